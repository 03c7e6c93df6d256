"""The simulated Kubernetes API server: the store over HTTP, close enough to kube-apiserver for kubectl 1.32 and
kubernetes-asyncio.

- discovery: ``/version``, ``/api``, ``/apis``, ``/api/v1``, ``/apis/<group>[/<version>]``, and the aggregated
  discovery documents (``apidiscovery.k8s.io/v2``) kubectl asks for first;
- list (``limit``/``continue``, ``resourceVersion``, label and field selectors), server-side ``Table`` output
  (``Accept: application/json;as=Table;...``) with the columns ``kubectl get`` prints, ``PartialObjectMetadata``;
- watch (``?watch=1``, ``resourceVersion``, ``allowWatchBookmarks``, ``timeoutSeconds``, ``sendInitialEvents``):
  newline-delimited JSON events, a 410 ``ERROR`` event for a compacted resourceVersion;
- get, create (POST), update (PUT), patch (merge, JSON and strategic merge; strategic merge is refused with 415
  for custom resources, like a real server), delete (``DeleteOptions`` with preconditions and propagation),
  deletecollection, and the ``status`` subresource;
- every error is a ``Status`` object; bearer-token authentication (401 without it; ``/version`` and the health
  endpoints are open, as on a real cluster);
- fault injection (``services/devtools/simcluster/faults.py``) in front of every resource request, and ``/_sim/faults``.

It serves HTTPS with a self-signed certificate by default (kubectl sends a bearer token only over TLS); the
kubeconfig carries the certificate as its authority. Python clients may use plain HTTP (``tls=False``).

Run one on its own:
``python -m services.devtools.simcluster.server --port 0 --kubeconfig sim.kubeconfig``; it prints one JSON line
with the URL and token on stdout when it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import random
import secrets
import signal
import socket
import ssl
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml
from aiohttp import web

from services.devtools.simcluster.auth import ADMIN, Users, acting_as, authorize, current_user
from services.devtools.simcluster.faults import Faults
from services.devtools.simcluster.kubeconfig import write_kubeconfig
from services.devtools.simcluster.registry import AGE, NAME, ResourceInfo
from services.devtools.simcluster.store import PatchType, Store, Watcher, WatchItem
from services.devtools.simcluster.store_api import ApiError, Obj, Resource
from services.platform.logs import configure, get_logger
from shared.errors import SIM_INSTALL, MissingDependency

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

JSON = "application/json"
AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
KUBE_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-vmquota-sim"}
ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = ("get", "patch", "update")
PATCH_TYPES: dict[str, PatchType] = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
}
API_SERVER: web.AppKey[ApiServer] = web.AppKey("api_server")


def _status_response(err: ApiError) -> web.Response:
    headers = {}
    retry = err.details.get("retryAfterSeconds")
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return web.Response(status=err.code, body=_encode(err.status()), content_type=JSON, headers=headers)


def _not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")


def _bool(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def _int(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, "BadRequest", f"invalid {what}: {value!r}") from None


def _continue_token(rv: int, last: tuple[str, str]) -> str:
    doc = _encode({"v": "meta.k8s.io/v1", "rv": rv, "ns": last[0], "name": last[1]})
    return base64.urlsafe_b64encode(doc).decode().rstrip("=")


def _parse_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        doc = _decode(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return int(doc["rv"]), (str(doc["ns"]), str(doc["name"]))
    except Exception:
        raise ApiError(400, "BadRequest", f"continue key is not valid: {token!r}") from None


# --- protobuf request bodies (kubectl's generator commands send them) -----------------------------------------

# A field: (JSON name, kind, nested schema). Kinds: "str", "strs" (repeated string), "map" (string → string),
# "qmap" (string → Quantity), "msg", "msgs" (repeated message). Unknown fields are skipped.
_PbSchema = dict[int, tuple[str, str, Any]]
_OBJECT_META: _PbSchema = {
    1: ("name", "str", None),
    2: ("generateName", "str", None),
    3: ("namespace", "str", None),
    11: ("labels", "map", None),
    12: ("annotations", "map", None),
    14: ("finalizers", "strs", None),
}
_SCOPE_REQUIREMENT: _PbSchema = {
    1: ("scopeName", "str", None),
    2: ("operator", "str", None),
    3: ("values", "strs", None),
}
_PB_KINDS: dict[str, _PbSchema] = {
    "Namespace": {1: ("metadata", "msg", _OBJECT_META), 2: ("spec", "msg", {1: ("finalizers", "strs", None)})},
    "ResourceQuota": {
        1: ("metadata", "msg", _OBJECT_META),
        2: (
            "spec",
            "msg",
            {
                1: ("hard", "qmap", None),
                2: ("scopes", "strs", None),
                3: ("scopeSelector", "msg", {1: ("matchExpressions", "msgs", _SCOPE_REQUIREMENT)}),
            },
        ),
    },
}


def _pb_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _pb_fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _pb_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _pb_varint(buf, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _pb_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated field")
            out.append((number, buf[pos : pos + length]))
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def _pb_str(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ValueError("expected a string")
    return value.decode()


def _pb_message(buf: bytes, schema: _PbSchema) -> Obj:
    out: Obj = {}
    for number, value in _pb_fields(buf):
        field = schema.get(number)
        if field is None or not isinstance(value, bytes):
            continue
        name, kind, nested = field
        if kind == "str":
            if value:
                out[name] = _pb_str(value)
        elif kind == "strs":
            out.setdefault(name, []).append(_pb_str(value))
        elif kind in ("map", "qmap"):
            entry = dict(_pb_fields(value))
            raw = entry.get(2, b"")
            if kind == "qmap":
                raw = dict(_pb_fields(raw)).get(1, b"") if isinstance(raw, bytes) else b""
            out.setdefault(name, {})[_pb_str(entry.get(1, b""))] = _pb_str(raw)
        elif kind == "msg":
            out[name] = _pb_message(value, nested)
        elif kind == "msgs":
            out.setdefault(name, []).append(_pb_message(value, nested))
    return out


def decode_protobuf(data: bytes) -> Obj:
    """A Kubernetes protobuf body (``k8s\\0`` + ``runtime.Unknown``) of a Namespace or ResourceQuota as JSON."""
    if not data.startswith(b"k8s\x00"):
        raise ValueError("not a Kubernetes protobuf envelope")
    envelope = dict(_pb_fields(data[4:]))
    type_meta = envelope.get(1, b"")
    raw = envelope.get(2, b"")
    if not isinstance(type_meta, bytes) or not isinstance(raw, bytes):
        raise ValueError("malformed envelope")
    tm = {k: _pb_str(v) for k, v in _pb_fields(type_meta)}
    api_version, kind = tm.get(1, ""), tm.get(2, "")
    schema = _PB_KINDS.get(kind)
    if schema is None:
        raise LookupError(kind or "unknown kind")
    return {"apiVersion": api_version, "kind": kind, **_pb_message(raw, schema)}


class ApiServer:
    """The HTTP front of one store. ``make_app()`` gives the aiohttp application."""

    def __init__(self, store: Store, *, token: str, faults: Faults | None = None, users: Users | None = None) -> None:
        self.store = store
        self.registry = store.registry
        self.token = token
        self.users = users if users is not None else Users(token)
        self.users.add(ADMIN, token)
        self.faults = faults if faults is not None else Faults(store)
        self._watchers: set[Watcher] = set()
        self._log = get_logger(component="simcluster.server")
        self._discovery: dict[str, bytes] = {}
        self._build_discovery()
        self._openapi()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=32 * 1024 * 1024)
        app[API_SERVER] = self
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def close_watches(self) -> None:
        """End every watch this server streams (before shutting down, so no handler waits for events)."""
        for w in list(self._watchers):
            w.close("server shutting down")

    # --- discovery ----------------------------------------------------------------------------------------------

    def _resource_list(self, group: str, version: str) -> Obj:
        gv = f"{group}/{version}" if group else version
        resources: list[Obj] = []
        for info in self.registry.in_group_version(group, version):
            r = info.resource
            entry: Obj = {
                "name": r.plural,
                "singularName": r.kind.lower(),
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": list(ALL_VERBS),
            }
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            if info.categories:
                entry["categories"] = list(info.categories)
            resources.append(entry)
            for sub in r.subresources:
                resources.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": r.kind,
                        "verbs": list(SUBRESOURCE_VERBS),
                    }
                )
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    def _aggregated(self, infos: Sequence[ResourceInfo], group: str) -> Obj:
        versions: dict[str, list[Obj]] = {}
        for info in infos:
            r = info.resource
            kind = {"group": r.group, "version": r.version, "kind": r.kind}
            entry: Obj = {
                "resource": r.plural,
                "responseKind": kind,
                "scope": "Namespaced" if r.namespaced else "Cluster",
                "singularResource": r.kind.lower(),
                "verbs": list(ALL_VERBS),
            }
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            if info.categories:
                entry["categories"] = list(info.categories)
            if r.subresources:
                entry["subresources"] = [
                    {"subresource": sub, "responseKind": kind, "verbs": list(SUBRESOURCE_VERBS)}
                    for sub in r.subresources
                ]
            versions.setdefault(r.version, []).append(entry)
        return {
            "metadata": {"name": group} if group else {},
            "versions": [{"version": v, "resources": rs, "freshness": "Current"} for v, rs in versions.items()],
        }

    def _build_discovery(self) -> None:
        core = [i for i in self.registry.infos if not i.resource.group]
        groups = self.registry.groups()
        d = self._discovery
        d["/api"] = _encode({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        d["/api/v1"] = _encode(self._resource_list("", "v1"))
        group_docs = []
        for group, versions in groups.items():
            gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            doc = {"name": group, "versions": gvs, "preferredVersion": gvs[0]}
            group_docs.append(doc)
            d[f"/apis/{group}"] = _encode({"kind": "APIGroup", "apiVersion": "v1", **doc})
            for v in versions:
                d[f"/apis/{group}/{v}"] = _encode(self._resource_list(group, v))
        d["/apis"] = _encode({"kind": "APIGroupList", "apiVersion": "v1", "groups": group_docs})
        agg_head = {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}}
        d["agg:/api"] = _encode({**agg_head, "items": [self._aggregated(core, "")]})
        d["agg:/apis"] = _encode(
            {
                **agg_head,
                "items": [
                    self._aggregated([i for i in self.registry.infos if i.resource.group == g], g) for g in groups
                ],
            }
        )

    def _openapi(self) -> None:
        """Minimal OpenAPI v3 documents: one PATCH operation per resource that declares the ``fieldValidation``
        query parameter, which is what kubectl reads to rely on server-side validation (no schemas)."""
        d = self._discovery
        roots: dict[str, Obj] = {}
        gvs = [("", "v1")] + [(g, v) for g, vs in self.registry.groups().items() for v in vs]
        for group, version in gvs:
            prefix = f"apis/{group}/{version}" if group else f"api/{version}"
            paths: dict[str, Obj] = {}
            for info in self.registry.in_group_version(group, version):
                r = info.resource
                gvk = {"group": r.group, "version": r.version, "kind": r.kind}
                base = f"/{prefix}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"/{prefix}/{r.plural}"
                op = {
                    "x-kubernetes-group-version-kind": gvk,
                    "x-kubernetes-action": "patch",
                    "parameters": [
                        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                        {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
                        {"name": "dryRun", "in": "query", "schema": {"type": "string"}},
                    ],
                    "responses": {"200": {"description": "OK"}},
                }
                paths[f"{base}/{{name}}"] = {"patch": op}
                for sub in r.subresources:
                    paths[f"{base}/{{name}}/{sub}"] = {"patch": op}
            doc = _encode({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths})
            digest = hashlib.sha256(doc).hexdigest()[:32].upper()
            d[f"/openapi/v3/{prefix}"] = doc
            roots[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={digest}"}
        d["/openapi/v3"] = _encode({"paths": roots})

    def _discovery_response(self, request: web.Request, path: str) -> web.Response:
        accept = request.headers.get("Accept", "")
        if path in ("/api", "/apis") and "as=APIGroupDiscoveryList" in accept and "v=v2;" in accept + ";":
            return web.Response(body=self._discovery["agg:" + path], headers={"Content-Type": AGGREGATED})
        body = self._discovery.get(path)
        if body is None:
            raise _not_found()
        return web.Response(body=body, content_type=JSON)

    # --- dispatch -----------------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except ApiError as err:
            if err.code >= 500:
                self._log.info("request failed", method=request.method, path=request.path, code=err.code)
            return _status_response(err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self._log.exception("internal error", method=request.method, path=request.path)
            return _status_response(ApiError(500, "InternalError", f"Internal error occurred: {exc}"))

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return web.Response(body=_encode(KUBE_VERSION), content_type=JSON)
        with acting_as(self.users.authenticate(request.headers.get("Authorization"))):
            return await self._route_as_user(request, path)

    async def _route_as_user(self, request: web.Request, path: str) -> web.StreamResponse:
        parts = path.strip("/").split("/")
        head = parts[0]
        if head == "_sim":
            if current_user().tenant_of is not None:
                raise ApiError(403, "Forbidden", "the simulator's controls are for the cluster administrator")
            return await self._admin(request, parts)
        if head == "api" and len(parts) >= 2 and parts[1] == "v1" and len(parts) > 2:
            return await self._resource_request(request, "", "v1", parts[2:])
        if head == "apis" and len(parts) > 3:
            return await self._resource_request(request, parts[1], parts[2], parts[3:])
        if head in ("api", "apis", "openapi") and request.method == "GET":
            return self._discovery_response(request, path)
        raise _not_found()

    async def _resource_request(
        self, request: web.Request, group: str, version: str, rest: list[str]
    ) -> web.StreamResponse:
        query = request.query
        watch = False
        if rest[0] == "watch":
            watch = True
            rest = rest[1:]
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            namespace = rest[1]
            rest = rest[2:]
        if not rest or len(rest) > 3:
            raise _not_found()
        info = self.registry.by_url(group, version, rest[0])
        if info is None:
            raise _not_found()
        res = info.resource
        if namespace is not None and not res.namespaced:
            raise _not_found()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and sub not in res.subresources:
            raise _not_found()
        method = request.method
        if name is None:
            if method == "GET":
                verb = "watch" if watch or _bool(query.get("watch")) else "list"
            elif method == "POST" and (namespace is not None or not res.namespaced):
                verb = "create"
            elif method == "DELETE":
                verb = "deletecollection"
            else:
                raise _method_not_allowed()
        else:
            if res.namespaced and namespace is None:
                raise _not_found()
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, "")
            if not verb or (watch and verb != "get"):
                raise _method_not_allowed()
            if watch:
                verb = "watch"
        authorize(current_user(), verb, res, namespace, sub)
        if self.faults.active():
            delay, err = self.faults.check(verb, res, name or "")
            if delay > 0:
                await asyncio.sleep(delay)  # injected latency, not synchronisation
            if err is not None:
                raise err
        if "dryRun" in query:
            raise ApiError(400, "BadRequest", "dryRun is not supported by the simulated API server")
        if verb == "list":
            return self._list(request, info, namespace)
        if verb == "watch":
            return await self._watch(request, info, namespace, name)
        if verb == "get":
            assert name is not None
            raw = self.store.get_raw(res, namespace, name)
            return self._object_response(request, info, raw)
        if verb == "create":
            raw = await self.store.create_raw(res, await self._body(request, res), namespace=namespace)
            return web.Response(status=201, body=raw, content_type=JSON)
        assert name is not None or verb == "deletecollection"
        if verb == "update":
            assert name is not None
            body = await self._body(request, res)
            raw = await self.store.update_raw(res, body, subresource=sub, namespace=namespace, name=name)
            return web.Response(body=raw, content_type=JSON)
        if verb == "patch":
            assert name is not None
            return await self._patch(request, info, namespace, name, sub)
        if verb == "delete":
            assert name is not None
            return await self._delete(request, res, namespace, name)
        return await self._delete_collection(request, info, namespace)

    # --- bodies and outputs -------------------------------------------------------------------------------------

    async def _body(self, request: web.Request, res: Resource) -> Obj:
        data = await request.read()
        ctype = request.content_type
        try:
            if ctype in ("application/yaml", "application/x-yaml", "text/yaml"):
                obj = yaml.safe_load(data)
            elif "protobuf" in ctype:
                obj = decode_protobuf(data)
            else:
                obj = _decode(data)
        except (msgspec.DecodeError, yaml.YAMLError, ValueError) as exc:
            raise ApiError(400, "BadRequest", f"couldn't get version/kind; json parse error: {exc}") from None
        except LookupError as exc:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the simulated API server reads protobuf bodies only for Namespace and ResourceQuota, not {exc}; "
                "send JSON (kubectl create -f)",
            ) from None
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", f"the body of the request for {res.key} must be a JSON object")
        return obj

    def _table(self, info: ResourceInfo, objs: Sequence[Obj], meta: Obj, include: str, headers: bool = True) -> Obj:
        now = self.store.now()
        columns = info.columns or (NAME, AGE)
        rows = []
        for obj in objs:
            row: Obj = {"cells": [c.cell(obj, now) for c in columns]}
            if include == "Object":
                row["object"] = obj
            elif include != "None":
                row["object"] = {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj.get("metadata", {}),
                }
            rows.append(row)
        table: Obj = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta}
        if headers:
            table["columnDefinitions"] = [c.definition() for c in columns]
        table["rows"] = rows
        return table

    @staticmethod
    def _wants(request: web.Request, what: str) -> bool:
        return f"as={what}" in request.headers.get("Accept", "")

    def _object_response(self, request: web.Request, info: ResourceInfo, raw: bytes) -> web.Response:
        if self._wants(request, "Table"):
            obj = _decode(raw)
            meta = {"resourceVersion": obj.get("metadata", {}).get("resourceVersion", "")}
            include = request.query.get("includeObject", "Metadata")
            return web.Response(body=_encode(self._table(info, [obj], meta, include)), content_type=JSON)
        if self._wants(request, "PartialObjectMetadata"):
            obj = _decode(raw)
            partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            return web.Response(body=_encode(partial), content_type=JSON)
        return web.Response(body=raw, content_type=JSON)

    def _list(self, request: web.Request, info: ResourceInfo, namespace: str | None) -> web.Response:
        q = request.query
        res = info.resource
        after: tuple[str, str] | None = None
        list_rv: int | None = None
        cont = q.get("continue")
        if cont:
            list_rv, after = _parse_continue(cont)
            if list_rv < self.store.oldest_resource_version:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. "
                    "You can start a new list without the continue parameter.",
                )
        rv = _int(q.get("resourceVersion"), "resource version")
        current = self.store.resource_version
        if rv is not None and rv > current:
            raise ApiError(
                504,
                "Timeout",
                f"Too large resource version: {rv}, current: {current}",
                {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}]},
            )
        if q.get("resourceVersionMatch") == "Exact" and rv is not None and rv != current:
            raise ApiError(410, "Expired", f"too old resource version: {rv} ({current})")
        limit = _int(q.get("limit"), "limit")
        items, current, last, remaining = self.store.list_raw(
            res,
            namespace,
            label_selector=q.get("labelSelector"),
            field_selector=q.get("fieldSelector"),
            limit=limit,
            after=after,
        )
        meta: Obj = {"resourceVersion": str(list_rv if list_rv is not None else current)}
        if last is not None:
            meta["continue"] = _continue_token(list_rv if list_rv is not None else current, last)
            meta["remainingItemCount"] = remaining
        if self._wants(request, "Table"):
            objs = [_decode(raw) for raw in items]
            include = q.get("includeObject", "Metadata")
            return web.Response(body=_encode(self._table(info, objs, meta, include)), content_type=JSON)
        if self._wants(request, "PartialObjectMetadataList"):
            partial = [
                {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": _decode(raw)["metadata"]}
                for raw in items
            ]
            body = _encode(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": meta,
                    "items": partial,
                }
            )
            return web.Response(body=body, content_type=JSON)
        head = b'{"kind":"' + res.kind.encode() + b'List","apiVersion":"' + res.api_version.encode() + b'","metadata":'
        body = head + _encode(meta) + b',"items":[' + b",".join(items) + b"]}"
        return web.Response(body=body, content_type=JSON)

    async def _patch(
        self, request: web.Request, info: ResourceInfo, namespace: str | None, name: str, sub: str | None
    ) -> web.Response:
        ctype = request.content_type
        patch_type = PATCH_TYPES.get(ctype)
        if patch_type is None:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format ({ctype}) - accepted media types include: "
                "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json",
            )
        try:
            patch = _decode(await request.read())
        except msgspec.DecodeError as exc:
            raise ApiError(400, "BadRequest", f"error decoding patch: {exc}") from None
        raw = await self.store.patch_raw(info.resource, namespace, name, patch, patch_type, subresource=sub)
        return web.Response(body=raw, content_type=JSON)

    async def _delete_options(self, request: web.Request) -> Obj:
        opts: Obj = {}
        if request.can_read_body:
            data = await request.read()
            if data.strip():
                try:
                    opts = _decode(data)
                except msgspec.DecodeError as exc:
                    raise ApiError(400, "BadRequest", f"invalid DeleteOptions: {exc}") from None
                if not isinstance(opts, dict):
                    raise ApiError(400, "BadRequest", "DeleteOptions must be a JSON object")
        if "propagationPolicy" in request.query:
            opts["propagationPolicy"] = request.query["propagationPolicy"]
        if opts.get("dryRun"):
            raise ApiError(400, "BadRequest", "dryRun is not supported by the simulated API server")
        return opts

    async def _delete(self, request: web.Request, res: Resource, namespace: str | None, name: str) -> web.Response:
        opts = await self._delete_options(request)
        preconditions = opts.get("preconditions")
        raw = await self.store.delete_raw(
            res,
            namespace,
            name,
            preconditions=preconditions if isinstance(preconditions, dict) else None,
            options=opts,
        )
        return web.Response(body=raw, content_type=JSON)

    async def _delete_collection(self, request: web.Request, info: ResourceInfo, namespace: str | None) -> web.Response:
        res = info.resource
        opts = await self._delete_options(request)
        q = request.query
        items, _, _, _ = self.store.list_raw(
            res, namespace, label_selector=q.get("labelSelector"), field_selector=q.get("fieldSelector")
        )
        deleted: list[bytes] = []
        for raw in items:
            meta = _decode(raw)["metadata"]
            with contextlib.suppress(ApiError):
                deleted.append(await self.store.delete_raw(res, meta.get("namespace"), meta["name"], options=opts))
        meta_out = _encode({"resourceVersion": str(self.store.resource_version)})
        head = b'{"kind":"' + res.kind.encode() + b'List","apiVersion":"' + res.api_version.encode() + b'","metadata":'
        return web.Response(body=head + meta_out + b',"items":[' + b",".join(deleted) + b"]}", content_type=JSON)

    # --- watch --------------------------------------------------------------------------------------------------

    async def _watch(
        self, request: web.Request, info: ResourceInfo, namespace: str | None, name: str | None
    ) -> web.StreamResponse:
        q = request.query
        res = info.resource
        field_selector = q.get("fieldSelector")
        if name is not None:  # the legacy /watch/.../<name> form
            term = f"metadata.name={name}"
            field_selector = f"{field_selector},{term}" if field_selector else term
        rv_text = q.get("resourceVersion", "")
        send_initial = q.get("sendInitialEvents")
        initial = (rv_text in ("", "0") and send_initial != "false") or _bool(send_initial)
        rv = None if rv_text in ("", "0") else _int(rv_text, "resource version")
        timeout = _int(q.get("timeoutSeconds"), "timeoutSeconds")
        if not timeout or timeout <= 0:
            timeout = random.randint(1800, 3600)
        bookmarks = _bool(q.get("allowWatchBookmarks"))
        w = self.store.open_watch(
            res,
            namespace,
            resource_version=None if initial else rv,
            label_selector=q.get("labelSelector"),
            field_selector=field_selector,
            bookmarks=bookmarks,
            initial_events=initial,
            timeout_seconds=float(timeout),
        )
        self._watchers.add(w)
        first: list[bytes] = []
        as_table = self._wants(request, "Table")
        include = q.get("includeObject", "Metadata")
        if _bool(send_initial) and bookmarks:
            # Streaming list: the initial state, then a bookmark marking its end.
            first.extend(self._lines(list(w.items), w, info, as_table, include))
            w.items.clear()
            marker = w.bookmark_object(self.store.resource_version)
            marker["metadata"]["annotations"] = {"k8s.io/initial-events-end": "true"}
            first.append(b'{"type":"BOOKMARK","object":' + _encode(marker) + b"}\n")
        resp = web.StreamResponse(headers={"Content-Type": JSON, "Cache-Control": "no-cache, private"})
        try:
            await resp.prepare(request)
            if first:
                await resp.write(b"".join(first))
            while True:
                batch = await w.next_batch()
                if batch is None:
                    break
                if len(batch) < 64:
                    # Let the other writes of this loop iteration land too: fewer, bigger socket writes.
                    await asyncio.sleep(0)
                    batch += w.take()
                await resp.write(b"".join(self._lines(batch, w, info, as_table, include)))
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            w.close()
            self._watchers.discard(w)
        return resp

    def _lines(
        self, batch: list[WatchItem], w: Watcher, info: ResourceInfo, as_table: bool, include: str
    ) -> list[bytes]:
        out: list[bytes] = []
        for typ, payload in batch:
            if typ == "BOOKMARK":
                out.append(b'{"type":"BOOKMARK","object":' + _encode(w.bookmark_object(payload)) + b"}\n")
            elif typ == "ERROR":
                out.append(b'{"type":"ERROR","object":' + _encode(payload) + b"}\n")
            elif as_table:
                obj = _decode(payload.raw)
                meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
                table = self._table(info, [obj], meta, include)
                out.append(b'{"type":"' + typ.encode() + b'","object":' + _encode(table) + b"}\n")
            else:
                out.append(payload.line(typ))
        return out

    # --- the admin endpoint -------------------------------------------------------------------------------------

    async def _admin(self, request: web.Request, parts: list[str]) -> web.Response:
        if parts != ["_sim", "faults"]:
            raise _not_found()
        if request.method == "GET":
            return web.Response(body=_encode(self.faults.describe()), content_type=JSON)
        if request.method != "POST":
            raise _method_not_allowed()
        try:
            body = _decode(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            result = self.faults.apply(body)
        except (ValueError, msgspec.DecodeError) as exc:
            raise ApiError(400, "BadRequest", f"invalid fault request: {exc}") from None
        return web.Response(body=_encode(result), content_type=JSON)


# --- running a server -------------------------------------------------------------------------------------------


def require_tls_support() -> None:
    """:class:`MissingDependency` unless the package the simulated cluster's HTTPS needs is installed (a command
    checks before it starts anything, so that the reason is all it prints)."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise MissingDependency(
            f"the simulated cluster serves HTTPS and needs the 'cryptography' package: {SIM_INSTALL}"
        ) from None


def self_signed_certificate(host: str = "127.0.0.1") -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate (PEM) valid for ``host``, localhost and the loopback
    addresses; the certificate is its own authority (clients trust it through the kubeconfig)."""
    import datetime
    import ipaddress

    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:  # pragma: no cover - depends on the installation
        raise MissingDependency(
            f"the simulated cluster serves HTTPS and needs the 'cryptography' package: {SIM_INSTALL}"
        ) from None

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vmquota-simcluster")])
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    try:
        addr = ipaddress.ip_address(host)
        if addr not in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")):
            sans.append(x509.IPAddress(addr))
    except ValueError:
        if host != "localhost":
            sans.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as tmp:
        cert_file, key_file = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert_file.write_bytes(cert_pem)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key_pem)
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


@dataclass
class RunningServer:
    """A server listening on ``url``; ``close()`` ends its watches and stops it. ``ca_pem`` is the certificate
    clients must trust when it serves HTTPS (None for plain HTTP)."""

    url: str
    token: str
    store: Store
    api: ApiServer
    runner: web.AppRunner
    ca_pem: bytes | None = None

    @property
    def faults(self) -> Faults:
        return self.api.faults

    def client_ssl(self) -> ssl.SSLContext | None:
        """An SSL context trusting this server (for aiohttp clients), or None for plain HTTP."""
        if self.ca_pem is None:
            return None
        return ssl.create_default_context(cadata=self.ca_pem.decode())

    def write_kubeconfig(self, path: str | Path, *, namespace: str | None = None) -> Path:
        return write_kubeconfig(path, self.url, self.token, ca_pem=self.ca_pem, namespace=namespace)

    async def close(self) -> None:
        self.api.close_watches()
        await self.runner.cleanup()


async def start_server(
    store: Store | None = None,
    *,
    app: web.Application | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    faults: Faults | None = None,
    tls: bool = True,
    users: Users | None = None,
) -> RunningServer:
    """Serve ``store`` (a new empty one by default), or an ``app`` made by ``ApiServer.make_app()`` (possibly with
    more routes or middlewares added), on ``host:port`` (0: a free port); HTTPS with a fresh self-signed
    certificate unless ``tls=False``."""
    if app is None:
        store = store if store is not None else Store()
        api = ApiServer(store, token=token or secrets.token_urlsafe(24), faults=faults, users=users)
        app = api.make_app()
    else:
        api = app[API_SERVER]
        store = api.store
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    ca_pem: bytes | None = None
    ssl_context: ssl.SSLContext | None = None
    if tls:
        ca_pem, key_pem = self_signed_certificate(host)
        ssl_context = _server_ssl_context(ca_pem, key_pem)
    site = web.SockSite(runner, sock, ssl_context=ssl_context)
    await site.start()
    bound = sock.getsockname()[1]
    scheme = "https" if tls else "http"
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind is reached over loopback here
    url = f"{scheme}://[{reach}]:{bound}" if ":" in reach else f"{scheme}://{reach}:{bound}"
    return RunningServer(url=url, token=api.token, store=store, api=api, runner=runner, ca_pem=ca_pem)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.devtools.simcluster.server", description=__doc__.splitlines()[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed on stdout)")
    p.add_argument("--token", default=None, help="bearer token clients must send (default: random)")
    p.add_argument("--kubeconfig", default=None, help="write a kubeconfig for this server to this path")
    p.add_argument("--no-tls", action="store_true", help="serve plain HTTP (kubectl then sends no token)")
    p.add_argument("--history", type=int, default=10_000, help="watch events kept for resuming watches")
    p.add_argument("--watch-queue", type=int, default=10_000, help="events queued per watcher before it is dropped")
    p.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    p.add_argument("--log-level", default="info")
    return p


async def _serve(args: argparse.Namespace) -> int:
    store = Store(history=args.history, watch_queue=args.watch_queue, bookmark_interval=args.bookmark_interval)
    server = await start_server(store, host=args.host, port=args.port, token=args.token, tls=not args.no_tls)
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig)
    print(json.dumps({"url": server.url, "token": server.token}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.log_level)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
