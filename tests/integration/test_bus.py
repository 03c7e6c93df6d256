"""The bus helpers against a real nats-server: streams, dedupe, the consumer across a server restart, DLQ."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.platform import runner
from services.platform.bus import Bus, NatsOptions
from services.platform.consumer import HEADERS_ONLY, PullConsumer
from services.platform.publisher import Item, Publisher, PublisherFailed, publish_all
from shared import contract
from shared.snapshot import PodSnapshot
from tests.conftest import NatsServer

pytestmark = pytest.mark.integration


async def _connect(url: str) -> Bus:
    return await Bus.connect(NatsOptions(url=url, name="test"), connect_timeout=10)


async def test_ensure_streams_is_idempotent_and_updates_limits(nats_url: str) -> None:
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams(events_max_age=3600.0))
        first = await b.js.stream_info(contract.EVENTS_STREAM)
        await b.ensure_streams(contract.streams(events_max_age=3600.0))
        again = await b.js.stream_info(contract.EVENTS_STREAM)
        assert again.state.messages == first.state.messages
        assert again.config.max_age == first.config.max_age == 3600.0
        await b.js.publish("vmquota.ev.c1.ns.pod", b"{}")
        await b.ensure_streams(contract.streams(events_max_age=7200.0))
        updated = await b.js.stream_info(contract.EVENTS_STREAM)
        assert updated.config.max_age == 7200.0
        assert updated.state.messages == 1, "updating limits keeps what is stored"
        names = {s.config.name for s in await b.js.streams_info()}
        assert {contract.EVENTS_STREAM, contract.USAGE_STREAM, contract.DECISIONS_STREAM, contract.DLQ_STREAM} <= names
        usage = await b.js.stream_info(contract.USAGE_STREAM)
        assert usage.config.max_msgs_per_subject == 1
        kv1 = await b.ensure_kv(contract.LEDGER_BUCKET)
        await kv1.put("k", b"v")
        kv2 = await b.ensure_kv(contract.LEDGER_BUCKET)
        assert (await kv2.get("k")).value == b"v"
    finally:
        await b.close()


async def test_a_service_waiting_for_a_stream_says_so_at_once_and_warns_only_when_it_takes_long(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Services started together wait for the ledger a moment, which is no trouble: the first line is information;
    a warning, with what to check, follows only once the wait has lasted ``WAIT_WARN_AFTER`` (10 s)."""
    from structlog.testing import capture_logs

    from services.platform import bus as bus_module
    from tests.waiting import wait_until

    monkeypatch.setattr(bus_module, "WAIT_WARN_AFTER", 1.0)
    b = await _connect(nats_url)
    try:
        with capture_logs() as logs:
            waiting = asyncio.create_task(b.wait_for_streams(["VMQUOTA_LATE"]))
            await wait_until(lambda: any(e["log_level"] == "warning" for e in logs), what="the warning")
            said = [e for e in logs if e["event"] == "waiting for a stream"]
            assert [e["log_level"] for e in said] == ["info", "warning"], said
            assert said[0]["waited_s"] < 1.0 <= said[1]["waited_s"] and "is the ledger running?" in said[1]["why"]
            await b.js.add_stream(name="VMQUOTA_LATE", subjects=["vmquota-late.>"])
            await asyncio.wait_for(waiting, 10)
            assert logs[-1]["event"] == "stream is there", logs[-1]
    finally:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await b.js.delete_stream("VMQUOTA_LATE")
        await b.close()


async def test_no_client_can_erase_a_streams_messages_and_changed_limits_are_put_back(nats_url: str) -> None:
    """A client that may update a stream (in the two-cluster layout, every cluster's watcher on the events stream)
    turned roll-ups on and erased every cluster's events with one ``Nats-Rollup: all`` header, or set ``max_msgs: 1``,
    which no start put back. The streams deny deleting and purging (which the server refuses to cancel, and roll-ups
    need), and each start puts other limits back."""
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await b.js.publish("vmquota.ev.c2.ns.pod", b"{}")
        cfg = (await b.js.stream_info(contract.EVENTS_STREAM)).config
        for changed in (
            dataclasses.replace(cfg, allow_rollup_hdrs=True),
            dataclasses.replace(cfg, deny_purge=False),
            dataclasses.replace(cfg, deny_delete=False),
        ):
            with pytest.raises(nats.js.errors.APIError):
                await b.js.update_stream(changed)
        with pytest.raises(nats.js.errors.APIError):
            await b.js.purge_stream(contract.EVENTS_STREAM)
        with pytest.raises(nats.js.errors.APIError):
            await b.js.delete_msg(contract.EVENTS_STREAM, 1)
        with pytest.raises(nats.js.errors.APIError):
            await b.js.publish("vmquota.ev.c1.ns.pod", b"{}", headers={"Nats-Rollup": "all"})
        await b.js.update_stream(dataclasses.replace(cfg, max_msgs=1, max_msg_size=64))
        await b.ensure_streams(contract.streams())
        again = (await b.js.stream_info(contract.EVENTS_STREAM)).config
        assert (again.max_msgs, again.max_msg_size) == (-1, -1), "put back at the next start"
        await b.js.publish("vmquota.ev.c1.ns.pod", b"{}")
        assert (await b.js.stream_info(contract.EVENTS_STREAM)).state.messages == 2, "nothing was erased"
        await b.js.update_stream(dataclasses.replace(again, sealed=True))
        await b.ensure_streams(contract.streams())  # (a sealed stream is reported, not retried for ever)
    finally:
        await b.close()


async def test_the_usage_history_keeps_every_snapshot_the_usage_stream_replaces(nats_url: str) -> None:
    """VMQUOTA_USAGE keeps the latest snapshot per namespace; the server copies each into VMQUOTA_USAGE_HISTORY
    (same subject), which keeps them all for its max age: nobody publishes twice."""
    from tests.waiting import wait_until

    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams(usage_history_max_age=3600.0))
        await b.ensure_streams(contract.streams(usage_history_max_age=3600.0))  # (idempotent with sources)
        subject = contract.usage_subject("c1", "tenant-a")
        for seq in (1, 2, 3):
            await b.publish(subject, f'{{"seq": {seq}}}'.encode())

            async def copied(n: int = seq) -> bool:  # (the server copies asynchronously)
                return (await b.js.stream_info(contract.USAGE_HISTORY_STREAM)).state.messages == n

            await wait_until(copied, what=f"the history to hold {seq} snapshot(s)")
        assert (await b.js.stream_info(contract.USAGE_STREAM)).state.messages == 1
        history = await b.js.stream_info(contract.USAGE_HISTORY_STREAM)
        assert history.config.max_age == 3600.0 and history.config.max_msgs_per_subject in (-1, 0)
        sub = await b.js.subscribe(subject, stream=contract.USAGE_HISTORY_STREAM, ordered_consumer=True)
        got = [(await sub.next_msg(timeout=5)).data for _ in range(3)]
        await sub.unsubscribe()
        assert got == [b'{"seq": 1}', b'{"seq": 2}', b'{"seq": 3}']
    finally:
        await b.close()


async def test_publish_with_msg_id_is_deduplicated_by_the_server(nats_url: str) -> None:
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        ev = contract.object_event(
            "upserted",
            cluster="c1",
            kind="Pod",
            namespace="ns",
            name="p",
            uid="u1",
            rv="5",
            snapshot=PodSnapshot(name="p"),
        )
        subject = contract.event_subject("c1", "Pod", "ns")
        a1 = await b.publish(subject, contract.encode(ev), msg_id=ev.id)
        a2 = await b.publish(subject, contract.encode(ev), msg_id=ev.id)
        assert not a1.duplicate and a2.duplicate and a2.seq == a1.seq
        items = [(subject, b"x", f"id-{i % 50}") for i in range(200)]
        stored, dups = await publish_all(b, items, window=64)
        assert (stored, dups) == (50, 150)
        info = await b.js.stream_info(contract.EVENTS_STREAM)
        assert info.state.messages == 51
    finally:
        await b.close()


async def _collect(consumer: PullConsumer, want: int, out: list[int], deadline: float = 20.0) -> None:
    async def run() -> None:
        async for batch in consumer.batches():
            out.extend(m.metadata.sequence.stream for m in batch)
            if len(out) >= want:
                return

    await asyncio.wait_for(run(), deadline)


async def test_consumer_reads_in_order_from_start_seq_with_filters(nats_url: str) -> None:
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [(f"vmquota.ev.c{i % 3}.ns.pod", b"x", None) for i in range(300)])
        c = PullConsumer(
            b,
            stream=contract.EVENTS_STREAM,
            durable="t1",
            filter_subjects=["vmquota.ev.c0.>", "vmquota.ev.c1.>"],
            start_seq=31,
            batch=50,
            idle=0.2,
        )
        seen: list[int] = []
        await _collect(c, 180, seen)
        expected = [s for s in range(31, 301) if (s - 1) % 3 != 2]
        assert seen == expected
        assert c.next_seq == 300 and c.pending == 0
        await c.close()
    finally:
        await b.close()


async def test_consumer_survives_a_server_restart(nats_server: NatsServer) -> None:
    b = await _connect(nats_server.url)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [("vmquota.ev.c1.ns.pod", b"x", f"a{i}") for i in range(100)])
        c = PullConsumer(
            b, stream=contract.EVENTS_STREAM, durable="t2", filter_subjects=["vmquota.ev.>"], batch=40, idle=0.2
        )
        seen: list[int] = []
        await _collect(c, 40, seen)
        assert seen == list(range(1, 41))

        await asyncio.to_thread(nats_server.restart)
        # After the restart the client reconnects by itself; messages published now must reach the consumer.
        await publish_all(b, [("vmquota.ev.c1.ns.pod", b"x", f"b{i}") for i in range(100)])
        await _collect(c, 200, seen, deadline=30.0)
        assert seen == list(range(1, 201)), "every message once, in order, across the restart"
        assert b.epoch >= 1
        assert c.recreations >= 2
        await c.close()
    finally:
        await b.close()


async def test_consumer_recreates_itself_when_deleted(nats_url: str) -> None:
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [("vmquota.ev.c1.ns.pod", b"x", None) for _ in range(10)])
        c = PullConsumer(
            b, stream=contract.EVENTS_STREAM, durable="t3", filter_subjects=["vmquota.ev.>"], batch=10, idle=0.1
        )
        seen: list[int] = []
        await _collect(c, 10, seen)
        await b.js.delete_consumer(contract.EVENTS_STREAM, "t3")
        await publish_all(b, [("vmquota.ev.c1.ns.pod", b"x", None) for _ in range(5)])
        await _collect(c, 15, seen)
        assert seen == list(range(1, 16))
        await c.close()
    finally:
        await b.close()


async def test_dead_letter_carries_the_original(nats_url: str) -> None:
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        stored = []
        for _ in range(2):  # the same original twice (a replay) is stored once, and said so (the count is not raised)
            stored.append(
                await b.publish_dead_letter(
                    "ledger",
                    "not a JSON event",
                    cluster="c1",
                    original_subject="vmquota.ev.c1.ns.pod",
                    stream=contract.EVENTS_STREAM,
                    stream_seq=7,
                    payload=b"\x00garbage",
                )
            )
        info = await b.js.stream_info(contract.DLQ_STREAM)
        assert info.state.messages == 1 and stored == [True, False]
        # (as long as the events stream drops a relisted event's repeat: past 2 minutes, a restart lettered it again)
        events = await b.js.stream_info(contract.EVENTS_STREAM)
        assert info.config.duplicate_window == events.config.duplicate_window == 600
        msg = await b.js.get_msg(contract.DLQ_STREAM, subject="vmquota.dlq.ledger.c1.ns", seq=None, direct=False)
        letter = contract.decode_dead_letter(msg.data or b"")
        assert letter.reason == "not a JSON event"
        assert (letter.original_subject, letter.stream_seq, letter.payload) == (
            "vmquota.ev.c1.ns.pod",
            7,
            b"\x00garbage",
        )
        assert msg.headers is not None and msg.headers["Vmquota-Reason"] == "not a JSON event"
    finally:
        await b.close()


async def test_a_dead_letter_whose_ack_was_lost_is_still_its_callers_to_count(nats_url: str) -> None:
    """The letter stored, its ack lost: the try again is answered as a repeat, and the letter was counted by no one
    (`vmquota_dlq_total` and its alert missed it). A repeat after a try of the call's own went unanswered is the
    call's letter; after a try refused outright (no responders: nothing stored), an earlier call's."""
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        real = b.js.publish
        calls = 0
        fail: type[Exception] | None = nats.errors.TimeoutError

        async def first_try_fails(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls, fail
            calls += 1
            if fail is nats.errors.NoRespondersError:
                fail = None
                raise nats.errors.NoRespondersError  # (refused before it was stored)
            ack = await real(*args, **kwargs)
            if fail is not None:
                fail = None
                raise nats.errors.TimeoutError  # (stored; the answer never came)
            return ack

        b.js.publish = first_try_fails  # type: ignore[method-assign]

        async def letter() -> bool:
            return await b.publish_dead_letter(
                "ledger", "bad", cluster="c1", original_subject="vmquota.ev.c1.ns.pod", stream="E", stream_seq=9
            )

        assert await letter()
        assert calls == 2 and (await b.js.stream_info(contract.DLQ_STREAM)).state.messages == 1
        assert not await letter(), "a repeat of a letter an earlier call stored"
        fail = nats.errors.NoRespondersError
        assert not await letter(), "refused outright, then a repeat: an earlier call's letter"
        assert fail is None and (await b.js.stream_info(contract.DLQ_STREAM)).state.messages == 1
    finally:
        await b.close()


async def test_an_ack_that_never_comes_is_published_again_not_awaited_forever(nats_url: str) -> None:
    """A connection lost between a publish and its ack leaves no ack to wait for: the publisher publishes the
    message again on its own after ``ack_timeout`` (the msg-id makes a repeat harmless) instead of hanging."""
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        real = b.nc.publish
        lost: list[str] = []

        async def first_lost(subject: str, *args: Any, **kwargs: Any) -> None:
            if not lost:  # the message is not even sent: its ack can never arrive
                lost.append(subject)
                return
            await real(subject, *args, **kwargs)

        b.nc.publish = first_lost  # type: ignore[method-assign]
        items = [("vmquota.ev.c1.ns.pod", b"x", f"lost-{i}") for i in range(3)]
        stored, dups = await asyncio.wait_for(publish_all(b, items, window=8, ack_timeout=0.2), 10)
        assert (stored, dups) == (3, 0)
        assert lost == ["vmquota.ev.c1.ns.pod"], "the first message was lost on the way"
        info = await b.js.stream_info(contract.EVENTS_STREAM)
        assert info.state.messages == 3
    finally:
        await b.close()


async def test_a_publisher_whose_stream_is_gone_fails_instead_of_waiting_forever(nats_url: str) -> None:
    """JetStream answers but no stream stores the subject (deleted, or lost with a memory-storage server): waiting
    does not bring it back. The publisher fails after ``no_stream_after`` seconds (the service then stops, and waits
    for the ledger to create the stream again when it starts) instead of republishing forever, and every waiter is
    told."""
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await b.js.delete_stream(contract.USAGE_STREAM)
        publisher = Publisher(b, window=4, no_stream_after=0.5)
        publisher.start()
        try:
            publisher.enqueue(Item(contract.usage_subject("c1", "ns"), b"{}", None))
            with pytest.raises(PublisherFailed, match="publishing failed"):
                await asyncio.wait_for(publisher.flush(), 10)
            assert isinstance(publisher.failed, nats.js.errors.NoStreamResponseError)
        finally:
            await publisher.close()
    finally:
        await b.close()


async def test_a_message_larger_than_the_server_takes_is_dropped_not_the_publisher(nats_url: str) -> None:
    """No retry stores a message larger than the server's max_payload: it is dropped and counted, and the
    messages after it are published. Before, it failed the publisher, and the service with it (a dead letter that
    quoted a tenant's megabyte stopped the watcher for every namespace)."""
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        publisher = Publisher(b, window=4)
        publisher.start()
        try:
            subject = contract.usage_subject("c1", "ns")
            publisher.enqueue(Item(subject, b"x" * (b.max_payload + 1), None))
            publisher.enqueue(Item(subject, b'{"after": 1}', None))
            await asyncio.wait_for(publisher.flush(), 10)
            assert publisher.failed is None and publisher.dropped == 1
            assert (await b.js.get_last_msg(contract.USAGE_STREAM, subject)).data == b'{"after": 1}'
        finally:
            await publisher.close()
    finally:
        await b.close()


async def until(condition: Callable[[], bool], within: float) -> None:
    """Poll ``condition`` (a reader task appends to a list) until it holds, for at most ``within`` seconds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 (the reader is a task of its own: nothing to wait on)
            await asyncio.sleep(0.02)


async def test_consumer_repairs_a_durable_tampered_with(nats_url: str) -> None:
    """Someone deletes the durable and re-creates it under the same name with a filter that matches nothing: the
    reader would wait forever. The consumer's periodic check finds the configuration it did not create and
    re-creates its durable from where it was, and messages flow again."""
    b = await Bus.connect(NatsOptions(url=nats_url, name="test", consumer_check=0.5), connect_timeout=10)
    other = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [("vmquota.ev.c1.ns.pod", b"x", None) for _ in range(5)])
        c = PullConsumer(
            b, stream=contract.EVENTS_STREAM, durable="t4", filter_subjects=["vmquota.ev.c1.>"], batch=10, idle=0.1
        )
        assert c.check_interval == 0.5
        seen: list[int] = []

        async def read() -> None:
            async for batch in c.batches():
                seen.extend(m.metadata.sequence.stream for m in batch)

        reader = asyncio.create_task(read())
        try:
            await until(lambda: len(seen) >= 5, 10)
            await other.js.delete_consumer(contract.EVENTS_STREAM, "t4")
            await other.js.add_consumer(
                contract.EVENTS_STREAM,
                ConsumerConfig(
                    name="t4",
                    durable_name="t4",
                    filter_subject="vmquota.ev.nothing.>",
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=6,
                    ack_policy=AckPolicy.NONE,
                    max_waiting=16,
                    inactive_threshold=3600.0,
                ),
            )
            await publish_all(other, [("vmquota.ev.c1.ns.pod", b"y", None) for _ in range(5)])
            await until(lambda: len(seen) >= 10, 5)  # well within ten check periods
        finally:
            await runner.cancel(reader)
        assert seen == list(range(1, 11)), "every message once, in order"
        assert c.repairs == 1
        assert "filter_subjects" in c.last_differences
        info = await other.js.consumer_info(contract.EVENTS_STREAM, "t4")
        assert info.config.filter_subject == "vmquota.ev.c1.>"
        await c.close()
    finally:
        await b.close()
        await other.close()


@contextlib.asynccontextmanager
async def reading(
    nats_url: str, durable: str, filters: list[str]
) -> AsyncIterator[tuple[PullConsumer, list[tuple[int, bytes]], Bus]]:
    """A consumer of the events stream read by a task of its own into a list of (stream sequence, data), whose
    durable is checked only when the test makes it (the periodic check an hour apart), and another client beside it
    (with the right to create consumers on the stream)."""
    b = await Bus.connect(NatsOptions(url=nats_url, name="test", consumer_check=3600), connect_timeout=10)
    other = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        c = PullConsumer(b, stream=contract.EVENTS_STREAM, durable=durable, filter_subjects=filters, batch=10, idle=0.1)
        seen: list[tuple[int, bytes]] = []

        async def read() -> None:
            async for batch in c.batches():
                seen.extend((m.metadata.sequence.stream, m.data) for m in batch)

        reader = asyncio.create_task(read())
        try:
            yield c, seen, other
        finally:
            await runner.cancel(reader)
            await c.close()
    finally:
        await b.close()
        await other.close()


async def test_a_durable_changed_to_deliver_headers_only_loses_no_message(nats_url: str) -> None:
    """Another client with the right to create consumers on the stream (the operator's replay, any consumer of a
    single-cluster bus) updates the reader's durable in place to deliver headers only: every message then came empty,
    was read as malformed, dead-lettered and passed by, and the check, which compared no such field, re-created the
    durable from after them (a ledger's events, an enforcer's usage snapshot lowering a migration's raise: lost for
    good). The first message without its body has the durable re-created from it at once, whatever the check's
    period; the check finds such a durable too."""
    async with reading(nats_url, "t5", ["vmquota.ev.c1.>"]) as (c, seen, other):
        await publish_all(other, [("vmquota.ev.c1.ns.pod", b"x", None) for _ in range(3)])
        await until(lambda: len(seen) >= 3, 10)
        config = {
            "name": "t5",
            "durable_name": "t5",
            "filter_subject": "vmquota.ev.c1.>",
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": 1,
            "ack_policy": "none",
            "max_waiting": 16,
            "inactive_threshold": 3_600_000_000_000,
            "mem_storage": True,
            "num_replicas": 1,
            "headers_only": True,
        }
        body = json.dumps({"stream_name": contract.EVENTS_STREAM, "config": config}).encode()
        answer = await other.nc.request(f"$JS.API.CONSUMER.CREATE.{contract.EVENTS_STREAM}.t5", body, 5)
        assert "error" not in json.loads(answer.data), answer.data
        info = await other.js.consumer_info(contract.EVENTS_STREAM, "t5")
        assert "headers_only" in c.differences(info)
        await publish_all(other, [("vmquota.ev.c1.ns.pod", b"y", None) for _ in range(5)])
        await until(lambda: len(seen) >= 8, 10)
        assert seen == [(i, b"x" if i <= 3 else b"y") for i in range(1, 9)], "every message once, whole, in order"
        assert c.repairs == 1 and "headers_only" in c.last_differences
        info = await other.js.consumer_info(contract.EVENTS_STREAM, "t5")
        assert not info.config.headers_only


async def test_a_message_a_publisher_gave_the_headers_only_header_holds_no_reader_back(nats_url: str) -> None:
    """The header a durable that delivers headers only puts in place of a message's body is any publisher's to set:
    a bodiless message with it (one cluster's watcher may publish on the events stream every ledger reads) had the
    reader re-create its durable from it, get it again, and so on, 470 times a second, for good: no cluster's events
    read any more. The server is asked; a durable as created gives the message on, to be dead-lettered as
    malformed."""
    async with reading(nats_url, "t7", ["vmquota.ev.>"]) as (c, seen, other):
        await other.js.publish("vmquota.ev.c1.a.pod", b"x")
        await until(lambda: len(seen) >= 1, 10)
        await other.js.publish("vmquota.ev.c2.evil.pod", b"", headers={HEADERS_ONLY: "0"})
        await other.js.publish("vmquota.ev.c1.a.pod", b"y")
        await until(lambda: len(seen) >= 3, 10)
        assert seen == [(1, b"x"), (2, b""), (3, b"y")], seen
        assert c.repairs == 0 and c.recreations == 1, (c.repairs, c.recreations)


async def test_a_durable_whose_filter_another_client_narrowed_passes_over_nothing(nats_url: str) -> None:
    """Another client with the right to create consumers on the stream narrows the reader's filter in place (to one
    namespace): the messages of the others were passed over, and the check, every 30 s, re-created the durable from
    after them: lost for good. A jump ahead in the stream has the durable checked beside the reading (not before
    the batch is taken: a filter on a stream of many subjects jumps at nearly every message), and a durable found
    changed is re-created from where the first jump since the last check began: what was passed over is read, and
    what came under the narrowed filter read again (the readers fold by sequence and version)."""
    async with reading(nats_url, "t6", ["vmquota.ev.c1.>"]) as (c, read, other):
        await publish_all(other, [("vmquota.ev.c1.a.pod", b"x", None)])
        await until(lambda: len(read) >= 1, 10)
        info = await other.js.consumer_info(contract.EVENTS_STREAM, "t6")
        narrowed = dataclasses.replace(info.config, filter_subject="vmquota.ev.c1.a.>")
        await other.js.add_consumer(contract.EVENTS_STREAM, narrowed)
        info = await other.js.consumer_info(contract.EVENTS_STREAM, "t6")
        assert info.config.filter_subject == "vmquota.ev.c1.a.>", "the server took the narrowed filter"
        await publish_all(other, [(f"vmquota.ev.c1.{ns}.pod", b"y", None) for ns in "babab"])
        await until(lambda: {s for s, _ in read} == set(range(1, 7)), 10)
        seen = [s for s, _ in read]
        again = seen.index(2)
        assert seen[:again] == [1, *[s for s in seen[1:again] if s in (3, 5)]], seen
        assert seen[again:] == [2, 3, 4, 5, 6], f"read again from the first jump, in order: {seen}"
        assert c.repairs == 1 and "filter_subjects" in c.last_differences


async def test_a_durable_changed_each_time_it_is_made_does_not_hold_the_reader_in_one_place(nats_url: str) -> None:
    """Another client narrows the reader's filter again every 50 ms: each check found it changed, the durable was made
    again from the first jump since the last check, and narrowed again before the next: the reader went back to the
    same position for good (5,270 messages read, 510 distinct, none past sequence 1,019 of 4,000). After a few such
    returns to one position it reads on, and the loss is noted for a reader that notes losses (the ledger: a
    relist mends it)."""
    b = await Bus.connect(NatsOptions(url=nats_url, name="test", consumer_check=3600), connect_timeout=10)
    other = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [(f"vmquota.ev.c{1 + i % 2}.a.pod", b"x", None) for i in range(2000)])
        c = PullConsumer(
            b,
            stream=contract.EVENTS_STREAM,
            durable="t10",
            filter_subjects=["vmquota.ev.c1.>"],
            batch=10,
            idle=0.1,
            note_losses=True,
        )
        seen: list[int] = []
        losses: list[Any] = []

        async def read() -> None:
            async for batch in c.batches():
                if (loss := c.take_loss()) is not None:
                    losses.append(loss)
                seen.extend(m.metadata.sequence.stream for m in batch)
                await asyncio.sleep(0.01)

        async def tamper() -> None:
            while True:
                with contextlib.suppress(Exception):
                    info = await other.js.consumer_info(contract.EVENTS_STREAM, "t10")
                    if info.config.filter_subject != "vmquota.ev.c1.a.>":
                        narrowed = dataclasses.replace(info.config, filter_subject="vmquota.ev.c1.a.>")
                        await other.js.add_consumer(contract.EVENTS_STREAM, narrowed)
                await asyncio.sleep(0.05)

        reader = asyncio.create_task(read())
        tampering = asyncio.create_task(tamper())
        try:
            await until(lambda: bool(seen) and max(seen) >= 1999, 60)
        finally:
            await runner.cancel(tampering)
            await runner.cancel(reader)
        assert c.repairs >= 1 and losses, (c.repairs, losses)
        await c.close()
    finally:
        await b.close()
        await other.close()


async def test_a_field_the_server_takes_otherwise_is_not_repaired_at_every_check(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that keeps a field otherwise than asked (here: told so) made the durable look changed at every
    check, and each repair read again from the first jump since: the reader stayed in place for good. What the
    server made is the durable as created."""
    b = await Bus.connect(NatsOptions(url=nats_url, name="test", consumer_check=0.2), connect_timeout=10)
    try:
        await b.ensure_streams(contract.streams())
        await publish_all(b, [(f"vmquota.ev.c{1 + i % 2}.a.pod", b"x", None) for i in range(200)])
        c = PullConsumer(
            b, stream=contract.EVENTS_STREAM, durable="t11", filter_subjects=["vmquota.ev.c1.>"], batch=5, idle=0.1
        )
        real = c.differences
        monkeypatch.setattr(c, "differences", lambda info: {**real(info), "replay_policy": ("instant", "original")})
        seen: list[int] = []

        async def read() -> None:
            async for batch in c.batches():
                seen.extend(m.metadata.sequence.stream for m in batch)
                await asyncio.sleep(0.02)

        reader = asyncio.create_task(read())
        try:
            await until(lambda: len(set(seen)) == 100, 30)
        finally:
            await runner.cancel(reader)
        assert c.repairs == 0 and c.recreations == 1, (c.repairs, c.recreations)
        await c.close()
    finally:
        await b.close()


async def test_an_empty_batch_says_whether_the_consumer_read_or_failed(nats_url: str) -> None:
    """An empty batch is given both when nothing came within ``idle`` and when the durable could not be made or read
    (a permission refused, a stream missing): an enforcer took the second for caught up, and logged "usage caught up"
    with a consumer that never existed. ``failing`` tells them apart."""
    b = await Bus.connect(NatsOptions(url=nats_url, name="test"), connect_timeout=10)
    try:
        missing = PullConsumer(b, stream="VMQUOTA_NOPE", durable="t8", filter_subjects=["vmquota.nope.>"], idle=0.1)
        batches = missing.batches()
        assert await anext(batches) == [] and missing.failing
        await batches.aclose()
        await b.ensure_streams(contract.streams())
        idle = PullConsumer(b, stream=contract.EVENTS_STREAM, durable="t9", filter_subjects=["vmquota.ev.>"], idle=0.1)
        batches = idle.batches()
        assert await anext(batches) == [] and not idle.failing
        await batches.aclose()
        await idle.close()
    finally:
        await b.close()


async def test_every_stream_and_the_bucket_have_a_size_limit(nats_url: str) -> None:
    """Each stream and the checkpoint bucket are bounded in bytes as well as in age, so together they fit the
    volume (the NATS component's 10Gi); the sizes are settings, and a changed size is applied to what exists."""
    sizes = contract.StreamSizes()
    assert sizes.total() <= 8 * 2**30, "well under the component's 10Gi volume"
    b = await Bus.connect(NatsOptions(url=nats_url, name="test", stream_sizes=sizes), connect_timeout=10)
    try:
        await b.ensure_streams(contract.streams())
        await b.ensure_kv(contract.LEDGER_BUCKET)
        for spec in contract.streams():
            info = await b.js.stream_info(spec.name)
            assert info.config.max_bytes == sizes.of(spec.name) > 0, spec.name
            assert spec.max_bytes == sizes.of(spec.name)
        kv = await b.js.stream_info(f"KV_{contract.LEDGER_BUCKET}")
        assert kv.config.max_bytes == sizes.checkpoints > 0

        smaller = contract.StreamSizes(events=64 * 2**20, checkpoints=32 * 2**20)
        b2 = await Bus.connect(NatsOptions(url=nats_url, name="test", stream_sizes=smaller), connect_timeout=10)
        try:
            await b2.ensure_streams(contract.streams())
            await b2.ensure_kv(contract.LEDGER_BUCKET)
            assert (await b2.js.stream_info(contract.EVENTS_STREAM)).config.max_bytes == 64 * 2**20
            assert (await b2.js.stream_info(f"KV_{contract.LEDGER_BUCKET}")).config.max_bytes == 32 * 2**20
        finally:
            await b2.close()
    finally:
        await b.close()


async def test_a_stream_the_server_has_no_room_or_replicas_for_names_the_flag_at_once(tmp_path: Any) -> None:
    """A stream larger than the server's JetStream storage, or replicas of a server that is not clustered: the ledger
    retried the create for 60 s, then stopped with a stack trace that named no flag. No retry mends either: one
    line, naming the flag to change."""
    from shared.errors import InvalidInput

    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 268435456 }\n")  # (256 MiB)
    events = [s for s in contract.streams() if s.name == contract.EVENTS_STREAM]
    with NatsServer(tmp_path / "nats", config_file=conf) as server:
        big = contract.StreamSizes(events=2**40, checkpoints=2**40)
        b = await Bus.connect(NatsOptions(url=server.url, name="test", stream_sizes=big), connect_timeout=10)
        try:
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(InvalidInput) as e:
                await b.ensure_streams(events)
            assert e.value.where == "--events-max-bytes (VMQUOTA_EVENTS_MAX_BYTES)", e.value
            assert f"NATS has no room for the stream {contract.EVENTS_STREAM} of {2**40} bytes" in e.value.message
            assert loop.time() - began < 10, "not retried"
            with pytest.raises(InvalidInput) as e:  # (the checkpoint bucket likewise)
                await b.ensure_kv(contract.LEDGER_BUCKET)
            assert e.value.where == "--checkpoints-max-bytes (VMQUOTA_CHECKPOINTS_MAX_BYTES)", e.value
            b.stream_replicas = 3
            b.stream_sizes = contract.StreamSizes(events=64 * 2**20)
            with pytest.raises(InvalidInput) as e:
                await b.ensure_streams(events)
            assert e.value.where == "--stream-replicas (VMQUOTA_STREAM_REPLICAS)", e.value
        finally:
            await b.close()


# ---- NATS unreachable ------------------------------------------------------------------------------------------


def test_a_repeating_client_error_is_logged_once_then_every_interval_with_a_count() -> None:
    from services.platform.bus import LogThrottle

    now = [100.0]
    throttle = LogThrottle(30.0, clock=lambda: now[0])
    said = []
    for _ in range(60):  # a reconnect attempt every 0.5 s for 30 s
        said.append(throttle.admit("connection refused"))
        now[0] += 0.5
    assert said[0] == 0 and said.count(None) == 59
    assert throttle.admit("connection refused") == 60, "after 30 s: one line that says how often meanwhile"
    assert throttle.admit("authorization violation") == 0, "another cause is said at once"
    throttle.reset()
    assert throttle.admit("connection refused") == 0


async def test_a_service_without_nats_backs_off_and_stops_at_once() -> None:
    """NATS unreachable from the start: the attempts back off (not a line every 0.5 s), and SIGTERM ends the
    service at once (nothing to drain), with status 0."""
    import json
    import os
    import signal
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once closed
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "services.cli.main", "run", "ledger", "--nats", f"nats://127.0.0.1:{port}"),
        *("--http-port", "0", "--log-level", "info"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("VMQUOTA_")},
    )
    assert proc.stdout is not None
    retries: list[dict[str, Any]] = []
    lines: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(30):
            while len(retries) < 5:
                raw = await proc.stdout.readline()
                assert raw, f"the ledger ended: {lines}"
                line = json.loads(raw)
                lines.append(line)
                if line["event"] == "nats not reachable, retrying":
                    retries.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    at = loop.time()
    rest, _ = await asyncio.wait_for(proc.communicate(), 10)
    took = loop.time() - at
    waits = [r["retry_in"] for r in retries]
    assert waits[-1] > 2 * waits[0], f"no backoff: {waits}"
    assert not [x for x in lines if x["event"] == "nats error"], "the first connection's errors are the retry lines"
    assert "Connect call failed" in retries[0]["error"], retries[0]
    assert proc.returncode == 0, rest.decode()[-2000:]
    assert took < 3.0, f"SIGTERM took {took:.1f}s"


@pytest.mark.parametrize("buffered", [10_000, 7])
async def test_the_commands_reader_gives_every_message_once_in_order(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, buffered: int
) -> None:
    """``opsbus.messages`` (what ``vmquota replay`` reads with): a slow reader, with a buffer it fills many times
    over (the subscription then waits for room), gets every stored message once, in stream order, and stops at the
    last one stored when it began."""
    from services.cli import opsbus
    from services.platform.bus import position

    monkeypatch.setattr(opsbus, "_BUFFERED", buffered)
    b = await _connect(nats_url)
    try:
        await b.ensure_streams(contract.streams_for("ledger"))
        first = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        for i in range(300):
            await b.js.publish(f"vmquota.ev.c1.ns{i % 3}.pod", str(i).encode())
        got: list[tuple[int, bytes]] = []
        async for m in opsbus.messages(b.nc, contract.EVENTS_STREAM, "vmquota.ev.c1.>"):
            got.append((position(m).stream, m.data))
            if len(got) % 5 == 0:
                await asyncio.sleep(0.001)  # (a slow reader: the callback fills the buffer meanwhile)
            if len(got) == 100:
                await b.js.publish("vmquota.ev.c1.ns0.pod", b"later")  # (stored after the reader began)
        mine = [(s, d) for s, d in got if s > first]
        assert [d for _, d in mine] == [str(i).encode() for i in range(300)]
        assert [s for s, _ in mine] == list(range(first + 1, first + 301))
    finally:
        await b.close()
