"""kubernetes-asyncio (the client the watcher and enforcer use) against the simulated API server, over HTTPS with the
kubeconfig the fixture writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.integration.conftest import SimApi

pytestmark = pytest.mark.integration

TIMEOUT = aiohttp.ClientTimeout(sock_connect=5, sock_read=10)
MERGE = "application/merge-patch+json"


@pytest.fixture
async def api(sim_api: SimApi) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(sim_api.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(cfg) as api_client:
        namespace: Any = {"metadata": {"name": "a"}}
        await client.CoreV1Api(api_client).create_namespace(namespace, _request_timeout=TIMEOUT)
        yield api_client


def pod(name: str) -> Any:  # a plain dict body: the client sends it as it is
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [{"name": "c"}]}}


async def next_event(stream: Any, within: float = 5.0) -> dict[str, Any]:
    event: dict[str, Any] = await asyncio.wait_for(stream.__anext__(), within)
    return event


async def test_list_and_typed_objects(api: client.ApiClient) -> None:
    v1 = client.CoreV1Api(api)
    await v1.create_namespaced_pod("a", pod("x"), _request_timeout=TIMEOUT)
    quota: Any = {"metadata": {"name": "q"}, "spec": {"hard": {"limits.memory": "64Gi"}}}
    created = await v1.create_namespaced_resource_quota("a", quota, _request_timeout=TIMEOUT)
    pods = await v1.list_namespaced_pod("a", _request_timeout=TIMEOUT)
    assert [p.metadata.name for p in pods.items] == ["x"]
    assert pods.metadata.resource_version == created.metadata.resource_version  # one global version
    quotas = await v1.list_resource_quota_for_all_namespaces(_request_timeout=TIMEOUT)
    assert quotas.items[0].spec.hard == {"limits.memory": "64Gi"}
    namespaces = await v1.list_namespace(label_selector="kubernetes.io/metadata.name=a", _request_timeout=TIMEOUT)
    assert [n.status.phase for n in namespaces.items] == ["Active"]
    with pytest.raises(ApiException) as err:
        await v1.read_namespaced_pod("nope", "a", _request_timeout=TIMEOUT)
    assert err.value.status == 404


async def test_watch_bookmarks_and_resume_from_resource_version(api: client.ApiClient, sim_api: SimApi) -> None:
    v1 = client.CoreV1Api(api)
    first = await v1.create_namespaced_pod("a", pod("x"), _request_timeout=TIMEOUT)
    start = first.metadata.resource_version
    async with watch.Watch() as w:
        stream = w.stream(
            v1.list_namespaced_pod,
            "a",
            resource_version=start,
            allow_watch_bookmarks=True,
            timeout_seconds=30,
            _request_timeout=TIMEOUT,
        )
        second = await v1.create_namespaced_pod("a", pod("y"), _request_timeout=TIMEOUT)
        ev = await next_event(stream)
        assert ev["type"] == "ADDED" and ev["object"].metadata.name == "y"
        sim_api.store.send_bookmarks()
        bookmark = await next_event(stream)
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["raw_object"]["metadata"]["resourceVersion"] == second.metadata.resource_version
        assert str(w.resource_version) == second.metadata.resource_version  # the client resumes from here
    # Resume from the first version: the second pod is replayed.
    async with watch.Watch() as w:
        stream = w.stream(v1.list_namespaced_pod, "a", resource_version=start, timeout_seconds=30)
        ev = await next_event(stream)
        assert (ev["type"], ev["object"].metadata.name) == ("ADDED", "y")


async def test_watch_from_a_compacted_version_raises_410(api: client.ApiClient, sim_api: SimApi) -> None:
    v1 = client.CoreV1Api(api)
    old = await v1.create_namespaced_pod("a", pod("x"), _request_timeout=TIMEOUT)
    await v1.create_namespaced_pod("a", pod("y"), _request_timeout=TIMEOUT)
    sim_api.faults.compact()
    async with watch.Watch() as w:
        stream = w.stream(
            v1.list_namespaced_pod, "a", resource_version=old.metadata.resource_version, timeout_seconds=30
        )
        with pytest.raises(ApiException) as err:
            await next_event(stream)
    assert err.value.status == 410


async def test_merge_patch_with_precondition_and_409(api: client.ApiClient) -> None:
    v1 = client.CoreV1Api(api)
    body: Any = {"metadata": {"name": "q"}, "spec": {"hard": {"pods": "1"}}}
    quota = await v1.create_namespaced_resource_quota("a", body, _request_timeout=TIMEOUT)
    rv = quota.metadata.resource_version
    body = {"metadata": {"resourceVersion": rv}, "spec": {"hard": {"pods": "2"}}}
    # (the client's type stubs omit ``_content_type``, which it accepts)
    patched = await v1.patch_namespaced_resource_quota(
        "q",
        "a",
        body,
        _content_type=MERGE,
        _request_timeout=TIMEOUT,  # type: ignore[call-arg]
    )
    assert patched.spec.hard == {"pods": "2"}
    with pytest.raises(ApiException) as err:
        await v1.patch_namespaced_resource_quota(
            "q",
            "a",
            body,
            _content_type=MERGE,
            _request_timeout=TIMEOUT,  # type: ignore[call-arg]
        )
    assert err.value.status == 409
    assert "the object has been modified" in str(err.value.body)
    # Without the content type a dict body is a strategic merge patch, which works for built-in kinds.
    labelled = await v1.patch_namespaced_resource_quota(
        "q", "a", {"metadata": {"labels": {"x": "y"}}}, _request_timeout=TIMEOUT
    )
    assert labelled.metadata.labels == {"x": "y"}


async def test_custom_objects_api_for_kubevirt(api: client.ApiClient) -> None:
    co = client.CustomObjectsApi(api)
    args = ("kubevirt.io", "v1", "a", "virtualmachineinstances")
    vmi = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm1"},
        "spec": {"domain": {"cpu": {"sockets": 2}, "memory": {"guest": "1Gi"}, "devices": {}}},
    }
    created = await co.create_namespaced_custom_object(*args, vmi, _request_timeout=TIMEOUT)
    assert created["metadata"]["uid"]
    listed = await co.list_namespaced_custom_object(*args, _request_timeout=TIMEOUT)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["vm1"]
    status = {"status": {"phase": "Running", "nodeName": "n1"}}
    # Custom objects: a dict patch body must name its type (the client's default is a JSON patch).
    await co.patch_namespaced_custom_object_status(
        *args,
        "vm1",
        status,
        _content_type=MERGE,
        _request_timeout=TIMEOUT,  # type: ignore[call-arg]
    )
    got = await co.get_namespaced_custom_object(*args, "vm1", _request_timeout=TIMEOUT)
    assert got["status"] == {"phase": "Running", "nodeName": "n1"}
    patched = await co.patch_namespaced_custom_object(
        *args,
        "vm1",
        {"metadata": {"labels": {"tier": "gold"}}},
        _content_type=MERGE,  # type: ignore[call-arg]
        _request_timeout=TIMEOUT,
    )
    assert patched["metadata"]["labels"] == {"tier": "gold"}
    kv = await co.create_namespaced_custom_object(
        "kubevirt.io", "v1", "a", "kubevirts", {"metadata": {"name": "kubevirt"}, "spec": {}}, _request_timeout=TIMEOUT
    )
    assert kv["kind"] == "KubeVirt"
    async with watch.Watch() as w:
        stream = w.stream(co.list_namespaced_custom_object, *args, timeout_seconds=30)
        ev = await next_event(stream)
        assert ev["type"] == "ADDED" and ev["object"]["metadata"]["name"] == "vm1"
    await co.delete_namespaced_custom_object(*args, "vm1", _request_timeout=TIMEOUT)
    assert (await co.list_namespaced_custom_object(*args, _request_timeout=TIMEOUT))["items"] == []
