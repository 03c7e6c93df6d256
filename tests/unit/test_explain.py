"""``shared.explain``: the timeline of a migration and of a VM from bus messages alone."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from shared import contract
from shared.explain import migration_timeline, vm_timeline
from shared.snapshot import EventSnapshot, PodSnapshot, VmiMigrationState, VmimSnapshot, VmiSnapshot
from tests import builders

NS = "tenant-a"


def at(second: int) -> str:
    return f"2026-12-01T10:00:{second:02d}Z"


def ms(second: int) -> str:
    return f"2026-12-01T10:00:{second:02d}.000Z"


def ev(kind: str, name: str, uid: str, rv: int, snapshot: Any, second: int, *, deleted: bool = False) -> Any:
    return contract.object_event(
        "deleted" if deleted else "upserted",
        cluster="c1",
        kind=kind,
        namespace=NS,
        name=name,
        uid=uid,
        rv=str(rv),
        snapshot=snapshot,
        time=at(second),
    )


def vmim(phase: str, rv: int, second: int) -> Any:
    snap = VmimSnapshot(
        uid="mig-uid",
        namespace=NS,
        name="mig1",
        vmi_name="vm1",
        phase=phase,
        resource_version=str(rv),
        creation_timestamp=datetime(2026, 12, 1, 10, 0, 10, tzinfo=UTC),
    )
    return ev("VirtualMachineInstanceMigration", "mig1", "mig-uid", rv, snap, second)


def refusal(uid: str, count: int, second: int) -> Any:
    snap = EventSnapshot(
        uid=uid,
        namespace=NS,
        name=f"vm1.{uid}",
        reason="FailedCreate",
        involved_kind="VirtualMachineInstance",
        involved_name="vm1",
        message="pods is forbidden: exceeded quota: compute",
        quota_name="compute",
        count=count,
    )
    return ev("Event", f"vm1.{uid}", uid, 100 + second, snap, second)


def decision(reason: str, second: int) -> contract.Decision:
    return builders.decision(NS, id=f"d{second}", time=at(second), reason=reason)


def vmi(rv: int, second: int, *, phase: str = "Running", target: str = "") -> Any:
    state = VmiMigrationState(migration_uid="mig-uid", target_pod=target) if target else None
    snap = VmiSnapshot(uid="vmi-uid", namespace=NS, name="vm1", phase=phase, node_name="node01", migration=state,
                       creation_timestamp=datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC))  # fmt: skip
    return ev("VirtualMachineInstance", "vm1", "vmi-uid", rv, snap, second)


def events() -> list[Any]:
    target_pod = PodSnapshot(uid="pod-uid", namespace=NS, name="virt-launcher-vm1-tgt")
    return [
        vmi(1, 1, phase="Pending"),
        refusal("start", 2, 2),  # the VM's own start was refused twice: not the migration's
        vmi(2, 3),
        vmim("Pending", 10, 11),
        refusal("target", 1, 12),
        refusal("target", 4, 13),  # (the same Event, counted up)
        vmi(3, 14, target="virt-launcher-vm1-tgt"),
        ev("Pod", "virt-launcher-vm1-tgt", "pod-uid", 20, target_pod, 15),
        vmim("Running", 11, 16),
        vmim("Succeeded", 12, 18),
        refusal("later", 1, 30),  # after the migration ended
    ]


def test_a_migrations_timeline_lists_its_steps_in_time_order_with_what_belongs_to_it() -> None:
    decisions = [
        decision("raised limits.memory by 17.6Gi for the migration of vm1", 12),
        decision("raised limits.memory by 1Gi for the migration of vm9", 12),  # another VM's
        decision("lowered limits.memory by 17.6Gi (limits.memory: budget 64Gi, pods 64Gi)", 19),  # (no name)
        decision("lowered limits.memory by 1Gi (limits.memory: budget 64Gi)", 20),  # nothing raised for it now
        decision("raised limits.memory by 17.6Gi for the migration of vm1", 40),  # a later migration of vm1
        decision("raised limits.memory by 1Gi for the migration of vm1", 5),  # an earlier one
    ]
    steps = migration_timeline(NS, "mig1", events(), decisions)
    assert steps is not None
    assert [s.step for s in steps] == [
        "created", "seen", "raised", "target-refused", "target-refused", "target-admitted", "succeeded", "lowered",
    ]  # fmt: skip
    assert [s.time for s in steps] == [ms(10), ms(11), ms(12), ms(12), ms(13), ms(15), ms(18), ms(19)]
    assert "refused 4 times in all" in steps[4].detail, steps[4]
    assert "target pod virt-launcher-vm1-tgt" in steps[5].detail
    assert steps[6].detail.endswith("(+8.000s)"), steps[6]
    assert "vm9" not in " ".join(s.detail for s in steps)
    assert migration_timeline(NS, "other", events(), decisions) is None


def test_a_vms_timeline_and_the_ledgers_current_view() -> None:
    usage = contract.UsageSnapshot(
        id="u", source="vmquota/ledger/c1", subject=NS, time=at(40), cluster="c1", namespace=NS, seq=9,
        vms=[contract.VmState(name="vm1", state="refused", reason="does not fit: 64Gi of 64Gi used",
                         refused_by={"compute": ["limits.memory"]})],
    )  # fmt: skip
    gone = ev("VirtualMachineInstance", "vm1", "vmi-uid", 9, None, 35, deleted=True)
    steps = vm_timeline(NS, "vm1", [*events(), gone], [usage, usage])
    assert steps is not None
    names = [s.step for s in steps]
    assert names[:4] == ["created", "seen", "refused", "running"], names
    assert names[-2:] == ["stopped", "refused"], names
    assert "does not fit compute: limits.memory" in steps[-1].detail, steps[-1]
    said = [s.detail for s in steps if s.step == "refused"]
    assert sum("refused its pod" in d for d in said) == 1, "a quota's retries are one line, then their count"
    assert any(d.startswith("refused 7 times in all (KubeVirt retries)") for d in said), said
    assert vm_timeline(NS, "vm2", events(), [usage]) is None


def test_a_refusal_only_an_event_says_is_shown_as_its_word_and_another_incarnations_is_left_out() -> None:
    """An Event is anyone's in the namespace to write: a refusal KubeVirt's status
    (``migrationRejectedByResourceQuota``) never confirmed is shown as an Event's word, one about another
    incarnation of the VMI (its uid) is left out,
    and an Event's count adds at most a million. Before, a tenant's Event read as the quota's refusal of the target,
    counted 10**18 times."""
    forged = refusal("forged", 10**18, 12)
    other = refusal("other", 1, 13)
    other = with_snapshot(other, involved_uid="an-earlier-vmi-uid")
    steps = migration_timeline(NS, "mig1", [*events()[:4], forged, other, *events()[6:]], [])
    assert steps is not None
    refused = [s for s in steps if s.step == "target-refused"]
    assert len(refused) == 2, refused  # (the forged Event and its total; the other incarnation's left out)
    assert "an Event's word" in refused[0].detail
    assert "1000000 times" in refused[1].detail or "1,000,000 times" in refused[1].detail, refused[1]
    confirmed = [with_snapshot(e, rejected_by_quota=True) if e.kind == "VirtualMachineInstanceMigration" else e
                 for e in events()]  # fmt: skip
    shown = migration_timeline(NS, "mig1", confirmed, [])
    assert shown is not None and all("an Event's word" not in s.detail for s in shown)


def with_snapshot(e: Any, **changes: Any) -> Any:
    """``e`` (an event with an EventSnapshot) with its snapshot changed."""
    return msgspec.structs.replace(e, snapshot=msgspec.structs.replace(e.snapshot, **changes))


def test_the_migration_of_vm1_is_not_told_the_raises_for_vm10_or_myvm1() -> None:
    """A decision names the VMIs whose migrations it raised for: each whole. Matched as text, the migration of vm1
    took the raise for vm10 as its own (and ``myvm1,`` in a list)."""
    decisions = [
        decision("raised limits.memory by 16Gi for the migration of vm10", 12),
        decision("raised limits.memory by 2Gi for the migrations of myvm1, vm12 and vm1x", 12),
        decision("raised limits.memory by 17.6Gi for the migrations of a, vm1 and b; note", 13),
    ]
    steps = migration_timeline(NS, "mig1", events(), decisions)
    assert steps is not None
    raised = [s.detail for s in steps if s.step == "raised"]
    assert raised == [
        "quota compute: raised limits.memory by 17.6Gi for the migrations of a, vm1 and b; note (+3.000s)"
    ]


def test_a_refusals_message_shows_only_the_amounts_it_names() -> None:
    """An Event's message is anyone's in the namespace to write: shown whole, a tenant padded it with spaces until
    a step of its own making (``running ... enforced``) began a row of the operator's terminal. Only the amounts
    it names are shown, and a resource name or an amount holds no space."""
    fake = "  2026-12-01T10:00:03.000Z  running  phase Running on node-7 (quota admitted, enforced)"
    forged = with_snapshot(
        refusal("start", 1, 2),
        message="exceeded quota: compute, requested: limits.memory=1073741824, used: limits.memory=63Gi, limited: "
        "limits.memory=64Gi" + " " * 57 + fake + " " * 40 + "\u3164" * 30,
    )
    steps = vm_timeline(NS, "vm1", [events()[0], forged], [])
    assert steps is not None
    refused = [s.detail for s in steps if s.step == "refused"]
    assert refused == [
        "quota compute refused its pod: requested limits.memory=1Gi; used limits.memory=63Gi; limited "
        "limits.memory=64Gi (+2.000s)"
    ], refused
    junk = with_snapshot(refusal("start", 1, 2), message="exceeded quota: compute, requested: junk   junk, used: ")
    steps = vm_timeline(NS, "vm1", [events()[0], junk], [])
    assert steps is not None and "no amounts it names can be read" in steps[-1].detail, steps
