"""The simulated controllers' work queue: delayed adds are released in time order, never early, and a stop drops
what was waiting."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.devtools.simcluster.workqueue import WorkQueue
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


async def test_delayed_keys_come_in_time_order_and_not_before_their_time() -> None:
    loop = asyncio.get_running_loop()
    seen: list[tuple[str, float]] = []

    async def handle(key: str) -> None:
        seen.append((key, loop.time()))

    q = WorkQueue("t", handle)
    q.start()
    try:
        start = loop.time()
        delays = {"c": 0.06, "a": 0.02, "b": 0.04, "now": 0.0}
        for key, delay in delays.items():
            q.add_after(key, delay)
        assert not q.idle()  # delayed keys with progress keep the queue busy
        await wait_until(lambda: len(seen) == 4, 5.0, "every key", every=0.001)
        assert [k for k, _ in seen] == ["now", "a", "b", "c"]
        for key, at in seen:
            assert at - start >= delays[key], (key, at - start)  # never early, on the loop's own clock
        await wait_until(q.idle, 5.0, "an idle queue", every=0.001)
    finally:
        await q.stop()


async def test_a_retry_does_not_count_as_pending_work_and_a_stop_drops_waiting_keys() -> None:
    seen: list[str] = []

    async def handle(key: str) -> None:
        seen.append(key)

    q = WorkQueue("t", handle)
    q.start()
    q.add_after("later", 0.05, progress=False)
    assert q.idle() and len(q) == 1
    await q.stop()
    assert len(q) == 0
    q.start()
    try:
        q.add("again")
        await wait_until(lambda: seen == ["again"], 5.0, "the new key", every=0.001)
        assert len(q) == 0 and q.idle()
    finally:
        await q.stop()


async def test_many_keys_due_together_are_all_released() -> None:
    seen: set[int] = set()

    async def handle(key: int) -> None:
        seen.add(key)

    q = WorkQueue("t", handle, workers=2)
    q.start()
    try:
        for i in range(200):
            q.add_after(i, 0.01 + (i % 7) * 0.001)
        await wait_until(lambda: len(seen) == 200, 5.0, "every key", every=0.001)
        await wait_until(q.idle, 5.0, "an idle queue", every=0.001)
    finally:
        await q.stop()


async def test_a_timer_that_fires_early_does_not_release_its_key_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop with a coarse clock (uvloop's is a millisecond) may fire a timer before its time; a controller
    step woken early would find itself not yet due and wait for a timer it already set, for ever."""
    loop = asyncio.get_running_loop()
    real_call_at = loop.call_at

    def early(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        return real_call_at(when - 0.01, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", early)
    seen: list[float] = []

    async def handle(key: str) -> None:
        seen.append(loop.time())

    q = WorkQueue("t", handle)
    q.start()
    try:
        start = loop.time()
        q.add_after("k", 0.03)
        await wait_until(lambda: bool(seen), 5.0, "the key", every=0.001)
        assert seen[0] - start >= 0.03
    finally:
        await q.stop()
