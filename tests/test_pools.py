"""Every worker pool, with real workers: exclusion, renewal, skip/wait, release, time limits.

Each pool gets two workers (``tests/poolapp.py``), each on a queue of its own so
a test decides which worker a message reaches; the workers are shared by the
pool's tests (module-scoped, parametrized: pytest runs one pool's tests, then the
next). Bodies last 2.5 s under a 1 s TTL, so a lease that is not renewed is gone
before the body ends. What ran, when, and whether the lease held is read from a
ledger every body writes to Redis under the pool's prefix.

The CPU-bound body (``spinner``) never yields: under gevent and eventlet that
starved a greenlet renewer (zero ticks, lease gone); the renewer now runs on
an OS thread there, and these tests hold it to that.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from celery_lockguard import _doctor as doctor
from celery_lockguard._keys import lock_name
from celery_lockguard.testing import Worker, delete_prefix, start_all, stop_all

from .harness import wait_for
from .poolapp import create_app

# The module's tests share a fleet per pool (a module fixture): under pytest-xdist they run in one worker,
# which starts each fleet once (make unit runs --dist loadgroup).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_pools")]

ROOT = Path(__file__).resolve().parent.parent
POOLS = ["prefork", "threads", "solo", "gevent", "eventlet"]
#: Time limits each pool enforces (celery/concurrency/*.py: gevent wraps the body in gevent.Timeout, hard only).
LIMITS = {"prefork": ("hard", "soft"), "gevent": ("hard",)}
#: Seconds a result may take: a 2.5 s body, a wait behind it and a loaded 2-core machine.
RESULT_TIMEOUT = 30


@dataclass
class PoolFleet:
    pool: str
    app: Celery
    prefix: str
    queues: tuple[str, str]
    workers: list[Worker]
    r: redis.Redis

    def send(self, task: str, key: str, seconds: float, tag: str, worker: int) -> AsyncResult:
        return self.app.send_task(f"pools.{task}", args=(key, seconds, tag), queue=self.queues[worker])

    def lock(self, key: str) -> str:
        return lock_name(self.prefix, f"res:{key}")

    def ledger(self, key: str) -> list[dict[str, Any]]:
        rows = [json.loads(x) for x in self.r.lrange(f"{self.prefix}:ledger", 0, -1)]
        return [x for x in rows if x["key"] == key]


@pytest.fixture(scope="module", params=POOLS)
def fleet(
    request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoolFleet]:
    pool = request.param
    if pool in ("gevent", "eventlet") and importlib.util.find_spec(pool) is None:
        pytest.skip(f"{pool} is not installed")
    prefix = f"lgt:{uuid.uuid4().hex[:10]}"
    queues = (f"{prefix}:q1", f"{prefix}:q2")
    cfg = {"broker": redis_url, "lock_url": redis_url, "prefix": prefix, "queue": queues[0]}
    env = {"POOLAPP_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)}
    app = create_app(cfg)
    logs = tmp_path_factory.mktemp(f"pool-{pool}")
    workers = [
        Worker(
            "tests.poolapp:app",
            control=app,
            pool=pool,
            concurrency=1 if pool == "solo" else 2,
            queues=[q],
            env=env,
            cwd=ROOT,
            log_path=logs / f"w{i}.log",
        )
        for i, q in enumerate(queues)
    ]
    start_all(workers, 60)
    try:
        yield PoolFleet(pool, app, prefix, queues, workers, redis.Redis.from_url(redis_url, decode_responses=True))
    finally:
        stop_all(workers)
        delete_prefix(redis.Redis.from_url(redis_url), prefix)


def overlapping(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    spans = sorted((x["start"], x["end"], x["tag"]) for x in rows)
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


@pytest.mark.parametrize("body", ["sleeper", "spinner"])
def test_a_renewed_lease_excludes_the_other_worker_skips_identical_work_and_makes_other_work_wait(
    fleet: PoolFleet, body: str
) -> None:
    """A 2.5 s body under a 1 s TTL on worker 1; identical and different work sent to worker 2 once the
    lease has lived past its TTL (which only renewal allows). ``spinner`` never yields: the gevent and
    eventlet case that used to starve the renewer."""
    key = f"{body}-{uuid.uuid4().hex[:6]}"
    first = fleet.send(body, key, 2.5, "same", worker=0)

    def renewed_past_its_ttl() -> bool:
        h = fleet.r.hgetall(fleet.lock(key))
        return bool(h) and int(h["renewed_at"]) - int(h["acquired_at"]) >= 1200

    wait_for(renewed_past_its_ttl, 15, what=f"{fleet.pool}/{body}: the lease renewed past its 1 s TTL")
    duplicate = fleet.send(body, key, 2.5, "same", worker=1)
    other = fleet.send("sleeper", key, 0.2, "other", worker=1)

    held = first.get(timeout=RESULT_TIMEOUT)
    assert held["lost"] is False and held["ticks"] >= 3, held
    assert held["renewer"] == ("os-thread" if fleet.pool in ("gevent", "eventlet") else "thread")
    assert duplicate.get(timeout=RESULT_TIMEOUT) is None  # skipped: identical work behind a live holder
    assert other.get(timeout=RESULT_TIMEOUT)["lost"] is False
    rows = fleet.ledger(key)
    assert sorted(x["tag"] for x in rows) == ["other", "same"]
    assert overlapping(rows) == []
    assert not fleet.r.exists(fleet.lock(key))


def test_the_lease_is_released_on_success_and_on_failure(fleet: PoolFleet) -> None:
    """Release lives in ``__call__``'s ``finally``, which runs before Celery stores the result."""
    good, bad = f"ok-{uuid.uuid4().hex[:6]}", f"bad-{uuid.uuid4().hex[:6]}"
    ok = fleet.send("sleeper", good, 0.2, "ok", worker=0)
    failed = fleet.send("failer", bad, 0.2, "bad", worker=1)
    assert ok.get(timeout=RESULT_TIMEOUT)["lost"] is False
    assert not fleet.r.exists(fleet.lock(good))
    with pytest.raises(ValueError, match="failed on purpose"):
        failed.get(timeout=RESULT_TIMEOUT)
    assert not fleet.r.exists(fleet.lock(bad))
    assert [x["tag"] for x in fleet.ledger(bad)] == ["bad"]


@pytest.mark.parametrize("limit", ["hard", "soft"])
def test_a_time_limit_frees_the_lease(fleet: PoolFleet, limit: str) -> None:
    """Bodies of 20 s under a 30 s TTL and a 1 s limit: the key must be free long before either ends."""
    if limit not in LIMITS.get(fleet.pool, ()):
        pytest.skip(f"the {fleet.pool} pool enforces no {limit} time limit (docs/pools.md)")
    key = f"{limit}-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    result = fleet.send(f"{limit}_limited", key, 20, limit, worker=0)
    if limit == "soft":
        assert result.get(timeout=RESULT_TIMEOUT)["soft_limited"] is True
        assert not fleet.r.exists(fleet.lock(key))
    else:
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=RESULT_TIMEOUT)
        # prefork: the main process shortens the lease to a grace (the child may not be dead yet);
        # gevent: gevent.Timeout is raised inside the body, so its finally releases.
        wait_for(lambda: not fleet.r.exists(fleet.lock(key)), 10, what=f"{fleet.pool}: the lease freed")
    assert time.monotonic() - started < 15


def test_a_lost_lease_is_logged_while_the_body_still_runs(fleet: PoolFleet) -> None:
    """Under gevent and eventlet lock.lost used to wait for the next task start or end (on an idle worker,
    forever): the renewer's OS thread queued it. Now it wakes the hub, so every pool logs it within a tick."""
    key = f"lost-{uuid.uuid4().hex[:6]}"
    result = fleet.send("sleeper", key, 3, "lost", worker=0)
    wait_for(lambda: fleet.r.exists(fleet.lock(key)), 15, interval=0.01, what="the lease")
    fleet.r.delete(fleet.lock(key))
    deleted = time.monotonic()
    line = re.compile(rf"lock\.lost task_name=pools\.sleeper lock_key=res:{key} .*reason=token_gone")
    wait_for(lambda: line.search(fleet.workers[0].output()), 10, what=f"{fleet.pool}: lock.lost in the log")
    assert not result.ready(), f"{fleet.pool}: lock.lost was logged only once the body ended"
    assert time.monotonic() - deleted < 1.5  # a renewal interval (~0.3 s) and a loaded machine's slack
    assert result.get(timeout=RESULT_TIMEOUT)["lost"] is True


def test_doctor_flags_a_pool_that_ignores_the_time_limit_a_lease_is_capped_by(redis_url: str) -> None:
    """threads, solo and eventlet never stop a body, gevent stops only one that yields (a CPU-bound body runs
    on, docs/pools.md); lock_max_hold defaults to its time limit anyway."""
    prefix = f"lgt:{uuid.uuid4().hex[:10]}"
    app = create_app({"broker": redis_url, "lock_url": redis_url, "prefix": prefix, "queue": prefix})
    found = {}
    pools = ["prefork", "processes", "gevent", "threads", "solo", "eventlet", "celery.concurrency.thread:TaskPool"]
    for pool in pools:
        app.conf.worker_pool = pool
        found[pool] = [f for f in doctor.run(app) if f.code == "pool_ignores_time_limit"]
    # a class path names the same pool as its alias
    assert {p for p, f in found.items() if f} == {"threads", "solo", "eventlet", "gevent", pools[-1]}
    assert found["threads"][0].tasks == found["gevent"][0].tasks == ["pools.hard_limited"]
    assert "lock_max_hold" in found["threads"][0].message
    assert "only when the body yields" in found["gevent"][0].message
    assert "CPU-bound" in found["gevent"][0].message and "lock_max_hold" in found["gevent"][0].message
    assert doctor.POOLS["gevent"]["renewer"].startswith("OS thread")
    assert doctor.POOLS["gevent"]["hard_limit_stops"] == "a body that yields"
    assert all(facts["cpu_bound_renewed"] for facts in doctor.POOLS.values())
