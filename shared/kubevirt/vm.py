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
from shared.kubevirt.overhead import admitted_requests
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


def with_admission_defaults(vmi: Mapping[str, Any], config: KubeVirtConfig) -> dict[str, Any]:
    """A copy of ``vmi`` with what virt-api's mutating webhook writes into a VMI at its creation, the VMI admission
    policies see (``pkg/defaults`` ``SetDefaultVirtualMachineInstanceSpec``): the resource requests
    (``requests.cpu`` from ``limits.cpu``, the cluster's ``cpuRequest`` when it is not 100m, and up to v1.6.3
    ``requests.memory``), then the guest memory (from the requests, the limits or the hugepage size), the CPU
    topology (sockets from the CPU limit, else request, when no count is set; counts of 0 dropped, as the webhook
    writes the spec back from Go) and the hotplug maxima. Raises :class:`InvalidInput` for a spec KubeVirt's
    validating webhook refuses."""
    before = vmi_spec(vmi)
    out: dict[str, Any] = copy.deepcopy(dict(vmi))
    domain = out.setdefault("spec", {}).setdefault("domain", {})
    resources = domain.setdefault("resources", {})
    requests = resources.setdefault("requests", {})
    for name, value in admitted_requests(before, config).items():
        if name not in before.requests or before.requests[name].nanos == 0:
            requests[name] = str(value)
    if not requests:
        del resources["requests"]
    if not resources:
        del domain["resources"]
    after = vmi_spec(out)  # (guest memory and topology as KubeVirt defaults them, from these requests)
    memory = domain.get("memory")
    if after.guest_memory is not None and not (isinstance(memory, dict) and memory.get("guest") is not None):
        domain["memory"] = {**(memory if isinstance(memory, dict) else {}), "guest": str(after.guest_memory)}
    cpu = domain.get("cpu") if isinstance(domain.get("cpu"), dict) else {}
    cpu = {k: v for k, v in cpu.items() if v != 0}
    if not any(cpu.get(k) for k in ("sockets", "cores", "threads")):
        topology = after.topology
        cpu = {**cpu, "sockets": topology.sockets, "cores": topology.cores, "threads": topology.threads}
    domain["cpu"] = cpu
    set_hotplug_maxima(domain, config)
    return out


def vmi_from_vm(vm: Mapping[str, Any], config: KubeVirtConfig) -> dict[str, Any]:
    """The VMI the VM controller creates: the template, with KubeVirt's admission defaults written in."""
    m = _meta(vm)
    tmpl = (vm.get("spec") or {}).get("template") or {}
    tmeta = tmpl.get("metadata") or {}
    vmi_spec(vm)  # validates; InvalidInput names the VM and field
    spec = with_admission_defaults({"spec": tmpl.get("spec") or {}}, config)["spec"]
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
