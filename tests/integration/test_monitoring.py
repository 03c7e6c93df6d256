"""deploy/components/monitoring against the services' metrics.

The alert rules (prometheus-rule.yaml) under ``promtool``: they load, every alert fires on the series of
tests/integration/alerts/ where it should and not on the look-alikes, they read only metrics the services export,
and docs/operations.md describes these rules rather than a copy of its own. The Grafana dashboard (dashboard.json)
charts only metrics the services export (read from their metric classes), and what operators look for."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.exported import every_service_metrics, metric_names, sample_names
from tests.promtool import PromtoolUnavailable, find_promtool

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "components" / "monitoring"
RULE = MONITORING / "prometheus-rule.yaml"
DASHBOARD = MONITORING / "dashboard.json"
TESTS = Path(__file__).parent / "alerts"
DOC = ROOT / "docs" / "operations.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return find_promtool()
    except PromtoolUnavailable as e:
        pytest.skip(f"cannot test the alert rules: {e}")


def rules_file() -> dict[str, Any]:
    """The PrometheusRule's spec: the Prometheus rules file promtool reads."""
    rule = yaml.safe_load(RULE.read_text())
    assert rule["kind"] == "PrometheusRule"
    spec: dict[str, Any] = rule["spec"]
    return spec


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rules_file()["groups"] for r in g["rules"] if "alert" in r}


def unit_tests() -> list[Path]:
    found = sorted(TESTS.glob("*.yaml"))
    assert found, f"no promtool tests in {TESTS}"
    return found


def run_unit_tests(promtool: str, rules: dict[str, Any], where: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` on copies of the unit tests, next to ``rules`` written as rules.yaml."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    copies = []
    for t in unit_tests():
        shutil.copy(t, where / t.name)
        copies.append(str(where / t.name))
    return subprocess.run([promtool, "test", "rules", *copies], capture_output=True, text=True, timeout=120)


def test_the_rules_load(promtool: str, tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_file(), sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_passes_its_unit_tests(promtool: str, tmp_path: Path) -> None:
    out = run_unit_tests(promtool, rules_file(), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_unit_tests_catch_a_changed_threshold(promtool: str, tmp_path: Path) -> None:
    """The tests can fail: a lag threshold ten times higher no longer fires where the tests expect it."""
    rules = rules_file()
    lagging = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VmquotaConsumerLagging")
    lagging["expr"] = lagging["expr"].replace("> 1000", "> 10000")
    out = run_unit_tests(promtool, rules, tmp_path)
    assert out.returncode != 0 and "VmquotaConsumerLagging" in out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for t in unit_tests():
        doc = yaml.safe_load(t.read_text())
        assert doc["rule_files"] == ["rules.yaml"], t.name
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(alerts()) == firing, f"alerts never shown firing: {set(alerts()) - firing}"
    assert set(alerts()) == silent, f"alerts never shown silent: {set(alerts()) - silent}"


def test_the_rules_read_only_exported_metrics() -> None:
    exported = sample_names(every_service_metrics().registry) | {"up"}
    for name, rule in alerts().items():
        read = metric_names(rule["expr"])
        assert read, name
        assert read <= exported, f"{name} reads metrics no service exports: {read - exported}"


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_the_operations_guide_describes_these_rules_and_keeps_no_copy() -> None:
    doc = DOC.read_text()
    section = doc[doc.index("## Metrics and alerts") :]
    section = section[: section.index("\n## ", 1)]
    assert "deploy/components/monitoring/prometheus-rule.yaml" in section
    assert "groups:" not in section and "expr:" not in section, "the rules live in the PrometheusRule only"
    documented = set(re.findall(r"`(Vmquota[A-Za-z]+)`", section))
    assert documented == set(alerts()), f"alerts in the rules but not the guide: {set(alerts()) ^ documented}"


# ---- the dashboard -----------------------------------------------------------------------------------------------


def dashboard_queries() -> dict[str, str]:
    """Every PromQL expression of the dashboard: each panel's targets and each variable's query (the series
    selector of ``label_values(selector, label)``), by where it stands."""
    dash = json.loads(DASHBOARD.read_text())
    found: dict[str, str] = {}
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            found[f"panel {panel['title']!r} {t['refId']}"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
        assert m, f"variable {v['name']}: {v['query']['query']}"
        found[f"variable {v['name']}"] = m.group(1)
    return found


def test_the_dashboard_loads_and_every_panel_has_queries() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "vmquota" and dash["title"]
    charts = [p for p in dash["panels"] if p["type"] != "row"]
    assert charts and all(p.get("targets") for p in charts)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "panel ids are unique"
    for p in charts:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]


def test_the_dashboard_charts_only_exported_metrics() -> None:
    exported = sample_names(every_service_metrics().registry) | {"up"}
    for where, expr in dashboard_queries().items():
        read = metric_names(expr)
        assert read, f"{where}: no metric in {expr!r}"
        assert read <= exported, f"{where} reads metrics no service exports: {read - exported}"


def test_the_dashboard_shows_what_operators_look_for() -> None:
    read = set().union(*(metric_names(e) for e in dashboard_queries().values()))
    exprs = " ".join(dashboard_queries().values())
    for metric in (
        "vmquota_quota_used",  # quota use in VM terms
        "vmquota_quota_budget",
        "vmquota_quota_hard",  # raises during migrations
        "vmquota_quota_reserved",
        "vmquota_namespace_migrations",
        "vmquota_enforcer_reaction_seconds_bucket",  # unblock latency
        "vmquota_enforcer_decisions_total",  # refusals among the decisions
        "vmquota_dlq_total",
        "vmquota_consumer_lag",
    ):
        assert metric in read, metric
    assert 'action="refuse"' in exprs and 'state="refused"' in exprs
