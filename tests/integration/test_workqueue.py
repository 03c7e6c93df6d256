"""The controllers' work queue (the simulated cluster's and the enforcer's): delayed adds are released in time
order, never early, a stop drops what was waiting, and retries are the queue's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.platform.workqueue import WorkQueue
from shared.backoff import Backoff
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


class Failure(Exception):
    def __init__(self, retry_after: float | None = None) -> None:
        super().__init__("failed")
        self.retry_after = retry_after


async def test_a_failed_key_is_retried_after_its_backoff_and_forgotten_once_it_succeeds() -> None:
    loop = asyncio.get_running_loop()
    seen: list[float] = []
    retries: list[tuple[str, int, float]] = []

    async def handle(key: str) -> None:
        seen.append(loop.time())
        if len(seen) < 3:
            raise Failure(retry_after=0.05 if len(seen) == 2 else None)
        q.forget(key)

    q: WorkQueue[str] = WorkQueue(
        "t",
        handle,
        backoff=Backoff(initial=0.01, maximum=1.0, jitter=0.0),
        on_retry=lambda key, e, attempt, delay: retries.append((key, attempt, delay)),
    )
    q.start()
    try:
        q.add("k")
        await wait_until(lambda: len(seen) == 3, 5.0, "two retries", every=0.001)
        assert [(k, n) for k, n, _ in retries] == [("k", 1), ("k", 2)]
        assert retries[0][2] == 0.01 and retries[1][2] == 0.05  # (the second honours the error's retry_after)
        assert seen[1] - seen[0] >= 0.01 and seen[2] - seen[1] >= 0.05
        await wait_until(q.empty, 5.0, "nothing left", every=0.001)
        assert q.failures("k") == 0
    finally:
        await q.stop()


async def test_with_hold_retries_an_add_does_not_run_a_key_before_its_retry() -> None:
    """The enforcer's quota writes: a key whose write failed (a 429, a 5xx) is not written again sooner than its
    backoff, however many inputs mark it; its retry runs with the latest state."""
    loop = asyncio.get_running_loop()
    seen: list[float] = []

    async def handle(key: str) -> None:
        seen.append(loop.time())
        if len(seen) == 1:
            raise Failure()

    q: WorkQueue[str] = WorkQueue("t", handle, backoff=Backoff(initial=0.1, maximum=1.0, jitter=0.0), hold_retries=True)
    q.start()
    try:
        q.add("k")
        await wait_until(lambda: len(seen) == 1 and not q.empty(), 5.0, "the failure", every=0.001)
        for _ in range(5):
            q.add("k")
        assert not q.empty() and q.idle()  # (waiting for its retry: not progress, but not empty)
        await wait_until(lambda: len(seen) == 2, 5.0, "the retry", every=0.001)
        assert seen[1] - seen[0] >= 0.1
        await wait_until(q.empty, 5.0, "nothing left", every=0.001)
        assert len(seen) == 2
    finally:
        await q.stop()


async def test_a_drain_lets_what_is_processed_finish_and_starts_nothing_new() -> None:
    release = asyncio.Event()
    done: list[str] = []

    async def handle(key: str) -> None:
        await release.wait()
        done.append(key)

    q: WorkQueue[str] = WorkQueue("t", handle)
    q.start()
    try:
        q.add("a")
        q.add("b")
        await wait_until(lambda: not q.idle() and len(q) == 1, 5.0, "a in process", every=0.001)
        drained = asyncio.create_task(q.drain(5.0))
        release.set()
        assert await drained
        assert done == ["a"]
    finally:
        await q.stop()


async def test_a_groups_backlog_waits_behind_its_own_share_not_ahead_of_another_group() -> None:
    """With ``share``, at most so many keys of one group are processed at once, whatever the workers; a key of
    another group added after a group's long backlog is processed at once, and the backlog all in turn, in order."""
    release = asyncio.Event()
    under_way: dict[str, int] = {}
    most: dict[str, int] = {}
    done: list[tuple[str, int]] = []
    started: list[int] = []

    async def handle(key: tuple[str, int]) -> None:
        group = key[0]
        if group == "busy":
            started.append(key[1])
        under_way[group] = under_way.get(group, 0) + 1
        most[group] = max(most.get(group, 0), under_way[group])
        try:
            if group == "busy":
                await release.wait()
            done.append(key)
        finally:
            under_way[group] -= 1

    q: WorkQueue[tuple[str, int]] = WorkQueue("t", handle, workers=8, share=(lambda k: k[0], 3))
    q.start()
    try:
        for i in range(50):
            q.add(("busy", i))
        q.add(("other", 0))
        await wait_until(lambda: ("other", 0) in done, 5.0, "the other group's key, past the backlog", every=0.001)
        assert most == {"busy": 3, "other": 1} and under_way["busy"] == 3
        assert not q.idle() and len(q) == 47
        release.set()
        await wait_until(q.idle, 5.0, "the backlog done", every=0.001)
        assert started == list(range(50)) and len(done) == 51 and most["busy"] == 3
        assert len(q) == 0
    finally:
        await q.stop()
