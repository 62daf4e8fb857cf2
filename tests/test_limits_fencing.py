"""Fences with lock_limit > 1: N legitimate holders never reject each other; a stale holder of a slot is
rejected once that slot's next holder wrote (real Redis for the fences, PostgreSQL and SQLite for storage)."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from celery_lockguard import StaleFence, advance_fence, create_fence_table
from celery_lockguard import _lease as L
from celery_lockguard.testing import RedisServer


def take(c: Any, task_id: str) -> L.Lease:
    got = L.acquire(
        c, "lg", "tenant:a", ttl_ms=30_000, task_id=task_id, task_name="exports.run", digest=task_id,
        worker="w@h", fence_ttl_ms=60_000, limit=2,
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    return got


@pytest.fixture(params=["sqlite", "postgresql"])
def conn(request: pytest.FixtureRequest, postgres_url: str) -> Iterator[tuple[Any, str]]:
    table = f"lgf_{uuid.uuid4().hex[:8]}"
    if request.param == "sqlite":
        db = sqlite3.connect(":memory:", isolation_level=None)
        create_fence_table(db, table)
        yield db, table
        db.close()
        return
    with psycopg.connect(postgres_url, autocommit=True) as pg:
        create_fence_table(pg, table)
        yield pg, table
        pg.execute(f"DROP TABLE IF EXISTS {table}")


def test_slot_holders_never_reject_each_other_and_a_stale_slot_holder_is_rejected(
    own_redis: RedisServer, conn: tuple[Any, str]
) -> None:
    db, table = conn
    c = own_redis.client()
    zero, one = take(c, "t-0"), take(c, "t-1")
    assert (zero.slot, one.slot) == (0, 1) and (zero.fence_row, one.fence_row) == ("tenant:a", "tenant:a#1")
    # Both legitimate holders write, in either order, repeatedly: nobody is rejected.
    for lease in (one, zero, one, zero):
        assert advance_fence(db, lease, table) == lease.fence
    # Slot 1's holder stalls past its TTL; a new holder takes slot 1 and writes through its fence.
    c.delete(one.redis_key)
    successor = take(c, "t-2")
    assert successor.slot == 1 and successor.fence > one.fence
    assert advance_fence(db, successor, table) == successor.fence
    with pytest.raises(StaleFence) as err:
        advance_fence(db, one, table)  # the stale holder of slot 1
    assert err.value.args[0] == "tenant:a#1"
    assert advance_fence(db, zero, table) == zero.fence  # slot 0's holder is still legitimate


def test_a_forced_release_of_one_slot_fences_that_slot_only(own_redis: RedisServer, conn: tuple[Any, str]) -> None:
    from celery_lockguard.fencing import bump_fence

    db, table = conn
    c = own_redis.client()
    zero, one = take(c, "t-0"), take(c, "t-1")
    deleted, fence, evicted, _ = L.force_release(c, "lg", "tenant:a", 60_000, slot=1)
    assert deleted and evicted == "t-1" and fence > one.fence
    bump_fence(db, one.fence_row, fence, table)  # what `lockguard release --slot 1 --fence-dsn` writes
    with pytest.raises(StaleFence):
        advance_fence(db, one, table)
    assert advance_fence(db, zero, table) == zero.fence
