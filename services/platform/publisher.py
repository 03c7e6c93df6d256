"""Ordered JetStream publishing with a bounded window of acks in flight: the one way the services publish many
messages (the watcher its events, the ledger its usage snapshots, :func:`publish_all` a finite batch).

``enqueue`` is synchronous: it fixes the message's place in the publication order before the caller awaits
anything, so a task that sees the producer's bookkeeping updated knows the message is queued. ``room()`` applies
back-pressure (waits while the queue is full). A sender task publishes the queue in order with at most ``window``
messages awaiting their JetStream ack; acks arrive on one inbox subscription and are matched by sequence number.
(This is what nats-py's ``publish_async`` does, without its per-message task and timer: about three times
cheaper, and the watcher publishes every object of a cluster on each start.)

A message whose ack reports an error, or does not come within ``ack_timeout``, is published again on its own with
``Bus.publish`` (which retries while JetStream is unavailable; a ``Nats-Msg-Id`` makes a repeat a no-op on the
server). ``flush()`` returns once everything enqueued before it is stored: the watcher calls it before a sync
marker, so a marker is never stored ahead of the events it speaks for; the ledger before it remembers a usage as
published.

While NATS is away the republishing goes on with backoff (``room()`` and ``flush()`` then hold the producers
back, and they go on once it is back); only an error that retrying cannot cure fails the publisher — among them
no stream storing the subject for ``no_stream_after`` seconds (a stream deleted, or lost with a server's memory
storage: the service restarts and waits for the ledger to create it again; the ledger creates it at its start) —:
``failed`` is set, every waiter raises :class:`PublisherFailed`, and the service stops rather than lose messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.platform.bus import TRANSIENT, Bus
from shared.backoff import Backoff

log = structlog.get_logger("vmquota.publisher")

_REPUBLISH_BACKOFF: Final = Backoff(initial=1.0, maximum=30.0, jitter=0.2)


@dataclass(frozen=True, slots=True)
class Item:
    subject: str
    data: bytes
    msg_id: str | None
    headers: dict[str, str] | None = None
    label: str = ""
    """For the ``on_stored`` callback (the watcher passes the kind and event type)."""


class _Ack(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, object] | None = None


_ACK_DECODER: Final = msgspec.json.Decoder(_Ack)
_NEVER: Final = 1 << 62


class PublisherFailed(RuntimeError):
    pass


class Publisher:
    def __init__(
        self,
        bus: Bus,
        *,
        window: int = 1000,
        queue_limit: int | None = None,
        ack_timeout: float = 10.0,
        on_stored: Callable[[Item, bool], None] | None = None,
        no_stream_after: float = 60.0,
    ) -> None:
        """``on_stored(item, duplicate)`` is called once per message when the server has it. ``no_stream_after``:
        seconds a message is republished while no stream stores its subject before the publisher fails."""
        if window < 1 or ack_timeout <= 0:
            raise ValueError("window and ack timeout must be positive")
        self.bus = bus
        self.window = window
        self.queue_limit = queue_limit if queue_limit is not None else 2 * window
        self.ack_timeout = ack_timeout
        self.on_stored = on_stored
        self.no_stream_after = no_stream_after
        self._queue: deque[tuple[int, Item]] = deque()
        self._outstanding: dict[int, tuple[Item, float, int]] = {}
        """order → (item, when sent, the connection's epoch then), in sending order (the oldest first)."""
        self._retrying: dict[int, Item] = {}
        self._retry_tasks: set[asyncio.Task[None]] = set()
        self.enqueued = 0
        """Messages enqueued; also the order number of the last one."""
        self.dropped = 0
        """Messages larger than the server takes, dropped (:meth:`_drop`)."""
        self.failed: BaseException | None = None
        self._queue_ready = asyncio.Event()
        self._window_open = asyncio.Event()
        self._changed = asyncio.Event()
        self._prefix = ""
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._send(), name="publisher-send"),
                asyncio.create_task(self._expire(), name="publisher-expire"),
            ]

    async def close(self) -> None:
        """Stop (queued and unacknowledged messages are dropped: call ``flush`` first to keep them)."""
        tasks = [*self._tasks, *self._retry_tasks]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        self._retry_tasks.clear()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    # ---- the producer's side ---------------------------------------------------------------------------------
    @property
    def max_payload(self) -> int:
        """The largest message the server takes (bytes, headers included)."""
        return self.bus.max_payload

    def enqueue(self, item: Item) -> None:
        self._check()
        self.enqueued += 1
        self._queue.append((self.enqueued, item))
        self._queue_ready.set()

    async def room(self) -> None:
        """Wait while the queue holds ``queue_limit`` messages or more."""
        while len(self._queue) >= self.queue_limit:
            self._check()
            self._changed.clear()
            await self._changed.wait()
        self._check()

    async def flush(self) -> None:
        """Wait until every message enqueued so far is stored."""
        target = self.enqueued
        while self._lowest_unsettled() <= target:
            self._check()
            self._changed.clear()
            await self._changed.wait()
        self._check()

    def _lowest_unsettled(self) -> int:
        low = _NEVER
        if self._outstanding:
            low = next(iter(self._outstanding))  # sent in order, so the oldest entry has the lowest number
        if self._retrying:
            low = min(low, min(self._retrying))
        if self._queue:
            low = min(low, self._queue[0][0])
        return low

    def _check(self) -> None:
        if self.failed is not None:
            raise PublisherFailed(f"publishing failed: {self.failed}") from self.failed

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = e
        self._changed.set()

    # ---- sending ---------------------------------------------------------------------------------------------
    async def _send(self) -> None:
        nc = self.bus.nc
        loop = asyncio.get_running_loop()
        try:
            self._prefix = nc.new_inbox() + "."
            self._sub = await nc.subscribe(self._prefix + "*", cb=self._on_ack)
            queue, outstanding = self._queue, self._outstanding
            while True:
                while not queue:
                    self._queue_ready.clear()
                    await self._queue_ready.wait()
                while len(outstanding) >= self.window:
                    self._window_open.clear()
                    await self._window_open.wait()
                order, item = queue.popleft()
                outstanding[order] = (item, loop.time(), self.bus.epoch)
                headers = item.headers
                if item.msg_id is not None:
                    mid = self.bus.keyed(item.msg_id)
                    headers = {**headers, "Nats-Msg-Id": mid} if headers else {"Nats-Msg-Id": mid}
                try:
                    await nc.publish(item.subject, item.data, reply=f"{self._prefix}{order}", headers=headers)
                except (*TRANSIENT, nats.errors.ConnectionDrainingError):
                    if outstanding.pop(order, None) is not None:
                        self._retry(order, item)
                except nats.errors.MaxPayloadError as e:
                    outstanding.pop(order, None)
                    self._drop(item, e)
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a closed connection or a bug: stop visibly
            self._fail(e)

    async def _on_ack(self, msg: Msg) -> None:
        try:
            order = int(msg.subject[len(self._prefix) :])
        except ValueError:
            return
        entry = self._outstanding.pop(order, None)
        if entry is None:
            return  # answered after it timed out: the republish settles it
        item = entry[0]
        if msg.headers and msg.headers.get("Status") == "503":
            self._retry(order, item)  # no responders: JetStream is not (yet) there
            return
        try:
            ack = _ACK_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            ack = _Ack(error={"description": "unreadable ack"})
        if ack.error is not None:
            self._retry(order, item)
            return
        self._settle(item, ack.duplicate)

    def _drop(self, item: Item, e: Exception) -> None:
        """A message larger than the server takes: no retry stores it, and it must not stop the others (the
        services check what they send; a dead letter quoting a tenant's megabyte once did not). Logged, counted,
        and settled unstored."""
        self.dropped += 1
        log.error(
            "message larger than the server takes: dropped",
            subject=item.subject,
            bytes=len(item.data),
            label=item.label,
            error=str(e) or type(e).__name__,
        )
        self._moved()

    def _settle(self, item: Item, duplicate: bool) -> None:
        if self.on_stored is not None:
            self.on_stored(item, duplicate)
        self._moved()

    def _moved(self) -> None:
        """A message left the window: wake the sender (room in it) and the producers (``room``, ``flush``)."""
        if len(self._outstanding) < self.window:
            self._window_open.set()
        self._changed.set()

    # ---- failures --------------------------------------------------------------------------------------------
    def _retry(self, order: int, item: Item) -> None:
        self._retrying[order] = item
        task = asyncio.create_task(self._republish(order, item), name="publisher-retry")
        self._retry_tasks.add(task)
        task.add_done_callback(self._retry_tasks.discard)
        if len(self._outstanding) < self.window:
            self._window_open.set()

    async def _republish(self, order: int, item: Item) -> None:
        attempt = 0
        while True:
            try:
                ack = await self.bus.publish(
                    item.subject, item.data, msg_id=item.msg_id, headers=item.headers, deadline=self.no_stream_after
                )
                break
            except asyncio.CancelledError:
                raise
            except nats.js.errors.NoStreamResponseError as e:
                # JetStream answers, but no stream stores the subject (deleted, or lost with a server's memory
                # storage): waiting here does not bring it back. Fail: the service stops, and when it starts again
                # it waits for the ledger, which keeps the streams, to create it.
                log.error("no stream stores the subject; publishing stops", subject=item.subject, error=str(e))
                self._fail(e)
                return
            except nats.errors.MaxPayloadError as e:
                self._retrying.pop(order, None)
                self._drop(item, e)
                return
            except TRANSIENT as e:  # NATS is away longer than Bus.publish's deadline: keep trying
                log.warning("publish still failing, retrying", subject=item.subject, error=str(e) or type(e).__name__)
                await asyncio.sleep(_REPUBLISH_BACKOFF.delay(attempt))
                attempt += 1
            except Exception as e:
                self._fail(e)
                return
        self._retrying.pop(order, None)
        self._settle(item, bool(ack.duplicate))

    async def _expire(self) -> None:
        """Publish again the messages whose ack did not come in time, or that were sent before a reconnect (their
        acks went to a subscription the server may not have had yet)."""
        loop = asyncio.get_running_loop()
        period = min(0.25, self.ack_timeout / 4)
        while True:
            await asyncio.sleep(period)
            cutoff = loop.time() - self.ack_timeout
            epoch = self.bus.epoch
            late = []
            for order, (item, sent, sent_epoch) in self._outstanding.items():
                if sent > cutoff and sent_epoch == epoch:
                    break
                late.append((order, item))
            for order, item in late:
                del self._outstanding[order]
                self._retry(order, item)


async def publish_all(
    bus: Bus, items: Iterable[tuple[str, bytes, str | None]], *, window: int = 1000, ack_timeout: float = 10.0
) -> tuple[int, int]:
    """Publish ``(subject, data, msg_id)`` items in order with up to ``window`` acks in flight and wait until every
    one is stored. Returns (stored, duplicates)."""
    counts = [0, 0]

    def stored(_: Item, duplicate: bool) -> None:
        counts[1 if duplicate else 0] += 1

    publisher = Publisher(bus, window=window, ack_timeout=ack_timeout, on_stored=stored)
    publisher.start()
    try:
        for subject, data, msg_id in items:
            await publisher.room()
            publisher.enqueue(Item(subject, data, msg_id))
        await publisher.flush()
    finally:
        await publisher.close()
    return counts[0], counts[1]
