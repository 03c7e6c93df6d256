"""Root pytest fixtures: a real JetStream nats-server on a random port (never a mock bus).

The server is ``services.devtools.natsserver.NatsServer`` — the same launcher ``vmquota demo`` and the benchmarks use.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.devtools.natsserver import NatsServer, NatsServerNotFound, find_nats_server
from services.devtools.natsserver import nats_server_binary as _binary

__all__ = ["NatsServer", "find_nats_server", "nats_server_binary"]


def nats_server_binary() -> str:
    """The nats-server binary; fails the test (not an error deep inside a fixture) when it is not installed."""
    try:
        return _binary()
    except NatsServerNotFound as e:
        pytest.fail(str(e))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh JetStream nats-server for one test; its URL is ``nats_server.url``. ``restart()`` keeps the port and
    the store (a server crash/upgrade), ``kill()`` is SIGKILL."""
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
