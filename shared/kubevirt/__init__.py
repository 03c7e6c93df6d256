"""The KubeVirt launcher-pod renderer: what pod (and memory overhead) KubeVirt creates for a VMI, per version."""

from shared.kubevirt.config import DEFAULT_VERSION, KubeVirtConfig, VersionProfile, profile
from shared.kubevirt.overhead import memory_overhead
from shared.kubevirt.render import (
    AUTO_MEMORY_LIMITS_RATIO_LABEL,
    MEMORY_OVERHEAD_ANNOTATION,
    cpu_request,
    published_overhead,
    render_launcher_pod,
)
from shared.kubevirt.types import COMPUTE, NamespaceFacts, RenderedPod

__all__ = [
    "AUTO_MEMORY_LIMITS_RATIO_LABEL",
    "COMPUTE",
    "DEFAULT_VERSION",
    "MEMORY_OVERHEAD_ANNOTATION",
    "KubeVirtConfig",
    "NamespaceFacts",
    "RenderedPod",
    "VersionProfile",
    "cpu_request",
    "memory_overhead",
    "profile",
    "published_overhead",
    "render_launcher_pod",
]
