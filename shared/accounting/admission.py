"""The admission pass of a namespace's accounting: pending VMs and hotplug growth in creation order, after every
running VM and pod is counted; then the migrations without growth."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Final

from shared.accounting.estimates import current_size
from shared.accounting.migrations import Migrations, migration_entry
from shared.accounting.pods import in_mode
from shared.accounting.results import (
    ADMITTED,
    CANCEL,
    REFUSED,
    VmEntry,
)
from shared.accounting.state import CreatedTarget, Target, created_key, fmt, size_change, vm_key, vm_size
from shared.quantity import ZERO
from shared.quota.equation import takes
from shared.quota.modes import (
    CPU_LIMIT_NAMES,
    CPU_REQUEST_NAMES,
    DEFINED_RESOURCES,
    MEMORY_NAMES,
    VmSize,
    mode_usage,
)
from shared.resources import ResourceList, add, growth, maximum, minimum, nonzero, positive_part
from shared.snapshot import (
    PodSnapshot,
    VmiSnapshot,
)
from shared.vmi import GUARD_REFUSERS

_CPU_NAMES: Final = CPU_REQUEST_NAMES | CPU_LIMIT_NAMES


class Admission(Migrations):
    """The admission pass."""

    def _admissions(self) -> None:
        """Pending VMs and hotplug growth, in creation order (a VMI's, a migration's), after every running VM and
        pod is counted; then the migrations without growth."""
        attach = []
        for c in self.created:  # (a migration to cancel needs no room for its target's attachment pod)
            if not self._cancel_unadmitted(c) and c.attach:
                attach.append(c)
        items: list[tuple[tuple[bool, datetime, str, str], int, VmiSnapshot | Target]] = [
            (created_key(v), i, v) for i, v in enumerate(self.pending)
        ]
        plain: list[Target] = []
        for t in self.targets:
            if t.grow or self._size_change(t.v):  # (a VM-term growth its pods may not show: explicit CPU, say)
                items.append((created_key(t.m), len(items), t))
            else:
                plain.append(t)
        for _, _, item in sorted(items, key=lambda it: it[:2]):
            if isinstance(item, Target):
                self._decide_target(item, admit=True)
            else:
                self._admit(item)
        for t in plain:  # the same VM, moving: it needs no admission, only (maybe) room for its second pod
            self._decide_target(t, admit=False)
        for a in attach:  # (and, beside a target, the hotplug attachment pod KubeVirt waits for)
            self._decide_attachment(a)

    def _cancel_unadmitted(self, c: CreatedTarget) -> bool:
        """Whether migration ``c``, whose target exists, is to be canceled (its entry then says so): its VM's spec
        is larger than the size it runs at (:meth:`_size_change`), and its end would carry the change out without
        the growth having passed quota admission. virt-handler gives the domain the spec's vCPUs at the end of every
        migration whatever its target was made for (``finalizeMigration``, ``hotplugCPU``), and its memory whatever
        it was made for where the VMI's pod-memory label says so (a label the tenant may write).

        A target made for the size the VM runs at (:meth:`_made_before_the_change`) got in without the growth:
        KubeVirt rendered it from a VMI its cache had before the change (a drain's migration the moment after a
        hotplug), or the change came while the target waited (without the reservation guard; with it, in the
        moment before kube-apiserver's cache has the migration). Such a migration is canceled whatever the budget
        says: its growth was never in any pod native quota admitted, and a ``status.hard`` the quota controller has
        not lowered yet lets other pods into the room it takes. A target made for the change got in with its
        growth, through quota admission. Where the pods cannot show the change (nothing grows in what quota charges,
        or the VMI does not render), the budget decides: canceled when, with the VM counted at its spec, as it is
        while its target exists, some quota is over its budget in a resource the change grows.

        The enforcer deletes a migration so marked: KubeVirt cancels one not yet handed off and aborts one that runs,
        and the VM keeps running at its current size; a migration KubeVirt makes again is rendered at the new size,
        whose growth is admitted, or refused, like any hotplug's."""
        v = c.v
        if not self._size_change(v):
            return False
        pods = self.launchers.get(vm_key(v), [])
        # Every pod carrying the migration's label is judged, each against all the VM's other pods, labelled or not:
        # a tenant's pod so labelled and made for the spec must not stand in for KubeVirt's target, nor the source,
        # labelled so by the tenant, leave the pods the target is judged against. (A tenant can add a pod made for
        # the new size, one KubeVirt adopts into the VMI, never shrink KubeVirt's; and the ledger remembers a pod as
        # made for its VMI's spec as it first saw it with the pod, so a target rendered from the VMI before the
        # change, first seen after it, would look made for it.)
        labelled = {p.uid for p, _ in c.labelled}
        judged = [
            self._made_before_the_change(v, charged, [pc for pc in pods if pc[0].uid != p.uid])
            for p, charged in c.labelled
        ]
        if not any(judged) and False in judged:
            return False
        if any(judged):
            why = (
                f"{c.exists}, made for the size the VM runs at, not its spec's; its end would give the VM its spec's "
                "size, whose growth was never admitted"
            )
        else:
            parts = self._over_with_the_change(v, [pc for pc in pods if pc[0].uid not in labelled])
            if not parts:
                return False
            why = f"{c.exists}; its end would give the VM its spec's size, which was never admitted and does not fit: "
            why += "; ".join(parts)
        why += "; canceled (KubeVirt cancels the migration, or aborts it once it runs), the VM keeps running at its "
        why += "current size"
        self.mig_entries[c.index] = migration_entry(c.m, CANCEL, why, None, c.grow)
        return True

    def _made_before_the_change(
        self, v: VmiSnapshot, target: ResourceList, others: list[tuple[PodSnapshot, ResourceList]]
    ) -> bool | None:
        """Whether a target charged ``target`` was made for the size the VM runs at in ``others`` (its pods but the
        target), not for its spec. The change shows in the pods as the growth between the renderings at the two
        sizes (the vCPUs' CPU and memory overhead, guest memory). A target short of the spec's CPU by half of one
        added vCPU's share, or its memory by half of a guest memory change, was made before it
        (:meth:`_short_of_the_spec`). In each resource where the pods the VM runs in lack at least half of it (the
        smallest of them, against the rendering at the spec: a tenant can add a pod, never shrink KubeVirt's), a
        target made for the change has at least half of it more than the largest of them (half: a rendering a
        little off KubeVirt's must not make a target made for the spec look made before it, and
        a KubeVirt setting that keeps a resource from growing, a cluster-wide ``cpuRequest``, leaves it out; a vCPU
        change such a setting keeps out of every CPU resource is not shown by the rest: None unless the target lacks
        something). False when they lack nothing and the ledger saw each made for the spec's vCPUs (its domain
        started at the spec: the VMI raised while pending), and the migration changes nothing; None when the pods
        cannot show the change (nothing grows in what quota charges, they are charged the spec's rendering or more
        without having been made for it, or the VMI does not render), or, with a guest memory change pending, the
        target's memory is not the rendering at the spec's (short of it by less than the measure, or beyond it)."""
        grow = nonzero(self.renderer.hotplug_growth(v))
        at_spec = self.renderer.new_pod_usage(v)
        charges = [charged for _, charged in others]
        if not grow or at_spec is None or not charges:
            return None
        if self._short_of_the_spec(v, target, grow, at_spec):
            return True
        half = {r: q.nanos // 2 for r, q in grow.items()}
        smallest = functools.reduce(minimum, charges)
        lacking = [r for r in grow if at_spec.get(r, ZERO).nanos - smallest.get(r, ZERO).nanos >= half[r]]
        if not lacking:
            # they show the spec: made for it when the ledger saw each made when the spec was what it is now (a VMI
            # raised while pending); a charge larger than the rendering (containers a webhook adds, or those of an
            # annotation the tenant took off the VMI since) shows nothing, and the budget decides
            made = [self._made_for(v, p) for p, _ in others]
            if not v.memory_change and all(m is not None and m >= v.vcpus for m in made):
                return False
            return None
        largest = functools.reduce(maximum, charges)
        if any(target.get(r, ZERO).nanos < largest.get(r, ZERO).nanos + half[r] for r in lacking):
            return True
        if self._runs_at_vcpus(v, others) < v.vcpus and not any(r in _CPU_NAMES for r in lacking):
            # the vCPUs' part shows in no CPU resource (a cluster-wide ``cpuRequest``): their memory overhead is lost
            # beside a guest memory change, so what the target has shows nothing of them, and the budget decides
            return None
        if v.memory_change and any(
            target.get(r, ZERO).nanos != at_spec.get(r, ZERO).nanos for r in grow if r in MEMORY_NAMES
        ):
            # not the spec's memory as vmquota renders it: short of it by less than the measure (a rendering a little
            # off KubeVirt's, or a target made for a raise admitted on the way, the spec raised again by less since),
            # or beyond it (containers the VMI no longer asks for: hook sidecars whose annotation the tenant took off
            # at the raise, charged more than the raise); virt-handler gives the guest the spec's memory all the
            # same, so the budget decides
            return None
        return False

    def _short_of_the_spec(
        self, v: VmiSnapshot, target: ResourceList, grow: ResourceList, at_spec: ResourceList
    ) -> bool:
        """Whether a target lacks, in a resource the change grows, a measure of it against the rendering at the spec,
        whatever it carries beside it: made for less than the spec (a size admitted on the way, the spec raised
        again while the target waited or KubeVirt's cache having the first of two raises; hook sidecars added to the
        VMI before the migration, which put a target made for the old size more than half of the change above the
        VM's other pods). In CPU the measure is half of what one added vCPU adds: vmquota renders CPU as KubeVirt
        does (the vCPUs over the allocation ratio, explicit CPU grown by the added vCPUs' share, sidecars), in the
        cluster's configuration now, as KubeVirt renders a new target, so an allocation ratio changed since the
        VM's other pods were made changes nothing here (one changed, or automatic CPU limits turned on, since the
        target was made cancels that migration once; KubeVirt renders the next in the new configuration). In memory,
        with a guest memory change pending, it is half of the change: what the vCPUs alone add to memory (their
        overhead), and a guest memory a little short of the spec's, are within the rendering's error."""
        added = v.vcpus - current_size(v).vcpus

        def short(r: str, by: int) -> bool:
            return target.get(r, ZERO).nanos + by < at_spec.get(r, ZERO).nanos

        return any(
            (r in _CPU_NAMES and added > 0 and short(r, q.nanos // (2 * added)))
            or (r in MEMORY_NAMES and v.memory_change and short(r, q.nanos // 2))
            for r, q in grow.items()
        )

    def _over_with_the_change(self, v: VmiSnapshot, others: list[tuple[PodSnapshot, ResourceList]]) -> list[str]:
        """Why the quotas, with the VM counted at its spec (as it is while its target exists), are over their budget
        in a resource the change grows against the size it runs at (``Vms._runs_at_vcpus`` of its pods in
        ``others``, all but the target; the spec's guest memory where they all carry it), or nothing."""
        cur = self.vm_entries.get(vm_key(v))
        if cur is None:
            return []
        return self._over_with(
            cur,
            VmSize(self._runs_at_vcpus(v, others), self._runs_at_memory(v, others)),
            lambda q, grows: [r for r, b in q.policy.budget.items() if r in grows and q.over(r, b)],
        )

    def _size_change(self, v: VmiSnapshot) -> bool:
        """The VM's spec is larger than the size it runs at (:func:`~shared.accounting.state.size_change`), or than
        some pod of it may have been made for (the fewest of :attr:`made_for`): a CPU hotplug its status does not
        show, the VMI created with a ``currentCPUTopology`` as large as the spec it is later raised to (KubeVirt
        then sees no change, and carries the new size out by the next migration all the same). Some pod, not every
        one: a tenant can add a pod made for the raised spec to the VM (adopted into the VMI and let go of, it runs
        on as the VM's), never take KubeVirt's away."""
        if size_change(v):
            return True
        made = [self._made_for_fewer(v, p) for p, _ in self.launchers.get(vm_key(v), ())]
        return any(m is not None and m < v.vcpus for m in made)

    def _beside_own(self, usages: Mapping[str, ResourceList], own: Sequence[ResourceList]) -> dict[str, ResourceList]:
        """Per quota, what a pending VM needs beyond what its own launcher pods ``own`` already count as it (less
        than nothing where they count more than the VM: their overhead)."""
        out: dict[str, ResourceList] = {}
        for q in self.quotas:
            empty: ResourceList = {}
            counted = functools.reduce(add, (in_mode(c, q.factors) for c in own), empty)
            # (not clamped at zero: what its pods count beyond the VM, their overhead, is room it frees too)
            out[q.policy.name] = {r: n - counted.get(r, ZERO) for r, n in usages[q.policy.name].items()}
        return out

    def _refused_for_room(self, v: VmiSnapshot) -> bool:
        """KubeVirt was refused the VMI's launcher pod by a managed quota or the reservation guard: room made for it
        mends that. (A quota vmquota does not manage refuses it whatever room the managed ones hold; a watcher
        before ``refused_by`` said only that some ``FailedCreate`` happened.)"""
        if not v.pod_refused:
            return False
        who = v.refused_by
        return not who or who in GUARD_REFUSERS or any(q.policy.name == who for q in self.quotas)

    def _admit(self, v: VmiSnapshot) -> None:
        """A pending VM (no launcher pod named yet: one its command names may exist), in creation order: admitted iff it
        fits every managed quota. Room is held for its pod (``S``, ``W``) once KubeVirt was refused it for room
        (:meth:`_refused_for_room`), at the size the latest refusal asked within the estimate's evidence bound;
        none when it asked for more: room held for the estimate would not let that pod in, and with the guard its
        holder would keep every other pod of the namespace out meanwhile (a webhook's containers, which the
        rendering does not know; or an Event that is not KubeVirt's, whose tenant holds back its own VM). It starts
        when KubeVirt next tries it with the room the namespace has, and the refusal of that try decides then.
        The latest, not the largest: what made a pod larger (a webhook's container, KubeVirt's overhead ratio) may
        have gone, and a VM whose pod needs vmquota's room (its overhead, in the VM-term modes) was kept pending for
        good by a refusal from before. Latest in the order the ledger folded them (:attr:`refused`; else by the
        times its Events state): a refusal of the tenant's own after KubeVirt's decides for its own VM only, as with
        the guard a holder's pod is held to the room held for it."""
        key = vm_key(v)
        # its own launcher pod may exist already, counted as the VM (KubeVirt names it in the write that moves the
        # VMI on, which may come after the pod's event): no room is held for another, and the VM at its size stands
        # in for that pod (not refused for the room its own pod takes, nor counted less than its size)
        own = self.as_vm_pods.get(v.uid, ())
        refused = self._refused_for_room(v) and not own
        size = vm_size(v)
        estimate = self.renderer.new_pod_usage(v) or {}
        taken: ResourceList = {}
        pod_est = dict(estimate)
        beyond = False
        if refused:  # (a status condition only KubeVirt writes: it really tried to create the pod)
            latest = self.refused.get(v.uid)  # (the fold's: its Event may have been deleted or pushed out)
            if latest is None:
                found = self._refusals(v, v.creation_timestamp)
                latest = found[-1] if found else None
            pod_est, taken, beyond = self._bounded(estimate, [latest] if latest else [], v.ref)
            refused = not beyond
        pod_est = nonzero(pod_est)
        usages = {q.policy.name: mode_usage(q.policy.mode, size, pod_est, q.ratio) for q in self.quotas}
        if taken:
            # what a refusal's amounts raise the estimate by counts as the VM's, in the mode's terms: an Event is
            # anyone's to write, and room held for it beyond the budget was open to any pod once the VM's own pod was
            # in, without the guard (the rendering's own overhead beyond the mode's terms stays outside, as for
            # every new VM); only in the resources the mode counts in its own terms: in the others the VM counts its
            # pod's usage, the raised estimate already
            inflated = growth(pod_est, estimate)
            for q in self.quotas:
                defined = DEFINED_RESOURCES[q.policy.mode]
                raised = {r: n for r, n in inflated.items() if r in defined}
                if raised:
                    usages[q.policy.name] = add(usages[q.policy.name], in_mode(raised, q.factors))
        # (with its own pods: the VM at its size in their stead must fit, and it counts what it needs beyond them)
        needs = self._beside_own(usages, own) if own else usages
        misfit, parts = self._misfits(needs)
        if misfit:
            reason = "pending, does not fit: " + "; ".join(parts)
            self.vm_entries[key] = VmEntry(v.name, v.uid, v.phase, REFUSED, reason, size, pod_est, {}, {}, misfit)
            return
        for q in self.quotas:
            need = needs[q.policy.name]
            q.used.add(usages[q.policy.name] if not own else positive_part(need))
            if refused:
                q.taken.add(takes({}, usages[q.policy.name], q.factors))
                q.reserved.add(pod_est)
        if refused:
            reason = "pending, admitted in creation order: launcher pod reserved"
        elif own:
            reason = (
                "pending, admitted in creation order; its launcher pod exists (KubeVirt has not named it in the VMI "
                "yet) and counts as the VM (with what its size needs beyond that pod, if anything)"
            )
        elif beyond:
            reason = (
                "pending, admitted in creation order; no room is held for its launcher pod: a quota refusal asked "
                "for more than its estimate's bound (see errors), which held room would not let in"
            )
        else:
            reason = (
                "pending, admitted in creation order; room is reserved for its launcher pod once KubeVirt is refused it"
            )
        if taken:
            reason += f" (the amounts of a quota refusal: {fmt(taken)})"
        if not estimate:
            reason += "; its launcher pod could not be estimated (see errors)"
        self.vm_entries[key] = VmEntry(
            v.name,
            v.uid,
            v.phase,
            ADMITTED,
            reason,
            size,
            pod_est,
            usages,
            pod_est if refused else {},
            pod_refused=refused,
            vmi_size=self.renderer.held_digest(v),
        )
