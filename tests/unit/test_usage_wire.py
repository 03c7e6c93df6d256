"""The ledger's usage wire form: VMs encoded once and spliced in give the bytes of encoding the whole message."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import contract
from shared.accounting.results import VmEntry
from shared.accounting.wire import _vm_state, vms_json
from shared.ledger.usage import usage_digest
from shared.quantity import Quantity
from shared.quota.modes import VmSize
from shared.times import rfc3339

names = st.text("abcxyz-0123456789", min_size=1, max_size=8)
amounts = st.dictionaries(
    st.sampled_from(["requests.cpu", "limits.memory", "pods", "requests.memory"]),
    st.integers(0, 10**6).map(lambda n: Quantity.parse(f"{n}m")),
    max_size=4,
)


@st.composite
def entries(draw: st.DrawFn) -> VmEntry:
    return VmEntry(
        name=draw(names),
        uid=draw(st.sampled_from(["", "u1", "u2", "u3"])),
        phase=draw(st.sampled_from(["", "Running", "Pending"])),
        state=draw(st.sampled_from(["running", "admitted", "refused", "stopped"])),
        reason=draw(st.text(max_size=20)),
        size=VmSize(1, Quantity.parse("1Gi")),
        pod_usage={},
        counts=draw(st.dictionaries(st.sampled_from(["", "compute", "q2"]), amounts, max_size=2)),
        reserved=draw(amounts),
        refused_by=draw(st.dictionaries(st.sampled_from(["compute"]), st.tuples(names), max_size=1)),
    )


def body(vms: list[contract.VmState]) -> contract.UsageBody:
    return contract.UsageBody(quotas={}, vms=vms, migrations=[], errors=["e"])


@settings(max_examples=200, deadline=None)
@given(st.lists(entries(), max_size=6), st.lists(st.booleans(), max_size=6))
def test_spliced_vms_encode_as_the_list(found: list[VmEntry], fresh: list[bool]) -> None:
    # states from the ledger's cache (encoded once) mixed with others (encoded on the spot)
    vms = (
        [
            contract.VmState(name=e.name, state=e.state) if fresh[i % len(fresh)] else _vm_state("ns", e)
            for i, e in enumerate(found)
        ]
        if fresh
        else [_vm_state("ns", e) for e in found]
    )
    raw = vms_json("ns", vms)
    assert contract.encode(msgspec.structs.replace(body(vms), vms=raw)) == contract.encode(body(vms))
    assert msgspec.json.decode(bytes(raw), type=list[contract.VmState]) == vms
    assert usage_digest(body(vms), raw) == usage_digest(body(list(vms)))


def test_a_changed_entry_is_encoded_again() -> None:
    size = VmSize(1, Quantity.parse("1Gi"))
    first = VmEntry("vm1", "u1", "Running", "running", "running", size, {}, {"q": {"pods": Quantity.parse("1")}})
    second = VmEntry("vm1", "u1", "Running", "running", "running", size, {}, {"q": {"pods": Quantity.parse("2")}})
    a = _vm_state("ns", first)
    assert _vm_state("ns", first) is a  # the same entry: the same state, not formatted again
    b = _vm_state("ns", second)
    assert b is not a
    assert b'"pods":"2"' in bytes(vms_json("ns", [b])) and b'"pods":"1"' in bytes(vms_json("ns", [a]))


def test_namespace_sums_beyond_int64_are_saturated_and_reported_not_refused() -> None:
    """Two pods charged 5Ei each add up past what Kubernetes can represent: the usage snapshot carries the largest
    value it can, says so, and still passes the enforcer's checks (it used to be dead-lettered, freezing the
    namespace's ``hard``); ``hard`` falls back to the budget, which opens no room."""
    from shared.accounting.wire import account
    from shared.ledger.fold import NamespaceView
    from shared.normalize import normalize
    from shared.quantity import MAX_NANOS
    from shared.quota.enforcement import check_usage
    from tests import builders as acc

    objs = [acc.quota_obj("rq", {"limits.memory": "64Gi"})]
    objs += [acc.pod_obj(f"huge{i}", {"memory": "5Ei"}, {"memory": "5Ei"}) for i in range(2)]
    kinds: dict[str, list[Any]] = {}
    for i, o in enumerate(objs):
        o["metadata"].setdefault("resourceVersion", str(10 + i))
        kinds.setdefault(o["kind"], []).append(normalize(o))
    view = NamespaceView(cluster="c1", namespace=acc.NS, seq=3, objects=kinds, cluster_objects={})
    b = account(view)
    t = b.quotas["rq"]
    assert Quantity.parse(t.pods["limits.memory"]).nanos == MAX_NANOS
    assert Quantity.parse(t.used["limits.memory"]).nanos == MAX_NANOS
    assert t.hard == {"limits.memory": "64Gi"}
    assert any(e.startswith("quota rq: pods of limits.memory") and "exceeds what Kubernetes" in e for e in b.errors)
    u = contract.UsageSnapshot(
        id="x",
        source="vmquota/ledger/c1",
        subject=acc.NS,
        time=rfc3339(),
        cluster="c1",
        namespace=acc.NS,
        seq=3,
        quotas=b.quotas,
    )
    check_usage(u)
