"""The per-quota gauges the enforcer shows from the ledger's usage snapshots."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry

from services.enforcer.quota_metrics import QuotaMetrics, base_units
from shared import contract
from shared.times import rfc3339


def snapshot(seq: int, quotas: dict[str, contract.QuotaTerms], namespace: str = "tenant-a") -> contract.UsageSnapshot:
    return contract.UsageSnapshot(
        id=f"c1/usage/{namespace}/{seq}",
        source=contract.source("ledger", "c1"),
        subject=namespace,
        time=rfc3339(),
        cluster="c1",
        namespace=namespace,
        seq=seq,
        quotas=quotas,
    )


def terms(
    *,
    budget: dict[str, str] | None = None,
    used: dict[str, str] | None = None,
    pods: dict[str, str] | None = None,
    reserved: dict[str, str] | None = None,
    hard: dict[str, str] | None = None,
) -> contract.QuotaTerms:
    return contract.QuotaTerms(
        mode="VirtualResources",
        budget=budget or {},
        used=used or {},
        pods=pods or {},
        reserved=reserved or {},
        hard=hard or {},
    )


def value(r: CollectorRegistry, term: str, quota: str, resource: str, namespace: str = "tenant-a") -> float | None:
    labels = {"service": "enforcer", "cluster": "c1", "namespace": namespace, "quota": quota, "resource": resource}
    return r.get_sample_value(f"vmquota_quota_{term}", labels)


def series(r: CollectorRegistry) -> set[tuple[str, ...]]:
    return {
        (s.name, s.labels["namespace"], s.labels["quota"], s.labels["resource"])
        for f in r.collect()
        if f.name.startswith("vmquota_quota_")
        for s in f.samples
    }


def test_base_units() -> None:
    assert base_units("1Gi") == 2**30
    assert base_units("500m") == 0.5
    assert base_units("4") == 4.0
    assert base_units("1.5k") == 1500.0
    assert base_units("lots") is None


def test_terms_are_shown_per_resource_in_base_units() -> None:
    r = CollectorRegistry()
    m = QuotaMetrics(r)
    m.observe(
        snapshot(
            1,
            {
                "compute": terms(
                    budget={"requests.memory": "64Gi", "requests.cpu": "16"},
                    used={"requests.memory": "48Gi", "requests.cpu": "12500m"},
                    reserved={"requests.memory": "8Gi"},
                    hard={"requests.memory": "72Gi", "requests.cpu": "16"},
                    pods={"requests.memory": "50Gi"},  # (Kubernetes' terms: not shown)
                )
            },
        )
    )
    assert value(r, "budget", "compute", "requests.memory") == 64 * 2**30
    assert value(r, "used", "compute", "requests.cpu") == 12.5
    assert value(r, "reserved", "compute", "requests.memory") == 8 * 2**30
    assert value(r, "reserved", "compute", "requests.cpu") is None, "only the resources a term names"
    assert value(r, "hard", "compute", "requests.memory") == 72 * 2**30
    assert len(series(r)) == 7


def test_a_quota_or_resource_the_next_snapshot_drops_loses_its_series() -> None:
    r = CollectorRegistry()
    m = QuotaMetrics(r)
    both = {
        "a": terms(budget={"requests.memory": "1Gi", "requests.cpu": "1"}, hard={"requests.memory": "2Gi"}),
        "b": terms(budget={"requests.memory": "3Gi"}),
    }
    m.observe(snapshot(1, both))
    m.observe(snapshot(1, {"x": terms(budget={"requests.cpu": "2"})}, namespace="tenant-b"))
    assert len(series(r)) == 5
    m.observe(snapshot(2, {"a": terms(budget={"requests.memory": "1Gi"})}))
    assert series(r) == {
        ("vmquota_quota_budget", "tenant-a", "a", "requests.memory"),
        ("vmquota_quota_budget", "tenant-b", "x", "requests.cpu"),
    }, "b, a's cpu and a's hard are gone; the other namespace is untouched"
    m.observe(snapshot(3, {}))
    assert series(r) == {("vmquota_quota_budget", "tenant-b", "x", "requests.cpu")}


def test_vms_and_migrations_are_counted_by_state() -> None:
    r = CollectorRegistry()
    m = QuotaMetrics(r)
    vm = contract.VmState
    mig = contract.MigrationState
    first = msgspec.structs.replace(
        snapshot(1, {}),
        vms=[vm(name="a", state="running"), vm(name="b", state="running"), vm(name="c", state="refused")],
        migrations=[mig(name="m1", vmi="a", state="growth-refused")],
    )
    m.observe(first)
    labels = {"service": "enforcer", "cluster": "c1", "namespace": "tenant-a"}
    assert r.get_sample_value("vmquota_namespace_vms", {**labels, "state": "running"}) == 2
    assert r.get_sample_value("vmquota_namespace_vms", {**labels, "state": "refused"}) == 1
    assert r.get_sample_value("vmquota_namespace_migrations", {**labels, "state": "growth-refused"}) == 1
    m.observe(snapshot(2, {}))
    assert r.get_sample_value("vmquota_namespace_vms", {**labels, "state": "running"}) is None
    assert r.get_sample_value("vmquota_namespace_migrations", {**labels, "state": "growth-refused"}) is None
