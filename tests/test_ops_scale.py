"""Operator surfaces at scale (issue 30): cost follows the rows shown, not the leases held.

``lockguard locks`` shows the first ``--limit`` rows (most deliveries waiting, then the longest held) and
says how many there are; ``--all`` streams every one. The page's sampler reads no lease while nobody views
the page. Real Redis (the shared server under the test's prefix, or a private one where Redis's own
command counts or DBSIZE are read), the real CLI and exporter as subprocesses.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
import redis

from celery_lockguard import _holders as holders
from celery_lockguard._keys import lock_name, wait_name
from celery_lockguard.testing import RedisServer, free_port

from .conftest import make_cfg
from .harness import ROOT, wait_for
from .test_cli import cli, cli_env
from .test_page import LOCKGUARD

pytestmark = pytest.mark.integration

N = 120


def plant(r: redis.Redis, prefix: str, n: int, first: int = 0, state: str = "running") -> None:
    """``n`` held leases as ACQUIRE writes them; lease i was acquired i minutes ago (e:0119 is the oldest).
    ``state="queued"``: ``until_done`` queue claims in the lease hash instead."""
    sec, usec = r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    pipe = r.pipeline(transaction=False)
    for i in range(first, first + n):
        name = lock_name(prefix, f"e:{i:04d}")
        pipe.hset(
            name,
            mapping={
                "token": f"tok-{i}", "task_id": f"t-{i}", "task_name": "ops.task", "digest": "d", "host": "h",
                "pid": "1", "worker": "w@h", "state": state, "acquired_at": str(now - i * 60_000),
                "renewed_at": str(now), "ttl": "600000", "fence": str(i + 1),
            },
        )  # fmt: skip
        pipe.pexpire(name, 600_000)
    pipe.execute()


def rows_of(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("e:")]


def test_locks_shows_the_first_rows_and_how_many_there_are(r: redis.Redis, redis_url: str, prefix: str) -> None:
    plant(r, prefix, N)
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "locks")
    assert out.returncode == 0, out.stderr
    rows = rows_of(out.stdout)
    assert len(rows) == 50, out.stdout  # the default limit
    assert f"showing 50 of {N} rows: {N} leases, 0 queue claims" in out.stdout
    # Longest held first: e:0119 (119 minutes) down to e:0070.
    assert [row.split()[0] for row in rows] == [f"e:{i:04d}" for i in range(119, 69, -1)]
    ten = cli(cfg, "locks", "--limit", "10")
    assert len(rows_of(ten.stdout)) == 10 and f"showing 10 of {N} rows: {N} leases" in ten.stdout
    data = json.loads(cli(cfg, "locks", "--json", "--limit", "5").stdout)
    assert [row["key"] for row in data] == ["e:0119", "e:0118", "e:0117", "e:0116", "e:0115"]
    assert all(row["waiting"] == 0 for row in data)


def test_locks_puts_the_most_waited_on_entity_first_and_shows_waiting(
    r: redis.Redis, redis_url: str, prefix: str
) -> None:
    plant(r, prefix, N)
    r.rpush(wait_name(prefix, "e:0003"), "park-1", "park-2", "park-3")  # young, but three deliveries wait
    r.rpush(wait_name(prefix, "e:0001"), "park-1")
    out = cli(make_cfg(prefix, redis_url), "locks", "--limit", "4")
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    assert header.split()[-1] == "WAITING", header
    rows = [row.split() for row in rows_of(out.stdout)]
    assert [(row[0], row[-1]) for row in rows] == [("e:0003", "3"), ("e:0001", "1"), ("e:0119", "-"), ("e:0118", "-")]


def test_locks_all_streams_every_lease(r: redis.Redis, redis_url: str, prefix: str) -> None:
    plant(r, prefix, N)
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "locks", "--all")
    assert out.returncode == 0, out.stderr
    assert sorted(row.split()[0] for row in rows_of(out.stdout)) == [f"e:{i:04d}" for i in range(N)]
    assert "showing" not in out.stdout
    every = json.loads(cli(cfg, "locks", "--all", "--json").stdout)
    assert sorted(row["key"] for row in every) == [f"e:{i:04d}" for i in range(N)]
    assert json.loads(cli(cfg, "locks", "--all", "--json", "--match", "none:*").stdout) == []


@pytest.fixture
def private() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def test_past_the_budget_the_rows_are_a_sample_and_the_total_an_estimate(private: RedisServer) -> None:
    r = private.client()
    plant(r, "big", 2000)
    plant(r, "big", 1000, first=2000, state="queued")  # until_done claims: a third of the rows
    sample = holders.top_leases(r, "big", "*", 5, budget=500)
    assert not sample.complete and sample.seen < 3000 and len(sample.leases) == 5
    assert 1500 <= sample.total <= 6000, sample.total  # DBSIZE is all rows here: the estimate is close
    assert sample.total * 0.15 <= sample.claims <= sample.total * 0.6, (sample.claims, sample.total)
    line = sample.summary(5)
    assert f"of about {sample.total} rows (about {sample.total - sample.claims} leases, {sample.claims} queue" in line
    assert "a sample of" in line
    ages = [lease.held_for_ms for lease in sample.leases]
    assert ages == sorted(ages, reverse=True)  # the oldest of what was seen, oldest first
    every = holders.top_leases(r, "big", "*", 5)
    assert every.complete and (every.total, every.claims) == (3000, 1000)
    assert [lease.key for lease in every.leases] == ["e:2999", "e:2998", "e:2997", "e:2996", "e:2995"]


def _commands(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def test_the_page_reads_no_lease_while_nobody_views_it(private: RedisServer) -> None:
    """With nobody viewing, the sampler sends no lease read (PTTL, HGETALL of leases, the scan script) for
    many intervals; the first page request wakes it and is answered with a fresh sample."""
    r = private.client()
    plant(r, "idle", 50)
    port = free_port()
    proc = subprocess.Popen(
        [*LOCKGUARD, "exporter", "--port", str(port), "--page", "--page-interval", "0.2"],
        cwd=ROOT,
        env=cli_env(make_cfg("idle", private.url)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        wait_for(lambda: "lockguard page" in proc.stdout.readline(), 60, what="the exporter to start")
        # After the first (metrics-only) sample, a window of 15 intervals. The one doctor run at start may fall
        # in it (its bounded SCAN sample, INFO): lease reads are PTTL and the scan script, which it never sends.
        wait_for(lambda: _commands(r).get("zrevrangebyscore", 0) >= 1, 30, what="the first metrics sample")
        before = _commands(r)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # 15 intervals: a sampler reading leases would have read them 15 times
            assert proc.poll() is None
            time.sleep(0.2)
        after = _commands(r)
        read = {c: after.get(c, 0) - before.get(c, 0) for c in ("pttl", "eval", "evalsha")}
        assert not any(read.values()), read
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/page/data.json", timeout=30) as resp:
            data = json.loads(resp.read())
        assert resp.status == 200 and data["lease_count"] == 50 and len(data["leases"]) == 50
        assert data["leases"][0]["key"] == "e:0049"  # longest held first
        assert _commands(r).get("pttl", 0) > after.get("pttl", 0)  # viewed: it read the leases
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_page_counts_about_past_the_sample_budget(private: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    from celery_lockguard import _page_html as html
    from celery_lockguard import _page_state as page_state
    from celery_lockguard._config import settings

    monkeypatch.setattr(holders, "SAMPLE_LEASES", 500)
    monkeypatch.setattr(page_state, "FULL_READ", 100)
    monkeypatch.setattr(page_state, "MAX_LEASES", 20)
    r = private.client()
    plant(r, "pg", 3000)
    app = Celery("scale", broker=private.url, set_as_current=False)
    app.conf.update(lockguard_redis_url=private.url, lockguard_key_prefix="pg")
    state = page_state.PageState(app, settings(app), interval=1, doctor_interval=3600)
    state.refresh()
    snap = state.snapshot
    assert not snap.lease_count_exact and len(snap.leases) == 20 and snap.lease_count > 500
    assert re.search(r'class="count">about \d+<', html.leases_section(snap))
