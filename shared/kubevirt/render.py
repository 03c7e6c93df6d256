"""The launcher pod KubeVirt's virt-controller would create for a VMI: per-container requests/limits, pod totals
(by :func:`shared.podusage.pod_totals`) and the memory overhead.

Model (``pkg/virt-controller/services/renderresources.go`` and ``template.go``): the compute container starts from
the VMI's own ``resources`` (after admission defaults) and computed values; the VMI's explicit values win over
computed ones; memory overhead is added to the memory request (unless ``overcommitGuestOverhead``) and to any
memory limit. Support containers (containerDisks, guest-console-log, virtiofs, hook sidecars) have fixed sizes,
changed by ``supportContainerResources`` and raised to their limits under dedicated CPUs / Guaranteed QoS.
Version differences live in :class:`~shared.kubevirt.config.VersionProfile`. ``docs/rendering.md`` has the
decisions where the reference leaves room.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction
from functools import lru_cache
from typing import Any, Final

from shared.errors import InvalidInput
from shared.fields import boolean, mapping, objects
from shared.kinds import VM_KIND
from shared.kubevirt.config import (
    EPHEMERAL_STORAGE,
    HOTPLUG_ATTACHMENT,
    LATEST_MINOR,
    RENDERER,
    WEBHOOK_GUEST,
    KubeVirtConfig,
    parse_go_float,
    selector_matches,
)
from shared.kubevirt.overhead import (
    admitted_requests,
    devices_of,
    memory_of,
    overcommitted,
    overhead_nanos,
    wants_guaranteed_qos,
)
from shared.kubevirt.types import COMPUTE, NamespaceFacts, RenderedPod
from shared.podusage import ContainerSpec, pod_totals, quota_usage_of
from shared.quantity import ZERO, Format, Quantity
from shared.resources import ResourceList
from shared.vmi import VmiSpec, vmi_spec

MEMORY_OVERHEAD_ANNOTATION: Final = "kubevirt.io/memory-overhead-bytes"
AUTO_MEMORY_LIMITS_RATIO_LABEL: Final = "alpha.kubevirt.io/auto-memory-limits-ratio"
EMULATOR_THREAD_EVEN_PARITY_ANNOTATION: Final = "alpha.kubevirt.io/EmulatorThreadCompleteToEvenParity"
HOOK_SIDECARS_ANNOTATION: Final = "hooks.kubevirt.io/hookSidecars"
SKIP_DIGEST_RESOLUTION_ANNOTATION: Final = "kubevirt.io/image-volume-skip-digest-resolution"
RENDER_ANNOTATIONS: Final = (
    EMULATOR_THREAD_EVEN_PARITY_ANNOTATION,
    HOOK_SIDECARS_ANNOTATION,
    SKIP_DIGEST_RESOLUTION_ANNOTATION,
)
"""The VMI annotations the launcher pod is rendered from (a VMI's metadata stays its owner's to change)."""


def render_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    """The :data:`RENDER_ANNOTATIONS` among ``annotations``."""
    return {k: annotations[k] for k in RENDER_ANNOTATIONS if k in annotations}


DEFAULT_MEMORY_LIMITS_RATIO: Final = 2.0

_Q = Quantity.parse
_ONE: Final = _Q("1")


def _container(
    name: str, requests: ResourceList, limits: ResourceList, *, init: bool = False, restartable: bool = False
) -> ContainerSpec:
    # API-server defaulting: a resource with a limit and no request is requested at its limit
    for k, v in limits.items():
        if k not in requests:
            requests[k] = v
    return ContainerSpec(name=name, requests=requests, limits=limits, init=init, restartable=restartable)


# ---- CPU ---------------------------------------------------------------------------------------------------------


def _go_g(x: float) -> str | None:
    r = repr(x)
    return None if ("e" in r or "n" in r) else r


@lru_cache(maxsize=1024)
def cpu_request(vcpus: int, ratio: Fraction) -> Quantity:
    """``vCPUs / cpuAllocationRatio`` as virt-controller writes it: float64 division printed with ``%g``, in
    millicores below one core (``fmt.Sprintf("%gm", val*1000)``), then parsed as a quantity."""
    val = vcpus / float(ratio)
    text = _go_g(val * 1000) if val < 1 else _go_g(val)
    if text is None:  # exponent notation: not reachable with real sizes; fall back to the exact value
        return Quantity.from_fraction(Fraction(vcpus) / ratio)
    return Quantity.parse(text + "m" if val < 1 else text)


@lru_cache(maxsize=1024)
def _cpus(n: int, fmt: Format = Format.DECIMAL_SI) -> Quantity:
    return Quantity.from_int(n, fmt)


def _auto_cpu_limits(vmi: VmiSpec, config: KubeVirtConfig, ns: NamespaceFacts) -> bool:
    if "cpu" in vmi.limits:
        return False
    if config.auto_limits_from_quota and ns.quota_has_limits_cpu:
        return True
    sel = config.auto_cpu_limit_namespace_label_selector
    return sel is not None and selector_matches(sel, ns.labels)


def memory_limits_ratio(labels: Mapping[str, str]) -> float:
    """The namespace's ``alpha.kubevirt.io/auto-memory-limits-ratio`` (a float >= 1), else 2.0."""
    raw = labels.get(AUTO_MEMORY_LIMITS_RATIO_LABEL)
    if raw is None:
        return DEFAULT_MEMORY_LIMITS_RATIO
    value = parse_go_float(raw)
    return value if value is not None and value >= 1.0 else DEFAULT_MEMORY_LIMITS_RATIO


# ---- the compute container -----------------------------------------------------------------------------------------


def _compute(
    vmi: VmiSpec,
    config: KubeVirtConfig,
    ns: NamespaceFacts,
    vm_req: ResourceList,
    overhead: Quantity,
    devices: Mapping[str, Any],
) -> ContainerSpec:
    vm_lim: ResourceList = dict(vmi.limits)
    calc_req: ResourceList = {}
    calc_lim: ResourceList = {}

    # ephemeral storage for KubeVirt's own files
    vm_req["ephemeral-storage"] = vm_req.get("ephemeral-storage", ZERO) + EPHEMERAL_STORAGE
    if "ephemeral-storage" in vm_lim:
        vm_lim["ephemeral-storage"] = vm_lim["ephemeral-storage"] + EPHEMERAL_STORAGE

    # memory request: v1.6.2 overcommits whatever request the VMI has (WithMemoryOvercommit); v1.6.4+ derives a
    # missing one from the limit, else guest (or hugepage size) x 100 / overcommit, for every VMI (WithMemoryRequests);
    # up to v1.6.3 the admission webhook already did (admitted_requests)
    mode = config.profile.memory_request
    mem_req = vm_req.get("memory")
    if mode == WEBHOOK_GUEST:
        if mem_req is not None and config.memory_overcommit != 100:
            vm_req["memory"] = overcommitted(mem_req, config.memory_overcommit)
    elif mode == RENDERER and (mem_req is None or mem_req.nanos == 0):
        lim = vm_lim.get("memory")
        if lim is not None and lim.nanos != 0:
            vm_req["memory"] = lim
        elif mem_req is None and vmi.guest_memory is not None and vmi.guest_memory.nanos > 0:
            vm_req["memory"] = overcommitted(vmi.guest_memory, config.memory_overcommit)
    hugepages = vmi.hugepage_size is not None

    # CPU: the supplemental IO-thread pool (v1.5+) counts like vCPUs from v1.5.2 (getIOThreadsCount: the count,
    # whatever the policy); in v1.5.0-v1.5.1 the request covers the topology only and WithIOThreads adds the pool to
    # the CPU limit (with the policy); before v1.5 the field does not exist. The emulator-thread parity adds the
    # pool again only with the policy (additionalCPUs).
    prof = config.profile
    policy_pool = vmi.vcpus - vmi.topology.vcpus if prof.minor >= 5 else 0  # (with the supplementalPool policy)
    sized = vmi.topology.vcpus + vmi.io_thread_pool if prof.pool_in_cpu else vmi.topology.vcpus
    if vmi.dedicated_cpus:
        total = sized
        vm_lim["cpu"] = vm_req["cpu"] = _cpus(total, Format.BINARY_SI)
        if vmi.isolate_emulator_thread:
            extra = 1
            if EMULATOR_THREAD_EVEN_PARITY_ANNOTATION in vmi.annotations and (total + policy_pool) % 2 == 0:
                extra = 2
            vm_lim["cpu"] = vm_req["cpu"] = _cpus(total + extra, Format.BINARY_SI)
        if "memory" in vm_req:
            vm_lim["memory"] = vm_req["memory"]
    else:
        calc_req["cpu"] = cpu_request(sized, config.cpu_allocation_ratio)
        if _auto_cpu_limits(vmi, config, ns):
            calc_lim["cpu"] = _cpus(sized)
    if policy_pool > 0 and not prof.pool_in_cpu:  # WithIOThreads: addToCPU(vmLimits, pool)
        added = _cpus(policy_pool, Format.BINARY_SI)
        cur = vm_lim.get("cpu")
        vm_lim["cpu"] = added if cur is None else cur + added
        if vmi.dedicated_cpus:
            vm_req["cpu"] = vm_lim["cpu"]

    # memory: hugepages carry the guest RAM, the memory request only the overhead (and any request above guest)
    if hugepages:
        page_size = memory_of(vmi).get("hugepages", {}).get("pageSize")
        name = f"hugepages-{page_size}"
        hp_guest = vmi.guest_memory  # memory.guest after the admission default
        hp_req = vm_req.get("memory", ZERO)
        calc_req[name] = calc_lim[name] = hp_guest if hp_guest is not None and hp_req > hp_guest else hp_req
        req_diff = Quantity(0, Format.DECIMAL_SI)
        lim_diff = Quantity(0, Format.DECIMAL_SI)
        if hp_guest is not None:
            if hp_req > hp_guest:
                req_diff = req_diff + hp_req - hp_guest
            hp_lim = vm_lim.get("memory", ZERO)
            if hp_lim > hp_guest:
                lim_diff = lim_diff + hp_lim - hp_guest
        vm_req["memory"] = req_diff + overhead
        if "memory" in vm_lim:
            vm_lim["memory"] = lim_diff + overhead
    else:
        if not _overcommit_guest_overhead(vmi):
            vm_req["memory"] = vm_req.get("memory", ZERO) + overhead
        else:
            vm_req["memory"] = vm_req.get("memory", ZERO)
        if "memory" in vm_lim:
            vm_lim["memory"] = vm_lim["memory"] + overhead

    # automatic memory limit: some quota has limits.memory and the VMI sets no memory limit
    if config.auto_limits_from_quota and ns.quota_has_limits_memory and "memory" not in vmi.limits:
        req = vm_req.get("memory", ZERO)
        value = int(float(req.ceil()) * memory_limits_ratio(ns.labels))
        calc_lim["memory"] = Quantity.from_int(value, req.format)

    # device-plugin resources: virtualization devices (limits; API-server defaulting requests them), then the
    # requested ones (requests and limits)
    dw = f"{vmi.spec_path}.domain.devices"
    for name in _virtualization_devices(vmi, config, devices, dw):
        vm_lim[name] = _ONE
    for name in _requested_devices(vmi, config, devices, dw):
        have = calc_req.get(name)
        calc_req[name] = calc_lim[name] = _ONE if have is None else have + _ONE

    calc_req.update(vm_req)
    calc_lim.update(vm_lim)
    return _container(COMPUTE, calc_req, calc_lim)


KVM_DEVICE: Final = "devices.kubevirt.io/kvm"
TUN_DEVICE: Final = "devices.kubevirt.io/tun"
VHOST_NET_DEVICE: Final = "devices.kubevirt.io/vhost-net"
VHOST_VSOCK_DEVICE: Final = "devices.kubevirt.io/vhost-vsock"
SEV_DEVICE: Final = "devices.kubevirt.io/sev"
TDX_DEVICE: Final = "devices.kubevirt.io/tdx"
PR_HELPER_DEVICE: Final = "devices.kubevirt.io/pr-helper"
IOMMUFD_DEVICE: Final = "devices.kubevirt.io/iommufd"


def _virtualization_devices(vmi: VmiSpec, config: KubeVirtConfig, devices: Mapping[str, Any], dw: str) -> list[str]:
    """``getRequiredResources`` (renderresources.go, v1.2..main): ``tun`` unless the VMI has no interfaces and
    ``autoattachPodInterface: false``; ``vhost-net`` for a virtio (or model-less) interface, also the default
    pod-network one admission adds; ``kvm`` unless ``useEmulation``; ``vhost-vsock`` with ``autoattachVSOCK``."""
    interfaces = objects(devices, "interfaces", dw)
    autoattach = boolean(devices, "autoattachPodInterface", dw) is not False
    out = []
    if interfaces or autoattach:
        out.append(TUN_DEVICE)
    if not config.use_emulation:
        # SetDefaultNetworkInterface: no interfaces and no networks -> the default pod interface (no model)
        if any(i.get("model") in (None, "", "virtio") for i in interfaces) or (
            not interfaces and autoattach and not objects(vmi.spec, "networks", vmi.spec_path)
        ):
            out.append(VHOST_NET_DEVICE)
        out.append(KVM_DEVICE)
    if devices.get("autoattachVSOCK") is not None and boolean(devices, "autoattachVSOCK", dw):
        out.append(VHOST_VSOCK_DEVICE)
    return out


def _requested_devices(vmi: VmiSpec, config: KubeVirtConfig, devices: Mapping[str, Any], dw: str) -> list[str]:
    """The resources ``requestResource`` adds one of each (renderresources.go): a GPU's / host device's
    ``deviceName`` per entry (from v1.6 only entries without a DRA ``claimRequest``), ``sev`` for SEV (and SNP from
    v1.7), ``tdx`` for TDX (v1.9+), ``pr-helper`` for a LUN disk with ``reservation``, ``iommufd`` on every pod
    while the IOMMUFD gate is on (v1.9+). Multus network resources are not modelled (they need the cluster's
    NetworkAttachmentDefinitions; from v1.9 ExternalNetResourceInjection leaves them to a webhook by default)."""
    minor = config.profile.minor
    out = []
    for key in ("gpus", "hostDevices"):
        if devices.get(key) is None:
            continue
        for dev in objects(devices, key, dw):
            dname = dev.get("deviceName")
            if isinstance(dname, str) and dname and (minor < 6 or dev.get("claimRequest") is None):
                out.append(dname)
    if vmi.domain.get("launchSecurity") is not None:
        ls = mapping(vmi.domain, "launchSecurity", f"{vmi.spec_path}.domain")
        if ls.get("sev") is not None or (minor >= 7 and ls.get("snp") is not None):
            out.append(SEV_DEVICE)
        if minor >= 9 and ls.get("tdx") is not None:
            out.append(TDX_DEVICE)
    if devices.get("disks") is not None:
        for disk in objects(devices, "disks", dw):
            lun = disk.get("lun")
            if isinstance(lun, Mapping) and lun.get("reservation") is True:
                out.append(PR_HELPER_DEVICE)
                break
    if config.iommufd:
        out.append(IOMMUFD_DEVICE)
    return out


def _overcommit_guest_overhead(vmi: VmiSpec) -> bool:
    res = mapping(vmi.domain, "resources", f"{vmi.spec_path}.domain")
    return boolean(res, "overcommitGuestOverhead", f"{vmi.spec_path}.domain.resources") is True


# ---- support containers -----------------------------------------------------------------------------------------


def _support_containers(
    vmi: VmiSpec, config: KubeVirtConfig, guaranteed: bool, devices: Mapping[str, Any]
) -> tuple[list[ContainerSpec], list[ContainerSpec]]:
    """(init containers, containers) besides ``compute``, in pod order."""
    inits: list[ContainerSpec] = []
    containers: list[ContainerSpec] = []
    sw = vmi.spec_path
    dw = f"{sw}.domain.devices"
    table = config.support[guaranteed]

    def add(to: list[ContainerSpec], name: str, kind: str, init: bool = False, restartable: bool = False) -> None:
        req, lim = table[kind]
        to.append(ContainerSpec(name, dict(req), dict(lim), init=init, restartable=restartable))

    # guest-console-log: a restartable init container (sidecar), first of the init containers, from v1.6; a
    # regular container, placed after the virtiofs ones, up to v1.5 (serialconsolelog.go)
    console = config.profile.serial_console_log and _serial_console_log(devices, config, dw)
    if console and config.profile.minor >= 6:
        add(inits, "guest-console-log", "console", init=True, restartable=True)

    # containerDisks: one container per volume (+ a pre-pull init container), and the container-disk binary copier
    volumes = objects(vmi.spec, "volumes", sw)
    disk_volumes = [_volume_name(v, i, sw) for i, v in enumerate(volumes) if v.get("containerDisk") is not None]
    if _kernel_boot_image(vmi):
        disk_volumes.append("kernel-boot-volume")
    if disk_volumes and not config.image_volume:
        add(inits, "container-disk-binary", "binary", init=True)
        for vol in disk_volumes:
            add(inits, f"volume{vol}-init", "disk", init=True)
        for vol in disk_volumes:
            add(containers, f"volume{vol}", "disk")
    elif disk_volumes and config.profile.minor >= 7 and not _skips_digest_resolution(vmi, config):
        # image volumes: one no-op init container per disk exposes the image digest (v1.7+; none in v1.6)
        for vol in disk_volumes:
            add(inits, f"volume{vol}", "disk", init=True)

    # virtiofs: one container per volume shared as a filesystem
    filesystems = objects(devices, "filesystems", dw)
    if filesystems:
        fs_names = {f.get("name") for f in filesystems}
        for i, v in enumerate(volumes):
            if v.get("name") in fs_names:
                add(containers, f"virtiofs-{_volume_name(v, i, sw)}", "virtiofs")

    if console and config.profile.minor < 6:
        add(containers, "guest-console-log", "console")

    # hook sidecars (annotation) and network binding plugins that run a sidecar
    n_sidecars = _hook_sidecar_count(vmi) + _binding_sidecar_count(devices, config, dw)
    for i in range(n_sidecars):
        add(containers, f"hook-sidecar-{i}", "sidecar")
    return inits, containers


def _skips_digest_resolution(vmi: VmiSpec, config: KubeVirtConfig) -> bool:
    """``kubevirt.io/image-volume-skip-digest-resolution: "true"`` (main, after v1.9.0) drops the no-op init
    containers of image volumes."""
    return config.profile.minor > LATEST_MINOR and vmi.annotations.get(SKIP_DIGEST_RESOLUTION_ANNOTATION) == "true"


def _volume_name(volume: Mapping[str, Any], index: int, where: str) -> str:
    name = volume.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput("a volume needs a name", f"{where}.volumes[{index}].name")
    return name


def _serial_console_log(devices: Mapping[str, Any], config: KubeVirtConfig, dw: str) -> bool:
    if boolean(devices, "autoattachSerialConsole", dw) is False:
        return False
    explicit = boolean(devices, "logSerialConsole", dw)
    if explicit is not None:
        return explicit
    return not config.disable_serial_console_log


def _kernel_boot_image(vmi: VmiSpec) -> bool:
    fw = mapping(vmi.domain, "firmware", f"{vmi.spec_path}.domain")
    kb = mapping(fw, "kernelBoot", f"{vmi.spec_path}.domain.firmware")
    ct = mapping(kb, "container", f"{vmi.spec_path}.domain.firmware.kernelBoot")
    return bool(ct.get("image"))


def _hook_sidecar_count(vmi: VmiSpec) -> int:
    raw = vmi.annotations.get(HOOK_SIDECARS_ANNOTATION)
    if not raw:
        return 0
    try:
        value = json.loads(raw)
    except ValueError:
        raise InvalidInput("is not valid JSON", f"metadata.annotations.{HOOK_SIDECARS_ANNOTATION}") from None
    if value is None:  # (Go's json.Unmarshal of null into the list leaves it empty: KubeVirt renders no sidecar)
        return 0
    if not isinstance(value, list):
        raise InvalidInput("expected a JSON list of sidecars", f"metadata.annotations.{HOOK_SIDECARS_ANNOTATION}")
    return len(value)


def _binding_sidecar_count(devices: Mapping[str, Any], config: KubeVirtConfig, dw: str) -> int:
    if not config.network_binding_sidecars:
        return 0
    used: set[str] = set()
    for i, iface in enumerate(objects(devices, "interfaces", dw)):
        name = mapping(iface, "binding", f"{dw}.interfaces[{i}]").get("name")
        if name in config.network_binding_sidecars:
            used.add(name)
    return len(used)


# ---- the pod -----------------------------------------------------------------------------------------------------


def published_overhead(obj: Mapping[str, Any]) -> Quantity | None:
    """``status.memory.memoryOverhead`` of a VMI, when KubeVirt published it."""
    status = obj.get("status")
    if not isinstance(status, Mapping):
        return None
    mem = status.get("memory")
    if not isinstance(mem, Mapping) or mem.get("memoryOverhead") is None:
        return None
    try:
        return Quantity.parse(mem["memoryOverhead"])
    except InvalidInput as e:
        raise e.at("status.memory.memoryOverhead") from None


def render_launcher_pod(
    vmi: Mapping[str, Any] | VmiSpec, config: KubeVirtConfig, namespace: NamespaceFacts
) -> RenderedPod:
    """The launcher pod of a VMI (or of a VM's template). Raises :class:`InvalidInput` naming the object and field.

    When the VMI object carries ``status.memory.memoryOverhead`` (KubeVirt published the exact figure), that
    overhead is used instead of the computed one."""
    published: Quantity | None = None
    if isinstance(vmi, VmiSpec):
        spec = vmi
    else:
        spec = vmi_spec(vmi)
        if spec.kind != VM_KIND:
            try:
                published = published_overhead(vmi)
            except InvalidInput as e:
                raise e.at(spec.ref) from None
    try:
        return _render(spec, config, namespace, published)
    except InvalidInput as e:
        raise e.at(spec.ref) from None


def _render(vmi: VmiSpec, config: KubeVirtConfig, ns: NamespaceFacts, published: Quantity | None) -> RenderedPod:
    if vmi.guest_memory is None and "memory" not in vmi.requests and "memory" not in vmi.limits:
        raise InvalidInput(
            "no memory size: set memory.guest, resources.requests.memory or resources.limits.memory",
            f"{vmi.spec_path}.domain.memory.guest",
        )
    if vmi.hugepage_size is not None and not isinstance(memory_of(vmi).get("hugepages", {}).get("pageSize"), str):
        raise InvalidInput(
            "expected a page size such as 2Mi or 1Gi", f"{vmi.spec_path}.domain.memory.hugepages.pageSize"
        )
    devices = devices_of(vmi)
    vm_req = admitted_requests(vmi, config)
    guaranteed = wants_guaranteed_qos(vm_req, vmi.limits, config.profile.guaranteed_from_limits)
    if published is not None:
        overhead = published
    else:
        nanos, fmt = overhead_nanos(vmi, config, vm_req.get("memory"), guaranteed, devices)
        overhead = Quantity(nanos, fmt)
    compute = _compute(vmi, config, ns, vm_req, overhead, devices)
    inits, others = _support_containers(vmi, config, vmi.dedicated_cpus or guaranteed, devices)
    containers = (*inits, compute, *others)
    requests, limits = pod_totals(containers)
    return RenderedPod(
        containers=containers,
        requests=requests,
        limits=limits,
        memory_overhead=overhead,
        annotations={MEMORY_OVERHEAD_ANNOTATION: str(overhead.ceil())} if config.memory_overhead_report else {},
    )


# ---- hotplug attachment pods -------------------------------------------------------------------------------------

_ATTACHMENT_REQUESTS: Final = {"cpu": _Q("10m"), "memory": _Q("2M")}
_ATTACHMENT_LIMITS: Final = {"cpu": _Q("100m"), "memory": _Q("80M")}


def attachment_resources(config: KubeVirtConfig) -> tuple[ResourceList, ResourceList]:
    """(requests, limits) of the one container of a hotplug attachment pod (``hp-volume-*``, which virt-controller
    creates beside a launcher pod whose VMI has hotplugged volumes, a migration target's included:
    ``RenderHotplugAttachmentPodTemplate``): 10m CPU and 2M of memory, limited to 100m and 80M, unless
    ``supportContainerResources`` of type ``hotplug-attachment`` say otherwise (``hotplugContainerRequests``,
    ``hotplugContainerLimits``)."""
    o_req, o_lim = config.support_container_resources.get(HOTPLUG_ATTACHMENT, ({}, {}))
    requests = {r: o_req.get(r, q) for r, q in _ATTACHMENT_REQUESTS.items()}
    limits = {r: o_lim.get(r, q) for r, q in _ATTACHMENT_LIMITS.items()}
    return requests, limits


def attachment_pod_usage(config: KubeVirtConfig) -> ResourceList:
    """What quota charges a hotplug attachment pod (:func:`attachment_resources`)."""
    return quota_usage_of(*attachment_resources(config))
