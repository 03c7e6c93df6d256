"""A usage snapshot larger than the bus takes: the ledger drops VM states, but never what the enforcer acts on."""

from __future__ import annotations

from typing import Any

from shared import contract
from shared.accounting.wire import account
from shared.kinds import POD_KIND, QUOTA_KIND, VMI_KIND, VMIM_KIND
from shared.ledger.fold import NamespaceView
from shared.ledger.usage import fit, usage_snapshot
from shared.quota import guard
from shared.snapshot import PodSnapshot, QuotaSnapshot, VmimSnapshot, VmiSnapshot
from tests.builders import NS, launcher_obj, quota_obj, refused_vmi, snaps, usage_of, vmi_obj, vmim_obj

KINDS: dict[type[Any], str] = {
    VmiSnapshot: VMI_KIND,
    PodSnapshot: POD_KIND,
    QuotaSnapshot: QUOTA_KIND,
    VmimSnapshot: VMIM_KIND,
}


def publish(body: contract.UsageBody) -> tuple[contract.UsageSnapshot, bytes | None]:
    """The ledger's usage snapshot of ``body`` and what it publishes of it on a bus that takes 1 MB."""
    msg, _ = usage_snapshot(body, cluster="c", namespace=NS, seq=1, source="vmquota/ledger/c", time="t")
    return msg, fit(msg, body.vms, 1024 * 1024).data


def test_a_trimmed_usage_keeps_the_guards_holders_and_the_admitted_vms() -> None:
    """A tenant pads its namespace with 1,500 pending VMIs with long names that do not fit (refused, no room): the
    usage snapshot outgrows the bus's 1 MB and is published with only the admitted VMs' states. A pending
    migration's holder and an admitted VM's holder are still listed. (Before, every VM state was dropped and the
    guard listed no holder: the raise went out unguarded.)"""
    v = vmi_obj("v", guest="4Gi")
    source = launcher_obj(v)
    budget = usage_of(source)["requests.memory"] + usage_of(launcher_obj(vmi_obj("w", guest="1Gi")))["requests.memory"]
    objs = [quota_obj("rq", {"requests.memory": budget.canonical()}), v, source, vmim_obj("m", "v", rejected=True)]
    objs.append(refused_vmi(vmi_obj("w", guest="1Gi", phase="Pending", node="", t=150)))  # admitted, KubeVirt refused
    objs += [vmi_obj("x" * 240 + f"{i:05d}", guest="8Gi", phase="Pending", node="", t=200 + i) for i in range(1500)]
    objects: dict[str, list[Any]] = {}
    for s in snaps(objs):
        objects.setdefault(KINDS[type(s)], []).append(s)
    body = account(NamespaceView("c", NS, 1, objects, {}))
    msg, data = publish(body)
    assert data is not None and len(contract.encode(msg)) > 1024 * 1024 > len(data)
    published = contract.decode_usage(data)
    assert [s.name for s in published.vms] == ["w"] and "1501 of the 1502 VMs are left out" in published.errors[-1]
    assert {h.name for h in guard.holders(published)} == {"v", "w"}
    assert sorted(s.vmi for s in guard.reserved_sizes(published)) == ["v", "w"]


def test_a_namespace_of_many_admitted_vms_keeps_them_by_name_and_uid() -> None:
    """2,000 small admitted VMIs with long names: with their whole states even the admitted ones outgrow the bus;
    they are kept by name and uid (the guard's holders, the nudges) rather than the snapshot not being published
    at all (which would hold every raise of the namespace back)."""
    quota = quota_obj("rq", {"requests.memory": "10Ti"})
    objs: list[dict[str, Any]] = [quota]
    for i in range(2000):
        v = refused_vmi(vmi_obj("y" * 240 + f"{i:05d}", guest="1Mi", phase="Pending", node="", t=200 + i))
        v["metadata"]["uid"] = f"{i:036d}"  # (as long as a real uid)
        objs.append(v)
    objects: dict[str, list[Any]] = {}
    for s in snaps(objs):
        objects.setdefault(KINDS[type(s)], []).append(s)
    body = account(NamespaceView("c", NS, 1, objects, {}))
    assert all(v.state == "admitted" for v in body.vms) and len(body.vms) == 2000
    _, data = publish(body)
    assert data is not None, "the snapshot was not published at all"
    published = contract.decode_usage(data)
    assert len(guard.holders(published)) == 2000
    assert "the admitted ones without their counts and reasons" in published.errors[-1]
