"""``pdserve top``: a live view of a deployment in the terminal, redrawn every ``--interval``.

The data comes from ``top_sources`` and the frame from ``top_view.render``; this module owns
the terminal. On a terminal it draws on the alternate screen with the cursor hidden and
stdin in cbreak mode, so ``q`` quits without Enter; ``q``, Ctrl-C and SIGTERM all end it with
exit status 0 and the terminal as it was. Without a terminal (a pipe, ``--once``) frames are
plain text, one after the other. Standard library only (no curses), and no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import termios
import tty
from collections.abc import Iterator

import aetcd

from pdserve.cli.common import etcd_auth, positive_duration
from pdserve.cli.operate import EXIT_STATUS, ETCD_TIMEOUT_S, add_etcd_arg, run_with_etcd
from pdserve.cli.top_sources import Sources
from pdserve.cli.top_view import render
from pdserve.discovery.etcd import EtcdConnection

DESCRIPTION = """A live view of a deployment, redrawn every --interval (default 1s) until q or Ctrl-C.
Per model: each pool's workers (prefill and decode) with their running and waiting requests, KV
blocks in use, held prompts (prefill), prefix-cache hit rate and preemptions (from the worker's
/metrics), and whether each is ready or draining; the p50/p90 TTFT, ITL and end-to-end latency
the frontends measure over their rolling window, each against the SLO's p90 target (the worst
frontend's, as `pdserve status` shows them); the knobs in force (as `pdserve knobs show`); and
the migrations the frontends counted, in all and since the previous frame.

Each source (etcd, and every worker's and frontend's /metrics) is read concurrently with a
deadline of at most --interval; one that does not answer is listed under NO ANSWER and its
values show as ?, while the rest of the frame keeps updating."""

EXAMPLES = f"""examples:
  pdserve top                                   # the `pdserve up` running on this machine
  pdserve top --etcd http://etcd:2379 --model meta-llama/Llama-3.1-8B
  pdserve top --once                            # one frame as plain text, then exit (scripts)
  pdserve top --interval 5s

keys: q quits (so do Ctrl-C and SIGTERM; the terminal is restored and the exit status is 0).
columns: RUN/WAIT requests running and queued on the worker; KV the share of its KV blocks in
use; HELD prompts whose KV a prefill worker keeps pinned for a decode worker to pull; HIT its
prefix-cache hit rate; PREEMPT requests it preempted since it started; ? where its /metrics
did not answer (or it serves none).

{EXIT_STATUS}
"""

_ALTERNATE_SCREEN, _MAIN_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def add_parser(commands: argparse._SubParsersAction) -> None:
    top = commands.add_parser(
        "top",
        help="live view: workers by pool, latency vs SLO, knobs, migrations",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_etcd_arg(top)
    top.add_argument("--model", help="only this model")
    top.add_argument(
        "--interval",
        type=positive_duration,
        default=1.0,
        metavar="DURATION",
        help="time between frames, e.g. 500ms or 5s; also each source's deadline, up to 2s (default: 1s)",
    )
    top.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    top.set_defaults(func=run_top)


def run_top(args: argparse.Namespace) -> int:
    """Check etcd answers (exit 1 if not, as every etcd command), then show frames."""

    async def body(_: aetcd.Client) -> int:
        etcd = EtcdConnection(args.etcd, min(args.interval, ETCD_TIMEOUT_S), etcd_auth(args))
        sources = Sources(etcd, min(args.interval, ETCD_TIMEOUT_S), args.interval, args.model)
        try:
            if args.once:
                print("\n".join(render(await sources.read(), _width())))
                return 0
            return await _live(sources, args.interval)
        finally:
            await etcd.close()

    return run_with_etcd(args, body)


async def _live(sources: Sources, interval_s: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    try:
        with _terminal(interactive) as keys:
            if keys is not None:
                loop.add_reader(keys, lambda: _on_key(keys, stop))
            try:
                while not stop.is_set():
                    size = shutil.get_terminal_size((160, 50))
                    frame = render(await sources.read(), size.columns, interactive=interactive)
                    _draw(frame[: size.lines - 1] if interactive else frame, interactive)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval_s)
            finally:
                if keys is not None:
                    loop.remove_reader(keys)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def _on_key(fd: int, stop: asyncio.Event) -> None:
    if b"q" in os.read(fd, 1024).lower():
        stop.set()


@contextlib.contextmanager
def _terminal(interactive: bool) -> Iterator[int | None]:
    """On a terminal: the alternate screen, no cursor, keys unbuffered; yields stdin's fd (None
    off a terminal). Everything is put back however the block ends."""
    if not interactive:
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    sys.stdout.write(_ALTERNATE_SCREEN)
    try:
        yield fd
    finally:
        sys.stdout.write(_MAIN_SCREEN)
        sys.stdout.flush()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _draw(lines: list[str], interactive: bool) -> None:
    if interactive:
        # Overwrite in place, line by line, rather than clearing first: no flicker.
        sys.stdout.write(_HOME + "".join(line + _CLEAR_LINE + "\r\n" for line in lines) + _CLEAR_BELOW)
    else:
        sys.stdout.write("\n".join(lines) + "\n\n")
    sys.stdout.flush()


def _width() -> int:
    return shutil.get_terminal_size((160, 50)).columns
