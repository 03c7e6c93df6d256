"""What :func:`~shared.accounting.namespace.account_namespace` returns: a namespace's usage per managed quota
(``U``, ``P``, ``S``, the overlap ``D``, the unvouched ``X``, ``hard``) and every VM, migration and pod with what it
counts and why, and the names of their states.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Final

from shared.quota.modes import QuotaPolicy, VmSize
from shared.resources import ResourceList

# VM states
RUNNING: Final = "running"
ADMITTED: Final = "admitted"
REFUSED: Final = "refused"
STOPPED: Final = "stopped"

# pod roles
LAUNCHER: Final = "launcher"
MIGRATION_TARGET: Final = "migration-target"
NON_VM: Final = "non-vm"
ORPHAN_LAUNCHER: Final = "orphan-launcher"

# migration states
PENDING: Final = "pending"
TARGET_CREATED: Final = "target-created"
ATTACHMENT_RESERVED: Final = "attachment-reserved"
"""A migration whose target exists, of a VMI with hotplugged volumes: KubeVirt goes on only once it has an attachment
pod beside the target, whose room is reserved."""
QUEUED: Final = "queued"
WAITING: Final = "waiting"
NOT_TRIED: Final = "not-tried"
GROWTH_REFUSED: Final = "growth-refused"
CANCEL: Final = "cancel"
"""A migration whose target exists and whose end would carry out a size change of its VM never admitted (its target
made before the change, or, where pods cannot show it, a change that does not fit): the enforcer deletes it
(``Admission._cancel_unadmitted``)."""


@dataclass(frozen=True, slots=True)
class VmEntry:
    name: str
    uid: str
    phase: str
    state: str
    """``running``, ``admitted`` (pending, pod reserved), ``refused`` (pending, does not fit) or ``stopped``."""
    reason: str
    size: VmSize
    pod_usage: ResourceList
    """The launcher pod usage the VM counts at (real pods, at most their rendering; else the estimate)."""
    counts: Mapping[str, ResourceList]
    """Per quota: what the VM adds to ``U`` (empty for a refused or stopped VM)."""
    reserved: ResourceList = field(default_factory=dict)
    """The launcher pod reservation (admitted VMs only)."""
    refused_by: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per quota: the resources the VM does not fit."""
    overlap: ResourceList = field(default_factory=dict)
    """What its pods are charged beyond the one launcher pod ``hard`` holds room for (the larger of them, at most
    as vmquota renders it): ``D`` in the equation."""
    unvouched: ResourceList = field(default_factory=dict)
    """The part of ``overlap`` that is not a migration target's (a second pod with no active migration: a
    finished migration's source, or a tenant's pod KubeVirt adopted; a third pod; a pod charged beyond the
    rendering): it counts as used when VMs and hotplugs are admitted."""
    taken: Mapping[str, ResourceList] = field(default_factory=dict)
    """Per quota: what it takes of the budget in pod terms (its part of ``W``): the larger of its launcher pod's
    charge and ``k`` times what it counts."""
    pod_refused: bool = False
    """Admitted, but KubeVirt's last try to create its launcher pod was refused (VMI condition
    ``Synchronized=False``, reason ``FailedCreate``): KubeVirt needs a nudge to try again once there is room."""
    vmi_size: str = ""
    """Admitted: the :func:`~shared.snapshot.size_digest` of the VMI its launcher pod was reserved from (the
    enforcer opens the room only while the VMI still has it)."""


@dataclass(frozen=True, slots=True)
class MigrationEntry:
    name: str
    uid: str
    vmi: str
    phase: str
    state: str
    """``pending`` (target reserved: KubeVirt was refused it), ``not-tried`` (no room held: KubeVirt has not been
    refused a target pod), ``growth-refused`` (its hotplug growth does not fit), ``target-created``, ``cancel``
    (its target exists, and its end would carry out a size change never admitted: the enforcer deletes it),
    ``queued`` (behind another migration of the VMI), ``waiting`` (the VMI has no running launcher pod) or
    ``attachment-reserved`` (its target exists and the room of its hotplug attachment pod is reserved)."""
    reason: str
    reserved: ResourceList = field(default_factory=dict)
    growth: ResourceList = field(default_factory=dict)
    """Target minus source, in pod terms (hotplug)."""
    rejected_by_quota: bool = False
    vmi_size: str = ""
    """A pending migration's: the :func:`~shared.snapshot.size_digest` of the VMI spec its target was reserved
    from (the enforcer opens the room only while the VMI still has that size)."""
    vmi_uid: str = ""
    """A pending migration's: its VMI's uid (the reservation guard's holder, whatever else a snapshot carries)."""
    target_pod_uid: str = ""
    """``attachment-reserved``: the target pod's uid, which the attachment pod's controller reference names (the
    reservation guard's holder)."""


@dataclass(frozen=True, slots=True)
class PodEntry:
    name: str
    uid: str
    role: str
    """``launcher`` (of a VM in the set), ``migration-target``, ``non-vm`` or ``orphan-launcher``."""
    vmi: str
    active: bool
    """Charged for compute (not terminal, not past its deletion grace period)."""
    charged: ResourceList
    """What the native evaluator charges (its share of ``P``)."""
    counts: ResourceList
    """What the pod adds to ``U`` itself (launcher pods: nothing, their VM counts)."""
    reason: str


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    policy: QuotaPolicy
    used: ResourceList
    """``U``."""
    pods: ResourceList
    """``P``."""
    reserved: ResourceList
    """``S``."""
    overlap: ResourceList
    """``D``: what VMs' pods are charged beyond the one launcher pod per VM ``hard`` holds room for."""
    unvouched: ResourceList
    """``X``: the part of ``D`` that is no migration's target; used when VMs are admitted (``U + X/k + u <= B``)."""
    taken: ResourceList
    """``W``: what the namespace takes of the budget in pod terms (``hard = P + S + k * B - W - D``)."""
    factors: Mapping[str, Fraction | None]
    """``k`` per budget resource (see ``shared.quota.equation``)."""
    hard: ResourceList
    over_budget: tuple[str, ...]
    """Budget resources where ``U + X/k > B``."""
    vmi_minimums: Mapping[str, str] = field(default_factory=dict)
    """``shared.quota.modes.vmi_minimums`` of the quota."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    namespace: str
    quotas: Mapping[str, QuotaUsage]
    vms: tuple[VmEntry, ...]
    migrations: tuple[MigrationEntry, ...]
    pods: tuple[PodEntry, ...]
    errors: tuple[str, ...] = ()
    """Problems that did not stop accounting (an invalid managed quota, a VMI the renderer cannot read)."""
