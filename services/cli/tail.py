"""``vmquota tail``: follow the bus one readable line per message (decisions by default, or events, usage or dead
letters), from ``--since`` and then live (read-only)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

from nats.aio.msg import Msg

from services.cli import opsbus
from shared import contract, report, text
from shared.errors import InvalidInput


def add_arguments(p: argparse.ArgumentParser) -> None:
    opsbus.add_bus_arguments(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--decisions", dest="what", action="store_const", const="decisions", help="(the default)")
    which.add_argument("--events", dest="what", action="store_const", const="events", help="object events")
    which.add_argument("--usage", dest="what", action="store_const", const="usage", help="usage snapshots")
    which.add_argument(
        "--dead-letters",
        dest="what",
        action="store_const",
        const="dead-letters",
        help="what a service could not use, with the reason (every namespace: a dead letter may name none)",
    )
    p.add_argument("--since", default=None, help="start this long ago (10m, 2h) or at an RFC 3339 time")
    p.add_argument("--no-follow", dest="follow", action="store_false", help="stop after what is stored now")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")


STREAMS = {
    "decisions": (contract.DECISIONS_STREAM, "quota"),
    "events": (contract.EVENTS_STREAM, "ev"),
    "usage": (contract.USAGE_STREAM, "usage"),
    "dead-letters": (contract.DLQ_STREAM, "dlq"),
}


def line(what: str, subject: str, data: bytes, letter: contract.DeadLetter | None = None) -> str:
    """One readable line for a message of ``what`` read on ``subject`` (a dead letter: ``letter``, when it is decoded
    already); :class:`InvalidInput` for one the services refuse, a body on another's subject included."""
    if what == "decisions":
        d = contract.decode_decision_on(subject, data)
        dry = " [dry-run]" if d.dry_run else ""
        only = " [status.hard only]" if d.status_only else ""
        return f"{d.time} {d.cluster} {d.namespace}/{d.quota} ({d.mode}){dry}{only}: {d.reason}"
    if what == "dead-letters":
        dl = letter or contract.decode_dead_letter(data)
        was = f" (was {dl.original_subject}" + (f", {dl.stream} seq {dl.stream_seq})" if dl.stream_seq else ")")
        return f"{dl.time} {dl.cluster or '-'} dead letter from the {dl.service}: {dl.reason}{was}"
    if what == "usage":
        u = contract.decode_usage_on(subject, data)
        parts = [
            f"{r.name} {r.mode} used {report.used_of_budget(r.used, r.budget) or '-'}; {r.status}"
            for r in report.quota_rows([u])
        ]
        return f"{u.time} {u.cluster} {u.namespace}: " + (" | ".join(parts) or "no managed quota")
    ev = contract.decode_event_on(subject, data)
    if isinstance(ev, contract.Sync):
        present = f"{len(ev.present)} present at rv {ev.resource_version}"
        return f"{ev.time} {ev.cluster} sync {ev.kind} {ev.namespace}: {present}"
    verb = "upserted" if isinstance(ev, contract.Upserted) else "deleted"
    where = f"{ev.namespace}/{text.name(ev.name)}" if ev.namespace else text.name(ev.name)
    return f"{ev.time} {ev.cluster} {verb} {ev.kind} {where} rv {ev.resource_version}"


def show(what: str, m: Msg, output: str, letter: contract.DeadLetter | None = None) -> str:
    if output == "json":
        try:
            doc = json.loads(m.data)
        except ValueError as e:  # (whoever may publish on the subject may publish anything: one line, and go on)
            return json.dumps({"unreadable": m.subject, "error": f"not JSON: {e}"}, separators=(",", ":"))
        try:  # (what the services refuse, a body on another's subject too, is no message of theirs to show as one)
            line(what, m.subject, m.data, letter)
        except InvalidInput as e:
            return json.dumps({"unreadable": m.subject, "error": str(e)}, separators=(",", ":"))
        return json.dumps(doc, separators=(",", ":"))
    try:
        return text.printable(line(what, m.subject, m.data, letter))
    except InvalidInput as e:
        return text.printable(f"(unreadable message at {m.subject}: {e})")


def _letter(data: bytes) -> contract.DeadLetter | None:
    try:
        return contract.decode_dead_letter(data)
    except InvalidInput:
        return None


async def main(args: argparse.Namespace) -> int:
    f = opsbus.Filter.from_args(args)
    what = args.what or "decisions"
    since = opsbus.parse_since(args.since, datetime.now(UTC))
    stream, token = STREAMS[what]
    nc = await opsbus.connect(args)
    try:
        # (a dead letter's subject names only the service: its cluster is in the message)
        subject = f"{contract.PREFIX}.dlq.>" if what == "dead-letters" else f.subject(token)
        async for m in opsbus.messages(nc, stream, subject, since=since, follow=args.follow):
            letter = _letter(m.data) if what == "dead-letters" else None
            if letter is not None and f.cluster is not None and letter.cluster not in (f.cluster, ""):
                continue
            print(show(what, m, args.output, letter), flush=True)
    finally:
        await nc.close()
    return 0


def run(args: argparse.Namespace) -> int:
    return opsbus.run_command(args, lambda: main(args))
