"""When the ledger accounts a namespace after a change: how urgent a change is (:func:`urgency`, :class:`Urgency`)
and which changed namespaces are due (:func:`schedule`). Only the timing of accounting depends on this, never its
result.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from enum import IntEnum
from typing import Final

from shared.bounded import Bounded
from shared.kinds import EVENT_KIND, POD_KIND, QUOTA_KIND, VMI_KIND, VMIM_KIND
from shared.quota.modes import policy_changed
from shared.resources import ResourceList
from shared.snapshot import EventSnapshot, PodSnapshot, QuotaSnapshot, Snapshot, VmimSnapshot, VmiSnapshot

URGENT_KINDS: Final[frozenset[str]] = frozenset({VMIM_KIND, VMI_KIND, EVENT_KIND, QUOTA_KIND, POD_KIND})
"""The kinds :func:`urgency` may find urgent."""


class Urgent(IntEnum):
    """How soon the ledger accounts a namespace after a change of one of its objects (:func:`urgency`)."""

    NO = 0
    """At the namespace's debounce: nothing waits for the change."""
    SOON = 1
    """After a short delay that gathers such changes: a reservation ends (a migration or a VMI ends or goes, a VMI
    changes phase) or a VMI's ``status.activePods`` changes, so ``hard`` comes down, but nothing waits for it."""
    NOW = 2
    """At once, before other namespaces: a migration or a VM waits for the reservation this starts or corrects (a
    migration appears or becomes active, KubeVirt reports it was refused a migration's target or a VMI's launcher
    pod, a VMI appears or changes size, a quota refusal brings new amounts, a
    quota appears, goes or changes what accounting reads of it: its policy, or which resources ``spec.hard`` names,
    not the enforcer's own writes of ``spec.hard`` values and its annotations; a pod that is not a launcher pod
    appears: quota admission may have let it into room ``hard`` holds for a reservation, and ``hard`` must make
    room again)."""


def urgency(old: Snapshot | None, new: Snapshot | None) -> Urgent:
    """How soon a change of one object (``old`` → ``new``; None: absent) must be accounted: see :class:`Urgent`.
    A migration's progress through its active phases changes no reservation (the target pod's appearance ends it,
    and adds as much to ``P``); neither does a launcher pod (above all: it ends a reservation but adds as much to
    ``P``, so ``hard`` stays), a pod's update nor a quota's status. See :class:`Urgency` for repeated refusals."""
    obj = new if new is not None else old
    if obj is None:
        return Urgent.NO
    if isinstance(obj, PodSnapshot):  # (the bulk of a stream: the common case first)
        if obj.is_launcher or (old is not None and new is not None):
            return Urgent.NO
        return Urgent.NOW if new is not None else Urgent.SOON
    if isinstance(obj, VmimSnapshot):  # a reservation starts with a migration and ends when it is no longer active
        if not isinstance(new, VmimSnapshot):
            return Urgent.SOON
        if not isinstance(old, VmimSnapshot) or old.active != new.active:
            return Urgent.NOW if new.active else Urgent.SOON
        if new.rejected_by_quota and not old.rejected_by_quota:
            return Urgent.NOW  # KubeVirt was refused the target: room for it is made now, and only now
        return Urgent.NOW if old.vmi_name != new.vmi_name else Urgent.NO
    if isinstance(obj, QuotaSnapshot):  # (the enforcer's own writes, of spec.hard and its annotations, are not)
        if not isinstance(old, QuotaSnapshot) or not isinstance(new, QuotaSnapshot):
            return Urgent.NOW
        # (what accounting reads of a quota: its policy, or why it cannot be managed, and which resources its
        # spec.hard names: whether the launcher pods get automatic limits)
        changed = policy_changed(old, new) or old.spec_hard.keys() != new.spec_hard.keys()
        return Urgent.NOW if changed else Urgent.NO
    if isinstance(obj, VmiSnapshot):
        if not isinstance(new, VmiSnapshot):
            return Urgent.SOON
        if not isinstance(old, VmiSnapshot) or _vmi_size(old) != _vmi_size(new):
            return Urgent.NOW
        if new.pod_refused and not old.pod_refused:
            return Urgent.NOW  # KubeVirt was refused the launcher pod: its refusal amounts now count, a nudge waits
        if old.active_pods != new.active_pods:
            return Urgent.SOON  # a pod became (or stopped being) a launcher pod: U and D change
        return Urgent.SOON if (old.phase, old.deletion_timestamp) != (new.phase, new.deletion_timestamp) else Urgent.NO
    if isinstance(obj, EventSnapshot):
        if not isinstance(old, EventSnapshot) or not isinstance(new, EventSnapshot):
            if not obj.quota_refusal:
                return Urgent.NO
            return Urgent.NOW if new is not None else Urgent.SOON  # a correction; or one that goes
        return Urgent.NOW if (old.quota_name, old.requested) != (new.quota_name, new.requested) else Urgent.NO
    return Urgent.NO


Key = tuple[str, str]
"""(cluster, namespace)."""


def waited_for(changed: Collection[Key], urgent: Mapping[Key, Urgent]) -> list[Key]:
    """The changed namespaces a migration or a VM waits for (an ``Urgent.NOW`` change), in ``urgent``'s order (that
    of their first urgent change)."""
    return [k for k, level in urgent.items() if level is Urgent.NOW and k in changed]


def schedule(
    changed: Collection[Key],
    urgent: Mapping[Key, Urgent],
    accounted_at: Mapping[Key, float],
    now: float,
    *,
    debounce: float,
    soon: float,
) -> tuple[list[Key], float | None]:
    """Which changed namespaces to account now, in order, and the seconds until the next of the others is due
    (None: none waits). ``urgent``: the highest urgency of each namespace's changes since it was last accounted
    (``accounted_at``, the same clock as ``now``; never: due at once), in the order of their first urgent change.

    A namespace is due ``debounce`` seconds after it was last accounted, ``soon`` seconds after (at most
    ``debounce``) for an ``Urgent.SOON`` change, at once for an ``Urgent.NOW`` one. While any namespace has an
    ``Urgent.NOW`` change, only those are due (first, in ``urgent``'s order), so that the next one a migration waits
    for is not held up behind the others, which wait for the next round (0 s) unless overdue by a whole
    ``debounce``."""
    first = waited_for(changed, urgent)
    hold = -debounce if first else 0.0
    due: list[Key] = []
    wait: float | None = None
    for key in changed:
        level = urgent.get(key, Urgent.NO)
        if level is Urgent.NOW:
            continue
        left = accounted_at.get(key, -math.inf) + (min(soon, debounce) if level is Urgent.SOON else debounce) - now
        if left <= hold:
            due.append(key)
        else:
            left = max(left, 0.0)
            wait = left if wait is None else min(wait, left)
    return first + sorted(due), wait


class Urgency:
    """:func:`urgency`, except that a quota refusal (a new event, or an aggregated one seen again) repeating
    the amounts of the last refusal seen for the same VMI is not urgent: KubeVirt retries a refused pod on every
    quota update, and each retry is an event with the same ``requested:`` amounts, which correct nothing the first
    did not. (When a VMI is refused with the amounts of an earlier refusal, for a later migration, the correction
    waits for the ledger's debounce.) Only the timing of accounting depends on this, never its result."""

    def __init__(self, maxsize: int = 65536) -> None:
        self._last: Bounded[tuple[str, str, str], tuple[str, ResourceList]] = Bounded(maxsize)

    def __call__(self, old: Snapshot | None, new: Snapshot | None, cluster: str = "") -> Urgent:
        """How urgent the change is; ``cluster``: where the object is (a ledger may fold several)."""
        if not isinstance(new, EventSnapshot) or not new.quota_refusal:
            return urgency(old, new)
        key = (cluster, new.namespace, new.involved_uid or f"name:{new.involved_name}")
        amounts = (new.quota_name, new.requested)
        if self._last.get(key) == amounts:
            return Urgent.NO
        self._last.keep(key, amounts)
        return Urgent.NOW


def _vmi_size(v: VmiSnapshot) -> tuple[object, ...]:
    """What the size of a VMI's reservation (its launcher pod's estimate, a migration target's) depends on;
    ``spec`` is compared by identity (VMIs with the same kept spec share one dict, so an equal spec is the same
    object)."""
    return (
        v.vcpus,
        v.guest_memory,
        v.status_vcpus,
        v.status_guest_memory,
        v.memory_change,
        v.unplugged_interfaces,
        v.memory_overhead,
        id(v.spec),  # (explicit requests and limits are in it: domain.resources is kept)
    )
