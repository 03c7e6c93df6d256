"""Per-quota gauges from the ledger's usage snapshots: each managed quota's terms (``shared.contract.QuotaTerms``) per
resource, in base units (bytes, cores, counts), as of the namespace's latest snapshot the enforcer accepted.

Series: ``vmquota_quota_{budget,used,reserved,hard}{service, cluster, namespace, quota, resource}``, one per term
and resource each quota names; a quota (or a resource) that the namespace's next snapshot no longer carries loses
its series. Cardinality: at most 4 x (managed quotas) x (resources per quota).

With them, per namespace, ``vmquota_namespace_vms{service, cluster, namespace, state}`` (running, admitted, refused,
stopped) and ``vmquota_namespace_migrations{..., state}`` (pending, growth-refused, cancel, ...): how many are in
each state the snapshot names (a state none is in has no series). Cardinality: a few series per namespace.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Gauge

from shared import contract
from shared.errors import InvalidInput
from shared.quantity import Quantity

TERMS: Final = {
    "budget": "What the administrator allows (the quota's budget), in base units",
    "used": "Each admitted VM once in the mode's terms plus every non-VM pod at its pod usage, in base units",
    "reserved": "Admitted pods that do not exist yet (new VMs' launcher pods, refused migration targets)",
    "hard": "The spec.hard the quota equation gives, in base units",
}
LABELS: Final = ("service", "cluster", "namespace", "quota", "resource")

Series = tuple[str, str, str]
"""(term, quota, resource)."""


def base_units(text: str) -> float | None:
    """A quantity string as a float in base units (``1Gi`` → 1073741824.0, ``500m`` → 0.5); None if unreadable."""
    try:
        return float(Quantity.parse(text).value)
    except InvalidInput:
        return None


class QuotaMetrics:
    """The gauges, fed with :meth:`observe` for every usage snapshot the enforcer accepts."""

    def __init__(self, registry: CollectorRegistry, service: str = "enforcer") -> None:
        self.service = service
        self.gauges = {
            term: Gauge(f"vmquota_quota_{term}", doc, LABELS, registry=registry) for term, doc in TERMS.items()
        }
        self._shown: dict[tuple[str, str], set[Series]] = {}
        """(cluster, namespace) → the series its last snapshot set."""
        ns_labels = ["service", "cluster", "namespace", "state"]
        self.vms = Gauge("vmquota_namespace_vms", "VMs of the namespace by state", ns_labels, registry=registry)
        self.migrations = Gauge(
            "vmquota_namespace_migrations",
            "Migrations in flight in the namespace by state",
            ns_labels,
            registry=registry,
        )
        self._states: dict[tuple[str, str], set[tuple[str, str]]] = {}
        """(cluster, namespace) → the (family, state) series its last snapshot set."""

    def observe(self, u: contract.UsageSnapshot) -> None:
        """Show ``u``'s quotas (the namespace's latest snapshot), and drop the series of what it no longer has."""
        shown: set[Series] = set()
        for quota, terms in u.quotas.items():
            for term, gauge in self.gauges.items():
                values: dict[str, str] = getattr(terms, term)
                for resource, text in values.items():
                    value = base_units(text)
                    if value is None:
                        continue
                    gauge.labels(self.service, u.cluster, u.namespace, quota, resource).set(value)
                    shown.add((term, quota, resource))
        key = (u.cluster, u.namespace)
        for term, quota, resource in self._shown.get(key, set()) - shown:
            self.gauges[term].remove(self.service, u.cluster, u.namespace, quota, resource)
        if shown:
            self._shown[key] = shown
        else:
            self._shown.pop(key, None)
        self._count_states(u)

    def _count_states(self, u: contract.UsageSnapshot) -> None:
        families = {"vms": self.vms, "migrations": self.migrations}
        counts: dict[tuple[str, str], int] = {}
        for v in u.vms:
            counts[("vms", v.state)] = counts.get(("vms", v.state), 0) + 1
        for m in u.migrations:
            state = m.state or "unknown"
            counts[("migrations", state)] = counts.get(("migrations", state), 0) + 1
        for (family, state), n in counts.items():
            families[family].labels(self.service, u.cluster, u.namespace, state).set(n)
        key = (u.cluster, u.namespace)
        for family, state in self._states.get(key, set()) - set(counts):
            families[family].remove(self.service, u.cluster, u.namespace, state)
        if counts:
            self._states[key] = set(counts)
        else:
            self._states.pop(key, None)
