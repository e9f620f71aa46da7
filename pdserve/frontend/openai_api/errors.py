"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with the
HTTP status that matches the gRPC status the same failure gets on the gRPC API."""

from __future__ import annotations

import re

import grpc
import msgspec
from starlette.responses import Response

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
# The field a pdserve message begins with: "prompt: ...", "sampling.top_p must be ...".
_FIELD = re.compile(r"^(?:sampling\.)?([a-z_]+)\b")


class ApiError(Exception):
    """A request refused or failed; ``status`` and the body go to the client."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        """The HTTP form of a gRPC failure; an INVALID_ARGUMENT message names its field first,
        as the gRPC API's does, less the ``sampling.`` prefix that HTTP bodies do not have."""
        status = _STATUS.get(code, 500)
        param = None
        if status == 400:
            message = message.removeprefix("sampling.")
            found = _FIELD.match(message)
            param = found.group(1) if found else None
        if status == 404:
            return cls(status, message, param="model", code="model_not_found")
        return cls(status, message, param=param)

    def body(self) -> dict[str, object]:
        kind = _TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return Response(
            msgspec.json.encode(self.body()), status_code=self.status, media_type="application/json", headers=headers
        )
