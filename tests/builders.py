"""Builders of the objects the accounting tests feed the pure core (VMIs, launcher pods, migrations, quotas, refusal
Events) and the helpers that account them: shared by the unit, property and integration tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any, Final, cast

from hypothesis import strategies as st

from shared import contract
from shared.accounting.namespace import account_namespace, account_view
from shared.accounting.results import (
    NamespaceUsage,
)
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.kubevirt.command import set_launcher_command
from shared.ledger.fold import Ledger
from shared.normalize import normalize
from shared.podusage import quota_usage_of
from shared.quantity import Quantity
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL, MODE_ANNOTATION, RATIO_ANNOTATION
from shared.quota.modes import VMI_NAMES, Mode, VmSize
from shared.resources import ResourceList, format_resource_list, parse_resource_list
from shared.snapshot import AnySnapshot, NamespaceSnapshot, PodSnapshot, VmiSnapshot
from shared.vmi import GUARD_REFUSERS

NS = "tenant"
T0 = datetime(2025, 1, 1, tzinfo=UTC)
NOW = T0 + timedelta(days=1)


def ts(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


# ---- builders ----------------------------------------------------------------------------------------------------


def vmi_obj(
    name: str,
    *,
    vcpus: int = 1,
    guest: str = "1Gi",
    t: float = 0,
    phase: str = "Running",
    node: str = "n1",
    limits: Mapping[str, str] | None = None,
    requests: Mapping[str, str] | None = None,
    status_vcpus: int | None = None,
    status_guest: str | None = None,
    priority: str | None = None,
    namespace: str = NS,
) -> dict[str, Any]:
    domain: dict[str, Any] = {"cpu": {"sockets": vcpus, "cores": 1, "threads": 1}, "memory": {"guest": guest}}
    res: dict[str, Any] = {}
    if limits:
        res["limits"] = dict(limits)
    if requests:
        res["requests"] = dict(requests)
    if res:
        domain["resources"] = res
    status: dict[str, Any] = {"phase": phase}
    if node and phase != "Pending":
        status["nodeName"] = node
    if status_vcpus is not None:
        status["currentCPUTopology"] = {"sockets": status_vcpus, "cores": 1, "threads": 1}
    if status_guest is not None:
        status["memory"] = {"guestCurrent": status_guest}
    spec: dict[str, Any] = {"domain": domain}
    if priority:
        spec["priorityClassName"] = priority
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "creationTimestamp": ts(t)},
        "spec": spec,
        "status": status,
    }


def created_vmi(name: str, **kw: Any) -> dict[str, Any]:
    """:func:`vmi_obj` as its creator writes it, with no status: KubeVirt keeps the status a VMI is created with
    (its webhook sets only the phase and what its defaults own), so a status given to a create is a forgery."""
    obj = vmi_obj(name, **kw)
    del obj["status"]
    return obj


def facts_for(budget_keys: Iterable[str]) -> NamespaceFacts:
    keys = set(budget_keys)
    return NamespaceFacts(quota_has_limits_cpu="limits.cpu" in keys, quota_has_limits_memory="limits.memory" in keys)


def launcher_obj(
    vmi: Mapping[str, Any],
    *,
    config: KubeVirtConfig | None = None,
    facts: NamespaceFacts | None = None,
    migration_uid: str | None = None,
    node: str = "n1",
    t: float = 1,
    phase: str = "Running",
    suffix: str = "",
    vouched: bool = True,
    controller: bool = False,
) -> dict[str, Any]:
    """The launcher pod KubeVirt creates for ``vmi`` (rendered), as the API server would return it. ``vouched``:
    KubeVirt names it in the VMI's ``status.activePods`` (``vmi`` is changed in place), as it does for its own pods;
    a pod that only looks like a launcher pod (a tenant's forgery) is not. ``controller``: the owner reference is a
    controller reference (KubeVirt's own pods carry one; its VMI controller lists such pods in ``activePods``)."""
    rendered = render_launcher_pod(vmi, config or KubeVirtConfig(), facts or NamespaceFacts())
    meta = vmi["metadata"]
    labels = {
        "kubevirt.io": "virt-launcher",
        "kubevirt.io/created-by": meta["uid"],
        "vm.kubevirt.io/name": meta["name"],
    }
    if migration_uid:
        labels["kubevirt.io/migrationJobUID"] = migration_uid
    name = f"virt-launcher-{meta['name']}-{suffix or ('t' + migration_uid if migration_uid else 's')}"
    pod: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "uid": f"pod-{name}",
            "creationTimestamp": ts(t),
            "labels": labels,
            "ownerReferences": [
                {"kind": "VirtualMachineInstance", "name": meta["name"], "uid": meta["uid"]}
                | ({"controller": True} if controller else {})
            ],
        },
        "spec": {**rendered.pod_spec(), "nodeName": node},
        "status": {"phase": phase},
    }
    set_launcher_command(pod["spec"], meta["name"], meta["uid"], meta["namespace"])
    if vouched:
        vouch(vmi, pod)
    return pod


def refused_vmi(vmi: dict[str, Any], by: str = "rq") -> dict[str, Any]:
    """``vmi`` after KubeVirt was refused its launcher pod by the quota ``by`` (or by the reservation guard when
    ``by`` is one of ``shared.vmi.GUARD_REFUSERS``): condition ``Synchronized=False``, ``FailedCreate``, with the API
    server's refusal in its message as KubeVirt writes it; changed in place."""
    name = vmi["metadata"]["name"]
    refusal = (
        f"ValidatingAdmissionPolicy '{by}' with binding '{by}' denied request: vmquota: the room is reserved"
        if by in GUARD_REFUSERS
        else f"exceeded quota: {by}, requested: limits.memory=1Gi, used: limits.memory=0, limited: limits.memory=0"
    )
    message = f'failed to create virtual machine pod: pods "virt-launcher-{name}-x" is forbidden: {refusal}'
    conds = vmi.setdefault("status", {}).setdefault("conditions", [])
    conds.append({"type": "Synchronized", "status": "False", "reason": "FailedCreate", "message": message})
    return vmi


def vouch(vmi: Mapping[str, Any], pod: Mapping[str, Any]) -> None:
    """KubeVirt's VMI controller names ``pod`` in ``vmi``'s ``status.activePods`` (changed in place)."""
    status = cast(dict[str, Any], vmi).setdefault("status", {})
    status.setdefault("activePods", {})[pod["metadata"]["uid"]] = pod["spec"].get("nodeName", "")


def pod_obj(
    name: str,
    requests: Mapping[str, str],
    limits: Mapping[str, str] | None = None,
    *,
    phase: str = "Running",
    t: float = 0,
    priority: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "resources": {"requests": dict(requests), "limits": dict(limits or {})}}]
    }
    if priority:
        spec["priorityClassName"] = priority
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"pod-{name}", "creationTimestamp": ts(t)},
        "spec": spec,
        "status": {"phase": phase},
    }


def quota_obj(
    name: str,
    hard: Mapping[str, str],
    mode: Mode | str = Mode.VMI_POD_USAGE,
    *,
    ratio: str | None = None,
    budget: Mapping[str, str] | None = None,
    scope_selector: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    ann = {MODE_ANNOTATION: str(mode)}
    if ratio is not None:
        ann[RATIO_ANNOTATION] = ratio
    if budget is not None:
        ann[BUDGET_ANNOTATION] = json.dumps(dict(budget))
    spec: dict[str, Any] = {"hard": dict(hard)}
    if scope_selector:
        spec["scopeSelector"] = {"matchExpressions": scope_selector}
    return {
        "kind": "ResourceQuota",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"rq-{name}",
            "labels": {MANAGED_LABEL: "true"},
            "annotations": ann,
        },
        "spec": spec,
    }


def vmim_obj(name: str, vmi: str, *, t: float = 100, phase: str = "Pending", rejected: bool = False) -> dict[str, Any]:
    """A migration; ``rejected``: KubeVirt was refused its target pod (condition
    ``migrationRejectedByResourceQuota``)."""
    status: dict[str, Any] = {"phase": phase}
    if rejected:
        status["conditions"] = [{"type": "migrationRejectedByResourceQuota", "status": "True"}]
    return {
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": name, "namespace": NS, "uid": f"mig-{name}", "creationTimestamp": ts(t)},
        "spec": {"vmiName": vmi},
        "status": status,
    }


def refusal_event(vmi: str, requested: Mapping[str, str], *, t: float, quota: str = "rq") -> dict[str, Any]:
    req = ",".join(f"{k}={v}" for k, v in requested.items())
    return {
        "kind": "Event",
        "metadata": {"name": f"{vmi}.{int(t)}", "namespace": NS, "uid": f"ev-{vmi}-{t}", "creationTimestamp": ts(t)},
        "involvedObject": {"kind": "VirtualMachineInstance", "name": vmi, "uid": f"uid-{vmi}"},
        "reason": "FailedCreate",
        "type": "Warning",
        "message": f'Error creating pod: pods "virt-launcher-{vmi}-x" is forbidden: exceeded quota: {quota}, '
        f"requested: {req}, used: cpu=0, limited: cpu=0",
        "count": 1,
        "lastTimestamp": ts(t),
    }


def snaps(objs: Iterable[Mapping[str, Any]]) -> list[AnySnapshot]:
    return [normalize(o) for o in objs]


def account(objs: Iterable[Mapping[str, Any]], **kw: Any) -> NamespaceUsage:
    return account_namespace(snaps(objs), now=NOW, **kw)


_DELETED: Final = "deleted by the test"


def deleted(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` deleted, as a version for :func:`folded` (a deletion event at its place)."""
    return {**obj, _DELETED: True}


_PUBLISHED: Final = "published at, by the test"


def published(obj: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """``obj`` as a version for :func:`folded` whose event the watcher published at ``ts(seconds)`` (else at the
    version's place in the list, in seconds)."""
    return {**obj, _PUBLISHED: seconds}


def folded(versions: Iterable[Mapping[str, Any]], cluster: str = "c1") -> Ledger:
    """A ledger that folded ``versions`` in order (objects, several versions of one among them), each an upsert at the
    next resourceVersion and stream sequence (a deletion for one made by :func:`deleted`; one published at a time of
    its own by :func:`published`)."""
    led = Ledger()
    for seq, version in enumerate(versions, 1):
        obj = {k: v for k, v in version.items() if k != _PUBLISHED}
        meta = obj["metadata"]
        gone = bool(obj.get(_DELETED))
        snap = None if gone else normalize({**obj, "metadata": {**meta, "resourceVersion": str(seq)}})
        ev = contract.object_event(
            "deleted" if gone else "upserted",
            cluster=cluster,
            kind=obj["kind"],
            namespace=meta.get("namespace", ""),
            name=meta["name"],
            uid=meta["uid"],
            rv=str(seq),
            snapshot=snap,
            time=ts(version.get(_PUBLISHED, seq)),
        )
        led.apply(ev, seq)
    return led


def account_history(versions: Iterable[Mapping[str, Any]], namespace: str = NS, **kw: Any) -> NamespaceUsage:
    """The namespace accounted as the ledger accounts it once it has folded ``versions`` in order: with its memory
    of their history (pods created in a refusal, launcher pods KubeVirt named and names no more, what each launcher
    pod was made for)."""
    view = folded(versions).view("c1", namespace)
    return account_view(
        {**view.cluster_objects, **view.objects},
        namespace,
        now=NOW,
        late=view.late,
        settled=view.settled,
        departed=view.departed,
        made_for=view.made_for,
        **kw,
    )


def usage_snapshot(
    namespace: str,
    seq: int = 1,
    *,
    quotas: Mapping[str, contract.QuotaTerms] | None = None,
    vms: Iterable[contract.VmState] = (),
    migrations: Iterable[contract.MigrationState] = (),
    errors: Iterable[str] = (),
) -> contract.UsageSnapshot:
    """A ledger's usage snapshot of ``namespace`` (cluster ``c1``) at ``seq``."""
    return contract.UsageSnapshot(
        id=f"c1/usage/{namespace}/{seq}",
        source="vmquota/ledger/c1",
        subject=namespace,
        time="2026-01-01T00:00:00.000Z",
        cluster="c1",
        namespace=namespace,
        seq=seq,
        quotas=dict(quotas or {}),
        vms=list(vms),
        migrations=list(migrations),
        errors=list(errors),
    )


def usage_of(pod: Mapping[str, Any]) -> ResourceList:
    s = normalize(pod)
    assert isinstance(s, PodSnapshot)
    return dict(s.usage)


def rendered_usage(vmi: Mapping[str, Any], config: KubeVirtConfig, facts: NamespaceFacts) -> ResourceList:
    r = render_launcher_pod(vmi, config, facts)
    return quota_usage_of(r.requests, r.limits)


def hard_of(u: NamespaceUsage, quota: str = "rq") -> dict[str, str]:
    return format_resource_list(u.quotas[quota].hard)


def spec_size(vmi: Mapping[str, Any]) -> VmSize:
    """The size of a VMI's spec (after KubeVirt's admission defaults)."""
    s = normalize(vmi)
    assert isinstance(s, VmiSnapshot)
    return VmSize.of(s.vcpus, s.guest_memory, None, None)


def current_size(vmi: Mapping[str, Any]) -> VmSize:
    """The size a VMI runs at: its status where the status says (a hotplug not carried out yet leaves the status
    at the old size), else its spec."""
    s = normalize(vmi)
    assert isinstance(s, VmiSnapshot)
    return VmSize.of(s.status_vcpus or s.vcpus, s.status_guest_memory or s.guest_memory, None, None)


def divided_up(q: Quantity, k: Fraction | None) -> Quantity:
    """``q / k`` rounded up (unchanged for ``k`` None or 1): a pod-terms amount in the mode's terms."""
    if k is None or k >= 1:
        return q
    return Quantity(-(-q.nanos * k.denominator // k.numerator), q.format)


# ---- random namespaces -------------------------------------------------------------------------------------------

CPU_RES = ["requests.cpu", "limits.cpu"]
MEM_RES = ["requests.memory", "limits.memory"]
COUNT_NAMES = ["pods", "count/pods"]
CPU_NAMES = ["requests.cpu", "cpu", "limits.cpu"]
MEM_NAMES = ["requests.memory", "memory", "limits.memory"]


@dataclass(frozen=True)
class Setup:
    """A namespace's managed quota ``rq`` and the cluster's KubeVirt configuration."""

    mode: Mode
    config: KubeVirtConfig
    ratio: Fraction
    """The mode's CPU allocation ratio (the quota's own in the ratio mode, else KubeVirt's)."""
    budget_raw: dict[str, str]
    quota: dict[str, Any]

    @property
    def budget(self) -> ResourceList:
        return parse_resource_list(self.budget_raw)

    @property
    def enforced(self) -> list[str]:
        """The budget's resources native quota enforces (not the report-only ``/vmi`` names)."""
        return [r for r in self.budget_raw if r not in VMI_NAMES]


@st.composite
def namespace_setups(
    draw: st.DrawFn,
    *,
    modes: tuple[Mode, ...] = tuple(Mode),
    memory_gi: tuple[int, int] = (0, 24),
    cores: tuple[int, int] = (0, 16),
    count: tuple[int, int] = (0, 6),
) -> Setup:
    """A random managed quota (mode, budget of 1-4 resources) under a random KubeVirt configuration (CPU
    allocation ratio 1-10, memory overcommit 100 or 150), adopted with its budget annotation. ``memory_gi``,
    ``cores`` and ``count``: the ranges budgets are drawn from (whole units, plus a fraction for the first two)."""
    mode = draw(st.sampled_from(modes))
    kv = Fraction(draw(st.sampled_from([1, 2, 3, 4, 8, 10])))
    overcommit = draw(st.sampled_from([100, 100, 150]))
    ratio = (
        Fraction(draw(st.sampled_from([2, 4, 10, 16])))
        if mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO
        else kv
    )
    config = KubeVirtConfig(cpu_allocation_ratio=kv, memory_overcommit=overcommit)
    names = draw(st.sets(st.sampled_from([*CPU_RES, *MEM_RES, "cpu", "memory", *COUNT_NAMES]), min_size=1, max_size=4))
    if mode is Mode.DEDICATED_VIRTUAL_RESOURCES:
        names |= draw(st.sets(st.sampled_from(sorted(VMI_NAMES)), max_size=2))
    budget: dict[str, str] = {}
    for r in sorted(names):
        if r in COUNT_NAMES or "instances" in r:
            budget[r] = str(draw(st.integers(*count)))
        elif r.endswith("memory") or "memory/" in r:
            budget[r] = f"{draw(st.integers(*memory_gi)) * 1024 + draw(st.sampled_from([0, 100, 512]))}Mi"
        else:
            budget[r] = f"{draw(st.integers(*cores)) * 1000 + draw(st.sampled_from([0, 250, 500]))}m"
    annotation_ratio = str(ratio) if mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO else None
    return Setup(mode, config, ratio, budget, quota_obj("rq", budget, mode, ratio=annotation_ratio))


def decision(namespace: str = "tenant", quota: str = "compute", **fields: Any) -> contract.Decision:
    """An enforcer's decision on ``namespace/quota`` of cluster ``c1``, in mode ``VmiPodUsage``, with ``fields`` set."""
    base: dict[str, Any] = {
        "id": f"c1/decision/{quota}/1",
        "source": "vmquota/enforcer/c1",
        "subject": f"{namespace}/{quota}",
        "time": "2026-12-05T12:00:00Z",
        "cluster": "c1",
        "mode": "VmiPodUsage",
    }
    return contract.Decision(namespace=namespace, quota=quota, **{**base, **fields})


def namespace_event(cluster: str, name: str, uid: str, rv: str) -> contract.Upserted | contract.Deleted:
    """The watcher's upsert of Namespace ``name`` of ``cluster`` (its subject: ``contract.event_subject(cluster,
    "Namespace", "")``)."""
    return contract.object_event(
        "upserted",
        cluster=cluster,
        kind="Namespace",
        namespace="",
        name=name,
        uid=uid,
        rv=rv,
        snapshot=NamespaceSnapshot(uid=uid, name=name, resource_version=rv),
    )
