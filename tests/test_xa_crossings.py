"""Review ``xa``: queue-time modes (until_started / until_done) crossed with one other feature at a time,
through real prefork ``celery worker`` subprocesses and the real Redis. Tasks in ``tests/xaapp.py``
(leases of 30 s: an entity free again within a few seconds was freed, not expired).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_completion_workers import completion_cfg  # noqa: F401 - the fixture: Redis or PostgreSQL records
from .test_workers import records

pytestmark = pytest.mark.integration


def lock_key(prefix: str, key: str) -> str:
    return f"{prefix}:v1:{{{key}}}:lock"


def claim_key(prefix: str, key: str) -> str:
    return f"{prefix}:v1:{{{key}}}:claim"


def starts(r: redis.Redis, prefix: str, task_id: str) -> list[dict[str, Any]]:
    return [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == task_id]


def test_an_until_done_retry_onto_another_entity_frees_the_claim_it_leaves_behind(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x retry(kwargs=...) moving the call to another entity: retry() hands the lease on xa:A over
    to the retry message as its claim, but the retry message renders xa:B, adopts nothing on xa:A and never
    frees it. Expected: once the retry has run (on B), xa:A is free and an identical publish of the original
    work is new work that runs. Actual: xa:A stays claimed ('queued', the retried task id) for queue_lock_ttl
    (3600 s) + countdown, and the identical publish is answered with the finished task's AsyncResult."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    a, b = (uuid.uuid4().hex[:8] for _ in range(2))
    task = app.tasks["xa.shard"]
    first = task.apply_async(kwargs={"shard": a, "move_to": b})
    assert first.get(timeout=30) == {"shard": b, "retries": 1}
    assert not r.exists(lock_key(prefix, f"xa:{b}"))
    leftover = r.hgetall(lock_key(prefix, f"xa:{a}"))
    ttl = r.pttl(lock_key(prefix, f"xa:{a}")) / 1000
    again = task.apply_async(kwargs={"shard": a, "move_to": b})
    assert again.id != first.id, (
        f"identical work answered with the finished task: xa:{a} still claimed {leftover} for {ttl:.0f}s more"
    )
    assert not leftover, f"xa:{a} left claimed for {ttl:.0f}s: {leftover}"


def test_an_until_done_publish_behind_a_killed_holder_is_not_answered_with_the_dead_task(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x a worker child killed mid-body (SIGKILL, no acks_late: the message is not redelivered).
    The dead holder's lease lives out its 30 s TTL. A duplicate is skipped only behind a *live* holder
    (docs/failure-modes.md, "A worker child is killed"; Publish.holder_alive), since the dead holder's work
    will never be redone. Expected: an identical publish is accepted as new work (it waits out the lease at
    execution, then runs). Actual: apply_async answers it with the dead task's AsyncResult (FAILURE,
    WorkerLostError) and the work is never done."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    task = app.tasks["xa.ud"]
    first = task.delay(key, gate)
    rows = wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    os.kill(rows[0]["pid"], signal.SIGKILL)
    wait_for(lambda: first.state == "FAILURE", 30, what="the killed task to be reported lost")
    assert r.hget(lock_key(prefix, f"xa:{key}"), "state") == "running"  # the dead holder's lease, until its TTL
    r.set(gate, 1)
    again = task.delay(key, gate)
    assert again.id != first.id, "identical work answered with a dead holder's failed task: the work is lost"
    assert again.get(timeout=60) == {"key": key}


def test_until_done_tasks_sharing_a_namespace_answer_a_later_publish_from_the_record(
    fleet: Fleet,
    redis_url: str,
    prefix: str,
    r: redis.Redis,
    completion_cfg: dict[str, Any],  # noqa: F811
) -> None:
    """until_done x idempotency_key + idempotency_namespace: capture (xa.cap1) ran; a later publish of the same
    effect, by the same task or the other task of the namespace, is answered from the record (docs/completion.md)
    without running, and leaves the entity S free. On either completion store."""
    cfg = make_cfg(prefix, redis_url, **completion_cfg)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    inv = int(uuid.uuid4().int % 10**8)
    first = app.tasks["xa.cap1"].delay(inv)
    assert first.get(timeout=30) == {"by": "xa.cap1"}
    s_lock = lock_key(prefix, f"xa-pay:{inv}")
    wait_for(lambda: not r.exists(s_lock), 10, what="S free after the run")
    for name in ("xa.cap2", "xa.cap1"):
        again = app.tasks[name].delay(inv)
        assert again.id != first.id
        assert again.get(timeout=30) == {"by": "xa.cap1"}, name
        wait_for(lambda: not r.exists(s_lock, claim_key(prefix, f"xa-pay:{inv}")), 10, what="S free")
    assert [x["name"] for x in records(r, prefix) if x["ev"] == "start"] == ["xa.cap1"]


def test_until_done_tasks_sharing_a_namespace_queued_together_run_the_effect_once(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x namespace, both queued at once: cap2's publish meets cap1's claim (different task: not a
    duplicate) and queues behind it in {S}:claim; delivered, it waits for cap1 and is answered from its record."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    inv = int(uuid.uuid4().int % 10**8)
    one = app.tasks["xa.cap1"].delay(inv)
    two = app.tasks["xa.cap2"].delay(inv)
    dup = app.tasks["xa.cap2"].delay(inv)
    assert dup.id == two.id  # identical work of cap2 queued once
    fleet.worker(cfg, concurrency=2)
    assert one.get(timeout=30) == {"by": "xa.cap1"}
    assert two.get(timeout=60) == {"by": "xa.cap1"}
    assert [x["name"] for x in records(r, prefix) if x["ev"] == "start"] == ["xa.cap1"]
    wait_for(
        lambda: not r.exists(lock_key(prefix, f"xa-pay:{inv}"), claim_key(prefix, f"xa-pay:{inv}")), 10, what="free"
    )


def test_a_multi_entity_until_started_claim_is_freed_at_start_and_by_a_failed_publish(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started x several entities: the claim (on the anchor) dedupes an identical publish while queued,
    is freed when the body starts (one more copy may then queue), and a publish that fails at the broker
    frees the claim it took."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    a, b = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    gate = f"{prefix}:gate"
    task = app.tasks["xa.multi_us"]
    first = task.delay(b, a, gate)  # named out of order: the anchor is the first sorted key
    assert r.hget(claim_key(prefix, f"xam:{a}"), "task_id") == first.id
    assert task.delay(b, a, gate).id == first.id
    fleet.worker(cfg, concurrency=2)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    wait_for(lambda: not r.exists(claim_key(prefix, f"xam:{a}")), 10, what="the claim freed at start")
    second = task.delay(b, a, gate)
    assert second.id != first.id
    assert task.delay(b, a, gate).id == second.id
    r.set(gate, 1)
    assert first.get(timeout=30) == {"a": b, "b": a}
    assert second.get(timeout=60) == {"a": b, "b": a}
    # a failed publish: the same task through a broker that refuses connections
    bad = fleet.app({**cfg, "broker": "redis://127.0.0.1:1/0"})
    bad.conf.task_publish_retry = False
    bad.conf.broker_connection_retry = False
    bad.conf.broker_connection_max_retries = 0
    with pytest.raises(Exception):  # noqa: B017 - kombu's OperationalError or redis' ConnectionError
        bad.tasks["xa.multi_us"].delay(b, a, "")
    assert not r.keys(f"{prefix}:v1:*:claim")
    third = task.delay(b, a, "")
    assert third.get(timeout=30) == {"a": b, "b": a}


@pytest.mark.parametrize("blocker", ["other_work", "slot_holder"])
def test_an_until_done_delivery_waiting_behind_a_holder_keeps_its_claim_through_its_waits(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, blocker: str
) -> None:
    """until_done (queue_lock_ttl=2) x waiting behind a holder: other work of the same task, or a lock_limit
    task's slot (docs/limits.md: the until_done delivery waits, never parks). Its wait copies carry the claim
    on, but nothing extends the claim's TTL, so it lapses 2 s after the publish while the message still waits
    in the broker ("a hand-over covers its countdown"). Expected: an identical publish meanwhile is answered
    with the one queued copy, and the work runs once. Actual: the claim is gone, the identical publish
    queues a second copy and the body runs twice."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    if blocker == "other_work":
        holder = app.tasks["xa.udq"].delay(key, "holder", gate)
    else:
        holder = app.tasks["xa.slots"].delay(key, "holder", gate)
    wait_for(lambda: starts(r, prefix, holder.id), 30, what="the holder")
    first = app.tasks["xa.udq"].delay(key, "u", "")
    wait_for(lambda: first.state == "RETRY", 10, what="the identical work's delivery to wait behind the holder")
    deadline = time.monotonic() + 6  # three times the claim's 2 s queue TTL, the holder still running
    dups = set()
    while time.monotonic() < deadline:
        dups.add(app.tasks["xa.udq"].delay(key, "u", ""))
        time.sleep(0.5)
    r.set(gate, 1)
    assert holder.get(timeout=30)["tag"] == "holder"
    assert first.get(timeout=60) == {"tag": "u"}
    for dup in dups:
        dup.get(timeout=60)  # a second copy runs too, or is skipped behind the first at execution
    ran = [x for x in records(r, prefix) if x["ev"] == "start" and x.get("tag") == "u"]
    ids = {d.id for d in dups}
    assert ids == {first.id} and len(ran) == 1, (
        f"{len(ids - {first.id})} more copies of identical work queued; the body ran {len(ran)} times"
    )


@pytest.mark.parametrize("how", ["ok", "error", "ignore", "reject", "soft", "retry_exhausted"])
def test_every_exit_of_an_until_done_body_frees_the_entity_for_identical_work(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, how: str
) -> None:
    """until_done x each way a body ends (success, exception, Ignore, Reject, SoftTimeLimitExceeded, retry past
    max_retries): the claim-lease is freed at the exit (30 s lease: not its TTL), and an identical publish
    afterwards is new work that runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["xa.exit"]
    first = task.delay(key, how)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    wait_for(lambda: not r.exists(lock_key(prefix, f"xe:{key}"), claim_key(prefix, f"xe:{key}")), 10, what="freed")
    again = task.delay(key, how)
    assert again.id != first.id
    wait_for(lambda: starts(r, prefix, again.id), 30, what="identical work to run again")


_ONE_CLAIM_SLOT = pytest.mark.xfail(
    strict=True,
    reason=(
        "known limit (docs/model.md): until_started has one claim per entity, {K}:claim; while other work's "
        "claim is in it, identical publishes of a second work each go out unclaimed. A claim per (entity, "
        "work) would change the claim's key, which the CLI, the page and the operator scripts read"
    ),
)


@_ONE_CLAIM_SLOT
def test_until_started_identical_work_is_queued_once_also_while_other_work_is_queued_on_its_anchor(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started x several entities x different work queued on the same anchor entity: the claim is one
    ``{anchor}:claim`` hash. transfer(a, b) is queued; transfer(a, c) is different work (published without a
    claim, as documented). Expected ("at most one queued copy of identical work", docs/model.md): a second
    transfer(a, c) is answered with the first one's AsyncResult. Actual: CLAIM meets (a, b)'s claim, the
    publish is "different work" again and a second copy of (a, c) is queued; both run."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    a, b, c = sorted(uuid.uuid4().hex[:8] for _ in range(3))
    task = app.tasks["xa.multi_us"]
    ab = task.delay(a, b, "")
    ac = task.delay(a, c, "")
    ac2 = task.delay(a, c, "")
    fleet.worker(cfg, concurrency=2)
    for res in (ab, ac, ac2):
        res.get(timeout=30)
    ran = [x for x in records(r, prefix) if x["ev"] == "start" and x["key"] == f"{a}+{c}"]
    assert ac2.id == ac.id, f"identical work queued twice while other work was queued on its anchor; ran {len(ran)}x"


def test_a_revoked_multi_entity_until_done_retry_frees_its_claim_when_due_and_identical_work_runs(
    fleet: Fleet, broker_cfg: dict[str, Any], prefix: str, r: redis.Redis
) -> None:
    """until_done x several entities x retry(countdown=4) x revoke of the retry before it runs: the hand-over
    keeps the claim on the anchor only (the other entity is free at once); the worker discards the revoked
    retry when due and frees the anchor's claim then, not at queue_lock_ttl; identical work runs again."""
    cfg = broker_cfg  # the Redis broker, or RabbitMQ
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    a, b = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    task = app.tasks["xa.multi_ud"]
    first = task.delay(b, a, 1)
    anchor = lock_key(prefix, f"xd:{a}")
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt (past its publish-time claim)")
    wait_for(lambda: r.hget(anchor, "state") == "queued", 30, what="the claim handed over to the retry")
    handed = time.time()
    assert not r.exists(lock_key(prefix, f"xd:{b}"))
    assert task.delay(b, a, 1).id == first.id  # the retry is the one queued copy
    app.control.revoke(first.id)
    wait_for(lambda: not r.exists(anchor), 4.0 + 10, what="the revoked retry's claim freed")
    assert time.time() - handed < 4.0 + 5
    assert len(starts(r, prefix, first.id)) == 1
    again = task.delay(b, a, 0)
    assert again.id != first.id and again.get(timeout=30) == {"a": b, "b": a}


def test_an_until_done_multi_entity_body_past_its_hard_time_limit_frees_every_entity_within_the_grace(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x several entities x hard time limit (time_limit=2 given at publish): the
    main process cuts each entity's lease to the shorten grace; identical work publishes and runs after."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    a, b = sorted(uuid.uuid4().hex[:8] for _ in range(2))
    task = app.tasks["xa.multi_ud"]
    first = task.apply_async(args=(a, b, 0, 20.0), time_limit=2)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    began = time.time()
    wait_for(lambda: first.state == "FAILURE", 20, what="the hard time limit")
    wait_for(
        lambda: not r.exists(lock_key(prefix, f"xd:{a}"), lock_key(prefix, f"xd:{b}")), 10, what="both entities free"
    )
    assert time.time() - began < 2 + 2 + 5
    again = task.delay(a, b, 0)
    assert again.id != first.id and again.get(timeout=30) == {"a": a, "b": b}


def test_an_until_done_message_that_expires_in_the_queue_frees_its_claim_and_identical_work_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x ``expires``: a message that expired while the only worker process was busy is discarded
    unrun when received, and its claim freed then; identical work published afterwards is new and runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=1)
    busy, key = (uuid.uuid4().hex[:8] for _ in range(2))
    gate = f"{prefix}:gate"
    task = app.tasks["xa.ud"]
    blocker = task.delay(busy, gate)
    wait_for(lambda: starts(r, prefix, blocker.id), 30, what="the only process busy")
    first = task.apply_async(args=(key, ""), expires=1)
    assert r.exists(lock_key(prefix, f"xa:{key}"))
    time.sleep(1.5)  # the message's own expiry: nothing to poll before it passes
    r.set(gate, 1)
    wait_for(lambda: first.state == "REVOKED", 30, what="the expired message discarded")
    wait_for(lambda: not r.exists(lock_key(prefix, f"xa:{key}")), 10, what="its claim freed")
    again = task.delay(key, "")
    assert again.id != first.id and again.get(timeout=30) == {"key": key}
    assert not starts(r, prefix, first.id)


@_ONE_CLAIM_SLOT
def test_until_started_identical_work_is_queued_once_also_while_other_work_is_queued_on_its_entity(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started, one entity: charge(42, "x") queued holds {K}:claim; charge(42, "y") published twice is
    queued twice (each publish is "different work" against x's claim and takes no claim of its own), while
    charge(42, "x") published again is answered with the first. Expected: one queued copy of each work."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["until_started"]
    x = task.delay(key, 0.1, "x")
    y1 = task.delay(key, 0.1, "y")
    y2 = task.delay(key, 0.1, "y")
    assert task.delay(key, 0.1, "x").id == x.id
    fleet.worker(cfg, concurrency=2)
    for res in (x, y1, y2):
        res.get(timeout=30)
    assert y2.id == y1.id, "identical work queued twice while other work's claim was queued on the entity"


def test_an_until_done_message_terminated_before_it_started_frees_its_claim(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x revoke(terminate=True) of a message the worker has reserved (sent to its busy pool) but not
    started: when the process frees, Celery kills it at accept (or discards the request as revoked). Either
    way its claim must be freed within the shorten grace (2 s), never left for queue_lock_ttl, and identical
    work published afterwards runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=1)
    busy, key = (uuid.uuid4().hex[:8] for _ in range(2))
    gate = f"{prefix}:gate"
    task = app.tasks["xa.ud"]
    blocker = task.delay(busy, gate)
    wait_for(lambda: starts(r, prefix, blocker.id), 30, what="the only process busy")
    first = task.delay(key, "")
    time.sleep(1.0)  # let the worker reserve it (nothing observable from outside the worker)
    app.control.revoke(first.id, terminate=True, signal="SIGKILL")
    time.sleep(0.5)
    r.set(gate, 1)
    released = time.time()
    assert blocker.get(timeout=30) == {"key": busy}
    wait_for(lambda: first.state == "REVOKED", 30, what="the revoked message")
    name = lock_key(prefix, f"xa:{key}")
    state = r.hgetall(name)
    wait_for(lambda: not r.exists(name), 10, what=f"its claim freed (was {state})")
    assert time.time() - released < 2 + 5
    again = task.delay(key, "")
    assert again.id != first.id and again.get(timeout=30) == {"key": key}


def test_an_until_done_body_revoked_while_running_then_retrying_frees_the_handed_over_claim(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done x revoke (no terminate) of a running body x retry(countdown=4): the body goes on, hands its
    lease over to the retry message and publishes it; the worker discards that message as revoked (at receipt
    or when due) and frees the claim then: the entity is free within countdown + grace, not queue_lock_ttl."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate"
    first = app.tasks["xr.ud"].apply_async(args=(key, gate, "t", 1, 4.0))
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    app.control.revoke(first.id)
    time.sleep(0.5)  # the broadcast reaches the worker (no reply to wait for)
    r.set(gate, 1)
    retried = time.time()
    name = lock_key(prefix, f"xu:{key}")
    wait_for(lambda: not r.exists(name), 4.0 + 10, what="the revoked retry's claim freed")
    assert time.time() - retried < 4.0 + 5
    assert len(starts(r, prefix, first.id)) == 1
    again = app.tasks["xr.ud"].delay(key, "", "t2")
    assert again.id != first.id and again.get(timeout=30)["tag"] == "t2"


def test_a_revoked_multi_entity_until_started_message_frees_its_anchor_claim(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started x several entities x revoke before it runs: the worker discards the message and frees the
    claim on the anchor (the first sorted entity, whatever order the call names them in); identical work runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=1)
    busy, a, b = sorted(uuid.uuid4().hex[:8] for _ in range(3))
    gate = f"{prefix}:gate"
    blocker = app.tasks["xa.ud"].delay(busy, gate)
    wait_for(lambda: starts(r, prefix, blocker.id), 30, what="the only process busy")
    task = app.tasks["xa.multi_us"]
    first = task.delay(b, a, "")
    assert r.hget(claim_key(prefix, f"xam:{a}"), "task_id") == first.id
    app.control.revoke(first.id)
    time.sleep(0.5)  # the broadcast reaches the worker (no reply to wait for)
    r.set(gate, 1)
    wait_for(lambda: first.state == "REVOKED", 30, what="the revoked message discarded")
    wait_for(lambda: not r.exists(claim_key(prefix, f"xam:{a}")), 10, what="the anchor claim freed")
    again = task.delay(b, a, "")
    assert again.id != first.id and again.get(timeout=30) == {"a": b, "b": a}
