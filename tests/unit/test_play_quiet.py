"""The demo player's quiet rule: a wait ends after ``settle`` seconds of no writes, or longer on a machine where
vmquota was seen to react slower (``services.devtools.demo.play.Observer``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.devtools.demo import play
from services.devtools.demo.scenario import builtin_scenarios
from services.devtools.simcluster.store_api import Resource

EVENTS = Resource("", "v1", "events", "Event", True)
PODS = Resource("", "v1", "pods", "Pod", True)


def refusal(vmi: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "tenant-a", "name": f"{vmi}.1"},
        "reason": "FailedCreate",
        "message": 'pods "virt-launcher-x" is forbidden: exceeded quota: compute, requested: limits.memory=1Gi',
        "involvedObject": {"kind": "VirtualMachineInstance", "name": vmi},
    }


def launcher(vmi: str) -> dict[str, Any]:
    owner = {"kind": "VirtualMachineInstance", "name": vmi, "uid": f"uid-{vmi}"}
    return {"metadata": {"namespace": "tenant-a", "name": f"virt-launcher-{vmi}-x", "ownerReferences": [owner]}}


def test_the_quiet_grows_with_the_slowest_reaction_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half a second of quiet ended a step while vmquota, slower on a loaded machine, was still at work: the raise for
    a refused pod came after the step's outcome was read. The quiet is three times the slowest time seen from a
    refusal of a VMI's pod to the creation of one, once that is longer than ``settle``; a VMI that stays refused
    (a VM that does not fit) measures nothing."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sc = builtin_scenarios()[0]
    observer = play.Observer(None, sc, play.RunResult(scenario=sc.name, with_vmquota=True))  # type: ignore[arg-type]
    assert observer.quiet_for(0.5) == 0.5
    observer("ADDED", EVENTS, refusal("vm1"))
    observer("ADDED", EVENTS, refusal("vm4"))  # (never admitted)
    clock[0] += 0.1
    observer("MODIFIED", EVENTS, refusal("vm1"))  # (a repeat: the reaction counts from the first)
    clock[0] += 0.7
    observer("ADDED", PODS, launcher("vm1"))
    assert observer.slowest == pytest.approx(0.8)
    assert observer.quiet_for(0.5) == pytest.approx(2.4) and observer.quiet_for(5.0) == 5.0
    clock[0] += 2.3
    assert not observer.quiet(0.5)
    clock[0] += 0.2
    assert observer.quiet(0.5)
    clock[0] += 10.0
    observer("ADDED", PODS, launcher("vm2"))  # (never refused: no reaction)
    assert observer.slowest == pytest.approx(0.8)
