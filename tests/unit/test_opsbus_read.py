"""How a command's read of a stream ends (``services.cli.opsbus.messages``), against a stand-in JetStream whose
timing the test sets: never at a quiet second while messages are still on their way."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.msg import Msg

from services.cli import opsbus
from services.platform.bus import position


def _msg(seq: int, pending: int, subject: str = "vmquota.ev.c1.ns.t") -> Msg:
    reply = f"$JS.ACK.S.C.1.{seq}.{seq}.1700000000000000000.{pending}"
    return Msg(_client=None, subject=subject, reply=reply, data=b"x")  # type: ignore[arg-type]


class _Sub:
    async def unsubscribe(self) -> None:
        return None


class _JetStream:
    """A stream of three messages whose consumer delivers ``first`` at once and the rest when the reader asks the
    stream's state again (a server that stalled, and answers then: its messages before its answer)."""

    def __init__(self, first: list[Msg], rest: list[Msg]) -> None:
        self.first, self.rest, self.asked = first, rest, 0
        self.cb: Any = None

    held = 3
    """What the stream holds on the subject read, by its count."""
    stored: tuple[int, ...] = (1, 2, 3)
    """The sequences of the messages it holds."""
    at_the_time = 1
    """The first sequence stored at the time a read from a time asks for."""
    per_subject = -1
    """How many messages it keeps per subject (-1: no limit)."""
    subjects: dict[str, int] | None = None
    """What it holds per subject, when not :attr:`held` on one."""

    async def stream_info(self, stream: str, subjects_filter: str | None = None) -> Any:
        self.asked += 1
        if self.asked > 1:
            for m in self.rest:
                await self.cb(m)
        subjects = self.subjects or ({"vmquota.ev.c1.ns.t": self.held} if self.held else {})
        return SimpleNamespace(
            state=SimpleNamespace(messages=3, last_seq=3, subjects=subjects),
            config=SimpleNamespace(max_msgs_per_subject=self.per_subject),
        )

    async def subscribe(self, subject: str, **kw: Any) -> _Sub:
        self.cb = kw["cb"]
        for m in self.first:
            asyncio.get_running_loop().create_task(self.cb(m))
        return _Sub()


class _Connection:
    is_closed = False
    last_error = None

    def __init__(self, js: _JetStream) -> None:
        self.js = js

    def jetstream(self) -> _JetStream:
        return self.js

    async def request(self, subject: str, data: bytes, **kw: Any) -> Any:
        """A message get: the first stored at the sequence asked or after, or by start time at the stream's
        :attr:`_JetStream.at_the_time` or after."""
        ask = json.loads(data)
        assert subject == "$JS.API.STREAM.MSG.GET.S" and ask["next_by_subj"] == "vmquota.ev.>"
        from_seq = self.js.at_the_time if "start_time" in ask else ask["seq"]
        found = [seq for seq in self.js.stored if seq >= from_seq]
        answer = {"message": {"seq": found[0]}} if found else {"error": {"code": 404, "err_code": 10037}}
        return SimpleNamespace(data=json.dumps(answer).encode())


async def _read(js: _JetStream, since: datetime | None = None) -> list[int]:
    return [position(m).stream async for m in opsbus.messages(_Connection(js), "S", "vmquota.ev.>", since=since)]


async def test_messages_that_come_while_the_server_is_asked_are_read() -> None:
    """Nothing came in the first second; the server was asked whether it still answers, and sent the messages before
    its answer: they were dropped, and the read ended as if the subject held nothing."""
    assert await _read(_JetStream([], [_msg(1, 2), _msg(2, 1), _msg(3, 0)])) == [1, 2, 3]


async def test_a_read_waits_for_what_the_last_message_said_was_to_come() -> None:
    """The first message said two more were to come, then a quiet second: the read waits for them (a stall), it does
    not end there."""

    class Late(_JetStream):
        async def subscribe(self, subject: str, **kw: Any) -> _Sub:
            sub = await super().subscribe(subject, **kw)
            loop = asyncio.get_running_loop()
            loop.call_later(1.5, lambda: [loop.create_task(self.cb(m)) for m in (_msg(2, 1), _msg(3, 0))])
            return sub

    assert await _read(Late([_msg(1, 2)], [])) == [1, 2, 3]


async def test_a_slow_first_message_is_waited_for_and_a_subject_that_holds_none_ends_the_read() -> None:
    """Nothing came in the first second, and the stream answered at once: the read ended empty, as if complete,
    where the server was only slow to send (a loaded server, a cold volume). It ends so only where the stream holds
    nothing on the subject."""

    class SlowFirst(_JetStream):
        async def subscribe(self, subject: str, **kw: Any) -> _Sub:
            sub = await super().subscribe(subject, **kw)
            loop = asyncio.get_running_loop()
            loop.call_later(1.5, lambda: [loop.create_task(self.cb(m)) for m in (_msg(1, 2), _msg(2, 1), _msg(3, 0))])
            return sub

    assert await _read(SlowFirst([], [])) == [1, 2, 3]
    assert await _read(SlowFirst([], []), since=datetime(2026, 1, 1, tzinfo=UTC)) == [1, 2, 3]  # (tail --since)
    empty = _JetStream([], [])
    empty.held = 0
    assert await _read(empty) == []


async def test_a_read_whose_messages_to_come_expired_before_they_were_sent_ends_with_what_it_read() -> None:
    """The first message said two more were to come; they expired (the stream's age limit) before the server sent
    them. The read waited 30 s for them, then said the server had stopped sending, with messages left."""
    gone = _JetStream([_msg(1, 2)], [])
    gone.stored = (1,)
    assert await _read(gone) == [1]


def _later(js: _JetStream, seconds: float, msgs: list[Msg]) -> None:
    loop = asyncio.get_running_loop()
    loop.call_later(seconds, lambda: [loop.create_task(js.cb(m)) for m in msgs])


async def test_messages_that_replace_others_during_a_read_of_a_per_subject_stream_are_read() -> None:
    """``VMQUOTA_USAGE`` keeps one message per subject. Of the three a read began with, the second and third were
    replaced (4 and 5) before they were sent: the read ended at the first replacement, the stream's last sequence
    when it began, and so showed nothing of the third namespace."""

    class Replaced(_JetStream):
        async def subscribe(self, subject: str, **kw: Any) -> _Sub:
            sub = await super().subscribe(subject, **kw)
            _later(self, 1.5, [_msg(4, 1), _msg(5, 0)])
            return sub

    js = Replaced([_msg(1, 2)], [])
    js.stored, js.per_subject = (1, 4, 5), 1
    assert await _read(js) == [1, 4, 5]


async def test_a_message_that_comes_while_the_server_is_asked_for_the_rest_is_read() -> None:
    """A quiet second's lookup of what is still stored: a message that came while the server was asked, and expired
    before it answered, was dropped with the read's end."""

    class Asked(_Connection):
        async def request(self, subject: str, data: bytes, **kw: Any) -> Any:
            if self.js.stored:
                await self.js.cb(_msg(2, 1))  # (delivered while the lookup is under way)
                self.js.stored = ()  # (2 and 3 expired before the server answered)
            return await super().request(subject, data, **kw)

    js = _JetStream([_msg(1, 2)], [])
    assert [position(m).stream async for m in opsbus.messages(Asked(js), "S", "vmquota.ev.>")] == [1, 2]


async def test_a_read_from_a_time_shows_nothing_before_it_when_its_consumer_starts_again_from_the_first() -> None:
    """An ordered consumer that resets before it delivered anything (a lost consumer, missed heartbeats) is made again
    from sequence 1 by the client library: a ``tail --since`` then showed the stream's whole history before the time
    it was asked from."""
    js = _JetStream([_msg(1, 2), _msg(2, 1), _msg(3, 0)], [])
    js.at_the_time = 3
    assert await _read(js, since=datetime(2026, 1, 1, tzinfo=UTC)) == [3]


async def test_a_read_of_a_per_subject_stream_a_faster_publisher_keeps_replacing_ends() -> None:
    """Each message of a stream that keeps one per subject was replaced before it was sent (a publisher faster than
    the reader), so every message said one more was to come: the read ended only where the reader caught up. It
    ends once it has read as many again as the stream held when it began (three: to sequence 6)."""

    class Replacing(_JetStream):
        async def subscribe(self, subject: str, **kw: Any) -> _Sub:
            sub = await super().subscribe(subject, **kw)
            _later(self, 0.0, [_msg(seq, 1) for seq in range(1, 40)])
            return sub

    js = Replacing([], [])
    js.stored, js.per_subject = tuple(range(1, 40)), 1
    assert await _read(js) == [1, 2, 3, 4, 5, 6]


async def test_a_read_that_ends_past_a_faster_publisher_says_what_it_could_not_show() -> None:
    """A, B and C at 1 to 3 of a stream that keeps one per subject; while the reader held 1 and 2, A was published
    again at 4 to 7 and C at 8, so C's 3 was gone before it was sent. The read ended at 7, as many past the stream's
    last as it held, without C's only message, and `status` left a namespace out without a word."""

    def at(seq: int, pending: int, ns: str) -> Msg:
        return _msg(seq, pending, f"vmquota.usage.c1.{ns}")

    class Replacing(_JetStream):
        async def subscribe(self, subject: str, **kw: Any) -> _Sub:
            sub = await super().subscribe(subject, **kw)
            _later(self, 0.0, [at(1, 2, "a"), at(2, 2, "b"), at(7, 1, "a"), at(8, 0, "c")])
            return sub

    js = Replacing([], [])
    js.stored, js.per_subject = (2, 7, 8), 1
    js.subjects = {"vmquota.usage.c1.a": 1, "vmquota.usage.c1.b": 1, "vmquota.usage.c1.c": 1}
    got: list[int] = []
    with pytest.raises(opsbus.BusUnavailable, match=r"faster than they were read: 1 subject\(s\) not shown"):
        async for m in opsbus.messages(_Connection(js), "S", "vmquota.ev.>"):
            got.append(position(m).stream)
    assert got == [1, 2, 7]
