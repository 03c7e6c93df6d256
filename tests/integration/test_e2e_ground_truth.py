"""Ground truth: at every quiescent point, the ledger's latest usage snapshot on the bus
(``vmquota.usage.<cluster>.<namespace>``) agrees with the simulated cluster itself:

* its pod usage ``P`` equals what the Kubernetes quota evaluator charges the pods in the simulator's store
  (``shared.podusage.pod_quota_usage``), and the simulator's quota controller's ``status.used``;
* the VMs it reports running are exactly the VMIs that run, none is left admitted-but-pending, no migration open;
* ``spec.hard`` carries the equation's value the snapshot reports.

Checked after start, migration, hotplug, stop and a plain pod's deletion, in two namespaces (VmiPodUsage and the
ratio mode).
"""

from __future__ import annotations

import asyncio

from services.devtools.simcluster.kubevirt import phase
from shared.quantity import ZERO
from shared.resources import format_resource_list, nonzero, parse_resource_list
from tests.integration.e2e import Pipeline, pipeline, plain_pod

POD = "tenant-pod"
RATIO = "tenant-ratio"
QUOTA = "compute"


def disagreements(p: Pipeline, ns: str) -> list[str]:
    """Where the ledger's latest snapshot of ``ns`` and the simulator differ (empty: they agree)."""
    snap = p.tap.usage.get(ns)
    if snap is None:
        return ["no usage snapshot yet"]
    out: list[str] = []
    terms = snap.quotas.get(QUOTA)
    if terms is None:
        return [f"no terms for quota {QUOTA}"]
    pods = nonzero(parse_resource_list(terms.pods, "pods"))
    truth = nonzero(p.pod_usage(ns))
    if pods != truth:
        out.append(f"P {format_resource_list(pods)} != pods in the store {format_resource_list(truth)}")
    q = p.quota(ns, QUOTA)
    status_used = parse_resource_list((q.get("status") or {}).get("used"), "status.used")
    on_hard = {r: pods.get(r, ZERO) for r in status_used}
    if on_hard != status_used:
        out.append(f"P {format_resource_list(on_hard)} != status.used {format_resource_list(status_used)}")
    running = {v.name for v in snap.vms if v.state == "running"}
    if running != p.running_vmis(ns):
        out.append(f"running VMs {sorted(running)} != running VMIs {sorted(p.running_vmis(ns))}")
    pending = [v.name for v in snap.vms if v.state == "admitted"]
    if pending:
        out.append(f"VMs still admitted but not running: {pending}")
    if snap.migrations:
        out.append(f"open migrations: {[m.name for m in snap.migrations]}")
    if terms.reserved:
        out.append(f"reservations left: {terms.reserved}")
    hard = parse_resource_list(terms.hard, "hard")
    if p.hard(ns, QUOTA) != hard:
        out.append(
            f"spec.hard {format_resource_list(p.hard(ns, QUOTA))} != the snapshot's {format_resource_list(hard)}"
        )
    return out


def quiet(p: Pipeline) -> bool:
    """The cluster has nothing in progress: no controller work, no unfinished migration, every VMI settled."""
    if not p.sim.idle():
        return False
    for ns in (POD, RATIO):
        if any(phase(m) not in ("Succeeded", "Failed") for m in p.objects("vmim", ns)):
            return False
        if any(phase(v) not in ("Running", "Pending") for v in p.objects("vmi", ns)):
            return False
    return True


async def agree(p: Pipeline, step: str) -> None:
    """At the next quiescent point the ledger agrees with the simulator in both namespaces."""
    try:
        await p.wait(lambda: quiet(p) and not disagreements(p, POD) and not disagreements(p, RATIO), step)
    except TimeoutError as e:
        raise AssertionError(f"{e}: {POD}: {disagreements(p, POD)}; {RATIO}: {disagreements(p, RATIO)}") from None
    assert quiet(p)


async def test_usage_snapshots_match_the_simulator_at_every_quiescent_point() -> None:
    async with pipeline(cpu_allocation_ratio=4) as p:
        await p.managed_quota(
            POD,
            QUOTA,
            {"requests.cpu": "8", "limits.cpu": "16", "requests.memory": "40Gi", "limits.memory": "80Gi", "pods": "10"},
        )
        await p.managed_quota(
            RATIO,
            QUOTA,
            {"requests.cpu": "3", "limits.cpu": "12", "requests.memory": "24Gi", "limits.memory": "32Gi"},
            mode="VirtualResourcesWithCPUAllocationRatio",
        )
        await asyncio.gather(
            p.start_vm(POD, "vm1", sockets=2, memory="4Gi", limits={"memory": "4Gi", "cpu": "2"}),
            p.start_vm(POD, "vm2", sockets=1, memory="2Gi"),
            p.start_vm(RATIO, "vm1", sockets=4, memory="8Gi"),
            p.start_vm(RATIO, "vm2", sockets=2, memory="4Gi"),
        )
        # (the VMs accounted and the quotas in effect first: the plain pods got in only while they raced the room
        # held for a VM's launcher pod KubeVirt was refused, and were refused once it was gone (one run in eight
        # here); KubeVirt's automatic memory limits charge a launcher pod twice its guest memory or so, and the
        # limits.memory budget of the ratio namespace leaves room for a plain pod beside both VMs)
        await agree(p, "the VMs started")
        await p.wait(lambda: all(p.in_effect(ns, QUOTA) for ns in (POD, RATIO)), "the quotas in effect")
        for ns in (POD, RATIO):
            await p.sim.create(plain_pod(ns, "web", {"cpu": "250m", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}))
        await agree(p, "after start")

        migs = await asyncio.gather(p.migrate(POD, "vm1"), p.migrate(RATIO, "vm1"))
        await p.wait_migrated(POD, "vm1", migs[0])
        await p.wait_migrated(RATIO, "vm1", migs[1])
        await agree(p, "after the migrations")

        await p.sim.hotplug(POD, "vm2", sockets=2)
        await p.sim.hotplug(RATIO, "vm2", memory="6Gi")
        await p.wait(lambda: all(len(p.objects("vmim", ns)) == 2 for ns in (POD, RATIO)), "the hotplug migrations")
        await agree(p, "after the hotplugs")
        assert {v.name: v.counts[QUOTA].get("limits.memory") for v in p.tap.usage[RATIO].vms} == {
            "vm1": "8Gi",
            "vm2": "6Gi",
        }

        await p.sim.set_running(POD, "vm1", False)
        await p.sim.set_running(RATIO, "vm2", False)
        await agree(p, "after the stops")
        assert p.running_vmis(POD) == {"vm2"} and p.running_vmis(RATIO) == {"vm1"}

        for ns in (POD, RATIO):
            await p.sim.store.delete(p.sim.store.resource("pods"), ns, "web")
        await agree(p, "after deleting the plain pods")
