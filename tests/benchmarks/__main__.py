"""``make bench``: run every ``bench_*.py`` module in this folder and print one line per figure.

A benchmark module exposes ``run() -> list[Result]`` (sync) or ``async def run_async() -> list[Result]``.
Targets are reported next to the figure; a missed target is printed, not failed on (figures are noisy).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

from services.platform.logs import configure
from services.platform.runner import run_to_end
from tests.benchmarks.common import Result


def main() -> int:
    import tests.benchmarks as pkg

    only = set(sys.argv[1:])
    configure("warning")  # (what runs in this process says only what goes wrong: the figures are the output)
    results: list[Result] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("bench_") or (only and info.name not in only):
            continue
        mod = importlib.import_module(f"tests.benchmarks.{info.name}")
        t0 = time.perf_counter()
        res = run_to_end(mod.run_async()) if hasattr(mod, "run_async") else mod.run()
        print(f"# {info.name}: {time.perf_counter() - t0:.1f}s", flush=True)
        for r in res:
            print(r.line(), flush=True)
        results.extend(res)
    missed = [r for r in results if r.met is False]
    print(f"{len(results)} figures, {len(missed)} below target")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stopped, with what the benchmark started
        sys.exit(130)
