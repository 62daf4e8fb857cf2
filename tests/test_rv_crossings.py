"""Review ``rv``: the fixes 87dfad3 / 12eb963 / 42f8c96 / 62f7a48 crossed with one other feature, through real
prefork ``celery worker`` subprocesses and the real Redis. Tasks in ``tests/rvapp.py`` and ``tests/xaapp.py``."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard.exceptions import AlreadyQueued
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_workers import records

pytestmark = pytest.mark.integration


def lock_key(prefix: str, key: str) -> str:
    return f"{prefix}:v1:{{{key}}}:lock"


def claim_key(prefix: str, key: str) -> str:
    return f"{prefix}:v1:{{{key}}}:claim"


def starts(r: redis.Redis, prefix: str, task_id: str | None = None) -> list[dict[str, Any]]:
    return [x for x in records(r, prefix) if x["ev"] == "start" and (task_id is None or x["task_id"] == task_id)]


def _kill_holder(fleet: Fleet, app: Any, r: redis.Redis, prefix: str, name: str, key: str, gate: str) -> Any:
    first = app.tasks[name].delay(key, gate)
    rows = wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    os.kill(rows[0]["pid"], signal.SIGKILL)
    wait_for(lambda: first.state == "FAILURE", 30, what="the killed task to be reported lost")
    return first


def test_an_until_done_raise_publish_behind_a_killed_holder_is_not_refused_with_the_dead_task(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """12eb963 x on_locked="raise": the fix accepts an identical publish behind a dead holder with skip, but with
    raise decide_publish checks ``duplicate and on_locked == 'raise'`` before the holder's liveness: the caller
    gets AlreadyQueued naming the dead (FAILURE) task, for the rest of the dead lease's TTL. Expected: accepted,
    as with skip (the dead holder's work will never be done)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    first = _kill_holder(fleet, app, r, prefix, "rv.udr", key, gate)
    assert r.hget(lock_key(prefix, f"rv:{key}"), "state") == "running"
    r.set(gate, 1)
    try:
        again = app.tasks["rv.udr"].delay(key, gate)
    except AlreadyQueued as exc:
        pytest.fail(f"identical work refused behind a dead holder ({exc!r}; {first.id} is {first.state})")
    assert again.get(timeout=60) == {"key": key}


def test_identical_publishes_behind_a_killed_until_done_holder_queue_one_copy(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """12eb963 x repeated publishes: behind a dead holder each identical publish is published without a claim
    (PublishAction.PUBLISH, 'holder_not_alive'), so every one queues another copy. DESIGN: until_done keeps one
    copy queued or running; the second publish should be answered with the first accepted copy."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    _kill_holder(fleet, app, r, prefix, "xa.ud", key, gate)
    task = app.tasks["xa.ud"]
    ids = {task.delay(key, gate).id for _ in range(3)}
    r.set(gate, 1)
    assert len(ids) == 1, f"{len(ids)} copies of identical work queued behind a dead holder"


@pytest.mark.parametrize("move_to", ["y", "a"])  # same anchor (m < x, y); the anchor moves (a < m)
def test_a_multi_entity_until_done_retry_moving_its_second_entity_leaves_nothing_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, move_to: str
) -> None:
    """87dfad3 x several entities: retry(kwargs=) keeps entity m and moves x -> y (same anchor: handed over) or
    x -> a (the anchor moves: released). x is freed at the retry; the retry runs on the new pair; all free after."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    tag = uuid.uuid4().hex[:6]
    m, x, new = f"m{tag}", f"x{tag}", f"{move_to}{tag}"
    res = app.tasks["rv.mud"].apply_async(kwargs={"a": m, "b": x, "move_b": new})
    wait_for(lambda: starts(r, prefix, res.id), 30, what="the first attempt")
    wait_for(lambda: not r.exists(lock_key(prefix, f"rvm:{x}")), 5, what="the moved-off entity freed at the retry")
    assert res.get(timeout=30) == {"a": m, "b": new}
    for k in (m, x, new):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"rvm:{k}"), claim_key(prefix, f"rvm:{k}")), 10,
                 what=f"rvm:{k} free")  # fmt: skip
