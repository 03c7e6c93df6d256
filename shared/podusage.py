"""Kubernetes' pod resource rules (``k8s.io/component-helpers/resource``), pure.

:func:`pod_totals` is the one place the effective requests/limits of a pod are computed: the sum of containers
and restartable init containers (sidecars), max'ed with each plain init container (plus the sidecars started
before it), plus ``spec.overhead`` (added to limits only where a limit exists).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from shared.errors import InvalidInput
from shared.quantity import Quantity
from shared.resources import ResourceList, add, format_resource_list, maximum, parse_resource_list


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


# ---- a pod object as the ResourceQuota evaluator charges it ----------------------------------------------------

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_REQUEST_STANDARD = ("cpu", "memory", "ephemeral-storage")
_LIMIT_STANDARD = ("cpu", "memory", "ephemeral-storage")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def counts_for_compute(
    phase: object, deletion_timestamp: datetime | None, grace_seconds: object, now: datetime | None = None
) -> bool:
    """False for pods the quota evaluator charges only ``count/pods``: phase Succeeded/Failed, or terminating
    past ``deletionTimestamp + deletionGracePeriodSeconds`` (``now`` defaults to the current UTC time)."""
    if phase in TERMINAL_PHASES:
        return False
    if deletion_timestamp is not None and isinstance(grace_seconds, int) and not isinstance(grace_seconds, bool):
        current = now or datetime.now(UTC)
        if current > deletion_timestamp + timedelta(seconds=grace_seconds):
            return False
    return True


def pod_counts_for_compute(pod: Mapping[str, Any], now: datetime | None = None) -> bool:
    """:func:`counts_for_compute` of a pod object."""
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return counts_for_compute(phase, None, None, now)
    return counts_for_compute(
        phase, _parse_time(meta.get("deletionTimestamp")), meta.get("deletionGracePeriodSeconds"), now
    )


def pod_containers(pod: Mapping[str, Any]) -> list[ContainerSpec]:
    """The containers of a pod object (init containers first), with parsed resources; InvalidInput on bad input."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidInput("pod has no spec", "spec")
    out: list[ContainerSpec] = []
    for field, init in (("initContainers", True), ("containers", False)):
        items = spec.get(field) or []
        if not isinstance(items, list):
            raise InvalidInput("expected a list", f"spec.{field}")
        for i, c in enumerate(items):
            where = f"spec.{field}[{i}]"
            if not isinstance(c, Mapping):
                raise InvalidInput("expected a container object", where)
            res = c.get("resources") or {}
            if not isinstance(res, Mapping):
                raise InvalidInput("expected an object", f"{where}.resources")
            out.append(
                ContainerSpec(
                    name=str(c.get("name") or ""),
                    requests=parse_resource_list(res.get("requests"), f"{where}.resources.requests"),
                    limits=parse_resource_list(res.get("limits"), f"{where}.resources.limits"),
                    init=init,
                    restartable=init and c.get("restartPolicy") == "Always",
                )
            )
    return out


def pod_resources(pod: Mapping[str, Any]) -> tuple[ResourceList, ResourceList]:
    """Effective (requests, limits) of a pod object, ``spec.overhead`` included."""
    spec = pod.get("spec")
    overhead = parse_resource_list(spec.get("overhead"), "spec.overhead") if isinstance(spec, Mapping) else {}
    return pod_totals(pod_containers(pod), overhead)


def quota_usage_of(requests: Mapping[str, Quantity], limits: Mapping[str, Quantity]) -> ResourceList:
    """Map effective pod requests/limits to the resource names a ResourceQuota uses (non-terminal pod):
    ``pods``/``count/pods`` = 1; ``cpu``/``requests.cpu`` etc.; ``limits.*``; ``hugepages-*`` and
    ``requests.hugepages-*``; extended resources as ``requests.<name>``."""
    one = Quantity.from_int(1)
    out: ResourceList = {"pods": one, "count/pods": one}
    for name in _REQUEST_STANDARD:
        if name in requests:
            out[name] = requests[name]
            out[f"requests.{name}"] = requests[name]
    for name in _LIMIT_STANDARD:
        if name in limits:
            out[f"limits.{name}"] = limits[name]
    for name, q in requests.items():
        if name.startswith("hugepages-"):
            out[name] = q
            out[f"requests.{name}"] = q
        elif "/" in name and "kubernetes.io/" not in name and not name.startswith("requests."):
            out[f"requests.{name}"] = q
    return out


def pod_quota_usage(pod: Mapping[str, Any], now: datetime | None = None) -> ResourceList:
    """What the ResourceQuota evaluator charges for a pod object (terminal pods: only ``count/pods``)."""
    if not pod_counts_for_compute(pod, now):
        return {"count/pods": Quantity.from_int(1)}
    requests, limits = pod_resources(pod)
    return quota_usage_of(requests, limits)
