"""Per-quota gauges from the ledger's usage snapshots: each managed quota's terms (``shared.bus.QuotaTerms``) per
resource, in base units (bytes, cores, counts), as of the namespace's latest snapshot the enforcer accepted.

Series: ``vmquota_quota_{budget,used,reserved,hard}{service, cluster, namespace, quota, resource}``, one per term
and resource each quota names; a quota (or a resource) that the namespace's next snapshot no longer carries loses
its series. Cardinality: at most 4 x (managed quotas) x (resources per quota).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Gauge

from shared import bus as contract
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
