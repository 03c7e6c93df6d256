"""Sums of resource lists kept up to date as lists are added, replaced or removed (:class:`Sum`): the accelerator
behind ``U``, ``P``, ``S``, ``D`` and ``X``. The total is the same as adding the lists in order with
:func:`shared.resources.add`, printed form included.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import compress, islice
from operator import is_not
from typing import Final, cast

from shared.accounting.memo import MISS, Memo
from shared.quantity import ZERO, Format, Quantity
from shared.resources import ResourceList

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
SumValue = tuple[dict[str, int], dict[str, Format], bool]
"""A sum's total as a memo keeps it: nanos and format per resource, and whether it was added in order."""
_ADD_MAX: Final = 4
"""At most this many lists queued on a sum that has a total are added one by one (no chunks)."""
_AMEND_MAX: Final = 8
"""At most this many lists changed in place for :func:`_amended` to be tried (beyond, the chunks are cheaper)."""


def _amended(
    before: Sequence[object],
    value: SumValue,
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


class Sum:
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
        memo: Memo | None = None,
        slot: Hashable = None,
        alike: dict[tuple[int, ...], tuple[tuple[object, ...], SumValue]] | None = None,
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
                before = self._chunks_before = {} if found is MISS else found
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
