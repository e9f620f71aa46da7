"""The models the registry's workers serve, and the checks a request must pass before routing.

A request is validated once, here, so that a bad one never reaches a worker: the model must be
served, the prompt non-empty, inside the vocabulary and the context window, ``max_tokens``
within what the window leaves, and the sampling values valid (``SamplingParams`` names the
field), a structured output's schema, regex or grammar included (``check_structured``, on a
thread). Text prompts are tokenized here with the model's ``tokenizer.json`` (or a GGUF file's own), read from the
``model_path`` the workers registered (or ``--tokenizer``), so that routing sees the tokens; the
same tokenizer turns the workers' token ids into the client's text (``TextStream``).

Tokenizing is slow for a large prompt (seconds for megabytes), so it runs on a thread, off the
event loop that serves every other request: ``validate`` is a coroutine for that alone. Before
any of that work, a text is refused when it is longer than ``max_prompt_chars``, or when its
length alone proves it cannot fit the context window: no token of the vocabulary stands for
more than ``Tokenizer.max_token_chars`` characters, so a text of more than
``(max_model_len - 1) * max_token_chars`` has too many tokens. (A tokenizer whose normalizer
deletes characters would break that proof; none of the Llama, Qwen, Mistral, DeepSeek or
SmolLM tokenizers has one.) The text then waits for room in the ``CharBudget``, which bounds
the characters tokenized at once across requests, and so the frontend's memory. Reading a tokenizer takes
~100 ms, so it also runs on a thread, once per file, started when the model's first worker
joins (``preload``): no request, token ids included, waits for it then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.discovery.registry import Role, WorkerEntry
from pdserve.frontend.char_budget import CharBudget
from pdserve.rpc.sampling import sampling_params
from pdserve.text.grammar import check_structured
from pdserve.text.tokenizer import Tokenizer, find_tokenizer
from pdserve.types.sampling_params import SamplingParams
from pdserve.v1 import inference_pb2

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The request can never be served as sent; the message names the field."""


class UnknownModel(InvalidRequest):
    """The request names a model no worker serves."""


class ModelUnavailable(RuntimeError):
    """No worker serves any model right now."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    num_prefill: int
    num_decode: int


@dataclass(frozen=True)
class ValidRequest:
    model: ModelInfo
    token_ids: list[int]
    params: SamplingParams  # stop strings included: the frontend applies them
    options: inference_pb2.SamplingOptions  # forwarded to the workers: as sent, less the stop strings
    tokenizer: Tokenizer | None  # None: the completion has no text, and stop strings cannot match
    cache_salt: str | None = None  # the prefix-cache salt it runs under (``cache_salt.combine``)


class ModelCatalog:
    def __init__(
        self, tokenizer_path: str | None = None, max_prompt_chars: int | None = None, budget: CharBudget | None = None
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.max_prompt_chars = max_prompt_chars
        self.budget = budget  # None: no bound on the text tokenized at once
        self._tokenizers: dict[str, Tokenizer | None] = {}  # by file, once read
        self._reading: dict[str, asyncio.Future[Tokenizer | None]] = {}  # by file, while read

    @staticmethod
    def models(workers: Sequence[WorkerEntry]) -> dict[str, ModelInfo]:
        """Served models, with the tightest limits any of their workers has."""
        by_name: dict[str, list[WorkerEntry]] = {}
        for worker in workers:
            by_name.setdefault(worker.model, []).append(worker)
        return {
            name: ModelInfo(
                name=name,
                model_path=entries[0].model_path,
                max_model_len=min(w.max_model_len for w in entries),
                vocab_size=min(w.vocab_size for w in entries),
                num_prefill=sum(w.role is Role.PREFILL for w in entries),
                num_decode=sum(w.role is Role.DECODE for w in entries),
            )
            for name, entries in sorted(by_name.items())
        }

    def model(self, name: str, workers: Sequence[WorkerEntry]) -> ModelInfo:
        """The served model ``name`` (empty: the only one served); raises UnknownModel,
        InvalidRequest or ModelUnavailable."""
        models = self.models(workers)
        if not models:
            raise ModelUnavailable("no workers are registered")
        if name:
            if name not in models:
                raise UnknownModel(f"model: {name!r} is not served here; served: {sorted(models)}")
            return models[name]
        if len(models) == 1:
            return next(iter(models.values()))
        raise InvalidRequest(f"model: required when several models are served: {sorted(models)}")

    async def validate(
        self,
        request: inference_pb2.GenerateRequest,
        workers: Sequence[WorkerEntry],
        *,
        add_special_tokens: bool = True,
        fill_context: bool = False,
        cache_salt: str | None = None,
    ) -> ValidRequest:
        """The request, checked and tokenized. ``add_special_tokens``: False for a text that
        already holds them (a rendered chat template); ``fill_context``: a request without
        ``max_tokens`` may generate up to the end of the context window (OpenAI's chat);
        ``cache_salt``: the salt it runs under, carried along."""
        model = self.model(request.model, workers)
        token_ids = await self._prompt(request, model, add_special_tokens)
        room = model.max_model_len - len(token_ids)
        sampling = request.sampling
        if fill_context and not sampling.HasField("max_tokens"):
            sampling = inference_pb2.SamplingOptions()
            sampling.CopyFrom(request.sampling)
            sampling.max_tokens = room
        try:
            params = sampling_params(sampling)
            if params.structured is not None:  # compiling a large schema takes a while
                await asyncio.to_thread(check_structured, params.structured)
        except ValueError as exc:
            raise InvalidRequest(f"sampling.{exc}") from None
        if params.max_tokens > room:
            raise InvalidRequest(
                f"sampling.max_tokens = {params.max_tokens} exceeds the room the context window leaves: "
                f"max_model_len {model.max_model_len} - {len(token_ids)} prompt tokens = {room}"
            )
        options = inference_pb2.SamplingOptions()
        options.CopyFrom(sampling)
        options.ClearField("stop")
        tokenizer = await self.tokenizer(model.name, model.model_path)
        return ValidRequest(model, token_ids, params, options, tokenizer, cache_salt)

    async def _prompt(
        self, request: inference_pb2.GenerateRequest, model: ModelInfo, add_special_tokens: bool
    ) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("prompt: text is empty")
            if self.max_prompt_chars is not None and len(request.text) > self.max_prompt_chars:
                raise InvalidRequest(
                    f"prompt: {len(request.text)} characters, past the limit (max_prompt_chars) of "
                    f"{self.max_prompt_chars}"
                )
            tokenizer = await self.tokenizer(model.name, model.model_path)
            if tokenizer is None:
                raise InvalidRequest(f"prompt: model {model.name!r} has no tokenizer.json; send token_ids")
            token_ids = await self._encode(tokenizer, request.text, model, add_special_tokens)
        elif kind == "token_ids":
            token_ids = list(request.token_ids.ids)
            for index, token in enumerate(token_ids):
                if not 0 <= token < model.vocab_size:
                    raise InvalidRequest(
                        f"prompt: token_ids[{index}] = {token} is outside the vocabulary [0, {model.vocab_size})"
                    )
        else:
            raise InvalidRequest("prompt: set text or token_ids")
        if not token_ids:
            raise InvalidRequest("prompt: empty")
        if len(token_ids) >= model.max_model_len:
            raise InvalidRequest(
                f"prompt: {len(token_ids)} tokens, but the context window (max_model_len) is "
                f"{model.max_model_len} and must leave room for at least one generated token"
            )
        return token_ids

    async def _encode(self, tokenizer: Tokenizer, text: str, model: ModelInfo, add_special_tokens: bool) -> list[int]:
        """``text``'s tokens, on a thread, within the budget; refused at once when its length
        alone says it cannot fit the context window. Raises InvalidRequest or Busy."""
        longest = tokenizer.max_token_chars
        if len(text) > (model.max_model_len - 1) * longest:
            raise InvalidRequest(
                f"prompt: {len(text)} characters are at least {-(-len(text) // longest)} tokens (no token of the "
                f"model's vocabulary is longer than {longest} characters), but the context window (max_model_len) "
                f"is {model.max_model_len} tokens and must leave room for at least one generated token"
            )
        if self.budget is None:
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)
        charge = await self.budget.acquire(len(text))
        try:
            encoding = asyncio.get_running_loop().run_in_executor(None, tokenizer.encode, text, add_special_tokens)
        except BaseException:
            self.budget.release(charge)
            raise
        budget = self.budget
        encoding.add_done_callback(lambda _: budget.release(charge))  # when the thread is done, caller or not
        return await asyncio.shield(encoding)

    async def tokenizer(self, model: str, model_path: str) -> Tokenizer | None:
        """The model's tokenizer (None: it has none), read on a thread the first time; callers
        meanwhile wait for that one read."""
        key = str(Path(self.tokenizer_path or model_path))
        if key in self._tokenizers:
            return self._tokenizers[key]
        reading = self._reading.get(key)
        if reading is None or reading.get_loop() is not asyncio.get_running_loop():
            reading = self._reading[key] = asyncio.ensure_future(asyncio.to_thread(self._read, key, model))
        try:
            tokenizer = await asyncio.shield(reading)  # one caller cancelled does not cancel the read
        finally:
            if reading.done():
                self._reading.pop(key, None)
        self._tokenizers[key] = tokenizer
        return tokenizer

    async def preload(self, model: str, model_path: str) -> None:
        """Read the model's tokenizer now (a worker of it joined); a failure is logged, and
        the first request that needs it reads it again."""
        try:
            await self.tokenizer(model, model_path)
        except Exception:
            logger.exception("reading the tokenizer of %s from %s failed", model, self.tokenizer_path or model_path)

    @staticmethod
    def _read(path: str, model: str) -> Tokenizer | None:
        tokenizer = find_tokenizer(Path(path))
        if tokenizer is None:
            logger.warning(
                "no tokenizer at %s (tokenizer.json or a GGUF file): text prompts for %s are refused, completions have no text",
                path,
                model,
            )
        return tokenizer
