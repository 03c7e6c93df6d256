"""``vmquota replay``: fold ``VMQUOTA_EVENTS`` from its start up to a time (``--at``) or a stream sequence
(``--until-seq``) with the ledger's own pure core (``shared.ledger.fold`` and ``shared.accounting``), and print each
managed quota as it was then: budget, use in VM terms, pods charged, reservations and the ``hard`` the quota
equation gives.

``--verify`` checks the replay against history: for every decision the enforcer published (up to the end of the
replay), the events are folded exactly up to the usage snapshot the decision was computed from (its
``usageSeq``), and the ``hard`` the equation gives there must equal the ``hard`` the enforcer wrote; and for every
usage snapshot in ``VMQUOTA_USAGE_HISTORY``, folded up to its ``seq``, each quota's ``hard`` and ``used`` must be
what the ledger published. Any difference is printed and the exit status is 1.

Read-only: ordered consumers (the ``replay`` NATS user).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg

from services.cli import opsbus
from services.platform.bus import position
from shared import contract, report, text
from shared.accounting.namespace import ACCOUNTED_KINDS
from shared.accounting.wire import account
from shared.errors import InvalidInput
from shared.ledger.fold import Ledger
from shared.quota.enforcement import hard_from
from shared.resources import canonical_resource_list, parse_resource_list
from shared.times import rfc3339


def add_arguments(p: argparse.ArgumentParser) -> None:
    opsbus.add_bus_arguments(p)
    until = p.add_mutually_exclusive_group()
    until.add_argument("--at", default=None, help="replay up to this RFC 3339 time or this long ago (2h)")
    until.add_argument("--until-seq", type=int, default=None, help="replay up to this events stream sequence")
    p.add_argument(
        "--verify", action="store_true", help="compare with the hard the enforcer wrote; exit 1 if any differs"
    )
    p.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table", help="output format")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


@dataclass
class Replay:
    """The fold so far."""

    ledger: Ledger = field(default_factory=lambda: Ledger(kinds=ACCOUNTED_KINDS))
    """Folding what accounting reads (VirtualMachines are skipped, by subject, without being decoded)."""
    events: int = 0
    skipped: int = 0
    seq: int = 0

    def apply(self, data: bytes, seq: int, subject: str = "") -> None:
        try:
            self.ledger.apply_bytes(data, seq, subject)
        except InvalidInput:
            self.skipped += 1  # (dead-lettered by the ledger too)
        self.events += 1
        self.seq = seq

    def usage(self, cluster: str, namespace: str, at: datetime) -> contract.UsageSnapshot:
        body = account(self.ledger.view(cluster, namespace), now=at)
        return contract.UsageSnapshot(
            id=f"{cluster}/replay/{namespace}/{self.seq}",
            source=contract.source("replay", cluster),
            subject=namespace,
            time=at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            cluster=cluster,
            namespace=namespace,
            seq=self.seq,
            quotas=body.quotas,
            vms=body.vms,
            migrations=body.migrations,
            errors=body.errors,
        )


class Progress:
    """Events/s and an estimate of the time left on stderr, at most every half second."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet or not sys.stderr.isatty()
        self.start = self.shown = time.monotonic()

    def update(self, done: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not final and now - self.shown < 0.5):
            return
        self.shown = now
        rate = done / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate and self.total > done else 0.0
        end = "\n" if final else ""
        print(f"\rreplayed {done}/{self.total} events, {rate:,.0f}/s, ~{left:.0f}s left ", end=end, file=sys.stderr)


def _stamp(m: Any) -> datetime:
    t: datetime = m.metadata.timestamp
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


async def main(args: argparse.Namespace) -> int:
    f = opsbus.Filter.from_args(args)
    now = datetime.now(UTC)
    at = opsbus.parse_since(args.at, now, "--at") if args.at is not None else None
    if at is not None and at > now:
        raise InvalidInput(
            f"{args.at!r} is in the future (a replay shows the state as it was; now is {rfc3339(now)})", "--at"
        )
    at_ns = opsbus.exact_nanos(args.at, at) if at is not None else None
    when = at or now
    nc = await opsbus.connect(args)
    try:
        js = nc.jetstream()
        info = await opsbus.stream_info(js, contract.EVENTS_STREAM)
        first = info.state.first_seq
        if args.until_seq is not None and args.until_seq < first:
            raise InvalidInput(
                f"sequence {args.until_seq} is before the retained history (from {first})", "--until-seq"
            )
        if args.until_seq is not None and args.until_seq > info.state.last_seq:
            raise InvalidInput(
                f"sequence {args.until_seq} is past the events stream's last ({info.state.last_seq}): a replay shows "
                "the state as it was",
                "--until-seq",
            )
        if first > 1 and not args.quiet:
            print(
                f"note: the events stream starts at sequence {first} (its retention dropped the older events): an "
                "object with no event since is missing from the replay",
                file=sys.stderr,
            )
        checks: list[tuple[int, int, contract.Decision | contract.UsageSnapshot]] = []
        unreadable: list[tuple[Msg, str]] = []
        """Decisions and usage snapshots that cannot be read (a newer schema, a body on another's subject): none can
        be compared, and each is a difference."""
        if args.verify:
            decided, unreadable = opsbus.readable(
                await opsbus.read(nc, contract.DECISIONS_STREAM, f.subject("quota")), contract.decode_decision_on
            )
            # (up to the end of the replay: published by then, or computed from the events up to its sequence)
            for m, d in decided:
                if not d.dry_run and d.usage_seq and _within(position(m).time_ns, d.usage_seq, at_ns, args.until_seq):
                    checks.append((d.usage_seq, 0, d))
            used, unused = opsbus.readable(await _history(nc, f.subject("usage")), contract.decode_usage_on)
            unreadable += unused
            for m, u in used:
                if u.seq and _within(position(m).time_ns, u.seq, at_ns, args.until_seq):
                    checks.append((u.seq, 1, u))
            checks.sort(key=lambda c: (c[0], c[1]))
        r = Replay()
        progress = Progress(info.state.messages, args.quiet)
        cluster_subject = f"{contract.PREFIX}.ev.{f.cluster or '*'}.>"
        last_stored = 0  # (when the last event applied was stored, in nanoseconds)
        differences: list[str] = []
        checked = {"decisions": 0, "usage": 0}
        pending = (c[2] for c in checks)
        nxt = next(pending, None)
        # (closed as the loop ends, early too: before the connection is)
        async with contextlib.aclosing(opsbus.messages(nc, contract.EVENTS_STREAM, cluster_subject)) as reading:
            async for m in reading:
                seq, _, _, stored = position(m)  # (the reply subject's time: nats-py's metadata costs ten times more)
                if at_ns is not None and r.events == 0 and stored > at_ns:
                    raise InvalidInput(
                        f"{when.isoformat()} is before the retained history (the events stream starts at "
                        f"{_stamp(m).isoformat()})",
                        "--at",
                    )
                if (args.until_seq is not None and seq > args.until_seq) or (at_ns is not None and stored > at_ns):
                    break
                while nxt is not None and _seq_of(nxt) < seq:
                    _check(r, nxt, differences, checked)
                    nxt = next(pending, None)
                r.apply(m.data, seq, m.subject)
                progress.update(r.events)
                last_stored = stored
        while nxt is not None:
            _check(r, nxt, differences, checked)
            nxt = next(pending, None)
        if args.until_seq is not None and r.events:  # (the state at a sequence is the state when its event was stored)
            when = datetime.fromtimestamp(last_stored / 1e9, UTC)
        # (those published by the end of the replay: what they were computed from is unknown)
        end_ns = at_ns if at_ns is not None else last_stored if args.until_seq is not None else None
        for m, why in unreadable:
            seq, _, _, stored = position(m)
            if end_ns is None or stored <= end_ns:
                differences.append(f"{m.subject} (seq {seq} of {m.metadata.stream}): cannot be compared: {why}")
        progress.update(r.events, final=True)
        if r.skipped:  # (as `status` says of what it skips; `tail --dead-letters` shows why each was)
            print(
                f"note: {r.skipped} unreadable event(s) skipped, as the ledger skips them (it dead-letters them)",
                file=sys.stderr,
            )
        usage = [
            r.usage(c, ns, when)
            for c, ns in r.ledger.namespaces()
            if (f.cluster is None or c == f.cluster) and (f.namespace is None or ns == f.namespace)
        ]
        rows = [row for row in report.quota_rows(usage) if row.name]
        if args.output == "json":
            out = report.status_json(rows, at=when.strftime("%Y-%m-%dT%H:%M:%SZ"), events=r.events)
            if args.verify:
                out["verify"] = {**checked, "differences": differences}
            print(json.dumps(out, indent=2))
        else:
            print(f"as of {when.strftime('%Y-%m-%dT%H:%M:%SZ')} (events stream sequence {r.seq}, {r.events} events)")
            print(report.status_table(rows, wide=args.output == "wide"))
            if args.verify:
                print(
                    f"verified {checked['decisions']} decisions and {checked['usage']} usage snapshots: "
                    f"{len(differences)} difference(s)"
                )
                for diff in differences:
                    print(text.printable(f"  {diff}"))
        return 1 if differences else 0
    finally:
        await nc.close()


async def _history(nc: Any, subject: str) -> list[Any]:
    """Every usage snapshot the history stream still holds (none from a bus that has no history stream yet)."""
    try:
        return await opsbus.read(nc, contract.USAGE_HISTORY_STREAM, subject)
    except opsbus.BusUnavailable as e:
        if "does not exist" not in str(e):
            raise
        return []


def _within(published_ns: int, seq: int, at_ns: int | None, until_seq: int | None) -> bool:
    """A decision or usage snapshot published at ``published_ns``, computed from the events up to ``seq``, is within
    a replay up to the time ``at_ns`` or the events stream sequence ``until_seq`` (None: to the end)."""
    return (at_ns is None or published_ns <= at_ns) and (until_seq is None or seq <= until_seq)


def _seq_of(c: contract.Decision | contract.UsageSnapshot) -> int:
    return c.usage_seq if isinstance(c, contract.Decision) else c.seq


def _check(
    r: Replay, c: contract.Decision | contract.UsageSnapshot, differences: list[str], checked: dict[str, int]
) -> None:
    try:
        if isinstance(c, contract.Decision):
            checked["decisions"] += _verify(r, c, differences)
        else:
            checked["usage"] += _verify_usage(r, c, differences)
    except InvalidInput as e:  # (one message the services published that cannot be compared: a difference, not the end)
        what = f"decision {c.id}" if isinstance(c, contract.Decision) else f"usage seq {c.seq}"
        differences.append(f"{c.cluster}/{c.namespace} {what}: cannot be compared: {e}")


def _verify_usage(r: Replay, u: contract.UsageSnapshot, differences: list[str]) -> int:
    """Compare one published usage snapshot with the replay folded up to its ``seq``: every managed quota's
    ``hard`` (and ``used``) must be what the ledger published. 1 when compared."""
    mine = r.usage(u.cluster, u.namespace, opsbus.parse_time(u.time, "time"))
    for name, t in sorted(u.quotas.items()):
        again = mine.quotas.get(name)
        if again is None or (again.hard, again.used) != (t.hard, t.used):
            gives = "no such quota" if again is None else _terms_text(again)
            differences.append(
                f"{u.cluster}/{u.namespace}/{name} at {u.time} (usage seq {u.seq}): published {_terms_text(t)}, "
                f"replay gives {gives}"
            )
    return 1


def _terms_text(t: contract.QuotaTerms) -> str:
    return f"hard {json.dumps(t.hard, sort_keys=True)} used {json.dumps(t.used, sort_keys=True)}"


def _verify(r: Replay, d: contract.Decision, differences: list[str]) -> int:
    """Compare one decision with the replay folded up to its ``usageSeq``; 1 when it could be compared (the
    replayed terms have the decision's budget and mode: the enforcer took ``hard`` from them)."""
    u = r.usage(d.cluster, d.namespace, opsbus.parse_time(d.time, "time"))
    t = u.quotas.get(d.quota)
    if t is None or t.mode != d.mode or t.budget != d.budget:
        return 0
    hard = t.hard
    if d.charged:  # (the enforcer held hard within what the API server charged: so does the replay)
        try:
            charged = parse_resource_list(d.charged, "charged")
            hard = canonical_resource_list(hard_from(t, charged))
        except InvalidInput as e:
            differences.append(f"{d.cluster}/{d.namespace}/{d.quota} at {d.time}: {e}")
            return 1
    if hard != d.hard_after:
        differences.append(
            f"{d.cluster}/{d.namespace}/{d.quota} at {d.time} (usage seq {d.usage_seq}): written "
            f"{json.dumps(d.hard_after, sort_keys=True)}, replay gives {json.dumps(hard, sort_keys=True)}"
        )
    return 1


def run(args: argparse.Namespace) -> int:
    return opsbus.run_command(args, lambda: main(args))
