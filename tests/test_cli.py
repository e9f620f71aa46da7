"""`pdserve generate` as a user runs it: a real process, its output and its exit code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_generate_json_matches_the_offline_api(checkpoints):
    path, _ = checkpoints("llama")
    result = _run(
        "generate",
        "--model",
        str(path),
        "--token-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected = LLM(str(path)).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out["token_ids"] == expected.token_ids
    assert out["finish_reason"] == "length"
    assert out["ttft_ms"] >= 0 and out["itl_ms"] >= 0


@pytest.mark.slow
def test_generate_streams_the_seeded_text(checkpoints):
    path, _ = checkpoints("llama")
    result = _run(
        "generate", "--model", str(path), "--prompt", "hello world", "--max-tokens", "8", "--seed", "3", "--ignore-eos"
    )
    assert result.returncode == 0, result.stderr
    expected = LLM(str(path)).generate(["hello world"], SamplingParams(max_tokens=8, seed=3, ignore_eos=True))[0]
    assert expected.text  # a stream of nothing would prove nothing
    assert result.stdout == expected.text + "\n"


@pytest.mark.slow
def test_bad_input_is_one_clear_line_and_exit_code_2(checkpoints, tmp_path):
    path, _ = checkpoints("llama")
    result = _run("generate", "--model", str(path), "--token-ids", "1,2,100000")
    assert result.returncode == 2
    assert "token_ids[2] = 100000 is outside the vocabulary" in result.stderr
    assert "Traceback" not in result.stderr
    missing = _run("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
