"""shared.vmi: VMI sizing facts after KubeVirt's admission defaults."""

from __future__ import annotations

from typing import Any

import pytest

from shared.errors import InvalidInput
from shared.kubevirt.config import KubeVirtConfig
from shared.kubevirt.vm import vmi_from_vm, with_admission_defaults
from shared.quantity import Format, Quantity
from shared.vmi import (
    GUARD_REFUSER,
    VM_TERMS_REFUSER,
    Topology,
    room_refuser,
    status_size,
    unplugged_interfaces,
    vmi_spec,
)

Q = Quantity.parse


def vmi(domain: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "a", "namespace": "ns", "uid": "u1", "labels": {"x": "y"}},
        "spec": {"domain": domain, **(spec or {})},
    }


@pytest.mark.parametrize(
    ("domain", "topology", "vcpus"),
    [
        ({}, (1, 1, 1), 1),
        ({"cpu": {"sockets": 2, "cores": 2, "threads": 2}}, (2, 2, 2), 8),
        ({"cpu": {"cores": 4}}, (0, 4, 0), 4),
        ({"resources": {"limits": {"cpu": "5"}, "requests": {"cpu": "3"}}}, (5, 1, 1), 5),
        ({"resources": {"requests": {"cpu": "2500m"}}}, (3, 1, 1), 3),
        ({"cpu": {"dedicatedCpuPlacement": True}, "resources": {"limits": {"cpu": "4"}}}, (4, 1, 1), 4),
        ({"resources": {"requests": {"cpu": "100m"}}}, (1, 1, 1), 1),
    ],
)
def test_cpu_topology_defaults(domain, topology, vcpus):
    s = vmi_spec(vmi(domain))
    assert (s.topology.sockets, s.topology.cores, s.topology.threads) == topology
    assert s.vcpus == vcpus


def test_supplemental_pool_adds_to_vcpus_not_topology():
    s = vmi_spec(
        vmi(
            {
                "cpu": {"sockets": 2},
                "ioThreadsPolicy": "supplementalPool",
                "ioThreads": {"supplementalPoolThreadCount": 3},
            }
        )
    )
    assert s.topology.vcpus == 2 and s.vcpus == 5
    s = vmi_spec(
        vmi({"cpu": {"sockets": 2}, "ioThreadsPolicy": "auto", "ioThreads": {"supplementalPoolThreadCount": 3}})
    )
    assert s.vcpus == 2


@pytest.mark.parametrize(
    ("domain", "guest"),
    [
        ({"memory": {"guest": "2Gi"}, "resources": {"requests": {"memory": "1Gi"}}}, "2Gi"),
        ({"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}}, "1Gi"),
        ({"resources": {"limits": {"memory": "2Gi"}}}, "2Gi"),
        ({"memory": {"hugepages": {"pageSize": "1Gi"}}}, "1Gi"),
        # setGuestMemory skips a zero request (KubeVirt's admission takes requests 0 with limits 8Gi)
        ({"resources": {"requests": {"memory": "0"}, "limits": {"memory": "8Gi"}}}, "8Gi"),
        ({"resources": {"requests": {"memory": "0"}}, "memory": {"hugepages": {"pageSize": "2Mi"}}}, "2Mi"),
        ({}, None),
    ],
)
def test_guest_memory_defaults(domain, guest):
    s = vmi_spec(vmi(domain))
    assert s.guest_memory == (Q(guest) if guest else None)
    if guest:
        assert s.guest_memory is not None and s.guest_memory.format is Format.BINARY_SI


def test_flags_and_metadata():
    s = vmi_spec(vmi({"cpu": {"dedicatedCpuPlacement": True, "isolateEmulatorThread": True}}))
    assert s.dedicated_cpus and s.isolate_emulator_thread
    assert (s.namespace, s.name, s.uid) == ("ns", "a", "u1")
    assert s.kind == "VirtualMachineInstance" and s.spec_path == "spec"
    assert s.ref == "VirtualMachineInstance ns/a"


def test_vm_uses_its_template():
    vm = {
        "kind": "VirtualMachine",
        "metadata": {"name": "v", "namespace": "ns", "annotations": {"vm": "annotation"}},
        "spec": {
            "template": {
                "metadata": {"annotations": {"tmpl": "annotation"}},
                "spec": {"domain": {"cpu": {"sockets": 3}, "memory": {"guest": "1Gi"}}},
            }
        },
    }
    s = vmi_spec(vm)
    assert s.vcpus == 3 and s.guest_memory == Q("1Gi")
    assert dict(s.annotations) == {"tmpl": "annotation"}
    assert s.kind == "VirtualMachine" and s.spec_path == "spec.template.spec"
    assert s.ref == "VirtualMachine ns/v"


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        (vmi({"cpu": {"sockets": "two"}}), "VirtualMachineInstance ns/a: spec.domain.cpu.sockets"),
        (vmi({"cpu": {"sockets": 5000}}), "VirtualMachineInstance ns/a: spec.domain.cpu.sockets"),
        (vmi({"cpu": {"sockets": 64, "cores": 64, "threads": 2}}), "VirtualMachineInstance ns/a: spec.domain.cpu"),
        (vmi({"memory": {"guest": "128Ti"}}), "VirtualMachineInstance ns/a: spec.domain.memory.guest"),
        (vmi({"memory": {"guest": "lots"}}), "VirtualMachineInstance ns/a: spec.domain.memory.guest"),
        (
            vmi({"resources": {"limits": {"memory": "-1Gi"}}}),
            "VirtualMachineInstance ns/a: spec.domain.resources.limits.memory",
        ),
        (vmi({"resources": []}), "VirtualMachineInstance ns/a: spec.domain.resources"),
        (vmi([]), "VirtualMachineInstance ns/a: spec.domain"),  # type: ignore[arg-type]
        (
            {
                "kind": "VirtualMachine",
                "metadata": {"name": "v"},
                "spec": {"template": {"spec": {"domain": {"memory": {"guest": 1.5}}}}},
            },
            None,
        ),
    ],
)
def test_errors_name_object_and_field(obj, where):
    if where is None:  # a float guest memory is a plain number of bytes: accepted
        assert vmi_spec(obj).guest_memory is not None
        return
    with pytest.raises(InvalidInput) as e:
        vmi_spec(obj)
    assert e.value.where == where


def test_not_an_object():
    with pytest.raises(InvalidInput):
        vmi_spec([])  # type: ignore[arg-type]


def test_topology_vcpus_skips_zero_factors():
    assert Topology(0, 4, 0).vcpus == 4
    assert Topology(0, 0, 0).vcpus == 1


def test_status_size():
    obj = vmi({})
    assert status_size(obj).vcpus is None and status_size(obj).guest_memory is None
    obj["status"] = {
        "currentCPUTopology": {"sockets": 4, "cores": 1, "threads": 1},
        "memory": {"guestCurrent": "2Gi", "guestRequested": "3Gi"},
    }
    s = status_size(obj)
    # what the domain was given, though the guest has only part of it online (it may online the rest at any time)
    assert s.vcpus == 4 and s.guest_memory == Q("3Gi")
    obj["status"]["memory"] = {"guestRequested": "3Gi"}
    assert status_size(obj).guest_memory == Q("3Gi")
    # an unplug the guest has not released: it still holds the memory
    obj["status"]["memory"] = {"guestCurrent": "4Gi", "guestRequested": "3Gi"}
    assert status_size(obj).guest_memory == Q("4Gi")
    obj["status"]["memory"] = {"guestCurrent": "2Gi"}
    assert status_size(obj).guest_memory == Q("2Gi")


@pytest.mark.parametrize("value", ["false", "true", 1, 0])
def test_cpu_flags_must_be_booleans(value: object) -> None:
    """``"false"`` is not false: a non-boolean dedicatedCpuPlacement is refused, naming the field."""
    vmi = {
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "v", "namespace": "ns"},
        "spec": {"domain": {"cpu": {"cores": 2, "dedicatedCpuPlacement": value}, "memory": {"guest": "1Gi"}}},
    }
    with pytest.raises(InvalidInput, match=r"spec\.domain\.cpu\.dedicatedCpuPlacement"):
        vmi_spec(vmi)


def test_unplugged_interfaces_are_those_a_running_vmis_domain_does_not_report() -> None:
    obj = vmi({})
    obj["spec"]["domain"]["devices"] = {
        "interfaces": [
            {"name": "default", "masquerade": {}},
            {"name": "fast", "sriov": {}},
            {"name": "gone", "bridge": {}, "state": "absent"},
            {"name": "br", "bridge": {}},
        ]
    }
    listed = [
        {"name": "default", "infoSource": "domain, guest-agent"},
        {"name": "br", "infoSource": "domain, multus-status"},
        {"ipAddress": "10.0.0.9", "infoSource": "guest-agent"},
        {"name": "fast", "infoSource": "multus-status"},  # (the pod's annotation: a tenant may write it)
    ]
    obj["status"] = {"phase": "Running", "interfaces": listed}
    assert unplugged_interfaces(obj) == [1], "not reported from the domain, not absent"
    obj["status"]["interfaces"].append({"name": "fast", "infoSource": "domain, multus-status"})
    assert unplugged_interfaces(obj) == []
    obj["status"] = {"phase": "Scheduled"}
    assert unplugged_interfaces(obj) == [], "a VMI not running yet is admitted whole"
    obj["status"] = {"phase": "Running", "interfaces": {"default": {}}}
    with pytest.raises(InvalidInput, match=r"status\.interfaces"):
        unplugged_interfaces(obj)


def test_a_room_refusal_is_read_from_the_start_of_kubevirts_message_only() -> None:
    """KubeVirt's condition says ``failed to create virtual machine pod: <the API server's message>``. Only a quota's
    refusal (``exceeded quota: <name>, ``) or the reservation guard's is one for room; a tenant's value quoted later
    in another refusal (an annotation KubeVirt copies onto the pod, which the API server finds invalid) is not."""
    pod = 'failed to create virtual machine pod: pods "virt-launcher-vm1-x" is forbidden: '
    assert room_refuser(pod + "exceeded quota: compute, requested: limits.memory=1Gi, used: ...") == "compute"
    guard = "ValidatingAdmissionPolicy 'vmquota-reservation-guard' with binding 'vmquota-reservation-guard' denied"
    assert room_refuser(pod + guard) == GUARD_REFUSER
    terms = "ValidatingAdmissionPolicy 'vmquota-vm-terms' with binding 'vmquota-vm-terms' denied request: vmquota:"
    assert room_refuser(pod + terms) == VM_TERMS_REFUSER
    apparmor = "container.apparmor.security.beta.kubernetes.io/compute"
    invalid = (
        'failed to create virtual machine pod: Pod "virt-launcher-vm1-x" is invalid: '
        f'metadata.annotations[{apparmor}]: Invalid value: "exceeded quota: x, ": invalid AppArmor profile name'
    )
    assert room_refuser(invalid) == ""
    assert room_refuser(pod + "failed quota: compute: must specify limits.memory") == ""
    assert room_refuser("failed to render launch manifest: exceeded quota: x, ") == ""
    assert room_refuser("") == ""


@pytest.mark.parametrize(
    "domain",
    [
        {"memory": {"guest": "1Gi"}},
        {"resources": {"limits": {"cpu": "3"}, "requests": {"memory": "2Gi"}}},
        {"cpu": {"cores": 2, "threads": 0}, "memory": {"guest": "1Gi"}},
        {"cpu": {"sockets": 100, "cores": 2}, "resources": {"requests": {"memory": "4Gi"}}},
    ],
)
@pytest.mark.parametrize("cpu_request", [None, "250m"])
def test_the_vmi_a_vm_starts_is_the_one_kubevirt_stores(domain: dict[str, Any], cpu_request: str | None) -> None:
    """``vmquota usage`` sizes a VM that has no VMI yet by :func:`vmi_from_vm`: the VMI virt-api's mutating webhook
    stores for it, so writing the defaults in again changes nothing, and they include the webhook's requests (the
    CPU request from the limit, the cluster's flat ``cpuRequest``) and its topology (counts of 0 dropped)."""
    config = KubeVirtConfig(cpu_request=None if cpu_request is None else Q(cpu_request))
    vm = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "a", "namespace": "ns", "uid": "u1"},
        "spec": {"running": True, "template": {"spec": {"domain": domain}}},
    }
    started = vmi_from_vm(vm, config)
    assert with_admission_defaults(started, config) == started
    assert started["spec"] == with_admission_defaults({"spec": {"domain": domain}}, config)["spec"]
    requests = started["spec"]["domain"].get("resources", {}).get("requests", {})
    if "cpu" in domain.get("resources", {}).get("limits", {}):
        assert requests["cpu"] == domain["resources"]["limits"]["cpu"]
    elif cpu_request is not None:
        assert requests["cpu"] == cpu_request
    assert 0 not in started["spec"]["domain"]["cpu"].values()
