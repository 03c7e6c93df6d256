"""Raw list and watch calls through kubernetes-asyncio's generated API methods.

The watcher does not use ``kubernetes_asyncio.watch.Watch``: its reconnect has no backoff and retries a 410 with
the same stale resourceVersion, and it turns every object into a model class. Here each call goes through the
generated method (``CoreV1Api``, ``CustomObjectsApi``: authentication, TLS and URLs come from the kubeconfig or
the in-cluster configuration) with ``_preload_content=False`` and an explicit ``_request_timeout``; bodies are
decoded with msgspec into plain dicts, the form ``shared.normalize.normalize`` reads.

Every failure becomes :class:`services.platform.kube.KubeError` with the HTTP status (0 for network failures) and the
``Retry-After`` the server asked for, so the loop decides in one place what to do about it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import msgspec
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from services.platform.kube import (
    NETWORK,
    KubeError,
    Obj,
    call,
    call_bytes,
    call_object_or_none,
    error_from_status,
)
from services.platform.kube import decode_json as _decode

__all__ = ["KubeError", "Obj", "ResourceSpec", "Timeouts", "error_from_status", "list_pages", "read", "watch"]
_MAX_LINE: Final = 64 * 1024 * 1024
"""A watch frame larger than this is a broken stream, not an object."""


@dataclass(frozen=True, slots=True)
class ResourceSpec:
    """One watched resource: its kind, where it is served, and the selectors of the objects the watcher wants."""

    kind: str
    plural: str
    group: str = ""
    version: str = "v1"
    label_selector: str | None = None
    field_selector: str | None = None

    @property
    def key(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def method(self, api: ApiClient, namespace: str | None) -> Callable[..., Awaitable[Any]]:
        """The generated list method (all namespaces, or one namespace)."""
        if self.group:
            custom = CustomObjectsApi(api)
            if namespace is None:

                def cluster_call(**kw: Any) -> Awaitable[Any]:
                    return custom.list_cluster_custom_object(self.group, self.version, self.plural, **kw)

                return cluster_call

            def namespaced_call(**kw: Any) -> Awaitable[Any]:
                return custom.list_namespaced_custom_object(self.group, self.version, namespace, self.plural, **kw)

            return namespaced_call
        core = CoreV1Api(api)
        names = _CORE_METHODS[self.plural]
        if namespace is None:
            fn: Callable[..., Awaitable[Any]] = getattr(core, names[0])
            return fn
        if names[1] is None:
            raise ValueError(f"{self.plural} is not namespaced")
        by_ns = getattr(core, names[1])

        def core_namespaced(**kw: Any) -> Awaitable[Any]:
            result: Awaitable[Any] = by_ns(namespace, **kw)
            return result

        return core_namespaced


_CORE_METHODS: Final[dict[str, tuple[str, str | None]]] = {
    "pods": ("list_pod_for_all_namespaces", "list_namespaced_pod"),
    "resourcequotas": ("list_resource_quota_for_all_namespaces", "list_namespaced_resource_quota"),
    "namespaces": ("list_namespace", None),
    "events": ("list_event_for_all_namespaces", "list_namespaced_event"),
}


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 10.0
    """Seconds to open a connection."""
    list_read: float = 60.0
    """Seconds a list page may go without a byte."""
    watch: float = 300.0
    """``timeout_seconds`` of a watch: the server ends it then, and the loop re-watches."""
    watch_slack: float = 30.0
    """The client gives up on a silent watch ``watch + watch_slack`` seconds after the last byte."""

    def for_list(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, connect=self.connect, sock_connect=self.connect, sock_read=self.list_read
        )

    def for_watch(self, timeout_seconds: int) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, connect=self.connect, sock_connect=self.connect, sock_read=timeout_seconds + self.watch_slack
        )


@dataclass(frozen=True, slots=True)
class ListPage:
    items: list[Obj]
    resource_version: str
    continue_token: str


HTTP_OK: Final = 200


async def _page(
    fn: Callable[..., Awaitable[Any]], spec: ResourceSpec, token: str, limit: int, timeouts: Timeouts
) -> ListPage:
    kw: dict[str, Any] = {"limit": limit, "_request_timeout": timeouts.for_list()}
    if token:
        kw["_continue"] = token
    if spec.label_selector:
        kw["label_selector"] = spec.label_selector
    if spec.field_selector:
        kw["field_selector"] = spec.field_selector
    body = await call_bytes(fn, **kw)  # a 2xx: call() turns the others into KubeError
    try:
        doc = _decode(body)
    except msgspec.DecodeError as e:
        raise KubeError(HTTP_OK, "BadList", f"the list of {spec.key} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise KubeError(HTTP_OK, "BadList", f"the list of {spec.key} is not an object")
    meta = doc.get("metadata") or {}
    items = doc.get("items") or []
    if not isinstance(meta, dict) or not isinstance(items, list):
        raise KubeError(HTTP_OK, "BadList", f"the list of {spec.key} has no items")
    api_version = f"{spec.group}/{spec.version}" if spec.group else spec.version
    for item in items:
        if isinstance(item, dict):
            item.setdefault("kind", spec.kind)
            item.setdefault("apiVersion", api_version)
    return ListPage(items, str(meta.get("resourceVersion") or ""), str(meta.get("continue") or ""))


async def list_pages(
    api: ApiClient,
    spec: ResourceSpec,
    *,
    namespace: str | None = None,
    limit: int = 500,
    timeouts: Timeouts = Timeouts(),
) -> AsyncGenerator[ListPage, None]:
    """The objects of ``spec`` in pages of ``limit`` (``limit``/``continue``). Items get ``kind`` and
    ``apiVersion`` set (list items usually lack them). A 410 on a continue token surfaces as KubeError(410).

    The next page is requested while the caller works on the current one (at most two pages in memory), so the
    API server's latency hides behind the caller's work."""
    fn = spec.method(api, namespace)
    ahead: asyncio.Task[ListPage] | None = asyncio.ensure_future(_page(fn, spec, "", limit, timeouts))
    try:
        while ahead is not None:
            page = await ahead
            ahead = None
            if page.continue_token:
                ahead = asyncio.ensure_future(_page(fn, spec, page.continue_token, limit, timeouts))
            yield page
    finally:
        if ahead is not None:
            ahead.cancel()
            ahead.add_done_callback(_retrieve)


async def read(
    api: ApiClient, spec: ResourceSpec, namespace: str, name: str, timeouts: Timeouts = Timeouts()
) -> Obj | None:
    """One namespaced custom object of ``spec`` as the API server has it now (a quorum read); None when it does not
    exist."""
    return await call_object_or_none(
        CustomObjectsApi(api).get_namespaced_custom_object,
        spec.group,
        spec.version,
        namespace,
        spec.plural,
        name,
        _request_timeout=timeouts.for_list(),
    )


def _retrieve(task: asyncio.Task[ListPage]) -> None:
    """Consume the outcome of a prefetch nobody awaits (no "exception was never retrieved" warning)."""
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str
    """ADDED, MODIFIED, DELETED, BOOKMARK or ERROR."""
    object: Obj


async def watch(
    api: ApiClient,
    spec: ResourceSpec,
    resource_version: str,
    *,
    timeout_seconds: int,
    timeouts: Timeouts = Timeouts(),
) -> AsyncGenerator[WatchEvent, None]:
    """Events after ``resource_version`` with bookmarks, until the server ends the watch (the iterator ends) or
    the connection fails (KubeError with status 0). ERROR events are yielded as they are; the caller reads their
    Status."""
    fn = spec.method(api, None)
    kw: dict[str, Any] = {
        "watch": True,
        "resource_version": resource_version,
        "allow_watch_bookmarks": True,
        "timeout_seconds": timeout_seconds,
        "_request_timeout": timeouts.for_watch(timeout_seconds),
    }
    if spec.label_selector:
        kw["label_selector"] = spec.label_selector
    if spec.field_selector:
        kw["field_selector"] = spec.field_selector
    resp = await call(fn, **kw)
    buf = b""
    try:
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                raise KubeError(NETWORK, type(e).__name__, str(e) or "watch connection lost") from None
            if not chunk:
                return
            buf = buf + chunk if buf else chunk
            if b"\n" not in chunk:
                if len(buf) > _MAX_LINE:
                    raise KubeError(NETWORK, "BadWatch", f"watch frame over {_MAX_LINE} bytes")
                continue
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in lines:
                if not line.strip():
                    continue
                try:
                    frame = _decode(line)
                except msgspec.DecodeError as e:
                    raise KubeError(NETWORK, "BadWatch", f"watch frame is not JSON: {e}") from None
                if not isinstance(frame, dict) or not isinstance(frame.get("object"), dict):
                    raise KubeError(NETWORK, "BadWatch", "watch frame without an object")
                yield WatchEvent(str(frame.get("type") or ""), frame["object"])
    finally:
        resp.close()
