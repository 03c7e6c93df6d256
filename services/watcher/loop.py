"""The pure parts of the watcher's list→watch loop: what it remembers per object, the relist diff, which failures
mean what (the backoff schedule is ``shared.backoff``). No I/O here, so the rules are unit-tested on their own.

Memory is bounded by design: per object the loop keeps ``uid → (namespace, name, resourceVersion)`` and never the
object itself (:class:`KnownSet`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from shared.quota.modes import is_managed
from shared.snapshot import labelled_launcher


class Tracked(NamedTuple):
    """What the loop remembers of one object."""

    namespace: str
    name: str
    rv: int
    launcher: bool = False
    """A launcher pod (tracked in every namespace; other pods only in managed ones)."""


class KnownSet:
    """``uid → Tracked`` of one watched resource, with the namespace strings interned (thousands of objects share a
    handful of namespaces)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, uid: object) -> bool:
        return uid in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def get(self, uid: str) -> Tracked | None:
        return self._items.get(uid)

    def put(self, uid: str, namespace: str, name: str, rv: int, launcher: bool = False) -> None:
        self._items[uid] = Tracked(sys.intern(namespace), name, rv, launcher)

    def pop(self, uid: str) -> Tracked | None:
        return self._items.pop(uid, None)

    def items(self) -> Iterable[tuple[str, Tracked]]:
        return self._items.items()

    def snapshot(self) -> dict[str, Tracked]:
        return dict(self._items)

    def namespaces(self) -> set[str]:
        return {t.namespace for t in self._items.values()}

    def drop_namespace(self, namespace: str, *, keep_launchers: bool = True) -> int:
        """Forget the objects of ``namespace`` (but launcher pods, unless told); how many were forgotten."""
        gone = [u for u, t in self._items.items() if t.namespace == namespace and not (keep_launchers and t.launcher)]
        for u in gone:
            del self._items[u]
        return len(gone)


def is_newer(known: Tracked | None, rv: int) -> bool:
    """Whether a version ``rv`` of an object is worth publishing: nothing is known of it, or it is newer."""
    return known is None or rv > known.rv


@dataclass(frozen=True, slots=True)
class RelistDiff:
    """What a relist at ``list_rv`` means against what the loop knew before it."""

    changed: list[str]
    """UIDs listed at a version the loop has not published (new objects or newer versions)."""
    vanished: list[tuple[str, Tracked]]
    """Known objects absent from the list and not newer than it: deleted while the loop was not watching."""
    present: dict[str, list[str]] = field(default_factory=dict)
    """namespace → sorted UIDs listed there."""


def diff_relist(known: Mapping[str, Tracked], listed: Mapping[str, Tracked], list_rv: int) -> RelistDiff:
    """Compare a list (``uid → Tracked``, taken at ``list_rv``) with what was known.

    A known object that the list lacks vanished only if the loop saw it at or before ``list_rv``; one it learnt of
    after the list was taken (another task listed a namespace meanwhile) cannot be judged by this list."""
    changed = [uid for uid, t in listed.items() if is_newer(known.get(uid), t.rv)]
    vanished = sorted(
        ((uid, t) for uid, t in known.items() if uid not in listed and t.rv <= list_rv),
        key=lambda item: (item[1].namespace, item[1].name, item[0]),
    )
    present: dict[str, list[str]] = {}
    for uid, t in listed.items():
        present.setdefault(t.namespace, []).append(uid)
    for uids in present.values():
        uids.sort()
    return RelistDiff(changed=changed, vanished=vanished, present=present)


def sync_namespaces(diff: RelistDiff, known_before: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """The namespaces a relist speaks for: where objects are listed, where they were known before it
    (``known_before``: their namespaces), and ``extra`` (every namespace of the cluster, so a namespace emptied
    while nobody watched is synced too)."""
    return sorted(set(diff.present) | set(known_before) | set(extra))


# ---- pods: which ones the watcher publishes --------------------------------------------------------------------


def pod_wanted(labels: object, namespace: str, managed: ManagedNamespaces | Iterable[str]) -> bool:
    """Launcher pods always; other pods only in namespaces with a managed ResourceQuota."""
    return labelled_launcher(labels) or namespace in managed


def quota_is_managed(labels: object) -> bool:
    """A ResourceQuota opted in (``vmquota.io/managed: "true"``), read from raw metadata.labels."""
    if not isinstance(labels, Mapping):
        return False
    clean = {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}
    return is_managed(clean)


class ManagedNamespaces:
    """Namespaces with at least one managed ResourceQuota, from the quotas' watch events."""

    __slots__ = ("_epochs", "_quotas")

    def __init__(self) -> None:
        self._quotas: dict[str, set[str]] = {}
        """namespace → uids of its managed quotas."""
        self._epochs: dict[str, int] = {}
        """namespace → how many times it changed between managed and not."""

    def epoch(self, namespace: str) -> int:
        return self._epochs.get(namespace, 0)

    def epochs(self) -> dict[str, int]:
        """The epoch of every managed namespace (to tell later whether one changed meanwhile)."""
        return {ns: self._epochs.get(ns, 0) for ns in self._quotas}

    def _bump(self, namespace: str) -> None:
        self._epochs[namespace] = self._epochs.get(namespace, 0) + 1

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._quotas

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._quotas))

    def __len__(self) -> int:
        return len(self._quotas)

    def update(self, namespace: str, uid: str, managed: bool) -> bool | None:
        """Record a quota's state; True when the namespace became managed, False when it stopped being so, None
        when nothing changed for the namespace."""
        quotas = self._quotas.get(namespace)
        if managed:
            if quotas is None:
                self._quotas[namespace] = {uid}
                self._bump(namespace)
                return True
            quotas.add(uid)
            return None
        if quotas is None or uid not in quotas:
            return None
        quotas.discard(uid)
        if not quotas:
            del self._quotas[namespace]
            self._bump(namespace)
            return False
        return None

    def replace(self, managed: Mapping[str, Iterable[str]]) -> tuple[list[str], list[str]]:
        """Set the whole state from a relist (namespace → managed quota uids); (became managed, stopped being)."""
        new = {ns: set(uids) for ns, uids in managed.items() if uids}
        added = sorted(set(new) - set(self._quotas))
        removed = sorted(set(self._quotas) - set(new))
        self._quotas = new
        for ns in (*added, *removed):
            self._bump(ns)
        return added, removed


# ---- failures and backoff --------------------------------------------------------------------------------------


class Recovery(Enum):
    RELIST = "relist"
    """410 Gone: the version the loop holds is compacted away; list again and diff."""
    BACKOFF = "backoff"
    """Throttled, server error, network trouble (or a client error an operator must fix): wait, then retry."""


def classify(status: int) -> Recovery:
    return Recovery.RELIST if status == 410 else Recovery.BACKOFF
