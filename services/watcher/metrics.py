"""The watcher's Prometheus metrics, registered once per registry (the process's, from the runner)."""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge


class WatcherMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        labels = ["cluster", "kind"]
        self.seen = Counter("vmquota_watcher_objects_seen", "Objects received from the API server", labels, registry=r)
        self.published = Counter(
            "vmquota_watcher_published",
            "Events stored on the bus (type: upserted, deleted, sync, deadletter; duplicates excluded)",
            [*labels, "type"],
            registry=r,
        )
        self.duplicates = Counter(
            "vmquota_watcher_duplicates", "Events the server dropped as repeats (msg-id)", labels, registry=r
        )
        self.relists = Counter(
            "vmquota_watcher_relists", "Lists of a resource (reason: start, gone)", [*labels, "reason"], registry=r
        )
        self.restarts = Counter(
            "vmquota_watcher_watch_restarts",
            "Watches opened again (reason: timeout, dropped, error)",
            [*labels, "reason"],
            registry=r,
        )
        self.errors = Counter(
            "vmquota_watcher_errors",
            "Failed API calls and unreadable objects (code: HTTP status, 0 network, dlq)",
            [*labels, "code"],
            registry=r,
        )
        self.tracked = Gauge("vmquota_watcher_tracked_objects", "Objects the watcher tracks", labels, registry=r)
        self.leader = Gauge(
            "vmquota_watcher_leader", "1 while this process holds the watcher's Lease", ["cluster"], registry=r
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
