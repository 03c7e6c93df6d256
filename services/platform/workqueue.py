"""A work queue of keys to reconcile, as client-go's ``util/workqueue``: keys are deduplicated while they wait, a
key is never processed by two workers at once (one added meanwhile is processed once more afterwards, with whatever
is true then), delayed adds come in time order and never early, and the queue owns retries: a key whose handler
raised is retried after its per-key backoff.

Delayed adds are *progress* (a step that will happen) unless they are retries, so :meth:`WorkQueue.idle` tells a
quiet queue from a busy one; :meth:`WorkQueue.empty` also counts retries. With ``hold_retries`` a key waiting for
its retry is not processed early when it is added again: its retry runs with the latest state anyway, and a server
that failed is not called sooner than its backoff (the enforcer's quota writes). With ``share`` at most so many keys of
one group are processed at once, and a group's backlog waits behind its own keys, not ahead of another group's (the
enforcer's nudges: one tenant's hundreds of VMIs must not hold back another tenant's one).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from services.platform.logs import get_logger
from shared.backoff import Backoff

K = TypeVar("K", bound=Hashable)
RetryHook = Callable[[K, BaseException, int, float], None]
"""Called when a handler raised: (key, the error, the attempt it was, the delay before the retry)."""

CLIENT_GO_BACKOFF = Backoff(initial=0.005, maximum=1000.0, jitter=0.0)
"""client-go's per-item exponential backoff: 5 ms, doubling, up to 1000 s."""


class WorkQueue(Generic[K]):
    """A deduplicating work queue with delayed adds and per-key retries, processed by ``workers`` tasks.

    ``handler(key)`` processes one key. When it raises, the key is retried after its backoff (``backoff``, never
    shorter than an error's ``retry_after`` up to the backoff's maximum); ``on_retry`` hears of it (by default a
    warning is logged). :meth:`forget` resets a key's backoff (call it when the key succeeded). ``share``: (the group
    of a key, how many keys of one group may be processed at once)."""

    def __init__(
        self,
        name: str,
        handler: Callable[[K], Awaitable[None]],
        *,
        workers: int = 1,
        backoff: Backoff = CLIENT_GO_BACKOFF,
        hold_retries: bool = False,
        on_retry: RetryHook[K] | None = None,
        share: tuple[Callable[[K], Hashable], int] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("a work queue needs a worker")
        if share is not None and share[1] < 1:
            raise ValueError("a group's share must be at least one key")
        self.name = name
        self._handler = handler
        self._backoff = backoff
        self._hold_retries = hold_retries
        self._on_retry = on_retry
        self._workers_n = workers
        self._ready: deque[K] = deque()
        self._share = share
        self._in_group: dict[Hashable, int] = {}
        """With ``share``: group → how many of its keys are being processed (dropped at none)."""
        self._parked: dict[Hashable, deque[K]] = {}
        """With ``share``: group → its ready keys taken off :attr:`_ready` while the group had its share processed,
        in order; one goes back to the front of :attr:`_ready` each time one of the group's keys is done."""
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._retrying: set[K] = set()
        """Keys waiting for their retry (with ``hold_retries``: an add does not make them ready early)."""
        self._delayed: list[tuple[float, int, K, bool]] = []
        self._delayed_progress = 0
        self._seq = itertools.count()
        self._failures: dict[K, int] = {}
        self._has_ready = asyncio.Event()
        self._settled = asyncio.Event()
        """Set whenever nothing is being processed."""
        self._settled.set()
        self._timer: tuple[float, asyncio.Handle] | None = None
        """A loop timer for the earliest delayed key: (when, handle)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._log = get_logger(component="workqueue", queue=name)

    # ---- adding -------------------------------------------------------------------------------------------
    def add(self, key: K) -> None:
        if self._stopping:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        if self._hold_retries and key in self._retrying:
            return  # (its retry comes with whatever is true then)
        if key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)
            self._has_ready.set()

    def add_after(self, key: K, delay: float, *, progress: bool = True) -> None:
        """Add ``key`` after ``delay`` seconds. ``progress=False`` marks a retry that keeps nobody waiting."""
        if self._stopping:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        heapq.heappush(self._delayed, (when, next(self._seq), key, progress))
        if progress:
            self._delayed_progress += 1
        # A loop timer for the earliest key: it is ready in the loop iteration its time comes (a timer task would
        # take a few more iterations, each as long as everything else the loop has to do then).
        if self._timer is None or when < self._timer[0]:
            if self._timer is not None:
                self._timer[1].cancel()
            self._arm(loop, when)

    def backoff(self, key: K, retry_after: float | None = None) -> float:
        """The delay the next :meth:`add_rate_limited` of ``key`` would use."""
        return self._backoff.delay(self._failures.get(key, 0), retry_after=retry_after)

    def add_rate_limited(self, key: K, retry_after: float | None = None) -> float:
        """Retry ``key`` after its per-key backoff; returns the delay."""
        delay = self.backoff(key, retry_after)
        self._failures[key] = self._failures.get(key, 0) + 1
        self._retrying.add(key)
        self.add_after(key, delay, progress=False)
        return delay

    def forget(self, key: K) -> None:
        """``key`` succeeded: its next retry starts from the first backoff step."""
        self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        """How many times in a row ``key`` was retried."""
        return self._failures.get(key, 0)

    # ---- state --------------------------------------------------------------------------------------------
    def processing(self, key: K) -> bool:
        """Whether ``key`` is being processed now."""
        return key in self._processing

    def idle(self) -> bool:
        """Nothing ready, nothing being processed, no pending progress (retries do not count)."""
        return not self._queued and not self._processing and not self._dirty and self._delayed_progress == 0

    def empty(self) -> bool:
        """Nothing ready, being processed or waiting, retries included."""
        return self.idle() and not self._delayed

    def __len__(self) -> int:
        return len(self._queued) + len(self._delayed)

    # ---- running ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._tasks:
            return
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"{self.name}-worker-{i}") for i in range(self._workers_n)
        ]

    async def drain(self, within: float) -> bool:
        """Let what is being processed finish, up to ``within`` seconds (nothing new starts meanwhile); True when
        it did."""
        self._stopping = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), within)
        return self._settled.is_set()

    async def stop(self) -> None:
        """Stop the workers (what is being processed is cancelled) and drop what was waiting."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self._timer is not None:
            self._timer[1].cancel()
            self._timer = None
        self._ready.clear()
        self._parked.clear()
        self._in_group.clear()
        self._queued.clear()
        self._delayed.clear()
        self._delayed_progress = 0
        self._dirty.clear()
        self._retrying.clear()
        self._processing.clear()
        self._settled.set()

    def _release_due(self, now: float) -> None:
        """Move the keys due by ``now`` to ready."""
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key, progress = heapq.heappop(self._delayed)
            if progress:
                self._delayed_progress -= 1
            else:
                self._retrying.discard(key)
            self.add(key)

    def _due(self) -> None:
        """The timer fired: release every key whose time has come, and set it for the next one. Never early: a
        controller that finds its step not yet due waits for the timer it already set, so a key released before its
        time would be lost; a loop may fire a timer up to a clock tick early (uvloop's is a millisecond), and then
        nothing is released and the timer is set again."""
        loop = asyncio.get_running_loop()
        self._timer = None
        self._release_due(loop.time())
        if self._delayed:
            self._arm(loop, self._delayed[0][0])

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._timer = (when, loop.call_at(when, self._due))

    def _take(self) -> K | None:
        """The next ready key to process (None: none may be now), parking those whose group has its share."""
        while self._ready:
            key = self._ready.popleft()
            if self._share is not None:
                group = self._share[0](key)
                if self._in_group.get(group, 0) >= self._share[1]:
                    self._parked.setdefault(group, deque()).append(key)
                    continue
                self._in_group[group] = self._in_group.get(group, 0) + 1
            return key
        return None

    def _done(self, key: K) -> None:
        """With ``share``: ``key`` is no longer processed; its group's oldest parked key, if any, is ready first."""
        if self._share is None:
            return
        group = self._share[0](key)
        left = self._in_group[group] - 1
        if left:
            self._in_group[group] = left
        else:
            del self._in_group[group]
        parked = self._parked.get(group)
        if parked:
            self._ready.appendleft(parked.popleft())
            if not parked:
                del self._parked[group]
            self._has_ready.set()

    async def _worker(self) -> None:
        while True:
            key = None if self._stopping else self._take()
            if key is None:
                self._has_ready.clear()
                await self._has_ready.wait()
                continue
            self._queued.discard(key)
            self._processing.add(key)
            self._settled.clear()
            try:
                await self._handler(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                attempt = self._failures.get(key, 0)
                delay = self.add_rate_limited(key, getattr(e, "retry_after", None))
                if self._on_retry is not None:
                    self._on_retry(key, e, attempt + 1, delay)
                else:
                    self._log.warning("sync failed, retrying", key=str(key), error=str(e), retry_in=round(delay, 6))
            finally:
                self._processing.discard(key)
                self._done(key)
                if not self._processing:
                    self._settled.set()
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
