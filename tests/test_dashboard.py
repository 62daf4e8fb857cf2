"""The shipped dashboard and alert rules: valid for promtool, regenerated identically, naming only our metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from celery_lockguard._stats import EXPORTED_METRICS
from ops import dashboard

from .conftest import REQUIRE

RULES = Path(dashboard.__file__).parent / "prometheus" / "lockguard-rules.yml"
RULE_TESTS = RULES.with_name("lockguard-rules.test.yml")
#: A metric name in PromQL (recording-rule names have colons and are not matched).
METRIC = re.compile(r"\blockguard_[a-z_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if REQUIRE:
            pytest.fail("LOCKGUARD_REQUIRE_SERVICES=1 but promtool is not on PATH (apt-get install prometheus)")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return found


def exported(name: str) -> bool:
    """Whether ``name`` is a series the exporter writes (a histogram's _bucket/_sum/_count included)."""
    if name in EXPORTED_METRICS:
        return True
    return any(name.endswith(s) and name[: -len(s)] in EXPORTED_METRICS for s in HISTOGRAM_SUFFIXES)


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout
    tested = subprocess.run(
        [tool, "test", "rules", RULE_TESTS.name], cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_and_panel_names_only_metrics_the_exporter_writes() -> None:
    exprs = rule_exprs() + [q.expr for p in dashboard.panels() for q in p.queries]
    named = {m for expr in exprs for m in METRIC.findall(expr)}
    assert named, "no metric found: the pattern is wrong"
    assert {m for m in named if not exported(m)} == set()
    # And the other way round: every family we export is on the dashboard or in a rule.
    families = {re.sub(r"_(bucket|sum|count)$", "", m) for m in named} | named
    unused = set(EXPORTED_METRICS) - families
    assert unused <= {"lockguard_metrics_last_flush_timestamp_seconds", "lockguard_folded_labels"}, unused


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    if not REQUIRE:
        pytest.importorskip("grafanalib")
    committed = dashboard.JSON_PATH.read_text()
    assert committed == dashboard.render(), "ops/grafana/lockguard.json is stale: run make dashboard"
    # Each panel's queries are in the JSON as written here.
    for panel in dashboard.panels():
        for query in panel.queries:
            assert query.expr.replace('"', '\\"') in committed
    assert dashboard.main(["--check"]) == 0


def test_the_alerts_documented_are_the_alerts_shipped() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    page = (Path(__file__).parent.parent / "docs" / "dashboards.md").read_text()
    assert {a for a in alerts if f"`{a}`" not in page} == set()
    for panel in dashboard.panels():
        assert f"dashboard-{panel.slug}.png" in page
        assert (Path(__file__).parent.parent / "docs" / "img" / f"dashboard-{panel.slug}.png").is_file()
