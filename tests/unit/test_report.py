"""What an operator reads: readable quantities, one row per managed quota, the JSON contract."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from shared import contract, report
from shared.quantity import Quantity
from tests.builders import decision


def test_one_readable_form_per_resource() -> None:
    assert report.readable(Quantity.parse("17179869184"), "limits.memory") == "16Gi"
    assert report.readable(Quantity.parse("17405661185"), "limits.memory") == "16.2Gi"
    assert report.readable(Quantity.parse("137106311Ki"), "requests.memory") == "130.8Gi"
    assert report.readable(Quantity.parse("1500m"), "requests.cpu") == "1500m"
    assert report.readable(Quantity.parse("2000m"), "limits.cpu") == "2"
    assert report.readable_list({"limits.memory": "64Gi", "pods": "10", "x": "lots"}) == {
        "limits.memory": "64Gi",
        "pods": "10",
        "x": "lots",
    }


def usage(quotas: dict[str, contract.QuotaTerms], **kw: object) -> contract.UsageSnapshot:
    return contract.UsageSnapshot(
        id="c1/usage/ns/1",
        source="vmquota/ledger/c1",
        subject="ns",
        time="2026-12-03T10:00:00Z",
        cluster="c1",
        namespace="ns",
        seq=1,
        quotas=quotas,
        **kw,  # type: ignore[arg-type]
    )


def test_rows_take_hard_from_the_last_written_decision_and_name_the_migrations() -> None:
    t = contract.QuotaTerms(
        mode="VirtualResources",
        budget={"requests.cpu": "8"},
        used={"requests.cpu": "8"},
        pods={"requests.cpu": "2"},
        reserved={"requests.cpu": "500m"},
        hard={"requests.cpu": "2500m"},
    )
    u = usage(
        {"compute": t},
        migrations=[contract.MigrationState(name="m1", vmi="vm1", reserved={"requests.cpu": "500m"})],
        vms=[contract.VmState(name="vm1", state="running"), contract.VmState(name="vm2", state="refused")],
    )
    d = decision("ns", time="2026-12-03T10:00:01Z", mode="VirtualResources", hard_after={"requests.cpu": "2"})
    dry = contract.Decision(**{**{f: getattr(d, f) for f in d.__struct_fields__}, "dry_run": True, "hard_after": {}})
    (row,) = report.quota_rows([u], [d, dry])
    assert row.hard == {"requests.cpu": "2"}, "what the enforcer wrote, dry runs aside"
    assert row.raised_for == ["m1"] and row.vms == {"running": 1, "admitted": 0, "refused": 1}
    assert row.status == "raised for m1; 1 VM(s) refused"
    j = report.status_json([row])["quotas"][0]
    assert list(j) == [
        "cluster", "namespace", "name", "mode", "budget", "used", "pods", "reserved", "hard", "raisedFor", "vms",
        "status", "time",
    ]  # fmt: skip
    assert j["time"] == "2026-12-03T10:00:00Z", "when the usage shown was published"
    table = report.status_table([row], wide=True)
    assert "requests.cpu 8/8" in table and "Note: hard = pods + reserved + k * budget - taken - overlap" in table
    assert report.status_table([]) == "no managed quotas found"
    narrow = report.status_table([row])
    assert "HARD" not in narrow and "Note:" not in narrow and "-o wide" in narrow, "the note is about a column"


def test_a_kubernetes_quota_message_reads_in_readable_amounts() -> None:
    """KubeVirt repeats the quota admission's message, amounts in bytes; explain shows them readable."""
    message = (
        'pods "virt-launcher-vm1-x" is forbidden: exceeded quota: compute, requested: limits.memory=35032106752, '
        "used: limits.memory=68719476736,requests.cpu=1500m, limited: limits.memory=64Gi"
    )
    assert report.readable_amounts(message) == (
        'pods "virt-launcher-vm1-x" is forbidden: exceeded quota: compute, requested: limits.memory=32.6Gi, '
        "used: limits.memory=64Gi,requests.cpu=1500m, limited: limits.memory=64Gi"
    )
    assert report.readable_amounts("no amounts here, version=1.2.3x") == "no amounts here, version=1.2.3x"


def test_names_from_the_bus_cannot_drive_the_operators_terminal_in_the_status_table() -> None:
    """`vmquota status` and `vmquota replay` print names and states that bus messages carry: a message forged with a
    publisher's credential must not move the cursor or clear the screen of the operator reading them."""
    t = contract.QuotaTerms(mode="VirtualResources", budget={"requests.cpu": "8"}, used={"requests.cpu": "1"})
    u = usage({"q\x1b[2J": t}, vms=[contract.VmState(name="vm1\x1b[H", state="refused")])
    (row,) = report.quota_rows([u])
    table = report.status_table([row], wide=True)
    assert "\x1b" not in table and "q\\x1b[2J" in table


def test_the_reason_a_namespace_has_no_quota_in_force_is_the_ledgers_not_a_tenants() -> None:
    """``vmquota status`` names why a namespace has no managed quota in force from its usage's errors: only a line
    the ledger wrote about a ResourceQuota (which a tenant cannot make) says so, not a line quoting an Event's
    text the tenant wrote to look like one, and what it prints cannot drive the terminal."""
    forged = "Event tenant-a/vm1.x: cannot read requested amount 'a: not managed: \x1b[2Jall is well'"
    real = "ResourceQuota tenant-a/vm-budget: not managed: vmquota.io/mode: unknown mode 'Bogus\x1b[2J'"
    assert report.refused_quota([forged]) is None
    line = report.refused_quota([forged, real])
    assert (
        line is not None and line.startswith("ResourceQuota tenant-a/vm-budget: not managed: ") and "\x1b" not in line
    )


def test_the_status_table_says_how_old_the_usage_it_shows_is() -> None:
    """A ledger that stopped left its last snapshots on the bus: `status` showed them as if current, with nothing to
    tell their age. The table has an AGE column, as kubectl shows one."""
    t = contract.QuotaTerms(mode="VirtualResources", budget={"requests.cpu": "8"}, used={"requests.cpu": "2"})
    (row,) = report.quota_rows([usage({"compute": t})])
    published = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)
    for later, shown in ((0, "0s"), (45, "45s"), (119, "119s"), (720, "12m"), (5 * 3600, "5h"), (3 * 86400, "3d")):
        table = report.status_table([row], now=published + timedelta(seconds=later)).splitlines()
        assert table[0].split()[-2:] == ["AGE", "STATUS"] and shown in table[1].split(), (later, table)
    assert report.age("2026-12-03T10:00:30Z", published) == "0s", "a clock behind the ledger's: no negative age"
    assert report.age("not a time", published) == "-"
    assert "AGE" not in report.status_table([row]), "a replay's table: no age"
