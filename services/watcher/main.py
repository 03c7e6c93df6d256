"""``vmquota run watcher --cluster ID``: the service shell around :class:`services.watcher.watcher.Watcher`.

The process connects to NATS at once (a standby is ready to take over), then runs the watcher only while it holds
the Lease ``vmquota-watcher-<cluster>`` (``services.platform.runner.leader_elected``): one watcher publishes per
cluster.
When it loses the Lease its work is cancelled and the process fails, so it restarts as a follower; a new leader
lists everything again and the message ids make the repeats no-ops on the server. After NATS reconnects, the
leader waits for its streams (which the ledger keeps) and starts over the same way (a restarted server may have
lost its store).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from services.platform.bus import Bus
from services.platform.kubeclient import kube_client
from services.platform.lease import LeaseTiming
from services.platform.publisher import Item, Publisher
from services.platform.runner import Runtime, leader_elected
from services.watcher.metrics import SERVICE, metrics_for
from services.watcher.watcher import Watcher, WatcherConfig
from shared import contract


@dataclass(frozen=True, slots=True)
class Tuning:
    lease: LeaseTiming = field(default_factory=LeaseTiming)
    watcher: WatcherConfig | None = None
    """Overrides of the list/watch settings (the cluster id still comes from ``--cluster``)."""


async def main(rt: Runtime) -> None:
    await serve(rt)


async def serve(rt: Runtime, tuning: Tuning = Tuning()) -> None:
    """Run until ``rt.stop`` is set (or the Lease is lost: then raise)."""
    cluster = rt.config.cluster
    if cluster is None:
        raise ValueError("the watcher needs --cluster")
    config = tuning.watcher or WatcherConfig(cluster=cluster)
    if config.cluster != cluster:
        raise ValueError(f"watcher settings are for cluster {config.cluster!r}, not {cluster!r}")
    log = rt.log(cluster=cluster)
    metrics = metrics_for(rt.metrics.registry)
    leader = metrics.leader.labels(cluster)
    reconnected = asyncio.Event()

    def on_reconnect() -> None:
        rt.metrics.reconnects.labels(SERVICE).inc()
        reconnected.set()

    bus = await Bus.connect(rt.nats_options(), on_reconnect=on_reconnect, stop=rt.stop)
    rt.health.set_ready(rt.name, True)  # a standby is healthy; the leader is ready once everything is listed

    def stored(item: Item, duplicate: bool) -> None:
        kind, _, typ = item.label.partition("|")
        if duplicate:
            metrics.duplicates.labels(cluster, kind).inc()
            return
        metrics.published.labels(cluster, kind, typ).inc()
        rt.metrics.events_out.labels(SERVICE).inc()
        if typ == "deadletter":
            rt.metrics.dlq.labels(SERVICE).inc()

    async def watch_until_reconnect(api: Any, publisher: Publisher) -> bool:
        """Run a watcher until stop (False) or a NATS reconnect (True: start over)."""
        watcher = Watcher(
            api, publisher, config, metrics=metrics, log=log, on_ready=lambda: rt.health.set_ready(rt.name, True)
        )
        running = asyncio.create_task(watcher.run(), name="watcher")
        stopping = asyncio.create_task(rt.stop.wait())
        again = asyncio.create_task(reconnected.wait())
        try:
            await asyncio.wait([running, stopping, again], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (running, stopping, again):
                t.cancel()
            for t in (stopping, again, running):
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        if rt.stop.is_set():
            return False
        if not reconnected.is_set():
            raise RuntimeError("the watcher stopped")
        return True

    async def work() -> None:
        leader.set(1)
        rt.health.set_ready(rt.name, False)
        publisher = Publisher(bus, window=config.window, ack_timeout=config.ack_timeout, on_stored=stored)
        try:
            api = await kube_client(rt.config.kubeconfig)
            try:
                publisher.start()
                while True:
                    reconnected.clear()
                    await bus.wait_for_streams(contract.STREAMS_USED[SERVICE])
                    if not await watch_until_reconnect(api, publisher):
                        break
                    # What the server kept is unknown (a restart may have lost its store): list and publish all
                    # again; message ids make the repeats no-ops where nothing was lost.
                    log.warning("NATS reconnected: listing and publishing everything again")
                    rt.health.set_ready(rt.name, False)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(publisher.flush(), 5.0)
            finally:
                await publisher.close()
                await api.close()
        finally:
            leader.set(0)

    try:
        await leader_elected(rt, work, tuning.lease)
    finally:
        await bus.close()
