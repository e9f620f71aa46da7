"""``kv_cache_dtype="fp8_e4m3"``: half the bytes a token, per-layer scales, dequantized on read.

FP8 rounds every cached key and value, so greedy tokens are not transformers' own. They are
those of transformers made to round its keys (after rotary) and values the same way, with the
same per-layer scales; and the logprobs stay close to the unquantized model's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from tests.model.test_models import _prompts
from tests.utils.checkpoints import reference_greedy

FP8 = dict(kv_cache_dtype="fp8_e4m3")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the cache gives back for ``x``: ``x / scale`` in FP8, times ``scale``."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * scale


class _QuantizedKV:
    """transformers' Llama with its keys (after rotary) and values rounded as the FP8 cache does."""

    def __init__(self, hf_model, k_scales: list[float], v_scales: list[float]) -> None:
        import transformers.models.llama.modeling_llama as llama

        self.module, self.original = llama, llama.apply_rotary_pos_emb
        self.layer = 0
        self.handles = []
        for index, layer in enumerate(hf_model.model.layers):
            attention = layer.self_attn
            self.handles.append(attention.register_forward_pre_hook(lambda *_, i=index: setattr(self, "layer", i)))
            self.handles.append(
                attention.v_proj.register_forward_hook(lambda _m, _a, out, i=index: _roundtrip(out, v_scales[i]))
            )

        def rotary(q, k, cos, sin, *args, **kwargs):
            q, k = self.original(q, k, cos, sin, *args, **kwargs)
            return q, _roundtrip(k, k_scales[self.layer])

        llama.apply_rotary_pos_emb = rotary

    def __enter__(self) -> _QuantizedKV:
        return self

    def __exit__(self, *exc) -> None:
        self.module.apply_rotary_pos_emb = self.original
        for handle in self.handles:
            handle.remove()


def _with_kv_scales(source, directory, k_scales: list[float], v_scales: list[float]):
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    for index, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{index}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{index}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_an_fp8_cache_holds_half_the_bytes_a_token(checkpoints):
    path, _ = checkpoints("llama")
    half = LLM(str(path), dtype="bfloat16").engine
    fp8 = LLM(str(path), dtype="bfloat16", **FP8).engine
    assert fp8.kv_cache.data.dtype == torch.float8_e4m3fn
    assert fp8.kv_cache_spec.bytes_per_token * 2 == half.kv_cache_spec.bytes_per_token


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("scales", [None, ([0.5, 0.25], [2.0, 0.125])])
def test_greedy_tokens_equal_transformers_rounding_kv_the_same_way(checkpoints, tmp_path, kernels, scales):
    path, hf_model = checkpoints("llama")
    k_scales, v_scales = scales or ([1.0, 1.0], [1.0, 1.0])
    if scales is not None:  # a calibrated checkpoint: its layers' own k_scale and v_scale
        path = _with_kv_scales(path, tmp_path, k_scales, v_scales)
    prompts = _prompts(11, [5, 17, 40])
    outputs = LLM(str(path), kernels=kernels, max_num_seqs=8, max_num_batched_tokens=24, **FP8).generate(
        prompts, GREEDY
    )
    compared, differs_unquantized = 0, False
    with _QuantizedKV(hf_model, k_scales, v_scales):
        references = [reference_greedy(hf_model, prompt, 10) for prompt in prompts]
    for output, (reference, num_clear) in zip(outputs, references):
        assert output.token_ids[:num_clear] == reference[:num_clear]
        compared += num_clear
    for prompt, (reference, _) in zip(prompts, references):
        differs_unquantized |= reference_greedy(hf_model, prompt, 10)[0] != reference
    assert compared >= 15, "too many near-ties: the comparison proves little"
    assert differs_unquantized, "the rounding changed no token: the test could not tell it was applied"


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_logprobs_stay_close_to_the_unquantized_model(checkpoints, arch):
    """Teacher-forced on pdserve's own tokens: each token's logprob, FP8 cache against
    transformers in float32 (the MLA latent cache of DeepSeek-V3 included)."""
    path, hf_model = checkpoints(arch)
    prompts = _prompts(12, [9, 33])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for prompt, output in zip(prompts, LLM(str(path), **FP8).generate(prompts, params)):
        ids = torch.tensor([prompt + output.token_ids])
        with torch.inference_mode():
            logprobs = hf_model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        want = logprobs.gather(1, torch.tensor(output.token_ids)[:, None]).squeeze(1)
        got = torch.tensor([entry.token_logprob for entry in output.logprobs])
        assert (got - want).abs().max() < 0.1, (got, want)


def test_triton_kernels_refuse_an_fp8_cache_by_name(checkpoints):
    path, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e4m3' runs on the torch and cpu kernels"):
        LLM(str(path), kernels="triton", **FP8)


def test_an_unknown_kv_cache_dtype_is_refused_by_field(checkpoints):
    path, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(path), kv_cache_dtype="int8")
