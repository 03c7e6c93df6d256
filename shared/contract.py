"""The bus contract: subjects, stream definitions, message Structs and message ids. Pure: no I/O.

Every message on the bus is JSON encoded from one of the msgspec Structs below. Each carries ``schema`` (the
version of this contract), CloudEvents-style attributes (``id``, ``source``, ``type``, ``subject``, ``time``) and
the cluster it is about. Decoders allow unknown fields, so a newer producer can add fields during a rolling
upgrade; a message with a newer ``schema`` than this module knows is refused (it goes to the dead-letter subject).

Subjects (``docs/events.md`` documents every field with an example):

* ``vmquota.ev.<cluster>.<namespace>.<kind>`` — object events (:class:`Upserted`, :class:`Deleted`,
  :class:`Sync`); cluster-scoped objects (Namespace, the KubeVirt CR) use the namespace token ``_cluster``;
* ``vmquota.usage.<cluster>.<namespace>`` — the ledger's :class:`UsageSnapshot` of a namespace;
* ``vmquota.quota.<cluster>.<namespace>`` — the enforcer's :class:`Decision` on a quota;
* ``vmquota.dlq.<service>`` — :class:`DeadLetter`: what a service could not use, with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, cast

import msgspec

from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.snapshot import WIRE_SNAPSHOT, AnySnapshot, dec_hook, enc_hook, from_wire, wire_variant

SCHEMA: Final = 1
"""Version of this contract. Raised only for an incompatible change; additive fields keep it."""

PREFIX: Final = "vmquota"
CLUSTER_TOKEN: Final = "_cluster"
"""Namespace token of cluster-scoped objects in event subjects."""

# ---- kinds ------------------------------------------------------------------------------------------------------

KIND_TOKENS: Final[dict[str, str]] = {
    VMI_KIND: "vmi",
    VM_KIND: "vm",
    VMIM_KIND: "vmim",
    POD_KIND: "pod",
    QUOTA_KIND: "resourcequota",
    NAMESPACE_KIND: "namespace",
    KUBEVIRT_KIND: "kubevirt",
    EVENT_KIND: "event",
}
"""Kubernetes kind → subject token of every object kind published on the bus."""

TOKEN_KINDS: Final[dict[str, str]] = {v: k for k, v in KIND_TOKENS.items()}


# ---- event types ------------------------------------------------------------------------------------------------

UPSERTED: Final = "io.vmquota.event.upserted"
DELETED: Final = "io.vmquota.event.deleted"
SYNC: Final = "io.vmquota.event.sync"
USAGE: Final = "io.vmquota.usage"
DECISION: Final = "io.vmquota.decision"
DEAD_LETTER: Final = "io.vmquota.deadletter"

_SHORT_TYPE: Final = {UPSERTED: "upserted", DELETED: "deleted", SYNC: "sync"}

# ---- names and validation ---------------------------------------------------------------------------------------

_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_RV: Final = re.compile(r"^[0-9]{1,19}$")


def check_cluster(cluster: object) -> str:
    """A cluster id must be a DNS label (it is a subject token and part of every message id)."""
    if not isinstance(cluster, str) or not _DNS_LABEL.match(cluster):
        raise InvalidInput(
            f"cluster id {cluster!r} is not a DNS label (lower-case letters, digits and '-', 1-63 characters, "
            "starting and ending with a letter or digit)",
            "cluster",
        )
    return cluster


def check_namespace(namespace: object, where: str = "namespace") -> str:
    """A namespace name (a DNS label, so it is safe as a subject token)."""
    if not isinstance(namespace, str) or not _DNS_LABEL.match(namespace):
        raise InvalidInput(f"namespace {namespace!r} is not a DNS label", where)
    return namespace


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in KIND_TOKENS:
        raise InvalidInput(f"unknown kind {kind!r} (known: {', '.join(sorted(KIND_TOKENS))})", "kind")
    return kind


def resource_version(rv: object, where: str = "resourceVersion") -> int:
    """The resourceVersion as an integer for ordering (Kubernetes and the simulated cluster use etcd revisions)."""
    if not isinstance(rv, str) or not _RV.match(rv):
        raise InvalidInput(f"resourceVersion {rv!r} is not a decimal number", where)
    return int(rv)


def namespace_token(kind: str, namespace: str) -> str:
    """The namespace token of an object's event subject: ``_cluster`` for cluster-scoped kinds."""
    return CLUSTER_TOKEN if kind in CLUSTER_SCOPED_KINDS else namespace


def event_subject(cluster: str, kind: str, namespace: str) -> str:
    """``vmquota.ev.<cluster>.<namespace or _cluster>.<kind token>``."""
    check_cluster(cluster)
    check_kind(kind)
    token = namespace_token(kind, namespace)
    if token != CLUSTER_TOKEN:
        check_namespace(namespace)
    return f"{PREFIX}.ev.{cluster}.{token}.{KIND_TOKENS[kind]}"


def events_filter(cluster: str | None = None) -> str:
    """Subject filter of every event (of one cluster, or of all clusters)."""
    return f"{PREFIX}.ev.{check_cluster(cluster)}.>" if cluster is not None else f"{PREFIX}.ev.>"


def usage_subject(cluster: str, namespace: str) -> str:
    return f"{PREFIX}.usage.{check_cluster(cluster)}.{check_namespace(namespace)}"


def decision_subject(cluster: str, namespace: str) -> str:
    return f"{PREFIX}.quota.{check_cluster(cluster)}.{check_namespace(namespace)}"


def dlq_subject(service: str) -> str:
    if not _DNS_LABEL.match(service):
        raise InvalidInput(f"service name {service!r} is not a DNS label", "service")
    return f"{PREFIX}.dlq.{service}"


@dataclass(frozen=True, slots=True)
class EventSubject:
    cluster: str
    namespace: str
    """A namespace name, or ``_cluster``."""
    kind: str


def parse_event_subject(subject: str) -> EventSubject:
    """Split and validate ``vmquota.ev.<cluster>.<namespace>.<kind token>``."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] != "ev":
        raise InvalidInput(f"{subject!r} is not an event subject (vmquota.ev.<cluster>.<namespace>.<kind>)", "subject")
    cluster = check_cluster(parts[2])
    kind = TOKEN_KINDS.get(parts[4])
    if kind is None:
        raise InvalidInput(f"unknown kind token {parts[4]!r}", "subject")
    if parts[3] != CLUSTER_TOKEN:
        check_namespace(parts[3], "subject")
    return EventSubject(cluster, parts[3], kind)


# ---- message ids ------------------------------------------------------------------------------------------------


def msg_id(cluster: str, kind: str, uid: str, rv: str, type_: str) -> str:
    """``Nats-Msg-Id`` of an object event: ``cluster/kind/uid/resourceVersion/type`` (type: upserted, deleted,
    sync). The server drops a repeat within the stream's duplicate window, so relists and a second watcher during
    a leader hand-over do not store the same version twice."""
    return f"{cluster}/{kind}/{uid}/{rv}/{_SHORT_TYPE.get(type_, type_)}"


def sync_uid(namespace: str) -> str:
    """The ``uid`` slot of a sync marker's message id: ``ns=<namespace or _cluster>`` (never a real UID)."""
    return f"ns={namespace}"


# ---- streams ----------------------------------------------------------------------------------------------------

DAY: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """A JetStream stream this project uses (services/platform/bus.py turns it into a server config)."""

    name: str
    subjects: tuple[str, ...]
    max_age: float = 0.0
    """Seconds; 0 keeps messages forever."""
    max_msgs_per_subject: int = -1
    """1 keeps only the last message of each subject."""
    duplicate_window: float = 120.0
    """Seconds during which a repeated ``Nats-Msg-Id`` is dropped."""
    max_bytes: int = -1
    """The most the stream stores (bytes; -1: unbounded); the oldest messages go first."""
    sources: tuple[str, ...] = ()
    """Streams whose messages the server copies into this one (with their subjects): a history of a stream that
    keeps only the latest per subject, at no cost to the publisher."""


EVENTS_STREAM: Final = "VMQUOTA_EVENTS"
USAGE_STREAM: Final = "VMQUOTA_USAGE"
USAGE_HISTORY_STREAM: Final = "VMQUOTA_USAGE_HISTORY"
"""Every usage snapshot for ``--usage-history-max-age`` (sourced by the server from ``VMQUOTA_USAGE``)."""
DECISIONS_STREAM: Final = "VMQUOTA_DECISIONS"
DLQ_STREAM: Final = "VMQUOTA_DLQ"
LEDGER_BUCKET: Final = "VMQUOTA_LEDGER"
"""Key-value bucket of the ledger's checkpoints."""


MiB: Final = 2**20
GiB: Final = 2**30


@dataclass(frozen=True, slots=True)
class StreamSizes:
    """The most each stream and the checkpoint bucket store, in bytes (``--<stream>-max-bytes``). The defaults add
    up to 7.5 GiB, so that they fit the NATS component's 10Gi volume with room for JetStream's own files. When a
    stream is full its oldest messages are dropped, as when they reach the maximum age."""

    events: int = 4 * GiB
    """VMQUOTA_EVENTS: what a ledger without checkpoints, or an operator, replays."""
    usage: int = 512 * MiB
    """VMQUOTA_USAGE: the last snapshot of each namespace (a few KB each)."""
    usage_history: int = 512 * MiB
    """VMQUOTA_USAGE_HISTORY: every snapshot, for ``vmquota replay --verify`` and ``vmquota explain``."""
    decisions: int = 1 * GiB
    dlq: int = 512 * MiB
    checkpoints: int = 1 * GiB
    """The ledger's key-value bucket (one compressed checkpoint per namespace)."""

    def of(self, name: str) -> int:
        """The size of the stream (or bucket) ``name``."""
        sizes = {
            EVENTS_STREAM: self.events,
            USAGE_STREAM: self.usage,
            USAGE_HISTORY_STREAM: self.usage_history,
            DECISIONS_STREAM: self.decisions,
            DLQ_STREAM: self.dlq,
            LEDGER_BUCKET: self.checkpoints,
            f"KV_{LEDGER_BUCKET}": self.checkpoints,
        }
        if name not in sizes:
            raise KeyError(f"no size for stream {name!r}")
        return sizes[name]

    def total(self) -> int:
        return self.events + self.usage + self.usage_history + self.decisions + self.dlq + self.checkpoints


def streams(
    events_max_age: float = 30 * DAY,
    duplicate_window: float = 600.0,
    sizes: StreamSizes = StreamSizes(),
    usage_history_max_age: float = 7 * DAY,
) -> tuple[StreamSpec, ...]:
    """Every stream, with the events stream kept ``events_max_age`` seconds (operators replay it) and the usage
    history ``usage_history_max_age``, each at most its size in ``sizes``."""
    if events_max_age < 0 or duplicate_window <= 0 or usage_history_max_age < 0:
        raise InvalidInput("stream ages must be positive", "events-max-age")
    if events_max_age and duplicate_window > events_max_age:
        duplicate_window = events_max_age
    return (
        StreamSpec(
            EVENTS_STREAM,
            (f"{PREFIX}.ev.>",),
            max_age=events_max_age,
            duplicate_window=duplicate_window,
            max_bytes=sizes.events,
        ),
        StreamSpec(USAGE_STREAM, (f"{PREFIX}.usage.>",), max_msgs_per_subject=1, max_bytes=sizes.usage),
        StreamSpec(
            USAGE_HISTORY_STREAM,
            (),
            max_age=usage_history_max_age,
            max_bytes=sizes.usage_history,
            sources=(USAGE_STREAM,),
        ),
        StreamSpec(DECISIONS_STREAM, (f"{PREFIX}.quota.>",), max_age=events_max_age, max_bytes=sizes.decisions),
        StreamSpec(DLQ_STREAM, (f"{PREFIX}.dlq.>",), max_age=events_max_age, max_bytes=sizes.dlq),
    )


STREAM_OWNERS: Final[dict[str, frozenset[str]]] = {
    "watcher": frozenset({EVENTS_STREAM, DLQ_STREAM}),
    "ledger": frozenset({USAGE_STREAM, USAGE_HISTORY_STREAM, DLQ_STREAM}),
    "enforcer": frozenset({DECISIONS_STREAM, DLQ_STREAM}),
}
"""Which streams each service creates and updates at start-up (it writes them); the streams it only reads it
waits for. Every service may write its rejects to the DLQ stream."""


def streams_for(
    service: str,
    events_max_age: float = 30 * DAY,
    sizes: StreamSizes = StreamSizes(),
    usage_history_max_age: float = 7 * DAY,
) -> tuple[StreamSpec, ...]:
    """The streams ``service`` owns (all of them for an unknown service name, e.g. ``all`` or a test)."""
    owned = STREAM_OWNERS.get(service)
    every = streams(events_max_age, sizes=sizes, usage_history_max_age=usage_history_max_age)
    return tuple(s for s in every if owned is None or s.name in owned)


_DURATION: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY, "w": 7 * DAY}


def parse_duration(text: str, where: str = "duration") -> float:
    """``30d``, ``12h``, ``1h30m``, ``90s``, ``500ms`` or a plain number of seconds → seconds."""
    s = text.strip()
    try:
        value = float(s)
    except ValueError:
        pos, total = 0, 0.0
        for m in _DURATION.finditer(s):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise InvalidInput(f"{text!r} is not a duration (e.g. 30d, 12h, 1h30m, 90s)", where) from None
        return total
    if value < 0 or value != value:
        raise InvalidInput(f"{text!r} is not a duration (e.g. 30d, 12h, 1h30m, 90s)", where)
    return value


_SIZE: Final = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|K|M|G|T)?")
_UNIT_BYTES: Final = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def parse_size(text: str, where: str = "size") -> int:
    """``4Gi``, ``512Mi``, ``10G`` or a plain number of bytes (a Kubernetes quantity without fractions) → bytes,
    at least 1 MiB."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise InvalidInput(f"{text!r} is not a size (e.g. 4Gi, 512Mi, 10G)", where)
    value = int(m.group(1)) * _UNIT_BYTES.get(m.group(2) or "", 1)
    if value < MiB:
        raise InvalidInput(f"{text!r} is less than 1Mi", where)
    return value


# ---- messages ---------------------------------------------------------------------------------------------------

Snapshot = AnySnapshot
"""The compact snapshot of an object (``shared/snapshot.py``), tagged by its ``kind``."""


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


ObjectEvent = Upserted | Deleted | Sync


class QuotaTerms(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """The quota equation's terms for one managed ResourceQuota; quantities as canonical strings."""

    mode: str
    """The accounting mode (``VmiPodUsage``, ``VirtualResources``, ...)."""
    budget: dict[str, str] = {}
    """``B``: what the administrator allows."""
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


class MigrationState(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    name: str
    uid: str = ""
    vmi: str
    phase: str = ""
    state: str = ""
    """``pending`` (target reserved), ``not-tried``, ``growth-refused``, ``target-created``, ``queued`` or
    ``waiting``."""
    reason: str = ""
    reserved: dict[str, str] = {}
    growth: dict[str, str] = {}
    """Hotplug growth (target minus source), in pod terms."""
    rejected_by_quota: bool = False


class UsageBody(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """What accounting says about a namespace: the content of a :class:`UsageSnapshot`."""

    quotas: dict[str, QuotaTerms] = {}
    """Managed ResourceQuota name → its mode and U, P, S, hard."""
    vms: list[VmState] = []
    migrations: list[MigrationState] = []
    """Migrations that are not finished."""
    errors: list[str] = []
    """Problems that did not stop accounting (an invalid managed quota, an unreadable VMI)."""


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
    """What the enforcer did (or, dry-run, would do) to one quota's ``spec.hard``."""

    namespace: str
    quota: str
    mode: str
    budget: dict[str, str] = {}
    hard_before: dict[str, str] = {}
    hard_after: dict[str, str] = {}
    reason: str = ""
    usage_seq: int = 0
    """``seq`` of the usage snapshot it was computed from."""
    dry_run: bool = False


class DeadLetter(_Message, frozen=True, kw_only=True, tag=DEAD_LETTER):
    """A message a service could not use: the original, where it came from, and why."""

    service: str
    reason: str
    original_subject: str = ""
    stream: str = ""
    stream_seq: int = 0
    payload: bytes = b""
    """The original payload (base64 in JSON)."""


# ---- encoding ---------------------------------------------------------------------------------------------------

_ENCODER: Final = msgspec.json.Encoder(enc_hook=enc_hook)
_EVENT_DECODER: Final = msgspec.json.Decoder(ObjectEvent, dec_hook=dec_hook)
_WireUpserted: Final = wire_variant(Upserted, snapshot=WIRE_SNAPSHOT)
_WireDeleted: Final = wire_variant(Deleted, snapshot=WIRE_SNAPSHOT | None)
_FAST_EVENT_DECODER: Final = msgspec.json.Decoder(_WireUpserted | _WireDeleted | Sync, dec_hook=dec_hook)
_USAGE_DECODER: Final = msgspec.json.Decoder(UsageSnapshot)
_DECISION_DECODER: Final = msgspec.json.Decoder(Decision)
_DLQ_DECODER: Final = msgspec.json.Decoder(DeadLetter)


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def _check_schema(schema: int) -> None:
    if schema > SCHEMA or schema < 1:
        raise InvalidInput(f"schema version {schema} is not supported (this build reads 1..{SCHEMA})", "schema")


_KNOWN_LABELS: set[str] = set()
"""DNS labels already validated (cluster ids and namespaces repeat on every event: validate each once)."""


def _known_label(s: str) -> bool:
    if s in _KNOWN_LABELS:
        return True
    if isinstance(s, str) and _DNS_LABEL.match(s):
        if len(_KNOWN_LABELS) >= 65536:
            _KNOWN_LABELS.clear()
        _KNOWN_LABELS.add(s)
        return True
    return False


def decode_event(data: bytes) -> Upserted | Deleted | Sync:
    """Decode and validate an object event; :class:`InvalidInput` says what is wrong and where."""
    try:
        ev = decode_event_fast(data)
    except Exception:  # (malformed: the plain decoder, again, says what is wrong exactly as it always did)
        ev = decode_event_plain(data)
    if ev.schema != SCHEMA:
        _check_schema(ev.schema)
    if ev.cluster not in _KNOWN_LABELS and not _known_label(ev.cluster):  # (the set first: every event)
        check_cluster(ev.cluster)
    kind = ev.kind
    if kind not in KIND_TOKENS:
        check_kind(kind)
    rv = ev.resource_version
    if not (rv.isascii() and rv.isdigit() and len(rv) <= 19):
        resource_version(rv)
    if type(ev) is Sync:
        if kind in CLUSTER_SCOPED_KINDS:
            if ev.namespace != CLUSTER_TOKEN:
                raise InvalidInput(f"a sync of {kind} must have namespace {CLUSTER_TOKEN!r}", "namespace")
        elif not _known_label(ev.namespace):
            check_namespace(ev.namespace)
        return ev
    if TYPE_CHECKING:  # (``isinstance`` on a Struct class costs 65 ns: every event)
        assert not isinstance(ev, Sync)
    if not ev.uid:
        raise InvalidInput("empty uid", f"{_where(ev)}: uid")
    snap = ev.snapshot
    if snap is not None:
        snap_kind = type(snap).__struct_config__.tag
        if snap_kind != kind:
            raise InvalidInput(
                f"snapshot of kind {snap_kind!r} in an event of kind {kind!r}", f"{_where(ev)}: snapshot"
            )
        if snap.uid and snap.uid != ev.uid:
            raise InvalidInput(f"snapshot uid {snap.uid!r} differs from the event's", f"{_where(ev)}: snapshot.uid")
        if kind not in CLUSTER_SCOPED_KINDS and snap.namespace != ev.namespace:
            raise InvalidInput(
                f"snapshot namespace {snap.namespace!r} differs from the event's", f"{_where(ev)}: snapshot.namespace"
            )
        if ev.name and snap.name != ev.name:
            raise InvalidInput(f"snapshot name {snap.name!r} differs from the event's", f"{_where(ev)}: snapshot.name")
    if kind not in CLUSTER_SCOPED_KINDS:
        if ev.namespace not in _KNOWN_LABELS and not _known_label(ev.namespace):
            check_namespace(ev.namespace, f"{_where(ev)}: namespace")
    elif kind == NAMESPACE_KIND and not _known_label(ev.name):
        check_namespace(ev.name, f"{_where(ev)}: name")
    return ev


def decode_event_plain(data: bytes) -> ObjectEvent:
    """What :func:`decode_event` decodes, before it validates: msgspec's decoding of :data:`ObjectEvent`."""
    try:
        return _EVENT_DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise InvalidInput(f"invalid event: {e}", "event") from None
    except msgspec.DecodeError as e:
        raise InvalidInput(f"not a JSON event: {e}", "event") from None


def decode_event_fast(data: bytes) -> ObjectEvent:
    """:func:`decode_event_plain`, faster: a pod's resource lists and a VMI's spec are decoded once per distinct
    JSON text (``shared.snapshot.from_wire``). Equal results for every event the plain decoder takes; on others it
    raises, not necessarily the same error (:func:`decode_event` then decodes again with the plain decoder)."""
    w: Any = _FAST_EVENT_DECODER.decode(data)
    t = type(w)
    if t is _WireUpserted:
        return Upserted(
            schema=w.schema,
            id=w.id,
            source=w.source,
            subject=w.subject,
            time=w.time,
            cluster=w.cluster,
            kind=w.kind,
            namespace=w.namespace,
            name=w.name,
            uid=w.uid,
            resource_version=w.resource_version,
            snapshot=from_wire(w.snapshot),
        )
    if t is _WireDeleted:
        return Deleted(
            schema=w.schema,
            id=w.id,
            source=w.source,
            subject=w.subject,
            time=w.time,
            cluster=w.cluster,
            kind=w.kind,
            namespace=w.namespace,
            name=w.name,
            uid=w.uid,
            resource_version=w.resource_version,
            snapshot=from_wire(w.snapshot),
        )
    return cast(Sync, w)


def _where(ev: Upserted | Deleted) -> str:
    return f"{ev.kind} {ev.namespace + '/' if ev.namespace else ''}{ev.name or ev.uid}"


_M = TypeVar("_M", bound=_Message)


def _decode_checked(decoder: msgspec.json.Decoder[_M], data: bytes, what: str, where: str) -> _M:
    try:
        msg = decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise InvalidInput(f"invalid {what}: {e}", where) from None
    _check_schema(msg.schema)
    return msg


def decode_usage(data: bytes) -> UsageSnapshot:
    return _decode_checked(_USAGE_DECODER, data, "usage snapshot", "usage")


def decode_decision(data: bytes) -> Decision:
    return _decode_checked(_DECISION_DECODER, data, "decision", "decision")


def decode_dead_letter(data: bytes) -> DeadLetter:
    return _decode_checked(_DLQ_DECODER, data, "dead letter", "deadletter")


def now_rfc3339(now: datetime | None = None) -> str:
    t = now or datetime.now(UTC)
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        "time": time or now_rfc3339(),
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
) -> tuple[DeadLetter, dict[str, str]]:
    """A :class:`DeadLetter` for ``vmquota.dlq.<service>`` and its headers (``Vmquota-Reason``: the reason on one
    line, at most 512 characters, so an operator can filter without decoding). ``msg_id`` is the deduplication id,
    when there is one (the id is made from the time otherwise); ``subject`` defaults to ``original_subject``."""
    now = time or now_rfc3339()
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
    return letter, {"Vmquota-Reason": reason[:512].replace("\r", " ").replace("\n", " ")}


def sync_event(
    *,
    cluster: str,
    kind: str,
    namespace: str,
    rv: str,
    present: list[str],
    producer: str = "watcher",
    time: str | None = None,
) -> Sync:
    """A sync marker for ``kind`` in ``namespace`` (ignored for cluster-scoped kinds: ``_cluster``)."""
    token = namespace_token(kind, namespace)
    return Sync(
        id=msg_id(cluster, kind, sync_uid(token), rv, SYNC),
        source=source(producer, cluster),
        subject=token,
        time=time or now_rfc3339(),
        cluster=cluster,
        kind=kind,
        namespace=token,
        resource_version=rv,
        present=sorted(present),
    )
