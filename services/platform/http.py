"""What a process serves over HTTP on ``--http-port``: ``/healthz`` and ``/readyz`` (:class:`Health`) and
Prometheus ``/metrics`` (:class:`Metrics`, one registry per process, labelled by service).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from shared.errors import InvalidInput

if TYPE_CHECKING:  # the clients are imported when a service runs, not when the CLI builds its parser
    from aiohttp import web
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase


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
        self.incomplete = Gauge(
            "vmquota_incomplete_clusters",
            "Clusters whose events the stream lost before they were read, waiting for their watcher's relist",
            ["service"],
            registry=r,
        )

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
    try:
        await site.start()
    except OSError as e:  # (in use: two services on one host both default to 8080; or a port below 1024)
        await runner.cleanup()
        raise InvalidInput(
            f"cannot listen on 0.0.0.0:{port} ({e.strerror or e}): give another port, or 0 for a free one",
            "--http-port (VMQUOTA_HTTP_PORT)",
        ) from None
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
