"""KubeVirt behaviour in the simulated cluster: VM → VMI → launcher pod, quota refusals with FailedCreate and retries,
the migration lifecycle, hotplug, stop, the parallel-migration limit, and ``vmquota simulate``."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.devtools.simcluster.cluster import KUBEVIRT_NAME, KUBEVIRT_NAMESPACE, SimCluster
from services.devtools.simcluster.kubevirt import (
    FAIL_START_ANNOTATION,
    MIGRATION_FINALIZER,
    MIGRATION_REQUIRED,
    POD_MEMORY_REQUESTS_LABEL,
    VMI_FINALIZER,
    KubeVirtTiming,
    has_condition,
    memory_covered,
    phase,
)
from services.devtools.simcluster.store_api import ApiError, Obj
from shared.kubevirt import MEMORY_OVERHEAD_ANNOTATION, KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.kubevirt.command import launched_vmi_uid
from shared.podusage import pod_quota_usage
from shared.quantity import Quantity
from tests.builders import created_vmi
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SPEED = 0.05
MIGRATION_PHASES = ["Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running", "Succeeded"]


@pytest.fixture
async def sim() -> Any:
    async with SimCluster(speed=SPEED, serve_http=False) as s:
        await s.create_namespace("t", labels={"tenant": "a"})
        yield s


def conditions(obj: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


async def expected_pod(sim: SimCluster, vmi: Obj) -> Any:
    """What the renderer says KubeVirt creates for this VMI in this cluster (the test's oracle)."""
    cr = await sim.get("kubevirts", KUBEVIRT_NAMESPACE, KUBEVIRT_NAME)
    ns = await sim.get("namespaces", None, vmi["metadata"]["namespace"])
    hard: dict[str, str] = {}
    for q in await sim.list_objects("resourcequotas", vmi["metadata"]["namespace"]):
        hard.update(q["spec"]["hard"])
    facts = NamespaceFacts(
        labels=ns["metadata"]["labels"],
        quota_has_limits_cpu="limits.cpu" in hard,
        quota_has_limits_memory="limits.memory" in hard,
    )
    bare = {k: v for k, v in vmi.items() if k != "status"}
    return render_launcher_pod(bare, KubeVirtConfig.from_cr(cr), facts)


def resources_by_container(pod: Obj) -> dict[str, Any]:
    spec = pod["spec"]
    return {c["name"]: c.get("resources", {}) for c in [*spec.get("initContainers", []), *spec["containers"]]}


async def test_vm_start_creates_vmi_and_the_rendered_launcher_pod(sim: SimCluster) -> None:
    await sim.create_quota("t", "compute", {"limits.cpu": "20", "limits.memory": "40Gi"})
    await sim.wait_quota_synced("t", "compute")
    vm = await sim.create_vm("t", "vm1", sockets=2, memory="2Gi", labels={"app": "web"})
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    # VMI: owned by the VM, template labels, admission defaults written
    ref = vmi["metadata"]["ownerReferences"][0]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "VirtualMachine",
        "vm1",
        vm["metadata"]["uid"],
        True,
    )
    assert vmi["metadata"]["labels"]["app"] == "web"
    assert vmi["spec"]["domain"]["cpu"]["sockets"] == 2
    assert vmi["spec"]["domain"]["memory"]["guest"] == "2Gi"
    # the pod: labels, owner, annotations as KubeVirt sets them; resources as the renderer computes them
    [pod] = await sim.launcher_pods("t", "vm1")
    labels = pod["metadata"]["labels"]
    assert labels["kubevirt.io"] == "virt-launcher"
    assert labels["kubevirt.io/created-by"] == vmi["metadata"]["uid"]
    assert labels["vm.kubevirt.io/name"] == "vm1"
    assert labels["app"] == "web"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == vmi["metadata"]["uid"]
    assert pod["metadata"]["name"].startswith("virt-launcher-vm1-")
    expected = await expected_pod(sim, vmi)
    want = {
        c["name"]: c["resources"]
        for c in [*expected.pod_spec().get("initContainers", []), *expected.pod_spec()["containers"]]
    }
    assert resources_by_container(pod) == want
    assert (
        pod["metadata"]["annotations"][MEMORY_OVERHEAD_ANNOTATION] == expected.annotations[MEMORY_OVERHEAD_ANNOTATION]
    )
    assert "limits" in want["compute"] and "cpu" in want["compute"]["limits"]  # auto limits from the quota
    # VMI status follows the pod
    assert pod["status"]["phase"] == "Running"
    assert vmi["status"]["nodeName"] == pod["spec"]["nodeName"]
    assert vmi["status"]["activePods"] == {pod["metadata"]["uid"]: pod["spec"]["nodeName"]}
    assert vmi["status"]["currentCPUTopology"] == {"sockets": 2, "cores": 1, "threads": 1}
    overhead = Quantity.parse(vmi["status"]["memory"]["memoryOverhead"])
    assert overhead.ceil() == int(pod["metadata"]["annotations"][MEMORY_OVERHEAD_ANNOTATION])
    phases = [p["phase"] for p in vmi["status"]["phaseTransitionTimestamps"]]
    assert phases == ["Pending", "Scheduling", "Scheduled", "Running"]  # (virt-api writes the first)
    vm_now = await sim.wait_until("vm", "t", "vm1", lambda o: o.get("status", {}).get("printableStatus") == "Running")
    assert vm_now["status"]["ready"] is True
    created = {
        e["involvedObject"]["kind"]: e["message"] for e in await sim.events("t", "vm1", reason="SuccessfulCreate")
    }
    assert created["VirtualMachineInstance"] == f"Created virtual machine pod {pod['metadata']['name']}"
    assert "VirtualMachine" in created
    # quota charged exactly the pod's usage
    q = await sim.get("resourcequotas", "t", "compute")
    usage = pod_quota_usage(pod)
    assert q["status"]["used"] == {
        "limits.cpu": usage["limits.cpu"].canonical(),
        "limits.memory": usage["limits.memory"].canonical(),
    }


async def test_a_vmi_keeps_the_status_it_is_created_with_but_for_what_virt_api_writes(sim: SimCluster) -> None:
    """KubeVirt's VMI has no status subresource, and virt-api's webhook rewrites only the phase, the memory status
    and (when the create has none) the current CPU topology of a create's status; the rest stays as written until
    KubeVirt's controllers rewrite what they own."""
    forged = created_vmi("forged", vcpus=4, guest="2Gi", namespace="t")
    forged["status"] = {
        "phase": "Running",
        "currentCPUTopology": {"sockets": 1, "cores": 1, "threads": 1},
        "memory": {"guestRequested": "1Mi", "guestCurrent": "1Mi", "memoryOverhead": "1Mi"},
        "volumeStatus": [{"name": "disk", "hotplugVolume": {"attachPodName": "x"}}],
    }
    created = await sim.create(forged)
    st = created["status"]
    assert st["phase"] == "Pending" and [p["phase"] for p in st["phaseTransitionTimestamps"]] == ["Pending"]
    assert st["currentCPUTopology"] == {"sockets": 1, "cores": 1, "threads": 1}
    assert st["memory"] == {"guestAtBoot": "2Gi", "guestCurrent": "2Gi", "guestRequested": "2Gi"}
    assert st["volumeStatus"] == forged["status"]["volumeStatus"]
    plain = await sim.create(created_vmi("plain", vcpus=4, namespace="t"))
    assert plain["status"]["currentCPUTopology"] == {"sockets": 4, "cores": 1, "threads": 1}
    assert plain["status"]["phase"] == "Pending"


async def test_a_launcher_pods_command_names_its_vmi_for_good(sim: SimCluster) -> None:
    """KubeVirt starts the ``compute`` container with ``virt-launcher-monitor --uid <VMI uid>``, and a pod's
    containers cannot be changed but for their images: the one mark of a launcher pod its tenant cannot take off
    (labels and owner references it can)."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    [pod] = await sim.launcher_pods("t", "vm1")
    assert launched_vmi_uid(pod["spec"]["containers"]) == vmi["metadata"]["uid"]
    pods = sim.store.resource("Pod")

    def rewrite(p: Obj) -> Obj:
        for c in p["spec"]["containers"]:
            if c["name"] == "compute":
                c["command"] = ["/usr/bin/virt-launcher-monitor", "--uid", "someone-else"]
        return p

    with pytest.raises(ApiError) as err:
        await sim.store.mutate(pods, "t", pod["metadata"]["name"], rewrite)
    assert err.value.code == 422 and "pod updates may not change fields" in err.value.message

    def strip(p: Obj) -> Obj:
        p["metadata"]["ownerReferences"] = []
        p["metadata"]["labels"] = {}
        for c in p["spec"]["containers"]:
            c["image"] = "elsewhere/image:1"
        return p

    stripped = await sim.store.mutate(pods, "t", pod["metadata"]["name"], strip)
    assert launched_vmi_uid(stripped["spec"]["containers"]) == vmi["metadata"]["uid"]


async def test_kubevirt_cr_configuration_and_drift_reach_the_pod() -> None:
    async with SimCluster(
        speed=SPEED, serve_http=False, developer_configuration={"cpuAllocationRatio": 4}, extra_memory_overhead="64Mi"
    ) as sim:
        await sim.create_namespace("t")
        await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
        vmi = await sim.wait_for_phase("t", "vm1", "Running")
        [pod] = await sim.launcher_pods("t", "vm1")
        expected = await expected_pod(sim, vmi)
        compute = resources_by_container(pod)["compute"]
        assert compute["requests"]["cpu"] == "250m"  # 1 vCPU / ratio 4
        want_mem = expected.container("compute").requests["memory"] + Quantity.parse("64Mi")
        assert Quantity.parse(compute["requests"]["memory"]) == want_mem
        published = int(pod["metadata"]["annotations"][MEMORY_OVERHEAD_ANNOTATION])
        assert published == expected.memory_overhead.ceil() + 64 * 1024 * 1024


async def test_a_retried_rendering_is_a_fresh_copy_and_follows_the_vmi_and_the_namespace(sim: SimCluster) -> None:
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    kv = sim.kubevirt
    first = kv.render(vmi)
    first["metadata"]["annotations"]["changed-by-the-caller"] = "x"
    again = kv.render(vmi)
    assert "changed-by-the-caller" not in again["metadata"]["annotations"]
    assert again == kv.render(vmi)
    limits_before = resources_by_container(again)["compute"].get("limits", {})
    assert "memory" not in limits_before
    # A quota with limits.memory makes KubeVirt set memory limits: the namespace facts are part of the rendering.
    await sim.create_quota("t", "compute", {"limits.memory": "64Gi"})
    await sim.wait_quota_synced("t", "compute")
    limited = kv.render(vmi)
    assert "memory" in resources_by_container(limited)["compute"]["limits"]
    assert resources_by_container(limited) == resources_by_container(await expected_pod_rendered(sim, vmi))


async def expected_pod_rendered(sim: SimCluster, vmi: Obj) -> Obj:
    expected = await expected_pod(sim, vmi)
    return {"spec": expected.pod_spec()}


async def test_refused_pod_gives_failedcreate_events_condition_and_retries(sim: SimCluster) -> None:
    await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})
    await sim.wait_quota_synced("t", "compute")
    await sim.create_vm("t", "vm1", memory="2Gi")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: "Synchronized" in conditions(o))
    cond = conditions(vmi)["Synchronized"]
    assert (cond["status"], cond["reason"]) == ("False", "FailedCreate")
    assert vmi["status"]["phase"] == "Pending"
    assert cond["message"].startswith('failed to create virtual machine pod: pods "virt-launcher-vm1-')  # (KubeVirt's)
    assert "is forbidden: exceeded quota: compute, requested: limits.memory=" in cond["message"]
    assert cond["message"].endswith("used: limits.memory=0, limited: limits.memory=1Gi")
    # retried with backoff; client-go combines similar events from the 10th distinct message on
    await sim.wait_for(lambda: sim.kubevirt.pods_refused >= 12, what="twelve refused creations")
    events = await sim.events("t", "vm1", reason="FailedCreate")
    assert all(e["type"] == "Warning" and e["involvedObject"]["kind"] == "VirtualMachineInstance" for e in events)
    assert events[0]["message"].startswith('Error creating pod: pods "virt-launcher-vm1-')
    combined = [e for e in events if e["message"].startswith("(combined from similar events): Error creating pod:")]
    assert len(combined) == 1 and combined[0]["count"] >= 2
    assert len(events) == 10  # nine single ones, then the combined one keeps counting
    assert await sim.launcher_pods("t", "vm1") == []
    # more quota: the VMI starts at its next backoff retry (the VMI controller does not watch quotas)
    await sim.set_quota_hard("t", "compute", {"limits.memory": "8Gi"})
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    assert "Synchronized" not in conditions(vmi)


async def test_migration_lifecycle_to_succeeded_with_source_pod_terminal_then_deleted(sim: SimCluster) -> None:
    await sim.create_quota("t", "compute", {"limits.memory": "64Gi", "limits.cpu": "16"})
    await sim.wait_quota_synced("t", "compute")
    await sim.create_vm("t", "vm1", memory="4Gi", limits={"memory": "4Gi"})
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    await sim.wait_quiet()
    used_before = (await sim.get("resourcequotas", "t", "compute"))["status"]["used"]
    [source] = await sim.launcher_pods("t", "vm1")
    source_node = vmi["status"]["nodeName"]
    seen_vm_status: set[str] = set()
    sim.store.on_change(
        lambda t, r, o: (
            seen_vm_status.add(o.get("status", {}).get("printableStatus", ""))
            if r.plural == "virtualmachines"
            else None
        )
    )
    vmim = await sim.migrate("t", "vm1", name="mig1")
    done = await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    assert [p["phase"] for p in done["status"]["phaseTransitionTimestamps"]] == MIGRATION_PHASES
    target = next(p for p in await sim.launcher_pods("t", "vm1") if p["metadata"]["uid"] != source["metadata"]["uid"])
    assert target["metadata"]["labels"]["kubevirt.io/migrationJobUID"] == vmim["metadata"]["uid"]
    assert target["metadata"]["annotations"]["kubevirt.io/migrationJobName"] == "mig1"
    assert target["spec"]["nodeName"] != source_node
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["nodeName"] == target["spec"]["nodeName"]
    assert vmi["metadata"]["labels"]["kubevirt.io/nodeName"] == target["spec"]["nodeName"]
    state = vmi["status"]["migrationState"]
    assert state["migrationUid"] == vmim["metadata"]["uid"]
    assert (state["sourceNode"], state["targetNode"]) == (source_node, target["spec"]["nodeName"])
    assert (state["targetPod"], state["sourcePod"]) == (target["metadata"]["name"], source["metadata"]["name"])
    assert state["completed"] is True and not state.get("failed")
    assert "Migrating" in seen_vm_status
    # the source pod goes terminal, then it is deleted; the quota's usage is back where it was
    await sim.wait_for(
        lambda: (p := sim.peek("pods", "t", source["metadata"]["name"])) is None or p["status"]["phase"] == "Succeeded",
        what="source pod Succeeded",
    )
    await sim.wait_for(lambda: sim.peek("pods", "t", source["metadata"]["name"]) is None, what="source pod deleted")
    q = await sim.wait_until("resourcequotas", "t", "compute", lambda o: o["status"]["used"] == used_before)
    assert q["status"]["used"] == used_before
    assert [e["reason"] for e in await sim.events("t", "mig1")].count("SuccessfulMigration") == 1


async def test_hotplug_starts_a_workload_update_migration_with_the_new_size(sim: SimCluster) -> None:
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.hotplug("t", "vm1", sockets=2, memory="2Gi")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["cpu"]["sockets"] == 2)
    assert vmi["spec"]["domain"]["memory"]["guest"] == "2Gi"
    await sim.wait_for(lambda: bool(sim.cache.list("virtualmachineinstancemigrations", "t")), what="a migration")
    migrations = await sim.list_objects("vmim", "t")
    assert len(migrations) == 1
    [mig] = migrations
    assert mig["metadata"]["name"].startswith("kubevirt-workload-update-")
    assert "kubevirt.io/workloadUpdateMigration" in mig["metadata"]["annotations"]
    done = await sim.wait_for_phase("t", mig["metadata"]["name"], "Succeeded", kind="vmim")
    assert done["status"]["phase"] == "Succeeded"
    target = next(
        p for p in await sim.launcher_pods("t", "vm1") if "kubevirt.io/migrationJobUID" in p["metadata"]["labels"]
    )
    vmi = await sim.get("vmi", "t", "vm1")
    expected = await expected_pod(sim, vmi)
    assert resources_by_container(target)["compute"] == next(
        c["resources"] for c in expected.pod_spec()["containers"] if c["name"] == "compute"
    )
    assert resources_by_container(target)["compute"]["requests"]["cpu"] == "200m"  # 2 vCPUs / 10
    assert vmi["status"]["currentCPUTopology"]["sockets"] == 2
    assert vmi["status"]["memory"]["guestCurrent"] == "2Gi"
    assert "HotVCPUChange" not in conditions(vmi) and "HotMemoryChange" not in conditions(vmi)


async def test_a_cpu_hotplug_before_the_vm_runs_starts_the_domain_at_the_new_size_in_the_old_pod(
    sim: SimCluster,
) -> None:
    """Upstream's VM controller patches raised sockets into a VMI whatever its phase (``handleCPUChangeRequest``), and
    virt-launcher starts the domain from the VMI's spec: the guest runs 3 vCPUs in a pod made for 1, while the VMI's
    ``status.currentCPUTopology`` keeps the size it was created with; once it runs, ``HotVCPUChange`` and a
    workload-update migration follow, whose target carries the 3 vCPUs. Guest memory is not raised before the VMI
    runs (memory hotplug needs a migratable VMI)."""
    sim.kubevirt.schedulable = set()  # (the launcher pod waits for a node)
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Scheduling")
    await sim.hotplug("t", "vm1", sockets=3, memory="2Gi")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["cpu"]["sockets"] == 3)
    assert vmi["spec"]["domain"]["memory"]["guest"] == "1Gi" and phase(vmi) == "Scheduling"
    (pod,) = await sim.launcher_pods("t", "vm1")
    assert resources_by_container(pod)["compute"]["requests"]["cpu"] == "100m", "made for 1 vCPU"
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    running = await sim.wait_for_phase("t", "vm1", "Running")
    assert running["status"]["currentCPUTopology"]["sockets"] == 1
    assert sim.kubevirt.domain_vcpus[pod["metadata"]["uid"]] == 3
    await sim.wait_for(lambda: bool(sim.cache.list("virtualmachineinstancemigrations", "t")), what="a migration")
    (mig,) = await sim.list_objects("vmim", "t")
    assert mig["metadata"]["name"].startswith("kubevirt-workload-update-")
    await sim.wait_for_phase("t", mig["metadata"]["name"], "Succeeded", kind="vmim")
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["currentCPUTopology"]["sockets"] == 3 and "HotVCPUChange" not in conditions(vmi)


async def test_a_cpu_hotplug_after_a_target_was_made_is_carried_out_at_the_migrations_end(sim: SimCluster) -> None:
    """A migration whose target pod was made for 1 vCPU has not started; the VM's sockets are raised to 3, which
    KubeVirt patches into the VMI (it is not migrating yet). At the migration's end virt-handler gives the target's
    domain the spec's vCPUs whatever its pod was made for (``finalizeMigration``: ``hotplugCPU``), writes them into
    ``currentCPUTopology`` and takes ``HotVCPUChange`` off."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    sim.kubevirt.schedulable = set()  # (the target waits for a node)
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_for(lambda: len(sim.cache.list("pods", "t")) == 2, what="the target pod")
    await sim.hotplug("t", "vm1", sockets=3)
    await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["cpu"]["sockets"] == 3)
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    target = next(
        p for p in await sim.launcher_pods("t", "vm1") if "kubevirt.io/migrationJobUID" in p["metadata"]["labels"]
    )
    assert resources_by_container(target)["compute"]["requests"]["cpu"] == "100m", "made for 1 vCPU"
    assert sim.kubevirt.domain_vcpus[target["metadata"]["uid"]] == 3
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["currentCPUTopology"]["sockets"] == 3 and "HotVCPUChange" not in conditions(vmi)


async def test_a_memory_hotplug_after_a_target_was_made_is_carried_out_where_the_hand_off_label_covers_it(
    sim: SimCluster,
) -> None:
    """A migration whose target pod was made for 1Gi has not started; the VM's guest memory is raised to 2Gi. At the
    hand-off virt-controller labels the VMI with the target's compute memory request; at the end virt-handler
    (``hotplugMemory``) gives the guest the spec's memory where that label covers the target's memory overhead and
    the VMI's memory request: a VMI that sets guest memory only has none, so a pod made for 1Gi runs a 2Gi guest.
    The label goes once the migration ends."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    sim.kubevirt.schedulable = set()  # (the target waits for a node)
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_for(lambda: len(sim.cache.list("pods", "t")) == 2, what="the target pod")
    await sim.hotplug("t", "vm1", memory="2Gi")
    await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["memory"]["guest"] == "2Gi")
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    labelled = await sim.wait_until(
        "vmi", "t", "vm1", lambda o: "kubevirt.io/vmi-pod-memory-resource-requests" in o["metadata"]["labels"]
    )
    target = next(
        p for p in await sim.launcher_pods("t", "vm1") if "kubevirt.io/migrationJobUID" in p["metadata"]["labels"]
    )
    made = Quantity.parse(resources_by_container(target)["compute"]["requests"]["memory"])
    assert made < Quantity.parse("2Gi"), "made for 1Gi"
    assert Quantity.parse(labelled["metadata"]["labels"]["kubevirt.io/vmi-pod-memory-resource-requests"]) == made
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["memory"]["guestRequested"] == "2Gi"
    assert "kubevirt.io/vmi-pod-memory-resource-requests" not in vmi["metadata"]["labels"]


async def test_a_migration_without_a_memory_change_pending_leaves_the_guest_memory(sim: SimCluster) -> None:
    """``hotplugMemory`` acts only with ``HotMemoryChange``: a target rendered with more guest memory than the VMI
    runs (here from a copy of the VMI that says so) changes nothing of the guest's memory at the migration's end,
    and the VMI's memory overhead becomes the target's (``updateMemoryOverheadStatusFromPod``)."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    larger = json.loads(json.dumps(vmi))
    larger["spec"]["domain"]["memory"]["guest"] = "2Gi"
    sim.kubevirt.render_from[("t", "vm1")] = larger
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["memory"]["guestCurrent"] == "1Gi" and vmi["status"]["memory"]["guestRequested"] == "1Gi"
    target = next(
        p for p in await sim.launcher_pods("t", "vm1") if "kubevirt.io/migrationJobUID" in p["metadata"]["labels"]
    )
    overhead = Quantity.parse(target["metadata"]["annotations"][MEMORY_OVERHEAD_ANNOTATION])
    assert Quantity.parse(vmi["status"]["memory"]["memoryOverhead"]) == overhead


def test_a_memory_change_the_hand_off_label_does_not_cover_is_not_carried_out() -> None:
    """``hotplugMemory``'s check: the label against the target's overhead plus the VMI's memory request."""
    vmi: Obj = {
        "metadata": {"labels": {POD_MEMORY_REQUESTS_LABEL: "1224Mi"}},
        "spec": {"domain": {"resources": {"requests": {"memory": "2Gi"}}}},
        "status": {"migrationState": {"targetMemoryOverhead": "200Mi"}},
    }
    assert not memory_covered(vmi)  # (the target made for a 1Gi request)
    vmi["spec"]["domain"]["resources"]["requests"]["memory"] = "1Gi"
    assert memory_covered(vmi)
    del vmi["spec"]["domain"]["resources"]
    assert memory_covered(vmi)  # (guest memory only: the overhead alone is checked)
    vmi["metadata"]["labels"][POD_MEMORY_REQUESTS_LABEL] = "not-a-quantity"
    assert not memory_covered(vmi)


async def test_a_hotplug_grows_explicit_resources_only_where_the_template_has_them(sim: SimCluster) -> None:
    """Upstream's VMICPUsPatch and memory hotplug: the CPU request and limit grow by the added vCPUs / ratio (100m
    each at 10) only where the VM's template has them, so a request virt-api copied from the limit stays; the
    memory limit, which the template has, grows by the new size less guestCurrent."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi", limits={"cpu": "1", "memory": "2Gi"})
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    assert vmi["spec"]["domain"]["resources"]["requests"] == {"cpu": "1"}  # (virt-api's default, from the limit)
    await sim.hotplug("t", "vm1", sockets=3, memory="3Gi")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["cpu"]["sockets"] == 3)
    resources = vmi["spec"]["domain"]["resources"]
    assert resources["limits"] == {"cpu": "1200m", "memory": "4Gi"}, resources
    assert resources["requests"] == {"cpu": "1"}, resources


async def test_an_interface_hotplug_is_plugged_in_place_or_by_a_workload_update_migration(sim: SimCluster) -> None:
    """As upstream's network hotplug: a bridge interface added to a running VM's template is appended to the VMI's
    spec and plugged in place (``status.interfaces`` names it, no migration); an SR-IOV one is appended too but
    plugged only by a migration: ``MigrationRequired`` until a workload-update migration, whose target is rendered
    with it (KubeVirt's VFIO overhead), completes; only then does the status name it."""
    await sim.create_vm("t", "vm1", sockets=1, memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    assert [i["name"] for i in vmi["status"]["interfaces"]] == ["default"]
    await sim.add_interface("t", "vm1", "br")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: len(o["status"].get("interfaces", [])) == 2)
    assert [i["name"] for i in vmi["spec"]["domain"]["devices"]["interfaces"]] == ["default", "br"]
    assert [n["name"] for n in vmi["spec"]["networks"]] == ["default", "br"]
    assert MIGRATION_REQUIRED not in conditions(vmi)
    assert not sim.cache.list("virtualmachineinstancemigrations", "t"), "a bridge interface needs no migration"
    source = (await sim.launcher_pods("t", "vm1"))[0]

    await sim.add_interface("t", "vm1", "fast", sriov=True)
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: MIGRATION_REQUIRED in conditions(o))
    assert conditions(vmi)[MIGRATION_REQUIRED]["reason"] == "AutoMigrationDueToLiveUpdate"
    assert [i["name"] for i in vmi["spec"]["domain"]["devices"]["interfaces"]] == ["default", "br", "fast"]
    await sim.wait_for(lambda: bool(sim.cache.list("virtualmachineinstancemigrations", "t")), what="a migration")
    [mig] = await sim.list_objects("vmim", "t")
    assert mig["metadata"]["name"].startswith("kubevirt-workload-update-")
    await sim.wait_for_phase("t", mig["metadata"]["name"], "Succeeded", kind="vmim")
    vmi = await sim.get("vmi", "t", "vm1")
    assert [i["name"] for i in vmi["status"]["interfaces"]] == ["default", "br", "fast"]
    assert MIGRATION_REQUIRED not in conditions(vmi)
    target = next(
        p for p in await sim.launcher_pods("t", "vm1") if "kubevirt.io/migrationJobUID" in p["metadata"]["labels"]
    )
    memory = Quantity.parse(resources_by_container(target)["compute"]["requests"]["memory"])
    before = Quantity.parse(resources_by_container(source)["compute"]["requests"]["memory"])
    assert memory - before >= Quantity.parse("1Gi"), "the VFIO overhead"
    expected = await expected_pod(sim, vmi)
    assert resources_by_container(target)["compute"] == next(
        c["resources"] for c in expected.pod_spec()["containers"] if c["name"] == "compute"
    )


async def running_vm_in_a_full_quota(sim: SimCluster) -> dict[str, str]:
    """vm1 (1Gi) running in namespace t, whose quota ``compute`` is then set to what is used: a migration target is
    refused. The quota's ``status.used``."""
    await sim.create_quota("t", "compute", {"limits.memory": "64Gi"})
    await sim.wait_quota_synced("t", "compute")
    await sim.create_vm("t", "vm1", memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.wait_quiet()
    used: dict[str, str] = (await sim.get("resourcequotas", "t", "compute"))["status"]["used"]
    await sim.set_quota_hard("t", "compute", used)  # full: the target is refused
    await sim.wait_quota_synced("t", "compute")
    return used


def test_the_retry_backoff_is_scaled_by_the_speed_unless_it_runs_in_real_time() -> None:
    scaled = KubeVirtTiming(speed=0.02).backoff()
    real = KubeVirtTiming(speed=0.02, backoff_in_real_time=True).backoff()
    assert [scaled.base(n) for n in range(3)] == pytest.approx([0.0001, 0.0002, 0.0004])
    assert [real.base(n) for n in range(3)] == pytest.approx([0.005, 0.01, 0.02])  # (client-go's default)
    assert (scaled.maximum, real.maximum) == pytest.approx((20.0, 1000.0))
    # client-go's overall bucket: 10 retries a second, 100 at once (then each waits its turn)
    bucket = KubeVirtTiming(speed=0.02, backoff_in_real_time=True).bucket()
    assert [bucket.take(0.0) for _ in range(100)] == [0.0] * 100
    assert bucket.take(0.0) == pytest.approx(0.1) and bucket.take(0.0) == pytest.approx(0.2)
    assert KubeVirtTiming(speed=0.02).bucket().rate == pytest.approx(500.0)


async def test_a_refused_target_is_tried_again_at_its_backoff_and_at_once_on_a_quota_update(sim: SimCluster) -> None:
    """KubeVirt's migration controller retries a refused target with its per-item backoff and re-queues it at once
    on an update of the migration (its own condition write after the first refusal), of its VMI or pods, and of a
    quota of its namespace; the simulator counts each refused try by what made it."""
    used = await running_vm_in_a_full_quota(sim)
    refused = sim.kubevirt.target_refusals
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_until(
        "vmim", "t", "mig1", lambda o: "migrationRejectedByResourceQuota" in conditions(o), what="target refused"
    )
    await sim.wait_for(lambda: refused["backoff retry"] >= 3, what="three retries at the backoff")
    assert refused["first try"] == 1 and refused["quota update"] == 0
    assert refused["object update"] == 1, "the update of its condition re-queued it once"
    # an update of the quota that makes no room: tried at once, refused again
    await sim.set_quota_hard("t", "compute", {**used, "pods": "100"})
    await sim.wait_for(lambda: refused["quota update"] >= 1, what="a try at the quota's update")
    await sim.set_quota_hard("t", "compute", {"limits.memory": "64Gi"})
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    assert refused["first try"] == 1
    events = await sim.events("t", "vm1", reason="FailedCreate")
    assert sum(refused.values()) == sum(e.get("count", 1) for e in events)


_HOLD_TARGETS = [
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "hold-targets"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                ]
            },
            "validations": [
                {
                    "expression": "!('kubevirt.io/migrationJobUID' in object.metadata.labels)",
                    "message": "migration targets are held back",
                }
            ],
        },
    },
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "hold-targets"},
        "spec": {"policyName": "hold-targets", "validationActions": ["Deny"]},
    },
]


async def test_a_quota_update_re_queues_only_the_migrations_refused_for_quota() -> None:
    """Upstream's migration controller re-queues on a quota's update the migrations whose status carries
    ``migrationRejectedByResourceQuota`` (``updateResourceQuota`` at v1.9.0), which only an error that says
    ``exceeded quota`` sets. The simulator woke every migration waiting out a backoff in the namespace, so a target
    refused for another reason was retried at vmquota's next quota write instead of at KubeVirt's backoff."""
    timing = KubeVirtTiming(speed=SPEED, backoff_base=30.0, backoff_in_real_time=True)
    async with SimCluster(speed=SPEED, serve_http=False, kubevirt_timing=timing) as sim:
        await sim.create_namespace("t")
        await sim.create_quota("t", "compute", {"limits.memory": "64Gi"})
        await sim.wait_quota_synced("t", "compute")
        await sim.create_vm("t", "vm1", memory="1Gi")
        await sim.wait_for_phase("t", "vm1", "Running")
        for obj in _HOLD_TARGETS:
            await sim.create(copy.deepcopy(obj))
        await sim.migrate("t", "vm1", name="mig1")
        await sim.wait_for(lambda: sim.kubevirt.waits_out_backoff("vmim", ("t", "mig1")), what="the target refused")
        events = await sim.events("t", "vm1", reason="FailedCreate")
        assert any("held back" in e["message"] for e in events), events
        assert "migrationRejectedByResourceQuota" not in conditions(await sim.get("vmim", "t", "mig1"))
        await sim.set_quota_hard("t", "compute", {"limits.memory": "65Gi"})  # (a quota update; cache fed at once)
        assert sim.kubevirt.waits_out_backoff("vmim", ("t", "mig1")), "re-queued by a quota update"


async def test_a_migration_of_a_vmi_with_a_hotplugged_volume_waits_for_its_targets_attachment_pod(
    sim: SimCluster,
) -> None:
    """Upstream's migration controller: for a VMI with hotplugged volumes the migration stays Pending once the
    target exists, until it has made an attachment pod beside the target (controlled by it, once the target runs)
    and that pod runs; quota refuses the attachment pod like any pod (an Event on the migration, retried), and the
    migration goes on once there is room for it."""
    await sim.create_quota("t", "compute", {"limits.memory": "64Gi"})
    await sim.create_vm("t", "vm1", memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    source_attachment = await sim.attach_volume("t", "vm1")
    vmi = await sim.get("vmi", "t", "vm1")
    assert vmi["status"]["volumeStatus"][0]["hotplugVolume"]["attachPodName"] == source_attachment["metadata"]["name"]
    await sim.wait_quiet()
    used = (await sim.get("resourcequotas", "t", "compute"))["status"]["used"]
    charged = Quantity.parse(used["limits.memory"])  # (the launcher pod and its attachment pod)
    attachment = Quantity.parse(source_attachment["spec"]["containers"][0]["resources"]["limits"]["memory"])
    room = charged + (charged - attachment)  # room for a second launcher pod, not for an attachment pod beside it
    await sim.set_quota_hard("t", "compute", {"limits.memory": room.canonical()})
    await sim.wait_quota_synced("t", "compute")
    await sim.migrate("t", "vm1", name="mig1")

    def target_of() -> Obj | None:
        pods = sim.cache.list("pods", "t")
        return next((p for p in pods if "kubevirt.io/migrationJobUID" in p["metadata"].get("labels", {})), None)

    await sim.wait_for(lambda: (t := target_of()) is not None and t["status"].get("phase") == "Running", what="target")
    refused: list[Obj] = []

    async def attachment_refused() -> bool:  # (an Event on the VMI, as createAttachmentPod records it)
        events = await sim.events("t", "vm1", reason="FailedCreate")
        refused[:] = [e for e in events if "Error creating attachment pod: " in e["message"]]
        return bool(refused)

    await wait_until(attachment_refused, what="the attachment pod refused")
    assert (
        refused[0]["involvedObject"]["kind"] == "VirtualMachineInstance" and "exceeded quota" in refused[0]["message"]
    )
    mig = await sim.get("vmim", "t", "mig1")
    assert mig["status"]["phase"] == "Pending", "KubeVirt goes on only once the attachment pod runs"
    await sim.set_quota_hard("t", "compute", {"limits.memory": "64Gi"})
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    target = target_of()
    assert target is not None
    attached = [
        p
        for p in sim.cache.list("pods", "t")
        if any(
            r.get("kind") == "Pod" and r.get("uid") == target["metadata"]["uid"]
            for r in p["metadata"].get("ownerReferences", [])
        )
    ]
    mig = await sim.get("vmim", "t", "mig1")
    assert [p["metadata"]["labels"] for p in attached] == [
        {"kubevirt.io": "hotplug-disk", "kubevirt.io/migrationJobUID": mig["metadata"]["uid"]}
    ], "createAttachmentPod labels it with its migration"
    assert attached[0]["metadata"]["annotations"]["kubevirt.io/migrationJobName"] == "mig1"
    assert attached[0]["spec"]["nodeName"] == target["spec"]["nodeName"], "beside its target"


async def test_a_migration_waiting_for_its_attachment_pod_fails_when_its_target_goes_down(
    sim: SimCluster,
) -> None:
    """Upstream's ``updateStatus`` fails a migration whose target pod is down (``PodIsDown``: Succeeded or Failed)
    in any phase, Pending included: the simulator left a migration of a VMI with hotplugged volumes (Pending until
    its target's attachment pod runs) Pending for good once its target failed."""
    await sim.create_vm("t", "vm1", memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.attach_volume("t", "vm1")
    await sim.migrate("t", "vm1", name="mig1", target_fails=True)
    await sim.wait_for_phase("t", "mig1", "Failed", kind="vmim")
    failed = await sim.events("t", "mig1", reason="FailedMigration")
    assert any("target pod shutdown during migration" in e["message"] for e in failed), failed

    await sim.migrate("t", "vm1", name="mig2")  # (and the next migration goes ahead)
    await sim.wait_for_phase("t", "mig2", "Succeeded", kind="vmim")


async def test_a_hotplug_applies_while_a_migration_is_pending_and_its_target_carries_the_new_size(
    sim: SimCluster,
) -> None:
    """Upstream's live-update handlers refuse a hotplug only while the VMI is migrating (a migration has started)
    or another hotplug is in progress: a migration whose target quota refuses has not started, so the hotplug
    patches the VMI, KubeVirt's next try renders the target at the new size, and no workload-update migration is
    made beside the one in flight (the completed migration makes the new size current)."""
    await running_vm_in_a_full_quota(sim)
    mig = await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_until(
        "vmim", "t", "mig1", lambda o: "migrationRejectedByResourceQuota" in conditions(o), what="target refused"
    )
    await sim.hotplug("t", "vm1", memory="2Gi")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: o["spec"]["domain"]["memory"]["guest"] == "2Gi")
    assert conditions(vmi)["HotMemoryChange"]["status"] == "True"
    await sim.set_quota_hard("t", "compute", {"limits.memory": "64Gi"})
    done = await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")
    target = next(
        p
        for p in await sim.launcher_pods("t", "vm1")
        if p["metadata"]["name"] == done["status"]["migrationState"]["targetPod"]
    )
    expected = await expected_pod(sim, await sim.get("vmi", "t", "vm1"))
    assert resources_by_container(target)["compute"] == next(
        c["resources"] for c in expected.pod_spec()["containers"] if c["name"] == "compute"
    ), "the target was rendered at the new size"
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: "HotMemoryChange" not in conditions(o))
    assert vmi["status"]["memory"]["guestCurrent"] == "2Gi"
    await sim.wait_quiet()
    assert [m["metadata"]["uid"] for m in await sim.list_objects("vmim", "t")] == [mig["metadata"]["uid"]]


async def test_stop_deletes_the_vmi_and_its_pods_and_start_creates_a_new_one(sim: SimCluster) -> None:
    await sim.create_vm("t", "vm1", memory="1Gi")
    first = await sim.wait_for_phase("t", "vm1", "Running")
    await sim.set_running("t", "vm1", False)
    await sim.wait_for(lambda: sim.peek("vmi", "t", "vm1") is None, what="VMI deleted")
    await sim.wait_for(lambda: not sim.cache.list("pods", "t"), what="pods deleted")
    vm = await sim.wait_until("vm", "t", "vm1", lambda o: o.get("status", {}).get("printableStatus") == "Stopped")
    assert vm["status"]["created"] is False
    await sim.set_running("t", "vm1", True)
    second = await sim.wait_for_phase("t", "vm1", "Running")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]


async def test_at_most_five_migrations_run_at_once() -> None:
    nodes = [f"node{i:02d}" for i in range(1, 10)]
    async with SimCluster(speed=SPEED, serve_http=False, nodes=nodes) as sim:
        await sim.create_namespace("t")
        for i in range(8):
            await sim.create_vm("t", f"vm{i}", memory="1Gi")
        for i in range(8):
            await sim.wait_for_phase("t", f"vm{i}", "Running")
        active: dict[str, str] = {}
        peak = [0]

        def track(type_: str, res: Any, obj: Obj) -> None:
            if res.plural != "virtualmachineinstancemigrations":
                return
            phase = obj.get("status", {}).get("phase", "")
            active[obj["metadata"]["name"]] = phase
            running = sum(1 for p in active.values() if p in MIGRATION_PHASES[1:-1])
            peak[0] = max(peak[0], running)

        sim.store.on_change(track)
        for i in range(8):
            await sim.migrate("t", f"vm{i}", name=f"mig{i}")
        for i in range(8):
            await sim.wait_for_phase("t", f"mig{i}", "Succeeded", kind="vmim")
        assert peak[0] == 5


async def test_no_target_is_created_while_the_vmi_has_two_active_pods_one_of_them_being_deleted(
    sim: SimCluster,
) -> None:
    """KubeVirt's migration controller creates no target while the VMI has more than one active pod
    (``VMIActivePodsCount``: every pod it controls that is not Succeeded or Failed, one being deleted too). Here a
    tenant's pod with a controller reference to the VMI, deleted but kept by a finalizer."""
    await sim.create_vm("t", "vm1", memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    owner: Obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "vm1"}
    owner |= {"uid": vmi["metadata"]["uid"], "controller": True}
    await sim.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "extra",
                "namespace": "t",
                "labels": {"kubevirt.io": "virt-launcher"},  # (KubeVirt sees no pod without the key)
                "ownerReferences": [owner],
                "finalizers": ["t/hold"],
            },
            # (its containers run on for its grace period once it is deleted)
            "spec": {"containers": [{"name": "c", "image": "busybox"}], "terminationGracePeriodSeconds": 3600},
        }
    )
    await sim.wait_until("pods", "t", "extra", lambda o: o["status"].get("phase") == "Running")
    await sim.store.delete(sim.store.resource("pods"), "t", "extra")
    held = await sim.get("pods", "t", "extra")
    assert held["metadata"].get("deletionTimestamp") and held["status"]["phase"] == "Running"
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_quiet()
    assert len(await sim.launcher_pods("t", "vm1")) == 1, "no target while the VMI has two active pods"
    assert (await sim.get("vmim", "t", "mig1"))["status"].get("phase", "Pending") == "Pending"
    await sim.store.mutate(
        sim.store.resource("pods"), "t", "extra", lambda o: {**o, "metadata": {**o["metadata"], "finalizers": []}}
    )
    await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim")


async def test_kubevirt_sees_only_pods_with_the_label_key_kubevirt_io(sim: SimCluster) -> None:
    """virt-controller's VMI and migration controllers watch pods through an informer that selects the label key
    ``kubevirt.io`` (``KubeVirtPod``): a pod the VMI controls without it is not the VMI's, so a pending VMI does not
    run in it; once the pod carries the key (any value), KubeVirt takes it for the VMI's launcher pod."""
    await sim.create_quota("t", "compute", {"requests.cpu": "1"})  # (KubeVirt's pod for 16 vCPUs does not fit)
    await sim.wait_quota_synced("t", "compute")
    vmi = await sim.create(created_vmi("big", vcpus=16, namespace="t"))
    await sim.wait_until(
        "vmi",
        "t",
        "big",
        lambda o: any(c.get("reason") == "FailedCreate" for c in o.get("status", {}).get("conditions") or []),
    )
    owner: Obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "big"}
    owner |= {"uid": vmi["metadata"]["uid"], "controller": True}
    small = {"requests": {"cpu": "10m"}}
    tiny: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "tiny", "namespace": "t", "ownerReferences": [owner]},
        "spec": {"containers": [{"name": "c", "image": "busybox", "resources": small}]},
    }
    await sim.create(tiny)
    await sim.wait_until("pods", "t", "tiny", lambda o: o["status"].get("phase") == "Running")
    await sim.wait_quiet()
    now = await sim.get("vmi", "t", "big")
    assert now["status"].get("phase") == "Pending" and not now["status"].get("activePods"), now["status"]
    await sim.store.mutate(
        sim.store.resource("pods"),
        "t",
        "tiny",
        lambda o: {**o, "metadata": {**o["metadata"], "labels": {"kubevirt.io": "anything"}}},
    )
    running = await sim.wait_for_phase("t", "big", "Running")
    assert list(running["status"]["activePods"]) == [(await sim.get("pods", "t", "tiny"))["metadata"]["uid"]]


async def test_validating_admission_sees_a_migration_as_virt_apis_mutator_made_it(sim: SimCluster) -> None:
    """virt-api's create mutator is a mutating webhook: validating admission (policies, virt-api's validator) sees
    the new migration with its ``kubevirt.io/vmi-name`` label and KubeVirt's finalizer already on."""
    seen: list[Obj] = []

    async def look(op: str, res: Any, new: Obj | None, old: Obj | None, sub: str | None = None) -> Obj | None:
        if op == "CREATE" and new is not None:
            seen.append(copy.deepcopy(new["metadata"]))
        return None

    sim.store.add_admission(sim.store.resource("vmim"), look, first=True)  # (as admission policies run)
    await sim.create_vm("t", "vm1", memory="512Mi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.migrate("t", "vm1", name="mig1")
    ((meta,),) = [seen]
    assert meta["labels"]["kubevirt.io/vmi-name"] == "vm1" and MIGRATION_FINALIZER in meta["finalizers"]


async def test_a_migration_carries_kubevirts_finalizer_and_is_marked_deleted_before_it_goes(sim: SimCluster) -> None:
    """virt-api's webhook puts ``kubevirt.io/migrationJobFinalize`` on a migration as it is created
    (``migration-create-mutator``): its deletion is first an update with ``deletionTimestamp``, then the
    controller lets it go."""
    await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})  # (no room for a target: it stays Pending)
    await sim.create_vm("t", "vm1", memory="512Mi")
    await sim.wait_for_phase("t", "vm1", "Running")
    created = await sim.migrate("t", "vm1", name="mig1")
    assert MIGRATION_FINALIZER in created["metadata"].get("finalizers", []), created["metadata"]
    seen: list[Obj] = []
    sim.store.on_change(lambda t, r, o: seen.append(o) if r.plural == "virtualmachineinstancemigrations" else None)
    await sim.store.delete(sim.store.resource("vmim"), "t", "mig1")
    await sim.wait_for(lambda: sim.peek("vmim", "t", "mig1") is None, what="the migration let go")
    assert seen and seen[0]["metadata"].get("deletionTimestamp"), "marked deleted first"


async def test_a_deleted_vmi_outlives_its_pods_which_kubevirt_deletes(sim: SimCluster) -> None:
    """virt-api puts ``kubevirt.io/foregroundDeleteVirtualMachine`` on every VMI; a deleted VMI stays until KubeVirt
    has deleted the pods it controls (``deleteAllMatchingPods``), turns ``Succeeded``, and then lets it go. Deleted
    with orphan propagation, the garbage collector first takes the VMI's controller reference off its pods, which
    stay."""
    await sim.create_vm("t", "vm1", memory="512Mi", run_strategy="Once")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    assert VMI_FINALIZER in vmi["metadata"]["finalizers"]
    (pod,) = await sim.launcher_pods("t", "vm1")
    seen: list[tuple[str, str, str]] = []
    sim.store.on_change(
        lambda t, r, o: (
            seen.append((r.plural, t, str((o.get("status") or {}).get("phase") or "")))
            if r.plural in ("pods", "virtualmachineinstances")
            else None
        )
    )
    await sim.store.delete(sim.store.resource("vmi"), "t", "vm1")
    await sim.wait_for(lambda: sim.peek("vmi", "t", "vm1") is None, what="the VMI let go")
    order = [(kind, t, ph) for kind, t, ph in seen if t == "DELETED" or ph == "Succeeded"]
    assert order[0][:2] == ("pods", "DELETED") and order[-1] == ("virtualmachineinstances", "DELETED", "Succeeded")
    assert sim.peek("pods", "t", pod["metadata"]["name"]) is None
    await sim.create_vm("t", "vm2", memory="512Mi", run_strategy="Once")
    await sim.wait_for_phase("t", "vm2", "Running")
    (kept,) = await sim.launcher_pods("t", "vm2")
    await sim.store.delete(sim.store.resource("vmi"), "t", "vm2", propagation="Orphan")
    await sim.wait_for(lambda: sim.peek("vmi", "t", "vm2") is None, what="the VMI let go")
    after = sim.peek("pods", "t", kept["metadata"]["name"])
    assert after is not None and "ownerReferences" not in after["metadata"] and phase(after) == "Running"


async def test_a_deleted_vmi_whose_pod_a_finalizer_holds_is_final_and_its_pod_ends_after_its_grace(
    sim: SimCluster,
) -> None:
    """A finalizer of the tenant's on the launcher pod keeps the pod, not the guest: the deleted VMI turns final once
    its pods are deleted (virt-handler shut the domain down), the kubelet ends the pod at the end of its grace period,
    and KubeVirt lets the VMI go once the pod is gone."""
    await sim.create_vm("t", "vm1", memory="512Mi", run_strategy="Once")
    await sim.wait_for_phase("t", "vm1", "Running")
    (pod,) = await sim.launcher_pods("t", "vm1")
    pods = sim.store.resource("pods")
    name = pod["metadata"]["name"]
    await sim.store.patch(pods, "t", name, {"metadata": {"finalizers": ["example.com/hold"]}}, "merge")
    await sim.store.delete(sim.store.resource("vmi"), "t", "vm1")
    vmi = await sim.wait_until("vmi", "t", "vm1", lambda o: phase(o) == "Succeeded")
    assert vmi["metadata"].get("deletionTimestamp") and VMI_FINALIZER in vmi["metadata"]["finalizers"]
    await sim.wait_until("pods", "t", name, lambda o: phase(o) == "Succeeded")
    await sim.store.patch(pods, "t", name, {"metadata": {"finalizers": None}}, "merge")
    await sim.wait_for(lambda: sim.peek("vmi", "t", "vm1") is None, what="the VMI let go")


async def test_a_gated_pod_is_not_scheduled_until_its_gates_go(sim: SimCluster) -> None:
    """The scheduler leaves a pod with scheduling gates alone (``PodScheduled=False``, ``SchedulingGated``), and its
    binding is refused; once its gates are removed it is bound and runs."""
    pods = sim.store.resource("pods")
    gated: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated", "namespace": "t"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "schedulingGates": [{"name": "example.com/wait"}]},
    }
    await sim.create(gated)
    held = await sim.wait_until(
        "pods",
        "t",
        "gated",
        lambda o: any(c.get("reason") == "SchedulingGated" for c in o["status"].get("conditions", [])),
    )
    assert "nodeName" not in held["spec"] and held["status"]["phase"] == "Pending"
    with pytest.raises(ApiError) as err:
        await sim.store.bind(pods, "t", "gated", "node01")
    assert err.value.code == 409 and "has non-empty .spec.schedulingGates" in err.value.message
    await sim.store.patch(pods, "t", "gated", {"spec": {"schedulingGates": None}}, "merge")
    await sim.wait_until("pods", "t", "gated", lambda o: o["status"].get("phase") == "Running")


async def test_a_migration_of_a_vmi_that_does_not_run_yet_waits_for_it(sim: SimCluster) -> None:
    """virt-api admits a migration of any VMI that is not final (``migration-create-admitter``, v1.9.0), and the
    migration controller creates its target only once the VMI runs; a finished VMI's migration is refused."""
    sim.kubevirt.schedulable = set()  # (the launcher pod waits for a node)
    await sim.create_vm("t", "vm1", memory="512Mi", run_strategy="Once")
    await sim.wait_for_phase("t", "vm1", "Scheduling")
    await sim.migrate("t", "vm1", name="early")
    await sim.wait_for_phase("t", "early", "Pending", kind="vmim")
    await sim.wait_quiet()
    assert len(await sim.launcher_pods("t", "vm1")) == 1, "no target while the VMI does not run"
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.wait_for_phase("t", "early", "Succeeded", kind="vmim")
    await sim.wait_until(  # (upstream's updateStatus takes KubeVirt's finalizer off every final migration)
        "vmim", "t", "early", lambda o: MIGRATION_FINALIZER not in (o["metadata"].get("finalizers") or [])
    )
    await sim.store.delete(sim.store.resource("vmi"), "t", "vm1")
    await sim.create(created_vmi("done", namespace="t"))
    await sim.wait_for_phase("t", "done", "Running")
    await sim.store.mutate(
        sim.store.resource("vmi"), "t", "done", lambda o: {**o, "status": {"phase": "Succeeded"}}, status=True
    )
    with pytest.raises(ApiError) as err:
        await sim.migrate("t", "done")
    assert err.value.code == 400 and "Cannot migrate VMI in finalized state." in err.value.message


async def test_kubevirt_does_not_put_back_a_migration_finalizer_someone_took_off(sim: SimCluster) -> None:
    """Only the webhook adds the finalizer, at creation; upstream's migration controller only removes it. A
    migration whose finalizer was taken off goes at once when deleted (what the reservation guard keeps tenants
    from doing where a quota is managed: ``tests/integration/test_sim_policy.py -k finalizer_off``)."""
    await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})  # (no room for a target: it stays Pending)
    await sim.create_vm("t", "vm1", memory="512Mi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.migrate("t", "vm1", name="mig1")
    vmims = sim.store.resource("vmim")
    taken = await sim.store.patch(vmims, "t", "mig1", {"metadata": {"finalizers": None}}, "merge")
    await sim.wait_until(
        "vmim", "t", "mig1", lambda o: o["metadata"]["resourceVersion"] != taken["metadata"]["resourceVersion"]
    )  # (KubeVirt synced the migration since: it wrote its refusal or its phase)
    await sim.wait_quiet()
    assert not (await sim.get("vmim", "t", "mig1"))["metadata"].get("finalizers")
    await sim.store.delete(vmims, "t", "mig1")
    assert sim.peek("vmim", "t", "mig1") is None


async def test_a_migrations_spec_and_its_vmi_label_are_kept_while_it_runs(sim: SimCluster) -> None:
    """virt-api's ``migration-update-admitter`` (v1.9.0) refuses any change of a migration's spec, from anyone, and
    of its ``kubevirt.io/vmi-name`` label while the migration is not final."""
    await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})  # (no room for a target: it stays Pending)
    await sim.create_vm("t", "vm1", memory="512Mi")
    await sim.create_vm("t", "vm2", memory="128Mi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.wait_for_phase("t", "vm2", "Running")
    await sim.migrate("t", "vm1", name="mig1")
    vmims = sim.store.resource("vmim")
    for change, words in [
        ({"spec": {"vmiName": "vm2"}}, "update of Migration object's spec is restricted"),
        ({"metadata": {"labels": {"kubevirt.io/vmi-name": None}}}, "can't be removed from an in-flight migration"),
        ({"metadata": {"labels": {"kubevirt.io/vmi-name": "vm2"}}}, "can't be modified on an in-flight migration"),
    ]:
        with pytest.raises(ApiError) as err:
            await sim.store.patch(vmims, "t", "mig1", change, "merge")
        assert err.value.code == 422 and words in err.value.message, err.value.message
    kept = await sim.store.patch(vmims, "t", "mig1", {"metadata": {"labels": {"other": "x"}}}, "merge")
    assert kept["spec"]["vmiName"] == "vm1" and kept["metadata"]["labels"]["kubevirt.io/vmi-name"] == "vm1"


async def test_a_migration_deleted_before_its_hand_off_is_canceled_and_its_target_pod_deleted(
    sim: SimCluster,
) -> None:
    """KubeVirt's migration controller fails a migration deleted before it handed the VMI off to the target and
    deletes the target pod it created (``handlePreHandoffMigrationCancel``); its finalizer goes once the migration is
    final. The target does not wait on after its migration is gone."""
    await sim.create_vm("t", "vm1", memory="512Mi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    sim.kubevirt.schedulable = {vmi["status"]["nodeName"]}  # (the target finds no node: it stays Pending)
    await sim.migrate("t", "vm1", name="mig1")
    await sim.wait_for_phase("t", "mig1", "Scheduling", kind="vmim")
    (target,) = [p for p in await sim.launcher_pods("t", "vm1") if p["status"].get("phase") == "Pending"]
    seen: list[Obj] = []
    sim.store.on_change(lambda t, r, o: seen.append(o) if r.plural == "virtualmachineinstancemigrations" else None)
    await sim.store.delete(sim.store.resource("vmim"), "t", "mig1")
    await sim.wait_for(lambda: sim.peek("vmim", "t", "mig1") is None, what="the migration let go")
    assert any(o["status"].get("phase") == "Failed" and o["metadata"].get("deletionTimestamp") for o in seen)
    assert sim.peek("pods", "t", target["metadata"]["name"]) is None, "the canceled migration's target is deleted"
    assert [p["status"]["phase"] for p in await sim.launcher_pods("t", "vm1")] == ["Running"]


async def test_a_migration_deleted_after_its_hand_off_is_aborted_and_the_vmi_stays_on_its_source(
    sim: SimCluster,
) -> None:
    """Deleting a migration KubeVirt handed off aborts it unless the domain has moved already: the migration
    controller marks it ``AbortRequested``, and once it runs asks for the abort in the VMI's migration state
    (``markMigrationAbortInVmiStatus``); virt-handler aborts, the migration fails, the target pod goes, and the VMI
    runs on on its source."""
    await sim.create_vm("t", "vm1", memory="512Mi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    source = vmi["status"]["nodeName"]
    sim.kubevirt.timing = dataclasses.replace(
        sim.kubevirt.timing, migration_step=10.0
    )  # (each phase after hand-off, times the speed)
    seen: list[Obj] = []
    sim.store.on_change(lambda t, r, o: seen.append(o) if r.plural == "virtualmachineinstancemigrations" else None)
    await sim.migrate("t", "vm1", name="mig1")

    def handed_off_to() -> str:
        return str(
            ((sim.peek("vmi", "t", "vm1") or {}).get("status", {}).get("migrationState") or {}).get("targetPod") or ""
        )

    await sim.wait_for(lambda: bool(handed_off_to()), what="the hand-off")
    target = handed_off_to()
    await sim.store.delete(sim.store.resource("vmim"), "t", "mig1")
    await sim.wait_for(lambda: sim.peek("vmim", "t", "mig1") is None, what="the migration let go")
    after = await sim.get("vmi", "t", "vm1")
    state = after["status"]["migrationState"]
    assert state["abortRequested"] and state["abortStatus"] == "Succeeded" and state["failed"], state
    assert after["status"]["nodeName"] == source and after["status"]["phase"] == "Running"
    asked = [o["status"].get("phase") for o in seen if has_condition(o, "AbortRequested")]
    assert asked[0] != "Running" and "Running" in asked, f"asked in {asked}: it went on until it ran"
    assert sim.peek("pods", "t", target) is None, "the aborted migration's target is deleted"
    assert [p["status"]["phase"] for p in await sim.launcher_pods("t", "vm1")] == ["Running"]


async def test_target_pod_that_cannot_start_fails_the_migration(sim: SimCluster) -> None:
    await sim.create_vm("t", "vm1", memory="1Gi")
    vmi = await sim.wait_for_phase("t", "vm1", "Running")
    await sim.migrate("t", "vm1", name="mig1", target_fails=True)
    failed = await sim.wait_for_phase("t", "mig1", "Failed", kind="vmim")
    assert [p["phase"] for p in failed["status"]["phaseTransitionTimestamps"]] == ["Pending", "Scheduling", "Failed"]
    after = await sim.get("vmi", "t", "vm1")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["nodeName"] == vmi["status"]["nodeName"]
    [reason] = [e["message"] for e in await sim.events("t", "mig1", reason="FailedMigration")]
    assert "target pod" in reason
    pods = await sim.launcher_pods("t", "vm1")
    assert [p["status"]["phase"] for p in pods if FAIL_START_ANNOTATION not in p["metadata"]["annotations"]] == [
        "Running"
    ]


async def test_kubevirt_webhooks_refuse_bad_objects_naming_the_field(sim: SimCluster) -> None:
    both = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "both", "namespace": "t"},
        "spec": {
            "running": True,
            "runStrategy": "Always",
            "template": {"spec": {"domain": {"memory": {"guest": "1Gi"}}}},
        },
    }
    with pytest.raises(ApiError) as err:
        await sim.create(both)
    assert err.value.code == 422
    assert "Running and RunStrategy are mutually exclusive" in err.value.message
    with pytest.raises(ApiError) as err:
        await sim.create_vm("t", "badmem", memory="lots")
    assert err.value.code == 422
    assert "VirtualMachine t/badmem: spec.template.spec.domain.memory.guest" in err.value.message
    with pytest.raises(ApiError) as err:
        await sim.migrate("t", "ghost")
    assert err.value.code == 400 and "does not exist" in err.value.message  # (virt-api's ToAdmissionResponseError)
    await sim.create_vm("t", "vm1", memory="1Gi")
    await sim.wait_for_phase("t", "vm1", "Running")
    await sim.migrate("t", "vm1", name="first", annotations={FAIL_START_ANNOTATION: "true"})
    with pytest.raises(ApiError, match="in-flight migration detected"):
        await sim.migrate("t", "vm1", name="second")


async def test_a_new_vmi_carries_kubevirts_defaults_before_validating_admission() -> None:
    """virt-api's mutating webhook sets a new VMI's defaults before any validating admission sees it (the
    rendering-model policy reads them): requests.cpu from limits.cpu, the cluster's cpuRequest when it is not 100m,
    the guest memory from the memory request, and the CPU topology from the CPU limit (after those requests)."""

    def vmi(name: str, domain: Obj) -> Obj:
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": "t"},
            "spec": {"domain": domain},
        }

    seen: list[Obj] = []

    async def look(op: str, res: Any, new: Obj | None, old: Obj | None, sub: str | None = None) -> None:
        if op == "CREATE" and new is not None:
            seen.append(copy.deepcopy(new["spec"]["domain"]))

    async with SimCluster(speed=SPEED, serve_http=False, kubevirt_configuration={"cpuRequest": "250m"}) as s:
        await s.create_namespace("t")
        s.store.add_admission(s.store.resource("VirtualMachineInstance"), look, first=True)  # (a validating one)
        await s.create(vmi("limited", {"resources": {"limits": {"cpu": "3"}, "requests": {"memory": "2Gi"}}}))
        await s.create(vmi("flat", {"memory": {"guest": "1Gi"}}))
        await s.create(vmi("sized", {"cpu": {"cores": 2, "threads": 0}, "memory": {"guest": "1Gi"}}))
        await s.create(vmi("wide", {"cpu": {"sockets": 100, "cores": 2}, "memory": {"guest": "1Gi"}}))
    limited, flat, sized, wide = seen
    assert limited["resources"]["requests"] == {"memory": "2Gi", "cpu": "3"}
    assert limited["memory"]["guest"] == "2Gi"
    # (and under the LiveUpdate rollout strategy, hotplug maxima: four times the sockets and the guest memory)
    assert limited["cpu"] == {"sockets": 3, "cores": 1, "threads": 1, "maxSockets": 12}
    assert limited["memory"] == {"guest": "2Gi", "maxGuest": "8Gi"}
    assert flat["resources"]["requests"] == {"cpu": "250m"}  # (the cluster's flat request)
    assert flat["cpu"] == {"sockets": 1, "cores": 1, "threads": 1, "maxSockets": 4}
    assert sized["cpu"] == {"cores": 2}  # (a topology that is set is kept; zeros are dropped; no sockets, no maximum)
    assert wide["cpu"]["maxSockets"] == 256  # (at most 512 vCPUs)


async def test_workqueue_backoff_doubles_and_is_capped() -> None:
    timing = KubeVirtTiming(speed=1.0, backoff_base=0.005, backoff_cap=0.04)
    async with SimCluster(serve_http=False, kubevirt_timing=timing) as sim:
        q = sim.kubevirt.vmi_queue
        delays = [q.add_rate_limited(("x", "y")) for _ in range(6)]
        assert delays == [0.005, 0.01, 0.02, 0.04, 0.04, 0.04]
        q.forget(("x", "y"))
        assert q.backoff(("x", "y")) == 0.005


def _kubectl() -> str | None:
    return shutil.which("kubectl")


async def _read_line(proc: asyncio.subprocess.Process, within: float) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout=within)
    return line.decode()


async def test_vmquota_simulate_serves_kubectl_until_interrupted(tmp_path: Path) -> None:
    seed = tmp_path / "seed.yaml"
    seed.write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: tenant-a}\n---\n"
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: vm1, namespace: tenant-a}\n"
        "spec: {running: true, template: {spec: {domain: {memory: {guest: 1Gi}, devices: {}}}}}\n"
    )
    kubeconfig = tmp_path / "kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli.main",
        "simulate",
        "--speed",
        "0.05",
        "--seed-file",
        str(seed),
        "--kubeconfig-out",
        str(kubeconfig),
        "--log-level",
        "warning",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        info = json.loads(await _read_line(proc, 20))
        assert info["kubeconfig"] == str(kubeconfig) and info["url"].startswith("https://127.0.0.1:")
        kubectl = _kubectl()
        if kubectl is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            phase = ""
            while phase != "Running":
                assert loop.time() < deadline, "VMI did not reach Running through kubectl"
                out = await asyncio.create_subprocess_exec(
                    kubectl, "--kubeconfig", str(kubeconfig), "get", "vmi", "-n", "tenant-a", "vm1",
                    "-o", "jsonpath={.status.phase}",
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                stdout, _ = await out.communicate()
                phase = stdout.decode().strip()
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), timeout=20)
    assert code == 0


async def test_vmquota_simulate_bad_seed_exits_2_with_one_line(tmp_path: Path) -> None:
    seed = tmp_path / "bad.yaml"
    seed.write_text("kind: Gadget\nmetadata: {name: x}\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli.main", "simulate", "--seed-file", str(seed), "--log-level", "error",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert lines == ["vmquota simulate: seed[0].kind: the simulated cluster does not serve kind 'Gadget'"]
