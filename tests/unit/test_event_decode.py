"""``contract.decode_event`` reads events with a fast path (``decode_event_fast``: a pod's resource lists and a VMI's
spec read as JSON text, each distinct text decoded once) and falls back to the plain decoder (``decode_event_plain``)
on what the fast path does not take. Both give the same events, quantities printed the same way; and
``decode_event`` gives what it gives without the fast path: the same event or the same error. ``snapshot.decode``
reads a snapshot alone the same way."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Literal
from unittest import mock

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from shared import contract, snapshot
from shared.contract import codec as contract_codec
from shared.errors import InvalidInput
from shared.ledger.fold import Ledger, PartitionSet
from shared.quantity import Quantity
from shared.snapshot import PodSnapshot, VmiMigrationState, VmiSnapshot, fastpath
from shared.snapshot import codec as snapshot_codec
from tests.benchmarks.bench_memory import events_of, vm_objects

# ---- generated events ---------------------------------------------------------------------------------------------

_QUANTITY = st.sampled_from(["1", "100m", "1000m", "0.5", "1Gi", "1024Mi", "1073741824", "1e3", "50M", "0"])
_BAD_QUANTITY = st.sampled_from(["lots", "-1", "", "1.2.3", "1Qi"])
_JSON_SCALAR = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8)
)
_JSON = st.recursive(
    _JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
_RESOURCE_NAMES = st.sampled_from(
    ["cpu", "memory", "pods", "ephemeral-storage", "requests.cpu", "limits.memory", "devices.kubevirt.io/kvm"]
)
_RESOURCES = st.dictionaries(_RESOURCE_NAMES, _QUANTITY | st.integers(0, 64), max_size=6)
_SPEC = st.sampled_from(
    [
        {},
        {"domain": {"cpu": {"sockets": 2, "cores": 1, "threads": 1}, "memory": {"guest": "4Gi"}}},
        {
            "domain": {"memory": {"guest": "2Gi"}, "devices": {"disks": [{}, {}], "interfaces": [{}]}},
            "networks": [{}],
            "volumes": [{"name": "rootdisk", "containerDisk": {}}, {"name": "cloudinitdisk"}],
        },
        {"domain": {"resources": {"requests": {"memory": "1Gi"}}}, "architecture": "amd64"},
    ]
) | st.dictionaries(st.sampled_from(["domain", "volumes", "networks", "other"]), _JSON, max_size=3)


@st.composite
def _pod(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "Pod", "name": "virt-launcher-vm1-abcde", "namespace": "tenant-a"}
    for field in ("requests", "limits", "usage"):
        if draw(st.booleans()):
            doc[field] = draw(_RESOURCES)
    if draw(st.booleans()):
        doc["labels"] = {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": "u-vmi"}
    if draw(st.booleans()):
        doc["memoryOverhead"] = draw(_QUANTITY)
    doc["phase"] = draw(st.sampled_from(["", "Running", "Pending"]))
    return doc


@st.composite
def _vmi(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "VirtualMachineInstance", "name": "virt-launcher-vm1-abcde", "namespace": "tenant-a"}
    if draw(st.booleans()):
        doc["spec"] = draw(_SPEC)
    for field in ("requests", "limits"):
        if draw(st.booleans()):
            doc[field] = draw(_RESOURCES)
    if draw(st.booleans()):
        doc["guestMemory"] = draw(_QUANTITY)
    if draw(st.booleans()):
        doc["labels"] = {"kubevirt.io/vm": "vm1", "note": "x" * draw(st.sampled_from([3, 80]))}
    return doc


_OTHER: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [
        {"kind": "VirtualMachine", "name": "virt-launcher-vm1-abcde", "namespace": "tenant-a", "guestMemory": "1Gi"},
        {"kind": "ResourceQuota", "name": "virt-launcher-vm1-abcde", "namespace": "tenant-a", "specHard": {"pods": 3}},
    ]
)


@st.composite
def _snapshot(draw: st.DrawFn) -> dict[str, Any]:
    snap: dict[str, Any] = dict(draw(_pod() | _vmi() | _OTHER))
    if draw(st.integers(0, 3)) == 0:  # malformed: a field of the snapshot replaced by anything
        field = draw(st.sampled_from(["requests", "limits", "usage", "spec", "memoryOverhead", "labels", "kind"]))
        snap[field] = draw(_JSON | _BAD_QUANTITY | st.dictionaries(_RESOURCE_NAMES, _BAD_QUANTITY, min_size=1))
    return snap


def _json(doc: Any, compact: bool) -> bytes:
    return json.dumps(doc, separators=(",", ":") if compact else None).encode()


@st.composite
def _event(draw: st.DrawFn) -> bytes:
    snap = draw(_snapshot())
    kind = snap["kind"] if isinstance(snap["kind"], str) else "Pod"
    doc: dict[str, Any] = {
        "type": draw(st.sampled_from(["io.vmquota.event.upserted", "io.vmquota.event.deleted"])),
        "id": "c1/Pod/u-1/7/upserted",
        "source": "vmquota/watcher/c1",
        "subject": "tenant-a/virt-launcher-vm1-abcde",
        "time": "2026-01-01T00:00:00Z",
        "cluster": "c1",
        "kind": kind,
        "namespace": "tenant-a",
        "name": "virt-launcher-vm1-abcde",
        "uid": "u-1",
        "resourceVersion": "7",
    }
    if doc["type"] == "io.vmquota.event.upserted" or draw(st.booleans()):
        doc["snapshot"] = snap
    return _json(doc, draw(st.booleans()))


def _without_the_fast_path(data: bytes) -> contract.ObjectEvent:
    with mock.patch.object(contract, "decode_event_fast", side_effect=ValueError("no fast path")):
        return contract.decode_event(data)


def _outcome(decode: Any, data: bytes) -> tuple[str, Any]:
    try:
        ev = decode(data)
    except InvalidInput as e:
        return ("invalid", str(e))
    return ("event", (ev, contract.encode(ev)))


@settings(max_examples=400)
@given(_event())
def test_the_fast_path_gives_what_the_plain_decoder_gives(data: bytes) -> None:
    try:
        plain = contract.decode_event_plain(data)
    except InvalidInput:
        event("refused")
        with pytest.raises(Exception):  # noqa: B017  (whatever it raises: decode_event asks the plain decoder)
            contract.decode_event_fast(data)
        return
    event(f"read: {type(getattr(plain, 'snapshot', None)).__name__}")
    fast = contract.decode_event_fast(data)  # (every event the plain decoder takes: no fallback)
    assert type(fast) is type(plain) and fast == plain
    assert type(getattr(fast, "snapshot", None)) is type(getattr(plain, "snapshot", None))
    assert contract.encode(fast) == contract.encode(plain), "quantities printed the same way"


@settings(max_examples=400)
@given(_event())
def test_decode_event_gives_the_same_event_or_the_same_error_without_the_fast_path(data: bytes) -> None:
    assert _outcome(contract.decode_event, data) == _outcome(_without_the_fast_path, data)


@settings(max_examples=300)
@given(_snapshot(), st.booleans())
def test_a_snapshot_alone_decodes_as_the_plain_decoder_decodes_it(doc: dict[str, Any], compact: bool) -> None:
    data = _json(doc, compact)
    try:
        plain = snapshot_codec._DECODER.decode(data)
    except msgspec.DecodeError as e:  # (a ValidationError too; not JSON at all when a float is infinite)
        with pytest.raises(type(e)) as refused:
            snapshot.decode(data)
        assert type(refused.value) is type(e) and str(refused.value) == str(e)
        return
    got = snapshot.decode(data)
    assert type(got) is type(plain) and got == plain and snapshot.encode(got) == snapshot.encode(plain)


@pytest.mark.parametrize(
    "change",
    [
        {"requests": None},
        {"requests": 5},
        {"requests": {"cpu": "lots"}},
        {"usage": {"memory": -1}},
        {"limits": [1, 2]},
        {"memoryOverhead": "lots"},
        {"labels": {"a": 1}},
    ],
)
def test_malformed_pods_are_refused_with_the_plain_decoders_words(change: dict[str, Any]) -> None:
    ev = next(e for e in events_of(vm_objects(1)) if b'"kind":"Pod"' in e)
    doc = json.loads(ev)
    doc["snapshot"].update(change)
    data = json.dumps(doc).encode()
    with pytest.raises(InvalidInput) as plain:
        contract.decode_event_plain(data)
    with pytest.raises(InvalidInput) as got:
        contract.decode_event(data)
    assert str(got.value) == str(plain.value) and "$.snapshot." in str(got.value)


@pytest.mark.parametrize("spec", [None, 5, "x", [1], {"domain": {"memory": {"guest": 1e400}}}])
def test_malformed_vmi_specs_are_refused_with_the_plain_decoders_words(spec: Any) -> None:
    ev = next(e for e in events_of(vm_objects(1)) if b'"kind":"VirtualMachineInstance"' in e)
    data = ev.replace(b'"spec":{', b'"spec":' + json.dumps(spec).encode() + b',"was":{', 1)
    assert _outcome(contract.decode_event, data) == _outcome(_without_the_fast_path, data)


def test_pods_of_one_size_and_vmis_of_one_template_share_what_they_carry() -> None:
    events = events_of([o for i in (0, 4) for o in vm_objects(i)])  # (the same size and template)
    snaps = [ev.snapshot for ev in map(contract.decode_event, events) if isinstance(ev, contract.Upserted)]
    a, b = (s for s in snaps if isinstance(s, PodSnapshot))
    assert a.requests and a.requests is b.requests and a.limits is b.limits and a.usage is b.usage
    plain = contract.decode_event_plain(next(e for e in events if b'"kind":"Pod"' in e))
    assert isinstance(plain, contract.Upserted) and isinstance(plain.snapshot, PodSnapshot)
    assert plain.snapshot == a and plain.snapshot.requests == a.requests, "(sharing is the fast path's alone)"
    x, y = (s for s in snaps if isinstance(s, VmiSnapshot))
    assert x.spec and x.spec is y.spec and snapshot.compact_vmi_spec(x.spec) is x.spec


def test_the_memos_are_bounded() -> None:
    pod = json.loads(next(e for e in events_of(vm_objects(1)) if b'"kind":"Pod"' in e))
    for n in range(fastpath._MEMO_ENTRIES + 10):
        pod["snapshot"]["requests"] = {"cpu": f"{n + 1}m"}
        contract.decode_event(json.dumps(pod).encode())
        assert len(fastpath._POD_LISTS) <= fastpath._MEMO_ENTRIES
    pod["snapshot"]["requests"] = {f"example.com/r{n}": "1" for n in range(400)}  # (a long text: not remembered)
    before = dict(fastpath._POD_LISTS)
    contract.decode_event(json.dumps(pod).encode())
    assert before == fastpath._POD_LISTS


def test_a_fold_is_the_same_with_and_without_the_fast_path() -> None:
    events = events_of([o for i in range(60) for o in vm_objects(i)])
    fast, plain = Ledger(PartitionSet.all(1)), Ledger(PartitionSet.all(1))
    for seq, data in enumerate(events, 1):
        fast.apply_bytes(data, seq)
        with mock.patch.object(contract, "decode_event_fast", side_effect=ValueError("no fast path")):
            plain.apply_bytes(data, seq)
    assert fast.fingerprint() == plain.fingerprint()
    for key, st_ in fast.states.items():
        assert st_.live_objects() == plain.states[key].live_objects()


def test_the_wire_variants_read_every_field_of_what_they_stand_for() -> None:
    """A field added to a snapshot or an event is read by the fast path too (or this fails)."""
    pairs: list[tuple[type[msgspec.Struct], Any]] = [
        (PodSnapshot, fastpath._WirePod),
        (VmiSnapshot, fastpath._WireVmi),
        (contract.Upserted, contract_codec._WireUpserted),
        (contract.Deleted, contract_codec._WireDeleted),
    ]
    for public, wire in pairs:
        names = [(f.name, f.encode_name) for f in msgspec.structs.fields(public)]
        assert [(f.name, f.encode_name) for f in msgspec.structs.fields(wire)] == names
        assert wire.__struct_config__.tag == public.__struct_config__.tag


def _non_default(tp: Any, name: str) -> Any:
    """A value of type ``tp`` that no field has by default (each field's own: a forgotten one shows)."""
    if tp is str:
        return f"v-{name}"
    if tp is bool:
        return True
    if tp is int or tp == (int | None):
        return 3 + len(name)
    if tp == (datetime | None):
        return datetime(2026, 1, 2, 3, 4, len(name), tzinfo=UTC)
    if tp == (Quantity | None):
        return Quantity.parse(f"{len(name)}Mi")
    if tp == dict[str, str]:
        return {"k": f"v-{name}"}
    if tp == dict[str, Quantity]:
        return {"cpu": Quantity.parse(f"{len(name)}00m"), "memory": Quantity.parse("1Gi")}
    if tp == dict[str, Any]:
        return {"domain": {"memory": {"guest": f"{len(name)}Gi"}}}
    if tp == (VmiMigrationState | None):
        return VmiMigrationState(migration_uid=f"m-{name}", completed=True)
    if tp == tuple[int, ...]:
        return (1, len(name))
    raise AssertionError(f"no value for {tp} ({name})")


@pytest.mark.parametrize("tp", [PodSnapshot, VmiSnapshot])
@pytest.mark.parametrize("type_", ["upserted", "deleted"])
def test_every_field_is_read_by_the_fast_path(tp: type[msgspec.Struct], type_: Literal["upserted", "deleted"]) -> None:
    """A field added to a snapshot or an event and forgotten by the fast path's builders fails this."""
    values = {f.name: _non_default(f.type, f.name) for f in msgspec.structs.fields(tp)}
    values.update(namespace="tenant-a", name="vm1", uid="u-1")
    snap = tp(**values)
    ev = contract.object_event(
        type_,
        cluster="c1",
        kind=str(tp.__struct_config__.tag),
        namespace="tenant-a",
        name="vm1",
        uid="u-1",
        rv="7",
        snapshot=snap,  # type: ignore[arg-type]
    )
    data = contract.encode(ev)
    fast, plain = contract.decode_event_fast(data), contract.decode_event_plain(data)
    assert fast == plain and contract.encode(fast) == contract.encode(plain) == data
    assert isinstance(fast, contract.Upserted | contract.Deleted) and fast.snapshot == snap


def test_a_body_that_belongs_on_another_subject_is_refused_by_every_reader() -> None:
    """A credential may publish on its own cluster's subjects only; a body of another cluster, namespace or kind on
    them is refused by the ledger, and was folded by `vmquota replay` (``Ledger.apply_bytes``) all the same."""
    from tests import builders

    ev = builders.namespace_event("c1", "ns1", "u1", "10")
    data = contract.encode(ev)
    right = contract.event_subject("c1", "Namespace", "")
    assert contract.decode_event_on(right, data) == ev
    Ledger().apply_bytes(data, 1, right)
    for wrong in (contract.event_subject("c2", "Namespace", ""), "vmquota.ev.c1._cluster.kubevirt"):
        with pytest.raises(InvalidInput, match=f"published on {wrong}, but the event belongs on {right}"):
            contract.decode_event_on(wrong, data)
        with pytest.raises(InvalidInput, match="belongs on"):
            Ledger().apply_bytes(data, 1, wrong)
    d = builders.decision("tenant-a")
    assert contract.decode_decision_on("vmquota.quota.c1.tenant-a", contract.encode(d)) == d
    with pytest.raises(InvalidInput, match=r"the decision belongs on vmquota\.quota\.c1\.tenant-a"):
        contract.decode_decision_on("vmquota.quota.c1.tenant-b", contract.encode(d))
    u = builders.usage_snapshot("tenant-a")
    on = contract.usage_subject(u.cluster, u.namespace)
    assert contract.decode_usage_on(on, contract.encode(u)) == u
    with pytest.raises(InvalidInput, match=f"the usage snapshot belongs on {on}"):
        contract.decode_usage_on(f"{on}x", contract.encode(u))
