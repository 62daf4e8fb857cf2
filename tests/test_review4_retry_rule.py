"""Review R4: d983721's RETRY rule (a member copy whose stored state is RETRY meeting an ended workflow fails
with WorkflowEnded) crossed with duplicate copies of a member's retry. Through Celery's real tracer on the real
Redis: a duplicate must be dropped quietly (never overwrite a final state, never fail a member whose body ran
and succeeded)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers
from celery_lockguard._keys import lock_name

from .test_review3_forfeit import A, B, failed_with, spec, start_in_gap
from .tracer import Message, Traced, make_app, published
from .tracer import deliver as traced


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("review4", redis_url, prefix)


def redeliver(task: Any, msg: Message) -> Traced:
    """Deliver a retry message read from the queue, with its retries count."""
    return traced(task, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom(),
                  retries=int(msg.headers.get("retries") or 0), parent_id=msg.headers.get("parent_id"))  # fmt: skip


def last_member(wid: str) -> dict[str, Any]:
    """Member 1 of a two-member workflow on A and B: the last, its success ends the workflow."""
    s = spec(1, wid)
    s = type(s)(**{**s.__dict__, "count": 2})
    assert s.last
    return {headers.WORKFLOW: s.header()}


def retried_once(app: Celery, r: redis.Redis, prefix: str, wid: str, outcome: str) -> tuple[Any, Any, list[int]]:
    """Member 1 (last) retries once; returns the task, its retry message and the bodies' retries seen."""
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name=f"r4.{outcome}", max_retries=3)
    def step(self: Any, prev: Any = None) -> str:
        ran.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        if outcome == "fail":
            raise ValueError("the retry failed")
        return "ran"

    start_in_gap(r, prefix, wid)
    first = traced(step, (), {}, task_id="m1", headers=last_member(wid))
    assert first.state == "RETRY", first
    (copy,) = [m for m in published(r, app) if m.task_id == "m1"]
    return step, copy, ran


@pytest.mark.parametrize("outcome", ["succeed", "fail"])
def test_a_duplicate_retry_message_after_the_retry_ended_is_dropped_quietly(
    app: Celery, r: redis.Redis, prefix: str, outcome: str
) -> None:
    """The broker redelivers the retry message after the retry copy ran to its end (SUCCESS or FAILURE) and
    ended the workflow: the duplicate is dropped, the stored result stays."""
    step, copy, ran = retried_once(app, r, prefix, "wfr4a" + outcome, outcome)
    done = redeliver(step, copy)
    final = "SUCCESS" if outcome == "succeed" else "FAILURE"
    assert done.state == final and ran == [0, 1], (done, ran)
    assert not r.exists(lock_name(prefix, A)) and not r.exists(lock_name(prefix, B))
    dup = redeliver(step, copy)
    assert ran == [0, 1], ran
    assert app.AsyncResult("m1").state == final, dup
    assert "WorkflowEnded" not in repr(dup.retval), dup
    if outcome == "fail":
        assert isinstance(app.AsyncResult("m1").result, ValueError), app.AsyncResult("m1").result


def test_a_duplicate_retry_copy_meeting_the_end_its_twin_wrote_before_storing_its_result_is_dropped(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same retry message delivered twice at once (the broker's visibility timeout, a lost ack): copy 1 runs
    the body, succeeds, and (the last member) writes WORKFLOW_END and releases; copy 2 enters in the window before
    copy 1's tracer stores SUCCESS (here: copy 1's store is held back until copy 2 has run). Copy 2 finds the
    workflow ended and the state still RETRY: it must be dropped (its twin answered), not fail the member whose
    body succeeded (a FAILURE fires the chain's errbacks / fails a chord's callback). Copy 1's store lands 0.3 s
    into copy 2's delivery (in a worker it lands milliseconds after the end is written): copy 2 reads the state
    again for ``ANSWER_GRACE`` before it answers, and finds its twin's."""
    step, copy, ran = retried_once(app, r, prefix, "wfr4b", "succeed")
    backend = app.backend
    held: list[tuple[Any, ...]] = []
    real = backend.mark_as_done
    monkeypatch.setattr(backend, "mark_as_done", lambda *a, **k: held.append((a, k)))
    first = redeliver(step, copy)
    assert ran == [0, 1] and held, (first, ran)
    assert not r.exists(lock_name(prefix, A)), "copy 1 ended the workflow"
    monkeypatch.setattr(backend, "mark_as_done", real)
    ((args, kwargs),) = held
    lands = threading.Timer(0.3, lambda: real(*args, **kwargs))  # copy 1's store lands during copy 2's delivery
    lands.start()
    second = redeliver(step, copy)  # copy 2, in the window
    lands.join()
    assert ran == [0, 1], ran
    assert second.state != "FAILURE", (
        f"a duplicate of the retry copy failed the member ({failed_with(second)}) although its twin's body "
        "succeeded: the RETRY rule reads its twin's not-yet-stored result as 'never answered'"
    )


def test_a_chord_page_retry_copy_runs_after_its_sibling_left_for_good(app: Celery, r: redis.Redis, prefix: str) -> None:
    """RETRY rule x a chord page's retry: page 1 retries (state RETRY), page 2 ends for good meanwhile. Page 1's
    retry copy must still run (the slot is not the last page's to end while a page retries), never meet an
    ended workflow; then the last page out hands the accounts on to the callback."""
    page = spec(1, "wfr4c").header(parallel=True, width=2)
    ran: list[tuple[str, int]] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r4.page", max_retries=2)
    def page_task(self: Any, prev: Any = None, n: int = 0) -> int:
        ran.append((self.request.id, self.request.retries))
        if n == 1 and self.request.retries == 0:
            raise self.retry(countdown=0)
        return n

    start_in_gap(r, prefix, "wfr4c")
    p1 = traced(page_task, (), {"n": 1}, task_id="p1", headers={headers.WORKFLOW: page})
    assert p1.state == "RETRY", p1
    p2 = traced(page_task, (), {"n": 2}, task_id="p2", headers={headers.WORKFLOW: page})
    assert p2.state == "SUCCESS", p2
    (copy,) = [m for m in published(r, app) if m.task_id == "p1"]
    again = redeliver(page_task, copy)
    assert again.state == "SUCCESS" and ran == [("p1", 0), ("p2", 0), ("p1", 1)], (again, ran)
    anchor = r.hgetall(lock_name(prefix, A))
    assert anchor.get("workflow") == "wfr4c" and anchor.get("state") == "gap", anchor
