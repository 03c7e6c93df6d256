"""``vmquota render`` and ``services.platform.inputs``: good input in both formats, stdin, bad input -> exit 2
with one line."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import render as cli_render
from services.platform.inputs import load_objects, parse_objects
from shared.errors import InvalidInput

VMI_YAML = """\
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: vmi1
  namespace: tenant-a
  creationTimestamp: 2024-01-01T00:00:00Z
spec:
  domain:
    cpu: {sockets: 2}
    resources: {requests: {memory: 1Gi}}
---
---
apiVersion: v1
kind: List
items:
- apiVersion: kubevirt.io/v1
  kind: VirtualMachine
  metadata: {name: vm2, namespace: tenant-a}
  spec:
    runStrategy: Always
    template:
      spec:
        domain:
          memory: {guest: 2Gi}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: cm, namespace: tenant-a}
"""

KUBEVIRT_CR = """\
apiVersion: kubevirt.io/v1
kind: KubeVirt
metadata: {name: kubevirt, namespace: kubevirt}
spec:
  configuration:
    developerConfiguration: {cpuAllocationRatio: 4}
status: {observedKubeVirtVersion: v1.5.1}
"""


def run(argv: list[str], stdin: str = "", monkeypatch: pytest.MonkeyPatch | None = None, capsys=None):
    parser = argparse.ArgumentParser(prog="vmquota render")
    cli_render.add_arguments(parser)
    args = parser.parse_args(argv)
    if monkeypatch is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli_render.run(args)
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


@pytest.fixture()
def vmis(tmp_path: Path) -> Path:
    p = tmp_path / "vmis.yaml"
    p.write_text(VMI_YAML)
    return p


def test_json_output(vmis, capsys):
    code, out, err = run(["-f", str(vmis), "-o", "json", "--quota-has", "limits.cpu,limits.memory"], capsys=capsys)
    assert code == 0
    doc = json.loads(out)
    assert [i["name"] for i in doc["items"]] == ["vmi1", "vm2"]
    first = doc["items"][0]
    assert set(first) == {"name", "namespace", "containers", "pod", "memoryOverhead"}
    assert first["namespace"] == "tenant-a"
    assert first["memoryOverhead"] == "291504128"  # 278 Mi (v1.9, 2 vCPUs, page tables of 1Gi), DecimalSI
    devices = {"devices.kubevirt.io/kvm": "1", "devices.kubevirt.io/tun": "1", "devices.kubevirt.io/vhost-net": "1"}
    assert first["containers"]["compute"] == {
        "requests": {"cpu": "200m", "ephemeral-storage": "50M", "memory": "1302Mi", **devices},
        "limits": {"cpu": "2", "memory": "2604Mi", **devices},
    }
    assert first["pod"]["requests"]["cpu"] == "205m"
    assert set(first["pod"]) == {"requests", "limits"}
    assert "note: skipping ConfigMap tenant-a/cm" in err


def test_table_output(vmis, capsys):
    code, out, _ = run(["-f", str(vmis)], capsys=capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAMESPACE", "NAME", "KIND", "VCPUS", "GUEST"]
    # (the compute container sets no limit: the pod has none, and 15m is its sidecar's; the note says so)
    assert lines[1].split()[:7] == ["tenant-a", "vmi1", "VMI", "2", "1Gi", "205m", "15m*"]
    assert lines[2].split()[:5] == ["tenant-a", "vm2", "VM", "1", "2Gi"]
    assert lines[1].split()[-1] == "278Mi"
    assert lines[-1].startswith("(*: some container sets no such limit, so the pod has none")
    code, out, _ = run(["-f", str(vmis), "--quota-has", "limits.cpu,limits.memory"], capsys=capsys)
    assert code == 0 and "*" not in out, out


def test_a_resourcequota_in_the_input_sets_its_namespaces_automatic_limits(vmis, tmp_path, capsys):
    """A namespace dumped with its ResourceQuota (`kubectl get vmis,resourcequota -o yaml`): the quota was skipped,
    and the launcher pods rendered without the limits KubeVirt sets where a quota names them, as if no quota did.
    It counts for its own namespace only, as ``--quota-has`` does for every one."""
    quota = """\
---
apiVersion: v1
kind: ResourceQuota
metadata: {name: vm-size, namespace: tenant-a}
spec: {hard: {limits.cpu: "8", limits.memory: 64Gi}}
---
apiVersion: v1
kind: ResourceQuota
metadata: {name: other, namespace: tenant-b}
spec: {hard: {limits.memory: 64Gi}}
"""
    p = tmp_path / "dump.yaml"
    p.write_text(VMI_YAML + quota)
    code, out, err = run(["-f", str(p), "-o", "json"], capsys=capsys)
    assert code == 0, err
    with_quota = {i["name"]: i["pod"]["limits"] for i in json.loads(out)["items"]}
    code, flagged, _ = run(["-f", str(vmis), "-o", "json", "--quota-has", "limits.cpu,limits.memory"], capsys=capsys)
    assert with_quota == {i["name"]: i["pod"]["limits"] for i in json.loads(flagged)["items"]}
    assert with_quota["vmi1"]["cpu"] == "2015m", "the compute container's 2 and its sidecar's 15m"
    assert "note: ResourceQuota tenant-a/vm-size names limits.cpu and limits.memory" in err, err
    assert "skipping ResourceQuota" not in err
    other = tmp_path / "other.yaml"
    other.write_text(VMI_YAML + quota.replace("namespace: tenant-a", "namespace: tenant-c"))
    code, out, _ = run(["-f", str(other)], capsys=capsys)
    assert code == 0 and "15m*" in out, "a quota of another namespace sets no limits here"


def test_stdin(monkeypatch, capsys):
    code, out, _ = run(["-f", "-", "-o", "json"], stdin=VMI_YAML, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    assert len(json.loads(out)["items"]) == 2


def test_json_input(tmp_path, capsys):
    p = tmp_path / "vmi.json"
    p.write_text(json.dumps({"kind": "VirtualMachineInstanceList", "items": parse_objects("x", VMI_YAML)[:1]}))
    code, out, _ = run(["-f", str(p), "-o", "json", "--kubevirt-version", "main"], capsys=capsys)
    assert code == 0
    assert json.loads(out)["items"][0]["memoryOverhead"] == "312475648"  # 298 Mi


def test_kubevirt_config_and_flag_override(vmis, tmp_path, capsys):
    cr = tmp_path / "kv.yaml"
    cr.write_text(KUBEVIRT_CR)
    code, out, _ = run(["-f", str(vmis), "-o", "json", "--kubevirt-config", str(cr)], capsys=capsys)
    assert code == 0
    item = json.loads(out)["items"][0]
    assert item["containers"]["compute"]["requests"]["cpu"] == "500m"  # 2 vCPUs / 4
    assert item["memoryOverhead"] == "274726912"  # v1.5 constants: 262 Mi
    code, out, _ = run(
        [
            "-f",
            str(vmis),
            "-o",
            "json",
            "--kubevirt-config",
            str(cr),
            "--cpu-allocation-ratio",
            "1",
            "--kubevirt-version",
            "main",
        ],
        capsys=capsys,
    )
    item = json.loads(out)["items"][0]
    assert item["containers"]["compute"]["requests"]["cpu"] == "2"
    assert item["memoryOverhead"] == "312475648"


def test_namespace_labels(vmis, capsys):
    code, out, _ = run(
        [
            "-f",
            str(vmis),
            "-o",
            "json",
            "--quota-has",
            "limits.memory",
            "--namespace-label",
            "alpha.kubevirt.io/auto-memory-limits-ratio=1.5",
        ],
        capsys=capsys,
    )
    assert code == 0
    compute = json.loads(out)["items"][0]["containers"]["compute"]
    assert compute["limits"]["memory"] == "1953Mi"  # int(1302 Mi x 1.5)


def test_arm64(vmis, capsys):
    code, out, _ = run(["-f", str(vmis), "-o", "json", "--arch", "arm64"], capsys=capsys)
    assert code == 0
    assert json.loads(out)["items"][0]["memoryOverhead"] == str((278 + 128) * 1024 * 1024)


INSTANCETYPE_VM = (
    "kind: VirtualMachine\nmetadata: {name: v, namespace: n}\n"
    "spec: {instancetype: {name: u1.small}, template: {spec: {domain: {}}}}\n"
)


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if not ln.startswith("note:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "kind: VirtualMachineInstance\nmetadata: {name: x, namespace: n}\n"
            "spec: {domain: {memory: {guest: huge}}}\n",
            "error: VirtualMachineInstance n/x: spec.domain.memory.guest: invalid quantity 'huge'",
        ),
        (
            "kind: VirtualMachine\nmetadata: {name: v, namespace: n}\n"
            "spec: {template: {spec: {domain: {cpu: {cores: x}}}}}\n",
            "error: VirtualMachine n/v: spec.template.spec.domain.cpu.cores: expected a whole number, got 'x'",
        ),
        (
            "kind: VirtualMachineInstance\nmetadata: {name: x, namespace: n}\n"
            "spec: {domain: {memory: {guest: 1Gi}, devices: [1]}}\n",
            "error: VirtualMachineInstance n/x: spec.domain.devices: expected an object, got list",
        ),
        ("kind: VirtualMachineInstance\nmetadata: {name: x\n", "error: <stdin>: document 1: invalid YAML (line 3):"),
        ("---\nkind: A\n---\n- 1\n", "error: <stdin>: document 2: [0]: expected an object, got int"),
        ("just a string\n", "error: <stdin>: document 1: expected an object, got str"),
        ('{"kind": ', "error: <stdin>: document 1: invalid JSON:"),
        (
            INSTANCETYPE_VM,
            "error: VirtualMachine n/v: spec.template.spec.domain.memory.guest: no memory size",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(text, expected, monkeypatch, capsys):
    code, out, err = run(["-f", "-"], stdin=text, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2
    assert out == ""
    assert one_error_line(err).startswith(expected)


def test_instancetype_hint(monkeypatch, capsys):
    text = INSTANCETYPE_VM
    _, _, err = run(["-f", "-"], stdin=text, monkeypatch=monkeypatch, capsys=capsys)
    assert "instancetype u1.small: render its VMI instead" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--kubevirt-version", "v2.1"], "error: --kubevirt-version: unsupported KubeVirt version 'v2.1'"),
        (["--cpu-allocation-ratio", "abc"], "error: --cpu-allocation-ratio: expected a number"),
        (["--cpu-allocation-ratio", "0"], "error: --cpu-allocation-ratio: must be greater than 0, got '0'"),
        (["--namespace-label", "novalue"], "error: --namespace-label: expected KEY=VALUE"),
        (["--kubevirt-config", "/nonexistent/kv.yaml"], "error: /nonexistent/kv.yaml: no such file"),
    ],
)
def test_bad_options_exit_2(vmis, argv, expected, capsys):
    code, _, err = run(["-f", str(vmis), *argv], capsys=capsys)
    assert code == 2
    assert one_error_line(err).startswith(expected)


def test_missing_file(capsys):
    code, _, err = run(["-f", "/nonexistent/file.yaml"], capsys=capsys)
    assert code == 2
    assert one_error_line(err) == "error: /nonexistent/file.yaml: no such file"


def test_a_kubevirt_newer_than_known_is_rendered_as_main_and_said_so(vmis, tmp_path, capsys):
    cr = tmp_path / "kv.yaml"
    cr.write_text(KUBEVIRT_CR.replace("v1.5", "v1.42"))
    code, out, err = run(["-f", str(vmis), "-o", "json", "--kubevirt-config", str(cr)], capsys=capsys)
    assert code == 0
    assert "note: KubeVirt v1.42" in err and "is newer than this build knows" in err and "as for main" in err
    code, as_main, err_main = run(
        ["-f", str(vmis), "-o", "json", "--kubevirt-config", str(cr), "--kubevirt-version", "main"], capsys=capsys
    )
    assert json.loads(out) == json.loads(as_main) and "newer than this build" not in err_main


def test_kubevirt_config_without_a_kubevirt(vmis, capsys):
    code, _, err = run(["-f", str(vmis), "--kubevirt-config", str(vmis)], capsys=capsys)
    assert code == 2
    assert one_error_line(err) == f"error: {vmis}: no KubeVirt object found"


def test_bad_kubevirt_config(vmis, tmp_path, capsys):
    cr = tmp_path / "kv.yaml"
    cr.write_text(
        "kind: KubeVirt\nmetadata: {name: kv}\n"
        "spec: {configuration: {developerConfiguration: {memoryOvercommit: -5}}}\n"
    )
    code, _, err = run(["-f", str(vmis), "--kubevirt-config", str(cr)], capsys=capsys)
    assert code == 2
    assert one_error_line(err).startswith(
        f"error: {cr}: KubeVirt kv: spec.configuration.developerConfiguration.memoryOvercommit:"
    )


# ---- services.platform.inputs ---------------------------------------------------------------------------------


def test_parse_objects_shapes():
    objs = parse_objects("f", VMI_YAML)
    assert [o["kind"] for o in objs] == ["VirtualMachineInstance", "VirtualMachine", "ConfigMap"]
    assert objs[0]["metadata"]["creationTimestamp"] == "2024-01-01T00:00:00Z"  # stays a string
    assert parse_objects("f", "") == []
    assert parse_objects("f", "---\n---\n") == []
    assert parse_objects("f", '[{"kind": "A"}, {"kind": "B"}]') == [{"kind": "A"}, {"kind": "B"}]
    assert parse_objects("f", "{kind: A}") == [{"kind": "A"}]  # flow YAML, not JSON
    assert parse_objects("f", "kind: PodList\nitems: []\n") == []


def test_parse_objects_errors():
    with pytest.raises(InvalidInput) as e:
        parse_objects("f.yaml", "kind: List\nitems:\n- 3\n")
    assert str(e.value) == "f.yaml: document 1: items[0]: expected an object, got int"
    with pytest.raises(InvalidInput) as e:
        parse_objects("f.yaml", "kind: List\nitems: {a: 1}\n")
    assert e.value.where == "f.yaml: document 1: items"


def test_load_objects_file_and_errors(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("kind: A\n")
    assert load_objects(str(p)) == [{"kind": "A"}]
    with pytest.raises(InvalidInput):
        load_objects(str(tmp_path))
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(InvalidInput) as e:
        load_objects(str(p))
    assert "UTF-8" in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("services.cli.usage") is None, reason="vmquota usage not installed yet")
def test_entry_point_end_to_end(vmis):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "render", "-f", "-", "-o", "json"],
        input=vmis.read_text(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["items"]) == 2
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "render", "-f", "-"],
        input="kind: VirtualMachineInstance\nspec: 3\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("version", "profile"), [("v1.6.2", "v1.6.2"), ("v1.6.0", "v1.6.0-v1.6.1"), ("v1.6", "v1.6.4+"), ("main", "main")]
)
def test_patch_versions_and_the_profile_used_are_reported(vmis, capsys, version, profile):
    code, out, err = run(["-f", str(vmis), "-o", "json", "--kubevirt-version", version], capsys=capsys)
    assert code == 0
    assert json.loads(out)["kubevirt"] == {"version": version, "profile": profile}
    assert f"note: rendered as KubeVirt {version} (profile {profile}" in err
