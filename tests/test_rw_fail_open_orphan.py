"""rw review: the fail_open give-back of a timed-out ACQUIRE's lease (``_release.free_orphan``) crossed with
retry, parking, lock_limit+lock_rate, debounce and an outage that outlasts the body, through real prefork
workers; the lock Redis is a private server paused (SIGSTOP), the broker the shared RabbitMQ (own queue)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_lockguard.testing import RedisServer, wait_for

from .conftest import Fleet, amqp_url, make_cfg
from .test_workers import records

pytestmark = pytest.mark.integration


@pytest.fixture
def srv() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s
        if s.proc is not None:
            s.resume()


def cfg_for(prefix: str, redis_url: str, srv: RedisServer, **over: Any) -> dict[str, Any]:
    return make_cfg(prefix, redis_url, broker=amqp_url(), backend=redis_url, lock_url=srv.url, **over)


def evs(r: redis.Redis, prefix: str, ev: str, **match: Any) -> list[dict[str, Any]]:
    return [x for x in records(r, prefix) if x["ev"] == ev and all(x.get(k) == v for k, v in match.items())]


def started(r: redis.Redis, prefix: str, tag: str) -> bool:
    return bool(evs(r, prefix, "start", tag=tag))


def lease(lock: redis.Redis, prefix: str, key: str, slot: int = 0) -> dict[str, str]:
    name = f"{prefix}:v1:{{{key}}}:lock" + (f":{slot}" if slot else "")
    return lock.hgetall(name)  # type: ignore[return-value]


def warm(app: Any, r: redis.Redis, prefix: str, name: str, n: int) -> None:
    g = f"{prefix}:warmgate"
    rs = [app.tasks[name].delay(f"warm{i}", g, f"warm{i}") for i in range(n)]
    wait_for(lambda: all(started(r, prefix, f"warm{i}") for i in range(n)), 30, what="warm-up calls")
    r.set(g, 1)
    for x in rs:
        x.get(timeout=30)


def stall_at_delivery(app: Any, r: redis.Redis, prefix: str, srv: RedisServer, name: str, key: str, gate: str,
                      tag: str, **kw: Any) -> Any:  # fmt: skip
    """Publish, stall the lock Redis before the delivery, wait for the unlocked body, resume: the ACQUIRE that
    timed out runs on the server now and leaves the orphan lease."""
    res = app.tasks[name].apply_async((key, gate, tag), kw, countdown=1)
    time.sleep(0.5)
    srv.pause()
    wait_for(lambda: started(r, prefix, tag), 30, what=f"{tag}'s body to run unlocked")
    srv.resume()
    return res


def test_retry_in_a_fail_open_body_frees_the_orphan_and_the_retry_runs_locked(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 1: the fail-open body calls ``self.retry(countdown=2)``; free_orphan runs while Retry propagates.
    The orphan is freed at once (not at lock_ttl), and the retry takes its own lease and runs (never freed)."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    lock = srv.client()
    warm(app, r, prefix, "rw.one_open", 2)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    res = stall_at_delivery(app, r, prefix, srv, "rw.open_retry", key, gate, "m", countdown=2.0)
    wait_for(lambda: lease(lock, prefix, f"rw:{key}"), 10, what="the orphan lease after the resume")
    orphan = lease(lock, prefix, f"rw:{key}")["token"]
    r.set(gate, 1)
    wait_for(lambda: evs(r, prefix, "end", tag="m"), 10, what="the first attempt to end")
    wait_for(lambda: not lease(lock, prefix, f"rw:{key}"), 1.5, what="the orphan freed after the retry")
    out = res.get(timeout=30)
    print(w.output()[-3000:])
    assert out["locked"] is True
    starts = evs(r, prefix, "start", tag="m")
    assert [x["retries"] for x in starts] == [0, 1], starts
    assert orphan not in [lease(lock, prefix, f"rw:{key}").get("token")]


def test_parked_waiter_behind_the_orphan_is_woken_by_the_give_back(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 6: a waiter parks behind the orphan lease (alive pid here): the give-back wakes it at once."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    lock = srv.client()
    warm(app, r, prefix, "rw.one_open", 2)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    res = stall_at_delivery(app, r, prefix, srv, "rw.one_open", key, gate, "m")
    wait_for(lambda: lease(lock, prefix, f"rw:{key}"), 10, what="the orphan lease after the resume")
    waiter = app.tasks["rw.one"].delay(key, "", "w")
    wait_for(lambda: lock.llen(f"{prefix}:v1:{{rw:{key}}}:wait") >= 1, 10, what="the waiter parked")
    r.set(gate, 1)
    assert res.get(timeout=30)["locked"] is False
    ended = evs(r, prefix, "end", tag="m")[0]["t"]
    assert waiter.get(timeout=30)["locked"] is True
    began = evs(r, prefix, "start", tag="w")[0]["t"]
    print(w.output()[-3000:])
    print("WAITER_GAP", began - ended)
    assert began - ended < 1.5, f"the waiter ran {began - ended:.1f}s after the fail-open body ended"


def test_slots_with_rate_only_the_orphan_slot_is_freed(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 3: lock_limit=3 + lock_rate. Two holders run in slots 0 and 1; the fail-open call's ACQUIRE_SLOTS
    times out and takes slot 2 at the resume. After it ends, slot 2 is free, slots 0 and 1 keep their holders."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=3)
    lock = srv.client()
    warm(app, r, prefix, "rw.rate_open", 3)
    key, gh, gate = uuid.uuid4().hex[:6], f"{prefix}:gh", f"{prefix}:gate"
    hs = [app.tasks["rw.rate_open"].delay(key, gh, f"h{i}") for i in range(2)]
    wait_for(lambda: started(r, prefix, "h0") and started(r, prefix, "h1"), 30, what="two holders")
    before = {i: lease(lock, prefix, f"rw:{key}", i).get("token") for i in range(3)}
    assert before[0] and before[1] and not before[2], before
    res = stall_at_delivery(app, r, prefix, srv, "rw.rate_open", key, gate, "m")
    wait_for(lambda: lease(lock, prefix, f"rw:{key}", 2), 10, what="the orphan slot after the resume")
    r.set(gate, 1)
    assert res.get(timeout=30)["locked"] is False
    after = {i: lease(lock, prefix, f"rw:{key}", i).get("token") for i in range(3)}
    r.set(gh, 1)
    for h in hs:
        assert h.get(timeout=30)["locked"] is True
    print(before, after, w.output()[-3000:])
    assert after == {0: before[0], 1: before[1], 2: None}, (before, after)


def test_outage_outlasting_the_body_bounds_the_return(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 5a: Redis still stalled when the body ends: the return waits about one socket timeout (1 s)."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    warm(app, r, prefix, "rw.one_open", 1)
    key = uuid.uuid4().hex[:6]
    res = app.tasks["rw.one_open"].apply_async((key, "", "m"), countdown=1)
    time.sleep(0.5)
    srv.pause()
    try:
        out = res.get(timeout=30)
        ended = evs(r, prefix, "end", tag="m")[0]["t"]
        done = time.time()
    finally:
        srv.resume()
    print(w.output()[-3000:])
    assert out["locked"] is False
    print("RETURN_AFTER_BODY", done - ended)
    assert done - ended < 3.0, f"the result came {done - ended:.1f}s after the body ended"
    assert "the fail-open attempt may have taken is left to its TTL" in w.output()


def test_refused_connections_after_the_body_log_and_return(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Crossing 5b: the lock Redis refuses connections once the body runs: no exception escapes, an event says."""
    with RedisServer(persistent=True) as srv:
        cfg = cfg_for(prefix, redis_url, srv)
        app = fleet.app(cfg)
        w = fleet.worker(cfg, concurrency=1)
        warm(app, r, prefix, "rw.one_open", 1)
        key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
        res = stall_at_delivery(app, r, prefix, srv, "rw.one_open", key, gate, "m")
        lock = srv.client()
        wait_for(lambda: lease(lock, prefix, f"rw:{key}"), 10, what="the orphan lease after the resume")
        srv.stop()
        r.set(gate, 1)
        out = res.get(timeout=30)
        print(w.output()[-3000:])
        assert out["locked"] is False
        assert "the fail-open attempt may have taken is left to its TTL" in w.output()


def test_debounce_fail_open_stalled_at_delivery_leaves_nothing_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 4: fail_open + lock_debounce; the lock Redis stalls at delivery (DEBOUNCE_TAKE and ACQUIRE
    time out, the body runs unlocked). After it ends nothing holds the entity: the next burst runs at once."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    lock = srv.client()
    warm(app, r, prefix, "rw.deb_open", 1)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    res = app.tasks["rw.deb_open"].delay(key, gate, "m")
    time.sleep(0.6)
    srv.pause()
    wait_for(lambda: started(r, prefix, "m"), 30, what="the body to run unlocked")
    srv.resume()
    time.sleep(0.5)
    left_during = lease(lock, prefix, f"rw:{key}")
    r.set(gate, 1)
    assert res.get(timeout=30)["locked"] is False
    ended = time.time()
    left = lease(lock, prefix, f"rw:{key}")
    nxt = app.tasks["rw.deb_open"].delay(key, "", "n")
    out = nxt.get(timeout=30)
    began = evs(r, prefix, "start", tag="n")[0]["t"]
    print(left_during, left, w.output()[-3000:])
    assert not left, left
    assert out["locked"] is True
    assert began - ended < 1.0 + 2.0, f"next burst began {began - ended:.1f}s after"
