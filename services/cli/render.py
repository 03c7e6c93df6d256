"""``vmquota render``: the launcher pods KubeVirt would create for VMIs/VMs, with their requests, limits and memory
overhead, for a given KubeVirt version and configuration.

Exit codes: 0 rendered; 2 malformed input or options, or nothing to render (one line on stderr naming the object
and field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, TextIO

from services.platform.inputs import kubevirt_fields, load_objects
from shared.errors import InvalidInput
from shared.kinds import QUOTA_KIND, VM_KIND, VMI_KIND
from shared.kubevirt import KubeVirtConfig, NamespaceFacts, RenderedPod, render_launcher_pod
from shared.kubevirt.config import positive_ratio
from shared.quantity import Quantity
from shared.resources import format_resource_list, is_quota_resource_name
from shared.vmi import VmiSpec, object_ref, vmi_spec

EXIT_INVALID = 2
_MI = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="YAML/JSON with VMIs and/or VMs ('-': stdin)"
    )
    p.add_argument(
        "--kubevirt-version",
        metavar="VERSION",
        help="v1.0 .. v1.9, a release such as v1.6.2, or main (default: the KubeVirt CR's observedKubeVirtVersion, "
        "else v1.9); a bare minor means its newest patch release",
    )
    p.add_argument("--arch", choices=("amd64", "arm64"), help="cluster CPU architecture (default amd64)")
    p.add_argument("--cpu-allocation-ratio", metavar="N", help="vCPUs per requested core (default 10)")
    p.add_argument("--kubevirt-config", metavar="FILE", help="a KubeVirt CR; the options above override it")
    p.add_argument(
        "--namespace-label",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="labels of the namespace (autoCPULimitNamespaceLabelSelector, auto-memory-limits-ratio)",
    )
    p.add_argument(
        "--quota-has",
        default="",
        metavar="RESOURCES",
        help="comma list of what some ResourceQuota in the namespace has in spec.hard, e.g. limits.cpu,limits.memory",
    )
    p.add_argument("-o", "--output", choices=("json", "table"), default="table", help="output format (default table)")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_INVALID


def build_config(args: argparse.Namespace, notes: TextIO) -> KubeVirtConfig:
    fields: dict[str, Any] = {}
    if args.kubevirt_config:
        fields = kubevirt_fields(args.kubevirt_config, args.kubevirt_version, notes)
    if args.kubevirt_version is not None:
        fields["version"] = args.kubevirt_version
    if args.arch is not None:
        fields["arch"] = args.arch
    if args.cpu_allocation_ratio is not None:
        ratio = positive_ratio(args.cpu_allocation_ratio, "--cpu-allocation-ratio")
        if not Fraction(1, 1000) <= ratio <= 1000:  # (beyond these, a launcher pod's CPU is no quantity anyone means)
            raise InvalidInput(
                f"must be between 0.001 and 1000, got {args.cpu_allocation_ratio!r}", "--cpu-allocation-ratio"
            )
        fields["cpu_allocation_ratio"] = ratio
    try:
        return KubeVirtConfig(**fields)
    except InvalidInput as e:
        flag = {
            "version": "--kubevirt-version",
            "cpuAllocationRatio": "--cpu-allocation-ratio",
            "arch": "--arch",
        }.get(e.where)
        raise InvalidInput(e.message, flag or e.where) from None


def build_namespace(args: argparse.Namespace) -> NamespaceFacts:
    labels: dict[str, str] = {}
    for item in args.namespace_label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidInput(f"expected KEY=VALUE, got {item!r}", "--namespace-label")
        labels[key] = value
    names = {n.strip() for n in args.quota_has.split(",") if n.strip()}
    for n in sorted(names):  # (a typo read as "no quota names limits" renders another pod, without a word)
        if not is_quota_resource_name(n):
            raise InvalidInput(f"{n!r} is not a resource a ResourceQuota can hold (e.g. limits.memory)", "--quota-has")
    return NamespaceFacts(labels=labels).with_quota_resources(names)


def item_json(spec: VmiSpec, pod: RenderedPod) -> dict[str, Any]:
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "containers": {
            c.name: {"requests": format_resource_list(c.requests), "limits": format_resource_list(c.limits)}
            for c in pod.containers
        },
        "pod": {"requests": format_resource_list(pod.requests), "limits": format_resource_list(pod.limits)},
        "memoryOverhead": pod.memory_overhead.canonical(),
    }


def _bytes(q: Quantity | None) -> str:
    """Bytes for people: whole Gi or Mi when exact, else Mi with one decimal."""
    if q is None:
        return "-"
    n = q.ceil()
    if n and n % (1024 * _MI) == 0:
        return f"{n // (1024 * _MI)}Gi"
    if n % _MI == 0:
        return f"{n // _MI}Mi"
    return f"{n / _MI:.1f}Mi"


def _cpu(q: Quantity | None) -> str:
    return "-" if q is None else q.canonical()


def _partial(pod: RenderedPod, resource: str) -> bool:
    """Some container the pod runs sets no limit of ``resource``: the pod's limit is none, and what quota charges
    as ``limits.<resource>`` is the sum over the containers that set one."""
    return any(resource not in c.limits for c in pod.containers if not c.init or c.restartable)


def write_table(rows: Sequence[tuple[VmiSpec, RenderedPod]], out: TextIO) -> None:
    header = ("NAMESPACE", "NAME", "KIND", "VCPUS", "GUEST", "CPU REQ", "CPU LIM", "MEM REQ", "MEM LIM", "OVERHEAD")
    table = [header]
    partial = False
    for spec, pod in rows:
        marks = {r: "*" if _partial(pod, r) and pod.limits.get(r) is not None else "" for r in ("cpu", "memory")}
        partial = partial or any(marks.values())
        table.append(
            (
                spec.namespace or "-",
                spec.name or "-",
                "VM" if spec.kind == VM_KIND else "VMI",
                str(spec.vcpus),
                _bytes(spec.guest_memory),
                _cpu(pod.requests.get("cpu")),
                _cpu(pod.limits.get("cpu")) + marks["cpu"],
                _bytes(pod.requests.get("memory")),
                _bytes(pod.limits.get("memory")) + marks["memory"],
                _bytes(pod.memory_overhead),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() + "\n")
    if partial:
        out.write(
            "(*: some container sets no such limit, so the pod has none: the sum over those that set one. A quota "
            "naming limits.cpu or limits.memory refuses such a pod, and KubeVirt sets the limits: --quota-has, or "
            "the quota in the input)\n"
        )


def _instancetype_hint(obj: Mapping[str, Any]) -> str:
    spec = obj.get("spec")
    if obj.get("kind") == VM_KIND and isinstance(spec, Mapping):
        for key in ("instancetype", "preference"):
            ref = spec.get(key)
            if isinstance(ref, Mapping) and ref.get("name"):
                return f"{key} {ref.get('name')}"
    return ""


def _namespace_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    ns = meta.get("namespace") if isinstance(meta, Mapping) else None
    return ns if isinstance(ns, str) else ""


def _quota_resources(objects: Sequence[Mapping[str, Any]], notes: TextIO) -> dict[str, set[str]]:
    """Per namespace, the resources the ResourceQuotas among ``objects`` have in ``spec.hard``: KubeVirt's automatic
    limits follow them, as ``--quota-has`` says for every namespace."""
    found: dict[str, set[str]] = {}
    for obj in objects:
        if obj.get("kind") != QUOTA_KIND:
            continue
        spec = obj.get("spec")
        hard = spec.get("hard") if isinstance(spec, Mapping) else None
        names = {r for r in hard if isinstance(r, str)} if isinstance(hard, Mapping) else set()
        found.setdefault(_namespace_of(obj), set()).update(names)
        limits = sorted(names & {"limits.cpu", "limits.memory"})
        said = f"names {' and '.join(limits)}: the launcher pods of its namespace get KubeVirt's automatic limits"
        print(f"note: {object_ref(obj)} {said if limits else 'names no limits'}", file=notes)
    return found


def render_objects(
    objects: Sequence[Mapping[str, Any]], config: KubeVirtConfig, namespace: NamespaceFacts, notes: TextIO
) -> list[tuple[VmiSpec, RenderedPod]]:
    rows: list[tuple[VmiSpec, RenderedPod]] = []
    quotas = _quota_resources(objects, notes)
    for obj in objects:
        kind = obj.get("kind")
        if kind == QUOTA_KIND:
            continue
        if kind not in (VMI_KIND, VM_KIND):
            print(f"note: skipping {object_ref(obj)}: not a VirtualMachine or VirtualMachineInstance", file=notes)
            continue
        hint = _instancetype_hint(obj)
        facts = namespace.with_quota_resources(quotas.get(_namespace_of(obj), ()))
        try:
            pod = render_launcher_pod(obj, config, facts)
            spec = vmi_spec(obj)
        except InvalidInput as e:
            if hint:
                raise InvalidInput(f"{e.message} (the VM uses {hint}: render its VMI instead)", e.where) from None
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a shape no validator anticipated
            raise InvalidInput(f"malformed object ({type(e).__name__}: {e})", object_ref(obj)) from None
        if hint:
            print(
                f"note: {object_ref(obj)} uses {hint}: rendered from its template alone;"
                " render its VMI for exact figures",
                file=notes,
            )
        rows.append((spec, pod))
    return rows


def profile_note(config: KubeVirtConfig) -> str:
    """Which KubeVirt behaviour the rendering follows, e.g. ``rendered as KubeVirt v1.6 (profile v1.6.4+: a bare
    minor is its newest patch release)``."""
    text = f"rendered as KubeVirt {config.version} (profile {config.profile.name}"
    if config.version != "main" and config.version.count(".") == 1:
        text += ": a bare minor is its newest patch release"
    return text + ")"


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args, sys.stderr)
        namespace = build_namespace(args)
        objects = load_objects(args.filename)
        rows = render_objects(objects, config, namespace, sys.stderr)
        if not rows:
            raise InvalidInput(f"nothing to render: no {VM_KIND} or {VMI_KIND} in the input", args.filename)
    except InvalidInput as e:
        return _fail(str(e))
    print(f"note: {profile_note(config)}", file=sys.stderr)
    try:
        if args.output == "json":
            doc: dict[str, Any] = {
                "kubevirt": {"version": config.version, "profile": config.profile.name},
                "items": [item_json(s, p) for s, p in rows],
            }
            json.dump(doc, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            write_table(rows, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:  # `vmquota render ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0
