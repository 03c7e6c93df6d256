"""The watcher of one cluster: a list→watch loop per resource, publishing compact snapshots on the bus.

Per resource (:class:`ListWatch`): list in pages, publish what is new, then watch from the list's resourceVersion
with bookmarks and a server-side timeout; re-watch from the last version seen when the server ends the watch or
the connection drops; on 410 Gone list again and diff against what it knew: ``Deleted`` for objects that vanished
meanwhile, then a ``Sync`` marker per namespace. 429, 5xx and network failures back off exponentially with jitter.

Sync markers and the ledger: a ``Sync`` for (kind, namespace) at version ``L`` makes the ledger drop what it holds
there that is not listed, and refuse later upserts at or below ``L`` of objects it does not hold. So a marker is
sent only when it describes one complete list, after every event it covers is stored (``Publisher.flush``).

Pods: launcher pods (``kubevirt.io: virt-launcher``) are published in every namespace, other pods only in
namespaces with a managed ResourceQuota. The pod watch is cluster-wide and filters on the watcher's side, so one
list describes every namespace consistently. When a namespace becomes managed, its pods are listed and published
(then a sync marker for it); when it stops being managed, its other pods are forgotten (no events are sent: the
ledger keeps their last state until the namespace is managed again and a new marker settles it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes_asyncio.client import ApiClient

from services.platform.kube import is_transient
from services.platform.publisher import Publisher
from services.watcher import kube
from services.watcher.emitter import Emitter, Ident, where
from services.watcher.kube import KubeError, Obj, ResourceSpec, Timeouts
from services.watcher.loop import (
    KnownSet,
    ManagedNamespaces,
    Recovery,
    RelistDiff,
    Tracked,
    classify,
    diff_relist,
    is_newer,
    pod_wanted,
    quota_is_managed,
    sync_namespaces,
)
from services.watcher.metrics import WatcherMetrics
from shared import contract
from shared.backoff import Backoff
from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.normalize import normalize
from shared.snapshot import VmimSnapshot, labelled_launcher

FAILED_CREATE_SELECTOR: Final = "involvedObject.kind=VirtualMachineInstance,reason=FailedCreate"

RESOURCES: Final[tuple[ResourceSpec, ...]] = (
    ResourceSpec(NAMESPACE_KIND, "namespaces"),
    ResourceSpec(QUOTA_KIND, "resourcequotas"),
    ResourceSpec(KUBEVIRT_KIND, "kubevirts", "kubevirt.io"),
    ResourceSpec(VM_KIND, "virtualmachines", "kubevirt.io"),
    ResourceSpec(VMI_KIND, "virtualmachineinstances", "kubevirt.io"),
    ResourceSpec(VMIM_KIND, "virtualmachineinstancemigrations", "kubevirt.io"),
    ResourceSpec(POD_KIND, "pods"),
    ResourceSpec(EVENT_KIND, "events", field_selector=FAILED_CREATE_SELECTOR),
)
"""What the watcher follows. Namespaces and quotas are listed first: syncs name every namespace, and the pod list
needs to know which namespaces are managed."""

FIRST: Final = frozenset({NAMESPACE_KIND, QUOTA_KIND})


@dataclass(frozen=True, slots=True)
class WatcherConfig:
    cluster: str
    page_size: int = 500
    timeouts: Timeouts = field(default_factory=Timeouts)
    backoff: Backoff = field(default_factory=Backoff)
    window: int = 1000
    """Acks in flight."""
    ack_timeout: float = 10.0
    short_watch: float = 1.0
    """A watch that ends sooner than this without an event counts as a failure (backoff), not a timeout."""
    resources: tuple[ResourceSpec, ...] = RESOURCES

    def __post_init__(self) -> None:
        contract.check_cluster(self.cluster)
        if self.page_size < 1 or self.window < 1:
            raise InvalidInput("page size and window must be positive", "watcher")


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

    def list_context(self) -> Any:
        """Taken before a list starts; handed to ``sync_plan``."""
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

    def upsert(self, obj: Obj, ident: Ident) -> None:
        """Publish the object if this version is new to the loop, and remember it."""
        if not is_newer(self.known.get(ident.uid), ident.rv):
            return
        self.w.emitter.upsert(self.kind, obj, ident)
        self.known.put(
            ident.uid, ident.namespace, ident.name, ident.rv, self.kind == POD_KIND and labelled_launcher(_labels(obj))
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
    async def list_into(self, namespace: str | None, listed: dict[str, Tracked]) -> str:
        """List (one namespace or all), publish what is new, fill ``listed``; the list's resourceVersion."""
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
                    self.upsert(obj, ident)
                    await self.w.publisher.room()
        if not list_rv.isdigit():
            raise KubeError(0, "BadList", f"the list of {self.spec.key} has resourceVersion {list_rv!r}")
        return list_rv

    async def relist(self, reason: str) -> None:
        """List everything, publish changes, deletions of vanished objects, then sync markers."""
        m = self.w.metrics
        if m is not None:
            m.relists.labels(self.w.config.cluster, self.kind, reason).inc()
        self.started = True
        before = self.known.namespaces()
        context = self.list_context()
        listed: dict[str, Tracked] = {}
        list_rv = await self.list_into(None, listed)
        list_rv_int = int(list_rv)
        self.relisted()
        diff = diff_relist(self.known.snapshot(), listed, list_rv_int)
        for uid, t in diff.vanished:
            self.known.pop(uid)
            self.w.emitter.delete(self.kind, None, uid=uid, namespace=t.namespace, name=t.name, rv=str(t.rv), obj=None)
        plan = self.sync_plan(diff, before, context)
        await self.w.publisher.flush()
        for ns, present in sorted(plan.items()):
            self.w.emitter.sync(self.kind, ns, list_rv, present)
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
                    rv = (ev.object.get("metadata") or {}).get("resourceVersion")
                    if isinstance(rv, str) and rv:
                        self.rv = rv
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
                if need_list:
                    await self.relist(reason)
                    need_list = False
                    gone = 0
                count, lasted = await self.watch_once()
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


def _labels(obj: Obj) -> object:
    meta = obj.get("metadata")
    return meta.get("labels") if isinstance(meta, dict) else None


class MigrationListWatch(ListWatch):
    """Migrations. Before a migration whose target pod quota refused is published (the ledger reserves its target
    then), its VMI is read afresh and published first when it is newer than what the VMI loop published: the two
    watches lag each other, and a target reserved from a VMI older than the one KubeVirt rendered it from (a
    hotplug the VMI watch has not delivered yet) would be too small, its growth never admitted
    (``docs/accounting.md``, "Known limits"). One read per new version of such a migration while it is
    ``Pending`` (a version the loop would not publish reads nothing); a failed read is logged and the migration
    published all the same (the VMI watch catches up as before)."""

    reads = VMI_KIND

    async def before_upsert(self, obj: Obj) -> None:
        if not _rejected_by_quota(obj):
            return
        try:
            ident = Ident(obj)
        except InvalidInput:
            return  # (dead-lettered by handle)
        if not is_newer(self.known.get(ident.uid), ident.rv):
            return  # (not published again: nothing to read for)
        spec = obj.get("spec")
        name = spec.get("vmiName") if isinstance(spec, dict) else None
        vmis = self.w.loops.get(VMI_KIND)
        if vmis is None or not isinstance(name, str) or not name:
            return
        namespace = ident.namespace
        try:
            vmi = await kube.read(self.w.api, vmis.spec, namespace, name, self.w.config.timeouts)
        except KubeError as e:
            self.log.warning(
                "reading a refused migration's VMI failed", namespace=namespace, vmi=name, status=e.status, error=str(e)
            )
            return
        if vmi is not None:
            vmis.fresh(vmi)


def _rejected_by_quota(obj: Obj) -> bool:
    """A migration still waiting for its target (``Pending``: KubeVirt has not created it) whose last try quota
    refused: the ledger reserves its target now. (Later phases have their target: nothing to read for.) Read as
    accounting reads it (the normaliser's snapshot); an object that does not normalise is dead-lettered by
    ``handle``."""
    try:
        snap = normalize(obj)
    except InvalidInput:
        return False
    return isinstance(snap, VmimSnapshot) and snap.rejected_by_quota and snap.phase in ("", "Pending")


class QuotaListWatch(ListWatch):
    """ResourceQuotas: also keeps the set of managed namespaces, and tells the pods when it changes."""

    def __init__(self, watcher: Watcher, spec: ResourceSpec) -> None:
        super().__init__(watcher, spec)
        self._listing: dict[str, set[str]] | None = None

    def observe(self, typ: str, obj: Obj, ident: Ident) -> None:
        managed = typ != "DELETED" and quota_is_managed(_labels(obj))
        if self._listing is not None:
            if managed:
                self._listing.setdefault(ident.namespace, set()).add(ident.uid)
            return
        change = self.w.managed.update(ident.namespace, ident.uid, managed)
        if change is not None:
            self.w.managed_changed([ident.namespace] if change else [], [] if change else [ident.namespace])

    async def relist(self, reason: str) -> None:
        self._listing = {}
        try:
            await super().relist(reason)
        finally:
            self._listing = None

    def relisted(self) -> None:
        added, removed = self.w.managed.replace(self._listing or {})
        self._listing = None
        if added or removed:
            self.w.managed_changed(added, removed)


class PodListWatch(ListWatch):
    """Pods: launcher pods everywhere, other pods in managed namespaces; lists a namespace when it becomes managed."""

    def __init__(self, watcher: Watcher, spec: ResourceSpec) -> None:
        super().__init__(watcher, spec)
        self._backfills: dict[str, asyncio.Task[None]] = {}

    def wanted(self, obj: Obj, ident: Ident) -> bool:
        return pod_wanted(_labels(obj), ident.namespace, self.w.managed)

    def list_context(self) -> Any:
        return self.w.managed.epochs()

    def sync_plan(self, diff: RelistDiff, before: set[str], context: Any) -> dict[str, list[str]]:
        """Only namespaces managed for the whole list: there every pod is tracked, so the list is complete."""
        epochs: dict[str, int] = context
        now = self.w.managed.epochs()
        return {ns: diff.present.get(ns, []) for ns, e in now.items() if epochs.get(ns) == e}

    def became_managed(self, namespace: str) -> None:
        if not self.started:
            return  # the first list will cover it
        old = self._backfills.pop(namespace, None)
        if old is not None:
            old.cancel()
        self._backfills[namespace] = self.w.spawn(self.backfill(namespace), f"backfill-{namespace}")

    def stopped_managed(self, namespace: str) -> None:
        old = self._backfills.pop(namespace, None)
        if old is not None:
            old.cancel()
        dropped = self.known.drop_namespace(namespace)
        self.log.info("namespace no longer managed", namespace=namespace, forgotten_pods=dropped)

    async def backfill(self, namespace: str) -> None:
        """List the pods of a namespace that just became managed, publish them, then its sync marker."""
        cfg = self.w.config
        attempt = 0
        try:
            while namespace in self.w.managed:
                epoch = self.w.managed.epoch(namespace)
                listed: dict[str, Tracked] = {}
                try:
                    list_rv = await self.list_into(namespace, listed)
                except KubeError as e:
                    delay = cfg.backoff.delay(attempt, self.w.rng, e.retry_after)
                    attempt += 1
                    self.log.warning("listing a managed namespace failed", namespace=namespace, error=str(e))
                    await asyncio.sleep(delay)
                    continue
                if self.w.managed.epoch(namespace) != epoch:
                    continue
                await self.w.publisher.flush()
                if self.w.managed.epoch(namespace) != epoch:
                    continue
                self.w.emitter.sync(self.kind, namespace, list_rv, sorted(listed))
                self.log.info("namespace became managed: pods listed", namespace=namespace, pods=len(listed))
                return
        finally:
            if self._backfills.get(namespace) is asyncio.current_task():
                del self._backfills[namespace]


LOOPS: Final[dict[str, type[ListWatch]]] = {
    QUOTA_KIND: QuotaListWatch,
    POD_KIND: PodListWatch,
    VMIM_KIND: MigrationListWatch,
}
"""The kinds whose loop does more than list and watch."""


class Watcher:
    """Every resource of one cluster (see the module docstring). ``run()`` until cancelled."""

    def __init__(
        self,
        api: ApiClient,
        publisher: Publisher,
        config: WatcherConfig,
        *,
        metrics: WatcherMetrics | None,
        log: Any,
        rng: Any = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        import random

        self.api = api
        self.publisher = publisher
        self.config = config
        self.metrics = metrics
        self.log = log.bind(cluster=config.cluster)
        self.rng = rng if rng is not None else random.Random()
        self.on_ready = on_ready
        self.emitter = Emitter(config.cluster, publisher, metrics, self.log)
        self.managed = ManagedNamespaces()
        self.loops: dict[str, ListWatch] = {}
        for spec in config.resources:
            cls = LOOPS.get(spec.kind, ListWatch)
            self.loops[spec.kind] = cls(self, spec)
        self._group: asyncio.TaskGroup | None = None

    def cluster_namespaces(self) -> Iterable[str]:
        ns = self.loops.get(NAMESPACE_KIND)
        if ns is None:
            return ()
        return [t.name for _, t in ns.known.items()]

    def managed_changed(self, added: Iterable[str], removed: Iterable[str]) -> None:
        pods = self.loops.get(POD_KIND)
        for ns in added:
            self.log.info("namespace managed", namespace=ns)
            if isinstance(pods, PodListWatch):
                pods.became_managed(ns)
        for ns in removed:
            if isinstance(pods, PodListWatch):
                pods.stopped_managed(ns)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        if self._group is None:
            raise RuntimeError("the watcher is not running")
        task: asyncio.Task[None] = self._group.create_task(coro, name=name)
        return task

    async def run(self) -> None:
        first = [lw for k, lw in self.loops.items() if k in FIRST]
        rest = [lw for k, lw in self.loops.items() if k not in FIRST]
        async with asyncio.TaskGroup() as group:
            self._group = group
            for lw in first:
                group.create_task(lw.run(), name=f"watch-{lw.kind}")
            for lw in first:
                await lw.listed.wait()
            for lw in rest:
                group.create_task(lw.run(), name=f"watch-{lw.kind}")
            for lw in rest:
                await lw.listed.wait()
            self.log.info("every resource listed", objects={k: len(lw.known) for k, lw in self.loops.items()})
            if self.on_ready is not None:
                self.on_ready()
