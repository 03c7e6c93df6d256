"""The reservation guard's content (shared.quota.guard): who is listed, and when a quota stops carrying a
reservation."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared import contract
from shared.kubevirt.render import RENDER_ANNOTATIONS
from shared.normalize import normalize
from shared.quota import guard
from shared.quota.annotations import BUDGET_ANNOTATION, MANAGED_LABEL
from shared.snapshot import QuotaSnapshot, VmiSnapshot, compact_vmi_spec, size_digest
from tests.builders import usage_snapshot, vmi_obj

NS = "t1"


def usage(
    vms: list[contract.VmState], migrations: list[contract.MigrationState], hard: str = "64Gi"
) -> contract.UsageSnapshot:
    terms = contract.QuotaTerms(mode="VmiPodUsage", budget={"limits.memory": "64Gi"}, hard={"limits.memory": hard})
    return usage_snapshot(NS, quotas={"compute": terms}, vms=vms, migrations=migrations)


def quota(spec: str, status: str, *, managed: bool = True, annotations: dict[str, str] | None = None) -> QuotaSnapshot:
    meta: dict[str, Any] = {"name": "compute", "namespace": NS, "uid": "q1", "resourceVersion": "5"}
    meta |= {"labels": {MANAGED_LABEL: "true"}} if managed else {}
    meta |= {"annotations": annotations} if annotations else {}
    raw: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": meta,
        "spec": {"hard": {"limits.memory": spec}},
        "status": {"hard": {"limits.memory": status}},
    }
    s = normalize(raw)
    assert isinstance(s, QuotaSnapshot)
    return s


VMS = [
    contract.VmState(name="vm1", uid="u1", state="running"),
    contract.VmState(name="vm2", uid="u2", state="admitted", pod_refused=True),
    contract.VmState(name="vm3", uid="u3", state="refused"),
    contract.VmState(name="vm4", uid="u4", state="running"),
]
MIGRATIONS = [
    contract.MigrationState(name="m1", vmi="vm1", state="pending"),
    contract.MigrationState(name="m4", vmi="vm4", state="not-tried"),
    contract.MigrationState(
        name="m3", vmi="vm3", state="pending"
    ),  # (its VM is refused: listed by VMI uid all the same)
]


def test_holders_are_admitted_vms_and_reserved_migration_targets() -> None:
    held = guard.holders(usage(VMS, MIGRATIONS))
    assert held == {
        guard.Holder("u2", "vm2", "launcher pod"),
        guard.Holder("u1", "vm1", "migration m1"),
        guard.Holder("u3", "vm3", "migration m3"),
    }
    assert guard.holders(None) == frozenset()
    body = guard.reservation(NS, held, ["kv", "kv"])
    assert body["metadata"] == {
        "name": "vmquota",
        "namespace": NS,
        "labels": {"app.kubernetes.io/managed-by": "vmquota"},
    }
    assert body["spec"]["creators"] == ["kv"]
    assert [h["uid"] for h in body["spec"]["holders"]] == ["u1", "u2", "u3"]


def test_a_holder_is_listed_with_its_room_in_the_resources_a_quota_limits_that_the_policy_charges() -> None:
    """The room reserved for a holder's pod goes with it, so that the policy admits no pod of it charged more (the
    room of every holder is pooled in ``hard``): in the resources a managed quota limits among the ones the policy
    computes a pod's charge in; an attachment pod's holder is held to none. Listed, it reads back the same."""
    reserved = {"limits.memory": "1100Mi", "requests.memory": "1100Mi", "requests.cpu": "100m", "pods": "1"}
    vms = [contract.VmState(name="vm2", uid="u2", state="admitted", pod_refused=True, reserved=reserved)]
    migrations = [
        contract.MigrationState(name="m1", vmi="vm1", vmi_uid="u1", state="pending", reserved=reserved),
        contract.MigrationState(name="m5", vmi="vm5", state="attachment-reserved", target_pod_uid="t5"),
    ]
    held = guard.holders(usage(vms, migrations))
    room = (("limits.memory", "1100Mi"),)  # (the quota limits limits.memory only)
    assert held == {
        guard.Holder("u2", "vm2", "launcher pod", room),
        guard.Holder("u1", "vm1", "migration m1", room),
        guard.Holder("t5", "vm5", "the attachment pod of migration m5"),
    }
    body = guard.reservation(NS, held, ["kv"])
    assert [h.get("room") for h in body["spec"]["holders"]] == [
        None,
        {"limits.memory": "1100Mi"},
        {"limits.memory": "1100Mi"},
    ]
    assert guard.listed(body) == held


def test_a_quota_stops_carrying_a_reservation_only_once_admission_checks_the_lower_hard() -> None:
    before = guard.holders(usage(VMS, MIGRATIONS))
    after = usage([contract.VmState(name="vm1", uid="u1", state="running")], [])
    # spec.hard lowered to what the new snapshot asks, but status.hard (what admission checks) not yet
    assert guard.carried(before, quota("64Gi", "80Gi"), after) == before
    # synced: only what the snapshot holds
    assert guard.carried(before, quota("64Gi", "64Gi"), after) == frozenset()
    # spec.hard is not (yet) what the snapshot asks: keep what was carried, and the snapshot's
    newer = usage(VMS, MIGRATIONS, hard="80Gi")
    assert guard.carried(frozenset(), quota("64Gi", "64Gi"), newer) == before


def test_a_quota_vmquota_does_not_manage_carries_nothing_once_handed_back_and_synced() -> None:
    """A quota not labelled managed has no terms in a usage: it carried what it carried ``before`` for good, and a
    namespace's quota of object counts beside the managed one kept every holder listed, every other pod out. It
    carries none once none of the enforcer's annotations is on it (never managed, or handed back) and admission
    checks its ``spec.hard``; until then (a label just taken off, the release not written or not copied yet)
    what it carried and the usage's holders, as a managed quota."""
    before = guard.holders(usage(VMS, MIGRATIONS))
    now = usage(VMS, MIGRATIONS, hard="80Gi")
    assert guard.carried(before, quota("100", "100", managed=False), now) == frozenset(), "never managed"
    released = quota("64Gi", "80Gi", managed=False)
    assert guard.carried(before, released, now) == before, "handed back, admission still checks the raise"
    label_off = quota("80Gi", "80Gi", managed=False, annotations={BUDGET_ANNOTATION: '{"limits.memory": "64Gi"}'})
    assert guard.carried(before, label_off, now) == before, "its label off, the release not written yet"


@given(st.lists(st.tuples(st.sampled_from(["running", "admitted", "refused", "stopped"]), st.booleans()), max_size=6))
def test_every_admitted_vm_kubevirt_was_refused_for_room_is_a_holder(states: list[tuple[str, bool]]) -> None:
    """An admitted VM KubeVirt has not tried yet (or may never try: a volume that does not exist) holds no one out:
    it would keep every other pod of the namespace out, drain targets included, for as long as it waits."""
    vms = [contract.VmState(name=f"vm{i}", uid=f"u{i}", state=s, pod_refused=r) for i, (s, r) in enumerate(states)]
    held = guard.holders(usage(vms, []))
    assert {h.uid for h in held} == {v.uid for v in vms if v.state == "admitted" and v.pod_refused}


def test_the_sizes_a_raise_checks_are_the_pending_targets_and_a_fresh_vmi_must_have_them() -> None:
    """The enforcer opens a target's room only while the VMI, read once its holder is listed, has the size the
    target was reserved at: the same size digest and the same VMI (uid); a hotplug, another VMI of the name, a
    malformed or missing object all wait."""
    vmi = vmi_obj("vm1", vcpus=2, guest="2Gi")
    vmi["metadata"]["uid"] = "u1"
    snap = normalize(vmi)
    assert isinstance(snap, VmiSnapshot)
    size = size_digest(snap.spec, snap.annotations)
    migrations = [
        contract.MigrationState(name="m1", vmi="vm1", state="pending", vmi_size=size),
        contract.MigrationState(name="m4", vmi="vm4", state="not-tried", vmi_size="ignored"),
        contract.MigrationState(name="m2", vmi="vm2", state="pending"),  # (an older ledger's: no size to check)
    ]
    [sized] = guard.reserved_sizes(usage(VMS, migrations))
    assert sized == guard.Sized("vm1", "u1", size)
    assert guard.reserved_sizes(None) == frozenset()
    assert guard.still_sized(sized, vmi)
    assert guard.still_sized(sized, vmi | {"status": {"phase": "Running", "nodeName": "n9"}}), "status is not size"
    grown = copy.deepcopy(vmi)
    grown["spec"]["domain"]["memory"]["guest"] = "3Gi"
    more = copy.deepcopy(vmi)
    more["spec"]["domain"]["cpu"]["sockets"] = 3
    limited = copy.deepcopy(vmi)
    limited["spec"]["domain"]["resources"] = {"limits": {"memory": "4Gi"}}
    other = copy.deepcopy(vmi)
    other["metadata"]["uid"] = "u9"
    broken = copy.deepcopy(vmi)
    broken["spec"]["domain"]["memory"]["guest"] = "lots"
    for obj in (grown, more, limited, other, broken, None):
        assert not guard.still_sized(sized, obj), obj


@given(
    st.sampled_from(
        [
            ("domain", "cpu", {"sockets": 3}),
            ("domain", "memory", {"guest": "3Gi"}),
            ("domain", "resources", {"requests": {"memory": "2Gi"}}),
            ("domain", "devices", {"interfaces": [{"name": "vf", "sriov": {}}]}),
            ("networks", None, [{"name": "vf", "multus": {"networkName": "sriov"}}, {"name": "x", "pod": {}}]),
        ]
    )
)
def test_the_size_digest_changes_with_what_the_pod_is_rendered_from_and_not_with_the_rest(
    change: tuple[str, str | None, Any],
) -> None:
    spec = vmi_obj("vm1")["spec"]
    assert size_digest(spec, {}) == size_digest(compact_vmi_spec(spec), {}), "pruned or whole: the same digest"
    changed = copy.deepcopy(spec)
    where, field, value = change
    if field is None:
        changed[where] = value
    else:
        changed[where][field] = value
    assert size_digest(changed, {}) != size_digest(spec, {})
    elsewhere = copy.deepcopy(spec)
    elsewhere["hostname"] = "h"
    elsewhere["domain"]["clock"] = {"utc": {}}  # (not what the pod is rendered from)
    assert size_digest(elsewhere, {"team": "a"}) == size_digest(spec, {})
    for key in RENDER_ANNOTATIONS:  # (the renderer reads these from the VMI's metadata)
        assert size_digest(spec, {key: "true"}) != size_digest(spec, {}), key


def test_a_pending_migrations_holder_needs_no_vm_state() -> None:
    """A usage snapshot too large for the bus is published without most VM states; a pending migration carries its
    VMI's uid, so its holder (and the size to check) is listed all the same: the raise never goes out unguarded."""
    migrations = [contract.MigrationState(name="m1", vmi="vm1", state="pending", vmi_size="abc", vmi_uid="u1")]
    trimmed = usage([], migrations)
    assert guard.holders(trimmed) == {guard.Holder("u1", "vm1", "migration m1")}
    assert guard.reserved_sizes(trimmed) == {guard.Sized("vm1", "u1", "abc")}


def test_an_admitted_vm_is_sized_as_it_was_admitted() -> None:
    """An admitted VM's launcher pod is reserved from the VMI the ledger read; its size is checked like a
    migration target's (a pending VMI's metadata stays its owner's to change)."""
    vms = [
        contract.VmState(name="vm2", uid="u2", state="admitted", vmi_size="d2", pod_refused=True),
        contract.VmState(name="vm3", uid="u3", state="admitted", vmi_size="d3"),  # (not tried: no holder)
        contract.VmState(name="vm1", uid="u1", state="running", vmi_size="ignored"),
    ]
    assert guard.reserved_sizes(usage(vms, [])) == {guard.Sized("vm2", "u2", "d2")}


def test_holders_listed_unconfirmed_are_read_back_as_written() -> None:
    held = frozenset({guard.Holder("u1", "vm1", "launcher pod"), guard.Holder("u2", "vm2", "migration m2")})
    obj = guard.reservation(NS, held, ["kv"], frozenset({"u2"}))
    assert [h.get("confirmed") for h in obj["spec"]["holders"]] == [None, False]
    assert guard.listed(obj) == held and guard.unconfirmed(obj) == frozenset({"u2"})
    assert guard.unconfirmed(guard.reservation(NS, held, ["kv"])) == frozenset()
    assert guard.unconfirmed(None) == frozenset() and guard.unconfirmed({"spec": {"holders": "x"}}) == frozenset()


def test_a_targets_attachment_pod_is_held_by_the_target_pod_and_listed_confirmed() -> None:
    """KubeVirt's hotplug attachment pod names the target pod as its controller: that pod is the holder, with no
    size to read (the attachment pod's rendering does not follow the VMI's), so it is listed confirmed."""
    migrations = [
        contract.MigrationState(
            name="m1", vmi="vm1", state="attachment-reserved", vmi_uid="u1", target_pod_uid="pod-t1"
        ),
        contract.MigrationState(name="m2", vmi="vm2", state="target-created", target_pod_uid="pod-t2"),
    ]
    trimmed = usage([], migrations)
    assert guard.holders(trimmed) == {guard.Holder("pod-t1", "vm1", "the attachment pod of migration m1")}
    assert guard.reserved_sizes(trimmed) == frozenset()
