"""The whole engine on the Triton kernels (interpreted on CPU) gives the torch backend's
greedy tokens — the contract tests outside this repository rely on."""

from __future__ import annotations

import pytest
import torch

import pdserve.model.setup as model_setup
from pdserve import LLM, SamplingParams
from pdserve.kernels import block_fp8
from pdserve.kernels.block_fp8 import BlockFP8Weight
from pdserve.kernels.torch_backend import TorchBackend
from tests.utils.checkpoints import ARCHITECTURES, VOCAB
from tests.utils.fp8_checkpoint import write_fp8_deepseek_v3
from tests.utils.gguf_files import make_model, write_gguf


# A fixed, small KV cache: on a GPU the default takes most of the free memory, and the kit
# runs these tests side by side in several processes.
SMALL = dict(max_model_len=128, kv_cache_memory=2**22)


@pytest.fixture(autouse=True)
def _kernel_device():
    """Overrides the package's CUDA default device: these tests write checkpoints and draw
    prompts on the CPU, and the engine places itself."""
    yield


# Interpreted on CPU two architectures cover both attention kinds within CI's time; compiled
# on a GPU (bench/gpu_check.sh) every architecture runs.
PARITY_ARCHITECTURES = ARCHITECTURES if torch.cuda.is_available() else ("llama", "deepseek_v3")


@pytest.mark.slow
@pytest.mark.parametrize("arch", PARITY_ARCHITECTURES)
def test_triton_kernels_give_the_torch_backends_greedy_tokens(checkpoints, arch):
    path, _ = checkpoints(arch)
    generator = torch.Generator().manual_seed(7)
    # 17 tokens cross a block boundary; the 5-token prompt shares the decode batch.
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (17, 5)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(str(path), kernels="torch", **SMALL).generate(prompts, params)
    triton_llm = LLM(str(path), kernels="triton", **SMALL)
    assert triton_llm.engine.backend.name == "triton"
    got = triton_llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    triton_llm.engine.check_idle_integrity()


@pytest.mark.slow
def test_a_gguf_file_runs_on_the_triton_kernels(tmp_path):
    """The default model is a GGUF file and Triton the default on a GPU: its weights load
    dequantized on that backend too, and give the torch backend's tokens."""
    path = write_gguf(tmp_path / "tiny.Q4_1.gguf", "llama", make_model("llama"))
    prompts = [[5, 17, 33, 200, 7, 9], list(range(40, 57))]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(str(path), kernels="torch", **SMALL).generate(prompts, params)
    triton_llm = LLM(str(path), kernels="triton", **SMALL)
    assert triton_llm.engine.backend.name == "triton"
    assert [o.token_ids for o in triton_llm.generate(prompts, params)] == [o.token_ids for o in expected]


class _ReferenceFP8Backend(TorchBackend):
    """The torch reference, keeping FP8 linears FP8 and running them as the Triton GEMM does
    (activations quantized per token and group): the arithmetic the Triton engine must equal."""

    runs_block_fp8 = True

    def linear(self, x, weight, bias=None):
        if isinstance(weight, BlockFP8Weight):
            return block_fp8.block_fp8_linear(x, weight, bias)
        return super().linear(x, weight, bias)


@pytest.mark.slow
def test_fp8_checkpoints_keep_fp8_linears_on_triton_and_equal_the_reference_arithmetic(tmp_path, monkeypatch):
    """On the Triton backend an FP8 checkpoint's linears stay FP8 and run the block-scaled
    GEMM. Its activation quantization moves the logits a little, so the tokens are compared
    with the torch reference of the same arithmetic, not with the dequantized model."""
    path = tmp_path / "fp8"
    write_fp8_deepseek_v3(path, tmp_path / "reference", (24, 40))
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (17, 5)]
    # Six tokens: the sixth of the first prompt differs from the dequantized model's (the
    # activations' quantization decides it), so equality here shows the same arithmetic.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    triton_llm = LLM(str(path), kernels="triton", **SMALL)
    attention = triton_llm.engine.model.layers[1].attention
    assert isinstance(attention.o_proj.weight, BlockFP8Weight) and isinstance(attention.q_b_proj.weight, BlockFP8Weight)
    got = triton_llm.generate(prompts, params)
    monkeypatch.setattr(model_setup, "select_backend", lambda kernels, device: _ReferenceFP8Backend())
    expected = LLM(str(path), kernels="torch", **SMALL).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
