"""Integration: real ``celery worker`` subprocesses (prefork, -c 2) against a real broker."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard import _lease as L
from celery_lockguard._keys import lock_name

from .harness import wait_for

pytestmark = pytest.mark.integration


def records(r: redis.Redis, prefix: str, key: str | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in r.lrange(f"{prefix}:record", 0, -1)]
    return [x for x in rows if key is None or x["key"] == key]


def intervals(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    starts = {x["task_id"]: x["t"] for x in rows if x["ev"] == "start"}
    return sorted((starts[x["task_id"]], x["t"]) for x in rows if x["ev"] == "end")


def overlapping(spans: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    spans = sorted(spans)
    return [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


def test_duplicates_across_workers_never_overlap_while_other_keys_run_in_parallel(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    hot, cold = f"hot-{uuid.uuid4().hex[:6]}", f"cold-{uuid.uuid4().hex[:6]}"
    results = [app.tasks["hold_wait"].delay(hot, 0.3, f"d{i}") for i in range(8)]
    results += [app.tasks["hold_wait"].delay(f"{cold}-{i}", 0.6, f"c{i}") for i in range(3)]
    outs = [res.get(timeout=90) for res in results]
    assert all(o["held"] for o in outs)
    hot_spans = intervals(records(r, cfg["prefix"], f"{hot}"))
    assert len(hot_spans) == 8
    assert overlapping(hot_spans) == []
    fences = [o["fence"] for o in outs[:8]]
    assert len(set(fences)) == 8
    all_spans = intervals([x for x in records(r, cfg["prefix"]) if x["key"].startswith((hot, cold))])
    assert overlapping(all_spans), "different keys should have run in parallel"


def test_short_ttl_lease_survives_a_long_body_and_excludes_others(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["lock_url"], decode_responses=True)
    key = f"long-{uuid.uuid4().hex[:6]}"
    res = app.tasks["short_ttl"].delay(key, 4.0, "long")
    name = lock_name(cfg["prefix"], f"res:{key}")
    wait_for(lambda: r.exists(name), 30, what="lease to be taken")
    got = L.acquire(
        r,
        cfg["prefix"],
        f"res:{key}",
        ttl_ms=1000,
        task_id="probe",
        task_name="probe",
        digest="x",
        worker="test",
        fence_ttl_ms=60_000,
    )
    assert isinstance(got, L.Holder) and got.task_id == res.id
    renewals: set[str] = set()

    def renewed_three_ttls_on() -> bool:
        # every sample: the lease is present and still the task's, whatever the TTL was at start
        assert r.hget(name, "task_id") == res.id, "lease vanished or changed hands during the body"
        renewals.add(r.hget(name, "renewed_at") or "")
        return len(renewals) >= 9

    wait_for(renewed_three_ttls_on, 6, interval=0.05, what="nine renewals (three TTLs) of the 1 s lease")
    out = res.get(timeout=30)
    assert out["held"] is True and out["lost"] is False
    assert not r.exists(name)


def test_different_work_waits_then_runs_identical_work_is_skipped(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    inv = int(uuid.uuid4().int % 10**9)
    first = app.tasks["charge"].delay(inv, 100, 1.5)
    wait_for(lambda: records(r, cfg["prefix"], f"invoice:{inv}"), 30, what="first charge to start")
    other = app.tasks["charge"].delay(inv, 250, 0.1)
    dup = app.tasks["charge"].delay(inv, 100, 1.5)
    assert dup.get(timeout=30) is None and dup.state == "SUCCESS"
    assert first.get(timeout=30)["tag"] == "charge:100"
    assert other.get(timeout=60)["tag"] == "charge:250"
    rows = records(r, cfg["prefix"], f"invoice:{inv}")
    starts = [x["tag"] for x in rows if x["ev"] == "start"]
    assert sorted(starts) == ["charge:100", "charge:250"]
    spans = {x["tag"]: x["t"] for x in rows if x["ev"] == "end"}
    start_250 = next(x["t"] for x in rows if x["ev"] == "start" and x["tag"] == "charge:250")
    assert start_250 >= spans["charge:100"]


def test_raise_policy_fails_visibly(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    key = f"raise-{uuid.uuid4().hex[:6]}"
    first = app.tasks["hold_raise"].delay(key, 1.5)
    wait_for(lambda: records(r, cfg["prefix"], key), 30, what="holder to start")
    second = app.tasks["hold_raise"].delay(key, 0.1)
    with pytest.raises(Exception) as err:
        second.get(timeout=30)
    assert type(err.value).__name__ == "LockContended" and second.state == "FAILURE"
    assert first.get(timeout=30)["held"]


def test_stolen_lease_is_reported_lost_and_release_spares_the_successor(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["lock_url"], decode_responses=True)
    key = f"steal-{uuid.uuid4().hex[:6]}"
    name = lock_name(cfg["prefix"], f"res:{key}")
    res = app.tasks["no_renew"].delay(key, 2.5, "victim")
    wait_for(lambda: r.exists(name), 30, what="lease to be taken")
    wait_for(lambda: not r.exists(name), 5, interval=0.01, what="unrenewed lease to expire")
    successor = L.acquire(
        r,
        cfg["prefix"],
        f"res:{key}",
        ttl_ms=30_000,
        task_id="successor",
        task_name="s",
        digest="x",
        worker="test",
        fence_ttl_ms=60_000,
    )
    assert isinstance(successor, L.Lease)
    out = res.get(timeout=30)
    assert out["lost"] is True and out["held"] is False
    assert r.hget(name, "token") == successor.token
    assert successor.fence > out["fence"]


def test_child_killed_mid_body_is_redelivered_and_completes(fleet: Any, redis_url: str, prefix: str) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url, acks_late=True)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    res = app.tasks["crash_once"].delay("k1", "boom")
    out = res.get(timeout=60)
    assert out["attempt"] == 2
    rows = records(r, prefix, "k1")
    assert [x["attempt"] for x in rows if x["ev"] == "start"] == [1, 2]
    assert [x["attempt"] for x in rows if x["ev"] == "end"] == [2]
    assert not r.exists(lock_name(prefix, "res:k1"))


def test_redelivery_of_a_running_task_is_dropped_not_run(fleet: Any, redis_url: str, prefix: str) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url, acks_late=True, visibility_timeout=1)
    worker = fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    res = app.tasks["hold_skip"].delay("redeliver", 5.0, "original")
    wait_for(
        lambda: "redelivery_of_running_original" in worker.log(),
        30,
        interval=0.2,
        what="the redelivered copy to be dropped",
    )
    out = res.get(timeout=30)
    assert out["tag"] == "original" and out["held"] is True
    assert [x["ev"] for x in records(r, prefix, "redeliver")] == ["start", "end"]
    assert res.state == "SUCCESS"


def test_hard_time_limit_shortens_the_lease_from_the_main_process(fleet: Any, redis_url: str, prefix: str) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    name = lock_name(prefix, "res:tl")
    res = app.tasks["limited"].delay("tl", 30, "limited")
    wait_for(lambda: r.exists(name), 30, what="lease to be taken")
    assert r.pttl(name) > 10_000
    with pytest.raises(Exception) as err:
        res.get(timeout=30)
    assert "TimeLimitExceeded" in type(err.value).__name__
    wait_for(lambda: r.pttl(name) <= 2000, 10, what="main process to shorten the lease to the grace")
    wait_for(lambda: not r.exists(name), 5, what="lease to be free within the grace")


def test_revoke_terminate_shortens_the_lease(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["lock_url"], decode_responses=True)
    key = f"revoke-{uuid.uuid4().hex[:6]}"
    name = lock_name(cfg["prefix"], f"res:{key}")
    res = app.tasks["hold_skip"].delay(key, 30, "revoked")
    wait_for(lambda: r.exists(name), 30, what="lease to be taken")
    app.control.revoke(res.id, terminate=True)
    wait_for(lambda: 0 < r.pttl(name) <= 2000 or not r.exists(name), 15, what="lease shortened after terminate")


def _gate(tmp: Any) -> Any:
    return tmp / f"gate-{uuid.uuid4().hex[:6]}"


@pytest.mark.parametrize("lock_is_broker", [False, True], ids=["lock-redis-only", "lock-redis-is-broker"])
def test_fail_closed_runs_nothing_during_an_outage_and_runs_once_after(
    fleet: Any, redis_url: str, prefix: str, tmp_path: Any, lock_is_broker: bool
) -> None:
    from celery_lockguard.testing import RedisServer

    from .conftest import make_cfg

    with RedisServer(persistent=True) as own:
        broker = own.url if lock_is_broker else redis_url
        cfg = make_cfg(prefix, broker, lock_url=own.url, record_url=redis_url, on_unavailable="fail_closed")
        worker = fleet.worker(cfg)
        app = fleet.app(cfg)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        gate = _gate(tmp_path)
        res = app.tasks["gated"].delay("outage", str(gate), "closed")
        wait_for(lambda: worker.log().count("gated[") >= 1, 30, interval=0.1, what="the task to be received")
        own.stop()
        gate.touch()
        wait_for(lambda: "lock.backend_unavailable" in worker.log(), 30, interval=0.1, what="the outage to be seen")
        assert records(r, prefix, "outage") == []
        own.start()
        out = res.get(timeout=90)
        assert out["tag"] == "closed" and out["fence"] is not None
        assert [x["ev"] for x in records(r, prefix, "outage")] == ["start", "end"]
        worker.stop()


def test_fail_open_runs_the_body_without_a_lease(fleet: Any, redis_url: str, prefix: str, tmp_path: Any) -> None:
    from celery_lockguard.testing import RedisServer

    from .conftest import make_cfg

    with RedisServer() as own:
        cfg = make_cfg(prefix, redis_url, lock_url=own.url, on_unavailable="fail_open")
        worker = fleet.worker(cfg)
        app = fleet.app(cfg)
        own.stop()
        out = app.tasks["hold_skip"].delay("open", 0.1, "open").get(timeout=60)
        assert out == {"tag": "open", "fence": None, "lost": None, "held": None}
        assert "lock.fail_open" in worker.log()


def test_original_killed_after_its_redelivery_was_dropped_still_completes(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    """Dropping the redelivered copy acks it, which on Redis also deletes the original's unacked entry;
    the watch copy left behind is what runs the job when the original then dies (found by the chaos soak)."""
    import os
    import signal

    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url, acks_late=True, visibility_timeout=1)
    worker = fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    res = app.tasks["hold_skip"].delay("watched", 4.0, "job")
    wait_for(
        lambda: "redelivery_of_running_original" in worker.log(),
        30,
        interval=0.1,
        what="the redelivered copy to be dropped",
    )
    (first,) = [x for x in records(r, prefix, "watched") if x["ev"] == "start"]
    os.kill(first["pid"], signal.SIGKILL)
    out = res.get(timeout=90)
    assert out["tag"] == "job" and out["held"] is True
    rows = records(r, prefix, "watched")
    assert [x["ev"] for x in rows].count("end") == 1
    assert len([x for x in rows if x["ev"] == "start"]) == 2
