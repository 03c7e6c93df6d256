"""``vmquota schema MESSAGE``: the JSON Schema of a message on the bus (``shared.contract.schema``), for a subscriber
written in another language. Needs no bus."""

from __future__ import annotations

import argparse
import json

from shared.contract.schema import MESSAGES, json_schema


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "message",
        choices=sorted(MESSAGES),
        help="event (vmquota.ev.*), usage (vmquota.usage.*), decision (vmquota.quota.*), deadletter "
        "(vmquota.dlq.*) or relist (vmquota.relist.*)",
    )


def run(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(args.message), indent=2, sort_keys=True))
    return 0
