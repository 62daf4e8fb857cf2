"""Several entities as one acquisition, on real prefork workers and a real Redis (issue 32)."""

from __future__ import annotations

import random
import time
import uuid

import pytest
import redis

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard.testing import WaitTimeout, wait_for

from .conftest import Fleet, make_cfg
from .test_workers import intervals, overlapping, records

pytestmark = pytest.mark.integration

#: Seconds from a lease's end to the woken waiter's start: far below the 30 s safety countdown.
BOUND = 5.0
#: How long a revoked waiter's discard may take to give its kept reservation back (its TTL is ~37 s).
GIVE_BACK = 15.0


def hold(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    """A foreign holder of ``pair:{key}`` for 30 s (other work: a contender parks behind it)."""
    got = L.acquire(
        r, prefix, f"pair:{key}", ttl_ms=30_000, task_id=f"holder-{uuid.uuid4().hex[:6]}", task_name="ops.holder",
        digest="d", worker="w@h", fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease), got
    return got


def parked(r: redis.Redis, prefix: str, key: str) -> None:
    wait_for(lambda: r.llen(f"{prefix}:v1:{{{key}}}:wait") >= 1, 30, what=f"a waiter parked on {key}")


def started(r: redis.Redis, prefix: str, task_id: str, timeout: float) -> float:
    def start() -> float | None:
        rows = [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == task_id]
        return rows[0]["t"] if rows else None

    return wait_for(start, timeout, what=f"{task_id} to start (its safety copy is 30 s away)")


def test_opposite_orders_never_deadlock_and_never_overlap(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    fleet.worker(cfg)
    task = app.tasks["multi_pair"]
    rng = random.Random(32)
    names = [f"{prefix[-4:]}{c}" for c in "xyz"]
    pairs = [tuple(rng.sample(names, 2)) for _ in range(30)]
    pairs += [(b, a) for a, b in pairs[:10]]  # the same pairs in the opposite order
    results = [task.delay(a, b, "", f"t{i}", 0.05) for i, (a, b) in enumerate(pairs)]
    started_at = time.monotonic()
    outs = [res.get(timeout=180) for res in results]
    assert [o["tag"] for o in outs] == [f"t{i}" for i in range(len(pairs))]
    # Every wait ended by a release (a woken waiter), never by a 30 s lease TTL or safety copy: nobody
    # held part of a set while it waited, and no crossed pair of waiters stalled each other.
    assert time.monotonic() - started_at < 28
    rows = records(r, prefix)
    for name in names:
        entity = f"pair:{name}"
        spans = intervals([x for x in rows if entity in x["keys"]])
        assert len(spans) == sum(1 for a, b in pairs if name in (a, b))
        assert overlapping(spans) == [], f"two bodies held {entity} at once"
    # one fence per entity, strictly increasing across the bodies that held it
    for name in names:
        entity = f"pair:{name}"
        fences = [o["fences"][entity] for o in outs if entity in o["fences"]]
        assert len(set(fences)) == len(fences)
    left = {n: r.hgetall(f"{prefix}:v1:{{pair:{n}}}:lock") for n in names}
    assert not any(left.values()), left


def test_the_release_of_the_blocking_entity_wakes_a_multi_waiter_and_a_new_blocker_parks_it_again(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    x, y = sorted(uuid.uuid4().hex[:8] for _ in range(2))  # x first in the set's order: y is given back
    first = hold(r, prefix, y)
    waiter = app.tasks["multi_pair"].delay(x, y, "", "waiter")
    parked(r, prefix, f"pair:{y}")
    assert not r.exists(f"{prefix}:v1:{{pair:{x}}}:lock"), "a waiter holds no part of its set"
    assert r.llen(f"{prefix}:v1:{{pair:{x}}}:wait") == 0, "it parks on the entity that blocked it only"
    second = hold(r, prefix, x)  # another entity of the set is taken meanwhile
    s = settings(app)
    handoff.release(app, s, r, f"pair:{y}", first.token, "ops.holder", first.task_id)  # y's end wakes the waiter
    # its woken copy meets x held: it gives y's reservation back and parks on x
    parked(r, prefix, f"pair:{x}")
    wait_for(lambda: not r.exists(f"{prefix}:v1:{{pair:{y}}}:lock"), 10, what="the reservation of y given back")
    assert r.llen(f"{prefix}:v1:{{pair:{y}}}:wait") == 0
    handoff.release(app, s, r, f"pair:{x}", second.token, "ops.holder", second.task_id)
    ended = time.time()
    assert started(r, prefix, waiter.id, BOUND) - ended < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"


def test_a_woken_multi_waiter_blocked_further_up_the_order_keeps_its_reservation_through_the_wait(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    lo, hi = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    first = hold(r, prefix, lo)
    waiter = app.tasks["multi_pair"].delay(hi, lo, "", "waiter")
    parked(r, prefix, f"pair:{lo}")
    second = hold(r, prefix, hi)  # the entity after lo in the order is taken meanwhile
    s = settings(app)
    handoff.release(app, s, r, f"pair:{lo}", first.token, "ops.holder", first.task_id)  # wakes the waiter
    # its woken copy meets hi held: it keeps lo reserved (sorted before hi) for its wait and parks on hi
    parked(r, prefix, f"pair:{hi}")
    kept = r.hgetall(f"{prefix}:v1:{{pair:{lo}}}:lock")
    assert kept.get("state") == "handed", kept
    # as long as the safety copy's countdown (the holder's 30 s TTL) plus the grace, not a 5 s reservation
    assert r.pttl(f"{prefix}:v1:{{pair:{lo}}}:lock") > handoff.RESERVATION_TTL * 1000 + 10_000
    assert r.llen(f"{prefix}:v1:{{pair:{lo}}}:wait") == 0
    handoff.release(app, s, r, f"pair:{hi}", second.token, "ops.holder", second.task_id)
    ended = time.time()
    assert started(r, prefix, waiter.id, BOUND) - ended < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"
    assert not r.exists(f"{prefix}:v1:{{pair:{lo}}}:lock"), "the kept reservation was adopted, then released"


def test_a_revoked_multi_waiter_gives_back_its_kept_reservations_at_once(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """A waiter (lo, hi) keeps lo reserved and parks on hi; it is revoked: when its copy is discarded, lo is
    given back with hi's reservation and lo's waiter woken, not left to the kept reservation's ~37 s TTL."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    worker = fleet.worker(cfg, concurrency=2)
    lo, hi = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    first = hold(r, prefix, lo)
    waiter = app.tasks["multi_pair"].delay(hi, lo, "", "waiter")
    parked(r, prefix, f"pair:{lo}")
    second = hold(r, prefix, hi)
    s = settings(app)
    handoff.release(app, s, r, f"pair:{lo}", first.token, "ops.holder", first.task_id)  # wakes the waiter
    parked(r, prefix, f"pair:{hi}")  # it keeps lo reserved and parks on hi
    assert r.hgetall(f"{prefix}:v1:{{pair:{lo}}}:lock").get("state") == "handed"
    replies = app.control.revoke(waiter.id, reply=True, timeout=5)
    assert replies, "no worker acknowledged the revoke"
    kept = f"{prefix}:v1:{{pair:{lo}}}:lock"
    kept_token = r.hget(kept, "token")
    # The single-key task meets the kept reservation: it parks behind it or, delivered once the reservation no
    # longer reads as renewed (a loaded machine), backs off. Either way it waits; which is timing (CI saw both).
    single = app.tasks["multi_single"].delay(lo, "single")
    # hi's end wakes the revoked waiter: the worker discards its woken copy, which frees hi and the kept lo
    handoff.release(app, s, r, f"pair:{hi}", second.token, "ops.holder", second.task_id)
    applied = time.time()
    # Within GIVE_BACK, well under the kept reservation's ~37 s TTL it guards against: the discard runs in the
    # worker's main process, which a loaded CI machine (xdist processes, other tests' workers) can hold for seconds.
    try:
        wait_for(lambda: r.hget(kept, "token") != kept_token, GIVE_BACK, what="the kept reservation on lo given back")
    except WaitTimeout:
        tail = "\n".join(worker.log().splitlines()[-25:])
        raise AssertionError(f"lo still kept: {r.hgetall(kept)} pttl={r.pttl(kept)}; worker log:\n{tail}") from None
    assert time.time() - applied < GIVE_BACK, "given back at once, not left to the kept reservation's ~37 s TTL"
    # Parked: woken at once; backing off: at its next try (a step of a few seconds at most by then).
    assert started(r, prefix, single.id, BOUND + 8) - applied < BOUND + 8
    assert single.get(timeout=30)["tag"] == "single"
    assert not [x for x in records(r, prefix) if x["task_id"] == waiter.id], "the revoked waiter ran"


def test_a_terminated_multi_entity_holder_frees_every_entity_and_wakes_each_ones_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    task = app.tasks["multi_pair"]
    x, y, z = (uuid.uuid4().hex[:8] for _ in range(3))
    holder = task.delay(x, y, f"{prefix}:never", "holder")
    wait_for(lambda: records(r, prefix), 30, what="the holder's body")
    waiters = [task.delay(x, z, "", "wx"), task.delay(y, z + "b", "", "wy")]  # one parks on x, one on y
    parked(r, prefix, f"pair:{x}")
    parked(r, prefix, f"pair:{y}")
    # SIGKILL: the child runs no release; the main process cuts every entity of the set to the grace (2 s).
    app.control.revoke(holder.id, terminate=True, signal="SIGKILL")
    revoked_at = time.time()
    for w in waiters:
        assert started(r, prefix, w.id, BOUND + 2) - revoked_at < BOUND
    assert sorted(w.get(timeout=30)["tag"] for w in waiters) == ["wx", "wy"]


def test_many_crossed_transfers_among_few_entities_all_finish(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Regression (the transfer soak's livelock): woken multi-entity waiters met each other's reservations,
    each gave its own back to the other and parked on the other's entity, over and over; calls stayed
    parked for minutes. A woken waiter now keeps the reservations sorted before its blocker (global order)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    fleet.worker(cfg)
    task = app.tasks["multi_pair"]
    rng = random.Random(5)
    names = [f"{prefix[-4:]}{c}" for c in "abcd"]
    pairs = [tuple(rng.sample(names, 2)) for _ in range(120)]
    results = [task.delay(a, b, "", f"t{i}", 0.01) for i, (a, b) in enumerate(pairs)]
    deadline = time.monotonic() + 60  # one entity's lock_key: ~10 s; the livelock left calls parked for minutes
    outs = [res.get(timeout=max(0.1, deadline - time.monotonic())) for res in results]
    assert [o["tag"] for o in outs] == [f"t{i}" for i in range(len(pairs))]
    rows = records(r, prefix)
    for name in names:
        spans = intervals([x for x in rows if f"pair:{name}" in x["keys"]])
        assert overlapping(spans) == [], f"two bodies held pair:{name} at once"
