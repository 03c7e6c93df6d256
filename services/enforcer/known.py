"""The quotas the enforcer knows of: the newest version of each (by resourceVersion), the tombstones of deleted
ones, and which of them the API server itself returned labelled managed.

Two sources feed it and rank differently. The quota events (the watcher's) are kept only when newer than what is
held, and a deleted quota's tombstone keeps an older upsert from bringing it back. What the API server returns (a
listing, a read) is kept whatever version is held: a quota event with a forged resourceVersion must not outrank
the API server. Only quotas the API server returned labelled managed are set back to their budget when released
(``shared.quota.enforcement.plan``'s ``managed``): a tenant cannot write a quota, but the bus says only what its
publishers say.
"""

from __future__ import annotations

from collections.abc import Iterator

import structlog

from services.enforcer.kube import Obj
from services.enforcer.options import NUDGED_MAX, Key
from shared.errors import InvalidInput
from shared.normalize import normalize
from shared.quota.modes import is_managed
from shared.snapshot import QuotaSnapshot, same_content

log = structlog.get_logger("vmquota.enforcer")


class KnownQuotas:
    """``(namespace, name)`` → the newest :class:`QuotaSnapshot` known, with an index by namespace (a usage
    snapshot or a sync touches one namespace, not every quota)."""

    def __init__(self) -> None:
        self._quotas: dict[Key, QuotaSnapshot] = {}
        self._names: dict[str, dict[str, None]] = {}
        """namespace → names of its quotas in ``_quotas`` (kept by ``_keep`` and ``forget``, which alone write
        ``_quotas``)."""
        self._gone: dict[str, int] = {}
        """uid → resourceVersion of deleted quotas (an older upsert must not bring them back; a quota created again
        under the same name has another uid)."""
        self._vouched: dict[str, None] = {}
        """uids of the quotas the API server returned labelled managed (a listing, a read, a patch's answer)."""

    # ---- reading -----------------------------------------------------------------------------------------------
    def get(self, key: Key) -> QuotaSnapshot | None:
        return self._quotas.get(key)

    def __getitem__(self, key: Key) -> QuotaSnapshot:
        return self._quotas[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._quotas)

    def __len__(self) -> int:
        return len(self._quotas)

    def names(self, namespace: str) -> list[str]:
        """Names of the namespace's known quotas (a copy: the caller may forget some)."""
        return list(self._names.get(namespace, ()))

    def of(self, namespace: str) -> list[QuotaSnapshot]:
        """The namespace's known quotas."""
        return [self._quotas[(namespace, name)] for name in self._names.get(namespace, ())]

    def vouched(self, snap: QuotaSnapshot) -> bool:
        """The API server returned this quota (its uid) labelled managed."""
        return snap.uid in self._vouched

    # ---- keeping -----------------------------------------------------------------------------------------------
    def remember(self, snap: QuotaSnapshot) -> bool:
        """Keep ``snap`` (a quota event's) if it is newer than what is held and than its tombstone; True when kept."""
        key = (snap.namespace, snap.name)
        rv = snap.rv_order
        held = self._quotas.get(key)
        if held is not None and held.rv_order >= rv:
            return False
        if held is None and self._gone.get(snap.uid, -1) >= rv:
            return False
        self._keep(key, snap)
        return True

    def remember_truth(self, snap: QuotaSnapshot) -> bool:
        """Keep ``snap``, as the API server returned it (a read or a listing), whatever version is held, and vouch
        for it; True when its content differs from what was held."""
        self._vouch(snap)
        key = (snap.namespace, snap.name)
        held = self._quotas.get(key)
        if held is not None and held.rv_order > snap.rv_order:
            log.warning(
                "a quota event claimed a newer version than the API server has; the API server's is kept",
                namespace=key[0],
                quota=key[1],
                event_resource_version=held.resource_version,
                resource_version=snap.resource_version,
            )
        self._keep(key, snap)
        return held is None or not same_content(held, snap)

    def _vouch(self, snap: QuotaSnapshot) -> None:
        """``snap`` came from the API server: remember whether it is labelled managed."""
        if is_managed(snap.labels):
            self._vouched[snap.uid] = None
            if len(self._vouched) > NUDGED_MAX:
                del self._vouched[next(iter(self._vouched))]

    def from_api(self, raw: Obj, *, truth: bool = False) -> QuotaSnapshot:
        """Keep a quota the API server returned: with ``truth`` (a read, a listing) whatever version is held,
        else (a patch's answer) only when newer than what is held. The version now held."""
        snap = normalize(raw)
        if not isinstance(snap, QuotaSnapshot):
            raise InvalidInput(f"expected a ResourceQuota, got {type(snap).__name__}", "kind")
        if truth:
            self.remember_truth(snap)
        else:
            self._vouch(snap)
            self.remember(snap)
        return self._quotas.get((snap.namespace, snap.name), snap)

    def deleted(self, uid: str, rv: int) -> None:
        """A quota not held was deleted at ``rv``: an older upsert of it must not bring it back."""
        self._gone[uid] = max(rv, self._gone.get(uid, -1))

    def forget(self, key: Key, rv: int) -> QuotaSnapshot | None:
        """Drop ``key`` (gone at ``rv``, leaving its tombstone); the version that was held."""
        gone = self._quotas.pop(key, None)
        names = self._names.get(key[0])
        if names is not None:
            names.pop(key[1], None)
            if not names:
                del self._names[key[0]]
        if gone is not None:
            self.deleted(gone.uid, rv)
        return gone

    def _keep(self, key: Key, snap: QuotaSnapshot) -> None:
        self._gone.pop(snap.uid, None)
        self._quotas[key] = snap
        self._names.setdefault(key[0], {})[key[1]] = None
