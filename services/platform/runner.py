"""``vmquota run watcher|ledger|enforcer|all``: the service shell.

Flags (each also from an environment variable, flag wins) are the contract the deploy manifests are written from;
``docs/services.md`` lists them. The shell configures structlog JSON logs, serves ``/healthz``, ``/readyz`` and
``/metrics`` on ``--http-port``, turns SIGTERM/SIGINT into a graceful stop, and runs the selected service(s).

A service registers here with one line in :data:`SERVICES`: its name → ``"module:function"``, an
``async def main(rt: Runtime) -> None`` that returns when ``rt.stop`` is set. :func:`leader_elected` runs a
service's work only while this process holds the service's Lease (watchers and enforcers: one active per cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib
import os
import signal
import socket
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from services.platform import logs
from shared import contract, guard
from shared.enforcement import DEFAULT_EXCLUDED_NAMESPACES
from shared.errors import InvalidInput
from shared.ledger import PartitionSet

if TYPE_CHECKING:  # the clients are imported when a service runs, not when the CLI builds its parser
    from aiohttp import web
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from services.platform.bus import NatsOptions
    from services.platform.lease import LeaseTiming


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    main: str
    """``module:function`` of ``async def main(rt: Runtime) -> None``."""
    needs_cluster: bool = False
    """``--cluster`` is required (it watches or writes one cluster)."""


# The registry: adding a service is one line here.
SERVICES: dict[str, ServiceSpec] = {
    "ledger": ServiceSpec("services.ledger.main:main"),
    "enforcer": ServiceSpec("services.enforcer.main:main", needs_cluster=True),
    "watcher": ServiceSpec("services.watcher.main:main", needs_cluster=True),
}
PLANNED = ("watcher", "ledger", "enforcer")
"""Services ``all`` stands for (those registered run; the others are reported as not in this build)."""


@dataclass(frozen=True, slots=True)
class Config:
    service: str
    cluster: str | None
    nats: NatsOptions
    kubeconfig: str | None
    http_port: int
    log_level: str
    partitions: PartitionSet
    events_max_age: float
    """Seconds."""
    dry_run: bool
    leader_election: bool
    lease_namespace: str
    identity: str
    usage_history_max_age: float = 7 * contract.DAY
    """Seconds (the ledger's usage history stream)."""
    reservation_guard: bool = False
    """Enforcer: write each namespace's QuotaReservation before a raise (``deploy/components/reservation-guard``)."""
    guard_creators: tuple[str, ...] = (guard.DEFAULT_CREATOR,)
    exclude_namespaces: tuple[str, ...] = DEFAULT_EXCLUDED_NAMESPACES
    """Enforcer: namespaces (shell-style patterns) whose quotas are never written."""
    resync_interval: float = 60.0
    """Enforcer: seconds between two reads of the managed quotas from the API server (0: never)."""


class Metrics:
    """The Prometheus metrics of every service, in one registry per process, labelled by service; with the
    process's own (``process_*``: CPU, memory, open files; ``python_*``: version, garbage collections) on a registry
    this class creates."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            GCCollector,
            Histogram,
            PlatformCollector,
            ProcessCollector,
        )

        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry = registry
        r = self.registry
        self.events_in = Counter("vmquota_events_in", "Messages consumed from the bus", ["service"], registry=r)
        self.events_out = Counter("vmquota_events_out", "Messages published to the bus", ["service"], registry=r)
        self.lag = Gauge(
            "vmquota_consumer_lag", "Messages left in the stream for this consumer", ["service"], registry=r
        )
        self.fold_seconds = Histogram(
            "vmquota_fold_seconds",
            "Time to apply one fetched batch of events",
            ["service"],
            registry=r,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
        )
        self.reconnects = Counter("vmquota_nats_reconnects", "Reconnections to NATS", ["service"], registry=r)
        self.dlq = Counter("vmquota_dlq", "Messages sent to the dead-letter subject", ["service"], registry=r)
        self.applied_seq = Gauge("vmquota_applied_sequence", "Last stream sequence applied", ["service"], registry=r)

    def declare(self, service: str) -> None:
        """Export ``service``'s dead letters and reconnections at 0 from the start: ``increase()`` (the alerts') does
        not count the first step of a series that appears only with it."""
        self.dlq.labels(service=service)
        self.reconnects.labels(service=service)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        out: bytes = generate_latest(self.registry)
        return out


M = TypeVar("M", bound="MetricWrapperBase")


class ServiceLabelled(Generic[M]):
    """A metric family whose first label is ``service``, with that label bound: ``labels()`` takes the others (by
    position or by name), so that every series of a service carries its name."""

    __slots__ = ("family", "service")

    def __init__(self, family: M, service: str) -> None:
        if not family._labelnames or family._labelnames[0] != "service":
            raise ValueError(f"{family._name}: the first label must be service, not {family._labelnames}")
        self.family = family
        self.service = service

    def labels(self, *values: str, **named: str) -> M:
        if values:
            return self.family.labels(self.service, *values)
        return self.family.labels(service=self.service, **named)


class Health:
    """Liveness and readiness of the process: each service marks its components ready or not."""

    def __init__(self) -> None:
        self._ready: dict[str, bool] = {}
        self.failed: str | None = None

    def set_ready(self, component: str, ready: bool) -> None:
        self._ready[component] = ready

    def expect(self, component: str) -> None:
        self._ready.setdefault(component, False)

    @property
    def ready(self) -> bool:
        return self.failed is None and bool(self._ready) and all(self._ready.values())

    def status(self) -> dict[str, Any]:
        return {"ready": self.ready, "components": dict(sorted(self._ready.items())), "failed": self.failed}


@dataclass
class Runtime:
    """What a service's ``main`` gets: its configuration, metrics, health, and the stop signal."""

    name: str
    config: Config
    metrics: Metrics
    health: Health
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.metrics.declare(self.name)

    def log(self, **context: Any) -> Any:
        return logs.get_logger(service=self.name, **context)

    def nats_options(self) -> NatsOptions:
        """The connection options of this service: the configured ones, named after the service."""
        return dataclasses.replace(self.config.nats, name=f"vmquota-{self.name}")


ServiceMain = Callable[[Runtime], Coroutine[Any, Any, None]]


def resolve(name: str) -> ServiceMain:
    """Import a registered service's main."""
    module, _, func = SERVICES[name].main.partition(":")
    fn: ServiceMain = getattr(importlib.import_module(module), func)
    return fn


# ---- flags ------------------------------------------------------------------------------------------------------


def env(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, or ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_bool(name: str, default: bool) -> bool:
    raw = env(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise InvalidInput(f"{raw!r} is not a boolean (true/false)", name)


SIZE_FLAGS: dict[str, str] = {
    "events": "the events stream",
    "usage": "the usage stream",
    "usage_history": "the usage history stream",
    "decisions": "the decisions stream",
    "dlq": "the dead-letter stream",
    "checkpoints": "the ledger's checkpoint bucket",
}
"""``--<name>-max-bytes``: the fields of :class:`shared.contract.StreamSizes`."""


def _size_text(n: int) -> str:
    for unit, size in (("Gi", 2**30), ("Mi", 2**20)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", metavar="SERVICE", help=f"the service to run: {', '.join(PLANNED)} or all")
    p.add_argument("--cluster", default=env("VMQUOTA_CLUSTER"), help="cluster id, a DNS label [VMQUOTA_CLUSTER]")
    p.add_argument(
        "--nats",
        default=env("VMQUOTA_NATS", "nats://127.0.0.1:4222"),
        help="NATS URL, or a comma-separated list of a cluster's [VMQUOTA_NATS]",
    )
    p.add_argument("--nats-creds", default=env("VMQUOTA_NATS_CREDS"), help="NATS .creds file [VMQUOTA_NATS_CREDS]")
    p.add_argument("--nats-user", default=env("VMQUOTA_NATS_USER"), help="NATS user [VMQUOTA_NATS_USER]")
    p.add_argument(
        "--nats-password", default=env("VMQUOTA_NATS_PASSWORD"), help="NATS password [VMQUOTA_NATS_PASSWORD]"
    )
    p.add_argument(
        "--nats-ca",
        default=env("VMQUOTA_NATS_CA"),
        help="CA bundle (PEM) of the NATS server's certificate, for tls:// URLs; default: the system's CAs "
        "[VMQUOTA_NATS_CA]",
    )
    p.add_argument(
        "--nats-consumer-check",
        default=env("VMQUOTA_NATS_CONSUMER_CHECK", "30s"),
        help="how often each service checks that its durable consumers are as it created them, and re-creates "
        "one another client changed [VMQUOTA_NATS_CONSUMER_CHECK, 30s]",
    )
    p.add_argument(
        "--kubeconfig",
        default=env("VMQUOTA_KUBECONFIG"),
        help="kubeconfig file; default: the in-cluster service account [VMQUOTA_KUBECONFIG]",
    )
    p.add_argument(
        "--http-port",
        default=env("VMQUOTA_HTTP_PORT", "8080"),
        help="port of /healthz, /readyz and /metrics; 0 picks a free one [VMQUOTA_HTTP_PORT, 8080]",
    )
    p.add_argument("--log-level", default=env("VMQUOTA_LOG_LEVEL", "info"), help="[VMQUOTA_LOG_LEVEL, info]")
    p.add_argument(
        "--partitions",
        default=env("VMQUOTA_PARTITIONS", "16"),
        help="number of namespace partitions of the ledger [VMQUOTA_PARTITIONS, 16]",
    )
    p.add_argument(
        "--owned-partitions",
        default=env("VMQUOTA_OWNED_PARTITIONS", "all"),
        help="partitions this ledger instance folds, e.g. 0-7 or 0,2,4-5 [VMQUOTA_OWNED_PARTITIONS, all]",
    )
    p.add_argument(
        "--events-max-age",
        default=env("VMQUOTA_EVENTS_MAX_AGE", "30d"),
        help="how long the events stream keeps events, e.g. 30d, 12h [VMQUOTA_EVENTS_MAX_AGE, 30d]",
    )
    p.add_argument(
        "--stream-replicas",
        default=env("VMQUOTA_STREAM_REPLICAS", "1"),
        help="servers of a JetStream cluster that keep each stream and the bucket; 3 for a 3-node cluster "
        "[VMQUOTA_STREAM_REPLICAS, 1]",
    )
    p.add_argument(
        "--usage-history-max-age",
        default=env("VMQUOTA_USAGE_HISTORY_MAX_AGE", "7d"),
        help="ledger: how long the usage history stream keeps every snapshot [VMQUOTA_USAGE_HISTORY_MAX_AGE, 7d]",
    )
    defaults = contract.StreamSizes()
    for name, what in SIZE_FLAGS.items():
        var = f"VMQUOTA_{name.upper()}_MAX_BYTES"
        default = _size_text(getattr(defaults, name))
        p.add_argument(
            f"--{name.replace('_', '-')}-max-bytes",
            default=env(var, default),
            help=f"the most {what} keeps, e.g. 4Gi, 512Mi [{var}, {default}]",
        )
    p.add_argument(
        "--dry-run",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enforcer: compute and report, never patch [VMQUOTA_DRY_RUN, false]",
    )
    p.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one active watcher/enforcer per cluster through a Lease [VMQUOTA_LEADER_ELECTION, true]",
    )
    p.add_argument(
        "--lease-namespace",
        default=env("VMQUOTA_LEASE_NAMESPACE", "vmquota-system"),
        help="namespace of the Leases [VMQUOTA_LEASE_NAMESPACE, vmquota-system]",
    )
    p.add_argument(
        "--identity",
        default=env("VMQUOTA_IDENTITY"),
        help="this process's identity in Leases [VMQUOTA_IDENTITY, the host name]",
    )
    p.add_argument(
        "--reservation-guard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enforcer: write the QuotaReservation the reservation-guard policy reads before every raise "
        "(needs deploy/components/reservation-guard) [VMQUOTA_RESERVATION_GUARD, false]",
    )
    p.add_argument(
        "--guard-creators",
        default=env("VMQUOTA_GUARD_CREATORS", guard.DEFAULT_CREATOR),
        help="enforcer: comma-separated users that create launcher pods (KubeVirt's virt-controller) "
        f"[VMQUOTA_GUARD_CREATORS, {guard.DEFAULT_CREATOR}]",
    )
    p.add_argument(
        "--exclude-namespaces",
        default=env("VMQUOTA_EXCLUDE_NAMESPACES", ",".join(DEFAULT_EXCLUDED_NAMESPACES)),
        help="enforcer: comma-separated namespaces (shell patterns) whose quotas are never written "
        f"[VMQUOTA_EXCLUDE_NAMESPACES, {','.join(DEFAULT_EXCLUDED_NAMESPACES)}]",
    )
    p.add_argument(
        "--resync-interval",
        default=env("VMQUOTA_RESYNC_INTERVAL", "60s"),
        help="enforcer: how often the managed quotas are read from the API server, whose versions then replace "
        "the quota events' (0 never) [VMQUOTA_RESYNC_INTERVAL, 60s]",
    )


def _int(raw: object, where: str) -> int:
    try:
        return int(str(raw).strip())
    except ValueError:
        raise InvalidInput(f"{raw!r} is not a whole number", where) from None


def service_names(service: str) -> list[str]:
    """The services ``vmquota run SERVICE`` runs: the one named, or for ``all`` every one this build has."""
    return [n for n in PLANNED if n in SERVICES] if service == "all" else [service]


def config_from_args(args: argparse.Namespace) -> Config:
    """Validate the flags; :class:`InvalidInput` names the flag."""
    service = args.service
    if service != "all" and service not in SERVICES:
        if service in PLANNED:
            raise InvalidInput(f"service {service!r} is not available in this build yet", "SERVICE")
        raise InvalidInput(f"unknown service {service!r} (expected one of {', '.join(PLANNED)}, all)", "SERVICE")
    names = service_names(service)
    cluster = args.cluster
    if cluster is None and any(SERVICES[n].needs_cluster for n in names):
        raise InvalidInput(f"--cluster (VMQUOTA_CLUSTER) is required for {service}", "--cluster")
    if cluster is not None:
        try:
            contract.check_cluster(cluster)
        except InvalidInput as e:
            raise InvalidInput(e.message, "--cluster") from None
    http_port = _int(args.http_port, "--http-port (VMQUOTA_HTTP_PORT)")
    if http_port < 0 or http_port > 65535:
        raise InvalidInput(f"{http_port} is not a port number", "--http-port (VMQUOTA_HTTP_PORT)")
    total = _int(args.partitions, "--partitions (VMQUOTA_PARTITIONS)")
    try:
        partitions = PartitionSet.parse(args.owned_partitions, total)
    except InvalidInput as e:
        flag = "--partitions" if e.where == "partitions" else "--owned-partitions"
        raise InvalidInput(e.message, flag) from None
    from services.platform.bus import NatsOptions

    max_age = contract.parse_duration(args.events_max_age, "--events-max-age")
    history_age = contract.parse_duration(args.usage_history_max_age, "--usage-history-max-age")
    sizes = contract.StreamSizes(
        **{
            name: contract.parse_size(getattr(args, f"{name}_max_bytes"), f"--{name.replace('_', '-')}-max-bytes")
            for name in SIZE_FLAGS
        }
    )
    replicas = _int(args.stream_replicas, "--stream-replicas (VMQUOTA_STREAM_REPLICAS)")
    if not 1 <= replicas <= 5:
        raise InvalidInput(f"must be 1 to 5 (JetStream's limit), got {replicas}", "--stream-replicas")
    consumer_check = contract.parse_duration(args.nats_consumer_check, "--nats-consumer-check")
    if consumer_check <= 0:
        raise InvalidInput("the consumer check interval must be positive", "--nats-consumer-check")
    if args.nats_user and args.nats_creds:
        raise InvalidInput("give either --nats-creds or --nats-user/--nats-password, not both", "--nats-creds")
    dry_run = args.dry_run if args.dry_run is not None else _env_bool("VMQUOTA_DRY_RUN", False)
    leader = args.leader_election if args.leader_election is not None else _env_bool("VMQUOTA_LEADER_ELECTION", True)
    guard = (
        args.reservation_guard if args.reservation_guard is not None else _env_bool("VMQUOTA_RESERVATION_GUARD", False)
    )
    creators = tuple(c.strip() for c in str(args.guard_creators).split(",") if c.strip())
    if guard and not creators:
        raise InvalidInput("--guard-creators (VMQUOTA_GUARD_CREATORS) names nobody", "--guard-creators")
    excluded = tuple(n.strip() for n in str(args.exclude_namespaces).split(",") if n.strip())
    resync = contract.parse_duration(args.resync_interval, "--resync-interval (VMQUOTA_RESYNC_INTERVAL)")
    return Config(
        service=service,
        cluster=cluster,
        nats=NatsOptions(
            url=args.nats,
            creds=args.nats_creds,
            user=args.nats_user,
            password=args.nats_password,
            ca=args.nats_ca,
            consumer_check=consumer_check,
            stream_sizes=sizes,
            stream_replicas=replicas,
        ),
        kubeconfig=args.kubeconfig,
        http_port=http_port,
        log_level=args.log_level,
        partitions=partitions,
        events_max_age=max_age,
        usage_history_max_age=history_age,
        dry_run=dry_run,
        leader_election=leader,
        lease_namespace=args.lease_namespace,
        identity=args.identity or socket.gethostname(),
        reservation_guard=guard,
        guard_creators=creators,
        exclude_namespaces=excluded,
        resync_interval=resync,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if any(SERVICES[n].needs_cluster for n in service_names(config.service)):
            check_kube_access(config.kubeconfig)  # (here, not in the flags: it reads files and the environment)
    except InvalidInput as e:
        print(f"vmquota run: {e}", file=sys.stderr)
        return 2
    logs.configure(config.log_level)
    for name in service_names(config.service):
        resolve(name)  # imported now, so that tune_gc() below freezes the modules
    tune_gc()
    return asyncio.run(serve(config))


GC_THRESHOLDS = (50_000, 50, 1000)
"""The services allocate and free (by reference counting) a dict per field of every object they decode, which
triggers Python's cyclic collector every 700 allocations by default: a collection per object or two, each walking
the young generation. Rarer collections cut the watcher's CPU per object by about a quarter (bench_pipeline)."""


def tune_gc() -> None:
    """Collect less often (:data:`GC_THRESHOLDS`), and keep what start-up allocated (modules, classes, the
    Kubernetes client's models: 40,000 to 150,000 objects) out of the collector's sight (``gc.freeze``): a full
    collection then walks only what the service allocates while it runs, instead of pausing the service for
    20-120 ms under load each time. Nothing frozen is garbage: it lives as long as the process."""
    gc.collect()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


# ---- HTTP -------------------------------------------------------------------------------------------------------


async def start_http(port: int, metrics: Metrics, health: Health) -> tuple[web.AppRunner, int]:
    """Serve /healthz, /readyz and /metrics; returns the runner and the bound port."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST

    started = time.time()

    async def healthz(_: web.Request) -> web.Response:
        if health.failed is not None:
            return web.json_response({"ok": False, "failed": health.failed}, status=500)
        return web.json_response({"ok": True, "uptime": round(time.time() - started, 3)})

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response(health.status(), status=200 if health.ready else 503)

    async def metrics_handler(_: web.Request) -> web.Response:
        resp = web.Response(body=metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host="0.0.0.0", port=port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)


# ---- serving ----------------------------------------------------------------------------------------------------


async def serve(
    config: Config, *, ready: Callable[[int], None] | None = None, stop: asyncio.Event | None = None
) -> int:
    """Run the configured service(s) until SIGTERM/SIGINT, or until ``stop`` is set when given (the service(s) are
    then part of a larger program, such as the demo, which keeps its own signal handling); 0 after a clean stop, 1
    on a failure. ``ready`` is told the bound HTTP port once serving."""
    log = logs.get_logger(service=config.service, cluster=config.cluster, identity=config.identity)
    names = service_names(config.service)
    if config.service == "all":
        missing = [n for n in PLANNED if n not in SERVICES]
        if missing:
            log.warning("services not in this build are not started", missing=missing)
    metrics, health = Metrics(), Health()
    signals = (signal.SIGTERM, signal.SIGINT) if stop is None else ()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    http, port = await start_http(config.http_port, metrics, health)
    log.info("serving", services=names, http_port=port)
    if ready is not None:
        ready(port)
    runtimes = [Runtime(name=n, config=config, metrics=metrics, health=health, stop=asyncio.Event()) for n in names]
    for rt in runtimes:
        health.expect(rt.name)
    tasks: dict[asyncio.Task[None], Runtime] = {
        asyncio.create_task(resolve(rt.name)(rt), name=rt.name): rt for rt in runtimes
    }
    stopper = asyncio.create_task(stop.wait())
    code = 0
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is stopper:
                continue
            exc = t.exception()
            if exc is not None:
                health.failed = f"{t.get_name()}: {exc}"
                if isinstance(exc, InvalidInput):  # a setting to fix: the line says which; no traceback
                    log.error("service failed", failed=t.get_name(), error=str(exc))
                else:
                    log.error("service failed", failed=t.get_name(), error=str(exc), exc_info=exc)
            else:
                log.warning("service returned before stop", failed=t.get_name())
            code = 1
        log.info("stopping")
        for rt in runtimes:
            rt.stop.set()
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=15.0)
            for t in still:
                log.warning("service did not stop in time; cancelling", failed=t.get_name())
            await cancel(*still)
        from services.platform.bus import ConnectStopped

        for t in tasks:
            if isinstance(_failure(t), ConnectStopped):
                log.info("stopped before NATS was reachable", failed=t.get_name())
            elif _failure(t) is not None and code == 0:
                log.error("service failed while stopping", failed=t.get_name(), error=str(t.exception()))
                code = 1
    finally:
        stopper.cancel()
        await http.cleanup()
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    log.info("stopped", code=code)
    return code


def _failure(t: asyncio.Task[None]) -> BaseException | None:
    return t.exception() if t.done() and not t.cancelled() else None


T = TypeVar("T")


def run_to_end(work: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(work)`` for programs that run to an end (the demo, the benchmarks): SIGTERM cancels ``work`` as
    Ctrl-C does, at an await, so that every clean-up runs (an embedded nats-server, a simulated cluster, service
    processes) and nothing is left behind; either ends in KeyboardInterrupt. A service stops on SIGTERM through
    :func:`serve` instead."""
    try:
        return asyncio.run(_stopped_by_sigterm(work))
    except asyncio.CancelledError:  # (SIGTERM)
        raise KeyboardInterrupt from None


async def _stopped_by_sigterm(work: Awaitable[T]) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await work
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def cancel(*tasks: asyncio.Task[Any], attempts: int = 50) -> None:
    """Cancel ``tasks`` and wait for them to end; cancel again if a library swallowed the cancellation (nats-py's
    ``asyncio.wait_for`` can on Python 3.11)."""
    for _ in range(attempts):
        pending = [t for t in tasks if not t.done()]
        if not pending:
            break
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.1)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: the caller reports failures from the task itself


# ---- Kubernetes and leader election -----------------------------------------------------------------------------


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def check_kube_access(kubeconfig: str | None) -> None:
    """Before anything connects: the kubeconfig is a readable kubeconfig whose current context exists, or, without
    one, this process runs in a pod with a service account. :class:`InvalidInput` says what to do."""
    flag = "--kubeconfig (VMQUOTA_KUBECONFIG)"
    if not kubeconfig:
        if not os.environ.get("KUBERNETES_SERVICE_HOST") or not os.path.exists(SERVICE_ACCOUNT_TOKEN):
            raise InvalidInput("not running in a Kubernetes pod (no service account): give a kubeconfig file", flag)
        return
    import yaml

    path = os.path.expanduser(kubeconfig)
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise InvalidInput(f"no such file: {kubeconfig}", flag) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read {kubeconfig}: {getattr(e, 'strerror', None) or e}", flag) from None
    except yaml.YAMLError as e:
        from services.platform.inputs import yaml_problem

        raise InvalidInput(f"{kubeconfig}: {yaml_problem(e)}", flag) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clusters"), list):
        raise InvalidInput(f"{kubeconfig} is not a kubeconfig (no clusters list)", flag)
    contexts = {c.get("name") for c in doc.get("contexts") or [] if isinstance(c, dict)}
    current = doc.get("current-context")
    if not current or current not in contexts:
        have = ", ".join(sorted(str(c) for c in contexts)) or "none"
        raise InvalidInput(f"{kubeconfig}: current-context {current!r} is not among its contexts ({have})", flag)


async def kube_client(kubeconfig: str | None) -> Any:
    """A kubernetes-asyncio ``ApiClient`` from a kubeconfig file (``--kubeconfig``) or, without one, the in-cluster
    service account."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig

    cfg = client.Configuration()
    try:
        if kubeconfig:
            await kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (kconfig.ConfigException, OSError, ValueError) as e:
        raise InvalidInput(f"cannot use it: {e}", "--kubeconfig (VMQUOTA_KUBECONFIG)") from None
    if not cfg.proxy:
        cfg.proxy = env_proxy(cfg.host or "")
    api = client.ApiClient(configuration=cfg)
    _resolve_env_once(api)
    return api


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``/``HTTP_PROXY`` by scheme, either case), or
    None when there is none or ``NO_PROXY`` exempts the host: the standard library's reading of the variables, as
    aiohttp's. Unlike aiohttp per request, it reads no proxy credentials from ``~/.netrc`` (credentials go in the
    proxy URL)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return proxies.get(parts.scheme) or None


def _resolve_env_once(api: Any) -> None:
    """kubernetes-asyncio's HTTP session trusts the environment, so aiohttp reads the proxy variables and
    ``~/.netrc`` again on every request, each time in a worker thread: two thread hand-offs per API call, the
    enforcer's largest cost after the call itself. The proxy is resolved once instead (:func:`env_proxy`, into the
    configuration), and the session is replaced by one that does not look again. ``~/.netrc`` is not read: the
    client authenticates with the kubeconfig's or the service account's credentials."""
    import aiohttp

    rest = api.rest_client
    old: aiohttp.ClientSession = rest.pool_manager
    if not old.trust_env:
        return
    rest.pool_manager = aiohttp.ClientSession(
        connector=old.connector,
        trust_env=False,
        read_bufsize=2**21,  # as kubernetes-asyncio sets it: large objects in one watch line
    )
    old.detach()  # the connector now belongs to the new session


def lease_name(service: str, cluster: str | None) -> str:
    """The Lease a service's instances elect their leader with: ``vmquota-<service>-<cluster>`` (the deploy
    manifests grant each service ``get``/``update`` of exactly this name)."""
    return f"vmquota-{service}-{cluster or 'all'}"


async def leader_elected(rt: Runtime, work: Callable[[], Awaitable[None]], timing: LeaseTiming | None = None) -> None:
    """Run ``work()`` while this process holds the Lease ``vmquota-<service>-<cluster>`` in ``--lease-namespace``
    (or at once with ``--no-leader-election``); ``services.platform.lease`` has the rules. Losing the Lease stops
    the work and raises, so the process restarts as a follower instead of acting on a stale view; a graceful stop
    releases it, so that a standby takes over at once. The process is ready (``/readyz``) only while the Lease API
    answers: leading, or a standby that sees a valid holder."""
    if not rt.config.leader_election:
        await work()
        return
    from services.platform.lease import Elector, LeaseTiming, run_leading

    lease = lease_name(rt.name, rt.config.cluster)
    component = f"{rt.name}-lease"
    rt.health.expect(component)
    api = await kube_client(rt.config.kubeconfig)
    try:
        elector = Elector(
            api,
            rt.config.lease_namespace,
            lease,
            rt.config.identity,
            timing or LeaseTiming(),
            on_health=lambda ok: rt.health.set_ready(component, ok),
        )
        rt.log(lease=lease).info("waiting for the lease", lease_namespace=rt.config.lease_namespace)
        await run_leading(elector, work, rt.stop)
        if not rt.stop.is_set():
            raise RuntimeError(f"{rt.name} stopped working while leading")
    finally:
        await api.close()
