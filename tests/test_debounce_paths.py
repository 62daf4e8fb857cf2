"""Every exit of a debounced publish and delivery, through Celery's real tracer, on the real Redis.

Each test publishes to the Redis broker (messages are read back from the queue,
not run by a worker), delivers what was published through ``build_tracer(eager=False)``
and checks what the delivery left behind: the record, the run, the messages, the events.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chain
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers
from celery_lockguard._config import reset
from celery_lockguard._keys import debounce_name, debounce_run_name

from .tracer import deliver, make_app, published, redeliver

DOWN = "redis://127.0.0.1:1/0"


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = make_app("debounce-paths", redis_url, prefix)
    ran: list[Any] = []
    app.ran = ran  # type: ignore[attr-defined]

    @app.task(base=LockedTask, bind=True, shared=False, name="d.reindex", lock_key="doc:{doc}", lock_debounce=0.2)
    def reindex(self: Any, doc: int, text: str = "") -> str:
        ran.append((self.request.id, text))
        return text

    @app.task(base=LockedTask, bind=True, shared=False, name="d.slow", lock_key="doc:{doc}", lock_debounce=30)
    def slow(self: Any, doc: int) -> int:
        return doc

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="d.retrying",
        lock_key="doc:{doc}",
        lock_debounce=0.2,
        max_retries=1,
    )
    def retrying(self: Any, doc: int) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return doc

    @app.task(shared=False, name="d.echo")
    def echo(value: Any = None) -> Any:
        return value

    yield app


def names(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


def point_lock_redis(app: Celery, url: str) -> None:
    app.conf.lockguard_redis_url = url
    reset(app)


def test_the_burst_run_takes_the_record_and_the_superseded_name_it(app: Celery, r: redis.Redis, prefix: str) -> None:
    t = app.tasks["d.reindex"]
    first, last = t.delay(7, "v1"), t.delay(7, "v2")
    msgs = published(r, app)
    assert [m.headers[headers.DEBOUNCE] for m in msgs] == [first.id, first.id]  # one burst, named after its first
    with capture_logs() as logs:
        out = [redeliver(t, m) for m in msgs]
    assert out[0].retval == {"lockguard": "superseded", "superseded_by": last.id} and out[0].state == "SUCCESS"
    assert out[1].retval == "v2" and app.ran == [(last.id, "v2")]  # type: ignore[attr-defined]
    superseded = [e for e in logs if e["event"] == "lock.superseded"]
    assert superseded and superseded[0]["task_id"] == first.id and superseded[0]["superseded_by"] == last.id
    assert r.get(debounce_run_name(prefix, "doc:7", "d.reindex", first.id)) == last.id
    # Redelivered (acks_late, visibility timeout): the superseded one stays superseded, the run is a redelivery.
    again = redeliver(t, msgs[0])
    assert again.retval == {"lockguard": "superseded", "superseded_by": last.id}


def test_a_lost_record_runs_every_message_and_says_so(app: Celery, r: redis.Redis, prefix: str) -> None:
    t = app.tasks["d.reindex"]
    results = [t.delay(8, f"v{i}") for i in range(3)]
    r.delete(debounce_name(prefix, "doc:8", "d.reindex"))  # evicted, expired, a restart without persistence
    with capture_logs() as logs:
        out = [redeliver(t, m) for m in published(r, app)]
    assert [o.retval for o in out] == ["v0", "v1", "v2"], "without its record no message may be dropped"
    assert names(logs).count("lock.debounce_missing") == 3
    assert [x[0] for x in app.ran] == [res.id for res in results]  # type: ignore[attr-defined]


def test_redis_down_at_publish_publishes_unrecorded_and_it_runs(app: Celery, r: redis.Redis, redis_url: str) -> None:
    t = app.tasks["d.reindex"]
    point_lock_redis(app, DOWN)
    with capture_logs() as logs:
        res = t.delay(9, "offline")
    assert "lock.backend_unavailable" in names(logs)
    (msg,) = published(r, app)
    assert headers.DEBOUNCE not in msg.headers and msg.headers.get("eta"), "delayed, but not debounced"
    point_lock_redis(app, redis_url)
    out = redeliver(t, msg)
    assert (out.state, out.retval, res.id) == ("SUCCESS", "offline", msg.task_id)


def drain(r: redis.Redis, app: Celery) -> None:
    """Empty the queue: the messages read so far are delivered by hand."""
    r.delete(f"{app.conf.broker_transport_options['global_keyprefix']}{app.conf.task_default_queue}")


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_redis_down_at_delivery_follows_on_unavailable(
    app: Celery, r: redis.Redis, redis_url: str, policy: str
) -> None:
    t = app.tasks["d.reindex"]
    t.delay(10, "due")
    (msg,) = published(r, app)
    drain(r, app)
    app.conf.lockguard_on_unavailable = policy
    point_lock_redis(app, DOWN)
    with capture_logs() as logs:
        out = redeliver(t, msg)
    if policy == "fail_open":
        assert (out.state, out.retval) == ("SUCCESS", "due") and "lock.fail_open" in names(logs)
        return
    assert out.state == "RETRY" and "lock.backend_unavailable" in names(logs)
    (wait,) = published(r, app)
    assert wait.task_id == msg.task_id and wait.headers[headers.DEBOUNCE] == msg.headers[headers.DEBOUNCE]
    assert int(wait.headers[headers.WAITS]) == 1
    point_lock_redis(app, redis_url)
    back = redeliver(t, wait)
    assert (back.state, back.retval) == ("SUCCESS", "due")


def test_a_failed_publish_puts_back_the_run_it_replaced(
    app: Celery, r: redis.Redis, prefix: str, redis_url: str
) -> None:
    t = app.tasks["d.reindex"]
    first = t.delay(11, "kept")
    (msg,) = published(r, app)
    broken = make_app("debounce-broken", "redis://127.0.0.1:1/0", prefix, lockguard_redis_url=redis_url)
    broken.task(base=LockedTask, shared=False, name="d.reindex", lock_key="doc:{doc}", lock_debounce=0.2)(
        lambda doc, text="": text
    )
    with pytest.raises(Exception):  # noqa: B017 - kombu's connection error, whatever its class
        broken.tasks["d.reindex"].delay(11, "never-sent")
    assert r.hget(debounce_name(prefix, "doc:11", "d.reindex"), "task_id") == first.id
    out = redeliver(t, msg)
    assert out.retval == "kept", "the pending run must survive a publish that replaced it and failed"


def test_an_early_delivery_waits_out_its_delay(app: Celery, r: redis.Redis) -> None:
    t = app.tasks["d.slow"]
    res = t.delay(12)
    (msg,) = published(r, app)
    drain(r, app)
    out = redeliver(t, msg)  # 30 s early: re-delivered with the remaining countdown, never run now
    assert out.state == "RETRY"
    (again,) = published(r, app)
    assert again.task_id == res.id and again.headers[headers.DEBOUNCE] == msg.headers[headers.DEBOUNCE]
    assert again.headers.get("eta")


def test_self_republishes_and_canvas_members_are_not_debounced(app: Celery, r: redis.Redis, prefix: str) -> None:
    t = app.tasks["d.retrying"]
    t.delay(13)
    (msg,) = published(r, app)
    drain(r, app)
    assert redeliver(t, msg).state == "RETRY"
    (retry,) = published(r, app)
    assert retry.headers[headers.DEBOUNCE] == msg.headers[headers.DEBOUNCE], "a retried run keeps its burst"
    assert retry.headers["retries"] == 1
    again = deliver(t, tuple(retry.args), retry.kwargs, task_id=retry.task_id, headers=retry.custom(), retries=1)
    assert again.retval == 13
    drain(r, app)
    chain(app.tasks["d.reindex"].s(14, "in-chain"), app.tasks["d.echo"].s()).apply_async()
    (member,) = published(r, app)
    assert headers.DEBOUNCE not in member.headers
    assert not r.exists(debounce_name(prefix, "doc:14", "d.reindex"))


def test_a_retried_run_is_superseded_once_a_later_run_has_started(app: Celery, r: redis.Redis, prefix: str) -> None:
    """A retry of an older burst's run, delivered after a newer run started, must not land last with older
    arguments (review): it is consumed unrun as superseded, naming the newer run."""
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="d.edit", lock_key="doc:{doc}", lock_debounce=0.2,
              queue_lock_ttl=1)  # fmt: skip
    def edit(self: Any, doc: int, text: str) -> str:
        if text == "old" and self.request.retries == 0:
            raise self.retry(countdown=5)
        ran.append(text)
        return text

    edit.delay(15, "old")
    (old,) = published(r, app)
    drain(r, app)
    assert redeliver(edit, old).state == "RETRY"
    (retry,) = published(r, app)
    drain(r, app)
    # The burst's keys outlive the retry's countdown (5 s + queue_lock_ttl), not just their own 1.2 s: past it
    # the retry would find nothing, run, and land last with the older arguments (re-review).
    burst = retry.headers[headers.DEBOUNCE]
    assert r.pttl(debounce_run_name(prefix, "doc:15", "d.edit", burst)) > 5000
    assert r.pttl(debounce_name(prefix, "doc:15", "d.edit")) > 5000
    new = edit.delay(15, "new")
    (msg,) = published(r, app)
    drain(r, app)
    assert redeliver(edit, msg).retval == "new"
    with capture_logs() as logs:
        late = deliver(edit, tuple(retry.args), retry.kwargs, task_id=retry.task_id, headers=retry.custom(), retries=1)
    assert late.retval == {"lockguard": "superseded", "superseded_by": new.id}
    assert ran == ["new"]
    assert [e["superseded_by"] for e in logs if e["event"] == "lock.superseded"] == [new.id]


def test_a_copy_sent_through_the_primitive_is_never_debounced_and_new_work_inside_it_is(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """The woken copy a releaser publishes is its parked delivery (issue 29): no new record, no countdown;
    the marker names that copy's id only, so other work published meanwhile is still debounced."""
    from celery_lockguard import _handoff as handoff
    from celery_lockguard import _republish as republish

    t = app.tasks["d.reindex"]
    first = t.delay(21, "first")
    (msg,) = published(r, app)
    drain(r, app)
    record = debounce_name(prefix, "doc:21", "d.reindex")
    due = r.hget(record, "due_ms")
    spec = dict(t.signature(tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom()))
    handoff.publish(app, spec)  # as RELEASE's releaser does, from outside the parked task
    (woken,) = published(r, app)
    drain(r, app)
    assert woken.task_id == first.id and woken.headers.get("eta") is None, "published at once"
    assert woken.headers[headers.DEBOUNCE] == msg.headers[headers.DEBOUNCE], "still its burst's run"
    assert r.hget(record, "due_ms") == due and r.hget(record, "superseded") == "0", "the record is untouched"
    with republish.own_copy(first.id):
        other = t.delay(21, "other")
    (new,) = published(r, app)
    assert new.headers.get("eta") is not None and r.hget(record, "task_id") == other.id, "new work is debounced"
