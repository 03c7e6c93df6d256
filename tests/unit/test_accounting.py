"""Per-namespace accounting: U, P, S, admissions and migrations, on DESIGN's seed scenarios and edge cases.

The object builders at the top are shared with ``test_equation.py`` (property tests) and ``test_cli_usage.py``.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Final

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import contract
from shared.accounting.memo import Memo
from shared.accounting.namespace import account_namespace, account_view, by_kind
from shared.accounting.results import (
    ADMITTED,
    CANCEL,
    GROWTH_REFUSED,
    LAUNCHER,
    MIGRATION_TARGET,
    NON_VM,
    NOT_TRIED,
    ORPHAN_LAUNCHER,
    PENDING,
    QUEUED,
    REFUSED,
    RUNNING,
    STOPPED,
    TARGET_CREATED,
    WAITING,
    MigrationEntry,
    NamespaceUsage,
)
from shared.accounting.sums import Sum
from shared.errors import InvalidInput
from shared.kubevirt import KubeVirtConfig, NamespaceFacts
from shared.kubevirt.command import set_launcher_command
from shared.ledger.fold import Ledger, NamespaceState
from shared.ledger.schedule import Urgency, Urgent, schedule, urgency
from shared.normalize import normalize
from shared.quantity import Quantity
from shared.quota.modes import Mode, QuotaPolicy
from shared.resources import ResourceList, canonical_resource_list, fits, format_resource_list, parse_resource_list
from shared.snapshot import (
    MIGRATION_JOB_LABEL,
    SNAPSHOT_TYPES,
    AnySnapshot,
    QuotaSnapshot,
    VmimSnapshot,
    VmiSnapshot,
)
from shared.vmi import GUARD_REFUSER, VM_TERMS_REFUSER
from tests.builders import (
    NOW,
    NS,
    T0,
    account,
    account_history,
    deleted,
    facts_for,
    folded,
    hard_of,
    launcher_obj,
    pod_obj,
    published,
    quota_obj,
    refusal_event,
    refused_vmi,
    rendered_usage,
    snaps,
    ts,
    usage_of,
    vmi_obj,
    vmim_obj,
    vouch,
)
from tests.fold_events import attaching_of

Q = Quantity.parse


def vm(u: NamespaceUsage, name: str) -> Any:
    return next(e for e in u.vms if e.name == name)


def full_64gi() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """A ``VmiPodUsage`` quota of ``limits.memory: 64Gi`` and three running 16Gi VMs with their launcher pods."""
    facts = facts_for(["limits.memory"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    return quota_obj("rq", {"limits.memory": "64Gi"}), vmis, [launcher_obj(v, facts=facts) for v in vmis]


def mig(u: NamespaceUsage, name: str) -> Any:
    return next(e for e in u.migrations if e.name == name)


# ---- DESIGN seed scenario 1: Harvester's 64Gi limits.memory, three 16Gi VMs, one migrates -----------------------


def test_a_running_vmi_whose_pod_is_not_in_view_keeps_hard_and_reserves_nothing() -> None:
    """The ledger sees a VMI's update before its pod's event (or KubeVirt names the pod in ``status.activePods``
    late, or the pod ended and the VMI is about to finish): the VM counts in ``U`` at its rendering, nothing is
    reserved for it (KubeVirt creates no pod for a VMI past Pending) and ``hard`` is what it is with the pod in
    view: room for the pod if it is charged, none for a pod that ended."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)
    facts = facts_for(["limits.memory"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    pods = [launcher_obj(v, facts=facts) for v in vmis]
    seen = account([quota, *vmis, *pods])
    lagging = account([quota, *vmis, *pods[1:]])
    assert hard_of(lagging) == hard_of(seen)
    e = vm(lagging, "vm0")
    assert e.state == RUNNING and not e.reserved
    assert lagging.quotas["rq"].used["limits.memory"] == seen.quotas["rq"].used["limits.memory"]
    late = vmi_obj("late", guest="16Gi", limits={"memory": "16Gi"}, t=9, phase="Pending")
    assert vm(account([quota, *vmis, *pods[1:], late]), "late").state == ADMITTED  # (64Gi: it fits)
    extra = vmi_obj("extra", guest="1Gi", limits={"memory": "1Gi"}, t=10, phase="Pending")
    assert vm(account([quota, *vmis, *pods[1:], late, extra]), "extra").state == REFUSED


def test_a_target_whose_reserved_room_a_later_pod_took_holds_no_room_again() -> None:
    """Without the reservation guard, room held for a migration's target is open to any pod: a tenant's pod created
    after the migration can take it. vmquota then holds no room for that target again while the namespace is over
    its budget with such pods (else each raise could be taken again); a namespace over its budget with older pods
    (its budget lowered, say) still migrates."""
    quota, vmis, pods = full_64gi()
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    assert mig(account([quota, *vmis, *pods, migration]), "m1").state == PENDING
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "30Gi"}, t=101)  # (took the reserved room)
    held = mig(account([quota, *vmis, *pods, migration, grab]), "m1")
    assert held.state == WAITING and not held.reserved and "taken by another pod" in held.reason
    older = pod_obj("older", {"memory": "1Gi"}, {"memory": "30Gi"}, t=50)  # over budget, but not since
    assert mig(account([quota, *vmis, *pods, migration, older]), "m1").state == PENDING


@pytest.mark.parametrize("later", ["after", "same second"])
def test_a_pod_created_after_a_migration_in_room_the_budget_left_does_not_hold_it_back_once_the_budget_is_lowered(
    later: str,
) -> None:
    """A pod created after a migration (or in its second) that took room the budget left, not the room reserved for
    the target, and then an administrator's lowering of the budget below what runs: the namespace is over its budget
    for the administrator's reason, and the migration still gets its room (it waited for good before, while that
    pod ran: a VM's pod runs for good). A pod created once the budget is lowered still counts as taking the room."""
    quota, vmis, pods = full_64gi()
    filler = pod_obj("filler", {"memory": "1Gi"}, {"memory": "15Gi"}, t=50)
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    small = pod_obj("small", {"memory": "32Mi"}, {"memory": "32Mi"}, t=101 if later == "after" else 100)
    base = [quota, *vmis, *pods, filler, migration]
    assert mig(account_history([*base, small]), "m1").state == PENDING, "the small pod took the budget's room"
    lowered = quota_obj("rq", {"limits.memory": "64Gi"}, budget={"limits.memory": "60Gi"})
    held = mig(account_history([*base, small, lowered]), "m1")
    assert held.state == PENDING and held.reserved, held
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "8Gi"}, t=102)  # (created once the budget is lowered)
    taken = mig(account_history([*base, small, lowered, grab]), "m1")
    assert taken.state == WAITING and "taken by another pod" in taken.reason, taken


@pytest.mark.parametrize("order", ["recreated, then the pod created after it", "the pod folded first"])
def test_a_budget_lowered_by_replacing_the_quota_settles_what_was_created_before_it_as_an_edit_does(order: str) -> None:
    """As above, with the administrator lowering the budget by replacing the quota (a delete and a create: ``kubectl
    replace --force``, a GitOps tool's): a new uid, so no edit of a policy; the migration waited for as long as the
    pod that took the budget's room ran, node drains included. A managed quota's creation settles what was created
    before it (its creation time, the API server's, however late its first version is folded); a pod created after
    it still counts as taking the room."""
    quota, vmis, pods = full_64gi()
    filler = pod_obj("filler", {"memory": "1Gi"}, {"memory": "15Gi"}, t=50)
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    small = pod_obj("small", {"memory": "32Mi"}, {"memory": "32Mi"}, t=101)
    base = [quota, *vmis, *pods, filler, migration, small]
    lowered = quota_obj("rq", {"limits.memory": "64Gi"}, budget={"limits.memory": "60Gi"})
    meta = {**lowered["metadata"], "uid": "rq-rq-2", "creationTimestamp": ts(104)}
    recreated = {**lowered, "metadata": meta}
    held = mig(account_history([*base, deleted(quota), recreated]), "m1")
    assert held.state == PENDING and held.reserved, held
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "8Gi"}, t=106)  # (created once the quota is replaced)
    history = (
        [*base, deleted(quota), recreated, grab]
        if order.startswith("recreated")
        else [*base, deleted(quota), grab, recreated]
    )
    taken = mig(account_history(history), "m1")
    assert taken.state == WAITING and "taken by another pod" in taken.reason, taken


@pytest.mark.parametrize("late", ["pod", "migration", "both"])
def test_a_budget_lowered_settles_what_was_created_before_it_whatever_is_folded_after_it(late: str) -> None:
    """The same as above, with the pod's creation (or the migration's refused first version, or both) folded after
    the administrator's change: the watches of two kinds are in no order. The change settled only what was folded
    before it, the pod was then marked as created in the refusal, and the migration waited for as long as the pod
    ran. What was created before the change (its event published at 105 s here) is settled whenever it is folded;
    a pod created after it still counts as taking the room."""
    quota, vmis, pods = full_64gi()
    filler = pod_obj("filler", {"memory": "1Gi"}, {"memory": "15Gi"}, t=50)
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    small = pod_obj("small", {"memory": "32Mi"}, {"memory": "32Mi"}, t=101)
    lowered = published(quota_obj("rq", {"limits.memory": "64Gi"}, budget={"limits.memory": "60Gi"}), 105)
    before = [quota, *vmis, *pods, filler] + ([] if late in ("migration", "both") else [migration])
    after = ([] if late == "pod" else [migration]) + ([small] if late in ("pod", "both") else [])
    if late == "migration":
        before.append(small)
    held = mig(account_history([*before, lowered, *after]), "m1")
    assert held.state == PENDING and held.reserved, held
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "8Gi"}, t=106)  # (created once the budget is lowered)
    taken = mig(account_history([*before, lowered, *after, grab]), "m1")
    assert taken.state == WAITING and "taken by another pod" in taken.reason, taken


def test_pods_created_in_the_second_a_budget_change_was_published_are_not_settled() -> None:
    """The budget is lowered and the watcher publishes the change at 105.4 s (its clock); vmquota holds room for the
    refused target under the new policy within that second. A pod's creation time is to the second: pods the tenant
    created in the rest of that second were stamped 105 s, before the publish time, and settled, so each took the
    room and it was held again (three 8Gi pods in one target's room, 28Gi over 60Gi). What a change settles ends a
    second before the second it was published in."""
    quota, vmis, pods = full_64gi()
    filler = pod_obj("filler", {"memory": "1Gi"}, {"memory": "15Gi"}, t=50)
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    lowered = published(quota_obj("rq", {"limits.memory": "64Gi"}, budget={"limits.memory": "60Gi"}), 105.4)
    history: list[dict[str, Any]] = [quota, *vmis, *pods, filler, migration, lowered]
    first = mig(account_history(history), "m1")
    assert first.state == PENDING and first.reserved, first
    grabs = 0
    for i in range(3):
        history.append(pod_obj(f"grab{i}", {"memory": "1Gi"}, {"memory": "8Gi"}, t=105))
        grabs += 1
        if mig(account_history(history), "m1").state == WAITING:
            break
    assert grabs == 1, f"{grabs} pods of 8Gi took the room held for one target"


def _drained_later(
    hotplugged: bool, o_rendered: KubeVirtConfig | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], KubeVirtConfig]:
    """A ``VmiPodUsage`` namespace sized for its two VMs and an app pod: ``v`` (whose drain a test asks for later)
    and ``o`` (``hotplugged``: with a hotplugged volume; its pod rendered with ``o_rendered``, by default the
    memory overhead KubeVirt is changed to later). Returns the quota, the VMs and their pods, VMI ``o``, its pod, and
    that later configuration, under which ``v``'s target renders larger: the namespace over its budget for no
    tenant's reason."""
    plain, ratio = KubeVirtConfig(), KubeVirtConfig(additional_guest_memory_overhead_ratio="2.0")
    v = vmi_obj("v", guest="1Gi")
    source = launcher_obj(v, config=plain, facts=NamespaceFacts())
    o = vmi_obj("o", guest="8Gi", t=5)
    if hotplugged:
        o["status"]["volumeStatus"] = [{"name": "data", "hotplugVolume": {"attachPodName": "hp-volume-src"}}]
    o_pod = launcher_obj(o, config=o_rendered or ratio, facts=NamespaceFacts(), suffix="o")
    budget = usage_of(o_pod)["requests.memory"] + usage_of(source)["requests.memory"] + Q("264Mi")
    quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    return [quota, v, source, o, o_pod], o, o_pod, ratio


def _drain_after_a_resize(during: str) -> Any:
    """A full ``VmiPodUsage`` namespace: VM ``o`` migrates with no refusal (no room is held for it), and an app pod
    is resized in place, inside the budget, ``during`` its migration (``running``; ``queued``: the migration Pending
    with no target, as KubeVirt's parallel-migration limits keep one in a drain, VM ``o`` with a hotplugged volume)
    or before it (""). The migration ends. Later a KubeVirt change of the memory overhead drains VM ``v``, whose size
    did not change: its target renders larger, the namespace over its budget for no tenant's reason."""
    objects, _, _, ratio = _drained_later(hotplugged=during == "queued")
    app, grown = pod_obj("app", {"memory": "100Mi"}, t=10), pod_obj("app", {"memory": "200Mi"}, t=10)
    phase = "Pending" if during == "queued" else "Running"
    running, done = vmim_obj("m0", "o", t=100, phase=phase), vmim_obj("m0", "o", t=100, phase="Succeeded")
    history = [*objects, app]
    history += [running, grown] if during else [grown, running]
    history += [done, deleted(done), vmim_obj("drain", "v", t=300, rejected=True)]
    return mig(account_history(history, config=ratio), "drain")


@pytest.mark.parametrize("during", ["running", "queued"])
def test_a_resize_during_a_migration_no_room_was_held_for_holds_no_later_drain_back(during: str) -> None:
    """A pod that grows while any migration is active was marked as one that took a migration's room: an app pod
    resized (a vertical autoscaler) during a migration no room was held for held a later drain back, in a namespace
    over its budget for KubeVirt's reason, for as long as the app ran; and so, marked while a migration of a VM with
    hotplugged volumes was Pending, did one resized while that migration waited with no target. Growth is marked in a
    refusal, or while room may be held for a hotplug attachment pod, its target running
    (``test_..._resized_into_an_attachment_...``)."""
    assert _drain_after_a_resize("").state == PENDING
    drain = _drain_after_a_resize(during)
    assert drain.state == PENDING, f"{drain.state}: {drain.reason}"


def test_seed_1_migration_at_full_use_succeeds_and_hard_comes_back() -> None:
    quota = quota_obj("rq", {"limits.memory": "64Gi"})
    facts = facts_for(["limits.memory"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    pods = [launcher_obj(v, facts=facts) for v in vmis]
    before = account([quota, *vmis, *pods])
    assert hard_of(before) == {"limits.memory": "64Gi"}  # B - U + P with U == P: nothing to change
    assert [vm(before, f"vm{i}").state for i in range(3)] == [RUNNING] * 3

    tried = vmim_obj("m1", "vm0")  # KubeVirt has not tried yet (or holds it back): no room is held for it
    assert mig(account([quota, *vmis, *pods, tried]), "m1").state == NOT_TRIED
    migration = vmim_obj("m1", "vm0", rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    p = usage_of(target)
    # without vmquota the target is refused (the published failure: requested limits.memory=17...)
    assert fits(p, before.quotas["rq"].pods, {"limits.memory": Q("64Gi")}) == ["limits.memory"]

    pending = account([quota, *vmis, *pods, migration])
    m = mig(pending, "m1")
    assert m.state == PENDING and m.reserved == usage_of(pods[0])
    q = pending.quotas["rq"]
    assert q.reserved == m.reserved and q.used == before.quotas["rq"].used
    assert fits(p, q.pods, q.hard) == []  # the target gets in

    running = account([quota, *vmis, *pods, migration, target])
    assert mig(running, "m1").state == TARGET_CREATED
    assert running.quotas["rq"].reserved == {}
    assert {e.name: e.role for e in running.pods}[target["metadata"]["name"]] == MIGRATION_TARGET

    # migration done: the VMI moved, the source pod finished and was deleted
    vmis_after = [vmi_obj("vm0", guest="16Gi", limits={"memory": "16Gi"}, node="n2"), *vmis[1:]]
    vouch(vmis_after[0], target)
    vouch(vmis_after[0], pods[0])  # (KubeVirt lists every pod it controls, terminal ones too)
    done_migration = vmim_obj("m1", "vm0", phase="Succeeded")
    source_done = dict(pods[0], status={"phase": "Succeeded"})
    finishing = account([quota, *vmis_after, source_done, *pods[1:], done_migration, target])
    assert hard_of(finishing)["limits.memory"] == hard_of(before)["limits.memory"]
    after = account([quota, *vmis_after, *pods[1:], done_migration, target])
    assert hard_of(after) == hard_of(before)

    # and a fourth VM is refused, by the ledger and by native admission alike
    vm4 = vmi_obj("vm4", guest="16Gi", limits={"memory": "16Gi"}, t=500, phase="Pending")
    with4 = account([quota, *vmis, *pods, vm4])
    assert vm(with4, "vm4").state == REFUSED and "limits.memory" in vm(with4, "vm4").reason
    q4 = with4.quotas["rq"]
    assert fits(usage_of(launcher_obj(vm4, facts=facts)), q4.pods, q4.hard) == ["limits.memory"]


# ---- DESIGN seed scenario 2: 3000m / 4000Mi limits, two small VMs migrate at once -------------------------------


def test_seed_2_two_concurrent_migrations_succeed_and_quota_is_restored() -> None:
    hard = {"limits.cpu": "3000m", "limits.memory": "4000Mi"}
    quota = quota_obj("rq", hard)
    facts = facts_for(hard)
    vm1 = vmi_obj("vm1", guest="1Gi", limits={"cpu": "1", "memory": "1Gi"})
    vm2 = vmi_obj("vm2", guest="2Gi", limits={"cpu": "1", "memory": "2Gi"}, t=1)
    p1, p2 = launcher_obj(vm1, facts=facts), launcher_obj(vm2, facts=facts)
    base = [quota, vm1, vm2, p1, p2]
    before = account(base)
    assert hard_of(before) == format_resource_list(parse_resource_list(hard))

    m1, m2 = vmim_obj("m1", "vm1", rejected=True), vmim_obj("m2", "vm2", t=101, rejected=True)
    t1 = launcher_obj(vm1, facts=facts, migration_uid="mig-m1", node="n2", t=200)
    t2 = launcher_obj(vm2, facts=facts, migration_uid="mig-m2", node="n2", t=201)
    both = account([*base, m1, m2])
    q = both.quotas["rq"]
    assert fits(usage_of(t1), q.pods, q.hard) == [] and fits(usage_of(t2), q.pods, q.hard) == []
    one = account([*base, m1, m2, t1])  # the first target exists; the second must still fit
    q = one.quotas["rq"]
    assert fits(usage_of(t2), q.pods, q.hard) == []
    assert fits(usage_of(t2), q.pods, parse_resource_list(hard)) != []  # it would not without vmquota

    vm1b, vm2b = (
        vmi_obj(v["metadata"]["name"], guest=g, limits=lim, node="n2", t=i)
        for i, (v, g, lim) in enumerate(
            [(vm1, "1Gi", {"cpu": "1", "memory": "1Gi"}), (vm2, "2Gi", {"cpu": "1", "memory": "2Gi"})]
        )
    )
    vouch(vm1b, t1)
    vouch(vm2b, t2)
    after = account(
        [quota, vm1b, vm2b, t1, t2, vmim_obj("m1", "vm1", phase="Succeeded"), vmim_obj("m2", "vm2", phase="Succeeded")]
    )
    assert hard_of(after) == hard_of(before)


# ---- DESIGN seed scenario 3: ratio mode, tenants size by sockets and guest memory only ---------------------------


@pytest.mark.parametrize("kubevirt_ratio", [4, 10])
def test_seed_3_ratio_mode_admits_by_vm_size_and_migrates_at_full_use(kubevirt_ratio: int) -> None:
    budget = {"requests.cpu": "2", "limits.cpu": "8", "requests.memory": "8Gi", "limits.memory": "8Gi"}
    quota = quota_obj("rq", budget, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, ratio="4")
    config = KubeVirtConfig(cpu_allocation_ratio=Fraction(kubevirt_ratio))
    facts = facts_for(budget)
    vms = [vmi_obj(f"vm{i}", vcpus=4, guest="4Gi", t=i) for i in range(2)]
    pods = [launcher_obj(v, config=config, facts=facts) for v in vms]
    full = account([quota, *vms, *pods], config=config)
    q = full.quotas["rq"]
    assert format_resource_list(q.used)["requests.cpu"] == "2"  # 2 x 4 vCPUs / 4
    assert format_resource_list(q.used)["requests.memory"] == "8Gi"  # guest memory, overhead notwithstanding
    assert q.over_budget == ()
    assert q.factors["requests.cpu"] == min(Fraction(1), Fraction(4, kubevirt_ratio))

    vm3 = vmi_obj("vm3", vcpus=1, guest="1Gi", t=10, phase="Pending")
    with3 = account([quota, *vms, *pods, vm3], config=config)
    assert vm(with3, "vm3").state == REFUSED
    q3 = with3.quotas["rq"]
    assert fits(usage_of(launcher_obj(vm3, config=config, facts=facts)), q3.pods, q3.hard) != []

    target = launcher_obj(vms[1], config=config, facts=facts, migration_uid="mig-m", node="n2", t=50)
    migrating = account([quota, *vms, *pods, vmim_obj("m", "vm1", rejected=True)], config=config)
    qm = migrating.quotas["rq"]
    assert fits(usage_of(target), qm.pods, qm.hard) == []


def test_ratio_mode_small_vm_fits_in_a_half_used_budget() -> None:
    budget = {"requests.cpu": "2", "requests.memory": "8Gi"}
    quota = quota_obj("rq", budget, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, ratio="4")
    running = vmi_obj("vm0", vcpus=4, guest="4Gi")
    small = vmi_obj("vm1", vcpus=4, guest="4Gi", t=5, phase="Pending")
    u = account([quota, running, launcher_obj(running), small])
    assert vm(u, "vm1").state == ADMITTED
    q = u.quotas["rq"]
    assert format_resource_list(q.used)["requests.cpu"] == "2"
    assert q.reserved == {}, "no room is held before KubeVirt is refused the pod"
    # its pod (still to be created) is refused natively (it carries overhead the budget left no room for); refused,
    # it is reserved, and the reservation is in hard
    assert fits(usage_of(launcher_obj(small)), q.pods, q.hard) != []
    u = account([quota, running, launcher_obj(running), refused_vmi(small)])
    q = u.quotas["rq"]
    assert q.reserved == rendered_usage(small, KubeVirtConfig(), NamespaceFacts())
    assert fits(usage_of(launcher_obj(small)), q.pods, q.hard) == []


# ---- admission order, reservations, refusal amounts ---------------------------------------------------------------


def test_pending_vms_are_admitted_in_creation_order_regardless_of_input_order() -> None:
    quota = quota_obj("rq", {"requests.cpu": "3", "requests.memory": "100Gi"}, Mode.VIRTUAL_RESOURCES)
    a = vmi_obj("a", vcpus=2, t=10, phase="Pending")
    b = vmi_obj("b", vcpus=2, t=20, phase="Pending")
    c = vmi_obj("c", vcpus=1, t=30, phase="Pending")
    objs = [quota, a, b, c]
    for seed in range(5):
        shuffled = objs[:]
        random.Random(seed).shuffle(shuffled)
        u = account(shuffled)
        assert [(e.name, e.state) for e in u.vms] == [("a", ADMITTED), ("b", REFUSED), ("c", ADMITTED)]
        assert "quota rq (VirtualResources): requests.cpu needs 2 but 1 of 3 is left" in vm(u, "b").reason
    b_first = account([quota, a | {"metadata": {**a["metadata"], "creationTimestamp": ts(40)}}, b, c])
    assert [e.state for e in b_first.vms] == [ADMITTED, ADMITTED, REFUSED]  # order: b, c, a


def test_refusal_amounts_replace_the_estimate_for_a_pending_vm() -> None:
    quota = quota_obj("rq", {"limits.memory": "64Gi"})
    v = refused_vmi(vmi_obj("v", guest="4Gi", t=10, phase="Pending"))
    est = rendered_usage(v, KubeVirtConfig(), facts_for(["limits.memory"]))
    old = refusal_event("v", {"limits.memory": "1"}, t=5)  # before the VMI existed: another incarnation
    larger = est["limits.memory"] + Q("100Mi")  # (KubeVirt rendered more than vmquota: within the bound)
    exact = refusal_event("v", {"limits.memory": str(larger)}, t=20)
    u = account([quota, v, old, exact])
    assert vm(u, "v").state == ADMITTED
    r = u.quotas["rq"].reserved
    assert r["limits.memory"] == larger
    assert r["requests.memory"] == est["requests.memory"]
    assert "quota refusal" in vm(u, "v").reason
    # an amount below the estimate lowers nothing (the pod it was for may have been rendered from an older spec)
    smaller = refusal_event("v", {"limits.memory": str(est["limits.memory"] - Q("100Mi"))}, t=20)
    assert account([quota, v, smaller]).quotas["rq"].reserved["limits.memory"] == est["limits.memory"]


def test_refusal_amounts_after_the_migration_correct_its_target_estimate() -> None:
    quota = quota_obj("rq", {"limits.memory": "64Gi"})
    facts = facts_for(["limits.memory"])
    v = vmi_obj("v", guest="4Gi")
    pod = launcher_obj(v, facts=facts)
    before_migration = refusal_event("v", {"limits.memory": "1"}, t=50)
    during = refusal_event("v", {"limits.memory": "9Gi"}, t=150)
    u = account([quota, v, pod, vmim_obj("m", "v", t=100, rejected=True), before_migration, during])
    m = mig(u, "m")
    assert m.state == PENDING and m.reserved["limits.memory"] == Q("9Gi")
    assert m.reserved["requests.memory"] == usage_of(pod)["requests.memory"]
    # the target is charged more than the source: that much more counts in U
    assert u.quotas["rq"].used["limits.memory"] == Q("9Gi")


@pytest.mark.parametrize("forged", ["smaller", "beyond_the_bound"])
def test_a_refusal_dated_ahead_does_not_take_the_place_of_kubevirts_amounts(forged: str) -> None:
    """KubeVirt's refusal of a drain's target says 9Gi (a webhook's container: more than vmquota's estimate, within
    the bound). The tenant adds a refusal Event on the VMI dated ahead of KubeVirt's, smaller or beyond the bound.
    When later events won, it took the place of KubeVirt's amounts: the target had room for the estimate only, and
    KubeVirt's 9Gi pod was refused for as long as the Event was kept."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"})
    v = vmi_obj("v", guest="4Gi")
    pod = launcher_obj(v, facts=facts_for(["limits.memory"]))
    kubevirts = refusal_event("v", {"limits.memory": "9Gi"}, t=150)
    amount = {"smaller": "8Gi", "beyond_the_bound": "90Gi"}[forged]
    dated_ahead = refusal_event("v", {"limits.memory": amount}, t=10**8) | {"metadata": {"name": "v.forged"}}
    dated_ahead["metadata"] |= {"namespace": NS, "uid": "ev-forged", "creationTimestamp": ts(160)}
    u = account([quota, v, pod, vmim_obj("m", "v", t=100, rejected=True), kubevirts, dated_ahead])
    m = mig(u, "m")
    assert m.state == PENDING and m.reserved["limits.memory"] == Q("9Gi"), m.reserved


def test_only_the_oldest_active_migration_of_a_vmi_reserves() -> None:
    quota = quota_obj("rq", {"requests.memory": "64Gi"})
    v = vmi_obj("v")
    objs = [quota, v, launcher_obj(v), vmim_obj("later", "v", t=300), vmim_obj("first", "v", t=200, rejected=True)]
    u = account(objs)
    assert mig(u, "first").state == PENDING and mig(u, "later").state == QUEUED
    assert u.quotas["rq"].reserved == mig(u, "first").reserved
    finished = account([quota, v, launcher_obj(v), vmim_obj("done", "v", t=100, phase="Failed")])
    assert finished.migrations == () and finished.quotas["rq"].reserved == {}


def test_migration_of_a_vmi_without_a_pod_waits() -> None:
    quota = quota_obj("rq", {"requests.memory": "64Gi"})
    u = account([quota, vmi_obj("v", phase="Pending"), vmim_obj("m", "v"), vmim_obj("ghost", "nope")])
    assert mig(u, "m").state == WAITING and mig(u, "ghost").state == WAITING
    assert vm(u, "v").state == ADMITTED  # its own launcher pod is reserved, no migration target
    assert u.quotas["rq"].reserved == vm(u, "v").reserved


def test_hotplug_growth_is_admitted_with_its_migration_and_reserved_for_the_target() -> None:
    quota = quota_obj("rq", {"requests.cpu": "100", "requests.memory": "100Gi"}, Mode.VIRTUAL_RESOURCES)
    grown = vmi_obj("v", vcpus=4, guest="4Gi", status_vcpus=2, status_guest="2Gi")
    source = launcher_obj(vmi_obj("v", vcpus=2, guest="2Gi"), vouched=False)
    vouch(grown, source)
    idle = account([quota, grown, source])
    q = idle.quotas["rq"]
    assert format_resource_list(q.used)["requests.cpu"] == "2"  # the size it runs at
    assert format_resource_list(q.used)["requests.memory"] == "2Gi"
    migrating = account([quota, grown, source, vmim_obj("m", "v", rejected=True)])
    assert format_resource_list(migrating.quotas["rq"].used)["requests.cpu"] == "4"  # growth admitted
    assert format_resource_list(migrating.quotas["rq"].used)["requests.memory"] == "4Gi"
    m = mig(migrating, "m")
    assert m.growth["requests.memory"] >= Q("2Gi") and m.growth["requests.cpu"] > Q("0")
    target = launcher_obj(grown, migration_uid="mig-m", node="n2")
    assert fits(usage_of(target), migrating.quotas["rq"].pods, migrating.quotas["rq"].hard) == []
    for r, v in usage_of(target).items():
        assert m.reserved[r] >= v, r


@pytest.mark.parametrize("mode", [Mode.VMI_POD_USAGE, Mode.VIRTUAL_RESOURCES])
def test_hotplug_growth_of_a_vm_with_explicit_resources_is_admitted_like_any(mode: Mode) -> None:
    """KubeVirt grows a VMI's explicit memory request and limit with a memory hotplug (CPU ones with a CPU hotplug):
    the growth is what the target adds over the pod the VM runs in, not zero because the explicit amounts already
    moved. 12Gi of 16Gi used, 8Gi more: refused; 2Gi more: admitted and reserved for the target. (Both failed: the
    growth read as none, so the target was reserved at its new size with nothing admitted.)"""
    quota = quota_obj("rq", {"limits.memory": "16Gi"}, mode)
    other = vmi_obj("other", guest="4Gi", limits={"memory": "4Gi"})
    before = vmi_obj("v", guest="8Gi", limits={"memory": "8Gi"})
    pods = [launcher_obj(other, suffix="o", facts=facts_for(["limits.memory"]))]
    source = launcher_obj(before, vouched=False, facts=facts_for(["limits.memory"]))
    for more, fits_in in ((8, False), (2, True)):
        grown = vmi_obj("v", guest=f"{8 + more}Gi", limits={"memory": f"{8 + more}Gi"}, status_guest="8Gi")
        vouch(grown, source)
        u = account([quota, other, *pods, grown, source, vmim_obj("m", "v", rejected=True)])
        m = mig(u, "m")
        assert (m.state == PENDING) == fits_in and (m.state == GROWTH_REFUSED) == (not fits_in), m
        if fits_in:
            target = launcher_obj(grown, migration_uid="mig-m", node="n2", facts=facts_for(["limits.memory"]))
            assert m.reserved["limits.memory"] >= usage_of(target)["limits.memory"]
            assert m.growth["limits.memory"] >= Q(f"{more}Gi")


def test_cpu_hotplug_growth_of_a_vm_with_an_explicit_cpu_request_is_admitted_like_any() -> None:
    """A CPU hotplug grows an explicit CPU request by the added vCPUs' share at the allocation ratio (1000 // 10 =
    100m each here): 2 vCPUs more is 200m more, which an 800m budget with 700m used does not have."""
    quota = quota_obj("rq", {"requests.cpu": "800m"})
    other = vmi_obj("other", requests={"cpu": "500m"})
    pods = [launcher_obj(other, suffix="o")]
    before = vmi_obj("v", vcpus=2, requests={"cpu": "200m"})
    source = launcher_obj(before, vouched=False)
    grown = vmi_obj("v", vcpus=4, requests={"cpu": "400m"}, status_vcpus=2)
    vouch(grown, source)
    u = account([quota, other, *pods, grown, source, vmim_obj("m", "v", rejected=True)])
    assert mig(u, "m").state == GROWTH_REFUSED, mig(u, "m")
    assert mig(u, "m").growth["requests.cpu"] == Q("200m")


def stale_target(budget_cpus: str) -> tuple[dict[str, Any], ...]:
    """A ``VirtualResources`` budget of ``budget_cpus`` vCPUs; vm-x runs 2 vCPUs, vm-a 1 and asks 4 (a CPU hotplug
    KubeVirt has not carried out), and a migration of vm-a whose target KubeVirt made for 1 vCPU: rendered from the
    VMI its cache had before the change, or made before the change came."""
    quota = quota_obj("rq", {"requests.cpu": budget_cpus}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    grown = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2)
    before = vmi_obj("vm-a", vcpus=1, t=2)
    source = launcher_obj(before, vouched=False)
    target = launcher_obj(before, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, source)
    vouch(grown, target)
    return quota, other, launcher_obj(other), grown, source, target, vmim_obj("m", "vm-a", phase="Scheduling")


def test_a_migration_whose_end_would_carry_out_a_hotplug_that_does_not_fit_is_canceled() -> None:
    """virt-handler gives the domain the spec's vCPUs at the end of a migration whatever its target was made for
    (``finalizeMigration``, ``hotplugCPU``): the migration of vm-a would run 6 vCPUs of guests on a budget of 4."""
    u = account(list(stale_target("4")))
    m = mig(u, "m")
    assert m.state == CANCEL, m
    assert "made for the size the VM runs at" in m.reason and "keeps running at its current size" in m.reason
    assert not m.reserved and not u.quotas["rq"].reserved


def test_a_target_the_ledger_first_saw_beside_the_grown_spec_is_canceled_all_the_same() -> None:
    """The ledger remembers a pod as made for its VMI's spec as it first saw it with the pod: the stale target,
    created after the hotplug, is remembered as made for 4 vCPUs, which is no evidence that the VM ran at them
    before; what it runs at is judged without the target."""
    quota, other, other_pod, grown, source, target, migration = stale_target("5")
    before = vmi_obj("vm-a", vcpus=1, t=2)
    vouch(before, source)
    u = account_history([quota, other, other_pod, before, source, grown, migration, target])
    m = mig(u, "m")
    assert m.state == CANCEL, m


def test_a_pod_made_for_the_new_size_beside_the_vm_does_not_keep_its_migration_from_being_canceled() -> None:
    """The tenant's pod with a controller reference to the VMI, made for its new size, which KubeVirt adopts: the VM
    counts at that size already, but KubeVirt's own pod was made for the old one."""
    quota, other, other_pod, grown, source, target, migration = stale_target("5")
    adopted = launcher_obj(grown, suffix="-t", t=150, controller=True)
    u = account([quota, other, other_pod, grown, source, adopted, target, migration])
    assert mig(u, "m").state == CANCEL, mig(u, "m")


def test_a_vm_whose_domain_started_at_its_spec_is_not_canceled_over_the_budget() -> None:
    """Raised to 4 vCPUs while pending, the VMI's launcher pod (and so its domain) was made for 4 while its status
    keeps the 1 it was created with until a migration ends; an administrator then lowers the budget below what runs.
    Its migration, whose target is made for 4 too, changes nothing: it is not canceled (it was, and every later
    migration of the VM with it)."""
    quota = quota_obj("rq", {"requests.cpu": "3"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    created = vmi_obj("vm-a", vcpus=1, status_vcpus=1, t=2, phase="Pending")
    raised = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2, phase="Pending")
    running = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2)
    source = launcher_obj(running, t=5, vouched=False)
    target = launcher_obj(running, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(running, source)
    moving = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2)
    vouch(moving, source)
    vouch(moving, target)
    history = [quota, other, launcher_obj(other), created, raised, source, running]
    assert format_resource_list(account_history(history).quotas["rq"].used)["requests.cpu"] == "6"
    u = account_history([*history, vmim_obj("m", "vm-a", phase="Scheduling"), target, moving])
    assert mig(u, "m").state == TARGET_CREATED, mig(u, "m")


def test_a_target_made_before_a_hotplug_is_canceled_even_when_the_growth_fits() -> None:
    """The growth fits the budget, but it was never in a pod quota admitted: until the quota controller copies the
    lowered ``hard``, the room it takes is open to other pods."""
    u = account(list(stale_target("6")))
    m = mig(u, "m")
    assert m.state == CANCEL, m
    assert "made for the size the VM runs at" in m.reason


def test_a_target_made_before_a_cpu_hotplug_is_canceled_however_large_its_memory() -> None:
    """A target charged more memory than the VM's pods (a hook sidecar's container the tenant annotated the VMI with,
    without the guard) but the CPU of the size the VM runs at: the vCPUs' growth is not in it."""
    quota, other, other_pod, grown, source, _, migration = stale_target("5")
    larger = launcher_obj(vmi_obj("vm-a", vcpus=1, guest="3Gi", t=2), migration_uid="mig-m", node="n2", t=200)
    vouch(grown, larger)
    u = account([quota, other, other_pod, grown, source, larger, migration])
    assert mig(u, "m").state == CANCEL, mig(u, "m")


def test_a_tenants_older_pod_labelled_as_the_target_does_not_stand_in_for_it() -> None:
    """A pod of the tenant's, made for the spec, with the migration's label, a controller reference to the VMI (which
    KubeVirt adopts) and ``kubevirt.io: decoy`` (KubeVirt sees it, its target lookup does not): older than KubeVirt's
    target, it was taken for the target, and the stale target went unjudged."""
    quota, other, other_pod, grown, source, target, migration = stale_target("4")
    decoy = launcher_obj(grown, suffix="decoy", migration_uid="mig-m", t=50, controller=True, vouched=False)
    decoy["metadata"]["labels"]["kubevirt.io"] = "decoy"
    vouch(grown, decoy)
    u = account([quota, other, other_pod, grown, source, decoy, target, migration])
    assert mig(u, "m").state == CANCEL, mig(u, "m")


def guaranteed_vmi(vcpus: int, cpu: str, sidecars: int, **kw: Any) -> dict[str, Any]:
    """vm-a with equal CPU and memory requests and limits (Guaranteed: hook sidecars are charged 200m/64M each)."""
    res = {"cpu": cpu, "memory": "1Gi"}
    v = vmi_obj("vm-a", vcpus=vcpus, t=2, requests=res, limits=res, **kw)
    if sidecars:
        hooks = json.dumps([{"image": f"hook{i}"} for i in range(sidecars)])
        v["metadata"]["annotations"] = {"hooks.kubevirt.io/hookSidecars": hooks}
    return v


def test_a_sidecar_annotation_taken_off_the_vmi_does_not_make_a_stale_target_pass() -> None:
    """Source and target made with two hook sidecars at 1 vCPU; the tenant takes the annotation off and raises the
    sockets to 4 (KubeVirt grows the explicit CPU by 3 x 100m): the spec's rendering is smaller than the pods, which
    then lacked nothing of it, and the stale target went through, unjudged by the budget too (6 vCPUs on 4)."""
    quota = quota_obj("rq", {"requests.cpu": "4"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    before = guaranteed_vmi(1, "1", 2)
    grown = guaranteed_vmi(4, "1300m", 0, status_vcpus=1)
    source = launcher_obj(before)
    target = launcher_obj(before, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, source)
    vouch(grown, target)
    history = [quota, other, launcher_obj(other), before, source, grown, vmim_obj("m", "vm-a", phase="Scheduling")]
    m = mig(account_history([*history, target]), "m")
    assert m.state == CANCEL and "over its budget in requests.cpu" in m.reason, m


def hotplug_target(
    budget: str, made_for: int, spec: int, *, target_first: bool = True, ratios: tuple[int, int] = (10, 10)
) -> MigrationEntry:
    """vm-a runs 1 vCPU beside vm-x's 2 on a ``VirtualResources`` budget of ``budget`` vCPUs; raised to
    ``made_for`` vCPUs (its migration admitted: the target reserved), KubeVirt's target is made for them, and the
    spec is ``spec`` vCPUs by the time the target exists (seen before or after the raise). ``ratios``: KubeVirt's
    CPU allocation ratio when the VMs' pods were made, and since. Returns the migration."""
    quota = quota_obj("rq", {"requests.cpu": budget}, Mode.VIRTUAL_RESOURCES)
    then, now = (KubeVirtConfig(cpu_allocation_ratio=Fraction(r)) for r in ratios)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    before = vmi_obj("vm-a", vcpus=1, t=2)
    source = launcher_obj(before, t=5, config=then)
    made = vmi_obj("vm-a", vcpus=made_for, status_vcpus=1, t=2)
    vouch(made, source)
    target = launcher_obj(made, migration_uid="mig-m", node="n2", t=200, vouched=False, config=now)
    history = [quota, other, launcher_obj(other, config=then), before, source, made]
    history.append(vmim_obj("m", "vm-a", rejected=True))
    assert mig(account_history(history, config=now), "m").state == PENDING  # (the raise fits: its target reserved)
    raised = vmi_obj("vm-a", vcpus=spec, status_vcpus=1, t=2)
    vouch(raised, source)
    vouch(raised, target)
    tail = [target, raised] if target_first else [raised, target]
    history += [vmim_obj("m", "vm-a", phase="Scheduling"), *tail]
    m: MigrationEntry = mig(account_history(history, config=now), "m")
    return m


@pytest.mark.parametrize("target_first", [True, False], ids=["target_seen_first", "raise_seen_first"])
def test_a_target_made_for_a_size_admitted_on_the_way_does_not_carry_a_further_raise(target_first: bool) -> None:
    """vm-a runs 1 vCPU and is raised to 4 (fits: 2 + 4 of 6): its growth admitted, KubeVirt's target made for 4.
    While it waits for a node the tenant raises the spec to 6. The target had more than half of the growth from 1
    to 6 over the source, which read as made for the spec: the migration went on and its end gave the guest 6
    vCPUs, 2 of them never admitted (8 on 6). (With the guard the same target comes from KubeVirt rendering it from
    a cache that had the first of two quick raises.)"""
    m = hotplug_target("6", 4, 6, target_first=target_first)
    assert m.state == CANCEL and "made for the size the VM runs at" in m.reason, m


@pytest.mark.parametrize("ratios", [(10, 2), (2, 10)], ids=["ratio_lowered", "ratio_raised"])
def test_a_target_made_for_a_size_admitted_on_the_way_after_a_ratio_change_is_canceled(ratios: tuple[int, int]) -> None:
    """The same after an administrator changed KubeVirt's CPU allocation ratio since the VMs' pods were made: the
    source, made at the old ratio, shows nothing of the change (lowered: it has far less CPU than the targets;
    raised: as much as the spec's rendering), and only the rendering at the spec tells the target made for 2 of a
    raise from 1 to 3 (the guest got the third vCPU unadmitted)."""
    assert hotplug_target("100", 3, 3, ratios=ratios).state == TARGET_CREATED
    m = hotplug_target("100", 2, 3, ratios=ratios)
    assert m.state == CANCEL and "made for the size the VM runs at" in m.reason, m


def test_a_target_made_for_the_spec_of_a_many_vcpu_hotplug_is_not_canceled() -> None:
    """The other side of the rule above: KubeVirt's target made for the spec (1 to 6 vCPUs, admitted) goes on."""
    assert hotplug_target("8", 6, 6).state == TARGET_CREATED


def test_a_sidecar_annotation_added_before_a_stale_target_does_not_make_it_pass() -> None:
    """vm-a (Guaranteed) runs 1 vCPU in a pod without sidecars; the tenant adds a hook sidecar annotation to the
    running VMI and creates a migration, whose target KubeVirt renders from it (1 vCPU and the sidecar's 200m);
    while the target waits, it raises the sockets to 2 (KubeVirt grows the explicit CPU by 100m). The sidecar gives
    the target more than half of the change over the source: it read as made for the spec, and the guest ended at 2
    vCPUs on a budget of 3 already full. (The guard keeps a running VMI's render annotations.)"""
    quota = quota_obj("rq", {"requests.cpu": "3"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    before = guaranteed_vmi(1, "1", 0)
    source = launcher_obj(before, t=5)
    annotated = guaranteed_vmi(1, "1", 1)
    vouch(annotated, source)
    target = launcher_obj(annotated, migration_uid="mig-m", node="n2", t=200, vouched=False)
    raised = guaranteed_vmi(2, "1100m", 1, status_vcpus=1)
    vouch(raised, source)
    vouch(raised, target)
    history = [quota, other, launcher_obj(other), before, source, annotated, vmim_obj("m", "vm-a", t=150)]
    history += [vmim_obj("m", "vm-a", t=150, phase="Scheduling"), target, raised]
    assert mig(account_history(history), "m").state == CANCEL


def forged_larger(budget: str) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``VirtualResources`` of ``budget`` vCPUs, vm-x running 2; vm-a created with 1 vCPU and a
    ``currentCPUTopology`` forged at 4 (its pod, made for 1, gets in natively), then raised to 4. Returns the history,
    the raised VMI and the VMI as its pod was made."""
    quota = quota_obj("rq", {"requests.cpu": budget}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    created = vmi_obj("vm-a", vcpus=1, status_vcpus=4, t=2, phase="Pending")
    small = vmi_obj("vm-a", vcpus=1, status_vcpus=4, t=2)
    source = launcher_obj(small, t=5)
    raised = vmi_obj("vm-a", vcpus=4, status_vcpus=4, t=2)
    vouch(raised, source)
    return [quota, other, launcher_obj(other), created, source, small, raised], raised, small


def test_a_hotplug_to_a_topology_forged_larger_at_creation_is_admitted_from_what_the_pod_was_made_for() -> None:
    """The VM counts at the forged 4 vCPUs already (6 on 4: over its budget), and its growth from them was nothing:
    KubeVirt's target, made for 4, got room, and the guest ran 4 vCPUs where its pod had been made for 1."""
    history, _, _ = forged_larger("4")
    m = mig(account_history([*history, vmim_obj("m", "vm-a", rejected=True)]), "m")
    assert m.state == GROWTH_REFUSED, m


def test_a_migration_state_forged_at_creation_does_not_hide_a_topology_forged_larger() -> None:
    """The same VMI created with a ``status.migrationState`` forged too, naming a completed migration's target (the
    tenant may write a VMI's status only when it creates it): the target of a completed migration does not lower
    the size the VM runs at, but the launcher pod KubeVirt makes afterwards has a name generated then, which no
    status written before can name, so its memory of being made for 1 vCPU still counts."""
    history, _, _ = forged_larger("4")
    forged = {"migrationUid": "forged", "targetPod": "virt-launcher-vm-a-guess", "completed": True}
    for obj in history:
        if obj["kind"] == "VirtualMachineInstance" and obj["metadata"]["name"] == "vm-a":
            obj["status"]["migrationState"] = dict(forged)
    m = mig(account_history([*history, vmim_obj("m", "vm-a", rejected=True)]), "m")
    assert m.state == GROWTH_REFUSED, m


def test_a_stale_target_of_a_vm_raised_to_a_topology_forged_larger_is_canceled() -> None:
    history, raised, small = forged_larger("4")
    target = launcher_obj(small, migration_uid="mig-m", node="n2", t=200, vouched=False)
    moving = copy.deepcopy(raised)
    vouch(moving, target)
    u = account_history([*history, vmim_obj("m", "vm-a", phase="Scheduling"), target, moving])
    assert mig(u, "m").state == CANCEL, mig(u, "m")


def test_a_cpu_and_memory_hotplug_under_a_cluster_wide_cpu_request_is_not_judged_by_its_memory() -> None:
    """A target made for the new guest memory but the old vCPUs (KubeVirt's cache had one patch, not the other): the
    vCPUs' memory overhead is lost beside the guest memory's growth, and no CPU resource shows them, so the budget
    decides (it went through unjudged: 6 vCPUs on 4)."""
    config = KubeVirtConfig(cpu_request=Q("200m"))
    facts = facts_for({"requests.cpu": "4"})
    quota = quota_obj("rq", {"requests.cpu": "4"}, Mode.VIRTUAL_RESOURCES)
    defaulted: dict[str, Any] = {"requests": {"cpu": "200m"}}
    other = vmi_obj("vm-x", vcpus=2, t=1, **defaulted)
    before = vmi_obj("vm-a", vcpus=1, t=2, **defaulted)
    source = launcher_obj(before, config=config, facts=facts, t=5)
    grown = vmi_obj("vm-a", vcpus=4, status_vcpus=1, guest="4Gi", status_guest="1Gi", t=2, **defaulted)
    vouch(grown, source)
    half = vmi_obj("vm-a", vcpus=1, guest="4Gi", t=2, **defaulted)
    target = launcher_obj(half, config=config, facts=facts, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, target)
    pods = [launcher_obj(other, config=config, facts=facts), before, source, grown]
    history = [quota, other, *pods, vmim_obj("m", "vm-a", phase="Scheduling"), target]
    m = mig(account_history(history, config=config), "m")
    assert m.state == CANCEL and "over its budget in requests.cpu" in m.reason, m


def relabelled_and_adopted(source: dict[str, Any], grown: dict[str, Any]) -> list[dict[str, Any]]:
    """The tenant's moves without the guard: the VM's source pod labelled as migration ``m``'s target, with
    ``kubevirt.io: decoy`` (KubeVirt's target lookup skips it), and a pod made for ``grown`` with a controller
    reference to the VMI, which KubeVirt adopts. Returns the relabelled source, that pod and the VMI naming it."""
    relabelled = copy.deepcopy(source)
    relabelled["metadata"]["labels"].update({"kubevirt.io/migrationJobUID": "mig-m", "kubevirt.io": "decoy"})
    adopted = launcher_obj(grown, suffix="adopted", t=300, controller=True, vouched=False)
    adopting = copy.deepcopy(grown)
    vouch(adopting, adopted)
    return [relabelled, adopted, adopting]


def test_the_source_labelled_as_the_migrations_target_is_no_target() -> None:
    """Without the guard the tenant labels KubeVirt's source pod with the migration's label (and ``kubevirt.io:
    decoy``, which KubeVirt's target lookup skips), then has KubeVirt adopt a pod made for the spec: the VM's other
    pods were that one alone, which lacked nothing, and the stale target went through (6 vCPUs on 4). A pod created
    before the migration is none of its targets."""
    quota, other, other_pod, grown, source, target, migration = stale_target("4")
    created = vmi_obj("vm-a", vcpus=1, t=2)
    vouch(created, source)
    relabelled, adopted, adopting = relabelled_and_adopted(source, grown)
    history = [quota, other, other_pod, created, source, grown, migration, target, relabelled, adopted, adopting]
    assert mig(account_history(history), "m").state == CANCEL


def test_the_source_labelled_as_the_target_of_a_migration_made_before_it_is_judged_all_the_same() -> None:
    """The tenant migrates its VM while it is pending (KubeVirt admits it; the migration waits), so that the source
    pod is created after the migration, then labels the source as the target and has KubeVirt adopt a pod made for
    the spec: each labelled pod is judged against all the VM's other pods, and KubeVirt's stale target against the
    source (it went through: 6 vCPUs on 4)."""
    quota = quota_obj("rq", {"requests.cpu": "4"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    pending = vmi_obj("vm-a", vcpus=1, t=2, phase="Pending")
    before = vmi_obj("vm-a", vcpus=1, t=2)
    source = launcher_obj(before, vouched=False, t=5)
    vouch(before, source)
    grown = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2)
    target = launcher_obj(vmi_obj("vm-a", vcpus=1, t=2), migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, source)
    vouch(grown, target)
    relabelled, adopted, adopting = relabelled_and_adopted(source, grown)
    history = [quota, other, launcher_obj(other), pending, vmim_obj("m", "vm-a", t=3), source, before, grown]
    history += [vmim_obj("m", "vm-a", phase="Scheduling", t=3), target, relabelled, adopted, adopting]
    assert mig(account_history(history), "m").state == CANCEL


def carried_out_hotplug() -> list[dict[str, Any]]:
    """vm-a, raised from 1 to 4 vCPUs, was migrated (m1) and runs 4 in m1's target, KubeVirt's status naming it the
    completed migration's target; the ledger folded that target before the VMI's raise, so it remembers it made
    for 1. The budget was lowered below what runs since (5 vCPUs for 6)."""
    quota = quota_obj("rq", {"requests.cpu": "5"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("vm-x", vcpus=2, t=1)
    small = vmi_obj("vm-a", vcpus=1, t=2)
    source = launcher_obj(small, t=5)
    raised = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2)
    vouch(raised, source)
    first = launcher_obj(raised, migration_uid="mig-m1", node="n2", t=100, vouched=False)
    moved = vmi_obj("vm-a", vcpus=4, status_vcpus=4, t=2, node="n2")
    vouch(moved, first)
    moved["status"]["migrationState"] = {"migrationUid": "mig-m1", "targetPod": first["metadata"]["name"]}
    moved["status"]["migrationState"]["completed"] = True
    history = [quota, other, launcher_obj(other), small, source, vmim_obj("m1", "vm-a", t=90), first, raised]
    return [*history, vmim_obj("m1", "vm-a", t=90, phase="Succeeded"), moved, deleted(source)]


@pytest.mark.parametrize(
    "config",
    [
        KubeVirtConfig(),
        KubeVirtConfig(version="main"),
        KubeVirtConfig(cpu_allocation_ratio=Fraction(5)),
        KubeVirtConfig(additional_guest_memory_overhead_ratio="1.5"),
    ],
    ids=["unchanged", "kubevirt_upgraded", "allocation_ratio_lowered", "overhead_ratio_set"],
)
def test_a_drain_after_a_hotplug_carried_out_is_not_refused_for_a_pod_remembered_made_for_less(
    config: KubeVirtConfig,
) -> None:
    """A drain's migration of the VM, whose size does not change, was refused and its target canceled: after the
    upgrade of KubeVirt or a change of its configuration since m1 (``config``), the pod's charge no longer shows
    the rendering at the spec, and the ledger's memory of it made for 1 made the drain a size change. The target
    of a migration KubeVirt's status says completed runs what the status says."""
    history = carried_out_hotplug()
    drain = vmim_obj("m2", "vm-a", t=300, rejected=True)
    assert mig(account_history([*history, drain], config=config), "m2").state == PENDING
    moving = copy.deepcopy(history[-2])
    second = launcher_obj(moving, migration_uid="mig-m2", node="n3", t=310, vouched=False, config=config)
    vouch(moving, second)
    scheduling = vmim_obj("m2", "vm-a", t=300, phase="Scheduling")
    assert mig(account_history([*history, scheduling, second, moving], config=config), "m2").state == TARGET_CREATED


def test_a_stale_target_of_a_migration_queued_behind_an_older_one_is_canceled() -> None:
    """KubeVirt goes on with whichever migration of a VMI its workers reach first, not the oldest: a younger
    migration's stale target went unjudged while the older one waited (``growth-refused``)."""
    quota, other, other_pod, grown, source, target, migration = stale_target("4")
    older = vmim_obj("m0", "vm-a", t=90)
    u = account([quota, other, other_pod, grown, source, target, older, migration])
    assert mig(u, "m").state == CANCEL, mig(u, "m")


def test_a_target_made_for_a_hotplug_that_fits_is_not_canceled() -> None:
    quota, other, other_pod, grown, source, _, migration = stale_target("6")
    target = launcher_obj(grown, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, target)
    u = account([quota, other, other_pod, grown, source, target, migration])
    assert mig(u, "m").state == TARGET_CREATED
    assert format_resource_list(u.quotas["rq"].used)["requests.cpu"] == "6"  # (the VM at its spec while it moves)


@pytest.mark.parametrize("budget", ["4", "6"])
def test_a_target_made_before_a_hotplug_under_a_cluster_wide_cpu_request_is_canceled(budget: str) -> None:
    """A KubeVirt CR with ``cpuRequest`` gives every VMI the same ``requests.cpu``, which a CPU hotplug does not grow:
    the vCPUs' memory overhead still tells a target made before the change from one made for it."""
    config = KubeVirtConfig(cpu_request=Q("200m"))
    facts = facts_for({"requests.cpu": budget})
    quota = quota_obj("rq", {"requests.cpu": budget}, Mode.VIRTUAL_RESOURCES)
    defaulted: dict[str, Any] = {"requests": {"cpu": "200m"}}
    other = vmi_obj("vm-x", vcpus=2, t=1, **defaulted)
    grown = vmi_obj("vm-a", vcpus=4, status_vcpus=1, t=2, **defaulted)
    before = vmi_obj("vm-a", vcpus=1, t=2, **defaulted)
    source = launcher_obj(before, config=config, facts=facts)  # (named by the VMI before the change)
    target = launcher_obj(before, config=config, facts=facts, migration_uid="mig-m", node="n2", t=200, vouched=False)
    vouch(grown, source)
    vouch(grown, target)
    other_pod = launcher_obj(other, config=config, facts=facts)
    history = [quota, other, other_pod, before, source, grown, vmim_obj("m", "vm-a", phase="Scheduling"), target]
    assert mig(account_history(history, config=config), "m").state == CANCEL
    made_for_it = launcher_obj(grown, config=config, facts=facts, migration_uid="mig-m", node="n2", t=200)
    history = [*history[:-1], made_for_it]
    # (one made for it: no CPU resource shows the vCPUs, so the budget decides)
    assert mig(account_history(history, config=config), "m").state == (CANCEL if budget == "4" else TARGET_CREATED)


@pytest.mark.parametrize(("budget", "state"), [("4", CANCEL), ("20", TARGET_CREATED)])
def test_where_pods_cannot_show_a_size_change_the_budget_decides_its_migration(budget: str, state: str) -> None:
    """A VMI vmquota cannot render (nothing tells what its pods were made for): its migration is canceled when, with
    the VM at its spec, the budget is exceeded."""
    quota, other, other_pod, grown, source, target, migration = stale_target(budget)
    del grown["spec"]["domain"]["memory"]
    created = vmi_obj("vm-a", vcpus=1, t=2)
    vouch(created, source)
    u = account_history([quota, other, other_pod, created, source, grown, migration, target])
    assert any("vm-a" in e for e in u.errors), u.errors
    m = mig(u, "m")
    assert m.state == state, m
    assert state != CANCEL or "over its budget in requests.cpu" in m.reason


def test_a_migration_of_a_vm_whose_size_does_not_change_is_not_canceled_over_the_budget() -> None:
    """A namespace over its budget (lowered below what runs) still migrates a VM whose size does not change."""
    quota, other, other_pod, _, source, target, migration = stale_target("2")
    same = vmi_obj("vm-a", vcpus=1, t=2)
    vouch(same, source)
    vouch(same, target)
    u = account([quota, other, other_pod, same, source, target, migration])
    assert u.quotas["rq"].over_budget == ("requests.cpu",)
    assert mig(u, "m").state == TARGET_CREATED


def dedicated(vmi: dict[str, Any]) -> dict[str, Any]:
    """``vmi`` with dedicated CPUs (Guaranteed QoS: a hook sidecar's container is charged)."""
    vmi["spec"]["domain"]["cpu"]["dedicatedCpuPlacement"] = True
    return vmi


def drain_of_a_topology_forged_smaller(
    *, sidecar: bool = False, cpus: Callable[[dict[str, Any]], dict[str, Any]] = dedicated
) -> list[dict[str, Any]]:
    """A 4-vCPU VMI (its CPUs made by ``cpus``) created with ``status.currentCPUTopology`` at one socket (KubeVirt
    keeps a VMI's status written at its creation, and renders its pod from the spec: the ledger sees the pod made
    for 4 vCPUs), never resized, and an administrator's drain whose target KubeVirt made for the spec, like the
    source; ``sidecar``: the tenant then adds a hook sidecar to the running VMI, which KubeVirt renders no pod it
    made already with."""
    facts = facts_for(["requests.cpu", "limits.cpu"])
    source = launcher_obj(cpus(vmi_obj("v", vcpus=4)), t=1, facts=facts)
    target = launcher_obj(
        cpus(vmi_obj("v", vcpus=4)), migration_uid="mig-drain", node="n2", t=101, facts=facts, suffix="t"
    )
    created = cpus(vmi_obj("v", vcpus=4, status_vcpus=1))
    vouch(created, source)
    running = cpus(vmi_obj("v", vcpus=4, status_vcpus=1))
    if sidecar:
        running["metadata"]["annotations"] = {"hooks.kubevirt.io/hookSidecars": json.dumps([{"image": "x"}])}
    vouch(running, source)
    vouch(running, target)
    drain = vmim_obj("drain", "v", t=100, phase="Scheduling")
    return [created, source, drain, target, running]


FORGED_TOPOLOGY_DRAIN: Final = pytest.mark.xfail(
    strict=True,
    reason="open: a drain of a VM whose status was written smaller at its creation is judged as a CPU hotplug's "
    "(docs/accounting.md, Known limits)",
)


@FORGED_TOPOLOGY_DRAIN
@pytest.mark.parametrize("mode", [Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO])
def test_a_sidecar_added_once_a_drains_target_exists_does_not_cancel_the_drain(mode: Mode) -> None:
    """Without the guard (its ``vmquota-vmi-render-annotations`` refuses the annotation). The VM's size never
    changes, and the ledger saw its pods made for its spec; its status, written smaller at its creation, makes it
    look like a CPU hotplug's, and the sidecar has the drain's target look made for less than the spec: vmquota
    cancels the administrator's migration, and every retry of it, the tenant taking the annotation off before
    KubeVirt renders each next target. (Trusting the ledger's memory of what the pods were made for would close
    it, but that memory is an upper bound: a hotplug folded before a pod's first event passes for the size the pod
    was made for.)"""
    budget = {"requests.cpu": "64"} if mode is Mode.VIRTUAL_RESOURCES else {"limits.cpu": "64"}
    quota = quota_obj("rq", budget, mode)
    plain = drain_of_a_topology_forged_smaller()
    assert mig(account_history([quota, *plain]), "drain").state != CANCEL
    m = mig(account_history([quota, *plain, drain_of_a_topology_forged_smaller(sidecar=True)[-1]]), "drain")
    assert m.state != CANCEL, m.reason


@FORGED_TOPOLOGY_DRAIN
def test_a_cpu_allocation_ratio_changed_once_a_drains_target_exists_does_not_cancel_the_drain() -> None:
    """With the guard too: the same VM, and KubeVirt's CPU allocation ratio lowered (10 to 5) while the drain's
    target exists. The target, rendered at 10, looks made for less than the spec rendered at 5."""
    quota = quota_obj("rq", {"requests.cpu": "64"}, Mode.VIRTUAL_RESOURCES)
    objs = [quota, *drain_of_a_topology_forged_smaller(cpus=lambda vmi: vmi)]
    m = mig(account_history(objs, config=KubeVirtConfig(cpu_allocation_ratio=Fraction(5))), "drain")
    assert m.state != CANCEL, m.reason


def test_an_adopted_pod_does_not_hide_a_hotplugs_growth() -> None:
    """The tenant creates a copy of its launcher pod rendered at the size it is about to hotplug to, with a
    controller reference to its VMI on the VMI's node (KubeVirt lists it in activePods, and it is the newest pod:
    the migration's source), then hotplugs 4Gi -> 11Gi. Growth is capped by what the *smallest* of the VM's pods
    lacks of the target: still 7Gi, refused. (Capped by the adopted pod, the growth read as none.)"""
    small = vmi_obj("v", guest="4Gi")
    real = launcher_obj(small, t=1)
    adopted = launcher_obj(vmi_obj("v", guest="11Gi"), suffix="adopted", t=5, vouched=False)
    budget = usage_of(real)["requests.memory"] + usage_of(adopted)["requests.memory"] + Q("16Mi")
    quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    v = vmi_obj("v", guest="11Gi", status_guest="4Gi")
    v["status"]["activePods"] = small["status"]["activePods"]
    vouch(v, adopted)
    u = account([quota, v, real, adopted, vmim_obj("kubevirt-workload-update-x", "v", rejected=True)])
    m = mig(u, "kubevirt-workload-update-x")
    assert m.state == GROWTH_REFUSED and m.growth["requests.memory"] >= Q("7Gi"), m


def test_a_target_is_reserved_at_its_source_pods_charge_with_the_containers_a_webhook_added() -> None:
    """KubeVirt copies a VMI's annotations to its launcher pods, and a mutating webhook (a service mesh's sidecar
    injector) adds containers for them: to the source pod, and to the target alike. At full use the target's room
    follows the source pod's charge: before, it stopped at the evidence bound of the rendering (an eighth of it),
    and the refusals' amounts beyond it were ignored, so that a VM with an 8Gi sidecar beside 16Gi, or the 2 CPUs
    of a mesh's default proxy limit beside 4 vCPUs, never migrated while its namespace stayed full."""
    facts = facts_for(["limits.memory", "limits.cpu"])
    for extra in ({"memory": "8Gi"}, {"cpu": "2"}):
        v = vmi_obj("v", guest="16Gi", vcpus=4, limits={"memory": "16Gi", "cpu": "4"})
        source = launcher_obj(v, facts=facts)
        sidecar = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "100m", "memory": "128Mi"}}
        sidecar["limits"].update(extra)
        source["spec"]["containers"].append({"name": "istio-proxy", "resources": sidecar})
        charged = usage_of(source)
        budget = {r: charged[r].canonical() for r in ("limits.memory", "limits.cpu")}  # (full use)
        quota = quota_obj("rq", budget, Mode.VMI_POD_USAGE)
        refusal = refusal_event("v", {r: str(charged[r]) for r in ("limits.memory", "limits.cpu")}, t=110)
        u = account([quota, v, source, vmim_obj("m", "v", rejected=True), refusal])
        m = mig(u, "m")
        assert m.state == PENDING, m
        for r in ("limits.memory", "limits.cpu"):
            assert m.reserved[r] >= charged[r], (extra, r, m.reserved)
        assert not [e for e in u.errors if "ignored" in e], u.errors


def test_without_the_guard_a_source_larger_than_its_target_costs_no_more_than_its_charge() -> None:
    """The price of following the source pod's charge: the tenant lowers the annotation that sizes its proxy before
    migrating, so the target (no proxy) is 8Gi smaller than the room held for it, and takes that 8Gi with a plain
    pod before the target exists (no guard). The namespace goes over its budget by no more than the room reserved
    while source and target both run, and once the source ends it is back within the budget: the tenant had paid
    for that room with its source pod's charge. Nothing is held for the migration again meanwhile."""
    facts = facts_for(["limits.memory"])
    v = vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"})
    source = launcher_obj(v, facts=facts)
    proxy = {"requests": {"memory": "128Mi"}, "limits": {"memory": "8Gi"}}
    source["spec"]["containers"].append({"name": "istio-proxy", "resources": proxy})
    budget = usage_of(source)["limits.memory"]  # (full use)
    quota = quota_obj("rq", {"limits.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    m = vmim_obj("m", "v", t=100, rejected=True)
    q = account([quota, v, source, m]).quotas["rq"]
    reserved = q.hard["limits.memory"] - q.pods["limits.memory"]
    assert reserved >= budget, "the target's room follows the source pod's charge"
    target = launcher_obj(v, facts=facts, migration_uid="mig-m", node="n2", t=120, suffix="t")
    excess = reserved - usage_of(target)["limits.memory"]
    assert excess >= Q("8Gi")
    grab = pod_obj("grab", {"memory": "64Mi"}, {"memory": excess.canonical()}, t=110)
    u = account([quota, v, source, m, grab])
    assert mig(u, "m").state != PENDING, "room held again for a migration whose room a pod took"
    vouch(v, target)
    during = account([quota, v, source, m, grab, target]).quotas["rq"]
    assert during.pods["limits.memory"] <= budget + reserved, "over the budget by more than the room reserved"
    done = vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"}, node="n2")
    vouch(done, target)
    after = account([quota, done, vmim_obj("m", "v", t=100, phase="Succeeded"), grab, target]).quotas["rq"]
    assert after.pods["limits.memory"] <= budget, "over the budget once the source ended"
    assert after.hard["limits.memory"] <= budget, "room above the budget once the source ended"


@pytest.mark.xfail(
    strict=True,
    reason="open: a refusal's amounts beyond the evidence bound are not trusted for a migration (a tenant writes "
    "Events, and their times), so room stays held for a target larger than its source (docs/accounting.md, Known "
    "limits)",
)
def test_a_target_larger_than_its_source_beyond_the_bound_holds_no_room_for_good() -> None:
    """A mesh sizes its proxy by an annotation KubeVirt copies from the VMI to its pods; raised on the running VMI
    (or by a mesh upgrade), the migration's target is 8Gi larger than its source. KubeVirt's refusal says so, beyond
    the evidence bound: the amounts are ignored, and room stays held at the estimate (with the guard, a holder that
    keeps the namespace's other pods out) for a pod it cannot let in, until the namespace has room for the rest."""
    facts = facts_for(["limits.memory"])
    v = vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"})
    source = launcher_obj(v, facts=facts)
    proxy = {"requests": {"memory": "128Mi"}, "limits": {"memory": "128Mi"}}
    source["spec"]["containers"].append({"name": "istio-proxy", "resources": proxy})
    asked = usage_of(source)["limits.memory"] + Quantity.parse("8Gi")  # the target, with the larger proxy
    quota = quota_obj("rq", {"limits.memory": "40Gi"}, Mode.VMI_POD_USAGE)
    refusal = refusal_event("v", {"limits.memory": str(asked)}, t=110)
    m = mig(account([quota, v, source, vmim_obj("m", "v", rejected=True), refusal]), "m")
    assert not (m.state == PENDING and m.reserved["limits.memory"] < asked), m


def test_a_migration_state_a_tenant_wrote_when_it_created_its_vmi_does_not_reopen_the_reserved_room() -> None:
    """KubeVirt v1.9.0 keeps the status a VMI is created with (the VMI has no status subresource; its webhook forces
    only the phase to Pending), so a tenant may create a VMI whose ``status.migrationState.targetPod`` names the pod
    that took a refused target's room, and adopt that pod into it. A VM's pod created after the migration counts as
    taking the room unless KubeVirt's hand-off names it: before, the forged name reopened the room once per such
    VMI (97Gi on a 64Gi budget with three). Now only a migration state naming one of the VMI's migrations that
    KubeVirt took past scheduling its target exempts a pod; with the name of a real migration of another VMI, or
    of a migration still scheduling, it does not either."""
    quota, vmis, pods = full_64gi()
    m1 = vmim_obj("m1", "vm0", t=100, rejected=True)
    u = account([quota, *vmis, *pods, m1])
    assert mig(u, "m1").state == PENDING
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "16Gi"}, t=101)
    q = u.quotas["rq"]
    assert fits(usage_of(grab), q.pods, q.hard) == [], "native admission lets it into the reserved room"
    assert mig(account([quota, *vmis, *pods, m1, grab]), "m1").state == WAITING
    for forged, phase in (("forged", "Pending"), ("mig-m1", "Running"), ("mig-other", "Scheduling")):
        big = vmi_obj("big", guest="32Gi", limits={"memory": "32Gi"}, t=50, phase=phase)
        big["status"]["migrationState"] = {"targetPod": "grab", "migrationUid": forged}
        vouch(big, grab)  # (adopted into the VMI)
        other = vmim_obj("other", "big", t=102, phase="Scheduling")
        again = mig(account([quota, *vmis, *pods, m1, grab, big, other]), "m1")
        assert again.state == WAITING and not again.reserved, (forged, again)


def test_a_vmi_created_again_naming_its_predecessors_migration_does_not_reopen_the_reserved_room() -> None:
    """The tenant migrates its VMI ``x`` (KubeVirt carries it out and keeps the migration), deletes x and creates it
    again with a ``status.migrationState`` naming that migration and the pod that took vm0's target room, which it
    adopts into the new x. The migration is x's by name and past its hand-off, so the pod passed for the target
    KubeVirt handed off to, and the room was held again, to be taken again. A migration made before the VMI was of
    an earlier VMI of its name."""
    quota, vmis, pods = full_64gi()
    m1 = vmim_obj("m1", "vm0", t=100, rejected=True)
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "16Gi"}, t=101)
    for made in (20, 60):  # (before the VMI, and in its second: times are to the second)
        mx = vmim_obj("mx", "x", t=made, phase="Succeeded")
        x = vmi_obj("x", guest="1Gi", limits={"memory": "1Gi"}, t=60)
        x["status"]["migrationState"] = {"targetPod": "grab", "migrationUid": "mig-mx"}
        vouch(x, grab)
        again = mig(account([quota, *vmis, *pods, mx, m1, grab, x]), "m1")
        assert again.state == WAITING and not again.reserved, (made, again)


def test_a_pod_that_took_reserved_room_and_runs_on_orphaned_keeps_the_room_from_being_held_again() -> None:
    """The pod that took vm0's target room, given a small VMI's launcher command and a controller reference to it
    (KubeVirt lists it), and then orphaned: the tenant deleted that VMI with ``propagationPolicy: Orphan``. The pod
    runs on as that VM's, remembered by the ledger; only the VMs in view were looked at for pods that took the room,
    so room was held again, to be taken again, once per VMI so prepared."""
    quota, vmis, pods = full_64gi()
    m1 = vmim_obj("m1", "vm0", t=100, rejected=True)
    x = vmi_obj("x", guest="1Gi", limits={"memory": "1Gi"}, t=50)
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "16Gi"}, t=101)
    grab["spec"]["containers"][0]["name"] = "compute"
    set_launcher_command(grab["spec"], "x", x["metadata"]["uid"], grab["metadata"]["namespace"])
    named = copy.deepcopy(x)
    vouch(named, grab)
    u = account_history([quota, *vmis, *pods, x, m1, grab, named, deleted(named)])
    assert vm(u, "x").state == RUNNING, "the orphaned pod runs on as x"
    again = mig(u, "m1")
    assert again.state == WAITING and not again.reserved, again


def test_no_room_is_held_for_a_target_kubevirt_creates_no_pod_for_while_the_vmi_has_two_active_pods() -> None:
    """KubeVirt creates no migration target while the VMI has more than one active pod (here a tenant's pod it
    adopted): a refused migration of such a VMI holds no room (with the guard, its holder would keep every other
    pod of the namespace out for as long as the tenant keeps that pod)."""
    v = vmi_obj("v", guest="4Gi")
    source = launcher_obj(v)
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    u = account([quota, v, source, vmim_obj("m", "v", rejected=True)])
    assert mig(u, "m").state == PENDING and mig(u, "m").reserved
    adopted = launcher_obj(vmi_obj("v", guest="4Gi"), suffix="adopted", t=5, vouched=False)
    vouch(v, adopted)
    u = account([quota, v, source, adopted, vmim_obj("m", "v", rejected=True)])
    m = mig(u, "m")
    assert m.state == WAITING and not m.reserved and "2 active pods" in m.reason, m
    # a pod past its deletion grace period that is not terminal yet (a finalizer, say) is still active to KubeVirt,
    # though quota no longer charges it
    gone = (NOW - T0).total_seconds() - 10
    adopted["metadata"].update({"deletionTimestamp": ts(gone), "deletionGracePeriodSeconds": 0})
    adopted["status"]["phase"] = "Pending"
    m = mig(account([quota, v, source, adopted, vmim_obj("m", "v", rejected=True)]), "m")
    assert m.state == WAITING and not m.reserved, m
    adopted["status"]["phase"] = "Failed"  # (terminal: KubeVirt counts one pod again, and room is made at once)
    assert mig(account([quota, v, source, adopted, vmim_obj("m", "v", rejected=True)]), "m").state == PENDING


def test_a_pod_kubevirt_adopted_whose_command_names_another_vmi_is_still_an_active_pod_to_kubevirt() -> None:
    """The tenant's pod has a controller reference to its VMI (KubeVirt lists it in ``status.activePods``) and a
    launcher command naming another VMI, so it is not the VM's pod to vmquota; KubeVirt counts it all the same and
    creates no target: no room is held for one (it was reserved, and with the guard its holder kept every other pod
    of the namespace out)."""
    v, w = vmi_obj("v", guest="4Gi"), vmi_obj("w", guest="1Gi")
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    adopted = launcher_obj(vmi_obj("v", guest="4Gi"), suffix="adopted", t=5, vouched=False)
    set_launcher_command(adopted["spec"], "w", "uid-w", adopted["metadata"]["namespace"])
    vouch(v, adopted)
    u = account([quota, v, w, launcher_obj(v), launcher_obj(w), adopted, vmim_obj("m", "v", rejected=True)])
    m = mig(u, "m")
    assert m.state == WAITING and not m.reserved and "2 active pods" in m.reason, m


def test_no_room_is_held_for_a_new_vms_pod_a_refusal_says_is_larger_than_its_estimates_bound() -> None:
    """KubeVirt was refused a new VM's launcher pod, and the refusal asks for more than the estimate's evidence
    bound (a webhook's 8Gi sidecar; or an Event the tenant wrote). Room held for the estimate would not let that pod
    in, and with the guard the VM, a holder, kept every other pod of the namespace out for as long as it waited:
    it is admitted without room held (and without a nudge), the amounts reported. Within the bound, room is held
    at the refusal's amounts."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    rendered = usage_of(launcher_obj(vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"}), vouched=False))
    for more, held in (("8Gi", False), ("64Mi", True)):
        v = refused_vmi(vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"}, phase="Pending", node=""), by="rq")
        asked = rendered["limits.memory"] + Quantity.parse(more)
        u = account([quota, v, refusal_event("v", {"limits.memory": str(asked)}, t=5)])
        e = vm(u, "v")
        assert e.state == ADMITTED and e.pod_refused == held and bool(e.reserved) == held, (more, e)
        assert bool([x for x in u.errors if "ignored" in x]) != held, u.errors
        if held:
            assert e.reserved["limits.memory"] == asked


@pytest.mark.parametrize("order", ["kubevirts_first", "kubevirts_last"])
def test_the_latest_refusal_decides_the_room_held_for_a_new_vms_pod(order: str) -> None:
    """A new VM's pod was refused at 8Gi beyond the rendering (a webhook's container) and at 64Mi beyond it. The latest
    decides: what made a pod larger may have gone since (the webhook removed, KubeVirt's overhead ratio lowered), and
    while the largest decided, a VM whose pod needs vmquota's room stayed pending for good
    (``tests/unit/test_lag_model.py -k "webhook_since_removed or overhead_ratio_was_lowered"``). A later refusal
    of the tenant's own within the bound decides for its own VM only: with the guard, its holder's pod is held to its
    room (``tests/unit/test_lag_model.py -k "later_forged_refusal or flooded_out_or_deleted"``); without it, room
    held is open to any pod until its pod exists, the reservation window."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    rendered = usage_of(launcher_obj(vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"}), vouched=False))
    v = refused_vmi(vmi_obj("v", guest="16Gi", limits={"memory": "16Gi"}, phase="Pending", node=""), by="rq")
    beyond = refusal_event("v", {"limits.memory": str(rendered["limits.memory"] + Q("8Gi"))}, t=5)
    within = refusal_event("v", {"limits.memory": str(rendered["limits.memory"] + Q("64Mi"))}, t=6)
    if order == "kubevirts_last":
        beyond["lastTimestamp"], within["lastTimestamp"] = within["lastTimestamp"], beyond["lastTimestamp"]
    u = account([quota, v, beyond, within])
    e = vm(u, "v")
    if order == "kubevirts_last":
        assert e.state == ADMITTED and not e.pod_refused and not e.reserved, e
        assert any("quota refusal amounts ignored" in err for err in u.errors), u.errors
    else:
        assert e.state == ADMITTED and e.pod_refused, e
        assert e.reserved["limits.memory"] == rendered["limits.memory"] + Q("64Mi"), e


def test_a_refusal_in_a_resource_no_managed_quota_limits_holds_no_room_back() -> None:
    """A pending VM was refused while its quota limited ``limits.memory``; its administrator then made the budget
    ``requests.memory``. The old refusal's 16Gi of ``limits.memory`` was beyond the bound of an estimate that has
    none of it (no automatic limits now): no room was held for the VM and it was not nudged, waiting for KubeVirt's
    backoff. A refusal's amounts in a resource no managed quota limits are no matter."""
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    v = refused_vmi(vmi_obj("v", guest="16Gi", phase="Pending", node=""), by="rq")
    rendered = usage_of(launcher_obj(vmi_obj("v", guest="16Gi"), vouched=False))
    old = refusal_event("v", {"limits.memory": str(rendered["requests.memory"])}, t=5)
    new = refusal_event("v", {"requests.memory": str(rendered["requests.memory"])}, t=6)
    e = vm(account([quota, v, old, new]), "v")
    assert e.state == ADMITTED and e.pod_refused and e.reserved, e


def test_a_refusal_beyond_the_bound_under_another_name_of_a_budgeted_charge_holds_no_room() -> None:
    """Quota charges ``memory`` and ``requests.memory`` alike. A refusal 8Gi beyond the bound naming
    ``requests.memory`` (an unmanaged quota's, or the managed one's before its budget was renamed) after one within
    it naming ``memory``, the budget's: the latest, it was skipped as of a resource no managed quota limits, and room
    was held at the earlier for a pod KubeVirt renders 8Gi larger."""
    quota = quota_obj("rq", {"memory": "64Gi"}, Mode.VMI_POD_USAGE)
    rendered = usage_of(launcher_obj(vmi_obj("v", guest="16Gi"), vouched=False))
    v = refused_vmi(vmi_obj("v", guest="16Gi", phase="Pending", node=""), by="rq")
    within = refusal_event("v", {"memory": str(rendered["memory"] + Q("64Mi"))}, t=5)
    beyond = refusal_event("v", {"requests.memory": str(rendered["requests.memory"] + Q("8Gi"))}, t=6, quota="other")
    e = vm(account([quota, v, within, beyond]), "v")
    assert e.state == ADMITTED and not e.pod_refused and not e.reserved, e


def test_what_a_refusal_within_the_bound_adds_to_a_new_vms_room_counts_in_the_budget() -> None:
    """A ``VirtualResources`` budget of 80Gi, a 16Gi plain pod, and a 64Gi VM admitted, its pod refused. The tenant
    writes a refusal Event asking 72Gi, within the evidence bound. The room held at those amounts took the 7.7Gi
    beyond the VM's pod from outside the budget: once KubeVirt's real pod was in, a tenant's pod of that size got in
    before vmquota lowered ``hard`` (87.7Gi in VM terms on 80Gi, the VM running). What a refusal raises the estimate
    by counts as the VM's: it no longer fits there, and where it fits (a budget of 100Gi), no room beyond the budget
    is left once its pod is in but the rendering's own overhead, as for every new VM."""
    facts = facts_for({"requests.memory": "80Gi"})
    rendered = usage_of(launcher_obj(vmi_obj("big", guest="64Gi"), facts=facts, vouched=False))["requests.memory"]
    overhead = rendered - Quantity.parse("64Gi")
    filler = pod_obj("filler", {"memory": "16Gi"}, t=1)
    big = refused_vmi(vmi_obj("big", guest="64Gi", t=10, phase="Pending", node=""), by="rq")
    forged = refusal_event("big", {"requests.memory": "72Gi"}, t=20)
    for size, events, state in (("80Gi", [], ADMITTED), ("80Gi", [forged], REFUSED), ("100Gi", [forged], ADMITTED)):
        quota = quota_obj("rq", {"requests.memory": size}, Mode.VIRTUAL_RESOURCES)
        u = account([quota, filler, big, *events])
        e = vm(u, "big")
        assert e.state == state, (size, e.reason)
        if state == ADMITTED:
            q = u.quotas["rq"]
            left = q.hard["requests.memory"] - q.pods["requests.memory"] - rendered  # (once KubeVirt's pod is in)
            free = Quantity.parse(size) - Quantity.parse("80Gi")  # (the budget less the plain pod and the VM)
            beyond = left - free
            assert beyond <= overhead, f"{beyond} open beyond the budget once the VM's pod is in ({size})"


def test_a_refusals_raise_counts_once_where_the_mode_counts_the_pods_usage() -> None:
    """Where a mode counts a VM by its pod's usage (every resource in ``VmiPodUsage``; those a VM-term mode does not
    define, ephemeral storage say), the raised estimate is counted already: adding the raise again refused a VM
    whose pod, as KubeVirt asked for it, fitted the budget exactly."""
    facts = facts_for({"requests.memory": "1Gi"})
    est = usage_of(launcher_obj(vmi_obj("big", guest="8Gi"), facts=facts, vouched=False))
    big = refused_vmi(vmi_obj("big", guest="8Gi", t=10, phase="Pending", node=""), by="rq")
    memory = est["requests.memory"] + Quantity.parse("1Gi")
    storage = est["requests.ephemeral-storage"] + Quantity.parse("200Mi")
    for mode, budget, asked in (
        (Mode.VMI_POD_USAGE, {"requests.memory": str(memory)}, {"requests.memory": str(memory)}),
        (
            Mode.VIRTUAL_RESOURCES,
            {"requests.memory": "100Gi", "requests.ephemeral-storage": str(storage)},
            {"requests.ephemeral-storage": str(storage)},
        ),
    ):
        u = account([quota_obj("rq", budget, mode), big, refusal_event("big", asked, t=20)])
        assert vm(u, "big").state == ADMITTED, (mode, vm(u, "big").reason)


def test_room_is_held_for_a_new_vms_pod_only_once_a_managed_quota_or_the_guard_refused_it() -> None:
    """An admitted VM counts at once, but room for its pod is held (and the guard lists it, and the enforcer nudges
    it) only once KubeVirt was refused the pod for room by a quota vmquota manages or by the guard: a quota it does
    not manage refuses it whatever room the managed ones hold, and a tenant who fills such a quota must not have
    its VM keep the namespace's other pods out for good."""
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    for by, held in ((None, False), ("rq", True), (GUARD_REFUSER, True), (VM_TERMS_REFUSER, True), ("scoped", False)):
        v = vmi_obj("v", guest="4Gi", phase="Pending", node="")
        if by is not None:
            refused_vmi(v, by=by)
        e = vm(account([quota, v]), "v")
        assert e.state == ADMITTED and bool(e.reserved) == held and e.pod_refused == held, (by, e)


def test_a_pod_that_took_reserved_room_and_was_adopted_into_another_vm_keeps_the_room_from_being_held_again() -> None:
    """Without the guard, a tenant's pod took a refused target's reserved room: no room is held for that target
    again while such a pod keeps the namespace over its budget. The tenant then sets a controller reference on that
    pod to another of its VMIs (KubeVirt adopts it): it is no plain pod any more, but its charge beyond that VM's
    launcher pod still counts, and no room is held again. (Room was held again, to be taken a second time: over the
    budget by as many reserved amounts as the tenant has VMs to adopt its pods.)"""
    quota, vmis, pods = full_64gi()
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    grab = pod_obj("grab", {"memory": "1Gi"}, {"memory": "30Gi"}, t=101)
    assert mig(account([quota, *vmis, *pods, migration, grab]), "m1").state == WAITING
    vouch(vmis[1], grab)  # (adopted into vm1)
    again = mig(account([quota, *vmis, *pods, migration, grab]), "m1")
    assert again.state == WAITING and not again.reserved, again
    assert "taken by another pod" in again.reason


def test_a_pod_that_took_reserved_room_and_was_adopted_into_a_pending_vmi_keeps_the_room_from_being_held_again() -> (
    None
):
    """The same, into a *pending* VMI the ledger refused: KubeVirt names every pod a VMI controls in its
    ``status.activePods``, whatever its phase, so the grabbing pod became that VM's one launcher pod, below its
    rendering, with nothing charged beyond it. Room was held again, to be taken again, one refused VMI per round: 17Gi
    over a 64Gi budget after two. A VM's pod created after the migration counts, whatever the VM."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"})
    facts = facts_for(["limits.memory"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    pods = [launcher_obj(v, facts=facts) for v in vmis]
    bigs = [vmi_obj(f"big{i}", guest="32Gi", limits={"memory": "32Gi"}, t=50 + i, phase="Pending") for i in range(2)]
    objs = [quota, *vmis, *pods, *bigs, vmim_obj("m1", "vm0", t=100, rejected=True)]
    for i, big in enumerate(bigs):
        u = account(objs)
        q = u.quotas["rq"]
        assert mig(u, "m1").state == PENDING
        grab = pod_obj(f"grab{i}", {"memory": "1Gi"}, {"memory": "16Gi"}, t=101 + i)
        assert fits(usage_of(grab), q.pods, q.hard) == [], "native admission lets it into the reserved room"
        objs.append(grab)
        assert mig(account(objs), "m1").state == WAITING
        vouch(big, grab)  # (adopted into the refused VMI)
        again = mig(account(objs), "m1")
        assert again.state == WAITING and not again.reserved, again
        objs.remove(grab)  # (so that the next round has room to take, were it held again)
    # a migration target KubeVirt's status names is no pod that took the room
    target = launcher_obj(vmis[1], facts=facts, migration_uid="mig-m2", node="n2", t=102, vouched=False)
    vmis[1]["status"]["migrationState"] = {"targetPod": target["metadata"]["name"], "migrationUid": "mig-m2"}
    vmis[1]["status"]["activePods"] = {}
    vouch(vmis[1], target)
    over = quota_obj("rq", {"limits.memory": "40Gi"})  # (its budget lowered below what runs)
    m2 = vmim_obj("m2", "vm1", t=101, phase="Scheduled")  # (KubeVirt hands off at Scheduled)
    objs = [over, *vmis, pods[0], pods[2], target, vmim_obj("m1", "vm0", t=100, rejected=True), m2]
    assert mig(account(objs), "m1").state == PENDING, "a namespace over its budget for other reasons still migrates"


def _with_sriov(v: dict[str, Any], *, listed: bool) -> dict[str, Any]:
    """``v`` with a pod-network interface and an SR-IOV one, ``fast``; ``listed``: its ``status.interfaces`` names
    ``fast`` (KubeVirt has it in the VM's pod)."""
    v["spec"]["domain"]["devices"] = {
        "interfaces": [{"name": "default", "masquerade": {}}, {"name": "fast", "sriov": {}}]
    }
    v["spec"]["networks"] = [{"name": "default", "pod": {}}, {"name": "fast", "multus": {"networkName": "vf"}}]
    domain = {"infoSource": "domain"}
    v["status"]["interfaces"] = [{"name": "default", **domain}, *([{"name": "fast", **domain}] if listed else [])]
    return v


@pytest.mark.parametrize("room", ["512Mi", "2Gi"])
def test_an_sriov_interface_added_to_a_running_vm_is_growth_admitted_like_any(room: str) -> None:
    """KubeVirt adds an SR-IOV interface to a running VMI's spec at once and plugs it only through a migration: the
    target is rendered with KubeVirt's 1Gi VFIO overhead, the source pod has none. That is growth, admitted like a
    new VM: with 512Mi left it is refused (the VM keeps running without the interface), with 2Gi left reserved.
    (The target was reserved at its new size with nothing admitted: 1Gi over the budget per such migration.)"""
    before = vmi_obj("v", guest="4Gi")
    before["status"]["interfaces"] = [{"name": "default", "infoSource": "domain"}]
    source = launcher_obj(before, vouched=False)
    grown = _with_sriov(vmi_obj("v", guest="4Gi"), listed=False)
    vouch(grown, source)
    target = launcher_obj(grown, migration_uid="mig-m", node="n2", vouched=False)
    assert usage_of(target)["requests.memory"] - usage_of(source)["requests.memory"] >= Q("1Gi")
    budget = usage_of(source)["requests.memory"] + Q(room)
    quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    u = account([quota, grown, source, vmim_obj("kubevirt-workload-update-x", "v", rejected=True)])
    m = mig(u, "kubevirt-workload-update-x")
    assert m.growth["requests.memory"] >= Q("1Gi"), m
    if room == "512Mi":
        assert m.state == GROWTH_REFUSED, m
        assert u.quotas["rq"].used["requests.memory"] == usage_of(source)["requests.memory"], "still its old size"
    else:
        assert m.state == PENDING, m
        assert m.reserved["requests.memory"] >= usage_of(target)["requests.memory"]


def test_a_vm_with_an_sriov_interface_since_it_started_migrates_without_growth() -> None:
    """A VM started with an SR-IOV interface has the VFIO overhead in its pod: a drain in a full namespace is no
    growth, whether its status names the interface or does not yet (the smallest pod caps the growth)."""
    for listed in (True, False):
        v = _with_sriov(vmi_obj("v", guest="4Gi"), listed=True)
        source = launcher_obj(v)
        if not listed:
            v["status"]["interfaces"] = [{"name": "default", "infoSource": "domain"}]
        budget = usage_of(source)["requests.memory"] + Q("64Mi")
        quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
        u = account([quota, v, source, vmim_obj("drain", "v", rejected=True)])
        assert mig(u, "drain").state == PENDING and mig(u, "drain").growth == {}, (listed, mig(u, "drain"))


def test_an_sriov_interface_the_domain_does_not_report_is_growth_whatever_else_names_it() -> None:
    """``status.interfaces`` entries from the launcher pod's network-status annotation (``multus-status``: a tenant
    who may edit its pods can write it) or from the guest agent alone do not make an interface plugged: only
    ``domain`` (virt-handler, from libvirt) does. (An entry of any source hid the growth: the target was reserved
    with nothing admitted.)"""
    before = vmi_obj("v", guest="4Gi")
    source = launcher_obj(before, vouched=False)
    for forged in ("multus-status", "guest-agent", ""):
        grown = _with_sriov(vmi_obj("v", guest="4Gi"), listed=False)
        grown["status"]["interfaces"].append({"name": "fast", "infoSource": forged})
        vouch(grown, source)
        budget = usage_of(source)["requests.memory"] + Q("512Mi")
        quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
        u = account([quota, grown, source, vmim_obj("kubevirt-workload-update-x", "v", rejected=True)])
        m = mig(u, "kubevirt-workload-update-x")
        assert m.state == GROWTH_REFUSED and m.growth["requests.memory"] >= Q("1Gi"), (forged, m)


def test_a_vm_with_sriov_since_it_started_counts_its_pod_whatever_its_status_reports() -> None:
    """The VFIO overhead in a VM's own pod is no growth: while its status does not report the interface from the
    domain (right after it started, or an older KubeVirt), the VM counts at its pod's rendering, nothing of it as a
    charge beyond its rendering (which would count as used and refuse VMs that fit, or hold a drain back)."""
    v = _with_sriov(vmi_obj("v", guest="4Gi"), listed=True)
    source = launcher_obj(v)
    v["status"]["interfaces"] = [{"name": "default", "infoSource": "domain"}]
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    u = account([quota, v, source])
    e = vm(u, "v")
    assert e.unvouched == {} and e.overlap == {}, e
    assert e.pod_usage["requests.memory"] == usage_of(source)["requests.memory"]


def test_a_tiny_pod_adopted_into_a_vm_with_sriov_since_it_started_does_not_make_its_overhead_free() -> None:
    """The smallest of a VM's pods caps a hotplug's growth (what that pod has already is no growth). A tenant's tiny
    pod that KubeVirt adopted into the VM is among its pods too: it lowers the cap, so the VFIO overhead its status
    does not report yet counts as growth and the launcher pod's charge beyond that rendering as used; nothing of
    either pod is free."""
    v = _with_sriov(vmi_obj("v", guest="4Gi"), listed=True)
    source = launcher_obj(v)
    v["status"]["interfaces"] = [{"name": "default", "infoSource": "domain"}]
    tiny = pod_obj("tiny", {"memory": "1Mi"}, t=5)
    vouch(v, tiny)
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VMI_POD_USAGE)
    u = account([quota, v, source, tiny])
    e = vm(u, "v")
    charged = usage_of(source)["requests.memory"] + Q("1Mi")
    assert e.pod_usage["requests.memory"] + e.overlap["requests.memory"] == charged, e
    assert e.unvouched["requests.memory"] >= Q("1Gi"), "the overhead the status does not report counts as used"
    assert u.quotas["rq"].used["requests.memory"] + e.unvouched["requests.memory"] >= charged


def _unchanged_vm_drain(
    source_config: KubeVirtConfig,
    config: KubeVirtConfig,
    budget_key: str,
    *,
    vcpus: int = 1,
    guest: str = "4Gi",
    facts: NamespaceFacts | None = None,
    now_facts: NamespaceFacts | None = None,
    namespace_labels: Mapping[str, str] | None = None,
    requests: Mapping[str, str] | None = None,
    domain: Mapping[str, Any] | None = None,
) -> Any:
    v = vmi_obj("v", vcpus=vcpus, guest=guest, requests=requests)
    v["spec"]["domain"].update(domain or {})
    src = launcher_obj(v, config=source_config, facts=facts or NamespaceFacts())
    other = vmi_obj("o", vcpus=vcpus, guest="8Gi", t=5)
    o_pod = launcher_obj(other, config=config, facts=now_facts or NamespaceFacts(), suffix="o")
    room = Q("50m") if budget_key.endswith("cpu") else Q("64Mi")
    budget = usage_of(o_pod)[budget_key] + usage_of(src)[budget_key] + room
    objs: list[dict[str, Any]] = [quota_obj("rq", {budget_key: budget.canonical()}, Mode.VMI_POD_USAGE)]
    if namespace_labels:
        objs.append({"kind": "Namespace", "metadata": {"name": NS, "uid": "ns", "labels": dict(namespace_labels)}})
    u = account([*objs, v, src, other, o_pod, vmim_obj("drain", "v", rejected=True)], config=config)
    return mig(u, "drain")


def test_a_vm_whose_size_did_not_change_migrates_whatever_changed_its_pods_rendering() -> None:
    """A drain or an upgrade of VMs whose sizes did not change, in full namespaces, after changes that render their
    targets larger than their pods (none the tenant's): a new overhead ratio, an upgrade that stops overcommitting
    an explicit request, an upgrade that counts the IO-thread pool in the CPU request, a higher automatic memory
    limit ratio on the namespace. Each is reserved, never refused as growth (migrations of an unchanged size must
    not fail); what the target is charged beyond the source counts in U."""
    plain = KubeVirtConfig()
    ratio = KubeVirtConfig(additional_guest_memory_overhead_ratio="2.0")
    assert _unchanged_vm_drain(plain, ratio, "requests.memory", guest="1Gi").state == PENDING
    old = KubeVirtConfig(version="v1.6.2", memory_overcommit=150)
    new = KubeVirtConfig(version="v1.6.4", memory_overcommit=150)
    assert _unchanged_vm_drain(old, new, "requests.memory", requests={"memory": "4Gi"}).state == PENDING
    pool = {"ioThreadsPolicy": "supplementalPool", "ioThreads": {"supplementalPoolThreadCount": 8}}
    old, new = KubeVirtConfig(version="v1.5.1"), KubeVirtConfig(version="v1.5.2")
    assert _unchanged_vm_drain(old, new, "requests.cpu", vcpus=2, guest="2Gi", domain=pool).state == PENDING
    limited = NamespaceFacts(quota_has_limits_memory=True)
    ratio3 = NamespaceFacts(labels={"alpha.kubevirt.io/auto-memory-limits-ratio": "3"}, quota_has_limits_memory=True)
    drained = _unchanged_vm_drain(
        plain,
        plain,
        "limits.memory",
        facts=limited,
        now_facts=ratio3,
        namespace_labels={"alpha.kubevirt.io/auto-memory-limits-ratio": "3"},
    )
    assert drained.state == PENDING, drained


def test_a_guest_that_kept_hotplugged_memory_offline_migrates_without_growth() -> None:
    """A hotplug to 8Gi was admitted and migrated: the VM's pod is rendered at 8Gi, but its guest never brought the
    memory online, so the status reports 4Gi. An evacuation of that pod (the same size) needs no growth: reserved
    in a full namespace. (It was refused as 4Gi of growth, and the node drain waited for room.)"""
    vm = vmi_obj("v", guest="8Gi")
    vm["status"]["memory"] = {"guestAtBoot": "4Gi", "guestCurrent": "4Gi", "guestRequested": "8Gi"}
    pod = launcher_obj(vm, suffix="now", t=50)  # the hotplug migration's target, now its pod
    other = vmi_obj("o", guest="8Gi")
    quota = quota_obj("rq", {"requests.memory": "16Gi"}, Mode.VIRTUAL_RESOURCES)
    u = account([quota, vm, pod, other, launcher_obj(other, suffix="o"), vmim_obj("evac", "v", rejected=True)])
    assert mig(u, "evac").state == PENDING, mig(u, "evac").reason
    assert mig(u, "evac").growth == {}


@pytest.mark.parametrize("mode", [Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO])
@pytest.mark.parametrize("resource", ["requests.memory", "limits.memory"])
def test_hotplugged_memory_the_guest_keeps_offline_is_no_room_for_another_vm(mode: Mode, resource: str) -> None:
    """A hotplug to 8Gi was admitted and migrated, but the guest keeps the 4Gi it got offline (libvirt's current
    memory, ``guestCurrent``, follows the guest). Counting the VM at 4Gi made the admitted growth room again: a new
    8Gi VM was reserved and let in, and once the guest brought its memory online (no pod, no migration to refuse)
    the namespace ran 16Gi of guest memory on a 12Gi budget. The VM counts at what its domain was given."""
    budget = {resource: "12Gi"}
    facts = facts_for(budget)

    def hotplugged(online: str) -> dict[str, Any]:
        v = vmi_obj("v", guest="8Gi")
        v["spec"]["domain"]["memory"]["maxGuest"] = "16Gi"
        v["status"]["memory"] = {"guestAtBoot": "4Gi", "guestCurrent": online, "guestRequested": "8Gi"}
        return v

    offline = hotplugged("4Gi")
    pod = launcher_obj(offline, suffix="now", t=50, facts=facts)
    quota = quota_obj("rq", budget, mode)
    u = account([quota, offline, pod, refused_vmi(vmi_obj("p", guest="8Gi", t=100, phase="Pending"))])
    assert vm(u, "v").counts["rq"][resource] == Q("8Gi")
    assert vm(u, "p").state == REFUSED and "does not fit" in vm(u, "p").reason, vm(u, "p").reason
    p_pod = launcher_obj(vmi_obj("p", guest="8Gi", t=100), suffix="p", t=101, facts=facts)
    assert usage_of(pod)[resource] + usage_of(p_pod)[resource] > Q(hard_of(u)[resource]), "native quota refuses it"


def _memory_vmi(guest: str, requested: str, current: str, limits: str | None = None) -> dict[str, Any]:
    v = vmi_obj("v", guest=guest, limits={"memory": limits} if limits else None)
    v["spec"]["domain"]["memory"]["maxGuest"] = "16Gi"
    v["status"]["memory"] = {"guestAtBoot": "2Gi", "guestRequested": requested, "guestCurrent": current}
    return v


def test_an_unplug_that_grows_explicit_memory_limits_is_growth_to_admit() -> None:
    """A guest keeps 4Gi of a hotplug to 6Gi offline (``guestCurrent`` 2Gi), then the tenant unplugs to 5Gi:
    KubeVirt grows the explicit limit by the new size less the guest's current memory (+3Gi) and migrates, since
    the spec differs from ``guestRequested``. The target is charged 3Gi more than the pod: growth to admit, refused
    when it does not fit. (It was reserved as an unchanged VM's migration: 2.9Gi over the budget per unplug, and
    again at each next one.)"""
    facts = facts_for(["limits.memory"])
    before = _memory_vmi("6Gi", "6Gi", "2Gi", limits="6Gi")
    pod = launcher_obj(before, facts=facts, t=1)
    budget = usage_of(pod)["limits.memory"] + Q("64Mi")
    quota = quota_obj("rq", {"limits.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    unplugged = _memory_vmi("5Gi", "6Gi", "2Gi", limits="9Gi")  # 6Gi + (5Gi - 2Gi)
    vouch(unplugged, pod)
    u = account([quota, unplugged, pod, vmim_obj("m", "v", t=300, rejected=True)])
    target = launcher_obj(unplugged, facts=facts, migration_uid="mig-m", node="n2", t=2)
    grows = usage_of(target)["limits.memory"] - usage_of(pod)["limits.memory"]
    assert grows == Q("3Gi")
    assert mig(u, "m").state == GROWTH_REFUSED, mig(u, "m").reason
    assert mig(u, "m").growth["limits.memory"] == grows
    # with room for it, it is admitted, and the namespace stays within its budget once the target is the VM's pod
    roomy = quota_obj("rq", {"limits.memory": (budget + grows).canonical()}, Mode.VMI_POD_USAGE)
    assert mig(account([roomy, unplugged, pod, vmim_obj("m", "v", t=300, rejected=True)]), "m").state == PENDING


def test_an_unplug_of_a_vm_without_explicit_memory_needs_no_room() -> None:
    """Its target is smaller than its pod: no growth, reserved like any migration of an unchanged VM."""
    before = _memory_vmi("6Gi", "6Gi", "2Gi")
    pod = launcher_obj(before, t=1)
    quota = quota_obj("rq", {"requests.memory": usage_of(pod)["requests.memory"].canonical()}, Mode.VMI_POD_USAGE)
    unplugged = _memory_vmi("5Gi", "6Gi", "2Gi")
    vouch(unplugged, pod)
    u = account([quota, unplugged, pod, vmim_obj("m", "v", t=300, rejected=True)])
    assert mig(u, "m").state == PENDING and mig(u, "m").growth == {}, mig(u, "m").reason


def test_a_replug_after_an_unplug_the_guest_did_not_release_is_growth_in_pod_terms() -> None:
    """Unplugged from 8Gi to 6Gi, migrated to a pod made for 6Gi, but the guest did not release the memory
    (``guestCurrent`` 8Gi); then re-plugged to 8Gi. The status size (8Gi) equals the spec, yet the target is made
    for 8Gi: in the pod-usage modes that is growth to admit. (It was charged once reserved, admitted never.)"""
    pod = launcher_obj(_memory_vmi("6Gi", "6Gi", "8Gi"), t=1)
    budget = usage_of(pod)["requests.memory"] + Q("64Mi")
    quota = quota_obj("rq", {"requests.memory": budget.canonical()}, Mode.VMI_POD_USAGE)
    replugged = _memory_vmi("8Gi", "6Gi", "8Gi")
    vouch(replugged, pod)
    u = account([quota, replugged, pod, vmim_obj("m", "v", t=300, rejected=True)])
    assert mig(u, "m").state == GROWTH_REFUSED, mig(u, "m").reason
    assert mig(u, "m").growth["requests.memory"] == Q("2Gi")
    # in VM terms the guest had the 8Gi all along: counted, no growth
    vm_terms = quota_obj("rq", {"requests.memory": "8Gi"}, Mode.VIRTUAL_RESOURCES)
    u = account([vm_terms, replugged, pod, vmim_obj("m", "v", t=300, rejected=True)])
    assert vm(u, "v").counts["rq"]["requests.memory"] == Q("8Gi")
    assert mig(u, "m").state == PENDING, mig(u, "m").reason


@pytest.mark.parametrize("mode", [Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO])
def test_a_memory_change_virt_handler_did_not_carry_out_counts_at_the_pod_it_made(mode: Mode) -> None:
    """A hotplug to 6Gi was admitted and migrated, but virt-handler did not apply it to the domain (it reads a VMI
    label the tenant may edit): ``guestRequested`` stays 2Gi in a pod made for 6Gi, and KubeVirt migrates again.
    Counted at 2Gi, the admitted growth was room again for a new 6Gi VM, and the next migration (nothing to grow in
    pod terms) took it back unchecked: 12Gi of guest memory on an 8Gi budget."""
    budget = {"requests.memory": "8Gi"}
    facts = facts_for(budget)
    v = _memory_vmi("6Gi", "2Gi", "2Gi")
    pod = launcher_obj(v, suffix="now", t=50, facts=facts)
    quota = quota_obj("rq", budget, mode)
    u = account([quota, v, pod, refused_vmi(vmi_obj("p", guest="6Gi", t=100, phase="Pending"))])
    assert vm(u, "v").counts["rq"]["requests.memory"] == Q("6Gi")
    assert vm(u, "p").state == REFUSED, vm(u, "p").reason
    # the same VM before its migration made the pod: the hotplug is pending, growth to admit
    old_pod = launcher_obj(_memory_vmi("2Gi", "2Gi", "2Gi"), suffix="old", t=50, facts=facts)
    vouch(v, old_pod)
    v["status"]["activePods"] = {old_pod["metadata"]["uid"]: "n1"}
    u = account([quota, v, old_pod, vmim_obj("m", "v", t=300, rejected=True)])
    assert vm(u, "v").counts["rq"]["requests.memory"] == Q("2Gi")
    assert mig(u, "m").growth, mig(u, "m").reason


def memory_raised_while_the_target_waits(
    mode: Mode,
    budget: str,
    raised_to: str,
    *,
    sidecars: str | None = None,
    sidecars_then: str | None = None,
    config: KubeVirtConfig | None = None,
) -> MigrationEntry:
    """vm-x runs 2Gi of guest memory and v 1Gi on a ``budget`` of ``requests.memory``; v's memory is raised to 4Gi,
    whose growth fits (its target reserved), KubeVirt's target is made for 4Gi, and the ledger then sees the spec
    at ``raised_to``. ``sidecars_then``/``sidecars``: v's hook sidecars annotation until then, and at the raise;
    ``config``: KubeVirt's. Returns the migration."""

    def v(guest: str, hooks: str | None) -> dict[str, Any]:
        obj = _memory_vmi(guest, "1Gi", "1Gi")
        if hooks is not None:
            obj["metadata"]["annotations"] = {"hooks.kubevirt.io/hookSidecars": hooks}
        return obj

    config = config or KubeVirtConfig()
    quota = quota_obj("rq", {"requests.memory": budget}, mode)
    other = vmi_obj("x", guest="2Gi", t=1)
    before = v("1Gi", sidecars_then)
    source = launcher_obj(before, t=5, config=config)
    made = v("4Gi", sidecars_then)
    vouch(made, source)
    history = [quota, other, launcher_obj(other, t=1, config=config), before, source, made]
    history.append(vmim_obj("m", "v", rejected=True))
    assert mig(account_history(history, config=config), "m").state == PENDING  # (the raise fits: target reserved)
    target = launcher_obj(made, migration_uid="mig-m", node="n2", t=200, vouched=False, config=config)
    raised = v(raised_to, sidecars)
    vouch(raised, source)
    vouch(raised, target)
    history += [vmim_obj("m", "v", phase="Scheduling"), target, raised]
    m: MigrationEntry = mig(account_history(history, config=config), "m")
    return m


@pytest.mark.parametrize("mode", [Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO])
def test_a_memory_raise_while_the_target_waits_goes_on_only_where_it_fits(mode: Mode) -> None:
    """v's memory hotplug from 1Gi to 4Gi is admitted (2Gi + 4Gi of 6Gi) and KubeVirt's target made for 4Gi; the
    ledger then sees the spec at 5Gi (the tenant raised its VM twice at once, and KubeVirt's VM controller patched
    the second raise into the VMI from a cache without the first's ``HotMemoryChange`` condition), less than half of
    the change from 1Gi, which the target was not short of by the memory measure: the migration went on, and
    virt-handler gave the guest the spec's 5Gi (a VMI setting guest memory alone has no memory request to check the
    target's against), 7Gi on 6Gi. A target short of the spec's memory at all goes on only where the VM fits at its
    spec; one made for the spec whatever."""
    m = memory_raised_while_the_target_waits(mode, "6Gi", "5Gi")
    assert m.state == CANCEL and "over its budget in requests.memory" in m.reason, m
    assert memory_raised_while_the_target_waits(mode, "7Gi", "5Gi").state == TARGET_CREATED
    assert memory_raised_while_the_target_waits(mode, "6Gi", "4Gi").state == TARGET_CREATED


@pytest.mark.parametrize("hooks", ["not json", "{}"], ids=["not_json", "not_a_list"])
def test_a_memory_raise_beside_a_vmi_vmquota_cannot_render_is_judged_at_the_size_it_runs_at(hooks: str) -> None:
    """The same second raise, to 5Gi, with the VMI's hook sidecars annotation made unreadable to vmquota (without
    the guard a running VMI's annotations are the tenant's; KubeVirt's target exists already). Where the pods cannot
    show a change the budget decides, but a VMI that does not render counted at its spec's memory as the size it runs
    at, so the change grew nothing and the migration went on: 7Gi on 6Gi."""
    m = memory_raised_while_the_target_waits(Mode.VIRTUAL_RESOURCES, "6Gi", "5Gi", sidecars=hooks)
    assert m.state == CANCEL and "over its budget in requests.memory" in m.reason, m


def test_a_memory_raise_of_a_vmi_vmquota_cannot_render_is_admitted_only_where_it_fits() -> None:
    """v runs 1Gi beside vm-x's 2Gi on 6Gi; the VMI no longer renders for vmquota (an annotation it cannot read)
    and its guest memory is raised to 5Gi. It counts at its spec's memory already (a VM that does not render), so
    the growth was nothing and KubeVirt's target got room: its end gave the guest 5Gi (7Gi on 6Gi)."""
    quota = quota_obj("rq", {"requests.memory": "6Gi"}, Mode.VIRTUAL_RESOURCES)
    other = vmi_obj("x", guest="2Gi", t=1)
    before = _memory_vmi("1Gi", "1Gi", "1Gi")
    source = launcher_obj(before, t=5)
    raised = _memory_vmi("5Gi", "1Gi", "1Gi")
    raised["metadata"]["annotations"] = {"hooks.kubevirt.io/hookSidecars": "not json"}
    vouch(raised, source)
    history = [quota, other, launcher_obj(other, t=1), before, source, raised, vmim_obj("m", "v", rejected=True)]
    m = mig(account_history(history), "m")
    assert m.state == GROWTH_REFUSED and "over its budget in requests.memory" in m.reason, m


@pytest.mark.parametrize("fill", ["4608Mi", "6Gi"], ids=["beyond_the_raise", "short_of_the_raise"])
def test_hook_sidecars_taken_off_at_a_memory_raise_do_not_make_its_target_look_made_for_it(fill: str) -> None:
    """The cluster charges hook sidecars 512Mi each (``supportContainerResources``); v has two when its raise to
    4Gi is admitted, so KubeVirt's target is made for 4Gi and 1Gi of sidecars. The tenant takes the annotation off
    at a second raise: to 4.5Gi, the target has more memory than the spec's rendering, which read as made for it
    (6.5Gi on 6Gi); to 6Gi, less (8Gi on 6Gi). A target whose memory is not the rendering at the spec's goes on only
    where the VM fits at its spec. (Raised by exactly what the sidecars carry, the target is the spec's rendering:
    Known limits.)"""
    sidecar = {"memory": Q("512Mi")}
    config = KubeVirtConfig(support_container_resources={"sidecar": (sidecar, sidecar)})
    hooks = json.dumps([{"image": "registry.example/hook:1"}, {"image": "registry.example/hook:2"}])
    m = memory_raised_while_the_target_waits(Mode.VIRTUAL_RESOURCES, "6Gi", fill, sidecars_then=hooks, config=config)
    assert m.state == CANCEL and "over its budget in requests.memory" in m.reason, m


def test_a_memory_change_kubevirt_gave_up_on_is_not_pending() -> None:
    """virt-handler could not apply the memory to the domain and set ``HotMemoryChange`` False: KubeVirt asks for a
    restart and carries the change out no more. Nothing is pending, so an evacuation whose target a new version
    renders larger than the pod is not growth to admit (migrations of an unchanged VM must not fail)."""
    v = _memory_vmi("6Gi", "2Gi", "2Gi")

    def pending() -> bool:
        snap = _one(v)
        assert isinstance(snap, VmiSnapshot)
        return snap.memory_change

    v["status"]["conditions"] = [{"type": "HotMemoryChange", "status": "False", "reason": "MemoryHotplugFailed"}]
    assert not pending()
    v["status"]["conditions"][0]["status"] = "True"
    assert pending()
    del v["status"]["conditions"]
    assert pending()


@pytest.mark.xfail(strict=True, reason="open without the guard: native room cannot hold such VMs back")
def test_explicit_memory_overcommit_gets_past_a_vm_term_budget() -> None:
    """The room ``hard`` leaves natively, in a VM-term budget, must hold no more guest memory than the budget has
    left. A VM with ``requests.memory`` far below its guest memory is charged its request and overhead only, so
    twelve 16Gi VMs fit a 16Gi budget's room at once. Only admission of the VMI closes it: the reservation guard's
    rendering-model policy (``tests/integration/test_e2e_adversary.py -k rendering_model``)."""
    quota = quota_obj("rq", {"requests.memory": "16Gi"}, Mode.VIRTUAL_RESOURCES)
    room = Q(hard_of(account([quota]))["requests.memory"])
    charge = usage_of(launcher_obj(vmi_obj("v", guest="16Gi", requests={"memory": "1Gi"})))["requests.memory"]
    fit = room.nanos // charge.nanos
    assert fit * 16 <= 16, f"{fit} VMs of 16Gi guest memory fit natively: {fit * 16}Gi on a 16Gi budget"


# ---- pods ----------------------------------------------------------------------------------------------------------


def test_non_vm_terminal_and_orphan_pods() -> None:
    quota = quota_obj("rq", {"requests.cpu": "10", "count/pods": "10"})
    web = pod_obj("web", {"cpu": "500m"})
    done = pod_obj("job", {"cpu": "2"}, phase="Succeeded")
    deleting = pod_obj("old", {"cpu": "1"}) | {
        "metadata": {"name": "old", "namespace": NS, "deletionTimestamp": ts(0), "deletionGracePeriodSeconds": 30}
    }
    orphan = launcher_obj(vmi_obj("gone"))
    stopped = vmi_obj("stopped", phase="Succeeded")
    stopped_pod = launcher_obj(stopped, phase="Succeeded")
    u = account([quota, web, done, deleting, orphan, stopped, stopped_pod])
    roles = {e.name: e.role for e in u.pods}
    assert roles["web"] == NON_VM and roles[orphan["metadata"]["name"]] == ORPHAN_LAUNCHER
    assert roles[stopped_pod["metadata"]["name"]] == LAUNCHER
    assert vm(u, "stopped").state == STOPPED and vm(u, "stopped").counts == {}
    q = u.quotas["rq"]
    orphan_cpu = usage_of(orphan)["requests.cpu"]
    assert q.pods["requests.cpu"] == Q("500m") + orphan_cpu
    assert q.used["requests.cpu"] == Q("500m") + orphan_cpu
    # terminal pods, launcher or not, count (and are charged) count/pods only
    assert q.pods["count/pods"] == Q("5") and q.used["count/pods"] == Q("5")
    assert hard_of(u)["count/pods"] == "10"
    assert hard_of(u)["requests.cpu"] == "10"


def test_a_pod_is_a_launcher_pod_only_when_kubevirt_names_it_in_the_vmi_status() -> None:
    quota = quota_obj("rq", {"requests.cpu": "10"})
    v = vmi_obj("v")
    pod = launcher_obj(v)
    u = account([quota, v, pod])
    assert vm(u, "v").state == RUNNING and u.pods[0].role == LAUNCHER
    # the same labels and owner reference, but KubeVirt's status does not name it: a plain pod at full usage
    forged = launcher_obj(vmi_obj("v"), vouched=False, suffix="forged")
    u = account([quota, v, pod, forged])
    roles = {e.name: e.role for e in u.pods}
    assert roles[forged["metadata"]["name"]] == ORPHAN_LAUNCHER
    q = u.quotas["rq"]
    assert q.used["requests.cpu"] == usage_of(pod)["requests.cpu"] + usage_of(forged)["requests.cpu"]
    # a VMI whose status names no pod has none, whatever the pods' labels say
    bare = vmi_obj("v")
    u = account([quota, bare, json.loads(json.dumps(pod))])
    # (a VMI past Pending is counted, at its rendering, and holds no room: KubeVirt creates no pod for it any more)
    e = vm(u, "v")
    assert e.state == RUNNING and not e.reserved and u.pods[0].role == ORPHAN_LAUNCHER
    assert "no running launcher pod" in e.reason


def test_two_launcher_pods_count_once_at_their_maximum() -> None:
    quota = quota_obj("rq", {"requests.memory": "100Gi"})
    v = vmi_obj("v", guest="2Gi")
    small = launcher_obj(vmi_obj("v", guest="1Gi"), suffix="a", vouched=False)
    vouch(v, small)
    big = launcher_obj(v, suffix="b", t=5)
    u = account([quota, v, small, big])
    q = u.quotas["rq"]
    assert q.used["requests.memory"] == usage_of(big)["requests.memory"]
    assert q.pods["requests.memory"] == usage_of(big)["requests.memory"] + usage_of(small)["requests.memory"]
    # hard holds room for one launcher pod of the VM (B - U + P - D = B): the end of either frees nothing
    assert q.overlap["requests.memory"] == usage_of(small)["requests.memory"]
    assert q.hard["requests.memory"] == Q("100Gi")
    # no migration names either as its target: the second pod counts as used when a VM is admitted
    assert q.unvouched["requests.memory"] == usage_of(small)["requests.memory"]


def test_a_pod_kubevirt_adopted_counts_in_full_beyond_the_rendering() -> None:
    """A tenant's pod with a controller reference to its VMI is in ``status.activePods`` (KubeVirt lists every
    pod the VMI controls), larger than the VM's launcher pod: in VM terms the VM still counts its guest memory,
    ``hard`` holds room for one launcher pod as vmquota renders it, and the rest counts as used, so neither a
    plain pod nor a VM gets the room the forged pod would otherwise free."""
    quota = quota_obj("rq", {"limits.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)
    v = vmi_obj("v", guest="2Gi")
    launcher = launcher_obj(v, facts=facts_for(["limits.memory"]))
    forged = pod_obj("big", {"memory": "40Gi"}, {"memory": "40Gi"}, t=5)
    vouch(v, forged)  # (as KubeVirt's setActivePods does for a pod with a controller reference to the VMI)
    u = account([quota, v, launcher, forged])
    q = u.quotas["rq"]
    lim = usage_of(launcher)["limits.memory"]
    assert Q("2Gi") < lim < Q("40Gi") and vm(u, "v").state == RUNNING
    assert q.used["limits.memory"] == Q("2Gi")  # the VM, in VM terms
    assert q.overlap["limits.memory"] == q.unvouched["limits.memory"] == Q("40Gi")
    # the room left is the budget less the VM and the forged pod in full, whichever pod is the larger, and less
    # what its launcher pod is charged beyond its guest memory (E: the overhead, freed when the pod ends)
    assert q.taken["limits.memory"] == lim  # (W: it takes its launcher pod's charge, more than its 2Gi)
    room = Q("64Gi") - lim - Q("40Gi")
    assert q.hard["limits.memory"] - q.pods["limits.memory"] == room
    late = vmi_obj("late", guest="23Gi", t=9, phase="Pending")
    assert vm(account([quota, v, launcher, forged, late]), "late").state == REFUSED
    fits = vmi_obj("fits", guest="22Gi", t=9, phase="Pending")
    assert vm(account([quota, v, launcher, forged, fits]), "fits").state == ADMITTED


# ---- quotas ----------------------------------------------------------------------------------------------------------


def test_a_scoped_managed_quota_is_refused_and_never_refuses_a_vm() -> None:
    """The enforcer refuses scoped quotas; the ledger applies the same rule (shared.quota.modes.quota_policy), so such a
    quota never makes a VM wait: it is reported in the errors and left out of admission."""
    sel = [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]
    quota = quota_obj("rq", {"requests.cpu": "1"}, Mode.VIRTUAL_RESOURCES, scope_selector=sel)
    pending = vmi_obj("big", vcpus=8, priority="high", phase="Pending")
    u = account([quota, pending])
    assert "rq" not in u.quotas
    assert any("scoped quotas are not managed" in e and "spec.scopeSelector" in e for e in u.errors), u.errors
    assert vm(u, "big").state == ADMITTED and vm(u, "big").counts == {}


def test_several_quotas_admit_jointly() -> None:
    cpu = quota_obj("cpu", {"requests.cpu": "4"}, Mode.VIRTUAL_RESOURCES)
    mem = quota_obj("mem", {"requests.memory": "2Gi"}, Mode.VIRTUAL_RESOURCES)
    v = vmi_obj("v", vcpus=2, guest="4Gi", phase="Pending")
    u = account([cpu, mem, v])
    e = vm(u, "v")
    assert e.state == REFUSED and set(e.refused_by) == {"mem"}
    assert u.quotas["cpu"].reserved == {} and u.quotas["cpu"].used == {}


def test_dedicated_mode_reports_but_does_not_enforce_vmi_names() -> None:
    budget = {"requests.instances/vmi": "1", "requests.cpu/vmi": "2", "requests.memory/vmi": "1Gi"}
    quota = quota_obj("rq", budget, Mode.DEDICATED_VIRTUAL_RESOURCES)
    a, b = vmi_obj("a", vcpus=2), vmi_obj("b", vcpus=2, t=5, phase="Pending")
    u = account([quota, a, launcher_obj(a), b])
    assert vm(u, "b").state == ADMITTED  # report-only resources never refuse
    q = u.quotas["rq"]
    assert format_resource_list(q.hard) == format_resource_list(parse_resource_list(budget))
    assert q.over_budget == ("requests.cpu/vmi", "requests.instances/vmi", "requests.memory/vmi")
    assert all(k is None for k in q.factors.values())


def test_budget_annotation_wins_over_spec_hard() -> None:
    quota = quota_obj("rq", {"requests.cpu": "999"}, budget={"requests.cpu": "2"})
    u = account([quota, pod_obj("p", {"cpu": "500m"})])
    assert u.quotas["rq"].policy.budget == {"requests.cpu": Q("2")}
    assert hard_of(u) == {"requests.cpu": "2"}


def test_invalid_managed_quota_is_reported_and_skipped() -> None:
    good = quota_obj("good", {"requests.cpu": "2"})
    bad = quota_obj("bad", {"requests.cpu": "2"}, "NoSuchMode")
    unmanaged = quota_obj("plain", {"requests.cpu": "2"})
    unmanaged["metadata"]["labels"] = {}
    u = account([good, bad, unmanaged])
    assert set(u.quotas) == {"good"}
    assert len(u.errors) == 1 and "ResourceQuota tenant/bad" in u.errors[0] and "NoSuchMode" in u.errors[0]


def test_explicit_policies_and_config_from_a_kubevirt_snapshot() -> None:
    kv = {
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"cpuAllocationRatio": 4}}},
    }
    v = refused_vmi(vmi_obj("v", vcpus=4, phase="Pending"), by=GUARD_REFUSER)
    pol = QuotaPolicy(name="", mode=Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO)
    u = account([kv, v], policies=[pol])
    e = vm(u, "v")
    assert e.state == ADMITTED and e.counts[""]["requests.cpu"] == Q("1")  # the CR's ratio, 4
    assert e.reserved["requests.cpu"] >= Q("1")  # rendered with the CR's ratio too


def test_a_kubevirt_newer_than_this_build_is_accounted_as_main_and_reported() -> None:
    """A cluster upgraded past the versions this build knows keeps its CR's configuration (here its ratio) and gets
    the development branch's launcher pod profile, with a note, instead of losing its CR altogether."""
    kv = {
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"cpuAllocationRatio": 4}}},
        "status": {"observedKubeVirtVersion": "v1.12.3"},
    }
    v = refused_vmi(vmi_obj("v", vcpus=4, phase="Pending"), by=GUARD_REFUSER)
    pol = QuotaPolicy(name="", mode=Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO)
    u = account([kv, v], policies=[pol])
    assert vm(u, "v").counts[""]["requests.cpu"] == Q("1"), "the CR's ratio, 4"
    assert u.errors == (
        "KubeVirt v1.12.3 is newer than this build knows (up to v1.9): launcher pods are estimated as for main",
    )
    as_main = account([{**kv, "status": {"observedKubeVirtVersion": "main"}}, v], policies=[pol])
    assert vm(u, "v").reserved == vm(as_main, "v").reserved and not as_main.errors
    with pytest.raises(InvalidInput, match=r"v0\.58"):  # not a later release: refused as before
        account([{**kv, "status": {"observedKubeVirtVersion": "v0.58.0"}}, v], policies=[pol])


def test_unrenderable_vmi_is_reported_not_fatal() -> None:
    quota = quota_obj("rq", {"requests.cpu": "2"})
    v = vmi_obj("v", phase="Pending")
    del v["spec"]["domain"]["memory"]
    u = account([quota, v])
    assert vm(u, "v").state == ADMITTED and any("VirtualMachineInstance tenant/v" in e for e in u.errors)


# ---- input handling --------------------------------------------------------------------------------------------------


def test_objects_of_several_namespaces() -> None:
    a = vmi_obj("a")
    b = vmi_obj("b", namespace="other")
    with pytest.raises(InvalidInput, match="several namespaces"):
        account([a, b])
    u = account([a, b], namespace="other")
    assert [e.name for e in u.vms] == ["b"] and u.namespace == "other"


def test_newest_version_of_an_object_wins_whatever_the_order() -> None:
    quota = quota_obj("rq", {"requests.cpu": "10"})
    old = pod_obj("p", {"cpu": "1"})
    old["metadata"]["resourceVersion"] = "5"
    new = pod_obj("p", {"cpu": "2"})
    new["metadata"]["resourceVersion"] = "12"
    for objs in ([quota, old, new], [quota, new, old], [new, quota, old, new]):
        assert account(objs).quotas["rq"].used["requests.cpu"] == Q("2")


def test_result_is_independent_of_input_order() -> None:
    quota = quota_obj("rq", {"requests.cpu": "6", "limits.memory": "64Gi"})
    facts = facts_for(["limits.memory"])
    vs = [vmi_obj(f"v{i}", vcpus=1 + i % 2, t=i) for i in range(4)]
    objs: list[dict[str, Any]] = [quota, *vs, launcher_obj(vs[0], facts=facts), launcher_obj(vs[1], facts=facts)]
    objs += [vmim_obj("m", "v0"), pod_obj("p", {"cpu": "300m"}), refusal_event("v3", {"limits.memory": "3Gi"}, t=10)]
    objs[3] = dict(objs[3], status={"phase": "Pending"})
    objs[4] = dict(objs[4], status={"phase": "Pending"})
    ref = account(objs)
    for seed in range(6):
        shuffled = objs[:]
        random.Random(seed).shuffle(shuffled)
        assert account(shuffled) == ref


# ---- memoisation: the same result with and without the memo ---------------------------------------------------------

_MEMORY = ["512Mi", "1Gi", "1073741824", "1024Mi", "2G", "1536Mi"]  # equal amounts in different formats too
_PRIORITIES = [None, "high"]


@st.composite
def namespaces(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A random namespace: quotas of every mode (some scoped), running, pending and stopped VMs, launcher pods
    (some of migration targets, some terminal), migrations, quota refusals and plain pods."""
    objs: list[dict[str, Any]] = []
    for i, mode in enumerate(draw(st.lists(st.sampled_from(list(Mode)), min_size=1, max_size=3))):
        hard = {"requests.cpu": f"{draw(st.integers(0, 40))}", "requests.memory": f"{draw(st.integers(0, 64))}Gi"}
        if draw(st.booleans()):
            hard["limits.memory"] = draw(st.sampled_from(["64Gi", "68719476736", "40G"]))
        if draw(st.booleans()):
            hard["count/pods"] = str(draw(st.integers(0, 20)))
        scope = None
        if draw(st.booleans()):
            scope = [
                {"scopeName": "PriorityClass", "operator": draw(st.sampled_from(["In", "NotIn"])), "values": ["high"]}
            ]
        objs.append(quota_obj(f"rq{i}", hard, mode, scope_selector=scope))
    facts = facts_for({k for o in objs for k in o["spec"]["hard"]})
    for i in range(draw(st.integers(0, 8))):
        phase = draw(st.sampled_from(["Running", "Running", "Pending", "Succeeded"]))
        v = vmi_obj(
            f"v{i}",
            vcpus=draw(st.integers(1, 4)),
            guest=draw(st.sampled_from(_MEMORY)),
            t=draw(st.integers(0, 5)),
            phase=phase,
            priority=draw(st.sampled_from(_PRIORITIES)),
            status_vcpus=draw(st.sampled_from([None, 1])),
        )
        objs.append(v)
        if phase == "Running":
            objs.append(launcher_obj(v, facts=facts, phase=draw(st.sampled_from(["Running", "Running", "Failed"]))))
            if draw(st.booleans()):
                objs.append(vmim_obj(f"m{i}", f"v{i}", t=draw(st.integers(50, 60))))
                if draw(st.booleans()):
                    objs.append(launcher_obj(v, facts=facts, migration_uid=f"mig-m{i}", node="n2"))
        if draw(st.booleans()):
            objs.append(refusal_event(f"v{i}", {"requests.memory": draw(st.sampled_from(_MEMORY))}, t=70))
    for i in range(draw(st.integers(0, 5))):
        mem = draw(st.sampled_from(_MEMORY))
        objs.append(
            pod_obj(
                f"p{i}",
                {"cpu": draw(st.sampled_from(["0", "100m", "1"])), "memory": mem},
                {"memory": mem} if draw(st.booleans()) else None,
                phase=draw(st.sampled_from(["Running", "Running", "Succeeded"])),
                t=draw(st.integers(0, 5)),
                priority=draw(st.sampled_from(_PRIORITIES)),
            )
        )
    for n, o in enumerate(objs):
        o["metadata"]["resourceVersion"] = str(n + 1)
    return objs


def _same(a: NamespaceUsage, b: NamespaceUsage) -> None:
    assert a == b
    assert repr(a) == repr(b)  # quantity equality ignores the format; the canonical forms (and key order) must agree


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(namespaces(), st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(_MEMORY)), max_size=6))
def test_memoised_accounting_equals_the_reference(objs: list[dict[str, Any]], edits: list[tuple[int, str]]) -> None:
    """The memoised path (snapshots kept from one call to the next, as the ledger does) gives exactly what
    accounting from scratch gives, after each change of one object."""
    current = snaps(objs)
    _same(account_namespace(current, now=NOW), account_namespace(current, now=NOW, memoize=False))
    lists: dict[str, list[AnySnapshot]] = {}
    for step, (i, mem) in enumerate(edits):
        k = i % len(objs)
        obj = copy.deepcopy(objs[k])
        obj["metadata"]["resourceVersion"] = str(1000 + step)
        if obj["kind"] == "VirtualMachineInstance":
            obj["spec"]["domain"]["memory"]["guest"] = mem
        elif obj["kind"] == "Pod":
            obj["status"]["phase"] = "Succeeded" if obj["status"]["phase"] == "Running" else "Running"
        elif obj["kind"] == "ResourceQuota":
            obj["spec"]["hard"]["requests.memory"] = mem
        elif obj["kind"] == "VirtualMachineInstanceMigration":  # (an active migration decides whose pod is a target)
            obj.setdefault("status", {})["phase"] = (
                "Succeeded" if obj["status"].get("phase") != "Succeeded" else "Running"
            )
        objs[k] = obj
        current[k] = normalize(obj)
        _same(account_namespace(current, now=NOW), account_namespace(current, now=NOW, memoize=False))
        # one version per object, as a ledger view holds them: skipping the duplicate search changes nothing
        _same(account_namespace(current, now=NOW, distinct=True), account_namespace(current, now=NOW, memoize=False))
        # split by kind, a kind's list the same object while the kind does not change: as the ledger gives them
        lists = _by_kind(current, lists if step else {})
        by_kind = account_view(lists, NS, now=NOW)
        _same(by_kind, account_namespace(current, now=NOW, memoize=False))


_KIND_OF = {t: kind for kind, t in SNAPSHOT_TYPES.items()}


def _by_kind(objs: list[AnySnapshot], before: Mapping[str, list[AnySnapshot]]) -> dict[str, list[AnySnapshot]]:
    """``objs`` by kind, in a shuffled order; a kind whose objects did not change keeps its list from ``before``."""
    out: dict[str, list[AnySnapshot]] = {}
    for s in objs:
        out.setdefault(_KIND_OF[type(s)], []).append(s)
    for kind, found in out.items():
        old = before.get(kind)
        if old is not None and sorted(map(id, old)) == sorted(map(id, found)):
            out[kind] = old
        else:
            found.reverse()  # not in creation order: accounting orders them
    return out


def test_memo_follows_a_migration_that_ends_while_its_pods_stay() -> None:
    """Whether a VM's second pod is a migration's target depends on the migration's phase alone: the memoised
    pass over running VMs must not serve the entry of a still-active migration once it has ended."""
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)
    v = vmi_obj("v", guest="2Gi")
    source = launcher_obj(v)
    target = launcher_obj(v, migration_uid="mig-m", node="n2", t=5)
    running = vmim_obj("m", "v", phase="Running")
    objs = snaps([quota, v, source, target, running])
    during = account_namespace(objs, now=NOW)
    assert during.quotas["rq"].unvouched == {}
    ended = copy.deepcopy(running)
    ended["status"]["phase"] = "Succeeded"
    ended["metadata"]["resourceVersion"] = "9"
    after = [*objs[:-1], normalize(ended)]
    got = account_namespace(after, now=NOW)
    _same(got, account_namespace(after, now=NOW, memoize=False))
    assert got.quotas["rq"].unvouched, "a finished migration's second pod counts as used when VMs are admitted"


def test_memo_is_not_fooled_by_a_reused_identity() -> None:
    """Two different objects with the same uid and resourceVersion (fixtures do that; Kubernetes does not): the
    memo compares the objects themselves, including the quantities' formats."""
    quota = quota_obj("rq", {"requests.memory": "64Gi", "limits.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)
    results = []
    for guest in ["1Gi", "1073741824", "2Gi"]:
        v = vmi_obj("v", guest=guest)
        v["metadata"]["resourceVersion"] = "7"
        pod = launcher_obj(v, facts=facts_for(["limits.memory"]))
        pod["metadata"]["resourceVersion"] = "8"
        objs = snaps([quota, v, pod, vmi_obj("w", guest=guest, phase="Pending")])
        got = account_namespace(objs, now=NOW)
        _same(got, account_namespace(objs, now=NOW, memoize=False))
        results.append(repr(got.quotas["rq"].used))
    assert results[0] != results[2]  # 1Gi and 2Gi: the memo did not serve the first VM for the last


def test_memo_hit_returns_what_was_computed() -> None:
    """Accounting the very same snapshots twice gives the same result (the second time from the memo)."""
    quota = quota_obj("rq", {"requests.cpu": "8"}, Mode.VIRTUAL_RESOURCES)
    vs = [vmi_obj(f"v{i}", vcpus=1 + i, t=i) for i in range(3)]
    objs = snaps([quota, *vs, *(launcher_obj(v) for v in vs[:2]), vmim_obj("m", "v0")])
    first = account_namespace(objs, now=NOW)
    _same(account_namespace(objs, now=NOW), first)
    assert first.quotas["rq"].used["requests.cpu"] == Q("6")  # 1 + 2 running, 3 admitted


# ---- urgency: which changes the ledger accounts at once ------------------------------------------------------------


def _one(obj: Mapping[str, Any]) -> AnySnapshot:
    return snaps([obj])[0]


def test_urgent_changes_are_those_a_reservation_depends_on() -> None:
    running = _one(vmi_obj("v"))
    assert isinstance(running, VmiSnapshot)
    assert urgency(None, running) is Urgent.NOW, "a new VMI may need a reservation"
    assert urgency(running, None) is Urgent.SOON, "a VMI that goes ends one"
    touched = msgspec.structs.replace(running, resource_version="99")
    assert urgency(running, touched) is Urgent.NO, "a new version that changes nothing accounting reads"
    assert urgency(running, msgspec.structs.replace(running, phase="Succeeded")) is Urgent.SOON, "it ends"
    assert urgency(running, msgspec.structs.replace(running, vcpus=running.vcpus + 1)) is Urgent.NOW, "hotplug"
    added = msgspec.structs.replace(running, unplugged_interfaces=(1,))
    assert urgency(running, added) is Urgent.NOW, "an interface added by live update: growth to admit"
    assert urgency(added, running) is Urgent.NOW, "it is plugged: the target's growth is over"
    unplug = msgspec.structs.replace(running, memory_change=True)
    assert urgency(running, unplug) is Urgent.NOW, "a memory change (an unplug too): the target's growth changes"
    pod = _one(launcher_obj(vmi_obj("v")))
    assert urgency(None, pod) is Urgent.NO, "a new launcher pod ends a reservation but adds as much to P"
    assert urgency(pod, None) is Urgent.NO
    plain = _one(pod_obj("web", {"cpu": "50m"}))
    assert urgency(None, plain) is Urgent.NOW, "a plain pod may have taken the room held for a reservation"
    assert urgency(plain, None) is Urgent.SOON, "room freed"
    assert urgency(plain, msgspec.structs.replace(plain, phase="Succeeded")) is Urgent.NO
    quota = _one(quota_obj("rq", {"requests.memory": "1Gi"}, Mode.VIRTUAL_RESOURCES))
    assert isinstance(quota, QuotaSnapshot)
    edited = msgspec.structs.replace(quota, spec_hard={"requests.memory": Quantity.parse("2Gi")})
    assert urgency(quota, edited) is Urgent.NOW, "a quota edit may change the budget"
    echo = msgspec.structs.replace(quota, status_used={"requests.memory": Quantity.parse("1Gi")})
    assert urgency(quota, echo) is Urgent.NO, "the quota controller's status echo changes nothing"
    adopted = _one(
        quota_obj("rq", {"requests.memory": "1Gi"}, Mode.VIRTUAL_RESOURCES, budget={"requests.memory": "1Gi"})
    )
    assert isinstance(adopted, QuotaSnapshot)
    raised = msgspec.structs.replace(
        adopted,
        spec_hard={"requests.memory": Quantity.parse("3Gi")},
        annotations={**adopted.annotations, "vmquota.io/status": "Enforcing"},
    )
    assert urgency(adopted, raised) is Urgent.NO, "the enforcer's own write: the same budget, the same resources"
    more = msgspec.structs.replace(adopted, spec_hard={**adopted.spec_hard, "limits.memory": Quantity.parse("1Gi")})
    assert urgency(adopted, more) is Urgent.NOW, "a resource spec.hard names decides the launcher pods' limits"
    unmanaged = msgspec.structs.replace(adopted, labels={})
    assert urgency(adopted, unmanaged) is Urgent.NOW, "handed back"
    mig = _one(vmim_obj("m", "v", t=1))
    assert isinstance(mig, VmimSnapshot)
    assert urgency(None, mig) is Urgent.NOW, "a new migration needs its target reserved"
    assert urgency(mig, msgspec.structs.replace(mig, phase="Scheduling")) is Urgent.NO, "progress while active"
    ended = msgspec.structs.replace(mig, phase="Failed")
    assert urgency(mig, ended) is Urgent.SOON, "an ended migration releases its target"
    assert urgency(mig, None) is Urgent.SOON and urgency(None, ended) is Urgent.SOON, "nothing to reserve"
    rejected = msgspec.structs.replace(mig, rejected_by_quota=True)
    assert urgency(mig, rejected) is Urgent.NOW, "KubeVirt was refused the target: room for it now"
    assert urgency(rejected, rejected) is Urgent.NO
    refused_pod = msgspec.structs.replace(running, pod_refused=True)
    assert urgency(running, refused_pod) is Urgent.NOW, "KubeVirt was refused the launcher pod"
    vouched = msgspec.structs.replace(running, active_pods={"pod-x": "n1"})
    assert urgency(running, vouched) is Urgent.SOON, "a pod became a launcher pod: U and D change"
    refusal = _one(refusal_event("v", {"requests.memory": "2Gi"}, t=1))
    assert urgency(None, refusal) is Urgent.NOW and urgency(refusal, None) is Urgent.SOON


def test_a_repeated_refusal_is_not_urgent_a_new_amount_is() -> None:
    urgent = Urgency()
    first = _one(refusal_event("v", {"requests.memory": "2Gi"}, t=1))
    again = msgspec.structs.replace(_one(refusal_event("v", {"requests.memory": "2Gi"}, t=2)), uid="e2", name="e2")
    other = msgspec.structs.replace(_one(refusal_event("v", {"requests.memory": "3Gi"}, t=3)), uid="e3", name="e3")
    assert urgent(None, first) is Urgent.NOW, "the first refusal of a VMI corrects its estimate"
    assert urgent(first, msgspec.structs.replace(first, count=5)) is Urgent.NO, "a count bump with the last amounts"
    assert urgent(None, again) is Urgent.NO, "KubeVirt's retry, refused with the same amounts: nothing new"
    assert urgent(None, again, "another-cluster"), "the same namespace and VMI in another cluster: its first"
    assert urgent(None, other) is Urgent.NOW, "other amounts: a correction"
    assert urgent(first, msgspec.structs.replace(first, count=6)), "the amounts before the last again: news"


# ---- scheduling: when the ledger accounts each changed namespace ----------------------------------------------------

_KEYS = [("c", f"ns{i}") for i in range(6)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_KEYS), unique=True),
    st.lists(st.tuples(st.sampled_from(_KEYS), st.sampled_from(list(Urgent))), unique_by=lambda t: t[0]),
    st.dictionaries(st.sampled_from(_KEYS), st.floats(0, 2)),
    st.floats(0, 2),
    st.sampled_from([(0.25, 0.05), (0.01, 0.05)]),
)
def test_schedule(
    changed: list[tuple[str, str]],
    levels: list[tuple[tuple[str, str], Urgent]],
    accounted_at: dict[tuple[str, str], float],
    now: float,
    delays: tuple[float, float],
) -> None:
    debounce, soon = delays
    urgent = dict(levels)
    keys, wait = schedule(set(changed), urgent, accounted_at, now, debounce=debounce, soon=soon)
    assert len(keys) == len(set(keys)) and set(keys) <= set(changed)
    first = [k for k, level in levels if level is Urgent.NOW and k in changed]
    assert keys[: len(first)] == first, "what a migration waits for first, in the order it came"
    waiting = []
    for k in set(changed) - set(first):
        level = urgent.get(k, Urgent.NO)
        delay = min(soon, debounce) if level is Urgent.SOON else debounce  # (never later than the debounce)
        left = accounted_at.get(k, -1e9) + delay - now
        # due once its delay is over; while something waits, only when overdue by a whole debounce
        assert (k in keys) == (left <= (-debounce if first else 0)), (k, left)
        if k not in keys:
            waiting.append(max(left, 0.0))
    assert wait == (min(waiting) if waiting else None)


# ---- sums: what the memo reuses equals adding in order ----------------------------------------------------------

_AMOUNTS = ["0", "0Gi", "1", "3", "500m", "1k", "2Gi", "1024Mi", "1073741824", "1e3", "-1", "-2Gi"]
_FEW_AMOUNTS = ["0", "0Gi", "0m", "1", "1Gi", "-1"]
"""Mostly zeros, so that sums are zero or turn zero, and first non-zero operands come and go."""
_RESOURCES = ["cpu", "memory", "pods"]


@st.composite
def _resource_list(draw: st.DrawFn, amounts: list[str], keys: tuple[str, ...] | None = None) -> ResourceList:
    if keys is None:
        keys = tuple(draw(st.permutations(_RESOURCES))[: draw(st.integers(0, 3))])
    return {k: Quantity.parse(draw(st.sampled_from(amounts)), allow_negative=True) for k in keys}


def _exactly(rl: ResourceList) -> list[tuple[str, int, Any]]:
    """A resource list as names, amounts and formats, in order (a quantity's text often hides its format)."""
    return [(k, q.nanos, q.format) for k, q in rl.items()]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["all", "non-negative", "few"]))
def test_a_memoised_sum_equals_adding_in_order(data: st.DataObject, kind: str) -> None:
    """A sum of resource lists with a memo (whole sums reused, amended after lists replaced in place, chunks
    re-summed, sums of the same lists shared within an accounting) gives what adding the lists in order gives:
    values, formats and key order, accounting after accounting."""
    memo = Memo(4096)
    amounts = {"all": _AMOUNTS, "non-negative": [a for a in _AMOUNTS if a[0] != "-"], "few": _FEW_AMOUNTS}[kind]
    lists: list[ResourceList] = data.draw(st.lists(_resource_list(amounts), max_size=60))

    def in_order(ls: list[ResourceList]) -> ResourceList:
        s = Sum()
        s.extend(ls)
        return s.result()

    for _ in range(data.draw(st.integers(1, 6))):
        alike: dict[Any, Any] = {}
        for slot in ("a", "b"):  # two sums of the same lists: the second from the first's total
            midway: bool = data.draw(st.booleans())
            s = Sum(memo, slot, alike)
            s.extend(lists)
            extra = lists[:2] if midway else []
            if midway:
                s.get("cpu")  # (a total taken midway, then a few lists more, as admissions do)
                s.extend(extra)
            got, want = s.result(), in_order(lists + extra)
            assert _exactly(got) == _exactly(want)
        if not lists:
            break
        for _ in range(data.draw(st.integers(0, 3))):  # lists replaced in place, most with the same resources
            i = data.draw(st.integers(0, len(lists) - 1))
            how = data.draw(st.sampled_from(["same", "same", "reordered", "any"]))
            keys = {"same": tuple(lists[i]), "reordered": tuple(reversed(lists[i])), "any": None}[how]
            lists[i] = data.draw(_resource_list(amounts, keys))
        if data.draw(st.integers(0, 9)) == 0:
            lists.insert(data.draw(st.integers(0, len(lists))), data.draw(_resource_list(amounts)))


@pytest.mark.parametrize(
    ("before", "i", "after"),
    [
        ([{"cpu": "1", "memory": "1Gi"}, {"cpu": "2"}], 0, {"memory": "1Gi", "cpu": "1"}),  # key order follows
        ([{"memory": "1Gi"}, {"memory": "1"}], 0, {"memory": "0"}),  # the first non-zero goes: the next one's format
        ([{"memory": "0"}, {"memory": "1Gi"}], 1, {"memory": "0Gi"}),  # the sum turns zero: the last one's format
        ([{"memory": "0"}, {"memory": "0Gi"}], 1, {"memory": "0"}),  # a zero sum: its last operand's format
        ([{"memory": "1Gi"}, {"memory": "-1Gi"}, {"memory": "2"}], 2, {"memory": "3"}),  # a negative amount
        ([{"memory": "1Gi"}, {"memory": "0"}, {"memory": "2k"}], 1, {"memory": "-1Gi"}),  # one comes: zero midway
        ([{"memory": "0"}, {"memory": "1Gi"}], 0, {"memory": "1"}),  # a new first non-zero, in another format
        ([{"memory": "1Gi"}, {"memory": "1"}], 1, {"memory": "5"}),  # a later one in another format: amended
    ],
)
def test_a_sum_after_one_list_is_replaced_is_what_adding_in_order_gives(
    before: list[dict[str, str]], i: int, after: dict[str, str]
) -> None:
    def parse(rl: dict[str, str]) -> ResourceList:
        return {k: Quantity.parse(v, allow_negative=True) for k, v in rl.items()}

    memo = Memo(64)
    lists = [parse(rl) for rl in before]
    for _ in range(2):
        s = Sum(memo, "slot")
        s.extend(lists)
        plain = Sum()
        plain.extend(lists)
        got, want = s.result(), plain.result()
        assert _exactly(got) == _exactly(want)
        lists[i] = parse(after)


def test_a_negative_amount_added_on_top_of_a_total_keeps_the_sum_in_order() -> None:
    """A few lists added after a total was taken (as admitted VMs are), one of them negative, then more lists:
    the same as adding them all in order."""

    def run(s: Sum) -> ResourceList:
        for batch in (["1Gi"], ["-2Gi"], ["1Gi", "2k", "0", "0", "0", "0"]):
            s.extend({"memory": Quantity.parse(v, allow_negative=True)} for v in batch)
            s.get("memory")
        return s.result()

    assert _exactly(run(Sum(Memo(64), "slot"))) == _exactly(run(Sum()))


def test_sums_of_the_same_lists_share_a_total_only_while_those_lists_live() -> None:
    """Within one accounting, a sum of the very same lists as another takes its total; a list freed meanwhile (its
    memo slot evicted) cannot pass its identity on to a new list with other amounts."""
    memo = Memo(2)
    alike: dict[Any, Any] = {}
    base = {"cpu": Quantity.parse("1")}
    for i, v in enumerate(["1", "4", "2", "7", "3"]):
        s = Sum(memo, f"sum-{i}", alike)
        s.extend([base, {"cpu": Quantity.parse(v)}])  # (a fresh list each time, freed once its slot is evicted)
        assert _exactly(s.result()) == [("cpu", (1 + int(v)) * 10**9, Quantity.parse(v).format)]


def test_a_migration_target_is_estimated_afresh_not_with_the_overhead_published_for_the_source() -> None:
    """KubeVirt renders every new pod from the spec (``renderLaunchManifest`` recomputes the overhead); the VMI's
    ``status.memory.memoryOverhead`` is copied from its current pod's annotation (lifecycle.go
    ``updateMemoryOverheadStatusFromPod``) and is stale for a target rendered from a changed spec."""
    quota = quota_obj("rq", {"requests.memory": "100Gi"})
    grown = vmi_obj("v", vcpus=4, guest="4Gi", status_vcpus=2, status_guest="2Gi")
    source_vmi = vmi_obj("v", vcpus=2, guest="2Gi")
    source_vmi["status"]["memory"] = {"memoryOverhead": "3Gi"}  # e.g. published under an earlier configuration
    source = launcher_obj(source_vmi, vouched=False)
    vouch(grown, source)
    grown["status"]["memory"]["memoryOverhead"] = "3Gi"
    u = account([quota, grown, source, vmim_obj("m", "v", rejected=True)])
    fresh_vmi = copy.deepcopy(grown)
    del fresh_vmi["status"]
    fresh = usage_of(launcher_obj(fresh_vmi, migration_uid="mig-m", node="n2", vouched=False))
    reserved = mig(u, "m").reserved["requests.memory"]
    assert reserved >= fresh["requests.memory"]
    # and never more than the source pod's charge and the growth (the source may carry what the target will too:
    # containers a webhook adds for the VMI's annotations; an estimate too large only holds room longer unused)
    grew = mig(u, "m").growth.get("requests.memory", Q("0"))
    assert reserved <= usage_of(source)["requests.memory"] + grew, (reserved, usage_of(source), mig(u, "m").growth)


def test_a_failed_migrations_target_that_still_runs_counts_as_used_not_for_free() -> None:
    """AAQ's VmiPodUsage counts a launcher pod that is neither the source nor the target of the VMI's latest
    non-failed migration for nothing (natively it is still charged). vmquota is stricter: such a pod (here the
    target of a Failed migration, which KubeVirt still lists in ``status.activePods``) is not believed to be a
    second launcher pod; what it is charged counts as used when VMs are admitted, so no VM gets its room."""
    quota = quota_obj("rq", {"requests.memory": "10Gi"})
    v = vmi_obj("v", guest="2Gi")
    source = launcher_obj(v)
    target = launcher_obj(v, migration_uid="mig-m", node="n2", t=5)
    failed = vmim_obj("m", "v", phase="Failed")
    failed["metadata"]["uid"] = "mig-m"
    u = account([quota, v, source, target, failed])
    q = u.quotas["rq"]
    mem = usage_of(target)["requests.memory"]
    assert q.overlap["requests.memory"] == q.unvouched["requests.memory"] == mem
    room = Q("10Gi") - usage_of(source)["requests.memory"] - mem  # the budget less the VM and the stray target
    fits = vmi_obj("fits", guest="1Gi", t=9, phase="Pending")
    assert (
        room > Q("1Gi") + Q("500Mi") and vm(account([quota, v, source, target, failed, fits]), "fits").state == ADMITTED
    )
    big = vmi_obj("big", guest="6Gi", t=9, phase="Pending")
    # (it would fit were the stray target free, as in AAQ: 10Gi less the VM alone)
    assert room < Q("6Gi") < Q("10Gi") - usage_of(source)["requests.memory"] - Q("500Mi")
    assert vm(account([quota, v, source, target, failed, big]), "big").state == REFUSED


@given(st.permutations(range(4)))
def test_a_sums_printed_total_is_its_resources_one_form_in_any_order(order: list[int]) -> None:
    """1Gi + 1024M is 2,097,741,824 bytes: a whole number of Ki. Kept in its first operand's form it printed
    ``2048576Ki`` or ``2097741824`` depending on which list came first; published, it is always the resource's
    form (binary units for bytes, decimal for the rest)."""
    lists = [{"memory": Q("1Gi")}, {"memory": Q("1024M")}, {"cpu": Q("0.25")}, {"cpu": Q("250m"), "memory": Q("0")}]
    s = Sum()
    s.extend([lists[i] for i in order])
    assert canonical_resource_list(s.result()) == {"cpu": "500m", "memory": "2048576Ki"}


def test_a_refusal_never_reads_as_needing_what_is_left() -> None:
    """Readable amounts round to a tenth: a need just above what is left would print the same on both sides, so
    such a reason is written exactly."""
    from shared.accounting.state import _needs

    q = Quantity.parse
    assert _needs("limits.memory", q("16Gi"), q("8Gi"), q("64Gi")) == "limits.memory needs 16Gi but 8Gi of 64Gi is left"
    assert _needs("limits.memory", q("17405661185"), q("17390000000"), q("64Gi")) == (
        "limits.memory needs 17405661185 but 17390M of 64Gi is left"
    )


def test_a_launcher_pod_kubevirt_names_no_more_counts_as_its_vm_while_it_runs() -> None:
    """A running VM's launcher pod whose controller reference the tenant took off is named by no VMI's
    ``status.activePods`` any more, but the guest may run on in it: with the fold's memory of the VMI as it last
    named the pod, the pod counts as that VM (4 vCPUs, not its 0.4 of charge), and a 3-vCPU VM no longer fits a
    4-vCPU budget beside it. Without the memory (accounting from snapshots alone) it is a plain pod."""
    quota = quota_obj("rq", {"requests.cpu": "4"}, Mode.VIRTUAL_RESOURCES)
    old = vmi_obj("vm-a", vcpus=4)
    pod = launcher_obj(old)
    vouch(old, pod)
    named = normalize(old)
    assert isinstance(named, VmiSnapshot)
    del pod["metadata"]["ownerReferences"]
    old["status"]["phase"] = "Failed"
    old["status"]["activePods"] = {}
    waiting = vmi_obj("vm-b", vcpus=3, phase="Pending", node="")
    for gone in (False, True):  # (the VMI failed, or it is gone as well)
        _, kinds = by_kind(snaps([quota, pod, waiting] if gone else [quota, pod, old, waiting]), NS)
        plain = account_view(kinds, NS, now=NOW)
        if gone:  # (its command names a VMI not in view: it counts as the VM it may run, its charge over k)
            assert vm(plain, "vm-b").state == REFUSED
            assert plain.quotas["rq"].used["requests.cpu"].nanos >= Q("4").nanos
        else:
            assert vm(plain, "vm-b").state == ADMITTED, "a pod its VMI names no more is a plain pod at its charge"
        remembered = account_view(kinds, NS, now=NOW, departed={pod["metadata"]["uid"]: named})
        assert vm(remembered, "vm-b").state == REFUSED
        assert vm(remembered, "vm-a").state == RUNNING and vm(remembered, "vm-a").counts["rq"]["requests.cpu"] == Q("4")
        assert remembered.quotas["rq"].used["requests.cpu"] == Q("4")


def test_a_pod_a_pending_vmi_names_in_its_status_is_no_launcher_pod_nor_remembered_as_one() -> None:
    """KubeVirt keeps the status a VMI is created with (but for its phase, ``Pending``), and its VMI controller lists
    a pod in ``activePods`` in the same write that moves the VMI to ``Scheduling``. A tenant created a pending VMI
    whose status named its 60Gi plain pod: the pod counted as that 1Gi VM, and once KubeVirt's first sync took it
    off the list, the fold remembered it as a launcher pod KubeVirt had named, for as long as it ran (1Gi used of a
    64Gi budget, not 61Gi). A pending VMI's ``activePods`` vouches for nothing."""
    quota = quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)
    x = vmi_obj("x", guest="1Gi", phase="Pending", node="")
    big = pod_obj("big", {"memory": "60Gi"}, {"memory": "60Gi"}, t=5)
    vouch(x, big)  # (the tenant's words, at creation)
    u = account([quota, x, big])
    assert vm(u, "x").state == ADMITTED and u.quotas["rq"].used["requests.memory"] == Q("61Gi")
    synced = copy.deepcopy(x)
    synced["status"]["activePods"] = {}  # (KubeVirt's first sync)
    ledger = Ledger()
    for seq, obj in enumerate((quota, big, x, synced), start=1):
        snap = normalize(obj)
        meta = obj["metadata"]
        ev = contract.object_event("upserted", cluster="c1", kind=obj["kind"], namespace=NS, name=meta["name"],
                                   uid=meta["uid"], rv=str(100 + seq), snapshot=snap)  # fmt: skip
        ledger.apply(ev, seq)
    view = ledger.view("c1", NS)
    assert not view.departed, "the fold remembers no pod a pending VMI named"
    assert account_view(view.objects, NS, now=NOW).quotas["rq"].used["requests.memory"] == Q("61Gi")


def _attachment_pod(owner: dict[str, Any], name: str, *, t: float) -> dict[str, Any]:
    """KubeVirt's hotplug attachment pod for ``owner`` (a launcher pod), as virt-controller renders it
    (``RenderHotplugAttachmentPodTemplate``: label ``kubevirt.io: hotplug-disk``, a controller reference to the
    launcher pod)."""
    pod = pod_obj(name, {"cpu": "10m", "memory": "2M"}, {"cpu": "100m", "memory": "80M"}, t=t)
    pod["metadata"]["labels"] = {"kubevirt.io": "hotplug-disk"}
    meta = owner["metadata"]
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "controller": True}
    ]
    return pod


def test_a_migration_of_a_vm_with_a_hotplugged_volume_gets_room_for_its_targets_attachment_pod() -> None:
    """KubeVirt keeps the migration of a VMI with hotplugged volumes from going on until it has an attachment pod
    beside the target (``migration.go``: ``VMIHasHotplugVolumes``, ``createAttachmentPod``), which quota charges as
    any pod. Once the target exists ``hard`` holds no room for the source pod: without a reservation for that
    attachment pod, a namespace with less than a launcher pod of its budget left refused it, and the migration of
    a VM whose size did not change waited for as long as the namespace stayed so. The reservation ends once a pod
    the target controls exists (KubeVirt then makes none) or the migration has left Pending."""
    quota = quota_obj("rq", {"limits.memory": "64Gi", "requests.cpu": "8"})
    facts = facts_for(["limits.memory", "requests.cpu"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    vmis[0]["status"]["volumeStatus"] = [{"name": "data", "hotplugVolume": {"attachPodName": "hp-volume-src"}}]
    pods = [launcher_obj(v, facts=facts) for v in vmis]
    base = [quota, *vmis, *pods, _attachment_pod(pods[0], "hp-volume-src", t=2)]
    q = account(base).quotas["rq"]
    assert q.hard["limits.memory"] - q.pods["limits.memory"] > Quantity.parse("14Gi"), "not even full"
    migration = vmim_obj("m1", "vm0", rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    pending = account([*base, migration]).quotas["rq"]
    assert fits(usage_of(target), pending.pods, pending.hard) == [], "the target is reserved and gets in"
    running = account([*base, migration, target])
    (entry,) = running.migrations
    assert (entry.state, entry.target_pod_uid) == ("attachment-reserved", target["metadata"]["uid"]), entry
    attachment = _attachment_pod(target, "hp-volume-tgt", t=201)
    assert entry.reserved == usage_of(attachment), "as virt-controller renders it"
    q = running.quotas["rq"]
    assert fits(usage_of(attachment), q.pods, q.hard) == [], (q.hard, q.pods)
    attached = account([*base, migration, target, attachment])
    assert [m.state for m in attached.migrations] == ["target-created"] and not attached.quotas["rq"].reserved
    unseen = _attachment_pod(target, "not-seen", t=201)
    unseen["metadata"]["labels"] = {}  # (KubeVirt's pod informer does not see it: it makes its own attachment pod)
    assert [m.state for m in account([*base, migration, target, unseen]).migrations] == ["attachment-reserved"]
    scheduling = vmim_obj("m1", "vm0", phase="Scheduling")
    assert [m.state for m in account([*base, scheduling, target]).migrations] == ["target-created"]
    del vmis[0]["status"]["volumeStatus"]  # (no hotplugged volume: KubeVirt makes no attachment pod)
    assert [m.state for m in account([*base, migration, target]).migrations] == ["target-created"]


def _full_with_a_hotplugged_volume() -> tuple[list[dict[str, Any]], list[dict[str, Any]], NamespaceFacts]:
    """Three 16Gi VMs, vm0 with a hotplugged volume, and a plain pod that takes what the budget leaves."""
    quota = quota_obj("rq", {"limits.memory": "64Gi", "requests.cpu": "8"})
    facts = facts_for(["limits.memory", "requests.cpu"])
    vmis = [vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}, t=i) for i in range(3)]
    vmis[0]["status"]["volumeStatus"] = [{"name": "data", "hotplugVolume": {"attachPodName": "hp-volume-src"}}]
    base: list[dict[str, Any]] = [quota, *vmis, *(launcher_obj(v, facts=facts) for v in vmis)]
    q = account(base).quotas["rq"]
    left = {r: q.hard[r] - q.pods.get(r, Quantity.parse("0")) for r in q.hard}
    filler = pod_obj(
        "filler",
        {"cpu": left["requests.cpu"].canonical()},
        {"memory": f"{left['limits.memory'].nanos // 10**9}", "cpu": "1"},
        t=50,
    )
    full = [*base, filler]
    q = account(full).quotas["rq"]
    assert fits({"limits.memory": Quantity.parse("1Mi")}, q.pods, q.hard) != [], "full"
    return full, vmis, facts


def test_a_pod_that_took_a_targets_attachment_room_is_not_followed_by_another() -> None:
    """Without the guard the attachment pod's room is open to any pod until it exists: once a pod created after the
    migration took it (the namespace over its budget by it), the room is not held again while that pod lives, as
    for a target's (before, five pods got in one after the other on one migration's attachment room)."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    migration = vmim_obj("m1", "vm0", rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    assert [m.state for m in account([*full, migration, target]).migrations] == ["attachment-reserved"]
    takers: list[dict[str, Any]] = []
    for i in range(5):
        q = account([*full, migration, target, *takers]).quotas["rq"]
        taker = pod_obj(f"taker{i}", {"cpu": "10m", "memory": "2M"}, {"cpu": "100m", "memory": "80M"}, t=201 + i)
        if fits(usage_of(taker), q.pods, q.hard):
            break
        takers.append(taker)  # admitted by native quota
    assert len(takers) == 1, f"{len(takers)} pods took the attachment room of one migration, one after the other"
    (entry,) = account([*full, migration, target, *takers]).migrations
    assert entry.state == "waiting" and "no room held for its hotplug attachment pod" in entry.reason, entry


def test_without_the_guard_an_old_pod_resized_into_an_attachment_room_is_not_followed_by_another_resize() -> None:
    """The target got in at KubeVirt's first try (no refusal: no ``migrationRejectedByResourceQuota``), and its
    attachment pod is reserved. A pod created before the migration is resized in place into that room (quota
    admission charges only the growth). The ledger's fold marked growth only in a refusal, and the pod is older
    than the migration: the room was held again and taken again, 10m a round (8195m on an 8-core budget after 30
    rounds, and rising). Growth while a migration is active marks the pod, as a creation after it does."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    filler = next(p for p in full if p["metadata"]["name"] == "filler")
    migration = vmim_obj("m1", "vm0", t=100)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    history = [*full, migration, target]
    assert [m.state for m in account_history(history).migrations] == ["attachment-reserved"]
    grown = _grown_round_after_round(history, lambda grown: [_resized_by(filler, grown)])
    (entry,) = account_history(history).migrations
    assert grown == 10, f"{grown}m of growth took the attachment room of one migration, round after round"
    assert entry.state == "waiting" and "no room held for its hotplug attachment pod" in entry.reason, entry


def _cpu_room(u: NamespaceUsage) -> int:
    """The millicores of ``requests.cpu`` quota ``rq``'s ``hard`` leaves beside what its pods are charged."""
    q = u.quotas["rq"]
    return (q.hard["requests.cpu"] - q.pods["requests.cpu"]).nanos // 10**6


def _grown_round_after_round(
    history: list[dict[str, Any]], versions: Callable[[int], list[dict[str, Any]]], rounds: int = 10
) -> int:
    """A tenant grows into the CPU room ``hard`` leaves, round after round, while there is some (native quota admits
    a resize whose growth fits ``status.hard``): ``versions(grown)`` are what each round adds to ``history``. The
    millicores grown in all."""
    grown = 0
    for _ in range(rounds):
        room = _cpu_room(account_history(history))
        if room <= 0:
            break
        grown += room
        history += versions(grown)
    return grown


def _resized_by(pod: dict[str, Any], cpu_m: int) -> dict[str, Any]:
    """``pod``'s next version, its CPU request ``cpu_m`` millicores larger (an in-place resize)."""
    out = copy.deepcopy(pod)
    requests = out["spec"]["containers"][0]["resources"]["requests"]
    requests["cpu"] = f"{Quantity.parse(requests['cpu']).nanos // 10**6 + cpu_m}m"
    return out


_ATTACHMENT_LIMIT: Final = pytest.mark.xfail(
    strict=True,
    reason="open without the guard: the fold marks growth while an attachment pod's room may be held, not a pod "
    "created into it, a resize heard of after that, or one while the VMI's volumes flapped (docs/accounting.md, "
    "Known limits)",
)


@pytest.mark.parametrize("heard", ["at_once", pytest.param("after_the_deletion", marks=_ATTACHMENT_LIMIT)])
def test_without_the_guard_an_attachment_room_taken_is_not_held_again_at_the_next_migration(heard: str) -> None:
    """Migration after migration of vm0 (a hotplugged volume, no refusal), each deleted by the tenant once its
    attachment room is held and an old pod was resized into it. The ledger marked growth only while that room may be
    held when it heard of the resize: one it heard of after the deletion (the tenant slowing the pod watch with its
    own pods' updates) is not marked, and the room is held again at the next migration and taken again, 10m of
    CPU a round without bound: a known limit without the guard (a window kept as for a refusal that ended marked
    KubeVirt's own target and attachment pods at every such migration, holding later drains back)."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    filler = next(p for p in full if p["metadata"]["name"] == "filler")
    history: list[dict[str, Any]] = list(full)
    grown = 0
    for i in range(5):
        migration = vmim_obj(f"m{i}", "vm0", t=100 + 100 * i)
        target = launcher_obj(vmis[0], facts=facts, migration_uid=f"mig-m{i}", node="n2", t=150 + 100 * i)
        history += [migration, target]
        grown += max(0, _cpu_room(account_history(history)))
        ended = [deleted(migration), deleted(target)]
        resize = _resized_by(filler, grown)
        history += [*ended, resize] if heard == "after_the_deletion" else [resize, *ended]
    assert grown == 10, f"{grown}m of growth took the attachment rooms of 5 migrations"


@_ATTACHMENT_LIMIT
def test_without_the_guard_an_attachment_room_taken_by_a_new_pod_is_not_held_again_at_the_next_migration() -> None:
    """The same with a pod created into the room (10m of CPU): older than the next migration and not marked, it let
    the room be held again and taken again, one attachment pod's worth per migration the tenant made."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    history: list[dict[str, Any]] = list(full)
    got_in = 0
    for r in range(4):
        t = 100 + 100 * r
        migration = vmim_obj(f"m{r}", "vm0", t=t)
        target = launcher_obj(vmis[0], facts=facts, migration_uid=f"mig-m{r}", node="n2", suffix=f"t{r}", t=t + 10)
        history += [migration, target]
        u = account_history(history)
        (entry,) = u.migrations
        if entry.state != "attachment-reserved":
            break
        room = _cpu_room(u)
        got_in += 1  # (a pod of that room's CPU is admitted natively)
        history += [pod_obj(f"taker{r}", {"cpu": f"{room}m"}, t=t + 11), deleted(migration), deleted(target)]
    assert got_in == 1, f"{got_in} pods took the attachment rooms of successive migrations"


@_ATTACHMENT_LIMIT
def test_without_the_guard_an_attachment_room_is_not_taken_again_while_the_vmis_volumes_flap() -> None:
    """One migration; the VMI shows no hotplugged volume in one version (an unplug, or a status write: a VMI has no
    status subresource), folded before an old pod's resize into the attachment room, and shows it again in the
    next: the resize was not marked, and the same room was held again and taken again, round after round."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    filler = next(p for p in full if p["metadata"]["name"] == "filler")
    plain = copy.deepcopy(vmis[0])
    plain["status"]["volumeStatus"] = []
    migration = vmim_obj("m1", "vm0", t=100)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    history: list[dict[str, Any]] = [*full, migration, target]
    grown = _grown_round_after_round(
        history, lambda grown: [copy.deepcopy(plain), _resized_by(filler, grown), copy.deepcopy(vmis[0])], rounds=5
    )
    assert grown == 10, f"{grown}m of growth in one migration's attachment room"


_ATTACH_OPS: Final = (
    *("target-running", "target-pending", "relabel", "attached", "detached", "target-gone"),
    *("vmim-pending", "vmim-running", "vmim-gone", "volumes-off", "volumes-on"),
    *("second-target", "second-gone", "attached-to-second", "self-owned"),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_ATTACH_OPS), max_size=10))
def test_the_folds_attachment_rooms_follow_its_objects_after_every_event(ops: list[str]) -> None:
    """The fold keeps which migrations room may be held for whose target's attachment pod (``attaching``), derived
    from a migration's phase, its VMI's hotplugged volumes, its target's label and phase and an attachment pod:
    after every event it is what those objects say, whatever their order. It was not recomputed when a running
    pod's ``migrationJobUID`` was rewritten (the tenant's to write without the guard): a resize into the room
    held for that target went unmarked, round after round."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    plain = copy.deepcopy(vmis[0])
    plain["status"]["volumeStatus"] = []
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    attachment = _attachment_pod(target, "hp-volume-tgt", t=201)
    second = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n3", t=202)
    second["metadata"] |= {"name": "second-target", "uid": "uid-second-target"}
    history: list[dict[str, Any]] = [*full, vmim_obj("m1", "vm0", t=100)]
    for op in ops:
        if op == "target-gone":
            history.append(deleted(target))
        elif op in ("second-target", "second-gone"):
            history.append(second if op == "second-target" else deleted(second))
        elif op == "attached-to-second":  # (the attachment pod's controller reference moved to the other target)
            attachment = copy.deepcopy(attachment)
            ref = attachment["metadata"]["ownerReferences"][0]
            ref["uid"] = (
                second["metadata"]["uid"] if ref["uid"] == target["metadata"]["uid"] else target["metadata"]["uid"]
            )
            history.append(attachment)
        elif op == "self-owned":  # (the tenant names the target its own attachment pod's owner)
            target = copy.deepcopy(target)
            refs = target["metadata"].get("ownerReferences") or []
            own = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": target["metadata"]["name"],
                "uid": target["metadata"]["uid"],
                "controller": True,
            }
            target["metadata"]["ownerReferences"] = [] if own in refs else [own]
            history.append(target)
        elif op.startswith("target") or op == "relabel":
            target = copy.deepcopy(target)
            if op == "relabel":
                labels = target["metadata"]["labels"]
                labels[MIGRATION_JOB_LABEL] = "other" if labels.get(MIGRATION_JOB_LABEL) == "mig-m1" else "mig-m1"
            else:
                target["status"]["phase"] = "Pending" if op == "target-pending" else "Running"
            history.append(target)
        elif op in ("attached", "detached"):
            history.append(attachment if op == "attached" else deleted(attachment))
        elif op.startswith("vmim"):
            migration = vmim_obj("m1", "vm0", t=100, phase=op.removeprefix("vmim-").capitalize())
            history.append(deleted(migration) if op == "vmim-gone" else migration)
        else:
            history.append(copy.deepcopy(plain if op == "volumes-off" else vmis[0]))
        state = folded(history).state("c1", NS)
        assert state is not None
        assert state.attaching == attaching_of(state), (ops, state.attaching)
        restored = NamespaceState.from_checkpoint(state.checkpoint())
        assert restored.attaching == state.attaching
        assert (restored.attach_refs, restored.awaiting) == (state.attach_refs, state.awaiting), ops


def test_without_the_guard_an_attachment_room_of_a_target_relabelled_is_not_taken_again() -> None:
    """The target's first version carried another ``migrationJobUID`` (the tenant's patch, without the guard), then
    this migration's: the fold did not see that room may be held for its attachment pod, and an old pod resized
    into it had it held again and took it again, 100m of CPU in 10 rounds."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    filler = next(p for p in full if p["metadata"]["name"] == "filler")
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    other = copy.deepcopy(target)
    other["metadata"]["labels"][MIGRATION_JOB_LABEL] = "other"
    history = [*full, vmim_obj("m1", "vm0", t=100), other, target]
    assert [m.state for m in account_history(history).migrations] == ["attachment-reserved"]
    grown = _grown_round_after_round(history, lambda grown: [_resized_by(filler, grown)])
    assert grown == 10, f"{grown}m of growth took the attachment room of one migration, round after round"


def test_a_resize_once_the_attachment_pod_exists_holds_no_later_drain_back() -> None:
    """Once the target's attachment pod exists accounting holds no room for it (the migration still ``Pending`` until
    that pod is ready), and the room held for it went to it: an app resized then (a vertical autoscaler), inside the
    budget, was marked as one that took it, and held a later drain back, in a namespace over its budget for
    KubeVirt's reason, for as long as the app ran."""
    objects, other, _, ratio = _drained_later(hotplugged=True)
    app, grown = pod_obj("app", {"memory": "100Mi"}, t=10), pod_obj("app", {"memory": "200Mi"}, t=10)
    pending, failed = vmim_obj("m0", "o", t=100, phase="Pending"), vmim_obj("m0", "o", t=100, phase="Failed")
    target = launcher_obj(
        other, config=ratio, facts=NamespaceFacts(), migration_uid="mig-m0", node="n2", t=200, vouched=False
    )
    attachment = _attachment_pod(target, "hp-volume-tgt", t=201)
    history = [*objects, app, pending, target, attachment, grown]
    history += [failed, deleted(target), deleted(attachment), deleted(failed)]
    history.append(vmim_obj("drain", "v", t=300, rejected=True))
    drain = mig(account_history(history, config=ratio), "drain")
    assert drain.state == PENDING, f"{drain.state}: {drain.reason}"


@pytest.mark.parametrize("migration", ["kept", "deleted"])
def test_an_ordinary_migration_of_a_vm_with_hotplugged_volumes_holds_no_later_drain_back(migration: str) -> None:
    """KubeVirt's own migration of a VM with a hotplugged volume (target created, running, its attachment pod, the
    migration on to Succeeded, the source gone; the migration then deleted, by KubeVirt's clean-up of finalized
    migrations or the tenant), then a drain in a namespace over its budget for KubeVirt's reason (an overhead ratio
    set after). Keeping an attachment pod's room as a window, with the pods created in it, marked that target, now
    the VM's launcher pod, and the drain waited for as long as the VM ran: no pod of KubeVirt's is marked."""
    plain = KubeVirtConfig()
    objects, o, source_o, ratio = _drained_later(hotplugged=True, o_rendered=plain)
    attached_to_source = _attachment_pod(source_o, "hp-volume-src", t=6)
    starting = launcher_obj(
        o,
        config=plain,
        facts=NamespaceFacts(),
        migration_uid="mig-m0",
        node="n2",
        t=200,
        phase="Pending",
        vouched=False,
    )
    target = copy.deepcopy(starting)
    target["status"]["phase"] = "Running"
    attachment = _attachment_pod(target, "hp-volume-tgt", t=201)
    moved = copy.deepcopy(o)
    moved["status"]["activePods"] = {}
    vouch(moved, target)
    moved["status"]["migrationState"] = {"migrationUid": "mig-m0", "targetPod": target["metadata"]["name"]}
    history = [*objects, attached_to_source, vmim_obj("m0", "o", t=100), starting, target]
    history += [attachment, *(vmim_obj("m0", "o", t=100, phase=p) for p in ("Scheduling", "Running", "Succeeded"))]
    history += [moved, deleted(source_o), deleted(attached_to_source)]
    if migration == "deleted":
        history.append(deleted(vmim_obj("m0", "o", t=100, phase="Succeeded")))
    assert not folded(history).view("c1", NS).late
    drain = mig(account_history([*history, vmim_obj("drain", "v", t=300, rejected=True)], config=ratio), "drain")
    assert drain.state == PENDING, f"{drain.state}: {drain.reason}"


def test_a_targets_attachment_room_is_held_only_once_the_target_runs() -> None:
    """virt-controller creates the attachment pod only once the target is ready (``migration.go``: otherwise
    ``handlePendingPodTimeout``): room held before would be open to any pod (with the guard, the namespace closed)
    while the target schedules, pulls its image or never starts."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    migration = vmim_obj("m1", "vm0", rejected=True)
    pending = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="", t=200, phase="Pending")
    (entry,) = account([*full, migration, pending]).migrations
    assert entry.state == "target-created" and not entry.reserved, entry


def test_a_tenants_pod_controlled_by_a_target_gets_no_room_from_its_attachment_reservation() -> None:
    """A tenant may give its pod a controller reference to the migration target (KubeVirt then takes it for the
    attachment pod and makes none): the reservation ends, and the pod counts at its full charge as any plain pod,
    so it gains nothing beyond its own migration waiting."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    migration = vmim_obj("m1", "vm0", rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    forged = _attachment_pod(target, "mine", t=201)
    forged["spec"]["containers"][0]["resources"] = {"requests": {"memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    u = account([*full, migration, target, forged])
    assert [m.state for m in u.migrations] == ["target-created"] and not u.quotas["rq"].reserved
    (entry,) = [e for e in u.pods if e.name == "mine"]
    assert entry.role == "non-vm" and entry.charged["limits.memory"] == Quantity.parse("4Gi")
    assert "limits.memory" in u.quotas["rq"].over_budget, "it counts, and the namespace is over its budget by it"


def test_a_targets_attachment_pod_in_the_room_held_for_it_holds_no_other_migration_back() -> None:
    """The attachment pod gets into room held for it beyond the budget, and counts as a plain pod: the namespace
    is over its budget by it while vm0 migrates. A drain's migration of vm1, refused meanwhile, found the namespace
    over its budget with a pod created after it (the attachment pod) and got no room until vm0's migration ended
    (on a real cluster KubeVirt waits for that pod to be ready, for as long as that takes). The room held for it,
    for a pod charged no more than an attachment pod, keeps no other migration out; a pod KubeVirt does not see (no
    label key ``kubevirt.io``) is no attachment pod, and a look-alike charged more got in through other room."""
    full, vmis, facts = _full_with_a_hotplugged_volume()
    first = vmim_obj("m1", "vm0", t=150, phase="Scheduling")
    drain = vmim_obj("m2", "vm1", t=199, rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    attachment = _attachment_pod(target, "hp-volume-tgt", t=201)
    u = account([*full, first, drain, target, attachment])
    assert "limits.memory" in u.quotas["rq"].over_budget, "over its budget by the attachment pod"
    assert {m.name: m.state for m in u.migrations} == {"m1": "target-created", "m2": "pending"}, u.migrations
    unseen = copy.deepcopy(attachment)
    unseen["metadata"]["labels"] = {}  # (KubeVirt's pod informer does not see it: it is no attachment pod)
    u = account([*full, first, drain, target, unseen])
    assert {m.name: m.state for m in u.migrations} == {"m1": "target-created", "m2": "waiting"}, u.migrations
    larger = copy.deepcopy(attachment)
    larger["spec"]["containers"][0]["resources"] = {"requests": {"memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    u = account([*full, first, drain, target, larger])
    assert {m.name: m.state for m in u.migrations} == {"m1": "target-created", "m2": "waiting"}, u.migrations
    later = vmim_obj("m2", "vm1", t=201, rejected=True)  # (only the look-alike is created after it)
    u = account([*full, first, later, target, larger])
    assert {m.name: m.state for m in u.migrations} == {"m1": "target-created", "m2": "waiting"}, u.migrations


def test_a_target_created_in_its_migrations_second_is_its_target() -> None:
    """Creation times are to the second and virt-controller creates the target pod within milliseconds of the
    migration: a target created in the migration's second is KubeVirt's target (only a pod created *before* the
    migration is none of its targets), counted with its VM; its room is not reserved a second time."""
    quota, vmis, pods = full_64gi()
    facts = facts_for(["limits.memory"])
    migration = vmim_obj("m1", "vm0", t=100, phase="Scheduling", rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=100)
    u = account([quota, *vmis, *pods, migration, target])
    m = mig(u, "m1")
    assert m.state == TARGET_CREATED and not m.reserved, m
    assert u.quotas["rq"].reserved == {}
    assert {e.name: e.role for e in u.pods}[target["metadata"]["name"]] == MIGRATION_TARGET
    q = u.quotas["rq"]
    assert fits({"limits.memory": usage_of(pods[0])["limits.memory"]}, q.pods, q.hard) != [], "no room opened twice"


def test_the_evidence_bound_is_an_eighth_of_the_estimate_or_its_floor_whichever_is_larger() -> None:
    """A refusal Event is anyone's to write: its amounts may raise an estimate by the larger of an eighth of it and
    a floor (256Mi for bytes, 250m for others), never by their sum, and pod counts not at all."""
    from shared.accounting.estimates import evidence_bound, widened
    from shared.quantity import Quantity

    Q = Quantity.parse
    assert evidence_bound("limits.memory", Q("16Gi")) == Q("2Gi")  # (the eighth)
    assert evidence_bound("limits.memory", Q("1Gi")) == Q("256Mi")  # (the floor)
    assert evidence_bound("requests.cpu", Q("8")) == Q("1")
    assert evidence_bound("requests.cpu", Q("1")) == Q("250m")
    assert evidence_bound("count/pods", Q("1")) == Q("0")
    assert widened({"limits.memory": Q("16Gi")}) == {"limits.memory": Q("18Gi")}


def test_a_pod_created_in_the_migrations_second_that_took_an_attachment_room_is_not_followed_by_another() -> None:
    """Creation times are to the second: a pod created in the migration's own second came in its refusal as much as
    one created after it (``Migrations._after``), and once it took the attachment pod's room (the namespace over its
    budget by it) that room is not held again."""

    full, vmis, facts = _full_with_a_hotplugged_volume()
    migration = vmim_obj("m1", "vm0", t=100, rejected=True)
    target = launcher_obj(vmis[0], facts=facts, migration_uid="mig-m1", node="n2", t=200)
    assert [m.state for m in account([*full, migration, target]).migrations] == ["attachment-reserved"]
    taker = pod_obj("taker", {"cpu": "10m", "memory": "2M"}, {"cpu": "100m", "memory": "80M"}, t=100)
    (entry,) = account([*full, migration, target, taker]).migrations
    assert entry.state == "waiting" and "no room held for its hotplug attachment pod" in entry.reason, entry
