"""Review 2 (fresh context) of b69312a..main: two features at a time, through Celery's real tracer.

An errored PARK that ran all the same ("unconfirmed": the reply lost) crossed with the release waking its entry,
a second park, ``lock_limit`` slots and ``max_waits``; the orphan tokens of ``lockguard_attempt`` crossed with
retry() and forged header values; a multi-entity ``until_done`` retry's hand-over crossed with an error at one
of its other entities.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime
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


def deliver_due(
    r: redis.Redis, app: Celery, t: Any, task_id: str, until: float, stop: Callable[[], bool] = lambda: False
) -> None:
    """Deliver this call's copies as a worker would, each when due (its eta), earliest first, until ``until``."""
    delivered: set[int] = set()
    while time.time() < until and not stop():
        mine = [(m, i) for i, m in enumerate(published(r, app)) if m.task_id == task_id and i not in delivered]
        if not mine:
            return
        msg, i = min(mine, key=lambda p: (eta_of(p[0]), p[1]))
        if eta_of(msg) > until:
            return
        time.sleep(max(0.0, eta_of(msg) - time.time()))
        delivered.add(i)
        redeliver(t, msg)


def eta_of(msg: Message) -> float:
    eta = msg.headers.get("eta")
    return datetime.fromisoformat(eta).timestamp() if eta else 0.0


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
    holders = [
        L.acquire(r, prefix, "inv:3", ttl_ms=10_000, task_id=f"h{i}", digest=f"d{i}", **common) for i in range(2)
    ]
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


# -- a multi-entity until_done retry's hand-over (release_others) crossed with an error at one entity ----------


def test_an_until_done_retry_failing_at_one_other_entity_still_frees_and_wakes_the_rest(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry hands the anchor (acc:1) over as its claim and frees the others (acc:2, acc:3), waking their
    waiters. acc:2's waiter queue is of another type (the vehicle test_multi_errors uses): its free fails. As
    for RELEASE_MULTI and KEEP_BEFORE since 38f128b, the loop must go on: acc:3 freed, its waiter woken; the
    anchor handed over (or freed), not left held by a body that has ended."""
    woken: list[dict[str, Any]] = []
    monkeypatch.setattr(handoff, "publish", lambda _app, spec: woken.append(spec))
    attempts: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="r2.tri",
        lock_key=("acc:{a}", "acc:{b}", "acc:{c}"),
        lock_mode="until_done",
        max_retries=2,
    )
    def tri(self: Any, a: int, b: int, c: int) -> int:
        attempts.append(self.request.id)
        if len(attempts) == 1:
            parked = handoff.park(r, prefix, "acc:3", "p3", "{}", task_id="w3", task_name="n", digest="d", countdown=30)
            assert parked.kind == "parked"
            r.set(wait_name(prefix, "acc:2"), "planted", px=30_000)  # a string where acc:2's waiter queue is
            raise self.retry(countdown=5)
        return len(attempts)

    out = deliver(tri, (1, 2, 3))
    assert out.state == "RETRY" and len(attempts) == 1
    holder3 = r.hgetall(lock_name(prefix, "acc:3"))
    holder1 = r.hgetall(lock_name(prefix, "acc:1"))
    assert holder3.get("token") == "p3" and holder3.get("state") == "handed", (
        f"acc:3 (after the failing acc:2) is left {holder3} (pttl {r.pttl(lock_name(prefix, 'acc:3'))} ms); "
        f"its waiter woken: {len(woken)}"
    )
    assert len(woken) == 1
    assert holder1.get("state") in (None, "queued"), f"the anchor is left held by the ended body: {holder1}"


def test_an_until_done_retry_whose_hand_over_failed_is_not_lost_behind_its_own_ended_body(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """The same failed hand-over: the anchor stays held under the ended body's token, the retry goes out
    without a claim. The retry copy meets a holder of its own id under a token it does not carry: it must
    not drop itself as a duplicate of a running original (nothing runs; the job would be lost), but wait
    (or adopt) and run once."""
    attempts: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="r2.tri2",
        lock_key=("acc:{a}", "acc:{b}", "acc:{c}"),
        lock_mode="until_done",
        max_retries=2,
        lock_ttl=3,
    )
    def tri(self: Any, a: int, b: int, c: int) -> int:
        attempts.append(self.request.id)
        if len(attempts) == 1:
            r.set(wait_name(prefix, "acc:12"), "planted", px=30_000)
            raise self.retry(countdown=0)
        return len(attempts)

    out = deliver(tri, (11, 12, 13))
    assert out.state == "RETRY" and len(attempts) == 1
    deliver_due(r, app, tri, out.task_id, until=time.time() + 20, stop=lambda: len(attempts) >= 2)
    assert len(attempts) == 2, (
        f"the retry never ran: {len(attempts)} runs; published {[m.custom() for m in messages(r, app, out.task_id)]}; "
        f"acc:11 {r.hgetall(lock_name(prefix, 'acc:11'))}"
    )


# -- an unconfirmed PARK of a workflow member with its own lock: the workflow's gap and its two copies ----------


def _wf_spec(index: int) -> Any:
    from celery_lockguard import _workflow as wf

    return wf.Spec(
        id="wfr2", key="tenant:r2:pipeline", name="workflow:r2", digest="d1", ttl_ms=5000, gap_ms=1000,
        index=index, count=3, on_locked="retry", on_unavailable="fail_closed", max_waits=100, max_hold=3600.0,
    )  # fmt: skip


@pytest.mark.parametrize("order", ["safety_first", "woken_first"])
def test_unconfirmed_park_of_a_workflow_member_runs_it_once_and_keeps_the_workflow(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str], order: str
) -> None:
    """Member 1 of a workflow parks on its own lock (inv:9); PARK ran, its reply lost. The copy goes out early,
    the workflow handed to member 1's slot for at least its countdown. The holder ends (woken copy out); both
    copies come: the member runs once, and the workflow is handed on to member 2, never ended or freed."""
    from celery_lockguard import _scripts as scripts
    from celery_lockguard import _workflow as wf

    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r2.own", lock_key="inv:{inv}", lock_ttl=5)
    def own(self: Any, prev: Any = None, inv: int = 0) -> list[str]:
        ran.append(self.request.id)
        return [*(prev or []), "own"]

    wkey = lock_name(prefix, "tenant:r2:pipeline")
    stub = type("S", (), {"key_prefix": prefix, "fence_ttl": 86400.0})()
    req0 = type("R", (), {"id": "m0", "task": "r2.step", "hostname": "w1@host"})()
    assert wf.enter(r, stub, _wf_spec(0), req0, "tok0", False).kind == "started"
    assert int(scripts.workflow_pass(r, [wkey], ["tok0", wf.slot(1), 1000])) == 1
    holder = hold(r, prefix, "inv:9")
    out = deliver(own, (), {"inv": 9}, task_id="m1", headers={headers.WORKFLOW: _wf_spec(1).header()})
    assert out.state == "RETRY" and park_ran_reply_lost == ["parked"]
    (safety,) = messages(r, app, "m1")
    gap = r.hgetall(wkey)
    assert gap.get("state") == "gap" and gap.get("next") == wf.slot(1), gap
    assert r.pttl(wkey) >= (eta_of(safety) - time.time()) * 1000, "the hand-over covers the copy's countdown"
    assert release(app, r, prefix, holder)
    woken = messages(r, app, "m1")[-1]
    assert woken.headers.get(headers.WOKEN) == 1
    time.sleep(max(0.0, eta_of(safety) - time.time()))
    first, second = (safety, woken) if order == "safety_first" else (woken, safety)
    states = [redeliver(own, first).state, redeliver(own, second).state]
    deliver_due(r, app, own, "m1", until=time.time() + 5)  # anything they published of themselves
    assert ran == ["m1"], (ran, states)
    lease = r.hgetall(wkey)
    assert lease.get("state") == "gap" and lease.get("next") == wf.slot(2), (lease, states)


# -- lockguard_attempt forged by anyone with broker access: bounded, never a crash ----------------------------


@pytest.mark.parametrize(
    "forged",
    [
        ",".join(f"tok{i:04d}" for i in range(10_000)),  # 10 000 tokens
        ",,,,,,,,,,,,",  # empty fields only
        12345,  # not a string
        ["a", "b"],  # a JSON list
        {"x": 1},  # a JSON object
        "x" * 200_000,  # one huge token
    ],
    ids=["many", "empty", "int", "list", "dict", "huge"],
)
def test_a_forged_attempt_header_is_bounded_and_never_crashes_the_delivery(
    app: Celery, r: redis.Redis, prefix: str, forged: Any
) -> None:
    """A copy carrying a forged ``lockguard_attempt`` waits (parks) as any copy would; what it carries on is
    bounded (MAX_ATTEMPT_TOKENS tokens, never more than it came with), and the job runs once."""
    runs: list[str] = []
    t = waiter(app, runs)
    holder = hold(r, prefix, "inv:5")
    out = deliver(t, (5, 100), headers={headers.ATTEMPT: forged, headers.WAITS: 1})
    assert out.state == "RETRY" and runs == [], out
    (copy,) = messages(r, app, out.task_id)
    carried = str(copy.headers.get(headers.ATTEMPT) or "")
    tokens = [tk for tk in carried.split(",") if tk]
    assert len(tokens) <= headers.MAX_ATTEMPT_TOKENS, len(tokens)
    assert all(len(tk) <= headers.MAX_TOKEN_LEN for tk in tokens), "no token of ours is longer: dropped"
    assert len(carried) <= len(str(forged)), f"the copy carries on {len(carried)} characters"
    assert release(app, r, prefix, holder)
    deliver_due(r, app, t, out.task_id, until=time.time() + 5)
    assert runs == [f"{out.task_id}:100"], runs


# -- the orphan tokens crossed with retry(): a retry is a new attempt, it carries none -------------------------


def test_a_copy_that_adopted_its_orphan_then_retries_publishes_a_retry_without_orphan_tokens(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """A wait copy carries the token of an ACQUIRE that errored yet ran (its orphan lease); it adopts the orphan,
    runs, and calls retry(). The retry carries no lockguard_attempt (a retry is a new attempt), takes the entity
    afresh and runs once; nothing is left held."""
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r2.retrying", lock_key="inv:{a}", max_retries=2)
    def retrying(self: Any, a: int) -> int:
        runs.append(self.request.id)
        if len(runs) == 1:
            raise self.retry(countdown=0)
        return len(runs)

    task_id = "r2-orphan-retry"
    orphan = hold(r, prefix, "inv:7", task_id=task_id, task_name="r2.retrying")  # the ACQUIRE that ran on thaw
    out = deliver(retrying, (7,), task_id=task_id, headers={headers.ATTEMPT: f"junk,{orphan.token}", headers.WAITS: 1})
    assert out.state == "RETRY" and len(runs) == 1, (out, runs)
    (again,) = messages(r, app, task_id)
    assert headers.ATTEMPT not in again.headers, again.custom()
    assert not r.exists(lock_name(prefix, "inv:7")), r.hgetall(lock_name(prefix, "inv:7"))
    assert redeliver(retrying, again).state == "SUCCESS" and runs == [task_id, task_id]
    assert not r.exists(lock_name(prefix, "inv:7"))


# -- an unconfirmed PARK of a multi-entity woken copy that kept a reservation: its copy revoked, or early ------


def _lose_next_park_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    real = handoff.park

    def ran_then_lost(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        monkeypatch.setattr(handoff, "park", real)
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(handoff, "park", ran_then_lost)


@pytest.mark.parametrize("then", ["revoked", "early_then_woken"])
def test_unconfirmed_park_of_a_woken_multi_entity_copy_that_kept_a_reservation(
    redis_url: str, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The woken copy of acc:1's waiter meets acc:2 held, keeps acc:1 and parks on acc:2; PARK ran, its reply lost.
    Revoked, its copy gives back acc:1 and leaves no entry on acc:2 to be woken for nobody. Delivered early, it
    parks again keeping acc:1; acc:2's release then runs the job once and leaves nothing held."""
    from types import SimpleNamespace

    from celery_lockguard._signals import free_reservation_from_main

    from .test_multi_errors import copies, held, transfer, woken_blocked

    app = make_app("review2m", redis_url, prefix)
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, second = woken_blocked(app, r, r, prefix, t, ttl_ms=60_000)
    _lose_next_park_reply(monkeypatch)
    assert redeliver(t, copy).state == "RETRY" and ran == []
    parked = copies(r, app, copy.task_id)[-1]
    assert parked.headers[headers.PARK_ENTITY] == "acc:2" and not parked.headers.get(headers.WOKEN)
    assert r.hget(lock_name(prefix, "acc:1"), "token") == parked.headers[headers.PARK]  # kept for the copy
    assert r.llen(wait_name(prefix, "acc:2")) == 1  # PARK ran
    if then == "revoked":
        free_reservation_from_main(
            t, SimpleNamespace(id=parked.task_id, headers=parked.custom(), request_dict={}), (1, 2), {}
        )
        assert not r.exists(lock_name(prefix, "acc:1")), r.hgetall(lock_name(prefix, "acc:1"))
        assert release(app, r, prefix, second) is False, "acc:2 was handed to a revoked waiter"
        assert not r.exists(lock_name(prefix, "acc:2")), r.hgetall(lock_name(prefix, "acc:2"))
        return
    assert redeliver(t, parked).state == "RETRY" and ran == []  # acc:2 still held: parks again
    assert release(app, r, prefix, second)
    deliver_due(r, app, t, copy.task_id, until=time.time() + 5, stop=lambda: bool(ran))
    assert ran == [(1, 2)]
    for m in copies(r, app, copy.task_id):  # every copy delivered again (a duplicate): none runs it twice
        redeliver(t, m)
    assert ran == [(1, 2)] and held(r, prefix) == []


# -- orphan tokens: two of a copy's carried tokens each holding part of its entities ---------------------------


def test_a_copy_whose_entities_are_held_under_two_of_its_carried_tokens_adopts_them_without_spinning(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acc:31 is left under token P1 and acc:32 under P2, both this call's and both carried in lockguard_attempt
    (on Cluster a KEEP_BEFORE per entity, one call re-tokening and the next timing out, leaves exactly this:
    "under the old token or the new one"). ADOPT takes one token at a time: adopting P1 meets acc:32 under P2,
    adopting P2 meets acc:31 under P1. The delivery must settle (adopt both, or wait) in a bounded number of
    ACQUIREs, not spin until one of them lapses."""
    from celery_lockguard import _delivery

    ran: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r2.pair", lock_key=("acc:{a}", "acc:{b}"))
    def pair(self: Any, a: int, b: int) -> int:
        ran.append((a, b))
        return a + b

    task_id = "r2-two-tokens"
    for key, token in (("acc:31", "p1" * 16), ("acc:32", "p2" * 16)):  # a woken copy's reservations (wake_oldest)
        r.hset(
            lock_name(prefix, key),
            mapping={"token": token, "task_id": task_id, "task_name": "r2.pair", "digest": "", "host": "",
                     "pid": 0, "worker": "", "state": "handed", "ttl": 3000, "fence": ""},
        )  # fmt: skip
        r.pexpire(lock_name(prefix, key), 3000)
    calls: list[str] = []
    real = _delivery._acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[7]))  # replace_token
        return real(*args, **kwargs)

    monkeypatch.setattr(_delivery, "_acquire", counted)
    began = time.monotonic()
    out = deliver(
        pair, (31, 32), task_id=task_id, headers={headers.ATTEMPT: f"{'p1' * 16},{'p2' * 16}", headers.WAITS: 1}
    )
    took = time.monotonic() - began
    assert len(calls) <= 6, (
        f"{len(calls)} ACQUIREs in {took:.2f} s ({out.state}, ran {ran}); replace tokens {calls[:6]}..."
    )


# -- an unconfirmed PARK crossed with lock_debounce: the burst's run parks, its copies come back -------------


@pytest.mark.parametrize("order", ["safety_first", "woken_first"])
def test_unconfirmed_park_of_a_debounced_run_runs_the_burst_once(
    app: Celery, r: redis.Redis, prefix: str, park_ran_reply_lost: list[str], order: str
) -> None:
    """A burst of two publishes; the last (the burst's run) meets other work on the entity and parks; PARK ran,
    its reply lost. The release wakes it; both copies come (the early safety copy and the woken one): the burst
    runs once, with the last arguments, and nothing is left held."""
    ran: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r2.reindex", lock_key="doc:{doc}", lock_debounce=0.2)
    def reindex(self: Any, doc: int, text: str = "") -> str:
        ran.append((self.request.id, text))
        return text

    holder = hold(r, prefix, "doc:8")
    reindex.delay(8, "v1")
    last = reindex.delay(8, "v2")
    deliver_due(r, app, reindex, last.id, until=time.time() + 3, stop=lambda: bool(park_ran_reply_lost))
    for m in published(r, app):  # the superseded first publish, once due
        if m.task_id != last.id:
            time.sleep(max(0.0, eta_of(m) - time.time()))
            redeliver(reindex, m)
    assert park_ran_reply_lost == ["parked"] and ran == []
    safety = messages(r, app, last.id)[-1]
    assert safety.headers.get(headers.PARK) and not safety.headers.get(headers.WOKEN)
    assert release(app, r, prefix, holder)
    woken = messages(r, app, last.id)[-1]
    assert woken.headers.get(headers.WOKEN) == 1
    time.sleep(max(0.0, eta_of(safety) - time.time()))
    first, second = (safety, woken) if order == "safety_first" else (woken, safety)
    states = [redeliver(reindex, first).state, redeliver(reindex, second).state]
    assert [text for _, text in ran] == ["v2"], (ran, states)
    assert not r.exists(lock_name(prefix, "doc:8")), r.hgetall(lock_name(prefix, "doc:8"))
    no_entry_left(r, prefix, "doc:8")
