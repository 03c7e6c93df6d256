"""``vmquota explain (migration|vm) NS/NAME``: the timeline of one migration or VM, from the bus alone: the
namespace's events, decisions and usage history (``shared.explain`` says what each step rests on).

Read-only: ordered consumers (the ``replay`` NATS user). An object with no event in the retained history exits 1
with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from nats.aio.msg import Msg

from services.cli import opsbus
from shared import contract, explain, text
from shared.errors import InvalidInput


def add_arguments(p: argparse.ArgumentParser) -> None:
    opsbus.add_bus_arguments(p, namespace=False)
    p.add_argument("what", choices=("migration", "vm"), help="a migration (VMIM) or a VM (its VMI)")
    p.add_argument("ref", metavar="NAMESPACE/NAME", help="the object, e.g. tenant-a/mig1")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")


def parse_ref(ref: str) -> tuple[str, str]:
    namespace, sep, name = ref.partition("/")
    if not sep or not name or "/" in name:
        raise InvalidInput(f"expected NAMESPACE/NAME, got {ref!r}", "NAMESPACE/NAME")
    contract.check_namespace(namespace, "NAMESPACE/NAME")
    return namespace, name


M = TypeVar("M", contract.Decision, contract.UsageSnapshot)


async def _read(
    nc: Any,
    stream: str,
    subject: str,
    decode: Callable[[str, bytes], M],
    cluster: str | None,
    skipped: list[tuple[Msg, str]],
) -> list[M]:
    """The readable messages of ``stream`` on ``subject`` (of ``cluster``), oldest first; those refused added to
    ``skipped``."""
    found, refused = opsbus.readable(await opsbus.read(nc, stream, subject), decode)
    skipped += refused
    return [msg for _, msg in found if cluster is None or msg.cluster == cluster]


async def main(args: argparse.Namespace) -> int:
    namespace, name = parse_ref(args.ref)
    f = opsbus.Filter.checked(args.cluster, namespace)
    nc = await opsbus.connect(args)
    try:
        # (one the ledger refuses, it dead-letters: skipped here, and said so)
        read, skipped = opsbus.readable(
            await opsbus.read(nc, contract.EVENTS_STREAM, f.subject("ev")), contract.decode_event_on
        )
        events = [e for _, e in read]
        clusters = sorted(
            {
                e.cluster
                for e in events
                if not isinstance(e, contract.Sync) and e.namespace == namespace and e.name == name
            }
        )
        if len(clusters) > 1:
            raise InvalidInput(f"{args.ref} is on the bus of clusters {', '.join(clusters)}: give one", "--cluster")
        cluster = clusters[0] if clusters else args.cluster
        events = [e for e in events if cluster is None or e.cluster == cluster]
        decisions = await _read(
            nc, contract.DECISIONS_STREAM, f.subject("quota"), contract.decode_decision_on, cluster, skipped
        )
        try:
            usages = await _read(
                nc, contract.USAGE_HISTORY_STREAM, f.subject("usage"), contract.decode_usage_on, cluster, skipped
            )
        except opsbus.BusUnavailable as e:  # (a bus from before the history stream: the latest snapshot only)
            if "does not exist" not in str(e):
                raise
            usages = await _read(
                nc, contract.USAGE_STREAM, f.subject("usage"), contract.decode_usage_on, cluster, skipped
            )
    finally:
        await nc.close()
    if args.what == "migration":
        steps = explain.migration_timeline(namespace, name, events, decisions, usages)
    else:
        steps = explain.vm_timeline(namespace, name, events, usages)
    if steps is None:
        kind = "migration (VirtualMachineInstanceMigration)" if args.what == "migration" else "VM (VMI)"
        raise opsbus.NotFound(
            f"no {kind} {args.ref} in the retained history of {contract.EVENTS_STREAM}"
            + (f" of cluster {args.cluster}" if args.cluster else "")
            + ": check the name, or it is older than the events stream keeps (the ledger's --events-max-age)"
            # (its events may be among those the services refused: one line all the same)
            + (f"; {len(skipped)} unreadable message(s) skipped (vmquota tail --dead-letters)" if skipped else "")
        )
    if skipped:  # (as `status` says of what it skips; `tail --dead-letters` shows why the services refused each)
        print(opsbus.skipped_note(skipped), file=sys.stderr)
    if args.output == "json":
        out: dict[str, Any] = {
            "kind": args.what,
            "cluster": cluster,
            "namespace": namespace,
            "name": name,
            "steps": [s.to_json() for s in steps],
        }
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.what} {args.ref}" + (f" (cluster {cluster})" if cluster else ""))
        width = max(len(s.step) for s in steps)
        for s in steps:
            print(text.printable(f"  {s.time}  {s.step.ljust(width)}  {s.detail}"))
    return 0


def run(args: argparse.Namespace) -> int:
    return opsbus.run_command(args, lambda: main(args))
