"""Facts about a VirtualMachineInstance that every part of accounting needs: its size after KubeVirt's admission
defaults (vCPUs, guest memory), its explicit resources, and the sizes reported in its status after hotplug.

Input is the plain JSON/YAML object (``dict``) of a VMI, or of a VM (whose ``spec.template`` is used). Errors
raise :class:`~shared.errors.InvalidInput` naming the object and field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from shared.errors import InvalidInput
from shared.fields import boolean, mapping, objects, string, string_map
from shared.kinds import VM_KIND, VMI_KIND
from shared.quantity import Format, Quantity
from shared.resources import ResourceList, parse_resource_list

_MAX_VCPUS = 4096
_MAX_GUEST = Quantity.parse("64Ti")


def object_ref(obj: Mapping[str, Any]) -> str:
    """``Kind namespace/name`` for error messages."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    kind = obj.get("kind") or "object"
    ns, name = meta.get("namespace"), meta.get("name") or "<unnamed>"
    return f"{kind} {ns}/{name}" if ns else f"{kind} {name}"


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    v = obj.get(key, 0)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInput(f"expected a whole number, got {v!r}", f"{where}.{key}")
    if v < 0 or v > _MAX_VCPUS:
        raise InvalidInput(f"{v} is out of range (0..{_MAX_VCPUS})", f"{where}.{key}")
    return v


@dataclass(frozen=True, slots=True)
class Topology:
    sockets: int
    cores: int
    threads: int

    @property
    def vcpus(self) -> int:
        n = 1
        for f in (self.sockets, self.cores, self.threads):
            if f:
                n *= f
        return n


@dataclass(frozen=True, slots=True)
class VmiSpec:
    """The parts of a VMI spec (or VM template spec) that sizing depends on, with admission defaults applied."""

    namespace: str
    name: str
    uid: str
    annotations: Mapping[str, str]
    domain: Mapping[str, Any]
    spec: Mapping[str, Any]
    topology: Topology
    vcpus: int
    """vCPUs for sizing: topology product, plus the supplemental IO thread pool when that policy is set."""
    guest_memory: Quantity | None
    """Guest memory after defaults; None only for a hugepages VM with nothing else set (not possible after defaults)."""
    requests: ResourceList
    limits: ResourceList
    dedicated_cpus: bool
    isolate_emulator_thread: bool
    hugepage_size: Quantity | None
    io_thread_pool: int = 0
    """``ioThreads.supplementalPoolThreadCount`` whatever ``ioThreadsPolicy`` says (v1.5.2+ count it in the launcher's
    CPU either way; only ``vcpus`` and the emulator-thread parity require the policy)."""
    kind: str = VMI_KIND
    """``VirtualMachineInstance`` or ``VirtualMachine`` (the object the spec was read from)."""
    spec_path: str = "spec"
    """Where the VMI spec sits in that object (``spec.template.spec`` for a VM), for error messages."""

    @property
    def ref(self) -> str:
        """``Kind namespace/name`` for error messages."""
        name = self.name or "<unnamed>"
        return f"{self.kind} {self.namespace}/{name}" if self.namespace else f"{self.kind} {name}"


def vmi_spec(obj: Mapping[str, Any]) -> VmiSpec:
    """Read a VMI or VM object; apply KubeVirt's admission defaults for CPU topology and guest memory."""
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"expected an object, got {type(obj).__name__}")
    try:
        return _vmi_spec(obj)
    except InvalidInput as e:
        raise e.at(object_ref(obj)) from None


def _vmi_spec(obj: Mapping[str, Any]) -> VmiSpec:
    meta = mapping(obj, "metadata", "")
    kind = obj.get("kind", VMI_KIND)
    spec = mapping(obj, "spec", "")
    where = "spec"
    if kind == VM_KIND:
        tmpl = mapping(spec, "template", "spec")
        spec = mapping(tmpl, "spec", "spec.template")
        where = "spec.template.spec"
        tmeta = mapping(tmpl, "metadata", "spec.template")
        annotations = string_map(tmeta, "annotations", "spec.template.metadata")
    else:
        annotations = string_map(meta, "annotations", "metadata")
    domain = mapping(spec, "domain", where)
    dwhere = f"{where}.domain"
    res = mapping(domain, "resources", dwhere)
    requests = parse_resource_list(res.get("requests"), f"{dwhere}.resources.requests")
    limits = parse_resource_list(res.get("limits"), f"{dwhere}.resources.limits")

    # CPU (pkg/defaults: topology all zero -> cores=1, threads=1, sockets from limits/requests, else 1)
    cpu = mapping(domain, "cpu", dwhere)
    cwhere = f"{dwhere}.cpu"
    sockets, cores, threads = (_count(cpu, k, cwhere) for k in ("sockets", "cores", "threads"))
    if sockets == 0 and cores == 0 and threads == 0:
        if "cpu" in limits:
            sockets = max(1, limits["cpu"].ceil())
        elif "cpu" in requests:
            sockets = max(1, requests["cpu"].ceil())
        else:
            sockets = 1
        cores, threads = 1, 1
    topo = Topology(sockets, cores, threads)
    vcpus = topo.vcpus
    if vcpus > _MAX_VCPUS:
        raise InvalidInput(f"{vcpus} vCPUs is out of range (at most {_MAX_VCPUS})", cwhere)
    pool = _count(mapping(domain, "ioThreads", dwhere), "supplementalPoolThreadCount", f"{dwhere}.ioThreads")
    if domain.get("ioThreadsPolicy") == "supplementalPool":
        vcpus += pool
    dedicated = boolean(cpu, "dedicatedCpuPlacement", cwhere) is True
    isolate = boolean(cpu, "isolateEmulatorThread", cwhere) is True

    # Memory (guest <- requests.memory <- limits.memory <- hugepage size; never the reverse)
    mem = mapping(domain, "memory", dwhere)
    mwhere = f"{dwhere}.memory"
    hp = mapping(mem, "hugepages", mwhere)
    hugepage_size: Quantity | None = None
    if hp.get("pageSize") is not None:
        hugepage_size = _quantity(hp.get("pageSize"), f"{mwhere}.hugepages.pageSize")
    guest: Quantity | None
    if mem.get("guest") is not None:
        guest = _quantity(mem.get("guest"), f"{mwhere}.guest")
    elif "memory" in requests and requests["memory"].nanos:  # (setGuestMemory skips a zero request, and a zero limit)
        guest = requests["memory"]
    elif "memory" in limits and limits["memory"].nanos:
        guest = limits["memory"]
    else:
        guest = hugepage_size
    if guest is not None and guest > _MAX_GUEST:
        raise InvalidInput(f"guest memory {guest} is out of range (at most {_MAX_GUEST})", f"{mwhere}.guest")
    if guest is not None:
        guest = guest.with_format(Format.BINARY_SI)
    return VmiSpec(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        annotations=annotations,
        domain=domain,
        spec=spec,
        topology=topo,
        vcpus=vcpus,
        guest_memory=guest,
        requests=requests,
        limits=limits,
        dedicated_cpus=dedicated,
        isolate_emulator_thread=isolate,
        hugepage_size=hugepage_size,
        io_thread_pool=pool,
        kind=VM_KIND if kind == VM_KIND else VMI_KIND,
        spec_path=where,
    )


def _quantity(raw: object, where: str) -> Quantity:
    try:
        return Quantity.parse(raw)
    except InvalidInput as e:
        raise e.at(where) from None


@dataclass(frozen=True, slots=True)
class StatusSize:
    """Sizes a running VMI reports after hotplug (None where the status does not say)."""

    vcpus: int | None
    guest_memory: Quantity | None
    guest_requested: Quantity | None = None
    """``status.memory.guestRequested`` alone: the memory virt-handler gave the domain (the spec, once a hotplug is
    applied; KubeVirt's VMI controller reads a spec other than it as a memory change to carry out)."""


def status_size(obj: Mapping[str, Any]) -> StatusSize:
    """``status.currentCPUTopology`` and the larger of ``status.memory.guestRequested`` and ``guestCurrent`` of a
    VMI: the size it runs at now, which a hotplug request raises only once its migration hands over.

    ``guestRequested`` is virt-handler's record of the memory the domain was given (the spec, once a hotplug is
    applied); ``guestCurrent`` is libvirt's current memory, which follows what the guest has brought online. A
    guest (the tenant's) may keep hotplugged memory offline and bring it online at any time, with no pod and no
    migration to refuse: counting the VM at ``guestCurrent`` would make the admitted growth room again. And a guest
    that did not release memory after an unplug still holds it: the larger of the two counts."""
    status = obj.get("status")
    if not isinstance(status, Mapping):
        return StatusSize(None, None)
    vcpus: int | None = None
    topo = status.get("currentCPUTopology")
    if isinstance(topo, Mapping):
        t = Topology(*(_count(topo, k, "status.currentCPUTopology") for k in ("sockets", "cores", "threads")))
        vcpus = t.vcpus
    guest: Quantity | None = None
    requested: Quantity | None = None
    memst = status.get("memory")
    if isinstance(memst, Mapping):
        for key in ("guestRequested", "guestCurrent"):
            if memst.get(key) is not None:
                reported = _quantity(memst.get(key), f"status.memory.{key}")
                guest = reported if guest is None or reported > guest else guest
                if key == "guestRequested":
                    requested = reported
    return StatusSize(vcpus, guest, requested)


def unplugged_interfaces(obj: Mapping[str, Any]) -> list[int]:
    """Indexes in ``spec.domain.devices.interfaces`` of a running VMI's interfaces (other than ``state: absent``)
    that its ``status.interfaces`` does not report from the domain yet: added by a live update and not in its pod.
    KubeVirt plugs an SR-IOV one only through a migration (its target pod is rendered with it, the source pod has
    nothing of it; a ``MigrationRequired`` condition has the workload updater start it), a bridge one in place.
    Only an entry whose ``infoSource`` names ``domain`` counts: virt-handler writes it from libvirt's domain (SR-IOV
    host devices included). An entry from ``multus-status`` alone comes from the launcher pod's network-status
    annotation, which a tenant who may edit its pods can write, and one from ``guest-agent`` alone from the guest.
    Empty for a VMI that is not running: it is admitted whole."""
    status = obj.get("status")
    if not isinstance(status, Mapping) or status.get("phase") != "Running":
        return []
    plugged = set()
    for i, e in enumerate(objects(status, "interfaces", "status")):
        where = f"status.interfaces[{i}]"
        sources = {s.strip() for s in string(e, "infoSource", where).split(",")}
        if "domain" in sources:
            plugged.add(string(e, "name", where))
    spec = mapping(obj, "spec", "")
    devices = mapping(mapping(spec, "domain", "spec"), "devices", "spec.domain")
    where = "spec.domain.devices"
    return [
        i
        for i, iface in enumerate(objects(devices, "interfaces", where))
        if string(iface, "state", f"{where}.interfaces[{i}]") != "absent"
        and string(iface, "name", f"{where}.interfaces[{i}]") not in plugged
    ]


def has_hotplug_volumes(obj: Mapping[str, Any]) -> bool:
    """KubeVirt's ``controller.VMIHasHotplugVolumes``: a volume status with ``hotplugVolume``, or a DataVolume or
    PersistentVolumeClaim volume marked ``hotpluggable``. A migration of such a VMI waits for an attachment pod beside
    its target (``shared.kubevirt.render.attachment_pod_usage``)."""
    status = mapping(obj, "status", "")
    if any(isinstance(v.get("hotplugVolume"), Mapping) for v in objects(status, "volumeStatus", "status")):
        return True
    spec = mapping(obj, "spec", "")
    for i, volume in enumerate(objects(spec, "volumes", "spec")):
        for source in ("dataVolume", "persistentVolumeClaim"):
            if mapping(volume, source, f"spec.volumes[{i}]").get("hotpluggable") is True:
                return True
    return False


GUARD_REFUSER: Final = "vmquota-reservation-guard"
""":func:`room_refuser` of a refusal by the reservation guard's policy (``deploy/components/reservation-guard``)."""
VM_TERMS_REFUSER: Final = "vmquota-vm-terms"
""":func:`room_refuser` of a refusal by the guard's policy that admits no pod while a VM-term quota is not accounted:
room vmquota makes once it is mends it too."""
GUARD_REFUSERS: Final = frozenset({GUARD_REFUSER, VM_TERMS_REFUSER})

_ROOM_REFUSAL: Final = re.compile(
    r'failed to create virtual machine pod: pods "[^"]*" is forbidden: '
    r"(?:exceeded quota: ([^,]+), |ValidatingAdmissionPolicy '(" + "|".join(sorted(GUARD_REFUSERS)) + r")' )"
)


def room_refuser(message: str) -> str:
    """Who refused KubeVirt a VMI's launcher pod for room, from its ``Synchronized=False`` / ``FailedCreate``
    condition (KubeVirt's message, with the API server's refusal in it): the ResourceQuota's name, or the name of
    one of the guard's policies (:data:`GUARD_REFUSERS`); "" for any other failure (a manifest that does not
    render, a priority class that does not exist, a pod the API server finds invalid), which room does not mend.
    Only the start of the message is read, as KubeVirt and the API server write it: what follows may quote a value
    of the tenant's (an annotation KubeVirt copies onto the pod), which must not pass for a refusal."""
    m = _ROOM_REFUSAL.match(message)
    if m is None:
        return ""
    return m.group(1) or m.group(2)
