"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from pdserve.engine.weights import CheckpointError

EPILOG = """examples:
  pdserve generate --model ./Llama-3.1-8B --prompt "The capital of France is"
  pdserve generate --model ./tiny --token-ids 1,2,3 --max-tokens 8 --temperature 0 --json
"""


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from None


def _bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 4G, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        help="generate text from a prompt with a local model",
        description="Load a Hugging Face model directory and generate a completion for one prompt. "
        "Text streams to the terminal as it is generated; --json prints one JSON object at the end.",
    )
    gen.add_argument("--model", required=True, help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--token-ids", type=_token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (default: 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens; -1 disables")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    gen.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable); not included in the text")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="compute dtype (default: the checkpoint's)")
    gen.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto",
                     help="compute kernels: auto = Triton on CUDA, torch reference elsewhere")
    gen.add_argument("--kv-cache-memory", type=_bytes, default=None, help="KV cache budget, e.g. 2G (default: sized automatically)")
    gen.set_defaults(func=_generate)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(args.model, EngineConfig(dtype=args.dtype, kernels=args.kernels, kv_cache_memory=args.kv_cache_memory))
    prompt = args.prompt if args.prompt is not None else args.token_ids
    start = time.perf_counter()
    request = engine.add_request("cli", prompt, params)
    first_token_at = None
    final = None
    while final is None:
        for output in engine.step().outputs:
            if output.new_token_ids and first_token_at is None:
                first_token_at = time.perf_counter()
            if not args.json and output.text_delta:
                sys.stdout.write(output.text_delta)
                sys.stdout.flush()
            if output.finished:
                final = output
    elapsed = time.perf_counter() - start
    if args.json:
        num_out = len(final.token_ids)
        print(json.dumps({
            "token_ids": final.token_ids,
            "text": final.text,
            "finish_reason": final.finish_reason,
            "prompt_tokens": len(request.prompt_token_ids),
            "ttft_ms": round(((first_token_at or start) - start) * 1000, 3),
            "itl_ms": round((elapsed - ((first_token_at or start) - start)) / max(num_out - 1, 1) * 1000, 3),
            "total_ms": round(elapsed * 1000, 3),
        }))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, CheckpointError) as error:
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
