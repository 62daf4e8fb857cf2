"""Park and wake through Celery's real tracer: every exit of a parked delivery, its copies and its releaser.

A holder of other work runs on the entity (a lease taken in this process, so it is alive, or a real
``LockedTask`` body in a thread); the waiter is delivered through ``build_tracer(eager=False)``; what
the runtime publishes is read back from the broker list and delivered again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _handoff as handoff
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard._config import settings
from celery_lockguard._keys import done_name, lock_name, wait_name, waiters_name

from .test_paths import hold
from .tracer import HOSTNAME, Message, deliver, make_app, published, redeliver


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("handoff", redis_url, prefix)


def release(app: Celery, r: redis.Redis, prefix: str, lease: L.Lease) -> bool:
    """What ``_release.release`` does on RELEASE's reply: wake the oldest waiter."""
    _, _, woken = L.release_and_wake(r, lease, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    return handoff.wake(app, settings(app), woken, "holder", "other")


def messages(r: redis.Redis, app: Celery, task_id: str) -> list[Message]:
    return [m for m in published(r, app) if m.task_id == task_id]


def waiter(app: Celery, runs: list[str], name: str = "h.charge", **options: Any) -> Any:
    @app.task(base=LockedTask, bind=True, name=name, lock_key="inv:{a}", shared=False, **options)
    def charge(self: Any, a: int, amount: int) -> int:
        runs.append(f"{self.request.id}:{amount}")
        return amount

    return charge


def lines(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    return [rec.lockguard for rec in caplog.records if getattr(rec, "lockguard", {}).get("event") == event]


class _Discarded:
    """The request ``task_revoked`` hands the worker's main process for a discarded copy."""

    def __init__(self, msg: Message) -> None:
        self.id = msg.task_id
        self.headers = msg.custom()
        self.request_dict = msg.custom()


def test_a_waiter_parks_once_and_the_release_wakes_it_with_a_reservation(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:1")
    out = deliver(t, (1, 100))
    assert out.state == "RETRY" and runs == []
    (safety,) = messages(r, app, out.task_id)
    park_token = safety.headers[headers.PARK]
    assert safety.headers["eta"] and headers.WOKEN not in safety.headers and safety.headers[headers.WAITS] == 1
    assert r.lrange(wait_name(prefix, "inv:1"), 0, -1) == [park_token]
    # a fresh delivery of other work meets the live holder and parks behind
    second = deliver(t, (1, 200))
    assert second.state == "RETRY"
    assert release(app, r, prefix, lease)
    woken = messages(r, app, out.task_id)[-1]
    assert woken.headers[headers.WOKEN] == 1 and woken.headers[headers.PARK] == park_token
    assert woken.headers.get("eta") is None and woken.args == [1, 100]
    held = r.hgetall(lock_name(prefix, "inv:1"))
    assert held["state"] == "handed" and held["token"] == park_token
    # nobody barges in on the reservation: a fresh delivery parks behind it
    barging = deliver(t, (1, 300))
    assert barging.state == "RETRY" and runs == []
    assert redeliver(t, woken).state == "SUCCESS" and runs == [f"{out.task_id}:100"]
    # the woken copy's release woke the next waiter; the safety copy drops itself, storing nothing
    assert messages(r, app, second.task_id)[-1].headers.get(headers.WOKEN) == 1
    assert redeliver(t, safety).state == "SUCCESS" and runs == [f"{out.task_id}:100"]
    assert not r.hexists(waiters_name(prefix, "inv:1"), f"s:{park_token}"), "the safety copy cleans its entry up"
    assert len(messages(r, app, out.task_id)) == 2, "a waiting task costs two re-publishes"


@pytest.mark.parametrize("exit_", ["success", "failure", "retry"])
def test_every_exit_of_the_holder_wakes_the_waiter(app: Celery, r: redis.Redis, prefix: str, exit_: str) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    go, started = threading.Event(), threading.Event()

    @app.task(base=LockedTask, bind=True, name="h.holder", lock_key="inv:{a}", shared=False, max_retries=3)
    def holder(self: Any, a: int) -> int:
        started.set()
        go.wait(10)
        if exit_ == "failure":
            raise ValueError("body failed")
        if exit_ == "retry":
            raise self.retry(countdown=30)
        return a

    holding: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: holding.update(out=deliver(holder, (2,), task_id="holder-id")))
    thread.start()
    assert started.wait(10)
    out = deliver(t, (2, 100))
    assert out.state == "RETRY"
    go.set()
    thread.join(10)
    assert holding["out"].state == {"success": "SUCCESS", "failure": "FAILURE", "retry": "RETRY"}[exit_]
    woken = messages(r, app, out.task_id)[-1]
    assert woken.headers.get(headers.WOKEN) == 1, f"the holder's {exit_} did not wake the waiter"
    assert redeliver(t, woken).state == "SUCCESS" and len(runs) == 1


def test_a_stalled_wake_publish_never_holds_up_the_releasing_delivery(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: with RELEASE waited for (the server on this host), the wake-up publish ran inside the
    releasing task, so a broker down held it about 19 s past its body (Celery's publish retries). It runs on
    the replies thread, as for a deferred reply; the woken copy goes out once the publish gets through."""
    from celery.app.trace import build_tracer

    from celery_lockguard.testing import settle

    runs: list[str] = []
    t = waiter(app, runs)
    started, go = threading.Event(), threading.Event()

    @app.task(base=LockedTask, bind=True, name="h.stall", lock_key="inv:{a}", shared=False)
    def holder(self: Any, a: int) -> int:
        started.set()
        go.wait(10)
        return a

    unstall, publishing = threading.Event(), threading.Event()
    on: list[str] = []
    real_publish = handoff.publish

    def stalled(app_: Celery, spec: dict[str, Any]) -> None:
        on.append(threading.current_thread().name)
        publishing.set()
        assert unstall.wait(10)
        real_publish(app_, spec)

    monkeypatch.setattr(handoff, "publish", stalled)
    request = {"id": "stall-holder", "task": holder.name, "args": [4], "kwargs": {}, "hostname": HOSTNAME}
    trace = build_tracer(holder.name, holder, app=app, eager=False, propagate=False)
    returned: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: returned.update(rv=trace("stall-holder", [4], {}, {**request})[0]))
    thread.start()
    assert started.wait(10)
    out = deliver(t, (4, 100))
    assert out.state == "RETRY"
    go.set()
    thread.join(10)
    assert returned.get("rv") == 4, "the releasing delivery waited for its wake-up publish"
    assert publishing.wait(10) and on == ["lockguard-replies"]
    assert not any(m.headers.get(headers.WOKEN) for m in messages(r, app, out.task_id))  # still stalled
    unstall.set()
    settle()
    woken = messages(r, app, out.task_id)[-1]
    assert woken.headers.get(headers.WOKEN) == 1
    assert redeliver(t, woken).state == "SUCCESS" and runs == [f"{out.task_id}:100"]


def test_the_wait_budget_gives_up_without_parking(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs: list[str] = []
    t = waiter(app, runs, lock_max_waits=1)
    hold(r, prefix, "inv:3")
    out = deliver(t, (3, 100), headers={headers.WAITS: 1})
    assert out.state == "FAILURE" and not r.exists(wait_name(prefix, "inv:3"))


def test_identical_work_is_still_skipped_not_parked(app: Celery, r: redis.Redis, prefix: str) -> None:
    from celery_lockguard._keys import digest

    runs: list[str] = []
    t = waiter(app, runs)
    hold(r, prefix, "inv:4", task_name=t.name, dig=digest({"a": 4, "amount": 100}))
    out = deliver(t, (4, 100))
    assert out.state == "SUCCESS" and out.retval is None and not r.exists(wait_name(prefix, "inv:4"))


def test_a_woken_copy_answered_from_the_record_frees_its_reservation_for_the_next(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    runs: list[str] = []
    t = waiter(app, runs, name="h.idem", idempotency_key="pay:{a}:{amount}")
    lease = hold(r, prefix, "inv:5")
    first, second = deliver(t, (5, 100)), deliver(t, (5, 200))
    assert release(app, r, prefix, lease)
    # identical work meanwhile meets the reservation of identical work: skipped, as behind any live holder
    assert deliver(t, (5, 100), task_id="identical").retval is None
    record = '{"task_id":"x","task":"h.idem","digest":"","result":100}'
    r.set(done_name(prefix, "by:h.idem:pay:5:100"), record)  # h.idem's own record (issue 29 item 7)
    woken = messages(r, app, first.task_id)[-1]
    assert redeliver(t, woken).state == "SUCCESS" and runs == []  # answered from the record
    assert messages(r, app, second.task_id)[-1].headers.get(headers.WOKEN) == 1, "the next waiter was stranded"


def test_an_outage_at_park_publishes_the_parks_copy_due_as_a_wait(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PARK's reply lost is no answer (it may have run): the copy is the park's safety copy, carrying its token,
    so it settles with an entry PARK may have left and never runs beside a woken copy; due as a wait would be."""
    runs: list[str] = []
    t = waiter(app, runs)
    hold(r, prefix, "inv:6")

    def down(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("lock Redis unreachable")

    monkeypatch.setattr(handoff, "park", down)
    out = deliver(t, (6, 100))
    assert out.state == "RETRY"
    (msg,) = messages(r, app, out.task_id)
    assert msg.headers[headers.PARK] and not msg.headers.get(headers.WOKEN) and msg.headers[headers.WAITS] == 1
    # Due as a first wait is (at most 0.25 s), not at the holder's TTL as a parked delivery's safety copy.
    eta = datetime.fromisoformat(msg.headers["eta"])
    assert r.pttl(lock_name(prefix, "inv:6")) > 5000 and (eta - datetime.now(timezone.utc)).total_seconds() < 2


def test_arguments_that_are_not_json_back_off_as_before(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    hold(r, prefix, "inv:7")
    monkeypatch.setattr(handoff, "message_for", lambda *a, **k: None)  # what a pickled, non-JSON argument gives
    out = deliver(t, (7, 100))
    (msg,) = messages(r, app, out.task_id)
    assert out.state == "RETRY" and headers.PARK not in msg.headers and not r.exists(wait_name(prefix, "inv:7"))


def test_a_safety_copy_that_cannot_be_published_takes_its_entry_back_and_waits_in_process(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kombu.exceptions import OperationalError

    from celery_lockguard import _republish

    runs: list[str] = []
    t = waiter(app, runs)
    hold(r, prefix, "inv:8", ttl_ms=300)

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(_republish, "publish", broker_down)
    out = deliver(t, (8, 100))
    assert out.state == "SUCCESS" and len(runs) == 1, "the delivery must not be lost"
    assert r.llen(wait_name(prefix, "inv:8")) == 0 and not r.hgetall(waiters_name(prefix, "inv:8"))


def test_a_woken_copy_that_cannot_be_published_never_fails_the_releaser_and_the_safety_copy_takes_over(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:9")
    out = deliver(t, (9, 100))
    (safety,) = messages(r, app, out.task_id)

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OSError("broker unreachable")

    monkeypatch.setattr(handoff, "publish", broker_down)
    monkeypatch.setattr(handoff, "WAKE_GRACE", 0.2)
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        assert release(app, r, prefix, lease) is False
    assert lines(caplog, "lock.wake_failed")[0]["reason"].startswith("publish: OSError")
    assert r.hget(waiters_name(prefix, "inv:9"), f"s:{safety.headers[headers.PARK]}") == "waking"
    assert redeliver(t, safety).state == "SUCCESS" and len(runs) == 1  # took over after the grace


def test_an_outage_at_release_leaves_the_waiter_to_its_safety_copy(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    hold(r, prefix, "inv:10")
    out = deliver(t, (10, 100))
    (safety,) = messages(r, app, out.task_id)
    r.delete(lock_name(prefix, "inv:10"))  # RELEASE never answered: the lease expires by its TTL
    assert redeliver(t, safety).state == "SUCCESS" and len(runs) == 1
    assert r.llen(wait_name(prefix, "inv:10")) == 0


def test_an_outage_at_wake_confirm_still_runs_the_waiter_once(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:11")
    out = deliver(t, (11, 100))
    (safety,) = messages(r, app, out.task_id)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("lock Redis unreachable")

    monkeypatch.setattr(handoff, "confirm", down)
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        assert release(app, r, prefix, lease)
    assert lines(caplog, "lock.backend_unavailable")[0]["reason"] == "confirm wake: ConnectionError"
    woken = messages(r, app, out.task_id)[-1]
    assert redeliver(t, woken).state == "SUCCESS"
    assert redeliver(t, safety).state == "SUCCESS" and len(runs) == 1


def test_a_releaser_that_dies_before_the_wake_publish_is_covered_by_the_safety_copy(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    t = waiter(app, runs, completion=False)
    lease = hold(r, prefix, "inv:12")
    out = deliver(t, (12, 100))
    (safety,) = messages(r, app, out.task_id)
    monkeypatch.setattr(handoff, "WAKE_GRACE", 0.2)
    _, _, woken = L.release_and_wake(r, lease, prefix, reserve_ms=5000)  # ... and the releaser dies here
    assert woken is not None and len(messages(r, app, out.task_id)) == 1
    assert redeliver(t, safety).state == "SUCCESS" and len(runs) == 1
    # had the releaser only been slow, its late woken copy drops itself: never a second run (completion off)
    handoff.publish(app, __import__("json").loads(woken.message))
    late = messages(r, app, out.task_id)[-1]
    assert late.headers.get(headers.WOKEN) == 1
    redeliver(t, late)
    assert len(runs) == 1


def test_a_revoked_woken_copy_frees_its_reservation_and_wakes_the_next(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    from celery_lockguard import _signals

    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:13")
    first, second = deliver(t, (13, 100)), deliver(t, (13, 200))
    assert release(app, r, prefix, lease)
    woken = messages(r, app, first.task_id)[-1]

    assert _signals.free_reservation_from_main(t, _Discarded(woken), [13, 100], {})
    assert r.hget(lock_name(prefix, "inv:13"), "task_id") == second.task_id, "the next waiter holds the reservation"
    assert messages(r, app, second.task_id)[-1].headers.get(headers.WOKEN) == 1


def test_a_revoked_safety_copy_leaves_the_waiter_queue(
    app: Celery, r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A parked delivery revoked before anyone woke it: the release hands the entity to the next live waiter.

    Before, its entry stayed: the release reserved the entity for a message that was gone and
    re-published the revoked task (its woken copy), which a worker that forgot the revoke would run.
    """
    from celery_lockguard import _signals

    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:16")
    gone, live = deliver(t, (16, 100)), deliver(t, (16, 200))
    (safety,) = messages(r, app, gone.task_id)

    with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
        assert _signals.free_reservation_from_main(t, _Discarded(safety), [16, 100], {})
    assert [ln["reason"] for ln in lines(caplog, "lock.handoff_dropped")] == ["discarded_while_parked"]
    assert lines(caplog, "lock.released") == [], "it never held a lease: no release is counted"
    assert r.llen(wait_name(prefix, "inv:16")) == 1
    assert not _signals.free_reservation_from_main(t, _Discarded(safety), [16, 100], {}), "withdrawn once"
    assert release(app, r, prefix, lease)
    assert r.hget(lock_name(prefix, "inv:16"), "task_id") == live.task_id, "the live waiter holds the reservation"
    assert len(messages(r, app, gone.task_id)) == 1, "the revoked task was never re-published"
    assert messages(r, app, live.task_id)[-1].headers.get(headers.WOKEN) == 1


def test_a_revoked_workflow_member_parked_on_its_own_entity_leaves_the_waiter_queue(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """A member revoked while parked ends its workflow's lease, and its entry on its own entity goes too."""
    from celery import chain
    from celery.app.task import Context

    from celery_lockguard import _signals, workflow
    from celery_lockguard._headers import WORKFLOW

    runs: list[str] = []
    step = waiter(app, runs, name="h.step")

    @app.task(base=LockedTask, bind=True, name="h.done", shared=False)
    def done(task: Any, x: Any) -> Any:
        return x

    spec = workflow(chain(step.si(18, 100), done.s()), lock_key="wf:18", app=app).spec()
    lease = hold(r, prefix, "inv:18")
    out = deliver(
        step,
        (18, 100),
        headers={WORKFLOW: spec.header(index=0)},
        chain=[done.s().set(headers={WORKFLOW: spec.header(index=1)})],
    )
    (safety,) = messages(r, app, out.task_id)
    assert out.state == "RETRY" and r.llen(wait_name(prefix, "inv:18")) == 1
    request = Context(
        {"id": out.task_id, "args": [18, 100], "kwargs": {}, "headers": safety.custom(), **safety.custom()}
    )
    _signals._on_revoked(sender=step, request=request, terminated=False, expired=False)
    assert not r.exists(lock_name(prefix, "wf:18")), "the workflow's lease ended"
    assert r.llen(wait_name(prefix, "inv:18")) == 0, "its entry left the waiter queue"
    assert not release(app, r, prefix, lease), "nobody is woken"
    assert not r.exists(lock_name(prefix, "inv:18")) and len(messages(r, app, out.task_id)) == 1


def test_a_revoked_safety_copy_of_a_waking_entry_frees_the_reservation_for_the_next_waiter(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """Discarded after a release woke it, whose releaser died before publishing: the next waiter is woken.

    Its woken copy (same id, same ``expires``) would be discarded in turn; without this the entity
    stayed reserved for a message that was gone until the reservation's TTL.
    """
    from celery_lockguard import _signals

    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:17")
    out, nxt = deliver(t, (17, 100)), deliver(t, (17, 200))
    (safety,) = messages(r, app, out.task_id)
    _, _, woken = L.release_and_wake(r, lease, prefix, reserve_ms=5000)  # ... and the releaser dies here
    assert woken is not None and r.hget(lock_name(prefix, "inv:17"), "task_id") == out.task_id

    assert _signals.free_reservation_from_main(t, _Discarded(safety), [17, 100], {})
    assert r.hget(lock_name(prefix, "inv:17"), "task_id") == nxt.task_id, "the next waiter holds the reservation"
    assert messages(r, app, nxt.task_id)[-1].headers.get(headers.WOKEN) == 1
    assert len(messages(r, app, out.task_id)) == 1, "the discarded task was never re-published"


@dataclass
class Parked:
    """A waiter parked behind a live holder of other work (its task, runs, the lease, the delivery, its safety copy)."""

    task: Any
    runs: list[str]
    lease: L.Lease
    out: Any
    safety: Message


def parked(app: Celery, r: redis.Redis, prefix: str, n: int) -> Parked:
    """Park one delivery of ``h.charge(n, 100)`` on ``inv:<n>`` behind a lease held in this process."""
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, f"inv:{n}")
    out = deliver(t, (n, 100))
    (safety,) = messages(r, app, out.task_id)
    return Parked(t, runs, lease, out, safety)


def test_a_discarded_safety_copy_whose_entry_was_already_woken_leaves_the_woken_run_alone(
    app: Celery, r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The release woke it and the woken copy is out: discarding the safety copy frees nothing the woken copy needs."""
    from celery_lockguard import _signals

    p = parked(app, r, prefix, 19)
    t, runs, out, safety = p.task, p.runs, p.out, p.safety
    assert release(app, r, prefix, p.lease)  # woken copy published, entry 'woken'
    woken = messages(r, app, out.task_id)[-1]
    with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
        assert not _signals.free_reservation_from_main(t, _Discarded(safety), [19, 100], {})
    assert lines(caplog, "lock.handoff_dropped") == [] and lines(caplog, "lock.released") == []
    assert r.hget(lock_name(prefix, "inv:19"), "token") == woken.headers[headers.PARK], "the reservation stands"
    assert redeliver(t, woken).state == "SUCCESS" and runs == [f"{out.task_id}:100"]
    assert len(messages(r, app, out.task_id)) == 2, "nothing re-published for the discarded copy"


def test_a_discarded_safety_copy_with_no_entry_changes_nothing(
    app: Celery, r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its entry already gone (its woken copy ran and cleaned up, or it expired): no key is written, nobody woken."""
    from celery_lockguard import _signals

    p = parked(app, r, prefix, 20)
    t, runs, out, safety = p.task, p.runs, p.out, p.safety
    assert release(app, r, prefix, p.lease)
    assert redeliver(t, messages(r, app, out.task_id)[-1]).state == "SUCCESS"
    assert redeliver(t, safety).state == "SUCCESS" and len(runs) == 1  # the safety copy dropped its entry
    before = sorted(r.scan_iter(f"{prefix}:*"))
    with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
        assert not _signals.free_reservation_from_main(t, _Discarded(safety), [20, 100], {})
    assert sorted(r.scan_iter(f"{prefix}:*")) == before
    assert lines(caplog, "lock.handoff_dropped") == [] and lines(caplog, "lock.backend_unavailable") == []


def test_a_discarded_safety_copy_during_a_redis_outage_says_so_and_its_entry_goes_stale(
    app: Celery, r: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process cannot reach Redis: logged as an outage; the entry is left for a release to skip."""
    from celery_lockguard import _config, _signals

    p = parked(app, r, prefix, 21)
    t, lease, gone, safety = p.task, p.lease, p.out, p.safety
    with monkeypatch.context() as m:
        m.setitem(app.conf, "lockguard_redis_url", "redis://127.0.0.1:1/0")  # nothing listens on port 1
        _config.reset(app)
        with caplog.at_level(logging.DEBUG, logger="celery_lockguard"):
            assert not _signals.free_reservation_from_main(t, _Discarded(safety), [21, 100], {})
    _config.reset(app)
    (outage,) = lines(caplog, "lock.backend_unavailable")
    assert outage["reason"].startswith("withdraw:") and outage["lock_key"] == "inv:21"
    assert r.llen(wait_name(prefix, "inv:21")) == 1, "the entry is still queued"
    entry = f"d:{safety.headers[headers.PARK]}"
    r.hset(waiters_name(prefix, "inv:21"), entry, 0)  # its deadline passes (as for any dead waiter)
    live = deliver(t, (21, 200))
    assert release(app, r, prefix, lease)
    assert messages(r, app, live.task_id)[-1].headers.get(headers.WOKEN) == 1, "the release skipped the stale entry"
    assert len(messages(r, app, gone.task_id)) == 1, "the discarded task was never re-published"


def test_a_woken_copy_whose_reservation_lapsed_decides_as_any_delivery(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:14")
    out = deliver(t, (14, 100))
    assert release(app, r, prefix, lease)
    r.delete(lock_name(prefix, "inv:14"))  # the reservation lapsed (the woken copy sat in a long queue) ...
    hold(r, prefix, "inv:14", task_id="barged-in")  # ... and other work took the entity
    woken = messages(r, app, out.task_id)[-1]
    assert redeliver(t, woken).state == "RETRY" and runs == []  # it parks again
    assert messages(r, app, out.task_id)[-1].headers[headers.PARK] != woken.headers[headers.PARK]


def test_a_stale_entry_whose_message_is_gone_is_skipped_by_the_release(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:15")
    monkeypatch.setattr(handoff, "ENTRY_SLACK", -1000.0)  # the first entry is past its deadline at once
    lost = deliver(t, (15, 100))
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 30.0)
    live = deliver(t, (15, 200))
    assert release(app, r, prefix, lease)
    assert messages(r, app, live.task_id)[-1].headers.get(headers.WOKEN) == 1
    assert len(messages(r, app, lost.task_id)) == 1, "a stale entry is never woken; its safety copy decides"
    (safety,) = messages(r, app, lost.task_id)
    assert redeliver(t, safety).state == "RETRY"  # entry gone: decides afresh (the entity is reserved)


def test_eager_apply_never_parks(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs: list[str] = []
    t = waiter(app, runs, lock_max_waits=20)
    hold(r, prefix, "inv:16", ttl_ms=200)
    assert t.apply(args=(16, 100)).get() == 100  # waited in process, then ran
    assert not r.exists(wait_name(prefix, "inv:16"))


def test_a_safety_copy_whose_holder_still_runs_keeps_its_place_in_the_queue(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """W1 parked first; its safety copy comes back while the holder still runs and parks again: the release
    must still wake W1 before W2 (it went to the tail, and W2 was woken first)."""
    runs: list[str] = []
    t = waiter(app, runs)
    lease = hold(r, prefix, "inv:1")
    w1 = deliver(t, (1, 100), task_id="W1")
    w2 = deliver(t, (1, 200), task_id="W2")
    assert (w1.state, w2.state) == ("RETRY", "RETRY")
    (safety,) = messages(r, app, "W1")
    again = redeliver(t, safety)  # its countdown ended; the holder is alive: it parks again
    assert again.state == "RETRY" and runs == []
    queue = r.lrange(wait_name(prefix, "inv:1"), 0, -1)
    assert len(queue) == 2 and r.hget(waiters_name(prefix, "inv:1"), f"t:{queue[0]}") == "W1"
    assert release(app, r, prefix, lease)
    woken = messages(r, app, "W1")[-1]
    assert woken.headers[headers.WOKEN] == 1  # the oldest waiter goes first


def test_a_limited_waiter_parks_behind_its_slots_and_is_woken_into_the_slot_freed(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """``lock_limit``: a slot's release is a lease end like any other (it wakes), and a discarded woken copy
    frees the slot reserved for it and wakes the next waiter into that slot."""
    from celery_lockguard import _signals
    from celery_lockguard._keys import slot_lock_name

    runs: list[str] = []
    t = waiter(app, runs, name="h.limited", lock_limit=2)
    common = {"task_name": "other", "worker": "w", "fence_ttl_ms": 60_000, "limit": 2}
    slots = [L.acquire(r, prefix, "inv:21", ttl_ms=30_000, task_id=f"x{i}", digest=f"d{i}", **common) for i in range(2)]
    first, second = deliver(t, (21, 100)), deliver(t, (21, 200))
    assert first.state == second.state == "RETRY" and runs == []
    assert r.llen(wait_name(prefix, "inv:21")) == 2, "both parked behind the two slots, not backing off"
    freed = slots[1]
    assert isinstance(freed, L.Lease) and freed.slot == 1
    assert release(app, r, prefix, freed)
    slot_one = slot_lock_name(prefix, "inv:21", 1)
    assert r.hget(slot_one, "task_id") == first.task_id and r.hget(slot_one, "state") == "handed"
    woken = messages(r, app, first.task_id)[-1]
    assert woken.headers.get(headers.WOKEN) == 1
    # the worker discards that woken copy (revoked): its slot goes to the next waiter
    assert _signals.free_reservation_from_main(t, _Discarded(woken), [21, 100], {})
    assert r.hget(slot_one, "task_id") == second.task_id
    again = messages(r, app, second.task_id)[-1]
    assert again.headers.get(headers.WOKEN) == 1
    assert redeliver(t, again).state == "SUCCESS" and runs == [f"{second.task_id}:200"]
    assert r.hget(lock_name(prefix, "inv:21"), "task_id") == "x0", "slot 0's holder was never touched"
