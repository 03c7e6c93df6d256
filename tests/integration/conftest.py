"""Fixtures for a running simulated Kubernetes API server (``services/devtools/simcluster``).

- ``sim_store``: the store to serve (a fresh ``Store`` with quick bookmarks); override it in a test module to serve
  a store with controllers installed.
- ``sim_api``: a server for ``sim_store`` on a free port of 127.0.0.1 (HTTPS), with its URL, token and a kubeconfig.
- ``sim_api_factory``: ``await start(store=None, *, app=None, tls=True, namespace=None)`` for more servers, other
  stores, or an aiohttp app built with ``ApiServer(...).make_app()`` (plus your own routes); all are stopped at the
  end of the test.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from services.devtools.simcluster.faults import Faults
from services.devtools.simcluster.server import RunningServer, start_server
from services.devtools.simcluster.store import Store


@dataclass
class SimApi:
    """A running simulated API server, as a test sees it."""

    url: str
    token: str
    kubeconfig: Path
    server: RunningServer

    @property
    def store(self) -> Store:
        return self.server.store

    @property
    def faults(self) -> Faults:
        return self.server.faults

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def ssl(self) -> ssl.SSLContext | bool:
        """For aiohttp's ``ssl=`` argument: a context trusting the server's certificate, or True for plain HTTP."""
        return self.server.client_ssl() or True


SimApiFactory = Callable[..., Awaitable[SimApi]]


@pytest.fixture
def sim_store() -> Store:
    return Store(bookmark_interval=0.2, seed=1)


@pytest.fixture
async def sim_api_factory(tmp_path: Path) -> AsyncIterator[SimApiFactory]:
    servers: list[RunningServer] = []

    async def start(
        store: Store | None = None,
        *,
        app: web.Application | None = None,
        tls: bool = True,
        namespace: str | None = None,
    ) -> SimApi:
        server = await start_server(store if app is None else None, app=app, tls=tls)
        servers.append(server)
        path = server.write_kubeconfig(tmp_path / f"sim-{len(servers)}.kubeconfig", namespace=namespace)
        return SimApi(url=server.url, token=server.token, kubeconfig=path, server=server)

    yield start
    for server in reversed(servers):
        await server.close()


@pytest.fixture
async def sim_api(sim_api_factory: SimApiFactory, sim_store: Store) -> SimApi:
    return await sim_api_factory(sim_store)
