"""Launcher-pod rendering rate on one core: VMI objects (plain dicts, as they arrive from the bus or a file) in,
``RenderedPod`` out, for a mix of typical VMIs (container disk, instancetype-sized, explicit limits, dedicated CPUs,
hugepages) under a namespace whose quota has ``limits.*``."""

from __future__ import annotations

import copy
from typing import Any

from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.vmi import vmi_spec
from tests.benchmarks.common import Result, rate

TARGET = 20_000


def _vmi(i: int, domain: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": f"vm-{i}", "namespace": "tenant-a", "uid": f"uid-{i}", "labels": {"app": "web"}},
        "spec": {"domain": domain, **(spec or {})},
        "status": {"phase": "Running"},
    }


def workload() -> list[dict[str, Any]]:
    shapes = [
        (
            {
                "cpu": {"sockets": 2, "cores": 1, "threads": 1},
                "memory": {"guest": "4Gi"},
                "devices": {"disks": [{"name": "root"}]},
            },
            {"volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora:40"}}]},
        ),
        (
            {
                "cpu": {"sockets": 1, "cores": 2, "threads": 1},
                "memory": {"guest": "2Gi"},
                "resources": {"requests": {"memory": "2Gi"}},
            },
            None,
        ),
        (
            {
                "cpu": {"sockets": 4},
                "memory": {"guest": "16Gi"},
                "resources": {"requests": {"memory": "16Gi"}, "limits": {"memory": "16Gi", "cpu": "4"}},
                "devices": {"interfaces": [{"name": "default", "masquerade": {}}]},
            },
            {"networks": [{"name": "default", "pod": {}}]},
        ),
        (
            {
                "cpu": {"sockets": 2, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True},
                "memory": {"guest": "8Gi"},
            },
            None,
        ),
        ({"cpu": {"cores": 2}, "memory": {"guest": "4Gi", "hugepages": {"pageSize": "2Mi"}}}, None),
    ]
    return [_vmi(i, copy.deepcopy(d), copy.deepcopy(s)) for i in range(1000) for d, s in [shapes[i % len(shapes)]]]


def run() -> list[Result]:
    config = KubeVirtConfig(version="v1.9")
    ns = NamespaceFacts(labels={"team": "a"}, quota_has_limits_cpu=True, quota_has_limits_memory=True)
    objs = workload()
    specs = [vmi_spec(o) for o in objs]

    def from_dicts() -> int:
        for o in objs:
            render_launcher_pod(o, config, ns)
        return len(objs)

    def from_specs() -> int:
        for s in specs:
            render_launcher_pod(s, config, ns)
        return len(specs)

    from_dicts()  # warm caches
    return [
        Result("render: VMI dicts -> launcher pods (1 core)", rate(from_dicts, 2.0), "VMIs/s", target=TARGET),
        Result("render: parsed VmiSpec -> launcher pods (1 core)", rate(from_specs, 2.0), "VMIs/s"),
    ]


if __name__ == "__main__":
    for r in run():
        print(r.line())
