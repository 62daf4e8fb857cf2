"""Review 3 (fresh context) of d8b365f..main: WORKFLOW_FORFEIT / WORKFLOW_ABORT crossed with one other feature,
through Celery's real tracer on the real Redis (a member delivered as a worker child runs it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _workflow as wf
from celery_lockguard._cli import lockguard
from celery_lockguard._keys import lock_name, workflows_ended_name

from .tracer import deliver, make_app, published, redeliver

A, B = "acct:r3a", "acct:r3b"  # sorted: A is the anchor


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("review3", redis_url, prefix)


def spec(index: int, wid: str = "wfr3") -> wf.Spec:
    return wf.Spec(
        id=wid, key=A, keys=(A, B), name="workflow:r3", digest="d1", ttl_ms=30_000, gap_ms=60_000,
        index=index, count=3, on_locked="retry", on_unavailable="fail_closed", max_waits=100, max_hold=3600.0,
    )  # fmt: skip


def force_release(app: Celery, key: str) -> None:
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["release", key, "--yes"], obj=obj)
    assert out.exit_code == 0, out.output


def start_in_gap(r: redis.Redis, prefix: str, wid: str = "wfr3") -> None:
    """Member 0 took both accounts and handed them to member 1's slot (state gap)."""
    stub = SimpleNamespace(key_prefix=prefix, fence_ttl=86400.0)
    req0 = SimpleNamespace(id="m0", task="r3.step", hostname="w1@host")
    assert wf.enter(r, stub, spec(0, wid), req0, "tok0", False).kind == "started"
    names = [lock_name(prefix, k) for k in (A, B)]
    assert int(scripts.workflow_pass(r, names, ["tok0", wf.slot(1), 60_000, ""])) == 1


def failed_with(out: Any) -> str:
    """The name of the exception a traced delivery failed with ('' if none)."""
    exc = getattr(out.retval, "exception", out.retval)
    return type(exc).__name__ if isinstance(exc, BaseException) else ""


def plain(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    got = L.acquire(
        r, prefix, key, ttl_ms=30_000, task_id="other", task_name="other.job", digest="d", worker="w",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease), got
    return got


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_member_retrying_after_an_entity_was_forced_away_fails_its_retry_copy_visibly(
    app: Celery, r: redis.Redis, prefix: str, forced: str
) -> None:
    """forfeit 'pass' x a member's retry(): an operator releases one account while member 1 runs; the member then
    retries. Its hand-over to the retry copy finds the loss and forfeits (the other account freed, the workflow
    marked ended). The retry copy must end visibly (WorkflowEnded, a LockLost), not be dropped as a stale copy of
    an ended workflow. Failed before the fix: its state was RETRY, not PENDING, so it was dropped (Ignore) and
    the chain hung; RETRY now counts as not yet answered."""
    gone = A if forced == "anchor" else B
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.retrying", max_retries=3)
    def retrying(self: Any, prev: Any = None) -> str:
        ran.append(self.request.retries)
        if self.request.retries == 0:
            force_release(app, gone)
            raise self.retry(countdown=0.2)
        return "ran"

    start_in_gap(r, prefix)
    first = deliver(retrying, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert first.state == "RETRY", first
    assert not r.exists(lock_name(prefix, A)) and not r.exists(lock_name(prefix, B)), "forfeit freed the other"
    (copy,) = [m for m in published(r, app) if m.task_id == "m1"]
    time.sleep(0.3)
    again = redeliver(retrying, copy)
    assert ran == [0], ran  # the body never ran again on accounts the workflow no longer holds
    assert again.state == "FAILURE" and failed_with(again) == "WorkflowEnded", (
        f"the retry copy of a forfeited workflow ended as {again.state} ({again.retval!r}): "
        "the member's result is never final, the chain waits forever"
    )


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_forfeit_never_releases_an_account_another_task_took_after_the_forced_release(
    app: Celery, r: redis.Redis, prefix: str, forced: str
) -> None:
    """forfeit 'pass' x a forced account taken at once by other work: member 1 ends, finds the loss and frees the
    account still the workflow's, never the other task's lease (token / workflow checks)."""
    gone, kept = (A, B) if forced == "anchor" else (B, A)
    taken: list[L.Lease] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.step")
    def step(self: Any, prev: Any = None) -> str:
        force_release(app, gone)
        taken.append(plain(r, prefix, gone))
        return "ran"

    start_in_gap(r, prefix)
    out = deliver(step, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert out.state == "SUCCESS", out
    other = r.hgetall(lock_name(prefix, gone))
    assert other.get("token") == taken[0].token and other.get("task_id") == "other", other
    assert not r.exists(lock_name(prefix, kept)), r.hgetall(lock_name(prefix, kept))


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_member_entering_after_a_forced_account_was_retaken_frees_only_the_workflows_own(
    app: Celery, r: redis.Redis, prefix: str, forced: str
) -> None:
    """forfeit 'enter' x a forced account taken at once by other work (in the gap): member 1 fails visibly
    (LockLost), the gap account is freed at once, the other task's lease is left alone."""
    gone, kept = (A, B) if forced == "anchor" else (B, A)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.step2")
    def step(self: Any, prev: Any = None) -> str:
        ran.append(self.request.id)
        return "ran"

    start_in_gap(r, prefix)
    force_release(app, gone)
    lease = plain(r, prefix, gone)
    out = deliver(step, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert ran == [] and out.state == "FAILURE" and failed_with(out) == "LockLost", out
    assert r.hget(lock_name(prefix, gone), "token") == lease.token
    assert not r.exists(lock_name(prefix, kept)), r.hgetall(lock_name(prefix, kept))


def test_abort_of_a_queued_member_decides_on_the_sibling_when_the_anchor_was_retaken(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """WORKFLOW_ABORT x the anchor forced away and retaken by other work: a revoke of the member the gap waits for
    frees the sibling (still the workflow's) and leaves the other task's anchor lease untouched."""
    start_in_gap(r, prefix)
    force_release(app, A)
    lease = plain(r, prefix, A)
    s = SimpleNamespace(key_prefix=prefix, shorten_grace=0.5)
    assert wf.abort(r, s, spec(1), "m1") is True  # type: ignore[arg-type]
    assert r.hget(lock_name(prefix, A), "token") == lease.token
    assert not r.exists(lock_name(prefix, B))


def test_a_retry_copy_that_finds_an_account_gone_in_its_gap_fails_with_lock_lost(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """Control for the retry crossing above: the same retry, the account forced away after the hand-over (in
    the gap): the retry copy enters, finds the loss and fails visibly (LockLost); the other account is freed."""
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.retrying2", max_retries=3)
    def retrying(self: Any, prev: Any = None) -> str:
        ran.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)
        return "ran"

    start_in_gap(r, prefix)
    first = deliver(retrying, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert first.state == "RETRY", first
    force_release(app, B)
    (copy,) = [m for m in published(r, app) if m.task_id == "m1"]
    time.sleep(0.3)
    again = redeliver(retrying, copy)
    assert ran == [0] and again.state == "FAILURE" and failed_with(again) == "LockLost", again
    assert not r.exists(lock_name(prefix, A)) and not r.exists(lock_name(prefix, B))


def test_a_chord_page_killed_under_a_forfeited_workflow_leaves_the_account_to_lapse_by_its_ttl(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """forfeit 'leave' x a chord page that died (SIGKILL: it never leaves, ``active`` never reaches 0): the other
    page ends after one account was forced away; the account still the workflow's is not freed under the dead
    page's count, and not held past its TTL either (nothing renews it); the dead page's redelivery fails visibly."""
    ttl_ms = 3000
    page = {**spec(1).header(parallel=True, width=2), "ttl_ms": ttl_ms}

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.page")
    def page_task(self: Any, prev: Any = None, n: int = 0) -> int:
        if n == 2:
            force_release(app, B)
        return n

    start_in_gap(r, prefix)
    stub = SimpleNamespace(key_prefix=prefix, fence_ttl=86400.0)
    killed = SimpleNamespace(id="p1", task="r3.page", hostname="w1@host")
    p1 = wf.Spec.from_header(page, "r3.page")
    assert wf.enter(r, stub, p1, killed, "ignored", False).kind == "entered"  # page 1 runs, then dies
    out = deliver(page_task, (), {"n": 2}, task_id="p2", headers={headers.WORKFLOW: page})
    assert out.state == "SUCCESS", out
    anchor = lock_name(prefix, A)
    assert r.hget(anchor, "workflow") == "wfr3" and 0 < r.pttl(anchor) <= 30_000, r.hgetall(anchor)
    again = deliver(page_task, (), {"n": 1}, task_id="p1", headers={headers.WORKFLOW: page})
    assert again.state == "FAILURE" and failed_with(again) == "LockLost", again
    deadline = time.time() + 35
    while r.exists(anchor) and time.time() < deadline:
        time.sleep(0.2)
    assert not r.exists(anchor), "the account outlived its TTL under a dead page"


def test_a_stale_delivery_ending_after_a_take_over_never_frees_the_accounts_under_the_new_delivery(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """forfeit 'pass' x a take-over: member 1's delivery D1 stops renewing (paused), its redelivery D2 takes the
    workflow over (WORKFLOW_ENTER take-over: fresh token, new fences on both accounts) and runs. D1 then ends: its
    hand-over finds its token gone. Nothing was forced away, and D2's body runs under both accounts: they must
    stay held under D2's token (never two bodies per entity), and the workflow must not be marked ended.

    Failed before its fix (a defect of the first forfeit): WORKFLOW_FORFEIT named entities by workflow id, not by
    D1's token: D1's forfeit 'pass' released both accounts under D2's token and marked the workflow ended."""
    stub = SimpleNamespace(key_prefix=prefix, fence_ttl=86400.0)
    d2 = SimpleNamespace(id="m1", task="r3.slow", hostname="w2@other-host")
    took: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.slow")
    def slow(self: Any, prev: Any = None) -> str:
        # meanwhile on another worker: the redelivery of this very message takes the member over
        entry = wf.enter(r, stub, spec(1), d2, "tok-d2", True)
        assert entry.kind == "entered", entry
        took.append(entry.token)
        return "ran"

    start_in_gap(r, prefix)
    out = deliver(slow, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert out.state == "SUCCESS" and took == ["tok-d2"], out
    leases = {k: r.hgetall(lock_name(prefix, k)) for k in (A, B)}
    assert all(h.get("token") == "tok-d2" for h in leases.values()), f"D2 still runs, its accounts: {leases}"
    assert r.zscore(workflows_ended_name(prefix, A), "wfr3") is None, "the workflow D2 runs was marked ended"


def test_a_member_parked_on_its_own_lock_woken_after_an_account_was_forced_away_fails_and_frees_all(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """forfeit 'enter' x a member parked on its own lock (inv:7): while it is parked (the workflow in the gap for
    its slot) an operator releases one account. The holder of inv:7 ends and wakes it: the woken copy fails
    visibly (LockLost), never runs its body, frees the other account at once and leaves nothing of its own on
    inv:7 (its reservation given back: the next waiter there is not held up)."""
    from celery_lockguard import _handoff as handoff
    from celery_lockguard._config import settings
    from celery_lockguard._keys import wait_name

    from .test_paths import hold

    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.own", lock_key="inv:{inv}", lock_ttl=5)
    def own(self: Any, prev: Any = None, inv: int = 0) -> str:
        ran.append(self.request.id)
        return "ran"

    start_in_gap(r, prefix)
    holder = hold(r, prefix, "inv:7")
    out = deliver(own, (), {"inv": 7}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()})
    assert out.state == "RETRY" and r.llen(wait_name(prefix, "inv:7")) == 1, out
    assert r.hget(lock_name(prefix, A), "state") == "gap"
    force_release(app, B)
    _, _, woken = L.release_and_wake(r, holder, prefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
    assert handoff.wake(app, settings(app), woken, "holder", "other")
    copy = [m for m in published(r, app) if m.task_id == "m1" and m.headers.get(headers.WOKEN)][-1]
    again = redeliver(own, copy)
    assert ran == [] and again.state == "FAILURE" and failed_with(again) == "LockLost", again
    assert not r.exists(lock_name(prefix, A)) and not r.exists(lock_name(prefix, B))
    inv = r.hgetall(lock_name(prefix, "inv:7"))
    assert not inv, f"inv:7 still held for the failed member: {inv}"


def test_a_chord_page_whose_retries_ran_out_after_a_forced_release_does_not_free_a_running_pages_account(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """forfeit 'leave' x a page's retry() that ran out of retries: page 2 runs on another worker; page 1 finds
    account B forced away, then retries with none left. Its retry hand-over left the slot (forfeit 'leave': one
    page fewer) and its failing end leaves again (``left``: not counted twice by WORKFLOW_LEAVE). The account
    still the workflow's must stay held while page 2's body runs (never two bodies per entity).

    Failed before its fix (a defect of the first forfeit): forfeit 'leave' counted page 1 out twice (``active``
    2 -> 0), so it released account A, marked ended, while page 2 ran."""
    page = spec(1).header(parallel=True, width=2)

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.page2", max_retries=0)
    def page_task(self: Any, prev: Any = None, n: int = 0) -> int:
        force_release(app, B)
        raise self.retry(countdown=0.2, exc=ValueError("page 1: try again"))

    start_in_gap(r, prefix)
    stub = SimpleNamespace(key_prefix=prefix, fence_ttl=86400.0)
    other = SimpleNamespace(id="p2", task="r3.page2", hostname="w2@other-host")
    assert wf.enter(r, stub, wf.Spec.from_header(page, "r3.page2"), other, "x", False).kind == "entered"
    out = deliver(page_task, (), {"n": 1}, task_id="p1", headers={headers.WORKFLOW: page})
    assert out.state == "FAILURE", out
    anchor = r.hgetall(lock_name(prefix, A))
    assert anchor.get("workflow") == "wfr3" and anchor.get("state") == "running", (
        f"page 2 still runs, yet account {A} is {anchor or 'free'}"
    )


@pytest.mark.parametrize("planted", ["wait_queue", "lease_hash"])
def test_an_until_done_retry_with_a_wrong_type_key_on_its_anchor_still_frees_and_wakes_the_others(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """release_others x WRONGTYPE on the anchor (acc:1): the retry frees acc:2 (its parked waiter woken) whatever
    the anchor's keys hold; the anchor is handed over as the retry's claim (its wait queue planted) or, its lease
    hash replaced by a string, left as it is (nothing of ours), and the retry is published either way."""
    from celery_lockguard import _handoff as handoff
    from celery_lockguard._keys import wait_name

    woken: list[dict[str, Any]] = []
    monkeypatch.setattr(handoff, "publish", lambda _app, spec: woken.append(spec))
    attempts: list[str] = []

    @app.task(
        base=LockedTask, bind=True, shared=False, name="r3.duo", lock_key=("acc:{a}", "acc:{b}"),
        lock_mode="until_done", max_retries=2,
    )  # fmt: skip
    def duo(self: Any, a: int, b: int) -> int:
        attempts.append(self.request.id)
        parked = handoff.park(r, prefix, "acc:2", "p2", "{}", task_id="w2", task_name="n", digest="d", countdown=30)
        assert parked.kind == "parked"
        if planted == "wait_queue":
            r.set(wait_name(prefix, "acc:1"), "planted", px=30_000)
        else:
            r.delete(lock_name(prefix, "acc:1"))
            r.set(lock_name(prefix, "acc:1"), "planted", px=30_000)
        raise self.retry(countdown=5)

    out = deliver(duo, (1, 2))
    assert out.state == "RETRY" and len(attempts) == 1, out
    two = r.hgetall(lock_name(prefix, "acc:2"))
    assert two.get("token") == "p2" and two.get("state") == "handed" and len(woken) == 1, (two, woken)
    assert [m for m in published(r, app) if m.task_id == out.task_id], "the retry was not published"
    if planted == "wait_queue":
        assert r.hget(lock_name(prefix, "acc:1"), "state") == "queued", r.hgetall(lock_name(prefix, "acc:1"))


@pytest.mark.parametrize("then", ["free", "taken"])
def test_a_wait_copy_whose_orphan_lapses_before_it_is_adopted_runs_once_or_waits(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """adopt-once x the carried orphan lapsing between the ACQUIRE that met it and the adoption: the copy takes
    the entity afresh and runs once (``free``), or, another task having taken it meanwhile (``taken``), never
    runs beside it: it waits (RETRY, a copy published), the other task's lease untouched."""
    from celery_lockguard import _delivery as delivery

    from .test_paths import hold

    runs: list[str] = []
    others: list[L.Lease] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.adopt", lock_key="inv:{a}", lock_ttl=5)
    def adopt(self: Any, a: int) -> int:
        runs.append(self.request.id)
        return a

    task_id = "r3-orphan-lapse"
    orphan = hold(r, prefix, "inv:8", task_id=task_id, task_name="r3.adopt")
    real = delivery._facts

    def facts_then_lapse(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        if args[2].token == orphan.token and r.exists(lock_name(prefix, "inv:8")):
            r.delete(lock_name(prefix, "inv:8"))  # the orphan lapses (its TTL) before the adoption
            if then == "taken":
                others.append(plain(r, prefix, "inv:8"))
        return out

    monkeypatch.setattr(delivery, "_facts", facts_then_lapse)
    out = deliver(adopt, (8,), task_id=task_id, headers={headers.ATTEMPT: orphan.token, headers.WAITS: 1})
    if then == "free":
        assert out.state == "SUCCESS" and runs == [task_id], (out, runs)
        assert not r.exists(lock_name(prefix, "inv:8")), r.hgetall(lock_name(prefix, "inv:8"))
    else:
        assert runs == [] and out.state == "RETRY", (out, runs)
        assert r.hget(lock_name(prefix, "inv:8"), "token") == others[0].token


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_stale_copy_of_the_first_member_after_a_forfeit_never_starts_the_workflow_again(
    app: Celery, r: redis.Redis, prefix: str, forced: str
) -> None:
    """forfeit x a redelivered stale member after WORKFLOW_END: member 1 ends finding one account forced away and
    retaken; its forfeit marks the workflow ended. A copy of member 0 (no result stored: a lost ack before the
    store) comes back: it is told the workflow ended (WorkflowEnded), never takes the accounts again."""
    gone, kept = (A, B) if forced == "anchor" else (B, A)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r3.step3")
    def step(self: Any, prev: Any = None) -> str:
        ran.append(self.request.id)
        if self.request.id == "m1":
            force_release(app, gone)
            plain(r, prefix, gone)
        return "ran"

    start_in_gap(r, prefix)
    assert deliver(step, (), {}, task_id="m1", headers={headers.WORKFLOW: spec(1).header()}).state == "SUCCESS"
    assert not r.exists(lock_name(prefix, kept))
    stale = deliver(step, (), {}, task_id="m0", headers={headers.WORKFLOW: spec(0).header()})
    assert ran == ["m1"] and stale.state == "FAILURE" and failed_with(stale) == "WorkflowEnded", stale
    assert not r.exists(lock_name(prefix, kept)) and r.hget(lock_name(prefix, gone), "task_id") == "other"
