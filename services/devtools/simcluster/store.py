"""The simulated API server's object store: an in-memory "etcd + generic registry" implementing ``StoreAPI``.

Semantics kept faithful to kube-apiserver where clients depend on them:

- one global, monotonically increasing resourceVersion; every committed write gets the next one and produces exactly
  one watch event; a write that changes nothing is not a write (no new resourceVersion, no event);
- uid, creationTimestamp, generation, names from ``generateName``; namespaced objects need an existing, non-terminating
  namespace (404 / 403 like the real server); names are validated (422);
- optimistic concurrency: a stale ``metadata.resourceVersion`` on update or patch is a 409 Conflict with the real
  message; resources with a ``status`` subresource keep status on main writes and change only status through it;
  status is dropped on create (pods start ``Pending``, namespaces ``Active``) unless ``keep_status=True``;
- finalizers: delete sets ``deletionTimestamp``; the write that removes the last finalizer removes the object;
  no new finalizers on an object being deleted; deleting a namespace deletes everything in it, then the namespace;
  background garbage collection of dependents whose owners (``ownerReferences``) are all gone;
- watches: from now, from a resourceVersion (replayed from a bounded history; older → one ERROR event with a 410
  ``Expired`` Status), or with the current state first (synthetic ADDED, as for an unset resourceVersion over
  HTTP); label/field selectors with ADDED/DELETED on selector transitions; periodic bookmarks; per-watcher bounded
  queues: a writer waits up to ``slow_watcher_timeout`` for a lagging watcher, then disconnects it (the watch ends);
- admission hooks (mutating or refusing) run in registration order inside the write lock; the lock is re-entrant
  for the task holding it, so a hook may itself write (quota admission charges the quota's ``status.used``).

Objects are kept as encoded JSON: a read is a decode (a fresh deep copy), a list over HTTP is a join of stored
bytes, and a watch event is encoded once and shared by every watcher, so the write path is O(watchers).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal

import msgspec

from services.devtools.simcluster.auth import GARBAGE_COLLECTOR, acting_as
from services.devtools.simcluster.patch import json_patch, merge_patch, strategic_merge_patch
from services.devtools.simcluster.registry import DEFAULT_REGISTRY, Registry, ResourceInfo, format_time
from services.devtools.simcluster.selectors import (
    FieldSelector,
    LabelSelector,
    parse_field_selector,
    parse_label_selector,
)
from services.devtools.simcluster.store_api import (
    DELETE_OPTIONS,
    AdmissionHook,
    ApiError,
    Obj,
    Operation,
    Resource,
    WatchEvent,
    WatchType,
)
from services.platform.logs import get_logger
from shared.resources import DNS1123_LABEL_RE, DNS1123_SUBDOMAIN_RE
from shared.times import go_seconds

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_log = get_logger(component="simcluster.store")

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the API server uses for generateName suffixes

PatchType = Literal["merge", "json", "strategic"]
ChangeCallback = Callable[[WatchType, Resource, Obj], None]


# --- stored objects, events, watchers ---------------------------------------------------------------------------


class _Stored:
    """One object as stored: its encoded JSON plus what selectors and the garbage collector need."""

    __slots__ = ("deleting", "fields", "finalizers", "labels", "owners", "raw", "rv", "uid")

    def __init__(
        self,
        raw: bytes,
        rv: int,
        uid: str,
        labels: dict[str, str],
        fields: dict[str, str],
        owners: tuple[str, ...],
        deleting: bool,
        finalizers: bool,
    ) -> None:
        self.raw = raw
        self.rv = rv
        self.uid = uid
        self.labels = labels
        self.fields = fields
        self.owners = owners
        self.deleting = deleting
        self.finalizers = finalizers


class _Event:
    """A committed change as watchers see it (shared by all of them)."""

    __slots__ = ("_line", "fields", "key", "labels", "namespace", "prev_fields", "prev_labels", "raw", "rv", "type")

    def __init__(
        self,
        type: WatchType,
        rv: int,
        key: str,
        namespace: str,
        raw: bytes,
        labels: Mapping[str, str],
        fields: Mapping[str, str],
        prev_labels: Mapping[str, str] | None = None,
        prev_fields: Mapping[str, str] | None = None,
    ) -> None:
        self.type = type
        self.rv = rv
        self.key = key
        self.namespace = namespace
        self.raw = raw
        self.labels = labels
        self.fields = fields
        self.prev_labels = prev_labels
        self.prev_fields = prev_fields
        self._line: bytes | None = None

    def line(self, type: WatchType | None = None) -> bytes:
        """The newline-delimited JSON watch frame ``{"type":...,"object":...}`` (cached for the event's own type)."""
        if type is None or type == self.type:
            if self._line is None:
                self._line = b'{"type":"' + self.type.encode() + b'","object":' + self.raw + b"}\n"
            return self._line
        return b'{"type":"' + type.encode() + b'","object":' + self.raw + b"}\n"


# A queued watch item: (type, event) for changes, (BOOKMARK, resourceVersion) and (ERROR, Status object).
WatchItem = tuple[WatchType, Any]


class Watcher:
    """One open watch: a bounded queue of items filled synchronously by the store's commits.

    ``await next_batch()`` returns the queued items (waiting for some, or for a bookmark to fall due), or None when
    the watch has ended (timeout, disconnected as slow, dropped by a fault, closed, or after an ERROR).
    """

    def __init__(
        self,
        store: Store,
        info: ResourceInfo,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        *,
        bookmarks: bool,
        min_rv: int,
        timeout_seconds: float | None,
    ) -> None:
        self._store = store
        self.info = info
        self.resource = info.resource
        self.namespace = namespace
        self.label_selector = labels
        self.field_selector = fields
        self._filtered = not (labels.empty and fields.empty)
        self.bookmarks = bookmarks
        self.min_rv = min_rv
        self.items: deque[WatchItem] = deque()
        self.limit = store.watch_queue  # queue bound; raised when the initial state or a replay is larger
        self._half = self.limit // 2
        self.closed = False
        self.close_reason = ""
        self.consumer: asyncio.Task[Any] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drained: list[asyncio.Future[None]] = []
        loop = asyncio.get_running_loop()
        self._loop = loop
        now = loop.time()
        self.deadline = None if timeout_seconds is None else now + timeout_seconds
        self.next_bookmark = now + store.bookmark_interval

    # -- producer side (synchronous, called by the store) --

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._half = limit // 2

    def offer(self, ev: _Event) -> None:
        if self.closed or ev.rv <= self.min_rv:
            return
        if self.namespace is not None and ev.namespace != self.namespace:
            return
        if self._filtered:
            self._offer_filtered(ev)
            return
        # The hot path of every write (once per watcher): _push inlined.
        items = self.items
        if len(items) >= self.limit:
            self.close("slow watcher: queue full")
            return
        items.append((ev.type, ev))
        if len(items) > self._half:
            self._store._pressured.add(self)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _offer_filtered(self, ev: _Event) -> None:
        now = self.label_selector.matches(ev.labels) and self.field_selector.matches(ev.fields)
        if ev.type == "MODIFIED" and ev.prev_labels is not None and ev.prev_fields is not None:
            before = self.label_selector.matches(ev.prev_labels) and self.field_selector.matches(ev.prev_fields)
            if now and before:
                self._push(("MODIFIED", ev))
            elif now:
                self._push(("ADDED", ev))
            elif before:
                self._push(("DELETED", ev))
        elif now:
            self._push((ev.type, ev))

    def _push(self, item: WatchItem) -> None:
        if len(self.items) >= self.limit:
            self.close("slow watcher: queue full")
            return
        self.items.append(item)
        if len(self.items) > self._half:
            self._store._pressured.add(self)
        self._wake()

    def push_bookmark(self) -> None:
        if self.bookmarks and not self.closed:
            self.items.append(("BOOKMARK", self._store.resource_version))
            self._wake()

    def push_error(self, status: Obj) -> None:
        self.items.append(("ERROR", status))
        self.closed = True
        self.close_reason = str(status.get("message", ""))
        self._wake()

    def close(self, reason: str = "closed") -> None:
        """End the watch now; queued items are discarded (like a connection the server drops)."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.items.clear()
        self._store._unregister(self)
        self._wake()
        self._release_drain_waiters()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _release_drain_waiters(self) -> None:
        for fut in self._drained:
            if not fut.done():
                fut.set_result(None)
        self._drained.clear()

    def drained(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self._loop.create_future()
        if self.closed or len(self.items) <= self._half:
            fut.set_result(None)
        else:
            self._drained.append(fut)
        return fut

    # -- consumer side --

    def take(self) -> list[WatchItem]:
        """The queued items, without waiting (empty when there are none)."""
        if not self.items:
            return []
        out = list(self.items)
        self.items.clear()
        if self._drained:
            self._release_drain_waiters()
        if out[-1][0] == "ERROR":
            self._store._unregister(self)
        return out

    async def next_batch(self) -> list[WatchItem] | None:
        self.consumer = asyncio.current_task()
        while True:
            if self.items:
                return self.take()
            if self.closed:
                return None
            now = self._loop.time()
            timeout: float | None = None
            if self.deadline is not None:
                if now >= self.deadline:
                    self.close("timeout")
                    return None
                timeout = self.deadline - now
            if self.bookmarks:
                if now >= self.next_bookmark:
                    self.next_bookmark = now + self._store.bookmark_interval
                    return [("BOOKMARK", self._store.resource_version)]
                wait = self.next_bookmark - now
                timeout = wait if timeout is None else min(timeout, wait)
            fut: asyncio.Future[None] = self._loop.create_future()
            self._waiter = fut
            handle = None if timeout is None else self._loop.call_later(timeout, _set_done, fut)
            try:
                await fut
            finally:
                self._waiter = None
                if handle is not None:
                    handle.cancel()

    def bookmark_object(self, rv: int) -> Obj:
        r = self.resource
        return {"kind": r.kind, "apiVersion": r.api_version, "metadata": {"resourceVersion": str(rv)}}


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class StoreWatch:
    """The in-process watch iterator (``Store.watch``): yields ``WatchEvent`` with fresh object copies."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self._buf: deque[WatchItem] = deque()

    def __aiter__(self) -> StoreWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if not self._buf:
            batch = await self.watcher.next_batch()
            if batch is None:
                raise StopAsyncIteration
            self._buf.extend(batch)
        typ, payload = self._buf.popleft()
        if typ == "BOOKMARK":
            return WatchEvent("BOOKMARK", self.watcher.bookmark_object(payload))
        if typ == "ERROR":
            return WatchEvent("ERROR", dict(payload))
        return WatchEvent(typ, _decode(payload.raw))

    async def aclose(self) -> None:
        self.watcher.close()

    def close(self) -> None:
        self.watcher.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.watcher.close()


# --- the re-entrant write lock --------------------------------------------------------------------------------


class _WriteLock:
    """An asyncio lock the holding task may take again (admission hooks write while a write holds it)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[Any] | None = None
        self._depth = 0

    @property
    def owner(self) -> asyncio.Task[Any] | None:
        return self._owner

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if self._owner is task and task is not None:
            self._depth += 1
            return
        await self._lock.acquire()
        self._owner = task
        self._depth = 1

    async def __aexit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()


# --- helpers --------------------------------------------------------------------------------------------------


def _not_found(res: Resource, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{res.key} "{name}" not found', {"name": name, "group": res.group, "kind": res.plural}
    )


def conflict(res: Resource, name: str) -> ApiError:
    """The 409 a stale resourceVersion gets, with kube-apiserver's message."""
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {res.key} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        {"name": name, "group": res.group, "kind": res.plural},
    )


def _invalid(res: Resource, name: str, field: str, detail: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{res.kind} "{name}" is invalid: {field}: {detail}',
        {"name": name, "group": res.group, "kind": res.kind, "causes": [{"field": field, "message": detail}]},
    )


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _dig(obj: Any, path: str) -> Any:
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _field_values(info: ResourceInfo, obj: Obj, namespace: str, name: str) -> dict[str, str]:
    out = {"metadata.name": name, "metadata.namespace": namespace}
    for path in info.fields:
        value = _dig(obj, "source.component" if path == "source" else path)
        out[path] = "" if value is None else str(value)
    return out


def _spec_of(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}


def _resources_of(pod: Obj) -> list[Any]:
    """Each container's ``resources`` by name: what only the ``resize`` subresource may change."""
    spec = pod.get("spec") or {}
    return [
        (field, c.get("name"), c.get("resources"))
        for field in ("containers", "initContainers")
        for c in spec.get(field) or ()
        if isinstance(c, dict)
    ]


ORPHAN_FINALIZER: Final = "orphan"
"""kube-apiserver's ``metav1.FinalizerOrphanDependents``: a delete naming no propagation policy of an object that
carries it orphans the object's dependents."""


def _orphans(options: Mapping[str, Any] | None, finalizers: Iterable[str]) -> bool:
    """kube-apiserver's ``shouldOrphanDependents``: a delete's ``propagationPolicy``, else its ``orphanDependents``,
    else, naming neither, the object's finalizer ``orphan``."""
    if options and "propagationPolicy" in options:
        return bool(options["propagationPolicy"] == "Orphan")
    if options and "orphanDependents" in options:
        return options["orphanDependents"] is True
    return ORPHAN_FINALIZER in finalizers


_POD_SPEC_UPDATABLE: Final = (
    "activeDeadlineSeconds",
    "terminationGracePeriodSeconds",
    "tolerations",
    "schedulingGates",
)
"""The pod spec fields an update may change (kube-apiserver's ``ValidatePodUpdate``), besides containers' images."""


def _is_pod(res: Resource) -> bool:
    """Pods are updated, resized and deleted by rules of their own."""
    return res.plural == "pods" and not res.group


def _pod_grace(pod: Obj) -> int:
    """A pod's ``terminationGracePeriodSeconds`` (30 when unset), the grace period of its deletion."""
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return grace if isinstance(grace, int) and not isinstance(grace, bool) and grace >= 0 else 30


def _fixed_pod_spec(pod: Obj) -> Obj:
    """A pod's spec as an update may not change it (``ValidatePodUpdate``): all but its containers' and init
    containers' ``image`` (and their ``resources``, see :func:`_resources_of`) and :data:`_POD_SPEC_UPDATABLE`,
    whose changes are checked apart. ``nodeName`` is set only by a binding, ephemeral containers only through their
    subresource; a launcher pod's command names its VMI for good."""
    spec = dict(pod.get("spec") or {})
    for field in ("containers", "initContainers"):
        if field in spec:
            spec[field] = [
                {k: v for k, v in c.items() if k not in ("image", "resources")} if isinstance(c, dict) else c
                for c in spec[field] or ()
            ]
    for field in _POD_SPEC_UPDATABLE:
        spec.pop(field, None)
    return spec


def _pod_update_allowed(old: Obj, new: Obj) -> bool:
    """What ``ValidatePodUpdate`` lets a plain update change: images, ``activeDeadlineSeconds``,
    ``terminationGracePeriodSeconds``, tolerations added, scheduling gates removed (container resources only through
    ``resize``). (Two relaxations are not modelled: a negative grace period may only become 1, and a deadline only
    shrink; a gated pod's node selector and affinity may not be added to either.)"""
    if _fixed_pod_spec(new) != _fixed_pod_spec(old) or _resources_of(new) != _resources_of(old):
        return False
    new_spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    tolerations = new_spec.get("tolerations") or []
    gates = old_spec.get("schedulingGates") or []
    return all(t in tolerations for t in old_spec.get("tolerations") or ()) and all(
        g in gates for g in new_spec.get("schedulingGates") or ()
    )


def _resized(old: Obj, new: Obj) -> Obj:
    """A write to a pod's ``resize`` subresource (in-place vertical scaling, beta and on by default since
    Kubernetes 1.33): as the API server's resize strategy, only the containers' ``resources`` and
    ``resizePolicy`` are taken from the request, matched by container name; everything else stays."""
    result: Obj = copy.deepcopy(old)
    spec, asked = result.get("spec") or {}, new.get("spec") or {}
    for field in ("containers", "initContainers"):
        by_name = {c.get("name"): c for c in asked.get(field) or () if isinstance(c, dict)}
        for c in spec.get(field) or ():
            req = by_name.get(c.get("name"))
            if req is None:
                continue
            for key in ("resources", "resizePolicy"):
                if key in req:
                    c[key] = copy.deepcopy(req[key])
    if _spec_of(result) != _spec_of(old):
        meta = result.setdefault("metadata", {})
        meta["generation"] = int(meta.get("generation", 1)) + 1
    return result


class Store:
    """The in-memory object store (see the module docstring). Create it inside or outside a running loop; use it
    from one event loop."""

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        history: int = 10_000,
        watch_queue: int = 10_000,
        bookmark_interval: float = 60.0,
        slow_watcher_timeout: float = 1.0,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        garbage_collection: bool = True,
    ) -> None:
        self.registry = registry or DEFAULT_REGISTRY
        self.history_size = history
        self.watch_queue = watch_queue
        self.bookmark_interval = bookmark_interval
        self.slow_watcher_timeout = slow_watcher_timeout
        self.garbage_collection = garbage_collection
        self._clock = clock
        self._rng = random.Random(seed)
        self._rv = 0
        self._floor = 0  # the newest resourceVersion no longer replayable from history
        self._history: deque[_Event] = deque()
        self._objects: dict[str, dict[str, dict[str, _Stored]]] = {i.resource.key: {} for i in self.registry.infos}
        self._ns_count: dict[str, int] = {}
        self._owners: dict[str, tuple[str, str, str]] = {}  # uid -> (resource key, namespace, name)
        self._dependents: dict[str, set[tuple[str, str, str]]] = {}
        self._watchers: dict[str, list[Watcher]] = {i.resource.key: [] for i in self.registry.infos}
        self._hooks: dict[str, list[AdmissionHook]] = {}
        self._mutators: dict[str, list[AdmissionHook]] = {}
        self._status_on_create: set[str] = set()
        self._callbacks: list[ChangeCallback] = []
        self._pressured: set[Watcher] = set()
        self._lock_obj: _WriteLock | None = None

    @property
    def _lock(self) -> _WriteLock:
        if self._lock_obj is None:
            self._lock_obj = _WriteLock()
        return self._lock_obj

    # --- look-ups -----------------------------------------------------------------------------------------------

    def resource(self, key: str) -> Resource:
        return self.registry.resource(key)

    def info(self, res: Resource) -> ResourceInfo:
        return self.registry.info_of(res)

    @property
    def resource_version(self) -> int:
        return self._rv

    @property
    def oldest_resource_version(self) -> int:
        """The oldest resourceVersion a watch may still start from (older ones get 410)."""
        return self._floor

    def watcher_count(self, res: Resource | None = None) -> int:
        if res is not None:
            return len(self._watchers[res.key])
        return sum(len(ws) for ws in self._watchers.values())

    def _scope(self, res: Resource, namespace: str | None) -> str:
        if not res.namespaced:
            return ""
        if not namespace:
            raise _bad_request(f"a namespace is required for {res.key}")
        return namespace

    def _table(self, res: Resource) -> dict[str, dict[str, _Stored]]:
        try:
            return self._objects[res.key]
        except KeyError:
            raise ApiError(404, "NotFound", "the server could not find the requested resource") from None

    def _find(self, res: Resource, namespace: str, name: str) -> _Stored | None:
        names = self._table(res).get(namespace)
        return None if names is None else names.get(name)

    # --- reads --------------------------------------------------------------------------------------------------

    def _existing(self, res: Resource, ns: str, name: str) -> _Stored:
        """The stored object, or the API server's 404."""
        stored = self._find(res, ns, name)
        if stored is None:
            raise _not_found(res, name)
        return stored

    def get_raw(self, res: Resource, namespace: str | None, name: str) -> bytes:
        return self._existing(res, self._scope(res, namespace), name).raw

    async def get(self, res: Resource, namespace: str | None, name: str) -> Obj:
        obj: Obj = _decode(self.get_raw(res, namespace, name))
        return obj

    def peek(self, res: Resource, namespace: str | None, name: str) -> Obj | None:
        """Synchronous get for callbacks and tests: a copy, or None when absent."""
        stored = self._find(res, (namespace or "") if res.namespaced else "", name)
        return None if stored is None else _decode(stored.raw)

    def _selectors(
        self, info: ResourceInfo, label_selector: str | None, field_selector: str | None
    ) -> tuple[LabelSelector, FieldSelector]:
        labels = parse_label_selector(label_selector)
        fields = parse_field_selector(field_selector).check(info.selectable_fields)
        return labels, fields

    def list_raw(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        after: tuple[str, str] | None = None,
    ) -> tuple[list[bytes], int, tuple[str, str] | None, int]:
        """Matching objects' JSON sorted by (namespace, name), starting after ``after``; at most ``limit``.

        Returns (items, list resourceVersion, key of the last item when more remain, how many remain)."""
        info = self.info(res)
        labels, fields = self._selectors(info, label_selector, field_selector)
        table = self._table(res)
        spaces = sorted(table) if not res.namespaced or namespace is None else [namespace] if namespace in table else []
        out: list[tuple[str, str, bytes]] = []
        for ns in spaces:
            if after is not None and ns < after[0]:
                continue
            names = table[ns]
            for name in sorted(names):
                if after is not None and (ns, name) <= after:
                    continue
                stored = names[name]
                if (labels.empty or labels.matches(stored.labels)) and (fields.empty or fields.matches(stored.fields)):
                    out.append((ns, name, stored.raw))
        remaining = 0
        last: tuple[str, str] | None = None
        if limit is not None and limit > 0 and len(out) > limit:
            remaining = len(out) - limit
            out = out[:limit]
            last = (out[-1][0], out[-1][1])
        return [raw for _, _, raw in out], self._rv, last, remaining

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[Obj], int]:
        raws, rv, _, _ = self.list_raw(res, namespace, label_selector=label_selector, field_selector=field_selector)
        return [_decode(r) for r in raws], rv

    # --- writes -------------------------------------------------------------------------------------------------

    def now(self) -> float:
        """The store's clock (epoch seconds): timestamps and ages use it."""
        return self._clock()

    def _now(self) -> str:
        return format_time(self._clock())

    def _check_meta(self, res: Resource, obj: Any, name_hint: str = "") -> Obj:
        if not isinstance(obj, dict):
            raise _bad_request(f"the body of the request for {res.key} must be a JSON object")
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise _invalid(res, name_hint, "metadata", "Invalid value: must be an object")
        for field in ("labels", "annotations"):
            value = meta.get(field)
            if value is None:
                meta.pop(field, None)
                continue
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise _invalid(res, name_hint, f"metadata.{field}", "Invalid value: must be a map of strings")
        self._check_owner_references(res, name_hint, meta.get("ownerReferences"))
        for field, want in (("kind", res.kind), ("apiVersion", res.api_version)):
            have = obj.get(field)
            if have is None or have == "":
                obj[field] = want
            elif have != want:
                raise _bad_request(
                    f"the {field} of the object ({have}) does not match the {field} of the request ({want}) "
                    f"for {res.key}"
                )
        return meta

    @staticmethod
    def _check_owner_references(res: Resource, name: str, refs: Any) -> None:
        """kube-apiserver's ``ValidateOwnerReferences``: each reference names an ``apiVersion`` with a version, a
        ``kind``, a ``name`` and a ``uid``, and at most one is the controller."""
        if refs is None:
            return
        field = "metadata.ownerReferences"
        if not isinstance(refs, list) or not all(isinstance(r, dict) for r in refs):
            raise _invalid(res, name, field, "Invalid value: must be a list of objects")
        controller = ""
        for ref in refs:
            version = str(ref.get("apiVersion") or "").rpartition("/")[2]
            for key, value, why in (
                ("apiVersion", version, "version must not be empty"),
                ("kind", ref.get("kind"), "must not be empty"),
                ("name", ref.get("name"), "must not be empty"),
                ("uid", ref.get("uid"), "must not be empty"),
            ):
                if not value:
                    have = str(ref.get(key) or "")
                    raise _invalid(res, name, f"{field}.{key}", f'Invalid value: "{have}": {why}')
            if ref.get("controller") is True:
                this = f"{ref['kind']}/{ref['name']}"
                if controller:
                    raise _invalid(
                        res,
                        name,
                        field,
                        'Invalid value: Only one reference can have Controller set to true. Found "true" in '
                        f"references for {controller} and {this}",
                    )
                controller = this

    def _validate_name(self, res: Resource, name: str) -> None:
        pattern, what = (
            (DNS1123_LABEL_RE, "RFC 1123 label")
            if res.plural == "namespaces"
            else (DNS1123_SUBDOMAIN_RE, "RFC 1123 subdomain")
        )
        limit = 63 if res.plural == "namespaces" else 253
        if len(name) > limit or not pattern.match(name):
            raise _invalid(
                res,
                name,
                "metadata.name",
                f'Invalid value: "{name}": a lowercase {what} must consist of lower case alphanumeric characters, '
                f"'-' or '.', and must start and end with an alphanumeric character (at most {limit} characters)",
            )

    def _new_uid(self) -> str:
        return str(uuid.UUID(int=self._rng.getrandbits(128), version=4))

    async def create(self, res: Resource, obj: Obj, *, namespace: str | None = None, keep_status: bool = False) -> Obj:
        """See ``StoreAPI.create``. ``keep_status=True`` (in-process only) keeps a given ``status`` on a resource
        with a status subresource, to seed a scenario in one write; the real server drops it."""
        stored = await self.create_raw(res, _decode(_encode(obj)), namespace=namespace, keep_status=keep_status)
        created: Obj = _decode(stored)
        return created

    async def create_raw(
        self, res: Resource, obj: Obj, *, namespace: str | None = None, keep_status: bool = False
    ) -> bytes:
        """Create from an object the caller hands over (it is modified and kept); returns the stored JSON."""
        info = self.info(res)
        meta = self._check_meta(res, obj)
        body_ns = meta.get("namespace")
        if res.namespaced:
            if namespace and body_ns and body_ns != namespace:
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            ns = self._scope(res, namespace or body_ns)
            meta["namespace"] = ns
        else:
            ns = ""
            meta.pop("namespace", None)
        if meta.get("resourceVersion"):
            raise _bad_request("resourceVersion should not be set on objects to be created")
        async with self._lock:
            name = meta.get("name")
            if not name:
                prefix = meta.get("generateName")
                if not prefix:
                    raise _invalid(res, "", "metadata.name", "Required value: name or generateName is required")
                for _ in range(100):
                    name = str(prefix) + "".join(self._rng.choice(_NAME_CHARS) for _ in range(5))
                    if self._find(res, ns, name) is None:
                        break
                meta["name"] = name
            if not isinstance(name, str):
                raise _invalid(res, str(name), "metadata.name", "Invalid value: must be a string")
            self._validate_name(res, name)
            if res.namespaced:
                ns_obj = self._find(self.registry.resource("namespaces"), "", ns)
                if ns_obj is None:
                    raise ApiError(
                        404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "group": "", "kind": "namespaces"}
                    )
                if ns_obj.deleting:
                    raise ApiError(
                        403,
                        "Forbidden",
                        f'{res.key} "{name}" is forbidden: unable to create new content in namespace {ns} '
                        "because it is being terminated",
                        {"name": name, "group": res.group, "kind": res.plural},
                    )
            if self._find(res, ns, name) is not None:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{res.key} "{name}" already exists',
                    {"name": name, "group": res.group, "kind": res.plural},
                )
            meta["uid"] = self._new_uid()
            meta["creationTimestamp"] = self._now()
            meta["generation"] = 1
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "managedFields"):
                meta.pop(field, None)
            if "status" in res.subresources and not keep_status and res.key not in self._status_on_create:
                obj.pop("status", None)
            if res.plural == "pods" and not keep_status:
                obj["status"] = {"phase": "Pending"}
            if res.plural == "namespaces":
                labels = meta.setdefault("labels", {})
                labels["kubernetes.io/metadata.name"] = name
                obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
                if not keep_status or "status" not in obj:
                    obj["status"] = {"phase": "Active"}
            obj = await self._admit("CREATE", res, obj, None)
            stored = self._commit("ADDED", info, ns, name, obj, None)
        await self._relieve()
        return stored.raw

    async def _admit(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj:
        # mutating admission (KubeVirt's defaults) before validating (policies, webhooks, quota), as the API server
        for hook in (*self._mutators.get(res.key, ()), *self._hooks.get(res.key, ())):
            result = await hook(op, res, new, old, subresource)
            if result is not None and new is not None:
                new = result
        return new if new is not None else (old or {})

    def _prepare_update(
        self, res: Resource, stored: _Stored, new: Obj, subresource: str | None, name: str, namespace: str
    ) -> tuple[Obj, Obj]:
        """Merge ``new`` into the stored object by the (sub)resource's rules; returns (object to store, old)."""
        old: Obj = _decode(stored.raw)
        if subresource == "status":
            if "status" not in res.subresources:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            result: Obj = _decode(stored.raw)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            return result, old
        if subresource == "resize" and _is_pod(res):
            return _resized(old, new), old
        if subresource is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        meta = self._check_meta(res, new, name)
        old_meta = old["metadata"]
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        meta["name"] = name
        if res.namespaced:
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if "status" in res.subresources:
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        if old_meta.get("deletionTimestamp"):
            before = set(old_meta.get("finalizers") or ())
            added = [f for f in meta.get("finalizers") or () if f not in before]
            if added:
                raise _invalid(
                    res,
                    name,
                    "metadata.finalizers",
                    "Forbidden: no new finalizers can be added if the object is being deleted, "
                    f"found new finalizers {added}",
                )
        if _is_pod(res) and not _pod_update_allowed(old, new):
            raise _invalid(
                res,
                name,
                "spec",
                "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to "
                "existing tolerations), `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                "previously negative); container resources change only through the resize subresource",
            )
        if _spec_of(new) != _spec_of(old):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        return new, old

    async def _write_existing(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        build: Callable[[_Stored], Obj | None],
        *,
        subresource: str | None,
    ) -> bytes:
        """Common path of update, patch and mutate: ``build`` returns the requested object (None: no change)."""
        info = self.info(res)
        ns = self._scope(res, namespace)
        async with self._lock:
            stored = self._existing(res, ns, name)
            requested = build(stored)
            if requested is None:
                return stored.raw
            new, old = self._prepare_update(res, stored, requested, subresource, name, ns)
            new = await self._admit("UPDATE", res, new, old, subresource)
            new.setdefault("metadata", {})["resourceVersion"] = str(stored.rv)
            if new == old:
                return stored.raw
            meta = new["metadata"]
            # A terminating namespace goes only once it is empty (its content's finalizers hold it too).
            emptied = res.plural != "namespaces" or res.group or self._ns_count.get(name, 0) == 0
            if meta.get("deletionTimestamp") and not meta.get("finalizers") and emptied:
                result = self._commit("DELETED", info, ns, name, new, stored)
                await self._after_removal(res, ns, stored.uid)
            else:
                result = self._commit("MODIFIED", info, ns, name, new, stored)
        await self._relieve()
        return result.raw

    async def update(self, res: Resource, obj: Obj, *, subresource: str | None = None) -> Obj:
        return _decode(await self.update_raw(res, msgspec.json.decode(_encode(obj)), subresource=subresource))  # type: ignore[no-any-return]

    async def update_raw(
        self,
        res: Resource,
        obj: Obj,
        *,
        subresource: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
    ) -> bytes:
        """Replace (PUT) from an object the caller hands over. ``namespace``/``name`` (from a URL) must match the
        body's when both are given."""
        meta = self._check_meta(res, obj, name or "")
        body_name = meta.get("name")
        if name is not None and body_name and body_name != name:
            raise _bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
        name = name or body_name
        if not name or not isinstance(name, str):
            raise _invalid(res, "", "metadata.name", "Required value: name is required")
        body_ns = meta.get("namespace")
        if res.namespaced and namespace and body_ns and body_ns != namespace:
            raise _bad_request("the namespace of the provided object does not match the namespace sent on the request")
        ns = (namespace or body_ns) if res.namespaced else None
        want_rv = meta.get("resourceVersion")

        def build(stored: _Stored) -> Obj:
            if want_rv and str(want_rv) != str(stored.rv):
                raise conflict(res, name)
            return obj

        return await self._write_existing(res, ns, name, build, subresource=subresource)

    async def patch(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        patch: Any,
        patch_type: PatchType,
        *,
        subresource: str | None = None,
    ) -> Obj:
        return _decode(await self.patch_raw(res, namespace, name, patch, patch_type, subresource=subresource))  # type: ignore[no-any-return]

    async def patch_raw(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        patch: Any,
        patch_type: PatchType,
        *,
        subresource: str | None = None,
    ) -> bytes:
        info = self.info(res)
        if patch_type == "strategic" and not info.builtin:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types include: "
                "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
            )

        def build(stored: _Stored) -> Obj:
            current: Obj = _decode(stored.raw)
            if patch_type == "merge":
                if not isinstance(patch, dict):
                    raise _bad_request("merge patch must be a JSON object")
                result = merge_patch(current, patch)
            elif patch_type == "json":
                result = json_patch(current, patch)
            elif patch_type == "strategic":
                result = strategic_merge_patch(current, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {patch_type!r}")
            if not isinstance(result, dict):
                raise _bad_request("the patch does not produce an object")
            meta = result.get("metadata")
            if isinstance(meta, dict):
                rv = meta.get("resourceVersion")
                if rv and str(rv) != str(stored.rv):
                    raise conflict(res, name)
                meta["resourceVersion"] = str(stored.rv)
            return result

        return await self._write_existing(res, namespace, name, build, subresource=subresource)

    async def mutate(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        fn: Callable[[Obj], Obj | None],
        *,
        status: bool = False,
    ) -> Obj:
        def build(stored: _Stored) -> Obj | None:
            current: Obj = _decode(stored.raw)
            result = fn(current)
            if result is None:
                return None
            result.setdefault("metadata", {})["resourceVersion"] = str(stored.rv)
            return result

        raw = await self._write_existing(res, namespace, name, build, subresource="status" if status else None)
        result: Obj = _decode(raw)
        return result

    async def bind(self, res: Resource, namespace: str, name: str, node: str) -> Obj:
        """``POST pods/<name>/binding``, as the scheduler binds a pod (kube-apiserver's ``BindingREST``): admission
        sees a CREATE of the ``binding`` subresource with the ``Binding`` as its object; the pod gets ``nodeName``
        and the condition ``PodScheduled=True`` in one write. A pod already bound, being deleted or with scheduling
        gates is a 409."""
        info = self.info(res)
        ns = self._scope(res, namespace)
        async with self._lock:
            stored = self._existing(res, ns, name)
            binding: Obj = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": ns},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
            await self._admit("CREATE", res, binding, None, "binding")
            pod: Obj = _decode(stored.raw)
            bound = (pod.get("spec") or {}).get("nodeName")
            why = (
                f"pod {name} is being deleted, cannot be assigned to a host"
                if pod["metadata"].get("deletionTimestamp")
                else f'pod {name} is already assigned to node "{bound}"'
                if bound
                else f"pod {name} has non-empty .spec.schedulingGates"
                if (pod.get("spec") or {}).get("schedulingGates")
                else ""
            )
            if why:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": {why}')
            pod.setdefault("spec", {})["nodeName"] = node
            status = pod.setdefault("status", {})
            others = [c for c in status.get("conditions") or () if c.get("type") != "PodScheduled"]
            scheduled = {"type": "PodScheduled", "status": "True", "lastProbeTime": None}
            status["conditions"] = [*others, scheduled | {"lastTransitionTime": self._now()}]
            pod["metadata"]["resourceVersion"] = str(stored.rv)
            result = self._commit("MODIFIED", info, ns, name, pod, stored)
        await self._relieve()
        return _decode(result.raw)  # type: ignore[no-any-return]

    async def evict(self, res: Resource, namespace: str, name: str, delete_options: Obj | None = None) -> None:
        """``POST pods/<name>/eviction`` (kube-apiserver's ``EvictionREST``), without PodDisruptionBudgets:
        admission sees a CREATE of the ``eviction`` subresource with the ``Eviction`` as its object, and the pod is
        then deleted with the Eviction's ``deleteOptions`` (their ``propagationPolicy`` too) through the storage,
        with no admission of a pod delete, as upstream deletes it."""
        ns = self._scope(res, namespace)
        options: Obj = {"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", **(delete_options or {})}
        eviction: Obj = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
        if delete_options is not None:
            eviction["deleteOptions"] = options
        async with self._lock:
            self._existing(res, ns, name)
            await self._admit("CREATE", res, eviction, None, "eviction")
            await self._delete_locked(res, ns, name, options, admit=False)
        await self._relieve()

    async def delete(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        *,
        preconditions: Mapping[str, Any] | None = None,
        propagation: str | None = None,
    ) -> Obj:
        """See ``StoreAPI.delete``. ``preconditions`` (``uid``, ``resourceVersion``) → 409 when they do not hold;
        ``propagation="Orphan"`` leaves dependents alone (otherwise they are garbage-collected)."""
        raw = await self.delete_raw(res, namespace, name, preconditions=preconditions, propagation=propagation)
        result: Obj = _decode(raw)
        return result

    async def delete_raw(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        *,
        preconditions: Mapping[str, Any] | None = None,
        propagation: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> bytes:
        """``options``: a request's ``DeleteOptions`` as given (admission sees them so: ``orphanDependents`` too),
        else built from ``propagation`` and ``preconditions``."""
        ns = self._scope(res, namespace)
        async with self._lock:
            opts: Obj = {"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", **(options or {})}
            if propagation:
                opts["propagationPolicy"] = propagation
            if preconditions:
                opts["preconditions"] = dict(preconditions)
            raw = await self._delete_locked(res, ns, name, opts)
        await self._relieve()
        return raw

    async def _delete_locked(
        self,
        res: Resource,
        ns: str,
        name: str,
        options: Obj | None = None,
        *,
        admit: bool = True,
    ) -> bytes:
        """Delete with the request's ``options`` (None: a controller's delete, naming no policy): its
        preconditions, its propagation (:func:`_orphans`), admitted unless ``admit`` is False."""
        info = self.info(res)
        stored = self._existing(res, ns, name)
        preconditions = (options or {}).get("preconditions")
        if isinstance(preconditions, Mapping):
            want_uid = preconditions.get("uid")
            if want_uid and want_uid != stored.uid:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.key} "{name}": Precondition failed: '
                    f"UID in precondition: {want_uid}, UID in object meta: {stored.uid}",
                    {"name": name, "group": res.group, "kind": res.plural},
                )
            want_rv = preconditions.get("resourceVersion")
            if want_rv and str(want_rv) != str(stored.rv):
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.key} "{name}": Precondition failed: '
                    f"ResourceVersion in precondition: {want_rv}, ResourceVersion in object meta: {stored.rv}",
                    {"name": name, "group": res.group, "kind": res.plural},
                )
        old: Obj = _decode(stored.raw)
        if stored.deleting:
            return stored.raw
        # (admission sees the request's DeleteOptions; the garbage collector's deletes of dependents have their own)
        token = DELETE_OPTIONS.set(options or {"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions"})
        try:
            if admit:
                await self._admit("DELETE", res, None, old)
        finally:
            DELETE_OPTIONS.reset(token)
        if res.plural == "namespaces" and not res.group:
            return await self._delete_namespace(info, name, stored, old)
        collect = not _orphans(options, old["metadata"].get("finalizers") or ())
        if not collect and self.garbage_collection:
            await self._orphan_dependents(stored.uid)
            stored = self._find(res, ns, name) or stored
            kept = _decode(stored.raw)
            finalizers = kept["metadata"].get("finalizers") or []
            if ORPHAN_FINALIZER in finalizers:
                # (the garbage collector takes the finalizer off once it has orphaned the dependents)
                kept["metadata"]["finalizers"] = [f for f in finalizers if f != ORPHAN_FINALIZER] or None
                if kept["metadata"]["finalizers"] is None:
                    del kept["metadata"]["finalizers"]
                stored = self._commit("MODIFIED", info, ns, name, kept, stored)
                old = kept
        if stored.finalizers:
            new: Obj = _decode(stored.raw)
            # (a pod is deleted gracefully, as kube-apiserver does: its deletionTimestamp is when its grace period
            # ends, and quota charges it until then, or until the kubelet has ended it)
            grace = _pod_grace(new) if _is_pod(res) else 0
            new["metadata"]["deletionTimestamp"] = format_time(self._clock() + go_seconds(grace).total_seconds())
            new["metadata"]["deletionGracePeriodSeconds"] = grace
            return self._commit("MODIFIED", info, ns, name, new, stored).raw
        result = self._commit("DELETED", info, ns, name, old, stored)
        await self._after_removal(res, ns, stored.uid, collect=collect)
        return result.raw

    async def _delete_namespace(self, info: ResourceInfo, name: str, stored: _Stored, old: Obj) -> bytes:
        new: Obj = _decode(stored.raw)
        new["metadata"]["deletionTimestamp"] = self._now()
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        new["status"] = {"phase": "Terminating"}
        result = self._commit("MODIFIED", info, "", name, new, stored)
        for other in self.registry.infos:
            r = other.resource
            if not r.namespaced:
                continue
            names = self._objects[r.key].get(name)
            for obj_name in sorted(names or ()):
                current = self._find(r, name, obj_name)
                if current is not None and not current.deleting:
                    await self._delete_locked(r, name, obj_name)
        finished = await self._finish_namespace(name)
        return finished or result.raw

    async def _finish_namespace(self, name: str) -> bytes | None:
        """Remove a terminating namespace once nothing is left in it (and it has no finalizers of its own)."""
        ns_res = self.registry.resource("namespaces")
        stored = self._find(ns_res, "", name)
        if stored is None or not stored.deleting or stored.finalizers or self._ns_count.get(name, 0) > 0:
            return None
        obj: Obj = _decode(stored.raw)
        obj.get("spec", {}).pop("finalizers", None)
        result = self._commit("DELETED", self.info(ns_res), "", name, obj, stored)
        await self._after_removal(ns_res, "", stored.uid)
        return result.raw

    async def _orphan_dependents(self, uid: str) -> None:
        """The garbage collector's orphaning (``propagationPolicy: Orphan``): it takes the owner's references off
        each dependent, as its own identity (admission sees it so), before the owner goes."""

        def without(stored: _Stored) -> Obj | None:
            obj: Obj = _decode(stored.raw)
            refs = obj["metadata"].get("ownerReferences") or []
            kept = [r for r in refs if not (isinstance(r, dict) and r.get("uid") == uid)]
            if len(kept) == len(refs):
                return None
            if kept:
                obj["metadata"]["ownerReferences"] = kept
            else:
                obj["metadata"].pop("ownerReferences", None)
            obj["metadata"]["resourceVersion"] = str(stored.rv)
            return obj

        for key, dns, dname in sorted(self._dependents.get(uid, ())):
            # (gone meanwhile, or refused: the collector would retry later)
            with acting_as(GARBAGE_COLLECTOR), contextlib.suppress(ApiError):
                await self._write_existing(self.registry.resource(key), dns, dname, without, subresource=None)

    async def _after_removal(self, res: Resource, ns: str, uid: str, *, collect: bool = True) -> None:
        if ns:
            await self._finish_namespace(ns)
        dependents = self._dependents.pop(uid, None)
        if not dependents or not collect or not self.garbage_collection:
            return
        for key, dns, dname in sorted(dependents):
            dres = self.registry.resource(key)
            current = self._find(dres, dns, dname)
            if current is None or current.deleting:
                continue
            if all(owner not in self._owners for owner in current.owners):
                await self._delete_locked(dres, dns, dname)

    # --- commit and fan-out ---------------------------------------------------------------------------------------

    def _commit(
        self, type: WatchType, info: ResourceInfo, ns: str, name: str, obj: Obj, prev: _Stored | None
    ) -> _Stored:
        """Assign the next resourceVersion, store (or remove) the object, record and fan out the event."""
        res = info.resource
        self._rv += 1
        rv = self._rv
        meta = obj["metadata"]
        meta["resourceVersion"] = str(rv)
        raw = _encode(obj)
        labels = meta.get("labels") or {}
        fields = _field_values(info, obj, ns, name)
        uid = str(meta.get("uid", ""))
        owners = tuple(
            str(ref["uid"]) for ref in meta.get("ownerReferences") or () if isinstance(ref, dict) and ref.get("uid")
        )
        stored = _Stored(
            raw, rv, uid, labels, fields, owners, bool(meta.get("deletionTimestamp")), bool(meta.get("finalizers"))
        )
        key = res.key
        table = self._objects[key]
        ref = (key, ns, name)
        if prev is not None:
            for owner in prev.owners:
                deps = self._dependents.get(owner)
                if deps is not None:
                    deps.discard(ref)
        if type == "DELETED":
            names = table.get(ns)
            if names is not None:
                names.pop(name, None)
                if not names:
                    del table[ns]
            self._owners.pop(uid, None)
            if ns:
                self._ns_count[ns] = self._ns_count.get(ns, 1) - 1
        else:
            names = table.get(ns)
            if names is None:
                names = table[ns] = {}
            names[name] = stored
            self._owners[uid] = ref
            for owner in owners:
                self._dependents.setdefault(owner, set()).add(ref)
            if prev is None and ns:
                self._ns_count[ns] = self._ns_count.get(ns, 0) + 1
        ev = _Event(
            type,
            rv,
            key,
            ns,
            raw,
            labels,
            fields,
            prev.labels if prev is not None else None,
            prev.fields if prev is not None else None,
        )
        history = self._history
        if len(history) >= self.history_size:
            self._floor = history.popleft().rv
            while len(history) >= self.history_size:
                self._floor = history.popleft().rv
        history.append(ev)
        for w in tuple(self._watchers[key]):
            w.offer(ev)
        if self._callbacks:
            shown = _decode(raw)  # one copy for every callback (read-only: see on_change)
            for cb in self._callbacks:
                try:
                    cb(type, res, shown)
                except Exception:
                    _log.exception("on_change callback failed", resource=key, namespace=ns, name=name)
        return stored

    async def _relieve(self) -> None:
        """Backpressure: wait (bounded) for watchers whose queues are over half full; disconnect those that stay so."""
        if not self._pressured:
            return
        me = asyncio.current_task()
        if self._lock_obj is not None and self._lock_obj.owner is me:
            return  # a write nested in an admission hook: the outer write relieves after releasing the lock
        waiting = [w for w in self._pressured if not w.closed and w.consumer is not me]
        self._pressured.clear()
        if not waiting:
            return
        futs = [w.drained() for w in waiting]
        _, pending = await asyncio.wait(futs, timeout=self.slow_watcher_timeout)
        for w, fut in zip(waiting, futs, strict=True):
            if fut in pending:
                fut.cancel()
                _log.info("disconnecting slow watcher", resource=w.resource.key, queued=len(w.items))
                w.close("slow watcher")

    # --- watches ------------------------------------------------------------------------------------------------

    def open_watch(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        resource_version: int | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        bookmarks: bool = False,
        initial_events: bool = False,
        timeout_seconds: float | None = None,
    ) -> Watcher:
        """Register a watcher now (must be called with a running loop). ``initial_events``: first an ADDED for
        every matching object (at its own resourceVersion), then changes, as for an HTTP watch without a
        resourceVersion or with ``0``. Otherwise changes after ``resource_version`` (None: from now)."""
        info = self.info(res)
        labels, fields = self._selectors(info, label_selector, field_selector)
        ns = namespace if res.namespaced else None
        start = self._rv if resource_version is None or initial_events else resource_version
        w = Watcher(self, info, ns, labels, fields, bookmarks=bookmarks, min_rv=start, timeout_seconds=timeout_seconds)
        if initial_events:
            table = self._objects[res.key]
            for space in sorted(table) if ns is None else [ns]:
                for _, stored in sorted((table.get(space) or {}).items()):
                    if labels.matches(stored.labels) and fields.matches(stored.fields):
                        w.items.append(("ADDED", _Event("ADDED", stored.rv, res.key, space, stored.raw, {}, {})))
        elif resource_version is not None and resource_version < self._floor:
            w.push_error(
                ApiError(410, "Expired", f"too old resource version: {resource_version} ({self._floor + 1})").status()
            )
            return w
        elif resource_version is not None and resource_version < self._rv:
            replay: list[_Event] = []
            for ev in reversed(self._history):
                if ev.rv <= resource_version:
                    break
                if ev.key == res.key:
                    replay.append(ev)
            w.set_limit(self.watch_queue + len(replay))
            for ev in reversed(replay):
                w.offer(ev)
            w.min_rv = self._rv
        w.set_limit(max(w.limit, self.watch_queue + len(w.items)))
        self._watchers[res.key].append(w)
        return w

    def watch(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        resource_version: int | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        bookmarks: bool = False,
        initial_events: bool = False,
        timeout_seconds: float | None = None,
    ) -> StoreWatch:
        """See ``StoreAPI.watch``; registered at call time, so no change after the call is missed. Extensions:
        ``initial_events`` (see ``open_watch``) and ``timeout_seconds`` (the iteration ends then)."""
        return StoreWatch(
            self.open_watch(
                res,
                namespace,
                resource_version=resource_version,
                label_selector=label_selector,
                field_selector=field_selector,
                bookmarks=bookmarks,
                initial_events=initial_events,
                timeout_seconds=timeout_seconds,
            )
        )

    def _unregister(self, w: Watcher) -> None:
        ws = self._watchers.get(w.resource.key)
        if ws is not None:
            with contextlib.suppress(ValueError):
                ws.remove(w)
        self._pressured.discard(w)

    # --- hooks, callbacks, faults ------------------------------------------------------------------------------

    def add_admission(self, res: Resource, hook: AdmissionHook, *, first: bool = False, mutating: bool = False) -> None:
        hooks = (self._mutators if mutating else self._hooks).setdefault(res.key, [])
        if first:
            hooks.insert(0, hook)
        else:
            hooks.append(hook)

    def keep_status_on_create(self, res: Resource) -> None:
        """A create of ``res`` keeps the status it is written with, for its mutating admission to rewrite: a
        resource whose real kind has no status subresource (KubeVirt's VMI) but whose simulated controllers write
        its status through one."""
        self._status_on_create.add(res.key)

    def on_change(self, callback: ChangeCallback) -> None:
        """Call ``callback(type, resource, object)`` on every committed change; every callback of a change gets
        the same decoded object, which it must not modify."""
        self._callbacks.append(callback)

    def drop_watches(self, resources: Iterable[Resource] | None = None) -> int:
        """Disconnect every open watch (of the given resources); returns how many were dropped."""
        keys = [r.key for r in resources] if resources is not None else list(self._watchers)
        dropped = 0
        for key in keys:
            for w in list(self._watchers.get(key, ())):
                w.close("dropped")
                dropped += 1
        return dropped

    def compact(self, resource_version: int | None = None) -> int:
        """Forget history up to ``resource_version`` (default: all of it): watches from older versions get 410.
        Returns the new oldest version a watch may start from."""
        upto = self._rv if resource_version is None else min(resource_version, self._rv)
        while self._history and self._history[0].rv <= upto:
            self._history.popleft()
        self._floor = max(self._floor, upto)
        return self._floor

    def send_bookmarks(self) -> None:
        """Queue a bookmark (at the current resourceVersion) on every watch that asked for bookmarks, now."""
        for ws in self._watchers.values():
            for w in ws:
                w.push_bookmark()
