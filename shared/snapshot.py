"""Compact, versioned snapshots of the Kubernetes objects accounting needs, and nothing else.

Each snapshot is a frozen msgspec Struct tagged by the Kubernetes ``kind``; field names are camelCase on the wire
(JSON) and snake_case in Python; unknown fields are ignored on decode, so an older reader accepts a newer writer
(rolling upgrades); ``schema`` is the snapshot schema version.

Quantities are :class:`~shared.quantity.Quantity` objects in Python and canonical strings on the wire: encode and
decode with :data:`enc_hook` / :data:`dec_hook` (or :func:`encode` / :func:`decode`), also when a snapshot is
embedded in another Struct.

:func:`shared.normalize.normalize` turns a raw Kubernetes object (JSON/YAML dict) into its snapshot; malformed
input raises :class:`~shared.errors.InvalidInput` naming the object and the field.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import datetime
from fractions import Fraction
from typing import Any, ClassVar, Final, Union, cast

import msgspec

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
from shared.quantity import Quantity

SCHEMA: Final = 1


# Labels and annotations KubeVirt puts on launcher pods and migrations.
LAUNCHER_LABEL: Final = "kubevirt.io"
LAUNCHER_VALUE: Final = "virt-launcher"
CREATED_BY_LABEL: Final = "kubevirt.io/created-by"
VM_NAME_LABEL: Final = "vm.kubevirt.io/name"
MIGRATION_JOB_LABEL: Final = "kubevirt.io/migrationJobUID"
VMI_NAME_LABEL: Final = "kubevirt.io/vmi-name"
EVACUATION_ANNOTATION: Final = "kubevirt.io/evacuationMigration"
WORKLOAD_UPDATE_ANNOTATION: Final = "kubevirt.io/workloadUpdateMigration"
REJECTED_BY_QUOTA: Final = "migrationRejectedByResourceQuota"
POD_LABELS_KEPT: Final = (LAUNCHER_LABEL, CREATED_BY_LABEL, VM_NAME_LABEL, MIGRATION_JOB_LABEL)
VMIM_ACTIVE_PHASES: Final = frozenset(
    {"", "Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running"}
)
VMI_FINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})
VMI_WAITING_PHASES: Final = frozenset({"", "Pending"})
"""Phases of a VMI whose launcher pod KubeVirt has yet to create (its phase moves on once the pod exists)."""


def labelled_launcher(labels: object) -> bool:
    """Whether ``labels`` (a pod's ``metadata.labels``, raw or kept) say KubeVirt launcher pod
    (``kubevirt.io: virt-launcher``). A tenant can write labels: this decides what the watcher publishes, never
    what accounting believes (only a VMI's ``status.activePods`` vouches for a launcher pod)."""
    return isinstance(labels, Mapping) and labels.get(LAUNCHER_LABEL) == LAUNCHER_VALUE


# ---- Struct base and parts -------------------------------------------------------------------------------------


class Snapshot(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", rename="camel", gc=False):
    """Common identity of every snapshot."""

    schema: int = SCHEMA
    uid: str = ""
    namespace: str = ""
    name: str
    resource_version: str = ""
    creation_timestamp: datetime | None = None

    unread: ClassVar[frozenset[str]] = frozenset({"resource_version"})
    """Fields no accounting result depends on (:func:`same_content` ignores them)."""

    @property
    def rv_order(self) -> int:
        """The resourceVersion as a number for ordering versions of one object (-1 when it is not a number)."""
        rv = self.resource_version
        return int(rv) if rv.isdigit() else -1

    @property
    def ref(self) -> str:
        kind = type(self).__struct_config__.tag
        return f"{kind} {self.namespace}/{self.name}" if self.namespace else f"{kind} {self.name}"


class Part(msgspec.Struct, frozen=True, kw_only=True, rename="camel", gc=False):
    """Base of nested snapshot parts (not tagged)."""


class VmiMigrationState(Part, frozen=True, kw_only=True):
    """The essentials of a VMI's ``status.migrationState`` (written at hand-off; may describe a past migration)."""

    migration_uid: str = ""
    source_node: str = ""
    target_node: str = ""
    target_pod: str = ""
    completed: bool = False
    failed: bool = False
    target_memory_overhead: Quantity | None = None


class Condition(Part, frozen=True, kw_only=True):
    type: str
    status: str = ""
    reason: str = ""
    message: str = ""


class ScopeSelector(Part, frozen=True, kw_only=True):
    scope_name: str
    operator: str = "Exists"
    values: list[str] = []


# ---- the VMI spec, as far as the launcher pod depends on it --------------------------------------------------------

KEEP: Final = None
"""In a spec shape: keep the value verbatim."""
PRESENT: Final = "present"
"""In a spec shape: only whether the value is set matters (kept as ``{}``, or ``None`` when it is null)."""

SpecShape = Mapping[str, "SpecShape"] | tuple["SpecShape"] | str | None
"""How much of a value to keep: :data:`KEEP`, :data:`PRESENT`, an object shape (``{key: shape}``: only those keys)
or a one-element tuple (a list whose object items have that shape)."""

_DEVICE: Final[SpecShape] = ({"deviceName": KEEP, "claimRequest": PRESENT},)
RENDER_SPEC_SHAPE: Final[SpecShape] = {
    "domain": {
        "resources": KEEP,
        "cpu": {k: KEEP for k in ("sockets", "cores", "threads", "dedicatedCpuPlacement", "isolateEmulatorThread")},
        "ioThreadsPolicy": KEEP,
        "ioThreads": {"supplementalPoolThreadCount": KEEP},
        "memory": {"guest": KEEP, "hugepages": {"pageSize": KEEP}, "reservedOverhead": {"addedOverhead": KEEP}},
        "firmware": {"kernelBoot": {"container": {"image": KEEP}}},
        "launchSecurity": {"sev": PRESENT, "snp": PRESENT, "tdx": PRESENT},
        "devices": {
            "gpus": _DEVICE,
            "hostDevices": _DEVICE,
            "filesystems": ({"name": KEEP},),
            "interfaces": (
                {
                    "sriov": PRESENT,
                    "passtBinding": PRESENT,
                    "passt": PRESENT,
                    "binding": {"name": KEEP},
                    "model": KEEP,
                    "ports": KEEP,
                },
            ),
            "disks": ({"lun": {"reservation": KEEP}},),
            "autoattachPodInterface": KEEP,
            "autoattachVSOCK": KEEP,
            "autoattachSerialConsole": KEEP,
            "logSerialConsole": KEEP,
            "autoattachGraphicsDevice": KEEP,
            "tpm": KEEP,
        },
    },
    "volumes": ({"name": KEEP, "containerDisk": PRESENT, "downwardMetrics": PRESENT},),
    "networks": ({},),
    "architecture": KEEP,
    "livenessProbe": {"exec": PRESENT},
    "readinessProbe": {"exec": PRESENT},
}
"""The parts of a VMI spec that ``shared.vmi.vmi_spec`` and ``shared.kubevirt.render_launcher_pod`` read (sizes,
devices, volumes and probes that add containers, device-plugin resources or overhead). Cloud-init data, firmware
ids, disk and network details and the like change no launcher pod and are dropped (only a LUN's ``reservation``
and how many networks there are count). Kept in step with the renderer by ``tests/unit/test_snapshot.py``
(rendering from the pruned spec gives the same pod, or the same error, as from the full one)."""


def _prune(value: Any, shape: SpecShape) -> Any:
    if shape is KEEP:
        return value
    if shape == PRESENT:
        return None if value is None else {}
    if type(shape) is tuple:
        if type(value) is not list:
            return value  # not a list: kept as is, so the renderer reports it as it would have
        item = shape[0]
        return [_prune(v, item) if type(v) is dict else v for v in value]  # every item: indexes in errors stay
    assert isinstance(shape, Mapping)
    if type(value) is not dict:
        return value
    return {k: _prune(v, shape[k]) for k, v in value.items() if k in shape}


def prune_vmi_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a VMI spec (:data:`RENDER_SPEC_SHAPE`) the launcher pod depends on: rendering the pruned spec
    gives the same pod, or the same error naming the same field, as rendering the full one. Values of an
    unexpected type are kept as they are; key order is kept. Pruning a pruned spec changes nothing."""
    return _prune(dict(spec), RENDER_SPEC_SHAPE)  # type: ignore[no-any-return]


_SPEC_ENCODER: Final = msgspec.json.Encoder()


_COMPACT: dict[bytes, dict[str, Any]] = {}
"""The encoded form of each shared pruned spec → that spec (at most ``_COMPACT_MAX``)."""
_COMPACT_MAX: Final = 4096
_COMPACT_SHARED: dict[int, dict[str, Any]] = {}
"""The same specs by ``id`` (alive while ``_COMPACT`` holds them): a shared spec is recognised at once."""


def compact_vmi_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`prune_vmi_spec`, shared: VMIs of one template or instance type hold one dict (read-only, like the
    snapshot holding it). Specs that do not survive a JSON round trip unchanged are not shared. A spec equal to a
    shared one, with the same JSON form, is that one, without pruning it again (pruning a pruned spec changes
    nothing): the common case of a snapshot decoded from the wire, whose spec its writer pruned. A shared spec is
    itself."""
    known: dict[str, Any] | None = _COMPACT_SHARED.get(id(spec))
    if known is spec:
        return known
    try:
        known = _COMPACT.get(_SPEC_ENCODER.encode(spec))
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):  # (what pruning drops may not encode)
        known = None
    if known is not None and known == spec:
        return known
    pruned = prune_vmi_spec(spec)
    try:
        key = _SPEC_ENCODER.encode(pruned)
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):
        return pruned
    shared = _COMPACT.get(key)
    if shared is None:
        shared = cast(dict[str, Any], msgspec.json.decode(key))
        if shared != pruned:
            return pruned
        if len(_COMPACT) >= _COMPACT_MAX:
            _COMPACT.clear()  # (more shapes than that: remembered afresh)
            _COMPACT_SHARED.clear()
        _COMPACT[key] = _COMPACT_SHARED[id(shared)] = shared
        return shared
    return shared if shared == pruned else pruned


_SHARED_LISTS: dict[tuple[str | int, ...], dict[str, Quantity]] = {}
_SHARED_LISTS_MAX: Final = 4096
_SHARED_LIST_IDS: dict[int, dict[str, Quantity]] = {}
"""The shared lists by ``id`` (alive while ``_SHARED_LISTS`` holds them, the empty one always): a shared list is
recognised at once."""


def shared_resources(rl: dict[str, Quantity]) -> dict[str, Quantity]:
    """An equal resource list (the same names in the same order, the very same quantity objects) that snapshots
    of the same shape share (launcher pods of one instance type). Read-only, like the snapshot holding it.

    Keyed by the names and the ids of the quantities (the wire decoder hands out one object per printed form):
    hashing stays in C, which matters because this runs for every pod snapshot the ledger decodes. A stored list
    keeps its quantities alive, so an equal key means the very same quantities."""
    if not rl:
        return _NO_QUANTITIES
    key: tuple[str | int, ...] = (*rl, *map(id, rl.values()))
    shared = _SHARED_LISTS.get(key)
    if shared is None:
        if len(_SHARED_LISTS) >= _SHARED_LISTS_MAX:
            _SHARED_LISTS.clear()  # bounded; sharing is an optimisation, never needed for correctness
            _SHARED_LIST_IDS.clear()
            _SHARED_LIST_IDS[id(_NO_QUANTITIES)] = _NO_QUANTITIES
        shared = dict(rl)
        _SHARED_LISTS[key] = _SHARED_LIST_IDS[id(shared)] = shared
    return shared


_SHARED_POD_LISTS: dict[tuple[str | int, ...], tuple[dict[str, Quantity], ...]] = {}


def _shared_pod_resources(
    requests: dict[str, Quantity], limits: dict[str, Quantity], usage: dict[str, Quantity]
) -> tuple[dict[str, Quantity], ...]:
    """:func:`shared_resources` of a pod's three lists at once (one key, one lookup: every pod event)."""
    key: tuple[str | int, ...] = (
        *requests,
        *map(id, requests.values()),
        0,
        *limits,
        *map(id, limits.values()),
        1,
        *usage,
        *map(id, usage.values()),
    )
    found = _SHARED_POD_LISTS.get(key)
    if found is None:
        if len(_SHARED_POD_LISTS) >= _SHARED_LISTS_MAX:
            _SHARED_POD_LISTS.clear()
        found = _SHARED_POD_LISTS[key] = (
            shared_resources(requests),
            shared_resources(limits),
            shared_resources(usage),
        )
    return found


# ---- sharing: what a ledger holds for thousands of objects ---------------------------------------------------------

_intern: Final = sys.intern
_set: Final = msgspec.structs.force_setattr
_NO_QUANTITIES: Final[dict[str, Quantity]] = {}
"""One empty resource list for every snapshot without one (read-only, like the snapshot holding it)."""
_SHARED_LIST_IDS[id(_NO_QUANTITIES)] = _NO_QUANTITIES


# ---- snapshots -------------------------------------------------------------------------------------------------


class VmiSnapshot(Snapshot, tag=VMI_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    """Annotations except kubectl's last-applied configuration (the renderer may read KubeVirt's)."""
    deletion_timestamp: datetime | None = None
    phase: str = ""
    node_name: str = ""
    vcpus: int = 1
    """vCPUs of the spec, after KubeVirt's admission defaults."""
    guest_memory: Quantity | None = None
    """Guest memory of the spec, after KubeVirt's admission defaults."""
    status_vcpus: int | None = None
    """``status.currentCPUTopology`` as a vCPU count (hotplug), when reported."""
    status_guest_memory: Quantity | None = None
    """``status.memory.guestCurrent`` (else ``guestRequested``), when reported."""
    requests: dict[str, Quantity] = {}
    """Explicit ``spec.domain.resources.requests``."""
    limits: dict[str, Quantity] = {}
    """Explicit ``spec.domain.resources.limits``."""
    memory_overhead: Quantity | None = None
    """``status.memory.memoryOverhead``: the overhead KubeVirt published, when it did."""
    migration: VmiMigrationState | None = None
    active_pods: dict[str, str] = {}
    """``status.activePods``: pod uid → node of the launcher pods KubeVirt's VMI controller counts as the VMI's (a
    field only KubeVirt writes: the one proof that a pod is a launcher pod, whatever its labels say)."""
    pod_refused: bool = False
    """Condition ``Synchronized=False`` with reason ``FailedCreate``: KubeVirt tried to create the launcher pod and
    was refused (a field only KubeVirt writes)."""
    priority_class_name: str = ""
    spec: dict[str, Any] = {}
    """The parts of the VMI spec the launcher pod depends on (:func:`compact_vmi_spec`), to re-render it. Read-only:
    VMIs with the same such parts share one dict."""

    def __post_init__(self) -> None:  # on construction and on decode (every VMI event the ledger folds: inlined)
        setattr_, intern = _set, _intern
        spec = self.spec
        if _COMPACT_SHARED.get(id(spec)) is not spec:  # (a shared spec is itself: :func:`compact_vmi_spec`)
            setattr_(self, "spec", compact_vmi_spec(spec))  # old writers sent the whole spec
        # Identity strings interned: a VM's name and uid recur in its VMI, its pods' labels and owner references and
        # every version of them, and a ledger keys its records by the uid.
        setattr_(self, "namespace", intern(self.namespace))
        setattr_(self, "name", intern(self.name))
        setattr_(self, "uid", intern(self.uid))
        setattr_(self, "phase", intern(self.phase))
        setattr_(self, "node_name", intern(self.node_name))
        for values in (self.labels, self.annotations):  # values interned (nodes, apps, versions recur) but long ones
            for k, v in values.items():
                if len(v) <= 64:
                    values[k] = intern(v)
        if not self.requests:
            setattr_(self, "requests", _NO_QUANTITIES)
        if not self.limits:
            setattr_(self, "limits", _NO_QUANTITIES)

    def as_object(self) -> dict[str, Any]:
        """A VMI object with what the renderer reads (metadata, spec, the published overhead)."""
        obj: dict[str, Any] = {
            "apiVersion": "kubevirt.io/v1",
            "kind": VMI_KIND,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
            },
            "spec": self.spec,
        }
        if self.memory_overhead is not None:
            obj["status"] = {"memory": {"memoryOverhead": self.memory_overhead.canonical()}}
        return obj


class VmSnapshot(Snapshot, tag=VM_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    run_strategy: str = ""
    """``spec.runStrategy``, or ``Always``/``Halted`` from ``spec.running``."""
    printable_status: str = ""
    vcpus: int = 1
    """vCPUs of the template, after admission defaults."""
    guest_memory: Quantity | None = None


class VmimSnapshot(Snapshot, tag=VMIM_KIND, frozen=True, kw_only=True):
    vmi_name: str
    phase: str = ""
    deletion_timestamp: datetime | None = None
    conditions: list[Condition] = []
    rejected_by_quota: bool = False
    """Condition ``migrationRejectedByResourceQuota`` is True."""
    trigger: str = ""
    """``evacuation`` (node drain), ``workload-update`` (hotplug, upgrade) or empty (requested)."""

    @property
    def active(self) -> bool:
        return self.phase in VMIM_ACTIVE_PHASES and self.deletion_timestamp is None


class PodSnapshot(Snapshot, tag=POD_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    """Only the labels accounting reads (:data:`POD_LABELS_KEPT`)."""
    phase: str = ""
    node_name: str = ""
    deletion_timestamp: datetime | None = None
    deletion_grace_period_seconds: int | None = None
    owner_vmi_name: str = ""
    owner_vmi_uid: str = ""
    requests: dict[str, Quantity] = {}
    """Effective pod requests (``shared.podusage``), overhead included."""
    limits: dict[str, Quantity] = {}
    usage: dict[str, Quantity] = {}
    """What the quota evaluator charges while the pod is not terminal, in ResourceQuota names."""
    memory_overhead: Quantity | None = None
    """The ``kubevirt.io/memory-overhead-bytes`` annotation, when present."""
    terminating_scope: bool = False
    """``spec.activeDeadlineSeconds`` is set (the ``Terminating`` quota scope)."""
    best_effort: bool = False
    """BestEffort QoS: no container requests or limits CPU or memory."""
    priority_class_name: str = ""

    def __post_init__(self) -> None:  # on construction and on decode (every pod event the ledger folds: inlined)
        setattr_, intern, shared = _set, _intern, _SHARED_LIST_IDS
        requests, limits, usage = self.requests, self.limits, self.usage
        if (
            shared.get(id(requests)) is not requests
            or shared.get(id(limits)) is not limits
            or shared.get(id(usage)) is not usage
        ):  # (shared lists are themselves: the events decoder hands them out)
            requests, limits, usage = _shared_pod_resources(requests, limits, usage)
            setattr_(self, "requests", requests)
            setattr_(self, "limits", limits)
            setattr_(self, "usage", usage)
        setattr_(self, "namespace", intern(self.namespace))
        setattr_(self, "uid", intern(self.uid))  # (the name is the pod's own: nothing to share it with)
        setattr_(self, "phase", intern(self.phase))
        setattr_(self, "node_name", intern(self.node_name))
        setattr_(self, "owner_vmi_name", intern(self.owner_vmi_name))
        setattr_(self, "owner_vmi_uid", intern(self.owner_vmi_uid))
        labels = self.labels
        for k, v in labels.items():
            labels[k] = intern(v) if len(v) <= 64 else v

    @property
    def is_launcher(self) -> bool:
        """Labelled as a launcher pod (a tenant can write the label: only ``status.activePods`` vouches for it)."""
        return labelled_launcher(self.labels)

    @property
    def vmi_uid(self) -> str:
        """The VMI this launcher pod belongs to (``kubevirt.io/created-by``, else the owner reference)."""
        return self.labels.get(CREATED_BY_LABEL) or self.owner_vmi_uid

    @property
    def migration_job_uid(self) -> str:
        return self.labels.get(MIGRATION_JOB_LABEL, "")


class QuotaSnapshot(Snapshot, tag=QUOTA_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    spec_hard: dict[str, Quantity] = {}
    scopes: list[str] = []
    scope_selector: list[ScopeSelector] = []
    status_hard: dict[str, Quantity] = {}
    status_used: dict[str, Quantity] = {}

    unread: ClassVar[frozenset[str]] = frozenset({"resource_version", "status_hard", "status_used"})
    """The status is the quota controller's echo, rewritten on every admitted pod; accounting reads the spec and
    the metadata only."""


class NamespaceSnapshot(Snapshot, tag=NAMESPACE_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    phase: str = ""


class KubeVirtSnapshot(Snapshot, tag=KUBEVIRT_KIND, frozen=True, kw_only=True):
    version: str = ""
    """``status.observedKubeVirtVersion`` (empty: unknown, the renderer's default applies)."""
    cpu_allocation_ratio: str = "10"
    memory_overcommit: int = 100
    configuration: dict[str, Any] = {}
    """The parts of ``spec.configuration`` that shape launcher pods, verbatim."""

    def as_object(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "kind": KUBEVIRT_KIND,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {"configuration": self.configuration},
        }
        if self.version:
            obj["status"] = {"observedKubeVirtVersion": self.version}
        return obj


class EventSnapshot(Snapshot, tag=EVENT_KIND, frozen=True, kw_only=True):
    """A ``FailedCreate`` event on a VMI (KubeVirt could not create a launcher pod)."""

    reason: str = ""
    type: str = ""
    involved_kind: str = ""
    involved_name: str = ""
    involved_uid: str = ""
    message: str = ""
    quota_name: str = ""
    """The ResourceQuota that refused the pod (``exceeded quota: <name>``), if the message says."""
    requested: dict[str, Quantity] = {}
    """The ``requested:`` amounts of the refusal: exactly what the pod is charged for those resources."""
    count: int = 1
    last_timestamp: datetime | None = None

    @property
    def quota_refusal(self) -> bool:
        return bool(self.quota_name)


AnySnapshot = (
    VmiSnapshot
    | VmSnapshot
    | VmimSnapshot
    | PodSnapshot
    | QuotaSnapshot
    | NamespaceSnapshot
    | KubeVirtSnapshot
    | EventSnapshot
)
SNAPSHOT_TYPES: Final[Mapping[str, type[Snapshot]]] = {
    t.__struct_config__.tag: t  # type: ignore[misc]
    for t in (
        VmiSnapshot,
        VmSnapshot,
        VmimSnapshot,
        PodSnapshot,
        QuotaSnapshot,
        NamespaceSnapshot,
        KubeVirtSnapshot,
        EventSnapshot,
    )
}
SUPPORTED_KINDS: Final = frozenset(SNAPSHOT_TYPES)


def _read_spans(tp: type[Snapshot]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Index ranges of ``astuple(snapshot)`` holding the fields accounting reads (all but ``tp.unread``), and the
    indexes among them of fields holding quantities (whose equality ignores the printed form)."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    fields = tp.__struct_fields__
    for i, name in enumerate(fields):
        if name in tp.unread:
            if start is not None:
                spans.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(fields)))
    hints = {f.name: f.type for f in msgspec.structs.fields(tp)}
    quantities = tuple(i for i, name in enumerate(fields) if name not in tp.unread and _holds_quantities(hints[name]))
    return tuple(spans), quantities


def _holds_quantities(tp: object) -> bool:
    if tp is Quantity:
        return True
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return any(_holds_quantities(f.type) for f in msgspec.structs.fields(tp))
    return any(_holds_quantities(arg) for arg in getattr(tp, "__args__", ()))


def same_content(old: Snapshot, new: Snapshot) -> bool:
    """Whether ``new`` tells accounting nothing ``old`` did not: the same type and fields, quantities printed the
    same way, but for the resourceVersion and the other fields in ``unread`` (a pod's status heartbeat, a quota's
    ``status.used``). The ledger stores such a version without accounting the namespace again."""
    tp = type(old)
    if type(new) is not tp:
        return False
    spans = _SPANS.get(tp)
    if spans is None:
        spans = _SPANS[tp] = _read_spans(tp)
    a, b = msgspec.structs.astuple(old), msgspec.structs.astuple(new)
    for i, j in spans[0]:  # (loops, not all(...): this runs for every update the ledger folds)
        if a[i:j] != b[i:j]:
            return False
    for i in spans[1]:  # equal amounts: the same printed form too (shared lists, cached quantities: identical)
        x, y = a[i], b[i]
        if x is not y and _ENCODER.encode(x) != _ENCODER.encode(y):
            return False
    return True


_SPANS: dict[type[Snapshot], tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = {}


# ---- wire format -----------------------------------------------------------------------------------------------


def enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook``: quantities as canonical strings, fractions as decimal strings."""
    if type(obj) is Quantity:  # every quantity of every event (the printed form is cached on the object)
        return obj.canonical()
    if isinstance(obj, Fraction):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_WIRE_QUANTITIES: dict[str, Quantity] = {}
"""Quantities decoded, by printed form: quantities on the bus are canonical strings from a small set, so one
(immutable) object serves them all; a plain dict lookup is the cheapest call per quantity decoded, and sharing
the object lets snapshots share their resource lists (:func:`shared_resources`)."""


def dec_hook(tp: type, obj: Any) -> Any:
    """msgspec ``dec_hook``: quantities from strings (or JSON numbers)."""
    if tp is Quantity:
        if type(obj) is str:
            q = _WIRE_QUANTITIES.get(obj)
            if q is None:
                q = Quantity.parse(obj)
                if len(_WIRE_QUANTITIES) >= 8192:
                    _WIRE_QUANTITIES.clear()
                _WIRE_QUANTITIES[obj] = q
            return q
        return Quantity.parse(obj)
    raise NotImplementedError(f"cannot decode {tp}")


_ENCODER: Final = msgspec.json.Encoder(enc_hook=enc_hook)
_DECODER: Final = msgspec.json.Decoder(AnySnapshot, dec_hook=dec_hook)


def encode(snapshot: Snapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode(data: bytes | str) -> AnySnapshot:
    """Decode any snapshot; msgspec.ValidationError (a ValueError) on a malformed one. (Read as
    :data:`WIRE_SNAPSHOT` first: :func:`from_wire`; anything that does not read so is decoded again as
    :data:`AnySnapshot`, which says what is wrong.)"""
    try:
        snap: AnySnapshot = from_wire(_WIRE_DECODER.decode(data))
    except Exception:
        return _DECODER.decode(data)
    return snap


def to_builtins(snapshot: Snapshot) -> Any:
    return msgspec.to_builtins(snapshot, enc_hook=enc_hook)


def from_builtins(obj: Any) -> AnySnapshot:
    snap: AnySnapshot = msgspec.convert(obj, AnySnapshot, dec_hook=dec_hook)
    return snap


# ---- the events decoder's fast path: parts that recur verbatim on the wire -----------------------------------------

RAW: Final = msgspec.Raw | msgspec.UnsetType
"""In a :func:`wire_variant`: the field's JSON text (``msgspec.UNSET`` when it is absent)."""


def wire_variant(tp: type[msgspec.Struct], **types: Any) -> Any:
    """A Struct (decode only) that reads the JSON ``tp`` reads: the same wire names, tag and defaults, the named
    fields typed as given (:data:`RAW`: their JSON text), and no ``__post_init__``."""
    fields = msgspec.structs.fields(tp)
    config = tp.__struct_config__

    def default(f: msgspec.structs.FieldInfo) -> Any:
        if types.get(f.name) is RAW:
            return msgspec.UNSET
        if f.default_factory is not msgspec.NODEFAULT:
            return msgspec.field(default_factory=f.default_factory)
        return msgspec.field() if f.default is msgspec.NODEFAULT else f.default

    return msgspec.defstruct(
        f"Wire{tp.__name__}",
        [(f.name, types.get(f.name, f.type), default(f)) for f in fields],
        module=__name__,
        tag_field=config.tag_field,
        tag=config.tag,
        rename={f.name: f.encode_name for f in fields},
        forbid_unknown_fields=config.forbid_unknown_fields,
        frozen=True,
        kw_only=True,
        gc=False,
    )


# A launcher pod's three resource lists hold 25 quantities (a ``dec_hook`` call each, then the lists are shared with
# equal ones), and a VMI's kept spec is a dozen containers that are encoded again to be shared: most of decoding an
# event. Pods of one size and VMIs of one template carry them byte for byte the same. The wire variants read them as
# JSON text, and each distinct text is decoded once (bounded memos; the values are shared, read-only, as the
# snapshots' own sharing makes them). Decoding is a function of the text, so a text's value is the same every time.
_WirePod: Final = wire_variant(PodSnapshot, requests=RAW, limits=RAW, usage=RAW)
_WireVmi: Final = wire_variant(VmiSnapshot, spec=RAW)
_MEMO_ENTRIES: Final = 4096
_MEMO_TEXT_BYTES: Final = 4096
"""Longer texts are decoded every time, not remembered."""
_RESOURCES_DECODER: Final = msgspec.json.Decoder(dict[str, Quantity], dec_hook=dec_hook)
_SPEC_DECODER: Final = msgspec.json.Decoder(dict[str, Any])
_POD_LISTS: dict[tuple[bytes, bytes, bytes], tuple[dict[str, Quantity], ...]] = {}
_VMI_SPECS: dict[bytes, dict[str, Any]] = {}


def _pod_from_wire(w: Any) -> PodSnapshot:
    unset = msgspec.UNSET  # (absent: the default, an empty list)
    r, lim, u = w.requests, w.limits, w.usage
    key = (b"{}" if r is unset else bytes(r), b"{}" if lim is unset else bytes(lim), b"{}" if u is unset else bytes(u))
    lists = _POD_LISTS.get(key)
    if lists is None:
        lists = tuple(shared_resources(_RESOURCES_DECODER.decode(text)) for text in key)
        if sum(map(len, key)) <= _MEMO_TEXT_BYTES:
            if len(_POD_LISTS) >= _MEMO_ENTRIES:
                _POD_LISTS.clear()
            _POD_LISTS[key] = lists
    requests, limits, usage = lists
    return PodSnapshot(
        schema=w.schema,
        uid=w.uid,
        namespace=w.namespace,
        name=w.name,
        resource_version=w.resource_version,
        creation_timestamp=w.creation_timestamp,
        labels=w.labels,
        phase=w.phase,
        node_name=w.node_name,
        deletion_timestamp=w.deletion_timestamp,
        deletion_grace_period_seconds=w.deletion_grace_period_seconds,
        owner_vmi_name=w.owner_vmi_name,
        owner_vmi_uid=w.owner_vmi_uid,
        requests=requests,
        limits=limits,
        usage=usage,
        memory_overhead=w.memory_overhead,
        terminating_scope=w.terminating_scope,
        best_effort=w.best_effort,
        priority_class_name=w.priority_class_name,
    )


def _vmi_from_wire(w: Any) -> VmiSnapshot:
    text = b"{}" if w.spec is msgspec.UNSET else bytes(w.spec)  # (absent: the default, no spec)
    spec = _VMI_SPECS.get(text)
    if spec is None:
        spec = compact_vmi_spec(_SPEC_DECODER.decode(text))
        if len(text) <= _MEMO_TEXT_BYTES:
            if len(_VMI_SPECS) >= _MEMO_ENTRIES:
                _VMI_SPECS.clear()
            _VMI_SPECS[text] = spec
    return VmiSnapshot(
        schema=w.schema,
        uid=w.uid,
        namespace=w.namespace,
        name=w.name,
        resource_version=w.resource_version,
        creation_timestamp=w.creation_timestamp,
        labels=w.labels,
        annotations=w.annotations,
        deletion_timestamp=w.deletion_timestamp,
        phase=w.phase,
        node_name=w.node_name,
        vcpus=w.vcpus,
        guest_memory=w.guest_memory,
        status_vcpus=w.status_vcpus,
        status_guest_memory=w.status_guest_memory,
        requests=w.requests,
        limits=w.limits,
        memory_overhead=w.memory_overhead,
        migration=w.migration,
        active_pods=w.active_pods,
        pod_refused=w.pod_refused,
        priority_class_name=w.priority_class_name,
        spec=spec,
    )


_FROM_WIRE: Final[dict[type, Any]] = {_WirePod: _pod_from_wire, _WireVmi: _vmi_from_wire}

WIRE_SNAPSHOT: Final = Union[  # noqa: UP007  (a union built at run time)
    tuple(_WirePod if t is PodSnapshot else _WireVmi if t is VmiSnapshot else t for t in SNAPSHOT_TYPES.values())
]
""":data:`AnySnapshot` as the events decoder's fast path reads it (:func:`from_wire` makes the snapshot)."""


def from_wire(w: Any) -> Any:
    """The snapshot a value read as :data:`WIRE_SNAPSHOT` stands for: what decoding it as :data:`AnySnapshot`
    gives (None stays None). Raises like that decoding (``msgspec.ValidationError``) on a part it refuses."""
    make = _FROM_WIRE.get(type(w))
    return w if make is None else make(w)


_WIRE_DECODER: Final = msgspec.json.Decoder(WIRE_SNAPSHOT, dec_hook=dec_hook)
