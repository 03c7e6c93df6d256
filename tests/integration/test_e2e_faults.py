"""Fault tests of the whole pipeline: each service killed (SIGKILL) and restarted around a migration, the
nats-server restarted mid-scenario, forced 410s (history compacted, watches dropped) and 409 storms on quota
patches. In every case the migration succeeds and ``spec.hard`` returns exactly to its value before it.
"""

from __future__ import annotations

import asyncio

import pytest

from services.devtools.demo.play import SERVICE_NAMES
from services.devtools.simcluster.kubevirt import phase
from tests.integration.e2e import SLOW_MIGRATIONS, Pipeline, full_namespace, pipeline

NS = "tenant-faults"
QUOTA = "compute"


def unfinished(p: Pipeline, migration: str) -> bool:
    return phase(p.migration(NS, migration)) not in ("Succeeded", "Failed")


@pytest.mark.parametrize("service", SERVICE_NAMES)
async def test_service_killed_and_restarted_around_migrations(service: str) -> None:
    async with pipeline(separate=True, kubevirt_timing=SLOW_MIGRATIONS) as p:
        await full_namespace(p, NS)
        before = p.hard(NS, QUOTA)

        # Down before the migration: nobody raises hard, Kubernetes refuses the target pod and the migration waits.
        await p.stack.stop_service(service, kill=True)
        refusals = len(p.quota_refusals(NS, "vm1"))
        mig = await p.migrate(NS, "vm1")
        await p.wait(lambda: len(p.quota_refusals(NS, "vm1")) > refusals, "the target pod to be refused")
        assert unfinished(p, mig) and not p.target_pods(NS, mig)
        assert p.hard(NS, QUOTA) == before
        await p.stack.start_service(service)
        await p.wait_migrated(NS, "vm1", mig)
        await p.wait_hard(NS, QUOTA, before, f"hard to return after {service} came back")

        # Killed while the target pod runs next to the source; back after the migration ended and the source pod
        # went: hard is never below the budget meanwhile (once vmquota saw the target pod it holds no room for the
        # second pod, `D`, so it may already be back at it), and the restarted service brings it back.
        mig2 = await p.migrate(NS, "vm2")
        await p.wait(lambda: bool(p.target_pods(NS, mig2)), "the target pod of vm2")
        assert unfinished(p, mig2), "the migration ended before the kill"
        await p.stack.stop_service(service, kill=True)
        await p.wait_migrated(NS, "vm2", mig2)
        assert p.hard(NS, QUOTA)["limits.memory"] >= before["limits.memory"], "hard fell below the budget"
        await p.stack.start_service(service)
        await p.wait_hard(NS, QUOTA, before, f"hard to return after {service} restarted")
        assert p.stack.starts[service] == 3


async def test_nats_server_restart_mid_scenario() -> None:
    async with pipeline(kubevirt_timing=SLOW_MIGRATIONS) as p:
        await full_namespace(p, NS)
        before = p.hard(NS, QUOTA)
        mig = await p.migrate(NS, "vm1")
        await p.wait(lambda: bool(p.target_pods(NS, mig)), "the target pod of vm1")
        await asyncio.to_thread(p.stack.nats.restart)  # same port, same store: a server restart
        await p.wait_migrated(NS, "vm1", mig)
        await p.wait_hard(NS, QUOTA, before, "hard to return after the NATS restart")
        # The pipeline still works end to end after reconnecting: the next migration needs a raise again.
        decisions = len(p.tap.decisions)
        mig2 = await p.migrate(NS, "vm3")
        await p.wait_migrated(NS, "vm3", mig2)
        await p.wait_hard(NS, QUOTA, before, "hard to return after the migration that followed the restart")
        # (the tap hears the lowering's decision a moment after the cluster shows the lower hard: wait for it)
        await p.wait(lambda: len(p.tap.decisions) >= decisions + 2, "raise and lower decisions after the restart")


async def test_forced_410_during_a_migration() -> None:
    async with pipeline(kubevirt_timing=SLOW_MIGRATIONS) as p:
        await full_namespace(p, NS)
        before = p.hard(NS, QUOTA)
        mig = await p.migrate(NS, "vm1")
        await p.wait(lambda: bool(p.target_pods(NS, mig)), "the target pod of vm1")
        # Every watch resumes from a resourceVersion older than the history: 410 Gone, relist and diff.
        p.sim.faults.compact()
        assert p.sim.faults.drop_watches() > 0, "the watcher had no watches to drop"
        await p.wait_migrated(NS, "vm1", mig)
        await p.wait_hard(NS, QUOTA, before, "hard to return after the 410s")
        # Changes made after the relist are still followed: stop vm3, its share of the quota comes back.
        await p.sim.set_running(NS, "vm3", False)
        await p.wait(lambda: not p.launcher_pods(NS, "vm3"), "vm3 to stop")
        await p.wait_hard(NS, QUOTA, before, "hard to stay at the budget after vm3 stopped")
        mig2 = await p.migrate(NS, "vm2")
        await p.wait_migrated(NS, "vm2", mig2)
        await p.wait_hard(NS, QUOTA, before)


async def test_409_storm_on_quota_patches() -> None:
    async with pipeline() as p:
        await full_namespace(p, NS)
        before = p.hard(NS, QUOTA)
        storm = p.sim.faults.fail(409, 0.8, verbs=["patch"], resources=["resourcequotas"], count=40)
        migs = await asyncio.gather(*(p.migrate(NS, vm) for vm in ("vm1", "vm2")))
        for vm, mig in zip(("vm1", "vm2"), migs, strict=True):
            await p.wait_migrated(NS, vm, mig)
        await p.wait_hard(NS, QUOTA, before, "hard to return through the 409 storm")
        assert storm.injected > 0, "the storm never hit a quota patch"
