"""Interface types of the KubeVirt launcher-pod renderer (shared by the renderer, the modes and the simulator)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shared.podusage import ContainerSpec
from shared.quantity import Quantity
from shared.resources import ResourceList

COMPUTE = "compute"


@dataclass(frozen=True, slots=True)
class NamespaceFacts:
    """What the renderer needs to know about the VMI's namespace."""

    labels: Mapping[str, str] = field(default_factory=dict)
    quota_has_limits_cpu: bool = False
    """Some ResourceQuota in the namespace has ``limits.cpu`` in ``spec.hard``."""
    quota_has_limits_memory: bool = False
    """Some ResourceQuota in the namespace has ``limits.memory`` in ``spec.hard``."""

    def with_quota_resources(self, names: Iterable[str]) -> NamespaceFacts:
        """These facts with the resources some ResourceQuota of the namespace has in ``spec.hard``: KubeVirt sets a
        launcher pod's automatic limits where one has ``limits.cpu`` or ``limits.memory``."""
        names = frozenset(names)
        return replace(
            self,
            quota_has_limits_cpu=self.quota_has_limits_cpu or "limits.cpu" in names,
            quota_has_limits_memory=self.quota_has_limits_memory or "limits.memory" in names,
        )


@dataclass(frozen=True, slots=True)
class RenderedPod:
    """The launcher pod KubeVirt would create for a VMI: containers and the totals the quota evaluator charges."""

    containers: tuple[ContainerSpec, ...]
    """Every container, init containers included (see ``ContainerSpec.init``)."""
    requests: ResourceList
    """Pod totals by the Kubernetes pod-usage rules, in container resource names (``cpu``, ``memory`` ...)."""
    limits: ResourceList
    memory_overhead: Quantity
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Annotations KubeVirt puts on the pod (e.g. ``kubevirt.io/memory-overhead-bytes``)."""

    def container(self, name: str) -> ContainerSpec:
        for c in self.containers:
            if c.name == name:
                return c
        raise KeyError(name)

    def pod_spec(self) -> dict[str, Any]:
        """``containers`` and ``initContainers`` of a pod spec carrying these resources."""
        spec: dict[str, Any] = {"containers": [c.to_json() for c in self.containers if not c.init]}
        inits = [c.to_json() for c in self.containers if c.init]
        if inits:
            spec["initContainers"] = inits
        return spec
