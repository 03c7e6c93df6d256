"""A usage snapshot larger than the bus takes: the ledger drops VM states, but never what the enforcer acts on."""

from __future__ import annotations

from typing import Any, cast

import pytest

from shared import contract
from shared.accounting.namespace import by_kind
from shared.accounting.wire import account
from shared.contract import MAX_ERRORS, error_count
from shared.errors import InvalidInput
from shared.ledger.fold import NamespaceView
from shared.ledger.usage import fit, usage_snapshot
from shared.quota import guard
from tests.builders import (
    NS,
    launcher_obj,
    quota_obj,
    refusal_event,
    refused_vmi,
    snaps,
    usage_of,
    vmi_obj,
    vmim_obj,
)


def view(objs: list[dict[str, Any]]) -> NamespaceView:
    """The ledger's view of the namespace of ``objs``."""
    return NamespaceView("c", NS, 1, cast(Any, by_kind(snaps(objs), NS)[1]), {})


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
    body = account(view(objs))
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
    body = account(view(objs))
    assert all(v.state == "admitted" for v in body.vms) and len(body.vms) == 2000
    _, data = publish(body)
    assert data is not None, "the snapshot was not published at all"
    published = contract.decode_usage(data)
    assert len(guard.holders(published)) == 2000
    assert "the admitted ones without their counts and reasons" in published.errors[-1]


def test_vmis_vmquota_cannot_estimate_do_not_keep_the_usage_off_the_bus() -> None:
    """A tenant pads its namespace with 4,000 pending VMIs with long names whose hook-sidecar annotation is not
    JSON (vmquota's renderer refuses it): each was one line of the snapshot's ``errors``, which the fit to the bus
    kept in every form it tried, so nothing was published, every raise of the namespace (a migration's target's)
    was held back, and a changed budget left the quota Waiting. ``errors`` carries at most 50 lines now."""
    objs: list[dict[str, Any]] = [quota_obj("rq", {"requests.memory": "10Ti"})]
    for i in range(4000):  # (names short enough for the VMs' states to fit: the snapshot's other limit)
        v = vmi_obj("z" * 40 + f"{i:05d}", guest="1Mi", phase="Pending", node="", t=200 + i)
        v["metadata"].setdefault("annotations", {})["hooks.kubevirt.io/hookSidecars"] = "not json"
        objs.append(v)
    body = account(view(objs))
    assert len(body.errors) >= 4000, body.errors[:3]
    msg, data = publish(body)
    assert data is not None, "the snapshot is published"
    assert len(msg.errors) == MAX_ERRORS and msg.errors[-1].startswith(f"and {len(body.errors) - MAX_ERRORS + 1} more")
    assert error_count(msg.errors) == len(body.errors), "vmquota status counts them all"


def test_refusal_events_naming_many_made_up_resources_do_not_keep_the_usage_off_the_bus() -> None:
    """FailedCreate Events are anyone's to write in a namespace: the tenant's twenty Events about its refused VMI
    name a hundred made-up resources each. The ledger ignores every amount, as it must, and reported each in a line
    of ``errors``; amounts in resources no managed quota limits are no matter now, and not reported (those it
    limits, beyond the bound, are said in one line per refusal: ``tests/unit/test_accounting.py``). An Event naming
    more resources than a quota may limit is not a quota's refusal: the watcher refuses it (dead letter)."""
    v = refused_vmi(vmi_obj("w", guest="1Gi", phase="Pending", node="", t=150))
    objs: list[dict[str, Any]] = [quota_obj("rq", {"requests.memory": "64Gi"}), v]
    for e in range(20):
        names: dict[str, str] = {f"example.com/r{e:02d}x{i:04d}": "1" for i in range(100)}
        objs.append(refusal_event("w", names, t=160 + e))
    body = account(view(objs))
    assert not [line for line in body.errors if "quota refusal amounts ignored" in line], body.errors
    assert body.vms[0].state == "admitted" and body.vms[0].pod_refused, body.vms
    assert publish(body)[1] is not None
    with pytest.raises(InvalidInput, match="naming 129 resources"):
        too_many: dict[str, str] = {f"example.com/r{i:04d}": "1" for i in range(129)}
        snaps([refusal_event("w", too_many, t=200)])
