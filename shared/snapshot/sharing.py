"""What a ledger holds for thousands of objects, shared: equal resource lists are one dict (by the identity of their
quantities, which the wire decoder hands out one per printed form). The events decoder's fast path
(``shared.snapshot.fastpath``) uses it, and interns the strings that recur. An optimisation only: nothing depends
on it for correctness."""

from __future__ import annotations

from typing import Any, Final, TypeVar

from shared.bounded import Bounded
from shared.quantity import Quantity

V = TypeVar("V")


class Shared(dict[str, V]):
    """A part that snapshots of one shape share (read-only, like the snapshots holding it): its type says it is
    shared already (a VMI keeps a shared spec as it is). Equal to, and encoded as, a plain dict; a copy is a plain
    dict (shared is what a memo handed out, nothing else)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[dict[str, Any]]]:
        return dict, (dict(self),)


class SharedResources(Shared[Quantity]):
    """A resource list that snapshots of one shape share."""

    __slots__ = ()


NO_QUANTITIES: Final = SharedResources()
"""One empty resource list for every snapshot without one."""


_SHARED_LISTS: Final[Bounded[tuple[str | int, ...], SharedResources]] = Bounded(4096)


def shared_resources(rl: dict[str, Quantity]) -> SharedResources:
    """An equal resource list (the same names in the same order, the very same quantity objects) that snapshots
    of the same shape share (launcher pods of one instance type). Read-only, like the snapshot holding it.

    Keyed by the names and the ids of the quantities (the wire decoder hands out one object per printed form):
    hashing stays in C, which matters because this runs for every pod snapshot the ledger decodes. A stored list
    keeps its quantities alive, so an equal key means the very same quantities."""
    if not rl:
        return NO_QUANTITIES
    key: tuple[str | int, ...] = (*rl, *map(id, rl.values()))
    shared = _SHARED_LISTS.get(key)
    if shared is None:
        shared = _SHARED_LISTS.keep(key, SharedResources(rl))
    return shared
