"""A whole simulated KubeVirt cluster: store, Kubernetes quota, KubeVirt controllers and the HTTP API server.

``SimCluster`` is what the demo, the tests and the benchmarks start::

    async with SimCluster(speed=0.05) as sim:
        await sim.create_namespace("tenant-a")
        await sim.create_quota("tenant-a", "compute", {"limits.memory": "64Gi"})
        await sim.create_vm("tenant-a", "vm1", memory="16Gi", limits={"memory": "16Gi"})
        await sim.wait_for_phase("tenant-a", "vm1", "Running")
        # point vmquota (or kubectl) at sim.kubeconfig_path

All controller delays are multiplied by ``speed``; :meth:`SimCluster.wait_quiet` waits until no controller has
work pending (a migration retried with backoff because of quota does not count: it waits for a quota change).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, cast

from services.devtools.simcluster.auth import KUBEVIRT_CONTROLLER, Users, acting_as
from services.devtools.simcluster.cache import Cache
from services.devtools.simcluster.faults import Faults
from services.devtools.simcluster.kubeconfig import write_kubeconfig
from services.devtools.simcluster.kubevirt import (
    FAIL_START_ANNOTATION,
    KubeVirtSimConfig,
    KubeVirtSimulator,
    KubeVirtTiming,
    attachment_pod,
    phase,
)
from services.devtools.simcluster.policy import PolicySystem
from services.devtools.simcluster.quota import QuotaTiming, ResourceQuotaSystem
from services.devtools.simcluster.server import RunningServer, start_server
from services.devtools.simcluster.store import Store
from services.devtools.simcluster.store_api import ApiError, Obj
from services.platform.inputs import load_documents
from services.platform.logs import get_logger
from shared.errors import InvalidInput
from shared.kubevirt.vm import API_VERSION
from shared.quantity import Quantity
from shared.resources import parse_resource_list

KUBEVIRT_NAMESPACE: Final = "kubevirt"
KUBEVIRT_NAME: Final = "kubevirt"
DEFAULT_KUBEVIRT_VERSION: Final = "v1.9.0"
CACHED: Final = (
    "namespaces",
    "pods",
    "resourcequotas",
    "virtualmachines",
    "virtualmachineinstances",
    "virtualmachineinstancemigrations",
    "kubevirts",
)
# Seed objects go in this order so that what others depend on exists first.
_SEED_ORDER: Final = {"Namespace": 0, "KubeVirt": 1, "ResourceQuota": 2, "LimitRange": 3}


class SimCluster:
    """Store + quota admission/controller + KubeVirt behaviour + HTTP server, started and stopped together."""

    def __init__(
        self,
        *,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        kubeconfig_path: str | Path | None = None,
        serve_http: bool = True,
        tls: bool = True,
        kubevirt_version: str = DEFAULT_KUBEVIRT_VERSION,
        developer_configuration: Mapping[str, Any] | None = None,
        kubevirt_configuration: Mapping[str, Any] | None = None,
        nodes: Iterable[str] | None = None,
        extra_memory_overhead: str | Quantity | None = None,
        quota_timing: QuotaTiming | None = None,
        kubevirt_timing: KubeVirtTiming | None = None,
        parallel_migrations: int = 5,
        store: Store | None = None,
        seed: int | None = None,
    ) -> None:
        self.speed = speed
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)
        self.serve_http = serve_http
        self.tls = tls
        self.kubevirt_version = kubevirt_version
        self.store = store or Store(seed=seed)
        self.faults = Faults(self.store, seed=seed)
        self.cache = Cache(self.store, CACHED)
        extra = (
            Quantity.parse(extra_memory_overhead) if isinstance(extra_memory_overhead, str) else extra_memory_overhead
        )
        sim_config = KubeVirtSimConfig(
            nodes=tuple(nodes) if nodes is not None else KubeVirtSimConfig().nodes,
            parallel_migrations=parallel_migrations,
            extra_memory_overhead=extra,
        )
        self.quota = ResourceQuotaSystem(self.store, self.cache, quota_timing or QuotaTiming(speed=speed))
        self.kubevirt = KubeVirtSimulator(
            self.store, self.cache, kubevirt_timing or KubeVirtTiming(speed=speed), sim_config
        )
        self._kv_conf = dict(kubevirt_configuration or {})
        if developer_configuration:
            self._kv_conf["developerConfiguration"] = dict(developer_configuration)
        self._kubeconfig_arg = Path(kubeconfig_path) if kubeconfig_path is not None else None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.kubeconfig_path: Path | None = None
        self.url = ""
        self._server: RunningServer | None = None
        self._started = False
        self._waiters: set[asyncio.Event] = set()
        self._log = get_logger(component="simcluster")
        self.users = Users(self.token)
        self.policies = PolicySystem(self.store)
        self.store.on_change(self._poke)
        self.quota.install()
        self.policies.install()  # in front of every other admission, as kube-apiserver runs it before quota
        self.kubevirt.install()

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> SimCluster:
        if self._started:
            return self
        self._started = True
        await self.cache.start()
        await self._ensure_kubevirt_cr()
        await self.quota.start()
        await self.kubevirt.start()
        if self.serve_http:
            await self._start_http()
        self._log.info("simulated cluster started", url=self.url or None, speed=self.speed)
        return self

    async def _start_http(self) -> None:
        self._server = await start_server(
            self.store,
            host=self.host,
            port=self.port,
            token=self.token,
            faults=self.faults,
            tls=self.tls,
            users=self.users,
        )
        self.url = self._server.url
        if self._kubeconfig_arg is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="simcluster-")
            path = Path(self._tmpdir.name) / "kubeconfig"
        else:
            path = self._kubeconfig_arg
        self.kubeconfig_path = self._server.write_kubeconfig(path)

    def add_tenant(self, name: str, namespaces: Iterable[str]) -> str:
        """A tenant user who may edit ``namespaces`` (``simcluster.auth``); returns its bearer token."""
        return self.users.add_tenant(name, namespaces)

    def write_kubeconfig(self, path: str | Path, token: str, *, namespace: str | None = None) -> Path:
        """A kubeconfig for ``token`` (e.g. a tenant's) against this cluster's server."""
        if self._server is None:
            raise RuntimeError("the simulated cluster serves no HTTP")
        return write_kubeconfig(path, self.url, token, ca_pem=self._server.ca_pem, namespace=namespace)

    @property
    def ca_pem(self) -> bytes | None:
        """The certificate clients must trust (HTTPS), None for plain HTTP or when not serving."""
        return self._server.ca_pem if self._server is not None else None

    def client_ssl(self) -> ssl.SSLContext | None:
        """An SSL context trusting the server, for aiohttp clients."""
        return self._server.client_ssl() if self._server is not None else None

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._server is not None:
            await self._server.close()
            self._server = None
        await self.kubevirt.stop()
        await self.quota.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    async def __aenter__(self) -> SimCluster:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ---- quiet -------------------------------------------------------------------------------------------------
    def idle(self) -> bool:
        """No controller has work ready, running or scheduled (backoff retries excluded)."""
        return self.quota.idle() and self.kubevirt.idle()

    async def wait_quiet(self, within: float = 10.0) -> None:
        """Wait until :meth:`idle` holds on two checks in a row; TimeoutError after ``within`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        streak = 0
        while True:
            streak = streak + 1 if self.idle() else 0
            if streak >= 2:
                return
            if loop.time() > deadline:
                busy = [q.name for q in (*self.quota.queues, *self.kubevirt.queues) if not q.idle()]
                raise TimeoutError(f"simulated cluster not quiet after {within}s (busy: {', '.join(busy)})")
            await asyncio.sleep(0.002 if streak else 0.005)

    async def wait_for(
        self, predicate: Callable[[], bool | Awaitable[bool]], *, within: float = 10.0, what: str = "condition"
    ) -> None:
        """Wait until ``predicate()`` is true (re-checked after every store write); TimeoutError naming ``what``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        changed = asyncio.Event()
        self._waiters.add(changed)
        try:
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"timed out after {within}s waiting for {what}")
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=min(remaining, 0.05))
        finally:
            self._waiters.discard(changed)

    def _poke(self, *_: Any) -> None:
        for ev in self._waiters:
            ev.set()

    async def wait_until(
        self,
        kind: str,
        namespace: str,
        name: str,
        predicate: Callable[[Obj], bool],
        *,
        within: float = 10.0,
        what: str = "",
    ) -> Obj:
        """Wait until the object exists and ``predicate(obj)`` holds; return it."""
        found: list[Obj] = []

        def check() -> bool:
            obj = self.store.peek(self.store.resource(kind), namespace, name)
            if obj is not None and predicate(obj):
                found.append(obj)
                return True
            return False

        await self.wait_for(check, within=within, what=what or f"{kind} {namespace}/{name}")
        return found[-1]

    async def wait_for_phase(
        self, namespace: str, name: str, want: str, *, kind: str = "vmi", within: float = 10.0
    ) -> Obj:
        return await self.wait_until(
            kind, namespace, name, lambda o: phase(o) == want, within=within, what=f"{kind} {namespace}/{name} {want}"
        )

    # ---- reading -----------------------------------------------------------------------------------------------
    async def get(self, kind: str, namespace: str | None, name: str) -> Obj:
        return await self.store.get(self.store.resource(kind), namespace, name)

    def peek(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        return self.store.peek(self.store.resource(kind), namespace, name)

    async def list_objects(
        self, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[Obj]:
        items, _ = await self.store.list(self.store.resource(kind), namespace, label_selector=label_selector)
        return items

    async def launcher_pods(self, namespace: str, vmi: str) -> list[Obj]:
        """The launcher pods of a VMI (source and target during a migration), oldest first."""
        pods = await self.list_objects(
            "pods", namespace, label_selector=f"kubevirt.io=virt-launcher,vm.kubevirt.io/name={vmi}"
        )
        return sorted(pods, key=lambda p: int(p["metadata"]["resourceVersion"]))

    async def events(self, namespace: str, name: str, *, reason: str | None = None) -> list[Obj]:
        """Events whose involvedObject has this name (and reason), oldest first."""
        items = await self.list_objects("events", namespace)
        out = [
            e
            for e in items
            if (e.get("involvedObject") or {}).get("name") == name and (reason is None or e.get("reason") == reason)
        ]
        return sorted(out, key=lambda e: int(e["metadata"]["resourceVersion"]))

    # ---- writing -----------------------------------------------------------------------------------------------
    async def create(self, obj: Obj) -> Obj:
        kind = str(obj.get("kind") or "")
        res = self.store.resource(kind)
        return await self.store.create(res, obj)

    async def apply(self, obj: Obj) -> Obj:
        """Create, or replace the spec/metadata of an existing object (status is the controllers')."""
        res = self.store.resource(str(obj.get("kind") or ""))
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k, ""), str) for k in ("name", "namespace")):
            return await self.store.create(res, obj)  # (which refuses it as the API server does, naming the field)
        ns = meta.get("namespace") if res.namespaced else None
        name = str(meta.get("name") or "")
        if name and self.store.peek(res, ns, name) is not None:

            def replace(current: Obj) -> Obj:
                new = {**current, **{k: v for k, v in obj.items() if k not in ("metadata", "status")}}
                new_meta = dict(current.get("metadata") or {})
                for key in ("labels", "annotations"):
                    if key in meta:
                        new_meta[key] = meta[key]
                new["metadata"] = new_meta
                return new

            return await self.store.mutate(res, ns, name, replace)
        return await self.store.create(res, obj)

    async def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> Obj:
        return await self.create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}}
        )

    async def create_quota(
        self,
        namespace: str,
        name: str,
        hard: Mapping[str, str],
        *,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        scopes: list[str] | None = None,
    ) -> Obj:
        spec: Obj = {"hard": dict(hard)}
        if scopes:
            spec["scopes"] = list(scopes)
        return await self.create(
            {
                "apiVersion": "v1",
                "kind": "ResourceQuota",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": dict(labels or {}),
                    "annotations": dict(annotations or {}),
                },
                "spec": spec,
            }
        )

    async def set_quota_hard(self, namespace: str, name: str, hard: Mapping[str, str]) -> Obj:
        def change(obj: Obj) -> Obj:
            obj.setdefault("spec", {})["hard"] = dict(hard)
            return obj

        return await self.store.mutate(self.store.resource("resourcequotas"), namespace, name, change)

    async def wait_quota_synced(self, namespace: str, name: str, *, within: float = 10.0) -> Obj:
        """Until the quota controller has copied ``spec.hard`` to ``status.hard`` and computed ``status.used``."""

        def synced(q: Obj) -> bool:
            st = q.get("status") or {}
            hard = parse_resource_list((q.get("spec") or {}).get("hard"))
            status_hard = parse_resource_list(st.get("hard"))
            return status_hard == hard and set(st.get("used") or {}) == set(hard)

        return await self.wait_until("resourcequotas", namespace, name, synced, within=within)

    async def create_vm(
        self,
        namespace: str,
        name: str,
        *,
        memory: str | None = "1Gi",
        sockets: int | None = None,
        cores: int | None = None,
        threads: int | None = None,
        requests: Mapping[str, str] | None = None,
        limits: Mapping[str, str] | None = None,
        running: bool | None = True,
        run_strategy: str | None = None,
        labels: Mapping[str, str] | None = None,
        domain: Mapping[str, Any] | None = None,
    ) -> Obj:
        """A VM with guest memory ``memory``, a CPU topology and explicit resources as given."""
        dom: Obj = dict(domain or {})
        cpu: Obj = {}
        for key, value in (("sockets", sockets), ("cores", cores), ("threads", threads)):
            if value is not None:
                cpu[key] = value
        if cpu:
            dom["cpu"] = {**dom.get("cpu", {}), **cpu}
        if memory is not None:
            dom["memory"] = {**dom.get("memory", {}), "guest": memory}
        res: Obj = {}
        if requests:
            res["requests"] = dict(requests)
        if limits:
            res["limits"] = dict(limits)
        if res:
            dom["resources"] = res
        dom.setdefault("devices", {})
        spec: Obj = {
            "template": {"metadata": {"labels": {"kubevirt.io/vm": name, **(labels or {})}}, "spec": {"domain": dom}}
        }
        if run_strategy is not None:
            spec["runStrategy"] = run_strategy
        elif running is not None:
            spec["running"] = running
        return await self.create(
            {
                "apiVersion": API_VERSION,
                "kind": "VirtualMachine",
                "metadata": {"name": name, "namespace": namespace},
                "spec": spec,
            }
        )

    async def set_running(self, namespace: str, name: str, running: bool) -> Obj:
        def change(vm: Obj) -> Obj:
            spec = vm.setdefault("spec", {})
            spec.pop("runStrategy", None)
            spec["running"] = running
            return vm

        return await self.store.mutate(self.store.resource("virtualmachines"), namespace, name, change)

    async def hotplug(self, namespace: str, name: str, *, sockets: int | None = None, memory: str | None = None) -> Obj:
        """Raise the VM template's sockets and/or guest memory (KubeVirt hotplugs them into the running VMI)."""

        def change(vm: Obj) -> Obj:
            domain = (
                vm.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {}).setdefault("domain", {})
            )
            if sockets is not None:
                domain.setdefault("cpu", {})["sockets"] = sockets
            if memory is not None:
                domain.setdefault("memory", {})["guest"] = memory
            return vm

        return await self.store.mutate(self.store.resource("virtualmachines"), namespace, name, change)

    async def attach_volume(self, namespace: str, vmi: str, volume: str = "data") -> Obj:
        """What KubeVirt does when a volume is hotplugged to a running VMI: an attachment pod beside its launcher pod
        (``shared.kubevirt.render.attachment_resources``) and the volume's status with ``hotplugVolume``; the VMI's
        migrations then wait for an attachment pod beside their target. Returns the attachment pod."""
        vmi_obj = await self.get("vmi", namespace, vmi)
        launcher = self.kubevirt.launcher_of(vmi_obj)
        if launcher is None:
            raise ValueError(f"VMI {namespace}/{vmi} runs in no launcher pod")
        config = self.kubevirt.kubevirt_config()
        with acting_as(KUBEVIRT_CONTROLLER):
            pod = await self.create(attachment_pod(launcher, config, image=self.kubevirt.image(config)))

        def hotplugged(obj: Obj) -> Obj:
            statuses = obj.setdefault("status", {}).setdefault("volumeStatus", [])
            statuses.append(
                {
                    "name": volume,
                    "target": "sda",
                    "phase": "Ready",
                    "hotplugVolume": {"attachPodName": pod["metadata"]["name"], "attachPodUID": pod["metadata"]["uid"]},
                }
            )
            return obj

        with acting_as(KUBEVIRT_CONTROLLER):
            await self.store.mutate(
                self.store.resource("virtualmachineinstances"), namespace, vmi, hotplugged, status=True
            )
        return pod

    async def add_interface(self, namespace: str, name: str, interface: str, *, sriov: bool = False) -> Obj:
        """Add a bridge (or SR-IOV) interface on a Multus network of the same name to the VM's template (KubeVirt
        hotplugs it into the running VMI); the pod-network ``default`` interface is made explicit first."""

        def change(vm: Obj) -> Obj:
            spec = vm.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
            interfaces = spec.setdefault("domain", {}).setdefault("devices", {}).setdefault("interfaces", [])
            networks = spec.setdefault("networks", [])
            if not interfaces:
                interfaces.append({"name": "default", "masquerade": {}})
                networks.append({"name": "default", "pod": {}})
            interfaces.append({"name": interface, "sriov" if sriov else "bridge": {}})
            networks.append({"name": interface, "multus": {"networkName": interface}})
            return vm

        return await self.store.mutate(self.store.resource("virtualmachines"), namespace, name, change)

    async def migrate(
        self,
        namespace: str,
        vmi: str,
        *,
        name: str | None = None,
        target_fails: bool = False,
        annotations: Mapping[str, str] | None = None,
    ) -> Obj:
        """Create a VirtualMachineInstanceMigration for ``vmi``; ``target_fails`` makes its target pod fail."""
        ann = dict(annotations or {})
        if target_fails:
            ann[FAIL_START_ANNOTATION] = "true"
        meta: Obj = {"namespace": namespace, "annotations": ann}
        if name:
            meta["name"] = name
        else:
            meta["generateName"] = f"{vmi}-migration-"
        return await self.create(
            {
                "apiVersion": API_VERSION,
                "kind": "VirtualMachineInstanceMigration",
                "metadata": meta,
                "spec": {"vmiName": vmi},
            }
        )

    async def set_kubevirt_configuration(self, developer_configuration: Mapping[str, Any]) -> Obj:
        """Merge into the KubeVirt CR's ``spec.configuration.developerConfiguration``."""

        def change(cr: Obj) -> Obj:
            conf = cr.setdefault("spec", {}).setdefault("configuration", {})
            conf["developerConfiguration"] = {**conf.get("developerConfiguration", {}), **developer_configuration}
            return cr

        return await self.store.mutate(self.store.resource("kubevirts"), KUBEVIRT_NAMESPACE, KUBEVIRT_NAME, change)

    async def _ensure_kubevirt_cr(self) -> None:
        ns_res, kv_res = self.store.resource("namespaces"), self.store.resource("kubevirts")
        if self.store.peek(ns_res, None, KUBEVIRT_NAMESPACE) is None:
            await self.create_namespace(KUBEVIRT_NAMESPACE)
        if self.store.peek(kv_res, KUBEVIRT_NAMESPACE, KUBEVIRT_NAME) is None:
            cr: Obj = {
                "apiVersion": API_VERSION,
                "kind": "KubeVirt",
                "metadata": {"name": KUBEVIRT_NAME, "namespace": KUBEVIRT_NAMESPACE},
                "spec": {"configuration": self._kv_conf},
                "status": {
                    "phase": "Deployed",
                    "observedKubeVirtVersion": self.kubevirt_version,
                    "targetKubeVirtVersion": self.kubevirt_version,
                },
            }
            await self.store.create(kv_res, cr, keep_status=True)

    # ---- seeding -----------------------------------------------------------------------------------------------
    async def seed(self, documents: Iterable[Obj]) -> list[Obj]:
        """Create (or update) objects, namespaces and the KubeVirt CR first; ``List`` kinds are flattened."""
        flat: list[Obj] = []
        for doc in documents:
            if not doc:
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
                raise InvalidInput("expected a Kubernetes object with a kind", "seed")
            if doc["kind"].endswith("List") and isinstance(doc.get("items"), list):
                for item in doc["items"]:
                    if not isinstance(item, dict):
                        raise InvalidInput(f"an item of a {doc['kind']} is not an object", "seed")
                    flat.append(item)
            else:
                flat.append(doc)
        flat.sort(key=lambda o: _SEED_ORDER.get(str(o.get("kind")), 10))
        out = []
        for i, obj in enumerate(flat):
            try:
                out.append(await self.apply(obj))
            except KeyError:
                raise InvalidInput(
                    f"the simulated cluster does not serve kind {obj.get('kind')!r}", f"seed[{i}].kind"
                ) from None
            except ApiError as e:
                raise InvalidInput(e.message, _seed_where(i, obj)) from None
        return out


def _seed_where(i: int, obj: Obj) -> str:
    """Where in the seed (namespaces first) an object is: ``seed[3] Pod web``, its kind and name where they are
    text."""
    meta = obj.get("metadata")
    named = [obj.get("kind"), meta.get("name") if isinstance(meta, dict) else None]
    return " ".join([f"seed[{i}]", *(str(n) for n in named if isinstance(n, str) and n)])


def load_seed_file(path: str | Path) -> list[Obj]:
    """The YAML (or JSON) documents of a seed file; InvalidInput naming the file when it cannot be read."""
    name, docs = load_documents(path)
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise InvalidInput(f"document {i} is not an object", name)
    return cast(list[Obj], docs)
