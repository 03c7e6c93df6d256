"""Snapshots: raw Kubernetes objects -> compact msgspec Structs, the wire form, and errors naming object and field."""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import snapshot
from shared.errors import InvalidInput
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.normalize import normalize, parse_refusal
from shared.podusage import pod_quota_usage
from shared.quantity import MAX_NANOS, Quantity
from shared.resources import format_resource_list
from shared.snapshot import (
    SCHEMA,
    SUPPORTED_KINDS,
    EventSnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    VmimSnapshot,
    VmiSnapshot,
    VmSnapshot,
    compact_vmi_spec,
    dec_hook,
    decode,
    enc_hook,
    encode,
    from_builtins,
    prune_vmi_spec,
    same_content,
    shared_resources,
    to_builtins,
)
from tests.unit import test_overhead, test_render

META = {"namespace": "tenant", "uid": "u-1", "resourceVersion": "42", "creationTimestamp": "2025-01-01T00:00:00Z"}

VMI: dict[str, Any] = {
    "apiVersion": "kubevirt.io/v1",
    "kind": "VirtualMachineInstance",
    "metadata": {
        "name": "vm1",
        **META,
        "labels": {"app": "db"},
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}", "kubevirt.io/x": "y"},
    },
    "spec": {
        "priorityClassName": "high",
        "domain": {
            "cpu": {"sockets": 4, "cores": 1, "threads": 1},
            "memory": {"guest": "8Gi"},
            "resources": {"limits": {"memory": "8Gi"}},
            "devices": {},
        },
    },
    "status": {
        "phase": "Running",
        "nodeName": "node-a",
        "currentCPUTopology": {"sockets": 2, "cores": 1, "threads": 1},
        "memory": {"guestCurrent": "3584Mi", "guestRequested": "4Gi", "memoryOverhead": "300Mi"},
        "migrationState": {"migrationUid": "m-0", "sourceNode": "node-b", "targetNode": "node-a", "completed": True},
    },
}

POD: dict[str, Any] = {
    "kind": "Pod",
    "metadata": {
        "name": "virt-launcher-vm1-abcde",
        **META,
        "labels": {
            "kubevirt.io": "virt-launcher",
            "kubevirt.io/created-by": "u-1",
            "vm.kubevirt.io/name": "vm1",
            "kubevirt.io/migrationJobUID": "m-1",
            "pod-template-hash": "x",
        },
        "annotations": {"kubevirt.io/memory-overhead-bytes": "314572800"},
        "ownerReferences": [{"kind": "VirtualMachineInstance", "name": "vm1", "uid": "u-1", "controller": True}],
        "deletionTimestamp": "2025-01-01T01:00:00Z",
        "deletionGracePeriodSeconds": 30,
    },
    "spec": {
        "nodeName": "node-b",
        "priorityClassName": "high",
        "containers": [
            {
                "name": "compute",
                "resources": {"requests": {"cpu": "400m", "memory": "8492Mi"}, "limits": {"memory": "8492Mi"}},
            }
        ],
        "initContainers": [
            {
                "name": "guest-console-log",
                "restartPolicy": "Always",
                "resources": {"requests": {"cpu": "5m", "memory": "35M"}, "limits": {"cpu": "15m", "memory": "60M"}},
            }
        ],
    },
    "status": {"phase": "Running"},
}

VMIM: dict[str, Any] = {
    "kind": "VirtualMachineInstanceMigration",
    "metadata": {"name": "kubevirt-evacuation-abc", **META, "annotations": {"kubevirt.io/evacuationMigration": "n"}},
    "spec": {"vmiName": "vm1"},
    "status": {
        "phase": "Pending",
        "conditions": [{"type": "migrationRejectedByResourceQuota", "status": "True", "reason": "x", "message": "m"}],
    },
}

QUOTA: dict[str, Any] = {
    "kind": "ResourceQuota",
    "metadata": {
        "name": "rq",
        **META,
        "labels": {"vmquota.io/managed": "true"},
        "annotations": {"vmquota.io/mode": "x"},
    },
    "spec": {
        "hard": {"limits.memory": "64Gi", "requests.cpu": "4"},
        "scopes": ["NotTerminating"],
        "scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]},
    },
    "status": {"hard": {"limits.memory": "64Gi"}, "used": {"limits.memory": "1024Mi"}},
}

MESSAGE = (
    'Error creating pod: pods "virt-launcher-vm1-x" is forbidden: exceeded quota: rq, requested: '
    "limits.memory=17405661185,requests.cpu=100m, used: limits.memory=48Gi, limited: limits.memory=64Gi"
)
EVENT: dict[str, Any] = {
    "kind": "Event",
    "metadata": {"name": "vm1.17a", **META},
    "involvedObject": {"kind": "VirtualMachineInstance", "name": "vm1", "uid": "u-1"},
    "reason": "FailedCreate",
    "type": "Warning",
    "message": MESSAGE,
    "count": 7,
    "lastTimestamp": "2025-01-01T00:05:00Z",
}

KUBEVIRT: dict[str, Any] = {
    "kind": "KubeVirt",
    "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
    "spec": {
        "configuration": {
            "developerConfiguration": {"cpuAllocationRatio": 4, "memoryOvercommit": 150},
            "network": {},
            "imagePullPolicy": "IfNotPresent",
        }
    },
    "status": {"observedKubeVirtVersion": "v1.7.1"},
}

VM: dict[str, Any] = {
    "kind": "VirtualMachine",
    "metadata": {"name": "vm1", **META},
    "spec": {
        "running": True,
        "template": {"spec": {"domain": {"cpu": {"cores": 2}, "memory": {"guest": "2Gi"}}}},
    },
    "status": {"printableStatus": "Running"},
}

NAMESPACE: dict[str, Any] = {"kind": "Namespace", "metadata": {"name": "tenant", "labels": {"team": "a"}}}

ALL = [VMI, POD, VMIM, QUOTA, EVENT, KUBEVIRT, VM, NAMESPACE]


def test_every_kind_is_supported() -> None:
    assert {o["kind"] for o in ALL} == set(SUPPORTED_KINDS)


def test_vmi() -> None:
    s = normalize(VMI)
    assert isinstance(s, VmiSnapshot)
    assert (s.namespace, s.name, s.uid, s.resource_version) == ("tenant", "vm1", "u-1", "42")
    assert s.creation_timestamp == datetime(2025, 1, 1, tzinfo=UTC)
    assert s.vcpus == 4 and s.guest_memory == Quantity.parse("8Gi")
    # guestRequested: what the domain was given, of which the guest has 3.5Gi online (the hotplug to 8Gi pending)
    assert s.status_vcpus == 2 and s.status_guest_memory == Quantity.parse("4Gi")
    assert s.memory_overhead == Quantity.parse("300Mi")
    assert format_resource_list(s.limits) == {"memory": "8Gi"}
    assert s.migration is not None and s.migration.completed and s.migration.source_node == "node-b"
    assert s.annotations == {}  # only what the launcher pod is rendered from: last-applied and the others dropped
    assert s.priority_class_name == "high" and s.phase == "Running" and s.node_name == "node-a"
    obj = s.as_object()
    assert obj["spec"] == prune_vmi_spec(VMI["spec"]) and obj["status"]["memory"]["memoryOverhead"] == "300Mi"
    assert obj["spec"]["domain"] == VMI["spec"]["domain"] and "priorityClassName" not in obj["spec"]


def test_pod() -> None:
    s = normalize(POD)
    assert isinstance(s, PodSnapshot)
    assert s.is_launcher and s.vmi_uid == "u-1" and s.migration_job_uid == "m-1"
    assert "pod-template-hash" not in s.labels
    assert (s.owner_vmi_name, s.owner_vmi_uid) == ("vm1", "u-1")
    assert s.memory_overhead == Quantity.parse("314572800")
    assert s.deletion_grace_period_seconds == 30 and s.node_name == "node-b"
    assert s.usage == pod_quota_usage(POD, datetime(2025, 1, 1, tzinfo=UTC))
    assert s.requests == {"cpu": Quantity.parse("405m"), "memory": Quantity.parse("8492Mi") + Quantity.parse("35M")}
    assert not s.best_effort and not s.terminating_scope


@pytest.mark.parametrize("overhead", ["garbage", "-1", "1e", ""])
def test_a_pod_whose_overhead_annotation_cannot_be_read_is_still_a_pod(overhead: str) -> None:
    """Anyone who may write a pod may write its annotations: one vmquota cannot read as a quantity is as if KubeVirt
    had published no overhead (what taking it off does), and the pod, with its charge, is counted. Before, the whole
    pod was a dead letter, and the ledger kept no pod, or the version before the annotation, in its place."""
    p = copy.deepcopy(POD)
    p["metadata"]["annotations"]["kubevirt.io/memory-overhead-bytes"] = overhead
    s = normalize(p)
    assert isinstance(s, PodSnapshot) and s.memory_overhead is None
    assert s.usage == pod_quota_usage(p, datetime(2025, 1, 1, tzinfo=UTC)) and s.is_launcher


@pytest.mark.parametrize(
    "storage", ["1e19", "10E", "1e30", "10Ei", "1234567890123456789012345678901234567890123456789012345678901234567"]
)
def test_a_pod_asking_past_what_a_quantity_holds_is_counted(storage: str) -> None:
    """The API server keeps a decimal quantity of any size, written in any number of digits (and caps a binary one):
    a tenant's pod asking for ``1e19`` of ephemeral storage, which no budget names, exists and is charged its
    memory. Its snapshot could not be made, the watcher dead-lettered it, and vmquota's usage and reports left it
    out; now the amount is cut to what a quantity holds and the pod is counted."""
    p = copy.deepcopy(POD)
    p["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"] = storage
    s = normalize(p)
    assert isinstance(s, PodSnapshot)
    assert s.usage["requests.ephemeral-storage"].nanos == MAX_NANOS
    plain = normalize(POD)
    assert isinstance(plain, PodSnapshot) and s.usage["requests.memory"] == plain.usage["requests.memory"]


def test_pod_scope_facts() -> None:
    p = copy.deepcopy(POD)
    p["spec"]["containers"][0]["resources"] = {}
    p["spec"]["initContainers"] = []
    p["spec"]["activeDeadlineSeconds"] = 60
    s = normalize(p)
    assert isinstance(s, PodSnapshot) and s.best_effort and s.terminating_scope


def test_vmim() -> None:
    s = normalize(VMIM)
    assert isinstance(s, VmimSnapshot)
    assert s.vmi_name == "vm1" and s.phase == "Pending" and s.active
    assert s.rejected_by_quota and s.trigger == "evacuation"


def test_quota() -> None:
    s = normalize(QUOTA)
    assert isinstance(s, QuotaSnapshot)
    assert format_resource_list(s.spec_hard) == {"limits.memory": "64Gi", "requests.cpu": "4"}
    assert s.scopes == ["NotTerminating"]
    assert s.scope_selector[0].scope_name == "PriorityClass" and s.scope_selector[0].values == ["high"]
    assert format_resource_list(s.status_used) == {"limits.memory": "1Gi"}


def test_event_parses_the_refusal() -> None:
    s = normalize(EVENT)
    assert isinstance(s, EventSnapshot)
    assert s.quota_name == "rq" and s.quota_refusal
    assert format_resource_list(s.requested) == {"limits.memory": "17405661185", "requests.cpu": "100m"}
    assert s.count == 7 and s.last_timestamp == datetime(2025, 1, 1, 0, 5, tzinfo=UTC)
    assert (s.involved_name, s.involved_uid) == ("vm1", "u-1")


def test_event_without_a_quota_refusal() -> None:
    e = copy.deepcopy(EVENT)
    e["message"] = "Error creating pod: admission webhook denied the request"
    s = normalize(e)
    assert isinstance(s, EventSnapshot) and not s.quota_refusal and s.requested == {}
    assert parse_refusal("nothing here") == ("", {})


def test_an_event_keeps_no_more_than_names_and_a_refusals_message() -> None:
    """An Event is anyone's to write: one naming a 900,000-character VMI fit the bus, and twenty of them made an
    11 MiB checkpoint of one namespace; any Event kept its message. Fields longer than any name or uid are dropped,
    and the message is kept only for a quota refusal, which explanations quote."""
    e = copy.deepcopy(EVENT)
    e["involvedObject"] = {**e["involvedObject"], "name": "v" * 900_000, "uid": "u" * 900_000}
    e["type"] = "W" * 900_000
    s = normalize(e)
    assert isinstance(s, EventSnapshot) and (s.involved_name, s.involved_uid, s.type) == ("", "", "")
    assert s.quota_refusal and s.message == EVENT["message"]
    assert len(snapshot.encode(s)) < 4096
    e = copy.deepcopy(EVENT)
    e["message"] = "Error creating pod: " + "x" * 1_000_000
    s = normalize(e)
    assert isinstance(s, EventSnapshot) and not s.quota_refusal and s.message == ""
    e["message"] = "exceeded quota: " + "q" * 900_000 + ", requested: limits.memory=1Gi, used: x"
    s = normalize(e)
    assert isinstance(s, EventSnapshot) and not s.quota_refusal and s.message == "" and s.requested == {}


def test_kubevirt_cr() -> None:
    s = normalize(KUBEVIRT)
    assert isinstance(s, KubeVirtSnapshot)
    assert s.cpu_allocation_ratio == "4" and s.memory_overcommit == 150 and s.version == "v1.7.1"
    assert "imagePullPolicy" not in s.configuration and "developerConfiguration" in s.configuration


def test_vm_and_namespace() -> None:
    vm = normalize(VM)
    assert isinstance(vm, VmSnapshot) and vm.run_strategy == "Always" and vm.vcpus == 2
    assert vm.guest_memory == Quantity.parse("2Gi") and vm.printable_status == "Running"
    # (nothing reads a VM's labels: a tenant's would only grow the events stream, up to a message a label)
    padded = normalize(
        {**VM, "metadata": {**VM["metadata"], "labels": {f"example.com/p{i}": "x" * 63 for i in range(99)}}}
    )
    assert b"example.com/p" not in snapshot.encode(padded) and padded == vm
    ns = normalize(NAMESPACE)
    assert isinstance(ns, NamespaceSnapshot) and ns.labels == {"team": "a"} and ns.namespace == ""


@pytest.mark.parametrize("obj", ALL, ids=lambda o: o["kind"])
def test_wire_round_trip(obj: dict[str, Any]) -> None:
    s = normalize(obj)
    data = encode(s)
    wire = json.loads(data)
    assert wire["kind"] == obj["kind"] and wire["schema"] == SCHEMA
    assert all("_" not in k for k in wire)  # camelCase on the wire
    assert decode(data) == s
    assert from_builtins(to_builtins(s)) == s


def test_unknown_fields_are_ignored_on_decode() -> None:
    wire = json.loads(encode(normalize(POD)))
    wire["addedInSchema7"] = {"x": 1}
    wire["schema"] = 7
    s = decode(json.dumps(wire))
    assert isinstance(s, PodSnapshot) and s.schema == 7 and s.name == POD["metadata"]["name"]


def test_bad_wire_quantity_is_a_validation_error() -> None:
    wire = json.loads(encode(normalize(POD)))
    wire["usage"]["cpu"] = "lots"
    with pytest.raises(msgspec.ValidationError):
        decode(json.dumps(wire))


def test_hooks_refuse_other_types() -> None:
    with pytest.raises(NotImplementedError):
        enc_hook(object())
    with pytest.raises(NotImplementedError):
        dec_hook(int, 1)


def _with(obj: dict[str, Any], path: str | tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    cur: Any = out
    keys = path.split(".") if isinstance(path, str) else path
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur.setdefault(k, {})
    cur[keys[-1]] = value
    return out


@pytest.mark.parametrize(
    ("obj", "path", "value", "where"),
    [
        (VMI, "spec.domain.memory.guest", "lots", "VirtualMachineInstance tenant/vm1: spec.domain.memory.guest"),
        (VMI, "spec.domain.memory.guest", "1K", "VirtualMachineInstance tenant/vm1: spec.domain.memory.guest"),
        (VMI, "spec.domain.cpu.sockets", -1, "VirtualMachineInstance tenant/vm1: spec.domain.cpu.sockets"),
        (VMI, "status.memory.memoryOverhead", "x", "VirtualMachineInstance tenant/vm1: status.memory.memoryOverhead"),
        (
            VMI,
            "metadata.creationTimestamp",
            "yesterday",
            "VirtualMachineInstance tenant/vm1: metadata.creationTimestamp",
        ),
        (VMI, "metadata.annotations", {"a": 1}, "VirtualMachineInstance tenant/vm1: metadata.annotations.a"),
        (
            POD,
            "spec.containers.0.resources.requests.cpu",
            "1K",
            "Pod tenant/virt-launcher-vm1-abcde: spec.containers[0].resources.requests.cpu",
        ),
        (
            POD,
            "metadata.deletionGracePeriodSeconds",
            "30",
            "Pod tenant/virt-launcher-vm1-abcde: metadata.deletionGracePeriodSeconds",
        ),
        (QUOTA, "spec.hard", {"limits.memory": "-1Gi"}, "ResourceQuota tenant/rq: spec.hard.limits.memory"),
        (QUOTA, "spec.scopes", "NotTerminating", "ResourceQuota tenant/rq: spec.scopes"),
        (VMIM, "spec.vmiName", "", "VirtualMachineInstanceMigration tenant/kubevirt-evacuation-abc: spec.vmiName"),
        (
            VMIM,
            "status.conditions",
            "x",
            "VirtualMachineInstanceMigration tenant/kubevirt-evacuation-abc: status.conditions",
        ),
        (EVENT, "reason", "Created", "Event tenant/vm1.17a: reason"),
        (
            EVENT,
            "message",
            "exceeded quota: rq, requested: cpu=x, used: ",
            "Event tenant/vm1.17a: message (requested cpu)",
        ),
        (VM, "spec.runStrategy", "Always", "VirtualMachine tenant/vm1: spec.running"),
        (KUBEVIRT, "spec.configuration.developerConfiguration.cpuAllocationRatio", 0, "KubeVirt kubevirt/kubevirt"),
    ],
)
def test_errors_name_object_and_field(obj: dict[str, Any], path: str | tuple[str, ...], value: Any, where: str) -> None:
    with pytest.raises(InvalidInput) as err:
        normalize(_with(obj, path, value))
    assert err.value.where.startswith(where), err.value.where


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        ({"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "t"}}, "ConfigMap t/x: kind"),
        ({"kind": "Pod", "metadata": {"namespace": "t"}, "spec": {}}, "Pod t/<unnamed>: metadata.name"),
        ({"kind": "Pod", "metadata": {"name": "x"}, "spec": {}}, "Pod x: metadata.namespace"),
        ({"kind": "Pod", "metadata": {"name": "x", "namespace": "t"}}, "Pod t/x: spec"),
    ],
)
def test_unusable_objects(obj: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidInput) as err:
        normalize(obj)
    assert err.value.where == where


def test_not_a_mapping() -> None:
    with pytest.raises(InvalidInput):
        normalize([])  # type: ignore[arg-type]


_QTY = st.integers(min_value=0, max_value=2**40).map(lambda n: f"{n}m") | st.integers(min_value=0, max_value=2**20).map(
    lambda n: f"{n}Mi"
)


@given(st.lists(st.tuples(_QTY, _QTY, st.booleans()), min_size=1, max_size=4))
def test_pod_usage_is_the_evaluators_and_survives_the_wire(containers: list[tuple[str, str, bool]]) -> None:
    pod = {
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "t"},
        "spec": {
            "containers": [
                {"name": f"c{i}", "resources": {"requests": {"cpu": cpu, "memory": mem}, "limits": {"memory": mem}}}
                for i, (cpu, mem, _) in enumerate(containers)
            ],
            "initContainers": [
                {
                    "name": f"i{i}",
                    "restartPolicy": "Always" if side else "Never",
                    "resources": {"requests": {"cpu": cpu}},
                }
                for i, (cpu, _, side) in enumerate(containers)
            ],
        },
    }
    s = normalize(pod)
    assert isinstance(s, PodSnapshot)
    assert s.usage == pod_quota_usage(pod)
    assert decode(encode(s)) == s


# ---- the VMI spec kept to re-render the launcher pod ----------------------------------------------------------------

FULL_SPEC: dict[str, Any] = {
    "domain": {
        "cpu": {"sockets": 2, "cores": 1, "threads": 1, "model": "host-model"},
        "memory": {"guest": "4Gi", "maxGuest": "16Gi"},
        "machine": {"type": "q35"},
        "firmware": {"uuid": "5d3c3f0e-6f1b-4a8e-9a55-0d5e5a1b2c3d", "bootloader": {"efi": {}}},
        "features": {"acpi": {"enabled": True}},
        "devices": {
            "disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}, {"name": "cloud", "disk": {"bus": "virtio"}}],
            "interfaces": [{"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"}],
            "rng": {},
        },
    },
    "networks": [{"name": "default", "pod": {}}],
    "volumes": [
        {"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/fedora:40"}},
        {"name": "cloud", "cloudInitNoCloud": {"userData": "#cloud-config\nuser: fedora\n" * 20}},
    ],
    "evictionStrategy": "LiveMigrate",
    "terminationGracePeriodSeconds": 180,
    "priorityClassName": "high",
}


def _vmi_with(spec: Any, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm1", "namespace": "tenant", "uid": "u-1", "resourceVersion": "7", **meta},
        "spec": spec,
    }


def test_the_kept_spec_drops_what_no_launcher_pod_depends_on() -> None:
    kept = prune_vmi_spec(FULL_SPEC)
    assert kept == {
        "domain": {
            "cpu": {"sockets": 2, "cores": 1, "threads": 1},
            "memory": {"guest": "4Gi"},
            "firmware": {},
            "devices": {"disks": [{}, {}], "interfaces": [{}]},
        },
        "volumes": [{"name": "rootdisk", "containerDisk": {}}, {"name": "cloud"}],
        "networks": [{}],
    }
    assert prune_vmi_spec(kept) == kept
    assert len(msgspec.json.encode(kept)) * 5 < len(msgspec.json.encode(FULL_SPEC))


def test_values_of_an_unexpected_type_are_kept_for_the_renderer_to_report() -> None:
    spec = {"domain": {"devices": {"interfaces": ["eth0", {"name": "x", "sriov": {}}]}}, "volumes": "none"}
    assert prune_vmi_spec(spec) == {"domain": {"devices": {"interfaces": ["eth0", {"sriov": {}}]}}, "volumes": "none"}


def test_vmis_with_the_same_kept_spec_share_it_and_old_writers_are_pruned_on_decode() -> None:
    a = normalize(_vmi_with(FULL_SPEC))
    other = copy.deepcopy(FULL_SPEC)
    other["domain"]["firmware"]["uuid"] = "another"
    other["volumes"][1]["cloudInitNoCloud"]["userData"] = "#cloud-config\n"
    b = normalize(_vmi_with(other, name="vm2", uid="u-2"))
    assert isinstance(a, VmiSnapshot) and isinstance(b, VmiSnapshot)
    assert a.spec is b.spec and a.spec == prune_vmi_spec(FULL_SPEC)
    # a writer from before pruning sent the whole spec: the reader keeps only the pruned one
    old = to_builtins(a)
    old["spec"] = FULL_SPEC
    decoded = decode(msgspec.json.encode(old))
    assert isinstance(decoded, VmiSnapshot) and decoded.spec is a.spec
    assert decode(encode(a)) == a and from_builtins(to_builtins(a)) == a
    # a different size is a different spec
    bigger = copy.deepcopy(FULL_SPEC)
    bigger["domain"]["memory"]["guest"] = "8Gi"
    c = normalize(_vmi_with(bigger))
    assert isinstance(c, VmiSnapshot) and c.spec is not a.spec and c.spec["domain"]["memory"] == {"guest": "8Gi"}


def test_a_decoded_spec_equal_to_a_shared_one_is_that_one_and_others_are_pruned_as_before() -> None:
    a = normalize(_vmi_with(FULL_SPEC))
    assert isinstance(a, VmiSnapshot)
    decoded = decode(encode(a))  # (the wire form's spec is already pruned: taken as the shared one)
    assert isinstance(decoded, VmiSnapshot) and decoded.spec is a.spec
    assert compact_vmi_spec(copy.deepcopy(a.spec)) is a.spec
    assert compact_vmi_spec(FULL_SPEC) is a.spec, "a full spec is pruned, then shared"
    as_tuple = {**a.spec, "volumes": tuple(a.spec["volumes"])}  # (equal encoding, not equal: not the shared one)
    assert compact_vmi_spec(as_tuple) == prune_vmi_spec(as_tuple) and compact_vmi_spec(as_tuple) is not a.spec
    unencodable = copy.deepcopy(FULL_SPEC)  # (a lone surrogate, in a part pruning drops: JSON files can hold one)
    unencodable["volumes"][1]["cloudInitNoCloud"]["userData"] = "\ud800"
    assert compact_vmi_spec(unencodable) is a.spec


# Equivalence: the launcher pod rendered from the kept spec is the one rendered from the full spec (or the error is
# the same), for the renderer's own test inputs and for generated VMIs, under several configurations.

_CONFIGS = (
    KubeVirtConfig(version="v1.0"),
    KubeVirtConfig(version="v1.5", memory_overcommit=150),
    KubeVirtConfig(version="v1.9"),
    KubeVirtConfig(
        version="main",
        arch="arm64",
        network_binding_memory={"slirp": Quantity.parse("100Mi")},
        network_binding_sidecars=frozenset({"slirp"}),
        feature_gates=frozenset({"ImageVolume"}),
    ),
)
_FACTS = (NamespaceFacts(), NamespaceFacts(quota_has_limits_cpu=True, quota_has_limits_memory=True))


def _fmt(rl: Mapping[str, Quantity]) -> list[tuple[str, str]]:
    return [(k, v.canonical()) for k, v in rl.items()]


def _rendered(obj: Mapping[str, Any], config: KubeVirtConfig, facts: NamespaceFacts) -> Any:
    try:
        pod = render_launcher_pod(obj, config, facts)
    except InvalidInput as e:
        return ("error", str(e))
    containers = [(c.name, _fmt(c.requests), _fmt(c.limits), c.init, c.restartable) for c in pod.containers]
    return containers, _fmt(pod.requests), _fmt(pod.limits), pod.memory_overhead.canonical(), dict(pod.annotations)


def assert_renders_alike(obj: Mapping[str, Any]) -> int:
    """Render ``obj`` with its full spec and with the kept one (directly, and through a snapshot and the wire)."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping) or obj.get("kind", "VirtualMachineInstance") != "VirtualMachineInstance":
        return 0
    pruned = {**obj, "spec": prune_vmi_spec(spec)}
    try:
        snap = decode(encode(normalize(obj)))
    except InvalidInput:
        snap = None
    for config in _CONFIGS:
        for facts in _FACTS:
            want = _rendered(obj, config, facts)
            assert _rendered(pruned, config, facts) == want
            if isinstance(snap, VmiSnapshot):
                assert _rendered(snap.as_object(), config, facts) == want
    return 1


def _param_sets(fn: Any) -> list[dict[str, Any]]:
    """Every argument combination of a test function's ``parametrize`` marks."""
    combos: list[dict[str, Any]] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = [getattr(r, "values", r) for r in mark.args[1]]
        rows = [r if len(names) > 1 else (r,) for r in rows]
        combos = [{**c, **dict(zip(names, r, strict=True))} for c in combos for r in rows]
    return combos


def _inputs_of(module: Any, name: str) -> list[Mapping[str, Any]]:
    """The VMI objects a test module hands to ``name`` (its import of the renderer or of ``vmi_spec``), by running
    its tests with that name recording."""
    seen: list[Mapping[str, Any]] = []
    real = getattr(module, name)

    def record(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(obj, Mapping):
            seen.append(copy.deepcopy(obj))
        return real(obj, *args, **kwargs)

    with mock.patch.object(module, name, record):
        for attr in dir(module):
            fn = getattr(module, attr)
            if not (attr.startswith("test_") and callable(fn)):
                continue
            params = inspect.signature(fn).parameters
            for args in _param_sets(fn):
                if set(params) <= set(args):
                    fn(**args)
    return seen


@pytest.mark.parametrize(("module", "name"), [(test_render, "render_launcher_pod"), (test_overhead, "vmi_spec")])
def test_the_renderers_test_inputs_render_alike_from_the_kept_spec(module: Any, name: str) -> None:
    inputs = _inputs_of(module, name)
    assert sum(assert_renders_alike(obj) for obj in inputs) >= 30


_MEM = st.sampled_from(["1Gi", "512Mi", "2Gi", "1500M", "0"])
_CPU = st.sampled_from(["1", "2", "500m", "3"])
_BOOL = st.booleans()
_RESOURCES = st.fixed_dictionaries(
    {},
    optional={
        "requests": st.fixed_dictionaries({}, optional={"cpu": _CPU, "memory": _MEM}),
        "limits": st.fixed_dictionaries({}, optional={"cpu": _CPU, "memory": _MEM}),
        "overcommitGuestOverhead": _BOOL,
    },
)
_INTERFACE = st.fixed_dictionaries(
    {"name": st.just("net")},
    optional={
        "masquerade": st.just({}),
        "bridge": st.just({}),
        "sriov": st.just({}),
        "passtBinding": st.just({}),
        "binding": st.fixed_dictionaries({"name": st.sampled_from(["slirp", "passt", "other"])}),
        "macAddress": st.just("02:00:00:00:00:01"),
    },
)
_DEVICE = st.fixed_dictionaries(
    {"name": st.just("dev")},
    optional={"deviceName": st.sampled_from(["nvidia.com/A10", "vendor/nic", ""]), "claimRequest": st.just({})},
)
_DEVICES = st.fixed_dictionaries(
    {},
    optional={
        "disks": st.just([{"name": "rootdisk", "disk": {"bus": "virtio"}}]),
        "interfaces": st.lists(_INTERFACE, max_size=3),
        "gpus": st.lists(_DEVICE, max_size=2),
        "hostDevices": st.lists(_DEVICE, max_size=2),
        "filesystems": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["fs0", "fs1"])}), max_size=2),
        "autoattachSerialConsole": _BOOL,
        "logSerialConsole": _BOOL,
        "autoattachGraphicsDevice": _BOOL,
        "tpm": st.one_of(st.just({}), st.fixed_dictionaries({"enabled": _BOOL})),
        "rng": st.just({}),
    },
)
_VOLUME = st.fixed_dictionaries(
    {"name": st.sampled_from(["rootdisk", "fs0", "fs1", "cloud"])},
    optional={
        "containerDisk": st.just({"image": "quay.io/containerdisks/fedora:40"}),
        "cloudInitNoCloud": st.just({"userData": "#cloud-config\n"}),
        "downwardMetrics": st.just({}),
        "persistentVolumeClaim": st.just({"claimName": "pvc"}),
    },
)
_DOMAIN = st.fixed_dictionaries(
    {
        "memory": st.fixed_dictionaries(
            {"guest": _MEM},
            optional={
                "hugepages": st.fixed_dictionaries({"pageSize": st.sampled_from(["2Mi", "1Gi"])}),
                "reservedOverhead": st.fixed_dictionaries({"addedOverhead": st.just("100Mi")}),
                "maxGuest": st.just("64Gi"),
            },
        )
    },
    optional={
        "resources": _RESOURCES,
        "cpu": st.fixed_dictionaries(
            {},
            optional={
                "sockets": st.integers(0, 3),
                "cores": st.integers(0, 2),
                "threads": st.integers(0, 2),
                "dedicatedCpuPlacement": _BOOL,
                "isolateEmulatorThread": _BOOL,
                "model": st.just("host-model"),
            },
        ),
        "ioThreadsPolicy": st.sampled_from(["shared", "supplementalPool"]),
        "ioThreads": st.fixed_dictionaries({"supplementalPoolThreadCount": st.integers(0, 4)}),
        "firmware": st.fixed_dictionaries(
            {"uuid": st.just("5d3c3f0e")},
            optional={"kernelBoot": st.just({"container": {"image": "quay.io/kernel:1"}, "kernelArgs": "quiet"})},
        ),
        "launchSecurity": st.sampled_from([{}, {"sev": {}}, {"snp": {}}]),
        "devices": _DEVICES,
        "features": st.just({"acpi": {"enabled": True}}),
    },
)
_SPEC = st.fixed_dictionaries(
    {"domain": _DOMAIN},
    optional={
        "volumes": st.lists(_VOLUME, max_size=4),
        "networks": st.just([{"name": "net", "pod": {}}]),
        "architecture": st.sampled_from(["amd64", "arm64", ""]),
        "livenessProbe": st.sampled_from([{"exec": {"command": ["true"]}}, {"httpGet": {"port": 80}}]),
        "readinessProbe": st.sampled_from([{"exec": {"command": ["true"]}}, {"tcpSocket": {"port": 22}}]),
        "evictionStrategy": st.just("LiveMigrate"),
        "priorityClassName": st.just("high"),
    },
)
_ANNOTATIONS = st.fixed_dictionaries(
    {},
    optional={
        "hooks.kubevirt.io/hookSidecars": st.sampled_from(['[{"image": "hook:1"}]', "[]"]),
        "alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity": st.just(""),
    },
)


# malformed values (one in a few VMIs): the renderer must report the same error, naming the same field
_BAD: list[tuple[tuple[str, ...], Any]] = [
    (("volumes",), "none"),
    (("volumes",), [{"name": "", "containerDisk": {}}]),
    (("domain", "devices", "interfaces"), ["eth0"]),
    (("domain", "devices", "interfaces"), [{"name": "n", "binding": "slirp"}]),
    (("domain", "devices", "logSerialConsole"), "yes"),
    (("domain", "devices", "tpm"), True),
    (("domain", "devices", "gpus"), [{"name": "g", "deviceName": 7}]),
    (("domain", "memory", "reservedOverhead", "addedOverhead"), "bad"),
    (("domain", "memory", "guest"), None),
    (("domain", "launchSecurity"), "sev"),
    (("domain", "firmware", "kernelBoot"), []),
    (("livenessProbe",), "probe"),
    (("metadata", "annotations", "hooks.kubevirt.io/hookSidecars"), "not json"),
]


def _corrupt(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = obj if path[0] == "metadata" else obj["spec"]
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@settings(max_examples=150, deadline=None)
@given(
    spec=_SPEC,
    annotations=_ANNOTATIONS,
    overhead=st.sampled_from([None, "300Mi"]),
    bad=st.one_of(st.none(), st.none(), st.none(), st.sampled_from(_BAD)),
)
def test_generated_vmis_render_alike_from_the_kept_spec(
    spec: dict[str, Any], annotations: dict[str, str], overhead: str | None, bad: tuple[tuple[str, ...], Any] | None
) -> None:
    obj = _vmi_with(spec, annotations=annotations)
    if bad is not None:
        _corrupt(obj, *bad)
    if overhead is not None:
        obj["status"] = {"memory": {"memoryOverhead": overhead}}
    assert assert_renders_alike(obj) == 1
    snap = normalize(obj) if _normalizes(obj) else None
    if isinstance(snap, VmiSnapshot):
        assert prune_vmi_spec(snap.spec) == snap.spec == prune_vmi_spec(obj["spec"])


def _normalizes(obj: Mapping[str, Any]) -> bool:
    try:
        normalize(obj)
    except InvalidInput:
        return False
    return True


def test_decoded_launcher_pods_of_one_shape_share_their_resource_lists_and_formats_are_kept() -> None:
    a = normalize(POD)
    b = normalize({**POD, "metadata": {**POD["metadata"], "name": "virt-launcher-vm2-xyz", "uid": "u-2"}})
    assert isinstance(a, PodSnapshot) and isinstance(b, PodSnapshot)
    c, d = decode(encode(a)), decode(encode(b))
    assert isinstance(c, PodSnapshot) and isinstance(d, PodSnapshot) and c == a and d == b
    assert c.requests is d.requests and c.limits is d.limits and c.usage is d.usage and c.requests
    binary = {"memory": Quantity.parse("1Gi")}
    decimal = {"memory": Quantity.parse("1073741824")}
    assert shared_resources(binary) == shared_resources(decimal)  # equal values ...
    assert shared_resources(decimal)["memory"].canonical() == "1073741824"  # ... not confused: formats kept
    assert shared_resources(binary)["memory"].canonical() == "1Gi"


def test_decoded_snapshots_share_their_identity_strings_and_resource_lists() -> None:
    """What a ledger holds for thousands of objects: one copy of each namespace, name, uid, phase, node and label
    value, one resource list per shape, one empty list; the content is the same as without sharing."""
    pod, vmi = normalize(POD), normalize(VMI)
    assert isinstance(pod, PodSnapshot) and isinstance(vmi, VmiSnapshot)
    a, b = decode(encode(pod)), decode(encode(pod))
    assert isinstance(a, PodSnapshot) and isinstance(b, PodSnapshot) and a == b == pod
    for field in ("namespace", "uid", "phase", "node_name", "owner_vmi_uid", "owner_vmi_name"):
        assert getattr(a, field) is getattr(b, field), field
    assert a.labels is not b.labels and all(a.labels[k] is b.labels[k] for k in a.labels)
    assert a.owner_vmi_uid is a.labels["kubevirt.io/created-by"], "the owner's uid and the label are one string"
    assert a.requests is b.requests and a.usage is b.usage
    v = decode(encode(vmi))
    assert isinstance(v, VmiSnapshot) and v == vmi and v.uid is a.owner_vmi_uid, "the VMI's uid and its pod's"
    bare = decode(encode(msgspec.structs.replace(vmi, requests={}, limits={})))
    other = decode(encode(msgspec.structs.replace(vmi, requests={}, limits={}, name="vm2")))
    assert isinstance(bare, VmiSnapshot) and isinstance(other, VmiSnapshot)
    assert bare.requests == {} and bare.requests is other.limits, "one shared empty list"
    running = decode(encode(msgspec.structs.replace(vmi, active_pods={"u-pod": "node-1"}, annotations={})))
    assert isinstance(running, VmiSnapshot) and running.active_pods == {"u-pod": "node-1"}
    ((pod_uid, node),) = running.active_pods.items()
    assert pod_uid is decode(encode(msgspec.structs.replace(pod, uid="u-pod"))).uid, "an active pod's uid and its pod's"
    assert node is a.node_name or node == "node-1"
    assert running.annotations == {} and running.annotations is other.annotations, "one shared empty map"


def test_a_vmi_keeps_only_the_annotations_its_launcher_pod_is_rendered_from_and_no_labels() -> None:
    """A tenant's other annotations (or the enforcer's nudge) and its labels are nothing accounting reads: they
    neither make a new version worth re-accounting nor grow a ledger."""
    hooks = '[{"image": "example.com/hook:1"}]'
    meta = VMI["metadata"]
    vmi = normalize(
        {
            **VMI,
            "metadata": {
                **meta,
                "annotations": {
                    "hooks.kubevirt.io/hookSidecars": hooks,
                    "vmquota.io/retry": "7",
                    "example.com/padding": "x" * 4096,
                    "kubevirt.io/latest-observed-api-version": "v1",
                },
            },
        }
    )
    assert isinstance(vmi, VmiSnapshot) and vmi.annotations == {"hooks.kubevirt.io/hookSidecars": hooks}
    labelled = normalize({**VMI, "metadata": {**meta, "labels": {f"example.com/pad{i}": "x" * 63 for i in range(50)}}})
    assert isinstance(labelled, VmiSnapshot) and same_content(labelled, normalize(VMI))
    assert b"example.com/pad" not in snapshot.encode(labelled)
    older = msgspec.json.encode({**snapshot.to_builtins(labelled), "labels": {"example.com/pad": "x"}})
    assert snapshot.decode(older) == labelled, "an event of an older version, with the VMI's labels, still reads"
    nudged = normalize(
        {**VMI, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), "vmquota.io/retry": "8"}}}
    )
    assert same_content(nudged, normalize(VMI))


def test_same_content_ignores_only_what_accounting_does_not_read() -> None:
    pod = normalize(POD)
    assert same_content(pod, msgspec.structs.replace(pod, resource_version="43"))
    assert not same_content(pod, msgspec.structs.replace(pod, phase="Succeeded"))
    assert not same_content(pod, normalize(VMI))
    quota = normalize(
        {
            "kind": "ResourceQuota",
            "metadata": {"name": "q", "namespace": "tenant", "resourceVersion": "1"},
            "spec": {"hard": {"pods": "10"}},
        }
    )
    assert isinstance(quota, QuotaSnapshot)
    used = msgspec.structs.replace(quota, status_used={"pods": Quantity.parse("3")}, resource_version="2")
    assert same_content(quota, used), "the quota controller's status echo"
    assert not same_content(quota, msgspec.structs.replace(quota, spec_hard={"pods": Quantity.parse("11")}))
    gib = msgspec.structs.replace(quota, spec_hard={"memory": Quantity.parse("1Gi")})
    in_bytes = msgspec.structs.replace(quota, spec_hard={"memory": Quantity.parse("1073741824")})
    assert gib.spec_hard == in_bytes.spec_hard, "quantity equality ignores the printed form"
    assert not same_content(gib, in_bytes), "but the published budget and hard print it: not the same content"
    reported = msgspec.structs.replace(
        quota, annotations={"vmquota.io/usage": "limits.memory 8Gi of 64Gi", "vmquota.io/status": "Enforcing"}
    )
    assert same_content(quota, reported), "the enforcer's reports for people (a summary refreshed alone)"
    moded = msgspec.structs.replace(reported, annotations={**reported.annotations, "vmquota.io/mode": "VmiPodUsage"})
    assert not same_content(reported, moded), "an annotation accounting reads"
    assert not same_content(quota, msgspec.structs.replace(quota, annotations={"example.com/note": "x"}))


def test_a_pending_vmi_snapshot_vouches_for_no_pod_whatever_its_active_pods() -> None:
    """The decoder of the bus (``shared.snapshot.fastpath``) keeps ``active_pods`` as published; only
    :attr:`VmiSnapshot.vouched_pods` keeps a pending VMI (its status its creator's words) from vouching."""
    from shared.normalize import normalize
    from shared.snapshot import VmiSnapshot
    from tests.builders import vmi_obj

    running = normalize(vmi_obj("v"))
    assert isinstance(running, VmiSnapshot)
    named = msgspec.structs.replace(running, active_pods={"pod-x": "n1"})
    assert named.vouched_pods == {"pod-x": "n1"}
    pending = msgspec.structs.replace(named, phase="Pending")
    assert pending.active_pods and pending.vouched_pods == {}
