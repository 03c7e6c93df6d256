"""The enforcer's policy, pure: adoption, budget edits, foreign writes, hand-back, refusals, patch bodies, reasons."""

from __future__ import annotations

import copy
import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.devtools.simcluster.patch import merge_patch
from shared import contract
from shared.errors import InvalidInput
from shared.normalize import normalize
from shared.quantity import Quantity
from shared.quota import enforcement as enf
from shared.quota import reports
from shared.quota.annotations import (
    BUDGET_ANNOTATION,
    ENFORCED_BUDGET_ANNOTATION,
    LAST_HARD_ANNOTATION,
    MANAGED_LABEL,
    MODE_ANNOTATION,
    RATIO_ANNOTATION,
    STATUS_ANNOTATION,
    USAGE_ANNOTATION,
    VMI_MINIMUM_ANNOTATIONS,
)
from shared.quota.enforcement import Action
from shared.snapshot import QuotaSnapshot
from tests.builders import usage_snapshot

NS = "tenant-a"
MANAGED = {MANAGED_LABEL: "true"}


def raw_quota(
    hard: dict[str, str],
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    rv: str = "10",
    spec_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": "compute",
            "namespace": NS,
            "uid": "q-uid-1",
            "resourceVersion": rv,
            "labels": dict(MANAGED if labels is None else labels),
            "annotations": dict(annotations or {}),
        },
        "spec": {"hard": dict(hard), **(spec_extra or {})},
        "status": {"hard": dict(hard), "used": {"limits.memory": "1Gi"}},
    }


def snap(raw: dict[str, Any]) -> QuotaSnapshot:
    s = normalize(raw)
    assert isinstance(s, QuotaSnapshot)
    return s


def terms(budget: dict[str, str], hard: dict[str, str], mode: str = "VmiPodUsage", **kw: Any) -> contract.QuotaTerms:
    return contract.QuotaTerms(mode=mode, budget=budget, hard=hard, **kw)


def usage(
    quotas: dict[str, contract.QuotaTerms] | None = None,
    migrations: list[contract.MigrationState] | None = None,
    seq: int = 7,
) -> contract.UsageSnapshot:
    return usage_snapshot(NS, seq, quotas=quotas, migrations=migrations or ())


def apply(raw: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """What the API server does with our merge patch (precondition checked, resourceVersion bumped)."""
    assert body["metadata"]["resourceVersion"] == raw["metadata"]["resourceVersion"]
    out: dict[str, Any] = merge_patch(copy.deepcopy(raw), body)
    out["metadata"]["resourceVersion"] = str(int(raw["metadata"]["resourceVersion"]) + 1)
    return out


def write(raw: dict[str, Any], p: enf.Plan) -> dict[str, Any]:
    """What the enforcer writes for a plan: ``status.hard`` first where the plan sets it, then the rest on the
    version that made."""
    if p.set_status:
        raw = apply(raw, enf.status_body(p))
        p = dataclasses.replace(p, resource_version=raw["metadata"]["resourceVersion"])
    return apply(raw, enf.patch_body(p))


def adopted(budget: dict[str, str], hard: dict[str, str], **kw: Any) -> dict[str, Any]:
    ann = {
        BUDGET_ANNOTATION: enf.rl_json({k: Quantity.parse(v) for k, v in budget.items()}),
        LAST_HARD_ANNOTATION: enf.rl_json({k: Quantity.parse(v) for k, v in hard.items()}),
        STATUS_ANNOTATION: "Enforcing (VmiPodUsage)",
        **kw.pop("annotations", {}),
    }
    return raw_quota(hard, annotations=ann, **kw)


MIGRATING = [
    contract.MigrationState(name="mig-1", vmi="vm1", state="pending", reserved={"limits.memory": "17405661185"})
]


# ---- adoption --------------------------------------------------------------------------------------------------


def test_adoption_without_usage_records_the_budget_and_waits() -> None:
    q = snap(raw_quota({"limits.memory": "64Gi", "pods": "10"}))
    p = enf.plan(q, None)
    assert p.action is Action.ADOPT and p.event_reason == enf.ADOPTED and p.event_type == enf.NORMAL
    assert not p.set_hard
    assert json.loads(p.annotations[BUDGET_ANNOTATION] or "") == {"limits.memory": "64Gi", "pods": "10"}
    assert p.annotations[LAST_HARD_ANNOTATION] == p.annotations[BUDGET_ANNOTATION]
    assert p.annotations[STATUS_ANNOTATION] == "Waiting for usage (VmiPodUsage)"
    assert p.reason == "adopted in mode VmiPodUsage with budget limits.memory=64Gi, pods=10"
    body = enf.patch_body(p)
    assert body == {"metadata": {"resourceVersion": "10", "annotations": dict(sorted(p.annotations.items()))}}


def test_adoption_with_usage_writes_hard_and_is_then_a_fixed_point() -> None:
    raw = raw_quota({"limits.memory": "64Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "81Gi"})}, MIGRATING)
    p = enf.plan(snap(raw), u)
    assert p.action is Action.ADOPT and p.set_hard
    assert p.hard_after == {"limits.memory": Quantity.parse("81Gi")}
    assert p.reason == (
        "adopted in mode VmiPodUsage with budget limits.memory=64Gi; "
        "raised limits.memory by 17Gi for the migration of vm1"
    )
    assert p.annotations[STATUS_ANNOTATION] == "Enforcing (VmiPodUsage)"
    after = write(raw, p)
    assert after["spec"]["hard"] == {"limits.memory": "81Gi"}
    assert json.loads(after["metadata"]["annotations"][BUDGET_ANNOTATION]) == {"limits.memory": "64Gi"}
    assert json.loads(after["metadata"]["annotations"][LAST_HARD_ANNOTATION]) == {"limits.memory": "81Gi"}
    again = enf.plan(snap(after), u)
    assert again.action is Action.NONE and not again.changes


def test_the_ledgers_vmi_minimums_go_on_the_quota_and_off_it_again() -> None:
    """What a VMI's explicit resources must be at least (the guard's rendering-model policy reads it) follows the
    ledger's terms, and goes once the terms have none (a pod-terms mode) or the quota is released."""
    budget = {"requests.memory": "16Gi"}
    raw = adopted(budget, budget, annotations={STATUS_ANNOTATION: "Enforcing (VirtualResources)"})
    raw["metadata"]["annotations"][MODE_ANNOTATION] = "VirtualResources"
    minimums = {"requests.memory": "0.666666"}
    u = usage({"compute": terms(budget, budget, mode="VirtualResources", vmi_minimums=minimums)})
    p = enf.plan(snap(raw), u)
    key = VMI_MINIMUM_ANNOTATIONS["requests.memory"]
    assert p.annotations[key] == "0.666666" and not p.set_hard
    after = write(raw, p)
    assert enf.plan(snap(after), u).action is Action.NONE, "a fixed point"
    gone = enf.plan(snap(after), usage({"compute": terms(budget, budget, mode="VirtualResources")}))
    assert key in gone.annotations and gone.annotations[key] is None
    released = after | {"metadata": {**after["metadata"], "labels": {}}}
    assert enf.plan(snap(released), u).annotations.get(key, "kept") is None


def test_hard_follows_usage_and_drops_back_when_the_migration_ends() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    during = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "80.2Gi"})}, MIGRATING, seq=8)
    p = enf.plan(snap(raw), during)
    assert p.action is Action.ADJUST and p.event_reason == enf.ADJUSTED
    assert p.reason == "raised limits.memory by 16.2Gi for the migration of vm1"
    raw = write(raw, p)
    done = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})}, seq=9)
    back = enf.plan(snap(raw), done, previous=during)
    assert back.hard_after == {"limits.memory": Quantity.parse("64Gi")}
    assert back.reason == "lowered limits.memory by 16.2Gi: the migration of vm1 ended"
    without_memory = enf.plan(snap(raw), done)
    assert without_memory.hard_after == back.hard_after and without_memory.annotations == back.annotations
    assert without_memory.reason.startswith("lowered limits.memory by 16.2Gi (limits.memory: budget 64Gi")


def test_usage_in_another_mode_or_budget_is_not_applied() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    other_mode = usage(
        {"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "99Gi"}, mode="VirtualResources")}
    )
    other_budget = usage({"compute": terms({"limits.memory": "50Gi"}, {"limits.memory": "99Gi"})})
    for other in (other_mode, other_budget):
        p = enf.plan(snap(raw), other)
        assert not p.set_hard, "hard follows only usage accounted in the quota's mode with its budget"
        # and until then the quota is not enforced in them: the status says so (the rendering-model policy reads
        # it), though it was enforced before
        assert p.annotations == {STATUS_ANNOTATION: "Waiting for usage (VmiPodUsage)"}


# ---- budget --------------------------------------------------------------------------------------------------


def test_budget_annotation_edit_takes_effect_through_the_ledger() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    raw["metadata"]["annotations"][BUDGET_ANNOTATION] = '{"limits.memory": "80Gi"}'
    old = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})}, seq=3)
    waiting = enf.plan(snap(raw), old)
    assert not waiting.set_hard, "the ledger has not accounted with the new budget yet"
    assert waiting.annotations[STATUS_ANNOTATION] == "Waiting for usage (VmiPodUsage)"
    new = usage({"compute": terms({"limits.memory": "80Gi"}, {"limits.memory": "80Gi"})}, seq=4)
    p = enf.plan(snap(raw), new, previous=old)
    assert p.set_hard and p.hard_after == {"limits.memory": Quantity.parse("80Gi")}
    assert p.event_reason == enf.BUDGET_CHANGED
    assert p.reason == "raised limits.memory by 16Gi for the new budget limits.memory=80Gi"
    assert BUDGET_ANNOTATION not in p.annotations, "the administrator's spelling of the same budget is kept"
    assert json.loads(p.annotations[LAST_HARD_ANNOTATION] or "") == {"limits.memory": "80Gi"}


def test_foreign_write_to_spec_hard_becomes_the_budget_and_is_reported() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})
    raw["spec"]["hard"] = {"limits.memory": "100Gi", "limits.cpu": "8"}
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})}, MIGRATING)
    q = snap(raw)
    b = enf.resolve_budget(q)
    assert b.foreign and b.budget == {"limits.memory": Quantity.parse("100Gi"), "limits.cpu": Quantity.parse("8")}
    assert b.previous == {"limits.memory": Quantity.parse("64Gi")}
    p = enf.plan(q, u)
    assert p.event_reason == enf.BUDGET_CHANGED and p.event_type == enf.WARNING
    assert not p.set_hard, "hard waits until the ledger accounts with the new budget"
    assert json.loads(p.annotations[BUDGET_ANNOTATION] or "") == {"limits.cpu": "8", "limits.memory": "100Gi"}
    assert json.loads(p.annotations[LAST_HARD_ANNOTATION] or "") == {"limits.cpu": "8", "limits.memory": "100Gi"}
    assert p.reason.startswith(
        "spec.hard was changed outside vmquota to limits.cpu=8, limits.memory=100Gi: taken as the new budget "
        "(was limits.memory=64Gi)"
    )
    raw = write(raw, p)
    assert not enf.plan(snap(raw), u).changes
    agreed = usage({"compute": terms({"limits.memory": "100Gi", "limits.cpu": "8"}, {"limits.memory": "116Gi"})})
    p2 = enf.plan(snap(raw), agreed)
    assert p2.set_hard and enf.patch_body(p2)["spec"]["hard"] == {"limits.cpu": None, "limits.memory": "116Gi"}


def test_rewriting_the_value_we_wrote_is_not_a_foreign_write() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})
    raw["spec"]["hard"] = {"limits.memory": "81920Mi"}  # the same amount, spelled differently
    b = enf.resolve_budget(snap(raw))
    assert not b.foreign and b.budget == {"limits.memory": Quantity.parse("64Gi")}


def test_removing_the_budget_annotation_is_refused_instead_of_adopting_a_raised_hard() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})
    del raw["metadata"]["annotations"][BUDGET_ANNOTATION]
    with pytest.raises(InvalidInput, match=r"was removed while vmquota owns spec\.hard"):
        enf.resolve_budget(snap(raw))
    p = enf.plan(snap(raw), None)
    assert p.action is Action.REFUSE and not p.set_hard
    assert (p.annotations[STATUS_ANNOTATION] or "").startswith("Refused: ResourceQuota tenant-a/compute: metadata.")


def test_unreadable_last_hard_is_rewritten() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    raw["metadata"]["annotations"][LAST_HARD_ANNOTATION] = "{not json"
    p = enf.plan(snap(raw), None)
    assert p.annotations[LAST_HARD_ANNOTATION] == '{"limits.memory":"64Gi"}'
    assert "unreadable and is rewritten" in p.reason


# ---- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec_extra", "field"),
    [
        ({"scopes": ["NotTerminating"]}, "spec.scopes"),
        (
            {"scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "Exists"}]}},
            "spec.scopeS",
        ),
    ],
)
def test_scoped_quota_is_refused(spec_extra: dict[str, Any], field: str) -> None:
    raw = raw_quota({"limits.memory": "64Gi"}, spec_extra=spec_extra)
    p = enf.plan(snap(raw), usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "90Gi"})}))
    assert p.action is Action.REFUSE and p.event_type == enf.WARNING and p.event_reason == enf.REFUSED
    assert not p.set_hard and set(p.annotations) == {STATUS_ANNOTATION}
    status = p.annotations[STATUS_ANNOTATION] or ""
    assert status.startswith(f"Refused: ResourceQuota tenant-a/compute: {field}") and "scoped quotas" in status
    assert not enf.plan(snap(write(raw, p)), None).changes, "reported once"


def test_unknown_mode_is_refused_and_an_adopted_quota_falls_back_to_its_budget() -> None:
    raw = raw_quota({"limits.memory": "64Gi"}, annotations={MODE_ANNOTATION: "VmPodUsage"})
    p = enf.plan(snap(raw), None)
    assert p.action is Action.REFUSE and not p.set_hard
    assert "unknown accounting mode 'VmPodUsage'" in (p.annotations[STATUS_ANNOTATION] or "")
    assert "VirtualResourcesWithCPUAllocationRatio" in p.reason

    was = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"}, annotations={MODE_ANNOTATION: "Bogus"})
    p = enf.plan(snap(was), None)
    assert p.action is Action.REFUSE and p.set_hard and p.hard_after == {"limits.memory": Quantity.parse("64Gi")}
    assert p.reason.endswith("spec.hard set back to the budget limits.memory=64Gi (native quota)")
    fixed = write(was, p)
    fixed["metadata"]["annotations"][MODE_ANNOTATION] = "VirtualResources"
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "70Gi"}, mode="VirtualResources")})
    p = enf.plan(snap(fixed), u)
    assert p.action is Action.ADJUST and p.annotations[STATUS_ANNOTATION] == "Enforcing (VirtualResources)"


def test_bad_ratio_annotation_is_refused() -> None:
    raw = raw_quota({"requests.cpu": "8"}, annotations={RATIO_ANNOTATION: "0"})
    p = enf.plan(snap(raw), None)
    assert p.action is Action.REFUSE and "cpu-allocation-ratio" in (p.annotations[STATUS_ANNOTATION] or "")


# ---- hand-back -----------------------------------------------------------------------------------------------


def test_unlabelling_hands_the_quota_back_with_the_budget() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"}, labels={})
    raw["metadata"]["annotations"]["team"] = "a"
    p = enf.plan(snap(raw), usage({}))
    assert p.action is Action.RELEASE and p.event_reason == enf.RELEASED
    assert p.reason == "released to native quota: spec.hard set back to the budget limits.memory=64Gi"
    body = enf.patch_body(p)
    assert body == {
        "metadata": {
            "resourceVersion": "10",
            "annotations": {BUDGET_ANNOTATION: None, LAST_HARD_ANNOTATION: None, STATUS_ANNOTATION: None},
        },
        "spec": {"hard": {"limits.memory": "64Gi"}},
    }
    after = apply(raw, body)
    assert after["metadata"]["annotations"] == {"team": "a"}
    assert not enf.plan(snap(after), None).changes


def test_unlabelling_after_a_foreign_write_keeps_the_foreign_value() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"}, labels={MANAGED_LABEL: "false"})
    raw["spec"]["hard"] = {"limits.memory": "32Gi"}
    p = enf.plan(snap(raw), None)
    assert p.action is Action.RELEASE and not p.set_hard
    assert p.reason == "released to native quota: spec.hard already equals the budget"


def test_a_release_raises_spec_hard_only_for_a_quota_the_api_server_showed_managed() -> None:
    """Annotations alone prove nothing: an unlabelled quota carrying a budget of 1Ti and a matching last-hard
    (written by anyone who may edit quotas, or copied by a tool) is not raised to 1Ti. Only a quota the enforcer
    saw managed is set back to a budget above its ``spec.hard`` (a scaled mode's hard can be below it)."""
    raw = raw_quota(
        {"limits.memory": "64Gi", "pods": "10"},
        labels={},
        annotations={
            BUDGET_ANNOTATION: '{"limits.memory":"1Ti","pods":"5","requests.cpu":"100"}',
            LAST_HARD_ANNOTATION: '{"limits.memory":"64Gi","pods":"10"}',
        },
    )
    p = enf.plan(snap(raw), None)
    assert p.action is Action.RELEASE
    assert p.hard_after == {"limits.memory": Quantity.parse("64Gi"), "pods": Quantity.parse("5")}
    vouched = enf.plan(snap(raw), None, managed=True)
    assert vouched.hard_after == {
        "limits.memory": Quantity.parse("1Ti"),
        "pods": Quantity.parse("5"),
        "requests.cpu": Quantity.parse("100"),
    }


@pytest.mark.parametrize("how", ["released", "refused"])
def test_a_quota_handed_back_has_a_status_hard_raise_whose_spec_hard_never_followed_set_back(how: str) -> None:
    """The enforcer wrote a raise to ``status.hard``, and before its ``spec.hard`` followed the quota was handed back
    (its label taken off, or its policy made invalid). ``spec.hard`` already equals the budget, so nothing changed
    it, and the quota controller copies it only at its resync, minutes later: quota admission checked the raise on a
    quota vmquota no longer managed. The plan sets ``status.hard`` back where it is above what is handed back, and
    raises it nowhere."""
    raw = adopted({"limits.memory": "64Gi", "pods": "10"}, {"limits.memory": "64Gi", "pods": "10"})
    if how == "released":
        raw["metadata"]["labels"] = {}
    else:
        raw["metadata"]["annotations"][MODE_ANNOTATION] = "NoSuchMode"
    raw["status"] = {
        "hard": {"limits.memory": "80Gi", "pods": "5"},
        "used": {"limits.memory": "64Gi", "pods": "5"},
    }
    p = enf.plan(snap(raw), None, managed=True)
    assert p.action is (Action.RELEASE if how == "released" else Action.REFUSE) and not p.set_hard
    assert p.set_status and not p.raises
    assert write(raw, p)["status"]["hard"] == {"limits.memory": "64Gi", "pods": "5"}
    below = copy.deepcopy(raw)
    below["status"]["hard"] = {"limits.memory": "60Gi", "pods": "10"}
    assert not enf.plan(snap(below), None, managed=True).set_status, "native quota copies a raise itself"


def test_quotas_in_excluded_namespaces() -> None:
    patterns = enf.DEFAULT_EXCLUDED_NAMESPACES
    assert enf.excluded("kube-system", patterns) and enf.excluded("kube-public", patterns)
    assert enf.excluded("kubevirt", patterns) and enf.excluded("vmquota-system", patterns)
    assert not enf.excluded("tenant-a", patterns) and not enf.excluded("kubevirt-tenant", patterns)
    assert not enf.excluded("kube-system", ())


@pytest.mark.parametrize(
    ("budget", "why"),
    [
        ('{"limits.memroy":"64Gi"}', "'limits.memroy' is not a ResourceQuota resource name"),
        ('{"limits.mémoire":"64Gi"}', "'limits.mémoire' is not a ResourceQuota resource name"),
        ('{"requests.nvidia.com/gpu":"2","a/b/c":"1"}', "'a/b/c' is not a ResourceQuota resource name"),
        (json.dumps({f"count/r{i}.example.com": "1" for i in range(129)}), "names 129 resources, more than the 128"),
    ],
)
def test_a_budget_that_names_no_quota_resource_is_refused(budget: str, why: str) -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})
    raw["metadata"]["annotations"][BUDGET_ANNOTATION] = budget
    p = enf.plan(snap(raw), usage({}))
    assert p.action is Action.REFUSE and why in (p.annotations[STATUS_ANNOTATION] or ""), p.annotations
    assert not any("memroy" in r or "/b/" in r or "mémoire" in r for r in p.hard_after)


def test_budget_names_kubernetes_accepts() -> None:
    ok = {
        "limits.memory": "1",
        "requests.cpu": "1",
        "pods": "1",
        "count/pods": "1",
        "hugepages-2Mi": "1",
        "requests.hugepages-1Gi": "1",
        "requests.nvidia.com/gpu": "1",
        "gold.storageclass.storage.k8s.io/requests.storage": "1",
        "requests.memory/vmi": "1",
    }
    raw = adopted(ok, ok)
    assert enf.plan(snap(raw), usage({})).action is not Action.REFUSE


def test_a_quota_that_was_never_ours_is_left_alone() -> None:
    raw = raw_quota({"limits.memory": "64Gi"}, labels={}, annotations={"other/annotation": "x"})
    p = enf.plan(snap(raw), usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "90Gi"})}))
    assert p.action is Action.NONE and not p.changes


# ---- reports -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amount", "resource", "text"),
    [
        ("17405661185", "limits.memory", "16.2Gi"),
        ("16Gi", "limits.memory", "16Gi"),
        ("1536Mi", "requests.memory", "1.5Gi"),
        ("100", "limits.memory", "100"),
        ("1500m", "limits.cpu", "1500m"),
        ("3", "pods", "3"),
        ("2Ti", "requests.storage", "2Ti"),
    ],
)
def test_human_quantity(amount: str, resource: str, text: str) -> None:
    assert enf.human_quantity(Quantity.parse(amount), resource) == text


def test_reason_names_several_migrations_and_resources() -> None:
    raw = adopted({"limits.memory": "4000Mi", "limits.cpu": "3"}, {"limits.memory": "4000Mi", "limits.cpu": "3"})
    migs = [
        contract.MigrationState(name="m2", vmi="vm2", state="pending", reserved={"limits.cpu": "1"}),
        contract.MigrationState(name="m1", vmi="vm1", state="pending", reserved={"limits.cpu": "1"}),
        contract.MigrationState(name="m3", vmi="vm3", state="queued"),
    ]
    u = usage(
        {
            "compute": terms(
                {"limits.memory": "4000Mi", "limits.cpu": "3"}, {"limits.memory": "7146Mi", "limits.cpu": "5"}
            )
        },
        migs,
    )
    p = enf.plan(snap(raw), u)
    assert p.reason == ("raised limits.cpu by 2, raised limits.memory by 3.1Gi for the migrations of vm1 and vm2")


def test_event_and_decision_bodies() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "80.5Gi"})}, MIGRATING, seq=42)
    p = enf.plan(snap(raw), u)
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    ev = reports.event_body(p, identity="pod-1", now=now)
    assert ev["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "namespace": NS,
        "name": "compute",
        "uid": "q-uid-1",
    }
    assert (ev["reason"], ev["type"], ev["message"]) == ("QuotaAdjusted", "Normal", p.reason)
    assert ev["lastTimestamp"] == "2026-01-02T03:04:05Z" and ev["metadata"]["name"].startswith("compute.")
    d = reports.decision(p, cluster="c1", dry_run=False, resource_version="11")
    assert d.id == "c1/decision/q-uid-1/11" and d.usage_seq == 42 and not d.dry_run
    assert (d.hard_before, d.hard_after, d.budget) == (
        {"limits.memory": "64Gi"},
        {"limits.memory": "82432Mi"},
        {"limits.memory": "64Gi"},
    )
    assert contract.decode_decision(contract.encode(d)) == d
    dry = reports.decision(p, cluster="c1", dry_run=True)
    assert dry.dry_run and dry.id.startswith("c1/decision/q-uid-1/10/dry-run-")
    assert not d.status_only


def test_a_status_hard_written_alone_is_a_decision_from_what_it_wrote_over() -> None:
    """The enforcer wrote ``status.hard``, and its ``spec.hard`` met a newer version: the decision records the raise
    in effect, from the ``status.hard`` it wrote over, and its Event says where the raise is."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    raw["status"] = {"hard": {"limits.memory": "60Gi"}, "used": {"limits.memory": "60Gi"}}
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})}, MIGRATING)
    p = enf.plan(snap(raw), u)
    assert p.set_status and p.set_hard
    only = p.status_written()
    d = reports.decision(only, cluster="c1", dry_run=False, resource_version="12")
    assert d.status_only and (d.hard_before, d.hard_after) == ({"limits.memory": "60Gi"}, {"limits.memory": "80Gi"})
    assert d.reason == p.reason and contract.decode_decision(contract.encode(d)) == d
    ev = reports.event_body(only, identity="pod-1", now=datetime(2026, 1, 2, tzinfo=UTC))
    assert ev["message"] == p.reason + reports.STATUS_ONLY_NOTE


def test_check_usage_refuses_malformed_terms() -> None:
    enf.check_usage(usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})}))
    with pytest.raises(InvalidInput, match=r"usage tenant-a: quotas.compute.hard.limits.memory"):
        enf.check_usage(usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "lots"})}))
    with pytest.raises(InvalidInput, match="unknown accounting mode"):
        enf.check_usage(usage({"compute": terms({}, {}, mode="Nope")}))


# ---- properties ----------------------------------------------------------------------------------------------

RESOURCES = ["limits.memory", "requests.cpu", "pods", "limits.cpu"]
amounts = st.sampled_from(["0", "1", "500m", "2", "1Gi", "1536Mi", "16Gi", "17405661185", "64Gi"])
lists = st.dictionaries(st.sampled_from(RESOURCES), amounts, max_size=4)


@st.composite
def quota_states(draw: st.DrawFn) -> tuple[dict[str, Any], contract.UsageSnapshot | None]:
    """Any state a quota can be in: labelled or not, adopted or not, foreign-written or not, any usage."""
    hard = draw(lists)
    labels = draw(st.sampled_from([MANAGED, {}, {MANAGED_LABEL: "false"}]))
    ann: dict[str, str] = {}
    if draw(st.booleans()):
        ann[BUDGET_ANNOTATION] = json.dumps(draw(lists))
    if draw(st.booleans()):
        ann[LAST_HARD_ANNOTATION] = json.dumps(draw(st.one_of(st.just(hard), lists)))
    if draw(st.booleans()):
        ann[STATUS_ANNOTATION] = draw(st.sampled_from(["Enforcing (VmiPodUsage)", "Refused: x"]))
    if draw(st.booleans()):
        ann[MODE_ANNOTATION] = draw(st.sampled_from(["VmiPodUsage", "VirtualResources", "Bogus"]))
    spec_extra = {"scopes": ["NotTerminating"]} if draw(st.integers(0, 9)) == 0 else None
    raw = raw_quota(hard, labels=labels, annotations=ann, spec_extra=spec_extra)
    u = None
    if draw(st.booleans()):
        mode = ann.get(MODE_ANNOTATION, "VmiPodUsage")
        budget = draw(st.one_of(lists, st.just(json.loads(ann.get(BUDGET_ANNOTATION, json.dumps(hard))))))
        u = usage({"compute": terms(budget, draw(lists), mode=mode if mode != "Bogus" else "VmiPodUsage")})
    return raw, u


@settings(max_examples=300, deadline=None)
@given(quota_states())
def test_plan_reaches_a_fixed_point_in_one_write(state: tuple[dict[str, Any], contract.UsageSnapshot | None]) -> None:
    raw, u = state
    p = enf.plan(snap(raw), u)
    if not p.changes:
        return
    body = enf.patch_body(p)
    assert set(body) <= {"metadata", "spec"} and set(body["metadata"]) <= {"resourceVersion", "annotations"}
    assert set(body.get("spec", {})) <= {"hard"}, "never anything but spec.hard"
    assert set(body["metadata"].get("annotations", {})) <= set(enf.OWN_ANNOTATIONS)
    # (the enforcer's writes of a plan: ``status.hard`` first where it sets it, a raise of an adopted quota's the
    # quota controller had synced; then the patch. Applying the patch alone left a plan that sets it changing again)
    after = write(raw, p)
    assert after["metadata"]["labels"] == raw["metadata"]["labels"]
    assert after["status"].get("used") == raw["status"].get("used"), "never status.used"
    assert p.set_status or after["status"] == raw["status"], "status.hard only where the plan sets it"
    again = enf.plan(snap(after), u)
    assert not again.changes, (p, again)


@settings(max_examples=200, deadline=None)
@given(quota_states(), st.booleans())
def test_what_is_written_does_not_depend_on_memory_of_the_past(
    state: tuple[dict[str, Any], contract.UsageSnapshot | None], remember: bool
) -> None:
    """A restarted enforcer (no previous usage) writes exactly what a running one writes; only the words differ."""
    raw, u = state
    previous = usage({"compute": terms({"limits.memory": "1Gi"}, {})}, MIGRATING, seq=1) if remember else None
    a, b = enf.plan(snap(raw), u, previous), enf.plan(snap(raw), u)
    assert (a.action, a.set_hard, a.hard_after, dict(a.annotations)) == (
        b.action,
        b.set_hard,
        b.hard_after,
        dict(b.annotations),
    )


def test_a_usage_snapshot_may_not_ask_for_more_than_budget_pods_and_reserved() -> None:
    """``hard = k * max(B - U, 0) + P - D + S`` with ``k <= 1``: anything above ``B + P + S`` is no result of the
    equation (a forged snapshot), and a resource outside the budget is not either."""
    ok = contract.QuotaTerms(
        mode="VmiPodUsage",
        budget={"limits.memory": "64Gi"},
        pods={"limits.memory": "70Gi"},
        reserved={"limits.memory": "16Gi"},
        hard={"limits.memory": "150Gi"},
    )
    enf.check_usage(usage({"compute": ok}))
    with pytest.raises(InvalidInput, match=r"exceeds budget \+ pods \+ reserved = 150Gi"):
        enf.check_usage(usage({"compute": msgspec.structs.replace(ok, hard={"limits.memory": "151Gi"})}))
    with pytest.raises(InvalidInput, match="which the budget does not"):
        enf.check_usage(usage({"compute": msgspec.structs.replace(ok, hard={"limits.memory": "1Gi", "pods": "9"})}))


def test_the_usage_annotation_rides_on_hard_writes_and_alone_is_a_refresh() -> None:
    """``vmquota.io/usage`` says, in readable units, what the quota is used for; it is written with a ``spec.hard``
    write; out of date alone, it is a refresh (which the enforcer paces), and it is removed on release."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    t = terms(
        {"limits.memory": "64Gi"},
        {"limits.memory": "81604378625"},
        used={"limits.memory": "52613349376"},
        reserved={"limits.memory": "17405661185"},
    )
    p = enf.plan(snap(raw), usage({"compute": t}, MIGRATING))
    assert p.set_hard
    assert p.annotations[USAGE_ANNOTATION] == (
        "used limits.memory 49Gi/64Gi; reserved limits.memory 16.2Gi; raised for mig-1"
    )
    after = write(raw, p)
    moved = terms(
        {"limits.memory": "64Gi"},
        {"limits.memory": "81604378625"},
        used={"limits.memory": "53613349376"},
        reserved={"limits.memory": "17405661185"},
    )
    refresh = enf.plan(snap(after), usage({"compute": moved}, MIGRATING))
    assert refresh.action is enf.Action.REFRESH and not refresh.set_hard and not refresh.reason
    assert dict(refresh.annotations) == {
        USAGE_ANNOTATION: "used limits.memory 49.9Gi/64Gi; reserved limits.memory 16.2Gi; raised for mig-1"
    }
    assert enf.plan(snap(write(after, refresh)), usage({"compute": moved}, MIGRATING)).action is (enf.Action.NONE)
    after["metadata"]["labels"] = {}
    released = enf.plan(snap(after), None, managed=True)
    assert released.annotations[USAGE_ANNOTATION] is None


def test_re_applying_the_unchanged_manifest_is_no_budget_change() -> None:
    """GitOps re-applies the quota as written (``spec.hard`` = the budget) while vmquota holds ``hard`` raised for a
    migration: the budget did not change, so no Warning ``BudgetChanged`` whose "was" equals the new value; the
    enforced ``hard`` is written back."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"})
    raw["spec"]["hard"] = {"limits.memory": "64Gi"}
    t = terms({"limits.memory": "64Gi"}, {"limits.memory": "80Gi"}, reserved={"limits.memory": "16Gi"})
    p = enf.plan(snap(raw), usage({"compute": t}, MIGRATING))
    assert p.event_reason != enf.BUDGET_CHANGED and p.event_type == "Normal"
    assert p.hard_after == {"limits.memory": Quantity.parse("80Gi")}
    assert "set to the budget again" in p.reason and BUDGET_ANNOTATION not in p.annotations


def test_a_budget_written_back_while_usage_is_missing_is_not_enforced() -> None:
    """GitOps writes the budget back into an enforced VM-term quota's ``spec.hard`` (or a new one) while the
    enforcer has no usage for it (a restart after the namespace's last usage aged out; the ledger not yet caught
    up): the quota keeps that unscaled ``spec.hard`` until usage comes, so it is not enforced meanwhile, and the
    status says so (the reservation guard admits no VMI in VM terms then). Were it left ``Enforcing`` with
    ``last-hard`` written to match, VMs of KubeVirt's own rendering would get past the budget (36 vCPUs on 4)."""
    enforcing = {
        STATUS_ANNOTATION: "Enforcing (VirtualResources)",
        MODE_ANNOTATION: "VirtualResources",
        ENFORCED_BUDGET_ANNOTATION: '{"requests.cpu":"4"}',
    }
    for written in ({"requests.cpu": "4"}, {"requests.cpu": "36"}):
        raw = adopted({"requests.cpu": "4"}, {"requests.cpu": "400m"}, annotations=enforcing)
        raw["spec"]["hard"] = dict(written)
        p = enf.plan(snap(raw), None)
        assert p.annotations[STATUS_ANNOTATION] == "Waiting for usage (VirtualResources)", (written, p.annotations)
    # spec.hard still vmquota's while the usage is missing (a ledger restarting): it stays enforced
    raw = adopted({"requests.cpu": "4"}, {"requests.cpu": "400m"}, annotations=enforcing)
    assert STATUS_ANNOTATION not in enf.plan(snap(raw), None).annotations
    # ... but not once its budget is lowered (annotation vmquota.io/budget): that spec.hard was scaled for 4 vCPUs
    raw = adopted({"requests.cpu": "4"}, {"requests.cpu": "400m"}, annotations=enforcing)
    raw["metadata"]["annotations"][BUDGET_ANNOTATION] = '{"requests.cpu":"1"}'
    assert enf.plan(snap(raw), None).annotations[STATUS_ANNOTATION] == "Waiting for usage (VirtualResources)"
    # usage in the quota's mode and budget records the budget its spec.hard is for
    t = terms({"requests.cpu": "4"}, {"requests.cpu": "400m"}, mode="VirtualResources")
    raw = adopted({"requests.cpu": "4"}, {"requests.cpu": "400m"}, annotations={MODE_ANNOTATION: "VirtualResources"})
    p = enf.plan(snap(raw), usage({"compute": t}))
    assert p.annotations[ENFORCED_BUDGET_ANNOTATION] == '{"requests.cpu":"4"}', p.annotations
    # ... as the budget annotation's text, an administrator's spelling kept: the reservation guard compares the two
    # texts, and admits VMs in VM terms only while they are the same (a budget lowered through the annotation was
    # open at the old one until the enforcer wrote)
    spelled = '{ "requests.cpu": 4 }'
    raw["metadata"]["annotations"][BUDGET_ANNOTATION] = spelled
    p = enf.plan(snap(raw), usage({"compute": t}))
    assert p.annotations[ENFORCED_BUDGET_ANNOTATION] == spelled and BUDGET_ANNOTATION not in p.annotations


def test_last_hard_is_rewritten_in_vmquotas_own_spelling() -> None:
    """The reservation guard reads ``vmquota.io/last-hard``'s text: the same values spelled otherwise (a space, a
    quantity in other units) are rewritten as vmquota writes them, where the budget's spelling is left alone."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    raw["metadata"]["annotations"][LAST_HARD_ANNOTATION] = '{"limits.memory": "65536Mi"}'
    raw["metadata"]["annotations"][BUDGET_ANNOTATION] = '{"limits.memory": "65536Mi"}'
    t = terms({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    p = enf.plan(snap(raw), usage({"compute": t}))
    assert p.annotations[LAST_HARD_ANNOTATION] == '{"limits.memory":"64Gi"}'
    assert BUDGET_ANNOTATION not in p.annotations


def test_a_tenants_many_long_migration_names_do_not_grow_the_usage_annotation() -> None:
    """Migration names are the tenant's: 40 pending migrations with 200-character names keep ``vmquota.io/usage``
    short (five names, then a count), so a tenant cannot grow the quota object with them."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    many = [
        contract.MigrationState(
            name=f"m{i:02d}-" + "x" * 196, vmi=f"vm{i}", state="pending", reserved={"limits.memory": "1Gi"}
        )
        for i in range(40)
    ]
    t = terms({"limits.memory": "64Gi"}, {"limits.memory": "104Gi"}, reserved={"limits.memory": "40Gi"})
    p = enf.plan(snap(raw), usage({"compute": t}, many))
    line = p.annotations[USAGE_ANNOTATION] or ""
    assert line.endswith("and 35 more") and len(line) < 1200, len(line)


def test_a_refused_vm_is_told_which_vms_hold_the_budget_largest_first_and_at_most_five_by_name() -> None:
    from shared.contract import VmState
    from shared.quota.reports import vm_refused_event

    holders = [
        VmState(name=f"vm{i}", state="running" if i % 2 else "admitted", counts={"q": {"limits.memory": f"{i}Gi"}})
        for i in range(1, 9)
    ]
    stopped = VmState(name="big", state="stopped", counts={"q": {"limits.memory": "99Gi"}})
    other_quota = VmState(name="elsewhere", state="running", counts={"other": {"limits.memory": "50Gi"}})
    vm = VmState(name="new", state="refused", reason="pending, does not fit", refused_by={"q": ["limits.memory"]})
    event = vm_refused_event(
        "ns", vm, identity="e1", now=datetime(2026, 1, 1, tzinfo=UTC), others=[*holders, stopped, other_quota, vm]
    )
    assert event["message"] == (
        "VM new is not admitted: does not fit; limits.memory of quota q is held by vm8 8Gi, vm7 7Gi, vm6 6Gi, "
        "vm5 5Gi, vm4 4Gi and 3 more"
    )
    alone = vm_refused_event("ns", vm, identity="e1", now=datetime(2026, 1, 1, tzinfo=UTC))
    assert alone["message"] == "VM new is not admitted: does not fit"


# ---- the quota's own CPU allocation ratio ------------------------------------------------------------------------

RATIO_MODE = "VirtualResourcesWithCPUAllocationRatio"


def _enforced_at_ratio(ratio: str) -> dict[str, Any]:
    """A budget of 4 requests.cpu in the ratio mode, enforced at the quota's own ratio ``ratio``."""
    return adopted(
        {"requests.cpu": "4"},
        {"requests.cpu": "4"},
        annotations={
            MODE_ANNOTATION: RATIO_MODE,
            RATIO_ANNOTATION: ratio,
            STATUS_ANNOTATION: f"Enforcing ({RATIO_MODE}, ratio {ratio})",
            ENFORCED_BUDGET_ANNOTATION: '{"requests.cpu":"4"}',
        },
    )


def _terms_at(ratio: str) -> contract.UsageSnapshot:
    return usage(
        {"compute": terms({"requests.cpu": "4"}, {"requests.cpu": "4"}, mode=RATIO_MODE, cpu_allocation_ratio=ratio)}
    )


def test_usage_accounted_at_another_cpu_allocation_ratio_does_not_enforce_the_quota() -> None:
    """The same budget means another number of vCPUs at another ratio (requests.cpu 4 is 40 vCPUs at 10, 4 at 1):
    usage accounted at the old ratio is not usage for the quota as it is now, so the quota waits for the ledger, and
    the reservation guard admits nothing meanwhile. Before, the mode and budget alone were compared: the quota stayed
    Enforcing over a spec.hard scaled for 40 vCPUs."""
    raw = _enforced_at_ratio("10")
    fixed = enf.plan(snap(raw), _terms_at("10"))
    assert STATUS_ANNOTATION not in fixed.annotations and not fixed.set_hard, "a fixed point at ratio 10"
    raw["metadata"]["annotations"][RATIO_ANNOTATION] = "1"
    p = enf.plan(snap(raw), _terms_at("10"))
    assert p.annotations[STATUS_ANNOTATION] == f"Waiting for usage ({RATIO_MODE}, ratio 1)"
    assert not p.set_hard, "spec.hard waits for usage accounted at the new ratio"
    p = enf.plan(snap(raw), _terms_at("1"))
    assert p.annotations[STATUS_ANNOTATION] == f"Enforcing ({RATIO_MODE}, ratio 1)"
    spelled = _enforced_at_ratio("10")
    spelled["metadata"]["annotations"][RATIO_ANNOTATION] = " 10.0 "  # (by value: the same ratio, respelled)
    assert enf.plan(snap(spelled), _terms_at("10")).annotations[STATUS_ANNOTATION] == (
        f"Enforcing ({RATIO_MODE}, ratio 10.0)"
    )


def test_a_cpu_allocation_ratio_changed_while_usage_is_missing_leaves_the_quota_waiting() -> None:
    """With no usage for the namespace (a ledger restarting), an enforced quota stays Enforcing only for the policy
    its spec.hard was computed for: the status names the ratio, so one changed since is seen without the ledger."""
    raw = _enforced_at_ratio("10")
    assert enf.plan(snap(raw), None).action is enf.Action.NONE
    raw["metadata"]["annotations"][RATIO_ANNOTATION] = "1"
    assert enf.plan(snap(raw), None).annotations[STATUS_ANNOTATION] == f"Waiting for usage ({RATIO_MODE}, ratio 1)"


@pytest.mark.parametrize(
    ("seq", "time", "older"),
    [
        (5, "2026-01-01T00:00:00.000Z", False),  # (the held one again: the same content)
        (4, "2025-12-31T23:59:59.000Z", True),  # (an older one: folded less, published before)
        (5, "2025-12-31T23:59:59.000Z", True),  # (folded as far, published before: time moved its terms)
        (6, "2025-12-31T23:59:59.000Z", False),  # (folded further: an instance whose clock is behind)
        (5, "2026-01-01T00:00:00.001Z", False),  # (the ledger's own republish of the same fold)
        (1, "2026-01-01T00:00:01.000Z", False),  # (the events stream created anew: its sequences start again)
        (4, "not a time", False),
    ],
)
def test_a_usage_snapshot_is_older_when_folded_no_further_and_published_no_later(
    seq: int, time: str, older: bool
) -> None:
    """What the enforcer ignores as a copy of an older snapshot that a reader of the bus had stored after the one it
    holds (``tests/integration/test_enforcer.py -k older_usage``)."""
    held = enf.usage_mark(usage_snapshot("tenant", 5))
    u = msgspec.structs.replace(usage_snapshot("tenant", seq), time=time)
    assert enf.usage_is_older(u, held) is older
    assert not enf.usage_is_older(u, "unreadable"), "a mark that cannot be read holds nothing back"
    assert enf.mark_order(held) == (datetime(2026, 1, 1, tzinfo=UTC), 5)


def test_status_hard_is_written_with_spec_hard_where_the_quota_controller_has_synced_it() -> None:
    """``status.hard`` is what quota admission checks: a plan writes it too, first, with the same ``hard``; only
    for the resources the quota controller has synced (the same names, each with a value in ``status.used``),
    since admission refuses every pod for a limited resource it finds no usage of."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "81Gi"})}, MIGRATING)
    p = enf.plan(snap(raw), u)
    assert p.set_hard and p.set_status
    assert enf.status_body(p) == {"metadata": {"resourceVersion": "10"}, "status": {"hard": {"limits.memory": "81Gi"}}}
    after = write(raw, p)
    assert after["status"] == {"hard": {"limits.memory": "81Gi"}, "used": {"limits.memory": "1Gi"}}
    assert not enf.plan(snap(after), u).changes, "written once"
    assert not p.spec_only().set_status and p.spec_only().set_hard
    unsynced = copy.deepcopy(raw)
    unsynced["status"] = {"hard": {"limits.memory": "64Gi"}, "used": {}}
    assert not enf.plan(snap(unsynced), u).set_status, "no usage for the resource in status.used"
    other = copy.deepcopy(raw)
    other["status"]["hard"]["pods"] = "10"
    other["status"]["used"]["pods"] = "1"
    assert not enf.plan(snap(other), u).set_status, "names the quota controller removes"


@pytest.mark.parametrize("left", ["81Gi", "64Gi"])
def test_a_status_hard_that_is_not_the_spec_hard_written_is_written_again(left: str) -> None:
    """``status.hard`` written and ``spec.hard`` not (the enforcer stopped between the two writes, or the quota
    controller's copy of an older ``spec.hard`` came after ours): the quota controller copies again only when
    ``spec.hard`` changes, or at its resync minutes later, so the enforcer writes it, raised or lowered."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "72Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "72Gi"})}, MIGRATING)
    raw = write(raw, enf.plan(snap(raw), u))  # (the annotations a first write records)
    assert not enf.plan(snap(raw), u).changes
    raw["status"]["hard"] = {"limits.memory": left}
    p = enf.plan(snap(raw), u)
    assert p.action is Action.ADJUST and p.set_status and not p.set_hard and not p.annotations
    verb = "lowered" if left == "81Gi" else "raised"
    assert p.reason == f"{verb} status.hard to spec.hard: limits.memory=72Gi" and p.status_only
    d = reports.decision(p, cluster="c1", dry_run=False, resource_version="12")
    assert (d.hard_before, d.hard_after) == ({"limits.memory": left}, {"limits.memory": "72Gi"}), d
    assert write(raw, p)["status"]["hard"] == {"limits.memory": "72Gi"}
    assert enf.status_astray(snap(raw)), "a version that says so is planned again"


def test_a_repair_that_opens_room_anywhere_says_raised() -> None:
    """``vmquota explain`` takes a decision whose reason starts "lowered" as the end of a migration's room: a repair
    that lowers one resource and raises another opens room, and says so."""
    budget = {"limits.cpu": "8", "limits.memory": "64Gi"}
    raw = adopted(budget, budget)
    u = usage({"compute": terms(budget, budget)})
    raw["status"] = {"hard": dict(budget), "used": {"limits.cpu": "1", "limits.memory": "1Gi"}}
    raw = write(raw, enf.plan(snap(raw), u))
    raw["status"]["hard"] = {"limits.cpu": "10", "limits.memory": "60Gi"}
    p = enf.plan(snap(raw), u)
    assert p.raises and p.status_only and p.reason.startswith("raised status.hard to spec.hard"), p.reason


def test_a_write_of_status_hard_beside_annotations_is_status_only() -> None:
    """``spec.hard`` stays and annotations change: the decision reports the ``status.hard`` admission checks, not
    a ``spec.hard`` that moved nowhere."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "72Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "72Gi"})}, MIGRATING)
    raw = write(raw, enf.plan(snap(raw), u))
    raw["status"]["hard"] = {"limits.memory": "80Gi"}
    raw["metadata"]["annotations"][STATUS_ANNOTATION] = "Waiting for usage (VmiPodUsage)"
    p = enf.plan(snap(raw), u)
    assert p.set_status and not p.set_hard and p.annotations and p.status_only
    d = reports.decision(p, cluster="c1", dry_run=False, resource_version="13")
    assert (d.hard_before, d.hard_after) == ({"limits.memory": "80Gi"}, {"limits.memory": "72Gi"}), d


def test_a_quota_is_astray_only_where_status_hard_names_what_spec_hard_does_at_another_amount() -> None:
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "64Gi"})
    assert not enf.status_astray(snap(raw))
    raw["status"]["hard"] = {"limits.memory": "65536Mi"}
    assert not enf.status_astray(snap(raw)), "the same amount, spelled otherwise"
    raw["status"]["hard"] = {"limits.memory": "64Gi", "pods": "10"}
    assert not enf.status_astray(snap(raw)), "other names: the quota controller's to sync"
    raw["status"]["hard"] = {}
    assert not enf.status_astray(snap(raw)), "not synced yet"


def test_a_write_that_raises_status_hard_is_a_raise() -> None:
    """Quota admission checks ``status.hard``: a plan that raises it (a repair, or a lowering of ``spec.hard`` that
    stays above ``status.hard``) opens room, and goes through the gates of a raise (the read of what the API
    server charges; with the guard, the wait for unconfirmed holders). Compared with ``spec.hard`` alone it did
    not. A plan that does not write ``status.hard`` is as before."""
    raw = adopted({"limits.memory": "64Gi"}, {"limits.memory": "81Gi"})
    u = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "81Gi"})}, MIGRATING)
    raw = write(raw, enf.plan(snap(raw), u))
    raw["status"]["hard"] = {"limits.memory": "64Gi"}
    p = enf.plan(snap(raw), u)
    assert p.set_status and not p.set_hard and p.raises
    lowered = usage({"compute": terms({"limits.memory": "64Gi"}, {"limits.memory": "72Gi"})}, MIGRATING)
    p = enf.plan(snap(raw), lowered)
    assert p.set_hard and p.set_status and p.raises, "spec.hard lowered to 72Gi, status.hard raised from 64Gi"
    assert not enf.plan(snap(raw), lowered, status=False).raises


def test_a_nudge_is_held_while_admission_charges_pods_the_usage_no_longer_counts_and_only_then() -> None:
    """The quota controller uncharges a pod that ended a moment after the ledger hears of it: a nudge sent meanwhile
    was refused, and the VM waited for KubeVirt's backoff (163 s). Held while ``status.used`` is above ``P`` where
    room is reserved; not by the sum of what is reserved against the room: during a migration ``R`` is negative, and
    a first version of the hold kept back a VM that fit natively (one of two admitted) until the migration ended."""
    budget = {"cpu": "4"}

    def quota(hard: str, used: str) -> QuotaSnapshot:
        raw = raw_quota({"cpu": hard})
        raw["status"]["used"] = {"cpu": used}
        return snap(raw)

    # (a running VM, one migrating with both its pods, two VMs admitted: P 3, S 2, hard 4 = P + S + R, R = -1)
    during = terms(budget, {"cpu": "4"}, pods={"cpu": "3"}, reserved={"cpu": "2"})
    assert enf.charged_as_counted(quota("4", "3"), during), "one of the two fits natively: nudge"
    assert not enf.charged_as_counted(quota("4", "4"), during), "a pod that ended is still charged: hold"
    assert enf.charged_as_counted(quota("4", "4"), terms(budget, {"cpu": "4"}, pods={"cpu": "3"})), "none reserved"
    assert enf.charged_as_counted(quota("4", "4"), terms(budget, {"cpu": "4"}, reserved={"cpu": "2"})), "P unknown"
