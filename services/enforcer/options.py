"""The enforcer's settings (:class:`EnforcerOptions`, one object) and its own Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.platform.http import ServiceLabelled
from shared.quota import enforcement, guard

Key = tuple[str, str]
"""(namespace, quota name)."""

RESERVATION: Final = ""
"""The quota name of a work queue key that stands for the namespace's QuotaReservation alone (no quota's name is
empty): the namespace's quotas read from the API server, then the holders none of them carries taken off."""

REPORT_QUEUE: Final = 10_000
NUDGED_MAX: Final = 65_536
TELLING_MAX: Final = 8
"""Events on VMIs created at once (the rest wait their turn)."""
NUDGING_MAX: Final = 16
"""Nudges of VMIs under way at once (the rest wait their turn): a tenant with thousands of VMIs to nudge must not
take the API client's connections from every namespace's quota patches."""
NUDGING_PER_NAMESPACE: Final = 4
"""Of those, the most one namespace's nudges may hold at once (the nudge queue's share per namespace: the rest of
its nudges wait behind its own): with one queue for all, a tenant with hundreds of VMIs to nudge again and again
kept another namespace's VM waiting behind them all for its touch (1.3 s with 500 VMIs and 40 ms a patch, growing
with both)."""


@dataclass(frozen=True, slots=True)
class EnforcerOptions:
    cluster: str
    dry_run: bool = False
    identity: str = "vmquota-enforcer"
    """Reported as the Event's ``reportingInstance``."""
    service: str = "enforcer"
    idle: float = 0.5
    """Seconds a fetch waits for messages before the consumer loop yields."""
    conflict_pause: float = 0.01
    """Upper bound of the jittered pause before the second and later re-reads after a conflict. Not
    growing: the usual other writer is quota admission updating ``status``, which does not back off either, so a
    longer pause only widens the window for the next conflict."""
    max_conflicts: int = 50
    """Conflicts in a row after which the quota is retried later with backoff (like any other failed call)."""
    conflict_backoff: float = 0.05
    """First wait after a patch conflicts on a version that already conflicted (no other writer's progress
    explains it): doubles with every repeat, ±50%, up to ``conflict_backoff_max``."""
    conflict_backoff_max: float = 0.5
    """At most about two patches a second per quota while its version keeps conflicting (a 100% storm), and a
    streak of conflicts in an 80% storm costs seconds, not tens of seconds (2 s let a streak of 14 hold a
    migration's raise back 20 s)."""
    patch_rate: float = 100.0
    """Most quota patches per second overall (a burst of as many); ``quota_patch_rate`` per quota."""
    quota_patch_rate: float = 10.0
    retry_base: float = 0.2
    """First backoff after a failed call (429, 5xx, timeout); doubles up to ``retry_max``, ±20%, never shorter than
    a ``Retry-After`` the server sent (up to ``retry_max``)."""
    retry_max: float = 10.0
    nudge_interval: float = 0.2
    """Least seconds between two nudges of one VMI (``shared.quota.annotations.NUDGE_ANNOTATION``)."""
    tell_interval: float = 60.0
    """Least seconds between two Events telling one refused VMI why, when the cause changed: the amounts left in
    a reason move with every pod of the namespace, and a tenant's pod churn must not make an Event per refused VMI
    per change (the same cause is told once)."""
    usage_refresh_interval: float = 30.0
    """Least seconds between two writes of one quota's ``vmquota.io/usage`` summary when nothing else of the
    quota changes (``Action.REFRESH``); the summary also rides on every other write."""
    refresh_rate: float = 10.0
    """Most summary-only writes per second overall (a tenth of ``patch_rate``): with thousands of quotas whose
    usage moves, the summaries must not take the write budget the raises migrations wait for; a refresh that finds
    no room waits its turn."""
    reservation_guard: bool = False
    """Write each namespace's QuotaReservation (``shared.quota.guard``) before a raise that reserves, and shrink it once
    no quota carries the reservation: for the optional reservation-guard policy."""
    guard_creators: tuple[str, ...] = (guard.DEFAULT_CREATOR,)
    """Who may create pods for a holder while a reservation is open (KubeVirt's virt-controller)."""
    exclude_namespaces: tuple[str, ...] = enforcement.DEFAULT_EXCLUDED_NAMESPACES
    """Shell-style patterns of namespaces whose quotas are never written, whatever their labels say."""
    workers: int = 32
    """Quotas reconciled at once (each by one worker at a time)."""
    resync_interval: float = 60.0
    """Seconds between two reads of the managed quotas from the API server, whose versions then replace what the
    quota events said (0: never). The API server wins over the bus: a forged quota event is undone within this."""


class EnforcerMetrics:
    """The enforcer's own Prometheus metrics (in the process registry, next to the runner's), each series labelled
    with the service's name as the runner's are; ``labels()`` takes the other labels."""

    def __init__(self, registry: CollectorRegistry, service: str = "enforcer") -> None:
        def counter(name: str, doc: str, label: str) -> ServiceLabelled[Counter]:
            return ServiceLabelled(Counter(name, doc, ["service", label], registry=registry), service)

        self.patches = counter("vmquota_enforcer_patches", "Quota patches by outcome", "outcome")
        self.decisions = counter("vmquota_enforcer_decisions", "Decisions by action (dry-run included)", "action")
        self.conflict_retries = counter(
            "vmquota_enforcer_conflict_retries",
            "Where the version retried after a 409 came from: a quota event that arrived meanwhile, or a read",
            "source",
        )
        self.nudges = counter(
            "vmquota_enforcer_nudges",
            "VMIs touched so that KubeVirt retries a refused launcher pod at once, by outcome",
            "outcome",
        )
        self.cancels = counter(
            "vmquota_enforcer_cancels",
            "Migrations deleted because their end would carry out a size change never admitted, by outcome",
            "outcome",
        )
        self.reaction = Histogram(
            "vmquota_enforcer_reaction_seconds",
            "From receiving a usage snapshot or quota event to the patch that applies it",
            ["service"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        ).labels(service)
