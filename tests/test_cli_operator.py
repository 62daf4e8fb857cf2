"""What an operator reads: forced releases apart from expiries, counts that agree, logs off stdout, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_lockguard import LockedTask
from celery_lockguard import _connection as connection
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard import _stats as stats
from celery_lockguard._config import reset
from celery_lockguard._keys import lock_name

from .harness import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("operator", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    yield a
    connection.forget_clients()


def invoke(app: Celery, *args: str) -> Result:
    from celery_lockguard._cli import lockguard

    reset(app)
    return CliRunner().invoke(lockguard, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))


def _count(r: redis.Redis, prefix: str, task: str, counts: dict[str, int]) -> None:
    for name, n in counts.items():
        metrics.count(task, name, n)
    metrics.flush(r, prefix)


def test_a_forced_release_is_not_read_as_an_expiry(app: Celery, r: redis.Redis, prefix: str) -> None:
    # The operator evicts a holder; the holder's own release then finds its lease gone and counts
    # lock.expired_before_release. stats read that as "expired-lock rate 100%, the TTL is too short".
    L.acquire(
        r, prefix, "acct:1", ttl_ms=60_000, task_id="t-1", task_name="ledger.post", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert invoke(app, "release", "acct:1", "--yes").exit_code == 0
    _count(r, prefix, "ledger.post", {"lock.acquired": 1, "lock.lost": 1, "lock.expired_before_release": 1})
    summary = json.loads(invoke(app, "stats", "--json").stdout)
    total = summary["tasks"]["ledger.post"]["windows"]["total"]
    assert (total["expired"], total["expired_rate"], total["force_released"]) == (0, 0.0, 1)
    readings = summary["tasks"]["ledger.post"]["readings"]
    assert not [x for x in readings if "TTL is too short" in x], readings
    assert "1 lease was force-released (1 by an operator, not counted as expired)" in readings
    text = invoke(app, "stats").stdout
    assert "FORCED" in text and "EXPIRED" in text


def test_completion_skips_are_in_the_stats_text(app: Celery, r: redis.Redis, prefix: str) -> None:
    _count(r, prefix, "billing.charge", {"lock.acquired": 2, "lock.released": 2, "completion.skipped": 3})
    text = invoke(app, "stats").stdout
    header = next(line for line in text.splitlines() if line.startswith("WINDOW"))
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert "FROM RECORD" in header, header
    assert total[header.index("FROM RECORD") :].split()[0] == "3", (header, total)
    assert "3 calls answered from the completion record" in text


def test_readings_agree_with_their_counts() -> None:
    now = time.time()
    raw = {
        "now": now,
        "total": {
            "@first_flush_at": str(now - 600),
            "t|lock.acquired": "1",
            "t|lock.skipped_duplicate": "1",
            "t|lock.expired_before_release": "1",
            "t|lock.released": "0",
            "t|lock.max_hold_reached": "1",
            "t|lock.fail_open": "1",
            "t|lock.wait_budget_exhausted": "1",
            "t|lock.force_released": "1",
        },
        "minutes": {},
    }
    readings = " | ".join(stats.summarize(raw)["tasks"]["t"]["readings"])
    for phrase in (
        "1 duplicate skipped",
        "2 leases ended by expiry or max-hold",
        "1 lease expired before release",
        "1 call gave up",
        "1 lease reached lock_max_hold",
        "1 body ran with no lock",
        "1 lease was force-released",
    ):
        assert phrase in readings, (phrase, readings)
    assert "1 leases" not in readings and "1 duplicates" not in readings and "1 bodies" not in readings


def test_doctor_exits_78_for_an_invalid_option_and_an_invalid_setting(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="op.bad", lock_key="k:{n}", on_locked="sometimes")
    def bad(self: Any, n: int) -> None: ...

    out = invoke(app, "doctor")
    assert out.exit_code == 78, out.output
    assert "[configuration]" in out.stdout and "on_locked='sometimes'" in out.stdout
    app.conf.lockguard_on_unavailable = "shrug"
    assert invoke(app, "doctor").exit_code == 78


APP_MODULE = """
import logging, os, sys
from celery import Celery

app = Celery("logapp", broker=os.environ["LG_REDIS"])
app.conf.lockguard_key_prefix = os.environ["LG_PREFIX"]
if os.environ["LG_LOGS"] == "structlog":
    import structlog  # structlog's default PrintLogger writes to stdout
    structlog.configure()
    app.conf.lockguard_log_backend = "structlog"
else:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO)  # a container's usual set-up
"""


@pytest.mark.parametrize("logs", ["logging", "structlog"])
def test_release_prints_its_result_on_stdout_and_its_log_line_on_stderr(
    r: redis.Redis, redis_url: str, prefix: str, tmp_path: Path, logs: str
) -> None:
    (tmp_path / "logapp.py").write_text(textwrap.dedent(APP_MODULE))
    L.acquire(
        r, prefix, "acct:2", ttl_ms=60_000, task_id="t-2", task_name="ledger.post", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    env = {**os.environ, "LG_REDIS": redis_url, "LG_PREFIX": prefix, "LG_LOGS": logs}
    env["PYTHONPATH"] = f"{tmp_path}:{ROOT}"
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "logapp", "lockguard", "release", "acct:2", "--yes"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert "released 'acct:2'" in out.stdout and not r.exists(lock_name(prefix, "acct:2"))
    assert "lock.force_released" not in out.stdout, out.stdout
    assert "lock.force_released" in out.stderr


def quickstart(page: str) -> str:
    """The first python sample of ``page``: the app a new user copies."""
    import re

    text = (ROOT / page).read_text()
    if page.endswith("index.md"):
        text = text[text.index("## Quickstart") :]
    found = re.search(r"```python\n(.*?)```", text, re.S)
    assert found, page
    return found.group(1)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_doctor_passes_the_app_the_quickstart_sets_up(
    page: str, store: str, own_redis: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Tried as a new user would: doctor failed the quickstart's own app (fail_closed_shares_broker: no acks_late).
    (tmp_path / "quickstart.py").write_text(quickstart(page))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_", "DATABASE_URL", "REDIS_URL"))}
    env.update(REDIS_URL=own_redis.url, PYTHONPATH=f"{tmp_path}:{ROOT}")
    schema = None
    if store == "postgres":
        import uuid
        from urllib.parse import quote

        import psycopg

        dsn = request.getfixturevalue("postgres_url")
        schema = f"qs_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        env["DATABASE_URL"] = f"{dsn}{'&' if '?' in dsn else '?'}options={quote(f'-csearch_path={schema}')}"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "quickstart", "lockguard", "doctor"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        described = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "quickstart", "lockguard", "describe", "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        if schema:
            import psycopg

            with psycopg.connect(request.getfixturevalue("postgres_url"), autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "lockguard doctor: no findings", out.stdout  # (after what the sample prints)
    (row,) = json.loads(described.stdout[described.stdout.index("[\n") :])
    assert row["acks_late"] is True and row["on_locked"] == "skip"
    assert row["completion_store"].startswith("postgresql" if store == "postgres" else "redis")


def test_no_command_prints_a_password(app: Celery, r: redis.Redis, prefix: str, postgres_url: str) -> None:
    from celery_lockguard.testing import free_port

    @app.task(base=LockedTask, bind=True, shared=False, name="op.t", lock_key="k:{n}")
    def t(self: Any, n: int) -> None: ...

    app.conf.lockguard_redis_url = f"redis://127.0.0.1:{free_port()}/0?password=hunter2"
    for args in (("describe",), ("doctor",), ("doctor", "--json"), ("locks",), ("stats",)):
        out = invoke(app, *args)
        assert "hunter2" not in out.output and "password=***" in out.output, (args, out.output)
    app.conf.lockguard_completion_backend = "postgressql://app:hunter2@db/billing"  # a mistyped scheme
    for args in (("describe",), ("doctor",), ("locks",)):
        out = invoke(app, *args)
        assert out.exit_code == 78 and "hunter2" not in out.output, (args, out.output)
    app.conf.lockguard_redis_url = None
    app.conf.lockguard_completion_backend = postgres_url.replace("postgres@", "postgres:hunter2%ZZ@", 1)
    out = invoke(app, "completions", "show", "s")
    assert out.exit_code == 69 and "hunter2" not in out.output, out.output
    L.acquire(
        r, prefix, "k:1", ttl_ms=60_000, task_id="t", task_name="op.t", digest="d", worker="w", fence_ttl_ms=60_000
    )
    out = invoke(app, "release", "k:1", "--yes", "--fence-dsn", "postgresql://u:hunter2%ZZ@127.0.0.1/test")
    assert out.exit_code == 69 and "nothing was released" in out.output and "hunter2" not in out.output, out.output
