"""Kubernetes ResourceQuota in the simulated cluster: admission exactly as kube-apiserver refuses and charges, and the
quota controller's copy of spec.hard and recomputation of status.used."""

from __future__ import annotations

import asyncio
import ctypes
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.kubevirt import KubeVirtTiming
from services.devtools.simcluster.quota import (
    PodUsageCache,
    QuotaTiming,
    admit_pod,
    compute_usage,
    default_pod,
    missing_constraints,
    pretty,
)
from services.devtools.simcluster.store_api import ApiError
from shared.podusage import pod_quota_usage
from shared.quantity import Quantity
from shared.resources import add, format_resource_list, parse_resource_list
from shared.times import parse_rfc3339

pytestmark = pytest.mark.integration

SPEED = 0.05


def container(
    name: str, requests: dict[str, str] | None = None, limits: dict[str, str] | None = None
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if requests:
        res["requests"] = requests
    if limits:
        res["limits"] = limits
    return {"name": name, "image": "busybox", "resources": res}


def pod(name: str, *containers: dict[str, Any], namespace: str = "t", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": list(containers), **spec},
    }


def quota(name: str, hard: dict[str, str], used: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "t"},
        "spec": {"hard": hard, **spec},
        "status": {"hard": hard, "used": used if used is not None else dict.fromkeys(hard, "0")},
    }


# ---- admission, pure --------------------------------------------------------------------------------------------


def test_exceeded_quota_message_is_kube_apiservers() -> None:
    q = quota("compute", {"limits.memory": "64Gi"}, {"limits.memory": "48Gi"})
    p = pod("virt-launcher-vm4-abcde", container("compute", {"memory": "16Gi"}, {"memory": "17405661185"}))
    with pytest.raises(ApiError) as err:
        admit_pod(p, [q])
    assert err.value.code == 403
    assert err.value.reason == "Forbidden"
    assert err.value.message == (
        'pods "virt-launcher-vm4-abcde" is forbidden: exceeded quota: compute, requested: '
        "limits.memory=17405661185, used: limits.memory=48Gi, limited: limits.memory=64Gi"
    )


def test_only_exceeded_resources_are_listed_sorted() -> None:
    q = quota(
        "compute",
        {"limits.cpu": "2", "limits.memory": "1Gi", "requests.cpu": "10", "pods": "10"},
        {"limits.cpu": "1500m", "limits.memory": "512Mi", "requests.cpu": "0", "pods": "1"},
    )
    p = pod("p", container("c", {"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}))
    with pytest.raises(ApiError) as err:
        admit_pod(p, [q])
    assert err.value.message.endswith(
        "exceeded quota: compute, requested: limits.cpu=1,limits.memory=1Gi, "
        "used: limits.cpu=1500m,limits.memory=512Mi, limited: limits.cpu=2,limits.memory=1Gi"
    )


def test_must_specify_names_resources_and_containers() -> None:
    q = quota("compute", {"limits.cpu": "10", "limits.memory": "64Gi"})
    p = pod("p", container("compute", limits={"memory": "1Gi"}), container("sidecar"))
    with pytest.raises(ApiError) as err:
        admit_pod(p, [q])
    assert err.value.code == 403
    assert err.value.message == (
        'pods "p" is forbidden: failed quota: compute: must specify limits.cpu for: compute,sidecar; '
        "limits.memory for: sidecar"
    )
    # the brief's single-resource form
    one = pod("p", container("compute", limits={"memory": "1Gi"}))
    assert missing_constraints(one, ["limits.cpu", "limits.memory"]) == "must specify limits.cpu for: compute"
    # resources outside the validation set (extended resources) never need specifying
    assert missing_constraints(one, ["requests.nvidia.com/gpu", "count/pods"]) is None
    # podEvaluator.Constraints (Kubernetes 1.34+): a pod with pod-level resources is not held to container values;
    # an unsupported pod-level resource alone does not count (IsPodLevelResourcesSet)
    pod_level = {**one, "spec": {**one["spec"], "resources": {"limits": {"cpu": "2", "memory": "2Gi"}}}}
    assert missing_constraints(pod_level, ["limits.cpu", "limits.memory"]) is None
    storage_only = {**one, "spec": {**one["spec"], "resources": {"limits": {"ephemeral-storage": "1Gi"}}}}
    assert missing_constraints(storage_only, ["limits.cpu"]) == "must specify limits.cpu for: compute"


def test_unsynced_quota_does_not_constrain_and_unknown_usage_refuses() -> None:
    big = pod("p", container("c", {"memory": "100Gi"}, {"memory": "100Gi"}))
    fresh = {"metadata": {"name": "new"}, "spec": {"hard": {"limits.memory": "1Gi"}}}
    assert admit_pod(big, [fresh]) == {}  # status.hard not yet copied by the controller: no constraint
    half = {"metadata": {"name": "half"}, "spec": {}, "status": {"hard": {"limits.memory": "1Gi"}}}
    with pytest.raises(ApiError) as err:
        admit_pod(big, [half])
    assert err.value.message == 'pods "p" is forbidden: status unknown for quota: half, resources: limits.memory'


def test_admission_returns_new_used_of_each_charged_quota() -> None:
    q1 = quota("a", {"limits.memory": "4Gi", "pods": "5"}, {"limits.memory": "1Gi", "pods": "1"})
    q2 = quota("b", {"requests.storage": "1Ti"})  # tracks nothing a pod uses: not charged
    p = pod("p", container("c", {"memory": "512Mi"}, {"memory": "1Gi"}))
    out = admit_pod(p, [q1, q2])
    assert set(out) == {"a"}
    assert format_resource_list(out["a"]) == {"limits.memory": "2Gi", "pods": "2"}


def test_scopes_select_pods() -> None:
    best_effort = quota("be", {"pods": "1"}, {"pods": "1"}, scopes=["BestEffort"])
    terminating = quota("term", {"pods": "1"}, {"pods": "1"}, scopes=["Terminating"])
    burstable = pod("b", container("c", {"cpu": "1"}))
    assert admit_pod(burstable, [best_effort, terminating]) == {}
    with pytest.raises(ApiError, match="exceeded quota: be"):
        admit_pod(pod("e", container("c")), [best_effort])
    with pytest.raises(ApiError, match="exceeded quota: term"):
        admit_pod(pod("d", container("c", {"cpu": "1"}), activeDeadlineSeconds=60), [terminating])
    pc = quota(
        "prio",
        {"pods": "0"},
        {"pods": "0"},
        scopeSelector={"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]},
    )
    assert admit_pod(pod("low", container("c"), priorityClassName="low"), [pc]) == {}
    with pytest.raises(ApiError, match="exceeded quota: prio"):
        admit_pod(pod("hi", container("c"), priorityClassName="high"), [pc])


def test_terminal_pods_count_only_for_count_pods() -> None:
    hard = {"limits.memory": "10Gi", "count/pods": "10", "pods": "10"}
    running = pod("r", container("c", {"memory": "1Gi"}, {"memory": "1Gi"}))
    done = {**pod("d", container("c", {"memory": "2Gi"}, {"memory": "2Gi"})), "status": {"phase": "Succeeded"}}
    q = {"metadata": {"name": "q"}, "spec": {"hard": hard}}
    status_hard, used = compute_usage(q, [running, done])
    assert format_resource_list(status_hard) == hard
    assert format_resource_list(used) == {"count/pods": "2", "limits.memory": "1Gi", "pods": "1"}


_SIZES = st.sampled_from(["100m", "250m", "1", "2"]), st.sampled_from(["64Mi", "512Mi", "1Gi", "1536Mi", "3Gi"])


@settings(max_examples=60, deadline=None)
@given(
    hard_cpu=st.sampled_from(["1", "2", "5"]),
    hard_mem=st.sampled_from(["1Gi", "4Gi", "6Gi"]),
    pods=st.lists(st.tuples(*_SIZES, st.booleans()), max_size=12),
)
def test_admission_never_overcommits_and_agrees_with_the_controller(
    hard_cpu: str, hard_mem: str, pods: list[tuple[str, str, bool]]
) -> None:
    """Invariants: a pod is refused iff it would push a tracked resource over hard; charged usage equals what the
    controller recomputes from the admitted pods."""
    hard = {"limits.cpu": hard_cpu, "limits.memory": hard_mem, "pods": "8"}
    q = quota("compute", hard)
    admitted: list[dict[str, Any]] = []
    hard_q = parse_resource_list(hard)
    for i, (cpu, mem, with_request) in enumerate(pods):
        p = pod(f"p{i}", container("c", {"memory": mem} if with_request else None, {"cpu": cpu, "memory": mem}))
        used = parse_resource_list(q["status"]["used"])
        want = add(used, {k: v for k, v in pod_quota_usage(p).items() if k in hard_q})
        fits = all(want[k] <= hard_q[k] for k in hard_q)
        try:
            out = admit_pod(p, [q])
        except ApiError as e:
            assert not fits, e.message
            assert "exceeded quota: compute" in e.message
            continue
        assert fits
        q["status"]["used"] = format_resource_list(out.get("compute", used))
        admitted.append(p)
    _, recomputed = compute_usage(q, admitted)
    assert format_resource_list(recomputed) == q["status"]["used"]
    cache = PodUsageCache()
    for i, p in enumerate(admitted):  # the controller's cached charges give the same status, twice over
        p["metadata"].update(uid=f"u{i}", resourceVersion=str(i + 1))
    for _ in range(2):
        _, cached = compute_usage(q, admitted, usage_of=cache)
        assert format_resource_list(cached) == q["status"]["used"]


def test_the_pod_usage_cache_follows_versions_and_time() -> None:
    cache = PodUsageCache()
    p = pod("p", container("c", {"memory": "1Gi"}, {"memory": "1Gi"}))
    p["metadata"].update(uid="u1", resourceVersion="1")
    assert format_resource_list(cache(p)) == format_resource_list(pod_quota_usage(p))
    resized = pod("p", container("c", {"memory": "2Gi"}, {"memory": "2Gi"}))
    resized["metadata"].update(uid="u1", resourceVersion="2")
    assert format_resource_list(cache(resized))["limits.memory"] == "2Gi", "a new version is charged anew"
    done = {**resized, "status": {"phase": "Failed"}}
    assert format_resource_list(cache(done)) == {"count/pods": "1"}, "terminal: whatever the cache holds"


# ---- in the simulated cluster -------------------------------------------------------------------------------------


@pytest.fixture
async def sim() -> Any:
    async with SimCluster(speed=SPEED, serve_http=False) as s:
        await s.create_namespace("t")
        yield s


async def test_admission_charges_status_used_in_the_same_write(sim: SimCluster) -> None:
    await sim.create_quota("t", "compute", {"limits.memory": "8Gi", "limits.cpu": "4", "pods": "10"})
    before = await sim.wait_quota_synced("t", "compute")
    created = await sim.create(
        pod("p1", container("c", {"cpu": "500m", "memory": "1Gi"}, {"cpu": "1", "memory": "2Gi"}))
    )
    after = await sim.get("resourcequotas", "t", "compute")  # no waiting: admission wrote it
    assert int(after["metadata"]["resourceVersion"]) == int(created["metadata"]["resourceVersion"]) - 1
    assert after["status"]["used"] == {"limits.cpu": "1", "limits.memory": "2Gi", "pods": "1"}
    assert before["status"]["used"] == {"limits.cpu": "0", "limits.memory": "0", "pods": "0"}
    assert created["status"]["phase"] == "Pending"
    assert created["status"]["qosClass"] == "Burstable"
    assert created["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "500m"


async def test_refused_pod_is_not_stored_and_not_charged(sim: SimCluster) -> None:
    await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})
    synced = await sim.wait_quota_synced("t", "compute")
    with pytest.raises(ApiError) as err:
        await sim.create(pod("big", container("c", limits={"memory": "2Gi"})))
    assert err.value.code == 403
    assert "exceeded quota: compute, requested: limits.memory=2Gi, used: limits.memory=0" in err.value.message
    assert sim.peek("pods", "t", "big") is None
    q = await sim.get("resourcequotas", "t", "compute")
    assert q["metadata"]["resourceVersion"] == synced["metadata"]["resourceVersion"]


async def test_a_pods_overhead_is_its_runtime_classs_only(sim: SimCluster) -> None:
    """kube-apiserver's RuntimeClass admission (before quota): ``spec.overhead`` set without a RuntimeClass is
    refused; the simulated cluster has no RuntimeClass, so a pod naming one is refused as naming a missing one."""
    await sim.create_quota("t", "compute", {"limits.memory": "8Gi"})
    await sim.wait_quota_synced("t", "compute")
    overhead = pod("o", container("c", limits={"memory": "1Gi"}))
    overhead["spec"]["overhead"] = {"memory": "1Gi"}
    named = pod("r", container("c", limits={"memory": "1Gi"}))
    named["spec"]["runtimeClassName"] = "kata"
    for refused, why in (
        (overhead, "Pod Overhead set without corresponding RuntimeClass defined Overhead"),
        (named, 'RuntimeClass "kata" not found'),
    ):
        with pytest.raises(ApiError) as err:
            await sim.create(refused)
        name = refused["metadata"]["name"]
        assert (err.value.code, err.value.message) == (403, f'pods "{name}" is forbidden: pod rejected: {why}')


async def test_a_pod_a_finalizer_holds_is_charged_through_its_grace_period(sim: SimCluster) -> None:
    """A pod is deleted gracefully: its ``deletionTimestamp`` is the end of its grace period, and quota charges it
    until then or until the kubelet has ended it (a pod held by a finalizer stays; one without goes at once)."""
    await sim.create_quota("t", "compute", {"limits.memory": "4Gi"})
    await sim.wait_quota_synced("t", "compute")
    held = pod("held", container("c", limits={"memory": "1Gi"}), terminationGracePeriodSeconds=3600)
    held["metadata"]["finalizers"] = ["example.com/hold"]
    await sim.create(held)
    await sim.wait_until("pods", "t", "held", lambda o: o["status"].get("phase") == "Running")
    deleted = await sim.store.delete(sim.store.resource("pods"), "t", "held")
    assert deleted["metadata"]["deletionGracePeriodSeconds"] == 3600
    await sim.store.mutate(  # (any write of the quota makes the controller recalculate it)
        sim.store.resource("resourcequotas"),
        "t",
        "compute",
        lambda o: {**o, "spec": {"hard": {"limits.memory": "5Gi"}}},
    )
    q = await sim.wait_until(
        "resourcequotas", "t", "compute", lambda o: o["status"].get("hard", {}).get("limits.memory") == "5Gi"
    )
    assert q["status"]["used"]["limits.memory"] == "1Gi", "charged through its grace period"
    with pytest.raises(ApiError) as err:
        await sim.create(pod("more", container("c", limits={"memory": "4500Mi"})))
    assert err.value.code == 403


async def test_a_grace_period_past_gos_durations_wraps_as_kube_apiserver_wraps_it(sim: SimCluster) -> None:
    """kube-apiserver sets a deleted pod's ``deletionTimestamp`` to now plus ``time.Duration(grace) * time.Second``,
    int64 nanoseconds that wrap, and keeps the grace period as asked: a grace period of 10^14 seconds ends some 200
    years away, not three million; the simulator wrote a timestamp no RFC 3339 reader takes."""
    held = pod("held", container("c", limits={"memory": "1Gi"}), terminationGracePeriodSeconds=10**14)
    held["metadata"]["finalizers"] = ["example.com/hold"]
    await sim.create(held)
    before = datetime.now(UTC).replace(microsecond=0)
    deleted = await sim.store.delete(sim.store.resource("pods"), "t", "held")
    assert deleted["metadata"]["deletionGracePeriodSeconds"] == 10**14
    ends = parse_rfc3339(deleted["metadata"]["deletionTimestamp"])
    wrapped = timedelta(microseconds=ctypes.c_int64(10**14 * 10**9).value // 1000)  # (Go's int64, by C's)
    assert ends is not None and abs(ends - (before + wrapped)) <= timedelta(seconds=2), ends


async def test_a_cross_namespace_affinity_quota_holds_only_such_pods(sim: SimCluster) -> None:
    """``CrossNamespacePodAffinity`` (with ``pods: 0``, the documented way to forbid cross-namespace affinity) matches
    a pod with a pod (anti-)affinity term that names namespaces or has a namespace selector; a
    ``VolumeAttributesClass`` scope is a volume claim's and matches no pod."""
    await sim.create_quota("t", "no-cross", {"pods": "0"}, scopes=["CrossNamespacePodAffinity"])
    await sim.create_quota("t", "volumes", {"pods": "0"}, scopes=["VolumeAttributesClass"])
    for name in ("no-cross", "volumes"):
        await sim.wait_quota_synced("t", name)
    await sim.create(pod("plain", container("c", limits={"memory": "64Mi"})))
    crossing = pod("crossing", container("c", limits={"memory": "64Mi"}))
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}, "namespaceSelector": {}}
    crossing["spec"]["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    with pytest.raises(ApiError) as err:
        await sim.create(crossing)
    assert err.value.code == 403 and "exceeded quota: no-cross, requested: pods=1" in err.value.message


async def test_spec_hard_takes_effect_only_after_the_controller_copies_it() -> None:
    async with SimCluster(speed=1.0, serve_http=False, quota_timing=QuotaTiming(sync_delay=0.3)) as sim:
        await sim.create_namespace("t")
        await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})
        await sim.wait_quota_synced("t", "compute", within=5)
        await sim.set_quota_hard("t", "compute", {"limits.memory": "4Gi"})
        big = pod("big", container("c", limits={"memory": "2Gi"}))
        with pytest.raises(ApiError, match=r"limited: limits\.memory=1Gi"):
            await sim.create(big)  # status.hard still says 1Gi
        q = await sim.wait_quota_synced("t", "compute", within=5)
        assert q["status"]["hard"] == {"limits.memory": "4Gi"}
        await sim.create(big)
        assert (await sim.get("resourcequotas", "t", "compute"))["status"]["used"] == {"limits.memory": "2Gi"}


async def test_controller_recomputes_from_pods_and_replenishes_on_termination_and_deletion(sim: SimCluster) -> None:
    for i, mem in enumerate(["1Gi", "2Gi", "3Gi"]):
        await sim.create(pod(f"p{i}", container("c", {"memory": mem}, {"memory": mem})))
    # a quota created after its pods: the controller computes their usage
    await sim.create_quota("t", "compute", {"limits.memory": "10Gi", "count/pods": "10", "pods": "10"})
    q = await sim.wait_quota_synced("t", "compute")
    assert q["status"]["used"] == {"count/pods": "3", "limits.memory": "6Gi", "pods": "3"}
    for i in range(3):
        await sim.wait_until("pods", "t", f"p{i}", lambda p: p["status"].get("phase") == "Running")

    def succeed(p: dict[str, Any]) -> dict[str, Any]:
        p["status"]["phase"] = "Succeeded"
        return p

    await sim.store.mutate(sim.store.resource("pods"), "t", "p2", succeed, status=True)
    q = await sim.wait_until("resourcequotas", "t", "compute", lambda o: o["status"]["used"]["limits.memory"] == "3Gi")
    assert q["status"]["used"] == {"count/pods": "3", "limits.memory": "3Gi", "pods": "2"}
    await sim.store.delete(sim.store.resource("pods"), "t", "p0")
    q = await sim.wait_until("resourcequotas", "t", "compute", lambda o: o["status"]["used"]["pods"] == "1")
    assert q["status"]["used"] == {"count/pods": "2", "limits.memory": "2Gi", "pods": "1"}


async def test_invalid_quotas_and_pods_are_refused_naming_the_field(sim: SimCluster) -> None:
    with pytest.raises(ApiError) as err:
        await sim.create_quota("t", "bad", {"limits.memory": "lots"})
    assert err.value.code == 422
    assert 'ResourceQuota "bad" is invalid: spec.hard.limits.memory' in err.value.message
    with pytest.raises(ApiError) as err:
        await sim.create_quota("t", "scoped", {"pods": "1"}, scopes=["Unknown"])
    assert err.value.code == 422
    assert "spec.scopes[0]: Unsupported value: 'Unknown'" in err.value.message
    with pytest.raises(ApiError) as err:
        await sim.create(pod("p", container("c", limits={"memory": "-1Gi"})))
    assert err.value.code == 422
    assert "spec.containers[0].resources.limits.memory" in err.value.message


async def test_a_pod_whose_limit_is_written_in_67_digits_is_admitted_and_charged(sim: SimCluster) -> None:
    """kube-apiserver parses a quantity of any length (a decimal one is kept as written, beyond int64): such a pod
    is admitted and quota charges what it asks. The simulated cluster refused it as invalid, so no test could reach
    what vmquota makes of it."""
    await sim.create_quota("t", "compute", {"requests.memory": "8Gi"})
    await sim.wait_quota_synced("t", "compute")
    digits = "1234567890123456789012345678901234567890123456789012345678901234567"
    await sim.create(pod("long", container("c", {"memory": "1Gi"}, {"ephemeral-storage": digits})))
    q = await sim.get("resourcequotas", "t", "compute")
    assert q["status"]["used"]["requests.memory"] == "1Gi"


async def test_refusal_over_https_is_a_403_status(tmp_path: Any) -> None:
    async with SimCluster(speed=SPEED) as sim:
        await sim.create_namespace("t")
        await sim.create_quota("t", "compute", {"limits.memory": "1Gi"})
        await sim.wait_quota_synced("t", "compute")
        headers = {"Authorization": f"Bearer {sim.token}"}
        body = pod("web", container("c", limits={"memory": "2Gi"}))
        async with (
            aiohttp.ClientSession(headers=headers) as http,
            http.post(f"{sim.url}/api/v1/namespaces/t/pods", json=body, ssl=sim.client_ssl() or False) as resp,
        ):
            status = await resp.json()
        assert resp.status == 403
        assert status["kind"] == "Status"
        assert status["reason"] == "Forbidden"
        assert status["message"] == (
            'pods "web" is forbidden: exceeded quota: compute, requested: limits.memory=2Gi, '
            "used: limits.memory=0, limited: limits.memory=1Gi"
        )


async def test_quota_update_requeues_a_refused_migration_at_once() -> None:
    """With a backoff far longer than the test, only the re-queue on quota update can let the migration go."""
    timing = KubeVirtTiming(speed=SPEED, backoff_base=200.0)
    async with SimCluster(speed=SPEED, serve_http=False, kubevirt_timing=timing) as sim:
        await sim.create_namespace("t")
        await sim.create_quota("t", "compute", {"limits.memory": "12Gi"})
        await sim.wait_quota_synced("t", "compute")
        await sim.create_vm("t", "vm1", memory="8Gi", limits={"memory": "8Gi"})
        await sim.wait_for_phase("t", "vm1", "Running")
        vmim = await sim.migrate("t", "vm1", name="mig1")
        await sim.wait_until(
            "vmim",
            "t",
            "mig1",
            lambda m: any(
                c["type"] == "migrationRejectedByResourceQuota" for c in m.get("status", {}).get("conditions", [])
            ),
        )
        refused = sim.kubevirt.pods_refused
        assert sim.kubevirt.migration_queue.backoff(("t", "mig1")) >= 200.0 * SPEED  # next retry far away
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await sim.set_quota_hard("t", "compute", {"limits.memory": "24Gi"})
        done = await sim.wait_for_phase("t", "mig1", "Succeeded", kind="vmim", within=5)
        assert loop.time() - t0 < 200.0 * SPEED
        # the spec edit itself re-queues too (KubeVirt reacts to every quota update), before status.hard follows
        assert refused <= sim.kubevirt.pods_refused <= refused + 1
        assert "conditions" not in done["status"] or all(
            c["type"] != "migrationRejectedByResourceQuota" for c in done["status"]["conditions"]
        )
        assert vmim["metadata"]["labels"]["kubevirt.io/vmi-name"] == "vm1"


def test_pretty_prints_canonical_quantities() -> None:
    assert pretty({"b": Quantity.parse("1024Mi"), "a": Quantity.parse("0.5")}) == "a=500m,b=1Gi"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(["requests.cpu", "requests.memory", "pods", "limits.cpu"]),
            st.sampled_from(["0", "1", "100m", "1Gi", "1073741824", "1G", "500M", "2"]).map(Quantity.parse),
            max_size=4,
        ),
        max_size=8,
    )
)
def test_the_controllers_sum_is_quantity_addition_in_pod_order(charges: list[dict[str, Quantity]]) -> None:
    """Values and printed forms (the first non-zero operand's format) as adding the pods' charges one by one."""
    hard = {"requests.cpu": "100", "requests.memory": "100Gi", "pods": "100"}
    q: dict[str, Any] = {"metadata": {"name": "q", "namespace": "ns"}, "spec": {"hard": hard}}
    pods = [{"metadata": {"name": f"p{i}"}, "charge": c} for i, c in enumerate(charges)]

    def charge(pod: Any, now: Any = None) -> dict[str, Quantity]:
        return pod["charge"]  # type: ignore[no-any-return]

    _, used = compute_usage(q, pods, usage_of=charge)
    want = {k: Quantity.parse("0") for k in hard}
    for c in charges:
        for k in hard:
            if k in c:
                want[k] = want[k] + c[k]
    assert format_resource_list(used) == format_resource_list(want)


@pytest.mark.parametrize(
    ("resources", "containers", "requests", "limits"),
    [
        # only pod-level limits: the requests are those limits (TestPodResourcesDefaults, Kubernetes v1.35)
        ({"limits": {"cpu": "4", "memory": "4Gi"}}, [{}], {"cpu": "4", "memory": "4Gi"}, {"cpu": "4", "memory": "4Gi"}),
        # pod limits, containers' requests: cpu and memory default to the containers' aggregate
        (
            {"limits": {"cpu": "5m", "memory": "7Mi"}, "requests": {}},
            [{"requests": {"cpu": "2m", "memory": "1Mi"}}, {"requests": {"cpu": "1m", "memory": "5Mi"}}],
            {"cpu": "3m", "memory": "6Mi"},
            {"cpu": "5m", "memory": "7Mi"},
        ),
        # a hugepage limit of the containers becomes the pod's, and its request too
        (
            {"limits": {"cpu": "1"}},
            [{"limits": {"hugepages-2Mi": "4Mi"}}],
            {"cpu": "1", "hugepages-2Mi": "4Mi"},
            {"cpu": "1", "hugepages-2Mi": "4Mi"},
        ),
        # only pod-level requests: nothing is defaulted
        ({"requests": {"cpu": "1"}}, [{}], {"cpu": "1"}, None),
    ],
)
def test_pod_level_requests_default_as_the_api_server_defaults_them(
    resources: dict[str, Any], containers: list[dict[str, Any]], requests: dict[str, str], limits: Any
) -> None:
    """A pod with only pod-level limits was charged no ``requests.*`` in the simulated cluster, where the API server
    defaults its requests to those limits (``defaultPodRequests``): its native quota admitted what a real one
    refuses."""
    pod = {
        "metadata": {"name": "p", "namespace": "t"},
        "spec": {
            "resources": resources,
            "containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)],
        },
    }
    spec = default_pod(pod)["spec"]["resources"]
    assert spec.get("requests") == requests and spec.get("limits") == limits
    q = {
        "metadata": {"name": "q", "namespace": "t"},
        "spec": {"hard": {"requests.cpu": "10m"}},
        "status": {"hard": {"requests.cpu": "10m"}, "used": {"requests.cpu": "0"}},
    }
    if Quantity.parse(requests["cpu"]) > Quantity.parse("10m"):
        with pytest.raises(ApiError, match="exceeded quota"):
            admit_pod(pod, [q])


async def test_the_quota_controller_leaves_a_status_hard_written_by_another_until_spec_hard_changes(
    sim: SimCluster,
) -> None:
    """The quota controller's informer ignores updates that change only ``status`` ("all driven by this
    controller"): a ``status.hard`` another writer put there stays until ``spec.hard`` changes or the periodic
    resync. The simulated controller synced on any update whose ``status.hard`` differed from ``spec.hard``, and
    wrote the older ``spec.hard`` back at once."""
    await sim.create_quota("t", "compute", {"limits.memory": "8Gi"})
    await sim.wait_quota_synced("t", "compute")
    quotas = sim.store.resource("resourcequotas")
    status = {"status": {"hard": {"limits.memory": "12Gi"}}}
    await sim.store.patch(quotas, "t", "compute", status, "merge", subresource="status")
    await sim.wait_quiet()
    q = await sim.get("resourcequotas", "t", "compute")
    assert q["status"]["hard"] == {"limits.memory": "12Gi"} and q["spec"]["hard"] == {"limits.memory": "8Gi"}
    await sim.store.patch(quotas, "t", "compute", {"spec": {"hard": {"limits.memory": "10Gi"}}}, "merge")
    synced = await sim.wait_quota_synced("t", "compute")
    assert synced["status"]["hard"] == {"limits.memory": "10Gi"}
