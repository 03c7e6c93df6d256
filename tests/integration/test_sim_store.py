"""The simulated cluster's store: the Kubernetes API semantics vmquota depends on, without HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.devtools.simcluster.patch import json_patch, merge_patch, strategic_merge_patch
from services.devtools.simcluster.selectors import parse_field_selector, parse_label_selector
from services.devtools.simcluster.store import Store
from services.devtools.simcluster.store_api import ApiError, Obj, Operation, Resource, StoreAPI, WatchEvent

pytestmark = pytest.mark.integration


def pod(name: str, labels: dict[str, str] | None = None, **spec: Any) -> Obj:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], **spec},
    }


async def with_namespace(store: Store, name: str = "a") -> None:
    await store.create(store.resource("namespaces"), {"metadata": {"name": name}})


async def next_event(it: Any, within: float = 2.0) -> WatchEvent:
    ev: WatchEvent = await asyncio.wait_for(it.__anext__(), within)
    return ev


def test_store_satisfies_the_contract() -> None:
    store: StoreAPI = Store()
    assert store.resource("po").kind == "Pod"


def test_lookup_by_plural_kind_short_name_and_group() -> None:
    s = Store()
    vmi = s.resource("virtualmachineinstances.kubevirt.io")
    for key in ("vmi", "vmis", "VirtualMachineInstance", "virtualmachineinstance", "virtualmachineinstances"):
        assert s.resource(key) == vmi
    assert s.resource("quota").plural == "resourcequotas"
    assert s.resource("ev").kind == "Event"
    assert s.resource("kv").group == "kubevirt.io"
    assert s.resource("leases").api_version == "coordination.k8s.io/v1"
    assert s.resource("vmim").subresources == ("status",)
    assert not s.resource("ns").namespaced
    with pytest.raises(KeyError):
        s.resource("deployments")


async def test_create_assigns_identity_and_one_increasing_resource_version() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    a = await s.create(po, pod("x"), namespace="a")
    b = await s.create(po, {"metadata": {"generateName": "web-"}, "spec": {}}, namespace="a")
    q = await s.create(s.resource("quota"), {"metadata": {"name": "q", "namespace": "a"}, "spec": {"hard": {}}})
    rvs = [int(o["metadata"]["resourceVersion"]) for o in (a, b, q)]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    assert s.resource_version == rvs[-1]
    assert b["metadata"]["name"].startswith("web-") and len(b["metadata"]["name"]) == len("web-") + 5
    assert a["metadata"]["uid"] != b["metadata"]["uid"]
    assert a["metadata"]["creationTimestamp"].endswith("Z")
    assert a["kind"] == "Pod" and a["apiVersion"] == "v1"
    assert a["status"] == {"phase": "Pending"}  # status is the server's on create
    with pytest.raises(ApiError) as err:
        await s.create(po, pod("x"), namespace="a")
    assert err.value.code == 409 and err.value.reason == "AlreadyExists"
    assert err.value.message == 'pods "x" already exists'


async def test_namespaced_create_needs_the_namespace() -> None:
    s = Store()
    with pytest.raises(ApiError) as err:
        await s.create(s.resource("pods"), pod("x"), namespace="nope")
    assert err.value.code == 404 and err.value.message == 'namespaces "nope" not found'
    with pytest.raises(ApiError) as err:
        await s.create(s.resource("ns"), {"metadata": {"name": "Bad_Name"}})
    assert err.value.code == 422 and "metadata.name" in err.value.message
    assert s.resource_version == 0


async def test_returned_objects_are_copies() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    body = pod("x")
    created = await s.create(po, body, namespace="a")
    created["spec"]["containers"].clear()
    body["spec"]["containers"].clear()
    got = await s.get(po, "a", "x")
    assert got["spec"]["containers"] == [{"name": "c", "image": "busybox"}]


async def test_stale_resource_version_is_a_conflict_with_the_real_message() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    old = await s.create(po, pod("x"), namespace="a")
    await s.patch(po, "a", "x", {"metadata": {"labels": {"v": "1"}}}, "merge")
    for attempt in (
        s.update(po, old),
        s.patch(po, "a", "x", {"metadata": {"resourceVersion": old["metadata"]["resourceVersion"]}}, "merge"),
    ):
        with pytest.raises(ApiError) as err:
            await attempt
        assert err.value.code == 409 and err.value.reason == "Conflict"
        assert err.value.message == (
            'Operation cannot be fulfilled on pods "x": the object has been modified; '
            "please apply your changes to the latest version and try again"
        )
    current = await s.get(po, "a", "x")
    current["metadata"]["labels"]["v"] = "2"
    updated = await s.update(po, current)
    assert updated["metadata"]["labels"]["v"] == "2"
    vmi = s.resource("vmi")
    await s.create(vmi, {"metadata": {"name": "v", "namespace": "a"}, "spec": {}})
    with pytest.raises(ApiError) as err:
        await s.patch(vmi, "a", "v", {"metadata": {"resourceVersion": "1"}}, "merge")
    assert err.value.message.startswith('Operation cannot be fulfilled on virtualmachineinstances.kubevirt.io "v"')


async def test_a_write_that_changes_nothing_is_no_write() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    created = await s.create(po, pod("x", {"a": "1"}), namespace="a")
    rv = s.resource_version
    same = await s.patch(po, "a", "x", {"metadata": {"labels": {"a": "1"}}}, "merge")
    assert same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert await s.mutate(po, "a", "x", lambda o: None) == created
    assert s.resource_version == rv


async def test_status_subresource_semantics() -> None:
    s = Store()
    await with_namespace(s)
    q = s.resource("resourcequotas")
    created = await s.create(
        q, {"metadata": {"name": "q", "namespace": "a"}, "spec": {"hard": {"pods": "1"}}, "status": {"used": {}}}
    )
    assert "status" not in created  # dropped on create, like the real server
    assert created["metadata"]["generation"] == 1
    with_status = await s.mutate(q, "a", "q", lambda o: {**o, "status": {"hard": {"pods": "1"}}}, status=True)
    assert with_status["status"] == {"hard": {"pods": "1"}}
    assert with_status["metadata"]["generation"] == 1
    # A main write cannot change status; it changes spec and bumps the generation.
    obj = await s.get(q, "a", "q")
    obj["status"] = {"hard": {"pods": "99"}}
    obj["spec"]["hard"]["pods"] = "2"
    updated = await s.update(q, obj)
    assert updated["status"] == {"hard": {"pods": "1"}} and updated["spec"]["hard"]["pods"] == "2"
    assert updated["metadata"]["generation"] == 2
    # A status write cannot change spec.
    obj = await s.get(q, "a", "q")
    obj["spec"]["hard"]["pods"] = "3"
    obj["status"]["used"] = {"pods": "0"}
    status_only = await s.update(q, obj, subresource="status")
    assert status_only["spec"]["hard"]["pods"] == "2" and status_only["status"]["used"] == {"pods": "0"}
    patched = await s.patch(q, "a", "q", {"status": {"used": {"pods": "1"}}}, "merge", subresource="status")
    assert patched["status"]["used"] == {"pods": "1"}
    seeded = await s.create(q, {"metadata": {"name": "r", "namespace": "a"}, "status": {"used": {}}}, keep_status=True)
    assert seeded["status"] == {"used": {}}


async def test_a_pod_update_changes_only_what_kube_apiserver_lets_it() -> None:
    """``ValidatePodUpdate``: a plain update may change containers' images, ``activeDeadlineSeconds``,
    ``terminationGracePeriodSeconds``, add tolerations and remove scheduling gates; nothing else of the spec
    (``nodeName`` is set by a binding, container resources through ``resize``)."""
    store = Store()
    await with_namespace(store)
    po = store.resource("pods")
    gates = [{"name": "a"}, {"name": "b"}]
    await store.create(
        po, pod("p", tolerations=[{"key": "k", "operator": "Exists"}], schedulingGates=gates), namespace="a"
    )
    allowed: list[Obj] = [
        {"spec": {"containers": [{"name": "c", "image": "alpine"}]}},
        {"spec": {"activeDeadlineSeconds": 60, "terminationGracePeriodSeconds": 5}},
        {"spec": {"tolerations": [{"key": "k", "operator": "Exists"}, {"key": "x", "operator": "Exists"}]}},
        {"spec": {"schedulingGates": [{"name": "b"}]}},
    ]
    for change in allowed:
        await store.patch(po, "a", "p", change, "merge")
    refused: list[Obj] = [
        {"spec": {"nodeName": "n1"}},
        {"spec": {"overhead": {"cpu": "1"}}},
        {"spec": {"resources": {"requests": {"cpu": "100"}}}},
        {"spec": {"priorityClassName": "high"}},
        {"spec": {"containers": [{"name": "c", "image": "alpine", "command": ["sh"]}]}},
        {"spec": {"containers": [{"name": "c", "image": "alpine", "resources": {"requests": {"cpu": "9"}}}]}},
        {"spec": {"ephemeralContainers": [{"name": "e", "image": "busybox"}]}},
        {"spec": {"tolerations": []}},
        {"spec": {"schedulingGates": [{"name": "b"}, {"name": "c"}]}},
    ]
    for change in refused:
        with pytest.raises(ApiError) as err:
            await store.patch(po, "a", "p", change, "merge")
        assert err.value.code == 422 and "pod updates may not change fields" in err.value.message, change
    now = await store.get(po, "a", "p")
    assert now["spec"]["containers"][0]["image"] == "alpine" and "nodeName" not in now["spec"]


async def test_a_pod_is_bound_to_a_node_once_through_its_binding() -> None:
    """``pods/binding`` (kube-apiserver's ``BindingREST``): admission sees a CREATE of the subresource with the
    ``Binding``; the pod gets ``nodeName`` and ``PodScheduled=True`` in one write; binding it again is a 409."""
    store = Store()
    await with_namespace(store)
    po = store.resource("pods")
    await store.create(po, pod("p"), namespace="a")
    seen: list[tuple[Operation, str | None, Obj | None]] = []

    async def hook(
        op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        seen.append((op, subresource, new))
        return None

    store.add_admission(po, hook)
    bound = await store.bind(po, "a", "p", "n1")
    assert bound["spec"]["nodeName"] == "n1"
    assert [c["status"] for c in bound["status"]["conditions"] if c["type"] == "PodScheduled"] == ["True"]
    ((op, sub, binding),) = seen
    assert (op, sub) == ("CREATE", "binding") and binding is not None and binding["kind"] == "Binding"
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    with pytest.raises(ApiError) as err:
        await store.bind(po, "a", "p", "n2")
    assert err.value.code == 409 and 'already assigned to node "n1"' in err.value.message


async def test_finalizers_keep_an_object_until_the_last_one_goes() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    await s.create(po, {**pod("x"), "metadata": {"name": "x", "finalizers": ["a/b", "c/d"]}}, namespace="a")
    w = s.watch(po, "a")
    deleting = await s.delete(po, "a", "x")
    assert deleting["metadata"]["deletionTimestamp"]
    assert (await next_event(w)).type == "MODIFIED"
    with pytest.raises(ApiError) as err:
        await s.patch(po, "a", "x", {"metadata": {"finalizers": ["a/b", "c/d", "e/f"]}}, "merge")
    assert err.value.code == 422 and "no new finalizers" in err.value.message
    await s.patch(po, "a", "x", [{"op": "remove", "path": "/metadata/finalizers/0"}], "json")
    assert (await s.get(po, "a", "x"))["metadata"]["finalizers"] == ["c/d"]
    assert (await next_event(w)).type == "MODIFIED"
    await s.mutate(po, "a", "x", lambda o: {**o, "metadata": {**o["metadata"], "finalizers": []}})
    gone = await next_event(w)
    assert gone.type == "DELETED" and gone.object["metadata"]["name"] == "x"
    with pytest.raises(ApiError) as err:
        await s.get(po, "a", "x")
    assert err.value.code == 404 and err.value.message == 'pods "x" not found'


async def test_deleting_a_namespace_deletes_its_objects_then_itself() -> None:
    s = Store()
    await with_namespace(s, "a")
    await with_namespace(s, "b")
    po, ns = s.resource("pods"), s.resource("namespaces")
    await s.create(po, pod("x"), namespace="a")
    await s.create(po, {**pod("y"), "metadata": {"name": "y", "finalizers": ["keep"]}}, namespace="a")
    await s.create(po, pod("z"), namespace="b")
    await s.create(s.resource("vmi"), {"metadata": {"name": "v"}, "spec": {}}, namespace="a")
    terminating = await s.delete(ns, None, "a")
    assert terminating["status"]["phase"] == "Terminating"
    pods, _ = await s.list(po)
    assert [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods] == [("a", "y"), ("b", "z")]
    assert (await s.list(s.resource("vmi")))[0] == []
    with pytest.raises(ApiError) as err:
        await s.create(po, pod("new"), namespace="a")
    assert err.value.code == 403 and "is being terminated" in err.value.message
    await s.patch(po, "a", "y", {"metadata": {"finalizers": None}}, "merge")
    names = [n["metadata"]["name"] for n in (await s.list(ns))[0]]
    assert names == ["b"]
    # A namespace with finalizers of its own waits for them, and for its content.
    await s.create(ns, {"metadata": {"name": "c", "finalizers": ["example.com/hold"]}})
    await s.create(po, {**pod("p"), "metadata": {"name": "p", "finalizers": ["keep"]}}, namespace="c")
    await s.delete(ns, None, "c")
    await s.patch(ns, None, "c", {"metadata": {"finalizers": None}}, "merge")
    assert (await s.get(ns, None, "c"))["status"]["phase"] == "Terminating"  # the pod still holds it
    await s.patch(po, "c", "p", {"metadata": {"finalizers": None}}, "merge")
    assert [n["metadata"]["name"] for n in (await s.list(ns))[0]] == ["b"]


@pytest.mark.parametrize(
    ("refs", "error"),
    [
        ([{"apiVersion": "v1", "kind": "Pod", "name": "a"}], 'metadata.ownerReferences.uid: Invalid value: "": must'),
        ([{"apiVersion": "kubevirt.io/", "kind": "X", "name": "a", "uid": "u"}], "version must not be empty"),
        ([{"apiVersion": "v1", "name": "a", "uid": "u"}], "metadata.ownerReferences.kind"),
        (
            [
                {"apiVersion": "v1", "kind": "Pod", "name": "a", "uid": "u1", "controller": True},
                {"apiVersion": "v1", "kind": "Pod", "name": "b", "uid": "u2", "controller": True},
            ],
            'Only one reference can have Controller set to true. Found "true" in references for Pod/a and Pod/b',
        ),
    ],
)
async def test_owner_references_are_validated_as_kube_apiserver_does(refs: list[Obj], error: str) -> None:
    """``ValidateOwnerReferences``: an apiVersion with a version, a kind, a name and a uid, one controller at most;
    on create and on update."""
    store = Store()
    await with_namespace(store)
    po = store.resource("pods")
    owned = pod("p")
    owned["metadata"]["ownerReferences"] = refs
    with pytest.raises(ApiError) as err:
        await store.create(po, owned, namespace="a")
    assert err.value.code == 422 and error in err.value.message, err.value.message
    await store.create(po, pod("p"), namespace="a")
    with pytest.raises(ApiError) as err:
        await store.patch(po, "a", "p", {"metadata": {"ownerReferences": refs}}, "merge")
    assert err.value.code == 422 and error in err.value.message, err.value.message


async def test_garbage_collection_follows_owner_references() -> None:
    s = Store()
    await with_namespace(s)
    vmi, po = s.resource("vmi"), s.resource("pods")
    owner = await s.create(vmi, {"metadata": {"name": "v"}, "spec": {}}, namespace="a")
    ref = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "name": "v",
        "uid": owner["metadata"]["uid"],
    }
    await s.create(po, {**pod("launcher"), "metadata": {"name": "launcher", "ownerReferences": [ref]}}, namespace="a")
    await s.create(po, pod("unrelated"), namespace="a")
    await s.delete(vmi, "a", "v")
    assert [p["metadata"]["name"] for p in (await s.list(po, "a"))[0]] == ["unrelated"]
    orphan_owner = await s.create(vmi, {"metadata": {"name": "w"}, "spec": {}}, namespace="a")
    ref2 = {**ref, "name": "w", "uid": orphan_owner["metadata"]["uid"]}
    await s.create(po, {**pod("kept"), "metadata": {"name": "kept", "ownerReferences": [ref2]}}, namespace="a")
    await s.delete(vmi, "a", "w", propagation="Orphan")
    kept = await s.get(po, "a", "kept")
    assert "ownerReferences" not in kept["metadata"], "the garbage collector takes the orphaned owner's reference off"


async def test_delete_preconditions() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    created = await s.create(po, pod("x"), namespace="a")
    with pytest.raises(ApiError) as err:
        await s.delete(po, "a", "x", preconditions={"uid": "someone-else"})
    assert err.value.code == 409 and "Precondition failed" in err.value.message
    await s.delete(po, "a", "x", preconditions={"uid": created["metadata"]["uid"]})
    assert (await s.list(po))[0] == []


async def test_admission_hook_refuses_with_a_403_status_and_nothing_is_written() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    seen: list[tuple[Operation, str | None]] = []

    async def deny_big(op: Operation, res: Resource, new: Obj | None, old: Obj | None, sub: str | None) -> Obj | None:
        seen.append((op, (new or old or {}).get("metadata", {}).get("name")))
        if new is not None and new["metadata"].get("labels", {}).get("size") == "big":
            raise ApiError(403, "Forbidden", f'pods "{new["metadata"]["name"]}" is forbidden: exceeded quota: q')
        if new is not None:
            new["metadata"].setdefault("annotations", {})["admitted"] = "yes"
        return new

    s.add_admission(po, deny_big)
    rv = s.resource_version
    with pytest.raises(ApiError) as err:
        await s.create(po, pod("huge", {"size": "big"}), namespace="a")
    assert err.value.code == 403
    assert err.value.status()["kind"] == "Status" and err.value.status()["reason"] == "Forbidden"
    assert s.resource_version == rv and (await s.list(po))[0] == []
    ok = await s.create(po, pod("small"), namespace="a")
    assert ok["metadata"]["annotations"] == {"admitted": "yes"}
    await s.delete(po, "a", "small")
    assert seen == [("CREATE", "huge"), ("CREATE", "small"), ("DELETE", "small")]


async def test_admission_hook_may_write_to_the_store_while_the_write_lock_is_held() -> None:
    s = Store()
    await with_namespace(s)
    po, q = s.resource("pods"), s.resource("resourcequotas")
    await s.create(q, {"metadata": {"name": "q", "namespace": "a"}, "spec": {}})

    async def charge(op: Operation, res: Resource, new: Obj | None, old: Obj | None, sub: str | None) -> Obj | None:
        if op == "CREATE":

            def bump(o: Obj) -> Obj:
                used = o.setdefault("status", {}).setdefault("used", {})
                used["pods"] = str(int(used.get("pods", "0")) + 1)
                return o

            await s.mutate(q, "a", "q", bump, status=True)
        return None

    s.add_admission(po, charge)
    await asyncio.gather(*(s.create(po, pod(f"p{i}"), namespace="a") for i in range(5)))
    assert (await s.get(q, "a", "q"))["status"]["used"] == {"pods": "5"}


async def test_on_change_sees_every_committed_write_in_order() -> None:
    s = Store()
    seen: list[tuple[str, str, str]] = []
    s.on_change(lambda t, r, o: seen.append((t, r.plural, o["metadata"]["resourceVersion"])))
    await with_namespace(s)
    po = s.resource("pods")
    await s.create(po, pod("x"), namespace="a")
    await s.patch(po, "a", "x", {"metadata": {"labels": {"k": "v"}}}, "strategic")
    await s.delete(po, "a", "x")
    assert seen == [
        ("ADDED", "namespaces", "1"),
        ("ADDED", "pods", "2"),
        ("MODIFIED", "pods", "3"),
        ("DELETED", "pods", "4"),
    ]


async def test_watch_from_a_resource_version_replays_then_follows() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    first = await s.create(po, pod("x"), namespace="a")
    await s.create(po, pod("y"), namespace="a")
    w = s.watch(po, "a", resource_version=int(first["metadata"]["resourceVersion"]))
    await s.delete(po, "a", "x")
    events = [await next_event(w) for _ in range(2)]
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [("ADDED", "y"), ("DELETED", "x")]
    everything = s.watch(po, initial_events=True)
    ev = await next_event(everything)
    assert (ev.type, ev.object["metadata"]["name"]) == ("ADDED", "y")


async def test_watch_from_a_compacted_resource_version_is_410() -> None:
    s = Store(history=5)
    await with_namespace(s)
    po = s.resource("pods")
    for i in range(10):
        await s.create(po, pod(f"p{i}"), namespace="a")
    assert s.oldest_resource_version == s.resource_version - 5
    w = s.watch(po, resource_version=2)
    ev = await next_event(w)
    assert ev.type == "ERROR" and ev.object["code"] == 410 and ev.object["kind"] == "Status"
    assert ev.object["message"].startswith("too old resource version: 2")
    with pytest.raises(StopAsyncIteration):
        await next_event(w)
    ok = s.watch(po, resource_version=s.oldest_resource_version)
    assert (await next_event(ok)).object["metadata"]["name"] == "p5"
    s.compact()
    again = s.watch(po, resource_version=s.resource_version - 1)
    assert (await next_event(again)).object["code"] == 410


async def test_bookmarks_carry_only_the_resource_version() -> None:
    s = Store(bookmark_interval=0.05)
    await with_namespace(s)
    po = s.resource("pods")
    w = s.watch(po, "a", bookmarks=True)
    await s.create(s.resource("quota"), {"metadata": {"name": "q", "namespace": "a"}, "spec": {}})
    ev = await next_event(w)
    assert ev.type == "BOOKMARK"
    assert ev.object == {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(s.resource_version)}}
    quiet = s.watch(po, "a")  # did not ask for bookmarks: gets none
    s.send_bookmarks()
    await s.create(po, pod("x"), namespace="a")
    assert (await next_event(quiet)).type == "ADDED"
    assert [(await next_event(w)).type for _ in range(2)] == ["BOOKMARK", "ADDED"]


async def test_watch_selectors_turn_transitions_into_added_and_deleted() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    w = s.watch(po, "a", label_selector="app=web")
    await s.create(po, pod("x", {"app": "db"}), namespace="a")
    await s.patch(po, "a", "x", {"metadata": {"labels": {"app": "web"}}}, "merge")
    await s.patch(po, "a", "x", {"metadata": {"labels": {"tier": "1"}}}, "merge")
    await s.patch(po, "a", "x", {"metadata": {"labels": {"app": "db"}}}, "merge")
    types = [(await next_event(w)).type for _ in range(3)]
    assert types == ["ADDED", "MODIFIED", "DELETED"]
    fw = s.watch(po, field_selector="status.phase=Running")
    await s.mutate(po, "a", "x", lambda o: {**o, "status": {"phase": "Running"}}, status=True)
    assert (await next_event(fw)).type == "ADDED"


async def test_a_slow_watcher_is_disconnected() -> None:
    s = Store(watch_queue=8, slow_watcher_timeout=0.05)
    await with_namespace(s)
    po = s.resource("pods")
    slow = s.watch(po)
    fast = s.watch(po)
    received: list[str] = []

    async def consume() -> None:
        async for ev in fast:
            received.append(ev.object["metadata"]["name"])
            if len(received) == 30:
                return

    task = asyncio.create_task(consume())
    for i in range(30):
        await s.create(po, pod(f"p{i}"), namespace="a")
    await asyncio.wait_for(task, 2)
    assert received == [f"p{i}" for i in range(30)]
    assert slow.watcher.closed and slow.watcher.close_reason.startswith("slow watcher")
    with pytest.raises(StopAsyncIteration):
        await next_event(slow)


async def test_drop_watches_ends_every_watch() -> None:
    s = Store()
    await with_namespace(s)
    w = s.watch(s.resource("pods"))
    assert s.drop_watches() == 1 and s.watcher_count() == 0
    with pytest.raises(StopAsyncIteration):
        await next_event(w)


async def test_list_selectors_and_bad_selectors() -> None:
    s = Store()
    await with_namespace(s)
    po = s.resource("pods")
    await s.create(po, pod("a1", {"app": "web", "tier": "1"}, nodeName="n1"), namespace="a")
    await s.create(po, pod("a2", {"app": "db"}), namespace="a")
    await s.create(po, pod("a3", {}), namespace="a")

    async def names(**kw: str) -> list[str]:
        return [p["metadata"]["name"] for p in (await s.list(po, "a", **kw))[0]]

    assert await names(label_selector="app=web") == ["a1"]
    assert await names(label_selector="app!=web") == ["a2", "a3"]
    assert await names(label_selector="app in (web, db)") == ["a1", "a2"]
    assert await names(label_selector="app notin (web)") == ["a2", "a3"]
    assert await names(label_selector="app,!tier") == ["a2"]
    assert await names(label_selector="tier>0") == ["a1"]
    assert await names(field_selector="spec.nodeName=n1") == ["a1"]
    assert await names(field_selector="metadata.name!=a1,status.phase=Pending") == ["a2", "a3"]
    for bad in ("app=(x", "in (a)", "a in ()", "app=web,", "!"):
        with pytest.raises(ApiError) as err:
            await s.list(po, label_selector=bad)
        assert err.value.code == 400, bad
    with pytest.raises(ApiError) as err:
        await s.list(po, field_selector="spec.containers=x")
    assert err.value.code == 400 and err.value.message == 'field label not supported: "spec.containers"'


def test_selector_parsing_details() -> None:
    sel = parse_label_selector("a.b/c == x , d notin (y,z), !e")
    assert sel.matches({"a.b/c": "x"}) and not sel.matches({"a.b/c": "x", "e": ""})
    assert not sel.matches({"a.b/c": "x", "d": "z"})
    assert parse_label_selector("").matches({"any": "thing"})
    for key in ("/e", "a/b/c", "Not_A.Domain/x", "x" * 64):  # (a key with an empty prefix was taken)
        with pytest.raises(ApiError, match="invalid label key"):
            parse_label_selector(f"{key}=v")
    fs = parse_field_selector(r"metadata.name=a\,b")
    assert fs.terms == (("metadata.name", "=", "a,b"),)


def test_patch_formats() -> None:
    doc = {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    assert merge_patch(doc, {"a": {"b": None, "c": [3]}, "e": 1}) == {"a": {"c": [3]}, "d": "x", "e": 1}
    assert doc == {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    ops = [
        {"op": "add", "path": "/a/c/-", "value": 3},
        {"op": "replace", "path": "/d", "value": "y"},
        {"op": "move", "from": "/a/b", "path": "/b"},
        {"op": "copy", "from": "/b", "path": "/a/k~1j"},
        {"op": "test", "path": "/d", "value": "y"},
    ]
    assert json_patch(doc, ops) == {"a": {"c": [1, 2, 3], "k/j": 1}, "d": "y", "b": 1}
    with pytest.raises(ApiError) as err:
        json_patch(doc, [{"op": "test", "path": "/d", "value": "nope"}])
    assert err.value.code == 422
    with pytest.raises(ApiError):
        json_patch(doc, [{"op": "remove", "path": "/missing"}])
    p = {
        "metadata": {"finalizers": ["a"]},
        "spec": {"containers": [{"name": "c", "image": "1", "env": [{"name": "A", "value": "1"}]}, {"name": "d"}]},
    }
    patched = strategic_merge_patch(
        p,
        {
            "metadata": {"finalizers": ["b"]},
            "spec": {
                "containers": [
                    {"name": "c", "image": "2", "env": [{"name": "B", "value": "2"}]},
                    {"name": "d", "$patch": "delete"},
                    {"name": "e"},
                ]
            },
        },
    )
    assert patched == {
        "metadata": {"finalizers": ["a", "b"]},
        "spec": {
            "containers": [
                {"name": "c", "image": "2", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                {"name": "e"},
            ]
        },
    }
    replaced = strategic_merge_patch(p, {"spec": {"$patch": "replace", "hostname": "h"}})
    assert replaced["spec"] == {"hostname": "h"}
    pruned = strategic_merge_patch(p, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}})
    assert pruned["metadata"]["finalizers"] == []


async def test_strategic_merge_patch_is_refused_for_custom_resources() -> None:
    s = Store()
    await with_namespace(s)
    vmi = s.resource("vmi")
    await s.create(vmi, {"metadata": {"name": "v"}, "spec": {}}, namespace="a")
    with pytest.raises(ApiError) as err:
        await s.patch(vmi, "a", "v", {"metadata": {"labels": {"a": "b"}}}, "strategic")
    assert err.value.code == 415


# --- the invariant: a watch replayed onto a list reproduces the store, with or without selectors --------------

_NAMES = st.sampled_from(["p0", "p1", "p2", "p3"])
_LABELS = st.sampled_from([{}, {"app": "web"}, {"app": "db"}, {"app": "web", "tier": "1"}])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), _NAMES, _LABELS),
        st.tuples(st.just("label"), _NAMES, _LABELS),
        st.tuples(st.just("delete"), _NAMES, _LABELS),
        st.tuples(st.just("finalize"), _NAMES, _LABELS),
    ),
    max_size=25,
)


async def _apply(s: Store, op: tuple[str, str, dict[str, str]]) -> None:
    po = s.resource("pods")
    kind, name, labels = op
    try:
        if kind == "create":
            await s.create(
                po,
                {**pod(name, labels), "metadata": {"name": name, "labels": labels, "finalizers": ["f"]}},
                namespace="a",
            )
        elif kind == "label":
            await s.patch(po, "a", name, {"metadata": {"labels": labels or None}}, "merge")
        elif kind == "delete":
            await s.delete(po, "a", name)
        else:
            await s.patch(po, "a", name, {"metadata": {"finalizers": None}}, "merge")
    except ApiError as err:
        assert err.code in (404, 409), err.message


def _fold(state: dict[str, Obj], ev: WatchEvent) -> None:
    name = ev.object["metadata"]["name"]
    if ev.type == "DELETED":
        state.pop(name)
    else:
        assert ev.type in ("ADDED", "MODIFIED") and (ev.type == "ADDED") == (name not in state)
        state[name] = ev.object


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_OPS, after=_OPS, selector=st.sampled_from(["", "app=web", "app!=web", "tier"]))
def test_list_then_watch_reproduces_the_store(
    before: list[tuple[str, str, dict[str, str]]], after: list[tuple[str, str, dict[str, str]]], selector: str
) -> None:
    async def scenario() -> None:
        s = Store(seed=0)
        await with_namespace(s)
        po = s.resource("pods")
        for op in before:
            await _apply(s, op)
        items, rv = await s.list(po, "a", label_selector=selector)
        rvs = [rv]
        w = s.watch(po, "a", resource_version=rv, label_selector=selector, bookmarks=True)
        for op in after:
            await _apply(s, op)
            rvs.append(s.resource_version)
        assert rvs == sorted(rvs)
        s.send_bookmarks()  # marks the end: everything before it has been delivered
        state = {o["metadata"]["name"]: o for o in items}
        last = rv
        while True:
            ev = await next_event(w)
            new_rv = int(ev.object["metadata"]["resourceVersion"])
            if ev.type == "BOOKMARK":
                assert new_rv == s.resource_version
                break
            assert new_rv > last
            last = new_rv
            _fold(state, ev)
        final, _ = await s.list(po, "a", label_selector=selector)
        assert state == {o["metadata"]["name"]: o for o in final}

    asyncio.run(scenario())
