"""The quota equation: the ``spec.hard`` a managed ResourceQuota must carry, as a pure function of its budget and
the namespace's usage.

For every resource ``r`` in the budget ``B``::

    hard[r] = k[r] * max(B[r] - U[r], 0) + P[r] - D[r] + S[r]

``U`` is the accounted usage in the mode's terms, ``P`` what the native evaluator charges the namespace's pods,
``S`` the reservations (launcher pods of admitted VMs and migration targets that do not exist yet), ``D`` the
overlap of migrating VMs: what a VM's launcher pods are charged beyond the larger of them (source and target). With
``D``, ``hard`` holds room for one launcher pod per VM: when either pod of a migration ends, the quota controller
frees what ``hard`` never held, so no other pod can take it before vmquota catches up (Kubernetes allows
``used > hard``; it only refuses new pods).

``k[r]`` (:func:`shared.quota.modes.pod_factor`) expresses the mode headroom ``max(B - U, 0)`` in pod terms. Native
admission admits a pod ``p`` iff ``P + p <= hard``, i.e. iff ``p <= k * max(B - U, 0) + S``; a VM the mode refuses
(``u > B - U`` for some ``r``) is then refused natively as long as its pod is charged ``p >= k * u`` for that
``r``. ``k = 1`` wherever the launcher pod is charged at least what the mode counts (``VmiPodUsage``, limits,
pod counts, resources at pod usage, the ratio mode when the quota's ratio is KubeVirt's); below 1 where the mode
counts more (``VirtualResources`` requests.cpu: ``1 / cpuAllocationRatio``; guest memory with memory overcommit;
a quota ratio lower than KubeVirt's). The price: non-VM pods share that resource's headroom at ``k`` rather than
1:1. ``k = None`` marks a report-only resource (the ``/vmi`` names, which no pod is charged for): ``hard = B``.

A ``hard`` beyond what Kubernetes can represent (an int64 of base units; only pods charged absurd amounts add up
to it) is the budget instead: no quota could carry it, and native quota's is ``B``.

A scaled headroom is rounded down (to whole millicores, or whole bytes for byte resources), so rounding never
lets a refused VM in. See ``docs/accounting.md`` for the reasoning and the invariants.
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


def scaled_headroom(headroom: Quantity, factor: Fraction, resource: str) -> Quantity:
    """``factor * headroom`` rounded down to whole bytes (byte resources) or whole milli-units (others)."""
    if factor == 1:
        return headroom
    step = _UNIT_NANOS if is_byte_resource(resource) else _MILLI_NANOS
    scaled = Fraction(headroom.nanos) * factor
    nanos = (scaled.numerator // (scaled.denominator * step)) * step
    return Quantity(nanos, headroom.format)


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
    room ``hard - status.used`` then stays at most ``k * max(B - U, 0) + S``, whatever the bus claims. Where
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
    accounted: Mapping[str, Quantity],
    pod_usage: Mapping[str, Quantity],
    reserved: Mapping[str, Quantity],
    factors: Mapping[str, Fraction | None] | None = None,
    overlap: Mapping[str, Quantity] | None = None,
    targets: Mapping[str, Quantity] | None = None,
) -> ResourceList:
    """``hard[r] = k[r] * max(B[r] - U[r], 0) + P[r] - D[r] + S[r]`` for every ``r`` in ``budget``; ``k`` defaults
    to 1, ``D`` (``overlap``) to nothing, and a factor of None keeps ``hard[r] = B[r]`` (report-only resource).
    Each value keeps the budget's format.

    ``targets``: the part of ``S`` reserved for migration targets. While some is, ``D`` is held back only as far as
    the headroom and the other reservations cover it (``min(D, k * max(B - U, 0) + S - targets)``), so that a
    pending target always finds its room: see :func:`held_back`."""
    hard: ResourceList = {}
    for r, b in budget.items():
        factor = _ONE if factors is None else factors.get(r, _ONE)
        if factor is None:
            hard[r] = b
            continue
        headroom = (b - accounted.get(r, ZERO)).clamp0()
        scaled = scaled_headroom(headroom, factor, r)
        total = scaled + pod_usage.get(r, ZERO) + reserved.get(r, ZERO)
        if overlap:
            total = total - held_back(r, scaled, overlap, reserved, targets)
        if total.nanos > MAX_NANOS:  # (only absurd pods get here: no quota can hold it, native quota's is B)
            total = b
        hard[r] = total.with_format(b.format)
    return hard


def held_back(
    resource: str,
    headroom: Quantity,
    overlap: Mapping[str, Quantity],
    reserved: Mapping[str, Quantity],
    targets: Mapping[str, Quantity] | None,
) -> Quantity:
    """How much of the overlap ``D`` (what migrating VMs' second launcher pods are charged) ``hard`` holds no room
    for: all of it, so that the end of either pod of a migration frees nothing another pod could take, except
    while migration targets are reserved (``targets``): then only as far as the (scaled) ``headroom`` and the other
    reservations cover it, so that those targets still get in. The room that exception leaves is open while they
    wait, like any reservation."""
    d = overlap.get(resource, ZERO)
    pending = ZERO if targets is None else targets.get(resource, ZERO)
    if d.nanos <= 0 or pending.nanos <= 0:
        return d
    cover = headroom + reserved.get(resource, ZERO) - pending
    return d if d <= cover else cover.clamp0()
