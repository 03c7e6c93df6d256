"""The layout's boundaries (docs/architecture.md), read from the code: every import, at module level or inside a
function, of every module of the product."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("services.watcher", "services.ledger", "services.enforcer")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


MODULES = {module_name(p): imports_of(p) for top in ("shared", "services") for p in (ROOT / top).rglob("*.py")}


def under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def offenders(of: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{mod} imports {imp}"
        for mod, imps in MODULES.items()
        if under(mod, *of) and not under(mod, *allowed)
        for imp in imps
        if under(imp, *forbidden)
    )


def test_the_modules_are_found() -> None:
    assert {"shared.quota.equation", "services.platform.runner", "services.cli.main", "services.devtools.up"} <= set(
        MODULES
    )


def test_the_pure_core_imports_no_service() -> None:
    assert offenders(("shared",), ("services",)) == []


def test_the_platform_knows_no_service_command_or_development_tool() -> None:
    assert offenders(("services.platform",), (*SERVICES, "services.cli", "services.devtools")) == []


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service_nor_the_commands_nor_the_development_tools(service: str) -> None:
    others = tuple(s for s in SERVICES if s != service)
    assert offenders((service,), (*others, "services.cli", "services.devtools")) == []


def test_the_commands_import_no_service_and_no_development_tool() -> None:
    """The operator commands read the bus and the pure core; the dispatcher names the development commands as
    strings and loads them only when chosen."""
    assert offenders(("services.cli",), (*SERVICES, "services.devtools")) == []


def test_nothing_of_the_product_imports_the_development_tools() -> None:
    assert offenders(("shared", "services"), ("services.devtools",), allowed=("services.devtools",)) == []


def helpers_taken_from_test_modules(path: Path) -> list[str]:
    """The names a module imports *from* a test module (``from tests.unit.test_x import helper``)."""
    return [
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.rsplit(".", 1)[-1].startswith("test_")
        for a in node.names
    ]


def test_no_test_module_takes_helpers_from_another() -> None:
    """What tests share lives in helper modules (``tests/builders.py``, ``waiting.py``, ``exported.py``,
    ``integration/e2e.py``, ...), never in a test module another one imports from. (A test that reruns another
    module's tests to collect their inputs imports that module as a whole: ``test_snapshot`` does.)"""
    found = [
        f"{module_name(p)}: {name}"
        for p in (ROOT / "tests").rglob("*.py")
        for name in helpers_taken_from_test_modules(p)
    ]
    assert found == []
