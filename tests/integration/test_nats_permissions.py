"""The NATS users of deploy/components/nats/nats-server.conf against a real nats-server: every service's user can do
its job with nats-py, and anything outside its permissions is refused by the server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.client import JetStreamContext

from services.cli import opsbus
from services.devtools.natsserver import NatsServer
from services.platform.bus import Bus, NatsOptions
from services.platform.consumer import PullConsumer
from services.platform.identity import inbox_prefix
from services.platform.publisher import publish_all
from services.platform.runner import cancel
from shared import contract
from shared.snapshot import VmiSnapshot
from tests.conftest import nats_server_binary
from tests.integration.natscluster import _free_ports
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "components" / "nats" / "nats-server.conf"
USERS = ("watcher", "ledger", "enforcer", "subscriber", "replay", "listener")
DENIED_TIMEOUT = 0.3
"""A refused JetStream API request gets no answer: how long the test waits for one (the refusal itself arrives as
an asynchronous -ERR, which the test waits for on its own deadline)."""
SMALL = contract.StreamSizes(*(16 * 2**20,) * 6)
"""Streams of 16 MiB each: a test server's disk need not hold the defaults."""


def password_env(passwords: dict[str, str]) -> dict[str, str]:
    return {f"VMQUOTA_NATS_{user.upper()}_PASSWORD": pw for user, pw in passwords.items()}


@dataclass
class SecuredServer:
    url: str
    passwords: dict[str, str]
    proc: subprocess.Popen[bytes]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SecuredServer]:
    """nats-server with the deploy configuration; test passwords through the environment, as in Kubernetes."""
    # hex, as docs/operations.md asks: nats-server parses an environment value as configuration syntax
    passwords = {user: secrets.token_hex(16) for user in USERS}
    server = NatsServer(tmp_path, config_file=CONFIG, env=password_env(passwords))
    try:
        server.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    assert server.proc is not None
    try:
        yield SecuredServer(server.url, passwords, server.proc)
    finally:
        server.stop()


@dataclass
class Conn:
    nc: Client
    js: JetStreamContext
    errors: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def denied(self, what: str, subject: str) -> None:
        """Wait until the server reports a permissions violation of ``what`` (publish|subscription) on ``subject``."""
        pattern = re.compile(rf'permissions violation for {what} to "?{re.escape(subject)}"?', re.IGNORECASE)
        try:
            async with asyncio.timeout(5):
                while not any(pattern.search(e) for e in self.errors):
                    self.arrived.clear()
                    await self.arrived.wait()
        except TimeoutError:
            raise AssertionError(f"no permissions violation for {what} to {subject}; errors: {self.errors}") from None

    def clean(self) -> None:
        assert not self.errors, f"unexpected server errors: {self.errors}"


class Connect(Protocol):
    def __call__(self, user: str, password: str | None = None) -> Awaitable[Conn]: ...


def uid_of(data: bytes) -> str:
    ev = contract.decode_event(data)
    assert not isinstance(ev, contract.Sync)
    return ev.uid


@pytest.fixture
async def connect(server: SecuredServer) -> AsyncIterator[Connect]:
    opened: list[Client] = []

    async def _connect(user: str, password: str | None = None) -> Conn:
        conn_errors: list[str] = []
        arrived = asyncio.Event()

        async def on_error(e: Exception) -> None:
            conn_errors.append(str(e))
            arrived.set()

        nc = await nats.connect(
            server.url,
            user=user,
            password=password if password is not None else server.passwords[user],
            inbox_prefix=inbox_prefix(user),  # (as vmquota's clients: each user may hear its own inbox only)
            error_cb=on_error,
            allow_reconnect=False,
            connect_timeout=5,
        )
        opened.append(nc)
        return Conn(nc, nc.jetstream(timeout=5), conn_errors, arrived)

    yield _connect
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


def stream_config(name: str) -> StreamConfig:
    """The server config of one of the project's streams, from the bus contract (shared.contract.streams)."""
    spec = next(s for s in contract.streams() if s.name == name)
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        max_age=spec.max_age or None,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window,
    )


def event(uid: str, rv: str, namespace: str = "tenant-a") -> tuple[str, bytes, dict[str, str]]:
    ev = contract.object_event(
        "upserted",
        cluster="c1",
        kind="VirtualMachineInstance",
        namespace=namespace,
        name=f"vm-{uid}",
        uid=uid,
        rv=rv,
        snapshot=VmiSnapshot(uid=uid, namespace=namespace, name=f"vm-{uid}", resource_version=rv),
    )
    return contract.event_subject("c1", ev.kind, namespace), contract.encode(ev), {"Nats-Msg-Id": ev.id}


async def refused_request(conn: Conn, subject: str, payload: bytes = b"") -> None:
    """A JetStream API request the user may not make: no answer, and the server says why."""
    with pytest.raises(nats.errors.TimeoutError):
        await conn.nc.request(subject, payload, timeout=DENIED_TIMEOUT)
    await conn.denied("publish", subject)


async def kept(connect: Connect, *streams: str) -> None:
    """The streams created, as the ledger creates them: the one identity that may create or update a stream."""
    led = await connect("ledger")
    for name in streams:
        await led.js.add_stream(stream_config(name))


async def watcher_publishes(connect: Connect) -> Conn:
    w = await connect("watcher")
    await kept(connect, contract.EVENTS_STREAM)
    for i in range(3):
        subject, data, headers = event(f"u{i}", str(10 + i))
        ack = await w.js.publish(subject, data, headers=headers)
        assert ack.stream == contract.EVENTS_STREAM and not ack.duplicate
    subject, data, headers = event("u0", "10")
    assert (await w.js.publish(subject, data, headers=headers)).duplicate  # a relist does not store it twice
    return w


async def test_watcher_publishes_events_and_nothing_else(connect: Connect) -> None:
    w = await watcher_publishes(connect)
    await kept(connect, contract.DLQ_STREAM)
    await w.js.publish(contract.dlq_subject("watcher"), b"{}")
    w.clean()

    await w.nc.publish(contract.usage_subject("c1", "tenant-a"), b"forged")
    await w.denied("publish", "vmquota.usage.c1.tenant-a")
    await w.nc.publish(contract.dlq_subject("ledger"), b"{}")
    await w.denied("publish", contract.dlq_subject("ledger"))
    await w.nc.subscribe("vmquota.>")
    await w.denied("subscription", "vmquota.>")
    await refused_request(w, f"$JS.API.STREAM.CREATE.{contract.USAGE_STREAM}", b'{"name":"VMQUOTA_USAGE"}')
    await refused_request(w, f"$JS.API.STREAM.CREATE.{contract.EVENTS_STREAM}", b'{"name":"VMQUOTA_EVENTS"}')
    await refused_request(w, f"$JS.API.STREAM.DELETE.{contract.EVENTS_STREAM}")
    await refused_request(w, f"$JS.API.CONSUMER.CREATE.{contract.EVENTS_STREAM}")
    assert (await w.js.stream_info(contract.EVENTS_STREAM)).state.messages == 3  # nothing was deleted


async def test_ledger_folds_events_checkpoints_and_publishes_usage(connect: Connect) -> None:
    await watcher_publishes(connect)
    led = await connect("ledger")
    sub = await led.js.pull_subscribe(  # (as the service reads: no acks, its position in its checkpoints)
        contract.events_filter("c1"),
        durable="ledger-p0",
        stream=contract.EVENTS_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE),
    )
    msgs = await sub.fetch(3, timeout=5)
    assert [uid_of(m.data) for m in msgs] == ["u0", "u1", "u2"]
    # It acks nothing and gets no message by sequence: allowed either, its credential could ack away the messages
    # of another consumer of the stream (an integration's explicit-ack durable).
    assert msgs[0].reply
    await led.nc.publish(msgs[0].reply, b"+ACK")
    await led.denied("publish", msgs[0].reply)
    led.errors.clear()
    await refused_request(led, f"$JS.API.STREAM.MSG.GET.{contract.EVENTS_STREAM}", b'{"seq": 2}')
    await refused_request(led, f"$JS.API.DIRECT.GET.{contract.EVENTS_STREAM}", b'{"seq": 2}')
    led.errors.clear()

    kv = await led.js.create_key_value(bucket=contract.LEDGER_BUCKET, history=1)
    rev = await kv.put("p0", b'{"seq": 3}')
    assert await kv.update("p0", b'{"seq": 4}', last=rev) > rev
    assert (await kv.get("p0")).value == b'{"seq": 4}'
    assert await kv.keys() == ["p0"]
    kv = await led.js.key_value(contract.LEDGER_BUCKET)  # a restarted ledger binds to the existing bucket

    await led.js.add_stream(stream_config(contract.USAGE_STREAM))
    await led.js.add_stream(stream_config(contract.DLQ_STREAM))
    ack = await led.js.publish(contract.usage_subject("c1", "tenant-a"), b'{"seq": 3}')
    assert ack.stream == contract.USAGE_STREAM
    await led.js.publish(contract.dlq_subject("ledger"), b"{}")
    led.clean()

    subject, data, _ = event("forged", "99")
    await led.nc.publish(subject, data)
    await led.denied("publish", subject)
    await led.nc.publish(contract.decision_subject("c1", "tenant-a"), b"{}")
    await led.denied("publish", "vmquota.quota.c1.tenant-a")
    await refused_request(led, f"$JS.API.STREAM.PURGE.{contract.EVENTS_STREAM}")
    await refused_request(led, f"$JS.API.STREAM.MSG.DELETE.{contract.EVENTS_STREAM}", b'{"seq": 1}')
    await refused_request(led, "$JS.API.STREAM.CREATE.OTHER", b'{"name":"OTHER"}')  # (vmquota's streams only)
    await refused_request(led, f"$JS.API.STREAM.DELETE.{contract.DECISIONS_STREAM}")
    assert (await led.js.stream_info(contract.EVENTS_STREAM)).state.messages == 3


async def test_enforcer_reads_usage_and_quota_events_and_publishes_decisions(connect: Connect) -> None:
    await watcher_publishes(connect)
    led = await connect("ledger")
    await led.js.add_stream(stream_config(contract.USAGE_STREAM))
    await led.js.create_key_value(bucket=contract.LEDGER_BUCKET)
    await led.js.publish(contract.usage_subject("c1", "tenant-a"), b'{"seq": 3}')

    enf = await connect("enforcer")
    usage = await enf.js.pull_subscribe("vmquota.usage.c1.>", durable="enforcer-c1", stream=contract.USAGE_STREAM)
    [u] = await usage.fetch(1, timeout=5)
    assert u.data == b'{"seq": 3}'
    quotas = await enf.js.pull_subscribe("vmquota.ev.c1.*.vmi", durable="enforcer-c1-ev", stream=contract.EVENTS_STREAM)
    assert len(await quotas.fetch(3, timeout=5)) == 3
    # (the service acks nothing and gets no message by sequence: see the ledger's test)
    assert u.reply
    await enf.nc.publish(u.reply, b"+ACK")
    await enf.denied("publish", u.reply)
    enf.errors.clear()
    for stream in (contract.USAGE_STREAM, contract.EVENTS_STREAM):
        await refused_request(enf, f"$JS.API.STREAM.MSG.GET.{stream}", b'{"seq": 1}')
    enf.errors.clear()

    await kept(connect, contract.DECISIONS_STREAM, contract.DLQ_STREAM)
    ack = await enf.js.publish(contract.decision_subject("c1", "tenant-a"), b"{}")
    assert ack.stream == contract.DECISIONS_STREAM
    await enf.js.publish(contract.dlq_subject("enforcer"), b"{}")
    enf.clean()

    await enf.nc.publish(contract.usage_subject("c1", "tenant-a"), b"forged")
    await enf.denied("publish", "vmquota.usage.c1.tenant-a")
    await enf.nc.publish(f"$KV.{contract.LEDGER_BUCKET}.p0", b"forged")
    await enf.denied("publish", f"$KV.{contract.LEDGER_BUCKET}.p0")
    await refused_request(enf, f"$JS.API.STREAM.INFO.KV_{contract.LEDGER_BUCKET}")
    await refused_request(enf, f"$JS.API.STREAM.UPDATE.{contract.EVENTS_STREAM}", b'{"name":"VMQUOTA_EVENTS"}')


async def test_subscriber_reads_and_cannot_write(connect: Connect) -> None:
    await watcher_publishes(connect)
    enf = await connect("enforcer")
    await kept(connect, contract.DECISIONS_STREAM)

    sub = await connect("subscriber")
    received: asyncio.Queue[Msg] = asyncio.Queue()
    got = asyncio.Event()

    async def on_msg(m: Msg) -> None:
        await received.put(m)
        got.set()

    await sub.nc.subscribe("vmquota.quota.>", cb=on_msg)
    await sub.nc.flush()
    # A brand-new subscription can (rarely) miss a message published right after it is registered, so publish
    # until one arrives, within a deadline: what is tested is the permission to subscribe, not that timing.
    deadline = asyncio.get_running_loop().time() + 10
    while received.empty():
        await enf.js.publish(contract.decision_subject("c1", "tenant-a"), b'{"d": 1}')
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(got.wait(), timeout=0.5)
        assert asyncio.get_running_loop().time() < deadline, "the subscriber never received a decision"
    msg = received.get_nowait()
    assert (msg.subject, msg.data) == ("vmquota.quota.c1.tenant-a", b'{"d": 1}')

    pull = await sub.js.pull_subscribe("vmquota.ev.>", durable="subscriber", stream=contract.EVENTS_STREAM)
    assert len(await pull.fetch(3, timeout=5)) == 3
    decisions = await sub.js.pull_subscribe("vmquota.quota.>", durable="subscriber", stream=contract.DECISIONS_STREAM)
    assert (await decisions.fetch(1, timeout=5))[0].data == b'{"d": 1}'
    sub.clean()

    await sub.nc.publish(contract.decision_subject("c1", "tenant-a"), b"forged")
    await sub.denied("publish", "vmquota.quota.c1.tenant-a")
    await sub.nc.subscribe("vmquota.dlq.>")
    await sub.denied("subscription", "vmquota.dlq.>")
    await refused_request(sub, f"$JS.API.STREAM.CREATE.{contract.DLQ_STREAM}", b'{"name":"VMQUOTA_DLQ"}')
    await refused_request(sub, f"$JS.API.CONSUMER.DELETE.{contract.DLQ_STREAM}.x")
    await refused_request(sub, f"$JS.API.CONSUMER.CREATE.{contract.DECISIONS_STREAM}", b"{}")  # ordered: replay's


async def keeper_streams(server: SecuredServer) -> None:
    """Every stream and the bucket, as the ledger creates them."""
    keeper = await Bus.connect(
        NatsOptions(url=server.url, user="ledger", password=server.passwords["ledger"], name="keeper"),
        connect_timeout=5,
    )
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=SMALL))
        await keeper.ensure_kv(contract.LEDGER_BUCKET)
    finally:
        await keeper.close()


async def test_a_reader_can_have_copies_and_empty_messages_stored_in_the_usage_stream(
    server: SecuredServer, connect: Connect
) -> None:
    """What the enforcer's refusal of older usage and the ledger's never-empty mark of lost events exist for: JetStream
    delivers a pull request's messages to whatever reply subject the request names, without asking whether the
    requester may publish there, and a stream that captures that subject stores the delivery, headers and original
    subject kept; a pull that finds nothing is answered with an empty status message, stored under the reply subject.
    The read-only subscriber so has an old usage snapshot stored after the current one (into the events stream, and
    back), and an empty message on any subject of the streams or the ledger's bucket (docs/operations.md, "What a
    reader can still write"; tests/integration/test_enforcer.py -k older_usage)."""
    ledger = await connect("ledger")
    await keeper_streams(server)
    usage = contract.usage_subject("c1", "tenant-a")
    sub, reader = await connect("subscriber"), await connect("replay")

    async def pull_into(stream: str, reply: str, subjects: str) -> None:
        config = {"durable_name": "subscriber", "deliver_policy": "all", "ack_policy": "none"}
        config["filter_subject"] = subjects
        create = json.dumps({"stream_name": stream, "config": config}).encode()
        answer = await sub.nc.request(f"$JS.API.CONSUMER.CREATE.{stream}.subscriber", create, timeout=5)
        assert "error" not in json.loads(answer.data), answer.data
        pull = json.dumps({"batch": 1, "no_wait": True}).encode()
        await sub.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.subscriber", pull, reply=reply)
        await sub.nc.flush()

    async def last(stream: str, subject: str) -> tuple[int, bytes]:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            m = await reader.js.get_last_msg(stream, subject)
            return m.seq or 0, m.data or b""
        return 0, b""

    async def stored(stream: str, subject: str, data: bytes) -> None:
        async def there() -> bool:
            return (await last(stream, subject))[1] == data

        await wait_until(there, 10, f"{data!r} stored in {stream}")

    await ledger.js.publish(usage, b'{"old": 1}')
    await pull_into(contract.USAGE_STREAM, "vmquota.ev.c1.x.pod", usage)  # (the events stream captures the reply)
    await stored(contract.EVENTS_STREAM, usage, b'{"old": 1}')
    current = await ledger.js.publish(usage, b'{"new": 2}')
    await pull_into(contract.EVENTS_STREAM, usage, usage)  # (back into the usage stream)
    await stored(contract.USAGE_STREAM, usage, b'{"old": 1}')
    assert (await last(contract.USAGE_STREAM, usage))[0] > current.seq, "the copy is stored after the current one"
    key = f"$KV.{contract.LEDGER_BUCKET}.lost.x"
    await pull_into(contract.DECISIONS_STREAM, key, "vmquota.quota.>")  # (nothing to deliver: a status answer)
    marks: list[bytes | None] = []

    async def marked() -> bool:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            marks.append((await ledger.js.get_last_msg(f"KV_{contract.LEDGER_BUCKET}", key)).data)
        return bool(marks)

    await wait_until(marked, 10, "a message under the key of a ledger's mark of lost events")
    assert not marks[0], marks


async def heard(nc: Client, subject: str, publish: Callable[[], Awaitable[object]]) -> Msg:
    """The first message ``nc`` hears on ``subject`` while ``publish`` is repeated (a new subscription can miss a
    message published right after it is registered), within a deadline."""
    sub = await nc.subscribe(subject)
    await nc.flush()
    async with asyncio.timeout(10):
        while True:
            await publish()
            with contextlib.suppress(nats.errors.TimeoutError):
                return await sub.next_msg(timeout=0.3)


async def test_the_listener_hears_usage_and_decisions_and_can_have_nothing_stored(
    server: SecuredServer, connect: Connect
) -> None:
    """The user for services not trusted as much as the bus (docs/operations.md, "A listener"): it hears usage and
    decisions, and publishes nothing, so neither a JetStream API request nor a pull whose reply subject a stream
    captures (what ``subscriber`` can do, the test above) is open to it: nothing it sends is stored."""
    await keeper_streams(server)
    ledger, enf, lis = await connect("ledger"), await connect("enforcer"), await connect("listener")
    usage, decision = contract.usage_subject("c1", "tenant-a"), contract.decision_subject("c1", "tenant-a")
    got = await heard(lis.nc, "vmquota.usage.>", lambda: ledger.js.publish(usage, b'{"u": 1}'))
    assert (got.subject, got.data) == (usage, b'{"u": 1}')
    got = await heard(lis.nc, "vmquota.quota.>", lambda: enf.js.publish(decision, b'{"d": 1}'))
    assert (got.subject, got.data) == (decision, b'{"d": 1}')
    lis.clean()
    before = {
        s: (await ledger.js.stream_info(s)).state.messages for s in (contract.USAGE_STREAM, contract.EVENTS_STREAM)
    }

    await lis.nc.publish(usage, b'{"forged": 1}')
    await lis.denied("publish", usage)
    pull = json.dumps({"batch": 1, "no_wait": True}).encode()
    await lis.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{contract.USAGE_STREAM}.subscriber", pull, reply=usage)
    await lis.denied("publish", f"$JS.API.CONSUMER.MSG.NEXT.{contract.USAGE_STREAM}.subscriber")
    await refused_request(lis, f"$JS.API.STREAM.INFO.{contract.USAGE_STREAM}")
    await refused_request(lis, f"$JS.API.CONSUMER.CREATE.{contract.DECISIONS_STREAM}", b"{}")
    for subject in ("vmquota.ev.>", "vmquota.dlq.>", "_INBOX.>", f"$KV.{contract.LEDGER_BUCKET}.>"):
        await lis.nc.subscribe(subject)
        await lis.denied("subscription", subject)
    await lis.nc.flush()
    after = {s: (await ledger.js.stream_info(s)).state.messages for s in before}
    assert after == before, "the listener had something stored"


async def test_a_server_fed_by_the_listener_as_a_leaf_node_keeps_history_and_writes_nothing_back(
    tmp_path: Path,
) -> None:
    """How a service not trusted as much as the bus keeps history (docs/operations.md, "A listener"): its own
    nats-server connects to vmquota's as a leaf node with the listener's credentials and stores what it hears in a
    stream of its own. Whatever is published or delivered on that server, vmquota's subjects included, stays there."""
    passwords = {user: secrets.token_hex(16) for user in USERS}
    hub_dir, leaf_dir = tmp_path / "hub", tmp_path / "leaf"
    hub_dir.mkdir()
    leaf_dir.mkdir()
    (hub_dir / "vmquota.conf").write_text(CONFIG.read_text())
    [leaf_port] = _free_ports(1)
    (hub_dir / "hub.conf").write_text(f"include ./vmquota.conf\nleafnodes {{ listen: 127.0.0.1:{leaf_port} }}\n")
    hub = NatsServer(hub_dir, config_file=hub_dir / "hub.conf", env=password_env(passwords))
    leaf: NatsServer | None = None
    clients: list[Client] = []
    try:
        hub.start()
        assert hub.proc is not None
        remote = f"nats-leaf://listener:{passwords['listener']}@127.0.0.1:{leaf_port}"
        (leaf_dir / "leaf.conf").write_text(f'leafnodes {{ remotes: [{{ url: "{remote}" }}] }}\n')
        leaf = NatsServer(leaf_dir, config_file=leaf_dir / "leaf.conf").start()
        server = SecuredServer(hub.url, passwords, hub.proc)
        await keeper_streams(server)
        ledger = await nats.connect(
            hub.url, user="ledger", password=passwords["ledger"], inbox_prefix=inbox_prefix("ledger")
        )
        own = await nats.connect(leaf.url)
        clients += [ledger, own]
        ledger_js, own_js = ledger.jetstream(timeout=5), own.jetstream(timeout=5)
        await own_js.add_stream(StreamConfig(name="HEARD", subjects=["vmquota.usage.>", "vmquota.quota.>"]))
        usage = contract.usage_subject("c1", "tenant-a")

        async def history() -> int:
            return (await own_js.stream_info("HEARD")).state.messages

        async def stored() -> bool:
            return await history() > 0

        deadline = asyncio.get_running_loop().time() + 10
        while not await stored():  # (the leaf's interest reaches the hub a moment after the stream exists)
            await ledger_js.publish(usage, b'{"u": 1}')
            assert asyncio.get_running_loop().time() < deadline, "the leaf never stored usage"
            with contextlib.suppress(TimeoutError):
                await wait_until(stored, 0.3, "usage stored on the leaf")
        assert (await own_js.get_last_msg("HEARD", usage)).data == b'{"u": 1}'
        in_vmquota = (await ledger_js.stream_info(contract.USAGE_STREAM)).state.last_seq
        n = await history()

        # what the subscriber could do to vmquota's streams, done on the leaf: a forged usage message, and a pull
        # whose reply subject a stream captures
        await own.publish(usage, b'{"forged": 1}')
        await own_js.add_consumer("HEARD", ConsumerConfig(durable_name="mine", ack_policy=AckPolicy.NONE))
        await own.publish("$JS.API.CONSUMER.MSG.NEXT.HEARD.mine", json.dumps({"batch": 1}).encode(), reply=usage)
        answer = await own.request(f"$JS.API.STREAM.INFO.{contract.USAGE_STREAM}", b"", timeout=5)
        assert json.loads(answer.data)["error"]["code"] == 404, "the leaf's JetStream API is its own"

        async def both_stored() -> bool:
            return await history() >= n + 2

        await wait_until(both_stored, 10, "the forged message and the copy stored on the leaf")
        await ledger.flush()
        last_seq = (await ledger_js.stream_info(contract.USAGE_STREAM)).state.last_seq
        assert last_seq == in_vmquota, "something the leaf sent was stored in vmquota's usage stream"
    finally:
        for nc in clients:
            if not nc.is_closed:
                await nc.close()
        if leaf is not None:
            leaf.stop()
        hub.stop()


async def test_replay_reads_streams_with_ordered_consumers_only(connect: Connect) -> None:
    await watcher_publishes(connect)
    rep = await connect("replay")
    ordered = await rep.js.subscribe(
        contract.events_filter(),
        stream=contract.EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=2),
    )
    got = [uid_of((await ordered.next_msg(timeout=5)).data) for _ in range(2)]
    assert got == ["u1", "u2"]
    assert (await rep.js.get_msg(contract.EVENTS_STREAM, 1)).seq == 1
    rep.clean()

    subject, data, _ = event("forged", "99")
    await rep.nc.publish(subject, data)
    await rep.denied("publish", subject)
    await refused_request(rep, f"$JS.API.CONSUMER.DURABLE.CREATE.{contract.EVENTS_STREAM}.mine", b"{}")
    await refused_request(rep, f"$JS.API.STREAM.DELETE.{contract.EVENTS_STREAM}")
    await refused_request(rep, f"$JS.API.STREAM.INFO.KV_{contract.LEDGER_BUCKET}")


async def test_replay_may_look_a_message_up_on_every_stream_the_commands_read(connect: Connect) -> None:
    """The commands ask the server where a read from a time starts, and on a quiet second whether what a read waits
    for is still stored (a message get): on every stream, the usage history included (``explain``, ``replay``),
    which ``replay`` could not ask."""
    await kept(connect, *(s.name for s in contract.streams()))
    await watcher_publishes(connect)
    rep = await connect("replay")
    for s in contract.streams():
        assert await opsbus.next_stored(rep.nc, s.name, ">", seq=1) == (1 if s.name == contract.EVENTS_STREAM else None)
    assert await opsbus.next_stored(rep.nc, contract.EVENTS_STREAM, contract.events_filter(), seq=2) == 2
    assert await opsbus.next_stored(rep.nc, contract.EVENTS_STREAM, ">", seq=4) is None


async def test_wrong_password_and_unknown_user_are_refused(connect: Connect) -> None:
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await connect("watcher", password="not-the-password")
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await connect("admin", password="x")


def test_config_users_streams_and_env_match_the_bus_contract() -> None:
    text = CONFIG.read_text()
    assert set(re.findall(r"^\s*user:\s*(\S+)", text, re.MULTILINE)) == set(USERS)
    assert set(re.findall(r"\$(VMQUOTA_NATS_[A-Z]+_PASSWORD)", text)) == set(password_env(dict.fromkeys(USERS, "")))
    names = set(re.findall(r"\b(?:KV_)?VMQUOTA_[A-Z]+\b", text)) - set(password_env(dict.fromkeys(USERS, "")))
    known = {s.name for s in contract.streams()} | {contract.LEDGER_BUCKET, f"KV_{contract.LEDGER_BUCKET}"}
    assert names <= known, f"streams in the NATS config unknown to shared/contract/: {names - known}"
    # each service may create exactly the streams the code has it create (shared.contract.STREAM_OWNERS)
    blocks = re.split(r"^\s*user:\s*", text, flags=re.MULTILINE)[1:]
    for block in blocks:
        user = block.split()[0]
        created = set(re.findall(r"\$JS\.API\.STREAM\.CREATE\.(VMQUOTA_\w+)", block))
        assert created == set(contract.STREAM_OWNERS.get(user, frozenset())), user
        # (who may create or update a stream decides everything about it: the keeper alone)
        updated = set(re.findall(r"\$JS\.API\.STREAM\.UPDATE\.(VMQUOTA_\w+)", block))
        assert updated == created, user
        looked_up = set(re.findall(r"\$JS\.API\.STREAM\.INFO\.(VMQUOTA_\w+)", block))
        assert set(contract.STREAMS_USED.get(user, frozenset())) <= looked_up, f"{user} waits for what it uses"
    # the file is valid for the server itself, and refuses to load without the passwords
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMQUOTA_NATS_")}
    missing = subprocess.run([nats_server_binary(), "-c", str(CONFIG), "-t"], env=env, capture_output=True, timeout=30)
    assert missing.returncode != 0 and b"VMQUOTA_NATS_" in missing.stdout + missing.stderr
    ok = subprocess.run(
        [nats_server_binary(), "-c", str(CONFIG), "-t"],
        env={**env, **password_env(dict.fromkeys(USERS, "pw"))},
        capture_output=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr


async def test_the_services_bus_helpers_work_with_their_users(server: SecuredServer) -> None:
    """The code paths the services use (services/platform/bus.py) under each service's own user: the streams the
    ledger keeps and the others wait for,
    publishing, the ledger's checkpoint bucket, durable pull consumers and dead letters."""

    async def as_user(user: str) -> Bus:
        opts = NatsOptions(url=server.url, user=user, password=server.passwords[user], name=f"test-{user}")
        return await Bus.connect(opts, connect_timeout=5)

    async def first_batch(consumer: PullConsumer) -> list[bytes]:
        async for batch in consumer.batches():
            if batch:
                return [m.data for m in batch]
        raise AssertionError("consumer ended")

    buses: list[Bus] = []
    try:
        async with asyncio.timeout(30):  # a refused request would retry for a minute: fail sooner
            watcher = await as_user("watcher")
            ledger = await as_user("ledger")
            enforcer = await as_user("enforcer")
            buses += [watcher, ledger, enforcer]
            await ledger.ensure_streams(contract.streams_for("ledger", sizes=SMALL))  # (it keeps every stream)
            for service, b in (("watcher", watcher), ("enforcer", enforcer)):
                await b.wait_for_streams(contract.STREAMS_USED[service])
            items = [event(f"u{i}", str(i + 1)) for i in range(3)]
            stored, dups = await publish_all(watcher, [(s, d, h["Nats-Msg-Id"]) for s, d, h in items])
            assert (stored, dups) == (3, 0)

            events = PullConsumer(
                ledger, stream=contract.EVENTS_STREAM, durable="ledger-p0", filter_subjects=["vmquota.ev.>"]
            )
            assert [uid_of(d) for d in await first_batch(events)] == ["u0", "u1", "u2"]
            await events.close()
            kv = await ledger.ensure_kv(contract.LEDGER_BUCKET)
            await kv.put("p0", b"3")
            await ledger.publish(contract.usage_subject("c1", "tenant-a"), b'{"seq": 3}')
            await ledger.publish_dead_letter("ledger", "test", stream=contract.EVENTS_STREAM, stream_seq=2)

            usage = PullConsumer(
                enforcer,
                stream=contract.USAGE_STREAM,
                durable="enforcer-c1",
                filter_subjects=["vmquota.usage.c1.>"],
            )
            assert await first_batch(usage) == [b'{"seq": 3}']
            await usage.close()
            quotas = PullConsumer(
                enforcer,
                stream=contract.EVENTS_STREAM,
                durable="enforcer-c1-quotas",
                filter_subjects=["vmquota.ev.c1.*.resourcequota", "vmquota.ev.c1.*.vmi"],
            )
            assert len(await first_batch(quotas)) == 3
            await quotas.close()
            await enforcer.publish(contract.decision_subject("c1", "tenant-a"), b"{}")
            await enforcer.publish_dead_letter("enforcer", "test")
    finally:
        for b in buses:
            await b.close()


# ---- consumers: a read-only user cannot touch a service's durable ------------------------------------------------

LEDGER_DURABLE = "vmquota-ledger-n16_0-7-all"
"""A ledger's durable consumer name (``services/ledger/service.py``: ``vmquota-ledger-<partitions>-<cluster>``)."""


async def ledger_durable(connect: Connect) -> Conn:
    """The ledger's durable on the events stream, created as ``services.platform.consumer.PullConsumer`` creates it."""
    await watcher_publishes(connect)
    led = await connect("ledger")
    await led.js.add_consumer(
        contract.EVENTS_STREAM,
        ConsumerConfig(
            name=LEDGER_DURABLE,
            durable_name=LEDGER_DURABLE,
            filter_subject=contract.events_filter(),
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=1,
            ack_policy=AckPolicy.NONE,
            max_waiting=16,
            inactive_threshold=3600.0,
        ),
    )
    return led


def hijack(name: str, *, nameless: bool = False) -> bytes:
    """A consumer create request for ``name`` whose filter matches nothing (the ledger would go blind); for the
    nameless create without ``durable_name``, which it refuses."""
    durable = {} if nameless else {"durable_name": name}
    return json.dumps(
        {
            "stream_name": contract.EVENTS_STREAM,
            "config": {
                "name": name,
                **durable,
                "filter_subject": "vmquota.ev.nothing.>",
                "deliver_policy": "by_start_sequence",
                "opt_start_seq": 1,
                "ack_policy": "none",
                "max_waiting": 16,
                "inactive_threshold": 3_600_000_000_000,
                "mem_storage": True,  # (as the services create theirs: the server refuses to change the storage)
                "num_replicas": 1,
            },
        }
    ).encode()


@pytest.mark.parametrize("user", ["subscriber", "replay"])
async def test_read_only_users_cannot_delete_or_recreate_a_services_durable(connect: Connect, user: str) -> None:
    led = await ledger_durable(connect)
    ro = await connect(user)
    s, d = contract.EVENTS_STREAM, LEDGER_DURABLE
    await refused_request(ro, f"$JS.API.CONSUMER.DELETE.{s}.{d}")
    await refused_request(ro, f"$JS.API.CONSUMER.CREATE.{s}.{d}", hijack(d))
    await refused_request(ro, f"$JS.API.CONSUMER.CREATE.{s}.{d}.vmquota.ev.nothing.>", hijack(d))
    await refused_request(ro, f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.{d}", hijack(d))
    await refused_request(ro, f"$JS.API.CONSUMER.MSG.NEXT.{s}.{d}", b'{"batch": 1}')
    info = await led.js.consumer_info(s, d)
    assert info.config.filter_subject == contract.events_filter() and info.delivered.stream_seq == 0


async def test_subscriber_cannot_rewrite_a_durable_through_the_nameless_create(connect: Connect) -> None:
    """The nameless create (``$JS.API.CONSUMER.CREATE.<stream>``, what ordered consumers use) takes the consumer's
    name from the request body, and the server then updates an existing consumer of that name: it is not for
    the subscriber."""
    led = await ledger_durable(connect)
    sub = await connect("subscriber")
    await refused_request(
        sub, f"$JS.API.CONSUMER.CREATE.{contract.EVENTS_STREAM}", hijack(LEDGER_DURABLE, nameless=True)
    )
    info = await led.js.consumer_info(contract.EVENTS_STREAM, LEDGER_DURABLE)
    assert info.config.filter_subject == contract.events_filter()


async def test_subscriber_manages_only_its_own_durable(connect: Connect) -> None:
    await watcher_publishes(connect)
    sub = await connect("subscriber")
    pull = await sub.js.pull_subscribe(
        "vmquota.ev.>", durable="subscriber", stream=contract.EVENTS_STREAM, config=ConsumerConfig(ack_wait=30)
    )
    msgs = await pull.fetch(3, timeout=5)
    for m in msgs:
        await m.ack_sync()
    assert (await sub.js.consumer_info(contract.EVENTS_STREAM, "subscriber")).num_ack_pending == 0
    assert await sub.js.delete_consumer(contract.EVENTS_STREAM, "subscriber")
    sub.clean()
    await refused_request(sub, f"$JS.API.CONSUMER.DURABLE.CREATE.{contract.EVENTS_STREAM}.billing", b"{}")


async def until(condition: Callable[[], bool], within: float) -> None:
    """Poll ``condition`` (a reader task appends to a list) until it holds, for at most ``within`` seconds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 (the reader is a task of its own: nothing to wait on)
            await asyncio.sleep(0.02)


async def test_a_durable_replay_rewrote_is_repaired(server: SecuredServer, connect: Connect) -> None:
    """What the replay user can still do to a durable (the nameless create updates an existing consumer of the
    name in the body), the consumer undoes within its check period, under the ledger's own permissions."""
    await watcher_publishes(connect)
    opts = NatsOptions(
        url=server.url, user="ledger", password=server.passwords["ledger"], name="test-ledger", consumer_check=0.5
    )
    ledger = await Bus.connect(opts, connect_timeout=5)
    c = PullConsumer(
        ledger, stream=contract.EVENTS_STREAM, durable=LEDGER_DURABLE, filter_subjects=[contract.events_filter()]
    )
    seen: list[str] = []

    async def read() -> None:
        async for batch in c.batches():
            seen.extend(uid_of(m.data) for m in batch)

    reader = asyncio.create_task(read())
    try:
        await until(lambda: len(seen) >= 3, 10)
        rep = await connect("replay")
        answer = await rep.nc.request(
            f"$JS.API.CONSUMER.CREATE.{contract.EVENTS_STREAM}", hijack(LEDGER_DURABLE, nameless=True), timeout=5
        )
        assert json.loads(answer.data).get("config", {}).get("filter_subject") == "vmquota.ev.nothing.>", answer.data
        w = await connect("watcher")
        subject, data, headers = event("u9", "19")
        await w.js.publish(subject, data, headers=headers)
        await until(lambda: len(seen) >= 4, 5)
    finally:
        await cancel(reader)
        await c.close()
        await ledger.close()
    assert seen == ["u0", "u1", "u2", "u9"]
    assert c.repairs == 1 and "filter_subjects" in c.last_differences


# ---- the two-cluster layout: per-cluster users ----------------------------------------------------------------------

PER_CLUSTER = ROOT / "deploy" / "overlays" / "two-clusters" / "central" / "nats-per-cluster" / "nats-server.conf"
PER_CLUSTER_USERS = (
    "watcher-cluster-a",
    "enforcer-cluster-a",
    "watcher-cluster-b",
    "enforcer-cluster-b",
    "ledger",
    "subscriber",
    "replay",
    "listener",
)


def user_blocks(text: str) -> dict[str, str]:
    """Each user's block of a configuration file, by user name."""
    parts = re.split(r"\n    # ", text[text.index("authorization {") :])
    return {re.search(r"user:\s*(\S+)", p)[1]: p for p in parts if re.search(r"user:\s*(\S+)", p)}  # type: ignore[index]


def test_the_per_cluster_file_is_the_components_with_per_cluster_users() -> None:
    shared, per_cluster = CONFIG.read_text(), PER_CLUSTER.read_text()
    assert (
        shared[shared.index("port: 4222") : shared.index("authorization {")]
        == per_cluster[per_cluster.index("port: 4222") : per_cluster.index("authorization {")]
    )
    ours, theirs = user_blocks(shared), user_blocks(per_cluster)
    assert set(theirs) == set(PER_CLUSTER_USERS)
    for user in ("ledger", "subscriber", "replay", "listener"):
        assert theirs[user] == ours[user], user
    for user, block in theirs.items():  # (a cluster's users neither create nor update a stream)
        service = user.split("-cluster-")[0]
        if service != user:
            assert "STREAM.CREATE" not in block and "STREAM.UPDATE" not in block, user
            looked_up = set(re.findall(r"\$JS\.API\.STREAM\.INFO\.(VMQUOTA_\w+)", block))
            assert set(contract.STREAMS_USED[service]) <= looked_up, f"{user} waits for what it uses"


@dataclass
class PerCluster:
    """Connections to a nats-server with the two-cluster layout's users (a :class:`Connect`)."""

    url: str
    passwords: dict[str, str]
    opened: list[Client] = field(default_factory=list)

    async def __call__(self, user: str, password: str | None = None) -> Conn:
        errors: list[str] = []
        arrived = asyncio.Event()

        async def on_error(e: Exception) -> None:
            errors.append(str(e))
            arrived.set()

        nc = await nats.connect(
            self.url,
            user=user,
            password=password if password is not None else self.passwords[user],
            inbox_prefix=inbox_prefix(user),
            error_cb=on_error,
            connect_timeout=5,
        )
        self.opened.append(nc)
        return Conn(nc, nc.jetstream(timeout=5), errors, arrived)

    def options(self, user: str) -> NatsOptions:
        """How vmquota's services connect as ``user``."""
        return NatsOptions(url=self.url, user=user, password=self.passwords[user])


@pytest.fixture
async def per_cluster(tmp_path: Path) -> AsyncIterator[PerCluster]:
    """nats-server with the two-cluster layout's users."""
    passwords = {user: secrets.token_hex(16) for user in PER_CLUSTER_USERS}
    env = {f"VMQUOTA_NATS_{u.upper().replace('-', '_')}_PASSWORD": pw for u, pw in passwords.items()}
    server = NatsServer(tmp_path, config_file=PER_CLUSTER, env=env)
    try:
        server.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    conns = PerCluster(server.url, passwords)
    try:
        yield conns
    finally:
        for nc in conns.opened:
            if not nc.is_closed:
                await nc.close()
        server.stop()


def cluster_event(cluster: str, uid: str, kind: str = "ResourceQuota") -> tuple[str, bytes]:
    ev = contract.object_event(
        "upserted",
        cluster=cluster,
        kind="VirtualMachineInstance",
        namespace="tenant-a",
        name=uid,
        uid=uid,
        rv="1",
        snapshot=VmiSnapshot(uid=uid, namespace="tenant-a", name=uid, resource_version="1"),
    )
    return contract.event_subject(cluster, kind, "tenant-a"), contract.encode(ev)


async def test_a_clusters_watcher_publishes_only_its_clusters_events(per_cluster: Connect) -> None:
    wa = await per_cluster("watcher-cluster-a")
    await kept(per_cluster, contract.EVENTS_STREAM)
    subject, data = cluster_event("cluster-a", "u1")
    assert (await wa.js.publish(subject, data)).stream == contract.EVENTS_STREAM
    wa.clean()
    subject, data = cluster_event("cluster-b", "u2")
    await wa.nc.publish(subject, data)
    await wa.denied("publish", subject)
    await wa.nc.publish("vmquota.ev.cluster-b.>", b"")  # (a wildcard is no subject to publish to either)
    assert (await wa.js.stream_info(contract.EVENTS_STREAM)).state.messages == 1

    wb = await per_cluster("watcher-cluster-b")
    assert (await wb.js.publish(subject, data)).stream == contract.EVENTS_STREAM
    await wb.nc.publish(contract.event_subject("cluster-a", "Pod", "tenant-a"), b"{}")
    await wb.denied("publish", "vmquota.ev.cluster-a.tenant-a.pod")
    # dead letters too: a cluster's watcher writes its own cluster's subjects only (it can still fill the shared
    # stream's bytes with letters of its own, which drops the oldest of every cluster: docs/operations.md)
    await wb.nc.publish(contract.dlq_subject("watcher", "cluster-a", "tenant-a"), b"{}")
    await wb.denied("publish", "vmquota.dlq.watcher.cluster-a.tenant-a")
    await kept(per_cluster, contract.DLQ_STREAM)
    letter = contract.dlq_subject("watcher", "cluster-b", "tenant-a")
    assert (await wb.js.publish(letter, b"{}")).stream == contract.DLQ_STREAM


async def test_a_clusters_enforcer_reads_and_decides_only_for_its_cluster(per_cluster: Connect) -> None:
    wa, wb = await per_cluster("watcher-cluster-a"), await per_cluster("watcher-cluster-b")
    await kept(per_cluster, contract.EVENTS_STREAM)
    for w, cluster in ((wa, "cluster-a"), (wb, "cluster-b")):
        subject, data = cluster_event(cluster, f"q-{cluster}")
        await w.js.publish(subject, data)
    led = await per_cluster("ledger")
    await led.js.add_stream(stream_config(contract.USAGE_STREAM))
    for cluster in ("cluster-a", "cluster-b"):
        await led.js.publish(contract.usage_subject(cluster, "tenant-a"), cluster.encode())

    ea = await per_cluster("enforcer-cluster-a")
    await kept(per_cluster, contract.DECISIONS_STREAM)
    # the enforcer's own consumers, as services/enforcer/service.py names and filters them
    b = Bus(ea.nc)
    for kind, stream, filter_ in (
        ("quotas", contract.EVENTS_STREAM, "vmquota.ev.cluster-a.*.resourcequota"),
        ("usage", contract.USAGE_STREAM, "vmquota.usage.cluster-a.>"),
    ):
        c = PullConsumer(b, stream=stream, durable=f"enforcer-cluster-a-{kind}", filter_subjects=[filter_])
        async with asyncio.timeout(10):
            async for batch in c.batches():
                if batch:
                    assert len(batch) == 1
                    break
        await c.close()
    assert (
        await ea.js.publish(contract.decision_subject("cluster-a", "tenant-a"), b"{}")
    ).stream == contract.DECISIONS_STREAM
    ea.clean()

    await ea.nc.publish(contract.decision_subject("cluster-b", "tenant-a"), b"{}")
    await ea.denied("publish", "vmquota.quota.cluster-b.tenant-a")
    other = "$JS.API.CONSUMER.CREATE.VMQUOTA_USAGE.enforcer-cluster-a-usage.vmquota.usage.cluster-b.>"
    await refused_request(ea, other, b"{}")  # its durable, on another cluster's usage
    await refused_request(ea, "$JS.API.CONSUMER.CREATE.VMQUOTA_USAGE.enforcer-cluster-b-usage.vmquota.usage.>", b"{}")
    await refused_request(ea, f"$JS.API.CONSUMER.DELETE.{contract.EVENTS_STREAM}.enforcer-cluster-b-quotas")
    await refused_request(ea, f"$JS.API.CONSUMER.DELETE.{contract.EVENTS_STREAM}.{LEDGER_DURABLE}")
    await refused_request(ea, f"$JS.API.CONSUMER.CREATE.{contract.EVENTS_STREAM}", b"{}")


# ---- the operator commands under the shipped users -------------------------------------------------------------


async def _command(server: SecuredServer, user: str, *argv: str) -> tuple[int, str, str]:
    """``vmquota ARGV`` as ``user``, as an operator runs it: exit code, stdout, stderr."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "services.cli.main", *argv),
        *("--nats", server.url, "--nats-user", user, "--nats-password", server.passwords[user]),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_operator_commands_read_as_replay_and_say_which_user_as_subscriber(
    connect: Connect, server: SecuredServer
) -> None:
    """``vmquota tail`` (and ``status``/``replay``, the same reader) reads with ordered consumers: it works as
    ``replay``; as ``subscriber``, which may not create them, it exits 1 with one line that names the user to use,
    not a traceback."""
    await watcher_publishes(connect)

    async def tail(user: str, *argv: str) -> tuple[int, str, str]:
        return await _command(server, user, "tail", "--events", "--no-follow", "-o", "json", *argv)

    code, out, err = await tail("replay")
    assert code == 0, err
    assert len(out.splitlines()) == 3, out
    code, out, err = await tail("replay", "-n", "nothing-here")  # (a read that gets nothing ends, as `replay`)
    assert (code, out) == (0, ""), err
    # (from a time: the first message since then looked up by the server, which `replay` may ask)
    code, out, err = await tail("replay", "--since", "1h")
    assert code == 0 and len(out.splitlines()) == 3, (out, err)
    code, out, err = await tail("replay", "--since", "2999-01-01T00:00:00Z")
    assert (code, out) == (0, ""), err
    for argv in ((), ("--since", "1h")):
        code, out, err = await tail("subscriber", *argv)
        assert code == 1 and not out
        assert len(err.strip().splitlines()) == 1, err
        assert "use the `replay` user (--nats-user replay)" in err, err


async def test_an_operator_command_as_a_user_that_may_not_read_says_so_on_an_empty_bus_too(
    connect: Connect, server: SecuredServer
) -> None:
    """On streams with nothing in them yet (a bus just set up), `status` and `tail` as `subscriber` (which may not
    make the commands' consumers) said "no managed quotas found" and exited 0, as if vmquota had nothing to show;
    as `listener` (which may not read a stream's state) the line gave no hint of the user to use."""
    await kept(connect, contract.USAGE_STREAM, contract.DECISIONS_STREAM)
    code, out, err = await _command(server, "replay", "status")
    assert code == 0 and "no managed quotas" in out + err, (out, err)
    for user, argv in (("subscriber", ("status",)), ("subscriber", ("tail", "--no-follow")), ("listener", ("status",))):
        code, out, err = await _command(server, user, *argv)
        assert code == 1 and not out, (user, argv, out, err)
        assert len(err.strip().splitlines()) == 1, err
        assert "(--nats-user replay)" in err, err


async def test_only_the_ledger_asks_a_clusters_watcher_to_relist(connect: Connect, per_cluster: Connect) -> None:
    """``vmquota.relist.<cluster>``: the ledger publishes, the watcher (of that cluster, in the two-cluster layout)
    hears it; nobody else may ask, and a cluster's watcher cannot listen in on another's."""
    request = contract.encode(contract.RelistRequest(token="loss-7", requester="vmquota/ledger/all"))
    forged = contract.encode(contract.RelistRequest(token="forged-1", requester="vmquota/ledger/all"))
    w, led = await connect("watcher"), await connect("ledger")
    heard: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_request(m: Msg) -> None:
        await heard.put(m.data)

    async def asked(by: Conn, subject: str) -> str:
        """The token the watcher hears once ``by`` asks, asking again until it does: a brand-new subscription can
        (rarely, on a loaded machine) miss a message published right after it is registered."""
        async with asyncio.timeout(10):
            while True:
                await by.nc.publish(subject, request)
                await by.nc.flush()  # (on the wire, and the server done with it, before the wait)
                with contextlib.suppress(TimeoutError):
                    return contract.decode_relist_request(await asyncio.wait_for(heard.get(), 0.5)).token

    await w.nc.subscribe(contract.relist_subject("c1"), cb=on_request)
    await w.nc.flush()
    assert await asked(led, contract.relist_subject("c1")) == "loss-7"
    assert not w.errors and not led.errors
    for user in ("watcher", "enforcer", "subscriber", "replay"):
        c = w if user == "watcher" else await connect(user)
        await c.nc.publish(contract.relist_subject("c1"), forged)
        await c.denied("publish", "vmquota.relist.c1")
    tokens = []
    while not heard.empty():  # (the ledger's asks heard late, if any: none of the others')
        tokens.append(contract.decode_relist_request(heard.get_nowait()).token)
    assert "forged-1" not in tokens, tokens

    wa, ledger = await per_cluster("watcher-cluster-a"), await per_cluster("ledger")
    await wa.nc.subscribe(contract.relist_subject("cluster-a"), cb=on_request)
    await wa.nc.subscribe(contract.relist_subject("cluster-b"))
    await wa.denied("subscription", "vmquota.relist.cluster-b")
    assert await asked(ledger, contract.relist_subject("cluster-a")) == "loss-7"


async def test_no_user_hears_another_users_inbox(per_cluster: Connect) -> None:
    """Each user may subscribe to its own inbox only: with ``_INBOX.>`` open to every user, cluster-a's watcher heard
    the ledger's pull deliveries of cluster-b's events (and every JetStream answer of every other user). The ledger,
    connected as vmquota's services connect, still reads."""
    wa, wb = await per_cluster("watcher-cluster-a"), await per_cluster("watcher-cluster-b")
    await kept(per_cluster, contract.EVENTS_STREAM)
    heard: list[bytes] = []

    async def hear(m: Msg) -> None:
        heard.append(m.data)

    for subject in ("_INBOX.>", "_INBOX.ledger.>"):
        await wa.nc.subscribe(subject, cb=hear)
        await wa.denied("subscription", subject)
    b_subject, b_data = cluster_event("cluster-b", "secret-vm-uid")
    await wb.js.publish(b_subject, b_data)
    ledger = await per_cluster("ledger")
    sub = await ledger.js.pull_subscribe("vmquota.ev.>", durable="ledger-x", stream=contract.EVENTS_STREAM)
    assert b"secret-vm-uid" in (await sub.fetch(1, timeout=5))[0].data
    await ledger.nc.flush()
    await wa.nc.flush()
    assert not heard, "cluster-a's watcher heard another user's inbox"
    ledger.clean()


async def test_a_clusters_watcher_cannot_suppress_another_clusters_events_by_their_ids(per_cluster: PerCluster) -> None:
    """A stream drops a message whose ``Nats-Msg-Id`` it stored within its duplicate window, whoever published the
    first: cluster-a's watcher, allowed only its own subjects, published a decoy with the id of a cluster-b event,
    and cluster-b's real event was then dropped as a repeat. vmquota's clients tag their ids with a key from their own
    secret: cluster-b's event is stored, and its own repeat is still dropped."""
    wa = await per_cluster("watcher-cluster-a")
    await kept(per_cluster, contract.EVENTS_STREAM)
    b_subject, b_data = cluster_event("cluster-b", "victim-uid")
    b_id = "cluster-b/VirtualMachineInstance/victim-uid/1/upserted"  # (contract.msg_id of the event)
    a_subject, a_data = cluster_event("cluster-a", "decoy")
    assert not (await wa.js.publish(a_subject, a_data, headers={"Nats-Msg-Id": b_id})).duplicate
    opts = per_cluster.options("watcher-cluster-b")
    bus = await Bus.connect(opts, connect_timeout=5)
    try:
        ack = await bus.publish(b_subject, b_data, msg_id=b_id)
        assert not ack.duplicate, "cluster-b's event was dropped: cluster-a's watcher suppressed it"
        again = await Bus.connect(opts, connect_timeout=5)  # (another replica of the same identity)
        try:
            assert (await again.publish(b_subject, b_data, msg_id=b_id)).duplicate, "a repeat is still dropped"
        finally:
            await again.close()
    finally:
        await bus.close()


async def test_no_clusters_watcher_or_enforcer_can_create_or_update_the_shared_streams(per_cluster: PerCluster) -> None:
    """In the two-cluster layout every cluster's watcher writes the one events stream, every enforcer the one
    decisions stream, and all of them the dead letters. Who may update a stream may seal it (which nothing undoes:
    every cluster's events stop until an operator deletes it) or shorten it; who may create a missing one (after an
    operator deleted it, or the server lost its store) decides all of it, down to republishing cluster-a's messages
    under cluster-b's subjects or into the usage stream. Only the ledger, the streams' keeper, creates and updates
    them; the watchers and enforcers wait for them."""
    wa, ea = await per_cluster("watcher-cluster-a"), await per_cluster("enforcer-cluster-a")
    writers = ((wa, contract.EVENTS_STREAM), (wa, contract.DLQ_STREAM), (ea, contract.DECISIONS_STREAM))
    for conn, stream in writers:  # (missing: a create that would reroute another cluster's messages)
        spec = {s.name: s for s in contract.streams()}[stream]
        rerouted = {
            "name": stream,
            "subjects": list(spec.subjects),
            "republish": {"src": ">", "dest": "vmquota.usage.x"},
        }
        await refused_request(conn, f"$JS.API.STREAM.CREATE.{stream}", json.dumps(rerouted).encode())
        conn.errors.clear()
    waiting = [
        asyncio.create_task(Bus(conn.nc).wait_for_streams(contract.STREAMS_USED[user.split("-cluster-")[0]]))
        for conn, user in ((wa, "watcher-cluster-a"), (ea, "enforcer-cluster-a"))
    ]
    done, _ = await asyncio.wait(waiting, timeout=DENIED_TIMEOUT)  # (what should not happen, for a while)
    assert not done, "the services wait for the streams the ledger creates"
    ledger = await Bus.connect(per_cluster.options("ledger"), connect_timeout=5)
    try:
        await ledger.ensure_streams(contract.streams_for("ledger", sizes=SMALL))
    finally:
        await ledger.close()
    async with asyncio.timeout(10):
        await asyncio.gather(*waiting)
    for conn, stream in writers:
        have = (await conn.js.stream_info(stream)).config
        assert have.republish is None and not have.sealed and have.max_age == 30 * contract.DAY, (stream, have)
        sealed = json.dumps({**have.as_dict(), "sealed": True}).encode()
        await refused_request(conn, f"$JS.API.STREAM.UPDATE.{stream}", sealed)
        await refused_request(conn, f"$JS.API.STREAM.CREATE.{stream}", json.dumps(have.as_dict()).encode())
        conn.errors.clear()
