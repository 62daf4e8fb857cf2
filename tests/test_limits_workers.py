"""lock_limit and lock_rate on real ``celery worker`` subprocesses (prefork) against the real Redis."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard._keys import rate_name, slot_lock_name

from .harness import wait_for

pytestmark = pytest.mark.integration


def rows(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in r.lrange(f"{prefix}:record", 0, -1)]
    return [x for x in out if x["key"] == key]


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of spans open at one moment."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


def test_the_limit_holds_across_two_workers_and_a_killed_holder_frees_its_slot_within_the_ttl(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    tenant = f"t{uuid.uuid4().hex[:6]}"
    victim = app.tasks["export_limited"].delay(tenant, 30.0, "victim")  # holds its slot until killed
    wait_for(lambda: rows(r, prefix, tenant), 60, what="the victim to start")
    (start,) = [x for x in rows(r, prefix, tenant) if x["ev"] == "start"]
    others = [app.tasks["export_limited"].delay(tenant, 0.4, f"job{i}") for i in range(6)]
    wait_for(lambda: len([x for x in rows(r, prefix, tenant) if x["ev"] == "start"]) >= 2, 60, what="a second holder")
    slot_key = slot_lock_name(prefix, f"tenant:{tenant}", start["slot"])
    # The slot lease is renewed by the worker's renewer like any lease (ttl 3 s: every second).
    wait_for(lambda: r.hget(slot_key, "renewed_at") != r.hget(slot_key, "acquired_at"), 30, what="a renewal")
    killed_at = time.time()
    os.kill(start["pid"], signal.SIGKILL)
    # The killed holder's lease is no longer renewed: its slot frees within the TTL (3 s), then others take it.
    # The victim's lease ends when the server expires it, not when this poll sees it gone (a waiting job can take
    # the slot in between): the last PEXPIRETIME read while the victim still held the slot is that moment.
    expires_ms: list[int] = []

    def victim_gone() -> bool:
        holder, expiry = (
            r.pipeline(transaction=False).hget(slot_key, "task_id").execute_command("PEXPIRETIME", slot_key).execute()
        )
        if holder == victim.id:
            expires_ms.append(int(expiry))
        return holder != victim.id

    wait_for(victim_gone, 3 + 10, interval=0.05, what="the slot to free")
    freed_at = time.time()
    assert freed_at - killed_at < 3 + 5  # the TTL, plus a loaded machine's polling slack
    lease_end = expires_ms[-1] / 1000.0
    assert lease_end <= freed_at
    outs = [res.get(timeout=120) for res in others]
    assert sorted(o["tag"] for o in outs) == [f"job{i}" for i in range(6)]
    got = rows(r, prefix, tenant)
    starts = {x["task_id"]: x["t"] for x in got if x["ev"] == "start"}
    ends = {x["task_id"]: x["t"] for x in got if x["ev"] == "end"}
    spans = [(starts[t], ends[t]) for t in ends]
    spans.append((start["t"], lease_end))  # the victim holds its slot until its lease expired on the server
    assert len(spans) == 7
    assert most_at_once(spans) <= 2  # never more than lock_limit bodies on the entity
    assert most_at_once(spans) == 2  # and the second slot was used: different work ran beside the victim
    assert {o["slot"] for o in outs} <= {0, 1}


def test_the_rate_holds_over_several_windows_under_a_race_of_publishers(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    partner = f"p{uuid.uuid4().hex[:6]}"
    results: list[Any] = []
    barrier = threading.Barrier(16)
    guard = threading.Lock()

    def publisher(i: int) -> None:
        barrier.wait()
        sent = app.tasks["partner_call"].delay(partner, 0.05, f"call{i}")
        with guard:
            results.append(sent)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [res.get(timeout=180) for res in results]
    assert sorted(o["tag"] for o in outs) == sorted(f"call{i}" for i in range(16))
    admitted_at = sorted(o["at"] for o in outs)  # server ms of each admission (the lease's acquired_at)
    assert all(admitted_at)
    # Sliding window: any 4 consecutive admissions span at least the window (1 s), i.e. <= 3 starts per window.
    for i in range(len(admitted_at) - 3):
        assert admitted_at[i + 3] - admitted_at[i] >= 1000, admitted_at
    assert admitted_at[-1] - admitted_at[0] >= 4000  # 16 starts at 3/s: at least five windows
    window = rate_name(prefix, f"partner:{partner}")
    assert r.zcard(window) <= 3 and r.pttl(window) <= 1000  # bounded memory: N members, PX = the window
    assert all(res.state == "SUCCESS" for res in results)  # waits never spent max_retries=0


def test_raise_fails_visibly_with_lock_throttled_when_the_window_is_full(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    partner = f"p{uuid.uuid4().hex[:6]}"
    first = app.tasks["partner_call_raise"].delay(partner, 0.01, "first")
    assert first.get(timeout=60)["tag"] == "first"
    second = app.tasks["partner_call_raise"].delay(partner, 0.01, "second")
    with pytest.raises(Exception) as err:
        second.get(timeout=60)
    assert type(err.value).__name__ == "LockThrottled" and second.state == "FAILURE"
    assert "1/1m" in str(err.value)


def test_a_single_lease_and_the_slots_of_one_entity_exclude_each_other(fleet: Any, redis_url: str, prefix: str) -> None:
    """docs/limits.md's export(partner) with lock_limit=2 beside delete_partner(partner) with the single lease.

    The delete must never overlap an export and exports never overlap a delete (shared/exclusive, as
    Redisson's RReadWriteLock), by the lock server's clock read in the bodies. A delete published while
    both exports run parks behind them, and the release of the last slot wakes it (``lock.woken``).
    """
    from .conftest import make_cfg

    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg, concurrency=4)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    partner = f"p{uuid.uuid4().hex[:6]}"
    export, delete = app.tasks["export_partner"], app.tasks["delete_partner"]

    def started(tag: str) -> bool:
        return any(x["ev"] == "start" and x["tag"] == tag for x in rows(r, prefix, partner))

    d1 = delete.delay(partner, 1.5, "d1")  # the delete holds the entity: exports wait for it
    wait_for(lambda: started("d1"), 60, what="the first delete to start")
    exports = [export.delay(partner, 2.5, f"e{i}") for i in range(2)]
    wait_for(lambda: started("e0") and started("e1"), 60, what="both exports to start")
    d2 = delete.delay(partner, 0.5, "d2")  # the exports hold both slots: the delete waits for both
    e2 = export.delay(partner, 0.3, "e2")  # both slots taken: a third export waits, never beside d2
    for res in (d1, *exports, d2, e2):
        assert res.get(timeout=90)["tag"]
    recs = rows(r, prefix, partner)
    starts = {x["task_id"]: x for x in recs if x["ev"] == "start"}
    spans = {starts[x["task_id"]]["tag"]: (starts[x["task_id"]]["at"], x["at"]) for x in recs if x["ev"] == "end"}
    assert set(spans) == {"d1", "d2", "e0", "e1", "e2"}, spans
    for d in ("d1", "d2"):
        for e in ("e0", "e1", "e2"):
            (ds, de), (es, ee) = spans[d], spans[e]
            assert de <= es or ee <= ds, f"{d} {spans[d]} overlaps {e} {spans[e]}"
    assert most_at_once([spans[e] for e in ("e0", "e1", "e2")]) <= 2
    # d2 parked behind the slots, and the release of the last one woke it (not its safety copy, a TTL later).
    assert [x["woken"] for x in recs if x["ev"] == "start" and x["tag"] == "d2"] == [True], recs
