"""Several entities through Celery's real tracer, meeting each kind of Redis error at each multi-entity script.

ACQUIRE_MULTI (before the body), RELEASE_MULTI (after it) and KEEP_BEFORE (a woken waiter blocked again)
each meet a refused connection, a timeout (the lock server frozen), a key of the wrong type and an empty
script cache. Each delivery must follow ``on_unavailable`` visibly, never drop the job silently, and leave no
entity held longer than its TTL. The lock Redis is a private server the test may stop or freeze; the broker
is the shared one, so the messages a delivery publishes are read back and delivered again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard import _connection as connection
from celery_lockguard import _handoff as handoff
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard._config import settings
from celery_lockguard._keys import lock_name, wait_name, waiters_name
from celery_lockguard.testing import RedisServer, free_port, wait_for

from .tracer import Message, deliver, make_app, published, redeliver

PAIR = ("acc:1", "acc:2")


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
    connection.forget_clients()


def app_on(redis_url: str, prefix: str, lock_url: str, policy: str = "fail_closed") -> Celery:
    return make_app("multierr", redis_url, prefix, lockguard_redis_url=lock_url, lockguard_on_unavailable=policy)


def transfer(app: Celery, ran: list[Any], body: Callable[[], Any] | None = None, **options: Any) -> Any:
    @app.task(
        base=LockedTask, bind=True, shared=False, name="m.transfer", lock_key=("acc:{src}", "acc:{dst}"), **options
    )
    def t(self: Any, src: int, dst: int) -> int:
        ran.append((src, dst))
        if body is not None:
            body()
        return src + dst

    return t


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def held(c: redis.Redis, prefix: str, keys: tuple[str, ...] = PAIR) -> list[str]:
    return [k for k in keys if c.exists(lock_name(prefix, k))]


def hold(c: redis.Redis, prefix: str, key: str, task_id: str = "other", ttl_ms: int = 10_000) -> L.Lease:
    got = L.acquire(
        c, prefix, key, ttl_ms=ttl_ms, task_id=task_id, task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    return got


# -- ACQUIRE_MULTI ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("kind", ["refused", "timeout"])
def test_an_outage_at_acquire_multi_follows_on_unavailable_and_leaves_nothing_held(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, kind: str, policy: str
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0" if kind == "refused" else lock_server.url
    app = app_on(redis_url, prefix, url, policy)
    ran: list[Any] = []
    t = transfer(app, ran)
    if kind == "timeout":  # a delivery first, so that the process's connection is up when the server freezes
        assert deliver(t, (3, 4)).state == "SUCCESS" and ran.pop() == (3, 4)
        lock_server.pause()
    try:
        with capture_logs() as logs:
            out = deliver(t, (1, 2))
    finally:
        if kind == "timeout":
            lock_server.resume()
    if policy == "fail_open":
        assert (out.state, ran) == ("SUCCESS", [(1, 2)]) and events(logs, "lock.fail_open")
    else:
        assert (out.state, ran) == ("RETRY", []), "fail_closed: waits, never runs unlocked"
        (wait_msg,) = published(r, app)
        assert wait_msg.headers[headers.WAITS] == 1
        assert events(logs, "lock.backend_unavailable")
    if kind == "timeout":
        c = lock_server.client()
        c.ping()  # the thawed server has run what it had read before it answers this
        # It may have run the ACQUIRE_MULTI it read while frozen: an orphan of a gone attempt, which lives at
        # most its TTL -- and which the wait's copy, carrying the attempt's token, adopts at once.
        ttl_ms = int(t.lockguard_options.ttl * 1000)
        for k in held(c, prefix):
            assert c.hget(lock_name(prefix, k), "task_id") == out.task_id and 0 < c.pttl(lock_name(prefix, k)) <= ttl_ms
        if policy == "fail_closed":
            (wait_msg,) = published(r, app)
            assert redeliver(t, wait_msg).state == "SUCCESS" and ran == [(1, 2)]
            assert held(c, prefix) == []


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("refusal", ["NOREPLICAS", "READ ONLY"])
def test_a_refused_write_at_acquire_multi_follows_on_unavailable_and_writes_nothing(
    redis_url: str, r: redis.Redis, prefix: str, refusal: str, policy: str
) -> None:
    """A server that refuses writes (too few replicas; a replica): ACQUIRE_MULTI fails at its first write,
    after reading every entity, so no entity is taken; the delivery follows ``on_unavailable``."""
    with RedisServer() as primary:
        extra = (
            ["--min-replicas-to-write", "1"]
            if refusal == "NOREPLICAS"
            else ["--replicaof", "127.0.0.1", str(primary.port)]
        )
        with RedisServer(extra=extra) as lock_server:
            app = app_on(redis_url, prefix, lock_server.url, policy)
            ran: list[Any] = []
            t = transfer(app, ran)
            with capture_logs() as logs:
                out = deliver(t, (1, 2))
            if policy == "fail_open":
                assert (out.state, ran) == ("SUCCESS", [(1, 2)]) and events(logs, "lock.fail_open")
            else:
                assert (out.state, ran) == ("RETRY", [])
                (wait_msg,) = published(r, app)
                assert wait_msg.headers[headers.WAITS] == 1
                reasons = [str(e.get("reason")) for e in events(logs, "lock.backend_unavailable")]
                assert any(refusal in reason.upper() for reason in reasons), reasons  # the reply, as redis-py words it
            assert held(lock_server.client(), prefix) == []
    connection.forget_clients()


def test_a_wrong_type_key_at_acquire_multi_fails_the_task_visibly_before_the_body_and_takes_nothing(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    ran: list[Any] = []
    t = transfer(app, ran)
    c = lock_server.client()
    c.set(lock_name(prefix, "acc:2"), "planted", px=60_000)  # a string where a lease hash belongs
    out = deliver(t, (1, 2))
    assert (out.state, ran) == ("FAILURE", [])
    assert "WRONGTYPE" in str(app.AsyncResult(out.task_id).result)
    assert not c.exists(lock_name(prefix, "acc:1")), "ACQUIRE_MULTI read every entity before writing any"


def test_acquire_multi_reloads_after_script_flush_through_the_tracer(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    ran: list[Any] = []
    t = transfer(app, ran)
    c = lock_server.client()
    c.script_flush()
    assert deliver(t, (1, 2)).state == "SUCCESS" and ran == [(1, 2)]
    assert c.script_exists(scripts.acquire_multi.sha, scripts.release_multi.sha) == [True, True]
    assert held(c, prefix) == []


# -- RELEASE_MULTI ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["refused", "timeout"])
def test_an_outage_at_release_multi_keeps_the_bodys_success_and_the_entities_lapse_by_their_ttl(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, kind: str
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    ran: list[Any] = []
    t = transfer(app, ran, lock_server.stop if kind == "refused" else lock_server.pause, lock_ttl=1.0)
    with capture_logs() as logs:
        out = deliver(t, (1, 2))
    if kind == "refused":
        lock_server.start()
    else:
        lock_server.resume()
    assert (out.state, out.retval, ran) == ("SUCCESS", 3, [(1, 2)]), "a failing release never fails the body"
    assert events(logs, "lock.backend_unavailable")
    c = lock_server.client()
    wait_for(lambda: held(c, prefix) == [], 3, what="both entities free within their TTL")


@pytest.mark.parametrize("planted", PAIR)
def test_a_wrong_type_key_at_release_multi_keeps_the_bodys_success_and_frees_the_other_entity_by_its_ttl(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, planted: str
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()

    def plant() -> None:  # one entity's lease replaced by a string: RELEASE_MULTI's HGET fails with WRONGTYPE
        c.delete(lock_name(prefix, planted))
        c.set(lock_name(prefix, planted), "x", px=500)

    ran: list[Any] = []
    t = transfer(app, ran, plant, lock_ttl=1.0)
    with capture_logs() as logs:
        out = deliver(t, (1, 2))
    assert (out.state, out.retval) == ("SUCCESS", 3)
    assert events(logs, "lock.backend_unavailable")
    other = PAIR[1 - PAIR.index(planted)]
    wait_for(lambda: not c.exists(lock_name(prefix, other)), 3, what="the other entity free within its TTL")


def test_a_wrong_type_key_at_release_multis_second_entity_leaves_no_waiter_reserved_without_its_wake(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    """A waiter parks on acc:1 behind a holder of (acc:1, acc:2) whose acc:2 is replaced by a string before its
    release. RELEASE_MULTI used to free acc:1 and reserve it for the waiter, then fail at acc:2: the reply lost,
    nobody published the waiter's woken copy, and acc:1 sat reserved for a wake that never came. Now it writes
    nothing: acc:1 lapses by the holder's TTL and the waiter's safety copy runs it; no entry is left 'waking'."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    started, go = threading.Event(), threading.Event()

    def body() -> None:
        started.set()
        assert go.wait(10)
        c.delete(lock_name(prefix, "acc:2"))
        c.set(lock_name(prefix, "acc:2"), "x", px=500)

    ran: list[Any] = []
    t = transfer(app, ran, body, lock_ttl=1.0)
    outcome: list[Any] = []
    logs: list[dict[str, Any]] = []

    def run_holder() -> None:
        with capture_logs() as got:
            outcome.append(deliver(t, (1, 2)))
        logs.extend(got)

    holder = threading.Thread(target=run_holder)
    holder.start()
    try:
        assert started.wait(10)
        waiter = deliver(t, (1, 3))
        assert waiter.state == "RETRY"
        (safety,) = copies(r, app, waiter.task_id)
        park = safety.headers[headers.PARK]
        assert safety.headers.get(headers.PARK_ENTITY, "acc:1") == "acc:1"
    finally:
        go.set()
        holder.join(15)
    assert outcome and (outcome[0].state, outcome[0].retval) == ("SUCCESS", 3)
    assert any("WRONGTYPE" in str(e.get("reason")) for e in events(logs, "lock.backend_unavailable"))
    entry = c.hget(waiters_name(prefix, "acc:1"), f"s:{park}")
    woken = [m for m in copies(r, app, waiter.task_id) if m.headers.get(headers.WOKEN)]
    assert entry == "parked" and woken == [], "nothing reserved for the waiter, so no wake to lose"
    assert c.hget(lock_name(prefix, "acc:1"), "state") == "running", "acc:1 left to the holder's TTL"
    wait_for(lambda: not c.exists(lock_name(prefix, "acc:1")), 3, what="acc:1 free within the holder's TTL")
    assert redeliver(t, safety).state == "SUCCESS" and ran == [(1, 2), (1, 3)]
    assert held(c, prefix, ("acc:1", "acc:3")) == []


def test_release_multi_reloads_after_script_flush_in_the_body(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran, c.script_flush)
    with capture_logs() as logs:
        assert deliver(t, (1, 2)).state == "SUCCESS"
    assert held(c, prefix) == [] and not events(logs, "lock.backend_unavailable"), "freed at once, not by TTL"


# -- KEEP_BEFORE: a woken waiter blocked again ---------------------------------------------------------


def woken_blocked(app: Celery, r: redis.Redis, c: redis.Redis, prefix: str, t: Any, ttl_ms: int = 10_000) -> Any:
    """A waiter parked on acc:1 and woken by its release while acc:2 is taken meanwhile: (woken copy, acc:2's lease).

    Delivered, the woken copy adopts its reservation on acc:1, meets acc:2 held, keeps acc:1 (sorted before
    the blocker) under a new park token (KEEP_BEFORE) and parks on acc:2.
    """
    first = hold(c, prefix, "acc:1")
    out = deliver(t, (1, 2))
    assert out.state == "RETRY"
    (safety,) = published(r, app)
    assert safety.headers[headers.PARK_ENTITY] == "acc:1"
    second = hold(c, prefix, "acc:2", task_id="other2", ttl_ms=ttl_ms)
    _, _, woken = L.release_and_wake(c, first, prefix, reserve_ms=5000)
    assert handoff.wake(app, settings(app), woken, "holder", "other", c)
    (copy,) = [m for m in published(r, app) if m.headers.get(headers.WOKEN)]
    assert c.hget(lock_name(prefix, "acc:1"), "token") == safety.headers[headers.PARK]  # reserved for the waiter
    return copy, second


def copies(r: redis.Redis, app: Celery, task_id: str) -> list[Message]:
    return [m for m in published(r, app) if m.task_id == task_id]


def test_a_woken_waiter_blocked_again_keeps_what_comes_before_the_blocker_and_parks(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    """The baseline the error cases below depart from."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, second = woken_blocked(app, r, c, prefix, t)
    assert redeliver(t, copy).state == "RETRY" and ran == []
    parked = copies(r, app, copy.task_id)[-1]
    assert parked.headers[headers.PARK_ENTITY] == "acc:2"
    kept = c.hgetall(lock_name(prefix, "acc:1"))
    assert (kept["token"], kept["state"]) == (parked.headers[headers.PARK], "handed")
    L.release_and_wake(c, second, prefix, reserve_ms=5000)
    assert redeliver(t, parked).state == "SUCCESS" and ran == [(1, 2)]  # the safety copy adopts both
    assert held(c, prefix) == []


@pytest.mark.parametrize("kind", ["refused", "timeout", "wrongtype", "noscript"])
def test_an_error_at_keep_before_never_drops_the_job_and_leaves_no_reservation_past_its_ttl(
    redis_url: str,
    r: redis.Redis,
    prefix: str,
    lock_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, second = woken_blocked(app, r, c, prefix, t, ttl_ms=1500)
    real = scripts.keep_before

    def breaking(client: Any, names: list[str], args: list[Any]) -> Any:
        if kind == "refused":
            lock_server.stop()
        elif kind == "timeout":
            lock_server.pause()
        elif kind == "wrongtype":  # another writer put a string where acc:1's reservation was
            c.delete(names[0])
            c.set(names[0], "planted", px=1000)
        else:
            c.script_flush()
        return real(client, names, args)

    monkeypatch.setattr(scripts, "keep_before", breaking)
    try:
        with capture_logs() as logs:
            out = redeliver(t, copy)
    finally:
        if kind == "refused":
            lock_server.start()
        elif kind == "timeout":
            lock_server.resume()
    monkeypatch.setattr(scripts, "keep_before", real)
    assert ran == []
    assert out.state == "RETRY", f"the job waits on, visibly: {out}"
    if kind != "noscript":
        assert any("reservations left to their TTL" in str(e.get("reason")) for e in logs)
    c = lock_server.client()
    if c.hget(lock_name(prefix, "acc:2"), "task_id") == "other2":
        L.release_and_wake(c, second, prefix, reserve_ms=5000)
    # What comes back (the parked safety copy, or the wait when parking failed too) runs the job.
    deadline = time.monotonic() + 15
    while not ran and time.monotonic() < deadline:
        redeliver(t, copies(r, app, copy.task_id)[-1])
    assert ran == [(1, 2)], "the job was not dropped"
    assert held(c, prefix) == []


# -- a park whose publish fails after KEEP_BEFORE ---------------------------------------------------------


def test_a_failed_park_publish_after_keep_before_gives_the_kept_reservations_back(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No copy of the park will come back to adopt acc:1: it is given back before the delivery backs off."""
    from kombu.exceptions import OperationalError

    from celery_lockguard import _republish

    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, _ = woken_blocked(app, r, c, prefix, t, ttl_ms=1000)
    seen: list[dict[str, str]] = []

    def broker_down(*args: Any, **kwargs: Any) -> None:
        seen.append(c.hgetall(lock_name(prefix, "acc:1")))  # acc:1 as each publish attempt finds it
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(_republish, "publish", broker_down)
    with capture_logs() as logs:
        out = redeliver(t, copy)
    assert (out.state, ran) == ("SUCCESS", [(1, 2)]), "waited in process once the park could not be published"
    assert len(seen) >= 2 and seen[0]["state"] == "handed", "the park's publish: acc:1 kept for the park"
    assert seen[1] == {}, "the wait's publish: the kept reservation was given back first"
    assert any(e.get("policy") == "park" and "publish failed" in str(e.get("reason")) for e in logs)
    assert c.llen(wait_name(prefix, "acc:2")) == 0 and not c.hgetall(waiters_name(prefix, "acc:2"))
    assert held(c, prefix) == []


def test_a_failed_park_publish_woken_meanwhile_leaves_the_kept_reservations_to_the_woken_copy(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acc:2's release woke the park before its publish failed: the woken copy is out, so the delivery drops
    itself (``Ignore``) and the woken copy adopts the kept acc:1 with the reserved acc:2 and runs the job."""
    from kombu.exceptions import OperationalError

    from celery_lockguard import _republish

    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, second = woken_blocked(app, r, c, prefix, t)

    def woken_then_down(*args: Any, **kwargs: Any) -> None:
        _, _, woken = L.release_and_wake(c, second, prefix, reserve_ms=5000)
        assert handoff.wake(app, settings(app), woken, "holder", "other2", c)
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(_republish, "publish", woken_then_down)
    with capture_logs() as logs:
        redeliver(t, copy)
    monkeypatch.undo()
    assert ran == [] and any(e["event"] == "lock.handoff_dropped" for e in logs)
    (late,) = [m for m in copies(r, app, copy.task_id) if m.headers.get(headers.PARK_ENTITY) == "acc:2"]
    assert late.headers.get(headers.WOKEN)
    tokens = {c.hget(lock_name(prefix, k), "token") for k in PAIR}
    assert tokens == {late.headers[headers.PARK]}, "both entities reserved for the copy that comes back"
    assert redeliver(t, late).state == "SUCCESS" and ran == [(1, 2)]
    assert held(c, prefix) == []


# -- forced release of one entity of a multi-entity holder -----------------------------------------------


@pytest.mark.parametrize("waiter_keys", [("acc:{a}",), ("acc:{a}", "acc:{b}")])
def test_forcing_one_entity_of_a_multi_entity_holder_wakes_its_waiter_and_the_body_loses_the_lease(
    redis_url: str, r: redis.Redis, prefix: str, waiter_keys: tuple[str, ...]
) -> None:
    """``lockguard release acc:1`` evicts a holder of (acc:1, acc:2): the waiter parked on acc:1 is woken at once
    (a reservation and its woken copy), the holder's next renewal reports the lease lost (``LockLost`` from
    ``ensure_held()``), and its exit frees acc:2, which stayed held until then, without touching the waiter's
    reservation on acc:1. The waiter then runs."""
    from celery_lockguard import LockLost

    from .test_cli_hostile import invoke

    app = make_app("multiforce", redis_url, prefix)
    started, lost = threading.Event(), threading.Event()

    @app.task(
        base=LockedTask, bind=True, shared=False, name="m.holder", lock_key=("acc:{src}", "acc:{dst}"), lock_ttl=3
    )
    def holder(self: Any, src: int, dst: int) -> None:
        started.set()
        wait_for(lambda: self.lock.lost, 10, what="the renewer to report the forced release")
        try:
            self.lock.ensure_held()
        except LockLost:
            lost.set()
            raise

    runs: list[Any] = []
    key = waiter_keys[0] if len(waiter_keys) == 1 else waiter_keys

    @app.task(base=LockedTask, bind=True, shared=False, name="m.waiter", lock_key=key)
    def waiter(self: Any, a: int, b: int = 0) -> None:
        runs.append(self.request.id)

    outcome: list[Any] = []
    body = threading.Thread(target=lambda: outcome.append(deliver(holder, (1, 2))))
    body.start()
    try:
        assert started.wait(10)
        out = deliver(waiter, (1, 2))
        assert out.state == "RETRY" and runs == []
        sent = copies(r, app, out.task_id)
        assert len(sent) == 1, f"one safety copy expected: {[m.headers for m in sent]}"
        safety = sent[0]
        assert safety.headers.get(headers.PARK_ENTITY, "acc:1") == "acc:1"
        done = invoke(app, "release", "acc:1", "--yes")
        assert done.exit_code == 0, done.output
        assert "its holder also holds acc:2: those stay held" in done.output and "woke the oldest waiter" in done.output
        woken = [m for m in copies(r, app, out.task_id) if m.headers.get(headers.WOKEN)]
        assert len(woken) == 1, "a forced release wakes the waiter parked on the entity"
        assert r.hget(lock_name(prefix, "acc:1"), "token") == safety.headers[headers.PARK]
        assert r.exists(lock_name(prefix, "acc:2")), "the sibling stays held while the body runs"
    finally:
        body.join(15)
    assert lost.is_set() and outcome and outcome[0].state == "FAILURE"
    assert isinstance(app.AsyncResult(outcome[0].task_id).result, LockLost)
    assert not r.exists(lock_name(prefix, "acc:2")), "the body's end freed the sibling"
    assert r.hget(lock_name(prefix, "acc:1"), "token") == safety.headers[headers.PARK], "the reservation stands"
    assert redeliver(waiter, woken[0]).state == "SUCCESS" and runs == [out.task_id]
    assert held(r, prefix) == []


def test_a_multi_entity_waiter_woken_by_a_forced_release_keeps_it_while_the_evicted_body_ends(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    """The woken copy of a waiter on (acc:1, acc:2) arrives while the evicted holder still runs on acc:2: it keeps
    acc:1 (sorted before its blocker) and parks on acc:2; the evicted body's end frees acc:2, wakes it, and it
    runs on both -- the evicted holder's release leaves the kept acc:1 alone."""
    from .test_cli_hostile import invoke

    app = make_app("multiforce2", redis_url, prefix)
    started, go = threading.Event(), threading.Event()

    @app.task(
        base=LockedTask, bind=True, shared=False, name="m.holder2", lock_key=("acc:{src}", "acc:{dst}"), lock_ttl=3
    )
    def holder(self: Any, src: int, dst: int) -> bool:
        started.set()
        assert go.wait(15)
        wait_for(lambda: self.lock.lost, 10, what="the renewer to report the forced release")
        return True

    runs: list[Any] = []
    t = transfer(app, runs)
    outcome: list[Any] = []
    body = threading.Thread(target=lambda: outcome.append(deliver(holder, (1, 2))))
    body.start()
    try:
        assert started.wait(10)
        out = deliver(t, (1, 2))
        assert out.state == "RETRY"
        assert invoke(app, "release", "acc:1", "--yes").exit_code == 0
        (woken,) = [m for m in copies(r, app, out.task_id) if m.headers.get(headers.WOKEN)]
        assert redeliver(t, woken).state == "RETRY" and runs == []
        parked = copies(r, app, out.task_id)[-1]
        assert parked.headers[headers.PARK_ENTITY] == "acc:2"
        assert r.hget(lock_name(prefix, "acc:1"), "token") == parked.headers[headers.PARK]
    finally:
        go.set()
        body.join(15)
    assert outcome and outcome[0].retval is True, "the evicted body saw its lease lost"
    assert r.hget(lock_name(prefix, "acc:1"), "token") == parked.headers[headers.PARK], "its release left acc:1 alone"
    assert r.hget(lock_name(prefix, "acc:2"), "token") == parked.headers[headers.PARK], "and handed acc:2 to the waiter"
    (again,) = [m for m in copies(r, app, out.task_id) if m.headers.get(headers.WOKEN)][1:]
    assert redeliver(t, again).state == "SUCCESS" and runs == [(1, 2)]
    assert held(r, prefix) == []


@contextmanager
def keep_before_frozen(lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """KEEP_BEFORE sent to a frozen server (the call times out) that has the script cached, so it runs on thaw."""
    lock_server.client().script_load(scripts.keep_before.source)
    real = scripts.keep_before

    def frozen(client: Any, names: list[str], args: list[Any]) -> Any:
        lock_server.pause()
        try:
            return real(client, names, args)
        finally:
            lock_server.resume()
            lock_server.client().ping()  # the thawed server has run the KEEP_BEFORE it read while frozen

    monkeypatch.setattr(scripts, "keep_before", frozen)
    try:
        yield
    finally:
        monkeypatch.setattr(scripts, "keep_before", real)


def test_a_keep_before_that_times_out_yet_runs_on_thaw_leaves_its_kept_reservation_to_the_park(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock server freezes as KEEP_BEFORE is sent and runs it on thaw, after the client gave up: acc:1 is
    re-tokened to the new park token for the blocker's whole countdown. The park must carry that token, so
    that its woken copy adopts acc:1 when acc:2 is released -- not meet it as an orphan held by nobody, park
    on it, and wait out the blocker's TTL (here a minute) with acc:1 blocked for everyone (review1)."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, second = woken_blocked(app, r, c, prefix, t, ttl_ms=60_000)
    with capture_logs() as logs, keep_before_frozen(lock_server, monkeypatch):
        out = redeliver(t, copy)
    assert (out.state, ran) == ("RETRY", [])
    assert any("reservations left to their TTL" in str(e.get("reason")) for e in logs), "the timeout was met"
    parked = copies(r, app, copy.task_id)[-1]
    assert parked.headers[headers.PARK_ENTITY] == "acc:2"
    kept = c.hgetall(lock_name(prefix, "acc:1"))
    assert kept.get("state") == "handed", "KEEP_BEFORE ran on thaw: acc:1 kept for the park"
    assert kept["token"] == parked.headers[headers.PARK], "the park carries the token acc:1 was kept under"
    _, _, woken = L.release_and_wake(c, second, prefix, reserve_ms=5000)
    assert handoff.wake(app, settings(app), woken, "holder", "other2", c)
    (late,) = [m for m in copies(r, app, copy.task_id) if m.headers.get(headers.WOKEN)][-1:]
    assert redeliver(t, late).state == "SUCCESS" and ran == [(1, 2)], "the woken copy adopts acc:1 and acc:2"
    assert held(c, prefix) == []


def test_a_keep_before_refused_by_a_wrong_type_key_writes_nothing_and_the_parks_copy_adopts_the_reservation(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KEEP_BEFORE meets a string planted over the blocker's lease (acc:2, after acc:1 in the script's order). It
    checks every key before its first write, so it writes nothing: a write before the error would stand (Redis
    does not roll a script back) with its reply lost. acc:1 stays reserved under the woken copy's token, which the
    park's copy does not carry: that copy adopts it as a reservation of its own call -- not take it for a running
    original to watch for the reservation's TTL."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, _ = woken_blocked(app, r, c, prefix, t, ttl_ms=60_000)
    real = scripts.keep_before

    def planted(client: Any, names: list[str], args: list[Any]) -> Any:
        c.delete(names[3])  # acc:2's lease hash, after acc:1's in the script's order
        c.set(names[3], "planted", px=60_000)
        return real(client, names, args)

    monkeypatch.setattr(scripts, "keep_before", planted)
    with capture_logs() as logs:
        out = redeliver(t, copy)
    monkeypatch.setattr(scripts, "keep_before", real)
    assert (out.state, ran) == ("RETRY", [])
    assert any("WRONGTYPE" in str(e.get("reason")) for e in logs), "KEEP_BEFORE met the planted key"
    parked = copies(r, app, copy.task_id)[-1]
    assert parked.headers[headers.PARK_ENTITY] == "acc:2"
    kept = c.hgetall(lock_name(prefix, "acc:1"))
    assert (kept.get("state"), kept.get("token")) == ("handed", copy.headers[headers.PARK]), "nothing re-tokened"
    c.delete(lock_name(prefix, "acc:2"))
    with capture_logs() as logs:
        assert redeliver(t, parked).state == "SUCCESS" and ran == [(1, 2)], "the safety copy adopts acc:1"
    assert any(e.get("reason") == "adopting_own_orphan" for e in logs)
    assert held(c, prefix) == []


def test_a_waiter_revoked_after_a_keep_before_that_ran_on_thaw_gives_back_what_it_kept(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the frozen KEEP_BEFORE runs on thaw; the parked waiter is then revoked. The worker discarding
    its copy gives back the reservations kept under the copy's park token: acc:1 must be one of them, not left
    kept for nobody for the blocker's countdown (review1)."""
    from types import SimpleNamespace

    from celery_lockguard._signals import free_reservation_from_main

    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran)
    copy, _ = woken_blocked(app, r, c, prefix, t, ttl_ms=60_000)
    with keep_before_frozen(lock_server, monkeypatch):
        assert redeliver(t, copy).state == "RETRY"
    parked = copies(r, app, copy.task_id)[-1]
    assert c.hget(lock_name(prefix, "acc:1"), "state") == "handed", "KEEP_BEFORE ran on thaw"
    discarded = SimpleNamespace(id=parked.task_id, headers=parked.custom(), request_dict={})
    free_reservation_from_main(t, discarded, (1, 2), {})
    assert not c.exists(lock_name(prefix, "acc:1")), "the revoked waiter's kept reservation is given back"


def eta_s(msg: Message) -> float:
    """When a message is due (unix seconds): its ``eta``, or at once."""
    from datetime import datetime

    eta = msg.headers.get("eta")
    return datetime.fromisoformat(eta).timestamp() if eta else 0.0


def run_due_copies(
    r: redis.Redis, app: Celery, t: Any, task_id: str, delivered: set[int], ran: list[Any], until: float
) -> list[float]:
    """Deliver this call's copies due before ``until`` (unix s) as a worker would, the earliest due first, new
    ones included; returns the eta of each copy whose delivery ran the body."""
    ran_at: list[float] = []
    for _ in range(50):
        pending = [(eta_s(m), i, m) for i, m in enumerate(published(r, app)) if m.task_id == task_id]
        pending = [p for p in pending if p[1] not in delivered and p[0] < until]
        if not pending:
            return ran_at
        due, i, msg = min(pending, key=lambda p: (p[0], p[1]))
        delivered.add(i)
        before = len(ran)
        redeliver(t, msg)
        if len(ran) > before:
            ran_at.append(due)
    raise AssertionError("the copies of one call kept publishing copies")


@pytest.mark.parametrize("completion", [True, False])
@pytest.mark.parametrize("blocker_ends", ["before_the_copy_comes", "after_the_copy_parks"])
def test_a_server_frozen_through_keep_before_and_park_leaves_no_reservation_the_job_waits_out(
    redis_url: str,
    r: redis.Redis,
    prefix: str,
    lock_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    blocker_ends: str,
    completion: bool,
) -> None:
    """The lock server freezes as KEEP_BEFORE is sent and thaws only after PARK timed out too: KEEP_BEFORE runs on
    thaw and keeps acc:1 for the new park token for the blocker's whole countdown (a minute here). PARK's reply
    was lost, so the delivery cannot tell whether it parked: its copy goes out as the park's safety copy (the park
    token in its headers), due when a wait would be, and nothing is given back. That copy adopts acc:1 and runs as
    soon as acc:2 is free -- before, the delivery gave back (which timed out too) and backed off with a copy that
    did not carry the token: it took acc:1 for a running original and watched it until it lapsed (a reviewer saw
    the job run 33 s late; without completion records no watch is published and the job was dropped). Once, and
    nothing is left held. Still blocked by acc:2 when it comes, it keeps acc:1 for its own park (KEEP_BEFORE under
    the park's token), whose woken copy adopts both when acc:2 is released."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran, completion=completion)
    copy, second = woken_blocked(app, r, c, prefix, t, ttl_ms=60_000)
    c.script_load(scripts.keep_before.source)  # cached: the frozen call runs on thaw, not refused as NOSCRIPT
    delivered = {i for i, m in enumerate(published(r, app)) if m.task_id == copy.task_id}
    real = scripts.keep_before
    sent: list[list[Any]] = []

    def frozen(client: Any, names: list[str], args: list[Any]) -> Any:
        sent.append(args)
        if len(sent) == 1:
            lock_server.pause()  # KEEP_BEFORE, then PARK: each times out
        return real(client, names, args)

    monkeypatch.setattr(scripts, "keep_before", frozen)
    try:
        with capture_logs() as logs:
            out = redeliver(t, copy)
    finally:
        lock_server.resume()  # thaw once the delivery has ended
        monkeypatch.setattr(scripts, "keep_before", real)
    assert (out.state, ran) == ("RETRY", []) and len(sent) == 1, "nothing given back: the park may hold it"
    reasons = [str(e.get("reason")) for e in logs]
    assert sum("Timeout" in x for x in reasons) == 2, reasons  # KEEP_BEFORE and PARK
    safety = copies(r, app, copy.task_id)[-1]
    assert safety.headers[headers.PARK] == sent[0][1] and not safety.headers.get(headers.WOKEN), "the park's copy"
    c = lock_server.client()
    c.ping()  # the thawed server has run what it had read before it answers this
    kept = c.hgetall(lock_name(prefix, "acc:1"))
    assert (kept.get("state"), kept.get("token")) == ("handed", sent[0][1]), "KEEP_BEFORE ran on thaw"
    assert c.pttl(lock_name(prefix, "acc:1")) > 50_000, "kept for the blocker's countdown"
    if blocker_ends == "after_the_copy_parks":
        run_due_copies(r, app, t, copy.task_id, delivered, ran, until=time.time() + 10)
        assert ran == []
        parked = copies(r, app, copy.task_id)[-1]
        assert parked.headers[headers.PARK_ENTITY] == "acc:2" and not parked.headers.get(headers.WOKEN)
        assert c.hget(lock_name(prefix, "acc:1"), "token") == parked.headers[headers.PARK], "kept for its park"
    released_at = time.time()
    _, _, woken = L.release_and_wake(c, second, prefix, reserve_ms=5000)
    if woken is not None:
        assert handoff.wake(app, settings(app), woken, "holder", "other2", c)
    assert run_due_copies(r, app, t, copy.task_id, delivered, ran, until=released_at + 10)
    assert ran == [(1, 2)], "promptly: from a copy due within seconds, not once acc:1 lapses (a minute)"
    run_due_copies(r, app, t, copy.task_id, delivered, ran, until=float("inf"))  # every copy left, safety included
    assert ran == [(1, 2)], "once"
    assert held(c, prefix) == []


@pytest.mark.parametrize("completion", [True, False])
def test_a_give_back_that_never_ran_after_a_full_queue_leaves_a_reservation_the_wait_adopts(
    redis_url: str,
    r: redis.Redis,
    prefix: str,
    lock_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    completion: bool,
) -> None:
    """A woken copy blocked again keeps acc:1 (KEEP_BEFORE), then PARK answers ``full``: it cannot park, so it
    gives acc:1 back and backs off. The give-back never reaches the server (an error before it was sent): acc:1
    stays kept under the park token for the blocker's countdown. The wait carries that token as its orphan token,
    so it adopts acc:1 and runs as soon as acc:2 is free -- before, it met acc:1 held under its own task id by a
    token it did not carry, watched it as a running original until it lapsed, or, without completion records,
    dropped the job. Once, and nothing is left held."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran, completion=completion)
    copy, second = woken_blocked(app, r, c, prefix, t, ttl_ms=60_000)
    delivered = {i for i, m in enumerate(published(r, app)) if m.task_id == copy.task_id}
    monkeypatch.setattr(handoff, "MAX_WAITERS", 0)  # PARK answers full
    real = scripts.keep_before
    sent: list[list[Any]] = []

    def give_back_never_sent(client: Any, names: list[str], args: list[Any]) -> Any:
        sent.append(args)
        if len(sent) == 2:  # the give-back: lost before it reached the server
            raise redis.exceptions.TimeoutError("Timeout connecting to server")
        return real(client, names, args)

    monkeypatch.setattr(scripts, "keep_before", give_back_never_sent)
    with capture_logs():
        out = redeliver(t, copy)
    monkeypatch.setattr(scripts, "keep_before", real)
    monkeypatch.setattr(handoff, "MAX_WAITERS", 1000)
    assert (out.state, ran, len(sent)) == ("RETRY", [], 2)
    kept = sent[0][1]
    assert c.hget(lock_name(prefix, "acc:1"), "token") == kept, "the give-back did not run: acc:1 is still kept"
    wait = copies(r, app, copy.task_id)[-1]
    assert kept in wait.headers[headers.ATTEMPT].split(",") and wait.headers.get(headers.PARK) != kept, "a wait"
    released_at = time.time()
    L.release_and_wake(c, second, prefix, reserve_ms=5000)
    assert run_due_copies(r, app, t, copy.task_id, delivered, ran, until=released_at + 15)
    assert ran == [(1, 2)], "promptly: from the wait's copy, not once acc:1 lapses (a minute)"
    run_due_copies(r, app, t, copy.task_id, delivered, ran, until=float("inf"))
    assert ran == [(1, 2)], "once"
    assert held(c, prefix) == []


def test_a_redelivered_original_never_adopts_a_reservation_handed_to_its_park(
    redis_url: str, r: redis.Redis, prefix: str, lock_server: RedisServer
) -> None:
    """Only a copy carrying a token adopts a reservation of its own id. The original message redelivered (a worker
    killed after the park, before the ack) meets acc:2 handed to its park, under a token it does not carry: it
    must not run it, for the park's woken copy does -- adopting by task id would run the job twice (no completion
    records here to answer the second)."""
    app = app_on(redis_url, prefix, lock_server.url)
    c = lock_server.client()
    ran: list[Any] = []
    t = transfer(app, ran, completion=False)
    blocker = hold(c, prefix, "acc:2", ttl_ms=60_000)
    out = deliver(t, (1, 2))
    assert (out.state, ran) == ("RETRY", [])
    _, _, woken = L.release_and_wake(c, blocker, prefix, reserve_ms=5000)
    assert woken is not None and handoff.wake(app, settings(app), woken, "holder", "other", c)
    assert c.hget(lock_name(prefix, "acc:2"), "state") == "handed"
    assert deliver(t, (1, 2), task_id=out.task_id).state != "SUCCESS" and ran == [], "the redelivery runs nothing"
    woken_copy = next(m for m in copies(r, app, out.task_id) if m.headers.get(headers.WOKEN))
    assert redeliver(t, woken_copy).state == "SUCCESS" and ran == [(1, 2)]
    for m in copies(r, app, out.task_id):
        if not m.headers.get(headers.WOKEN):
            redeliver(t, m)  # the park's safety copy, and any the redelivery left
    assert ran == [(1, 2)], "once"
    assert held(c, prefix) == []
