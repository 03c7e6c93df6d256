"""The enforcer's writes to tenants' VMIs, off the reconcile path (services/enforcer/reporting.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from services.enforcer.kube import KubeError, QuotaApi
from services.enforcer.options import NUDGING_MAX, NUDGING_PER_NAMESPACE, EnforcerMetrics, EnforcerOptions
from services.enforcer.reporting import Reporter
from services.platform.bus import Bus
from services.platform.http import Metrics
from shared import contract
from tests.builders import usage_snapshot
from tests.waiting import wait_until

_made: list[Reporter] = []


@pytest.fixture(autouse=True)
async def _stopped() -> AsyncIterator[None]:
    """Each reporter a test made stopped after it (its nudge queue's workers)."""
    yield
    while _made:
        await _made.pop().stop()


def _reporter(kube: object, **opts: Any) -> Reporter:
    """A reporter whose Kubernetes calls are ``kube``'s (nudges do not touch the bus), with options ``opts``."""
    registry = CollectorRegistry()
    reporter = Reporter(
        cast(Bus, None),
        cast(QuotaApi, kube),
        EnforcerOptions(cluster="c1", **opts),
        Metrics(registry),
        EnforcerMetrics(registry),
        lambda: datetime(2026, 1, 1, tzinfo=UTC),
    )
    _made.append(reporter)
    return reporter


class _SlowNudges:
    """An API server whose VMI patches wait until released: how many are under way at once is what is counted."""

    def __init__(self) -> None:
        self.under_way = self.most = 0
        self.nudged: list[str] = []
        self.namespaces: set[str] = set()
        """The namespaces of the patches under way."""
        self.release = asyncio.Event()

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.under_way += 1
        self.most = max(self.most, self.under_way)
        self.namespaces.add(namespace)
        try:
            await self.release.wait()
            self.nudged.append(name)
        finally:
            self.under_way -= 1


async def test_a_tenants_many_nudges_take_a_bounded_share_of_the_api_client() -> None:
    """A tenant with a thousand admitted VMIs whose launcher pods were refused had a thousand VMI patches under way at
    once, on the API client every namespace's quota patches share. At most ``NUDGING_PER_NAMESPACE`` of one namespace
    are (``NUDGING_MAX`` of all); every one is made."""
    kube = _SlowNudges()
    reporter = _reporter(kube)
    vms = [contract.VmState(name=f"vm{i}", uid=f"u{i}", state="admitted", pod_refused=True) for i in range(1000)]
    usage = usage_snapshot("tenant", 1, vms=vms)
    reporter.tell_and_nudge("tenant", usage, 1)
    await wait_until(lambda: kube.under_way == NUDGING_PER_NAMESPACE, 10, "the first nudges under way")
    for _ in range(5):
        await asyncio.sleep(0)
    assert kube.most == NUDGING_PER_NAMESPACE
    # (the next snapshots, past the nudge interval: a VMI whose nudge waits its turn gets no second one; one whose
    # nudge is under way gets one after it, which may be the one that finds the room)
    later = msgspec.structs.replace(usage, seq=2)
    reporter.opts = EnforcerOptions(cluster="c1", nudge_interval=0.0)
    reporter.tell_and_nudge("tenant", later, 2)
    kube.release.set()
    await wait_until(lambda: len(kube.nudged) == len(vms) + NUDGING_PER_NAMESPACE, 10, "every VMI nudged")
    assert kube.most == NUDGING_PER_NAMESPACE and sorted(set(kube.nudged)) == sorted(v.name for v in vms)
    reporter.tell_and_nudge("tenant", msgspec.structs.replace(usage, seq=3), 3)
    await wait_until(
        lambda: len(kube.nudged) == 2 * len(vms) + NUDGING_PER_NAMESPACE, 10, "nudged again once they were made"
    )


async def test_one_namespaces_many_nudges_keep_no_other_namespaces_nudge_waiting() -> None:
    """One queue served every namespace in turn of arrival: a tenant with hundreds of VMIs to nudge, again at each of
    its usages, kept another namespace's VM behind them all (1.3 s with 500 VMIs and 40 ms a patch, growing with
    both), past the second in which a VM that fits is to start. A namespace's nudges now wait behind its own."""
    kube = _SlowNudges()
    reporter = _reporter(kube)
    many = [contract.VmState(name=f"vm{i}", uid=f"u{i}", state="admitted", pod_refused=True) for i in range(100)]
    reporter.tell_and_nudge("busy", usage_snapshot("busy", 1, vms=many), 1)
    for n in range(5):  # (other namespaces with a few each)
        few = [contract.VmState(name=f"w{n}", uid=f"w{n}", state="admitted", pod_refused=True)]
        reporter.tell_and_nudge(f"ns{n}", usage_snapshot(f"ns{n}", 1, vms=few), 1)
    others = {f"ns{n}" for n in range(5)}
    await wait_until(lambda: others <= kube.namespaces, 10, "the other namespaces' nudges under way")
    assert kube.most <= NUDGING_MAX
    kube.release.set()
    await wait_until(lambda: len(kube.nudged) == len(many) + 5, 10, "every VMI nudged")


class _Tokens:
    """An API server that records each VMI patch's annotation value."""

    def __init__(self) -> None:
        self.tokens: list[tuple[str, str]] = []

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.tokens.append((name, token))


async def test_a_holder_let_in_again_with_no_new_usage_is_touched_with_another_value() -> None:
    """A holder let in, put back to unconfirmed (its listing read again after a failed write) and let in again with
    no new usage was touched with the same annotation value: a patch that changes nothing is no update, and KubeVirt
    saw none. Each let-in's touch has a value of its own."""
    kube = _Tokens()
    reporter = _reporter(kube)
    pending = contract.MigrationState(name="m1", vmi="vm1", vmi_uid="uid-vm1", state="pending")
    usage = usage_snapshot("tenant", 7, migrations=[pending])
    for n in (1, 2):
        reporter.tell_and_nudge("tenant", usage, 7, frozenset({"uid-vm1"}))
        await wait_until(lambda: reporter.settled(), 10, "the holder's VMI touched")
        assert len(kube.tokens) == n
    assert [name for name, _ in kube.tokens] == ["vm1", "vm1"]
    assert kube.tokens[0][1] != kube.tokens[1][1], kube.tokens
    await wait_until(lambda: reporter.settled(), 10, "the touches done")
    reporter.tell_and_nudge("tenant", usage, 7)
    assert reporter.settled() and len(kube.tokens) == 2, "touched again with nothing let in"


class _FirstAnswerWaits:
    """An API server that has each VMI patch at once, but answers the first only when released."""

    def __init__(self) -> None:
        self.tokens: list[tuple[str, str]] = []
        self.release = asyncio.Event()

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.tokens.append((name, token))  # (the patch is in: KubeVirt may act on it now)
        if len(self.tokens) == 1:
            await self.release.wait()  # (its answer is on its way)


async def test_a_holder_let_in_while_a_touch_of_its_vmi_is_under_way_is_touched_again() -> None:
    """A touch of an admitted VM's VMI went out while its holder was still unconfirmed (KubeVirt's retry then refused
    by the guard); the holder was let in while that touch's answer was on its way. The touch under way counted as
    enough, and the VMI waited for KubeVirt's backoff. One asked for while one is under way follows it."""
    kube = _FirstAnswerWaits()
    reporter = _reporter(kube, nudge_interval=0.0)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 6, vms=[vm]), 6)
    await wait_until(lambda: len(kube.tokens) == 1, 10, "the first touch under way")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, vms=[vm]), 7, frozenset({"uid-vm1"}))
    kube.release.set()
    await wait_until(lambda: reporter.settled(), 10, "the touches done")
    assert len(kube.tokens) == 2 and kube.tokens[1][1] != kube.tokens[0][1], kube.tokens


async def test_a_usage_with_room_within_the_nudge_interval_of_a_vain_touch_is_nudged_when_it_has_passed() -> None:
    """During a migration a new VM that fits is admitted with no native room: each usage touches its VMI in vain,
    and each vain try doubles KubeVirt's backoff. The usage with room (the source pod ended) came within
    ``nudge_interval`` of the last vain touch, and its touch was dropped: the VM waited for KubeVirt's backoff
    (3.2 s in the simulated cluster; 28 s with a tenant changing the namespace's usage all along). It is made once
    the interval has passed."""
    kube = _Tokens()
    reporter = _reporter(kube)  # (``nudge_interval``: 0.2 s)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 6, vms=[vm]), 6)  # (no native room yet)
    await wait_until(lambda: len(kube.tokens) == 1, 10, "the first touch")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, vms=[vm]), 7)  # (room now)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 8, vms=[vm]), 8)  # (one touch waits, for the latest)
    await wait_until(lambda: len(kube.tokens) == 2 and reporter.settled(), 10, "the usage with room's touch")
    assert kube.tokens[1][1].startswith("8."), kube.tokens


@pytest.mark.parametrize("then", ["running", "gone", "touched"])
async def test_a_nudge_waiting_for_the_interval_is_taken_back_once_no_longer_due(then: str) -> None:
    """A touch waits for the interval; then the next usage has the VM running (its pod got in), or no longer lists
    it (deleted), or the VMI is touched meanwhile for a newer usage (a holder let in): the waiting touch is not
    made. (A VMI the usage no longer listed was touched all the same, and one touched meanwhile twice within the
    interval, the older usage's sequence recorded last.)"""
    kube = _Tokens()
    reporter = _reporter(kube)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 6, vms=[vm]), 6)
    await wait_until(lambda: len(kube.tokens) == 1, 10, "the first touch")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, vms=[vm]), 7)
    if then == "touched":
        pending = contract.MigrationState(name="m1", vmi="vm1", vmi_uid="uid-vm1", state="pending")
        opened = usage_snapshot("tenant", 9, vms=[vm], migrations=[pending])
        reporter.tell_and_nudge("tenant", opened, 9, frozenset({"uid-vm1"}))
    else:
        vms = [msgspec.structs.replace(vm, state="running", pod_refused=False)] if then == "running" else []
        reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 8, vms=vms), 8)
    await wait_until(lambda: reporter.settled(), 10, "the waiting touch's turn")
    assert [t.split(".")[0] for _, t in kube.tokens] == (["6", "9"] if then == "touched" else ["6"]), kube.tokens


async def test_a_usage_with_room_while_a_vain_touch_is_under_way_is_nudged_after_it() -> None:
    """As above, with the vain touch's answer still on its way when the usage with room came: the touch under way
    counted as enough, though KubeVirt may have tried (and been refused) before the room was made."""
    kube = _FirstAnswerWaits()
    reporter = _reporter(kube, nudge_interval=0.0)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 6, vms=[vm]), 6)
    await wait_until(lambda: len(kube.tokens) == 1, 10, "the first touch under way")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, vms=[vm]), 7)
    kube.release.set()
    await wait_until(lambda: reporter.settled(), 10, "the touches done")
    assert len(kube.tokens) == 2 and kube.tokens[1][1].startswith("7."), kube.tokens


class _FirstFails:
    """An API server whose first VMI patch fails (a transient error)."""

    def __init__(self) -> None:
        self.tokens: list[tuple[str, str]] = []

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.tokens.append((name, token))
        if len(self.tokens) == 1:
            raise KubeError(503, "ServiceUnavailable", "try again")


async def test_a_touch_that_fails_once_is_tried_again() -> None:
    """A holder is let in once; no later usage snapshot touches its VMI again (it was never refused a launcher
    pod): a touch that failed once left it to KubeVirt's backoff. A transient failure is tried again."""
    kube = _FirstFails()
    reporter = _reporter(kube, retry_base=0.001)
    pending = contract.MigrationState(name="m1", vmi="vm1", vmi_uid="uid-vm1", state="pending")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, migrations=[pending]), 7, frozenset({"uid-vm1"}))
    await wait_until(lambda: reporter.settled(), 10, "the touch done")
    assert [name for name, _ in kube.tokens] == ["vm1", "vm1"], kube.tokens


class _Annotations:
    """An API server keeping each VMI's nudge annotation: a merge patch to the value it has is no update."""

    def __init__(self) -> None:
        self.value: dict[str, str] = {}
        self.updates: list[tuple[str, str]] = []
        """(VMI, value) of the patches that changed something: what KubeVirt sees."""

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        if self.value.get(name) != token:
            self.value[name] = token
            self.updates.append((name, token))


@pytest.mark.parametrize("before", ["nothing", "nudge_again", "a_new_leader"])
async def test_a_touch_for_the_same_usage_again_is_an_update_kubevirt_sees(before: str) -> None:
    """An admitted VM refused its launcher pod was touched with the usage snapshot's sequence as the annotation's
    value. Touched again for the same usage — the namespace's VMIs nudged again once a quota whose calls kept failing
    had the room, or an enforcer that took over — with its holder let in, the patch repeated that value: it changed
    nothing, and KubeVirt saw no update. Every touch has a value of its own."""
    kube = _Annotations()
    reporter = _reporter(kube, nudge_interval=0.0)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    usage = usage_snapshot("tenant", 7, vms=[vm])
    reporter.tell_and_nudge("tenant", usage, 7)
    await wait_until(lambda: reporter.settled(), 10, "the first touch done")
    assert len(kube.updates) == 1
    if before == "nudge_again":
        reporter.nudge_again("tenant")
    elif before == "a_new_leader":
        reporter = _reporter(kube, nudge_interval=0.0)
    reporter.tell_and_nudge("tenant", usage, 7, frozenset({"uid-vm1"}))
    await wait_until(lambda: reporter.settled(), 10, "the let-in's touch done")
    assert len(kube.updates) == 2, f"the touch made no update KubeVirt sees: {kube.updates}"


class _AppliedThenAnswerLost:
    """An API server that applies each VMI patch, but whose first answer is lost (a transient error after the write:
    the retry sends a value the VMI has already, no update KubeVirt sees)."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.calls = 0

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        self.calls += 1
        if not self.applied or self.applied[-1] != token:
            self.applied.append(token)
        if self.calls == 1:
            raise KubeError(503, "ServiceUnavailable", "the answer was lost")


async def test_a_holder_let_in_while_a_touch_waits_to_retry_is_touched_with_a_value_of_its_own() -> None:
    """A touch went out, its answer lost, and waited for its retry when the VMI's holder was let in: the touch
    asked for then was merged into that retry, which repeated a value the VMI had already (no update KubeVirt sees),
    and a holder let in is touched once: the VM waited for KubeVirt's backoff. A touch waiting to retry is followed
    by one of its own, as one under way is."""
    kube = _AppliedThenAnswerLost()
    reporter = _reporter(kube, nudge_interval=0.0)  # (retries after 0.2 s)
    vm = contract.VmState(name="vm1", uid="uid-vm1", state="admitted", pod_refused=True)
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 6, vms=[vm]), 6)
    await wait_until(lambda: kube.calls == 1, 10, "the first touch applied, its answer lost: its retry waits")
    reporter.tell_and_nudge("tenant", usage_snapshot("tenant", 7, vms=[vm]), 7, frozenset({"uid-vm1"}))
    await wait_until(reporter.settled, 10, "the touches done")
    assert len(kube.applied) == 2 and kube.applied[1].startswith("7."), kube.applied
