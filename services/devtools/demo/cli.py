"""``vmquota demo [--scenario-file FILE] [--without-vmquota] [--json]``: play scenarios and print what happened."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from services.devtools.demo.play import RunResult, dumps, play
from services.devtools.demo.scenario import Scenario, builtin_scenarios, load_scenario
from services.devtools.speed import check_speed
from services.platform import runner
from shared.errors import InvalidInput
from shared.quantity import Quantity
from shared.quota.modes import VM_TERM_MODES
from shared.report import SCALE_NOTE, readable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario-file", metavar="FILE", help="play this scenario file instead of the built-in ones")
    p.add_argument(
        "--without-vmquota", action="store_true", help="only the plain-Kubernetes run (expectations apply to it)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (a list for several scenarios)")
    p.add_argument(
        "--speed",
        type=float,
        default=0.05,
        help="simulated-cluster delay factor (smaller is faster; 1.0 is real KubeVirt timing) [0.05]",
    )
    p.add_argument(
        "--log-level", default="error", help="log level of the embedded services (their logs go to stderr) [error]"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr while it plays")


class Progress:
    """One line on stderr per thing the demo does, as it does it: ``[scenario, with vmquota] 1.2s migrate vm1``."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = time.monotonic()

    def for_run(self, scenario: str, with_vmquota: bool) -> Callable[[str], None]:
        label = f"[{scenario}, {'with' if with_vmquota else 'without'} vmquota]"

        def say(line: str) -> None:
            print(f"{label} {time.monotonic() - self.started:5.1f}s {line.strip()}", file=self.out, flush=True)

        return say


def _fmt_hard(hard: Mapping[str, Quantity]) -> str:
    return ", ".join(f"{k}={readable(hard[k], k)}" for k in sorted(hard)) or "(none)"


def _print_run(r: RunResult, out: TextIO, modes: Mapping[str, str]) -> None:
    label = "with vmquota" if r.with_vmquota else "without vmquota (plain ResourceQuota)"
    print(f"  {label}:", file=out)
    for s in r.steps:
        print(f"    - {s}", file=out)
    for vm, m in sorted(r.migrations.items()):
        unblock = f", target pod admitted after {m.unblock_ms:.0f} ms" if m.unblock_ms is not None else ""
        refusals = f", {m.quota_refusals} quota refusal(s) of its target pod" if m.quota_refusals else ""
        print(f"    migration of {vm}: {m.shown_phase}{unblock}{refusals}", file=out)
    for line in r.tenant:
        print(f"    tenant: {line}", file=out)
    states = ", ".join(f"{vm} {st}" for vm, st in sorted(r.vms.items()))
    print(f"    VMs: {states}", file=out)
    if r.refusals:
        first = r.refusals[0]
        msg = first.split("forbidden: ", 1)[-1]
        print(
            f"    Kubernetes refused {len(r.refusals)} pod creation(s) (KubeVirt retries a refused pod, so one VM or "
            f"migration counts many times), e.g.: {msg}",
            file=out,
        )
    scaled = False
    for key, q in sorted(r.quotas.items()):
        scaled = scaled or (r.with_vmquota and modes.get(key) in VM_TERM_MODES and q.hard_before != q.budget)
        print(f"    quota {key}: budget {_fmt_hard(q.budget)}", file=out)
        print(f"      spec.hard before the steps: {_fmt_hard(q.hard_before)}", file=out)
        if q.hard_max != q.hard_before:
            print(f"      highest during the steps:   {_fmt_hard(q.hard_max)}", file=out)
        print(f"      after the steps:            {_fmt_hard(q.hard_after)}", file=out)
        changes = [(t, h) for t, h in q.timeline]
        if r.with_vmquota and len(changes) > 1:
            shown = "; ".join(f"{t:.2f}s {_fmt_hard(h)}" for t, h in changes[-6:])
            print(f"      spec.hard over time: {shown}", file=out)
    if scaled:
        print(f"    (why hard is not the budget: {SCALE_NOTE})", file=out)
    if not r.judged:
        print("    => for comparison (the expectations apply to the run with vmquota)", file=out)
        return
    verdict = "all expectations held" if r.passed else "FAILED: " + "; ".join(r.failures)
    print(f"    => {verdict}", file=out)


def print_summary(scenario: Scenario, runs: list[RunResult], out: TextIO) -> None:
    print(f"== {scenario.name}", file=out)
    if scenario.description:
        print(f"  {scenario.description}", file=out)
    modes = {f"{ns.name}/{q.name}": q.mode for ns in scenario.namespaces for q in ns.quotas}
    for r in runs:
        _print_run(r, out, modes)
    print(file=out)


async def _play_all(scenarios: list[Scenario], args: argparse.Namespace) -> list[tuple[Scenario, list[RunResult]]]:
    out: list[tuple[Scenario, list[RunResult]]] = []
    progress = None if args.quiet else Progress(sys.stderr)

    def told(sc: Scenario, with_vmquota: bool) -> Callable[[str], None] | None:
        return None if progress is None else progress.for_run(sc.name, with_vmquota)

    for sc in scenarios:
        runs: list[RunResult] = []
        plain = await play(sc, with_vmquota=False, speed=args.speed, progress=told(sc, False))
        if args.without_vmquota:
            runs.append(plain)
        else:
            plain.judged = False  # expectations describe the run with vmquota; the plain run is for comparison
            runs.append(plain)
            runs.append(await play(sc, with_vmquota=True, speed=args.speed, progress=told(sc, True)))
        if not args.json:
            print_summary(sc, runs, sys.stdout)
            sys.stdout.flush()
        out.append((sc, runs))
    return out


def run(args: argparse.Namespace) -> int:
    from services.platform import logs

    try:
        logs.check_level(args.log_level)
        check_speed(args.speed)
        scenarios = [load_scenario(args.scenario_file)] if args.scenario_file else builtin_scenarios()
    except InvalidInput as e:
        print(f"vmquota demo: {e}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    from services.devtools.simcluster.server import require_tls_support

    require_tls_support()
    results = runner.run_to_end(_play_all(scenarios, args))  # (Ctrl-C or SIGTERM: KeyboardInterrupt, exit 130)
    judged = [runs[-1] for _, runs in results]
    if args.json:
        print(dumps(judged))
    else:
        passed = sum(1 for r in judged if r.passed)
        print(f"{passed} of {len(judged)} scenario(s) passed")
    return 0 if all(r.passed for r in judged) else 1
