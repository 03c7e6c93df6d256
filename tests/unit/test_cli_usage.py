"""``vmquota usage``: per-namespace usage in a mode, as JSON and as a table; bad input exits 2 with one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli.main import build_parser, main
from services.cli.usage import account_all, build_config, build_policy, load_snapshots, namespace_json
from shared.errors import InvalidInput
from shared.normalize import parse_refusal
from shared.quota.modes import Mode
from tests.builders import launcher_obj, pod_obj, quota_obj, refusal_event, refused_vmi, vmi_obj, vmim_obj


def write(tmp_path: Path, objs: list[dict[str, Any]], name: str = "objs.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objs))
    return str(path)


@pytest.fixture
def namespace_file(tmp_path: Path) -> str:
    running = vmi_obj("vm1", vcpus=4, guest="4Gi")
    pending = vmi_obj("vm2", vcpus=2, guest="2Gi", t=5, phase="Pending")
    other_ns = vmi_obj("vm3", vcpus=1, guest="1Gi", namespace="other")
    objs = [
        running,
        launcher_obj(running),
        pending,
        other_ns,
        launcher_obj(other_ns),
        pod_obj("web", {"cpu": "250m", "memory": "512Mi"}),
        vmim_obj("m1", "vm1", rejected=True),
        {"kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "tenant"}},
        refusal_event("vm2", {"requests.cpu": "300m"}, t=10) | {"reason": "Scheduled"},
    ]
    return write(tmp_path, objs)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["usage", *argv, "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict)
    return out


def test_json_virtual_resources(capsys: pytest.CaptureFixture[str], namespace_file: str) -> None:
    out = run_json(capsys, "--mode", "VirtualResources", "-f", namespace_file)
    assert set(out["namespaces"]) == {"tenant", "other"}
    tenant = out["namespaces"]["tenant"]
    assert tenant["mode"] == "VirtualResources"
    # vm1 (4 vCPUs, 4Gi) + vm2 (2 vCPUs, 2Gi, admitted: no budget) + the web pod (250m, 512Mi)
    assert tenant["used"]["requests.cpu"] == "6250m"
    assert tenant["used"]["requests.memory"] == "6656Mi"
    assert tenant["used"]["pods"] == "3"
    by_name = {(o["kind"], o["name"]): o for o in tenant["objects"]}
    vm1 = by_name[("VirtualMachineInstance", "vm1")]
    assert vm1["state"] == "running" and vm1["counts"]["requests.cpu"] == "4" and vm1["reason"]
    vm2 = by_name[("VirtualMachineInstance", "vm2")]
    assert vm2["state"] == "admitted" and "reserved" not in vm2, "room is held once KubeVirt is refused the pod"
    assert "once KubeVirt is refused it" in vm2["reason"]
    mig = by_name[("VirtualMachineInstanceMigration", "m1")]
    assert mig["state"] == "pending" and mig["vmi"] == "vm1" and mig["reserved"]["pods"] == "1"
    launcher = next(o for o in tenant["objects"] if o["kind"] == "Pod" and o["role"] == "launcher")
    assert launcher["counts"] == {} and launcher["charged"]["pods"] == "1" and launcher["vmi"] == "vm1"
    web = by_name[("Pod", "web")]
    assert web["role"] == "non-vm" and web["counts"] == web["charged"]
    assert out["namespaces"]["other"]["used"]["requests.cpu"] == "1"
    assert capsys.readouterr().err == ""  # notes were read before


def test_notes_for_skipped_objects(capsys: pytest.CaptureFixture[str], namespace_file: str) -> None:
    assert main(["usage", "--mode", "VmiPodUsage", "-f", namespace_file, "-o", "json"]) == 0
    err = capsys.readouterr().err
    assert "skipping ConfigMap tenant/cm" in err and "skipping Event tenant/vm2.10" in err


@pytest.mark.parametrize(("ratio", "vm1_cpu"), [("4", "1"), ("2", "2")])
def test_ratio_mode(capsys: pytest.CaptureFixture[str], namespace_file: str, ratio: str, vm1_cpu: str) -> None:
    out = run_json(
        capsys,
        "--mode",
        str(Mode.VIRTUAL_RESOURCES_WITH_CPU_ALLOCATION_RATIO),
        "--cpu-allocation-ratio",
        ratio,
        "-f",
        namespace_file,
    )
    tenant = out["namespaces"]["tenant"]
    assert tenant["cpuAllocationRatio"] == ratio
    vm1 = next(o for o in tenant["objects"] if o["name"] == "vm1")
    assert vm1["counts"]["requests.cpu"] == vm1_cpu and vm1["counts"]["limits.cpu"] == "4"


def test_ratio_defaults_to_the_kubevirt_cr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    v = vmi_obj("vm1", vcpus=8)
    kv = {
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"cpuAllocationRatio": 8}}},
    }
    path = write(tmp_path, [v, kv])
    out = run_json(capsys, "--mode", "VirtualResourcesWithCPUAllocationRatio", "-f", path)
    assert out["namespaces"]["tenant"]["used"]["requests.cpu"] == "1"
    cr = write(
        tmp_path, [dict(kv, spec={"configuration": {"developerConfiguration": {"cpuAllocationRatio": 2}}})], "kv.yaml"
    )
    out = run_json(capsys, "--mode", "VirtualResourcesWithCPUAllocationRatio", "--kubevirt-config", cr, "-f", path)
    assert out["namespaces"]["tenant"]["used"]["requests.cpu"] == "4"


def test_kubevirt_version_overrides_the_version_of_a_kubevirt_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kv = {
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"cpuAllocationRatio": 8}}},
        "status": {"observedKubeVirtVersion": "v0.1.0"},
    }
    files = ["--kubevirt-config", write(tmp_path, [kv], "kv.yaml"), "-f", write(tmp_path, [vmi_obj("vm1", vcpus=8)])]
    mode = "VirtualResourcesWithCPUAllocationRatio"
    err = bad(capsys, "--mode", mode, *files)
    assert "kv.yaml: KubeVirt kubevirt/kubevirt: status.observedKubeVirtVersion" in err and "v0.1.0" in err
    out = run_json(capsys, "--mode", mode, "--kubevirt-version", "v1.9", *files)
    assert out["namespaces"]["tenant"]["used"]["requests.cpu"] == "1", "the file's ratio, with the given version"


@pytest.mark.parametrize("given_as", ["in the file", "--kubevirt-config"])
def test_a_kubevirt_newer_than_known_is_estimated_as_main_and_said_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, given_as: str
) -> None:
    kv = {
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "status": {"observedKubeVirtVersion": "v1.42.0"},
    }
    v = vmi_obj("vm1", vcpus=2)
    files = ["-f", write(tmp_path, [v, kv])]
    if given_as == "--kubevirt-config":
        files = ["--kubevirt-config", write(tmp_path, [kv], "kv.yaml"), "-f", write(tmp_path, [v])]

    def usage(*version: str) -> tuple[object, str]:
        assert main(["usage", "--mode", "VmiPodUsage", *version, *files, "-o", "json"]) == 0
        got = capsys.readouterr()
        return json.loads(got.out)["namespaces"]["tenant"]["used"], got.err

    fallback, err = usage()
    note = "KubeVirt v1.42.0 is newer than this build knows (up to v1.9): launcher pods are estimated as for main"
    assert f"note: {note}" in err
    as_main, err_main = usage("--kubevirt-version", "main")
    as_v19, err_v19 = usage("--kubevirt-version", "v1.9")
    assert fallback == as_main != as_v19, "estimated with main's profile"
    assert "newer than this build" not in err_main + err_v19, "a version given explicitly is no fallback"


def test_table_output(capsys: pytest.CaptureFixture[str], namespace_file: str) -> None:
    assert main(["usage", "--mode", "VirtualResources", "-f", namespace_file]) == 0
    out = capsys.readouterr().out
    assert "NAMESPACE tenant  MODE VirtualResources" in out and "NAMESPACE other" in out
    lines = out[out.index("NAMESPACE tenant") :].splitlines()
    cpu_row = next(line for line in lines if line.startswith("requests.cpu "))
    assert cpu_row.split()[1] == "6250m"
    assert any(line.startswith("VMI ") and "vm2" in line and "admitted" in line for line in lines)
    assert any(line.startswith("VMIM ") and "reserves" in line for line in lines)


def test_objects_without_namespace_use_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    v = vmi_obj("vm1")
    del v["metadata"]["namespace"]
    out = run_json(capsys, "--mode", "VirtualResources", "-n", "lab", "-f", write(tmp_path, [v]))
    assert list(out["namespaces"]) == ["lab"]


def test_stdin(tmp_path: Path) -> None:
    text = json.dumps({"kind": "List", "items": [vmi_obj("vm1", vcpus=3)]})
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "usage", "--mode", "VirtualResources", "-f", "-", "-o", "json"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["namespaces"]["tenant"]["used"]["requests.cpu"] == "3"


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["usage", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


def test_malformed_object_names_object_and_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    v = vmi_obj("vm1", guest="lots")
    err = bad(capsys, "--mode", "VirtualResources", "-f", write(tmp_path, [v]))
    assert "VirtualMachineInstance tenant/vm1: spec.domain.memory.guest" in err
    p = pod_obj("web", {"cpu": "1K"})
    err = bad(capsys, "--mode", "VmiPodUsage", "-f", write(tmp_path, [p]))
    assert "Pod tenant/web: spec.containers[0].resources.requests.cpu" in err


def test_bad_options_and_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, namespace_file: str) -> None:
    err = bad(capsys, "--mode", "Pods", "-f", namespace_file)
    assert "--mode" in err and "VirtualResourcesWithCPUAllocationRatio" in err
    err = bad(
        capsys, "--mode", "VirtualResourcesWithCPUAllocationRatio", "--cpu-allocation-ratio", "0", "-f", namespace_file
    )
    assert "--cpu-allocation-ratio" in err
    err = bad(capsys, "--mode", "VirtualResources", "-f", str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Pod\n  bad: [indent\n")
    assert "broken.yaml" in bad(capsys, "--mode", "VirtualResources", "-f", str(broken))
    err = bad(capsys, "--mode", "VirtualResources", "--kubevirt-version", "v2.0", "-f", namespace_file)
    assert "--kubevirt-version" in err


def test_ratio_flag_in_another_mode_is_noted(capsys: pytest.CaptureFixture[str], namespace_file: str) -> None:
    assert main(["usage", "--mode", "VirtualResources", "--cpu-allocation-ratio", "4", "-f", namespace_file]) == 0
    assert "no effect" in capsys.readouterr().err


def test_the_building_blocks_give_plain_json(namespace_file: str) -> None:
    notes = io.StringIO()
    args = build_parser().parse_args(["usage", "--mode", "VmiPodUsage", "-f", namespace_file])
    snaps = load_snapshots(namespace_file, "default", notes)
    results = account_all(
        snaps, build_policy(args, notes), build_config(args, snaps, notes), datetime(2025, 1, 2, tzinfo=UTC)
    )
    data = {ns: namespace_json(u) for ns, u in results.items()}
    assert json.loads(json.dumps(data)) == data
    assert data["tenant"]["used"]["requests.cpu"] == data["tenant"]["used"]["cpu"]
    assert "ConfigMap" in notes.getvalue()


# ---- against the managed quotas in the input, and VMs -----------------------------------------------------------


def vm_obj(name: str, guest: str, *, t: int, run: str = "Always", namespace: str = "tenant") -> dict[str, Any]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "creationTimestamp": f"2026-01-01T00:00:{t:02d}Z",
        },
        "spec": {
            "runStrategy": run,
            "template": {"spec": {"domain": {"cpu": {"sockets": 4}, "memory": {"guest": guest}, "devices": {}}}},
        },
    }


def managed_quota(hard: dict[str, str], namespace: str = "tenant") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": "vm-size",
            "namespace": namespace,
            "labels": {"vmquota.io/managed": "true"},
            "annotations": {"vmquota.io/mode": "VirtualResources"},
        },
        "spec": {"hard": hard},
    }


def test_vms_are_admitted_against_the_managed_quota_in_creation_order(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Five 16Gi VMs and a 64Gi budget: the first four are admitted, the fifth is refused, as the ledger decides
    (not five admitted at 80Gi, as without the budget); a halted VM is skipped, and each VM read from its
    template is said so."""
    objs: list[dict[str, Any]] = [managed_quota({"limits.memory": "64Gi", "requests.memory": "64Gi"})]
    objs += [vm_obj(f"vm{i}", "16Gi", t=i) for i in (5, 4, 3, 2, 1)]  # (file order is not creation order)
    objs.append(vm_obj("vm6", "16Gi", t=6, run="Halted"))
    path = write(tmp_path, objs)
    assert main(["usage", "-f", path, "-o", "json"]) == 0
    captured = capsys.readouterr()
    tenant = json.loads(captured.out)["namespaces"]["tenant"]
    quota = tenant["quotas"]["vm-size"]
    assert quota["budget"]["limits.memory"] == "64Gi"
    assert quota["used"]["limits.memory"] == "64Gi" and quota["overBudget"] == []
    states = {o["name"]: o["state"] for o in tenant["objects"] if o["kind"] == "VirtualMachineInstance"}
    assert states == {"vm1": "admitted", "vm2": "admitted", "vm3": "admitted", "vm4": "admitted", "vm5": "refused"}
    vm5 = next(o for o in tenant["objects"] if o["name"] == "vm5")
    assert "limits.memory" in vm5["refusedBy"]["vm-size"], vm5
    assert "note: skipping VirtualMachine tenant/vm6: run strategy Halted starts no VMI" in captured.err
    assert "VirtualMachine tenant/vm1 has no VMI in the input: counted as the VMI its template gives" in captured.err

    assert main(["usage", "-f", path]) == 0  # the table says the same
    table = capsys.readouterr().out
    assert "QUOTA vm-size  MODE VirtualResources" in table and "BUDGET" in table
    assert [line.split()[2] for line in table.splitlines() if line.startswith("VMI ")] == [
        *["admitted"] * 4,
        "refused",
    ]


def test_without_a_managed_quota_or_mode_nothing_is_accounted_and_it_says_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, [vm_obj("vm1", "16Gi", t=1)])
    assert main(["usage", "-f", path]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (after the notes on what was read and skipped)
    assert last.startswith("error: ") and "nothing to account" in last and "give --mode" in last, last
    both = write(tmp_path, [vm_obj("vm1", "16Gi", t=1, namespace="a"), managed_quota({"limits.memory": "8Gi"}, "b")])
    assert main(["usage", "-f", both, "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)["namespaces"]) == {"b"}
    assert "note: skipping namespace a: no managed ResourceQuota in the input and no --mode" in captured.err
    assert main(["usage", "--mode", "VirtualResources", "-f", both, "-o", "json"]) == 0  # --mode: the rest too
    out = json.loads(capsys.readouterr().out)["namespaces"]
    assert out["a"]["used"]["limits.memory"] == "16Gi" and "quotas" in out["b"]


def test_a_tenants_event_text_reaches_the_table_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tenant's FailedCreate Event names a "resource" carrying terminal escapes (a title, a cleared screen). Before,
    `vmquota usage` printed it raw in its warning line; now quota refusal names must be resource names (the Event is
    unreadable, and said so), and every cell and warning is written escaped."""
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[1;1Hlimits.memory"
    with pytest.raises(InvalidInput, match="cannot read requested amount"):
        parse_refusal(f"exceeded quota: rq, requested: {evil}=1Gi, used: limits.memory=0, limited: limits.memory=0")
    vmi = refused_vmi(vmi_obj("vm1", guest="1Gi", phase="Pending", t=5))
    vmi["metadata"]["annotations"] = {"note": "\x1b[2J"}
    objs = [quota_obj("rq", {"limits.memory": "64Gi"}), vmi, refusal_event("vm1", {evil: "1Gi"}, t=6)]
    main(["usage", "-f", write(tmp_path, objs)])
    out = capsys.readouterr()
    assert "\x1b" not in out.out and "\x1b" not in out.err, (out.out[-400:], out.err[-400:])
    assert "cannot read requested amount" in out.out + out.err


def test_the_table_shows_amounts_readably_and_the_json_exactly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pod charged 17521053376 bytes: the table says 16.3Gi, as ``vmquota status`` would (it mixed 64Gi with raw
    byte counts), and the JSON keeps the exact quantity."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "t"},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"memory": "17521053376", "cpu": "1"}}}]},
    }
    path = write(tmp_path, [pod])
    assert main(["usage", "--mode", "VmiPodUsage", "-f", path]) == 0
    table = capsys.readouterr().out
    assert "requests.memory  16.3Gi" in table and "17521053376" not in table, table
    assert main(["usage", "--mode", "VmiPodUsage", "-f", path, "-o", "json"]) == 0
    used = json.loads(capsys.readouterr().out)["namespaces"]["t"]["used"]
    assert used["requests.memory"] == "17521053376", used
