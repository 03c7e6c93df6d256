"""The enforcer's writes of the reservation guard's parameter: each managed namespace's ``QuotaReservation`` lists
the holders of every reservation its quotas carry or are being written with (``shared.quota.guard`` has the
content; ``docs/accounting.md``, "The reservation guard", the order).

The holders are listed *before* a write of ``spec.hard`` that reserves for them (:meth:`GuardWriter.before`), and
taken off only once no quota of the namespace carries their reservation any more, in ``status.hard`` too
(:meth:`GuardWriter.after`): the room vmquota opens is never open to other pods. A holder reserved at a size is
listed unconfirmed until :meth:`GuardWriter.confirm` has read its VMI at that size (its size is kept from the
listing on): the room may be in ``hard`` already, and a pod rendered at another size must not get into it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Final

import structlog

from services.enforcer.kube import KubeError, Obj, QuotaApi, version_of
from services.enforcer.options import Key
from shared import contract
from shared.quota import guard
from shared.snapshot import QuotaSnapshot

log = structlog.get_logger("vmquota.enforcer")

GUARD_CONFLICTS: Final = 5
"""Writes of a QuotaReservation that may meet another writer's version before a grow gives up (and is retried)."""


class GuardWriter:
    """What each namespace's ``QuotaReservation`` must list, and the writes that make it so."""

    def __init__(
        self,
        kube: QuotaApi,
        creators: tuple[str, ...],
        carrying: Callable[[str], Iterable[str]] = lambda ns: (),
        complete: Callable[[], bool] = lambda: True,
        unsure: Callable[[str], None] = lambda ns: None,
    ) -> None:
        self.kube = kube
        self.creators = creators
        self.carrying = carrying
        """The names of a namespace's quotas the enforcer knows whose limits may hold room vmquota raised
        (``guard.may_carry``: managed, or handed back with the release pending): a shrink keeps what is listed
        while one of them has not been reconciled since the start (an earlier enforcer's raise may still be in
        it)."""
        self.complete = complete
        """Whether the enforcer has listed the managed quotas from the API server since its start (until then, a
        quota it does not know may carry a raise)."""
        self.unsure = unsure
        """Called with a namespace whose shrink kept what is listed for want of knowing its quotas (no quota known
        there that may carry a raise, or no listing yet): the caller has the API server show them, then
        :meth:`shrink`."""
        self._carried: dict[str, dict[str, frozenset[guard.Holder]]] = {}
        """namespace → quota name → the holders whose reservations the quota's ``spec.hard`` carries now."""
        self._writing: dict[str, dict[str, frozenset[guard.Holder]]] = {}
        """namespace → quota name → the holders of a ``spec.hard`` write under way."""
        self._listed: dict[str, tuple[frozenset[guard.Holder], frozenset[str], str]] = {}
        """What each namespace's QuotaReservation holds, the uids it lists unconfirmed, and its resourceVersion (as
        last read or written; dropped when a write meets another writer's version)."""
        self._sizes: dict[str, dict[str, guard.Sized]] = {}
        """namespace → holder uid → the size the latest usage reserved its pod at."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._sized: dict[str, dict[str, guard.Sized]] = {}
        """namespace → VMI name → the size it was read at while listed as a holder (it cannot change while it
        stays listed: the policy keeps it; dropped when the listing drops it or another writer wrote the list)."""
        self._opened: dict[str, set[str]] = {}
        """namespace → uids of the holders whose pods a write let in (listed, and confirmed) that the list kept out
        before it, since :meth:`opened` last took them."""

    async def before(self, key: Key, usage: contract.UsageSnapshot | None) -> None:
        """A write of ``spec.hard`` from ``usage`` is about to go out: its holders are listed first. Raises when they
        could not be (no raise goes out unguarded; the quota is retried with backoff)."""
        writing = self._writing.setdefault(key[0], {})
        # (with those of an earlier write that failed: it may have landed, its answer lost)
        writing[key[1]] = writing.get(key[1], frozenset()) | guard.holders(usage)
        self._reserved_at(key[0], usage)
        await self.write(key[0], grow=True)

    async def after(self, key: Key, quota: QuotaSnapshot, usage: contract.UsageSnapshot | None) -> None:
        """The quota now carries ``quota.spec_hard``: record whose reservations that holds, and let the namespace's
        QuotaReservation shrink to what its quotas still carry."""
        ns, name = key
        before = self._carried.get(ns, {}).get(name)
        if before is None:  # first time since the start: it may carry what the QuotaReservation lists
            async with self._locks.setdefault(ns, asyncio.Lock()):  # (not while another write is under way)
                before = (await self._state(ns))[0]
        # (the write's holders, and those of earlier writes that failed but may have landed, count as carried before
        # it; popped only now: until then they are what the write keeps)
        written = self._writing.get(ns, {}).pop(name, frozenset())
        self._carried.setdefault(ns, {})[name] = guard.carried(before | written, quota, usage)
        self._reserved_at(ns, usage)
        await self.write(ns, grow=False)

    def _reserved_at(self, namespace: str, usage: contract.UsageSnapshot | None) -> None:
        self._sizes[namespace] = {s.uid: s for s in guard.reserved_sizes(usage) if s.uid}

    def shrinks(self, key: Key, quota: QuotaSnapshot, usage: contract.UsageSnapshot | None) -> bool:
        """Whether :meth:`after` with ``quota`` could take holders off the list (or, the first time since the start,
        whatever an earlier enforcer listed): the enforcer then has it from the API server first, since a quota
        event's ``status.hard`` is only the bus's word, and taking a holder off opens its room to every pod."""
        ns, name = key
        before = self._carried.get(ns, {}).get(name)
        if before is None:
            return True
        # (with the holders of a write of hard that failed, which after() counts: it may have landed, and the copy
        # at hand, a quota event's, may be older than it)
        before = before | self._writing.get(ns, {}).get(name, frozenset())
        return bool(before - guard.carried(before, quota, usage))

    async def confirm(self, namespace: str, usage: contract.UsageSnapshot | None) -> str:
        """Read every VMI whose pod ``usage`` reserves (its holder is listed, so its size can no longer change) and
        confirm the holders that still have the size their pod was reserved at; why the others wait, or "". A
        hotplug the ledger has not seen would make KubeVirt render the pod larger than its room: such a holder stays
        unconfirmed (its pods stay out; a raise for it goes out, open to no pod) until the ledger's next usage, with
        the new size, is planned. Another writer's version met meanwhile drops what was read (the list is read
        again): the VMIs are read again until the list confirms every holder found at its size; raises when it keeps
        changing (the quota is retried with backoff: an unconfirmed holder keeps the namespace's pods out)."""
        sizes = sorted(guard.reserved_sizes(usage))
        for _ in range(GUARD_CONFLICTS):
            why, resized, read = "", set(), False
            for sized in sizes:
                if self._sized.get(namespace, {}).get(sized.vmi) == sized:
                    continue
                read = True
                obj = await self.kube.get_vmi(namespace, sized.vmi)
                if not guard.still_sized(sized, obj):
                    self._sized.get(namespace, {}).pop(sized.vmi, None)
                    why = why or f"VMI {sized.vmi} is not the size its pod was reserved at"
                    resized.add(sized.uid)
                    continue
                # remembered only if listed now, after the read (a shrink meanwhile may have taken it off the list)
                if sized.uid in {h.uid for h in self._listed.get(namespace, (frozenset(), frozenset(), ""))[0]}:
                    self._sized.setdefault(namespace, {})[sized.vmi] = sized
            if read:  # (nothing read: the list is as before()/after() just wrote it)
                await self.write(namespace, grow=True)
            listed, unconfirmed, _ = self._listed.get(namespace, (frozenset(), frozenset(), ""))
            uids = {h.uid for h in listed}
            if not any(s.uid in unconfirmed and s.uid in uids and s.uid not in resized for s in sizes):
                return why
        raise KubeError(409, "Conflict", f"the QuotaReservation of {namespace} kept changing under the enforcer")

    def opened(self, namespace: str) -> frozenset[str]:
        """The uids of the holders whose pods the writes since the last call let in (taken: the next call returns
        only those let in after). KubeVirt does not watch the QuotaReservation: a holder confirmed where ``hard``
        held its room already, with no write of a quota after it, waits for KubeVirt's backoff unless its VMI is
        touched (the caller's nudge)."""
        return frozenset(self._opened.pop(namespace, ()))

    def reopen(self, namespace: str, uids: frozenset[str]) -> None:
        """Give back holders :meth:`opened` returned that nothing woke KubeVirt for after all (the write of a quota
        that was to wake it failed): the next call returns them again."""
        if uids:
            self._opened.setdefault(namespace, set()).update(uids)

    def forget(self, key: Key) -> bool:
        """The quota is gone (or no longer managed): it carries nothing. True when it held holders (the namespace's
        QuotaReservation should then shrink: they would keep its pods out for nothing)."""
        ns, name = key
        held = [d.get(ns, {}).pop(name, None) for d in (self._carried, self._writing)]
        return any(held)

    async def shrink(self, namespace: str) -> None:
        """Take off what no quota of the namespace carries, the API server having just shown the namespace's quotas
        (a shrink still keeps what is listed while one that may hold room vmquota raised, ``guard.may_carry``, is
        not reconciled since the start); raises when it could not (the caller retries: a namespace left with no
        managed quota has no later write that would)."""
        await self.write(namespace, grow=False, checked=True)

    def observe(self, namespace: str, obj: Obj) -> bool:
        """The namespace's QuotaReservation as the API server listed it: held to be that when nothing is held (an
        earlier enforcer's), read again at the next write when what is held is another version (a write whose
        answer was lost; a listing may also be older than a write of this enforcer's, so it is not taken as is).
        True when it lists holders."""
        held = self._listed.get(namespace)
        if held is None:
            self._listed[namespace] = (guard.listed(obj), guard.unconfirmed(obj), version_of(obj))
        elif held[2] != version_of(obj):
            self._unheld(namespace)
        return bool(guard.listed(obj))

    def absent(self, present: set[str]) -> list[str]:
        """The API server listed the QuotaReservations of the namespaces ``present`` only: what is held of any other
        is dropped (read again at the next write). Returns the namespaces of those that were held to list holders
        (deleted by someone else while they guarded room: they are to be written again)."""
        gone = [ns for ns in self._listed if ns not in present]
        held = [ns for ns in gone if self._listed[ns][0]]
        for ns in gone:
            self._unheld(ns)
        return held

    def _unheld(self, namespace: str) -> None:
        """Forget what is held of the namespace's QuotaReservation, and the sizes read while it listed them: read
        again at the next write."""
        self._listed.pop(namespace, None)
        self._sized.pop(namespace, None)

    def holds_listed(self, namespace: str) -> bool:
        """Whether the namespace's QuotaReservation lists holders, as last read, listed or written."""
        held = self._listed.get(namespace)
        return held is not None and bool(held[0])

    async def _state(self, namespace: str) -> tuple[frozenset[guard.Holder], frozenset[str], str]:
        """What the namespace's QuotaReservation lists, which of them unconfirmed, and its resourceVersion: as last
        written, or read once after the start (an earlier enforcer's holders may still guard a quota's ``hard``)."""
        state = self._listed.get(namespace)
        if state is None:
            obj = await self.kube.get_reservation(namespace)
            state = self._listed[namespace] = (guard.listed(obj), guard.unconfirmed(obj), version_of(obj))
        return state

    def _waiting(
        self, namespace: str, want: frozenset[guard.Holder], have: frozenset[guard.Holder], unconfirmed: frozenset[str]
    ) -> frozenset[str]:
        """The holders of ``want`` to list unconfirmed: those reserved at a size their VMI has not been read at since
        they were listed, and those listed unconfirmed already that no usage reserves at a size any more."""
        sizes = self._sizes.get(namespace, {})
        read = self._sized.get(namespace, {})
        out = set()
        for h in want:
            sized = sizes.get(h.uid)
            if sized is not None:
                if read.get(sized.vmi) != sized:
                    out.add(h.uid)
            elif h in have and h.uid in unconfirmed:
                out.add(h.uid)
        return frozenset(out)

    async def write(self, namespace: str, *, grow: bool, checked: bool = False) -> None:
        """Make the namespace's QuotaReservation list every holder a quota of the namespace carries or is being
        written with (with ``grow``, never fewer than it lists now). Each write is conditional on the version
        last seen: one that meets another writer's version reads it and plans again from it, and a shrink then
        keeps what that writer listed beyond what the shrink started from (another enforcer's holders — a new
        leader's, should a write of a replica past its renew deadline get through — guard room it raised; this
        enforcer's own write whose answer was lost adds nothing it does not know). Until each managed quota of the
        namespace that may carry a raise is reconciled since the start, a shrink keeps what is listed, and so does
        one in a namespace the writer knows no such quota of, or before the managed quotas were listed, unless
        ``checked`` (the API server has just shown the namespace's quotas: one the writer does not know may carry a
        raise, a listing at the start having failed); :attr:`unsure` is then told. A write that fails otherwise may
        have landed: what the writer holds listed is read again next time. A failed write raises (the caller
        retries: a shrink dropped left holders listed for nothing, the namespace's other pods kept out)."""
        lock = self._locks.setdefault(namespace, asyncio.Lock())
        async with lock:
            known: frozenset[guard.Holder] | None = None  # what was listed when the write was planned
            for _ in range(GUARD_CONFLICTS):
                want = guard.union(
                    [*self._carried.get(namespace, {}).values(), *self._writing.get(namespace, {}).values()]
                )
                have, unconfirmed, rv = await self._state(namespace)
                known = have if known is None else known
                carried = self._carried.get(namespace, {})
                carrying = list(self.carrying(namespace))
                unknown = not grow and not checked and (not carrying or not self.complete())
                if unknown and have - want:
                    self.unsure(namespace)
                if grow or unknown or any(name not in carried for name in carrying):
                    want |= have
                else:
                    want |= have - known
                waiting = self._waiting(namespace, want, have, unconfirmed)
                if (want, waiting) == (have, unconfirmed):
                    return
                body = guard.reservation(namespace, want, self.creators, waiting)
                try:
                    written = await self.kube.put_reservation(namespace, body, rv)
                except KubeError as e:
                    self._unheld(namespace)  # (another writer's version, or it may have landed)
                    if not e.conflict:
                        raise
                    continue
                self._listed[namespace] = (want, waiting, written)
                let_in = {h.uid for h in want if h.uid not in waiting} - {
                    h.uid for h in have if h.uid not in unconfirmed
                }
                if let_in:
                    self._opened.setdefault(namespace, set()).update(let_in)
                uids = {h.uid for h in want}
                sized = self._sized.get(namespace, {})
                for vmi in [v for v, s in sized.items() if s.uid not in uids]:
                    del sized[vmi]
                log.info(
                    "reservation guard written",
                    namespace=namespace,
                    holders=sorted(h.name for h in want),
                    unconfirmed=sorted(h.name for h in want if h.uid in waiting),
                )
                return
            raise KubeError(409, "Conflict", f"the QuotaReservation of {namespace} kept changing under the enforcer")
