"""``vmquota up`` as an administrator meets it: one process, then the printed kubectl lines against it (the
installed kubectl), ``vmquota status`` on its bus, and a stop that ends everything within 5 s."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
]

VMQUOTA = [sys.executable, "-m", "services.cli.main"]


async def _run(*argv: str, stdin: str | None = None, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_up_runs_the_stack_the_guide_works_and_ctrl_c_ends_it(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "vmquota.kubeconfig"
    proc = await asyncio.create_subprocess_exec(
        *VMQUOTA,
        "up",
        "--example",
        "--nats-port",
        "0",
        "--kubeconfig-out",
        str(kubeconfig),
        "-o",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 90)
        assert line, f"vmquota up printed nothing; stderr: {(await proc.stderr.read()).decode()[-2000:]}"  # type: ignore[union-attr]
        info = json.loads(line)
        assert Path(info["kubeconfig"]) == kubeconfig.resolve() and kubeconfig.exists()
        env = {"KUBECONFIG": str(kubeconfig), "VMQUOTA_NATS": info["nats"]}

        async def kubectl(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
            return await _run("kubectl", *args, stdin=stdin, env=env)

        async def vmi_phase(name: str) -> str:
            code, out, _ = await kubectl("-n", "tenant-a", "get", "vmi", name, "-o", "jsonpath={.status.phase}")
            return out if code == 0 else ""

        async def three_running() -> bool:
            return [await vmi_phase(n) for n in ("vm1", "vm2", "vm3")] == ["Running"] * 3

        await wait_until(three_running, within=60, what="the example's three VMs running", every=0.2)

        def start(vm: str) -> list[str]:
            return ["-n", "tenant-a", "patch", "vm", vm, "--type", "merge", "-p", '{"spec":{"runStrategy":"Always"}}']

        code, _, err = await kubectl(*start("vm4"))
        assert code == 0, err

        async def vm4_running() -> bool:
            return await vmi_phase("vm4") == "Running"

        await wait_until(vm4_running, within=60, what="vm4 (fits the budget) running", every=0.2)
        code, _, err = await kubectl(*start("vm5"))
        assert code == 0, err

        async def vm5_refused() -> Any:
            code, out, _ = await kubectl(
                "-n", "tenant-a", "get", "events", "--field-selector", "reason=VMQuotaExceeded", "-o", "json"
            )
            items = json.loads(out)["items"] if code == 0 else []
            return [e for e in items if e["involvedObject"]["name"] == "vm5"]

        await wait_until(vm5_refused, within=60, what="a VMQuotaExceeded Event on vm5", every=0.2)
        assert await vmi_phase("vm5") != "Running"

        migration = {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": "mig1"},
            "spec": {"vmiName": "vm1"},
        }
        code, _, err = await kubectl("-n", "tenant-a", "create", "-f", "-", stdin=json.dumps(migration))
        assert code == 0, err

        async def migrated() -> bool:
            code, out, _ = await kubectl("-n", "tenant-a", "get", "vmim", "mig1", "-o", "jsonpath={.status.phase}")
            assert out != "Failed", "the migration failed at full quota"
            return code == 0 and out == "Succeeded"

        await wait_until(migrated, within=90, what="the migration at full quota succeeded", every=0.2)

        code, out, err = await _run(*VMQUOTA, "status", "-o", "json", env=env)  # VMQUOTA_NATS from the guide
        assert code == 0, err
        rows = {(r["namespace"], r["name"]): r for r in json.loads(out)["quotas"]}
        assert rows[("tenant-a", "vm-size")]["mode"] == "VirtualResources", out
        assert rows[("tenant-a", "vm-size")]["vms"].get("refused") == 1, out
    finally:
        if proc.returncode is None:  # Ctrl-C in a terminal: SIGINT to the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
    loop = asyncio.get_running_loop()
    stopped_at = loop.time()
    code = await asyncio.wait_for(proc.wait(), 30)
    took = loop.time() - stopped_at
    stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    assert code == 0, stderr[-2000:]
    assert took < 8.0, f"a stop took {took:.1f}s"
    errors = [line for line in stderr.splitlines() if '"level": "error"' in line]
    assert not errors, f"a clean stop logs no error (the services stop before the nats-server): {errors}"
    assert '"nats disconnected"' not in stderr, "a service's own close is no disconnect to warn about"
    assert not kubeconfig.exists(), "the kubeconfig of a stopped cluster is removed"


async def test_up_refuses_to_overwrite_a_kubeconfig_it_did_not_write(tmp_path: Path) -> None:
    theirs = tmp_path / "config"
    theirs.write_text("apiVersion: v1\nkind: Config\ncurrent-context: prod\nclusters: []\n")
    code, _, err = await _run(*VMQUOTA, "up", "--nats-port", "0", "--kubeconfig-out", str(theirs))
    assert code == 2
    assert err.strip().count("\n") == 0 and "exists and is not a kubeconfig vmquota wrote" in err, err
    assert theirs.read_text().startswith("apiVersion: v1\nkind: Config\ncurrent-context: prod")


async def test_up_says_which_flag_fixes_a_busy_nats_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = await _run(*VMQUOTA, "up", "--nats-port", str(port), "--kubeconfig-out", str(tmp_path / "kc"))
    assert code == 2
    assert err.strip().count("\n") == 0, err
    assert f"127.0.0.1:{port} is in use" in err and "--nats-port 0" in err, err


async def _up_json(kubeconfig: Path) -> tuple[asyncio.subprocess.Process, str, int]:
    """``vmquota up -o json`` started, once it printed its line: the process and its nats-server's host and port."""
    proc = await asyncio.create_subprocess_exec(
        *VMQUOTA,
        "up",
        *("--nats-port", "0", "--api-port", "0", "--kubeconfig-out", str(kubeconfig), "-o", "json"),
        *("--log-level", "info"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 90)
    assert line, (await proc.stderr.read()).decode()[-2000:]
    host, port = json.loads(line)["nats"].removeprefix("nats://").rsplit(":", 1)
    return proc, host, int(port)


async def _nats_stops(host: str, port: int) -> None:
    async def gone() -> bool:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            return True
        writer.close()
        return False

    await wait_until(gone, within=15, what="the nats-server stopped")


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
async def test_a_second_signal_while_up_stops_leaves_nothing_behind(tmp_path: Path, second: signal.Signals) -> None:
    """Supervisors and ``timeout`` send SIGTERM twice: the second, while the stack stopped, killed ``vmquota up``
    (143), left its kubeconfig and its nats-server running, holding its port for the next ``vmquota up``. A second
    Ctrl-C breaks a stop that hangs (130), and left the nats-server running likewise."""
    kubeconfig = tmp_path / "vmquota.kubeconfig"
    proc, host, port = await _up_json(kubeconfig)
    assert proc.stderr is not None
    proc.send_signal(signal.SIGTERM)
    said: list[bytes] = []
    while not said or b"stopped" not in said[-1]:  # (the stack is stopping: its first service said so)
        said.append(await asyncio.wait_for(proc.stderr.readline(), 30))
        assert said[-1], b"".join(said).decode()[-2000:]
    proc.send_signal(second)
    code = await asyncio.wait_for(proc.wait(), 30)
    assert code == (0 if second == signal.SIGTERM else 130), (b"".join(said) + await proc.stderr.read()).decode()[
        -2000:
    ]
    assert not kubeconfig.exists()
    await _nats_stops(host, port)


async def test_up_killed_outright_takes_its_nats_server_with_it(tmp_path: Path) -> None:
    """The nats-server runs in a session of its own (a Ctrl-C must reach the services first). ``vmquota up`` killed
    with SIGKILL (an OOM kill, ``kill -9``) left it running, holding its port and store, and ``vmquota status``
    showed the dead stack's usage."""
    proc, host, port = await _up_json(tmp_path / "vmquota.kubeconfig")
    proc.kill()
    assert await asyncio.wait_for(proc.wait(), 30) == -signal.SIGKILL
    await _nats_stops(host, port)
