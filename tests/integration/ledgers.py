"""What the ledger's integration tests share: a stand-in accountant, a generator of object events, a running
ledger service, and reading what it published (``tests/integration/test_ledger*.py``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.js.errors

from services.ledger.service import LedgerOptions, LedgerService
from services.platform.bus import Bus, NatsOptions
from services.platform.publisher import publish_all
from services.platform.runner import cancel
from shared import contract
from shared.ledger.fold import Ledger, NamespaceView, PartitionSet
from shared.ledger.usage import usage_digest
from shared.snapshot import KubeVirtSnapshot, PodSnapshot

CLUSTER = "c1"


def count_objects(view: NamespaceView) -> contract.UsageBody:
    """A stand-in accountant for the service's plumbing: the live pods and their phases (a pure function of the
    view, as the real one is)."""
    pods = view.objects.get("Pod", [])
    vms = [contract.VmState(name=p.name, uid=p.uid, phase=getattr(p, "phase", ""), state="running") for p in pods]
    errors = [f"namespace object {s.name}" for s in view.objects.get("Namespace", [])]
    return contract.UsageBody(vms=vms, errors=errors)


@dataclass
class World:
    """Generates object events as a cluster would: one global resourceVersion, creates, updates and deletes."""

    rnd: random.Random
    namespaces: list[str]
    rv: int = 100
    live: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (namespace, name)
    made: int = 0

    def next(self) -> contract.Upserted | contract.Deleted:
        self.rv += 1
        roll = self.rnd.random()
        if self.live and roll < 0.2:
            uid = self.rnd.choice(sorted(self.live))
            ns, name = self.live.pop(uid)
            ev = contract.object_event(
                "deleted", cluster=CLUSTER, kind="Pod", namespace=ns, name=name, uid=uid, rv=str(self.rv), snapshot=None
            )
        elif self.live and roll < 0.6:
            uid = self.rnd.choice(sorted(self.live))
            ns, name = self.live[uid]
            ev = self._pod(uid, ns, name)
        else:
            self.made += 1
            ns = self.rnd.choice(self.namespaces)
            uid, name = f"uid-{self.made:05d}", f"pod-{self.made}"
            self.live[uid] = (ns, name)
            ev = self._pod(uid, ns, name)
        return ev

    def kubevirt(self) -> contract.Upserted | contract.Deleted:
        """The cluster's KubeVirt CR at a new version (cluster-wide state, folded by every instance)."""
        self.rv += 1
        snap = KubeVirtSnapshot(
            uid="kv-uid",
            namespace="kubevirt",
            name="kubevirt",
            resource_version=str(self.rv),
            cpu_allocation_ratio=str(self.rv % 7 + 1),
        )
        return contract.object_event(
            "upserted",
            cluster=CLUSTER,
            kind="KubeVirt",
            namespace="kubevirt",
            name="kubevirt",
            uid="kv-uid",
            rv=str(self.rv),
            snapshot=snap,
        )

    def _pod(self, uid: str, ns: str, name: str) -> contract.Upserted | contract.Deleted:
        phase = self.rnd.choice(["Pending", "Running"])
        snap = PodSnapshot(uid=uid, namespace=ns, name=name, resource_version=str(self.rv), phase=phase)
        return contract.object_event(
            "upserted", cluster=CLUSTER, kind="Pod", namespace=ns, name=name, uid=uid, rv=str(self.rv), snapshot=snap
        )


def subject_of(ev: contract.Upserted | contract.Deleted | contract.Sync) -> str:
    return contract.event_subject(ev.cluster, ev.kind, ev.namespace or getattr(ev, "name", ""))


async def publish(b: Bus, events: list[contract.Upserted | contract.Deleted], *, msg_ids: bool = True) -> None:
    await publish_all(b, [(subject_of(e), contract.encode(e), e.id if msg_ids else None) for e in events])


def options(partitions: PartitionSet | None = None, *, part_bytes: int = 0) -> LedgerOptions:
    return LedgerOptions(
        partitions=partitions or PartitionSet.all(4),
        cluster=CLUSTER,
        batch=64,
        idle=0.1,
        debounce=0.01,
        checkpoint_interval=0.05,
        checkpoint_part_bytes=part_bytes,
    )


class Running:
    """A LedgerService task; ``crash()`` cancels it mid-flight (no clean stop), ``stop()`` stops it cleanly."""

    def __init__(
        self, b: Bus, opts: LedgerOptions, account: Callable[[NamespaceView], contract.UsageBody] = count_objects
    ) -> None:
        self.stop_event = asyncio.Event()
        self.service = LedgerService(b, opts, account)
        self.task = asyncio.create_task(self.service.run(self.stop_event))

    def applied_through(self, seq: int) -> bool:
        if self.task.done():
            self.task.result()  # surface a failure
        c = self.service.consumer
        return c is not None and c.next_seq > seq

    async def crash(self) -> None:
        await cancel(self.task)  # (until it is dead: nats-py can lose a cancellation on Python 3.11)
        assert self.task.cancelled()

    async def stop(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(self.task, 10)


async def last_usage(b: Bus) -> dict[str, contract.UsageSnapshot]:
    """The last usage snapshot of every namespace (the usage stream keeps one per subject)."""
    out: dict[str, contract.UsageSnapshot] = {}
    try:
        info = await b.js.stream_info(contract.USAGE_STREAM, subjects_filter=">")
    except nats.js.errors.NotFoundError:
        return out  # the ledger has not created it yet
    for subject in sorted(info.state.subjects or {}):
        msg = await b.js.get_msg(contract.USAGE_STREAM, subject=subject, direct=False)
        u = contract.decode_usage(msg.data or b"")
        out[u.namespace] = u
    return out


def expected_usage(events: list[contract.Upserted | contract.Deleted]) -> tuple[Ledger, dict[str, str]]:
    """A ledger that applied ``events`` without stopping, and the usage content (digest) of each namespace.
    (A usage snapshot's ``seq`` is the sequence at which it was published, which depends on batching: an event
    that does not change the content is not republished. The content is what must match.)"""
    led = Ledger()
    for i, ev in enumerate(events):
        led.apply(ev, i + 1)
    return led, {ns: usage_digest(count_objects(led.view(c, ns))) for c, ns in led.namespaces()}


def usage_of(snapshots: dict[str, contract.UsageSnapshot]) -> dict[str, str]:
    return {
        ns: usage_digest(contract.UsageBody(quotas=u.quotas, vms=u.vms, migrations=u.migrations, errors=u.errors))
        for ns, u in snapshots.items()
    }


async def connect_bus(url: str) -> Bus:
    return await Bus.connect(NatsOptions(url=url, name="test"), connect_timeout=10)
