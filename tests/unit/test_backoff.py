"""The retry schedule and the rate bound every service shares."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.backoff import Backoff, TokenBucket


def test_token_bucket_allows_a_burst_then_spaces_events_at_the_rate() -> None:
    b = TokenBucket(rate=10.0, burst=3.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.1)
    assert b.take(0.0) == pytest.approx(0.2), "a wait is taken on credit: the next caller waits longer"
    assert b.take(1.0) == 0.0, "refilled after a second"


@given(st.lists(st.floats(0, 0.05), min_size=1, max_size=200), st.floats(1, 50), st.integers(1, 10))
def test_token_bucket_never_lets_more_than_burst_plus_rate_times_elapsed(
    gaps: list[float], rate: float, burst: int
) -> None:
    """Whatever the arrival pattern, the events let through (each at its arrival plus its wait) within any
    window from the start never exceed ``burst + rate * elapsed``."""
    b = TokenBucket(rate=rate, burst=float(burst))
    now, times = 0.0, []
    for g in gaps:
        now += g
        times.append(now + b.take(now))
    for i, t in enumerate(times):
        assert i + 1 <= burst + rate * t + 1e-6


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)
    with pytest.raises(ValueError):
        Backoff(initial=0)
