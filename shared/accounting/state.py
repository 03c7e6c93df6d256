"""What one accounting of a namespace holds while it runs (:class:`State`), and the helpers every pass uses: a
quota's running sums, the quota refusals of a VMI, what does not fit, the evidence bound on refusal amounts.

The accounting is one object built in layers, one module per pass, each reading what the passes before it left in
the state: :mod:`~shared.accounting.pods` (what each pod is charged and whose it is), :mod:`~shared.accounting.vms`
(running VMs), :mod:`~shared.accounting.migrations` (migration targets), :mod:`~shared.accounting.admission`
(pending VMs and hotplug growth in creation order), :mod:`~shared.accounting.namespace` (the input and the result).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Final

from shared.accounting.estimates import Renderer, evidence_bound
from shared.accounting.memo import Memo
from shared.accounting.results import (
    MigrationEntry,
    PodEntry,
    VmEntry,
)
from shared.accounting.sums import Sum
from shared.kubevirt import KubeVirtConfig
from shared.quantity import Quantity
from shared.quota.equation import in_mode_terms
from shared.quota.modes import MEMORY_NAMES, QuotaPolicy, VmSize
from shared.report import readable
from shared.resources import ResourceList, charged_alike, growth, maximum, minimum, nonzero
from shared.snapshot import (
    EventSnapshot,
    PodSnapshot,
    Snapshot,
    VmimSnapshot,
    VmiSnapshot,
)

_IGNORED_SHOWN: Final = 5
"""Refused amounts a line about ignored ones names (the rest are counted)."""


def event_order(e: EventSnapshot) -> tuple[bool, datetime, str, str]:
    """Order of events: by last time (events without one first), then name and uid."""
    return (e.last_timestamp is not None, e.last_timestamp or datetime.min, e.name, e.uid)


def created_key(s: Snapshot) -> tuple[bool, datetime, str, str]:
    """Creation order; objects without a creation time last, then by name and uid."""
    ts = s.creation_timestamp
    return (ts is None, ts or datetime.min, s.name, s.uid)


def fmt(rl: Mapping[str, Quantity]) -> str:
    """A resource list in a reason: readable amounts (``limits.memory=32.6Gi``), as every human-facing line."""
    return ", ".join(f"{k}={readable(rl[k], k)}" for k in sorted(rl)) or "nothing"


def _needs(r: str, need: Quantity, left: Quantity, budget: Quantity) -> str:
    """``limits.memory needs 16Gi but 8Gi of 64Gi is left``: readable, but exact when rounding would print the
    need and what is left the same (it is more than is left)."""
    n, lf = readable(need, r), readable(left, r)
    if n == lf:
        n, lf = need.canonical(), left.canonical()
    return f"{r} needs {n} but {lf} of {readable(budget, r)} is left"


def smallest_lacks(rendered: ResourceList, charges: Sequence[ResourceList]) -> ResourceList:
    """What the smallest of a VM's pod ``charges`` (per resource) lacks of the ``rendered`` pod."""
    return growth(rendered, functools.reduce(minimum, charges))


def capped_growth(
    grow: ResourceList, rendered: ResourceList, charges: Sequence[ResourceList], memory_change: bool = False
) -> ResourceList:
    """A hotplug's growth in pod terms: ``grow`` (the rendering of the spec less the rendering at the size the VM
    runs at) at most what the smallest of ``charges`` lacks of ``rendered``. With a memory change pending
    (``VmiSnapshot.memory_change``) the memory resources are what that pod lacks, whatever ``grow`` says: KubeVirt
    grows explicit memory requests and limits by the new size less the guest's current memory (the guest's to
    report; an unplug too), so no rendering tells what the source pod has."""
    if not grow and not memory_change:
        return {}  # (nothing to cap)
    lacks = smallest_lacks(rendered, charges)
    if memory_change:
        grow = maximum(grow, {r: q for r, q in lacks.items() if r in MEMORY_NAMES})
    return nonzero(minimum(grow, lacks))


def size_change(v: VmiSnapshot) -> bool:
    """The VM's spec is larger than the size it runs at, a change KubeVirt carries out by a migration: more vCPUs
    than ``status.currentCPUTopology`` reports, or more guest memory than the status (a memory change,
    ``VmiSnapshot.memory_change``, that is not an unplug)."""
    return v.fewer_vcpus or (v.memory_change and v.less_memory)


def vm_size(v: VmiSnapshot) -> VmSize:
    return VmSize.of(v.vcpus, v.guest_memory, v.status_vcpus, v.status_guest_memory)


def vm_key(v: VmiSnapshot) -> str:
    return v.uid or f"name:{v.name}"


@dataclass
class QuotaSums:
    """A managed quota's policy, factors and the running sums of the equation's terms."""

    policy: QuotaPolicy
    factors: dict[str, Fraction | None]
    ratio: Fraction
    used: Sum
    pods: Sum
    reserved: Sum
    overlap: Sum
    unvouched: Sum
    taken: Sum
    vmi_minimums: dict[str, str] = field(default_factory=dict)
    """:func:`~shared.quota.modes.vmi_minimums` of the quota."""
    projected: ResourceList = field(default_factory=dict)
    """What ``used`` counts of migration targets that do not exist yet, beyond what was admitted: room held for a
    larger pod, no pod's charge."""

    def counted(self, r: str) -> int:
        """``U + X / k`` of ``r`` in nanos (rounded up): what admission counts as used. ``hard`` holds no room for
        ``X`` at all, so in the mode's terms it costs ``X / k``: a VM admitted beside it then gets in natively."""
        return self.used.get(r) + in_mode_terms(self.unvouched.get(r), self.factors.get(r))

    def over(self, r: str, budget: Quantity, less: Quantity | None = None) -> bool:
        """A natively enforced (scaled) resource ``r`` that admission counts above its ``budget`` (``less`` that
        much, in ``U``), by what pods are charged: not by the growth of targets still to be made (``projected``)."""
        if self.factors.get(r) is None:
            return False
        projected = self.projected.get(r)
        return self.counted(r) - (less.nanos if less else 0) - (projected.nanos if projected else 0) > budget.nanos

    @property
    def label(self) -> str:
        """How reasons name the quota: ``quota <name> (<mode>)``, or ``(<mode>)`` for one with no name."""
        mode = f"({self.policy.mode.value})"
        return f"quota {self.policy.name} {mode}" if self.policy.name else mode

    def misfits(self, u: Mapping[str, Quantity]) -> tuple[str, ...]:
        """Natively enforced budget resources that ``U + X/k + u`` would exceed."""
        return tuple(
            sorted(
                r
                for r, b in self.policy.budget.items()
                if self.factors[r] is not None  # (factors cover the budget)
                and r in u
                and self.counted(r) + u[r].nanos > b.nanos
            )
        )


@dataclass(frozen=True, slots=True)
class Target:
    """A migration that may reserve its target pod: the oldest active one of a VMI with a running source pod and
    no target pod yet."""

    index: int
    """Its place among the migration entries."""
    m: VmimSnapshot
    v: VmiSnapshot
    estimate: ResourceList
    grow: ResourceList
    why: list[str]
    explained: ResourceList
    """The estimate before any refusal's amounts: what the VM's pods and KubeVirt's rendering explain."""


@dataclass(frozen=True, slots=True)
class CreatedTarget:
    """A migration whose target pod exists: its end may carry out a size change that was never admitted
    (``Admission._cancel_unadmitted``), and, of a VMI with hotplugged volumes whose target runs with no pod it controls
    yet (``attach``), its hotplug attachment pod may be reserved (``Migrations._decide_attachment``)."""

    index: int
    """Its place among the migration entries."""
    m: VmimSnapshot
    v: VmiSnapshot
    target: PodSnapshot
    labelled: tuple[tuple[PodSnapshot, ResourceList], ...]
    """Every pod of the VM that carries the migration's label, the target among them, with what quota charges each
    (the tenant may label a pod of its own so, one KubeVirt adopted into the VMI)."""
    grow: ResourceList
    exists: str
    """Why its entry says the target exists."""
    attach: bool


class State:
    """The namespace's objects and what the passes found so far (set by :class:`~shared.accounting.namespace.
    Accounting` before the passes run)."""

    now: datetime
    namespace: str
    errors: list[str]
    config: KubeVirtConfig
    memo: Memo
    vmis: list[VmiSnapshot]
    vmims: list[VmimSnapshot]
    pods: list[PodSnapshot]
    late: frozenset[str]
    """Uids of the pods created in a refusal of a migration, as the ledger's fold remembers them."""
    settled: frozenset[str]
    """Uids of the pods a change of a quota's policy found created since a migration, as the ledger's fold
    remembers them: their creation after a migration no longer holds it back."""
    made_for: Mapping[str, tuple[str, int, int]]
    """Launcher pod uid → the VMI it was made for, the vCPUs of its spec as the ledger's fold first saw the two
    together (at least what the pod was made for), and the fewest vCPUs the pod may have been made for
    (``shared.ledger.fold``; none from snapshots alone)."""
    refused: Mapping[str, ResourceList]
    """Pending VMI uid → the amounts of the latest quota refusal that named it, as the ledger's fold remembers them
    (``NamespaceState.refused``; none from snapshots alone): they outlast the Events."""
    quotas: list[QuotaSums]
    renderer: Renderer
    quotas_key: int
    """What a VM's counts depend on besides the VM: the quotas' names, modes, ratios and factors (a memo token)."""
    vouched: dict[str, VmiSnapshot]
    """Launcher pods by uid, as KubeVirt names them in its VMIs' ``status.activePods`` (or named them, and the pod
    still exists: ``departed_pods``)."""
    departed: list[VmiSnapshot]
    """VMIs gone, as they last named a launcher pod KubeVirt names no more that still exists (they count as running
    VMs with such pods)."""
    departed_pods: frozenset[str]
    """The pods among ``vouched`` that no VMI names now."""
    vmi_by_name: dict[str, VmiSnapshot]
    vmim_by_uid: dict[str, VmimSnapshot]
    refusals_by_uid: dict[str, list[EventSnapshot]]
    """Quota refusals by the uid of the VMI they are about (when the event names it)."""
    refusals_by_name: dict[str, list[EventSnapshot]]
    """Quota refusals by the name of the VMI they are about."""
    launchers: dict[str, list[tuple[PodSnapshot, ResourceList]]]
    """The running launcher pods of each VM (by :func:`vm_key`) and what each is charged."""
    as_vm_pods: dict[str, list[ResourceList]]
    """The charges of the pods that count as the VM they may run (``pods.made_for_unseen_vmi``), by the VMI their
    launcher command names (read only)."""
    pod_entries: list[PodEntry]
    mig_entries: list[MigrationEntry]
    targets: list[Target]
    created: list[CreatedTarget]
    vm_entries: dict[str, VmEntry]
    pending: list[VmiSnapshot]
    target_reserved: ResourceList
    """The part of every quota's ``S`` reserved for migration targets."""

    def _refusals(self, v: VmiSnapshot, since: datetime | None) -> list[ResourceList]:
        """The ``requested:`` amounts of each of the VMI's quota refusals at or after ``since``, in event order."""
        by_name = self.refusals_by_name.get(v.name, ())
        if v.uid:  # the events that name this uid, and those that name no uid but this VMI's name
            found = [*self.refusals_by_uid.get(v.uid, ()), *(e for e in by_name if not e.involved_uid)]
        else:
            found = list(by_name)
        return [
            e.requested
            for e in sorted(found, key=event_order)
            if since is None or e.last_timestamp is None or e.last_timestamp >= since
        ]

    def _misfits(self, usages: Mapping[str, ResourceList]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
        """Per quota, the budget resources ``U + usages[quota]`` would exceed, and a line for each."""
        misfit: dict[str, tuple[str, ...]] = {}
        parts: list[str] = []
        for q in self.quotas:
            u = usages[q.policy.name]
            rs = q.misfits(u)
            if not rs:
                continue
            misfit[q.policy.name] = rs
            budget = q.policy.budget
            left = {r: Quantity(max(budget[r].nanos - q.counted(r), 0), budget[r].format) for r in rs}
            detail = ", ".join(_needs(r, u[r], left[r], budget[r]) for r in rs)
            parts.append(f"{q.label}: {detail}")
        return misfit, parts

    def _bounded(
        self, estimate: Mapping[str, Quantity], refusals: Sequence[Mapping[str, Quantity]], ref: str
    ) -> tuple[ResourceList, ResourceList, bool]:
        """The estimate with the amounts of quota refusals in place of estimated ones where they are larger, each only
        up to :func:`evidence_bound` above the estimate (an Event is anyone's to write: evidence, not truth); the
        others are ignored, those beyond the bound (or of resources not estimated) reported. Of the refusals'
        amounts within the bound the largest is taken, whatever an Event says of its time (a migration's target: a
        tenant's Event dated ahead of KubeVirt's, smaller or beyond the bound, took the place of KubeVirt's amounts,
        and a target KubeVirt renders larger than vmquota's estimate then had room for the estimate only, refused for
        as long as the Event was kept; a pending VM's pod is given its latest refusal alone, ``Admission._admit``).
        Amounts in resources no managed quota limits are no matter (a refusal from before its quota's budget
        changed: the VM waited for KubeVirt's backoff, no room held). Returns the corrected estimate, the amounts
        taken, and whether any refusal has an amount beyond the bound. Never smaller: a refusal is KubeVirt's word
        for a pod it tried to create, and that pod may have been rendered from an older spec (a migration refused
        before a hotplug made its target larger); an estimate too large only reserves room the pod does not take,
        one too small would let it take room reserved for others."""
        out = dict(estimate)
        taken: ResourceList = {}
        ignored: list[str] = []
        limited = charged_alike(r for q in self.quotas for r in q.policy.budget)
        for refused in refusals:
            for r, amount in sorted(refused.items()):
                if r not in limited:  # (no room is held in it: a quota since changed, or not a managed one's)
                    continue
                est = estimate.get(r)
                bound = evidence_bound(r, est) if est is not None else None
                if est is not None and bound is not None and 0 <= amount.nanos - est.nanos <= bound.nanos:
                    if amount.nanos > out[r].nanos or r not in taken:
                        out[r] = taken[r] = amount
                elif est is None or bound is None or amount.nanos - est.nanos > bound.nanos:
                    within = f"{est} + up to {bound}" if est is not None else "not estimated"
                    ignored.append(f"{r}={amount} ({within})")
        if ignored:  # (one line for the pod, however many Events and resources: their text is the tenant's)
            ignored = list(dict.fromkeys(ignored))
            shown = ", ".join(ignored[:_IGNORED_SHOWN])
            more = f" and {len(ignored) - _IGNORED_SHOWN} more" if len(ignored) > _IGNORED_SHOWN else ""
            self.errors.append(
                f"{ref}: quota refusal amounts ignored: {shown}{more}; an Event may raise an estimate only within "
                "its bound"
            )
        return out, taken, bool(ignored)
