"""The simulated API server under load: writes per second over HTTP while 100 watches are open on the written
resource (every write fans out to all of them), and how fast the watchers receive everything.

The server runs in its own process (as for the pipeline benchmarks); the writers and watch readers share this one.
Also measured: the store alone (in-process writes with 100 in-process watchers), for comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

from services.devtools.simcluster.store import Store, StoreWatch
from tests.benchmarks.common import Result

WATCHERS = 100
WRITERS = 32
SECONDS = 3.0
TARGET_WRITES = 2_000.0


def _pod(i: int) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"p{i}", "labels": {"app": "bench", "n": str(i % 10)}},
        "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "10m"}}}]},
    }


class Progress:
    """Events received per watcher; ``all_reached`` is set once every watcher has ``target`` of them."""

    def __init__(self, watchers: int) -> None:
        self.counts = [0] * watchers
        self.target: int | None = None
        self.reached = 0
        self.all_reached = asyncio.Event()

    def add(self, i: int, n: int) -> None:
        before = self.counts[i]
        self.counts[i] = before + n
        if self.target is not None and before < self.target <= self.counts[i]:
            self._reach()

    def expect(self, target: int) -> None:
        self.target = target
        for c in self.counts:
            if c >= target:
                self._reach()

    def _reach(self) -> None:
        self.reached += 1
        if self.reached == len(self.counts):
            self.all_reached.set()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux ``/proc``); None where that is not available."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def _start_server() -> tuple[asyncio.subprocess.Process, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.devtools.simcluster.server",
        "--no-tls",
        "--log-level",
        "warning",
        "--watch-queue",
        "1000000",
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    info = json.loads(line)
    return proc, info["url"], info["token"]


async def _watch(
    session: aiohttp.ClientSession, path: str, rv: str, progress: Progress, i: int, ready: asyncio.Event
) -> None:
    params = {"watch": "1", "resourceVersion": rv, "timeoutSeconds": "120"}
    async with session.get(path, params=params) as resp:
        resp.raise_for_status()
        ready.set()
        async for chunk in resp.content.iter_any():
            progress.add(i, chunk.count(b"\n"))


async def _http() -> list[Result]:
    proc, url, token = await _start_server()
    try:
        conn = aiohttp.TCPConnector(limit=WATCHERS + WRITERS + 8)
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(base_url=url, headers=headers, connector=conn) as session:
            async with session.post("/api/v1/namespaces", json={"metadata": {"name": "bench"}}) as resp:
                rv = (await resp.json())["metadata"]["resourceVersion"]
            path = "/api/v1/namespaces/bench/pods"
            progress = Progress(WATCHERS)
            readies = [asyncio.Event() for _ in range(WATCHERS)]
            watches = [asyncio.create_task(_watch(session, path, rv, progress, i, r)) for i, r in enumerate(readies)]
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 30)

            written = 0
            next_name = iter(range(10**9))
            cpu0 = _cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            deadline = t0 + SECONDS

            async def writer() -> None:
                nonlocal written
                while time.perf_counter() < deadline:
                    async with session.post(path, json=_pod(next(next_name))) as r:
                        if r.status != 201:
                            raise RuntimeError(f"create failed: {r.status} {await r.text()}")
                        await r.read()
                    written += 1

            await asyncio.gather(*(writer() for _ in range(WRITERS)))
            t_writes = time.perf_counter() - t0
            progress.expect(written)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.all_reached.wait(), 60)
            t_delivered = time.perf_counter() - t0
            cpu1 = _cpu_seconds(proc.pid)
            delivered = sum(progress.counts)
            for w in watches:
                w.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
    finally:
        proc.terminate()
        await proc.wait()
    complete = delivered == written * WATCHERS
    cpu: list[Result] = []
    if cpu0 is not None and cpu1 is not None and written:
        per_write = (cpu1 - cpu0) / written
        cpu.append(
            Result(
                f"simcluster: server CPU per write, {WATCHERS} watches",
                per_write * 1e6,
                "us",
                higher_is_better=False,
                note=f"one core sustains ~{1 / per_write:,.0f} writes/s (steadier than the rate on a busy machine)",
            )
        )
    return [
        Result(
            f"simcluster: HTTP writes/s, {WATCHERS} watches",
            written / t_writes,
            "writes/s",
            target=TARGET_WRITES,
            note=f"{written} pod creates, {WRITERS} concurrent writers",
        ),
        Result(
            "simcluster: watch events delivered/s (all watches)",
            delivered / t_delivered,
            "events/s",
            note="complete" if complete else f"INCOMPLETE: {delivered}/{written * WATCHERS}",
        ),
        *cpu,
    ]


async def _in_process() -> Result:
    store = Store(watch_queue=1_000_000)
    await store.create(store.resource("ns"), {"metadata": {"name": "bench"}})
    po = store.resource("pods")
    progress = Progress(WATCHERS)

    async def consume(i: int, events: StoreWatch) -> None:
        async for _ in events:
            progress.add(i, 1)

    tasks = [asyncio.create_task(consume(i, store.watch(po, "bench"))) for i in range(WATCHERS)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < SECONDS / 2:
        for _ in range(100):
            await store.create(po, _pod(n), namespace="bench")
            n += 1
        await asyncio.sleep(0)  # let the consumers run, as a server's other tasks would
    progress.expect(n)
    await asyncio.wait_for(progress.all_reached.wait(), 60)
    dt = time.perf_counter() - t0
    store.drop_watches()
    await asyncio.gather(*tasks, return_exceptions=True)
    return Result(f"simcluster: store writes/s, {WATCHERS} in-process watchers", n / dt, "writes/s")


async def run_async() -> list[Result]:
    results = await _http()
    results.append(await _in_process())
    return results


if __name__ == "__main__":
    for r in asyncio.run(run_async()):
        print(r.line())
