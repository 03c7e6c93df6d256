"""Accounting throughput: mode-usage computations per second (per mode), whole-namespace accounting (from scratch,
and again after one object changed, as the ledger does on every urgent event), and the snapshot work the ledger
does per event (normalise a raw pod, decode a pod snapshot from the wire)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import msgspec

from shared.accounting.namespace import account_namespace, account_view
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, render_launcher_pod
from shared.normalize import normalize
from shared.podusage import quota_usage_of
from shared.quantity import Quantity
from shared.quota.annotations import MANAGED_LABEL, MODE_ANNOTATION
from shared.quota.modes import Mode, VmSize, mode_usage
from shared.snapshot import (
    SNAPSHOT_TYPES,
    AnySnapshot,
    PodSnapshot,
    Snapshot,
    VmimSnapshot,
    VmiSnapshot,
    decode,
    encode,
)
from tests.benchmarks.common import Result, rate

NS = "bench"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _vmi(i: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "kind": "VirtualMachineInstance",
        "metadata": {
            "name": f"vm{i}",
            "namespace": NS,
            "uid": f"u{i}",
            "creationTimestamp": (T0 + timedelta(seconds=i)).isoformat(),
        },
        "spec": {"domain": {"cpu": {"sockets": 1 + i % 4}, "memory": {"guest": f"{1 + i % 8}Gi"}, "devices": {}}},
        "status": {"phase": phase, "nodeName": f"n{i % 5}"},
    }


def _launcher(vmi: dict[str, Any], config: KubeVirtConfig, facts: NamespaceFacts, mig: str = "") -> dict[str, Any]:
    meta = vmi["metadata"]
    labels = {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": meta["uid"]}
    if mig:
        labels["kubevirt.io/migrationJobUID"] = mig
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"virt-launcher-{meta['name']}{mig}",
            "namespace": NS,
            "uid": f"p-{meta['uid']}{mig}",
            "labels": labels,
        },
        "spec": {**render_launcher_pod(vmi, config, facts).pod_spec(), "nodeName": vmi["status"].get("nodeName", "")},
        "status": {"phase": "Running"},
    }


def namespace_objects(vms: int = 100, pods: int = 50, migrations: int = 5, pending: int = 5) -> list[AnySnapshot]:
    """A busy namespace: running VMs with launcher pods, non-VM pods, pending migrations and pending VMs."""
    config, facts = KubeVirtConfig(), NamespaceFacts(quota_has_limits_memory=True)
    objs: list[dict[str, Any]] = []
    for i in range(vms):
        v = _vmi(i)
        pod = _launcher(v, config, facts)
        v["status"]["activePods"] = {pod["metadata"]["uid"]: pod["spec"]["nodeName"]}  # (KubeVirt vouches for it)
        objs += [v, pod]
    for i in range(pending):
        objs.append(_vmi(vms + i, phase="Pending"))
    for i in range(migrations):
        objs.append(
            {
                "kind": "VirtualMachineInstanceMigration",
                "metadata": {"name": f"m{i}", "namespace": NS, "uid": f"m{i}"},
                "spec": {"vmiName": f"vm{i}"},
                "status": {"phase": "Pending"},
            }
        )
    for i in range(pods):
        objs.append(
            {
                "kind": "Pod",
                "metadata": {"name": f"web{i}", "namespace": NS, "uid": f"w{i}"},
                "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}]},
                "status": {"phase": "Running"},
            }
        )
    for mode in Mode:
        objs.append(
            {
                "kind": "ResourceQuota",
                "metadata": {
                    "name": f"rq-{mode.value.lower()}",
                    "namespace": NS,
                    "labels": {MANAGED_LABEL: "true"},
                    "annotations": {MODE_ANNOTATION: mode.value},
                },
                "spec": {
                    "hard": {"requests.cpu": "200", "limits.memory": "2Ti", "requests.memory": "1Ti", "pods": "500"}
                },
            }
        )
    for n, o in enumerate(objs):
        o["metadata"]["resourceVersion"] = str(n + 1)
    return [normalize(o) for o in objs]


def one_change_at_a_time(objs: list[AnySnapshot], kinds: tuple[type, ...]) -> Any:
    """Replace one object of these kinds by a new version (the next in turn) on each call, as the ledger's view
    of a namespace changes by one event; returns the changing view: kind → list, a new list for the changed kind
    only (as ``shared.ledger.fold.NamespaceState.live`` shares a kind's list until it changes)."""
    kind_of = {t: kind for kind, t in SNAPSHOT_TYPES.items()}
    view: dict[str, list[AnySnapshot]] = {}
    for o in objs:
        view.setdefault(kind_of[type(o)], []).append(o)
    picks = [(kind, i) for kind, found in view.items() for i, o in enumerate(found) if isinstance(o, kinds)]
    state = {"n": 0}

    def step() -> dict[str, list[AnySnapshot]]:
        state["n"] += 1
        kind, i = picks[state["n"] % len(picks)]
        found = view[kind] = list(view[kind])
        found[i] = msgspec.structs.replace(found[i], resource_version=str(1_000_000 + state["n"]))
        return view

    return step


def _refused_over_budget(vms: int) -> dict[str, list[AnySnapshot]]:
    """A namespace over its budget (64 CPUs for ``vms`` running VMs) whose every VM KubeVirt was refused a target
    for: a budget lowered before a drain, or a tenant that migrates each of its VMs once a pod of its own took a
    refused target's room. The view the ledger accounts."""
    from tests.builders import folded, launcher_obj, quota_obj, vmi_obj, vmim_obj

    objs: list[dict[str, Any]] = [quota_obj("rq", {"requests.cpu": "64", "requests.memory": "64Gi"})]
    for i in range(vms):
        vmi = vmi_obj(f"v{i}")
        objs += [vmi, launcher_obj(vmi), vmim_obj(f"m{i}", f"v{i}", rejected=True)]
    view = folded(objs).view("c1", "tenant")
    return {**view.cluster_objects, **view.objects}


def run() -> list[Result]:
    results: list[Result] = []
    config = KubeVirtConfig()
    v = _vmi(3)
    pod = render_launcher_pod(v, config, NamespaceFacts(quota_has_limits_memory=True))
    usage = quota_usage_of(pod.requests, pod.limits)
    size = VmSize(4, Quantity.parse("4Gi"))
    ratio = Fraction(4)
    batch = 2000
    for mode in Mode:

        def step(mode: Mode = mode) -> int:
            for _ in range(batch):
                mode_usage(mode, size, usage, ratio)
            return batch

        results.append(Result(f"mode usage {mode.value}", rate(step, 0.5), "VMs/s", target=100_000))

    objs = namespace_objects()
    now = T0 + timedelta(days=1)

    def account_once() -> int:
        account_namespace(objs, now=now, config=config, memoize=False)
        return 1

    per_ns = rate(account_once, 1.0)
    results.append(Result("account a 100-VM namespace, 4 quotas", per_ns, "namespaces/s", target=20))
    results.append(Result("  objects accounted", per_ns * len(objs), "objects/s"))
    for what, kinds in [
        ("a VMI or migration", (VmiSnapshot, VmimSnapshot)),
        ("a pod", (PodSnapshot,)),
        ("any object", (Snapshot,)),
    ]:
        changing = one_change_at_a_time(list(objs), kinds)

        def account_again(changing: Any = changing) -> int:
            account_view(changing(), NS, now=now, config=config)
            return 1

        results.append(
            Result(
                f"  again after {what} changed (ms)",
                1000 / rate(account_again, 1.0),
                "ms",
                target=1.0,
                higher_is_better=False,
                note="memoised: estimates, running VMs, the pod pass and sums of unchanged objects are reused",
            )
        )

    over = _refused_over_budget(2000)

    def account_over() -> int:
        account_view(over, "tenant", now=now, config=config, memoize=False)
        return 1

    results.append(
        Result(
            "account a 2,000-VM namespace over its budget, every VM's migration refused (ms)",
            1000 / rate(account_over, 1.0),
            "ms",
            target=1000.0,
            higher_is_better=False,
            note="each refused migration asks whether pods that came in a refusal took its room: once per pass",
        )
    )

    raw = _launcher(v, config, NamespaceFacts())
    wire = encode(normalize(raw))

    def normalize_batch() -> int:
        for _ in range(500):
            normalize(raw)
        return 500

    def decode_batch() -> int:
        for _ in range(2000):
            decode(wire)
        return 2000

    results.append(Result("normalize a launcher pod", rate(normalize_batch, 0.5), "pods/s", target=10_000))
    results.append(Result("decode a pod snapshot", rate(decode_batch, 0.5), "snapshots/s", target=100_000))
    return results


if __name__ == "__main__":
    for r in run():
        print(r.line())
