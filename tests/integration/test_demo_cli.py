"""``vmquota demo`` as a process: a SIGTERM stops it as Ctrl-C does, with its embedded nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: pid → command name."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # (gone meanwhile)
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[1]) == pid:
            out[int(entry.name)] = comm
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # (a zombie has exited)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_sigterm_stops_the_demo_and_its_nats_server() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli.main",
        "demo",
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    nats: list[int] = []
    try:

        def started() -> bool:  # (as soon as it exists: a SIGTERM may come while it starts)
            nats[:] = [pid for pid, comm in _children(proc.pid).items() if comm.startswith("nats-server")]
            return bool(nats) or proc.returncode is not None

        await wait_until(started, within=60, what="the demo's nats-server")
        assert nats, f"the demo ended before its nats-server was seen: {proc.returncode}"
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 130, err.decode()
        await wait_until(lambda: not _alive(nats[0]), within=20, what="the demo's nats-server to stop")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in nats:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_the_demo_shows_each_step_as_it_plays_and_then_the_summary() -> None:
    """Progress lines on stderr while it plays (stdout keeps the summary, and the JSON of --json clean)."""
    scenario = ROOT / "services" / "devtools" / "demo" / "scenarios" / "1-full-quota-migration.yaml"
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "services.cli.main", "demo", "--scenario-file", str(scenario)),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        first = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert proc.returncode is None, "the first line comes while it plays, not after"
        assert first.decode().startswith("[full-quota-migration, without vmquota]"), first
        assert "starting the simulated cluster" in first.decode()
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    progress = err.decode().splitlines()
    assert any(line.startswith("[full-quota-migration, with vmquota]") and line.endswith("migrate vm1")
               for line in progress), progress  # fmt: skip
    assert "=> all expectations held" in out.decode() and "[full-quota-migration" not in out.decode()
    assert proc.returncode == 0
