"""The ledger's fold, pure: the latest snapshot of every object, per namespace, from the events stream.

:class:`Ledger` applies object events (``shared.contract``) in stream order. Each namespace has a
:class:`NamespaceState`: for every object (kind, uid) the newest version seen, by resourceVersion. An older version
or a repeat is ignored; a deletion leaves a tombstone with its resourceVersion, so a late older upsert cannot bring
the object back. A sync marker (after a relist) drops the objects the producer no longer lists, and prunes the
tombstones it covers (its resourceVersion then guards against resurrection instead).

Routing: namespaced objects belong to their namespace; a ``Namespace`` object to the namespace it names; the
KubeVirt CR to the cluster-wide state (key ``_cluster``), which every namespace of the cluster reads.

Checkpoints: each state carries ``seq``, the last stream sequence applied to it. An event at or below a state's
``seq`` is skipped for that state, so after loading checkpoints a reader may replay the stream from the lowest
sequence any of them needs and reach the same state as one that never stopped. :meth:`NamespaceState.checkpoint`
is deterministic: the same state gives the same bytes.

Pods created in a refusal: a pod created at or after a migration that KubeVirt was refused its target for
(``migrationRejectedByResourceQuota``), while that migration was active, or one whose charge grew meanwhile (an
in-place resize), is remembered for as long as it exists (:attr:`NamespaceState.late`, in checkpoints too), even
once that migration is gone: it may have taken the room ``hard`` held for the target, and accounting holds no room
for any migration again while such a pod keeps the namespace over its budget (``shared.accounting.migrations``). So
is one grown while room may be held for a migration target's hotplug attachment pod, which KubeVirt marks no refusal
for (:attr:`NamespaceState.attaching`). A refusal that ended (the migration deleted, or finished) is kept as a window
(:attr:`NamespaceState.windows`): the room raised for it stays in ``status.hard`` until vmquota has lowered it and
the quota controller has copied that, and the two kinds' watches are in no order with each other, so a pod created
up to :data:`REFUSAL_GRACE` after the end (the migration's ``deletionTimestamp``, which KubeVirt's finalizer gives
a deletion; a tenant may take the finalizer off and delete at once, and then the end is the time the watcher
published the deletion) is marked, whenever it is delivered; the window goes once a pod created after that arrives
(beyond :data:`WINDOWS_KEPT`, the two that end first are kept as one spanning both). A change of a managed
quota's policy (an administrator lowering the budget, say; or replacing the quota, whose creation settles what was
created before it) clears the marks: they are about the room ``hard`` held
under the old one. For the same reason the pods it finds created since the oldest active migration, or in a window,
are *settled* (:attr:`NamespaceState.settled`): their creation after a migration no longer holds it back, and they
are marked again only by growing in a refusal (a pod that took room the budget left, and then the budget lowered
below what runs, held the migration back for as long as it ran). What was created a second before the second the
change was published in (:data:`SETTLE_MARGIN`) and is folded after it — a pod, or a migration's first version, the
watches of two kinds being in no order — is settled as the change would have settled it
(:attr:`NamespaceState.settled_until`). The marks follow from the events' order alone, so a replay of the stream
makes the same.

Launcher pods KubeVirt stopped naming: a pod a VMI's ``status.activePods`` named (KubeVirt writes it, for the
pods the VMI controls) that the VMI names no more while the pod still runs — its controller reference taken off
by the tenant, or by the garbage collector when the VMI was deleted with ``propagationPolicy: Orphan`` — may go on
running the guest (virt-handler shuts a domain down gracefully, for the VMI's termination grace period). Such a
pod is remembered with the VMI as it last named it (:attr:`NamespaceState.departed`, in checkpoints too) until the
pod is gone or finished, so that accounting counts it as that VM, not as a plain pod at its (k times smaller)
charge.

What a launcher pod was made for: the vCPUs of its VMI's spec when the pod was created (:attr:`NamespaceState.
made_for`, in checkpoints too, until the pod is gone). KubeVirt renders a pod from the spec, while the status's
``currentCPUTopology``, which a VM counts at until its hotplug is admitted, is its creator's to write when it creates
the VMI: accounting counts a running VM at the vCPUs some pod of it was made for, whatever the status says, and a VM
whose spec has more vCPUs than the fewest some pod of it may have been made for as a size change to admit. The VMI is
the one the pod's launcher command names (immutable; else its owner reference at creation), its spec the one in view
when the pod is first folded; when a VMI names the pod in ``status.activePods`` before that (the watches of two kinds
are in no order), the smaller of the spec then and when the pod arrives (a spec's vCPUs only grow while the VM runs);
for a pod folded before its VMI was in view (or before this memory was kept), the spec of the first version of its VMI
that names it. So it is at least what the pod was made for, and maybe more (a hotplug asked at once, seen before the
pod): accounting counts by it, and takes a pod as made at a size only where its charge shows it too. Beside it, the
fewest vCPUs the pod may have been made for: a VMI's spec may grow before the VMI names its first pod (KubeVirt's VM
controller carries a VM's new sockets into its VMI whatever the VMI's phase), and KubeVirt may have rendered that
pod from the smaller spec; the fold keeps the smallest spec of such a VMI (:attr:`NamespaceState.grew_unnamed`)
until it names a pod, and a pod made for it then may have been made for that. Admission takes a pod as made at a
size only where that says so (a VMI created with a ``currentCPUTopology`` as large as the spec it is raised to as
its pod is made gets no growth unadmitted); counting keeps the larger.

What a pending VMI was refused last: the ``requested:`` amounts, in the resources a quota of the namespace limits, of
the latest quota refusal folded that names its uid (:attr:`NamespaceState.refused`, in checkpoints too, until the
VMI is no longer pending or is gone). It decides whether room is held for a new VM's pod, and at what size
(``shared.accounting.admission``): a refusal is evidence of the pod KubeVirt made then, and what made it larger (a
webhook's container, KubeVirt's overhead ratio) may have gone since. Kept apart from its Event, which its tenant may
delete or push out of the Events a state keeps (:data:`EVENTS_KEPT`); latest in the order folded, not by the times
an Event states, which its writer dates. A later refusal of the tenant's own decides for its own VM only: with the
reservation guard, a holder's pod is held to the room held for it.

Partitions: a namespace belongs to partition ``crc32("<cluster>/<namespace>") % total``. A ledger instance owns a
:class:`PartitionSet` and skips the namespaces of other partitions; cluster-wide objects are folded by all.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Final, cast

import msgspec

from shared import contract
from shared.contract import Deleted, Snapshot, Sync, Upserted
from shared.errors import InvalidInput
from shared.kinds import (
    EVENT_KIND,
    FINAL_PHASES,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.quantity import ZERO, Quantity
from shared.quota.modes import policy_changed, policy_or_error
from shared.resources import ResourceList, canonical_resource_list, charged_alike, parse_resource_list
from shared.snapshot import (
    WIRE_SNAPSHOT,
    EventSnapshot,
    PodSnapshot,
    QuotaSnapshot,
    VmimSnapshot,
    VmiSnapshot,
    dec_hook,
    enc_hook,
    from_wire,
    migration_awaits_attachment,
    same_content,
    target_awaits_attachment,
    wire_variant,
)
from shared.times import parse_rfc3339

CLUSTER_WIDE: Final = contract.CLUSTER_TOKEN
"""The namespace key of a cluster's cluster-wide state."""

CLUSTER_WIDE_KINDS: Final = frozenset({KUBEVIRT_KIND})
"""Kinds folded into the cluster-wide state (the others into a namespace)."""

CHECKPOINT_SCHEMA: Final = 1


# ---- partitions -------------------------------------------------------------------------------------------------


def partition_of(cluster: str, namespace: str, total: int) -> int:
    """Stable partition of a namespace: ``crc32("<cluster>/<namespace>") % total``."""
    return zlib.crc32(f"{cluster}/{namespace}".encode()) % total


@dataclass(frozen=True, slots=True)
class PartitionSet:
    """The partitions a ledger instance owns out of ``total``."""

    total: int
    owned: frozenset[int]

    @classmethod
    def all(cls, total: int) -> PartitionSet:
        return cls.parse("all", total)

    @classmethod
    def parse(cls, spec: str, total: int) -> PartitionSet:
        """``all`` (or empty), or a list of numbers and ranges: ``0-7``, ``0,3,8-11``."""
        if not isinstance(total, int) or total < 1 or total > 4096:
            raise InvalidInput(f"partition count {total!r} must be between 1 and 4096", "partitions")
        text = spec.strip()
        if text in ("", "all"):
            return cls(total, frozenset(range(total)))
        owned: set[int] = set()
        for part in text.split(","):
            lo_s, sep, hi_s = part.strip().partition("-")
            try:
                lo = int(lo_s)
                hi = int(hi_s) if sep else lo
            except ValueError:
                raise InvalidInput(
                    f"{part.strip()!r} is not a partition number or range (e.g. 0-7)", "owned-partitions"
                ) from None
            if lo > hi:
                raise InvalidInput(
                    f"partition range {part.strip()!r} runs backwards (e.g. {hi}-{lo})", "owned-partitions"
                )
            if lo < 0 or hi >= total:
                raise InvalidInput(f"partition range {part.strip()!r} is outside 0-{total - 1}", "owned-partitions")
            owned.update(range(lo, hi + 1))
        return cls(total, frozenset(owned))

    def owns(self, cluster: str, namespace: str) -> bool:
        return namespace == CLUSTER_WIDE or partition_of(cluster, namespace, self.total) in self.owned

    def token(self) -> str:
        """A name-safe token of this set: ``n16_0-7``, ``n16_0-3_9`` (consumer and checkpoint key names)."""
        ranges: list[str] = []
        nums = sorted(self.owned)
        i = 0
        while i < len(nums):
            j = i
            while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
                j += 1
            ranges.append(f"{nums[i]}-{nums[j]}" if j > i else str(nums[i]))
            i = j + 1
        return "_".join([f"n{self.total}", *ranges])


# ---- state ------------------------------------------------------------------------------------------------------


class Outcome(Enum):
    APPLIED = "applied"
    """The state changed (an object appeared, changed, was deleted, or a sync dropped some)."""
    STALE = "stale"
    """An older version or a repeat of what the state holds: ignored."""
    CHECKPOINTED = "checkpointed"
    """At or below the state's checkpointed sequence: already applied before a restart."""
    FOREIGN = "foreign"
    """A namespace of a partition this instance does not own."""
    REFRESHED = "refreshed"
    """A newer version that differs only in what accounting never reads (``shared.snapshot.same_content``): stored
    (it is the newest), but the namespace's usage cannot have changed."""
    UNTRACKED = "untracked"
    """A kind this ledger does not fold (accounting does not read it)."""


_APPLIED: Final = Outcome.APPLIED  # (a member read through its Enum class costs 60 ns: every event's outcomes)
_REFRESHED: Final = Outcome.REFRESHED


class Record(msgspec.Struct, frozen=True, gc=False):
    """The newest version of one object: a snapshot, or a tombstone (``snapshot is None``). Replaced, never
    changed (one is made for every event folded: a Struct is made in C)."""

    rv: int
    seq: int
    snapshot: Snapshot | None


UNSEEN: Final = -1
"""The resourceVersion of a record a sync made for an object it lists as present that this state holds no version
of (the events stream lost its events): a placeholder, not a tombstone: the object's version, whatever it is, is
taken when it comes (the relist that answers the loss publishes it), and a sync that no longer lists it drops it."""


class _CkRecord(msgspec.Struct, array_like=True):
    kind: str
    uid: str
    rv: int
    seq: int
    snapshot: Snapshot | None
    """Decoded as the events decoder reads snapshots (:data:`WIRE_SNAPSHOT`, then ``from_wire``): a state loaded
    from a checkpoint shares and interns as a folded one does."""


class Checkpoint(msgspec.Struct, kw_only=True, rename="camel"):
    """The serialised form of a :class:`NamespaceState` (JSON, objects sorted by kind and uid)."""

    schema: int = CHECKPOINT_SCHEMA
    cluster: str
    namespace: str
    seq: int
    usage_digest: str = ""
    answered: dict[str, int] = {}
    """:attr:`NamespaceState.answered`."""
    floors: dict[str, int] = {}
    late: list[str] = []
    """Pods created in a refusal (:attr:`NamespaceState.late`), sorted."""
    settled: list[str] = []
    """:attr:`NamespaceState.settled`, sorted."""
    settled_until: datetime | None = None
    """:attr:`NamespaceState.settled_until`."""
    windows: dict[str, tuple[datetime, datetime]] = {}
    """Refusals that ended (:attr:`NamespaceState.windows`)."""
    clock: datetime | None = None
    """:attr:`NamespaceState.clock`."""
    departed: dict[str, str] = {}
    """:attr:`NamespaceState.departed`: pod uid → VMI uid."""
    departed_vmis: dict[str, VmiSnapshot] = {}
    """The VMIs those name, once each (:attr:`NamespaceState.departed_vmis`)."""
    made_for: dict[str, tuple[str, int]] = {}
    """:attr:`NamespaceState.made_for`: pod uid → (VMI uid, vCPUs)."""
    made_fewest: dict[str, int] = {}
    """The fewest vCPUs of :attr:`NamespaceState.made_for`, for the pods where it is below the vCPUs."""
    grew_unnamed: dict[str, int] = {}
    """:attr:`NamespaceState.grew_unnamed`."""
    refused: dict[str, dict[str, str]] = {}
    """:attr:`NamespaceState.refused`, the amounts as quantities' text."""
    objects: list[_CkRecord] = []


_CK_ENCODER: Final = msgspec.json.Encoder(order="deterministic", enc_hook=enc_hook)
_CK_DECODER: Final = msgspec.json.Decoder(  # (records' snapshots read as the events decoder reads them)
    wire_variant(
        Checkpoint,
        objects=list[wire_variant(_CkRecord, snapshot=WIRE_SNAPSHOT | None)],  # type: ignore[misc]
        departed_vmis=dict[str, WIRE_SNAPSHOT],  # type: ignore[valid-type]
    ),
    dec_hook=dec_hook,
)


def _refused_since(m: Snapshot) -> datetime | None:
    """When an active migration KubeVirt was refused its target for was created (None: not such a migration)."""
    if isinstance(m, VmimSnapshot) and m.active and m.rejected_by_quota:
        return m.creation_timestamp
    return None


def _grew(before: Snapshot | None, pod: Snapshot) -> bool:
    """Whether a pod's new version is charged more of some resource than the one it replaces (an in-place
    resize: quota admission charges only the growth, and an old pod may take room that way)."""
    if not (isinstance(before, PodSnapshot) and isinstance(pod, PodSnapshot)):
        return False
    return any(q > before.usage.get(r, ZERO) for r, q in pod.usage.items())


def _hotplugged(vmi: Snapshot | None) -> bool:
    """Whether a VMI version has hotplugged volumes (KubeVirt then makes an attachment pod beside a migration's
    target)."""
    return isinstance(vmi, VmiSnapshot) and vmi.hotplug_volumes


def _attach_phase(migration: Snapshot | None) -> tuple[str, bool] | None:
    """What :meth:`NamespaceState._attachments` reads of a migration version: its VMI, and whether it is active and
    ``Pending``."""
    if not isinstance(migration, VmimSnapshot):
        return None
    return (migration.vmi_name, migration.active and migration.pending)


def _attach_facts(pod: Snapshot | None) -> tuple[str, str, str]:
    """What :meth:`NamespaceState._attachments` reads of a pod version: the migration it is labelled the target of
    (``kubevirt.io/migrationJobUID``) with its phase, and the pod it is KubeVirt's attachment pod of (one KubeVirt
    sees, with the key ``kubevirt.io``, and a controller reference to a pod); empty for any other pod."""
    if not isinstance(pod, PodSnapshot):
        return ("", "", "")
    job = pod.migration_job_uid
    return (job, pod.phase if job else "", pod.attachment_of)


def _count(counts: dict[str, int], key: str, step: int) -> int:
    """Add ``step`` to ``counts[key]`` (nothing for an empty key), dropping it at zero; the count now."""
    if not key:
        return 0
    n = counts.get(key, 0) + step
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
    return n


def _finished(pod: Snapshot) -> bool:
    """A pod that runs nothing any more (phase Succeeded or Failed)."""
    return isinstance(pod, PodSnapshot) and pod.phase in FINAL_PHASES


_UNKNOWN: Final = object()


def _kept_in_fold_order(recs: dict[str, Record], uid: str) -> None:
    """A namespace's Events, ``uid`` just folded: kept in the order folded (the dict's, ascending ``seq``: the one
    folded moves to the end) and no more than :data:`EVENTS_KEPT`, the one folded longest ago dropped (its last
    version: a repeat of KubeVirt's refusal renews it). Not by the times an Event states, which are its writer's: a
    tenant's dated ahead would outlast every refusal of KubeVirt's. Constant time: a tenant's flood costs the ledger,
    which folds every namespace in one order, no more per Event than any other. The order is a function of the
    events alone (a state restored from a checkpoint is put in it again), so a replay drops the same."""
    recs[uid] = recs.pop(uid)
    if len(recs) > EVENTS_KEPT:
        del recs[next(iter(recs))]


REFUSAL_GRACE: Final = timedelta(seconds=60)
"""How long after a refusal ended a pod created is taken as one that may have taken its room (vmquota lowers
``hard`` and the quota controller copies it within a second or so when all is well)."""

SETTLE_MARGIN: Final = timedelta(seconds=1)
"""What a change of policy settles ends this long before the second it was published in
(:attr:`NamespaceState.settled_until`): a pod created in that second, stamped to the second, may have come after the
change, and the watcher's clock may run a little ahead of the API server's."""

WINDOWS_KEPT: Final = 32
"""Windows of ended refusals a namespace keeps apart (:attr:`NamespaceState.windows`); beyond, the two that end first
are kept as one that spans both. A window goes once a pod created after its end is folded, so only a namespace that
creates no pod keeps many: a tenant refused migration after migration kept one per migration, each scanned at every
pod event and written into every checkpoint. (A pod created between two windows so kept and folded after both is
taken as created in them.)"""

EVENTS_KEPT: Final = 1024
"""The ``FailedCreate`` Events (with their tombstones) a namespace's state keeps, the latest folded: an Event is
anyone's to write, for any VMI, so a tenant could otherwise grow the ledger and its checkpoints by as many as the
API server takes in the Events' lifetime (an hour by default). Accounting reads them as evidence of what KubeVirt
was refused, each VMI's latest; a namespace whose tenant writes more loses the oldest, its own VMs' evidence only
(:func:`_kept_in_fold_order`); the deletion of one it does not hold leaves no tombstone."""

ACCOUNTED_OBJECT_KINDS: Final = frozenset({POD_KIND, VMI_KIND, VMIM_KIND, QUOTA_KIND, EVENT_KIND})
"""The namespaced kinds whose floors a deleted namespace's state raises (:meth:`NamespaceState._compact`), seen or
not."""

TOMBSTONES_KEPT: Final = 4096
"""The tombstones of one kind (Events aside, which :data:`EVENTS_KEPT` bounds) a namespace's state keeps between
two sync markers, the latest folded. A sync prunes the tombstones it covers, but a watcher relists only at its start,
on a 410 or when a ledger asks: a tenant that creates and deletes pods in a loop otherwise grew its namespace's
state, its checkpoint and the sort of its objects on every accounting without bound (50,000 deleted pods: 11 MB,
1.4 MB of checkpoint, 37 ms per accounting, on the loop that folds every namespace). A tombstone dropped takes its
guard with it, and the floor is not raised in its place: a pod listed when its namespace became managed may be
published after newer events of that namespace, and a raised floor would drop it uncounted. So a version of an
object older than its deletion, published after more than this many deletions of its kind in its namespace since
(a stale producer's in flight), brings the object back until the next sync: counted, never missed."""

ANSWERS_KEPT: Final = 1024
"""Relist tokens a cluster-wide state remembers as answered (the latest: one per loss a ledger instance noted, and a
watcher ignores a token it answered, so one forgotten before its ledger read as far would be waited for in vain)."""

RV_HORIZON: Final = 10**12
"""How far beyond a list's resourceVersion an object's version may plausibly be when the list did not return it
(etcd revisions count every write of the cluster: 10^12 is centuries of writes between a list and an event)."""


class NamespaceState:
    """One namespace's objects (or a cluster's cluster-wide objects when ``namespace == "_cluster"``)."""

    __slots__ = (
        "_live",
        "answered",
        "attach_refs",
        "attaching",
        "awaiting",
        "clock",
        "cluster",
        "departed",
        "departed_vmis",
        "floors",
        "grew_unnamed",
        "late",
        "made_for",
        "namespace",
        "objects",
        "pending_jobs",
        "refused",
        "refused_from",
        "replaced",
        "seq",
        "settled",
        "settled_until",
        "tombs",
        "usage_digest",
        "windows",
    )

    def __init__(self, cluster: str, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.seq = 0
        """The last stream sequence applied."""
        self.objects: dict[str, dict[str, Record]] = {}
        """kind → uid → newest record."""
        self.floors: dict[str, int] = {}
        """kind → resourceVersion of the last sync: an unknown object at or below it is not resurrected."""
        self.tombs: dict[str, dict[str, None]] = {}
        """kind → the uids of its tombstones in the order folded (Events aside), at most :data:`TOMBSTONES_KEPT`."""
        self.usage_digest = ""
        """Digest of the last usage snapshot published for this namespace (kept by the service)."""
        self.answered: dict[str, int] = {}
        """Of a cluster-wide state: relist token → the stream sequence of the marker of the cluster's watcher that
        answered it (:attr:`Sync.answers <shared.contract.Sync.answers>`: every object of the cluster was published
        again before it), the latest :data:`ANSWERS_KEPT`; see :meth:`Ledger.whole`."""
        self._live: dict[str, list[Snapshot]] = {}
        """kind → :meth:`live` of that kind, until the kind changes (accounting reads a namespace on every change
        of it, mostly of one kind)."""
        self.replaced: Snapshot | None = None
        """The snapshot the last applied or refreshed event replaced (None: the object was absent)."""
        self.late: set[str] = set()
        """Uids of the existing pods created in a refusal (see the module)."""
        self.settled: set[str] = set()
        """Uids of the existing pods a change of a managed quota's policy found created since a migration (see the
        module): they took nothing the new policy holds room for, and no longer count as created after it."""
        self.settled_until: datetime | None = None
        """:data:`SETTLE_MARGIN` before the second the latest change of a managed quota's policy was published in: a
        pod created by then whose creation, or a migration created by then whose first version, is folded after the
        change is settled as the change would have settled it (the watches of two kinds are in no order)."""
        self.refused_from: datetime | object | None = _UNKNOWN
        """:meth:`_refused_from`, or :data:`_UNKNOWN` since the last change of a migration."""
        self.pending_jobs: frozenset[str] | object = _UNKNOWN
        """:meth:`_pending_jobs`, or :data:`_UNKNOWN` since the last change of a migration."""
        self.attaching: set[str] = set()
        """The migrations room may be held for whose target's hotplug attachment pod (:meth:`_attachments`; derived
        from the objects, recomputed when a migration, a VMI's hotplugged volumes or what a pod says of migration
        targets and attachment pods changes): a pod that grows meanwhile is marked as in a refusal."""
        self.attach_refs: dict[str, int] = {}
        """Pod uid → how many existing pods name it as the pod they are KubeVirt's attachment pod of
        (:attr:`PodSnapshot.attachment_of`); derived from the objects, kept as pods change."""
        self.awaiting: dict[str, int] = {}
        """Migration uid → how many existing pods labelled its target run with no attachment pod yet (what
        :meth:`_attachments` asks of the pods); derived from the objects, kept as pods change."""
        self.windows: dict[str, tuple[datetime, datetime]] = {}
        """Migration uid → (its creation, its end + :data:`REFUSAL_GRACE`) for a refused migration that ended: pods
        created between the two are marked (see the module)."""
        self.clock: datetime | None = None
        """The newest creation time of the namespace's objects folded (a refusal's end is never before it)."""
        self.departed: dict[str, str] = {}
        """Pod uid → the uid of the VMI that named the pod in ``status.activePods`` and names it no more, for a pod
        that may still run (see the module)."""
        self.departed_vmis: dict[str, VmiSnapshot] = {}
        """VMI uid → the version of the VMI before the latest one that stopped naming such a pod, without its
        ``status.activePods`` (one copy per VMI, however many pods it named: a tenant's VMI may control thousands;
        its size is the VM's a hotplug aside). Entries no pod refers to any more are dropped when the state is
        checkpointed."""
        self.made_for: dict[str, tuple[str, int, int]] = {}
        """Pod uid → (the VMI's uid, the vCPUs of its spec as first seen with the pod, the fewest vCPUs the pod may
        have been made for) (see the module), while the pod exists."""
        self.grew_unnamed: dict[str, int] = {}
        """VMI uid → the fewest vCPUs of its spec, for a VMI whose spec grew while it named no pod, until it names
        one (see the module)."""
        self.refused: dict[str, ResourceList] = {}
        """VMI uid → the ``requested:`` amounts of the latest quota refusal folded that names it, for a pending VMI
        (see the module and :meth:`_refusal`)."""

    # ---- reading ----------------------------------------------------------------------------------------------
    def live(self, kind: str) -> list[Snapshot]:
        """Snapshots of the existing objects of ``kind``, ordered by uid (a list shared until the kind changes:
        read-only)."""
        found = self._live.get(kind)
        if found is not None:
            return found
        recs = self.objects.get(kind)
        if not recs:
            return []
        snaps = (recs[u].snapshot for u in sorted(recs))
        found = self._live[kind] = [s for s in snaps if s is not None]
        return found

    def live_objects(self) -> dict[str, list[Snapshot]]:
        """kind → existing snapshots (ordered by uid), for every kind with at least one."""
        out = {k: self.live(k) for k in sorted(self.objects)}
        return {k: v for k, v in out.items() if v}

    def get(self, kind: str, uid: str) -> Record | None:
        return self.objects.get(kind, {}).get(uid)

    def __len__(self) -> int:
        return sum(len(v) for v in self.objects.values())

    # ---- folding ----------------------------------------------------------------------------------------------
    def apply(self, ev: Upserted | Deleted, seq: int, *, compare: bool = True) -> Outcome:
        """Apply an upsert or a deletion found at stream sequence ``seq``. ``compare``: tell a version that changes
        nothing accounting reads (:attr:`Outcome.REFRESHED`) from others (False: report every newer version as
        :attr:`Outcome.APPLIED`, e.g. when the namespace is to be accounted anyway)."""
        if seq <= self.seq:
            return Outcome.CHECKPOINTED
        self.seq = seq
        rv = int(ev.resource_version)
        kind = ev.kind
        recs = self.objects.get(kind)
        if recs is None:
            recs = self.objects[kind] = {}
        uid = ev.uid
        rec = recs.get(uid)
        if type(ev) is Upserted:
            uid = ev.snapshot.uid or uid  # the snapshot's (interned) string: one copy for key and snapshot
            refreshed = False
            if rec is not None:
                if rv <= rec.rv:  # a repeat, an older version, or the version a deletion already covers
                    return Outcome.STALE
                if rec.snapshot is None and rec.rv != UNSEEN and rv <= self.floors.get(kind, -1):
                    # (a sync dropped it, leaving the version it held: absent at the sync's, newer than this one;
                    # an old watcher leader's publish in flight across a hand-over, which never saw the deletion)
                    return Outcome.STALE
                refreshed = compare and rec.snapshot is not None and same_content(rec.snapshot, ev.snapshot)
            elif rv <= self.floors.get(kind, -1):
                return Outcome.STALE  # absent at the last sync, which is newer: a stale producer
            self.replaced = rec.snapshot if rec is not None else None
            recs[uid] = Record(rv, seq, ev.snapshot)
            if rec is not None and rec.snapshot is None and kind in self.tombs:
                self.tombs[kind].pop(uid, None)
            self._live.pop(kind, None)
            created = ev.snapshot.creation_timestamp
            if created is not None and (self.clock is None or created > self.clock):
                self.clock = created
            if kind == VMI_KIND:
                self._grown_unnamed(self.replaced, ev.snapshot)
                self._named(self.replaced, ev.snapshot)
                self._pending(uid, ev.snapshot, self.replaced is None)
                # (a VMI made while the fold holds another of its name, a VM restarted across a relist, changes which
                # of the two a migration's VMI is too)
                if _hotplugged(self.replaced) != _hotplugged(ev.snapshot) or (self.replaced is None and self.awaiting):
                    self.attaching = self._attachments()
            elif kind == POD_KIND:
                if self.replaced is None and (rec is None or rec.rv == UNSEEN):  # (a pod's first version)
                    self._made(uid, ev.snapshot)
                    if self.settled_until is not None and created is not None and created <= self.settled_until:
                        self.settled.add(uid)  # (created before a change of policy that reached the fold first)
                if self.departed and uid in self.departed and _finished(ev.snapshot):
                    del self.departed[uid]
                if _attach_facts(self.replaced) != _attach_facts(ev.snapshot) and self._pod_attach(
                    uid, self.replaced, ev.snapshot
                ):
                    self.attaching = self._attachments()
                if self.windows or self.attaching or self._refused_from() is not None:  # (none: three tests)
                    if uid not in self.late and self._in_refusal(ev.snapshot, self.replaced, uid in self.settled):
                        self.late.add(uid)
                        refreshed = False
                    self._pods_at(created)
            elif kind == VMIM_KIND:
                if self.replaced is None and self.settled_until is not None:
                    self._settle_late(ev.snapshot)
                since = _refused_since(ev.snapshot)
                if since is not None and (self.replaced is None or _refused_since(self.replaced) is None):
                    # (refused now: the pods folded before it, the watches of two kinds being in no order)
                    self.late.update(
                        p.uid
                        for p in self._pods()
                        if p.creation_timestamp and p.creation_timestamp >= since and p.uid not in self.settled
                    )
                self._migration_changed(uid, self.replaced, ev.snapshot, ev.time)
            elif kind == EVENT_KIND:
                _kept_in_fold_order(recs, uid)
                self._refusal(ev.snapshot)
            elif kind == QUOTA_KIND and isinstance(ev.snapshot, QuotaSnapshot):
                self._quota_changed(self.replaced, ev.snapshot, ev.time)
            return _REFRESHED if refreshed else _APPLIED
        if rec is not None and (rv < rec.rv or (rv == rec.rv and rec.snapshot is None)):
            return Outcome.STALE
        if rec is None and rv <= self.floors.get(kind, -1):
            return Outcome.STALE
        if rec is None and kind == EVENT_KIND:
            # (an Event this state does not hold, dropped beyond EVENTS_KEPT or never seen: no tombstone, or the
            # expiry of a tenant's flood would fill the bound again; a late older version of it brings back only
            # what an Event's writer could write anew)
            return Outcome.STALE
        self.replaced = rec.snapshot if rec is not None else None
        recs[uid] = Record(rv, seq, None)
        self._live.pop(kind, None)
        self.late.discard(uid)
        self.settled.discard(uid)
        self._gone(kind, uid, self.replaced)
        if kind == VMIM_KIND:
            self._migration_changed(uid, self.replaced, None, ev.time)
        if kind == EVENT_KIND:
            _kept_in_fold_order(recs, uid)
        else:
            self._entomb(kind, recs, uid)
        if kind == NAMESPACE_KIND:
            self._compact(rv, ev.time)
        return Outcome.APPLIED

    def _compact(self, deleted_at: int, published: str) -> None:
        """The namespace was deleted at version ``deleted_at`` (published at ``published``): Kubernetes deletes a
        Namespace once every object in it is gone, so none of those this state holds at or below that version exists,
        whatever the state says (the watcher sends no deletion of the plain pods of a namespace that stopped being
        managed, its quota deleted first). They are dropped, tombstones too, each kind's floor raised to the
        deletion's version so that no late version brings one back, and what the state remembers of them goes with
        them. A namespace made again under the name is newer: its objects, which another kind's watch may have
        brought before this deletion, are kept. A namespace deleted used to keep all that (a sync lists only
        namespaces that exist) in memory and in its checkpoint for as long as the ledger ran."""
        for kind in [k for k in self.objects if k != NAMESPACE_KIND]:
            recs = self.objects[kind]
            tombs = self.tombs.get(kind)
            for uid in [u for u, r in recs.items() if r.rv <= deleted_at]:
                gone = recs.pop(uid).snapshot
                if tombs:
                    tombs.pop(uid, None)
                if gone is not None:
                    self.late.discard(uid)
                    self.settled.discard(uid)
                    self._gone(kind, uid, gone)
                    if kind == VMIM_KIND:
                        self._migration_changed(uid, gone, None, published)
            self._live.pop(kind, None)
            if not recs:
                del self.objects[kind]
        for kind in {*self.objects, *ACCOUNTED_OBJECT_KINDS} - {NAMESPACE_KIND}:
            self.floors[kind] = max(self.floors.get(kind, -1), deleted_at)
        self.departed_vmis = self._departed_vmis()

    def _entomb(self, kind: str, recs: dict[str, Record], uid: str) -> None:
        """``recs[uid]`` of ``kind`` just became a tombstone: the latest :data:`TOMBSTONES_KEPT` are kept, the one
        folded longest ago dropped (constant time)."""
        tombs = self.tombs.get(kind)
        if tombs is None:
            tombs = self.tombs[kind] = {}
        tombs.pop(uid, None)
        tombs[uid] = None
        if len(tombs) > TOMBSTONES_KEPT:
            oldest = next(iter(tombs))
            del tombs[oldest]
            del recs[oldest]

    def _named(self, before: Snapshot | None, now: Snapshot | None) -> None:
        """A VMI's new version ``now`` (None: deleted) replaced ``before``: the pods ``before`` named in
        ``status.activePods`` that ``now`` does not are remembered with ``before`` while they may still run; those
        ``now`` names are the VMI's again (not another VMI's: a tenant may move a pod's controller reference). The
        pods ``now`` names that have no memory of what they were made for get the spec ``now`` has."""
        named = now.vouched_pods if isinstance(now, VmiSnapshot) else {}
        pods = self.objects.get(POD_KIND) or {}
        if named:
            assert isinstance(now, VmiSnapshot)
            departed, made_for = self.departed, self.made_for
            for uid in named:
                # (named by another VMI, a pod is still remembered with the one it ran for: a tenant may move a
                # launcher pod's controller reference to a VMI of its own, which then names it)
                if departed and departed.get(uid) == now.uid:
                    del departed[uid]
                if uid not in made_for:
                    # (named before its event arrived, or folded before its VMI was in view: the spec now, which
                    # the spec the pod was made for is at most; not a pod made for another VMI)
                    rec = pods.get(uid)
                    pod = rec.snapshot if rec is not None else None
                    if not isinstance(pod, PodSnapshot) or (pod.command_vmi_uid or now.uid) == now.uid:
                        made_for[uid] = (now.uid, now.vcpus, self._fewest(now.uid, now.vcpus))
            self.grew_unnamed.pop(now.uid, None)
        if not isinstance(before, VmiSnapshot) or not before.vouched_pods:
            return
        kept = False
        for uid in before.vouched_pods:
            if uid in named:
                continue
            rec = pods.get(uid)
            pod = rec.snapshot if rec is not None else None
            if isinstance(pod, PodSnapshot) and pod.command_vmi_uid and pod.command_vmi_uid != before.uid:
                continue  # (not made for it: a VMI letting go of it does not take the pod's memory over)
            # (a pod not folded yet may still arrive: the watches of two kinds are in no order with each other; so
            # may one a sync listed whose events were lost)
            if rec is None or rec.rv == UNSEEN or (pod is not None and not _finished(pod)):
                self.departed[uid] = before.uid
                kept = True
        if kept:
            self.departed_vmis[before.uid] = msgspec.structs.replace(before, active_pods={})

    def _refusal(self, event: Snapshot) -> None:
        """An Event's version folded: a quota refusal naming a pending VMI's uid is what is remembered of that
        VMI's refusals now (:attr:`refused`), in the resources a quota of the namespace limits (a quota refuses no
        other; a tenant's Events may name any number of others; one that names none of them leaves the last)."""
        if not isinstance(event, EventSnapshot) or not event.quota_refusal or not event.involved_uid:
            return
        rec = (self.objects.get(VMI_KIND) or {}).get(event.involved_uid)
        if rec is not None and isinstance(rec.snapshot, VmiSnapshot) and not rec.snapshot.synced:
            self._remember_refusal(event.involved_uid, event.requested)

    def _remember_refusal(self, uid: str, requested: Mapping[str, Quantity]) -> None:
        limited = charged_alike(r for q in self.live(QUOTA_KIND) if isinstance(q, QuotaSnapshot) for r in q.spec_hard)
        amounts = {r: a for r, a in requested.items() if r in limited}
        if amounts:
            self.refused[uid] = amounts

    def _pending(self, uid: str, vmi: Snapshot, first: bool) -> None:
        """A VMI's version folded (``first``: the first this state holds): while it is pending its latest refusal is
        remembered (at its first version, the latest folded before it, from the Events kept, in the order folded:
        the watches of two kinds are in no order; later ones as they are folded), and forgotten once it is not (its
        pod exists: a migration's refusals are read from its Events since the migration was made)."""
        if not isinstance(vmi, VmiSnapshot) or vmi.synced:
            self.refused.pop(uid, None)
            return
        if not first:
            return
        for rec in (self.objects.get(EVENT_KIND) or {}).values():
            e = rec.snapshot
            if isinstance(e, EventSnapshot) and e.quota_refusal and e.involved_uid == uid:
                self._remember_refusal(uid, e.requested)

    def _grown_unnamed(self, before: Snapshot | None, now: Snapshot) -> None:
        """A VMI's new version ``now`` replaced ``before``: a spec that grew while the VMI named no pod is
        remembered at its smallest (:attr:`grew_unnamed`), until the VMI names a pod."""
        if (
            isinstance(before, VmiSnapshot)
            and isinstance(now, VmiSnapshot)
            and now.vcpus > before.vcpus
            and not before.vouched_pods
        ):
            self.grew_unnamed[now.uid] = min(before.vcpus, self.grew_unnamed.get(now.uid, before.vcpus))

    def _fewest(self, vmi_uid: str, vcpus: int) -> int:
        """The fewest vCPUs a pod made now for the VMI ``vmi_uid``, whose spec has ``vcpus``, may have been made for
        (:attr:`grew_unnamed`)."""
        return min(vcpus, self.grew_unnamed.get(vmi_uid, vcpus))

    def _made(self, uid: str, pod: Snapshot) -> None:
        """A pod folded for the first time: remember the vCPUs of the spec of the VMI it was made for, if in view
        (see the module)."""
        if not isinstance(pod, PodSnapshot):
            return
        vmi_uid = pod.command_vmi_uid or pod.owner_vmi_uid
        rec = (self.objects.get(VMI_KIND) or {}).get(vmi_uid) if vmi_uid else None
        vmi = rec.snapshot if rec is not None else None
        early = self.made_for.get(uid)
        if early is not None and early[0] != vmi_uid:
            del self.made_for[uid]  # (named by a VMI it was not made for)
            early = None
        if isinstance(vmi, VmiSnapshot):
            vcpus = vmi.vcpus if early is None else min(early[1], vmi.vcpus)
            fewest = min(self._fewest(vmi_uid, vcpus), early[2] if early is not None else vcpus)
            self.made_for[uid] = (vmi_uid, vcpus, fewest)

    def _gone(self, kind: str, uid: str, before: Snapshot | None) -> None:
        """An object of ``kind`` was deleted (or dropped by a sync), ``before`` its last version."""
        if kind == VMI_KIND:
            self._named(before, None)
            self.grew_unnamed.pop(uid, None)
            self.refused.pop(uid, None)
            if _hotplugged(before) or self.awaiting:  # (another VMI of its name may be the migration's now)
                self.attaching = self._attachments()
        elif kind == POD_KIND:
            self.departed.pop(uid, None)
            self.made_for.pop(uid, None)
            if any(_attach_facts(before)) and self._pod_attach(uid, before, None):
                self.attaching = self._attachments()

    def _migration_changed(self, uid: str, before: Snapshot | None, now: Snapshot | None, published: str) -> None:
        """A migration's version ``now`` (None: deleted, or dropped by a sync) replaced ``before``, in an event the
        watcher published at ``published``: what the state keeps of migrations follows (the oldest refusal, the
        window of one that ended, the attachment pods' rooms)."""
        self.refused_from = self.pending_jobs = _UNKNOWN
        self._ended(uid, before, now, published)
        if _attach_phase(before) != _attach_phase(now):
            self.attaching = self._attachments()

    def _refused_from(self) -> datetime | None:
        """The creation of the oldest active migration KubeVirt was refused its target for (None: none is); kept
        until a migration changes."""
        if self.refused_from is _UNKNOWN:
            times = [t for t in map(_refused_since, self.live(VMIM_KIND)) if t is not None]
            self.refused_from = min(times, default=None)
        return cast(datetime | None, self.refused_from)

    def _pending_jobs(self) -> frozenset[str]:
        """The uids of the active ``Pending`` migrations (those :meth:`_attachments` may hold room for); kept until a
        migration changes."""
        if self.pending_jobs is _UNKNOWN:
            self.pending_jobs = frozenset(
                m.uid for m in self.live(VMIM_KIND) if isinstance(m, VmimSnapshot) and m.active and m.pending
            )
        return cast(frozenset[str], self.pending_jobs)

    def _awaits(self, pod: Snapshot | None) -> str:
        """The migration whose target ``pod`` is labelled and that awaits an attachment pod beside it: the pod runs,
        and no existing pod is its attachment pod; else ""."""
        if not isinstance(pod, PodSnapshot) or not pod.migration_job_uid:
            return ""
        return pod.migration_job_uid if target_awaits_attachment(pod, self.attach_refs) else ""

    def _pod_attach(self, uid: str, before: Snapshot | None, now: Snapshot | None) -> bool:
        """A pod's version ``now`` (None: gone) replaced ``before``: :attr:`attach_refs` and :attr:`awaiting`
        follow, for the pod and the pods it names (or named) its attachment pod's owner; True when an active
        ``Pending`` migration's target came to await an attachment pod or stopped awaiting one (:attr:`attaching`
        then changes). A constant cost: a tenant's pods labelled the target of a migration, made or relabelled by
        the thousand while one is ``Pending``, each had the fold pass over every pod of the namespace (8,000: 8.3 s
        to fold)."""
        pods = self.objects.get(POD_KIND) or {}
        of_before, of_now = _attach_facts(before)[2], _attach_facts(now)[2]
        others = [pods[r].snapshot for r in {of_before, of_now} - {"", uid} if r in pods]
        was = [self._awaits(before), *map(self._awaits, others)]
        _count(self.attach_refs, of_before, -1)
        _count(self.attach_refs, of_now, 1)
        now_ = [self._awaits(now), *map(self._awaits, others)]
        crossed = [job for job in was if job and _count(self.awaiting, job, -1) == 0]
        crossed += [job for job in now_ if job and _count(self.awaiting, job, 1) == 1]
        return bool(crossed) and not self._pending_jobs().isdisjoint(crossed)

    def _index_attachments(self) -> None:
        """:attr:`attach_refs` and :attr:`awaiting` from the objects (a state restored from a checkpoint): each pod
        counted as if it had just come."""
        self.attach_refs, self.awaiting = {}, {}
        for uid, rec in (self.objects.get(POD_KIND) or {}).items():
            self._pod_attach(uid, None, rec.snapshot)

    def _attachments(self) -> set[str]:
        """The migrations room may be held for whose target's hotplug attachment pod, which KubeVirt marks no refusal
        for: active and ``Pending``, their VMI with hotplugged volumes, and a pod labelled their target that runs
        with no attachment pod yet (:attr:`awaiting`; ``shared.snapshot.awaits_attachment_pod``, of which this asks
        the migration's half of each migration and keeps the target's half of each pod; ``shared.accounting.
        migrations`` reserves the attachment pod of the target KubeVirt's status names)."""
        awaited = [m for m in self.live(VMIM_KIND) if isinstance(m, VmimSnapshot) and self.awaiting.get(m.uid)]
        if not awaited:
            return set()
        vmis = {v.name: v for v in self.live(VMI_KIND) if isinstance(v, VmiSnapshot)}
        return {m.uid for m in awaited if m.vmi_name in vmis and migration_awaits_attachment(m, vmis[m.vmi_name])}

    def _pods(self) -> Iterator[PodSnapshot]:
        """The existing pods, in no order (:meth:`live` sorts them, again after every change of a pod)."""
        return (r.snapshot for r in (self.objects.get(POD_KIND) or {}).values() if isinstance(r.snapshot, PodSnapshot))

    def _quota_changed(self, before: Snapshot | None, now: QuotaSnapshot, published: str) -> None:
        """A quota's version ``now`` replaced ``before`` (None: it was absent), in an event the watcher published at
        ``published``: a change of a managed quota's policy clears the marks and settles (see the module). So does a
        managed quota's creation, as an administrator replacing a quota (a delete and a create, ``kubectl replace
        --force``, a GitOps tool's) changes the policy as an edit does (the migration waited for as long as the pod
        ran, as before the edit was settled), but only for what was created before it: its creation is the API
        server's time, however late its first version is folded."""
        if isinstance(before, QuotaSnapshot):
            if not policy_changed(before, now):
                return
            self.late.clear()
            self._settle()
            stamp = parse_rfc3339(published)
        elif before is None and policy_or_error(now) is not None:
            stamp = now.creation_timestamp or parse_rfc3339(published)
        else:
            return
        if stamp is None:
            return
        # (a creation time is to the second, the API server's; a publish time the watcher's, finer: a pod stamped in
        # the second of the change, or the one before, may have come after it)
        at = stamp.replace(microsecond=0) - SETTLE_MARGIN
        if before is None:
            self._settle(at)
            self.late -= self.settled
        if self.settled_until is None or at > self.settled_until:
            self.settled_until = at

    def _settle(self, until: datetime | None = None) -> None:
        """A managed quota's policy changed: the pods created since the oldest active migration, or in the window
        of a refusal that ended (up to ``until``, when given), took room the old policy held, if any, and their
        creation holds no migration back any more (:attr:`settled`, which a later change adds to), as the marks do
        not."""
        starts = [
            m.creation_timestamp
            for m in self.live(VMIM_KIND)
            if isinstance(m, VmimSnapshot) and m.active and m.creation_timestamp is not None
        ]
        starts += [start for start, _ in self.windows.values()]
        oldest = min(starts, default=None)
        if oldest is not None:
            self._settle_between(oldest, until)

    def _settle_late(self, migration: Snapshot) -> None:
        """A migration's first version, folded after a change of policy (:attr:`settled_until`): the pods created
        between its creation and the change are settled, as the change would have settled them had the migration
        been folded before it."""
        start = migration.creation_timestamp if isinstance(migration, VmimSnapshot) else None
        until = self.settled_until
        if start is not None and until is not None and start <= until:
            self._settle_between(start, until)

    def _settle_between(self, start: datetime, until: datetime | None) -> None:
        """Settle the pods created from ``start`` on (to ``until``, when given)."""
        self.settled |= {
            p.uid
            for p in self._pods()
            if p.creation_timestamp is not None
            and start <= p.creation_timestamp
            and (until is None or p.creation_timestamp <= until)
        }

    def _in_refusal(self, pod: Snapshot, before: Snapshot | None, settled: bool = False) -> bool:
        """Whether ``pod`` (``before`` the version it replaces) was created, or grew, in a refusal (one still active in
        the view, or one that ended: :attr:`windows`), or grew while room may be held for a target's hotplug
        attachment pod (:attr:`attaching`). A ``settled`` pod (:attr:`settled`) only by growing."""
        since = self._refused_from()
        created = pod.creation_timestamp if isinstance(pod, PodSnapshot) else None
        if (
            not settled
            and created is not None
            and (
                (since is not None and since <= created)
                or any(start <= created <= until for start, until in self.windows.values())
            )
        ):
            return True
        return (since is not None or bool(self.windows) or bool(self.attaching)) and _grew(before, pod)

    def _pods_at(self, created: datetime | None) -> None:
        """A pod created at ``created`` arrived: the windows that end before it are done with (the pod watch
        delivers creations in order)."""
        if self.windows and created is not None:
            for uid in [u for u, (_, until) in self.windows.items() if until < created]:
                del self.windows[uid]

    def _ended(self, uid: str, before: Snapshot | None, now: Snapshot | None, published: str) -> None:
        """A migration's new version ``now`` (None: deleted), in an event the watcher published at ``published``: a
        refusal that was active and is no more is kept as a window, from its creation to its end and the grace.
        The end is the migration's ``deletionTimestamp``, else the event's time (a tenant may take KubeVirt's
        finalizer off its migration and delete it at once), else :attr:`clock`."""
        since = _refused_since(before) if before is not None else None
        if since is None or (now is not None and _refused_since(now) is not None):
            return
        end = (now.deletion_timestamp if isinstance(now, VmimSnapshot) else None) or parse_rfc3339(published)
        end = max(t for t in (end, self.clock, since) if t is not None)
        self.windows[uid] = (since, end + REFUSAL_GRACE)
        if len(self.windows) > WINDOWS_KEPT:  # (the two that end first, as one: a pod in either is in it)
            ends_first = sorted(self.windows.items(), key=lambda w: (w[1][1], w[0]))
            (a, (a_start, a_end)), (b, (b_start, b_end)) = ends_first[:2]
            del self.windows[a]
            self.windows[b] = (min(a_start, b_start), max(a_end, b_end))

    def apply_sync(self, ev: Sync, seq: int) -> Outcome:
        """Drop the objects of ``ev.kind`` not in ``ev.present`` and not newer than the sync, and those whose
        version is beyond any the cluster can have written since its list (:data:`RV_HORIZON`): a forged
        resourceVersion such as ``9999999999999999999`` does not keep an object the list did not return."""
        if seq <= self.seq:
            return Outcome.CHECKPOINTED
        self.seq = seq
        rv = int(ev.resource_version)
        changed = rv > self.floors.get(ev.kind, -1)
        if changed:
            self.floors[ev.kind] = rv
        recs = self.objects.get(ev.kind)
        # (only a sync no older than the floor makes or drops placeholders: an old watcher leader's, in flight across
        # a hand-over, lists what a newer one dropped, and lacks what was created after its list; a namespace sync
        # lists every namespace's uid)
        top = rv == self.floors[ev.kind]
        if top and ev.kind != EVENT_KIND and ev.kind != NAMESPACE_KIND:
            # (an object the list returned that this state holds no version of: its events were lost; below the
            # floor now, its version must still be taken when the relist publishes it again)
            unseen = [u for u in ev.present if recs is None or u not in recs]
            if unseen:
                if recs is None:
                    recs = self.objects[ev.kind] = {}
                for uid in unseen:
                    recs[uid] = Record(UNSEEN, seq, None)
                changed = True
        if recs:
            present = set(ev.present)
            dropped = [
                u
                for u, r in recs.items()
                if ((r.rv <= rv and (top or r.rv != UNSEEN)) or r.rv > rv + RV_HORIZON) and u not in present
            ]
            events = ev.kind == EVENT_KIND
            for uid in sorted(dropped):
                if uid not in recs:
                    continue  # (a tombstone the bound dropped as this sync made others)
                gone = recs[uid].snapshot
                if gone is None:
                    del recs[uid]  # a tombstone the floor now covers (or a placeholder)
                    tombs = self.tombs.get(ev.kind)
                    if tombs:
                        tombs.pop(uid, None)
                else:
                    recs[uid] = Record(recs[uid].rv, seq, None)
                    if events:  # (folded now, in the order a checkpoint restores tombstones of one relist)
                        _kept_in_fold_order(recs, uid)
                    else:
                        self._entomb(ev.kind, recs, uid)
                    self._live.pop(ev.kind, None)
                    self._gone(ev.kind, uid, gone)
                    if ev.kind == VMIM_KIND:
                        self._migration_changed(uid, gone, None, ev.time)
                self.late.discard(uid)
                self.settled.discard(uid)
                changed = True
        if ev.kind == POD_KIND and self.made_for:
            # (a pod named before it was folded, which the list does not return: gone, or named by a forgery; the
            # VMI names it again if it exists)
            live = self.objects.get(POD_KIND) or {}
            present = set(ev.present)
            for uid in [u for u in self.made_for if u not in present and u not in live]:
                del self.made_for[uid]
        if ev.kind == POD_KIND and self.departed:
            # (a pod remembered before it was folded, which a list newer than the VMI that named it does not
            # return: it is gone; a list older than that VMI's version may predate the pod)
            live = self.objects.get(POD_KIND) or {}
            present = set(ev.present)
            vmis = self.departed_vmis
            forgotten = [
                u for u, v in self.departed.items() if u not in present and u not in live and rv >= vmis[v].rv_order
            ]
            for uid in forgotten:
                del self.departed[uid]
            changed = changed or bool(forgotten)
        return Outcome.APPLIED if changed else Outcome.STALE

    def departed_pods(self) -> dict[str, VmiSnapshot]:
        """Pod uid → its VMI (:attr:`departed_vmis`), for the launcher pods KubeVirt names no more."""
        vmis = self.departed_vmis
        return {pod: vmis[vmi] for pod, vmi in self.departed.items()}

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def _departed_vmis(self) -> dict[str, VmiSnapshot]:
        """:attr:`departed_vmis`, those no pod refers to any more dropped."""
        used = set(self.departed.values())
        for uid in [u for u in self.departed_vmis if u not in used]:
            del self.departed_vmis[uid]
        return dict(sorted(self.departed_vmis.items()))

    def checkpoint(self) -> bytes:
        """Deterministic JSON of this state (which drops the :attr:`departed_vmis` no pod refers to any more)."""
        return b"".join(self.checkpoint_parts(records=1 << 62))  # (the objects in one piece: one encode)

    def checkpoint_parts(self, records: int = 128) -> Iterator[bytes]:
        """:meth:`checkpoint` in pieces of about ``records`` objects, to encode a little at a time: the state is
        captured now (its records are replaced, never changed), so folding between two pieces does not change
        what the pieces spell."""
        objects = [
            _CkRecord(kind, uid, r.rv, r.seq, r.snapshot)
            for kind in sorted(self.objects)
            for uid, r in sorted(self.objects[kind].items())
        ]
        head = _CK_ENCODER.encode(
            Checkpoint(
                cluster=self.cluster,
                namespace=self.namespace,
                seq=self.seq,
                usage_digest=self.usage_digest,
                answered=dict(sorted(self.answered.items())),
                floors=dict(sorted(self.floors.items())),
                late=sorted(self.late),
                settled=sorted(self.settled),
                settled_until=self.settled_until,
                windows=dict(sorted(self.windows.items())),
                clock=self.clock,
                departed=dict(sorted(self.departed.items())),
                departed_vmis=self._departed_vmis(),
                made_for={pod: (vmi, vcpus) for pod, (vmi, vcpus, _) in sorted(self.made_for.items())},
                made_fewest={pod: f for pod, (_, vcpus, f) in sorted(self.made_for.items()) if f < vcpus},
                grew_unnamed=dict(sorted(self.grew_unnamed.items())),
                refused={vmi: canonical_resource_list(rl) for vmi, rl in sorted(self.refused.items())},
            )
        )
        assert head.endswith(b"[]}"), "objects is the last field of a checkpoint"
        return self._parts(head[:-3], objects, max(1, records))

    @staticmethod
    def _parts(head: bytes, objects: list[_CkRecord], records: int) -> Iterator[bytes]:
        yield head + b"["
        for i in range(0, len(objects), records):
            part = _CK_ENCODER.encode(objects[i : i + records])[1:-1]  # a JSON array is its items, comma-joined
            yield part if i == 0 else b"," + part
        yield b"]}"

    @classmethod
    def from_checkpoint(cls, data: bytes) -> NamespaceState:
        try:
            ck = _CK_DECODER.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise InvalidInput(f"invalid checkpoint: {e}", "checkpoint") from None
        if ck.schema != CHECKPOINT_SCHEMA:
            raise InvalidInput(f"checkpoint schema {ck.schema} is not supported", "checkpoint")
        st = cls(ck.cluster, ck.namespace)
        st.seq = ck.seq
        st.usage_digest = ck.usage_digest
        st.answered = dict(ck.answered)
        st.floors = dict(ck.floors)
        st.late = set(ck.late)
        st.settled = set(ck.settled)
        st.settled_until = ck.settled_until
        st.windows = dict(ck.windows)
        st.clock = ck.clock
        for uid, wire in ck.departed_vmis.items():
            try:
                snap = from_wire(wire)
            except msgspec.ValidationError as e:
                raise InvalidInput(f"invalid checkpoint: {e}", "checkpoint") from None
            if not isinstance(snap, VmiSnapshot):
                raise InvalidInput(f"invalid checkpoint: departedVmis.{uid} is not a VMI", "checkpoint")
            st.departed_vmis[uid] = snap
        for pod, vmi in ck.departed.items():
            if vmi not in st.departed_vmis:
                raise InvalidInput(f"invalid checkpoint: departed.{pod} names VMI {vmi}, which it does not hold")
            st.departed[pod] = vmi
        st.made_for = {
            pod: (vmi, vcpus, min(vcpus, ck.made_fewest.get(pod, vcpus))) for pod, (vmi, vcpus) in ck.made_for.items()
        }
        st.grew_unnamed = dict(ck.grew_unnamed)
        try:
            st.refused = {vmi: parse_resource_list(amounts) for vmi, amounts in ck.refused.items()}
        except InvalidInput as e:
            raise InvalidInput(f"invalid checkpoint: refused: {e}", "checkpoint") from None
        for r in ck.objects:
            try:
                snap = from_wire(r.snapshot)  # (the parts the wire variant reads as text are decoded here)
            except msgspec.ValidationError as e:
                raise InvalidInput(f"invalid checkpoint: {e}", "checkpoint") from None
            uid = snap.uid or r.uid if snap is not None else r.uid  # (the snapshot's interned string, as folding keys)
            st.objects.setdefault(r.kind, {})[uid] = Record(r.rv, r.seq, snap)
        events = st.objects.get(EVENT_KIND)
        if events:  # (in the order folded, as folding keeps them: ``_kept_in_fold_order``)
            st.objects[EVENT_KIND] = dict(sorted(events.items(), key=lambda item: item[1].seq))
        for kind, recs in st.objects.items():  # (the tombstones in the order folded, as ``_entomb`` keeps them)
            if kind != EVENT_KIND:
                tombs = sorted((r.seq, u) for u, r in recs.items() if r.snapshot is None and r.rv != UNSEEN)
                if tombs:
                    st.tombs[kind] = dict.fromkeys(u for _, u in tombs)
        st._index_attachments()  # (derived from the objects, as folding keeps them)
        st.attaching = st._attachments()
        return st


@dataclass(frozen=True, slots=True)
class NamespaceView:
    """What accounting gets for one namespace: its live objects and its cluster's cluster-wide objects."""

    cluster: str
    namespace: str
    seq: int
    objects: dict[str, list[Snapshot]]
    """kind → snapshots (ordered by uid); the namespace's ``Namespace`` object is under ``"Namespace"``."""
    cluster_objects: dict[str, list[Snapshot]]
    """kind → snapshots of the cluster-wide objects (the KubeVirt CR)."""
    late: frozenset[str] = frozenset()
    """Uids of the pods created in a refusal (:attr:`NamespaceState.late`)."""
    settled: frozenset[str] = frozenset()
    """Uids of the pods a change of policy found created since a migration (:attr:`NamespaceState.settled`)."""
    departed: Mapping[str, VmiSnapshot] = field(default_factory=dict)
    """Launcher pods KubeVirt stopped naming that may still run (:attr:`NamespaceState.departed`)."""
    made_for: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)
    """The VMI and vCPUs each launcher pod was made for, and the fewest it may have been made for
    (:attr:`NamespaceState.made_for`)."""
    refused: Mapping[str, ResourceList] = field(default_factory=dict)
    """The amounts of the latest quota refusal of each pending VMI (:attr:`NamespaceState.refused`)."""


def checkpoint_key(cluster: str, namespace: str, instance: str) -> str:
    """Key of a state's checkpoint in the ledger's KV bucket: ``ns.<cluster>.<namespace>``, written by the one owner
    of the namespace's partition; ``cl.<cluster>.<instance>`` for the cluster-wide state, which every instance folds
    and keeps apart (``instance``: ``<partitions>.<cluster or all>``): under one shared key, an instance lagging
    behind wrote an older state over the one another's progress counted on."""
    return f"cl.{cluster}.{instance}" if namespace == CLUSTER_WIDE else f"ns.{cluster}.{namespace}"


COMPRESS_OVER: Final = 128 * 1024
"""Checkpoints larger than this are stored zlib-compressed (prefix ``z``); JSON otherwise."""


def pack_checkpoint(data: bytes) -> bytes:
    """A checkpoint as the bucket stores it."""
    # level 1: a third of level 6's time for about 1.4 times its size (checkpoints compress ~15:1 either way)
    return b"z" + zlib.compress(data, 1) if len(data) > COMPRESS_OVER else data


def unpack_checkpoint(data: bytes) -> bytes:
    """A stored checkpoint as :meth:`Ledger.load` reads it; InvalidInput when it does not decompress."""
    if data[:1] != b"z":
        return data
    try:
        return zlib.decompress(data[1:])
    except zlib.error as e:
        raise InvalidInput(f"a compressed checkpoint does not decompress: {e}") from e


CHECKPOINT_PARTS: Final = b"m"
"""Prefix of a stored checkpoint too large for one message: the manifest of its parts (:func:`split_checkpoint`)."""


def part_key(key: str, digest: str, index: int) -> str:
    """Key of part ``index`` of the checkpoint with digest ``digest`` stored under ``key``: named by content, so that
    writing a new checkpoint's parts leaves the parts the stored manifest names as they are (outside the
    ``ns.``/``cl.`` keys a load reads)."""
    return f"part.{key}.{digest[:16]}.{index}"


def part_of(key: str) -> str | None:
    """The checkpoint key a part's key (:func:`part_key`) belongs to; None for a key that is no part's."""
    if not key.startswith("part."):
        return None
    owner, *rest = key[len("part.") :].rsplit(".", 2)
    return owner if len(rest) == 2 else None


def split_checkpoint(packed: bytes, limit: int) -> tuple[bytes, list[bytes]]:
    """A packed checkpoint larger than ``limit`` bytes (the bus's largest message, less headroom) as a manifest for
    its own key and the parts to store first, under :func:`part_keys`: one namespace with tens of thousands of pods
    must not keep every checkpoint of the instance from being written. The manifest names the parts' count and the
    digest of their whole; the parts' keys carry the digest, so a write that does not finish leaves the checkpoint
    stored before it whole."""
    parts = [packed[i : i + limit] for i in range(0, len(packed), limit)]
    digest = hashlib.sha256(packed).hexdigest()
    return CHECKPOINT_PARTS + f"{len(parts)}:{digest}".encode(), parts


def read_manifest(manifest: bytes) -> tuple[int, str]:
    """The parts' count and digest a manifest names; InvalidInput for one that is not a manifest."""
    count, _, digest = manifest[len(CHECKPOINT_PARTS) :].partition(b":")
    if not manifest.startswith(CHECKPOINT_PARTS) or not count.isdigit() or int(count) < 1 or len(digest) != 64:
        raise InvalidInput("an unreadable checkpoint manifest", "checkpoint")
    return int(count), digest.decode()


def part_keys(key: str, manifest: bytes) -> list[str]:
    """The keys of the parts the manifest stored under ``key`` names."""
    count, digest = read_manifest(manifest)
    return [part_key(key, digest, i) for i in range(count)]


def join_checkpoint(manifest: bytes, parts: list[bytes]) -> bytes:
    """The packed checkpoint a manifest and its parts make; InvalidInput when they do not make the one it names."""
    count, digest = read_manifest(manifest)
    whole = b"".join(parts)
    if len(parts) != count or hashlib.sha256(whole).hexdigest() != digest:
        raise InvalidInput("a checkpoint's parts do not make the checkpoint its manifest names", "checkpoint")
    return whole


class Ledger:
    """Every state this instance folds, and which of them changed since the caller last looked."""

    def __init__(self, partitions: PartitionSet | None = None, kinds: frozenset[str] | None = None) -> None:
        self.partitions = partitions or PartitionSet.all(1)
        self.kinds = kinds
        """The kinds folded (None: all); events of other kinds are :attr:`Outcome.UNTRACKED`."""
        self.replaced: Snapshot | None = None
        """After :meth:`apply` applied an upsert or a deletion: the snapshot of the object it replaced (None: it
        was absent)."""
        self.states: dict[tuple[str, str], NamespaceState] = {}
        self.changed: set[tuple[str, str]] = set()
        """Namespaces whose live objects (or whose cluster-wide objects) changed: recompute their usage."""
        self.unsaved: set[tuple[str, str]] = set()
        """States changed since their last checkpoint."""

    def state(self, cluster: str, namespace: str) -> NamespaceState | None:
        return self.states.get((cluster, namespace))

    def cluster_state(self, cluster: str) -> NamespaceState | None:
        return self.states.get((cluster, CLUSTER_WIDE))

    def _state(self, key: tuple[str, str]) -> NamespaceState:
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = NamespaceState(*key)
            self.unsaved.add(key)  # even an empty state records the sequence it has seen
        return st

    def whole(self, cluster: str, lost: str, applied: int) -> bool:
        """Whether the states of ``cluster`` hold everything for a ledger that has read the events stream up to
        ``applied`` and whose latest loss of events it had not read is named ``lost`` ("": it never lost any): a
        marker answering that loss stands at or before ``applied``. (A cluster-wide state loaded from the checkpoint
        an earlier version shared may hold a marker another instance folded: this one's namespace states hold the
        relist only once it has read as far.)"""
        if not lost:
            return True
        cw = self.states.get((cluster, CLUSTER_WIDE))
        at = cw.answered.get(lost) if cw is not None else None
        return at is not None and at <= applied

    def clusters(self) -> list[str]:
        """The clusters this ledger holds states of, sorted."""
        return sorted({c for c, _ in self.states})

    def namespaces(self, cluster: str | None = None) -> Iterator[tuple[str, str]]:
        """Keys of the namespace states (not the cluster-wide ones), sorted."""
        for key in sorted(self.states):
            if key[1] != CLUSTER_WIDE and (cluster is None or key[0] == cluster):
                yield key

    def _mark(self, key: tuple[str, str]) -> None:
        self.unsaved.add(key)
        if key[1] == CLUSTER_WIDE:
            self.changed.update(self.namespaces(key[0]))
        else:
            self.changed.add(key)

    def view(self, cluster: str, namespace: str) -> NamespaceView:
        st = self.states.get((cluster, namespace))
        cw = self.states.get((cluster, CLUSTER_WIDE))
        return NamespaceView(
            cluster=cluster,
            namespace=namespace,
            seq=st.seq if st is not None else 0,
            objects=st.live_objects() if st is not None else {},
            cluster_objects=cw.live_objects() if cw is not None else {},
            late=frozenset(st.late) if st is not None else frozenset(),
            settled=frozenset(st.settled) if st is not None else frozenset(),
            departed=st.departed_pods() if st is not None and st.departed else {},
            made_for=st.made_for if st is not None else {},
            refused=st.refused if st is not None else {},
        )

    def apply(self, ev: Upserted | Deleted | Sync, seq: int) -> Outcome:
        """Fold one decoded event found at stream sequence ``seq``."""
        if type(ev) is Sync:
            return self._apply_sync(ev, seq)
        if TYPE_CHECKING:  # (``isinstance`` on a Struct class costs 65 ns: every event)
            assert not isinstance(ev, Sync)
        kind = ev.kind
        if self.kinds is not None and kind not in self.kinds:
            return Outcome.UNTRACKED
        if kind in CLUSTER_WIDE_KINDS:
            key = (ev.cluster, CLUSTER_WIDE)
        else:
            key = (ev.cluster, ev.name if kind == NAMESPACE_KIND else ev.namespace)
        st = self.states.get(key)
        if st is None:
            if not self.partitions.owns(*key):
                return Outcome.FOREIGN
            st = self._state(key)
        outcome = st.apply(ev, seq, compare=key not in self.changed)  # a namespace to account anyway: no need
        self.replaced, st.replaced = st.replaced, None  # (held for this call only)
        if outcome is _APPLIED:
            if key[1] == CLUSTER_WIDE:
                self._mark(key)
            else:
                self.unsaved.add(key)
                self.changed.add(key)
        elif outcome is _REFRESHED:
            self.unsaved.add(key)
        return outcome

    def _apply_sync(self, ev: Sync, seq: int) -> Outcome:
        if self.kinds is not None and ev.kind not in self.kinds:
            return Outcome.UNTRACKED
        if ev.answers and ev.kind == NAMESPACE_KIND:
            cw = self._state((ev.cluster, CLUSTER_WIDE))
            new = [t for t in ev.answers if t not in cw.answered]
            if new:
                cw.answered.update(dict.fromkeys(new, seq))
                for t in sorted(cw.answered, key=cw.answered.__getitem__)[: max(0, len(cw.answered) - ANSWERS_KEPT)]:
                    del cw.answered[t]
                self._mark((ev.cluster, CLUSTER_WIDE))  # (every namespace of the cluster is accounted again)
        if ev.kind in CLUSTER_WIDE_KINDS:
            keys: Iterable[tuple[str, str]] = [(ev.cluster, CLUSTER_WIDE)]
        elif ev.kind == NAMESPACE_KIND:
            keys = list(self.namespaces(ev.cluster))
        elif self.partitions.owns(ev.cluster, ev.namespace):
            keys = [(ev.cluster, ev.namespace)]
        else:
            return Outcome.FOREIGN
        result = Outcome.STALE
        for key in keys:
            outcome = self._state(key).apply_sync(ev, seq)
            if outcome is Outcome.APPLIED:
                self._mark(key)
                result = outcome
            elif outcome is Outcome.CHECKPOINTED and result is Outcome.STALE:
                result = outcome
        return result

    def apply_bytes(self, data: bytes, seq: int, subject: str = "") -> Outcome:
        """Decode and fold; :class:`InvalidInput` for a malformed or unknown event. ``subject``: the one it was
        published on; an event of a kind this ledger does not fold is then skipped undecoded
        (:attr:`Outcome.UNTRACKED`), and one that belongs on another subject is refused, as the ledger service
        refuses it."""
        if not subject:
            return self.apply(contract.decode_event(data), seq)
        if self.kinds is not None:
            kind = contract.subject_kind(subject)
            if kind is not None and kind not in self.kinds:
                return Outcome.UNTRACKED
        return self.apply(contract.decode_event_on(subject, data), seq)

    def load(self, data: bytes) -> NamespaceState:
        """Load a checkpoint (replacing the state it is for); objects of kinds this ledger does not fold (a
        checkpoint of an older version) are dropped."""
        st = NamespaceState.from_checkpoint(data)
        if self.kinds is not None:
            for kind in [k for k in st.objects if k not in self.kinds]:
                del st.objects[kind]
        self.states[(st.cluster, st.namespace)] = st
        return st

    def fingerprint(self) -> dict[tuple[str, str], bytes]:
        """Every state's checkpoint bytes (tests compare ledgers with it)."""
        return {k: self.states[k].checkpoint() for k in sorted(self.states)}
