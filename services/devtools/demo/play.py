"""Play a scenario on the simulated cluster, without vmquota (plain ResourceQuotas) or with the watcher, ledger and
enforcer running against an embedded nats-server, and report what happened.

The player observes the cluster through the simulator's in-process change feed (every committed write, in
order), so timings such as a migration's unblock time are measured at the store, not polled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from services.devtools.demo.scenario import UNMANAGED, Scenario
from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.kubevirt import KubeVirtTiming
from services.devtools.simcluster.store_api import ApiError, Obj, Resource, WatchType
from shared.kinds import FINAL_PHASES, VMI_KIND
from shared.quantity import Quantity
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL, MODE_ANNOTATION, RATIO_ANNOTATION
from shared.resources import ResourceList, format_resource_list, parse_resource_list
from shared.snapshot import MIGRATION_JOB_LABEL


@dataclass
class MigrationRecord:
    vm: str
    namespace: str
    name: str = ""
    uid: str = ""
    phase: str = ""
    created: float | None = None
    admitted: float | None = None
    quota_refusals: int = 0

    @property
    def shown_phase(self) -> str:
        """The phase as a scenario states it: ``Pending`` while KubeVirt has set none, ``(no migration)`` when none
        was created (a hotplug of a stopped VM)."""
        return self.phase or ("Pending" if self.uid or self.name else "(no migration)")

    @property
    def unblock_ms(self) -> float | None:
        if self.created is None or self.admitted is None:
            return None
        return round((self.admitted - self.created) * 1000.0, 1)


@dataclass
class QuotaRecord:
    budget: ResourceList
    hard_before: ResourceList = field(default_factory=dict)
    hard_max: ResourceList = field(default_factory=dict)
    """The highest ``hard`` in effect during the steps, per resource: of ``spec.hard`` and of ``status.hard``, which
    quota admission checks (the enforcer writes it first; when its write of ``spec.hard`` then meets a newer version,
    the raise may have been in ``status.hard`` alone)."""
    hard_after: ResourceList = field(default_factory=dict)
    timeline: list[tuple[float, ResourceList]] = field(default_factory=list)


@dataclass
class RunResult:
    scenario: str
    with_vmquota: bool
    passed: bool = True
    failures: list[str] = field(default_factory=list)
    migrations: dict[str, MigrationRecord] = field(default_factory=dict)
    vms: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, QuotaRecord] = field(default_factory=dict)
    refusals: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    tenant: list[str] = field(default_factory=list)
    """What the hostile tenant of a ``tenant`` step tried, one line each (``admitted`` or ``refused``)."""
    tenant_admitted: int = 0
    judged: bool = True
    """False for a comparison run whose expectations are not checked."""
    progress: Callable[[str], None] | None = field(default=None, repr=False, compare=False)
    """Told each step line as it happens (the demo shows them while it plays)."""

    def step(self, line: str) -> None:
        self.steps.append(line)
        if self.progress is not None:
            self.progress(line)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "passed": self.passed,
            "failures": list(self.failures),
            "migrations": {
                vm: {"phase": m.shown_phase, "unblock_ms": m.unblock_ms, "quota_refusals": m.quota_refusals}
                for vm, m in sorted(self.migrations.items())
            },
            "vms": dict(sorted(self.vms.items())),
            "tenant": {"tried": len(self.tenant), "admitted": self.tenant_admitted, "attempts": list(self.tenant)},
            "quotas": {
                key: {
                    "budget": format_resource_list(q.budget),
                    "hard_before": format_resource_list(q.hard_before),
                    "hard_max": format_resource_list(q.hard_max),
                    "hard_after": format_resource_list(q.hard_after),
                }
                for key, q in sorted(self.quotas.items())
            },
        }


def _hard_of(obj: Mapping[str, Any]) -> ResourceList:
    spec = obj.get("spec") or {}
    return parse_resource_list(spec.get("hard") or {}, "spec.hard")


class Observer:
    """Follows the store's change feed: quota ``spec.hard`` over time, migrations, target pods, refusals."""

    def __init__(self, sim: SimCluster, scenario: Scenario, result: RunResult) -> None:
        self.sim = sim
        self.result = result
        self.t0 = time.monotonic()
        self.recording = False
        self.last_write = time.monotonic()
        self.slowest = 0.0
        """With vmquota, the longest time seen from KubeVirt's refusal of a pod for a VMI, or a quota of its namespace
        charging less after it, to the creation of one: vmquota's reaction on this machine, of which the quiet that
        ends a wait is a multiple (:meth:`quiet_for`)."""
        self._refused_since: dict[str, dict[str, float]] = {}
        """namespace → VMI → since when KubeVirt was refused a pod for it (or a quota of the namespace last charged
        less after that), none created since."""
        self._quota_keys = {f"{n.name}/{q.name}" for n in scenario.namespaces for q in n.quotas}
        self._by_uid: dict[str, MigrationRecord] = {}
        self._tenants: dict[str, Quantity] = {}
        """Namespace → the size of the pod its hostile tenant creates when the quota's usage drops."""
        self._used: dict[str, ResourceList] = {}
        self._sources_ended: set[str] = set()
        """Namespaces where a launcher pod (a migration's source) has turned Succeeded."""
        self.strikes: list[asyncio.Task[None]] = []

    def arm_tenant(self, namespace: str, memory: Quantity) -> None:
        self._tenants[namespace] = memory

    def strike(self, namespace: str, why: str) -> None:
        """The tenant creates its pod (once per armed namespace)."""
        memory = self._tenants.pop(namespace, None)
        if memory is not None:
            self.strikes.append(asyncio.get_running_loop().create_task(self._grab(namespace, memory, why)))

    async def _grab(self, namespace: str, memory: Quantity, why: str) -> None:
        size = memory.canonical()
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "grab", "namespace": namespace, "labels": {"app": "grab"}},
            "spec": {
                "containers": [
                    {
                        "name": "app",
                        "image": "app:1",
                        "resources": {
                            "requests": {"cpu": "100m", "memory": size},
                            "limits": {"cpu": "100m", "memory": size},
                        },
                    }
                ]
            },
        }
        try:
            await self.sim.create(pod)
        except ApiError as e:
            self.result.tenant.append(f"a {size} pod {why}: refused ({e.message.split('forbidden: ', 1)[-1]})")
            return
        self.result.tenant_admitted += 1
        self.result.tenant.append(f"a {size} pod {why}: ADMITTED")

    def quiet_for(self, settle: float) -> float:
        """How long nothing may be written for a wait to end: ``settle``, or :data:`QUIET_PER_REACTION` times the
        slowest reaction seen, if longer. On a slow or loaded machine a quiet of ``settle`` alone ended a step while
        vmquota was still at work (the raise for a refused pod not written yet), and what was read then was not the
        outcome. At most :data:`QUIET_MAX`."""
        return max(settle, min(QUIET_PER_REACTION * self.slowest, QUIET_MAX))

    def quiet(self, settle: float) -> bool:
        """Nothing was written for :meth:`quiet_for` seconds."""
        return time.monotonic() - self.last_write >= self.quiet_for(settle)

    def __call__(self, type_: WatchType, res: Resource, obj: Obj) -> None:
        now = time.monotonic()
        self.last_write = now
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace") or "", meta.get("name") or ""
        kind = res.kind
        if kind == "ResourceQuota" and f"{ns}/{name}" in self._quota_keys and type_ != "DELETED":
            rec = self.result.quotas.get(f"{ns}/{name}")
            if rec is not None:
                hard = _hard_of(obj)
                if not rec.timeline or rec.timeline[-1][1] != hard:
                    rec.timeline.append((now - self.t0, hard))
                if self.recording:
                    in_status = (obj.get("status") or {}).get("hard") or {}
                    for r, q in [*hard.items(), *parse_resource_list(in_status, "status.hard").items()]:
                        if r not in rec.hard_max or q > rec.hard_max[r]:
                            rec.hard_max[r] = q
            used = parse_resource_list(((obj.get("status") or {}).get("used")) or {}, "status.used")
            before = self._used.get(ns)
            self._used[ns] = used
            dropped = before is not None and any(q < before.get(r, q) for r, q in used.items())
            waiting = self._refused_since.get(ns)
            if waiting and dropped:
                # (room freed: the time a VM waits for a later step to free its room is not a reaction, the one from
                # that step on is)
                self._refused_since[ns] = dict.fromkeys(waiting, now)
            if ns in self._tenants and ns in self._sources_ended and dropped:
                self.strike(ns, "the moment the quota stopped charging the migration's source pod")
        elif kind == "VirtualMachineInstanceMigration" and type_ != "DELETED":
            uid = meta.get("uid") or ""
            mig = self._by_uid.get(uid)
            if mig is None:
                vmi = (obj.get("spec") or {}).get("vmiName") or ""
                mig = self.result.migrations.get(vmi)
                if mig is None or (mig.uid and mig.uid != uid):
                    return
                mig.uid, mig.name, mig.created = uid, name, now
                self._by_uid[uid] = mig
            mig.phase = (obj.get("status") or {}).get("phase") or mig.phase
        elif kind == "Pod" and (obj.get("status") or {}).get("phase") == "Succeeded":
            if (meta.get("labels") or {}).get("kubevirt.io") == "virt-launcher":
                self._sources_ended.add(ns)
        elif kind == "Pod" and type_ == "ADDED":
            owner: Obj = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == VMI_KIND), {})
            since = self._refused_since.get(ns, {}).pop(str(owner.get("name") or ""), None)
            if since is not None and self.result.with_vmquota:
                self.slowest = max(self.slowest, now - since)
            uid = (meta.get("labels") or {}).get(MIGRATION_JOB_LABEL)
            mig = self._by_uid.get(uid or "")
            if mig is not None and mig.admitted is None:
                mig.admitted = now
        elif kind == "Event" and type_ in ("ADDED", "MODIFIED"):
            message = str(obj.get("message") or "")
            if obj.get("reason") == "FailedCreate" and "exceeded quota" in message:
                involved = (obj.get("involvedObject") or {}).get("name") or ""
                self.result.refusals.append(f"{ns}/{involved}: {message}")
                self._refused_since.setdefault(ns, {}).setdefault(involved, now)
                mig = self.result.migrations.get(involved)
                if mig is not None and mig.uid and mig.admitted is None and mig.phase not in FINAL_PHASES:
                    mig.quota_refusals += 1


QUIET_PER_REACTION: Final = 3.0
"""The quiet that ends a wait, in multiples of the slowest reaction seen (:meth:`Observer.quiet_for`)."""

QUIET_MAX: Final = 10.0
"""The longest quiet that ends a wait (seconds): a machine slower than that is told by the outcome, not waited for."""

STARTUP_QUIET: Final = 2.0
"""The least quiet (seconds, real time) that ends the wait for a scenario's VMs to start without all of them
running: a VM that stays refused ends it so."""


async def _settle(sim: SimCluster, observer: Observer, done: Any, *, settle: float, within: float) -> bool:
    """Wait until ``done()`` holds, or the cluster is quiet and nothing was written for ``settle`` seconds, or longer
    on a machine where vmquota was seen to react slower (:meth:`Observer.quiet_for`): the outcome is then final, e.g.
    a migration that quota keeps refusing. False when ``within`` passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if done():
            return True
        if sim.idle() and observer.quiet(settle):
            return True
        with contextlib.suppress(TimeoutError):
            await sim.wait_for(done, within=min(0.05, max(0.0, deadline - loop.time())), what="scenario step")
    return done() is True


def _vm_state(sim: SimCluster, ns: str, name: str, refused: set[str]) -> str:
    vmi = sim.store.peek(sim.store.resource("virtualmachineinstances"), ns, name)
    vm = sim.store.peek(sim.store.resource("virtualmachines"), ns, name)
    spec = (vm or {}).get("spec") or {}
    wants_running = spec.get("running") is True or spec.get("runStrategy") in ("Always", "RerunOnFailure", "Once")
    if vmi is not None and ((vmi.get("status") or {}).get("phase") == "Running"):
        return "Running"
    if not wants_running:
        return "Stopped"
    if f"{ns}/{name}" in refused:
        return "Refused"
    return "Pending"


def _refused_names(result: RunResult) -> set[str]:
    return {r.split(":", 1)[0] for r in result.refusals}


SERVICE_NAMES = ("watcher", "ledger", "enforcer")


class VmquotaStack:
    """The embedded nats-server plus the watcher, ledger and enforcer: ``vmquota run all`` in this process, or
    (``separate``) each service as its own ``vmquota run <service>`` process, so that a test can stop, kill
    (SIGKILL: no graceful stop, nothing flushed) and restart each on its own."""

    def __init__(
        self,
        sim: SimCluster,
        cluster: str = "demo",
        *,
        separate: bool = False,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        nats_port: int | None = None,
        nats: Any = None,
        nats_ends_with_us: bool = False,
    ) -> None:
        """``nats_port``: the embedded nats-server's port on 127.0.0.1 (default: a free one). ``nats``: a bus
        started elsewhere (anything with a ``url``, e.g. a cluster's comma-separated URLs) used instead of an
        embedded server, and left running on stop. ``nats_ends_with_us``: the embedded server is stopped when
        this thread ends, even by SIGKILL (see :class:`~services.devtools.natsserver.NatsServer`)."""
        self.sim = sim
        self.nats_port = nats_port
        self.extra_args = tuple(extra_args)
        """More ``vmquota run`` flags for every service (e.g. ``--reservation-guard``)."""
        self.cluster = cluster
        self.separate = separate
        self.log_level = log_level
        self._nats: Any = nats
        self._own_nats = nats is None
        self._nats_ends_with_us = nats_ends_with_us
        self._task: asyncio.Task[int] | None = None
        self._stop = asyncio.Event()
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.starts: dict[str, int] = {}
        """How many times each service was started."""

    @property
    def nats(self) -> Any:
        """The :class:`~services.devtools.natsserver.NatsServer` (``restart()`` it for a server restart)."""
        assert self._nats is not None, "not started"
        return self._nats

    def _argv(self, service: str, http_port: int) -> list[str]:
        return [
            service,
            "--cluster",
            self.cluster,
            "--nats",
            self.nats.url,
            "--kubeconfig",
            str(self.sim.kubeconfig_path),
            "--http-port",
            str(http_port),
            "--no-leader-election",
            "--log-level",
            self.log_level,
            "--identity",
            f"{service}-{self.starts.get(service, 0)}",
            *self.extra_args,
        ]

    async def start(self) -> None:
        from services.devtools.natsserver import NatsServer

        if self._own_nats:
            self._nats = NatsServer(port=self.nats_port, ends_with_starter=self._nats_ends_with_us).start()
        if self.separate:
            await asyncio.gather(*(self.start_service(name) for name in SERVICE_NAMES))
            return
        from services.platform import runner
        from services.platform.config import config_from_args

        p = argparse.ArgumentParser()
        runner.add_arguments(p)
        config = config_from_args(p.parse_args(self._argv("all", 0)))
        ready = asyncio.Event()
        self._task = asyncio.create_task(runner.serve(config, ready=lambda _port: ready.set(), stop=self._stop))
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiter.cancel()
            raise RuntimeError(f"vmquota services stopped during start-up (status {self._task.result()})")

    def running(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.returncode is None

    async def start_service(self, name: str, *, within: float = 60.0) -> None:
        """Start ``vmquota run <name>`` (separate mode) and wait until its ``/readyz`` answers 200."""
        import aiohttp

        if not self.separate or name not in SERVICE_NAMES:
            raise ValueError(f"start_service needs separate=True and one of {', '.join(SERVICE_NAMES)}, not {name!r}")
        if self.running(name):
            raise RuntimeError(f"{name} is already running")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        cmd = [sys.executable, "-m", "services.cli.main", "run", *self._argv(name, port)]
        with (Path(self.nats.workdir) / f"{name}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL
            )
        self._procs[name] = proc
        self.starts[name] = self.starts.get(name, 0) + 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with aiohttp.ClientSession() as session:
            while True:
                if proc.returncode is not None:
                    tail = self._log_tail(name)
                    raise RuntimeError(f"vmquota run {name} exited with {proc.returncode} during start-up:\n{tail}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as resp:
                        if resp.status == 200:
                            return
                if loop.time() > deadline:
                    raise TimeoutError(f"vmquota run {name} not ready after {within}s")
                await asyncio.sleep(0.05)  # polling an HTTP endpoint of another process: nothing to wait on

    def _log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a service process's log (what it said before it exited)."""
        try:
            text = (Path(self.nats.workdir) / f"{name}.log").read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e.strerror})"
        return "\n".join(text.splitlines()[-lines:])

    async def stop_service(self, name: str, *, kill: bool = False) -> int | None:
        """Stop one service process: SIGTERM (graceful stop) or ``kill`` (SIGKILL). Returns its exit status."""
        proc = self._procs.pop(name, None)
        if proc is None:
            return None
        if proc.returncode is None:
            if kill:
                proc.kill()
            else:
                proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            return await proc.wait()

    async def stop(self) -> None:
        """Stop the services gracefully, then the nats-server it started. Whatever breaks the stop (a second Ctrl-C,
        a cancellation), the services not asked to stop yet are killed and the nats-server is stopped: it runs in a
        session of its own, and would outlive this process."""
        try:
            for name in list(self._procs):
                with contextlib.suppress(Exception):
                    await self.stop_service(name)
            self._stop.set()
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, timeout=20)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Kill the services' processes not stopped yet and stop the nats-server it started (synchronous: what a
        stop that is given up still does)."""
        for proc in self._procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        if self._nats is not None and self._own_nats:
            self._nats.close()


async def play(
    scenario: Scenario,
    *,
    with_vmquota: bool,
    speed: float = 0.05,
    settle: float = 1.0,
    within: float = 30.0,
    progress: Callable[[str], None] | None = None,
    real_time_backoff: bool = False,
) -> RunResult:
    """Run ``scenario`` once and check its expectations (when ``with_vmquota``, or when asked for the plain run).
    ``progress`` is told what happens as it happens: the start-up and every step line of the result.
    ``real_time_backoff``: KubeVirt retries refused pods at its own 5 ms backoff, not scaled by ``speed`` (for counts of
    refused tries)."""
    result = RunResult(scenario=scenario.name, with_vmquota=with_vmquota, progress=progress)
    if progress is not None:
        progress("starting the simulated cluster" + (", nats-server and the services" if with_vmquota else ""))
    timing = KubeVirtTiming(speed=speed, backoff_in_real_time=real_time_backoff)
    if scenario.migration_step_seconds is not None:
        timing = replace(timing, migration_step=scenario.migration_step_seconds / speed)
    sim = SimCluster(
        speed=speed,
        kubevirt_version=scenario.kubevirt_version,
        developer_configuration={"cpuAllocationRatio": float(scenario.cpu_allocation_ratio)},
        kubevirt_timing=timing,
    )
    await sim.start()
    observer = Observer(sim, scenario, result)
    sim.store.on_change(observer)
    stack = VmquotaStack(sim) if with_vmquota else None
    try:
        if stack is not None:
            await stack.start()
        for ns in scenario.namespaces:
            await sim.create_namespace(ns.name, ns.labels)
            for q in ns.quotas:
                result.quotas[f"{ns.name}/{q.name}"] = QuotaRecord(budget=dict(q.hard))
                labels: dict[str, str] = {}
                annotations: dict[str, str] = {}
                if with_vmquota and q.mode != UNMANAGED:
                    labels[MANAGED_LABEL] = "true"
                    annotations[MODE_ANNOTATION] = q.mode
                    if q.cpu_allocation_ratio is not None:
                        annotations[RATIO_ANNOTATION] = str(q.cpu_allocation_ratio)
                await sim.create_quota(
                    ns.name, q.name, format_resource_list(q.hard), labels=labels, annotations=annotations
                )
                await sim.wait_quota_synced(ns.name, q.name)
        if stack is not None:
            await _wait_adopted(sim, scenario, within=within)
        if progress is not None:
            progress(f"creating {len(scenario.vms)} VM(s): {', '.join(v.name for v in scenario.vms)}")
        for vm in scenario.vms:
            await sim.create(vm.manifest())
        initial = [v for v in scenario.vms if v.running]

        def all_started() -> bool:
            # Only Running ends the wait early: a first refusal can be transient (with vmquota the enforcer raises
            # hard moments later); a VM that stays refused ends it through the quiet rule of _settle.
            return all(_vm_state(sim, v.namespace, v.name, set()) == "Running" for v in initial)

        def steady() -> bool:
            return sim.idle() and observer.quiet(settle)

        # (quiet for longer: a VM refused for a moment starts once vmquota reacts, which on a loaded machine may
        # take longer than a step's quiet; the steps then ran with a VM missing, a migration needed no raise)
        await _settle(sim, observer, all_started, settle=max(settle, STARTUP_QUIET), within=within)
        refused = _refused_names(result)
        started = [v.name for v in initial if _vm_state(sim, v.namespace, v.name, refused) == "Running"]
        result.step(f"started {len(started)} of {len(initial)} VMs: {', '.join(started) or 'none'}")
        # (vmquota takes back the room it reserved for the launcher pods once they exist: hard before the steps is
        # the one at rest)
        await _settle(sim, observer, steady, settle=settle, within=within)
        for key, rec in result.quotas.items():
            qns, qname = key.split("/", 1)
            rec.hard_before = _hard_of(await sim.get("resourcequotas", qns, qname))
            rec.hard_max = dict(rec.hard_before)
        observer.recording = True

        for step in scenario.steps:
            await _run_step(sim, observer, scenario, step, result, settle=settle, within=within)

        # Let the pipeline catch up with the last step (source pods going away, hard coming back).
        await _settle(sim, observer, steady, settle=settle, within=within)
        for ns in scenario.namespaces:  # a tenant whose moment never came tries once at the end
            observer.strike(ns.name, "at the end (no migration's source pod ended)")
        await asyncio.gather(*observer.strikes)
        refused = _refused_names(result)
        for vm in scenario.vms:
            result.vms[vm.name] = _vm_state(sim, vm.namespace, vm.name, refused)
        for key, rec in result.quotas.items():
            qns, qname = key.split("/", 1)
            rec.hard_after = _hard_of(await sim.get("resourcequotas", qns, qname))
    finally:
        if stack is not None:
            await stack.stop()
        await sim.stop()
    _check(scenario, result)
    return result


async def _wait_adopted(sim: SimCluster, scenario: Scenario, *, within: float) -> None:
    """Until the enforcer has adopted every managed quota (the budget annotation is on it)."""
    for ns in scenario.namespaces:
        for q in ns.quotas:
            if q.mode == UNMANAGED:
                continue
            await sim.wait_until(
                "resourcequotas",
                ns.name,
                q.name,
                lambda o: BUDGET_ANNOTATION in ((o.get("metadata") or {}).get("annotations") or {}),
                within=within,
                what=f"the enforcer to adopt quota {ns.name}/{q.name}",
            )


async def _run_step(
    sim: SimCluster,
    observer: Observer,
    scenario: Scenario,
    step: Any,
    result: RunResult,
    *,
    settle: float,
    within: float,
) -> None:
    result.step(step.describe())
    vms = [scenario.vm(n) for n in step.vms]
    if step.action == "migrate":
        for vm in vms:
            result.migrations[vm.name] = MigrationRecord(vm=vm.name, namespace=vm.namespace)
        outcomes = await asyncio.gather(*(sim.migrate(vm.namespace, vm.name) for vm in vms), return_exceptions=True)
        for vm, outcome in zip(vms, outcomes, strict=True):
            if isinstance(outcome, ApiError):
                result.migrations[vm.name].phase = "Rejected"
                result.step(f"  the API server refused the migration of {vm.name}: {outcome.message}")
            elif isinstance(outcome, BaseException):
                raise outcome
        records = [m for m in (result.migrations[vm.name] for vm in vms) if m.phase != "Rejected"]
        await _settle(
            sim, observer, lambda: all(m.phase in FINAL_PHASES for m in records), settle=settle, within=within
        )
    elif step.action in ("start", "stop"):
        running = step.action == "start"
        for vm in vms:
            await sim.set_running(vm.namespace, vm.name, running)

        def reached() -> bool:
            states = [_vm_state(sim, vm.namespace, vm.name, set()) for vm in vms]
            return all(s == "Running" for s in states) if running else all(s == "Stopped" for s in states)

        await _settle(sim, observer, reached, settle=settle, within=within)
    elif step.action == "tenant":
        assert step.memory is not None
        observer.arm_tenant(step.namespace, step.memory)
    elif step.action == "hotplug":
        vm = vms[0]
        record = MigrationRecord(vm=vm.name, namespace=vm.namespace)
        result.migrations[vm.name] = record  # the workload-update migration KubeVirt starts for the hotplug
        await sim.hotplug(
            vm.namespace,
            vm.name,
            sockets=step.sockets,
            memory=step.memory.canonical() if isinstance(step.memory, Quantity) else None,
        )
        await _settle(sim, observer, lambda: record.phase in FINAL_PHASES, settle=settle, within=within)


def _check(scenario: Scenario, result: RunResult) -> None:
    ex = scenario.expect
    for vm, want in ex.migrations.items():
        got = result.migrations[vm].shown_phase if vm in result.migrations else "(no migration)"
        if got != want:
            result.failures.append(f"migration of {vm}: expected {want}, got {got}")
    for vm, want in ex.vms.items():
        got = result.vms.get(vm, "(unknown)")
        if got != want:
            result.failures.append(f"VM {vm}: expected {want}, got {got}")
    if ex.tenant_admitted is not None and result.tenant_admitted > ex.tenant_admitted:
        result.failures.append(
            f"the hostile tenant got {result.tenant_admitted} pod(s) in, expected at most {ex.tenant_admitted}"
        )
    for key, want_hard in ex.hard_after.items():
        got_hard = result.quotas[key].hard_after
        for r, q in want_hard.items():
            if got_hard.get(r) != q:
                shown = got_hard[r].canonical() if r in got_hard else "(absent)"
                result.failures.append(f"quota {key} {r}: expected {q.canonical()} after the steps, got {shown}")
    result.passed = not result.failures


def dumps(results: list[RunResult]) -> str:
    if len(results) == 1:
        return json.dumps(results[0].to_json(), indent=2)
    return json.dumps([r.to_json() for r in results], indent=2)
