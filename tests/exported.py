"""The metrics the services export, from the services' own metric classes (not from a list kept by hand): one
registry holding every service's families, as ``vmquota run all`` has."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from services.enforcer.quota_metrics import QuotaMetrics
from services.enforcer.service import EnforcerMetrics
from services.runner import Metrics
from services.watcher.metrics import WatcherMetrics


def every_service_metrics() -> Metrics:
    """The runner's metrics (the ledger has no others) with the watcher's and the enforcer's (its own and the
    per-quota gauges) on the same registry."""
    m = Metrics()
    WatcherMetrics(m.registry)
    EnforcerMetrics(m.registry)
    QuotaMetrics(m.registry)
    return m


def families(registry: CollectorRegistry) -> dict[str, MetricWrapperBase]:
    """Each vmquota metric family of ``registry`` by its name (without the ``_total`` of counters)."""
    found: dict[str, MetricWrapperBase] = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase) and collector._name.startswith("vmquota_"):
            found[collector._name] = collector
    return found


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can export: counters' ``_total`` and ``_created``, histograms' ``_bucket``,
    ``_sum`` and ``_count``, gauges, and the process collectors' metrics."""
    names: set[str] = set()
    for collector in list(registry._collector_to_names):
        names.update(registry._collector_to_names[collector])
    return names
