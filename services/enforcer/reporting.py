"""What the enforcer does besides ``spec.hard``, all off the write path: each decision as a Kubernetes Event on the
quota and a ``Decision`` on the bus, a Warning Event on a VMI the ledger refused (or whose hotplug it refused), the
nudge of a VMI KubeVirt was refused a launcher pod for once there is room, and the cancel of a migration whose end
would carry out a size change never admitted (:class:`Reporter`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import structlog

from services.enforcer.kube import KubeError, Obj, QuotaApi
from services.enforcer.options import (
    NUDGED_MAX,
    NUDGING_MAX,
    NUDGING_PER_NAMESPACE,
    REPORT_QUEUE,
    TELLING_MAX,
    EnforcerMetrics,
    EnforcerOptions,
    Key,
)
from services.platform.bus import Bus
from services.platform.http import Metrics
from services.platform.runner import cancel
from services.platform.workqueue import WorkQueue
from shared import contract
from shared.backoff import Backoff
from shared.quota import enforcement, guard, reports
from shared.quota.annotations import USAGE_FROM_ANNOTATION
from shared.quota.enforcement import Plan

log = structlog.get_logger("vmquota.enforcer")

NudgeKey = tuple[str, str]
"""(namespace, VMI uid)."""


@dataclass(slots=True)
class _Touch:
    """A touch of a VMI asked for: its name, the usage snapshot (stream sequence) it is for, the monotonic time it
    may be made at, and its annotation value (empty while it waits for that time: it is made, and given one, then)."""

    name: str
    at: int
    due: float
    token: str = ""


def _namespace_of(key: NudgeKey) -> str:
    return key[0]


class Reporter:
    """The enforcer's reports and the tenant-facing Events and nudges; :meth:`run` publishes the reports queued."""

    def __init__(
        self,
        bus: Bus,
        kube: QuotaApi,
        opts: EnforcerOptions,
        metrics: Metrics,
        own: EnforcerMetrics,
        now: Callable[[], datetime],
    ) -> None:
        self.bus = bus
        self.kube = kube
        self.opts = opts
        self.metrics = metrics
        self.own = own
        self._now = now
        self._backoff = Backoff(initial=opts.retry_base, maximum=opts.retry_max, jitter=0.2)
        self._queue: asyncio.Queue[tuple[Plan, str, str | None]] = asyncio.Queue(REPORT_QUEUE)
        self._dry_seen: dict[Key, str] = {}
        self._nudged: dict[tuple[str, str], tuple[int, float]] = {}
        """(namespace, VMI uid) → the usage snapshot (its stream sequence) and the time of the last nudge."""
        self._told: dict[tuple[str, ...], None] = {}
        """(namespace, migration uid) of hotplugs refused, told on their VMI (once each)."""
        self._canceled: dict[tuple[str, str], None] = {}
        """(namespace, migration uid) of migrations canceled, or being canceled (once each; forgotten when it fails)."""
        self._told_vmi: dict[tuple[str, str], tuple[str, float]] = {}
        """(namespace, VMI uid) of VMs refused → the reason last told and when (monotonic)."""
        self._later: dict[tuple[str, str], tuple[contract.VmState, list[contract.VmState]]] = {}
        """(namespace, VMI uid) → the refusal to tell once ``tell_interval`` has passed since the last (a changed
        cause), and the namespace's VMs then."""
        self._telling = asyncio.Semaphore(TELLING_MAX)
        """Events under way at once: however many VMIs there are to tell, the quota patches keep the API client."""
        self._touches = 0
        """Touches made so far. Each touch's annotation value is the usage snapshot's sequence, this process's
        :attr:`_epoch` and this count, so that it changes the VMI: a patch that changes nothing is no update KubeVirt
        sees (a nudge again for the same usage, an enforcer that took over from another, a holder let in again)."""
        self._epoch = secrets.token_hex(3)
        self._touch: dict[str, dict[str, _Touch]] = {}
        """namespace → VMI uid → the touch asked for of it and not yet made (one per VMI: a later one replaces it)."""
        self._nudges: WorkQueue[NudgeKey] = WorkQueue(
            "nudge",
            self._nudge,
            workers=NUDGING_MAX,
            backoff=self._backoff,
            share=(_namespace_of, NUDGING_PER_NAMESPACE),
            on_retry=self._nudge_retry,
        )
        """The VMIs to touch. A VMI asked for while its touch is under way is touched once more after it (that one
        may have reached KubeVirt before the room the new one is for was made); one asked for while waiting its turn
        is touched once, with the latest value. The queue owns the retries."""
        self.side_tasks: set[asyncio.Task[None]] = set()
        """VMI Events and cancels under way (off the reconcile path)."""
        self.reported = 0

    # ---- decisions ---------------------------------------------------------------------------------------------
    def decision(self, p: Plan, resource_version: str, at: str | None = None) -> None:
        """A write of ``p`` went out (``resource_version``: the quota's version after it; ``at``: when its first
        write went out, the decision's time: quota admission may act on ``status.hard`` before the last one
        returns): log it and queue its Event and bus decision."""
        self.own.decisions.labels(action=p.action.value).inc()
        log.info(
            "quota decision",
            namespace=p.namespace,
            quota=p.name,
            action=p.action.value,
            reason=p.reason,
            hard=enforcement.rl_json(p.written_after),
            usage_seq=p.usage_seq,
            resource_version=resource_version or p.resource_version,
            **({"status_only": True} if p.status_only else {}),
        )
        try:
            self._queue.put_nowait((p, resource_version, at))
        except asyncio.QueueFull:
            log.error("report queue full; decision not published", namespace=p.namespace, quota=p.name)

    def dry_run(self, key: Key, p: Plan) -> None:
        """Dry-run: report a plan once (the same plan again says nothing new)."""
        body = enforcement.patch_body(p)
        body["metadata"].pop("resourceVersion", None)
        (body["metadata"].get("annotations") or {}).pop(USAGE_FROM_ANNOTATION, None)  # (each snapshot's own)
        fingerprint = repr(sorted(body.items()))
        if self._dry_seen.get(key) == fingerprint:
            return
        self._dry_seen[key] = fingerprint
        self.decision(p, "")

    def forget(self, key: Key) -> None:
        self._dry_seen.pop(key, None)

    def nudge_again(self, namespace: str) -> None:
        """Let the namespace's VMIs be nudged again for the usage snapshot they were nudged for (a quota whose calls
        kept failing, which the nudge did not wait for, has the room now), at once."""
        for k in [k for k in self._nudged if k[0] == namespace]:
            self._nudged[k] = (-1, float("-inf"))

    async def run(self) -> None:
        while True:
            p, rv, at = await self._queue.get()
            try:
                await self._publish(p, rv, at)
            except Exception as e:  # a report is best effort: the quota itself is already right
                log.error("report failed", namespace=p.namespace, quota=p.name, error=str(e) or type(e).__name__)
            finally:
                self._queue.task_done()

    async def join(self) -> None:
        """Until every queued report went out."""
        await self._queue.join()

    def idle(self) -> bool:
        return self._queue.empty()

    async def _publish(self, p: Plan, rv: str, at: str | None) -> None:
        dry = self.opts.dry_run
        d = reports.decision(p, cluster=self.opts.cluster, dry_run=dry, resource_version=rv, time=at)
        await self.bus.publish(
            contract.decision_subject(self.opts.cluster, p.namespace), contract.encode(d), msg_id=d.id
        )
        self.metrics.events_out.labels(service=self.opts.service).inc()
        if not dry:
            body = reports.event_body(p, identity=self.opts.identity, now=self._now())
            try:
                await self._retrying(lambda: self.kube.create_event(p.namespace, body))
            except KubeError as e:
                if e.status != 409:  # (same name: already recorded)
                    raise
        self.reported += 1

    async def _retrying(self, call: Callable[[], Awaitable[_R]]) -> _R:
        """``call()``, a transient failure tried again after a backoff, three tries in all (the last failure
        raised)."""
        for attempt in range(2):
            try:
                return await call()
            except KubeError as e:
                if not e.retryable:
                    raise
                await asyncio.sleep(self._backoff.delay(attempt))
        return await call()

    # ---- the tenant's VMIs -------------------------------------------------------------------------------------
    def tell_and_nudge(
        self, namespace: str, u: contract.UsageSnapshot, at: int, opened: frozenset[str] = frozenset()
    ) -> None:
        """Once a quota of the namespace carries what usage ``u`` (stream sequence ``at``) asks: tell each VMI whose
        hotplug the ledger refused why (a Warning Event, once per migration), and each VMI the ledger refused why
        (once per cause), and touch each VMI the ledger admitted whose launcher pod KubeVirt was refused (KubeVirt's
        VMI controller does not watch quotas), once per usage snapshot and at most every ``nudge_interval`` seconds
        per VMI (one asked for sooner is made when the interval has passed: an earlier touch may have had KubeVirt
        try before the room this usage holds was made, and no later usage may come). ``opened``: the uids of the
        reservation guard's holders whose pods its QuotaReservation let in with no write of a quota after it
        (KubeVirt's migration controller re-queues on a quota's update, not on the QuotaReservation's): their VMIs
        are touched too, each once, whatever the two bounds above say (one touch per holder let in, which only the
        enforcer's own writes make). Off the reconcile path; a nudge that fails is tried again after a backoff,
        three tries in all, then logged."""
        now = time.monotonic()
        asked: set[str] = set()
        for m in u.migrations:
            if m.state == "growth-refused" and m.uid and (namespace, m.uid) not in self._told:
                _remember(self._told, (namespace, m.uid), None)
                body = reports.size_change_refused_event(namespace, m, identity=self.opts.identity, now=self._now())
                self.spawn(self._tell(namespace, body), f"tell-{namespace}-{m.name}")
        for v in u.vms:
            if v.state == "refused" and v.uid:
                self._tell_refused(namespace, v, u.vms, now)
            elif v.uid:
                self._later.pop((namespace, v.uid), None)  # (no longer refused: nothing to tell)
            if v.state != "admitted" or not v.pod_refused or not v.uid:
                continue
            asked.add(v.uid)
            key = (namespace, v.uid)
            last = self._nudged.get(key)
            if last is not None and last[0] >= at:
                continue
            if last is not None and now - last[1] < self.opts.nudge_interval:
                # (not dropped, it may be the one nudge that matters: a VM refused during a migration is nudged in
                # vain at each usage until the source pod ends, and the touch for the usage with room came within
                # the interval of the last vain one; dropped, it waited for KubeVirt's backoff, doubled by each try)
                self._ask(key, v.name, at, last[1] + self.opts.nudge_interval, now)
                continue
            self._ask(key, v.name, at, 0.0, now)
        for uid, t in list(self._touch.get(namespace, {}).items()):
            if not t.token and uid not in asked:  # (a wait taken back: its pod got in, it is refused or gone)
                self._done((namespace, uid), t)
        for h in guard.holders(u) if opened else ():
            if h.uid in opened:
                self._ask((namespace, h.uid), h.name, at, 0.0, now)

    def _ask(self, key: NudgeKey, name: str, at: int, due: float, now: float) -> None:
        """Touch VMI ``name`` (``key``) for usage ``at`` at monotonic time ``due`` (0: at once). A touch that waits
        for its time keeps it for a later usage (one waits per VMI); one due already and not tried yet takes a later
        usage's place, and a touch asked for at once replaces one that waits; one under way or waiting to retry is
        followed by this one."""
        self._nudges.start()  # (its workers, once)
        t = self._asked(key)
        tried = self._nudges.processing(key) or self._nudges.failures(key) > 0  # (under way, or waiting to retry)
        if t is not None and not tried and (t.token or due > now):
            t.name, t.at = name, at  # (the touch asked for before makes this one too)
            return
        if due > now:
            self._touch.setdefault(key[0], {})[key[1]] = _Touch(name, at, due)
            self._nudges.add_after(key, due - now)
            return
        self._touch.setdefault(key[0], {})[key[1]] = self._made(name, at, now, key)
        self._nudges.add(key)

    def _asked(self, key: NudgeKey) -> _Touch | None:
        return self._touch.get(key[0], {}).get(key[1])

    def _done(self, key: NudgeKey, t: _Touch) -> None:
        """Forget touch ``t`` of VMI ``key``, unless another took its place."""
        asked = self._touch.get(key[0])
        if asked is not None and asked.get(key[1]) is t:
            del asked[key[1]]
            if not asked:
                del self._touch[key[0]]

    def _made(self, name: str, at: int, now: float, key: NudgeKey) -> _Touch:
        """The touch of VMI ``name`` for usage ``at`` made now: its own annotation value, the time remembered, and
        three tries of its own. (One tried already may have reached KubeVirt, answer lost, before the room this one
        is for was made: its value again would be no update.)"""
        self._nudges.forget(key)
        self._touches += 1
        _remember(self._nudged, key, (at, now))
        return _Touch(name, at, 0.0, f"{at}.{self._epoch}.{self._touches}")

    async def _nudge(self, key: NudgeKey) -> None:
        """Touch the VMI asked for (the nudge queue's handler), unless it waits for its time or was taken back; a
        transient failure is raised for the queue to retry after its backoff, three tries in all (a holder let in
        is touched once, and no later usage snapshot touches it again), then logged."""
        t = self._asked(key)
        if t is None:
            return
        now = time.monotonic()
        if not t.token:
            if t.due > now:  # (an older wait's time came: this one's has not)
                self._nudges.add_after(key, t.due - now)
                return
            t = self._touch[key[0]][key[1]] = self._made(t.name, t.at, now, key)
        try:
            await self.kube.nudge_vmi(key[0], t.name, t.token)
        except KubeError as e:
            if e.retryable and self._nudges.failures(key) < 2:
                raise
            self.own.nudges.labels(outcome="failed").inc()
            log.info("VMI not nudged", namespace=key[0], vmi=t.name, error=str(e))
        else:
            self.own.nudges.labels(outcome="applied").inc()
        self._nudges.forget(key)
        self._done(key, t)

    def _nudge_retry(self, key: NudgeKey, error: BaseException, attempt: int, delay: float) -> None:
        log.debug("VMI nudge retried", namespace=key[0], uid=key[1], attempt=attempt, error=str(error))

    def settled(self) -> bool:
        """No Event, cancel or nudge under way, queued or waiting for its time."""
        return not self.side_tasks and self._nudges.empty()

    async def stop(self) -> None:
        """Stop what is under way (the enforcer stops)."""
        await self._nudges.stop()
        await cancel(*self.side_tasks)

    def cancel(self, namespace: str, u: contract.UsageSnapshot) -> None:
        """Cancel each migration usage ``u`` says is to be (``cancel``: its end would carry out a size change of its
        VM never admitted) by deleting it, and tell its VMI why; once per migration, at once (the size change is
        carried out at the migration's end, whatever quota admission says meanwhile). A failed cancel is logged and
        tried again with the next usage snapshot. Dry-run: logged once per migration, nothing deleted."""
        for m in u.migrations:
            if m.state == "cancel" and m.uid and (namespace, m.uid) not in self._canceled:
                _remember(self._canceled, (namespace, m.uid), None)
                if self.opts.dry_run:
                    self.own.cancels.labels(outcome="dry-run").inc()
                    log.warning("dry run: migration not canceled", namespace=namespace, migration=m.name, vmi=m.vmi)
                    continue
                self.spawn(self._cancel(namespace, m), f"cancel-{namespace}-{m.name}")

    async def _cancel(self, namespace: str, m: contract.MigrationState) -> None:
        """Cancel one migration: a transient failure is tried again at once after a backoff (the migration's end
        does not wait), three times; then it is forgotten, and the next usage snapshot that asks tries again."""
        try:
            canceled = await self._retrying(lambda: self.kube.cancel_migration(namespace, m.name, m.uid))
        except KubeError as e:
            self._canceled.pop((namespace, m.uid), None)
            self.own.cancels.labels(outcome="failed").inc()
            log.warning("migration not canceled", namespace=namespace, migration=m.name, vmi=m.vmi, error=str(e))
            return
        self.own.cancels.labels(outcome="canceled" if canceled else "gone").inc()
        if not canceled:
            log.info("migration to cancel is gone or final", namespace=namespace, migration=m.name, vmi=m.vmi)
            return
        log.warning("migration canceled", namespace=namespace, migration=m.name, vmi=m.vmi, reason=m.reason)
        body = reports.size_change_refused_event(namespace, m, identity=self.opts.identity, now=self._now())
        await self._tell(namespace, body)

    def _tell_refused(self, namespace: str, v: contract.VmState, others: list[contract.VmState], now: float) -> None:
        """Tell a refused VMI why: once per cause (the same refusal in the next snapshots tells nothing new), and a
        changed cause at most every ``tell_interval`` seconds per VMI (the amounts left move with each pod of the
        namespace: a tenant churning one pod beside N refused VMIs made N Events per change); one changed sooner
        is told once the interval has passed, as it is then, even if no usage comes meanwhile."""
        key = (namespace, v.uid)
        last = self._told_vmi.get(key)
        if last is not None and last[0] == v.reason:
            self._later.pop(key, None)  # (back to what was told)
            return
        wait = 0.0 if last is None else self.opts.tell_interval - (now - last[1])
        if wait > 0:
            if key not in self._later:
                self.spawn(self._tell_later(key, wait), f"tell-later-{namespace}-{v.name}")
            self._later[key] = (v, others)
            return
        self._tell_now(key, v, others, now)

    def _tell_now(self, key: tuple[str, str], v: contract.VmState, others: list[contract.VmState], now: float) -> None:
        """Tell VMI ``key`` why it is refused now (an Event) and remember it."""
        self._told_vmi.pop(key, None)  # (the oldest first out)
        _remember(self._told_vmi, key, (v.reason, now))
        body = reports.vm_refused_event(key[0], v, identity=self.opts.identity, now=self._now(), others=others)
        self.spawn(self._tell(key[0], body), f"tell-{key[0]}-{v.name}")

    async def _tell_later(self, key: tuple[str, str], wait: float) -> None:
        """Tell the cause VMI ``key`` was last refused for once ``wait`` seconds have passed (if it still is)."""
        await asyncio.sleep(wait)
        later = self._later.pop(key, None)
        if later is not None:
            self._tell_now(key, *later, time.monotonic())

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` off the reconcile path (cancelled when the enforcer stops)."""
        task = asyncio.create_task(work, name=name)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)

    async def _tell(self, namespace: str, body: Obj) -> None:
        try:
            async with self._telling:
                await self.kube.create_event(namespace, body)
        except KubeError as e:
            log.info("VMI event not created", namespace=namespace, vmi=body["involvedObject"]["name"], error=str(e))


_R = TypeVar("_R")
_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(memory: dict[_K, _V], key: _K, value: _V) -> None:
    """``memory[key] = value``, the oldest entry forgotten beyond ``NUDGED_MAX``: a tenant's churn must not grow it."""
    memory[key] = value
    if len(memory) > NUDGED_MAX:
        del memory[next(iter(memory))]
