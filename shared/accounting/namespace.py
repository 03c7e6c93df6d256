"""The accounting of one namespace: :func:`account_namespace` takes the namespace's objects and gives ``U``, ``P``,
``S``, ``D``, ``X``, ``W`` and ``hard`` per managed quota, with every VM, migration and pod and why (the package's
docstring has the rules). The accounting runs in passes, one module each, layered in the order they run:
``state`` (what every pass reads and writes), ``pods``, ``vms``, ``migrations``, ``admission``; this module reads
the input and makes the result."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from fractions import Fraction
from typing import Any, Final

from shared.accounting.admission import Admission
from shared.accounting.estimates import Renderer
from shared.accounting.memo import NO_MEMO, config_of, memo_of
from shared.accounting.results import (
    MigrationEntry,
    NamespaceUsage,
    PodEntry,
    QuotaUsage,
    VmEntry,
)
from shared.accounting.state import CreatedTarget, QuotaSums, Target, created_key, vm_key
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
from shared.kubevirt.config import WEBHOOK_GUEST, fallback_note
from shared.quota.equation import desired_hard
from shared.quota.modes import QuotaPolicy, pod_factor, policy_of, vmi_minimums
from shared.resources import ResourceList
from shared.snapshot import (
    EventSnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    Snapshot,
    VmimSnapshot,
    VmiSnapshot,
    is_cluster_scoped,
)

ACCOUNTED_KINDS: Final[frozenset[str]] = frozenset(
    {VMI_KIND, VMIM_KIND, POD_KIND, QUOTA_KIND, NAMESPACE_KIND, KUBEVIRT_KIND, EVENT_KIND}
)
"""The kinds accounting reads (VirtualMachines are not among them: a VM counts through its VMI and pods)."""


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


def _order(objs: Iterable[Snapshot]) -> list[Any]:
    return sorted(objs, key=created_key)


def account_namespace(
    objects: Iterable[Snapshot],
    *,
    now: datetime,
    config: KubeVirtConfig | None = None,
    policies: Sequence[QuotaPolicy] | None = None,
    namespace: str | None = None,
    memoize: bool = True,
    distinct: bool = False,
) -> NamespaceUsage:
    """Account one namespace from its snapshots in any order: :func:`by_kind`, then :func:`account_view`.

    ``objects``: the namespace's snapshots (objects of other namespaces are ignored when ``namespace`` is given,
    else they are an error), with the cluster-scoped ones (Namespaces, KubeVirt CRs) it reads. ``distinct``: the
    caller guarantees one version per object, so looking for duplicates is skipped (given duplicates anyway, the
    result is unspecified). The other arguments as :func:`account_view`'s."""
    namespace, kinds = by_kind(objects, namespace, distinct=distinct)
    return _Accounting(
        kinds, namespace, now=now, config=config, policies=policies, memoize=memoize, shared_lists=False
    ).run()


def account_view(
    kinds: Mapping[str, Sequence[Snapshot]],
    namespace: str,
    *,
    now: datetime,
    config: KubeVirtConfig | None = None,
    policies: Sequence[QuotaPolicy] | None = None,
    memoize: bool = True,
    late: frozenset[str] = frozenset(),
    departed: Mapping[str, VmiSnapshot] | None = None,
    made_for: Mapping[str, tuple[str, int, int]] | None = None,
    settled: frozenset[str] = frozenset(),
    refused: Mapping[str, ResourceList] | None = None,
) -> NamespaceUsage:
    """Account one namespace: **the** entry of the accounting.

    ``kinds``: kind → snapshots of that kind, one version each (the namespace's own and the cluster-scoped
    Namespaces and KubeVirt CRs), as a ledger view holds them. The lists are read, never changed; one that is the
    same list object as in the namespace's last accounting is not sorted again. ``now`` decides which terminating
    pods are past their grace period. ``config``: the cluster's KubeVirt configuration (default: the KubeVirt
    snapshot among ``kinds``, else KubeVirt's defaults). ``policies``: the quotas to account for (default: the
    managed ResourceQuotas among ``kinds``; a managed quota with invalid annotations is skipped and reported in
    ``errors``). ``memoize``: reuse what earlier calls derived from the same objects (launcher pod estimates per
    VMI uid, resourceVersion, configuration and namespace facts; the configuration of the same KubeVirt
    snapshot), so that accounting a namespace again after one change costs little; the result is the same either
    way (False: the reference). ``late``: the uids of the pods created in a refusal, as the ledger's fold remembers
    them (``shared.ledger.fold``; none without a history), and ``settled`` those a change of a quota's policy found
    created since a migration (likewise; their creation after a migration no longer holds it back). ``departed``:
    launcher pods KubeVirt named in a VMI's ``status.activePods`` and names no more, with that VMI as it last named
    them (the fold's memory, likewise): such a pod that still runs counts as that VM. ``made_for``: launcher pod uid
    → the VMI it was made for, the vCPUs of that VMI's spec as the fold first saw the two together (at least what
    the pod was made for) and the fewest the pod may have been made for (likewise): a running VM counts at the most
    vCPUs that or its pods' charges show, whatever its status says, and is admitted as a size change unless the
    fewest and its charges show its spec. ``refused``: pending VMI uid → the largest amounts of the quota refusals
    that named it (likewise): evidence of what KubeVirt was refused that outlasts the Events, which the tenant may
    delete or push out."""
    return _Accounting(
        kinds,
        namespace,
        now=now,
        config=config,
        policies=policies,
        memoize=memoize,
        shared_lists=True,
        late=late,
        departed=departed,
        made_for=made_for,
        settled=settled,
        refused=refused,
    ).run()


def by_kind(
    objects: Iterable[Snapshot], namespace: str | None = None, *, distinct: bool = False
) -> tuple[str, dict[str, list[Snapshot]]]:
    """Snapshots in any order → (their namespace, kind → the latest version of each object of that kind), as
    :func:`account_view` takes them: the namespace's objects and the cluster-scoped ones; VirtualMachines are
    skipped (a VM counts through its VMI and pods). :class:`InvalidInput` for objects of several namespaces when
    ``namespace`` is not given, or a kind accounting does not read."""
    objs = list(objects) if distinct else _latest(objects)
    if namespace is None:
        names = {s.namespace for s in objs if s.namespace and not is_cluster_scoped(s)}
        if len(names) > 1:
            raise InvalidInput(f"objects of several namespaces given: {', '.join(sorted(names))}", "namespace")
        namespace = names.pop() if names else ""
    kinds: dict[str, list[Snapshot]] = {}
    for s in objs:
        kind = type(s).__struct_config__.tag
        if kind in CLUSTER_SCOPED_KINDS or s.namespace == namespace:
            found = kinds.get(kind)  # type: ignore[arg-type]
            if found is None:
                found = kinds[kind] = []  # type: ignore[index]
            found.append(s)
    for kind in kinds.keys() - ACCOUNTED_KINDS - {VM_KIND}:
        s = kinds[kind][0]
        raise InvalidInput(f"unexpected snapshot type {type(s).__name__}", s.ref)
    kinds.pop(VM_KIND, None)
    return namespace, kinds


class _Accounting(Admission):
    """One accounting of a namespace, :func:`account_view`'s or :func:`account_namespace`'s (a builder; not
    reused): the input, then the passes in order (pods, VMs, migrations, admission), then the equation per quota."""

    def __init__(
        self,
        kinds: Mapping[str, Sequence[Snapshot]],
        namespace: str,
        *,
        now: datetime,
        config: KubeVirtConfig | None,
        policies: Sequence[QuotaPolicy] | None,
        memoize: bool,
        shared_lists: bool,
        late: frozenset[str] = frozenset(),
        departed: Mapping[str, VmiSnapshot] | None = None,
        made_for: Mapping[str, tuple[str, int, int]] | None = None,
        settled: frozenset[str] = frozenset(),
        refused: Mapping[str, ResourceList] | None = None,
    ) -> None:
        self.now = now
        self.late = late
        self.settled = settled
        self.made_for: Mapping[str, tuple[str, int, int]] = made_for or {}
        self.refused: Mapping[str, ResourceList] = refused or {}
        self.errors: list[str] = []
        self.namespace = namespace
        self._split(kinds)
        if config is None:
            config = config_of(self.kv_obj, memoize)
            note = fallback_note(self.kv_obj.version) if self.kv_obj is not None else None
            if note is not None:
                self.errors.append(note)
        self.config = config
        self.memo = memo_of(config) if memoize else NO_MEMO
        self._shared_lists = shared_lists
        """The lists are a ledger view's (shared from one accounting to the next until their kind changes)."""
        self.vmis: list[VmiSnapshot] = self._ordered(VMI_KIND)
        self.vmims: list[VmimSnapshot] = self._ordered(VMIM_KIND)
        self.pods: list[PodSnapshot] = self._ordered(POD_KIND)
        self.quotas = self._policies(policies)
        hard_keys = {r for q in self.quota_objs for r in q.spec_hard} | {
            r for q in self.quotas for r in q.policy.budget
        }
        facts = NamespaceFacts(labels=dict(self.ns_obj.labels) if self.ns_obj is not None else {})
        facts = facts.with_quota_resources(hard_keys)
        self.renderer = Renderer(config, facts, self.memo)
        self.quotas_key = self.memo.token(
            tuple((q.policy.name, q.policy.mode, q.ratio, tuple(q.factors.items())) for q in self.quotas)
        )
        """What a VM's counts depend on besides the VM: the quotas' names, modes, ratios and factors (which follow the
        resources their budgets name: a budget that comes to name ``requests.cpu`` changes what a pod of a VMI not in
        view counts, and what a VM takes)."""
        self.commands = {p.uid: p.command_vmi_uid for p in self.pods if p.command_vmi_uid}
        """The VMI each pod's launcher command names (pods with one), by pod uid."""
        self.vouched: dict[str, VmiSnapshot] = {
            pod: v for v in self.vmis for pod in v.vouched_pods if self.commands.get(pod, v.uid) == v.uid
        }
        """Launcher pods by uid, as KubeVirt names them in its VMIs' ``status.activePods`` (or named them: below),
        but for a pod whose launcher command names another VMI: KubeVirt made it for that one, and a tenant moved its
        controller reference to a VMI of its own (a small one, which would count in its stead)."""
        self.departed: list[VmiSnapshot] = []
        """VMIs gone, as they last named a launcher pod that KubeVirt names no more and that still exists: each counts
        as a running VM with such pods (one whose VMI exists counts through it)."""
        self.departed_pods: frozenset[str] = frozenset()
        if departed:
            self._departed(departed)
        self.vmi_by_name = {v.name: v for v in self.vmis}
        self.vmim_by_uid = {m.uid: m for m in self.vmims if m.uid}
        self.launchers: dict[str, list[tuple[PodSnapshot, ResourceList]]] = {}
        self.pod_entries: list[PodEntry] = []
        self.mig_entries: list[MigrationEntry] = []
        self.targets: list[Target] = []
        self.created: list[CreatedTarget] = []
        self.vm_entries: dict[str, VmEntry] = {}
        self.pending: list[VmiSnapshot] = []
        self.target_reserved: ResourceList = {}
        """The part of every quota's ``S`` reserved for migration targets."""

    def _departed(self, departed: Mapping[str, VmiSnapshot]) -> None:
        """Vouch for the launcher pods KubeVirt stopped naming (the fold's memory): a tenant takes a pod's controller
        reference off, or deletes its VMI with ``propagationPolicy: Orphan``, and the guest may run on in it (for the
        VMI's termination grace period, the tenant's to set); as a plain pod it would count its charge only, k times
        less than the VM in the VM-term modes, while KubeVirt starts the VM again beside it. Only a pod whose
        launcher command names the VMI can run its guest: a tenant's pod KubeVirt adopted into the VMI and let go of
        again is a plain pod, not the VM running on."""
        live = {v.uid: v for v in self.vmis}
        gone: dict[str, VmiSnapshot] = {}
        found: set[str] = set()
        for pod, v in sorted(departed.items()):
            if pod in self.vouched or self.commands.get(pod) != v.uid:
                continue
            self.vouched[pod] = live.get(v.uid) or gone.setdefault(v.uid, v)
            found.add(pod)
        self.departed = list(gone.values())
        self.departed_pods = frozenset(found)

    def _split(self, kinds: Mapping[str, Sequence[Snapshot]]) -> None:
        """The objects of the namespace, by kind (see :func:`account_view`)."""
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
        """The objects of ``kind`` in creation order. With ``shared_lists`` (a ledger view's), the order of the same
        list object as in the namespace's last accounting (a ledger view shares a kind's list until the kind
        changes, and never changes it in place) is the one computed then."""
        objs = self._unordered[kind]
        if not self._shared_lists:
            return _order(objs)
        return self.memo.latest(("order", self.namespace, kind), id(objs), (objs,), _order, objs)  # type: ignore[no-any-return]

    def _policies(self, policies: Sequence[QuotaPolicy] | None) -> list[QuotaSums]:
        memo = self.memo
        kv_ratio, overcommit = self.config.cpu_allocation_ratio, self.config.memory_overcommit
        terms: list[tuple[QuotaPolicy, Fraction, dict[str, Fraction | None], dict[str, str]]] | None = None
        if policies is None:
            # (a function of the quota objects and the configuration: the same while they are the same objects)
            slot = ("policies", self.namespace)
            key = (
                tuple(map(id, self.quota_objs)),
                kv_ratio,
                overcommit,
                self.config.profile.memory_request,
            )
            hit = memo.last(slot)
            if hit is not None and hit[0] == key:
                terms, errors = hit[2]
                self.errors.extend(errors)
        if terms is None:
            before = len(self.errors)
            terms = self._quota_terms(policies, kv_ratio, overcommit)
            if policies is None:
                memo.put_latest(slot, key, tuple(self.quota_objs), (terms, self.errors[before:]))
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] = {}
        out: list[QuotaSums] = []
        for pol, ratio, factors, minimums in terms:
            terms_ = ("U", "P", "S", "D", "X", "W")
            used, pods, reserved, overlap, unvouched, taken = (
                Sum(memo, ("sum", self.namespace, pol.name, term), alike) for term in terms_
            )
            out.append(QuotaSums(pol, factors, ratio, used, pods, reserved, overlap, unvouched, taken, minimums))
        return out

    def _quota_terms(
        self, policies: Sequence[QuotaPolicy] | None, kv_ratio: Fraction, overcommit: int
    ) -> list[tuple[QuotaPolicy, Fraction, dict[str, Fraction | None], dict[str, str]]]:
        """Each managed quota's policy (given, or read from the quota objects: an invalid one is reported in
        ``errors`` and skipped), in name order, with its CPU allocation ratio, its factors ``k`` and the minimums
        of a VMI's explicit resources they give (:func:`~shared.quota.modes.vmi_minimums`)."""
        if policies is None:
            found: list[QuotaPolicy] = []
            for qo in self.quota_objs:
                try:
                    pol = policy_of(qo)
                except InvalidInput as err:
                    why = str(err).removeprefix(f"{qo.ref}: ")  # (said once: the line begins with the quota)
                    self.errors.append(f"{qo.ref}: not managed: {why}")
                    continue
                if pol is not None:
                    found.append(pol)
            policies = found
        # (v1.6.2 overcommits an explicit memory request too)
        webhook_guest = self.config.profile.memory_request == WEBHOOK_GUEST
        request_overcommit = Fraction(overcommit, 100) if webhook_guest else Fraction(1)
        out = []
        for pol in sorted(policies, key=lambda p: p.name):
            ratio = pol.ratio(kv_ratio)
            factors = {
                r: pod_factor(pol.mode, r, kubevirt_ratio=kv_ratio, memory_overcommit=overcommit, mode_ratio=ratio)
                for r in pol.budget
            }
            minimums = vmi_minimums(
                pol.mode,
                pol.budget,
                factors,
                ratio,
                request_overcommit=request_overcommit,
            )
            out.append((pol, ratio, factors, minimums))
        return out

    def run(self) -> NamespaceUsage:
        self._pods()
        self._migrations()
        self._running_vms()
        self._admissions()
        results: dict[str, QuotaUsage] = {}
        for q in self.quotas:
            b = q.policy.budget
            used, pods, reserved = q.used.result(), q.pods.result(), q.reserved.result()
            overlap, unvouched, taken_ = q.overlap.result(), q.unvouched.result(), q.taken.result()
            results[q.policy.name] = QuotaUsage(
                policy=q.policy,
                used=used,
                pods=pods,
                reserved=reserved,
                overlap=overlap,
                unvouched=unvouched,
                taken=taken_,
                factors=q.factors,
                hard=desired_hard(b, taken_, pods, reserved, q.factors, overlap, unvouched, self.target_reserved),
                over_budget=tuple(sorted(r for r in b if q.counted(r) > b[r].nanos)),
                vmi_minimums=q.vmi_minimums,
            )
        return NamespaceUsage(
            namespace=self.namespace,
            quotas=results,
            vms=(
                *(self.vm_entries[vm_key(v)] for v in self.vmis),
                *(self.vm_entries[vm_key(v)] for v in self.departed if vm_key(v) in self.vm_entries),
            ),
            migrations=tuple(self.mig_entries),
            pods=tuple(self.pod_entries),
            errors=tuple(self.errors + self.renderer.errors),
        )
