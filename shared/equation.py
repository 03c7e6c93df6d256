"""The quota equation: the ``spec.hard`` a managed ResourceQuota must carry, as a pure function of its budget and
the namespace's usage.

For every resource ``r`` in the budget ``B``::

    hard[r] = k[r] * max(B[r] - U[r], 0) + P[r] + S[r]

``U`` is the accounted usage in the mode's terms, ``P`` what the native evaluator charges the namespace's pods,
``S`` the reservations (launcher pods of admitted VMs and migration targets that do not exist yet).

``k[r]`` (:func:`shared.modes.pod_factor`) expresses the mode headroom ``max(B - U, 0)`` in pod terms. Native
admission admits a pod ``p`` iff ``P + p <= hard``, i.e. iff ``p <= k * max(B - U, 0) + S``; a VM the mode refuses
(``u > B - U`` for some ``r``) is then refused natively as long as its pod is charged ``p >= k * u`` for that
``r``. ``k = 1`` wherever the launcher pod is charged at least what the mode counts (``VmiPodUsage``, limits,
pod counts, resources at pod usage, the ratio mode when the quota's ratio is KubeVirt's); below 1 where the mode
counts more (``VirtualResources`` requests.cpu: ``1 / cpuAllocationRatio``; guest memory with memory overcommit;
a quota ratio lower than KubeVirt's). The price: non-VM pods share that resource's headroom at ``k`` rather than
1:1. ``k = None`` marks a report-only resource (the ``/vmi`` names, which no pod is charged for): ``hard = B``.

A scaled headroom is rounded down (to whole millicores, or whole bytes for byte resources), so rounding never
lets a refused VM in. See ``docs/accounting.md`` for the reasoning and the invariants.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Final

from shared.quantity import ZERO, Quantity
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


def desired_hard(
    budget: Mapping[str, Quantity],
    accounted: Mapping[str, Quantity],
    pod_usage: Mapping[str, Quantity],
    reserved: Mapping[str, Quantity],
    factors: Mapping[str, Fraction | None] | None = None,
) -> ResourceList:
    """``hard[r] = k[r] * max(B[r] - U[r], 0) + P[r] + S[r]`` for every ``r`` in ``budget``; ``k`` defaults to 1
    and a factor of None keeps ``hard[r] = B[r]`` (report-only resource). Each value keeps the budget's format."""
    hard: ResourceList = {}
    for r, b in budget.items():
        factor = _ONE if factors is None else factors.get(r, _ONE)
        if factor is None:
            hard[r] = b
            continue
        headroom = (b - accounted.get(r, ZERO)).clamp0()
        total = scaled_headroom(headroom, factor, r) + pod_usage.get(r, ZERO) + reserved.get(r, ZERO)
        hard[r] = total.with_format(b.format)
    return hard
