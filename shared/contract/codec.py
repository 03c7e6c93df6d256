"""Messages to and from JSON, validated: an event that does not decode, has a newer ``schema``, names a kind, cluster
or namespace that is not valid, or whose snapshot is not of its kind raises :class:`~shared.errors.InvalidInput`
saying what is wrong and where (the consumer dead-letters it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import msgspec

from shared.bounded import Bounded
from shared.contract.messages import (
    RELIST_TOKEN,
    SCHEMA,
    DeadLetter,
    Decision,
    Deleted,
    ObjectEvent,
    RelistRequest,
    Sync,
    Upserted,
    UsageSnapshot,
    _Message,
)
from shared.contract.subjects import (
    _DNS_LABEL,
    CLUSTER_TOKEN,
    KIND_TOKENS,
    check_cluster,
    check_kind,
    check_namespace,
    decision_subject,
    event_subject_of,
    namespace_token,
    resource_version,
    usage_subject,
)
from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    NAMESPACE_KIND,
)
from shared.snapshot import SCHEMA as SNAPSHOT_SCHEMA
from shared.snapshot import WIRE_SNAPSHOT, dec_hook, enc_hook, from_wire, wire_variant

# ---- encoding ---------------------------------------------------------------------------------------------------

_ENCODER: Final = msgspec.json.Encoder(enc_hook=enc_hook)
_EVENT_DECODER: Final = msgspec.json.Decoder(ObjectEvent, dec_hook=dec_hook)
_WireUpserted: Final = wire_variant(Upserted, snapshot=WIRE_SNAPSHOT)
_WireDeleted: Final = wire_variant(Deleted, snapshot=WIRE_SNAPSHOT | None)
_FAST_EVENT_DECODER: Final = msgspec.json.Decoder(_WireUpserted | _WireDeleted | Sync, dec_hook=dec_hook)
_USAGE_DECODER: Final = msgspec.json.Decoder(UsageSnapshot)
_DECISION_DECODER: Final = msgspec.json.Decoder(Decision)
_DLQ_DECODER: Final = msgspec.json.Decoder(DeadLetter)
_RELIST_DECODER: Final = msgspec.json.Decoder(RelistRequest)


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def _check_schema(schema: int, where: str = "schema", supported: int = SCHEMA) -> None:
    if schema > supported or schema < 1:
        raise InvalidInput(f"schema version {schema} is not supported (this build reads 1..{supported})", where)


_KNOWN_LABELS: Final[Bounded[str, bool]] = Bounded(65536)
"""DNS labels already validated (cluster ids and namespaces repeat on every event: validate each once)."""


def _known_label(s: str) -> bool:
    if s in _KNOWN_LABELS:
        return True
    if isinstance(s, str) and _DNS_LABEL.match(s):
        return _KNOWN_LABELS.keep(s, True)
    return False


def decode_event(data: bytes) -> Upserted | Deleted | Sync:
    """Decode and validate an object event; :class:`InvalidInput` says what is wrong and where."""
    try:
        ev = decode_event_fast(data)
    except Exception:  # (malformed: the plain decoder, again, says what is wrong exactly as it always did)
        ev = decode_event_plain(data)
    if ev.schema != SCHEMA:
        _check_schema(ev.schema, f"{_where(ev)}: schema")
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
        if snap.schema != SNAPSHOT_SCHEMA:  # (the snapshot's layout has a version of its own)
            _check_schema(snap.schema, f"{_where(ev)}: snapshot.schema", SNAPSHOT_SCHEMA)
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
    if t is _WireUpserted or t is _WireDeleted:
        return (Upserted if t is _WireUpserted else Deleted)(
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


def _where(ev: ObjectEvent) -> str:
    """The object an event is about, as a dead letter's reason names it."""
    if type(ev) is Sync:
        return f"sync of {ev.kind} {ev.namespace}"
    assert not isinstance(ev, Sync)
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


# ---- read from the bus: the body must belong on the subject ----------------------------------------------------
# A credential may publish on its own cluster's subjects only (docs/operations.md): a body naming another cluster,
# namespace or kind than its subject is a forgery (or a bug), and every reader refuses it, the services and the
# operator's commands alike, so that `vmquota replay` folds what the ledger folds.


def check_event_subject(ev: Upserted | Deleted | Sync, subject: str) -> None:
    """:class:`InvalidInput` unless ``subject`` is the one ``ev`` belongs on."""
    token = ev.namespace if type(ev) is Sync else namespace_token(ev.kind, ev.namespace)
    _published_on(subject, event_subject_of(ev.cluster, token, ev.kind), "event")


def _published_on(subject: str, expected: str, what: str) -> None:
    if subject != expected:
        raise InvalidInput(f"published on {subject}, but the {what} belongs on {expected}", "subject")


def decode_event_on(subject: str, data: bytes) -> Upserted | Deleted | Sync:
    """:func:`decode_event` of an event read on ``subject``, refused if it belongs on another."""
    ev = decode_event(data)
    check_event_subject(ev, subject)
    return ev


def decode_usage_on(subject: str, data: bytes) -> UsageSnapshot:
    """:func:`decode_usage` of a snapshot read on ``subject``, refused if it belongs on another."""
    u = decode_usage(data)
    _published_on(subject, usage_subject(u.cluster, u.namespace), "usage snapshot")
    return u


def decode_decision_on(subject: str, data: bytes) -> Decision:
    """:func:`decode_decision` of a decision read on ``subject``, refused if it belongs on another."""
    d = decode_decision(data)
    _published_on(subject, decision_subject(d.cluster, d.namespace), "decision")
    return d


def decode_relist_request(data: bytes) -> RelistRequest:
    """A relist request, validated; :class:`InvalidInput` saying what is wrong."""
    try:
        req = _RELIST_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise InvalidInput(f"invalid relist request: {e}", "relist") from None
    if not RELIST_TOKEN.match(req.token):
        raise InvalidInput(f"relist token {req.token!r} is not 1-64 letters, digits, '.', '_' or '-'", "relist.token")
    return req
