"""Review R4: d983721's RETRY rule crossed with a member's wait on its own lock (a parked copy, state RETRY)
and with a workflow that ends while the member waits. Real tracer, real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _handoff as handoff
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _workflow as wf
from celery_lockguard._config import settings
from celery_lockguard._keys import lock_name, wait_name

from .test_paths import hold
from .test_review3_forfeit import failed_with
from .tracer import deliver, make_app, published, redeliver

A = "acct:r4single"


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("review4w", redis_url, prefix)


def single(index: int) -> wf.Spec:
    return wf.Spec(
        id="wfr4s", key=A, keys=(), name="workflow:r4", digest="d1", ttl_ms=30_000, gap_ms=60_000,
        index=index, count=3, on_locked="retry", on_unavailable="fail_closed", max_waits=100, max_hold=3600.0,
    )  # fmt: skip


def start_single_in_gap(r: redis.Redis, prefix: str) -> None:
    stub = SimpleNamespace(key_prefix=prefix, fence_ttl=86400.0)
    req0 = SimpleNamespace(id="m0", task="r4.step", hostname="w1@host")
    assert wf.enter(r, stub, single(0), req0, "tok0", False).kind == "started"
    assert int(scripts.workflow_pass(r, [lock_name(prefix, A)], ["tok0", wf.slot(1), 60_000, ""])) == 1


def parked_member(app: Celery, r: redis.Redis, prefix: str, ran: list[str]) -> tuple[Any, L.Lease]:
    @app.task(base=LockedTask, bind=True, shared=False, name="r4.own", lock_key="inv:{inv}", lock_ttl=5)
    def own(self: Any, prev: Any = None, inv: int = 0) -> str:
        ran.append(self.request.id)
        return "ran"

    start_single_in_gap(r, prefix)
    holder = hold(r, prefix, "inv:8")
    out = deliver(own, (), {"inv": 8}, task_id="m1", headers={headers.WORKFLOW: single(1).header()})
    assert out.state == "RETRY" and r.llen(wait_name(prefix, "inv:8")) == 1, out
    return own, holder


def test_a_woken_copy_of_a_member_whose_workflow_was_revoked_while_it_waited_fails_and_frees_its_reservation(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """Single-entity workflow, member 1 parked on its own lock inv:8 (state RETRY). The chain is revoked: the
    queued member 2's revoke aborts nothing of member 1's slot, so an operator's ``abort`` of member 1 ends it
    (as a worker's main process does for a revoked copy it discards). The holder of inv:8 ends and wakes member
    1's copy on a worker that never heard of the revoke: it fails visibly (WorkflowEnded), never runs, and gives
    its reservation on inv:8 back (the next waiter is not held up for the reservation TTL)."""
    ran: list[str] = []
    own, holder = parked_member(app, r, prefix, ran)
    assert wf.abort(r, settings(app), single(1), "m1", app)
    assert not r.exists(lock_name(prefix, A))
    _, _, woken = L.release_and_wake(r, holder, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    assert handoff.wake(app, settings(app), woken, "holder", "other")
    copy = [m for m in published(r, app) if m.task_id == "m1" and m.headers.get(headers.WOKEN)][-1]
    again = redeliver(own, copy)
    assert ran == [] and again.state == "FAILURE" and failed_with(again) == "WorkflowEnded", again
    assert not r.exists(lock_name(prefix, "inv:8")), r.hgetall(lock_name(prefix, "inv:8"))


def test_a_woken_copy_of_a_revoked_member_whose_revoke_was_stored_gives_its_reservation_back(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """As above, but the revoke was stored (REVOKED, a ready state) by the worker that discarded one copy: the
    other copy (on a worker without the revoke) is dropped as already answered -- and must still give back the
    reservation RELEASE made for it on inv:8, or the next waiter there waits out the reservation TTL."""
    ran: list[str] = []
    own, holder = parked_member(app, r, prefix, ran)
    assert wf.abort(r, settings(app), single(1), "m1", app)
    app.backend.mark_as_revoked("m1", "revoked")
    _, _, woken = L.release_and_wake(r, holder, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    assert handoff.wake(app, settings(app), woken, "holder", "other")
    copy = [m for m in published(r, app) if m.task_id == "m1" and m.headers.get(headers.WOKEN)][-1]
    redeliver(own, copy)
    assert ran == [] and app.AsyncResult("m1").state == "REVOKED"
    inv = r.hgetall(lock_name(prefix, "inv:8"))
    assert not inv, f"inv:8 still reserved for a member that will never run: {inv}"


@pytest.mark.parametrize("state", ["PENDING", "RETRY"])
def test_an_until_done_member_meeting_an_ended_workflow_frees_its_claim_on_its_own_entity(
    app: Celery, r: redis.Redis, prefix: str, state: str
) -> None:
    """RETRY rule x until_done: member 1 (own lock_key inv:10, lock_mode until_done) was published (its claim on
    inv:10 taken at publish); the workflow ends before it runs (aborted). Its copy, never answered (PENDING,
    or RETRY after a retry), fails with WorkflowEnded -- and must free its claim on inv:10, or identical work
    is refused and inv:10 stays held for a member that will never run."""
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r4.ud", lock_key="inv:{inv}", lock_mode="until_done")
    def ud(self: Any, prev: Any = None, inv: int = 0) -> str:
        ran.append(self.request.id)
        return "ran"

    start_single_in_gap(r, prefix)
    ud.apply_async(kwargs={"inv": 10}, task_id="m1", headers={headers.WORKFLOW: single(1).header()})
    assert r.exists(lock_name(prefix, "inv:10")), "the publish claimed inv:10"
    if state == "RETRY":
        app.backend.mark_as_retry("m1", RuntimeError("earlier try"))
    assert wf.abort(r, settings(app), single(1), "m1", app)
    (msg,) = [m for m in published(r, app) if m.task_id == "m1"]
    out = redeliver(ud, msg)
    assert ran == [] and out.state == "FAILURE" and failed_with(out) == "WorkflowEnded", out
    claim = r.hgetall(lock_name(prefix, "inv:10"))
    assert not claim, f"inv:10 still claimed for a member that failed: {claim}"
