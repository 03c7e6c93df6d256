"""The messages on the bus: one msgspec Struct per message type (object events, usage snapshots, decisions, dead
letters) with CloudEvents-style attributes, and the builders producers use."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from shared.contract.subjects import (
    DEAD_LETTER,
    DECISION,
    DELETED,
    PREFIX,
    SYNC,
    UPSERTED,
    USAGE,
    msg_id,
    namespace_token,
    sync_uid,
)
from shared.errors import InvalidInput
from shared.kinds import (
    NAMESPACE_KIND,
)
from shared.snapshot import AnySnapshot
from shared.text import printable
from shared.times import rfc3339

SCHEMA: Final = 1
"""Version of this contract. Raised only for an incompatible change; additive fields keep it."""


# ---- messages ---------------------------------------------------------------------------------------------------

Snapshot = AnySnapshot
"""The compact snapshot of an object (``shared/snapshot/``), tagged by its ``kind``."""


class _Message(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="type"):
    schema: int = SCHEMA
    id: str
    """Unique id; for object events the message id (``cluster/kind/uid/resourceVersion/type``)."""
    source: str
    """Who produced it: ``vmquota/<service>/<cluster>``."""
    subject: str
    """What it is about: ``<namespace>/<name>`` of the object (``<name>`` when cluster-scoped)."""
    time: str
    """RFC 3339 UTC time of publication."""
    cluster: str


class _ObjectEvent(_Message, frozen=True, kw_only=True):
    kind: str
    namespace: str = ""
    """The object's namespace; empty for cluster-scoped objects."""
    name: str = ""
    uid: str
    resource_version: str


class Upserted(_ObjectEvent, frozen=True, kw_only=True, tag=UPSERTED):
    """The object exists at this resourceVersion; ``snapshot`` is its full compact state (never a diff)."""

    snapshot: Snapshot


class Deleted(_ObjectEvent, frozen=True, kw_only=True, tag=DELETED):
    """The object is gone; ``resourceVersion`` is the deletion's (or, after a relist, the last one seen)."""

    snapshot: Snapshot | None = None
    """The last known state, when the producer has it."""


class Sync(_Message, frozen=True, kw_only=True, tag=SYNC):
    """After a (re)list: the objects of ``kind`` in ``namespace`` (``_cluster`` for cluster-scoped kinds) of this
    cluster are exactly ``present`` as of ``resourceVersion``. A consumer drops every object it holds of that kind
    and namespace whose uid is not in ``present`` and whose resourceVersion is not newer than the sync's."""

    kind: str
    namespace: str
    resource_version: str
    present: list[str]
    """UIDs of the objects that exist."""
    answers: list[str] = []
    """Only on the marker that ends a relist a consumer asked for because the events stream lost events of this
    cluster before it read them (:class:`RelistRequest`): the tokens of the requests the watcher had received when
    that relist began. Every object of every kind the watcher follows was published again before this marker,
    whatever had been published before, so a consumer that lost events holds the cluster's whole state again once
    it has read a marker answering its token. Such a marker is a sync of the cluster's namespaces (kind
    ``Namespace``), the relist's last message."""


ObjectEvent = Upserted | Deleted | Sync


class QuotaTerms(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The quota equation's terms for one managed ResourceQuota; quantities as canonical strings."""

    mode: str
    """The accounting mode (``VmiPodUsage``, ``VirtualResources``, ...)."""
    budget: dict[str, str] = {}
    """``B``: what the administrator allows."""
    cpu_allocation_ratio: str = ""
    """The quota's own CPU allocation ratio the terms were accounted with (``vmquota.io/cpu-allocation-ratio``, as a
    fraction ``"4"``, ``"5/2"``); empty when it has none (KubeVirt's applies). The enforcer acts on terms only for
    the mode, budget and ratio the quota has now."""
    used: dict[str, str] = {}
    """``U``: each admitted VM once in the mode's terms, plus every non-VM pod at its pod usage."""
    pods: dict[str, str] = {}
    """``P``: what Kubernetes charges for the namespace's pods (terminal ones only ``count/pods``)."""
    reserved: dict[str, str] = {}
    """``S``: admitted pods that do not exist yet (new VMs' launcher pods, migration targets KubeVirt was refused)."""
    overlap: dict[str, str] = {}
    """``D``: what VMs' pods are charged beyond the one launcher pod per VM ``hard`` holds room for (the larger of
    its pods, at most as vmquota renders it)."""
    unvouched: dict[str, str] = {}
    """``X``: the part of ``D`` that is no active migration's target pod; it counts as used when VMs are admitted."""
    taken: dict[str, str] = {}
    """``W``: what the namespace takes of the budget in pod terms: each plain pod its charge, each running VM the
    larger of its launcher pod's charge and ``k`` times what it counts, each admitted VM (or hotplug growth) not
    running yet ``k`` times what it counts. ``hard = P + S + k * B - W - D``."""
    hard: dict[str, str] = {}
    """``spec.hard`` the equation gives."""
    over_budget: list[str] = []
    """Resources where ``U + X/k > B``."""
    vmi_minimums: dict[str, str] = {}
    """What a VMI's explicit ``requests.memory`` / ``limits.memory`` must be per byte of guest memory, and its
    ``requests.cpu`` / ``limits.cpu`` per vCPU, in the VM-term modes (``shared.quota.modes.vmi_minimums``): the
    enforcer puts them on the quota for the reservation guard's rendering-model policy."""


class VmState(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    uid: str = ""
    phase: str = ""
    state: str
    """``running``, ``admitted`` (pending, its pod reserved), ``refused`` (does not fit) or ``stopped``."""
    reason: str = ""
    counts: dict[str, dict[str, str]] = {}
    """Per quota: what the VM adds to ``U``."""
    reserved: dict[str, str] = {}
    """The launcher pod reservation (admitted VMs)."""
    refused_by: dict[str, list[str]] = {}
    """Per quota: the resources the VM does not fit."""
    pod_refused: bool = False
    """Admitted, and KubeVirt's last try to create its launcher pod was refused: the enforcer nudges the VMI."""
    vmi_size: str = ""
    """Admitted: the size digest of the VMI its launcher pod was reserved from (``shared.snapshot.size_digest``);
    with the reservation guard the enforcer opens the room only while the VMI still has it."""


class MigrationState(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    uid: str = ""
    vmi: str
    phase: str = ""
    state: str = ""
    """``pending`` (target reserved), ``not-tried``, ``growth-refused``, ``target-created``, ``cancel`` (the target
    exists, and the migration's end would carry out a size change never admitted: the enforcer deletes it),
    ``attachment-reserved`` (the target exists; its hotplug attachment pod is reserved), ``queued`` or
    ``waiting``."""
    reason: str = ""
    reserved: dict[str, str] = {}
    growth: dict[str, str] = {}
    """Hotplug growth (target minus source), in pod terms."""
    rejected_by_quota: bool = False
    vmi_size: str = ""
    """``pending``: the size digest of the VMI spec the target was reserved from (``shared.snapshot.size_digest``);
    with the reservation guard the enforcer opens the room only while the VMI still has it."""
    vmi_uid: str = ""
    """``pending``: the VMI's uid, the reservation guard's holder (also when a snapshot leaves out its VM states)."""
    target_pod_uid: str = ""
    """``attachment-reserved``: the target pod's uid, the reservation guard's holder for the attachment pod (whose
    controller reference names it)."""


MAX_ERRORS: Final = 50
"""Lines of ``errors`` a usage snapshot carries (the last counts the rest, :func:`capped_errors`): what the tenant's
objects say goes into them (a refusal Event naming many resources), and a snapshot too large for the bus would
leave the namespace's quotas where they are, migrations waiting."""
MAX_ERROR_CHARS: Final = 1000
"""Characters of one line of ``errors`` (cut beyond, with an ellipsis)."""
_MORE_ERRORS: Final = re.compile(r"and (\d+) more lines like these")


def capped_errors(errors: list[str]) -> list[str]:
    """``errors`` within :data:`MAX_ERRORS` lines of :data:`MAX_ERROR_CHARS` characters (the list itself when it
    is)."""
    if len(errors) <= MAX_ERRORS and all(len(e) <= MAX_ERROR_CHARS for e in errors):
        return errors
    out = [e if len(e) <= MAX_ERROR_CHARS else e[: MAX_ERROR_CHARS - 1] + "…" for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        out[-1] = f"and {len(errors) - MAX_ERRORS + 1} more lines like these"
    return out


def error_count(errors: list[str]) -> int:
    """How many problems ``errors`` (as :func:`capped_errors` leaves them) stands for."""
    if len(errors) == MAX_ERRORS and (m := _MORE_ERRORS.fullmatch(errors[-1])) is not None:
        return MAX_ERRORS - 1 + int(m.group(1))
    return len(errors)


class UsageBody(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What accounting says about a namespace: the content of a :class:`UsageSnapshot`."""

    quotas: dict[str, QuotaTerms] = {}
    """Managed ResourceQuota name → its mode and U, P, S, hard."""
    vms: list[VmState] = []
    migrations: list[MigrationState] = []
    """Migrations that are not finished."""
    errors: list[str] = []
    """Problems that did not stop accounting (an invalid managed quota, an unreadable VMI); in a published snapshot
    at most :data:`MAX_ERRORS` lines (:func:`capped_errors`, :func:`error_count`)."""


class UsageSnapshot(_Message, frozen=True, kw_only=True, tag=USAGE):
    """The ledger's view of one namespace after applying the events stream up to ``seq``."""

    namespace: str
    seq: int
    """The events stream sequence of the last event applied to this namespace."""
    quotas: dict[str, QuotaTerms] = {}
    vms: list[VmState] = []
    migrations: list[MigrationState] = []
    errors: list[str] = []


class Decision(_Message, frozen=True, kw_only=True, tag=DECISION):
    """What the enforcer did (or, dry-run, would do) to one quota's ``spec.hard`` (and ``status.hard``)."""

    namespace: str
    quota: str
    mode: str
    budget: dict[str, str] = {}
    hard_before: dict[str, str] = {}
    hard_after: dict[str, str] = {}
    reason: str = ""
    usage_seq: int = 0
    """``seq`` of the usage snapshot it was computed from."""
    charged: dict[str, str] = {}
    """The quota's ``status.used`` as the API server returned it when ``hard`` was planned, in the resources of
    ``hard_after``: ``hard`` holds no room for pods the usage counts beyond it (empty: planned without a read)."""
    dry_run: bool = False
    status_only: bool = False
    """Only ``status.hard`` was written, which quota admission checks: the write of ``spec.hard`` after it met a newer
    version of the quota, and the quota was planned again from that (``hard_before`` is then the ``status.hard``
    written over). The decision records a ``hard`` that was in effect, whatever the next one writes."""


class DeadLetter(_Message, frozen=True, kw_only=True, tag=DEAD_LETTER):
    """A message a service could not use: the original, where it came from, and why."""

    service: str
    reason: str
    original_subject: str = ""
    stream: str = ""
    stream_seq: int = 0
    payload: bytes = b""
    """The original payload (base64 in JSON)."""


def source(service: str, cluster: str) -> str:
    return f"{PREFIX}/{service}/{cluster}"


def object_event(
    type_: Literal["upserted", "deleted"],
    *,
    cluster: str,
    kind: str,
    namespace: str,
    name: str,
    uid: str,
    rv: str,
    snapshot: Snapshot | None,
    producer: str = "watcher",
    time: str | None = None,
) -> Upserted | Deleted:
    """Build an object event with its id, source, subject and time filled in (for producers and tests)."""
    full = UPSERTED if type_ == "upserted" else DELETED
    common: dict[str, Any] = {
        "id": msg_id(cluster, kind, uid, rv, full),
        "source": source(producer, cluster),
        "subject": f"{namespace}/{name}" if namespace else name,
        "time": time or rfc3339(),
        "cluster": cluster,
        "kind": kind,
        "namespace": "" if kind == NAMESPACE_KIND else namespace,
        "name": name,
        "uid": uid,
        "resource_version": rv,
    }
    if type_ == "upserted":
        if snapshot is None:
            raise InvalidInput("an upserted event needs a snapshot", f"{kind} {name}")
        return Upserted(snapshot=snapshot, **common)
    return Deleted(snapshot=snapshot, **common)


MAX_REASON: Final = 2048
"""Most characters of a dead letter's reason: a reason may quote the input it could not read, which is a tenant's
(an Event's message of a megabyte), and a letter larger than the bus takes stopped the publisher that sent it."""


def short_reason(reason: str) -> str:
    """``reason``, cut to :data:`MAX_REASON` characters with a note of how many more there were."""
    if len(reason) <= MAX_REASON:
        return reason
    return f"{reason[:MAX_REASON]}... ({len(reason) - MAX_REASON} more characters)"


MAX_DLQ_PAYLOAD: Final = 32 * 1024
"""The most of the refused message (or object) a dead letter carries: the start of it is what tells what went wrong.
A letter carries its payload in base64, a third larger: a whole message near the server's ``max_payload`` made a
letter the server refused, and the service that could not publish it stopped at the same message at every start.
With :data:`shared.contract.streams.DLQ_PER_SUBJECT` it bounds what one subject takes of the dead-letter stream."""


def dead_letter(
    service: str,
    reason: str,
    *,
    cluster: str = "",
    subject: str = "",
    original_subject: str = "",
    stream: str = "",
    stream_seq: int = 0,
    payload: bytes = b"",
    msg_id: str | None = None,
    time: str | None = None,
    limit: int = MAX_DLQ_PAYLOAD,
) -> tuple[DeadLetter, dict[str, str]]:
    """A :class:`DeadLetter` and its headers (``Vmquota-Reason``: the reason on one line, at most 512 characters,
    every character a terminal would act on escaped (a NATS client prints headers as they are), so an operator
    can filter without decoding); the reason at most
    :data:`MAX_REASON` characters (:func:`short_reason`). ``msg_id`` is the deduplication id,
    when there is one (the id is made from the time otherwise); ``subject`` defaults to ``original_subject``. The
    payload is cut to its first ``limit`` bytes (at most :data:`MAX_DLQ_PAYLOAD`), which the reason then says."""
    now = time or rfc3339()
    limit = max(0, min(limit, MAX_DLQ_PAYLOAD))
    if len(payload) > limit:  # (said first: a reason may be cut)
        reason = f"payload of {len(payload)} bytes, truncated to its first {limit}: {reason}"
        payload = payload[:limit]
    reason = short_reason(reason)
    letter = DeadLetter(
        id=msg_id or f"dlq/{service}/{cluster or '-'}/{now}",
        source=source(service, cluster or "-"),
        subject=subject or original_subject,
        time=now,
        cluster=cluster,
        service=service,
        reason=reason,
        original_subject=original_subject,
        stream=stream,
        stream_seq=stream_seq,
        payload=payload,
    )
    return letter, {"Vmquota-Reason": printable(reason)[:512]}


def sync_event(
    *,
    cluster: str,
    kind: str,
    namespace: str,
    rv: str,
    present: list[str],
    producer: str = "watcher",
    time: str | None = None,
    answers: Sequence[str] = (),
) -> Sync:
    """A sync marker for ``kind`` in ``namespace`` (ignored for cluster-scoped kinds: ``_cluster``); ``answers``: see
    :attr:`Sync.answers`."""
    token = namespace_token(kind, namespace)
    return Sync(
        id=msg_id(cluster, kind, sync_uid(token), rv, SYNC) + (f"/answers-{answers_key(answers)}" if answers else ""),
        source=source(producer, cluster),
        subject=token,
        time=time or rfc3339(),
        cluster=cluster,
        kind=kind,
        namespace=token,
        resource_version=rv,
        present=sorted(present),
        answers=sorted(set(answers)),
    )


def answers_key(tokens: Sequence[str]) -> str:
    """A short name of a set of relist tokens (message ids of the relist that answers them)."""
    return hashlib.sha256("\n".join(sorted(set(tokens))).encode()).hexdigest()[:16]


class RelistRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer's request (core NATS, on :func:`~shared.contract.subjects.relist_subject`) that a cluster's watcher
    publish every object again, then a marker that answers it (:attr:`Sync.answers`): the events stream lost events
    the consumer had not read (its retention dropped them, or the stream was created anew). Only the ledger may
    publish it; a watcher that receives one relists at most once at a time, and not again for a token it answered."""

    token: str
    """Names the loss (a new one for each: a relist that began before a loss does not answer it)."""
    requester: str = ""
    """Who asks (``vmquota/<service>/<cluster or all>``), for the watcher's log."""


RELIST_TOKEN: Final = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
"""What a relist token may be."""
