"""Kubernetes' pod resource rules (``k8s.io/component-helpers/resource``), pure.

:func:`pod_totals` is the one place the effective requests/limits of a pod are computed: the sum of containers
and restartable init containers (sidecars), max'ed with each plain init container (plus the sidecars started
before it), plus ``spec.overhead`` (added to limits only where a limit exists).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.quantity import Quantity
from shared.resources import ResourceList, add, format_resource_list, maximum


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """Requests and limits of one container, and whether it is an init container / a sidecar."""

    name: str
    requests: Mapping[str, Quantity]
    limits: Mapping[str, Quantity]
    init: bool = False
    """An init container (plain unless ``restartable``)."""
    restartable: bool = False
    """An init container with ``restartPolicy: Always`` (a sidecar): counted with the containers."""

    def to_json(self) -> dict[str, Any]:
        """The container as it appears in a pod spec (name, resources, restartPolicy for sidecars)."""
        res = {k: format_resource_list(v) for k, v in (("requests", self.requests), ("limits", self.limits)) if v}
        out: dict[str, Any] = {"name": self.name, "resources": res}
        if self.restartable:
            out["restartPolicy"] = "Always"
        return out


def _effective(containers: Iterable[ContainerSpec], pick: str) -> ResourceList:
    total: ResourceList = {}
    sidecars: ResourceList = {}
    init_peak: ResourceList = {}
    for c in containers:
        rl: Mapping[str, Quantity] = c.requests if pick == "requests" else c.limits
        if not c.init:
            total = add(total, rl)
        elif c.restartable:
            total = add(total, rl)
            sidecars = add(sidecars, rl)
            init_peak = maximum(init_peak, sidecars)
        else:
            init_peak = maximum(init_peak, add(rl, sidecars))
    return maximum(total, init_peak)


def pod_totals(
    containers: Iterable[ContainerSpec], overhead: Mapping[str, Quantity] | None = None
) -> tuple[ResourceList, ResourceList]:
    """Effective pod (requests, limits). ``containers`` in pod order: init containers first, as in a pod spec."""
    cs = list(containers)
    # Kubernetes walks init containers in order for the peak and sums regular containers separately.
    ordered = [c for c in cs if c.init] + [c for c in cs if not c.init]
    requests = _effective(ordered, "requests")
    limits = _effective(ordered, "limits")
    if overhead:
        requests = add(requests, overhead)
        limits = {k: (v + overhead[k] if k in overhead else v) for k, v in limits.items()}
    return requests, limits
