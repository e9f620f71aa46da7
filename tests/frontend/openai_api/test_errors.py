"""gRPC failures become OpenAI errors with the matching HTTP status and the field named."""

from __future__ import annotations

import grpc
import pytest

from pdserve.frontend.openai_api.errors import ApiError


@pytest.mark.parametrize(
    ("code", "message", "status", "param"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 2", 400, "top_p"),
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty", 400, "prompt"),
        (grpc.StatusCode.NOT_FOUND, "model: 'x' is not served here", 404, "model"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "9 requests in flight", 429, None),
        (grpc.StatusCode.UNAVAILABLE, "no decode worker is available for model 'm'", 503, None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "request r passed its deadline", 504, None),
        (grpc.StatusCode.INTERNAL, "boom", 500, None),
    ],
)
def test_status_and_field(code, message, status, param):
    error = ApiError.from_grpc(code, message)
    body = error.body()["error"]
    assert (error.status, body["param"]) == (status, param)
    assert body["message"] == message.removeprefix("sampling.") and body["type"]
