"""The migrations pass of a namespace's accounting: the oldest active migration of a VMI may reserve its target pod,
only while KubeVirt is refused it, and a hotplug's growth is admitted like a new VM."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Final

from shared.accounting.estimates import widened
from shared.accounting.results import (
    ATTACHMENT_RESERVED,
    GROWTH_REFUSED,
    NON_VM,
    NOT_TRIED,
    ORPHAN_LAUNCHER,
    PENDING,
    QUEUED,
    TARGET_CREATED,
    WAITING,
    MigrationEntry,
    VmEntry,
)
from shared.accounting.state import CreatedTarget, QuotaSums, Target, capped_growth, fmt, vm_key, vm_size
from shared.accounting.vms import Vms
from shared.kinds import FINAL_PHASES
from shared.quantity import ZERO
from shared.quota.equation import takes
from shared.quota.modes import VmSize, mode_usage
from shared.resources import ResourceList, add, growth, maximum, minimum, nonzero
from shared.snapshot import (
    PodSnapshot,
    VmimSnapshot,
    VmiSnapshot,
    awaits_attachment_pod,
)


def migration_entry(
    m: VmimSnapshot,
    state: str,
    reason: str,
    reserved: ResourceList | None = None,
    grow: ResourceList | None = None,
    vmi_size: str = "",
    vmi_uid: str = "",
    target_pod_uid: str = "",
) -> MigrationEntry:
    """``vmi_size``, ``vmi_uid``: of the VMI a pending migration's target is reserved for; ``target_pod_uid``: of the
    target whose attachment pod is reserved."""
    return MigrationEntry(
        m.name,
        m.uid,
        m.vmi_name,
        m.phase,
        state,
        reason,
        reserved or {},
        grow or {},
        m.rejected_by_quota,
        vmi_size,
        vmi_uid,
        target_pod_uid,
    )


_NOT_HANDED_OFF: Final = frozenset({"", "Pending", "Scheduling", "Failed"})
"""Phases of a migration before KubeVirt writes its VMI's ``status.migrationState`` (at ``Scheduled``, its target pod
ready), and ``Failed``, which it may reach before (a migration of a VMI its tenant deleted and created again)."""


def _before(p: PodSnapshot, m: VmimSnapshot) -> bool:
    """Pod ``p`` was created before migration ``m`` (to the second: the same second is not before)."""
    return (
        p.creation_timestamp is not None
        and m.creation_timestamp is not None
        and p.creation_timestamp < m.creation_timestamp
    )


def _pick_source(sources: list[tuple[PodSnapshot, ResourceList]], v: VmiSnapshot) -> tuple[PodSnapshot, ResourceList]:
    """The migration source: the VMI's newest pod on its node, else its newest pod."""
    on_node = [pc for pc in sources if v.node_name and pc[0].node_name == v.node_name]
    pool = on_node or sources
    return max(
        pool,
        key=lambda pc: (pc[0].creation_timestamp is not None, pc[0].creation_timestamp or datetime.min, pc[0].name),
    )


class Migrations(Vms):
    """The migrations pass (targets are decided in :class:`~shared.accounting.admission.Admission`'s order)."""

    def _migrations(self) -> None:
        seen: set[str] = set()
        for m in self.vmims:
            if not m.active:
                continue
            entry = self._migration(m, seen)
            self.mig_entries.append(entry)

    def _migration(self, m: VmimSnapshot, seen: set[str]) -> MigrationEntry:
        """A migration's entry; the oldest active one of a VMI with a running source pod and no target yet is a
        :class:`Target`, decided once running VMs are counted (:meth:`_decide_targets`)."""
        v = self.vmi_by_name.get(m.vmi_name)
        if v is None:
            return migration_entry(m, WAITING, "VMI not found")
        key = vm_key(v)
        vm_pods = self.launchers.get(key, [])
        # (a pod with the migration's label created before the migration is none of KubeVirt's targets: the tenant
        # labelled one of the VM's pods so, its source maybe)
        targets = [pc for pc in vm_pods if m.uid and pc[0].migration_job_uid == m.uid and not _before(pc[0], m)]
        if key in seen:
            if targets:
                # (KubeVirt goes on with whichever migration of the VMI its workers reach first: a younger one's
                # target is judged for the cancel like the oldest's)
                exists = f"target pod {targets[0][0].name} exists"
                self.created.append(
                    CreatedTarget(len(self.mig_entries), m, v, targets[0][0], tuple(targets), {}, exists, False)
                )
            return migration_entry(m, QUEUED, "queued behind an older migration of the same VMI")
        seen.add(key)
        sources = [pc for pc in vm_pods if not any(pc is t for t in targets)]
        if targets:
            target = targets[0][0]
            grow = growth(targets[0][1], _pick_source(sources, v)[1]) if sources else {}
            exists = f"target pod {target.name} exists: charged in P"
            attach = awaits_attachment_pod(m, v, target, self._attachment_owners)
            # (decided once running VMs are counted)
            index = len(self.mig_entries)
            self.created.append(CreatedTarget(index, m, v, target, tuple(targets), grow, exists, attach))
            return migration_entry(m, TARGET_CREATED, exists, None, grow)
        if not sources:
            return migration_entry(m, WAITING, "the VMI has no running launcher pod")
        source_pod, source_usage = _pick_source(sources, v)
        others = tuple(u for p, u in sources if p is not source_pod)
        # (a function of the VMI and the VM's pods, as long as they are the same objects)
        slot = ("target", self.namespace, vm_key(v))
        args = (v, source_pod, source_usage, *others)
        estimate, grow, reasons = self.memo.latest(slot, tuple(map(id, args)), args, self._target_estimate, *args)
        why = list(reasons)
        explained = nonzero(estimate)
        if m.rejected_by_quota:  # (a status condition only KubeVirt writes: it really tried to create the pod)
            refused = self._refusals(v, m.creation_timestamp)
            estimate, taken, _ = self._bounded(estimate, refused, f"{m.ref} (VMI {v.name})")
            if taken:
                why.append(f"the amounts of a quota refusal: {fmt(taken)}")
        self.targets.append(Target(len(self.mig_entries), m, v, nonzero(estimate), dict(grow), why, explained))
        return migration_entry(m, NOT_TRIED, "")  # (replaced by the decision)

    def _attachment_pods(self) -> dict[str, ResourceList]:
        """The hotplug attachment pods beside active migrations' targets, with their charges, which room reserved for
        them covers (``_decide_attachment``: beyond the budget, as the target's): for each target of a VMI with
        hotplugged volumes, the oldest live pod KubeVirt sees that the target controls, if it is charged no more
        than an attachment pod. A tenant's pod so dressed is the one KubeVirt takes (it creates none then), so the
        room it took is the room held for KubeVirt's own; one charged more got in through other room."""
        rendered = self.renderer.attachment_usage()
        out: dict[str, ResourceList] = {}
        for m in self.vmims:
            v = self.vmi_by_name.get(m.vmi_name) if m.active and m.uid else None
            if v is None or not v.hotplug_volumes:
                continue
            for target, _ in self.launchers.get(vm_key(v), ()):
                if target.migration_job_uid != m.uid:
                    continue
                beside = [
                    (p, e.charged)
                    for p, e in zip(self.pods, self.pod_entries, strict=True)
                    if p.attachment_of == target.uid and e.active and e.role == NON_VM
                ]
                if beside:
                    p, charged = min(beside, key=lambda pc: (pc[0].creation_timestamp or datetime.min, pc[0].name))
                    if not nonzero(growth(charged, rendered)):
                        out[p.uid] = charged
        return out

    def _decide_attachment(self, a: CreatedTarget) -> None:
        """Reserve the hotplug attachment pod of a migration's target: KubeVirt keeps the migration of a VMI with
        hotplugged volumes in ``Pending`` until it has created one beside the target, once the target is ready, and
        that one is ready (``migration.go``, ``VMIHasHotplugVolumes``). ``hard`` holds no room for the source pod
        once the target exists, so without the reservation a namespace with less than a launcher pod of its budget
        left refuses the attachment pod, and the migration of a VM whose size did not change waits for as long as
        the namespace stays so. KubeVirt marks no ``migrationRejectedByResourceQuota`` for it (only while the target
        is missing), and the facts it is reserved on are KubeVirt's: the target (its status names the VMI's pods,
        the kubelet its phase), the migration's phase and the VMI's hotplugged volumes. It counts as a plain pod once
        it exists, over the budget by that much until the source's ends with the migration. As for a target, room
        that another pod took is not held again while that pod keeps the namespace over its budget."""
        att = self.renderer.attachment_usage()
        taken_by = self._room_taken(a.m, att, own=a.target.uid)
        if taken_by:
            why = (
                f"{a.exists}; no room held for its hotplug attachment pod: the namespace is over its budget "
                f"({taken_by}) with pods created after the migration; room is made again once they end"
            )
            self.mig_entries[a.index] = migration_entry(a.m, WAITING, why, None, a.grow)
            return
        self._reserve_for_migration(att)
        why = f"{a.exists}; its hotplug attachment pod reserved ({fmt(att)}): KubeVirt goes on once it exists"
        self.mig_entries[a.index] = migration_entry(
            a.m, ATTACHMENT_RESERVED, why, att, a.grow, "", a.v.uid, a.target.uid
        )

    def _active(self, v: VmiSnapshot) -> int:
        """The VMI's active pods as KubeVirt's migration controller counts them (``VMIActivePodsCount``): those it
        controls (``status.activePods`` names them) that are not Succeeded or Failed, whether or not they are being
        deleted (a pod past its grace period but not terminal is still active to KubeVirt), and whatever their
        launcher command names (a tenant's pod KubeVirt adopted counts to KubeVirt, though not as the VM's)."""
        return sum(1 for uid in v.vouched_pods if uid in self._running_pods)

    def _target_estimate(
        self, v: VmiSnapshot, source_pod: PodSnapshot, source_usage: ResourceList, *others: ResourceList
    ) -> tuple[ResourceList, ResourceList, tuple[str, ...]]:
        """A migration target's estimate before any refusal's amounts, the hotplug growth, and why; ``others``:
        the charges of the VM's other pods. Not to be changed."""
        grow = self.renderer.hotplug_growth(v)
        rendered = self.renderer.new_pod_usage(v)
        if rendered is not None:
            # Growth is at most what the VM's pods lack of the target: what a pod already has is no growth again.
            # The smallest of its pods: a tenant can add a pod (one KubeVirt adopts into the VMI), never shrink
            # KubeVirt's
            grow = capped_growth(grow, rendered, (source_usage, *others), v.memory_change)
        estimate = add(source_usage, grow)
        if rendered is not None:
            # The source pod's real charge may exceed the rendering: overhead vmquota does not know, or containers a
            # mutating webhook adds for the VMI's annotations, which KubeVirt copies to every pod of the VM (a
            # service mesh's sidecar: the target gets it too). Followed up to the smallest charge of the VM's pods,
            # each one KubeVirt named (a tenant can add a pod, one KubeVirt adopts into the VMI, never shrink
            # KubeVirt's), or within the evidence bound of the rendering.
            smallest = functools.reduce(minimum, others, source_usage)
            estimate = maximum(minimum(estimate, maximum(widened(rendered), add(smallest, grow))), rendered)
        why = [f"target estimated from source pod {source_pod.name}"]
        if grow:
            why.append(f"hotplug growth {fmt(grow)}")
        return estimate, grow, tuple(why)

    def _decide_target(self, t: Target, admit: bool) -> None:
        """Reserve a migration's target while KubeVirt is refused it (``migrationRejectedByResourceQuota``), never
        for one KubeVirt has not tried (held back by the parallel-migration limits, or still to try: the room
        would be open to any pod). A hotplug's growth in the mode's terms is new usage, admitted in creation order
        like a new VM (``admit``); one that does not fit gets no room and the VM keeps its current size."""
        cur = self.vm_entries[vm_key(t.v)]
        # a function of the VMI, its entry (memoised: the same object while unchanged), the estimate and the
        # quotas; the estimate by value and wire format (it is built anew on every accounting)
        est = tuple((r, q.nanos, q.format) for r, q in t.estimate.items())
        memo_key = (id(t.v), id(cur), est, self.quotas_key)
        slot = ("grown", self.namespace, vm_key(t.v))
        grown = self.memo.latest(slot, memo_key, (t.v, cur), self._grown, t, cur)
        why = list(t.why)
        if admit:
            misfit, parts = self._misfits(grown)
            over = self._over_at_spec(t.v, cur, grown) if not misfit else ""
            if misfit or over:
                why.append(
                    "hotplug growth does not fit: "
                    + ("; ".join(parts) or over)
                    + "; the VM keeps running at its current size"
                )
                self.mig_entries[t.index] = migration_entry(t.m, GROWTH_REFUSED, "; ".join(why), None, t.grow)
                return
            why.append("hotplug growth admitted in creation order")
            self._count_growth(grown)  # (admitted: the VM's usage from now on, whatever becomes of its target)
        if not t.m.rejected_by_quota:
            why.append(
                "no room held: KubeVirt has not been refused its target pod (room is made once it is, and only then)"
            )
            self.mig_entries[t.index] = migration_entry(t.m, NOT_TRIED, "; ".join(why), None, t.grow)
            return
        pods = self._active(t.v)
        if pods > 1:
            # KubeVirt's migration controller creates no target while the VMI has more than one active pod (a
            # tenant's pod it adopted, say): room held for it would stay open, and with the guard its holder would
            # keep every other pod of the namespace out, other VMs' migration targets too, for as long as that lasts
            why.append(
                f"no room held: KubeVirt creates no target pod while the VMI has {pods} active pods (room is made "
                "as soon as it has one)"
            )
            self.mig_entries[t.index] = migration_entry(t.m, WAITING, "; ".join(why), None, t.grow)
            return
        taken_by = self._room_taken(t.m, t.estimate)
        if taken_by:
            why.insert(
                0,
                f"no room held: the namespace is over its budget ({taken_by}) with pods created after the migration "
                "(the room reserved for its target was taken by another pod); room is made again once they end",
            )
            self.mig_entries[t.index] = migration_entry(t.m, WAITING, "; ".join(why), None, t.grow)
            return
        why.insert(0, "target reserved: KubeVirt reported migrationRejectedByResourceQuota")
        room = t.estimate
        if not admit:
            grown, room = self._unexplained(t, cur, grown, why)
            # A larger pod for KubeVirt's reasons (an upgrade's overhead): what the VM counts more once it exists,
            # counted while its room is held, not before. It is no pod's charge yet, so it puts no namespace over
            # its budget for another migration (``_room_taken``). Counted for every target as it was, a tenant's
            # refused migration of its own VM with a refusal Event forged as large as the evidence bound lets, and a
            # small pod made in that refusal, had the namespace over its budget with nothing over it, and held a
            # drain's migration back for as long as the tenant kept the three.
            self._count_growth(grown, projected=True)
        self._reserve_for_migration(room)
        self.mig_entries[t.index] = migration_entry(
            t.m, PENDING, "; ".join(why), room, t.grow, self.renderer.held_digest(t.v), t.v.uid
        )

    def _unexplained(
        self, t: Target, cur: VmEntry, grown: dict[str, ResourceList], why: list[str]
    ) -> tuple[dict[str, ResourceList], ResourceList]:
        """What a refusal's amounts ask of a target beyond what the VM's pods and KubeVirt's rendering explain
        (``t.explained``), where a quota counts it (pod terms): growth, admitted like a hotplug's. It has no cause
        vmquota can vouch for: a container a mutating webhook sizes by the VMI's metadata, which the tenant writes
        and KubeVirt copies to every pod (raised while the VM ran, it grew the VM past a pod-terms budget at each
        migration, 1.44Gi over at the first), or an Event the tenant forged. Where it fits, it counts as the VM's
        usage while the room is held; where it does not, room is held for the target as explained: KubeVirt's
        target as large as its source gets in (a forged Event holds no drain back), a larger one waits for room.
        Returns the growth still to count while the room is held, and the room to hold."""
        if t.explained == t.estimate:
            return grown, t.estimate
        base = self._grown_at(t.v, cur, t.explained)
        extra = {name: growth(g, base[name]) for name, g in grown.items()}
        if not any(extra.values()):
            return grown, t.estimate
        asked = fmt(growth(t.estimate, t.explained))
        misfit, parts = self._misfits(grown)
        if not any(set(rs) & extra[name].keys() for name, rs in misfit.items()):
            why.append(f"what the refusal asks beyond the VM's pods and its rendering ({asked}) admitted as growth")
            self._count_growth(extra)
            return base, t.estimate
        why.append(
            f"the refusal asks {asked} more than the VM's pods and its rendering explain, growth that does not fit: "
            + "; ".join(parts)
            + f"; room held for the target as they explain it ({fmt(t.explained)}): a larger one waits for room"
        )
        return base, t.explained

    def _over_at_spec(self, v: VmiSnapshot, cur: VmEntry, grown: dict[str, ResourceList]) -> str:
        """Why a size the VM counts at already, but was never admitted, does not fit, or "": a VM some pod of which
        was made for its spec's vCPUs counts at them before its migration, which then grows by nothing
        (``Vms._made_for_vcpus``); when that pod is not KubeVirt's own launcher pod (a tenant's, with a controller
        reference to the VMI), the quotas the vCPUs count in must be within their budget with the VM at them. So
        must those its spec's guest memory counts in where the VM counts at it only because vmquota cannot render
        the VMI (``Vms._carries_memory``), while KubeVirt may: its migration's end gives the guest that memory."""
        vm_pods = self.launchers.get(vm_key(v), [])
        vcpus = self._runs_at_vcpus(v, vm_pods)
        if cur.size.vcpus <= vcpus or self._carries_cpus(v, vm_pods, every=True):
            # (counted at its status, the growth admitted as such; or KubeVirt made its pod at that size, admitted
            # then)
            vcpus = cur.size.vcpus
        memory = self._runs_at_memory(v, vm_pods)
        if vcpus == cur.size.vcpus and memory == cur.size.guest_memory:
            return ""
        parts = self._over_with(
            cur,
            VmSize(vcpus, memory),
            lambda q, pending: q.misfits({r: grown[q.policy.name].get(r, ZERO) for r in pending}),
        )
        return "; ".join(parts)

    def _over_with(
        self, cur: VmEntry, before: VmSize, over: Callable[[QuotaSums, ResourceList], Sequence[str]]
    ) -> list[str]:
        """Why quotas are over their budget with the VM at its new size: per quota, the resources ``over`` finds
        among those the VM's count (``cur``, at its spec) grows by against its count at the size ``before``."""
        parts = []
        for q in self.quotas:
            grows = nonzero(
                growth(cur.counts[q.policy.name], mode_usage(q.policy.mode, before, cur.pod_usage, q.ratio))
            )
            rs = over(q, grows)
            if rs:
                parts.append(f"{q.label} is over its budget in {', '.join(rs)} with the VM at its new size")
        return parts

    def _reserve_for_migration(self, pod: ResourceList) -> None:
        """Hold room in every quota for a pod a migration needs (its target, the target's attachment pod): ``S``,
        and the part of it :func:`~shared.quota.equation.desired_hard` keeps ``D`` from taking."""
        for q in self.quotas:
            q.reserved.add(pod)
        self.target_reserved = add(self.target_reserved, pod)

    def _room_taken(self, m: VmimSnapshot, needs: ResourceList, own: str = "") -> str:
        """Why a migration KubeVirt is refused gets no room again for a pod charged ``needs`` (its target, or the
        target's attachment pod ``own`` waits for), or "": some quota is over its budget (``U + X/k > B``) in a
        resource that pod is charged, and pods created after the migration (or in the same second; but those a
        change of a quota's policy found, :attr:`settled`), or in the refusal of an earlier one (:attr:`late`),
        are charged that resource, other than migration targets KubeVirt's status names (a VM's pods too: a
        controller reference is the tenant's to set). Room held for a target is open to any pod until the target
        exists (without the reservation guard): a pod that took it must not be followed by another once vmquota
        raises again, so a namespace goes over its budget by one reserved amount at the most. A namespace over
        its budget for other reasons (its budget lowered, an upgrade's larger pods) still migrates."""
        since = m.creation_timestamp
        if since is None:
            return ""
        # (over the budget first: rare, and cheap to tell; the pods created since only then)
        over_budget = [(q, [r for r, b in q.policy.budget.items() if r in needs and q.over(r, b)]) for q in self.quotas]
        if not any(rs for _, rs in over_budget):
            return ""
        # KubeVirt's attachment pods beside active targets got in through room held for them beyond the budget: the
        # namespace is not over its budget by them, and they took no other pod's room (or a namespace migrating a VM
        # with hotplugged volumes at its budget held every other migration back until that one ended)
        beside = self._beside
        if beside:
            less: ResourceList = {}
            for charged in beside.values():
                less = add(less, charged)
            over_budget = [(q, [r for r in rs if q.over(r, q.policy.budget[r], less.get(r))]) for q, rs in over_budget]
            if not any(rs for _, rs in over_budget):
                return ""
        if own:  # (an attachment pod's room: rare, each pod looked at)
            taking = [c for p, c in self._room_takers(own) if self._after(p, since)]
            charged_in = frozenset(r for c in taking for r, n in c.items() if n.nanos > 0)
        else:  # (a target's: the pods that may take room are the same for every migration of the pass)
            latest, late = self._takers
            charged_in = late | {r for r, t in latest.items() if t >= since}
        for q, rs in over_budget:
            over = [r for r in rs if r in charged_in]
            if over:
                return f"quota {q.policy.name}: {', '.join(sorted(over))}" if q.policy.name else ", ".join(over)
        return ""

    def _after(self, p: PodSnapshot, since: datetime) -> bool:
        """Whether ``p`` came in a migration's refusal (created at ``since`` or after, or in the refusal of an earlier
        one): creation times are to the second, so the same second counts; a pod created in the refusal of an earlier
        migration too, which the ledger remembers once that migration is gone (a tenant must not reopen the window
        with each migration it creates); not one a change of a quota's policy settled."""
        return (
            p.creation_timestamp is not None and p.creation_timestamp >= since and p.uid not in self.settled
        ) or p.uid in self.late

    def _room_takers(self, own: str) -> Iterator[tuple[PodSnapshot, ResourceList]]:
        """The pods that may have taken room held for a migration's pod (``own``, the pod it waits beside, aside),
        with their charges: the plain pods and launchers of no VM that are active, but KubeVirt's attachment pods
        beside targets; and the VMs' pods but the target KubeVirt's status names (a pod that took the room and was
        then adopted into a VMI, its controller reference the tenant's to set, on a running VMI or a pending one, is
        no plain pod any more, but it counts all the same, or the room would be held, and taken, again; the VMs
        KubeVirt let go of too: a pod that took the room, made a VMI's and orphaned with it, runs on as that VM's)."""
        beside = self._beside
        for p, e in zip(self.pods, self.pod_entries, strict=True):
            if e.role in (NON_VM, ORPHAN_LAUNCHER) and e.active and p.uid != own and p.uid not in beside:
                yield p, e.charged
        for v in (*self.vmis, *self.departed):
            target = self._handed_off_to(v)
            yield from ((p, c) for p, c in self.launchers.get(vm_key(v), ()) if p.name != target and p.uid != own)

    @functools.cached_property
    def _takers(self) -> tuple[dict[str, datetime], frozenset[str]]:
        """Of :meth:`_room_takers` (none aside), per resource, the newest creation of one charged it and not
        settled, and the resources one of those created in a refusal (``late``) is charged: whether some pod came in
        a migration's refusal charged a resource is then one look per migration. Once per accounting, when first
        asked, the passes done (many refused migrations in a namespace over its budget cost the ledger seconds when
        each looked at every pod)."""
        latest: dict[str, datetime] = {}
        late: set[str] = set()
        for p, charged in self._room_takers(""):
            positive = [r for r, q in charged.items() if q.nanos > 0]
            if p.uid in self.late:
                late.update(positive)
            created = p.creation_timestamp
            if created is not None and p.uid not in self.settled:
                for r in positive:
                    if r not in latest or latest[r] < created:
                        latest[r] = created
        return latest, frozenset(late)

    @functools.cached_property
    def _beside(self) -> dict[str, ResourceList]:
        """:meth:`_attachment_pods`, once per accounting, when first asked (the pods and migrations it reads are
        counted by then)."""
        return self._attachment_pods()

    @functools.cached_property
    def _running_pods(self) -> frozenset[str]:
        """The uids of the pods not Succeeded or Failed (once per accounting, when first asked: a VMI's named pods are
        few, the namespace's many)."""
        return frozenset(p.uid for p in self.pods if p.phase not in FINAL_PHASES)

    @functools.cached_property
    def _attachment_owners(self) -> frozenset[str]:
        """The uids of the pods some pod is KubeVirt's attachment pod of (once per accounting, when first asked)."""
        return frozenset(p.attachment_of for p in self.pods if p.attachment_of)

    def _handed_off_to(self, v: VmiSnapshot) -> str:
        """The pod ``v``'s ``status.migrationState`` names its target, when KubeVirt wrote it: the migration it names
        is one of ``v``'s that KubeVirt took past scheduling its target (a migration's status is KubeVirt's alone).
        A VMI's status is the tenant's to write when it creates the VMI (KubeVirt's VMI has no status subresource,
        and its webhook keeps the status of a create, but for the phase), and a migration state KubeVirt never
        started stays as written: before, a pending VMI created naming the pod that took a refused target's room
        as its migration target reopened that room once per such VMI, and so did a VMI created again under its name
        naming that VMI's migration, which KubeVirt had carried out."""
        ms = v.migration
        if ms is None or not ms.target_pod or not ms.migration_uid or not v.synced:
            return ""  # (KubeVirt migrates only a running VMI)
        m = self.vmim_by_uid.get(ms.migration_uid)
        if m is None or m.vmi_name != v.name or m.phase in _NOT_HANDED_OFF:
            return ""
        if (
            m.creation_timestamp is not None
            and v.creation_timestamp is not None
            and m.creation_timestamp <= v.creation_timestamp
        ):
            # (a migration made before the VMI, or in its second (times are to the second: no VMI runs and migrates
            # within its first), was of an earlier VMI of its name: a tenant created this one naming it)
            return ""
        return ms.target_pod

    def _count_growth(self, grown: dict[str, ResourceList], *, projected: bool = False) -> None:
        """Count what a migration's target adds to its VM (:meth:`_grown`) in ``U``; ``projected``: a pod's that
        does not exist yet, which :meth:`_room_taken` leaves out of what puts a namespace over its budget."""
        for q in self.quotas:
            q.used.add(grown[q.policy.name])
            q.taken.add(takes({}, grown[q.policy.name], q.factors))
            if projected:
                q.projected = add(q.projected, grown[q.policy.name])

    def _grown(self, t: Target, cur: VmEntry) -> dict[str, ResourceList]:
        """Per quota, what the migration's target adds to the VM's count in the mode's terms (hotplug growth;
        an upgrade's larger pod in pod terms). Not to be changed."""
        return self._grown_at(t.v, cur, t.estimate)

    def _grown_at(self, v: VmiSnapshot, cur: VmEntry, estimate: ResourceList) -> dict[str, ResourceList]:
        """:meth:`_grown` with a target charged ``estimate``."""
        full = vm_size(v)
        return {
            q.policy.name: growth(
                mode_usage(q.policy.mode, full, maximum(cur.pod_usage, estimate), q.ratio), cur.counts[q.policy.name]
            )
            for q in self.quotas
        }
