"""Kubernetes' pod resource rules (``k8s.io/component-helpers/resource``), pure.

:func:`pod_totals` is the one place the effective requests/limits of a pod are computed: the sum of containers
and restartable init containers (sidecars), max'ed with each plain init container (plus the sidecars started
before it), plus ``spec.overhead`` (added to limits only where a limit exists).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from functools import lru_cache
from typing import Any, Final

from shared.errors import InvalidInput, InvalidQuantity
from shared.quantity import MAX_NANOS, NANO, Format, Quantity
from shared.resources import ResourceList, add, format_resource_list, parse_resource_list

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
            over = False
            for k, n in side.items():
                cur = run.get(k)
                if cur is None:
                    run[k] = n
                    run_fmt[k] = side_fmt[k]
                else:
                    if cur == 0:
                        run_fmt[k] = side_fmt[k]
                    n = run[k] = n + cur
                    over = over or n > MAX_NANOS
            if over:
                _check_range(run)
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
    return {k: Quantity(n, total_fmt[k]) for k, n in total.items()}


def _too_large(nanos: int) -> int:
    raise InvalidQuantity(f"{Fraction(nanos, NANO)} is larger than Kubernetes can represent")


def _accumulate(sums: dict[str, int], fmts: dict[str, Format], rl: Mapping[str, Quantity]) -> None:
    """``sums += rl`` in integer nanos, keeping the format ``Quantity`` addition keeps (the first non-zero
    operand's). A sum past the range is reported for the first resource of the sum that is (as adding whole lists
    and then checking reports it), not for the first one met while adding."""
    over = False
    for k, q in rl.items():
        cur = sums.get(k)
        if cur is None:
            sums[k] = q.nanos
            fmts[k] = q.format
        else:
            if cur == 0:
                fmts[k] = q.format
            n = sums[k] = cur + q.nanos
            over = over or n > MAX_NANOS
    if over:
        _check_range(sums)


def _check_range(sums: Mapping[str, int]) -> None:
    for n in sums.values():
        if abs(n) > MAX_NANOS:
            _too_large(n)


def pod_totals(
    containers: Iterable[ContainerSpec], overhead: Mapping[str, Quantity] | None = None
) -> tuple[ResourceList, ResourceList]:
    """Effective pod (requests, limits). ``containers`` in pod order: init containers first, as in a pod spec."""
    cs = list(containers)
    # Kubernetes walks init containers in order for the peak and sums regular containers separately.
    ordered = [c for c in cs if c.init] + [c for c in cs if not c.init]
    return _totals([(c.init, c.restartable, c.requests, c.limits) for c in ordered], overhead)


def _totals(entries: Sequence[_Entry], overhead: Mapping[str, Quantity] | None) -> tuple[ResourceList, ResourceList]:
    requests = _effective(entries, False)
    limits = _effective(entries, True)
    if overhead:
        requests = add(requests, overhead)
        limits = {k: (v + overhead[k] if k in overhead else v) for k, v in limits.items()}
        for v in (*requests.values(), *limits.values()):
            if abs(v.nanos) > MAX_NANOS:
                _too_large(v.nanos)
    return requests, limits


# ---- a pod object as the ResourceQuota evaluator charges it ----------------------------------------------------

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_ONE: Final = Quantity.from_int(1)
_EMPTY: Final[Mapping[str, Any]] = {}
_parse: Final = Quantity.parse
_REQUEST_STANDARD = ("cpu", "memory", "ephemeral-storage")
_LIMIT_STANDARD = ("cpu", "memory", "ephemeral-storage")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def counts_for_compute(
    phase: object, deletion_timestamp: datetime | None, grace_seconds: object, now: datetime | None = None
) -> bool:
    """False for pods the quota evaluator charges only ``count/pods``: phase Succeeded/Failed, or terminating
    past ``deletionTimestamp + deletionGracePeriodSeconds`` (``now`` defaults to the current UTC time)."""
    if phase in TERMINAL_PHASES:
        return False
    if deletion_timestamp is not None and isinstance(grace_seconds, int) and not isinstance(grace_seconds, bool):
        current = now or datetime.now(UTC)
        if current > deletion_timestamp + timedelta(seconds=grace_seconds):
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
        phase, _parse_time(meta.get("deletionTimestamp")), meta.get("deletionGracePeriodSeconds"), now
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


def pod_resources(pod: Mapping[str, Any]) -> tuple[ResourceList, ResourceList]:
    """Effective (requests, limits) of a pod object, ``spec.overhead`` included."""
    spec = pod.get("spec")
    if type(spec) is dict:
        shape = _shape(spec)
        if shape is not None:
            try:
                requests, limits = _resources_of_shape(shape)
            except (_Unusual, TypeError):  # TypeError: an unhashable value (a malformed quantity)
                pass
            else:
                return dict(requests), dict(limits)
    overhead = parse_resource_list(spec.get("overhead"), "spec.overhead") if isinstance(spec, Mapping) else {}
    # pod order is init containers first: the order pod_totals walks
    return _totals([(init, rs, rq, lm) for _, init, rs, rq, lm in _containers(pod)], overhead)


# Pods repeat a few resource shapes (replicas of a workload, VMs of one instance type): the totals of a shape are
# computed once. A shape is what the totals read, as tuples of the raw strings; only all-string shapes are kept
# (a string never equals a number, so a hit is the same input); anything unusual, errors included, takes the
# path above, which names the offending field.
_Shape = tuple[tuple[tuple[bool, bool, tuple[Any, ...], tuple[Any, ...]], ...], tuple[Any, ...]]


class _Unusual(Exception):
    pass


def _shape(spec: dict[str, Any]) -> _Shape | None:
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
            rq, lm = res.get("requests"), res.get("limits")  # only None counts as absent, as in parse_resource_list
            rq = _EMPTY if rq is None else rq
            lm = _EMPTY if lm is None else lm
            if type(rq) is not dict or type(lm) is not dict:
                return None
            parts.append((init, init and c.get("restartPolicy") == "Always", tuple(rq.items()), tuple(lm.items())))
    overhead = spec.get("overhead")
    overhead = _EMPTY if overhead is None else overhead
    if type(overhead) is not dict:
        return None
    return tuple(parts), tuple(overhead.items())


@lru_cache(maxsize=4096)
def _resources_of_shape(shape: _Shape) -> tuple[ResourceList, ResourceList]:
    """Shared results: callers copy them."""
    parts, overhead = shape
    entries = [(init, rs, _strings(rq), _strings(lm)) for init, rs, rq, lm in parts]
    return _totals(entries, _strings(overhead))


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


def quota_usage_of(requests: Mapping[str, Quantity], limits: Mapping[str, Quantity]) -> ResourceList:
    """Map effective pod requests/limits to the resource names a ResourceQuota uses (non-terminal pod):
    ``pods``/``count/pods`` = 1; ``cpu``/``requests.cpu`` etc.; ``limits.*``; ``hugepages-*`` and
    ``requests.hugepages-*``; extended resources as ``requests.<name>``."""
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
        elif "/" in name and "kubernetes.io/" not in name and not name.startswith("requests."):
            out[f"requests.{name}"] = q
    return out


def pod_quota_usage(pod: Mapping[str, Any], now: datetime | None = None) -> ResourceList:
    """What the ResourceQuota evaluator charges for a pod object (terminal pods: only ``count/pods``)."""
    if not pod_counts_for_compute(pod, now):
        return {"count/pods": Quantity.from_int(1)}
    requests, limits = pod_resources(pod)
    return quota_usage_of(requests, limits)
