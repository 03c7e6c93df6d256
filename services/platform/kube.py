"""Kubernetes API calls shared by the services that talk to the cluster (the watcher and the enforcer).

Each call goes through a kubernetes-asyncio generated method (authentication, TLS and URLs from the kubeconfig or
the in-cluster service account) with ``_preload_content=False`` — bodies are decoded with msgspec into the plain
dicts ``shared.normalize.normalize`` reads, never into model classes. Every failure is a :class:`KubeError` carrying
the HTTP status (``NETWORK`` = 0 when no answer came) and the ``Retry-After`` the server asked for, so each service
decides in one place what a 409, a 410 or a 429 means. Callers pass ``_request_timeout``: kubernetes-asyncio has
no timeout of its own.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp
import msgspec
from kubernetes_asyncio.client.exceptions import ApiException

Obj = dict[str, Any]
_decode: Final = msgspec.json.Decoder().decode

MAX_DEPTH: Final = 64
"""How deeply nested a document's parts are read when it is nested deeper than the decoder goes (Python's recursion
limit, some 990 levels; the API server takes 10,000): deeper ones read as ``null``. Kubernetes' and KubeVirt's
schemas nest some 20 deep; what a tenant puts deeper is in the fields KubeVirt keeps unknown (a VMI's
``spec.domain.clock``, a VM's template metadata), which nothing reads."""

_TOKENS: Final = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def decode_json(data: bytes) -> Any:
    """``data`` decoded; a document nested deeper than the decoder goes (it raised ``RecursionError``: a tenant's
    VMI stopped the watcher, at every start) is read with its parts deeper than :data:`MAX_DEPTH` as ``null``
    (:func:`shallow`). msgspec.DecodeError when it is not JSON."""
    try:
        return _decode(data)
    except RecursionError:
        return _decode(shallow(data, MAX_DEPTH))


def shallow(data: bytes, depth: int) -> bytes:
    """JSON ``data`` with every array and object nested deeper than ``depth`` replaced by ``null`` (strings, and the
    brackets in them, kept as they are). About 0.3 s per MiB of nesting, on the rare documents that need it."""
    out: list[bytes] = []
    level = cutting = kept = 0
    for m in _TOKENS.finditer(data):
        c = data[m.start()]
        if c == 0x22:  # a string, whole
            continue
        if c == 0x5B or c == 0x7B:
            level += 1
            if level > depth and not cutting:
                out += (data[kept : m.start()], b"null")
                cutting = level
        else:
            if cutting == level:
                kept, cutting = m.end(), 0
            level -= 1
    if not cutting:
        out.append(data[kept:])
    return b"".join(out)


NETWORK: Final = 0
"""The status of a failure without an HTTP answer (connection refused or reset, timeout)."""


def is_transient(status: int) -> bool:
    """Failures expected to pass on their own: network, 408, 429, 5xx. Others (401, 403, 404 — RBAC or a missing
    CRD) need an operator."""
    return status in (NETWORK, 408, 429) or 500 <= status <= 599


class KubeError(Exception):
    """A failed call: ``status`` is the HTTP status, or ``NETWORK`` (0) when no answer came."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def retryable(self) -> bool:
        return is_transient(self.status)


def error_from_status(obj: object, http_status: int = NETWORK, retry_after: float | None = None) -> KubeError:
    """A KubeError from a ``Status`` object (an error response body or a watch ERROR event). Its status is the
    response's ``http_status`` when there is one, else the object's ``code``."""
    if not isinstance(obj, dict):
        return KubeError(http_status, "Unknown", repr(obj)[:200], retry_after)
    code = obj.get("code")
    status = code if http_status == NETWORK and isinstance(code, int) and code > 0 else http_status
    details = obj.get("details")
    if retry_after is None and isinstance(details, dict):
        ra = details.get("retryAfterSeconds")
        if isinstance(ra, int | float) and ra > 0:
            retry_after = float(ra)
    return KubeError(status, str(obj.get("reason") or "Unknown"), str(obj.get("message") or "")[:500], retry_after)


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    raw = resp.headers.get("Retry-After")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


async def call(fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> aiohttp.ClientResponse:
    """Issue a generated API call with a raw response: the response when 2xx (the caller reads and releases it),
    else KubeError (the body read and released)."""
    try:
        resp: aiohttp.ClientResponse = await fn(*args, _preload_content=False, **kw)
    except ApiException as e:  # raised before a response exists (e.g. a malformed request)
        raise KubeError(int(e.status or NETWORK), str(e.reason or "ApiException"), str(e.body or "")[:500]) from None
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise KubeError(NETWORK, type(e).__name__, str(e) or type(e).__name__) from None
    if 200 <= resp.status <= 299:
        return resp
    retry_after = _retry_after(resp)
    try:
        body = await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        body = b""
    finally:
        resp.release()
    try:
        status_obj: object = decode_json(body) if body else None
    except msgspec.DecodeError:
        status_obj = None
    if isinstance(status_obj, dict) and status_obj.get("kind") == "Status":
        # (raised without a local name: a local would make the error, its traceback and this frame a cycle, kept
        # with everything the callers' frames hold until a garbage collection: 409 is the enforcer's normal path)
        raise error_from_status(status_obj, resp.status, retry_after)
    raise KubeError(resp.status, resp.reason or "Error", body[:200].decode("utf-8", "replace"), retry_after)


async def call_bytes(fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> bytes:
    """:func:`call`, then the whole body (the response released)."""
    resp = await call(fn, *args, **kw)
    try:
        data: bytes = await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise KubeError(NETWORK, type(e).__name__, str(e) or "body not received") from None
    finally:
        resp.release()
    return data


async def call_object(fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Obj:
    """:func:`call_bytes`, decoded: a JSON object, else KubeError ``BadResponse``."""
    data = await call_bytes(fn, *args, **kw)
    try:
        obj = decode_json(data)
    except msgspec.DecodeError as e:
        raise KubeError(NETWORK, "BadResponse", f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise KubeError(NETWORK, "BadResponse", "the response is not an object")
    return obj


async def call_object_or_none(fn: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Obj | None:
    """:func:`call_object`, None when the object does not exist (404): a read of one object that may be gone."""
    try:
        return await call_object(fn, *args, **kw)
    except KubeError as e:
        if e.not_found:
            return None
        raise
