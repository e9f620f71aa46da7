"""The OpenAI-compatible HTTP API end to end, with the official ``openai`` SDK as the client.

One deployment (1 prefill + 1 decode worker of a tiny Llama whose tokenizer_config.json has a
chat template, ``--disaggregation always``, an API key) is shared by the tests here; each test
leaves it idle and whole. The HTTP API drives the same gateway as gRPC: greedy text equals the
offline engine's.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx2
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve import LLM, SamplingParams
from pdserve.frontend.cache_salt import key_salt
from pdserve.text.chat_template import load_chat_template, load_special_tokens, render_chat
from pdserve.text.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2
from tests.e2e import fuzz
from tests.e2e.deployment import Deployment, Frontend
from tests.utils.checkpoints import VOCAB

pytestmark = pytest.mark.slow
MODEL = "e2e-openai"
KEY = "sk-test-0123456789"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[sys]{{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world! How are you?"}]
GREEDY = {"max_tokens": 8, "temperature": 0}
LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def served(checkpoints, etcd_url, tmp_path_factory):
    source = checkpoints("llama")[0]
    path = tmp_path_factory.mktemp("chat-llama")
    for file in source.iterdir():
        if file.name not in ("tokenizer_config.json", "config.json"):
            (path / file.name).symlink_to(file)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    # A longer context than the checkpoint's (same weights), so that a request can outlast a client.
    config = json.loads((source / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    deployment = Deployment(
        str(path), etcd_url, prefill=1, decode=1, model_name=MODEL, disaggregation="always", api_keys=(KEY,)
    )
    yield deployment, path
    deployment.close()


def _idle(workers) -> bool:
    return len(workers) == 2 and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in workers)


def _client(deployment: Deployment, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.http_url, api_key=key, max_retries=0, timeout=60)


def test_sdk_completions_and_chat_greedy_text_equals_the_offline_engine(served):
    deployment, path = served
    client = _client(deployment)
    llm = LLM(str(path))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = "The quick brown fox"
    want = llm.generate([prompt], greedy)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **GREEDY)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 8 and got.usage.prompt_tokens == len(
        Tokenizer.from_pretrained(path).encode(prompt)
    )
    assert got.model_extra["pdserve"]["choices"][0]["disaggregated"] is True
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices

    # Chat: the template's text, tokenized without adding special tokens, as transformers does.
    text = render_chat(load_chat_template(path), MESSAGES, special_tokens=load_special_tokens(path))
    ids = Tokenizer.from_pretrained(path).encode(text, add_special_tokens=False)
    want = llm.generate([ids], greedy)[0]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True}, **GREEDY)
    assert chat.choices[0].message.content == want.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length" and "pdserve" in chunks[-1].model_extra
    deployment.wait_registered(_idle, 10, "every block free")


def test_logprobs_equal_the_offline_engine_in_both_shapes_streamed_or_not(served):
    # The first token's logprobs come from the prefill worker, the rest from decode.
    deployment, path = served
    client = _client(deployment)
    tokenizer = Tokenizer.from_pretrained(path)
    prompt = "The quick brown fox"
    want = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))[
        0
    ]
    want_tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]

    def check(tokens, logprobs, tops) -> None:
        assert tokens == want_tokens
        assert logprobs == pytest.approx([w.token_logprob for w in want.logprobs], abs=1e-4)
        # Tokens of one text (a lone byte's "\ufffd") share a key, as in OpenAI's own shape.
        want_tops = [
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in reversed(w.top)} for w in want.logprobs
        ]
        assert len(tops) == len(want_tops)
        for top, want_top in zip(tops, want_tops):
            assert top == pytest.approx(want_top, abs=1e-4)

    kwargs = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    got = client.completions.create(**kwargs).choices[0].logprobs
    check(got.tokens, got.token_logprobs, got.top_logprobs)
    assert got.text_offset == [sum(map(len, want_tokens[:i])) for i in range(len(want_tokens))]
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs) if c.choices]
    check(
        [t for c in chunks if c for t in c.tokens],
        [v for c in chunks if c for v in c.token_logprobs],
        [t for c in chunks if c for t in c.top_logprobs],
    )

    text = render_chat(load_chat_template(path), MESSAGES, special_tokens=load_special_tokens(path))
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = LLM(str(path)).generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))[0]
    want_tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    check(
        [c.token for c in content],
        [c.logprob for c in content],
        [{t.token: t.logprob for t in reversed(c.top_logprobs)} for c in content],
    )
    assert content[0].bytes == list(content[0].token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    deployment.wait_registered(_idle, 10, "every block free")


def test_several_prompts_and_choices_and_the_models_list(served):
    deployment, _ = served
    client = _client(deployment)
    got = client.completions.create(
        model=MODEL, prompt=["Hello", "The dog"], n=2, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[1].text and got.choices[2].text == got.choices[3].text  # greedy
    assert got.usage.completion_tokens == 32
    # Seeded choices differ from each other (choice j samples with seed + j), and repeat.
    sampled = {"max_tokens": 8, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    seeded = [c.text for c in client.completions.create(model=MODEL, prompt="Hello", n=3, seed=5, **sampled).choices]
    assert len(set(seeded)) == 3
    alone = [
        client.completions.create(model=MODEL, prompt="Hello", seed=5 + j, **sampled).choices[0].text for j in range(3)
    ]
    assert seeded == alone
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert [c.finish_reason for c in ids.choices] in (
        ["length", "length"],
        ["length", "stop"],
        ["stop", "length"],
        ["stop", "stop"],
    )
    assert ids.usage.prompt_tokens == 5
    echoed = client.completions.create(model=MODEL, prompt="Hello", echo=True, max_tokens=2, temperature=0)
    assert echoed.choices[0].text.startswith("Hello")
    assert MODEL in [m.id for m in client.models.list()]


def test_a_wrong_or_missing_key_is_refused_on_both_apis_and_health_stays_open(served):
    deployment, _ = served
    with pytest.raises(openai.AuthenticationError):
        _client(deployment, "sk-wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert httpx2.post(f"{deployment.http_url}/completions", json={"prompt": "Hi"}).status_code == 401
    assert httpx2.get(deployment.http_url.removesuffix("/v1") + "/health").status_code == 200
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        token_ids=inference_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=inference_pb2.SamplingOptions(max_tokens=2),
    )
    for metadata in (None, [("authorization", "Bearer sk-wrong")], [("authorization", KEY)]):
        with pytest.raises(grpc.RpcError) as error:
            list(deployment.stub.Generate(request, timeout=10, metadata=metadata))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED and KEY not in (error.value.details() or "")
    answer = list(deployment.stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
    assert answer[-1].final.usage.completion_tokens == 2
    health = health_pb2_grpc.HealthStub(deployment.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING


def _cached(answer) -> int:
    details = answer.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def _salted_prompt() -> list[int]:
    """49 tokens (three full blocks of 16, and one more) no other test sends."""
    return [int(t) for t in np.random.default_rng().integers(3, VOCAB, size=49)]


def test_a_cache_salt_shares_cached_prompts_only_with_the_same_salt(served):
    deployment, _ = served
    client = _client(deployment)
    prefill = next(w for w in deployment.registered() if w.role == "prefill")
    before = deployment.worker_metrics(prefill)["pdserve_cached_prompt_tokens_total"]
    prompt = _salted_prompt()

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        return _cached(client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **GREEDY))

    # Cached under salt a, the prompt is a miss under b and unsalted, a hit under a again.
    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("tenant-a"), cached("tenant-b")] == [
        0,
        0,
        0,
        48,
        48,
    ]
    assert deployment.worker_metrics(prefill)["pdserve_cached_prompt_tokens_total"] - before == 96
    messages = [{"role": "user", "content": f"salted chat {prompt}"}]

    def chat_cached(salt: str) -> int:
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"cache_salt": salt}, **GREEDY
        )
        return _cached(answer)

    assert chat_cached("tenant-a") == 0 and chat_cached("tenant-b") == 0 and chat_cached("tenant-a") > 0
    empty = _post(deployment, "/completions", {"model": MODEL, "prompt": prompt, "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
    deployment.wait_whole(timeout=10)


def test_salts_from_keys_isolate_tenants_that_send_none_or_each_others(served, etcd_url, tmp_path):
    deployment, _ = served
    keys = ["sk-tenant-a-0123456789", "sk-tenant-b-0123456789"]
    key_file = tmp_path / "keys"
    key_file.write_text("\n".join(keys) + "\n")
    frontend = Frontend(
        etcd_url, "--api-key-file", str(key_file), "--cache-salt-from-key", "--disaggregation", "always"
    )
    try:
        a, b = (openai.OpenAI(base_url=frontend.http_url, api_key=k, max_retries=0, timeout=60) for k in keys)
        prompt = _salted_prompt()

        def cached(client: openai.OpenAI, salt: str | None = None) -> int:
            extra = {"cache_salt": salt} if salt is not None else None
            return _cached(client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **GREEDY))

        assert cached(a) == 0
        assert cached(b) == 0  # same prompt, no salt sent: b's key keeps it apart
        assert cached(b, key_salt(keys[0])) == 0  # naming a's salt does not reach a's cache
        assert cached(a) == 48 and cached(b) == 48
        assert cached(a, "x") == 0 and cached(a, "x") == 48  # a tenant may split its own cache further
        # gRPC derives the same salts from the same keys.
        for key, salt, expected in ((keys[1], "", 48), (keys[0], "y", 0), (keys[0], "x", 48)):
            request = inference_pb2.GenerateRequest(
                model=MODEL,
                token_ids=inference_pb2.TokenIds(ids=prompt),
                sampling=inference_pb2.SamplingOptions(max_tokens=2),
                cache_salt=salt,
            )
            answer = list(frontend.stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {key}")]))
            assert answer[-1].final.usage.cached_prompt_tokens == expected
    finally:
        frontend.close()
    deployment.wait_whole(timeout=10)


def _post(deployment: Deployment, path: str, body: object, **kwargs) -> httpx2.Response:
    kwargs.setdefault("timeout", 60)
    return httpx2.post(f"{deployment.http_url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, **kwargs)


def test_errors_have_openai_shape_and_status_and_name_the_field(served):
    deployment, _ = served
    cases = [
        ("/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
        ("/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/completions", {"prompt": [1, 2, 320]}, 400, "prompt"),
        ("/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
        ("/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
        ("/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ("/completions", {"model": "no-such-model", "prompt": "Hi"}, 404, "model"),
        ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("/chat/completions", {"messages": MESSAGES, "max_tokens": 100000}, 400, "max_tokens"),
    ]
    for path, body, status, param in cases:
        answer = _post(deployment, path, body)
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (status, param), (body, error)
        assert error["message"] and error["type"]
    assert _post(deployment, "/completions", None, content=b"{not json").status_code == 400
    huge = _post(deployment, "/completions", {"prompt": "x" * (17 * 2**20)})
    assert huge.status_code == 413 and "max_request_bytes" in huge.json()["error"]["message"]
    assert (
        httpx2.get(deployment.http_url + "/nothing-here", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    )
    assert not deployment.cluster.exited()


def test_past_the_queue_limit_429_and_without_workers_503(served, etcd_url, etcd_server):
    deployment, _ = served
    frontend = Frontend(etcd_url, "--max-queued-requests", "1", "--disaggregation", "always", "--api-key", KEY)
    try:
        body = {
            "model": MODEL,
            "prompt": [3, 4, 5],
            "max_tokens": LONG_CONTEXT - 100,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx2.stream("POST", f"{frontend.http_url}/completions", json=body, headers=headers, timeout=60) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the response, and the server aborts it
            line = next(line for line in lines if line.startswith("data: "))
            assert json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] is None, line  # in flight
            refused = httpx2.post(f"{frontend.http_url}/completions", json=body, headers=headers, timeout=30)
            assert refused.status_code == 429 and "max_queued_requests" in refused.json()["error"]["message"], (
                refused.text[:2000]
            )
    finally:
        frontend.close()
    empty = Frontend(etcd_server.url)  # a registry without any worker
    try:
        answer = httpx2.post(f"{empty.http_url}/completions", json={"prompt": "Hi"}, timeout=30)
        assert answer.status_code == 503 and "no workers" in answer.json()["error"]["message"]
    finally:
        empty.close()
    deployment.wait_registered(_idle, 10, "every block free")


def test_a_key_past_its_rate_gets_429_on_http_and_resource_exhausted_on_grpc(served, etcd_url):
    frontend = Frontend(
        etcd_url, "--api-key", KEY, "--api-key", "sk-other", "--rate-limit", "0.2", "--rate-limit-burst", "2"
    )
    try:

        def models(key: str) -> httpx2.Response:
            return httpx2.get(f"{frontend.http_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)

        assert [models(KEY).status_code for _ in range(2)] == [200, 200]
        refused = models(KEY)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(grpc.RpcError) as error:  # the same key's budget, on the other API
            frontend.stub.ListModels(
                inference_pb2.ListModelsRequest(), timeout=10, metadata=[("authorization", f"Bearer {KEY}")]
            )
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate" in error.value.details()
        assert models("sk-other").status_code == 200  # another key has its own
    finally:
        frontend.close()


def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(served):
    deployment, _ = served
    body = {"prompt": list(range(2, 60)), "max_tokens": LONG_CONTEXT - 100, "ignore_eos": True, "temperature": 0}
    busy = "the decode worker busy"
    with httpx2.stream(
        "POST",
        f"{deployment.http_url}/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        deployment.wait_registered(
            lambda ws: any(w.role == "decode" and w.load.kv_blocks_used > 0 for w in ws), 10, busy
        )
    deployment.wait_registered(_idle, 10, "every block free after the streaming client left")

    # Not streaming: the client gives up while the request still runs.
    with pytest.raises(httpx2.TimeoutException):
        _post(deployment, "/completions", body, timeout=httpx2.Timeout(60, read=2))
    deployment.wait_registered(_idle, 10, "every block free after the waiting client left")


def test_a_huge_prompt_is_refused_before_it_is_tokenized(served):
    """2 M characters: tokenizing them took this frontend ~10 s. Their count alone proves they
    cannot fit the context window (no token of the vocabulary is longer than a few characters),
    so they are refused at once. (A prompt that is tokenized is tokenized off the event loop:
    ``tests/frontend/test_catalog.py``.)"""
    deployment, _ = served
    started = time.monotonic()
    answer = _post(deployment, "/completions", {"prompt": "Hello world, the quick brown fox. " * 60_000})
    took = time.monotonic() - started
    assert answer.status_code == 400 and "max_model_len" in answer.json()["error"]["message"], answer.text[:500]
    assert took < 1.0, took


_FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _check_http(answer: httpx2.Response) -> None:
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, (answer.status_code, answer.text[:500])
    if answer.status_code != 200:
        assert answer.json()["error"]["message"]
    elif answer.headers["content-type"].startswith("text/event-stream"):
        assert answer.text.rstrip().endswith("data: [DONE]")


@_FUZZ
@given(body=fuzz.completion_bodies(MODEL, VOCAB))
def test_fuzzed_completion_bodies_get_an_answer_or_a_4xx_with_a_message(served, body):
    _check_http(_post(served[0], "/completions", None, content=json.dumps(body).encode()))


@_FUZZ
@given(body=fuzz.chat_bodies(MODEL, VOCAB))
def test_fuzzed_chat_bodies_get_an_answer_or_a_4xx_with_a_message(served, body):
    _check_http(_post(served[0], "/chat/completions", None, content=json.dumps(body).encode()))


@_FUZZ
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_get_a_4xx_with_a_message(served, raw):
    _check_http(_post(served[0], "/completions", None, content=raw))


@_FUZZ
@given(request=fuzz.generate_requests(MODEL, VOCAB))
def test_fuzzed_grpc_requests_get_an_answer_or_a_client_error_with_a_message(served, request):
    metadata = [("authorization", f"Bearer {KEY}")]
    try:
        list(served[0].stub.Generate(request, timeout=60, metadata=metadata))
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), error
        assert error.details()


def test_after_fuzzing_every_process_is_up_and_every_block_free(served):
    deployment, _ = served
    assert not deployment.cluster.exited()
    deployment.wait_registered(_idle, 15, "every block free after fuzzing")
