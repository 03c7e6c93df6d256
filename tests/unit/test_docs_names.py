"""The docs name what the code has: every metric the README and docs/ cite is one a service exports, and every
dotted name of the project's code they cite in backticks can be imported. A name that moved or never existed
sends an operator's query, or a reader, nowhere."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

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
