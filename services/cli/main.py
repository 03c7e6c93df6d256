"""The ``vmquota`` command line: a thin dispatcher over the services and the pure core.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; only the
chosen sub-command's module is imported, so ``vmquota run watcher`` never loads the simulated cluster or the demo,
and ``vmquota render`` never loads the NATS or Kubernetes clients. The development tools' commands (``up``,
``simulate``, ``demo``) live in ``services.devtools``; an installation without that package (the production image)
lists them and says so when one is chosen.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from shared.errors import SIM_INSTALL, MissingDependency

DEVTOOLS = "services.devtools"
NO_DEVTOOLS = (
    "is a development tool, not part of this installation (the production image leaves services.devtools out): "
    f"use the devtools image, or {SIM_INSTALL}"
)

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.devtools.up", "run nats-server, a simulated KubeVirt cluster and the services here, until Ctrl-C"),
    "render": ("services.cli.render", "render the launcher pods KubeVirt would create for VMIs/VMs"),
    "usage": ("services.cli.usage", "compute per-namespace usage of VMIs, migrations and pods in a mode"),
    "simulate": ("services.devtools.simulate", "run a simulated KubeVirt cluster until interrupted"),
    "run": ("services.platform.runner", "run a service: watcher, ledger, enforcer or all"),
    "demo": ("services.devtools.demo.cli", "play the seed scenarios (or a scenario file) without and with vmquota"),
    "status": (
        "services.cli.status",
        "show every managed quota: budget and use in VM terms (-o wide: pods, reservations, hard)",
    ),
    "tail": ("services.cli.tail", "follow decisions, usage or events on the bus, one line per message"),
    "explain": (
        "services.cli.explain",
        "the timeline of one migration or VM, from the bus: why it waited or was refused",
    ),
    "replay": ("services.cli.replay", "fold the events stream up to a time and show the quotas as they were"),
    "schema": ("services.cli.schema", "print the JSON Schema of a message on the bus, for subscribers"),
}


def _version() -> str:
    """The installed package's version (``pyproject.toml``), or ``unknown`` when run from a tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vmquota")
    except PackageNotFoundError:
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """An argument error is one line, as every other bad input (argparse prints the whole usage before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None, prog: str = "vmquota") -> argparse.ArgumentParser:
    """The full parser, or with ``only`` one sub-command's arguments (the others are listed, not loaded)."""
    parser = _Parser(prog=prog, description="VM-aware, migration-safe ResourceQuotas for KubeVirt")
    parser.set_defaults(_prog=prog)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if (only is None or name == only) and _available(module):
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def _available(module: str) -> bool:
    """Whether ``module`` is installed: only the development tools may be missing."""
    if not module.startswith(DEVTOOLS + "."):
        return True
    return importlib.util.find_spec(DEVTOOLS) is not None


def main(argv: Sequence[str] | None = None, prog: str = "vmquota") -> int:
    try:  # (Ctrl-C while the modules load, too: exit 130, no traceback)
        return _main(list(sys.argv[1:] if argv is None else argv), prog)
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str], prog: str) -> int:
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen in COMMANDS and not _available(COMMANDS[chosen][0]):
        print(f"{prog} {chosen}: {NO_DEVTOOLS}", file=sys.stderr)
        return 1
    args, extra = build_parser(chosen if chosen in COMMANDS else None, prog).parse_known_args(argv)
    if extra:  # (argparse blames the top-level command for a sub-command's unknown flag)
        print(
            f"{prog} {args.command}: unrecognized arguments: {' '.join(extra)} (see {prog} {args.command} --help)",
            file=sys.stderr,
        )
        return 2
    mod = importlib.import_module(args._module)
    try:
        code: int = mod.run(args)
    except MissingDependency as e:  # one line with the install line that fixes it, whichever command needs it
        print(f"{prog} {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # (the reader went away: `vmquota tail | head`) quiet, as other commands are
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nothing left to flush at exit)
        return 141
    return code


def kubectl_main() -> int:
    """``kubectl-vmquota``: kubectl runs it for ``kubectl vmquota ARGS`` with ARGS as they are."""
    return main(prog="kubectl vmquota")


if __name__ == "__main__":
    sys.exit(main())
