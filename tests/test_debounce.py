"""``lock_debounce`` with real workers: one run per burst, the last arguments, nothing lost to a killed worker."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from celery_lockguard import ConfigurationError
from celery_lockguard._keys import debounce_name, lock_name

from .conftest import make_cfg
from .harness import wait_for

pytestmark = pytest.mark.integration


def rows(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    return [x for x in (json.loads(v) for v in r.lrange(f"{prefix}:record", 0, -1)) if x["key"] == key]


def starts(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    return [x for x in rows(r, prefix, key) if x["ev"] == "start"]


def key() -> str:
    return f"k{uuid.uuid4().hex[:6]}"


def superseded_by(survivor: str) -> dict[str, str]:
    return {"lockguard": "superseded", "superseded_by": survivor}


def test_a_burst_of_50_publishes_runs_once_with_the_last_arguments(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str
) -> None:
    fleet.worker(broker_cfg)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    t = app.tasks["debounced"]
    burst = [t.delay(k, 0.1, f"edit-{i}") for i in range(50)]
    last = burst[-1]
    record = r.hgetall(debounce_name(broker_cfg["prefix"], f"res:{k}", "debounced"))
    assert record["task_id"] == last.id and int(record["superseded"]) == 49
    assert last.get(timeout=60)["tag"] == "edit-49"
    for res in burst[:-1]:
        assert res.get(timeout=60) == superseded_by(last.id)
    ran = starts(r, broker_cfg["prefix"], k)
    assert [x["tag"] for x in ran] == ["edit-49"] and ran[0]["task_id"] == last.id
    assert r.hget(debounce_name(broker_cfg["prefix"], f"res:{k}", "debounced"), "last_run") == last.id


def test_a_publish_during_the_run_is_one_more_run_after_it(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str
) -> None:
    fleet.worker(broker_cfg)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    t = app.tasks["debounced"]
    first = t.delay(k, 3.0, "same")
    wait_for(lambda: starts(r, broker_cfg["prefix"], k), 60, what="the first run to start")
    # Identical arguments while it runs: new work for after the run, never skipped as its duplicate.
    during = [t.delay(k, 3.0, "same") for _ in range(3)]
    assert first.get(timeout=60)["tag"] == "same"
    assert during[-1].get(timeout=60)["tag"] == "same"
    assert [res.get(timeout=60) for res in during[:-1]] == [superseded_by(during[-1].id)] * 2
    ran = rows(r, broker_cfg["prefix"], k)
    assert [x["task_id"] for x in ran if x["ev"] == "start"] == [first.id, during[-1].id]
    ends = {x["task_id"]: x["t"] for x in ran if x["ev"] == "end"}
    second_start = next(x["t"] for x in ran if x["ev"] == "start" and x["task_id"] == during[-1].id)
    assert second_start >= ends[first.id], "the second run starts after the first ended"


def test_worker_killed_holding_the_surviving_message_still_runs_it_once(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    cfg = make_cfg(prefix, redis_url, acks_late=True, visibility_timeout=4, debounce=3)
    doomed = fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    t = app.tasks["debounced"]
    burst = [t.delay(k, 0.1, f"edit-{i}") for i in range(5)]
    last = burst[-1]
    # The only worker holds every message of the burst (ETA messages, unacknowledged) before they are due.
    wait_for(lambda: all(res.id in doomed.output() for res in burst), 30, what="the worker to hold the burst")
    doomed.kill()
    assert not starts(r, prefix, k), "killed before the burst was due"
    fleet.worker(cfg)  # the broker redelivers the unacknowledged messages after visibility_timeout
    assert last.get(timeout=90)["tag"] == "edit-4"
    for res in burst[:-1]:
        assert res.get(timeout=60) == superseded_by(last.id)
    ran = starts(r, prefix, k)
    assert [x["task_id"] for x in ran] == [last.id]
    wait_for(lambda: not r.exists(lock_name(prefix, f"res:{k}")), 15, what="the lease to be released")


def test_an_expires_before_the_run_is_due_is_refused_and_a_later_one_runs(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str
) -> None:
    # The message waits lock_debounce (1.5 s) in the broker; an expires=0.5 message would be discarded
    # by the worker as expired when due, and the burst it ends would never run.
    fleet.worker(broker_cfg)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    t = app.tasks["debounced"]
    record = debounce_name(broker_cfg["prefix"], f"res:{k}", "debounced")
    first = t.apply_async((k, 0.1, "kept"), expires=60)
    with pytest.raises(ConfigurationError, match=r"'debounced'.*expires=0\.5"):
        t.apply_async((k, 0.1, "expiring"), expires=0.5)
    with pytest.raises(ConfigurationError, match="expires="):
        t.apply_async((k, 0.1, "expiring"), expires=datetime.now(timezone.utc) + timedelta(seconds=1))
    assert r.hget(record, "task_id") == first.id, "a refused publish leaves the pending run alone"
    assert first.get(timeout=60)["tag"] == "kept"
    assert [x["task_id"] for x in starts(r, broker_cfg["prefix"], k)] == [first.id]


def test_a_run_waiting_for_the_lease_is_replaced_by_a_later_publish(
    fleet: Any, broker_cfg: dict[str, Any], redis_url: str
) -> None:
    # x is published while `first` runs; its burst falls due and x is taken, but it waits for the lease:
    # its body has not started, so y (published then) replaces it. One more run after `first`: y's.
    fleet.worker(broker_cfg, concurrency=3)
    app = fleet.app(broker_cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = key()
    record = debounce_name(broker_cfg["prefix"], f"res:{k}", "debounced")
    t = app.tasks["debounced"]
    first = t.delay(k, 12.0, "first")
    wait_for(lambda: starts(r, broker_cfg["prefix"], k), 60, what="the first run to start")
    x = t.delay(k, 0.1, "x")
    wait_for(lambda: r.hget(record, "last_run") == x.id, 60, what="x to be taken (it then waits for the lease)")
    y = t.delay(k, 0.1, "y")
    assert first.get(timeout=60)["tag"] == "first"
    assert x.get(timeout=60) == superseded_by(y.id)
    assert y.get(timeout=60)["tag"] == "y"
    assert [e["tag"] for e in starts(r, broker_cfg["prefix"], k)] == ["first", "y"]
    wait_for(lambda: not r.exists(lock_name(broker_cfg["prefix"], f"res:{k}")), 15, what="the lease to be released")
