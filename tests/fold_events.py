"""Object events and sync markers as the watcher publishes them, for the tests of the ledger's fold
(``tests/unit/test_ledger_fold.py``, ``tests/unit/test_fold_fuzz.py``): one namespace ``a`` of cluster ``c1`` unless
told, a snapshot's content derived from its arguments."""

from __future__ import annotations

from typing import Any

from shared import contract
from shared.contract import Deleted, Sync, Upserted
from shared.ledger.fold import NamespaceState
from shared.snapshot import SNAPSHOT_TYPES, PodSnapshot, VmimSnapshot, VmiSnapshot, awaits_attachment_pod

Event = Upserted | Deleted | Sync


def make_snapshot(kind: str, uid: str, rv: int, ns: str, name: str, **fields: Any) -> contract.Snapshot:
    extra: dict[str, Any] = {"vmi_name": "vm"} if kind == "VirtualMachineInstanceMigration" else {}
    namespace = "" if kind == "Namespace" else ns
    snap = SNAPSHOT_TYPES[kind](name=name, namespace=namespace, uid=uid, resource_version=str(rv), **extra, **fields)
    return snap  # type: ignore[return-value]


def up(uid: str, rv: int, ns: str = "a", kind: str = "Pod", cluster: str = "c1", **fields: Any) -> Upserted:
    name = ns if kind == "Namespace" else f"{kind.lower()}-{uid}"
    ev = contract.object_event(
        "upserted",
        cluster=cluster,
        kind=kind,
        namespace=ns,
        name=name,
        uid=uid,
        rv=str(rv),
        snapshot=make_snapshot(kind, uid, rv, ns, name, **fields),
        time="t",
    )
    assert isinstance(ev, Upserted)
    return ev


def down(uid: str, rv: int, ns: str = "a", kind: str = "Pod", cluster: str = "c1") -> Deleted:
    name = ns if kind == "Namespace" else f"{kind.lower()}-{uid}"
    ev = contract.object_event(
        "deleted", cluster=cluster, kind=kind, namespace=ns, name=name, uid=uid, rv=str(rv), snapshot=None, time="t"
    )
    assert isinstance(ev, Deleted)
    return ev


def sync(present: list[str], rv: int, ns: str = "a", kind: str = "Pod", cluster: str = "c1") -> Sync:
    return contract.sync_event(cluster=cluster, kind=kind, namespace=ns, rv=str(rv), present=present, time="t")


def answer(*tokens: str, cluster: str = "c1", rv: int = 9) -> Sync:
    """The marker that ends a relist answering the requests named ``tokens``."""
    return contract.sync_event(
        cluster=cluster, kind="Namespace", namespace="", rv=str(rv), present=["n-a"], answers=tokens, time="t"
    )


def attaching_of(state: NamespaceState) -> set[str]:
    """What the fold's ``attaching`` must be, from its objects alone, as the accounting decides it of each target
    (``shared.snapshot.awaits_attachment_pod``): the oracle the fold's kept counts are held to."""
    pods = [p for p in state.live("Pod") if isinstance(p, PodSnapshot)]
    attached = {p.attachment_of for p in pods}
    vmis = {v.name: v for v in state.live("VirtualMachineInstance") if isinstance(v, VmiSnapshot)}
    migrations = {m.uid: m for m in state.live("VirtualMachineInstanceMigration") if isinstance(m, VmimSnapshot)}
    return {
        p.migration_job_uid
        for p in pods
        if (m := migrations.get(p.migration_job_uid)) is not None
        and (v := vmis.get(m.vmi_name)) is not None
        and awaits_attachment_pod(m, v, p, attached)
    }
