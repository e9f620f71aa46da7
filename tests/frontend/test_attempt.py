"""Attempt: each try at a request starts with nothing of the one before but what it is told."""

from __future__ import annotations

from pdserve.frontend.attempt import Attempt, Broken


def test_a_migration_is_a_fresh_attempt_with_its_own_request_id() -> None:
    first = Attempt("r1")
    assert first.is_first and first.migration is None
    first.decode_started = True

    second = Attempt.after(first, Broken("d1", "UNAVAILABLE gone"), "r1", num_tokens=3)
    assert (second.request_id, second.number, second.is_first) == ("r1.m1", 1, False)
    assert (second.decode_worker, second.decode_started) == (None, False)
    m = second.migration
    assert m is not None and (m.from_worker, m.tokens_streamed, m.reason) == ("d1", 3, "UNAVAILABLE gone")

    third = Attempt.after(second, Broken("d2", "INTERNAL"), "r1", num_tokens=5)
    assert (third.request_id, third.number) == ("r1.m2", 2)
    assert third.migration is not None and third.migration.from_worker == "d2"
