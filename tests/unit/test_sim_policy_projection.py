"""The simulated API server hands CEL only what an expression reads of its activation (``policy._read_paths``,
``policy._project``): every expression of the shipped policies must evaluate alike on that projection and on the
whole activation — the same value, or an error in both — whatever fields the objects lack or hold in another
shape."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.devtools.simcluster.policy import _cel, _Program, _project, _read_paths
from shared.quota import guard
from tests.builders import launcher_obj, quota_obj, vmi_obj, vmim_obj

POLICIES: Final = Path(__file__).resolve().parents[2] / "deploy/components/reservation-guard/policy.yaml"
KUBEVIRT: Final = "system:serviceaccount:kubevirt:kubevirt-controller"


def _policies() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all(POLICIES.read_text())
    return [d for d in docs if d and d.get("kind") == "ValidatingAdmissionPolicy"]


def _expressions(policy: dict[str, Any]) -> Iterator[tuple[str, str]]:
    spec = policy["spec"]
    for part in ("matchConditions", "variables", "validations"):
        for entry in spec.get(part) or []:
            yield part, str(entry["expression"])
            if entry.get("messageExpression"):
                yield part, str(entry["messageExpression"])


def _object(resource: str) -> dict[str, Any]:
    vmi = vmi_obj("vm1", vcpus=2, guest="2Gi", status_vcpus=1, status_guest="1Gi")
    vmi["metadata"].setdefault("annotations", {})["kubevirt.io/memory-overhead-bytes"] = "1000"
    return {
        "pods": launcher_obj(vmi),
        "virtualmachineinstances": vmi,
        "virtualmachineinstancemigrations": vmim_obj("m1", "vm1"),
        "resourcequotas": quota_obj("rq", {"limits.memory": "8Gi"}),
    }[resource]


def _param(kind: str) -> dict[str, Any]:
    holder = guard.Holder("uid-vm1", "vm1", "launcher pod")
    return {
        "ResourceQuota": quota_obj("rq", {"limits.memory": "8Gi"}, budget={"limits.memory": "8Gi"}),
        "QuotaReservation": guard.reservation("ns", frozenset({holder}), [KUBEVIRT], frozenset({"uid-vm1"})),
        "VirtualMachineInstanceMigration": vmim_obj("m1", "vm1", phase="Scheduling"),
        "VirtualMachineInstance": vmi_obj("vm1", vcpus=2, guest="2Gi", status_vcpus=1, status_guest="1Gi"),
    }[kind]


REPLACEMENTS: Final[tuple[Any, ...]] = (None, [], {}, "x", 0, "1Gi", True, [{"name": "x"}])


def _mutate(obj: Any, draws: list[tuple[int, int, int]]) -> Any:
    """``obj`` with a field removed or given another value, once per draw (a walk from the root by the draw)."""
    obj = copy.deepcopy(obj)
    for depth, pick, how in draws:
        node = obj
        for _ in range(depth):
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            child = node[keys[pick % len(keys)]] if keys else None
            if not isinstance(child, dict | list) or not child:
                break
            node = child
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            continue
        key = keys[pick % len(keys)]
        if how == len(REPLACEMENTS) and isinstance(node, dict):
            del node[key]
        else:
            node[key] = copy.deepcopy(REPLACEMENTS[how % len(REPLACEMENTS)])
    return obj


def _outcome(program: _Program, data: dict[str, Any], *, projected: bool) -> tuple[str, Any]:
    if projected:
        try:
            return "value", program.run(data)
        except Exception:
            return "error", None
    value = program._program.eval(data=data)
    if value.type() == _cel()[1]:
        return "error", None
    return "value", value.plain_value()


CASES: Final = [
    (policy["metadata"]["name"], part, expression, policy)
    for policy in _policies()
    for part, expression in _expressions(policy)
]
draws = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 1000), st.integers(0, len(REPLACEMENTS))), min_size=0, max_size=4
)


@pytest.mark.parametrize(
    ("policy_name", "part", "expression", "policy"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    new=draws,
    old=draws,
    param=draws,
    operation=st.sampled_from(["CREATE", "UPDATE", "DELETE"]),
    user=st.sampled_from([KUBEVIRT, "system:admin", "alice"]),
)
def test_an_expression_evaluates_alike_on_what_it_reads_and_on_the_whole_activation(
    policy_name: str,
    part: str,
    expression: str,
    policy: dict[str, Any],
    new: list[tuple[int, int, int]],
    old: list[tuple[int, int, int]],
    param: list[tuple[int, int, int]],
    operation: str,
    user: str,
) -> None:
    spec = policy["spec"]
    resource = spec["matchConstraints"]["resourceRules"][0]["resources"][0].partition("/")[0]
    base = _object(resource)
    request = {
        "operation": operation,
        "name": base["metadata"]["name"],
        "namespace": "ns",
        "subResource": "",
        "userInfo": {"username": user, "groups": ["system:authenticated"]},
        "options": {"propagationPolicy": "Orphan"} if operation == "DELETE" else None,
    }
    data: dict[str, Any] = {
        "object": None if operation == "DELETE" else _mutate(base, new),
        "oldObject": None if operation == "CREATE" else _mutate(base, old),
        "request": request,
        "params": _mutate(_param(spec["paramKind"]["kind"]), param) if spec.get("paramKind") else None,
        "namespaceObject": {"metadata": {"name": "ns", "labels": {"kubernetes.io/metadata.name": "ns"}}},
        "variables": {},
    }
    for var in spec.get("variables") or []:  # (what the whole activation gives: both sides read the same)
        kind, value = _outcome(_Program(str(var["expression"])), data, projected=False)
        if kind == "value":
            data["variables"] = {**data["variables"], str(var["name"]): value}
    program = _Program(expression)
    assert _outcome(program, data, projected=True) == _outcome(program, data, projected=False), (
        f"{policy_name} ({part}): {expression}"
    )


@pytest.mark.parametrize(
    ("expression", "reads"),
    [
        (
            "object.metadata.name == params.spec.vmiName",
            {"object": {("metadata", "name")}, "params": {("spec", "vmiName")}},
        ),
        ("object != null && has(object.metadata.labels)", {"object": {(), ("metadata", "labels")}}),
        ("object.metadata.name.startsWith('a')", {"object": {("metadata", "name")}}),
        ("object.spec.domain[k]", {"object": {("spec", "domain")}}),
        ("object.spec\n  .domain", {"object": {("spec",)}}),
        ("oldObject.spec.x.all(k, k != '')", {"oldObject": {("spec", "x")}}),
        ("variables.a + 'object.metadata'", {"variables": {("a",)}, "object": {("metadata",)}}),
        ("x.object.y", {}),
        ("object['spec'].x", {"object": {()}}),
        ("object.?spec.x", {"object": {()}}),
    ],
)
def test_the_paths_an_expression_reads(expression: str, reads: dict[str, set[tuple[str, ...]]]) -> None:
    assert _read_paths(expression) == {k: frozenset(v) for k, v in reads.items()}


def test_a_projection_keeps_the_subtrees_the_paths_end_in_and_no_more() -> None:
    obj = {"a": {"b": {"c": 1, "d": [1, 2]}, "e": 2}, "f": [3], "g": "h"}
    assert _project(obj, frozenset({("a", "b")})) == {"a": {"b": {"c": 1, "d": [1, 2]}}}
    assert _project(obj, frozenset({("a", "x"), ("f", "y")})) == {"a": {}, "f": [3]}
    assert _project(obj, frozenset({("a", "e"), ()})) == obj
    assert _project(None, frozenset({("a",)})) is None
