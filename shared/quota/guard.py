"""The reservation guard: who the room a raise reserves is for, as the namespace's ``QuotaReservation`` states it.

A raise of ``spec.hard`` for a reservation (``S``: an admitted VM's launcher pod, a migration's target pod) opens
room in the namespace before the pod it is for exists, and native quota admission lets *any* pod take it. With the
optional reservation guard (``deploy/components/reservation-guard``) a ValidatingAdmissionPolicy in the API
server closes that window: while the namespace's ``QuotaReservation`` (kind below, named :data:`NAME`) lists
holders, a pod is admitted only when one of the ``creators`` (KubeVirt's virt-controller) creates it for one of the
holders (its controller ``ownerReference``: a holder VMI, or a migration target pod whose hotplug attachment pod is
reserved). The enforcer writes the holders *before* a raise that reserves
for them and removes them only once no quota's ``spec.hard`` carries their reservation any more
(``docs/accounting.md``, "The reservation guard"). A second policy keeps a holder VMI's size while it is listed.
A holder reserved at a size is listed *unconfirmed* first (``confirmed: false``: its size is kept, its pods are
not admitted yet); the enforcer then reads its VMI, and confirms it only while it still has the size its room was
reserved at (:func:`reserved_sizes`, :func:`still_sized`), so that no pod rendered at another size gets into room
``hard`` holds already.

Pure: what to write, from the ledger's usage snapshots; whether a VMI object has a reserved size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from shared.contract import UsageSnapshot
from shared.errors import InvalidInput
from shared.kinds import RESERVATION_KIND
from shared.normalize import normalize
from shared.quota.enforcement import OWN_ANNOTATIONS, same
from shared.quota.modes import is_managed
from shared.resources import parse_resource_list
from shared.snapshot import QuotaSnapshot, VmiSnapshot, size_digest

GROUP: Final = "vmquota.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "quotareservations"
DEFAULT_CREATOR: Final = "system:serviceaccount:kubevirt:kubevirt-controller"
"""Who creates launcher and migration target pods in a default KubeVirt install (virt-controller's account)."""
NAME: Final = "vmquota"
"""The one ``QuotaReservation`` per namespace (the policy binding's ``paramRef.name``)."""
ROOM_CHECKED: Final = frozenset({"cpu", "memory", "requests.cpu", "requests.memory", "limits.cpu", "limits.memory"})
"""The resources whose room a holder's pod is held to (``room``): those the policy computes a pod's charge in, as
quota admission does (its containers and restartable init containers together, or an init container at a time,
and the pod's overhead)."""


@dataclass(frozen=True, slots=True, order=True)
class Holder:
    """A VMI whose pod a reservation is for; or a migration's target pod, whose hotplug attachment pod it is for
    (KubeVirt gives that pod a controller reference to the target pod, not to the VMI)."""

    uid: str
    name: str
    reason: str
    """``launcher pod``, ``migration <name>`` or ``the attachment pod of migration <name>`` (shown to whoever is
    refused meanwhile)."""
    room: tuple[tuple[str, str], ...] = ()
    """(resource, amount) of the room reserved for the holder's pod, in the resources of :data:`ROOM_CHECKED` a
    managed quota limits: the policy admits no pod of it charged more (room is pooled in ``hard``: a pod larger than
    its own, a webhook's container sized by an annotation the tenant changed between KubeVirt's tries, would take
    the room held for other holders). Empty: not held to a size (an attachment pod, rendered by KubeVirt alone)."""

    def as_object(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uid": self.uid, "name": self.name, "reason": self.reason}
        return out | ({"room": dict(self.room)} if self.room else {})


def _reservations(usage: UsageSnapshot | None) -> list[tuple[Holder, str]]:
    """Each reservation a usage snapshot's ``hard`` carries that KubeVirt is trying to fill — an admitted VM's
    launcher pod once KubeVirt was refused it for room (``pod_refused``), a pending migration's target (reserved
    only once KubeVirt was refused it) — as its holder (uid empty when the snapshot does not say it) and the size it
    was reserved at. An admitted VM KubeVirt has not been refused yet (it may never try: a volume that does not
    exist) has no room reserved (``shared.accounting.admission``), so it holds no one out."""
    if usage is None:
        return []
    uids = {v.name: v.uid for v in usage.vms if v.uid}
    limited = {r for t in usage.quotas.values() for r in t.hard if r in ROOM_CHECKED}

    def room(reserved: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((r, q) for r, q in reserved.items() if r in limited))

    out = [
        (Holder(v.uid, v.name, "launcher pod", room(v.reserved)), v.vmi_size)
        for v in usage.vms
        if v.state == "admitted" and v.pod_refused
    ]
    out += [
        (Holder(m.vmi_uid or uids.get(m.vmi, ""), m.vmi, f"migration {m.name}", room(m.reserved)), m.vmi_size)
        for m in usage.migrations
        if m.state == "pending"
    ]
    out += [
        (Holder(m.target_pod_uid, m.vmi, f"the attachment pod of migration {m.name}"), "")
        for m in usage.migrations
        if m.state == "attachment-reserved"
    ]
    return out


def holders(usage: UsageSnapshot | None) -> frozenset[Holder]:
    """The holders of the reservations a usage snapshot's ``hard`` carries that KubeVirt is trying to fill: each
    admitted VM KubeVirt was refused its launcher pod for room, and each migration whose target is reserved
    (``pending``)."""
    return frozenset(h for h, _ in _reservations(usage) if h.uid)


@dataclass(frozen=True, slots=True, order=True)
class Sized:
    """A VMI whose pod a reservation is for (an admitted VM's launcher pod, a pending migration's target) and the
    size (``shared.snapshot.size_digest``) it was reserved at."""

    vmi: str
    uid: str
    size: str


def reserved_sizes(usage: UsageSnapshot | None) -> frozenset[Sized]:
    """The VMIs whose pods a usage snapshot reserves (admitted VMs' launcher pods, pending migrations' targets),
    with the size each was reserved at."""
    return frozenset(Sized(h.name, h.uid, size) for h, size in _reservations(usage) if size)


def still_sized(sized: Sized, obj: Mapping[str, Any] | None) -> bool:
    """Whether a VMI object (read afresh) is the one reserved for and still has the size its pod was reserved at.
    The policy keeps a holder's size from changing, but only from the moment it is listed: a hotplug between the
    ledger's view and the listing would make KubeVirt render the pod larger than the room."""
    if obj is None:
        return False
    try:
        snap = normalize(obj)
    except InvalidInput:
        return False
    if not isinstance(snap, VmiSnapshot) or (sized.uid and snap.uid != sized.uid):
        return False
    return size_digest(snap.spec, snap.annotations) == sized.size


def may_carry(quota: QuotaSnapshot) -> bool:
    """Whether a quota's limits may hold room vmquota raised: it is labelled managed, or it bears an annotation of
    the enforcer's (its label taken off, the release not written yet), or admission does not check its ``spec.hard``
    yet (a release not copied to ``status.hard``)."""
    return (
        is_managed(quota.labels)
        or any(k in quota.annotations for k in OWN_ANNOTATIONS)
        or not same(quota.spec_hard, quota.status_hard)
    )


def carried(before: frozenset[Holder], quota: QuotaSnapshot, usage: UsageSnapshot | None) -> frozenset[Holder]:
    """The holders whose reservations a quota's limits carry now: the usage snapshot's, when its ``spec.hard`` is
    what that snapshot asks of it *and* quota admission already checks against it (``status.hard``: the quota
    controller copies ``spec.hard`` there on its next sync, so a lowered ``spec.hard`` leaves the old room open
    until then); otherwise what it carried ``before`` as well. A quota vmquota does not manage carries none once
    none of the enforcer's annotations is on it (never managed, or handed back, with ``spec.hard`` set back to
    its budget) and admission checks its ``spec.hard``: it has no terms in a usage, and kept what it carried
    ``before`` for good (a namespace's quota of object counts beside the managed one kept every holder listed, and
    every other new pod of the namespace out)."""
    if not may_carry(quota):
        return frozenset()
    now = holders(usage)
    terms = usage.quotas.get(quota.name) if usage is not None else None
    if terms is None or not same(quota.spec_hard, quota.status_hard):
        return before | now
    try:
        asked = parse_resource_list(terms.hard, "hard")
    except InvalidInput:
        return before | now
    return now if same(asked, quota.spec_hard) else before | now


def _entries(obj: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The holder entries of a ``QuotaReservation`` object that have a uid (none for None or a malformed list)."""
    spec = (obj or {}).get("spec")
    items = spec.get("holders") if isinstance(spec, Mapping) else None
    if not isinstance(items, list):
        return []
    return [h for h in items if isinstance(h, Mapping) and h.get("uid")]


def listed(obj: Mapping[str, Any] | None) -> frozenset[Holder]:
    """The holders a ``QuotaReservation`` object lists."""
    return frozenset(
        Holder(str(h.get("uid", "")), str(h.get("name", "")), str(h.get("reason", "")), _room(h.get("room")))
        for h in _entries(obj)
    )


def _room(room: object) -> tuple[tuple[str, str], ...]:
    """A listed holder's ``room``, as :attr:`Holder.room` (none for a malformed one)."""
    if not isinstance(room, Mapping):
        return ()
    return tuple(sorted((str(r), str(q)) for r, q in room.items()))


def unconfirmed(obj: Mapping[str, Any] | None) -> frozenset[str]:
    """The uids of the holders a ``QuotaReservation`` object lists unconfirmed (``confirmed: false``)."""
    return frozenset(str(h["uid"]) for h in _entries(obj) if h.get("confirmed") is False)


def union(sets: Iterable[frozenset[Holder]]) -> frozenset[Holder]:
    out: set[Holder] = set()
    for s in sets:
        out |= s
    return frozenset(out)


def reservation(
    namespace: str, held: frozenset[Holder], creators: Iterable[str], waiting: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The namespace's ``QuotaReservation`` object (holders sorted, so equal content is an equal object); the
    holders whose uid is in ``waiting`` are listed unconfirmed."""
    items = [h.as_object() | ({"confirmed": False} if h.uid in waiting else {}) for h in sorted(held)]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": RESERVATION_KIND,
        "metadata": {"name": NAME, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "vmquota"}},
        "spec": {"holders": items, "creators": sorted(set(creators))},
    }
