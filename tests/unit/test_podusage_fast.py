"""The fast pod totals (integer accumulation, shape memo) against a plain reference built from
``shared.resources.add``/``maximum``: same values, formats, key order and errors, over random pods."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.errors import InvalidInput, InvalidQuantity
from shared.podusage import ContainerSpec, pod_containers, pod_resources, pod_totals
from shared.quantity import MAX_NANOS, NANO, Quantity
from shared.resources import ResourceList, add, maximum, parse_resource_list


def checked_add(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> ResourceList:
    """``resources.add`` with the range check a single pod's totals get (sums past int64 are refused)."""
    out = add(a, b)
    for v in out.values():
        if abs(v.nanos) > MAX_NANOS:
            raise InvalidQuantity(f"{Fraction(v.nanos, NANO)} is larger than Kubernetes can represent")
    return out


def reference_totals(
    containers: list[ContainerSpec], overhead: Mapping[str, Quantity] | None = None
) -> tuple[ResourceList, ResourceList]:
    """Kubernetes' rule written the obvious way, one Quantity operation at a time."""
    ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
    out = []
    for pick in ("requests", "limits"):
        total: ResourceList = {}
        sidecars: ResourceList = {}
        peak: ResourceList = {}
        for c in ordered:
            rl = c.requests if pick == "requests" else c.limits
            if not c.init:
                total = checked_add(total, rl)
            elif c.restartable:
                total = checked_add(total, rl)
                sidecars = checked_add(sidecars, rl)
                peak = maximum(peak, sidecars)
            else:
                peak = maximum(peak, checked_add(rl, sidecars))
        out.append(maximum(total, peak))
    requests, limits = out
    if overhead:
        requests = checked_add(requests, overhead)
        limits = checked_add({}, {k: (v + overhead[k] if k in overhead else v) for k, v in limits.items()})
    return requests, limits


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
NAMES = ["cpu", "memory", "nvidia.com/gpu"]
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
    return {"kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}


def reference_resources(pod: dict[str, Any]) -> tuple[ResourceList, ResourceList]:
    spec = pod["spec"]
    overhead = parse_resource_list(spec.get("overhead"), "spec.overhead")
    return reference_totals(pod_containers(pod), overhead)


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


def test_sum_over_the_range_names_the_sum() -> None:
    pod = {"kind": "Pod", "spec": {"containers": [{"resources": {"limits": {"memory": "8E"}}}] * 2}}
    with pytest.raises(InvalidInput, match="16000000000000000000 is larger than Kubernetes can represent"):
        pod_resources(pod)
