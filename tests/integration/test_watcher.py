"""The watcher against the simulated API server and a real nats-server: what reaches the events stream.

Objects are written straight into the simulator's store (no controllers run), so every event the watcher could
publish is one the test made. A tap reads the streams with an ordered consumer and folds the events into a
``shared.ledger.fold.Ledger``, the consumer the watcher feeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from services.devtools.simcluster.store import Store
from services.devtools.simcluster.store_api import Obj
from services.platform.bus import Bus, NatsOptions
from services.platform.config import Config
from services.platform.http import Health, Metrics
from services.platform.lease import LeaseTiming
from services.platform.runner import Runtime
from services.watcher.kube import ResourceSpec, Timeouts
from services.watcher.main import Tuning, serve
from services.watcher.watcher import RESOURCES, WatcherConfig
from shared import contract
from shared.backoff import Backoff
from shared.contract import Deleted, Sync, Upserted
from shared.ledger.fold import Ledger, PartitionSet
from shared.quantity import Quantity
from shared.snapshot import KubeVirtSnapshot, VmiSnapshot
from tests.conftest import NatsServer
from tests.integration.conftest import SimApi
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

CLUSTER = "c1"
LEASE_NS = "vmquota-system"
REPO = Path(__file__).resolve().parents[2]


# ---- objects ----------------------------------------------------------------------------------------------------


def pod(name: str, *, launcher: bool = True, cpu: str = "100m", labels: dict[str, str] | None = None) -> Obj:
    lbl = {"kubevirt.io": "virt-launcher"} if launcher else {"app": "web"}
    lbl.update(labels or {})
    return {
        "metadata": {"name": name, "labels": lbl},
        "spec": {"containers": [{"name": "compute", "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}}]},
    }


def vmi(name: str) -> Obj:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name},
        "spec": {"domain": {"cpu": {"sockets": 2}, "memory": {"guest": "1Gi"}, "devices": {}}},
    }


def quota(name: str, *, managed: bool) -> Obj:
    labels = {"vmquota.io/managed": "true"} if managed else {}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"hard": {"limits.memory": "64Gi"}}}


def failed_create(name: str, vmi_name: str, reason: str = "FailedCreate") -> Obj:
    return {
        "metadata": {"name": name},
        "involvedObject": {
            "kind": "VirtualMachineInstance",
            "name": vmi_name,
            "namespace": "a",
            "uid": "u-" + vmi_name,
        },
        "reason": reason,
        "type": "Warning",
        "message": f'Error creating pod: pods "virt-launcher-{vmi_name}-x" is forbidden: exceeded quota: q, '
        "requested: limits.memory=2Gi, used: limits.memory=63Gi, limited: limits.memory=64Gi",
    }


class Cluster:
    """Writes to the simulator's store by kind name."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def create(self, kind: str, obj: Obj, namespace: str | None = None, *, keep_status: bool = False) -> Obj:
        return await self.store.create(self.store.resource(kind), obj, namespace=namespace, keep_status=keep_status)

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        await self.store.delete(self.store.resource(kind), namespace, name)

    async def relabel(self, kind: str, namespace: str | None, name: str, labels: dict[str, str]) -> Obj:
        patch = {"metadata": {"labels": labels}}
        return await self.store.patch(self.store.resource(kind), namespace, name, patch, "merge")


# ---- reading the bus --------------------------------------------------------------------------------------------


@dataclass
class Tap:
    """Every message of the events and dead-letter streams, in stream order, and the ledger fold of the events."""

    events: list[Upserted | Deleted | Sync] = field(default_factory=list)
    dead: list[contract.DeadLetter] = field(default_factory=list)
    ledger: Ledger = field(default_factory=lambda: Ledger(PartitionSet.all(1)))
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def on_event(self, msg: Msg) -> None:
        ev = contract.decode_event(msg.data)
        self.events.append(ev)
        self.ledger.apply(ev, msg.metadata.sequence.stream)
        self.arrived.set()

    def on_dead(self, msg: Msg) -> None:
        self.dead.append(contract.decode_dead_letter(msg.data))
        self.arrived.set()

    async def wait(self, what: str, check: Callable[[], bool], within: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not check():
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}; {len(self.events)} events seen")
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), min(left, 0.5))

    # views
    def live(self, namespace: str, kind: str) -> list[str]:
        st = self.ledger.state(CLUSTER, namespace)
        return sorted(s.name for s in st.live(kind)) if st is not None else []

    def of(self, cls: type[Any], kind: str, name: str | None = None) -> list[Any]:
        return [
            e
            for e in self.events
            if type(e) is cls and e.kind == kind and (name is None or getattr(e, "name", None) == name)
        ]

    def syncs(self, kind: str, namespace: str) -> list[Sync]:
        return [e for e in self.events if isinstance(e, Sync) and e.kind == kind and e.namespace == namespace]


@pytest.fixture
async def tap(nats_server: NatsServer) -> AsyncIterator[Tap]:
    t = Tap()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    for name, subjects in ((contract.EVENTS_STREAM, ["vmquota.ev.>"]), (contract.DLQ_STREAM, ["vmquota.dlq.>"])):
        with contextlib.suppress(Exception):
            await js.add_stream(name=name, subjects=subjects, duplicate_window=600.0)

    async def ev_cb(msg: Msg) -> None:
        t.on_event(msg)

    async def dl_cb(msg: Msg) -> None:
        t.on_dead(msg)

    await js.subscribe("vmquota.ev.>", stream=contract.EVENTS_STREAM, ordered_consumer=True, cb=ev_cb)
    await js.subscribe("vmquota.dlq.>", stream=contract.DLQ_STREAM, ordered_consumer=True, cb=dl_cb)
    try:
        yield t
    finally:
        await nc.close()


# ---- running watchers -------------------------------------------------------------------------------------------


@dataclass
class RunningWatcher:
    rt: Runtime
    task: asyncio.Task[None]

    def metric(self, name: str, **labels: str) -> float:
        value = self.rt.metrics.registry.get_sample_value(name, {"service": "watcher", "cluster": CLUSTER, **labels})
        return value or 0.0

    def published(self) -> float:
        total = 0.0
        for family in self.rt.metrics.registry.collect():
            if family.name == "vmquota_watcher_published":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return total

    async def stop(self) -> None:
        self.rt.stop.set()
        await asyncio.wait_for(self.task, 15)


StartWatcher = Callable[..., Awaitable[RunningWatcher]]


@pytest.fixture
async def start_watcher(nats_server: NatsServer, sim_api: SimApi) -> AsyncIterator[StartWatcher]:
    running: list[RunningWatcher] = []

    async def start(
        identity: str = "w1",
        *,
        leader_election: bool = False,
        lease: LeaseTiming | None = None,
        resources: tuple[ResourceSpec, ...] = RESOURCES,
    ) -> RunningWatcher:
        config = Config(
            service="watcher",
            cluster=CLUSTER,
            nats=NatsOptions(url=nats_server.url),
            kubeconfig=str(sim_api.kubeconfig),
            http_port=0,
            log_level="info",
            partitions=PartitionSet.all(1),
            events_max_age=3600.0,
            dry_run=False,
            leader_election=leader_election,
            lease_namespace=LEASE_NS,
            identity=identity,
        )
        rt = Runtime(name="watcher", config=config, metrics=Metrics(), health=Health())
        settings = WatcherConfig(
            cluster=CLUSTER,
            page_size=7,  # several pages even for small tests
            timeouts=Timeouts(connect=5.0, list_read=10.0, watch=5.0, watch_slack=5.0),
            backoff=Backoff(initial=0.05, maximum=0.5),
            resources=resources,
        )
        tuning = Tuning(lease=lease or LeaseTiming(), watcher=settings)
        w = RunningWatcher(rt, asyncio.create_task(serve(rt, tuning), name=f"watcher-{identity}"))
        running.append(w)
        return w

    yield start
    for w in running:
        if not w.task.done():
            w.rt.stop.set()
    for w in running:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.task, 15)


@pytest.fixture
async def cluster(sim_api: SimApi) -> Cluster:
    c = Cluster(sim_api.store)
    await c.create("namespaces", {"metadata": {"name": "a"}})
    await c.create("namespaces", {"metadata": {"name": "b"}})
    await c.create("namespaces", {"metadata": {"name": LEASE_NS}})
    await c.create("namespaces", {"metadata": {"name": "kubevirt"}})
    return c


async def watches_open(sim_api: SimApi, count: int = 8, within: float = 10.0) -> None:
    """Wait until the watcher has a watch open on every resource (the store counts them)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while sim_api.store.watcher_count() < count:
        if loop.time() > deadline:
            raise AssertionError(f"{sim_api.store.watcher_count()} watches open, expected {count}")
        await asyncio.sleep(0.02)  # polling a condition with a deadline


# ---- tests ------------------------------------------------------------------------------------------------------


async def test_publishes_every_object_then_changes_and_deletions(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    for i in range(10):
        await cluster.create("pods", pod(f"launcher-{i}"), "a")
    await cluster.create("pods", pod("web", launcher=False), "a")  # unmanaged namespace: not published
    await cluster.create("virtualmachineinstances", vmi("vm1"), "a")
    await cluster.create("resourcequotas", quota("plain", managed=False), "a")
    await cluster.create("events", failed_create("vm1.1", "vm1"), "a")
    await cluster.create("events", failed_create("vm1.2", "vm1", reason="Scheduled"), "a")  # not followed
    kv_config = {"developerConfiguration": {"cpuAllocationRatio": 4}}
    await cluster.create(
        "kubevirts", {"metadata": {"name": "kubevirt"}, "spec": {"configuration": kv_config}}, "kubevirt"
    )
    w = await start_watcher()
    await tap.wait("the first list", lambda: len(tap.live("a", "Pod")) == 10 and bool(tap.of(Upserted, "KubeVirt")))
    assert tap.live("a", "Pod") == [f"launcher-{i}" for i in range(10)]
    assert tap.live("a", "VirtualMachineInstance") == ["vm1"]
    assert tap.live("a", "ResourceQuota") == ["plain"]
    assert tap.live("a", "Event") == ["vm1.1"]
    cluster_wide = tap.ledger.cluster_state(CLUSTER)
    assert cluster_wide is not None
    kv = cluster_wide.live("KubeVirt")
    assert [s.cpu_allocation_ratio for s in kv if isinstance(s, KubeVirtSnapshot)] == ["4"]
    assert tap.live("b", "Namespace") == ["b"]
    upserts = [e for e in tap.events if isinstance(e, Upserted)]
    assert len(upserts) == len({e.uid for e in upserts}), "one event per object"
    assert not tap.of(Upserted, "Pod", "web")
    # A change arrives as a new version, a deletion as a Deleted event.
    changed = await cluster.relabel("pods", "a", "launcher-3", {"tier": "gold"})
    await cluster.delete("virtualmachineinstances", "a", "vm1")
    await tap.wait(
        "the change and the deletion",
        lambda: (
            bool(tap.of(Deleted, "VirtualMachineInstance", "vm1")) and len(tap.of(Upserted, "Pod", "launcher-3")) > 1
        ),
    )
    versions = [e.resource_version for e in tap.of(Upserted, "Pod", "launcher-3")]
    assert versions[-1] == changed["metadata"]["resourceVersion"] and len(versions) == 2
    assert tap.live("a", "VirtualMachineInstance") == []
    gone = tap.of(Deleted, "VirtualMachineInstance", "vm1")[0]
    assert gone.snapshot is not None and gone.snapshot.name == "vm1"
    assert w.metric("vmquota_watcher_relists_total", kind="Pod", reason="gone") == 0
    assert w.rt.health.ready


def migration(name: str, vmi_name: str, *, rejected: bool, phase: str = "Pending") -> Obj:
    conditions = [{"type": "migrationRejectedByResourceQuota", "status": "True"}] if rejected else []
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": name},
        "spec": {"vmiName": vmi_name},
        "status": {"phase": phase, "conditions": conditions},
    }


HIDDEN = "vmquota-test/hidden"
"""A label the VMI loop of :func:`resources_hiding_vmis` never lists or watches."""


def resources_hiding_vmis() -> tuple[ResourceSpec, ...]:
    """The watcher's resources, its VMI watch blind to VMIs labelled :data:`HIDDEN`: only a fresh read publishes
    them."""
    return tuple(
        ResourceSpec(r.kind, r.plural, r.group, r.version, label_selector=f"!{HIDDEN}")
        if r.kind == "VirtualMachineInstance"
        else r
        for r in RESOURCES
    )


async def test_a_refused_migrations_vmi_is_read_afresh_and_published_before_it(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    """The VMI watch may lag the migration watch (a hotplug not delivered yet when KubeVirt's target is refused):
    before a migration whose target quota refused is published, the watcher reads its VMI and publishes it first
    when newer. Here the VMI watch never delivers the VMIs (a label selector hides them), so only the fresh read can
    publish one; a migration not refused, or past ``Pending`` (its target exists), reads nothing."""
    resources = resources_hiding_vmis()
    for name in ("vm1", "vm2", "vm3"):
        obj = vmi(name)
        obj["metadata"]["labels"] = {HIDDEN: "true"}
        await cluster.create("virtualmachineinstances", obj, "a")
    vmims = "virtualmachineinstancemigrations"
    await cluster.create(vmims, migration("m1", "vm1", rejected=True), "a", keep_status=True)  # listed
    w = await start_watcher(resources=resources)
    await wait_until(lambda: w.rt.health.ready, what="every resource listed")
    await cluster.create(vmims, migration("m2", "vm2", rejected=False), "a", keep_status=True)  # watched
    scheduling = migration("m0", "vm3", rejected=True, phase="Scheduling")
    await cluster.create(vmims, scheduling, "a", keep_status=True)
    grow = {"spec": {"domain": {"memory": {"guest": "2Gi"}}}}  # (a hotplug the VMI watch does not deliver)
    await cluster.store.patch(cluster.store.resource("virtualmachineinstances"), "a", "vm2", grow, "merge")
    await cluster.create(vmims, migration("m3", "vm2", rejected=True), "a", keep_status=True)
    await tap.wait("the migrations", lambda: len(tap.of(Upserted, "VirtualMachineInstanceMigration")) == 4)
    order = [(e.kind, e.name) for e in tap.events if isinstance(e, Upserted) and e.kind.startswith("VirtualMachineI")]
    vmi_kind, vmim_kind = "VirtualMachineInstance", "VirtualMachineInstanceMigration"
    assert order == [
        (vmi_kind, "vm1"),
        (vmim_kind, "m1"),
        (vmim_kind, "m2"),
        (vmim_kind, "m0"),
        (vmi_kind, "vm2"),
        (vmim_kind, "m3"),
    ], "each refused migration's VMI, read afresh, just before it (listed or watched); nothing for the other"
    sizes = [e.snapshot.guest_memory for e in tap.of(Upserted, vmi_kind) if isinstance(e.snapshot, VmiSnapshot)]
    assert sizes == [Quantity.parse("1Gi"), Quantity.parse("2Gi")], "as the API server has each VMI when read"
    assert w.rt.health.ready


async def test_a_tenants_migration_cannot_make_the_watcher_read_or_publish_a_vmi(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    """The fresh read follows KubeVirt's word, in the migration's own namespace. A tenant who creates a migration
    with the refusal condition already in its ``status`` gets no read (the API server drops a created object's
    status: only KubeVirt writes it), and a refused migration naming a VMI of another namespace reads its own
    namespace, where there is none: nothing is published for either (the VMI watch hides the VMIs, as above)."""
    resources = resources_hiding_vmis()
    victim = vmi("vm1")
    victim["metadata"]["labels"] = {HIDDEN: "true"}
    await cluster.create("virtualmachineinstances", victim, "a")
    w = await start_watcher(resources=resources)
    await wait_until(lambda: w.rt.health.ready, what="every resource listed")
    vmims = "virtualmachineinstancemigrations"
    forged = await cluster.create(vmims, migration("forged", "vm1", rejected=True), "a")  # as the API server does
    assert not forged.get("status", {}).get("conditions"), "the created migration kept a status"
    await cluster.create(vmims, migration("elsewhere", "vm1", rejected=True), "b", keep_status=True)
    await tap.wait("both migrations", lambda: len(tap.of(Upserted, "VirtualMachineInstanceMigration")) == 2)
    assert not tap.of(Upserted, "VirtualMachineInstance"), "a tenant's migration made the watcher publish a VMI"


async def test_managed_namespace_pods_are_listed_and_synced(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    await cluster.create("pods", pod("launcher"), "b")
    for i in range(9):
        await cluster.create("pods", pod(f"web-{i}", launcher=False), "b")
    await start_watcher()
    await tap.wait("the launcher pod", lambda: tap.live("b", "Pod") == ["launcher"])
    assert not tap.syncs("Pod", "b"), "an unmanaged namespace gets no pod sync: its list is not complete"
    await cluster.create("resourcequotas", quota("compute", managed=True), "b")
    await tap.wait("the namespace's pods", lambda: len(tap.live("b", "Pod")) == 10 and bool(tap.syncs("Pod", "b")))
    sync = tap.syncs("Pod", "b")[-1]
    assert len(sync.present) == 10
    # New pods of the managed namespace follow; when it stops being managed, other pods are not published again.
    await cluster.create("pods", pod("web-new", launcher=False), "b")
    await tap.wait("a new pod", lambda: "web-new" in tap.live("b", "Pod"))
    quota_versions = len(tap.of(Upserted, "ResourceQuota", "compute"))
    await cluster.relabel("resourcequotas", "b", "compute", {"vmquota.io/managed": "false"})
    # (the quota's watch and the pods' are two streams: the pods are changed once the watcher has the quota's change)
    await tap.wait("the quota's change", lambda: len(tap.of(Upserted, "ResourceQuota", "compute")) > quota_versions)
    await cluster.relabel("pods", "b", "web-0", {"tier": "gold"})
    await cluster.relabel("pods", "b", "launcher", {"tier": "gold"})
    await tap.wait("the launcher's change", lambda: len(tap.of(Upserted, "Pod", "launcher")) == 2)
    assert len(tap.of(Upserted, "Pod", "web-0")) == 1


async def test_gone_relists_publishes_deletions_then_a_sync(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, sim_api: SimApi
) -> None:
    await cluster.create("resourcequotas", quota("compute", managed=True), "a")
    for i in range(6):
        await cluster.create("pods", pod(f"p{i}", launcher=i % 2 == 0), "a")
    w = await start_watcher()
    await tap.wait("the pods and their sync", lambda: len(tap.live("a", "Pod")) == 6 and bool(tap.syncs("Pod", "a")))
    await watches_open(sim_api)
    first_syncs = len(tap.syncs("Pod", "a"))
    # Keep the pod watch away while pods change, then compact the history: the re-watch gets 410 Gone.
    sim_api.faults.fail(500, verbs=["watch"], resources=["pods"])
    sim_api.faults.drop_watches(["pods"])
    await cluster.delete("pods", "a", "p1")
    await cluster.delete("pods", "a", "p4")
    created = await cluster.create("pods", pod("p9"), "a")
    sim_api.faults.compact()
    sim_api.faults.clear()
    await tap.wait("the relist's sync", lambda: len(tap.syncs("Pod", "a")) > first_syncs)
    assert sorted(e.name for e in tap.of(Deleted, "Pod")) == ["p1", "p4"]
    assert tap.live("a", "Pod") == ["p0", "p2", "p3", "p5", "p9"]
    assert w.metric("vmquota_watcher_relists_total", kind="Pod", reason="gone") == 1
    assert w.metric("vmquota_watcher_errors_total", kind="Pod", code="410") == 1
    # On the stream: the deletions and the new pod, then the sync listing exactly what exists.
    sync = tap.syncs("Pod", "a")[-1]
    at = tap.events.index(sync)
    before = tap.events[:at]
    assert {e.name for e in before if isinstance(e, Deleted)} == {"p1", "p4"}
    assert any(isinstance(e, Upserted) and e.uid == created["metadata"]["uid"] for e in before)
    live = {s.uid for s in tap.ledger.state(CLUSTER, "a").live("Pod")}  # type: ignore[union-attr]
    assert set(sync.present) == live and len(live) == 5


async def test_dropped_watches_resume_without_duplicates(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, sim_api: SimApi
) -> None:
    w = await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    await watches_open(sim_api)
    for i in range(30):
        await cluster.create("pods", pod(f"p{i}"), "a")
        if i % 10 == 9:
            sim_api.faults.drop_watches()
            await watches_open(sim_api)  # resumed from the last version seen
            await cluster.relabel("pods", "a", f"p{i - 5}", {"tier": "gold"})
    await tap.wait("every pod", lambda: len(tap.live("a", "Pod")) == 30)
    await tap.wait("the last change", lambda: len(tap.of(Upserted, "Pod", "p24")) == 2)
    versions = [(e.uid, e.resource_version) for e in tap.events if isinstance(e, Upserted)]
    assert len(versions) == len(set(versions)), "a version reached the stream twice"
    assert w.metric("vmquota_watcher_relists_total", kind="Pod", reason="gone") == 0
    restarts = sum(w.metric("vmquota_watcher_watch_restarts_total", kind="Pod", reason=r) for r in ("dropped", "error"))
    assert restarts >= 3


async def test_throttling_and_server_errors_back_off_and_recover(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, sim_api: SimApi
) -> None:
    for i in range(5):
        await cluster.create("virtualmachineinstances", vmi(f"vm{i}"), "a")
    sim_api.faults.fail(429, verbs=["list"], resources=["virtualmachineinstances"], count=2, retry_after=1)
    sim_api.faults.fail(500, verbs=["list", "watch"], resources=["pods"], count=3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    w = await start_watcher()
    await tap.wait("the VMIs", lambda: len(tap.live("a", "VirtualMachineInstance")) == 5)
    took = loop.time() - started
    # (the backoff alone would wait 0.05 + 0.1 s; the watcher's maximum here is 0.5 s, which caps a Retry-After)
    assert took >= 1.0, f"two 429s with Retry-After 1s honoured up to the 0.5s maximum, yet listed after {took:.2f}s"
    await cluster.create("pods", pod("after"), "a")
    await tap.wait("a pod after the errors", lambda: tap.live("a", "Pod") == ["after"])
    assert w.metric("vmquota_watcher_errors_total", kind="VirtualMachineInstance", code="429") == 2
    assert w.metric("vmquota_watcher_errors_total", kind="Pod", code="500") == 3


async def test_malformed_object_goes_to_the_dead_letter_subject(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    w = await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    bad = await cluster.create("pods", pod("absurd", cpu="lots"), "a")
    await cluster.create("pods", pod("fine"), "a")
    await tap.wait("the dead letter and the next pod", lambda: bool(tap.dead) and tap.live("a", "Pod") == ["fine"])
    letter = tap.dead[0]
    assert letter.service == "watcher" and letter.cluster == CLUSTER
    assert "Pod a/absurd" in letter.reason and "cpu" in letter.reason
    assert letter.original_subject == "vmquota.ev.c1.a.pod"
    assert letter.id.endswith(f"/{bad['metadata']['uid']}/{bad['metadata']['resourceVersion']}")
    assert msgspec.json.decode(letter.payload)["metadata"]["name"] == "absurd"
    assert w.metric("vmquota_watcher_errors_total", kind="Pod", code="dlq") == 1
    # Deleting it is still reported (the ledger may hold an older, readable version).
    await cluster.delete("pods", "a", "absurd")
    await tap.wait("its deletion", lambda: bool(tap.of(Deleted, "Pod", "absurd")))


async def test_a_tenants_event_of_a_megabyte_is_a_short_dead_letter_and_the_watcher_goes_on(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    """Anyone may write an Event about any VMI, in any namespace: one whose refusal text is a megabyte could not be
    read, and the dead letter quoting it was larger than the bus takes, which stopped the watcher's publisher and
    the watcher with it, for every namespace (and again at each restart, while the Event lasts). The reason is cut
    short, and a message the bus cannot take is dropped, never the publisher."""
    w = await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    huge = failed_create("huge", "v")
    huge["message"] = "exceeded quota: q, requested: " + "!" * 2**20 + ", used: "
    await cluster.create("events", huge, "b")
    await cluster.create("pods", pod("after"), "a")
    await tap.wait("the dead letter and the next pod", lambda: bool(tap.dead) and tap.live("a", "Pod") == ["after"])
    assert len(tap.dead[0].reason) <= contract.MAX_REASON + 64, len(tap.dead[0].reason)
    assert "more characters)" in tap.dead[0].reason
    assert not w.task.done()


async def test_a_tenants_object_nested_past_the_decoders_depth_stops_no_watcher(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    """A field KubeVirt keeps unknown (a VM's template metadata; a VMI's ``spec.domain.clock``) nests 1,200 deep,
    which the API server takes (Go's decoder goes to 10,000): msgspec raised RecursionError, which nothing caught,
    and the watcher stopped for every namespace, again at every start (its list met the object). The object is read
    with what is nested past 64 levels as null, and published; a watcher started afterwards lists it too."""
    w = await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    nested: Any = 1
    for _ in range(1200):
        nested = {"x": nested}
    template = {"metadata": {"annotations": {}, "x": nested}, "spec": {"domain": {"devices": {}}}}
    vm = {"metadata": {"name": "deep"}, "spec": {"running": False, "template": template}}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)  # (the simulator's store is Python, which the API server is not)
    try:
        await cluster.create("virtualmachines", vm, "b")
    finally:
        sys.setrecursionlimit(limit)
    await cluster.create("pods", pod("after"), "a")
    await tap.wait("the VM and the next pod", lambda: bool(tap.of(Upserted, "VirtualMachine", "deep")))
    await tap.wait("the next pod", lambda: tap.live("a", "Pod") == ["after"])
    await w.stop()
    again = await start_watcher("w2")
    await cluster.create("pods", pod("later"), "a")
    await tap.wait("the restarted watcher's next pod", lambda: tap.live("a", "Pod") == ["after", "later"])
    assert not again.task.done()


async def test_one_namespaces_flood_of_dead_letters_leaves_another_namespaces_letters(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, nats_server: NatsServer
) -> None:
    """A tenant writes Events as often as it likes, each a dead letter when its refusal does not read: with one
    subject for every namespace's letters, a flood evicted every other namespace's letters from the stream. Each
    namespace's letters now have a subject of their own, kept to DLQ_PER_SUBJECT letters, each at most 32 KiB of
    the object (here the stream is scaled down from 512 MiB to 8 MiB)."""
    bus = await Bus.connect(
        NatsOptions(url=nats_server.url, name="test", stream_sizes=contract.StreamSizes(dlq=8 * 2**20)),
        connect_timeout=10,
    )
    try:
        await bus.ensure_streams(s for s in contract.streams() if s.name == contract.DLQ_STREAM)
        await start_watcher()
        await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
        mine = failed_create("mine", "v")
        mine["message"] = "exceeded quota: q, requested: junk, used: "
        await cluster.create("events", mine, "a")
        await tap.wait("namespace a's dead letter", lambda: any("Event a/mine" in d.reason for d in tap.dead))
        flood = 400
        for i in range(flood):
            junk = failed_create(f"junk-{i}", "v")
            junk["involvedObject"]["namespace"] = "b"
            junk["message"] = "exceeded quota: q, requested: junk, used: " + "A" * 16 * 2**10
            await cluster.create("events", junk, "b")
        await tap.wait("the flood", lambda: sum("Event b/junk-" in d.reason for d in tap.dead) == flood, within=60)
        info = await bus.js.stream_info(contract.DLQ_STREAM)
        reasons = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):  # (the per-subject limit deletes inside)
                letter = await bus.js.get_msg(contract.DLQ_STREAM, seq)
                reasons.append(contract.decode_dead_letter(letter.data or b"").reason)
    finally:
        await bus.close()
    assert any("Event a/mine" in r for r in reasons), "namespace b's flood evicted namespace a's dead letter"
    assert sum("Event b/junk-" in r for r in reasons) == contract.DLQ_PER_SUBJECT


async def test_an_owner_reference_of_a_megabyte_hides_no_version_of_a_pod(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, sim_api: SimApi
) -> None:
    """Kubernetes takes an owner reference's uid of any length: one of a megabyte made every later version of the
    pod too large for the bus (a dead letter each), and the ledger kept an old one. Kept only as long as a uid can
    be, the pod's versions go on being published."""
    await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    await cluster.create("pods", pod("p"), "b")
    await tap.wait("the pod", lambda: tap.live("b", "Pod") == ["p"])
    store = sim_api.store
    big = {"apiVersion": "v1", "kind": "Pod", "name": "n", "uid": "x" * 2**20, "controller": True}
    await store.patch(store.resource("pods"), "b", "p", {"metadata": {"ownerReferences": [big]}}, "merge")
    latest = await store.patch(store.resource("pods"), "b", "p", {"metadata": {"labels": {"z": "1"}}}, "merge")
    rv = latest["metadata"]["resourceVersion"]

    def published() -> bool:
        return any(e.resource_version == rv for e in tap.of(Upserted, "Pod", "p"))

    await tap.wait("the pod's latest version", published)
    assert not tap.dead


async def test_two_watchers_one_publishes_the_other_takes_over(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher
) -> None:
    lease = LeaseTiming(lease_duration=2, renew_deadline=1.5, retry_period=1.0)
    first = await start_watcher("w1", leader_election=True, lease=lease)
    await tap.wait("a leader's first list", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    second = await start_watcher("w2", leader_election=True, lease=lease)
    await cluster.create("pods", pod("p1"), "a")
    await tap.wait("the pod", lambda: tap.live("a", "Pod") == ["p1"])
    # The second candidate stays a standby: connected and ready (once its NATS connection is up), publishing nothing.
    await wait_until(lambda: second.rt.health.ready, 10.0, "the standby's readiness")
    assert (
        first.metric(
            "vmquota_watcher_leader",
        )
        == 1
        and second.metric("vmquota_watcher_leader") == 0
    )
    assert first.published() > 0 and second.published() == 0
    assert second.rt.health.ready
    loop = asyncio.get_running_loop()
    await first.stop()
    stopped = loop.time()
    await cluster.create("pods", pod("p2"), "a")
    await tap.wait("the standby's takeover", lambda: tap.live("a", "Pod") == ["p1", "p2"], within=15)
    takeover = loop.time() - stopped
    assert second.metric("vmquota_watcher_leader") == 1 and second.published() > 0
    assert takeover < lease.lease_duration + 3.0, f"took over after {takeover:.1f}s"


async def stream_events(url: str) -> list[Upserted | Deleted | Sync]:
    """Every event on the stream now, read with a fresh connection and consumer."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(contract.EVENTS_STREAM)
        sub = await js.pull_subscribe("vmquota.ev.>", stream=contract.EVENTS_STREAM)
        out: list[Upserted | Deleted | Sync] = []
        while len(out) < info.state.messages:
            for msg in await sub.fetch(500, timeout=5):
                out.append(contract.decode_event(msg.data))
        return out
    finally:
        await nc.close()


async def test_nats_restart_loses_nothing(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, nats_server: NatsServer, sim_api: SimApi
) -> None:
    w = await start_watcher()
    await tap.wait("the namespaces", lambda: len(tap.of(Upserted, "Namespace")) == 4)
    await watches_open(sim_api)
    for i in range(10):
        await cluster.create("pods", pod(f"before-{i}"), "a")
    nats_server.kill()  # no clean shutdown: acks in flight are lost
    for i in range(10):
        await cluster.create("pods", pod(f"during-{i}"), "a")
    nats_server.start()
    for i in range(10):
        await cluster.create("pods", pod(f"after-{i}"), "a")
    want = {f"{p}-{i}" for p in ("before", "during", "after") for i in range(10)}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            events = await stream_events(nats_server.url)
        except (nats.errors.Error, OSError, TimeoutError):
            events = []  # the server is still coming back
        names = {e.name for e in events if isinstance(e, Upserted) and e.kind == "Pod"}
        if names >= want or loop.time() > deadline:
            break
        await asyncio.sleep(0.2)  # polling the stream until a deadline
    assert want <= names, f"missing after the restart: {sorted(want - names)}"
    versions = [(e.uid, e.resource_version) for e in events if isinstance(e, Upserted)]
    assert len(versions) == len(set(versions)), "the republished state was stored twice"
    # After the reconnect the watcher listed everything again (the server might have lost its store).
    reconnects = w.rt.metrics.registry.get_sample_value("vmquota_nats_reconnects_total", {"service": "watcher"})
    assert reconnects is not None and reconnects >= 1
    assert w.metric("vmquota_watcher_relists_total", kind="Pod", reason="start") >= 2


async def test_a_bus_that_lost_its_store_gets_the_current_state_again(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, nats_server: NatsServer, sim_api: SimApi
) -> None:
    await cluster.create("resourcequotas", quota("compute", managed=True), "a")
    for i in range(5):
        await cluster.create("pods", pod(f"p{i}", launcher=False), "a")
    await start_watcher()
    await tap.wait("the pods", lambda: len(tap.live("a", "Pod")) == 5)
    nats_server.kill()
    shutil.rmtree(nats_server.store)  # a new, empty volume
    nats_server.start()
    # the ledger creates the streams again (after its reconnect: tests/integration/test_ledger.py -k lost_its_store);
    # the watcher waits for them, and lists and publishes everything again
    keeper = await Bus.connect(NatsOptions(url=nats_server.url), connect_timeout=10)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
    finally:
        await keeper.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            events = await stream_events(nats_server.url)
        except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError):
            events = []  # the stream is not back yet
        pods = {e.name for e in events if isinstance(e, Upserted) and e.kind == "Pod"}
        synced = any(isinstance(e, Sync) and e.kind == "Pod" and e.namespace == "a" for e in events)
        if (len(pods) == 5 and synced) or loop.time() > deadline:
            break
        await asyncio.sleep(0.2)  # polling the stream until a deadline
    assert pods == {f"p{i}" for i in range(5)} and synced
    assert any(isinstance(e, Upserted) and e.kind == "Namespace" for e in events)


async def test_vmquota_run_watcher_serves_health_and_metrics(
    cluster: Cluster, tap: Tap, nats_server: NatsServer, sim_api: SimApi
) -> None:
    await cluster.create("pods", pod("p1"), "a")
    cmd = [sys.executable, "-m", "services.cli.main", "run", "watcher", "--cluster", CLUSTER, "--nats", nats_server.url]
    cmd += ["--kubeconfig", str(sim_api.kubeconfig), "--no-leader-election", "--http-port", "0"]
    proc = await asyncio.create_subprocess_exec(*cmd, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    assert proc.stderr is not None
    try:
        port = 0
        while not port:
            line = await asyncio.wait_for(proc.stderr.readline(), 20)
            assert line, "the watcher exited"
            with contextlib.suppress(ValueError):
                port = int(json.loads(line).get("http_port") or 0)
        await tap.wait("the pod", lambda: tap.live("a", "Pod") == ["p1"], within=20)
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{port}"
            ready = False
            for _ in range(100):  # readiness follows the first list: poll it with a deadline
                async with http.get(f"{base}/readyz") as resp:
                    ready = resp.status == 200
                if ready:
                    break
                await asyncio.sleep(0.05)
            assert ready
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
        assert 'vmquota_watcher_published_total{cluster="c1",kind="Pod",service="watcher",type="upserted"} 1.0' in text
        assert 'vmquota_watcher_leader{cluster="c1",service="watcher"} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_vmquota_run_watcher_needs_a_cluster() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "watcher"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--cluster" in out.stderr


async def test_a_relist_request_publishes_every_object_again_then_the_marker_answering_it(
    cluster: Cluster, tap: Tap, start_watcher: StartWatcher, sim_api: SimApi, nats_server: NatsServer
) -> None:
    """A ledger that lost events asks on ``vmquota.relist.<cluster>``: every object is published again (unchanged
    ones too, under message ids of the round, so the stream's duplicate window drops none), each kind's syncs
    follow, and a namespaces sync answering the request comes last; a request for a token answered already is not
    relisted again (the ledger asks until it has read the answer), a new one gets a round of its own."""
    await cluster.create("resourcequotas", quota("compute", managed=True), "a")
    for i in range(3):
        await cluster.create("pods", pod(f"p{i}"), "a")
    await cluster.create("virtualmachineinstances", vmi("vm1"), "a")
    w = await start_watcher()
    await tap.wait("the first list", lambda: len(tap.live("a", "Pod")) == 3 and bool(tap.syncs("Pod", "a")))
    await watches_open(sim_api)
    before = len(tap.events)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.publish(contract.relist_subject(CLUSTER), b"not json")  # (ignored, with a warning)

        async def ask(token: str) -> None:
            request = contract.RelistRequest(token=token, requester="vmquota/ledger/all")
            await nc.publish(contract.relist_subject(CLUSTER), contract.encode(request))
            await nc.flush()

        def answered(token: str) -> list[Sync]:
            return [e for e in tap.events[before:] if isinstance(e, Sync) and token in e.answers]

        def applied() -> int:
            return max(st.seq for st in tap.ledger.states.values())

        await ask("loss-41")
        await tap.wait("the marker", lambda: bool(answered("loss-41")))
        again = tap.events[before : tap.events.index(answered("loss-41")[0])]
        assert {e.name for e in again if isinstance(e, Upserted) and e.kind == "Pod"} == {"p0", "p1", "p2"}
        assert {e.name for e in again if isinstance(e, Upserted) and e.kind == "VirtualMachineInstance"} == {"vm1"}
        assert {e.kind for e in again if isinstance(e, Sync)} >= {"Pod", "VirtualMachineInstance", "ResourceQuota"}
        (marker,) = answered("loss-41")
        assert marker.kind == "Namespace" and marker.namespace == contract.CLUSTER_TOKEN
        assert marker.answers == ["loss-41"]
        assert {tap.ledger.state(CLUSTER, ns) is not None for ns in ("a", "b")} == {True}
        assert tap.ledger.whole(CLUSTER, "loss-41", applied()) and not tap.ledger.whole(CLUSTER, "loss-42", applied())
        rounds = w.metric("vmquota_watcher_relists_total", kind="Pod", reason="asked")

        # a ledger that has not read the answer yet asks again: one round answers a token
        await ask("loss-41")
        await ask("loss-42")
        await tap.wait("the next round", lambda: bool(answered("loss-42")))
        assert tap.ledger.whole(CLUSTER, "loss-42", applied())
        assert w.metric("vmquota_watcher_relists_total", kind="Pod", reason="asked") == rounds + 1
        assert len(answered("loss-41")) == 1
    finally:
        await nc.close()
