"""The watcher's list and watch loops against a scripted API (no I/O): races between a relist and a namespace's
backfill, and versions a bookmark brings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import structlog

from services.platform.kube import KubeError
from services.watcher import kube as wkube
from services.watcher.kube import ListPage, WatchEvent
from services.watcher.watcher import RESOURCES, Watcher, WatcherConfig
from shared import contract
from shared.backoff import Backoff
from shared.kinds import POD_KIND
from shared.ledger.fold import Ledger, PartitionSet
from tests.waiting import wait_until


class Published:
    """What the watcher enqueues for the bus, in order (a publisher that stores at once)."""

    max_payload = 1024 * 1024

    def __init__(self) -> None:
        self.items: list[Any] = []

    def enqueue(self, item: Any) -> None:
        self.items.append(item)

    async def room(self) -> None:
        await asyncio.sleep(0)

    async def flush(self) -> None:
        await asyncio.sleep(0)

    def labels(self) -> list[tuple[str, str]]:
        return [(i.label, msgspec.json.decode(i.data).get("name", "")) for i in self.items]


def _pod(ns: str, name: str, rv: int) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}", "resourceVersion": str(rv)},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}]},
        "status": {"phase": "Running"},
    }


async def test_a_namespace_made_managed_during_a_relist_keeps_its_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full relist of the pods reads namespace n while it is unmanaged (its plain pod x skipped); then n becomes
    managed and its backfill lists and publishes x, with its sync. When the relist ends, x is known, older than
    the list and not in it: it was published deleted, and the ledger, whose sync of n came first, kept it gone: the
    namespace undercounted for as long as x did not change. A list does not judge a namespace whose managed state
    changed while it ran."""
    gate, first_page = asyncio.Event(), asyncio.Event()
    x = _pod("n", "x", 50)

    async def list_pages(api: Any, spec: Any, *, namespace: str | None = None, **kw: Any) -> AsyncIterator[ListPage]:
        if namespace is None:
            yield ListPage([x, _pod("other", "y", 60)], "100", "next")
            first_page.set()
            await gate.wait()
            yield ListPage([_pod("other", "z", 70)], "100", "")
        else:
            yield ListPage([x], "150", "")

    monkeypatch.setattr(wkube, "list_pages", list_pages)
    out = Published()
    w = Watcher(None, out, WatcherConfig("c1", resources=RESOURCES), metrics=None, log=structlog.get_logger())  # type: ignore[arg-type]
    pods = w.loops[POD_KIND]
    pods.started = True
    async with asyncio.TaskGroup() as group:
        w._group = group
        relist = group.create_task(pods.relist("gone"))
        await first_page.wait()
        assert w.managed.update("n", "q-uid", True)
        w.managed_changed(["n"], [])
        await wait_until(lambda: "uid-x" in pods.known, 5, "the backfill")
        gate.set()
        await relist
    assert ("Pod|deleted", "x") not in out.labels(), out.labels()
    ledger = Ledger(PartitionSet.all(1))
    for seq, item in enumerate(out.items, 1):
        ledger.apply(contract.decode_event(item.data), seq)
    state = ledger.state("c1", "n")
    assert state is not None and [s.name for s in state.live(POD_KIND)] == ["x"]


async def test_a_bookmark_whose_version_is_no_version_is_not_watched_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bookmark with a resourceVersion that is no number (a proxy's, a broken server's) was taken as the version to
    watch from: every later watch was refused with a 400 and backed off, and the kind's events stopped for every
    namespace until a restart."""
    sent: list[str] = []

    async def list_pages(api: Any, spec: Any, **kw: Any) -> AsyncIterator[ListPage]:
        yield ListPage([], "100", "")

    async def watch(api: Any, spec: Any, resource_version: str, **kw: Any) -> AsyncIterator[WatchEvent]:
        sent.append(resource_version)
        if not resource_version.isdigit():
            raise KubeError(400, "BadRequest", f"invalid resource version: {resource_version!r}")
        if len(sent) == 1:  # (the first watch ends on it)
            yield WatchEvent("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "garbage"}})
            return
        yield WatchEvent("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": str(100 + len(sent))}})

    monkeypatch.setattr(wkube, "list_pages", list_pages)
    monkeypatch.setattr(wkube, "watch", watch)
    config = WatcherConfig("c1", resources=RESOURCES, backoff=Backoff(initial=0.01, maximum=0.02), short_watch=0.0)
    w = Watcher(None, Published(), config, metrics=None, log=structlog.get_logger())  # type: ignore[arg-type]
    task = asyncio.ensure_future(w.loops[POD_KIND].run())
    try:
        await wait_until(lambda: len(sent) >= 4, 5, "four watches")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert "garbage" not in sent and sent[:4] == ["100", "100", "102", "103"], sent
