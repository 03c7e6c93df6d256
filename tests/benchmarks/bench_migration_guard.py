"""``bench_migration`` with the reservation guard: the shipped ValidatingAdmissionPolicy in the simulated cluster and
the enforcer writing each namespace's QuotaReservation before a raise (one more API call on the unblock path).
The figures are named like bench_migration's, prefixed ``guard:``; compare them side by side."""

from __future__ import annotations

from dataclasses import replace

from tests.benchmarks import bench_migration
from tests.benchmarks.common import Result


async def run_async() -> list[Result]:
    results = await bench_migration.run_async(guard=True)
    return [replace(r, name=f"guard: {r.name}") for r in results if "start-up" not in r.name]
