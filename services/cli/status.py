"""``vmquota status``: every managed quota's budget, use in VM terms, pods charged, reservations and ``hard``, from
the latest usage snapshots and decisions on the bus (read-only; ``shared.report`` builds the rows)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from services.cli import opsbus
from shared import contract, report


def add_arguments(p: argparse.ArgumentParser) -> None:
    opsbus.add_bus_arguments(p)
    p.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table", help="output format")
    p.add_argument("--watch", action="store_true", help="print again whenever usage or a decision changes")


async def rows(nc: Any, f: opsbus.Filter) -> list[report.QuotaRow]:
    return (await _read(nc, f))[0]


async def _read(nc: Any, f: opsbus.Filter) -> tuple[list[report.QuotaRow], list[str]]:
    """The rows, and the errors of the usage snapshots read (a namespace whose every quota vmquota refuses has no
    row: its errors say why)."""
    usage, bad = opsbus.readable(
        await opsbus.read(nc, contract.USAGE_STREAM, f.subject("usage")), contract.decode_usage_on
    )
    decided, bad_decisions = opsbus.readable(
        await opsbus.read(nc, contract.DECISIONS_STREAM, f.subject("quota")), contract.decode_decision_on
    )
    bad += bad_decisions
    if bad:  # (one such message must not hide every other namespace's)
        print(opsbus.skipped_note(bad), file=sys.stderr)
    found = report.quota_rows([u for _, u in usage], (d for _, d in decided))
    return found, [e for _, u in usage for e in u.errors]


def render(found: list[report.QuotaRow], output: str, *, aged: bool = True) -> str:
    """The rows as ``output`` says; a table with the AGE of each row's usage unless not ``aged``."""
    if output == "json":
        return json.dumps(report.status_json(found), indent=2)
    return report.status_table(found, wide=output == "wide", now=datetime.now(UTC) if aged else None)


async def main(args: argparse.Namespace) -> int:
    f = opsbus.Filter.from_args(args)
    nc = await opsbus.connect(args)
    try:
        found, errors = await _read(nc, f)
        if not found and (f.cluster or f.namespace) and not args.watch:  # (one line, as any bad input)
            where = f"{f.cluster or '*'}/{f.namespace or '*'}"
            refused = report.refused_quota(errors)
            if refused:  # (the quotas of it vmquota refuses: the first says why)
                print(f"{opsbus.command_name(args)}: no managed quota in force in {where}: {refused}", file=sys.stderr)
            else:
                print(f"{opsbus.command_name(args)}: no managed quota matches {where}", file=sys.stderr)
            return 1
        print(render(found, args.output))
        for line in report.refused_quotas(errors):  # (a quota an administrator opted in that is not in force)
            print(f"refused: {line}", file=sys.stderr)
        if not args.watch:
            return 0
        changes: asyncio.Queue[opsbus.BusUnavailable | None] = asyncio.Queue()

        async def follow(stream: str, subject: str) -> None:
            try:
                async for _ in opsbus.messages(nc, stream, subject, follow=True, new_only=True):
                    changes.put_nowait(None)
            except opsbus.BusUnavailable as e:  # (the table shown is no longer followed: said, and the end)
                changes.put_nowait(e)

        watchers = [
            asyncio.create_task(follow(contract.USAGE_STREAM, f.subject("usage"))),
            asyncio.create_task(follow(contract.DECISIONS_STREAM, f.subject("quota"))),
        ]
        try:
            shown = render(found, args.output, aged=False)  # (printed again when what it shows changes, not its age)
            while True:
                if (lost := await changes.get()) is not None:
                    raise lost
                found = await rows(nc, f)
                if (content := render(found, args.output, aged=False)) != shown:
                    table = render(found, args.output)
                    print("\033[2J\033[H" + table if sys.stdout.isatty() else "\n" + table, flush=True)
                    shown = content
        finally:
            for t in watchers:
                t.cancel()
    finally:
        await nc.close()


def run(args: argparse.Namespace) -> int:
    return opsbus.run_command(args, lambda: main(args))
