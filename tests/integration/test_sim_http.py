"""The simulated API server over HTTP, with a plain aiohttp client: what any Kubernetes client relies on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import SimApi, SimApiFactory

pytestmark = pytest.mark.integration

PODS = "/api/v1/namespaces/a/pods"
VMIS = "/apis/kubevirt.io/v1/namespaces/a/virtualmachineinstances"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
async def http(sim_api: SimApi) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        base_url=sim_api.url,
        headers=sim_api.headers,
        connector=aiohttp.TCPConnector(ssl=sim_api.ssl()),
        timeout=aiohttp.ClientTimeout(total=10),
    ) as session:
        resp = await session.post("/api/v1/namespaces", json={"metadata": {"name": "a"}})
        assert resp.status == 201
        yield session


async def call(http: aiohttp.ClientSession, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, path, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {"containers": []}}


class WatchStream:
    """Reads a watch response line by line, with a deadline per line."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def next(self, within: float = 5.0) -> dict[str, Any]:
        line = await asyncio.wait_for(self.resp.content.readline(), within)
        if not line:
            raise EOFError("watch ended")
        event: dict[str, Any] = json.loads(line)
        return event


async def test_requests_without_the_token_get_a_401_status(sim_api: SimApi) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=sim_api.ssl())) as anon:
        async with anon.get(f"{sim_api.url}/api/v1/namespaces") as resp:
            assert resp.status == 401
            body = await resp.json()
        async with anon.get(f"{sim_api.url}/api/v1/namespaces", headers={"Authorization": "Bearer wrong"}) as r2:
            assert r2.status == 401
        async with anon.get(f"{sim_api.url}/version") as version:
            assert version.status == 200 and (await version.json())["major"] == "1"
    assert body["kind"] == "Status" and body["code"] == 401 and body["reason"] == "Unauthorized"


async def test_discovery_documents(http: aiohttp.ClientSession) -> None:
    status, core = await call(http, "GET", "/api/v1")
    assert status == 200 and core["kind"] == "APIResourceList"
    pods = next(r for r in core["resources"] if r["name"] == "pods")
    assert pods["namespaced"] and pods["shortNames"] == ["po"] and "watch" in pods["verbs"]
    assert any(r["name"] == "resourcequotas/status" for r in core["resources"])
    _, groups = await call(http, "GET", "/apis")
    assert {g["name"] for g in groups["groups"]} == {
        "admissionregistration.k8s.io",
        "coordination.k8s.io",
        "kubevirt.io",
        "vmquota.io",
    }
    _, kubevirt = await call(http, "GET", "/apis/kubevirt.io/v1")
    assert {r["name"] for r in kubevirt["resources"] if "/" not in r["name"]} == {
        "virtualmachines",
        "virtualmachineinstances",
        "virtualmachineinstancemigrations",
        "kubevirts",
    }
    agg = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
    async with http.get("/apis", headers={"Accept": agg}) as resp:
        assert "as=APIGroupDiscoveryList" in resp.headers["Content-Type"]
        doc = await resp.json(content_type=None)
    vmi = next(
        r
        for g in doc["items"]
        for v in g["versions"]
        for r in v["resources"]
        if r["resource"] == "virtualmachineinstances"
    )
    assert vmi["shortNames"] == ["vmi", "vmis"] and vmi["subresources"][0]["subresource"] == "status"


async def test_crud_and_status_errors(http: aiohttp.ClientSession) -> None:
    x = pod("x", app="web")
    x["spec"]["containers"] = [{"name": "c", "image": "a"}]
    status, created = await call(http, "POST", PODS, json=x)
    assert status == 201 and created["metadata"]["namespace"] == "a"
    status, err = await call(http, "POST", PODS, json=pod("x"))
    assert (status, err["reason"], err["kind"]) == (409, "AlreadyExists", "Status")
    status, err = await call(http, "GET", f"{PODS}/nope")
    assert status == 404 and err["message"] == 'pods "nope" not found' and err["details"]["name"] == "nope"
    status, err = await call(http, "GET", "/api/v1/namespaces/a/deployments")
    assert status == 404 and err["kind"] == "Status"
    status, err = await call(http, "POST", "/api/v1/namespaces/missing/pods", json=pod("y"))
    assert status == 404 and err["message"] == 'namespaces "missing" not found'
    status, err = await call(http, "POST", PODS, data=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 400 and err["reason"] == "BadRequest"
    # PUT with the current resourceVersion works; with a stale one it is a conflict.
    created["metadata"]["labels"]["v"] = "1"
    status, updated = await call(http, "PUT", f"{PODS}/x", json=created)
    assert status == 200 and updated["metadata"]["labels"]["v"] == "1"
    status, err = await call(http, "PUT", f"{PODS}/x", json=created)
    assert status == 409 and err["reason"] == "Conflict"
    stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"], "labels": {"v": "2"}}}
    status, err = await call(http, "PATCH", f"{PODS}/x", data=json.dumps(stale), headers=MERGE)
    assert status == 409 and "the object has been modified" in err["message"]
    # Status subresource.
    body = json.dumps({"status": {"phase": "Running"}})
    status, running = await call(http, "PATCH", f"{PODS}/x/status", data=body, headers=MERGE)
    assert status == 200 and running["status"]["phase"] == "Running"
    # Patch types.
    jp = json.dumps([{"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}}])
    status, patched = await call(
        http, "PATCH", f"{PODS}/x", data=jp, headers={"Content-Type": "application/json-patch+json"}
    )
    assert status == 200 and patched["metadata"]["annotations"] == {"k": "v"}
    smp = json.dumps({"spec": {"containers": [{"name": "c", "image": "i"}]}})
    headers = {"Content-Type": "application/strategic-merge-patch+json"}
    status, patched = await call(http, "PATCH", f"{PODS}/x", data=smp, headers=headers)
    assert status == 200 and patched["spec"]["containers"] == [{"name": "c", "image": "i"}]  # (merged by name)
    status, _ = await call(http, "POST", VMIS, json={"metadata": {"name": "v"}, "spec": {}})
    assert status == 201
    status, err = await call(http, "PATCH", f"{VMIS}/v", data=json.dumps({"metadata": {}}), headers=headers)
    assert status == 415 and err["reason"] == "UnsupportedMediaType"
    # Delete with a precondition, then for real.
    body = json.dumps({"preconditions": {"uid": "other"}})
    status, err = await call(http, "DELETE", f"{PODS}/x", data=body, headers={"Content-Type": "application/json"})
    assert status == 409
    status, deleted = await call(http, "DELETE", f"{PODS}/x", json={"propagationPolicy": "Background"})
    assert status == 200 and deleted["metadata"]["name"] == "x"
    status, _ = await call(http, "GET", f"{PODS}/x")
    assert status == 404


async def test_list_pages_with_limit_and_continue(http: aiohttp.ClientSession) -> None:
    for i in range(7):
        assert (await call(http, "POST", PODS, json=pod(f"p{i}", group=str(i % 2))))[0] == 201
    names: list[str] = []
    versions: set[str] = set()
    cont = ""
    pages = 0
    while True:
        params = {"limit": "3", **({"continue": cont} if cont else {})}
        status, page = await call(http, "GET", PODS, params=params)
        assert status == 200 and page["kind"] == "PodList"
        pages += 1
        names += [p["metadata"]["name"] for p in page["items"]]
        versions.add(page["metadata"]["resourceVersion"])
        cont = page["metadata"].get("continue", "")
        if not cont:
            break
    assert pages == 3 and names == [f"p{i}" for i in range(7)] and len(versions) == 1
    _, odd = await call(http, "GET", "/api/v1/pods", params={"labelSelector": "group=1"})
    assert [p["metadata"]["name"] for p in odd["items"]] == ["p1", "p3", "p5"]
    _, one = await call(http, "GET", PODS, params={"fieldSelector": "metadata.name=p4"})
    assert [p["metadata"]["name"] for p in one["items"]] == ["p4"]
    status, err = await call(http, "GET", PODS, params={"fieldSelector": "spec.hostname=x"})
    assert status == 400 and "field label not supported" in err["message"]
    status, gone = await call(http, "DELETE", PODS, params={"labelSelector": "group=0"})
    assert status == 200 and [p["metadata"]["name"] for p in gone["items"]] == ["p0", "p2", "p4", "p6"]


async def test_table_output(http: aiohttp.ClientSession) -> None:
    await call(http, "POST", PODS, json=pod("x"))
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    _, table = await call(http, "GET", PODS, headers={"Accept": accept})
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:5] == ["Name", "Ready", "Status", "Restarts", "Age"]
    assert table["rows"][0]["cells"][:4] == ["x", "0/0", "Pending", 0]
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


async def test_watch_stream_bookmarks_resume_and_410(http: aiohttp.ClientSession, sim_api: SimApi) -> None:
    _, created = await call(http, "POST", PODS, json=pod("x"))
    start = created["metadata"]["resourceVersion"]
    params = {"watch": "1", "resourceVersion": start, "allowWatchBookmarks": "true", "timeoutSeconds": "30"}
    async with http.get(PODS, params=params) as resp:
        assert resp.status == 200
        stream = WatchStream(resp)
        await call(http, "POST", PODS, json=pod("y"))
        ev = await stream.next()
        assert ev["type"] == "ADDED" and ev["object"]["metadata"]["name"] == "y"
        second = ev["object"]["metadata"]["resourceVersion"]
        bookmark = await stream.next()  # the fixture's store bookmarks every 0.2 s
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["object"]["metadata"] == {"resourceVersion": second}
    # Resume from the first version: the missed event is replayed.
    async with http.get(PODS, params={"watch": "true", "resourceVersion": start}) as resp:
        ev = await WatchStream(resp).next()
        assert ev["object"]["metadata"]["name"] == "y"
    # Without a resourceVersion: the current state as ADDED events first.
    async with http.get(PODS, params={"watch": "true"}) as resp:
        stream = WatchStream(resp)
        assert [(await stream.next())["object"]["metadata"]["name"] for _ in range(2)] == ["x", "y"]
    sim_api.store.compact()
    async with http.get(PODS, params={"watch": "true", "resourceVersion": start}) as resp:
        assert resp.status == 200
        stream = WatchStream(resp)
        err = await stream.next()
        assert err["type"] == "ERROR" and err["object"]["code"] == 410 and err["object"]["reason"] == "Expired"
        with pytest.raises(EOFError):
            await stream.next()


async def test_watch_ends_at_timeout_seconds(http: aiohttp.ClientSession) -> None:
    async with http.get(PODS, params={"watch": "true", "timeoutSeconds": "1"}) as resp:
        with pytest.raises(EOFError):
            await WatchStream(resp).next(within=5)


async def test_fault_injection(http: aiohttp.ClientSession, sim_api: SimApi) -> None:
    body = {"action": "fail", "code": 429, "verbs": ["create"], "resources": ["pods"], "count": 2}
    status, state = await call(http, "POST", "/_sim/faults", json=body)
    assert status == 200 and state["failures"][0]["code"] == 429
    for _ in range(2):
        async with http.post(PODS, json=pod("x")) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["reason"] == "TooManyRequests"
    assert (await call(http, "POST", PODS, json=pod("x")))[0] == 201
    await call(http, "POST", "/_sim/faults", json={"action": "fail", "code": 500, "verbs": ["get"]})
    status, err = await call(http, "GET", f"{PODS}/x")
    assert status == 500 and err["reason"] == "InternalError"
    status, _ = await call(http, "GET", PODS)
    assert status == 200  # only "get" fails
    await call(http, "POST", "/_sim/faults", json={"action": "clear"})
    assert (await call(http, "GET", f"{PODS}/x"))[0] == 200
    sim_api.faults.fail(409, resources=["pods"], verbs=["patch"], count=1)
    status, err = await call(http, "PATCH", f"{PODS}/x", data="{}", headers=MERGE)
    assert status == 409 and err["message"].startswith('Operation cannot be fulfilled on pods "x"')
    status, err = await call(http, "POST", "/_sim/faults", json={"action": "explode"})
    assert status == 400 and "unknown action" in err["message"]
    # Dropping watches ends open streams; compaction makes resuming them 410.
    async with http.get(PODS, params={"watch": "true", "resourceVersion": "1"}) as resp:
        stream = WatchStream(resp)
        assert (await stream.next())["type"] == "ADDED"
        status, dropped = await call(http, "POST", "/_sim/faults", json={"action": "drop_watches"})
        assert dropped["dropped"] == 1
        with pytest.raises(EOFError):
            await stream.next()
    await call(http, "POST", "/_sim/faults", json={"action": "compact"})
    async with http.get(PODS, params={"watch": "true", "resourceVersion": "1"}) as resp:
        assert (await WatchStream(resp).next())["object"]["code"] == 410


async def test_plain_http_server_and_served_app(sim_api_factory: SimApiFactory) -> None:
    from services.devtools.simcluster.server import ApiServer
    from services.devtools.simcluster.store import Store

    store = Store()
    app = ApiServer(store, token="secret").make_app()
    api = await sim_api_factory(app=app, tls=False)
    assert api.url.startswith("http://") and api.token == "secret"
    async with (
        aiohttp.ClientSession(headers=api.headers) as s,
        s.post(f"{api.url}/api/v1/namespaces", json={"metadata": {"name": "n"}}) as resp,
    ):
        assert resp.status == 201
    assert [n["metadata"]["name"] for n in (await store.list(store.resource("ns")))[0]] == ["n"]


def test_fault_rules_match_by_verb_resource_fraction_and_count() -> None:
    from services.devtools.simcluster.faults import Faults
    from services.devtools.simcluster.store import Store

    store = Store()
    faults = Faults(store, seed=7)
    pods, quotas = store.resource("pods"), store.resource("quota")
    rule = faults.fail(500, 0.5, verbs=["patch"], resources=["quota"])
    outcomes = [faults.check("patch", quotas, "q")[1] for _ in range(400)]
    failed = sum(1 for e in outcomes if e is not None)
    assert 150 < failed < 250 and rule.injected == failed
    assert all(e is None or e.code == 500 for e in outcomes)
    assert faults.check("get", quotas, "q") == (0.0, None)
    assert faults.check("patch", pods, "p") == (0.0, None)
    faults.clear()
    faults.fail(409, count=2)
    codes = [faults.check("update", pods, "p")[1] for _ in range(3)]
    assert [e.code if e else None for e in codes] == [409, 409, None]
    faults.add_latency(0.25, resources=["pods"])
    assert faults.check("get", pods, "p")[0] == 0.25 and faults.check("get", quotas, "q")[0] == 0.0
    with pytest.raises(ValueError):
        faults.fail(418)
    with pytest.raises(ValueError):
        faults.fail(500, 2.0)
    with pytest.raises(ValueError):
        faults.fail(500, verbs=["poke"])
    with pytest.raises(ValueError):
        faults.apply({"action": "fail", "code": 500, "resources": ["deployments"]})


async def test_injected_latency_delays_requests(http: aiohttp.ClientSession, sim_api: SimApi) -> None:
    sim_api.faults.add_latency(0.3, verbs=["list"])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert (await call(http, "GET", PODS))[0] == 200
    assert loop.time() - t0 >= 0.3
    t1 = loop.time()
    assert (await call(http, "GET", "/api/v1/namespaces/a"))[0] == 200  # a get, not a list
    assert loop.time() - t1 < 0.3
