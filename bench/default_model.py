"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): how long loading takes, and what
``pdserve generate`` (no --model) delivers, end to end.

Each round, in a fresh child process: parse the GGUF header, read and dequantize every tensor
(the raw cost of the format), then build the whole engine (configuration, weights, tokenizer,
backend, a 64 MiB KV cache: the engine's default 4 GiB CPU cache would time page zeroing, not
GGUF). Then ``pdserve generate --prompt ... --max-tokens N --ignore-eos --json`` as a user runs
it, timed from the command's start (process start and loading included) and from its first
token (decode speed). Rounds alternate the two measurements; medians are reported.

    python -m bench.default_model                 # a table
    python -m bench.default_model --json --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.lib import machine
from bench.lib.report import emit, median
from pdserve.model.default_model import resolve_model

_LOAD = """
import json, time, torch
t0 = time.perf_counter()
from pdserve.model.gguf.reader import GGUFFile
f = GGUFFile({path!r})
t1 = time.perf_counter()
for name in f.tensors:
    f.read(name)
t2 = time.perf_counter()
f.close()
from pdserve.engine.engine import LLMEngine
from pdserve.types.engine_config import EngineConfig
t3 = time.perf_counter()
LLMEngine({path!r}, EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=2048))
t4 = time.perf_counter()
print(json.dumps({{"header_s": t1 - t0, "dequantize_all_s": t2 - t1, "engine_s": t4 - t3}}))
"""


def _load_round(path: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD.format(path=path)], capture_output=True, text=True, timeout=900, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _generate_round(prompt: str, max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            str(max_tokens),
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    wall = time.perf_counter() - start
    out = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = len(out["token_ids"])
    decode_s = out["itl_ms"] * (tokens - 1) / 1e3
    return {
        "command_s": wall,
        "ttft_ms": out["ttft_ms"],
        "itl_ms": out["itl_ms"],
        "decode_tok_s": (tokens - 1) / decode_s if decode_s else 0.0,
        "tok_s_whole_command": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.default_model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = resolve_model(None)
    loads, gens = [], []
    for _ in range(args.rounds):
        loads.append(_load_round(path))
        gens.append(_generate_round(args.prompt, args.max_tokens))
    medians = {key: median(r[key] for r in loads) for key in loads[0]}
    medians.update({key: median(r[key] for r in gens) for key in gens[0]})
    result = {
        "model": path,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "median": medians,
        "load": loads,
        "generate": gens,
        "loadavg": os.getloadavg(),
        "machine": machine.describe(),
    }
    emit(result, args.json, _print_table)


def _print_table(result: dict) -> None:
    for key, value in result["median"].items():
        print(f"{key:>22}: {value:.3f}")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
