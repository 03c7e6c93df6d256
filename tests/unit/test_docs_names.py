"""The docs name what the code has: every metric the README and docs/ cite is one a service exports, and every
dotted name of the project's code they cite in backticks can be imported. A name that moved or never existed
sends an operator's query, or a reader, nowhere."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from _pytest.mark.expression import Expression

from tests.exported import every_service_metrics, sample_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]
METRIC = re.compile(r"\bvmquota_[a-z0-9_]*[a-z0-9]")
DOTTED = re.compile(r"`((?:shared|services)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _cited(pattern: re.Pattern[str]) -> dict[str, str]:
    """Each match of ``pattern`` in the docs, with where it is first cited."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                found.setdefault(m.group(m.lastindex or 0), f"{doc.relative_to(ROOT)}:{n}")
    return found


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute path of the longest module prefix of it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_metric_the_docs_cite_is_exported() -> None:
    cited = _cited(METRIC)
    assert "vmquota_dlq_total" in cited  # (the docs' runbook and alert tables are read)
    exported = sample_names(every_service_metrics().registry)
    # (a family named without its sample suffix, as the alert rules' prose does, counts too)
    missing = {name: at for name, at in cited.items() if name not in exported and f"{name}_total" not in exported}
    assert not missing, f"metrics the docs cite that no service exports: {missing}"


def test_every_dotted_name_the_docs_cite_imports() -> None:
    cited = _cited(DOTTED)
    assert "shared.quota.modes.quota_policy" in cited  # (backticked names are read)
    missing = {name: at for name, at in cited.items() if not _resolves(name)}
    assert not missing, f"names the docs cite that the code does not have: {missing}"


SELECTOR = re.compile(r"(tests/[\w/]+\.py)\s+-k\s+(?:\"([^\"]+)\"|'([^']+)'|([^\s`]+))")


def _selectors() -> dict[tuple[str, str], str]:
    """Each ``tests/<file>.py -k <expression>`` the docs cite in backticks (across line breaks), with where."""
    found: dict[tuple[str, str], str] = {}
    for doc in DOCS:
        text = doc.read_text()
        for span in re.finditer(r"`([^`]+)`", text):
            flat = " ".join(span.group(1).split())
            at = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, span.start()) + 1}"
            for m in SELECTOR.finditer(flat):
                expr = next(g for g in m.groups()[1:] if g is not None)
                found.setdefault((m.group(1), expr), at)
    return found


def test_every_test_selector_the_docs_cite_selects_a_test() -> None:
    """``pytest <file> -k <expression>``, as a reader runs it, selects at least one test: a test renamed or removed
    leaves a doc pointing at nothing."""
    cited = _selectors()
    assert any(f == "tests/unit/test_accounting.py" for f, _ in cited)  # (the docs' selectors are read)
    files = sorted({f for f, _ in cited})
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    assert ids, listed.stdout[-2000:] + listed.stderr[-2000:]
    by_file: dict[str, list[list[str]]] = {}
    for nodeid in ids:
        path, _, rest = nodeid.partition("::")
        # (what ``-k`` matches: the names of the test and of what holds it, its module's file name among them)
        by_file.setdefault(path, []).append([Path(path).name, *rest.split("::")])
    empty = {}
    for (file, expr), at in cited.items():
        compiled = Expression.compile(expr)
        if not any(compiled.evaluate(_Keywords(names)) for names in by_file.get(file, [])):
            empty[f"{file} -k {expr}"] = at
    assert not empty, f"test selectors the docs cite that select nothing: {empty}"


class _Keywords:
    """``-k``'s match of a name: a case-insensitive part of one of a test's ``names``."""

    def __init__(self, names: list[str]) -> None:
        self.names = [n.lower() for n in names]

    def __call__(self, name: str, /, **kwargs: str | int | bool | None) -> bool:
        return any(name.lower() in n for n in self.names)
