"""Sums of resource lists kept up to date as lists are added, replaced or removed (:class:`Sum`): the accelerator
behind ``U``, ``P``, ``S``, ``D``, ``X`` and ``W``. A sum is plain integer addition of nanos per resource (keys in
order of first appearance, as adding the lists in order with :func:`shared.resources.add` gives them); each total
comes out in its resource's one form (:func:`shared.resources.natural_format`), whatever the formats of what was
added, so the order in which lists are added changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import compress
from operator import is_not
from typing import Final, cast

from shared.accounting.memo import MISS, Memo
from shared.quantity import Quantity
from shared.resources import ResourceList, natural_format

_CHUNK_MAX: Final = 64

SumValue = dict[str, int]
"""A sum's total as a memo keeps it: nanos per resource, in order of first appearance."""


def _summary(chunk: Sequence[Mapping[str, Quantity]]) -> SumValue:
    """The sum of a chunk of lists, in nanos per resource (keys in order of first appearance)."""
    nanos: dict[str, int] = {}
    for rl in chunk:
        for k, q in rl.items():
            nanos[k] = nanos.get(k, 0) + q.nanos
    return nanos


_ADD_MAX: Final = 4
"""At most this many lists queued on a sum that has a total are added one by one (no chunks)."""
_AMEND_MAX: Final = 8
"""At most this many lists changed in place for :func:`_amended` to be tried (beyond, the chunks are cheaper)."""


def _amended(before: Sequence[object], value: SumValue, now: Sequence[Mapping[str, Quantity]]) -> SumValue | None:
    """The sum of ``now`` from ``value``, the sum of ``before``, when they are the same lists but for a few replaced
    in place with the same resources in the same order (so the keys keep their order). Else None: the caller sums
    the chunks."""
    if len(before) != len(now):
        return None
    lists = cast(Sequence[Mapping[str, Quantity]], before)  # (a sum's memo keeps the lists it added)
    changed = list(compress(range(len(now)), map(is_not, lists, now)))
    if len(changed) > _AMEND_MAX:
        return None
    out = dict(value)
    for i in changed:
        old, new = lists[i], now[i]
        if tuple(old) != tuple(new):
            return None
        for k, q in new.items():
            out[k] += q.nanos - old[k].nanos
    return out


class Sum:
    """A running sum of resource lists in integer nanos (values and key order as adding them in order gives);
    :meth:`result` builds the quantities once, each in its resource's form.

    With a memo, added lists are queued and folded in chunks whose sums are remembered by the identity of their
    lists (the chunks of this sum's last accounting, in the memo's slot ``("chunks", slot)``): the lists of
    memoised entries (a running VM's counts, a pod's usage) are the same objects from one accounting to the next,
    so after one change only the chunk it is in is summed again. Folding a chunk's sum gives what adding its lists
    in order gives (integers: the grouping changes nothing). A sum of the very same lists as the last accounting's
    but for a few replaced in place is amended instead (:func:`_amended`), and sums of one accounting that add the
    very same lists from nothing (quotas covering the same pods) are summed once (``alike``: the totals of this
    accounting's sums by the identities of their lists)."""

    __slots__ = ("_chunks_before", "_chunks_now", "alike", "memo", "nanos", "pending", "slot")

    def __init__(
        self,
        memo: Memo | None = None,
        slot: Hashable = None,
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] | None = None,
    ) -> None:
        self.nanos: dict[str, int] = {}
        self.memo = memo if memo is not None and memo.remembers else None  # (no memory: added one by one)
        self.slot = slot
        """Which sum this is (namespace, quota, term), where its latest total is remembered."""
        self.alike = alike
        self.pending: list[Mapping[str, Quantity]] = []
        self._chunks_before: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] | None = None
        self._chunks_now: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] = {}

    def add(self, rl: Mapping[str, Quantity]) -> None:
        if self.memo is None:
            self._add(rl)
        else:
            self.pending.append(rl)

    def extend(self, rls: Iterable[Mapping[str, Quantity]]) -> None:
        if self.memo is None:
            for rl in rls:
                self._add(rl)
        else:
            self.pending.extend(rls)

    def _add(self, rl: Mapping[str, Quantity]) -> None:
        nanos = self.nanos
        for k, q in rl.items():
            nanos[k] = nanos.get(k, 0) + q.nanos

    def _flush(self) -> None:
        pending = self.pending
        if not pending:
            return
        self.pending = []
        if self.nanos and len(pending) <= _ADD_MAX:  # a few lists on top (admitted VMs): add them as they are
            for rl in pending:
                self._add(rl)
            return
        memo = cast(Memo, self.memo)  # (lists wait only in a sum with a memo: see add)
        whole: tuple[Mapping[str, Quantity], ...] = ()
        if not self.nanos:
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
                    value = _amended(last[1], last[2], whole)
                if value is not None:
                    memo.put_latest(self.slot, key, whole, value)
            if value is not None:
                self.nanos = dict(value)
                if self.alike is not None:
                    self.alike[key] = (whole, value)
                return
        self._chunks(pending)
        if whole:
            value = dict(self.nanos)
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
        memo = cast(Memo, self.memo)
        before = self._chunks_before
        if before is None:  # the first chunk of this accounting: this sum's chunks of the last one
            slot = ("chunks", self.slot)
            found = memo.get_latest(slot, None)
            before = self._chunks_before = {} if found is MISS else found
            memo.put_latest(slot, None, (), self._chunks_now)
        objs = tuple(chunk)
        key = tuple(map(id, objs))  # the chunk's lists are kept with its sum: equal ids, the same lists
        hit = before.get(key)
        summary = _summary(objs) if hit is None else hit[1]
        self._chunks_now[key] = (objs, summary)
        nanos = self.nanos
        for k, n in summary.items():
            nanos[k] = nanos.get(k, 0) + n

    def get(self, resource: str) -> int:
        if self.pending:
            self._flush()
        return self.nanos.get(resource, 0)

    def result(self) -> ResourceList:
        self._flush()
        return {k: Quantity(n, natural_format(k)) for k, n in self.nanos.items()}
