"""Migration unblock latency under load: how long a live migration waits between its
VirtualMachineInstanceMigration being created and its target virt-launcher pod being admitted, when every
namespace uses its quota fully, measured at the simulator's store change feed (``sim.store.on_change``: the
commit of the VMIM, the commit of the target pod).

Setup: a simulated cluster with ``VMS`` running VMs (1 vCPU, 1 GiB) in ``NAMESPACES`` namespaces, one managed
``VirtualResources`` quota each whose budget is exactly what the VMs use plus room for a few plain pods: no target
pod fits natively. vmquota runs as in production, one process per service (watcher, ledger, enforcer) with a
nats-server, via ``devtools.demo.play.VmquotaStack``; the VMs run on ``NODES`` simulated nodes. While migrations
run (at most ``CONCURRENCY`` at a time, each from a different node, within KubeVirt's parallel-migration limits), a
churn task keeps stopping and starting other VMs and creating and deleting plain pods in the same namespaces. Two
phases of ``MIGRATIONS`` migrations each:
first offered at ``RATE`` per second whatever the system does (open loop: the figures with the target), then each
as soon as a slot is free (closed loop: the most the machine can do, and the wait at saturation, reported without
a target; see ``docs/benchmarks.md`` for why).

The simulated cluster (API server, quota admission and controllers, KubeVirt's controllers) runs in this process,
on one event loop. Once the fleet runs, this process puts what it holds out of its garbage collector's sight
(``services.platform.runner.tune_gc``, as every ``vmquota run`` process does at start): otherwise a full collection over
the fleet's objects stops the whole simulated cluster for 40-90 ms, an artefact of simulating it in one Python
process that the real API server and KubeVirt do not have.

Reported: p50/p99/max of the unblock latency at the offered load (target p99 <= 100 ms), how many quota refusals
(``FailedCreate`` events) a target pod saw before it was admitted, migrations/s and p50/p99 at saturation, and the
start-up time of the fleet.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.msg import Msg

from services.devtools.demo.play import VmquotaStack
from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.kubevirt import KubeVirtTiming
from services.devtools.simcluster.store_api import ApiError, Obj, Resource, WatchType
from services.platform import logs
from services.platform.runner import run_to_end, tune_gc
from shared import contract
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL, MODE_ANNOTATION
from shared.snapshot import MIGRATION_JOB_LABEL
from tests.benchmarks.common import Result
from tests.integration.e2e import install_guard

VMS = 1_000
NAMESPACES = 10
MIGRATIONS = 360
"""Migrations per phase (the p99 is the fifth-worst of 360)."""
RATE = 20.0
"""Offered load of the measured phase, in migrations started per second, whatever the system does (open loop).
KubeVirt's defaults let 5 migrations run in a cluster at once, 2 out of one node, and a live migration takes
seconds: a real cluster, even one draining all its nodes, completes a few migrations per second at most."""
CONCURRENCY = 4
NODES = 10
"""Simulated nodes the VMs spread over: with never two migrations from one node, enough that the node rule seldom
holds a migration of the offered load back (on 3 nodes, about half would wait for one)."""
CHURN_VMS = 50
"""VMs the churn task stops and starts (never migrated)."""
PLAIN_POD_ROOM = 2
"""Plain pods (50m CPU, 64Mi) each namespace's budget leaves room for. With at most one churn VM stopped per
namespace, the room a namespace can have (1 GiB + 128Mi) stays below a target pod's memory request (guest memory
plus overhead): no target pod is ever admitted natively, only through vmquota."""
SPEED = 0.02
"""Simulator delays x 0.02: a VM starts in a few ms, a migration's phases take ~1 ms each. KubeVirt's rate
limiter is not scaled (5 ms, doubling, and 10 retries a second overall): it races vmquota's reaction, which runs in
real time, and sets how often a target pod is refused before the raise is in ``status.hard``."""
TARGET_P99_MS = 100.0
WITHIN = 120.0


@dataclass
class Migration:
    namespace: str
    vmi: str
    created: float | None = None
    admitted: float | None = None
    refusals: int = 0
    phase: str = ""


@dataclass
class Tracker:
    """Follows the store's change feed: running VMIs, migrations, their target pods and quota refusals."""

    running: set[tuple[str, str]] = field(default_factory=set)
    migrations: dict[str, Migration] = field(default_factory=dict)
    """VMIM uid → its record."""
    pending: dict[tuple[str, str], str] = field(default_factory=dict)
    """(namespace, VMI) → uid of its migration awaiting a target pod."""
    hard_changes: dict[str, list[float]] = field(default_factory=dict)
    """namespace → when its managed quota's ``spec.hard`` changed."""
    _hard: dict[str, object] = field(default_factory=dict)

    def __call__(self, type_: WatchType, res: Resource, obj: Obj) -> None:
        now = time.perf_counter()
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace") or "", meta.get("name") or ""
        kind = res.kind
        if kind == "ResourceQuota" and type_ == "MODIFIED":
            hard = (obj.get("spec") or {}).get("hard")
            if hard != self._hard.get(ns):
                self._hard[ns] = hard
                self.hard_changes.setdefault(ns, []).append(now)
        elif kind == "VirtualMachineInstance":
            phase = (obj.get("status") or {}).get("phase")
            if type_ != "DELETED" and phase == "Running":
                self.running.add((ns, name))
            else:
                self.running.discard((ns, name))
        elif kind == "VirtualMachineInstanceMigration" and type_ != "DELETED":
            uid = meta.get("uid") or ""
            mig = self.migrations.get(uid)
            if mig is None:
                vmi = (obj.get("spec") or {}).get("vmiName") or ""
                mig = self.migrations[uid] = Migration(ns, vmi, created=now)
                self.pending[(ns, vmi)] = uid
            mig.phase = (obj.get("status") or {}).get("phase") or mig.phase
        elif kind == "Pod" and type_ == "ADDED":
            uid = (meta.get("labels") or {}).get(MIGRATION_JOB_LABEL) or ""
            mig = self.migrations.get(uid)
            if mig is not None and mig.admitted is None:
                mig.admitted = now
                self.pending.pop((mig.namespace, mig.vmi), None)
        elif (
            kind == "Event"
            and type_ in ("ADDED", "MODIFIED")
            and obj.get("reason") == "FailedCreate"
            and "exceeded quota" in str(obj.get("message") or "")
        ):
            involved = (obj.get("involvedObject") or {}).get("name") or ""
            uid = self.pending.get((ns, involved))
            if uid is not None:
                self.migrations[uid].refusals += 1


class BusTap:
    """When the VMIM events and the usage snapshots of each namespace pass on the bus (a core subscription)."""

    def __init__(self) -> None:
        self.vmim_event: dict[str, float] = {}
        """VMIM uid → when its first event was on the bus."""
        self.usage: dict[str, list[float]] = {}
        """namespace → when usage snapshots of it were on the bus."""
        self.errors: list[str] = []
        """What the tap's connection reported (a lost connection loses timestamps: the note says so)."""
        self._nc: Any = None

    async def start(self, url: str, cluster: str) -> None:
        self._nc = await nats.connect(url, error_cb=self._on_error)
        kind = contract.event_subject(cluster, "VirtualMachineInstanceMigration", "x").rsplit(".", 1)[1]
        await self._nc.subscribe(f"{contract.PREFIX}.ev.{cluster}.*.{kind}", cb=self._on_event)
        usage = contract.usage_subject(cluster, "x").rsplit(".", 1)[0]
        await self._nc.subscribe(f"{usage}.*", cb=self._on_usage)
        await self._nc.flush()

    async def _on_event(self, msg: Msg) -> None:
        ev = contract.decode_event(msg.data)
        if not isinstance(ev, contract.Sync):
            self.vmim_event.setdefault(ev.uid, time.perf_counter())

    async def _on_error(self, e: Exception) -> None:
        self.errors.append(str(e) or type(e).__name__)

    async def _on_usage(self, msg: Msg) -> None:
        self.usage.setdefault(msg.subject.rsplit(".", 1)[1], []).append(time.perf_counter())

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


def _first_after(times: list[float], t: float) -> float | None:
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None


def _stages(m: Migration, uid: str, tap: BusTap, tracker: Tracker) -> dict[str, float] | None:
    """Where one migration's wait went: VMIM commit → its event on the bus (watcher) → the namespace's next usage
    snapshot (ledger) → the quota's next ``spec.hard`` change (enforcer) → the target pod (KubeVirt's retry)."""
    if m.created is None or m.admitted is None:
        return None
    ev = tap.vmim_event.get(uid)
    usage = _first_after(tap.usage.get(m.namespace, []), ev) if ev is not None else None
    hard = _first_after(tracker.hard_changes.get(m.namespace, []), usage) if usage is not None else None
    if ev is None or usage is None or hard is None or hard > m.admitted:
        return None
    return {
        "watcher": ev - m.created,
        "ledger": usage - ev,
        "enforcer": hard - usage,
        "kubevirt retry": m.admitted - hard,
    }


def _namespace(i: int) -> str:
    return f"tenant-{i:02d}"


def _placement(vms: int, namespaces: int) -> list[tuple[str, str]]:
    return [(_namespace(i % namespaces), f"vm-{i:04d}") for i in range(vms)]


def _budget(vms_in_namespace: int) -> dict[str, str]:
    """Exactly the VMs' usage in VirtualResources terms, plus room for the plain pods."""
    return {
        "requests.cpu": f"{vms_in_namespace * 1000 + PLAIN_POD_ROOM * 50}m",
        "requests.memory": f"{vms_in_namespace * 1024 + PLAIN_POD_ROOM * 64}Mi",
        "pods": str(vms_in_namespace + PLAIN_POD_ROOM),
    }


def _plain_pod(namespace: str, name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "churn"}},
        "spec": {
            "containers": [
                {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}
            ]
        },
    }


async def _churn(sim: SimCluster, vms: list[tuple[str, str]], namespaces: int, stop: asyncio.Event) -> dict[str, int]:
    """Stop/start VMs (at most one stopped per namespace) and create/delete plain pods until ``stop``; counts of
    what it did."""
    rng = random.Random(5)
    counts = {"vm stops": 0, "vm starts": 0, "pod creates": 0, "pod refusals": 0, "pod deletes": 0}
    stopped: list[tuple[str, str]] = []
    pods: list[tuple[str, str]] = []
    n = 0
    while not stop.is_set():
        n += 1
        action = rng.random()
        try:
            idle = [v for v in vms if v[0] not in {ns for ns, _ in stopped}]  # one stopped VM per namespace at most
            if action < 0.25 and idle:
                ns, name = rng.choice(idle)
                await sim.set_running(ns, name, False)
                stopped.append((ns, name))
                counts["vm stops"] += 1
            elif action < 0.5 and stopped:
                ns, name = stopped.pop(rng.randrange(len(stopped)))
                await sim.set_running(ns, name, True)
                counts["vm starts"] += 1
            elif action < 0.8:
                ns, name = _namespace(rng.randrange(namespaces)), f"churn-{n}"
                try:
                    await sim.create(_plain_pod(ns, name))
                    pods.append((ns, name))
                    counts["pod creates"] += 1
                except ApiError:
                    counts["pod refusals"] += 1  # the namespace's plain-pod room is taken: quota says no
            elif pods:
                ns, name = pods.pop(0)
                await sim.store.delete(sim.store.resource("pods"), ns, name)
                counts["pod deletes"] += 1
        except ApiError:
            pass  # e.g. a VM being stopped while it starts: churn goes on
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.01)  # pacing of the load, not synchronisation
    for ns, name in stopped:  # leave the fleet as it was
        await sim.set_running(ns, name, True)
    return counts


@dataclass
class Phase:
    """The migrations of one phase and how they were started."""

    done: dict[str, Migration]
    """VMIM uid → its record."""
    span: float
    """Seconds from the phase's start to the last migration's end."""
    starts: list[float]
    """Seconds from the phase's start to each migration's VMIM being asked for, in order."""
    slot_waits: list[float]
    """Seconds each migration waited for a free slot (its node busy, or ``concurrency`` running)."""

    def start_rate(self) -> float:
        """Migrations started per second, first start to last."""
        first, last = min(self.starts), max(self.starts)
        return (len(self.starts) - 1) / (last - first) if last > first else float("inf")


async def _migrate_all(
    sim: SimCluster, tracker: Tracker, chosen: list[tuple[str, str]], concurrency: int, rate: float | None = None
) -> Phase:
    """Migrate each chosen VM once, at most ``concurrency`` at a time and never two from one node.

    ``rate`` (migrations per second): open loop, the i-th migration is due ``i / rate`` s after the start whatever
    the others do (one due while no slot is free waits for one: recorded). None: closed loop, each as soon as a slot
    is free: the most the system can do."""
    busy: set[str] = set()
    slots = asyncio.Condition()
    done: dict[str, Migration] = {}
    starts: list[float] = []
    waits: list[float] = []
    t0 = time.perf_counter()

    async def one(i: int, ns: str, name: str) -> None:
        if rate is not None:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))  # the load's pace, not synchronisation
        vmi = sim.peek("vmi", ns, name)
        node = str(((vmi or {}).get("status") or {}).get("nodeName") or "")
        asked = time.perf_counter()
        async with slots:
            await slots.wait_for(lambda: len(busy) < concurrency and node not in busy)
            busy.add(node)
        now = time.perf_counter()
        waits.append(now - asked)
        starts.append(now - t0)
        try:
            created = await sim.migrate(ns, name)
            uid = created["metadata"]["uid"]

            def finished() -> bool:
                m = tracker.migrations.get(uid)
                return m is not None and m.phase in ("Succeeded", "Failed")

            await sim.wait_for(finished, within=WITHIN, what=f"the migration of {ns}/{name}")
            done[uid] = tracker.migrations[uid]
        finally:
            async with slots:
                busy.discard(node)
                slots.notify_all()

    await asyncio.gather(*(one(i, ns, name) for i, (ns, name) in enumerate(chosen)))
    return Phase(done, time.perf_counter() - t0, sorted(starts), waits)


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def _causes(refused: dict[str, int], targets: int) -> str:
    """``first try 1.0, object update 1.0, backoff retry 0.4, quota update 1.2``: the simulated KubeVirt's refused
    target pods by what made it try, per target pod (the open-loop phase)."""
    order = ("first try", "object update", "backoff retry", "quota update")
    return ", ".join(f"{why} {refused.get(why, 0) / max(targets, 1):.1f}" for why in order)


def _latencies(done: dict[str, Migration]) -> list[float]:
    """Unblock latencies (ms) of the migrations that got a target pod."""
    return [
        1000.0 * (m.admitted - m.created) for m in done.values() if m.admitted is not None and m.created is not None
    ]


async def run_async(
    vms: int = VMS,
    namespaces: int = NAMESPACES,
    migrations: int = MIGRATIONS,
    concurrency: int = CONCURRENCY,
    rate: float = RATE,
    guard: bool = False,
) -> list[Result]:
    """``guard``: with the reservation guard (the shipped policy in the cluster, ``--reservation-guard``)."""
    logs.configure("warning")
    sim = SimCluster(
        speed=SPEED,
        seed=11,
        nodes=[f"node{i:02d}" for i in range(1, NODES + 1)],
        parallel_migrations=concurrency + 1,
        kubevirt_timing=KubeVirtTiming(speed=SPEED, backoff_in_real_time=True),
    )
    await sim.start()
    if guard:
        await install_guard(sim)
    tracker = Tracker()
    sim.store.on_change(tracker)
    stack = VmquotaStack(sim, "bench", separate=True, extra_args=["--reservation-guard"] if guard else [])
    tap = BusTap()
    placement = _placement(vms, namespaces)
    gc_before = gc.get_threshold()
    try:
        await stack.start()
        await tap.start(stack.nats.url, "bench")
        per_ns = {_namespace(i): sum(1 for ns, _ in placement if ns == _namespace(i)) for i in range(namespaces)}
        for ns, count in per_ns.items():
            await sim.create_namespace(ns)
            await sim.create_quota(
                ns,
                "compute",
                _budget(count),
                labels={MANAGED_LABEL: "true"},
                annotations={MODE_ANNOTATION: "VirtualResources"},
            )
        for ns in per_ns:
            await sim.wait_until(
                "resourcequotas",
                ns,
                "compute",
                lambda o: BUDGET_ANNOTATION in ((o.get("metadata") or {}).get("annotations") or {}),
                within=WITHIN,
                what=f"the enforcer to adopt quota {ns}/compute",
            )
        t0 = time.perf_counter()
        for i in range(0, len(placement), 50):
            await asyncio.gather(
                *(sim.create_vm(ns, name, memory="1Gi", sockets=1) for ns, name in placement[i : i + 50])
            )
        await sim.wait_for(lambda: len(tracker.running) >= vms, within=WITHIN * 2, what=f"{vms} VMs running")
        startup = time.perf_counter() - t0
        tune_gc()  # the simulated cluster's fleet out of its collector's sight (see above; undone below)

        rng = random.Random(3)
        order = rng.sample(placement, len(placement))
        churners, candidates = order[:CHURN_VMS], order[CHURN_VMS:]
        stop = asyncio.Event()
        churn = asyncio.create_task(_churn(sim, churners, namespaces, stop))
        paced = await _migrate_all(sim, tracker, candidates[:migrations], concurrency, rate)
        why_refused = dict(sim.kubevirt.target_refusals)  # (the paced phase's: the figure below is over it)
        saturated = await _migrate_all(sim, tracker, candidates[migrations : 2 * migrations], concurrency)
        stop.set()
        counts = await churn
    finally:
        await tap.close()
        await stack.stop()
        await sim.stop()
        gc.unfreeze()  # the benchmarks that run next in this process get the collector as it was
        gc.set_threshold(*gc_before)

    done = paced.done
    latencies = _latencies(done)
    if not latencies:
        raise AssertionError("no migration got a target pod")
    failed = sum(1 for m in done.values() if m.phase != "Succeeded")
    refusals = [m.refusals for m in done.values() if m.admitted is not None]
    stages = [st for uid, m in done.items() if (st := _stages(m, uid, tap, tracker)) is not None]
    where = ", ".join(
        f"{name} {statistics.median(1000.0 * st[name] for st in stages):.0f} ms"
        for name in (stages[0] if stages else {})
    )
    waited = [w for w in paced.slot_waits if w > 0.001]
    note = (
        f"{vms} VMs on {NODES} nodes in {namespaces} fully used namespaces; {len(done)} migrations offered at "
        f"{rate:g}/s (open loop; started at {paced.start_rate():.1f}/s, {len(waited)} waited for a slot, "
        f"{1000.0 * max(paced.slot_waits):.0f} ms at most), at most {concurrency} at a time, {failed} failed; "
        f"churn over both phases: {', '.join(f'{v} {k}' for k, v in counts.items())}"
    )
    refused_any = sum(1 for r in refusals if r)
    results = [
        Result("migration unblock p50", _percentile(latencies, 50), "ms", note=note),
        Result(
            "migration unblock p99",
            _percentile(latencies, 99),
            "ms",
            target=TARGET_P99_MS,
            higher_is_better=False,
            note=f"over the {len(latencies)} of {len(done)} migrations that got a target pod",
        ),
        Result("migration unblock max", max(latencies), "ms"),
        Result(
            "migration unblock: stage medians",
            float(len(stages)),
            "migrations",
            note=f"{where} (median of each stage over the migrations traced through every stage)"
            + (f"; the bus tap's connection reported: {'; '.join(sorted(set(tap.errors)))}" if tap.errors else ""),
        ),
        Result(
            "migration: quota refusals per target pod",
            statistics.fmean(refusals),
            "refusals",
            note=f"{refused_any} of {len(refusals)} target pods refused at least once, at most {max(refusals)}; "
            f"per target, what made KubeVirt try: {_causes(why_refused, len(refusals))}",
        ),
    ]
    at_most = _latencies(saturated.done)
    if at_most:
        sat_failed = sum(1 for m in saturated.done.values() if m.phase != "Succeeded")
        results += [
            Result(
                "migration at saturation: migrations/s",
                len(saturated.done) / saturated.span,
                "migrations/s",
                note=f"closed loop: {len(saturated.done)} more migrations ({sat_failed} failed), each as soon as "
                f"one of {concurrency} slots is free",
            ),
            Result("migration at saturation: unblock p50", _percentile(at_most, 50), "ms"),
            Result(
                "migration at saturation: unblock p99",
                _percentile(at_most, 99),
                "ms",
                note="no target: at saturation the wait is the machine's queueing (see docs/benchmarks.md)",
            ),
        ]
    results.append(
        Result("migration: fleet start-up", startup, "s", note=f"{vms} VMs created and Running, vmquota enforcing")
    )
    return results


if __name__ == "__main__":
    import sys

    args: dict[str, Any] = {}
    if len(sys.argv) > 1:
        args["vms"] = int(sys.argv[1])
    if len(sys.argv) > 2:
        args["migrations"] = int(sys.argv[2])
    if len(sys.argv) > 3:
        args["rate"] = float(sys.argv[3])
    try:
        results = run_to_end(run_async(**args))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stopped, with what the benchmark started
        sys.exit(130)
    for result in results:
        print(result.line())
