"""What the enforcer does to one ResourceQuota, as a pure function of the quota and the ledger's usage.

A quota is *managed* while it carries the label ``vmquota.io/managed: "true"``. The enforcer then owns its
``spec.hard`` and keeps three annotations of its own on it (``docs/quota.md`` is the user's guide):

* ``vmquota.io/budget`` — the budget ``B`` (JSON map of resource names to canonical quantities). Written at
  adoption from the administrator's ``spec.hard``; the administrator changes the budget by editing it;
* ``vmquota.io/last-hard`` — the ``spec.hard`` the enforcer last wrote. A ``spec.hard`` that differs from it was
  written by someone else (a person, a GitOps tool, Rancher's agent): it is taken as the new budget and reported;
* ``vmquota.io/status`` — one line: ``Enforcing (<mode>)``, ``Waiting for usage (<mode>)`` or ``Refused: <why>``.

:func:`plan` decides, from the quota (a :class:`~shared.snapshot.QuotaSnapshot` at some resourceVersion) and the
namespace's latest :class:`~shared.contract.UsageSnapshot`, one of:

* nothing (the quota already carries what it should);
* *adopt* / *adjust*: write ``spec.hard`` and our annotations. ``spec.hard`` is the quota equation's result for
  this quota as the ledger evaluated it (``QuotaTerms.hard``, from ``shared.quota.equation.desired_hard``), taken only
  when the ledger evaluated it with the budget and mode the quota states now; otherwise the enforcer records the
  budget and waits for the ledger's next usage snapshot (its own annotation write triggers one);
* *refuse*: a scoped quota, an unknown mode, an unreadable annotation: a status annotation and a Warning Event;
  a quota that was already adopted falls back to native quota with its budget as ``spec.hard``;
* *release*: the label is gone but our annotations are still there: ``spec.hard`` = budget, our annotations
  removed.

:func:`patch_body` turns a plan into the JSON merge patch (with ``metadata.resourceVersion``, so a stale plan
409s), and every plan carries the one-line human reason of the change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from fnmatch import fnmatchcase
from fractions import Fraction
from typing import Any, Final

from shared.contract import (
    MigrationState,
    QuotaTerms,
    UsageSnapshot,
    check_namespace,
)
from shared.errors import InvalidInput
from shared.quantity import ZERO, Quantity
from shared.quota.annotations import (
    BUDGET_ANNOTATION,
    ENFORCED_BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    RATIO_ANNOTATION,
    STATUS_ANNOTATION,
    USAGE_ANNOTATION,
    USAGE_FROM_ANNOTATION,
    VMI_MINIMUM_ANNOTATIONS,
)
from shared.quota.equation import within_charged
from shared.quota.modes import (
    VM_TERM_MODES,
    Mode,
    QuotaPolicy,
    cel_trim,
    is_managed,
    parse_budget,
    parse_mode,
    policy_of,
)
from shared.report import names_list, nonzero, readable_list, used_of_budget
from shared.report import readable as human_quantity
from shared.resources import ResourceList, canonical_resource_list, format_resource_list, parse_resource_list
from shared.snapshot import QuotaSnapshot
from shared.times import parse_rfc3339

__all__ = [
    "DEFAULT_EXCLUDED_NAMESPACES",
    "OWN_ANNOTATIONS",
    "Action",
    "Budget",
    "Plan",
    "check_hard_bound",
    "check_usage",
    "excluded",
    "human_quantity",
    "patch_body",
    "plan",
    "resolve_budget",
]

OWN_ANNOTATIONS: Final = (
    BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    ENFORCED_BUDGET_ANNOTATION,
    STATUS_ANNOTATION,
    USAGE_ANNOTATION,
    USAGE_FROM_ANNOTATION,
    *VMI_MINIMUM_ANNOTATIONS.values(),
)
"""The annotations the enforcer writes (and removes when it hands a quota back). The mode and ratio annotations
belong to the administrator and are never written."""

# Kubernetes Event reasons
ADOPTED: Final = "QuotaAdopted"
ADJUSTED: Final = "QuotaAdjusted"
BUDGET_CHANGED: Final = "BudgetChanged"
RELEASED: Final = "QuotaReleased"
REFUSED: Final = "QuotaRefused"
VM_QUOTA_EXCEEDED: Final = "VMQuotaExceeded"
"""On a VMI: what it asks for (the VM, or a hotplug) does not fit the budget."""

NORMAL: Final = "Normal"
WARNING: Final = "Warning"


class Action(StrEnum):
    NONE = "none"
    ADOPT = "adopt"
    ADJUST = "adjust"
    REFUSE = "refuse"
    RELEASE = "release"
    REFRESH = "refresh"
    """Only the ``vmquota.io/usage`` summary is out of date: the enforcer writes it at most once per
    ``usage_refresh_interval`` per quota, and reports nothing (it is not a decision)."""


HANDING_BACK: Final = frozenset({Action.RELEASE, Action.REFUSE})
"""The actions that hand a quota back to native quota."""


# ---- formatting --------------------------------------------------------------------------------------------------


def rl_json(rl: Mapping[str, Quantity]) -> str:
    """A resource list as the annotations hold it: compact JSON, sorted keys, canonical quantities."""
    return json.dumps(format_resource_list(rl), separators=(",", ":"), sort_keys=True)


def _items(rl: Mapping[str, Quantity]) -> str:
    return ", ".join(f"{r}={rl[r].canonical()}" for r in sorted(rl)) or "nothing"


def same(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> bool:
    """Equal as ``spec.hard`` values: the same resource names with the same amounts."""
    return a.keys() == b.keys() and all(a[k] == b[k] for k in a)


# ---- where the enforcer never writes -----------------------------------------------------------------------------

DEFAULT_EXCLUDED_NAMESPACES: Final = ("kube-*", "kubevirt", "vmquota-system")
"""Namespaces whose quotas the enforcer never touches, labelled or not: Kubernetes' own, KubeVirt's and
vmquota's (shell-style patterns, ``--exclude-namespaces``)."""


def excluded(namespace: str, patterns: Sequence[str]) -> bool:
    """``namespace`` matches one of the shell-style ``patterns`` (``kube-*``): the enforcer leaves its quotas
    alone."""
    return any(fnmatchcase(namespace, p) for p in patterns)


# ---- the budget --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    """The budget a managed quota states now, and where it came from."""

    budget: ResourceList
    adopting: bool
    """No budget annotation yet: the budget is the administrator's ``spec.hard``."""
    foreign: bool = False
    """The budget is ``spec.hard`` as someone else wrote it (it differs from ``vmquota.io/last-hard``)."""
    previous: ResourceList | None = None
    """The budget annotation a foreign write replaces."""
    note: str = ""
    """Something the reason line should mention (an unreadable last-hard annotation)."""


def _annotation_list(q: QuotaSnapshot, key: str) -> ResourceList | None:
    raw = q.annotations.get(key)
    return None if raw is None else parse_budget(raw, f"{q.ref}: metadata.annotations.{key}")


def resolve_budget(q: QuotaSnapshot) -> Budget:
    """The budget of a quota (managed or being released). InvalidInput names the quota and annotation when the
    budget annotation is unreadable, or when it was removed while the enforcer still owns ``spec.hard``."""
    budget = _annotation_list(q, BUDGET_ANNOTATION)
    note = ""
    try:
        last = _annotation_list(q, LAST_HARD_ANNOTATION)
    except InvalidInput:
        last, note = None, f"annotation {LAST_HARD_ANNOTATION} was unreadable and is rewritten"
    if last is not None and not same(q.spec_hard, last):
        if budget is not None and same(q.spec_hard, budget):
            # The budget written again as spec.hard (a GitOps tool re-applying the unchanged manifest): the budget
            # did not change, so no BudgetChanged; the enforced hard is simply written back.
            return Budget(budget, adopting=False, note="spec.hard was set to the budget again and is enforced again")
        return Budget(dict(q.spec_hard), adopting=budget is None, foreign=True, previous=budget)
    if budget is not None:
        return Budget(budget, adopting=False, note=note)
    if last is not None:
        raise InvalidInput(
            f"annotation {BUDGET_ANNOTATION} was removed while vmquota owns spec.hard: write the budget back "
            f"(e.g. {rl_json(last)} as it was last enforced), or set spec.hard to the new budget",
            f"{q.ref}: metadata.annotations.{BUDGET_ANNOTATION}",
        )
    return Budget(dict(q.spec_hard), adopting=True, note=note)


def check_manageable(q: QuotaSnapshot) -> QuotaPolicy:
    """The policy of a managed quota; InvalidInput when the enforcer must refuse it (a scope, an unknown mode, an
    unreadable CPU allocation ratio or budget). The same rule the ledger's accounting applies
    (``shared.quota.modes.quota_policy``), so a quota the enforcer refuses never counts in admission either."""
    policy = policy_of(q)
    if policy is None:  # not labelled managed: callers only ask about managed quotas
        raise InvalidInput("the quota is not labelled vmquota.io/managed=true", f"{q.ref}: metadata.labels")
    return policy


def policy_label(q: QuotaSnapshot, mode: Mode) -> str:
    """What the status names the policy by: the mode, and in ``VirtualResourcesWithCPUAllocationRatio`` the quota's
    own ratio as written (trimmed), so that the reservation guard's ``vmquota-vm-terms`` policy, which builds the
    same text from the quota, sees a ratio changed since the status was written at once."""
    raw = q.annotations.get(RATIO_ANNOTATION)
    if mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO and raw is not None:
        return f"{mode.value}, ratio {cel_trim(raw)}"
    return mode.value


def check_usage(u: UsageSnapshot) -> None:
    """Validate what the enforcer reads of a usage snapshot (namespace, every quota's mode and quantities), so that
    a malformed one is refused as a whole instead of half-applied. InvalidInput names the quota and field."""
    check_namespace(u.namespace, "usage: namespace")
    for name, t in u.quotas.items():
        where = f"usage {u.namespace}: quotas.{name}"
        parse_mode(t.mode, f"{where}.mode")
        lists = {
            f: parse_resource_list(getattr(t, f), f"{where}.{f}")
            for f in ("budget", "used", "pods", "reserved", "overlap", "unvouched", "taken", "hard")
        }
        check_hard_bound(lists, where)


def usage_mark(u: UsageSnapshot) -> str:
    """``<seq> <time>`` of a usage snapshot: what :func:`usage_is_older` compares (:data:`USAGE_FROM_ANNOTATION`)."""
    return f"{u.seq} {u.time}"


def _read_mark(mark: str) -> tuple[int, datetime] | None:
    """``(seq, time)`` of a :func:`usage_mark`, or None when it cannot be read."""
    seq, _, time = mark.partition(" ")
    t = parse_rfc3339(time)
    try:
        return (int(seq), t) if t is not None else None
    except ValueError:
        return None


def mark_order(mark: str) -> tuple[datetime, int]:
    """A :func:`usage_mark` as something to sort by: its time, then its ``seq`` (one that cannot be read first)."""
    read = _read_mark(mark)
    return (read[1], read[0]) if read is not None else (_EPOCH, 0)


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def usage_is_older(u: UsageSnapshot, mark: str) -> bool:
    """Whether snapshot ``u`` of a namespace was folded no further (``seq``) and published before (``time``) the
    one ``mark`` (:func:`usage_mark`) stands for, which the enforcer holds or last wrote a quota from: a copy of an
    older snapshot, which a reader of the bus can have JetStream store after the newer ones. A snapshot folded
    further, or published later (the ledger's own republish; the events stream created anew starts the sequences
    again), is not, nor the same one again. A mark or a time that cannot be read compares as not older."""
    held, t = _read_mark(mark), parse_rfc3339(u.time)
    return held is not None and t is not None and u.seq <= held[0] and t < held[1]


def status_astray(q: QuotaSnapshot) -> bool:
    """``status.hard`` names the resources ``spec.hard`` names, one of them at another amount: quota admission
    checks an amount ``spec.hard`` does not say (a write of ``status.hard`` whose ``spec.hard`` never followed, an
    enforcer's that lost its Lease in between and whose successor had nothing to write; or the quota controller's
    copy of an older ``spec.hard``), which the controller copies over only when ``spec.hard`` changes or at its
    resync, minutes later. A quota that says so is planned again whatever else changed (:func:`plan` repairs it)."""
    return bool(q.status_hard) and q.status_hard.keys() == q.spec_hard.keys() and not same(q.status_hard, q.spec_hard)


def check_hard_bound(terms: Mapping[str, ResourceList], where: str) -> None:
    """What a usage snapshot may ask for: ``hard <= B + P + S`` for every resource, and only the budget's
    resources. The equation gives ``hard = P + S + R`` with ``R = k * B - W - D`` (or zero), ``k <= 1`` and
    ``W, D >= 0``, so ``R <= B`` and a snapshot that asks for more is not the equation's result (a forged or
    corrupted one) whatever its other terms say. The bound is on the snapshot's own terms: it stops a snapshot
    from opening room it does not account for, not one that states a large ``P`` (see docs/operations.md,
    "Security model")."""
    budget, pods, reserved = terms["budget"], terms["pods"], terms["reserved"]
    for r, h in terms["hard"].items():
        if r not in budget:
            raise InvalidInput(f"hard names {r}, which the budget does not", f"{where}.hard.{r}")
        bound = budget[r] + pods.get(r, ZERO) + reserved.get(r, ZERO)
        if h > bound:
            raise InvalidInput(
                f"hard {h.canonical()} exceeds budget + pods + reserved = {bound.canonical()}: not the quota "
                "equation's result",
                f"{where}.hard.{r}",
            )


# ---- the plan ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """What to write to one quota, and why. ``hard_after`` equals ``hard_before`` when ``spec.hard`` stays."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    """The version of the quota the plan was made from (the patch's precondition)."""
    action: Action
    mode: str = ""
    budget: ResourceList = field(default_factory=dict)
    hard_before: ResourceList = field(default_factory=dict)
    hard_after: ResourceList = field(default_factory=dict)
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    """Our annotations to set (None: remove), only those that change."""
    event_type: str = NORMAL
    event_reason: str = ""
    reason: str = ""
    """One line: what changes and why."""
    usage_seq: int = 0
    status_hard: ResourceList = field(default_factory=dict)
    """The quota's ``status.hard`` when the plan was made: what quota admission checks."""
    charged_names: frozenset[str] = frozenset()
    """The resources the quota's ``status.used`` has a value for."""
    charged: ResourceList = field(default_factory=dict)
    """The quota's ``status.used`` the plan held ``hard`` within (:func:`~shared.quota.equation.within_charged`), in
    the resources of ``hard_after``: what a decision records, so that ``hard`` is derived again from the usage and
    it (``vmquota replay --verify``)."""
    status_only: bool = False
    """Of the two, ``status.hard`` alone is written: a plan that writes it and leaves ``spec.hard`` as it is (a repair,
    a quota handed back), or one written as far as its ``status.hard`` (:meth:`status_written`). Its decision's
    ``hard_before`` and ``hard_after`` are those of ``status.hard``."""

    @property
    def set_hard(self) -> bool:
        """``spec.hard`` is to be written."""
        return not same(self.hard_after, self.hard_before)

    @property
    def set_status(self) -> bool:
        """``status.hard`` is to be written too, before ``spec.hard``: what the quota controller would copy there on
        its next sync, written at once, so that quota admission checks the new ``hard`` from the write on (a lower
        one closes its room then, a raise opens it for KubeVirt's retry that the write itself wakes), not a sync
        later. Only for the resources the controller has synced already (the same names in ``status.hard``, each
        with a value in ``status.used``): a quota admission finds no usage for refuses every pod. A quota handed back
        (released or refused) has ``status.hard`` lowered only where it is above the ``hard`` handed back: a raise
        written to ``status.hard`` whose ``spec.hard`` never followed (the label taken off between the two writes)
        stayed open until the quota controller's resync, minutes later; native quota copies the rest."""
        return (
            (self.action in (Action.ADJUST, Action.ADOPT) or (self.action in HANDING_BACK and self._status_above))
            and bool(self.status_hard)
            and self.hard_after.keys() == self.status_hard.keys()
            and self.hard_after.keys() <= self.charged_names
            and not same(self.hard_after, self.status_hard)
        )

    @property
    def status_after(self) -> ResourceList:
        """The ``status.hard`` the plan writes where it :attr:`set_status`: its ``hard``, or for a quota handed back
        only the lowerings of it (:meth:`lowered_status`: native quota copies the rest)."""
        return self.lowered_status() if self.action in HANDING_BACK else self.hard_after

    @property
    def _status_above(self) -> bool:
        """``status.hard`` is above the plan's ``hard`` for some resource."""
        return any(r in self.hard_after and (q - self.hard_after[r]).nanos > 0 for r, q in self.status_hard.items())

    @property
    def changes(self) -> bool:
        return self.set_hard or bool(self.annotations) or self.set_status

    def spec_only(self) -> Plan:
        """The plan without its write of ``status.hard`` (an enforcer the API server does not let write it leaves
        the copy to the quota controller)."""
        return replace(self, status_hard={}) if self.set_status else self

    @property
    def raises_spec(self) -> bool:
        """``spec.hard`` grows for some resource."""
        return any(r not in self.hard_before or (q - self.hard_before[r]).nanos > 0 for r, q in self.hard_after.items())

    @property
    def in_vm_terms(self) -> bool:
        """The quota counts in VM terms: the reservation guard's ``vmquota-vm-terms`` reads it, and takes it as
        enforced only while ``status.hard`` is no higher than ``spec.hard`` (a lowering the quota controller has not
        copied leaves room open), refusing every pod and VMI of the namespace otherwise."""
        return self.mode in VM_TERM_MODES

    def lowered_status(self) -> ResourceList:
        """``status.hard`` with only the plan's lowerings: for each resource the smaller of it and the plan's
        ``hard``. Written before ``spec.hard``, then the plan's ``hard`` after it, ``status.hard`` is never above
        ``spec.hard`` on the way (a raise written to ``status.hard`` first, or the lowered part of a plan that raises
        another resource written to ``spec.hard`` first, had ``vmquota-vm-terms`` refuse every pod until the second
        write)."""
        return {r: min(q, self.status_hard[r]) for r, q in self.hard_after.items()}

    @property
    def raises(self) -> bool:
        """Room opens for some resource: ``spec.hard`` grows, or ``status.hard``, which quota admission checks and the
        plan writes, grows (a repair, or a lowering of ``spec.hard`` still above ``status.hard``). The enforcer then
        reads the quota's ``status.used`` from the API server first (see
        :func:`shared.quota.equation.within_charged`), and with the guard waits for unconfirmed holders."""
        if self.raises_spec:
            return True
        return self.set_status and any((q - self.status_hard[r]).nanos > 0 for r, q in self.status_after.items())

    @property
    def written_before(self) -> ResourceList:
        """The ``hard`` a decision of the plan records as written over: ``status.hard``'s when :attr:`status_only`,
        else ``spec.hard``'s."""
        return self.status_hard if self.status_only else self.hard_before

    @property
    def written_after(self) -> ResourceList:
        """The ``hard`` a decision of the plan records as written: :attr:`status_after` when :attr:`status_only`,
        else ``spec.hard``'s."""
        return self.status_after if self.status_only else self.hard_after

    def status_written(self) -> Plan:
        """The plan as far as it was written when its ``status.hard`` went out and its ``spec.hard`` did not: the
        write of ``spec.hard`` after it failed (it met a newer version of the quota, quota admission's charging the
        pod the raise let in, usually; or the API server failed it), and the quota is planned again. Quota admission
        checked the plan's ``hard`` from the first write on, and lets pods in by it: a decision records it
        (``status_only``), whatever the next plan writes."""
        return replace(self, status_only=True)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def _changed_annotations(q: QuotaSnapshot, want: Mapping[str, str | None]) -> dict[str, str | None]:
    """The subset of ``want`` that differs from the quota. The budget compares by value, so an administrator's
    spelling of the same budget is left alone; ``vmquota.io/last-hard`` is rewritten unless it is the very text,
    which the reservation guard's rendering-model policy reads."""
    out: dict[str, str | None] = {}
    for key, value in want.items():
        have = q.annotations.get(key)
        if value is None:
            if have is not None:
                out[key] = None
            continue
        if have == value:
            continue
        if have is not None and key == BUDGET_ANNOTATION:  # (last-hard is vmquota's, and the guard reads its text)
            try:
                if same(parse_budget(have, key), parse_budget(value, key)):
                    continue
            except InvalidInput:
                pass
        out[key] = value
    return out


def _base(q: QuotaSnapshot, action: Action, *, hard_after: ResourceList | None = None, **kw: Any) -> Plan:
    return Plan(
        namespace=q.namespace,
        name=q.name,
        uid=q.uid,
        resource_version=q.resource_version,
        action=action,
        hard_before=dict(q.spec_hard),
        hard_after=dict(q.spec_hard) if hard_after is None else hard_after,
        status_hard=dict(q.status_hard),
        charged_names=frozenset(q.status_used),
        **kw,
    )


def terms_of(usage: UsageSnapshot | None, name: str) -> QuotaTerms | None:
    """Quota ``name``'s terms in a namespace's usage snapshot, if both are there."""
    return None if usage is None else usage.quotas.get(name)


def _same_ratio(terms: QuotaTerms, policy: QuotaPolicy) -> bool:
    """The terms were accounted with the quota's own CPU allocation ratio as it is now (by value; none for none)."""
    if not terms.cpu_allocation_ratio:
        return policy.cpu_allocation_ratio is None
    try:
        return Fraction(terms.cpu_allocation_ratio) == policy.cpu_allocation_ratio
    except (ValueError, ZeroDivisionError):
        return False


def _ours(q: QuotaSnapshot, hard: Mapping[str, Quantity], budget: Mapping[str, Quantity]) -> bool:
    """``hard`` is what vmquota last wrote (``vmquota.io/last-hard``), for ``budget``
    (``vmquota.io/enforced-budget``)."""
    try:
        last = _annotation_list(q, LAST_HARD_ANNOTATION)
        enforced = _annotation_list(q, ENFORCED_BUDGET_ANNOTATION)
    except InvalidInput:
        return False
    return last is not None and same(hard, last) and enforced is not None and same(budget, enforced)


def charged_as_counted(q: QuotaSnapshot, terms: QuotaTerms | None) -> bool:
    """Whether quota admission charges no more than the usage ``terms`` count of the namespace's pods (``status.used``
    at most ``P``) in every resource the usage reserves room in (``S``). A pod that ended is uncharged by the quota
    controller a moment after the ledger hears of it: a nudge sent before was refused, and nothing nudged again (the
    usage does not change), so the VM waited for KubeVirt's backoff (163 s after its room appeared). Native
    admission checks each pod against the room; ``hard`` holds room for ``S`` beside ``P``, so once ``status.used``
    has come down to ``P`` each reserved pod fits as the usage says, whatever ``R`` is (negative during a migration:
    the sum of ``S`` need not fit). True when nothing is reserved or a figure is missing or unreadable (nothing to
    hold a nudge for)."""
    if terms is None or not terms.reserved:
        return True
    try:
        reserved = parse_resource_list(terms.reserved, "reserved")
        pods = parse_resource_list(terms.pods, "pods")
    except InvalidInput:
        return True
    for r in q.status_hard:
        want, used, counted = reserved.get(r), q.status_used.get(r), pods.get(r)
        if want is not None and want.nanos > 0 and used is not None and counted is not None and counted < used:
            return False
    return True


def hard_from(terms: QuotaTerms, charged: Mapping[str, Quantity] | None) -> ResourceList:
    """The ``hard`` the enforcer writes from a quota's published terms: the ledger's ``hard``, held within what the
    API server charges when ``charged`` (the quota's ``status.used`` as read) is given
    (:func:`~shared.quota.equation.within_charged`). What ``vmquota replay --verify`` derives a decision's ``hard``
    with, too. Raises :class:`InvalidInput` for malformed terms."""
    hard = parse_resource_list(terms.hard, "hard")
    if charged is None:
        return hard
    return within_charged(hard, parse_resource_list(terms.pods, "pods"), charged)


def plan(
    q: QuotaSnapshot,
    usage: UsageSnapshot | None,
    previous: UsageSnapshot | None = None,
    *,
    managed: bool = False,
    charged: Mapping[str, Quantity] | None = None,
    status: bool = True,
) -> Plan:
    """What the enforcer does to quota ``q`` given the namespace's latest usage snapshot. ``previous`` (the usage
    snapshot the enforcer acted on before, if it remembers one) only sharpens the reason line. ``managed``: the
    caller has seen the API server return this quota (its uid) labelled managed, so a release may set
    ``spec.hard`` back to the budget even where that raises it. ``charged``: the quota's ``status.used`` as the
    API server returned it just now; ``hard`` then holds no room for pods the usage counts in ``P`` beyond what
    the API server charges (:func:`shared.quota.equation.within_charged`). ``status``: the enforcer may write
    ``status.hard`` (False: ``spec.hard`` alone, for the quota controller to copy)."""
    p = _plan(q, usage, previous, managed=managed, charged=charged, write_status=status)
    if charged is not None:
        p = replace(p, charged={r: charged[r] for r in p.hard_after if r in charged})
    if not status:
        return p.spec_only()
    return replace(p, status_only=True) if p.set_status and not p.set_hard else p


def _plan(
    q: QuotaSnapshot,
    usage: UsageSnapshot | None,
    previous: UsageSnapshot | None,
    *,
    managed: bool,
    charged: Mapping[str, Quantity] | None,
    write_status: bool,
) -> Plan:
    seq = usage.seq if usage is not None else 0
    if not is_managed(q.labels):
        return _release(q, seq, managed=managed)
    try:
        policy = check_manageable(q)
        b = resolve_budget(q)
    except InvalidInput as e:
        return _refuse(q, str(e), seq)

    terms = terms_of(usage, q.name)
    hard = dict(q.spec_hard)
    agreed = False
    mode = policy.mode
    if terms is not None and terms.mode == mode.value and _same_ratio(terms, policy):
        try:
            ledger_budget = parse_resource_list(terms.budget, "budget")
            agreed = same(ledger_budget, b.budget)
            if agreed:
                hard = hard_from(terms, charged)
        except InvalidInput:
            agreed = False  # a malformed snapshot is refused before it gets here; wait for the next one
    label = policy_label(q, mode)
    status = f"Enforcing ({label})"
    if not agreed and (
        terms is not None or q.annotations.get(STATUS_ANNOTATION) != status or not _ours(q, hard, b.budget)
    ):
        # Usage accounted in this mode with this budget is not in yet: the quota is not enforced in it (and the
        # reservation guard's rendering-model policy admits no VMI meanwhile). An enforced quota stays so while its
        # namespace's usage is missing altogether (a ledger restarting), as long as spec.hard stays what vmquota
        # wrote (not a budget someone wrote back into it, unscaled) for the budget it still has (not one lowered
        # since, which that spec.hard is too high for).
        status = f"Waiting for usage ({label})"
    want: dict[str, str | None] = {
        BUDGET_ANNOTATION: rl_json(b.budget),
        LAST_HARD_ANNOTATION: rl_json(hard),
        STATUS_ANNOTATION: status,
    }
    if terms is not None and agreed:
        want.update({key: terms.vmi_minimums.get(r) for r, key in VMI_MINIMUM_ANNOTATIONS.items()})
        # (the budget annotation's text as it is after this write: an administrator's spelling of the same budget is
        # left alone, and the reservation guard tells a budget changed since by comparing the two texts)
        kept = q.annotations.get(BUDGET_ANNOTATION)
        rewritten = _changed_annotations(q, {BUDGET_ANNOTATION: want[BUDGET_ANNOTATION]})
        want[ENFORCED_BUDGET_ANNOTATION] = want[BUDGET_ANNOTATION] if rewritten or kept is None else kept
    annotations = _changed_annotations(q, want)
    set_hard = not same(hard, q.spec_hard)
    summary = (
        _changed_annotations(q, {USAGE_ANNOTATION: usage_summary(terms, usage)}) if terms is not None and agreed else {}
    )
    if not set_hard and not annotations:
        repair = _base(q, Action.ADJUST, mode=mode.value, budget=b.budget, usage_seq=seq, annotations=summary)
        if write_status and agreed and repair.set_status:
            # status.hard is not the spec.hard vmquota wrote (a write of it whose spec.hard never followed, or the
            # quota controller's copy of an older spec.hard that came after it): quota admission checks it, and the
            # controller copies spec.hard again only when spec.hard changes, or at its resync (minutes)
            # ("lowered" only where nothing opens: what ends a migration's room reads so, shared.explain)
            verb = "raised" if repair.raises else "lowered"
            return replace(repair, reason=f"{verb} status.hard to spec.hard: {_items(hard)}")
        action = Action.REFRESH if summary else Action.NONE  # (paced by the enforcer: see Action.REFRESH)
        return _base(q, action, mode=mode.value, budget=b.budget, usage_seq=seq, annotations=summary)
    annotations.update(summary)  # (rides on a write that happens anyway)
    if usage is not None and agreed:  # (so does the mark of the snapshot it is planned from)
        annotations.update(_changed_annotations(q, {USAGE_FROM_ANNOTATION: usage_mark(usage)}))

    parts: list[str] = []
    event_reason = ADJUSTED
    if b.foreign:
        event_reason = BUDGET_CHANGED
        before = f" (was {_items(b.previous)})" if b.previous is not None else ""
        parts.append(f"spec.hard was changed outside vmquota to {_items(b.budget)}: taken as the new budget{before}")
    elif b.adopting:
        event_reason = ADOPTED
        parts.append(f"adopted in mode {mode.value} with budget {_items(b.budget)}")
    old = terms_of(previous, q.name)
    budget_moved = old is not None and terms is not None and old.budget != terms.budget
    if set_hard:
        parts.append(_hard_change(q.spec_hard, hard, b.budget, terms, usage, previous, budget_moved=budget_moved))
    elif terms is not None and not agreed and (b.foreign or b.adopting):
        parts.append("spec.hard follows once usage is accounted with this budget")
    elif not parts and STATUS_ANNOTATION in annotations:
        parts.append(f"status: {status}")
    elif not parts:
        parts.append(f"recorded budget {_items(b.budget)} and the enforced spec.hard")
    if b.note:
        parts.append(b.note)
    if event_reason == ADJUSTED and budget_moved:
        event_reason = BUDGET_CHANGED
    return _base(
        q,
        Action.ADOPT if b.adopting else Action.ADJUST,
        mode=mode.value,
        budget=b.budget,
        hard_after=hard,
        annotations=annotations,
        event_type=WARNING if b.foreign else NORMAL,
        event_reason=event_reason,
        reason="; ".join(parts),
        usage_seq=seq,
    )


def _recorded_budget(q: QuotaSnapshot) -> Budget | None:
    """The quota's budget as :func:`resolve_budget` reads it, None when unreadable (refusing or releasing)."""
    try:
        return resolve_budget(q)
    except InvalidInput:
        return None


def _refuse(q: QuotaSnapshot, why: str, seq: int) -> Plan:
    """Refused: report it; an adopted quota falls back to native quota with its budget."""
    status = f"Refused: {why}"
    want: dict[str, str | None] = {STATUS_ANNOTATION: status}
    hard = dict(q.spec_hard)
    budget: ResourceList = {}
    b = _recorded_budget(q)
    if b is not None and not b.adopting:
        budget = hard = b.budget
        want[BUDGET_ANNOTATION] = rl_json(b.budget)
        want[LAST_HARD_ANNOTATION] = rl_json(hard)
    annotations = _changed_annotations(q, want)
    set_hard = not same(hard, q.spec_hard)
    if not set_hard and not annotations:
        return _base(q, Action.NONE, budget=budget, usage_seq=seq)
    reason = f"not managed: {why}"
    if set_hard:
        reason += f"; spec.hard set back to the budget {_items(budget)} (native quota)"
    return _base(
        q,
        Action.REFUSE,
        budget=budget,
        hard_after=hard,
        annotations=annotations,
        event_type=WARNING,
        event_reason=REFUSED,
        reason=reason,
        usage_seq=seq,
    )


def _handed_back(spec_hard: Mapping[str, Quantity], budget: Mapping[str, Quantity]) -> ResourceList:
    """``spec.hard`` of a quota released without proof that vmquota managed it: each resource at its budget where
    that is lower, the rest as it is. Never raised nor extended, so annotations that someone put on a quota
    vmquota never managed (a budget of 1Ti, a matching last-hard) open no room."""
    return {r: min(h, budget[r]) if r in budget else h for r, h in spec_hard.items()}


def _release(q: QuotaSnapshot, seq: int, *, managed: bool) -> Plan:
    """The label is gone: hand the quota back with ``spec.hard`` = budget and our annotations removed; unless
    ``managed`` (the caller saw the API server return this quota labelled), only lowered to the budget."""
    if not any(k in q.annotations for k in OWN_ANNOTATIONS):
        return _base(q, Action.NONE, usage_seq=seq)
    annotations: dict[str, str | None] = {k: None for k in OWN_ANNOTATIONS if k in q.annotations}
    hard = dict(q.spec_hard)
    b = _recorded_budget(q)
    if b is not None and not b.adopting:
        hard = dict(b.budget) if managed else _handed_back(q.spec_hard, b.budget)
    set_hard = not same(hard, q.spec_hard)
    if set_hard:
        reason = f"released to native quota: spec.hard set back to the budget {_items(hard)}"
    elif b is None:
        reason = "released to native quota: the budget annotation is unreadable, spec.hard left as it is"
    elif b.adopting:
        reason = "released to native quota: spec.hard left as it is"
    elif same(hard, b.budget):
        reason = "released to native quota: spec.hard already equals the budget"
    else:
        reason = "released to native quota: spec.hard left as it is (a release never raises it)"
    return _base(
        q,
        Action.RELEASE,
        budget=hard,
        hard_after=hard,
        annotations=annotations,
        event_reason=RELEASED,
        reason=reason,
        usage_seq=seq,
    )


# ---- the usage annotation ---------------------------------------------------------------------------------------


def usage_summary(terms: QuotaTerms, usage: UsageSnapshot | None) -> str:
    """``used limits.memory 49Gi/64Gi; reserved limits.memory 16.3Gi; raised for vm1-migration-x`` (readable
    quantities, budget order)."""
    parts = ["used " + (used_of_budget(terms.used, terms.budget) or "nothing")]
    reserved = {r: v for r, v in readable_list(terms.reserved).items() if v != "0"}
    if reserved:
        parts.append("reserved " + ", ".join(f"{r} {v}" for r, v in reserved.items()))
    raised = sorted(m.name for m in (usage.migrations if usage is not None else ()) if nonzero(m.reserved))
    if raised and reserved:
        parts.append("raised for " + names_list(raised))
    if terms.over_budget:
        parts.append("over budget: " + ", ".join(terms.over_budget))
    return "; ".join(parts)


# ---- the reason line ---------------------------------------------------------------------------------------------


def _vmis(migrations: Sequence[MigrationState], *, reserving: bool) -> list[str]:
    return sorted({m.vmi for m in migrations if not reserving or nonzero(m.reserved)})


def _names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_MIGRATIONS_OF: Final = re.compile(r"(?: for the |: the )migrations? of ([^;]+?)(?: ended)?(?:;|$)")


def migrations_named(reason: str) -> frozenset[str]:
    """The VMIs whose migrations a decision's reason names (``... for the migrations of vm1, vm2 and vm3``, ``...:
    the migration of vm1 ended``), each whole: the migration of ``vm1`` is not named by one of ``vm10``."""
    m = _MIGRATIONS_OF.search(reason)
    if m is None:
        return frozenset()
    first, _, last = m[1].rpartition(" and ")
    return frozenset([*(first.split(", ") if first else ()), last])


def _hard_change(
    before: Mapping[str, Quantity],
    after: Mapping[str, Quantity],
    budget: Mapping[str, Quantity],
    terms: QuotaTerms | None,
    usage: UsageSnapshot | None,
    previous: UsageSnapshot | None,
    *,
    budget_moved: bool,
) -> str:
    """``raised limits.memory by 16.2Gi for the migration of vm1`` and the like."""
    raised: list[str] = []
    lowered: list[str] = []
    changes: list[str] = []
    for r in sorted(set(before) | set(after)):
        if r not in after:
            changes.append(f"removed {r}")
            continue
        if r not in before:
            changes.append(f"set {r} to {after[r].canonical()}")
            continue
        delta = after[r] - before[r]
        if delta.nanos > 0:
            raised.append(r)
            changes.append(f"raised {r} by {human_quantity(delta, r)}")
        elif delta.nanos < 0:
            lowered.append(r)
            changes.append(f"lowered {r} by {human_quantity(-delta, r)}")
    text = ", ".join(changes)
    now_m = _vmis(usage.migrations, reserving=True) if usage is not None else []
    was_m = _vmis(previous.migrations, reserving=False) if previous is not None else []
    ended = sorted(set(was_m) - set(_vmis(usage.migrations, reserving=False) if usage is not None else []))
    if budget_moved:
        return f"{text} for the new budget {_items(budget)}"
    if raised and not lowered and now_m:
        plural = "migrations" if len(now_m) > 1 else "migration"
        return f"{text} for the {plural} of {_names(now_m)}"
    if lowered and not raised and ended:
        plural = "migrations" if len(ended) > 1 else "migration"
        return f"{text}: the {plural} of {_names(ended)} ended"
    if terms is None:
        return text
    used = parse_resource_list(terms.used, "used")
    pods = parse_resource_list(terms.pods, "pods")
    reserved = parse_resource_list(terms.reserved, "reserved")
    detail = "; ".join(
        f"{r}: budget {human_quantity(budget.get(r, ZERO), r)}, accounted {human_quantity(used.get(r, ZERO), r)}, "
        f"pods {human_quantity(pods.get(r, ZERO), r)}, reserved {human_quantity(reserved.get(r, ZERO), r)}"
        for r in (raised + lowered)[:3]
    )
    return f"{text} ({detail})" if detail else text


# ---- the patch ---------------------------------------------------------------------------------------------------


def status_body(p: Plan, hard: Mapping[str, Quantity] | None = None) -> dict[str, Any]:
    """The JSON merge patch of ``status.hard`` for a plan that :attr:`~Plan.set_status` (of the ``status``
    subresource): :attr:`~Plan.status_after` (or ``hard``), under the plan's resourceVersion as precondition. The same
    names as the ``status.hard`` it replaces, so nothing is removed, and ``status.used`` is left as it is."""
    return {
        "metadata": {"resourceVersion": p.resource_version},
        "status": {"hard": canonical_resource_list(p.status_after if hard is None else hard)},
    }


def patch_body(p: Plan) -> dict[str, Any]:
    """The JSON merge patch of a plan: ``metadata.resourceVersion`` (the precondition), the annotations that
    change (null removes), and ``spec.hard`` in full when it changes, with null for every resource it drops (a
    merge patch merges maps). Nothing else: never ``status``, never another annotation or label."""
    meta: dict[str, Any] = {"resourceVersion": p.resource_version}
    body: dict[str, Any] = {"metadata": meta}
    if p.annotations:
        meta["annotations"] = dict(sorted(p.annotations.items()))
    if p.set_hard:
        hard: dict[str, str | None] = {r: None for r in sorted(p.hard_before) if r not in p.hard_after}
        hard.update(canonical_resource_list(p.hard_after))
        body["spec"] = {"hard": hard}
    return body
