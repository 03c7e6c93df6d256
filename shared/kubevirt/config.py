"""KubeVirt cluster configuration as the launcher-pod renderer needs it, and the constants of each version family.

:class:`KubeVirtConfig` is built from the KubeVirt CR (:meth:`KubeVirtConfig.from_cr`) or directly; it validates
its values on construction (``InvalidInput``) and pre-computes what every render would otherwise recompute
(the version profile, byte constants, parsed support-container resources), so rendering stays cheap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, Final

from shared.errors import InvalidInput
from shared.fields import boolean, mapping, string
from shared.quantity import Quantity
from shared.resources import ResourceList, parse_resource_list

MI: Final = 1024 * 1024

DEFAULT_VERSION: Final = "v1.9"
AUTO_RESOURCE_LIMITS_GATE: Final = "AutoResourceLimitsGate"
IMAGE_VOLUME_GATE: Final = "ImageVolume"
MEMORY_OVERHEAD_REPORT_GATE: Final = "VmiMemoryOverheadReport"
IOMMUFD_GATE: Final = "IOMMUFD"

# The state of the feature gates that shape launcher pods, by the minor version from which it holds
# (``pkg/virt-config/featuregate/active.go`` and ``inactive.go`` at each tag; main counts as 99). A gate not yet
# registered in a version is off there.
_GATE_STATES: Final[Mapping[str, tuple[tuple[int, str], ...]]] = {
    IMAGE_VOLUME_GATE: ((6, "Alpha"), (7, "Beta")),
    MEMORY_OVERHEAD_REPORT_GATE: ((8, "Alpha"), (9, "Beta"), (99, "GA")),
    IOMMUFD_GATE: ((9, "Alpha"),),
}


def gate_state(gate: str, minor: int) -> str | None:
    """The state (``Alpha``, ``Beta``, ``GA``) of a feature gate in a minor version; None when not registered."""
    state = None
    for since, value in _GATE_STATES.get(gate, ()):
        if minor >= since:
            state = value
    return state


# supportContainerResources types (``v1.SupportContainerType``)
CONTAINER_DISK: Final = "containerDisk"
VIRTIOFS: Final = "virtiofs"
GUEST_CONSOLE_LOG: Final = "guest-console-log"
HOTPLUG_ATTACHMENT: Final = "hotplug-attachment"
SIDECAR: Final = "sidecar"
VMEXPORT: Final = "vmexport"
SUPPORT_CONTAINER_TYPES: Final = frozenset(
    {CONTAINER_DISK, VIRTIOFS, GUEST_CONSOLE_LOG, HOTPLUG_ATTACHMENT, SIDECAR, VMEXPORT}
)


# how the memory request of a VMI without one comes about (``VersionProfile.memory_request``)
WEBHOOK: Final = "webhook"
"""The VMI admission webhook writes ``requests.memory``: ``limits.memory``, else guest (or the hugepage size) x
100 / memoryOvercommit (``pkg/defaults`` ``setDefaultResourceRequests``, v1.0 .. v1.6.1 and v1.6.3)."""
WEBHOOK_GUEST: Final = "webhook-guest"
"""v1.6.2: the webhook writes ``limits.memory``, else the guest size, and the renderer then scales whatever memory
request the VMI has by 100 / memoryOvercommit (``WithMemoryOvercommit``), before anything else."""
RENDERER: Final = "renderer"
"""v1.6.4+: the VMI keeps no memory request; the renderer derives it for every VMI that has none (dedicated CPUs
and hugepages too): ``limits.memory``, else guest (or the hugepage size) x 100 / memoryOvercommit
(``WithMemoryRequests``, run first)."""

LATEST_PATCH: Final[Mapping[int, int]] = {0: 3, 1: 2, 2: 2, 3: 1, 4: 1, 5: 3, 6: 6, 7: 4, 8: 4, 9: 0}
"""The newest patch release of each minor this build was checked against: a bare ``v1.N`` means it."""


@dataclass(frozen=True, slots=True)
class VersionProfile:
    """What differs between KubeVirt releases, as far as launcher-pod resources go."""

    name: str
    """The releases that render alike: ``v1.0`` .. ``v1.9``, the v1.5 patch groups (``v1.5.0-v1.5.1``, ``v1.5.2``,
    ``v1.5.3+``), the v1.6 ones (``v1.6.0-v1.6.1``, ``v1.6.2``, ``v1.6.3``, ``v1.6.4+``) or ``main``."""
    minor: int
    """The minor version (``main`` counts as 99)."""
    patch: int
    """The patch release (a bare minor, and ``main``, count as the newest)."""
    fixed_overhead: int
    """virt-launcher-monitor + virt-launcher + virtlogd + virtqemud + qemu, in bytes."""
    video_overhead: int
    """Video RAM, in bytes (unless ``autoattachGraphicsDevice: false``)."""
    reserved_overhead: bool
    """``spec.domain.memory.reservedOverhead.addedOverhead`` is added (v1.8+)."""
    memory_request: str
    """How a VMI without a memory request gets one: :data:`WEBHOOK`, :data:`WEBHOOK_GUEST` or :data:`RENDERER`.
    What the webhook writes is part of the VMI, so the page-table term and the Guaranteed-QoS test see it."""
    pool_in_cpu: bool
    """The supplemental IO-thread pool counts like vCPUs in the CPU request and limits (v1.5.2+, "renderresources:
    fix cpu calculation"); before, v1.5.0-v1.5.1 add it to the CPU limit only (``WithIOThreads``)."""
    guaranteed_before_ratio: bool
    """The +100 Mi of dedicated CPUs / Guaranteed QoS is added before ``additionalGuestMemoryOverheadRatio`` (so it
    is scaled): v1.5.3+ (backported into release-1.5) and v1.6+; after it before."""
    guaranteed_from_limits: bool
    """``WantsToHaveQOSGuaranteed`` counts memory as wanting Guaranteed QoS also when only ``limits.memory`` is set
    (v1.6.4+; before, the webhook had copied the limit into the request)."""
    auto_limits: str
    """When a ResourceQuota with ``limits.*`` triggers automatic limits: ``never`` (v1.0), ``gate``
    (AutoResourceLimitsGate, v1.1-v1.4) or ``always`` (v1.5+)."""
    serial_console_log: bool
    """The ``guest-console-log`` container exists (v1.1+)."""


LATEST_MINOR: Final = 9
"""The latest KubeVirt release this build has a profile for: v1.9."""
_VERSION_RE: Final = re.compile(r"^v?1\.(\d+)(?:\.(\d+)(?:[-+][0-9A-Za-z.+-]*)?)?\Z")


def _name(minor: int, patch: int) -> str:
    """The releases that render alike, named (``VersionProfile.name``)."""
    if minor > LATEST_MINOR:
        return "main"
    if minor == 5:
        return "v1.5.0-v1.5.1" if patch <= 1 else ("v1.5.2" if patch == 2 else "v1.5.3+")
    if minor == 6:
        return "v1.6.0-v1.6.1" if patch <= 1 else (f"v1.6.{patch}" if patch <= 3 else "v1.6.4+")
    return f"v1.{minor}"


def _family(minor: int, patch: int) -> VersionProfile:
    release = (minor, patch)
    memory_request = WEBHOOK_GUEST if release == (6, 2) else (RENDERER if release >= (6, 4) else WEBHOOK)
    return VersionProfile(
        name=_name(minor, patch),
        minor=minor,
        patch=patch,
        fixed_overhead=(25 + 100 + (20 if minor <= 4 else 25) + (35 if minor <= 4 else 40) + (30 if minor <= 9 else 50))
        * MI,
        video_overhead=(16 if minor <= 5 else 32) * MI,
        reserved_overhead=minor >= 8,
        memory_request=memory_request,
        pool_in_cpu=release >= (5, 2),
        guaranteed_before_ratio=release >= (5, 3),
        guaranteed_from_limits=release >= (6, 4),
        auto_limits="never" if minor == 0 else ("gate" if minor <= 4 else "always"),
        serial_console_log=minor >= 1,
    )


@lru_cache(maxsize=64)
def profile(version: str) -> VersionProfile:
    """The profile of a KubeVirt version: ``v1.0`` .. ``v1.9`` (a bare minor is its newest patch release,
    :data:`LATEST_PATCH`), a release such as ``v1.6.2`` or ``1.9.0`` (also a pre-release, ``v1.6.0-rc.1``, as
    its patch), or ``main``. Anything else is :class:`InvalidInput`."""
    if not isinstance(version, str):
        raise InvalidInput(f"expected a version string, got {type(version).__name__}", "version")
    v = version.strip()
    if v == "main":
        return _family(99, 99)
    m = _VERSION_RE.match(v)
    if m is None or int(m.group(1)) > LATEST_MINOR:
        raise InvalidInput(
            f"unsupported KubeVirt version {version!r} (expected v1.0 .. v1.{LATEST_MINOR}, a release such as "
            f"v1.6.4, or main)",
            "version",
        )
    minor = int(m.group(1))
    return _family(minor, int(m.group(2)) if m.group(2) is not None else LATEST_PATCH[minor])


def newer_than_known(version: str) -> bool:
    """Whether ``version`` is a KubeVirt v1 release later than every one this build has a profile for."""
    m = _VERSION_RE.match(version.strip()) if isinstance(version, str) else None
    return m is not None and int(m.group(1)) > LATEST_MINOR


def fallback_note(observed: str) -> str | None:
    """What to tell the user when a cluster's KubeVirt (``observed``, a CR's ``status.observedKubeVirtVersion``) is
    newer than this build knows: its launcher pods are estimated with the ``main`` profile (see
    :func:`observed_version`). None when there is no fallback."""
    if not newer_than_known(observed):
        return None
    return (
        f"KubeVirt {observed} is newer than this build knows (up to v1.{LATEST_MINOR}): launcher pods are estimated "
        "as for main"
    )


def observed_version(observed: str) -> str:
    """The version to render for a cluster whose KubeVirt CR reports ``observed``: itself when this build knows it;
    ``main`` for a later v1 release (KubeVirt upgraded past this build: the development branch's profile is the
    closest; accounting and the command line report the substitution, see :func:`fallback_note`); anything else is
    :class:`InvalidInput`. An explicitly given version (``--kubevirt-version``) gets no such fallback."""
    if newer_than_known(observed):
        return "main"
    profile(observed)
    return observed


# ---- label selectors (metav1.LabelSelector) --------------------------------------------------------------------

_SELECTOR_OPS: Final = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


def validate_label_selector(sel: object, where: str) -> Mapping[str, Any]:
    if not isinstance(sel, Mapping):
        raise InvalidInput(f"expected a label selector object, got {type(sel).__name__}", where)
    ml = sel.get("matchLabels") or {}
    if not isinstance(ml, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ml.items()):
        raise InvalidInput("expected a map of strings", f"{where}.matchLabels")
    exprs = sel.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise InvalidInput("expected a list", f"{where}.matchExpressions")
    for i, e in enumerate(exprs):
        ew = f"{where}.matchExpressions[{i}]"
        if not isinstance(e, Mapping) or not isinstance(e.get("key"), str):
            raise InvalidInput("expected {key, operator, values}", ew)
        op = e.get("operator")
        if op not in _SELECTOR_OPS:
            raise InvalidInput(f"unknown operator {op!r} (expected In, NotIn, Exists, DoesNotExist)", f"{ew}.operator")
        values = e.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidInput("expected a list of strings", f"{ew}.values")
        if op in ("In", "NotIn") and not values:
            raise InvalidInput(f"operator {op} needs values", f"{ew}.values")
        if op in ("Exists", "DoesNotExist") and values:
            raise InvalidInput(f"operator {op} takes no values", f"{ew}.values")
    return sel


def selector_matches(sel: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` match a (validated) label selector; an empty selector matches everything."""
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        present = key in labels
        if op == "In" and (not present or labels[key] not in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


# ---- numbers as Go parses them ---------------------------------------------------------------------------------

_GO_FLOAT_RE: Final = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?\Z")


def parse_go_float(text: object) -> float | None:
    """A finite decimal float as ``strconv.ParseFloat`` reads it, or None (no spaces, underscores, inf or nan)."""
    if not isinstance(text, str) or not _GO_FLOAT_RE.match(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _overhead_ratio(raw: object, where: str) -> str | None:
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise InvalidInput(f'expected a string such as "1.5", got {raw!r}', where)
    value = parse_go_float(raw)
    if value is None or value < 1.0:
        raise InvalidInput(f"{raw!r} is not a number >= 1.0", where)
    return raw


def positive_ratio(raw: object, where: str) -> Fraction:
    """A KubeVirt ``cpuAllocationRatio``: a positive number (``10``, ``2.5``, ``"4"``)."""
    if isinstance(raw, bool):
        raise InvalidInput(f"expected a number, got {raw!r}", where)
    try:
        if isinstance(raw, (int, Fraction)):
            value = Fraction(raw)
        elif isinstance(raw, (float, str)):
            value = Fraction(str(raw).strip())
        else:
            raise ValueError
    except (ValueError, ZeroDivisionError):
        raise InvalidInput(f"expected a number, got {raw!r}", where) from None
    if value <= 0:
        raise InvalidInput(f"must be greater than 0, got {raw!r}", where)
    return value


def _overcommit(raw: object, where: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise InvalidInput(f"expected a whole percentage, got {raw!r}", where)
    if raw <= 0:
        raise InvalidInput(f"must be greater than 0, got {raw}", where)
    return raw


# ---- the configuration ----------------------------------------------------------------------------------------


EPHEMERAL_STORAGE: Final = Quantity.parse("50M")
"""What KubeVirt adds to a launcher pod's ephemeral-storage (and a container disk's request)."""

# (requests, limits) of the support containers; "guaranteed" is the variant under dedicated CPUs / Guaranteed QoS
_DISK_REQ: Final = {"cpu": Quantity.parse("1m"), "memory": Quantity.parse("1M")}
_DISK_LIM: Final = {"cpu": Quantity.parse("10m"), "memory": Quantity.parse("40M")}
_BINARY_REQ: Final = {"cpu": Quantity.parse("10m"), "memory": Quantity.parse("1M")}
_BINARY_LIM: Final = {"cpu": Quantity.parse("100m"), "memory": Quantity.parse("40M")}
_BINARY_GUARANTEED: Final = {"cpu": Quantity.parse("10m"), "memory": Quantity.parse("40M")}
_CONSOLE_REQ: Final = {"cpu": Quantity.parse("5m"), "memory": Quantity.parse("35M")}
_CONSOLE_LIM: Final = {"cpu": Quantity.parse("15m"), "memory": Quantity.parse("60M")}
_VIRTIOFS_REQ: Final = {"cpu": Quantity.parse("10m"), "memory": Quantity.parse("1M")}
_VIRTIOFS_LIM: Final = {"cpu": Quantity.parse("100m"), "memory": Quantity.parse("80M")}
_SIDECAR_GUARANTEED: Final = {"cpu": Quantity.parse("200m"), "memory": Quantity.parse("64M")}
_CPU_MEM: Final = ("cpu", "memory")


def _over(base: Mapping[str, Quantity], override: Mapping[str, Quantity]) -> ResourceList:
    """``base`` with cpu/memory replaced by ``override`` (``supportContainerResources`` sets only those two)."""
    out = dict(base)
    for k in _CPU_MEM:
        if k in override:
            out[k] = override[k]
    return out


def _support_table(
    scr: Mapping[str, tuple[ResourceList, ResourceList]], guaranteed: bool
) -> dict[str, tuple[ResourceList, ResourceList]]:
    """(requests, limits) of each support container for this configuration, with ``supportContainerResources``
    applied and, under dedicated CPUs / Guaranteed QoS, requests raised to limits."""
    table: dict[str, tuple[ResourceList, ResourceList]] = {}
    o_req, o_lim = scr.get(GUEST_CONSOLE_LOG, ({}, {}))
    lim = _over(_CONSOLE_LIM, o_lim)
    table["console"] = (dict(lim) if guaranteed else _over(_CONSOLE_REQ, o_req), lim)
    o_req, o_lim = scr.get(CONTAINER_DISK, ({}, {}))
    lim = _over(_DISK_LIM, o_lim)
    req = _over(lim if guaranteed else _over(_DISK_REQ, o_req), {})
    req["ephemeral-storage"] = EPHEMERAL_STORAGE
    table["disk"] = (req, lim)
    if guaranteed:
        b = _over(_BINARY_GUARANTEED, o_lim)
        table["binary"] = (dict(b), b)
    else:
        table["binary"] = (_over(_BINARY_REQ, o_req), _over(_BINARY_LIM, o_lim))
    o_req, o_lim = scr.get(VIRTIOFS, ({}, {}))
    lim = _over(_VIRTIOFS_LIM, o_lim)
    table["virtiofs"] = (dict(lim) if guaranteed else _over(_VIRTIOFS_REQ, o_req), lim)
    o_req, o_lim = scr.get(SIDECAR, ({}, {}))
    if guaranteed:
        lim = _over(_SIDECAR_GUARANTEED, o_lim)
        table["sidecar"] = (dict(lim), lim)
    else:
        table["sidecar"] = (_over({}, o_req), _over({}, o_lim))
    for req, lim in table.values():  # API-server defaulting, once
        for k, v in lim.items():
            req.setdefault(k, v)
    return table


@dataclass(frozen=True)
class KubeVirtConfig:
    """The KubeVirt CR settings that shape launcher pods. Validated on construction."""

    version: str = DEFAULT_VERSION
    arch: str = "amd64"
    cpu_allocation_ratio: Fraction = Fraction(10)
    memory_overcommit: int = 100
    additional_guest_memory_overhead_ratio: str | None = None
    auto_cpu_limit_namespace_label_selector: Mapping[str, Any] | None = None
    feature_gates: frozenset[str] = frozenset()
    """``developerConfiguration.featureGates``."""
    disabled_feature_gates: frozenset[str] = frozenset()
    """``developerConfiguration.disabledFeatureGates`` (v1.8+)."""
    use_emulation: bool = False
    """``developerConfiguration.useEmulation``: no ``/dev/kvm`` (software emulation)."""
    support_container_resources: Mapping[str, tuple[ResourceList, ResourceList]] = field(default_factory=dict)
    """``supportContainerResources`` by type: (requests, limits) that replace the defaults per resource."""
    network_binding_memory: Mapping[str, Quantity] = field(default_factory=dict)
    """``network.binding.<plugin>.computeResourceOverhead.requests.memory`` of each registered plugin."""
    network_binding_sidecars: frozenset[str] = frozenset()
    """Registered binding plugins that run a sidecar (``sidecarImage`` set)."""
    cpu_request: Quantity | None = None
    """``spec.configuration.cpuRequest``: default CPU request of VMIs when it is not the built-in 100m."""
    disable_serial_console_log: bool = False
    """``virtualMachineOptions.disableSerialConsoleLog`` is set."""

    # derived once, per config (not part of equality)
    profile: VersionProfile = field(init=False, compare=False, repr=False)
    overhead_ratio: float | None = field(init=False, compare=False, repr=False)
    auto_limits_from_quota: bool = field(init=False, compare=False, repr=False)
    image_volume: bool = field(init=False, compare=False, repr=False)
    """containerDisks are mounted as image volumes (the ImageVolume gate: v1.6+, on by default from v1.9)."""
    memory_overhead_report: bool = field(init=False, compare=False, repr=False)
    """The launcher pod carries ``kubevirt.io/memory-overhead-bytes`` and the VMI ``status.memory.memoryOverhead``
    (the VmiMemoryOverheadReport gate: v1.8+, on by default from v1.9, GA on main)."""
    iommufd: bool = field(init=False, compare=False, repr=False)
    """Every launcher pod asks for ``devices.kubevirt.io/iommufd`` (the IOMMUFD gate, v1.9+)."""
    support: Mapping[bool, Mapping[str, tuple[ResourceList, ResourceList]]] = field(
        init=False, compare=False, repr=False
    )
    """(requests, limits) of each support container, by whether the pod is Guaranteed (``_support_table``)."""

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "profile", profile(self.version))
        if self.arch not in ("amd64", "arm64", "s390x", "ppc64le"):
            raise InvalidInput(f"unsupported architecture {self.arch!r} (expected amd64 or arm64)", "arch")
        setattr_(self, "cpu_allocation_ratio", positive_ratio(self.cpu_allocation_ratio, "cpuAllocationRatio"))
        _overcommit(self.memory_overcommit, "memoryOvercommit")
        ratio = _overhead_ratio(self.additional_guest_memory_overhead_ratio, "additionalGuestMemoryOverheadRatio")
        setattr_(self, "overhead_ratio", None if ratio is None else float(ratio))
        if self.auto_cpu_limit_namespace_label_selector is not None:
            validate_label_selector(self.auto_cpu_limit_namespace_label_selector, "autoCPULimitNamespaceLabelSelector")
        setattr_(self, "feature_gates", frozenset(self.feature_gates))
        setattr_(self, "disabled_feature_gates", frozenset(self.disabled_feature_gates))
        setattr_(self, "image_volume", self.gate(IMAGE_VOLUME_GATE))
        setattr_(self, "memory_overhead_report", self.gate(MEMORY_OVERHEAD_REPORT_GATE))
        setattr_(self, "iommufd", self.gate(IOMMUFD_GATE))
        scr = self.support_container_resources
        setattr_(self, "support", {g: _support_table(scr, g) for g in (False, True)})
        mode = self.profile.auto_limits
        setattr_(
            self,
            "auto_limits_from_quota",
            mode == "always" or (mode == "gate" and AUTO_RESOURCE_LIMITS_GATE in self.feature_gates),
        )

    def gate(self, name: str) -> bool:
        """Whether a feature gate is on, as ``isFeatureGateEnabled`` of this version decides: not registered ->
        off; up to v1.8 on only when listed in ``featureGates``; from v1.9 (``featuregate.IsEnabled``) GA -> on,
        listed in ``featureGates`` -> on, in ``disabledFeatureGates`` -> off, Beta -> on (Beta gates default on
        from v1.9), else off."""
        state = gate_state(name, self.profile.minor)
        if state is None:
            return False
        if self.profile.minor <= 8:
            return state == "GA" or name in self.feature_gates
        if state == "GA" or name in self.feature_gates:
            return True
        return name not in self.disabled_feature_gates and state == "Beta"

    @classmethod
    def from_cr(cls, kubevirt_cr: Mapping[str, Any], *, version: str | None = None) -> KubeVirtConfig:
        """Read a KubeVirt CR. ``version`` wins over ``status.observedKubeVirtVersion`` (default v1.9)."""
        if not isinstance(kubevirt_cr, Mapping):
            raise InvalidInput(f"expected a KubeVirt object, got {type(kubevirt_cr).__name__}")
        try:
            return cls(**config_fields_from_cr(kubevirt_cr, version=version))
        except InvalidInput as e:
            meta = kubevirt_cr.get("metadata")
            name = meta.get("name") if isinstance(meta, Mapping) else None
            raise e.at(f"KubeVirt {name or '<unnamed>'}") from None


def config_fields_from_cr(kubevirt_cr: Mapping[str, Any], *, version: str | None = None) -> dict[str, Any]:
    """The keyword arguments of :class:`KubeVirtConfig` that a KubeVirt CR sets (for callers that override some)."""
    out: dict[str, Any] = {}
    status = mapping(kubevirt_cr, "status", "")
    if version is not None:
        out["version"] = version
    elif observed := string(status, "observedKubeVirtVersion", "status"):
        try:
            out["version"] = observed_version(observed)
        except InvalidInput as e:
            raise InvalidInput(e.message, "status.observedKubeVirtVersion") from None
    spec = mapping(kubevirt_cr, "spec", "")
    conf = mapping(spec, "configuration", "spec")
    cw = "spec.configuration"
    dev = mapping(conf, "developerConfiguration", cw)
    dw = f"{cw}.developerConfiguration"
    if dev.get("cpuAllocationRatio") is not None:
        out["cpu_allocation_ratio"] = positive_ratio(dev["cpuAllocationRatio"], f"{dw}.cpuAllocationRatio")
    if dev.get("memoryOvercommit") is not None:
        out["memory_overcommit"] = _overcommit(dev["memoryOvercommit"], f"{dw}.memoryOvercommit")
    gates = dev.get("featureGates")
    if gates is not None:
        if not isinstance(gates, list) or not all(isinstance(g, str) for g in gates):
            raise InvalidInput("expected a list of strings", f"{dw}.featureGates")
        out["feature_gates"] = frozenset(gates)
    disabled = dev.get("disabledFeatureGates")
    if disabled is not None:
        if not isinstance(disabled, list) or not all(isinstance(g, str) for g in disabled):
            raise InvalidInput("expected a list of strings", f"{dw}.disabledFeatureGates")
        out["disabled_feature_gates"] = frozenset(disabled)
    if dev.get("useEmulation") is not None:
        out["use_emulation"] = boolean(dev, "useEmulation", dw) is True
    if conf.get("additionalGuestMemoryOverheadRatio") is not None:
        raw = conf["additionalGuestMemoryOverheadRatio"]
        out["additional_guest_memory_overhead_ratio"] = _overhead_ratio(raw, f"{cw}.additionalGuestMemoryOverheadRatio")
    if conf.get("autoCPULimitNamespaceLabelSelector") is not None:
        sel = conf["autoCPULimitNamespaceLabelSelector"]
        out["auto_cpu_limit_namespace_label_selector"] = validate_label_selector(
            sel, f"{cw}.autoCPULimitNamespaceLabelSelector"
        )
    if conf.get("cpuRequest") is not None:
        try:
            out["cpu_request"] = Quantity.parse(conf["cpuRequest"])
        except InvalidInput as e:
            raise e.at(f"{cw}.cpuRequest") from None
    vmo = mapping(conf, "virtualMachineOptions", cw)
    if vmo.get("disableSerialConsoleLog") is not None:
        out["disable_serial_console_log"] = True
    arch = conf.get("architectureConfiguration")
    if isinstance(arch, Mapping) and isinstance(arch.get("defaultArchitecture"), str):
        out["arch"] = arch["defaultArchitecture"]
    out.update(_support_containers(conf.get("supportContainerResources"), f"{cw}.supportContainerResources"))
    out.update(_bindings(mapping(mapping(conf, "network", cw), "binding", f"{cw}.network"), f"{cw}.network.binding"))
    return out


def _support_containers(raw: object, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, list):
        raise InvalidInput("expected a list", where)
    table: dict[str, tuple[ResourceList, ResourceList]] = {}
    for i, item in enumerate(raw):
        iw = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidInput("expected {type, resources}", iw)
        kind = item.get("type")
        if kind not in SUPPORT_CONTAINER_TYPES:
            raise InvalidInput(f"unknown support container type {kind!r}", f"{iw}.type")
        res = mapping(item, "resources", iw)
        table[kind] = (
            parse_resource_list(res.get("requests"), f"{iw}.resources.requests"),
            parse_resource_list(res.get("limits"), f"{iw}.resources.limits"),
        )
    return {"support_container_resources": table}


def _bindings(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    memory: dict[str, Quantity] = {}
    sidecars: set[str] = set()
    for name, plugin in raw.items():
        pw = f"{where}.{name}"
        if not isinstance(plugin, Mapping):
            raise InvalidInput("expected an object", pw)
        if plugin.get("sidecarImage"):
            sidecars.add(str(name))
        overhead = mapping(plugin, "computeResourceOverhead", pw)
        requests = parse_resource_list(overhead.get("requests"), f"{pw}.computeResourceOverhead.requests")
        if "memory" in requests:
            memory[str(name)] = requests["memory"]
    return {"network_binding_memory": memory, "network_binding_sidecars": frozenset(sidecars)} if raw else {}
