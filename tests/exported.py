"""What the services expose, read from their own code (not from a list kept by hand): the metrics (one registry
holding every service's families, as ``vmquota run all`` has) and the environment variables ``vmquota run`` reads."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from services.enforcer.options import EnforcerMetrics
from services.enforcer.quota_metrics import QuotaMetrics
from services.platform.http import Metrics
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
        names.update(registry._collector_to_names[collector])  # (every name a family can have, children or not)
    names.update(s.name for family in registry.collect() for s in family.samples)  # (the process collectors')
    return names


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    clauses, functions (a name before ``(``), keywords and numbers are taken out. Grafana's variables (``$x``) may
    stand in matchers and ranges only."""
    text = _STRINGS.sub(" ", expr)
    while True:
        stripped = _BRACES.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = m.group()
        if text[m.end() :].lstrip().startswith("(") or name.lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] in "$."):
            continue  # (the unit of a number such as 1e3, or a variable)
        names.add(name)
    return names


def runner_env_vars() -> set[str]:
    """Environment variables `vmquota run` reads (from its flags' source: every env/_env_bool call)."""
    from services.platform import config

    source = Path(config.__file__).read_text()
    found = set(re.findall(r'\b(?:env|_env_bool)\(\s*"(VMQUOTA_[A-Z_]+)"', source))
    assert {"VMQUOTA_NATS", "VMQUOTA_CLUSTER"} <= found, "the runner no longer reads its flags this way"
    return found
