"""The bus as a 3-node JetStream cluster (three nats-server processes with routes): with ``--stream-replicas 3``
every stream and the ledger's bucket are kept by all three nodes, and migrations go on while one node after another
is killed (SIGKILL) and comes back: none fails, ``hard`` returns to the budget each time, no event is lost and the
ledger's checkpoints stay readable."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import nats.js.errors

from services.devtools.simcluster.kubevirt import phase
from shared import contract
from tests.integration.e2e import CLUSTER, SLOW_MIGRATIONS, full_namespace, pipeline
from tests.integration.natscluster import NatsCluster
from tests.waiting import wait_until

NS = "tenant-cluster"
QUOTA = "compute"


async def _replicas(url: str) -> dict[str, int]:
    nc = await nats.connect([u for u in url.split(",") if u])
    try:
        return {str(i.config.name): int(i.config.num_replicas or 1) for i in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


async def _caught_up(url: str) -> bool:
    """Every stream has a leader and all its replicas current: the node that came back has caught up."""
    try:
        nc = await nats.connect([u for u in url.split(",") if u], max_reconnect_attempts=1)
    except (nats.errors.Error, OSError, TimeoutError):
        return False  # (no node answering yet)
    try:
        try:
            infos = await nc.jetstream().streams_info()
        except (nats.errors.Error, TimeoutError):
            return False  # (the JetStream API is not answering yet)
        for info in infos:
            c = info.cluster
            if c is None or not c.leader or len(c.replicas or []) != 2:
                return False
            if not all(r.current and not r.offline for r in c.replicas or []):
                return False
        return True
    finally:
        await nc.close()


async def test_migrations_go_on_while_nodes_of_a_3_node_cluster_are_killed_one_after_another() -> None:
    with NatsCluster(3) as cluster:
        async with pipeline(
            separate=True, kubevirt_timing=SLOW_MIGRATIONS, nats=cluster, extra_args=["--stream-replicas", "3"]
        ) as p:
            await full_namespace(p, NS)
            before = p.hard(NS, QUOTA)
            replicas = await _replicas(cluster.url)
            owned = {s.name for s in contract.streams()} | {f"KV_{contract.LEDGER_BUCKET}"}
            assert owned <= set(replicas) and {replicas[s] for s in owned} == {3}, replicas

            migrations: list[tuple[str, str]] = []
            for victim, vm in ((0, "vm1"), (1, "vm2"), (2, "vm3")):
                mig = await p.migrate(NS, vm)
                migrations.append((vm, mig))

                def target(m: str = mig) -> bool:
                    return bool(p.target_pods(NS, m))

                await p.wait(target, f"the target pod of {vm}")
                await asyncio.to_thread(cluster.nodes[victim].kill)  # mid-migration, no clean shutdown
                await p.wait_migrated(NS, vm, mig)
                # (the services' JetStream calls to the dead node time out one after another, 5 s each, before
                # the new leaders answer: 4 to 19 s measured on a machine at rest)
                await p.wait_hard(NS, QUOTA, before, f"hard to return with node {victim} down", within=60)
                await asyncio.to_thread(cluster.nodes[victim].start)  # the same ports and store

                async def caught_up() -> bool:
                    return await _caught_up(cluster.url)

                await wait_until(caught_up, 60, f"node {victim} to catch up", every=0.25)
            for vm, mig in migrations:
                assert phase(p.migration(NS, mig)) == "Succeeded", (vm, p.migration(NS, mig))

            # no event lost: every migration's end is in the events stream, and the checkpoints are readable
            nc = await nats.connect([u for u in cluster.url.split(",") if u])
            try:
                js = nc.jetstream()
                ended: set[str] = set()
                subject = f"{contract.PREFIX}.ev.{CLUSTER}.{NS}.vmim"

                async def every_end_stored() -> bool:
                    # (the watcher may still be publishing the last end, retried after the node's death: read the
                    # stream again until it holds them all; a cluster still electing its stream's leader after the
                    # restart times requests out meanwhile, which is a "not yet" too)
                    ended.clear()
                    try:
                        sub = await js.subscribe(subject, stream=contract.EVENTS_STREAM, ordered_consumer=True)
                    except (nats.errors.Error, TimeoutError):  # (a timeout, or no leader yet: unavailable)
                        return False
                    try:
                        info = await js.stream_info(contract.EVENTS_STREAM, subjects_filter=subject)
                        for _ in range(sum((info.state.subjects or {}).values())):
                            ev = contract.decode_event((await sub.next_msg(timeout=10)).data)
                            if isinstance(ev, contract.Upserted) and getattr(ev.snapshot, "phase", "") == "Succeeded":
                                ended.add(ev.name)
                    except (nats.errors.Error, TimeoutError):
                        return False
                    finally:
                        await sub.unsubscribe()
                    return ended == {mig for _, mig in migrations}

                await wait_until(every_end_stored, 30, "every migration's end in the events stream", every=0.25)
                kv = await js.key_value(contract.LEDGER_BUCKET)

                async def checkpoints_read_back() -> bool:
                    # (the ledger writes every 2 s and retries a write a node's death failed: wait for one)
                    try:
                        keys = await kv.keys()
                    except nats.js.errors.NoKeysError:
                        return False
                    return bool(keys) and all([(await kv.get(k)).value for k in keys])

                await wait_until(checkpoints_read_back, 30, "the ledger's checkpoints to read back", every=0.25)
            finally:
                await nc.close()


async def test_a_cluster_without_the_room_or_the_nodes_a_stream_asks_names_the_flag() -> None:
    """A JetStream cluster answers a stream it cannot place with one code (no suitable peers), for too many replicas
    and for too little storage alike: the ledger stopped with a traceback naming no flag."""
    import pytest

    from services.platform.bus import Bus, NatsOptions
    from shared.errors import InvalidInput

    events = [s for s in contract.streams() if s.name == contract.EVENTS_STREAM]
    with NatsCluster(3) as cluster:
        for sizes, replicas, flag in (
            (contract.StreamSizes(events=64 * 2**20), 5, "--stream-replicas (VMQUOTA_STREAM_REPLICAS)"),
            (contract.StreamSizes(events=2**50), 3, "--events-max-bytes (VMQUOTA_EVENTS_MAX_BYTES)"),
        ):
            b = await Bus.connect(NatsOptions(url=cluster.url, name="test", stream_sizes=sizes), connect_timeout=20)
            b.stream_replicas = replicas
            try:
                with pytest.raises(InvalidInput) as e:
                    await b.ensure_streams(events, deadline=20.0)
                assert e.value.where == flag, e.value
            finally:
                await b.close()
