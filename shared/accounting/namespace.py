"""The accounting of one namespace: :func:`account_namespace` (the package's docstring has the rules)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction
from typing import Any, Final

from shared.accounting.estimates import Renderer, current_size, evidence_bound, widened
from shared.accounting.memo import config_of, memo_of
from shared.accounting.results import (
    ADMITTED,
    GROWTH_REFUSED,
    LAUNCHER,
    MIGRATION_TARGET,
    NON_VM,
    NOT_TRIED,
    ORPHAN_LAUNCHER,
    PENDING,
    QUEUED,
    REFUSED,
    RUNNING,
    STOPPED,
    TARGET_CREATED,
    WAITING,
    MigrationEntry,
    NamespaceUsage,
    PodEntry,
    QuotaUsage,
    VmEntry,
)
from shared.accounting.sums import Sum, SumValue
from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.kubevirt import KubeVirtConfig, NamespaceFacts
from shared.kubevirt.config import fallback_note
from shared.podusage import counts_for_compute
from shared.quantity import Quantity
from shared.quota.equation import desired_hard, in_mode_terms, takes
from shared.quota.modes import QuotaPolicy, VmSize, mode_usage, pod_factor, policy_of
from shared.resources import ResourceList, add, growth, maximum, minimum, nonzero, second_largest
from shared.snapshot import (
    VMI_FINAL_PHASES,
    VMI_WAITING_PHASES,
    EventSnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    Snapshot,
    VmimSnapshot,
    VmiSnapshot,
)

ACCOUNTED_KINDS: Final[frozenset[str]] = frozenset(
    {VMI_KIND, VMIM_KIND, POD_KIND, QUOTA_KIND, NAMESPACE_KIND, KUBEVIRT_KIND, EVENT_KIND}
)
"""The kinds accounting reads (VirtualMachines are not among them: a VM counts through its VMI and pods)."""

_ONE: Final = Quantity.from_int(1)
_ZERO: Final = Quantity.from_int(0)


"""Kinds every namespace's accounting reads, whatever their namespace."""


_POD_COUNT_ONLY: Final[ResourceList] = {"count/pods": _ONE}
"""What the evaluator charges a terminal pod."""


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


_PodsPass = tuple[
    tuple["PodEntry", ...],
    dict[str, list[tuple[PodSnapshot, ResourceList]]],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
]
"""Pod entries, launcher pods per VM, and the lists every quota adds to ``P`` and to ``U`` (and to ``W``: a plain
pod takes its charge)."""
_VmsPass = tuple[
    tuple[tuple[str, "VmEntry"], ...],
    tuple[VmiSnapshot, ...],
    tuple[tuple[ResourceList, ...], ...],
    tuple[ResourceList, ...],
    tuple[ResourceList, ...],
    tuple[tuple[ResourceList, ...], ...],
]
"""Entries of running and stopped VMs, pending VMs, per quota the lists running VMs add to ``U``, the lists
every quota adds to ``D`` and to ``X``, and per quota the lists running VMs add to ``W``."""


@dataclass
class _Quota:
    policy: QuotaPolicy
    factors: dict[str, Fraction | None]
    ratio: Fraction
    accounted: Sum
    pod_usage: Sum
    reserved: Sum
    overlap: Sum
    unvouched: Sum
    taken: Sum

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
            config = config_of(self.kv_obj, memoize)
            note = fallback_note(self.kv_obj.version) if self.kv_obj is not None else None
            if note is not None:
                self.errors.append(note)
        self.config = config
        self.memo = memo_of(config) if memoize else None
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
        self.renderer = Renderer(config, facts, self.memo)
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
        self.vm_entries: dict[str, VmEntry] = {}
        self.pending: list[VmiSnapshot] = []
        self.target_reserved: ResourceList = {}
        """The part of every quota's ``S`` reserved for migration targets."""

    # ---- input
    def _sort(self, objs: list[Snapshot]) -> None:
        """Objects in any order, one version each: the namespace's and the cluster-scoped ones (Namespaces, KubeVirt
        CRs) by kind, for :meth:`_split`; VirtualMachines are skipped (a VM counts through its VMI and pods)."""
        kinds: dict[str, list[Snapshot]] = {}
        for s in objs:
            kind = type(s).__struct_config__.tag
            if kind in CLUSTER_SCOPED_KINDS or s.namespace == self.namespace:
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
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] | None = None if memo is None else {}
        out: list[_Quota] = []
        for pol, ratio, factors in terms:
            terms_ = ("U", "P", "S", "D", "X", "W")
            sums = [Sum(memo, ("sum", self.namespace, pol.name, term), alike) for term in terms_]
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
            overlap, unvouched, taken_ = q.overlap.result(), q.unvouched.result(), q.taken.result()
            results[q.policy.name] = QuotaUsage(
                policy=q.policy,
                accounted=accounted,
                pod_usage=pod_usage,
                reserved=reserved,
                overlap=overlap,
                unvouched=unvouched,
                taken=taken_,
                factors=q.factors,
                hard=desired_hard(b, taken_, pod_usage, reserved, q.factors, overlap, unvouched, self.target_reserved),
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
            q.taken.extend(accounted)  # (a plain pod takes what it is charged)

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
            estimate = maximum(minimum(estimate, widened(rendered)), rendered)
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
            q.taken.add(takes({}, grown[q.policy.name], q.factors))
        if not t.m.rejected_by_quota:
            why.append(
                "no room held: KubeVirt has not been refused its target pod (room is made once it is, and only then)"
            )
            self.mig_entries[t.index] = _migration_entry(t.m, NOT_TRIED, "; ".join(why), None, t.grow)
            return
        taken_by = self._room_taken(t)
        if taken_by:
            why.insert(
                0,
                f"no room held: the namespace is over its budget ({taken_by}) with pods created after the migration "
                "(the room reserved for its target was taken by another pod); room is made again once they end",
            )
            self.mig_entries[t.index] = _migration_entry(t.m, WAITING, "; ".join(why), None, t.grow)
            return
        why.insert(0, "target reserved: KubeVirt reported migrationRejectedByResourceQuota")
        for q in self.quotas:
            q.reserved.add(t.estimate)
        self.target_reserved = add(self.target_reserved, t.estimate)
        self.mig_entries[t.index] = _migration_entry(t.m, PENDING, "; ".join(why), t.estimate, t.grow)

    def _room_taken(self, t: _Target) -> str:
        """Why a migration KubeVirt is refused gets no room again, or "": some quota is over its budget (``U + X/k
        > B``) in a resource the target is charged, and pods other than VMs' launcher pods created after the
        migration (or in the same second) are charged that resource. Room held for a target is open to any pod
        until the target exists (without the reservation guard): a pod that took it must not be followed by
        another once vmquota raises again, so a namespace goes over its budget by one reserved amount at the most.
        A namespace over its budget for other reasons (its budget lowered, an upgrade's larger pods) still
        migrates."""
        since = t.m.creation_timestamp
        if since is None:
            return ""
        late = [
            e.charged
            for p, e in zip(self.pods, self.pod_entries, strict=True)
            if e.role in (NON_VM, ORPHAN_LAUNCHER)
            and e.active
            and p.creation_timestamp is not None
            and p.creation_timestamp >= since  # (creation times are to the second: the same second counts)
        ]
        if not late:
            return ""
        for q in self.quotas:
            over = [
                r
                for r, b in q.policy.budget.items()
                if q.factors.get(r) is not None
                and r in t.estimate
                and q.used(r) > b.nanos
                and any(c.get(r, _ZERO).nanos > 0 for c in late)
            ]
            if over:
                return f"quota {q.policy.name}: {', '.join(sorted(over))}" if q.policy.name else ", ".join(over)
        return ""

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
        entries, pending, accounted, overlap, unvouched, takes = found
        self.vm_entries.update(entries)
        self.pending = list(pending)
        for q, acc, took in zip(self.quotas, accounted, takes, strict=True):
            q.accounted.extend(acc)
            q.overlap.extend(overlap)
            q.unvouched.extend(unvouched)
            q.taken.extend(took)

    def _vms_pass(self) -> _VmsPass:
        entries: list[tuple[str, VmEntry]] = []
        pending: list[VmiSnapshot] = []
        accounted: list[list[ResourceList]] = [[] for _ in self.quotas]
        takes: list[list[ResourceList]] = [[] for _ in self.quotas]
        overlap: list[ResourceList] = []
        unvouched: list[ResourceList] = []
        memo = self.memo
        namespace, quotas_key = self.namespace, self.quotas_key
        every = [  # (each VM, each quota)
            (q.policy.name, added, took) for q, added, took in zip(self.quotas, accounted, takes, strict=True)
        ]
        for v in self.vmis:
            key = _vm_key(v)
            vm_pods = self.launchers.get(key, [])
            if not vm_pods:
                if v.phase in VMI_FINAL_PHASES or v.deletion_timestamp is not None:
                    what = f"phase {v.phase}" if v.phase in VMI_FINAL_PHASES else "being deleted"
                    reason = f"{what}, no running launcher pod: counts nothing"
                    entries.append((key, VmEntry(v.name, v.uid, v.phase, STOPPED, reason, _size(v), {}, {})))
                elif v.phase not in VMI_WAITING_PHASES:
                    entry = self._unseen_pod_vm(v)
                    for name, added, took in every:
                        added.append(entry.counts[name])
                        took.append(entry.taken[name])
                    entries.append((key, entry))
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
            counts, takes_of = entry.counts, entry.taken
            for name, added, took in every:
                added.append(counts[name])
                took.append(takes_of[name])
            if entry.overlap:
                overlap.append(entry.overlap)
            if entry.unvouched:
                unvouched.append(entry.unvouched)
            entries.append((key, entry))
        return (
            tuple(entries),
            tuple(pending),
            tuple(map(tuple, accounted)),
            tuple(overlap),
            tuple(unvouched),
            tuple(map(tuple, takes)),
        )

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
        size = _size(v) if migrating else current_size(v)
        cap = self.renderer.vmi_usage(v) or {}  # (a VM that cannot be rendered: hard holds no room for its pods)
        if not migrating and cap:  # its launcher pod as rendered at its current size (a hotplug not yet admitted)
            grow = self.renderer.hotplug_growth(v)
            if grow:
                cap = {r: (q - grow[r]).clamp0() if r in grow else q for r, q in cap.items()}
        believed = minimum(pod_max, cap)
        counts = {q.policy.name: mode_usage(q.policy.mode, size, believed, q.ratio) for q in self.quotas}
        took = {q.policy.name: takes(believed, counts[q.policy.name], q.factors) for q in self.quotas}
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
            v.name,
            v.uid,
            v.phase,
            RUNNING,
            reason,
            size,
            believed,
            counts,
            overlap=overlap,
            unvouched=unvouched,
            taken=took,
        )

    def _unseen_pod_vm(self, v: VmiSnapshot) -> VmEntry:
        """A VMI past Pending with no running launcher pod in view: its pod ended (the VMI is about to finish), or
        KubeVirt has not named it in ``status.activePods`` yet (it then counts as a plain pod), or its event has not
        arrived. KubeVirt creates no launcher pod for it any more, so nothing is reserved (room held for it would be
        room for a pod that never comes, open to any other); until its status says it finished it counts at its
        rendering at its current size in ``U``, like a running VM (a VM admitted meanwhile waits for it), and it
        takes nothing in ``W``: ``W`` follows what ``P`` charges, and ``P`` has no pod of it (a pod that is charged
        but not in view takes its room all the same, and one that ended frees it), so ``hard`` stays where it is
        while KubeVirt's status and the pod events catch up."""
        size = current_size(v)
        cap = self.renderer.vmi_usage(v) or {}
        grow = self.renderer.hotplug_growth(v) if cap else {}
        if grow:
            cap = {r: (q - grow[r]).clamp0() if r in grow else q for r, q in cap.items()}
        counts = {q.policy.name: mode_usage(q.policy.mode, size, cap, q.ratio) for q in self.quotas}
        took: dict[str, ResourceList] = {q.policy.name: {} for q in self.quotas}
        reason = (
            f"phase {v.phase}, no running launcher pod in status.activePods: counts at its rendering, nothing reserved"
        )
        return VmEntry(v.name, v.uid, v.phase, RUNNING, reason, size, cap, counts, taken=took)

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
            q.taken.add(takes({}, usages[q.policy.name], q.factors))
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
