"""xc crossing review: the outage policies (fail_closed / fail_open) crossed with one other feature at a time,
through real prefork workers; the lock Redis is a private server paused (SIGSTOP) or restarted, the broker the
shared RabbitMQ (own queue), records and results on the shared Redis."""

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
            s.resume()  # never leave a stopped process behind


def cfg_for(prefix: str, redis_url: str, srv: RedisServer, **over: Any) -> dict[str, Any]:
    return make_cfg(prefix, redis_url, broker=amqp_url(), backend=redis_url, lock_url=srv.url, **over)


def evs(r: redis.Redis, prefix: str, ev: str, **match: Any) -> list[dict[str, Any]]:
    return [x for x in records(r, prefix) if x["ev"] == ev and all(x.get(k) == v for k, v in match.items())]


def test_checkpoint_outage_between_two_checkpoints_replays_the_first(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 6: fail_closed x checkpoint(). Step a is recorded, the lock Redis stalls before step b's read:
    the body stops and is re-delivered; once Redis is back the re-delivery replays a and runs b once."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    res = app.tasks["xc.cp"].delay(key, gate, "cp")
    wait_for(lambda: evs(r, prefix, "after_a"), 30, what="checkpoint a recorded")
    srv.pause()
    r.set(gate, 1)
    wait_for(lambda: "checkpoint 'b' read" in w.output(), 30, what="checkpoint b to meet the outage")
    time.sleep(1)
    srv.resume()
    out = res.get(timeout=90)
    print(w.output()[-4000:])
    steps = [x["step"] for x in evs(r, prefix, "step")]
    first_a = evs(r, prefix, "after_a")[0]["a"]
    assert steps.count("a") == 1, steps
    assert steps.count("b") == 1, steps
    assert out["a"] == first_a


def test_checkpoint_outage_refused_connections_between_two_checkpoints_replays_the_first(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Crossing 6 with the lock Redis down (connections refused; AOF keeps checkpoint a) rather than stalled: the
    release of the stopped body fails too, so the lease of the call's own id outlives it; the re-delivery must
    still replay a, run b once and finish within a bounded time (the lease TTL, a watch)."""
    with RedisServer(persistent=True) as srv:
        cfg = cfg_for(prefix, redis_url, srv)
        app = fleet.app(cfg)
        w = fleet.worker(cfg, concurrency=2)
        key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
        res = app.tasks["xc.cp"].delay(key, gate, "cp")
        wait_for(lambda: evs(r, prefix, "after_a"), 30, what="checkpoint a recorded")
        srv.stop()
        r.set(gate, 1)
        wait_for(lambda: "checkpoint 'b' read" in w.output(), 30, what="checkpoint b to meet the outage")
        wait_for(lambda: w.output().count("lock.waiting") >= 2, 30, what="the re-delivery to wait again")
        srv.start()
        t0 = time.time()
        out = res.get(timeout=120)
        print(w.output()[-6000:])
        print("finished after", time.time() - t0)
        steps = [x["step"] for x in evs(r, prefix, "step")]
        first_a = evs(r, prefix, "after_a")[0]["a"]
        assert steps.count("a") == 1, steps
        assert steps.count("b") == 1, steps
        assert out["a"] == first_a


def parked(lock: redis.Redis, prefix: str, key: str, n: int = 1) -> None:
    wait_for(lambda: lock.llen(f"{prefix}:v1:{{{key}}}:wait") >= n, 30, what=f"{n} waiter(s) parked on {key}")


def started(r: redis.Redis, prefix: str, tag: str) -> bool:
    return bool(evs(r, prefix, "start", tag=tag))


def max_overlap(rows: list[dict[str, Any]]) -> int:
    starts = {x["task_id"]: x["t"] for x in rows if x["ev"] == "start"}
    ends = {x["task_id"]: x["t"] for x in rows if x["ev"] == "end"}
    points = sorted([(t, 1) for t in starts.values()] + [(ends.get(k, float("inf")), -1) for k in starts])
    cur = best = 0
    for _, d in sorted(points, key=lambda p: (p[0], p[1])):
        cur += d
        best = max(best, cur)
    return best


def test_slot_release_during_a_stall_still_wakes_the_parked_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 3: fail_closed x lock_limit=2 with a parked waiter. A slot holder ends while the lock Redis is
    stalled (its release times out): after the resume the waiter runs within a bounded time, never a third."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=4)
    lock = srv.client()
    key = uuid.uuid4().hex[:6]
    gates = [f"{prefix}:gate:{i}" for i in range(3)]
    hs = [app.tasks["xc.slot"].delay(key, gates[i], f"h{i}") for i in range(2)]
    wait_for(lambda: started(r, prefix, "h0") and started(r, prefix, "h1"), 30, what="both slots")
    waiter = app.tasks["xc.slot"].delay(key, gates[2], "waiter")
    parked(lock, prefix, f"xc:{key}")
    srv.pause()
    r.set(gates[0], 1)
    wait_for(lambda: "release: " in w.output(), 30, what="h0's release to meet the stall")
    time.sleep(1)
    srv.resume()
    resumed = time.time()
    wait_for(lambda: started(r, prefix, "waiter"), 30, what="the waiter to run after the resume")
    print("waiter started", evs(r, prefix, "start", tag="waiter")[0]["t"] - resumed, "s after the resume")
    r.set(gates[1], 1)
    r.set(gates[2], 1)
    for h in [*hs, waiter]:
        h.get(timeout=30)
    print(w.output()[-5000:])
    assert max_overlap(records(r, prefix)) <= 2


def lease_keys(lock: redis.Redis, prefix: str, *keys: str) -> dict[str, dict[str, str]]:
    out = {}
    for k in keys:
        h = lock.hgetall(f"{prefix}:v1:{{{k}}}:lock")
        if h:
            out[k] = h
    return out


def test_fail_open_multi_entity_acquire_that_timed_out_leaves_no_leases_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 4: fail_open x multi-entity lock_key. The lock Redis stalls at ACQUIRE_MULTI: the body runs
    unlocked (``lock.fail_open``). The stalled script still runs on the server when it resumes, so both
    entities get leases of this call's token that nobody renews or releases: after the body ended (Redis back
    long before), both entities must be free, not blocked until lock_ttl by a lease of a finished call."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    lock = srv.client()
    a, b = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    app.tasks["xc.one"].delay("warm", "", "warm").get(timeout=30)  # the child's lock connection is open
    app.tasks["xc.multi_open"].delay("w1", "w2", "", "warm2").get(timeout=30)  # and ACQUIRE_MULTI is loaded
    srv.pause()
    res = app.tasks["xc.multi_open"].delay(a, b, gate, "m")
    wait_for(lambda: started(r, prefix, "m"), 30, what="the body to run unlocked")
    srv.resume()
    assert "lock.fail_open" in w.output()
    time.sleep(0.5)
    r.set(gate, 1)
    out = res.get(timeout=30)
    assert out["locked"] is False
    ended = time.time()
    left = lease_keys(lock, prefix, f"xc:{a}", f"xc:{b}")
    print(left, w.output()[-3000:])
    # a second call on one entity must not wait out the lease of the finished fail-open call
    other = app.tasks["xc.one"].delay(a, "", "after")
    other.get(timeout=30)
    waited = evs(r, prefix, "start", tag="after")[0]["t"] - ended
    assert not left, f"leases of a finished fail-open call left behind (the next call waited {waited:.1f}s): {left}"
    assert waited < 2.0, f"the next call on the entity waited {waited:.1f}s for the leftover lease"


def test_fail_open_until_done_published_without_claim_runs_once_and_dedupes_later_publishes(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 2: fail_open x until_done. The lock Redis is down at publish (sent without a claim, logged) and
    back before the delivery: the delivery runs once, under a lease; an identical copy published during the
    outage is skipped when delivered (identical work running), and an identical publish while it runs is never
    sent (answered with the holder). Nothing is left behind."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=3)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    task = app.tasks["xc.ud_open"]
    srv.stop()
    a = task.apply_async((key, gate, "A"), countdown=3)
    b = task.apply_async((key, gate, "A"), countdown=3.5)  # identical work, also published without a claim
    srv.start()
    wait_for(lambda: evs(r, prefix, "start", task_id=a.id), 30, what="A to run")
    c = task.delay(key, gate, "A")  # identical work while A runs: answered with A, never sent
    time.sleep(2)
    r.set(gate, 1)
    out_a = a.get(timeout=30)
    out_b = b.get(timeout=30)
    print(out_a, out_b, c.id, a.id, b.id, w.output()[-4000:])
    assert out_a["locked"] is True
    assert len(evs(r, prefix, "start")) == 1, evs(r, prefix, "start")
    assert c.id == a.id or c.id not in w.output()
    lock = srv.client()
    wait_for(lambda: not lease_keys(lock, prefix, f"xc:{key}"), 10, what="the lease released")
    assert not lock.exists(f"{prefix}:v1:{{xc:{key}}}:claim")


@pytest.mark.parametrize("name", ["xc.one_open", "xc.ud_open"])
def test_fail_open_single_entity_acquire_that_timed_out_leaves_no_lease_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer, name: str
) -> None:
    """Crossing 4's defect on one entity (while_running; until_done published with its claim while Redis was
    up): the ACQUIRE that timed out runs on the server at the resume and leaves a ``running`` lease of a call
    that ran unlocked and ended; the next call on the entity waits it out (lock_ttl)."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    lock = srv.client()
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    app.tasks[name].delay("warm", "", "warm").get(timeout=30)  # the child's connection open, its scripts loaded
    res = app.tasks[name].apply_async((key, gate, "m"), countdown=1)
    time.sleep(0.5)
    srv.pause()
    wait_for(lambda: started(r, prefix, "m"), 30, what="the body to run unlocked")
    srv.resume()
    assert "lock.fail_open" in w.output()
    time.sleep(0.5)
    r.set(gate, 1)
    out = res.get(timeout=30)
    assert out["locked"] is False
    ended = time.time()
    left = lease_keys(lock, prefix, f"xc:{key}")
    other = app.tasks["xc.one"].delay(key, "", "after")
    other.get(timeout=30)
    waited = evs(r, prefix, "start", tag="after")[0]["t"] - ended
    print(w.output()[-3000:])
    assert not left, f"lease of a finished fail-open call left behind (the next call waited {waited:.1f}s): {left}"
    assert waited < 2.0


@pytest.mark.parametrize("fault", ["pause", "stop"])
def test_fail_closed_debounce_outage_at_delivery_runs_the_burst_once(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, fault: str
) -> None:
    """Crossing 1: fail_closed x lock_debounce. A burst of three publishes is recorded; the lock Redis is down
    (stalled, or refusing with its data kept) when the messages come due: every delivery waits, and once Redis
    is back exactly one run happens, with the last publish's arguments; the others are superseded visibly."""
    with RedisServer(persistent=True) as srv:
        cfg = cfg_for(prefix, redis_url, srv)
        app = fleet.app(cfg)
        w = fleet.worker(cfg, concurrency=3)
        key = uuid.uuid4().hex[:6]
        app.tasks["xc.deb"].delay("warm", "", "warm").get(timeout=30)
        rs = [app.tasks["xc.deb"].delay(key, "", f"p{i}") for i in range(3)]
        if fault == "pause":
            srv.pause()
        else:
            srv.stop()
        wait_for(lambda: w.output().count("lock.waiting") >= 3, 30, what="the deliveries to wait for Redis")
        time.sleep(1)
        if fault == "pause":
            srv.resume()
        else:
            srv.start()
        outs = [x.get(timeout=90) for x in rs]
        print(outs, w.output()[-5000:])
        runs = [x for x in evs(r, prefix, "start") if x["tag"] != "warm"]
        assert [x["tag"] for x in runs] == ["p2"], runs
        assert outs[2]["tag"] == "p2"
        assert all(o.get("lockguard") == "superseded" for o in outs[:2]), outs


def test_restart_without_persistence_while_a_waiter_is_parked_the_waiter_still_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """Crossing 5: the lock Redis restarts empty while a waiter is parked behind a running holder. The waiter
    queue is gone, so no release wakes it: its safety copy (due a holder TTL after it parked) runs it; the
    holder learns its lease is gone first (``lock.lost``), so a body beside it is never silent."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=3)
    lock = srv.client()
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    holder = app.tasks["xc.one"].delay(key, gate, "holder")
    wait_for(lambda: started(r, prefix, "holder"), 30, what="the holder")
    waiter = app.tasks["xc.one"].delay(key, "", "waiter")
    parked(lock, prefix, f"xc:{key}")
    srv.stop()
    srv.start()
    restarted = time.time()
    out = waiter.get(timeout=40)
    began = evs(r, prefix, "start", tag="waiter")[0]["t"]
    print("waiter ran", began - restarted, "s after the restart", out)
    r.set(gate, 1)
    holder.get(timeout=30)
    log = w.output()
    print(log[-4000:])
    assert "lock.lost" in log
    assert began - restarted < 15


def test_restart_without_persistence_while_a_workflow_is_in_its_gap_ends_visibly(
    fleet: Fleet, redis_url: str, prefix: str, srv: RedisServer
) -> None:
    """Crossing 5: the lock Redis restarts empty while a workflow is between members. The next member finds no
    lease: the chain must end (a result or a visible failure) within a bounded time, never hang."""
    from celery import chain

    from celery_lockguard import workflow
    from celery_lockguard._keys import lock_name

    from .test_workflow_workers import PIPELINE, rows, start_worker
    from .workflowapp import create_app

    cfg = cfg_for(prefix, redis_url, srv)
    w = start_worker(fleet, cfg)
    app = create_app(cfg)
    rec = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    lock = srv.client()
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    sig = chain(step.s(tenant=tenant, tag="a", seconds=0), step.s(tenant=tenant, tag="b", seconds=0).set(countdown=3))
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=5, gap_ttl=60).apply_async()
    name = lock_name(cfg["prefix"], f"tenant:{tenant}:pipeline")
    wait_for(lambda: lock.hget(name, "state") == "gap", 60, interval=0.01, what="the lease handed on to b")
    srv.stop()
    srv.start()
    t0 = time.time()
    try:
        out = res.get(timeout=60)
    except Exception as exc:  # noqa: BLE001 - a visible end is what is asked
        out = exc
    print("ended after", time.time() - t0, repr(out), rows(rec, cfg, tenant), w.output()[-3000:])
    assert time.time() - t0 < 30


def warm(app: Any, r: redis.Redis, prefix: str, name: str, n: int) -> None:
    """Run ``n`` calls of ``name`` at once, so that each of ``n`` pool children has its lock connection open and
    the task's scripts loaded (a stalled server then gets the next command itself, not a connect or a load)."""
    g = f"{prefix}:warmgate"
    rs = [app.tasks[name].delay(f"warm{i}", g, f"warm{i}") for i in range(n)]
    wait_for(lambda: all(started(r, prefix, f"warm{i}") for i in range(n)), 30, what="warm-up calls")
    r.set(g, 1)
    for x in rs:
        x.get(timeout=30)


def test_fail_closed_slot_acquire_that_timed_out_is_adopted_by_its_wait(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """fail_closed x lock_limit=2: ACQUIRE_SLOTS times out in a stall and runs at the resume, taking the free
    slot under the attempt's token. The wait copy carries that token (docs: a wait after an ACQUIRE that errored
    adopts that attempt's orphan): it must run at once in its own slot, not wait out lock_ttl behind itself."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    warm(app, r, prefix, "xc.slot", 2)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    h0 = app.tasks["xc.slot"].delay(key, gate, "h0")
    wait_for(lambda: started(r, prefix, "h0"), 30, what="h0 in a slot")
    srv.pause()
    x = app.tasks["xc.slot"].delay(key, "", "x")
    wait_for(lambda: "reason=backend_unavailable" in w.output(), 30, what="x's ACQUIRE to time out")
    srv.resume()
    resumed = time.time()
    out = x.get(timeout=40)
    began = evs(r, prefix, "start", tag="x")[0]["t"]
    r.set(gate, 1)
    h0.get(timeout=30)
    print("x began", began - resumed, "s after the resume", out, w.output()[-4000:])
    assert began - resumed < 3.0, f"x waited {began - resumed:.1f}s behind its own orphan slot"


def test_fail_open_until_done_after_a_timed_out_acquire_the_next_identical_publish_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """The leftover lease of a fail-open until_done run (its ACQUIRE timed out in a stall, ran at the resume)
    says ``running`` for a call that has ended: an identical publish after the end is answered with the ended
    call (identical work running) and never sent, for up to lock_ttl; it must be sent and run."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    key = uuid.uuid4().hex[:6]
    task = app.tasks["xc.ud_open"]
    task.delay("warm", "", "warm").get(timeout=30)
    first = task.apply_async((key, "", "m"), countdown=1)
    time.sleep(0.5)
    srv.pause()
    wait_for(lambda: started(r, prefix, "m"), 30, what="the body to run unlocked")
    srv.resume()
    assert first.get(timeout=30)["locked"] is False
    again = task.delay(key, "", "m")
    print(again.id, first.id, w.output()[-2000:])
    assert again.id != first.id, "an identical publish after the call ended was answered with the ended call"
    assert again.get(timeout=30)["locked"] is True


def test_fail_open_slot_acquire_that_timed_out_leaves_no_slot_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """The same with lock_limit=2 (ACQUIRE_SLOTS): the leftover slot of the ended fail-open call halves the
    entity's capacity until lock_ttl; two calls after it must run side by side at once."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    warm(app, r, prefix, "xc.slot_open", 2)
    key, gate = uuid.uuid4().hex[:6], f"{prefix}:gate"
    srv.pause()
    m = app.tasks["xc.slot_open"].delay(key, "", "m")
    wait_for(lambda: started(r, prefix, "m"), 30, what="the body to run unlocked")
    srv.resume()
    assert m.get(timeout=30)["locked"] is False
    ended = time.time()
    lock = srv.client()
    hashes = [k for k in lock.scan_iter(f"{prefix}:*") if lock.type(k) == "hash"]
    left = {k: v for k, v in ((k, lock.hgetall(k)) for k in hashes) if "token" in v}
    rs = [app.tasks["xc.slot_open"].delay(key, gate, f"n{i}") for i in range(2)]
    wait_for(lambda: started(r, prefix, "n0") or started(r, prefix, "n1"), 30, what="a first call")
    time.sleep(2)
    both = started(r, prefix, "n0") and started(r, prefix, "n1")
    r.set(gate, 1)
    for x in rs:
        x.get(timeout=30)
    print(left, w.output()[-2000:])
    assert not left, f"a slot of the ended fail-open call left behind: {left}"
    assert both, f"only one of two calls could run within {time.time() - ended:.1f}s: a slot is held by nobody"


@pytest.mark.parametrize("name", ["xc.ud", "xc.ud_open"])
def test_until_done_claim_that_timed_out_at_publish_does_not_hold_up_its_own_message(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer, name: str
) -> None:
    """until_done x a stall at publish: CLAIM times out (the message is sent without a claim, logged) but runs
    on the server at the resume, leaving a claim of this very task id under a token the message does not carry.
    The delivery (Redis back) must run at once, under a lease, and leave nothing behind."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:6]
    task = app.tasks[name]
    task.delay("warm", "", "warm").get(timeout=30)  # this process's connection open, CLAIM loaded
    srv.pause()
    t0 = time.time()
    res = task.apply_async((key, "", "m"), countdown=2)
    srv.resume()
    due = t0 + 2
    out = res.get(timeout=40)
    began = evs(r, prefix, "start", tag="m")[0]["t"]
    lock = srv.client()
    print(out, began - due, w.output()[-3000:])
    assert out["locked"] is True
    assert began - due < 2.0, f"the delivery started {began - due:.1f}s after it was due"
    wait_for(lambda: not lease_keys(lock, prefix, f"xc:{key}"), 5, what="nothing left behind")
    assert not lock.exists(f"{prefix}:v1:{{xc:{key}}}:claim")


def test_fail_closed_multi_acquire_that_timed_out_is_adopted_by_its_wait(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, srv: RedisServer
) -> None:
    """fail_closed x multi-entity: ACQUIRE_MULTI times out in a stall and runs at the resume, leasing both
    entities under the attempt's token. The wait copy must adopt them and run promptly (not after lock_ttl),
    and leave nothing behind."""
    cfg = cfg_for(prefix, redis_url, srv)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=1)
    lock = srv.client()
    app.tasks["xc.multi"].delay("w1", "w2", "", "warm").get(timeout=30)
    a, b = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    srv.pause()
    m = app.tasks["xc.multi"].delay(a, b, "", "m")
    wait_for(lambda: "reason=backend_unavailable" in w.output(), 30, what="ACQUIRE_MULTI to time out")
    srv.resume()
    resumed = time.time()
    out = m.get(timeout=40)
    began = evs(r, prefix, "start", tag="m")[0]["t"]
    print(out, began - resumed, w.output()[-3000:])
    assert out["locked"] is True
    assert began - resumed < 3.0, f"ran {began - resumed:.1f}s after the resume"
    wait_for(lambda: not lease_keys(lock, prefix, f"xc:{a}", f"xc:{b}"), 5, what="nothing left behind")


@pytest.mark.parametrize("fault", ["pause", "stop"])
def test_fail_closed_debounce_outage_at_publish_and_delivery_loses_no_run(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, fault: str
) -> None:
    """Crossing 1 with the lock Redis down at publish too: each publish goes out without a record (logged,
    docs/debounce.md: an outage costs extra runs, never a lost one) and waits at delivery (fail_closed). Once
    Redis is back the burst runs at least once, the last publish's arguments among its runs, and every message
    ends with a result (none dropped silently). In which order the waiting copies run after the outage is not
    promised: none of them has a debounce record to order them by."""
    with RedisServer(persistent=True) as srv:
        cfg = cfg_for(prefix, redis_url, srv)
        app = fleet.app(cfg)
        w = fleet.worker(cfg, concurrency=2)
        key = uuid.uuid4().hex[:6]
        task = app.tasks["xc.deb"]
        task.delay("warm", "", "warm").get(timeout=30)
        if fault == "pause":
            srv.pause()
        else:
            srv.stop()
        rs = [task.delay(key, "", f"p{i}") for i in range(3)]
        wait_for(lambda: w.output().count("lock.waiting") >= 3, 30, what="the deliveries to wait for Redis")
        if fault == "pause":
            srv.resume()
        else:
            srv.start()
        outs = [x.get(timeout=90) for x in rs]
        runs = [x["tag"] for x in evs(r, prefix, "start") if x["tag"] != "warm"]
        print(fault, outs, runs)
        assert "p2" in runs, runs  # the last publish's arguments ran
        assert all(o for o in outs), outs
