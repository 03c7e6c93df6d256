"""Kubernetes ResourceQuota in the simulated cluster: the admission plugin and the quota controller.

Admission (``plugin/pkg/admission/resourcequota`` in kube-apiserver) checks every pod create against the
``status.hard`` and ``status.used`` of each matching quota in the namespace — not ``spec.hard``, which takes effect
only when the controller has copied it — refuses with the real 403 messages (``exceeded quota: …``, ``failed quota:
…: must specify …``, ``status unknown for quota: …``) and, on success, writes the new ``status.used`` itself, so the
quota's resourceVersion changes with every admitted pod that it charges.

The controller (``pkg/controller/resourcequota``) copies ``spec.hard`` to ``status.hard`` and recomputes
``status.used`` from the pods of the namespace: when ``spec.hard`` changes (its own, prioritised queue), when a pod
is deleted or turns terminal (replenishment), and periodically. Every sync waits ``sync_delay`` first.

The pure rules (scope matching, constraints, admission arithmetic, usage) are module functions; the
:class:`ResourceQuotaSystem` wires them to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from services.devtools.simcluster.cache import Cache, Key, key_of
from services.devtools.simcluster.store_api import ApiError, Obj, Operation, Resource, StoreAPI, WatchType
from services.platform.logs import get_logger
from services.platform.workqueue import WorkQueue
from shared.errors import InvalidInput
from shared.kinds import FINAL_PHASES
from shared.podusage import (
    is_pod_level_resource,
    is_quota_extended_resource,
    pod_containers,
    pod_counts_for_compute,
    pod_level_set,
    pod_quota_usage,
    pod_resources,
    pod_totals,
    quota_usage_of,
)
from shared.quantity import Format, Quantity
from shared.resources import ResourceList, add, format_resource_list, growth, only, parse_resource_list

# ---- the pod evaluator's resources and scopes ------------------------------------------------------------------

POD_RESOURCES: Final = frozenset(
    {
        "pods",
        "count/pods",
        "cpu",
        "memory",
        "ephemeral-storage",
        "requests.cpu",
        "requests.memory",
        "requests.ephemeral-storage",
        "limits.cpu",
        "limits.memory",
        "limits.ephemeral-storage",
    }
)
# BACKWARD COMPATIBILITY in Kubernetes: quota on these makes every container specify them.
VALIDATION_SET: Final = frozenset({"cpu", "memory", "requests.cpu", "requests.memory", "limits.cpu", "limits.memory"})
POD_SCOPES: Final = (
    "Terminating",
    "NotTerminating",
    "BestEffort",
    "NotBestEffort",
    "PriorityClass",
    "CrossNamespacePodAffinity",
    "VolumeAttributesClass",
)
"""The quota scopes (``VolumeAttributesClass`` is a persistent volume claim's: it matches no pod)."""
VALUED_SCOPES: Final = ("PriorityClass", "VolumeAttributesClass")
"""Scopes a selector may match with ``In``, ``NotIn`` and ``DoesNotExist`` (the others only with ``Exists``)."""
SCOPE_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")
_ZERO: Final = Quantity(0, Format.DECIMAL_SI)


def is_pod_resource(name: str) -> bool:
    """``podEvaluator.MatchingResources`` for one name: compute resources, hugepages, extended ``requests.*``."""
    if name in POD_RESOURCES:
        return True
    if name.startswith(("hugepages-", "requests.hugepages-")):
        return True
    return is_quota_extended_resource(name)


def _status_resources_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """``hasResourcesChanged``: some container status (or init container status) of ``new`` reports other
    ``resources`` than the same-named one of ``old``, or reports them for the first time."""
    for field in ("containerStatuses", "initContainerStatuses"):
        before = {cs.get("name"): cs for cs in ((old.get("status") or {}).get(field) or []) if isinstance(cs, Mapping)}
        for cs in (new.get("status") or {}).get(field) or []:
            if not isinstance(cs, Mapping):
                continue
            prev = before.get(cs.get("name"))
            if (cs.get("resources") is not None) if prev is None else (prev.get("resources") != cs.get("resources")):
                return True
    return False


def _terminating(pod: Mapping[str, Any]) -> bool:
    """``IsTerminating``: ``spec.activeDeadlineSeconds`` >= 0."""
    deadline = (pod.get("spec") or {}).get("activeDeadlineSeconds")
    return isinstance(deadline, int) and not isinstance(deadline, bool) and deadline >= 0


def matching_resources(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if is_pod_resource(n))


@dataclass(frozen=True, slots=True)
class ScopeSelector:
    scope: str
    operator: str = "Exists"
    values: tuple[str, ...] = ()


def quota_selectors(quota: Mapping[str, Any]) -> list[ScopeSelector]:
    """``spec.scopes`` (as Exists) and ``spec.scopeSelector.matchExpressions``; InvalidInput when malformed."""
    spec = quota.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise InvalidInput("expected an object", "spec")
    out: list[ScopeSelector] = []
    scopes = spec.get("scopes") or []
    if not isinstance(scopes, list):
        raise InvalidInput("expected a list of scope names", "spec.scopes")
    for i, s in enumerate(scopes):
        out.append(ScopeSelector(_scope_name(s, f"spec.scopes[{i}]")))
    sel = spec.get("scopeSelector") or {}
    if not isinstance(sel, Mapping):
        raise InvalidInput("expected an object", "spec.scopeSelector")
    exprs = sel.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise InvalidInput("expected a list", "spec.scopeSelector.matchExpressions")
    for i, e in enumerate(exprs):
        where = f"spec.scopeSelector.matchExpressions[{i}]"
        if not isinstance(e, Mapping):
            raise InvalidInput("expected an object", where)
        name = _scope_name(e.get("scopeName"), f"{where}.scopeName")
        op = e.get("operator")
        if op not in SCOPE_OPERATORS:
            raise InvalidInput(f"Unsupported value: {op!r}: supported values: {_quoted(SCOPE_OPERATORS)}", where)
        values = e.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise InvalidInput("expected a list of strings", f"{where}.values")
        if name not in VALUED_SCOPES and op != "Exists":
            raise InvalidInput(
                f"must be 'Exists' when scope is any of ResourceQuotaScopeTerminating, ...: {name}", where
            )
        if op in ("In", "NotIn") and not values:
            raise InvalidInput(
                "must be at least one value when `operator` is 'In' or 'NotIn' for scope selector", where
            )
        out.append(ScopeSelector(name, str(op), tuple(values)))
    return out


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(f'"{v}"' for v in values)


def _scope_name(raw: object, where: str) -> str:
    if raw not in POD_SCOPES:
        raise InvalidInput(f"Unsupported value: {raw!r}: supported values: {_quoted(POD_SCOPES)}", where)
    return str(raw)


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    out: list[Mapping[str, Any]] = []
    for field in ("initContainers", "containers"):
        out.extend(c for c in spec.get(field) or [] if isinstance(c, Mapping))
    return out


def is_best_effort(pod: Mapping[str, Any]) -> bool:
    """QoS class BestEffort: no container asks for or limits cpu or memory."""
    for c in _containers(pod):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            rl = res.get(part) or {}
            if any(k in rl for k in ("cpu", "memory")):
                return False
    return True


def qos_class(pod: Mapping[str, Any]) -> str:
    """Kubernetes' pod QoS class (``qos.GetPodQOS``) from cpu and memory requests/limits."""
    if is_best_effort(pod):
        return "BestEffort"
    guaranteed = True
    for c in _containers(pod):
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for r in ("cpu", "memory"):
            if r not in lim or (r in req and Quantity.parse(req[r]) != Quantity.parse(lim[r])):
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable"


def pod_matches_scope(sel: ScopeSelector, pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    terminating = _terminating(pod)
    if sel.scope == "Terminating":
        return terminating
    if sel.scope == "NotTerminating":
        return not terminating
    if sel.scope == "BestEffort":
        return is_best_effort(pod)
    if sel.scope == "NotBestEffort":
        return not is_best_effort(pod)
    if sel.scope == "PriorityClass":
        pc = str(spec.get("priorityClassName") or "")
        if sel.operator == "Exists":
            return pc != ""
        if sel.operator == "DoesNotExist":
            return False  # the selector always sees the key (possibly empty), as Kubernetes' label set does
        if sel.operator == "In":
            return pc in sel.values
        return pc not in sel.values
    if sel.scope == "CrossNamespacePodAffinity":
        return _cross_namespace_affinity(spec)
    return False


def _cross_namespace_affinity(spec: Mapping[str, Any]) -> bool:
    """``usesCrossNamespacePodAffinity``: a pod (anti-)affinity term, required or preferred, that names namespaces or
    has a namespace selector."""
    affinity = spec.get("affinity") or {}
    for kind in ("podAffinity", "podAntiAffinity"):
        terms = affinity.get(kind) or {}
        required = terms.get("requiredDuringSchedulingIgnoredDuringExecution") or []
        preferred = [
            w.get("podAffinityTerm") or {} for w in terms.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        ]
        if any(t.get("namespaces") or t.get("namespaceSelector") is not None for t in (*required, *preferred)):
            return True
    return False


def pod_matches_quota(quota: Mapping[str, Any], pod: Mapping[str, Any], hard_names: Iterable[str]) -> bool:
    """``generic.Matches``: the quota tracks some pod resource and every scope selector matches the pod."""
    if not matching_resources(hard_names):
        return False
    return all(pod_matches_scope(s, pod) for s in quota_selectors(quota))


def _container_usage_names(container: Mapping[str, Any]) -> set[str]:
    res = container.get("resources") or {}
    req, lim = res.get("requests") or {}, res.get("limits") or {}
    names: set[str] = set()
    for r in ("cpu", "memory"):
        if r in req:
            names |= {r, f"requests.{r}"}
        if r in lim:
            names.add(f"limits.{r}")
    return names


def missing_constraints(pod: Mapping[str, Any], required: Iterable[str]) -> str | None:
    """``podEvaluator.Constraints``: ``must specify limits.cpu for: compute; …`` or None when satisfied. A pod
    with pod-level resources (``IsPodLevelResourcesSet``: a cpu, memory or hugepages value in ``spec.resources``) is
    not held to it (PodLevelResources, Kubernetes 1.34+)."""
    req = set(required) & VALIDATION_SET
    if not req or _pod_level_set(pod):
        return None
    missing: dict[str, set[str]] = {}
    for c in _containers(pod):
        for r in req - _container_usage_names(c):
            missing.setdefault(r, set()).add(str(c.get("name") or ""))
    if not missing:
        return None
    parts = [f"{r} for: {','.join(sorted(missing[r]))}" for r in sorted(missing)]
    return "must specify " + "; ".join(parts)


def _pod_level_set(pod: Mapping[str, Any]) -> bool:
    res = (pod.get("spec") or {}).get("resources")
    if not isinstance(res, Mapping):
        return False
    names = [map(str, part) if isinstance(part, Mapping) else () for part in (res.get("requests"), res.get("limits"))]
    return pod_level_set(*names)


def pretty(rl: Mapping[str, Quantity]) -> str:
    """Kubernetes' ``prettyPrint``: ``name=value`` sorted by name, joined by commas."""
    return ",".join(f"{k}={rl[k].canonical()}" for k in sorted(rl))


def _status_lists(quota: Mapping[str, Any]) -> tuple[ResourceList, ResourceList]:
    status = quota.get("status") or {}
    return (
        parse_resource_list(status.get("hard"), "status.hard"),
        parse_resource_list(status.get("used"), "status.used"),
    )


def forbidden(pod_name: str, message: str) -> ApiError:
    return ApiError(
        403,
        "Forbidden",
        f'pods "{pod_name}" is forbidden: {message}',
        {"name": pod_name, "kind": "pods"},
    )


def admit_pod(
    pod: Mapping[str, Any],
    quotas: Iterable[Mapping[str, Any]],
    *,
    now: datetime | None = None,
    old: Mapping[str, Any] | None = None,
) -> dict[str, ResourceList]:
    """The resource quota admission check of one pod create, or of a resize (``old``: the pod before it), which
    the evaluator charges what the pod grows by (Kubernetes' ``SubtractWithNonNegativeResult``).

    Returns the new ``status.used`` of every quota whose usage changes (by quota name); raises :class:`ApiError`
    403 with the real message when a quota refuses the pod.
    """
    meta = pod.get("metadata") or {}
    pod_name = str(meta.get("name") or meta.get("generateName") or "")
    interesting: list[tuple[Mapping[str, Any], str, ResourceList, ResourceList]] = []
    for quota in sorted(quotas, key=lambda q: str((q.get("metadata") or {}).get("name") or "")):
        name = str((quota.get("metadata") or {}).get("name") or "")
        try:
            hard, used = _status_lists(quota)
            if not pod_matches_quota(quota, pod, hard):
                continue
        except InvalidInput as e:
            raise ApiError(500, "InternalError", f"quota {name} is malformed: {e}") from None
        restricted = matching_resources(hard)
        problem = missing_constraints(pod, restricted)
        if problem is not None:
            raise forbidden(pod_name, f"failed quota: {name}: {problem}")
        unknown = [r for r in restricted if r not in used]
        if unknown:
            raise forbidden(pod_name, f"status unknown for quota: {name}, resources: {','.join(unknown)}")
        interesting.append((quota, name, hard, used))
    if not interesting:
        return {}
    delta = pod_quota_usage(pod, now)
    if old is not None:
        delta = growth(delta, pod_quota_usage(old, now))
        if not delta:
            return {}
    out: dict[str, ResourceList] = {}
    for _quota, name, hard, used in interesting:
        requested = only(delta, hard)
        new_used = add(used, requested)
        masked = only(new_used, requested)
        exceeded = sorted(r for r, q in masked.items() if r in hard and q > hard[r])
        if exceeded:
            raise forbidden(
                pod_name,
                f"exceeded quota: {name}, requested: {pretty(only(requested, exceeded))}, "
                f"used: {pretty(only(used, exceeded))}, limited: {pretty(only(hard, exceeded))}",
            )
        if format_resource_list(new_used) != format_resource_list(used):
            out[name] = new_used
    return out


PodUsage = Callable[[Mapping[str, Any], "datetime | None"], ResourceList]
"""What the evaluator charges a pod at a time (:func:`~shared.podusage.pod_quota_usage`, or a cached form)."""


def compute_usage(
    quota: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    *,
    now: datetime | None = None,
    usage_of: PodUsage = pod_quota_usage,
) -> tuple[ResourceList, ResourceList]:
    """What the quota controller writes: ``(status.hard, status.used)`` from ``spec.hard`` and the pods.

    Pods that cannot be evaluated (malformed resources) are skipped, as they could never have been admitted.
    """
    spec = quota.get("spec") or {}
    hard = parse_resource_list(spec.get("hard"), "spec.hard")
    selectors = quota_selectors(quota)
    _, old_used = _status_lists(quota)
    matched = matching_resources(hard)
    usage: ResourceList = {}
    if matched:
        # summed in integer nanos, with the format Quantity addition gives (the first non-zero operand's)
        nanos = dict.fromkeys(matched, 0)
        formats = dict.fromkeys(matched, _ZERO.format)
        for pod in pods:
            if selectors and not all(pod_matches_scope(s, pod) for s in selectors):
                continue
            try:
                charged = usage_of(pod, now)
            except InvalidInput:
                continue
            for k in matched:  # only the quota's resources are kept: add those, in the quota's order
                v = charged.get(k)
                if v is not None:
                    n = nanos[k]
                    if n == 0:
                        formats[k] = v.format
                    nanos[k] = n + v.nanos
        usage = {k: Quantity(n, formats[k]) for k, n in nanos.items()}
    used = {**old_used, **usage}
    return hard, only(used, hard)


class PodUsageCache:
    """:func:`~shared.podusage.pod_quota_usage` of the latest version of each pod (by uid, checked against its
    resourceVersion): the quota controller recounts a namespace's pods on every change of one of them. Whether a
    pod still counts (terminal, past its grace period) is decided on every call, as it depends on the time."""

    def __init__(self, maxsize: int = 65536) -> None:
        self._known: dict[str, tuple[str, ResourceList]] = {}
        self._maxsize = maxsize

    def __call__(self, pod: Mapping[str, Any], now: datetime | None = None) -> ResourceList:
        meta = pod.get("metadata")
        if not isinstance(meta, Mapping):
            return pod_quota_usage(pod, now)
        uid, rv = meta.get("uid"), meta.get("resourceVersion")
        if not isinstance(uid, str) or not isinstance(rv, str) or not uid or not rv:
            return pod_quota_usage(pod, now)
        found = self._known.get(uid)
        if found is not None and found[0] == rv and meta.get("deletionTimestamp") is None:
            status = pod.get("status")
            if not isinstance(status, Mapping) or status.get("phase") not in FINAL_PHASES:
                return found[1]  # (the common case: a pod that counts whatever the time, charged as before)
        if not pod_counts_for_compute(pod, now):
            return pod_quota_usage(pod, now)
        if found is None or found[0] != rv:
            if found is None and len(self._known) >= self._maxsize:
                self._known.clear()  # (more live pods than that: recounted from scratch now and then)
            found = self._known[uid] = (rv, quota_usage_of(*pod_resources(pod)))
        return found[1]


def canonical_quantities(rl: object) -> object:
    """A resource map with every quantity in its canonical form, as the API server stores typed quantities
    (``1000`` → ``1k``, ``1024Mi`` → ``1Gi``, ``1000m`` → ``1``); anything unparsable is left for validation."""
    if not isinstance(rl, Mapping):
        return rl
    out: dict[str, Any] = {}
    for k, v in rl.items():
        try:
            out[k] = Quantity.parse(v, allow_negative=True).canonical()
        except InvalidInput:
            out[k] = v
    return out


def default_pod(pod: Obj) -> Obj:
    """API-server defaulting and serialization the quota check depends on: quantities in canonical form; a
    container's missing request defaults to its limit; ``status.phase`` starts Pending with the pod's QoS class."""
    for c in _containers(pod):
        res = c.get("resources")
        if not isinstance(res, dict):
            continue
        for part in ("requests", "limits"):
            if part in res:
                res[part] = canonical_quantities(res[part])
        lim = res.get("limits")
        if isinstance(lim, Mapping) and lim:
            req = res.get("requests")
            if not isinstance(req, dict):
                req = res["requests"] = {}
            for k, v in lim.items():
                req.setdefault(k, v)
    spec = pod.get("spec")
    if isinstance(spec, dict) and isinstance(spec.get("overhead"), Mapping):
        spec["overhead"] = canonical_quantities(spec["overhead"])
    if isinstance(spec, dict) and isinstance(spec.get("resources"), dict):
        _default_pod_level(pod, spec["resources"])
    status = pod.get("status")
    if not isinstance(status, dict):
        status = pod["status"] = {}
    status.setdefault("phase", "Pending")
    status["qosClass"] = qos_class(pod)
    return pod


def _default_pod_level(pod: Obj, res: dict[str, Any]) -> None:
    """``defaultHugePagePodLimits`` and ``defaultPodRequests`` (``SetDefaults_Pod``, after the containers'): where
    ``spec.resources`` is set, a hugepage limit the containers set becomes the pod's unless the pod requests that
    size; then, where the pod has limits, a missing pod-level request of cpu or memory defaults to the containers'
    aggregate request, and any other missing one to the pod-level limit. (A pod with only pod-level limits is
    charged ``requests.*`` at those limits.)"""
    for part in ("requests", "limits"):
        if isinstance(res.get(part), Mapping):
            res[part] = canonical_quantities(res[part])
    req = dict(res.get("requests") or {})
    lim = dict(res.get("limits") or {})
    if not req and not lim:
        return
    try:
        aggregate_requests, aggregate_limits = pod_totals(pod_containers(pod))
    except InvalidInput:
        return  # (validation refuses it)
    for k, q in aggregate_limits.items():
        if k.startswith("hugepages-") and k not in req and k not in lim:
            lim[k] = q.canonical()
    if not lim:
        return
    res["limits"] = lim
    for k, q in aggregate_requests.items():
        if k in ("cpu", "memory") and k not in req:
            req[k] = q.canonical()
    for k, v in lim.items():
        if is_pod_level_resource(k) and k not in req:
            req[k] = v
    res["requests"] = req


def _runtime_class_admission(pod: Mapping[str, Any]) -> None:
    """kube-apiserver's RuntimeClass admission, which runs before quota: a pod's ``spec.overhead`` is its
    RuntimeClass's, set by the plugin; one set without a RuntimeClass is refused. The simulated cluster has no
    RuntimeClass, so a pod that names one is refused as naming one that does not exist."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    name = meta.get("name") or meta.get("generateName") or ""
    why = ""
    if spec.get("runtimeClassName"):
        why = f'RuntimeClass "{spec["runtimeClassName"]}" not found'
    elif spec.get("overhead"):
        why = "Pod Overhead set without corresponding RuntimeClass defined Overhead"
    if why:
        raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: pod rejected: {why}')


def _validate_pod_resources(pod: Mapping[str, Any]) -> None:
    meta = pod.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or ""
    try:
        pod_quota_usage({**pod, "status": {}})
    except InvalidInput as e:
        raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: {e}') from None


def _validate_quota(quota: Mapping[str, Any]) -> None:
    meta = quota.get("metadata") or {}
    name = meta.get("name") or ""
    try:
        parse_resource_list((quota.get("spec") or {}).get("hard"), "spec.hard")
        quota_selectors(quota)
    except InvalidInput as e:
        raise ApiError(422, "Invalid", f'ResourceQuota "{name}" is invalid: {e}') from None


# ---- wiring to the store ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuotaTiming:
    """Delays of the quota controller in seconds (all multiplied by ``speed``)."""

    speed: float = 1.0
    sync_delay: float = 0.05
    """Wait before each sync (the controller is fast but asynchronous)."""
    resync_period: float = 300.0
    """Full recomputation of every quota (kube-controller-manager's default is 5 minutes)."""

    def __call__(self, seconds: float) -> float:
        return seconds * self.speed


class ResourceQuotaSystem:
    """Quota admission and the quota controller on a store. ``install()`` before the store serves writes."""

    def __init__(self, store: StoreAPI, cache: Cache, timing: QuotaTiming | None = None) -> None:
        self.store = store
        self.cache = cache
        self.timing = timing or QuotaTiming()
        self._pods = store.resource("pods")
        self._quotas = store.resource("resourcequotas")
        self._priority = WorkQueue("quota-priority", self._sync)
        self._queue = WorkQueue("quota", self._sync)
        self._resync_task: asyncio.Task[None] | None = None
        self._log = get_logger(component="simcluster-quota")
        self.admitted = 0
        self.refused = 0
        self._usage_of = PodUsageCache()
        cache.subscribe("resourcequotas", self._on_quota)
        cache.subscribe("pods", self._on_pod)

    def install(self) -> None:
        self.store.add_admission(self._pods, self._admit_pod)
        self.store.add_admission(self._quotas, self._admit_quota)

    async def start(self) -> None:
        self._priority.start()
        self._queue.start()
        for quota in self.cache.list("resourcequotas"):
            self._priority.add_after(key_of(quota), self.timing(self.timing.sync_delay))
        if self._resync_task is None:
            self._resync_task = asyncio.create_task(self._resync_loop(), name="quota-resync")

    async def stop(self) -> None:
        if self._resync_task is not None:
            self._resync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync_task
            self._resync_task = None
        await self._priority.stop()
        await self._queue.stop()

    def idle(self) -> bool:
        return self._priority.idle() and self._queue.idle()

    @property
    def queues(self) -> tuple[WorkQueue, ...]:
        return (self._priority, self._queue)

    # ---- admission ----------------------------------------------------------------------------------------
    async def _admit_quota(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        if op == "DELETE" or new is None:
            return None
        _validate_quota(new)
        spec = new.get("spec")
        if isinstance(spec, dict) and "hard" in spec:
            spec["hard"] = canonical_quantities(spec["hard"])
        status = new.get("status")
        if isinstance(status, dict):
            for part in ("hard", "used"):
                if part in status:
                    status[part] = canonical_quantities(status[part])
        return new

    async def _admit_pod(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        resize = op == "UPDATE" and subresource == "resize"
        if not ((op == "CREATE" and subresource is None) or resize) or new is None:
            return None
        if not resize:
            _runtime_class_admission(new)
        _validate_pod_resources(new)
        pod = default_pod(new)
        ns = str((pod.get("metadata") or {}).get("namespace") or "")
        quotas = self.cache.list("resourcequotas", ns)
        try:
            charges = admit_pod(pod, quotas, old=default_pod(old) if resize and old is not None else None)
        except ApiError as e:
            self.refused += 1
            self._log.info("pod refused by quota", namespace=ns, message=e.message)
            raise
        for name, used in charges.items():
            await self._write_used(ns, name, used)
        self.admitted += 1
        return pod

    async def _write_used(self, ns: str, name: str, used: ResourceList) -> None:
        text = format_resource_list(used)

        def fn(obj: Obj) -> Obj | None:
            status = obj.setdefault("status", {})
            if status.get("used") == text:
                return None
            status["used"] = dict(text)
            return obj

        await self.store.mutate(self._quotas, ns, name, fn, status=True)

    # ---- controller ---------------------------------------------------------------------------------------
    def _on_quota(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        if type_ == "DELETED":
            return
        # Only a new quota or a change of spec.hard: "We ignore all updates to quota.Status because they are all
        # driven by this controller" (resource_quota_controller.go, the informer's UpdateFunc), so a status.hard
        # someone else wrote stays until spec.hard changes or the periodic full resync
        spec_hard = canonical_quantities((obj.get("spec") or {}).get("hard") or {})
        old_hard = canonical_quantities(((old or {}).get("spec") or {}).get("hard"))
        if old is None or old_hard != spec_hard:
            self._priority.add_after(key_of(obj), self.timing(self.timing.sync_delay))

    def _on_pod(self, type_: WatchType, obj: Obj, old: Obj | None) -> None:
        replenish = False
        if type_ == "DELETED":
            replenish = True
        elif type_ == "MODIFIED" and old is not None:
            # DefaultUpdateFilter: the kubelet reported other container resources (an actuated resize), the
            # Terminating scope changed, or the pod stopped counting
            replenish = (
                _status_resources_changed(old, obj)
                or _terminating(old) != _terminating(obj)
                or (pod_counts_for_compute(old) and not pod_counts_for_compute(obj))
            )
        if replenish:
            ns = key_of(obj)[0]
            for quota in self.cache.list("resourcequotas", ns):
                self._queue.add_after(key_of(quota), self.timing(self.timing.sync_delay))

    def enqueue_all(self) -> None:
        for quota in self.cache.list("resourcequotas"):
            self._queue.add(key_of(quota))

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.timing(self.timing.resync_period))
            self.enqueue_all()

    async def _sync(self, key: Key) -> None:
        ns, name = key
        if self.cache.get("resourcequotas", ns, name) is None:
            return
        now = datetime.now(UTC)

        def fn(obj: Obj) -> Obj | None:
            # Runs under the store's write lock: the pod cache is exactly the committed state.
            try:
                hard, used = compute_usage(obj, self.cache.list("pods", ns), now=now, usage_of=self._usage_of)
            except InvalidInput as e:
                self._log.warning("quota cannot be synced", namespace=ns, quota=name, error=str(e))
                return None
            status = {"hard": format_resource_list(hard), "used": format_resource_list(used)}
            old = obj.get("status") or {}
            if old.get("hard") == status["hard"] and old.get("used") == status["used"]:
                return None
            obj["status"] = {**old, **status}
            return obj

        try:
            await self.store.mutate(self._quotas, ns, name, fn, status=True)
        except ApiError as e:
            if e.code != 404:
                raise
