"""The README's main job on the default model: `pdserve up` with no --model, then `pdserve
generate --target ... --prompt ...`; the served tokens equal transformers' on the same GGUF.
The official ``openai`` SDK on the same deployment: completions and chat (the GGUF's own chat
template), streamed or not, give the offline engine's greedy text; a wrong key gets 401."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.model.default_model import DEFAULT_MODEL_NAME
from tests.e2e.deployment import UpProcess
from tests.utils.gguf_files import default_model

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 12
KEY = "sk-default-model"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _through_the_openai_sdk(base_url: str) -> dict[str, object]:
    """What the official client gets from the served default model: greedy, MAX_TOKENS each."""
    client = openai.OpenAI(base_url=base_url, api_key=KEY, timeout=120, max_retries=0)
    greedy = {
        "model": DEFAULT_MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    got: dict[str, object] = {"completion": client.completions.create(prompt=PROMPT, **greedy).choices[0].text}
    stream = client.completions.create(prompt=PROMPT, stream=True, **greedy)
    got["completion_streamed"] = "".join(c.choices[0].text for c in stream if c.choices)
    chat = client.chat.completions.create(messages=MESSAGES, **greedy)
    got["chat"], got["chat_prompt_tokens"] = chat.choices[0].message.content, chat.usage.prompt_tokens
    stream = client.chat.completions.create(messages=MESSAGES, stream=True, **greedy)
    got["chat_streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0).models.list()
    return got


def test_up_serves_the_default_model_as_transformers_runs_it(tmp_path, smollm2_reference):
    path = default_model()
    up = UpProcess(
        "up",
        "--port",
        "0",
        "--http-port",
        "0",
        "--api-key",
        KEY,
        "--disaggregation",
        "always",
        "--threads-per-worker",
        "1",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "64MiB",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        line, port = up.wait_up(timeout=300)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "generate",
                "--target",
                f"127.0.0.1:{port}",
                "--prompt",
                PROMPT,
                "--model-name",
                DEFAULT_MODEL_NAME,
                "--max-tokens",
                str(MAX_TOKENS),
                "--temperature",
                "0",
                "--ignore-eos",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PDSERVE_API_KEY": KEY},
        )
        assert result.returncode == 0, result.stderr + up.output
        served = json.loads(result.stdout)
        sdk = _through_the_openai_sdk(re.search(r"OpenAI API on (\S+/v1)", line).group(1))
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(60) == 0, up.output
    finally:
        up.close()
    tokenizer = smollm2_reference.tokenizer
    expected, num_clear = smollm2_reference.greedy(tokenizer(PROMPT).input_ids, MAX_TOKENS)
    assert served["breakdown"]["disaggregated"] and served["breakdown"]["kv_transfer_bytes"] > 0
    assert served["token_ids"][:num_clear] == expected[:num_clear]
    assert served["text"] == tokenizer.decode(served["token_ids"]) and "Paris" in served["text"]

    llm = LLM(str(path), max_model_len=512, kv_cache_memory=64 * 2**20)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert sdk["completion"] == sdk["completion_streamed"] == served["text"] == llm.generate([PROMPT], greedy)[0].text
    # The chat prompt as transformers renders the GGUF's template: pdserve rendered the same one.
    chat_text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(chat_text, add_special_tokens=False).input_ids
    assert sdk["chat_prompt_tokens"] == len(chat_ids)
    assert sdk["chat"] == sdk["chat_streamed"] == llm.generate([chat_ids], greedy)[0].text
    assert "Paris" in sdk["chat"]


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["generate", "--prompt", "Hi"], ["decode", "--etcd", "x"]])
def test_a_missing_default_model_says_how_to_get_it(tmp_path, command):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", *command], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 2, result.stderr
    assert f"the default model ({DEFAULT_MODEL_NAME}) is not at {tmp_path}" in result.stderr
    assert "scripts/setup.sh" in result.stderr


def test_bad_gguf_files_are_one_clear_line(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path / "x.gguf"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and f"GGUF file not found: {tmp_path / 'x.gguf'}" in missing.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model().read_bytes()[:5000])
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--model", str(cut), "--prompt", "Hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{cut}: truncated: " in result.stderr and "at offset " in result.stderr
