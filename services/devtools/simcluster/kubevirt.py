"""KubeVirt in the simulated cluster: virt-controller, virt-handler and a few simulated nodes.

What vmquota depends on behaves as in KubeVirt (see ``docs/simcluster.md``, "Controllers"):

* **VM controller** — ``spec.running`` / ``spec.runStrategy`` → a VMI (ownerRef, template labels and annotations,
  admission defaults written into the spec); stopping deletes the VMI; raising ``cpu.sockets`` or
  ``memory.guest`` of a running VM patches the VMI and starts a workload-update migration (hotplug); a bridge or
  SR-IOV interface added to its template is appended to the VMI (a bridge one plugged in place, an SR-IOV one by
  a workload-update migration, ``MigrationRequired`` until then).
* **VMI controller** — renders the launcher pod with :func:`shared.kubevirt.render_launcher_pod` (plus an optional
  per-pod extra the renderer does not know: real clusters drift) and creates it. A refusal is a VMI Event
  ``Warning FailedCreate "Error creating pod: <API server message>"``, condition ``Synchronized=False`` reason
  ``FailedCreate`` (``failed to create virtual machine pod: <API server message>``), and a retry with per-item
  exponential backoff (KubeVirt's VMI controller has no ResourceQuota informer: a quota change does not wake it).
  Phases Pending → Scheduling → Scheduled → Running follow the pod. It and the migration controller see only pods
  carrying the label key ``kubevirt.io`` (:func:`kubevirt_sees`, as upstream's ``KubeVirtPod`` informer).
* **Migration controller** — virt-api's webhook puts ``kubevirt.io/migrationJobFinalize`` on each new migration
  (nothing puts it back once it is taken off) and keeps a migration's spec; one deleted before the hand-off is
  canceled (its target pod deleted, the migration failed: ``handlePreHandoffMigrationCancel``), one deleted after it
  aborted once it runs, unless its domain has moved already.
  Pending → target pod (label ``kubevirt.io/migrationJobUID``, annotation
  ``kubevirt.io/migrationJobName``; a quota refusal sets ``migrationRejectedByResourceQuota`` and keeps the
  migration Pending, retried like pod creation, and at once when a ResourceQuota of the namespace is updated or
  deleted) → Scheduling → Scheduled (hand-off: VMI ``status.migrationState``); for a VMI with hotplugged volumes
  (``shared.vmi.has_hotplug_volumes``) the migration stays Pending once the target exists until an attachment pod
  (``hp-volume-*``, controlled by the target pod, created once the target runs; a refusal is an Event on the
  migration and a retry) runs beside it
  → PreparingTarget → TargetReady → Running → Succeeded; the source pod then goes Succeeded and is deleted a bit
  later. At most ``parallel_migrations`` in the cluster and ``parallel_outbound_per_node`` per source node.
* **Kubelet / scheduler** — every pod gets a node (honouring required pod anti-affinity on the hostname) and
  turns Running after a delay; a pod annotated ``simcluster.vmquota.io/fail-start`` fails instead.

All delays are multiplied by :attr:`KubeVirtTiming.speed`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, cast

from services.devtools.simcluster.auth import KUBEVIRT_CONTROLLER, acting_as, current_user
from services.devtools.simcluster.cache import Cache, Key, key_of, uid_of
from services.devtools.simcluster.patch import copy_json
from services.devtools.simcluster.registry import format_time
from services.devtools.simcluster.store_api import ApiError, Obj, Operation, Resource, StoreAPI, WatchType
from services.platform.logs import get_logger
from services.platform.workqueue import WorkQueue
from shared.backoff import Backoff, TokenBucket
from shared.errors import InvalidInput
from shared.kinds import FINAL_PHASES
from shared.kubevirt import (
    COMPUTE,
    MEMORY_OVERHEAD_ANNOTATION,
    KubeVirtConfig,
    NamespaceFacts,
    RenderedPod,
    render_launcher_pod,
)
from shared.kubevirt.command import set_launcher_command
from shared.kubevirt.render import attachment_resources
from shared.kubevirt.vm import (
    API_VERSION,
    STARTING_STRATEGIES,
    owner_ref,
    run_strategy,
    vmi_from_vm,
    with_admission_defaults,
)
from shared.quantity import ZERO, Format, Quantity
from shared.vmi import has_hotplug_volumes, vmi_spec

# ---- names KubeVirt uses ---------------------------------------------------------------------------------------
# Written here from upstream, not imported from the product (``shared.snapshot`` has some of them too): the
# simulator is the product's model of KubeVirt, and a name the product got wrong must not be wrong here as well.


APP_LABEL: Final = "kubevirt.io"
LAUNCHER: Final = "virt-launcher"
CREATED_BY_LABEL: Final = "kubevirt.io/created-by"
VM_NAME_LABEL: Final = "vm.kubevirt.io/name"
VMI_ID_LABEL: Final = "vmi.kubevirt.io/id"
NODE_NAME_LABEL: Final = "kubevirt.io/nodeName"
MIGRATION_JOB_LABEL: Final = "kubevirt.io/migrationJobUID"
MIGRATION_JOB_NAME_ANNOTATION: Final = "kubevirt.io/migrationJobName"
MIGRATION_TARGET_NODE_LABEL: Final = "kubevirt.io/migrationTargetNodeName"
VMI_NAME_LABEL: Final = "kubevirt.io/vmi-name"
POD_MEMORY_REQUESTS_LABEL: Final = "kubevirt.io/vmi-pod-memory-resource-requests"
"""VMI label: virt-controller sets it at the hand-off of a VMI with a memory change pending to the target's compute
container memory request (its hugepages too); virt-handler carries the change out at the migration's end only where
it covers the target's memory overhead and the spec's memory request (``hotplugMemory``), and takes it off."""
DOMAIN_ANNOTATION: Final = "kubevirt.io/domain"
WORKLOAD_UPDATE_ANNOTATION: Final = "kubevirt.io/workloadUpdateMigration"
WORKLOAD_UPDATE_PREFIX: Final = "kubevirt-workload-update-"
MIGRATION_REQUIRED: Final = "MigrationRequired"
"""VMI condition: a live update (an SR-IOV interface added) is applied only by a migration, which the workload
updater starts."""
REJECTED_BY_QUOTA: Final = "migrationRejectedByResourceQuota"
FAIL_START_ANNOTATION: Final = "simcluster.vmquota.io/fail-start"
"""Simulator only: a pod with this annotation fails instead of running (on a VMIM: its target pod fails)."""
_RENDERED_MAX: Final = 1024
"""Launcher pod renderings kept for retries."""
COMPONENT: Final = "virtualmachine-controller"
VMI_KIND_NAME: Final = "VirtualMachineInstance"

VMIM_ACTIVE: Final = frozenset({"Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running"})
ABORT_REQUESTED: Final = "AbortRequested"
"""The condition KubeVirt's migration controller puts on a migration deleted before it is final."""


@dataclass(frozen=True, slots=True)
class KubeVirtTiming:
    """Delays in seconds (all multiplied by ``speed``)."""

    speed: float = 1.0
    schedule_delay: float = 0.02
    """Pod created → bound to a node."""
    start_delay: float = 0.1
    """Pod bound → Running (image pull, container start)."""
    boot_delay: float = 0.05
    """Launcher pod Running → VMI Running (virt-handler starts the domain)."""
    migration_step: float = 0.05
    """Each migration phase after the target pod is ready."""
    source_shutdown_delay: float = 0.05
    """Migration Succeeded → the source launcher pod turns Succeeded."""
    terminal_pod_cleanup: float = 0.5
    """A terminal launcher pod (migration source) is deleted after this long."""
    backoff_base: float = 0.005
    backoff_cap: float = 1000.0
    bucket_qps: float = 10.0
    bucket_burst: int = 100
    """The overall token bucket of each controller's rate limiter (client-go's default: 10 retries a second, 100 at
    once), over all the objects the controller retries; a retry waits for the longer of it and the per-item
    backoff."""
    backoff_in_real_time: bool = False
    """Pod-creation retries at ``backoff_base`` / ``backoff_cap`` and the bucket as given, not scaled by ``speed``:
    KubeVirt's rate limiter races vmquota's reaction, which runs in real time, so a count of refused tries is
    KubeVirt's only when its rate limiter is too."""
    parallel_wait: float = 5.0
    """Re-check of a migration held back by the parallel-migration limits."""
    unschedulable_timeout: float = 300.0
    """A migration target pod that cannot be scheduled this long is deleted and the migration fails."""
    pending_timeout: float = 900.0
    """A migration target pod Pending for another reason this long: the same."""

    def __call__(self, seconds: float) -> float:
        return seconds * self.speed

    def backoff(self) -> Backoff:
        """The controllers' per-item retry backoff (client-go's exponential failure rate limiter; no jitter)."""
        scale = 1.0 if self.backoff_in_real_time else self.speed
        return Backoff(initial=self.backoff_base * scale, maximum=self.backoff_cap * scale, jitter=0.0)

    def bucket(self) -> TokenBucket:
        """A controller's overall retry bucket (client-go's ``BucketRateLimiter``), full."""
        scale = 1.0 if self.backoff_in_real_time else self.speed
        return TokenBucket(rate=self.bucket_qps / scale, burst=self.bucket_burst)


@dataclass(frozen=True, slots=True)
class KubeVirtSimConfig:
    nodes: tuple[str, ...] = ("node01", "node02", "node03")
    parallel_migrations: int = 5
    parallel_outbound_per_node: int = 2
    finished_migrations_kept: int = 5
    extra_memory_overhead: Quantity | None = None
    """Added to the compute container's memory request and limit of every launcher pod (and to the published
    overhead): what the renderer does not know about this cluster."""
    launcher_image: str = "quay.io/kubevirt/virt-launcher"


# ---- small helpers ---------------------------------------------------------------------------------------------


def now_rfc3339() -> str:
    return format_time(time.time())


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    lab = meta(obj).get("labels")
    return lab if isinstance(lab, Mapping) else {}


def annotations_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    ann = meta(obj).get("annotations")
    return ann if isinstance(ann, Mapping) else {}


def status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    st = obj.get("status")
    return st if isinstance(st, Mapping) else {}


def phase(obj: Mapping[str, Any]) -> str:
    return str(status(obj).get("phase") or "")


MIGRATION_FINALIZER: Final = "kubevirt.io/migrationJobFinalize"
"""The finalizer virt-api puts on every new migration; the migration controller takes it off a deleted one once it
is final."""
VMI_FINALIZER: Final = "kubevirt.io/foregroundDeleteVirtualMachine"
"""virt-api puts it on every VMI it admits; the VMI controller takes it off a deleted VMI once the pods it controls
are gone."""


def deleting(obj: Mapping[str, Any]) -> bool:
    return bool(meta(obj).get("deletionTimestamp"))


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    return any(isinstance(r, Mapping) and r.get("uid") == owner_uid for r in meta(obj).get("ownerReferences") or [])


def set_condition(
    conds: list[Obj], type_: str, status_: str, reason: str = "", message: str = "", *, probe: bool = False
) -> None:
    """Set a condition in place, keeping ``lastTransitionTime`` when the status does not change."""
    now = now_rfc3339()
    for c in conds:
        if c.get("type") == type_:
            if c.get("status") != status_:
                c["lastTransitionTime"] = now
            c["status"] = status_
            if reason:
                c["reason"] = reason
            else:
                c.pop("reason", None)
            if message:
                c["message"] = message
            else:
                c.pop("message", None)
            return
    new: Obj = {"type": type_, "status": status_, "lastTransitionTime": now}
    new["lastProbeTime"] = now if probe else None
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    conds.append(new)


def remove_condition(conds: list[Obj], type_: str) -> None:
    conds[:] = [c for c in conds if c.get("type") != type_]


def has_condition(obj: Mapping[str, Any], type_: str, status_: str | None = None) -> bool:
    for c in status(obj).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == type_ and (status_ is None or c.get("status") == status_):
            return True
    return False


def set_phase(st: Obj, new_phase: str) -> None:
    if st.get("phase") == new_phase:
        return
    st["phase"] = new_phase
    st.setdefault("phaseTransitionTimestamps", []).append(
        {"phase": new_phase, "phaseTransitionTimestamp": now_rfc3339()}
    )


VMI_NOT_STARTED: Final = frozenset({"", "Pending", "Scheduling", "Scheduled"})
"""VMI phases before virt-handler has started the domain (it writes ``Running`` once it has)."""


def _vcpus(cpu: Mapping[str, Any]) -> int:
    return max(1, _int(cpu.get("sockets"))) * max(1, _int(cpu.get("cores"))) * max(1, _int(cpu.get("threads")))


def vcpus_of(vmi: Mapping[str, Any]) -> int:
    """The vCPUs of a VMI's spec (sockets times cores times threads)."""
    return _vcpus((((vmi.get("spec") or {}).get("domain") or {}).get("cpu")) or {})


def cpu_topology(cpu: Mapping[str, Any]) -> dict[str, int]:
    """``status.currentCPUTopology`` as KubeVirt writes it from a spec's ``domain.cpu``."""
    return {k: max(1, _int(cpu.get(k))) for k in ("sockets", "cores", "threads")}


def guest_memory_status(guest: str) -> dict[str, str]:
    """``status.memory`` as virt-api writes it from a spec's guest memory (at boot, current and requested)."""
    return {"guestAtBoot": guest, "guestCurrent": guest, "guestRequested": guest}


def compute_memory_request(pod: Mapping[str, Any]) -> Quantity:
    """What virt-controller labels a VMI with at a memory hotplug's hand-off (``getTargetPodMemoryRequests``): the
    memory request of the target's compute container and its hugepages."""
    total = ZERO
    for c in (pod.get("spec") or {}).get("containers") or []:
        if isinstance(c, Mapping) and c.get("name") == COMPUTE:
            requests = (c.get("resources") or {}).get("requests") or {}
            for r in ("memory", "hugepages-2Mi", "hugepages-1Gi"):
                if r in requests:
                    total = total + Quantity.parse(requests[r])
    return total.with_format(Format.BINARY_SI)


def memory_covered(vmi: Mapping[str, Any]) -> bool:
    """Whether virt-handler carries a VMI's memory change out at the end of its migration (``hotplugMemory``): the
    label :data:`POD_MEMORY_REQUESTS_LABEL` covers the target's memory overhead and the spec's memory request (none
    in a VMI that sets guest memory only). The label is a VMI label: anyone who may update the VMI may write it."""
    raw = ((vmi.get("metadata") or {}).get("labels") or {}).get(POD_MEMORY_REQUESTS_LABEL)
    try:
        labelled = Quantity.parse(raw)
        required = Quantity.parse((status(vmi).get("migrationState") or {}).get("targetMemoryOverhead") or 0)
        requests = ((((vmi.get("spec") or {}).get("domain") or {}).get("resources") or {}).get("requests")) or {}
        required = required + Quantity.parse(requests.get("memory") or 0)
    except InvalidInput:
        return False  # (upstream: "cannot parse Memory requests from VMI label")
    return labelled >= required


def interface_names(vmi: Mapping[str, Any], *, absent: bool = False) -> list[str]:
    """Names of the VMI's interfaces (without ``state: absent`` ones unless ``absent``): the pod network's
    ``default`` when the spec lists none (KubeVirt's default interface)."""
    domain = (vmi.get("spec") or {}).get("domain") or {}
    listed = (domain.get("devices") or {}).get("interfaces")
    if not listed:
        return ["default"]
    return [
        str(i.get("name") or "") for i in listed if isinstance(i, Mapping) and (absent or i.get("state") != "absent")
    ]


def listed_interfaces(vmi: Mapping[str, Any]) -> set[str]:
    """Names of the interfaces the VMI's ``status.interfaces`` reports (those its current pod has)."""
    return {str(e.get("name")) for e in status(vmi).get("interfaces") or [] if isinstance(e, Mapping)}


def sriov_interfaces(vmi: Mapping[str, Any]) -> set[str]:
    """Names of the VMI's SR-IOV interfaces (KubeVirt plugs a hotplugged one only by a migration)."""
    listed = (((vmi.get("spec") or {}).get("domain") or {}).get("devices") or {}).get("interfaces") or []
    return {str(i.get("name")) for i in listed if isinstance(i, Mapping) and "sriov" in i}


def attachment_pod(owner: Mapping[str, Any], config: KubeVirtConfig, *, image: str) -> Obj:
    """The hotplug attachment pod KubeVirt creates beside a launcher pod (``RenderHotplugAttachmentPodTemplate``):
    ``hp-volume-*``, label ``kubevirt.io: hotplug-disk``, a controller reference to the launcher pod, one container
    sized by :func:`shared.kubevirt.render.attachment_resources`, on the launcher pod's node."""
    requests, limits = attachment_resources(config)
    node = str((owner.get("spec") or {}).get("nodeName") or "")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"hp-volume-{secrets.token_hex(3)[:5]}",
            "namespace": key_of(owner)[0],
            "labels": {APP_LABEL: "hotplug-disk"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta(owner).get("name"),
                    "uid": uid_of(owner),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "hotplug-disk",
                    "image": image,
                    "command": ["/bin/sh", "-c", "/usr/bin/container-disk --copy-path /path/hp"],
                    "resources": {
                        "requests": {r: q.canonical() for r, q in requests.items()},
                        "limits": {r: q.canonical() for r, q in limits.items()},
                    },
                }
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    }
                }
            },
            "terminationGracePeriodSeconds": 0,
        },
    }


def interfaces_status(names: list[str], pod_ip: object) -> list[Obj]:
    """``status.interfaces`` as KubeVirt reports the interfaces a VM's pod has: the first (the pod network) with
    the pod's address, each from the domain (and the secondary ones from the pod's network status)."""
    return [
        {"name": n, "ipAddress": pod_ip, "infoSource": "domain"}
        if i == 0
        else {"name": n, "infoSource": "domain, multus-status"}
        for i, n in enumerate(names)
    ]


def _int(raw: object) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else 0


def launcher_pod(
    vmi: Mapping[str, Any],
    rendered: RenderedPod,
    *,
    image: str,
    extra_overhead: Quantity | None = None,
    migration: Mapping[str, Any] | None = None,
) -> Obj:
    """The pod object KubeVirt creates for a VMI (a migration target when ``migration`` is given)."""
    m = meta(vmi)
    name, uid = str(m.get("name") or ""), str(m.get("uid") or "")
    pod_labels = {**labels_of(vmi), APP_LABEL: LAUNCHER, CREATED_BY_LABEL: uid, VM_NAME_LABEL: name, VMI_ID_LABEL: name}
    pod_annotations = {
        DOMAIN_ANNOTATION: name,
        "kubectl.kubernetes.io/default-container": COMPUTE,
        **rendered.annotations,
    }
    spec: Obj = rendered.pod_spec()
    set_launcher_command(spec, name, uid, str(m.get("namespace") or ""))
    for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        c["image"] = image
    if extra_overhead is not None and extra_overhead.nanos:
        for c in spec["containers"]:
            if c["name"] != COMPUTE:
                continue
            res = c.setdefault("resources", {})
            for part in ("requests", "limits"):
                rl = res.get(part)
                if rl is not None and "memory" in rl:
                    rl["memory"] = (Quantity.parse(rl["memory"]) + extra_overhead).canonical()
        if MEMORY_OVERHEAD_ANNOTATION in pod_annotations:
            total = Quantity.parse(pod_annotations[MEMORY_OVERHEAD_ANNOTATION]) + extra_overhead
            pod_annotations[MEMORY_OVERHEAD_ANNOTATION] = str(total.ceil())
    spec.update(
        {
            "restartPolicy": "Never",
            "nodeSelector": {"kubevirt.io/schedulable": "true"},
            "terminationGracePeriodSeconds": 45,
            "automountServiceAccountToken": False,
            "hostname": name,
        }
    )
    if migration is not None:
        pod_labels[MIGRATION_JOB_LABEL] = uid_of(migration)
        pod_annotations[MIGRATION_JOB_NAME_ANNOTATION] = str(meta(migration).get("name") or "")
        spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {CREATED_BY_LABEL: uid}}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"virt-launcher-{name}-",
            "namespace": m.get("namespace"),
            "labels": pod_labels,
            "annotations": pod_annotations,
            "ownerReferences": [owner_ref({**vmi, "apiVersion": API_VERSION, "kind": "VirtualMachineInstance"})],
        },
        "spec": spec,
    }


# ---- events ----------------------------------------------------------------------------------------------------


class EventRecorder:
    """Kubernetes Events as client-go's recorder writes them (``tools/record`` EventCorrelator): an event seen again
    bumps ``count`` and ``lastTimestamp``; from the 10th distinct message with the same object, type and reason
    within 10 minutes, they are combined into one event whose message is
    ``(combined from similar events): <latest message>``."""

    MAX_SIMILAR: Final = 10
    WINDOW: Final = 600.0
    CACHE: Final = 4096

    def __init__(self, store: StoreAPI, component: str = COMPONENT) -> None:
        self.store = store
        self.component = component
        self._res = store.resource("events")
        self._observed: OrderedDict[tuple[str, ...], str] = OrderedDict()
        self._similar: OrderedDict[tuple[str, ...], tuple[float, set[str]]] = OrderedDict()
        self._log = get_logger(component="simcluster-events")

    def _remember(self, cache: OrderedDict[tuple[str, ...], Any], key: tuple[str, ...], value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.CACHE:
            cache.popitem(last=False)

    async def record(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        m = meta(obj)
        ns, name, uid = str(m.get("namespace") or "default"), str(m.get("name") or ""), str(m.get("uid") or "")
        aggregate = (ns, uid, self.component, type_, reason)
        clock = time.monotonic()
        last, messages = self._similar.get(aggregate, (clock, set()))
        if clock - last > self.WINDOW:
            messages = set()
        messages.add(message)
        key: tuple[str, ...] = (*aggregate, message)
        if len(messages) >= self.MAX_SIMILAR:
            messages.pop()
            message = f"(combined from similar events): {message}"
            key = aggregate
        self._remember(self._similar, aggregate, (clock, messages))
        now = now_rfc3339()
        existing = self._observed.get(key)
        if existing is not None:

            def bump(ev: Obj) -> Obj:
                ev["count"] = int(ev.get("count") or 1) + 1
                ev["lastTimestamp"] = now
                ev["message"] = message
                return ev

            try:
                await self.store.mutate(self._res, ns, existing, bump)
                return
            except ApiError as e:
                if e.code != 404:
                    raise
        ev_name = f"{name}.{time.time_ns():x}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": ev_name, "namespace": ns},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": name,
                "namespace": ns,
                "uid": uid,
                "resourceVersion": m.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": "",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.store.create(self._res, event, namespace=ns)
        except ApiError as e:  # the namespace may be going away; an event is never worth failing a sync for
            self._log.info("event not recorded", namespace=ns, reason=reason, error=e.message)
            return
        self._remember(self._observed, key, ev_name)


# ---- step timers -----------------------------------------------------------------------------------------------


class Steps:
    """Per-object step deadlines: "has the delay of this step elapsed since the step began?"."""

    def __init__(self, queue: WorkQueue) -> None:
        self.queue = queue
        self._due: dict[str, dict[str, float]] = {}
        """uid → step → when it is due."""
        self._scheduled: set[tuple[str, str, float]] = set()

    def elapsed(self, uid: str, step: str, delay: float, key: Key, *, progress: bool = True) -> bool:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = self._due.setdefault(uid, {}).setdefault(step, now + delay)
        if now >= due:
            return True
        if (uid, step, due) not in self._scheduled:
            self._scheduled.add((uid, step, due))
            self.queue.add_after(key, due - now, progress=progress)
        return False

    def clear(self, uid: str, step: str | None = None) -> None:
        steps = self._due.get(uid)
        if not steps:
            return
        for name in [step] if step is not None else list(steps):
            due = steps.pop(name, None)
            if due is not None:
                self._scheduled.discard((uid, name, due))
        if not steps:
            del self._due[uid]


# ---- the simulator ---------------------------------------------------------------------------------------------


class KubeVirtSimulator:
    """virt-controller, virt-handler, scheduler and kubelet behaviour on a store (see the module docstring)."""

    def __init__(
        self,
        store: StoreAPI,
        cache: Cache,
        timing: KubeVirtTiming | None = None,
        config: KubeVirtSimConfig | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.timing = timing or KubeVirtTiming()
        self.config = config or KubeVirtSimConfig()
        self.schedulable: set[str] = set(self.config.nodes)
        self.events = EventRecorder(store)
        self._log = get_logger(component="simcluster-kubevirt")
        self.r_pods = store.resource("pods")
        self.r_vms = store.resource("virtualmachines")
        self.r_vmis = store.resource("virtualmachineinstances")
        self.r_vmims = store.resource("virtualmachineinstancemigrations")
        backoff = self.timing.backoff()
        self.vm_queue: WorkQueue[Key] = WorkQueue("vm", self._sync_vm, backoff=backoff)
        self.vmi_queue: WorkQueue[Key] = WorkQueue("vmi", self._sync_vmi, backoff=backoff)
        self.migration_queue: WorkQueue[Key] = WorkQueue("migration", self._sync_migration, backoff=backoff)
        self.pod_queue: WorkQueue[Key] = WorkQueue("kubelet", self._sync_pod, backoff=backoff)
        self._vmi_steps = Steps(self.vmi_queue)
        self._vmim_steps = Steps(self.migration_queue)
        self._pod_steps = Steps(self.pod_queue)
        self._retry_at: dict[tuple[str, Key], float] = {}
        self._vmim_by_uid: dict[str, Key] = {}
        self._targets: dict[str, str] = {}
        """Migration uid → uid of the target pod created for it."""
        self._target_sizes: dict[str, tuple[Obj, list[str]]] = {}
        """Migration uid → the VMI's ``spec.domain.cpu`` and interface names its target pod was rendered from (what
        the VM runs with once it moves there, but a hotplug virt-handler carries out at its end)."""
        self._started_once: set[str] = set()
        self.render_from: dict[Key, Obj] = {}
        """A fault for tests: VMI (namespace, name) → an older copy of it, which the next target pod of the VMI is
        rendered from, as virt-controller renders from its informer's cache, which may not have a patch made the
        moment before (the VM controller's CPU hotplug). Nothing in KubeVirt compares a target with its VMI."""
        self.domain_vcpus: dict[str, int] = {}
        """Launcher pod uid → the vCPUs virt-launcher started its domain with (the VMI's spec then, not the status):
        the ground truth of what a guest runs, for tests."""
        self._source_done: set[str] = set()
        self._kv_config: tuple[str, KubeVirtConfig] | None = None
        self._rendered: OrderedDict[tuple[str, str, str], tuple[KubeVirtConfig, NamespaceFacts, Obj]] = OrderedDict()
        self.pods_refused = 0
        self.target_refusals: Counter[str] = Counter()
        """Migration target pods refused, by what made KubeVirt try: ``first try``, ``backoff retry`` (its rate
        limiter's wait ended), ``quota update`` (a quota of the namespace changed) or ``object update`` (the
        migration, its VMI or a pod of it changed: KubeVirt's own condition write after a refusal, say)."""
        self._woken: dict[Key, str] = {}
        """Migrations re-queued out of their backoff (by a quota update, or an update of the migration, its VMI or
        a pod of it), until their next try: what woke them."""
        self._buckets = {"vmi": self.timing.bucket(), "vmim": self.timing.bucket()}
        cache.subscribe("virtualmachines", self._on_vm)
        cache.subscribe("virtualmachineinstances", self._on_vmi)
        cache.subscribe("virtualmachineinstancemigrations", self._on_vmim)
        cache.subscribe("pods", self._on_pod)
        cache.subscribe("resourcequotas", self._on_quota)
        cache.add_index("pods", "vmi", lambda p: _label_values(p, CREATED_BY_LABEL))  # (the scheduler's)
        cache.add_index("pods", "controller", lambda p: _controller_uid(p) if kubevirt_sees(p) else ())
        cache.add_index(
            "pods", "migration", lambda p: _label_values(p, MIGRATION_JOB_LABEL) if kubevirt_sees(p) else ()
        )
        cache.add_index("pods", "node", _pod_node)
        cache.add_index("virtualmachineinstancemigrations", "vmi", _vmim_vmi)
        cache.add_index("virtualmachineinstancemigrations", "phase", lambda m: (phase(m),))

    @property
    def queues(self) -> tuple[WorkQueue, ...]:
        return (self.vm_queue, self.vmi_queue, self.migration_queue, self.pod_queue)

    def install(self) -> None:
        """Admission as KubeVirt's webhooks do it: a new VMI's defaults, then validation."""
        self.store.keep_status_on_create(self.r_vmis)  # (KubeVirt's VMI has no status subresource)
        self.store.add_admission(self.r_vmis, self._default_vmi, mutating=True)
        self.store.add_admission(self.r_vms, self._admit_vm)
        self.store.add_admission(self.r_vmis, self._admit_vmi)
        self.store.add_admission(self.r_vmims, self._default_vmim, mutating=True)
        self.store.add_admission(self.r_vmims, self._admit_vmim)

    async def start(self) -> None:
        with acting_as(KUBEVIRT_CONTROLLER):  # its workers (and what they start) write as virt-controller
            for q in self.queues:
                q.start()
        for vm in self.cache.list("virtualmachines"):
            self.vm_queue.add(key_of(vm))
        for vmi in self.cache.list("virtualmachineinstances"):
            self.vmi_queue.add(key_of(vmi))
        for vmim in self.cache.list("virtualmachineinstancemigrations"):
            self.migration_queue.add(key_of(vmim))
        for pod in self.cache.list("pods"):
            self.pod_queue.add(key_of(pod))

    async def stop(self) -> None:
        for q in self.queues:
            await q.stop()

    def idle(self) -> bool:
        return all(q.idle() for q in self.queues)

    # ---- configuration --------------------------------------------------------------------------------------
    def kubevirt_config(self) -> KubeVirtConfig:
        """From the KubeVirt CR (the first one), re-read when it changes; defaults when there is none."""
        crs = self.cache.list("kubevirts")
        if not crs:
            return KubeVirtConfig()
        cr = crs[0]
        rv = str(meta(cr).get("resourceVersion") or "")
        if self._kv_config is not None and self._kv_config[0] == rv:
            return self._kv_config[1]
        try:
            config = KubeVirtConfig.from_cr(cr)
        except InvalidInput as e:
            self._log.warning("KubeVirt CR is invalid, using defaults", error=str(e))
            config = KubeVirtConfig()
        self._kv_config = (rv, config)
        return config

    def namespace_facts(self, namespace: str) -> NamespaceFacts:
        ns = self.cache.get("namespaces", "", namespace)
        ns_labels = dict(labels_of(ns)) if ns is not None else {}
        hard = [
            r for q in self.cache.list("resourcequotas", namespace) for r in (q.get("spec") or {}).get("hard") or {}
        ]
        return NamespaceFacts(labels=ns_labels).with_quota_resources(hard)

    def image(self, config: KubeVirtConfig) -> str:
        return f"{self.config.launcher_image}:{config.version}"

    def render(self, vmi: Mapping[str, Any], migration: Mapping[str, Any] | None = None) -> Obj:
        """The launcher (or migration target) pod for a VMI as this cluster's KubeVirt creates it. The overhead is
        computed from the spec (never the published figure), like virt-controller does.

        A refused target pod is rendered again on every retry from the same inputs: the last renderings are kept by
        (VMI uid and resourceVersion, migration uid) with the configuration and namespace facts they were made
        from, and a copy is handed out."""
        config = self.kubevirt_config()
        m = meta(vmi)
        ns = str(m.get("namespace") or "")
        facts = self.namespace_facts(ns)
        key = (uid_of(vmi), str(m.get("resourceVersion") or ""), uid_of(migration) if migration is not None else "")
        hit = self._rendered.get(key) if key[0] and key[1] else None
        if hit is not None and hit[0] == config and hit[1] == facts:
            return cast(Obj, copy_json(hit[2]))
        bare = {k: v for k, v in vmi.items() if k != "status"}
        pod = launcher_pod(
            vmi,
            render_launcher_pod(bare, config, facts),
            image=self.image(config),
            extra_overhead=self.config.extra_memory_overhead,
            migration=migration,
        )
        if key[0] and key[1]:
            self._rendered[key] = (config, facts, copy_json(pod))
            self._rendered.move_to_end(key)
            if len(self._rendered) > _RENDERED_MAX:
                self._rendered.popitem(last=False)
        return pod

    # ---- informer handlers ----------------------------------------------------------------------------------
    def _on_vm(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        self.vm_queue.add(key_of(obj))

    def _on_vmi(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        key = key_of(obj)
        if old is not None and annotations_of(old) != annotations_of(obj):
            # KubeVirt re-queues a VMI on every update (Queue.Add, not rate limited): a change of its annotations (a
            # nudge, e.g. vmquota's once it made room) makes a refused pod creation retry at once
            self._retry_at.pop(("vmi", key), None)
        self.vmi_queue.add(key)
        self.vm_queue.add(key)
        for vmim in self.migrations_of(*key):
            if phase(vmim) not in FINAL_PHASES:
                self._wake_migration(key_of(vmim), "object update")
        if type_ == "DELETED":
            uid = uid_of(obj)
            self._vmi_steps.clear(uid)
            self._retry_at.pop(("vmi", key), None)

    def _on_vmim(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        key = key_of(obj)
        uid = uid_of(obj)
        if type_ == "DELETED":
            self._vmim_by_uid.pop(uid, None)
            self._targets.pop(uid, None)
            self._target_sizes.pop(uid, None)
            self._vmim_steps.clear(uid)
            self._retry_at.pop(("vmim", key), None)
            self._woken.pop(key, None)
            self.migration_queue.add(key)
        else:
            self._vmim_by_uid[uid] = key
            self._wake_migration(key, "object update")
        vmi_name = str((obj.get("spec") or {}).get("vmiName") or "")
        if vmi_name:
            self.vm_queue.add((key[0], vmi_name))
        if phase(obj) in FINAL_PHASES and (old is None or phase(old) not in FINAL_PHASES):
            # a slot is free: migrations held back by the parallel limits may go
            for waiting in ("", "Pending"):
                for other in self.cache.by_index("virtualmachineinstancemigrations", "phase", waiting):
                    self.migration_queue.add(key_of(other))

    def _on_pod(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        key = key_of(obj)
        if type_ != "DELETED":
            self.pod_queue.add(key)
        else:
            self._pod_steps.clear(uid_of(obj))
        if not kubevirt_sees(obj) and (old is None or not kubevirt_sees(old)):
            return  # (the kubelet's and the scheduler's, not in virt-controller's pod informer)
        lab = labels_of(obj)
        if lab.get(APP_LABEL) == LAUNCHER and lab.get(VM_NAME_LABEL):
            self.vmi_queue.add((key[0], lab[VM_NAME_LABEL]))
        for ref in meta(obj).get("ownerReferences") or []:  # (KubeVirt resolves the controller reference)
            if isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("kind") == VMI_KIND_NAME:
                self.vmi_queue.add((key[0], str(ref.get("name") or "")))
        job = lab.get(MIGRATION_JOB_LABEL)
        if job and job in self._vmim_by_uid:
            self._wake_migration(self._vmim_by_uid[job], "object update")
        owner = self._controller_pod(obj)
        if owner is not None:  # (an attachment pod: its migration target's migration is woken)
            job = labels_of(owner).get(MIGRATION_JOB_LABEL)
            if job and job in self._vmim_by_uid:
                self._wake_migration(self._vmim_by_uid[job], "object update")

    def _controller_pod(self, pod: Mapping[str, Any]) -> Obj | None:
        """The pod a pod's controller reference names (``metav1.IsControlledBy``: kind Pod, by uid), if it exists."""
        for ref in meta(pod).get("ownerReferences") or []:
            if isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("kind") == "Pod":
                owner = self.cache.get("pods", key_of(pod)[0], str(ref.get("name") or ""))
                seen = owner is not None and kubevirt_sees(owner) and uid_of(owner) == ref.get("uid")
                return owner if seen else None
        return None

    def _wake_migration(self, key: Key, why: str) -> None:
        """KubeVirt's migration controller re-queues a migration at once (``Queue.Add``, not rate limited) on an
        update of it, of its VMI or of a pod of it, and of a quota of its namespace: a retry waiting out its backoff
        runs now."""
        if self._retry_at.pop(("vmim", key), None) is not None:
            self._woken[key] = why
        self.migration_queue.add(key)

    def _on_quota(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        """KubeVirt's migration controller re-queues at once, when a quota of their namespace is updated or deleted
        (not created), the migrations whose status carries ``migrationRejectedByResourceQuota`` (set on an error
        that says ``exceeded quota``; ``updateResourceQuota`` at v1.9.0): a target refused for any other reason
        waits out its backoff, whatever the quotas do. The VMI controller does not watch quotas: a VMI whose pod was
        refused waits for its backoff to expire."""
        if type_ == "ADDED":
            return
        ns = key_of(obj)[0]
        for vmim in self.cache.list("virtualmachineinstancemigrations", ns):
            if has_condition(vmim, REJECTED_BY_QUOTA):
                self._wake_migration(key_of(vmim), "quota update")

    # ---- admission (KubeVirt's validating webhooks) ---------------------------------------------------------
    async def _admit_vm(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        if op == "DELETE" or new is None:
            return None
        try:
            run_strategy(new)
            vmi_spec(new)
        except InvalidInput as e:
            raise ApiError(
                422,
                "Invalid",
                f'admission webhook "virtualmachine-validator.kubevirt.io" denied the request: {e}',
            ) from None
        return None

    async def _default_vmi(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        """virt-api's VMI mutating webhook at creation (``vmi-mutator.go``): the defaults admission policies see
        (:func:`shared.kubevirt.vm.with_admission_defaults`), and the status it is created with but for what the
        webhook writes: the phase (``Pending``), the memory status from the guest memory, and the current CPU
        topology from the spec's when the create has none (``pkg/defaults``). The rest of a tenant's status stays
        until KubeVirt's controllers rewrite what they own."""
        if op != "CREATE" or new is None or subresource is not None:
            return None
        try:
            out = with_admission_defaults(new, self.kubevirt_config())
        except InvalidInput:
            return None  # (the validating webhook refuses it)
        given = out.get("status")
        st: Obj = dict(given) if isinstance(given, Mapping) else {}
        st.pop("phase", None)
        st.pop("phaseTransitionTimestamps", None)
        domain = (out.get("spec") or {}).get("domain") or {}
        guest = (domain.get("memory") or {}).get("guest")
        if guest is not None:
            st["memory"] = guest_memory_status(guest)
        cpu = domain.get("cpu")
        if isinstance(cpu, Mapping) and st.get("currentCPUTopology") is None:
            st["currentCPUTopology"] = cpu_topology(cpu)
        set_phase(st, "Pending")
        out["status"] = st
        metadata = out.setdefault("metadata", {})
        if VMI_FINALIZER not in (metadata.get("finalizers") or []):
            metadata["finalizers"] = [*(metadata.get("finalizers") or []), VMI_FINALIZER]
        return out

    async def _admit_vmi(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        if op == "UPDATE" and subresource is None and new is not None and old is not None:
            # virt-api's VMI update admitter: only KubeVirt's own accounts change a VMI's spec (a VM's changes
            # reach it through virt-controller). Applied here to tenants' requests; in-process callers and the
            # administrator stay free to set up what a test needs.
            if current_user().tenant_of is not None and new.get("spec") != old.get("spec"):
                raise ApiError(
                    422,
                    "Invalid",
                    'admission webhook "virtualmachineinstances-update-validator.kubevirt.io" denied the request: '
                    "update of VMI object is restricted",
                )
            return None
        if op != "CREATE" or new is None:
            return None
        try:
            vmi_spec(new)
        except InvalidInput as e:
            raise ApiError(
                422,
                "Invalid",
                f'admission webhook "virtualmachineinstances-create-validator.kubevirt.io" denied the request: {e}',
            ) from None
        return None

    async def _admit_vmim(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        """virt-api's migration validators: a new migration is refused for a VMI that cannot migrate; an update (by
        anyone) may not change the spec, nor the ``kubevirt.io/vmi-name`` label while the migration is not final
        (``migration-update-admitter``, v1.9.0)."""
        if op == "UPDATE" and new is not None and old is not None and subresource is None:
            self._admit_vmim_update(new, old)
            return None
        if op != "CREATE" or new is None:
            return None
        prefix = 'admission webhook "migration-create-validator.kubevirt.io" denied the request'
        ns = str(meta(new).get("namespace") or "")
        vmi_name = (new.get("spec") or {}).get("vmiName")
        if not isinstance(vmi_name, str) or not vmi_name:
            raise ApiError(422, "Invalid", f"{prefix}: spec.vmiName: Required value")
        # (these refusals are virt-api's ToAdmissionResponseError: 400; a spec's causes are 422)
        vmi = self.cache.get("virtualmachineinstances", ns, vmi_name)
        if vmi is None:
            raise ApiError(400, "BadRequest", f'{prefix}: the VMI "{ns}/{vmi_name}" does not exist')
        if phase(vmi) in FINAL_PHASES:  # (one that does not run yet is admitted: its migration waits for it)
            raise ApiError(400, "BadRequest", f"{prefix}: Cannot migrate VMI in finalized state.")
        for c in status(vmi).get("conditions") or ():
            if isinstance(c, Mapping) and c.get("type") == "LiveMigratable" and c.get("status") == "False":
                why = f"Reason: {c.get('reason', '')}, Message: {c.get('message', '')}"
                raise ApiError(400, "BadRequest", f"{prefix}: Cannot migrate VMI, {why}")
        for other in self.migrations_of(ns, vmi_name):
            if phase(other) not in FINAL_PHASES:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"{prefix}: in-flight migration detected. Active migration job ({uid_of(other)}) is currently "
                    f"already in progress for VMI {vmi_name}.",
                )
        return None

    async def _default_vmim(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        """virt-api's ``migration-create-mutator``: a new migration gets the ``kubevirt.io/vmi-name`` label and
        KubeVirt's finalizer, before any validating admission (policies, the create validator) sees it."""
        if op != "CREATE" or new is None or subresource is not None:
            return None
        metadata = new.setdefault("metadata", {})
        metadata.setdefault("labels", {})[VMI_NAME_LABEL] = str((new.get("spec") or {}).get("vmiName") or "")
        metadata["finalizers"] = [*(metadata.get("finalizers") or []), MIGRATION_FINALIZER]
        return new

    @staticmethod
    def _admit_vmim_update(new: Obj, old: Obj) -> None:
        prefix = 'admission webhook "migration-update-validator.kubevirt.io" denied the request'
        if (new.get("spec") or {}) != (old.get("spec") or {}):
            raise ApiError(422, "Invalid", f"{prefix}: update of Migration object's spec is restricted")
        old_labels = meta(old).get("labels") or {}
        if phase(old) not in FINAL_PHASES and VMI_NAME_LABEL in old_labels:
            label = (meta(new).get("labels") or {}).get(VMI_NAME_LABEL)
            if label is None:
                raise ApiError(422, "Invalid", f"{prefix}: selector label can't be removed from an in-flight migration")
            if label != old_labels[VMI_NAME_LABEL]:
                raise ApiError(422, "Invalid", f"{prefix}: selector label can't be modified on an in-flight migration")

    # ---- writes ----------------------------------------------------------------------------------------------
    async def _update_status(self, res: Resource, key: Key, change: Callable[[Obj], None]) -> Obj | None:
        """Apply ``change`` to the object's status (under the store lock); write only when something changed."""

        def fn(obj: Obj) -> Obj | None:
            before = copy_json(obj.get("status"))
            st = obj.get("status")
            if not isinstance(st, dict):
                obj["status"] = {}
            change(obj)
            return obj if obj.get("status") != before else None

        try:
            return await self.store.mutate(res, key[0], key[1], fn, status=True)
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    async def _update(self, res: Resource, key: Key, change: Callable[[Obj], None]) -> Obj | None:
        def fn(obj: Obj) -> Obj | None:
            before = copy_json(obj)
            change(obj)
            return obj if obj != before else None

        try:
            return await self.store.mutate(res, key[0], key[1], fn)
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    async def _delete(self, res: Resource, key: Key) -> None:
        try:
            await self.store.delete(res, key[0], key[1])
        except ApiError as e:
            if e.code != 404:
                raise

    def _blocked(self, kind: str, key: Key, queue: WorkQueue) -> bool:
        """Inside a backoff window (unless a quota change released it): re-queue for its end and say so."""
        until = self._retry_at.get((kind, key))
        if until is None:
            return False
        remaining = until - asyncio.get_running_loop().time()
        if remaining <= 0:
            return False
        queue.add_after(key, remaining, progress=False)
        return True

    def _backoff(self, kind: str, key: Key, queue: WorkQueue) -> None:
        """A failed try: retried after the longer of its per-item backoff and the controller's overall bucket
        (client-go's ``DefaultControllerRateLimiter``: both are taken on every rate-limited retry)."""
        now = asyncio.get_running_loop().time()
        delay = queue.add_rate_limited(key, retry_after=self._buckets[kind].take(now))
        self._retry_at[(kind, key)] = now + delay

    def waits_out_backoff(self, kind: str, key: Key) -> bool:
        """Whether the last try of a VMI (``vmi``) or migration (``vmim``) failed and its retry waits for its
        backoff, nothing having re-queued it since."""
        until = self._retry_at.get((kind, key))
        return until is not None and until > asyncio.get_running_loop().time()

    def _succeeded(self, kind: str, key: Key, queue: WorkQueue) -> None:
        queue.forget(key)
        self._retry_at.pop((kind, key), None)

    # ---- pods of a VMI ---------------------------------------------------------------------------------------
    def pods_of(self, vmi: Mapping[str, Any]) -> list[Obj]:
        """The pods the VMI controls (controller owner reference), as KubeVirt's ``IsControlledBy`` finds them
        among the pods its informer sees (:func:`kubevirt_sees`); no other label plays a part."""
        pods = self.cache.by_index("pods", "controller", f"{key_of(vmi)[0]}/{uid_of(vmi)}")
        return sorted(
            pods, key=lambda p: (str(meta(p).get("creationTimestamp") or ""), int(meta(p).get("resourceVersion") or 0))
        )

    def active_pods(self, vmi: Mapping[str, Any]) -> list[Obj]:
        return [p for p in self.pods_of(vmi) if phase(p) not in FINAL_PHASES and not deleting(p)]

    def active_pods_count(self, vmi: Mapping[str, Any]) -> int:
        """The VMI's active pods as KubeVirt's migration controller counts them (``VMIActivePodsCount``): every pod
        it controls that is not Succeeded or Failed, a pod being deleted too."""
        return sum(1 for p in self.pods_of(vmi) if phase(p) not in FINAL_PHASES)

    def launcher_of(self, vmi: Mapping[str, Any]) -> Obj | None:
        """The pod the VMI runs in: the newest active pod on ``status.nodeName``; before it runs, the newest active
        pod that is not a migration target."""
        active = self.active_pods(vmi)
        node = status(vmi).get("nodeName")
        if node:
            on_node = [p for p in active if (p.get("spec") or {}).get("nodeName") == node]
            return on_node[-1] if on_node else None
        plain = [p for p in active if MIGRATION_JOB_LABEL not in labels_of(p)]
        return plain[-1] if plain else None

    # ---- VM controller ---------------------------------------------------------------------------------------
    async def _sync_vm(self, key: Key) -> None:
        vm = self.cache.get("virtualmachines", *key)
        if vm is None:
            return
        vmi = self.cache.get("virtualmachineinstances", *key)
        if vmi is not None and not owned_by(vmi, uid_of(vm)):
            vmi = None  # a VMI of the same name that this VM does not own: leave it alone
        try:
            strategy = run_strategy(vm)
        except InvalidInput as e:
            self._log.warning("VM has an invalid run strategy", namespace=key[0], vm=key[1], error=str(e))
            return
        uid = uid_of(vm)
        if deleting(vm):
            if vmi is not None and not deleting(vmi):
                await self._delete(self.r_vmis, key)
        elif vmi is None:
            start = strategy in STARTING_STRATEGIES and (strategy != "Once" or uid not in self._started_once)
            if start:
                await self._start_vm(vm)
        elif not deleting(vmi):
            p = phase(vmi)
            stop = strategy == "Halted"
            restart = (strategy == "Always" and p in FINAL_PHASES) or (strategy == "RerunOnFailure" and p == "Failed")
            if stop or restart:
                await self._delete(self.r_vmis, key)
            elif p == "Running":
                await self._hotplug(vm, vmi)
            elif p in VMI_NOT_STARTED:
                await self._hotplug(vm, vmi, running=False)
        await self._vm_status(vm, key, strategy)

    async def _start_vm(self, vm: Obj) -> None:
        key = key_of(vm)
        try:
            vmi = vmi_from_vm(vm, self.kubevirt_config())
        except InvalidInput as e:
            await self.events.record(vm, "Warning", "FailedCreate", f"Error creating VirtualMachineInstance: {e}")
            return
        try:
            await self.store.create(self.r_vmis, vmi, namespace=key[0])
        except ApiError as e:
            if e.code == 409:
                return
            await self.events.record(
                vm, "Warning", "FailedCreate", f"Error creating VirtualMachineInstance: {e.message}"
            )
            self.vm_queue.add_rate_limited(key)
            return
        self._started_once.add(uid_of(vm))
        self.vm_queue.forget(key)
        await self.events.record(
            vm,
            "Normal",
            "SuccessfulCreate",
            f"Started the virtual machine by creating the new virtual machine instance {key[1]}",
        )

    async def _vm_status(self, vm: Obj, key: Key, strategy: str) -> None:
        vmi = self.cache.get("virtualmachineinstances", *key)
        if vmi is not None and not owned_by(vmi, uid_of(vm)):
            vmi = None
        migrating = any(phase(m) == "Running" for m in self.migrations_of(*key))
        if vmi is None:
            printable = "Stopped"
        elif deleting(vmi):
            printable = "Stopping"
        elif phase(vmi) == "Running":
            printable = "Migrating" if migrating else "Running"
        elif phase(vmi) == "Succeeded":
            printable = "Stopped"
        elif phase(vmi) == "Failed":
            printable = "CrashLoopBackOff" if strategy in ("Always", "RerunOnFailure") else "Stopped"
        else:
            printable = "Starting"
        ready = vmi is not None and phase(vmi) == "Running" and has_condition(vmi, "Ready", "True")

        def change(obj: Obj) -> None:
            st = obj["status"]
            st["printableStatus"] = printable
            st["created"] = vmi is not None
            st["ready"] = ready
            st["runStrategy"] = strategy
            conds = st.setdefault("conditions", [])
            set_condition(conds, "Ready", "True" if ready else "False")

        await self._update_status(self.r_vms, key, change)

    async def _hotplug(self, vm: Obj, vmi: Obj, *, running: bool = True) -> None:
        """Raised sockets or guest memory on a running VM: patch the VMI, then a workload-update migration.

        As upstream's live-update handlers: refused while the VMI is migrating (``IsMigrating``: a migration has
        started and not ended) or another hotplug is in progress (a ``HotVCPUChange``/``HotMemoryChange``
        condition), applied otherwise, also while a migration is pending (its target, rendered from the VMI at
        KubeVirt's next try, then carries the new size). The workload-update migration waits until no migration
        of the VMI is in flight (upstream's workload updater).

        Not ``running`` (the VMI not started yet): raised sockets are patched into its spec all the same
        (``handleCPUChangeRequest`` looks at no phase; memory needs a migratable VMI), and virt-launcher starts
        the domain from that spec; the VMI controller marks ``HotVCPUChange`` once it runs, its status still
        reporting the size it was created with (:meth:`_sync_cpu_change`)."""
        key = key_of(vmi)
        in_flight = any(phase(m) not in FINAL_PHASES for m in self.migrations_of(*key))
        if running:
            vmi = await self._hotplug_interfaces(vm, vmi)
        if any(has_condition(vmi, c, "True") for c in ("HotVCPUChange", "HotMemoryChange", MIGRATION_REQUIRED)):
            if not in_flight and running:
                await self._workload_update(vm, key)
            return
        ms = status(vmi).get("migrationState")
        if isinstance(ms, Mapping) and ms.get("startTimestamp") and not (ms.get("completed") or ms.get("failed")):
            return  # "memory hotplug is not allowed while VMI is migrating"; the VM is re-synced when it ends
        tdomain = ((((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("domain")) or {}
        domain = (vmi.get("spec") or {}).get("domain") or {}
        tcpu, cpu = tdomain.get("cpu") or {}, domain.get("cpu") or {}
        want_sockets, sockets = _int(tcpu.get("sockets")), _int(cpu.get("sockets"))
        max_sockets = _int(cpu.get("maxSockets"))
        cpu_delta = 0
        if want_sockets > sockets and max_sockets and want_sockets <= max_sockets:  # (else a restart is required)
            cores, threads = max(1, _int(cpu.get("cores"))), max(1, _int(cpu.get("threads")))
            cpu_delta = (want_sockets - sockets) * cores * threads
        mem_delta: Quantity | None = None
        tguest, guest, max_guest = (
            (tdomain.get("memory") or {}).get("guest"),
            (domain.get("memory") or {}).get("guest"),
            (domain.get("memory") or {}).get("maxGuest"),
        )
        try:
            if tguest is not None and guest is not None and running:
                want, have = Quantity.parse(tguest), Quantity.parse(guest)
                if want > have and (max_guest is None or want <= Quantity.parse(max_guest)):
                    mem_delta = want - have
        except InvalidInput:
            mem_delta = None
        if not cpu_delta and mem_delta is None:
            return
        ratio = self.kubevirt_config().cpu_allocation_ratio
        cpu_step = Quantity.from_milli(cpu_delta * int(Fraction(1000) // ratio)) if cpu_delta else None
        tres = tdomain.get("resources") or {}
        current = (status(vmi).get("memory") or {}).get("guestCurrent") or guest

        def has(rl: object, name: str) -> bool:  # (a non-zero amount of name)
            try:
                return isinstance(rl, Mapping) and rl.get(name) is not None and Quantity.parse(rl[name]).nanos != 0
            except InvalidInput:
                return False

        def patch(obj: Obj) -> None:
            # upstream's VMICPUsPatch and memory hotplug: the VMI's CPU request and limit grow by the added vCPUs'
            # share (1000 / ratio millicores each) only where the VM's template has them (a request the mutating
            # webhook copied from the limit does not grow); the memory request, where the VMI has one, by the new
            # size less guestCurrent, at least to the new size; the memory limit where the template has one
            d = obj.setdefault("spec", {}).setdefault("domain", {})
            res = d.setdefault("resources", {})
            if cpu_delta and cpu_step is not None:
                d.setdefault("cpu", {})["sockets"] = want_sockets
                for part in ("requests", "limits"):
                    if has(tres.get(part), "cpu"):
                        rl = res.setdefault(part, {})
                        rl["cpu"] = (Quantity.parse(rl.get("cpu") or 0) + cpu_step).canonical()
            if mem_delta is not None and tguest is not None:
                new_guest = Quantity.parse(tguest)
                d.setdefault("memory", {})["guest"] = new_guest.canonical()
                delta = new_guest - Quantity.parse(current)
                if has(res.get("requests"), "memory"):
                    req = Quantity.parse(res["requests"]["memory"]) + delta
                    if req < new_guest:
                        req, delta = new_guest, ZERO  # (upstream: the limit then grows by nothing)
                    res["requests"]["memory"] = req.canonical()
                if has(tres.get("limits"), "memory"):
                    rl = res.setdefault("limits", {})
                    rl["memory"] = (Quantity.parse(rl.get("memory") or 0) + delta).canonical()
            if not res:
                del d["resources"]

        updated = await self._update(self.r_vmis, key, patch)
        if updated is None or not running:
            return

        def conditions(obj: Obj) -> None:
            st = obj["status"]
            conds = st.setdefault("conditions", [])
            if cpu_delta:
                set_condition(conds, "HotVCPUChange", "True", probe=True)
            if mem_delta is not None:
                # (``guestRequested`` stays: virt-handler writes it once the target's domain has the memory, and
                # the VMI controller reads a spec other than it as a hotplug to carry out)
                set_condition(conds, "HotMemoryChange", "True", probe=True)

        await self._update_status(self.r_vmis, key, conditions)
        if not in_flight:
            await self._workload_update(vm, key)

    async def _hotplug_interfaces(self, vm: Obj, vmi: Obj) -> Obj:
        """Interfaces added to a running VM's template (bridge or SR-IOV, not ``state: absent``) are appended to the
        VMI's spec at once, with their networks (upstream's network synchronizer, on every VM sync); then
        :meth:`_plug_interfaces`. The VMI as it is now."""
        tspec = ((vm.get("spec") or {}).get("template") or {}).get("spec") or {}
        have = set(interface_names(vmi, absent=True))
        tnets = {n.get("name"): n for n in tspec.get("networks") or [] if isinstance(n, Mapping)}
        tdevices = (tspec.get("domain") or {}).get("devices") or {}
        tifaces = {i.get("name"): i for i in tdevices.get("interfaces") or [] if isinstance(i, Mapping)}
        added = [
            i
            for name, i in tifaces.items()
            if name not in have and i.get("state") != "absent" and ("bridge" in i or "sriov" in i) and name in tnets
        ]
        if added:

            def patch(obj: Obj) -> None:
                spec = obj.setdefault("spec", {})
                devices = spec.setdefault("domain", {}).setdefault("devices", {})
                if not devices.get("interfaces"):  # (the default interface KubeVirt's defaults gave it, explicit)
                    devices["interfaces"] = [copy_json(tifaces[n]) for n in sorted(have) if n in tifaces]
                    spec["networks"] = [copy_json(tnets[n]) for n in sorted(have) if n in tnets]
                devices["interfaces"].extend(copy_json(i) for i in added)
                spec.setdefault("networks", []).extend(copy_json(tnets[i["name"]]) for i in added)

            vmi = await self._update(self.r_vmis, key_of(vmi), patch) or vmi
        return await self._plug_interfaces(vmi)

    async def _plug_interfaces(self, vmi: Obj) -> Obj:
        """A running VMI's interfaces its ``status.interfaces`` does not name yet: a bridge one is plugged in place
        (the dynamic networks controller; the status names it), an SR-IOV one only through a migration
        (``MigrationRequired``, reason ``AutoMigrationDueToLiveUpdate``, has the workload updater start one; the
        status names it once a migration whose target has it completes). The VMI as it is now."""
        missing = [n for n in interface_names(vmi) if n not in listed_interfaces(vmi)]
        sriov_names = sriov_interfaces(vmi)
        bridged = [n for n in missing if n not in sriov_names]
        sriov = any(n in sriov_names for n in missing)
        if not bridged and (not sriov or has_condition(vmi, MIGRATION_REQUIRED, "True")):
            return vmi

        def plug(obj: Obj) -> None:
            st = obj["status"]
            st.setdefault("interfaces", []).extend({"name": n, "infoSource": "domain, multus-status"} for n in bridged)
            if sriov:
                set_condition(
                    st.setdefault("conditions", []), MIGRATION_REQUIRED, "True", reason="AutoMigrationDueToLiveUpdate"
                )

        return await self._update_status(self.r_vmis, key_of(vmi), plug) or vmi

    async def _workload_update(self, vm: Obj, key: Key) -> None:
        """The workload updater: a migration that moves a hotplugged VMI to a pod of its new size."""
        migration = {
            "apiVersion": API_VERSION,
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {
                "generateName": WORKLOAD_UPDATE_PREFIX,
                "namespace": key[0],
                "annotations": {WORKLOAD_UPDATE_ANNOTATION: ""},
                "labels": {VMI_NAME_LABEL: key[1]},
            },
            "spec": {"vmiName": key[1]},
        }
        try:
            await self.store.create(self.r_vmims, migration, namespace=key[0])
        except ApiError as e:
            self._log.warning("workload-update migration not created", namespace=key[0], vmi=key[1], error=e.message)
            self.vm_queue.add_rate_limited(key_of(vm))

    # ---- VMI controller --------------------------------------------------------------------------------------
    async def _sync_vmi(self, key: Key) -> None:
        vmi = self.cache.get("virtualmachineinstances", *key)
        if vmi is None:
            return
        if deleting(vmi):
            await self._sync_deleted_vmi(vmi)
            return
        uid = uid_of(vmi)
        p = phase(vmi)
        await self._cleanup_terminal_pods(vmi)
        await self._set_active_pods(vmi)
        if p in FINAL_PHASES:
            return
        pod = self.launcher_of(vmi)
        if pod is None:
            if p in ("Scheduled", "Running"):
                await self.events.record(vmi, "Warning", "Stopped", "The virtual machine pod disappeared")
                await self._update_status(self.r_vmis, key, lambda o: set_phase(o["status"], "Failed"))
                return
            await self._create_launcher(vmi)
            return
        pod_phase = phase(pod)
        if pod_phase == "Pending":
            await self._update_status(self.r_vmis, key, lambda o: set_phase(o["status"], "Scheduling"))
        elif pod_phase == "Running":
            if p in ("", "Pending", "Scheduling"):
                await self._update_status(self.r_vmis, key, lambda o: set_phase(o["status"], "Scheduled"))
            elif p == "Scheduled" and self._vmi_steps.elapsed(uid, "boot", self.timing(self.timing.boot_delay), key):
                await self._vmi_running(vmi, pod)
                self._vmi_steps.clear(uid, "boot")
        elif pod_phase in FINAL_PHASES:
            await self._update_status(self.r_vmis, key, lambda o: set_phase(o["status"], pod_phase))
        if p == "Running":
            await self._sync_cpu_change(vmi)

    async def _sync_deleted_vmi(self, vmi: Obj) -> None:
        """A VMI being deleted (``lifecycle.go``): KubeVirt deletes the pods it controls (``deleteAllMatchingPods``),
        the VMI turns final once none is left (``Succeeded`` once running: virt-handler shut its domain down), and
        KubeVirt's finalizer goes once no pod it controls exists (``allPodsDeleted``), and the VMI with it. A pod
        whose controller reference the garbage collector took off (the VMI deleted with orphan propagation) is
        not the VMI's any more."""
        key = key_of(vmi)
        controlled = self.pods_of(vmi)
        for pod in controlled:
            if not deleting(pod) or phase(pod) in FINAL_PHASES:
                await self._delete(self.r_pods, key_of(pod))
        if phase(vmi) not in FINAL_PHASES:  # (its pods deleted or going: virt-handler shut the domain down)
            done = "Succeeded" if phase(vmi) == "Running" else "Failed"
            await self._update_status(self.r_vmis, key, lambda o: set_phase(o["status"], done))
            return
        if controlled:
            return  # (woken by their deletion)
        if VMI_FINALIZER in (meta(vmi).get("finalizers") or []):
            await self._update(
                self.r_vmis,
                key,
                lambda o: o["metadata"].update(
                    finalizers=[f for f in o["metadata"].get("finalizers") or [] if f != VMI_FINALIZER]
                ),
            )

    async def _sync_cpu_change(self, vmi: Obj) -> None:
        """A running VMI whose spec has more sockets than its ``status.currentCPUTopology`` is marked
        ``HotVCPUChange`` (upstream's ``requireCPUHotplug``/``syncHotplugCondition``): the workload updater then
        migrates it, and the target carries the spec's vCPUs."""
        want = _int((((vmi.get("spec") or {}).get("domain") or {}).get("cpu") or {}).get("sockets"))
        have = _int((status(vmi).get("currentCPUTopology") or {}).get("sockets"))
        if want > have > 0 and not has_condition(vmi, "HotVCPUChange", "True"):
            await self._update_status(
                self.r_vmis,
                key_of(vmi),
                lambda o: set_condition(o["status"].setdefault("conditions", []), "HotVCPUChange", "True", probe=True),
            )

    def active_pods_status(self, vmi: Mapping[str, Any]) -> dict[str, str]:
        """``status.activePods`` as KubeVirt's VMI controller writes it: every pod the VMI controls, uid → node."""
        return {uid_of(p): str((p.get("spec") or {}).get("nodeName") or "") for p in self.pods_of(vmi)}

    async def _set_active_pods(self, vmi: Obj) -> None:
        active = self.active_pods_status(vmi)
        if active == (status(vmi).get("activePods") or {}) or (not active and "activePods" not in status(vmi)):
            return
        await self._update_status(self.r_vmis, key_of(vmi), lambda o: o["status"].update({"activePods": active}))

    async def _create_launcher(self, vmi: Obj) -> None:
        key = key_of(vmi)
        if self._blocked("vmi", key, self.vmi_queue):
            return
        try:
            pod = self.render(vmi)
        except InvalidInput as e:
            await self._failed_create(
                vmi, f"failed to render launch manifest: {e}", f"failed to render launch manifest: {e}"
            )
            return
        try:
            created = await self.store.create(self.r_pods, pod, namespace=key[0])
        except ApiError as e:
            self.pods_refused += 1
            await self._failed_create(
                vmi, f"failed to create virtual machine pod: {e.message}", f"Error creating pod: {e.message}"
            )
            return
        self._succeeded("vmi", key, self.vmi_queue)
        name = meta(created).get("name")
        await self.events.record(vmi, "Normal", "SuccessfulCreate", f"Created virtual machine pod {name}")

        def change(obj: Obj) -> None:
            st = obj["status"]
            remove_condition(st.setdefault("conditions", []), "Synchronized")
            set_phase(st, "Scheduling")

        await self._update_status(self.r_vmis, key, change)

    async def _failed_create(self, vmi: Obj, message: str, event: str) -> None:
        """``Synchronized=False`` / ``FailedCreate`` saying ``message``, and a ``FailedCreate`` Event saying ``event``
        (KubeVirt words them apart for a refused pod: ``failed to create virtual machine pod: …`` and ``Error
        creating pod: …``)."""
        key = key_of(vmi)
        self._log.info("launcher pod not created", namespace=key[0], vmi=key[1], message=message)
        await self.events.record(vmi, "Warning", "FailedCreate", event)

        def change(obj: Obj) -> None:
            st = obj["status"]
            set_condition(st.setdefault("conditions", []), "Synchronized", "False", "FailedCreate", message)
            set_phase(st, "Pending")

        await self._update_status(self.r_vmis, key, change)
        self._backoff("vmi", key, self.vmi_queue)

    async def _vmi_running(self, vmi: Obj, pod: Obj) -> None:
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        self.domain_vcpus[uid_of(pod)] = vcpus_of(vmi)  # (virt-launcher defines the domain from the VMI's spec)
        config = self.kubevirt_config()
        overhead = annotations_of(pod).get(MEMORY_OVERHEAD_ANNOTATION)
        pod_status = status(pod)
        guest = (((vmi.get("spec") or {}).get("domain") or {}).get("memory") or {}).get("guest")

        def change(obj: Obj) -> None:
            st = obj["status"]
            st["nodeName"] = node
            st["activePods"] = self.active_pods_status(vmi)
            st["qosClass"] = pod_status.get("qosClass")
            st["launcherContainerImageVersion"] = self.image(config)
            st["migrationMethod"] = "LiveMigration"
            st["migrationTransport"] = "Unix"
            if guest is not None:
                mem = st.setdefault("memory", {})
                mem.update(guest_memory_status(guest))
                if overhead is not None and config.memory_overhead_report:
                    mem["memoryOverhead"] = Quantity.parse(overhead).with_format(Format.BINARY_SI).canonical()
            st["interfaces"] = interfaces_status(interface_names(vmi), pod_status.get("podIP"))
            conds = st.setdefault("conditions", [])
            set_condition(conds, "Ready", "True")
            set_condition(conds, "LiveMigratable", "True")
            set_phase(st, "Running")

        await self._update(
            self.r_vmis,
            key_of(vmi),
            lambda o: o.setdefault("metadata", {}).setdefault("labels", {}).update({NODE_NAME_LABEL: node}),
        )
        await self._update_status(self.r_vmis, key_of(vmi), change)

    async def _cleanup_terminal_pods(self, vmi: Obj) -> None:
        """Terminal launcher pods (migration sources) are deleted after a while."""
        key = key_of(vmi)
        delay = self.timing(self.timing.terminal_pod_cleanup)
        for pod in self.pods_of(vmi):
            if (
                phase(pod) in FINAL_PHASES
                and not deleting(pod)
                and self._vmi_steps.elapsed(uid_of(pod), "cleanup", delay, key)
            ):
                await self._delete(self.r_pods, key_of(pod))
                self._vmi_steps.clear(uid_of(pod))

    # ---- migration controller --------------------------------------------------------------------------------
    def _target_pod(self, vmim: Mapping[str, Any]) -> Obj | None:
        """The target pod this controller created for the migration (recorded at creation and in the migration's
        ``status.migrationState.targetPod``), never another pod that merely carries its label."""
        pods = self.cache.by_index("pods", "migration", f"{key_of(vmim)[0]}/{uid_of(vmim)}")
        created = self._targets.get(uid_of(vmim))
        recorded = ((vmim.get("status") or {}).get("migrationState") or {}).get("targetPod")
        for p in pods:
            if (created is not None and uid_of(p) == created) or (recorded and meta(p).get("name") == recorded):
                return p
        return None

    def _running_migrations(self) -> list[Obj]:
        return [m for p in VMIM_ACTIVE for m in self.cache.by_index("virtualmachineinstancemigrations", "phase", p)]

    def migrations_of(self, namespace: str, vmi: str) -> list[Obj]:
        return self.cache.by_index("virtualmachineinstancemigrations", "vmi", f"{namespace}/{vmi}")

    async def _sync_migration(self, key: Key) -> None:
        vmim = self.cache.get("virtualmachineinstancemigrations", *key)
        if vmim is None:
            return
        finalizers = meta(vmim).get("finalizers") or []
        vmi = self.cache.get("virtualmachineinstances", key[0], str((vmim.get("spec") or {}).get("vmiName") or ""))
        if deleting(vmim):
            # KubeVirt's finalizer: a migration deleted before its hand-off is canceled (condition AbortRequested,
            # its target pod deleted, the migration failed: handlePreHandoffMigrationCancel); one handed off gets the
            # condition and goes on until it runs, when its abort is asked in the VMI's migration state
            # (markMigrationAbortInVmiStatus) and virt-handler aborts it unless the domain has moved already (the VMI
            # stays on its source); the finalizer goes once it is final, and the migration with it
            if MIGRATION_FINALIZER not in finalizers:
                return
            if phase(vmim) in FINAL_PHASES:
                await self._update(
                    self.r_vmims,
                    key,
                    lambda o: o["metadata"].update(
                        finalizers=[f for f in o["metadata"].get("finalizers") or [] if f != MIGRATION_FINALIZER]
                    ),
                )
                return
            handed_off = vmi is not None and (status(vmi).get("migrationState") or {}).get("migrationUid") == uid_of(
                vmim
            )
            if not has_condition(vmim, ABORT_REQUESTED):

                def ask(o: Obj) -> None:
                    set_condition(o["status"].setdefault("conditions", []), ABORT_REQUESTED, "True", probe=True)

                await self._update_status(self.r_vmims, key, ask)
            if not handed_off:
                await self._fail_migration(vmim, vmi, "Migration failed due to being canceled")
                return
            assert vmi is not None
            if phase(vmim) == "Running" and not self._completed(vmi, vmim):
                await self._update_migration_state(vmi, lambda ms: ms.update(abortRequested=True))
                await self._fail_migration(vmim, vmi, "Live migration aborted", aborted=True)
                return
        p = phase(vmim)
        if p in FINAL_PHASES:
            self._vmim_steps.clear(uid_of(vmim))
            if MIGRATION_FINALIZER in finalizers:  # (upstream's updateStatus takes it off every final migration)
                await self._update(
                    self.r_vmims,
                    key,
                    lambda o: o["metadata"].update(
                        finalizers=[f for f in o["metadata"].get("finalizers") or [] if f != MIGRATION_FINALIZER]
                    ),
                )
            await self._gc_migrations(vmim)
            return
        if vmi is None:
            await self._fail_migration(vmim, None, "Migration failed because vmi does not exist.")
            return
        if deleting(vmi) and phase(vmi) not in FINAL_PHASES:
            return  # (upstream's sync does nothing for a VMI being deleted; woken by its updates)
        if phase(vmi) in FINAL_PHASES:
            await self._fail_migration(vmim, vmi, "Migration failed vmi shutdown during migration.")
            return
        target = self._target_pod(vmim)
        if p == "":
            await self._update_status(self.r_vmims, key, lambda o: set_phase(o["status"], "Pending"))
            return
        if p == "Pending":
            if target is None and phase(vmi) != "Running":
                return  # (upstream: "target pod not created because vmi is not running"; woken by its updates)
            if target is None:
                await self._create_target(vmim, vmi)
            elif phase(target) in FINAL_PHASES:  # (upstream's PodIsDown, in any phase: here while it waits to attach)
                await self._fail_migration(vmim, vmi, "Migration failed because target pod shutdown during migration")
            elif has_hotplug_volumes(vmi):
                await self._attach(vmim, target)
            else:
                await self._set_migration_phase(key, "Scheduling")
            return
        target_down = target is None or phase(target) == "Failed" or deleting(target)
        if target_down and not self._completed(vmi, vmim):
            await self._fail_migration(vmim, vmi, "Migration failed because target pod shutdown during migration")
            return
        step = self.timing(self.timing.migration_step)
        uid = uid_of(vmim)
        if p == "Scheduling":
            assert target is not None
            if phase(target) == "Running":
                await self._set_migration_phase(key, "Scheduled")
            else:
                await self._check_target_timeout(vmim, vmi, target)
        elif p == "Scheduled":
            assert target is not None
            await self._hand_off(vmim, vmi, target)
            if self._vmim_steps.elapsed(uid, "Scheduled", step, key):
                await self._set_migration_phase(key, "PreparingTarget")
        elif p == "PreparingTarget" and self._vmim_steps.elapsed(uid, p, step, key):
            assert target is not None
            await self._update_migration_state(
                vmi, lambda ms: ms.update({"targetNodeAddress": str(status(target).get("podIP") or "")})
            )
            await self._set_migration_phase(key, "TargetReady")
        elif p == "TargetReady" and self._vmim_steps.elapsed(uid, p, step, key):
            await self._update_migration_state(vmi, lambda ms: ms.update({"startTimestamp": now_rfc3339()}))
            await self._set_migration_phase(key, "Running")
        elif p == "Running" and self._vmim_steps.elapsed(uid, p, step, key):
            assert target is not None
            await self._complete(vmim, vmi, target)

    def _completed(self, vmi: Mapping[str, Any], vmim: Mapping[str, Any]) -> bool:
        ms = status(vmi).get("migrationState") or {}
        return bool(ms.get("migrationUid") == uid_of(vmim) and ms.get("completed") and not ms.get("failed"))

    async def _set_migration_phase(self, key: Key, new_phase: str, *, target_pod: str = "") -> None:
        def change(obj: Obj) -> None:
            st = obj["status"]
            if target_pod:
                st.setdefault("migrationState", {})["targetPod"] = target_pod
            if new_phase == "Scheduling":
                remove_condition(st.setdefault("conditions", []), REJECTED_BY_QUOTA)
                if not st["conditions"]:
                    del st["conditions"]
            set_phase(st, new_phase)

        await self._update_status(self.r_vmims, key, change)

    async def _create_target(self, vmim: Obj, vmi: Obj) -> None:
        key = key_of(vmim)
        if phase(vmi) != "Running":
            self.migration_queue.add_after(key, self.timing(self.timing.parallel_wait), progress=False)
            return
        running = self._running_migrations()
        source_node = status(vmi).get("nodeName")
        outbound = 0
        for m in running:
            other = self.cache.get(
                "virtualmachineinstances", key_of(m)[0], str((m.get("spec") or {}).get("vmiName") or "")
            )
            if other is not None and status(other).get("nodeName") == source_node:
                outbound += 1
        if (
            len(running) >= self.config.parallel_migrations
            or outbound >= self.config.parallel_outbound_per_node
            or self.active_pods_count(vmi) > 1
        ):
            self.migration_queue.add_after(key, self.timing(self.timing.parallel_wait), progress=False)
            return
        if self._blocked("vmim", key, self.migration_queue):
            return
        cached = self.render_from.pop(key_of(vmi), vmi)
        try:
            pod = self.render(cached, migration=vmim)
        except InvalidInput as e:
            await self.events.record(vmi, "Warning", "FailedCreate", f"failed to render launch manifest: {e}")
            self._backoff("vmim", key, self.migration_queue)
            return
        if FAIL_START_ANNOTATION in annotations_of(vmim):
            pod["metadata"]["annotations"][FAIL_START_ANNOTATION] = "true"
        woken = self._woken.pop(key, "")
        try:
            created = await self.store.create(self.r_pods, pod, namespace=key[0])
        except ApiError as e:
            self.pods_refused += 1
            if "exceeded quota" in e.message:
                retried = "backoff retry" if self.migration_queue.failures(key) else "first try"
                self.target_refusals[woken or retried] += 1
            self._log.info("migration target pod not created", namespace=key[0], migration=key[1], message=e.message)
            await self.events.record(vmi, "Warning", "FailedCreate", f"Error creating pod: {e.message}")
            self._backoff("vmim", key, self.migration_queue)
            if "exceeded quota" in e.message and not has_condition(vmim, REJECTED_BY_QUOTA):
                # (upstream reads the words anywhere in any error: an invalid pod whose message quotes them too)

                def reject(obj: Obj) -> None:
                    conds = obj["status"].setdefault("conditions", [])
                    conds.append({"type": REJECTED_BY_QUOTA, "status": "True", "lastProbeTime": now_rfc3339()})

                # (as upstream, whose informer sees this write after the sync returned its error: the update
                # re-queues the migration at once, and KubeVirt tries again before its backoff)
                await self._update_status(self.r_vmims, key, reject)
            return
        self._succeeded("vmim", key, self.migration_queue)
        self._targets[uid_of(vmim)] = uid_of(created)
        rendered = (cached.get("spec") or {}).get("domain") or {}
        self._target_sizes[uid_of(vmim)] = (copy_json(rendered.get("cpu") or {}), interface_names(cached))
        name = meta(created).get("name")
        await self.events.record(vmim, "Normal", "SuccessfulCreate", f"Created migration target pod {name}")
        # (with hotplugged volumes it stays Pending until the target's attachment pod runs)
        await self._set_migration_phase(
            key, "Pending" if has_hotplug_volumes(vmi) else "Scheduling", target_pod=str(name)
        )

    async def _attach(self, vmim: Obj, target: Obj) -> None:
        """A migration of a VMI with hotplugged volumes whose target exists (``migration.go``): once the target runs,
        an attachment pod beside it, controlled by it (``createAttachmentPod``; any pod it controls counts, as
        ``controller.AttachmentPods`` has it), and Scheduling only once that one runs. A refused attachment pod is a
        ``FailedCreate`` Event on the VMI and a retry with backoff; no condition (the target exists)."""
        key = key_of(vmim)
        if phase(target) != "Running":
            return  # (woken by the target's updates)
        attached = [
            p for p in self.cache.list("pods", key[0]) if (o := self._controller_pod(p)) and uid_of(o) == uid_of(target)
        ]
        if attached:
            if phase(attached[0]) == "Running":
                await self._set_migration_phase(key, "Scheduling")
            return  # (woken by its updates)
        if self._blocked("vmim", key, self.migration_queue):
            return
        pod = attachment_pod(target, self.kubevirt_config(), image=self.image(self.kubevirt_config()))
        # (as createAttachmentPod: the migration's label and name on it; its label kubevirt.io: hotplug-disk keeps it
        # from being taken for the target, which listMatchingTargetPods wants labelled virt-launcher)
        pod["metadata"].setdefault("labels", {})[MIGRATION_JOB_LABEL] = uid_of(vmim)
        pod["metadata"].setdefault("annotations", {})[MIGRATION_JOB_NAME_ANNOTATION] = key[1]
        try:
            await self.store.create(self.r_pods, pod, namespace=key[0])
        except ApiError as e:
            self.pods_refused += 1
            self._log.info("attachment pod not created", namespace=key[0], migration=key[1], message=e.message)
            vmi = self.cache.get("virtualmachineinstances", key[0], str((vmim.get("spec") or {}).get("vmiName") or ""))
            message = f"Error creating attachment pod: {e.message}"
            await self.events.record(vmi or vmim, "Warning", "FailedCreate", message)  # (on the VMI, as upstream)
            self._backoff("vmim", key, self.migration_queue)
            return
        self._succeeded("vmim", key, self.migration_queue)

    async def _check_target_timeout(self, vmim: Obj, vmi: Obj, target: Obj) -> None:
        key, uid = key_of(vmim), uid_of(vmim)
        unschedulable = any(
            isinstance(c, Mapping) and c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in status(target).get("conditions") or []
        )
        step = "unschedulable" if unschedulable else "pending"
        limit = self.timing(self.timing.unschedulable_timeout if unschedulable else self.timing.pending_timeout)
        # a watchdog, not progress: it keeps nobody waiting for a quiet cluster
        if self._vmim_steps.elapsed(uid, step, limit, key, progress=False):
            await self._delete(self.r_pods, key_of(target))
            await self._fail_migration(vmim, vmi, f"Migration target pod was {step} for too long")

    async def _hand_off(self, vmim: Obj, vmi: Obj, target: Obj) -> None:
        ms = status(vmi).get("migrationState") or {}
        if ms.get("migrationUid") == uid_of(vmim):
            return
        source = self.launcher_of(vmi)
        target_node = str((target.get("spec") or {}).get("nodeName") or "")
        state: Obj = {
            "migrationUid": uid_of(vmim),
            "sourceNode": status(vmi).get("nodeName"),
            "targetNode": target_node,
            "targetPod": meta(target).get("name"),
            "sourcePod": meta(source).get("name") if source is not None else None,
            "mode": "PreCopy",
        }
        overhead = annotations_of(target).get(MEMORY_OVERHEAD_ANNOTATION)
        if overhead is not None:
            state["targetMemoryOverhead"] = Quantity.parse(overhead).with_format(Format.BINARY_SI).canonical()
        labels = {MIGRATION_TARGET_NODE_LABEL: target_node}
        if has_condition(vmi, "HotMemoryChange", "True"):
            labels[POD_MEMORY_REQUESTS_LABEL] = compute_memory_request(target).canonical()
        await self._update(
            self.r_vmis, key_of(vmi), lambda o: o.setdefault("metadata", {}).setdefault("labels", {}).update(labels)
        )
        await self._update_status(self.r_vmis, key_of(vmi), lambda o: o["status"].update({"migrationState": state}))
        await self.events.record(
            vmim, "Normal", "PreparingTarget", "Migration target pod is ready for preparation by virt-handler."
        )

    async def _update_migration_state(self, vmi: Obj, fn: Callable[[Obj], None]) -> None:
        def change(obj: Obj) -> None:
            ms = obj["status"].get("migrationState")
            if isinstance(ms, dict):
                fn(ms)

        await self._update_status(self.r_vmis, key_of(vmi), change)

    async def _complete(self, vmim: Obj, vmi: Obj, target: Obj) -> None:
        """The migration finished: the VMI moves to the target; the vCPUs and interfaces its target was rendered
        with become current. A memory hotplug is carried out as virt-handler's ``hotplugMemory`` does
        (:func:`memory_covered`; one that fails keeps its condition, and the workload updater migrates again). A CPU
        hotplug is carried out whatever the target was rendered for, as virt-handler's ``finalizeMigration`` does
        (``hotplugCPU``: with ``HotVCPUChange`` set, the domain gets the spec's vCPUs, ``currentCPUTopology``
        follows the spec and the condition goes; only dedicated CPUs are checked against the pod)."""
        key = key_of(vmi)
        node = str((target.get("spec") or {}).get("nodeName") or "")
        source = self.launcher_of(vmi)
        spec_domain = (vmi.get("spec") or {}).get("domain") or {}
        now_cpu, now_guest = spec_domain.get("cpu") or {}, (spec_domain.get("memory") or {}).get("guest")
        now_ifaces = interface_names(vmi)
        cpu, ifaces = self._target_sizes.get(uid_of(vmim), (now_cpu, now_ifaces))
        hot_cpu = has_condition(vmi, "HotVCPUChange", "True")
        if hot_cpu:
            cpu = now_cpu
        # (``hotplugMemory``: with a memory change pending, the spec's guest memory, whatever the target was made
        # for, where the label covers it; otherwise, or with none pending, the memory stays, and the VMI controller's
        # next sync asks again where the spec differs)
        guest = now_guest if has_condition(vmi, "HotMemoryChange", "True") and memory_covered(vmi) else None
        caught_up = cpu == now_cpu and guest == now_guest
        # what the target was rendered with, and what was plugged in place meanwhile (a bridge interface)
        listed = listed_interfaces(vmi)
        ifaces = [n for n in now_ifaces if n in ifaces or n in listed]
        plugged = not (sriov_interfaces(vmi) - set(ifaces))
        pod_ip = status(target).get("podIP")
        now = now_rfc3339()

        def change(obj: Obj) -> None:
            st = obj["status"]
            st["nodeName"] = node
            st["activePods"] = self.active_pods_status(vmi)
            ms = st.get("migrationState")
            if isinstance(ms, dict):
                ms.update({"completed": True, "endTimestamp": now, "targetNodeDomainReadyTimestamp": now})
            st["currentCPUTopology"] = cpu_topology(cpu)
            if guest is not None:
                st.setdefault("memory", {}).update({"guestCurrent": guest, "guestRequested": guest})
            mem = st.get("memory")
            overhead = annotations_of(target).get(MEMORY_OVERHEAD_ANNOTATION)
            if isinstance(mem, dict) and overhead is not None and "memoryOverhead" in mem:
                # (the VMI controller's ``updateMemoryOverheadStatusFromPod``: the active pod's, now the target's)
                mem["memoryOverhead"] = Quantity.parse(overhead).with_format(Format.BINARY_SI).canonical()
            st["interfaces"] = interfaces_status(ifaces, pod_ip)
            conds = st.setdefault("conditions", [])
            if caught_up or hot_cpu:
                remove_condition(conds, "HotVCPUChange")
            if caught_up:
                remove_condition(conds, "HotMemoryChange")
            if plugged:
                remove_condition(conds, MIGRATION_REQUIRED)

        def relabel(obj: Obj) -> None:
            lab = obj.setdefault("metadata", {}).setdefault("labels", {})
            lab[NODE_NAME_LABEL] = node
            lab.pop(MIGRATION_TARGET_NODE_LABEL, None)
            lab.pop(POD_MEMORY_REQUESTS_LABEL, None)

        self.domain_vcpus[uid_of(target)] = _vcpus(cpu)

        await self._update(self.r_vmis, key, relabel)
        updated = await self._update_status(self.r_vmis, key, change)
        ms = status(updated or vmi).get("migrationState")

        def succeed(obj: Obj) -> None:
            st = obj["status"]
            if isinstance(ms, Mapping):
                st["migrationState"] = dict(ms)
            set_phase(st, "Succeeded")

        await self._update_status(self.r_vmims, key_of(vmim), succeed)
        self._log.info("migration succeeded", namespace=key[0], migration=key_of(vmim)[1], vmi=key[1], node=node)
        await self.events.record(vmim, "Normal", "SuccessfulMigration", "Source node reported migration succeeded")
        await self.events.record(vmi, "Normal", "Migrated", f"The VirtualMachineInstance migrated to node {node}.")
        if source is not None:
            # virt-launcher on the source exits a moment later: the pod turns Succeeded (kubelet), later deleted
            self._pod_steps.clear(uid_of(source))
            self.pod_queue.add_after(key_of(source), 0.0)
            self._source_done.add(uid_of(source))

    async def _fail_migration(self, vmim: Obj, vmi: Obj | None, message: str, *, aborted: bool = False) -> None:
        key = key_of(vmim)
        target = self._target_pod(vmim)
        if target is not None and phase(target) not in FINAL_PHASES and not deleting(target):
            await self._delete(self.r_pods, key_of(target))
        if vmi is not None:
            ms = status(vmi).get("migrationState") or {}
            if ms.get("migrationUid") == uid_of(vmim):
                now = now_rfc3339()
                ended: Obj = {"completed": True, "failed": True, "endTimestamp": now, "failureReason": message}
                if aborted:
                    ended["abortStatus"] = "Succeeded"
                await self._update_migration_state(vmi, lambda m: m.update(ended))
                await self._update(
                    self.r_vmis,
                    key_of(vmi),
                    lambda o: (o.get("metadata") or {}).get("labels", {}).pop(MIGRATION_TARGET_NODE_LABEL, None),
                )
        await self._update_status(self.r_vmims, key, lambda o: set_phase(o["status"], "Failed"))
        self._log.info("migration failed", namespace=key[0], migration=key[1], reason=message)
        await self.events.record(vmim, "Warning", "FailedMigration", message)

    async def _gc_migrations(self, vmim: Obj) -> None:
        """Keep the newest finished migrations per VMI."""
        ns = key_of(vmim)[0]
        vmi_name = (vmim.get("spec") or {}).get("vmiName")
        done = [m for m in self.migrations_of(ns, str(vmi_name)) if phase(m) in FINAL_PHASES and not deleting(m)]
        if len(done) <= self.config.finished_migrations_kept:
            return
        done.sort(key=lambda m: (str(meta(m).get("creationTimestamp") or ""), int(meta(m).get("resourceVersion") or 0)))
        for m in done[: len(done) - self.config.finished_migrations_kept]:
            await self._delete(self.r_vmims, key_of(m))

    # ---- scheduler and kubelet -------------------------------------------------------------------------------
    def _pick_node(self, pod: Mapping[str, Any]) -> str | None:
        ns = key_of(pod)[0]
        excluded: set[str] = set()
        anti = (((pod.get("spec") or {}).get("affinity") or {}).get("podAntiAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or []
        for term in anti:
            match = ((term or {}).get("labelSelector") or {}).get("matchLabels") or {}
            if not match:
                continue
            # the pods the term selects (narrowed through the created-by index when it is one of the labels)
            if CREATED_BY_LABEL in match:
                others = self.cache.by_index("pods", "vmi", f"{ns}/{match[CREATED_BY_LABEL]}")
            else:
                others = self.cache.list("pods", ns)
            for p in others:
                if phase(p) in FINAL_PHASES or uid_of(p) == uid_of(pod):
                    continue
                if all(labels_of(p).get(k) == v for k, v in match.items()):
                    node = (p.get("spec") or {}).get("nodeName")
                    if node:
                        excluded.add(node)
        candidates = [n for n in self.config.nodes if n in self.schedulable and n not in excluded]
        hosts = _required_hosts(pod)
        if hosts is not None:
            candidates = [n for n in candidates if n in hosts]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (len(self.cache.by_index("pods", "node", n)), n))

    async def _sync_pod(self, key: Key) -> None:
        pod = self.cache.get("pods", *key)
        if pod is None:
            return
        if deleting(pod):  # (held by a finalizer: the kubelet stops its containers at the end of its grace period)
            grace = float(meta(pod).get("deletionGracePeriodSeconds") or 0)
            stopping = self._pod_steps.elapsed(uid_of(pod), "terminate", self.timing(grace), key, progress=False)
            if phase(pod) == "Running" and stopping:
                await self._update_status(
                    self.r_pods,
                    key,
                    lambda o: (
                        None if o["status"].get("phase") in FINAL_PHASES else _terminate(o["status"], "Completed", 0)
                    ),
                )
            return
        uid = uid_of(pod)
        p = phase(pod) or "Pending"
        if uid in self._source_done and p not in FINAL_PHASES:
            if self._pod_steps.elapsed(uid, "shutdown", self.timing(self.timing.source_shutdown_delay), key):
                self._source_done.discard(uid)
                await self._update_status(
                    self.r_pods,
                    key,
                    lambda o: (
                        None if o["status"].get("phase") in FINAL_PHASES else _terminate(o["status"], "Completed", 0)
                    ),
                )
            return
        if p == "Running" and _actuated(pod) != ((pod.get("status") or {}).get("containerStatuses") or []):
            await self._update_status(self.r_pods, key, lambda o: o["status"].update(containerStatuses=_actuated(o)))
            return
        if p != "Pending":
            return
        node = (pod.get("spec") or {}).get("nodeName")
        if not node and (pod.get("spec") or {}).get("schedulingGates"):  # (the scheduler waits for them to go)
            await self._update_status(
                self.r_pods,
                key,
                lambda o: set_condition(
                    o["status"].setdefault("conditions", []),
                    "PodScheduled",
                    "False",
                    "SchedulingGated",
                    "Scheduling is blocked due to non-empty scheduling gates",
                ),
            )
            return
        if not node:
            if not self._pod_steps.elapsed(uid, "schedule", self.timing(self.timing.schedule_delay), key):
                return
            chosen = self._pick_node(pod)
            if chosen is None:
                message = f"0/{len(self.config.nodes)} nodes are available: no node satisfies the pod's constraints."
                await self._update_status(
                    self.r_pods,
                    key,
                    lambda o: set_condition(
                        o["status"].setdefault("conditions", []), "PodScheduled", "False", "Unschedulable", message
                    ),
                )
                self._pod_steps.clear(uid, "schedule")
                self.pod_queue.add_after(key, self.timing(self.timing.schedule_delay) * 10, progress=False)
                return

            try:
                await self.store.bind(self.r_pods, key[0], key[1], chosen)
            except ApiError as e:
                if e.code not in (404, 409):  # (gone, or bound or deleted meanwhile: the next sync sees it)
                    raise
            return
        if not self._pod_steps.elapsed(uid, "start", self.timing(self.timing.start_delay), key):
            return
        fail = FAIL_START_ANNOTATION in annotations_of(pod)
        ip = f"10.244.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"

        def start(obj: Obj) -> None:
            st = obj["status"]
            if st.get("phase", "Pending") != "Pending":
                return  # someone else moved it on meanwhile
            spec = obj.get("spec") or {}
            now = now_rfc3339()
            st["hostIP"] = f"192.168.0.{(self.config.nodes.index(node) if node in self.config.nodes else 0) + 10}"
            st["podIP"] = ip
            st["podIPs"] = [{"ip": ip}]
            st["startTime"] = now
            if fail:
                _terminate(st, "Error", 1)
                return
            st["containerStatuses"] = [
                {
                    "name": c.get("name"),
                    "image": c.get("image"),
                    "imageID": c.get("image") or "",
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": now}},
                    **_reported_resources(c),
                }
                for c in spec.get("containers") or []
            ]
            conds = st.setdefault("conditions", [])
            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
                set_condition(conds, t, "True")
            st["phase"] = "Running"

        await self._update_status(self.r_pods, key, start)


def _required_hosts(pod: Mapping[str, Any]) -> set[str] | None:
    """The nodes a pod's required node affinity on ``kubernetes.io/hostname`` (``In``) allows, None without one."""
    affinity = (((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    hosts: set[str] | None = None
    for term in affinity.get("nodeSelectorTerms") or []:
        for e in (term or {}).get("matchExpressions") or []:
            if e.get("key") == "kubernetes.io/hostname" and e.get("operator") == "In":
                hosts = (hosts or set()) | {str(v) for v in e.get("values") or []}
    return hosts


def _reported_resources(container: Mapping[str, Any]) -> dict[str, Any]:
    """What a 1.33+ kubelet reports in a running container's status once it has actuated the spec: ``resources``
    (requests and limits) and ``allocatedResources`` (the requests). The quota evaluator charges the maximum of
    these and the spec, so a shrinking resize frees quota only once it is actuated."""
    res = container.get("resources") or {}
    reported = {k: dict(res[k]) for k in ("requests", "limits") if isinstance(res.get(k), Mapping) and res[k]}
    return {"resources": reported, "allocatedResources": dict(reported.get("requests") or {})}


def _actuated(pod: Mapping[str, Any]) -> list[Any]:
    """The container statuses once the kubelet has applied the spec's resources (a feasible resize; the simulated
    nodes have room for any): each running container's reported resources follow its spec."""
    specs = {c.get("name"): c for c in (pod.get("spec") or {}).get("containers") or [] if isinstance(c, Mapping)}
    out: list[Any] = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        c = specs.get(cs.get("name")) if isinstance(cs, Mapping) else None
        out.append({**cs, **_reported_resources(c)} if c is not None and "resources" in cs else cs)
    return out


def kubevirt_sees(pod: Mapping[str, Any]) -> bool:
    """Whether virt-controller's VMI and migration controllers see the pod at all: their pod informer lists and
    watches only pods carrying the label key ``kubevirt.io`` (``KubeVirtPod``, selector ``kubevirt.io``). A pod
    without it is never a VMI's, whatever its controller reference says."""
    return APP_LABEL in labels_of(pod)


def _label_values(obj: Mapping[str, Any], label: str) -> tuple[str, ...]:
    """``namespace/value`` of a label, for an index (empty when the label is absent)."""
    value = labels_of(obj).get(label)
    return (f"{key_of(obj)[0]}/{value}",) if value else ()


def _controller_uid(obj: Mapping[str, Any]) -> tuple[str, ...]:
    """``namespace/uid`` of the owner reference marked ``controller: true``, for an index."""
    for ref in meta(obj).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("uid"):
            return (f"{key_of(obj)[0]}/{ref['uid']}",)
    return ()


def _pod_node(pod: Mapping[str, Any]) -> tuple[str, ...]:
    node = (pod.get("spec") or {}).get("nodeName")
    return (str(node),) if node and phase(pod) not in FINAL_PHASES else ()


def _vmim_vmi(vmim: Mapping[str, Any]) -> tuple[str, ...]:
    name = (vmim.get("spec") or {}).get("vmiName")
    return (f"{key_of(vmim)[0]}/{name}",) if name else ()


def _terminate(st: Obj, reason: str, exit_code: int) -> None:
    """A pod whose containers all exited: Succeeded (exit 0) or Failed."""
    now = now_rfc3339()
    for cs in st.get("containerStatuses") or []:
        cs["ready"] = False
        cs["started"] = False
        cs["state"] = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now}}
    conds = st.setdefault("conditions", [])
    set_condition(conds, "Ready", "False", "PodCompleted" if exit_code == 0 else "PodFailed")
    set_condition(conds, "ContainersReady", "False", "PodCompleted" if exit_code == 0 else "PodFailed")
    st["phase"] = "Succeeded" if exit_code == 0 else "Failed"


__all__ = [
    "EventRecorder",
    "KubeVirtSimConfig",
    "KubeVirtSimulator",
    "KubeVirtTiming",
    "launcher_pod",
    "run_strategy",
    "vmi_from_vm",
]
