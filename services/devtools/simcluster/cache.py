"""Controller plumbing for the simulated cluster: an informer cache fed by the store (the controllers' work queue is
the platform's, ``services.platform.workqueue``: client-go style, as the enforcer's).

:class:`Cache` keeps the current objects of a few resources, updated synchronously by the store's ``on_change``
callback, so controllers read a consistent view without round trips.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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
