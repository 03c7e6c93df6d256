"""Ordered JetStream publishing with a bounded window of acks in flight.

``enqueue`` is synchronous: it fixes the message's place in the publication order before the caller awaits
anything, so a task that sees the watcher's bookkeeping updated knows the message is queued. ``room()`` applies
back-pressure (waits while the queue is full). A sender task hands the queue to ``publish_async`` with at most
``window`` acks outstanding; a settler awaits the acks in order. A message whose ack fails or does not come in
``ack_timeout`` is published again on its own (``Bus.publish`` retries; the ``Nats-Msg-Id`` makes a repeat a
no-op on the server). ``flush()`` returns once everything enqueued before it is stored: the watcher calls it
before a sync marker, so a marker is never stored ahead of the events it speaks for.

A message that cannot be stored within ``Bus.publish``'s deadline fails the publisher: ``failed`` is set and every
waiter raises, and the service stops rather than lose events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import PubAck

from services.bus import TRANSIENT, Bus


@dataclass(frozen=True, slots=True)
class Item:
    subject: str
    data: bytes
    msg_id: str | None
    headers: dict[str, str] | None = None
    label: str = ""
    """For the ack callback (the watcher passes the kind and event type)."""


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
    ) -> None:
        """``on_stored(item, duplicate)`` is called once per message when the server has it."""
        if window < 1:
            raise ValueError("window must be at least 1")
        self.bus = bus
        self.window = window
        self.queue_limit = queue_limit if queue_limit is not None else 2 * window
        self.ack_timeout = ack_timeout
        self.on_stored = on_stored
        self._queue: deque[Item] = deque()
        self._inflight: deque[tuple[asyncio.Future[PubAck], Item]] = deque()
        self.enqueued = 0
        self.settled = 0
        self.stored = 0
        self.duplicates = 0
        self.republished = 0
        self.failed: BaseException | None = None
        self._queue_ready = asyncio.Event()
        self._inflight_ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(window)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._send(), name="publisher-send"),
                asyncio.create_task(self._settle(), name="publisher-settle"),
            ]

    async def close(self) -> None:
        """Stop sending (queued messages are dropped: call ``flush`` first to keep them)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        for fut, _ in self._inflight:
            fut.cancel()
        self._inflight.clear()

    @property
    def backlog(self) -> int:
        """Enqueued and not yet stored."""
        return self.enqueued - self.settled

    def enqueue(self, item: Item) -> None:
        self._check()
        self._queue.append(item)
        self.enqueued += 1
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
        while self.settled < target:
            self._check()
            self._changed.clear()
            await self._changed.wait()
        self._check()

    def _check(self) -> None:
        if self.failed is not None:
            raise PublisherFailed(f"publishing failed: {self.failed}") from self.failed

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        self._changed.set()

    async def _send(self) -> None:
        js = self.bus.js
        try:
            while True:
                while not self._queue:
                    self._queue_ready.clear()
                    await self._queue_ready.wait()
                item = self._queue.popleft()
                self._changed.set()
                await self._slots.acquire()
                try:
                    fut = await js.publish_async(item.subject, item.data, headers=self._headers(item), wait_stall=30.0)
                except (*TRANSIENT, nats.js.errors.TooManyStalledMsgsError):
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(nats.errors.TimeoutError())
                self._inflight.append((fut, item))
                self._inflight_ready.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # anything else is a bug or a closed connection: stop visibly
            self._fail(e)

    async def _settle(self) -> None:
        try:
            while True:
                while not self._inflight:
                    self._inflight_ready.clear()
                    await self._inflight_ready.wait()
                fut, item = self._inflight[0]
                try:
                    ack = await asyncio.wait_for(asyncio.shield(fut), self.ack_timeout)
                except (*TRANSIENT, nats.js.errors.APIError, asyncio.CancelledError) as e:
                    if isinstance(e, asyncio.CancelledError) and not fut.cancelled():
                        raise
                    fut.cancel()  # releases nats-py's own pending slot
                    self.republished += 1
                    ack = await self.bus.publish(item.subject, item.data, msg_id=item.msg_id, headers=item.headers)
                self._inflight.popleft()
                self._slots.release()
                self.settled += 1
                if ack.duplicate:
                    self.duplicates += 1
                else:
                    self.stored += 1
                if self.on_stored is not None:
                    self.on_stored(item, bool(ack.duplicate))
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(e)

    @staticmethod
    def _headers(item: Item) -> dict[str, str] | None:
        if item.msg_id is None:
            return item.headers
        h = dict(item.headers) if item.headers else {}
        h["Nats-Msg-Id"] = item.msg_id
        return h
