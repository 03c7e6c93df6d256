"""The resources the simulated API server serves, and what the server knows about each of them.

For every resource: its ``Resource`` (group, version, plural, kind, scope, short names, subresources), the fields a
field selector may use, the discovery categories, and the columns ``kubectl get`` prints (the server-side Table
conversion, like the built-in printers and KubeVirt's ``additionalPrinterColumns``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.devtools.simcluster.store_api import Obj, Resource

Cell = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Column:
    """One Table column: ``cell`` computes the value from the object (and the current time, for ages)."""

    name: str
    type: str
    description: str
    cell: Callable[[Obj, float], Cell]
    priority: int = 0
    format: str = ""

    def definition(self) -> Obj:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }


@dataclass(frozen=True, slots=True)
class ResourceInfo:
    """A served resource with its selectable fields, discovery categories and printer columns."""

    resource: Resource
    fields: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    builtin: bool = True  # False for custom resources (no strategic merge patch, as on a real server)

    @property
    def selectable_fields(self) -> frozenset[str]:
        return frozenset(("metadata.name", "metadata.namespace", *self.fields))


# --- cell helpers ---------------------------------------------------------------------------------------------


def _get(obj: Any, path: str) -> Any:
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def parse_time(value: Any) -> float | None:
    """An RFC 3339 timestamp (``2024-05-01T10:00:00Z``) as epoch seconds; None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def format_time(epoch: float) -> str:
    """Epoch seconds as the API server writes timestamps (second precision, UTC, ``Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def human_duration(seconds: float) -> str:
    """Kubernetes' ``duration.HumanDuration``: ``45s``, ``2m30s``, ``5h``, ``3d4h``, ``2y``."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rest = s % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24
        rest = days % 365
        return f"{days // 365}y{rest}d" if rest else f"{days // 365}y"
    return f"{hours // 24 // 365}y"


def _age_of(path: str) -> Callable[[Obj, float], Cell]:
    def cell(obj: Obj, now: float) -> Cell:
        t = parse_time(_get(obj, path))
        return "<unknown>" if t is None else human_duration(now - t)

    return cell


def _path(path: str, default: Cell = "") -> Callable[[Obj, float], Cell]:
    def cell(obj: Obj, now: float) -> Cell:
        v = _get(obj, path)
        if v is None:
            return default
        return v if isinstance(v, str | int | float | bool) else str(v)

    return cell


def _condition(kind: str) -> Callable[[Obj, float], Cell]:
    def cell(obj: Obj, now: float) -> Cell:
        for c in _get(obj, "status.conditions") or ():
            if isinstance(c, Mapping) and c.get("type") == kind:
                return str(c.get("status", ""))
        return ""

    return cell


NAME = Column("Name", "string", "Name must be unique within a namespace.", _path("metadata.name"), format="name")
AGE = Column("Age", "string", "Time since the object was created.", _age_of("metadata.creationTimestamp"))


def _count(path: str) -> Callable[[Obj, float], Cell]:
    def cell(obj: Obj, now: float) -> Cell:
        value = _get(obj, path)
        return len(value) if isinstance(value, list) else 0

    return cell


def _pod_ready(obj: Obj, now: float) -> Cell:
    statuses = _get(obj, "status.containerStatuses") or []
    containers = _get(obj, "spec.containers") or []
    ready = sum(1 for s in statuses if isinstance(s, Mapping) and s.get("ready"))
    return f"{ready}/{len(containers)}"


def _pod_status(obj: Obj, now: float) -> Cell:
    if _get(obj, "metadata.deletionTimestamp"):
        return "Terminating"
    reason = _get(obj, "status.reason")
    if reason:
        return str(reason)
    for s in _get(obj, "status.containerStatuses") or []:
        waiting = _get(s, "state.waiting.reason")
        if waiting:
            return str(waiting)
    return str(_get(obj, "status.phase") or "Pending")


def _pod_restarts(obj: Obj, now: float) -> Cell:
    return sum(
        int(s.get("restartCount", 0)) for s in _get(obj, "status.containerStatuses") or [] if isinstance(s, Mapping)
    )


def _quota_cell(limits: bool) -> Callable[[Obj, float], Cell]:
    def cell(obj: Obj, now: float) -> Cell:
        hard = _get(obj, "status.hard") or {}
        used = _get(obj, "status.used") or {}
        parts = [
            f"{name}: {used.get(name, '0')}/{hard[name]}"
            for name in sorted(hard)
            if name.startswith("limits") == limits
        ]
        return ", ".join(parts)

    return cell


def _event_last_seen(obj: Obj, now: float) -> Cell:
    for path in ("lastTimestamp", "eventTime", "firstTimestamp", "metadata.creationTimestamp"):
        t = parse_time(_get(obj, path))
        if t is not None:
            return human_duration(now - t)
    return "<unknown>"


def _event_object(obj: Obj, now: float) -> Cell:
    return f"{str(_get(obj, 'involvedObject.kind') or '').lower()}/{_get(obj, 'involvedObject.name') or ''}"


def _vmi_ip(obj: Obj, now: float) -> Cell:
    for iface in _get(obj, "status.interfaces") or []:
        if isinstance(iface, Mapping) and iface.get("ipAddress"):
            return str(iface["ipAddress"])
    return ""


# --- the served resources ---------------------------------------------------------------------------------------

_STATUS = ("status",)
_POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
_EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)

RESOURCES: tuple[ResourceInfo, ...] = (
    ResourceInfo(
        Resource("", "v1", "namespaces", "Namespace", False, ("ns",), _STATUS),
        fields=("status.phase",),
        columns=(NAME, Column("Status", "string", "The phase of the namespace.", _path("status.phase")), AGE),
    ),
    ResourceInfo(
        Resource("", "v1", "pods", "Pod", True, ("po",), ("status", "resize")),
        fields=_POD_FIELDS,
        categories=("all",),
        columns=(
            NAME,
            Column("Ready", "string", "Ready containers / containers.", _pod_ready),
            Column("Status", "string", "The aggregate status of the containers in this pod.", _pod_status),
            Column("Restarts", "string", "Restarts of the containers in this pod.", _pod_restarts),
            AGE,
            Column("IP", "string", "IP address allocated to the pod.", _path("status.podIP", "<none>"), priority=1),
            Column("Node", "string", "Name of the node the pod runs on.", _path("spec.nodeName", "<none>"), priority=1),
        ),
    ),
    ResourceInfo(
        Resource("", "v1", "resourcequotas", "ResourceQuota", True, ("quota",), _STATUS),
        columns=(
            NAME,
            AGE,
            Column("Request", "string", "Used/hard of the non-limit resources.", _quota_cell(limits=False)),
            Column("Limit", "string", "Used/hard of the limits.* resources.", _quota_cell(limits=True)),
        ),
    ),
    ResourceInfo(
        Resource("", "v1", "events", "Event", True, ("ev",)),
        fields=_EVENT_FIELDS,
        columns=(
            Column("Last Seen", "string", "Time since the event was last seen.", _event_last_seen),
            Column("Type", "string", "Normal or Warning.", _path("type")),
            Column("Reason", "string", "Why the event happened.", _path("reason")),
            Column("Object", "string", "The object the event is about.", _event_object),
            Column("Message", "string", "What happened.", _path("message")),
            Column("Name", "string", "Name of the event.", _path("metadata.name"), priority=1, format="name"),
        ),
    ),
    ResourceInfo(
        Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
        columns=(NAME, Column("Holder", "string", "The lease holder.", _path("spec.holderIdentity")), AGE),
    ),
    ResourceInfo(
        Resource("kubevirt.io", "v1", "virtualmachines", "VirtualMachine", True, ("vm", "vms"), _STATUS),
        categories=("all",),
        builtin=False,
        columns=(
            NAME,
            AGE,
            Column("Status", "string", "Human readable status.", _path("status.printableStatus")),
            Column("Ready", "string", "The Ready condition.", _condition("Ready")),
        ),
    ),
    ResourceInfo(
        Resource(
            "kubevirt.io", "v1", "virtualmachineinstances", "VirtualMachineInstance", True, ("vmi", "vmis"), _STATUS
        ),
        categories=("all",),
        builtin=False,
        columns=(
            NAME,
            AGE,
            Column("Phase", "string", "The phase of the VMI.", _path("status.phase")),
            Column("IP", "string", "The IP address of the first interface.", _vmi_ip),
            Column("NodeName", "string", "The node the VMI runs on.", _path("status.nodeName")),
            Column("Ready", "string", "The Ready condition.", _condition("Ready")),
            Column("Live-Migratable", "string", "The LiveMigratable condition.", _condition("LiveMigratable"), 1),
        ),
    ),
    ResourceInfo(
        Resource(
            "kubevirt.io",
            "v1",
            "virtualmachineinstancemigrations",
            "VirtualMachineInstanceMigration",
            True,
            ("vmim", "vmims"),
            _STATUS,
        ),
        categories=("all",),
        builtin=False,
        columns=(
            NAME,
            Column("Phase", "string", "The phase of the migration.", _path("status.phase")),
            Column("VMI", "string", "The VMI being migrated.", _path("spec.vmiName")),
        ),
    ),
    ResourceInfo(
        Resource(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            False,
            (),
            _STATUS,
        ),
        columns=(
            NAME,
            Column("Validations", "integer", "Number of validations.", _count("spec.validations")),
            Column("ParamKind", "string", "The kind of the parameter.", _path("spec.paramKind.kind", "<unset>")),
            AGE,
        ),
    ),
    ResourceInfo(
        Resource(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            False,
        ),
        columns=(
            NAME,
            Column("PolicyName", "string", "The bound policy.", _path("spec.policyName")),
            Column("ParamRef", "string", "The parameter reference.", _path("spec.paramRef.name", "<unset>")),
            AGE,
        ),
    ),
    ResourceInfo(
        Resource("vmquota.io", "v1alpha1", "quotareservations", "QuotaReservation", True, ("qres",)),
        builtin=False,
        columns=(
            NAME,
            Column("Holders", "integer", "VMIs whose pods the reserved room is for.", _count("spec.holders")),
            AGE,
        ),
    ),
    ResourceInfo(
        Resource("kubevirt.io", "v1", "kubevirts", "KubeVirt", True, ("kv", "kvs"), _STATUS),
        builtin=False,
        columns=(NAME, AGE, Column("Phase", "string", "The phase of the deployment.", _path("status.phase"))),
    ),
)


class Registry:
    """Look-ups over the served resources: by plural, ``plural.group``, kind, singular or short name, and by
    (group, version, plural) for URL routing."""

    def __init__(self, infos: Iterable[ResourceInfo] = RESOURCES) -> None:
        self.infos: tuple[ResourceInfo, ...] = tuple(infos)
        self._by_key: dict[str, ResourceInfo] = {}
        self._by_url: dict[tuple[str, str, str], ResourceInfo] = {}
        self._aliases: dict[str, ResourceInfo] = {}
        for info in self.infos:
            r = info.resource
            self._by_key[r.key] = info
            self._by_url[(r.group, r.version, r.plural)] = info
        # Later entries never shadow earlier ones: core resources win over groups for bare names.
        for info in self.infos:
            r = info.resource
            for alias in (r.plural, r.kind, r.kind.lower(), *r.short_names, r.key, f"{r.kind}.{r.group}"):
                self._aliases.setdefault(alias, info)
                self._aliases.setdefault(alias.lower(), info)

    def info(self, key: str) -> ResourceInfo:
        """By plural, ``plural.group``, kind (any case), singular or short name; KeyError if unknown."""
        found = self._aliases.get(key) or self._aliases.get(key.lower())
        if found is None:
            raise KeyError(key)
        return found

    def resource(self, key: str) -> Resource:
        return self.info(key).resource

    def info_of(self, res: Resource) -> ResourceInfo:
        return self._by_key[res.key]

    def by_url(self, group: str, version: str, plural: str) -> ResourceInfo | None:
        return self._by_url.get((group, version, plural))

    def groups(self) -> dict[str, list[str]]:
        """Named API groups (not the core group) with their versions, in registration order."""
        out: dict[str, list[str]] = {}
        for info in self.infos:
            r = info.resource
            if r.group and r.version not in out.setdefault(r.group, []):
                out[r.group].append(r.version)
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceInfo]:
        return [i for i in self.infos if i.resource.group == group and i.resource.version == version]


DEFAULT_REGISTRY = Registry()
