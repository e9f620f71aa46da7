"""DeepSeek-V3 (MLA latent KV, MoE) over the disaggregated path: 32 concurrent greedy streams."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import LLM, SamplingParams
from tests.e2e.deployment import Deployment
from tests.e2e.prompts import shared_prefix_prompts
from tests.utils.checkpoints import reference_greedy

pytestmark = pytest.mark.slow


def test_deepseek_v3_greedy_tokens_over_disaggregation_equal_the_offline_engine(checkpoints, etcd_url):
    path, hf_model = checkpoints("deepseek_v3")
    prompts = shared_prefix_prompts(32, seed=3)
    expected = LLM(str(path)).generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    reference, clear = reference_greedy(hf_model, prompts[0], 10)
    assert clear >= 5 and expected[0].token_ids[:clear] == reference[:clear]
    deployment = Deployment(
        str(path), etcd_url, prefill=1, decode=1, model_name="e2e-deepseek-v3", disaggregation="always"
    )
    try:
        with ThreadPoolExecutor(32) as pool:
            results = list(
                pool.map(lambda p: deployment.generate(p, max_tokens=10, temperature=0, ignore_eos=True), prompts)
            )
        for prompt, result, want in zip(prompts, results, expected):
            assert result["token_ids"] == want.token_ids, prompt
            b = result["final"].breakdown
            assert b.disaggregated and b.prefill_worker != b.decode_worker and b.kv_transfer_bytes > 0
        assert sum(r["final"].usage.cached_prompt_tokens for r in results) > 0
        deployment.wait_registered(
            lambda ws: len(ws) == 2 and all(w.load.kv_blocks_used == 0 and w.load.held_requests == 0 for w in ws),
            10,
            "every block free",
        )
    finally:
        deployment.close()
