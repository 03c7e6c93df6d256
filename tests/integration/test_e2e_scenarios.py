"""End to end: the simulated KubeVirt cluster, a real nats-server and the watcher, ledger and enforcer.

The seed scenarios (DESIGN.md section 5) are played without vmquota (plain Kubernetes quota: the migration stays
Pending, refused by quota) and with it (the migration succeeds, ``spec.hard`` comes back exactly). Then concurrent
and hotplug migrations, admission in VM terms in a mixed namespace, and budget changes (annotation edited
mid-migration, a foreign write to ``spec.hard``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest

from services.devtools.demo.play import play
from services.devtools.demo.scenario import builtin_scenarios
from services.devtools.simcluster.kubevirt import KubeVirtTiming, phase
from services.devtools.simcluster.store_api import ApiError
from shared.quantity import Quantity
from shared.quota.enforcement import BUDGET_CHANGED
from shared.resources import ResourceList, add, format_resource_list, parse_resource_list
from shared.times import parse_rfc3339
from tests.integration.e2e import (
    INJECT,
    PATIENT_KUBEVIRT,
    SPEED,
    WITHIN,
    Pipeline,
    full_namespace,
    install_sidecar_injector,
    on,
    pipeline,
    plain_pod,
    rl,
)

SCENARIOS = {s.name: s for s in builtin_scenarios()}


# ---- 1. the seed scenarios, without and with vmquota ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_seed_scenario_without_vmquota_shows_the_problem(name: str) -> None:
    sc = SCENARIOS[name]
    result = await play(sc, with_vmquota=False, speed=SPEED, settle=0.5, within=WITHIN)
    for key, q in result.quotas.items():
        assert q.hard_after == q.budget, f"{key}: plain quota must stay as written"
        assert q.hard_max == q.budget, f"{key}: nothing may raise a plain quota"
    assert result.refusals, "Kubernetes quota refused nothing"
    assert all("exceeded quota" in r for r in result.refusals)
    vm_names = {v.name for v in sc.vms if v.running}
    if all(result.vms[v] == "Running" for v in vm_names):
        # Scenarios 1 and 2: the VMs run; the migration target pod is refused by quota and the migration waits.
        for vm, m in result.migrations.items():
            assert m.phase not in ("Succeeded", "Failed"), f"migration of {vm} ended: {m.phase}"
            assert m.admitted is None, f"the target pod of {vm} was admitted"
            assert m.quota_refusals >= 1, f"no quota refusal seen for the migration of {vm}"
        quota_name = sc.namespaces[0].quotas[0].name
        assert any(f"exceeded quota: {quota_name}, requested: " in r for r in result.refusals)
        assert any("limits.memory=" in r.split("requested: ", 1)[1] for r in result.refusals)
    else:
        # Scenario 3: VMs that fit the budget in VM terms do not all start: their pods carry KubeVirt's overhead.
        assert name == "allocation-ratio"
        refused = [v for v in ("vm1", "vm2", "vm3") if result.vms[v] != "Running"]
        assert refused, "all three VMs started natively although their overhead exceeds the budget"
        assert all(result.vms[v] == "Refused" for v in refused)
    assert not result.passed, "the plain run must not meet the scenario's expectations"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_seed_scenario_with_vmquota_migrates_and_restores_hard(name: str) -> None:
    sc = SCENARIOS[name]
    result = await play(sc, with_vmquota=True, speed=SPEED, settle=0.5, within=WITHIN)
    assert result.passed, result.failures
    assert result.migrations, "the scenario migrated nothing"
    for vm, m in result.migrations.items():
        assert m.phase == "Succeeded", f"migration of {vm}: {m.phase}"
        assert m.admitted is not None, f"the target pod of {vm} was never created"
    for key, q in result.quotas.items():
        assert q.hard_after == q.hard_before, (
            f"{key}: hard was {format_resource_list(q.hard_before)} before the migration, "
            f"{format_resource_list(q.hard_after)} after"
        )
        assert any(q.hard_max[r] > q.hard_before[r] for r in q.hard_before), f"{key}: hard was never raised"
        if sc.namespaces[0].quotas[0].mode == "VmiPodUsage":
            assert q.hard_before == q.budget, f"{key}: at rest, VmiPodUsage must keep hard == budget"


# ---- 2. concurrent and hotplug migrations ------------------------------------------------------------------------


@pytest.mark.parametrize("guard", [False, True], ids=["without_the_guard", "with_the_guard"])
async def test_a_vm_with_a_hotplugged_volume_migrates_where_less_than_a_launcher_pod_is_left(guard: bool) -> None:
    """KubeVirt migrates a VMI with hotplugged volumes only once an attachment pod runs beside the target; once the
    target exists ``hard`` holds no room for the source pod, so in a namespace with less than a launcher pod of its
    budget left that attachment pod was refused and the migration (a node drain's) never went on. vmquota now
    reserves it (with the guard, the target pod is its holder)."""
    ns = "tenant"
    async with pipeline(guard=guard) as p:
        await full_namespace(p, ns)
        await p.sim.attach_volume(ns, "vm1")
        await p.wait(lambda: p.tap.terms(ns, "compute") is not None, "usage")
        name = await p.migrate(ns, "vm1")
        await p.wait_migrated(ns, "vm1", name)
        owned = [(o, r) for o in p.pods(ns) for r in o["metadata"].get("ownerReferences", [])]
        targets = {t["metadata"]["uid"] for t in p.target_pods(ns, name)}
        attached = [o for o, r in owned if r.get("kind") == "Pod" and r.get("uid") in targets]
        assert [o["metadata"]["labels"]["kubevirt.io"] for o in attached] == ["hotplug-disk"]
        await p.wait_hard(ns, "compute", rl({"limits.memory": "64Gi"}), "hard back to the budget")


@pytest.mark.parametrize("guard", [False, True], ids=["without_the_guard", "with_the_guard"])
async def test_a_drain_beside_a_migrating_vm_with_a_hotplugged_volume_gets_room_at_once(guard: bool) -> None:
    """(liveness) A namespace exactly at its budget (the tenant's plain pod takes the room quota leaves) migrates
    vm1, which has a hotplugged volume: its target's attachment pod gets into room reserved for it beyond the budget.
    A node drain's migration of vm2 then got no room until vm1's migration ended: the attachment pod, charged as a
    plain pod and created during vm1's refusal, looked like a pod that took a target's room in a namespace over its
    budget by it (on a real cluster KubeVirt waits for that pod to be ready, for as long as that takes). The room
    held for it is not counted against the drain now."""
    ns = "tenant"
    slow = KubeVirtTiming(
        speed=SPEED, migration_step=60.0
    )  # (vm1's migration runs on for seconds once it has its pods)
    async with pipeline(guard=guard, kubevirt_timing=slow) as p:
        await full_namespace(p, ns)
        await p.sim.attach_volume(ns, "vm1")
        await p.wait(lambda: p.in_effect(ns, "compute"), "hard in effect")
        await p.sim.wait_quiet()
        status = p.quota(ns, "compute")["status"]
        room = rl(status["hard"])["limits.memory"] - rl(status["used"])["limits.memory"]
        await p.sim.create(plain_pod(ns, "filler", {"cpu": "10m", "memory": "64Mi"}, {"memory": str(room)}))
        first = await p.migrate(ns, "vm1")

        def attached() -> bool:
            targets = {t["metadata"]["uid"] for t in p.target_pods(ns, first)}
            return any(r.get("uid") in targets for o in p.pods(ns) for r in o["metadata"].get("ownerReferences", []))

        await p.wait(attached, "vm1's target's attachment pod")
        drain = await p.migrate(ns, "vm2")

        def reserved_or_over() -> bool:
            usage = p.tap.usage.get(ns)
            states = {m.name: m.state for m in usage.migrations} if usage is not None else {}
            return states.get(drain) in ("pending", "target-created") or phase(p.migration(ns, first)) == "Succeeded"

        await p.wait(reserved_or_over, "room for the drain, or vm1's migration over", within=120)
        assert phase(p.migration(ns, first)) != "Succeeded", "the drain got room only once vm1's migration ended"
        await p.wait_migrated(ns, "vm2", drain)


@pytest.mark.parametrize("guard", [False, True], ids=["without_the_guard", "with_the_guard"])
async def test_a_vm_whose_pods_a_webhook_enlarges_migrates_at_full_use(guard: bool) -> None:
    """vm1's launcher pods get an 8Gi proxy from a sidecar injector (half its guest memory: beyond the evidence
    bound of vmquota's rendering). The namespace is used to its budget, and vm1 migrates (a node drain): its target
    gets the proxy too, and vmquota now reserves the source pod's charge for it. Before, it reserved the rendering
    and ignored the refusals' larger amounts: the migration was refused for as long as the namespace stayed full."""
    ns = "tenant"
    async with pipeline(guard=guard) as p:
        install_sidecar_injector(p, "8Gi")
        await p.managed_quota(ns, "compute", {"limits.memory": "64Gi"})
        await p.start_vm(ns, "vm1", memory="16Gi", limits={"memory": "16Gi"}, labels={INJECT: "true"})
        await asyncio.gather(*(p.start_vm(ns, f"vm{i}", memory="16Gi", limits={"memory": "16Gi"}) for i in (2, 3)))
        await p.wait_hard(ns, "compute", rl({"limits.memory": "64Gi"}))
        status = p.quota(ns, "compute")["status"]
        left = rl(status["hard"])["limits.memory"] - rl(status["used"])["limits.memory"]
        fill = await p.sim.create(plain_pod(ns, "fill", {"memory": "64Mi"}, {"memory": str(left)}))
        created = parse_rfc3339(fill["metadata"]["creationTimestamp"])
        assert created is not None
        # (a pod created in the migration's second counts as created after it, which the room is not held against)
        await p.wait(lambda: datetime.now(UTC) >= created + timedelta(seconds=1), "the next second")
        name = await p.migrate(ns, "vm1")
        await p.wait_migrated(ns, "vm1", name)
        (target,) = p.launcher_pods(ns, "vm1")
        assert [c["name"] for c in target["spec"]["containers"]][-1] == "istio-proxy"
        await p.wait_hard(ns, "compute", rl({"limits.memory": "64Gi"}), "hard back to the budget")


async def test_concurrent_migrations_of_a_fully_used_namespace() -> None:
    async with pipeline() as p:
        ns = "tenant-many"
        await p.managed_quota(ns, "compute", {"limits.memory": "10Gi", "limits.cpu": "6"})
        vms = [f"vm{i}" for i in range(4)]
        await asyncio.gather(*(p.start_vm(ns, v, memory="2Gi", limits={"memory": "2Gi", "cpu": "1"}) for v in vms))
        await p.wait_hard(ns, "compute", p.quotas[(ns, "compute")])
        before = p.hard(ns, "compute")
        used = p.pod_usage(ns)
        free = before["limits.memory"] - used["limits.memory"]
        one_pod = p.pod_usage(ns)["limits.memory"].scale(Fraction(1, 4))
        assert free < one_pod, "the namespace must be too full for even one target pod natively"

        names = await asyncio.gather(*(p.migrate(ns, v) for v in vms))
        await asyncio.gather(*(p.wait_migrated(ns, v, m) for v, m in zip(vms, names, strict=True)))
        await p.wait_hard(ns, "compute", before, "hard to return after four concurrent migrations")
        assert all(phase(p.migration(ns, m)) == "Succeeded" for m in names)
        # (a decision reaches the bus after its write: the last may come to the tap after hard is back)
        await p.wait(
            lambda: len([d for d in p.tap.decisions if d.namespace == ns and d.hard_after != d.hard_before]) >= 2,
            "at least one raise and one return decision",
        )


def ratio_terms(vcpus: int, guest: str, ratio: int) -> ResourceList:
    """What a VM counts in VirtualResourcesWithCPUAllocationRatio (the quota's budget resources)."""
    mem = Quantity.parse(guest)
    return {
        "requests.cpu": Quantity.from_int(vcpus).scale(Fraction(1, ratio)),
        "limits.cpu": Quantity.from_int(vcpus),
        "requests.memory": mem,
        "limits.memory": mem,
    }


def expected_hard(budget: ResourceList, used: ResourceList, pods: ResourceList) -> ResourceList:
    """The quota equation at rest (nothing reserved, nothing migrating; k = 1: the quota's ratio is KubeVirt's),
    with every VM's launcher pod charged at least what the VM counts (KubeVirt's rendering adds overhead): every
    pod takes its charge from the budget (``W = P``), so ``hard = P + B - W`` is the budget, whatever ``U`` and
    ``P`` are (``used`` and ``pods``: what the namespace holds, for the message)."""
    return dict(budget)


def terms_used(p: Pipeline, ns: str, quota: str) -> ResourceList:
    terms = p.tap.terms(ns, quota)
    assert terms is not None, f"no usage snapshot for {ns}/{quota}"
    return parse_resource_list(terms.used, "used")


async def settled_at(p: Pipeline, ns: str, q: str, want_used: ResourceList, what: str) -> None:
    """Until the ledger's U (on the budget's resources) is ``want_used``, nothing is reserved or migrating, and
    ``spec.hard`` is the equation over the simulator's own pod usage, in effect."""
    b = p.quotas[(ns, q)]

    def settled() -> bool:
        t = p.tap.terms(ns, q)
        if t is None or t.reserved or p.tap.usage[ns].migrations:
            return False
        used = on(parse_resource_list(t.used, "used"), b)
        return (
            used == want_used and p.hard(ns, q) == expected_hard(b, want_used, p.pod_usage(ns)) and p.in_effect(ns, q)
        )

    try:
        await p.wait(settled, what)
    except TimeoutError as e:
        got = format_resource_list(on(terms_used(p, ns, q), b)) if p.tap.terms(ns, q) else "(no snapshot)"
        raise AssertionError(
            f"{e}: U={got} (want {format_resource_list(want_used)}), hard={format_resource_list(p.hard(ns, q))}, "
            f"want {format_resource_list(expected_hard(b, want_used, p.pod_usage(ns)))}"
        ) from None


async def test_hotplug_migrations_resize_the_vm_in_mode_terms() -> None:
    ratio = 4
    async with pipeline(cpu_allocation_ratio=ratio) as p:
        ns, q = "tenant-hot", "vm-budget"
        budget = {"requests.cpu": "2", "limits.cpu": "8", "requests.memory": "12Gi", "limits.memory": "12Gi"}
        await p.managed_quota(ns, q, budget, mode="VirtualResourcesWithCPUAllocationRatio")
        await p.start_vm(ns, "vma", sockets=2, memory="4Gi")
        await p.start_vm(ns, "vmb", sockets=2, memory="4Gi")

        def vms(sizes: dict[str, tuple[int, str]]) -> ResourceList:
            total: ResourceList = {}
            for vcpus, guest in sizes.values():
                total = add(total, ratio_terms(vcpus, guest, ratio))
            return total

        async def check(sizes: dict[str, tuple[int, str]], what: str) -> None:
            await settled_at(p, ns, q, vms(sizes), what)

        await check({"vma": (2, "4Gi"), "vmb": (2, "4Gi")}, "usage before hotplug")

        await p.sim.hotplug(ns, "vma", sockets=4)
        await p.wait(lambda: len(p.objects("vmim", ns)) == 1, "the workload-update migration")
        (mig,) = [str(m["metadata"]["name"]) for m in p.objects("vmim", ns)]
        await p.wait_migrated(ns, "vma", mig)
        assert p.sim.peek("vmi", ns, "vma")["spec"]["domain"]["cpu"]["sockets"] == 4  # type: ignore[index]
        await check({"vma": (4, "4Gi"), "vmb": (2, "4Gi")}, "usage after the sockets hotplug")

        await p.sim.hotplug(ns, "vmb", memory="8Gi")
        await p.wait(
            lambda: any(
                (m["spec"] or {}).get("vmiName") == "vmb" and phase(m) == "Succeeded" for m in p.objects("vmim", ns)
            ),
            "the memory hotplug migration of vmb",
        )
        await p.wait(lambda: len(p.launcher_pods(ns, "vmb")) == 1, "the source pod of vmb to go")
        await check({"vma": (4, "4Gi"), "vmb": (2, "8Gi")}, "usage after the memory hotplug")
        # The budget is now fully used in memory: a 1Gi VM does not fit and Kubernetes refuses it.
        await p.sim.create_vm(ns, "vmc", sockets=1, memory="1Gi")
        await p.wait(lambda: bool(p.quota_refusals(ns, "vmc")), "Kubernetes to refuse vmc")
        assert p.vmi_phase(ns, "vmc") != "Running"


# ---- 3. admission in VM terms; a mixed namespace ------------------------------------------------------------------


async def test_vm_terms_admission_in_a_mixed_namespace() -> None:
    ratio = 4
    async with pipeline(cpu_allocation_ratio=ratio) as p:
        ns, q = "tenant-mixed", "vm-budget"
        budget = {"requests.cpu": "2", "limits.cpu": "8", "requests.memory": "10Gi", "limits.memory": "10Gi"}
        await p.managed_quota(ns, q, budget, mode="VirtualResourcesWithCPUAllocationRatio")
        b = rl(budget)
        web = rl({"requests.cpu": "500m", "limits.cpu": "2", "requests.memory": "4Gi", "limits.memory": "4Gi"})
        # (explicit memory limits, as Harvester sets them: without one KubeVirt's automatic limit is twice the
        # launcher pod's request, and a running VM takes its pod's charge of the budget, so less would be left
        # for plain pods; VMs are admitted in VM terms either way)
        await p.start_vm(ns, "vm1", sockets=4, memory="4Gi", limits={"memory": "4Gi"})
        await settled_at(p, ns, q, ratio_terms(4, "4Gi", ratio), "vm1 accounted")
        # A plain pod takes its pod usage out of the same budget, 1:1.
        await p.sim.create(plain_pod(ns, "web", {"cpu": "500m", "memory": "4Gi"}, {"cpu": "2", "memory": "4Gi"}))
        await settled_at(p, ns, q, add(ratio_terms(4, "4Gi", ratio), web), "the plain pod accounted")
        # vm2 fills the budget exactly in VM terms; its launcher pod is charged more (overhead), and it starts.
        await p.start_vm(ns, "vm2", sockets=2, memory="2Gi", limits={"memory": "2Gi"})
        assert p.pod_usage(ns)["limits.memory"] > b["limits.memory"], "the pods must be charged above the budget"
        used = add(add(ratio_terms(4, "4Gi", ratio), ratio_terms(2, "2Gi", ratio)), web)
        assert used == b
        await settled_at(p, ns, q, used, "U to equal the budget")

        # vm3 does not fit in VM terms: Kubernetes itself refuses its launcher pod; the ledger reports it refused.
        await p.sim.create_vm(ns, "vm3", sockets=1, memory="1Gi", limits={"memory": "1Gi"})

        def vm3_refused() -> bool:
            snap = p.tap.usage.get(ns)
            states = {v.name: v.state for v in snap.vms} if snap else {}
            return states.get("vm3") == "refused" and bool(p.quota_refusals(ns, "vm3"))

        await p.wait(vm3_refused, "vm3 to be refused")
        await settled_at(p, ns, q, used, "vm3 refused, U unchanged")
        assert p.vmi_phase(ns, "vm3") != "Running"
        # A plain pod does not get in either: the budget is used.
        with pytest.raises(ApiError) as refused:
            await p.sim.create(
                plain_pod(ns, "extra", {"cpu": "10m", "memory": "64Mi"}, {"cpu": "10m", "memory": "64Mi"})
            )
        assert refused.value.code == 403 and "exceeded quota" in refused.value.message

        # Stopping vm2 frees 2Gi in VM terms: vm3 (1Gi) is admitted in creation order and starts.
        await p.sim.set_running(ns, "vm2", False)
        await p.sim.wait_for_phase(ns, "vm3", "Running", within=WITHIN)
        await p.wait(lambda: p.vmi_phase(ns, "vm2") == "" and len(p.launcher_pods(ns, "vm2")) == 0, "vm2 to stop")
        used = add(add(ratio_terms(4, "4Gi", ratio), ratio_terms(1, "1Gi", ratio)), web)
        await settled_at(p, ns, q, used, "hard to follow the budget after vm2 stopped and vm3 started")


# ---- 4. budget changes ---------------------------------------------------------------------------------------------


async def test_budget_annotation_edited_mid_migration() -> None:
    # Slow migration phases (0.5 s each) so the edit lands while the target pod runs next to the source.
    async with pipeline(kubevirt_timing=KubeVirtTiming(speed=SPEED, migration_step=10.0)) as p:
        ns = "tenant-budget"
        await full_namespace(p, ns)
        mig = await p.migrate(ns, "vm1")

        def target_accounted() -> bool:
            # The target pod exists, the ledger counts it in P (no reservation left) and hard is the ledger's.
            terms = p.tap.terms(ns, "compute")
            snap = p.tap.usage.get(ns)
            if terms is None or snap is None or terms.reserved or not p.target_pods(ns, mig):
                return False
            states = {m.name: m.state for m in snap.migrations}
            return states.get(mig) == "target-created" and p.hard(ns, "compute") == rl(terms.hard)

        await p.wait(target_accounted, "the target pod, accounted")
        raised = p.hard(ns, "compute")
        # room for one launcher pod per VM once the target exists: the end of the source pod frees nothing
        assert raised == rl({"limits.memory": "64Gi"})
        assert phase(p.migration(ns, mig)) not in ("Succeeded", "Failed"), "the migration ended too soon"

        await p.set_budget(ns, "compute", {"limits.memory": "72Gi"})
        # VmiPodUsage: B - U >= 0 before and after, so hard moves by exactly the budget change.
        await p.wait_hard(ns, "compute", {"limits.memory": raised["limits.memory"] + Quantity.parse("8Gi")})
        assert phase(p.migration(ns, mig)) not in ("Succeeded", "Failed"), "the edit did not land mid-migration"

        await p.wait_migrated(ns, "vm1", mig)
        await p.wait_hard(ns, "compute", rl({"limits.memory": "72Gi"}), "hard to settle at the new budget")
        assert p.budget(ns, "compute") == rl({"limits.memory": "72Gi"})
        await p.wait(
            lambda: any(d.namespace == ns and d.budget == {"limits.memory": "72Gi"} for d in p.tap.decisions),
            "a decision with the new budget",
        )
        await p.wait(lambda: bool(p.quota_events(ns, "compute", BUDGET_CHANGED)), "a BudgetChanged event")


@pytest.mark.parametrize("guard", [False, True], ids=["without_the_guard", "with_the_guard"])
async def test_a_budget_lowered_below_what_runs_mid_migration_still_migrates_beside_a_pod_made_since(
    guard: bool,
) -> None:
    """A tenant's small pod created just after a migration, in room the budget left (not the room held for the
    target), then an administrator lowering the budget below what runs while the target is reserved: the namespace
    is over its budget for the administrator's reason, and the migration still gets its room. Before, the pod's
    creation after the migration held it back for as long as the pod ran (a VM's pod would run for good)."""
    async with pipeline(kubevirt_timing=PATIENT_KUBEVIRT, guard=guard) as p:
        ns = "tenant-lowered-mid-migration"
        await full_namespace(p, ns)
        room = p.hard(ns, "compute")["limits.memory"] - p.pod_usage(ns)["limits.memory"]
        fill = format_resource_list({"memory": room - Quantity.parse("64Mi")})
        await p.sim.create(plain_pod(ns, "filler", fill, fill))
        mig = await p.migrate(ns, "vm1")
        await p.sim.create(plain_pod(ns, "small", {"memory": "32Mi"}, {"memory": "32Mi"}))

        def reserved() -> bool:
            snap = p.tap.usage.get(ns)
            return snap is not None and any(m.name == mig and m.state == "pending" for m in snap.migrations)

        await p.wait(reserved, "room reserved for the target")
        await p.set_budget(ns, "compute", {"limits.memory": "60Gi"})
        await p.wait_migrated(ns, "vm1", mig)
        assert any(o["metadata"]["name"] == "small" for o in p.objects("pods", ns)), "the small pod ran throughout"


async def test_foreign_write_to_spec_hard_becomes_the_budget() -> None:
    async with pipeline() as p:
        ns = "tenant-foreign"
        await full_namespace(p, ns)
        await p.sim.set_quota_hard(ns, "compute", {"limits.memory": "96Gi"})
        await p.wait(lambda: p.budget(ns, "compute") == rl({"limits.memory": "96Gi"}), "the new budget")
        await p.wait(lambda: bool(p.quota_events(ns, "compute", BUDGET_CHANGED)), "a BudgetChanged event")
        event = p.quota_events(ns, "compute", BUDGET_CHANGED)[-1]
        assert event["type"] == "Warning" and "outside vmquota" in event["message"]

        def reported() -> bool:
            return any(
                d.namespace == ns
                and d.quota == "compute"
                and d.budget == {"limits.memory": "96Gi"}
                and "outside vmquota" in d.reason
                for d in p.tap.decisions
            )

        await p.wait(reported, "a decision reporting the foreign write")
        # The new budget is enforced: a migration still succeeds and hard comes back to it.
        mig = await p.migrate(ns, "vm2")
        await p.wait_migrated(ns, "vm2", mig)
        await p.wait_hard(ns, "compute", rl({"limits.memory": "96Gi"}))
        assert p.last_hard(ns, "compute") == rl({"limits.memory": "96Gi"})
