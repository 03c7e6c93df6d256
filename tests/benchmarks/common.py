"""Shared pieces of the benchmarks: a result line and a rate measurement helper."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    name: str
    value: float
    unit: str
    target: float | None = None
    higher_is_better: bool = True
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def line(self) -> str:
        t = ""
        if self.target is not None:
            op = ">=" if self.higher_is_better else "<="
            t = f"  (target {op} {self.target:,.0f}: {'met' if self.met else 'MISSED'})"
        n = f"  {self.note}" if self.note else ""
        return f"{self.name:<48} {self.value:>14,.1f} {self.unit}{t}{n}"


def rate(fn: Callable[[], int], min_seconds: float = 1.0) -> float:
    """Call ``fn`` (which returns how many items it processed) until ``min_seconds`` pass; items per second."""
    items = 0
    t0 = time.perf_counter()
    while True:
        items += fn()
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return items / dt
