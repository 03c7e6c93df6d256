"""The pods pass of a namespace's accounting: what each pod is charged (``P``), whose launcher pod it is (only a
VMI's ``status.activePods`` says so), and what each plain pod adds to ``U`` and ``W``."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Final

from shared.accounting.results import (
    LAUNCHER,
    MIGRATION_TARGET,
    NON_VM,
    ORPHAN_LAUNCHER,
    PodEntry,
)
from shared.accounting.state import State, vm_key
from shared.podusage import counts_for_compute
from shared.quantity import Quantity
from shared.quota.equation import in_mode_terms, takes
from shared.resources import ResourceList
from shared.snapshot import (
    PodSnapshot,
    VmimSnapshot,
    VmiSnapshot,
)

_ONE: Final = Quantity.from_int(1)
_POD_COUNT_ONLY: Final[ResourceList] = {"count/pods": _ONE}
"""What the evaluator charges a terminal pod."""

PodsFound = tuple[
    tuple[PodEntry, ...],
    dict[str, list[tuple[PodSnapshot, ResourceList]]],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
    tuple[tuple[tuple[ResourceList, ...], tuple[ResourceList, ...]], ...],
    dict[str, list[ResourceList]],
]
"""Pod entries, launcher pods per VM, the lists every quota adds to ``P`` and to ``U`` (and to ``W``: a plain pod
takes its charge), per quota what the pods of VMIs not in view (or still pending) add to ``U`` and to ``W``, and the
charges of those pods by the VMI their command names."""


def made_for_unseen_vmi(p: PodSnapshot, seen: frozenset[str]) -> bool:
    """Whether ``p``'s launcher command (immutable: its labels and owner references the tenant may take off) names
    a VMI the namespace has no VMI of that KubeVirt has synced (``seen``): a launcher pod whose VMI vmquota cannot
    read (its event dead-lettered) or has not read yet, or whose VMI is still pending as vmquota sees it (KubeVirt
    names a new pod in the write that moves its VMI on, which the watches may bring after the pod): the VM may run
    in it (the pending VMI is admitted with its size in such pods' stead: ``Admission._admit``). Anyone may write
    such a command in a pod, and it only ever makes the pod count more."""
    return bool(p.command_vmi_uid) and p.command_vmi_uid not in seen


def in_mode(charged: ResourceList, factors: Mapping[str, Fraction | None]) -> ResourceList:
    """Pod-terms amounts ``charged`` in the mode's terms: over ``k`` per resource
    (:func:`~shared.quota.equation.in_mode_terms`)."""
    return {r: Quantity(in_mode_terms(q.nanos, factors.get(r)), q.format) for r, q in charged.items()}


def as_a_vm(charged: ResourceList, factors: Mapping[str, Fraction | None]) -> tuple[ResourceList, ResourceList]:
    """What a pod ``charged`` so counts in ``U`` and takes in ``W`` if a VM runs in it: in the mode's terms its charge
    over ``k`` per resource (as much as the VM it was made for counts, give or take its overhead), and it takes the
    larger of its charge and ``k`` times that (:func:`~shared.quota.equation.takes`)."""
    counted = in_mode(charged, factors)
    return counted, {**charged, **takes(charged, counted, factors)}


class Pods(State):
    """The pods pass."""

    def _owner(self, p: PodSnapshot) -> VmiSnapshot | None:
        """The VMI whose launcher pod ``p`` is: only a VMI whose ``status.activePods`` (written by KubeVirt alone)
        names the pod's uid. Labels and owner references are the tenant's to write: a pod that only carries them
        is a plain pod."""
        return self.vouched.get(p.uid) if p.uid else None

    def _pods(self) -> None:
        """Each pod's entry and what it adds to ``P`` and ``U``. With a memo, the whole pass is remembered: it
        depends on the pods, on the VMIs' and migrations' names and uids (owners, reasons), on the quotas and on
        ``now`` only for pods being deleted."""
        deleting = tuple(
            counts_for_compute(p.phase, p.deletion_timestamp, p.deletion_grace_period_seconds, self.now)
            for p in self.pods
            if p.deletion_timestamp is not None
        )
        key = (
            "pods",
            tuple(map(id, self.pods)),
            tuple((v.uid, v.name, v.synced, tuple(v.vouched_pods)) for v in self.vmis),
            tuple(sorted((p, self.vouched[p].uid) for p in self.departed_pods)),
            tuple((m.uid, m.name) for m in self.vmims),
            deleting,
            self.quotas_key,
        )
        self._apply_pods(self.memo.latest(("pods", self.namespace), key, tuple(self.pods), self._pods_pass))

    def _apply_pods(self, found: PodsFound) -> None:
        entries, launchers, pod_usage, accounted, unseen, as_vms = found
        self.pod_entries = list(entries)
        self.launchers = launchers  # read only from here on
        self.as_vm_pods = as_vms
        for q, (used, took) in zip(self.quotas, unseen, strict=True):  # (every managed quota covers every pod)
            q.pods.extend(pod_usage)
            q.used.extend(accounted)
            q.taken.extend(accounted)  # (a plain pod takes what it is charged)
            q.used.extend(used)
            q.taken.extend(took)

    def _pods_pass(self) -> PodsFound:
        """Every quota covers every pod (managed quotas are unscoped): one list of charges for all of them."""
        entries: list[PodEntry] = []
        launchers: dict[str, list[tuple[PodSnapshot, ResourceList]]] = {}
        pod_usage: list[ResourceList] = []
        accounted: list[ResourceList] = []
        as_vms: dict[str, list[ResourceList]] = {}
        # (a pending VMI does not vouch for its pod yet: its pod counts as the VM it may run)
        seen = frozenset(v.uid for v in (*self.vmis, *self.departed) if v.synced)
        memo = self.memo
        now = self.now
        for p in self.pods:
            active = counts_for_compute(p.phase, p.deletion_timestamp, p.deletion_grace_period_seconds, now)
            v = self._owner(p)
            mig = self.vmim_by_uid.get(p.migration_job_uid) if p.migration_job_uid else None
            # an entry is a function of the pod, whether it is charged for compute and whose it is
            owner = None if v is None else (v.uid, v.name)
            as_vm = v is None and active and made_for_unseen_vmi(p, seen)
            key = (id(p), active, owner, mig.name if mig is not None else None, p.uid in self.departed_pods, as_vm)
            slot = ("pod", self.namespace, p.uid or p.name)
            entry = memo.latest(slot, key, (p,), self._pod_entry, p, v, active, mig, as_vm)
            charged = entry.charged
            pod_usage.append(charged)
            if v is not None and active:  # a VM's running launcher pod: it counts through its VM
                launchers.setdefault(vm_key(v), []).append((p, charged))
            elif as_vm:
                as_vms.setdefault(p.command_vmi_uid, []).append(charged)
            else:
                accounted.append(charged)
            entries.append(entry)
        unseen = [charged for charges in as_vms.values() for charged in charges]
        per_quota = tuple(self._as_vms(q.factors, unseen) for q in self.quotas)
        return tuple(entries), launchers, tuple(pod_usage), tuple(accounted), per_quota, as_vms

    @staticmethod
    def _as_vms(
        factors: Mapping[str, Fraction | None], charges: list[ResourceList]
    ) -> tuple[tuple[ResourceList, ...], tuple[ResourceList, ...]]:
        """What the pods ``charges`` of VMIs not in view (or still pending) add to a quota's ``U`` and ``W``
        (:func:`as_a_vm`)."""
        both = [as_a_vm(c, factors) for c in charges]
        return tuple(u for u, _ in both), tuple(w for _, w in both)

    def _pod_entry(
        self, p: PodSnapshot, v: VmiSnapshot | None, active: bool, mig: VmimSnapshot | None, as_vm: bool = False
    ) -> PodEntry:
        """A pod's entry: what it is charged, and what it adds to ``U`` itself (nothing when it is the running
        launcher pod of a VM, which counts through its VM; its charge over ``k`` when it names a VMI not in view or
        still pending, ``as_vm``)."""
        charged = p.usage if active else _POD_COUNT_ONLY  # shared, not copied: results are not to be changed
        if v is None:
            role = ORPHAN_LAUNCHER if p.is_launcher else NON_VM
            reason = (
                "labelled as a launcher pod, but no VMI's status.activePods names it: pod usage"
                if p.is_launcher
                else "pod usage"
            )
            if as_vm:
                reason = (
                    "made for a VMI not in view or still pending (its launcher command names it): counts as the VM it "
                    "may run, its pod usage over each quota's pod/mode factor k"
                )
            if not active:
                reason += "; terminal or past its grace period: count/pods only"
            return PodEntry(p.name, p.uid, role, "", active, charged, charged, reason)
        role = MIGRATION_TARGET if p.migration_job_uid else LAUNCHER
        if p.uid in self.departed_pods:
            role = LAUNCHER
            if not active:
                return PodEntry(p.name, p.uid, role, v.name, active, charged, charged, "finished: count/pods only")
            reason = (
                f"launcher pod of VM {v.name} (VMI uid {v.uid}), which KubeVirt named in its status.activePods and "
                "names no more (its controller reference taken off): counted as that VM while it runs"
            )
            return PodEntry(p.name, p.uid, role, v.name, active, charged, {}, reason)
        if not active:
            # the evaluator still charges count/pods: count it too, or a VM refused on count/pods would get in
            reason = "terminal or past its grace period: count/pods only"
            return PodEntry(p.name, p.uid, role, v.name, active, charged, charged, reason)
        if role == MIGRATION_TARGET:
            reason = f"target of migration {mig.name if mig else p.migration_job_uid}: counted with VM {v.name}"
        else:
            reason = f"counted with VM {v.name}"
        return PodEntry(p.name, p.uid, role, v.name, active, charged, {}, reason)
