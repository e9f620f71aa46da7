"""Structured outputs and tool calls served: the official ``openai`` SDK's structured-output parsing against a
real frontend + prefill + decode deployment (``--disaggregation always``); greedy output under a
grammar is the same offline, colocated (a second frontend with ``--disaggregation off``, the
decode worker computing the prompt) and disaggregated (the prefill worker samples the first
token under the mask, the decode worker rebuilds the matcher from the tokens it receives), and
across a migration (a decode worker SIGKILLed mid-stream: the next one replays the grammar over
the tokens so far); a bad schema is a 400 naming the problem, before any worker is used.
Tool calls through the SDK: forced ones (named, required) parse against their function's schema,
streamed or not; ``auto`` reads the template's format; ``tool`` messages round-trip.
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
from pdserve.frontend.openai_api.tools import template_message
from pdserve.launch.supervisor import RestartPolicy
from pdserve.text.chat_template import load_chat_template, load_special_tokens, render_chat
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.structured_output import StructuredOutput
from pdserve.v1 import inference_pb2
from tests.e2e.deployment import Deployment, Frontend, collect

pytestmark = pytest.mark.slow
MODEL = "e2e-structured"
# Hermes-style tool calling (as Qwen's templates): tools listed up front, calls as <tool_call> JSON.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
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
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


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
        if file.name not in ("tokenizer_config.json", "config.json"):
            (path / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    # Room for the tools the template lists (the same weights, a longer context).
    config = json.loads((source / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
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


def _check_calls(calls, count: int | None = None) -> None:
    assert calls and (count is None or len(calls) == count), calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _streamed_calls(stream) -> tuple[list, str | None]:
    """The tool calls the stream's chunks carry, as the SDK's objects, and the finish reason."""
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    return calls, finish


def test_forced_tool_calls_parse_against_their_schema_streamed_or_not(served):
    deployment, _ = served
    client = _client(deployment)
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    # (Parallel calls are left out here: a random model, free to add calls, adds them until max_tokens.)
    for choice, parallel, count in ((named, None, 1), ("required", False, 1)):
        kwargs = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120}
        if parallel is not None:
            kwargs["parallel_tool_calls"] = parallel
        response = client.chat.completions.create(**kwargs)
        assert response.choices[0].finish_reason == "tool_calls", (choice, response.choices[0])
        _check_calls(response.choices[0].message.tool_calls, count)
        assert all(c.id.startswith("call_") and c.type == "function" for c in response.choices[0].message.tool_calls)
        calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert finish == "tool_calls"
        _check_calls(calls, count)
    assert response.choices[0].message.content is None


def test_auto_reads_the_templates_format_and_tool_messages_round_trip(served):
    deployment, path = served
    client = _client(deployment)
    # A random model does not call tools of itself: a regex makes it write the template's format.
    forced = {"guided_regex": r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'}
    messages = [{"role": "user", "content": "What time is it?"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=150, extra_body=forced
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time" and response.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    calls, finish = _streamed_calls(
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=150, stream=True, extra_body=forced
        )
    )
    assert [c.function.arguments for c in calls] == [call.function.arguments] and finish == "tool_calls"
    # The call and its result go back in: the template gets the arguments as an object.
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert again.choices[0].message.tool_calls is None
    rendered = render_chat(
        load_chat_template(path),
        [*messages, template_message(history[1]), history[2]],
        special_tokens=load_special_tokens(path),
        tools=TOOLS,
    )
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": ' in rendered
    assert again.usage.prompt_tokens == len(Tokenizer.from_pretrained(path).encode(rendered, add_special_tokens=False))


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
