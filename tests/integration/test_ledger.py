"""The ledger service against a real nats-server: fold, publish usage, checkpoints, crashes, DLQ, partitions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from services.ledger.service import LedgerService
from services.platform.bus import Bus
from shared import contract
from shared.ledger.fold import (
    CLUSTER_WIDE,
    Ledger,
    NamespaceView,
    PartitionSet,
    checkpoint_key,
    pack_checkpoint,
    part_keys,
    read_manifest,
    unpack_checkpoint,
)
from shared.ledger.usage import usage_digest
from shared.snapshot import NamespaceSnapshot, PodSnapshot
from tests.conftest import NatsServer
from tests.integration.ledgers import (
    CLUSTER,
    Running,
    World,
    connect_bus,
    count_objects,
    expected_usage,
    last_usage,
    options,
    publish,
    usage_of,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

# ---- tests ------------------------------------------------------------------------------------------------------


async def test_folds_events_and_publishes_usage_per_namespace(nats_url: str) -> None:
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(1), ["tenant-a", "tenant-b", "tenant-c"])
        events = [world.next() for _ in range(120)]
        await publish(b, events)
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(len(events)), what="ledger caught up")
        reference, want = expected_usage(events)
        await wait_until(lambda: _usage_matches(b, want), what="usage published")
        await run.stop()
        assert {k: s.live_objects() for k, s in run.service.ledger.states.items()} == {
            k: s.live_objects() for k, s in reference.states.items()
        }
        kv = await b.js.key_value(contract.LEDGER_BUCKET)
        for _, ns in reference.namespaces():
            entry = await kv.get(f"ns.{CLUSTER}.{ns}")
            assert entry.value and b'"namespace":"' + ns.encode() + b'"' in entry.value
        assert int((await kv.get(run.service.opts.progress_key)).value or b"0") == len(events)
    finally:
        await b.close()


async def test_a_defect_accounting_one_namespace_stops_no_other_namespaces_usage(nats_url: str) -> None:
    """An accountant that raises what it was never meant to (a tenant's object reaching a defect) on one namespace:
    the service went down with it, and at every restart, so no namespace had its usage published any more."""

    def failing_on_a(view: NamespaceView) -> contract.UsageBody:
        if view.namespace == "tenant-a":
            raise OverflowError("a defect")
        return count_objects(view)

    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(3), ["tenant-a", "tenant-b"])
        events = [world.next() for _ in range(40)]
        await publish(b, events)
        run = Running(b, options(), failing_on_a)
        _, want = expected_usage(events)

        async def b_published() -> bool:
            run.applied_through(0)  # (surfaces a failure of the service)
            return usage_of(await last_usage(b)).get("tenant-b") == want["tenant-b"]

        await wait_until(b_published, what="tenant-b's usage")
        assert "tenant-a" not in usage_of(await last_usage(b))
        await run.stop()
    finally:
        await b.close()


async def _usage_matches(b: Bus, want: dict[str, str]) -> bool:
    return usage_of(await last_usage(b)) == want


async def test_duplicates_and_stale_versions_are_harmless(nats_url: str) -> None:
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(2), ["tenant-a", "tenant-b"])
        events = [world.next() for _ in range(80)]
        rnd = random.Random(3)
        # Without msg-ids the server stores repeats: a late old version and repeats reach the ledger itself.
        noisy = events + [rnd.choice(events) for _ in range(40)]
        await publish(b, noisy, msg_ids=False)
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(len(noisy)), what="ledger caught up")
        reference, want = expected_usage(events)
        await run.stop()
        got = {k: s.live_objects() for k, s in run.service.ledger.states.items()}
        assert got == {k: s.live_objects() for k, s in reference.states.items()}
        assert usage_of(await last_usage(b)) == want
    finally:
        await b.close()


@pytest.mark.parametrize("part_bytes", [0, 700], ids=["whole", "in_parts"])
async def test_crash_and_restart_at_random_points_gives_the_same_state_and_usage(
    nats_url: str, part_bytes: int
) -> None:
    """``in_parts``: every checkpoint larger than 700 bytes is stored as parts and a manifest, as one larger than
    the bus's largest message is (a crash between a part and its manifest leaves the checkpoint stored before it
    whole, and parts no manifest names, which the next start deletes)."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        rnd = random.Random(4)
        world = World(rnd, [f"ns-{i}" for i in range(8)])
        events = [world.next() if i % 300 else world.kubevirt() for i in range(900)]  # with cluster-wide state
        await publish(b, events[:600])
        published = 600
        for round_ in range(4):
            run = Running(b, options(part_bytes=part_bytes))
            await wait_until(lambda: run.service.consumer is not None, what="started")  # noqa: B023
            kill_at = rnd.randrange(run.service.start_seq, published + 1) if run.service.start_seq <= published else 0
            await wait_until(functools.partial(run.applied_through, kill_at), what=f"round {round_}")
            await run.crash()
            if round_ == 1:  # more events arrive while the ledger is down
                await publish(b, events[600:])
                published = len(events)
        run = Running(b, options(part_bytes=part_bytes))
        await wait_until(lambda: run.applied_through(published), what="final catch-up")
        reference, want = expected_usage(events)
        await wait_until(lambda: _usage_matches(b, want), what="same usage as a ledger that never stopped")
        await run.stop()
        mine = {k: s.checkpoint() for k, s in run.service.ledger.states.items()}
        # The same states (the digests of the usage they published aside, which the reference did not publish).
        for st in run.service.ledger.states.values():
            st.usage_digest = ""
        assert run.service.ledger.fingerprint() == reference.fingerprint()
        assert mine  # compared above with digests cleared
    finally:
        await b.close()


async def crashed_between_checkpoints(b: Bus, seed: int = 7) -> str:
    """A ledger that checkpointed at 10 of 60 events of ``tenant-a`` (made by ``World(Random(seed))``), published
    the usage of all 60 and crashed before its next checkpoint; the usage content (digest) it published last."""
    world = World(random.Random(seed), ["tenant-a"])
    events = [world.next() for _ in range(60)]
    await publish(b, events[:10])
    run = Running(b, options())
    await wait_until(lambda: run.applied_through(10), what="the first events folded")
    await run.stop()  # (a checkpoint at 10)
    await publish(b, events[10:])
    run = Running(b, dataclasses.replace(options(), checkpoint_interval=3600))
    run.service._last_checkpoint = time.monotonic()  # (no checkpoint before the crash)
    _, want = expected_usage(events)
    await wait_until(lambda: _usage_matches(b, want), what="the usage of all 60 events published")
    await run.crash()
    return want["tenant-a"]


async def usage_heard_in_a_replay(b: Bus, want: str, batch: int = 2) -> list[str]:
    """The usage contents a ledger restarted after :func:`crashed_between_checkpoints` publishes for ``tenant-a``
    (reading ``batch`` events at a time) until it has replayed the 60 events and published ``want`` again."""
    heard: list[str] = []

    async def on_usage(m: Msg) -> None:
        u = contract.decode_usage(m.data)
        heard.append(usage_of({u.namespace: u})[u.namespace])

    sub = await b.nc.subscribe(contract.usage_subject(CLUSTER, "tenant-a"), cb=on_usage)
    await b.nc.flush()
    run = Running(b, dataclasses.replace(options(), batch=batch))
    await wait_until(lambda: run.service.consumer is not None, what="started")
    assert run.service.start_seq == 11, "replays from the checkpoint at 10"
    await wait_until(lambda: run.applied_through(60), what="the replay")
    await wait_until(lambda: bool(heard) and heard[-1] == want, what="the usage published again")
    await run.stop()
    await sub.unsubscribe()
    return heard


async def test_a_ledger_restarted_after_a_crash_publishes_no_usage_older_than_what_was_published_before(
    nats_url: str,
) -> None:
    """A ledger that crashed between checkpoints replays the events after its last one. Each usage it published on
    the way was an older state than the one it had published before the crash: the enforcer, which takes a later
    publication of an earlier fold (its own republish), raised ``hard`` again for a migration that had ended, and a
    tenant watching the quota had a launcher pod's worth of room over the budget (16.3Gi on 64Gi) for the moments
    until the replay's next batch. A replay publishes nothing until it has folded what the stream held at its start."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        want = await crashed_between_checkpoints(b)
        heard = await usage_heard_in_a_replay(b, want)
        assert set(heard) == {want}, f"{len(set(heard) - {want})} older usages published"
    finally:
        await b.close()


async def test_a_replay_is_not_ended_by_a_fetch_that_timed_out_with_events_pending(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch's timeout is also asyncio's when the server answers later than ``idle`` (a loaded server) while the
    stream still holds the replay's events: taken for a consumer with nothing left, it ended the replay at the
    checkpoint's state, older than what was published before the crash."""
    from nats.js.client import JetStreamContext

    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        want = await crashed_between_checkpoints(b)
        fetch = JetStreamContext.PullSubscription.fetch
        slow = [True]

        async def slow_first_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
            if slow[0]:  # (the server answered the first pull after ``idle``: 50 events still pending)
                slow[0] = False
                raise nats.errors.TimeoutError
            return await fetch(self, *args, **kwargs)

        monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", slow_first_fetch)
        heard = await usage_heard_in_a_replay(b, want)
        assert set(heard) == {want}, f"{len(set(heard) - {want})} older usages published"
    finally:
        await b.close()


async def test_a_replay_ends_where_the_stream_holds_only_other_clusters_events(nats_url: str) -> None:
    """The events stream is shared by every cluster: a ledger of one cluster whose replay waited for the stream's
    last sequence at its start, another cluster's event, would never publish or checkpoint again until an event of
    its own cluster came. It ends its replay once its consumer has nothing left to read."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(3), ["tenant-a"])
        await publish(b, [world.next() for _ in range(10)])
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(10), what="the first events folded")
        await run.stop()
        others = [
            contract.object_event(
                "upserted",
                cluster="c2",
                kind="Pod",
                namespace="tenant-b",
                name=f"p{i}",
                uid=f"c2-{i}",
                rv=str(i + 1),
                snapshot=PodSnapshot(uid=f"c2-{i}", namespace="tenant-b", name=f"p{i}", resource_version=str(i + 1)),
            )
            for i in range(20)
        ]
        await publish(b, others)
        run = Running(b, options())
        await wait_until(lambda: run.service.consumer is not None, what="started")
        assert run.service.replay_to == 30, "the stream's last sequence at the start"
        await wait_until(lambda: run.service.replay_to == 0, what="the replay ended")
        await run.stop()
    finally:
        await b.close()


async def checkpointed_in_parts(
    b: Bus, *, seed: int
) -> tuple[World, list[contract.Upserted | contract.Deleted], Running, bytes]:
    """200 events of the namespace ``big`` folded and checkpointed in parts of 1,000 bytes, the ledger stopped:
    the world, its events, the stopped ledger and the manifest stored for ``big``."""
    await b.ensure_streams(contract.streams())
    world = World(random.Random(seed), ["big"])
    events = [world.next() for _ in range(200)]
    await publish(b, events)
    run = Running(b, options(part_bytes=1000))
    await wait_until(lambda: run.applied_through(len(events)), what="the events folded")
    await run.stop()
    kv = await b.ensure_kv(contract.LEDGER_BUCKET)
    return world, events, run, (await kv.get(checkpoint_key(CLUSTER, "big", options().instance))).value or b""


async def test_a_checkpoint_larger_than_a_message_is_stored_in_parts_and_loaded_from_them(nats_url: str) -> None:
    """A namespace whose checkpoint is larger than the bus's largest message (a tenant with tens of thousands of
    pods) is stored as parts and a manifest: it no longer fails the round, which kept every namespace's checkpoint
    and the instance's progress from being written. A restart loads it from its parts and replays nothing."""
    b = await connect_bus(nats_url)
    try:
        _, events, run, manifest = await checkpointed_in_parts(b, seed=7)
        assert manifest.startswith(b"m") and read_manifest(manifest)[0] > 1, manifest[:40]
        again = Running(b, options(part_bytes=1000))
        await wait_until(lambda: again.service.consumer is not None, what="started")
        assert again.service.start_seq == len(events) + 1, "loaded from its parts: nothing replayed"
        state = again.service.ledger.state(CLUSTER, "big")
        assert state is not None and state.checkpoint() == run.service.ledger.state(CLUSTER, "big").checkpoint()  # type: ignore[union-attr]
        await again.stop()
    finally:
        await b.close()


async def part_keys_stored(kv: KeyValue) -> set[str]:
    try:
        return {k for k in await kv.keys() if k.startswith("part.")}
    except nats.js.errors.NoKeysError:
        return set()


async def test_checkpoint_parts_outlive_neither_their_manifest_nor_a_write_that_did_not_finish(nats_url: str) -> None:
    """Parts are stored under keys named by their content, so a write that did not finish (its manifest never
    written: a crash, a put that timed out) leaves the checkpoint stored before it whole, and the next start loads
    it and deletes the parts no manifest names; and a checkpoint written again takes the parts of the one before
    with it. (Parts overwritten in place made the stored checkpoint unreadable, and the next start replayed every
    namespace of the instance from the start; parts of a shrunk checkpoint stayed in the bucket for good.)"""
    b = await connect_bus(nats_url)
    try:
        world, events, _, manifest = await checkpointed_in_parts(b, seed=8)
        kv = await b.ensure_kv(contract.LEDGER_BUCKET)
        key = checkpoint_key(CLUSTER, "big", options().instance)
        assert await part_keys_stored(kv) == set(part_keys(key, manifest))
        # a write that did not finish: another checkpoint's parts, no manifest for them
        left = f"part.{key}.{'0' * 16}.0"
        await kv.put(left, b"a part of a checkpoint whose manifest was never written")
        again = Running(b, options(part_bytes=1000))
        await wait_until(lambda: again.service.consumer is not None, what="started")
        assert again.service.start_seq == len(events) + 1, "the stored checkpoint loaded whole: nothing replayed"
        assert left not in await part_keys_stored(kv), "the parts no manifest names are deleted"
        # the namespace shrinks: its checkpoint takes fewer parts, and the old ones go
        gone: list[contract.Upserted | contract.Deleted] = []
        for uid, (ns, name) in sorted(world.live.items()):
            world.rv += 1
            gone.append(
                contract.object_event(
                    "deleted",
                    cluster=CLUSTER,
                    kind="Pod",
                    namespace=ns,
                    name=name,
                    uid=uid,
                    rv=str(world.rv),
                    snapshot=None,
                )
            )
        await publish(b, gone)
        await wait_until(lambda: again.applied_through(len(events) + len(gone)), what="the deletions folded")
        await again.stop()
        smaller = (await kv.get(key)).value or b""
        assert read_manifest(smaller)[0] < read_manifest(manifest)[0], "fewer parts (its pods' tombstones remain)"
        assert await part_keys_stored(kv) == set(part_keys(key, smaller)), "the old checkpoint's parts are gone"
    finally:
        await b.close()


async def test_no_checkpoint_write_outlives_its_round(nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round writes many states at once; when one write fails, the round fails (the states stay unsaved) only
    once the others have ended. A write left running (asyncio.gather gives up at the first error and cancels
    nothing) could end after the next round's write of the same state, and put back an older checkpoint under a
    progress that skips the events it lacks."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(9), ["a-ns", "b-ns"])
        events = [world.next() for _ in range(60)]
        await publish(b, events)
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(len(events)), what="the events folded")
        svc = run.service
        real = svc._put_checkpoint
        failed = asyncio.Event()
        ended: list[str] = []

        async def put(key: str, data: bytes) -> None:
            if key.endswith(".a-ns"):
                failed.set()
                raise nats.errors.TimeoutError
            await failed.wait()  # (this write is still out when the other fails)
            await real(key, data)
            ended.append(key)

        monkeypatch.setattr(svc, "_put_checkpoint", put)
        svc.ledger.unsaved.update({(CLUSTER, "a-ns"), (CLUSTER, "b-ns")})
        assert await svc.checkpoint() == 0, "the round failed"
        assert ended == [checkpoint_key(CLUSTER, "b-ns", options().instance)], (
            "and the other write had ended when it returned"
        )
        assert {(CLUSTER, "a-ns"), (CLUSTER, "b-ns")} <= svc.ledger.unsaved
        monkeypatch.undo()
        await run.stop()
    finally:
        await b.close()


async def letters_stored(b: Bus, n: int) -> bool:
    """Whether the dead-letter stream holds ``n`` letters (the ledger counts a letter as it sends it, and the server
    stores it a moment later); more is a failure."""
    stored = (await b.js.stream_info(contract.DLQ_STREAM)).state.messages
    assert stored <= n, f"{stored} dead letters stored, {n} expected"
    return stored == n


async def test_a_malformed_event_goes_to_the_dlq_and_the_ledger_keeps_going(nats_url: str) -> None:
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(5), ["tenant-a"])
        good = [world.next() for _ in range(3)]
        await publish(b, good[:1])
        await b.publish("vmquota.ev.c1.tenant-a.pod", b'{"type":"io.vmquota.event.upserted","garbage":')
        wrong_subject = good[1]
        await b.publish("vmquota.ev.c1.tenant-b.pod", contract.encode(wrong_subject))
        await publish(b, good[2:])
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(4), what="ledger caught up")
        await wait_until(lambda: run.service.dead_letters == 2, what="two dead letters")
        await wait_until(lambda: letters_stored(b, 2), what="two dead letters stored")
        letters = [
            contract.decode_dead_letter((await b.js.get_msg(contract.DLQ_STREAM, seq=s)).data or b"") for s in (1, 2)
        ]
        assert [(d.stream_seq, d.original_subject) for d in letters] == [
            (2, "vmquota.ev.c1.tenant-a.pod"),
            (3, "vmquota.ev.c1.tenant-b.pod"),
        ]
        assert "not a JSON event" in letters[0].reason and letters[0].payload.startswith(b'{"type"')
        assert "belongs on vmquota.ev.c1.tenant-a.pod" in letters[1].reason
        state = run.service.ledger.state(CLUSTER, "tenant-a")
        assert state is not None and {s.uid for s in state.live("Pod")} == {
            e.uid for e in (good[0], good[2]) if isinstance(e, contract.Upserted)
        }
        await run.stop()
    finally:
        await b.close()


async def test_an_unreadable_event_near_the_servers_max_payload_is_dead_lettered_cut_and_the_ledger_goes_on(
    nats_url: str,
) -> None:
    """A dead letter carries the refused message in base64, a third larger: an unreadable event of 800 KB (any
    watcher's credentials may publish one; a newer watcher's schema during an upgrade too) made a letter the server
    refused, and the ledger stopped with ``MaxPayloadError`` at the same message at every start, for every cluster.
    The letter carries the message's first ``MAX_DLQ_PAYLOAD`` bytes and says so; the ledger folds what follows."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(5), ["tenant-a"])
        good = [world.next() for _ in range(3)]
        await publish(b, good[:1])
        huge = b'{"type":"io.vmquota.event.upserted","x":"' + b"a" * 800_000
        await b.publish("vmquota.ev.c1.tenant-a.pod", huge)
        await publish(b, good[1:])
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(4) or run.task.done(), what="ledger caught up")
        assert not run.task.done(), run.task.exception()
        await wait_until(lambda: run.service.dead_letters == 1, what="a dead letter")
        await wait_until(lambda: letters_stored(b, 1), what="the dead letter stored")
        letter = contract.decode_dead_letter((await b.js.get_msg(contract.DLQ_STREAM, seq=1)).data or b"")
        assert letter.stream_seq == 2 and letter.payload == huge[: contract.MAX_DLQ_PAYLOAD], len(letter.payload)
        assert f"payload of {len(huge)} bytes, truncated" in letter.reason, letter.reason
        state = run.service.ledger.state(CLUSTER, "tenant-a")
        assert state is not None and len(state.live("Pod")) == sum(isinstance(e, contract.Upserted) for e in good)
        await run.stop()
    finally:
        await b.close()


async def test_two_instances_with_disjoint_partitions_never_fold_the_same_namespace(nats_url: str) -> None:
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        namespaces = [f"team-{i}" for i in range(12)]
        world = World(random.Random(6), namespaces)
        events: list[contract.Upserted | contract.Deleted] = [world.next() for _ in range(200)]
        # The Namespace objects are cluster-scoped: their events carry the _cluster token, yet each is folded only
        # by the owner of the namespace it names.
        for i, ns in enumerate(namespaces):
            snap = NamespaceSnapshot(uid=f"ns-uid-{i}", name=ns)
            events.append(
                contract.object_event(
                    "upserted",
                    cluster=CLUSTER,
                    kind="Namespace",
                    namespace="",
                    name=ns,
                    uid=snap.uid,
                    rv="1",
                    snapshot=snap,
                )
            )
        await publish(b, events)
        one = Running(b, options(PartitionSet.parse("0-1", 4)))
        two = Running(b, options(PartitionSet.parse("2-3", 4)))
        await wait_until(lambda: one.applied_through(len(events)) and two.applied_through(len(events)), what="both")
        await one.stop()
        await two.stop()
        ns_one = {ns for _, ns in one.service.ledger.namespaces()}
        ns_two = {ns for _, ns in two.service.ledger.namespaces()}
        assert ns_one and ns_two and not ns_one & ns_two
        assert ns_one | ns_two == set(namespaces)
        _, want = expected_usage(events)
        assert usage_of(await last_usage(b)) == want, "every namespace's usage, each from its one owner"
        assert one.service.opts.consumer_name != two.service.opts.consumer_name
    finally:
        await b.close()


async def test_a_lagging_instance_never_writes_the_cluster_wide_state_another_restarts_from(nats_url: str) -> None:
    """Every instance folds the KubeVirt CR. One that lags behind (here B, still folding the CR's first version
    after A checkpointed its second and its progress past it) used to write its older cluster-wide state over A's
    under the key they shared; A, restarted, loaded it and replayed from its own progress, past the CR's change:
    it accounted every namespace with the old allocation ratio until the CR changed again."""
    b = await connect_bus(nats_url)
    gate, folded_first = asyncio.Event(), asyncio.Event()
    lagging = ahead = again = None
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(9), ["team-a", "team-b"])
        first = world.kubevirt()
        await publish(b, [first])  # (stream sequence 1)
        lagging = Running(b, dataclasses.replace(options(PartitionSet.parse("1", 2)), batch=1))
        fold = lagging.service._fold

        async def slow_fold(batch: list[Any]) -> None:  # B reads the first version, and folds it only later
            await gate.wait()
            await fold(batch)
            folded_first.set()
            lagging.stop_event.set()  # (its final checkpoint writes the state as it is: the first version)

        lagging.service._fold = slow_fold  # type: ignore[method-assign]
        second = world.kubevirt()
        events = [world.next() for _ in range(20)]
        await publish(b, [second, *events])
        a_opts = options(PartitionSet.parse("0", 2))
        ahead = Running(b, a_opts)
        await wait_until(lambda: ahead.applied_through(len(events) + 2), what="A read everything")
        await ahead.stop()  # (its checkpoint: the second version, and a progress past it)
        gate.set()
        await asyncio.wait_for(folded_first.wait(), 10)
        await lagging.stop()
        cw = lagging.service.ledger.cluster_state(CLUSTER)
        assert cw is not None and cw.seq == 1, "B wrote the first version after A's checkpoint"

        again = Running(b, a_opts)
        await wait_until(lambda: again.service.consumer is not None, what="A restarted")
        state = again.service.ledger.cluster_state(CLUSTER)
        assert state is not None
        assert [s.resource_version for s in state.live_objects()["KubeVirt"]] == [second.resource_version]
        await again.stop()
    finally:
        gate.set()
        for run in (lagging, ahead, again):
            if run is not None and not run.task.done():
                await run.crash()
        await b.close()


async def test_the_shared_cluster_wide_state_of_an_earlier_version_is_taken_with_the_events_after_it(
    nats_url: str,
) -> None:
    """Upgrading from the shared ``cl.<cluster>`` key: an instance with progress but no cluster-wide state of its own
    takes the shared one, which may be older than its progress, and replays the events stream from it (not from
    its progress, which would skip the CR's change), then keeps it under its own key."""
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(10), ["team-a"])
        first, second = world.kubevirt(), world.kubevirt()
        events = [world.next() for _ in range(10)]
        await publish(b, [first, second, *events])
        earlier = Ledger()
        earlier.apply(first, 1)
        cw = earlier.cluster_state(CLUSTER)
        assert cw is not None
        opts = options()
        kv = await b.ensure_kv(contract.LEDGER_BUCKET)
        await kv.put(f"cl.{CLUSTER}", pack_checkpoint(cw.checkpoint()))  # (a lagging instance wrote it last)
        await kv.put(opts.progress_key, str(len(events) + 2).encode())
        run = Running(b, opts)
        await wait_until(lambda: run.applied_through(len(events) + 2), what="caught up")
        await run.stop()
        state = run.service.ledger.cluster_state(CLUSTER)
        assert state is not None
        assert [s.resource_version for s in state.live_objects()["KubeVirt"]] == [second.resource_version]
        own = await kv.get(checkpoint_key(CLUSTER, CLUSTER_WIDE, opts.instance))
        assert own.value
        kept = Ledger().load(unpack_checkpoint(own.value)).live_objects()["KubeVirt"]
        assert [s.resource_version for s in kept] == [second.resource_version], "kept under its own key"
        assert run.service.start_seq == 2, "replayed from the shared state's sequence"
    finally:
        await b.close()


async def test_a_usage_larger_than_the_bus_takes_is_published_without_its_vm_states(tmp_path: Path) -> None:
    """A namespace of thousands of VMs makes a usage snapshot larger than NATS's maximum payload: the ledger
    publishes it without the per-VM states (saying so in ``errors``) and goes on with the other namespaces."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 32768\n")  # (1 MB by default: ~2,500 VMs' states; a small one stands in)
    server = NatsServer(tmp_path / "nats", config_file=conf)
    server.workdir.mkdir()
    server.start()
    b = await connect_bus(server.url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(8), [])
        events = []
        for ns, count in (("big", 600), ("small", 3)):
            for i in range(count):
                world.rv += 1
                events.append(world._pod(f"{ns}-{i}", ns, f"pod-{i}"))
        await publish(b, events)
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(len(events)), what="ledger caught up")

        async def both() -> bool:  # (a namespace's usage carries the sequence of its last event)
            got = await last_usage(b)
            return {"big", "small"} <= set(got) and (got["big"].seq, got["small"].seq) == (600, 603)

        await wait_until(both, what="the usage of both namespaces")
        got = await last_usage(b)
        assert got["big"].vms == [] and len(got["small"].vms) == 3
        assert any("the states of 600 of the 600 VMs are left out" in e for e in got["big"].errors), got["big"].errors
        assert run.applied_through(len(events)), "the ledger runs on"
        await run.stop()
    finally:
        await b.close()
        server.stop()


async def test_ledger_continues_across_a_nats_server_restart(nats_server: NatsServer) -> None:
    b = await connect_bus(nats_server.url)
    try:
        await b.ensure_streams(contract.streams())
        world = World(random.Random(7), ["tenant-a", "tenant-b"])
        events = [world.next() for _ in range(200)]
        await publish(b, events[:100])
        run = Running(b, options())
        await wait_until(lambda: run.applied_through(100), what="first half")
        await asyncio.to_thread(nats_server.restart)
        await publish(b, events[100:])
        await wait_until(lambda: run.applied_through(200), within=30, what="second half after the restart")
        _, want = expected_usage(events)
        await wait_until(lambda: _usage_matches(b, want), within=30, what="usage after the restart")
        await run.stop()
    finally:
        await b.close()


async def every_stream_there(b: Bus) -> bool:
    """Whether the server holds every stream of the contract (False while it does not answer)."""
    every = {s.name for s in contract.streams()}
    try:
        return every <= {str(i.config.name) for i in await b.js.streams_info()}
    except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError):
        return False  # (the server is still coming back)


def lose_the_store(nats_server: NatsServer) -> None:
    """Stop the server and start it again on a new, empty volume."""
    nats_server.kill()
    shutil.rmtree(nats_server.store)
    nats_server.start()


async def test_the_ledger_creates_the_streams_again_after_the_server_lost_its_store(nats_server: NatsServer) -> None:
    """The ledger keeps every stream (``shared.contract.STREAM_KEEPER``: the watchers and enforcers may not create
    one, and wait for them): it creates them at its start, and again once a server that lost its store is back (a
    reconnect), so that the watchers publish again."""
    b = await connect_bus(nats_server.url)
    try:
        run = Running(b, options())
        await wait_until(lambda: every_stream_there(b), what="the streams, created at the ledger's start")
        lose_the_store(nats_server)
        await wait_until(
            lambda: every_stream_there(b), within=30, what="the streams, created again after the reconnect"
        )
        await run.stop()
    finally:
        await b.close()


async def test_streams_lost_while_the_ledger_still_creates_its_bucket_are_created_again(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check of the streams counts for the connection it began on. The server lost its store after the ledger
    created the streams and before it created its bucket, at its start: the bucket was made on the server that came
    back, and the ledger took the whole check for that connection's, so that the streams came back only at the next
    periodic check (``consumer_check``, 30 s by default), and the watchers waited for them till then."""
    b = await connect_bus(nats_server.url)
    b.consumer_check = 3600.0  # (only the reconnect can bring the streams back within the test)
    create_streams = b.ensure_streams
    lost: list[int] = []

    async def create_streams_then_lose_them(specs: Any, *, deadline: float = 60.0) -> None:
        await create_streams(specs, deadline=deadline)
        if not lost:
            lost.append(b.epoch)
            lose_the_store(nats_server)
            await wait_until(lambda: b.epoch != lost[0], within=30, what="the reconnect")

    monkeypatch.setattr(b, "ensure_streams", create_streams_then_lose_them)
    try:
        run = Running(b, options())
        await wait_until(lambda: bool(lost), what="the streams, created at the ledger's start")
        await wait_until(lambda: every_stream_there(b), within=30, what="the streams, created again after the loss")
        await run.stop()
    finally:
        await b.close()


@pytest.mark.parametrize("where", ["once_its_bucket_is_made", "before_it_loads_its_checkpoints"])
async def test_a_ledger_whose_server_lost_its_store_while_it_started_starts_on(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The server lost its store after the ledger made its bucket, before it read it: the bucket was gone under the
    ledger's start (``stream not found``), which it took as fatal. The ledger task ended, no one made the streams
    again, and the watchers waited for them."""
    b = await connect_bus(nats_server.url)
    b.consumer_check = 3600.0  # (only the start can bring the streams back within the test)
    lost: list[int] = []

    async def lose() -> None:
        if not lost:
            lost.append(b.epoch)
            lose_the_store(nats_server)
            await wait_until(lambda: b.epoch != lost[0], within=30, what="the reconnect")

    if where == "once_its_bucket_is_made":
        make_bucket = b.ensure_kv

        async def make_bucket_then_lose_it(*args: Any, **kwargs: Any) -> Any:
            bucket = await make_bucket(*args, **kwargs)
            await lose()
            return bucket

        monkeypatch.setattr(b, "ensure_kv", make_bucket_then_lose_it)
    else:
        load = LedgerService._load

        async def lose_then_load(self: LedgerService) -> int:
            await lose()
            return await load(self)

        monkeypatch.setattr(LedgerService, "_load", lose_then_load)
    try:
        run = Running(b, options())
        await wait_until(lambda: bool(lost), what="the store lost while the ledger started")
        await wait_until(lambda: run.service.consumer is not None, within=30, what="the ledger started")
        await wait_until(lambda: every_stream_there(b), within=30, what="the streams, made again")
        assert not run.task.done()
        world = World(random.Random(3), ["tenant-a"])
        await publish(b, [world.next() for _ in range(5)])
        await wait_until(lambda: run.applied_through(5), within=30, what="the events after the loss")
        await run.stop()
    finally:
        await b.close()


async def test_the_ledger_checks_the_streams_without_holding_its_loop_through_an_outage(
    nats_server: NatsServer,
) -> None:
    """The ledger keeps the streams every ``consumer_check`` seconds from its loop. While NATS does not answer, one
    check is one try, not a minute of retries: the loop goes on (its timers, a consumer's re-creation once NATS is
    back), and the service does not die of an outage longer than a minute, which it did."""
    b = await connect_bus(nats_server.url)
    b.consumer_check = 0.2
    try:
        await b.ensure_streams(contract.streams())
        run = Running(b, options())
        await wait_until(lambda: run.service.kv is not None, what="the ledger started")
        nats_server.kill()
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(run.service._timers(time.monotonic() + 1.0), 20)  # (what its loop runs)
        assert loop.time() - began < 20 and run.service._streams_failing and not run.task.done()
        nats_server.start()
        world = World(random.Random(9), ["tenant-a"])
        await publish(b, [world.next() for _ in range(5)])
        await wait_until(lambda: run.applied_through(5), within=30, what="the events after the outage")
        await wait_until(lambda: not run.service._streams_failing, within=30, what="the streams checked again")
        await run.stop()
    finally:
        await b.close()


async def test_the_real_accountant_publishes_the_quota_equation_terms(nats_url: str) -> None:
    """Seed scenario 1 through the bus: three 16Gi VMs under ``limits.memory: 64Gi``, one migrating. The ledger's
    usage carries, per managed quota, what ``shared.accounting`` computes from the same objects directly."""
    from shared.accounting.wire import account
    from shared.normalize import normalize
    from tests import builders as acc

    quota = acc.quota_obj("rq", {"limits.memory": "64Gi"})
    facts = acc.facts_for(["limits.memory"])
    vmis = [acc.vmi_obj(f"vm{i}", guest="16Gi", limits={"memory": "16Gi"}) for i in range(3)]
    objs = [quota, *vmis, *(acc.launcher_obj(v, facts=facts) for v in vmis), acc.vmim_obj("mig", "vm0", rejected=True)]
    events = []
    for rv, obj in enumerate(objs, start=10):
        meta = obj["metadata"]
        snap = normalize({**obj, "metadata": {**meta, "resourceVersion": str(rv)}})
        events.append(
            contract.object_event(
                "upserted",
                cluster=CLUSTER,
                kind=obj["kind"],
                namespace=meta["namespace"],
                name=meta["name"],
                uid=meta["uid"],
                rv=str(rv),
                snapshot=snap,
            )
        )
    direct = acc.account(objs)  # accounting on the raw objects, without the bus or the ledger
    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        await publish(b, events)
        stop = asyncio.Event()
        service = LedgerService(b, options(), account)
        task = asyncio.create_task(service.run(stop))

        async def published() -> bool:
            return acc.NS in await last_usage(b) and (await last_usage(b))[acc.NS].seq == len(events)

        await wait_until(published, what="usage of the namespace with every event applied")
        stop.set()
        await asyncio.wait_for(task, 10)
        usage = (await last_usage(b))[acc.NS]
        terms = usage.quotas["rq"]
        assert terms.mode == "VmiPodUsage"
        assert terms.hard == acc.hard_of(direct)
        assert terms.budget == {"limits.memory": "64Gi"}
        assert [(m.name, m.state) for m in usage.migrations] == [(m.name, m.state) for m in direct.migrations]
        assert usage.migrations and usage.migrations[0].reserved, "the pending migration's target is reserved"
        assert sorted((v.name, v.state) for v in usage.vms) == sorted((v.name, v.state) for v in direct.vms)
    finally:
        await b.close()


# ---- the service shell: `vmquota run ledger` as a process -------------------------------------------------------


def _vmquota(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "run", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parents[2],
    )


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["bogus"], {}, "unknown service 'bogus'"),
        (["ledger", "--cluster", "Bad_1"], {}, "--cluster: cluster id 'Bad_1' is not a DNS label"),
        (["ledger"], {"VMQUOTA_OWNED_PARTITIONS": "0-99"}, "--owned-partitions: partition range '0-99'"),
        (["ledger"], {"VMQUOTA_HTTP_PORT": "eighty"}, "VMQUOTA_HTTP_PORT): 'eighty' is not a whole number"),
        (["ledger"], {"VMQUOTA_EVENTS_MAX_AGE": "forever"}, "--events-max-age: 'forever' is not a duration"),
        (["ledger"], {"VMQUOTA_LEADER_ELECTION": "perhaps"}, "VMQUOTA_LEADER_ELECTION: 'perhaps' is not a boolean"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv: list[str], env: dict[str, str], needle: str) -> None:
    proc = _vmquota(*argv, env=env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert out == b""


async def test_vmquota_run_ledger_serves_health_metrics_and_stops_on_sigterm(nats_url: str) -> None:
    import aiohttp

    proc = _vmquota("ledger", "--http-port", "0", env={"VMQUOTA_NATS": nats_url, "VMQUOTA_CLUSTER": CLUSTER})
    try:
        assert proc.stderr is not None
        port = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not port:  # the first log lines: JSON, one per line; "serving" names the bound HTTP port
            line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), max(0.1, deadline - loop.time()))
            assert line, "the process ended before serving"
            if line.startswith(b"{"):
                doc = json.loads(line)
                assert doc.get("service") is not None or "event" in doc
                if doc.get("event") == "serving":
                    port = int(doc["http_port"])
        b = await connect_bus(nats_url)
        try:
            await b.ensure_streams(contract.streams_for("ledger"))  # (the ledger keeps every stream)
            world = World(random.Random(8), ["tenant-a"])
            events = [world.next() for _ in range(20)]
            await publish(b, events)
            from shared.accounting.wire import account

            reference, _ = expected_usage(events)
            want = {ns: usage_digest(account(reference.view(c, ns))) for c, ns in reference.namespaces()}
            await wait_until(lambda: _usage_matches(b, want), what="usage from the ledger process")
        finally:
            await b.close()
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{port}"

            async def ready() -> bool:
                async with http.get(f"{base}/readyz") as r:
                    return r.status == 200

            await wait_until(ready, what="/readyz")
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"] is True
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
            assert 'vmquota_events_in_total{service="ledger"} 20.0' in text
            assert 'vmquota_events_out_total{service="ledger"}' in text
            assert 'vmquota_consumer_lag{service="ledger"} 0.0' in text
            assert "vmquota_fold_seconds_bucket" in text and "vmquota_dlq_total" in text
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 30)
        assert rc == 0
        rest = proc.stderr.read().decode()
        assert '"event": "stopped"' in rest or '"event":"stopped"' in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_leader_election_runs_one_replica_at_a_time_and_hands_over(sim_api: Any) -> None:
    """Two replicas of a per-cluster service against the simulated API server's Leases: one works at a time; when
    the leader stops, the other takes over at once: the stop releases the Lease."""
    import argparse

    from services.platform.config import add_arguments, config_from_args
    from services.platform.http import Health, Metrics
    from services.platform.lease import LeaseTiming
    from services.platform.runner import Runtime, leader_elected

    store = sim_api.store
    await store.create(store.resource("namespaces"), {"metadata": {"name": "vmquota-system"}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    active: list[str] = []
    most = 0

    def replica(identity: str) -> tuple[Runtime, asyncio.Task[None]]:
        args = parser.parse_args(
            ["watcher", "--cluster", CLUSTER, "--kubeconfig", str(sim_api.kubeconfig), "--identity", identity]
        )
        rt = Runtime(name="watcher", config=config_from_args(args), metrics=Metrics(), health=Health())

        async def work() -> None:
            nonlocal most
            active.append(identity)
            most = max(most, len(active))
            try:
                await rt.stop.wait()
            finally:
                active.remove(identity)

        election = leader_elected(rt, work, LeaseTiming(lease_duration=3, renew_deadline=2, retry_period=1))
        return rt, asyncio.create_task(election)

    (rt_a, task_a), (rt_b, task_b) = replica("replica-a"), replica("replica-b")
    loop = asyncio.get_running_loop()

    def leaders() -> int:
        for t in (task_a, task_b):
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise AssertionError("a replica failed") from t.exception()
        return len(active)

    try:
        await wait_until(lambda: leaders() == 1, what="a leader")
        first = active[0]
        await asyncio.wait([task_a, task_b], timeout=1.0)  # both keep running; the follower keeps waiting
        assert active == [first] and most == 1
        leader_rt, leader_task = (rt_a, task_a) if first == "replica-a" else (rt_b, task_b)
        leader_rt.stop.set()
        await asyncio.wait_for(leader_task, 10)
        released = loop.time()
        other = "replica-b" if first == "replica-a" else "replica-a"
        await wait_until(lambda: leaders() == 1 and active == [other], what="hand-over")
        handover = loop.time() - released
        assert most == 1, "never two leaders at once"
        # (a standby polls a Lease it saw held every 0.25 s; an expiry would take the 3 s of the Lease's duration)
        assert handover < 2.0, f"a graceful stop releases the Lease: the standby took {handover:.2f}s, not ~3s"
    finally:
        for rt, task in ((rt_a, task_a), (rt_b, task_b)):
            rt.stop.set()
            await asyncio.wait_for(task, 10)


async def test_the_fence_lets_a_leader_write_only_within_its_renew_deadline(sim_api: Any) -> None:
    """A leader paused past its renew deadline (a node stall, SIGSTOP) resumes before its next renewal tells it the
    Lease is gone, and a standby may lead by then: the fence its writes check is closed from the deadline on
    (``services.platform.lease.Fence``), and open again only once a renewal succeeds; a standby's is closed."""
    from services.platform.kubeclient import kube_client
    from services.platform.lease import Elector, Fence, LeaseTiming

    store = sim_api.store
    await store.create(store.resource("namespaces"), {"metadata": {"name": "vmquota-system"}})
    timing = LeaseTiming(lease_duration=3, renew_deadline=0.5, retry_period=0.2)
    api = await kube_client(str(sim_api.kubeconfig))
    try:
        fence, other = Fence(), Fence()
        assert fence.allows(), "without leader election every write is allowed"
        leader = Elector(api, "vmquota-system", "vmquota-enforcer-c1", "a", timing, fence=fence)
        standby = Elector(api, "vmquota-system", "vmquota-enforcer-c1", "b", timing, fence=other)
        assert not fence.allows() and not other.allows(), "closed until the Lease is held"
        assert await leader.try_acquire_or_renew() and fence.allows()
        assert not await standby.try_acquire_or_renew() and not other.allows()
        await wait_until(lambda: not fence.allows(), 2.0, "the fence closed at the renew deadline")
        assert await leader.try_acquire_or_renew() and fence.allows(), "a renewal opens it again"
        await leader.release()
        assert not fence.allows(), "released: closed"
    finally:
        await api.close()


async def test_a_renewal_the_leader_never_saw_answered_does_not_keep_the_lease_from_release(sim_api: Any) -> None:
    """A renewal cancelled in flight can still reach the API server, so the copy of the Lease the leader holds is
    then one version behind. The release on a graceful stop reads the Lease again and still frees it: the standby
    does not wait ``lease_duration`` for a Lease nobody works under."""
    import argparse

    from services.platform.config import add_arguments, config_from_args
    from services.platform.http import Health, Metrics
    from services.platform.lease import LeaseTiming
    from services.platform.runner import Runtime, leader_elected, lease_name

    store = sim_api.store
    await store.create(store.resource("namespaces"), {"metadata": {"name": "vmquota-system"}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["enforcer", "--cluster", CLUSTER, "--kubeconfig", str(sim_api.kubeconfig)])
    rt = Runtime(name="enforcer", config=config_from_args(args), metrics=Metrics(), health=Health())
    leases = store.resource("leases")
    name = lease_name("enforcer", CLUSTER)

    async def work() -> None:
        lease = await store.get(leases, "vmquota-system", name)
        lease["spec"]["renewTime"] = "2026-01-01T00:00:00.000000Z"  # (the renewal whose answer was lost)
        await store.update(leases, lease)
        rt.stop.set()

    timing = LeaseTiming(lease_duration=10, renew_deadline=8, retry_period=5)
    await asyncio.wait_for(leader_elected(rt, work, timing), 20)
    lease = await store.get(leases, "vmquota-system", name)
    assert not lease["spec"].get("holderIdentity"), lease["spec"]
    assert lease["spec"]["leaseDurationSeconds"] == 1


async def test_a_failing_leader_fails_its_service(sim_api: Any) -> None:
    """Work that fails while leading ends the service with that error (the process restarts), rather than the
    replica holding the lease without working."""
    import argparse

    from services.platform.config import add_arguments, config_from_args
    from services.platform.http import Health, Metrics
    from services.platform.lease import LeaseTiming
    from services.platform.runner import Runtime, leader_elected

    store = sim_api.store
    await store.create(store.resource("namespaces"), {"metadata": {"name": "vmquota-system"}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["enforcer", "--cluster", CLUSTER, "--kubeconfig", str(sim_api.kubeconfig)])
    rt = Runtime(name="enforcer", config=config_from_args(args), metrics=Metrics(), health=Health())

    async def work() -> None:
        raise ValueError("cannot reach the cluster")

    with pytest.raises(ValueError, match="cannot reach the cluster"):
        await asyncio.wait_for(
            leader_elected(rt, work, LeaseTiming(lease_duration=3, renew_deadline=2, retry_period=1)), 20
        )


async def test_a_missing_lease_namespace_is_one_clear_error_and_not_ready(sim_api: Any) -> None:
    """Readiness tells the truth: a candidate that cannot even create its Lease (its namespace is missing) is not
    ready, says why once (not a traceback every retry), and becomes ready once the namespace exists."""
    import argparse

    from structlog.testing import capture_logs

    from services.platform.config import add_arguments, config_from_args
    from services.platform.http import Health, Metrics
    from services.platform.lease import LeaseTiming
    from services.platform.runner import Runtime, leader_elected

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["enforcer", "--cluster", CLUSTER, "--kubeconfig", str(sim_api.kubeconfig), "--lease-namespace", "nowhere"]
    )
    rt = Runtime(name="enforcer", config=config_from_args(args), metrics=Metrics(), health=Health())
    rt.health.set_ready("enforcer", True)  # (connected to NATS)
    led = asyncio.Event()

    async def work() -> None:
        led.set()
        await rt.stop.wait()

    timing = LeaseTiming(lease_duration=3, renew_deadline=1, retry_period=0.2)
    with capture_logs() as logs:
        task = asyncio.create_task(leader_elected(rt, work, timing))
        try:
            await wait_until(lambda: sum(1 for e in logs if e["log_level"] == "error") >= 1, what="the error")
            await asyncio.wait([task], timeout=1.0)  # five more retries
            assert not rt.health.ready, "not ready while the Lease cannot be created"
            errors = [e for e in logs if e["log_level"] == "error"]
            assert len(errors) == 1, errors
            assert "the lease namespace 'nowhere' does not exist" in errors[0]["error"], errors[0]
            store = sim_api.store
            await store.create(store.resource("namespaces"), {"metadata": {"name": "nowhere"}})
            await wait_until(led.is_set, what="leading once the namespace exists")
            assert rt.health.ready
        finally:
            rt.stop.set()
            await asyncio.wait_for(task, 10)


async def test_a_replay_is_not_ended_by_a_fetch_whose_late_answer_took_the_last_event(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch that timed out on asyncio's side while the loaded server did deliver its message (late, into the
    subscription's queue): with no acks that message is no longer pending on the server, and the replay ended one
    event short, on the server's word that nothing was pending: the usage published then was older than what was
    published before the crash. Nothing delivered past what the ledger has read, too."""
    from nats.js.client import JetStreamContext

    from services.platform.bus import position

    b = await connect_bus(nats_url)
    try:
        await b.ensure_streams(contract.streams())
        want = await crashed_between_checkpoints(b, seed=8)
        world = World(random.Random(8), ["tenant-a"])
        events = [world.next() for _ in range(60)]
        _, before_last = expected_usage(events[:59])
        assert before_last["tenant-a"] != want, "the last event changes the usage"
        fetch = JetStreamContext.PullSubscription.fetch
        late = [False]

        async def late_answer(self: Any, *args: Any, **kwargs: Any) -> Any:
            msgs = await fetch(self, *args, **kwargs)
            if not late[0] and msgs and position(msgs[-1]).stream == 60:
                late[0] = True  # (the server answered after ``idle``: the message lands in the queue afterwards)
                for m in msgs:
                    self._sub._pending_queue.put_nowait(m)
                    self._sub._pending_size += len(m.data)
                raise nats.errors.TimeoutError
            return msgs

        monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", late_answer)
        heard = await usage_heard_in_a_replay(b, want, batch=1)
        assert late[0], "the last event's fetch answered late"
        assert set(heard) == {want}, f"{len(set(heard) - {want})} older usages published"
    finally:
        await b.close()
