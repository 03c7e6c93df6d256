"""Controller plumbing for the simulated cluster: an informer cache fed by the store, and client-go style work queues.

:class:`Cache` keeps the current objects of a few resources, updated synchronously by the store's ``on_change``
callback, so controllers read a consistent view without round trips. :class:`WorkQueue` is a rate-limited queue
as in ``k8s.io/client-go/util/workqueue``: keys are deduplicated, a key is never processed by two workers at
once, delayed adds, and per-item exponential backoff. Delayed adds are *progress* (a pod that will start, a
migration step) unless marked as a retry, so :meth:`WorkQueue.idle` can tell a quiet cluster from a busy one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from services.devtools.simcluster.store_api import Obj, Resource, StoreAPI, WatchType
from services.platform.logs import get_logger

Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
Handler = Callable[[WatchType, Obj, Obj | None], None]


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def uid_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def rv_of(obj: Mapping[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class Cache:
    """The current objects of some resources, by resource key and (namespace, name).

    Objects handed out are the cache's own: treat them as read-only (write through the store).
    """

    def __init__(self, store: StoreAPI, resources: Iterable[str]) -> None:
        self.store = store
        self.resources: dict[str, Resource] = {}
        for name in resources:
            res = store.resource(name)
            self.resources[res.key] = res
        self._objs: dict[str, dict[Key, Obj]] = {k: {} for k in self.resources}
        self._by_ns: dict[str, dict[str, dict[str, Obj]]] = {k: {} for k in self.resources}
        self._handlers: dict[str, list[Handler]] = {k: [] for k in self.resources}
        self._indexers: dict[str, dict[str, Callable[[Obj], Iterable[str]]]] = {k: {} for k in self.resources}
        self._indexes: dict[tuple[str, str], dict[str, dict[Key, Obj]]] = {}
        self._deleted: set[tuple[str, Key]] = set()
        self._started = False
        self._listing = False
        self._log = get_logger(component="simcluster-cache")

    def res(self, name: str) -> Resource:
        return self.store.resource(name)

    def add_index(self, resource: str, name: str, fn: Callable[[Obj], Iterable[str]]) -> None:
        """Index objects by the values ``fn(obj)`` returns (client-go's Indexers); add before :meth:`start`."""
        rkey = self.res(resource).key
        self._indexers[rkey][name] = fn
        index: dict[str, dict[Key, Obj]] = {}
        for k, obj in self._objs[rkey].items():
            for v in fn(obj):
                index.setdefault(v, {})[k] = obj
        self._indexes[(rkey, name)] = index

    def by_index(self, resource: str, name: str, value: str) -> list[Obj]:
        return list(self._indexes[(self.res(resource).key, name)].get(value, {}).values())

    def _unindex(self, rkey: str, k: Key, obj: Obj) -> None:
        for name, fn in self._indexers[rkey].items():
            index = self._indexes[(rkey, name)]
            for v in fn(obj):
                bucket = index.get(v)
                if bucket is not None:
                    bucket.pop(k, None)
                    if not bucket:
                        del index[v]

    def subscribe(self, resource: str, handler: Handler) -> None:
        """``handler(type, obj, old)`` is called synchronously for every change of that resource."""
        self._handlers[self.res(resource).key].append(handler)

    async def start(self) -> None:
        """Register with the store first, then list, so that nothing in between is missed."""
        if self._started:
            return
        self._started = True
        self._listing = True
        self.store.on_change(self._on_change)
        for rkey, res in self.resources.items():
            items, _ = await self.store.list(res)
            for obj in items:
                k = key_of(obj)
                if k in self._objs[rkey] or (rkey, k) in self._deleted:
                    continue
                self._put(rkey, k, obj)
                for h in self._handlers[rkey]:
                    self._call(h, "ADDED", obj, None)
        self._listing = False
        self._deleted.clear()

    def _put(self, rkey: str, k: Key, obj: Obj) -> None:
        old = self._objs[rkey].get(k)
        if old is not None:
            self._unindex(rkey, k, old)
        self._objs[rkey][k] = obj
        self._by_ns[rkey].setdefault(k[0], {})[k[1]] = obj
        for name, fn in self._indexers[rkey].items():
            index = self._indexes[(rkey, name)]
            for v in fn(obj):
                index.setdefault(v, {})[k] = obj

    def _drop(self, rkey: str, k: Key) -> None:
        old = self._objs[rkey].pop(k, None)
        if old is not None:
            self._unindex(rkey, k, old)
        ns = self._by_ns[rkey].get(k[0])
        if ns is not None:
            ns.pop(k[1], None)
            if not ns:
                del self._by_ns[rkey][k[0]]

    def _on_change(self, type_: WatchType, res: Resource, obj: Obj) -> None:
        rkey = res.key
        if rkey not in self._objs or type_ not in ("ADDED", "MODIFIED", "DELETED"):
            return
        k = key_of(obj)
        old = self._objs[rkey].get(k)
        if old is not None and rv_of(old) > rv_of(obj) > 0:
            return  # an older version than the one held
        if type_ == "DELETED":
            self._drop(rkey, k)
            if self._listing:
                self._deleted.add((rkey, k))
        else:
            self._put(rkey, k, obj)
        for h in self._handlers[rkey]:
            self._call(h, type_, obj, old)

    def _call(self, handler: Handler, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        try:
            handler(type_, obj, old)
        except Exception as e:  # a handler bug must not break the store's write path
            self._log.exception("informer handler failed", error=str(e))

    # ---- reads ------------------------------------------------------------------------------------------------
    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        return self._objs[self.res(resource).key].get((namespace, name))

    def list(self, resource: str, namespace: str | None = None) -> list[Obj]:
        rkey = self.res(resource).key
        if namespace is None:
            return list(self._objs[rkey].values())
        return list(self._by_ns[rkey].get(namespace, {}).values())


class WorkQueue:
    """A deduplicating, rate-limited work queue with delayed adds, processed by ``workers`` tasks.

    ``handler(key)`` processes one key; an exception is logged and the key is retried with backoff.
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[Any], Awaitable[None]],
        *,
        base_delay: float = 0.005,
        max_delay: float = 1000.0,
        workers: int = 1,
    ) -> None:
        self.name = name
        self._handler = handler
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._workers_n = workers
        self._ready: deque[Any] = deque()
        self._queued: set[Any] = set()
        self._processing: set[Any] = set()
        self._dirty: set[Any] = set()
        self._delayed: list[tuple[float, int, Any, bool]] = []
        self._delayed_progress = 0
        self._seq = itertools.count()
        self._failures: dict[Any, int] = {}
        self._has_ready = asyncio.Event()
        self._timer: tuple[float, asyncio.Handle] | None = None
        """A loop timer for the earliest delayed key: (when, handle)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._log = get_logger(component="simcluster-queue", queue=name)

    # ---- adding -------------------------------------------------------------------------------------------
    def add(self, key: Any) -> None:
        if self._stopping:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        if key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)
            self._has_ready.set()

    def add_after(self, key: Any, delay: float, *, progress: bool = True) -> None:
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

    def backoff(self, key: Any) -> float:
        """The delay the next :meth:`add_rate_limited` of ``key`` would use."""
        n = self._failures.get(key, 0)
        return float(min(self.base_delay * (2**n), self.max_delay))

    def add_rate_limited(self, key: Any) -> float:
        """Retry ``key`` after its per-item exponential backoff; returns the delay."""
        delay = self.backoff(key)
        self._failures[key] = self._failures.get(key, 0) + 1
        self.add_after(key, delay, progress=False)
        return delay

    def forget(self, key: Any) -> None:
        self._failures.pop(key, None)

    # ---- state --------------------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing ready, nothing being processed, no pending progress (backoff retries do not count)."""
        return not self._ready and not self._processing and not self._dirty and self._delayed_progress == 0

    def __len__(self) -> int:
        return len(self._ready) + len(self._delayed)

    # ---- running ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._tasks:
            return
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._worker(), name=f"{self.name}-worker-{i}") for i in range(self._workers_n)
        ]

    async def stop(self) -> None:
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
        self._queued.clear()
        self._delayed.clear()
        self._delayed_progress = 0
        self._dirty.clear()
        self._processing.clear()

    def _release_due(self, now: float) -> None:
        """Move the keys due by ``now`` to ready."""
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key, progress = heapq.heappop(self._delayed)
            if progress:
                self._delayed_progress -= 1
            self.add(key)

    def _due(self) -> None:
        """The timer fired: release every key whose time has come, and set it for the next one. Never early: a
        controller that finds its step not yet due waits for the timer it already set (``Steps``), so a key
        released before its time would be lost; a loop may fire a timer up to a clock tick early (uvloop's is a
        millisecond), and then nothing is released and the timer is set again."""
        loop = asyncio.get_running_loop()
        self._timer = None
        self._release_due(loop.time())
        if self._delayed:
            self._arm(loop, self._delayed[0][0])

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._timer = (when, loop.call_at(when, self._due))

    async def _worker(self) -> None:
        while True:
            if not self._ready:
                self._has_ready.clear()
                await self._has_ready.wait()
                continue
            key = self._ready.popleft()
            self._queued.discard(key)
            self._processing.add(key)
            try:
                await self._handler(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = self.add_rate_limited(key)
                self._log.warning("sync failed, retrying", key=str(key), error=str(e), retry_in=round(delay, 6))
            finally:
                self._processing.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
