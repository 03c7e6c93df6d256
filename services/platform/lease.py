"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's ``leaderelection`` does it, plus two
things the services need from it: readiness that tells the truth, and a hand-over on a graceful stop.

* A candidate reads the Lease every ``retry_period`` seconds while another holds it (``standby_poll`` once it
  has seen it held: a released Lease is taken within that), and takes it when it is free, released (no holder)
  or expired: its record unchanged for ``lease_duration`` seconds *as this process observed it* (local time, not
  the record's timestamps, so clock skew between nodes does not matter). Writes carry the resourceVersion read,
  so two candidates cannot both win.
* The leader renews every ``retry_period``; when no renewal succeeds for ``renew_deadline`` seconds it has lost
  the Lease (another candidate may take it ``lease_duration`` after the last renewal).
* On a graceful stop the leader releases the Lease (no holder, a duration of one second: client-go's
  ``ReleaseOnCancel``), so a standby takes over at its next poll instead of after ``lease_duration``.
* :class:`Fence`: whether the leader may still write. A renewal that began at ``t`` keeps the Lease this
  candidate's until at least ``t + lease_duration`` (a standby waits that long after it saw the record change), so
  a write sent before ``t + renew_deadline`` lands in time unless the network holds it longer than the difference.
  The work's writes check it, so that a leader paused (a node stall, SIGSTOP) past that moment sends nothing once
  it resumes, before its next renewal fails: a new leader may have acted meanwhile.
* :attr:`Elector.healthy`: the last call to the API server succeeded (leading, or a standby that sees a valid
  holder). An error is logged once per distinct cause (a missing lease namespace says so and what to do), not on
  every retry.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from services.platform.kube import KubeError, call_object, call_object_or_none

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """Seconds. ``lease_duration`` is whole seconds (the Lease's ``leaseDurationSeconds`` is an integer)."""

    lease_duration: int = 15
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    standby_poll: float = 0.25
    """How often a standby reads a Lease it saw held: a released Lease is taken within this."""

    def __post_init__(self) -> None:
        if not (0 < self.retry_period < self.renew_deadline < self.lease_duration) or self.standby_poll <= 0:
            raise ValueError(f"invalid lease timing {self!r}: need 0 < retry_period < renew_deadline < duration")


def _micro_time(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseLost(RuntimeError):
    pass


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def _clock() -> float:
    """Seconds that go on while the host is suspended too (Linux' ``CLOCK_BOOTTIME``; ``time.monotonic`` stops):
    a leader resumed from a suspend must not take the suspended time for time it still leads."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


class Fence:
    """Whether this process may write as the leader now: always without leader election (as made), until a
    moment the :class:`Elector` sets with it (see the module), on :func:`_clock`."""

    def __init__(self) -> None:
        self._until = math.inf

    def hold_until(self, until: float) -> None:
        """Writes are allowed until ``until`` (:func:`_clock`)."""
        self._until = until

    def allows(self) -> bool:
        return _clock() < self._until


class Elector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming,
        *,
        on_health: Callable[[bool], None] | None = None,
        fence: Fence | None = None,
    ) -> None:
        """``on_health(ok)`` is called after every call to the API server (readiness follows it); ``fence`` is
        held while this candidate leads (closed until then)."""
        from kubernetes_asyncio import client

        self.coordination = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing
        self.log = structlog.get_logger("vmquota.lease").bind(lease=name, lease_namespace=namespace, identity=identity)
        self.healthy = False
        self.leading = False
        self._observed: tuple[str, int, str] | None = None
        """(holder, leaseDurationSeconds, renewTime) of the record last read, and when it changed (below)."""
        self._observed_at = 0.0
        self._lease: Obj | None = None
        self._last_error = ""
        self._on_health = on_health
        self.fence = fence if fence is not None else Fence()
        self.fence.hold_until(-math.inf)

    # ---- one attempt -------------------------------------------------------------------------------------------
    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this candidate holds the Lease afterwards (the fence held until this round's
        start plus ``renew_deadline``)."""
        started = _clock()
        won = await self._round()
        if won:
            self.fence.hold_until(started + self.timing.renew_deadline)
        elif not self.leading:
            self.fence.hold_until(-math.inf)
        return won

    async def _round(self) -> bool:
        now = datetime.now(UTC)
        try:
            lease = await call_object_or_none(self.coordination.read_namespaced_lease, self.name, self.namespace)
        except KubeError as e:
            return self._failed(e)
        if lease is None:
            return await self._create(now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        duration = int(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        record = (holder, duration, str(spec.get("renewTime") or ""))
        mono = time.monotonic()
        if record != self._observed:
            self._observed, self._observed_at = record, mono
        if holder and holder != self.identity and mono < self._observed_at + duration:
            self._ok()
            self.leading = False
            return False  # held by another, and valid
        transitions = int(spec.get("leaseTransitions") or 0)
        body: Obj = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion"),
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.timing.lease_duration,
                "acquireTime": spec.get("acquireTime") if holder == self.identity else _micro_time(now),
                "renewTime": _micro_time(now),
                "leaseTransitions": transitions if holder == self.identity else transitions + 1,
            },
        }
        try:
            written = await call_object(self.coordination.replace_namespaced_lease, self.name, self.namespace, body)
        except KubeError as e:
            if e.conflict:  # another candidate wrote first
                self._ok()
                self.leading = False
                return False
            return self._failed(e)
        return self._won(written)

    async def _create(self, now: datetime) -> bool:
        body: Obj = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.timing.lease_duration,
                "acquireTime": _micro_time(now),
                "renewTime": _micro_time(now),
                "leaseTransitions": 0,
            },
        }
        try:
            created = await call_object(self.coordination.create_namespaced_lease, self.namespace, body)
        except KubeError as e:
            if e.status == 409:  # another candidate created it first
                self._ok()
                return False
            return self._failed(e)
        return self._won(created)

    def _won(self, lease: Obj) -> bool:
        self._lease = lease
        self._ok()
        self.leading = True
        return True

    def _ok(self) -> None:
        if self._last_error:
            self.log.info("lease API reachable again")
        self._last_error = ""
        self.healthy = True
        if self._on_health is not None:
            self._on_health(True)

    def _failed(self, e: KubeError) -> bool:
        self.healthy = False
        if self._on_health is not None:
            self._on_health(False)
        if e.not_found:
            why = (
                f"the lease namespace {self.namespace!r} does not exist: create it, or point --lease-namespace "
                "(VMQUOTA_LEASE_NAMESPACE) at the namespace vmquota runs in"
            )
        elif e.status in (401, 403):
            why = f"not allowed to read or write the Lease {self.namespace}/{self.name} ({e}): check the RBAC"
        else:
            why = f"the Lease {self.namespace}/{self.name} cannot be read or written: {e}"
        if why != self._last_error:
            self.log.error("leader election failing; not ready", error=why)
            self._last_error = why
        return False

    # ---- release -----------------------------------------------------------------------------------------------
    async def release(self) -> None:
        """Give the Lease up (a graceful stop of the leader): no holder, a duration of one second. As client-go
        does, the record is read first and released only while it still names this candidate: a renewal cancelled
        in flight may have reached the server, so the copy held from the last renewal can be stale."""
        self.fence.hold_until(-math.inf)
        if self._lease is None:
            return
        self._lease = None
        self.leading = False
        for _ in range(3):
            try:
                lease = await call_object(self.coordination.read_namespaced_lease, self.name, self.namespace)
            except KubeError as e:
                self.log.warning("lease not released; a standby takes over once it expires", error=str(e))
                return
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return  # already someone else's (or free)
            now = _micro_time(datetime.now(UTC))
            spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=now, acquireTime=now)
            try:
                await call_object(
                    self.coordination.replace_namespaced_lease, self.name, self.namespace, {**lease, "spec": spec}
                )
            except KubeError as e:
                if e.conflict:
                    continue  # written meanwhile: read again
                self.log.warning("lease not released; a standby takes over once it expires", error=str(e))
                return
            self.log.info("lease released")
            return
        self.log.warning("lease not released (it kept changing); a standby takes over once it expires")

    # ---- the loops ---------------------------------------------------------------------------------------------
    async def acquire(self) -> None:
        """Return once this candidate holds the Lease."""
        while not await self.try_acquire_or_renew():
            held = self.healthy and self._observed is not None and self._observed[0] not in ("", self.identity)
            await asyncio.sleep(self.timing.standby_poll if held else self.timing.retry_period)

    async def keep(self) -> None:
        """Renew every ``retry_period`` while leading; raise :class:`LeaseLost` once no renewal succeeded for
        ``renew_deadline`` seconds (or another holder took it)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.timing.retry_period)
            if await self.try_acquire_or_renew():
                last = time.monotonic()
                continue
            if self.healthy and not self.leading and self._observed and self._observed[0] != self.identity:
                raise LeaseLost(f"the Lease {self.namespace}/{self.name} is held by {self._observed[0]}")
            if time.monotonic() - last >= self.timing.renew_deadline:
                raise LeaseLost(
                    f"the Lease {self.namespace}/{self.name} was not renewed for {self.timing.renew_deadline}s"
                )


async def run_leading(
    elector: Elector,
    work: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
    *,
    on_lead: Callable[[bool], None] | None = None,
) -> None:
    """Wait for the Lease, then run ``work()`` while holding it. ``stop`` ends the wait or lets the work finish
    (it sees ``stop`` itself); once the work is over, for whatever reason, the Lease is released. Losing the Lease
    cancels the work and raises :class:`LeaseLost`. ``on_lead(True/False)`` reports leadership changes."""
    stopper = asyncio.create_task(stop.wait())
    acquiring = asyncio.create_task(elector.acquire())
    try:
        await asyncio.wait([acquiring, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not acquiring.done():
            return  # stopped while waiting
        acquiring.result()
    finally:
        acquiring.cancel()
    elector.log.info("leading")
    if on_lead is not None:
        on_lead(True)

    async def run_work() -> None:
        await work()

    working = asyncio.create_task(run_work())
    keeping = asyncio.create_task(elector.keep())
    try:
        await asyncio.wait([working, keeping, stopper], return_when=asyncio.FIRST_COMPLETED)
        if keeping.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
            keeping.result()  # raises LeaseLost
        if stopper.done() and not working.done():
            await asyncio.wait([working], timeout=15.0)  # the work sees the stop itself: let it finish
        if not working.done():
            working.cancel()
        await asyncio.gather(working, return_exceptions=True)
        if not working.cancelled() and working.exception() is not None:
            raise working.exception()  # type: ignore[misc]
    finally:
        keeping.cancel()
        stopper.cancel()
        await asyncio.gather(keeping, stopper, return_exceptions=True)
        if on_lead is not None:
            on_lead(False)
        if elector.leading:  # (the work is over: a standby may start at once)
            await elector.release()
