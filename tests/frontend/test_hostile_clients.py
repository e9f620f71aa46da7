"""What a hostile client gets from a real frontend, on both APIs: a clear refusal, fast, and the
frontend serving everyone else after.

- a reused gRPC ``request_id`` is refused while its request runs on, untouched;
- a prompt whose length alone proves it cannot fit is refused before it is tokenized;
- bodies nested past the decoder, or not UTF-8, get 400 and no traceback in the log;
- a client that trickles its headers is cut off at the header deadline, and one address past
  its connection cap is refused at once.
"""

from __future__ import annotations

import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2
import pytest

from pdserve.v1 import inference_pb2
from tests.frontend.fake_worker import Script
from tests.frontend.hostile import HostileTarget

KEY, OTHER_KEY = "sk-hostile-0", "sk-hostile-1"
TOKENS = tuple(range(40, 56))  # what the worker streams, 16 tokens, a gap between each
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def target(etcd_url, tmp_path_factory):
    model = f"org/hostile-{uuid.uuid4().hex[:8]}"
    served = HostileTarget(
        etcd_url,
        model,
        tmp_path_factory.mktemp("tokenizer"),
        Script(tokens=TOKENS, token_gap_s=0.05),
        *("--api-key", KEY, "--api-key", OTHER_KEY),
        *("--header-timeout", f"{HEADER_TIMEOUT_S}s", "--max-connections-per-client", str(MAX_CONNECTIONS)),
    )
    yield served
    served.close()


def _generate(target: HostileTarget, request_id: str, key: str = KEY) -> tuple[str, list[int], float]:
    """One streamed Generate: its status, the tokens it got, and when it ended (monotonic)."""
    request = inference_pb2.GenerateRequest(
        model=target.model,
        token_ids=inference_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=inference_pb2.SamplingOptions(max_tokens=len(TOKENS)),
        request_id=request_id,
    )
    tokens: list[int] = []
    try:
        for response in target.stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {key}")]):
            tokens += response.token_ids
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}", tokens, time.monotonic()
    return "OK", tokens, time.monotonic()


def _post(target: HostileTarget, path: str, content: bytes) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx2.post(f"{target.http_url}{path}", content=content, headers=headers, timeout=30)


def test_a_request_id_in_use_is_refused_and_the_request_holding_it_completes(target):
    """8 requests of one caller share an id: one streams all its tokens, 7 are refused at
    once. The same id from another caller (another key) is that caller's own, and runs."""
    with ThreadPoolExecutor(9) as pool:
        first = pool.submit(_generate, target, "shared-1")
        time.sleep(0.3)  # in flight
        started = time.monotonic()
        repeats = [pool.submit(_generate, target, "shared-1") for _ in range(7)]
        other = pool.submit(_generate, target, "shared-1", OTHER_KEY)
        status, tokens, _ = first.result(30)
        refused = [repeat.result(30) for repeat in repeats]
        assert other.result(30)[:2] == ("OK", list(TOKENS))
    assert (status, tokens) == ("OK", list(TOKENS))
    for status, tokens, ended in refused:
        assert status.startswith("INVALID_ARGUMENT") and "'shared-1' is already in use" in status, status
        assert not tokens and ended - started < 0.5
    ids = [d.request_id for d in target.worker.decodes]
    assert all(i.startswith("shared-1-") for i in ids[-2:]) and ids[-1] != ids[-2]  # never the caller's id alone
    assert _generate(target, "shared-1")[:2] == ("OK", list(TOKENS))  # free again once its request ended


def test_a_prompt_of_megabytes_is_refused_before_tokenizing_and_the_frontend_serves_after(target):
    huge = "The quick brown fox. " * 150_000  # 3.1 M characters
    started = time.monotonic()
    answer = _post(target, "/completions", f'{{"model": "{target.model}", "prompt": "{huge}"}}'.encode())
    took = time.monotonic() - started
    error = answer.json()["error"]
    assert answer.status_code == 400 and "max_model_len" in error["message"], error
    assert took < 0.5, took  # tokenizing it takes seconds
    request = inference_pb2.GenerateRequest(model=target.model, text=huge)
    with pytest.raises(grpc.RpcError) as refused:
        list(target.stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in refused.value.details()
    normal = _post(target, "/completions", f'{{"model": "{target.model}", "prompt": "Hello"}}'.encode())
    assert normal.status_code == 200 and normal.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_bodies_nested_too_deeply_or_not_utf8_get_400_naming_it_and_no_traceback(target, path):
    nested = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b', "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    field = b'"prompt"' if path == "/completions" else b'"messages": [{"role": "user", "content"'
    closing = b"}" if path == "/completions" else b"}]}"
    not_utf8 = b"{" + field + b': "caf\xe9 \xff"' + closing
    logged = len(target.lines)
    for body, problem in ((nested, "nested too deeply"), (not_utf8, "not valid UTF-8")):
        answer = _post(target, path, body)
        error = answer.json()["error"]
        assert answer.status_code == 400 and problem in error["message"], (body[:60], answer.text[:300])
    time.sleep(0.2)  # the log lines of those requests, if any, are in
    assert "Traceback" not in "".join(target.lines[logged:])
    assert _post(target, "/completions", f'{{"model": "{target.model}", "prompt": "Hi"}}'.encode()).status_code == 200


def _closed_within(sock: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before it closed the connection, or None if it is still open."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def test_a_client_trickling_its_headers_is_cut_off_at_the_deadline(target):
    with socket.create_connection(("127.0.0.1", target.http_port)) as sock:
        started = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        sent = 0
        closed_at = None
        while closed_at is None and time.monotonic() - started < HEADER_TIMEOUT_S * 5:
            try:
                sock.sendall(request[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            if _closed_within(sock, 0.1) is not None:
                closed_at = time.monotonic()
        assert closed_at is not None, "the connection stayed open"
        assert HEADER_TIMEOUT_S * 0.9 < closed_at - started < HEADER_TIMEOUT_S + 1.5, closed_at - started
    assert httpx2.get(target.http_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_connections_past_the_cap_for_one_address_are_refused_at_once(target):
    held = [socket.create_connection(("127.0.0.1", target.http_port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # accepted and counted
        with socket.create_connection(("127.0.0.1", target.http_port)) as extra:
            started = time.monotonic()
            answer = _closed_within(extra, HEADER_TIMEOUT_S / 2)
            assert answer is not None and time.monotonic() - started < 0.4, answer
            assert answer.startswith(b"HTTP/1.1 429") and b"max_connections_per_client" in answer, answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)  # their places are given back
    assert httpx2.get(target.http_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
