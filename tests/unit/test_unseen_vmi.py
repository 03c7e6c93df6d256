"""A launcher pod whose VMI vmquota has not seen: the watcher dead-lettered the VMI (a spec vmquota's parser refuses
though KubeVirt accepts it, an event too large for the bus), or its event has not arrived yet. Counted as a plain pod
at its charge, it counted ``k`` times less than the VM running in it in a VM-term mode's scaled resource (400m for 4
vCPUs at KubeVirt's default ratio), and another VM fitted beside it. A pod that names a VMI the namespace has no VMI
of counts its charge over ``k``; KubeVirt's command for the pod's ``compute`` container names the VMI, and a pod's
containers cannot be changed, so taking the pod's labels and owner reference off changes nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shared.accounting.namespace import account_view, by_kind
from shared.accounting.results import ADMITTED, NON_VM, REFUSED, NamespaceUsage
from shared.kubevirt.command import LAUNCHER_MONITOR, launched_vmi_uid
from shared.normalize import normalize
from shared.quantity import Quantity
from shared.quota.modes import Mode
from shared.snapshot import PodSnapshot
from tests.builders import (
    NOW,
    account,
    account_history,
    facts_for,
    launcher_obj,
    pod_obj,
    quota_obj,
    refused_vmi,
    snaps,
    usage_of,
    vmi_obj,
    vouch,
)

Q = Quantity.parse
BUDGET = {"requests.cpu": "4"}


def vm(u: NamespaceUsage, name: str) -> Any:
    return next(e for e in u.vms if e.name == name)


def unseen_launcher(*, stripped: bool) -> dict[str, Any]:
    """The running launcher pod of a 4-vCPU VM whose VMI vmquota never saw; ``stripped``: its tenant took its
    labels and owner references off."""
    pod = launcher_obj(vmi_obj("hidden", vcpus=4), facts=facts_for(BUDGET), vouched=False)
    if stripped:
        pod["metadata"]["labels"] = {}
        pod["metadata"]["ownerReferences"] = []
    return pod


def fits_natively(u: NamespaceUsage, pod: dict[str, Any]) -> bool:
    q = u.quotas["rq"]
    return all(q.pods.get(r, Q("0")) + amount <= q.hard[r] for r, amount in usage_of(pod).items() if r in q.hard)


@pytest.mark.parametrize("stripped", [False, True])
@pytest.mark.parametrize("mode", [Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO])
def test_a_launcher_pod_whose_vmi_is_not_in_view_counts_as_the_vm_it_runs(mode: Mode, stripped: bool) -> None:
    budget = {"requests.cpu": "4"} if mode == Mode.VIRTUAL_RESOURCES else {"requests.cpu": "400m"}
    pod = unseen_launcher(stripped=stripped)
    waiting = refused_vmi(vmi_obj("next", vcpus=3, t=100, phase="Pending", node=""))
    u = account([quota_obj("rq", budget, mode), pod, waiting])
    assert vm(u, "next").state == REFUSED, vm(u, "next").reason
    assert u.quotas["rq"].used["requests.cpu"] >= Q(budget["requests.cpu"])
    [entry] = u.pods
    assert entry.role == NON_VM or not stripped
    assert "not in view" in entry.reason
    # and the refused VM's pod is refused natively too: the room hard leaves follows W, which takes k * U
    assert not fits_natively(u, launcher_obj(vmi_obj("next", vcpus=3), facts=facts_for(budget), vouched=False))


def test_a_pod_naming_a_vmi_in_view_is_a_plain_pod_at_its_charge() -> None:
    """The VMI is in view (pending, say, KubeVirt not having named the pod in its status yet): its pod is a plain pod
    at its charge, as before; the VM counts once, through its VMI."""
    vmi = vmi_obj("v", vcpus=4, phase="Scheduling", node="")
    pod = launcher_obj(vmi_obj("v", vcpus=4), facts=facts_for(BUDGET), vouched=False)
    u = account([quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES), vmi, pod])
    [entry] = u.pods
    assert entry.counts == entry.charged and "not in view" not in entry.reason


def test_in_pod_terms_a_pod_of_a_vmi_not_in_view_counts_its_charge() -> None:
    """``VmiPodUsage`` counts every pod at its charge (``k`` is 1): nothing changes."""
    pod = unseen_launcher(stripped=False)
    u = account([quota_obj("rq", BUDGET, Mode.VMI_POD_USAGE), pod])
    assert u.quotas["rq"].used["requests.cpu"] == usage_of(pod)["requests.cpu"]


def test_a_tenants_plain_pod_naming_a_made_up_vmi_only_counts_more() -> None:
    """Anyone may write KubeVirt's launcher command in a pod: naming a VMI the namespace has none of makes the pod
    count more, never less. An owner reference or a label naming one changes nothing (KubeVirt's own pods always
    carry the command; a tenant's pod that only says so is a plain pod)."""
    commanded = pod_obj("p", {"cpu": "200m"}, {"cpu": "200m"})
    commanded["spec"]["containers"][0] |= {"name": "compute", "command": [LAUNCHER_MONITOR, "--uid", "made-up"]}
    labelled = pod_obj("p", {"cpu": "200m"}, {"cpu": "200m"})
    labelled["metadata"]["ownerReferences"] = [{"kind": "VirtualMachineInstance", "name": "x", "uid": "made-up"}]
    labelled["metadata"]["labels"] = {"kubevirt.io/created-by": "made-up"}
    waiting = refused_vmi(vmi_obj("next", vcpus=3, t=100, phase="Pending", node=""))
    quota = quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES)
    for plain in (pod_obj("p", {"cpu": "200m"}, {"cpu": "200m"}), labelled):
        assert vm(account([quota, plain, waiting]), "next").state == ADMITTED
    u = account([quota, commanded, waiting])
    assert u.quotas["rq"].used["requests.cpu"] == Q("2") and vm(u, "next").state == REFUSED


def test_the_vmi_a_pods_command_names_is_read_only_from_kubevirts_command() -> None:
    pod = unseen_launcher(stripped=True)
    snap = normalize(pod)
    assert isinstance(snap, PodSnapshot) and snap.command_vmi_uid == "uid-hidden"
    compute = next(c for c in pod["spec"]["containers"] if c["name"] == "compute")
    for command, uid in [
        (["/bin/sh", "-c", f"{LAUNCHER_MONITOR} --uid x"], ""),
        ([LAUNCHER_MONITOR, "--name", "n", "--uid"], ""),
        ([LAUNCHER_MONITOR, "--uid", "u" * 300], ""),  # (no uid is that long)
        ([LAUNCHER_MONITOR, "--uid", 7], ""),
    ]:
        compute["command"] = command
        snap = normalize(pod)
        assert isinstance(snap, PodSnapshot) and snap.command_vmi_uid == uid, command
    assert launched_vmi_uid("not a list") == "" and launched_vmi_uid([{"name": "compute"}]) == ""


def test_the_vm_is_admitted_once_its_vmi_is_in_view_and_fits() -> None:
    """Once the VMI is seen (and names its pod), the pod counts through its VM as before."""
    hidden = vmi_obj("hidden", vcpus=2)
    pod = launcher_obj(hidden, facts=facts_for(BUDGET))
    waiting = refused_vmi(vmi_obj("next", vcpus=2, t=100, phase="Pending", node=""))
    u = account([quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES), hidden, pod, waiting])
    assert vm(u, "next").state == ADMITTED, vm(u, "next").reason


def test_a_budget_that_comes_to_name_a_resource_is_accounted_afresh() -> None:
    """The passes are remembered by the quotas' names, modes and ratios, and by their factors, which follow the
    resources a budget names: an administrator adds ``requests.cpu`` to a budget while no pod or VMI changes (a
    ledger's view keeps the same lists). Without the factors in the key, the pod of a VMI not in view kept counting
    its charge and a 3-vCPU VM got into a 4-vCPU budget beside it."""
    pod = launcher_obj(vmi_obj("hidden", vcpus=4), facts=facts_for(BUDGET), vouched=False)
    waiting = refused_vmi(vmi_obj("next", vcpus=3, t=100, phase="Pending", node=""))
    base = snaps([pod, waiting])
    before = snaps([quota_obj("rq", {"requests.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)])
    after = snaps([quota_obj("rq", {"requests.cpu": "4", "requests.memory": "64Gi"}, Mode.VIRTUAL_RESOURCES)])
    ns, first = by_kind(base + before, distinct=True)
    _, second = by_kind(base + after, distinct=True)
    second = {**first, "ResourceQuota": second["ResourceQuota"]}  # (the same pod and VMI lists, as a ledger view)
    account_view(first, ns, now=NOW)
    remembered = account_view(second, ns, now=NOW)
    fresh = account_view(second, ns, now=NOW, memoize=False)
    assert remembered.quotas["rq"].used == fresh.quotas["rq"].used
    assert remembered.quotas["rq"].hard == fresh.quotas["rq"].hard
    assert vm(remembered, "next").state == REFUSED


@pytest.mark.parametrize("forged", [False, True])
def test_a_launcher_pod_moved_to_a_decoy_vmi_does_not_count_as_the_decoy(forged: bool) -> None:
    """A tenant moves the launcher pod of a 4-vCPU VMI vmquota has not seen (or one it deleted, the pod orphaned) to
    a controller reference to a small VMI of its own, which KubeVirt then lists the pod in: the pod counted through
    the decoy (1 vCPU with an explicit 400m request, or a 4-vCPU decoy whose status says one socket), and a 3-vCPU
    VM got into a 4-vCPU budget. The pod's launcher command names the VMI it was made for: it is no other's."""
    pod = launcher_obj(vmi_obj("hidden", vcpus=4), facts=facts_for(BUDGET), vouched=False)
    pod["metadata"]["ownerReferences"] = [
        {"kind": "VirtualMachineInstance", "name": "decoy", "uid": "uid-decoy", "controller": True}
    ]
    pod["metadata"]["labels"] = {}
    decoy = (
        vmi_obj("decoy", vcpus=4, guest="2Gi", status_vcpus=1)
        if forged
        else vmi_obj("decoy", vcpus=1, requests={"cpu": "400m"})
    )
    vouch(decoy, pod)
    waiting = refused_vmi(vmi_obj("next", vcpus=3, t=100, phase="Pending", node=""))
    u = account([quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES), pod, decoy, waiting])
    assert vm(u, "next").state == REFUSED, vm(u, "next").reason
    [entry] = u.pods
    assert entry.vmi == "" and "not in view" in entry.reason


def test_a_launcher_pod_kubevirt_named_stays_its_vms_when_a_decoy_names_it() -> None:
    """The same with a VMI the ledger saw: deleted with orphan propagation, its pod runs on and is remembered as its
    VM's (``departed``). Named by the decoy, the fold forgot that, and the pod counted as the decoy."""
    old = vmi_obj("hidden", vcpus=4)
    pod = launcher_obj(old, facts=facts_for(BUDGET))
    gone = copy.deepcopy(old)
    gone["status"]["phase"] = "Failed"
    gone["status"]["activePods"] = {}
    moved = copy.deepcopy(pod)
    moved["metadata"]["ownerReferences"] = [
        {"kind": "VirtualMachineInstance", "name": "decoy", "uid": "uid-decoy", "controller": True}
    ]
    decoy = vmi_obj("decoy", vcpus=1, requests={"cpu": "400m"})
    vouch(decoy, moved)
    waiting = refused_vmi(vmi_obj("next", vcpus=3, t=100, phase="Pending", node=""))
    quota = quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES)
    u = account_history([quota, old, pod, gone, moved, decoy, waiting])
    assert vm(u, "hidden").counts["rq"]["requests.cpu"] == Q("4"), vm(u, "hidden").reason
    assert vm(u, "next").state == REFUSED, vm(u, "next").reason
    # and once the decoy lets go of it again (its reference taken off, the decoy finished): still the VM it runs
    released = copy.deepcopy(moved)
    released["metadata"]["ownerReferences"] = []
    decoy_done = copy.deepcopy(decoy)
    decoy_done["status"] = {"phase": "Succeeded"}
    u = account_history([quota, old, pod, gone, moved, decoy, released, decoy_done, waiting])
    assert vm(u, "hidden").counts["rq"]["requests.cpu"] == Q("4"), vm(u, "hidden").reason
    assert vm(u, "next").state == REFUSED, vm(u, "next").reason


def test_a_tenants_pod_kubevirt_let_go_of_is_a_plain_pod_not_the_vm() -> None:
    """KubeVirt lists every pod with a controller reference to a VMI in its ``activePods``, a tenant's too; once the
    VM finished, that pod runs on while no VMI names it. Only a pod whose launcher command names the VMI can run its
    guest: the tenant's pod is a plain pod at its charge, and the finished VM counts nothing (found by the property
    tests: remembered as the VM's, the pod kept the VM counting)."""
    vmi = vmi_obj("v", vcpus=2)
    pod = launcher_obj(vmi, facts=facts_for(BUDGET))
    extra = pod_obj("extra", {"cpu": "100m"}, {"cpu": "100m"})
    extra["metadata"]["ownerReferences"] = [
        {"kind": "VirtualMachineInstance", "name": "v", "uid": "uid-v", "controller": True}
    ]
    vouch(vmi, extra)
    done = copy.deepcopy(vmi)
    done["status"] = {"phase": "Succeeded"}
    ended = copy.deepcopy(pod)
    ended["status"]["phase"] = "Succeeded"
    quota = quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES)
    u = account_history([quota, vmi, pod, extra, done, ended])
    assert vm(u, "v").state == "stopped", vm(u, "v").reason
    assert u.quotas["rq"].used["requests.cpu"] == Q("100m")


def test_the_pod_of_a_vmi_still_pending_as_vmquota_sees_it_counts_as_the_vm_it_may_run() -> None:
    """KubeVirt names a new launcher pod in the write that moves its VMI past ``Pending``, which the watches may
    bring after the pod. As a plain pod at its charge (400m for 4 vCPUs), the pod took the pending VMI's own room:
    the VMI did not fit and counted nothing, and a 3-vCPU VM refused for room was admitted, with room reserved for
    its pod: 7 vCPUs on 4. The pod of a VMI KubeVirt has not synced counts as the VM it may run."""
    quota = quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES)
    pod = launcher_obj(vmi_obj("v1", vcpus=4, t=10), facts=facts_for(BUDGET), vouched=False, t=11)
    v1 = vmi_obj("v1", vcpus=4, t=10, phase="Pending", node="")
    v2 = refused_vmi(vmi_obj("v2", vcpus=3, t=20, phase="Pending", node=""))
    for u in (account_history([quota, v1, v2, pod]), account([quota, v1, v2, pod])):
        assert vm(u, "v2").state == REFUSED, vm(u, "v2").reason
        assert u.quotas["rq"].used["requests.cpu"] >= Q("4"), u.quotas["rq"].used
    synced = vmi_obj("v1", vcpus=4, t=10)
    vouch(synced, pod)
    u = account([quota, synced, v2, pod])
    assert vm(u, "v1").counts["rq"]["requests.cpu"] == Q("4") and vm(u, "v2").state == REFUSED


def test_a_pending_vmi_is_not_refused_for_the_room_its_own_pod_takes() -> None:
    """An honest VM in a namespace with just enough room: its pod's event came before the VMI's move past
    ``Pending``, and the pod counts as the VM. The VMI was refused for want of the room its own pod took, and the
    tenant told its VM did not fit while it started. It is admitted, its size in its pod's stead, counted once, and
    no room is held for a second pod (KubeVirt's old refusal condition is still on the VMI). A tenant's small pod
    naming it does not make it count less than its size."""
    quota = quota_obj("rq", BUDGET, Mode.VIRTUAL_RESOURCES)
    v1 = refused_vmi(vmi_obj("v1", vcpus=4, t=10, phase="Pending", node=""))
    pod = launcher_obj(vmi_obj("v1", vcpus=4, t=10), facts=facts_for(BUDGET), vouched=False, t=11)
    for u in (account_history([quota, v1, pod]), account([quota, v1, pod])):
        entry = vm(u, "v1")
        assert entry.state == ADMITTED and not entry.reserved, entry.reason
        assert not u.quotas["rq"].reserved, "no room for a second pod"
        assert Q("4") <= u.quotas["rq"].used["requests.cpu"] < Q("4.5"), "counted once"
    small = pod_obj("small", {"cpu": "10m"})
    small["spec"]["containers"][0]["name"] = "compute"
    small["spec"]["containers"][0]["command"] = [LAUNCHER_MONITOR, "--uid", "uid-v1"]
    u = account([quota, v1, small])
    assert vm(u, "v1").state == ADMITTED and u.quotas["rq"].used["requests.cpu"] >= Q("4"), u.quotas["rq"].used
    too_big = refused_vmi(vmi_obj("v1", vcpus=6, t=10, phase="Pending", node=""))
    u = account([quota, too_big, launcher_obj(vmi_obj("v1", vcpus=6, t=10), facts=facts_for(BUDGET), vouched=False)])
    assert vm(u, "v1").state == REFUSED, "a VM that does not fit beside nothing is still refused"
