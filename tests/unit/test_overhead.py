"""Memory overhead: KubeVirt's own test figures (main, and v1.6-v1.9 = 20 Mi less), per-version constants, each term."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from shared.errors import InvalidInput
from shared.kubevirt import DEFAULT_VERSION, KubeVirtConfig, memory_overhead, profile
from shared.kubevirt.config import newer_than_known, observed_version
from shared.quantity import Format, Quantity
from shared.vmi import vmi_spec

MI = 1024 * 1024


def vmi(domain: dict[str, Any] | None = None, spec: dict[str, Any] | None = None, memory: str | None = "1Gi"):
    d: dict[str, Any] = {"resources": {"requests": {"memory": memory}} if memory else {}}
    d.update(domain or {})
    s: dict[str, Any] = {"domain": d}
    s.update(spec or {})
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm", "namespace": "ns"},
        "spec": s,
    }


def overhead(obj, version: str = "main", **cfg) -> int:
    return memory_overhead(vmi_spec(obj), KubeVirtConfig(version=version, **cfg)).ceil()


# KubeVirt's figures (pkg/hypervisor/kvm/hypervisorbackend_test.go): requests.memory 1Gi, amd64, main constants
CHECKS: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], int]] = [
    ("default 1 vCPU", {}, {}, {}, 290),
    ("2x2x2 topology", {"cpu": {"sockets": 2, "cores": 2, "threads": 2}}, {}, {}, 346),
    (
        "no topology, cpu request 3 / limit 5",
        {"resources": {"requests": {"memory": "1Gi", "cpu": "3"}, "limits": {"cpu": "5"}}},
        {},
        {},
        322,
    ),
    ("cpu request 3 only", {"resources": {"requests": {"memory": "1Gi", "cpu": "3"}}}, {}, {}, 306),
    ("no graphics", {"devices": {"autoattachGraphicsDevice": False}}, {}, {}, 258),
    ("arm64", {}, {}, {"arch": "arm64"}, 418),
    ("VFIO host device", {"devices": {"hostDevices": [{"name": "h", "deviceName": "vendor/dev"}]}}, {}, {}, 1314),
    ("VFIO GPU", {"devices": {"gpus": [{"name": "g", "deviceName": "nvidia.com/A10"}]}}, {}, {}, 1314),
    ("VFIO SR-IOV", {"devices": {"interfaces": [{"name": "s", "sriov": {}}]}}, {}, {}, 1314),
    ("downwardMetrics", {}, {"volumes": [{"name": "m", "downwardMetrics": {}}]}, {}, 291),
    ("one exec probe", {}, {"readinessProbe": {"exec": {"command": ["x"]}}}, {}, 400),
    (
        "both exec probes",
        {},
        {"readinessProbe": {"exec": {"command": ["x"]}}, "livenessProbe": {"exec": {"command": ["x"]}}},
        {},
        410,
    ),
    ("SEV", {"launchSecurity": {"sev": {}}}, {}, {}, 546),
    ("SEV-SNP", {"launchSecurity": {"snp": {}}}, {}, {}, 546),
    ("TPM", {"devices": {"tpm": {}}}, {}, {}, 343),
    ("dedicated CPUs", {"cpu": {"dedicatedCpuPlacement": True}}, {}, {}, 390),
]


@pytest.mark.parametrize(("name", "domain", "spec", "cfg", "mib"), CHECKS, ids=[c[0] for c in CHECKS])
def test_kubevirt_figures_main(name, domain, spec, cfg, mib):
    assert overhead(vmi(domain, spec), "main", **cfg) == mib * MI


@pytest.mark.parametrize(("name", "domain", "spec", "cfg", "mib"), CHECKS, ids=[c[0] for c in CHECKS])
@pytest.mark.parametrize("version", ["v1.6", "v1.7", "v1.8", "v1.9"])
def test_kubevirt_figures_v16_v19_are_20mi_less(name, domain, spec, cfg, mib, version):
    assert overhead(vmi(domain, spec), version, **cfg) == (mib - 20) * MI


def test_default_figure_in_bytes():
    assert overhead(vmi()) == 304087040


@pytest.mark.parametrize(("ratio", "expected"), [("3.2", 973080040), ("2.332", 709132040), ("1.234", 375243040)])
def test_additional_guest_memory_overhead_ratio(ratio, expected):
    assert overhead(vmi(), additional_guest_memory_overhead_ratio=ratio) == expected


def test_ratio_one_changes_nothing():
    assert overhead(vmi(), additional_guest_memory_overhead_ratio="1.0") == 290 * MI


@pytest.mark.parametrize(
    ("version", "fixed_mib", "video_mib"),
    [("v1.0", 210, 16), ("v1.4", 210, 16), ("v1.5", 220, 16), ("v1.6", 220, 32), ("v1.9", 220, 32), ("main", 240, 32)],
)
def test_version_constants(version, fixed_mib, video_mib):
    p = profile(version)
    assert p.fixed_overhead == fixed_mib * MI
    assert p.video_overhead == video_mib * MI
    # pagetables 2 Mi + fixed + 8 per vCPU + 8 IOThread + video
    assert overhead(vmi(), version) == (2 + fixed_mib + 8 + 8 + video_mib) * MI
    assert overhead(vmi({"devices": {"autoattachGraphicsDevice": False}}), version) == (2 + fixed_mib + 16) * MI


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("v1.0", "v1.0"),
        ("1.3", "v1.3"),
        ("v1.5.2", "v1.5.2"),
        ("v1.5.0", "v1.5.0-v1.5.1"),
        ("v1.5", "v1.5.3+"),
        ("v1.6.0-rc.1", "v1.6.0-v1.6.1"),
        ("v1.6.1", "v1.6.0-v1.6.1"),
        ("v1.6.2", "v1.6.2"),
        ("1.6.3", "v1.6.3"),
        ("v1.6.4", "v1.6.4+"),
        ("v1.6.6", "v1.6.4+"),
        ("v1.6", "v1.6.4+"),  # a bare minor is its newest patch release
        ("v1.9.2", "v1.9"),
        ("main", "main"),
    ],
)
def test_profile_parsing(text, name):
    assert profile(text).name == name


@pytest.mark.parametrize("text", ["v2.0", "v1.10", "v0.59", "latest", "", "1", "v1.x"])
def test_profile_rejects_unknown_versions(text):
    with pytest.raises(InvalidInput):
        profile(text)


@pytest.mark.parametrize(
    ("observed", "used"), [("v1.7.1", "v1.7.1"), ("v1.10.0", "main"), ("1.23", "main"), ("main", "main")]
)
def test_an_observed_version_later_than_known_is_rendered_as_main(observed, used):
    assert observed_version(observed) == used
    assert newer_than_known(observed) == (used == "main" and observed != "main")


@pytest.mark.parametrize("text", ["v2.0", "v0.59", "latest", ""])
def test_other_unknown_observed_versions_are_refused(text):
    with pytest.raises(InvalidInput):
        observed_version(text)


def test_default_version_is_v19():
    assert DEFAULT_VERSION == "v1.9"
    assert KubeVirtConfig().profile.name == "v1.9"


def test_pagetables_use_the_explicit_request_only():
    # v1.6+: the VMI keeps no memory request when only memory.guest is set -> no page-table term
    guest_only = vmi({"memory": {"guest": "1Gi"}}, memory=None)
    assert overhead(guest_only, "v1.9") == 268 * MI
    # v1.0-v1.5: the admission webhook wrote requests.memory = guest, so page tables count
    assert overhead(guest_only, "v1.5") == 254 * MI
    # pagetables on 64Gi: ceil(bytes/1000)*1000 // 512
    big = vmi(memory="64Gi")
    assert overhead(big, "v1.9") == (-(-(64 * 1024**3) // 1000) * 1000) // 512 + 268 * MI


def test_old_admission_applies_memory_overcommit_to_the_pagetable_request():
    guest_only = vmi({"memory": {"guest": "2Gi"}}, memory=None)
    request = 2 * 1024**3 * 100 // 150
    expected = (-(-request // 1000) * 1000) // 512 + 252 * MI
    assert overhead(guest_only, "v1.5", memory_overcommit=150) == expected


def test_vcpus_count_topology_not_the_supplemental_pool():
    obj = vmi(
        {"cpu": {"sockets": 2}, "ioThreadsPolicy": "supplementalPool", "ioThreads": {"supplementalPoolThreadCount": 4}}
    )
    assert overhead(obj) == 298 * MI


def test_no_cpu_struct_uses_ceil_of_limit():
    obj = vmi({"resources": {"requests": {"memory": "1Gi"}, "limits": {"cpu": "1500m"}}})
    assert overhead(obj) == 298 * MI


def test_tpm_disabled_adds_nothing():
    assert overhead(vmi({"devices": {"tpm": {"enabled": False}}})) == 290 * MI


def test_guaranteed_qos_adds_100mi():
    obj = vmi({"resources": {"requests": {"memory": "1Gi", "cpu": "2"}, "limits": {"memory": "1Gi", "cpu": "2"}}})
    assert overhead(obj) == (290 + 8 + 100) * MI


def test_guaranteed_qos_from_cpu_limit_default():
    # admission copies limits.cpu into requests.cpu, so memory/cpu limits alone ask for Guaranteed QoS
    obj = vmi({"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi", "cpu": "1"}}})
    assert overhead(obj) == 390 * MI


def test_limit_only_memory_is_guaranteed_in_every_version():
    obj = vmi({"resources": {"limits": {"memory": "1Gi", "cpu": "1"}}}, memory=None)
    # up to v1.6.3 the webhook wrote requests.memory = limits.memory (pkg/defaults setDefaultResourceRequests):
    # page tables (2Mi for 1Gi) + Guaranteed
    assert overhead(obj, "v1.5") == (254 + 100) * MI
    assert overhead(obj, "v1.6.3") == (270 + 100) * MI
    # v1.6.4+: no memory request on the VMI (no page tables), but WantsToHaveQOSGuaranteed (types.go @ v1.6.4)
    # counts a memory limit without a request as wanting Guaranteed QoS: 270 - 2 + 100
    assert overhead(obj, "v1.6.4") == (268 + 100) * MI
    assert overhead(obj, "v1.9") == (268 + 100) * MI
    assert overhead(obj, "main") == (288 + 100) * MI


def test_reserved_overhead_v18_and_later():
    obj = vmi({"memory": {"reservedOverhead": {"addedOverhead": "100Mi"}}})
    assert overhead(obj, "v1.8") == 370 * MI
    assert overhead(obj, "main") == 390 * MI
    assert overhead(obj, "v1.7") == 270 * MI


def test_passt_and_binding_plugins_after_the_ratio():
    passt = vmi({"devices": {"interfaces": [{"name": "default", "passtBinding": {}}]}})
    assert overhead(passt) == 540 * MI
    # the ratio does not scale the passt term
    assert (
        overhead(passt, additional_guest_memory_overhead_ratio="2")
        - overhead(vmi(), additional_guest_memory_overhead_ratio="2")
        == 250 * MI
    )
    plugin = vmi(
        {"devices": {"interfaces": [{"name": "a", "binding": {"name": "x"}}, {"name": "b", "binding": {"name": "x"}}]}}
    )
    # each plugin counted once
    assert overhead(plugin, network_binding_memory={"x": Quantity.parse("100Mi")}) == 390 * MI
    assert overhead(plugin) == 290 * MI  # unregistered plugin: nothing


def test_architecture_of_the_vmi_wins():
    assert overhead(vmi(spec={"architecture": "arm64"})) == 418 * MI
    assert overhead(vmi(spec={"architecture": "amd64"}), arch="arm64") == 290 * MI


def test_format_follows_kubernetes_addition():
    q = memory_overhead(vmi_spec(vmi()), KubeVirtConfig(version="main"))
    assert q.format is Format.DECIMAL_SI and q.canonical() == "304087040"
    q = memory_overhead(vmi_spec(vmi({"memory": {"guest": "1Gi"}}, memory=None)), KubeVirtConfig(version="main"))
    assert q.format is Format.BINARY_SI and q.canonical() == "288Mi"


@pytest.mark.parametrize(
    ("domain", "field"),
    [
        ({"devices": []}, "spec.domain.devices"),
        ({"devices": {"gpus": {}}}, "spec.domain.devices.gpus"),
        ({"devices": {"interfaces": ["x"]}}, "spec.domain.devices.interfaces[0]"),
        ({"devices": {"autoattachGraphicsDevice": "no"}}, "spec.domain.devices.autoattachGraphicsDevice"),
        (
            {"memory": {"reservedOverhead": {"addedOverhead": "lots"}}},
            "spec.domain.memory.reservedOverhead.addedOverhead",
        ),
    ],
)
def test_malformed_fields_are_named(domain, field):
    with pytest.raises(InvalidInput) as e:
        overhead(vmi(domain))
    assert e.value.where == f"VirtualMachineInstance ns/vm: {field}"


def test_vm_template_fields_are_named_with_their_path():
    vm = {
        "kind": "VirtualMachine",
        "metadata": {"name": "v", "namespace": "ns"},
        "spec": {"template": {"spec": {"domain": {"devices": []}}}},
    }
    with pytest.raises(InvalidInput) as e:
        memory_overhead(vmi_spec(vm), KubeVirtConfig())
    assert e.value.where == "VirtualMachine ns/v: spec.template.spec.domain.devices"


def test_config_validation():
    with pytest.raises(InvalidInput):
        KubeVirtConfig(additional_guest_memory_overhead_ratio="0.5")
    with pytest.raises(InvalidInput):
        KubeVirtConfig(additional_guest_memory_overhead_ratio="abc")
    with pytest.raises(InvalidInput):
        KubeVirtConfig(cpu_allocation_ratio=Fraction(0))
    with pytest.raises(InvalidInput):
        KubeVirtConfig(memory_overcommit=0)
    with pytest.raises(InvalidInput):
        KubeVirtConfig(version="v3")
    with pytest.raises(InvalidInput):
        KubeVirtConfig(arch="mips")


# ---- passt per version (item: passt) and the order of the +100 Mi ------------------------------------------------


def test_legacy_passt_v12_figure():
    # pkg/virt-controller/services/renderresources_test.go @ v1.2.0, "should add passt overhead for each
    # interface": requests.memory 1Gi, three passt interfaces without ports and one bridge -> 2644Mi
    # (2 page tables + 218 static with the IOThread + 16 video + 8 per vCPU + 3 x 800)
    ifaces = [{"name": f"passt{i}", "passt": {}} for i in (1, 2, 3)] + [{"name": "nonpasst", "bridge": {}}]
    assert overhead(vmi({"devices": {"interfaces": ifaces}}), "v1.2") == 2644 * MI
    # an interface that lists its ports adds nothing (len(net.Ports) == 0 is the condition)
    ported = [{"name": "p", "passt": {}, "ports": [{"port": 80}]}]
    assert overhead(vmi({"devices": {"interfaces": ported}}), "v1.2") == overhead(vmi(), "v1.2")


@pytest.mark.parametrize(("version", "extra_mib"), [("v1.3", 0), ("v1.5", 0), ("v1.7", 0), ("v1.8", 0), ("main", 0)])
def test_legacy_passt_adds_nothing_after_v12(version, extra_mib):
    # discontinued in v1.3 (DeprecatedPasst; rejected at admission from v1.8): no memory term
    ifaces = [{"name": "default", "passt": {}}]
    assert overhead(vmi({"devices": {"interfaces": ifaces}}), version) == overhead(vmi(), version) + extra_mib * MI


@pytest.mark.parametrize(("version", "extra_mib"), [("v1.7", 0), ("v1.8", 250), ("v1.9", 250), ("main", 250)])
def test_core_passt_binding_from_v18(version, extra_mib):
    # pkg/network/resources/memory_test.go @ v1.8.0 "when vmi has passt binding" -> 250Mi; the field does not exist
    # before v1.8 (nothing is added for it there)
    ifaces = [{"name": "default", "passtBinding": {}}, {"name": "second", "passtBinding": {}}]  # once per VMI
    assert overhead(vmi({"devices": {"interfaces": ifaces}}), version) == overhead(vmi(), version) + extra_mib * MI


@pytest.mark.parametrize(
    ("version", "interfaces", "extra_mib"),
    [
        # netbinding/memory_test.go @ v1.4.0: plugin1 500Mi + plugin2 600Mi -> 1100Mi; the same plugin twice -> 500Mi;
        # a plugin that is not registered -> 0
        ("v1.4", [("a", "plugin1"), ("b", "plugin2")], 1100),
        ("v1.4", [("a", "plugin1"), ("b", "plugin1")], 500),
        ("v1.4", [("a", "plugin1"), ("b", "non existent")], 500),
        # resources/memory_test.go @ v1.8.0 "when vmi has passt binding and a binding plugin" -> 750Mi
        ("v1.8", [("a", None), ("b", "plugin1")], 750),
        # v1.2: InterfaceBindingPlugin has no computeResourceOverhead yet
        ("v1.2", [("a", "plugin1"), ("b", "plugin2")], 0),
    ],
)
def test_binding_plugin_memory_per_version(version, interfaces, extra_mib):
    ifaces = [
        {"name": n, "binding": {"name": plugin}} if plugin else {"name": n, "passtBinding": {}}
        for n, plugin in interfaces
    ]
    plugins = {"plugin1": Quantity.parse("500Mi"), "plugin2": Quantity.parse("600Mi")}
    got = overhead(vmi({"devices": {"interfaces": ifaces}}), version, network_binding_memory=plugins)
    assert got == overhead(vmi(), version) + extra_mib * MI


@pytest.mark.parametrize("version", ["v1.2", "v1.5.2", "v1.5.3", "v1.5", "v1.6", "main"])
def test_the_dedicated_cpu_term_and_the_ratio(version):
    # renderresources.go GetMemoryOverhead: v1.2-v1.5.2 multiply by additionalGuestMemoryOverheadRatio and then add
    # the 100Mi of dedicated CPUs / Guaranteed QoS; v1.5.3 (the backport to release-1.5, renderresources.go line
    # order at the tag) and v1.6+ add it first, so it is scaled too. Worked by hand with ratio 2:
    # overhead(ratio 2, dedicated) - overhead(ratio 2, not dedicated) = 100Mi up to v1.5.2 and 200Mi from v1.5.3.
    dedicated = vmi({"cpu": {"dedicatedCpuPlacement": True}})
    diff = overhead(dedicated, version, additional_guest_memory_overhead_ratio="2") - overhead(
        vmi(), version, additional_guest_memory_overhead_ratio="2"
    )
    if version in ("v1.2", "v1.5.2"):
        assert diff == 100 * MI
    else:  # scaled with the rest, whose ratio step rounds to whole kB (int(float64(kB) x (r - 1)) x 1000)
        assert abs(diff - 200 * MI) < 2000
