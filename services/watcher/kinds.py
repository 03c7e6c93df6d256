"""The loops of the kinds whose list→watch does more than publish: migrations (a refused one's VMI read afresh
first), ResourceQuotas (which namespaces are managed) and pods (launcher pods everywhere, other pods only in
managed namespaces, listed when a namespace becomes managed)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

from services.watcher import kube
from services.watcher.emitter import Ident
from services.watcher.kube import KubeError, Obj, ResourceSpec
from services.watcher.listwatch import ListWatch, labels_of
from services.watcher.loop import RelistDiff, Tracked, is_newer, pod_wanted, quota_is_managed
from shared.errors import InvalidInput
from shared.kinds import POD_KIND, QUOTA_KIND, VMI_KIND, VMIM_KIND
from shared.normalize import normalize
from shared.snapshot import VmimSnapshot

if TYPE_CHECKING:
    from services.watcher.watcher import Watcher


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
        try:
            ident = Ident(obj)
        except InvalidInput:
            return  # (dead-lettered by handle)
        if not is_newer(self.known.get(ident.uid), ident.rv):
            return  # (not published again: nothing to read for)
        if not _rejected_by_quota(obj):
            return
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
    return isinstance(snap, VmimSnapshot) and snap.rejected_by_quota and snap.pending


class QuotaListWatch(ListWatch):
    """ResourceQuotas: also keeps the set of managed namespaces, and tells the pods when it changes."""

    def __init__(self, watcher: Watcher, spec: ResourceSpec) -> None:
        super().__init__(watcher, spec)
        self._listing: dict[str, set[str]] | None = None

    def observe(self, typ: str, obj: Obj, ident: Ident) -> None:
        managed = typ != "DELETED" and quota_is_managed(labels_of(obj))
        if self._listing is not None:
            if managed:
                self._listing.setdefault(ident.namespace, set()).add(ident.uid)
            return
        change = self.w.managed.update(ident.namespace, ident.uid, managed)
        if change is not None:
            self.w.managed_changed([ident.namespace] if change else [], [] if change else [ident.namespace])

    async def relist(self, reason: str, *, again: str = "") -> None:
        self._listing = {}
        try:
            await super().relist(reason, again=again)
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
        return pod_wanted(labels_of(obj), ident.namespace, self.w.managed)

    def list_context(self) -> Any:
        return self.w.managed.epochs()

    def sync_plan(self, diff: RelistDiff, before: set[str], context: Any) -> dict[str, list[str]]:
        """Only namespaces managed for the whole list: there every pod is tracked, so the list is complete."""
        epochs: dict[str, int] = context
        now = self.w.managed.epochs()
        return {ns: diff.present.get(ns, []) for ns, e in now.items() if epochs.get(ns) == e}

    def judged(self, vanished: list[tuple[str, Tracked]], context: Any) -> list[tuple[str, Tracked]]:
        """Only in namespaces whose managed state did not change during the list: one that became managed meanwhile
        had its pods listed by its backfill (the list skipped them, unmanaged then), and a pod the backfill published
        was taken for vanished and published deleted while it ran (the backfill's sync, already on the bus, kept the
        ledger from taking it back: the namespace undercounted until the pod changed)."""
        epochs: dict[str, int] = context
        now = self.w.managed.epochs()
        return [(uid, t) for uid, t in vanished if epochs.get(t.namespace) == now.get(t.namespace)]

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
