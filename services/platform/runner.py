"""``vmquota run watcher|ledger|enforcer|all``: the service shell.

Its flags are :mod:`services.platform.config`'s. The shell configures structlog JSON logs, serves ``/healthz``,
``/readyz`` and ``/metrics`` on ``--http-port`` (:mod:`services.platform.http`), turns SIGTERM/SIGINT into a
graceful stop, and runs the selected service(s).

A service registers with one line in :data:`~services.platform.config.SERVICES`: its name → ``"module:function"``, an
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
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from services.platform import logs
from services.platform.config import PLANNED, SERVICES, Config, config_from_args, service_names
from services.platform.config import add_arguments as add_arguments  # (the ``vmquota run`` command's flags)
from services.platform.http import Health, Metrics, start_http
from services.platform.kubeclient import check_kube_access, kube_client
from shared.errors import InvalidInput

if TYPE_CHECKING:  # the clients are imported when a service runs, not when the CLI builds its parser
    from services.platform.bus import NatsOptions
    from services.platform.lease import Fence, LeaseTiming


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
    try:
        return asyncio.run(serve(config))
    except InvalidInput as e:  # (a setting found wrong once serving: the HTTP port taken)
        print(f"vmquota run: {e}", file=sys.stderr)
        return 2


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


def lease_name(service: str, cluster: str | None) -> str:
    """The Lease a service's instances elect their leader with: ``vmquota-<service>-<cluster>`` (the deploy
    manifests grant each service ``get``/``update`` of exactly this name)."""
    return f"vmquota-{service}-{cluster or 'all'}"


async def leader_elected(
    rt: Runtime,
    work: Callable[[], Awaitable[None]],
    timing: LeaseTiming | None = None,
    *,
    fence: Fence | None = None,
) -> None:
    """Run ``work()`` while this process holds the Lease ``vmquota-<service>-<cluster>`` in ``--lease-namespace``
    (or at once with ``--no-leader-election``); ``services.platform.lease`` has the rules. Losing the Lease stops
    the work and raises, so the process restarts as a follower instead of acting on a stale view; a graceful stop
    releases it, so that a standby takes over at once. The process is ready (``/readyz``) only while the Lease API
    answers: leading, or a standby that sees a valid holder. ``fence`` is held while the Lease is
    (``services.platform.lease.Fence``): the work's writes check it."""
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
            fence=fence,
        )
        rt.log(lease=lease).info("waiting for the lease", lease_namespace=rt.config.lease_namespace)
        await run_leading(elector, work, rt.stop)
        if not rt.stop.is_set():
            raise RuntimeError(f"{rt.name} stopped working while leading")
    finally:
        await api.close()
