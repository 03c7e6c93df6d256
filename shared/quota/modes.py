"""Accounting modes: what one VM counts against a managed ResourceQuota, in ResourceQuota resource names.

The four mode names are public API (the first three follow KubeVirt AAQ's names and meanings):

* ``VmiPodUsage`` — a VM counts as its launcher pod's usage, overhead included (the same numbers the native
  quota evaluator charges);
* ``VirtualResources`` — ``cpu``/``requests.cpu``/``limits.cpu`` = vCPUs, ``memory``/``requests.memory``/
  ``limits.memory`` = guest memory, ``pods``/``count/pods`` = 1;
* ``DedicatedVirtualResources`` — ``instances/vmi``, ``cpu/vmi``, ``memory/vmi`` and their ``requests.`` forms
  (1, vCPUs, guest memory); reported, never charged by the native evaluator;
* ``VirtualResourcesWithCPUAllocationRatio`` — as ``VirtualResources`` but ``cpu``/``requests.cpu`` = vCPUs /
  ratio, written exactly as virt-controller writes the launcher's CPU request for that ratio.

Resources a VM-term mode does not define (hugepages, ephemeral storage, extended resources such as GPUs, and
anything else the launcher pod is charged) count at the launcher pod's usage, so a VM-term quota can still
budget them (AAQ drops them). A VM counts at the larger of its spec and status sizes (hotplug).

Also here: how a managed ResourceQuota states its mode (:class:`QuotaPolicy`, read from the quota's label and
annotations) and, per mode and resource, the least ratio between what the launcher pod is charged and what the
mode counts (:func:`pod_factor`), which the quota equation uses to express mode headroom in pod terms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Final

from shared.errors import InvalidInput
from shared.kubevirt.render import cpu_request as kubevirt_cpu_request
from shared.quantity import Format, Quantity
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL, MODE_ANNOTATION, RATIO_ANNOTATION
from shared.resources import ResourceList, is_quota_resource_name, parse_resource_list
from shared.snapshot import QuotaSnapshot


class Mode(StrEnum):
    VMI_POD_USAGE = "VmiPodUsage"
    VIRTUAL_RESOURCES = "VirtualResources"
    DEDICATED_VIRTUAL_RESOURCES = "DedicatedVirtualResources"
    VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO = "VirtualResourcesWithCPUAllocationRatio"


MODE_NAMES: Final = tuple(m.value for m in Mode)
DEFAULT_MODE: Final = Mode.VMI_POD_USAGE
VM_TERM_MODES: Final = frozenset({Mode.VIRTUAL_RESOURCES.value, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO.value})
"""The modes whose quotas the reservation guard's ``vmquota-vm-terms`` policy reads (its match condition)."""


CEL_SPACE: Final = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
"""What CEL's ``trim()`` strips in Kubernetes (Go's ``unicode.IsSpace``). Python's ``str.strip()`` strips more
(``\x1c`` to ``\x1f`` too): an annotation the reservation guard's policy reads with ``trim()`` is read the same way
here, or the enforcer and the policy would disagree about what the quota says."""


def cel_trim(text: str) -> str:
    """``text`` as CEL's ``trim()`` leaves it."""
    return text.strip(CEL_SPACE)


def parse_mode(text: object, where: str = "mode") -> Mode:
    """A mode by its exact public name (around it, what CEL's ``trim()`` strips); InvalidInput listing the valid
    names otherwise."""
    if isinstance(text, str):
        try:
            return Mode(cel_trim(text))
        except ValueError:
            pass
    raise InvalidInput(f"unknown accounting mode {text!r} (expected one of {', '.join(MODE_NAMES)})", where)


# ---- resource names --------------------------------------------------------------------------------------------

CPU_REQUEST_NAMES: Final = frozenset({"cpu", "requests.cpu"})
CPU_LIMIT_NAMES: Final = frozenset({"limits.cpu"})
MEMORY_NAMES: Final = frozenset({"memory", "requests.memory", "limits.memory"})
POD_COUNT_NAMES: Final = frozenset({"pods", "count/pods"})
VMI_INSTANCE_NAMES: Final = frozenset({"instances/vmi", "requests.instances/vmi"})
VMI_CPU_NAMES: Final = frozenset({"cpu/vmi", "requests.cpu/vmi"})
VMI_MEMORY_NAMES: Final = frozenset({"memory/vmi", "requests.memory/vmi"})
VMI_NAMES: Final = VMI_INSTANCE_NAMES | VMI_CPU_NAMES | VMI_MEMORY_NAMES
"""Resource names only DedicatedVirtualResources counts; the native pod evaluator never charges them."""

_VIRTUAL: Final = CPU_REQUEST_NAMES | CPU_LIMIT_NAMES | MEMORY_NAMES | POD_COUNT_NAMES

DEFINED_RESOURCES: Final[Mapping[Mode, frozenset[str]]] = {
    Mode.VMI_POD_USAGE: frozenset(),
    Mode.VIRTUAL_RESOURCES: _VIRTUAL,
    Mode.DEDICATED_VIRTUAL_RESOURCES: VMI_NAMES,
    Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO: _VIRTUAL,
}
"""Per mode, the resource names it defines in VM terms; every other name counts at the launcher pod's usage."""


def is_report_only(resource: str) -> bool:
    """A resource no pod is ever charged for by the native quota evaluator (the ``/vmi`` names)."""
    return resource in VMI_NAMES


# ---- the size of a VM ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VmSize:
    """vCPUs and guest memory a VM counts at: the larger of its spec and its status (after hotplug)."""

    vcpus: int
    guest_memory: Quantity

    @classmethod
    def of(
        cls, spec_vcpus: int, spec_guest: Quantity | None, status_vcpus: int | None, status_guest: Quantity | None
    ) -> VmSize:
        vcpus = max(spec_vcpus, status_vcpus or 0)
        guest = spec_guest if spec_guest is not None else Quantity(0, Format.BINARY_SI)
        if status_guest is not None and status_guest > guest:
            guest = status_guest
        return cls(vcpus, guest.with_format(Format.BINARY_SI))


def mode_usage(mode: Mode, size: VmSize, pod: Mapping[str, Quantity], cpu_allocation_ratio: Fraction) -> ResourceList:
    """What one VM counts in ``mode``'s terms.

    ``pod`` is the launcher pod's quota usage (the real pod's, or the estimate while it does not exist yet; during a
    migration the per-resource maximum of source and target); resources the mode does not define are taken from
    it. ``cpu_allocation_ratio`` matters only for ``VirtualResourcesWithCPUAllocationRatio``.
    """
    defined = DEFINED_RESOURCES[mode]
    out: ResourceList = {k: v for k, v in pod.items() if k not in defined}
    if mode is Mode.VMI_POD_USAGE:
        return out
    vcpus = Quantity.from_int(size.vcpus)
    one = Quantity.from_int(1)
    if mode is Mode.DEDICATED_VIRTUAL_RESOURCES:
        for name in VMI_INSTANCE_NAMES:
            out[name] = one
        for name in VMI_CPU_NAMES:
            out[name] = vcpus
        for name in VMI_MEMORY_NAMES:
            out[name] = size.guest_memory
        return out
    cpu_request = vcpus
    if mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO:
        cpu_request = kubevirt_cpu_request(size.vcpus, cpu_allocation_ratio)
    for name in CPU_REQUEST_NAMES:
        out[name] = cpu_request
    out["limits.cpu"] = vcpus
    for name in MEMORY_NAMES:
        out[name] = size.guest_memory
    for name in POD_COUNT_NAMES:
        out[name] = one
    return out


def pod_factor(
    mode: Mode, resource: str, *, kubevirt_ratio: Fraction, memory_overcommit: int, mode_ratio: Fraction
) -> Fraction | None:
    """The least ``pod charge / mode usage`` of ``resource`` for a VM rendered by KubeVirt, capped at 1.

    ``None`` for a resource no pod is charged for (report only). A factor below 1 means the mode counts more than
    the native evaluator charges the launcher pod (``VirtualResources`` counts vCPUs while the pod requests
    vCPUs / ``kubevirt_ratio``; guest memory while the pod requests guest x 100 / ``memory_overcommit`` plus
    overhead; a quota ratio below KubeVirt's); the equation then scales the mode headroom by it, so that a VM
    refused in mode terms is refused by native admission too (see ``docs/accounting.md``).
    """
    if is_report_only(resource):
        return None
    if resource not in DEFINED_RESOURCES[mode]:
        return Fraction(1)
    if resource in CPU_REQUEST_NAMES:
        counted = Fraction(1) if mode is Mode.VIRTUAL_RESOURCES else 1 / mode_ratio
        return min(Fraction(1), (1 / kubevirt_ratio) / counted)
    if resource in MEMORY_NAMES:
        return min(Fraction(1), Fraction(100, memory_overcommit))
    return Fraction(1)


def vmi_minimums(
    mode: Mode,
    budget: Mapping[str, Quantity],
    factors: Mapping[str, Fraction | None],
    ratio: Fraction,
    *,
    request_overcommit: Fraction = Fraction(1),
) -> dict[str, str]:
    """What a VMI's explicit ``spec.domain.resources`` must be at least, per unit of its size, for its launcher pod
    to be charged at least ``k`` times what the mode counts it (the reservation guard's rendering-model policy
    refuses a VMI below them). ``requests.memory`` and ``limits.memory`` per byte of guest memory,
    ``requests.cpu`` and ``limits.cpu`` per vCPU; only for the resources the budget names in VM terms. Decimals
    rounded down: the pod's overhead is the margin, and KubeVirt's own default request (guest x 100 / overcommit)
    must pass. A cluster-wide ``cpuRequest`` (KubeVirt gives every VMI without one that flat request, whatever its
    vCPUs) makes no exception: a VMI of more vCPUs than the flat request covers is below the minimum, else any such
    VM would be cheaper than ``k`` assumes.
    ``request_overcommit``: what KubeVirt divides an explicit memory request by when it renders the pod (v1.6.2
    overcommits whatever request a VMI has: ``memoryOvercommit / 100``), so the request must be that much larger."""
    if mode not in (Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO):
        return {}
    counted_cpu = Fraction(1) if mode is Mode.VIRTUAL_RESOURCES else 1 / ratio  # (what a vCPU counts)
    out: dict[str, Fraction] = {}
    for r in budget:
        k = factors.get(r)
        if k is None:
            continue
        if r in ("memory", "requests.memory"):
            out["requests.memory"] = k * request_overcommit  # (memory and requests.memory share one factor)
        elif r == "limits.memory":
            out["limits.memory"] = k
        elif r in CPU_REQUEST_NAMES:
            out["requests.cpu"] = k * counted_cpu
        elif r == "limits.cpu":
            out["limits.cpu"] = k
    return {r: _decimal_down(v) for r, v in sorted(out.items())}


def _decimal_down(v: Fraction) -> str:
    micro = (v.numerator * 1_000_000) // v.denominator
    whole, frac = divmod(micro, 1_000_000)
    return f"{whole}.{frac:06d}".rstrip("0").rstrip(".") if frac else str(whole)


# ---- a managed quota's policy ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScopeRequirement:
    """One ``spec.scopeSelector.matchExpressions`` entry (or a plain ``spec.scopes`` entry: operator Exists)."""

    scope: str
    operator: str = "Exists"
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class QuotaPolicy:
    """How one managed ResourceQuota accounts: its mode, its budget ``B`` and its own CPU allocation ratio (None: the
    KubeVirt CR's). Managed quotas are unscoped (:func:`quota_policy`): every pod of the namespace is in ``P``."""

    name: str
    mode: Mode
    budget: ResourceList = field(default_factory=dict)
    cpu_allocation_ratio: Fraction | None = None

    def ratio(self, kubevirt_ratio: Fraction) -> Fraction:
        return self.cpu_allocation_ratio if self.cpu_allocation_ratio is not None else kubevirt_ratio


def ratio_text(ratio: Fraction | None) -> str:
    """A quota's own CPU allocation ratio as usage terms carry it (``"4"``, ``"5/2"``; empty: none)."""
    return "" if ratio is None else str(ratio)


def parse_ratio(raw: object, where: str) -> Fraction:
    """A positive CPU allocation ratio (``"4"``, ``"2.5"``, ``4``)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, str, Fraction)):
        raise InvalidInput(f"expected a positive number, got {raw!r}", where)
    try:
        text = cel_trim(str(raw))
        if text != text.strip():  # (whitespace CEL's trim() keeps, which Fraction would skip)
            raise ValueError
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise InvalidInput(f"expected a positive number, got {raw!r}", where) from None
    if value <= 0 or value > 1000:
        raise InvalidInput(f"must be greater than 0 and at most 1000, got {raw!r}", where)
    return value


MAX_BUDGET_RESOURCES: Final = 128
"""Most resources a managed quota's budget may name. Kubernetes knows about 20 standard quota resources; beyond
them, ``count/<resource>``, extended and storage-class names. vmquota copies the budget into two annotations of
the quota, and every quota version travels the bus as one message: a bound keeps both small."""


def parse_budget(raw: str, where: str) -> ResourceList:
    try:
        data = json.loads(raw)
    except ValueError:
        raise InvalidInput("expected a JSON object of resource names to quantities", where) from None
    budget = parse_resource_list(data, where)
    check_budget(budget, where)
    return budget


def check_budget(budget: Mapping[str, Quantity], where: str) -> None:
    """InvalidInput when a budget names a resource a ResourceQuota cannot hold (Kubernetes'
    ``ValidateResourceQuotaResourceName``: a typo such as ``limits.memroy``, non-ASCII) or more than
    :data:`MAX_BUDGET_RESOURCES` resources: such a budget is refused, never written into ``spec.hard``."""
    if len(budget) > MAX_BUDGET_RESOURCES:
        raise InvalidInput(
            f"the budget names {len(budget)} resources, more than the {MAX_BUDGET_RESOURCES} vmquota manages", where
        )
    for name in budget:
        if not is_quota_resource_name(name):
            shown = name if len(name) <= 80 else name[:77] + "..."
            raise InvalidInput(
                f"{shown!r} is not a ResourceQuota resource name (a standard one such as limits.memory or "
                "requests.cpu, hugepages-<size>, or a qualified name with a '/')",
                f"{where}.{shown}",
            )


def is_managed(labels: Mapping[str, str]) -> bool:
    """Opted in: the label ``vmquota.io/managed`` is exactly ``true``, as the reservation guard's label selectors
    match it (a ``True`` would be managed here and unguarded there)."""
    return labels.get(MANAGED_LABEL) == "true"


def quota_policy(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec_hard: Mapping[str, Quantity],
    scopes: tuple[ScopeRequirement, ...] = (),
    *,
    ref: str = "",
    scope_field: str = "spec.scopes",
) -> QuotaPolicy | None:
    """The policy of a ResourceQuota, or None when it is not opted in. The budget is the annotation when present,
    else ``spec.hard`` as the administrator wrote it. InvalidInput names the quota and the annotation."""
    if not is_managed(labels):
        return None
    ref = ref or f"ResourceQuota {name}"
    where = f"{ref}: metadata.annotations"
    mode = parse_mode(annotations.get(MODE_ANNOTATION, DEFAULT_MODE.value), f"{where}.{MODE_ANNOTATION}")
    ratio: Fraction | None = None
    if annotations.get(RATIO_ANNOTATION) is not None:
        ratio = parse_ratio(annotations[RATIO_ANNOTATION], f"{where}.{RATIO_ANNOTATION}")
    if annotations.get(BUDGET_ANNOTATION) is not None:
        budget = parse_budget(annotations[BUDGET_ANNOTATION], f"{where}.{BUDGET_ANNOTATION}")
    else:
        budget = dict(spec_hard)
        check_budget(budget, f"{ref}: spec.hard")
    if scopes:
        # One rule for the ledger and the enforcer: a VM namespace's compute quota is unscoped. (A scoped managed
        # quota would make admission depend on which pods its scope selects, and native quota still charges the
        # VM's pods to the unscoped quotas beside it.)
        listed = ", ".join(s.scope for s in scopes)
        raise InvalidInput(
            f"scoped quotas are not managed (scopes: {listed}); use an unscoped quota for VMs",
            f"{ref}: {scope_field}",
        )
    return QuotaPolicy(name=name, mode=mode, budget=budget, cpu_allocation_ratio=ratio)


# ---- a quota snapshot's policy ---------------------------------------------------------------------------------


def quota_scopes(q: QuotaSnapshot) -> tuple[ScopeRequirement, ...]:
    out = [ScopeRequirement(s) for s in q.scopes]
    out += [ScopeRequirement(s.scope_name, s.operator, tuple(s.values)) for s in q.scope_selector]
    return tuple(out)


def policy_or_error(q: QuotaSnapshot) -> QuotaPolicy | str | None:
    """:func:`policy_of`, or why the quota's annotations give none (to compare two versions of a quota)."""
    try:
        return policy_of(q)
    except InvalidInput as e:
        return str(e)


def policy_changed(a: QuotaSnapshot, b: QuotaSnapshot) -> bool:
    """Whether two versions of a quota give different policies, or reasons for none. A version that changed nothing
    a policy is read from (a write of its status, quota admission's at each pod) gives the same, and is not read."""
    if (a.name, a.labels, a.annotations, a.spec_hard, a.scopes, a.scope_selector) == (
        b.name,
        b.labels,
        b.annotations,
        b.spec_hard,
        b.scopes,
        b.scope_selector,
    ):
        return False
    return policy_or_error(a) != policy_or_error(b)


def policy_of(q: QuotaSnapshot) -> QuotaPolicy | None:
    """The policy of a managed quota snapshot (None when not opted in); InvalidInput on bad annotations."""
    return quota_policy(
        q.name,
        q.labels,
        q.annotations,
        q.spec_hard,
        quota_scopes(q),
        ref=q.ref,
        scope_field="spec.scopes" if q.scopes else "spec.scopeSelector",
    )
