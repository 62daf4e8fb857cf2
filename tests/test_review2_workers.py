"""Review 2 on real prefork workers: PARK refused by the lock server (OOM: reads run, writes are refused), the
"unconfirmed" park of d8b365f crossed with a multi-entity waiter; the holder's end must still start it soon."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard.testing import RedisServer, wait_for

from .conftest import Fleet, make_cfg
from .test_workers import records

pytestmark = pytest.mark.integration

#: Seconds from the holder's end to the waiter's start: far below the holder's 30 s TTL (a safety copy).
BOUND = 5.0


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def oom_refusals(c: redis.Redis) -> int:
    return int(c.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


def test_a_multi_entity_waiter_whose_park_is_refused_runs_once_soon_after_the_holder_ends(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, lock_server: RedisServer
) -> None:
    cfg = make_cfg(prefix, redis_url, lock_url=lock_server.url)
    app = fleet.app(cfg)
    worker = fleet.worker(cfg)
    c = lock_server.client()
    a, b = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    holder = L.acquire(
        c, prefix, f"pair:{b}", ttl_ms=30_000, task_id="holder-x", task_name="ops.holder", digest="d",
        worker="w@h", fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(holder, L.Lease)
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", 1)  # every write refused (OOM), reads answered: ACQUIRE says 'held', PARK fails
    before = oom_refusals(c)
    waiter = app.tasks["multi_pair"].delay(a, b, "", "waiter")
    wait_for(lambda: oom_refusals(c) >= before + 2, 30, what="two PARKs refused (the copy came back)")
    c.config_set("maxmemory", 0)
    out = worker.output()
    assert "park: OutOfMemoryError" in out or 'reason="park: ' in out, out[-3000:]
    wait_for(lambda: c.llen(f"{prefix}:v1:{{pair:{b}}}:wait") >= 1, 30, what="the waiter parked once writes pass")
    _, _, woken = L.release_and_wake(c, holder, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    released_at = time.time()
    assert handoff.wake(app, settings(app), woken, "ops.holder", "holder-x")

    def start() -> float | None:
        rows = [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == waiter.id]
        return rows[0]["t"] if rows else None

    assert wait_for(start, BOUND + 5, what="the waiter to start") - released_at < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"
    time.sleep(1.0)  # a stray copy would start within this (its countdown is a first wait's)
    starts = [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == waiter.id]
    assert len(starts) == 1, starts
    assert not c.exists(f"{prefix}:v1:{{pair:{a}}}:lock") and not c.exists(f"{prefix}:v1:{{pair:{b}}}:lock")
