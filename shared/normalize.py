"""Normalisation: a raw Kubernetes object (a JSON-like mapping, as the API server returns it) to its compact
snapshot (:mod:`shared.snapshot`), or :class:`~shared.errors.InvalidInput` naming the field that is wrong. Only
what accounting reads is kept.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

from shared.errors import InvalidInput
from shared.fields import mapping, path, string, string_map
from shared.kinds import (
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.kubevirt.command import launched_vmi_uid
from shared.kubevirt.render import MEMORY_OVERHEAD_ANNOTATION, render_annotations
from shared.podusage import pod_resources, quota_usage_of
from shared.quantity import Quantity
from shared.quota.modes import MAX_BUDGET_RESOURCES
from shared.resources import ResourceList, is_qualified_name, parse_resource_list
from shared.snapshot import (
    EVACUATION_ANNOTATION,
    HOT_MEMORY_CHANGE,
    POD_LABELS_KEPT,
    REJECTED_BY_QUOTA,
    VMI_WAITING_PHASES,
    WORKLOAD_UPDATE_ANNOTATION,
    AnySnapshot,
    Condition,
    EventSnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    ScopeSelector,
    Snapshot,
    VmiMigrationState,
    VmimSnapshot,
    VmiSnapshot,
    VmSnapshot,
)
from shared.times import parse_rfc3339
from shared.vmi import has_hotplug_volumes, object_ref, room_refuser, status_size, unplugged_interfaces, vmi_spec

# ---- normalisation: raw Kubernetes object -> snapshot -----------------------------------------------------------

_DROPPED_ANNOTATIONS: Final = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})
_KUBEVIRT_CONFIG_KEYS: Final = (
    "developerConfiguration",
    "additionalGuestMemoryOverheadRatio",
    "autoCPULimitNamespaceLabelSelector",
    "cpuRequest",
    "virtualMachineOptions",
    "architectureConfiguration",
    "supportContainerResources",
    "network",
)


def _objects(obj: Mapping[str, Any], key: str, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """The items of a list of objects, each with its path (``status.conditions[2]``); absent or null: none."""
    raw = obj.get(key) or []
    at = path(where, key)
    if not isinstance(raw, list):
        raise InvalidInput("expected a list", at)
    items: list[tuple[str, Mapping[str, Any]]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise InvalidInput("expected an object", f"{at}[{i}]")
        items.append((f"{at}[{i}]", item))
    return items


def _time(obj: Mapping[str, Any], key: str, where: str) -> datetime | None:
    v = obj.get(key)
    if v is None or v == "":
        return None
    if isinstance(v, datetime):
        return v
    t = parse_rfc3339(v)
    if t is None:
        raise InvalidInput(f"expected an RFC 3339 time with its zone, got {v!r}", path(where, key))
    return t


def _int(obj: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int | None:
    v = obj.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"expected a whole number, got {v!r}", path(where, key))
    return v


def _quantity(raw: object, where: str) -> Quantity:
    try:
        return Quantity.parse(raw)
    except InvalidInput as e:
        raise e.at(where) from None


def _identity(obj: Mapping[str, Any], *, namespaced: bool = True) -> dict[str, Any]:
    meta = mapping(obj, "metadata", "")
    name = string(meta, "name", "metadata")
    if not name:
        raise InvalidInput("missing", "metadata.name")
    namespace = string(meta, "namespace", "metadata")
    if namespaced and not namespace:
        raise InvalidInput("missing", "metadata.namespace")
    return {
        "uid": string(meta, "uid", "metadata"),
        "namespace": namespace,
        "name": name,
        "resource_version": string(meta, "resourceVersion", "metadata"),
        "creation_timestamp": _time(meta, "creationTimestamp", "metadata"),
    }


_NAME_MAX: Final = 253
"""The longest name of a Kubernetes object or node (a DNS subdomain), and longer than any uid."""


def _beyond_a_name(text: str) -> bool:
    return len(text) > _NAME_MAX


def _as_a_name(text: str) -> str:
    """``text``, or "" when it is longer than any name or uid can be: not the cluster's (a VMI's status is its
    creator's to write when it creates the VMI, as virt-api keeps a create's status; a pod's command is its
    creator's), and kept, it could make the object's event too large for the bus, and the object unseen."""
    return "" if _beyond_a_name(text) else text


def _kept_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if k not in _DROPPED_ANNOTATIONS}


def _vmi(obj: Mapping[str, Any]) -> VmiSnapshot:
    ident = _identity(obj)
    meta = mapping(obj, "metadata", "")
    vs = vmi_spec(obj)
    size = status_size(obj)
    status = mapping(obj, "status", "")
    memst = mapping(status, "memory", "status")
    overhead = None
    if memst.get("memoryOverhead") is not None:
        overhead = _quantity(memst["memoryOverhead"], "status.memory.memoryOverhead")
    mig = None
    ms = mapping(status, "migrationState", "status")
    if ms:
        w = "status.migrationState"
        tmo = None
        if ms.get("targetMemoryOverhead") is not None:
            tmo = _quantity(ms["targetMemoryOverhead"], f"{w}.targetMemoryOverhead")
        mig = VmiMigrationState(
            migration_uid=string(ms, "migrationUid", w),
            source_node=string(ms, "sourceNode", w),
            target_node=string(ms, "targetNode", w),
            target_pod=string(ms, "targetPod", w),
            completed=bool(ms.get("completed", False)),
            failed=bool(ms.get("failed", False)),
            target_memory_overhead=tmo,
        )
        if any(map(_beyond_a_name, (mig.migration_uid, mig.source_node, mig.target_node, mig.target_pod))):
            mig = None  # (not KubeVirt's: its tenant wrote it when it created the VMI)
    phase = string(status, "phase", "status")
    spec = mapping(obj, "spec", "")
    memory_change_failed = False
    refused_by = ""
    for w, c in _objects(status, "conditions", "status"):
        kind, state = string(c, "type", w), string(c, "status", w)
        if kind == HOT_MEMORY_CHANGE and state == "False":
            # (virt-handler could not apply the memory to the domain; KubeVirt asks for a restart and carries the
            # change out no more: nothing is pending)
            memory_change_failed = True
        elif (
            kind == "Synchronized" and state == "False" and string(c, "reason", w) == "FailedCreate" and not refused_by
        ):
            refused_by = _as_a_name(room_refuser(string(c, "message", w)))
    return VmiSnapshot(
        **ident,
        # (no labels: nothing renders or accounts from a VMI's labels, and a tenant's must not grow a ledger)
        annotations=render_annotations(vs.annotations),
        deletion_timestamp=_time(meta, "deletionTimestamp", "metadata"),
        phase=phase,
        node_name=_as_a_name(string(status, "nodeName", "status")),
        vcpus=vs.vcpus,
        guest_memory=vs.guest_memory,
        # (plus the IO thread pool the spec's count has: the topology alone would make every pool VM look
        # smaller than its spec, a CPU change pending that never is)
        status_vcpus=None if size.vcpus is None else size.vcpus + vs.vcpus - vs.topology.vcpus,
        status_guest_memory=size.guest_memory,
        memory_change=(
            size.guest_requested is not None
            and vs.guest_memory is not None
            and size.guest_requested != vs.guest_memory
            and not memory_change_failed
        ),
        requests=dict(vs.requests),
        limits=dict(vs.limits),
        memory_overhead=overhead,
        migration=mig,
        # (only once KubeVirt has synced the VMI, which rewrites it: a pending VMI's is its creator's words, which
        # vouch for nothing, VmiSnapshot.vouched_pods, and must not make its event or the ledger grow)
        active_pods=string_map(status, "activePods", "status") if phase not in VMI_WAITING_PHASES else {},
        unplugged_interfaces=tuple(unplugged_interfaces(obj)),
        pod_refused=bool(refused_by),
        refused_by=refused_by,
        priority_class_name=string(spec, "priorityClassName", "spec"),
        hotplug_volumes=has_hotplug_volumes(obj),
        spec=dict(spec),
    )


def _vm(obj: Mapping[str, Any]) -> VmSnapshot:
    ident = _identity(obj)
    spec = mapping(obj, "spec", "")
    strategy = string(spec, "runStrategy", "spec")
    running = spec.get("running")
    if running is not None:
        if not isinstance(running, bool):
            raise InvalidInput(f"expected true or false, got {running!r}", "spec.running")
        if strategy:
            raise InvalidInput("spec.running and spec.runStrategy are mutually exclusive", "spec.running")
        strategy = "Always" if running else "Halted"
    vs = vmi_spec(obj)
    status = mapping(obj, "status", "")
    return VmSnapshot(
        **ident,
        # (no labels, as for a VMI: nothing reads a VM's, and a tenant's would only grow the events stream)
        run_strategy=strategy,
        printable_status=string(status, "printableStatus", "status"),
        vcpus=vs.vcpus,
        guest_memory=vs.guest_memory,
    )


def _vmim(obj: Mapping[str, Any]) -> VmimSnapshot:
    ident = _identity(obj)
    meta = mapping(obj, "metadata", "")
    spec = mapping(obj, "spec", "")
    vmi_name = string(spec, "vmiName", "spec")
    if not vmi_name:
        raise InvalidInput("missing", "spec.vmiName")
    status = mapping(obj, "status", "")
    conds: list[Condition] = []
    for w, c in _objects(status, "conditions", "status"):
        ctype = string(c, "type", w)
        if not ctype:
            raise InvalidInput("missing", f"{w}.type")
        conds.append(
            Condition(
                type=ctype,
                status=string(c, "status", w),
                reason=string(c, "reason", w),
                message=string(c, "message", w),
            )
        )
    ann = string_map(meta, "annotations", "metadata")
    trigger = ""
    if EVACUATION_ANNOTATION in ann:
        trigger = "evacuation"
    elif WORKLOAD_UPDATE_ANNOTATION in ann:
        trigger = "workload-update"
    return VmimSnapshot(
        **ident,
        vmi_name=vmi_name,
        phase=string(status, "phase", "status"),
        deletion_timestamp=_time(meta, "deletionTimestamp", "metadata"),
        conditions=conds,
        rejected_by_quota=any(c.type == REJECTED_BY_QUOTA and c.status == "True" for c in conds),
        trigger=trigger,
    )


_QOS_RESOURCES: Final = ("cpu", "memory")


def _pod(obj: Mapping[str, Any]) -> PodSnapshot:
    ident = _identity(obj)
    meta = mapping(obj, "metadata", "")
    labels = string_map(meta, "labels", "metadata")
    ann = string_map(meta, "annotations", "metadata")
    spec = mapping(obj, "spec", "")
    if not spec:
        raise InvalidInput("missing", "spec")
    status = mapping(obj, "status", "")
    requests, limits = pod_resources(obj)
    owner_name = owner_uid = owner_pod = ""
    for w, o in _objects(meta, "ownerReferences", "metadata"):
        # (names and uids of any length are Kubernetes' to accept in an owner reference: bounded as names are)
        if o.get("kind") == VMI_KIND and not owner_uid:
            owner_name = _as_a_name(string(o, "name", w))
            owner_uid = _as_a_name(string(o, "uid", w))
        elif o.get("kind") == POD_KIND and o.get("controller") is True and not owner_pod:
            owner_pod = _as_a_name(string(o, "uid", w))
    overhead = None
    if ann.get(MEMORY_OVERHEAD_ANNOTATION) is not None:
        # (anyone who may write the pod may write it: one that is no quantity is as if KubeVirt published none, as
        # when it is taken off, and the pod is counted all the same, not dead-lettered)
        with contextlib.suppress(InvalidInput):
            overhead = Quantity.parse(ann[MEMORY_OVERHEAD_ANNOTATION])
    deadline = _int(spec, "activeDeadlineSeconds", "spec")
    best_effort = not any(rl[r].nanos > 0 for rl in (requests, limits) for r in _QOS_RESOURCES if r in rl)
    return PodSnapshot(
        **ident,
        labels={k: labels[k] for k in POD_LABELS_KEPT if k in labels},
        phase=string(status, "phase", "status"),
        node_name=string(spec, "nodeName", "spec"),
        deletion_timestamp=_time(meta, "deletionTimestamp", "metadata"),
        deletion_grace_period_seconds=_int(meta, "deletionGracePeriodSeconds", "metadata"),
        owner_vmi_name=owner_name,
        owner_vmi_uid=owner_uid,
        command_vmi_uid=_as_a_name(launched_vmi_uid(spec.get("containers"))),
        owner_pod_uid=owner_pod,
        requests=requests,
        limits=limits,
        usage=quota_usage_of(requests, limits),
        memory_overhead=overhead,
        terminating_scope=deadline is not None and deadline >= 0,
        best_effort=best_effort,
        priority_class_name=string(spec, "priorityClassName", "spec"),
    )


def _quota(obj: Mapping[str, Any]) -> QuotaSnapshot:
    ident = _identity(obj)
    meta = mapping(obj, "metadata", "")
    spec = mapping(obj, "spec", "")
    status = mapping(obj, "status", "")
    scopes = spec.get("scopes") or []
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        raise InvalidInput("expected a list of scope names", "spec.scopes")
    sel = mapping(spec, "scopeSelector", "spec")
    selectors: list[ScopeSelector] = []
    for w, e in _objects(sel, "matchExpressions", "spec.scopeSelector"):
        values = e.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidInput("expected a list of strings", f"{w}.values")
        op = string(e, "operator", w)
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise InvalidInput(f"unknown operator {op!r}", f"{w}.operator")
        selectors.append(ScopeSelector(scope_name=string(e, "scopeName", w), operator=op, values=list(values)))
    return QuotaSnapshot(
        **ident,
        labels=string_map(meta, "labels", "metadata"),
        annotations=_kept_annotations(string_map(meta, "annotations", "metadata")),
        spec_hard=parse_resource_list(spec.get("hard"), "spec.hard"),
        scopes=list(scopes),
        scope_selector=selectors,
        status_hard=parse_resource_list(status.get("hard"), "status.hard"),
        status_used=parse_resource_list(status.get("used"), "status.used"),
    )


def _namespace(obj: Mapping[str, Any]) -> NamespaceSnapshot:
    ident = _identity(obj, namespaced=False)
    meta = mapping(obj, "metadata", "")
    status = mapping(obj, "status", "")
    return NamespaceSnapshot(
        **ident, labels=string_map(meta, "labels", "metadata"), phase=string(status, "phase", "status")
    )


def _kubevirt(obj: Mapping[str, Any]) -> KubeVirtSnapshot:
    from shared.kubevirt.config import (
        KubeVirtConfig,
        config_fields_from_cr,
    )  # validates the CR as the renderer reads it

    ident = _identity(obj, namespaced=False)
    config = KubeVirtConfig(**config_fields_from_cr(obj))
    conf = mapping(mapping(obj, "spec", ""), "configuration", "spec")
    status = mapping(obj, "status", "")
    return KubeVirtSnapshot(
        **ident,
        version=string(status, "observedKubeVirtVersion", "status"),
        cpu_allocation_ratio=str(config.cpu_allocation_ratio),
        memory_overcommit=config.memory_overcommit,
        configuration={k: conf[k] for k in _KUBEVIRT_CONFIG_KEYS if k in conf},
    )


_EXCEEDED_RE: Final = re.compile(r"exceeded quota: ([^,]+), requested: (.*?), used: ")


def parse_refusal(message: str, where: str = "message") -> tuple[str, ResourceList]:
    """The quota name and ``requested:`` amounts of a quota refusal message; ``("", {})`` for other messages."""
    m = _EXCEEDED_RE.search(message)
    if m is None:
        return "", {}
    quota, items = m.group(1).strip(), m.group(2)
    if _beyond_a_name(quota):
        return "", {}  # (no quota is named so: not a quota's refusal, whoever wrote the message)
    listed = items.split(",")
    if len(listed) > MAX_BUDGET_RESOURCES:  # (quota admission names only resources a quota limits)
        raise InvalidInput(f"a quota refusal naming {len(listed)} resources (at most {MAX_BUDGET_RESOURCES})", where)
    out: ResourceList = {}
    for item in listed:
        name, sep, value = item.strip().partition("=")
        if not sep or not is_qualified_name(name):  # (quota admission names resources; the text may be a tenant's)
            raise InvalidInput(f"cannot read requested amount {item.strip()!r}", where)
        out[name] = _quantity(value, f"{where} (requested {name})")
    return quota, out


EVENT_MESSAGE_KEPT: Final = 2048
"""The characters of a quota refusal's message an Event's snapshot keeps."""


def _event(obj: Mapping[str, Any]) -> EventSnapshot:
    ident = _identity(obj)
    inv = mapping(obj, "involvedObject", "") or mapping(obj, "regarding", "")
    kind = string(inv, "kind", "involvedObject")
    reason = string(obj, "reason", "")
    if kind != VMI_KIND or reason != "FailedCreate":
        raise InvalidInput(
            f"only FailedCreate events on a {VMI_KIND} are tracked "
            f"(got {reason or 'no reason'} on {kind or 'nothing'})",
            "reason",
        )
    message = string(obj, "message", "") or string(obj, "note", "")
    quota, requested = parse_refusal(message)
    series = mapping(obj, "series", "")
    last = (
        _time(obj, "lastTimestamp", "")
        or _time(series, "lastObservedTime", "series")
        or _time(obj, "eventTime", "")
        or _time(obj, "firstTimestamp", "")
        or ident["creation_timestamp"]
    )
    count = _int(obj, "count", "", None)
    if count is None:
        count = _int(series, "count", "series", 1)
    # (an Event is anyone's to write, with any involved object: what is kept is bounded as a name is, and the message
    # only for a quota refusal, which explanations quote)
    return EventSnapshot(
        **ident,
        reason=reason,
        type=_as_a_name(string(obj, "type", "")),
        involved_kind=kind,
        involved_name=_as_a_name(string(inv, "name", "involvedObject")),
        involved_uid=_as_a_name(string(inv, "uid", "involvedObject")),
        message=message[:EVENT_MESSAGE_KEPT] if quota else "",
        quota_name=quota,
        requested=requested,
        count=count or 1,
        last_timestamp=last,
    )


_NORMALIZERS: Final[Mapping[str, Callable[[Mapping[str, Any]], Snapshot]]] = {
    VMI_KIND: _vmi,
    VM_KIND: _vm,
    VMIM_KIND: _vmim,
    POD_KIND: _pod,
    QUOTA_KIND: _quota,
    NAMESPACE_KIND: _namespace,
    KUBEVIRT_KIND: _kubevirt,
    EVENT_KIND: _event,
}


def normalize(obj: Mapping[str, Any]) -> AnySnapshot:
    """The snapshot of a raw Kubernetes object. InvalidInput names the object and the field on malformed input
    (absurd quantities included) and on a kind accounting does not track."""
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"expected a Kubernetes object, got {type(obj).__name__}")
    kind = obj.get("kind")
    fn = _NORMALIZERS.get(kind) if isinstance(kind, str) else None
    if fn is None:
        raise InvalidInput(
            f"kind {kind!r} is not tracked (expected one of {', '.join(sorted(_NORMALIZERS))})",
            f"{object_ref(obj)}: kind",
        )
    try:
        return fn(obj)  # type: ignore[return-value]
    except InvalidInput as e:
        ref = object_ref(obj)
        if e.where.startswith(ref):
            raise
        raise e.at(ref) from None
