"""``pdserve profile``: measure this machine's engine speed into the profile the planner predicts from."""

from __future__ import annotations

import argparse

from pdserve.cli.common import add_engine_args, from_options
from pdserve.model.default_model import resolve_model
from pdserve.types.engine_config import EngineConfig

DESCRIPTION = """Load the model with the given engine options, time prefill at several prompt
lengths and decode steps at several batch sizes and context lengths (each point the fastest
of its repeats), and write the EngineProfile JSON that `pdserve planner` and
`pdserve up --autoscale` predict TTFT and ITL from. Run it on the hardware and with the
engine options the workers use; points that do not fit the engine are left out."""

EXAMPLES = """examples:
  pdserve profile --model ./Llama-3.1-8B --out llama.profile.json
  pdserve profile --model ./tiny --out tiny.json --prompt-lengths 16,64 --batch-sizes 1,4 --context-lengths 32
"""


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "profile",
        help="measure the engine into a planner profile",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a GGUF file (default: the set-up's SmolLM2-135M-Instruct)",
    )
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--prompt-lengths", type=_ints, default=[32, 128, 512, 1024], help="default: 32,128,512,1024")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32], help="decode batches (default: 1,8,32)")
    p.add_argument("--context-lengths", type=_ints, default=[64, 512], help="decode contexts (default: 64,512)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every point, fastest kept (default: 2)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.planner.profiler import ProfilePlan, profile_engine

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = resolve_model(args.model)
    engine = LLMEngine(model, from_options(args, EngineConfig))
    max_len, max_seqs = engine.max_model_len, engine.scheduler.config.max_num_seqs
    # Keep what fits this engine, so the defaults work for a small context or batch cap.
    prompts = [n for n in args.prompt_lengths if n + 1 < max_len]
    batches = [b for b in args.batch_sizes if b <= max_seqs]
    contexts = [c for c in args.context_lengths if 2 * c < max_len]
    if not (prompts and batches and contexts):
        raise ValueError(
            f"no measurement fits this engine (max_model_len {max_len}, max_num_seqs {max_seqs}); "
            "pass smaller --prompt-lengths, --batch-sizes or --context-lengths"
        )
    plan = ProfilePlan(prompt_lengths=prompts, batch_sizes=batches, context_lengths=contexts, repeats=args.repeats)
    profile = profile_engine(engine, plan, source=f"pdserve profile --model {model}")
    profile.save(args.out)
    print(
        f"pdserve profile: wrote {args.out} ({len(prompts)} prefill points, "
        f"{len(batches)}x{len(contexts)} decode grid)",
        flush=True,
    )
    return 0
