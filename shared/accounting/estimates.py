"""Launcher pod estimates: the renderer's pod for a VMI snapshot (a VM's pod, a migration target, a hotplug's
growth), and how far the ``requested:`` amounts of a quota refusal may correct an estimate (:func:`evidence_bound`:
refusal amounts are evidence, not truth).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping
from fractions import Fraction
from typing import Any, Final

from shared.accounting.memo import MISS, Memo
from shared.errors import InvalidInput
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.kubevirt.render import attachment_pod_usage
from shared.podusage import quota_usage_of
from shared.quantity import Quantity
from shared.quota.modes import VmSize
from shared.resources import ResourceList, growth, is_byte_resource
from shared.snapshot import VmiSnapshot, size_digest
from shared.vmi import vmi_spec

_EVIDENCE_SHARE: Final = 8
"""A refusal amount may differ from the estimate by an eighth of it ..."""
_EVIDENCE_FLOOR_BYTES: Final = Quantity.parse("256Mi")
"""... or by this much for byte resources (memory overhead varies by KubeVirt version and configuration) ..."""
_EVIDENCE_FLOOR_CPU: Final = Quantity.parse("250m")
"""... or this much for the others but counts (support containers' CPU)."""
_COUNTS: Final = frozenset({"pods", "count/pods"})


def evidence_bound(resource: str, estimate: Quantity) -> Quantity:
    """How far a quota refusal's ``requested:`` amount of ``resource`` may be from the estimate and still replace
    it: an eighth of the estimate, at least 256Mi for byte resources and 250m for others, 0 for pod counts.
    Beyond it the amount is ignored (and reported): a tenant can write Events too."""
    share = Quantity(estimate.nanos // _EVIDENCE_SHARE, estimate.format)
    if resource in _COUNTS:
        return Quantity(0, estimate.format)
    floor = _EVIDENCE_FLOOR_BYTES if is_byte_resource(resource) else _EVIDENCE_FLOOR_CPU
    return share if share > floor else floor


def unpublished(v: VmiSnapshot) -> dict[str, Any]:
    """The VMI object without its status (and so without the overhead published for its current pod)."""
    obj = v.as_object()
    obj.pop("status", None)
    return obj


def widened(estimate: Mapping[str, Quantity]) -> ResourceList:
    """Each amount of ``estimate`` plus its :func:`evidence_bound`."""
    return {r: q + evidence_bound(r, q) for r, q in estimate.items()}


def _shrunk(resources: Mapping[str, Any], by: Mapping[str, Quantity]) -> dict[str, Any]:
    """A VMI's ``spec.domain.resources`` with each explicit ``requests``/``limits`` amount of ``by``'s resources
    that much smaller (at least 0); other values as they are (the renderer reports what it cannot read)."""
    out = dict(resources)
    for part in ("requests", "limits"):
        values = resources.get(part)
        if not isinstance(values, Mapping):
            continue
        changed = dict(values)
        for name, less in by.items():
            raw = values.get(name)
            if raw is None:
                continue
            try:
                amount = Quantity.parse(str(raw))
            except InvalidInput:
                continue
            changed[name] = Quantity(max(amount.nanos - less.nanos, 0), amount.format).canonical()
        out[part] = changed
    return out


def current_size(v: VmiSnapshot) -> VmSize:
    """The size a VM runs at now: its status where the status says (hotplug not yet handed over), else its spec."""
    return VmSize.of(
        v.status_vcpus if v.status_vcpus is not None else v.vcpus,
        v.status_guest_memory if v.status_guest_memory is not None else v.guest_memory,
        None,
        None,
    )


def facts_key(facts: NamespaceFacts) -> Hashable:
    return (tuple(sorted(facts.labels.items())), facts.quota_has_limits_cpu, facts.quota_has_limits_memory)


class Renderer:
    """Renders launcher pods of VMI snapshots for one namespace; remembers failures as errors. With ``memoize``,
    estimates are remembered per (VMI uid, resourceVersion, namespace facts) in the configuration's cache."""

    def __init__(self, config: KubeVirtConfig, facts: NamespaceFacts, memo: Memo) -> None:
        self.config = config
        self.facts = facts
        self.errors: list[str] = []
        self.memo = memo
        self.facts_key = facts_key(facts)

    def usage(self, vmi: Mapping[str, Any], ref: str) -> ResourceList | None:
        try:
            pod = render_launcher_pod(vmi, self.config, self.facts)
        except InvalidInput as e:
            self.errors.append(f"{ref}: cannot estimate its launcher pod: {e}")
            return None
        return quota_usage_of(pod.requests, pod.limits)

    def _memoized(self, v: VmiSnapshot, what: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` and the errors it reports, remembered for this VMI snapshot."""
        memo = self.memo
        slot = ("vmi", v.uid or v.name, what)
        key = (v.resource_version, v.name, self.facts_key)
        hit = memo.get_latest(slot, key, (v,))
        if hit is not MISS:
            value, errors = hit
            self.errors.extend(errors)
            return value
        n = len(self.errors)
        value = compute()
        memo.put_latest(slot, key, (v,), (value, tuple(self.errors[n:])))
        return value

    def vmi_usage(self, v: VmiSnapshot) -> ResourceList | None:
        """The launcher pod estimate of a VMI (None, with an error, when it cannot be rendered), with the overhead
        KubeVirt published for its current pod when it did. Not to be changed."""
        result: ResourceList | None = self._memoized(v, "spec", lambda: self.usage(v.as_object(), v.ref))
        return result

    def new_pod_usage(self, v: VmiSnapshot) -> ResourceList | None:
        """The estimate of a launcher pod KubeVirt has still to create for a VMI (a migration target): rendered
        from the spec as virt-controller renders every new pod, never with ``status.memory.memoryOverhead``, which
        is the current pod's figure (stale after hotplug, an upgrade or a configuration change). Not to be
        changed."""
        if v.memory_overhead is None:
            return self.vmi_usage(v)
        result: ResourceList | None = self._memoized(v, "new", lambda: self.usage(unpublished(v), v.ref))
        return result

    def attachment_usage(self) -> ResourceList:
        """What quota charges a hotplug attachment pod in this configuration. Not to be changed."""
        return attachment_pod_usage(self.config)

    def held_digest(self, v: VmiSnapshot) -> str:
        """:func:`~shared.snapshot.size_digest` of the VMI (what the guard keeps of it while its room is open)."""
        digest: str = self._memoized(v, "held", lambda: size_digest(v.spec, v.annotations))
        return digest

    def hotplug_growth(self, v: VmiSnapshot) -> ResourceList:
        """Pod-terms growth of a VMI whose spec is larger than its status (hotplug awaiting a migration): more vCPUs or
        guest memory than the status reports, or interfaces its pod does not have yet (an SR-IOV one adds
        KubeVirt's VFIO overhead)."""
        result: ResourceList = self._memoized(v, "hotplug", lambda: self._hotplug_growth(v))
        return dict(result)  # it goes into a MigrationEntry: not the remembered one

    def _hotplug_growth(self, v: VmiSnapshot) -> ResourceList:
        if not (v.fewer_vcpus or v.less_memory or v.unplugged_interfaces):
            return {}
        target = unpublished(v)  # the published overhead is the source's; compute both sides alike
        source = self._at_status(v, target, cpu=v.fewer_vcpus, memory=v.less_memory)
        if source is None:
            return {}
        after = self.usage(target, v.ref)
        before = self.usage(source, v.ref)
        if after is None or before is None:
            return {}
        return growth(after, before)

    def spec_cpu_usage(self, v: VmiSnapshot) -> ResourceList | None:
        """The launcher pod of the VMI at its spec's vCPUs and otherwise at the size it runs at (its status's guest
        memory, without interfaces its pod does not have yet): what a pod made for the spec's vCPUs has at least,
        whatever memory change or interface is pending beside them (None when it cannot be rendered)."""

        def compute() -> ResourceList | None:
            vmi = self._at_status(v, unpublished(v), cpu=False, memory=v.less_memory)
            return None if vmi is None else self.usage(vmi, v.ref)

        result: ResourceList | None = self._memoized(v, "spec-cpu", compute)
        return result

    def _at_status(self, v: VmiSnapshot, target: dict[str, Any], *, cpu: bool, memory: bool) -> dict[str, Any] | None:
        """A copy of the VMI object ``target`` made back to the size its status reports: its vCPUs (``cpu``), its
        guest memory (``memory``), and without the interfaces its pod does not have yet; None when its spec does
        not read."""
        source = copy.deepcopy(target)
        domain = source["spec"].setdefault("domain", {})
        if v.unplugged_interfaces:  # (an interface its pod does not have yet: the source is rendered without it)
            devices = domain.get("devices")
            interfaces = devices.get("interfaces") if isinstance(devices, dict) else None
            if isinstance(interfaces, list):
                drop = set(v.unplugged_interfaces)
                devices["interfaces"] = [iface for i, iface in enumerate(interfaces) if i not in drop]
        # KubeVirt grows explicit requests and limits with the hotplug (memory by the same amount, CPU by the
        # vCPUs' share at the allocation ratio): the source has them that much smaller, else a VM with explicit
        # resources would show no growth where they are what quota charges
        resources = domain.get("resources")
        shrink: dict[str, Quantity] = {}
        if cpu and v.status_vcpus is not None:
            topology = dict(domain.get("cpu") or {})
            per_socket = max(1, int(topology.get("cores") or 1) * int(topology.get("threads") or 1))
            try:
                spec = vmi_spec(target)
            except InvalidInput:
                return None  # (it does not render either: reported where it is rendered)
            pool = spec.vcpus - spec.topology.vcpus  # (the IO thread pool: both counts carry it)
            topology["sockets"] = max(1, (v.status_vcpus - pool) // per_socket)
            domain["cpu"] = topology
            share = int(Fraction(1000) // self.config.cpu_allocation_ratio)
            shrink["cpu"] = Quantity.from_milli((v.vcpus - v.status_vcpus) * share)
        if memory and v.status_guest_memory is not None and v.guest_memory is not None:
            guest = dict(domain.get("memory") or {})
            guest["guest"] = v.status_guest_memory.canonical()
            domain["memory"] = guest
            shrink["memory"] = v.guest_memory - v.status_guest_memory
        if isinstance(resources, Mapping) and shrink:
            domain["resources"] = _shrunk(resources, shrink)
        return source
