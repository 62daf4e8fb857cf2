"""Third fresh-context review: two features crossed at a time, real prefork workers, real Redis.

Tasks in ``tests/xr3app.py``: leases of 30 s, so a waiter that starts within :data:`BOUND` of a lease's
end was woken by that end, not by its safety copy.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_wake_workers import BOUND, parked, started
from .test_workers import records

pytestmark = pytest.mark.integration


def lock_key(prefix: str, key: str) -> str:
    return f"{prefix}:v1:{{{key}}}:lock"


def starts(r: redis.Redis, prefix: str, task_id: str) -> list[dict]:
    return [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == task_id]


def test_a_multi_entity_retry_wakes_the_waiter_parked_on_each_entity(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """multi-entity x retry(countdown): retry() frees every entity of the set before the retry is published,
    and each freed entity's parked waiter starts at once (not at its 30 s safety copy); the retry runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    a, b = (uuid.uuid4().hex[:8] for _ in range(2))
    gate = f"{prefix}:gate"
    holder = app.tasks["xr.multi"].delay(a, b, gate, "holder", 1, 3.0)
    wait_for(lambda: starts(r, prefix, holder.id), 30, what="the multi holder to start")
    wa = app.tasks["xr.single"].delay(a, "", "wa")
    parked(r, prefix, f"xm:{a}")
    wb = app.tasks["xr.single"].delay(b, "", "wb")
    parked(r, prefix, f"xm:{b}")
    r.set(gate, 1)
    opened = time.time()
    for w in (wa, wb):
        assert started(r, prefix, w.id, BOUND + 3) - opened < BOUND
    assert holder.get(timeout=30) == {"tag": "holder", "retries": 1, "slot": None}
    assert sorted(w.get(timeout=30)["tag"] for w in (wa, wb)) == ["wa", "wb"]
    wait_for(lambda: not r.exists(lock_key(prefix, f"xm:{a}"), lock_key(prefix, f"xm:{b}")), 10, what="both freed")


def test_a_slot_holder_retrying_wakes_the_waiter_parked_behind_the_full_limit(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """lock_limit x retry(countdown): both slots held, a third parks; one holder retries: its slot is freed
    and the parked waiter starts at once in it; the retry then waits for a slot and runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    g1, g2 = f"{prefix}:g1", f"{prefix}:g2"
    task = app.tasks["xr.slot"]
    h1 = task.delay(p, g1, "h1", 1, 2.0)
    h2 = task.delay(p, g2, "h2", 0, 0)
    wait_for(lambda: starts(r, prefix, h1.id) and starts(r, prefix, h2.id), 30, what="both slots held")
    w = task.delay(p, "", "w")
    parked(r, prefix, f"xs:{p}")
    r.set(g1, 1)
    opened = time.time()
    assert started(r, prefix, w.id, BOUND + 3) - opened < BOUND
    assert w.get(timeout=30)["tag"] == "w"
    r.set(g2, 1)
    assert h1.get(timeout=60)["retries"] == 1
    assert h2.get(timeout=30)["tag"] == "h2"


def test_an_until_done_retry_longer_than_the_queue_claim_keeps_its_claim_through_the_countdown(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x retry(countdown > queue_lock_ttl): the claim handed to the retry message lives at least
    its countdown, so an identical publish during the countdown is answered with the queued retry (no
    second run), and the retry runs once."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["xr.ud"]
    first = task.delay(key, "", "t", 1, 8.0)  # queue_lock_ttl=2, countdown 8 s
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    name = lock_key(prefix, f"xu:{key}")
    wait_for(lambda: r.hget(name, "state") == "queued", 10, what="the claim handed over to the retry")
    handed_at = time.monotonic()
    ttl_at_handover = r.pttl(name)
    assert ttl_at_handover > 6_000, ttl_at_handover
    # let the queue claim's own TTL (2 s) pass: the hand-over must outlive it, the retry is 8 s away
    wait_for(lambda: time.monotonic() - handed_at > 3.5, 10, what="queue_lock_ttl to pass")
    assert r.hget(name, "state") == "queued", r.hgetall(name)
    dup = task.delay(key, "", "t", 1, 8.0)  # identical work: the queued retry answers it
    assert dup.id == first.id, "an identical publish during the retry's countdown was not deduplicated"
    assert first.get(timeout=30) == {"tag": "t", "retries": 1, "slot": None}
    assert len(starts(r, prefix, first.id)) == 2
    wait_for(lambda: not r.exists(name), 10, what="the claim freed by the retry's end")


def test_an_until_done_retry_hands_the_claim_over_and_its_end_wakes_the_parked_other_work(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x retry x park/wake: other work parked behind the running body stays behind the handed-over
    claim and starts as soon as the retry's body ends (not at its safety copy)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    first = app.tasks["xr.ud"].delay(key, gate, "ud", 1, 2.0)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    other = app.tasks["xr.ud_other"].delay(key, "", "other")
    parked(r, prefix, f"xu:{key}")
    r.set(gate, 1)
    assert first.get(timeout=30)["retries"] == 1
    ended = time.time()
    assert started(r, prefix, other.id, BOUND + 3) - ended < BOUND
    rows = [x["tag"] for x in records(r, prefix) if x["ev"] == "start"]
    assert rows == ["ud", "ud", "other"], rows


def test_a_multi_entity_until_done_retry_frees_the_other_entities_and_wakes_their_waiters(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """multi-entity x until_done x retry: the hand-over keeps the claim on its anchor and frees the other
    entities, waking their parked waiters at once; the retry then runs and frees everything."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    a, b = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    gate = f"{prefix}:gate"
    holder = app.tasks["xr.multi_ud"].delay(a, b, gate, "holder", 1, 4.0)
    wait_for(lambda: starts(r, prefix, holder.id), 30, what="the holder to start")
    wb = app.tasks["xr.single"].delay(b, "", "wb")
    parked(r, prefix, f"xm:{b}")
    r.set(gate, 1)
    opened = time.time()
    assert started(r, prefix, wb.id, BOUND + 3) - opened < BOUND
    assert holder.get(timeout=30) == {"tag": "holder", "retries": 1, "slot": None}
    wait_for(lambda: not r.exists(lock_key(prefix, f"xm:{a}"), lock_key(prefix, f"xm:{b}")), 10, what="both freed")


def test_an_until_done_body_killed_mid_run_is_redelivered_runs_once_and_frees_the_entity(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis
) -> None:
    """until_done x SIGKILL of the child mid-body (acks_late, reject_on_worker_lost): the redelivered copy
    takes its own dead claim over at once (same host, pid gone), completes, and leaves nothing held."""
    cfg = broker_cfg
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    res = app.tasks["xr.ud_kill"].delay(key, "k")
    began = time.time()
    assert res.get(timeout=60) == {"tag": "k"}
    assert time.time() - began < 20, "the redelivered copy waited out the dead holder's 30 s lease"
    rows = [x["ev"] for x in records(r, prefix) if x.get("task_id") == res.id]
    assert rows == ["start", "start", "end"], rows
    wait_for(lambda: not r.exists(lock_key(prefix, f"xk:{key}")), 10, what="the entity freed")
    again = app.tasks["xr.ud_kill"].delay(key, "k")
    assert again.id != res.id and again.get(timeout=30) == {"tag": "k"}


def force_release(app: object, key: str) -> str:
    """``celery lockguard release KEY --yes`` in process, on the test's app (its prefix and lock Redis)."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lockguard._cli import lockguard

    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["release", key, "--yes"], obj=obj)
    assert out.exit_code == 0, out.output
    return out.output


def test_a_multi_entity_body_killed_mid_run_is_redelivered_and_takes_its_dead_set_over(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis
) -> None:
    """multi-entity x SIGKILL (acks_late): the redelivered copy (same id, same host, pid gone) takes every
    entity of its dead set over at once and runs, rather than waiting out the 30 s leases."""
    cfg = broker_cfg
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    a, b = (uuid.uuid4().hex[:8] for _ in range(2))
    began = time.time()
    res = app.tasks["xr.multi_kill"].delay(a, b, "k")
    assert res.get(timeout=60) == {"tag": "k"}
    assert time.time() - began < 20, "the redelivered copy waited out its dead set's 30 s leases"
    rows = [x["ev"] for x in records(r, prefix) if x.get("task_id") == res.id]
    assert rows == ["start", "start", "end"], rows
    wait_for(lambda: not r.exists(lock_key(prefix, f"xm:{a}"), lock_key(prefix, f"xm:{b}")), 10, what="both freed")


def test_a_slot_holder_killed_mid_run_is_redelivered_and_the_limit_is_not_exceeded(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis
) -> None:
    """lock_limit x SIGKILL (acks_late): with the other slot held, the redelivered copy takes its own dead
    slot over (same id, same host, pid gone) and runs at once, and the limit of 2 is never exceeded."""
    cfg = broker_cfg
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    p = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    other = app.tasks["xr.slot"].delay(p, gate, "other")
    wait_for(lambda: starts(r, prefix, other.id), 30, what="the other slot holder")
    began = time.time()
    res = app.tasks["xr.slot_kill"].delay(p, "k")
    assert res.get(timeout=60) == {"tag": "k"}
    took = time.time() - began
    r.set(gate, 1)
    assert other.get(timeout=30)["tag"] == "other"
    assert took < 20, f"the redelivered copy waited {took:.1f}s: its dead slot's 30 s lease"


def test_an_until_done_body_terminated_frees_its_claim_and_an_identical_publish_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x revoke(terminate=True): the main process cuts the claim-lease to its grace; an identical
    publish after that is accepted as new work and runs (the entity is not blocked for the 30 s lease)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    first = app.tasks["xr.ud"].delay(key, gate, "t")
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    app.control.revoke(first.id, terminate=True, signal="SIGKILL")
    revoked = time.time()
    wait_for(lambda: not r.exists(lock_key(prefix, f"xu:{key}")), BOUND + 3, what="the claim cut to its grace")
    assert time.time() - revoked < BOUND
    r.set(gate, 1)
    again = app.tasks["xr.ud"].delay(key, gate, "t")
    assert again.id != first.id
    assert again.get(timeout=30)["tag"] == "t"


def test_a_revoked_until_done_retry_frees_its_handed_over_claim_when_it_is_due(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x retry(countdown) x revoke: the retry message holding the handed-over claim is revoked;
    the worker discards it when due and frees the claim then, not at the claim's TTL; new work runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    name = lock_key(prefix, f"xu:{key}")
    first = app.tasks["xr.ud"].delay(key, "", "t", 1, 4.0)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    wait_for(lambda: r.hget(name, "state") == "queued", 30, what="the claim handed over to the retry")
    handed = time.time()
    claim_ttl = r.pttl(name) / 1000
    app.control.revoke(first.id)
    wait_for(lambda: not r.exists(name), claim_ttl + 5, what="the revoked retry's claim freed")
    freed_after = time.time() - handed
    assert freed_after < 4.0 + BOUND < claim_ttl, (freed_after, claim_ttl)
    assert len(starts(r, prefix, first.id)) == 1, "the revoked retry ran"
    again = app.tasks["xr.ud"].delay(key, "", "t2")
    assert again.id != first.id and again.get(timeout=30)["tag"] == "t2"


def test_a_forced_release_of_a_workflow_gap_wakes_the_waiter_and_the_late_member_never_overlaps_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """forced release x workflow lease: released in a gap, the parked plain task starts at once (woken);
    the member that comes after the gap never runs beside it (it waits, or fails visibly with LockLost)."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    p = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    m = app.tasks["rv.wfgate"]
    sig = chain(m.si(p, "", "m1"), m.si(p, "", "m2").set(countdown=5))
    wf = workflow(sig, lock_key="rvp:{p}", p=p, app=app, gap_ttl=300).apply_async()
    name = lock_key(prefix, f"rvp:{p}")
    wait_for(lambda: r.hget(name, "state") == "gap", 30, what="m1 to hand the lease to the gap")
    plain = app.tasks["rv.del"].delay(p, gate, "plain", 3.0)
    parked(r, prefix, f"rvp:{p}")
    out = force_release(app, f"rvp:{p}")
    released = time.time()
    assert started(r, prefix, plain.id, BOUND + 3) - released < BOUND, out
    r.set(gate, 1)
    assert plain.get(timeout=60)["tag"] == "plain"
    try:
        wf.get(timeout=60)
    except Exception as err:  # noqa: BLE001 - a visible failure is allowed; a silent overlap is not
        assert type(err).__name__ == "LockLost", repr(err)
    rows = records(r, prefix, p)
    spans = {x["tag"]: [x["at"], None] for x in rows if x["ev"] == "start"}
    for x in rows:
        if x["ev"] == "end":
            spans[x["tag"]][1] = x["at"]
    if "m2" in spans:
        assert spans["m2"][0] >= spans["plain"][1] or spans["m2"][1] <= spans["plain"][0], spans


def test_a_forced_release_of_an_until_done_retry_claim_never_loses_the_retry(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """forced release x until_done retry hand-over: other work parked behind the running body; the body
    retries (claim handed to the 4 s retry); an operator releases the claim: the waiter runs at once, and
    the retry, arriving while it runs, is accepted work: it waits and runs after it (not lost, not beside)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    g1, g2 = f"{prefix}:g1", f"{prefix}:g2"
    name = lock_key(prefix, f"xu:{key}")
    first = app.tasks["xr.ud"].delay(key, g1, "ud", 1, 4.0)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    other = app.tasks["xr.ud_other"].delay(key, g2, "other")
    parked(r, prefix, f"xu:{key}")
    r.set(g1, 1)
    wait_for(lambda: r.hget(name, "state") == "queued", 30, what="the claim handed over to the retry")
    out = force_release(app, f"xu:{key}")
    released = time.time()
    assert started(r, prefix, other.id, BOUND + 3) - released < BOUND, out
    wait_for(lambda: len(starts(r, prefix, first.id)) == 2 or time.time() - released > 8, 15, what="the retry due")
    r.set(g2, 1)
    assert other.get(timeout=30)["tag"] == "other"
    assert first.get(timeout=60) == {"tag": "ud", "retries": 1, "slot": None}
    rows = records(r, prefix)
    t = {(x["tag"], x["ev"], x.get("retries")): x["t"] for x in rows}
    assert t[("ud", "start", 1)] >= t[("other", "end", 0)], rows


def test_terminating_a_debounced_run_wakes_the_next_bursts_parked_run_within_the_grace(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """debounce x revoke(terminate=True): the next burst's run, parked behind the running one, starts once
    the main process has cut the terminated run's lease to its grace (not after the 30 s TTL)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["xr.deb"]
    v1 = task.delay(key, "v1", f"{prefix}:never")
    wait_for(lambda: starts(r, prefix, v1.id), 30, what="v1 to start")
    nxt = task.delay(key, "A")
    parked(r, prefix, f"xd:{key}")
    app.control.revoke(v1.id, terminate=True, signal="SIGKILL")
    revoked = time.time()
    assert started(r, prefix, nxt.id, BOUND + 3) - revoked < BOUND
    assert nxt.get(timeout=30) == {"tag": "A"}


def test_a_debounced_run_killed_mid_body_with_the_next_burst_parked_ends_on_the_last_arguments(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis
) -> None:
    """debounce x SIGKILL (acks_late): v1 runs and is killed mid-body while the next burst's run A is parked
    behind it; the redelivered v1 and A resolve to one more run of A (the last arguments), A's result is
    its own, and the entity is neither blocked for the 30 s lease nor left held."""
    cfg = broker_cfg
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    task = app.tasks["xr.deb"]
    v1 = task.delay(key, "v1", gate, True)
    wait_for(lambda: starts(r, prefix, v1.id), 30, what="v1 to start")
    nxt = task.delay(key, "A")
    parked(r, prefix, f"xd:{key}")
    r.set(gate, 1)  # v1's first delivery SIGKILLs its child now; its redelivery runs straight through
    began = time.time()
    assert nxt.get(timeout=60) == {"tag": "A"}
    assert time.time() - began < 20, "A waited out the killed run's 30 s lease"
    out = v1.get(timeout=60)
    rows = records(r, prefix)
    ends = [x["tag"] for x in rows if x["ev"] == "end"]
    assert ends and ends[-1] == "A", (ends, out)
    wait_for(lambda: not r.exists(lock_key(prefix, f"xd:{key}")), 10, what="the entity freed")


def hold_entity(r: redis.Redis, prefix: str, key: str) -> object:
    """A foreign holder of ``key`` for 30 s (other work: a contender parks behind it)."""
    from celery_lockguard import _lease as L

    got = L.acquire(
        r, prefix, key, ttl_ms=30_000, task_id=f"holder-{uuid.uuid4().hex[:6]}", task_name="ops.holder",
        digest="d", worker="w@h", fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease), got
    return got


def test_a_woken_multi_waiter_that_gives_up_gives_back_the_reservation_it_was_handed(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """multi-entity park/wake x give-up (lock_max_waits=1): the waiter parks on lo (its one wait); lo's release
    hands it a reservation and wakes it; its woken copy meets hi held and, out of waits, fails visibly
    with LockContended. That exit must give lo back at once (waking lo's next waiter), not keep it reserved
    for the reservation's TTL."""
    from celery_lockguard import _handoff as handoff
    from celery_lockguard._config import settings

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    lo, hi = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    first = hold_entity(r, prefix, f"xm:{lo}")
    waiter = app.tasks["xr.multi_w1"].delay(hi, lo, "waiter")
    parked(r, prefix, f"xm:{lo}")
    behind = app.tasks["xr.single"].delay(lo, "", "behind")  # parks on lo behind the multi waiter
    parked(r, prefix, f"xm:{lo}", 2)
    hold_entity(r, prefix, f"xm:{hi}")
    handoff.release(app, settings(app), r, f"xm:{lo}", first.token, "ops.holder", first.task_id)  # type: ignore[attr-defined]
    with pytest.raises(Exception) as err:
        waiter.get(timeout=30)
    assert type(err.value).__name__ == "LockContended", repr(err.value)
    gave_up = time.time()
    try:
        took = started(r, prefix, behind.id, BOUND + 3) - gave_up
    except Exception:  # noqa: BLE001
        left = r.hgetall(lock_key(prefix, f"xm:{lo}"))
        pytest.fail(f"lo still held after the waiter gave up ({r.pttl(lock_key(prefix, f'xm:{lo}'))} ms): {left}")
    assert took < BOUND, took


@pytest.mark.parametrize("member", ["until_done", "multi"])
def test_a_workflow_member_with_its_own_lock_retrying_past_the_gap_keeps_both_and_frees_both(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, member: str
) -> None:
    """workflow x a member's own lock (until_done claim, or several entities) x retry(countdown > gap_ttl):
    the retry keeps the workflow (other work on its entity waits for the end) and its own lock is handed
    over or freed; the chain finishes and every key ends free."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    p, k1, k2 = (uuid.uuid4().hex[:8] for _ in range(3))
    if member == "until_done":
        first = app.tasks["xr.ud"].si(k1, "", "m1", 1, 4.0)
        own = [lock_key(prefix, f"xu:{k1}")]
    else:
        first = app.tasks["xr.multi"].si(k1, k2, "", "m1", 1, 4.0)
        own = [lock_key(prefix, f"xm:{k1}"), lock_key(prefix, f"xm:{k2}")]
    sig = chain(first, app.tasks["rv.after"].si(p, "m2"))
    wf = workflow(sig, lock_key="xw:{p}", p=p, app=app, gap_ttl=2).apply_async()
    wait_for(lambda: [x for x in records(r, prefix) if x.get("tag") == "m1"], 30, what="m1's first try")
    other = app.tasks["xr.wf_plain"].delay(p, "other")
    assert wf.get(timeout=60) == {"tag": "m2"}
    assert other.get(timeout=60)["tag"] == "other"
    rows = records(r, prefix)
    t_m2 = next(x["t"] for x in rows if x.get("tag") == "m2")
    t_other = next(x["t"] for x in rows if x.get("tag") == "other" and x["ev"] == "start")
    assert t_other >= t_m2, rows
    assert [x.get("retries") for x in rows if x.get("tag") == "m1" and x["ev"] == "start"] == [0, 1]
    wait_for(lambda: not r.exists(*own, lock_key(prefix, f"xw:{p}")), 10, what="every key free")


@pytest.mark.parametrize("mode", ["ud", "multi", "slot", "deb"])
def test_a_redelivery_after_the_body_ran_is_answered_from_its_record_and_frees_the_entity(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis, mode: str
) -> None:
    """completion record ("answered") x until_done / several entities / lock_limit / debounce: the child is
    SIGKILLed after the body ran and released but before the result is stored or the message acked
    (acks_late): the redelivered copy is answered from the record (the side effect ran once), its result is
    the body's, and the entity is free at once afterwards."""
    cfg = broker_cfg
    app = fleet.app(cfg)
    worker = fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    task = app.tasks[f"xr.after_{mode}"]
    res = task.delay(key, "t")
    assert res.get(timeout=60) == {"tag": "t", "effects": 1}
    assert r.get(f"{prefix}:killed:after:{res.id}") == "1"
    wait_for(lambda: [x for x in worker.log().splitlines() if "completion.skipped" in x and res.id in x], 60,
             what="the redelivered copy answered from the record")  # fmt: skip
    assert res.get(timeout=10) == {"tag": "t", "effects": 1}
    assert r.get(f"{prefix}:effects:{res.id}") == "1"
    wait_for(lambda: not r.keys(f"{prefix}:v1:{{xa:{key}*:lock*"), 5, what="the entity free")
    again = task.delay(key, "t2")
    assert again.id != res.id and again.get(timeout=60)["tag"] == "t2"


def test_until_started_a_waiting_identical_copy_is_still_the_one_queued_copy(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started x execution-time wait: A runs; B (identical, accepted once A started) meets A and waits
    (queue modes back off, docs/model.md). B has not started, so it is still the one queued copy: C
    (identical) is answered with B; A then B run, nothing else."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    worker = fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    task = app.tasks["xr.us"]
    a = task.delay(key, gate)
    wait_for(lambda: starts(r, prefix, a.id), 30, what="A to start")
    b = task.delay(key, gate)
    assert b.id != a.id
    wait_for(lambda: f"lock.waiting task_name=xr.us lock_key=xq:{key} task_id={b.id}" in worker.log(), 30,
             what="B to meet A and wait")  # fmt: skip
    c = task.delay(key, gate)
    assert c.id == b.id, "a second queued copy of identical work was accepted while B waits"
    r.set(gate, 1)
    a.get(timeout=30)
    b.get(timeout=60)
    assert len([x for x in records(r, prefix) if x["ev"] == "start"]) == 2
