"""A durable JetStream pull consumer a service owns (:class:`PullConsumer`): created or repaired to the configuration
the service needs, fetched in batches in stream order, and recreated from a position when the server lost it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from datetime import datetime

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    ReplayPolicy,
)

from services.platform.bus import CALL_BACKOFF, TRANSIENT, Bus, position

log = structlog.get_logger("vmquota.bus")

HEADERS_ONLY = "Nats-Msg-Size"
"""The header a consumer set to deliver headers only puts in place of a message's body (a publisher may set it too)."""

REWINDS = 3
"""How often in a row the reading goes back to the same position for a durable found changed before it reads on
(see ``PullConsumer._unverified``)."""

JUMP_CHECK_GAP = 0.25
"""Least time between two checks of the durable that jumps ahead in the stream start (a filter on a stream of many
subjects, or one that keeps the last message of each, jumps at nearly every message)."""


def _value(policy: object) -> object:
    """An enum's value (nats-py gives policies as enums or, for a value it does not know, as strings)."""
    return getattr(policy, "value", policy)


def _printable(differences: dict[str, tuple[object, object]]) -> dict[str, dict[str, str]]:
    return {k: {"expected": str(want), "found": str(have)} for k, (want, have) in differences.items()}


@dataclass(frozen=True, slots=True)
class Loss:
    """Messages a consumer lost: from stream sequence ``first`` to before ``stream_first`` (the stream's first
    message when the loss was noted; ``stream_last`` its last); ``recreated``: the stream was created anew (its
    last sequence was behind what the consumer had read), every message of the old one is lost and the consumer
    reads the new one from its start."""

    first: int
    stream_first: int
    stream_last: int
    recreated: bool = False


class PullConsumer:
    """Read ``stream`` in stream order from ``start_seq``, through a durable pull consumer named ``durable``.

    ``batches()`` yields lists of messages (an empty list when nothing arrived within ``idle`` seconds, so the
    reader can run its timers). After yielding a batch the consumer takes it as applied: ``next_seq`` is the
    stream sequence it asks for when it has to re-create itself.

    With ``note_losses``, messages the stream no longer holds (its retention dropped them) before this consumer read
    them are a loss: the consumer notes it (:meth:`take_loss`) when it is created at a position the stream's first
    message is past, when it is created on a stream created anew (created at another time than the one it read, or
    whose last message is behind what it had read: it then reads that one from its start), and when a message comes
    after a jump and the stream's first message is past the one it expected (with a filter, what it jumped over may
    all have been other subjects': such a reader is told of a loss only when the stream turned over past it, which a
    relist then mends). A stream that keeps the last message of each subject drops older ones by design: its readers
    do not ask.

    Every ``check_interval`` seconds (default: the bus's ``consumer_check``) and right after creating it, the consumer
    reads its durable's configuration back. Any other filter, deliver policy, ack policy or push delivery, or a
    durable created by someone else (another creation time), one that delivers headers only, is paused or replays at
    the original pace, means another client changed it: the consumer logs an error with the differences and
    re-creates its durable from ``next_seq``. It checks beside the reading when it passes over messages (a jump ahead
    in the stream, at most every :data:`JUMP_CHECK_GAP`: a filter another client narrowed passes over messages for
    good), and a durable found changed is re-created from the first jump since the last check, what came meanwhile
    read again (readers fold by sequence and version); and before it gives on a message without its body (headers
    only: if the server says so, it is read again, whole; else a publisher set the header, and it is given on).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str,
        filter_subjects: Sequence[str],
        start_seq: int = 1,
        batch: int = 500,
        idle: float = 1.0,
        check_interval: float | None = None,
        note_losses: bool = False,
        stream_created: datetime | None = None,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.filter_subjects = list(filter_subjects)
        self.next_seq = max(1, start_seq)
        self.batch = batch
        self.idle = idle
        self.pending = 0
        """Messages left in the stream for this consumer after the last batch (the lag)."""
        self.drained = False
        """Whether the last batch left nothing in the stream for this consumer (nothing pending after it, as the
        server said with its last message; an empty batch says nothing: see :meth:`nothing_pending`)."""
        self.recreations = 0
        self.failing = False
        """Whether the last batch was an empty one given for an error (the durable could not be made or read: a
        permission refused, the stream missing), not for an idle read: it says nothing of being caught up."""
        self.check_interval = check_interval if check_interval is not None else bus.consumer_check
        self.repairs = 0
        """Re-creations because the durable was not what this consumer had created."""
        self.last_differences: dict[str, tuple[object, object]] = {}
        """What was found changed at the last repair: field → (expected, found)."""
        self._created: object = None
        """The server's creation time of the durable this consumer created."""
        self._next_check = 0.0
        self._unchecked_from: int | None = None
        """The earliest position (a ``next_seq``) this consumer passed over messages from, by a jump ahead in the
        stream, since the durable was last checked: re-read from there if a check finds it changed."""
        self._checking: asyncio.Task[str] | None = None
        """A check of the durable running beside the reading, for the jumps from ``_checking_from`` on."""
        self._checking_from: int | None = None
        self._checked_at = -JUMP_CHECK_GAP
        self._rewound = (0, 0)
        """The position the reading last went back to, and how often in a row."""
        self._as_created: dict[str, tuple[object, object]] = {}
        """How the durable differed from what this consumer asks for as the server made it (a server that takes a
        field otherwise): not another client's change, and not repaired again at every check."""
        self._sub: JetStreamContext.PullSubscription | None = None
        self._epoch = -1
        self._expected_cseq = 1
        self._idle_fetches = 0
        self._loss: Loss | None = None
        self.note_losses = note_losses
        self.stream_created = stream_created
        """With ``note_losses``: when the stream this consumer read was created (the server's ``created``); a stream
        created at another time is another stream, whatever its sequences."""

    def take_loss(self) -> Loss | None:
        """The loss noted since the last call (the first position lost, and the stream's first and last sequence
        when it was noted), if any; read it before applying the batch it came with."""
        loss, self._loss = self._loss, None
        return loss

    async def _note_loss(self, *, creating: bool = False) -> bool:
        """Note a loss if the stream's first message is past ``next_seq`` (``creating``: or its last one is behind
        what was read: a stream created anew, whose start this consumer then reads from); whether it did."""
        info = await self.bus.js.stream_info(self.stream)
        state = info.state
        known, self.stream_created = self.stream_created, info.created or self.stream_created
        anew = known is not None and info.created is not None and info.created != known
        if creating and (anew or state.last_seq < self.next_seq - 1):
            log.error(
                "the stream was created anew since this consumer read it: read from its start",
                stream=self.stream,
                consumer=self.durable,
                read_to=self.next_seq - 1,
                stream_last_seq=state.last_seq,
            )
            self._loss = Loss(1, max(1, state.first_seq), state.last_seq, recreated=True)
            self.next_seq = max(1, state.first_seq)
            return True
        if state.first_seq <= self.next_seq:
            return False
        first = self._loss.first if self._loss is not None else self.next_seq
        recreated = self._loss is not None and self._loss.recreated
        self._loss = Loss(first, state.first_seq, state.last_seq, recreated)
        log.error(
            "the stream lost messages this consumer had not read",
            stream=self.stream,
            consumer=self.durable,
            lost_from=first,
            stream_first_seq=state.first_seq,
        )
        return True

    def _unverified(self) -> None:
        """Read again from the earliest position messages were passed over from since the durable was last found as
        created (the durable is re-created: whatever it was meanwhile, what it passed over is read again; the readers
        fold by sequence and version, so a message read twice changes nothing)."""
        if self._checking is not None:
            self._checking.cancel()
            self._checking = None
        starts = [p for p in (self._unchecked_from, self._checking_from) if p is not None]
        self._unchecked_from = self._checking_from = None
        if not starts or min(starts) >= self.next_seq:
            return
        start = min(starts)
        times = self._rewound[1] + 1 if self._rewound[0] == start else 1
        self._rewound = (start, times)
        where = {"stream": self.stream, "consumer": self.durable, "from_seq": start, "next_seq": self.next_seq}
        if times > REWINDS:
            # (changed again each time it is made, faster than it is checked: reading that stretch again would never
            # end, and reading on may have passed messages over; a reader that notes losses has them mended)
            log.error(
                "the durable is changed as soon as it is made: reading on, what it passed over may be lost", **where
            )
            if self.note_losses:
                first = min(start, self._loss.first) if self._loss is not None else start
                self._loss = Loss(first, self.next_seq, self.next_seq - 1)
            return
        log.warning("reading again what was passed over since the consumer was last checked", **where)
        self.next_seq = start

    def _check_beside(self) -> None:
        """Start a check of the durable beside the reading for the jumps not checked yet, at most every
        :data:`JUMP_CHECK_GAP` seconds."""
        now = asyncio.get_running_loop().time()
        if self._unchecked_from is None or self._checking is not None or now < self._checked_at + JUMP_CHECK_GAP:
            return
        self._checked_at = now
        self._checking_from, self._unchecked_from = self._unchecked_from, None
        self._checking = asyncio.create_task(self._check(), name=f"check-{self.durable}")

    def _checked_beside(self) -> str:
        """The outcome of a check run beside the reading that has ended: the reason to re-create the durable
        (re-reading from what it covered), or ""."""
        task, self._checking = self._checking, None
        assert task is not None
        covered, self._checking_from = self._checking_from, None
        try:
            why = task.result()
        except (*TRANSIENT, nats.js.errors.APIError) as e:  # (not known: the next check covers it too)
            log.warning("consumer not checked", consumer=self.durable, error=str(e) or type(e).__name__)
            if covered is not None:
                self._unchecked_from = min(covered, self._unchecked_from or covered)
            return ""
        if why:
            self._checking_from = covered  # (read again from it as the durable is re-created: _unverified)
        return why

    async def _recreate(self, why: str) -> None:
        self._unverified()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as e:  # the old inbox may already be gone with the connection
                log.debug("unsubscribe failed", error=str(e))
            self._sub = None
        self._epoch = self.bus.epoch
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(self.stream, self.durable)
        if self.note_losses:
            await self._note_loss(creating=True)
        cfg = ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.next_seq,
            ack_policy=AckPolicy.NONE,
            filter_subjects=self.filter_subjects if len(self.filter_subjects) > 1 else None,
            filter_subject=self.filter_subjects[0] if len(self.filter_subjects) == 1 else None,
            max_waiting=16,
            inactive_threshold=3600.0,
            # The reader keeps its own position and re-creates the consumer from it, so the server need not: one
            # replica in memory, even on a replicated stream (no raft group of its own to elect when a node dies).
            num_replicas=1,
            mem_storage=True,
        )
        info = await self.bus.js.add_consumer(self.stream, cfg)
        self._created = info.created
        self._sub = await self.bus.js.pull_subscribe_bind(self.durable, stream=self.stream)
        self._expected_cseq = 1
        self._idle_fetches = 0
        self.recreations += 1
        log.info("consumer created", stream=self.stream, consumer=self.durable, start_seq=self.next_seq, why=why)
        differences = self._as_created = self.differences(info)
        if differences:  # (a server that takes a field otherwise)
            log.error(
                "consumer created with another configuration",
                stream=self.stream,
                consumer=self.durable,
                differences=_printable(differences),
            )
        self._next_check = asyncio.get_running_loop().time() + self.check_interval

    def differences(self, info: ConsumerInfo) -> dict[str, tuple[object, object]]:
        """How the durable ``info`` describes differs from what this consumer creates: field → (expected, found)."""
        have = info.config
        found_filters = sorted({*(have.filter_subjects or ()), *([have.filter_subject] if have.filter_subject else [])})
        checks: dict[str, tuple[object, object]] = {
            "filter_subjects": (sorted(self.filter_subjects), found_filters),
            "deliver_policy": (DeliverPolicy.BY_START_SEQUENCE.value, _value(have.deliver_policy)),
            "ack_policy": (AckPolicy.NONE.value, _value(have.ack_policy)),
            "durable_name": (self.durable, have.durable_name),
            "deliver_subject": (None, have.deliver_subject or None),
            # (a durable told to deliver headers only gives every message empty: read as malformed, dead-lettered
            # and passed by; one paused delivers nothing; one replaying at the original pace, the stream's history
            # at the speed it was written)
            "headers_only": (False, bool(have.headers_only)),
            "pause_until": (None, have.pause_until or None),
            "replay_policy": (ReplayPolicy.INSTANT.value, _value(have.replay_policy or ReplayPolicy.INSTANT)),
        }
        if self._created is not None:
            checks["created"] = (self._created, info.created)
        return {k: v for k, v in checks.items() if v[0] != v[1]}

    async def _check(self) -> str:
        """Compare the durable with what this consumer created; the reason to re-create it, or "" when it is as
        created."""
        self._next_check = asyncio.get_running_loop().time() + self.check_interval
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            return "consumer vanished"
        made = self._as_created
        differences = {k: v for k, v in self.differences(info).items() if made.get(k) != v}
        return self._changed(differences) if differences else ""

    def _changed(self, differences: dict[str, tuple[object, object]]) -> str:
        """Another client changed the durable (``differences``: field → (expected, found)): note and log it; the
        reason to re-create it."""
        self.repairs += 1
        self.last_differences = differences
        log.error(
            "consumer changed by another client, re-creating it",
            stream=self.stream,
            consumer=self.durable,
            differences=_printable(differences),
            next_seq=self.next_seq,
        )
        return "configuration changed: " + ", ".join(sorted(differences))

    async def nothing_pending(self) -> bool:
        """Whether the server has nothing left for this consumer that it has not read: none pending
        (``num_pending``) and none delivered past what it has read (False when the server does not answer). An
        empty batch does not say so: a fetch that timed out may be asyncio's, the server answering later than
        ``idle`` (a loaded server), with messages still pending or delivered into the subscription's queue (no acks:
        a message the server sent is no longer pending)."""
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except (*TRANSIENT, nats.js.errors.APIError):
            return False
        pending: int = info.num_pending or 0
        delivered: int = (info.delivered.stream_seq or 0) if info.delivered is not None else 0
        return pending == 0 and delivered < self.next_seq

    async def _consumer_exists(self) -> bool:
        try:
            await self.bus.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def batches_or_holdups(self, held_up: float) -> AsyncGenerator[list[Msg] | None, None]:
        """:meth:`batches`, and None whenever none has come for ``idle + held_up`` seconds: :meth:`batches` yields at
        least every ``idle`` seconds, but not while a JetStream call waits for an answer (a loaded server answers one
        late, up to the call's timeout). A reader that runs timers between batches runs them at a None too. Closing
        this generator closes :meth:`batches` (a call it waits in is cancelled)."""
        batches = self.batches()
        coming: asyncio.Task[list[Msg] | None] | None = None

        async def following() -> list[Msg] | None:
            return await anext(batches, None)

        try:
            while True:
                if coming is None:
                    coming = asyncio.create_task(following(), name=f"next-batch-{self.durable}")
                done, _ = await asyncio.wait({coming}, timeout=self.idle + held_up)
                if not done:
                    yield None
                    continue
                batch, coming = coming.result(), None
                if batch is None:
                    return
                yield batch
        finally:
            if coming is not None:
                coming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await coming
            await batches.aclose()

    async def batches(self) -> AsyncGenerator[list[Msg], None]:
        why = "start"
        attempt = 0
        while True:
            try:
                if why:
                    await self._recreate(why)
                    why = ""
                if self.bus.epoch != self._epoch:
                    why = "reconnected"
                    continue
                if self._checking is not None and self._checking.done():
                    why = self._checked_beside()
                    if why:
                        continue
                if asyncio.get_running_loop().time() >= self._next_check:
                    why = await self._check()
                    if why:
                        continue
                self._check_beside()
                assert self._sub is not None
                try:
                    # One message first: nats-py's fetch(n) holds a long-poll open until n messages or the
                    # deadline, so a lone message would wait out ``idle``; then what is already pending, at once.
                    msgs = await self._sub.fetch(1, timeout=self.idle)
                    backlog = min(position(msgs[-1]).pending, self.batch - 1)
                    if backlog > 0:
                        with contextlib.suppress(TimeoutError):  # the backlog may have been purged meanwhile
                            msgs += await self._sub.fetch(backlog, timeout=self.idle)
                except TimeoutError:  # nats.errors.TimeoutError, or asyncio's when the fetch deadline runs out first
                    self.failing = False
                    self._idle_fetches += 1
                    if self._idle_fetches % 5 == 0 and not await self._consumer_exists():
                        why = "consumer vanished"
                        continue
                    yield []
                    continue
            except (*TRANSIENT, nats.js.errors.APIError) as e:
                log.warning("consumer error, re-creating", consumer=self.durable, error=str(e) or type(e).__name__)
                why = f"error: {type(e).__name__}"
                self.failing = True
                await asyncio.sleep(CALL_BACKOFF.delay(attempt))
                attempt += 1
                yield []  # the reader runs its timers and sees a stop while the stream is unavailable
                continue
            self.failing = False
            attempt = 0
            self._idle_fetches = 0
            good: list[Msg] = []
            checked = bodiless = False
            for m in msgs:
                at = position(m)
                if at.consumer != self._expected_cseq or at.stream < self.next_seq:
                    why = f"gap: consumer sequence {at.consumer}, expected {self._expected_cseq}"
                    break
                if not m.data and m.headers and HEADERS_ONLY in m.headers and not bodiless:
                    # (once a batch: the durable may have been changed to deliver headers only since it was
                    # checked; if the server says so, this message is read again, whole, from a durable as created,
                    # rather than passed by as malformed; a publisher may have set the header, and then it is one)
                    bodiless = True
                    try:
                        why = await self._check()
                    except (*TRANSIENT, nats.js.errors.APIError) as e:
                        why = f"error: {type(e).__name__}"
                    if why:
                        break
                if at.stream > self.next_seq:
                    # (a jump: what it passed over, it passed over as created, not by a filter another client
                    # narrowed since the last check: a check beside the reading finds that out, and the durable is
                    # then re-created from here)
                    if self._unchecked_from is None:
                        self._unchecked_from = self.next_seq
                    if self.note_losses and not checked:
                        checked = True  # (once a batch: what it delivered, the stream held)
                        try:
                            await self._note_loss()
                        except (*TRANSIENT, nats.js.errors.APIError) as e:
                            why = f"error: {type(e).__name__}"  # (read again from here, and checked on creation)
                            log.warning("stream not read", consumer=self.durable, error=str(e) or type(e).__name__)
                            break
                self._expected_cseq += 1
                self.next_seq = at.stream + 1
                self.pending = at.pending
                self.drained = at.pending == 0
                good.append(m)
            self._check_beside()
            if good:
                yield good

    async def close(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
            self._checking = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as e:  # closing after the connection went away
                log.debug("unsubscribe failed", error=str(e))
            self._sub = None
