"""Scenario files for ``vmquota demo`` (format documented in ``docs/scenarios.md``).

Parsing is strict: unknown keys, unknown modes, bad quantities, steps that name undeclared VMs and expectations
that cannot be checked are refused with an error naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from services.platform.inputs import load_documents
from shared.contract import check_namespace
from shared.errors import InvalidInput
from shared.kubevirt import profile
from shared.kubevirt.config import positive_ratio
from shared.quantity import Quantity
from shared.quota.modes import parse_mode, parse_ratio
from shared.resources import ResourceList, is_dns_subdomain, is_quota_resource_name, parse_resource_list

UNMANAGED = "unmanaged"
VM_STATES = ("Running", "Refused", "Stopped")
MIGRATION_PHASES = ("Succeeded", "Failed", "Pending")


@dataclass(frozen=True)
class QuotaDef:
    name: str
    mode: str  # an accounting mode's name, or "unmanaged"
    hard: ResourceList
    cpu_allocation_ratio: Fraction | None = None


@dataclass(frozen=True)
class NamespaceDef:
    name: str
    labels: Mapping[str, str]
    quotas: tuple[QuotaDef, ...]


@dataclass(frozen=True)
class VmDef:
    name: str
    namespace: str
    sockets: int
    cores: int
    threads: int
    guest: Quantity
    resources: Mapping[str, Any]
    running: bool

    def manifest(self) -> dict[str, Any]:
        """The VirtualMachine object for this definition."""
        domain: dict[str, Any] = {
            "cpu": {"sockets": self.sockets, "cores": self.cores, "threads": self.threads},
            "memory": {"guest": self.guest.canonical()},
            "devices": {},
        }
        if self.resources:
            domain["resources"] = dict(self.resources)
        return {
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachine",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "runStrategy": "Always" if self.running else "Halted",
                "template": {"metadata": {"labels": {"vm.kubevirt.io/name": self.name}}, "spec": {"domain": domain}},
            },
        }


@dataclass(frozen=True)
class Step:
    action: str  # migrate | start | stop | hotplug | tenant
    vms: tuple[str, ...]
    sockets: int | None = None
    memory: Quantity | None = None
    namespace: str = ""
    """``tenant``: the namespace the hostile tenant works in."""

    def describe(self) -> str:
        if self.action == "tenant":
            return (
                f"a tenant of {self.namespace} watches its pods and quota and creates a {self.memory} pod the moment "
                "the quota stops charging a migration's source pod, to take that room"
            )
        if self.action == "hotplug":
            what = ", ".join(
                x
                for x in (
                    f"sockets={self.sockets}" if self.sockets is not None else "",
                    f"memory={self.memory}" if self.memory is not None else "",
                )
                if x
            )
            return f"hotplug {self.vms[0]} ({what})"
        return f"{self.action} {', '.join(self.vms)}"


@dataclass(frozen=True)
class Expectations:
    migrations: Mapping[str, str] = field(default_factory=dict)
    vms: Mapping[str, str] = field(default_factory=dict)
    hard_after: Mapping[str, ResourceList] = field(default_factory=dict)
    tenant_admitted: int | None = None
    """How many of the hostile tenant's pods quota admission may let in (a ``tenant`` step)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    kubevirt_version: str
    cpu_allocation_ratio: Fraction
    namespaces: tuple[NamespaceDef, ...]
    vms: tuple[VmDef, ...]
    steps: tuple[Step, ...]
    expect: Expectations
    migration_step_seconds: float | None = None
    """How long each migration phase after the target pod runs takes, in real seconds whatever ``--speed`` (live
    migrations take seconds); None: the simulator's, scaled by ``--speed``."""

    def vm(self, name: str) -> VmDef:
        for v in self.vms:
            if v.name == name:
                return v
        raise KeyError(name)


def _keys(
    obj: object, where: str, allowed: set[str], required: frozenset[str] | set[str] = frozenset()
) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"expected a mapping, got {type(obj).__name__}", where)
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidInput(
            f"unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(sorted(allowed))}", where
        )
    missing = sorted(required - set(obj))
    if missing:
        raise InvalidInput(f"missing key(s) {', '.join(missing)}", where)
    return obj


def _name(obj: object, where: str, *, dns: bool = True) -> str:
    """An object's name, as the API server takes it (a DNS subdomain: lower-case letters, digits, '-' and '.'); a
    namespace's is a DNS label (:func:`shared.contract.check_namespace`)."""
    if not isinstance(obj, str) or not obj:
        raise InvalidInput(f"expected a non-empty name, got {obj!r}", where)
    if dns and not is_dns_subdomain(obj):
        what = "lower-case letters, digits, '-' and '.'; the API server refuses it"
        raise InvalidInput(f"{obj!r} is not a DNS subdomain ({what})", where)
    return obj


def _hard(obj: object, where: str) -> ResourceList:
    """A quota's ``hard``: resources a ResourceQuota holds (the API server refuses others)."""
    hard = parse_resource_list(obj, where)
    for name in hard:
        if not is_quota_resource_name(name):
            what = "a resource a ResourceQuota holds (e.g. limits.memory, requests.cpu)"
            raise InvalidInput(f"{name!r} is not {what}", f"{where}.{name}")
    return hard


def _int(obj: object, where: str, lo: int = 0, hi: int = 1024) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int) or not lo <= obj <= hi:
        raise InvalidInput(f"expected a whole number in {lo}..{hi}, got {obj!r}", where)
    return obj


def _quota_ratio(obj: object, where: str) -> Fraction:
    """A quota's ``cpuAllocationRatio``: what its ``vmquota.io/cpu-allocation-ratio`` annotation accepts (YAML may
    give a float)."""
    return parse_ratio(str(obj) if isinstance(obj, float) else obj, where)


def _names(obj: object, where: str) -> tuple[str, ...]:
    if isinstance(obj, str):
        return (obj,)
    if not isinstance(obj, list) or not obj:
        raise InvalidInput("expected a VM name or a non-empty list of VM names", where)
    return tuple(_name(x, f"{where}[{i}]") for i, x in enumerate(obj))


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    """Validate a loaded YAML document into a :class:`Scenario`; InvalidInput names the file and key."""
    try:
        return _parse(data)
    except InvalidInput as e:
        raise e.at(source) from None


def _parse(data: object) -> Scenario:
    top = _keys(
        data,
        "",
        {"name", "description", "kubevirt", "namespaces", "vms", "steps", "expect"},
        {"name", "namespaces", "vms"},
    )
    kv = _keys(top.get("kubevirt") or {}, "kubevirt", {"version", "cpuAllocationRatio", "migrationStepSeconds"})
    step_seconds: float | None = None
    if "migrationStepSeconds" in kv:
        raw = kv["migrationStepSeconds"]
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 < raw <= 60:
            raise InvalidInput(f"expected seconds in (0, 60], got {raw!r}", "kubevirt.migrationStepSeconds")
        step_seconds = float(raw)
    version = str(kv.get("version", "v1.9"))
    profile(version)  # validates
    ratio = positive_ratio(kv.get("cpuAllocationRatio", 10), "kubevirt.cpuAllocationRatio")  # as in the KubeVirt CR

    namespaces: list[NamespaceDef] = []
    for i, ns in enumerate(top.get("namespaces") or []):
        w = f"namespaces[{i}]"
        nd = _keys(ns, w, {"name", "labels", "quotas"}, {"name"})
        labels = nd.get("labels") or {}
        if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
            raise InvalidInput("expected a map of strings", f"{w}.labels")
        quotas: list[QuotaDef] = []
        for j, q in enumerate(nd.get("quotas") or []):
            qw = f"{w}.quotas[{j}]"
            qd = _keys(q, qw, {"name", "mode", "hard", "cpuAllocationRatio"}, {"name", "hard"})
            mode = str(qd.get("mode", "VmiPodUsage"))
            if mode != UNMANAGED:
                try:
                    mode = str(parse_mode(mode))
                except InvalidInput as e:
                    raise InvalidInput(f"{e.message} (or {UNMANAGED!r})", f"{qw}.mode") from None
            qratio = qd.get("cpuAllocationRatio")
            quotas.append(
                QuotaDef(
                    name=_name(qd["name"], f"{qw}.name"),
                    mode=mode,
                    hard=_hard(qd["hard"], f"{qw}.hard"),
                    cpu_allocation_ratio=None if qratio is None else _quota_ratio(qratio, f"{qw}.cpuAllocationRatio"),
                )
            )
        namespaces.append(NamespaceDef(check_namespace(nd["name"], f"{w}.name"), dict(labels), tuple(quotas)))
    ns_names = {n.name for n in namespaces}
    if len(ns_names) != len(namespaces):
        raise InvalidInput("namespace names must be unique", "namespaces")

    vms: list[VmDef] = []
    for i, vm in enumerate(top.get("vms") or []):
        w = f"vms[{i}]"
        vd = _keys(
            vm, w, {"name", "namespace", "cpu", "memory", "resources", "running"}, {"name", "namespace", "memory"}
        )
        ns = _name(vd["namespace"], f"{w}.namespace")
        if ns not in ns_names:
            raise InvalidInput(f"namespace {ns!r} is not declared under namespaces", f"{w}.namespace")
        cpu = _keys(vd.get("cpu") or {}, f"{w}.cpu", {"sockets", "cores", "threads"})
        mem = _keys(vd["memory"], f"{w}.memory", {"guest"}, {"guest"})
        try:
            guest = Quantity.parse(mem["guest"])
        except InvalidInput as e:
            raise e.at(f"{w}.memory.guest") from None
        res = _keys(vd.get("resources") or {}, f"{w}.resources", {"requests", "limits"})
        for part in ("requests", "limits"):
            parse_resource_list(res.get(part), f"{w}.resources.{part}")
        running = vd.get("running", True)
        if not isinstance(running, bool):
            raise InvalidInput(f"expected true or false, got {running!r}", f"{w}.running")
        vms.append(
            VmDef(
                name=_name(vd["name"], f"{w}.name"),
                namespace=ns,
                sockets=_int(cpu.get("sockets", 1), f"{w}.cpu.sockets", 1),
                cores=_int(cpu.get("cores", 1), f"{w}.cpu.cores", 1),
                threads=_int(cpu.get("threads", 1), f"{w}.cpu.threads", 1),
                guest=guest,
                resources=dict(res),
                running=running,
            )
        )
    vm_names = {v.name for v in vms}
    if len(vm_names) != len(vms):
        raise InvalidInput("VM names must be unique", "vms")

    steps: list[Step] = []
    for i, st in enumerate(top.get("steps") or []):
        w = f"steps[{i}]"
        sd = _keys(st, w, {"migrate", "start", "stop", "hotplug", "tenant"})
        if len(sd) != 1:
            raise InvalidInput("each step has exactly one of migrate, start, stop, hotplug, tenant", w)
        ((action, arg),) = sd.items()
        if action == "tenant":
            td = _keys(arg, f"{w}.tenant", {"namespace", "memory"}, {"namespace", "memory"})
            if td["namespace"] not in {n.name for n in namespaces}:
                raise InvalidInput(f"namespace {td['namespace']!r} is not declared", f"{w}.tenant.namespace")
            try:
                size = Quantity.parse(td["memory"])
            except InvalidInput as e:
                raise e.at(f"{w}.tenant.memory") from None
            steps.append(Step("tenant", (), memory=size, namespace=str(td["namespace"])))
            continue
        if action == "hotplug":
            hd = _keys(arg, f"{w}.hotplug", {"vm", "sockets", "memory"}, {"vm"})
            if "sockets" not in hd and "memory" not in hd:
                raise InvalidInput("hotplug needs sockets and/or memory", f"{w}.hotplug")
            memory = None
            if "memory" in hd:
                try:
                    memory = Quantity.parse(hd["memory"])
                except InvalidInput as e:
                    raise e.at(f"{w}.hotplug.memory") from None
            step = Step(
                "hotplug",
                (_name(hd["vm"], f"{w}.hotplug.vm"),),
                sockets=_int(hd["sockets"], f"{w}.hotplug.sockets", 1) if "sockets" in hd else None,
                memory=memory,
            )
        else:
            step = Step(action, _names(arg, f"{w}.{action}"))
        for vm_name in step.vms:
            if vm_name not in vm_names:
                raise InvalidInput(f"VM {vm_name!r} is not declared under vms", w)
        steps.append(step)

    ex = _keys(top.get("expect") or {}, "expect", {"migrations", "vms", "hard_after", "tenant_admitted"})
    tenant_admitted = _int(ex["tenant_admitted"], "expect.tenant_admitted", 0) if "tenant_admitted" in ex else None
    migrations = _keys(ex.get("migrations") or {}, "expect.migrations", vm_names)
    for k, v in migrations.items():
        if v not in MIGRATION_PHASES:
            raise InvalidInput(f"expected one of {', '.join(MIGRATION_PHASES)}, got {v!r}", f"expect.migrations.{k}")
    vm_exp = _keys(ex.get("vms") or {}, "expect.vms", vm_names)
    for k, v in vm_exp.items():
        if v not in VM_STATES:
            raise InvalidInput(f"expected one of {', '.join(VM_STATES)}, got {v!r}", f"expect.vms.{k}")
    quota_keys = {f"{n.name}/{q.name}" for n in namespaces for q in n.quotas}
    hard_raw = _keys(ex.get("hard_after") or {}, "expect.hard_after", quota_keys)
    hard_after = {k: parse_resource_list(v, f"expect.hard_after.{k}") for k, v in hard_raw.items()}
    return Scenario(
        name=_name(top["name"], "name", dns=False),  # (the scenario's own: no object's)
        description=str(top.get("description") or "").strip(),
        kubevirt_version=version,
        migration_step_seconds=step_seconds,
        cpu_allocation_ratio=ratio,
        namespaces=tuple(namespaces),
        vms=tuple(vms),
        steps=tuple(steps),
        expect=Expectations(dict(migrations), dict(vm_exp), hard_after, tenant_admitted),
    )


def load_scenario(path: str | Path) -> Scenario:
    name, docs = load_documents(path)
    if len(docs) != 1:
        why = "the file is empty" if not docs else f"expected one scenario, got {len(docs)} documents"
        raise InvalidInput(why, name)
    return parse_scenario(docs[0], name)


def builtin_scenarios() -> list[Scenario]:
    """The embedded seed scenarios of DESIGN.md section 5, in order."""
    folder = resources.files("services.devtools.demo") / "scenarios"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out.append(parse_scenario(yaml.safe_load(entry.read_text()), f"builtin:{entry.name}"))
    return out
