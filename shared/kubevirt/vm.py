"""What KubeVirt's VM controller does with a ``VirtualMachine``: whether it runs (its run strategy) and the VMI it
creates from the template, with KubeVirt's admission defaults written in (``pkg/virt-controller/watch/vm.go``,
``setupVMIFromVM``; defaults from ``pkg/virt-api/webhooks/mutating-webhook``). Used by the simulated cluster's VM
controller and by ``vmquota usage`` for VMs that have no VMI yet."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

from shared.errors import InvalidInput
from shared.kinds import VMI_KIND
from shared.kubevirt.config import KubeVirtConfig
from shared.quantity import Format, Quantity
from shared.vmi import vmi_spec

API_VERSION: Final = "kubevirt.io/v1"
RUN_STRATEGIES: Final = ("Always", "Halted", "Manual", "RerunOnFailure", "Once", "WaitAsReceiver")
STARTING_STRATEGIES: Final = frozenset({"Always", "RerunOnFailure", "Once"})
"""The run strategies under which the VM controller creates a VMI for a VM that has none."""


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    m = obj.get("metadata")
    return m if isinstance(m, Mapping) else {}


def run_strategy(vm: Mapping[str, Any]) -> str:
    """The effective run strategy: ``spec.running`` true → Always, false → Halted; default Halted."""
    spec = vm.get("spec") or {}
    running, strategy = spec.get("running"), spec.get("runStrategy")
    if running is not None and strategy is not None:
        raise InvalidInput("Running and RunStrategy are mutually exclusive", "spec.running")
    if running is not None:
        if not isinstance(running, bool):
            raise InvalidInput(f"expected true or false, got {running!r}", "spec.running")
        return "Always" if running else "Halted"
    if strategy is None:
        return "Halted"
    if strategy not in RUN_STRATEGIES:
        raise InvalidInput(
            f"unknown run strategy {strategy!r} (expected one of {', '.join(RUN_STRATEGIES)})", "spec.runStrategy"
        )
    return str(strategy)


def owner_ref(obj: Mapping[str, Any], *, controller: bool = True) -> dict[str, Any]:
    """The ownerReference to ``obj`` a controller sets on what it creates for it."""
    return {
        "apiVersion": obj.get("apiVersion") or API_VERSION,
        "kind": obj.get("kind"),
        "name": _meta(obj).get("name"),
        "uid": _meta(obj).get("uid"),
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def _int(raw: object) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else 0


MAX_HOTPLUG_RATIO: Final = 4
"""KubeVirt's default ``maxHotplugRatio``: a VM may be hotplugged to four times its sockets and guest memory."""
MAX_HOTPLUG_VCPUS: Final = 512
"""The most vCPUs KubeVirt's default ``maxSockets`` allows (``setupCPUHotplug``: any machine type's bound)."""


def set_hotplug_maxima(domain: dict[str, Any], config: KubeVirtConfig) -> None:
    """KubeVirt's hotplug defaults under its ``LiveUpdate`` rollout strategy (the default from v1.6 here), written
    into a VMI's ``spec.domain`` where unset (``pkg/defaults`` ``setupCPUHotplug``/``setupMemoryHotplug``):
    ``cpu.maxSockets`` four times the sockets, lowered to stay within 512 vCPUs but never below the sockets, and
    ``memory.maxGuest`` four times the guest memory."""
    if config.profile.minor < 6:
        return
    cpu = domain.get("cpu")
    if isinstance(cpu, dict) and not _int(cpu.get("maxSockets")) and _int(cpu.get("sockets")):
        sockets = _int(cpu.get("sockets"))  # (no sockets, no maximum: upstream multiplies the 0)
        per_socket = max(1, _int(cpu.get("cores"))) * max(1, _int(cpu.get("threads")))
        most = sockets * MAX_HOTPLUG_RATIO
        if most * per_socket > MAX_HOTPLUG_VCPUS:
            most = max(MAX_HOTPLUG_VCPUS // per_socket, sockets)
        cpu["maxSockets"] = most
    memory = domain.get("memory")
    if isinstance(memory, dict) and memory.get("guest") is not None and not memory.get("maxGuest"):
        guest = Quantity.parse(memory["guest"])
        memory["maxGuest"] = guest.scale(MAX_HOTPLUG_RATIO).with_format(Format.BINARY_SI).canonical()


def vmi_from_vm(vm: Mapping[str, Any], config: KubeVirtConfig) -> dict[str, Any]:
    """The VMI the VM controller creates: the template with KubeVirt's admission defaults written in."""
    m = _meta(vm)
    tmpl = (vm.get("spec") or {}).get("template") or {}
    tmeta = tmpl.get("metadata") or {}
    spec: dict[str, Any] = copy.deepcopy(dict(tmpl.get("spec") or {}))
    size = vmi_spec(vm)  # validates; InvalidInput names the VM and field
    domain = spec.setdefault("domain", {})
    cpu = domain.setdefault("cpu", {})
    if not (_int(cpu.get("sockets")) or _int(cpu.get("cores")) or _int(cpu.get("threads"))):
        cpu["sockets"], cpu["cores"], cpu["threads"] = size.topology.sockets, size.topology.cores, size.topology.threads
    else:
        for k in ("sockets", "cores", "threads"):
            cpu.setdefault(k, 1)
    memory = domain.setdefault("memory", {})
    if memory.get("guest") is None and size.guest_memory is not None:
        memory["guest"] = size.guest_memory.canonical()
    set_hotplug_maxima(domain, config)
    return {
        "apiVersion": API_VERSION,
        "kind": VMI_KIND,
        "metadata": {
            "name": m.get("name"),
            "namespace": m.get("namespace"),
            "labels": dict(tmeta.get("labels") or {}),
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [owner_ref(vm)],
        },
        "spec": spec,
    }
