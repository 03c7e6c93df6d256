"""The contract between the simulated cluster's object store and its controllers.

The store (``store.py``) is the in-memory "etcd + generic registry" of the simulated API server: one global,
monotonically increasing resourceVersion, optimistic concurrency, admission hooks, and watch fan-out. The HTTP
layer (``server.py``) and the in-process controllers (``quota.py``, ``kubevirt.py``) both use only this contract.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Obj = dict[str, Any]
Operation = Literal["CREATE", "UPDATE", "DELETE"]
WatchType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]


@dataclass(frozen=True, slots=True)
class Resource:
    """A served resource type, e.g. ``Resource("", "v1", "pods", "Pod", True)``."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """``pods`` or ``virtualmachineinstances.kubevirt.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


class ApiError(Exception):
    """An error the API server returns, rendered as a ``Status`` object with this code, reason and message."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # NotFound, AlreadyExists, Conflict, Forbidden, Invalid, Gone, TooManyRequests, ...
        self.message = message
        self.details = dict(details or {})

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: WatchType
    object: Obj


# An admission hook sees the operation, the resource, the new object (None for DELETE), the old one (None for
# CREATE) and the subresource written (None for the main resource; "status", "resize"). It may return a modified
# object (mutating) or raise ApiError (validating, e.g. quota 403). Hooks run in registration order, inside the
# store's write lock, before the resourceVersion is assigned.
AdmissionHook = Callable[[Operation, Resource, Obj | None, Obj | None, str | None], Awaitable[Obj | None]]

DELETE_OPTIONS: ContextVar[Obj | None] = ContextVar("simcluster_delete_options", default=None)
"""The ``DeleteOptions`` of the delete being admitted (admission's ``request.options``), None otherwise."""


class StoreAPI(Protocol):
    """What the store offers. All objects going in and out are plain JSON dicts (deep copies)."""

    def resource(self, key: str) -> Resource:
        """Look up a resource by plural (``pods``), ``plural.group``, kind, or short name; KeyError if unknown."""
        ...

    @property
    def resource_version(self) -> int:
        """The current (latest assigned) global resourceVersion."""
        ...

    async def create(self, res: Resource, obj: Obj, *, namespace: str | None = None) -> Obj:
        """Assign uid, creationTimestamp, resourceVersion (and name from generateName); 409 AlreadyExists."""
        ...

    async def get(self, res: Resource, namespace: str | None, name: str) -> Obj:
        """404 NotFound when absent."""
        ...

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[list[Obj], int]:
        """Objects (sorted by namespace/name) and the resourceVersion of the list."""
        ...

    async def update(self, res: Resource, obj: Obj, *, subresource: str | None = None) -> Obj:
        """Replace; ``metadata.resourceVersion`` if set must equal the stored one, else 409 Conflict.
        With ``subresource="status"`` only ``status`` is taken from ``obj``; otherwise ``status`` is kept
        unchanged for resources that have a status subresource."""
        ...

    async def patch(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        patch: Any,
        patch_type: Literal["merge", "json", "strategic"],
        *,
        subresource: str | None = None,
    ) -> Obj:
        """Apply a patch; a ``metadata.resourceVersion`` in the result that differs from the stored one → 409."""
        ...

    async def mutate(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        fn: Callable[[Obj], Obj | None],
        *,
        status: bool = False,
    ) -> Obj:
        """Read-modify-write under the store lock (for controllers): ``fn`` gets a copy and returns the new
        object (or None: no change). Runs admission like an update. Never 409s."""
        ...

    async def bind(self, res: Resource, namespace: str, name: str, node: str) -> Obj:
        """Bind a pod to a node (``pods/binding``, as the scheduler does): ``spec.nodeName`` can be set no other
        way. 409 when the pod is bound already or being deleted."""
        ...

    async def delete(self, res: Resource, namespace: str | None, name: str) -> Obj:
        """With finalizers: sets deletionTimestamp and returns the object; without: removes it (DELETED event)."""
        ...

    def watch(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        resource_version: int | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        bookmarks: bool = False,
    ) -> AsyncIterator[WatchEvent]:
        """Events after ``resource_version`` (None: from now). A version older than the retained history yields
        one ERROR event with a 410 Gone Status and ends."""
        ...

    def add_admission(self, res: Resource, hook: AdmissionHook, *, first: bool = False, mutating: bool = False) -> None:
        """Run ``hook`` on every write of ``res`` (``first``: before the hooks added so far); a hook returns the
        object to store instead (a mutation) or None. ``mutating`` hooks all run before the validating ones."""
        ...

    def keep_status_on_create(self, res: Resource) -> None:
        """A create of ``res`` keeps the status it is written with, for its mutating admission to rewrite (a kind
        with no status subresource on a real server whose simulated controllers write status through one)."""
        ...

    def on_change(self, callback: Callable[[WatchType, Resource, Obj], None]) -> None:
        """In-process informer: called synchronously after every committed write (for controllers' queues)."""
        ...
