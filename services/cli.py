"""The ``vmquota`` command line: a thin dispatcher over the services and the pure core.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; only the
chosen sub-command's module is imported, so ``vmquota run watcher`` never loads the simulated cluster or the demo,
and ``vmquota render`` never loads the NATS or Kubernetes clients.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shared.errors import MissingDependency

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.cli_up", "run nats-server, a simulated KubeVirt cluster and the services here, until Ctrl-C"),
    "render": ("services.cli_render", "render the launcher pods KubeVirt would create for VMIs/VMs"),
    "usage": ("services.cli_usage", "compute per-namespace usage of VMIs, migrations and pods in a mode"),
    "simulate": ("services.cli_simulate", "run a simulated KubeVirt cluster until interrupted"),
    "run": ("services.runner", "run a service: watcher, ledger, enforcer or all"),
    "demo": ("services.demo.cli", "play the seed scenarios (or a scenario file) without and with vmquota"),
    "status": ("services.cli_status", "show every managed quota: budget, use in VM terms, reservations, hard"),
    "tail": ("services.cli_tail", "follow decisions, usage or events on the bus, one line per message"),
    "explain": (
        "services.cli_explain",
        "the timeline of one migration or VM, from the bus: why it waited or was refused",
    ),
    "replay": ("services.cli_replay", "fold the events stream up to a time and show the quotas as they were"),
}


def build_parser(only: str | None = None, prog: str = "vmquota") -> argparse.ArgumentParser:
    """The full parser, or with ``only`` one sub-command's arguments (the others are listed, not loaded)."""
    parser = argparse.ArgumentParser(prog=prog, description="VM-aware, migration-safe ResourceQuotas for KubeVirt")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "vmquota") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None, prog)
    args = parser.parse_args(argv)
    mod = importlib.import_module(args._module)
    try:
        code: int = mod.run(args)
    except KeyboardInterrupt:
        return 130
    except MissingDependency as e:  # one line with the install line that fixes it, whichever command needs it
        print(f"{prog} {args.command}: {e}", file=sys.stderr)
        return 1
    return code


def kubectl_main() -> int:
    """``kubectl-vmquota``: kubectl runs it for ``kubectl vmquota ARGS`` with ARGS as they are."""
    return main(prog="kubectl vmquota")


if __name__ == "__main__":
    sys.exit(main())
