"""The prefill side's SentReporter between real processes: a request is reported sent only once
every decode rank that reads from the prefill rank has notified; a report that comes before
its pin is kept by the pins (the engine's side) and frees the pin as it is made."""

from __future__ import annotations

import time

from tests.kvtransfer import protocol as p
from tests.kvtransfer.conftest import GQA, settle, wait_until

TOKENS_PER_BLOCK = GQA["block_size"]


def test_sent_is_reported_once_every_decode_rank_has_notified(gqa):
    """Decode TP2 reads a TP1 prefill rank: each decode rank's notice says two are expected."""
    P, D0, D1 = gqa["P1"], gqa["D2.0"], gqa["D2.1"]
    before = P.status()
    held = P.request(p.Hold("partial-1", 23))
    assert isinstance(held, p.Held), held
    cmd = p.Pull("partial-1", [P.cfg.name], held.block_ids, 23)
    assert D0.request(cmd).ok
    time.sleep(0.3)  # the first notice is in; it alone must not free
    status = P.status()
    assert status.num_reported == before.num_reported and status.num_held == before.num_held + 1
    assert D1.request(cmd).ok
    wait_until(lambda: P.status().freed_by_notice == before.freed_by_notice + 1, 5.0, "the second notice")
    assert P.status().num_reported == before.num_reported + 1
    for decode in (D0, D1):
        decode.request(p.Release("partial-1"))
    settle(P, D0, D1)


def test_a_sent_reported_before_its_pin_frees_the_pin_as_it_is_made(gqa):
    """Another pin keeps the prefill side fetching notices, so this one is reported at once,
    before its own pin exists: the pins keep it and honour it."""
    P, D = gqa["P1"], gqa["D1"]
    before = P.status()
    other = P.request(p.Hold("keeps-polling", 2 * TOKENS_PER_BLOCK))
    assert isinstance(other, p.Held), other
    full_hit = dict(num_cached_blocks=2)  # the decode side has the whole prefix: nothing moves
    assert D.request(p.Pull("early-2", [P.cfg.name], [0, 1], 2 * TOKENS_PER_BLOCK, **full_hit)).ok
    wait_until(lambda: P.status().num_reported == before.num_reported + 1, 5.0, "the early report")
    assert P.status().freed_by_notice == before.freed_by_notice  # nothing pinned for it yet
    assert isinstance(P.request(p.Hold("early-2", 2 * TOKENS_PER_BLOCK)), p.Held)
    status = P.status()
    assert status.freed_by_notice == before.freed_by_notice + 1 and status.num_held == before.num_held + 1
    pull = p.Pull("keeps-polling", [P.cfg.name], other.block_ids, 2 * TOKENS_PER_BLOCK, **full_hit)
    assert D.request(pull).ok
    wait_until(lambda: P.status().freed_by_notice == before.freed_by_notice + 2, 5.0, "the other pin's notice")
    for request_id in ("early-2", "keeps-polling"):
        D.request(p.Release(request_id))
    settle(P, D)
