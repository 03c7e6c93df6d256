"""``vmquota usage``: what the VMs, migrations and pods of each namespace count, against which budget, and why.

Reads any mix of VMIs, VMIMs, pods, VMs, ResourceQuotas (and optionally Namespaces, FailedCreate Events and a
KubeVirt CR) from a file, as ``kubectl get -o yaml`` prints them, and accounts every namespace with
``shared.accounting`` as the ledger does:

* a namespace with managed ResourceQuotas in the input is accounted against them (their modes and budgets), pending
  VMs admitted in creation order while they fit, exactly as the ledger decides;
* a namespace without one is accounted in ``--mode`` without a budget (every pending VM counts as admitted), or,
  without ``--mode``, skipped with a note;
* a VM that has no VMI in the input and whose run strategy starts it counts as the VMI KubeVirt would create from
  its template (pending); a VM that would not run is skipped with a note.

Exit codes: 0 accounted; 2 malformed input or options, or nothing to account (one line on stderr).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec

from services.platform.inputs import cr_fields, kubevirt_fields, load_objects
from shared.accounting.namespace import account_namespace
from shared.accounting.results import NamespaceUsage, QuotaUsage, VmEntry
from shared.accounting.wire import quota_terms
from shared.contract import check_namespace
from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    EVENT_KIND,
    POD_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)
from shared.kubevirt import KubeVirtConfig
from shared.kubevirt.config import profile
from shared.kubevirt.vm import STARTING_STRATEGIES, run_strategy, vmi_from_vm
from shared.normalize import normalize
from shared.quota.modes import MODE_NAMES, Mode, QuotaPolicy, is_managed, parse_mode, parse_ratio
from shared.report import readable
from shared.resources import ResourceList, canonical_resource_list
from shared.snapshot import (
    SUPPORTED_KINDS,
    AnySnapshot,
    KubeVirtSnapshot,
    QuotaSnapshot,
    VmiSnapshot,
    is_cluster_scoped,
)
from shared.text import printable
from shared.vmi import object_ref

EXIT_INVALID = 2
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
    p.add_argument(
        "--mode",
        metavar="MODE",
        help=f"mode for namespaces without a managed quota in the input, no budget: {', '.join(MODE_NAMES)}",
    )
    p.add_argument(
        "--cpu-allocation-ratio",
        metavar="N",
        help="the quota's own ratio for VirtualResourcesWithCPUAllocationRatio (default: the KubeVirt CR's, else 10)",
    )
    p.add_argument(
        "-f",
        "--filename",
        required=True,
        metavar="FILE",
        help="YAML/JSON: VMs, VMIs, migrations, pods, quotas ('-': stdin)",
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
    if obj.get("kind") in CLUSTER_SCOPED_KINDS or not isinstance(meta, Mapping) or meta.get("namespace"):
        return obj
    out = copy.copy(dict(obj))
    out["metadata"] = {**meta, "namespace": namespace}
    return out


def _snapshot(obj: Mapping[str, Any]) -> AnySnapshot:
    try:
        return normalize(obj)
    except InvalidInput:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a shape no validator anticipated
        raise InvalidInput(f"malformed object ({type(e).__name__}: {e})", object_ref(obj)) from None


def load_snapshots(
    path: str, namespace: str, notes: TextIO, config: Callable[[Sequence[AnySnapshot]], KubeVirtConfig] | None = None
) -> list[AnySnapshot]:
    """The snapshots of the objects in ``path``; with ``config`` (the KubeVirt configuration, from what was read),
    also the VMI each VM without one would get (see the module docstring)."""
    out: list[AnySnapshot] = []
    vms: list[Mapping[str, Any]] = []
    for obj in load_objects(path):
        reason = _skip_reason(obj)
        if reason is not None:
            print(f"note: skipping {object_ref(obj)}: {reason}", file=notes)
            continue
        placed = _with_namespace(obj, namespace)
        out.append(_snapshot(placed))
        if placed.get("kind") == VM_KIND:
            vms.append(placed)
    if config is not None and vms:
        out += _vmis_of_vms(vms, out, config(out), notes)
    return out


def _vmis_of_vms(
    vms: Sequence[Mapping[str, Any]], snapshots: Sequence[AnySnapshot], config: KubeVirtConfig, notes: TextIO
) -> list[AnySnapshot]:
    have = {(s.namespace, s.name) for s in snapshots if isinstance(s, VmiSnapshot)}
    out: list[AnySnapshot] = []
    for vm in vms:
        ref = object_ref(vm)
        meta = vm.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if key in have:
            continue
        try:
            strategy = run_strategy(vm)
        except InvalidInput as e:
            raise e.at(ref) from None
        if strategy not in STARTING_STRATEGIES:
            print(f"note: skipping {ref}: run strategy {strategy} starts no VMI", file=notes)
            continue
        try:
            vmi = vmi_from_vm(vm, config)
        except InvalidInput as e:
            raise e.at(ref) from None
        vmi["metadata"]["uid"] = f"{meta.get('uid') or '/'.join(key)}-vmi"
        if meta.get("creationTimestamp"):  # (admission follows creation order)
            vmi["metadata"]["creationTimestamp"] = meta["creationTimestamp"]
        print(f"note: {ref} has no VMI in the input: counted as the VMI its template gives (pending)", file=notes)
        out.append(_snapshot(vmi))
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


def build_policy(args: argparse.Namespace, notes: TextIO) -> QuotaPolicy | None:
    """The ``--mode`` policy (no budget), or None without ``--mode``."""
    ratio = None
    if args.cpu_allocation_ratio is not None:
        ratio = parse_ratio(args.cpu_allocation_ratio, "--cpu-allocation-ratio")
    if args.mode is None:
        if ratio is not None:
            print("note: --cpu-allocation-ratio has no effect without --mode", file=notes)
        return None
    mode = parse_mode(args.mode, "--mode")
    if ratio is not None and mode is not Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO:
        print(f"note: --cpu-allocation-ratio has no effect in mode {mode}", file=notes)
    return QuotaPolicy(name="", mode=mode, cpu_allocation_ratio=ratio)


def account_all(
    snapshots: Sequence[AnySnapshot],
    policy: QuotaPolicy | None,
    config: KubeVirtConfig,
    now: datetime,
    notes: TextIO | None = None,
) -> dict[str, NamespaceUsage]:
    """Each namespace against its managed quotas in ``snapshots`` (as the ledger), else in ``policy`` without a
    budget, else skipped (with a note)."""
    shared = [s for s in snapshots if is_cluster_scoped(s)]  # (each namespace reads them)
    by_namespace: dict[str, list[AnySnapshot]] = {}
    for s in snapshots:
        if s.namespace and not is_cluster_scoped(s):
            by_namespace.setdefault(s.namespace, []).append(s)
    out: dict[str, NamespaceUsage] = {}
    for ns in sorted(by_namespace):
        objects = by_namespace[ns]
        managed = any(isinstance(s, QuotaSnapshot) and is_managed(s.labels) for s in objects)
        if not managed and policy is None:
            if notes is not None:
                print(f"note: skipping namespace {ns}: no managed ResourceQuota in the input and no --mode", file=notes)
            continue
        policies = None if managed or policy is None else [policy]  # None: the managed quotas among the objects
        out[ns] = account_namespace([*objects, *shared], now=now, config=config, policies=policies, namespace=ns)
    return out


def budgeted(u: NamespaceUsage) -> bool:
    """Accounted against managed quotas (with budgets), not in ``--mode`` alone."""
    return "" not in u.quotas


# ---- output ----------------------------------------------------------------------------------------------------


def _quota_json(q: QuotaUsage, notes: list[str]) -> dict[str, Any]:
    """The quota's terms as the ledger publishes them (``shared.accounting.wire.quota_terms``); with ``--mode``
    alone (no budget) without ``budget`` and ``overBudget``."""
    out: dict[str, Any] = msgspec.to_builtins(quota_terms(q.policy.name, q, notes))
    if not q.policy.budget:
        del out["budget"], out["overBudget"]
    if q.policy.mode is Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO:
        ratio = q.policy.cpu_allocation_ratio
        out["cpuAllocationRatio"] = str(ratio) if ratio is not None else None
    return out


def namespace_json(u: NamespaceUsage) -> dict[str, Any]:
    """With ``--mode`` alone: the mode's ``used``/``pods``/``reserved``/``taken`` and each object's ``counts`` (the
    bus contract's names for the terms). Against
    managed quotas: ``quotas`` (per quota, with its ``budget`` and ``overBudget``), and each VM's ``counts`` and
    ``refusedBy`` per quota."""
    per_quota = budgeted(u)
    objects: list[dict[str, Any]] = []
    for vm in u.vms:
        entry: dict[str, Any] = {
            "kind": VMI_KIND,
            "name": vm.name,
            "state": vm.state,
            "vcpus": vm.size.vcpus,
            "guestMemory": vm.size.guest_memory.canonical(),
            "counts": (
                {name: canonical_resource_list(c) for name, c in sorted(vm.counts.items())}
                if per_quota
                else canonical_resource_list(vm.counts.get("", {}))
            ),
            "reason": vm.reason,
        }
        if per_quota and vm.refused_by:
            entry["refusedBy"] = {name: list(r) for name, r in sorted(vm.refused_by.items())}
        if vm.reserved:
            entry["reserved"] = canonical_resource_list(vm.reserved)
        objects.append(entry)
    for m in u.migrations:
        entry = {
            "kind": VMIM_KIND,
            "name": m.name,
            "vmi": m.vmi,
            "phase": m.phase,
            "state": m.state,
            "counts": {},
            "reason": m.reason,
        }
        if m.reserved:
            entry["reserved"] = canonical_resource_list(m.reserved)
        if m.growth:
            entry["growth"] = canonical_resource_list(m.growth)
        objects.append(entry)
    for p in u.pods:
        objects.append(
            {
                "kind": POD_KIND,
                "name": p.name,
                "role": p.role,
                "vmi": p.vmi or None,
                "counts": canonical_resource_list(p.counts),
                "charged": canonical_resource_list(p.charged),
                "reason": p.reason,
            }
        )
    errors = list(u.errors)
    if per_quota:
        out: dict[str, Any] = {"quotas": {name: _quota_json(q, errors) for name, q in sorted(u.quotas.items())}}
    else:
        out = _quota_json(u.quotas[""], errors)
    out["objects"] = objects
    if errors:
        out["errors"] = errors
    return out


def _brief(rl: ResourceList) -> str:
    shown = [k for k in _TABLE_NAMES if k in rl] + sorted(
        k for k in rl if k not in _TABLE_NAMES and k not in _TABLE_SKIP
    )
    return " ".join(f"{k}={readable(rl[k], k)}" for k in shown) or "-"


def _table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    rows = [tuple(printable(cell) for cell in r) for r in rows]  # (reasons and names may carry a tenant's text)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() + "\n")


def _vm_counts(v: VmEntry, per_quota: bool) -> str:
    if not per_quota:
        return _brief(v.counts.get("", {}))
    return "; ".join(f"{k}: {_brief(c)}" for k, c in sorted(v.counts.items()) if c) or "-"


def write_table(results: Mapping[str, NamespaceUsage], out: TextIO) -> None:
    for i, (ns, u) in enumerate(results.items()):
        if i:
            out.write("\n")
        for name, q in sorted(u.quotas.items()):
            title = (
                f"NAMESPACE {ns}  QUOTA {name}  MODE {q.policy.mode}"
                if name
                else f"NAMESPACE {ns}  MODE {q.policy.mode}"
            )
            out.write(title + ("  (no budget: --mode)\n" if not name else "\n"))
            budget = q.policy.budget
            names = sorted(set(budget) | set(q.used) | set(q.pods) | set(q.reserved))
            lists = (budget, q.used, q.pods, q.reserved, q.hard) if budget else (q.used, q.pods, q.reserved)
            head = (
                ("RESOURCE", "BUDGET", "USED", "PODS", "RESERVED", "HARD")
                if budget
                else ("RESOURCE", "USED", "PODS", "RESERVED")
            )
            rows: list[tuple[str, ...]] = [head]
            for r in names:
                rows.append((r, *(readable(rl[r], r) if r in rl else "-" for rl in lists)))
            _table(rows, out)
            if q.over_budget:
                out.write(f"over budget: {', '.join(q.over_budget)}\n")
            out.write("\n")
        objs: list[tuple[str, ...]] = [("KIND", "NAME", "STATE", "COUNTS", "WHY")]
        objs += [("VMI", v.name, v.state, _vm_counts(v, budgeted(u)), v.reason) for v in u.vms]
        objs += [
            ("VMIM", m.name, m.state, f"reserves {_brief(m.reserved)}" if m.reserved else "-", m.reason)
            for m in u.migrations
        ]
        objs += [(POD_KIND, p.name, p.role, _brief(p.counts), p.reason) for p in u.pods]
        _table(objs, out)
        for e in u.errors:
            out.write(f"warning: {printable(e)}\n")


def run(args: argparse.Namespace) -> int:
    try:
        check_namespace(args.namespace, "-n/--namespace")
        policy = build_policy(args, sys.stderr)
        if args.kubevirt_version is not None:  # options first: one error line, before any note about the file
            try:
                profile(args.kubevirt_version)
            except InvalidInput as e:
                raise InvalidInput(e.message, "--kubevirt-version") from None
        configs: list[KubeVirtConfig] = []

        def config_of(read: Sequence[AnySnapshot]) -> KubeVirtConfig:
            configs.append(build_config(args, read, sys.stderr))
            return configs[0]

        snapshots = load_snapshots(args.filename, args.namespace, sys.stderr, config_of)
        config = configs[0] if configs else build_config(args, snapshots, sys.stderr)
        results = account_all(snapshots, policy, config, datetime.now(UTC), sys.stderr)
        if not results:
            raise InvalidInput(
                "nothing to account: no namespace has a managed ResourceQuota in the input; give --mode to account "
                "them without a budget",
                args.filename,
            )
    except InvalidInput as e:
        return _fail(str(e))
    if args.output == "json":
        json.dump({"namespaces": {ns: namespace_json(u) for ns, u in results.items()}}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        write_table(results, sys.stdout)
    return 0
