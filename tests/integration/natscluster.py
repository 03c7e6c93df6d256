"""A JetStream cluster of three nats-server processes on loopback, joined by routes: each a
:class:`~services.devtools.natsserver.NatsServer` with its own store, client port and route port, so that a test can
``kill()`` (SIGKILL) one node and ``start()`` it again on the same ports and store."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from types import TracebackType

from services.devtools.natsserver import NatsServer

CLUSTER_NAME = "vmquota-test"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsCluster:
    def __init__(self, size: int = 3) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="vmquota-nats-cluster-")
        root = self.workdir = Path(self._tmp.name)
        """(the services' logs go here when a stack runs them as processes)"""
        clients, routes = _free_ports(size), _free_ports(size)
        self.nodes: list[NatsServer] = []
        for i in range(size):
            workdir = root / f"n{i}"
            workdir.mkdir()
            config = workdir / "cluster.conf"
            peers = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)
            config.write_text(
                f"server_name: n{i}\n"
                f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{routes[i]}\n  routes: [{peers}]\n}}\n"
            )
            self.nodes.append(NatsServer(workdir, config_file=config, port=clients[i]))

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (as ``--nats`` takes them)."""
        return ",".join(f"nats://127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> NatsCluster:
        for n in self.nodes:
            n.start()
        return self

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        self._tmp.cleanup()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
