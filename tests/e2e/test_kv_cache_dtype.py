"""An FP8 KV cache across the disaggregated hand-off: served tokens equal the offline engine's
on the same cache at a quarter of float32's bytes moved, and a prefill and a decode worker
that disagree on the cache dtype are refused before any byte moves, the prefill pin freed."""

from __future__ import annotations

import grpc
import pytest

from pdserve import LLM, SamplingParams
from pdserve.types.engine_config import EngineConfig
from pdserve.v1 import inference_pb2
from tests.e2e.deployment import Deployment

pytestmark = pytest.mark.slow
FP8 = EngineConfig(kv_cache_dtype="fp8_e4m3")
PROMPT = list(range(3, 40))


def _idle(workers) -> bool:
    return len(workers) == 2 and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in workers)


def test_fp8_kv_over_disaggregation_moves_a_quarter_of_the_bytes_and_equals_offline(checkpoints, etcd_url):
    path, _ = checkpoints("llama")
    want = LLM(str(path), kv_cache_dtype="fp8_e4m3").generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name="e2e-fp8-kv",
        disaggregation="always",
        prefill_fields={"engine": FP8},
        decode_fields={"engine": FP8},
    )
    try:
        result = deployment.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
        assert result["token_ids"] == want.token_ids
        b = result["final"].breakdown
        assert b.disaggregated
        # 37 tokens in 3 blocks of 16; a token is 2 layers x (K, V) x 2 heads x 16 values, 1 byte each
        # (float32: 4 bytes each).
        assert b.kv_transfer_bytes == 3 * 16 * 2 * 2 * 2 * 16
        deployment.wait_registered(_idle, 10, "every block free")
    finally:
        deployment.close()


def test_a_cache_dtype_mismatch_is_refused_before_anything_moves(checkpoints, etcd_url):
    path, _ = checkpoints("llama")
    deployment = Deployment(
        str(path),
        etcd_url,
        prefill=1,
        decode=1,
        model_name="e2e-fp8-mismatch",
        disaggregation="always",
        prefill_fields={"engine": FP8},
    )
    try:
        request = inference_pb2.GenerateRequest(
            model="e2e-fp8-mismatch",
            token_ids=inference_pb2.TokenIds(ids=PROMPT),
            sampling=inference_pb2.SamplingOptions(max_tokens=4, temperature=0),
        )
        with pytest.raises(grpc.RpcError) as error:
            list(deployment.stub.Generate(request, timeout=60))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype" in error.value.details() and "float8_e4m3fn" in error.value.details()
        # The decode worker never pulled: the frontend released the prefill worker's pin.
        deployment.wait_registered(_idle, 10, "the prefill pin released and every block free")
    finally:
        deployment.close()
