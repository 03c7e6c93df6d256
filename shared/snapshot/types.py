"""The snapshot types: one frozen msgspec Struct per kind accounting reads, tagged by the Kubernetes ``kind``, with
the labels and phases of KubeVirt's objects they are read with, and :func:`same_content` (whether a new version
tells accounting anything)."""

from __future__ import annotations

from collections.abc import Container, Mapping
from datetime import datetime
from typing import Any, ClassVar, Final

import msgspec

from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
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
from shared.quota.annotations import REPORT_ANNOTATIONS
from shared.snapshot.hooks import enc_hook
from shared.snapshot.vmispec import SharedSpec, compact_vmi_spec

_set: Final = msgspec.structs.force_setattr
_VALUES: Final = msgspec.json.Encoder(enc_hook=enc_hook)
"""Field values in their wire form (:func:`same_content` compares quantities by their printed form)."""

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
HOT_MEMORY_CHANGE: Final = "HotMemoryChange"
"""The VMI condition of a memory change (KubeVirt's ``VirtualMachineInstanceMemoryChange``)."""
POD_LABELS_KEPT: Final = (LAUNCHER_LABEL, CREATED_BY_LABEL, VM_NAME_LABEL, MIGRATION_JOB_LABEL)
VMIM_ACTIVE_PHASES: Final = frozenset(
    {"", "Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running"}
)
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
    unread_annotations: ClassVar[frozenset[str]] = frozenset()
    """Annotations no accounting result depends on (:func:`same_content` ignores them)."""

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


class VmiSnapshot(Snapshot, tag=VMI_KIND, frozen=True, kw_only=True):
    """(No labels: nothing renders or accounts from a VMI's labels; the decoder ignores those that events of older
    versions carry.)"""

    annotations: dict[str, str] = {}
    """The annotations the launcher pod is rendered from (``shared.kubevirt.render.RENDER_ANNOTATIONS``): only
    those, so that a tenant's other annotations (or the enforcer's nudge) neither change what accounting reads nor
    grow a ledger. (Events of older versions carry all but kubectl's last-applied configuration.)"""
    deletion_timestamp: datetime | None = None
    phase: str = ""
    node_name: str = ""
    vcpus: int = 1
    """vCPUs of the spec, after KubeVirt's admission defaults."""
    guest_memory: Quantity | None = None
    """Guest memory of the spec, after KubeVirt's admission defaults."""
    status_vcpus: int | None = None
    """``status.currentCPUTopology`` as a vCPU count (hotplug), when reported, plus the supplemental IO thread pool
    :attr:`vcpus` counts."""
    status_guest_memory: Quantity | None = None
    """The larger of ``status.memory.guestRequested`` and ``guestCurrent``, when reported."""
    memory_change: bool = False
    """The spec's guest memory differs from ``status.memory.guestRequested``: a memory hotplug, or unplug, that
    KubeVirt carries out by a migration (its VMI controller's ``requireMemoryHotplug``; KubeVirt grows explicit
    memory requests and limits with it by the new size less the guest's current memory, an unplug too)."""
    requests: dict[str, Quantity] = {}
    """Explicit ``spec.domain.resources.requests``."""
    limits: dict[str, Quantity] = {}
    """Explicit ``spec.domain.resources.limits``."""
    memory_overhead: Quantity | None = None
    """``status.memory.memoryOverhead``: the overhead KubeVirt published, when it did."""
    migration: VmiMigrationState | None = None
    active_pods: dict[str, str] = {}
    """``status.activePods``: pod uid → node of the launcher pods KubeVirt's VMI controller counts as the VMI's (a
    field only KubeVirt writes once it has synced the VMI: the one proof that a pod is a launcher pod, whatever its
    labels say; read it through :attr:`vouched_pods`)."""
    unplugged_interfaces: tuple[int, ...] = ()
    """Indexes in the spec's ``domain.devices.interfaces`` of interfaces added to the running VMI that its pod does
    not have yet (``shared.vmi.unplugged_interfaces``, from ``status.interfaces``, a field only KubeVirt writes):
    an SR-IOV one is growth to admit (KubeVirt's VFIO overhead) when its migration renders the target with it."""
    pod_refused: bool = False
    """Condition ``Synchronized=False`` with reason ``FailedCreate`` for room: KubeVirt tried to create the launcher
    pod and a ResourceQuota, or the reservation guard, refused it (a field only KubeVirt writes); ``refused_by``
    says which (empty from watchers before it: any ``FailedCreate``)."""
    refused_by: str = ""
    """``shared.vmi.room_refuser`` of that condition: the refusing ResourceQuota's name, or the guard's."""
    priority_class_name: str = ""
    hotplug_volumes: bool = False
    """KubeVirt's ``VMIHasHotplugVolumes`` (a volume status with ``hotplugVolume``, or a hotpluggable DataVolume or
    PVC): a migration of the VMI waits for an attachment pod beside its target."""
    spec: dict[str, Any] = {}
    """The parts of the VMI spec the launcher pod depends on (:func:`compact_vmi_spec`), to re-render it. Read-only:
    VMIs with the same such parts share one dict."""

    def __post_init__(self) -> None:
        if type(self.spec) is not SharedSpec:  # (old writers sent the whole spec; the decoder hands out a kept one)
            _set(self, "spec", compact_vmi_spec(self.spec))

    @property
    def synced(self) -> bool:
        """Whether KubeVirt has written the VMI's status: it is past ``Pending``. KubeVirt keeps the status a VMI is
        created with (its VMI has no status subresource; virt-api's webhook sets only the phase, ``Pending``), and
        only its own controllers move the phase on: a pending VMI's status is its creator's words."""
        return self.phase not in VMI_WAITING_PHASES

    @property
    def fewer_vcpus(self) -> bool:
        """The status reports fewer vCPUs than the spec (a CPU hotplug not carried out, or a forged status)."""
        return self.status_vcpus is not None and self.status_vcpus < self.vcpus

    @property
    def less_memory(self) -> bool:
        """The status reports less guest memory than the spec."""
        return (
            self.status_guest_memory is not None
            and self.guest_memory is not None
            and self.status_guest_memory < self.guest_memory
        )

    @property
    def vouched_pods(self) -> dict[str, str]:
        """:attr:`active_pods` once :attr:`synced` (KubeVirt's VMI controller moves a VMI with a pod to
        ``Scheduling`` in the same write that lists the pod, ``lifecycle.go``); none while it is pending."""
        return self.active_pods if self.synced else {}

    def as_object(self) -> dict[str, Any]:
        """A VMI object with what the renderer reads (metadata, spec, the published overhead)."""
        obj: dict[str, Any] = {
            "apiVersion": "kubevirt.io/v1",
            "kind": VMI_KIND,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "annotations": dict(self.annotations),
            },
            "spec": self.spec,
        }
        if self.memory_overhead is not None:
            obj["status"] = {"memory": {"memoryOverhead": self.memory_overhead.canonical()}}
        return obj


class VmSnapshot(Snapshot, tag=VM_KIND, frozen=True, kw_only=True):
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

    @property
    def pending(self) -> bool:
        """``Pending`` (or no phase yet): KubeVirt has not gone past the target's creation (and, for a VMI with
        hotplugged volumes, its attachment pod's)."""
        return self.phase in ("", "Pending")


class PodSnapshot(Snapshot, tag=POD_KIND, frozen=True, kw_only=True):
    labels: dict[str, str] = {}
    """Only the labels accounting reads (:data:`POD_LABELS_KEPT`)."""
    phase: str = ""
    node_name: str = ""
    deletion_timestamp: datetime | None = None
    deletion_grace_period_seconds: int | None = None
    owner_vmi_name: str = ""
    owner_vmi_uid: str = ""
    command_vmi_uid: str = ""
    """The VMI uid its ``compute`` container's ``virt-launcher-monitor`` command names
    (:func:`shared.kubevirt.command.launched_vmi_uid`): the one mark of a launcher pod its tenant cannot take off."""
    owner_pod_uid: str = ""
    """The uid of the pod its controller reference names, if a pod does (KubeVirt's hotplug attachment pods: of a
    launcher pod; a tenant may write such a reference on its pods too)."""
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

    @property
    def attachment_of(self) -> str:
        """The uid of the pod KubeVirt takes this one for the hotplug attachment pod of (``AttachmentPods``: a pod
        its informer sees, with the label key ``kubevirt.io``, that the pod controls), or ""."""
        return self.owner_pod_uid if LAUNCHER_LABEL in self.labels else ""


def awaits_attachment_pod(
    migration: VmimSnapshot, vmi: VmiSnapshot, target: PodSnapshot, attached: Container[str]
) -> bool:
    """Whether KubeVirt waits for a hotplug attachment pod beside a migration's target: the migration may wait for
    one (:func:`migration_awaits_attachment`), and its target does (:func:`target_awaits_attachment`). KubeVirt marks
    no refusal of such a pod, so room for it is held on this alone."""
    return migration_awaits_attachment(migration, vmi) and target_awaits_attachment(target, attached)


def migration_awaits_attachment(migration: VmimSnapshot, vmi: VmiSnapshot) -> bool:
    """The migration is active and ``Pending``, and its VMI has hotplugged volumes: once its target runs, KubeVirt
    goes on only with an attachment pod beside it."""
    return migration.active and migration.pending and bool(vmi.hotplug_volumes)


def target_awaits_attachment(target: PodSnapshot, attached: Container[str]) -> bool:
    """The target runs, and no pod KubeVirt sees is its attachment pod yet (``attached``: the
    :attr:`PodSnapshot.attachment_of` of the namespace's pods)."""
    return target.phase == "Running" and target.uid not in attached


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
    unread_annotations: ClassVar[frozenset[str]] = REPORT_ANNOTATIONS
    """What the enforcer reports on the quota for people (its status line, the usage summary it refreshes every
    ``--usage-refresh-interval``): a write of them alone makes the ledger account the namespace again for nothing."""


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
    """Index ranges of ``astuple(snapshot)`` holding the fields accounting reads (all but ``tp.unread``, and but
    ``annotations`` when ``tp.unread_annotations`` says some are unread: :func:`same_content` compares those apart),
    and the indexes among them of fields holding quantities (whose equality ignores the printed form)."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    fields = tp.__struct_fields__
    unread = tp.unread | ({"annotations"} if tp.unread_annotations else set())  # (those compared apart)
    for i, name in enumerate(fields):
        if name in unread:
            if start is not None:
                spans.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(fields)))
    hints = {f.name: f.type for f in msgspec.structs.fields(tp)}
    quantities = tuple(i for i, name in enumerate(fields) if name not in unread and _holds_quantities(hints[name]))
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
    ``status.used``) and the annotations in ``unread_annotations`` (the enforcer's reports on a quota). The ledger
    stores such a version without accounting the namespace again."""
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
        if x is not y and _VALUES.encode(x) != _VALUES.encode(y):
            return False
    if tp.unread_annotations:  # (the same annotations, the usual case: no copies)
        a_ann, b_ann = getattr(old, "annotations"), getattr(new, "annotations")  # noqa: B009
        return a_ann == b_ann or _read_annotations(old) == _read_annotations(new)
    return True


def _read_annotations(s: Snapshot) -> dict[str, str]:
    annotations: dict[str, str] = getattr(s, "annotations")  # noqa: B009 (the types with unread annotations have it)
    unread = type(s).unread_annotations
    return {k: v for k, v in annotations.items() if k not in unread}


_SPANS: dict[type[Snapshot], tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = {}


def is_cluster_scoped(s: Snapshot) -> bool:
    """A snapshot of a kind that holds for the whole cluster (``shared.kinds.CLUSTER_SCOPED_KINDS``): every
    namespace's accounting reads it."""
    return type(s).__struct_config__.tag in CLUSTER_SCOPED_KINDS
