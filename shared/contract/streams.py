"""The streams and the bucket on the bus: what each keeps and for how long, who keeps them and who writes which, and
the sizes and durations an operator gives them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from shared.contract.subjects import PREFIX
from shared.errors import InvalidInput
from shared.text import clipped

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
        return int(getattr(self, self.field(name)))

    @staticmethod
    def setting(field: str) -> tuple[str, str]:
        """The flag and the environment variable that set ``field``: ``--usage-history-max-bytes``,
        ``VMQUOTA_USAGE_HISTORY_MAX_BYTES``."""
        return f"--{field.replace('_', '-')}-max-bytes", f"VMQUOTA_{field.upper()}_MAX_BYTES"

    @staticmethod
    def field(name: str) -> str:
        """The field that sizes the stream (or bucket) ``name``: its flag is ``--<field>-max-bytes``."""
        fields = {
            EVENTS_STREAM: "events",
            USAGE_STREAM: "usage",
            USAGE_HISTORY_STREAM: "usage_history",
            DECISIONS_STREAM: "decisions",
            DLQ_STREAM: "dlq",
            LEDGER_BUCKET: "checkpoints",
            f"KV_{LEDGER_BUCKET}": "checkpoints",
        }
        if name not in fields:
            raise KeyError(f"no size for stream {name!r}")
        return fields[name]

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
        StreamSpec(
            DLQ_STREAM,
            (f"{PREFIX}.dlq.>",),
            max_age=events_max_age,
            max_bytes=sizes.dlq,
            max_msgs_per_subject=DLQ_PER_SUBJECT,
            # (the letter of an event has its id; a service that reads the event again, after a restart, within the
            # window of the events stream's repeats, does not store it again)
            duplicate_window=duplicate_window,
        ),
    )


DLQ_PER_SUBJECT: Final = 256
"""The most dead letters the stream keeps per subject, that is per service, cluster and namespace (the oldest go
first). A tenant writes what its namespace's letters are made of (an Event's message is free text), as often as
it likes; without this bound one namespace's flood evicted every other's letters from the whole stream."""

STREAM_KEEPER: Final = "ledger"
"""The one service that creates and updates streams (and its bucket): at its start, after a reconnect and every
``--nats-consumer-check`` it creates what is missing and puts back limits that differ from its own. The others
only wait for the streams they use. Who may create or update a stream decides everything about it — sealed
(which nothing undoes), its limits, roll-ups allowed, messages republished to another's subjects — so one
identity, the central one, may: not a watcher's or an enforcer's credential, which in the two-cluster layout every
cluster has for the events, decisions and dead-letter streams all clusters share."""

STREAM_OWNERS: Final[dict[str, frozenset[str]]] = {
    STREAM_KEEPER: frozenset({EVENTS_STREAM, USAGE_STREAM, USAGE_HISTORY_STREAM, DECISIONS_STREAM, DLQ_STREAM}),
}
"""Which streams each service creates and updates: the keeper every one."""

STREAMS_USED: Final[dict[str, frozenset[str]]] = {
    "watcher": frozenset({EVENTS_STREAM, DLQ_STREAM}),
    "ledger": frozenset({EVENTS_STREAM, USAGE_STREAM, DLQ_STREAM}),
    "enforcer": frozenset({DECISIONS_STREAM, DLQ_STREAM, USAGE_STREAM, EVENTS_STREAM}),
}
"""The streams each service publishes to or reads (every service writes its rejects to the DLQ stream): a service
that does not keep them waits for them (:meth:`services.platform.bus.Bus.wait_for_streams`) before it is ready."""


def streams_for(
    service: str,
    events_max_age: float = 30 * DAY,
    sizes: StreamSizes = StreamSizes(),
    usage_history_max_age: float = 7 * DAY,
) -> tuple[StreamSpec, ...]:
    """The streams ``service`` creates and updates (:data:`STREAM_OWNERS`; all of them for an unknown service name,
    e.g. ``all`` or a test; none for a service that only waits for them)."""
    if service in STREAMS_USED and service not in STREAM_OWNERS:
        return ()  # (it waits for them)
    owned = STREAM_OWNERS.get(service)
    every = streams(events_max_age, sizes=sizes, usage_history_max_age=usage_history_max_age)
    return tuple(s for s in every if owned is None or s.name in owned)


_DURATION: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY, "w": 7 * DAY}


MAX_DURATION: Final = 100 * 365 * DAY
"""The longest duration any flag takes: 100 years (a stream's age limit is int64 nanoseconds, 292 years)."""


def parse_duration(text: str, where: str = "duration") -> float:
    """``30d``, ``12h``, ``1h30m``, ``90s``, ``500ms`` or a plain number of seconds → seconds (at most
    :data:`MAX_DURATION`)."""
    s = text.strip()
    try:
        value = float(s)
    except ValueError:
        pos, value = 0, 0.0
        for m in _DURATION.finditer(s):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise InvalidInput(f"{text!r} is not a duration (e.g. 30d, 12h, 1h30m, 90s)", where) from None
    if value < 0 or value != value:
        raise InvalidInput(f"{text!r} is not a duration (e.g. 30d, 12h, 1h30m, 90s)", where)
    if value > MAX_DURATION:
        raise InvalidInput(f"{text!r} is longer than 100 years", where)
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


_SIZE_MAX: Final = 2**63 - 1
"""The largest ``max_bytes`` JetStream takes (an int64)."""


def parse_size(text: str, where: str = "size") -> int:
    """``4Gi``, ``512Mi``, ``10G`` or a plain number of bytes (a Kubernetes quantity without fractions) → bytes,
    at least 1 MiB and at most an int64."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise InvalidInput(f"{text!r} is not a size (e.g. 4Gi, 512Mi, 10G)", where)
    digits = m.group(1).lstrip("0") or "0"
    value = int(digits) * _UNIT_BYTES.get(m.group(2) or "", 1) if len(digits) <= 20 else _SIZE_MAX + 1
    if value < MiB:
        raise InvalidInput(f"{text!r} is less than 1Mi", where)
    if value > _SIZE_MAX:  # (refused by the server as the ledger made the stream: a stack trace, no flag named)
        raise InvalidInput(
            f"{clipped(text)!r} is more than a stream's limit holds (an int64 of bytes: 8388607Ti and a little)", where
        )
    return value
