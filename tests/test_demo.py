"""``make demo`` in a bounded form: real workers, a SIGKILLed child, and a checked report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from example_app.report import build_report

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


def run_demo(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report_path = tmp_path / "report.json"
    base = {k: v for k, v in os.environ.items() if k not in ("LOCKGUARD_REDIS_URL", "DATABASE_URL")}
    proc = subprocess.run(
        [sys.executable, "-m", "example_app.demo"],
        cwd=ROOT,
        env={**base, "DEMO_JOBS": "90", "DEMO_TIMEOUT": "60", "DEMO_REPORT": str(report_path), **env},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads(report_path.read_text())


def check(proc: subprocess.CompletedProcess[str], report: dict[str, Any]) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report["ok"] and report["problems"] == []
    assert report["jobs_enqueued"] == 90
    assert report["jobs_succeeded"] == 90 and report["jobs_lost"] == 0 and report["jobs_failed"] == 0
    n = report["invoices"]
    assert report["charges_per_invoice"] == {"1": n}
    assert report["postings_per_invoice"] == {"1": n}
    assert report["receipts_per_invoice"].get("0", 0) == 0
    # Duplicates were skipped: far fewer charge bodies than charge jobs, and at most one extra (the killed one).
    assert report["duplicates_skipped"] + report["completions_skipped"] > 0
    charges = report["bodies_run"]["billing.charge_invoice"]
    assert n <= charges <= n + 1 < report["jobs_by_task"]["billing.charge_invoice"]
    assert report["killed"] is not None and report["takeovers"] <= 1
    assert report["catalog_overlaps"] == 0
    assert "OK: no invoice charged twice, no job lost." in proc.stdout
    assert f"SIGKILL -> worker child {report['killed']['pid']}" in proc.stdout
    for pid in report["processes"]:  # the demo left nothing running
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert report["run"] not in cmdline and "valkey" not in cmdline, f"process {pid} outlived the demo"


def test_demo_on_embedded_valkey_and_sqlite(tmp_path: Path) -> None:
    proc, report = run_demo(tmp_path)
    check(proc, report)
    assert "embedded Valkey" in proc.stdout and "ledger: SQLite" in proc.stdout


def test_demo_on_the_shared_redis_and_postgresql(tmp_path: Path, redis_url: str, postgres_url: str) -> None:
    import psycopg
    import redis

    proc, report = run_demo(tmp_path, LOCKGUARD_REDIS_URL=redis_url, DATABASE_URL=postgres_url)
    check(proc, report)
    assert "ledger: PostgreSQL" in proc.stdout
    # It cleaned up after itself: no keys under its prefix, no schema.
    assert not list(redis.Redis.from_url(redis_url).scan_iter(match=f"demo-{report['run']}*", count=1000))
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT 1 FROM pg_namespace WHERE nspname = %s", (f"billing_demo_{report['run']}",)
        ).fetchone()
    assert row is None


def test_report_fails_on_a_double_charge_a_missing_charge_and_a_lost_job() -> None:
    report = build_report(
        jobs=[("billing.charge_invoice", (1, 100)), ("billing.charge_invoice", (2, 200))],
        ids=["a", "b"],
        states={"a": "SUCCESS"},
        invoices=[1, 2, 3],
        events={"lock.acquired": Counter({"billing.charge_invoice": 3})},
        ledger={
            "charges": {1: 2, 2: 1},
            "provider_calls": {1: 2, 2: 1},
            "postings": {1: 1, 2: 1},
            "emails": {1: 1, 2: 1},
            "tenant_pages": {},
            "catalog_runs": [(1.0, 3.0), (2.0, 4.0)],
        },
        killed=None,
        elapsed=1.0,
    )
    assert not report["ok"]
    assert report["jobs_lost"] == 1 and report["charges_per_invoice"] == {"0": 1, "1": 1, "2": 1}
    problems = " | ".join(report["problems"])
    for needle in ("1 jobs never finished", "charged more than once: [1]", "never charged: [3]", "overlapped"):
        assert needle in problems
