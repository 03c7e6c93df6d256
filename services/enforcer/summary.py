"""When a quota's ``vmquota.io/usage`` summary may be written on its own (``Action.REFRESH``): at most once per
``usage_refresh_interval`` per quota, and at most ``refresh_rate`` such writes a second overall, so that summaries
never take the write budget raises wait for. A summary that has to wait is reconciled again when its time comes,
by a loop timer (not the work queue's delay: it keeps nobody waiting and never shortens a retry's backoff)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.enforcer.options import Key
from shared.backoff import TokenBucket


class SummaryPacer:
    def __init__(self, interval: float, rate: float, due: Callable[[Key], None]) -> None:
        """``due(key)``: reconcile ``key`` again (called when a summary that had to wait may be written)."""
        self.interval = interval
        self._bucket = TokenBucket(rate, max(1.0, rate))
        self._due = due
        self._written: dict[Key, float] = {}
        """Monotonic time of each quota's last write of its summary (alone or with anything else)."""
        self._turn: set[Key] = set()
        """Quotas whose summary has its turn under the overall rate (taken on credit when it was put off)."""
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    def written(self, key: Key) -> None:
        self._written[key] = time.monotonic()

    def later(self, key: Key) -> bool:
        """Whether the quota's summary, alone out of date, waits; it is then due again when its time comes."""
        now = time.monotonic()
        last = self._written.get(key)
        wait = 0.0 if last is None else last + self.interval - now
        if wait <= 0:
            if key in self._turn:  # (its turn, taken when it was put off)
                self._turn.discard(key)
                return False
            wait = self._bucket.take(now)
            if wait <= 0:
                return False
            self._turn.add(key)
        if key not in self._timers:
            self._timers[key] = asyncio.get_running_loop().call_later(wait, self._fire, key)
        return True

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._due(key)

    def forget(self, key: Key) -> None:
        self._written.pop(key, None)
        self._turn.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
