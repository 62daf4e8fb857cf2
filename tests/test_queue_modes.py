"""Queue-time modes and Celery's edge cases, with real workers on the Redis broker and on RabbitMQ."""

from __future__ import annotations

import itertools
import json
import os
import signal
import uuid
from typing import Any

import pytest
import redis
from celery import chain, chord, group

from celery_lockguard import AlreadyQueued
from celery_lockguard._keys import claim_name, lock_name

from .harness import wait_for

pytestmark = pytest.mark.integration


def rows(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    return [x for x in (json.loads(v) for v in r.lrange(f"{prefix}:record", 0, -1)) if x["key"] == key]


def spans(rs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    starts = {x["task_id"]: x["t"] for x in rs if x["ev"] == "start"}
    return sorted((starts[x["task_id"]], x["t"]) for x in rs if x["ev"] == "end")


def no_overlap(sp: list[tuple[float, float]]) -> bool:
    return all(b[0] >= a[1] for a, b in itertools.pairwise(sorted(sp)))


@pytest.fixture
def env(fleet: Any, broker_cfg: dict[str, Any], redis_url: str) -> tuple[Any, Any, dict[str, Any], Any]:
    worker = fleet.worker(broker_cfg)
    return fleet.app(broker_cfg), redis.Redis.from_url(redis_url, decode_responses=True), broker_cfg, worker


def key() -> str:
    return f"k{uuid.uuid4().hex[:6]}"


def test_until_started_keeps_one_queued_copy_behind_the_running_one(env: Any) -> None:
    app, r, cfg, _ = env
    k = key()
    t = app.tasks["until_started"]
    a = t.delay(k, 1.5, "a")
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="A to start")
    assert not r.exists(claim_name(cfg["prefix"], f"res:{k}")), "the claim is freed when the body starts"
    b = t.delay(k, 1.5, "a")  # identical work while A runs: kept, waits behind A
    c = t.delay(k, 1.5, "a")  # identical work while B is queued: the same as B
    assert c.id == b.id != a.id
    assert a.get(timeout=30)["tag"] == "a" and b.get(timeout=60)["tag"] == "a"
    sp = spans(rows(r, cfg["prefix"], k))
    assert len(sp) == 2 and no_overlap(sp)


def test_until_started_raise_runs_a_copy_accepted_while_the_first_runs(env: Any) -> None:
    """Accepted means it runs: ``raise`` refuses at publish, never at execution (celery-once's ``unlock_before_run``).

    B is published while A runs (A's claim was freed when it started), so B is accepted; a second worker
    process picks B up while A still holds the lease. B must wait and run after A, not fail ``LockContended``.
    """
    app, r, cfg, _ = env
    k = key()
    t = app.tasks["until_started_raise"]
    a = t.delay(k, 2.0, "a")
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="A to start")
    b = t.delay(k, 2.0, "a")  # identical work while A runs: accepted (no AlreadyQueued)
    assert b.id != a.id
    with pytest.raises(AlreadyQueued) as err:  # B holds the queue claim until it starts: refused at publish
        t.delay(k, 2.0, "a")
    assert err.value.task_id == b.id
    assert a.get(timeout=30)["tag"] == "a"
    assert b.get(timeout=60)["tag"] == "a"
    sp = spans(rows(r, cfg["prefix"], k))
    assert len(sp) == 2 and no_overlap(sp)


def test_until_done_raise_runs_different_work_accepted_while_the_first_runs(env: Any) -> None:
    """Accepted means it runs, in until_done too: different work on the entity is published (never
    AlreadyQueued), and delivered while the first still runs it waits, then runs, instead of failing."""
    app, r, cfg, _ = env
    k = key()
    t = app.tasks["until_done_raise"]
    a = t.delay(k, 2.0, "a")
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="A to start")
    with pytest.raises(AlreadyQueued):
        t.delay(k, 2.0, "a")  # identical work running: refused at publish
    b = t.delay(k, 0.2, "b")  # different work on the entity: accepted
    assert a.get(timeout=30)["tag"] == "a"
    assert b.get(timeout=60)["tag"] == "b"
    sp = spans(rows(r, cfg["prefix"], k))
    assert len(sp) == 2 and no_overlap(sp)


def test_until_done_dedupes_queued_and_running_identical_work_only(env: Any) -> None:
    app, r, cfg, _ = env
    k = key()
    t = app.tasks["until_done"]
    a = t.delay(k, 1.5, "a")
    assert t.delay(k, 1.5, "a").id == a.id  # queued or already running: one copy
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="A to start")
    assert r.hget(lock_name(cfg["prefix"], f"res:{k}"), "state") == "running"
    assert t.delay(k, 1.5, "a").id == a.id
    other = t.delay(k, 0.1, "different")  # different work on the entity is never deduplicated
    assert other.id != a.id
    k2 = key()
    raising = app.tasks["until_done_raise"]
    claimed = raising.delay(k2, 0.2, "r")
    with pytest.raises(AlreadyQueued) as err:
        raising.delay(k2, 0.2, "r")
    assert err.value.key == f"res:{k2}" and err.value.task_id == claimed.id
    assert claimed.get(timeout=30)["tag"] == "r"
    assert a.get(timeout=30)["tag"] == "a" and other.get(timeout=60)["tag"] == "different"
    wait_for(lambda: not r.exists(lock_name(cfg["prefix"], f"res:{k}")), 10, what="the lease to be released")
    after = t.delay(k, 0.1, "a")
    assert after.id != a.id and after.get(timeout=30)["tag"] == "a"
    sp = spans(rows(r, cfg["prefix"], k))
    assert len(sp) == 3 and no_overlap(sp)


def test_countdown_claim_lives_until_due_plus_queue_ttl(env: Any) -> None:
    app, r, cfg, _ = env
    k = key()
    t = app.tasks["until_done"]  # queue_lock_ttl=2
    a = t.apply_async((k, 0.1, "later"), countdown=4)
    pttl = r.pttl(lock_name(cfg["prefix"], f"res:{k}"))
    assert 4000 < pttl <= 6000
    assert t.apply_async((k, 0.1, "later"), countdown=4).id == a.id
    assert a.get(timeout=30)["tag"] == "later"


@pytest.mark.parametrize("task_name", ["until_done_retry", "until_done_autoretry"])
def test_retries_keep_their_own_claim_and_leave_nothing_behind(env: Any, task_name: str) -> None:
    app, r, cfg, _ = env
    k = key()
    t = app.tasks[task_name]
    res = t.delay(k)
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="the first attempt")
    assert res.get(timeout=60) == {"retries": 2}
    assert [x["retries"] for x in rows(r, cfg["prefix"], k)] == [0, 1, 2]
    wait_for(lambda: not r.exists(lock_name(cfg["prefix"], f"res:{k}")), 10, what="no lock left behind")


def test_exhausted_retries_leave_no_lock(env: Any) -> None:
    app, r, cfg, _ = env
    k = key()
    res = app.tasks["until_done_retry"].delay(k, True)
    with pytest.raises(Exception) as err:
        res.get(timeout=60)
    assert "MaxRetriesExceeded" in type(err.value).__name__
    assert len(rows(r, cfg["prefix"], k)) == 3
    wait_for(lambda: not r.exists(lock_name(cfg["prefix"], f"res:{k}")), 10, what="no lock left behind")


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_revoked_or_expired_message_frees_its_claim(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str, how: str
) -> None:
    fleet.worker(broker_cfg, concurrency=1)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    busy, k = key(), key()
    blocker = app.tasks["hold_skip"].delay(busy, 2.5, "busy")
    wait_for(lambda: rows(r, broker_cfg["prefix"], busy), 30, what="the worker to be busy")
    if how == "revoked":
        victim = app.tasks["until_done"].delay(k, 0.1, "victim")
        app.control.revoke(victim.id)
    else:
        victim = app.tasks["until_done"].apply_async((k, 0.1, "victim"), expires=1)
    name = lock_name(broker_cfg["prefix"], f"res:{k}")
    assert r.hget(name, "state") == "queued"
    blocker.get(timeout=30)
    wait_for(lambda: not r.exists(name), 15, what=f"the {how} message's claim to be freed")
    assert rows(r, broker_cfg["prefix"], k) == []
    wait_for(lambda: victim.state == "REVOKED", 10, what="the message to be marked revoked")


def test_warm_shutdown_finishes_and_releases(fleet: Any, broker_cfg: dict[str, Any], redis_url: str) -> None:
    worker = fleet.worker(broker_cfg)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    res = app.tasks["hold_skip"].delay(k, 2.0, "warm")
    wait_for(lambda: rows(r, broker_cfg["prefix"], k), 30, what="the task to start")
    worker.stop()
    assert res.get(timeout=10)["held"] is True
    assert not r.exists(lock_name(broker_cfg["prefix"], f"res:{k}"))


def test_killed_worker_frees_the_lock_within_its_ttl(fleet: Any, broker_cfg: dict[str, Any], redis_url: str) -> None:
    worker = fleet.worker(broker_cfg)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    app.tasks["short_ttl"].delay(k, 30, "cold")  # lock_ttl=1
    name = lock_name(broker_cfg["prefix"], f"res:{k}")
    wait_for(lambda: r.exists(name), 30, what="the lease")
    assert worker.proc is not None
    for pid in [*worker.children(), worker.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not r.exists(name), 1.5, interval=0.02, what="the lease to expire within its TTL")


def test_chain_passes_none_from_a_skipped_duplicate(env: Any) -> None:
    app, r, cfg, _ = env
    k = key()
    first = app.tasks["hold_skip"].delay(k, 2.0, "running")
    wait_for(lambda: rows(r, cfg["prefix"], k), 30, what="the holder to start")
    res = chain(app.tasks["hold_skip"].s(k, 2.0, "running"), app.tasks["echo"].s()).apply_async()
    assert res.get(timeout=30) == {"got": None}
    assert first.get(timeout=30)["tag"] == "running"


def test_groups_and_chords_of_locked_tasks_complete(env: Any) -> None:
    app, _r, _cfg, _ = env
    k = key()
    t = app.tasks["until_done"]
    g = group(t.s(k, 0.2, "g") for _ in range(3)).apply_async()
    results = g.get(timeout=60)
    assert len(results) == 3 and any(x is not None and x["tag"] == "g" for x in results)
    c = chord([t.s(f"{k}-{i}", 0.1, "c") for i in range(2)], app.tasks["echo"].s()).apply_async()
    got = c.get(timeout=60)["got"]
    assert [x["tag"] for x in got] == ["c", "c"]


def test_beat_runs_that_overrun_their_interval_never_overlap(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str
) -> None:
    cfg = {**broker_cfg, "beat_every": 1.0}
    worker = fleet.worker(cfg)
    beat = fleet.beat(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    wait_for(
        lambda: worker.log().count("lock.skipped_duplicate") >= 2,
        30,
        interval=0.2,
        what="beat ticks to overlap a running reindex and be skipped",
    )
    beat.stop()
    wait_for(
        lambda: (
            len(spans(rows(r, cfg["prefix"], "catalog:reindex"))) >= 1
            and not r.exists(lock_name(cfg["prefix"], "catalog:reindex"))
        ),
        30,
        what="the last run to finish",
    )
    sp = spans(rows(r, cfg["prefix"], "catalog:reindex"))
    assert sp and no_overlap(sp)


@pytest.mark.parametrize("mode", ["while_running", "until_done"])
def test_replace_hands_the_task_id_to_the_replacement(env: Any, mode: str) -> None:
    app, r, cfg, _ = env
    results = []
    for _ in range(5):  # the replacement races the original's release: repeat to give the race a chance
        k = key()
        res = app.tasks["replacer"].delay(k, mode)
        results.append((k, res))
    for k, res in results:
        assert res.get(timeout=60)["tag"] == "replaced"
        assert [x["ev"] for x in rows(r, cfg["prefix"], k)] == ["replacer", "start", "end"]
        wait_for(lambda k=k: not r.exists(lock_name(cfg["prefix"], f"res:{k}")), 10, what="nothing left held")
