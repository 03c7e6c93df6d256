"""The list→watch loop of one resource (:class:`ListWatch`), which the watcher runs per resource.

List in pages, publish what is new, then watch from the list's resourceVersion with bookmarks and a server-side
timeout; re-watch from the last version seen when the server ends the watch or the connection drops; on 410 Gone
list again and diff against what it knew: ``Deleted`` for objects that vanished meanwhile, then a ``Sync`` marker per
namespace. 429, 5xx and network failures back off exponentially with jitter.

Sync markers and the ledger: a ``Sync`` for (kind, namespace) at version ``L`` makes the ledger drop what it holds
there that is not listed, and refuse later upserts at or below ``L`` of objects it does not hold. So a marker is
sent only when it describes one complete list, after every event it covers is stored (``Publisher.flush``).
The loops of kinds that do more than list and watch are in ``services.watcher.kinds``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from services.platform.kube import is_transient
from services.watcher import kube
from services.watcher.emitter import Ident, where
from services.watcher.kube import KubeError, Obj, ResourceSpec
from services.watcher.loop import (
    KnownSet,
    Recovery,
    RelistDiff,
    Tracked,
    classify,
    diff_relist,
    is_newer,
    sync_namespaces,
)
from shared import contract
from shared.errors import InvalidInput
from shared.kinds import CLUSTER_SCOPED_KINDS, POD_KIND
from shared.snapshot import labelled_launcher

if TYPE_CHECKING:
    from services.watcher.watcher import Watcher


class ListWatch:
    """The list→watch loop of one resource."""

    def __init__(self, watcher: Watcher, spec: ResourceSpec) -> None:
        self.w = watcher
        self.spec = spec
        self.kind = spec.kind
        self.known = KnownSet()
        self.rv = ""
        """The last resourceVersion seen (list, event or bookmark): where a re-watch starts."""
        self.listed = asyncio.Event()
        """Set once the first list is published."""
        self._republish: list[tuple[str, asyncio.Future[None]]] = []
        """Callers of :meth:`republish` waiting for the loop's next list, with their round's name."""
        self._interrupt = asyncio.Event()
        """Set when :meth:`republish` wants the watch ended and everything listed again."""
        self.started = False
        """Set when the first list starts."""
        self.log = watcher.log.bind(kind=spec.kind)
        self.cluster_scoped = spec.kind in CLUSTER_SCOPED_KINDS
        m = watcher.metrics
        c = watcher.config.cluster
        self._seen = m.seen.labels(c, spec.kind) if m else None
        if m is not None:  # read at each scrape: every list, watch event, backfill and forgotten namespace counts
            m.tracked.labels(c, spec.kind).set_function(self.known.__len__)

    # ---- hooks for subclasses --------------------------------------------------------------------------------
    def wanted(self, obj: Obj, ident: Ident) -> bool:
        return True

    def observe(self, typ: str, obj: Obj, ident: Ident) -> None:
        """Every object event seen (listed objects arrive as ADDED), before filtering."""

    def relisted(self) -> None:
        """After a list is processed (before the deletions and syncs it implies are queued)."""

    def sync_plan(self, diff: RelistDiff, before: set[str], context: Any) -> dict[str, list[str]]:
        """namespace → present UIDs of the sync markers a complete list implies ("" for cluster-scoped kinds)."""
        if self.cluster_scoped:
            return {"": sorted(uid for uids in diff.present.values() for uid in uids)}
        spaces = sync_namespaces(diff, before, self.w.cluster_namespaces())
        return {ns: diff.present.get(ns, []) for ns in spaces}

    def judged(self, vanished: list[tuple[str, Tracked]], context: Any) -> list[tuple[str, Tracked]]:
        """Of the objects a list lacks, those it speaks for (``context``: :meth:`list_context`): all of them."""
        return vanished

    def list_context(self) -> Any:
        """Taken before a list starts; handed to ``sync_plan`` and ``judged``."""
        return None

    reads: str | None = None
    """The kind of which :meth:`before_upsert` reads single objects, if it does (the watcher's only ``get``: see
    its RBAC)."""

    async def before_upsert(self, obj: Obj) -> None:
        """With ``reads``: what must be read and published before an object listed or watched (not deleted) is (see
        :class:`MigrationListWatch`)."""

    # ---- objects ---------------------------------------------------------------------------------------------
    def _ident(self, obj: Obj) -> Ident | None:
        try:
            return Ident(obj)
        except InvalidInput as e:
            self.w.emitter.dead_letter(self.kind, obj, f"{where(self.kind, obj)}: {e}", None)
            return None

    def upsert(self, obj: Obj, ident: Ident, *, again: str = "") -> None:
        """Publish the object if this version is new to the loop (``again``, the name of a relist a consumer asked
        for: whatever it published), and remember it."""
        if not again and not is_newer(self.known.get(ident.uid), ident.rv):
            return
        self.w.emitter.upsert(self.kind, obj, ident, again=again)
        self.known.put(
            ident.uid,
            ident.namespace,
            ident.name,
            ident.rv,
            self.kind == POD_KIND and labelled_launcher(labels_of(obj)),
        )

    def fresh(self, obj: Obj) -> None:
        """An object read outside the watch, at least as new as what the watch delivered: published when newer than
        what this loop published. The watch's events of it that are not newer are then not published
        (:func:`is_newer`), so the bus never goes back to an older version."""
        ident = self._ident(obj)
        if ident is not None and self.wanted(obj, ident):
            self.upsert(obj, ident)

    def delete(self, obj: Obj, ident: Ident) -> None:
        known = self.known.pop(ident.uid)
        if known is None and not self.wanted(obj, ident):
            return
        self.w.emitter.delete(
            self.kind, ident, uid=ident.uid, namespace=ident.namespace, name=ident.name, rv=ident.rv_text, obj=obj
        )

    def handle(self, typ: str, obj: Obj) -> None:
        """One watch event (ADDED, MODIFIED, DELETED)."""
        if self._seen is not None:
            self._seen.inc()
        ident = self._ident(obj)
        if ident is None:
            rv = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj.get("metadata"), dict) else None
            if isinstance(rv, str) and rv.isdigit():
                self.rv = rv
            return
        self.rv = ident.rv_text
        self.observe(typ, obj, ident)
        if typ == "DELETED":
            self.delete(obj, ident)
        elif self.wanted(obj, ident):
            self.upsert(obj, ident)
        else:
            self.known.pop(ident.uid)  # out of scope now (a pod of a namespace no longer managed)

    # ---- list ------------------------------------------------------------------------------------------------
    async def list_into(self, namespace: str | None, listed: dict[str, Tracked], *, again: str = "") -> str:
        """List (one namespace or all), publish what is new (``again``: everything), fill ``listed``; the list's
        resourceVersion."""
        list_rv = ""
        pages = kube.list_pages(
            self.w.api, self.spec, namespace=namespace, limit=self.w.config.page_size, timeouts=self.w.config.timeouts
        )
        async with contextlib.aclosing(pages):
            async for page in pages:
                if not list_rv:
                    list_rv = page.resource_version  # the first page's: a consistent list's version
                for obj in page.items:
                    if self._seen is not None:
                        self._seen.inc()
                    ident = self._ident(obj)
                    if ident is None:
                        continue
                    self.observe("ADDED", obj, ident)
                    if not self.wanted(obj, ident):
                        if namespace is None:
                            self.known.pop(ident.uid)
                        continue
                    listed[ident.uid] = Tracked(ident.namespace, ident.name, ident.rv)
                    if self.reads is not None:
                        await self.before_upsert(obj)
                    self.upsert(obj, ident, again=again)
                    await self.w.publisher.room()
        if not list_rv.isdigit():
            raise KubeError(0, "BadList", f"the list of {self.spec.key} has resourceVersion {list_rv!r}")
        return list_rv

    async def relist(self, reason: str, *, again: str = "") -> None:
        """List everything, publish changes (``again``: every object), deletions of vanished objects, then sync
        markers."""
        m = self.w.metrics
        if m is not None:
            m.relists.labels(self.w.config.cluster, self.kind, reason).inc()
        self.started = True
        before = self.known.namespaces()
        context = self.list_context()
        listed: dict[str, Tracked] = {}
        list_rv = await self.list_into(None, listed, again=again)
        list_rv_int = int(list_rv)
        self.relisted()
        diff = diff_relist(self.known.snapshot(), listed, list_rv_int)
        for uid, t in self.judged(diff.vanished, context):
            self.known.pop(uid)
            self.w.emitter.delete(self.kind, None, uid=uid, namespace=t.namespace, name=t.name, rv=str(t.rv), obj=None)
        plan = self.sync_plan(diff, before, context)
        await self.w.publisher.flush()
        for ns, present in sorted(plan.items()):
            self.w.emitter.sync(self.kind, ns, list_rv, present, again=again)
        self.rv = list_rv
        self.log.info(
            "listed",
            reason=reason,
            resource_version=list_rv,
            objects=len(listed),
            vanished=len(diff.vanished),
            syncs=len(plan),
        )
        self.listed.set()

    # ---- watch -----------------------------------------------------------------------------------------------
    async def watch_once(self) -> tuple[int, float]:
        """One watch from ``self.rv`` until the server ends it; (events handled, seconds it lasted)."""
        cfg = self.w.config
        loop = asyncio.get_running_loop()
        started = loop.time()
        count = 0
        timeout = int(cfg.timeouts.watch * self.w.rng.uniform(1.0, 1.25))
        stream = kube.watch(self.w.api, self.spec, self.rv, timeout_seconds=timeout, timeouts=cfg.timeouts)
        async with contextlib.aclosing(stream):  # close the connection at once when handling fails
            async for ev in stream:
                if ev.type == "BOOKMARK":
                    meta = ev.object.get("metadata")
                    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                    # (a version that is not one, from a proxy or a broken server: every watch sent it was refused
                    # with a 400, backed off and sent again, and the kind's events stopped for good)
                    with contextlib.suppress(InvalidInput):
                        contract.resource_version(rv, "a bookmark's resourceVersion")
                        self.rv = str(rv)
                    continue
                if ev.type == "ERROR":
                    raise kube.error_from_status(ev.object)
                if ev.type not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                count += 1
                if self.reads is not None and ev.type != "DELETED":
                    await self.before_upsert(ev.object)
                self.handle(ev.type, ev.object)
                await self.w.publisher.room()
        return count, loop.time() - started

    def republish(self, again: str) -> asyncio.Future[None]:
        """Have the loop end its watch, list everything and publish every object again, whatever it published before
        (a consumer lost events: ``Watcher.republish``; ``again`` names the round); done once that list's sync
        markers are queued."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._republish.append((again, done))
        self._interrupt.set()
        return done

    async def _relist(self, reason: str) -> None:
        """:meth:`relist`, publishing everything again when :meth:`republish` asked (its callers are then told)."""
        waiting, self._republish = self._republish, []
        self._interrupt.clear()
        try:
            await self.relist(reason, again=waiting[-1][0] if waiting else "")
        except BaseException:
            self._republish = waiting + self._republish  # (asked again by the next list)
            if self._republish:
                self._interrupt.set()
            raise
        for _, done in waiting:
            if not done.done():
                done.set_result(None)

    async def _watch(self) -> tuple[int, float] | None:
        """:meth:`watch_once`, ended early (None) when :meth:`republish` asks for a list."""
        if self._interrupt.is_set():
            return None
        watch = asyncio.ensure_future(self.watch_once())
        asked = asyncio.ensure_future(self._interrupt.wait())
        try:
            await asyncio.wait([watch, asked], return_when=asyncio.FIRST_COMPLETED)
        finally:
            asked.cancel()
            if not watch.done():
                watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        return None if watch.cancelled() else watch.result()

    async def run(self) -> None:
        """List, then watch forever (until cancelled)."""
        cfg = self.w.config
        m = self.w.metrics
        c = cfg.cluster
        attempt = 0
        gone = 0
        need_list, reason = True, "start"
        timeout_floor = cfg.timeouts.watch * 0.9
        while True:
            try:
                if need_list or self._republish:
                    await self._relist(reason if need_list else "asked")
                    need_list = False
                    gone = 0
                watched = await self._watch()
                if watched is None:
                    continue  # (a list was asked for)
                count, lasted = watched
                if count == 0 and lasted < cfg.short_watch:
                    raise KubeError(0, "ShortWatch", f"the watch ended after {lasted:.2f}s without an event")
                attempt = 0
                why = "timeout" if lasted >= timeout_floor else "dropped"
                if m is not None:
                    m.restarts.labels(c, self.kind, why).inc()
                self.log.debug("re-watching", why=why, resource_version=self.rv, events=count)
            except KubeError as e:
                if m is not None:
                    m.errors.labels(c, self.kind, str(e.status)).inc()
                if classify(e.status) is Recovery.RELIST:
                    need_list, reason = True, "gone"
                    self.log.info("resource version gone, relisting", resource_version=self.rv, error=str(e))
                    gone += 1
                    if gone == 1:
                        continue  # the first 410 relists at once; repeated ones back off
                delay = cfg.backoff.delay(attempt, self.w.rng, e.retry_after)
                attempt += 1
                level = self.log.warning if is_transient(e.status) else self.log.error
                level("list or watch failed, backing off", status=e.status, error=str(e), delay=round(delay, 3))
                if m is not None and not need_list:
                    m.restarts.labels(c, self.kind, "error").inc()
                await asyncio.sleep(delay)


def labels_of(obj: Obj) -> object:
    meta = obj.get("metadata")
    return meta.get("labels") if isinstance(meta, dict) else None
