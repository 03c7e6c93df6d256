"""The enforcer against a real nats-server and the simulated cluster over HTTPS (kubernetes-asyncio, as in
production). Quota events are mirrored from the simulated cluster to the bus as the watcher publishes them; usage
snapshots are published as the ledger does, so each test controls exactly what the enforcer sees."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import msgspec
import pytest
from kubernetes_asyncio import client, config

from services.devtools.simcluster.auth import KUBEVIRT_CONTROLLER, acting_as
from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.quota import QuotaTiming
from services.devtools.simcluster.store_api import ApiError, Obj
from services.enforcer.kube import KubeQuotas, QuotaApi
from services.enforcer.options import EnforcerOptions
from services.enforcer.service import NUDGE_PAST_FAILURES, Enforcer
from services.platform.bus import Bus, NatsOptions
from services.platform.http import Metrics
from services.platform.kube import KubeError
from services.platform.lease import Fence
from services.platform.runner import cancel
from shared import contract
from shared.errors import InvalidInput
from shared.normalize import normalize
from shared.quantity import Quantity
from shared.quota import enforcement, guard
from shared.quota.annotations import (
    BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    MANAGED_LABEL,
    MODE_ANNOTATION,
    STATUS_ANNOTATION,
    USAGE_ANNOTATION,
    USAGE_FROM_ANNOTATION,
)
from shared.snapshot import VmiSnapshot, size_digest
from shared.times import rfc3339
from tests.builders import created_vmi, usage_snapshot, vmi_obj
from tests.integration.e2e import full_namespace, install_guard, pipeline, rl
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

CLUSTER = "c1"
NS = "tenant-a"
MANAGED = {MANAGED_LABEL: "true"}
MIGRATING = [contract.MigrationState(name="m1", vmi="vm1", state="pending", reserved={"limits.memory": "16Gi"})]


@pytest.fixture
async def sim() -> AsyncIterator[SimCluster]:
    async with SimCluster(speed=0.02, seed=3) as s:
        await s.create_namespace(NS)
        yield s


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(NatsOptions(url=nats_url, name="test"), connect_timeout=10)
    await b.ensure_streams(contract.streams())
    yield b
    await b.close()


@pytest.fixture
async def api(sim: SimCluster) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(sim.kubeconfig_path), client_configuration=cfg)
    async with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
async def mirror(sim: SimCluster, bus: Bus) -> AsyncIterator[None]:
    """Publish every ResourceQuota change of the simulated cluster as the watcher does."""
    res = sim.store.resource("resourcequotas")

    async def run() -> None:
        async for ev in sim.store.watch(res, resource_version=0):
            if ev.type in ("ADDED", "MODIFIED", "DELETED"):
                await publish_quota(bus, ev.object, deleted=ev.type == "DELETED")

    task = asyncio.create_task(run())
    yield
    await cancel(task)  # again and again if need be: nats-py can swallow a cancellation (Python 3.11's wait_for)
    assert task.done()


def quota_event(obj: Obj, *, deleted: bool = False) -> contract.Upserted | contract.Deleted:
    """The watcher's event for a ResourceQuota object."""
    meta = obj["metadata"]
    ev = contract.object_event(
        "deleted" if deleted else "upserted",
        cluster=CLUSTER,
        kind="ResourceQuota",
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        rv=meta["resourceVersion"],
        snapshot=normalize(obj),
    )
    assert not isinstance(ev, contract.Sync)
    return ev


async def publish_quota(b: Bus, obj: Obj, *, deleted: bool = False) -> None:
    meta = obj["metadata"]
    ev = quota_event(obj, deleted=deleted)
    await b.publish(
        contract.event_subject(CLUSTER, "ResourceQuota", meta["namespace"]), contract.encode(ev), msg_id=ev.id
    )


async def publish_usage(
    b: Bus,
    seq: int,
    quotas: dict[str, contract.QuotaTerms],
    migrations: list[contract.MigrationState] | None = None,
    vms: list[contract.VmState] | None = None,
) -> None:
    u = contract.UsageSnapshot(
        id=f"{CLUSTER}/usage/{NS}/{seq}",
        source=contract.source("ledger", CLUSTER),
        subject=NS,
        time=rfc3339(),
        cluster=CLUSTER,
        namespace=NS,
        seq=seq,
        quotas=quotas,
        migrations=migrations or [],
        vms=vms or [],
    )
    await b.publish(contract.usage_subject(CLUSTER, NS), contract.encode(u), msg_id=u.id)


def terms(budget: str, hard: str) -> dict[str, contract.QuotaTerms]:
    """The terms of a ``limits.memory`` quota whose ``hard`` is the budget plus a reservation (``S``), as the
    ledger states them (a snapshot whose ``hard`` exceeds ``B + P + S`` is refused)."""
    extra = {}
    with contextlib.suppress(InvalidInput):
        room = Quantity.parse(hard) - Quantity.parse(budget)
        if room.nanos > 0:
            extra = {"limits.memory": room.canonical()}
    return {
        "compute": contract.QuotaTerms(
            mode="VmiPodUsage", budget={"limits.memory": budget}, reserved=extra, hard={"limits.memory": hard}
        )
    }


@contextlib.asynccontextmanager
async def enforcer(
    bus: Bus, api: client.ApiClient, *, calls: QuotaApi | None = None, **opts: Any
) -> AsyncIterator[tuple[Enforcer, asyncio.Task[None]]]:
    """A running enforcer (``calls``: its Kubernetes calls, when not the API server's as they are)."""
    kube = calls if calls is not None else KubeQuotas(api)
    e = Enforcer(bus, kube, EnforcerOptions(cluster=CLUSTER, idle=0.1, **opts), metrics=Metrics())
    stop = asyncio.Event()
    task = asyncio.create_task(e.run(stop))
    try:
        yield e, task
    finally:
        stop.set()
        done, _ = await asyncio.wait([task], timeout=20)
        if not done:
            for t in asyncio.all_tasks():
                t.print_stack()
            raise AssertionError("the enforcer did not stop within 20 s")
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc


def hard(q: Obj) -> dict[str, str]:
    return dict(q["spec"].get("hard") or {})


def notes(q: Obj) -> dict[str, str]:
    return dict(q["metadata"].get("annotations") or {})


async def wait_quota(sim: SimCluster, pred: Callable[[Obj], bool], what: str, within: float = 15.0) -> Obj:
    return await sim.wait_until("resourcequotas", NS, "compute", pred, within=within, what=what)


async def wait_events(sim: SimCluster, reason: str, *, count: int = 1, within: float = 10.0) -> list[Obj]:
    found: list[Obj] = []

    async def check() -> bool:
        found[:] = await sim.events(NS, "compute", reason=reason)
        return len(found) >= count

    await sim.wait_for(check, within=within, what=f"an Event {reason}")
    return found


async def read_stream(
    b: Bus, stream: str, subject: str, want: Callable[[list[Any]], bool], within: float = 10.0
) -> list[Any]:
    """Every message on ``subject`` so far, re-read until ``want`` holds (a condition with a deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        sub = await b.js.subscribe(subject, stream=stream, ordered_consumer=True)
        out: list[Any] = []
        try:
            while True:
                try:
                    m = await sub.next_msg(timeout=0.3)
                except Exception:  # nats TimeoutError: nothing more stored
                    break
                out.append(m)
        finally:
            await sub.unsubscribe()
        if want(out) or loop.time() > deadline:
            return out


async def decisions(b: Bus, want: Callable[[list[contract.Decision]], bool]) -> list[contract.Decision]:
    msgs = await read_stream(
        b,
        contract.DECISIONS_STREAM,
        contract.decision_subject(CLUSTER, NS),
        lambda ms: want([contract.decode_decision(m.data) for m in ms]),
    )
    return [contract.decode_decision(m.data) for m in msgs]


# ---- tests -------------------------------------------------------------------------------------------------------


async def test_adopts_then_raises_hard_through_a_409_storm(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        q = await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        assert hard(q) == {"limits.memory": "64Gi"}, "no usage yet: spec.hard stays as the administrator wrote it"
        assert json.loads(notes(q)[BUDGET_ANNOTATION]) == {"limits.memory": "64Gi"}
        assert notes(q)[STATUS_ANNOTATION] == "Waiting for usage (VmiPodUsage)"
        adopted = await wait_events(sim, "QuotaAdopted")
        assert adopted[0]["type"] == "Normal" and "budget limits.memory=64Gi" in adopted[0]["message"]

        await sim.wait_quota_synced(NS, "compute")  # (no status write of the controller's meets the storm)
        storm = sim.faults.fail(409, 1.0, verbs=["patch"], resources=["resourcequotas"], count=6)
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised")
        assert storm.injected == 6 and e.conflicts >= 6, "every injected 409 was re-read and retried"
        reads = e.metrics.registry.get_sample_value(
            "vmquota_enforcer_conflict_retries_total", {"service": "enforcer", "source": "read"}
        )
        assert reads is not None and reads >= 6, "an injected 409 changes no version: each was followed by a read"
        assert json.loads(notes(q)[LAST_HARD_ANNOTATION]) == {"limits.memory": "80Gi"}
        assert notes(q)[STATUS_ANNOTATION] == "Enforcing (VmiPodUsage)"
        synced = await sim.wait_quota_synced(NS, "compute")
        assert synced["status"]["hard"] == {"limits.memory": "80Gi"}, "the quota controller took it over"

        adjusted = await wait_events(sim, "QuotaAdjusted")
        assert adjusted[-1]["message"] == "raised limits.memory by 16Gi for the migration of vm1"
        ds = await decisions(bus, lambda ds: any(d.hard_after == {"limits.memory": "80Gi"} for d in ds))
        last = [d for d in ds if d.hard_after == {"limits.memory": "80Gi"}][-1]
        assert (last.quota, last.mode, last.usage_seq, last.dry_run) == ("compute", "VmiPodUsage", 5, False)
        assert last.budget == {"limits.memory": "64Gi"} and last.hard_before == {"limits.memory": "64Gi"}

        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "hard back to the budget")
        lowered = await wait_events(sim, "QuotaAdjusted", count=2)
        assert lowered[-1]["message"] == "lowered limits.memory by 16Gi: the migration of vm1 ended"


async def test_a_status_only_quota_version_is_kept_but_not_reconciled(
    sim: SimCluster, bus: Bus, api: client.ApiClient
) -> None:
    """Quota admission rewrites a quota's status on every admitted pod: the newer version is kept (its
    resourceVersion is the next patch's precondition), but it changes no plan, so no reconciliation runs."""
    e = Enforcer(bus, KubeQuotas(api), EnforcerOptions(cluster=CLUSTER), metrics=Metrics())
    e._warm = True  # (not running: the events are applied by hand)
    raw = await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"})  # not managed: plans change nothing
    key = (NS, "compute")

    def event(obj: Obj, rv: int) -> contract.Upserted | contract.Deleted:
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(rv)
        return quota_event(obj)

    rv = int(raw["metadata"]["resourceVersion"])
    e._queue.start()
    e._apply_quota_event(event(raw, rv))
    assert not e._queue.empty(), "a new quota is reconciled"
    await sim.wait_for(e._queue.empty, within=10, what="the reconciliation")

    echo = dict(raw, status={"hard": {"limits.memory": "64Gi"}, "used": {"limits.memory": "3Gi"}})
    e._apply_quota_event(event(echo, rv + 1))
    assert e.quotas[key].resource_version == str(rv + 1), "the newer version is kept"
    assert e._queue.empty(), "a status-only version is not reconciled"

    edited = dict(echo, metadata={**echo["metadata"], "labels": MANAGED})
    e._apply_quota_event(event(edited, rv + 2))
    assert not e._queue.empty(), "any other change is"
    await e._queue.stop()


class BeatenOnce:
    """The enforcer's calls, except that another writer changes the quota's status (as quota admission does) just
    before the first patch, and that version's quota event reaches the enforcer before the 409 comes back."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster) -> None:
        self.inner, self.sim = inner, sim
        self.calls: list[str] = []
        self.enforcer: Enforcer | None = None

    async def get_quota(self, namespace: str, name: str) -> Obj:
        self.calls.append("get")
        return await self.inner.get_quota(namespace, name)

    async def list_quotas(self, label_selector: str, namespace: str | None = None) -> list[Obj]:
        return await self.inner.list_quotas(label_selector, namespace)

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        self.calls.append("status")
        return await self.inner.patch_quota_status(namespace, name, body)

    async def create_event(self, namespace: str, body: Obj) -> None:
        await self.inner.create_event(namespace, body)

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        await self.inner.nudge_vmi(namespace, name, token)

    async def cancel_migration(self, namespace: str, name: str, uid: str) -> bool:
        return await self.inner.cancel_migration(namespace, name, uid)

    async def put_reservation(self, namespace: str, body: Obj, resource_version: str) -> str:
        return await self.inner.put_reservation(namespace, body, resource_version)

    async def get_vmi(self, namespace: str, name: str) -> Obj | None:
        return await self.inner.get_vmi(namespace, name)

    async def get_reservation(self, namespace: str) -> Obj | None:
        return await self.inner.get_reservation(namespace)

    async def list_reservations(self) -> list[Obj]:
        return await self.inner.list_reservations()

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        self.calls.append("patch")
        if self.calls.count("patch") == 1 and self.enforcer is not None:

            def admit(obj: Obj) -> Obj:
                obj["status"] = {"hard": obj["spec"]["hard"], "used": {"limits.memory": "3Gi"}}
                return obj

            res = self.sim.store.resource("resourcequotas")
            newer = await self.sim.store.mutate(res, namespace, name, admit, status=True)
            self.enforcer._apply_quota_event(quota_event(newer))
        return await self.inner.patch_quota(namespace, name, body)


async def test_a_conflict_is_retried_with_the_version_the_quota_events_brought(
    sim: SimCluster, bus: Bus, api: client.ApiClient
) -> None:
    """A 409 comes from a write that beat the patch; when its quota event arrived while the patch was out, the
    enforcer plans with that version and patches at once, without reading the quota."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    raw = await sim.wait_quota_synced(NS, "compute")  # (the quota controller's first write is done)
    calls = BeatenOnce(KubeQuotas(api), sim)
    e = Enforcer(bus, calls, EnforcerOptions(cluster=CLUSTER), metrics=Metrics())
    calls.enforcer = e
    e._warm = True  # (not running: the events are applied by hand)
    e._queue.start()
    e._apply_quota_event(quota_event(raw))
    await sim.wait_for(e._queue.empty, within=10, what="the adoption")  # one patch, beaten once
    q = await sim.get("resourcequotas", NS, "compute")
    assert json.loads(notes(q)[BUDGET_ANNOTATION]) == {"limits.memory": "64Gi"}, "adopted in the end"
    assert q["status"]["used"] == {"limits.memory": "3Gi"}, "the other writer's change was kept"
    assert calls.calls == ["patch", "patch"], "the conflict was retried with the newer version, no read"
    assert e.conflicts == 1
    assert (
        e.metrics.registry.get_sample_value(
            "vmquota_enforcer_conflict_retries_total", {"service": "enforcer", "source": "event"}
        )
        == 1
    )
    await e._queue.stop()


async def test_a_conflict_leaves_no_reference_cycle(sim: SimCluster, api: client.ApiClient) -> None:
    """A 409 is the enforcer's normal path: its error must be freed at once, not kept in a cycle with the frames
    of the call (and everything they hold: the usage snapshot, the response) until a garbage collection, which
    then pauses the enforcer for tens of ms under load."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"})
    quotas = KubeQuotas(api)
    body = {"metadata": {"resourceVersion": "1"}, "spec": {"hard": {"limits.memory": "65Gi"}}}  # a stale version
    held = [{"large": list(range(1000))}]  # what a caller's frame holds

    async def patch(payload: list[dict[str, Any]]) -> bool:
        try:
            await quotas.patch_quota(NS, "compute", body)
        except KubeError as e:
            return e.conflict
        return False

    await patch(held)  # (the first call warms the client up: its caches are not the conflicts' garbage)
    for _ in range(3):  # (what earlier tests left, callbacks included, goes first)
        await asyncio.sleep(0)
        gc.collect()
    gc.disable()
    try:
        conflicts = [await patch(held) for _ in range(20)]
        cyclic = gc.collect()
    finally:
        gc.enable()
    assert all(conflicts), "every patch conflicted"
    assert cyclic < 100, f"{cyclic} objects were left in reference cycles by 20 conflicts"


async def test_server_errors_back_off_and_converge(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    outage = sim.faults.fail(503, 1.0, verbs=["patch"], resources=["resourcequotas"], count=3)
    async with enforcer(bus, api, retry_base=0.02) as (e, _):
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised after the outage")
        assert outage.injected == 3
        errors = e.metrics.registry.get_sample_value(
            "vmquota_enforcer_patches_total", {"service": "enforcer", "outcome": "error"}
        )
        assert errors == 3, "each failed patch was retried once, after its backoff"
        await sim.wait_for(e.idle, within=20, what="enforcer idle")


async def test_dry_run_reports_and_writes_nothing(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    created = await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api, dry_run=True) as (e, _):
        ds = await decisions(bus, lambda ds: any(d.hard_after == {"limits.memory": "80Gi"} for d in ds))
        dry = [d for d in ds if d.hard_after == {"limits.memory": "80Gi"}]
        assert dry and all(d.dry_run for d in ds)
        assert "raised limits.memory by 16Gi for the migration of vm1" in dry[-1].reason
        await sim.wait_for(e.idle, within=20, what="enforcer idle")
        reported = e.reporter.reported
        await publish_usage(bus, 6, terms("64Gi", "80Gi"), MIGRATING)  # same content again
        await sim.wait_for(lambda: NS in e.usage and e.usage[NS].seq == 6 and e.idle(), within=20, what="seq 6")
        assert e.reporter.reported == reported, "a dry run reports each plan once"
    q = sim.peek("resourcequotas", NS, "compute")
    assert q is not None
    assert hard(q) == {"limits.memory": "64Gi"} and notes(q) == notes(created)
    assert e.patched == 0 and await sim.events(NS, "compute") == []


async def test_restart_mid_way_converges_to_the_same_hard(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api) as (first, task):
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "first enforcer raised hard")
        slow = sim.faults.add_latency(0.3, verbs=["patch"], resources=["resourcequotas"])
        await publish_usage(bus, 6, terms("64Gi", "72Gi"), MIGRATING)
        await sim.wait_for(lambda: not first._queue.idle(), within=20, what="a patch in flight")
        task.cancel()  # a crash (or a lost Lease) in the middle of a patch
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sim.faults.latencies.remove(slow)
    await publish_usage(bus, 7, terms("64Gi", "64Gi"))
    async with enforcer(bus, api) as (second, _):
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "second enforcer converged")
        await sim.wait_for(second.idle, within=20, what="second enforcer idle")
    q = sim.peek("resourcequotas", NS, "compute") or q
    assert hard(q) == {"limits.memory": "64Gi"}
    assert json.loads(notes(q)[BUDGET_ANNOTATION]) == {"limits.memory": "64Gi"}, "the budget never moved"
    assert json.loads(notes(q)[LAST_HARD_ANNOTATION]) == {"limits.memory": "64Gi"}
    async with enforcer(bus, api) as (third, _):
        await sim.wait_for(third.idle, within=20, what="third enforcer idle")
        assert third.patched == 0, "a restart with nothing new changes nothing"


async def test_foreign_write_and_release(sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api):
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised")
        await sim.set_quota_hard(NS, "compute", {"limits.memory": "100Gi"})  # someone else writes spec.hard
        q = await wait_quota(
            sim, lambda o: json.loads(notes(o)[BUDGET_ANNOTATION]) == {"limits.memory": "100Gi"}, "new budget"
        )
        assert hard(q) == {"limits.memory": "100Gi"}
        changed = await wait_events(sim, "BudgetChanged")
        assert changed[0]["type"] == "Warning" and "changed outside vmquota" in changed[0]["message"]
        await publish_usage(bus, 6, terms("100Gi", "116Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "116Gi"}, "hard from the new budget")

        def unlabel(obj: Obj) -> Obj:
            obj["metadata"]["labels"] = {}
            return obj

        await sim.store.mutate(sim.store.resource("resourcequotas"), NS, "compute", unlabel)
        q = await wait_quota(sim, lambda o: not any(k.startswith("vmquota.io/") for k in notes(o)), "release")
        assert hard(q) == {"limits.memory": "100Gi"}, "handed back with the budget"
        released = await wait_events(sim, "QuotaReleased")
        assert "spec.hard set back to the budget limits.memory=100Gi" in released[0]["message"]


async def test_scoped_quota_is_refused_with_an_event(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED, scopes=["NotTerminating"])
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api):
        q = await wait_quota(sim, lambda o: STATUS_ANNOTATION in notes(o), "status annotation")
        assert notes(q)[STATUS_ANNOTATION].startswith("Refused: ResourceQuota tenant-a/compute: spec.scopes")
        assert hard(q) == {"limits.memory": "64Gi"} and BUDGET_ANNOTATION not in notes(q)
        refused = await wait_events(sim, "QuotaRefused")
        assert refused[0]["type"] == "Warning" and "scoped quotas are not managed" in refused[0]["message"]


async def test_malformed_input_goes_to_the_dead_letter_subject(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await bus.publish(contract.usage_subject(CLUSTER, NS), b'{"type": "io.vmquota.usage", "not": "usage"}')
        await sim.wait_for(lambda: e.dead_letters == 1, within=20, what="the first reject")
        # The usage stream keeps one message per namespace: each is read before the next replaces it.
        await publish_usage(bus, 5, terms("64Gi", "a lot"))
        await sim.wait_for(lambda: e.dead_letters == 2, within=20, what="the second reject")
        await bus.publish(contract.event_subject(CLUSTER, "ResourceQuota", NS), b"\xff not json")
        await publish_usage(bus, 6, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the next good snapshot applies")
        msgs = await read_stream(bus, contract.DLQ_STREAM, "vmquota.dlq.enforcer.>", lambda ms: len(ms) >= 3)
        letters = [contract.decode_dead_letter(m.data) for m in msgs]
        reasons = sorted(d.reason for d in letters)
        assert len(letters) == 3 and e.dead_letters == 3
        assert any("quotas.compute.hard.limits.memory" in r for r in reasons)
        assert any("invalid usage snapshot" in r for r in reasons)
        assert any("not a JSON event" in r for r in reasons)
        assert {d.stream for d in letters} == {contract.USAGE_STREAM, contract.EVENTS_STREAM}
    # A restart reads the quota events again from the stream's first: the bad one was lettered again (dropped as a
    # repeat within the duplicate window, stored again past it) and counted again, each rollout firing the
    # dead-letter alert anew. The ledger, which reads every event, letters it; this enforcer did when it first read it.
    async with enforcer(bus, api) as (again, _):
        await sim.wait_for(lambda: again._warm, within=20, what="the restarted enforcer caught up")
        await publish_usage(bus, 7, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the restarted enforcer at work")
        counted = again.metrics.registry.get_sample_value("vmquota_dlq_total", {"service": "enforcer"})
        assert again.dead_letters == 0 and not counted, (again.dead_letters, counted)
        assert again._refused_catching_up == 1 and "not a JSON event" in again._first_refused, "said once, in a warning"


# ---- end to end: seed scenario 1 through the real watcher, ledger and enforcer -----------------------------------


async def test_seed_scenario_1_the_migration_gets_in_and_hard_comes_back() -> None:
    """Quota ``limits.memory: 64Gi``, three VMs of 16Gi guest memory with explicit 16Gi limits running; migrate
    one: the enforcer raises hard by the target pod's charge, says why on the quota and on the bus, and lowers it
    back exactly when the migration is over."""
    async with pipeline() as p:
        await full_namespace(p, NS)
        name = await p.migrate(NS, "vm1")
        await p.wait_migrated(NS, "vm1", name)
        await p.wait_hard(NS, "compute", rl({"limits.memory": "64Gi"}), "hard back to the budget")
        assert p.budget(NS, "compute") == rl({"limits.memory": "64Gi"})

        def for_the_migration() -> list[contract.Decision]:
            # (a decision may raise hard back after one that held it within what the API server charged, too)
            return [
                d
                for d in p.tap.decisions
                if d.reason.startswith("raised limits.memory by") and d.reason.endswith("for the migration of vm1")
            ]

        # (a decision reaches the bus after its write: the raise may come to the tap after hard is back)
        await p.wait(lambda: bool(for_the_migration()), "the raise on the bus")
        raised = for_the_migration()[0]
        assert not raised.dry_run
        target = rl(raised.hard_after)["limits.memory"] - rl(raised.hard_before)["limits.memory"]
        assert target > rl({"limits.memory": "16Gi"})["limits.memory"], "the target pod charges 16Gi + overhead"
        await p.wait(lambda: any(d.reason.startswith("lowered limits.memory") for d in p.tap.decisions), "the lowering")
        events = p.quota_events(NS, "compute", "QuotaAdjusted")
        assert any(e["message"].startswith(raised.reason) for e in events), "the decision is on the quota as an Event"
        assert all(e["involvedObject"]["uid"] == p.quota(NS, "compute")["metadata"]["uid"] for e in events)


async def test_a_quota_older_than_the_events_stream_is_listed_at_start(
    sim: SimCluster, bus: Bus, api: client.ApiClient
) -> None:
    """No `mirror`: the quota never reaches the events stream (as when its last change is older than the stream's
    max age). The enforcer lists managed quotas from the API at start, so it still adopts and enforces it."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api):
        q = await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption of a listed quota")
        assert json.loads(notes(q)[BUDGET_ANNOTATION]) == {"limits.memory": "64Gi"}
        await publish_usage(bus, 1, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised from the listed quota")


async def test_the_guard_lists_holders_before_a_raise_and_keeps_what_it_found_until_the_quota_drops_it(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A restarted enforcer finds a QuotaReservation an earlier one wrote: it adds to it before raising and
    removes nothing until the quota no longer carries it (status.hard synced, the ledger reserving only vm1)."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    earlier = guard.Holder("uid-vm9", "vm9", "launcher pod")
    await sim.apply(guard.reservation(NS, frozenset({earlier}), [guard.DEFAULT_CREATOR]))
    writes: list[tuple[str, set[str]]] = []
    hards: list[str] = []

    def record(type_: str, res: Any, obj: Obj) -> None:
        if res.plural == guard.PLURAL:
            writes.append(("guard", {h.name for h in guard.listed(obj)}))
        elif res.plural == "resourcequotas":
            h = str((obj["spec"].get("hard") or {}).get("limits.memory"))
            if not hards or hards[-1] != h:
                hards.append(h)
                writes.append(("hard", {h}))

    sim.store.on_change(record)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True):
        await raised_for_vm1(sim, bus, vms)
        await sim.wait_quota_synced(NS, "compute")
        await sim.wait_until(
            guard.PLURAL, NS, guard.NAME, lambda o: {h.name for h in guard.listed(o)} == {"vm1"}, what="vm9 dropped"
        )
    raised = next(i for i, w in enumerate(writes) if w == ("hard", {"80Gi"}))
    before = [w for w in writes[:raised] if w[0] == "guard"]
    assert before and before[-1][1] == {"vm1", "vm9"}, writes


async def raised_for_vm1(sim: SimCluster, bus: Bus, vms: list[contract.VmState], *, full: bool = False) -> None:
    """The enforcer adopted ``compute`` (64Gi), then raised it to 80Gi for vm1's migration (MIGRATING); ``full``:
    the tenant's pods use the budget first (4 x 16Gi), so the raise's room is the target's."""
    await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
    await sim.wait_quota_synced(NS, "compute")
    if full:
        await namespace_full(sim)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING, vms=vms)
    await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised")


def listed_names(sim: SimCluster) -> set[str]:
    return {h.name for h in guard.listed(sim.peek(guard.PLURAL, NS, guard.NAME))}


async def test_a_shrink_of_the_guard_never_removes_what_another_writer_listed(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A leader handover: while the old enforcer's shrink is due, the new one has written the QuotaReservation
    (its own holders). The shrink is conditional on the version the old one last wrote: it meets a 409 and is
    dropped, so it cannot open room the new enforcer raised."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await raised_for_vm1(sim, bus, vms)
        assert listed_names(sim) == {"vm1"}
        newer = guard.Holder("uid-vm7", "vm7", "migration m7")
        await sim.apply(guard.reservation(NS, frozenset({newer}), [guard.DEFAULT_CREATOR]))  # the new leader's
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)  # the old one's migration is over
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "hard lowered")
        await sim.wait_quota_synced(NS, "compute")
        await sim.wait_for(lambda: (NS, "compute") not in e._lagging and e.idle(), within=20, what="enforcer idle")
        assert listed_names(sim) == {"vm7"}, "the old enforcer's shrink removed what the new one listed"


async def test_a_deleted_quota_takes_its_holders_off_the_guard(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A quota that goes while it carries a raise: nothing holds room any more, so its holders must not keep the
    namespace's other pods out."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING, vms=vms)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised")
        assert listed_names(sim) == {"vm1"}
        await sim.store.delete(sim.store.resource("resourcequotas"), NS, "compute")
        await sim.wait_for(lambda: listed_names(sim) == set(), within=20, what="the holders taken off")


async def holders_taken_off(sim: SimCluster) -> None:
    await sim.wait_for(lambda: listed_names(sim) == set(), within=10, what="the holders taken off")
    assert await tenant_pod(sim, "after"), "the namespace's pods get in again"


@contextlib.asynccontextmanager
async def listed_for_vm1(
    sim: SimCluster, bus: Bus, api: client.ApiClient, *, full: bool = False
) -> AsyncIterator[list[contract.VmState]]:
    """The guard installed, ``compute`` (64Gi) managed, and an enforcer running that raised it to 80Gi for vm1's
    migration, vm1 listed (``full``: see :func:`raised_for_vm1`); yields the usage's VMs."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True):
        await raised_for_vm1(sim, bus, vms, full=full)
        await sim.wait_quota_synced(NS, "compute")
        assert listed_names(sim) == {"vm1"}
        yield vms


async def test_with_the_guard_a_holder_let_in_where_hard_held_its_room_already_is_nudged(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """vm1's target got in as vm2's migration was refused (by the guard: vm1 was listed), and the room vm1's target
    was raised for is vm2's now: ``hard`` stays, and only the QuotaReservation changes, which KubeVirt does not
    watch. vm2's retry waited for KubeVirt's backoff (812 ms in ``bench_migration_guard``, after three refused
    tries; more after more). Its VMI is touched once its holder is let in; vm1's, listed before a raise that woke
    KubeVirt, is not."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name=vm, uid=f"uid-{vm}", state="running") for vm in ("vm1", "vm2")]
    calls = NudgeRecorder(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls, reservation_guard=True) as (e, _):
        await raised_for_vm1(sim, bus, vms, full=True)
        await sim.wait_quota_synced(NS, "compute")
        assert listed_names(sim) == {"vm1"}
        turn = contract.MigrationState(name="m2", vmi="vm2", state="pending", reserved={"limits.memory": "16Gi"})
        await publish_usage(bus, 6, terms("64Gi", "80Gi"), [turn], vms=vms)
        await sim.wait_for(lambda: listed_names(sim) == {"vm2"}, within=20, what="vm2 listed in vm1's place")
        await sim.wait_for(lambda: "vm2" in calls.nudged, within=20, what="vm2's VMI nudged")
        await sim.wait_for(lambda: e.idle() and e.reporter.settled(), within=20, what="the enforcer idle")
        assert calls.nudged == ["vm2"], calls.nudged
        assert calls.nudged_at == [{"limits.memory": "80Gi"}], "nudged before quota admission had the room"
        assert hard(sim.peek("resourcequotas", NS, "compute") or {}) == {"limits.memory": "80Gi"}


async def test_with_the_guard_a_holder_unconfirmed_holds_no_other_holders_raise_back(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """vm2 takes the room vm1's target was raised for, and vm3's target needs a raise, but vm3's VMI is not the
    size it was reserved at (a hotplug the ledger has not seen; here it is not found, which reads the same). The
    raise goes out with vm3 unconfirmed (its pods stay out) and vm2 let in. It waited for the ledger, whole: a
    tenant that kept one holder unconfirmed kept every raise of the namespace back."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name=vm, uid=f"uid-{vm}", state="running") for vm in ("vm1", "vm2", "vm3")]
    async with enforcer(bus, api, reservation_guard=True):
        await raised_for_vm1(sim, bus, vms, full=True)
        await sim.wait_quota_synced(NS, "compute")
        turn = contract.MigrationState(name="m2", vmi="vm2", state="pending", reserved={"limits.memory": "16Gi"})
        third = contract.MigrationState(
            name="m3", vmi="vm3", state="pending", reserved={"limits.memory": "16Gi"}, vmi_size="a size"
        )
        await publish_usage(bus, 6, terms("64Gi", "96Gi"), [turn, third], vms=vms)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "96Gi"}, "hard raised for vm2 and vm3")
        await sim.wait_for(lambda: listed_names(sim) == {"vm2", "vm3"}, within=20, what="vm2 and vm3 listed")
        assert guard.unconfirmed(sim.peek(guard.PLURAL, NS, guard.NAME)) == {"uid-vm3"}, "vm2 let in, vm3 kept out"


async def test_with_the_guard_a_tenant_replacing_its_pending_vmi_holds_no_drain_back(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A drain migrates vm1 (its size unchanged) while the tenant's small VM waits for its launcher pod, a holder.
    Each time, the tenant deletes that VMI and makes it again, so each usage reserves a pod for a VMI the enforcer
    no longer finds (under the same name, another uid). The raise waited for those holders to be confirmed, which
    never came: the drain's target was refused for as long as the tenant went on, and every deleted VMI's uid
    stayed listed. Now the raise goes out, and what no usage reserves any more comes off the list."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", guest="2Gi", namespace=NS))  # the drained VM, running
        await sim.create(created_vmi("s", phase="Pending", node="", namespace=NS))  # the tenant's VMI, made again
    vm1 = normalize(await sim.get("virtualmachineinstances", NS, "vm1"))
    small = normalize(await sim.get("virtualmachineinstances", NS, "s"))
    assert isinstance(vm1, VmiSnapshot) and isinstance(small, VmiSnapshot)
    drain = [
        msgspec.structs.replace(m, vmi_size=size_digest(vm1.spec, vm1.annotations), vmi_uid=vm1.uid) for m in MIGRATING
    ]

    def replaced(i: int) -> list[contract.VmState]:  # (what the ledger saw: the uid of a VMI the tenant deleted)
        deleted = contract.VmState(
            name="s",
            uid=f"uid-of-deleted-s-{i}",
            state="admitted",
            vmi_size=size_digest(small.spec, small.annotations),
            pod_refused=True,
        )
        return [contract.VmState(name="vm1", uid=vm1.uid, state="running"), deleted]

    async def raised_and_listed(i: int) -> None:
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": f"{80 + i}Gi"}, f"raise {i}")
        await sim.wait_for(
            lambda: (
                {h.uid for h in guard.listed(sim.peek(guard.PLURAL, NS, guard.NAME))}
                == {vm1.uid, f"uid-of-deleted-s-{i}"}
            ),
            within=20,
            what=f"only vm1 and the latest replaced VMI listed ({i})",
        )

    async with enforcer(bus, api, reservation_guard=True):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        for i in range(4):
            await publish_usage(bus, 5 + i, terms("64Gi", f"{80 + i}Gi"), drain, vms=replaced(i))
            await raised_and_listed(i)
        assert guard.unconfirmed(sim.peek(guard.PLURAL, NS, guard.NAME)) == {"uid-of-deleted-s-3"}


async def test_a_guard_write_whose_answer_was_lost_is_read_again_before_the_next(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The listing of a holder lands and its answer is lost; the tenant deletes its migration before the retry, so
    nothing is reserved any more. The retry's shrink planned from what the enforcer held listed (nothing) and wrote
    nothing: the holder stayed, and every new pod of the namespace was refused, until another reservation there
    or a restart (75 of 75 tries over 75 s)."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    calls = ReservationAnswersLost(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls, reservation_guard=True):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        calls.lose = 1
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING, vms=vms)
        await sim.wait_for(lambda: calls.lose == 0 and listed_names(sim) == {"vm1"}, within=20, what="a lost answer")
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)  # (the migration deleted)
        await holders_taken_off(sim)


async def test_a_guard_shrink_that_meets_another_version_is_planned_again_not_dropped(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A shrink whose write meets a conflict (here injected; this enforcer's own earlier write whose answer was lost
    makes one) reads the QuotaReservation again and shrinks from it. It was dropped, and the holder kept the
    namespace's pods out until the namespace's next change (none in a quiet one)."""
    async with listed_for_vm1(sim, bus, api) as vms:
        conflict = sim.faults.fail(409, verbs=["patch"], resources=[guard.PLURAL], count=1)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)  # (the target got in: the raise ends)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "hard lowered")
        await sim.wait_quota_synced(NS, "compute")
        await holders_taken_off(sim)
        assert conflict.injected == 1


@pytest.mark.parametrize("restarted", [False, True], ids=["retried", "after_a_restart"])
async def test_a_deleted_quotas_holders_are_taken_off_though_the_first_tries_fail(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None, restarted: bool
) -> None:
    """The quota that carried a raise is deleted, and the shrink of the QuotaReservation fails: once, or for as long
    as this enforcer runs. No later write of the namespace comes (it has no managed quota left), and a shrink was
    tried once: the holder stayed, the namespace's pods kept out for good, across restarts. Now the shrink is
    retried after the work queue's backoff, and an enforcer lists the QuotaReservations at its start."""
    async with listed_for_vm1(sim, bus, api):
        failing = sim.faults.fail(500, verbs=["patch"], resources=[guard.PLURAL], count=None if restarted else 1)
        await sim.store.delete(sim.store.resource("resourcequotas"), NS, "compute")
        await sim.wait_for(lambda: failing.injected >= 1, within=20, what="a failed shrink")
        if not restarted:
            await holders_taken_off(sim)
            return
    sim.faults.clear()
    assert listed_names(sim) == {"vm1"}
    async with enforcer(bus, api, reservation_guard=True):
        await holders_taken_off(sim)


async def test_an_odd_listing_of_the_reservations_stops_nothing(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A QuotaReservation item whose metadata is not an object in the API server's answer: the enforcer raised
    AttributeError at its start (and would have at a resync, ending it). It is skipped."""

    class OddReservations(NudgeRecorder):
        async def list_reservations(self) -> list[Obj]:
            return [{"metadata": "x"}, {"metadata": {"namespace": 5}}]

    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api, calls=OddReservations(KubeQuotas(api), sim), reservation_guard=True) as (_, task):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        assert not task.done()


@pytest.mark.parametrize("end", ["migration_over", "managed_quota_deleted", "label_taken_off"])
async def test_a_quota_vmquota_does_not_manage_keeps_no_holder_listed(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None, end: str
) -> None:
    """A namespace with a quota of object counts beside the managed one (or the managed one's label taken off, so
    that it is handed back): the quota vmquota does not manage has no terms in a usage, and kept every holder it
    had seen carried for good. After vm1's raise the holder stayed listed, and every other new pod of the
    namespace was refused, whether the migration ended, the managed quota was deleted, or it was handed back,
    across restarts too."""
    if end != "label_taken_off":
        await sim.create_quota(NS, "objects", {"count/configmaps": "100"})
    async with listed_for_vm1(sim, bus, api) as vms:
        if end == "migration_over":
            await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)
        elif end == "managed_quota_deleted":
            await sim.store.delete(sim.store.resource("resourcequotas"), NS, "compute")
        else:

            def unlabel(obj: Obj) -> Obj:
                obj["metadata"]["labels"].pop(MANAGED_LABEL, None)
                return obj

            await sim.store.mutate(sim.store.resource("resourcequotas"), NS, "compute", unlabel)
            await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the quota handed back")
            await sim.wait_quota_synced(NS, "compute")
            await publish_usage(bus, 6, {}, vms=vms)  # (the ledger: no managed quota, no migration)
        await holders_taken_off(sim)


async def test_a_holder_is_kept_while_a_quota_handed_back_still_holds_its_raise(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The managed quota's label is taken off while no enforcer runs, `hard` raised for vm1's target, vm1 listed,
    and the ledger reserves nothing any more; the enforcer that starts cannot write the release yet. The namespace
    has no managed quota, and its holders were taken off at once, the raise still in `spec.hard` and
    `status.hard`: a tenant's 16Gi pod took the room. They come off once the release is written and copied."""
    async with listed_for_vm1(sim, bus, api, full=True) as vms:
        pass

    def unlabel(obj: Obj) -> Obj:
        obj["metadata"]["labels"].pop(MANAGED_LABEL, None)
        return obj

    await sim.store.mutate(sim.store.resource("resourcequotas"), NS, "compute", unlabel)
    await publish_usage(bus, 6, {}, vms=vms)  # (the ledger: no managed quota, no migration; the raise is stale)
    failing = sim.faults.fail(500, verbs=["patch"], resources=["resourcequotas"])
    async with enforcer(bus, api, reservation_guard=True):
        await sim.wait_for(lambda: failing.injected >= 2, within=10, what="the release failing")
        assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "80Gi"}
        assert listed_names(sim) == {"vm1"}, "the holder of the raise the handed-back quota holds was taken off"
        assert not await tenant_pod(sim, "grab"), "a tenant's pod took the room of vm1's target"
        sim.faults.clear()
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the release written")
        await sim.wait_for(lambda: listed_names(sim) == set(), within=10, what="the holders taken off")


async def test_a_holder_is_kept_while_the_api_server_shows_a_managed_quota_the_enforcer_does_not_know(
    sim: SimCluster, bus: Bus, api: client.ApiClient
) -> None:
    """The quota is not in the events stream (its last change older than the stream's max age: no mirror here) and
    carries vm1's raise, vm1 listed. A restarted enforcer's listing of the managed quotas fails once: it knows no
    quota in the namespace, and lists its QuotaReservation with a holder. It took the holder off, `hard` still
    80Gi for vm1's target, and a tenant's 16Gi pod got in (80Gi used on a 64Gi budget). The holders of a namespace
    the enforcer knows no managed quota of are taken off only once the API server shows none there."""
    async with listed_for_vm1(sim, bus, api, full=True):
        pass
    failing = sim.faults.fail(503, verbs=["list"], resources=["resourcequotas"], count=1)
    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await sim.wait_for(lambda: failing.injected == 1 and e.idle(), within=10, what="the enforcer idle")
        assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "80Gi"}
        assert listed_names(sim) == {"vm1"}, "the holder of a raise the quota carries was taken off"
        assert not await tenant_pod(sim, "grab"), "a tenant's pod took the room of vm1's target"


async def test_a_quota_vmquota_does_not_manage_takes_off_no_holder_of_a_managed_quota_not_known_yet(
    sim: SimCluster, bus: Bus, api: client.ApiClient
) -> None:
    """As ``-k does_not_know``, with a quota of object counts beside ``compute``: the restarted enforcer's listings
    of the quotas fail a few times, and the other quota's event comes meanwhile. Its reconciliation, carrying no
    holder, shrank the QuotaReservation to nothing, the enforcer knowing no managed quota in the namespace: vm1 was
    off, ``compute`` still 80Gi, until the namespace-only key's listing found ``compute``, and a tenant's 16Gi pod
    got in meanwhile. A shrink in a namespace the enforcer knows no managed quota of keeps what is listed, unless
    the API server showed none there."""
    emptied: list[Obj] = []

    def watch(type_: str, res: Any, obj: Obj) -> None:
        if res.plural == guard.PLURAL and not guard.listed(obj):
            emptied.append(obj)

    await sim.create_quota(NS, "objects", {"count/configmaps": "100"})
    async with listed_for_vm1(sim, bus, api, full=True):
        pass
    sim.store.on_change(watch)
    failing = sim.faults.fail(503, verbs=["list"], resources=["resourcequotas"], count=4)
    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await sim.wait_for(lambda: failing.injected >= 2, within=10, what="listings failing")
        await publish_quota(bus, await sim.get("resourcequotas", NS, "objects"))
        await sim.wait_for(lambda: failing.injected == 4 and e.idle(), within=15, what="the enforcer idle")
        assert not emptied, "the holder of the raise compute carries was taken off"
        assert listed_names(sim) == {"vm1"}
        assert not await tenant_pod(sim, "grab")


def emptied_while_raised(sim: SimCluster) -> list[dict[str, str]]:
    """The ``status.hard`` of ``compute`` at each write of the QuotaReservation that lists nobody, from now on."""
    found: list[dict[str, str]] = []

    def watch(type_: str, res: Any, obj: Obj) -> None:
        if res.plural == guard.PLURAL and not guard.listed(obj):
            q = sim.peek("resourcequotas", NS, "compute") or {}
            found.append(dict((q.get("status") or {}).get("hard") or {}))

    sim.store.on_change(watch)
    return found


OTHER_TERMS: Final = {
    "other": contract.QuotaTerms(
        mode="VmiPodUsage", budget={"limits.memory": "1000Gi"}, reserved={}, hard={"limits.memory": "1000Gi"}
    )
}


@pytest.mark.parametrize("compute", ["handed_back", "not_known"])
async def test_a_shrink_after_a_restart_waits_for_every_quota_that_may_carry_a_raise(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None, compute: str
) -> None:
    """``compute`` carries vm1's raise (80Gi), vm1 listed, and a second managed quota ``other`` is beside it; the
    enforcer restarts and the ledger reserves nothing any more. ``handed_back``: compute's label was taken off
    while no enforcer ran, and its release cannot be written yet; ``not_known``: the restarted enforcer's listings
    of the quotas fail a few times, and compute's last change is not in the events stream. ``other``'s
    reconciliation shrank the QuotaReservation to nothing, compute still 80Gi, and a tenant's 16Gi pod got in. A
    shrink keeps what is listed until every quota the API server shows that may carry a raise is reconciled."""
    async with listed_for_vm1(sim, bus, api, full=True) as vms:
        pass
    if compute == "handed_back":

        def unlabel(obj: Obj) -> Obj:
            obj["metadata"]["labels"].pop(MANAGED_LABEL, None)
            return obj

        await sim.store.mutate(sim.store.resource("resourcequotas"), NS, "compute", unlabel)
    await sim.create_quota(NS, "other", {"limits.memory": "1000Gi"}, labels=MANAGED)
    usage = OTHER_TERMS if compute == "handed_back" else {**terms("64Gi", "64Gi"), **OTHER_TERMS}
    await publish_usage(bus, 6, usage, vms=vms)  # (vm1's migration over: no reservation)
    emptied = emptied_while_raised(sim)
    if compute == "handed_back":
        calls = ComputeWritesFail(KubeQuotas(api), sim)
        async with enforcer(bus, api, calls=calls, reservation_guard=True):
            await sim.wait_until("resourcequotas", NS, "other", lambda o: BUDGET_ANNOTATION in notes(o), within=15)
            await sim.wait_for(lambda: calls.failed >= 2, within=10, what="compute's release failing")
            assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "80Gi"}
            assert listed_names(sim) == {"vm1"} and not emptied, "the holder of compute's raise came off"
            assert not await tenant_pod(sim, "grab"), "a tenant's pod took the room of vm1's target"
        return
    failing = sim.faults.fail(503, verbs=["list"], resources=["resourcequotas"], count=4)
    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await sim.wait_for(lambda: failing.injected >= 1, within=10, what="the listings failing")
        await publish_quota(bus, await sim.get("resourcequotas", NS, "other"))
        await sim.wait_for(lambda: failing.injected == 4 and e.idle(), within=15, what="the enforcer idle")
        assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "64Gi"}, "lowered once known"
        assert emptied and all(h == {"limits.memory": "64Gi"} for h in emptied), f"emptied at {emptied}"


async def raised_for_vm1_answer_lost(
    sim: SimCluster, bus: Bus, calls: RaiseAnswerLostThenReadsFail, vms: list[contract.VmState]
) -> None:
    """The raise to 80Gi for vm1's migration (MIGRATING) lands with its answer lost, vm1 listed, and the quota
    controller has copied it."""
    calls.lose = 1
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING, vms=vms)
    await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised (its answer lost)")
    await sim.wait_quota_synced(NS, "compute")
    assert listed_names(sim) == {"vm1"}


async def test_a_holder_of_a_raise_whose_answer_was_lost_is_kept_until_admission_checks_the_lowering(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Without ``status.hard`` writes (no RBAC on ``resourcequotas/status``): the raise for vm1 lands with its
    answer lost, the quota's reads fail for a while, the quota controller copies the raise, and the migration is
    deleted. The lowering then planned holders from the new usage alone (none), the landed raise's forgotten: the
    holder came off while ``status.hard`` still held the raise (the controller slow to copy the lowering), and a
    tenant's 16Gi pod got in (80Gi used on 64Gi). The holders of a write that failed count until one lands."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    calls = RaiseAnswerLostThenReadsFail(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls, reservation_guard=True) as (e, _):
        e.status_writes = False
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        await namespace_full(sim)
        await raised_for_vm1_answer_lost(sim, bus, calls, vms)
        emptied = emptied_while_raised(sim)
        sim.quota.timing = QuotaTiming(sync_delay=3600.0)  # (the quota controller slow to copy the lowering)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)  # (the migration deleted)
        await sim.wait_for(lambda: e.usage.get(NS) is not None and e.usage[NS].seq == 6, within=20, what="usage 6")
        calls.block = False
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "hard lowered")
        await sim.wait_for(lambda: e.idle(), within=10, what="the enforcer idle")
        assert not emptied, f"the holder came off while status.hard was {emptied}"
        assert listed_names(sim) == {"vm1"}
        assert not await tenant_pod(sim, "grab"), "a tenant's pod took the room status.hard still held"


async def test_a_quota_reservation_deleted_by_hand_while_it_guards_a_raise_is_written_again(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """An administrator (or a tool pruning what it did not create) deletes the namespace's QuotaReservation while it
    lists vm1 for the raise ``hard`` carries. The enforcer took vm1 for listed and wrote nothing for it again: the
    room stayed open to every pod for as long as the reservation lasted. Its next listing of the QuotaReservations
    finds the one it held gone, and it is written again."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True, resync_interval=0.2):
        await raised_for_vm1(sim, bus, vms, full=True)
        await sim.wait_quota_synced(NS, "compute")
        assert listed_names(sim) == {"vm1"}
        await sim.store.delete(sim.store.resource(guard.PLURAL), NS, guard.NAME)
        assert not listed_names(sim)
        await sim.wait_for(lambda: listed_names(sim) == {"vm1"}, within=20, what="the QuotaReservation written again")
        assert not await tenant_pod(sim, "grab"), "a tenant's pod took the room the QuotaReservation guards"


async def test_a_holder_of_a_raise_whose_answer_was_lost_is_kept_while_the_quota_events_lag(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """With ``status.hard`` writes: the raise for vm1 lands with its answer lost, the quota's events lag (the watcher
    or the bus behind, or the enforcer's consumer busy with quota admission's writes, which a tenant's pods make),
    and the migration is deleted. The retry planned from the copy of the quota it had, from before the raise: it
    asked for what the new usage asks, nothing to write, and nothing to read first, for the shrink was judged
    without the holders of the failed write; then the shrink counted them against that copy and took vm1 off while
    ``status.hard`` held its raise (3 of 3 runs; a tenant's 16Gi pod got in, 80Gi used on 64Gi)."""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    calls = RaiseAnswerLostThenReadsFail(KubeQuotas(api), sim)
    quotas_in, usage_in = asyncio.Event(), asyncio.Event()
    quotas_in.set()
    usage_in.set()
    async with enforcer(bus, api, calls=calls, reservation_guard=True) as (e, _):
        gate_inputs(e, quotas_in, usage_in)
        await publish_usage(bus, 4, terms("64Gi", "64Gi"), vms=vms)
        await wait_quota(sim, lambda o: notes(o).get(USAGE_FROM_ANNOTATION, "").startswith("4 "), "enforcing")
        await sim.wait_quota_synced(NS, "compute")
        await namespace_full(sim)
        await sim.wait_for(
            lambda: e.quotas.get((NS, "compute")) == e.quotas.from_api(sim.peek("resourcequotas", NS, "compute") or {}),
            within=20,
            what="the enforcer's copy of the full quota",
        )
        quotas_in.clear()  # (the quota events lag from here on)
        await raised_for_vm1_answer_lost(sim, bus, calls, vms)
        emptied = emptied_while_raised(sim)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)  # (the migration deleted)
        await sim.wait_for(lambda: e.usage.get(NS) is not None and e.usage[NS].seq == 6, within=20, what="usage 6")
        calls.block = False
        await sim.wait_for(lambda: not listed_names(sim), within=10, what="vm1 off the list")
        assert emptied == [{"limits.memory": "64Gi"}], f"vm1 off while status.hard was {emptied}"
        quotas_in.set()
        assert status_hard(sim.peek("resourcequotas", NS, "compute") or {}) == {"limits.memory": "64Gi"}


async def test_with_the_guard_room_for_a_target_opens_only_while_its_vmi_has_the_size_it_was_reserved_at(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The policy keeps a holder VMI's size only once it is listed; a hotplug just before that, which the ledger
    has not seen, would make KubeVirt's next try of the target larger than its room. After listing the holder the
    enforcer reads the VMI: a usage that reserved the target at another size is raised for, but its holder stays
    unconfirmed and KubeVirt's pod for it stays out; the ledger's next usage, at the VMI's size, confirms it. Fails
    when the enforcer confirms without the read. (One patch a second per quota: the raise waits for its turn after
    the adoption, and is counted ``resized`` once, when written, not at each pass.)"""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", guest="2Gi", namespace=NS))
    vmi = await sim.get("virtualmachineinstances", NS, "vm1")
    uid = str(vmi["metadata"]["uid"])
    vms = [contract.VmState(name="vm1", uid=uid, state="running")]
    snap = normalize(vmi)
    assert isinstance(snap, VmiSnapshot)
    before = size_digest(vmi_obj("vm1", guest="1Gi")["spec"], {})  # (what the ledger saw before a hotplug)
    now = size_digest(snap.spec, snap.annotations)
    assert before != now

    def migrating(size: str) -> list[contract.MigrationState]:
        return [msgspec.structs.replace(m, vmi_size=size) for m in MIGRATING]

    async with enforcer(bus, api, reservation_guard=True, quota_patch_rate=1.0) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), migrating(before), vms=vms)
        await kept_out_until_confirmed(
            sim, e, holder_pod("virt-launcher-vm1-target", "vm1", uid, "3Gi"), "reserved for vm1 (migration m1)"
        )
        await publish_usage(bus, 6, terms("64Gi", "80Gi"), migrating(now), vms=vms)
        await admitted_once_confirmed(sim, holder_pod("virt-launcher-vm1-target", "vm1", uid, "3Gi"))


async def kept_out_until_confirmed(sim: SimCluster, e: Enforcer, pod: Obj, reserved_for: str) -> None:
    """``compute`` is raised to 80Gi, with vm1 its holder listed unconfirmed (its VMI read at another size than the
    usage reserved it at), and in effect: KubeVirt's ``pod`` for vm1 is refused all the same, saying
    ``reserved_for``."""
    await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised")
    await sim.wait_quota_synced(NS, "compute")
    labels = {"service": "enforcer", "outcome": "resized"}
    assert e.metrics.registry.get_sample_value("vmquota_enforcer_patches_total", labels) == 1.0
    assert guard.unconfirmed(sim.peek(guard.PLURAL, NS, guard.NAME)) == {pod["metadata"]["ownerReferences"][0]["uid"]}
    with acting_as(KUBEVIRT_CONTROLLER), pytest.raises(ApiError) as refused:
        await sim.create(pod)
    assert reserved_for in str(refused.value)


async def admitted_once_confirmed(sim: SimCluster, pod: Obj) -> None:
    """The ledger's next usage reserves the holder at its VMI's size: it is confirmed, and KubeVirt's ``pod`` gets
    in."""
    await sim.wait_for(
        lambda: not guard.unconfirmed(sim.peek(guard.PLURAL, NS, guard.NAME)), within=20, what="the holder confirmed"
    )
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(pod)


def holder_pod(name: str, vmi: str, uid: str, memory: str) -> Obj:
    """A pod KubeVirt makes for the VMI ``vmi`` (its controller owner reference), of ``memory``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "ownerReferences": [
                {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": vmi}
                | {"uid": uid, "controller": True}
            ],
        },
        "spec": {
            "containers": [{"name": "compute", "image": "virt-launcher", "resources": {"limits": {"memory": memory}}}]
        },
    }


async def test_with_the_guard_a_holder_whose_room_hard_holds_already_waits_for_the_read_of_its_vmi(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A usage can reserve a migration target without a raise: its room is in ``hard`` already (another
    reservation ended in the same snapshot). The holder is listed unconfirmed — its size kept, its pods out — and
    confirmed only once the enforcer has read its VMI at the size the target was reserved at: read larger (a hotplug
    before the listing), KubeVirt's pod for it stays out; the ledger's next usage, at the VMI's size, confirms it.
    (Without the read, the holder was listed and its larger target admitted into the room.)"""
    await install_guard(sim)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", guest="2Gi", namespace=NS))
    snap = normalize(await sim.get("virtualmachineinstances", NS, "vm1"))
    assert isinstance(snap, VmiSnapshot)
    vms = [contract.VmState(name="vm1", uid=snap.uid, state="running")]
    before = size_digest(vmi_obj("vm1", guest="1Gi")["spec"], {})  # (what the ledger saw before a hotplug)
    now = size_digest(snap.spec, snap.annotations)

    def migrating(size: str) -> list[contract.MigrationState]:
        return [msgspec.structs.replace(m, vmi_size=size, vmi_uid=snap.uid) for m in MIGRATING]

    target = holder_pod("virt-launcher-vm1-target", "vm1", snap.uid, "3Gi")
    async with enforcer(bus, api, reservation_guard=True):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        await publish_usage(bus, 5, terms("64Gi", "64Gi"), migrating(before), vms=vms)  # (no raise)
        await sim.wait_for(lambda: listed_names(sim) == {"vm1"}, within=20, what="vm1 listed")
        reservation = sim.peek(guard.PLURAL, NS, guard.NAME)
        assert guard.unconfirmed(reservation) == {snap.uid}, "listed unconfirmed: read larger than reserved"
        with acting_as(KUBEVIRT_CONTROLLER), pytest.raises(ApiError) as refused:
            await sim.create(target)
        assert "reserved for vm1 (migration m1)" in str(refused.value)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), migrating(now), vms=vms)
        await sim.wait_for(
            lambda: not guard.unconfirmed(sim.peek(guard.PLURAL, NS, guard.NAME)), within=20, what="vm1 confirmed"
        )
        with acting_as(KUBEVIRT_CONTROLLER):
            await sim.create(target)


async def test_with_the_guard_room_for_an_admitted_vm_opens_only_while_its_vmi_is_as_it_was_admitted(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """KubeVirt keeps a pending VMI's spec, not its metadata: a tenant can add a rendering annotation (hook
    sidecars) between the ledger's read and the holder's listing. The enforcer reads an admitted VM's VMI too: a
    usage that admitted it as it was leaves its holder unconfirmed, KubeVirt's pod for it out; one from the VMI as
    it is confirms it. Fails when the enforcer confirms without the read. (The guard's policies are installed
    after the annotation: ``vmquota-vmi-render-annotations`` refuses it, another layer of the same defence.)"""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.create(created_vmi("vm1", phase="Pending", node="", namespace=NS))
    vmi = await sim.get("virtualmachineinstances", NS, "vm1")
    snap = normalize(vmi)
    assert isinstance(snap, VmiSnapshot)
    sidecars = {"hooks.kubevirt.io/hookSidecars": '[{"image": "sidecar"}]'}
    before = size_digest(snap.spec, {})  # (what the ledger read before the tenant's annotation)
    now = size_digest(snap.spec, sidecars)
    with acting_as(KUBEVIRT_CONTROLLER):
        await sim.store.mutate(
            sim.store.resource("virtualmachineinstances"),
            NS,
            "vm1",
            lambda o: {**o, "metadata": {**o["metadata"], "annotations": sidecars}},
        )
    await install_guard(sim)

    def admitted(size: str) -> list[contract.VmState]:  # (KubeVirt was refused its pod: it is a holder)
        return [contract.VmState(name="vm1", uid=snap.uid, state="admitted", vmi_size=size, pod_refused=True)]

    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), vms=admitted(before))
        launcher = holder_pod("virt-launcher-vm1-abcde", "vm1", snap.uid, "3Gi")
        await kept_out_until_confirmed(sim, e, launcher, "reserved for vm1")
        await publish_usage(bus, 6, terms("64Gi", "80Gi"), vms=admitted(now))
        await admitted_once_confirmed(sim, launcher)


# ---- hostile input on the bus ------------------------------------------------------------------------------------


async def test_a_forged_usage_snapshot_neither_opens_room_nor_shadows_the_real_ones(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Usage is ordered by the stream sequence the server assigns, not by the ``seq`` a snapshot claims, and a
    snapshot asking for more than ``B + P + S`` is refused: a forged ``seq=10^15`` asking for 1Ti writes nothing,
    and one within the bound is replaced by the next real snapshot."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        forged = {
            "compute": contract.QuotaTerms(
                mode="VmiPodUsage", budget={"limits.memory": "64Gi"}, hard={"limits.memory": "1Ti"}
            )
        }
        await publish_usage(bus, 10**15, forged)
        await sim.wait_for(lambda: e.dead_letters == 1, within=20, what="the forged snapshot refused")
        await publish_usage(bus, 10**15 + 1, terms("64Gi", "80Gi"), MIGRATING)  # within the bound, huge seq
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the bounded forgery applies")
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))  # the real ledger's next snapshot
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the real snapshot wins")
        assert hard(q) == {"limits.memory": "64Gi"} and e.dead_letters == 1
        msgs = await read_stream(bus, contract.DLQ_STREAM, "vmquota.dlq.enforcer.>", lambda ms: len(ms) >= 1)
        reason = contract.decode_dead_letter(msgs[0].data).reason
        assert "exceeds budget + pods + reserved = 64Gi" in reason, reason


async def test_a_copy_of_an_older_usage_snapshot_stored_after_the_newer_one_is_ignored(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A reader of the bus can have JetStream store a copy of any stored message after the newer ones
    (tests/integration/test_nats_permissions.py -k copies_and_empty): a copy of the snapshot that raised `hard` for
    a migration, stored after the one that lowered it again, raised it again (80Gi on a 64Gi budget) until the
    namespace's next change. A snapshot folded no further and published before the one held is ignored, and before
    one is held (an enforcer that has just started), before the one a quota was last written from
    (``vmquota.io/usage-from``, which tenants cannot write); the ledger's next one, folded further, applies."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised for the migration")
        raised = (await read_stream(bus, contract.USAGE_STREAM, contract.usage_subject(CLUSTER, NS), bool))[-1]
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "lowered after it")
        await bus.publish(contract.usage_subject(CLUSTER, NS), raised.data)  # (the copy: the same bytes, later)
        await sim.wait_for(lambda: e.older_usage == 1, within=20, what="the copy ignored")
        assert e.usage[NS].seq == 6
        await publish_usage(bus, 7, terms("64Gi", "64Gi"))
        await sim.wait_for(lambda: e.usage[NS].seq == 7, within=20, what="the next snapshot applied")
        assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "64Gi"}
    # (an enforcer that starts after a copy was stored holds no snapshot yet: the quota says what it was written from)
    await bus.publish(contract.usage_subject(CLUSTER, NS), raised.data)
    assert notes(await sim.get("resourcequotas", NS, "compute"))[USAGE_FROM_ANNOTATION].startswith("6 ")
    async with enforcer(bus, api) as (e, _):
        await sim.wait_for(lambda: e.older_usage == 1, within=20, what="the copy ignored at start")
        assert NS not in e.usage
        assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "64Gi"}


async def test_a_phantom_pod_on_the_bus_opens_no_room(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A usage snapshot that counts a 100Gi pod the cluster never admitted (a forged pod event folded by the
    ledger): ``P`` says 100Gi is charged, the API server's ``status.used`` says 0. Before a write that raises
    ``hard`` the enforcer reads the quota and holds no room for what ``P`` exceeds ``status.used`` by, so the room
    (``hard - status.used``) stays what the budget leaves."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        phantom = {
            "compute": contract.QuotaTerms(
                mode="VmiPodUsage",
                budget={"limits.memory": "64Gi"},
                used={"limits.memory": "40Gi"},
                pods={"limits.memory": "100Gi"},  # a 100Gi pod (and what really runs: nothing)
                hard={"limits.memory": "124Gi"},  # (64Gi - 40Gi) + 100Gi, as the ledger computes it
            )
        }
        patched = e.patched
        await publish_usage(bus, 7, phantom)
        q = await wait_quota(sim, lambda o: e.patched > patched, "the enforcer's write")
        used = Quantity.parse(q["status"]["used"]["limits.memory"])
        room = Quantity.parse(hard(q)["limits.memory"]) - used
        assert room <= Quantity.parse("24Gi"), f"room {room.canonical()} opened for a pod the cluster never charged"
        assert hard(q) == {"limits.memory": "24Gi"}, hard(q)


@pytest.mark.parametrize("forged", ["hard", "used", "above"])
async def test_a_phantom_pod_and_a_quota_copy_forged_at_the_real_version_open_no_room(
    sim: SimCluster, bus: Bus, api: client.ApiClient, forged: str
) -> None:
    """The phantom pod of the test above, with a quota copy forged at the quota's real resourceVersion (the watcher's
    credentials, published before the watcher's own event), which the patch's precondition takes:
    - ``hard``: its ``spec.hard`` and ``last-hard`` already say what the phantom asks, so only ``status.hard``
      differed and the enforcer wrote 124Gi into it on the copy's word (a write of ``status.hard`` alone);
    - ``used``: its ``status.used`` is as large as the phantom, so the usage counted no pod beyond what the copy
      said the API server charges, and the enforcer raised ``hard`` to 124Gi with no read;
    - ``above``: its ``spec.hard`` and ``status.hard`` above what the phantom asks, so the raise to 124Gi looked
      like a lowering, which went without a read.
    Each way quota admission had 123Gi of room on a 64Gi budget. Every write that moves ``hard`` is planned from
    the API server's copy."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        small = {"name": "c", "image": "x", "resources": {"limits": {"memory": "1Gi"}}}
        await sim.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "small", "namespace": NS},
                          "spec": {"containers": [small]}})  # fmt: skip
        # (quota admission's write of status.used: a version the enforcer has not heard of, forged first)
        await wait_quota(sim, lambda o: o["status"]["used"].get("limits.memory") == "1Gi", "charged")
        await sim.wait_quiet()  # (the quota controller's sync after it too: the version the writes will meet)
        lie = json.loads(json.dumps(await sim.get("resourcequotas", NS, "compute")))
        if forged == "hard":
            lie["spec"]["hard"] = {"limits.memory": "124Gi"}
            lie["metadata"]["annotations"][LAST_HARD_ANNOTATION] = '{"limits.memory":"124Gi"}'
        elif forged == "used":
            lie["status"]["used"] = {"limits.memory": "100Gi"}
        else:
            lie["spec"]["hard"] = lie["status"]["hard"] = {"limits.memory": "200Gi"}
            lie["metadata"]["annotations"][LAST_HARD_ANNOTATION] = '{"limits.memory":"200Gi"}'
        await publish_quota(bus, lie)
        phantom = {
            "compute": contract.QuotaTerms(
                mode="VmiPodUsage",
                budget={"limits.memory": "64Gi"},
                used={"limits.memory": "40Gi"},
                pods={"limits.memory": "100Gi"},
                hard={"limits.memory": "124Gi"},
            )
        }
        patched = e.patched
        seen: list[str] = []  # every status.hard quota admission checked meanwhile

        def settled() -> bool:
            q = sim.peek("resourcequotas", NS, "compute") or {}
            seen.append(((q.get("status") or {}).get("hard") or {}).get("limits.memory", ""))
            return e.patched > patched and e.idle()

        await publish_usage(bus, 7, phantom)
        await sim.wait_for(settled, within=10, what="the enforcer's writes")
        assert all(Quantity.parse(h) <= Quantity.parse("64Gi") for h in seen if h), seen


FORGED_RV = "9999999999999999999"


def forged(obj: Obj, **spec_hard: str) -> Obj:
    """A copy of a quota as a forged quota event would carry it: a huge resourceVersion, optionally another
    ``spec.hard`` (with matching annotations, so that it looks enforced already)."""
    out: Obj = json.loads(json.dumps(obj))
    out["metadata"]["resourceVersion"] = FORGED_RV
    if spec_hard:
        out["spec"]["hard"] = dict(spec_hard)
        out["metadata"]["annotations"][LAST_HARD_ANNOTATION] = json.dumps(spec_hard, separators=(",", ":"))
    return out


async def test_the_api_server_wins_over_a_forged_quota_event(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A quota event claiming resourceVersion 9999999999999999999 does not outrank the API server: after the 409
    its stale precondition brings, the version read is kept; and a restart that replays the forged event
    converges the same way."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api):
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised")
        await publish_quota(bus, forged(q))
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "lowered through the forgery", 5)
    await publish_usage(bus, 7, terms("64Gi", "72Gi"), MIGRATING)
    async with enforcer(bus, api):  # (the forged event is replayed from the stream)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "72Gi"}, "a restart converges too", 5)


async def test_with_the_guard_a_forged_quota_event_takes_no_holder_off_the_list(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The enforcer lowered ``spec.hard`` once vm1's migration no longer needed its room, but the quota controller
    has not copied it: ``status.hard`` still holds that room, so vm1 stays listed. A forged quota event (the
    watcher's credentials) claims ``status.hard`` has caught up: taking vm1 off the list on its word would open
    the room to every pod. Holders go only on what the API server returns."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    vms = [contract.VmState(name="vm1", uid="uid-vm1", state="running")]
    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        e.status_writes = False  # (the enforcer writes status.hard itself: as one whose ClusterRole does not let it)
        await raised_for_vm1(sim, bus, vms)
        await sim.wait_quota_synced(NS, "compute")
        assert listed_names(sim) == {"vm1"}
        sim.quota.timing = QuotaTiming(sync_delay=3600.0)  # (the quota controller does not copy the lowering)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=vms)
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "hard lowered")
        assert q["status"]["hard"] == {"limits.memory": "80Gi"}
        lie = forged(q)
        lie["status"]["hard"] = dict(q["spec"]["hard"])
        await sim.wait_for(lambda: e.idle(), within=20, what="enforcer idle")
        before = e.quotas.get((NS, "compute"))
        await publish_quota(bus, lie)

        def heard() -> bool:  # (the forged version kept, or the API server's read since: another snapshot)
            return e.quotas.get((NS, "compute")) is not before and e.idle()

        await sim.wait_for(heard, within=20, what="the forged event heard and acted on")
        assert listed_names(sim) == {"vm1"}, "a holder went on a quota event's word"


async def test_a_forged_deletion_does_not_make_the_enforcer_forget_a_quota(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    q = await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api) as (e, _):
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised")
        await publish_quota(bus, forged(q), deleted=True)
        await sim.wait_for(lambda: e.idle() and not e._verify, within=20, what="the deletion checked")
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "still enforced", 5)


async def test_a_forged_quota_copy_that_plans_nothing_is_undone_by_the_resync(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A forged copy that looks enforced already (its ``spec.hard`` what the usage asks for) makes no plan write,
    so no 409 exposes it: the periodic read of the managed quotas from the API server does."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    async with enforcer(bus, api, resync_interval=0.5):
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised")
        await publish_quota(bus, forged(q, **{"limits.memory": "64Gi"}))
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "lowered after the resync", 5)


async def test_annotations_alone_open_no_room_and_excluded_namespaces_are_left_alone(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """An unlabelled quota carrying vmquota's annotations (budget 1Ti, last-hard equal to its ``spec.hard``) is
    not raised to 1Ti on release, and a labelled quota in the KubeVirt namespace is never written."""
    forged_notes = {BUDGET_ANNOTATION: '{"limits.memory":"1Ti"}', LAST_HARD_ANNOTATION: '{"limits.memory":"8Gi"}'}
    await sim.create_quota(NS, "compute", {"limits.memory": "8Gi"}, annotations=forged_notes)
    await sim.create_quota("kubevirt", "compute", {"limits.memory": "8Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        q = await wait_quota(sim, lambda o: BUDGET_ANNOTATION not in notes(o), "our annotations removed")
        assert hard(q) == {"limits.memory": "8Gi"}, "a release never raises a quota vmquota was not seen managing"
        await sim.wait_for(lambda: e.idle() and ("kubevirt", "compute") in e._excluded, within=20, what="excluded")
        k = sim.peek("resourcequotas", "kubevirt", "compute")
        assert k is not None and hard(k) == {"limits.memory": "8Gi"} and BUDGET_ANNOTATION not in notes(k)


async def test_a_conflict_storm_is_backed_off_not_hammered(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Every patch answered 409 while the quota's version stays the same: no other writer's progress explains
    it, so the enforcer backs off (jittered, doubling) from the first repeat instead of ~167 patches/s."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        storm = sim.faults.fail(409, 1.0, verbs=["patch"], resources=["resourcequotas"])
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        await sim.wait_for(lambda: storm.injected >= 3, within=20, what="the storm under way")
        start, loop = storm.injected, asyncio.get_running_loop()
        t0 = loop.time()
        await sim.wait_for(lambda: loop.time() - t0 >= 2.0, within=20, what="two seconds of storm")
        attempts = storm.injected - start
        assert attempts <= 12, f"{attempts} patches in 2 s of a 409 storm"
        sim.faults.failures.remove(storm)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "raised once the storm ends", 10)


async def test_progress_and_quota_terms_are_exported(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """``VmquotaNotProgressing`` reads the service's lag and applied sequence: the enforcer exports both (for the
    usage input, which its lag gauge follows); and each quota's terms from the usage snapshot it acts on."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    async with enforcer(bus, api) as (e, _):
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "hard raised")
        last = (await bus.js.stream_info(contract.USAGE_STREAM)).state.last_seq
        r = e.metrics.registry
        assert r.get_sample_value("vmquota_applied_sequence", {"service": "enforcer"}) == last
        assert r.get_sample_value("vmquota_consumer_lag", {"service": "enforcer"}) == 0
        quota = {"service": "enforcer", "cluster": CLUSTER, "namespace": NS, "quota": "compute"}
        memory = {**quota, "resource": "limits.memory"}
        assert r.get_sample_value("vmquota_quota_budget", memory) == 64 * 2**30
        assert r.get_sample_value("vmquota_quota_hard", memory) == 80 * 2**30


async def test_a_refused_vm_is_told_on_its_vmi_once_per_cause(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The ledger refuses a VM: a Warning ``VMQuotaExceeded`` Event on its VMI says why, once per cause (not once
    per usage snapshot), and again when the cause changes (here at once: ``tell_interval`` 0)."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    why = "pending, does not fit: quota compute (VmiPodUsage): limits.memory needs 16Gi but 0 of 64Gi is left"
    holders = [
        contract.VmState(name=f"vm{i}", uid=f"u{i}", state="running", counts={"compute": {"limits.memory": size}})
        for i, size in ((1, "8Gi"), (2, "16Gi"), (3, "16Gi"), (4, "24Gi"))
    ]
    vm9 = contract.VmState(name="vm9", uid="u9", state="refused", reason=why, refused_by={"compute": ["limits.memory"]})
    refused = [*holders, vm9]
    async with enforcer(bus, api, tell_interval=0) as (e, _):
        await publish_usage(bus, 5, terms("64Gi", "64Gi"), vms=refused)
        await sim.wait_for(lambda: e.reporter.reported >= 1, within=10, what="adoption reported")

        async def events(n: int) -> list[Obj]:
            found: list[Obj] = []

            async def check() -> bool:
                found[:] = await sim.events(NS, "vm9", reason="VMQuotaExceeded")
                return len(found) >= n

            await sim.wait_for(check, within=10, what=f"{n} VMQuotaExceeded Event(s)")
            return found

        first = await events(1)
        assert first[0]["type"] == "Warning" and first[0]["involvedObject"]["kind"] == "VirtualMachineInstance"
        assert (
            first[0]["message"]
            == "VM vm9 is not admitted: does not fit: quota compute (VmiPodUsage): limits.memory needs 16Gi but 0 of "
            "64Gi is left; "
            "limits.memory of quota compute is held by vm4 24Gi, vm2 16Gi, vm3 16Gi, vm1 8Gi"
        )
        assert first[0]["source"]["component"] == "vmquota-enforcer"
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=refused)
        await sim.wait_for(lambda: e._usage_at.get(NS, 0) >= 2 and e.idle(), within=10, what="the repeat applied")
        assert len(await sim.events(NS, "vm9", reason="VMQuotaExceeded")) == 1, "the same cause is told once"
        moved = [*holders, msgspec.structs.replace(vm9, reason=why.replace("0 of 64Gi", "8Gi of 64Gi"))]
        await publish_usage(bus, 7, terms("64Gi", "64Gi"), vms=moved)
        assert len(await events(2)) == 2


async def test_refused_vms_are_told_a_changed_cause_at_most_once_a_minute(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The amounts left in a refused VM's reason move with every pod of its namespace: a tenant churning one pod
    beside 40 refused VMIs made 40 new Events per change (before: 200 for five changes) on the client the quota
    patches use. Each VMI is told once, and a changed cause again only after ``tell_interval`` (a minute): the
    latest one then."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)

    def refused(left: int) -> list[contract.VmState]:
        why = (
            f"pending, does not fit: quota compute (VmiPodUsage): limits.memory needs 32Gi but {left}Gi of 64Gi is left"
        )
        return [
            contract.VmState(name=f"big{i}", uid=f"u{i}", state="refused", reason=why, refused_by={"compute": []})
            for i in range(40)
        ]

    async def told() -> int:
        items = await sim.list_objects("events", NS)
        return sum(1 for e in items if e.get("reason") == "VMQuotaExceeded")

    async with enforcer(bus, api) as (e, _):
        await publish_usage(bus, 5, terms("64Gi", "64Gi"), vms=refused(0))
        await sim.wait_for(lambda: _count_is(told, 40), within=10, what="each refused VMI told once")
        for seq, left in enumerate((1, 2, 3, 4, 5), start=6):
            await publish_usage(bus, seq, terms("64Gi", "64Gi"), vms=refused(left))
        await sim.wait_for(lambda: e._usage_at.get(NS, 0) >= 6 and e.idle(), within=10, what="the changes applied")
        assert len(e.reporter._later) == 40, "each VMI's latest cause waits for the minute to pass"
        assert await told() == 40, "a changed cause within the minute is not told again"


async def test_a_cause_changed_within_the_interval_is_told_once_it_has_passed(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A refused VMI's cause changes within ``tell_interval`` (another quota is now the one it does not fit), and
    then no usage comes: the new cause is told once the interval has passed. Before, it was dropped, and the VMI's
    last Event named a cause that was no longer the one for as long as the namespace stayed quiet."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)

    def refused(why: str) -> list[contract.VmState]:
        return [contract.VmState(name="vm9", uid="u9", state="refused", reason=why, refused_by={"compute": []})]

    async def messages() -> list[str]:
        return [str(e.get("message")) for e in await sim.events(NS, "vm9", reason="VMQuotaExceeded")]

    async def told(n: int) -> bool:
        return len(await messages()) >= n

    async with enforcer(bus, api, tell_interval=0.5):
        await publish_usage(bus, 5, terms("64Gi", "64Gi"), vms=refused("pending, does not fit: quota compute: memory"))
        await sim.wait_for(lambda: told(1), within=10, what="the first cause told")
        await publish_usage(bus, 6, terms("64Gi", "64Gi"), vms=refused("pending, does not fit: quota gpu: gpus"))
        await sim.wait_for(lambda: told(2), within=10, what="the changed cause told, with no usage since")
        assert "quota gpu" in (await messages())[-1]


async def _count_is(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() == n


async def test_a_paced_write_carries_what_arrived_while_it_waited(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Patches of one quota are rate-bounded (here 1 a second): a write that has to wait for its turn is planned
    again when its turn comes, so it writes the latest usage, never the one that was current when it began to wait
    (a raise a migration waits for must not come a turn late behind a write of what is no longer true)."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    written: list[dict[str, str]] = []

    def on_change(type_: str, res: Any, obj: Obj) -> None:
        if res.plural == "resourcequotas" and obj["metadata"].get("namespace") == NS:
            h = hard(obj)
            if not written or written[-1] != h:
                written.append(h)

    sim.store.on_change(on_change)
    async with enforcer(bus, api, quota_patch_rate=1.0) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")  # (the token of this second)
        await publish_usage(bus, 1, terms("64Gi", "70Gi"), MIGRATING)  # waits for the next token ...

        def paced() -> float:
            labels = {"service": "enforcer", "outcome": "paced"}
            return e.metrics.registry.get_sample_value("vmquota_enforcer_patches_total", labels) or 0.0

        await sim.wait_for(lambda: paced() >= 1, within=20, what="the write to wait for its turn")
        await publish_usage(bus, 2, terms("64Gi", "80Gi"), MIGRATING)  # ... and this one arrives meanwhile
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the latest usage applied")
    assert {"limits.memory": "70Gi"} not in written, f"a write planned before it waited went out: {written}"


class NudgeRecorder(BeatenOnce):
    """The enforcer's calls as they are, recording what quota admission checked (``status.hard``) when a VMI was
    nudged."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster) -> None:
        super().__init__(inner, sim)
        self.nudged_at: list[dict[str, str]] = []
        self.used_at: list[dict[str, str]] = []
        """What the quota's ``status.used`` was at each nudge."""
        self.nudged: list[str] = []
        """The VMIs nudged, in order."""

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        q = self.sim.peek("resourcequotas", NS, "compute") or {}
        self.nudged_at.append(dict((q.get("status") or {}).get("hard") or {}))
        self.used_at.append(dict((q.get("status") or {}).get("used") or {}))
        self.nudged.append(name)
        await self.inner.nudge_vmi(namespace, name, token)

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        return await self.inner.patch_quota(namespace, name, body)


class ComputeWritesFail(NudgeRecorder):
    """The enforcer's calls as they are, but every write of ``compute`` fails (counted in ``failed``)."""

    failed = 0

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        if name == "compute":
            self.failed += 1
            raise KubeError(500, "InternalError", "compute's write fails")
        return await self.inner.patch_quota(namespace, name, body)

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        if name == "compute":
            self.failed += 1
            raise KubeError(500, "InternalError", "compute's status write fails")
        return await self.inner.patch_quota_status(namespace, name, body)


class RaiseAnswerLostThenReadsFail(NudgeRecorder):
    """The enforcer's calls as they are, but the next ``lose`` writes of ``compute`` land with their answer lost,
    and ``compute``'s reads then fail while ``block``."""

    lose = 0
    block = False

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        written = await self.inner.patch_quota(namespace, name, body)
        if name == "compute" and self.lose > 0:
            self.lose -= 1
            self.block = True
            raise KubeError(504, "Timeout", "the answer was lost (the write landed)")
        return written

    async def get_quota(self, namespace: str, name: str) -> Obj:
        if name == "compute" and self.block:
            raise KubeError(500, "InternalError", "read fails")
        return await self.inner.get_quota(namespace, name)


class ReservationAnswersLost(NudgeRecorder):
    """The enforcer's calls as they are, but the next ``lose`` writes of the QuotaReservation land and their answer
    is lost (a timeout after the API server wrote)."""

    lose = 0

    async def put_reservation(self, namespace: str, body: Obj, resource_version: str) -> str:
        written = await self.inner.put_reservation(namespace, body, resource_version)
        if self.lose > 0:
            self.lose -= 1
            raise KubeError(504, "Timeout", "the answer was lost (the write landed)")
        return written


async def test_a_vmi_is_nudged_once_quota_admission_has_the_raise(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A nudge KubeVirt acts on before quota admission has the raise (``status.hard``) is refused, and nothing would
    nudge again (the usage does not change): an enforcer that does not write ``status.hard`` itself nudges once it
    is what it wrote, whenever the quota controller gets to it."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    calls = NudgeRecorder(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls) as (e, _):
        e.status_writes = False
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        sim.quota.timing = QuotaTiming(sync_delay=0.3)  # (the quota controller copies spec.hard 0.3 s later)
        vm = contract.VmState(name="vm9", uid="uid-vm9", state="admitted", pod_refused=True)
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), vms=[vm])
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the raise")
        await sim.wait_for(lambda: bool(calls.nudged_at), within=10, what="the nudge")
        assert calls.nudged_at[0] == {"limits.memory": "80Gi"}, "nudged before quota admission had the raise"


async def test_a_vmi_is_nudged_once_quota_admission_has_uncharged_the_pod_whose_end_made_its_room(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A VM stops, the ledger admits a waiting one in its room, the enforcer raises and nudges, all in some 30 ms:
    the quota controller had not uncharged the stopped VM's pod yet (``status.used``), KubeVirt's retry was refused,
    and nothing nudged again (the usage does not change): the VM started at KubeVirt's backoff, 163 s after its room
    appeared. The nudge waits until ``status.used`` leaves room for what the usage reserves."""
    ending = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stopped-vm-pod", "namespace": NS},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"memory": "70Gi"}}}]},
    }
    await sim.create(ending)  # (before the quota: charged 70Gi of it)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    calls = NudgeRecorder(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        vm = contract.VmState(name="vm9", uid="uid-vm9", state="admitted", pod_refused=True)
        counted = {"compute": msgspec.structs.replace(terms("64Gi", "80Gi")["compute"], pods={"limits.memory": "0"})}
        await publish_usage(bus, 5, counted, vms=[vm])  # (the ledger: the 70Gi pod has ended)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the raise")
        await sim.wait_quota_synced(NS, "compute")
        await sim.store.delete(sim.store.resource("pods"), NS, "stopped-vm-pod")  # (the quota controller's recount)
        await sim.wait_for(lambda: bool(calls.nudged), within=10, what="the nudge")
        assert calls.used_at[0].get("limits.memory", "0") == "0", f"nudged while charged {calls.used_at[0]}"


async def test_the_usage_summary_alone_is_written_at_most_once_per_interval(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """``vmquota.io/usage`` rides on every ``spec.hard`` write; a usage that changes without moving ``hard`` (VMs
    started and stopped inside the budget) is written on its own, at most once per ``usage_refresh_interval``,
    without an Event or a decision, and its last state always lands."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)

    def used(gi: int) -> dict[str, contract.QuotaTerms]:
        t = terms("64Gi", "64Gi")["compute"]
        return {"compute": msgspec.structs.replace(t, used={"limits.memory": f"{gi}Gi"})}

    async with enforcer(bus, api, usage_refresh_interval=1.0) as (e, _):
        await publish_usage(bus, 1, used(8))
        q = await wait_quota(sim, lambda o: "used limits.memory 8Gi/64Gi" in notes(o).get(USAGE_ANNOTATION, ""), "8Gi")
        adopted = [d for d in await decisions(bus, lambda ds: len(ds) >= 1)]
        for seq, gi in enumerate((16, 24, 32, 40), 2):  # (within one interval: hard stays 64Gi)
            await publish_usage(bus, seq, used(gi))
        await wait_quota(sim, lambda o: "used limits.memory 40Gi/64Gi" in notes(o).get(USAGE_ANNOTATION, ""), "40Gi")
        refreshed = e.metrics.registry.get_sample_value(
            "vmquota_enforcer_patches_total", {"service": "enforcer", "outcome": "refreshed"}
        )
        assert refreshed is not None and 1 <= refreshed <= 2, refreshed  # (not one write per snapshot)
        final = await wait_quota(sim, lambda o: True, "the quota")
        assert hard(final) == hard(q) == {"limits.memory": "64Gi"}
        assert len(await decisions(bus, lambda ds: True)) == len(adopted), "no decision for the summary alone"


async def test_summary_writes_have_their_own_rate_bound(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Thousands of quotas whose usage moves must not spend the write budget raises wait for: summary-only writes
    are spaced by ``refresh_rate`` (here 2/s, a burst of 2), and each still lands."""
    names = [f"q{i}" for i in range(4)]
    for name in names:
        await sim.create_quota(NS, name, {"limits.memory": "64Gi"}, labels=MANAGED)

    def used(gi: int) -> dict[str, contract.QuotaTerms]:
        t = terms("64Gi", "64Gi")["compute"]
        return {name: msgspec.structs.replace(t, used={"limits.memory": f"{gi}Gi"}) for name in names}

    def summary(gi: int) -> Callable[[], Any]:
        async def check() -> bool:
            objs = [await sim.get("resourcequotas", NS, name) for name in names]
            return all(f"used limits.memory {gi}Gi/64Gi" in notes(o).get(USAGE_ANNOTATION, "") for o in objs)

        return check

    async with enforcer(bus, api, usage_refresh_interval=0.0, refresh_rate=2.0) as (e, _):
        await publish_usage(bus, 1, used(8))
        await sim.wait_for(summary(8), within=10, what="adopted with the 8Gi summary")
        loop = asyncio.get_running_loop()
        start = loop.time()
        await publish_usage(bus, 2, used(16))
        await sim.wait_for(summary(16), within=10, what="every summary refreshed")
        took = loop.time() - start
        refreshed = e.metrics.registry.get_sample_value(
            "vmquota_enforcer_patches_total", {"service": "enforcer", "outcome": "refreshed"}
        )
        assert refreshed == 4, refreshed
        assert took >= 0.9, f"4 refreshes at 2/s with a burst of 2 take a second; took {took:.2f} s"


# ---- the cancel of a migration whose end would carry out a size change never admitted -------------------------


async def test_a_migration_is_canceled_only_while_it_is_the_one_asked_and_not_final(
    sim: SimCluster, api: client.ApiClient
) -> None:
    """``cancel_migration`` deletes the migration of that name only while it has that uid and is not final (KubeVirt
    then cancels it); one made since under the name, and one that ended, are left alone."""
    kube = KubeQuotas(api)
    await sim.create_vm(NS, "vm1", memory="512Mi")
    vmi = await sim.wait_for_phase(NS, "vm1", "Running")
    sim.kubevirt.schedulable = {vmi["status"]["nodeName"]}  # (the target finds no node: the migration waits)
    await sim.migrate(NS, "vm1", name="mig1")
    waiting = await sim.wait_for_phase(NS, "mig1", "Scheduling", kind="vmim")
    assert not await kube.cancel_migration(NS, "mig1", "another-uid")
    assert sim.peek("vmim", NS, "mig1") is not None
    assert await kube.cancel_migration(NS, "mig1", waiting["metadata"]["uid"])
    await sim.wait_for(lambda: sim.peek("vmim", NS, "mig1") is None, what="KubeVirt to cancel it")
    assert not await kube.cancel_migration(NS, "mig1", waiting["metadata"]["uid"])  # (gone)
    sim.kubevirt.schedulable = set(sim.kubevirt.config.nodes)
    await sim.migrate(NS, "vm1", name="mig2")
    done = await sim.wait_for_phase(NS, "mig2", "Succeeded", kind="vmim")
    assert not await kube.cancel_migration(NS, "mig2", done["metadata"]["uid"])
    assert sim.peek("vmim", NS, "mig2") is not None, "a final migration is left alone"


class FlakyCancels(BeatenOnce):
    """The enforcer's calls, but the first ``fail`` cancels fail with ``status``."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster, status: int, fail: int) -> None:
        super().__init__(inner, sim)
        self.status, self.fail, self.cancels = status, fail, 0

    async def cancel_migration(self, namespace: str, name: str, uid: str) -> bool:
        self.cancels += 1
        if self.cancels <= self.fail:
            raise KubeError(self.status, "ServiceUnavailable" if self.status == 503 else "Forbidden", "no")
        return await self.inner.cancel_migration(namespace, name, uid)


@pytest.mark.parametrize(("status", "tries"), [(503, 3), (403, 1)])
async def test_a_cancel_that_fails_is_tried_again(
    sim: SimCluster, bus: Bus, api: client.ApiClient, status: int, tries: int
) -> None:
    """A transient failure is tried again at once (twice, after a backoff); any other is forgotten, and the next
    usage snapshot asking the cancel tries again. Each cancel tells the VMI why, once."""
    await sim.create_vm(NS, "vm1", memory="512Mi")
    vmi = await sim.wait_for_phase(NS, "vm1", "Running")
    sim.kubevirt.schedulable = {vmi["status"]["nodeName"]}
    await sim.migrate(NS, "vm1", name="mig1")
    m = await sim.wait_for_phase(NS, "mig1", "Scheduling", kind="vmim")
    calls = FlakyCancels(KubeQuotas(api), sim, status, fail=2)
    e = Enforcer(bus, calls, EnforcerOptions(cluster=CLUSTER, retry_base=0.001), metrics=Metrics())
    state = contract.MigrationState(
        name="mig1", uid=m["metadata"]["uid"], vmi="vm1", phase="Scheduling", state="cancel", reason="its end would"
    )
    asked = usage_snapshot(NS, 1, migrations=[state])
    e.reporter.cancel(NS, asked)
    await wait_until(lambda: not e.reporter.side_tasks, what="the cancel")
    assert calls.cancels == tries
    if status == 403:
        assert sim.peek("vmim", NS, "mig1") is not None
        e.reporter.cancel(NS, asked)  # (the next snapshot)
        await wait_until(lambda: not e.reporter.side_tasks, what="the cancel")
        e.reporter.cancel(NS, asked)
        await wait_until(lambda: not e.reporter.side_tasks, what="the cancel")
        assert calls.cancels == 3, "tried with each snapshot until it went through, then no more"
    await sim.wait_for(lambda: sim.peek("vmim", NS, "mig1") is None, what="KubeVirt to cancel it")
    told = [ev for ev in await sim.events(NS, "vm1", reason="VMQuotaExceeded") if "mig1" in ev["message"]]
    assert len(told) == 1, told


async def test_a_dry_run_cancels_nothing(sim: SimCluster, bus: Bus, api: client.ApiClient) -> None:
    calls = FlakyCancels(KubeQuotas(api), sim, 503, fail=0)
    metrics = Metrics()
    e = Enforcer(bus, calls, EnforcerOptions(cluster=CLUSTER, dry_run=True), metrics=metrics)
    state = contract.MigrationState(name="mig1", uid="u1", vmi="vm1", phase="Scheduling", state="cancel")
    e.reporter.cancel(NS, usage_snapshot(NS, 1, migrations=[state]))
    e.reporter.cancel(NS, usage_snapshot(NS, 2, migrations=[state]))
    await wait_until(lambda: not e.reporter.side_tasks, what="nothing under way")
    assert calls.cancels == 0
    seen = metrics.registry.get_sample_value(
        "vmquota_enforcer_cancels_total", {"service": "enforcer", "outcome": "dry-run"}
    )
    assert seen == 1.0, "reported once"


class StatusRefused(BeatenOnce):
    """The enforcer's calls, with the API server refusing ``resourcequotas/status`` (a ClusterRole without it)."""

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        self.calls.append("status")
        raise KubeError(403, "Forbidden", 'resourcequotas "compute" is forbidden: cannot patch resource status')

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        return await self.inner.patch_quota(namespace, name, body)


async def test_quota_admission_checks_what_the_enforcer_writes_from_the_write_on(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Quota admission checks ``status.hard``, which the quota controller copies from ``spec.hard`` a sync later:
    until then a raise is not there for KubeVirt's retry that the write wakes (a refusal per migration target), and
    a lowered ``hard`` leaves its room open. The enforcer writes ``status.hard`` first, then ``spec.hard``; with a
    quota controller that copies nothing, admission has both the raise and the lowering at once."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await sim.wait_quota_synced(NS, "compute")
    async with enforcer(bus, api) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        sim.quota.timing = QuotaTiming(sync_delay=3600.0)  # (the quota controller copies nothing from now on)
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the raise")
        assert q["status"]["hard"] == {"limits.memory": "80Gi"}, "quota admission does not have the raise"
        assert q["status"]["used"], "status.used is the quota controller's and admission's, left as it was"
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        q = await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the lowering")
        assert q["status"]["hard"] == {"limits.memory": "64Gi"}, "the lowered room stays open to quota admission"
        assert e.status_writes


async def test_an_enforcer_the_api_server_does_not_let_write_status_writes_spec_hard_as_before(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A ClusterRole without ``patch`` on ``resourcequotas/status`` (an upgrade's manifests not applied yet): the
    403 is logged once, and the enforcer writes ``spec.hard`` alone, for the quota controller to copy, instead of
    retrying the quota for ever."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await sim.wait_quota_synced(NS, "compute")
    calls = StatusRefused(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the raise")
        await sim.wait_quota_synced(NS, "compute")
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "64Gi"}, "the lowering")
        assert not e.status_writes and calls.calls.count("status") == 1, calls.calls


class AdmittedBetween(BeatenOnce):
    """The enforcer's calls, with quota admission charging a pod (``status.used`` grows) right after the enforcer's
    first write of ``status.hard`` that raises it: the pod the raise let in, before the enforcer's ``spec.hard``
    patch, whose precondition then fails."""

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        written = await self.inner.patch_quota_status(namespace, name, body)
        if written["status"]["hard"] == {"limits.memory": "80Gi"} and "admitted" not in self.calls:
            self.calls.append("admitted")

            def admit(obj: Obj) -> Obj:
                obj["status"]["used"] = {"limits.memory": "80Gi"}
                return obj

            res = self.sim.store.resource("resourcequotas")
            await self.sim.store.mutate(res, namespace, name, admit, status=True)
        return written

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        self.calls.append("patch")
        return await self.inner.patch_quota(namespace, name, body)

    async def get_quota(self, namespace: str, name: str) -> Obj:
        if "admitted" in self.calls:  # (the read after the conflict: the next write goes out 20 ms after the first)
            await asyncio.sleep(0.02)
        return await super().get_quota(namespace, name)


class SpecFailsOnceAfterRaise(BeatenOnce):
    """The enforcer's calls, with the ``spec.hard`` patch after the first ``status.hard`` raise failed by the API
    server (a 500)."""

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        written = await self.inner.patch_quota_status(namespace, name, body)
        if written["status"]["hard"] == {"limits.memory": "80Gi"}:
            self.calls.append("raised")
        return written

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        self.calls.append("patch")
        if self.calls[-2:] == ["raised", "patch"] and self.calls.count("raised") == 1:
            raise KubeError(500, "InternalError", "etcdserver: request timed out")
        return await self.inner.patch_quota(namespace, name, body)


async def test_a_raise_in_status_hard_whose_spec_hard_failed_is_reported_as_a_decision(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Not only a conflict: whatever failed the ``spec.hard`` patch, quota admission checked the raise from the
    ``status.hard`` write on (and a usage that moves on before the work queue's retry leaves it unrecorded)."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await sim.wait_quota_synced(NS, "compute")
    calls = SpecFailsOnceAfterRaise(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        ds = await decisions(bus, lambda ds: any(d.status_only for d in ds))
        (only,) = [d for d in ds if d.status_only]
        assert (only.hard_before, only.hard_after) == ({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"}), only
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "spec.hard after the retry")


async def test_a_raise_in_status_hard_alone_is_reported_as_a_decision(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The enforcer writes ``status.hard`` first; quota admission lets the pod in by it and charges it, so the
    ``spec.hard`` patch after it conflicts, and the quota is planned again. The raise admission acted on was reported
    nowhere: the decisions showed no raise for a pod let in past the budget, and ``replay --verify`` could not check
    it. It is a decision of its own (``statusOnly``), at the status write's version."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await sim.wait_quota_synced(NS, "compute")
    calls = AdmittedBetween(KubeQuotas(api), sim)
    async with enforcer(bus, api, calls=calls) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        ds = await decisions(bus, lambda ds: any(d.status_only for d in ds))
        (only,) = [d for d in ds if d.status_only]
        assert only.hard_after == {"limits.memory": "80Gi"} and only.hard_before == {"limits.memory": "64Gi"}, only
        assert only.reason.startswith("raised limits.memory by 16Gi"), only.reason
        assert e.conflicts >= 1 and "admitted" in calls.calls, calls.calls
        assert next(d for d in ds if d.hard_after == {"limits.memory": "80Gi"}) is only, "reported in order"
        ds = await decisions(bus, lambda ds: len([d for d in ds if d.hard_after == {"limits.memory": "80Gi"}]) == 2)
        spec = [d for d in ds if d.hard_after == {"limits.memory": "80Gi"}][1]
        assert not spec.status_only and spec.hard_before == {"limits.memory": "64Gi"}, "spec.hard followed"
        assert spec.time > only.time, "each decision has the time of its own first write"


@contextlib.asynccontextmanager
async def two_quotas_enforced(
    sim: SimCluster, bus: Bus, api: client.ApiClient, calls: QuotaApi
) -> AsyncIterator[tuple[Enforcer, Obj]]:
    """Managed quotas ``compute`` (64Gi of memory) and ``gpu`` (2 GPUs), adopted by an enforcer making ``calls`` and
    synced by the quota controller: the enforcer, and ``compute`` as adopted."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await sim.create_quota(NS, "gpu", {"requests.nvidia.com/gpu": "2"}, labels=MANAGED)
    async with enforcer(bus, api, calls=calls) as (e, _):
        adopted = await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        await sim.wait_quota_synced(NS, "compute")
        await sim.wait_quota_synced(NS, "gpu")
        yield e, adopted


async def raise_both_for_vm9(bus: Bus) -> None:
    """Usage with quota ``compute`` raised by 16Gi and quota ``gpu`` by one GPU, for the admitted VM vm9 whose launcher
    pod KubeVirt was refused (it is nudged once both have the room)."""
    gpus = contract.QuotaTerms(
        mode="VmiPodUsage",
        budget={"requests.nvidia.com/gpu": "2"},
        reserved={"requests.nvidia.com/gpu": "1"},
        hard={"requests.nvidia.com/gpu": "3"},
    )
    vm = contract.VmState(name="vm9", uid="uid-vm9", state="admitted", pod_refused=True)
    await publish_usage(bus, 5, {**terms("64Gi", "80Gi"), "gpu": gpus}, vms=[vm])


class SlowSecondQuota(NudgeRecorder):
    """The enforcer's calls, with every write of quota ``gpu`` 0.3 s late, recording both quotas' ``status.hard``
    when a VMI is nudged."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster) -> None:
        super().__init__(inner, sim)
        self.both_at: list[tuple[dict[str, str], dict[str, str]]] = []

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        status = [(self.sim.peek("resourcequotas", NS, q) or {}).get("status") or {} for q in ("compute", "gpu")]
        self.both_at.append((dict(status[0].get("hard") or {}), dict(status[1].get("hard") or {})))
        await self.inner.nudge_vmi(namespace, name, token)

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        if name == "gpu":
            await asyncio.sleep(0.3)
        return await self.inner.patch_quota_status(namespace, name, body)

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        if name == "gpu":
            await asyncio.sleep(0.3)
        return await self.inner.patch_quota(namespace, name, body)


async def test_a_vmi_is_nudged_once_every_managed_quota_of_its_namespace_has_the_raise(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Two managed quotas, both raised for an admitted VM whose launcher pod KubeVirt was refused. A VMI is nudged
    once per usage snapshot: nudged when the first quota had the room, KubeVirt's retry met the second's refusal,
    and nothing nudged again (KubeVirt's backoff, up to minutes). The nudge waits for every managed quota."""
    calls = SlowSecondQuota(KubeQuotas(api), sim)
    async with two_quotas_enforced(sim, bus, api, calls):
        await raise_both_for_vm9(bus)
        await sim.wait_for(lambda: bool(calls.both_at), within=10, what="the nudge")
        assert calls.both_at[0] == ({"limits.memory": "80Gi"}, {"requests.nvidia.com/gpu": "3"}), calls.both_at


@pytest.mark.parametrize("cpu", ["8", "6"])
async def test_with_the_guard_a_quota_in_vm_terms_never_has_status_hard_above_spec_hard(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None, cpu: str
) -> None:
    """The guard's ``vmquota-vm-terms`` takes a quota counted in VM terms as enforced only while ``status.hard`` is
    no higher than ``spec.hard`` (a lowering not copied yet leaves room open), and refuses every pod and VMI of the
    namespace otherwise. Written ``status.hard`` first, a raise was refused so until ``spec.hard`` followed
    (``bench_migration_guard``: 694 of its refusals); written ``spec.hard`` first, the lowered part of a plan that
    raises another resource (``cpu`` 8 to 6 beside a memory raise) was. The lowerings go to ``status.hard`` first,
    then ``spec.hard``, then the raises to ``status.hard``; a lowering still closes its room with its first write."""
    budget = {"requests.memory": "16Gi", "requests.cpu": "8"}
    await sim.create_quota(NS, "compute", budget, labels=MANAGED, annotations={MODE_ANNOTATION: "VirtualResources"})
    await sim.wait_quota_synced(NS, "compute")
    seen: list[tuple[dict[str, str], dict[str, str]]] = []  # (spec.hard, status.hard) at every write of the quota

    def look() -> None:
        q = sim.peek("resourcequotas", NS, "compute") or {}
        seen.append((dict((q.get("spec") or {}).get("hard") or {}), dict((q.get("status") or {}).get("hard") or {})))

    def wanted(memory: str, cpu: str, reserved: str = "") -> dict[str, contract.QuotaTerms]:
        return {
            "compute": contract.QuotaTerms(
                mode="VirtualResources",
                budget=budget,
                reserved={"requests.memory": reserved} if reserved else {},
                hard={"requests.memory": memory, "requests.cpu": cpu},
            )
        }

    async def written(seq: int, terms: dict[str, contract.QuotaTerms], want: dict[str, str], *mig: Any) -> None:
        patched = e.patched
        await publish_usage(bus, seq, terms, *mig)

        def done() -> bool:
            look()
            return e.patched > patched and e.idle() and seen[-1] == (want, want)

        await sim.wait_for(done, within=10, what=f"hard {want}")

    async with enforcer(bus, api, reservation_guard=True) as (e, _):
        await publish_usage(bus, 5, wanted("16Gi", "8"))
        await wait_quota(sim, lambda o: notes(o).get(STATUS_ANNOTATION, "").startswith("Enforcing"), "enforced")
        await written(6, wanted("20Gi", cpu, "4Gi"), {"requests.memory": "20Gi", "requests.cpu": cpu}, MIGRATING)
        await written(7, wanted("16Gi", cpu), {"requests.memory": "16Gi", "requests.cpu": cpu})
    above = [(sp, st) for sp, st in seen if any(Quantity.parse(st[r]) > Quantity.parse(sp[r]) for r in sp if r in st)]
    assert not above, above
    assert ({"requests.memory": "20Gi", "requests.cpu": cpu}, {"requests.memory": "16Gi", "requests.cpu": cpu}) in seen


class FailingQuota(NudgeRecorder):
    """The enforcer's calls, with every call for the quota named ``failing`` answered 500, recording nudges."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster) -> None:
        super().__init__(inner, sim)
        self.failing = ""
        self.failures_left = -1  # (how many more calls fail; -1: every one)
        self.nudges: list[str] = []
        self.gpu_at: list[dict[str, str]] = []  # (the gpu quota's status.hard at each nudge)

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.nudges.append(name)
        self.gpu_at.append(
            dict(((self.sim.peek("resourcequotas", NS, "gpu") or {}).get("status") or {}).get("hard") or {})
        )
        await self.inner.nudge_vmi(namespace, name, token)

    def _check(self, name: str) -> None:
        if name == self.failing and self.failures_left != 0:
            self.failures_left -= 1
            raise KubeError(429, "TooManyRequests", "the API server is busy")

    async def get_quota(self, namespace: str, name: str) -> Obj:
        self._check(name)
        return await self.inner.get_quota(namespace, name)

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        self._check(name)
        return await self.inner.patch_quota(namespace, name, body)

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        self._check(name)
        return await self.inner.patch_quota_status(namespace, name, body)


async def test_a_quota_only_the_bus_tells_of_or_whose_calls_fail_holds_no_nudge_back(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The nudge waits for every managed quota of the namespace, but not for one only a quota event tells of (a
    forged one, the watcher's credentials, that never exists: it held every nudge of the namespace back for good)
    nor for one whose calls fail (an unrelated quota's 500s held back a VM that fits)."""
    calls = FailingQuota(KubeQuotas(api), sim)
    async with two_quotas_enforced(sim, bus, api, calls) as (e, real):
        ghost = json.loads(json.dumps(real))
        ghost["metadata"].update(name="ghost", uid="uid-ghost", resourceVersion="1")
        ghost["status"] = {"hard": {"limits.memory": "4Gi"}, "used": {"limits.memory": "0"}}
        ghost["metadata"]["annotations"] = {
            BUDGET_ANNOTATION: '{"limits.memory":"8Gi"}',
            LAST_HARD_ANNOTATION: '{"limits.memory":"8Gi"}',
            STATUS_ANNOTATION: "Waiting for usage (VmiPodUsage)",
        }
        ghost["spec"]["hard"] = {"limits.memory": "8Gi"}
        await publish_quota(bus, ghost)
        await sim.wait_for(lambda: e.quotas.get((NS, "ghost")) is not None and e.idle(), within=20, what="the ghost")
        calls.failing = "gpu"
        gpus = contract.QuotaTerms(
            mode="VmiPodUsage", budget={"requests.nvidia.com/gpu": "2"}, hard={"requests.nvidia.com/gpu": "1"}
        )  # (a lowering of gpu, whose calls fail: nothing to do with the VM, which has no GPU)
        vm = contract.VmState(name="vm9", uid="uid-vm9", state="admitted", pod_refused=True)
        await publish_usage(bus, 5, {**terms("64Gi", "80Gi"), "gpu": gpus}, vms=[vm])
        await wait_quota(sim, lambda o: hard(o) == {"limits.memory": "80Gi"}, "the raise")
        await sim.wait_for(lambda: bool(calls.nudges), within=10, what="the nudge")


async def test_one_failure_of_another_quota_does_not_spend_the_nudge(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """A quota whose calls keep failing holds no nudge back, but one failure (a 429, retried in milliseconds) does:
    the VM needs that quota's raise too, and a nudge sent before it had the room was the snapshot's only one."""
    calls = FailingQuota(KubeQuotas(api), sim)
    async with two_quotas_enforced(sim, bus, api, calls):
        calls.failing, calls.failures_left = "gpu", 1
        await raise_both_for_vm9(bus)
        await sim.wait_for(lambda: bool(calls.nudges), within=10, what="the nudge")
        q = sim.peek("resourcequotas", NS, "gpu") or {}
        assert q["status"]["hard"] == {"requests.nvidia.com/gpu": "3"}, "nudged before the gpu quota had the room"


class StatusFails(FailingQuota):
    """The enforcer's calls, with every write of ``status.hard`` that raises memory past 16Gi answered 500."""

    def __init__(self, inner: KubeQuotas, sim: SimCluster) -> None:
        super().__init__(inner, sim)
        self.status_writes = 0

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        self.status_writes += 1
        if Quantity.parse(body["status"]["hard"]["requests.memory"]) > Quantity.parse("16Gi"):
            raise KubeError(500, "InternalError", "the API server failed")
        return await self.inner.patch_quota_status(namespace, name, body)


async def test_with_the_guard_a_failing_status_write_after_spec_hard_is_retried_with_backoff(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """``spec.hard`` written, the write of ``status.hard`` after it failing every time: the quota was queued again at
    once, its round counted as a success, so it spun (39 writes of each in 3 s, in the review) and reported each
    round a decision for a write that had failed. It is retried after the queue's backoff, and a round whose
    writes all failed reports nothing."""
    budget = {"requests.memory": "16Gi", "requests.cpu": "8"}
    await sim.create_quota(NS, "compute", budget, labels=MANAGED, annotations={MODE_ANNOTATION: "VirtualResources"})
    await sim.wait_quota_synced(NS, "compute")
    calls = StatusFails(KubeQuotas(api), sim)
    terms_of = {
        "compute": contract.QuotaTerms(
            mode="VirtualResources",
            budget=budget,
            reserved={"requests.memory": "4Gi"},
            hard={"requests.memory": "20Gi", "requests.cpu": "6"},
        )
    }
    async with enforcer(bus, api, calls=calls, reservation_guard=True) as (e, _):
        await wait_quota(sim, lambda o: BUDGET_ANNOTATION in notes(o), "adoption")
        sim.quota.timing = QuotaTiming(sync_delay=2.0)  # (the quota controller copies 2 s after spec.hard changes)
        patched, tried = e.patched, calls.status_writes
        await publish_usage(bus, 6, terms_of, MIGRATING)
        await wait_quota(sim, lambda o: hard(o) == {"requests.memory": "20Gi", "requests.cpu": "6"}, "spec.hard")
        synced = await sim.wait_quota_synced(NS, "compute", within=10)
        assert synced["status"]["hard"] == {"requests.memory": "20Gi", "requests.cpu": "6"}
        assert calls.status_writes - tried <= 8, calls.status_writes - tried  # (backoff 0.2 s, doubling: 2 s)
        assert e.patched - patched <= 2, e.patched - patched  # (the lowering of cpu and the spec.hard; no more)


async def test_a_vmi_nudged_past_a_failing_quota_is_nudged_again_once_that_quota_has_the_room(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """The nudge does not wait for a quota whose reconciliation failed three times in a row; when that quota's
    calls succeed again (a burst of 429s under a second) it has the VM's room only after the nudge, which went
    once per usage snapshot: the VM waited for KubeVirt's backoff. Its VMIs are nudged again once it has it."""
    failing = FailingQuota(KubeQuotas(api), sim)  # (the gpu quota's calls fail three times, then succeed)
    async with two_quotas_enforced(sim, bus, api, failing):
        failing.failing, failing.failures_left = "gpu", NUDGE_PAST_FAILURES
        await raise_both_for_vm9(bus)
        room = {"requests.nvidia.com/gpu": "3"}
        await sim.wait_for(lambda: room in failing.gpu_at, within=15, what="a nudge once the gpu quota has the room")


# ---- an enforcer that lost its Lease (a leader paused past its renew deadline) --------------------------------


class Paused:
    """An enforcer's Kubernetes calls that wait while ``running`` is clear (the process paused: a node stall,
    SIGSTOP); with ``writes_only`` its reads go on (paused after its read of the quota, before its write)."""

    def __init__(self, inner: KubeQuotas, *, writes_only: bool = False) -> None:
        self.inner = inner
        self.writes_only = writes_only
        self.running = asyncio.Event()
        self.running.set()
        self.waiting = asyncio.Event()
        self.writes: list[str] = []
        self.after_resumed: Callable[[], object] | None = None
        """Called once the first write held by the pause is answered (its Lease renewal came back refused); no
        write goes out after it."""
        self.stopped = False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        writes = name.startswith("patch_quota")
        if not callable(target) or (self.writes_only and not writes):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            if writes and self.stopped:  # (the work is being cancelled: nothing more goes out)
                await asyncio.Event().wait()
            held = not self.running.is_set()
            if held:
                self.waiting.set()
                await self.running.wait()
            try:
                answer = await target(*args, **kwargs)
                if writes:
                    self.writes.append(name)  # (answered: the write went out)
                return answer
            finally:
                if held and writes and self.after_resumed is not None:
                    self.stopped = True
                    self.after_resumed()

        return call


def gate_inputs(e: Enforcer, quotas: asyncio.Event, usage: asyncio.Event) -> None:
    """Hold the enforcer's input handlers until ``quotas`` / ``usage`` are set (a paused process reads nothing; a
    lagging usage consumer reads its usage late)."""
    on_quota, on_usage = e._on_quota_message, e._on_usage_message

    async def quota_msg(m: Any) -> None:
        await quotas.wait()
        await on_quota(m)

    async def usage_msg(m: Any) -> None:
        await usage.wait()
        await on_usage(m)

    e._on_quota_message, e._on_usage_message = quota_msg, usage_msg  # type: ignore[method-assign]


def status_hard(q: Obj) -> dict[str, str]:
    return dict((q.get("status") or {}).get("hard") or {})


async def tenant_pod(sim: SimCluster, name: str) -> bool:
    """Whether the tenant (``edit`` in the namespace) gets a 16Gi pod in, through admission as any client."""
    user = sim.users.authenticate(f"Bearer {sim.add_tenant('mallory', [NS])}")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [
                {"name": "c", "image": "x", "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "16Gi"}}}
            ]
        },
    }
    try:
        with acting_as(user):
            await sim.create(pod)
    except ApiError:
        return False
    return True


async def namespace_full(sim: SimCluster) -> None:
    for i in range(4):
        assert await tenant_pod(sim, f"app-{i}")


async def test_an_enforcer_behind_on_usage_writes_nothing_from_usage_older_than_the_quota_was_written_from(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Enforcer A raised ``hard`` for a migration (usage seq 5) and was paused. The migration ended (seq 6); B, the
    leader once A's Lease expired, lowered ``hard`` and wrote ``vmquota.io/usage-from: 6``. A resumed with its quota
    events coming in and its usage consumer behind (seq 5): it read the quota and wrote ``hard`` from seq 5, and the
    tenant watching the quota had a 16Gi pod in (80Gi on 64Gi), 9 times of 9. A write is not planned from usage
    older than the one the quota, as the API server has it, was last written from."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 4, terms("64Gi", "64Gi"))
    a_calls = Paused(KubeQuotas(api))
    a_quotas, a_usage = asyncio.Event(), asyncio.Event()
    a_quotas.set()
    a_usage.set()
    async with enforcer(bus, api, calls=a_calls) as (a, _):
        gate_inputs(a, a_quotas, a_usage)
        await wait_quota(sim, lambda o: notes(o).get(USAGE_FROM_ANNOTATION, "").startswith("4 "), "A enforcing")
        await sim.wait_quota_synced(NS, "compute")
        await namespace_full(sim)
        await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
        await wait_quota(sim, lambda o: status_hard(o) == {"limits.memory": "80Gi"}, "A raised for the migration")
        await sim.wait_for(a.idle, within=20, what="A idle")
        a_calls.running.clear()  # A is paused: no input, no call
        a_quotas.clear()
        a_usage.clear()
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))  # the migration ended
        async with enforcer(bus, api, service="enforcer-b") as (b, _):
            q = await wait_quota(
                sim,
                lambda o: hard(o) == {"limits.memory": "64Gi"} and status_hard(o) == {"limits.memory": "64Gi"},
                "B lowered hard",
            )
            assert notes(q)[USAGE_FROM_ANNOTATION].startswith("6 ")
            await sim.wait_for(b.idle, within=20, what="B idle")
            written = len(a_calls.writes)
            a_calls.running.set()  # A resumes: its calls and quota events go on, its usage still at seq 5
            a_quotas.set()
            await sim.wait_for(
                lambda: a.older_usage > 0 or len(a_calls.writes) > written, within=20, what="A's reconciliation"
            )
            await sim.wait_for(a.idle, within=20, what="A idle")
            assert a_calls.writes[written:] == [], "A wrote hard from usage older than B wrote it from"
            assert status_hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "64Gi"}
            assert not await tenant_pod(sim, "grab")
            a_usage.set()


async def paused_before_a_raise(sim: SimCluster, bus: Bus, a: Enforcer, a_calls: Paused) -> int:
    """Enforcer A, making ``a_calls``, enforces a full namespace (seq 4), then plans a raise for a migration (seq 5)
    and is paused right before its write; how many writes it had made before."""
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 4, terms("64Gi", "64Gi"))
    await wait_quota(sim, lambda o: notes(o).get(USAGE_FROM_ANNOTATION, "").startswith("4 "), "A enforcing")
    await sim.wait_quota_synced(NS, "compute")
    await namespace_full(sim)
    await sim.wait_for(a.idle, within=20, what="A idle")
    written = len(a_calls.writes)
    a_calls.running.clear()
    await publish_usage(bus, 5, terms("64Gi", "80Gi"), MIGRATING)
    await sim.wait_for(a_calls.waiting.is_set, within=20, what="A about to write the raise")
    return written


async def test_a_status_hard_an_enforcer_wrote_after_losing_its_lease_is_set_back_to_spec_hard(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Enforcer A planned a raise (seq 5), read the quota and was paused before its write of ``status.hard``. The
    migration went (seq 6, no pod changed: the quota's version stayed); B, the new leader, had nothing to write. A
    resumed, its write (its precondition still current) landed as its Lease renewal came back refused, and A
    stopped: ``status.hard`` 80Gi over a ``spec.hard`` of 64Gi, which B ignored as a status-only version, in its
    resyncs too, so quota admission checked 80Gi until the namespace's next change (or the quota controller's
    resync, minutes): the tenant's 16Gi pod got in, 11 times of 11. B sets ``status.hard`` back to ``spec.hard``."""
    a_calls = Paused(KubeQuotas(api), writes_only=True)
    async with enforcer(bus, api, calls=a_calls) as (a, a_task):
        written = await paused_before_a_raise(sim, bus, a, a_calls)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))  # the tenant deleted its refused migration
        async with enforcer(bus, api, service="enforcer-b") as (b, _):
            await sim.wait_for(
                lambda: b.idle() and b.usage.get(NS) is not None and b.usage[NS].seq == 6, within=20, what="B at seq 6"
            )
            assert b.patched == 0, "hard is what seq 6 asks: B writes nothing"
            a_calls.after_resumed = a_task.cancel  # (LeaseLost: A stops once its write is answered)
            a_calls.running.set()
            with contextlib.suppress(asyncio.CancelledError):
                await a_task
            assert a_calls.writes[written:] == ["patch_quota_status"], a_calls.writes
            await wait_quota(sim, lambda o: status_hard(o) == {"limits.memory": "64Gi"}, "status.hard set back", 5)
            assert hard(await sim.get("resourcequotas", NS, "compute")) == {"limits.memory": "64Gi"}
            assert not await tenant_pod(sim, "grab")


async def test_an_enforcer_writes_nothing_while_its_fence_is_closed(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None
) -> None:
    """Past its renew deadline an enforcer may no longer lead (``services.platform.lease.Fence``): its writes are
    refused before they go out (a network-class error, retried with backoff), and go out once a renewal opens the
    fence again."""
    fence = Fence()
    fence.hold_until(-math.inf)
    await sim.create_quota(NS, "compute", {"limits.memory": "64Gi"}, labels=MANAGED)
    await publish_usage(bus, 4, terms("64Gi", "64Gi"))
    async with enforcer(bus, api, calls=KubeQuotas(api, fence=fence)) as (e, _):
        await sim.wait_for(lambda: e._queue.failures(("tenant-a", "compute")) >= 1, within=20, what="a refused write")
        assert BUDGET_ANNOTATION not in notes(await sim.get("resourcequotas", NS, "compute")), "nothing written"
        assert e.patched == 0
        fence.hold_until(math.inf)
        await wait_quota(sim, lambda o: notes(o).get(USAGE_FROM_ANNOTATION, "").startswith("4 "), "adopted")


class HeldAfterRead:
    """An enforcer's Kubernetes calls whose read of a quota, once ``hold`` is cleared, is answered and then held
    (the reconciliation goes on with the copy it read, once ``hold`` is set)."""

    def __init__(self, inner: KubeQuotas) -> None:
        self.inner = inner
        self.hold = asyncio.Event()
        self.hold.set()
        self.read = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def get_quota(self, namespace: str, name: str) -> Obj:
        answer = await self.inner.get_quota(namespace, name)
        if not self.hold.is_set():
            self.read.set()
            await self.hold.wait()
        return answer


class HeldAfterUnreadableRead(HeldAfterRead):
    """As :class:`HeldAfterRead`, but the held read answers an object the enforcer cannot read (InvalidInput)."""

    async def get_quota(self, namespace: str, name: str) -> Obj:
        held = not self.hold.is_set()
        answer = await super().get_quota(namespace, name)
        return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {}} if held else answer


@pytest.mark.parametrize("readable", [True, False], ids=["planned", "unreadable"])
async def test_a_late_status_hard_that_lands_while_the_leader_reconciles_the_quota_is_set_back_too(
    sim: SimCluster, bus: Bus, api: client.ApiClient, mirror: None, readable: bool
) -> None:
    """As ``-k after_losing_its_lease``, but A's late write of ``status.hard`` lands while B is reconciling the same
    quota (a read in flight, planned from the version before A's write, with nothing to write): the quota event
    that says so came while the quota was being reconciled, was not planned from, and nothing planned the quota
    again (80Gi checked over a 64Gi ``spec.hard`` until the namespace's next change, 6 times of 7); the same when
    B's reconciliation ends with a quota it cannot read ("quota not readable"). It is read and planned again once
    that reconciliation is done."""
    a_calls = Paused(KubeQuotas(api), writes_only=True)
    async with enforcer(bus, api, calls=a_calls) as (a, a_task):
        written = await paused_before_a_raise(sim, bus, a, a_calls)
        await publish_usage(bus, 6, terms("64Gi", "64Gi"))
        b_calls = HeldAfterRead(KubeQuotas(api)) if readable else HeldAfterUnreadableRead(KubeQuotas(api))
        async with enforcer(bus, api, calls=b_calls, service="enforcer-b") as (b, _):
            await sim.wait_for(
                lambda: b.idle() and b.usage.get(NS) is not None and b.usage[NS].seq == 6, within=20, what="B at seq 6"
            )
            assert b.patched == 0
            key = (NS, "compute")
            b_calls.hold.clear()
            b._verify.add(key)  # (B reconciles the quota, reading it: e.g. the guard's shrinks, a resync's verify)
            b._schedule(key)
            await sim.wait_for(b_calls.read.is_set, within=20, what="B read the quota (before A's write)")
            a_calls.after_resumed = a_task.cancel
            a_calls.running.set()
            with contextlib.suppress(asyncio.CancelledError):
                await a_task
            assert a_calls.writes[written:] == ["patch_quota_status"], a_calls.writes
            await sim.wait_for(
                lambda: (q := b.quotas.get(key)) is not None and bool(enforcement.status_astray(q)),
                within=20,
                what="B heard A's write",
            )
            b_calls.hold.set()
            await sim.wait_for(b.idle, within=20, what="B idle")
            await wait_quota(sim, lambda o: status_hard(o) == {"limits.memory": "64Gi"}, "status.hard set back", 5)
            assert not await tenant_pod(sim, "grab")
