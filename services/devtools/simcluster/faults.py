"""Fault injection for the simulated API server: what real clusters do to clients, on demand.

- fail a fraction of requests (per verb and resource) with 409 Conflict, 429 TooManyRequests (with Retry-After),
  500 InternalError, 503 ServiceUnavailable or 504 Timeout, optionally only the next ``count`` matching requests;
- add latency to matching requests;
- drop every open watch connection (clients must re-watch from their last resourceVersion);
- compact the history, so re-watching from an older resourceVersion gets 410 Expired (clients must relist);
- send bookmarks now.

Use the Python API (``Faults``) in-process, or ``POST /_sim/faults`` with a JSON body (see ``Faults.apply``).
Random choices come from a seeded generator, so a test run is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.devtools.simcluster.store import Store, conflict
from services.devtools.simcluster.store_api import ApiError, Obj, Resource
from services.platform.logs import get_logger

VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"})
_REASONS = {
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_log = get_logger(component="simcluster.faults")


def _names(values: Iterable[str] | None) -> frozenset[str]:
    return frozenset(values or ())


@dataclass
class FailRule:
    """Fail matching requests with ``code``: each with probability ``fraction``; at most ``count`` times."""

    code: int
    fraction: float = 1.0
    verbs: frozenset[str] = frozenset()  # empty: every verb
    resources: frozenset[str] = frozenset()  # resource keys (``pods``, ``virtualmachineinstances.kubevirt.io``)
    count: int | None = None
    retry_after: int = 1
    injected: int = 0

    def matches(self, verb: str, res: Resource) -> bool:
        return (not self.verbs or verb in self.verbs) and (
            not self.resources or res.key in self.resources or res.plural in self.resources
        )

    def describe(self) -> Obj:
        return {
            "code": self.code,
            "fraction": self.fraction,
            "verbs": sorted(self.verbs),
            "resources": sorted(self.resources),
            "count": self.count,
            "injected": self.injected,
        }


@dataclass
class LatencyRule:
    seconds: float
    verbs: frozenset[str] = frozenset()
    resources: frozenset[str] = frozenset()

    def matches(self, verb: str, res: Resource) -> bool:
        return (not self.verbs or verb in self.verbs) and (
            not self.resources or res.key in self.resources or res.plural in self.resources
        )

    def describe(self) -> Obj:
        return {"seconds": self.seconds, "verbs": sorted(self.verbs), "resources": sorted(self.resources)}


@dataclass
class Faults:
    """The faults the server injects into requests for one store."""

    store: Store
    seed: int | None = None
    failures: list[FailRule] = field(default_factory=list)
    latencies: list[LatencyRule] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    # --- rules --------------------------------------------------------------------------------------------------

    def fail(
        self,
        code: int,
        fraction: float = 1.0,
        *,
        verbs: Iterable[str] | None = None,
        resources: Iterable[str] | None = None,
        count: int | None = None,
        retry_after: int = 1,
    ) -> FailRule:
        """Fail requests with ``code`` (409, 429, 500, 503 or 504). ``resources`` are plurals or resource keys."""
        if code not in _REASONS:
            raise ValueError(f"fault code must be one of {sorted(_REASONS)}, not {code}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fault fraction must be within [0, 1], not {fraction}")
        unknown = _names(verbs) - VERBS
        if unknown:
            raise ValueError(f"unknown verbs {sorted(unknown)}; known: {sorted(VERBS)}")
        rule = FailRule(code, fraction, _names(verbs), self._resource_keys(resources), count, retry_after)
        self.failures.append(rule)
        return rule

    def add_latency(
        self, seconds: float, *, verbs: Iterable[str] | None = None, resources: Iterable[str] | None = None
    ) -> LatencyRule:
        if seconds < 0:
            raise ValueError(f"latency must not be negative, not {seconds}")
        rule = LatencyRule(seconds, _names(verbs), self._resource_keys(resources))
        self.latencies.append(rule)
        return rule

    def clear(self) -> None:
        self.failures.clear()
        self.latencies.clear()

    def _resource_keys(self, names: Iterable[str] | None) -> frozenset[str]:
        out = set()
        for name in names or ():
            try:
                out.add(self.store.resource(name).key)
            except KeyError:
                raise ValueError(f"unknown resource {name!r}") from None
        return frozenset(out)

    # --- store-level faults -------------------------------------------------------------------------------------

    def drop_watches(self, resources: Iterable[str] | None = None) -> int:
        res = None if resources is None else [self.store.resource(k) for k in self._resource_keys(resources)]
        dropped = self.store.drop_watches(res)
        _log.info("fault: dropped watches", count=dropped)
        return dropped

    def compact(self, resource_version: int | None = None) -> int:
        floor = self.store.compact(resource_version)
        _log.info("fault: compacted history", oldest_resource_version=floor)
        return floor

    # --- the server's check -------------------------------------------------------------------------------------

    def active(self) -> bool:
        return bool(self.failures or self.latencies)

    def check(self, verb: str, res: Resource, name: str = "") -> tuple[float, ApiError | None]:
        """Latency to add and the error to answer with (None: serve the request) for one request."""
        delay = sum(r.seconds for r in self.latencies if r.matches(verb, res))
        for rule in self.failures:
            if rule.count is not None and rule.injected >= rule.count:
                continue
            if not rule.matches(verb, res) or self._rng.random() >= rule.fraction:
                continue
            rule.injected += 1
            return delay, self._error(rule, res, name)
        return delay, None

    def _error(self, rule: FailRule, res: Resource, name: str) -> ApiError:
        if rule.code == 409:
            return conflict(res, name)
        if rule.code == 429:
            return ApiError(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
                {"retryAfterSeconds": rule.retry_after},
            )
        if rule.code == 500:
            return ApiError(500, "InternalError", "Internal error occurred: injected fault", {"causes": []})
        if rule.code == 503:
            return ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")
        return ApiError(504, "Timeout", "the server was unable to return a response in the time allotted")

    # --- the admin endpoint -------------------------------------------------------------------------------------

    def describe(self) -> Obj:
        return {
            "failures": [r.describe() for r in self.failures],
            "latencies": [r.describe() for r in self.latencies],
            "resourceVersion": str(self.store.resource_version),
            "oldestResourceVersion": str(self.store.oldest_resource_version),
            "watches": self.store.watcher_count(),
        }

    def apply(self, body: Mapping[str, Any]) -> Obj:
        """Apply one admin action, e.g. ``{"action": "fail", "code": 429, "fraction": 0.5, "verbs": ["patch"],
        "resources": ["resourcequotas"], "count": 10}``; ``latency`` (``seconds``), ``drop_watches``
        (``resources``), ``compact`` (``resourceVersion``), ``bookmarks``, ``clear``. ValueError when malformed."""
        action = body.get("action")
        verbs = body.get("verbs")
        resources = body.get("resources")
        for name, value in (("verbs", verbs), ("resources", resources)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise ValueError(f"{name} must be a list of strings")
        if action == "fail":
            code = body.get("code")
            if not isinstance(code, int):
                raise ValueError("fail needs an integer code")
            count = body.get("count")
            if count is not None and not isinstance(count, int):
                raise ValueError("count must be an integer")
            fraction = body.get("fraction", 1.0)
            if not isinstance(fraction, int | float):
                raise ValueError("fraction must be a number")
            retry_after = body.get("retryAfterSeconds", 1)
            if not isinstance(retry_after, int):
                raise ValueError("retryAfterSeconds must be an integer")
            self.fail(code, float(fraction), verbs=verbs, resources=resources, count=count, retry_after=retry_after)
        elif action == "latency":
            seconds = body.get("seconds")
            if not isinstance(seconds, int | float):
                raise ValueError("latency needs a number of seconds")
            self.add_latency(float(seconds), verbs=verbs, resources=resources)
        elif action == "drop_watches":
            return {"dropped": self.drop_watches(resources), **self.describe()}
        elif action == "compact":
            rv = body.get("resourceVersion")
            if rv is not None:
                try:
                    rv = int(rv)
                except (TypeError, ValueError):
                    raise ValueError("resourceVersion must be an integer") from None
            self.compact(rv)
        elif action == "bookmarks":
            self.store.send_bookmarks()
        elif action == "clear":
            self.clear()
        else:
            raise ValueError(
                f"unknown action {action!r}; known: fail, latency, drop_watches, compact, bookmarks, clear"
            )
        return self.describe()
