"""The one policy of the pure core's memos of recurring values (quantities by printed form, shared resource lists
and VMI specs, decoded texts): a dict read as any dict, at most ``maxsize`` entries, emptied when full.

Each memo only saves work or memory: a value found is the value that would be computed, so emptying one changes
no result. Emptying at once (instead of evicting one entry at a time) keeps a hit a single C-level ``dict.get``
and a miss one method call; the values a workload repeats come back after a few misses.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Bounded(dict[K, V]):
    """A memo of at most ``maxsize`` entries: read it as a dict, add to it with :meth:`keep`."""

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize

    def keep(self, key: K, value: V) -> V:
        """Remember ``value`` for ``key`` (emptying the memo first when it is full) and return it."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value
