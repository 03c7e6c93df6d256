"""The enforcer's three Kubernetes calls: read a ResourceQuota, merge-patch it, create an Event.

Each goes through kubernetes-asyncio's generated ``CoreV1Api`` method (authentication, TLS and URLs from the
kubeconfig or the in-cluster service account) with ``_preload_content=False`` and an explicit
``_request_timeout``, so no call can hang and no model class is built: bodies are decoded with msgspec into the
plain dicts ``shared.snapshot.normalize`` reads. Every failure is a :class:`KubeError` carrying the HTTP status (0
when no answer came), so the enforcer decides in one place what a 409, a 404 or a 429 means.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Final, Protocol, cast

import aiohttp
import msgspec
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

Obj = dict[str, Any]
_decode: Final = msgspec.json.Decoder().decode
MERGE_PATCH: Final = "application/merge-patch+json"
RETRYABLE: Final = frozenset({0, 408, 429, 500, 502, 503, 504})
"""Statuses worth retrying with backoff (0: no answer: network failure or timeout)."""


class KubeError(Exception):
    """A failed call: ``status`` is the HTTP status, or 0 when no answer came."""

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
        return self.status in RETRYABLE


class QuotaApi(Protocol):
    """What the enforcer needs of the API server (the tests count and fault these calls)."""

    async def get_quota(self, namespace: str, name: str) -> Obj: ...

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj: ...

    async def create_event(self, namespace: str, body: Obj) -> None: ...


def _error(status: int, data: bytes, retry_after: str | None) -> KubeError:
    ra: float | None = None
    if retry_after:
        try:
            ra = float(retry_after)
        except ValueError:
            ra = None
    try:
        obj = _decode(data) if data else {}
    except msgspec.DecodeError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    details = obj.get("details")
    if ra is None and isinstance(details, dict):
        value = details.get("retryAfterSeconds")
        if isinstance(value, int | float) and value > 0:
            ra = float(value)
    message = str(obj.get("message") or data[:200].decode("utf-8", "replace"))
    return KubeError(status, str(obj.get("reason") or "Unknown"), message[:500], ra)


class KubeQuotas:
    """:class:`QuotaApi` over a kubernetes-asyncio ``ApiClient``; every call times out after ``timeout`` s."""

    def __init__(self, api: ApiClient, *, timeout: float = 5.0) -> None:
        self.core = CoreV1Api(api)
        self.timeout = timeout

    def _raw(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of a generated call: the raw response, and the timeout."""
        return {"_preload_content": False, "_request_timeout": self.timeout, **extra}

    async def _call(self, call: Awaitable[Any]) -> bytes:
        try:
            resp = await call
            try:
                data: bytes = await resp.read()
            finally:
                resp.release()
        except ApiException as e:  # raised before a response exists (e.g. a malformed request)
            raise KubeError(int(e.status or 0), str(e.reason or "ApiException"), str(e.body or "")[:500]) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise KubeError(0, type(e).__name__, str(e) or "no answer") from None
        if not 200 <= resp.status <= 299:
            raise _error(resp.status, data, resp.headers.get("Retry-After"))
        return data

    async def _obj(self, call: Awaitable[Any]) -> Obj:
        data = await self._call(call)
        try:
            obj = _decode(data)
        except msgspec.DecodeError as e:
            raise KubeError(0, "BadResponse", f"not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise KubeError(0, "BadResponse", "the response is not an object")
        return obj

    async def get_quota(self, namespace: str, name: str) -> Obj:
        return await self._obj(self.core.read_namespaced_resource_quota(name, namespace, **self._raw()))

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        return await self._obj(
            self.core.patch_namespaced_resource_quota(name, namespace, body, **self._raw(_content_type=MERGE_PATCH))
        )

    async def create_event(self, namespace: str, body: Obj) -> None:
        await self._call(self.core.create_namespaced_event(namespace, cast(Any, body), **self._raw()))
