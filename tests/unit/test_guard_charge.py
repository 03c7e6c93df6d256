"""The reservation guard holds a holder's pod to the room reserved for it, charged as quota admission charges it: its
policy's ``charge`` (CEL, ``deploy/components/reservation-guard/policy.yaml``) against ``shared.podusage`` (what the
ResourceQuota evaluator charges), over pod shapes quota admission computes otherwise than a plain sum."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from services.devtools.simcluster.policy import _Program
from shared.podusage import pod_quota_usage
from shared.quantity import Quantity
from shared.quota import guard

POLICIES: Final = Path(__file__).resolve().parents[2] / "deploy/components/reservation-guard/policy.yaml"
CHARGED: Final = ("cpu", "memory", "requests.cpu", "requests.memory", "limits.cpu", "limits.memory")


def _guard_variables() -> list[tuple[str, _Program]]:
    docs = [d for d in yaml.safe_load_all(POLICIES.read_text()) if d and d.get("kind") == "ValidatingAdmissionPolicy"]
    (policy,) = [d for d in docs if d["metadata"]["name"] == "vmquota-reservation-guard"]
    return [(v["name"], _Program(v["expression"])) for v in policy["spec"]["variables"]]


VARIABLES: Final = _guard_variables()


def _charge(pod: dict[str, Any]) -> dict[str, float]:
    """The policy's ``variables.charge`` of ``pod`` (its variables evaluated in order, as the API server does)."""
    params = guard.reservation("ns", frozenset({guard.Holder("u1", "vm1", "launcher pod")}), ["kubevirt"])
    activation: dict[str, Any] = {"object": pod, "params": params, "variables": {}}
    for name, program in VARIABLES:
        activation["variables"] = {**activation["variables"], name: program.run(activation)}
    return dict(activation["variables"]["charge"])


def _amount(cpu_millis: int, memory_mib: int) -> dict[str, str]:
    return {"cpu": f"{cpu_millis}m", "memory": f"{memory_mib}Mi"}


def _container(name: str, req: tuple[int, int], lim: tuple[int, int] | None, *, sidecar: bool = False) -> Any:
    resources: dict[str, Any] = {"requests": _amount(*req)}
    if lim is not None:
        resources["limits"] = _amount(*lim)
    return {"name": name, "image": "x", "resources": resources} | ({"restartPolicy": "Always"} if sidecar else {})


_sizes = st.tuples(st.integers(1, 4000), st.integers(1, 16384))


@st.composite
def _pods(draw: st.DrawFn) -> dict[str, Any]:
    """A pod of app containers, init containers (restartable ones among them, in any order: quota admission adds a
    restartable one to the init containers after it), perhaps pod-level resources and an overhead."""
    spec: dict[str, Any] = {
        "containers": [
            _container(f"c{i}", req, draw(st.one_of(st.none(), st.just(req), _sizes)))
            for i, req in enumerate(draw(st.lists(_sizes, min_size=1, max_size=3)))
        ]
    }
    inits = [
        _container(f"i{i}", req, req, sidecar=draw(st.booleans()))
        for i, req in enumerate(draw(st.lists(_sizes, max_size=4)))
    ]
    if inits:
        spec["initContainers"] = inits
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": spec}
    if draw(st.booleans()):
        # (pod-level resources, Kubernetes 1.32+: requests no smaller than the containers' together, limits no smaller
        # than any one container's, as the API server validates them)
        aggregate = pod_quota_usage(pod)
        extra = draw(_sizes)
        requests = {
            "cpu": f"{aggregate['requests.cpu'].nanos // 10**6 + extra[0]}m",
            "memory": f"{aggregate['requests.memory'].nanos // 10**9 + extra[1] * 2**20}",
        }
        spec["resources"] = {"requests": requests}
        every = spec["containers"] + inits
        if all("limits" in c["resources"] for c in every) and draw(st.booleans()):
            most = [max(Quantity.parse(c["resources"]["limits"][r]).nanos for c in every) for r in ("cpu", "memory")]
            spec["resources"]["limits"] = {
                "cpu": f"{most[0] // 10**6 + extra[0]}m",
                "memory": f"{most[1] // 10**9 + extra[1] * 2**20}",
            }
    if draw(st.booleans()):
        spec["overhead"] = _amount(*draw(_sizes))
    return pod


@settings(max_examples=200, deadline=None)
@given(_pods())
def test_the_guards_charge_of_a_pod_is_quota_admissions(pod: dict[str, Any]) -> None:
    """Within half a unit (a millicore, a byte): the policy compares approximate floats with that margin."""
    charged = pod_quota_usage(pod)
    found = _charge(pod)
    for r in CHARGED:
        want = charged.get(r, Quantity(0)).nanos / 1e9
        unit = 0.0005 if r.endswith("cpu") else 0.5
        assert abs(found[r] - want) < unit, (r, found[r], want)


def test_a_restartable_init_container_counts_beside_the_init_containers_after_it_only() -> None:
    """Istio's native sidecars: an init container, then the proxy as a restartable one. Quota admission charges the
    proxy beside the containers and the init containers after it, not before: charging it beside every init
    container (no index in CEL to tell) took 4 CPUs of a pod charged 3, beyond the evidence bound, and the drain of
    such a VM was refused for good."""
    pod = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "containers": [_container("compute", (100, 1300), (1000, 1300))],
            "initContainers": [
                _container("istio-init", (10, 40), (2000, 1024)),
                _container("istio-proxy", (100, 128), (2000, 1024), sidecar=True),
            ],
        },
    }
    charged = pod_quota_usage(pod)
    assert charged["limits.cpu"] == Quantity.parse("3")
    assert _charge(pod)["limits.cpu"] == pytest.approx(3.0)
