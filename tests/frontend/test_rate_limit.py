"""The per-key token bucket: its burst, its refill, and keys kept apart."""

from __future__ import annotations

import pytest

from pdserve.frontend.rate_limit import RateLimiter


def test_a_key_gets_its_burst_then_its_rate_and_other_keys_are_untouched():
    now = [0.0]
    limiter = RateLimiter(2.0, burst=3, clock=lambda: now[0])
    assert [limiter.acquire("key-0") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("key-0") == pytest.approx(0.5)  # one token back every 0.5 s
    assert limiter.acquire("key-1") == 0.0
    now[0] = 0.5
    assert limiter.acquire("key-0") == 0.0 and limiter.acquire("key-0") > 0
    now[0] = 100.0  # refills up to the burst, no more
    assert [limiter.acquire("key-0") == 0.0 for _ in range(4)] == [True, True, True, False]


def test_bad_settings_are_refused():
    for rate in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rate"):
            RateLimiter(rate)
    with pytest.raises(ValueError, match="burst"):
        RateLimiter(1.0, burst=0)
    assert RateLimiter(2.5).burst == 3
