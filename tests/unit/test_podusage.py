"""Pod usage as the ResourceQuota evaluator charges it (k8s.io/component-helpers/resource + the pod evaluator)."""

from __future__ import annotations

import ctypes
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


def _go_int64(n: int) -> int:
    """``n`` as Go's int64 arithmetic leaves it (two's complement), by ctypes' C int64, not the code under test."""
    return ctypes.c_int64(n).value


@pytest.mark.parametrize("grace", [10**14, 3 * 10**11, 2**63 - 1, 10**10, -5])
def test_a_grace_period_of_any_size_is_charged_as_gos_arithmetic_charges_it(grace: int) -> None:
    """A tenant may delete its pod with any grace period (``kubectl delete --grace-period=100000000000000``, the pod
    kept by a finalizer): Kubernetes multiplies it into int64 nanoseconds, which wrap. It was charged with Python's
    unbounded arithmetic, which raised past timedelta's range and stopped the ledger for every namespace."""
    end_ns = _go_int64(grace * 1_000_000_000)
    for after_ns in (end_ns - 1_000, end_ns + 1_000, 0, 1_000, 86_400 * 10**9):
        now = T0 + timedelta(microseconds=after_ns // 1_000)
        assert counts_for_compute("Running", T0, grace, now) == (not after_ns > end_ns), (grace, after_ns)
    p = pod(deletionTimestamp="2025-01-01T00:00:00Z", deletionGracePeriodSeconds=grace)
    assert pod_quota_usage(p, T0 + timedelta(days=1))  # (charged, or count/pods only: never an error)


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


# ---- Kubernetes 1.33+: in-place resize, pod-level resources, extended resources ----------------------------------
# Expected values are the upstream test figures of k8s.io/component-helpers/resource/helpers_test.go
# (TestPodResourceRequests, TestPodResourceLimits, TestPodLevelResourceRequests; Kubernetes v1.34/v1.35, where
# resize status is the PodResizePending condition) and of pkg/quota/v1/evaluator/core/pods.go (v1.35).

INFEASIBLE = [{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}]


def resized_pod(
    containers: list[dict[str, Any]],
    statuses: list[dict[str, Any]] | None = None,
    *,
    init: list[dict[str, Any]] | None = None,
    init_statuses: list[dict[str, Any]] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    pod_level: dict[str, Any] | None = None,
    overhead: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers, "initContainers": init or []}
    if pod_level is not None:
        spec["resources"] = pod_level
    if overhead is not None:
        spec["overhead"] = overhead
    status: dict[str, Any] = {"containerStatuses": statuses or [], "initContainerStatuses": init_statuses or []}
    if conditions:
        status["conditions"] = conditions
    return {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": spec, "status": status}


def test_resized_per_resource_three_way_maximum() -> None:
    # "resized: per-resource 3-way maximum": max(spec, allocatedResources, status.resources) per resource
    pod = resized_pod(
        [
            {
                "name": "container-1",
                "resources": {"requests": {"cpu": "30m", "memory": "20M", "ephemeral-storage": "10G"}},
            }
        ],
        [
            {
                "name": "container-1",
                "allocatedResources": {"cpu": "20m", "memory": "10M", "ephemeral-storage": "30G"},
                "resources": {"requests": {"cpu": "10m", "memory": "30M", "ephemeral-storage": "20G"}},
            }
        ],
    )
    assert fmt(pod_resources(pod)[0]) == {"cpu": "30m", "ephemeral-storage": "30G", "memory": "30M"}


def test_resized_infeasible_ignores_the_spec() -> None:
    # "resized, infeasible": spec 4, status 2 -> 2; without the condition ("resized, no resize status") -> 4
    statuses = [{"name": "container-1", "resources": {"requests": {"cpu": "2"}}}]
    spec = [{"name": "container-1", "resources": {"requests": {"cpu": "4"}}}]
    assert fmt(pod_resources(resized_pod(spec, statuses, conditions=INFEASIBLE))[0]) == {"cpu": "2"}
    assert fmt(pod_resources(resized_pod(spec, statuses))[0]) == {"cpu": "4"}


def test_resized_restartable_init_container_infeasible() -> None:
    # "resized, restartable init container, infeasible" -> 2; a plain init container keeps its spec
    init = [{"name": "restartable-init-1", "restartPolicy": "Always", "resources": {"requests": {"cpu": "4"}}}]
    st = [{"name": "restartable-init-1", "resources": {"requests": {"cpu": "2"}}}]
    pod = resized_pod([], init=init, init_statuses=st, conditions=INFEASIBLE)
    assert fmt(pod_resources(pod)[0]) == {"cpu": "2"}
    plain = [{"name": "restartable-init-1", "resources": {"requests": {"cpu": "4"}}}]
    assert fmt(pod_resources(resized_pod([], init=plain, init_statuses=st, conditions=INFEASIBLE))[0]) == {"cpu": "4"}


def test_allocated_resources_count_only_with_a_reported_status() -> None:
    # "aggregate request resolves max of sums instead of sum of maxes": statuses with allocatedResources but no
    # resources (cs.Resources == nil) leave the spec: 1 + 2 = 3
    pod = resized_pod(
        [
            {"name": "c1", "resources": {"requests": {"cpu": "1"}}},
            {"name": "c2", "resources": {"requests": {"cpu": "2"}}},
        ],
        [{"name": "c1", "allocatedResources": {"cpu": "2"}}, {"name": "c2", "allocatedResources": {"cpu": "1"}}],
    )
    assert fmt(pod_resources(pod)[0]) == {"cpu": "3"}


def test_resized_limits_follow_the_status() -> None:
    # determineContainerLimits: max(spec, status) normally, the status alone when infeasible
    spec = [{"name": "c", "resources": {"limits": {"memory": "1Gi"}, "requests": {"memory": "1Gi"}}}]
    st = [{"name": "c", "resources": {"limits": {"memory": "2Gi"}, "requests": {"memory": "2Gi"}}}]
    assert fmt(pod_resources(resized_pod(spec, st))[1]) == {"memory": "2Gi"}
    shrink = [{"name": "c", "resources": {"limits": {"memory": "512Mi"}, "requests": {"memory": "512Mi"}}}]
    assert fmt(pod_resources(resized_pod(spec, shrink))[1]) == {"memory": "1Gi"}  # not freed until actuated
    assert fmt(pod_resources(resized_pod(spec, shrink, conditions=INFEASIBLE))[1]) == {"memory": "512Mi"}


def test_overhead_goes_to_non_zero_limits_only() -> None:
    # TestPodResourceLimits "pod overhead included": cpu 2+3 (init 2) + 1 = 6, no memory limit
    pod = resized_pod(
        [{"name": "a", "resources": {"limits": {"cpu": "2"}}}, {"name": "b", "resources": {"limits": {"cpu": "3"}}}],
        init=[{"name": "i", "resources": {"limits": {"cpu": "2"}}}],
        overhead={"cpu": "1", "memory": "1Gi"},
    )
    assert fmt(pod_resources(pod)[1]) == {"cpu": "6"}
    zero = resized_pod([{"name": "a", "resources": {"limits": {"cpu": "0", "memory": "1Gi"}}}], overhead={"cpu": "1"})
    assert fmt(pod_resources(zero)[1]) == {"cpu": "0", "memory": "1Gi"}


@pytest.mark.parametrize(
    ("pod_level", "containers", "init", "expected"),
    [
        # "pod level memory and container level cpu resources"
        ({"requests": {"memory": "2Mi"}}, [{"requests": {"cpu": "2m"}}], [], {"cpu": "2m", "memory": "2Mi"}),
        # "pod level unsupported resources set at pod-level"
        ({"requests": {"storage": "2Mi"}}, [{"requests": {"memory": "3Mi"}}], [], {"memory": "3Mi"}),
        # "pod-level resources, container-level resources, init and sidecar container set"
        (
            {"requests": {"memory": "15Mi", "cpu": "18m"}},
            [{"requests": {"memory": "3Mi", "cpu": "2m"}}],
            [
                ({"requests": {"memory": "5Mi", "cpu": "4m"}}, True),
                ({"requests": {"memory": "6Mi", "cpu": "8m"}}, False),
            ],
            {"cpu": "18m", "memory": "15Mi"},
        ),
        # "pod-level resources, container-level resources, hugepage request/limit multiple page sizes between
        # pod-level and container-level"
        (
            {"limits": {"hugepages-2Mi": "10Mi"}, "requests": {"cpu": "1", "hugepages-2Mi": "10Mi"}},
            [{"limits": {"hugepages-1Gi": "1Gi"}, "requests": {"memory": "4Mi", "hugepages-1Gi": "1Gi"}}],
            [],
            {"cpu": "1", "hugepages-1Gi": "1Gi", "hugepages-2Mi": "10Mi", "memory": "4Mi"},
        ),
    ],
)
def test_pod_level_requests_replace_the_aggregate(
    pod_level: dict[str, Any],
    containers: list[dict[str, Any]],
    init: list[tuple[dict[str, Any], bool]],
    expected: dict[str, str],
) -> None:
    cs = [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)]
    inits = [
        {"name": f"i{i}", "resources": r, **({"restartPolicy": "Always"} if side else {})}
        for i, (r, side) in enumerate(init)
    ]
    assert fmt(pod_resources(resized_pod(cs, init=inits, pod_level=pod_level))[0]) == expected


def test_pod_level_limits_need_a_supported_pod_level_value() -> None:
    # IsPodLevelResourcesSet: "only unsupported resource limits set" is false, so the aggregate stays
    cs = [{"name": "c", "resources": {"limits": {"cpu": "2", "ephemeral-storage": "2Mi"}}}]
    assert fmt(pod_resources(resized_pod(cs, pod_level={"limits": {"ephemeral-storage": "1Mi"}}))[1]) == {
        "cpu": "2",
        "ephemeral-storage": "2Mi",
    }
    assert fmt(pod_resources(resized_pod(cs, pod_level={"limits": {"cpu": "1m"}}))[1]) == {
        "cpu": "1m",
        "ephemeral-storage": "2Mi",
    }


@pytest.mark.parametrize(
    ("name", "charged"),
    [
        ("example.com/gpu", ["requests.example.com/gpu"]),
        ("nvidia.com/gpu", ["requests.nvidia.com/gpu"]),
        ("devices.kubevirt.io/kvm", ["requests.devices.kubevirt.io/kvm"]),
        # helper.IsNativeResource: any name containing "kubernetes.io/" is native, not extended
        ("kubernetes.io/foo", []),
        ("x.kubernetes.io/foo", []),
        # the implicit DRA extended resource of a DeviceClass (schedutil.IsDRAExtendedResourceName, v1.35)
        ("deviceclass.resource.kubernetes.io/gpu-class", ["requests.deviceclass.resource.kubernetes.io/gpu-class"]),
        # requests.<name> must be a qualified name (IsExtendedResourceName)
        ("Example.com/gpu", []),
        ("example.com/a/b", []),
        ("example.com/" + "x" * 64, []),
        ("requests.example.com/gpu", []),
    ],
)
def test_extended_resources_are_charged_as_requests_only(name: str, charged: list[str]) -> None:
    usage = quota_usage_of({name: Quantity.parse("1")}, {name: Quantity.parse("1")})
    assert sorted(k for k in usage if "/" in k and k != "count/pods") == charged
