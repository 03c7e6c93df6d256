"""Ledger benchmarks: the in-process fold rate, memory per tracked object, and NATS publish → ledger throughput
against the raw nats-py publish + consume rate measured in the same run on the same server."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from services.devtools.natsserver import NatsServer
from services.ledger.service import LedgerOptions, LedgerService
from services.platform.bus import Bus, NatsOptions
from shared import contract
from shared.accounting.wire import account
from shared.ledger.fold import EVENTS_KEPT, Ledger, PartitionSet
from shared.normalize import normalize
from tests.benchmarks.common import Result, rate

CLUSTER = "bench"
NAMESPACES = 100
EVENTS = 20_000
OBJECTS = 5_000
ROUNDS = 2


def launcher_pod(i: int, rv: int, ns: str) -> dict[str, object]:
    """A launcher-pod-shaped Pod (compute container plus a sidecar, labels KubeVirt sets) at resourceVersion rv."""
    res = {"requests": {"cpu": "100m", "memory": "1290Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"virt-launcher-vm{i}-abcde",
            "namespace": ns,
            "uid": f"pod-uid-{i:06d}",
            "resourceVersion": str(rv),
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": f"vmi-uid-{i:06d}"},
        },
        "spec": {
            "nodeName": "node-1",
            "containers": [
                {"name": "compute", "resources": res},
                {"name": "guest-console-log", "resources": {"requests": {"cpu": "5m", "memory": "35M"}}},
            ],
        },
        "status": {"phase": "Running"},
    }


def upserted(cluster: str, obj: dict[str, Any]) -> tuple[str, bytes, str]:
    """The watcher's message of object ``obj`` upserted, as (subject, data, msg-id)."""
    meta = obj["metadata"]
    kind, ns = obj["kind"], meta["namespace"]
    ev = contract.object_event(
        "upserted",
        cluster=cluster,
        kind=kind,
        namespace=ns,
        name=meta["name"],
        uid=meta["uid"],
        rv=meta["resourceVersion"],
        snapshot=normalize(obj),
    )
    return contract.event_subject(cluster, kind, ns), contract.encode(ev), ev.id


def make_events(n: int, objects: int, cluster: str = CLUSTER) -> list[tuple[str, bytes, str]]:
    """``n`` upserts of ``objects`` distinct pods spread over NAMESPACES namespaces, as (subject, data, msg-id)."""
    return [
        upserted(cluster, launcher_pod(k % objects, 1000 + k, f"tenant-{k % objects % NAMESPACES}")) for k in range(n)
    ]


def make_event_flood(n: int, cluster: str = CLUSTER) -> list[tuple[str, bytes, str]]:
    """``n`` ``FailedCreate`` Events a tenant writes in one namespace, each new (a flood far past ``EVENTS_KEPT``)."""
    ns = "tenant-flood"
    message = (
        'Error creating pod: pods "virt-launcher-x" is forbidden: exceeded quota: rq, requested: limits.memory=1Gi, '
        "used: limits.memory=1Gi, limited: limits.memory=1Gi"
    )
    return [
        upserted(
            cluster,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"vm.{k:08x}",
                    "namespace": ns,
                    "uid": f"ev-{k:08d}",
                    "resourceVersion": str(k + 1),
                },
                "involvedObject": {"kind": "VirtualMachineInstance", "name": f"no-such-vm-{k}", "namespace": ns},
                "reason": "FailedCreate",
                "type": "Warning",
                "message": message,
                "lastTimestamp": "2026-01-01T00:00:00Z",
            },
        )
        for k in range(n)
    ]


def make_labelled_pod_flood(n: int, cluster: str = CLUSTER) -> list[tuple[str, bytes, str]]:
    """A namespace with a migration ``Pending``, then ``n`` pods its tenant labels the target of a migration
    (``kubevirt.io/migrationJobUID``), that one's or another's, each new: the fold passed over every pod of the
    namespace for each of them."""
    from tests.builders import launcher_obj, pod_obj, vmi_obj, vmim_obj

    vmi, migration = vmi_obj("vm"), vmim_obj("m", "vm")
    objs: list[dict[str, Any]] = [vmi, launcher_obj(vmi), migration]
    for k in range(n):  # (half of them that migration's uid, which it is Pending for: the costlier)
        pod = pod_obj(f"p{k}", {"cpu": "1m"}, t=10 + k)
        job = migration["metadata"]["uid"] if k % 2 else f"job-{k}"
        pod["metadata"]["labels"] = {"kubevirt.io/migrationJobUID": job}
        objs.append(pod)
    for rv, obj in enumerate(objs, start=1):
        obj["metadata"] |= {"namespace": "tenant-labels", "resourceVersion": str(rv)}
    return [upserted(cluster, obj) for obj in objs]


def fold_rate(events: list[tuple[str, bytes, str]]) -> float:
    datas = [d for _, d, _ in events]

    def once() -> int:
        led = Ledger()
        for seq, data in enumerate(datas, start=1):
            led.apply_bytes(data, seq)
        return len(datas)

    once()  # warm caches (quantity parsing, validated names)
    return rate(once, min_seconds=2.0)


def memory_per_object(events: list[tuple[str, bytes, str]]) -> float:
    datas = [d for _, d, _ in events]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    led = Ledger()
    for seq, data in enumerate(datas, start=1):
        led.apply_bytes(data, seq)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    objects = sum(len(st) for st in led.states.values())
    return (after - before) / objects


class Publisher:
    """The event source as in production: another process (the watcher's place) publishing the events with
    windowed async publishes. It builds its events first, says ``ready``, and publishes on ``go``."""

    def __init__(self, url: str, subject_prefix: str, n: int, cluster: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.benchmarks.bench_ledger", url, subject_prefix, str(n), cluster],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"publisher did not start: {line!r}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    async def done(self) -> None:
        rc = await asyncio.to_thread(self.proc.wait, 300)
        if rc != 0:
            raise RuntimeError(f"publisher failed with {rc}")


async def _publish_main(url: str, prefix: str, n: int, cluster: str) -> None:
    """nats-py's own windowed publishing (``publish_async``, 1000 acks in flight), the same source for the raw
    consumer and for the ledger: the ratio compares the readers. (The watcher's publisher is about three times
    faster than this source; fed by it the ledger is the slower side: ``docs/benchmarks.md``.)"""
    events = make_events(n, objects=OBJECTS, cluster=cluster)
    b = await Bus.connect(NatsOptions(url=url, name="bench-publisher"), connect_timeout=10)
    try:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        acks: deque[asyncio.Future[Any]] = deque()
        for subj, data, mid in events:
            headers = {"Nats-Msg-Id": mid} if mid is not None else None
            acks.append(await b.js.publish_async(prefix + subj, data, headers=headers, wait_stall=30.0))
            if len(acks) >= 1000:
                for _ in range(500):
                    await acks.popleft()
        for ack in acks:
            await ack
    finally:
        await b.close()


async def _wait(cond: Callable[[], bool], what: str, within: float = 300.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise RuntimeError(f"timed out: {what}")
        await asyncio.sleep(0.002)


async def raw_rate(b: Bus, url: str, n: int, cluster: str) -> float:
    """nats-py alone: a pull consumer (batches of 1000, no acks) reading what the publisher process sends."""
    stream, prefix = f"RAW_{cluster.upper().replace('-', '_')}", f"raw.{cluster}."
    await b.js.add_stream(StreamConfig(name=stream, subjects=[prefix + ">"], duplicate_window=120))
    await b.js.add_consumer(
        stream, ConsumerConfig(durable_name="raw", ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
    )
    sub = await b.js.pull_subscribe_bind("raw", stream=stream)
    publisher = await asyncio.to_thread(Publisher, url, prefix, n, cluster)
    got = 0

    async def consume() -> None:
        nonlocal got
        while got < n:
            try:
                got += len(await sub.fetch(1000, timeout=1.0))
            except TimeoutError:
                continue

    reader = asyncio.create_task(consume())
    t0 = time.perf_counter()
    publisher.go()
    await asyncio.wait_for(reader, 300)
    elapsed = time.perf_counter() - t0
    await publisher.done()
    return n / elapsed


async def pipeline_rate(b: Bus, url: str, n: int, cluster: str) -> tuple[float, int]:
    """The same events from the publisher process into the events stream, while a running ledger folds them,
    accounts the changed namespaces with the real accountant and publishes usage; until it applied the last."""
    await b.ensure_streams(contract.streams())
    stop = asyncio.Event()
    service = LedgerService(b, LedgerOptions(partitions=PartitionSet.all(16), cluster=cluster, batch=1000), account)
    task = asyncio.create_task(service.run(stop))
    await _wait(lambda: service.consumer is not None, "ledger start")
    base = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
    publisher = await asyncio.to_thread(Publisher, url, "", n, cluster)
    t0 = time.perf_counter()
    publisher.go()

    def applied() -> bool:
        if task.done():
            task.result()
        return service.consumer is not None and service.consumer.next_seq > base + n

    await _wait(applied, "ledger catch-up")
    elapsed = time.perf_counter() - t0
    await publisher.done()
    stop.set()
    await asyncio.wait_for(task, 30)
    return n / elapsed, service.published


async def replay_rate(b: Bus, cluster: str, n: int) -> float:
    """A ledger with no checkpoint for its partition layout replays the cluster's events from the stream."""
    stop = asyncio.Event()
    opts = LedgerOptions(partitions=PartitionSet.all(8), cluster=cluster, batch=1000)
    service = LedgerService(b, opts, account)
    last = (await b.js.stream_info(contract.EVENTS_STREAM)).state.last_seq
    t0 = time.perf_counter()
    task = asyncio.create_task(service.run(stop))

    def applied() -> bool:
        if task.done():
            task.result()
        return service.consumer is not None and service.consumer.next_seq > last

    await _wait(applied, "replay")
    elapsed = time.perf_counter() - t0
    stop.set()
    await asyncio.wait_for(task, 30)
    return n / elapsed


async def run_async() -> list[Result]:
    events = make_events(EVENTS, objects=OBJECTS)
    results = [
        Result("ledger fold, in process (decode + apply)", fold_rate(events), "events/s", target=100_000),
        Result("ledger memory per tracked object", memory_per_object(events), "bytes", note="launcher-pod snapshots"),
        Result(
            "ledger fold of a tenant's Event flood, in process",
            fold_rate(make_event_flood(EVENTS)),
            "events/s",
            target=100_000,
            note=f"{EVENTS} new Events in one namespace, past the {EVENTS_KEPT} it keeps (the ledger folds every "
            "namespace in one order)",
        ),
        Result(
            "ledger fold of a tenant's labelled pods, a migration Pending, in process",
            fold_rate(make_labelled_pod_flood(EVENTS)),
            "events/s",
            target=100_000,
            note=f"{EVENTS} pods in one namespace labelled the target of a migration (kubevirt.io/migrationJobUID)",
        ),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp))
        server.start()
        try:
            b = await Bus.connect(NatsOptions(url=server.url, name="bench"), connect_timeout=10)
            try:
                raws, pipes = [], []
                for r in range(ROUNDS):  # alternate, keep the best of each: figures on a shared machine are noisy
                    raws.append(await raw_rate(b, server.url, EVENTS, f"bench-{r}"))
                    pipes.append(await pipeline_rate(b, server.url, EVENTS, f"bench-{r}"))
                raw = max(raws)
                pipe, published = max(pipes)
                replay = await replay_rate(b, f"bench-{ROUNDS - 1}", EVENTS)  # the last events of the stream
            finally:
                await b.close()
        finally:
            server.stop()
    results += [
        Result("nats-py raw publish + pull consume", raw, "events/s", note="publisher in another process"),
        Result("NATS publish -> ledger applied", pipe, "events/s", note=f"{published} usage snapshots published"),
        Result("ledger pipeline / raw nats-py", 100 * pipe / raw, "%", target=70),
        Result("ledger replay from the stream (no checkpoint)", replay, "events/s", note="fold + accounting"),
    ]
    return results


if __name__ == "__main__":  # the publisher process of the NATS figures: URL SUBJECT_PREFIX COUNT
    asyncio.run(_publish_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
