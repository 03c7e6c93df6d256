"""Pod usage as the ResourceQuota evaluator charges it (k8s.io/component-helpers/resource + the pod evaluator)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from shared.errors import InvalidInput
from shared.podusage import (
    ContainerSpec,
    counts_for_compute,
    pod_counts_for_compute,
    pod_quota_usage,
    pod_resources,
    pod_totals,
    quota_usage_of,
)
from shared.quantity import Quantity
from shared.resources import format_resource_list, parse_resource_list

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def c(name: str, req: dict[str, str], lim: dict[str, str] | None = None, **kw: bool) -> ContainerSpec:
    return ContainerSpec(name, parse_resource_list(req), parse_resource_list(lim or {}), **kw)


def fmt(rl: dict[str, Quantity]) -> dict[str, str]:
    return format_resource_list(rl)


def test_containers_sum() -> None:
    req, lim = pod_totals([c("a", {"cpu": "100m"}, {"cpu": "1"}), c("b", {"cpu": "200m", "memory": "1Gi"})])
    assert fmt(req) == {"cpu": "300m", "memory": "1Gi"}
    assert fmt(lim) == {"cpu": "1"}


def test_plain_init_container_is_a_max() -> None:
    req, _ = pod_totals([c("init", {"cpu": "2"}, init=True), c("a", {"cpu": "1", "memory": "1Gi"})])
    assert fmt(req) == {"cpu": "2", "memory": "1Gi"}


def test_sidecars_add_and_count_in_later_init_peaks() -> None:
    containers = [
        c("sidecar", {"cpu": "500m"}, init=True, restartable=True),
        c("init", {"cpu": "1"}, init=True),  # runs next to the sidecar: peak 1.5
        c("main", {"cpu": "200m"}),
    ]
    req, _ = pod_totals(containers)
    assert fmt(req) == {"cpu": "1500m"}  # max(0.2 + 0.5, 1 + 0.5)


def test_init_before_sidecar_does_not_include_it() -> None:
    containers = [
        c("init", {"cpu": "1"}, init=True),
        c("sidecar", {"cpu": "500m"}, init=True, restartable=True),
        c("main", {"cpu": "200m"}),
    ]
    req, _ = pod_totals(containers)
    assert fmt(req) == {"cpu": "1"}  # max(0.7, 1)


def test_overhead_added_to_requests_and_existing_limits_only() -> None:
    overhead = parse_resource_list({"cpu": "250m", "memory": "120Mi"})
    req, lim = pod_totals([c("a", {"cpu": "1", "memory": "1Gi"}, {"memory": "2Gi"})], overhead)
    assert fmt(req) == {"cpu": "1250m", "memory": "1144Mi"}
    assert fmt(lim) == {"memory": "2168Mi"}


def test_quota_names() -> None:
    usage = quota_usage_of(
        parse_resource_list(
            {
                "cpu": "1",
                "memory": "1Gi",
                "ephemeral-storage": "50M",
                "hugepages-2Mi": "1Gi",
                "nvidia.com/gpu": "1",
                "example.kubernetes.io/thing": "1",
            }
        ),
        parse_resource_list({"cpu": "2", "memory": "2Gi"}),
    )
    assert fmt(usage) == {
        "count/pods": "1",
        "cpu": "1",
        "ephemeral-storage": "50M",
        "hugepages-2Mi": "1Gi",
        "limits.cpu": "2",
        "limits.memory": "2Gi",
        "memory": "1Gi",
        "pods": "1",
        "requests.cpu": "1",
        "requests.ephemeral-storage": "50M",
        "requests.hugepages-2Mi": "1Gi",
        "requests.memory": "1Gi",
        "requests.nvidia.com/gpu": "1",
    }


def pod(phase: str = "Running", **meta: Any) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "t", **meta},
        "spec": {
            "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}],
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "500m", "memory": "64Mi"}}}],
            "overhead": {"memory": "10Mi"},
        },
        "status": {"phase": phase},
    }


def test_pod_object_usage() -> None:
    req, lim = pod_resources(pod())
    assert fmt(req) == {"cpu": "2", "memory": "74Mi"}
    assert lim == {}
    assert fmt(pod_quota_usage(pod())) == {
        "count/pods": "1",
        "cpu": "2",
        "memory": "74Mi",
        "pods": "1",
        "requests.cpu": "2",
        "requests.memory": "74Mi",
    }


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_terminal_pods_count_only_object_count(phase: str) -> None:
    assert fmt(pod_quota_usage(pod(phase))) == {"count/pods": "1"}


def test_terminating_pod_past_grace_counts_only_object_count() -> None:
    p = pod(deletionTimestamp="2025-01-01T00:00:00Z", deletionGracePeriodSeconds=30)
    assert pod_counts_for_compute(p, T0 + timedelta(seconds=30))
    assert not pod_counts_for_compute(p, T0 + timedelta(seconds=31))
    assert fmt(pod_quota_usage(p, T0 + timedelta(seconds=31))) == {"count/pods": "1"}
    assert counts_for_compute("Running", T0, 0, T0)
    assert not counts_for_compute("Running", T0, 0, T0 + timedelta(microseconds=1))
    assert counts_for_compute("Running", T0, None, T0 + timedelta(days=1))  # no grace period: still charged


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"containers": "x"}, "spec.containers"),
        (
            {"containers": [{"name": "a", "resources": {"requests": {"cpu": "lots"}}}]},
            "spec.containers[0].resources.requests.cpu",
        ),
        ({"containers": [{"name": "a", "resources": "x"}]}, "spec.containers[0].resources"),
        ({"containers": [], "overhead": {"memory": "1K"}}, "spec.overhead.memory"),
    ],
)
def test_bad_pods_name_the_field(spec: dict[str, Any], where: str) -> None:
    with pytest.raises(InvalidInput) as err:
        pod_resources({"spec": spec})
    assert err.value.where == where
