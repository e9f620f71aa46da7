"""DeepSeek-V3's FP8 block-quantized checkpoints on the CPU: dequantized at load, greedy tokens
equal to transformers' on the dequantized weights; malformed ones refused by name, up front."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.model.config import read_model_config
from pdserve.model.weights import Checkpoint, CheckpointError
from tests.model.test_models import _assert_matches_reference, _prompts
from tests.utils.fp8_checkpoint import write_fp8_deepseek_v3

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    made = {}

    def make(block_size: tuple[int, int]):
        if block_size not in made:
            root = tmp_path_factory.mktemp(f"fp8_{block_size[0]}x{block_size[1]}")
            made[block_size] = (root / "fp8", write_fp8_deepseek_v3(root / "fp8", root / "reference", block_size))
        return made[block_size]

    return make


# Blocks smaller than the matrices, none dividing them all: every weight has partial edge
# blocks (64 = 2 x 24 + 16 rows, 64 = 40 + 24 columns; 96, 128, 32 ... likewise).
@pytest.mark.parametrize("block_size,kernels", [((24, 40), "cpu"), ((16, 48), "torch")])
def test_fp8_deepseek_v3_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    fp8_checkpoints, block_size, kernels
):
    path, hf_model = fp8_checkpoints(block_size)
    llm = LLM(str(path), kernels=kernels, max_num_batched_tokens=24, max_num_seqs=8)
    assert llm.engine.model_config.quantization is not None
    prompts = _prompts(7, [5, 17, 40, 1])
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_reference(hf_model, prompts, outputs)
    llm.engine.check_idle_integrity()


def test_fp8_weights_are_dequantized_into_the_serving_dtype(fp8_checkpoints):
    path, hf_model = fp8_checkpoints((24, 40))
    config = read_model_config(path, dtype="bfloat16")
    ckpt = Checkpoint(path, CPU, config.dtype, weight_block_size=config.quantization.weight_block_size)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert ckpt.is_block_fp8(name) and not ckpt.is_block_fp8("model.layers.1.mlp.gate.weight")
    weight = ckpt.get(name, (96, 24))
    assert weight.dtype == torch.bfloat16
    want = hf_model.state_dict()[name]  # the twin holds the dequantized values
    assert torch.equal(weight, want.to(torch.bfloat16))
    assert torch.equal(ckpt.get(name, (96, 24), dtype=torch.float32), want)


def _broken_copy(fp8_path, tmp_path, edit) -> None:
    for file in fp8_path.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(fp8_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})


def test_a_missing_scale_names_the_tensor_and_both_shapes_before_any_weight_is_read(fp8_checkpoints, tmp_path):
    path, _ = fp8_checkpoints((24, 40))
    _broken_copy(path, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"))
    config = read_model_config(tmp_path)
    # Refused when the checkpoint is opened: no weight has been read yet.
    with pytest.raises(CheckpointError) as error:
        Checkpoint(tmp_path, CPU, torch.float32, weight_block_size=config.quantization.weight_block_size)
    message = str(error.value)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in message
    assert "[64, 32]" in message and "[3, 1]" in message
    with pytest.raises(CheckpointError, match="down_proj.weight_scale_inv"):
        LLM(str(tmp_path))


def test_a_scale_of_the_wrong_shape_names_the_tensor_and_both_shapes(fp8_checkpoints, tmp_path):
    path, _ = fp8_checkpoints((24, 40))
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"

    def edit(tensors):
        tensors[name] = torch.ones(2, 2)  # 64 x 64 in 24 x 40 blocks needs [3, 2]

    _broken_copy(path, tmp_path, edit)
    with pytest.raises(CheckpointError) as error:
        LLM(str(tmp_path))
    assert name in str(error.value) and "[2, 2]" in str(error.value) and "[3, 2]" in str(error.value)


def test_fp8_weights_without_a_quantization_config_are_refused(fp8_checkpoints, tmp_path):
    path, _ = fp8_checkpoints((24, 40))
    _broken_copy(path, tmp_path, lambda t: None)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="F8_E4M3 but config.json has no quantization_config"):
        LLM(str(tmp_path))


def test_an_unknown_safetensors_dtype_names_the_tensor_and_the_dtype(tmp_path):
    save_file({"w": torch.zeros(4, 4, dtype=torch.float8_e5m2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor w has unsupported dtype F8_E5M2"):
        Checkpoint(tmp_path, CPU, torch.float32)


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ],
)
def test_quantization_configs_pdserve_cannot_read_are_refused_by_field(fp8_checkpoints, tmp_path, spec, field):
    path, _ = fp8_checkpoints((24, 40))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = spec
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        read_model_config(tmp_path)
