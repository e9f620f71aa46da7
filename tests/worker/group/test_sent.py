"""GroupSent: a prefill group's pin is freed once, when every rank has reported the request."""

from __future__ import annotations

from pdserve.worker.group.sent import GroupSent


def test_the_pin_is_freed_once_every_rank_has_reported_and_partial_tallies_are_forgotten():
    now = [0.0]
    freed: list[str] = []
    sent = GroupSent(3, freed.append, forget_after_s=10.0, clock=lambda: now[0])
    sent.rank_sent(0, "a")
    sent.rank_sent(2, "a")
    sent.rank_sent(2, "a")  # a repeat counts once
    assert freed == []
    sent.rank_sent(1, "a")
    assert freed == ["a"]
    sent.rank_sent(1, "b")  # rank 1 reported b; ranks 0 and 2 never do (their decode ranks died)
    now[0] = 11.0
    sent.rank_sent(0, "b")  # b's old tally was forgotten: this starts a new one
    sent.rank_sent(2, "b")
    assert freed == ["a"]
    sent.rank_sent(1, "b")
    assert freed == ["a", "b"]
