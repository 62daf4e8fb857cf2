"""Review 2 (fresh context) of b69312a..main: two features at a time, through Celery's real tracer.

An errored PARK that ran all the same ("unconfirmed": the reply lost) crossed with the release waking its entry,
a second park, ``lock_limit`` slots and ``max_waits``; the orphan tokens of ``lockguard_attempt`` crossed with
retry() and forged header values; a multi-entity ``until_done`` retry's hand-over crossed with an error at one
of its other entities.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _handoff as handoff
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard._keys import lock_name, slot_lock_name, wait_name, waiters_name

from .test_paths import hold
from .tracer import Message, deliver, make_app, published, redeliver


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("review2", redis_url, prefix)


def messages(r: redis.Redis, app: Celery, task_id: str) -> list[Message]:
    return [m for m in published(r, app) if m.task_id == task_id]


def release(app: Celery, r: redis.Redis, prefix: str, lease: L.Lease) -> bool:
    """What ``_release.release`` does on RELEASE's reply: wake the oldest waiter."""
    _, _, woken = L.release_and_wake(r, lease, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    return handoff.wake(app, settings(app), woken, "holder", "other")


def waiter(app: Celery, runs: list[str], **options: Any) -> Any:
    @app.task(base=LockedTask, bind=True, name="r2.charge", lock_key="inv:{a}", shared=False, **options)
    def charge(self: Any, a: int, amount: int) -> int:
        runs.append(f"{self.request.id}:{amount}")
        return amount

    return charge


@pytest.fixture
def park_ran_reply_lost(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """PARK runs on the server, then its reply is lost (a timeout): the first call only."""
    real, calls = handoff.park, []

    def ran_then_lost(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls.append(str(out.kind))
        if len(calls) == 1:
            raise redis.TimeoutError("Timeout reading from socket")
        return out

    monkeypatch.setattr(handoff, "park", ran_then_lost)
    return calls


def no_entry_left(r: redis.Redis, prefix: str, key: str) -> None:
    """Nothing of the waits stays behind: the queue holds only dropped entries' tokens, no parked entry."""
    entries = r.hgetall(waiters_name(prefix, key))
    parked = [k for k, v in entries.items() if k.startswith("s:") and v == "parked"]
    assert parked == [], f"parked entries left behind: {entries}"


@pytest.mark.parametrize("order", ["safety_first", "woken_first"])
def test_unconfirmed_park_that_ran_then_woken_runs_the_job_once(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str], order: str
) -> None:
    """PARK ran, its reply lost; the release wakes the entry; the early safety copy and the woken copy both
    come: the job runs exactly once and the entity ends free."""
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:1")
    out = deliver(t, (1, 100))
    assert out.state == "RETRY" and park_ran_reply_lost == ["parked"]
    (safety,) = messages(r, app, out.task_id)
    assert r.lrange(wait_name(prefix, "inv:1"), 0, -1) == [safety.headers[headers.PARK]]
    assert release(app, r, prefix, lease)
    woken = messages(r, app, out.task_id)[-1]
    assert woken.headers.get(headers.WOKEN) == 1
    first, second = (safety, woken) if order == "safety_first" else (woken, safety)
    redeliver(t, first)
    redeliver(t, second)
    for m in messages(r, app, out.task_id)[2:]:  # anything either copy published again
        redeliver(t, m)
    assert runs == [f"{out.task_id}:100"], runs
    assert not r.exists(lock_name(prefix, "inv:1")), r.hgetall(lock_name(prefix, "inv:1"))
    no_entry_left(r, prefix, "inv:1")


def test_unconfirmed_park_that_ran_then_copy_parks_again_keeps_one_live_entry(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str]
) -> None:
    """The early copy arrives while the holder still holds: it parks again. The release then wakes one copy,
    which runs once; the first entry is never woken beside it."""
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:2")
    out = deliver(t, (2, 100))
    (safety,) = messages(r, app, out.task_id)
    assert redeliver(t, safety).state == "RETRY" and runs == []
    assert release(app, r, prefix, lease)
    mine = messages(r, app, out.task_id)
    woken = [m for m in mine if m.headers.get(headers.WOKEN) == 1]
    assert len(woken) == 1, [m.custom() for m in mine]
    for m in mine[1:]:
        redeliver(t, m)
    assert runs == [f"{out.task_id}:100"], runs
    assert not r.exists(lock_name(prefix, "inv:2"))
    no_entry_left(r, prefix, "inv:2")


def test_unconfirmed_park_that_ran_on_a_full_lock_limit_runs_once_when_a_slot_frees(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str]
) -> None:
    """Crossing with lock_limit: both slots held, the waiter's PARK ran and its reply was lost."""
    runs: list[str] = []
    t = waiter(app, runs, lock_limit=2)
    common = {"task_name": "other", "worker": "w", "fence_ttl_ms": 60_000, "limit": 2}
    holders = [L.acquire(r, prefix, "inv:3", ttl_ms=10_000, task_id=f"h{i}", digest=f"d{i}", **common) for i in range(2)]
    assert all(isinstance(h, L.Lease) for h in holders), holders
    out = deliver(t, (3, 100))
    assert out.state == "RETRY"
    (safety,) = messages(r, app, out.task_id)
    assert redeliver(t, safety).state == "RETRY" and runs == []  # still full: parks again
    assert release(app, r, prefix, holders[1])  # type: ignore[arg-type]
    for m in messages(r, app, out.task_id)[1:]:
        redeliver(t, m)
    assert runs == [f"{out.task_id}:100"], runs
    assert not r.exists(slot_lock_name(prefix, "inv:3", 1)), r.hgetall(slot_lock_name(prefix, "inv:3", 1))
    no_entry_left(r, prefix, "inv:3")


def test_unconfirmed_park_that_ran_with_max_waits_spent_gives_up_and_wakes_nobody_for_it(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str]
) -> None:
    """Crossing with max_waits: the early copy has spent its budget and gives up (skip); the entry PARK left
    must not be woken later, reserving the entity for a job that is over (blocked for the reservation TTL)."""
    runs: list[str] = []
    t = waiter(app, runs, lock_max_waits=1, on_locked="skip")
    lease = hold(r, prefix, "inv:4")
    out = deliver(t, (4, 100))
    (safety,) = messages(r, app, out.task_id)
    assert redeliver(t, safety).state in ("SUCCESS", "IGNORED", "FAILURE") and runs == []
    release(app, r, prefix, lease)
    assert not r.exists(lock_name(prefix, "inv:4")), r.hgetall(lock_name(prefix, "inv:4"))
    assert [m for m in messages(r, app, out.task_id) if m.headers.get(headers.WOKEN)] == []
