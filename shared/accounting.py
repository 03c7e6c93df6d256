"""A namespace's usage as a pure function of the objects in it.

:func:`account_namespace` takes the snapshots of one namespace (VMIs, migrations, pods, ResourceQuotas, the
Namespace, FailedCreate events; VMs are accepted and ignored) and returns, for every managed quota:

* ``U`` — accounted usage: each VM counted once in the quota's mode (running VMs always; pending VMs only when
  admitted), every non-VM pod at its pod usage, and the hotplug growth of pending migrations;
* ``P`` — pod usage: what the native evaluator charges the namespace's pods (``shared.podusage``);
* ``S`` — reservations, in pod terms: the launcher pod of each admitted VM whose pod does not exist yet, and the
  target pod of each pending migration;
* ``hard`` — the equation (``shared.equation``) applied to them;

plus every VM (running, admitted, refused, stopped), pod and migration with what it counts and why.

Rules (``docs/accounting.md`` explains them):

* a VM is *running* while it has a non-terminal launcher pod; running VMs always count, at the per-resource
  maximum of their launcher pods (source and target during a migration) and any pending target estimate;
* pending VMs are admitted in creation order (then name, uid): admitted iff ``U + u <= B`` for every natively
  enforced resource of every managed quota (managed quotas are unscoped); an admitted VM adds ``u`` to ``U`` and its
  launcher pod estimate to ``S``;
* estimates: the renderer's launcher pod for the VMI (the published overhead when KubeVirt published it), with the
  ``requested:`` amounts of the VMI's latest quota refusals (FailedCreate events) replacing the estimated ones;
  a migration target: the source pod's usage plus the hotplug growth, at least the rendering of the current spec,
  refusal amounts again replacing the estimate;
* only the oldest active migration of a VMI reserves a target; the others queue behind it (KubeVirt runs one at
  a time per VMI);
* launcher pods of a VMI that is not in the set count as non-VM pods (their resources are in use); terminal
  launcher pods count what the evaluator still charges them (``count/pods``);
* the result does not depend on the order of the input: objects are sorted, duplicates keep the newest version.

Only the kinds in :data:`ACCOUNTED_KINDS` are read.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from fractions import Fraction
from itertools import compress, islice
from operator import is_not
from typing import Any, Final, cast

from shared.equation import desired_hard, in_mode_terms
from shared.errors import InvalidInput
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.kubevirt.config import fallback_note
from shared.modes import (
    QuotaPolicy,
    ScopeRequirement,
    VmSize,
    mode_usage,
    pod_factor,
    quota_policy,
)
from shared.podusage import counts_for_compute, quota_usage_of
from shared.quantity import ZERO, Format, Quantity
from shared.resources import ResourceList, add, growth, is_byte_resource, maximum, minimum, nonzero, second_largest
from shared.snapshot import (
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VMI_FINAL_PHASES,
    EventSnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    Snapshot,
    VmimSnapshot,
    VmiSnapshot,
    encode,
)
from shared.vmi import VM_KIND, VMI_KIND, VMIM_KIND

ACCOUNTED_KINDS: Final[frozenset[str]] = frozenset(
    {VMI_KIND, VMIM_KIND, POD_KIND, QUOTA_KIND, NAMESPACE_KIND, KUBEVIRT_KIND, EVENT_KIND}
)
"""The kinds accounting reads (VirtualMachines are not among them: a VM counts through its VMI and pods)."""

_ONE: Final = Quantity.from_int(1)


_CLUSTER_SCOPED: Final = frozenset({NAMESPACE_KIND, KUBEVIRT_KIND})
"""Kinds every namespace's accounting reads, whatever their namespace."""

URGENT_KINDS: Final[frozenset[str]] = frozenset({VMIM_KIND, VMI_KIND, EVENT_KIND, QUOTA_KIND, POD_KIND})
"""The kinds :func:`urgency` may find urgent."""


class Urgent(IntEnum):
    """How soon the ledger accounts a namespace after a change of one of its objects (:func:`urgency`)."""

    NO = 0
    """At the namespace's debounce: nothing waits for the change."""
    SOON = 1
    """After a short delay that gathers such changes: a reservation ends (a migration or a VMI ends or goes, a VMI
    changes phase) or a VMI's ``status.activePods`` changes, so ``hard`` comes down, but nothing waits for it."""
    NOW = 2
    """At once, before other namespaces: a migration or a VM waits for the reservation this starts or corrects (a
    migration appears or becomes active, KubeVirt reports it was refused a migration's target or a VMI's launcher
    pod, a VMI appears or changes size, a quota refusal brings new amounts, a
    quota appears, goes or changes what accounting reads of it: its policy, or which resources ``spec.hard`` names,
    not the enforcer's own writes of ``spec.hard`` values and its annotations; a pod that is not a launcher pod
    appears: quota admission may have let it into room ``hard`` holds for a reservation, and ``hard`` must make
    room again)."""


def urgency(old: Snapshot | None, new: Snapshot | None) -> Urgent:
    """How soon a change of one object (``old`` → ``new``; None: absent) must be accounted: see :class:`Urgent`.
    A migration's progress through its active phases changes no reservation (the target pod's appearance ends it,
    and adds as much to ``P``); neither does a launcher pod (above all: it ends a reservation but adds as much to
    ``P``, so ``hard`` stays), a pod's update nor a quota's status. See :class:`Urgency` for repeated refusals."""
    obj = new if new is not None else old
    if obj is None:
        return Urgent.NO
    if isinstance(obj, PodSnapshot):  # (the bulk of a stream: the common case first)
        if obj.is_launcher or (old is not None and new is not None):
            return Urgent.NO
        return Urgent.NOW if new is not None else Urgent.SOON
    if isinstance(obj, VmimSnapshot):  # a reservation starts with a migration and ends when it is no longer active
        if not isinstance(new, VmimSnapshot):
            return Urgent.SOON
        if not isinstance(old, VmimSnapshot) or old.active != new.active:
            return Urgent.NOW if new.active else Urgent.SOON
        if new.rejected_by_quota and not old.rejected_by_quota:
            return Urgent.NOW  # KubeVirt was refused the target: room for it is made now, and only now
        return Urgent.NOW if old.vmi_name != new.vmi_name else Urgent.NO
    if isinstance(obj, QuotaSnapshot):  # (the enforcer's own writes, of spec.hard and its annotations, are not)
        if not isinstance(old, QuotaSnapshot) or not isinstance(new, QuotaSnapshot):
            return Urgent.NOW
        return Urgent.NOW if _quota_terms(old) != _quota_terms(new) else Urgent.NO
    if isinstance(obj, VmiSnapshot):
        if not isinstance(new, VmiSnapshot):
            return Urgent.SOON
        if not isinstance(old, VmiSnapshot) or _vmi_size(old) != _vmi_size(new):
            return Urgent.NOW
        if new.pod_refused and not old.pod_refused:
            return Urgent.NOW  # KubeVirt was refused the launcher pod: its refusal amounts now count, a nudge waits
        if old.active_pods != new.active_pods:
            return Urgent.SOON  # a pod became (or stopped being) a launcher pod: U and D change
        return Urgent.SOON if (old.phase, old.deletion_timestamp) != (new.phase, new.deletion_timestamp) else Urgent.NO
    if isinstance(obj, EventSnapshot):
        if not isinstance(old, EventSnapshot) or not isinstance(new, EventSnapshot):
            if not obj.quota_refusal:
                return Urgent.NO
            return Urgent.NOW if new is not None else Urgent.SOON  # a correction; or one that goes
        return Urgent.NOW if (old.quota_name, old.requested) != (new.quota_name, new.requested) else Urgent.NO
    return Urgent.NO


Key = tuple[str, str]
"""(cluster, namespace)."""


def waited_for(changed: Collection[Key], urgent: Mapping[Key, Urgent]) -> list[Key]:
    """The changed namespaces a migration or a VM waits for (an ``Urgent.NOW`` change), in ``urgent``'s order (that
    of their first urgent change)."""
    return [k for k, level in urgent.items() if level is Urgent.NOW and k in changed]


def schedule(
    changed: Collection[Key],
    urgent: Mapping[Key, Urgent],
    accounted_at: Mapping[Key, float],
    now: float,
    *,
    debounce: float,
    soon: float,
) -> tuple[list[Key], float | None]:
    """Which changed namespaces to account now, in order, and the seconds until the next of the others is due
    (None: none waits). ``urgent``: the highest urgency of each namespace's changes since it was last accounted
    (``accounted_at``, the same clock as ``now``; never: due at once), in the order of their first urgent change.

    A namespace is due ``debounce`` seconds after it was last accounted, ``soon`` seconds after (at most
    ``debounce``) for an ``Urgent.SOON`` change, at once for an ``Urgent.NOW`` one. While any namespace has an
    ``Urgent.NOW`` change, only those are due (first, in ``urgent``'s order), so that the next one a migration waits
    for is not held up behind the others, which wait for the next round (0 s) unless overdue by a whole
    ``debounce``."""
    first = waited_for(changed, urgent)
    hold = -debounce if first else 0.0
    due: list[Key] = []
    wait: float | None = None
    for key in changed:
        level = urgent.get(key, Urgent.NO)
        if level is Urgent.NOW:
            continue
        left = accounted_at.get(key, -math.inf) + (min(soon, debounce) if level is Urgent.SOON else debounce) - now
        if left <= hold:
            due.append(key)
        else:
            left = max(left, 0.0)
            wait = left if wait is None else min(wait, left)
    return first + sorted(due), wait


class Urgency:
    """:func:`urgency`, except that a quota refusal (a new event, or an aggregated one seen again) repeating
    the amounts of the last refusal seen for the same VMI is not urgent: KubeVirt retries a refused pod on every
    quota update, and each retry is an event with the same ``requested:`` amounts, which correct nothing the first
    did not. (When a VMI is refused with the amounts of an earlier refusal, for a later migration, the correction
    waits for the ledger's debounce.) Only the timing of accounting depends on this, never its result."""

    def __init__(self, maxsize: int = 65536) -> None:
        self._last: dict[tuple[str, str, str], tuple[str, ResourceList]] = {}
        self._maxsize = maxsize

    def __call__(self, old: Snapshot | None, new: Snapshot | None, cluster: str = "") -> Urgent:
        """How urgent the change is; ``cluster``: where the object is (a ledger may fold several)."""
        if not isinstance(new, EventSnapshot) or not new.quota_refusal:
            return urgency(old, new)
        key = (cluster, new.namespace, new.involved_uid or f"name:{new.involved_name}")
        amounts = (new.quota_name, new.requested)
        if self._last.get(key) == amounts:
            return Urgent.NO
        if len(self._last) >= self._maxsize:
            self._last.clear()
        self._last[key] = amounts
        return Urgent.NOW


def _quota_terms(q: QuotaSnapshot) -> tuple[object, ...]:
    """What accounting reads of a quota: its policy (managed or not, mode, budget, ratio), or why it cannot
    be managed, and which resources its ``spec.hard`` names (whether the launcher pods get automatic limits)."""
    try:
        policy: object = policy_of(q)
    except InvalidInput as e:
        policy = str(e)
    return (policy, frozenset(q.spec_hard))


def _vmi_size(v: VmiSnapshot) -> tuple[object, ...]:
    """What the size of a VMI's reservation (its launcher pod's estimate, a migration target's) depends on;
    ``spec`` is compared by identity (VMIs with the same kept spec share one dict, so an equal spec is the same
    object)."""
    return (
        v.vcpus,
        v.guest_memory,
        v.status_vcpus,
        v.status_guest_memory,
        v.memory_overhead,
        id(v.spec),  # (explicit requests and limits are in it: domain.resources is kept)
    )


_POD_COUNT_ONLY: Final[ResourceList] = {"count/pods": _ONE}
"""What the evaluator charges a terminal pod."""

# VM states
RUNNING: Final = "running"
ADMITTED: Final = "admitted"
REFUSED: Final = "refused"
STOPPED: Final = "stopped"

# pod roles
LAUNCHER: Final = "launcher"
MIGRATION_TARGET: Final = "migration-target"
NON_VM: Final = "non-vm"
ORPHAN_LAUNCHER: Final = "orphan-launcher"

# migration states
PENDING: Final = "pending"
TARGET_CREATED: Final = "target-created"
QUEUED: Final = "queued"
WAITING: Final = "waiting"
NOT_TRIED: Final = "not-tried"
GROWTH_REFUSED: Final = "growth-refused"


# ---- results ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VmEntry:
    name: str
    uid: str
    phase: str
    state: str
    """``running``, ``admitted`` (pending, pod reserved), ``refused`` (pending, does not fit) or ``stopped``."""
    reason: str
    size: VmSize
    pod_usage: ResourceList
    """The launcher pod usage the VM counts at (real pods, at most their rendering; else the estimate)."""
    counts: Mapping[str, ResourceList]
    """Per quota: what the VM adds to ``U`` (empty for a refused or stopped VM)."""
    reserved: ResourceList = field(default_factory=dict)
    """The launcher pod reservation (admitted VMs only)."""
    refused_by: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per quota: the resources the VM does not fit."""
    overlap: ResourceList = field(default_factory=dict)
    """What its pods are charged beyond the one launcher pod ``hard`` holds room for (the larger of them, at most
    as vmquota renders it): ``D`` in the equation."""
    unvouched: ResourceList = field(default_factory=dict)
    """The part of ``overlap`` that is not a migration target's (a second pod with no active migration: a
    finished migration's source, or a tenant's pod KubeVirt adopted; a third pod; a pod charged beyond the
    rendering): it counts as used when VMs and hotplugs are admitted."""
    pod_refused: bool = False
    """Admitted, but KubeVirt's last try to create its launcher pod was refused (VMI condition
    ``Synchronized=False``, reason ``FailedCreate``): KubeVirt needs a nudge to try again once there is room."""


@dataclass(frozen=True, slots=True)
class MigrationEntry:
    name: str
    uid: str
    vmi: str
    phase: str
    state: str
    """``pending`` (target reserved: KubeVirt was refused it), ``not-tried`` (no room held: KubeVirt has not been
    refused a target pod), ``growth-refused`` (its hotplug growth does not fit), ``target-created``, ``queued``
    (behind another migration of the VMI) or ``waiting`` (the VMI has no running launcher pod)."""
    reason: str
    reserved: ResourceList = field(default_factory=dict)
    growth: ResourceList = field(default_factory=dict)
    """Target minus source, in pod terms (hotplug)."""
    rejected_by_quota: bool = False


@dataclass(frozen=True, slots=True)
class PodEntry:
    name: str
    uid: str
    role: str
    """``launcher`` (of a VM in the set), ``migration-target``, ``non-vm`` or ``orphan-launcher``."""
    vmi: str
    active: bool
    """Charged for compute (not terminal, not past its deletion grace period)."""
    charged: ResourceList
    """What the native evaluator charges (its share of ``P``)."""
    accounted: ResourceList
    """What the pod adds to ``U`` itself (launcher pods: nothing, their VM counts)."""
    reason: str


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    policy: QuotaPolicy
    accounted: ResourceList
    """``U``."""
    pod_usage: ResourceList
    """``P``."""
    reserved: ResourceList
    """``S``."""
    overlap: ResourceList
    """``D``: what VMs' pods are charged beyond the one launcher pod per VM ``hard`` holds room for."""
    unvouched: ResourceList
    """``X``: the part of ``D`` that is no migration's target; used when VMs are admitted (``U + X/k + u <= B``)."""
    factors: Mapping[str, Fraction | None]
    """``k`` per budget resource (see ``shared.equation``)."""
    hard: ResourceList
    over_budget: tuple[str, ...]
    """Budget resources where ``U + X/k > B``."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    namespace: str
    quotas: Mapping[str, QuotaUsage]
    vms: tuple[VmEntry, ...]
    migrations: tuple[MigrationEntry, ...]
    pods: tuple[PodEntry, ...]
    errors: tuple[str, ...] = ()
    """Problems that did not stop accounting (an invalid managed quota, a VMI the renderer cannot read)."""


# ---- policies ----------------------------------------------------------------------------------------------------


def quota_scopes(q: QuotaSnapshot) -> tuple[ScopeRequirement, ...]:
    out = [ScopeRequirement(s) for s in q.scopes]
    out += [ScopeRequirement(s.scope_name, s.operator, tuple(s.values)) for s in q.scope_selector]
    return tuple(out)


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


# ---- helpers ---------------------------------------------------------------------------------------------------


def _rv_key(s: Snapshot) -> tuple[int, str]:
    return (s.rv_order, s.resource_version)


def _latest(objs: Iterable[Snapshot]) -> list[Snapshot]:
    """One snapshot per object (kind, uid or name): the newest resourceVersion; ties broken by the encoded form."""
    best: dict[tuple[str, str], Snapshot] = {}
    for s in objs:
        key = (type(s).__name__, s.uid or f"name:{s.name}")
        cur = best.get(key)
        if cur is None or (_rv_key(s), repr(s)) > (_rv_key(cur), repr(cur)):
            best[key] = s
    return list(best.values())


def _event_order(e: EventSnapshot) -> tuple[bool, datetime, str, str]:
    """Order of events: by last time (events without one first), then name and uid."""
    return (e.last_timestamp is not None, e.last_timestamp or datetime.min, e.name, e.uid)


def _created_key(s: Snapshot) -> tuple[bool, datetime, str, str]:
    """Creation order; objects without a creation time last, then by name and uid."""
    ts = s.creation_timestamp
    return (ts is None, ts or datetime.min, s.name, s.uid)


def _order(objs: Iterable[Snapshot]) -> list[Any]:
    return sorted(objs, key=_created_key)


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


def _unpublished(v: VmiSnapshot) -> dict[str, Any]:
    """The VMI object without its status (and so without the overhead published for its current pod)."""
    obj = v.as_object()
    obj.pop("status", None)
    return obj


def _widened(estimate: Mapping[str, Quantity]) -> ResourceList:
    """Each amount of ``estimate`` plus its :func:`evidence_bound`."""
    return {r: q + evidence_bound(r, q) for r, q in estimate.items()}


def _current_size(v: VmiSnapshot) -> VmSize:
    """The size a VM runs at now: its status where the status says (hotplug not yet handed over), else its spec."""
    return VmSize.of(
        v.status_vcpus if v.status_vcpus is not None else v.vcpus,
        v.status_guest_memory if v.status_guest_memory is not None else v.guest_memory,
        None,
        None,
    )


@dataclass(frozen=True, slots=True)
class _Target:
    """A migration that may reserve its target pod: the oldest active one of a VMI with a running source pod and
    no target pod yet."""

    index: int
    """Its place among the migration entries."""
    m: VmimSnapshot
    v: VmiSnapshot
    estimate: ResourceList
    grow: ResourceList
    why: list[str]


def _migration_entry(
    m: VmimSnapshot, state: str, reason: str, reserved: ResourceList | None = None, grow: ResourceList | None = None
) -> MigrationEntry:
    return MigrationEntry(
        m.name, m.uid, m.vmi_name, m.phase, state, reason, reserved or {}, grow or {}, m.rejected_by_quota
    )


def _fmt(rl: Mapping[str, Quantity]) -> str:
    return ", ".join(f"{k}={rl[k]}" for k in sorted(rl)) or "nothing"


class _Memo:
    """Values derived from objects, one per *slot* (a VMI's estimate, a VM's entry, a namespace's pod pass, a
    sum's chunks): only the latest version of an object is worth keeping, so the memo is as large as the live
    objects, not as their history (which would also make every full garbage collection walk the history). A value
    is kept with the objects it was derived from and the inputs it depends on (``key``); a hit needs an equal key
    and the very same objects (a key of their ids: the entry keeps them alive, so no other object has those ids)
    or objects with the same encoded form, so a reused identity with other content (a fixture, a restored object)
    is recomputed, never served stale: a result is the same with and without the memo. Slots least recently
    written go first when it is full."""

    __slots__ = ("_latest", "_maxsize", "_next_token", "_tokens")

    def __init__(self, maxsize: int) -> None:
        self._latest: dict[Hashable, tuple[Hashable, tuple[object, ...], Any]] = {}
        self._maxsize = maxsize
        self._tokens: dict[Hashable, int] = {}
        self._next_token = 0

    def get_latest(self, slot: Hashable, key: Hashable, objs: tuple[Snapshot, ...] | None = None) -> Any:
        """The value last remembered in ``slot`` if it was for ``key`` (and, given ``objs``, for the same or equal
        objects), else :data:`_MISS`."""
        hit = self._latest.get(slot)
        if hit is None or hit[0] != key:
            return _MISS
        if objs is not None:
            kept = hit[1]
            if len(kept) != len(objs):
                return _MISS
            for a, b in zip(kept, objs, strict=True):
                if a is not b and encode(a) != encode(b):  # type: ignore[arg-type]  # Quantity equality ignores the format: compare the wire form
                    return _MISS
        return hit[2]

    def latest(
        self, slot: Hashable, key: Hashable, objs: tuple[object, ...], compute: Callable[..., Any], *args: Any
    ) -> Any:
        """The value in ``slot`` for ``key`` (a key made of ids of ``objs``), else ``compute(*args)``, remembered."""
        hit = self._latest.get(slot)
        if hit is not None and hit[0] == key:
            return hit[2]
        found = compute(*args)
        self.put_latest(slot, key, objs, found)
        return found

    def last(self, slot: Hashable) -> tuple[Hashable, tuple[object, ...], Any] | None:
        """What ``slot`` holds, whatever its key: (key, objects, value)."""
        return self._latest.get(slot)

    def put_latest(self, slot: Hashable, key: Hashable, objs: tuple[object, ...], value: Any) -> None:
        latest = self._latest
        latest.pop(slot, None)
        latest[slot] = (key, objs, value)
        if len(latest) > self._maxsize:
            del latest[next(iter(latest))]

    def token(self, value: Hashable) -> int:
        """A small number standing for ``value`` in keys (cheap to hash); never reused for another value."""
        tokens = self._tokens
        t = tokens.get(value)
        if t is None:
            if len(tokens) >= 256:
                tokens.clear()
            t = tokens[value] = self._next_token
            self._next_token += 1
        return t


_MISS: Final = object()
_MEMO_SIZE: Final = 65536
"""Memo slots per KubeVirt configuration: three or four per VM (estimates, its entry, its pods' entries) and a few
per namespace and quota; past that (some 15,000 VMs), misses only cost time."""
_MEMO_KEY: Final = ("shared.accounting", "memo")
"""Where the memo lives in ``KubeVirtConfig.cache``."""

_config_memo: tuple[KubeVirtSnapshot, KubeVirtConfig] | None = None


def _config_of(kv: KubeVirtSnapshot | None, memoize: bool) -> KubeVirtConfig:
    """The configuration of a KubeVirt snapshot (KubeVirt's defaults without one); the last one is remembered so
    that its memoised estimates survive from one accounting to the next."""
    global _config_memo
    if kv is None:
        return _DEFAULT_CONFIG if memoize else KubeVirtConfig()
    memo = _config_memo
    if memoize and memo is not None and (memo[0] is kv or encode(memo[0]) == encode(kv)):
        return memo[1]
    config = KubeVirtConfig.from_cr(kv.as_object())
    if memoize:
        _config_memo = (kv, config)
    return config


_DEFAULT_CONFIG: Final = KubeVirtConfig()


def _memo_of(config: KubeVirtConfig) -> _Memo:
    """The memo of values derived under this configuration (kept in its cache: they depend on it)."""
    memo = config.cache.get(_MEMO_KEY)
    if not isinstance(memo, _Memo):
        memo = config.cache[_MEMO_KEY] = _Memo(_MEMO_SIZE)
    return memo


def _facts_key(facts: NamespaceFacts) -> Hashable:
    return (tuple(sorted(facts.labels.items())), facts.quota_has_limits_cpu, facts.quota_has_limits_memory)


class _Renderer:
    """Renders launcher pods of VMI snapshots for one namespace; remembers failures as errors. With ``memoize``,
    estimates are remembered per (VMI uid, resourceVersion, namespace facts) in the configuration's cache."""

    def __init__(self, config: KubeVirtConfig, facts: NamespaceFacts, memo: _Memo | None) -> None:
        self.config = config
        self.facts = facts
        self.errors: list[str] = []
        self.memo = memo
        self.facts_key = _facts_key(facts)

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
        if memo is None:
            return compute()
        slot = ("vmi", v.uid or v.name, what)
        key = (v.resource_version, v.name, self.facts_key)
        hit = memo.get_latest(slot, key, (v,))
        if hit is not _MISS:
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
        result: ResourceList | None = self._memoized(v, "new", lambda: self.usage(_unpublished(v), v.ref))
        return result

    def hotplug_growth(self, v: VmiSnapshot) -> ResourceList:
        """Pod-terms growth of a VMI whose spec is larger than its status (hotplug awaiting a migration)."""
        result: ResourceList = self._memoized(v, "hotplug", lambda: self._hotplug_growth(v))
        return dict(result)  # it goes into a MigrationEntry: not the remembered one

    def _hotplug_growth(self, v: VmiSnapshot) -> ResourceList:
        grow_cpu = v.status_vcpus is not None and v.status_vcpus < v.vcpus
        grow_mem = (
            v.status_guest_memory is not None and v.guest_memory is not None and v.status_guest_memory < v.guest_memory
        )
        if not (grow_cpu or grow_mem):
            return {}
        target = _unpublished(v)  # the published overhead is the source's; compute both sides alike
        source = copy.deepcopy(target)
        domain = source["spec"].setdefault("domain", {})
        if grow_cpu and v.status_vcpus is not None:
            cpu = dict(domain.get("cpu") or {})
            per_socket = max(1, int(cpu.get("cores") or 1) * int(cpu.get("threads") or 1))
            cpu["sockets"] = max(1, v.status_vcpus // per_socket)
            domain["cpu"] = cpu
        if grow_mem and v.status_guest_memory is not None:
            memory = dict(domain.get("memory") or {})
            memory["guest"] = v.status_guest_memory.canonical()
            domain["memory"] = memory
        after = self.usage(target, v.ref)
        before = self.usage(source, v.ref)
        if after is None or before is None:
            return {}
        return growth(after, before)


_CHUNK_MAX: Final = 64


def _summary(chunk: Sequence[Mapping[str, Quantity]]) -> _ChunkSum | None:
    """Per resource: the sum in nanos (keys in order of first appearance), the format of the first non-zero
    operand and that of the last operand; None when an operand is negative (then only adding in order is exact)."""
    nanos: dict[str, int] = {}
    first: dict[str, Format] = {}
    last: dict[str, Format] = {}
    for rl in chunk:
        for k, q in rl.items():
            n = q.nanos
            if n < 0:
                return None
            nanos[k] = nanos.get(k, 0) + n
            if n and k not in first:
                first[k] = q.format
            last[k] = q.format
    return nanos, first, last


_ChunkSum = tuple[dict[str, int], dict[str, Format], dict[str, Format]]
_SumValue = tuple[dict[str, int], dict[str, Format], bool]
"""A sum's total as a memo keeps it: nanos and format per resource, and whether it was added in order."""
_ADD_MAX: Final = 4
"""At most this many lists queued on a sum that has a total are added one by one (no chunks)."""
_AMEND_MAX: Final = 8
"""At most this many lists changed in place for :func:`_amended` to be tried (beyond, the chunks are cheaper)."""


def _amended(
    before: Sequence[object],
    value: _SumValue,
    now: Sequence[Mapping[str, Quantity]],
) -> tuple[dict[str, int], dict[str, Format]] | None:
    """The sum of ``now`` from the sum of ``before`` (``value``: nanos, formats, exact) when they are the same lists
    but for a few replaced in place with the same resources in the same order, and the result is what adding ``now``
    in order gives: every amount non-negative, no sum that is zero afterwards (its format is then the last
    operand's), and no replaced operand that is or becomes the first non-zero one of its resource with another
    format than the sum keeps. Else None: the caller sums the chunks."""
    nanos, fmt, exact = value
    if exact or len(before) != len(now):
        return None
    lists = cast(Sequence[Mapping[str, Quantity]], before)  # (a sum's memo keeps the lists it added)
    changed = list(compress(range(len(now)), map(is_not, lists, now)))
    if len(changed) > _AMEND_MAX:
        return None
    out = dict(nanos)
    for i in changed:
        old, new = lists[i], now[i]
        if tuple(old) != tuple(new):
            return None
        for k, q in new.items():
            o, n, f = old[k].nanos, q.nanos, fmt.get(k)
            if o < 0 or n < 0 or f is None:
                return None
            if ((o and not n) or (n and q.format != f)) and not any(rl.get(k, ZERO).nanos for rl in islice(now, i)):
                return None  # (it was or becomes the first non-zero operand: the format follows it)
            out[k] += n - o
    if any(not out[k] for i in changed for k in now[i]):
        return None
    return out, dict(fmt)


_PodsPass = tuple[
    tuple["PodEntry", ...],
    dict[str, list[tuple[PodSnapshot, ResourceList]]],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
]
"""Pod entries, launcher pods per VM, and the lists every quota adds to ``P`` and to ``U``."""
_VmsPass = tuple[
    tuple[tuple[str, "VmEntry"], ...],
    tuple[VmiSnapshot, ...],
    tuple[tuple[ResourceList, ...], ...],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
]
"""Entries of running and stopped VMs, pending VMs, per quota the lists running VMs add to ``U``, and the lists
every quota adds to ``D`` and to ``X``."""


class _Sum:
    """A running sum of resource lists in integer nanos, as ``Quantity`` addition in order gives it (values,
    formats, key order); :meth:`result` builds the quantities once.

    With a memo, added lists are queued and folded in chunks whose sums are remembered by the identity of their
    lists (the chunks of this sum's last accounting, in the memo's slot ``("chunks", slot)``): the lists of
    memoised entries (a running VM's counts, a pod's usage) are the same objects from one accounting to the next,
    so after one change only the chunk it is in is summed again. Folding a chunk's sum gives what adding its lists
    in order gives as long as nothing is negative (checked; else lists are added one by one). A sum of the very
    same lists as the last accounting's but for a few replaced in place is amended instead (:func:`_amended`), and
    sums of one accounting that add the very same lists from nothing (quotas covering the same pods) are summed
    once (``alike``: the totals of this accounting's sums by the identities of their lists)."""

    __slots__ = ("_chunks_before", "_chunks_now", "alike", "exact", "fmt", "memo", "nanos", "pending", "slot")

    def __init__(
        self,
        memo: _Memo | None = None,
        slot: Hashable = None,
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], _SumValue]] | None = None,
    ) -> None:
        self.nanos: dict[str, int] = {}
        self.fmt: dict[str, Format] = {}
        self.memo = memo
        self.slot = slot
        """Which sum this is (namespace, quota, term), where its latest total is remembered."""
        self.alike = alike
        self.pending: list[Mapping[str, Quantity]] = []
        self.exact = memo is None
        """Add list by list (no memo, or a negative amount was seen)."""
        self._chunks_before: dict[tuple[int, ...], tuple[tuple[object, ...], _ChunkSum | None]] | None = None
        self._chunks_now: dict[tuple[int, ...], tuple[tuple[object, ...], _ChunkSum | None]] = {}

    def add(self, rl: Mapping[str, Quantity]) -> None:
        if self.exact:
            self._add(rl)
        else:
            self.pending.append(rl)

    def extend(self, rls: Iterable[Mapping[str, Quantity]]) -> None:
        if self.exact:
            for rl in rls:
                self._add(rl)
        else:
            self.pending.extend(rls)

    def _add(self, rl: Mapping[str, Quantity]) -> None:
        nanos, fmt = self.nanos, self.fmt
        for k, q in rl.items():
            cur = nanos.get(k, 0)
            if not cur:  # as Quantity addition: the first non-zero operand's format
                fmt[k] = q.format
            nanos[k] = cur + q.nanos

    def _flush(self) -> None:
        pending = self.pending
        if not pending:
            return
        self.pending = []
        if self.nanos and len(pending) <= _ADD_MAX:  # a few lists on top (admitted VMs): add them as they are
            for rl in pending:
                self._add(rl)
                if not self.exact and any(q.nanos < 0 for q in rl.values()):
                    self.exact = True  # (from here on in order: chunk sums are exact only without negatives)
            return
        memo = self.memo
        whole: tuple[Mapping[str, Quantity], ...] = ()
        if memo is not None and not self.nanos and not self.exact:
            # the same lists from nothing (quotas covering the same pods, a namespace where only VMs changed)
            whole = tuple(pending)
            key = tuple(map(id, whole))
            last = memo.last(self.slot)
            if last is not None and last[0] == key:
                value = last[2]
            else:
                found_alike = None if self.alike is None else self.alike.get(key)
                value = None if found_alike is None else found_alike[1]
                if value is None and last is not None:
                    found = _amended(last[1], last[2], whole)
                    value = None if found is None else (*found, False)
                if value is not None:
                    memo.put_latest(self.slot, key, whole, value)
            if value is not None:
                nanos, fmt, self.exact = value
                self.nanos, self.fmt = dict(nanos), dict(fmt)
                if self.alike is not None:
                    self.alike[key] = (whole, value)
                return
        self._chunks(pending)
        if whole and memo is not None:
            value = (dict(self.nanos), dict(self.fmt), self.exact)
            memo.put_latest(self.slot, key, whole, value)
            if self.alike is not None:
                self.alike[key] = (whole, value)  # (the lists kept with it: their ids stay theirs)

    def _chunks(self, pending: list[Mapping[str, Quantity]]) -> None:
        start = 0
        for i, rl in enumerate(pending):
            # a chunk ends after a list chosen by its identity (1 in 16): adding or removing one list changes
            # only the chunk it is in
            if ((id(rl) >> 4) * 2654435761) & 0xFFFF < 0x1000 or i + 1 - start >= _CHUNK_MAX:
                self._fold(pending[start : i + 1])
                start = i + 1
        if start < len(pending):
            self._fold(pending[start:])

    def _fold(self, chunk: list[Mapping[str, Quantity]]) -> None:
        memo = self.memo
        summary: _ChunkSum | None = None
        if memo is not None and not self.exact:
            before = self._chunks_before
            if before is None:  # the first chunk of this accounting: this sum's chunks of the last one
                slot = ("chunks", self.slot)
                found = memo.get_latest(slot, None)
                before = self._chunks_before = {} if found is _MISS else found
                memo.put_latest(slot, None, (), self._chunks_now)
            objs = tuple(chunk)
            key = tuple(map(id, objs))  # the chunk's lists are kept with its sum: equal ids, the same lists
            hit = before.get(key)
            summary = _summary(objs) if hit is None else hit[1]
            self._chunks_now[key] = (objs, summary)
        if summary is None:
            self.exact = True
            for rl in chunk:
                self._add(rl)
            return
        nanos, fmt = self.nanos, self.fmt
        s_nanos, s_first, s_last = summary
        for k, n in s_nanos.items():
            cur = nanos.get(k, 0)
            if not cur:  # (never negative here: only non-negative chunks were folded so far)
                f = s_first.get(k)
                fmt[k] = s_last[k] if f is None else f
            nanos[k] = cur + n

    def get(self, resource: str) -> int:
        if self.pending:
            self._flush()
        return self.nanos.get(resource, 0)

    def result(self) -> ResourceList:
        self._flush()
        return {k: Quantity(n, self.fmt[k]) for k, n in self.nanos.items()}


@dataclass
class _Quota:
    policy: QuotaPolicy
    factors: dict[str, Fraction | None]
    ratio: Fraction
    accounted: _Sum
    pod_usage: _Sum
    reserved: _Sum
    overlap: _Sum
    unvouched: _Sum

    def used(self, r: str) -> int:
        """``U + X / k`` of ``r`` in nanos (rounded up): what admission counts as used. ``hard`` holds no room for
        ``X`` at all, so in the mode's terms it costs ``X / k``: a VM admitted beside it then gets in natively."""
        return self.accounted.get(r) + in_mode_terms(self.unvouched.get(r), self.factors.get(r))

    def misfits(self, u: Mapping[str, Quantity]) -> tuple[str, ...]:
        """Natively enforced budget resources that ``U + X/k + u`` would exceed."""
        return tuple(
            sorted(
                r
                for r, b in self.policy.budget.items()
                if self.factors[r] is not None  # (factors cover the budget)
                and r in u
                and self.used(r) + u[r].nanos > b.nanos
            )
        )


# ---- the function ----------------------------------------------------------------------------------------------


def account_namespace(
    objects: Iterable[Snapshot],
    *,
    now: datetime,
    config: KubeVirtConfig | None = None,
    policies: Sequence[QuotaPolicy] | None = None,
    namespace: str | None = None,
    memoize: bool = True,
    distinct: bool = False,
    kinds: Mapping[str, Sequence[Snapshot]] | None = None,
) -> NamespaceUsage:
    """Account one namespace.

    ``objects``: the namespace's snapshots in any order (objects of other namespaces are ignored when
    ``namespace`` is given, else they are an error). ``now`` decides which terminating pods are past their grace
    period. ``config``: the cluster's KubeVirt configuration (default: a KubeVirt snapshot among ``objects``, else
    KubeVirt's defaults). ``policies``: the quotas to account for (default: the managed ResourceQuotas among
    ``objects``; a managed quota with invalid annotations is skipped and reported in ``errors``). ``memoize``:
    reuse what earlier calls derived from the same objects (launcher pod estimates per VMI uid, resourceVersion,
    configuration and namespace facts; the configuration of the same KubeVirt snapshot), so that accounting a
    namespace again after one change costs little; the result is the same either way (False: the reference).
    ``distinct``: the caller guarantees one version per object (a ledger view), so looking for duplicates is
    skipped; given duplicates anyway, the result is unspecified.

    ``kinds`` (with ``namespace``, in place of ``objects``, which are then ignored): the objects already split
    by kind (kind → snapshots of that kind: the namespace's own and the cluster-scoped Namespaces and KubeVirt
    CRs), one version each, as a ledger view holds them (``distinct`` is implied). The lists are read, never
    changed; one that is the same list object as in the last accounting of the namespace is not sorted again. Same
    result as ``objects``.
    """
    return _Accounting(
        objects,
        now=now,
        config=config,
        policies=policies,
        namespace=namespace,
        memoize=memoize,
        distinct=distinct,
        kinds=kinds,
    ).run()


def _size(v: VmiSnapshot) -> VmSize:
    return VmSize.of(v.vcpus, v.guest_memory, v.status_vcpus, v.status_guest_memory)


def _vm_key(v: VmiSnapshot) -> str:
    return v.uid or f"name:{v.name}"


def _pick_source(sources: list[tuple[PodSnapshot, ResourceList]], v: VmiSnapshot) -> tuple[PodSnapshot, ResourceList]:
    """The migration source: the VMI's newest pod on its node, else its newest pod."""
    on_node = [pc for pc in sources if v.node_name and pc[0].node_name == v.node_name]
    pool = on_node or sources
    return max(
        pool,
        key=lambda pc: (pc[0].creation_timestamp is not None, pc[0].creation_timestamp or datetime.min, pc[0].name),
    )


class _Accounting:
    """One run of :func:`account_namespace` (a builder; not reused)."""

    def __init__(
        self,
        objects: Iterable[Snapshot],
        *,
        now: datetime,
        config: KubeVirtConfig | None,
        policies: Sequence[QuotaPolicy] | None,
        namespace: str | None,
        memoize: bool,
        distinct: bool = False,
        kinds: Mapping[str, Sequence[Snapshot]] | None = None,
    ) -> None:
        self.now = now
        self.errors: list[str] = []
        if kinds is not None:
            if namespace is None:
                raise InvalidInput("objects given by kind need their namespace", "namespace")
            self.namespace = namespace
            self._split(kinds)
        else:
            objs = list(objects) if distinct else _latest(objects)
            if namespace is None:
                names = {
                    s.namespace
                    for s in objs
                    if s.namespace and not isinstance(s, (NamespaceSnapshot, KubeVirtSnapshot))
                }
                if len(names) > 1:
                    raise InvalidInput(f"objects of several namespaces given: {', '.join(sorted(names))}", "namespace")
                namespace = names.pop() if names else ""
            self.namespace = namespace
            self._sort(objs)
        if config is None:
            config = _config_of(self.kv_obj, memoize)
            note = fallback_note(self.kv_obj.version) if self.kv_obj is not None else None
            if note is not None:
                self.errors.append(note)
        self.config = config
        self.memo = _memo_of(config) if memoize else None
        self._shared_lists = kinds is not None
        self.vmis: list[VmiSnapshot] = self._ordered(VMI_KIND)
        self.vmims: list[VmimSnapshot] = self._ordered(VMIM_KIND)
        self.pods: list[PodSnapshot] = self._ordered(POD_KIND)
        self.quotas = self._policies(policies)
        hard_keys = {r for q in self.quota_objs for r in q.spec_hard} | {
            r for q in self.quotas for r in q.policy.budget
        }
        facts = NamespaceFacts(
            labels=dict(self.ns_obj.labels) if self.ns_obj is not None else {},
            quota_has_limits_cpu="limits.cpu" in hard_keys,
            quota_has_limits_memory="limits.memory" in hard_keys,
        )
        self.renderer = _Renderer(config, facts, self.memo)
        self.quotas_key = (
            -1
            if self.memo is None
            else self.memo.token(tuple((q.policy.name, q.policy.mode, q.ratio) for q in self.quotas))
        )
        """What a VM's counts depend on besides the VM: the quotas' names, modes and ratios."""
        self.vouched: dict[str, VmiSnapshot] = {pod: v for v in self.vmis for pod in v.active_pods}
        """Launcher pods by uid, as KubeVirt names them in its VMIs' ``status.activePods``."""
        self.vmi_by_name = {v.name: v for v in self.vmis}
        self.vmim_by_uid = {m.uid: m for m in self.vmims if m.uid}
        self.launchers: dict[str, list[tuple[PodSnapshot, ResourceList]]] = {}
        self.pod_entries: list[PodEntry] = []
        self.mig_entries: list[MigrationEntry] = []
        self.targets: list[_Target] = []
        self.target_reserved: ResourceList = {}
        """The part of every quota's ``S`` reserved for migration targets."""
        self.vm_entries: dict[str, VmEntry] = {}
        self.pending: list[VmiSnapshot] = []

    # ---- input
    def _sort(self, objs: list[Snapshot]) -> None:
        """Objects in any order, one version each: the namespace's and the cluster-scoped ones (Namespaces, KubeVirt
        CRs) by kind, for :meth:`_split`; VirtualMachines are skipped (a VM counts through its VMI and pods)."""
        kinds: dict[str, list[Snapshot]] = {}
        for s in objs:
            kind = type(s).__struct_config__.tag
            if kind in _CLUSTER_SCOPED or s.namespace == self.namespace:
                found = kinds.get(kind)  # type: ignore[arg-type]
                if found is None:
                    found = kinds[kind] = []  # type: ignore[index]
                found.append(s)
        for kind in kinds.keys() - ACCOUNTED_KINDS - {VM_KIND}:
            s = kinds[kind][0]
            raise InvalidInput(f"unexpected snapshot type {type(s).__name__}", s.ref)
        self._split(kinds)

    def _split(self, kinds: Mapping[str, Sequence[Snapshot]]) -> None:
        """The objects of a ledger view, by kind (see :func:`account_namespace`)."""
        self.ns_obj: NamespaceSnapshot | None = None
        for s in kinds.get(NAMESPACE_KIND, ()):
            if s.name == self.namespace and isinstance(s, NamespaceSnapshot):
                self.ns_obj = s
                break
        kvs = [s for s in kinds.get(KUBEVIRT_KIND, ()) if isinstance(s, KubeVirtSnapshot)]
        self.kv_obj: KubeVirtSnapshot | None = min(kvs, key=lambda s: (s.namespace, s.name)) if kvs else None
        self._take(
            kinds.get(VMI_KIND, ()),  # type: ignore[arg-type]  # the view's lists hold their kind's snapshots
            kinds.get(VMIM_KIND, ()),  # type: ignore[arg-type]
            kinds.get(POD_KIND, ()),  # type: ignore[arg-type]
            kinds.get(QUOTA_KIND, ()),  # type: ignore[arg-type]
            kinds.get(EVENT_KIND, ()),  # type: ignore[arg-type]
        )

    def _take(
        self,
        vmis: Sequence[VmiSnapshot],
        vmims: Sequence[VmimSnapshot],
        pods: Sequence[PodSnapshot],
        quotas: Sequence[QuotaSnapshot],
        events: Sequence[EventSnapshot],
    ) -> None:
        self._unordered: dict[str, Sequence[Snapshot]] = {VMI_KIND: vmis, VMIM_KIND: vmims, POD_KIND: pods}
        self.quota_objs = sorted(quotas, key=lambda q: q.name)
        self.refusals_by_uid: dict[str, list[EventSnapshot]] = {}
        """Quota refusals by the uid of the VMI they are about (when the event names it)."""
        self.refusals_by_name: dict[str, list[EventSnapshot]] = {}
        """Quota refusals by the name of the VMI they are about."""
        for e in events:
            if e.quota_refusal:
                if e.involved_uid:
                    self.refusals_by_uid.setdefault(e.involved_uid, []).append(e)
                self.refusals_by_name.setdefault(e.involved_name, []).append(e)

    def _ordered(self, kind: str) -> list[Any]:
        """The objects of ``kind`` in creation order. With a memo and lists given by kind, the order of the same
        list object as in the namespace's last accounting (a ledger view shares a kind's list until the kind
        changes, and never changes it in place) is the one computed then."""
        objs = self._unordered[kind]
        memo = self.memo
        if memo is None or not self._shared_lists:
            return _order(objs)
        return memo.latest(("order", self.namespace, kind), id(objs), (objs,), _order, objs)  # type: ignore[no-any-return]

    def _policies(self, policies: Sequence[QuotaPolicy] | None) -> list[_Quota]:
        memo = self.memo
        kv_ratio, overcommit = self.config.cpu_allocation_ratio, self.config.memory_overcommit
        terms: list[tuple[QuotaPolicy, Fraction, dict[str, Fraction | None]]] | None = None
        if policies is None and memo is not None:
            # (a function of the quota objects and the configuration: the same while they are the same objects)
            slot = ("policies", self.namespace)
            key = (tuple(map(id, self.quota_objs)), kv_ratio, overcommit)
            hit = memo.last(slot)
            if hit is not None and hit[0] == key:
                terms, errors = hit[2]
                self.errors.extend(errors)
        if terms is None:
            before = len(self.errors)
            terms = self._quota_terms(policies, kv_ratio, overcommit)
            if policies is None and memo is not None:
                memo.put_latest(slot, key, tuple(self.quota_objs), (terms, self.errors[before:]))
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], _SumValue]] | None = None if memo is None else {}
        out: list[_Quota] = []
        for pol, ratio, factors in terms:
            sums = [_Sum(memo, ("sum", self.namespace, pol.name, term), alike) for term in ("U", "P", "S", "D", "X")]
            out.append(_Quota(pol, factors, ratio, *sums))
        return out

    def _quota_terms(
        self, policies: Sequence[QuotaPolicy] | None, kv_ratio: Fraction, overcommit: int
    ) -> list[tuple[QuotaPolicy, Fraction, dict[str, Fraction | None]]]:
        """Each managed quota's policy (given, or read from the quota objects: an invalid one is reported in
        ``errors`` and skipped), in name order, with its CPU allocation ratio and its factors ``k``."""
        if policies is None:
            found: list[QuotaPolicy] = []
            for qo in self.quota_objs:
                try:
                    pol = policy_of(qo)
                except InvalidInput as err:
                    self.errors.append(f"{qo.ref}: not managed: {err}")
                    continue
                if pol is not None:
                    found.append(pol)
            policies = found
        out = []
        for pol in sorted(policies, key=lambda p: p.name):
            ratio = pol.ratio(kv_ratio)
            factors = {
                r: pod_factor(pol.mode, r, kubevirt_ratio=kv_ratio, memory_overcommit=overcommit, mode_ratio=ratio)
                for r in pol.budget
            }
            out.append((pol, ratio, factors))
        return out

    def run(self) -> NamespaceUsage:
        self._pods()
        self._migrations()
        self._running_vms()
        self._admissions()
        results: dict[str, QuotaUsage] = {}
        for q in self.quotas:
            b = q.policy.budget
            accounted, pod_usage, reserved = q.accounted.result(), q.pod_usage.result(), q.reserved.result()
            overlap, unvouched = q.overlap.result(), q.unvouched.result()
            results[q.policy.name] = QuotaUsage(
                policy=q.policy,
                accounted=accounted,
                pod_usage=pod_usage,
                reserved=reserved,
                overlap=overlap,
                unvouched=unvouched,
                factors=q.factors,
                hard=desired_hard(b, accounted, pod_usage, reserved, q.factors, overlap, self.target_reserved),
                over_budget=tuple(sorted(r for r in b if q.used(r) > b[r].nanos)),
            )
        return NamespaceUsage(
            namespace=self.namespace,
            quotas=results,
            vms=tuple(self.vm_entries[_vm_key(v)] for v in self.vmis),
            migrations=tuple(self.mig_entries),
            pods=tuple(self.pod_entries),
            errors=tuple(self.errors + self.renderer.errors),
        )

    # ---- pods: what each is charged, and whose it is
    def _owner(self, p: PodSnapshot) -> VmiSnapshot | None:
        """The VMI whose launcher pod ``p`` is: only a VMI whose ``status.activePods`` (written by KubeVirt alone)
        names the pod's uid. Labels and owner references are the tenant's to write: a pod that only carries them
        is a plain pod."""
        return self.vouched.get(p.uid) if p.uid else None

    def _pods(self) -> None:
        """Each pod's entry and what it adds to ``P`` and ``U``. With a memo, the whole pass is remembered: it
        depends on the pods, on the VMIs' and migrations' names and uids (owners, reasons), on the quotas and on
        ``now`` only for pods being deleted."""
        memo = self.memo
        if memo is None:
            self._apply_pods(self._pods_pass())
            return
        deleting = tuple(
            counts_for_compute(p.phase, p.deletion_timestamp, p.deletion_grace_period_seconds, self.now)
            for p in self.pods
            if p.deletion_timestamp is not None
        )
        key = (
            "pods",
            tuple(map(id, self.pods)),
            tuple((v.uid, v.name, tuple(v.active_pods)) for v in self.vmis),
            tuple((m.uid, m.name) for m in self.vmims),
            deleting,
            self.quotas_key,
        )
        self._apply_pods(memo.latest(("pods", self.namespace), key, tuple(self.pods), self._pods_pass))

    def _apply_pods(self, found: _PodsPass) -> None:
        entries, launchers, pod_usage, accounted = found
        self.pod_entries = list(entries)
        self.launchers = launchers  # read only from here on
        for q in self.quotas:  # (every managed quota covers every pod)
            q.pod_usage.extend(pod_usage)
            q.accounted.extend(accounted)

    def _pods_pass(self) -> _PodsPass:
        """Every quota covers every pod (managed quotas are unscoped): one list of charges for all of them."""
        entries: list[PodEntry] = []
        launchers: dict[str, list[tuple[PodSnapshot, ResourceList]]] = {}
        pod_usage: list[ResourceList] = []
        accounted: list[ResourceList] = []
        memo = self.memo
        now = self.now
        for p in self.pods:
            active = counts_for_compute(p.phase, p.deletion_timestamp, p.deletion_grace_period_seconds, now)
            v = self._owner(p)
            mig = self.vmim_by_uid.get(p.migration_job_uid) if p.migration_job_uid else None
            if memo is None:
                entry = self._pod_entry(p, v, active, mig)
            else:
                # an entry is a function of the pod, whether it is charged for compute and whose it is
                owner = None if v is None else (v.uid, v.name)
                key = (id(p), active, owner, mig.name if mig is not None else None)
                slot = ("pod", self.namespace, p.uid or p.name)
                entry = memo.latest(slot, key, (p,), self._pod_entry, p, v, active, mig)
            charged = entry.charged
            pod_usage.append(charged)
            if v is not None and active:  # a VM's running launcher pod: it counts through its VM
                launchers.setdefault(_vm_key(v), []).append((p, charged))
            else:
                accounted.append(charged)
            entries.append(entry)
        return tuple(entries), launchers, tuple(pod_usage), tuple(accounted)

    def _pod_entry(self, p: PodSnapshot, v: VmiSnapshot | None, active: bool, mig: VmimSnapshot | None) -> PodEntry:
        """A pod's entry: what it is charged, and what it adds to ``U`` itself (nothing when it is the running
        launcher pod of a VM, which counts through its VM)."""
        charged = p.usage if active else _POD_COUNT_ONLY  # shared, not copied: results are not to be changed
        if v is None:
            role = ORPHAN_LAUNCHER if p.is_launcher else NON_VM
            reason = (
                "labelled as a launcher pod, but no VMI's status.activePods names it: pod usage"
                if p.is_launcher
                else "pod usage"
            )
            if not active:
                reason += "; terminal or past its grace period: count/pods only"
            return PodEntry(p.name, p.uid, role, "", active, charged, charged, reason)
        role = MIGRATION_TARGET if p.migration_job_uid else LAUNCHER
        if not active:
            # the evaluator still charges count/pods: count it too, or a VM refused on count/pods would get in
            reason = "terminal or past its grace period: count/pods only"
            return PodEntry(p.name, p.uid, role, v.name, active, charged, charged, reason)
        if role == MIGRATION_TARGET:
            reason = f"target of migration {mig.name if mig else p.migration_job_uid}: counted with VM {v.name}"
        else:
            reason = f"counted with VM {v.name}"
        return PodEntry(p.name, p.uid, role, v.name, active, charged, {}, reason)

    # ---- FailedCreate events
    def _refusals(self, v: VmiSnapshot, since: datetime | None) -> ResourceList:
        """Merged ``requested:`` amounts of the VMI's quota refusals at or after ``since`` (later events win)."""
        by_name = self.refusals_by_name.get(v.name, ())
        if v.uid:  # the events that name this uid, and those that name no uid but this VMI's name
            found = [*self.refusals_by_uid.get(v.uid, ()), *(e for e in by_name if not e.involved_uid)]
        else:
            found = list(by_name)
        out: ResourceList = {}
        for e in sorted(found, key=_event_order):
            if since is not None and e.last_timestamp is not None and e.last_timestamp < since:
                continue
            out.update(e.requested)
        return out

    # ---- migrations: the oldest active one per VMI may reserve its target
    def _migrations(self) -> None:
        seen: set[str] = set()
        for m in self.vmims:
            if not m.active:
                continue
            entry = self._migration(m, seen)
            self.mig_entries.append(entry)

    def _migration(self, m: VmimSnapshot, seen: set[str]) -> MigrationEntry:
        """A migration's entry; the oldest active one of a VMI with a running source pod and no target yet is a
        :class:`_Target`, decided once running VMs are counted (:meth:`_decide_targets`)."""
        v = self.vmi_by_name.get(m.vmi_name)
        if v is None:
            return _migration_entry(m, WAITING, "VMI not found")
        key = _vm_key(v)
        if key in seen:
            return _migration_entry(m, QUEUED, "queued behind an older migration of the same VMI")
        seen.add(key)
        vm_pods = self.launchers.get(key, [])
        targets = [pc for pc in vm_pods if m.uid and pc[0].migration_job_uid == m.uid]
        sources = [pc for pc in vm_pods if not (m.uid and pc[0].migration_job_uid == m.uid)]
        if targets:
            grow = growth(targets[0][1], _pick_source(sources, v)[1]) if sources else {}
            return _migration_entry(
                m, TARGET_CREATED, f"target pod {targets[0][0].name} exists: charged in P", None, grow
            )
        if not sources:
            return _migration_entry(m, WAITING, "the VMI has no running launcher pod")
        source_pod, source_usage = _pick_source(sources, v)
        memo = self.memo
        if memo is None:
            estimate, grow, reasons = self._target_estimate(v, source_pod, source_usage)
        else:  # (a function of the VMI and the source pod, as long as they are the same objects)
            slot = ("target", self.namespace, _vm_key(v))
            args = (v, source_pod, source_usage)
            estimate, grow, reasons = memo.latest(slot, tuple(map(id, args)), args, self._target_estimate, *args)
        why = list(reasons)
        if m.rejected_by_quota:  # (a status condition only KubeVirt writes: it really tried to create the pod)
            refused = self._refusals(v, m.creation_timestamp)
            estimate, taken = self._bounded(estimate, refused, f"{m.ref} (VMI {v.name})")
            if taken:
                why.append(f"exact amounts from a quota refusal: {_fmt(taken)}")
        self.targets.append(_Target(len(self.mig_entries), m, v, nonzero(estimate), dict(grow), why))
        return _migration_entry(m, NOT_TRIED, "")  # (replaced by the decision)

    def _target_estimate(
        self, v: VmiSnapshot, source_pod: PodSnapshot, source_usage: ResourceList
    ) -> tuple[ResourceList, ResourceList, tuple[str, ...]]:
        """A migration target's estimate before any refusal's amounts, the hotplug growth, and why. Not to be
        changed."""
        grow = self.renderer.hotplug_growth(v)
        estimate = add(source_usage, grow)
        rendered = self.renderer.new_pod_usage(v)
        if rendered is not None:
            # the source pod's real charge may exceed the rendering (overhead vmquota does not know), but only
            # within the evidence bound: the "source" may be a tenant's pod KubeVirt adopted into the VMI
            estimate = maximum(minimum(estimate, _widened(rendered)), rendered)
        why = [f"target estimated from source pod {source_pod.name}"]
        if grow:
            why.append(f"hotplug growth {_fmt(grow)}")
        return estimate, grow, tuple(why)

    def _decide_target(self, t: _Target, admit: bool) -> None:
        """Reserve a migration's target while KubeVirt is refused it (``migrationRejectedByResourceQuota``), never
        for one KubeVirt has not tried (held back by the parallel-migration limits, or still to try: the room
        would be open to any pod). A hotplug's growth in the mode's terms is new usage, admitted in creation order
        like a new VM (``admit``); one that does not fit gets no room and the VM keeps its current size."""
        cur = self.vm_entries[_vm_key(t.v)]
        memo = self.memo
        if memo is None:
            grown = self._grown(t, cur)
        else:
            # a function of the VMI, its entry (memoised: the same object while unchanged), the estimate and the
            # quotas; the estimate by value and wire format (it is built anew on every accounting)
            est = tuple((r, q.nanos, q.format) for r, q in t.estimate.items())
            memo_key = (id(t.v), id(cur), est, self.quotas_key)
            slot = ("grown", self.namespace, _vm_key(t.v))
            grown = memo.latest(slot, memo_key, (t.v, cur), self._grown, t, cur)
        why = list(t.why)
        if admit:
            misfit, parts = self._misfits(grown)
            if misfit:
                why.append(
                    "hotplug growth does not fit: " + "; ".join(parts) + "; the VM keeps running at its current size"
                )
                self.mig_entries[t.index] = _migration_entry(t.m, GROWTH_REFUSED, "; ".join(why), None, t.grow)
                return
            why.append("hotplug growth admitted in creation order")
        for q in self.quotas:
            q.accounted.add(grown[q.policy.name])
        if not t.m.rejected_by_quota:
            why.append(
                "no room held: KubeVirt has not been refused its target pod (room is made once it is, and only then)"
            )
            self.mig_entries[t.index] = _migration_entry(t.m, NOT_TRIED, "; ".join(why), None, t.grow)
            return
        why.insert(0, "target reserved: KubeVirt reported migrationRejectedByResourceQuota")
        for q in self.quotas:
            q.reserved.add(t.estimate)
        self.target_reserved = add(self.target_reserved, t.estimate)
        self.mig_entries[t.index] = _migration_entry(t.m, PENDING, "; ".join(why), t.estimate, t.grow)

    def _grown(self, t: _Target, cur: VmEntry) -> dict[str, ResourceList]:
        """Per quota, what the migration's target adds to the VM's count in the mode's terms (hotplug growth;
        an upgrade's larger pod in pod terms). Not to be changed."""
        full = _size(t.v)
        return {
            q.policy.name: growth(
                mode_usage(q.policy.mode, full, maximum(cur.pod_usage, t.estimate), q.ratio), cur.counts[q.policy.name]
            )
            for q in self.quotas
        }

    # ---- VMs
    def _running_vms(self) -> None:
        """Running VMs always count; the others are stopped or wait for admission. With a memo, the whole pass is
        remembered: it depends on the VMIs, their launcher pods (the pod pass's result), the active migrations and
        the quotas."""
        memo = self.memo
        if memo is None:
            self._apply_vms(self._vms_pass())
            return
        objs = (*self.vmis, self.launchers)
        # (the active migrations decide whose pods are targets)
        active = tuple(sorted((m.uid, m.vmi_name) for m in self.vmims if m.active and m.uid))
        key = ("vms", tuple(map(id, objs)), active, self.quotas_key)
        self._apply_vms(memo.latest(("vms", self.namespace), key, objs, self._vms_pass))

    def _apply_vms(self, found: _VmsPass) -> None:
        entries, pending, accounted, overlap, unvouched = found
        self.vm_entries.update(entries)
        self.pending = list(pending)
        for q, acc in zip(self.quotas, accounted, strict=True):
            q.accounted.extend(acc)
            q.overlap.extend(overlap)
            q.unvouched.extend(unvouched)

    def _vms_pass(self) -> _VmsPass:
        entries: list[tuple[str, VmEntry]] = []
        pending: list[VmiSnapshot] = []
        accounted: list[list[ResourceList]] = [[] for _ in self.quotas]
        overlap: list[ResourceList] = []
        unvouched: list[ResourceList] = []
        memo = self.memo
        namespace, quotas_key = self.namespace, self.quotas_key
        every = [(q.policy.name, added) for q, added in zip(self.quotas, accounted, strict=True)]  # (each VM, each)
        for v in self.vmis:
            key = _vm_key(v)
            vm_pods = self.launchers.get(key, [])
            if not vm_pods:
                if v.phase in VMI_FINAL_PHASES or v.deletion_timestamp is not None:
                    what = f"phase {v.phase}" if v.phase in VMI_FINAL_PHASES else "being deleted"
                    reason = f"{what}, no running launcher pod: counts nothing"
                    entries.append((key, VmEntry(v.name, v.uid, v.phase, STOPPED, reason, _size(v), {}, {})))
                else:
                    pending.append(v)
                continue
            migrating = self._migrating(v, vm_pods)
            if memo is None:
                entry = self._running_vm(v, vm_pods, migrating)
            else:
                # the entry is a function of the VMI, its active launcher pods, whether it migrates and the quotas
                memo_obj = (v, *(p for p, _ in vm_pods))
                memo_slot = ("running", namespace, key)
                memo_key = (tuple(map(id, memo_obj)), migrating, quotas_key)
                entry = memo.latest(memo_slot, memo_key, memo_obj, self._running_vm, v, vm_pods, migrating)
            counts = entry.counts
            for name, added in every:
                added.append(counts[name])
            if entry.overlap:
                overlap.append(entry.overlap)
            if entry.unvouched:
                unvouched.append(entry.unvouched)
            entries.append((key, entry))
        return tuple(entries), tuple(pending), tuple(map(tuple, accounted)), tuple(overlap), tuple(unvouched)

    def _migrating(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]]) -> bool:
        """Whether one of the VM's pods is the target of an active migration of this VMI (a migration's phase is
        KubeVirt's to write; the pod's label alone is anyone's): the one case where a VM has two pods."""
        for p, _ in vm_pods:
            m = self.vmim_by_uid.get(p.migration_job_uid) if p.migration_job_uid else None
            if m is not None and m.active and m.vmi_name == v.name:
                return True
        return False

    def _running_vm(self, v: VmiSnapshot, vm_pods: list[tuple[PodSnapshot, ResourceList]], migrating: bool) -> VmEntry:
        """A running VM counts at its current size (its status: a hotplug request counts once admitted, see
        :meth:`_decide_target`), or at its spec size while an active migration's target pod exists for it; in pod
        terms at the larger of its launcher pods per resource, at most as vmquota renders its launcher pod at that
        size. (A pod's labels say nothing here: a launcher pod keeps the ``migrationJobUID`` label of the migration
        that made it. When a hotplug's migration has ended and KubeVirt has not updated the status yet, the pod
        made for the new size is charged beyond that rendering: the difference is ``unvouched``.)

        ``hard`` holds room for one launcher pod per VM, the larger of its pods but at most as vmquota renders it;
        what its pods are charged beyond that is its ``overlap`` (``D``), so that the end of either pod of a
        migration frees nothing another pod could take. Every pod the VMI controls is in its
        ``status.activePods``, a tenant's pod with a forged controller reference too, so only a migration's
        target (of an active migration: its phase is KubeVirt's to write) is believed to be a second launcher
        pod; the rest of the overlap is ``unvouched`` and counts as used when VMs are admitted."""
        charges = [charged for _, charged in vm_pods]
        pod_max: ResourceList = {}
        for charged in charges:
            pod_max = maximum(pod_max, charged)
        size = _size(v) if migrating else _current_size(v)
        cap = self.renderer.vmi_usage(v) or {}  # (a VM that cannot be rendered: hard holds no room for its pods)
        if not migrating and cap:  # its launcher pod as rendered at its current size (a hotplug not yet admitted)
            grow = self.renderer.hotplug_growth(v)
            if grow:
                cap = {r: (q - grow[r]).clamp0() if r in grow else q for r, q in cap.items()}
        believed = minimum(pod_max, cap)
        counts = {q.policy.name: mode_usage(q.policy.mode, size, believed, q.ratio) for q in self.quotas}
        total = pod_max
        if len(charges) > 1:  # (the common case, one pod, has nothing to add up)
            total = {}
            for charged in charges:
                total = add(total, charged)
        overlap = growth(total, believed)
        target = nonzero(minimum(second_largest(charges), cap)) if migrating else {}
        unvouched = growth(overlap, target)
        reason = "running: always counts"
        if len(charges) > 1:
            reason += f" (at the larger of its {len(charges)} launcher pods per resource)"
        if unvouched:
            reason += (
                f"; its pods are charged {_fmt(unvouched)} beyond one launcher pod"
                f"{' and its migration target' if migrating else ''} as vmquota renders them: counted as used"
            )
        return VmEntry(
            v.name, v.uid, v.phase, RUNNING, reason, size, believed, counts, overlap=overlap, unvouched=unvouched
        )

    def _admissions(self) -> None:
        """Pending VMs and hotplug growth, in creation order (a VMI's, a migration's), after every running VM and
        pod is counted; then the migrations without growth."""
        items: list[tuple[tuple[bool, datetime, str, str], int, VmiSnapshot | _Target]] = [
            (_created_key(v), i, v) for i, v in enumerate(self.pending)
        ]
        plain: list[_Target] = []
        for t in self.targets:
            if t.grow:
                items.append((_created_key(t.m), len(items), t))
            else:
                plain.append(t)
        for _, _, item in sorted(items, key=lambda it: it[:2]):
            if isinstance(item, _Target):
                self._decide_target(item, admit=True)
            else:
                self._admit(item)
        for t in plain:  # the same VM, moving: it needs no admission, only (maybe) room for its second pod
            self._decide_target(t, admit=False)

    def _misfits(self, usages: Mapping[str, ResourceList]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
        """Per quota, the budget resources ``U + usages[quota]`` would exceed, and a line for each."""
        misfit: dict[str, tuple[str, ...]] = {}
        parts: list[str] = []
        for q in self.quotas:
            u = usages[q.policy.name]
            rs = q.misfits(u)
            if not rs:
                continue
            misfit[q.policy.name] = rs
            left = {r: Quantity(max(q.policy.budget[r].nanos - q.used(r), 0), q.policy.budget[r].format) for r in rs}
            detail = ", ".join(f"{r} needs {u[r]} but {left[r]} is left" for r in rs)
            parts.append(f"quota {q.policy.name}: {detail}" if q.policy.name else detail)
        return misfit, parts

    def _admit(self, v: VmiSnapshot) -> None:
        """A pending VM (no launcher pod yet), in creation order: admitted iff it fits every managed quota."""
        key = _vm_key(v)
        size = _size(v)
        estimate = self.renderer.new_pod_usage(v) or {}
        taken: ResourceList = {}
        pod_est = dict(estimate)
        if v.pod_refused:  # (a status condition only KubeVirt writes: it really tried to create the pod)
            pod_est, taken = self._bounded(estimate, self._refusals(v, v.creation_timestamp), v.ref)
        pod_est = nonzero(pod_est)
        usages = {q.policy.name: mode_usage(q.policy.mode, size, pod_est, q.ratio) for q in self.quotas}
        misfit, parts = self._misfits(usages)
        if misfit:
            reason = "pending, does not fit: " + "; ".join(parts)
            self.vm_entries[key] = VmEntry(v.name, v.uid, v.phase, REFUSED, reason, size, pod_est, {}, {}, misfit)
            return
        for q in self.quotas:
            q.accounted.add(usages[q.policy.name])
            q.reserved.add(pod_est)
        reason = "pending, admitted in creation order: launcher pod reserved"
        if taken:
            reason += f" (exact amounts from a quota refusal: {_fmt(taken)})"
        if not estimate:
            reason += "; its launcher pod could not be estimated (see errors)"
        self.vm_entries[key] = VmEntry(
            v.name, v.uid, v.phase, ADMITTED, reason, size, pod_est, usages, pod_est, pod_refused=v.pod_refused
        )

    def _bounded(
        self, estimate: Mapping[str, Quantity], refused: Mapping[str, Quantity], ref: str
    ) -> tuple[ResourceList, ResourceList]:
        """The estimate with the amounts of quota refusals in place of estimated ones, each only within
        :func:`evidence_bound` of the estimate (an Event is anyone's to write: evidence, not truth); the others
        are ignored and reported. Returns the corrected estimate and the amounts taken."""
        out = dict(estimate)
        taken: ResourceList = {}
        for r, amount in sorted(refused.items()):
            est = estimate.get(r)
            bound = evidence_bound(r, est) if est is not None else None
            if est is not None and bound is not None and abs(amount.nanos - est.nanos) <= bound.nanos:
                out[r] = taken[r] = amount
            else:
                within = f"{est} ± {bound}" if est is not None else "nothing (not estimated)"
                self.errors.append(
                    f"{ref}: quota refusal amount {r}={amount} ignored: the estimate is {within}, and an Event "
                    "may correct an estimate only within that bound"
                )
        return out, taken
