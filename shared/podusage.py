"""Kubernetes' pod resource rules (``k8s.io/component-helpers/resource``), pure.

:func:`pod_totals` is the one place the effective requests/limits of a pod are computed: the sum of containers
and restartable init containers (sidecars), max'ed with each plain init container (plus the sidecars started
before it), plus ``spec.overhead`` (added to requests, and to limits only where a non-zero limit exists).

:func:`pod_resources` reads a pod object as the ResourceQuota evaluator does on Kubernetes 1.33+
(``PodRequests``/``PodLimits`` with ``UseStatusResources`` and pod-level resources):

- **in-place resize** (InPlacePodVerticalScaling, on by default since 1.33): a container or sidecar whose status
  reports ``resources`` counts the per-resource maximum of its spec, ``status.resources`` and
  ``allocatedResources`` for requests, and of its spec and ``status.resources`` for limits; while the pod's
  ``PodResizePending`` condition says ``Infeasible`` the spec is ignored (requests = max(status, allocated),
  limits = status). Plain init containers always count their spec.
- **pod-level resources** (PodLevelResources, on by default since 1.34): ``spec.resources`` values of cpu,
  memory and ``hugepages-*`` replace the container aggregate. The API server drops the field where the gate is
  off, so a pod that carries it was admitted with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Final

from shared.bounded import Bounded
from shared.errors import InvalidInput
from shared.kinds import FINAL_PHASES
from shared.quantity import MAX_NANOS, Format, Quantity
from shared.resources import (
    ResourceList,
    add,
    format_resource_list,
    is_qualified_name,
    maximum,
    parse_resource_list,
    saturated,
)
from shared.times import go_seconds, parse_rfc3339

_Entry = tuple[bool, bool, Mapping[str, "Quantity"], Mapping[str, "Quantity"]]
"""What the totals read of a container: init, restartable, requests, limits."""


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """Requests and limits of one container, and whether it is an init container / a sidecar."""

    name: str
    requests: Mapping[str, Quantity]
    limits: Mapping[str, Quantity]
    init: bool = False
    """An init container (plain unless ``restartable``)."""
    restartable: bool = False
    """An init container with ``restartPolicy: Always`` (a sidecar): counted with the containers."""

    def to_json(self) -> dict[str, Any]:
        """The container as it appears in a pod spec (name, resources, restartPolicy for sidecars)."""
        res = {k: format_resource_list(v) for k, v in (("requests", self.requests), ("limits", self.limits)) if v}
        out: dict[str, Any] = {"name": self.name, "resources": res}
        if self.restartable:
            out["restartPolicy"] = "Always"
        return out


def _effective(containers: Iterable[_Entry], limits: bool) -> ResourceList:
    """Kubernetes' rule, computed as ``resources.add``/``maximum`` would (same values, formats, key order and
    range errors) but accumulated as integers (nanos, and the format ``Quantity`` addition keeps) instead of
    intermediate objects: this runs for every pod the watcher normalises.

    A sum takes the format of its left operand unless that is zero (``Quantity.__add__``); a maximum keeps the
    left operand on a tie; new keys are appended in the order they are met."""
    total: dict[str, int] = {}
    total_fmt: dict[str, Format] = {}
    side: dict[str, int] = {}  # the sidecars started so far
    side_fmt: dict[str, Format] = {}
    peak: dict[str, int] = {}  # the init containers' peak
    peak_fmt: dict[str, Format] = {}
    for init, restartable, requests, lims in containers:
        rl = lims if limits else requests
        if not init or restartable:
            _accumulate(total, total_fmt, rl)
            if not init:
                continue
            _accumulate(side, side_fmt, rl)  # a sidecar: it runs beside the init containers after it
            run, run_fmt = side, side_fmt
        else:  # a plain init container: its resources + the sidecars started before it
            run = {k: q.nanos for k, q in rl.items()}
            run_fmt = {k: q.format for k, q in rl.items()}
            for k, n in side.items():
                cur = run.get(k)
                if cur is None:
                    run[k] = n
                    run_fmt[k] = side_fmt[k]
                else:
                    if cur == 0:
                        run_fmt[k] = side_fmt[k]
                    run[k] = n + cur
        for k, n in run.items():  # peak = max(peak, run)
            cur = peak.get(k)
            if cur is None or n > cur:
                peak[k] = n
                peak_fmt[k] = run_fmt[k]
    for k, n in peak.items():  # max(total, peak)
        cur = total.get(k)
        if cur is None or n > cur:
            total[k] = n
            total_fmt[k] = peak_fmt[k]
    return {k: _quantity(n, total_fmt[k]) for k, n in total.items()}


_QUANTITIES: Final[Bounded[tuple[int, Format], Quantity]] = Bounded(4096)


def _quantity(nanos: int, fmt: Format) -> Quantity:
    """``Quantity(nanos, fmt)``, shared: pods repeat a few totals (quantities are immutable, and a shared one keeps
    its printed form once computed)."""
    key = (nanos, fmt)
    q = _QUANTITIES.get(key)
    if q is None:
        q = _QUANTITIES.keep(key, Quantity(nanos, fmt))
    return q


def _accumulate(sums: dict[str, int], fmts: dict[str, Format], rl: Mapping[str, Quantity]) -> None:
    """``sums += rl`` in integer nanos, keeping the format ``Quantity`` addition keeps (the first non-zero
    operand's)."""
    for k, q in rl.items():
        cur = sums.get(k)
        if cur is None:
            sums[k] = q.nanos
            fmts[k] = q.format
        else:
            if cur == 0:
                fmts[k] = q.format
            sums[k] = cur + q.nanos


def pod_totals(
    containers: Iterable[ContainerSpec], overhead: Mapping[str, Quantity] | None = None
) -> tuple[ResourceList, ResourceList]:
    """Effective pod (requests, limits). ``containers`` in pod order: init containers first, as in a pod spec."""
    cs = list(containers)
    # Kubernetes walks init containers in order for the peak and sums regular containers separately.
    ordered = [c for c in cs if c.init] + [c for c in cs if not c.init]
    return _totals([(c.init, c.restartable, c.requests, c.limits) for c in ordered], overhead)


PodLevel = tuple[Mapping[str, "Quantity"], Mapping[str, "Quantity"]]
"""``spec.resources`` of a pod: (requests, limits)."""
_NO_POD_LEVEL: Final[PodLevel] = ({}, {})


def is_pod_level_resource(name: str) -> bool:
    """``IsSupportedPodLevelResource``: cpu, memory and ``hugepages-*``."""
    return name in ("cpu", "memory") or name.startswith("hugepages-")


def pod_level_set(requests: Iterable[str], limits: Iterable[str] = ()) -> bool:
    """``IsPodLevelResourcesSet`` (``IsPodLevelRequestsSet`` with no limits) of the names in ``spec.resources``."""
    return any(is_pod_level_resource(k) for names in (requests, limits) for k in names)


def _totals(
    entries: Sequence[_Entry], overhead: Mapping[str, Quantity] | None, pod_level: PodLevel = _NO_POD_LEVEL
) -> tuple[ResourceList, ResourceList]:
    requests = _effective(entries, False)
    limits = _effective(entries, True)
    pl_req, pl_lim = pod_level
    if pl_req or pl_lim:  # PodRequests / PodLimits: supported pod-level values replace the aggregate
        if pod_level_set(pl_req):
            requests.update((k, v) for k, v in pl_req.items() if is_pod_level_resource(k))
        if pod_level_set(pl_req, pl_lim):
            limits.update((k, v) for k, v in pl_lim.items() if is_pod_level_resource(k))
    if overhead:
        requests = add(requests, overhead)
        limits = {k: (v + overhead[k] if k in overhead and v.nanos != 0 else v) for k, v in limits.items()}
    # A pod's totals past what a quantity holds (an int64 of base units) are cut to it: Kubernetes takes decimal
    # quantities of any size and adds them exactly, so such a pod exists, and refused, it went unaccounted while
    # native quota charged the rest of it. No quota holds that much, so what is cut changes no admission.
    return _within_range(requests), _within_range(limits)


def _within_range(rl: ResourceList) -> ResourceList:
    for v in rl.values():
        if v.nanos > MAX_NANOS or v.nanos < -MAX_NANOS:
            return saturated(rl)[0]
    return rl


# ---- a pod object as the ResourceQuota evaluator charges it ----------------------------------------------------

_ONE: Final = Quantity.from_int(1)
_EMPTY: Final[Mapping[str, Any]] = {}
_parse: Final = Quantity.parse
_REQUEST_STANDARD = ("cpu", "memory", "ephemeral-storage")
_LIMIT_STANDARD = ("cpu", "memory", "ephemeral-storage")


def counts_for_compute(
    phase: object, deletion_timestamp: datetime | None, grace_seconds: object, now: datetime | None = None
) -> bool:
    """False for pods the quota evaluator charges only ``count/pods``: phase Succeeded/Failed, or terminating
    past ``deletionTimestamp + deletionGracePeriodSeconds`` (``now`` defaults to the current UTC time). The grace
    period as Go's arithmetic has it (:func:`~shared.times.go_seconds`): a tenant's pod deleted with a grace period of
    ten to the fourteenth seconds is charged as Kubernetes charges it, and stops no accounting."""
    if phase in FINAL_PHASES:
        return False
    if deletion_timestamp is not None and isinstance(grace_seconds, int) and not isinstance(grace_seconds, bool):
        current = now or datetime.now(UTC)
        if current - deletion_timestamp > go_seconds(grace_seconds):
            return False
    return True


def pod_counts_for_compute(pod: Mapping[str, Any], now: datetime | None = None) -> bool:
    """:func:`counts_for_compute` of a pod object."""
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return counts_for_compute(phase, None, None, now)
    return counts_for_compute(
        phase, parse_rfc3339(meta.get("deletionTimestamp")), meta.get("deletionGracePeriodSeconds"), now
    )


def _resource_list(raw: object, field: str, index: int, pick: str) -> ResourceList:
    """:func:`~shared.resources.parse_resource_list` of ``spec.<field>[<index>].resources.<pick>``, with a fast
    path for the usual ``{name: "quantity"}`` dict; anything else (errors included) goes through it."""
    if type(raw) is dict:
        out: ResourceList = {}
        try:
            for k, v in raw.items():
                if type(v) is not str or type(k) is not str or not k:
                    break
                out[k] = _parse(v)
            else:
                return out
        except InvalidInput:
            pass
    return parse_resource_list(raw, f"spec.{field}[{index}].resources.{pick}")


def _containers(pod: Mapping[str, Any]) -> list[tuple[str, bool, bool, ResourceList, ResourceList]]:
    """(name, init, restartable, requests, limits) of each container, init containers first; InvalidInput on bad
    input."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidInput("pod has no spec", "spec")
    out: list[tuple[str, bool, bool, ResourceList, ResourceList]] = []
    for field, init in (("initContainers", True), ("containers", False)):
        items = spec.get(field) or []
        if not isinstance(items, list):
            raise InvalidInput("expected a list", f"spec.{field}")
        for i, c in enumerate(items):
            if type(c) is not dict and not isinstance(c, Mapping):
                raise InvalidInput("expected a container object", f"spec.{field}[{i}]")
            res = c.get("resources") or _EMPTY
            if type(res) is not dict and not isinstance(res, Mapping):
                raise InvalidInput("expected an object", f"spec.{field}[{i}].resources")
            requests = _resource_list(res.get("requests"), field, i, "requests")
            limits = _resource_list(res.get("limits"), field, i, "limits")
            out.append((c.get("name") or "", init, init and c.get("restartPolicy") == "Always", requests, limits))
    return out


def pod_containers(pod: Mapping[str, Any]) -> list[ContainerSpec]:
    """The containers of a pod object (init containers first), with parsed resources; InvalidInput on bad input."""
    return [
        ContainerSpec(name=str(name), requests=rq, limits=lm, init=init, restartable=rs)
        for name, init, rs, rq, lm in _containers(pod)
    ]


_StatusResources = tuple[ResourceList, ResourceList, ResourceList]
"""What a container status reports: ``resources.requests``, ``resources.limits``, ``allocatedResources``."""


def _status_resources(pod: Mapping[str, Any]) -> tuple[dict[str, _StatusResources], bool]:
    """The reported resources of each container (and init container) whose status has ``resources`` set, by name,
    and whether the pod's ``PodResizePending`` condition says ``Infeasible``; InvalidInput on bad input."""
    status = pod.get("status")
    if not isinstance(status, Mapping):
        return {}, False
    out: dict[str, _StatusResources] = {}
    for field in ("containerStatuses", "initContainerStatuses"):
        items = status.get(field) or []
        if not isinstance(items, list):
            raise InvalidInput("expected a list", f"status.{field}")
        for i, cs in enumerate(items):
            w = f"status.{field}[{i}]"
            if not isinstance(cs, Mapping):
                raise InvalidInput("expected a container status object", w)
            res = cs.get("resources")
            if res is None:
                continue  # cs.Resources == nil: the spec counts
            if not isinstance(res, Mapping):
                raise InvalidInput("expected an object", f"{w}.resources")
            out[str(cs.get("name") or "")] = (
                parse_resource_list(res.get("requests"), f"{w}.resources.requests"),
                parse_resource_list(res.get("limits"), f"{w}.resources.limits"),
                parse_resource_list(cs.get("allocatedResources"), f"{w}.allocatedResources"),
            )
    return out, _resize_infeasible(status.get("conditions"))


def _resize_infeasible(conditions: object) -> bool:
    """``IsPodResizeInfeasible``: the first ``PodResizePending`` condition has reason ``Infeasible``."""
    if not isinstance(conditions, list):
        return False
    for c in conditions:
        if isinstance(c, Mapping) and c.get("type") == "PodResizePending":
            return c.get("reason") == "Infeasible"
    return False


def _with_status(
    rows: Iterable[tuple[str, bool, bool, ResourceList, ResourceList]],
    statuses: Mapping[str, _StatusResources],
    infeasible: bool,
) -> list[_Entry]:
    """The entries the totals walk: containers and sidecars with a reported status count
    ``determineContainerReqs``/``determineContainerLimits``; plain init containers their spec."""
    out: list[_Entry] = []
    for name, init, restartable, requests, limits in rows:
        reported = statuses.get(name) if statuses and (restartable or not init) else None
        if reported is not None:
            st_req, st_lim, allocated = reported
            if infeasible:
                requests, limits = maximum(st_req, allocated), dict(st_lim)
            else:
                requests, limits = maximum(maximum(requests, st_req), allocated), maximum(limits, st_lim)
        out.append((init, restartable, requests, limits))
    return out


def _pod_level(spec: Mapping[str, Any]) -> PodLevel:
    res = spec.get("resources")
    if res is None:
        return _NO_POD_LEVEL
    if not isinstance(res, Mapping):
        raise InvalidInput("expected an object", "spec.resources")
    return (
        parse_resource_list(res.get("requests"), "spec.resources.requests"),
        parse_resource_list(res.get("limits"), "spec.resources.limits"),
    )


def pod_resources(pod: Mapping[str, Any]) -> tuple[ResourceList, ResourceList]:
    """Effective (requests, limits) of a pod object as the quota evaluator reads it (see the module docstring):
    status-reported resources of resized containers, pod-level resources and ``spec.overhead`` included."""
    spec = pod.get("spec")
    if type(spec) is dict:
        shape = _shape(spec, pod.get("status"))
        if shape is not None:
            try:
                requests, limits = _resources_of_shape(shape)
            except (_Unusual, TypeError):  # TypeError: an unhashable value (a malformed quantity)
                pass
            else:
                return dict(requests), dict(limits)
    if not isinstance(spec, Mapping):
        raise InvalidInput("pod has no spec", "spec")
    overhead = parse_resource_list(spec.get("overhead"), "spec.overhead")
    statuses, infeasible = _status_resources(pod)
    # pod order is init containers first: the order pod_totals walks
    return _totals(_with_status(_containers(pod), statuses, infeasible), overhead, _pod_level(spec))


# Pods repeat a few resource shapes (replicas of a workload, VMs of one instance type): the totals of a shape are
# computed once. A shape is what the totals read, as tuples of the raw strings; only all-string shapes are kept
# (a string never equals a number, so a hit is the same input); anything unusual, errors included, takes the
# path above, which names the offending field.
_Items = tuple[tuple[Any, Any], ...]
_Shape = tuple[
    tuple[tuple[str, bool, bool, _Items, _Items], ...],  # containers: name, init, restartable, requests, limits
    _Items,  # spec.overhead
    tuple[tuple[str, _Items, _Items, _Items], ...],  # reported container statuses: name, requests, limits, allocated
    bool,  # resize infeasible
    tuple[_Items, _Items],  # spec.resources
]


class _Unusual(Exception):
    pass


def _items(raw: object) -> _Items | None:
    """The items of a plain dict (None counts as empty, as in parse_resource_list); None for anything else."""
    if raw is None:
        return ()
    if type(raw) is not dict:
        return None
    return tuple(raw.items())


def _shape(spec: dict[str, Any], status: object) -> _Shape | None:
    parts = []
    for field, init in (("initContainers", True), ("containers", False)):
        items = spec.get(field) or ()
        if type(items) is not list and items != ():
            return None
        for c in items:
            if type(c) is not dict:
                return None
            res = c.get("resources") or _EMPTY
            if type(res) is not dict:
                return None
            rq, lm = _items(res.get("requests")), _items(res.get("limits"))
            name = c.get("name") or ""
            if rq is None or lm is None or type(name) is not str:
                return None
            parts.append((name, init, init and c.get("restartPolicy") == "Always", rq, lm))
    overhead = _items(spec.get("overhead"))
    if overhead is None:
        return None
    reported: list[tuple[str, _Items, _Items, _Items]] = []
    infeasible = False
    if status is not None:
        if type(status) is not dict:
            return None
        for field in ("containerStatuses", "initContainerStatuses"):
            items = status.get(field) or ()
            if type(items) is not list and items != ():
                return None
            for cs in items:
                if type(cs) is not dict:
                    return None
                res = cs.get("resources")
                if res is None:
                    continue
                if type(res) is not dict:
                    return None
                rq, lm = _items(res.get("requests")), _items(res.get("limits"))
                al = _items(cs.get("allocatedResources"))
                if rq is None or lm is None or al is None:
                    return None
                reported.append((str(cs.get("name") or ""), rq, lm, al))
        infeasible = _resize_infeasible(status.get("conditions"))
    pod_level: tuple[_Items, _Items] = ((), ())
    if spec.get("resources") is not None:
        res = spec["resources"]
        if type(res) is not dict:
            return None
        rq, lm = _items(res.get("requests")), _items(res.get("limits"))
        if rq is None or lm is None:
            return None
        pod_level = (rq, lm)
    return tuple(parts), overhead, tuple(reported), infeasible, pod_level


@lru_cache(maxsize=4096)
def _resources_of_shape(shape: _Shape) -> tuple[ResourceList, ResourceList]:
    """Shared results: callers copy them."""
    parts, overhead, reported, infeasible, (pl_req, pl_lim) = shape
    rows = [(name, init, rs, _strings(rq), _strings(lm)) for name, init, rs, rq, lm in parts]
    statuses = {name: (_strings(rq), _strings(lm), _strings(al)) for name, rq, lm, al in reported}
    return _totals(_with_status(rows, statuses, infeasible), _strings(overhead), (_strings(pl_req), _strings(pl_lim)))


def _strings(items: tuple[Any, ...]) -> ResourceList:
    out: ResourceList = {}
    for k, v in items:
        if type(v) is not str or type(k) is not str or not k:
            raise _Unusual
        try:
            out[k] = _parse(v)
        except InvalidInput:
            raise _Unusual from None
    return out


DEVICE_CLASS_PREFIX: Final = "deviceclass.resource.kubernetes.io/"
"""The implicit extended resource name of a DRA DeviceClass (``resourceapi.ResourceDeviceClassPrefix``)."""


def is_native_resource(name: str) -> bool:
    """``helper.IsNativeResource``: no ``/``, or a ``kubernetes.io/`` name anywhere in it."""
    return "/" not in name or "kubernetes.io/" in name


@lru_cache(maxsize=1024)
def is_extended_resource(name: str) -> bool:
    """``helper.IsExtendedResourceName``: not native, not ``requests.*``, and ``requests.<name>`` is a qualified
    name (what a quota can name)."""
    return not is_native_resource(name) and not name.startswith("requests.") and is_qualified_name(f"requests.{name}")


def is_quota_extended_resource(name: str) -> bool:
    """A quota key the pod evaluator matches as an extended resource (``isExtendedResourceNameForQuota``, 1.35):
    ``requests.`` and then a non-native name, or a DRA DeviceClass's implicit name."""
    return name.startswith("requests.") and (
        not is_native_resource(name) or name.startswith(f"requests.{DEVICE_CLASS_PREFIX}")
    )


def quota_usage_of(requests: Mapping[str, Quantity], limits: Mapping[str, Quantity]) -> ResourceList:
    """Map effective pod requests/limits to the resource names a ResourceQuota uses (non-terminal pod), as
    ``podComputeUsageHelper`` (Kubernetes 1.35): ``pods``/``count/pods`` = 1; ``cpu``/``requests.cpu`` etc.;
    ``limits.*``; ``hugepages-*`` and ``requests.hugepages-*``; extended resources
    (:func:`is_extended_resource`) and DRA DeviceClass names (``deviceclass.resource.kubernetes.io/<class>``) as
    ``requests.<name>`` only."""
    out: ResourceList = {"pods": _ONE, "count/pods": _ONE}
    for name in _REQUEST_STANDARD:
        if name in requests:
            out[name] = requests[name]
            out[f"requests.{name}"] = requests[name]
    for name in _LIMIT_STANDARD:
        if name in limits:
            out[f"limits.{name}"] = limits[name]
    for name, q in requests.items():
        if name.startswith("hugepages-"):
            out[name] = q
            out[f"requests.{name}"] = q
        elif is_extended_resource(name) or name.startswith(DEVICE_CLASS_PREFIX):
            out[f"requests.{name}"] = q
    return out


def pod_quota_usage(pod: Mapping[str, Any], now: datetime | None = None) -> ResourceList:
    """What the ResourceQuota evaluator charges for a pod object (terminal pods: only ``count/pods``)."""
    if not pod_counts_for_compute(pod, now):
        return {"count/pods": Quantity.from_int(1)}
    requests, limits = pod_resources(pod)
    return quota_usage_of(requests, limits)
