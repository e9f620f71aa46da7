"""A decode worker killed under load, as a user meets it: `pdserve up` (1 prefill + 2 decode,
--disaggregation always) on the default model (or --model), --streams concurrent greedy streams
of --max-tokens tokens, and SIGKILL to one decode worker --kill-after seconds into the run.

The same streams run once undisturbed first (the reference, and the warm-up). Reported: how
many of the disturbed streams completed, how many with exactly the reference's tokens, the
migrations their breakdowns report, every failure's status, and how long after the kill the
registry listed two decode workers again (`pdserve up` restarts the killed one).

    python -m bench.migration --json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import Any

from bench.lib.deploy import Deployment, DeploySpec
from bench.lib.load import BenchRequest, SamplingSpec, closed_loop, inference_stub, list_models
from bench.lib.report import emit
from pdserve.discovery.registry import Role

TOPICS = [
    "the sea",
    "a old clock",
    "the first snow",
    "a lighthouse keeper",
    "bread",
    "a lost key",
    "the moon",
    "a city at night",
    "a long train journey",
    "an orchard",
    "a chess game",
    "the last bookshop",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.migration",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model path (default: pdserve's default model)")
    parser.add_argument("--streams", type=int, default=12, help="concurrent greedy streams (default: 12)")
    parser.add_argument("--max-tokens", type=int, default=300, help="tokens each stream generates (default: 300)")
    parser.add_argument("--kill-after", type=float, default=6.0, help="seconds into the run of the kill (default: 6)")
    parser.add_argument("--deadline", type=float, default=300.0, help="each request's deadline, s (default: 300)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


async def _decode_workers_registered(deployment: Deployment) -> int:
    """The decode workers the frontend lists now (those registered in etcd)."""
    models = await list_models(deployment.address)
    return sum(m["decode_workers"] for m in models)


async def run_streams(stub: Any, prompts: list[str], max_tokens: int, deadline_s: float) -> list[dict[str, Any]]:
    """Every prompt as its own greedy stream, all at once."""
    requests = [BenchRequest(i, prompt, max_tokens) for i, prompt in enumerate(prompts)]
    results = await closed_loop(stub, "", requests, SamplingSpec(timeout_s=deadline_s), len(requests))
    out = []
    for r in results:
        if r.error is None:
            out.append({"status": "OK", "tokens": r.token_ids, "migrations": r.migration_history})
        elif r.error == "NO_FINAL":
            out.append({"status": "NO_FINAL", "tokens": r.token_ids, "migrations": []})
        else:
            out.append({"status": r.error, "details": r.detail, "tokens": r.token_ids, "migrations": []})
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(args.streams)]
    spec = DeploySpec(1, 2, "always", model=args.model, process=True)
    async with Deployment(spec) as up, inference_stub(up.address) as stub:
        started = time.monotonic()
        reference = await run_streams(stub, prompts, args.max_tokens, args.deadline)
        undisturbed_s = time.monotonic() - started
        victims = up.worker_pids(Role.DECODE)
        killed: dict[str, float] = {}

        async def kill() -> None:
            await asyncio.sleep(args.kill_after)
            os.kill(victims[0], signal.SIGKILL)
            killed["at"] = time.monotonic()

        started = time.monotonic()
        disturbed, _ = await asyncio.gather(run_streams(stub, prompts, args.max_tokens, args.deadline), kill())
        disturbed_s = time.monotonic() - started
        while await _decode_workers_registered(up) < 2 and time.monotonic() - killed["at"] < 120:
            await asyncio.sleep(0.5)
        back_s = time.monotonic() - killed["at"] if await _decode_workers_registered(up) >= 2 else None
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "kill_after_s": args.kill_after,
        "reference_completed": sum(r["status"] == "OK" for r in reference),
        "completed": sum(r["status"] == "OK" for r in disturbed),
        "identical_to_reference": sum(
            d["status"] == "OK" and d["tokens"] == r["tokens"] for d, r in zip(disturbed, reference)
        ),
        "migrated": sum(bool(d["migrations"]) for d in disturbed),
        "migrations": [d["migrations"] for d in disturbed if d["migrations"]],
        "failures": [{k: d[k] for k in ("status", "details") if k in d} for d in disturbed if d["status"] != "OK"],
        "two_decode_workers_again_after_s": None if back_s is None else round(back_s, 1),
        "undisturbed_run_s": round(undisturbed_s, 1),
        "disturbed_run_s": round(disturbed_s, 1),
    }


def main() -> None:
    args = _parser().parse_args()
    emit(asyncio.run(_run(args)), args.json, indent=2)


if __name__ == "__main__":
    main()
