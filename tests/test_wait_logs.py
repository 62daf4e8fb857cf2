"""A wait logs one lockguard line that says who holds the entity, when the call tries again and which attempt
this is, and Celery's own retry line says when too (it said ``Retry at None: LockContended(...)``).

Through Celery's real tracer (tests/tracer.py), as a worker child runs a delivery.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from celery_lockguard import LockedTask

from .test_task import hold_externally
from .tracer import deliver, make_app, published, redeliver


@pytest.mark.parametrize("policy", ["park", "throttled"])
def test_a_wait_is_one_lock_waiting_event_and_celerys_line_says_when(
    policy: str, redis_url: str, prefix: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """``park``: different work parks behind a holder (its safety copy's countdown); ``throttled``: a start
    past ``lock_rate`` backs off until the window admits it and is republished."""
    app = make_app("waitlogs", redis_url, prefix)

    rate = {"lock_rate": "1/m"} if policy == "throttled" else {}

    @app.task(base=LockedTask, bind=True, lock_key="export:{n}", name="wl.export", lock_max_waits=5, **rate)
    def export(self: Any, n: int) -> str:
        return "ran"

    if policy == "park":
        hold_externally(r, prefix, "export:1", task_id="holder-1", task_name="wl.other")
    else:
        assert deliver(export, (1,)).state == "SUCCESS"  # the window's one start
    with caplog.at_level(logging.INFO, logger="celery.app.trace"), capture_logs() as logs:
        first = deliver(export, (1,))
        assert first.state == "RETRY"
        second = redeliver(export, published(r, app)[-1])
        assert second.state == "RETRY"
    waiting = [e for e in logs if e["event"] == "lock.waiting"]
    assert len(waiting) == 2, [e["event"] for e in logs]  # one per wait
    if policy == "park":
        assert waiting[0]["holder_task_id"] == "holder-1" and waiting[0]["policy"] == "park"
    else:
        assert waiting[0]["reason"] == "rate_limited" or waiting[0]["holder_task_id"] is None, waiting[0]
    assert [w["attempt"] for w in waiting] == [1, 2] and waiting[0]["max_waits"] == 5
    assert all(w["countdown"] > 0 for w in waiting)
    retry_lines = [rec.getMessage() for rec in caplog.records if "retry:" in rec.getMessage()]
    assert len(retry_lines) == 2, retry_lines
    for line, wait in zip(retry_lines, waiting, strict=True):
        assert "Retry in " in line and "None" not in line.split(":")[1], line
        assert f"Retry in {wait['countdown']}s" in line, (line, wait)


def test_lock_waiting_is_logged_at_info() -> None:
    from celery_lockguard import _events

    assert _events._LEVELS["lock.waiting"] == logging.INFO


def test_a_late_safety_copy_says_at_info_why_it_is_ignored(
    redis_url: str, prefix: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery logs only "Task ... ignored" for the dropped copy of a parked call: lockguard's line says why."""
    from celery_lockguard import _headers as headers

    from .test_handoff import messages, release
    from .test_paths import hold

    app = make_app("waitlogs-safety", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, name="wl.charge", lock_key="inv:{a}", shared=False)
    def charge(self: Any, a: int) -> str:
        return "ran"

    lease = hold(r, prefix, "inv:1")
    out = deliver(charge, (1,))
    assert out.state == "RETRY"
    (safety,) = messages(r, app, out.task_id)
    assert release(app, r, prefix, lease)
    woken = messages(r, app, out.task_id)[-1]
    assert woken.headers[headers.WOKEN] == 1
    assert redeliver(charge, woken).state == "SUCCESS"
    with caplog.at_level(logging.INFO, logger="celery_lockguard"):
        redeliver(charge, safety)
    dropped = [rec for rec in caplog.records if getattr(rec, "lockguard", {}).get("event") == "lock.handoff_dropped"]
    assert len(dropped) == 1, [rec.getMessage() for rec in caplog.records]
    assert dropped[0].levelno == logging.INFO and dropped[0].lockguard["reason"] == "woken_copy_runs"
    assert dropped[0].lockguard["task_id"] == out.task_id


@pytest.mark.timeout(60)
def test_an_eager_apply_with_the_lock_redis_down_gives_up_visibly_within_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``.apply()`` waited in the caller's thread through the whole ``lock_max_waits`` budget (100 growing
    waits: over an hour), logging every few seconds. Now it gives up after ``EAGER_MAX_WAIT``."""
    import time

    from celery import Celery

    from celery_lockguard import BackendUnavailable
    from celery_lockguard import _waits as waits_module
    from celery_lockguard.testing import free_port

    monkeypatch.setattr(waits_module, "EAGER_MAX_WAIT", 3.0)
    app = Celery("eagerdown", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    app.conf.lockguard_socket_timeout = 0.5

    @app.task(base=LockedTask, bind=True, lock_key="k:{a}", name="wl.eager")  # lock_max_waits: the default 100
    def t(self: Any, a: int) -> str:
        return "ran"

    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(BackendUnavailable, match="eager call waited"):
        t.apply(args=(1,), throw=True)
    assert time.monotonic() - started < 3.0 + 10  # the bound plus a few refused connects
    (gave_up,) = [e for e in logs if e["event"] == "lock.wait_budget_exhausted"]
    assert gave_up["policy"] == "eager_max_wait" and gave_up["max_wait"] == 3.0


def _retry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "retry:" in rec.getMessage()]


@pytest.mark.parametrize("path", ["early", "outage"])
def test_a_debounced_delivery_sent_back_says_when_in_celerys_line(
    path: str, redis_url: str, prefix: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31: ``_debounce`` raised ``Retry(when=None)``, so Celery logged "Retry at None" for a delivery that
    came before its burst ended (``early``) and for one sent back because the record was unreachable
    (``outage``, fail_closed)."""
    from celery_lockguard._config import reset

    app = make_app("waitlogs-debounce", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="wl.reindex", lock_key="doc:{d}", lock_debounce=30)
    def reindex(self: Any, d: int) -> int:
        return d

    reindex.delay(1)
    (msg,) = published(r, app)
    r.delete(f"{app.conf.broker_transport_options['global_keyprefix']}{app.conf.task_default_queue}")
    if path == "outage":
        app.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"
        app.conf.lockguard_on_unavailable = "fail_closed"
        reset(app)
    with caplog.at_level(logging.INFO, logger="celery.app.trace"):
        assert redeliver(reindex, msg).state == "RETRY"
    (line,) = _retry_lines(caplog)
    assert "Retry in " in line and "Retry at None" not in line, line


def test_a_workflow_member_sent_back_to_wait_says_when_in_celerys_line(
    redis_url: str, prefix: str, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31: ``_workflow`` raised ``Retry(when=None)`` for a first member waiting behind another holder."""
    from celery import chain

    from celery_lockguard import workflow
    from celery_lockguard._headers import WORKFLOW

    app = make_app("waitlogs-workflow", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="wl.step")
    def step(self: Any, prev: Any = None) -> str:
        return "ok"

    hold_externally(r, prefix, "site:w", task_id="holder-1", task_name="wl.other")
    w = workflow(chain(step.s(), step.s()), lock_key="site:{site}", site="w", app=app)
    with caplog.at_level(logging.INFO, logger="celery.app.trace"):
        assert deliver(step, headers={WORKFLOW: w.spec().header(index=0)}).state == "RETRY"
    (line,) = _retry_lines(caplog)
    assert "Retry in " in line and "Retry at None" not in line, line
