"""The quota equation: the ``spec.hard`` a managed ResourceQuota must carry, as a pure function of its budget and
the namespace's usage.

For every resource ``r`` in the budget ``B``::

    hard[r] = P[r] + S[r] + R[r],    R[r] = k[r] * B[r] - W[r] - D[r]

``P`` is what the native evaluator charges the namespace's pods, ``S`` the reservations (launcher pods of admitted
VMs and migration targets that do not exist yet), ``W`` what the namespace **takes** of the budget in pod terms,
and ``D`` the overlap of migrating VMs: what a VM's launcher pods are charged beyond the larger of them (source and
target). ``W`` adds up, for every pod and VM accounting counts:

* a plain pod: its charge (it counts its charge in ``U`` too);
* a running VM: the larger of its launcher pod's charge and ``k`` times what it counts in the mode's terms;
* a VM admitted but not running yet, and an admitted hotplug's growth: ``k`` times what it counts (its pod is
  in ``S``).

``R`` is the room native admission leaves for pods vmquota did not reserve (``hard - P - S``). It may be negative
(the namespace's pods then already take more than the budget: Kubernetes allows ``used > hard``, it only refuses
new pods), except where something is reserved (``S[r] > 0``): there ``k * B - W - X`` is at least zero (``X``, the
unvouched part of ``D``, counts as used when the ledger admits), so that what vmquota admitted finds its room
whatever overhead the pods carry; the rest of ``D``, active migrations' second pods, is then held back as far as
reserved migration targets allow (:func:`held_back`).

Why each term:

* With ``W``, the end of any pod frees no more room than its end frees of the budget: a pod takes at least its
  charge from ``R``, so the quota controller's release of that charge is room the fresh ``hard`` leaves too.
  (Counting what a pod counts in the mode's terms instead, ``k * (B - U)``, made a VM's overhead, or a plain pod's
  charge in a scaled resource, room above the budget until vmquota lowered ``hard``: a plain pod of 3 cores
  ending in ``VirtualResources`` with KubeVirt's ratio 10 let a VM of 30 vCPUs in.) The price: pods other than
  those vmquota admits share what the budget leaves after every pod's charge (a VM's overhead included), and, in a
  scaled resource, at most ``k`` times the budget.
* With ``D``, ``hard`` holds room for one launcher pod per VM: when either pod of a migration ends, the quota
  controller frees what ``hard`` never held. While a migration target is reserved it gets in even when the
  namespace is full: the second pods of other migrations are held back only as far as the room covers them. A VM
  admitted while a migration holds two pods waits for the source pod to end (and is nudged then).
* ``S`` is room for pods vmquota admitted in the mode's terms (``U + u <= B``): a VM's launcher pod gets in however
  much overhead it carries, because its reservation is its whole pod.

``k[r]`` (:func:`shared.quota.modes.pod_factor`) expresses the mode's amounts in pod terms. Native admission admits
a pod ``p`` iff ``P + p <= hard``, i.e. iff ``p <= R + S``. A VM the mode refuses (``u > B - U`` for some ``r``) is
refused natively before vmquota reserves anything for it as long as its pod is charged ``p >= k * u`` for that
``r``: ``W >= k * U``, so ``R <= k * (B - U) < k * u <= p``. ``k = 1`` wherever the launcher pod is charged at least
what the mode counts (``VmiPodUsage``, limits, pod counts, resources at pod usage, the ratio mode when the quota's
ratio is KubeVirt's); below 1 where the mode counts more (``VirtualResources`` requests.cpu:
``1 / cpuAllocationRatio``; guest memory with memory overcommit; a quota ratio lower than KubeVirt's). ``k = None``
marks a report-only resource (the ``/vmi`` names, which no pod is charged for): ``hard = B``.

A ``hard`` beyond what Kubernetes can represent (an int64 of base units; only pods charged absurd amounts add up
to it) is the budget instead: no quota could carry it, and native quota's is ``B``. A ``hard`` below zero is zero.

Rounding is to whole millicores, or whole bytes for byte resources, always against the room: ``k * B`` down, and
``k`` times what an item counts up, so rounding never lets a refused VM in nor a pod's end open room. See
``docs/accounting.md`` for the reasoning and the invariants.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Final

from shared.quantity import MAX_NANOS, ZERO, Quantity
from shared.resources import ResourceList, is_byte_resource

_MILLI_NANOS: Final = 1_000_000
_UNIT_NANOS: Final = 1_000_000_000
_ONE: Final = Fraction(1)


def _step(resource: str) -> int:
    return _UNIT_NANOS if is_byte_resource(resource) else _MILLI_NANOS


def scaled_headroom(headroom: Quantity, factor: Fraction, resource: str) -> Quantity:
    """``factor * headroom`` rounded down (towards minus infinity) to whole bytes (byte resources) or whole
    milli-units (others)."""
    if factor == 1:
        return headroom
    step = _step(resource)
    scaled = Fraction(headroom.nanos) * factor
    nanos = (scaled.numerator // (scaled.denominator * step)) * step
    return Quantity(nanos, headroom.format)


def scaled_up(amount: Quantity, factor: Fraction, resource: str) -> Quantity:
    """``factor * amount`` rounded up to whole bytes (byte resources) or whole milli-units (others)."""
    if factor == 1:
        return amount
    step = _step(resource)
    scaled = Fraction(amount.nanos) * factor
    nanos = -(-scaled.numerator // (scaled.denominator * step)) * step
    return Quantity(nanos, amount.format)


def takes(
    charged: Mapping[str, Quantity], counted: Mapping[str, Quantity], factors: Mapping[str, Fraction | None]
) -> ResourceList:
    """What one VM takes of the budget in pod terms (its part of ``W``): per resource ``r`` with a factor, the
    larger of what its launcher pod is ``charged`` and ``k`` times what it is ``counted`` in the mode's terms
    (rounded up); ``charged`` empty for a VM whose pod is not charged yet (admitted, its pod reserved). Resources
    where that is nothing are left out."""
    out: ResourceList = {}
    for r, factor in factors.items():
        if factor is None:
            continue
        p, u = charged.get(r), counted.get(r)
        share = None if u is None else scaled_up(u, factor, r)
        most = p if share is None or (p is not None and p.nanos >= share.nanos) else share
        if most is not None and most.nanos > 0:
            out[r] = most
    return out


def in_mode_terms(nanos: int, factor: Fraction | None) -> int:
    """A pod-terms amount ``nanos`` in the mode's terms: ``nanos / factor``, rounded up (unchanged for a factor of
    1 or None). What ``hard`` holds no room for costs that much of the budget."""
    if not nanos or factor is None or factor >= 1:
        return nanos
    return -(-nanos * factor.denominator // factor.numerator)


def within_charged(
    hard: Mapping[str, Quantity], pod_usage: Mapping[str, Quantity], charged: Mapping[str, Quantity]
) -> ResourceList:
    """``hard`` less what ``P`` (``pod_usage``, what the events say the pods are charged) exceeds ``charged`` (the
    quota's ``status.used``, read from the API server) by, per resource, never below zero.

    Quota admission adds a pod's charge to ``status.used`` before the pod exists, so for every pod that exists
    ``P <= status.used``; ``P > status.used`` means pods the cluster never charged (a forged pod on the bus). The
    room ``hard - status.used`` then stays at most ``R + S``, whatever the bus claims. Where
    ``status.used`` is higher (pods ended, the quota controller not yet caught up) nothing changes. A resource
    missing from either side is left as it is."""
    out = dict(hard)
    for r, h in hard.items():
        p, c = pod_usage.get(r), charged.get(r)
        if p is None or c is None:
            continue
        excess = p - c
        if excess.nanos > 0:
            cut = h - excess
            out[r] = cut if cut.nanos > 0 else ZERO
    return out


def desired_hard(
    budget: Mapping[str, Quantity],
    taken: Mapping[str, Quantity],
    pod_usage: Mapping[str, Quantity],
    reserved: Mapping[str, Quantity],
    factors: Mapping[str, Fraction | None] | None = None,
    overlap: Mapping[str, Quantity] | None = None,
    unvouched: Mapping[str, Quantity] | None = None,
    targets: Mapping[str, Quantity] | None = None,
) -> ResourceList:
    """``hard[r] = P[r] + S[r] + R[r]`` with ``R[r] = k[r] * B[r] - W[r] - D[r]`` (``W``: ``taken``) for every
    ``r`` in ``budget``; ``hard`` is at least zero. ``k`` defaults to 1, ``D`` (``overlap``) and its unvouched part
    ``X`` (``unvouched``) to nothing; a factor of None keeps ``hard[r] = B[r]`` (report-only resource). (What is
    published and written prints each value in its resource's form: ``shared.resources.canonical_resource_list``.)

    Where something is reserved (``S[r] > 0``), ``k * B - W - X`` is at least zero, so that what vmquota admitted
    finds its room whatever overhead the pods carry (the ledger admitted it in the mode's terms, ``X`` counted); the
    rest of ``D``, active migrations' second pods, is held back in full (a VM admitted meanwhile waits for a source
    pod to end) except while migration targets are reserved (``targets``: the part of ``S`` for them): then only as
    far as that room and the other reservations cover it, so that a pending target always finds its room (see
    :func:`held_back`)."""
    hard: ResourceList = {}
    for r, b in budget.items():
        factor = _ONE if factors is None else factors.get(r, _ONE)
        if factor is None:
            hard[r] = b
            continue
        held = reserved.get(r, ZERO)
        room = scaled_headroom(b, factor, r) - taken.get(r, ZERO)
        d = overlap.get(r, ZERO) if overlap else ZERO
        x = unvouched.get(r, ZERO) if unvouched else ZERO
        room = room - x
        if held.nanos > 0:  # (what vmquota admitted gets in, whatever the pods already take)
            room = room.clamp0()
        second = d - x  # (active migrations' second pods)
        if second.nanos > 0:
            room = room - held_back(r, room, second, reserved, targets)
        total = pod_usage.get(r, ZERO) + held + room
        if total.nanos > MAX_NANOS:  # (only absurd pods get here: no quota can hold it, native quota's is B)
            total = b
        hard[r] = total.clamp0().with_format(b.format)
    return hard


def held_back(
    resource: str,
    room: Quantity,
    second: Quantity,
    reserved: Mapping[str, Quantity],
    targets: Mapping[str, Quantity] | None,
) -> Quantity:
    """How much of ``second`` (what active migrations' second launcher pods are charged) ``hard`` holds no room
    for: all of it, so that the end of either pod of a migration frees nothing another pod could take, except
    while migration targets are reserved (``targets``): then only as far as the ``room`` and the other reservations
    cover it, so that those targets still get in. The room that exception leaves is open while they wait, like any
    reservation."""
    pending = ZERO if targets is None else targets.get(resource, ZERO)
    if pending.nanos <= 0:
        return second
    cover = room + reserved.get(resource, ZERO) - pending
    return second if second <= cover else cover.clamp0()
