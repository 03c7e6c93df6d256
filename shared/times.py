"""RFC 3339 times, the one spelling the project reads and writes: Kubernetes' timestamps, a message's ``time``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def parse_rfc3339(text: object) -> datetime | None:
    """``text`` as a time when it is an RFC 3339 time with its zone (``Z`` or an offset); None for anything else,
    a time without a zone included (Kubernetes never writes one, and it cannot be compared with one that has)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        return None
    return t if t.tzinfo is not None else None


def rfc3339(t: datetime | None = None) -> str:
    """``t`` (default: now) in UTC with milliseconds, ``Z``-suffixed: every time vmquota writes, in one width."""
    return (t or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def go_seconds(seconds: int) -> timedelta:
    """Go's ``time.Duration(seconds) * time.Second``, as the API server and the quota evaluator compute a grace
    period's end: int64 nanoseconds, which wrap past 292 years (Kubernetes puts no upper bound on a grace period, so
    a tenant may ask for any). Never raises, whatever ``seconds`` is."""
    nanos = (seconds * 1_000_000_000 + 2**63) % 2**64 - 2**63
    return timedelta(microseconds=nanos // 1000)
