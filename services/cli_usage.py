"""``vmquota usage``: what the VMs, migrations and pods of each namespace count in an accounting mode, and why.

Reads any mix of VMIs, VMIMs, pods (and optionally VMs, ResourceQuotas, Namespaces, FailedCreate Events and a
KubeVirt CR) from a file, as ``kubectl get -o yaml`` prints them, and accounts every namespace with
``shared.accounting`` in the chosen mode, without a budget: every pending VM counts as admitted.

Exit codes: 0 accounted; 2 malformed input or options (one line on stderr naming the object and field).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from services.inputs import cr_fields, kubevirt_fields, load_objects
from shared.accounting import NamespaceUsage, account_namespace
from shared.errors import InvalidInput
from shared.kubevirt import KubeVirtConfig
from shared.kubevirt.config import profile
from shared.modes import MODE_NAMES, Mode, QuotaPolicy, parse_mode, parse_ratio
from shared.resources import ResourceList, format_resource_list
from shared.snapshot import (
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    SUPPORTED_KINDS,
    AnySnapshot,
    KubeVirtSnapshot,
    NamespaceSnapshot,
    normalize,
)
from shared.vmi import VMI_KIND, object_ref

EXIT_INVALID = 2
_CLUSTER_SCOPED = frozenset({NAMESPACE_KIND, KUBEVIRT_KIND})
_TABLE_NAMES = ("requests.cpu", "limits.cpu", "requests.memory", "limits.memory")
_TABLE_SKIP = frozenset(
    {
        "cpu",
        "memory",
        "pods",
        "count/pods",
        "ephemeral-storage",
        "requests.ephemeral-storage",
        "limits.ephemeral-storage",
    }
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", required=True, metavar="MODE", help=f"accounting mode: {', '.join(MODE_NAMES)}")
    p.add_argument(
        "--cpu-allocation-ratio",
        metavar="N",
        help="the quota's own ratio for VirtualResourcesWithCPUAllocationRatio (default: the KubeVirt CR's, else 10)",
    )
    p.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="YAML/JSON with VMIs, migrations and pods ('-': stdin)"
    )
    p.add_argument(
        "-n", "--namespace", default="default", help="namespace of objects that name none (default: default)"
    )
    p.add_argument(
        "--kubevirt-config", metavar="FILE", help="a KubeVirt CR (default: one in FILE, else KubeVirt's defaults)"
    )
    p.add_argument(
        "--kubevirt-version",
        metavar="VERSION",
        help="v1.0 .. v1.9, a release such as v1.6.2, or main (overrides the CR's)",
    )
    p.add_argument("-o", "--output", choices=("json", "table"), default="table", help="output format (default table)")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_INVALID


def _skip_reason(obj: Mapping[str, Any]) -> str | None:
    kind = obj.get("kind")
    if kind not in SUPPORTED_KINDS:
        return "not a kind accounting reads"
    if kind == EVENT_KIND:
        inv = obj.get("involvedObject")
        inv_kind = inv.get("kind") if isinstance(inv, Mapping) else None
        if obj.get("reason") != "FailedCreate" or inv_kind != VMI_KIND:
            return "only FailedCreate events on VMIs are read"
    return None


def _with_namespace(obj: Mapping[str, Any], namespace: str) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    if obj.get("kind") in _CLUSTER_SCOPED or not isinstance(meta, Mapping) or meta.get("namespace"):
        return obj
    out = copy.copy(dict(obj))
    out["metadata"] = {**meta, "namespace": namespace}
    return out


def load_snapshots(path: str, namespace: str, notes: TextIO) -> list[AnySnapshot]:
    out: list[AnySnapshot] = []
    for obj in load_objects(path):
        reason = _skip_reason(obj)
        if reason is not None:
            print(f"note: skipping {object_ref(obj)}: {reason}", file=notes)
            continue
        try:
            out.append(normalize(_with_namespace(obj, namespace)))
        except InvalidInput:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a shape no validator anticipated
            raise InvalidInput(f"malformed object ({type(e).__name__}: {e})", object_ref(obj)) from None
    return out


def build_config(args: argparse.Namespace, snapshots: Sequence[AnySnapshot], notes: TextIO) -> KubeVirtConfig:
    fields: dict[str, Any] = {}
    if args.kubevirt_config:
        fields = kubevirt_fields(args.kubevirt_config, args.kubevirt_version, notes)
    else:
        kvs = sorted((s for s in snapshots if isinstance(s, KubeVirtSnapshot)), key=lambda s: (s.namespace, s.name))
        if kvs:
            fields = cr_fields(kvs[0].as_object(), args.kubevirt_version, notes)
    if args.kubevirt_version is not None:
        fields["version"] = args.kubevirt_version
    try:
        return KubeVirtConfig(**fields)
    except InvalidInput as e:
        raise InvalidInput(e.message, "--kubevirt-version" if e.where == "version" else e.where) from None


def build_policy(args: argparse.Namespace, notes: TextIO) -> QuotaPolicy:
    mode = parse_mode(args.mode, "--mode")
    ratio = None
    if args.cpu_allocation_ratio is not None:
        ratio = parse_ratio(args.cpu_allocation_ratio, "--cpu-allocation-ratio")
        if mode is not Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO:
            print(f"note: --cpu-allocation-ratio has no effect in mode {mode}", file=notes)
    return QuotaPolicy(name="", mode=mode, cpu_allocation_ratio=ratio)


def account_all(
    snapshots: Sequence[AnySnapshot], policy: QuotaPolicy, config: KubeVirtConfig, now: datetime
) -> dict[str, NamespaceUsage]:
    cluster_scoped = (NamespaceSnapshot, KubeVirtSnapshot)
    shared = [s for s in snapshots if isinstance(s, cluster_scoped)]  # (each namespace reads them)
    by_namespace: dict[str, list[AnySnapshot]] = {}
    for s in snapshots:
        if s.namespace and not isinstance(s, cluster_scoped):
            by_namespace.setdefault(s.namespace, []).append(s)
    return {
        ns: account_namespace([*by_namespace[ns], *shared], now=now, config=config, policies=[policy], namespace=ns)
        for ns in sorted(by_namespace)
    }


# ---- output ----------------------------------------------------------------------------------------------------


def namespace_json(u: NamespaceUsage) -> dict[str, Any]:
    q = u.quotas[""]
    objects: list[dict[str, Any]] = []
    for vm in u.vms:
        entry: dict[str, Any] = {
            "kind": VMI_KIND,
            "name": vm.name,
            "state": vm.state,
            "vcpus": vm.size.vcpus,
            "guestMemory": vm.size.guest_memory.canonical(),
            "counts": format_resource_list(vm.counts.get("", {})),
            "reason": vm.reason,
        }
        if vm.reserved:
            entry["reserved"] = format_resource_list(vm.reserved)
        objects.append(entry)
    for m in u.migrations:
        entry = {
            "kind": "VirtualMachineInstanceMigration",
            "name": m.name,
            "vmi": m.vmi,
            "phase": m.phase,
            "state": m.state,
            "counts": {},
            "reason": m.reason,
        }
        if m.reserved:
            entry["reserved"] = format_resource_list(m.reserved)
        if m.growth:
            entry["growth"] = format_resource_list(m.growth)
        objects.append(entry)
    for p in u.pods:
        objects.append(
            {
                "kind": "Pod",
                "name": p.name,
                "role": p.role,
                "vmi": p.vmi or None,
                "counts": format_resource_list(p.accounted),
                "charged": format_resource_list(p.charged),
                "reason": p.reason,
            }
        )
    out: dict[str, Any] = {
        "mode": q.policy.mode.value,
        "usage": format_resource_list(q.accounted),
        "podUsage": format_resource_list(q.pod_usage),
        "reserved": format_resource_list(q.reserved),
        "objects": objects,
    }
    if q.policy.mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO:
        ratio = q.policy.cpu_allocation_ratio
        out["cpuAllocationRatio"] = str(ratio) if ratio is not None else None
    if u.errors:
        out["errors"] = list(u.errors)
    return out


def _brief(rl: ResourceList) -> str:
    shown = [k for k in _TABLE_NAMES if k in rl] + sorted(
        k for k in rl if k not in _TABLE_NAMES and k not in _TABLE_SKIP
    )
    return " ".join(f"{k}={rl[k]}" for k in shown) or "-"


def _table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() + "\n")


def write_table(results: Mapping[str, NamespaceUsage], out: TextIO) -> None:
    for i, (ns, u) in enumerate(results.items()):
        q = u.quotas[""]
        if i:
            out.write("\n")
        out.write(f"NAMESPACE {ns}  MODE {q.policy.mode}\n")
        names = sorted(set(q.accounted) | set(q.pod_usage) | set(q.reserved))
        rows: list[tuple[str, ...]] = [("RESOURCE", "USAGE", "POD USAGE", "RESERVED")]
        for r in names:
            rows.append((r, *(str(rl[r]) if r in rl else "-" for rl in (q.accounted, q.pod_usage, q.reserved))))
        _table(rows, out)
        out.write("\n")
        objs: list[tuple[str, ...]] = [("KIND", "NAME", "STATE", "COUNTS", "WHY")]
        objs += [("VMI", v.name, v.state, _brief(v.counts.get("", {})), v.reason) for v in u.vms]
        objs += [
            ("VMIM", m.name, m.state, f"reserves {_brief(m.reserved)}" if m.reserved else "-", m.reason)
            for m in u.migrations
        ]
        objs += [("Pod", p.name, p.role, _brief(p.accounted), p.reason) for p in u.pods]
        _table(objs, out)
        for e in u.errors:
            out.write(f"warning: {e}\n")


def run(args: argparse.Namespace) -> int:
    try:
        policy = build_policy(args, sys.stderr)
        if args.kubevirt_version is not None:  # options first: one error line, before any note about the file
            try:
                profile(args.kubevirt_version)
            except InvalidInput as e:
                raise InvalidInput(e.message, "--kubevirt-version") from None
        snapshots = load_snapshots(args.filename, args.namespace, sys.stderr)
        config = build_config(args, snapshots, sys.stderr)
        results = account_all(snapshots, policy, config, datetime.now(UTC))
    except InvalidInput as e:
        return _fail(str(e))
    if args.output == "json":
        json.dump({"namespaces": {ns: namespace_json(u) for ns, u in results.items()}}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        write_table(results, sys.stdout)
    return 0
