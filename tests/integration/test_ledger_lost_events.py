"""Events the stream dropped before the ledger read them, against a real nats-server.

The events stream keeps what its limits allow (``StreamSizes.events``, ``--events-max-age``) and drops its oldest
messages beyond them; anyone who can make objects can fill it. A ledger that replays it from the start (its
checkpoints lost, a new partition layout) or that was down for long would fold what is left and publish usage
without the objects whose events are gone: a ``hard`` too high. Instead it publishes no usage of the cluster until
the cluster's watcher has published everything again, which it asks for on ``vmquota.relist.<cluster>``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import pytest
from nats.aio.msg import Msg

from services.ledger.service import MENDED, LedgerOptions
from services.platform.bus import Bus, position
from services.platform.consumer import PullConsumer
from shared import contract
from shared.contract.streams import MiB, StreamSizes
from shared.ledger.fold import CLUSTER_WIDE, NamespaceState, PartitionSet, checkpoint_key, pack_checkpoint
from shared.snapshot import PodSnapshot
from tests.integration.ledgers import CLUSTER, Running, connect_bus, last_usage, options, publish
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SMALL = StreamSizes(events=MiB // 16)
"""The events stream's size, scaled down (4 GiB deployed): when it is full its oldest messages are dropped."""


def pod(ns: str, name: str, rv: int) -> contract.Upserted | contract.Deleted:
    snap = PodSnapshot(uid=f"uid-{name}", namespace=ns, name=name, resource_version=str(rv), phase="Running")
    return contract.object_event(
        "upserted", cluster=CLUSTER, kind="Pod", namespace=ns, name=name, uid=snap.uid, rv=str(rv), snapshot=snap
    )


async def small_stream(url: str) -> Bus:
    b = await connect_bus(url)
    b.stream_sizes = SMALL
    await b.ensure_streams(contract.streams(sizes=SMALL))
    return b


async def flood(b: Bus, past: int, rv: int) -> int:
    """A tenant's pods, created one after another, until the stream has dropped sequence ``past``; the next rv."""
    n = 0
    while (await b.js.stream_info(contract.EVENTS_STREAM)).state.first_seq <= past:
        batch = []
        for _ in range(50):
            n += 1
            rv += 1
            batch.append(pod("mallory", f"flood-{n}", rv))
        await publish(b, batch)
    return rv + 1


class Requests:
    """The relist requests the ledger sends for the cluster (what its watcher hears)."""

    def __init__(self) -> None:
        self.received: list[contract.RelistRequest] = []
        self.times: list[float] = []

    async def listen(self, b: Bus) -> None:
        async def heard(msg: Msg) -> None:
            self.received.append(contract.decode_relist_request(msg.data))
            self.times.append(asyncio.get_running_loop().time())

        await b.nc.subscribe(contract.relist_subject(CLUSTER), cb=heard)


async def listened_stream(url: str) -> tuple[Bus, Requests]:
    """:func:`small_stream`, and the relist requests the ledger sends for the cluster, heard."""
    b = await small_stream(url)
    requests = Requests()
    await requests.listen(b)
    return b, requests


async def relist(b: Bus, events: list[contract.Upserted | contract.Deleted], *answers: str) -> None:
    """What the watcher publishes when asked: every object again (message ids of the round), then the marker
    answering the requests named ``answers``."""
    await publish(b, events, msg_ids=False)
    marker = contract.sync_event(cluster=CLUSTER, kind="Namespace", namespace="", rv="1", present=[], answers=answers)
    await b.js.publish(contract.event_subject(CLUSTER, "Namespace", ""), contract.encode(marker))


def names(usage: dict[str, contract.UsageSnapshot], ns: str) -> set[str]:
    return {v.name for v in usage[ns].vms} if ns in usage else set()


def slow_retry() -> LedgerOptions:
    return replace(options(), relist_retry=(0.2, 0.4))


async def test_a_ledger_replaying_a_stream_that_dropped_its_head_publishes_nothing_until_the_watcher_relists(
    nats_url: str,
) -> None:
    """No checkpoints (a new bucket, a new partition layout): the ledger replays from the start of a stream whose
    oldest events a tenant's flood pushed out. Before, it published the victim's usage without its long-running
    pods and reported nothing."""
    b, requests = await listened_stream(nats_url)
    try:
        await publish(b, [pod("victim", "old-1", 101), pod("victim", "old-2", 102)])
        rv = await flood(b, 2, 200)
        await publish(b, [pod("victim", "new", rv)])
        last = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        run = Running(b, slow_retry())
        await wait_until(lambda: run.applied_through(last) and len(requests.received) >= 2, what="asked twice")
        assert run.service.lost.startswith(f"{last}-"), "(the stream's last sequence then, and a random part)"
        assert {r.token for r in requests.received} == {run.service.lost}
        assert run.service.incomplete() == [CLUSTER]
        assert await last_usage(b) == {}, "no usage of a cluster whose events were lost"

        everything = [pod("victim", "old-1", 101), pod("victim", "old-2", 102), pod("victim", "new", rv)]
        await relist(b, everything, "another-loss")
        marked = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        await wait_until(lambda: run.applied_through(marked), what="another answer folded")
        assert await last_usage(b) == {}, "a relist that answers another request is not enough"

        await relist(b, [], run.service.lost)
        await wait_until(lambda: run.service.incomplete() == [], what="the relist folded")
        await wait_until(lambda: _names_now(b, "victim", {"old-1", "old-2", "new"}), what="the victim's usage")
        await run.stop()
    finally:
        await b.close()


@pytest.mark.parametrize("stale_marker", [False, True], ids=["listed", "and_an_old_leaders_marker"])
async def test_an_object_whose_creation_the_stream_lost_is_in_the_usage_after_the_relist_that_answers_the_loss(
    nats_url: str, stale_marker: bool
) -> None:
    """A tenant's flood pushed the victim's pods out of the stream before the ledger read them, and a relist of the
    namespace's pods (a watch restart) came after: its sync listed them, raising the floor above their versions.
    The relist that answers the loss published them again at those versions, which were refused as a stale
    producer's: the ledger, whole again, published the victim's usage without them. ``and_an_old_leaders_marker``:
    an old watcher leader's Pod marker in flight lands next, a list at 150 (below the floor, before the pods
    existed) that does not list them; it dropped the placeholders the newer marker made."""
    b, requests = await listened_stream(nats_url)
    try:
        old = [pod("victim", "old-1", 301), pod("victim", "old-2", 302)]
        await publish(b, old)
        rv = await flood(b, 2, 400)
        listed = contract.sync_event(
            cluster=CLUSTER, kind="Pod", namespace="victim", rv=str(rv), present=["uid-old-1", "uid-old-2"]
        )
        await b.js.publish(contract.event_subject(CLUSTER, "Pod", "victim"), contract.encode(listed))
        if stale_marker:
            stale = contract.sync_event(cluster=CLUSTER, kind="Pod", namespace="victim", rv="150", present=[])
            await b.js.publish(contract.event_subject(CLUSTER, "Pod", "victim"), contract.encode(stale))
        run = Running(b, slow_retry())
        await wait_until(lambda: bool(requests.received) and run.service.lost != "", what="the loss noted")
        await relist(b, old, run.service.lost)
        await wait_until(lambda: run.service.incomplete() == [], what="the relist folded")
        await wait_until(lambda: _names_now(b, "victim", {"old-1", "old-2"}), what="the victim's usage with its pods")
        await run.stop()
    finally:
        await b.close()


async def _names_now(b: Bus, ns: str, want: set[str]) -> bool:
    return names(await last_usage(b), ns) == want


async def read_fifty(b: Bus) -> Running:
    """A ledger that read 50 events (the victim's p1, the tenant's pods) and published p1's usage."""
    await publish(b, [pod("victim", "p1", 101), *(pod("mallory", f"m{i}", 110 + i) for i in range(49))])
    run = Running(b, options())
    await wait_until(lambda: run.applied_through(50), what="read 50")
    await wait_until(lambda: _names_now(b, "victim", {"p1"}), what="p1's usage")
    return run


async def create_anew(b: Bus) -> None:
    """The events stream deleted and created again (its storage lost): it numbers from 1."""
    await b.js.delete_stream(contract.EVENTS_STREAM)
    await b.ensure_streams(contract.streams(sizes=SMALL))


async def usage_of_p1(b: Bus) -> None:
    """The victim's pod p1 published, folded and its usage published by a ledger, which then stops cleanly."""
    await publish(b, [pod("victim", "p1", 101)])
    run = Running(b, options())
    await wait_until(lambda: _names_now(b, "victim", {"p1"}), what="p1's usage")
    await run.stop()


async def test_a_ledger_down_while_the_stream_dropped_events_keeps_waiting_across_restarts(nats_url: str) -> None:
    """Checkpoints kept, but the ledger was down while the stream dropped events it had not read (the victim's new
    VM's pod among them). Before, it went on from the first message left and never knew; the mark it keeps now
    survives a restart that checkpointed past the loss."""
    b, requests = await listened_stream(nats_url)
    try:
        await usage_of_p1(b)
        await publish(b, [pod("victim", "vm2-launcher", 102)])  # while the ledger is down
        rv = await flood(b, 2, 200)
        last = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq

        run = Running(b, options())
        await wait_until(lambda: run.applied_through(last) and bool(requests.received), what="a relist asked")
        lost = run.service.lost
        await run.stop()  # (its checkpoint's progress is past the loss now)
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(last), what="restarted")
        assert run.service.lost == lost and run.service.incomplete() == [CLUSTER]
        assert names(await last_usage(b), "victim") == {"p1"}, "the usage from before the loss, as it was"

        await relist(b, [pod("victim", "p1", 101), pod("victim", "vm2-launcher", 102)], lost)
        await wait_until(lambda: _names_now(b, "victim", {"p1", "vm2-launcher"}), what="the victim's whole usage")
        assert "mallory" in await last_usage(b)
        await run.stop()
        assert rv > 200
    finally:
        await b.close()


def elsewhere(rv: int, cluster: str = "c2") -> contract.Upserted | contract.Deleted:
    """An event of another cluster."""
    snap = PodSnapshot(uid="x", namespace="elsewhere", name="x", resource_version=str(rv))
    return contract.object_event(
        "upserted", cluster=cluster, kind="Pod", namespace="elsewhere", name="x", uid="x", rv=str(rv), snapshot=snap
    )


def reader(b: Bus, durable: str, cluster: str | None, *, batch: int = 500, start_seq: int = 1) -> PullConsumer:
    return PullConsumer(
        b,
        stream=contract.EVENTS_STREAM,
        durable=durable,
        filter_subjects=[contract.events_filter(cluster)],
        note_losses=True,
        batch=batch,
        start_seq=start_seq,
    )


async def test_the_consumer_notes_events_dropped_before_it_read_them_behind_or_caught_up(nats_url: str) -> None:
    """A reader whose next events the stream dropped learns of it before it reads past them: one behind the stream
    (events pending for it), and one that had read everything when its next event came and went between two of its
    fetches (it was busy: folding, publishing). Before, only the first was told."""
    b = await small_stream(nats_url)
    try:
        await publish(b, [pod("victim", f"p{i}", 101 + i) for i in range(3)])
        behind = reader(b, "behind", CLUSTER, batch=1)
        batches = behind.batches()
        assert len(await anext(batches)) == 1 and behind.pending == 2
        assert behind.take_loss() is None
        await flood(b, 3, 200)
        got = await anext(batches)
        loss = behind.take_loss()
        assert loss is not None and loss.first == 2 and not loss.recreated, loss
        assert got and loss.stream_first <= position(got[0]).stream <= loss.stream_last
        await batches.aclose()
        await behind.close()

        head = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq + 1
        caught_up = reader(b, "caught-up", None, start_seq=head)
        batches = caught_up.batches()
        await publish(b, [pod("victim", "p9", 900)])
        assert len(await anext(batches)) == 1 and caught_up.pending == 0
        await publish(b, [pod("victim", "dropped", 901)])  # (while the reader is busy)
        await flood(b, head + 1, 1000)
        while not (got := await anext(batches)):
            pass
        loss = caught_up.take_loss()
        assert loss is not None and loss.first == head + 1, loss
        await batches.aclose()
        await caught_up.close()
    finally:
        await b.close()


async def test_a_jump_over_other_clusters_events_the_stream_still_holds_is_no_loss(nats_url: str) -> None:
    b = await small_stream(nats_url)
    try:
        head = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq + 1
        one = reader(b, "one-cluster", "c2", start_seq=head)
        batches = one.batches()
        await publish(b, [elsewhere(1)])
        assert len(await anext(batches)) == 1
        await publish(b, [pod("victim", f"p{i}", 101 + i) for i in range(5)])  # (another cluster's, kept)
        await publish(b, [elsewhere(2)])
        while not (got := await anext(batches)):
            pass
        assert position(got[0]).stream == head + 6 and one.take_loss() is None
        await batches.aclose()
        await one.close()
    finally:
        await b.close()


async def test_an_instance_waits_for_its_own_reading_of_a_relist_another_instance_answered(nats_url: str) -> None:
    """The cluster-wide checkpoint is every instance's: instance A (partition 1 of 2, the victim's) lost events and
    stopped; instance B (partition 0) lost events later, read a relist that answered both losses, and checkpointed
    it. When A starts again, its own namespace states are still from before the relist, which is ahead of it in
    the stream: it must not publish the victim's usage until it has read that far. Before, it did, without the
    lost pod."""
    b, requests = await listened_stream(nats_url)
    seen: list[set[str]] = []

    async def heard(msg: Msg) -> None:
        seen.append({v.name for v in contract.decode_usage(msg.data).vms})

    await b.nc.subscribe(contract.usage_subject(CLUSTER, "victim"), cb=heard)
    a_opts = replace(options(PartitionSet.parse("1", 2)), batch=4)
    b_opts = replace(options(PartitionSet.parse("0", 2)), batch=4)
    try:
        await publish(b, [pod("victim", "p1", 101)])
        run = Running(b, a_opts)
        await wait_until(lambda: seen == [{"p1"}], what="p1's usage")
        await run.stop()
        await publish(b, [pod("victim", "vm2-launcher", 102)])  # while A is down
        rv = await flood(b, 2, 200)
        await publish(b, [pod("victim", "p3", rv)])
        last = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        run = Running(b, a_opts)
        await wait_until(lambda: run.applied_through(last) and bool(requests.received), what="A notes its loss")
        lost_a = run.service.lost
        await run.stop()
        run_b = Running(b, b_opts)  # (no progress for its layout: replays a stream whose head is gone)
        await wait_until(lambda: bool(run_b.service.lost), what="B notes its loss")
        await publish(b, [pod("alice", f"a{i}", rv + 1 + i) for i in range(24)])  # (partition 0: not A's)
        published = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        # (B read them: the losses they made, the small stream turning over, noted before the relist answers them)
        await wait_until(lambda: run_b.applied_through(published), what="B read the pods")
        everything = [pod("victim", "p1", 101), pod("victim", "vm2-launcher", 102), pod("victim", "p3", rv)]
        await relist(b, everything, lost_a, run_b.service.lost)
        marked = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
        await wait_until(lambda: run_b.applied_through(marked) and run_b.service.incomplete() == [], what="B whole")
        await run_b.stop()

        run = Running(b, a_opts)
        await wait_until(lambda: run.applied_through(marked), what="A caught up")
        await wait_until(lambda: {"p1", "vm2-launcher", "p3"} in seen, what="the victim's whole usage")
        await run.stop()
        assert {"p1", "p3"} not in seen, f"usage published without the lost pod: {seen}"
    finally:
        await b.close()


async def test_a_running_ledger_whose_events_stream_is_created_anew_starts_over(nats_url: str) -> None:
    """The events stream is deleted and created again while the ledger runs (its storage lost): every event of the
    old one is gone, and the new one numbers from 1. Before, the consumer went on at its old position on the new
    stream, noted nothing, and never read what the watchers published below it."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await read_fifty(b)
        await create_anew(b)
        await publish(b, [pod("victim", "vm2-launcher", 300)])  # seq 1 of the new stream
        await wait_until(lambda: bool(requests.received), what="a relist asked")
        assert run.service.incomplete() == [CLUSTER]
        await relist(b, [pod("victim", "vm2-launcher", 300)], requests.received[-1].token)
        await wait_until(lambda: _names_now(b, "victim", {"vm2-launcher"}), what="the new stream's state")
        await run.stop()
        kv = await b.js.key_value(contract.LEDGER_BUCKET)
        progress = int((await kv.get(options().progress_key)).value or b"0")
        assert progress < 50, "the progress is the new stream's"
    finally:
        await b.close()


@pytest.mark.parametrize("grown", [False, True], ids=["shorter", "grown_past_them"])
async def test_an_instance_of_a_new_layout_drops_the_states_of_a_stream_created_anew(
    nats_url: str, grown: bool
) -> None:
    """A new partition layout has no progress of its own, yet it loads the namespace states the old layout kept. On a
    stream created anew their sequences are the old stream's and skipped the new one's events (here the victim's new
    launcher pod, at sequence 1). A state ahead of the stream now starts over as a progress ahead of it does; and,
    the new stream grown past every loaded state (a tenant's churn), the other instances' record of the stream they
    read tells it: the new layout's consumer takes it for its own."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await read_fifty(b)
        await run.stop()
        await create_anew(b)
        churn = [pod("mallory", f"n{i}", 400 + i) for i in range(60)] if grown else []
        await publish(b, [pod("victim", "vm2-launcher", 300), *churn])  # seq 1 of the new stream
        again = Running(b, replace(options(PartitionSet.all(8)), relist_retry=(0.2, 0.4)))
        await wait_until(lambda: bool(requests.received), what="a relist asked")
        await relist(b, [pod("victim", "vm2-launcher", 300)], requests.received[-1].token)
        await wait_until(lambda: _names_now(b, "victim", {"vm2-launcher"}), what="the new stream's state")
        await again.stop()
    finally:
        await b.close()


@pytest.mark.parametrize("running", [False, True], ids=["while_down", "while_running"])
async def test_a_stream_created_anew_and_refilled_past_the_ledgers_position_is_a_loss(
    nats_url: str, running: bool
) -> None:
    """The events stream is created anew and the watchers (a tenant's pods make as many events as it likes) publish
    more on it than the ledger had read before it looks again: its sequences alone do not tell, its creation time
    does. Before, the ledger went on from its old position on the new stream, on the old stream's states, and
    published the victim's usage without the pod the new stream holds first."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await read_fifty(b)
        if not running:
            await run.stop()
        await create_anew(b)
        await publish(
            b,
            [
                pod("victim", "vm2-launcher", 300),  # the new stream's first
                *(pod("mallory", f"n{i}", 400 + i) for i in range(53)),
                pod("victim", "p3", 500),
                *(pod("mallory", f"o{i}", 600 + i) for i in range(5)),
            ],
        )
        if not running:
            run = Running(b, options())
        await wait_until(lambda: bool(requests.received), what="a relist asked", within=60)
        assert run.service.incomplete() == [CLUSTER]
        assert names(await last_usage(b), "victim") == {"p1"}, "nothing published from the old stream's states"
        everything = [pod("victim", "vm2-launcher", 300), pod("victim", "p3", 500)]
        await relist(b, everything, requests.received[-1].token)
        await wait_until(lambda: _names_now(b, "victim", {"vm2-launcher", "p3"}), what="the new stream's state")
        await run.stop()
    finally:
        await b.close()


@pytest.mark.parametrize("mark", [b"not a token!", b""], ids=["garbled", "empty"])
async def test_an_unreadable_mark_is_a_new_loss_that_needs_a_relist_of_its_own(nats_url: str, mark: bytes) -> None:
    """A mark of lost events the ledger cannot read (a bad write) is a loss too; it names it anew, and only a relist
    answering that name makes the cluster whole. Before, an unreadable mark became the largest number, the watcher
    answered that, and every later loss of every instance counted as answered. An empty one too: a reader of the bus
    can have JetStream store an empty message under the mark's key (a pull request's status reply aimed there), and
    the ledger took it for "nothing lost" and published usage without the objects whose events were lost."""
    b, requests = await listened_stream(nats_url)
    try:
        await usage_of_p1(b)
        kv = await b.js.key_value(contract.LEDGER_BUCKET)
        await kv.put(options().lost_key, mark)
        run = Running(b, options())
        # (a JetStream call the server leaves unanswered while the ledger starts, reading its checkpoints, holds the
        # first request up until the call's timeout)
        await wait_until(lambda: bool(requests.received), within=60, what="asked")
        token = requests.received[-1].token
        assert contract.RELIST_TOKEN.match(token) and run.service.incomplete() == [CLUSTER]
        await relist(b, [pod("victim", "p1", 101)], token)
        await wait_until(lambda: run.service.incomplete() == [], what="answered")
        await run.stop()
        assert (await kv.get(options().lost_key)).value == MENDED, "mended once a checkpoint kept the relist read"
    finally:
        await b.close()


async def victim_lost(b: Bus) -> Running:
    """The victim's pod published, then flooded out of the stream before a ledger read it; a ledger started (asking
    again after 0.2 s, doubling up to 0.4 s)."""
    await publish(b, [pod("victim", "p1", 101)])
    await flood(b, 1, 200)
    return Running(b, slow_retry())


async def test_requests_back_off_while_no_watcher_answers(nats_url: str) -> None:
    """Asked again and again (a request is core NATS: one sent while the watcher restarts is lost), later and
    later, and no more once the answer is folded."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await victim_lost(b)
        # (as long as a first request may be held up, as in the test of an unreadable mark)
        await wait_until(lambda: len(requests.received) >= 4, what="four requests", within=60)
        at = requests.times[:4]
        gaps = [later - earlier for earlier, later in itertools.pairwise(at)]
        assert gaps[0] >= 0.15 and gaps[1] >= 0.35 and gaps[2] >= 0.35, gaps  # (0.2 s, doubled, at most 0.4 s)
        await relist(b, [pod("victim", "p1", 101)], run.service.lost)
        await wait_until(lambda: _names_now(b, "victim", {"p1"}), what="published")
        asked = len(requests.received)
        await wait_until(lambda: run.applied_through(0) and run.service.published >= 2, what="more rounds")
        await publish(b, [pod("victim", "p2", 9000)])
        await wait_until(lambda: _names_now(b, "victim", {"p1", "p2"}), what="a later change published")
        assert len(requests.received) <= asked + 1, "(one may have been on its way)"
        await run.stop()
    finally:
        await b.close()


async def test_a_consumer_held_up_by_a_call_the_server_does_not_answer_still_asks_for_relists(nats_url: str) -> None:
    """A loaded server can leave a JetStream call unanswered until the call's timeout (seconds; then the consumer is
    re-created). The ledger asked for relists, and published what was due, only between the consumer's batches, so a
    loss waited that long for its relist (over 20 s once, on a loaded machine). It runs its timers meanwhile, and
    stops promptly."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await victim_lost(b)
        await wait_until(lambda: len(requests.received) >= 1, what="asked", within=60)
        consumer = run.service.consumer
        assert consumer is not None and consumer._sub is not None
        never = asyncio.Event()

        async def unanswered(*_: object, **__: object) -> list[Msg]:
            await never.wait()
            return []

        consumer._sub.fetch = unanswered  # type: ignore[method-assign]
        held = len(requests.received) + 1  # (one fetch may still be on its way)
        # (a held-up ledger runs its timers every idle + 1 s: four rounds at most, whatever the machine's speed)
        await wait_until(lambda: len(requests.received) >= held + 3, what="asked while held up", within=30)
        await run.stop()
    finally:
        await b.close()


async def test_a_crash_while_starting_over_on_a_stream_created_anew_does_not_forget_the_loss(nats_url: str) -> None:
    """The running ledger finds the events stream created anew: it keeps the loss's token before it deletes its
    progress, stream key and checkpoints. Before, it deleted them first, and a crash at the token's put left a
    bucket that said nothing: the next instance read the new stream as if nothing was lost and published the
    victim's usage without its long-running pod."""
    b, requests = await listened_stream(nats_url)
    try:
        run = await read_fifty(b)
        keeping = asyncio.Event()

        async def crash_here() -> None:  # (the process dies at the put of the token)
            keeping.set()
            await asyncio.Event().wait()

        run.service._save_lost = crash_here  # type: ignore[method-assign]
        await create_anew(b)
        await publish(b, [pod("victim", "vm2-launcher", 300)])  # (the new stream's first)
        await asyncio.wait_for(keeping.wait(), 15)
        await run.crash()

        again = Running(b, options())
        await wait_until(lambda: bool(requests.received), what="the new instance asks for a relist")
        assert again.service.lost and again.service.incomplete() == [CLUSTER]
        assert names(await last_usage(b), "victim") == {"p1"}, "nothing published from the new stream alone"
        await again.stop()
    finally:
        await b.close()


async def test_a_loss_mended_and_checkpointed_stays_mended_whatever_a_lagging_instance_writes(
    nats_url: str,
) -> None:
    """An instance whose relist is read up to the progress it kept forgets its loss then, whatever other instances
    write: before, another instance's older cluster-wide checkpoint (once shared; still so while an earlier version
    runs beside this one during an upgrade) lacked the answer to its loss; restarted, it found its answer gone and
    behind its progress, waited for it for good, and the watcher, which had answered that token, did not relist
    again."""
    b, requests = await listened_stream(nats_url)
    a_opts = options(PartitionSet.parse("1", 2))
    try:
        kv = await b.ensure_kv(contract.LEDGER_BUCKET)
        await kv.put(a_opts.lost_key, b"0-aaaaaaaaaaaa")  # (a loss A noted before)
        await relist(b, [pod("victim", "p1", 101)], "0-aaaaaaaaaaaa")
        run = Running(b, a_opts)
        await wait_until(lambda: _names_now(b, "victim", {"p1"}), what="A whole: p1's usage")
        await wait_until(lambda: not run.service.lost, what="the loss mended at a checkpoint")
        await run.stop()
        assert (await kv.get(a_opts.lost_key)).value == MENDED
        older = NamespaceState(CLUSTER, CLUSTER_WIDE)  # (a lagging instance's cluster-wide state: no answer)
        for instance in ("", options(PartitionSet.parse("0", 2)).instance):  # (an earlier version's shared key)
            key = checkpoint_key(CLUSTER, CLUSTER_WIDE, instance).rstrip(".")
            await kv.put(key, pack_checkpoint(older.checkpoint()))
        await publish(b, [pod("victim", "p2", 102)])
        run = Running(b, a_opts)
        await wait_until(lambda: _names_now(b, "victim", {"p1", "p2"}), what="A goes on")
        assert run.service.incomplete() == [] and not requests.received
        await run.stop()
    finally:
        await b.close()


async def test_a_stale_publish_between_the_relists_kind_marker_and_its_answer_is_refused(
    nats_url: str,
) -> None:
    """The relist's Pod marker (``gone`` absent: deleted) is followed, before the final marker that answers, by an
    old watcher leader's publish in flight of ``gone`` at an older version: refused (below the floor, no
    placeholder), so the ledger, whole again, publishes the victim's usage without it."""
    b, requests = await listened_stream(nats_url)
    try:
        await publish(b, [pod("victim", "keep", 101), pod("victim", "gone", 102)])
        rv = await flood(b, 2, 200)
        run = Running(b, slow_retry())
        await wait_until(lambda: bool(requests.received) and run.service.lost != "", what="the loss noted")
        await publish(b, [pod("victim", "keep", 101)], msg_ids=False)
        marker = contract.sync_event(cluster=CLUSTER, kind="Pod", namespace="victim", rv=str(rv), present=["uid-keep"])
        await b.js.publish(contract.event_subject(CLUSTER, "Pod", "victim"), contract.encode(marker))
        await publish(b, [pod("victim", "gone", 150)], msg_ids=False)  # the old leader's, in flight
        await relist(b, [], run.service.lost)
        await wait_until(lambda: run.service.incomplete() == [], what="the relist folded")
        await wait_until(lambda: _victim_published(b), what="the victim's usage")
        assert names(await last_usage(b), "victim") == {"keep"}
        await run.stop()
    finally:
        await b.close()


async def _victim_published(b: Bus) -> bool:
    return "victim" in await last_usage(b)
