"""Scenario files for ``vmquota demo``: the built-in ones parse, and every kind of mistake is named precisely."""

from __future__ import annotations

import copy
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.devtools.demo.scenario import builtin_scenarios, load_scenario, parse_scenario
from shared.errors import InvalidInput
from shared.quantity import Quantity

SCENARIOS = Path(__file__).resolve().parents[2] / "services" / "devtools" / "demo" / "scenarios"

GOOD: dict[str, Any] = {
    "name": "t",
    "namespaces": [{"name": "a", "quotas": [{"name": "q", "mode": "VmiPodUsage", "hard": {"limits.memory": "8Gi"}}]}],
    "vms": [
        {"name": "vm1", "namespace": "a", "cpu": {"sockets": 2}, "memory": {"guest": "2Gi"}},
        {"name": "vm2", "namespace": "a", "memory": {"guest": "1Gi"}, "running": False},
    ],
    "steps": [{"migrate": ["vm1"]}, {"start": "vm2"}, {"hotplug": {"vm": "vm1", "sockets": 3}}, {"stop": ["vm2"]}],
    "expect": {
        "migrations": {"vm1": "Succeeded"},
        "vms": {"vm2": "Stopped"},
        "hard_after": {"a/q": {"limits.memory": "8Gi"}},
    },
}


def test_builtin_scenarios_are_the_three_seed_scenarios_and_the_tenant() -> None:
    names = [s.name for s in builtin_scenarios()]
    assert names == ["full-quota-migration", "concurrent-migrations", "allocation-ratio", "tenant-adversary"]
    tenant = builtin_scenarios()[3]
    assert [s.action for s in tenant.steps] == ["tenant", "migrate"]
    assert tenant.expect.tenant_admitted == 0 and tenant.migration_step_seconds == 0.25
    ratio = builtin_scenarios()[2]
    assert ratio.cpu_allocation_ratio == 4
    assert ratio.namespaces[0].quotas[0].mode == "VirtualResourcesWithCPUAllocationRatio"


def test_good_scenario_parses_with_defaults() -> None:
    sc = parse_scenario(GOOD)
    assert sc.kubevirt_version == "v1.9" and sc.cpu_allocation_ratio == 10
    vm1 = sc.vm("vm1")
    assert (vm1.sockets, vm1.cores, vm1.threads, vm1.running) == (2, 1, 1, True)
    assert sc.vm("vm2").running is False
    assert [s.action for s in sc.steps] == ["migrate", "start", "hotplug", "stop"]
    assert sc.steps[1].vms == ("vm2",)
    assert sc.expect.hard_after["a/q"]["limits.memory"] == Quantity.parse("8Gi")
    manifest = vm1.manifest()
    assert manifest["kind"] == "VirtualMachine" and manifest["spec"]["runStrategy"] == "Always"
    assert manifest["spec"]["template"]["spec"]["domain"]["memory"]["guest"] == "2Gi"


def _broken(path: list[Any], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


def test_ratios_may_be_fractional() -> None:
    doc = copy.deepcopy(GOOD)
    doc["kubevirt"] = {"cpuAllocationRatio": 2.5}
    doc["namespaces"][0]["quotas"][0]["cpuAllocationRatio"] = 1.5
    sc = parse_scenario(doc, "scenario")
    assert sc.cpu_allocation_ratio == Fraction(5, 2)
    assert sc.namespaces[0].quotas[0].cpu_allocation_ratio == Fraction(3, 2)


@pytest.mark.parametrize(
    ("path", "value", "where", "what"),
    [
        (["typo"], 1, "scenario", "unknown key(s) typo"),
        (["vms"], KeyError, "scenario", "missing key(s) vms"),
        (["namespaces", 0, "quotas", 0, "mode"], "Virtual", "namespaces[0].quotas[0].mode", "Virtual"),
        (["namespaces", 0, "quotas", 0, "hard"], {"limits.memory": "8 Gigs"}, "hard.limits.memory", "invalid"),
        (["vms", 0, "memory", "guest"], "-1Gi", "vms[0].memory.guest", "negative"),
        (["vms", 0, "namespace"], "nope", "vms[0].namespace", "not declared"),
        (["vms", 0, "cpu", "sockets"], 0, "vms[0].cpu.sockets", "whole number"),
        (["steps", 0], {"migrate": ["vm9"]}, "steps[0]", "'vm9' is not declared"),
        (["steps", 0], {"migrate": ["vm1"], "stop": ["vm1"]}, "steps[0]", "exactly one"),
        (["steps", 2, "hotplug"], {"vm": "vm1"}, "steps[2].hotplug", "sockets and/or memory"),
        (["steps", 0], {"tenant": {"namespace": "zz", "memory": "1Gi"}}, "steps[0].tenant.namespace", "not declared"),
        (["steps", 0], {"tenant": {"namespace": "a", "memory": "lots"}}, "steps[0].tenant.memory", "invalid"),
        (["steps", 0], {"tenant": {"namespace": "a"}}, "steps[0].tenant", "missing key(s) memory"),
        (["expect", "tenant_admitted"], -1, "expect.tenant_admitted", "whole number"),
        (["kubevirt"], {"migrationStepSeconds": 0}, "kubevirt.migrationStepSeconds", "seconds in (0, 60]"),
        (["expect", "vms", "vm2"], "Gone", "expect.vms.vm2", "Running, Refused, Stopped"),
        (["expect", "hard_after"], {"a/other": {"cpu": "1"}}, "expect.hard_after", "unknown key(s) a/other"),
        (["kubevirt"], {"version": "v0.1"}, "scenario", "v0.1"),
        (["kubevirt"], {"cpuAllocationRatio": 0}, "kubevirt.cpuAllocationRatio", "greater than 0"),
        (["namespaces", 0, "quotas", 0, "cpuAllocationRatio"], 2000, "quotas[0].cpuAllocationRatio", "at most 1000"),
        (["namespaces", 0, "quotas", 0, "cpuAllocationRatio"], "x", "quotas[0].cpuAllocationRatio", "positive"),
        # names and resources the API server refuses (the demo ended in a traceback, or waited 10 s for a quota)
        (["vms", 0, "name"], "VM_1", "vms[0].name", "'VM_1' is not a DNS subdomain"),
        (["namespaces", 0, "name"], "Tenant_A", "namespaces[0].name", "'Tenant_A' is not a DNS label"),
        (["namespaces", 0, "quotas", 0, "name"], "Bad_Q", "quotas[0].name", "'Bad_Q' is not a DNS subdomain"),
        (["namespaces", 0, "quotas", 0, "hard"], {"bogus.resource": "1"}, "hard.bogus.resource", "not a resource"),
    ],
)
def test_mistakes_are_named(path: list[Any], value: Any, where: str, what: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_scenario(_broken(path, value), "scenario")
    text = str(err.value)
    assert where in text and what in text, text


def test_load_scenario_reports_file_problems(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="no such file"):
        load_scenario(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(InvalidInput, match="invalid YAML"):
        load_scenario(bad)
    bad.write_text("name: a\n---\nname: b\n")
    with pytest.raises(InvalidInput, match="expected one scenario, got 2 documents"):
        load_scenario(bad)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD))
    assert load_scenario(good).name == "t"


def test_cli_exits_2_with_one_line_for_a_malformed_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_broken(["vms", 0, "memory", "guest"], "lots")))
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "demo", "--scenario-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "vms[0].memory.guest" in lines[0] and "Traceback" not in proc.stderr


def test_running_a_service_loads_neither_the_simulator_nor_the_demo() -> None:
    """Production services never import the simulated cluster: the CLI loads only the chosen sub-command."""
    code = (
        "import sys\n"
        "from services.cli import main as cli\n"
        "try:\n"
        "    cli.main(['run', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = sorted(m for m in sys.modules if m.startswith('services.devtools'))\n"
        "print('loaded=' + ','.join(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "usage: vmquota run" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "loaded="


def test_a_migration_with_no_phase_yet_or_none_at_all_is_named_as_a_scenario_states_it() -> None:
    """A step that made no migration (a hotplug of a stopped VM) has no phase: the run said ``expected Pending, got
    Pending`` and failed, and its JSON gave a phase of ``""``."""
    from services.devtools.demo.play import MigrationRecord, RunResult, _check

    none = MigrationRecord(vm="vm1", namespace="tenant-a")
    unset = MigrationRecord(vm="vm2", namespace="tenant-a", name="vm2-mig", uid="u2")
    assert (none.shown_phase, unset.shown_phase) == ("(no migration)", "Pending")
    doc = yaml.safe_load((SCENARIOS / "1-full-quota-migration.yaml").read_text())
    doc["expect"] = {"migrations": {"vm1": "Pending", "vm2": "Pending"}}
    scenario = parse_scenario(doc)
    result = RunResult(scenario="s", with_vmquota=True, migrations={"vm1": none, "vm2": unset})
    _check(scenario, result)
    assert result.failures == ["migration of vm1: expected Pending, got (no migration)"]
