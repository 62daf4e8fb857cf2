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
    first = _kill_holder(fleet, app, r, prefix, "xa.ud", key, gate)
    task = app.tasks["xa.ud"]
    copies = [task.delay(key, gate) for _ in range(3)]
    r.set(gate, 1)
    ids = {c.id for c in copies}
    assert len(ids) == 1, f"{len(ids)} copies of identical work queued behind a dead holder"
    assert copies[0].get(timeout=60) == {"key": key}  # it waits the dead lease (30 s) out, then runs
    assert [x["task_id"] for x in starts(r, prefix) if x["task_id"] != first.id] == [copies[0].id]
    wait_for(lambda: not r.exists(lock_key(prefix, f"xa:{key}"), claim_key(prefix, f"xa:{key}")), 10, what="free")


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


def test_a_revoked_waiting_until_done_delivery_frees_its_kept_claim(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """42f8c96 x revoke: a delivery waiting behind other work keeps its claim (extended to the wait hand-back
    TTL); revoked, the claim must be freed when its wait copy is discarded, not kept for that extended TTL:
    identical work published afterwards is accepted (not answered with the revoked task) and runs."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    holder = app.tasks["xa.udq"].delay(key, "holder", gate)
    wait_for(lambda: starts(r, prefix, holder.id), 30, what="the holder")
    first = app.tasks["xa.udq"].delay(key, "u", "")
    wait_for(lambda: first.state == "RETRY", 10, what="the identical work's delivery to wait behind the holder")
    app.control.revoke(first.id)
    wait_for(lambda: not r.exists(claim_key(prefix, f"xq:{key}")), 20,
             what=f"the revoked waiter's claim freed ({r.hgetall(claim_key(prefix, f'xq:{key}'))})")  # fmt: skip
    again = app.tasks["xa.udq"].delay(key, "u", "")
    assert again.id != first.id
    r.set(gate, 1)
    assert again.get(timeout=60) == {"tag": "u"}


def test_an_until_done_delivery_that_gives_up_waiting_frees_its_kept_claim(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """42f8c96 x lock_max_waits exhausted: the delivery kept its claim through each wait; when it gives up
    (LockContended) the claim is freed at once and identical work published then is accepted."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    holder = app.tasks["xa.udq"].delay(key, "holder", gate)
    wait_for(lambda: starts(r, prefix, holder.id), 30, what="the holder")
    first = app.tasks["rv.udw"].delay(key, "u")
    wait_for(lambda: first.state == "FAILURE", 60, what="the waiter to give up")
    assert not r.exists(claim_key(prefix, f"xq:{key}")), r.hgetall(claim_key(prefix, f"xq:{key}"))
    again = app.tasks["rv.udw"].delay(key, "u")
    assert again.id != first.id
    r.set(gate, 1)


def _chain_tags(r: redis.Redis, prefix: str) -> list[str]:
    return [x["tag"] for x in records(r, prefix) if x["ev"] == "start"]


def test_a_partial_overlap_member_waiting_on_its_other_entity_runs_when_it_frees(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """62f7a48 x waiting: the member over (workflow entity, other) finds ``other`` held by another task; it waits
    (its wait copy re-enters the workflow as itself) and runs once ``other`` frees; the chain completes."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant, other, gate = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6], f"{prefix}:gate"
    blocker = app.tasks["xb.one"].delay(other, gate, "blocker")
    wait_for(lambda: "blocker" in _chain_tags(r, prefix), 30, what="the blocker on the other entity")
    step, multi = app.tasks["xb.step"], app.tasks["xb.multi"]
    sig = chain(step.si(key="s1", tag="s1"), multi.si(tenant, other, "", "m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=3).apply_async()
    wait_for(lambda: res.parent.state == "RETRY", 20, what="the member to wait on the other entity")
    r.set(gate, 1)
    assert blocker.get(timeout=30)["tag"] == "blocker"
    assert res.get(timeout=60)["tag"] == "s3"
    assert _chain_tags(r, prefix) == ["blocker", "s1", "m", "s3"]
    for k in (tenant, other):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"xb:{k}")), 10, what=f"xb:{k} free")


def test_a_partial_overlap_member_retrying_keeps_its_place_and_its_checkpoint(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """62f7a48 x retry() x checkpoint: the member over (workflow entity, other) retries once; the retry re-enters
    the workflow, leases ``other`` again, replays its checkpoint (the effect once) and the chain completes."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant, other = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    step, member = app.tasks["xb.step"], app.tasks["rv.mretry"]
    sig = chain(step.si(key="s1", tag="s1"), member.si(tenant, other, "m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=5).apply_async()
    assert res.get(timeout=60)["tag"] == "s3"
    assert res.parent.get(timeout=5) == {"tag": "m", "n": 1}
    assert _chain_tags(r, prefix) == ["s1", "m", "m", "s3"]
    assert r.get(f"{prefix}:effects:{other}") == "1"
    for k in (tenant, other):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"xb:{k}")), 10, what=f"xb:{k} free")


def test_a_member_over_one_of_a_two_entity_workflows_entities_and_a_third_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """62f7a48 x a multi-entity workflow: the workflow holds (xb:t, xb:u); the member locks (xb:t, xb:o). It leases
    xb:o only, runs, and the chain completes with every entity free after."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    t, u, o = (uuid.uuid4().hex[:6] for _ in range(3))
    step, multi = app.tasks["xb.step"], app.tasks["xb.multi"]
    sig = chain(step.si(key="s1", tag="s1"), multi.si(t, o, "", "m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key=("xb:{t}", "xb:{u}"), t=t, u=u, gap_ttl=3).apply_async()
    assert res.get(timeout=60)["tag"] == "s3"
    assert _chain_tags(r, prefix) == ["s1", "m", "s3"]
    for k in (t, u, o):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"xb:{k}")), 10, what=f"xb:{k} free")


def test_a_chord_of_partial_overlap_members_runs_each_page_on_its_other_entity(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """62f7a48 x chord: pages over (workflow entity, o_i) share the workflow lease and each lease its own o_i;
    two pages on the same o serialize (never both inside at once)."""
    from celery import chord

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    tenant, o1, o2 = (uuid.uuid4().hex[:6] for _ in range(3))
    gate = f"{prefix}:gate"
    r.set(gate, 1)
    multi, step = app.tasks["xb.multi"], app.tasks["xb.step"]
    pages = [multi.si(tenant, o, gate, f"p{i}") for i, o in enumerate((o1, o2, o1))]
    res = workflow(chord(pages, step.si(key="cb", tag="cb")), lock_key="xb:{k}", k=tenant).apply_async()
    assert res.get(timeout=90)["tag"] == "cb"
    assert sorted(_chain_tags(r, prefix)) == ["cb", "p0", "p1", "p2"]
    from .test_workers import intervals, overlapping

    on_o1 = [x for x in records(r, prefix) if x["key"] == f"xb:{tenant}+xb:{o1}"]
    assert not overlapping(intervals(on_o1)), on_o1
    for k in (tenant, o1, o2):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"xb:{k}")), 10, what=f"xb:{k} free")


@pytest.mark.parametrize("task,renewed", [("xa.ud", "now"), ("xa.ud", "stale"), ("rv.udnr", "stale")])
def test_an_until_done_publish_behind_a_holder_on_another_host(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, task: str, renewed: str
) -> None:
    """12eb963 x a holder on another host (its lease hash's host field edited): renewed, it is alive and the
    identical publish is answered with it; not renewed past 0.6 of its TTL it looks dead and the publish goes out;
    a lock_renew=False holder elsewhere has no renewal to read and is presumed alive (answered)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    first = app.tasks[task].delay(key, gate)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    name = lock_key(prefix, ("xa:" if task == "xa.ud" else "rvn:") + key)
    assert r.hget(name, "state") == "running"
    r.hset(name, "host", "elsewhere.invalid")
    if renewed == "stale":
        r.hset(name, "renewed_at", int(r.hget(name, "renewed_at")) - 25_000)
    try:
        again = app.tasks[task].delay(key, gate)
        answered = again.id == first.id
    finally:
        r.set(gate, 1)
    assert answered == (renewed == "now" or task == "rv.udnr")
    first.get(timeout=30)
    again.get(timeout=60)


@pytest.mark.parametrize("how", ["eta", "exhaust"])
def test_an_until_done_retry_with_an_eta_hands_over_and_an_exhausted_one_frees(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, how: str
) -> None:
    """87dfad3 x retry(eta=): the claim is handed over for the eta's delay (identical work answered with the
    retrying task meanwhile); once retries are exhausted the entity is freed at once, not left to a claim."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    first = app.tasks["rv.ude"].delay(key, how)
    wait_for(lambda: len(starts(r, prefix, first.id)) >= 1, 30, what="the first attempt")
    wait_for(lambda: r.hget(lock_key(prefix, f"rve:{key}"), "state") == "queued", 10, what="the hand-over")
    assert app.tasks["rv.ude"].delay(key, how).id == first.id
    if how == "eta":
        assert first.get(timeout=30) == {"key": key, "retries": 1}
    else:
        from celery.exceptions import MaxRetriesExceededError

        with pytest.raises(MaxRetriesExceededError):
            first.get(timeout=30)
        assert len(starts(r, prefix, first.id)) == 2
    wait_for(lambda: not r.exists(lock_key(prefix, f"rve:{key}"), claim_key(prefix, f"rve:{key}")), 5,
             what="the entity free after the last attempt")  # fmt: skip
    again = app.tasks["rv.ude"].delay(key, "eta")
    assert again.id != first.id


def test_an_until_done_publish_behind_a_killed_acks_late_holder_is_answered_with_its_redelivery(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """12eb963 x acks_late + reject_on_worker_lost: the killed holder's message goes back to the broker and will
    run again, so the holder is dead but its work is still queued. DESIGN: until_done keeps one copy queued or
    running. Expected: an identical publish right after the kill is answered with the holder (as before 12eb963),
    and the body runs once more (the redelivery). Actual: the publish goes out beside it (pid gone: 'dead')."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=1)
    key, gate = uuid.uuid4().hex[:8], f"{prefix}:gate"
    task = app.tasks["rv.udak"]
    first = task.delay(key, gate)
    rows = wait_for(lambda: starts(r, prefix, first.id), 30, what="the body")
    os.kill(rows[0]["pid"], signal.SIGKILL)
    wait_for(lambda: not _pid_alive(rows[0]["pid"]), 5, what="the child gone")
    again = task.delay(key, gate)
    r.set(gate, 1)
    assert first.get(timeout=60) == {"key": key}
    again.get(timeout=90)
    ran = [x["task_id"] for x in starts(r, prefix)]
    assert again.id == first.id, f"identical work queued beside the killed holder's redelivery; bodies: {ran}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("shape", ["own_entity", "partial_overlap"])
def test_an_until_done_workflow_member_retrying_keeps_the_workflow_and_completes(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, shape: str
) -> None:
    """87dfad3 x 62f7a48 x workflow: an until_done member retries once, on the workflow's own entity (self.lock is
    the workflow lease) or over it plus another (nested lease on the other). The retry keeps its place, the chain
    completes, and every entity is free after."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant, other = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    step = app.tasks["xb.step"]
    if shape == "own_entity":
        member = app.tasks["rv.wfud"].si(key=tenant, tag="m")
    else:
        member = app.tasks["rv.wfmud"].si(a=tenant, b=other, tag="m")
    sig = chain(step.si(key="s1", tag="s1"), member, step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=5).apply_async()
    try:
        out = res.get(timeout=60)
    finally:
        print(r.hgetall(lock_key(prefix, f"xb:{tenant}")), [(x["tag"], x["ev"]) for x in records(r, prefix)])
    assert out["tag"] == "s3"
    assert res.parent.get(timeout=5) == {"tag": "m", "retries": 1}
    assert _chain_tags(r, prefix) == ["s1", "m", "m", "s3"]
    for k in (tenant, other):
        wait_for(lambda k=k: not r.exists(lock_key(prefix, f"xb:{k}"), claim_key(prefix, f"xb:{k}")), 10,
                 what=f"xb:{k} free")  # fmt: skip


def test_an_until_done_retry_whose_arguments_do_not_bind_frees_the_entity(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """87dfad3 x a retry(kwargs=) the signature cannot bind: the lease is released (not handed over); the retry
    message fails visibly when delivered, and the entity is free for identical work at once."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    first = app.tasks["rv.badretry"].delay(key)
    wait_for(lambda: starts(r, prefix, first.id), 30, what="the first attempt")
    wait_for(lambda: first.state == "FAILURE", 30, what="the unbindable retry to fail")
    assert len(starts(r, prefix, first.id)) == 1
    assert not r.exists(lock_key(prefix, f"rvb:{key}"), claim_key(prefix, f"rvb:{key}"))
    again = app.tasks["rv.badretry"].delay(key)
    assert again.id != first.id
