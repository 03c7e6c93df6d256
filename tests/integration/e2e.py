"""Helpers of the end-to-end tests: the simulated cluster with the whole vmquota pipeline (watcher → NATS → ledger
→ enforcer → cluster) started by :class:`~services.devtools.demo.play.VmquotaStack`, a
tap on the bus (usage snapshots and
decisions), the simulator's ground truth, and waits on conditions with deadlines (never sleeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import aiohttp
import nats
import yaml
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.devtools.demo.play import VmquotaStack
from services.devtools.simcluster.auth import acting_as
from services.devtools.simcluster.cluster import SimCluster
from services.devtools.simcluster.kubevirt import KubeVirtTiming, phase
from services.devtools.simcluster.store_api import ApiError, Obj
from shared import contract
from shared.errors import InvalidInput
from shared.podusage import pod_quota_usage
from shared.quantity import ZERO, Quantity
from shared.quota.annotations import (
    BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    MANAGED_LABEL,
    MODE_ANNOTATION,
    RATIO_ANNOTATION,
    STATUS_ANNOTATION,
)
from shared.resources import ResourceList, add, format_resource_list, parse_resource_list
from shared.snapshot import MIGRATION_JOB_LABEL

CLUSTER: Final = "e2e"
GUARD_POLICY: Final = Path(__file__).resolve().parents[2] / "deploy/components/reservation-guard/policy.yaml"
SPEED: Final = 0.05
"""Simulator speed factor: every controller delay x 0.05 (a VM starts in ~10 ms, a migration in ~30 ms)."""
WITHIN: Final = 20.0
"""Deadline of every wait, in seconds: generous for a loaded 2-core machine; a healthy run takes far less."""


def rl(values: Mapping[str, str]) -> ResourceList:
    return parse_resource_list(dict(values), "test")


def on(rlist: Mapping[str, Any], keys: Any) -> ResourceList:
    """``rlist`` restricted to ``keys``, a missing resource as zero (ResourceLists compare by value)."""
    return {k: rlist.get(k, ZERO) for k in keys}


class BusTap:
    """A plain NATS subscriber to one cluster's usage snapshots and decisions, as any operator's client would be."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.usage: dict[str, contract.UsageSnapshot] = {}
        """The latest usage snapshot received per namespace."""
        self.decisions: list[contract.Decision] = []
        self.undecodable: list[str] = []
        self.changed = asyncio.Event()
        self._nc: Client | None = None

    async def connect(self, url: str) -> None:
        self._nc = await nats.connect(
            [u for u in url.split(",") if u],
            name="e2e-tap",
            reconnect_time_wait=0.1,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
        )
        await self._nc.subscribe(f"{contract.PREFIX}.usage.{self.cluster}.>", cb=self._on_usage)
        await self._nc.subscribe(f"{contract.PREFIX}.quota.{self.cluster}.>", cb=self._on_decision)
        await self._nc.flush()

    async def _on_usage(self, msg: Msg) -> None:
        try:
            snap = contract.decode_usage(msg.data)
        except InvalidInput as e:
            self.undecodable.append(f"{msg.subject}: {e}")
            return
        self.usage[snap.namespace] = snap
        self.changed.set()

    async def _on_decision(self, msg: Msg) -> None:
        try:
            self.decisions.append(contract.decode_decision(msg.data))
        except InvalidInput as e:
            self.undecodable.append(f"{msg.subject}: {e}")
        self.changed.set()

    def terms(self, namespace: str, quota: str) -> contract.QuotaTerms | None:
        snap = self.usage.get(namespace)
        return None if snap is None else snap.quotas.get(quota)

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()


@dataclass
class Pipeline:
    """A running simulated cluster, vmquota stack and bus tap; the test's handle on all three."""

    sim: SimCluster
    stack: VmquotaStack
    tap: BusTap
    quotas: dict[tuple[str, str], ResourceList] = field(default_factory=dict)
    """(namespace, quota) → the budget it was created with."""

    # ---- waiting ---------------------------------------------------------------------------------------------------
    async def wait(self, predicate: Callable[[], bool | Awaitable[bool]], what: str, *, within: float = WITHIN) -> None:
        """Until ``predicate()`` holds (checked on every bus message and every 20 ms); TimeoutError naming ``what``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            self.tap.changed.clear()
            result = predicate()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {within}s waiting for {what}")
            with contextlib.suppress(TimeoutError):  # woken by a bus message, else re-checked every 20 ms
                await asyncio.wait_for(self.tap.changed.wait(), timeout=min(remaining, 0.02))

    # ---- quotas ----------------------------------------------------------------------------------------------------
    async def managed_quota(
        self,
        namespace: str,
        name: str,
        hard: Mapping[str, str],
        *,
        mode: str = "VmiPodUsage",
        ratio: str | None = None,
        wait: bool = True,
    ) -> None:
        """Create the namespace (if needed) and a managed quota in ``mode`` (with its own CPU allocation ratio);
        ``wait``: until the enforcer enforces it."""
        if self.sim.peek("namespaces", None, namespace) is None:
            await self.sim.create_namespace(namespace)
        annotations = {MODE_ANNOTATION: mode} | ({RATIO_ANNOTATION: ratio} if ratio is not None else {})
        await self.sim.create_quota(namespace, name, hard, labels={MANAGED_LABEL: "true"}, annotations=annotations)
        self.quotas[(namespace, name)] = rl(hard)
        if wait:
            await self.wait_enforcing(namespace, name)

    async def wait_enforcing(self, namespace: str, name: str) -> None:
        def enforcing() -> bool:
            q = self.sim.peek("resourcequotas", namespace, name)
            ann = ((q or {}).get("metadata") or {}).get("annotations") or {}
            return str(ann.get(STATUS_ANNOTATION, "")).startswith("Enforcing") and BUDGET_ANNOTATION in ann

        await self.wait(enforcing, f"the enforcer to enforce quota {namespace}/{name}")

    def quota(self, namespace: str, name: str) -> Obj:
        q = self.sim.peek("resourcequotas", namespace, name)
        assert q is not None, f"quota {namespace}/{name} is gone"
        return q

    def hard(self, namespace: str, name: str) -> ResourceList:
        return parse_resource_list((self.quota(namespace, name).get("spec") or {}).get("hard"), "spec.hard")

    def admission_hard(self, namespace: str, name: str) -> ResourceList:
        """``status.hard``: what quota admission checks pods against (the quota controller copies ``spec.hard``
        there on its next sync)."""
        hard = (self.quota(namespace, name).get("status") or {}).get("hard") or {}
        return parse_resource_list(hard, "status.hard")

    def budget(self, namespace: str, name: str) -> ResourceList:
        ann = (self.quota(namespace, name).get("metadata") or {}).get("annotations") or {}
        return parse_resource_list(json.loads(ann[BUDGET_ANNOTATION]), BUDGET_ANNOTATION)

    def last_hard(self, namespace: str, name: str) -> ResourceList:
        ann = (self.quota(namespace, name).get("metadata") or {}).get("annotations") or {}
        return parse_resource_list(json.loads(ann[LAST_HARD_ANNOTATION]), LAST_HARD_ANNOTATION)

    def in_effect(self, namespace: str, name: str) -> bool:
        """The quota controller has copied ``spec.hard`` to ``status.hard``: native admission checks against
        ``status.hard``, so a lowered ``spec.hard`` takes effect only then."""
        q = self.quota(namespace, name)
        status_hard = parse_resource_list((q.get("status") or {}).get("hard"), "status.hard")
        return status_hard == self.hard(namespace, name)

    async def wait_hard(
        self, namespace: str, name: str, want: Mapping[str, Any], what: str = "", *, within: float = WITHIN
    ) -> None:
        """Until ``spec.hard`` equals ``want`` (by value, resource by resource) and is in effect; the error shows
        both."""
        try:
            await self.wait(
                lambda: self.hard(namespace, name) == dict(want) and self.in_effect(namespace, name),
                what or f"spec.hard of {name}",
                within=within,
            )
        except TimeoutError as e:
            got = format_resource_list(self.hard(namespace, name))
            raise AssertionError(f"{e}: spec.hard is {got}, expected {format_resource_list(dict(want))}") from None

    async def set_budget(self, namespace: str, name: str, budget: Mapping[str, str]) -> None:
        """What an administrator does to change the budget: edit the budget annotation."""

        def change(obj: Obj) -> Obj:
            meta = obj.setdefault("metadata", {})
            meta.setdefault("annotations", {})[BUDGET_ANNOTATION] = json.dumps(dict(budget))
            return obj

        await self.sim.store.mutate(self.sim.store.resource("resourcequotas"), namespace, name, change)

    # ---- VMs and migrations -----------------------------------------------------------------------------------------
    async def start_vm(self, namespace: str, name: str, **kwargs: Any) -> None:
        await self.sim.create_vm(namespace, name, **kwargs)
        await self.sim.wait_for_phase(namespace, name, "Running", within=WITHIN)

    def vmi_phase(self, namespace: str, name: str) -> str:
        vmi = self.sim.peek("vmi", namespace, name)
        return "" if vmi is None else phase(vmi)

    def migration(self, namespace: str, name: str) -> Obj:
        m = self.sim.peek("vmim", namespace, name)
        assert m is not None, f"migration {namespace}/{name} is gone"
        return m

    async def migrate(self, namespace: str, vmi: str) -> str:
        """Create a migration of ``vmi``; its name."""
        created = await self.sim.migrate(namespace, vmi)
        return str(created["metadata"]["name"])

    def objects(self, kind: str, namespace: str) -> list[Obj]:
        """The objects of ``kind`` in ``namespace`` now (synchronous: safe inside a wait predicate)."""
        raws, _, _, _ = self.sim.store.list_raw(self.sim.store.resource(kind), namespace)
        return [json.loads(r) for r in raws]

    def pods(self, namespace: str) -> list[Obj]:
        return self.objects("pods", namespace)

    def target_pods(self, namespace: str, migration: str) -> list[Obj]:
        uid = self.migration(namespace, migration)["metadata"]["uid"]
        return [p for p in self.pods(namespace) if (p["metadata"].get("labels") or {}).get(MIGRATION_JOB_LABEL) == uid]

    def launcher_pods(self, namespace: str, vmi: str) -> list[Obj]:
        return [
            p
            for p in self.pods(namespace)
            if (p["metadata"].get("labels") or {}).get("kubevirt.io") == "virt-launcher"
            and (p["metadata"].get("labels") or {}).get("vm.kubevirt.io/name") == vmi
        ]

    def _refusal_events(self, namespace: str, involved: str) -> list[Obj]:
        return [
            e
            for e in self.objects("events", namespace)
            if e.get("reason") == "FailedCreate"
            and (e.get("involvedObject") or {}).get("name") == involved
            and "exceeded quota" in str(e.get("message"))
        ]

    def quota_refusals(self, namespace: str, involved: str) -> list[str]:
        """Messages of the FailedCreate events that report a quota refusal for ``involved`` (a VMI)."""
        return [str(e.get("message")) for e in self._refusal_events(namespace, involved)]

    def quota_refusal_count(self, namespace: str, involved: str) -> int:
        """How many times KubeVirt was refused a pod for ``involved`` (a VMI): the events' counts (similar events
        are aggregated into one)."""
        return sum(int(e.get("count") or 1) for e in self._refusal_events(namespace, involved))

    def quota_events(self, namespace: str, quota: str, reason: str) -> list[Obj]:
        return [
            e
            for e in self.objects("events", namespace)
            if (e.get("involvedObject") or {}).get("kind") == "ResourceQuota"
            and (e.get("involvedObject") or {}).get("name") == quota
            and e.get("reason") == reason
        ]

    async def wait_migration(self, namespace: str, name: str, want: str = "Succeeded") -> None:
        await self.wait(lambda: phase(self.migration(namespace, name)) == want, f"migration {name} {want}")

    async def wait_migrated(self, namespace: str, vmi: str, migration: str) -> None:
        """Until the migration Succeeded, the VMI runs and its source launcher pod is gone (one pod left)."""
        await self.wait_migration(namespace, migration)
        await self.wait(
            lambda: len(self.launcher_pods(namespace, vmi)) == 1 and self.vmi_phase(namespace, vmi) == "Running",
            f"the source pod of {vmi} to go",
        )

    # ---- ground truth ------------------------------------------------------------------------------------------
    def pod_usage(self, namespace: str) -> ResourceList:
        """What the native quota evaluator charges the namespace's pods, computed from the simulator's store."""
        total: ResourceList = {}
        for pod in self.pods(namespace):
            total = add(total, pod_quota_usage(pod))
        return total

    def running_vmis(self, namespace: str) -> set[str]:
        return {str(v["metadata"]["name"]) for v in self.objects("vmi", namespace) if phase(v) == "Running"}


def forged_refusal(vmi: Obj, name: str, message: str, **extra: Any) -> Obj:
    """A tenant's ``FailedCreate`` Event on its own VMI (create it with ``sim.create``): Events are the tenant's to
    write, so it reads like KubeVirt's refusal but vouches for nothing."""
    meta = vmi["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "reason": "FailedCreate",
        "type": "Warning",
        "message": message,
        "count": 1,
        **extra,
    }


INJECT: Final = "sidecar.istio.io/inject"


def install_sidecar_injector(p: Pipeline, memory: str, *, sized_by: str = "") -> None:
    """A mutating webhook as a service mesh's: it adds a proxy container to each pod labelled :data:`INJECT` (KubeVirt
    copies the VMI's labels and annotations to its launcher pods, a target's too); its memory limit ``memory``, or
    the value of the pod's label ``sized_by`` where it has one (a per-workload size, the tenant's to write)."""
    pods = p.sim.store.resource("pods")

    async def inject(op: str, res: Any, new: Obj | None, old: Obj | None, sub: str | None = None) -> Obj | None:
        labels = ((new or {}).get("metadata") or {}).get("labels") or {}
        if op != "CREATE" or new is None or labels.get(INJECT) != "true":
            return None
        limit = labels.get(sized_by, memory) if sized_by else memory
        proxy = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "2", "memory": limit}}
        new["spec"]["containers"].append({"name": "istio-proxy", "image": "proxyv2", "resources": proxy})
        return new

    p.sim.store.add_admission(pods, inject, first=True, mutating=True)


def plain_pod(ns: str, name: str, requests: dict[str, str], limits: dict[str, str]) -> Obj:
    """A pod that is not a VM's (create it with ``sim.create``)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            "containers": [{"name": "app", "image": "app:1", "resources": {"requests": requests, "limits": limits}}]
        },
    }


class Tenant:
    """The tenant's own API client: its bearer token (``edit`` in its namespace ``ns``), over the simulator's
    HTTPS."""

    def __init__(self, p: Pipeline, ns: str) -> None:
        self.ns = ns
        self.url = p.sim.url
        self.token = p.sim.add_tenant("mallory", [ns])
        self.user = p.sim.users.authenticate(f"Bearer {self.token}")
        self.sim = p.sim
        self.ssl = p.sim.client_ssl() or True
        self.session: aiohttp.ClientSession | None = None
        self.refusals: list[str] = []

    async def __aenter__(self) -> Tenant:
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"})
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def create_in_process(self, pod: Obj) -> bool:
        """The same create, as this tenant, without the HTTP round trip: a tenant whose watch and create are as
        fast as KubeVirt's own (the simulator's controllers run in-process, so over HTTP the tenant always
        loses the race it can win on a real cluster)."""
        with acting_as(self.user):
            try:
                await self.sim.create(pod)
            except ApiError as e:
                assert e.code in (403, 422), e.message
                self.refusals.append(e.message)
                return False
        return True

    async def create(self, pod: Obj) -> bool:
        """True when the API server admitted the pod; a refusal's message is kept."""
        assert self.session is not None
        url = f"{self.url}/api/v1/namespaces/{self.ns}/pods"
        async with self.session.post(url, json=pod, ssl=self.ssl) as resp:
            body = await resp.json()
            if resp.status == 201:
                return True
            assert resp.status in (403, 422), body
            self.refusals.append(str(body.get("message", "")))
            return False


async def grab_reserved_room(p: Pipeline, tenant: Tenant, budget: Quantity) -> tuple[bool, str]:
    """The tenant keeps trying, as fast as the API server answers, to create a pod that takes all the room its
    quota ``compute`` shows once ``status.hard`` (what quota admission checks) rises above the ``limits.memory``
    budget — room raised for the target pod of a migration of ``vm1`` (refused once by native quota, so vmquota
    reserves it). Returns (whether the tenant's pod got in, the migration)."""
    ns = tenant.ns
    m = await p.migrate(ns, "vm1")
    tries = 0
    while phase(p.migration(ns, m)) != "Succeeded":
        quota = p.sim.cache.get("resourcequotas", ns, "compute") or {}
        status = quota.get("status") or {}
        hard = rl(status.get("hard") or {}).get("limits.memory")
        used = rl(status.get("used") or {}).get("limits.memory")
        if hard is not None and used is not None and hard > budget and hard > used:
            tries += 1
            grab = plain_pod(ns, f"grab-{tries}", {"memory": "1Gi", "cpu": "100m"}, {"memory": str(hard - used)})
            if await tenant.create_in_process(grab):
                return True, m
        await asyncio.sleep(0)  # one try per turn of the event loop: as often as the simulator can answer
    assert tries, "status.hard never rose above the budget for the migration's target"
    return False, m


async def give_back_grabbed_room(p: Pipeline, ns: str) -> None:
    """Delete the pods :func:`grab_reserved_room` got in: while they run the namespace is over its budget and the
    migration whose room they took waits."""
    for pod in await p.sim.list_objects("pods", ns):
        if pod["metadata"]["name"].startswith("grab-"):
            await p.sim.store.delete(p.sim.store.resource("pods"), ns, pod["metadata"]["name"])


async def install_guard(sim: SimCluster) -> None:
    """The reservation guard's policy and binding, as ``deploy/components/reservation-guard`` ships them."""
    for doc in yaml.safe_load_all(GUARD_POLICY.read_text()):
        await sim.create(doc)


async def full_namespace(p: Pipeline, ns: str) -> None:
    """Seed scenario 1's namespace: limits.memory 64Gi (VmiPodUsage), three VMs with 16Gi guest memory and explicit
    16Gi memory limits, running; no target pod fits natively."""
    await p.managed_quota(ns, "compute", {"limits.memory": "64Gi"})
    await asyncio.gather(*(p.start_vm(ns, f"vm{i}", memory="16Gi", limits={"memory": "16Gi"}) for i in (1, 2, 3)))
    await p.wait_hard(ns, "compute", rl({"limits.memory": "64Gi"}))


SLOW_MIGRATIONS: Final = KubeVirtTiming(speed=SPEED, migration_step=5.0)
"""Migration phases of 0.25 s: long enough for a test to act while the target pod runs next to the source."""
PATIENT_KUBEVIRT: Final = replace(SLOW_MIGRATIONS, backoff_base=2.0)
"""KubeVirt retries a refused target pod after 0.1 s, then 0.2 s, ... (its backoff a few refusals in): the room
vmquota raises for the target stays open that long before the target pod exists."""


@asynccontextmanager
async def pipeline(
    *,
    separate: bool = False,
    speed: float = SPEED,
    cpu_allocation_ratio: float = 10,
    kubevirt_configuration: Mapping[str, Any] | None = None,
    kubevirt_timing: KubeVirtTiming | None = None,
    seed: int = 7,
    guard: bool = False,
    nats: Any = None,
    extra_args: Sequence[str] = (),
) -> AsyncIterator[Pipeline]:
    """A simulated cluster with vmquota running against it (``separate``: one runner per service) and a bus tap;
    ``guard``: with the reservation guard (the shipped policy in the cluster, the enforcer writing its parameter);
    ``kubevirt_configuration``: more of the KubeVirt CR's ``spec.configuration``."""
    sim = SimCluster(
        speed=speed,
        kubevirt_configuration=kubevirt_configuration,
        developer_configuration={"cpuAllocationRatio": cpu_allocation_ratio},
        kubevirt_timing=kubevirt_timing,
        seed=seed,
    )
    await sim.start()
    if guard:
        await install_guard(sim)
    args = [*extra_args, *(["--reservation-guard"] if guard else [])]
    stack = VmquotaStack(sim, CLUSTER, separate=separate, extra_args=args, nats=nats)
    tap = BusTap(CLUSTER)
    try:
        await stack.start()
        await tap.connect(stack.nats.url)
        p = Pipeline(sim, stack, tap)
        yield p
        assert not tap.undecodable, f"messages on the bus that do not decode: {tap.undecodable}"
    finally:
        await tap.close()
        await stack.stop()
        await sim.stop()
