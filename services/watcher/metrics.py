"""The watcher's Prometheus metrics, registered once per registry (the process's, from the runner). Every series
carries ``service`` (the watcher's name), as the runner's metrics do; ``labels()`` takes the other labels."""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.platform.http import ServiceLabelled

SERVICE = "watcher"


class WatcherMetrics:
    def __init__(self, registry: CollectorRegistry, service: str = SERVICE) -> None:
        r = registry
        labels = ["service", "cluster", "kind"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> ServiceLabelled[Counter]:
            return ServiceLabelled(Counter(name, doc, [*labels, *extra], registry=r), service)

        self.seen = counter("vmquota_watcher_objects_seen", "Objects received from the API server")
        self.published = counter(
            "vmquota_watcher_published",
            "Events stored on the bus (type: upserted, deleted, sync, deadletter; duplicates excluded)",
            ("type",),
        )
        self.duplicates = counter("vmquota_watcher_duplicates", "Events the server dropped as repeats (msg-id)")
        self.relists = counter("vmquota_watcher_relists", "Lists of a resource (reason: start, gone)", ("reason",))
        self.restarts = counter(
            "vmquota_watcher_watch_restarts", "Watches opened again (reason: timeout, dropped, error)", ("reason",)
        )
        self.errors = counter(
            "vmquota_watcher_errors",
            "Failed API calls and unreadable objects (code: HTTP status, 0 network, dlq)",
            ("code",),
        )
        self.tracked = ServiceLabelled(
            Gauge("vmquota_watcher_tracked_objects", "Objects the watcher tracks now", labels, registry=r), service
        )
        self.leader = ServiceLabelled(
            Gauge(
                "vmquota_watcher_leader",
                "1 while this process holds the watcher's Lease",
                ["service", "cluster"],
                registry=r,
            ),
            service,
        )


_lock = threading.Lock()
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, WatcherMetrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry) -> WatcherMetrics:
    """The watcher metrics of ``registry`` (created on first use; a registry refuses a name twice)."""
    with _lock:
        m = _by_registry.get(registry)
        if m is None:
            m = _by_registry[registry] = WatcherMetrics(registry)
        return m
