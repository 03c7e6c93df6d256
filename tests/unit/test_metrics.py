"""The services' Prometheus metrics: the ``service`` label on every series, gauges that follow what they count, and
the process's own metrics."""

from __future__ import annotations

from typing import Any, cast

import pytest
import structlog
from prometheus_client import Counter

from services.enforcer.options import EnforcerMetrics
from services.platform.http import Health, Metrics, ServiceLabelled
from services.platform.publisher import Item
from services.platform.runner import Runtime
from services.watcher.metrics import WatcherMetrics
from services.watcher.watcher import Watcher, WatcherConfig
from tests.exported import every_service_metrics, families


def test_every_vmquota_family_of_every_service_is_labelled_by_service() -> None:
    """docs/operations.md: each series has a ``service`` label (the one the alerts group by)."""
    found = families(every_service_metrics().registry)
    assert {"vmquota_events_in", "vmquota_watcher_tracked_objects", "vmquota_enforcer_patches"} <= set(found)
    unlabelled = sorted(name for name, f in found.items() if "service" not in f._labelnames)
    assert not unlabelled, f"families without a service label: {unlabelled}"


def test_service_labelled_binds_the_service_by_position_and_by_name() -> None:
    m = Metrics()
    w = WatcherMetrics(m.registry)
    w.seen.labels("c1", "Pod").inc()
    e = EnforcerMetrics(m.registry, "enforcer-b")
    e.patches.labels(outcome="applied").inc(2)
    e.reaction.observe(0.01)
    r = m.registry
    assert (
        r.get_sample_value("vmquota_watcher_objects_seen_total", {"service": "watcher", "cluster": "c1", "kind": "Pod"})
        == 1
    )
    assert r.get_sample_value("vmquota_enforcer_patches_total", {"service": "enforcer-b", "outcome": "applied"}) == 2
    assert r.get_sample_value("vmquota_enforcer_reaction_seconds_count", {"service": "enforcer-b"}) == 1
    with pytest.raises(ValueError, match="first label must be service"):
        ServiceLabelled(Counter("other", "without a service label", ["kind"], registry=None), "x")


class Captured:
    """What a Watcher publishes, kept in memory (the watcher's Publisher, without a bus)."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.items: list[Item] = []

    def enqueue(self, item: Item) -> None:
        self.items.append(item)


def namespace(name: str, rv: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": str(rv)}}


def test_tracked_objects_follow_watch_events_not_only_lists() -> None:
    """A namespace created while a watch is open counts at once (not only after the next list or watch restart),
    and so does one deleted."""
    m = Metrics()
    watcher = Watcher(
        cast(Any, None),
        cast(Any, Captured()),
        WatcherConfig(cluster="c1"),
        metrics=WatcherMetrics(m.registry),
        log=structlog.get_logger(),
    )
    loop = watcher.loops["Namespace"]

    def tracked() -> float | None:
        return m.registry.get_sample_value(
            "vmquota_watcher_tracked_objects", {"service": "watcher", "cluster": "c1", "kind": "Namespace"}
        )

    for i, name in enumerate(("a", "b", "c", "d"), start=1):
        loop.handle("ADDED", namespace(name, i))
    assert tracked() == 4
    loop.handle("DELETED", namespace("b", 5))
    assert tracked() == 3


def test_the_registry_carries_the_process_metrics() -> None:
    r = Metrics().registry
    assert r.get_sample_value("process_resident_memory_bytes") is not None
    assert r.get_sample_value("process_cpu_seconds_total") is not None
    assert r.get_sample_value("python_gc_collections_total", {"generation": "0"}) is not None
    assert any(s.name == "python_info" for f in r.collect() for s in f.samples)


def test_a_service_exports_its_alerted_counters_from_the_start() -> None:
    """VmquotaDeadLetters and VmquotaNatsFlapping take ``increase()``, which misses the first dead letter of a
    series that only appears with it: each service's series are there at 0 from the start."""
    m = Metrics()
    Runtime(name="enforcer", config=cast(Any, None), metrics=m, health=Health())
    assert m.registry.get_sample_value("vmquota_dlq_total", {"service": "enforcer"}) == 0
    assert m.registry.get_sample_value("vmquota_nats_reconnects_total", {"service": "enforcer"}) == 0
