"""The fast pod totals (integer accumulation, shape memo) against a plain reference built from
``shared.resources.add``/``maximum``: same values, formats, key order and errors, over random pods."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidInput
from shared.podusage import ContainerSpec, pod_containers, pod_resources, pod_totals
from shared.quantity import MAX_NANOS, Quantity
from shared.resources import ResourceList, add, maximum, parse_resource_list


def within_range(rl: Mapping[str, Quantity]) -> ResourceList:
    """A single pod's totals, cut to what a quantity holds (an int64 of base units): sums are exact until then."""
    return {k: Quantity(max(-MAX_NANOS, min(MAX_NANOS, v.nanos)), v.format) for k, v in rl.items()}


def reference_totals(
    containers: list[ContainerSpec],
    overhead: Mapping[str, Quantity] | None = None,
    pod_level: tuple[ResourceList, ResourceList] | None = None,
) -> tuple[ResourceList, ResourceList]:
    """Kubernetes' rule written the obvious way, one Quantity operation at a time (``PodRequests``/``PodLimits``
    of k8s.io/component-helpers/resource/helpers.go, Kubernetes v1.35.0)."""
    ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
    out = []
    for pick in ("requests", "limits"):
        total: ResourceList = {}
        sidecars: ResourceList = {}
        peak: ResourceList = {}
        for c in ordered:
            rl = c.requests if pick == "requests" else c.limits
            if not c.init:
                total = add(total, rl)
            elif c.restartable:
                total = add(total, rl)
                sidecars = add(sidecars, rl)
                peak = maximum(peak, sidecars)
            else:
                peak = maximum(peak, add(rl, sidecars))
        out.append(maximum(total, peak))
    requests, limits = out
    if pod_level is not None:
        supported = ("cpu", "memory", "hugepages-2Mi")
        pl_req, pl_lim = pod_level
        if any(k in supported for k in pl_req):  # IsPodLevelRequestsSet
            for k, v in pl_req.items():
                if k in supported:
                    requests[k] = v
        if any(k in supported for k in (*pl_req, *pl_lim)):  # IsPodLevelResourcesSet
            for k, v in pl_lim.items():
                if k in supported:
                    limits[k] = v
    if overhead:
        requests = add(requests, overhead)
        # overhead goes to non-zero limits only
        limits = add({}, {k: (v + overhead[k] if k in overhead and v.nanos else v) for k, v in limits.items()})
    return within_range(requests), within_range(limits)


def exact(rl: Mapping[str, Quantity]) -> list[tuple[str, int, str, str]]:
    """Everything observable of a resource list: key order, value, format, printed form."""
    return [(k, q.nanos, q.format.value, q.canonical()) for k, q in rl.items()]


def outcome(fn: Any, *args: Any) -> Any:
    try:
        req, lim = fn(*args)
    except InvalidInput as e:
        return ("error", type(e).__name__, str(e))
    return exact(req), exact(lim)


# equal values in other formats ("1Ki", "1024", "1.024k", "1024e0"; "0", "0Gi", "0e0") make ties observable
QUANTITIES = ["0", "0Gi", "0e0", "1", "1000m", "1Ki", "1024", "1.024k", "1024e0", "2048", "1Gi", "50M", "1n", "8E"]
NAMES = ["cpu", "memory", "nvidia.com/gpu", "hugepages-2Mi"]
BAD = [-1, "-1", "abc", "", None, True, 1.5, 2, {"x": 1}, [1]]

resource_lists = st.dictionaries(st.sampled_from(NAMES), st.sampled_from(QUANTITIES), max_size=4)
raw_values = st.one_of(st.sampled_from(QUANTITIES), st.sampled_from(BAD))
raw_lists: st.SearchStrategy[Any] = st.one_of(
    st.dictionaries(st.sampled_from([*NAMES, ""]), raw_values, max_size=4),
    st.sampled_from([None, [], "x", {}]),
)


@st.composite
def containers(draw: st.DrawFn) -> list[ContainerSpec]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        init = draw(st.booleans())
        out.append(
            ContainerSpec(
                f"c{i}",
                parse_resource_list(draw(resource_lists)),
                parse_resource_list(draw(resource_lists)),
                init=init,
                restartable=init and draw(st.booleans()),
            )
        )
    return out


@settings(max_examples=400, deadline=None)
@given(containers(), st.one_of(st.none(), resource_lists))
def test_pod_totals_equal_the_reference(cs: list[ContainerSpec], overhead: dict[str, str] | None) -> None:
    oh = parse_resource_list(overhead) if overhead is not None else None
    assert outcome(pod_totals, cs, oh) == outcome(reference_totals, cs, oh)


@st.composite
def raw_pods(draw: st.DrawFn) -> dict[str, Any]:
    def container(i: int) -> Any:
        if draw(st.integers(0, 30)) == 0:
            return draw(st.sampled_from(["bad", None, 3]))
        c: dict[str, Any] = {"name": f"c{i}"}
        res = draw(st.one_of(st.fixed_dictionaries({}, optional={"requests": raw_lists, "limits": raw_lists})))
        c["resources"] = res if draw(st.integers(0, 20)) else draw(st.sampled_from([None, [], "x"]))
        if draw(st.booleans()):
            c["restartPolicy"] = draw(st.sampled_from(["Always", "Never"]))
        return c

    spec: dict[str, Any] = {"containers": [container(i) for i in range(draw(st.integers(0, 4)))]}
    if draw(st.booleans()):
        spec["initContainers"] = [container(i) for i in range(draw(st.integers(0, 4)))]
    if draw(st.booleans()):
        spec["overhead"] = draw(raw_lists)
    if draw(st.integers(0, 3)) == 0:
        spec["resources"] = draw(st.fixed_dictionaries({}, optional={"requests": raw_lists, "limits": raw_lists}))
    out: dict[str, Any] = {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}
    if draw(st.booleans()):  # what the kubelet reports under in-place resize
        names = [c.get("name") for c in [*spec["containers"], *spec.get("initContainers", [])] if isinstance(c, dict)]
        statuses = []
        for name in names:
            if draw(st.booleans()):
                cs: dict[str, Any] = {"name": name}
                if draw(st.integers(0, 4)):
                    cs["resources"] = draw(
                        st.fixed_dictionaries({}, optional={"requests": raw_lists, "limits": raw_lists})
                    )
                if draw(st.booleans()):
                    cs["allocatedResources"] = draw(raw_lists)
                statuses.append(cs)
        status: dict[str, Any] = {draw(st.sampled_from(["containerStatuses", "initContainerStatuses"])): statuses}
        reason = draw(st.sampled_from([None, "Infeasible", "Deferred"]))
        if reason is not None:
            status["conditions"] = [{"type": "PodResizePending", "status": "True", "reason": reason}]
        out["status"] = status
    return out


def reference_resources(pod: dict[str, Any]) -> tuple[ResourceList, ResourceList]:
    """``determineContainerReqs``/``determineContainerLimits`` then the totals, as the Go code reads."""
    spec = pod["spec"]
    overhead = parse_resource_list(spec.get("overhead"), "spec.overhead")
    status = pod.get("status") or {}
    reported = {}
    for field in ("containerStatuses", "initContainerStatuses"):
        for i, cs in enumerate(status.get(field) or []):
            if cs.get("resources") is not None:
                w = f"status.{field}[{i}]"
                res = cs["resources"]
                reported[cs["name"]] = (
                    parse_resource_list(res.get("requests"), f"{w}.resources.requests"),
                    parse_resource_list(res.get("limits"), f"{w}.resources.limits"),
                    parse_resource_list(cs.get("allocatedResources"), f"{w}.allocatedResources"),
                )
    infeasible = any(c.get("reason") == "Infeasible" for c in status.get("conditions") or [])
    containers = []
    for c in pod_containers(pod):
        if c.name in reported and (c.restartable or not c.init):
            st_req, st_lim, allocated = reported[c.name]
            if infeasible:
                c = replace(c, requests=maximum(st_req, allocated), limits=dict(st_lim))
            else:
                c = replace(
                    c, requests=maximum(maximum(c.requests, st_req), allocated), limits=maximum(c.limits, st_lim)
                )
        containers.append(c)
    pod_level = None
    if spec.get("resources") is not None:
        res = spec["resources"]
        pod_level = (
            parse_resource_list(res.get("requests"), "spec.resources.requests"),
            parse_resource_list(res.get("limits"), "spec.resources.limits"),
        )
    return reference_totals(containers, overhead, pod_level)


@settings(max_examples=600, deadline=None)
@given(raw_pods())
def test_pod_resources_equal_the_reference_also_when_memoised(pod: dict[str, Any]) -> None:
    expected = outcome(reference_resources, pod)
    assert outcome(pod_resources, pod) == expected
    assert outcome(pod_resources, pod) == expected  # the second time from the shape memo, if it was kept


def test_memo_never_confuses_equal_values_of_other_types() -> None:
    # 1 == True == 1.0 as dict keys and tuple items: only all-string shapes may be memoised
    text = {"kind": "Pod", "spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}
    assert exact(pod_resources(text)[0]) == [("cpu", 10**9, "DecimalSI", "1")]
    number = {"kind": "Pod", "spec": {"containers": [{"resources": {"requests": {"cpu": 1}}}]}}
    assert exact(pod_resources(number)[0]) == [("cpu", 10**9, "DecimalSI", "1")]
    boolean = {"kind": "Pod", "spec": {"containers": [{"resources": {"requests": {"cpu": True}}}]}}
    with pytest.raises(InvalidInput, match=r"spec.containers\[0\].resources.requests.cpu"):
        pod_resources(boolean)


def test_memoised_results_are_fresh_dicts() -> None:
    pod = {"kind": "Pod", "spec": {"containers": [{"resources": {"requests": {"memory": "1Gi"}}}]}}
    first, _ = pod_resources(pod)
    first["memory"] = Quantity.parse("5Gi")
    first["cpu"] = Quantity.parse("1")
    again, _ = pod_resources(pod)
    assert exact(again) == [("memory", 2**30 * 10**9, "BinarySI", "1Gi")]


def test_a_sum_past_the_range_is_cut_to_it() -> None:
    """Kubernetes adds decimal quantities exactly: two containers of ``8E`` make a pod that exists. Refused, it went
    unaccounted while native quota charged the rest of it (its memory requests here)."""
    pod = {
        "kind": "Pod",
        "spec": {"containers": [{"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "8E"}}}] * 2},
    }
    requests, limits = pod_resources(pod)
    assert requests["memory"] == Quantity.parse("2Gi")
    assert limits["memory"].nanos == MAX_NANOS
