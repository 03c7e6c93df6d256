"""Memory per tracked VM: in the ledger's fold state and in the watcher's known sets.

A tracked VM is three objects, as in a cluster: its VirtualMachine, its running VirtualMachineInstance (with a full
spec: disks, interfaces, a cloud-init volume, of which the snapshot keeps what re-rendering the launcher pod needs)
and its virt-launcher pod (rendered by the simulator). The ledger figure folds the events the watcher would publish for
them (``Ledger.apply_bytes``, as the ledger service does); the watcher figure puts them in a ``KnownSet`` per
resource, with uid and name strings made fresh as a JSON decode makes them. Both are measured with
``tracemalloc``: the bytes still allocated after folding ``N`` VMs, over ``N``. Shared objects (interned
namespaces, cached quantities) count once, as they do in a running service. Target: <= 2 KiB per VM each.
"""

from __future__ import annotations

import gc
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

from services.devtools.simcluster.kubevirt import launcher_pod
from services.watcher.loop import KnownSet
from shared import contract
from shared.accounting.namespace import ACCOUNTED_KINDS
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.ledger.fold import Ledger, PartitionSet
from shared.normalize import normalize
from tests.benchmarks.common import Result

VMS = 20_000
"""Enough VMs that the growth of the interpreter's intern table (a doubling counts whole when it happens inside the
fold) is spread as in a large ledger, not a step that lands in or out of the measurement."""
NAMESPACES = 25
CLUSTER = "bench"
TARGET_BYTES = 2048.0
TIME = "2026-01-01T00:00:00Z"
KINDS = ("VirtualMachine", "VirtualMachineInstance", "Pod")
_CONFIG = KubeVirtConfig(version="v1.9")
_FACTS = NamespaceFacts(labels={}, quota_has_limits_cpu=True, quota_has_limits_memory=True)


def _uid(kind: int, i: int) -> str:
    return str(uuid.UUID(int=(kind << 64) | i))


def vm_objects(i: int) -> list[dict[str, Any]]:
    """The VirtualMachine, VirtualMachineInstance and launcher pod of VM number ``i`` (sizes vary with ``i``)."""
    ns, name = f"tenant-{i % NAMESPACES}", f"vm-{i:05d}"
    sockets, memory = 1 + i % 4, f"{2 ** (1 + i % 4)}Gi"
    domain = {
        "cpu": {"sockets": sockets, "cores": 1, "threads": 1, "model": "host-model"},
        "memory": {"guest": memory},
        "machine": {"type": "q35"},
        "firmware": {"uuid": _uid(9, i)},
        "features": {"acpi": {"enabled": True}},
        "devices": {
            "disks": [
                {"name": "rootdisk", "disk": {"bus": "virtio"}},
                {"name": "cloudinitdisk", "disk": {"bus": "virtio"}},
            ],
            "interfaces": [{"name": "default", "masquerade": {}}],
            "rng": {},
        },
    }
    spec = {
        "domain": domain,
        "networks": [{"name": "default", "pod": {}}],
        "volumes": [
            {"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/fedora:40"}},
            {
                "name": "cloudinitdisk",
                "cloudInitNoCloud": {"userData": "#cloud-config\nuser: fedora\nssh_pwauth: false\n"},
            },
        ],
        "evictionStrategy": "LiveMigrate",
        "terminationGracePeriodSeconds": 180,
    }
    labels = {"kubevirt.io/vm": name, "app": "web"}
    vm = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": ns, "uid": _uid(1, i), "resourceVersion": str(3 * i + 1)},
        "spec": {"runStrategy": "Always", "template": {"metadata": {"labels": labels}, "spec": spec}},
        "status": {"printableStatus": "Running", "ready": True, "created": True},
    }
    vmi = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": _uid(2, i),
            "resourceVersion": str(3 * i + 2),
            "creationTimestamp": TIME,
            "labels": {**labels, "kubevirt.io/nodeName": f"node-{i % 8}"},
            "annotations": {
                "kubevirt.io/latest-observed-api-version": "v1",
                "kubevirt.io/storage-observed-api-version": "v1",
            },
        },
        "spec": spec,
        "status": {
            "phase": "Running",
            "nodeName": f"node-{i % 8}",
            "memory": {"guestAtBoot": memory, "guestCurrent": memory, "guestRequested": memory},
            "currentCPUTopology": {"sockets": sockets, "cores": 1, "threads": 1},
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "LiveMigratable", "status": "True"}],
            "interfaces": [{"name": "default", "ipAddress": f"10.0.{i // 250}.{i % 250}"}],
            "activePods": {_uid(3, i): f"node-{i % 8}"},
        },
    }
    pod = launcher_pod(vmi, render_launcher_pod(vmi, _CONFIG, _FACTS), image="quay.io/kubevirt/virt-launcher:v1.9.0")
    pod["metadata"].pop("generateName", None)
    pod["metadata"].update(
        name=f"virt-launcher-{name}-{i % 99991:05x}",
        uid=_uid(3, i),
        resourceVersion=str(3 * i + 3),
        creationTimestamp=TIME,
    )
    pod["spec"]["nodeName"] = f"node-{i % 8}"
    pod["status"] = {"phase": "Running"}
    return [vm, vmi, pod]


def events_of(objs: list[dict[str, Any]]) -> list[bytes]:
    """The watcher's ``Upserted`` events of these objects, encoded as on the bus."""
    out = []
    for obj in objs:
        m = obj["metadata"]
        ev = contract.object_event(
            "upserted",
            cluster=CLUSTER,
            kind=obj["kind"],
            namespace=m["namespace"],
            name=m["name"],
            uid=m["uid"],
            rv=m["resourceVersion"],
            snapshot=normalize(obj),
            time=TIME,
        )
        out.append(contract.encode(ev))
    return out


def _traced(build: Callable[[], object]) -> tuple[int, object]:
    """Bytes still allocated by ``build()`` once it returned (its result kept alive), and that result."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, kept


def ledger_bytes(events: list[bytes]) -> tuple[int, Ledger]:
    def fold() -> Ledger:
        ledger = Ledger(PartitionSet.all(1), ACCOUNTED_KINDS)  # as the ledger service folds
        for seq, data in enumerate(events, 1):
            ledger.apply_bytes(data, seq)
        return ledger

    size, ledger = _traced(fold)
    assert isinstance(ledger, Ledger)
    return size, ledger


def known_set_bytes(objs: list[dict[str, Any]]) -> tuple[int, dict[str, KnownSet]]:
    # (uid, namespace, name, rv, launcher) as the watcher reads them; the strings are copied inside the traced
    # region, as decoding a list page or a watch event creates them
    rows = [
        (o["kind"], o["metadata"]["uid"].encode(), o["metadata"]["namespace"], o["metadata"]["name"].encode())
        for o in objs
    ]
    rvs = [int(o["metadata"]["resourceVersion"]) for o in objs]

    def track() -> dict[str, KnownSet]:
        sets: dict[str, KnownSet] = {}
        for (kind, uid, ns, name), rv in zip(rows, rvs, strict=True):
            known = sets.get(kind)
            if known is None:
                known = sets[kind] = KnownSet()
            known.put(uid.decode(), ns, name.decode(), rv + 10**9, kind == "Pod")  # a large rv: not a small int
        return sets

    size, sets = _traced(track)
    assert isinstance(sets, dict)
    return size, sets


def run(n: int = VMS) -> list[Result]:
    objs = [o for i in range(n) for o in vm_objects(i)]
    events = events_of(objs)
    expected = sum(1 for o in objs if o["kind"] in ACCOUNTED_KINDS)
    known_size, sets = known_set_bytes(objs)
    if sum(len(s) for s in sets.values()) != len(objs):
        raise AssertionError("the known sets lost objects")
    # The ledger's strings must be its own, as in a service: a source object kept alive would lend the fold the
    # strings it interns (and, measured before, the intern table's growth), which tracemalloc then does not count.
    del objs, sets
    gc.collect()
    led_size, ledger = ledger_bytes(events)
    folded = sum(len(st.live(kind)) for st in ledger.states.values() for kind in KINDS)
    if folded != expected:
        raise AssertionError(f"the ledger holds {folded} objects, expected {expected}")
    del ledger
    shares = []
    for k, kind in enumerate(KINDS):  # the same, one kind at a time: where the bytes go
        if kind not in ACCOUNTED_KINDS:
            shares.append(f"{kind} not folded")
            continue
        size, _ = ledger_bytes(events[k::3])
        shares.append(f"{kind} {size / n:,.0f} B")
    avg_event = sum(map(len, events)) / len(events)
    note = f"{n} VMs (VM + VMI + launcher pod) in {NAMESPACES} namespaces, events {avg_event:,.0f} B on average"
    return [
        Result(
            "memory: ledger fold state per VM",
            led_size / n,
            "B",
            target=TARGET_BYTES,
            higher_is_better=False,
            note=f"{note}; by kind: {', '.join(shares)}",
        ),
        Result("memory: watcher known sets per VM", known_size / n, "B", target=TARGET_BYTES, higher_is_better=False),
    ]


if __name__ == "__main__":
    for result in run():
        print(result.line())
