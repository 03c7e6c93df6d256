"""The deploy manifests (deploy/, kustomize) and the image (Dockerfile) against Kubernetes' schemas, the RBAC the
services need and nothing more, the pod security the namespace enforces, and the CLI the containers run."""

from __future__ import annotations

import argparse
import ast
import base64
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, Final

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from services.cli.main import build_parser
from services.platform import runner
from services.platform.config import PLANNED, SERVICES, config_from_args
from shared import contract
from shared.kinds import RESERVATION_KIND
from shared.kubevirt.render import RENDER_ANNOTATIONS
from shared.ledger.fold import PartitionSet
from shared.quantity import Quantity
from shared.quota import guard, modes
from shared.quota.annotations import MANAGED_LABEL, RATIO_ANNOTATION
from shared.snapshot import HELD_SPEC_FIELDS
from tests.certs import write_certificates
from tests.exported import runner_env_vars

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NATS_CONFIG = DEPLOY / "components" / "nats" / "nats-server.conf"
NATS_TLS_CONFIG = DEPLOY / "components" / "nats" / "nats-server-tls.conf"
PER_CLUSTER_CONFIG = DEPLOY / "overlays" / "two-clusters" / "central" / "nats-per-cluster" / "nats-server.conf"
SCRAPER_LABEL = ("vmquota.io/metrics-scraper", "true")
"""The label of the namespace(s) allowed to scrape the services' metrics port (Prometheus'; docs/operations.md)."""
KUBE_VERSIONS = ("1.28", "1.32")
"""Kubernetes versions whose schemas every rendered object must satisfy (oldest supported, kubectl's here)."""

Obj = dict[str, Any]

SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}
"""Custom resources the manifests ship, and their CRD's schema (Kubernetes' schemas do not have them)."""

# ---- least privilege: exactly what each service does in Kubernetes ---------------------------------------------

# What each service calls, derived from its code: the kubernetes-asyncio methods the modules call (their names say
# the verb and the resource), the watcher's watched resources, and the leader election's Lease calls.

Rule = tuple[str, str, str]
"""(API group, resource, verb)."""

METHOD: Final = re.compile(
    r"^(get|read|list|patch|create|replace|delete)_(?:namespaced_|cluster_)?([a-z_]+?)(_status)?(?:_for_all_namespaces)?$"
)
VERBS: Final = {
    **{"get": "get", "read": "get", "list": "list", "patch": "patch"},
    **{"create": "create", "replace": "update", "delete": "delete"},
}
API_OBJECTS: Final = {"core", "custom", "api_instance", "coordination"}
"""What the modules name their ``CoreV1Api``/``CoordinationV1Api`` and ``CustomObjectsApi`` objects."""


def _plural(snake: str) -> str:
    """kubernetes-asyncio's resource name in a method (``resource_quota``) → the API's plural (``resourcequotas``)."""
    word = snake.replace("_", "")
    return word + ("es" if word.endswith("s") else "s")


def _constant(node: ast.expr, module: Any) -> str | None:
    """The value of a literal or of a module constant (``guard.GROUP``) in a call's arguments."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        value = getattr(getattr(module, node.value.id, None), node.attr, None)
        return value if isinstance(value, str) else None
    return None


def _api_method(node: ast.expr) -> re.Match[str] | None:
    """``<api object>.<method>`` (``self.core.patch_namespaced_resource_quota``) → the method name's match."""
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
    return METHOD.match(node.attr) if owner in API_OBJECTS else None


def calls_of(module: Any) -> set[Rule]:
    """Every (group, resource, verb) a module's kubernetes-asyncio calls make: a method called, or passed as the
    first argument (``call_object(self.core.patch_namespaced_resource_quota, ...)``); the core methods' names say
    the resource and the verb, ``*_custom_object`` calls give the group and the plural as (constant) arguments."""
    found: set[Rule] = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if not isinstance(node, ast.Call):
            continue
        for ref, args in ((node.func, node.args), *((a, node.args[1:]) for a in node.args[:1])):
            m = _api_method(ref)
            if m is None:
                continue
            if m[2] == "custom_object":
                assert isinstance(ref, ast.Attribute)
                at = 3 if "_namespaced_" in ref.attr else 2
                group, plural = _constant(args[0], module), _constant(args[at], module)
                assert group is not None and plural is not None, f"{module.__name__}: {ast.unparse(node)}"
                found.add((group, plural, VERBS[m[1]]))
            else:
                resource = _plural(m[2]) + ("/status" if m[3] else "")
                found.add(("coordination.k8s.io" if m[2] == "lease" else "", resource, VERBS[m[1]]))
    return found


def watcher_rules() -> set[Rule]:
    """The watcher lists and watches (``services/watcher/kube.py``: ``list_pages`` and ``watch``, one list method
    per resource) every resource of ``services.watcher.watcher.RESOURCES``, reads single objects (``read``: a
    ``get``) of the kinds its loops name in ``reads``, and calls nothing else."""
    from services.watcher import kinds, listwatch, watcher
    from services.watcher import kube as wkube

    source = Path(wkube.__file__).read_text()
    verbs = {"list"} | ({"watch"} if re.search(r'"watch":\s*True', source) else set())
    for module in (watcher, listwatch, kinds):
        assert calls_of(module) == set(), f"{module.__name__} makes no API call of its own"
    assert "get_namespaced_custom_object" in source, "the watcher's read() is how it gets single objects"
    reads = {loop.reads for loop in kinds.LOOPS.values() if loop.reads}
    assert reads, "a loop reads single objects (the refused migration's VMI)"
    return {(r.group, r.plural, v) for r in watcher.RESOURCES for v in verbs} | {
        (r.group, r.plural, "get") for r in watcher.RESOURCES if r.kind in reads
    }


GUARD_ONLY_CALLS: Final = {"get_vmi"}
"""``services/enforcer/kube.py`` methods only the reservation guard calls (besides the QuotaReservation's)."""


def enforcer_rules() -> tuple[set[Rule], set[Rule]]:
    """(always, with the reservation guard) what ``services/enforcer/kube.py`` calls: the guard's are the
    QuotaReservation's and those of :data:`GUARD_ONLY_CALLS`, which only ``services/enforcer/guard.py`` uses."""
    from services.enforcer import guard as eguard
    from services.enforcer import kube as ekube
    from services.enforcer import service as eservice

    for method in GUARD_ONLY_CALLS:
        assert f".{method}(" in Path(eguard.__file__).read_text(), method
        assert f".{method}(" not in Path(eservice.__file__).read_text(), method
    found = calls_of(ekube)
    guarded = {r for r in found if r[0] == guard.GROUP} | {("kubevirt.io", "virtualmachineinstances", "get")}
    assert guarded <= found
    return found - guarded, guarded


def lease_rules() -> set[Rule]:
    """What the leader election (``services.platform.lease``, used by ``runner.leader_elected``) calls."""
    from services.platform import lease

    assert "Elector(" in Path(runner.__file__).read_text()
    return calls_of(lease)


NAME_SCOPED_VERBS: Final = {"get", "update", "patch", "delete"}
"""Verbs RBAC can limit to ``resourceNames`` (``create``, ``list`` and ``watch`` of a collection it cannot)."""

CLUSTER_RULES: dict[str, set[Rule]] = {
    "watcher": watcher_rules(),
    "enforcer": enforcer_rules()[0],
    "ledger": set(),
}


def namespaced_rules(service: str, cluster: str) -> set[tuple[str, str, str, str | None]]:
    """The Lease calls of a leader-elected service, each limited to its own Lease where RBAC can limit it."""
    if service == "ledger":
        return set()
    name = runner.lease_name(service, cluster)
    return {(g, r, v, name if v in NAME_SCOPED_VERBS else None) for g, r, v in lease_rules()}


# ---- rendering --------------------------------------------------------------------------------------------------


def kustomizations() -> list[Path]:
    """Every kustomization that renders on its own (components only render inside an overlay)."""
    found = []
    for k in sorted(DEPLOY.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind") != "Component":
            found.append(k.parent)
    return found


OVERLAYS = [p for p in kustomizations() if "overlays" in p.parts]
TWO_CLUSTERS = DEPLOY / "overlays" / "two-clusters"


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    return found


@cache
def render(path: Path) -> tuple[Obj, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)}: {out.stderr}"
    return tuple(o for o in yaml.safe_load_all(out.stdout) if o)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def of_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def by_name(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    """A generated object (ConfigMap, Secret) by its name before kustomize's hash suffix, or any object by name."""
    hits = [
        o for o in of_kind(objs, kind) if re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(hits) == 1, f"{kind} {name}: {len(hits)} found"
    return hits[0]


def workloads(objs: tuple[Obj, ...]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def nats_servers(objs: tuple[Obj, ...]) -> list[Obj]:
    """The NATS server's StatefulSets (the ledger's are StatefulSets too)."""
    return [
        o
        for o in of_kind(objs, "StatefulSet")
        if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == "nats"
    ]


def vmquota_deployments(objs: tuple[Obj, ...]) -> Iterator[tuple[Obj, str, Obj]]:
    """(Deployment or StatefulSet, service, container) of every vmquota service."""
    for d in workloads(objs):
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") != "vmquota":
            continue  # (the NATS server's)
        service = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        [container] = d["spec"]["template"]["spec"]["containers"]
        yield d, service, container


def container_env(objs: tuple[Obj, ...], container: Obj) -> dict[str, str | None]:
    """The environment a container gets: envFrom ConfigMaps (their data), then env (literal values; None for
    values from a Secret or the downward API)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref is not None, f"only ConfigMaps feed envFrom of vmquota containers: {source}"
        env.update(next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == ref["name"])["data"])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value")
    return env


def strict(schema: Any) -> Any:
    """A CRD's structural schema as the API server applies it with strict field validation: an object that lists
    its properties refuses others (unless it keeps unknown fields); patterns as Python's re reads them."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in out
    if "properties" in out and not keeps_unknown:
        out["additionalProperties"] = False
    pattern = out.get("pattern")
    if isinstance(pattern, str) and "(?i)" in pattern[1:]:  # Go's inline flag stands anywhere, Python's first
        out["pattern"] = "(?i)" + pattern.replace("(?i)", "")
    return out


@cache
def custom_resource_schema(api_version: str, kind: str) -> Any:
    schema = strict(yaml.safe_load((SCHEMAS / CUSTOM_RESOURCES[(api_version, kind)]).read_text()))
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    return schema


def validate(obj: Obj, version: str) -> None:
    """Kubernetes' schema of ``version`` for built-in kinds, the CRD's for the custom resources the manifests ship;
    raises ``kubernetes_validate.ValidationError`` or ``jsonschema.ValidationError``."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CUSTOM_RESOURCES:
        jsonschema.Draft7Validator(custom_resource_schema(*key)).validate(obj)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


# ---- tests: rendering and schemas -------------------------------------------------------------------------------


def test_the_tree_has_the_documented_layout() -> None:
    names = {rel(p) for p in kustomizations()}
    assert {
        "deploy/base",
        "deploy/overlays/single-cluster",
        "deploy/overlays/two-clusters/central",
        "deploy/overlays/two-clusters/cluster-a",
        "deploy/overlays/two-clusters/cluster-b",
    } <= names
    assert (DEPLOY / "components" / "nats" / "kustomization.yaml").exists()


@pytest.mark.parametrize("path", kustomizations(), ids=rel)
def test_renders_and_validates_against_kubernetes_schemas(path: Path) -> None:
    objs = render(path)
    assert objs
    for obj in objs:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                pytest.fail(
                    f"{rel(path)}: {obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): {where}: {e.message}"
                )
        cluster_scoped = (
            "Namespace",
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        )
        assert obj["kind"] in cluster_scoped or obj["metadata"].get("namespace")


def test_the_validator_catches_a_bad_manifest() -> None:
    """The schema check above can fail: a misspelt field and a wrong type are refused."""
    [deploy, *_] = of_kind(render(DEPLOY / "base"), "Deployment")
    bad = json.loads(json.dumps(deploy))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicey"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[-1], strict=True)
    bad = json.loads(json.dumps(deploy))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[-1], strict=True)


# ---- tests: RBAC ------------------------------------------------------------------------------------------------


def granted(objs: tuple[Obj, ...], service_account: str) -> tuple[set[Rule], set[tuple[str, str, str, str | None]]]:
    """(cluster-wide (group, resource, verb), namespaced (group, resource, verb, resource name or None)) bound to a
    service account. Wildcards and non-resource URLs are refused outright, and resource names in ClusterRoles: least
    privilege is spelled out."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objs if o["kind"] in ("ClusterRole", "Role")}
    cluster: set[Rule] = set()
    namespaced: set[tuple[str, str, str, str | None]] = set()
    for b in objs:
        if b["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account for s in b.get("subjects", [])):
            continue
        for s in b["subjects"]:
            assert s["kind"] == "ServiceAccount" and s["namespace"] == b["metadata"].get("namespace", s["namespace"])
        role = roles[(b["roleRef"]["kind"], b["roleRef"]["name"])]
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, rule
            names: list[str | None] = list(rule.get("resourceNames") or [None])
            assert b["kind"] == "RoleBinding" or names == [None], f"resource names in a ClusterRole: {rule}"
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert "*" not in (g, r, v), f"wildcard in {role['metadata']['name']}: {rule}"
                        if b["kind"] == "ClusterRoleBinding":
                            cluster.add((g, r, v))
                        else:
                            namespaced.update((g, r, v, n) for n in names)
    return cluster, namespaced


def test_the_derived_calls_are_what_the_code_does() -> None:
    """The derivation above sees the calls it should (so an empty or wrong set cannot pass unnoticed)."""
    assert ("", "resourcequotas", "patch") in CLUSTER_RULES["enforcer"]
    assert ("kubevirt.io", "virtualmachineinstances", "patch") in CLUSTER_RULES["enforcer"]
    assert ("", "pods", "watch") in CLUSTER_RULES["watcher"]
    assert enforcer_rules()[1] == {(guard.GROUP, guard.PLURAL, v) for v in ("get", "list", "create", "patch")} | {
        ("kubevirt.io", "virtualmachineinstances", "get")
    }
    assert lease_rules() == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_rbac_is_exactly_least_privilege(path: Path) -> None:
    objs = render(path)
    services = {service for _, service, _ in vmquota_deployments(objs)}
    assert services
    for service in services:
        sa = f"vmquota-{service}"
        cluster, namespaced = granted(objs, sa)
        assert cluster == CLUSTER_RULES[service], (
            f"{sa}: extra {cluster - CLUSTER_RULES[service]}, missing {CLUSTER_RULES[service] - cluster}"
        )
        ids = {container_env(objs, c).get("VMQUOTA_CLUSTER") for _, s, c in vmquota_deployments(objs) if s == service}
        [cluster_id] = ids
        wanted = namespaced_rules(service, cluster_id or "all")
        assert namespaced == wanted, f"{sa}: extra {namespaced - wanted}, missing {wanted - namespaced}"
        for d, s, _ in vmquota_deployments(objs):
            if s == service:
                assert d["spec"]["template"]["spec"]["serviceAccountName"] == sa
    # the namespaced Role (leases) lives where the pods look for their Lease: their own namespace
    for rb in of_kind(objs, "RoleBinding"):
        assert rb["metadata"]["namespace"] == rb["subjects"][0]["namespace"]
    # the ledger has no API access at all, not even a token
    ledger_sa = [o for o in of_kind(objs, "ServiceAccount") if o["metadata"]["name"] == "vmquota-ledger"]
    for sa_obj in ledger_sa:
        assert sa_obj["automountServiceAccountToken"] is False


def test_the_rbac_check_fails_on_an_extra_verb() -> None:
    objs = render(DEPLOY / "overlays" / "single-cluster")
    widened = json.loads(json.dumps(objs))
    role = next(o for o in widened if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "vmquota-watcher")
    core = next(r for r in role["rules"] if r["apiGroups"] == [""])
    core["verbs"].append("delete")
    cluster, _ = granted(tuple(widened), "vmquota-watcher")
    assert cluster != CLUSTER_RULES["watcher"]
    assert ("", "pods", "delete") in cluster


# ---- tests: pods ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_pods_are_restricted_probed_and_sized(path: Path) -> None:
    objs = render(path)
    for w in workloads(objs):
        name = f"{w['kind']} {w['metadata']['name']}"
        pod = w["spec"]["template"]["spec"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert psc.get("runAsUser", 1) != 0, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("livenessProbe", "readinessProbe"):
                get = c[probe]["httpGet"]
                assert get["port"] in ports or get["port"] in ports.values(), f"{name}: {probe} on an unknown port"
    for d, _service, c in vmquota_deployments(objs):
        env = container_env(objs, c)
        port = int(env.get("VMQUOTA_HTTP_PORT") or 8080)
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == port, d["metadata"]["name"]
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        # a read-only root filesystem: the only writable path is an emptyDir on /tmp
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"].get("volumes", [])}
        assert "emptyDir" in vols[mounts["/tmp"]]
    for ns in of_kind(objs, "Namespace"):
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_replicas_leader_election_pdbs_and_ledger_partitions(path: Path) -> None:
    objs = render(path)
    pdbs = of_kind(objs, "PodDisruptionBudget")
    owned: list[PartitionSet] = []
    for d, service, c in vmquota_deployments(objs):
        env = container_env(objs, c)
        labels = d["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        if service in ("watcher", "enforcer"):
            assert d["spec"]["replicas"] == 2, d["metadata"]["name"]
            assert env.get("VMQUOTA_LEADER_ELECTION") in (None, "true"), "leader election must stay on"
            assert len(covering) == 1 and covering[0]["spec"]["minAvailable"] == 1
            lease_ns = next(e for e in c["env"] if e["name"] == "VMQUOTA_LEASE_NAMESPACE")
            assert lease_ns["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        else:
            assert service == "ledger"
            # (at most one pod of each at a time: a Deployment replaces a pod while it still terminates)
            assert d["kind"] == "StatefulSet" and d["spec"]["replicas"] == 1, d["metadata"]["name"]
            # (a rollout replaces a pod that is not Ready: OrderedReady waits for it, forever when it crash-loops)
            assert d["spec"]["podManagementPolicy"] == "Parallel"
            [svc] = [o for o in of_kind(objs, "Service") if o["metadata"]["name"] == d["spec"]["serviceName"]]
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= labels.items()
            assert "app.kubernetes.io/name" not in svc["metadata"].get("labels", {}), "not scraped as the metrics one"
            assert not covering, "a single-replica ledger with a PDB would block node drains"
            total = int(env.get("VMQUOTA_PARTITIONS") or 16)
            owned.append(PartitionSet.parse(env.get("VMQUOTA_OWNED_PARTITIONS") or "all", total))
    if owned:
        assert len(owned) == 2
        assert len({p.total for p in owned}) == 1
        union = [n for p in owned for n in p.owned]
        assert sorted(union) == list(range(owned[0].total)), "every partition owned by exactly one ledger"


# ---- tests: image, commands, flags, env ---------------------------------------------------------------------------


def vmquota_parser() -> Any:
    return build_parser()


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_containers_run_the_cli_with_flags_and_env_it_reads(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    objs = render(path)
    parser = vmquota_parser()
    known_env = runner_env_vars()
    images = set()
    for d, service, c in vmquota_deployments(objs):
        images.add(c["image"])
        assert "command" not in c, "the image's ENTRYPOINT (vmquota) runs; args choose the command"
        args = parser.parse_args(c["args"])
        assert (args.command, args.service) == ("run", service)
        env = container_env(objs, c)
        assert set(env) <= known_env, f"{d['metadata']['name']}: env the runner does not read: {set(env) - known_env}"
        secret_refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert set(secret_refs) == {"VMQUOTA_NATS_USER", "VMQUOTA_NATS_PASSWORD"}
        # the values the pod gets: Secrets decoded, downward API fields as the kubelet fills them
        filled = {k: v for k, v in env.items() if v is not None}
        for name, ref in secret_refs.items():
            secret = next(s for s in of_kind(objs, "Secret") if s["metadata"]["name"] == ref["name"])
            filled[name] = base64.b64decode(secret["data"][ref["key"]]).decode()
        fields = {"metadata.name": f"{d['metadata']['name']}-abc12", "metadata.namespace": d["metadata"]["namespace"]}
        for e in c["env"]:
            if "fieldRef" in e.get("valueFrom", {}):
                filled[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        cluster_user = f"{service}-{filled.get('VMQUOTA_CLUSTER')}"
        assert filled["VMQUOTA_NATS_USER"] in (service, cluster_user), "each service connects as its own NATS user"
        if service in ("watcher", "enforcer"):
            assert filled.get("VMQUOTA_CLUSTER"), f"{d['metadata']['name']}: no cluster id"
            assert filled["VMQUOTA_LEASE_NAMESPACE"] == d["metadata"]["namespace"]
        if "VMQUOTA_CLUSTER" in filled:
            contract.check_cluster(filled["VMQUOTA_CLUSTER"])
        if "VMQUOTA_EVENTS_MAX_AGE" in filled:
            contract.parse_duration(filled["VMQUOTA_EVENTS_MAX_AGE"])
        assert filled["VMQUOTA_NATS"].startswith(("nats://", "tls://"))
        if "VMQUOTA_NATS_CA" in filled:
            # (a file the kubelet mounts from a Secret, which the runner reads at start: a CA bundle stands in)
            mounts = [v["mountPath"] for v in c.get("volumeMounts") or ()]
            ca = filled["VMQUOTA_NATS_CA"]
            assert any(ca.startswith(m.rstrip("/") + "/") for m in mounts), f"{ca} is in no volume the pod mounts"
            write_certificates(tmp_path)
            filled["VMQUOTA_NATS_CA"] = str(tmp_path / "ca.crt")
        if service in SERVICES:  # the runner's own validation accepts the pod's configuration
            with monkeypatch.context() as m:
                for k, v in filled.items():
                    m.setenv(k, v)
                config = config_from_args(vmquota_parser().parse_args(c["args"]))
            assert config.service == service and config.nats.user == filled["VMQUOTA_NATS_USER"]
            if config.nats.url.startswith("tls://"):
                assert config.nats.ca, "tls:// with the CA of the Secret vmquota-nats-tls"
            assert config.identity == fields["metadata.name"] and config.nats.url == filled["VMQUOTA_NATS"]
            if service == "ledger":
                assert config.partitions.owned, "a ledger that owns no partition"
    assert len(images) == 1, images


def test_dockerfile_entrypoint_and_command_are_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage: build, then a final stage without build tools"
    # the default target (the last stage) is the product, on the base both targets share
    assert re.fullmatch(r"FROM base AS product", lines[stages[-1]]), lines[stages[-1]]
    base = next(i for i in stages if re.fullmatch(r"FROM \S+ AS base", lines[i]))
    final = lines[base : stages[stages.index(base) + 1]] + lines[stages[-1] :]
    assert re.match(r"FROM \$\{PYTHON_IMAGE\} AS base$|FROM python:3\.11-slim", final[0]), final[0]
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.11-slim", text)

    def instruction(name: str) -> list[str]:
        found = [ln for ln in final if ln.upper().startswith(name + " ")]
        assert found, f"no {name} in the final stage"
        value: list[str] = json.loads(found[-1][len(name) :].strip())  # exec form only
        return value

    entrypoint, cmd = instruction("ENTRYPOINT"), instruction("CMD")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["vmquota"] and "vmquota" in scripts
    args = vmquota_parser().parse_args(cmd)
    assert args.command == "run" and args.service in ("all", *PLANNED)
    user = next(ln for ln in reversed(final) if ln.upper().startswith("USER "))
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root user, so runAsNonRoot can verify it"
    for d in workloads(render(DEPLOY / "base")):
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)
    body = "\n".join(final)
    for tool in ("gcc", "build-essential", "apt-get install", "pip install"):
        assert tool not in body, f"{tool} in the final stage"
    assert "PYTHONDONTWRITEBYTECODE=1" in body
    exposed = next(ln for ln in final if ln.upper().startswith("EXPOSE "))
    assert exposed.split()[1] == str(vmquota_parser().parse_args(["run", "ledger"]).http_port)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


# ---- tests: NATS component and the two-cluster layout --------------------------------------------------------------


def password_vars(conf: str) -> set[str]:
    return set(re.findall(r"\$(VMQUOTA_NATS_[A-Z_]+_PASSWORD)", conf))


def test_nats_component_serves_the_tested_config_and_matching_credentials() -> None:
    objs = render(TWO_CLUSTERS / "central")
    conf = by_name(objs, "ConfigMap", "vmquota-nats-config")
    assert conf["data"] == {
        "nats-server.conf": PER_CLUSTER_CONFIG.read_text(),
        "nats-server-tls.conf": NATS_TLS_CONFIG.read_text(),
    }
    users = by_name(objs, "Secret", "vmquota-nats-users")["data"]
    wanted = password_vars(PER_CLUSTER_CONFIG.read_text())
    assert set(users) == wanted, "the server's Secret provides every password its config reads"
    [sts] = nats_servers(objs)
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert c["envFrom"] == [{"secretRef": {"name": by_name(objs, "Secret", "vmquota-nats-users")["metadata"]["name"]}}]
    assert "-sd" in c["args"] and sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert any(m["mountPath"] == c["args"][c["args"].index("-sd") + 1] for m in c["volumeMounts"])
    version = re.search(r":(\d+)\.(\d+)", c["image"])
    assert version and (int(version[1]), int(version[2])) >= (2, 11), "nats-server >= 2.11 (DESIGN section 4)"
    # each service's own Secret carries the same password as the server's user (placeholders stay consistent)
    for d, service, cont in vmquota_deployments(objs):
        ref = next(e for e in cont["env"] if e["name"] == "VMQUOTA_NATS_PASSWORD")["valueFrom"]["secretKeyRef"]
        secret = next(s for s in of_kind(objs, "Secret") if s["metadata"]["name"] == ref["name"])
        assert secret["data"]["password"] == users[f"VMQUOTA_NATS_{service.upper()}_PASSWORD"], d["metadata"]["name"]
        assert container_env(objs, cont)["VMQUOTA_NATS"] == "tls://vmquota-nats:4222"
    # TLS: the server runs the TLS file (which includes the users' file) with the certificate of vmquota-nats-tls
    assert c["args"][:2] == ["-c", "/etc/nats/nats-server-tls.conf"]
    assert "include ./nats-server.conf" in NATS_TLS_CONFIG.read_text()
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert mounts["tls"] == "/etc/nats/tls" and vols["tls"]["secret"]["secretName"] == "vmquota-nats-tls"
    assert "/etc/nats/tls/tls.crt" in NATS_TLS_CONFIG.read_text()


def per_cluster_user_passwords(objs: tuple[Obj, ...], cluster: str) -> dict[str, str]:
    """A cluster part's NATS credentials: user → password (base64, as in the Secrets)."""
    found = {}
    for name in ("vmquota-nats-watcher", "vmquota-nats-enforcer"):
        data = by_name(objs, "Secret", name)["data"]
        found[base64.b64decode(data["user"]).decode()] = data["password"]
    assert set(found) == {f"watcher-{cluster}", f"enforcer-{cluster}"}
    return found


def test_two_clusters_use_per_cluster_nats_users_over_tls() -> None:
    """Each cluster's watcher and enforcer connect as that cluster's own NATS users (confined to its subjects by
    the central server's configuration; tests/integration/test_nats_permissions.py), with TLS, and the central
    server knows exactly those users and their (placeholder) passwords."""
    central = render(TWO_CLUSTERS / "central")
    server_users = by_name(central, "Secret", "vmquota-nats-users")["data"]
    conf = PER_CLUSTER_CONFIG.read_text()
    conf_users = set(re.findall(r"^\s*user:\s*(\S+)", conf, re.MULTILINE))
    for cluster in ("cluster-a", "cluster-b"):
        objs = render(TWO_CLUSTERS / cluster)
        for user, password in per_cluster_user_passwords(objs, cluster).items():
            assert user in conf_users
            assert server_users[f"VMQUOTA_NATS_{user.upper().replace('-', '_')}_PASSWORD"] == password, user
            assert f'"vmquota.{"ev" if user.startswith("watcher") else "quota"}.{cluster}.>"' in conf
        for _, _, c in vmquota_deployments(objs):
            env = container_env(objs, c)
            assert (env["VMQUOTA_NATS"] or "").startswith("tls://") and env["VMQUOTA_NATS_CA"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert os.path.dirname(env["VMQUOTA_NATS_CA"] or "") in mounts
    assert "watcher" not in conf_users and "enforcer" not in conf_users, "no user may publish for every cluster"


# ---- tests: network policies and the monitoring port ------------------------------------------------------------


def ingress_policies(objs: tuple[Obj, ...], labels: dict[str, str]) -> list[Obj]:
    """The NetworkPolicies whose pod selector selects pods with ``labels``."""
    return [
        n
        for n in of_kind(objs, "NetworkPolicy")
        if n["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
        and "Ingress" in n["spec"]["policyTypes"]
    ]


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_network_policies_admit_only_vmquota_to_nats_and_prometheus_to_metrics(path: Path) -> None:
    objs = render(path)
    for d, _, c in vmquota_deployments(objs):
        labels = d["spec"]["template"]["metadata"]["labels"]
        [policy] = ingress_policies(objs, labels)
        [rule] = policy["spec"]["ingress"]
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": dict([SCRAPER_LABEL])}}], "only Prometheus"
        assert "http" in {p["name"] for p in c["ports"]}
    for sts in nats_servers(objs):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        policies = ingress_policies(objs, labels)
        assert policies
        for policy in policies:
            for rule in policy["spec"]["ingress"]:
                assert rule["ports"] == [{"port": "client", "protocol": "TCP"}], "4222 only, never the monitor port"
                for peer in rule["from"]:
                    assert peer in ({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "vmquota"}}},) or (
                        "ipBlock" in peer and path.name == "central"
                    ), peer
    for svc in of_kind(objs, "Service"):
        ports = {p.get("name") for p in svc["spec"]["ports"]} | {p["port"] for p in svc["spec"]["ports"]}
        assert "monitor" not in ports and 8222 not in ports, f"{svc['metadata']['name']}: monitoring on a Service"


def test_two_clusters_share_one_ledger_and_one_nats() -> None:
    parts = {p.name: render(TWO_CLUSTERS / p.name) for p in sorted(TWO_CLUSTERS.iterdir()) if p.is_dir()}
    assert set(parts) == {"central", "cluster-a", "cluster-b"}
    services = {name: sorted(s for _, s, _ in vmquota_deployments(objs)) for name, objs in parts.items()}
    assert services == {
        "central": ["ledger", "ledger"],
        "cluster-a": ["enforcer", "watcher"],
        "cluster-b": ["enforcer", "watcher"],
    }
    assert [len(of_kind(objs, "StatefulSet")) for objs in parts.values()] == [3, 0, 0]  # (NATS, two ledgers)
    clusters = {}
    for name in ("cluster-a", "cluster-b"):
        ids = {container_env(parts[name], c)["VMQUOTA_CLUSTER"] for _, _, c in vmquota_deployments(parts[name])}
        [clusters[name]] = ids
    assert clusters == {"cluster-a": "cluster-a", "cluster-b": "cluster-b"}
    # the per-cluster parts hold no credentials of services they do not run
    for name in ("cluster-a", "cluster-b"):
        secrets_ = {re.sub(r"-[a-z0-9]{10}$", "", s["metadata"]["name"]) for s in of_kind(parts[name], "Secret")}
        assert secrets_ == {"vmquota-nats-watcher", "vmquota-nats-enforcer"}
    assert (TWO_CLUSTERS / "README.md").read_text().count("cluster-c") >= 2, "README shows how to add a cluster"


# ---- tests: example quotas ----------------------------------------------------------------------------------------


def test_examples_cover_every_mode_and_parse_as_managed_quotas() -> None:
    found = {}
    for f in sorted((DEPLOY / "examples").glob("*.yaml")):
        [quota] = [o for o in yaml.safe_load_all(f.read_text()) if o]
        assert quota["kind"] == "ResourceQuota"
        kubernetes_validate.validate(quota, KUBE_VERSIONS[-1], strict=True)
        hard = {k: Quantity.parse(str(v)) for k, v in quota["spec"]["hard"].items()}
        policy = modes.quota_policy(
            quota["metadata"]["name"], quota["metadata"]["labels"], quota["metadata"]["annotations"], hard
        )
        assert policy is not None, f"{f.name} is not opted in"
        assert policy.budget == hard
        found[policy.mode.value] = f.name
        assert "vmquota.io/mode" in f.read_text() and f.read_text().startswith("#"), "commented for tenants"
    assert set(found) == set(modes.MODE_NAMES)
    ratio = yaml.safe_load((DEPLOY / "examples" / found["VirtualResourcesWithCPUAllocationRatio"]).read_text())
    assert RATIO_ANNOTATION in ratio["metadata"]["annotations"]


def test_operations_guide_documents_every_flag_and_variable() -> None:
    """docs/operations.md lists every `vmquota run` flag and every environment variable the runner reads."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    p = argparse.ArgumentParser()
    runner.add_arguments(p)
    flags = {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert "--cluster" in flags
    undocumented = {f for f in flags if f"`{f}`" not in doc and f"`{f} " not in doc and f" {f}`" not in doc}
    assert not undocumented, f"flags missing from docs/operations.md: {sorted(undocumented)}"
    missing_env = {v for v in runner_env_vars() if f"`{v}`" not in doc}
    assert not missing_env, f"environment variables missing from docs/operations.md: {sorted(missing_env)}"
    for service in ("watcher", "ledger", "enforcer", "subscriber", "replay", "listener"):
        assert f"`{service}`" in doc


def test_single_cluster_with_the_nats_component_uncommented(tmp_path: Path) -> None:
    """The documented switch to in-cluster NATS: uncommenting the component in the single-cluster overlay."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    overlay = copy / "overlays" / "single-cluster" / "kustomization.yaml"
    text = overlay.read_text()
    switched = text.replace("# components:\n#   - ../../components/nats\n", "components:\n  - ../../components/nats\n")
    assert switched != text, "the overlay no longer carries the commented component lines"
    overlay.write_text(switched)
    objs = render(copy / "overlays" / "single-cluster")
    assert len(nats_servers(objs)) == 1
    users = by_name(objs, "Secret", "vmquota-nats-users")["data"]
    assert by_name(objs, "ConfigMap", "vmquota-nats-config")["data"]["nats-server.conf"] == NATS_CONFIG.read_text()
    for d, service, c in vmquota_deployments(objs):
        assert container_env(objs, c)["VMQUOTA_NATS"] == "tls://vmquota-nats:4222"
        ref = next(e for e in c["env"] if e["name"] == "VMQUOTA_NATS_PASSWORD")["valueFrom"]["secretKeyRef"]
        secret = next(s for s in of_kind(objs, "Secret") if s["metadata"]["name"] == ref["name"])
        assert secret["data"]["password"] == users[f"VMQUOTA_NATS_{service.upper()}_PASSWORD"], d["metadata"]["name"]
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)


def test_single_cluster_with_the_reservation_guard(tmp_path: Path) -> None:
    """The optional guard: the CRD, the policies the simulator's tests evaluate (pods; a holder VMI's size), the
    enforcer switched on, and exactly five more verbs for the enforcer (get, list, create and patch of
    QuotaReservations, get of VMIs)."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    overlay = copy / "overlays" / "single-cluster" / "kustomization.yaml"
    text = overlay.read_text()
    switched = text.replace("# components:\n#   - ../../components/nats\n", "components:\n").replace(
        "#   - ../../components/reservation-guard\n", "  - ../../components/reservation-guard\n"
    )
    assert switched.count("components/reservation-guard") == 1 and "components:\n" in switched, switched
    overlay.write_text(switched)
    objs = render(copy / "overlays" / "single-cluster")
    for obj in objs:
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)  # ValidatingAdmissionPolicy v1: 1.30+
    [crd] = of_kind(objs, "CustomResourceDefinition")
    assert crd["spec"]["group"] == guard.GROUP and crd["spec"]["names"]["kind"] == RESERVATION_KIND
    assert crd["spec"]["names"]["plural"] == guard.PLURAL and crd["spec"]["scope"] == "Namespaced"
    assert [v["name"] for v in crd["spec"]["versions"]] == [guard.VERSION]
    assert "aggregate" not in json.dumps(crd), "tenants' admin/edit roles must not include the guard's parameter"
    policies = of_kind(objs, "ValidatingAdmissionPolicy")
    for policy in policies:
        policy["metadata"].pop("namespace", None)  # kustomize's namespace: the API server drops it (cluster-scoped)
    shipped = yaml.safe_load_all((DEPLOY / "components" / "reservation-guard" / "policy.yaml").read_text())
    shipped_by_name = {p["metadata"]["name"]: p for p in shipped if p["kind"] == "ValidatingAdmissionPolicy"}
    assert {p["metadata"]["name"]: p for p in policies} == shipped_by_name  # (kustomize orders them by name)
    bindings = of_kind(objs, "ValidatingAdmissionPolicyBinding")
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(p["metadata"]["name"] for p in policies)
    by_name = {p["metadata"]["name"]: p for p in policies}
    for binding in bindings:
        kind = by_name[binding["spec"]["policyName"]]["spec"].get("paramKind")
        if kind == {"apiVersion": f"{guard.GROUP}/{guard.VERSION}", "kind": RESERVATION_KIND}:
            assert binding["spec"]["paramRef"] == {"name": guard.NAME, "parameterNotFoundAction": "Allow"}
        elif kind == {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration"}:
            # (the migration-size policy: every migration of the namespace, each carrying virt-api's label)
            assert binding["spec"]["paramRef"] == {
                "selector": {"matchExpressions": [{"key": "kubevirt.io/vmi-name", "operator": "Exists"}]},
                "parameterNotFoundAction": "Allow",
            }
        elif kind == {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance"}:
            # (the migration-hotplug policy: every VMI of the namespace)
            assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
        elif (
            kind is not None
        ):  # (the rendering-model policy: the namespace's managed quotas, which tenants cannot write)
            assert kind == {"apiVersion": "v1", "kind": "ResourceQuota"}
            assert binding["spec"]["paramRef"] == {
                "selector": {"matchLabels": {MANAGED_LABEL: "true"}},
                "parameterNotFoundAction": "Allow",
            }
        else:
            assert "paramRef" not in binding["spec"]
    sized = by_name["vmquota-reservation-holder-size"]
    frozen = " ".join(v["expression"] for v in sized["spec"]["validations"])
    assert all(f"object.spec.{f} == oldObject.spec.{f}" in frozen for f in HELD_SPEC_FIELDS), (
        "the policy keeps what the enforcer compares"
    )
    for name in (
        "vmquota-kubevirt-pods",
        "vmquota-migration-finalizer",
        "vmquota-migration-hotplug",
        "vmquota-vmi-orphaning",
    ):
        [creators] = [v["expression"] for v in by_name[name]["spec"]["variables"] if v["name"] == "creators"]
        assert re.findall(r"'([^']+)'", creators) == [guard.DEFAULT_CREATOR], f"{name}: KubeVirt is the guard's creator"
    kept = by_name["vmquota-vmi-render-annotations"]
    [keys] = [v["expression"] for v in kept["spec"]["variables"] if v["name"] == "renderAnnotations"]
    assert sorted(re.findall(r"'([^']+)'", keys)) == sorted(RENDER_ANNOTATIONS), "the annotations pods render from"
    cluster, _ = granted(objs, "vmquota-enforcer")
    assert cluster == CLUSTER_RULES["enforcer"] | enforcer_rules()[1]
    for _, service, c in vmquota_deployments(objs):
        if service == "enforcer":
            env = container_env(objs, c)
            assert env["VMQUOTA_RESERVATION_GUARD"] == "true"
            assert env["VMQUOTA_GUARD_CREATORS"] == guard.DEFAULT_CREATOR


def test_single_cluster_with_the_monitoring_component(tmp_path: Path) -> None:
    """The optional monitoring: a PodMonitor that scrapes every vmquota pod and gives ``up`` the ``job`` and
    ``service`` the alerts group by, the PrometheusRule as shipped, and the Grafana dashboard ConfigMap; the custom
    resources valid against their CRD's schema."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    overlay = copy / "overlays" / "single-cluster" / "kustomization.yaml"
    text = overlay.read_text()
    switched = text.replace("# components:\n#   - ../../components/nats\n", "components:\n").replace(
        "#   - ../../components/monitoring\n", "  - ../../components/monitoring\n"
    )
    assert switched.count("  - ../../components/monitoring\n") == 1 and "components:\n" in switched, switched
    overlay.write_text(switched)
    objs = render(copy / "overlays" / "single-cluster")
    for obj in objs:
        for version in KUBE_VERSIONS:
            validate(obj, version)
        assert obj["metadata"].get("namespace") or obj["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding")
    [monitor] = of_kind(objs, "PodMonitor")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["service"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    deployments = list(vmquota_deployments(objs))
    assert deployments
    for d, service, c in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), d["metadata"]["name"]
        assert labels["app.kubernetes.io/component"] == service, "up's service label is the metrics' service"
        assert labels[monitor["spec"]["jobLabel"]] == "vmquota", 'the alerts read up{job="vmquota"}'
        assert endpoint["port"] in {p["name"] for p in c["ports"]}
        assert monitor["metadata"]["namespace"] == d["metadata"]["namespace"], "no namespaceSelector: its own"
    for sts in nats_servers(objs):  # (NATS has no /metrics of vmquota's)
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [rule] = of_kind(objs, "PrometheusRule")
    shipped = yaml.safe_load((DEPLOY / "components" / "monitoring" / "prometheus-rule.yaml").read_text())
    assert rule["spec"] == shipped["spec"]
    dashboard = by_name(objs, "ConfigMap", "vmquota-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["vmquota.json"]) == json.loads(
        (DEPLOY / "components" / "monitoring" / "dashboard.json").read_text()
    )


def test_the_custom_resource_check_catches_a_bad_manifest() -> None:
    monitor = yaml.safe_load((DEPLOY / "components" / "monitoring" / "pod-monitor.yaml").read_text())
    validate(monitor, KUBE_VERSIONS[-1])
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["podMetricsEndpoints"][0]["prot"] = "http"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, KUBE_VERSIONS[-1])
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["podMetricsEndpoints"][0]["honorLabels"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, KUBE_VERSIONS[-1])
    rule = yaml.safe_load((DEPLOY / "components" / "monitoring" / "prometheus-rule.yaml").read_text())
    validate(rule, KUBE_VERSIONS[-1])
    rule["spec"]["groups"][0]["rules"][0]["exp"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    with pytest.raises(jsonschema.ValidationError):
        validate(rule, KUBE_VERSIONS[-1])
