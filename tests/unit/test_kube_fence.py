"""The enforcer's writes and its Lease fence: no request goes out once the fence is closed."""

from __future__ import annotations

import math
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

import services.enforcer.kube as kube
from services.enforcer.kube import KubeQuotas
from services.platform.lease import Fence


async def test_a_migration_is_not_deleted_once_the_fence_closed_during_its_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cancel_migration`` reads the migration (up to its 5 s timeout) before it deletes it: checked only before
    the read, a replica paused, or slowed, past its renew deadline during the read sent the delete after a standby
    may have taken over (the fence's margin, lease_duration - renew_deadline, is that timeout). It checks again."""
    fence = Fence()
    sent: list[str] = []

    async def read(*args: Any, **kwargs: Any) -> dict[str, Any]:
        fence.hold_until(-math.inf)  # (the renew deadline passes while the read is out)
        return {"metadata": {"uid": "m1"}, "status": {"phase": "Running"}}

    async def delete(*args: Any, **kwargs: Any) -> bytes:
        sent.append("delete")
        return b""

    monkeypatch.setattr(kube, "call_object_or_none", read)
    monkeypatch.setattr(kube, "call_bytes", delete)
    api = ApiClient()
    try:
        calls = KubeQuotas(api, fence=fence)
        with pytest.raises(kube.KubeError):
            await calls.cancel_migration("tenant-a", "mig", "m1")
        assert sent == [], "a delete went out past the renew deadline"
    finally:
        await api.close()


async def test_a_reservation_is_not_created_once_the_fence_closed_during_its_patch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``put_reservation`` patches, and on a 404 creates: the fence is checked again before the create."""
    fence = Fence()
    sent: list[str] = []

    async def call(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        name = getattr(fn, "__name__", "")
        if name.startswith("patch"):
            fence.hold_until(-math.inf)
            raise kube.KubeError(404, "NotFound", "no reservation")
        sent.append(name)
        return {"metadata": {"resourceVersion": "2"}}

    monkeypatch.setattr(kube, "call_object", call)
    api = ApiClient()
    try:
        calls = KubeQuotas(api, fence=fence)
        with pytest.raises(kube.KubeError):
            await calls.put_reservation("tenant-a", {"spec": {}}, "1")
        assert sent == [], "a create went out past the renew deadline"
    finally:
        await api.close()
