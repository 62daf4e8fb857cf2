"""``celery -A tests.workerapp:app lockguard ...`` as a subprocess, against real Redis and real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._keys import fence_name, lock_name
from celery_lockguard.testing import RedisServer, free_port

from .conftest import make_cfg
from .harness import ROOT, wait_for

pytestmark = pytest.mark.integration


def cli_env(cfg: dict[str, Any]) -> dict[str, str]:
    return {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)}


def cli(cfg: dict[str, Any], *args: str, input: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.workerapp:app lockguard ARGS`` as an operator would."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "lockguard", *args],
        cwd=ROOT,
        env=cli_env(cfg),
        input=input,
        capture_output=True,
        text=True,
        timeout=90,
    )


def cli_json(cfg: dict[str, Any], *args: str, code: int = 0) -> Any:
    out = cli(cfg, *args, "--json")
    assert out.returncode == code, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout)


def test_help_usage_and_bad_settings_exit_codes(redis_url: str, prefix: str) -> None:
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "--help")
    assert out.returncode == 0
    for command in ("locks", "release", "stats", "describe", "doctor", "completions", "exporter"):
        assert command in out.stdout
    out = cli(cfg, "locks", "--help")
    assert out.returncode == 0 and "--match" in out.stdout and "--json" in out.stdout
    assert cli(cfg, "no-such-command").returncode == 2
    bad = cli(make_cfg(prefix, redis_url, on_unavailable="sometimes"), "locks")
    assert bad.returncode == 78 and "lockguard_on_unavailable" in bad.stderr


def test_locks_and_release_while_a_worker_holds_the_lease(
    fleet: Any, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=0.5)
    worker = fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key, gate = f"k-{uuid.uuid4().hex[:6]}", tmp_path / "gate"
    name = lock_name(prefix, f"res:{key}")
    res = app.tasks["hold_gate"].delay(key, str(gate), "held")
    try:
        wait_for(lambda: r.exists(name), 30, what="the worker to take the lease")
        queued = L.acquire(
            r,
            prefix,
            f"claim:{key}",
            ttl_ms=60_000,
            task_id="queued-1",
            task_name="hold_skip",
            digest="d",
            worker="",
            fence_ttl_ms=60_000,
            state="queued",
        )
        assert isinstance(queued, L.Lease)

        rows = {row["key"]: row for row in cli_json(cfg, "locks")}
        held = rows[f"res:{key}"]
        assert held["task_name"] == "hold_gate" and held["task_id"] == res.id
        assert held["worker"] == worker.nodename and held["state"] == "running"
        assert held["fence"] == int(r.hget(name, "fence") or 0) > 0
        assert 0 < held["ttl_left_ms"] <= 5000 and held["lease_ttl_ms"] == 5000
        assert held["held_for_ms"] >= 0 and held["redis_key"] == name
        assert rows[f"claim:{key}"]["state"] == "queued" and rows[f"claim:{key}"]["task_id"] == "queued-1"

        only = cli_json(cfg, "locks", "--match", f"res:{key}*")
        assert [row["key"] for row in only] == [f"res:{key}"]
        table = cli(cfg, "locks", "--match", f"res:{key}*")
        assert table.returncode == 0 and f"res:{key}" in table.stdout and "hold_gate" in table.stdout

        # Asked, and the operator says no: nothing changes.
        no = cli(cfg, "release", f"res:{key}", input="n\n")
        assert no.returncode == 1 and "Aborted" in no.stderr
        assert r.hget(name, "task_id") == res.id

        old_fence = int(r.get(fence_name(prefix, f"res:{key}")) or 0)
        done = cli(cfg, "release", name, "--yes")  # the full Redis key is accepted too
        assert done.returncode == 0, done.stderr
        assert "released" in done.stdout and res.id in done.stdout
        assert not r.exists(name)
        assert int(r.get(fence_name(prefix, f"res:{key}")) or 0) > old_fence
        assert r.hget(metrics.total_key(prefix), "hold_gate|lock.force_released") == "1"

        missing = cli(cfg, "release", f"res:{key}", "--yes")
        assert missing.returncode == 1 and "no lease" in missing.stderr
    finally:
        gate.touch()
    out = res.get(timeout=30)
    assert out["tag"] == "held"
    assert not r.exists(name), "the evicted holder's release must not touch the key"
    # The evicted holder's release found its lease gone and counted an expiry: stats must not blame the TTL.
    wait_for(
        lambda: r.hget(metrics.total_key(prefix), "hold_gate|lock.expired_before_release") == "1",
        20,
        what="the worker to flush the holder's expiry",
    )
    gate = cli_json(cfg, "stats")["tasks"]["hold_gate"]
    total = gate["windows"]["total"]
    assert (total["expired"], total["expired_rate"], total["force_released"]) == (0, 0.0, 1)
    assert not [x for x in gate["readings"] if "TTL is too short" in x], gate["readings"]


@pytest.fixture(params=["redis", "postgres"])
def completion_cfg(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if request.param == "redis":
        yield {}
        return
    dsn = request.getfixturevalue("postgres_url")
    table = f"lgt_{uuid.uuid4().hex[:8]}_completions"
    yield {"completion_backend": dsn, "completion_table": table}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def test_completions_show_and_forget(fleet: Any, redis_url: str, prefix: str, completion_cfg: dict[str, Any]) -> None:
    cfg = make_cfg(prefix, redis_url, **completion_cfg)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    order = uuid.uuid4().int % 10**9
    res = app.tasks["idem_step"].delay(order)
    assert res.get(timeout=30) == {"order": order, "charged": 1}
    # The record answers idem_step only: --task names it (issue 29 item 7); the stored scope works too.
    assert cli(cfg, "completions", "show", f"order:{order}").returncode == 1
    assert cli_json(cfg, "completions", "show", f"by:idem_step:order:{order}")["record"]["task_id"] == res.id
    scope, task_opt = f"order:{order}", ("--task", "idem_step")

    shown = cli_json(cfg, "completions", "show", scope, *task_opt)
    record = shown["record"]
    assert {k: record[k] for k in ("task_id", "task", "result")} == {
        "task_id": res.id,
        "task": "idem_step",
        "result": {"order": order, "charged": 1},
    }
    assert len(record["digest"]) == 16  # the arguments digest: a reused key with other arguments is told apart
    assert shown["checkpoints"] == {"charge": {"value": 1}}
    assert shown["record_ttl_ms"] > 0
    text = cli(cfg, "completions", "show", scope, *task_opt)
    assert text.returncode == 0 and f"completed by {res.id}" in text.stdout and "checkpoint charge: 1" in text.stdout

    assert cli(cfg, "completions", "forget", scope, *task_opt, input="n\n").returncode == 1
    assert cli_json(cfg, "completions", "show", scope, *task_opt)["record"] is not None
    forgot = cli(cfg, "completions", "forget", scope, *task_opt, "--yes")
    assert forgot.returncode == 0, forgot.stderr
    assert cli(cfg, "completions", "show", scope, *task_opt).returncode == 1
    assert cli(cfg, "completions", "forget", scope, *task_opt, "--yes").returncode == 1
    # Forgotten: the same work runs again (and its checkpoint too).
    again = app.tasks["idem_step"].delay(order)
    assert again.get(timeout=30) == {"order": order, "charged": 2}


def test_stats_show_the_four_numbers_after_real_work(fleet: Any, redis_url: str, prefix: str, tmp_path: Path) -> None:
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=0.5)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key, gate = f"k-{uuid.uuid4().hex[:6]}", tmp_path / "gate"
    first = app.tasks["hold_gate"].delay(key, str(gate), "a")
    try:
        wait_for(lambda: r.exists(lock_name(prefix, f"res:{key}")), 30, what="the first copy to hold the lease")
        duplicate = app.tasks["hold_gate"].delay(key, str(gate), "a")
        assert duplicate.get(timeout=30) is None
    finally:
        gate.touch()
    assert first.get(timeout=30)["held"] is True
    expired = app.tasks["no_renew"].delay(f"e-{key}", 2.0)  # ttl 1 s, no renewal, a 2 s body
    assert expired.get(timeout=30)["lost"] is True

    def flushed() -> bool:
        total = r.hgetall(metrics.total_key(prefix))
        return (
            total.get("hold_gate|hold.count") == "1"
            and total.get("hold_gate|lock.skipped_duplicate") == "1"
            and total.get("no_renew|lock.expired_before_release") == "1"
        )

    wait_for(flushed, 20, what="the worker's periodic flush")

    summary = cli_json(cfg, "stats")
    gate_stats = summary["tasks"]["hold_gate"]
    assert gate_stats["key_template"] == "res:{key}"
    for window in ("5m", "total"):
        w = gate_stats["windows"][window]
        assert w["acquisitions"] == 1 and w["contended"] == 1 and w["contention_rate"] == 0.5
        assert w["skipped_duplicates"] == 1 and w["avg_hold_ms"] > 0 and w["expired_rate"] == 0
        assert w["acquisition_rate_per_min"] > 0
    assert any(x.startswith("1 duplicate skipped") and "stuck" in x for x in gate_stats["readings"])
    nr = summary["tasks"]["no_renew"]["windows"]["total"]
    assert nr["expired"] == 1 and nr["expired_rate"] == 1.0
    assert any("TTL is too short" in x for x in summary["tasks"]["no_renew"]["readings"])

    text = cli(cfg, "stats")
    assert text.returncode == 0 and "hold_gate" in text.stdout and "CONTENTION" in text.stdout
    # What a process holds now is shown under its task (a gauge as a flush writes it).
    row = {"task": "hold_gate", "worker": "w1@h", "held": 2, "oldest_acquired_at": time.time() - 7}
    r.set(metrics.proc_key(prefix, "h:1"), json.dumps({"at": time.time(), "ttl": 60, "held": [row]}))
    r.zadd(metrics.procs_key(prefix), {"h:1": time.time()})
    text = cli(cfg, "stats")
    assert "held now: 2 on w1@h (oldest " in text.stdout
    assert cli_json(cfg, "stats")["tasks"]["hold_gate"]["held_now"]["w1@h"]["held"] == 2
    prom = cli(cfg, "stats", "--prometheus")
    assert prom.returncode == 0
    assert 'lockguard_events_total{task="hold_gate",event="lock.acquired"} 1' in prom.stdout.splitlines()
    assert 'lockguard_hold_seconds_count{task="hold_gate"} 1' in prom.stdout.splitlines()


def test_describe_is_the_lock_inventory(redis_url: str, prefix: str) -> None:
    cfg = make_cfg(prefix, redis_url)
    rows = {row["task"]: row for row in cli_json(cfg, "describe")}
    hold = rows["hold_skip"]
    assert hold["key_template"] == "res:{key}" and hold["ttl"] == 5 and hold["renew"] is True
    assert hold["renew_every"] == pytest.approx(5 / 3, abs=0.01) and hold["max_hold"] == 3600
    assert (hold["mode"], hold["on_locked"], hold["on_unavailable"]) == ("while_running", "skip", "fail_closed")
    assert hold["completion_scope"] == "task id" and hold["completion_store"] == "redis"
    assert rows["hold_wait"]["on_locked"] == "retry" and rows["hold_raise"]["on_locked"] == "raise"
    assert rows["limited"]["max_hold"] == 1.5
    assert rows["no_renew"]["renew"] is False and rows["no_renew"]["renew_every"] is None
    assert rows["idem_effect"]["completion_scope"] == "inv:{invoice_id}"
    assert rows["idem_effect"]["completion_ttl"] == 86400
    assert rows["gated"]["key_template"].startswith("<callable")
    assert rows["crash_once"]["acks_late"] is True
    md = cli(cfg, "describe")
    assert md.returncode == 0
    assert "| `hold_skip` | `res:{key}` | 5s | every 1.667s | 3600s | while_running | skip | fail_closed |" in md.stdout


def codes(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["code"]: f for f in report["findings"]}


def test_doctor_passes_a_sound_setup(own_redis: RedisServer, redis_url: str, prefix: str) -> None:
    cfg = make_cfg(prefix, redis_url, lock_url=own_redis.url)  # locks on their own noeviction Redis
    assert cli_json(cfg, "doctor") == {"ok": True, "findings": []}
    plain = cli(cfg, "doctor")
    assert plain.returncode == 0 and "no findings" in plain.stdout


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_doctor_flags_an_evicting_lock_redis(policy: str, redis_url: str, prefix: str) -> None:
    with RedisServer(extra=["--maxmemory-policy", policy]) as server:
        cfg = make_cfg(prefix, redis_url, lock_url=server.url)
        found = codes(cli_json(cfg, "doctor", code=1))
    assert set(found) == {"maxmemory_policy"}
    message = found["maxmemory_policy"]["message"]
    assert f"maxmemory-policy={policy}" in message and "noeviction" in message
    if policy.startswith("volatile"):
        assert "evicts exactly them" in message


def test_doctor_reports_evictions_that_already_happened(redis_url: str, prefix: str) -> None:
    with RedisServer(extra=["--maxmemory-policy", "allkeys-lru", "--maxmemory", "2mb"]) as server:
        client = server.client()
        for i in range(64):
            client.set(f"{prefix}:filler:{i}", "x" * 65536)  # 4 MiB into a 2 MiB server
        assert int(client.info("stats")["evicted_keys"]) > 0
        found = codes(cli_json(make_cfg(prefix, redis_url, lock_url=server.url), "doctor", code=1))
    assert set(found) == {"maxmemory_policy", "evictions"}
    assert "has evicted" in found["evictions"]["message"]


def test_doctor_reports_an_unreachable_redis(redis_url: str, prefix: str) -> None:
    cfg = make_cfg(prefix, redis_url, lock_url=f"redis://:secret@127.0.0.1:{free_port()}/0")
    out = cli(cfg, "doctor")
    assert out.returncode == 69
    assert "[redis_unreachable]" in out.stdout and "secret" not in out.stdout
    assert cli(cfg, "locks").returncode == 69


def test_doctor_flags_risky_task_settings_and_cache_traffic(own_redis: RedisServer, prefix: str) -> None:
    server = own_redis.client()
    for i in range(40):
        server.set(f"cache:user:{i}", "x", ex=600)
    db3 = redis.Redis(host="127.0.0.1", port=own_redis.port, db=3)
    for i in range(30):
        db3.set(f"session:{i}", "x")
    cfg = make_cfg(prefix, own_redis.url, soft_time_limit=5)  # broker and locks on one Redis, no acks_late
    found = codes(cli_json(cfg, "doctor", code=1))
    assert set(found) == {"fail_closed_shares_broker", "ttl_below_time_limit", "cache_traffic", "shared_server"}
    sharing = found["fail_closed_shares_broker"]["tasks"]
    assert "hold_skip" in sharing and "crash_once" not in sharing  # crash_once is acks_late
    assert found["ttl_below_time_limit"]["tasks"] == ["no_renew"]
    assert "soft time limit (5s)" in found["ttl_below_time_limit"]["message"]
    assert "cache:user:" in found["cache_traffic"]["message"]
    assert "db3 (30 keys)" in found["shared_server"]["message"]


def test_doctor_flags_a_visibility_timeout_shorter_than_a_time_limit(own_redis: RedisServer, prefix: str) -> None:
    cfg = make_cfg(prefix, own_redis.url, acks_late=True, visibility_timeout=1)
    found = codes(cli_json(cfg, "doctor", code=1))
    assert set(found) == {"visibility_timeout_below_time_limit"}
    assert found["visibility_timeout_below_time_limit"]["tasks"] == ["limited"]


def test_exporter_serves_prometheus_text(redis_url: str, prefix: str) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    metrics.count("exp.task", "lock.acquired", 3)
    metrics.observe_hold("exp.task", 20)
    metrics.count("hold_skip", "lock.contended", 2)  # a task of the exporter's app: its template is known
    metrics.count("hold_wait", "lock.acquired", 5)  # the same template, another task
    metrics.flush(r, prefix)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "lockguard", "exporter", "--port", str(port)],
        cwd=ROOT,
        env=cli_env(make_cfg(prefix, redis_url)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def scrape() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                    return str(resp.read().decode())
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, "the exporter exited"
                return None

        lines = wait_for(scrape, 30, interval=0.2, what="the exporter to answer").splitlines()
        assert 'lockguard_events_total{task="exp.task",event="lock.acquired"} 3' in lines
        assert 'lockguard_hold_seconds_bucket{task="exp.task",le="0.05"} 1' in lines
        assert 'lockguard_hold_seconds_bucket{task="exp.task",le="0.01"} 0' in lines
        assert 'lockguard_template_contended_total{template="res:{key}"} 2' in lines
        assert 'lockguard_template_acquired_total{template="res:{key}"} 5' in lines
        assert 'lockguard_template_acquired_total{template="unknown"} 3' in lines, "exp.task is not in the app"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=2)
        assert err.value.code == 404
    finally:
        proc.terminate()
        proc.wait(10)


# -- release and the fence table ------------------------------------------------------------


@pytest.fixture
def fence_table(postgres_url: str) -> Iterator[str]:
    from celery_lockguard import create_fence_table

    table = f"lgt_{uuid.uuid4().hex[:8]}_fences"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        create_fence_table(conn, table)
    yield table
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def _held(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    got = L.acquire(
        r, prefix, key, ttl_ms=60_000, task_id="t-old", task_name="ledger.post", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    return got


def test_release_with_a_fence_dsn_makes_the_evicted_holders_fenced_write_fail(
    redis_url: str, prefix: str, postgres_url: str, fence_table: str
) -> None:
    from celery_lockguard import StaleFence, advance_fence

    cfg = make_cfg(prefix, redis_url)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"acct:{uuid.uuid4().hex[:6]}"
    old = _held(r, prefix, key)
    with psycopg.connect(postgres_url) as conn:
        with conn.transaction():  # the holder's fenced write, before the operator steps in
            assert advance_fence(conn, old, fence_table) == old.fence

        done = cli(cfg, "release", key, "--yes", "--fence-dsn", postgres_url, "--fence-table", fence_table)
        assert done.returncode == 0, done.stderr
        new_fence = int(r.get(fence_name(prefix, key)) or 0)
        assert new_fence > old.fence and f"fence is now {new_fence}" in done.stdout
        assert f"fence {new_fence} written to {fence_table}" in done.stdout and "raises StaleFence" in done.stdout
        assert "Redis only" not in done.stdout

        # The evicted holder wakes up and writes again with its old lease: refused at once.
        with pytest.raises(StaleFence) as err, conn.transaction():
            advance_fence(conn, old, fence_table)
        assert (err.value.fence, err.value.current) == (old.fence, new_fence)

        # A newer holder still writes: its fence comes after the bumped one.
        newer = _held(r, prefix, key)
        with conn.transaction():
            assert advance_fence(conn, newer, fence_table) == newer.fence > new_fence


def test_release_without_a_fence_dsn_says_the_evicted_holder_can_still_write(
    redis_url: str, prefix: str, postgres_url: str, fence_table: str
) -> None:
    from celery_lockguard import advance_fence

    cfg = make_cfg(prefix, redis_url)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"acct:{uuid.uuid4().hex[:6]}"
    old = _held(r, prefix, key)
    asked = cli(cfg, "release", key, input="n\n")
    assert "stay accepted until a newer holder writes" in asked.stdout
    done = cli(cfg, "release", key, "--yes")
    assert done.returncode == 0, done.stderr
    assert "in Redis only" in done.stdout and "is still accepted by storage" in done.stdout
    assert "--fence-dsn" in done.stdout
    with psycopg.connect(postgres_url) as conn, conn.transaction():
        assert advance_fence(conn, old, fence_table) == old.fence  # exactly what the message says


def test_release_checks_the_fence_databases_before_releasing_anything(
    redis_url: str, prefix: str, postgres_url: str, fence_table: str
) -> None:
    cfg = make_cfg(prefix, redis_url)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"acct:{uuid.uuid4().hex[:6]}"
    _held(r, prefix, key)
    missing = cli(cfg, "release", key, "--yes", "--fence-dsn", postgres_url, "--fence-table", "lgt_no_such_fences")
    assert missing.returncode == 78 and "no fence table 'lgt_no_such_fences'" in missing.stderr
    dead = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/test"
    down = cli(cfg, "release", key, "--yes", "--fence-dsn", dead, "--fence-table", fence_table)
    assert down.returncode == 69 and "unreachable" in down.stderr and "secret" not in down.stderr
    assert "nothing was released" in missing.stderr and "nothing was released" in down.stderr
    assert r.hget(lock_name(prefix, key), "task_id") == "t-old"


def test_release_takes_the_fence_databases_from_lockguard_fence_dsn(
    redis_url: str, prefix: str, postgres_url: str, fence_table: str
) -> None:
    from celery import Celery
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lockguard import StaleFence, advance_fence
    from celery_lockguard._cli import lockguard

    app = Celery("fenced", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_fence_dsn = [postgres_url]
    app.conf.lockguard_fence_table = fence_table
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"acct:{uuid.uuid4().hex[:6]}"
    old = _held(r, prefix, key)
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["release", key, "--yes"], obj=obj)
    assert out.exit_code == 0, out.output
    assert f"written to {fence_table}" in out.output
    with psycopg.connect(postgres_url) as conn, pytest.raises(StaleFence), conn.transaction():
        advance_fence(conn, old, fence_table)


def test_completions_respect_the_apps_prefix(redis_url: str, prefix: str, postgres_url: str) -> None:
    from celery_lockguard._completion import PostgresStore

    table = f"lgt_{uuid.uuid4().hex[:8]}_completions"
    other = f"lgt:{uuid.uuid4().hex[:10]}"
    try:
        PostgresStore(postgres_url, table, namespace=other).record("order:7", "t-other", '{"result":1}', 60_000)
        mine = make_cfg(prefix, redis_url, completion_backend=postgres_url, completion_table=table)
        theirs = make_cfg(other, redis_url, completion_backend=postgres_url, completion_table=table)
        assert cli(mine, "completions", "show", "order:7").returncode == 1
        assert cli(mine, "completions", "forget", "order:7", "--yes").returncode == 1
        shown = cli_json(theirs, "completions", "show", "order:7")
        assert shown["record"] == {"result": 1} and other in shown["store"]
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def test_locks_and_describe_show_debounced_runs(redis_url: str, prefix: str) -> None:
    from .workerapp import create_app

    cfg = make_cfg(prefix, redis_url, debounce=30)
    t = create_app(cfg).tasks["debounced"]
    key = uuid.uuid4().hex[:6]
    burst = [t.delay(key, 0.1, f"edit-{i}") for i in range(3)]  # no worker: the run stays pending
    rows = [row for row in cli_json(cfg, "locks") if row["state"] == "debounce"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["key"], row["task_name"], row["task_id"]) == (f"res:{key}", "debounced", burst[-1].id)
    assert row["superseded"] == 2 and 0 < row["due_in_ms"] <= 30_000 and row["last_run"] is None
    assert row["debounce_state"] in ("publishing", "queued") and row["ttl_left_ms"] > 30_000
    table = cli(cfg, "locks", "--match", f"res:{key}")
    assert table.returncode == 0 and "DEBOUNCED KEY" in table.stdout and burst[-1].id in table.stdout
    described = {r["task"]: r for r in cli_json(cfg, "describe")}
    assert described["debounced"]["debounce"] == 30 and described["hold_skip"]["debounce"] is None
    assert "while_running, debounce 30s" in cli(cfg, "describe").stdout


def test_locks_shows_no_worker_for_a_woken_waiters_reservation(redis_url: str, prefix: str) -> None:
    """A reservation RELEASE made for a woken waiter has no process yet (host '', pid 0): WORKER reads ``-``."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"res:{uuid.uuid4().hex[:6]}"
    name = lock_name(prefix, key)
    now = int(time.time() * 1000)
    # what RELEASE's wake writes (_scripts._WAKE_OLDEST)
    r.hset(name, mapping={"token": "p1", "task_id": "t-woken", "task_name": "hold_skip", "digest": "",
                          "host": "", "pid": 0, "worker": "", "state": "handed", "acquired_at": now,
                          "renewed_at": now, "ttl": 30_000, "fence": ""})  # fmt: skip
    r.pexpire(name, 30_000)
    try:
        cfg = make_cfg(prefix, redis_url)
        table = cli(cfg, "locks", "--match", key)
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if "t-woken" in line)
        assert ":0" not in row and " - " in row, row
    finally:
        r.delete(name)
