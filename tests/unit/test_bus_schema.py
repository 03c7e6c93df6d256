"""The bus contract: round-trips, message ids, subjects and validation."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import contract
from shared.errors import InvalidInput
from shared.kinds import CLUSTER_SCOPED_KINDS
from shared.quantity import Quantity
from shared.snapshot import SNAPSHOT_TYPES, PodSnapshot
from shared.text import printable

labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?\Z", fullmatch=True)
kinds = st.sampled_from(sorted(contract.KIND_TOKENS))
rvs = st.integers(min_value=0, max_value=2**62).map(str)
uids = st.uuids().map(str)


def _snapshot(kind: str, name: str, ns: str) -> contract.Snapshot:
    extra: dict[str, Any] = {"vmi_name": "vm"} if kind == "VirtualMachineInstanceMigration" else {}
    snap = SNAPSHOT_TYPES[kind](name=name, namespace="" if kind == "Namespace" else ns, **extra)
    return snap  # type: ignore[return-value]


def _pod_event(**kw: object) -> contract.Upserted | contract.Deleted:
    args: dict[str, object] = {
        "cluster": "east-1",
        "kind": "Pod",
        "namespace": "tenant-a",
        "name": "virt-launcher-vm1-abcde",
        "uid": "7d3f1a0e-0000-4000-8000-000000000001",
        "rv": "1042",
        "snapshot": PodSnapshot(name="virt-launcher-vm1-abcde", namespace="tenant-a", phase="Running"),
    }
    args.update(kw)
    return contract.object_event("upserted", **args)  # type: ignore[arg-type]


@given(cluster=labels, ns=labels, kind=kinds, uid=uids, rv=rvs, deleted=st.booleans())
def test_object_event_round_trip(cluster: str, ns: str, kind: str, uid: str, rv: str, deleted: bool) -> None:
    name = ns if kind == "Namespace" else "obj"
    ev = contract.object_event(
        "deleted" if deleted else "upserted",
        cluster=cluster,
        kind=kind,
        namespace=ns,
        name=name,
        uid=uid,
        rv=rv,
        snapshot=_snapshot(kind, name, ns),
        time="2026-01-01T00:00:00.000Z",
    )
    back = contract.decode_event(contract.encode(ev))
    assert back == ev
    assert type(back) is (contract.Deleted if deleted else contract.Upserted)
    assert back.id == f"{cluster}/{kind}/{uid}/{rv}/{'deleted' if deleted else 'upserted'}"
    subject = contract.event_subject(cluster, kind, ns)
    parsed = contract.parse_event_subject(subject)
    assert parsed.cluster == cluster and parsed.kind == kind
    assert parsed.namespace == (contract.CLUSTER_TOKEN if kind in CLUSTER_SCOPED_KINDS else ns)


@given(cluster=labels, ns=labels, kind=kinds, rv=rvs, present=st.lists(uids, max_size=5))
def test_sync_round_trip(cluster: str, ns: str, kind: str, rv: str, present: list[str]) -> None:
    ev = contract.sync_event(cluster=cluster, kind=kind, namespace=ns, rv=rv, present=present)
    back = contract.decode_event(contract.encode(ev))
    assert isinstance(back, contract.Sync) and back == ev
    assert back.present == sorted(present)
    token = contract.CLUSTER_TOKEN if kind in CLUSTER_SCOPED_KINDS else ns
    assert back.namespace == token
    assert back.id == f"{cluster}/{kind}/ns={token}/{rv}/sync"


def test_wire_names_are_camel_case_and_tagged_by_type() -> None:
    doc = json.loads(contract.encode(_pod_event()))
    assert doc["type"] == "io.vmquota.event.upserted"
    assert doc["resourceVersion"] == "1042"
    assert doc["schema"] == contract.SCHEMA
    assert "resource_version" not in doc


def test_snapshot_quantities_travel_as_canonical_strings() -> None:
    snap = PodSnapshot(
        name="virt-launcher-vm1-abcde", namespace="tenant-a", requests={"memory": Quantity.parse("1024Mi")}
    )
    ev = _pod_event(snapshot=snap)
    raw = contract.encode(ev)
    assert json.loads(raw)["snapshot"]["requests"] == {"memory": "1Gi"}
    back = contract.decode_event(raw)
    assert isinstance(back, contract.Upserted) and back.snapshot == snap
    assert isinstance(back.snapshot, PodSnapshot) and back.snapshot.requests["memory"] == Quantity.parse("1Gi")


def test_unknown_fields_are_allowed() -> None:
    doc = json.loads(contract.encode(_pod_event()))
    doc["addedLater"] = {"x": 1}
    back = contract.decode_event(json.dumps(doc).encode())
    assert isinstance(back, contract.Upserted) and back.uid == "7d3f1a0e-0000-4000-8000-000000000001"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"schema": contract.SCHEMA + 1}, "schema version"),
        ({"cluster": "East_1"}, "cluster id"),
        ({"kind": "Secret"}, "unknown kind"),
        ({"resourceVersion": "abc"}, "resourceVersion"),
        ({"uid": ""}, "empty uid"),
        ({"namespace": "Not A Label"}, "namespace"),
        ({"namespace": "tenant\n"}, "namespace"),
        ({"cluster": "c1\n"}, "cluster id"),
        ({"resourceVersion": "7\n"}, "resourceVersion"),
        ({"type": "io.vmquota.event.renamed"}, "type"),
        ({"snapshot": None}, "snapshot"),
        ({"snapshot": {"kind": "ResourceQuota", "name": "q"}}, "snapshot of kind 'ResourceQuota'"),
        ({"snapshot": {"kind": "Pod", "name": "p", "uid": "other"}}, "snapshot.uid"),
        ({"snapshot": {"kind": "Pod", "name": "p", "requests": {"cpu": "lots"}}}, "snapshot"),
        # (the snapshot's layout has its version: a newer one was folded with its fields' defaults)
        ({"snapshot": {"kind": "Pod", "name": "p", "schema": 2}}, ": snapshot.schema: schema version 2"),
    ],
)
def test_invalid_events_name_the_field(change: dict[str, object], needle: str) -> None:
    doc = json.loads(contract.encode(_pod_event()))
    doc.update(change)
    with pytest.raises(InvalidInput) as e:
        contract.decode_event(json.dumps(doc).encode())
    assert needle in str(e.value)


def test_a_newer_schema_is_refused_naming_the_object() -> None:
    """A dead letter's reason says what is wrong and where: a newer schema's named no object."""
    ev = _pod_event()
    doc = json.loads(contract.encode(ev))
    doc["schema"] = contract.SCHEMA + 1
    with pytest.raises(InvalidInput) as e:
        contract.decode_event(json.dumps(doc).encode())
    assert str(e.value).startswith(f"Pod {ev.namespace}/{ev.name}: schema: schema version {contract.SCHEMA + 1} "), e


def test_not_json_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="not a JSON event"):
        contract.decode_event(b"\x00garbage")


def test_a_name_with_a_line_break_after_it_is_no_name() -> None:
    """Every check was a pattern ending in ``$``, which Python lets match before a last newline: ``tenant\\n`` passed
    for a namespace (then a token of the subjects the services publish to), a relist token or a quota resource
    name."""
    from shared.resources import is_qualified_name, is_quota_resource_name

    for check in (contract.check_namespace, contract.check_cluster):
        with pytest.raises(InvalidInput):
            check("tenant\n")
    with pytest.raises(InvalidInput):
        contract.decode_relist_request(contract.encode(contract.RelistRequest(token="loss-7\n", requester="x")))
    assert not is_qualified_name("limits.memory\n") and not is_quota_resource_name("limits.memory\n")


@pytest.mark.parametrize("cluster", ["", "A", "-a", "a-", "a.b", "a" * 64, "a_b", 7, "c1\n"])
def test_cluster_ids_must_be_dns_labels(cluster: object) -> None:
    with pytest.raises(InvalidInput) as e:
        contract.check_cluster(cluster)
    assert e.value.where == "cluster"
    assert "DNS label" in str(e.value)


def test_subjects() -> None:
    assert contract.event_subject("c1", "VirtualMachineInstance", "ns") == "vmquota.ev.c1.ns.vmi"
    assert contract.event_subject("c1", "Namespace", "ns") == "vmquota.ev.c1._cluster.namespace"
    assert contract.event_subject("c1", "KubeVirt", "kubevirt") == "vmquota.ev.c1._cluster.kubevirt"
    assert contract.usage_subject("c1", "ns") == "vmquota.usage.c1.ns"
    assert contract.decision_subject("c1", "ns") == "vmquota.quota.c1.ns"
    assert contract.dlq_subject("ledger") == "vmquota.dlq.ledger._._"
    assert contract.dlq_subject("watcher", "c1", "tenant-a") == "vmquota.dlq.watcher.c1.tenant-a"
    assert contract.dlq_subject("watcher", "c1", "_cluster") == "vmquota.dlq.watcher.c1._cluster"
    # (a token that is not a name cannot reach the subject: no wildcard, no extra token)
    assert contract.dlq_subject("ledger", "c.*", "a.>") == "vmquota.dlq.ledger._._"
    assert contract.subject_scope("vmquota.ev.c1.tenant-a.pod") == ("c1", "tenant-a")
    assert contract.subject_scope("vmquota.usage.c1.tenant-a") == ("c1", "tenant-a")
    assert contract.subject_scope("vmquota.quota.c1.tenant-a") == ("", "")
    assert contract.events_filter("c1") == "vmquota.ev.c1.>"
    with pytest.raises(InvalidInput):
        contract.usage_subject("c1", "a.b")
    with pytest.raises(InvalidInput):
        contract.parse_event_subject("vmquota.ev.c1.ns.secret")


def test_every_stream_owns_its_subjects() -> None:
    specs = contract.streams(events_max_age=3600.0)
    subjects = [s for spec in specs for s in spec.subjects]
    assert len(subjects) == len(set(subjects))
    by_name = {s.name: s for s in specs}
    assert by_name[contract.EVENTS_STREAM].max_age == 3600.0
    assert by_name[contract.EVENTS_STREAM].duplicate_window <= 3600.0
    assert by_name[contract.USAGE_STREAM].max_msgs_per_subject == 1


def test_each_service_creates_the_streams_it_owns_and_waits_for_the_rest() -> None:
    # what the NATS configurations let each identity create (tests/integration/test_nats_permissions.py) is what
    # the service creates
    for service in contract.STREAMS_USED:
        names = {s.name for s in contract.streams_for(service)}
        assert names == contract.STREAM_OWNERS.get(service, frozenset()), service
    assert {s.name for s in contract.streams_for("all")} == {s.name for s in contract.streams()}


@pytest.mark.parametrize(
    ("text", "seconds"), [("30d", 30 * 86400.0), ("1h30m", 5400.0), ("500ms", 0.5), ("90", 90.0), ("2w", 1209600.0)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert contract.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "x", "10y", "-5", "5d3", "d"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(InvalidInput):
        contract.parse_duration(text)


def test_usage_decision_and_dead_letter_round_trip() -> None:
    usage = contract.UsageSnapshot(
        id="u",
        source="vmquota/ledger/c1",
        subject="ns",
        time="t",
        cluster="c1",
        namespace="ns",
        seq=42,
        quotas={
            "q": contract.QuotaTerms(mode="VirtualResources", used={"requests.memory": "16Gi"}, reserved={"pods": "1"})
        },
        vms=[contract.VmState(name="vm1", state="refused", refused_by={"q": ["requests.memory"]})],
        migrations=[contract.MigrationState(name="mig", vmi="vm1", phase="Scheduling", reserved={"pods": "1"})],
    )
    assert contract.decode_usage(contract.encode(usage)) == usage
    decision = contract.Decision(
        id="d", source="s", subject="ns/q", time="t", cluster="c1", namespace="ns", quota="q", mode="VmiPodUsage"
    )
    assert contract.decode_decision(contract.encode(decision)) == decision
    letter = contract.DeadLetter(
        id="x", source="s", subject="s", time="t", cluster="c1", service="ledger", reason="r", payload=b"\xff\x00"
    )
    raw = contract.encode(letter)
    assert json.loads(raw)["payload"] == "/wA="  # base64 on the wire: any payload survives
    assert contract.decode_dead_letter(raw) == letter
    with pytest.raises(InvalidInput):
        contract.decode_usage(b"{}")


@given(st.text(max_size=2000))
def test_a_dead_letter_reason_header_is_one_line_of_at_most_512_characters(reason: str) -> None:
    """A NATS client prints headers as they are: nothing in one may move an operator's cursor or recolour the
    terminal (an Event's name and message, which a tenant writes, are in the reason)."""
    letter, headers = contract.dead_letter("ledger", reason, cluster="c1", original_subject="vmquota.ev.c1.a.pod")
    header = headers["Vmquota-Reason"]
    assert header.isprintable() and len(header) <= 512
    assert header == printable(reason)[:512]
    assert letter.reason == reason, "the letter keeps the whole reason"
    assert contract.decode_dead_letter(contract.encode(letter)) == letter


def test_a_dead_letter_names_what_it_is_about() -> None:
    letter, _ = contract.dead_letter(
        "enforcer", "bad", cluster="c1", original_subject="vmquota.usage.c1.a", stream="S", stream_seq=7, msg_id="m"
    )
    assert (letter.id, letter.source, letter.subject) == ("m", "vmquota/enforcer/c1", "vmquota.usage.c1.a")
    assert (letter.service, letter.stream, letter.stream_seq) == ("enforcer", "S", 7)
    other, _ = contract.dead_letter("watcher", "bad", subject="a/vm1", time="2026-01-01T00:00:00Z")
    assert other.subject == "a/vm1" and other.source == "vmquota/watcher/-"
    assert other.id == "dlq/watcher/-/2026-01-01T00:00:00Z", "no deduplication id: one made from the time"


def test_structs_are_immutable() -> None:
    ev = _pod_event()
    with pytest.raises((AttributeError, TypeError)):
        ev.uid = "other"  # type: ignore[misc]
    assert isinstance(ev, msgspec.Struct)


@pytest.mark.parametrize(
    ("snapshot", "field"),
    [
        (PodSnapshot(name="virt-launcher-vm1-abcde", namespace="tenant-b", phase="Running"), "snapshot.namespace"),
        (PodSnapshot(name="another-pod", namespace="tenant-a", phase="Running"), "snapshot.name"),
    ],
)
def test_snapshot_must_describe_the_object_the_event_names(snapshot: PodSnapshot, field: str) -> None:
    """A snapshot of another object would be folded under the wrong key: refused with the field named."""
    with pytest.raises(InvalidInput, match=field):
        contract.decode_event(contract.encode(_pod_event(snapshot=snapshot)))
