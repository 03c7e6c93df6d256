"""The three patch formats of the Kubernetes API: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic
merge patch (maps merge; lists of containers, volumes, env, conditions, ... merge by their key; ``$patch``,
``$retainKeys``, ``$deleteFromPrimitiveList`` and ``$setElementOrder`` directives).

The functions never modify their inputs in place; a merge patch result may share unchanged subtrees with its
target (the store always patches a private copy). Errors are ``ApiError``: 400 for a malformed patch, 422 for a
JSON patch that cannot be applied.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.devtools.simcluster.store_api import ApiError

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value (a msgspec round trip: several times faster than ``copy.deepcopy``)."""
    return _decode(_encode(value))


# --- RFC 7386 JSON merge patch -------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply a JSON merge patch: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy_json(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = merge_patch(result.get(key), value)
        else:
            result[key] = copy_json(value) if isinstance(value, list) else value
    return result


# --- RFC 6902 JSON patch --------------------------------------------------------------------------------------


def _invalid(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise ApiError(400, "BadRequest", f"invalid JSON pointer {path!r}: must be empty or start with '/'")
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if for_add and token == "-":
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise _invalid(f"invalid array index {token!r}")
    i = int(token)
    if i > len(container) or (not for_add and i == len(container)):
        raise _invalid(f"array index {i} out of bounds (length {len(container)})")
    return i


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    cur = doc
    for tok in tokens[:-1]:
        if isinstance(cur, dict):
            if tok not in cur:
                raise _invalid(f"doc is missing path: {path!r}")
            cur = cur[tok]
        elif isinstance(cur, list):
            cur = cur[_index(cur, tok, for_add=False)]
        else:
            raise _invalid(f"doc is missing path: {path!r}")
    return cur


def _get_at(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise _invalid(f"doc is missing path: {path!r}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, for_add=False)]
    raise _invalid(f"doc is missing path: {path!r}")


def _remove_at(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise _invalid("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise _invalid(f"unable to remove nonexistent key: {last}: missing value")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, for_add=False))
    raise _invalid(f"doc is missing path: {path!r}")


def _add_at(doc: Any, path: str, value: Any, *, replace: bool) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise _invalid(f"replace operation does not apply: doc is missing key: {path}: missing value")
        parent[last] = value
    elif isinstance(parent, list):
        if replace:
            parent[_index(parent, last, for_add=False)] = value
        else:
            parent.insert(_index(parent, last, for_add=True), value)
    else:
        raise _invalid(f"doc is missing path: {path!r}")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """Apply an RFC 6902 JSON patch (add, remove, replace, move, copy, test) to a copy of ``doc``."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch must be a list of operations")
    result = copy_json(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, "BadRequest", f"invalid json patch operation: {op!r}")
        kind = op["op"]
        path = op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ApiError(400, "BadRequest", f"json patch {kind} operation at {path!r} has no value")
        if kind == "add":
            result = _add_at(result, path, copy_json(op["value"]), replace=False)
        elif kind == "replace":
            result = _add_at(result, path, copy_json(op["value"]), replace=True)
        elif kind == "remove":
            result, _ = _remove_at(result, path)
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise ApiError(400, "BadRequest", f"json patch {kind} operation at {path!r} has no 'from'")
            if kind == "move":
                if path.startswith(source + "/"):
                    raise _invalid(f"cannot move {source!r} into its own child {path!r}")
                result, value = _remove_at(result, source)
            else:
                value = copy_json(_get_at(result, source))
            result = _add_at(result, path, value, replace=False)
        elif kind == "test":
            if _get_at(result, path) != op["value"]:
                raise _invalid(f"testing value {path} failed: test failed")
        else:
            raise ApiError(400, "BadRequest", f"unexpected json patch operation {kind!r}")
    return result


# --- strategic merge patch ------------------------------------------------------------------------------------

# Lists that merge by a key (patchMergeKey in the Kubernetes API types); the key is the field name, at any depth,
# for the built-in kinds this server serves (pods, namespaces, resourcequotas, events, leases).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}
# Lists of primitives that merge as sets (patchStrategy "merge"), by their parent and field name.
MERGE_PRIMITIVES: frozenset[tuple[str, str]] = frozenset({("metadata", "finalizers")})

_DIRECTIVE = "$patch"
_RETAIN = "$retainKeys"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"
_ORDER = "$setElementOrder/"


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _strip_directives(v)
            for k, v in value.items()
            if k not in (_DIRECTIVE, _RETAIN) and not k.startswith((_DELETE_PRIMITIVE, _ORDER))
        }
    if isinstance(value, list):
        return [_strip_directives(v) for v in value if not (isinstance(v, dict) and v.get(_DIRECTIVE) == "delete")]
    return value


def _smp_map(original: Any, patch: dict[str, Any], parent: str) -> Any:
    directive = patch.get(_DIRECTIVE)
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip_directives(patch)
    if directive not in (None, "merge"):
        raise ApiError(400, "BadRequest", f"unknown patch type: {directive!r} in strategic merge patch")
    result = dict(original) if isinstance(original, dict) else {}
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in (_DIRECTIVE, _RETAIN) or key.startswith(_ORDER):
            continue
        if key.startswith(_DELETE_PRIMITIVE):
            if not isinstance(value, list):
                raise ApiError(400, "BadRequest", f"{key} must be a list")
            deletions[key[len(_DELETE_PRIMITIVE) :]] = value
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _smp_list(result.get(key), value, parent, key)
        else:
            result[key] = value
    for key, values in deletions.items():
        current = result.get(key)
        if isinstance(current, list):
            result[key] = [v for v in current if v not in values]
    retain = patch.get(_RETAIN)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(original: Any, patch: list[Any], parent: str, name: str) -> list[Any]:
    if (parent, name) in MERGE_PRIMITIVES:
        base = list(original) if isinstance(original, list) else []
        return base + [v for v in patch if v not in base]
    key = MERGE_KEYS.get(name)
    if key is None or not all(isinstance(v, dict) for v in patch):
        return [_strip_directives(v) for v in patch]
    if any(v.get(_DIRECTIVE) == "replace" for v in patch):
        return [_strip_directives(v) for v in patch if v.get(_DIRECTIVE) != "replace"]
    result = [copy_json(v) for v in original] if isinstance(original, list) else []
    for item in patch:
        if key not in item:
            raise ApiError(400, "BadRequest", f"map: {item!r} does not contain declared merge key: {key}")
        pos = next((i for i, v in enumerate(result) if isinstance(v, dict) and v.get(key) == item[key]), None)
        if item.get(_DIRECTIVE) == "delete":
            if pos is not None:
                result.pop(pos)
            continue
        if pos is None:
            result.append(_strip_directives(item))
        else:
            result[pos] = _smp_map(result[pos], item, name)
    return result


def strategic_merge_patch(original: Any, patch: Any) -> Any:
    """Apply a strategic merge patch to a copy of ``original`` (an object of a built-in kind)."""
    if not isinstance(patch, dict):
        raise ApiError(400, "BadRequest", "strategic merge patch must be a JSON object")
    result = _smp_map(copy_json(original), patch, "")
    return {} if result is None else result
