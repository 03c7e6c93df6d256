"""The VMs pass of a namespace's accounting: a running VM counts at its current size (its spec size while an
active migration's target pod exists), its pods believed up to its rendering; ``D``, ``X`` and ``W`` of its pods."""

from __future__ import annotations

import functools
from dataclasses import replace

from shared.accounting.estimates import current_size
from shared.accounting.pods import Pods
from shared.accounting.results import (
    RUNNING,
    STOPPED,
    VmEntry,
)
from shared.accounting.state import capped_growth, fmt, smallest_lacks, vm_key, vm_size
from shared.kinds import FINAL_PHASES
from shared.quantity import Quantity
from shared.quota.equation import takes
from shared.quota.modes import MEMORY_NAMES, VmSize, mode_usage
from shared.resources import ResourceList, add, growth, maximum, minimum, nonzero, second_largest
from shared.snapshot import (
    PodSnapshot,
    VmiSnapshot,
)

VmsFound = tuple[
    tuple[tuple[str, VmEntry], ...],
    tuple[VmiSnapshot, ...],
    tuple[tuple[ResourceList, ...], ...],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
    tuple[tuple[ResourceList, ...], ...],
]
"""Entries of running and stopped VMs, pending VMs, per quota the lists running VMs add to ``U``, the lists
every quota adds to ``D`` and to ``X``, and per quota the lists running VMs add to ``W``."""


class Vms(Pods):
    """The VMs pass."""

    def _running_vms(self) -> None:
        """Running VMs always count; the others are stopped or wait for admission. With a memo, the whole pass is
        remembered: it depends on the VMIs, their launcher pods (the pod pass's result), the active migrations and
        the quotas."""
        objs = (*self.vmis, *self.departed, self.launchers)
        # (the active migrations decide whose pods are targets)
        active = tuple(sorted((m.uid, m.vmi_name) for m in self.vmims if m.active and m.uid))
        # (what a launcher pod was made for is taken when a pod or a VMI's version is folded, and dropped when a pod
        # is deleted: each changes the objects)
        key = ("vms", tuple(map(id, objs)), active, self.quotas_key)
        self._apply_vms(self.memo.latest(("vms", self.namespace), key, objs, self._vms_pass))

    def _apply_vms(self, found: VmsFound) -> None:
        entries, pending, accounted, overlap, unvouched, takes = found
        self.vm_entries.update(entries)
        self.pending = list(pending)
        for q, acc, took in zip(self.quotas, accounted, takes, strict=True):
            q.used.extend(acc)
            q.overlap.extend(overlap)
            q.unvouched.extend(unvouched)
            q.taken.extend(took)

    def _vms_pass(self) -> VmsFound:
        entries: list[tuple[str, VmEntry]] = []
        pending: list[VmiSnapshot] = []
        accounted: list[list[ResourceList]] = [[] for _ in self.quotas]
        takes: list[list[ResourceList]] = [[] for _ in self.quotas]
        overlap: list[ResourceList] = []
        unvouched: list[ResourceList] = []
        memo = self.memo
        namespace, quotas_key = self.namespace, self.quotas_key
        every = [  # (each VM, each quota)
            (q.policy.name, added, took) for q, added, took in zip(self.quotas, accounted, takes, strict=True)
        ]
        departed = {v.uid for v in self.departed}
        for v in (*self.vmis, *self.departed):
            key = vm_key(v)
            vm_pods = self.launchers.get(key, [])
            if v.uid in departed and not vm_pods:
                continue  # (its pods finished: nothing runs)
            if not vm_pods:
                if v.phase in FINAL_PHASES or v.deletion_timestamp is not None:
                    what = f"phase {v.phase}" if v.phase in FINAL_PHASES else "being deleted"
                    reason = f"{what}, no running launcher pod: counts nothing"
                    entries.append((key, VmEntry(v.name, v.uid, v.phase, STOPPED, reason, vm_size(v), {}, {})))
                elif v.synced:
                    entry = self._unseen_pod_vm(v)
                    for name, added, took in every:
                        added.append(entry.counts[name])
                        took.append(entry.taken[name])
                    entries.append((key, entry))
                else:
                    pending.append(v)
                continue
            migrating = self._migrating(v, vm_pods)
            # the entry is a function of the VMI, its active launcher pods (and what they were made for: see
            # _running_vms), whether it migrates and the quotas
            memo_obj = (v, *(p for p, _ in vm_pods))
            memo_slot = ("running", namespace, key)
            memo_key = (tuple(map(id, memo_obj)), migrating, quotas_key)
            entry = memo.latest(memo_slot, memo_key, memo_obj, self._running_vm, v, vm_pods, migrating)
            if v.uid in departed:
                entry = replace(
                    entry,
                    reason="its VMI is gone, but a launcher pod KubeVirt made for it runs on (its controller "
                    "reference taken off, or the VMI deleted with orphan propagation): counts as running",
                )
            counts, takes_of = entry.counts, entry.taken
            for name, added, took in every:
                added.append(counts[name])
                took.append(takes_of[name])
            if entry.overlap:
                overlap.append(entry.overlap)
            if entry.unvouched:
                unvouched.append(entry.unvouched)
            entries.append((key, entry))
        return (
            tuple(entries),
            tuple(pending),
            tuple(map(tuple, accounted)),
            tuple(overlap),
            tuple(unvouched),
            tuple(map(tuple, takes)),
        )

    def _migrating(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> bool:
        """Whether one of the VM's pods is the target of an active migration of this VMI (a migration's phase is
        KubeVirt's to write; the pod's label alone is anyone's): the one case where a VM has two pods."""
        for p, _ in vm_pods:
            m = self.vmim_by_uid.get(p.migration_job_uid) if p.migration_job_uid else None
            if m is not None and m.active and m.vmi_name == v.name:
                return True
        return False

    def _rendered_now(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> ResourceList:
        """The VM's launcher pod as rendered at its current size: the spec's rendering less a hotplug's growth not
        yet admitted, at the spec's vCPUs where the VM counts at them (:meth:`_carries_cpus`; empty for a VM that
        cannot be rendered). The growth is at most what the smallest of its pods lacks of that rendering, as for its
        migration's target: what its own pod has already (a status that does not report an interface, or memory,
        the pod was made with) is no growth."""
        charges = [charged for _, charged in vm_pods]
        cap = self.renderer.vmi_usage(v) or {}
        grow = self.renderer.hotplug_growth(v) if cap else {}
        if cap and charges:
            grow = capped_growth(grow, cap, charges, v.memory_change)
        if grow:
            cap = {r: (q - grow[r]).clamp0() if r in grow else q for r, q in cap.items()}
        if cap and self._carries_cpus(v, vm_pods, every=False):
            # the spec's vCPUs count (some pod was made for them): their rendering is no growth still to admit, or
            # a small pod adopted beside the VM's would leave what its launcher pod carries of them unvouched
            cap = maximum(cap, self.renderer.spec_cpu_usage(v) or {})
        return cap

    def _made_for_vcpus(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]], *, every: bool) -> int:
        """The vCPUs the VM's pods were made for — some pod (what it counts at), or ``every`` one (what KubeVirt made
        its pod at, its growth admitted then) — between what its status reports and its spec. A running VM counts at
        the vCPUs some pod of it was made for, or the difference would be room for other VMs.

        The tenant may write ``status.currentCPUTopology`` when it creates the VMI: KubeVirt keeps it (its VMI has no
        status subresource, and its webhook sets the field only when a create has none) and renders the pod from
        the spec. Two things show what a pod was made for. Its charges: the largest of the VM's pods per resource
        (``every``: the smallest) has all of the rendering at the spec's vCPUs (``Renderer.spec_cpu_usage``:
        whatever memory change or interface is pending beside them), or the VM cannot be rendered; a change of the
        rendering since (an annotation, the cluster's overhead, a hotplug asked past the spec the pod was made for)
        hides it. And the ledger's memory (:attr:`made_for`: the spec's vCPUs of the VMI the pod's launcher command
        names, as the ledger first saw it with the pod), which nothing written later changes, but which may be more
        than the pod was made for (the watches of pods and VMIs are in no order: a hotplug asked at once may be seen
        first; ``every`` takes the fewest it may have been made for, which a spec grown before the VMI named a pod
        lowers). Some pod counts at what either shows (more is safe to count); every pod was made for what both show
        (an admission is skipped only on that). A tenant can add a pod to a VM (one KubeVirt adopts), never shrink
        KubeVirt's; a pod it creates naming the VMI counts as made for the spec then, so a CPU hotplug pending then
        counts at once, and its migration is admitted all the same (``Migrations._over_at_spec``)."""
        now = v.status_vcpus if v.status_vcpus is not None else v.vcpus
        if not v.fewer_vcpus:
            return now  # (its status reports its spec's vCPUs or more: nothing shown can count more)
        charges = [charged for _, charged in vm_pods]
        by_charge = v.vcpus if charges and self._rendered_for_spec(v, charges, every=every) else now
        made = [m for m in (self._made_for(v, p, fewest=every) for p, _ in vm_pods) if m is not None]
        most = min([by_charge, *made]) if every else max([by_charge, *made])
        return max(now, min(v.vcpus, most))

    def _runs_at_vcpus(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> int:
        """The fewest vCPUs the VM may run at: its status's, or fewer where the ledger saw a pod of it made for fewer
        (the fewest it may have been made for) and its charge lacks the rendering at the spec's vCPUs: a status forged
        larger than the spec at creation, and the spec raised to it since, is no size the domain runs at. (A pod the
        ledger saw before the VMI's raise reached it is remembered made for fewer than it was: its charge shows
        better.)"""
        now = current_size(v).vcpus
        renders = self.renderer.vmi_usage(v) is not None
        made = [
            m
            for p, charged in vm_pods
            if (m := self._made_for_fewer(v, p)) is not None
            and m < now
            and not (renders and self._rendered_for_spec(v, [charged], every=True))
        ]
        return min([now, *made])

    def _runs_at_memory(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> Quantity:
        """The guest memory the VM runs at when a size change of it is judged: its status's, or its spec's where
        every pod of it has the spec's rendering (:meth:`_carries_memory`), never only because vmquota cannot
        render it (it then counts at its spec's memory for what others may use, while KubeVirt may carry a raise
        out)."""
        carries = self.renderer.vmi_usage(v) is not None and self._carries_memory(v, [ch for _, ch in vm_pods])
        return vm_size(v).guest_memory if carries else current_size(v).guest_memory

    def _made_for_fewer(self, v: VmiSnapshot, p: PodSnapshot) -> int | None:
        """The fewest vCPUs the ledger remembers ``v``'s pod ``p`` may have been made for, where that may lower the
        size the VM runs at (:meth:`_runs_at_vcpus`, ``Admission._size_change``): not for the target of the VMI's
        last migration, which KubeVirt's status says completed. virt-handler gave its domain the spec's vCPUs then
        where a CPU hotplug was pending, and the status reports what it runs at since; the ledger's memory of such a
        target may be of the spec before the hotplug it was made for (the watches of pods and VMIs are in no order),
        and a KubeVirt upgrade or configuration change since leaves its charge unlike any rendering now: that memory
        made a drain of a VM whose size does not change a size change, refused and then canceled."""
        return None if _moved_into(v, p) else self._made_for(v, p, fewest=True)

    def _made_for(self, v: VmiSnapshot, p: PodSnapshot, *, fewest: bool = False) -> int | None:
        """The vCPUs ``v``'s pod ``p`` was made for, as the ledger remembers it made for ``v`` (None: not known):
        at least what it was made for, or (``fewest``) the fewest it may have been made for (its VMI's spec grew
        before the VMI named it)."""
        first = self.made_for.get(p.uid)
        if first is None or first[0] != v.uid:
            return None
        return first[2] if fewest else first[1]

    def _rendered_for_spec(self, v: VmiSnapshot, charges: list[ResourceList], *, every: bool) -> bool:
        """The largest of ``charges`` per resource (``every``: the smallest) has the rendering at the spec's vCPUs,
        or the VM cannot be rendered (see :meth:`_made_for_vcpus`)."""
        at_spec_cpus = self.renderer.spec_cpu_usage(v) if self.renderer.vmi_usage(v) is not None else None
        pods = functools.reduce(minimum if every else maximum, charges)
        return at_spec_cpus is None or not nonzero(growth(at_spec_cpus, pods))

    def _carries_cpus(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]], *, every: bool) -> bool:
        """Whether the VM's pods — some of them, or ``every`` one — were made for its spec's vCPUs while its status
        reports fewer (:meth:`_made_for_vcpus`)."""
        return v.fewer_vcpus and bool(vm_pods) and self._made_for_vcpus(v, vm_pods, every=every) >= v.vcpus

    def _carries_memory(self, v: VmiSnapshot, charges: list[ResourceList]) -> bool:
        """Every pod of the VM has the memory of the spec's rendering while a memory change is pending: virt-handler
        did not carry the change out after the migration made the pod (it failed, say, on a VMI label the tenant may
        edit). The growth was admitted, and the next migration, which finds nothing to grow in pod terms, would take
        it back unchecked. A VM that cannot be rendered too."""
        if not v.memory_change or not charges:
            return False
        rendered = self.renderer.vmi_usage(v)
        return rendered is None or not any(r in MEMORY_NAMES for r in nonzero(smallest_lacks(rendered, charges)))

    def _counted_size(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> VmSize:
        """The size a running VM that is not migrating counts at: its status (a size change counts once admitted),
        but the vCPUs some pod of it was made for (:meth:`_made_for_vcpus`) and its spec's memory where every pod
        has it (:meth:`_carries_memory`)."""
        now = current_size(v)
        vcpus = self._made_for_vcpus(v, vm_pods, every=False) if vm_pods else now.vcpus
        memory = self._carries_memory(v, [charged for _, charged in vm_pods])
        if vcpus == now.vcpus and not memory:
            return now
        return VmSize(vcpus, vm_size(v).guest_memory if memory else now.guest_memory)

    def _running_vm(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]], migrating: bool) -> VmEntry:
        """A running VM counts at its current size (its status: a hotplug request counts once admitted, see
        :meth:`_decide_target`), or at its spec size while an active migration's target pod exists for it; in pod
        terms at the larger of its launcher pods per resource, at most as vmquota renders its launcher pod at that
        size. (A pod's labels say nothing here: a launcher pod keeps the ``migrationJobUID`` label of the migration
        that made it. When a hotplug's migration has ended and KubeVirt has not updated the status yet, the pod
        made for the new size is charged beyond that rendering: the difference is ``unvouched``.)

        ``hard`` holds room for one launcher pod per VM, the larger of its pods but at most as vmquota renders it;
        what its pods are charged beyond that is its ``overlap`` (``D``), so that the end of either pod of a
        migration frees nothing another pod could take. Every pod the VMI controls is in its
        ``status.activePods``, a tenant's pod with a forged controller reference too, so only a migration's
        target (of an active migration: its phase is KubeVirt's to write) is believed to be a second launcher
        pod; the rest of the overlap is ``unvouched`` and counts as used when VMs are admitted."""
        charges = [charged for _, charged in vm_pods]
        pod_max: ResourceList = {}
        for charged in charges:
            pod_max = maximum(pod_max, charged)
        size = vm_size(v) if migrating else self._counted_size(v, vm_pods)
        # (a VM that cannot be rendered: hard holds no room for its pods)
        cap = (self.renderer.vmi_usage(v) or {}) if migrating else self._rendered_now(v, vm_pods)
        believed = minimum(pod_max, cap)
        counts = {q.policy.name: mode_usage(q.policy.mode, size, believed, q.ratio) for q in self.quotas}
        took = {q.policy.name: takes(believed, counts[q.policy.name], q.factors) for q in self.quotas}
        total = pod_max
        if len(charges) > 1:  # (the common case, one pod, has nothing to add up)
            total = {}
            for charged in charges:
                total = add(total, charged)
        overlap = growth(total, believed)
        target = nonzero(minimum(second_largest(charges), cap)) if migrating else {}
        unvouched = growth(overlap, target)
        reason = "running: always counts"
        if len(charges) > 1:
            reason += f" (at the larger of its {len(charges)} launcher pods per resource)"
        if unvouched:
            reason += (
                f"; its pods are charged {fmt(unvouched)} beyond one launcher pod"
                f"{' and its migration target' if migrating else ''} as vmquota renders them: counted as used"
            )
        return VmEntry(
            v.name,
            v.uid,
            v.phase,
            RUNNING,
            reason,
            size,
            believed,
            counts,
            overlap=overlap,
            unvouched=unvouched,
            taken=took,
        )

    def _unseen_pod_vm(self, v: VmiSnapshot) -> VmEntry:
        """A VMI past Pending with no running launcher pod in view: its pod ended (the VMI is about to finish), or
        KubeVirt has not named it in ``status.activePods`` yet (it then counts as a plain pod), or its event has not
        arrived. KubeVirt creates no launcher pod for it any more, so nothing is reserved (room held for it would be
        room for a pod that never comes, open to any other); until its status says it finished it counts at its
        rendering at its current size in ``U``, like a running VM (a VM admitted meanwhile waits for it), and it
        takes nothing in ``W``: ``W`` follows what ``P`` charges, and ``P`` has no pod of it (a pod that is charged
        but not in view takes its room all the same, and one that ended frees it), so ``hard`` stays where it is
        while KubeVirt's status and the pod events catch up."""
        size = current_size(v)
        cap = self._rendered_now(v, [])
        counts = {q.policy.name: mode_usage(q.policy.mode, size, cap, q.ratio) for q in self.quotas}
        took: dict[str, ResourceList] = {q.policy.name: {} for q in self.quotas}
        reason = (
            f"phase {v.phase}, no running launcher pod in status.activePods: counts at its rendering, nothing reserved"
        )
        return VmEntry(v.name, v.uid, v.phase, RUNNING, reason, size, cap, counts, taken=took)


def _moved_into(v: VmiSnapshot, p: PodSnapshot) -> bool:
    """``p`` is the target of ``v``'s last migration, which KubeVirt's status says completed (a status the tenant
    may write only when it creates the VMI, before any pod of it exists under its generated name)."""
    m = v.migration
    return m is not None and m.completed and not m.failed and bool(m.target_pod) and m.target_pod == p.name
