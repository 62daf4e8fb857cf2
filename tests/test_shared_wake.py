"""The end of an exclusive (single-lease) holder wakes the parked shared (``lock_limit``) waiters a slot is free
for, one after another: each woken waiter that takes its slot passes the wake on while a slot remains, and the
rest stay parked until a slot frees. Through Celery's real tracer on the real Redis (the real-worker versions
are in tests/test_review_crossings.py, with timing bounds; this one checks the hand-off at each step).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard._keys import slot_lock_name, wait_name, waiters_name

from .tracer import Message, make_app, published, redeliver


def _state(r: redis.Redis, prefix: str, slot: int) -> tuple[str, str]:
    h = r.hgetall(slot_lock_name(prefix, "t:1", slot))
    return h.get("state", ""), h.get("task_id", "")


def _take(r: redis.Redis, app: Celery, task_id: str, woken: bool) -> Message:
    """Take the woken copy (or the safety copy) of ``task_id`` from the queue."""
    queue = f"{app.conf.broker_transport_options['global_keyprefix']}{app.conf.task_default_queue}"
    raws = list(reversed(r.lrange(queue, 0, -1)))
    for raw, msg in zip(raws, published(r, app), strict=True):
        if msg.task_id == task_id and bool(msg.custom().get("lockguard_woken")) == woken:
            r.lrem(queue, 1, raw)
            return msg
    raise AssertionError(f"no {'woken' if woken else 'safety'} copy of {task_id} queued")


def test_an_exclusive_end_wakes_a_shared_waiter_which_passes_the_wake_on_while_slots_remain(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handoff, "WAKE_GRACE", 0.05)  # a safety copy meeting a 'waking' entry: keep it quick
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    app = make_app("shared-wake", redis_url, prefix)
    seen: dict[str, list[tuple[str, str]]] = {}
    parked: dict[str, list[str]] = {}  # the waiters still parked while each body runs

    @app.task(base=LockedTask, bind=True, shared=False, name="sw.export", lock_key="t:{t}", lock_limit=2,
              on_locked="retry", lock_ttl=30)  # fmt: skip
    def export(self: Any, t: int, tag: str) -> str:
        seen[tag] = [_state(r, prefix, 0), _state(r, prefix, 1)]
        entries = r.hgetall(waiters_name(prefix, "t:1"))
        parked[tag] = [entries[f"t:{p}"] for p in r.lrange(wait_name(prefix, "t:1"), 0, -1)]
        return tag

    # the exclusive single lease of another task on the entity (a delete beside the exports)
    delete = L.acquire(r, prefix, "t:1", ttl_ms=30_000, task_id="del", task_name="delete", digest="d",
                       worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(delete, L.Lease)
    ids = {tag: export.delay(1, tag).id for tag in ("w1", "w2", "w3")}
    for msg in published(r, app):  # each parks behind the delete: its safety copy goes out
        r.rpop(f"{prefix}:kombu:{app.conf.task_default_queue}")
        assert redeliver(export, msg).state == "RETRY"
    assert r.llen(wait_name(prefix, "t:1")) == 3 and seen == {}

    _, _, woken = L.release_and_wake(r, delete, prefix, reserve_ms=handoff.reserve_ms())
    assert handoff.wake(app, settings(app), woken, "delete", "del")
    assert _state(r, prefix, 0) == ("handed", ids["w1"])  # one waiter per freed lease hash: w1, into slot 0

    assert redeliver(export, _take(r, app, ids["w1"], woken=True)).state == "SUCCESS"
    # w1 took its slot and passed the wake on: w2 holds a reservation for slot 1; w3 stays parked (no slot left)
    assert seen["w1"] == [("running", ids["w1"]), ("handed", ids["w2"])], seen
    assert parked["w1"] == [ids["w3"]], parked
    # w1's end freed slot 0: w3 is woken into it
    assert _state(r, prefix, 0) == ("handed", ids["w3"])

    assert redeliver(export, _take(r, app, ids["w2"], woken=True)).state == "SUCCESS"
    assert seen["w2"] == [("handed", ids["w3"]), ("running", ids["w2"])], seen
    assert parked["w2"] == [], parked
    assert redeliver(export, _take(r, app, ids["w3"], woken=True)).state == "SUCCESS"
    assert seen["w3"][0] == ("running", ids["w3"]), seen
    for tag in ("w1", "w2", "w3"):  # the safety copies find their entries run and drop themselves
        redeliver(export, _take(r, app, ids[tag], woken=False))
    assert sorted(seen) == ["w1", "w2", "w3"] and published(r, app) == []
    assert [export.AsyncResult(ids[t]).get(timeout=5) for t in ("w1", "w2", "w3")] == ["w1", "w2", "w3"]
    assert not r.exists(slot_lock_name(prefix, "t:1", 0), slot_lock_name(prefix, "t:1", 1))


@pytest.mark.parametrize("end", ["abandon", "wake"])
def test_a_free_slot_never_wakes_a_shared_waiter_beside_the_exclusive_single_lease(
    redis_url: str, prefix: str, end: str
) -> None:
    """A lease end on a free slot >= 1 (RELEASE of a reservation already gone, as a discarded woken copy's
    ``abandon`` tries each slot; WAKE after a lease cut short) must not hand that slot to a shared waiter while
    the single lease holds ``{K}:lock``: the slot and the single lease exclude each other. The waiter stays
    parked; the single lease's own end wakes it. (Found by the model: the single lease beside slots [0, 1].)
    """
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    app = make_app("shared-wake-excl", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="sw.export2", lock_key="t:{t}", lock_limit=2,
              on_locked="retry", lock_ttl=30)  # fmt: skip
    def export(self: Any, t: int) -> int:
        return t

    delete = L.acquire(r, prefix, "t:1", ttl_ms=30_000, task_id="del", task_name="delete", digest="d",
                       worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(delete, L.Lease)
    tid = export.delay(1).id
    (msg,) = published(r, app)
    r.rpop(f"{prefix}:kombu:{app.conf.task_default_queue}")
    assert redeliver(export, msg).state == "RETRY"  # parked behind the single lease
    assert r.llen(wait_name(prefix, "t:1")) == 1

    if end == "abandon":  # a woken copy discarded: its reservation (here: none) is freed slot by slot
        assert not handoff.abandon(app, settings(app), "t:1", "gone-park-token", export.name, "other", limit=2)
    else:
        assert not handoff.wake_if_free(app, settings(app), "t:1", "x", "x", limit=2)
    assert not r.exists(slot_lock_name(prefix, "t:1", 1)), r.hgetall(slot_lock_name(prefix, "t:1", 1))
    assert r.hget(slot_lock_name(prefix, "t:1", 0), "task_id") == "del"
    assert r.llen(wait_name(prefix, "t:1")) == 1  # still parked

    _, _, woken = L.release_and_wake(r, delete, prefix, reserve_ms=handoff.reserve_ms())
    assert handoff.wake(app, settings(app), woken, "delete", "del")
    assert _state(r, prefix, 0) == ("handed", tid)  # the single lease's end wakes it, into slot 0
    assert redeliver(export, _take(r, app, tid, woken=True)).state == "SUCCESS"
    redeliver(export, _take(r, app, tid, woken=False))
    assert published(r, app) == [] and not r.exists(slot_lock_name(prefix, "t:1", 0))


def test_a_shared_waiter_giving_up_behind_the_single_lease_hands_no_slot_to_the_next(
    redis_url: str, prefix: str
) -> None:
    """The model's failing program (test_model_with_limits[retry-2-None]): the single lease held, two exports park
    behind it; the first reaches ``lock_max_waits`` and fails, freeing its (absent) reservation slot by slot. Its
    RELEASE of the free slot 1 must not wake the second export into slot 1 beside the single lease.
    """
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    app = make_app("shared-wake-giveup", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="sw.export3", lock_key="t:{t}", lock_limit=2,
              on_locked="retry", lock_max_waits=3, lock_ttl=30)  # fmt: skip
    def export(self: Any, t: int, a: int) -> int:
        return a

    delete = L.acquire(r, prefix, "t:1", ttl_ms=30_000, task_id="del", task_name="delete", digest="d",
                       worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(delete, L.Lease)
    export.delay(1, 10)
    export.delay(1, 20)
    queue = f"{prefix}:kombu:{app.conf.task_default_queue}"
    states = []
    while msgs := published(r, app):  # every copy, in order: each waits behind the single lease, then gives up
        r.rpop(queue)
        states.append(redeliver(export, msgs[0]).state)
        assert not r.exists(slot_lock_name(prefix, "t:1", 1)), (states, r.hgetall(slot_lock_name(prefix, "t:1", 1)))
        assert r.hget(slot_lock_name(prefix, "t:1", 0), "task_id") == "del"
    assert states == ["RETRY"] * 6 + ["FAILURE"] * 2, states
    assert r.llen(wait_name(prefix, "t:1")) == 0
    L.release(r, delete, prefix)


def test_a_shared_waiter_woken_into_a_slot_never_taken_keeps_the_single_lease_out(redis_url: str, prefix: str) -> None:
    """A shared waiter parked behind the single lease (no slot ever taken), then woken by WAKE into slot 1 while
    slot 0 is held: slot 1 had no marker ``{K}:fence:1`` (markers were made only by taking a slot), so the
    scan that finds slots (ACQUIRE's ``held_slot``) stopped before it and the single lease was taken beside
    the reservation. Found by the limits model in CI: the single lease beside slots [0, 1]."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    first = L.acquire(r, prefix, "t:2", ttl_ms=30_000, task_id="del", task_name="delete", digest="d",
                      worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(first, L.Lease)
    parked = handoff.park(r, prefix, "t:2", "pw", "{}", task_id="w", task_name="export", digest="dw",
                          countdown=10, limit=2)  # fmt: skip
    assert parked.kind == "parked"
    L.release(r, first, prefix)  # ended with no wake (a lease cut short; a holder with no waiters known)
    slot0 = L.acquire(r, prefix, "t:2", ttl_ms=30_000, task_id="s0", task_name="export", digest="d0",
                      worker="w1", fence_ttl_ms=60_000, limit=2)  # fmt: skip
    assert isinstance(slot0, L.Lease) and slot0.slot == 0
    assert not r.exists(f"{prefix}:v1:{{t:2}}:fence:1"), "slot 1 was never taken"
    woken = L.wake_if_free(r, prefix, "t:2", 5000, limit=2)
    assert woken is not None and r.hget(slot_lock_name(prefix, "t:2", 1), "state") == "handed"
    L.release(r, slot0, prefix)
    other = L.acquire(r, prefix, "t:2", ttl_ms=30_000, task_id="del2", task_name="delete", digest="d2",
                      worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(other, L.Holder) and other.slot == 1, "the single lease waits for the reserved slot 1"
