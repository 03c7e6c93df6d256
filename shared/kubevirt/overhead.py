"""KubeVirt's launcher memory overhead (``GetMemoryOverhead`` plus the network-binding terms), per version family.

The sum is computed in exact integers with the terms and order of ``pkg/hypervisor/kvm/hypervisorbackend.go``;
the ``additionalGuestMemoryOverheadRatio`` step uses float64 arithmetic exactly as Go does (``int64(float64(kB) *
(ratio - 1))``), so the figures match KubeVirt to the byte. See ``docs/rendering.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from shared.errors import InvalidInput
from shared.fields import boolean, mapping, objects, sequence
from shared.kubevirt.config import MI, RENDERER, WEBHOOK_GUEST, KubeVirtConfig
from shared.quantity import NANO, Format, Quantity
from shared.vmi import VmiSpec

_KILO_NANOS: Final = 1000 * NANO
_IOTHREAD: Final = 8 * MI
_PER_VCPU: Final = 8 * MI
_ARM64: Final = 128 * MI
_VFIO: Final = 1024 * MI
_DOWNWARD_METRICS: Final = 1 * MI
_PROBE_EACH: Final = 10 * MI
_PROBE_ONCE: Final = 100 * MI
_SEV: Final = 256 * MI
_TPM: Final = 53 * MI
_GUARANTEED: Final = 100 * MI
_PASST: Final = 250 * MI
_LEGACY_PASST: Final = 800 * MI


# ---- typed access to the raw VMI spec (errors name the field) --------------------------------------------------


def devices_of(vmi: VmiSpec) -> Mapping[str, Any]:
    return mapping(vmi.domain, "devices", f"{vmi.spec_path}.domain")


def memory_of(vmi: VmiSpec) -> Mapping[str, Any]:
    return mapping(vmi.domain, "memory", f"{vmi.spec_path}.domain")


# ---- VMI predicates (the ones in pkg/util and api/core/v1) -----------------------------------------------------


def admitted_requests(vmi: VmiSpec, config: KubeVirtConfig) -> dict[str, Quantity]:
    """``spec.domain.resources.requests`` as the stored VMI carries them after the admission webhook:
    ``requests.cpu`` from ``limits.cpu``; the cluster ``cpuRequest`` when it is not the built-in default; and,
    up to v1.6.3, ``requests.memory`` from ``limits.memory``, else guest (or hugepage size) x 100 / overcommit
    (v1.6.2: the guest size as is; its renderer overcommits)."""
    req = dict(vmi.requests)
    lim = vmi.limits
    cpu = req.get("cpu")
    if (cpu is None or cpu.nanos == 0) and "cpu" in lim and lim["cpu"].nanos != 0:
        req["cpu"] = lim["cpu"]
    cluster_cpu = config.cpu_request
    if cluster_cpu is not None and cluster_cpu != _DEFAULT_CPU_REQUEST and "cpu" not in req and not vmi.dedicated_cpus:
        req["cpu"] = cluster_cpu
    mode = config.profile.memory_request
    if mode != RENDERER:
        mem = req.get("memory")
        if (mem is None or mem.nanos == 0) and "memory" in lim and lim["memory"].nanos != 0:
            req["memory"] = lim["memory"]
        elif "memory" not in req:
            guest = vmi.guest_memory
            if guest is not None and guest.nanos > 0:
                oc = 100 if mode == WEBHOOK_GUEST else config.memory_overcommit
                req["memory"] = overcommitted(guest, oc)
    return req


def overcommitted(memory: Quantity, overcommit: int) -> Quantity:
    """``memory.Value() * 100 / overcommit`` as KubeVirt writes it (the quantity itself at 100%)."""
    return memory if overcommit == 100 else Quantity.from_int(memory.ceil() * 100 // overcommit, memory.format)


_DEFAULT_CPU_REQUEST: Final = Quantity.parse("100m")


def wants_guaranteed_qos(
    requests: Mapping[str, Quantity], limits: Mapping[str, Quantity], from_limits: bool = False
) -> bool:
    """``WantsToHaveQOSGuaranteed``: a non-zero CPU request equal to the CPU limit, and a non-zero memory request
    equal to the memory limit, or (``from_limits``, v1.6.4+) no memory request and a non-zero memory limit."""
    rm, rc = requests.get("memory"), requests.get("cpu")
    lm, lc = limits.get("memory"), limits.get("cpu")
    if rc is None or rc.nanos == 0 or lc is None or rc.nanos != lc.nanos:
        return False
    if rm is None or rm.nanos == 0:
        return from_limits and lm is not None and lm.nanos != 0
    return lm is not None and rm.nanos == lm.nanos


def is_vfio(vmi: VmiSpec, devices: Mapping[str, Any], interfaces: list[Mapping[str, Any]]) -> bool:
    """Any host device, GPU or SR-IOV interface (VFIO locks all guest RAM)."""
    dw = f"{vmi.spec_path}.domain.devices"
    if sequence(devices, "hostDevices", dw) or sequence(devices, "gpus", dw):
        return True
    return any(iface.get("sriov") is not None for iface in interfaces)


def _has_probe_exec(vmi: VmiSpec, key: str) -> bool:
    probe = mapping(vmi.spec, key, vmi.spec_path)
    return probe.get("exec") is not None


def _has_tpm(vmi: VmiSpec, devices: Mapping[str, Any]) -> bool:
    tpm = devices.get("tpm")
    if tpm is None:
        return False
    if not isinstance(tpm, Mapping):
        raise InvalidInput(f"expected an object, got {type(tpm).__name__}", f"{vmi.spec_path}.domain.devices.tpm")
    return boolean(tpm, "enabled", f"{vmi.spec_path}.domain.devices.tpm") is not False


def _has_sev(vmi: VmiSpec) -> bool:
    ls = mapping(vmi.domain, "launchSecurity", f"{vmi.spec_path}.domain")
    return ls.get("sev") is not None or ls.get("snp") is not None


def _has_downward_metrics(vmi: VmiSpec) -> bool:
    return any(v.get("downwardMetrics") is not None for v in objects(vmi.spec, "volumes", vmi.spec_path))


def _graphics(vmi: VmiSpec, devices: Mapping[str, Any]) -> bool:
    return boolean(devices, "autoattachGraphicsDevice", f"{vmi.spec_path}.domain.devices") is not False


def _reserved_overhead(vmi: VmiSpec) -> int:
    mem = memory_of(vmi)
    where = f"{vmi.spec_path}.domain.memory.reservedOverhead"
    ro = mapping(mem, "reservedOverhead", f"{vmi.spec_path}.domain.memory")
    raw = ro.get("addedOverhead")
    if raw is None:
        return 0
    try:
        return Quantity.parse(raw).nanos
    except InvalidInput as e:
        raise e.at(f"{where}.addedOverhead") from None


def _legacy_passt(vmi: VmiSpec, interfaces: list[Mapping[str, Any]]) -> int:
    """Up to v1.2 ``GetMemoryOverhead`` adds 800 Mi per legacy ``passt`` interface that forwards every port (no
    ``ports``); the binding was discontinued in v1.3 (renderresources.go, v1.2.0)."""
    dw = f"{vmi.spec_path}.domain.devices"
    return sum(
        _LEGACY_PASST
        for i, iface in enumerate(interfaces)
        if iface.get("passt") is not None and not sequence(iface, "ports", f"{dw}.interfaces[{i}]")
    )


def _network_overhead(vmi: VmiSpec, interfaces: list[Mapping[str, Any]], config: KubeVirtConfig) -> int:
    """What the network memory calculator adds after the ratio: from v1.3 ``computeResourceOverhead.requests
    .memory`` of each registered binding plugin the interfaces use, once per plugin (``netbinding/memory.go``);
    from v1.8 also 250 Mi once for a core ``passtBinding`` interface (``network/resources/memory.go``)."""
    minor = config.profile.minor
    if minor <= 2:
        return 0
    nanos = 0
    seen: set[str] = set()
    dw = f"{vmi.spec_path}.domain.devices"
    passt = False
    for i, iface in enumerate(interfaces):
        if iface.get("passtBinding") is not None:
            passt = True
        binding = mapping(iface, "binding", f"{dw}.interfaces[{i}]")
        name = binding.get("name")
        if isinstance(name, str) and name not in seen:
            seen.add(name)
            q = config.network_binding_memory.get(name)
            if q is not None:
                nanos += q.nanos
    if passt and minor >= 8:
        nanos += _PASST * NANO
    return nanos


# ---- the overhead -------------------------------------------------------------------------------------------------


def overhead_nanos(
    vmi: VmiSpec,
    config: KubeVirtConfig,
    memory_request: Quantity | None,
    guaranteed: bool,
    devices: Mapping[str, Any] | None = None,
) -> tuple[int, Format]:
    """The overhead in nano-bytes and the format Kubernetes would print it in.

    ``memory_request`` is the VMI's ``requests.memory`` (after admission, see :func:`admitted_requests`);
    ``guaranteed`` is :func:`wants_guaranteed_qos` of the admitted VMI; ``devices`` is
    ``spec.domain.devices`` when the caller has it already."""
    prof = config.profile
    if devices is None:
        devices = devices_of(vmi)
    interfaces = objects(devices, "interfaces", f"{vmi.spec_path}.domain.devices")
    # page tables: one bit per 512 B of the requested RAM, on the request rounded up to kB
    kilo = -((-memory_request.nanos) // _KILO_NANOS) if memory_request is not None else 0
    pagetables = kilo * 1000 // 512 if kilo > 0 else 0
    total = pagetables + prof.fixed_overhead + _PER_VCPU * max(1, vmi.topology.vcpus) + _IOTHREAD
    if _graphics(vmi, devices):
        total += prof.video_overhead
    arch = vmi.spec.get("architecture") or config.arch
    if arch == "arm64":
        total += _ARM64
    if is_vfio(vmi, devices, interfaces):
        total += _VFIO
    if _has_downward_metrics(vmi):
        total += _DOWNWARD_METRICS
    liveness, readiness = _has_probe_exec(vmi, "livenessProbe"), _has_probe_exec(vmi, "readinessProbe")
    if liveness or readiness:
        total += _PROBE_ONCE + _PROBE_EACH * (liveness + readiness)
    if _has_sev(vmi):
        total += _SEV
    if _has_tpm(vmi, devices):
        total += _TPM
    if prof.minor <= 2:
        total += _legacy_passt(vmi, interfaces)
    # the +100 Mi of dedicated CPUs / Guaranteed QoS: after the ratio up to v1.5.2, before it from v1.5.3
    extra = _GUARANTEED if vmi.dedicated_cpus or guaranteed else 0
    if prof.guaranteed_before_ratio:
        total += extra
    nanos = total * NANO
    if prof.reserved_overhead:
        nanos += _reserved_overhead(vmi)
    ratio = config.overhead_ratio
    if ratio is not None:
        kb = -((-nanos) // _KILO_NANOS)
        nanos += int(float(kb) * (ratio - 1.0)) * _KILO_NANOS
    if not prof.guaranteed_before_ratio:
        nanos += extra * NANO
    nanos += _network_overhead(vmi, interfaces, config)
    return nanos, (Format.DECIMAL_SI if pagetables > 0 else Format.BINARY_SI)


def memory_overhead(vmi: VmiSpec, config: KubeVirtConfig) -> Quantity:
    """The memory KubeVirt adds for a VMI's launcher (what the pod annotation ``kubevirt.io/memory-overhead-bytes``
    publishes): ``GetMemoryOverhead`` of the version family, then passt / binding-plugin memory."""
    req = admitted_requests(vmi, config)
    try:
        guaranteed = wants_guaranteed_qos(req, vmi.limits, config.profile.guaranteed_from_limits)
        nanos, fmt = overhead_nanos(vmi, config, req.get("memory"), guaranteed)
    except InvalidInput as e:
        raise e.at(vmi.ref) from None
    return Quantity(nanos, fmt)
