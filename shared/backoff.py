"""Exponential backoff with jitter: the one retry schedule of every service (watch loops, NATS calls, quota
patches, republishing). No I/O: the caller sleeps."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: attempt ``n`` (0-based) waits about ``initial * factor**n`` seconds, capped
    at ``maximum``, spread by ±``jitter`` so watchers that failed together do not retry together; never shorter
    than a ``Retry-After`` the server sent, up to ``maximum`` (a server asking for an hour must not stall a
    service that long)."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.maximum) or self.factor < 1 or not (0 <= self.jitter < 1):
            raise ValueError(f"invalid backoff {self!r}")

    def base(self, attempt: int) -> float:
        if attempt < 0:
            raise ValueError("attempt must not be negative")
        # cap the exponent first: factor**attempt overflows a float for large attempts
        exp = 0
        value = self.initial
        while exp < attempt and value < self.maximum:
            value *= self.factor
            exp += 1
        return min(value, self.maximum)

    def delay(self, attempt: int, rng: random.Random | None = None, retry_after: float | None = None) -> float:
        r = rng if rng is not None else random
        d = self.base(attempt) * r.uniform(1.0 - self.jitter, 1.0 + self.jitter)
        if retry_after is not None:
            d = max(d, min(retry_after, self.maximum))
        return d


@dataclass(slots=True)
class TokenBucket:
    """At most ``rate`` events per second on average, ``burst`` at once. No I/O and no clock of its own: the
    caller passes the monotonic time and sleeps the wait :meth:`take` returns."""

    rate: float
    burst: float
    tokens: float = -1.0
    """Tokens left (starts full)."""
    at: float = 0.0
    """When ``tokens`` was last brought up to date."""

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"invalid token bucket {self!r}")
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self, now: float) -> float:
        """Take one token: the seconds to wait before the event may happen (0 when at once). A wait is taken on
        credit, so callers that wait it out in turn are spaced ``1 / rate`` apart."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate
