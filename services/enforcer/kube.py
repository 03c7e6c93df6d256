"""The enforcer's Kubernetes calls: read a ResourceQuota, merge-patch it (and its ``status.hard``), create an
Event, nudge a VMI, cancel a migration, write a namespace's QuotaReservation and read a VMI (the reservation
guard).

Each goes through kubernetes-asyncio's generated ``CoreV1Api`` method via :mod:`services.platform.kube` (raw responses
decoded with msgspec, an explicit ``_request_timeout``, every failure a :class:`~services.platform.kube.KubeError`), so
no call can hang and the enforcer decides in one place what a 409, a 404 or a 429 means.
"""

from __future__ import annotations

from typing import Any, Final, Protocol, cast

from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

from services.platform.kube import NETWORK, KubeError, Obj, call_bytes, call_object, call_object_or_none
from services.platform.lease import Fence
from shared.kinds import FINAL_PHASES, QUOTA_KIND
from shared.quota import guard
from shared.quota.annotations import NUDGE_ANNOTATION

__all__ = ["MERGE_PATCH", "KubeError", "KubeQuotas", "Obj", "QuotaApi", "version_of"]

MERGE_PATCH: Final = "application/merge-patch+json"


class QuotaApi(Protocol):
    """What the enforcer needs of the API server (the tests count and fault these calls)."""

    async def get_quota(self, namespace: str, name: str) -> Obj: ...

    async def list_quotas(self, label_selector: str, namespace: str | None = None) -> list[Obj]: ...

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj: ...

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj: ...

    async def create_event(self, namespace: str, body: Obj) -> None: ...

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None: ...

    async def cancel_migration(self, namespace: str, name: str, uid: str) -> bool: ...

    async def get_vmi(self, namespace: str, name: str) -> Obj | None: ...

    async def put_reservation(self, namespace: str, body: Obj, resource_version: str) -> str: ...

    async def get_reservation(self, namespace: str) -> Obj | None: ...

    async def list_reservations(self) -> list[Obj]: ...


class KubeQuotas:
    """:class:`QuotaApi` over a kubernetes-asyncio ``ApiClient``; every call times out after ``timeout`` s. Its writes
    go out only while ``fence`` allows (``services.platform.lease.Fence``: an enforcer that may have lost its Lease
    writes nothing, a quota's ``hard`` least of all); a refused write is a network-class :class:`KubeError`
    (``NotLeading``), retried as any failed call until the work is stopped."""

    def __init__(self, api: ApiClient, *, timeout: float = 5.0, fence: Fence | None = None) -> None:
        self.core = CoreV1Api(api)
        self.custom = CustomObjectsApi(api)
        self.timeout = timeout
        self.fence = fence if fence is not None else Fence()

    def _may_write(self) -> None:
        if not self.fence.allows():
            raise KubeError(NETWORK, "NotLeading", "the Lease may have passed to another replica: nothing written")

    async def get_quota(self, namespace: str, name: str) -> Obj:
        return await call_object(
            self.core.read_namespaced_resource_quota, name, namespace, _request_timeout=self.timeout
        )

    async def list_quotas(self, label_selector: str, namespace: str | None = None) -> list[Obj]:
        """Every ResourceQuota matching ``label_selector`` in all namespaces, or in ``namespace`` (items get ``kind``
        set, as a list's items lack it)."""
        if namespace is None:
            listing = await call_object(
                self.core.list_resource_quota_for_all_namespaces,
                label_selector=label_selector,
                _request_timeout=self.timeout,
            )
        else:
            listing = await call_object(
                self.core.list_namespaced_resource_quota,
                namespace,
                label_selector=label_selector,
                _request_timeout=self.timeout,
            )
        items = listing.get("items")
        if not isinstance(items, list):
            raise KubeError(0, "BadResponse", "the quota list has no items")
        return [{"apiVersion": "v1", "kind": QUOTA_KIND, **i} for i in items if isinstance(i, dict)]

    async def patch_quota(self, namespace: str, name: str, body: Obj) -> Obj:
        self._may_write()
        return await call_object(
            self.core.patch_namespaced_resource_quota,
            name,
            namespace,
            body,
            _request_timeout=self.timeout,
            _content_type=MERGE_PATCH,
        )

    async def patch_quota_status(self, namespace: str, name: str, body: Obj) -> Obj:
        """Merge-patch the quota's ``status`` subresource (RBAC: ``patch`` on ``resourcequotas/status``): only
        ``status.hard``, with what the quota controller would copy there from ``spec.hard``."""
        self._may_write()
        return await call_object(
            self.core.patch_namespaced_resource_quota_status,
            name,
            namespace,
            body,
            _request_timeout=self.timeout,
            _content_type=MERGE_PATCH,
        )

    async def create_event(self, namespace: str, body: Obj) -> None:
        self._may_write()
        await call_bytes(self.core.create_namespaced_event, namespace, cast(Any, body), _request_timeout=self.timeout)

    async def nudge_vmi(self, namespace: str, name: str, token: str) -> None:
        """Merge-patch the VMI's :data:`NUDGE_ANNOTATION` to ``token`` (RBAC: ``patch`` on
        ``virtualmachineinstances``, nothing else of KubeVirt's)."""
        self._may_write()
        body = {"metadata": {"annotations": {NUDGE_ANNOTATION: token}}}
        await call_bytes(
            self.custom.patch_namespaced_custom_object,
            "kubevirt.io",
            "v1",
            namespace,
            "virtualmachineinstances",
            name,
            cast(Any, body),
            _request_timeout=self.timeout,
            _content_type=MERGE_PATCH,
        )

    async def cancel_migration(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the migration ``name`` if it is still the one of ``uid`` and not final (KubeVirt cancels a deleted
        migration before its hand-off and aborts it after); False when it is gone, another or final. The delete has
        the uid as precondition (a migration of the same name made since is left alone; one that turned final in
        between is deleted harmlessly). RBAC: ``get`` and ``delete`` on ``virtualmachineinstancemigrations``."""
        self._may_write()
        m = await call_object_or_none(
            self.custom.get_namespaced_custom_object,
            "kubevirt.io",
            "v1",
            namespace,
            "virtualmachineinstancemigrations",
            name,
            _request_timeout=self.timeout,
        )
        meta = (m or {}).get("metadata") or {}
        phase = ((m or {}).get("status") or {}).get("phase")
        if m is None or meta.get("uid") != uid or meta.get("deletionTimestamp") or phase in FINAL_PHASES:
            return False
        self._may_write()  # (again: the read took its time)
        try:
            await call_bytes(
                self.custom.delete_namespaced_custom_object,
                "kubevirt.io",
                "v1",
                namespace,
                "virtualmachineinstancemigrations",
                name,
                body=cast(Any, {"preconditions": {"uid": uid}}),
                _request_timeout=self.timeout,
            )
        except KubeError as e:
            if e.not_found or e.conflict:  # (gone, or another of its name)
                return False
            raise
        return True

    async def get_vmi(self, namespace: str, name: str) -> Obj | None:
        """The VMI as the API server has it now (a quorum read), None when there is none (RBAC: ``get`` on
        ``virtualmachineinstances``): with the reservation guard, the size a migration target's room is opened for
        is checked against it."""
        return await call_object_or_none(
            self.custom.get_namespaced_custom_object,
            "kubevirt.io",
            "v1",
            namespace,
            "virtualmachineinstances",
            name,
            _request_timeout=self.timeout,
        )

    async def get_reservation(self, namespace: str) -> Obj | None:
        """The namespace's QuotaReservation, None when there is none (RBAC: ``get``)."""
        return await call_object_or_none(
            self.custom.get_namespaced_custom_object,
            guard.GROUP,
            guard.VERSION,
            namespace,
            guard.PLURAL,
            guard.NAME,
            _request_timeout=self.timeout,
        )

    async def list_reservations(self) -> list[Obj]:
        """Every namespace's QuotaReservation (``list`` on ``quotareservations.vmquota.io``): at the start and at
        each resync, the enforcer takes in what its writes' lost answers hid, and finds the holders listed in a
        namespace left with no managed quota."""
        found = await call_object(
            self.custom.list_cluster_custom_object,
            guard.GROUP,
            guard.VERSION,
            guard.PLURAL,
            _request_timeout=self.timeout,
        )
        items = found.get("items")
        if not isinstance(items, list):
            raise KubeError(0, "BadResponse", "the QuotaReservation list has no items")
        return [i for i in items if isinstance(i, dict)]

    async def put_reservation(self, namespace: str, body: Obj, resource_version: str) -> str:
        """Write the namespace's QuotaReservation ``body`` (:mod:`shared.quota.guard`) over the version the caller last
        read or wrote (``resource_version``; empty: it knows of none): a merge patch of its ``spec`` (lists are
        replaced whole) with that version as precondition, or a create. Another writer in between is a 409
        (:attr:`KubeError.conflict`), for a create too. Returns the new resourceVersion. RBAC: ``create``/``patch``
        on ``quotareservations.vmquota.io``."""
        self._may_write()
        if resource_version:
            patch = {"metadata": {"resourceVersion": resource_version}, "spec": body["spec"]}
            try:
                written = await call_object(
                    self.custom.patch_namespaced_custom_object,
                    guard.GROUP,
                    guard.VERSION,
                    namespace,
                    guard.PLURAL,
                    guard.NAME,
                    cast(Any, patch),
                    _request_timeout=self.timeout,
                    _content_type=MERGE_PATCH,
                )
                return version_of(written)
            except KubeError as e:
                if not e.not_found:
                    raise
        self._may_write()  # (again: the patch took its time)
        written = await call_object(
            self.custom.create_namespaced_custom_object,
            guard.GROUP,
            guard.VERSION,
            namespace,
            guard.PLURAL,
            cast(Any, body),
            _request_timeout=self.timeout,
        )
        return version_of(written)


def version_of(obj: Obj | None) -> str:
    """An object's ``metadata.resourceVersion`` ("" for none, or no object)."""
    meta = (obj or {}).get("metadata")
    return str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
