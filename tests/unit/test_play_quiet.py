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
QUOTAS = Resource("", "v1", "resourcequotas", "ResourceQuota", True)


def refusal(vmi: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "tenant-a", "name": f"{vmi}.1"},
        "reason": "FailedCreate",
        "message": 'pods "virt-launcher-x" is forbidden: exceeded quota: compute, requested: limits.memory=1Gi',
        "involvedObject": {"kind": "VirtualMachineInstance", "name": vmi},
    }


def quota(hard: dict[str, str], used: str) -> dict[str, Any]:
    meta = {"namespace": "tenant-a", "name": "compute"}
    return {"metadata": meta, "spec": {"hard": hard}, "status": {"hard": hard, "used": {"limits.memory": used}}}


def launcher(vmi: str) -> dict[str, Any]:
    owner = {"kind": "VirtualMachineInstance", "name": vmi, "uid": f"uid-{vmi}"}
    return {"metadata": {"namespace": "tenant-a", "name": f"virt-launcher-{vmi}-x", "ownerReferences": [owner]}}


def test_the_quiet_grows_with_the_slowest_reaction_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half a second of quiet ended a step while vmquota, slower on a loaded machine, was still at work: the raise for
    a refused pod came after the step's outcome was read. The quiet is three times the slowest time seen from a
    refusal of a VMI's pod to the creation of one, once that is longer than ``settle``, and at most ``QUIET_MAX``; a
    VMI that stays refused (a VM that does not fit) measures nothing, and the time a VM waits for a later step to
    free its room counts from that step (the quota charging less), not from its refusal."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sc = builtin_scenarios()[0]
    observer = play.Observer(None, sc, play.RunResult(scenario=sc.name, with_vmquota=True))  # type: ignore[arg-type]
    assert observer.quiet_for(0.5) == 0.5
    assert "tenant-a/compute" in observer._quota_keys, sc.name
    observer("ADDED", QUOTAS, quota({"limits.memory": "64Gi"}, used="64Gi"))
    observer("ADDED", EVENTS, refusal("vm1"))
    observer("ADDED", EVENTS, refusal("vm4"))  # (never admitted)
    clock[0] += 0.1
    observer("MODIFIED", EVENTS, refusal("vm1"))  # (a repeat: the reaction counts from the first)
    clock[0] += 0.7
    observer("MODIFIED", QUOTAS, quota({"limits.memory": "64Gi"}, used="80Gi"))  # (admission charges vm1's pod)
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

    clock[0] += 30.0  # vm4 waited for a later step: a VM stopped, the quota controller charges less
    observer("MODIFIED", QUOTAS, quota({"limits.memory": "64Gi"}, used="48Gi"))
    clock[0] += 0.5  # the raise for vm4 (a reaction: its clock runs on), then its pod
    observer("MODIFIED", QUOTAS, quota({"limits.memory": "80Gi"}, used="48Gi"))
    clock[0] += 0.4
    observer("ADDED", PODS, launcher("vm4"))
    assert observer.slowest == pytest.approx(0.9)
    observer.slowest = 60.0
    assert observer.quiet_for(0.5) == play.QUIET_MAX


def test_without_vmquota_nothing_is_a_reaction(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sc = builtin_scenarios()[0]
    observer = play.Observer(None, sc, play.RunResult(scenario=sc.name, with_vmquota=False))  # type: ignore[arg-type]
    observer("ADDED", EVENTS, refusal("vm1"))
    clock[0] += 5.0  # (KubeVirt's backoff)
    observer("ADDED", PODS, launcher("vm1"))
    assert observer.slowest == 0.0
