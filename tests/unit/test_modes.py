"""Accounting modes: names, what a VM counts in each, the pod/mode factors, and a quota's policy."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import InvalidInput
from shared.kubevirt import cpu_request
from shared.quantity import Quantity
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL, MODE_ANNOTATION, RATIO_ANNOTATION
from shared.quota.modes import (
    VMI_NAMES,
    Mode,
    ScopeRequirement,
    VmSize,
    mode_usage,
    parse_mode,
    parse_ratio,
    pod_factor,
    quota_policy,
    vmi_minimums,
)
from shared.resources import format_resource_list, parse_resource_list

Q = Quantity.parse
R10 = Fraction(10)

POD = parse_resource_list(
    {
        "pods": "1",
        "count/pods": "1",
        "cpu": "405m",
        "requests.cpu": "405m",
        "limits.cpu": "4",
        "memory": "8500Mi",
        "requests.memory": "8500Mi",
        "limits.memory": "17000Mi",
        "ephemeral-storage": "50M",
        "requests.ephemeral-storage": "50M",
        "hugepages-1Gi": "2Gi",
        "requests.hugepages-1Gi": "2Gi",
        "requests.nvidia.com/gpu": "1",
    }
)
UNDEFINED = {
    "ephemeral-storage": "50M",
    "requests.ephemeral-storage": "50M",
    "hugepages-1Gi": "2Gi",
    "requests.hugepages-1Gi": "2Gi",
    "requests.nvidia.com/gpu": "1",
}
SIZE = VmSize(4, Q("8Gi"))


def test_public_names() -> None:
    assert [m.value for m in Mode] == [
        "VmiPodUsage",
        "VirtualResources",
        "DedicatedVirtualResources",
        "VirtualResourcesWithCPUAllocationRatio",
    ]
    for m in Mode:
        assert parse_mode(m.value) is m


@pytest.mark.parametrize("bad", ["virtualresources", "Virtual", "", None, 3])
def test_parse_mode_lists_valid_names(bad: object) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_mode(bad)
    assert "VirtualResourcesWithCPUAllocationRatio" in str(err.value) and "VmiPodUsage" in str(err.value)


def test_vmi_pod_usage_is_the_pod() -> None:
    assert mode_usage(Mode.VMI_POD_USAGE, SIZE, POD, R10) == POD


def test_virtual_resources() -> None:
    u = format_resource_list(mode_usage(Mode.VIRTUAL_RESOURCES, SIZE, POD, R10))
    assert u == {
        "pods": "1",
        "count/pods": "1",
        "cpu": "4",
        "requests.cpu": "4",
        "limits.cpu": "4",
        "memory": "8Gi",
        "requests.memory": "8Gi",
        "limits.memory": "8Gi",
        **UNDEFINED,
    }


def test_ratio_mode_counts_cpu_as_kubevirt_renders_it() -> None:
    for vcpus, ratio, expect in [(4, Fraction(4), "1"), (1, R10, "100m"), (3, Fraction(2), "1500m")]:
        u = mode_usage(Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, VmSize(vcpus, Q("1Gi")), {}, ratio)
        assert u["requests.cpu"] == u["cpu"] == cpu_request(vcpus, ratio)
        assert u["cpu"].canonical() == expect
        assert u["limits.cpu"] == Quantity.from_int(vcpus)
        assert u["requests.memory"].canonical() == "1Gi"


def test_dedicated_counts_vmi_names_and_the_rest_at_pod_usage() -> None:
    u = format_resource_list(mode_usage(Mode.DEDICATED_VIRTUAL_RESOURCES, SIZE, POD, R10))
    assert u["requests.instances/vmi"] == u["instances/vmi"] == "1"
    assert u["requests.cpu/vmi"] == u["cpu/vmi"] == "4"
    assert u["requests.memory/vmi"] == u["memory/vmi"] == "8Gi"
    assert u["requests.cpu"] == "405m" and u["limits.memory"] == "17000Mi"  # not defined: pod usage
    assert set(VMI_NAMES) <= set(u)


def test_size_is_the_larger_of_spec_and_status() -> None:
    assert VmSize.of(2, Q("2Gi"), 4, Q("1Gi")) == VmSize(4, Q("2Gi"))
    assert VmSize.of(4, Q("2Gi"), 2, Q("3Gi")) == VmSize(4, Q("3Gi"))
    assert VmSize.of(1, None, None, None) == VmSize(1, Q("0"))


@pytest.mark.parametrize(
    ("mode", "resource", "kv", "oc", "mr", "expect"),
    [
        (Mode.VMI_POD_USAGE, "requests.cpu", 10, 100, 10, Fraction(1)),
        (Mode.VMI_POD_USAGE, "requests.memory", 10, 200, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES, "requests.cpu", 10, 100, 10, Fraction(1, 10)),
        (Mode.VIRTUAL_RESOURCES, "cpu", 4, 100, 4, Fraction(1, 4)),
        (Mode.VIRTUAL_RESOURCES, "limits.cpu", 10, 100, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES, "requests.memory", 10, 100, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES, "limits.memory", 10, 150, 10, Fraction(2, 3)),
        (Mode.VIRTUAL_RESOURCES, "pods", 10, 100, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES, "requests.nvidia.com/gpu", 10, 100, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, "requests.cpu", 10, 100, 10, Fraction(1)),
        (Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, "requests.cpu", 10, 100, 4, Fraction(2, 5)),
        (Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, "requests.cpu", 4, 100, 10, Fraction(1)),
        (Mode.DEDICATED_VIRTUAL_RESOURCES, "requests.cpu", 10, 100, 10, Fraction(1)),
        (Mode.DEDICATED_VIRTUAL_RESOURCES, "requests.cpu/vmi", 10, 100, 10, None),
        (Mode.VIRTUAL_RESOURCES, "instances/vmi", 10, 100, 10, None),
    ],
)
def test_pod_factor(mode: Mode, resource: str, kv: int, oc: int, mr: int, expect: Fraction | None) -> None:
    got = pod_factor(mode, resource, kubevirt_ratio=Fraction(kv), memory_overcommit=oc, mode_ratio=Fraction(mr))
    assert got == expect


@given(
    st.integers(min_value=1, max_value=256),
    st.integers(min_value=1, max_value=64),
    st.sampled_from([1, 2, 4, 5, 8, 10, 16]),
    st.sampled_from([1, 2, 4, 5, 8, 10, 16]),
)
def test_pod_factor_bounds_the_pod_charge(vcpus: int, kv: int, mr: int, gib: int) -> None:
    """KubeVirt's CPU request for the VM is at least factor x what the mode counts."""
    size = VmSize(vcpus, Q(f"{gib}Gi"))
    pod_cpu = cpu_request(vcpus, Fraction(kv))
    for mode in (Mode.VIRTUAL_RESOURCES, Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO):
        u = mode_usage(mode, size, {}, Fraction(mr))
        k = pod_factor(
            mode, "requests.cpu", kubevirt_ratio=Fraction(kv), memory_overcommit=100, mode_ratio=Fraction(mr)
        )
        assert k is not None and 0 < k <= 1
        assert pod_cpu.value >= k * u["requests.cpu"].value


def managed(**ann: str) -> tuple[dict[str, str], dict[str, str]]:
    return {MANAGED_LABEL: "true"}, dict(ann)


def test_policy_of_unmanaged_quota_is_none() -> None:
    assert quota_policy("rq", {}, {}, {}) is None
    assert quota_policy("rq", {MANAGED_LABEL: "false"}, {}, {}) is None


def test_policy_defaults_and_budget_sources() -> None:
    hard = parse_resource_list({"requests.cpu": "4"})
    pol = quota_policy("rq", *managed(), hard)
    assert pol is not None and pol.mode is Mode.VMI_POD_USAGE and pol.budget == hard
    assert pol.ratio(R10) == R10
    labels, ann = managed(
        **{
            MODE_ANNOTATION: "VirtualResourcesWithCPUAllocationRatio",
            RATIO_ANNOTATION: "2.5",
            BUDGET_ANNOTATION: json.dumps({"requests.cpu": "8", "limits.memory": "64Gi"}),
        }
    )
    pol = quota_policy("rq", labels, ann, hard)
    assert pol is not None
    assert pol.mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO
    assert pol.ratio(R10) == Fraction(5, 2)
    assert format_resource_list(pol.budget) == {"limits.memory": "64Gi", "requests.cpu": "8"}


@pytest.mark.parametrize(
    ("ann", "field"),
    [
        ({MODE_ANNOTATION: "Pods"}, MODE_ANNOTATION),
        ({RATIO_ANNOTATION: "0"}, RATIO_ANNOTATION),
        ({RATIO_ANNOTATION: "ten"}, RATIO_ANNOTATION),
        ({BUDGET_ANNOTATION: "{not json"}, BUDGET_ANNOTATION),
        ({BUDGET_ANNOTATION: '{"cpu": "1K"}'}, BUDGET_ANNOTATION),
    ],
)
def test_bad_policy_annotations_name_quota_and_annotation(ann: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        quota_policy("rq", {MANAGED_LABEL: "true"}, ann, {})
    assert "ResourceQuota rq" in str(err.value) and field in str(err.value)


def test_unsupported_scope_is_refused() -> None:
    with pytest.raises(InvalidInput, match="CrossNamespacePodAffinity"):
        quota_policy("rq", {MANAGED_LABEL: "true"}, {}, {}, (ScopeRequirement("CrossNamespacePodAffinity"),))


def test_vmi_minimums_are_k_per_unit_of_size_in_the_vm_term_modes_only() -> None:
    """A VMI's explicit amounts must be at least ``k`` times what the mode counts per byte of guest memory or per
    vCPU, rounded down (KubeVirt's own default request, guest x 100 / overcommit, passes)."""
    gi = Quantity.parse("16Gi")
    budget = {"requests.memory": gi, "requests.cpu": Quantity.parse("4"), "limits.cpu": Quantity.parse("8")}
    factors = {"requests.memory": Fraction(100, 150), "requests.cpu": Fraction(1, 10), "limits.cpu": Fraction(1)}
    assert vmi_minimums(Mode.VIRTUAL_RESOURCES, budget, factors, Fraction(10)) == {
        "limits.cpu": "1",
        "requests.cpu": "0.1",
        "requests.memory": "0.666666",
    }
    # the ratio mode counts vCPUs / its ratio: 4 (k = 4 / 10), so a vCPU needs a tenth of a core as KubeVirt renders
    ratio = {"requests.cpu": Quantity.parse("4")}
    assert vmi_minimums(
        Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO, ratio, {"requests.cpu": Fraction(4, 10)}, Fraction(4)
    ) == {"requests.cpu": "0.1"}
    # v1.6.2 overcommits an explicit request too: the request must be the guest memory itself
    memory = {"requests.memory": gi}
    twice = vmi_minimums(
        Mode.VIRTUAL_RESOURCES,
        memory,
        {"requests.memory": Fraction(1, 2)},
        Fraction(10),
        request_overcommit=Fraction(2),
    )
    assert twice == {"requests.memory": "1"}
    assert vmi_minimums(Mode.VMI_POD_USAGE, budget, factors, Fraction(10)) == {}
    assert vmi_minimums(Mode.DEDICATED_VIRTUAL_RESOURCES, budget, factors, Fraction(10)) == {}
    assert vmi_minimums(
        Mode.VIRTUAL_RESOURCES, {"requests.memory": gi}, {"requests.memory": Fraction(1)}, Fraction(10)
    ) == {"requests.memory": "1"}


@pytest.mark.parametrize("space", ["\x1c", "\x1d", "\x1e", "\x1f"])
def test_a_mode_or_ratio_is_trimmed_as_the_guards_cel_trims_it(space: str) -> None:
    """The reservation guard's policy reads the mode and the quota's own ratio with CEL's ``trim()``, which strips
    what Go's ``unicode.IsSpace`` calls space; Python's ``str.strip()`` strips ``\x1c`` to ``\x1f`` as well. A ratio
    of ``"10\x1f"`` was 10 to the enforcer and ``10\x1f`` to the policy, whose status text then never matched the
    enforcer's: the namespace admitted no pod for good. Such a mode or ratio is invalid now (the quota Refused)."""
    with pytest.raises(InvalidInput):
        parse_ratio("10" + space, "r")
    with pytest.raises(InvalidInput):
        parse_mode("VirtualResources" + space)
    assert parse_ratio("\u00a010 \t", "r") == 10 and parse_mode(" VirtualResources\u3000") is Mode.VIRTUAL_RESOURCES
