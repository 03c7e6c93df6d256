"""The launcher pod: compute container rules, support containers, automatic limits, version differences."""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any

import pytest

from shared.errors import InvalidInput
from shared.kubevirt import (
    AUTO_MEMORY_LIMITS_RATIO_LABEL,
    MEMORY_OVERHEAD_ANNOTATION,
    KubeVirtConfig,
    NamespaceFacts,
    cpu_request,
    render_launcher_pod,
)
from shared.podusage import pod_totals
from shared.quantity import Quantity
from shared.vmi import vmi_spec

MI = 1024 * 1024
Q = Quantity.parse
NO_QUOTA = NamespaceFacts()
LIMITS_QUOTA = NamespaceFacts(quota_has_limits_cpu=True, quota_has_limits_memory=True)


def vmi(domain: dict[str, Any] | None = None, spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"resources": {"requests": {"memory": "1Gi"}}}
    d.update(domain or {})
    s: dict[str, Any] = {"domain": d}
    s.update(spec or {})
    m = {"name": "vm1", "namespace": "ns", **meta}
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": m, "spec": s}


def render(obj, version: str = "v1.9", ns: NamespaceFacts = NO_QUOTA, **cfg):
    return render_launcher_pod(obj, KubeVirtConfig(version=version, **cfg), ns)


def res(rl) -> dict[str, str]:
    return {k: v.canonical() for k, v in rl.items()}


def values(rl) -> dict[str, int]:
    return {k: v.ceil() if k != "cpu" else v.milli_ceil() for k, v in rl.items()}


# ---- the default pod ----------------------------------------------------------------------------------------------


# getRequiredResources (renderresources.go): a VMI without interfaces or networks gets the default pod interface at
# admission (no model: virtio), so tun, vhost-net and kvm, one each, as limits; API-server defaulting requests them.
# template_test.go "Should require tun device by default", "should add the kvm resource when emulation is disabled".
DEFAULT_DEVICES = {"devices.kubevirt.io/tun": "1", "devices.kubevirt.io/vhost-net": "1", "devices.kubevirt.io/kvm": "1"}


def test_default_pod():
    pod = render(vmi())
    compute = pod.container("compute")
    assert res(compute.requests) == {"cpu": "100m", "memory": "1294Mi", "ephemeral-storage": "50M", **DEFAULT_DEVICES}
    assert res(compute.limits) == DEFAULT_DEVICES
    console = pod.container("guest-console-log")
    assert console.init and console.restartable
    assert res(console.requests) == {"cpu": "5m", "memory": "35M"}
    assert res(console.limits) == {"cpu": "15m", "memory": "60M"}
    assert [c.name for c in pod.containers] == ["guest-console-log", "compute"]
    assert pod.memory_overhead.ceil() == 270 * MI
    assert pod.annotations == {MEMORY_OVERHEAD_ANNOTATION: str(270 * MI)}
    assert (pod.requests, pod.limits) == pod_totals(pod.containers)
    assert values(pod.requests) == {
        "cpu": 105,
        "memory": 1294 * MI + 35_000_000,
        "ephemeral-storage": 50_000_000,
        **{k: 1 for k in DEFAULT_DEVICES},
    }


def test_pod_spec_shape():
    spec = render(vmi()).pod_spec()
    assert spec["containers"][0]["name"] == "compute"
    assert spec["initContainers"][0]["restartPolicy"] == "Always"


def test_vm_template_renders_like_its_vmi():
    vm = {
        "kind": "VirtualMachine",
        "metadata": {"name": "vm1", "namespace": "ns"},
        "spec": {"runStrategy": "Always", "template": {"spec": vmi()["spec"]}},
    }
    assert render(vm).requests == render(vmi()).requests


def test_accepts_a_vmi_spec():
    assert render_launcher_pod(vmi_spec(vmi()), KubeVirtConfig(), NO_QUOTA).requests == render(vmi()).requests


# ---- CPU ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vcpus", "ratio", "expected"),
    [
        (1, 10, "100m"),
        (4, 10, "400m"),
        (10, 10, "1"),
        (12, 10, "1200m"),
        (16, 10, "1600m"),
        (3, 1, "3"),
        (1, 3, "333333334n"),
        (2, 4, "500m"),
    ],
)
def test_cpu_request_is_vcpus_over_ratio(vcpus, ratio, expected):
    assert cpu_request(vcpus, Fraction(ratio)).canonical() == expected
    obj = vmi({"cpu": {"sockets": vcpus}})
    assert (
        render(obj, cpu_allocation_ratio=Fraction(ratio)).container("compute").requests["cpu"].canonical() == expected
    )


def test_topology_and_supplemental_pool_size_the_cpu_request():
    obj = vmi({"cpu": {"sockets": 2, "cores": 2, "threads": 2}})
    assert render(obj).container("compute").requests["cpu"] == Q("800m")
    pool = vmi(
        {"cpu": {"sockets": 2}, "ioThreadsPolicy": "supplementalPool", "ioThreads": {"supplementalPoolThreadCount": 2}}
    )
    assert render(pool).container("compute").requests["cpu"] == Q("400m")


def test_explicit_cpu_request_and_limit_win():
    obj = vmi({"resources": {"requests": {"memory": "1Gi", "cpu": "250m"}, "limits": {"cpu": "3"}}})
    c = render(obj, ns=LIMITS_QUOTA).container("compute")
    assert c.requests["cpu"] == Q("250m")
    assert c.limits["cpu"] == Q("3")


def test_cpu_limit_alone_becomes_the_request():
    obj = vmi({"resources": {"requests": {"memory": "1Gi"}, "limits": {"cpu": "2"}}})
    c = render(obj).container("compute")
    assert c.requests["cpu"] == Q("2") and c.limits["cpu"] == Q("2")


def test_cluster_cpu_request_default():
    c = render(vmi(), cpu_request=Q("250m")).container("compute")
    assert c.requests["cpu"] == Q("250m")
    c = render(vmi(), cpu_request=Q("100m")).container("compute")  # the built-in default: vCPUs / ratio
    assert c.requests["cpu"] == Q("100m")


# ---- automatic limits -------------------------------------------------------------------------------------


def test_quota_with_limits_adds_cpu_and_memory_limits():
    c = render(vmi({"cpu": {"sockets": 4}}), ns=LIMITS_QUOTA).container("compute")
    assert c.limits["cpu"] == Q("4")
    assert c.requests["memory"].ceil() == 1024 * MI + 294 * MI
    assert c.limits["memory"].ceil() == 2 * (1024 + 294) * MI


def test_quota_with_requests_only_sets_no_limits():
    c = render(vmi(), ns=NamespaceFacts()).container("compute")
    assert "cpu" not in c.limits and "memory" not in c.limits


def test_only_the_quota_resource_that_has_a_limit_triggers():
    c = render(vmi(), ns=NamespaceFacts(quota_has_limits_memory=True)).container("compute")
    assert "cpu" not in c.limits and "memory" in c.limits
    c = render(vmi(), ns=NamespaceFacts(quota_has_limits_cpu=True)).container("compute")
    assert "cpu" in c.limits and "memory" not in c.limits


@pytest.mark.parametrize(
    ("label", "ratio"),
    [("3", 3.0), ("1.5", 1.5), ("1", 1.0), ("0.5", 2.0), ("abc", 2.0), ("", 2.0), (" 3", 2.0), ("inf", 2.0)],
)
def test_namespace_memory_limits_ratio(label, ratio):
    ns = NamespaceFacts(labels={AUTO_MEMORY_LIMITS_RATIO_LABEL: label}, quota_has_limits_memory=True)
    c = render(vmi(), ns=ns).container("compute")
    assert c.limits["memory"].ceil() == int(float(1294 * MI) * ratio)


def test_explicit_memory_limit_is_kept_plus_overhead():
    obj = vmi({"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}})
    c = render(obj, ns=LIMITS_QUOTA).container("compute")
    assert c.limits["memory"].ceil() == (2048 + 270) * MI
    assert c.requests["memory"].ceil() == (1024 + 270) * MI


@pytest.mark.parametrize(
    ("version", "gate", "limited"),
    [
        ("v1.0", True, False),
        ("v1.1", False, False),
        ("v1.4", True, True),
        ("v1.4", False, False),
        ("v1.5", False, True),
        ("main", False, True),
    ],
)
def test_auto_limits_by_version(version, gate, limited):
    gates = frozenset({"AutoResourceLimitsGate"}) if gate else frozenset()
    c = render(vmi(), version, ns=LIMITS_QUOTA, feature_gates=gates).container("compute")
    assert ("cpu" in c.limits) is limited
    assert ("memory" in c.limits) is limited


def test_auto_cpu_limit_namespace_label_selector():
    sel = {"matchLabels": {"tier": "gold"}, "matchExpressions": [{"key": "env", "operator": "In", "values": ["prod"]}]}
    ns = NamespaceFacts(labels={"tier": "gold", "env": "prod"})
    c = render(vmi({"cpu": {"sockets": 2}}), ns=ns, auto_cpu_limit_namespace_label_selector=sel).container("compute")
    assert c.limits["cpu"] == Q("2") and "memory" not in c.limits
    other = NamespaceFacts(labels={"tier": "gold", "env": "dev"})
    c = render(vmi(), ns=other, auto_cpu_limit_namespace_label_selector=sel).container("compute")
    assert "cpu" not in c.limits
    # v1.0 has the selector even without quota-triggered limits
    c = render(vmi(), "v1.0", ns=ns, auto_cpu_limit_namespace_label_selector=sel).container("compute")
    assert c.limits["cpu"] == Q("1")


# ---- dedicated CPUs / Guaranteed QoS ---------------------------------------------------------------------------


def test_dedicated_cpus():
    obj = vmi({"cpu": {"sockets": 2, "cores": 2, "dedicatedCpuPlacement": True}})
    c = render(obj).container("compute")
    assert c.requests["cpu"] == c.limits["cpu"] == Q("4")
    assert c.requests["memory"] == c.limits["memory"]
    assert c.requests["memory"].ceil() == (1024 + 270 + 24 + 100) * MI


def test_dedicated_cpus_override_explicit_cpu_values():
    obj = vmi(
        {
            "cpu": {"sockets": 2, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True},
            "resources": {"requests": {"memory": "1Gi", "cpu": "500m"}, "limits": {"cpu": "8"}},
        }
    )
    c = render(obj).container("compute")
    assert c.requests["cpu"] == c.limits["cpu"] == Q("3")


def test_isolate_emulator_thread_even_parity_annotation():
    domain = {"cpu": {"sockets": 3, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True}}
    obj = vmi(domain, annotations={"alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity": ""})
    assert render(obj).container("compute").limits["cpu"] == Q("4")
    domain["cpu"]["sockets"] = 4
    assert render(vmi(domain, annotations={"alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity": ""})).container(
        "compute"
    ).limits["cpu"] == Q("6")


def test_guaranteed_qos_support_containers():
    obj = vmi(
        {"resources": {"requests": {"memory": "1Gi", "cpu": "1"}, "limits": {"memory": "1Gi", "cpu": "1"}}},
        {"volumes": [{"name": "root", "containerDisk": {"image": "quay.io/x:1"}}]},
    )
    pod = render(obj, "v1.8")  # (ImageVolume off by default up to v1.8: the copying containers)
    for name in ("guest-console-log", "volumeroot", "volumeroot-init"):
        c = pod.container(name)
        assert {k: c.requests[k] for k in ("cpu", "memory")} == {k: c.limits[k] for k in ("cpu", "memory")}, name
    assert res(pod.container("container-disk-binary").requests) == {"cpu": "10m", "memory": "40M"}
    compute = pod.container("compute")
    assert compute.requests["memory"] == compute.limits["memory"]
    assert compute.requests["memory"].ceil() == (1024 + 370) * MI


# ---- memory ---------------------------------------------------------------------------------------------------


def test_guest_only_memory_request():
    obj = vmi({"memory": {"guest": "2Gi"}, "resources": {}})
    c = render(obj).container("compute")
    assert c.requests["memory"].ceil() == (2048 + 268) * MI


def test_limit_only_memory_request():
    obj = vmi({"resources": {"limits": {"memory": "2Gi"}}})
    c = render(obj).container("compute")
    assert c.requests["memory"] == c.limits["memory"]
    assert c.requests["memory"].ceil() == (2048 + 268) * MI


def test_memory_overcommit():
    obj = vmi({"memory": {"guest": "3000Mi"}, "resources": {}})
    c = render(obj, memory_overcommit=150).container("compute")
    assert c.requests["memory"].ceil() == 3000 * MI * 100 // 150 + 268 * MI
    # an explicit request is never overcommitted
    c = render(vmi({"memory": {"guest": "3000Mi"}}), memory_overcommit=150).container("compute")
    assert c.requests["memory"].ceil() == (1024 + 270) * MI
    # v1.6.4+ WithMemoryRequests runs first for every VMI without a memory request: dedicated CPUs too
    # (3000Mi x 100 / 150 = 2000Mi, + 268 + 100 for dedicated CPUs); the memory limit follows the request
    ded = vmi({"memory": {"guest": "3000Mi"}, "resources": {}, "cpu": {"dedicatedCpuPlacement": True}})
    c = render(ded, memory_overcommit=150).container("compute")
    assert c.requests["memory"].ceil() == c.limits["memory"].ceil() == (2000 + 368) * MI


MEMORY_SETTERS: dict[str, tuple[str, str, Any]] = {
    "requests": ("resources", "requests", {"memory": "1Gi"}),
    "limits": ("resources", "limits", {"memory": "1Gi"}),
    "guest": ("memory", "guest", "1Gi"),
    "hugepages": ("memory", "hugepages", {"pageSize": "1Gi"}),
}


@pytest.mark.parametrize(
    ("setters", "expect"),
    [
        # template_test.go @ v1.6.4, "should honor memoryOvercommit when set in the CR": the compute container's
        # memory request minus the overhead at memoryOvercommit 110 is the one at 100 x 100 / 110 exactly where
        # overcommit is expected. (Its first entry, a VMI without any memory, is refused here: see the docs.)
        (("requests",), False),
        (("limits",), False),
        (("guest",), True),
        (("hugepages",), True),
        (("requests", "limits"), False),
        (("requests", "guest"), False),
        (("requests", "hugepages"), False),
        (("limits", "guest"), False),
        (("limits", "hugepages"), False),
        (("guest", "hugepages"), True),
        (("requests", "limits", "guest"), False),
        (("requests", "limits", "hugepages"), False),
        (("requests", "guest", "hugepages"), False),
        (("limits", "guest", "hugepages"), False),
        (("requests", "limits", "guest", "hugepages"), False),
    ],
)
@pytest.mark.parametrize("version", ["v1.6.4", "v1.9", "main"])
def test_memory_overcommit_as_kubevirt_tests_it(setters, expect, version):
    domain: dict[str, Any] = {"resources": {}}
    for name in setters:
        section, key, value = MEMORY_SETTERS[name]
        domain.setdefault(section, {})[key] = value
    obj = vmi()
    obj["spec"]["domain"] = domain
    pods = [render(obj, version, memory_overcommit=oc) for oc in (100, 110)]
    mem100, mem110 = (p.container("compute").requests["memory"].ceil() - p.memory_overhead.ceil() for p in pods)
    assert mem110 == (mem100 * 100 // 110 if expect else mem100)


@pytest.mark.parametrize(
    ("version", "request_mib", "overhead_mib"),
    [
        # guest 3000Mi, memoryOvercommit 150, no memory request on the VMI; worked by hand at each tag:
        # v1.6.0-v1.6.1 / v1.6.3 (pkg/defaults setDefaultResourceRequests): the VMI gets requests.memory 2000Mi, so
        # page tables of 2000Mi (4096000 B, 3.9Mi) join the 268Mi
        ("v1.6.1", 2000, None),
        ("v1.6.3", 2000, None),
        # v1.6.2: the webhook writes the guest size (page tables of 3000Mi) and WithMemoryOvercommit scales it
        ("v1.6.2", 2000, None),
        # v1.6.4: WithMemoryRequests in the renderer; the VMI has no request (no page tables): 268Mi
        ("v1.6.4", 2000, 268),
    ],
)
def test_memory_request_per_v16_patch(version, request_mib, overhead_mib):
    obj = vmi({"memory": {"guest": "3000Mi"}, "resources": {}})
    pod = render(obj, version, memory_overcommit=150)
    request_bytes = {"v1.6.2": 3000 * MI, "v1.6.4": 0}.get(version, 2000 * MI)
    pagetables = -(-request_bytes // 1000) * 1000 // 512  # one bit per 512 B of the request rounded up to kB
    overhead = pod.memory_overhead.ceil()
    assert overhead == (overhead_mib * MI if overhead_mib is not None else 268 * MI + pagetables)
    assert pod.container("compute").requests["memory"].ceil() == request_mib * MI + overhead


def test_overcommit_guest_overhead():
    obj = vmi(
        {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}, "overcommitGuestOverhead": True}}
    )
    c = render(obj).container("compute")
    assert c.requests["memory"] == Q("1Gi")
    assert c.limits["memory"].ceil() == (2048 + 270) * MI


def test_hugepages():
    obj = vmi({"memory": {"guest": "4Gi", "hugepages": {"pageSize": "2Mi"}}, "resources": {}})
    c = render(obj).container("compute")
    assert c.requests["hugepages-2Mi"] == c.limits["hugepages-2Mi"] == Q("4Gi")
    assert c.requests["memory"].ceil() == 268 * MI
    assert "memory" not in c.limits


def test_hugepages_request_above_guest_and_limit():
    obj = vmi(
        {
            "memory": {"guest": "1Gi", "hugepages": {"pageSize": "1Gi"}},
            "resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "3Gi"}},
        }
    )
    c = render(obj).container("compute")
    assert c.requests["hugepages-1Gi"] == Q("1Gi")
    assert c.requests["memory"].ceil() == (1024 + 272) * MI  # request above guest + overhead (4 Mi page tables)
    assert c.limits["memory"].ceil() == (2048 + 272) * MI


def test_hugepages_without_guest_use_the_page_size():
    obj = vmi({"memory": {"hugepages": {"pageSize": "1Gi"}}, "resources": {}})
    c = render(obj).container("compute")
    assert c.requests["hugepages-1Gi"] == Q("1Gi")


def test_no_memory_at_all_is_refused():
    with pytest.raises(InvalidInput) as e:
        render(vmi({"resources": {}}))
    assert e.value.where == "VirtualMachineInstance ns/vm1: spec.domain.memory.guest"


def test_ephemeral_storage():
    c = render(vmi()).container("compute")
    assert c.requests["ephemeral-storage"] == Q("50M")
    obj = vmi(
        {"resources": {"requests": {"memory": "1Gi", "ephemeral-storage": "1G"}, "limits": {"ephemeral-storage": "2G"}}}
    )
    c = render(obj).container("compute")
    assert c.requests["ephemeral-storage"] == Q("1050M")
    assert c.limits["ephemeral-storage"] == Q("2050M")


def test_published_overhead_is_preferred():
    obj = vmi()
    obj["status"] = {"memory": {"memoryOverhead": "300Mi"}}
    pod = render(obj)
    assert pod.memory_overhead == Q("300Mi")
    assert pod.container("compute").requests["memory"] == Q("1324Mi")
    assert pod.annotations[MEMORY_OVERHEAD_ANNOTATION] == str(300 * MI)
    obj["status"] = {"memory": {"memoryOverhead": "lots"}}
    with pytest.raises(InvalidInput) as e:
        render(obj)
    assert e.value.where == "VirtualMachineInstance ns/vm1: status.memory.memoryOverhead"


# ---- support containers ---------------------------------------------------------------------------------------


def test_container_disks():
    obj = vmi(
        spec={
            "volumes": [
                {"name": "root", "containerDisk": {"image": "a"}},
                {"name": "data", "containerDisk": {"image": "b"}},
                {"name": "ci", "cloudInitNoCloud": {}},
            ]
        }
    )
    pod = render(obj, "v1.8")  # ImageVolume is Beta but off by default in v1.8
    names = [c.name for c in pod.containers]
    assert names == [
        "guest-console-log",
        "container-disk-binary",
        "volumeroot-init",
        "volumedata-init",
        "compute",
        "volumeroot",
        "volumedata",
    ]
    disk = pod.container("volumeroot")
    assert res(disk.requests) == {"cpu": "1m", "memory": "1M", "ephemeral-storage": "50M"}
    assert res(disk.limits) == {"cpu": "10m", "memory": "40M"}
    binary = pod.container("container-disk-binary")
    assert binary.init and not binary.restartable
    assert res(binary.requests) == {"cpu": "10m", "memory": "1M"}
    assert res(binary.limits) == {"cpu": "100m", "memory": "40M"}
    assert values(pod.requests)["cpu"] == 100 + 5 + 2
    assert pod.requests["ephemeral-storage"] == Q("150M")


@pytest.mark.parametrize(
    ("version", "cfg", "annotations", "expected"),
    [
        # feature-gates.go isFeatureGateEnabled: before v1.9 a gate is on only when listed
        ("v1.6", {"feature_gates": frozenset({"ImageVolume"})}, {}, ["guest-console-log", "compute"]),
        ("v1.5", {"feature_gates": frozenset({"ImageVolume"})}, {}, None),  # not registered before v1.6
        # v1.7+ (container-disk.go CreateImageVolumeInitContainer): one no-op init container per disk; template_test
        # "should create noop init containers for digest exposure": "with container disk" -> ["volumer0"]
        ("v1.7", {"feature_gates": frozenset({"ImageVolume"})}, {}, ["guest-console-log", "volumeroot", "compute"]),
        ("v1.8", {}, {}, None),  # Beta, still off by default
        # v1.9 featuregate.IsEnabled: Beta gates default on; disabledFeatureGates turns one off
        ("v1.9", {}, {}, ["guest-console-log", "volumeroot", "compute"]),
        ("v1.9", {"disabled_feature_gates": frozenset({"ImageVolume"})}, {}, None),
        ("main", {}, {}, ["guest-console-log", "volumeroot", "compute"]),
        # main: kubevirt.io/image-volume-skip-digest-resolution drops the no-op init containers
        ("main", {}, {"kubevirt.io/image-volume-skip-digest-resolution": "true"}, ["guest-console-log", "compute"]),
    ],
)
def test_container_disks_are_image_volumes_with_the_gate(version, cfg, annotations, expected):
    obj = vmi(spec={"volumes": [{"name": "root", "containerDisk": {"image": "a"}}]}, annotations=annotations)
    pod = render(obj, version, **cfg)
    names = [c.name for c in pod.containers]
    if expected is None:  # the copying containers
        assert "container-disk-binary" in names and "volumeroot-init" in names
        return
    assert names == expected
    if "volumeroot" in names:
        noop = pod.container("volumeroot")
        assert noop.init and not noop.restartable
        assert res(noop.requests) == {"cpu": "1m", "memory": "1M", "ephemeral-storage": "50M"}
        assert res(noop.limits) == {"cpu": "10m", "memory": "40M"}


def test_kernel_boot_container():
    obj = vmi({"firmware": {"kernelBoot": {"container": {"image": "k"}}}})
    names = [c.name for c in render(obj, "v1.8").containers]
    assert "volumekernel-boot-volume" in names and "container-disk-binary" in names
    # ImageVolume (v1.9 default): "with kernel boot" -> ["volumekernel-boot-volume"] as an init container
    pod = render(obj)
    assert [c.name for c in pod.containers] == ["guest-console-log", "volumekernel-boot-volume", "compute"]
    assert pod.container("volumekernel-boot-volume").init


@pytest.mark.parametrize(
    ("version", "domain", "spec", "cfg", "expected"),
    [
        # template_test.go "Should not require tun device if explicitly rejected": no interfaces, autoattach false
        ("v1.9", {"devices": {"autoattachPodInterface": False}}, {}, {}, {"kvm": (0, 1)}),
        # a non-virtio model needs no vhost-net (NeedVirtioNetDevice); networks given: no default interface added
        (
            "v1.9",
            {"devices": {"interfaces": [{"name": "n", "model": "e1000", "masquerade": {}}]}},
            {"networks": [{"name": "n", "pod": {}}]},
            {},
            {"tun": (0, 1), "kvm": (0, 1)},
        ),
        # Context "Use emulation": no kvm (and no vhost-net) with useEmulation
        ("v1.9", {}, {}, {"use_emulation": True}, {"tun": (0, 1)}),
        # "with VSOCK enabled" -> "should add VSOCK device to resources"
        (
            "v1.9",
            {"devices": {"autoattachVSOCK": True}},
            {},
            {},
            {**{d: (0, 1) for d in ("tun", "vhost-net", "kvm")}, "vhost-vsock": (0, 1)},
        ),
        # renderresources_test "WithSEV option adds SEV device resource": requests == limits == 1
        ("v1.2", {"launchSecurity": {"sev": {}}}, {}, {}, {"sev": (1, 1)}),
        # SNP maps to the sev device from v1.7 (IsSEVVMI)
        ("v1.6", {"launchSecurity": {"snp": {}}}, {}, {}, {}),
        ("v1.7", {"launchSecurity": {"snp": {}}}, {}, {}, {"sev": (1, 1)}),
        # "should add TDX device resource for VMI with TDX workload": v1.9 only
        ("v1.8", {"launchSecurity": {"tdx": {}}}, {}, {}, {}),
        ("v1.9", {"launchSecurity": {"tdx": {}}}, {}, {}, {"tdx": (1, 1)}),
        # a LUN with a persistent reservation: pr-helper
        ("v1.9", {"devices": {"disks": [{"name": "d", "lun": {"reservation": True}}]}}, {}, {}, {"pr-helper": (1, 1)}),
        # "should add IOMMUFD device resource when feature gate is enabled" (Alpha in v1.9: listed only)
        ("v1.9", {}, {}, {"feature_gates": frozenset({"IOMMUFD"})}, {"iommufd": (1, 1)}),
        ("v1.8", {}, {}, {"feature_gates": frozenset({"IOMMUFD"})}, {}),
    ],
)
def test_device_plugin_resources(version, domain, spec, cfg, expected):
    compute = render(vmi(domain, spec), version, **cfg).container("compute")
    virt = {"tun", "vhost-net", "kvm", "vhost-vsock"}
    want = {d: (0, 1) for d in ("tun", "vhost-net", "kvm")} if not (virt & set(expected)) else {}
    want.update(expected)
    got = {}
    for name in {*compute.requests, *compute.limits}:
        if name.startswith("devices.kubevirt.io/"):
            short = name.removeprefix("devices.kubevirt.io/")
            # (request as written by virt-controller, limit); virtualization devices are written as limits only
            got[short] = (0 if short in virt else compute.requests[name].ceil(), compute.limits[name].ceil())
    assert got == want
    for name in compute.limits:  # API-server defaulting: a limit without a request is requested at the limit
        assert compute.requests[name] == compute.limits[name]


def test_gpus_and_host_devices_claim_device_plugins():
    domain = {
        "devices": {
            "gpus": [{"name": "g1", "deviceName": "nvidia.com/A10"}, {"name": "g2", "deviceName": "nvidia.com/A10"}]
        }
    }
    compute = render(vmi(domain)).container("compute")
    assert compute.requests["nvidia.com/A10"] == Q("2") and compute.limits["nvidia.com/A10"] == Q("2")
    dra = {"devices": {"gpus": [{"name": "g1", "deviceName": "nvidia.com/A10", "claimRequest": {"claimName": "c"}}]}}
    assert "nvidia.com/A10" not in render(vmi(dra)).container("compute").requests  # v1.6+: DRA, a claim instead


@pytest.mark.parametrize(("version", "sidecar"), [("v1.1", False), ("v1.5", False), ("v1.6", True), ("main", True)])
def test_guest_console_log_kind_per_version(version, sidecar):
    # serialconsolelog.go: a regular container after the others up to v1.5; a restartable init container, first
    # of the init containers, from v1.6 (commit "guest console log: make virt-tail a proper sidecar")
    obj = vmi(spec={"volumes": [{"name": "root", "containerDisk": {"image": "a"}}]})
    pod = render(obj, version)
    console = pod.container("guest-console-log")
    assert (console.init, console.restartable) == (sidecar, sidecar)
    names = [c.name for c in pod.containers]
    assert names.index("guest-console-log") == (0 if sidecar else len(names) - 1)
    if not sidecar:  # the init phase no longer carries it: the largest init container alone (binary 10m)
        assert values(pod.requests)["cpu"] == 100 + 1 + 5


@pytest.mark.parametrize(
    ("devices", "cfg", "version", "present"),
    [
        ({}, {}, "v1.9", True),
        ({"logSerialConsole": False}, {}, "v1.9", False),
        ({"autoattachSerialConsole": False}, {}, "v1.9", False),
        ({}, {"disable_serial_console_log": True}, "v1.9", False),
        ({"logSerialConsole": True}, {"disable_serial_console_log": True}, "v1.9", True),
        ({}, {}, "v1.0", False),
    ],
)
def test_guest_console_log(devices, cfg, version, present):
    names = [c.name for c in render(vmi({"devices": devices}), version, **cfg).containers]
    assert ("guest-console-log" in names) is present


def test_virtiofs():
    obj = vmi(
        {"devices": {"filesystems": [{"name": "share", "virtiofs": {}}]}},
        {"volumes": [{"name": "share", "persistentVolumeClaim": {"claimName": "c"}}]},
    )
    c = render(obj).container("virtiofs-share")
    assert res(c.requests) == {"cpu": "10m", "memory": "1M"}
    assert res(c.limits) == {"cpu": "100m", "memory": "80M"}
    ded = copy.deepcopy(obj)
    ded["spec"]["domain"]["cpu"] = {"dedicatedCpuPlacement": True}
    c = render(ded).container("virtiofs-share")
    assert res(c.requests) == {"cpu": "100m", "memory": "80M"}


def test_support_container_resources_config():
    table = {
        "guest-console-log": ({"cpu": Q("50m")}, {"memory": Q("100M")}),
        "containerDisk": ({"memory": Q("2M")}, {"cpu": Q("20m")}),
    }
    obj = vmi(spec={"volumes": [{"name": "root", "containerDisk": {"image": "a"}}]})
    pod = render(obj, support_container_resources=table)
    assert res(pod.container("guest-console-log").requests) == {"cpu": "50m", "memory": "35M"}
    assert res(pod.container("guest-console-log").limits) == {"cpu": "15m", "memory": "100M"}
    assert res(pod.container("volumeroot").requests) == {"cpu": "1m", "memory": "2M", "ephemeral-storage": "50M"}
    assert res(pod.container("volumeroot").limits) == {"cpu": "20m", "memory": "40M"}


def test_hook_sidecars():
    ann = {"hooks.kubevirt.io/hookSidecars": '[{"image": "a"}, {"image": "b"}]'}
    pod = render(vmi(annotations=ann))
    assert [c.name for c in pod.containers][-2:] == ["hook-sidecar-0", "hook-sidecar-1"]
    assert pod.container("hook-sidecar-0").requests == {}
    ded = vmi({"cpu": {"dedicatedCpuPlacement": True}}, annotations=ann)
    assert res(render(ded).container("hook-sidecar-1").requests) == {"cpu": "200m", "memory": "64M"}
    with pytest.raises(InvalidInput) as e:
        render(vmi(annotations={"hooks.kubevirt.io/hookSidecars": "[oops"}))
    assert "hookSidecars" in str(e.value)
    # JSON null: Go's json.Unmarshal leaves KubeVirt's list empty, and it renders no sidecar (vmquota could not
    # render such a VM, so it held no room for its migration targets)
    plain = render(vmi())
    assert [c.name for c in render(vmi(annotations={"hooks.kubevirt.io/hookSidecars": "null"})).containers] == [
        c.name for c in plain.containers
    ]


def test_gpu_device_plugin_resources():
    obj = vmi(
        {
            "devices": {
                "gpus": [{"name": "g1", "deviceName": "nvidia.com/A10"}, {"name": "g2", "deviceName": "nvidia.com/A10"}]
            }
        }
    )
    pod = render(obj)
    assert pod.requests["nvidia.com/A10"] == pod.limits["nvidia.com/A10"] == Q("2")


# ---- configuration from the KubeVirt CR ----------------------------------------------------------------------------


def test_from_cr():
    cr = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {
            "configuration": {
                "developerConfiguration": {
                    "cpuAllocationRatio": 4,
                    "memoryOvercommit": 150,
                    "featureGates": ["ImageVolume"],
                },
                "additionalGuestMemoryOverheadRatio": "1.5",
                "autoCPULimitNamespaceLabelSelector": {"matchLabels": {"a": "b"}},
                "supportContainerResources": [{"type": "virtiofs", "resources": {"limits": {"memory": "100M"}}}],
                "network": {
                    "binding": {
                        "passt": {"sidecarImage": "x", "computeResourceOverhead": {"requests": {"memory": "250Mi"}}}
                    }
                },
                "virtualMachineOptions": {"disableSerialConsoleLog": {}},
            }
        },
        "status": {"observedKubeVirtVersion": "v1.4.1"},
    }
    cfg = KubeVirtConfig.from_cr(cr)
    assert cfg.version == "v1.4.1" and cfg.profile.name == "v1.4"
    assert cfg.cpu_allocation_ratio == 4 and cfg.memory_overcommit == 150
    assert cfg.feature_gates == {"ImageVolume"}
    assert cfg.overhead_ratio == 1.5
    assert cfg.auto_cpu_limit_namespace_label_selector == {"matchLabels": {"a": "b"}}
    assert cfg.support_container_resources["virtiofs"] == ({}, {"memory": Q("100M")})
    assert cfg.network_binding_memory == {"passt": Q("250Mi")}
    assert cfg.network_binding_sidecars == {"passt"}
    assert cfg.disable_serial_console_log
    assert KubeVirtConfig.from_cr(cr, version="main").profile.name == "main"
    assert KubeVirtConfig.from_cr({}).version == "v1.9"


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        (
            {"developerConfiguration": {"cpuAllocationRatio": 0}},
            "spec.configuration.developerConfiguration.cpuAllocationRatio",
        ),
        (
            {"developerConfiguration": {"memoryOvercommit": "a"}},
            "spec.configuration.developerConfiguration.memoryOvercommit",
        ),
        ({"developerConfiguration": {"featureGates": "x"}}, "spec.configuration.developerConfiguration.featureGates"),
        ({"additionalGuestMemoryOverheadRatio": "0.9"}, "spec.configuration.additionalGuestMemoryOverheadRatio"),
        (
            {"autoCPULimitNamespaceLabelSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
            "spec.configuration.autoCPULimitNamespaceLabelSelector.matchExpressions[0].operator",
        ),
        ({"supportContainerResources": [{"type": "nope"}]}, "spec.configuration.supportContainerResources[0].type"),
        ({"cpuRequest": "x"}, "spec.configuration.cpuRequest"),
    ],
)
def test_from_cr_errors_name_the_field(conf, field):
    cr = {"kind": "KubeVirt", "metadata": {"name": "kv"}, "spec": {"configuration": conf}}
    with pytest.raises(InvalidInput) as e:
        KubeVirtConfig.from_cr(cr)
    assert e.value.where == f"KubeVirt kv: {field}"


def test_from_cr_bad_observed_version():
    with pytest.raises(InvalidInput) as e:
        KubeVirtConfig.from_cr(
            {"kind": "KubeVirt", "metadata": {"name": "kv"}, "status": {"observedKubeVirtVersion": "v0.58.0"}}
        )
    assert e.value.where == "KubeVirt kv: status.observedKubeVirtVersion"


# ---- versions ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "overhead_mib"), [("v1.0", 244), ("v1.5", 254), ("v1.9", 270), ("main", 290)])
def test_compute_memory_by_version(version, overhead_mib):
    c = render(vmi(), version).container("compute")
    assert c.requests["memory"].ceil() == (1024 + overhead_mib) * MI


# ---- malformed input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (vmi({"resources": {"requests": {"memory": "one gig"}}}), "spec.domain.resources.requests.memory"),
        (vmi({"cpu": {"sockets": -1}}), "spec.domain.cpu.sockets"),
        (vmi(spec={"volumes": [{"containerDisk": {}}]}), "spec.volumes[0].name"),
        (vmi(spec={"volumes": "x"}), "spec.volumes"),
        (vmi({"memory": {"guest": "1Gi", "hugepages": {"pageSize": 2}}}), "spec.domain.memory.hugepages.pageSize"),
        (
            vmi({"resources": {"requests": {"memory": "1Gi"}, "overcommitGuestOverhead": "yes"}}),
            "spec.domain.resources.overcommitGuestOverhead",
        ),
        (vmi({"devices": {"logSerialConsole": 1}}), "spec.domain.devices.logSerialConsole"),
    ],
)
def test_malformed_input_names_object_and_field(obj, field):
    with pytest.raises(InvalidInput) as e:
        render(obj)
    assert e.value.where == f"VirtualMachineInstance ns/vm1: {field}"


@pytest.mark.parametrize(
    ("version", "gates", "disabled", "published"),
    [
        ("v1.7", set(), set(), False),  # no annotation before v1.8
        ("v1.8", set(), set(), False),  # VmiMemoryOverheadReport Alpha in v1.8: opt-in
        ("v1.8", {"VmiMemoryOverheadReport"}, set(), True),
        ("v1.9", set(), set(), True),  # Beta, on by default
        ("v1.9", set(), {"VmiMemoryOverheadReport"}, False),
        ("main", set(), {"VmiMemoryOverheadReport"}, True),  # GA on main: on even when listed as disabled
    ],
)
def test_memory_overhead_annotation_follows_its_gate(version, gates, disabled, published):
    # template.go renderLaunchManifest: the annotation only while VmiMemoryOverheadReportEnabled()
    pod = render(vmi(), version, feature_gates=frozenset(gates), disabled_feature_gates=frozenset(disabled))
    assert (MEMORY_OVERHEAD_ANNOTATION in pod.annotations) is published


def test_gates_and_emulation_are_read_from_the_kubevirt_cr():
    cr = {
        "status": {"observedKubeVirtVersion": "v1.9.0"},
        "spec": {
            "configuration": {"developerConfiguration": {"disabledFeatureGates": ["ImageVolume"], "useEmulation": True}}
        },
    }
    config = KubeVirtConfig.from_cr(cr)
    assert not config.image_volume and config.use_emulation
    bad = {"spec": {"configuration": {"developerConfiguration": {"disabledFeatureGates": "ImageVolume"}}}}
    with pytest.raises(InvalidInput, match=r"developerConfiguration\.disabledFeatureGates"):
        KubeVirtConfig.from_cr(bad)


@pytest.mark.parametrize(
    ("version", "hugepages"), [("v1.5", "2Gi"), ("v1.6.3", "2Gi"), ("v1.6.4", "2Gi"), ("v1.9", "2Gi")]
)
def test_hugepages_take_the_overcommitted_request(version, hugepages):
    # WithHugePages (renderresources.go): hugepages-<size> = the memory request capped at guest. The request is
    # guest x 100 / memoryOvercommit in every version: the webhook's up to v1.6.3, WithMemoryRequests (run first,
    # for every VMI) from v1.6.4; 4Gi x 100 / 200 = 2Gi
    obj = vmi({"memory": {"guest": "4Gi", "hugepages": {"pageSize": "2Mi"}}, "resources": {}})
    c = render(obj, version, memory_overcommit=200).container("compute")
    assert c.requests["hugepages-2Mi"] == c.limits["hugepages-2Mi"] == Q(hugepages)


@pytest.mark.parametrize(
    ("version", "ns", "cpu_request", "limit"),
    [
        # 4 vCPUs with ioThreadsPolicy supplementalPool and 2 pool threads, cpuAllocationRatio 10; worked by hand:
        # v1.4: no such field (the API server drops it): 4 / 10
        ("v1.4", NO_QUOTA, "400m", None),
        # v1.5.0 renderresources.go: WithoutDedicatedCPU covers the topology only (4 / 10); WithIOThreads adds the
        # pool to vmLimits (addToCPU), which wins over the automatic limit of 4
        ("v1.5.0", NO_QUOTA, "400m", "2"),
        ("v1.5.1", LIMITS_QUOTA, "400m", "2"),
        # v1.5.2 ("renderresources: fix cpu calculation") and v1.6.0: getIOThreadsCount joins the vCPUs in the
        # request and the automatic limit: 6 / 10, limit 6
        ("v1.5.2", NO_QUOTA, "600m", None),
        ("v1.5", LIMITS_QUOTA, "600m", "6"),
        ("v1.6", NO_QUOTA, "600m", None),
        ("v1.6", LIMITS_QUOTA, "600m", "6"),
    ],
)
def test_supplemental_io_thread_pool_per_version(version, ns, cpu_request, limit):
    domain = {
        "cpu": {"sockets": 4, "cores": 1, "threads": 1},
        "ioThreadsPolicy": "supplementalPool",
        "ioThreads": {"supplementalPoolThreadCount": 2},
    }
    c = render(vmi(domain), version, ns).container("compute")
    assert c.requests["cpu"] == Q(cpu_request)
    assert (c.limits["cpu"].canonical() if "cpu" in c.limits else None) == limit


@pytest.mark.parametrize(
    ("version", "vcpus", "pool", "parity", "expected"),
    [
        # renderresources_test.go @ v1.5.2 / v1.6.0 / main, "sets limits and requests to vCPUs + iothreads +
        # emulatorThreadCPUs when vCPUs != 0": 5 vCPUs, 2 IO threads -> 8; with the parity annotation (odd) -> 8;
        # 6 vCPUs, 2 IO threads, parity annotation (even) -> 10
        ("v1.5.2", 5, 2, False, 8),
        ("v1.6", 5, 2, True, 8),
        ("main", 6, 2, True, 10),
        # renderresources_test.go @ v1.5.0, "requires additional EmulatorThread CPUs overhead, and additional CPUs
        # added to the limits and the IOThreads": 2 cores, 4 IO threads, isolated emulator thread -> limits 7
        ("v1.5.0", 2, 4, False, 7),
    ],
)
def test_dedicated_cpus_with_io_threads_and_an_emulator_thread(version, vcpus, pool, parity, expected):
    domain = {
        "cpu": {"cores": vcpus, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True},
        "ioThreadsPolicy": "supplementalPool",
        "ioThreads": {"supplementalPoolThreadCount": pool},
    }
    annotations = {"alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity": ""} if parity else {}
    c = render(vmi(domain, annotations=annotations), version).container("compute")
    assert c.limits["cpu"] == Q(str(expected)) and c.requests["cpu"] == Q(str(expected))


def test_a_pool_count_without_the_policy_still_counts_in_cpu_from_v152():
    # getIOThreadsCount (v1.5.2+) reads supplementalPoolThreadCount whatever ioThreadsPolicy says, and admission
    # accepts a count with another policy: 4 vCPUs + 2 -> 6 / 10 = 600m; v1.5.0's WithIOThreads needs the policy
    domain = {"cpu": {"sockets": 4}, "ioThreadsPolicy": "auto", "ioThreads": {"supplementalPoolThreadCount": 2}}
    assert render(vmi(domain), "v1.9").container("compute").requests["cpu"] == Q("600m")
    c = render(vmi(domain), "v1.5.0").container("compute")
    assert c.requests["cpu"] == Q("400m") and "cpu" not in c.limits
