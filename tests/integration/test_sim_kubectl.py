"""The installed kubectl (1.32) as a real client of the simulated API server: get (tables, JSON, watch), describe,
create -f, patch (merge, JSON, strategic), delete — on namespaces, pods, resourcequotas and VMIs."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.devtools.simcluster.store import Store
from tests.integration.conftest import SimApi

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
]

MANIFESTS = """
apiVersion: v1
kind: Namespace
metadata:
  name: tenant-a
---
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: tenant-a
  labels: {app: web}
spec:
  containers:
  - name: c
    image: busybox
    resources: {requests: {cpu: 100m, memory: 64Mi}, limits: {cpu: 200m, memory: 128Mi}}
---
apiVersion: v1
kind: ResourceQuota
metadata: {name: compute, namespace: tenant-a}
spec:
  hard: {requests.cpu: "4", limits.memory: 64Gi}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: vm1, namespace: tenant-a}
spec:
  domain:
    cpu: {sockets: 2}
    memory: {guest: 1Gi}
    devices: {}
"""

Kubectl = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def kubectl(sim_api: SimApi, tmp_path: Path) -> Kubectl:
    binary = shutil.which("kubectl")
    assert binary is not None

    async def run(*args: str, stdin: str | None = None, ok: bool = True) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            binary,
            f"--kubeconfig={sim_api.kubeconfig}",
            f"--cache-dir={tmp_path / 'kube-cache'}",
            "--request-timeout=10s",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 30)
        code = proc.returncode
        assert code is not None
        if ok:
            assert code == 0, f"kubectl {' '.join(args)} failed ({code}): {err.decode()}"
        return code, out.decode(), err.decode()

    return run


def rows(table: str) -> list[list[str]]:
    """``kubectl get`` output as rows of whitespace-separated cells (header first)."""
    return [line.split() for line in table.strip().splitlines()]


async def seed(kubectl: Kubectl, store: Store) -> None:
    _, out, _ = await kubectl("create", "-f", "-", stdin=MANIFESTS)
    assert out.split() == [
        "namespace/tenant-a",
        "created",
        "pod/web",
        "created",
        "resourcequota/compute",
        "created",
        "virtualmachineinstance.kubevirt.io/vm1",
        "created",
    ]
    quota = store.resource("quota")
    await store.mutate(
        quota,
        "tenant-a",
        "compute",
        lambda q: {
            **q,
            "status": {"hard": q["spec"]["hard"], "used": {"requests.cpu": "100m", "limits.memory": "128Mi"}},
        },
        status=True,
    )
    vmi_status = {"phase": "Running", "nodeName": "node-1", "interfaces": [{"ipAddress": "10.0.0.7"}]}
    await store.mutate(store.resource("vmi"), "tenant-a", "vm1", lambda v: {**v, "status": vmi_status}, status=True)


async def test_get_prints_the_columns_of_each_kind(kubectl: Kubectl, sim_api: SimApi) -> None:
    await seed(kubectl, sim_api.store)
    _, out, _ = await kubectl("get", "namespaces")
    assert rows(out)[0] == ["NAME", "STATUS", "AGE"] and rows(out)[1][:2] == ["tenant-a", "Active"]
    _, out, _ = await kubectl("get", "pods", "-n", "tenant-a", "-o", "wide")
    assert rows(out)[0][:7] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE"]
    assert rows(out)[1][:4] == ["web", "0/1", "Pending", "0"]
    _, out, _ = await kubectl("get", "quota", "-n", "tenant-a")
    header, row = rows(out)
    assert header == ["NAME", "AGE", "REQUEST", "LIMIT"]
    assert row[0] == "compute" and "requests.cpu:" in row and "100m/4" in row and "128Mi/64Gi" in row
    _, out, _ = await kubectl("get", "vmi", "-A")
    assert rows(out)[0] == ["NAMESPACE", "NAME", "AGE", "PHASE", "IP", "NODENAME", "READY"]
    assert rows(out)[1][:2] == ["tenant-a", "vm1"] and rows(out)[1][3:6] == ["Running", "10.0.0.7", "node-1"]
    _, out, _ = await kubectl("get", "po,vmi", "-n", "tenant-a", "-l", "app=web", "-o", "name")
    assert out.split() == ["pod/web"]
    code, _, err = await kubectl("get", "pod", "nope", "-n", "tenant-a", ok=False)
    assert code == 1 and 'Error from server (NotFound): pods "nope" not found' in err


async def test_get_as_json(kubectl: Kubectl, sim_api: SimApi) -> None:
    await seed(kubectl, sim_api.store)
    _, out, _ = await kubectl("get", "pod", "web", "-n", "tenant-a", "-o", "json")
    obj = json.loads(out)
    assert obj["kind"] == "Pod" and obj["metadata"]["labels"] == {"app": "web"}
    assert obj["metadata"]["resourceVersion"] == str(
        (await sim_api.store.get(sim_api.store.resource("po"), "tenant-a", "web"))["metadata"]["resourceVersion"]
    )
    _, out, _ = await kubectl("get", "vmi", "-A", "-o", "json")
    items = json.loads(out)["items"]
    assert [(i["kind"], i["status"]["phase"]) for i in items] == [("VirtualMachineInstance", "Running")]


async def test_describe(kubectl: Kubectl, sim_api: SimApi) -> None:
    store = sim_api.store
    await seed(kubectl, store)
    web = await store.get(store.resource("po"), "tenant-a", "web")
    event: Any = {
        "metadata": {"name": "web.1"},
        "involvedObject": {"kind": "Pod", "namespace": "tenant-a", "name": "web", "uid": web["metadata"]["uid"]},
        "reason": "Scheduled",
        "message": "Successfully assigned tenant-a/web to node-1",
        "type": "Normal",
        "source": {"component": "default-scheduler"},
        "firstTimestamp": web["metadata"]["creationTimestamp"],
        "lastTimestamp": web["metadata"]["creationTimestamp"],
        "count": 1,
    }
    await store.create(store.resource("ev"), event, namespace="tenant-a")
    _, out, _ = await kubectl("describe", "pod", "web", "-n", "tenant-a")
    assert "Name:             web" in out or "Name:         web" in out
    assert "Successfully assigned tenant-a/web to node-1" in out and "Scheduled" in out
    _, out, _ = await kubectl("describe", "quota", "compute", "-n", "tenant-a")
    assert "limits.memory" in out and "128Mi" in out and "64Gi" in out
    _, out, _ = await kubectl("describe", "vmi", "vm1", "-n", "tenant-a")
    assert "Kind:         VirtualMachineInstance" in out and "Phase:" in out and "Running" in out
    _, out, _ = await kubectl("describe", "namespace", "tenant-a")
    assert "Status:       Active" in out and "compute" in out


async def test_patch_and_delete(kubectl: Kubectl, sim_api: SimApi) -> None:
    store = sim_api.store
    await seed(kubectl, store)
    _, out, _ = await kubectl(
        "patch", "quota", "compute", "-n", "tenant-a", "--type", "merge", "-p", '{"spec":{"hard":{"pods":"10"}}}'
    )
    assert out.strip() == "resourcequota/compute patched"
    quota = await store.get(store.resource("quota"), "tenant-a", "compute")
    assert quota["spec"]["hard"] == {"requests.cpu": "4", "limits.memory": "64Gi", "pods": "10"}
    jp = '[{"op":"add","path":"/metadata/labels","value":{"tier":"gold"}}]'
    await kubectl("patch", "vmi", "vm1", "-n", "tenant-a", "--type", "json", "-p", jp)
    assert (await store.get(store.resource("vmi"), "tenant-a", "vm1"))["metadata"]["labels"] == {"tier": "gold"}
    await kubectl(
        "patch", "pod", "web", "-n", "tenant-a", "-p", '{"spec":{"containers":[{"name":"c","image":"nginx"}]}}'
    )
    containers = (await store.get(store.resource("po"), "tenant-a", "web"))["spec"]["containers"]
    assert [(c["name"], c["image"], c["resources"]["requests"]["cpu"]) for c in containers] == [("c", "nginx", "100m")]
    code, _, err = await kubectl("patch", "vmi", "vm1", "-n", "tenant-a", "-p", '{"metadata":{}}', ok=False)
    # Strategic merge is for built-in kinds only, as on a real server (415, which kubectl reports as below).
    assert code == 1 and "strategic-merge-patch+json is not supported" in err and "merge-patch+json" in err
    _, out, _ = await kubectl("delete", "vmi", "vm1", "-n", "tenant-a")
    assert out.strip() == 'virtualmachineinstance.kubevirt.io "vm1" deleted'
    _, out, _ = await kubectl("delete", "pod", "web", "-n", "tenant-a")
    assert out.strip() == 'pod "web" deleted'
    assert (await store.list(store.resource("po")))[0] == []
    _, out, _ = await kubectl("delete", "quota", "compute", "-n", "tenant-a")
    assert out.strip() == 'resourcequota "compute" deleted'
    _, out, _ = await kubectl("delete", "namespace", "tenant-a")
    assert out.strip() == 'namespace "tenant-a" deleted'
    assert (await store.list(store.resource("ns")))[0] == []
    assert (await store.list(store.resource("quota")))[0] == []


async def test_get_watch_prints_changes(kubectl: Kubectl, sim_api: SimApi, tmp_path: Path) -> None:
    store = sim_api.store
    await seed(kubectl, store)
    binary = shutil.which("kubectl")
    assert binary is not None
    proc = await asyncio.create_subprocess_exec(
        binary,
        f"--kubeconfig={sim_api.kubeconfig}",
        f"--cache-dir={tmp_path / 'kube-cache'}",
        "get",
        "pods",
        "-n",
        "tenant-a",
        "-w",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        stdout = proc.stdout

        async def line() -> list[str]:
            raw: bytes = await asyncio.wait_for(stdout.readline(), 15)
            return raw.decode().split()

        assert (await line())[:3] == ["NAME", "READY", "STATUS"]
        assert (await line())[:3] == ["web", "0/1", "Pending"]
        await store.mutate(
            store.resource("po"), "tenant-a", "web", lambda p: {**p, "status": {"phase": "Running"}}, status=True
        )
        assert (await line())[:3] == ["web", "0/1", "Running"]
        await store.create(
            store.resource("po"), {"metadata": {"name": "db"}, "spec": {"containers": []}}, namespace="tenant-a"
        )
        assert (await line())[:3] == ["db", "0/0", "Pending"]
    finally:
        proc.kill()
        await proc.wait()


async def test_unauthenticated_kubectl_is_refused(kubectl: Kubectl, sim_api: SimApi, tmp_path: Path) -> None:
    bad = tmp_path / "bad.kubeconfig"
    bad.write_text(sim_api.kubeconfig.read_text().replace(sim_api.token, "not-the-token"))
    code, _, err = await kubectl(f"--kubeconfig={bad}", "get", "pods", ok=False)
    assert code == 1 and "logged in to the server" in err


async def test_generator_commands_send_protobuf(kubectl: Kubectl, sim_api: SimApi) -> None:
    store = sim_api.store
    _, out, _ = await kubectl("create", "namespace", "tenant-b")
    assert out.strip() == "namespace/tenant-b created"
    _, out, _ = await kubectl(
        "create", "quota", "compute", "-n", "tenant-b", "--hard=limits.memory=64Gi,pods=10", "--scopes=NotTerminating"
    )
    assert out.strip() == "resourcequota/compute created"
    quota = await store.get(store.resource("quota"), "tenant-b", "compute")
    assert quota["spec"] == {"hard": {"limits.memory": "64Gi", "pods": "10"}, "scopes": ["NotTerminating"]}
    code, _, err = await kubectl("create", "configmap", "x", "-n", "tenant-b", "--from-literal=a=b", ok=False)
    assert code == 1 and "could not find the requested resource" in err  # configmaps are not served


async def test_apply_creates_then_configures(kubectl: Kubectl, sim_api: SimApi) -> None:
    _, out, _ = await kubectl("apply", "-f", "-", stdin=MANIFESTS)
    assert "pod/web created" in out and "virtualmachineinstance.kubevirt.io/vm1 created" in out
    _, out, _ = await kubectl("apply", "-f", "-", stdin=MANIFESTS.replace("image: busybox", "image: nginx"))
    assert "pod/web configured" in out and "resourcequota/compute unchanged" in out
    web = await sim_api.store.get(sim_api.store.resource("po"), "tenant-a", "web")
    assert web["spec"]["containers"][0]["image"] == "nginx"
