"""The whole engine on the Triton kernels (interpreted on CPU) gives the torch backend's
greedy tokens — the contract tests outside this repository rely on."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.utils.checkpoints import VOCAB


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_triton_kernels_give_the_torch_backends_greedy_tokens(checkpoints, arch):
    path, _ = checkpoints(arch)
    generator = torch.Generator().manual_seed(7)
    # 17 tokens cross a block boundary; the 5-token prompt shares the decode batch.
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (17, 5)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(str(path), kernels="torch").generate(prompts, params)
    triton_llm = LLM(str(path), kernels="triton")
    assert triton_llm.engine.backend.name == "triton"
    got = triton_llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    triton_llm.engine.check_idle_integrity()
