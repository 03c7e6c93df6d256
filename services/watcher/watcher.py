"""The watcher of one cluster: a list→watch loop per resource, publishing compact snapshots on the bus.

Per resource, a ``services.watcher.listwatch.ListWatch`` (list, watch, relist on 410 Gone, sync markers; the
kinds that do more in ``services.watcher.kinds``). Namespaces and quotas are listed first.

Pods: launcher pods (``kubevirt.io: virt-launcher``) are published in every namespace, other pods only in
namespaces with a managed ResourceQuota. The pod watch is cluster-wide and filters on the watcher's side, so one
list describes every namespace consistently. When a namespace becomes managed, its pods are listed and published
(then a sync marker for it); when it stops being managed, its other pods are forgotten (no events are sent: the
ledger keeps their last state until the namespace is managed again and a new marker settles it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from kubernetes_asyncio.client import ApiClient
from nats.aio.msg import Msg

from services.platform.publisher import Publisher
from services.watcher.emitter import Emitter
from services.watcher.kinds import LOOPS, PodListWatch
from services.watcher.kube import ResourceSpec, Timeouts
from services.watcher.listwatch import ListWatch
from services.watcher.loop import ManagedNamespaces
from services.watcher.metrics import WatcherMetrics
from shared import contract
from shared.backoff import Backoff
from shared.errors import InvalidInput
from shared.kinds import (
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)

FAILED_CREATE_SELECTOR: Final = "involvedObject.kind=VirtualMachineInstance,reason=FailedCreate"

RESOURCES: Final[tuple[ResourceSpec, ...]] = (
    ResourceSpec(NAMESPACE_KIND, "namespaces"),
    ResourceSpec(QUOTA_KIND, "resourcequotas"),
    ResourceSpec(KUBEVIRT_KIND, "kubevirts", "kubevirt.io"),
    ResourceSpec(VM_KIND, "virtualmachines", "kubevirt.io"),
    ResourceSpec(VMI_KIND, "virtualmachineinstances", "kubevirt.io"),
    ResourceSpec(VMIM_KIND, "virtualmachineinstancemigrations", "kubevirt.io"),
    ResourceSpec(POD_KIND, "pods"),
    ResourceSpec(EVENT_KIND, "events", field_selector=FAILED_CREATE_SELECTOR),
)
"""What the watcher follows. Namespaces and quotas are listed first: syncs name every namespace, and the pod list
needs to know which namespaces are managed."""

FIRST: Final = frozenset({NAMESPACE_KIND, QUOTA_KIND})


@dataclass(frozen=True, slots=True)
class WatcherConfig:
    cluster: str
    page_size: int = 500
    timeouts: Timeouts = field(default_factory=Timeouts)
    backoff: Backoff = field(default_factory=Backoff)
    window: int = 1000
    """Acks in flight."""
    ack_timeout: float = 10.0
    short_watch: float = 1.0
    """A watch that ends sooner than this without an event counts as a failure (backoff), not a timeout."""
    resources: tuple[ResourceSpec, ...] = RESOURCES

    def __post_init__(self) -> None:
        contract.check_cluster(self.cluster)
        if self.page_size < 1 or self.window < 1:
            raise InvalidInput("page size and window must be positive", "watcher")


class Watcher:
    """Every resource of one cluster (see the module docstring). ``run()`` until cancelled."""

    def __init__(
        self,
        api: ApiClient,
        publisher: Publisher,
        config: WatcherConfig,
        *,
        metrics: WatcherMetrics | None,
        log: Any,
        rng: Any = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        import random

        self.api = api
        self.publisher = publisher
        self.config = config
        self.metrics = metrics
        self.log = log.bind(cluster=config.cluster)
        self.rng = rng if rng is not None else random.Random()
        self.on_ready = on_ready
        self.emitter = Emitter(config.cluster, publisher, metrics, self.log)
        self.managed = ManagedNamespaces()
        self.loops: dict[str, ListWatch] = {}
        for spec in config.resources:
            cls = LOOPS.get(spec.kind, ListWatch)
            self.loops[spec.kind] = cls(self, spec)
        self._group: asyncio.TaskGroup | None = None
        self._asked: set[str] = set()
        """Tokens of the relist requests received and not answered yet (:meth:`relist_asked`)."""
        self._answered: deque[str] = deque(maxlen=256)
        """Tokens this watcher answered (the latest)."""
        self._answering: set[str] = set()
        """Tokens the round that runs answers."""
        self._republishing: asyncio.Task[None] | None = None

    def cluster_namespaces(self) -> Iterable[str]:
        ns = self.loops.get(NAMESPACE_KIND)
        if ns is None:
            return ()
        return [t.name for _, t in ns.known.items()]

    def managed_changed(self, added: Iterable[str], removed: Iterable[str]) -> None:
        pods = self.loops.get(POD_KIND)
        for ns in added:
            self.log.info("namespace managed", namespace=ns)
            if isinstance(pods, PodListWatch):
                pods.became_managed(ns)
        for ns in removed:
            if isinstance(pods, PodListWatch):
                pods.stopped_managed(ns)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        if self._group is None:
            raise RuntimeError("the watcher is not running")
        task: asyncio.Task[None] = self._group.create_task(coro, name=name)
        return task

    # ---- relists a consumer asks for ----------------------------------------------------------------------------
    def relist_asked(self, data: bytes) -> None:
        """A relist request (``vmquota.relist.<cluster>``): a consumer lost events of this cluster. Every object is
        listed and published again, then a marker answering the request (:meth:`republish`); requests that come
        while that runs are answered by the next round, and a token answered already is not relisted again (the
        consumer asks until it has read the answer, which may lie behind a backlog)."""
        try:
            request = contract.decode_relist_request(data)
        except InvalidInput as e:
            self.log.warning("relist request ignored", error=str(e))
            return
        if request.token in self._answered or request.token in self._asked or request.token in self._answering:
            return
        self.log.warning("relist asked: publishing everything again", requester=request.requester, token=request.token)
        self._asked.add(request.token)
        if self._republishing is None or self._republishing.done():
            self._republishing = self.spawn(self.republish(), "republish")

    async def republish(self) -> None:
        """Have every loop list and publish every object again (namespaces and quotas first, as at the start), then
        publish the marker that answers the requests received before it began: a sync of the cluster's namespaces
        whose ``answers`` name their tokens (``shared.contract.Sync.answers``), after everything else is stored."""
        namespaces = self.loops.get(NAMESPACE_KIND)
        if namespaces is None:
            self.log.error("cannot answer a relist request without watching namespaces")
            return
        first = [lw for k, lw in self.loops.items() if k in FIRST]
        rest = [lw for k, lw in self.loops.items() if k not in FIRST]
        while self._asked:
            answering, self._asked = sorted(self._asked), set()
            self._answering = set(answering)
            again = f"relist-{contract.answers_key(answering)}"
            await asyncio.gather(*(lw.republish(again) for lw in first))
            await asyncio.gather(*(lw.republish(again) for lw in rest))
            await self.publisher.flush()
            self.emitter.sync(NAMESPACE_KIND, "", namespaces.rv, sorted(namespaces.known), answers=answering)
            await self.publisher.flush()
            self._answered.extend(answering)
            self._answering = set()
            self.log.info("relist published", answers=answering)

    async def run(self) -> None:
        first = [lw for k, lw in self.loops.items() if k in FIRST]
        rest = [lw for k, lw in self.loops.items() if k not in FIRST]

        async def asked(msg: Msg) -> None:
            self.relist_asked(msg.data)

        sub = None
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                sub = await self.publisher.bus.nc.subscribe(contract.relist_subject(self.config.cluster), cb=asked)
                for lw in first:
                    group.create_task(lw.run(), name=f"watch-{lw.kind}")
                for lw in first:
                    await lw.listed.wait()
                for lw in rest:
                    group.create_task(lw.run(), name=f"watch-{lw.kind}")
                for lw in rest:
                    await lw.listed.wait()
                self.log.info("every resource listed", objects={k: len(lw.known) for k, lw in self.loops.items()})
                if self.on_ready is not None:
                    self.on_ready()
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):  # (gone with the connection)
                    await sub.unsubscribe()
