"""Which requests an engine can serve: a prompt (and a resumed request's generated tokens) in
the vocabulary, inside the context window with room for a token more, and within the KV cache.

Each check raises ValueError naming the field and its range; the engine raises it from
``add_request`` and ``check_request``, before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.model.model_config import ModelConfig
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    kv: KVCacheManager  # its pool's block count bounds a request's blocks

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (text is encoded), checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"prompt is text but {self.model_config.path} has no tokenizer.json; pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            for index, token in enumerate(token_ids):
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise ValueError(f"prompt token_ids[{index}] = {token!r} is outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but the context window (max_model_len) is "
                f"{self.max_model_len}, which must leave room for at least one generated token"
            )
        needed = self.kv.num_blocks_for(len(token_ids) + 1)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt needs {needed} KV blocks but the cache holds {self.kv.pool.num_blocks}; raise kv_cache_memory"
            )
        return token_ids

    def generated_token_ids(self, prompt: list[int], generated: list[int], params: SamplingParams) -> list[int]:
        """Check a resumed request's generated tokens: in the vocabulary, short of its limits."""
        vocab = self.model_config.vocab_size
        for index, token in enumerate(generated):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"generated_token_ids[{index}] = {token!r} is outside the vocabulary [0, {vocab})")
        if len(generated) >= params.max_tokens:
            raise ValueError(
                f"generated_token_ids has {len(generated)} tokens: max_tokens ({params.max_tokens}) leaves none to generate"
            )
        if len(prompt) + len(generated) >= self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)}) and generated_token_ids ({len(generated)}) fill the context window "
                f"(max_model_len {self.max_model_len}): no room for another token"
            )
        if self.kv.num_blocks_for(len(prompt) + len(generated) + 1) > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt and generated_token_ids need more than the cache's {self.kv.pool.num_blocks} KV blocks"
            )
        return list(generated)
