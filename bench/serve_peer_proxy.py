"""vLLM's disaggregated serving for bench/serve_peer.py: a proxy in front of a prefill and a
decode ``vllm.entrypoints.openai.api_server``, both run with ``NixlConnector``.

Each completion request goes to the prefill server first with ``max_tokens`` 1 and
``kv_transfer_params`` asking it to keep the KV for a remote decode; the prefill server's
answer carries the KV's whereabouts (its own ``kv_transfer_params``), which go with the
original request to the decode server, whose answer (streamed or not) is the client's. This is
the flow of vLLM's disaggregated-serving examples, written here for the benchmark.

Runs under the vLLM environment's interpreter (Starlette, uvicorn and httpx come with vLLM):

    python -m bench.serve_peer_proxy --port 8100 --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# What a prefill-only request asks of the prefill server's NixlConnector.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_TIMEOUT_S = 600.0


def create_app(prefill_url: str, decode_url: str) -> Starlette:
    client = httpx.AsyncClient(timeout=_TIMEOUT_S)

    async def prefill(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Run the prompt on the prefill server; the KV's whereabouts for the decode server."""
        request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": _REMOTE_DECODE}
        request.pop("stream_options", None)
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        answer = await client.post(prefill_url + path, json=request)
        answer.raise_for_status()
        return answer.json().get("kv_transfer_params")

    async def forward(request: Request) -> Response:
        body = await request.json()
        path = request.url.path
        try:
            params = await prefill(path, body)
        except httpx.HTTPStatusError as exc:
            return Response(exc.response.content, exc.response.status_code, media_type="application/json")
        decode_request = client.build_request("POST", decode_url + path, json={**body, "kv_transfer_params": params})
        answer = await client.send(decode_request, stream=True)
        if not body.get("stream"):
            content = await answer.aread()
            await answer.aclose()
            return Response(content, answer.status_code, media_type="application/json")

        async def chunks():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(chunks(), answer.status_code, media_type="text/event-stream")

    async def models(request: Request) -> Response:
        answer = await client.get(decode_url + "/v1/models")
        return JSONResponse(answer.json(), answer.status_code)

    async def health(request: Request) -> Response:
        for url in (prefill_url, decode_url):
            if (await client.get(url + "/health")).status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    routes = [
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    args = parser.parse_args()
    uvicorn.run(create_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
