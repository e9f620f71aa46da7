"""The public ``pdserve.v1.Inference`` service on the frontend: a gRPC adapter over the ``Gateway``.

``Generate`` admits the request (queue limit, validation, the caller's ``request_id`` not in
use by its own requests: ``Gateway``) and streams its flow; a refusal or a
failure becomes a gRPC status whose message names the cause. Cancelling the call cancels the
flow, which cancels the worker calls, which abort the request on the workers. The caller's API
key (its ``authorization`` metadata) names its prefix-cache salt when salts come from keys.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.frontend.attempt import FlowError
from pdserve.frontend.auth import ApiKeys
from pdserve.frontend.gateway import Gateway, Rejected
from pdserve.v1 import inference_pb2, inference_pb2_grpc

INFERENCE_SERVICE = "pdserve.v1.Inference"


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, gateway: Gateway, keys: ApiKeys) -> None:
        self.gateway = gateway
        self.keys = keys

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    name=m.name,
                    max_model_len=m.max_model_len,
                    vocab_size=m.vocab_size,
                    prefill_workers=m.num_prefill,
                    decode_workers=m.num_decode,
                )
                for m in self.gateway.models().values()
            ]
        )

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            caller = self._caller(context)
            admitted = await self.gateway.admit(
                request, context.time_remaining(), caller=caller, key_salt=self.keys.cache_salt(caller)
            )
        except Rejected as exc:
            await context.abort(exc.code, exc.message)
        try:
            async for response in admitted.responses():
                yield response
        except FlowError as exc:
            await context.abort(exc.code, exc.message)

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """Whose ``request_id`` names are these: the key the call carries (the interceptor let
        it through), ``""`` for every caller alike when the frontend has no keys."""
        authorization = dict(context.invocation_metadata() or ()).get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        return self.keys.identify(authorization) or ""
