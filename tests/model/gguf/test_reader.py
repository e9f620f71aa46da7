"""The GGUF reader and dequantization: bit-exact against ``gguf.quants``; bad files named with
their offset; types, architectures and pre-tokenizers pdserve cannot handle named."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from pdserve import LLM
from pdserve.model.gguf.checkpoint import unpermute_rows
from pdserve.model.gguf.dequant import dequantize
from pdserve.model.gguf.reader import GGUFError, GGUFFile
from pdserve.text.gguf_tokenizer import load_gguf_tokenizer
from tests.utils.gguf_files import make_model, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16])
def test_dequantize_is_bit_exact_against_gguf(qtype):
    values = np.random.default_rng(int(qtype)).standard_normal((48, 96)).astype(np.float32) * 3
    raw = gguf.quants.quantize(values, qtype)
    ours = dequantize(raw.reshape(-1), qtype, (48, 96)).numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))


def test_unpermute_undoes_llama_cpp_reordering():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)  # 4 heads of head_dim 8
    permuted = weight.reshape(4, 2, 4, 3).swapaxes(1, 2).reshape(32, 3)
    import torch

    assert torch.equal(unpermute_rows(torch.from_numpy(permuted), 4), torch.from_numpy(weight))


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf-bad")
    return write_gguf(directory / "tiny.gguf", "qwen2", make_model("qwen2"))


def _offset(message: str) -> int:
    match = re.search(r"at offset (\d+)", message)
    assert match, message
    return int(match.group(1))


@pytest.mark.parametrize("keep", [3, 30, 2000, 20000, -100])
def test_a_truncated_file_names_the_file_and_the_offset(tiny_file, tmp_path, keep):
    data = tiny_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(GGUFError) as caught:
        GGUFFile(cut)
    message = str(caught.value)
    assert str(cut) in message and "truncated" in message or "not a GGUF file" in message
    assert 0 <= _offset(message) <= len(data)


def test_the_offset_points_at_the_damage(tiny_file, tmp_path):
    data = bytearray(tiny_file.read_bytes())
    with GGUFFile(tiny_file) as good:
        tensor = good.tensors["blk.1.ffn_down.weight"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: tensor.start + 10])
    with pytest.raises(GGUFError, match=f"{cut}: truncated: tensor blk.1.ffn_down.weight .* at offset {tensor.start}"):
        GGUFFile(cut)
    # A string whose length runs past the end: the offset is where its bytes would start.
    key = b"general.architecture"
    at = bytes(data).index(key) + len(key) + 4  # the value: u64 length, then the bytes
    data[at : at + 8] = (10**9).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        GGUFError, match=f"{bad}: truncated: general.architecture needs 1000000000 bytes.* at offset {at + 8}"
    ):
        GGUFFile(bad)


def test_not_gguf_and_empty(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match=r"x.gguf: not a GGUF file .* at offset 0"):
        GGUFFile(tmp_path / "x.gguf")
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file"):
        GGUFFile(tmp_path / "e.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LLM(str(tmp_path / "missing.gguf"))


def test_a_quant_type_pdserve_cannot_dequantize_is_named(tmp_path):
    # Q8_1 is a ggml type (llama.cpp's activation format) that nothing dequantizes.
    path = write_gguf(tmp_path / "q81.gguf", "qwen2", make_model("qwen2"), qtypes={"ffn_up": Q.Q8_1})
    with pytest.raises(GGUFError, match=r"q81.gguf: tensor blk.0.ffn_up.weight is Q8_1, a ggml type pdserve cannot"):
        LLM(str(path), max_model_len=64, kv_cache_memory=2**20)


def test_an_unknown_ggml_type_id_is_named(tiny_file, tmp_path):
    data = bytearray(tiny_file.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = bytes(data).index(name) + len(name) + 4 + 2 * 8  # dims count, two dims, then the type
    data[at : at + 4] = (77).to_bytes(4, "little")
    bad = tmp_path / "unknown.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="tensor blk.0.ffn_up.weight has unknown ggml type 77"):
        GGUFFile(bad)


def test_unsupported_architecture_and_pre_tokenizer_are_named(tmp_path):
    model = make_model("qwen2")
    gemma = write_gguf(tmp_path / "g.gguf", "gemma", model)
    with pytest.raises(GGUFError, match="general.architecture 'gemma' is not supported"):
        LLM(str(gemma))
    odd = write_gguf(tmp_path / "p.gguf", "qwen2", model, pre="deepseek-coder")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre 'deepseek-coder' is not supported"):
        load_gguf_tokenizer(odd)
