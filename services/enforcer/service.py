"""The enforcer service: keep every managed ResourceQuota of one cluster at what ``shared.quota.enforcement`` says.

Inputs, both read from the start of their stream on every start (the enforcer keeps no state of its own):

* quota events ``vmquota.ev.<cluster>.*.resourcequota`` (the watcher's snapshots): the latest version of every
  ResourceQuota, by resourceVersion; a deletion or a sync marker drops it;
* usage snapshots ``vmquota.usage.<cluster>.>`` (the ledger's, one kept per namespace): the latest per namespace.

Each input adds the quotas it concerns to a work queue (``services.platform.workqueue``, client-go style): a quota
waits there at most once, has at most one reconciliation in flight, and one added meanwhile is reconciled once more
afterwards, with the latest state (per-quota coalescing: the latest desired state wins, nothing queues up). The
queue owns retries: a reconciliation whose Kubernetes call failed is retried after the quota's backoff, and inputs
that arrive meanwhile do not call the API server sooner. A reconciliation plans (pure:
``shared.quota.enforcement.plan``) and, when the plan changes something, patches with a JSON merge patch carrying
``metadata.resourceVersion``. A 409 is the normal path under load (quota admission changes the resourceVersion with
every admitted pod): plan again with a newer version and patch again. The newer version is the one the quota events
brought while the patch was out, when they did (one round trip fewer), else a re-read (GET), with a jittered pause
before the second and later reads. 429/5xx/timeouts back off and retry (the queue's retries).

Every write is reported, off the write path, by a Kubernetes Event on the quota and a ``Decision`` on
``vmquota.quota.<cluster>.<namespace>`` (but for a write of the usage summary alone, ``Action.REFRESH``). With
``dry_run`` nothing is written to the cluster: each new plan is reported as a dry-run decision and logged. A
malformed quota event or usage snapshot goes to ``vmquota.dlq.enforcer`` with the reason (a quota event refused
while the enforcer catches up at its start is only logged: it was lettered when first read, and the ledger letters
every event); the enforcer keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Final

import structlog
from nats.aio.msg import Msg

from services.enforcer.guard import GuardWriter
from services.enforcer.known import KnownQuotas
from services.enforcer.kube import KubeError, Obj, QuotaApi, version_of
from services.enforcer.options import RESERVATION, EnforcerMetrics, EnforcerOptions, Key
from services.enforcer.quota_metrics import QuotaMetrics
from services.enforcer.reporting import Reporter
from services.enforcer.summary import SummaryPacer
from services.platform.bus import Bus, position
from services.platform.consumer import PullConsumer
from services.platform.http import Metrics
from services.platform.runner import cancel
from services.platform.workqueue import WorkQueue
from shared import contract
from shared.backoff import Backoff, TokenBucket
from shared.errors import InvalidInput
from shared.kinds import QUOTA_KIND
from shared.normalize import normalize
from shared.quota import enforcement, guard
from shared.quota.annotations import MANAGED_LABEL, USAGE_ANNOTATION, USAGE_FROM_ANNOTATION
from shared.quota.enforcement import Action
from shared.quota.modes import is_managed
from shared.resources import ResourceList
from shared.snapshot import QuotaSnapshot, same_content
from shared.times import rfc3339

log = structlog.get_logger("vmquota.enforcer")


NUDGE_PAST_FAILURES: Final = 3
"""A managed quota whose reconciliation failed this many times in a row holds the namespace's nudges back no more
(one failure, a 429 say, is retried in milliseconds: a nudge sent before it had the room would be spent)."""


class Enforcer:
    """One cluster's enforcer. ``run(stop)`` until ``stop`` is set (or the task is cancelled)."""

    def __init__(
        self,
        bus: Bus,
        kube: QuotaApi,
        opts: EnforcerOptions,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        contract.check_cluster(opts.cluster)
        self.bus = bus
        self.kube = kube
        self.opts = opts
        self.metrics = metrics or Metrics()
        self.own = EnforcerMetrics(self.metrics.registry, opts.service)
        self.quota_metrics = QuotaMetrics(self.metrics.registry, opts.service)
        self._now = clock or (lambda: datetime.now(UTC))
        self._backoff = Backoff(initial=opts.retry_base, maximum=opts.retry_max, jitter=0.2)
        self._conflict_backoff = Backoff(initial=opts.conflict_backoff, maximum=opts.conflict_backoff_max, jitter=0.5)
        self._patches = TokenBucket(opts.patch_rate, max(1.0, opts.patch_rate))
        self._quota_patches: dict[Key, TokenBucket] = {}
        self.quotas = KnownQuotas()
        self._excluded: dict[Key, None] = {}
        """Quotas in excluded namespaces, reported once each."""
        self._verify: set[Key] = set()
        """Quotas the bus says are gone: read from the API server before they are forgotten."""
        self.usage: dict[str, contract.UsageSnapshot] = {}
        self._usage_at: dict[str, int] = {}
        """The usage stream sequence of each namespace's snapshot in ``usage`` (the order the server assigned)."""
        self._acted: dict[Key, contract.UsageSnapshot] = {}
        """The usage snapshot each quota was last written from (for the reason line only)."""
        self._since: dict[Key, float] = {}
        """Monotonic time of the oldest input not yet applied to each dirty quota."""
        self._queue: WorkQueue[Key] = WorkQueue(
            "enforcer",
            self._reconcile_key,
            workers=opts.workers,
            backoff=self._backoff,
            hold_retries=True,  # (a quota waiting for its retry is not written sooner, whatever arrives)
            on_retry=self._on_retry,
        )
        self._nudged_past: dict[str, set[Key]] = {}
        """namespace → the quotas its last tell did not wait for (their calls kept failing)."""
        self._again: set[Key] = set()
        """Quotas to reconcile again after the work queue's backoff though their reconciliation returned: the last
        write of ``status.hard`` failed after ``spec.hard`` was written, or the namespace's QuotaReservation could
        not be shrunk after a write of ``hard`` (the write is done and reported)."""
        self._astray_seen: set[Key] = set()
        """Quotas a version with ``status.hard`` astray came for while they were being reconciled (``_astray``):
        read and planned again once that is done."""
        self._own_versions: dict[Key, set[str]] = {}
        """The versions the writes of a quota's reconciliation in progress made."""
        self._reconciled_at: dict[Key, int] = {}
        """The namespace's usage position (``_usage_at``) each quota was last reconciled from, to the end."""
        self.status_writes = True
        """Whether the enforcer writes ``status.hard`` with ``spec.hard``; off for good once the API server refuses
        it (403: a ClusterRole without ``patch`` on ``resourcequotas/status``)."""
        self._lagging: set[Key] = set()
        """Quotas whose ``status.hard`` had not caught up with ``spec.hard`` when last reconciled: a quota event that
        only changes status is then acted on. The namespace's nudges wait for it (a nudge KubeVirt acts on before
        quota admission has the raise is refused, and nothing would nudge again), and with the guard the quota is
        reconciled again, so that the holders shrink once admission applies the lower limit."""
        self.summaries = SummaryPacer(opts.usage_refresh_interval, opts.refresh_rate, self._summary_due)
        self._held: set[str] = set()
        """Namespaces touched before both inputs were read to their end (acted on once they are)."""
        self._caught_up = {"quotas": False, "usage": False}
        self._refused_catching_up = 0
        self._first_refused = ""
        self._warm = False
        self._stopped = False
        self.reporter = Reporter(bus, kube, opts, self.metrics, self.own, self._now)
        self._quotas_listed = False
        """The managed quotas were listed from the API server since the start."""
        self.guard = GuardWriter(
            kube,
            opts.guard_creators,
            self._carrying_names,
            lambda: self._quotas_listed,
            lambda ns: self._schedule((ns, RESERVATION)),
        )
        self.patched = 0
        self.conflicts = 0
        self.dead_letters = 0
        self.older_usage = 0
        """Usage snapshots ignored as older than the one held (copies a reader of the bus had stored)."""

    # ---- running -----------------------------------------------------------------------------------------------
    def _consumer(self, kind: str, stream: str, subject: str) -> PullConsumer:
        return PullConsumer(
            self.bus,
            stream=stream,
            durable=f"{self.opts.service}-{self.opts.cluster}-{kind}",
            filter_subjects=[subject],
            start_seq=1,
            batch=500,
            idle=self.opts.idle,
        )

    async def run(self, stop: asyncio.Event) -> None:
        c = self.opts.cluster
        quotas = self._consumer("quotas", contract.EVENTS_STREAM, f"{contract.PREFIX}.ev.{c}.*.resourcequota")
        usage = self._consumer("usage", contract.USAGE_STREAM, f"{contract.PREFIX}.usage.{c}.>")
        bound = structlog.contextvars.bound_contextvars(cluster=c, dry_run=self.opts.dry_run)
        with bound:
            log.info("enforcer starting")
            await self._list_managed_quotas()
            await self._list_reservations()
            self._queue.start()
            tasks = [
                asyncio.create_task(self._consume("quotas", quotas, self._on_quota_message), name="enforcer-quotas"),
                asyncio.create_task(
                    self._consume("usage", usage, self._on_usage_message, lag=True), name="enforcer-usage"
                ),
                asyncio.create_task(self.reporter.run(), name="enforcer-reports"),
                asyncio.create_task(self._resync_loop(), name="enforcer-resync"),
            ]
            stopper = asyncio.create_task(stop.wait())
            graceful = False
            try:
                done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = None if t is stopper else t.exception()
                    if exc is not None:
                        raise exc
                graceful = True
            finally:
                # A stop lets in-flight patches finish and queued reports go out; a cancellation (a lost Lease)
                # stops writing at once: another enforcer may be leading already.
                stopper.cancel()
                self._stopped = True
                self.summaries.stop()
                await cancel(*tasks[:2])
                if graceful:
                    await self._drain()
                await self._queue.stop()
                await self.reporter.stop()
                await cancel(*tasks[2:])
                await quotas.close()
                await usage.close()
                log.info("enforcer stopped", graceful=graceful, patched=self.patched, conflicts=self.conflicts)

    async def _list_managed_quotas(self) -> None:
        """Read the managed quotas from the API server once at start: the events stream has a max age, so a quota
        nobody touched for longer is not in it, and replaying the stream alone would forget it. Newer versions
        from the stream still win (by resourceVersion) until the next resync; a failure here only logs, the
        stream remains the input."""
        items = await self._list_or_log()
        for raw in items or ():
            try:
                snap = self.quotas.from_api(raw, truth=True)
            except InvalidInput as e:
                log.warning("a listed quota cannot be read", error=str(e))
                continue
            self._held.add(snap.namespace)
        if items is not None:
            self._quotas_listed = True
            log.info("managed quotas listed", count=len(items))

    async def _list_reservations(self) -> None:
        """With the guard, at the start and at each resync: every QuotaReservation as the API server has it is taken
        in by the guard's writer (a write whose answer was lost landed perhaps), and a namespace whose one lists
        holders has its quotas reconciled and its namespace-only key scheduled (its quotas read from the API
        server, then the holders none of them carries taken off: a write that failed before a restart, or an
        earlier enforcer's, would otherwise keep its pods out for good). One held to list holders that the API server
        lists no more (deleted by hand) is written again, its namespace's quotas reconciled: the writer, taking its
        holders for listed, wrote nothing for them, and the room it guards was open to every pod. A failure only
        logs: the next resync lists again."""
        if not self.opts.reservation_guard or self.opts.dry_run:
            return
        try:
            items = await self.kube.list_reservations()
        except KubeError as e:
            log.warning("could not list the QuotaReservations", error=str(e))
            return
        present = set()
        for obj in items:
            meta = obj.get("metadata")
            ns = str(meta.get("namespace") or "") if isinstance(meta, dict) else ""
            present.add(ns)
            if ns and self.guard.observe(ns, obj):
                self._touch_namespace(ns)
                self._schedule((ns, RESERVATION))  # (the API server shows the namespace's quotas, then a shrink)
        for ns in self.guard.absent(present):
            self._touch_namespace(ns)  # (deleted by someone else: listed again from the quotas' reservations)

    async def _list_or_log(self) -> list[Obj] | None:
        try:
            return await self.kube.list_quotas(f"{MANAGED_LABEL}=true")
        except KubeError as e:
            log.warning("could not list managed quotas; relying on the events stream", error=str(e))
            return None

    async def _resync_loop(self) -> None:
        """Every ``resync_interval``: the managed quotas as the API server has them replace what the quota events
        said (a quota event is only as trustworthy as the watcher's credentials; the API server is the truth).
        A held quota the listing lacks is read on its own before it is forgotten (it may only have lost its
        label, and then is released)."""
        if self.opts.resync_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.opts.resync_interval)
            if not self._warm or self._stopped:
                continue
            items = await self._list_or_log()
            if items is None:
                continue
            self._quotas_listed = True
            listed: set[Key] = set()
            for raw in items:
                try:
                    snap = normalize(raw)
                except InvalidInput as e:
                    log.warning("a listed quota cannot be read", error=str(e))
                    continue
                if isinstance(snap, QuotaSnapshot):
                    listed.add((snap.namespace, snap.name))
                    if self.quotas.remember_truth(snap) or self._astray(snap):
                        self._schedule((snap.namespace, snap.name))
            for key in [k for k in self.quotas if k not in listed]:
                self._verify.add(key)
                self._schedule(key)
            await self._list_reservations()

    async def _drain(self, within: float = 10.0) -> None:
        """Let in-flight reconciliations and queued reports finish (bounded; what is left is then cancelled)."""
        await self._queue.drain(within)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.reporter.join(), timeout=within)

    # ---- inputs ------------------------------------------------------------------------------------------------
    async def _consume(
        self, what: str, consumer: PullConsumer, on_message: Callable[[Msg], Awaitable[None]], *, lag: bool = False
    ) -> None:
        """Apply ``what`` ("quotas" or "usage") message by message; ``lag``: report this consumer's lag and applied
        sequence (the service's gauges follow one input: the usage, which a decision waits for)."""
        events_in = self.metrics.events_in.labels(service=self.opts.service)
        lag_gauge = self.metrics.lag.labels(service=self.opts.service) if lag else None
        seq_gauge = self.metrics.applied_seq.labels(service=self.opts.service) if lag else None
        async for batch in consumer.batches():
            if self._stopped:
                return
            for m in batch:
                await on_message(m)
            events_in.inc(len(batch))
            if lag_gauge is not None:
                lag_gauge.set(consumer.pending)
            if seq_gauge is not None:
                seq_gauge.set(consumer.next_seq - 1)
            if not self._caught_up[what] and not consumer.failing and (not batch or consumer.pending == 0):
                self._caught_up_with(what, consumer)

    def _caught_up_with(self, what: str, consumer: PullConsumer) -> None:
        """Act only once both inputs have been read to their end: planning with the quotas but not yet the usage
        (or the other way round) would write a transient state after every restart."""
        self._caught_up[what] = True
        if what == "quotas" and self._refused_catching_up:
            log.warning(
                "quota events refused while catching up (dead-lettered when first read)",
                count=self._refused_catching_up,
                first=self._first_refused,
            )
        if what == "usage":
            # (the cancels the latest usage of each namespace asks: those of the snapshots replayed before it may
            # have been undone since)
            for ns, u in self.usage.items():
                self.reporter.cancel(ns, u)
        log.info(f"{what} caught up", seq=consumer.next_seq - 1, quotas=len(self.quotas), namespaces=len(self.usage))
        if all(self._caught_up.values()):
            self._warm = True
            for ns in sorted(self._held):
                self._touch_namespace(ns)
            self._held.clear()

    async def _on_quota_message(self, m: Msg) -> None:
        try:
            ev = contract.decode_event_on(m.subject, m.data)
            if ev.kind != QUOTA_KIND or ev.cluster != self.opts.cluster:
                raise InvalidInput(f"a {ev.kind} event of cluster {ev.cluster!r} on {m.subject}", "kind")
            self._apply_quota_event(ev)
        except InvalidInput as e:
            await self._dead_letter(m, contract.EVENTS_STREAM, str(e))

    def _apply_quota_event(self, ev: contract.Upserted | contract.Deleted | contract.Sync) -> None:
        if isinstance(ev, contract.Sync):
            rv = contract.resource_version(ev.resource_version)
            present = set(ev.present)
            for name in self.quotas.names(ev.namespace):
                key = (ev.namespace, name)
                q = self.quotas[key]
                if q.uid not in present and q.rv_order <= rv:
                    self._gone_on_the_bus(key)
            return
        key = (ev.namespace, ev.name)
        rv = contract.resource_version(ev.resource_version)
        if isinstance(ev, contract.Deleted):
            held = self.quotas.get(key)
            if held is None:
                self.quotas.deleted(ev.uid, rv)
            elif held.uid == ev.uid and held.rv_order <= rv:
                self._gone_on_the_bus(key)
            return
        snap = ev.snapshot
        if not isinstance(snap, QuotaSnapshot):
            raise InvalidInput(f"expected a ResourceQuota snapshot, got {type(snap).__name__}", "snapshot")
        held = self.quotas.get(key)
        # A newer version is kept (its resourceVersion is the next patch's precondition); one that differs only in
        # its status (quota admission's and the quota controller's writes, on every admitted pod) changes no plan.
        if not self.quotas.remember(snap):
            return
        if held is None or not same_content(held, snap) or self._astray(snap):
            self._schedule(key)
        elif key in self._lagging:  # (a status-only version: quota admission may have what was written now)
            if self.opts.reservation_guard and not self.opts.dry_run:
                self._schedule(key)  # (the reconciliation tells and nudges once it is done)
            else:
                self._tell_when_in_effect(key)

    def _astray(self, snap: QuotaSnapshot) -> bool:
        """A version that only its status tells apart is planned again when its ``status.hard`` is not its
        ``spec.hard`` (``enforcement.status_astray``) and the enforcer may write it: a late write of an enforcer that
        lost its Lease had quota admission check a raise, with room for any pod, until the namespace's next change.
        While the quota is being reconciled (its own writes of ``status.hard`` and ``spec.hard`` go one after the
        other), only once that is done, and only if the newest version held still says so."""
        if not self._repairs(snap):
            return False
        key = (snap.namespace, snap.name)
        if self._queue.processing(key):
            if snap.resource_version not in self._own_versions.get(key, ()):  # (not a step of its own writes)
                self._astray_seen.add(key)
            return False
        return True

    def _repairs(self, snap: QuotaSnapshot) -> bool:
        """``status.hard`` is not ``spec.hard`` (``enforcement.status_astray``), and this enforcer writes it."""
        return self.status_writes and not self.opts.dry_run and enforcement.status_astray(snap)

    def _gone_on_the_bus(self, key: Key) -> None:
        """The quota events say the quota is gone: the API server decides (a forged deletion must not make the
        enforcer forget a quota whose ``spec.hard`` it still has to lower)."""
        self._verify.add(key)
        self._schedule(key)

    async def _on_usage_message(self, m: Msg) -> None:
        try:
            u = contract.decode_usage_on(m.subject, m.data)
            if u.cluster != self.opts.cluster:
                raise InvalidInput(
                    f"usage of cluster {u.cluster!r} read by the enforcer of {self.opts.cluster!r}", "cluster"
                )
            enforcement.check_usage(u)
        except InvalidInput as e:
            await self._dead_letter(m, contract.USAGE_STREAM, str(e))
            return
        # Later in the stream (a redelivery after a reconnect never goes back in it), and not older than the
        # snapshot held: a copy of an older snapshot that a reader of the bus had JetStream deliver into the stream
        # (docs/operations.md, "What a reader can still write") comes later in the stream, but was folded no further
        # and published before the one held.
        at = position(m).stream
        if at <= self._usage_at.get(u.namespace, 0):
            return
        mark = self._usage_mark(u.namespace)
        if mark is not None and enforcement.usage_is_older(u, mark):
            self._older_usage("usage snapshot older than the one held ignored (a copy)", u, mark, time=u.time)
            return
        self._usage_at[u.namespace] = at
        self.usage[u.namespace] = u
        self.quota_metrics.observe(u)
        if self._caught_up["usage"] and not self._stopped:
            self.reporter.cancel(u.namespace, u)
        self._touch_namespace(u.namespace)

    def _usage_mark(self, namespace: str) -> str | None:
        """What a namespace's next usage snapshot must not be older than: the one held, or, before one is (the
        enforcer has just started), the newest a quota of the namespace was last written from (its
        ``vmquota.io/usage-from``, which only the enforcer writes)."""
        held = self.usage.get(namespace)
        if held is not None:
            return enforcement.usage_mark(held)
        marks = [
            mark
            for q in self.quotas.of(namespace)
            if self.quotas.vouched(q) and (mark := q.annotations.get(USAGE_FROM_ANNOTATION)) is not None
        ]
        return max(marks, key=enforcement.mark_order, default=None)

    async def _dead_letter(self, m: Msg, stream: str, reason: str) -> None:
        seq = position(m).stream
        if stream == contract.EVENTS_STREAM and not self._caught_up["quotas"]:
            # (read again at every start, from the stream's first message: the ledger, which reads every event,
            # dead-letters each event this refuses, and this enforcer's earlier runs did; a letter again at each
            # start, past the stream's duplicate window, would be counted again and fire the alert again)
            # (said once the catch-up ends, in one warning: after a rollback, a ledger that resumed past an event of a
            # newer schema never read it, and this is then its one record)
            if not self._refused_catching_up:
                self._first_refused = f"seq {seq} on {m.subject}: {reason}"
            self._refused_catching_up += 1
            return
        with structlog.contextvars.bound_contextvars(subject=m.subject, seq=seq):
            log.warning("message rejected to the dead-letter subject", reason=reason)
        self.dead_letters += 1
        await self.bus.record_dead_letter(
            self.metrics.dlq.labels(service=self.opts.service).inc,
            self.opts.service,
            reason,
            cluster=self.opts.cluster,
            original_subject=m.subject,
            stream=stream,
            stream_seq=seq,
            payload=m.data,
        )

    # ---- state -------------------------------------------------------------------------------------------------
    def _forget(self, key: Key, rv: int) -> None:
        self.quotas.forget(key, rv)
        self._verify.discard(key)
        self._acted.pop(key, None)
        self._lagging.discard(key)
        self._reconciled_at.pop(key, None)
        self.summaries.forget(key)
        self.reporter.forget(key)
        held = self.guard.forget(key)
        self._quota_patches.pop(key, None)
        if not self.opts.reservation_guard or self.opts.dry_run:
            return
        if held or self._holders_left(key[0]):
            # (the quota carries nothing any more: its holders would keep the namespace's pods out for nothing;
            # retried until done, as no later write of the namespace may come)
            self._schedule((key[0], RESERVATION))

    def _touch_namespace(self, namespace: str) -> None:
        if not self._warm:
            self._held.add(namespace)
            return
        for name in self.quotas.names(namespace):
            self._schedule((namespace, name))
        if self.opts.reservation_guard and self._holders_left(namespace):
            self._schedule((namespace, RESERVATION))  # (holders listed, and no managed quota left to carry them)

    def _schedule(self, key: Key) -> None:
        if self._stopped:
            return
        if enforcement.excluded(key[0], self.opts.exclude_namespaces):
            if key not in self._excluded:
                self._excluded[key] = None
                log.warning(
                    "quota in an excluded namespace left alone",
                    namespace=key[0],
                    quota=key[1],
                    exclude_namespaces=",".join(self.opts.exclude_namespaces),
                )
            return
        if not self._warm:
            self._held.add(key[0])
            return
        self._since.setdefault(key, time.monotonic())
        self._queue.add(key)

    # ---- reconciling -------------------------------------------------------------------------------------------
    async def _reconcile_key(self, key: Key) -> None:
        """Reconcile one quota (the work queue's handler). A failed Kubernetes call raises, and the queue retries the
        quota after its backoff; so does a bug (it must cost one quota a retry, not the enforcer)."""
        at = self._usage_at.get(key[0], 0)
        if key[1] == RESERVATION:
            if not self.opts.dry_run:
                await self._shrink_checked(key[0])  # (a failure raises: the queue retries after its backoff)
            self._since.pop(key, None)
            self._queue.forget(key)
            return
        try:
            await self._reconcile(key)
        except InvalidInput as e:  # the API server returned an object we cannot read
            log.error("quota not readable", namespace=key[0], quota=key[1], error=str(e))
            self._reconciled(key, at)  # (as far as it goes: the namespace's other quotas are not held back for it)
            self._astray_since(key)
            return
        except KubeError:
            raise
        except Exception as e:
            log.error("reconcile failed", namespace=key[0], quota=key[1], error=repr(e), exc_info=e)
            raise KubeError(0, type(e).__name__, str(e)) from e
        finally:
            self._own_versions.pop(key, None)
        if key in self._again:  # (spec.hard written, status.hard or the guard's shrink not: after the backoff)
            self._again.discard(key)
            self._queue.add_rate_limited(key)
        else:
            self._queue.forget(key)
            self._astray_since(key)
        self._reconciled(key, at)
        self._tell_when_in_effect(key)

    def _astray_since(self, key: Key) -> None:
        """At the end of a reconciliation: another writer's version astray came meanwhile (``_astray``): read the
        quota and plan again. (A reconciliation that failed is retried, and this runs at the retry's end.)"""
        if key in self._astray_seen:
            self._astray_seen.discard(key)
            self._verify.add(key)
            self._queue.add(key)

    def _reconciled(self, key: Key, at: int) -> None:
        if self.quotas.get(key) is not None:  # (not one forgotten meanwhile: a quota made again is another's)
            self._reconciled_at[key] = at

    def _tell_when_in_effect(self, key: Key) -> None:
        """Tell the namespace's VMIs what the usage says (refusals, nudges) once quota admission checks what was
        written, in every managed quota of the namespace: each reconciled from the namespace's latest usage, its
        ``status.hard`` (the quota controller's copy of ``spec.hard``) equal to ``spec.hard``, and its ``status.used``
        down to what the usage counts of the pods where it reserves room (``enforcement.charged_as_counted``: the
        quota controller uncharges a pod that ended a moment after the ledger hears of it); until then wait for the
        reconciliation or the quota event that says so. (A nudge goes once per usage snapshot: sent when the
        first of two quotas had the room, KubeVirt's retry met the second's refusal, and nothing nudged again.)"""
        quota = self.quotas.get(key)
        if quota is not None and (
            not enforcement.same(quota.spec_hard, quota.status_hard)
            or not enforcement.charged_as_counted(quota, enforcement.terms_of(self.usage.get(key[0]), quota.name))
        ):
            self._lagging.add(key)
            return
        self._lagging.discard(key)
        ns = key[0]
        at = self._usage_at.get(ns, 0)
        passed: set[Key] = set()
        for q in self.quotas.of(ns):
            other = (ns, q.name)
            if not is_managed(q.labels):
                continue
            failing = other != key and self._queue.failures(other) >= NUDGE_PAST_FAILURES
            if failing:
                passed.add(other)
            if not self.quotas.vouched(q) or failing:
                continue  # (one only the bus has told of, or whose calls keep failing: no hold on the others')
            if self._reconciled_at.get(other, -1) < at or (other != key and other in self._lagging):
                return  # (that quota tells, once its reconciliation or quota event says it is in effect)
        if key in self._nudged_past.get(ns, ()):
            # (the namespace's VMIs were nudged without waiting for this quota, whose calls kept failing: it has
            # what the usage asks now, and a VMI nudged before it had the room would wait for KubeVirt's backoff)
            self.reporter.nudge_again(ns)
        if passed:
            self._nudged_past[ns] = passed
        else:
            self._nudged_past.pop(ns, None)
        u = self.usage.get(ns)
        if u is not None and not self.opts.dry_run and not self._stopped:
            # (the holders the QuotaReservation let in since the namespace's last write of a quota, which woke
            # KubeVirt: a raise waiting for the ledger, a shrink or a write where hard held their room already)
            self.reporter.tell_and_nudge(ns, u, at, self.guard.opened(ns))

    def _on_retry(self, key: Key, e: BaseException, attempt: int, delay: float) -> None:
        """The work queue retries ``key`` in ``delay`` seconds (its backoff, never shorter than a ``Retry-After``
        the server sent, up to its maximum)."""
        self.own.patches.labels(outcome="error").inc()
        log.warning(
            "quota call failed, retrying",
            namespace=key[0],
            quota=key[1],
            status=e.status if isinstance(e, KubeError) else 0,
            error=str(e),
            attempt=attempt,
            retry_in=round(delay, 3),
        )
        if attempt == NUDGE_PAST_FAILURES:  # (it holds the namespace's nudges back no more: they may go now)
            for name in self._managed_names(key[0]):
                if name != key[1] and self._queue.failures((key[0], name)) < NUDGE_PAST_FAILURES:
                    self._tell_when_in_effect((key[0], name))

    async def _reconcile(self, key: Key) -> None:
        ns, name = key
        quota = self.quotas.get(key)
        if quota is not None and key in self._verify:
            quota = await self._read(key, quota)
            self._verify.discard(key)
        conflicts = reads = repeats = 0
        unconfirmed = False  # (the write planned last goes out with a holder left unconfirmed)
        paced = False  # (a write of this reconciliation waited for its rate bound already)
        failed = ""  # the precondition of the last patch that conflicted
        fresh: QuotaSnapshot | None = None  # the copy read from the API server for this round, if any
        at = ""  # when this round's first write went out
        while quota is not None:
            usage = self.usage.get(ns)
            charged = quota.status_used if quota is fresh else None
            p = enforcement.plan(
                quota,
                usage,
                self._acted.get(key),
                managed=self.quotas.vouched(quota),
                charged=charged,
                status=self.status_writes,
            )
            if (p.set_hard or p.set_status) and quota is not fresh and not self.opts.dry_run:
                # hard moves: plan from the quota as the API server has it, with what it charges now (status.used),
                # so that a pod the cluster never admitted opens no room. The copy at hand is a quota event's, the
                # bus's word: forged at the quota's real resourceVersion, which the patch's precondition takes, with
                # a status.used as large as a phantom pod, it had hard raised for that pod with no read (123Gi of
                # room on a 64Gi budget); with spec.hard and status.hard above what the usage asks, a raise for it
                # looked like a lowering.
                quota = fresh = await self._read(key, quota)
                continue
            if (p.set_hard or p.set_status) and usage is not None and self._written_from_newer(quota, usage):
                return
            later = p.action is Action.REFRESH and (self.opts.dry_run or self.summaries.later(key))
            if not p.changes or later:
                if self.opts.reservation_guard and not self.opts.dry_run:
                    if quota is not fresh and self.guard.shrinks(key, quota, usage):
                        quota = fresh = await self._read(key, quota)  # (holders go on the API server's word)
                        continue
                    await self.guard.after(key, quota, usage)
                    # (a reservation whose room hard holds already: its holder waits for the read of its VMI)
                    why = await self.guard.confirm(ns, usage)
                    if why:
                        log.info("holder unconfirmed until the ledger catches up", namespace=ns, reason=why)
                self._since.pop(key, None)
                return
            if self.opts.dry_run:
                self._since.pop(key, None)
                self.reporter.dry_run(key, p)
                return
            if self.opts.reservation_guard:
                await self.guard.before(key, usage)  # the holders are listed before their room opens
                why = await self.guard.confirm(ns, usage)  # (and admitted once their VMIs are read at their size)
                unconfirmed = bool(why and p.raises)
                if unconfirmed:
                    # The raise goes out all the same: an unconfirmed holder's pods are kept out by the guard, so
                    # its room opens to no pod, and the other holders' raise cannot wait on it. It did wait: a tenant
                    # that deleted and made again a small pending VMI of its own, each time KubeVirt was refused its
                    # pod, kept every raise of the namespace back, a drain's migration with them.
                    log.info("raise with a holder unconfirmed", namespace=ns, quota=name, reason=why)
            if p.resource_version == failed:
                # The same version conflicted before: no other writer's progress explains it (a version that
                # moves on is quota admission at work, retried at once). Back off, jittered and growing.
                repeats += 1
                await asyncio.sleep(self._conflict_backoff.delay(repeats - 1))
            if not paced:
                paced = True
                if await self._pace(key):
                    # (what arrived while the write waited is planned in: never write what was true before it)
                    newer = self.quotas.get(key)
                    if newer is not None and newer.rv_order > quota.rv_order:
                        quota = newer
                    continue
            # (the decision's time is its first write's: quota admission may act on status.hard before spec.hard
            # is written, whose precondition the admission's own write of status.used then fails)
            at = at or rfc3339()
            # (the write wakes the migrations KubeVirt was refused for quota: the holders let in before it need no
            # nudge, unless it fails)
            let_in = self.guard.opened(ns)
            try:
                raw = await self._write(p, at)
            except KubeError as e:
                self.guard.reopen(ns, let_in)  # (not woken: nudged once the namespace's quotas are in effect)
                if e.not_found:
                    self._forget(key, quota.rv_order)
                    return
                if not e.conflict:
                    raise
                conflicts += 1
                failed = p.resource_version
                at = ""  # (what took effect is reported: the next decision's time is its own first write's)
                self.conflicts += 1
                self.own.patches.labels(outcome="conflict").inc()
                if conflicts >= self.opts.max_conflicts:
                    raise
                newer = self.quotas.get(key)
                if newer is not None and newer.rv_order > quota.rv_order:
                    # The quota events brought a newer version while the call was out (the write that beat
                    # ours, usually): plan with it at once, one round trip fewer than reading.
                    quota = newer
                    self.own.conflict_retries.labels(source="event").inc()
                    continue
                if reads:
                    await asyncio.sleep(random.uniform(0, self.opts.conflict_pause))
                reads += 1
                self.own.conflict_retries.labels(source="read").inc()
                quota = fresh = await self._read(key, quota)
                continue
            after = self.quotas.from_api(raw)
            if self.opts.reservation_guard:
                await self._guard_after(key, after, usage)
            self.patched += 1
            if USAGE_ANNOTATION in p.annotations:
                self.summaries.written(key)
            if p.action is Action.REFRESH:  # (the summary alone: not a decision, nothing to report)
                self._since.pop(key, None)
                self.own.patches.labels(outcome="refreshed").inc()
                return
            self.own.patches.labels(outcome="applied").inc()
            if unconfirmed:  # (counted once written: a pass that was paced, or met a conflict, wrote nothing)
                self.own.patches.labels(outcome="resized").inc()
            since = self._since.pop(key, None)
            if since is not None:
                self.own.reaction.observe(time.monotonic() - since)
            if usage is not None:
                self._acted[key] = usage
            self.reporter.decision(p, after.resource_version, at)
            return

    async def _shrink_checked(self, namespace: str) -> None:
        """Have the API server show the namespace's quotas, then let its QuotaReservation shrink (``guard.shrink``):
        what the enforcer knows may lack a quota whose limits hold room vmquota raised (its listing at the start
        failed, the events stream is past the quota's last change), and taking off the holder of such a raise opens
        that room to every pod. Each quota that may carry one (``guard.may_carry``: managed, or handed back with its
        release pending) is reconciled, and its holders are kept until it is; a quota that cannot be read keeps
        them all."""
        unreadable = False
        for raw in await self.kube.list_quotas("", namespace):
            try:
                snap = self.quotas.from_api(raw, truth=True)
            except InvalidInput:
                unreadable = True
                continue
            if guard.may_carry(snap):
                self._schedule((snap.namespace, snap.name))
        if not unreadable:
            await self.guard.shrink(namespace)

    def _holders_left(self, namespace: str) -> bool:
        """Whether the namespace's QuotaReservation lists holders while no quota the enforcer knows there may carry a
        raise (they would keep its pods out for nothing)."""
        return not self._carrying_names(namespace) and self.guard.holds_listed(namespace)

    def _carrying_names(self, namespace: str) -> list[str]:
        """The names of the namespace's known quotas whose limits may hold room vmquota raised."""
        return [q.name for q in self.quotas.of(namespace) if guard.may_carry(q)]

    async def _guard_after(self, key: Key, quota: QuotaSnapshot, usage: contract.UsageSnapshot | None) -> None:
        """``guard.after`` once ``hard`` is written: a failure to shrink the QuotaReservation is retried after the
        work queue's backoff (the write is done, and reported; a holder left listed for nothing keeps the
        namespace's other pods out)."""
        try:
            await self.guard.after(key, quota, usage)
        except KubeError as e:
            log.warning("reservation guard not shrunk; again after a backoff", namespace=key[0], error=str(e))
            self._again.add(key)

    def _written_from_newer(self, quota: QuotaSnapshot, usage: contract.UsageSnapshot) -> bool:
        """The quota, as the API server has it, was last written from a newer usage snapshot than ``usage``
        (``vmquota.io/usage-from``, which only the enforcer writes): another enforcer, the leader after this one
        lost its Lease while paused, wrote from usage this one has not read yet (its consumer lags). Writing from
        the older usage would bring back what the newer one ended (a migration's raise: room for any pod); the
        newer snapshot comes, and is planned from then."""
        mark = quota.annotations.get(USAGE_FROM_ANNOTATION)
        if mark is None or not self.quotas.vouched(quota) or not enforcement.usage_is_older(usage, mark):
            return False
        why = "quota written from newer usage than this enforcer holds: nothing written until it has that usage"
        self._older_usage(why, usage, mark, quota=quota.name)
        return True

    def _older_usage(self, why: str, u: contract.UsageSnapshot, mark: str, **context: str) -> None:
        self.older_usage += 1
        log.warning(why, namespace=u.namespace, seq=u.seq, held=mark, **context)

    async def _write(self, p: enforcement.Plan, at: str) -> Obj:
        """Write a plan: ``status.hard`` first where the plan sets it (quota admission checks it from then on), then
        ``spec.hard`` and the annotations, on the version the first write made. With the reservation guard, a quota
        counted in VM terms never has ``status.hard`` above ``spec.hard`` on the way (unless the API server refuses
        the enforcer ``status``): its lowerings go to ``status.hard`` first, then ``spec.hard``, then its raises to
        ``status.hard``
        (:meth:`~shared.quota.enforcement.Plan.lowered_status`). The quota as the last write returned it. A failed
        write raises, but for the last one there (``spec.hard`` is written: the quota is reconciled again); the
        quota is planned again, from the API server's copy, and writes what is missing. A ``status.hard`` written
        whose ``spec.hard`` then failed is reported as a decision of its own (``at``: its time), since quota admission
        let pods in by it (:meth:`~shared.quota.enforcement.Plan.status_written`)."""
        ns, name = p.key
        if p.set_status and p.set_hard and self.opts.reservation_guard and p.in_vm_terms:
            lowered = p.lowered_status()
            if not enforcement.same(lowered, p.status_hard):
                done = await self._write_status(p, lowered)
                if done is not None:
                    p = dataclasses.replace(p, resource_version=version_of(done), status_hard=lowered)
            raw = self._own(p.key, await self.kube.patch_quota(ns, name, enforcement.patch_body(p)))
            if self.status_writes and not enforcement.same(p.hard_after, p.status_hard):
                try:
                    raw = await self._write_status(dataclasses.replace(p, resource_version=version_of(raw))) or raw
                except KubeError as e:
                    # (spec.hard is written, and reported as such; the quota is reconciled again, at once after a
                    # conflict, else after the queue's backoff, and writes status.hard from the API server's copy,
                    # unless the quota controller's copy came first)
                    log.info("status.hard not written yet", namespace=ns, quota=name, status=e.status, error=str(e))
                    if e.conflict:  # (another writer's progress, quota admission's usually: again at once)
                        self._queue.add(p.key)
                    else:
                        self._again.add(p.key)
            return raw
        written = await self._write_status(p) if p.set_status else None
        if written is not None:
            if not p.set_hard and not p.annotations:
                return written
            p = dataclasses.replace(p, resource_version=version_of(written))
        try:
            return self._own(p.key, await self.kube.patch_quota(ns, name, enforcement.patch_body(p)))
        except Exception:
            if written is not None:
                # (whatever the failure, quota admission checks what went out; an answer lost may hide a patch that
                # landed, which the next plan then finds written)
                self.reporter.decision(p.status_written(), version_of(written), at)
            raise

    def _own(self, key: Key, raw: Obj) -> Obj:
        """``raw``, a write's answer, noted as a version of the quota's reconciliation in progress (``_astray``)."""
        self._own_versions.setdefault(key, set()).add(version_of(raw))
        return raw

    async def _write_status(self, p: enforcement.Plan, hard: ResourceList | None = None) -> Obj | None:
        """Write the plan's ``status.hard`` (or ``hard``); None when the API server does not let the enforcer (a 403:
        RBAC without ``patch`` on ``resourcequotas/status``, an upgrade's manifests not applied yet), which turns the
        writes of ``status.hard`` off: the quota controller copies ``spec.hard``, a sync later, as before."""
        try:
            return self._own(p.key, await self.kube.patch_quota_status(*p.key, enforcement.status_body(p, hard)))
        except KubeError as e:
            if e.status != 403:
                raise
            self.status_writes = False
            log.warning(
                "status.hard not written: the API server does not let the enforcer patch resourcequotas/status "
                "(apply its ClusterRole); the quota controller copies spec.hard a sync later",
                namespace=p.namespace,
                quota=p.name,
                error=e.message,
            )
            return None

    def _managed_names(self, namespace: str) -> list[str]:
        """The names of the namespace's known quotas labelled managed."""
        return [q.name for q in self.quotas.of(namespace) if is_managed(q.labels)]

    def _summary_due(self, key: Key) -> None:
        if not self._stopped:
            self._queue.add(key)

    async def _pace(self, key: Key) -> bool:
        """Wait until a patch of ``key`` fits both rate bounds (overall and per quota); True when it waited."""
        bucket = self._quota_patches.get(key)
        if bucket is None:
            rate = self.opts.quota_patch_rate
            bucket = self._quota_patches[key] = TokenBucket(rate, max(1.0, rate))
        now = time.monotonic()
        wait = max(bucket.take(now), self._patches.take(now))
        if wait <= 0:
            return False
        self.own.patches.labels(outcome="paced").inc()
        await asyncio.sleep(wait)
        return True

    async def _read(self, key: Key, held: QuotaSnapshot) -> QuotaSnapshot | None:
        """The quota as the API server has it now (kept whatever version was held); None when it is gone."""
        try:
            return self.quotas.from_api(await self.kube.get_quota(*key), truth=True)
        except KubeError as e:
            if e.not_found:
                self._forget(key, held.rv_order)
                return None
            raise

    # ---- introspection (tests, health) -------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing dirty, in flight or waiting to be reported."""
        return self._warm and self._queue.empty() and self.reporter.idle()
