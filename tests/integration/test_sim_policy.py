"""The simulated API server's ValidatingAdmissionPolicy evaluation (CEL, by cel-expr-python) and its identities, against
the semantics of kube-apiserver's ``admission/plugin/policy/validating`` (v1.32): matching, parameters,
``parameterNotFoundAction``, ``failurePolicy``, the message rules and the denial's status — and the reservation
guard policy vmquota ships (``deploy/components/reservation-guard/policy.yaml``), evaluated as the API server runs
it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest
import yaml

from services.devtools.simcluster.auth import ADMIN, GARBAGE_COLLECTOR, KUBEVIRT_CONTROLLER, UserInfo, acting_as
from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.kubevirt import MIGRATION_FINALIZER
from services.devtools.simcluster.policy import MAX_MESSAGE_EXPRESSION_BYTES, _matches_rule
from services.devtools.simcluster.registry import DEFAULT_REGISTRY
from services.devtools.simcluster.store_api import ApiError, Obj
from shared.normalize import parse_refusal
from shared.podusage import pod_quota_usage
from shared.quantity import Quantity
from shared.quota import guard
from shared.quota.annotations import (
    BUDGET_ANNOTATION,
    ENFORCED_BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    MANAGED_LABEL,
    MODE_ANNOTATION,
    RATIO_ANNOTATION,
    STATUS_ANNOTATION,
    VMI_MINIMUM_ANNOTATIONS,
)
from shared.quota.enforcement import rl_json
from shared.resources import format_resource_list, parse_resource_list
from shared.vmi import GUARD_REFUSER, room_refuser
from tests.builders import created_vmi

ROOT = Path(__file__).resolve().parents[2]
GUARD_POLICY = ROOT / "deploy" / "components" / "reservation-guard" / "policy.yaml"
COLLECTOR = GARBAGE_COLLECTOR
NS = "t1"
TENANT = UserInfo("mallory", tenant_of=frozenset({NS}))


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster() as s:
        await s.create_namespace(NS, {"team": "a"})
        await s.create_namespace("other")
        yield s


def pod(
    name: str,
    *,
    owner_uid: str | None = None,
    controller: bool = True,
    namespace: str = NS,
    requests: Obj | None = None,
) -> Obj:
    container: Obj = {"name": "c", "image": "busybox"}
    if requests is not None:
        container["resources"] = {"requests": requests}
    p: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [container]},
    }
    if owner_uid is not None:
        p["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstance",
                "name": "vm1",
                "uid": owner_uid,
                "controller": controller,
            }
        ]
    return p


SMALL: Final[Obj] = {"cpu": "100m", "memory": "64Mi"}
"""A plain pod's requests that fit every quota of these tests."""


async def create_as(sim: SimCluster, user: UserInfo, obj: Obj) -> ApiError | None:
    with acting_as(user):
        try:
            await sim.create(obj)
        except ApiError as e:
            return e
    return None


async def install(sim: SimCluster, text: str) -> None:
    for doc in yaml.safe_load_all(text):
        await sim.create(doc)


async def reserve(sim: SimCluster, *holders: guard.Holder) -> None:
    await sim.apply(guard.reservation(NS, frozenset(holders), [KUBEVIRT_CONTROLLER.username]))


HOLDER = guard.Holder("uid-vm1", "vm1", "migration vm1-mig")


# ---- the shipped guard --------------------------------------------------------------------------------------------


async def test_the_guard_admits_everyone_while_nothing_is_reserved(sim: SimCluster) -> None:
    await install(sim, GUARD_POLICY.read_text())
    assert await create_as(sim, TENANT, pod("no-param")) is None  # no QuotaReservation: parameterNotFoundAction
    await reserve(sim)
    assert await create_as(sim, TENANT, pod("no-holders")) is None


async def test_while_room_is_reserved_only_kubevirt_creates_and_only_for_a_holder(sim: SimCluster) -> None:
    await install(sim, GUARD_POLICY.read_text())
    await reserve(sim, HOLDER)
    err = await create_as(sim, TENANT, pod("plain"))
    assert err is not None and err.code == 403 and err.reason == "Forbidden"
    assert err.message == (
        "pods \"plain\" is forbidden: ValidatingAdmissionPolicy 'vmquota-reservation-guard' with binding "
        "'vmquota-reservation-guard' denied request: vmquota: exceeded quota: the room in this namespace is reserved "
        "for vm1 (migration vm1-mig) until those pods exist; retry in a moment"
    )
    # a tenant's pod with the holder's controller reference is still the tenant's
    assert await create_as(sim, TENANT, pod("forged", owner_uid=HOLDER.uid)) is not None
    # KubeVirt, for another VMI, or without a controller reference
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("other-vmi", owner_uid="uid-vm9")) is not None
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("no-ctl", owner_uid=HOLDER.uid, controller=False)) is not None
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("target", owner_uid=HOLDER.uid)) is None
    # other namespaces have their own parameter (none here)
    assert await create_as(sim, TENANT, pod("elsewhere", namespace="other")) is None


def _sized_pod(name: str, shape: str) -> Obj:
    """KubeVirt's pod for the holder, of a shape whose charge quota admission computes otherwise than a plain sum."""
    p = pod(name, owner_uid=HOLDER.uid)
    main: Obj = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1536Mi"}}
    p["spec"]["containers"] = [{"name": "compute", "image": "x", "resources": main}]
    if shape in ("init", "sidecar"):
        big: Obj = {"requests": {"cpu": "1500m", "memory": "2Gi"}, "limits": {"cpu": "1500m", "memory": "2Gi"}}
        small: Obj = {"requests": {"cpu": "100m", "memory": "100Mi"}, "limits": {"cpu": 1, "memory": 104857600}}
        side: Obj = {"name": "side", "image": "x", "resources": small}
        if shape == "sidecar":  # (a restartable one, first: it runs beside the next init container too)
            side["restartPolicy"] = "Always"
        p["spec"]["initContainers"] = [side, {"name": "big-init", "image": "x", "resources": big}]
    if shape == "native-sidecar":  # (Istio's native sidecar: an init container, then the proxy, restartable)
        small_vm: Obj = {"requests": {"cpu": "100m", "memory": "1300Mi"}, "limits": {"cpu": "1", "memory": "1300Mi"}}
        p["spec"]["containers"][0]["resources"] = small_vm
        lim: Obj = {"requests": {"cpu": "10m", "memory": "40Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
        proxy: Obj = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
        p["spec"]["initContainers"] = [
            {"name": "istio-init", "image": "x", "resources": lim},
            {"name": "istio-proxy", "image": "x", "resources": proxy, "restartPolicy": "Always"},
        ]
    if shape == "pod-level-limits":  # (no smaller than any one container's limit, smaller than their sum)
        proxy = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
        p["spec"]["containers"].append({"name": "proxy", "image": "x", "resources": proxy})
        p["spec"]["resources"] = {"limits": {"cpu": "2", "memory": "2Gi"}}
    if shape == "injected":  # (a webhook's container, sized by an annotation)
        extra: Obj = {"requests": {"cpu": "10m", "memory": "8Gi"}, "limits": {"cpu": "10m", "memory": "8Gi"}}
        p["spec"]["containers"].append({"name": "proxy", "image": "x", "resources": extra})
    return p


@pytest.mark.parametrize("shape", ["plain", "init", "sidecar", "native-sidecar", "pod-level-limits", "injected"])
async def test_a_holders_pod_is_admitted_up_to_the_room_reserved_for_it_charged_as_quota_admission_charges_it(
    sim: SimCluster, shape: str
) -> None:
    """``hard`` pools every holder's room: a holder's pod larger than its own (a webhook's container sized by an
    annotation the tenant changed after the refusal its room was held at) took the room held for other holders.
    The guard holds a holder's pod to its room, in the resources listed, charged as quota admission charges it (the
    larger of the containers with the restartable init containers and of each init container, plus the overhead);
    its refusal names what the pod asks, as vmquota reads a quota's refusal. (The simulated cluster has no
    RuntimeClass to give a pod an overhead: ``tests/unit/test_guard_charge.py`` has the policy's charge with one.)"""
    await install(sim, GUARD_POLICY.read_text())
    charged = pod_quota_usage(_sized_pod("probe", shape))
    resources = ("requests.cpu", "requests.memory", "limits.cpu", "limits.memory", "cpu", "memory")
    room = tuple(sorted((r, charged[r].canonical()) for r in resources))
    await reserve(sim, guard.Holder(HOLDER.uid, HOLDER.name, HOLDER.reason, room))
    assert await create_as(sim, KUBEVIRT_CONTROLLER, _sized_pod("fits", shape)) is None, "its room, exactly"
    for r in resources:
        less = charged[r] - Quantity.parse("1m" if r.endswith("cpu") else "1")
        short = tuple(sorted((x, less.canonical() if x == r else q) for x, q in room))
        await reserve(sim, guard.Holder(HOLDER.uid, HOLDER.name, HOLDER.reason, short))
        err = await create_as(sim, KUBEVIRT_CONTROLLER, _sized_pod(f"over-{r.replace('.', '-')}", shape))
        assert err is not None and err.code == 403, r
        quota, asked = parse_refusal(err.message)
        assert quota == GUARD_REFUSER and asked == {x: charged[x] for x in resources}, (r, err.message)
        assert room_refuser(f"failed to create virtual machine pod: {err.message}") == GUARD_REFUSER


async def test_while_a_holders_room_changes_its_pod_fits_either_room_listed(sim: SimCluster) -> None:
    """A refusal's amounts raise the room held for a holder: until no quota carries the old room, the holder is
    listed once per room, each counted in the budget by the usage that reserved it, and its pod may be as large as
    either (held to the smaller, it waited for the old entry to go, which wakes nobody)."""
    await install(sim, GUARD_POLICY.read_text())
    charged = pod_quota_usage(_sized_pod("probe", "plain"))["limits.memory"]
    old = guard.Holder(
        HOLDER.uid, HOLDER.name, HOLDER.reason, (("limits.memory", (charged - Quantity.parse("1")).canonical()),)
    )
    new = guard.Holder(HOLDER.uid, HOLDER.name, HOLDER.reason, (("limits.memory", charged.canonical()),))
    await reserve(sim, old)
    assert await create_as(sim, KUBEVIRT_CONTROLLER, _sized_pod("old", "plain")) is not None
    await reserve(sim, old, new)
    assert await create_as(sim, KUBEVIRT_CONTROLLER, _sized_pod("either", "plain")) is None


async def test_a_migration_targets_attachment_pod_gets_into_the_room_reserved_for_it(sim: SimCluster) -> None:
    """KubeVirt gives a hotplug attachment pod a controller reference to the launcher pod it serves, not to the VMI:
    while the room of a migration target's attachment pod is reserved, the target pod is the holder, and KubeVirt's
    pod controlled by it gets in; a tenant's with the same reference does not, nor KubeVirt's for another pod."""
    await install(sim, GUARD_POLICY.read_text())
    holder = guard.Holder("uid-target", "vm1", "the attachment pod of migration vm1-mig")
    await reserve(sim, holder)

    def attachment(name: str, owner_uid: str) -> Obj:
        obj = pod(name)
        obj["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": "virt-launcher-vm1-t", "uid": owner_uid, "controller": True}
        ]
        return obj

    err = await create_as(sim, TENANT, attachment("forged", holder.uid))
    assert err is not None and "reserved for vm1 (the attachment pod of migration vm1-mig)" in err.message, err
    assert await create_as(sim, KUBEVIRT_CONTROLLER, attachment("other", "uid-another-pod")) is not None
    assert await create_as(sim, KUBEVIRT_CONTROLLER, attachment("hp-volume-x", holder.uid)) is None


async def test_a_holder_listed_unconfirmed_keeps_the_room_closed_to_its_own_pods_too(sim: SimCluster) -> None:
    """A holder listed ``confirmed: false`` (the enforcer has not yet read its VMI at the size its room was reserved
    at) closes the namespace like any holder, and admits not even KubeVirt's pods for it until it is confirmed."""
    await install(sim, GUARD_POLICY.read_text())
    await sim.apply(guard.reservation(NS, frozenset({HOLDER}), [KUBEVIRT_CONTROLLER.username], frozenset({HOLDER.uid})))
    err = await create_as(sim, KUBEVIRT_CONTROLLER, pod("target", owner_uid=HOLDER.uid))
    assert err is not None and err.code == 403 and "reserved for vm1 (migration vm1-mig)" in err.message
    assert await create_as(sim, TENANT, pod("plain")) is not None
    await reserve(sim, HOLDER)  # confirmed
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("target")) is not None, "(no controller reference)"
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("target", owner_uid=HOLDER.uid)) is None


async def test_the_guard_never_matches_the_control_plane_or_kubevirt(sim: SimCluster) -> None:
    """failurePolicy Fail keeps the guard closed when its parameter cannot be read; the namespaces of the control
    plane, KubeVirt and vmquota are outside it, so that can never stop them (even with holders listed there)."""
    await install(sim, GUARD_POLICY.read_text())
    for ns in ("kube-system", "kubevirt"):
        if sim.peek("namespaces", None, ns) is None:
            await sim.create_namespace(ns)
        await sim.apply(guard.reservation(ns, frozenset({HOLDER}), [KUBEVIRT_CONTROLLER.username]))
        assert await create_as(sim, TENANT, pod("system", namespace=ns)) is None, ns
    await reserve(sim, HOLDER)
    assert await create_as(sim, TENANT, pod("tenant")) is not None


async def test_a_guarded_denial_takes_no_quota(sim: SimCluster) -> None:
    """ValidatingAdmissionPolicy runs before ResourceQuota admission: a refused pod is never charged."""
    await install(sim, GUARD_POLICY.read_text())
    await sim.create_quota(NS, "compute", {"pods": "10"})
    await sim.wait_quota_synced(NS, "compute")
    await reserve(sim, HOLDER)
    assert await create_as(sim, TENANT, pod("plain")) is not None
    q = await sim.get("resourcequotas", NS, "compute")
    assert (q.get("status") or {}).get("used", {}).get("pods") == "0"


async def update_as(
    sim: SimCluster, user: UserInfo, name: str, change: Any, *, status: bool = False
) -> ApiError | None:
    res = sim.store.resource("virtualmachineinstances")

    def fn(obj: Obj) -> Obj:
        change(obj)
        return obj

    with acting_as(user):
        try:
            await sim.store.mutate(res, NS, name, fn, status=status)
        except ApiError as e:
            return e
    return None


async def guarded_vmis(sim: SimCluster, *, running: bool = False) -> None:
    """The shipped guard installed, and VMIs ``vm1`` and ``vm2`` created by KubeVirt (``running``: and running)."""
    await install(sim, GUARD_POLICY.read_text())
    with acting_as(KUBEVIRT_CONTROLLER):
        for name in ("vm1", "vm2"):
            await sim.create(created_vmi(name, namespace=NS))
    for name in ("vm1", "vm2") if running else ():
        await sim.wait_for_phase(NS, name, "Running")


def hotplug(obj: Obj) -> None:
    obj["spec"]["domain"]["memory"]["guest"] = "2Gi"


def two_sockets(obj: Obj) -> None:
    """A CPU hotplug to 2 sockets (the VM controller's patch of one)."""
    obj["spec"]["domain"]["cpu"]["sockets"] = 2


async def test_a_holder_vmis_size_cannot_change_while_its_room_is_reserved(sim: SimCluster) -> None:
    """A hotplug KubeVirt applies to a holder VMI (its migration target's room reserved) would make the next try
    of the target larger than its room: the policy refuses changes of the holder's ``cpu``, ``memory`` and
    ``resources`` until it is off the list, whoever writes them, and lets every other VMI update through."""
    await guarded_vmis(sim)
    uid = str((await sim.get("virtualmachineinstances", NS, "vm1"))["metadata"]["uid"])
    await reserve(sim, guard.Holder(uid, "vm1", "migration vm1-mig"))
    err = await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", hotplug)
    assert err is not None and err.code == 403, err
    assert err.message == (
        'virtualmachineinstances.kubevirt.io "vm1" is forbidden: ValidatingAdmissionPolicy '
        "'vmquota-reservation-holder-size' with binding 'vmquota-reservation-holder-size' denied request: vmquota: "
        "vm1 holds room reserved for its migration vm1-mig; its domain and networks can change once that pod exists; "
        "retry in a moment"
    )

    def resources(obj: Obj) -> None:
        obj["spec"]["domain"]["resources"] = {"requests": {"memory": "2Gi"}}

    def interface(obj: Obj) -> None:
        obj["spec"]["domain"].setdefault("devices", {})["interfaces"] = [{"name": "vf", "sriov": {}}]
        obj["spec"]["networks"] = [{"name": "vf", "multus": {"networkName": "sriov"}}]

    for change in (two_sockets, resources, interface):
        assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", change) is not None, change.__name__

    def label(obj: Obj) -> None:
        obj["metadata"].setdefault("labels", {})["touched"] = "yes"

    def phase(obj: Obj) -> None:
        obj.setdefault("status", {})["reason"] = "touched"

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", label) is None, "an update that keeps the size"
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", phase, status=True) is None, "a status update"
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm2", hotplug) is None, "a VMI that holds nothing"
    assert (await sim.get("virtualmachineinstances", NS, "vm1"))["spec"]["domain"]["memory"]["guest"] == "1Gi"
    await reserve(sim)  # its pod exists: off the list
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", hotplug) is None, "once it holds nothing"


async def test_a_vmi_keeps_its_size_until_it_runs_where_a_quota_is_managed(sim: SimCluster) -> None:
    """KubeVirt's VM controller patches a CPU hotplug into a VMI whatever its phase, and virt-launcher starts the
    domain from the spec, in a pod made for the old size: where a quota is managed, the policy refuses a change of
    the ``cpu``, ``memory`` or ``resources`` of a VMI's domain, from anyone, until the VMI runs; its other updates,
    its status and a VMI elsewhere are not affected."""
    sim.kubevirt.schedulable = set()  # (no node for the launcher pods: the VMIs wait, scheduling)
    await guarded_vmis(sim)
    await sim.wait_for_phase(NS, "vm1", "Scheduling")

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm2", two_sockets) is None, "no managed quota: no rule"
    await managed_pod_terms_quota(sim)
    err = await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", two_sockets)
    assert err is not None and err.code == 403, err
    assert err.message == (
        'virtualmachineinstances.kubevirt.io "vm1" is forbidden: ValidatingAdmissionPolicy '
        "'vmquota-vmi-start-size' with binding 'vmquota-vmi-start-size' denied request: vmquota: quota vm-budget "
        "counts VMs, and vm1 does not run yet: its launcher pod was made for the size it has, and its domain starts "
        "from its spec, so its cpu can change once it runs (a hotplug then); retry in a moment"
    )
    for change in (hotplug, lambda o: o["spec"]["domain"].update(resources={"requests": {"memory": "2Gi"}})):
        assert await update_as(sim, TENANT, "vm1", change) is not None
        assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", change) is not None

    def label(obj: Obj) -> None:
        obj["metadata"].setdefault("labels", {})["touched"] = "yes"

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", label) is None, "an update that keeps the size"
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    await sim.wait_for_phase(NS, "vm1", "Running")
    await sim.wait_quiet()

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", two_sockets) is None, "a hotplug of a running VMI"


async def test_a_vmi_keeps_its_size_while_a_migration_of_it_is_not_final(sim: SimCluster) -> None:
    """A migration's end gives the target's domain the spec's vCPUs whatever its pod was made for: the ninth policy
    refuses a change of a VMI's size, from anyone, while a migration of it has not Succeeded or Failed, from its
    creation on (before its target exists); other VMIs, and the same VMI once the migration is final, change."""
    await guarded_vmis(sim, running=True)
    sim.kubevirt.schedulable = set()  # (the target waits for a node: the migration stays before its hand-off)
    await sim.migrate(NS, "vm1", name="m1")

    def sockets(obj: Obj) -> None:
        obj["spec"]["domain"]["cpu"]["sockets"] += 1

    err = await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", sockets)
    assert err is not None and err.code == 403, err
    assert err.message == (
        'virtualmachineinstances.kubevirt.io "vm1" is forbidden: ValidatingAdmissionPolicy '
        "'vmquota-vmi-migration-size' with binding 'vmquota-vmi-migration-size' denied request: vmquota: vm1 migrates "
        "(m1): its target pod is made for the size it has, and the migration gives the guest its spec, so its cpu can "
        "change once that migration is over (a hotplug then); retry in a moment"
    )
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm2", sockets) is None, "another VMI"
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    await sim.wait_for_phase(NS, "m1", "Succeeded", kind="vmim")
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", sockets) is None, "once the migration is over"


async def test_only_kubevirt_migrates_a_vmi_with_a_cpu_or_memory_hotplug_pending(sim: SimCluster) -> None:
    """KubeVirt renders a migration's target from its own cache of the VMI, which may miss the VM controller's latest
    patch of its sockets or guest memory, and the migration's end gives the guest the spec's vCPUs and memory: a
    migration of a VMI whose spec asks more sockets, or more guest memory, than its status runs is KubeVirt's to make
    (its own carries the hotplug out); the tenant migrates it once that is over, and migrates its other VMIs
    freely. The memory case was let through."""
    await guarded_vmis(sim, running=True)

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", two_sockets) is None

    def migration(name: str, vmi: str) -> Obj:
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"vmiName": vmi},
        }

    err = await create_as(sim, TENANT, migration("mine", "vm1"))
    assert err is not None and err.code == 403, err
    assert err.message == (
        'virtualmachineinstancemigrations.kubevirt.io "mine" is forbidden: ValidatingAdmissionPolicy '
        "'vmquota-migration-hotplug' with binding 'vmquota-migration-hotplug' denied request: vmquota: vm1 has a CPU "
        "hotplug pending (2 sockets asked, 1 running), which KubeVirt carries out with a migration of its own: migrate "
        "it once that is over"
    )
    assert await create_as(sim, TENANT, migration("other", "vm2")) is None, "a VMI with no hotplug pending"
    assert await create_as(sim, KUBEVIRT_CONTROLLER, migration("kubevirts", "vm1")) is None, "KubeVirt's own"

    # (a memory hotplug the same: hotplugMemory gives the guest the spec's memory at the migration's end)
    await sim.wait_for_phase(NS, "other", "Succeeded", kind="vmim")
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm2", hotplug) is None
    err = await create_as(sim, TENANT, migration("mine-too", "vm2"))
    assert err is not None and err.code == 403, err
    assert err.message.endswith(
        "vmquota: vm2 has a memory hotplug pending (2Gi asked, 1Gi running), which KubeVirt carries out with a "
        "migration of its own: migrate it once that is over"
    ), err.message


def sidecar(obj: Obj) -> None:
    obj["metadata"].setdefault("annotations", {})["hooks.kubevirt.io/hookSidecars"] = '[{"image": "x"}]'


async def test_a_running_vmis_render_annotations_are_kept_from_everyone(sim: SimCluster) -> None:
    """A hook sidecar (or another annotation its launcher pods are rendered from) added to a running VMI would make
    its next migration target larger than the VM vmquota admitted, without admitting the growth: the shipped policy
    refuses adding, changing or removing one, from the tenant and from KubeVirt alike, held room or not; other
    annotations change freely."""
    await install(sim, GUARD_POLICY.read_text())
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", namespace=NS))
    err = await update_as(sim, TENANT, "vm1", sidecar)
    assert err is not None and err.code == 403, err
    assert err.message == (
        'virtualmachineinstances.kubevirt.io "vm1" is forbidden: ValidatingAdmissionPolicy '
        "'vmquota-vmi-render-annotations' with binding 'vmquota-vmi-render-annotations' denied request: vmquota: "
        "hooks.kubevirt.io/hookSidecars of vm1 shape its launcher pods, which vmquota admitted as they are: a change "
        "applies at the next start of the VM (set it in its template)"
    )
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", sidecar) is not None, "nor KubeVirt"

    def parity(obj: Obj) -> None:
        obj["metadata"].setdefault("annotations", {})["alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity"] = ""

    def note(obj: Obj) -> None:
        obj["metadata"].setdefault("annotations", {})["example.com/note"] = "mine"

    assert await update_as(sim, TENANT, "vm1", parity) is not None, "an annotation with an empty value"
    assert await update_as(sim, TENANT, "vm1", note) is None, "another annotation"
    meta = (await sim.get("virtualmachineinstances", NS, "vm1"))["metadata"]
    assert "hooks.kubevirt.io/hookSidecars" not in meta["annotations"] and meta["annotations"]["example.com/note"]
    hooked = created_vmi("vm2", namespace=NS)
    sidecar(hooked)
    with acting_as(KUBEVIRT_CONTROLLER):  # created with one: kept, and not removable either
        await sim.create(hooked)

    def unhook(obj: Obj) -> None:
        obj["metadata"]["annotations"].pop("hooks.kubevirt.io/hookSidecars")

    def rehook(obj: Obj) -> None:  # (a larger sidecar in place of the one it was created with)
        obj["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"] = '[{"image": "x"}, {"image": "y"}]'

    assert await update_as(sim, TENANT, "vm2", unhook) is not None
    assert await update_as(sim, TENANT, "vm2", rehook) is not None, "a new value of one it has"
    assert await update_as(sim, TENANT, "vm2", note) is None


async def test_only_kubevirt_changes_a_vmis_spec(sim: SimCluster) -> None:
    """KubeVirt's VMI update admission: a tenant may label its VMI but not change its spec (a hotplug reaches a
    VMI through KubeVirt's VM controller), so a pending VMI keeps the size vmquota admitted it at."""
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", namespace=NS))
    err = await update_as(sim, TENANT, "vm1", hotplug)
    assert err is not None and err.code == 422, err
    assert err.message.endswith("denied the request: update of VMI object is restricted"), err.message

    def label(obj: Obj) -> None:
        obj["metadata"].setdefault("labels", {})["mine"] = "yes"

    assert await update_as(sim, TENANT, "vm1", label) is None
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", hotplug) is None


# ---- ValidatingAdmissionPolicy semantics ---------------------------------------------------------------------------

POLICY = """
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata: {name: p}
spec:
  failurePolicy: %(failure)s
  paramKind: {apiVersion: vmquota.io/v1alpha1, kind: QuotaReservation}
  matchConstraints:
    resourceRules:
      - {apiGroups: [""], apiVersions: ["v1"], operations: ["CREATE"], resources: ["pods"]}
  matchConditions:
    - {name: not-exempt, expression: "!has(object.metadata.labels) || !('exempt' in object.metadata.labels)"}
  variables: %(variables)s
  validations:
    - expression: "%(expression)s"
      %(message)s
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata: {name: b}
spec:
  policyName: p
  validationActions: [%(action)s]
  paramRef: {name: rules, parameterNotFoundAction: %(not_found)s}
  %(match)s
"""


def policy(
    *,
    failure: str = "Fail",
    message: str = "",
    action: str = "Deny",
    not_found: str = "Allow",
    match: str = "",
    variables: str = "[]",
    expression: str = "object.metadata.name.startsWith(params.spec.prefix)",
) -> str:
    return POLICY % {
        "failure": failure,
        "message": message,
        "action": action,
        "not_found": not_found,
        "match": match,
        "variables": variables,
        "expression": expression,
    }


async def rules(sim: SimCluster, prefix: Any) -> None:
    spec = {} if prefix is None else {"prefix": prefix}
    await sim.apply(
        {
            "apiVersion": "vmquota.io/v1alpha1",
            "kind": "QuotaReservation",
            "metadata": {"name": "rules", "namespace": NS},
            "spec": spec,
        }
    )


async def test_validation_with_the_parameter_of_the_request_namespace(sim: SimCluster) -> None:
    await install(sim, policy(message="messageExpression: \"'name must start with ' + params.spec.prefix\""))
    await rules(sim, "ok-")
    assert await create_as(sim, TENANT, pod("ok-1")) is None
    err = await create_as(sim, TENANT, pod("bad-1"))
    assert err is not None and err.code == 422 and err.reason == "Invalid"  # no reason: Invalid
    assert err.message.endswith("denied request: name must start with ok-")
    assert err.details["causes"] == [
        {"message": "ValidatingAdmissionPolicy 'p' with binding 'b' denied request: name must start with ok-"}
    ]
    exempt = pod("bad-2")
    exempt["metadata"]["labels"] = {"exempt": "yes"}
    assert await create_as(sim, TENANT, exempt) is None  # a false match condition skips the policy


async def test_message_falls_back_to_message_then_the_expression(sim: SimCluster) -> None:
    await install(sim, policy(message="message: 'a static message'"))
    await rules(sim, "ok-")
    err = await create_as(sim, TENANT, pod("bad"))
    assert err is not None and err.message.endswith("denied request: a static message")
    await sim.store.delete(sim.store.resource("validatingadmissionpolicies"), None, "p")
    await sim.store.delete(sim.store.resource("validatingadmissionpolicybindings"), None, "b")
    await install(sim, policy())
    err = await create_as(sim, TENANT, pod("bad2"))
    assert err is not None
    assert err.message.endswith(
        "denied request: failed expression: object.metadata.name.startsWith(params.spec.prefix)"
    )


async def test_parameter_not_found_allow_or_deny(sim: SimCluster) -> None:
    await install(sim, policy(not_found="Deny"))
    err = await create_as(sim, TENANT, pod("x"))
    assert err is not None and err.code == 422
    assert err.message.endswith(
        "denied request: failed to configure binding: no params found for policy binding with `Deny` "
        "parameterNotFoundAction"
    )


@pytest.mark.parametrize("failure", ["Fail", "Ignore"])
async def test_an_evaluation_error_follows_the_failure_policy(sim: SimCluster, failure: str) -> None:
    await install(sim, policy(failure=failure))
    await rules(sim, None)  # params.spec.prefix: no such key
    err = await create_as(sim, TENANT, pod("x"))
    if failure == "Ignore":
        assert err is None
    else:
        assert err is not None and "resulted in error" in err.message and err.code == 422


async def test_warn_does_not_deny_and_match_resources_narrow(sim: SimCluster) -> None:
    await install(sim, policy(action="Warn"))
    await rules(sim, "ok-")
    assert await create_as(sim, TENANT, pod("bad")) is None
    await sim.store.delete(sim.store.resource("validatingadmissionpolicybindings"), None, "b")
    await install(sim, policy(match="matchResources: {namespaceSelector: {matchLabels: {team: b}}}").split("---")[1])
    assert await create_as(sim, TENANT, pod("bad2")) is None  # t1 is team a: the binding does not apply


# ---- identities and authorization ----------------------------------------------------------------------------------


async def test_a_tenant_edits_its_namespace_and_nothing_else(sim: SimCluster) -> None:
    token = sim.add_tenant("mallory", [NS])
    headers = {"Authorization": f"Bearer {token}"}
    reservation = guard.reservation(NS, frozenset(), ["x"])
    cases: list[tuple[str, str, Obj | None, int]] = [
        ("POST", f"/api/v1/namespaces/{NS}/pods", pod("mine"), 201),
        ("GET", f"/api/v1/namespaces/{NS}/resourcequotas", None, 200),
        ("POST", "/api/v1/namespaces/other/pods", pod("theirs", namespace="other"), 403),
        (
            "POST",
            f"/api/v1/namespaces/{NS}/resourcequotas",
            {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "q"}},
            403,
        ),
        ("POST", f"/apis/vmquota.io/v1alpha1/namespaces/{NS}/quotareservations", reservation, 403),
        ("PUT", f"/api/v1/namespaces/{NS}/pods/mine/status", pod("mine"), 403),
        ("GET", "/api/v1/namespaces", None, 403),
        ("GET", "/_sim/faults", None, 403),
    ]
    async with aiohttp.ClientSession(headers=headers) as s:
        for method, path, body, want in cases:
            async with s.request(method, sim.url + path, json=body, ssl=sim.client_ssl() or True) as resp:
                assert resp.status == want, (method, path, await resp.text())
                if want == 403 and not path.startswith("/_sim"):
                    doc = await resp.json()
                    assert doc["reason"] == "Forbidden" and 'User "mallory" cannot' in doc["message"], doc
        nobody = {"Authorization": "Bearer nobody"}
        async with s.get(sim.url + "/api/v1/pods", headers=nobody, ssl=sim.client_ssl() or True) as resp:
            assert resp.status == 401


async def run_kubectl(kubeconfig: Path, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """kubectl with ``kubeconfig``: (exit code, stdout, stderr); the test is skipped where kubectl is missing."""
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed")
    proc = await asyncio.create_subprocess_exec(
        exe,
        f"--kubeconfig={kubeconfig}",
        f"--cache-dir={tmp_path / 'kube-cache'}",
        "--request-timeout=10s",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_kubectl_applies_and_lists_the_guard(sim: SimCluster, tmp_path: Path) -> None:
    assert sim.kubeconfig_path is not None

    async def kubectl(*args: str) -> str:
        assert sim.kubeconfig_path is not None
        code, out, err = await run_kubectl(sim.kubeconfig_path, tmp_path, *args)
        assert code == 0, err
        return out

    await kubectl("apply", "-f", str(GUARD_POLICY))
    assert "vmquota-reservation-guard" in await kubectl("get", "validatingadmissionpolicies")
    await reserve(sim, HOLDER)
    listed = json.loads(await kubectl("get", "quotareservations", "-n", NS, "-o", "json"))
    assert [i["spec"]["holders"][0]["name"] for i in listed["items"]] == ["vm1"]
    tenant = sim.write_kubeconfig(tmp_path / "tenant.kubeconfig", sim.add_tenant("mallory", [NS]), namespace=NS)
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod("plain")))
    code, _, err = await run_kubectl(tenant, tmp_path, "create", "-f", str(manifest))
    assert code != 0 and "reserved for vm1" in err, err


def _memory(amount: str) -> str:
    """A strategic merge patch giving container ``c`` ``amount`` of memory (request and limit)."""
    res = {"requests": {"memory": amount}, "limits": {"memory": amount}}
    return json.dumps({"spec": {"containers": [{"name": "c", "resources": res}]}})


async def _tenant_and_app(sim: SimCluster, tmp_path: Path, memory: str) -> tuple[Path, Path]:
    """A quota of 4Gi limits.memory, a tenant's kubeconfig, and the manifest of pod ``app`` with ``memory``."""
    await sim.create_quota(NS, "compute", {"limits.memory": "4Gi"})
    await sim.wait_quota_synced(NS, "compute")
    tenant = sim.write_kubeconfig(tmp_path / "tenant.kubeconfig", sim.add_tenant("mallory", [NS]), namespace=NS)
    app = pod("app")
    app["spec"]["containers"][0]["resources"] = json.loads(_memory(memory))["spec"]["containers"][0]["resources"]
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(app))
    return tenant, manifest


async def test_a_pod_grows_in_place_only_by_resize_which_quota_and_the_guard_check(
    sim: SimCluster, tmp_path: Path
) -> None:
    """Kubernetes 1.33+: container resources change only through ``pods/resize`` (a plain update is invalid);
    quota admission charges what a resize grows by, and the guard refuses a resize while room is reserved, so a
    tenant cannot grow a pod into the room either."""
    tenant, manifest = await _tenant_and_app(sim, tmp_path, "1Gi")

    async def tenant_kubectl(*args: str) -> tuple[int, str]:
        code, out, err = await run_kubectl(tenant, tmp_path, *args)
        return code, out + err

    async def used() -> str:
        q = await sim.get("resourcequotas", NS, "compute")
        return str(q["status"]["used"]["limits.memory"])

    assert (await tenant_kubectl("create", "-f", str(manifest)))[0] == 0
    code, out = await tenant_kubectl("patch", "pod", "app", "-p", _memory("2Gi"))
    assert code != 0 and "pod updates may not change fields" in out, out
    code, out = await tenant_kubectl("patch", "pod", "app", "--subresource=resize", "-p", _memory("3Gi"))
    assert code == 0, out
    assert await used() == "3Gi"
    code, out = await tenant_kubectl("patch", "pod", "app", "--subresource=resize", "-p", _memory("5Gi"))
    assert code != 0 and "exceeded quota: compute, requested: limits.memory=2Gi" in out, out
    await install(sim, GUARD_POLICY.read_text())
    await reserve(sim, HOLDER)
    code, out = await tenant_kubectl("patch", "pod", "app", "--subresource=resize", "-p", _memory("3584Mi"))
    assert code != 0 and "reserved for vm1" in out, out
    assert await used() == "3Gi"
    await reserve(sim)  # nothing reserved: resizes pass again
    code, out = await tenant_kubectl("patch", "pod", "app", "--subresource=resize", "-p", _memory("3584Mi"))
    assert code == 0, out
    assert await used() == "3584Mi"


async def managed_pod_terms_quota(sim: SimCluster) -> None:
    """Quota ``vm-budget`` of 8Gi ``limits.memory``, managed in ``VmiPodUsage``: the namespace's guard parameter."""
    await sim.create_quota(
        NS,
        "vm-budget",
        {"limits.memory": "8Gi"},
        labels={MANAGED_LABEL: "true"},
        annotations={MODE_ANNOTATION: "VmiPodUsage"},
    )


async def test_no_pod_is_resized_in_place_where_a_quota_is_managed(sim: SimCluster, tmp_path: Path) -> None:
    """A launcher pod shrunk in place would free room in status.hard that its VM still counts in VM terms until
    vmquota lowers spec.hard (a tenant watching the quota takes it); where quotas count pods, the room it freed is
    taken by another pod, and the VM's next migration target, rendered at full size, is reserved as the VM moving;
    one grown would charge what nobody admitted. KubeVirt finds a VMI's pods by the uid of their controller
    reference, whose kind a tenant may rewrite, so where a quota is managed the guard refuses every resize, from
    anyone; elsewhere resizes are quota's business."""
    tenant, manifest = await _tenant_and_app(sim, tmp_path, "1Gi")
    await install(sim, GUARD_POLICY.read_text())
    app = yaml.safe_load(manifest.read_text())
    launcher = {**app, "metadata": {**app["metadata"], "name": "virt-launcher-vm1-abcde"}}
    launcher["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceX",
            "name": "vm1",
            "uid": "u1",
            "controller": True,
        }
    ]  # (its kind rewritten by the tenant: KubeVirt still counts it the VMI's)
    await sim.create(launcher)
    assert (await run_kubectl(tenant, tmp_path, "create", "-f", str(manifest)))[0] == 0

    async def resize(pod: str, memory: str = "2Gi") -> tuple[int, str]:
        code, out, err = await run_kubectl(
            tenant, tmp_path, "patch", "pod", pod, "--subresource=resize", "-p", _memory(memory)
        )
        return code, out + err

    assert (await resize("app"))[0] == 0, "no managed quota: resizes are quota's business"
    await managed_pod_terms_quota(sim)
    for pod in ("virt-launcher-vm1-abcde", "app"):
        code, out = await resize(pod, "512Mi")
        assert code != 0, out
        assert (
            "ValidatingAdmissionPolicy 'vmquota-managed-pod-resize' with binding 'vmquota-managed-pod-resize' denied "
            "request: vmquota: quota vm-budget counts VMs, which their pods resized in place would get past: pods in "
            f"this namespace are not resized in place (recreate {pod} instead)" in out
        ), out
    with acting_as(KUBEVIRT_CONTROLLER):  # (from anyone)
        pod_now = await sim.get("pods", NS, "virt-launcher-vm1-abcde")
        shrunk = json.loads(_memory("512Mi"))["spec"]["containers"][0]["resources"]
        pod_now["spec"]["containers"][0]["resources"] = shrunk
        with pytest.raises(ApiError, match="not resized in place"):
            await sim.store.update(sim.store.resource("pods"), pod_now, subresource="resize")


async def test_only_kubevirt_makes_the_pods_kubevirt_runs_vms_in_where_a_quota_is_managed(
    sim: SimCluster, tmp_path: Path
) -> None:
    """KubeVirt's VMI and migration controllers see only pods with the label key ``kubevirt.io`` and take one whose
    controller reference names a VMI's uid (whatever its kind) for that VMI's: a tenant's small pod so labelled and
    owned would run a VM that does not fit. Where a quota is managed, only virt-controller creates a pod with that
    label key, adds it to a pod, or adds or changes a controller reference on a pod that carries it, or its labels
    ``kubevirt.io``, ``kubevirt.io/created-by`` and ``kubevirt.io/migrationJobUID``; the tenant may
    still rename a reference's kind or change other labels; not take a controller reference off (the garbage
    collector does, orphaning), nor change the labels KubeVirt's
    migration controller picks a migration's target pod by, whatever its owner, nor drop the label key (a target
    taken out of KubeVirt's sight so is not deleted with its canceled migration), nor delete such a pod leaving its
    dependents behind (the garbage collector would take their references off for it)."""
    tenant, manifest = await _tenant_and_app(sim, tmp_path, "1Gi")
    await install(sim, GUARD_POLICY.read_text())

    def labelled(name: str, owner_uid: str | None = "u1", label: bool = True, namespace: str = NS) -> Obj:
        p = pod(name, owner_uid=owner_uid, namespace=namespace)
        p["spec"]["containers"][0]["resources"] = {"requests": SMALL, "limits": SMALL}
        if label:
            p["metadata"]["labels"] = {"kubevirt.io": "virt-launcher"}
        return p

    async def tenant_kubectl(*args: str) -> tuple[int, str]:
        code, out, err = await run_kubectl(tenant, tmp_path, *args)
        return code, out + err

    def refusal(pod: str, what: str) -> str:
        return (
            "ValidatingAdmissionPolicy 'vmquota-kubevirt-pods' with binding 'vmquota-kubevirt-pods' denied request: "
            "vmquota: quota vm-budget counts VMs, and KubeVirt runs a VM in a pod labelled kubevirt.io that its VMI "
            f"controls: in this namespace only KubeVirt {what}"
        )

    assert await create_as(sim, TENANT, labelled("before")) is None, "no managed quota: the pods are anyone's"
    await managed_pod_terms_quota(sim)
    err = await create_as(sim, TENANT, labelled("forged"))
    assert err is not None and err.code == 403 and err.reason == "Forbidden"
    creates = "creates such a pod or labels one so (leave the label key kubevirt.io off forged)"
    assert refusal("forged", creates) in err.message, err.message
    err = await create_as(sim, TENANT, labelled("unowned", owner_uid=None))
    assert err is not None and err.code == 403, "without a reference it is still a pod KubeVirt sees"
    assert await create_as(sim, KUBEVIRT_CONTROLLER, labelled("virt-launcher-vm1-abcde")) is None
    assert await create_as(sim, TENANT, labelled("unlabelled", label=False)) is None
    assert (await tenant_kubectl("create", "-f", str(manifest)))[0] == 0, "a plain pod is the tenant's"

    code, out = await tenant_kubectl("label", "pod", "unlabelled", "kubevirt.io=virt-launcher")
    assert code != 0 and "leave the label key kubevirt.io off unlabelled" in out, out
    kv = "virt-launcher-vm1-abcde"
    moved = (
        "makes such a pod another VMI's or a migration's target (virt-launcher-vm1-abcde keeps its owner "
        "references, its labels kubevirt.io, kubevirt.io/created-by and kubevirt.io/migrationJobUID and its annotation "
        "kubevirt.io/memory-overhead-bytes, and gets no finalizer orphan)"
    )
    # (the labels KubeVirt's migration controller picks a migration's target by, whatever the pod's owner)
    for relabel in ("kubevirt.io=other", "kubevirt.io/created-by=u9", "kubevirt.io/migrationJobUID=m9"):
        code, out = await tenant_kubectl("label", "pod", kv, relabel, "--overwrite")
        assert code != 0 and refusal(kv, moved) in out, out
    code, out = await tenant_kubectl("label", "pod", kv, "app=mine")
    assert code == 0, out
    # (virt-controller copies it into the VMI's status: the overhead vmquota reads as KubeVirt's)
    code, out = await tenant_kubectl("annotate", "pod", kv, "kubevirt.io/memory-overhead-bytes=0")
    assert code != 0 and refusal(kv, moved) in out, out
    code, out = await tenant_kubectl("annotate", "pod", kv, "mine=yes")
    assert code == 0, out

    def refs(uid: str, kind: str = "VirtualMachineInstance") -> str:
        ref = {"apiVersion": "kubevirt.io/v1", "kind": kind, "name": "vm9", "uid": uid, "controller": True}
        return json.dumps({"metadata": {"ownerReferences": [ref]}})

    code, out = await tenant_kubectl("patch", "pod", kv, "--type=merge", "-p", refs("u9"))
    assert code != 0 and refusal(kv, moved) in out, out
    code, out = await tenant_kubectl("patch", "pod", kv, "--type=merge", "-p", refs("u1", "VirtualMachineInstanceX"))
    assert code != 0 and refusal(kv, moved) in out, "the reference's kind changed, its uid kept"
    # (a second owner, not a controller: one that exists has the garbage collector, deleting the VMI in the
    # foreground, take the VMI's reference off the pod instead of deleting it; one with the VMI's uid and another
    # kind or name is dangling to the garbage collector, which then takes off every reference with that uid)
    for second in (
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "mine", "uid": "u-cm"},
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "nope", "uid": "u1"},
    ):
        add = json.dumps([{"op": "add", "path": "/metadata/ownerReferences/-", "value": second}])
        code, out = await tenant_kubectl("patch", "pod", kv, "--type=json", "-p", add)
        assert code != 0 and refusal(kv, moved) in out, (second, out)
    off = json.dumps({"metadata": {"ownerReferences": None}})
    code, out = await tenant_kubectl("patch", "pod", kv, "--type=merge", "-p", off)
    assert code != 0 and refusal(kv, moved) in out, "a controller reference taken off (an attachment pod's too)"
    for user in (COLLECTOR, KUBEVIRT_CONTROLLER):  # (the garbage collector, orphaning; KubeVirt, putting it back)
        with acting_as(user):
            now = await sim.get("pods", NS, kv)
            now["metadata"]["ownerReferences"] = (
                None if user is COLLECTOR else json.loads(refs("u1"))["metadata"]["ownerReferences"]
            )
            await sim.store.update(sim.store.resource("pods"), now)
    code, out = await tenant_kubectl("label", "pod", kv, "kubevirt.io-")  # (out of KubeVirt's sight: not deleted)
    assert code != 0 and refusal(kv, moved) in out, out
    # (deleted leaving the pods it controls behind, a migration target's attachment pod: the garbage collector would
    # take their controller references off as itself)
    orphans = f"deletes such a pod leaving the pods it controls behind (delete {kv} without propagationPolicy Orphan)"
    code, out = await tenant_kubectl("delete", "pod", kv, "--cascade=orphan", "--wait=false")
    assert code != 0 and refusal(kv, orphans) in out, out
    # (nor by the finalizer orphan, which has a delete without a policy orphan them)
    orphan = json.dumps({"metadata": {"finalizers": ["orphan"]}})
    code, out = await tenant_kubectl("patch", "pod", kv, "--type=merge", "-p", orphan)
    assert code != 0 and refusal(kv, moved) in out, out
    # (nor by an eviction, which deletes the pod with its own deleteOptions, no delete admitted)
    pods = sim.store.resource("pods")
    with acting_as(TENANT), pytest.raises(ApiError) as evicted:
        await sim.store.evict(pods, NS, kv, {"propagationPolicy": "Orphan"})
    assert evicted.value.code == 403 and "evicts a pod leaving the pods it controls behind" in evicted.value.message
    code, out = await tenant_kubectl("delete", "pod", "unlabelled", "--cascade=orphan", "--wait=false")
    assert code == 0, out
    code, out = await tenant_kubectl("delete", "pod", kv, "--wait=false")
    assert code == 0, f"a delete that collects its dependents is the tenant's: {out}"
    assert await create_as(sim, KUBEVIRT_CONTROLLER, labelled("virt-launcher-vm2-fghij")) is None
    with acting_as(TENANT):
        await sim.store.evict(pods, NS, "virt-launcher-vm2-fghij")  # (as kubectl drain evicts: the tenant's too)
    assert sim.store.peek(pods, NS, "virt-launcher-vm2-fghij") is None
    elsewhere = labelled("elsewhere", namespace="other")
    assert await create_as(sim, UserInfo("mallory", tenant_of=frozenset({"other"})), elsewhere) is None


async def test_only_kubevirt_takes_its_finalizer_off_a_migration_where_a_quota_is_managed(sim: SimCluster) -> None:
    """With KubeVirt's finalizer a migration deleted before the hand-off is canceled and its target pod deleted; a
    tenant that took the finalizer off first left the target behind, in room reserved for it. Where a quota is
    managed only virt-controller takes it off; anyone may still delete the migration, or change other metadata."""
    vmims = sim.store.resource("vmim")
    for vm in ("vm1", "vm2", "vm3"):
        await sim.create_vm(NS, vm, memory="64Mi")
        await sim.wait_for_phase(NS, vm, "Running")
    sim.kubevirt.schedulable = set()  # (no node for a target: the migrations stay before their hand-off)

    async def patch_as(user: UserInfo, name: str, metadata: Obj) -> ApiError | None:
        with acting_as(user):
            try:
                await sim.store.patch(vmims, NS, name, {"metadata": metadata}, "merge")
            except ApiError as e:
                return e
        return None

    async def migration(name: str, vm: str) -> None:
        await sim.migrate(NS, vm, name=name)
        await sim.wait_until("vmim", NS, name, lambda o: MIGRATION_FINALIZER in o["metadata"].get("finalizers", []))

    await install(sim, GUARD_POLICY.read_text())
    await migration("before", "vm1")
    assert await patch_as(TENANT, "before", {"finalizers": None}) is None, "no managed quota: the tenant's to change"
    await managed_pod_terms_quota(sim)
    await migration("held", "vm2")
    err = await patch_as(TENANT, "held", {"finalizers": None})
    assert err is not None and err.code == 403, err
    assert (
        "ValidatingAdmissionPolicy 'vmquota-migration-finalizer' with binding 'vmquota-migration-finalizer' denied "
        "request: vmquota: quota vm-budget counts VMs, and a migration KubeVirt has not let go of cancels its target "
        "pod when it is deleted: only KubeVirt takes kubevirt.io/migrationJobFinalize off held (delete the migration "
        "instead)" in err.message
    ), err.message
    assert await patch_as(TENANT, "held", {"labels": {"mine": "yes"}}) is None, "other metadata stays the tenant's"
    await migration("admin", "vm3")  # (an administrator may, when virt-controller is gone)
    assert await patch_as(ADMIN, "admin", {"finalizers": None}) is None
    with acting_as(TENANT):  # (marked deleted: KubeVirt cancels it and takes its finalizer off)
        await sim.store.delete(vmims, NS, "held")
    await sim.wait_for(lambda: sim.peek("vmim", NS, "held") is None, what="KubeVirt to let the migration go")


async def test_only_kubevirt_deletes_a_vmi_leaving_its_pods_behind_where_a_quota_is_managed(
    sim: SimCluster, tmp_path: Path
) -> None:
    """A VMI deleted with ``--cascade=orphan`` (or naming no policy while it carries the finalizer ``orphan``) has
    the garbage collector take its controller reference off its launcher pods, which go on running the guest:
    deleted so during a migration, both of its pods stay charged over the budget. Where a quota is managed only
    virt-controller and cluster administrators delete a VMI so, and no VMI gets that finalizer but from an
    administrator (KubeVirt copies a VM template's finalizers into the VMI it creates); a plain delete, and every
    other change of a VMI, stay the tenant's."""
    tenant, _ = await _tenant_and_app(sim, tmp_path, "1Gi")
    for vm in ("vm1", "vm2", "vm3", "vm4"):
        await sim.create_vm(NS, vm, memory="64Mi")
        await sim.wait_for_phase(NS, vm, "Running")
    await install(sim, GUARD_POLICY.read_text())
    vmis = sim.store.resource("virtualmachineinstances")

    async def tenant_kubectl(*args: str) -> tuple[int, str]:
        code, out, err = await run_kubectl(tenant, tmp_path, *args)
        return code, out + err

    reason = (
        "ValidatingAdmissionPolicy 'vmquota-vmi-orphaning' with binding 'vmquota-vmi-orphaning' denied request: "
        "vmquota: quota vm-budget counts VMs, and a VMI deleted leaving its pods behind goes on running its guest in "
        "them: "
    )
    deletes = reason + "only KubeVirt deletes {} so in this namespace (delete it with propagationPolicy Background or "
    deletes += "Foreground"
    gets = (
        reason + "no VMI gets the finalizer orphan in this namespace (take it off {}, and off the template of its VM)"
    )
    finalizer = '{"metadata":{"finalizers":["orphan"]}}'

    code, out = await tenant_kubectl("delete", "vmi", "vm1", "--cascade=orphan", "--wait=false")
    assert code == 0, f"no managed quota: the tenant's to delete so: {out}"
    await managed_pod_terms_quota(sim)
    code, out = await tenant_kubectl("delete", "vmi", "vm2", "--cascade=orphan", "--wait=false")
    assert code != 0 and deletes.format("vm2") + ")" in out, out
    with acting_as(TENANT), pytest.raises(ApiError) as refused:  # (the older option, as a request body gives it)
        await sim.store.delete_raw(vmis, NS, "vm2", options={"orphanDependents": True})
    assert refused.value.code == 403 and deletes.format("vm2") in refused.value.message
    code, out = await tenant_kubectl("patch", "vmi", "vm2", "--type=merge", "-p", finalizer)
    assert code != 0 and gets.format("vm2") in out, out
    templated = created_vmi("vm9", namespace=NS)
    templated["metadata"]["finalizers"] = ["orphan"]
    with acting_as(KUBEVIRT_CONTROLLER), pytest.raises(ApiError) as refused:  # (a VM template's finalizers)
        await sim.create(templated)
    assert refused.value.code == 403 and gets.format("vm9") in refused.value.message
    code, out = await tenant_kubectl("label", "vmi", "vm2", "mine=yes")
    assert code == 0, f"other metadata stays the tenant's: {out}"
    with acting_as(ADMIN):  # (an administrator may; and a VMI that carries the finalizer orphan, deleted naming no
        # policy, orphans its pods, as kube-apiserver does)
        await sim.store.delete(vmis, NS, "vm3", propagation="Orphan")
        await sim.store.patch(vmis, NS, "vm4", json.loads(finalizer), "merge")
    pods = await sim.launcher_pods(NS, "vm4")
    assert pods
    carries = reason + "vm4 carries the finalizer orphan, which a delete naming no policy follows, KubeVirt's when "
    carries += "the VM stops too: take it off first"
    for user in (TENANT, KUBEVIRT_CONTROLLER):  # (naming no policy: kubectl names Background, KubeVirt's stop none)
        with acting_as(user), pytest.raises(ApiError) as refused:
            await sim.store.delete(vmis, NS, "vm4")
        assert refused.value.code == 403 and carries in refused.value.message, refused.value.message
    with acting_as(ADMIN):
        await sim.store.delete(vmis, NS, "vm4")
    for pod in pods:
        left = sim.store.peek(sim.store.resource("pods"), NS, pod["metadata"]["name"])
        assert left is not None and not left["metadata"].get("ownerReferences"), "orphaned, as kube-apiserver does"
    code, out = await tenant_kubectl("delete", "vmi", "vm2", "--wait=false")
    assert code == 0, f"a delete that collects its pods is the tenant's: {out}"


async def test_a_shrinking_resize_frees_quota_only_once_the_kubelet_reports_it(sim: SimCluster, tmp_path: Path) -> None:
    """InPlacePodVerticalScaling: the quota evaluator charges max(spec, status.resources, allocatedResources), so a
    resize down frees nothing until the kubelet reports the smaller size (component-helpers/resource)."""
    tenant, manifest = await _tenant_and_app(sim, tmp_path, "3Gi")
    code, _, err = await run_kubectl(tenant, tmp_path, "create", "-f", str(manifest))
    assert code == 0, err

    def reported(p: Obj) -> str | None:
        statuses = (p.get("status") or {}).get("containerStatuses") or []
        return statuses[0].get("resources", {}).get("limits", {}).get("memory") if statuses else None

    running = await sim.wait_until("pods", NS, "app", lambda p: reported(p) == "3Gi", what="app reported at 3Gi")
    assert running["status"]["containerStatuses"][0]["allocatedResources"] == {"memory": "3Gi"}
    code, _, err = await run_kubectl(
        tenant, tmp_path, "patch", "pod", "app", "--subresource=resize", "-p", _memory("1Gi")
    )
    assert code == 0, err
    await sim.wait_until("pods", NS, "app", lambda p: reported(p) == "1Gi", what="the kubelet actuating the resize")

    async def used_is_1gi() -> bool:
        q = await sim.get("resourcequotas", NS, "compute")
        return str(q["status"]["used"].get("limits.memory")) == "1Gi"

    await sim.wait_for(used_is_1gi, what="quota used to follow the reported size")
    shrunk = await sim.get("pods", NS, "app")
    still_big = {**shrunk, "status": {**shrunk["status"], "containerStatuses": running["status"]["containerStatuses"]}}
    assert format_resource_list(pod_quota_usage(still_big))["limits.memory"] == "3Gi"


async def test_a_tenant_cannot_forge_the_reported_resources_that_resize_accounting_reads(
    sim: SimCluster, tmp_path: Path
) -> None:
    """The evaluator believes ``status.containerStatuses[].resources`` and an ``Infeasible`` resize condition
    (which make it ignore the spec): both are the kubelet's. A tenant's pod created with a forged status that
    claims it runs at 1Gi is charged its 3Gi spec (the API server drops status on create), and the tenant
    cannot write ``pods/status``."""
    tenant, manifest = await _tenant_and_app(sim, tmp_path, "3Gi")
    app = yaml.safe_load(manifest.read_text())
    app["status"] = {
        "conditions": [{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}],
        "containerStatuses": [{"name": "c", "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Gi"}}}],
    }
    manifest.write_text(yaml.safe_dump(app))
    code, _, err = await run_kubectl(tenant, tmp_path, "create", "-f", str(manifest))
    assert code == 0, err
    q = await sim.get("resourcequotas", NS, "compute")
    assert q["status"]["used"]["limits.memory"] == "3Gi"
    forged = json.dumps({"status": app["status"]})
    code, _, err = await run_kubectl(tenant, tmp_path, "patch", "pod", "app", "--subresource=status", "-p", forged)
    assert code != 0 and "forbidden" in err.lower(), err
    q = await sim.get("resourcequotas", NS, "compute")
    assert q["status"]["used"]["limits.memory"] == "3Gi"


# ---- the rendering-model policy ----------------------------------------------------------------------------------


async def test_a_vmi_below_the_rendering_model_is_refused_where_a_quota_counts_vm_terms(sim: SimCluster) -> None:
    """Explicit requests far below a VM's size make its launcher pod cheap, so native quota would let in far more
    than a VM-term budget (twelve 16Gi VMs with requests.memory 1Gi in a 16Gi budget's room). Where a managed
    quota carries the enforcer's minimums, such a VMI is refused at creation, by anyone; KubeVirt's own defaults
    and VMIs at or above the minimums are admitted, and a namespace without them is not affected."""
    await install(sim, GUARD_POLICY.read_text())

    def vmi(name: str, **kw: Any) -> Obj:
        return created_vmi(name, namespace=NS, guest=kw.pop("guest", "16Gi"), **kw)

    cheap = vmi("cheap", requests={"memory": "1Gi"})
    assert await create_as(sim, TENANT, vmi("before", requests={"memory": "1Gi"})) is None, "no managed quota"
    minimums = {"requests.memory": "0.666666", "requests.cpu": "0.1", "limits.cpu": "1"}
    await sim.create_quota(
        NS,
        "vm-budget",
        {"requests.memory": "16Gi", "requests.cpu": "4", "limits.cpu": "16"},
        labels={MANAGED_LABEL: "true"},
        annotations={VMI_MINIMUM_ANNOTATIONS[r]: v for r, v in minimums.items()},
    )
    err = await create_as(sim, TENANT, cheap)
    assert err is not None and (err.code, err.reason) == (403, "Forbidden"), err
    assert err.message.endswith(
        "denied request: vmquota: explicit resources requests.memory of cheap below what quota vm-budget needs of "
        "its launcher pod to count it in VM terms (at least requests.memory 0.666666 x the guest memory; a missing "
        "memory request counts as its limit, a missing limit as its request): raise them, or leave them unset where "
        "KubeVirt sizes them by the VM (an instancetype that overcommits memory, or a cluster-wide cpuRequest, "
        "cannot be used here)"
    ), err.message
    # KubeVirt's VM controller creates VMIs: the same rule (an integer quantity too)
    assert await create_as(sim, KUBEVIRT_CONTROLLER, vmi("cheap2", requests={"memory": 1 << 30})) is not None
    # a missing request is the limit KubeVirt renders it from
    err = await create_as(sim, TENANT, vmi("capped", limits={"memory": "1Gi"}))
    assert err is not None and "explicit resources requests.memory of capped" in err.message, err
    # KubeVirt's default request with memory overcommit 150 (guest x 100 / 150), none at all, or the full size
    assert await create_as(sim, TENANT, vmi("overcommit", requests={"memory": "10923Mi"})) is None
    assert await create_as(sim, TENANT, vmi("plain")) is None
    # vCPUs: 4 need 400m requested and 4 as a limit at least
    err = await create_as(sim, TENANT, vmi("slow", vcpus=4, requests={"cpu": "100m"}, limits={"cpu": "2"}))
    assert err is not None and " of slow below what quota vm-budget needs" in err.message, err
    named = err.message.partition("explicit resources ")[2].partition(" of slow")[0]
    assert sorted(named.split(", ")) == ["limits.cpu", "requests.cpu"], err.message  # (in the map's order)
    fast = vmi("fast", vcpus=4, requests={"cpu": "400m"}, limits={"cpu": 4})
    fast["spec"]["domain"]["cpu"]["maxSockets"] = 4  # (no CPU hotplug past them: see the maxSockets test)
    assert await create_as(sim, TENANT, fast) is None
    # hugepages are charged as hugepages, not memory
    huge = vmi("huge")
    huge["spec"]["domain"]["memory"]["hugepages"] = {"pageSize": "2Mi"}
    err = await create_as(sim, TENANT, huge)
    assert err is not None and "huge is backed by hugepages" in err.message, err
    # another namespace has no managed quota
    assert await create_as(sim, TENANT, created_vmi("cheap", namespace="other", requests={"memory": "1Mi"})) is None
    # a budget of limits.memory alone: a missing limit is KubeVirt's automatic one, a multiple of the request, so the
    # request is what is checked
    await sim.create_quota(
        "other",
        "limits-only",
        {"limits.memory": "32Gi"},
        labels={MANAGED_LABEL: "true"},
        annotations={VMI_MINIMUM_ANNOTATIONS["limits.memory"]: "1"},
    )
    low = created_vmi("low", namespace="other", guest="16Gi", requests={"memory": "10Gi"})
    err = await create_as(sim, TENANT, low)
    assert err is not None and "explicit resources limits.memory of low" in err.message, err


async def test_until_a_vm_term_quota_is_accounted_no_vmi_is_admitted(sim: SimCluster) -> None:
    """Between an administrator opting a quota in (or changing its mode or budget) and vmquota having accounted the
    namespace so, the quota carries no minimums for it, and its `spec.hard` is the budget as written, not scaled by
    `k`: a tenant watching the quota could fit twelve 16Gi VMs with requests.memory 1Gi in a 16Gi VM-term budget's
    room then, or VMs of KubeVirt's own rendering ten times a CPU budget (a pod requests vCPUs / 10). Until the
    status says the quota is enforced in its mode (and ratio), with spec.hard what vmquota wrote and status.hard
    no higher, no VMI and no pod is admitted there (the pod of a VMI admitted earlier, or a plain pod in the room
    the cheaper launcher pods leave, would get in as well); a pod-terms quota holds nothing back, and a quota vmquota
    Refused falls back to native quota for pods."""
    await install(sim, GUARD_POLICY.read_text())

    def vmi(name: str, **kw: Any) -> Obj:
        return created_vmi(name, namespace=NS, guest=kw.pop("guest", "16Gi"), **kw)

    quota = await sim.create_quota(
        NS,
        "vm-budget",
        {"requests.memory": "16Gi", "requests.cpu": "4"},
        labels={MANAGED_LABEL: "true"},
        annotations={MODE_ANNOTATION: " VirtualResources "},  # (the enforcer trims the mode; so does the policy)
    )
    await sim.wait_quota_synced(NS, "vm-budget")  # (status.hard, which quota admission checks, is spec.hard)
    for name, kw in (("cheap", {"requests": {"memory": "1Gi"}}), ("plain", {"vcpus": 9})):
        err = await create_as(sim, TENANT, vmi(name, **kw))
        assert err is not None and (err.code, err.reason) == (403, "Forbidden"), err
        assert err.message.endswith(
            "denied request: vmquota: quota vm-budget counts VMs in mode VirtualResources and is not enforced in it "
            "yet (not adopted): a VM starts once vmquota has accounted the namespace; KubeVirt retries"
        ), err.message

    async def annotate(annotations: dict[str, str]) -> None:
        meta = quota["metadata"]
        await sim.apply({**quota, "metadata": {**meta, "annotations": annotations}})

    budget = '{"requests.memory": "16Gi", "requests.cpu": "4"}'  # (the administrator's spelling, kept)
    accounted = {
        MODE_ANNOTATION: "VirtualResources",
        STATUS_ANNOTATION: "Waiting for usage (VirtualResources)",
        LAST_HARD_ANNOTATION: '{"requests.cpu":"4000m","requests.memory":"16Gi"}',  # (its spec.hard, by value)
        VMI_MINIMUM_ANNOTATIONS["requests.memory"]: "0.666666",
        VMI_MINIMUM_ANNOTATIONS["requests.cpu"]: "0.1",
        BUDGET_ANNOTATION: budget,
        ENFORCED_BUDGET_ANNOTATION: budget,
    }
    await annotate(accounted)
    err = await create_as(sim, TENANT, vmi("plain", vcpus=9))
    assert err is not None and "(Waiting for usage (VirtualResources))" in err.message, err
    # enforced, but spec.hard is not what vmquota wrote (a budget written back, unscaled, by GitOps say)
    await annotate({**accounted, STATUS_ANNOTATION: "Enforcing (VirtualResources)", LAST_HARD_ANNOTATION: "{}"})
    err = await create_as(sim, TENANT, vmi("plain", vcpus=9))
    but = "but its budget or spec.hard changed since vmquota wrote it, or quota admission does not check it yet"
    assert err is not None and f"(Enforcing (VirtualResources), {but})" in err.message, err
    err = await create_as(sim, TENANT, pod("plain-pod", requests=SMALL))
    assert err is not None and err.message.endswith(
        "denied request: vmquota: exceeded quota: quota vm-budget counts VMs in mode VirtualResources and is not "
        f"enforced in it yet (Enforcing (VirtualResources), {but}): no pod is created in this namespace until "
        "vmquota has accounted it; retry in a moment"
    ), err
    # (KubeVirt's own pods too: "exceeded quota" makes it retry on updates)
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("launcher", owner_uid="uid-vm1")) is not None
    await annotate({**accounted, STATUS_ANNOTATION: "Refused: scoped quotas are not managed"})
    assert await create_as(sim, TENANT, pod("while-refused", requests=SMALL)) is None, (
        "a Refused quota is native quota for pods"
    )
    assert await create_as(sim, TENANT, vmi("while-refused")) is not None, "and starts no VM"
    # enforced, but the administrator has lowered the budget through its annotation since: spec.hard is still the
    # one for the old budget (a tenant watching the quota had four 9-vCPU VMs in on a new budget of 4)
    lowered = '{"requests.memory": "16Gi", "requests.cpu": "1"}'
    await annotate({**accounted, STATUS_ANNOTATION: "Enforcing (VirtualResources)", BUDGET_ANNOTATION: lowered})
    err = await create_as(sim, TENANT, vmi("plain", vcpus=9))
    assert err is not None and f"(Enforcing (VirtualResources), {but})" in err.message, err
    await annotate({**accounted, STATUS_ANNOTATION: "Enforcing (VirtualResources)"})
    assert await create_as(sim, TENANT, vmi("plain", vcpus=9)) is None
    assert await create_as(sim, TENANT, pod("enforced-pod", requests=SMALL)) is None
    # spec.hard lowered and recorded, but the quota controller has not copied it: status.hard, which quota
    # admission checks, is still the higher one
    await sim.quota.stop()
    quota = sim.peek("resourcequotas", NS, "vm-budget") or quota
    await sim.apply(
        {
            **quota,
            "metadata": {
                **quota["metadata"],
                "annotations": {
                    **accounted,
                    STATUS_ANNOTATION: "Enforcing (VirtualResources)",
                    LAST_HARD_ANNOTATION: '{"requests.cpu":"400m","requests.memory":"16Gi"}',
                },
            },
            "spec": {"hard": {"requests.memory": "16Gi", "requests.cpu": "400m"}},
        }
    )
    err = await create_as(sim, TENANT, pod("before-the-copy", requests=SMALL))
    assert err is not None and but in err.message, err
    await sim.quota.start()
    await sim.wait_quota_synced(NS, "vm-budget")
    assert await create_as(sim, TENANT, pod("after-the-copy", requests=SMALL)) is None
    quota = sim.peek("resourcequotas", NS, "vm-budget") or quota
    accounted[LAST_HARD_ANNOTATION] = '{"requests.cpu":"400m","requests.memory":"16Gi"}'
    assert await create_as(sim, TENANT, vmi("overcommit", requests={"memory": "10923Mi"})) is None
    assert await create_as(sim, TENANT, vmi("cheap", requests={"memory": "1Gi"})) is not None
    # the administrator changes the mode: not enforced in the new one until vmquota has accounted it
    await annotate({**accounted, MODE_ANNOTATION: "VirtualResourcesWithCPUAllocationRatio"})
    assert await create_as(sim, TENANT, vmi("plain2")) is not None
    # ... and in that mode, in the quota's own CPU allocation ratio: one changed since is not enforced yet
    ratio_mode = "VirtualResourcesWithCPUAllocationRatio"
    by_ratio = {**accounted, MODE_ANNOTATION: ratio_mode, RATIO_ANNOTATION: " 4 "}
    await annotate({**by_ratio, STATUS_ANNOTATION: f"Enforcing ({ratio_mode}, ratio 4)"})
    assert await create_as(sim, TENANT, vmi("plain2")) is None
    await annotate({**by_ratio, RATIO_ANNOTATION: "1", STATUS_ANNOTATION: f"Enforcing ({ratio_mode}, ratio 4)"})
    err = await create_as(sim, TENANT, pod("ratio-changed", requests=SMALL))
    assert err is not None and "exceeded quota" in err.message, err
    # a quota in a pod-terms mode holds nothing back, accounted or not
    await annotate({MODE_ANNOTATION: "VmiPodUsage"})
    assert await create_as(sim, TENANT, vmi("cheap2", requests={"memory": "1Gi"})) is None


async def a_cpu_budget_in_vm_terms(sim: SimCluster) -> None:
    """The shipped guard, and a managed quota of 4 vCPUs in VM terms: 0.1 core requested and 1 as a limit per vCPU."""
    await install(sim, GUARD_POLICY.read_text())
    await sim.create_quota(
        NS,
        "vm-budget",
        {"requests.cpu": "4", "limits.cpu": "16"},
        labels={MANAGED_LABEL: "true"},
        annotations={VMI_MINIMUM_ANNOTATIONS["requests.cpu"]: "0.1", VMI_MINIMUM_ANNOTATIONS["limits.cpu"]: "1"},
    )


async def test_the_rendering_model_policy_sees_kubevirts_defaults_and_the_io_thread_pool(sim: SimCluster) -> None:
    """The policy runs after KubeVirt's VMI defaults, as a real API server runs mutating admission first: a VMI with
    no CPU topology gets its sockets from its CPU limit, so a 100m request for 64 vCPUs is refused; and a VM-term
    mode counts the supplemental IO-thread pool as vCPUs, so explicit CPU must cover it too."""
    await a_cpu_budget_in_vm_terms(sim)

    def vmi(name: str, domain: Obj) -> Obj:
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"domain": {"memory": {"guest": "1Gi"}, **domain}},
        }

    untopped = vmi("untopped", {"resources": {"limits": {"cpu": "64"}, "requests": {"cpu": "100m"}}})
    err = await create_as(sim, TENANT, untopped)
    assert err is not None and "requests.cpu" in err.message.partition(" of untopped")[0], err
    topped = {"cpu": {"maxSockets": 2}, "resources": {"limits": {"cpu": "2"}}}  # (2 sockets, from the limit)
    assert await create_as(sim, TENANT, vmi("topped", topped)) is None
    pooled: Obj = {
        "cpu": {"sockets": 1, "maxSockets": 1},
        "ioThreadsPolicy": "supplementalPool",
        "ioThreads": {"supplementalPoolThreadCount": 3},
        "resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "400m"}},
    }
    err = await create_as(sim, TENANT, vmi("pooled", pooled))
    assert err is not None and "explicit resources limits.cpu of pooled" in err.message, err
    pooled["resources"]["limits"]["cpu"] = "4"
    assert await create_as(sim, TENANT, vmi("pooled", pooled)) is None
    # a count of 0 counts 1, as KubeVirt renders it (its defaults drop the 0): no way to zero the vCPUs checked
    zero = {"cpu": {"sockets": 4, "cores": 0, "maxSockets": 4}, "resources": {"requests": {"cpu": "1m"}}}
    err = await create_as(sim, TENANT, vmi("zero", zero))
    assert err is not None and "requests.cpu" in err.message.partition(" of zero")[0], err
    # dedicated CPUs are charged whole, whatever the VMI says: nothing to check
    pinned = {"cpu": {"sockets": 2, "dedicatedCpuPlacement": True}, "resources": {"limits": {"cpu": "2"}}}
    assert await create_as(sim, TENANT, vmi("pinned", pinned)) is None


async def test_the_rendering_model_policy_holds_explicit_cpu_to_the_vcpus_a_hotplug_may_reach(sim: SimCluster) -> None:
    """KubeVirt grows explicit CPU at a hotplug by the added vCPUs / its ratio only, and only where the VM's template
    has it: explicit CPU must cover the vCPUs at cpu.maxSockets. Memory is grown by KubeVirt by the model."""
    await a_cpu_budget_in_vm_terms(sim)

    def vmi(name: str, cpu: Obj, limits: Obj) -> Obj:
        domain = {"cpu": cpu, "memory": {"guest": "1Gi"}, "resources": {"limits": limits}}
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"domain": domain},
        }

    err = await create_as(sim, TENANT, vmi("hot", {"sockets": 1, "maxSockets": 32}, {"cpu": "1"}))
    assert err is not None, "a limit of one vCPU that a hotplug may take to 32"
    # (its request is the limit, copied by KubeVirt's defaults, which a hotplug does not grow)
    named = err.message.partition("explicit resources ")[2].partition(" of hot")[0]
    assert sorted(named.split(", ")) == ["limits.cpu", "requests.cpu"], err.message  # (in the map's order)
    assert "requests.cpu 0.1 x the vCPUs at its cpu.maxSockets 32" in err.message, err.message
    assert "limits.cpu 1 x the vCPUs at its cpu.maxSockets 32" in err.message, err.message
    assert "raise them (or lower cpu.maxSockets), or leave them unset" in err.message, err.message
    assert await create_as(sim, TENANT, vmi("sized", {"sockets": 1, "maxSockets": 32}, {"cpu": "32"})) is None
    assert await create_as(sim, TENANT, vmi("fixed", {"sockets": 2, "maxSockets": 2}, {"cpu": "2"})) is None
    err = await create_as(sim, TENANT, vmi("cores", {"sockets": 1, "cores": 2, "maxSockets": 32}, {"cpu": "32"}))
    assert err is not None and "explicit resources limits.cpu of cores" in err.message, "64 vCPUs at 32 sockets"


async def test_an_enforced_vm_term_quota_with_an_empty_budget_freezes_nothing(sim: SimCluster) -> None:
    """A managed `VirtualResources` quota with no budget yet (`kubectl create quota vm-budget`, no `--hard`) is
    enforced (`last-hard` `{}`), but the API server serves its empty `spec.hard` and `status.hard` as absent: the
    policy required both, and refused every pod of the namespace, KubeVirt's migration targets too, for as long as
    the budget stayed empty. An empty budget limits nothing, and vmquota wrote it empty."""
    await install(sim, GUARD_POLICY.read_text())
    await sim.quota.stop()  # (the quota controller writes no status.hard for an empty spec.hard either)
    annotations = {
        MODE_ANNOTATION: "VirtualResources",
        STATUS_ANNOTATION: "Enforcing (VirtualResources)",
        LAST_HARD_ANNOTATION: "{}",
        BUDGET_ANNOTATION: "{}",
        ENFORCED_BUDGET_ANNOTATION: "{}",
    }
    quota: Obj = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": "vm-budget",
            "namespace": NS,
            "labels": {MANAGED_LABEL: "true"},
            "annotations": annotations,
        },
        "spec": {},
    }
    await sim.apply(quota)
    assert await create_as(sim, TENANT, pod("plain-pod", requests=SMALL)) is None
    assert await create_as(sim, KUBEVIRT_CONTROLLER, pod("target", owner_uid="uid-vm1")) is None
    # ... but an empty spec.hard vmquota did not write (its last one limited something) is not in force
    await sim.apply(
        {
            **quota,
            "metadata": {
                **quota["metadata"],
                "annotations": {**annotations, LAST_HARD_ANNOTATION: '{"requests.cpu":"400m"}'},
            },
        }
    )
    err = await create_as(sim, TENANT, pod("after-a-write-back", requests=SMALL))
    assert err is not None and "exceeded quota" in err.message, err


# ---- Kubernetes' limits on what a policy's expressions produce and cost -------------------------------------------


@pytest.mark.parametrize(
    "holders",
    [
        # a tenant's own migrations of its own VMs, refused for room: names of the longest lengths the API allows
        [
            guard.Holder(f"uid-{i}", f"vm{i:02d}".ljust(63, "x"), "migration " + f"m{i:02d}".ljust(253, "y"))
            for i in range(16)
        ],
        # a drain of a large namespace: KubeVirt's evacuation migrations, refused for room while others are reserved
        [guard.Holder(f"uid-{i}", f"vm-{i:04d}", f"migration kubevirt-evacuation-{i:05d}") for i in range(120)],
    ],
    ids=["tenant-long-names", "large-drain"],
)
async def test_the_guards_refusal_keeps_exceeded_quota_within_the_message_size_kubernetes_keeps(
    sim: SimCluster, holders: list[guard.Holder]
) -> None:
    """KubeVirt reads a refused target pod as a quota refusal (``migrationRejectedByResourceQuota``, room reserved
    in turn) only when the refusal says ``exceeded quota``. kube-apiserver discards a messageExpression result over
    5 KiB and reports ``failed expression: ...`` instead, so the guard's message must stay under that size whatever
    the holders' names are."""
    await install(sim, GUARD_POLICY.read_text())
    await reserve(sim, *holders)
    err = await create_as(sim, TENANT, pod("plain"))
    assert err is not None and err.code == 403
    message = err.message.split("denied request: ", 1)[1]
    assert message.startswith("vmquota: exceeded quota: the room in this namespace is reserved for "), message
    assert f"{holders[0].name} ({holders[0].reason})" in message, "the holders' names, as far as they fit"
    assert len(message.encode()) <= MAX_MESSAGE_EXPRESSION_BYTES


PER_CALL_LIMIT: Final = 1_000_000
"""kube-apiserver's cost limit for one CEL expression or variable (``PerCallLimit``,
``k8s.io/apiserver/pkg/apis/cel/config.go``); past it the evaluation fails, which ``failurePolicy: Fail`` turns
into a refusal."""


def test_the_vm_terms_last_hard_lookup_stays_within_the_cel_cost_limit_for_a_large_quota() -> None:
    """``variables.accounted`` looks every resource of ``spec.hard`` up in ``vmquota.io/last-hard`` by scanning the
    whole annotation: Kubernetes charges each ``indexOf`` / ``substring`` on it a tenth of its length
    (``k8s.io/apiserver/pkg/cel/library/cost.go``). With many resources of long names (per-StorageClass or
    extended-resource budgets) the variable exceeds the per-call limit, and the policy, failing closed, refuses
    every pod and VMI of the namespace, KubeVirt's migration targets included."""
    doc = next(d for d in yaml.safe_load_all(GUARD_POLICY.read_text()) if d["metadata"]["name"] == "vmquota-vm-terms")
    accounted = next(v["expression"] for v in doc["spec"]["variables"] if v["name"] == "accounted")
    # the scans of the whole annotation made once per resource of spec.hard (in a comprehension over it)
    per_resource = accounted.split("params.spec.hard.all(r,")[1:]
    scans = sum(p.count("variables.lastHard.indexOf(") + p.count("variables.lastHard.substring(") for p in per_resource)
    hard = {
        f"sc-{i:03d}-{'x' * 50}.{'y' * 40}.storageclass.storage.k8s.io/requests.storage": "100Gi" for i in range(128)
    }
    last_hard = json.dumps(hard, separators=(",", ":"), sort_keys=True)  # (as the enforcer writes it)
    cost = len(hard) * scans * (len(last_hard) // 10)
    assert cost <= PER_CALL_LIMIT, (
        f"{len(hard)} resources, last-hard {len(last_hard)} characters: about {cost:,} for the lookup alone, over "
        f"Kubernetes' per-call limit of {PER_CALL_LIMIT:,}"
    )


async def test_a_vm_term_quota_of_many_long_resource_names_is_in_force_exactly_when_vmquota_wrote_it(
    sim: SimCluster,
) -> None:
    """``variables.accounted`` reads ``vmquota.io/last-hard`` once, entry by entry, however many resources the budget
    names: 128 of long names (a budget per extended resource) is in force when ``spec.hard`` is what vmquota wrote, by
    value, and not when any entry differs, is missing or is extra."""
    await install(sim, GUARD_POLICY.read_text())
    hard = {f"requests.gpu-{i:03d}-{'x' * 50}.{'y' * 40}.example.com/accelerator": f"{i + 1}" for i in range(127)}
    hard["requests.cpu"] = "4"
    written = hard
    annotations = {
        MODE_ANNOTATION: "VirtualResources",
        STATUS_ANNOTATION: "Enforcing (VirtualResources)",
        BUDGET_ANNOTATION: rl_json(parse_resource_list(hard)),
        ENFORCED_BUDGET_ANNOTATION: rl_json(parse_resource_list(hard)),
    }
    quota = await sim.create_quota(
        NS,
        "vm-budget",
        hard,
        labels={MANAGED_LABEL: "true"},
        annotations={**annotations, LAST_HARD_ANNOTATION: rl_json(parse_resource_list(written))},
    )
    await sim.wait_quota_synced(NS, "vm-budget")
    assert await create_as(sim, TENANT, pod("in-force", requests=SMALL)) is None
    first = next(iter(hard))
    for name, last in (
        ("one-differs", {**written, first: "2Gi"}),
        ("one-missing", {k: v for k, v in written.items() if k != first}),
        ("one-extra", {**written, "requests.memory": "16Gi"}),
    ):
        meta = quota["metadata"]
        await sim.apply(
            {
                **quota,
                "metadata": {
                    **meta,
                    "annotations": {**annotations, LAST_HARD_ANNOTATION: rl_json(parse_resource_list(last))},
                },
            }
        )
        err = await create_as(sim, TENANT, pod(name, requests=SMALL))
        assert err is not None and "changed since vmquota wrote it" in err.message, (name, err)


@pytest.mark.parametrize(
    ("entry", "subresource", "matches"),
    [
        ("pods", None, True),
        ("pods", "status", False),
        ("pods/*", None, True),
        ("pods/*", "binding", True),
        ("pods/status", "status", True),
        ("pods/status", None, False),
        ("*", None, True),
        ("*", "status", False),
        ("*/*", None, True),
        ("*/*", "resize", True),
        ("*/resize", "resize", True),
        ("*/resize", None, False),
        ("services", None, False),
    ],
)
def test_a_rules_resources_match_as_kube_apiserver_matches_them(
    entry: str, subresource: str | None, matches: bool
) -> None:
    """The API server's ``rules.Matcher``: an entry is ``resource[/subresource]``, ``*`` for any of either; an entry
    without a subresource matches the main resource only, so ``pods/*`` is pods and all their subresources."""
    rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["*"], "resources": [entry]}
    info = DEFAULT_REGISTRY.by_url("", "v1", "pods")
    assert info is not None
    pods = info.resource
    assert _matches_rule(rule, "UPDATE", pods, subresource) is matches


async def test_a_vmi_whose_guest_keeps_hotplugged_memory_offline_is_migrated_by_its_tenant(sim: SimCluster) -> None:
    """A memory hotplug KubeVirt carried out (``guestRequested`` at the spec) whose memory the guest keeps offline
    (``guestCurrent`` below it) is no hotplug pending: KubeVirt makes no migration for it again, and the rule that
    leaves such migrations to KubeVirt refused every migration of the VM by anyone else, for good."""
    await guarded_vmis(sim, running=True)

    def requested(obj: Obj) -> None:
        obj["status"]["memory"].update({"guestRequested": "2Gi", "guestCurrent": "1Gi"})

    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", requested, status=True) is None
    assert await update_as(sim, KUBEVIRT_CONTROLLER, "vm1", hotplug) is None
    v = await sim.get("virtualmachineinstances", NS, "vm1")
    assert (v["spec"]["domain"]["memory"]["guest"], v["status"]["memory"]["guestCurrent"]) == ("2Gi", "1Gi")
    migration = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "mine", "namespace": NS},
        "spec": {"vmiName": "vm1"},
    }
    assert await create_as(sim, TENANT, migration) is None


async def test_only_administrators_make_decentralized_migrations_where_a_quota_is_managed(sim: SimCluster) -> None:
    """A decentralized live migration brings a guest in with the domain of the VM it leaves, into a receiving VMI's
    pod rendered and admitted from that VMI's own spec, and KubeVirt compares no sizes: a tenant making both ends
    could run a large guest in a receiver counted small. Where a quota is managed, only cluster administrators make
    a migration with ``spec.sendTo`` or ``spec.receive``; a plain one is the tenant's, and so is every migration
    elsewhere."""

    def migration(name: str, vm: str, **spec: Obj) -> Obj:
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"vmiName": vm, **spec},
        }

    for vm in ("vm1", "vm2", "vm3"):  # (one migration of a VMI at a time)
        await sim.create_vm(NS, vm, memory="64Mi")
        await sim.wait_for_phase(NS, vm, "Running")
    sim.kubevirt.schedulable = set()  # (no node for a target: the migrations stay pending)
    receive = {"receive": {"migrationID": "m-1"}}
    send = {"sendTo": {"migrationID": "m-1", "connectURL": "remote.example:9185"}}
    await install(sim, GUARD_POLICY.read_text())
    assert await create_as(sim, TENANT, migration("before", "vm1", **receive)) is None, "no managed quota: the tenant's"
    await managed_pod_terms_quota(sim)
    for name, spec in (("receiving", receive), ("sending", send)):
        err = await create_as(sim, TENANT, migration(name, "vm3", **spec))
        assert err is not None and err.code == 403, err
        assert (
            "ValidatingAdmissionPolicy 'vmquota-decentralized-migrations' with binding "
            "'vmquota-decentralized-migrations' denied request: vmquota: quota vm-budget counts VMs, and a "
            f"decentralized migration brings a guest in at the size of the VM it leaves, into a pod made for the "
            f"receiving VMI: in this namespace only cluster administrators make {name}" in err.message
        ), err.message
    assert await create_as(sim, ADMIN, migration("by-an-admin", "vm2", **receive)) is None
    assert await create_as(sim, TENANT, migration("plain", "vm3")) is None, "a migration within the cluster"
    vmims = sim.store.resource("vmim")
    for user in (KUBEVIRT_CONTROLLER, TENANT):  # (KubeVirt's own updates of it: annotations, labels, finalizers)
        with acting_as(user):
            metadata = {"annotations": {f"by-{user.username.rsplit(':', 1)[-1]}": "x"}, "finalizers": ["mine"]}
            await sim.store.patch(vmims, NS, "by-an-admin", {"metadata": metadata}, "merge")


async def test_no_vmi_is_created_with_a_node_name_where_a_quota_is_managed(sim: SimCluster) -> None:
    """KubeVirt keeps a status written at a VMI's creation and takes only a pod on its ``status.nodeName`` for a
    pending VMI's launcher pod: for a VMI created with another node's name it made pod after pod (15 of a 1Gi VM
    until a 40Gi quota was full), each KubeVirt's, for the guard's holder and within its room, so the guard let
    them all into the room held for other holders. Where a quota is managed, no VMI is created with a node name."""

    def forged(name: str) -> Obj:
        vmi = created_vmi(name, namespace=NS, guest="64Mi")
        vmi["status"] = {"nodeName": "nowhere"}
        return vmi

    await install(sim, GUARD_POLICY.read_text())
    await managed_pod_terms_quota(sim)
    err = await create_as(sim, TENANT, forged("vm-forged"))
    assert err is not None and err.code == 403, err
    assert "'vmquota-vmi-node-name'" in err.message and "create it without a status" in err.message, err.message
    assert await create_as(sim, TENANT, created_vmi("vm-plain", namespace=NS, guest="64Mi")) is None


def test_the_guards_charge_stays_within_the_cel_cost_limit_for_a_pod_of_many_init_containers() -> None:
    """A launcher pod has an init container per container disk (up to 256 volumes, their names the tenant's) beside
    its restartable console logger. The charge first searched the init containers' names for every pair of an init
    container and a restartable one, in each of its four variables: Kubernetes charges each search a tenth of the
    names' length (``k8s.io/apiserver/pkg/cel/library/cost.go``), 849k a variable with one restartable container
    and 1.7M with two, past the per-call limit, and the policy, failing closed, would have refused every pod of the
    namespace while it listed holders. Each container's place is now searched once, in one variable."""
    doc = next(
        d for d in yaml.safe_load_all(GUARD_POLICY.read_text()) if d["metadata"]["name"] == "vmquota-reservation-guard"
    )
    variables = {v["name"]: v["expression"] for v in doc["spec"]["variables"]}
    searching = {name for name, e in variables.items() if "variables.initOrder.indexOf(" in e}
    assert searching == {"initsAt", "sidecarsAt"}, searching
    containers = 2 + 256  # (KubeVirt's console logger and container-disk binary, and one per volume)
    names = 1 + containers * (63 + 1)  # (initOrder: every name of 63 characters between commas)
    cost = containers * (names // 10)  # (one search per init container, in one variable or the other)
    assert cost * 2 <= PER_CALL_LIMIT, f"about {cost:,} for the places of {containers} init containers"


LAZY_VARIABLES = (
    '[{name: broken, expression: "params.spec.prefix.size() > 0"}, '
    "{name: named, expression: \"object.metadata.name.startsWith('ok-')\"}]"
)


@pytest.mark.parametrize(
    "expression",
    [
        "params.spec.prefix == 'x' || variables.named",  # an object's missing field on the left of ||
        "variables.broken || variables.named",  # a variable that fails, on the left of ||
        "[1, 2].exists(i, i == 1 ? params.spec.prefix == 'x' : variables.named)",  # in a macro
    ],
)
async def test_an_error_absorbed_by_the_other_side_does_not_hide_a_variable(sim: SimCluster, expression: str) -> None:
    """CEL's ``||`` is true when either side is, whatever error the other gives (and ``exists`` when any element
    is): Kubernetes evaluates ``variables.named`` where the expression reads it, so the pod is admitted (and was
    here when variables were evaluated up front). The first error CEL reports is the left side's, not the
    unevaluated variable's."""
    await install(sim, policy(variables=LAZY_VARIABLES, expression=expression))
    await rules(sim, None)  # params.spec.prefix: no such key, and variables.broken fails
    assert await create_as(sim, TENANT, pod("ok-1")) is None


async def test_a_failed_variable_does_not_hide_a_false_one_under_ignore(sim: SimCluster) -> None:
    """``err && false`` is false in CEL: Kubernetes denies; with the error reported instead, failurePolicy Ignore
    lets the pod in (the shape of vmquota-migration-hotplug's ``!variables.cpuPending && !variables.memoryPending``)."""
    await install(
        sim, policy(failure="Ignore", variables=LAZY_VARIABLES, expression="variables.broken && variables.named")
    )
    await rules(sim, None)
    err = await create_as(sim, TENANT, pod("bad-1"))
    assert err is not None and err.code == 422, err
