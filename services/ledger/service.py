"""The ledger service: fold the events stream into per-namespace state, publish usage, checkpoint.

Loop: fetch a batch of events in stream order (``services.platform.consumer.PullConsumer``), fold each into
``shared.ledger.fold.Ledger`` (a malformed or unknown event goes to ``vmquota.dlq.ledger`` and is skipped), then

* for each changed namespace, at most every ``debounce`` seconds per namespace (at once after a quiet spell of that
  namespace; sooner for changes that end a reservation; at once, before any other namespace, for changes a migration
  or a new VM waits for: ``shared.accounting.Urgent``), run accounting and publish a
  :class:`shared.contract.UsageSnapshot` on ``vmquota.usage.<cluster>.<namespace>`` if its content differs from the last
  one published (the digest is kept in the namespace's checkpoint);
* every ``checkpoint_interval`` seconds, write each changed state to the KV bucket (key
  ``ns.<cluster>.<namespace>``, or ``cl.<cluster>.<partitions>.<cluster filter>`` for this instance's own copy of
  the cluster-wide state every instance folds), then this instance's progress (``progress.<partitions>.<cluster
  filter>``): the stream sequence up to which every state it owns is checkpointed.

On start it loads the checkpoints of the namespaces it owns and replays the stream from progress + 1 (from the
start of the stream when it has no progress, e.g. with a new partition layout); a state skips the events at or
below its own checkpointed sequence. Whatever the crash point, the states and the last usage published per
namespace end up the same. Until it has folded what the stream held at its start (``replay_to``), it publishes no
usage and writes no checkpoint: each state on the way is older than one published before the crash, which the
enforcer would take as current (a migration's raise that had ended, back for a moment).

Lost events. The events stream keeps what its limits allow (``--events-max-age``, its size), and anyone who can
make objects can fill it: a ledger that is down for long, or replays from the start after losing its checkpoints,
may find that the stream dropped events it had not read, or that it was created anew (``PullConsumer.take_loss``).
Folding what is left would publish usage without the objects whose events are gone, a ``hard`` too high. Instead
the ledger names the loss with a new token (key ``lost.<partitions>.<cluster filter>``, written at once), publishes
no usage of a cluster until it has read a relist of it answering that token (``Ledger.whole``: the cluster's
watcher publishes every object again, then a ``Sync`` whose ``answers`` name the token), and asks each such
cluster's watcher for one on ``vmquota.relist.<cluster>``, again every few seconds (``relist_retry``) until it
comes. A stream created anew also discards every state and checkpoint (their sequences are the old stream's).
Meanwhile the enforcer keeps the usage it had, as while the ledger is down.

Partitions are filtered here, not by subject: every instance reads the whole events stream of its cluster filter
and folds only the namespaces of its partitions (cluster-wide objects are folded by all).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from services.platform.bus import CALL_BACKOFF, TRANSIENT, Bus, position
from services.platform.consumer import PullConsumer
from services.platform.http import Health, Metrics
from services.platform.publisher import Item, Publisher
from shared import contract
from shared.accounting.namespace import ACCOUNTED_KINDS
from shared.errors import InvalidInput
from shared.ledger.fold import (
    CHECKPOINT_PARTS,
    CLUSTER_WIDE,
    COMPRESS_OVER,
    Ledger,
    NamespaceState,
    NamespaceView,
    Outcome,
    PartitionSet,
    checkpoint_key,
    join_checkpoint,
    pack_checkpoint,
    part_keys,
    part_of,
    split_checkpoint,
    unpack_checkpoint,
)
from shared.ledger.schedule import URGENT_KINDS, Urgency, Urgent, schedule, waited_for
from shared.ledger.usage import fit, usage_snapshot
from shared.times import rfc3339

Accountant = Callable[[NamespaceView], contract.UsageBody]
"""Accounting of one namespace (``shared.accounting`` through ``shared.accounting.wire``)."""


log = structlog.get_logger("vmquota.ledger")


_HELD_UP: Final = 1.0
"""Seconds past the consumer's ``idle`` after which the loop runs its timers without a batch."""


MENDED: Final = b"mended"
"""The mark of lost events once every loss is mended. Not an empty value: a reader of the bus can have JetStream
store an empty message under any subject (a pull request's status reply, aimed at ``$KV.VMQUOTA_LEDGER.<key>``),
and an empty mark read as "nothing lost" forgot a loss. Anything but this value and a token is a new loss."""


def _token(last: int) -> str:
    """A new token naming a loss of events (the stream's last sequence then, for a person, and a random part)."""
    return f"{last}-{secrets.token_hex(6)}"


def _shared_cluster_key(key: str) -> bool:
    """Whether ``key`` is ``cl.<cluster>``: the cluster-wide checkpoint every instance of an earlier version wrote."""
    names = key.split(".")
    return names[0] == "cl" and len(names) == 2


_PAYLOAD_HEADROOM: Final = 4096
"""Bytes of the bus's maximum payload left for the message's headers and protocol line."""


@dataclass(frozen=True, slots=True)
class LedgerOptions:
    partitions: PartitionSet
    cluster: str | None = None
    """Fold only this cluster's events (None: every cluster on the bus)."""
    events_max_age: float = 30 * contract.DAY
    usage_history_max_age: float = 7 * contract.DAY
    batch: int = 1000
    idle: float = 0.5
    """Seconds a fetch waits for events before the loop runs its timers."""
    debounce: float = 0.25
    """Least time between two accounting rounds of one namespace: a change after a quiet spell of that namespace is
    published at once; under a stream of events it is accounted at most every ``debounce`` seconds, except for
    urgent changes (``shared.accounting.Urgency``): those a migration's or a new VM's latency depends on
    (``Urgent.NOW``) at once, before other namespaces, and those that end a reservation (``Urgent.SOON``) after
    ``soon`` seconds."""
    soon: float = 0.05
    """Least time between two accounting rounds of one namespace for changes that end a reservation (at most
    ``debounce``): the steps of one migration's or VM's end, arriving together, are accounted once."""
    checkpoint_interval: float = 2.0
    checkpoint_part_bytes: int = 0
    """The largest piece of a checkpoint stored as one value (0: the bus's largest message, less headroom); a larger
    checkpoint is stored in parts and a manifest (``shared.ledger.fold.split_checkpoint``)."""
    service: str = "ledger"
    relist_retry: tuple[float, float] = (2.0, 60.0)
    """Seconds between relist requests to a cluster whose lost events wait for one: the first, and the most after
    doubling."""
    kinds: frozenset[str] | None = ACCOUNTED_KINDS
    """The kinds folded (None: every kind); the others are skipped (VirtualMachines: accounting does not read
    them)."""

    @property
    def consumer_name(self) -> str:
        return f"vmquota-ledger-{self.partitions.token()}-{self.cluster or 'all'}"

    @property
    def instance(self) -> str:
        """``<partitions>.<cluster or all>``: what names this instance's own keys in the bucket."""
        return f"{self.partitions.token()}.{self.cluster or 'all'}"

    def _instance_key(self, what: str) -> str:
        """``<what>.<partitions>.<cluster or all>``: a key of this instance's own in the bucket."""
        return f"{what}.{self.instance}"

    @property
    def progress_key(self) -> str:
        return self._instance_key("progress")

    @property
    def stream_key(self) -> str:
        """Where this instance keeps when the events stream its progress counts in was created."""
        return self._instance_key("stream")

    @property
    def lost_key(self) -> str:
        """Where this instance keeps the token of events the stream lost before it read them (see the module)."""
        return self._instance_key("lost")


class LedgerService:
    def __init__(
        self,
        bus: Bus,
        opts: LedgerOptions,
        account: Accountant,
        *,
        metrics: Metrics | None = None,
        health: Health | None = None,
    ) -> None:
        self.bus = bus
        self.opts = opts
        self.account = account
        self.metrics = metrics or Metrics()
        self.health = health or Health()
        self.ledger = self._fresh_ledger()
        self.kv: KeyValue | None = None
        self._parts: dict[str, list[str]] = {}
        """Checkpoint key → the keys of the parts its stored manifest names (deleted once it is replaced)."""
        self.consumer: PullConsumer | None = None
        self.start_seq = 1
        self.replay_to = 0
        """The events stream's last sequence when this instance started: until it has folded that far (or read all
        there is of its cluster), it replays what an instance before it had folded and published (see the module)."""
        self.lost = ""
        """The token of the latest loss of events ("": none); see the module."""
        self._stream_created: datetime | None = None
        """When the events stream the progress counts in was created (as kept in the bucket)."""
        self._others_created: datetime | None = None
        """The latest creation time of the events stream other instances' progress counts in: for an instance with
        none of its own (a new partition layout), the stream the checkpoints it loads come from."""
        self._lost_saved = True
        self._relist_at = 0.0
        """When the next relist request is due (monotonic)."""
        self._streams_at = (bus.epoch, 0.0)
        """The bus's connection epoch and the time of the last :meth:`_ensure_streams`: the ledger keeps the streams
        (``shared.contract.STREAM_KEEPER``), again after a reconnect and every ``bus.consumer_check`` seconds."""
        self._streams_failing = ""
        """Why the last check of the streams failed ("" once they were checked): said once per kind."""
        self._relist_delay = opts.relist_retry[0]
        self._withheld: set[str] = set()
        """Clusters whose usage was withheld (logged once per cluster until whole again)."""
        self.applied = 0
        self.published = 0
        self.dead_letters = 0
        self._accounted_at: dict[tuple[str, str], float] = {}
        """When each namespace was last accounted (monotonic), for the per-namespace debounce."""
        self._urgent: dict[tuple[str, str], Urgent] = {}
        """Namespaces with an urgent change since they were last accounted, with the highest urgency, in the order of
        their first urgent change."""
        self._is_urgent = Urgency()
        self._last_checkpoint = 0.0
        self._checkpointing: asyncio.Task[int] | None = None
        """The checkpoint round being written in the background, if any."""
        self._usage_publisher: Publisher | None = None
        """Sends the usage snapshots while the service runs."""
        self._waiting = asyncio.Event()
        """Set while the loop waits for events: a background checkpoint round encodes a state only then, so it
        never holds up the accounting a migration waits for."""
        svc = opts.service
        self._m_in = self.metrics.events_in.labels(service=svc)
        self._m_out = self.metrics.events_out.labels(service=svc)
        self._m_lag = self.metrics.lag.labels(service=svc)
        self._m_fold = self.metrics.fold_seconds.labels(service=svc)
        self._m_dlq = self.metrics.dlq.labels(service=svc)
        self._m_seq = self.metrics.applied_seq.labels(service=svc)
        self._m_incomplete = self.metrics.incomplete.labels(service=svc)

    def _fresh_ledger(self) -> Ledger:
        return Ledger(self.opts.partitions, self.opts.kinds)

    # ---- start-up ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Ensure the streams and the bucket, load checkpoints, choose the replay start."""
        await self._ensure_streams()
        progress = await self._load()
        last = await self._events_last_seq()
        if last is not None and max([progress, *(st.seq for st in self.ledger.states.values())]) > last:
            log.error("checkpoints are ahead of the events stream (recreated?): starting over", last_seq=last)
            await self._lose(last)  # (the events of the old stream are gone; kept before anything is deleted)
            await self._start_over()
            progress = 0
        self.start_seq = progress + 1
        self.replay_to = last if last is not None and last >= self.start_seq else 0
        log.info(
            "ledger starting",
            partitions=self.opts.partitions.token(),
            states=len(self.ledger.states),
            start_seq=self.start_seq,
            replay_to=self.replay_to,
        )

    async def _start(self, deadline: float = 60.0) -> None:
        """:meth:`start`, from the beginning again while it fails for NATS (for ``deadline`` seconds, as each of its
        calls): a server that lost its store while the ledger started (the bucket it had just made, or a stream,
        gone under it) is started on again, as a running ledger goes on, not died of."""
        end = time.monotonic() + deadline
        for attempt in itertools.count():
            try:
                await self.start()
                return
            except (*TRANSIENT, nats.js.errors.NotFoundError) as e:
                if time.monotonic() >= end:
                    raise
                log.warning("ledger start failed; starting again", error=str(e) or type(e).__name__)
            self._unload()
            await asyncio.sleep(CALL_BACKOFF.delay(attempt))

    def _unload(self) -> None:
        """Forget what a start that failed had loaded."""
        self.ledger = self._fresh_ledger()
        self._parts.clear()
        self.lost, self._lost_saved = "", True
        self._stream_created = self._others_created = None
        self._relist_at, self._relist_delay = 0.0, self.opts.relist_retry[0]

    async def _ensure_streams(self, deadline: float = 60.0) -> None:
        """Create the streams that are missing and put back limits that differ: every stream, as their keeper (the
        one identity the NATS configurations let create or update one; the watchers and enforcers wait for them),
        and the checkpoint bucket. A transient error is retried for ``deadline`` seconds, then raised. The check
        counts for the connection it began on: a reconnect meanwhile (a server that lost its store after the streams
        were made, before the bucket was) has the next :meth:`_keep_streams` check them again."""
        epoch = self.bus.epoch
        await self.bus.ensure_streams(
            contract.streams_for(
                "ledger", self.opts.events_max_age, usage_history_max_age=self.opts.usage_history_max_age
            ),
            deadline=deadline,
        )
        self.kv = await self.bus.ensure_kv(contract.LEDGER_BUCKET, deadline=deadline)
        self._streams_at = (epoch, time.monotonic())

    async def _keep_streams(self, now: float) -> None:
        """:meth:`_ensure_streams` after a reconnect and every ``bus.consumer_check``, without holding the loop: one
        try (a few seconds at most), and while NATS does not answer, another a second later, logged once per
        outage; the service goes on meanwhile, as through any outage."""
        epoch, at = self._streams_at
        if epoch == self.bus.epoch and now < at + self.bus.consumer_check:
            return
        try:
            await self._ensure_streams(deadline=0.0)
        except (*TRANSIENT, InvalidInput) as e:
            # (a stream the server has no room for now, made again after an operator deleted it: said, and tried
            # again, while the ledger goes on folding; at the start the same answer stops the ledger)
            why = "NATS refuses them" if isinstance(e, InvalidInput) else "NATS does not answer"
            if self._streams_failing != why:  # (said once per kind of failure: an outage, then a refusal, each)
                log.warning(f"streams not checked yet: {why}", error=str(e) or type(e).__name__)
            self._streams_failing = why
            self._streams_at = (self.bus.epoch, now - self.bus.consumer_check + 1.0)
            return
        if self._streams_failing:
            log.info("streams checked again")
        self._streams_failing = ""

    async def _events_last_seq(self) -> int | None:
        try:
            info = await self.bus.js.stream_info(contract.EVENTS_STREAM)
        except nats.js.errors.NotFoundError:
            return None
        last: int = info.state.last_seq
        return last

    async def _load(self) -> int:
        assert self.kv is not None
        progress = 0
        stored: list[tuple[str, bytes]] = []
        earlier: list[tuple[str, bytes]] = []
        parts: dict[str, bytes] = {}
        # nats-py's watcher sends its "all delivered" marker once the consumer reports nothing pending, which on a
        # loaded machine can be before the client has handled what was delivered: read on until the newest write
        # the bucket held before the watch (deletions too: it may be one) has come
        newest = (await self.kv.status()).stream_info.state.last_seq
        watcher = await self.kv.watch(">")
        marked, seen = False, 0
        try:
            while not (marked and seen >= newest):
                entry = await watcher.updates(timeout=30.0)  # type: ignore[no-untyped-call]
                if entry is None:
                    marked = True
                    continue
                seen = max(seen, entry.revision or 0)
                if entry.operation is not None:  # (a deletion or a purge)
                    continue
                key, value = entry.key, entry.value or b""
                if key == self.opts.progress_key:
                    try:
                        progress = int(value.decode())
                    except (UnicodeDecodeError, ValueError):
                        log.warning("unreadable progress key; replaying from the start", key=key)
                        progress = 0
                elif key == self.opts.stream_key:
                    try:
                        self._stream_created = datetime.fromisoformat(value.decode())
                    except (UnicodeDecodeError, ValueError):
                        log.warning("unreadable creation time of the events stream; checked by sequences only", key=key)
                elif key.startswith("stream."):
                    try:
                        other = datetime.fromisoformat(value.decode())
                    except (UnicodeDecodeError, ValueError):
                        continue
                    self._others_created = max(other, self._others_created or other)
                elif key == self.opts.lost_key:
                    self.lost = "" if value == MENDED else value.decode(errors="replace")
                    if value != MENDED and not contract.RELIST_TOKEN.match(self.lost):
                        log.error("unreadable mark of lost events: every cluster waits for a new relist", key=key)
                        self.lost = _token(0)
                        self._lost_saved = False
                elif (owner := part_of(key)) is not None:
                    if self._loads(owner):
                        parts[key] = value
                elif self._loads(key):
                    (earlier if _shared_cluster_key(key) else stored).append((key, value))
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        for key, value in stored:
            if not self._load_one(key, value, parts):
                progress = -(10**18)  # forces a full replay below
        progress, adopted = self._adopt_earlier(earlier, parts, progress)
        await self._drop_unnamed_parts(parts)
        self.ledger.unsaved.clear()
        self.ledger.unsaved.update(adopted)
        if progress < 0:
            self.ledger = self._fresh_ledger()
            progress = 0
        # Recompute every namespace once: a usage not yet published before the stop (or computed by an older
        # version) is published now; an unchanged one is not (its digest is in the checkpoint).
        self.ledger.changed.update(self.ledger.namespaces())
        return progress

    def _adopt_earlier(
        self, earlier: list[tuple[str, bytes]], parts: dict[str, bytes], progress: int
    ) -> tuple[int, list[tuple[str, str]]]:
        """Take the cluster-wide states an earlier version shared (``cl.<cluster>``, every instance wrote them) of
        the clusters this instance has none of its own of: the replay starts from the oldest of them (it may be
        older than this instance's progress), and each is written under this instance's key at the next checkpoint.
        Returns the progress to replay from and the states taken."""
        adopted: list[tuple[str, str]] = []
        for key, value in earlier:
            cluster = key.split(".")[1]
            if self.ledger.cluster_state(cluster) is not None:
                continue
            if not self._load_one(key, value, parts):
                progress = -(10**18)  # forces a full replay
                continue
            state = self.ledger.cluster_state(cluster)
            if state is None:
                continue
            adopted.append((cluster, CLUSTER_WIDE))
            if state.seq < progress:
                log.warning(
                    "shared cluster-wide checkpoint of an earlier version: replaying the events stream from it",
                    key=key,
                    seq=state.seq,
                    progress=progress,
                )
                progress = state.seq
        return progress, adopted

    def _load_one(self, key: str, value: bytes, parts: dict[str, bytes]) -> bool:
        """Load one stored checkpoint; False (logged) when it cannot be read."""
        try:
            self.ledger.load(unpack_checkpoint(self._whole(key, value, parts)))
        except InvalidInput as e:
            log.error("unreadable checkpoint ignored: replaying from the start", key=key, error=str(e))
            return False
        return True

    def _loads(self, key: str) -> bool:
        """Whether this instance loads the checkpoint stored under ``key``: its own cluster-wide state of each cluster
        of its filter (and the one every instance of an earlier version shared), and the namespaces of its
        partitions."""
        names = key.split(".")
        if names[0] == "cl" and len(names) >= 2:
            return (self.opts.cluster is None or names[1] == self.opts.cluster) and (
                len(names) == 2 or ".".join(names[2:]) == self.opts.instance
            )
        return (
            names[0] == "ns"
            and len(names) == 3
            and (self.opts.cluster is None or names[1] == self.opts.cluster)
            and self.opts.partitions.owns(names[1], names[2])
        )

    def _whole(self, key: str, value: bytes, parts: dict[str, bytes]) -> bytes:
        """A stored checkpoint, its parts (among ``parts``, the bucket's) joined when it is a manifest
        (:func:`split_checkpoint`); the keys of those parts are remembered, to be deleted once replaced."""
        if not value.startswith(CHECKPOINT_PARTS):
            return value
        keys = part_keys(key, value)
        missing = [k for k in keys if k not in parts]
        if missing:
            raise InvalidInput(f"{len(missing)} of the {len(keys)} parts of the checkpoint are missing", key)
        self._parts[key] = keys
        return join_checkpoint(value, [parts[k] for k in keys])

    async def _drop_unnamed_parts(self, parts: dict[str, bytes]) -> None:
        """Delete the parts (of the checkpoints this instance loads) that no stored manifest names: a write that did
        not finish left them. Those of the cluster-wide state an earlier version shared are left: every instance of
        that version writes them."""
        named = {k for keys in self._parts.values() for k in keys}
        for key in sorted(parts):
            owner = part_of(key)
            if key not in named and owner is not None and not _shared_cluster_key(owner):
                await self._delete_part(key)

    async def _delete_part(self, key: str) -> None:
        """Delete a checkpoint part no manifest names any more (a failure is logged: the next start deletes it)."""
        assert self.kv is not None
        try:
            await self.kv.delete(key)
        except (nats.errors.Error, OSError) as e:  # (garbage only: the next start deletes it)
            log.warning("checkpoint part not deleted", key=key, error=str(e) or type(e).__name__)

    async def _put_checkpoint(self, key: str, data: bytes) -> None:
        """Store one packed checkpoint: when it is larger than a message, its parts first (keys named by their
        content), then their manifest; then delete the parts the checkpoint stored before named."""
        assert self.kv is not None
        keys: list[str] = []
        limit = self.opts.checkpoint_part_bytes or self._message_limit()
        if len(data) > limit:
            data, parts = split_checkpoint(data, limit)
            keys = part_keys(key, data)
            for k, part in zip(keys, parts, strict=True):
                await self.kv.put(k, part)
        await self.kv.put(key, data)
        old = self._parts.pop(key, [])
        if keys:
            self._parts[key] = keys
        for k in old:
            if k not in keys:
                await self._delete_part(k)

    def _message_limit(self) -> int:
        """The largest value this service stores or message it publishes: the bus's, less headroom."""
        return self.bus.max_payload - _PAYLOAD_HEADROOM

    # ---- the loop ----------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._usage_publisher = Publisher(self.bus, window=256)
        self._usage_publisher.start()
        try:
            await self._run(stop)
        finally:
            await self._usage_publisher.close()
            self._usage_publisher = None

    async def _run(self, stop: asyncio.Event) -> None:
        await self._start()
        self.consumer = PullConsumer(
            self.bus,
            stream=contract.EVENTS_STREAM,
            durable=self.opts.consumer_name,
            filter_subjects=[contract.events_filter(self.opts.cluster)],
            start_seq=self.start_seq,
            batch=self.opts.batch,
            idle=self.opts.idle,
            note_losses=True,
            # (with no progress of its own, the stream the checkpoints it loads were written in: a stream created
            # anew since is noted as one, however far it has grown past their sequences)
            stream_created=self._stream_created or self._others_created,
        )
        self.health.set_ready(self.opts.service, False)
        batches = self.consumer.batches_or_holdups(_HELD_UP)
        clean = False
        try:
            self._waiting.set()
            async for batch in batches:
                if batch is None:  # (held up: a JetStream call waits for an answer; the timers run meanwhile)
                    if stop.is_set():
                        break
                    self._waiting.clear()
                    await self._timers(time.monotonic())
                    self._waiting.set()
                    continue
                self._waiting.clear()
                idle = self._checkpoint_done()  # (raises what a finished round raised)
                self.health.set_ready(self.opts.service, True)
                loss = self.consumer.take_loss()
                if loss is not None:  # (before the batch that comes after it is folded)
                    if loss.recreated:
                        # (a round running would write the old stream's states and progress back)
                        await self._end_checkpointing(clean=False)
                        await self._lose(loss.stream_last)  # (kept before the progress is deleted)
                        await self._start_over()
                    else:
                        await self._lose(loss.stream_last)
                if batch:
                    await self._fold(batch)
                if self.replay_to:
                    await self._replayed(bool(batch))
                now = time.monotonic()
                await self._timers(now)
                if (
                    idle
                    and self.ledger.unsaved
                    and not self.replay_to
                    and not stop.is_set()
                    and now - self._last_checkpoint >= self.opts.checkpoint_interval
                ):
                    # In the background, a state at a time: the fold goes on while a round is written.
                    if self.ledger.changed:
                        await self.publish_usage()  # the progress it writes must not cover an unpublished change
                    self._checkpointing = asyncio.create_task(self.checkpoint(pace=True), name="ledger-checkpoint")
                if stop.is_set():
                    break
                self._waiting.set()
            clean = True
        finally:
            self._waiting.set()
            self.health.set_ready(self.opts.service, False)
            await batches.aclose()
            await self.consumer.close()
            await self._end_checkpointing(clean)
        if self.replay_to:  # (what it folded is older than what was published: the next start replays it again)
            log.info("ledger stopped during its replay: nothing published or checkpointed", replay_to=self.replay_to)
        else:
            await self.checkpoint()  # a clean stop leaves nothing to replay (it publishes what is pending first)
        log.info("ledger stopped", applied=self.applied, published=self.published, seq=self.consumer.next_seq - 1)

    async def _replayed(self, folded: bool) -> None:
        """End the replay once this instance has folded what the stream held at its start, or all there is of its
        cluster (the tail of the stream may be another cluster's): its last batch left nothing pending, or, after
        an empty one, the server says nothing is (an empty batch alone may be a fetch that timed out on a loaded
        server with the replay's events still pending)."""
        assert self.consumer is not None
        done = self._applied() >= self.replay_to or (folded and self.consumer.drained)
        if done or (not folded and await self.consumer.nothing_pending()):
            log.info("replay folded: usage published again", replay_to=self.replay_to, applied=self._applied())
            self.replay_to = 0

    def _checkpoint_done(self) -> bool:
        """Whether no checkpoint round is running (raising what a finished round raised)."""
        task = self._checkpointing
        if task is None:
            return True
        if not task.done():
            return False
        self._checkpointing = None
        task.result()
        return True

    async def _end_checkpointing(self, clean: bool) -> None:
        """On the way out: let a running round finish after a clean stop (a failure is logged; the final checkpoint
        writes its states again), cancel it when the loop failed (its error is the one that matters) or the ledger
        starts over on a stream created anew."""
        task, self._checkpointing = self._checkpointing, None
        if task is None:
            return
        if not clean:
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if clean:
                raise
        except Exception as e:
            log.error("checkpoint round failed", error=repr(e))

    async def _fold(self, batch: list[Msg]) -> None:
        t0 = time.perf_counter()
        rejects: list[tuple[Msg, int, str]] = []
        apply = self.ledger.apply
        for msg in batch:
            seq = position(msg).stream
            try:
                ev = contract.decode_event_on(msg.subject, msg.data)
                outcome = apply(ev, seq)
                if outcome is Outcome.APPLIED or outcome is Outcome.REFRESHED:
                    self.applied += 1
                if outcome is Outcome.APPLIED and ev.kind in URGENT_KINDS and not isinstance(ev, contract.Sync):
                    new = ev.snapshot if isinstance(ev, contract.Upserted) else None
                    level = self._is_urgent(self.ledger.replaced, new, ev.cluster)
                    key = (ev.cluster, ev.namespace)
                    if level > self._urgent.get(key, Urgent.NO):
                        self._urgent[key] = level
            except InvalidInput as e:
                rejects.append((msg, seq, str(e)))
        self._m_fold.observe(time.perf_counter() - t0)
        self._m_in.inc(len(batch))
        assert self.consumer is not None
        self._m_lag.set(self.consumer.pending)
        self._m_seq.set(self.consumer.next_seq - 1)
        for msg, seq, reason in rejects:
            await self._dead_letter(msg, seq, reason)

    async def _quiet(self) -> None:
        """Return when the loop waits for events (after letting whatever is ready run first)."""
        await asyncio.sleep(0)
        while not self._waiting.is_set():
            await self._waiting.wait()
            await asyncio.sleep(0)

    async def _dead_letter(self, msg: Msg, seq: int, reason: str) -> None:
        cluster = msg.subject.split(".")[2] if msg.subject.count(".") >= 4 else ""
        with structlog.contextvars.bound_contextvars(subject=msg.subject, seq=seq, cluster=cluster):
            log.warning("event rejected to the dead-letter subject", reason=reason)
            self.dead_letters += 1
            await self.bus.record_dead_letter(
                self._m_dlq.inc,
                self.opts.service,
                reason,
                cluster=cluster,
                original_subject=msg.subject,
                stream=contract.EVENTS_STREAM,
                stream_seq=seq,
                payload=msg.data,
            )

    # ---- lost events -------------------------------------------------------------------------------------------
    async def _lose(self, last: int) -> None:
        """The stream lost events this ledger had not read (its last sequence was ``last``): name the loss anew and
        hold back the usage of every cluster until a relist answering it is read (see the module). The token is
        kept before anything else is done."""
        self.lost = _token(last)
        self._relist_at, self._relist_delay = 0.0, self.opts.relist_retry[0]
        log.error(
            "the events stream lost events this ledger had not read: usage is withheld until each cluster's "
            "watcher has published everything again",
            lost=self.lost,
            clusters=self.ledger.clusters() or ([self.opts.cluster] if self.opts.cluster else []),
        )
        self._lost_saved = False
        await self._save_lost()

    async def _put_lost(self) -> None:
        """Keep :attr:`lost` in the bucket (raising what the put raises)."""
        assert self.kv is not None
        await self.kv.put(self.opts.lost_key, self.lost.encode())
        self._lost_saved = True

    async def _save_lost(self) -> None:
        """:meth:`_put_lost`, a failure logged (tried again before the next checkpoint's progress)."""
        try:
            await self._put_lost()
        except (nats.errors.Error, OSError) as e:
            log.warning("mark of lost events not saved yet", error=str(e) or type(e).__name__)

    def _publishable(self, cluster: str) -> bool:
        """Whether the cluster's usage may be published (logging when it is withheld, and when it is no more)."""
        if self.ledger.whole(cluster, self.lost, self._applied()):
            if cluster in self._withheld:
                self._withheld.discard(cluster)
                log.info("relist folded: usage published again", cluster=cluster, lost=self.lost)
            return True
        if cluster not in self._withheld:
            self._withheld.add(cluster)
            log.warning("usage withheld until the cluster's watcher has published everything again", cluster=cluster)
        return False

    def incomplete(self) -> list[str]:
        """The clusters whose usage waits for a relist answering :attr:`lost` (the one this instance folds even
        before it holds anything of it)."""
        return self._waiting_at(self._applied())

    def _waiting_at(self, applied: int) -> list[str]:
        """:meth:`incomplete` for a reader that has read up to ``applied``."""
        if not self.lost:
            return []
        clusters = set(self.ledger.clusters())
        if self.opts.cluster is not None:
            clusters.add(self.opts.cluster)
        return sorted(c for c in clusters if not self.ledger.whole(c, self.lost, applied))

    def _applied(self) -> int:
        """The stream sequence up to which this instance has folded the events stream."""
        return (self.consumer.next_seq if self.consumer is not None else self.start_seq) - 1

    async def _start_over(self) -> None:
        """The events stream was created anew: every state, and every checkpoint this instance loads, holds the old
        stream's sequences, which would skip the new stream's events. Drop them all (the watchers' relist brings
        the objects back)."""
        attempt = 0
        while not self._lost_saved:  # (the loss's token is kept before anything is deleted)
            if attempt == 5:
                raise RuntimeError("the events stream was created anew and the loss cannot be kept: restarting")
            await asyncio.sleep(CALL_BACKOFF.delay(attempt))
            await self._save_lost()
            attempt += 1
        self.ledger = self._fresh_ledger()
        self._parts.clear()
        self._stream_created = self._others_created = None
        assert self.kv is not None
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            keys = []
        owned = [key for key in keys if self._loads(part_of(key) or key)]
        # (the stream key last: a failure or a crash before it leaves the old creation time, and the next start
        # finds the stream created anew again and starts over again; a failure raises, the service restarts)
        for key in [*owned, self.opts.progress_key, self.opts.stream_key]:
            await self.kv.delete(key)

    async def _timers(self, now: float) -> None:
        """What the loop does whether or not events came: keep the streams (after a reconnect, and every
        ``bus.consumer_check``: a server that lost its store, a stream an operator deleted), ask for the relists a
        loss waits for, and account and publish the changed namespaces that are due."""
        await self._keep_streams(now)
        if self.lost:
            await self._ask_for_relists(now)
        if self.ledger.changed and not self.replay_to:
            due, wait = self._due(now)
            if due:
                await self.publish_usage(due)
            # wake up in time for the namespaces still waiting, even when no event arrives
            assert self.consumer is not None
            self.consumer.idle = self.opts.idle if wait is None else max(0.01, min(self.opts.idle, wait))

    async def _ask_for_relists(self, now: float) -> None:
        """Ask the watcher of each cluster still waiting for a relist (core NATS: a request lost with a watcher's
        restart is asked again, later and later)."""
        waiting = self.incomplete()
        self._m_incomplete.set(len(waiting))
        if not waiting or now < self._relist_at:
            return
        if not self._lost_saved:
            await self._save_lost()
        request = contract.encode(
            contract.RelistRequest(
                token=self.lost, requester=contract.source(self.opts.service, self.opts.cluster or "all")
            )
        )
        for cluster in waiting:
            try:
                await self.bus.nc.publish(contract.relist_subject(cluster), request)
            except (nats.errors.Error, OSError) as e:
                log.warning("relist request not sent", cluster=cluster, error=str(e) or type(e).__name__)
        log.info("relists requested", clusters=waiting, lost=self.lost)
        self._relist_at = now + self._relist_delay
        self._relist_delay = min(self._relist_delay * 2, self.opts.relist_retry[1])

    # ---- usage -------------------------------------------------------------------------------------------------
    def _fitted(self, msg: contract.UsageSnapshot, vms: list[contract.VmState]) -> bytes | None:
        """``msg`` as the bus takes it (``shared.ledger.usage.fit``), what was left out logged."""
        limit = self._message_limit()
        fitted = fit(msg, vms, limit)
        if fitted.size > limit:
            with structlog.contextvars.bound_contextvars(cluster=msg.cluster, namespace=msg.namespace, seq=msg.seq):
                if fitted.data is None:
                    log.error("usage too large to publish", size=fitted.size, limit=limit)
                else:
                    log.warning("usage published without its VM states", size=fitted.size, limit=limit)
        return fitted.data

    def _due(self, now: float) -> tuple[list[tuple[str, str]], float | None]:
        """Changed namespaces to account now, in order, and the seconds until the next one that waits is due."""
        o = self.opts
        return schedule(self.ledger.changed, self._urgent, self._accounted_at, now, debounce=o.debounce, soon=o.soon)

    async def publish_usage(self, keys: list[tuple[str, str]] | None = None) -> int:
        """Account the given changed namespaces in this order (default: every changed one, those a migration or a VM
        waits for first); publish the snapshots whose content changed. Returns how many."""
        if keys is None:  # what a migration or a new VM waits for first
            first = waited_for(self.ledger.changed, self._urgent)
            keys = first + sorted(self.ledger.changed.difference(first))
        self.ledger.changed.difference_update(keys)
        now = time.monotonic()
        for key in keys:
            self._urgent.pop(key, None)
            self._accounted_at[key] = now
        if len(self._accounted_at) > 2 * len(self.ledger.changed) + 1024:  # forget quiet namespaces (bounded)
            horizon = now - self.opts.debounce
            self._accounted_at = {k: t for k, t in self._accounted_at.items() if t > horizon}
        sent: list[tuple[NamespaceState, str, tuple[str, str]]] = []
        publisher = self._usage_publisher
        assert publisher is not None, "usage is published while the service runs"
        for cluster, namespace in keys:
            state = self.ledger.state(cluster, namespace)
            if state is None or namespace == CLUSTER_WIDE:
                continue
            if self.lost and not self._publishable(cluster):
                continue  # (accounted again once a relist of the cluster is folded)
            view = self.ledger.view(cluster, namespace)
            try:
                body = self.account(view)
            except InvalidInput as e:
                with structlog.contextvars.bound_contextvars(cluster=cluster, namespace=namespace, seq=view.seq):
                    log.error("accounting failed; usage not published", error=str(e))
                continue
            except Exception as e:  # (a defect accounting one namespace stops no other namespace's)
                with structlog.contextvars.bound_contextvars(cluster=cluster, namespace=namespace, seq=view.seq):
                    log.error(
                        "accounting failed on a defect; usage not published (accounted again at the namespace's next "
                        "change): please report it",
                        error=f"{type(e).__name__}: {e}",
                    )
                continue
            msg, digest = usage_snapshot(
                body,
                cluster=cluster,
                namespace=namespace,
                seq=view.seq,
                source=contract.source(self.opts.service, cluster),
                time=rfc3339(),
            )
            if digest == state.usage_digest:
                continue
            data = self._fitted(msg, body.vms)
            if data is None:
                continue
            # No Nats-Msg-Id: after a crash the same sequence may be published again with the same content,
            # but an earlier content must never be dropped as a "duplicate" of what a crashed run sent before
            # it. Sent at once (acks awaited below), and the loop let run so the connection writes it out
            # before the next namespace is accounted.
            await publisher.room()
            publisher.enqueue(Item(contract.usage_subject(cluster, namespace), data, None))
            await asyncio.sleep(0)
            sent.append((state, digest, (cluster, namespace)))
        await publisher.flush()  # while NATS is away: until it is back (the publisher republishes)
        # Only a stored usage is remembered as published (a checkpoint keeps the digest).
        for state, digest, key in sent:
            state.usage_digest = digest
            self.ledger.unsaved.add(key)
        if sent:
            self.published += len(sent)
            self._m_out.inc(len(sent))
        return len(sent)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    async def checkpoint(self, *, pace: bool = False) -> int:
        """Write every changed state, then this instance's progress. Returns how many states were written.

        ``pace``: a round running as a task beside the fold: encode each state a piece at a time, only while
        the loop waits for events, and compress it in a thread. That is safe: ``progress`` is taken first, so an
        event folded meanwhile is above it and is replayed after a crash (a state written after it has it already
        and skips it)."""
        assert self.kv is not None and self.consumer is not None
        if self.ledger.changed and not pace:
            await self.publish_usage()  # the progress written below must not cover an unpublished change
        kv = self.kv
        keys = sorted(self.ledger.unsaved)
        self.ledger.unsaved.clear()
        self._last_checkpoint = time.monotonic()
        progress = self.consumer.next_seq - 1
        created = self.consumer.stream_created  # (the stream ``progress`` counts in: taken with it)
        try:
            for i in range(0, len(keys), 128):
                chunk = keys[i : i + 128]
                puts: list[tuple[str, bytes]] = []
                for k in chunk:
                    if pace:
                        await self._quiet()
                        parts = []
                        for part in self.ledger.states[k].checkpoint_parts():  # the state as it is now
                            parts.append(part)
                            await self._quiet()
                        data = b"".join(parts)
                        # zlib lets go of the GIL: compress beside the fold
                        data = await asyncio.to_thread(pack_checkpoint, data) if len(data) > COMPRESS_OVER else data
                    else:
                        data = pack_checkpoint(self.ledger.states[k].checkpoint())
                    puts.append((checkpoint_key(*k, self.opts.instance), data))
                # (every write ends with its round: one left running would write an older checkpoint after the
                # next round's, and the progress that round wrote would skip events it lacks; the writes start
                # together, once the chunk is encoded, so that a round cancelled meanwhile leaves none unstarted)
                writes = [self._put_checkpoint(key, data) for key, data in puts]
                failed = [
                    r for r in await asyncio.gather(*writes, return_exceptions=True) if isinstance(r, BaseException)
                ]
                if failed:
                    raise failed[0]
            if not self._lost_saved:  # (a progress past a loss whose mark is not kept would forget the loss)
                await self._put_lost()
            if created is not None and created != self._stream_created:  # (the stream the progress counts in)
                await kv.put(self.opts.stream_key, created.isoformat().encode())
                self._stream_created = created
            await kv.put(self.opts.progress_key, str(progress).encode())
            if self.lost and not self._waiting_at(progress):
                # Every cluster's relist is read up to the progress just kept: the loss is mended for good (its
                # answer need not be kept any more: the cluster-wide state keeps the latest ``ANSWERS_KEPT``).
                await kv.put(self.opts.lost_key, MENDED)
                self.lost = ""
        except (nats.errors.Error, OSError) as e:
            # Not saved: try again next time (the states stay marked).
            self.ledger.unsaved.update(keys)
            log.warning("checkpoint failed; will retry", error=str(e) or type(e).__name__)
            return 0
        except BaseException:
            self.ledger.unsaved.update(keys)
            raise
        return len(keys)
