"""lock_limit and lock_rate through LockedTask in-process (``apply()``, Celery's own tracer), on the real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockContended, LockedTask, LockThrottled
from celery_lockguard import _lease as L
from celery_lockguard._keys import digest, lock_name, rate_name, slot_lock_name


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("limitstask", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    yield a


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def plant(r: redis.Redis, prefix: str, limit: int, task_name: str = "other", dig: str = "", **kw: Any) -> L.Lease:
    """Another holder of entity k:1 (other work unless told), through the same admission (this host and pid: alive)."""
    task_id = f"other-{L.new_token()[:6]}"
    got = L.acquire(
        r, prefix, "k:1", ttl_ms=10_000, task_id=task_id, task_name=task_name, digest=dig or task_id,
        worker="elsewhere", fence_ttl_ms=60_000, limit=limit, **kw,
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    return got


def test_a_free_slot_runs_beside_other_work_and_says_admitted(app: Celery, r: redis.Redis, prefix: str) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="t.export", lock_key="k:{a}", lock_limit=3)
    def export(self: Any, a: int) -> int:
        seen["slot"], seen["key"], seen["row"] = self.lock.slot, self.lock.redis_key, self.lock.fence_row
        return a

    other = plant(r, prefix, 3)
    with capture_logs() as logs:
        assert export.apply(args=(1,)).get() == 1
    assert (seen["slot"], seen["key"], seen["row"]) == (1, slot_lock_name(prefix, "k:1", 1), "k:1#1")
    (admitted,) = events(logs, "lock.admitted")
    assert (admitted["slot"], admitted["limit"], admitted["rate"]) == (1, 3, None)
    assert [e["event"] for e in logs if e["event"] != "lock.admitted"] == ["lock.acquired", "lock.released"]
    assert not r.exists(slot_lock_name(prefix, "k:1", 1)) and r.hget(other.redis_key, "token") == other.token


def test_identical_work_in_any_slot_is_skipped_even_with_a_free_slot(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="t.export", lock_key="k:{a}", lock_limit=3)
    def export(self: Any, a: int) -> None:
        runs.append(a)

    plant(r, prefix, 3)  # different work in slot 0
    plant(r, prefix, 3, task_name="t.export", dig=digest({"a": 1}))  # identical work in slot 1
    with capture_logs() as logs:
        assert export.apply(args=(1,)).get() is None
    assert runs == [] and events(logs, "lock.skipped_duplicate")
    assert not r.exists(slot_lock_name(prefix, "k:1", 2))


def test_raise_when_every_slot_is_held_by_other_work(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="t.x", lock_key="k:{a}", lock_limit=2, on_locked="raise")
    def x(self: Any, a: int) -> None: ...

    first, _ = plant(r, prefix, 2), plant(r, prefix, 2)
    with pytest.raises(LockContended) as err:
        x.apply(args=(1,), throw=True)
    assert not isinstance(err.value, LockThrottled) and err.value.holder_task_id is not None
    assert r.hget(first.redis_key, "token") == first.token


def test_raise_when_the_window_is_full_is_lock_throttled(app: Celery, r: redis.Redis, prefix: str) -> None:
    opts: dict[str, Any] = {"lock_key": "k:{a}", "lock_rate": "1/m", "on_locked": "raise"}

    @app.task(base=LockedTask, bind=True, shared=False, name="t.x", **opts)
    def x(self: Any, a: int) -> int:
        return a

    assert x.apply(args=(1,)).get() == 1
    assert r.zcard(rate_name(prefix, "k:1")) == 1 and not r.exists(lock_name(prefix, "k:1"))
    with capture_logs() as logs, pytest.raises(LockThrottled) as err:
        x.apply(args=(1,), throw=True)
    assert isinstance(err.value, LockContended) and 0 < (err.value.retry_after_ms or 0) <= 60_000
    assert err.value.rate == "1/m" and "rate limited (1/m)" in str(err.value)
    (throttled,) = events(logs, "lock.throttled")
    assert throttled["policy"] == "raise" and throttled["starts"] == 1 and throttled["rate"] == "1/m"


def test_a_throttled_call_waits_for_the_window_then_runs(app: Celery, r: redis.Redis, prefix: str) -> None:
    """Eager: the wait is in-process, for the countdown the window gave (when its oldest start leaves)."""
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="t.x", lock_key="k:{a}", lock_rate="1/1s", max_retries=0)
    def x(self: Any, a: int, b: int) -> None:
        runs.append(time.monotonic())

    x.apply(args=(1, 1)).get()
    with capture_logs() as logs:
        x.apply(args=(1, 2)).get()  # other work (skip waits for the window too); max_retries=0 is never spent
    assert len(runs) == 2
    (throttled,) = events(logs, "lock.throttled")
    (scheduled,) = events(logs, "lock.retry_scheduled")
    assert scheduled["reason"] == "rate_limited" and scheduled["countdown"] >= throttled["retry_after_ms"] / 1000
    assert runs[1] - runs[0] >= throttled["retry_after_ms"] / 1000


def test_the_wait_budget_spent_on_a_full_window_fails_with_lock_throttled(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="t.x", lock_key="k:{a}", lock_rate="1/h", lock_max_waits=0)
    def x(self: Any, a: int, b: int) -> None: ...

    x.apply(args=(1, 1)).get()
    with capture_logs() as logs, pytest.raises(LockThrottled):
        x.apply(args=(1, 2), throw=True)
    assert events(logs, "lock.wait_budget_exhausted")[0]["reason"] == "rate_limited"


def test_a_redelivery_of_a_slot_holder_is_dropped_through_the_real_tracer(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    """A copy of a task id holding slot 1 must not take slot 2 and run twice: dropped, watch left."""
    from .tracer import deliver, make_app

    app = make_app("limitsredeliver", redis_url, prefix, lockguard_redis_url=redis_url)
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="t.export", lock_key="k:{a}", lock_limit=3)
    def export(self: Any, a: int) -> None:
        runs.append(a)

    plant(r, prefix, 3)
    own = L.acquire(
        r, prefix, "k:1", ttl_ms=10_000, task_id="T1", task_name="t.export", digest=digest({"a": 1}),
        worker="elsewhere", fence_ttl_ms=60_000, limit=3,
    )  # fmt: skip
    assert isinstance(own, L.Lease) and own.slot == 1
    with capture_logs() as logs:
        deliver(export, (1,), task_id="T1")
    assert runs == [] and not r.exists(slot_lock_name(prefix, "k:1", 2))
    (skipped,) = events(logs, "lock.skipped_duplicate")
    assert skipped["reason"] == "redelivery_of_running_original"


def test_a_lowered_lock_limit_still_meets_a_holder_of_a_slot_past_it(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    """Deploy 1 runs lock_limit=3 and T1 holds slot 2; deploy 2 has lock_limit=2. T1's redelivery
    (and identical work) used to take the free slot 0 and run a second time beside T1."""
    from .tracer import deliver, make_app

    app = make_app("limitslowered", redis_url, prefix, lockguard_redis_url=redis_url)
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="t.export", lock_key="k:{a}", lock_limit=2)
    def export(self: Any, a: int) -> None:
        runs.append(a)

    first = [plant(r, prefix, 3), plant(r, prefix, 3)]
    old = L.acquire(
        r, prefix, "k:1", ttl_ms=10_000, task_id="T1", task_name="t.export", digest=digest({"a": 1}),
        worker="elsewhere", fence_ttl_ms=60_000, limit=3,
    )  # fmt: skip
    assert isinstance(old, L.Lease) and old.slot == 2
    for lease in first:
        L.release(r, lease, prefix)
    with capture_logs() as logs:
        deliver(export, (1,), task_id="T1")  # the redelivery
        deliver(export, (1,))  # identical work, another id: skipped
    assert runs == [] and not r.exists(lock_name(prefix, "k:1"))
    assert [e["reason"] for e in events(logs, "lock.skipped_duplicate")] == [
        "redelivery_of_running_original",
        "identical_work_running",
    ]
    assert r.hget(old.redis_key, "token") == old.token  # the old holder is left alone


def test_a_watch_copy_whose_original_settled_spends_no_start_of_the_window(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    """The watch copy takes a slot only to find its original done and drops itself: no body ran, so the
    start it was admitted with is taken back (it used to stay counted: a '1/h' budget gone for an hour)."""
    from celery import states

    from .tracer import deliver, make_app, published, redeliver

    app = make_app("limitswatch", redis_url, prefix, lockguard_redis_url=redis_url)
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="t.push", lock_key="k:{a}", lock_limit=2, lock_rate="2/m")
    def push(self: Any, a: int) -> None:
        runs.append(a)

    orig = L.acquire(
        r, prefix, "k:1", ttl_ms=10_000, task_id="T1", task_name="t.push", digest=digest({"a": 1}),
        worker="elsewhere", fence_ttl_ms=60_000, limit=2, rate=(2, 60_000),
    )  # fmt: skip
    assert isinstance(orig, L.Lease)
    deliver(push, (1,), task_id="T1")  # a redelivery while the original runs: dropped, a watch copy left
    (watch,) = published(r, app)
    assert "lockguard_watch" in watch.headers and runs == []
    L.release(r, orig, prefix)
    app.backend.store_result("T1", None, states.SUCCESS)  # the original ended
    assert r.zcard(rate_name(prefix, "k:1")) == 1
    out = redeliver(push, watch)
    assert runs == [] and out.state == "SUCCESS"  # dropped, the original's state left alone
    assert r.zrange(rate_name(prefix, "k:1"), 0, -1) == [orig.token]  # only the original's start counts
    assert not r.exists(lock_name(prefix, "k:1")) and not r.exists(slot_lock_name(prefix, "k:1", 1))
    assert push.apply(args=(2,)).get() is None and runs == [2]  # the budget's second start is still there


def test_a_failing_body_frees_its_slot_and_its_start_stays_counted(app: Celery, r: redis.Redis, prefix: str) -> None:
    """A failure is an exit like success: the slot is released at once (owner-checked: the other
    holder's slot is untouched), and the start it was admitted under stays in the window (it ran)."""

    @app.task(base=LockedTask, bind=True, shared=False, name="t.fails", lock_key="k:{a}", lock_limit=2, lock_rate="5/m")
    def fails(self: Any, a: int) -> None:
        assert self.lock.slot == 1
        raise RuntimeError("boom")

    other = plant(r, prefix, 2, rate=(5, 60_000))
    with capture_logs() as logs, pytest.raises(RuntimeError):
        fails.apply(args=(1,), throw=True)
    assert [e["event"] for e in logs if e["event"].startswith("lock.")][-1] == "lock.released"
    assert not r.exists(slot_lock_name(prefix, "k:1", 1))
    assert r.hget(other.redis_key, "token") == other.token
    assert r.zcard(rate_name(prefix, "k:1")) == 2


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_an_unreachable_lock_redis_follows_on_unavailable_with_limits(prefix: str, policy: str) -> None:
    from celery_lockguard import BackendUnavailable
    from tests.test_task import unreachable_app

    down = unreachable_app(policy, prefix)
    ran = []

    @down.task(base=LockedTask, bind=True, shared=False, name="t.down", lock_key="k:{a}", lock_limit=3, lock_rate="5/m")
    def t(self: Any, a: int) -> Any:
        ran.append(self.lock)
        return a

    with capture_logs() as logs:
        if policy == "fail_open":
            assert t.apply(args=(1,), throw=True).get() == 1
            assert ran == [None] and events(logs, "lock.fail_open")
        else:
            with pytest.raises(BackendUnavailable):
                t.apply(args=(1,), throw=True)
            assert ran == [] and events(logs, "lock.backend_unavailable")[0]["policy"] == "fail_closed"
