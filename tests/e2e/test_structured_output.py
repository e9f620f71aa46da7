"""Structured outputs served: the official ``openai`` SDK's structured-output parsing against a
real frontend + prefill + decode deployment (``--disaggregation always``); greedy output under a
grammar is the same offline, colocated (a second frontend with ``--disaggregation off``, the
decode worker computing the prompt) and disaggregated (the prefill worker samples the first
token under the mask, the decode worker rebuilds the matcher from the tokens it receives), and
across a migration (a decode worker SIGKILLed mid-stream: the next one replays the grammar over
the tokens so far); a bad schema is a 400 naming the problem, before any worker is used.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Annotated, Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest

from pdserve import LLM, SamplingParams
from pdserve.launch.supervisor import RestartPolicy
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.structured_output import StructuredOutput
from pdserve.v1 import inference_pb2
from tests.e2e.deployment import Deployment, Frontend, collect

pytestmark = pytest.mark.slow
MODEL = "e2e-structured"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GRAMMAR = 'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[1-9]/'
# Long enough that every stream is mid-output when a decode worker dies: 200 items, ~400 tokens.
LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 200,
    "maxItems": 200,
}
MESSAGES_BEFORE_KILL = 4


class Person(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=6)]
    age: Annotated[int, pydantic.Field(ge=0, le=99)]
    role: Literal["admin", "user", "guest"]
    active: bool


# What the SDK sends for Person (its strict form): no properties besides these.
PERSON_SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def served(checkpoints, etcd_url, tmp_path_factory):
    source = checkpoints("llama")[0]
    path = tmp_path_factory.mktemp("structured-llama")
    for file in source.iterdir():
        if file.name != "tokenizer_config.json":
            (path / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=2,
        model_name=MODEL,
        disaggregation="always",
        restart=RestartPolicy(),
    )
    yield deployment, path
    deployment.close()


def _client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.http_url, api_key="unused", max_retries=0, timeout=120)


def _request(prompt: list[int], spec: dict, max_tokens: int = 200) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=MODEL,
        token_ids=inference_pb2.TokenIds(ids=prompt),
        sampling=inference_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0, **spec),
    )


def test_the_sdks_parsed_response_validates_against_its_schema(served):
    deployment, _ = served
    client = _client(deployment)
    for content in ("Who is here?", "Describe one user.", "Hello, world!"):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": content}], response_format=Person, max_tokens=100
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())
        assert completion.model_extra["pdserve"]["choices"][0]["disaggregated"] is True
    # Streamed, the schema as a plain json_schema response_format: the chunks join into valid JSON.
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format=response_format,
        max_tokens=100,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))
    # json_object: an object begins, whatever the random model then puts in its strings.
    anything = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON"}],
        response_format={"type": "json_object"},
        max_tokens=8,
    )
    assert anything.choices[0].message.content.startswith("{")


def test_a_bad_schema_is_a_400_naming_the_problem(served):
    deployment, _ = served
    client = _client(deployment)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "zero"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=bad, max_tokens=5
        )
    assert "json_schema: Expected f64 for 'minimum'" in error.value.message
    with pytest.raises(grpc.RpcError) as rpc_error:
        collect(deployment.stub.Generate(_request([5, 6, 7], {"regex": "(unclosed"}), timeout=30))
    assert rpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex:" in rpc_error.value.details()


def test_greedy_output_is_the_same_offline_colocated_and_disaggregated(served, etcd_url):
    deployment, path = served
    tokenizer = Tokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(text) for text in ("hello world", "the quick brown fox", "Numbers: 1 2 3")]
    specs = [
        {"json_schema": json.dumps(PERSON_SCHEMA)},
        {"regex": r"(yes|no), [0-9]{2,4}"},
        {"choice": inference_pb2.StructuredChoice(options=["red", "green", "blue"])},
        {"grammar": GRAMMAR},
    ]
    offline_specs = [
        StructuredOutput(json_schema=specs[0]["json_schema"]),
        StructuredOutput(regex=specs[1]["regex"]),
        StructuredOutput(choice=("red", "green", "blue")),
        StructuredOutput(grammar=GRAMMAR),
    ]
    cases = [(prompt, spec, offline) for prompt in prompts for spec, offline in zip(specs, offline_specs)]
    llm = LLM(str(path))
    want = llm.generate(
        [prompt for prompt, _, _ in cases],
        [SamplingParams(max_tokens=200, temperature=0, structured=offline) for _, _, offline in cases],
    )
    colocated = Frontend(etcd_url, "--disaggregation", "off")
    try:
        for (prompt, spec, _), expected in zip(cases, want):
            assert expected.finish_reason == "stop"
            split = collect(deployment.stub.Generate(_request(prompt, spec), timeout=120))
            local = collect(colocated.stub.Generate(_request(prompt, spec), timeout=120))
            assert split["token_ids"] == expected.token_ids and split["final"].breakdown.disaggregated
            assert local["token_ids"] == expected.token_ids and not local["final"].breakdown.disaggregated
            assert split["final"].finish_reason == local["final"].finish_reason == "stop"
    finally:
        colocated.close()


def test_a_migration_mid_output_keeps_the_grammar(served):
    deployment, path = served
    tokenizer = Tokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(f"List {i} digits:") for i in range(4)]
    spec = {"json_schema": json.dumps(LONG_SCHEMA)}
    params = SamplingParams(max_tokens=480, temperature=0, structured=StructuredOutput(**spec))
    want = LLM(str(path)).generate(prompts, params)
    victim = deployment.worker("decode", 0)
    reached = [threading.Event() for _ in prompts]  # stream i is mid-output
    killed = threading.Event()
    results: list[object] = [None] * len(prompts)

    def one(i: int) -> None:
        tokens: list[int] = []
        final = None
        try:
            for n, response in enumerate(deployment.stub.Generate(_request(prompts[i], spec, 480), timeout=240)):
                tokens += response.token_ids
                if n == MESSAGES_BEFORE_KILL:
                    reached[i].set()
                    killed.wait(120)  # every stream is on a worker, mid-output, when one dies
                if response.HasField("final"):
                    final = response.final
            results[i] = (tokens, final)
        except grpc.RpcError as exc:
            results[i] = (tokens, f"{exc.code().name}: {exc.details()}")
        finally:
            reached[i].set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for event in reached:
        assert event.wait(120), "a stream never got going"
    assert not any(results), results  # none ended before the kill
    deployment.kill(victim, signal.SIGKILL)
    killed.set()
    for thread in threads:
        thread.join(240)
    migrated = 0
    for (tokens, final), expected in zip(results, want):
        assert isinstance(final, inference_pb2.Final), final
        assert tokens == expected.token_ids and final.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), LONG_SCHEMA)
        migrated += final.breakdown.migrations
    assert migrated, "no stream was on the killed worker"
