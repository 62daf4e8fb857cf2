"""Every path keeps the promise: the defects a line-by-line review reproduced, each through Celery's real tracer.

Each test drives a delivery through ``build_tracer(eager=False)`` against the
real Redis (and PostgreSQL where the store matters) and checks what the
delivery left behind: claims, leases, published messages, task state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, uuid
from structlog.testing import capture_logs

from celery_lockguard import AlreadyQueued, LockedTask
from celery_lockguard import _connection as connection
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard._keys import claim_name, digest, fence_name, lock_name
from celery_lockguard.testing import RedisServer, busy

from .tracer import deliver, make_app, published, redeliver


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("paths", redis_url, prefix)


def names(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


def hold(
    r: redis.Redis,
    prefix: str,
    key: str,
    *,
    task_id: str = "other",
    task_name: str = "x",
    dig: str = "d",
    ttl_ms: int = 10_000,
    host: str | None = None,
    token: str | None = None,
) -> L.Lease:
    got = L.acquire(
        r,
        prefix,
        key,
        ttl_ms=ttl_ms,
        task_id=task_id,
        task_name=task_name,
        digest=dig,
        worker="elsewhere",
        fence_ttl_ms=60_000,
        token=token,
    )
    assert isinstance(got, L.Lease)
    if host is not None:
        r.hset(lock_name(prefix, key), mapping={"host": host, "renewed_at": 0})
    return got


# -- 1. queue-time claims never outlive the work -------------------------------------------------


def test_until_started_raise_delivery_waits_behind_a_holder_with_its_claim(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """Accepted means it runs: ``raise`` answered at publish; delivered behind a holder, the copy waits."""

    @app.task(
        base=LockedTask, bind=True, name="p.us_raise", lock_key="k:{a}", lock_mode="until_started", on_locked="raise"
    )
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:1")  # different work runs on the entity
    sent = t.apply_async(args=(1,))
    assert r.exists(claim_name(prefix, "k:1"))
    (msg,) = published(r, app)
    r.delete(f"{prefix}:kombu:{app.conf.task_default_queue}")
    assert deliver(t, (1,), task_id=sent.id, headers=msg.custom()).state == "RETRY"
    (wait,) = published(r, app)
    assert wait.task_id == sent.id, "the accepted publish waits under its own id"
    assert r.hget(claim_name(prefix, "k:1"), "task_id") is not None, "its claim travels with the wait"
    with pytest.raises(AlreadyQueued):  # identical work is still queued: refused at publish
        t.apply_async(args=(1,))


def test_until_started_claim_is_freed_when_the_wait_budget_is_spent(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(
        base=LockedTask,
        bind=True,
        name="p.us_budget",
        lock_key="k:{a}",
        lock_mode="until_started",
        on_locked="retry",
        lock_max_waits=1,
    )
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:2")
    sent = t.apply_async(args=(2,))
    (msg,) = published(r, app)
    assert deliver(t, (2,), task_id=sent.id, headers=msg.custom()).state == "RETRY"
    assert r.exists(claim_name(prefix, "k:2")), "a wait hands the claim over to its message"
    wait_msg = published(r, app)[-1]
    assert wait_msg.task_id == sent.id and wait_msg.headers[headers.CLAIM] == msg.headers[headers.CLAIM]
    assert redeliver(t, wait_msg).state == "FAILURE"  # budget spent: LockContended
    assert not r.exists(claim_name(prefix, "k:2"))


def test_until_done_claim_is_freed_when_the_record_answers(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(
        base=LockedTask,
        bind=True,
        name="p.ud_record",
        lock_key="k:{a}",
        idempotency_key="pay:{a}",
        lock_mode="until_done",
    )
    def t(self: Any, a: int) -> int:
        return a * 10

    assert deliver(t, (3,)).retval == 30  # records pay:3
    sent = t.apply_async(args=(3,))
    assert r.hget(lock_name(prefix, "k:3"), "state") == "queued"
    (msg,) = published(r, app)
    with capture_logs() as logs:
        out = deliver(t, (3,), task_id=sent.id, headers=msg.custom())
    assert out.retval == 30 and "completion.skipped" in names(logs)
    assert not r.exists(lock_name(prefix, "k:3")), "answered from the record: the queued claim must be freed"


def test_a_failed_publish_frees_the_claim_it_took(redis_url: str, r: redis.Redis, prefix: str) -> None:
    app = make_app(
        "paths-nobroker",
        "redis://127.0.0.1:1/0",
        prefix,
        lockguard_redis_url=redis_url,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
    )

    @app.task(base=LockedTask, bind=True, name="p.pubfail", lock_key="k:{a}", lock_mode="until_started")
    def t(self: Any, a: int) -> int:
        return a

    with pytest.raises(Exception):  # noqa: B017 - kombu's OperationalError: the broker is unreachable
        t.apply_async(args=(4,))
    assert not r.exists(claim_name(prefix, "k:4")), "no message was sent: its claim must not swallow the next one"


# -- 2 and 3. self-republishes are never deduplicated ----------------------------------------------


def test_until_done_wait_never_stretches_a_dead_holders_lease(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.ud_dead", lock_key="k:{a}", lock_mode="until_done", lock_ttl=2)
    def t(self: Any, a: int) -> int:
        return a

    tid = uuid()
    hold(r, prefix, "k:5", task_id=tid, task_name=t.name, dig=digest({"a": 5}), ttl_ms=2000, host="gone-host")
    out = deliver(t, (5,), task_id=tid)
    assert out.state == "RETRY"
    assert 0 < r.pttl(lock_name(prefix, "k:5")) <= 2000, "the wait must not re-claim (and stretch) the dead lease"
    assert [m.task_id for m in published(r, app)] == [tid]


def test_a_wait_is_published_even_when_identical_work_holds_the_claim(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.us_wait", lock_key="k:{a}", lock_mode="until_started")
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:6")  # different work runs: even under skip this delivery waits
    L.claim(
        r,
        claim_name(prefix, "k:6"),
        token="b",
        ttl_ms=60_000,
        task_id="queued-b",
        task_name=t.name,
        digest=digest({"a": 6}),
    )  # identical work queued
    a = uuid()
    assert deliver(t, (6,), task_id=a).state == "RETRY"
    assert [m.task_id for m in published(r, app)] == [a], "the wait was swallowed by publish-time dedupe"


def test_retry_is_published_even_when_identical_work_holds_the_claim(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.us_retry", lock_key="k:{a}", lock_mode="until_started")
    def t(self: Any, a: int) -> int:
        if self.request.retries == 0:
            L.claim(
                r,
                claim_name(prefix, "k:7"),
                token="b",
                ttl_ms=60_000,
                task_id="queued-b",
                task_name=self.name,
                digest=digest({"a": 7}),
            )
            raise self.retry(countdown=5)
        return a

    a = uuid()
    assert deliver(t, (7,), task_id=a).state == "RETRY"
    assert [m.task_id for m in published(r, app)] == [a], "the retry was swallowed by publish-time dedupe"


def test_a_chains_last_link_is_never_skipped_at_publish(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.first", lock_key="f:{a}")
    def first(self: Any, a: int) -> int:
        return a

    @app.task(base=LockedTask, bind=True, name="p.last", lock_key="k:{a}", lock_mode="until_started")
    def last(self: Any, a: int) -> int:
        return a

    L.claim(
        r,
        claim_name(prefix, "k:8"),
        token="b",
        ttl_ms=60_000,
        task_id="queued-b",
        task_name=last.name,
        digest=digest({"a": 8}),
    )
    link = last.s()
    link.freeze()  # what Celery's chain puts in the first task's request: the rest of the chain, frozen
    deliver(first, (8,), chain=[dict(link)])
    assert [m.task_id for m in published(r, app)] == [link.id], "the chain's last link was skipped: it never resolves"


# -- 5. a timed-out ACQUIRE that ran anyway -------------------------------------------------------


def test_a_wait_after_a_failed_acquire_carries_its_token_and_recognises_its_orphan(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    app = make_app("paths-down", redis_url, prefix, lockguard_redis_url="redis://127.0.0.1:1/0")

    @app.task(base=LockedTask, bind=True, name="p.orphan", lock_key="k:{a}", completion=False)
    def t(self: Any, a: int) -> int:
        return a * 2

    tid = uuid()
    assert deliver(t, (9,), task_id=tid).state == "RETRY"  # the lock Redis is unreachable: fail_closed waits
    (wait_msg,) = published(r, app)
    token = wait_msg.headers[headers.ATTEMPT]
    assert token
    # Suppose that ACQUIRE did reach the server: the orphan lease carries our id, this host, a live pid.
    hold(r, prefix, "k:9", task_id=tid, task_name=t.name, dig=digest({"a": 9}), token=token)
    app.conf.lockguard_redis_url = redis_url
    from celery_lockguard._config import reset

    reset(app)
    out = redeliver(t, wait_msg)
    assert (out.state, out.retval) == ("SUCCESS", 18), "the returning wait dropped itself behind its own orphan"
    assert not r.exists(lock_name(prefix, "k:9"))


# -- 6. an unreachable PostgreSQL completion store --------------------------------------------------


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_unreachable_postgres_store_follows_the_outage_policy_and_frees_the_lease(
    redis_url: str, r: redis.Redis, prefix: str, policy: str
) -> None:
    app = make_app(
        "paths-pg",
        redis_url,
        prefix,
        lockguard_completion_backend="postgresql://postgres@127.0.0.1:1/x",
        lockguard_on_unavailable=policy,
    )
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, name="p.pgdown", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        ran.append(a)
        assert self.lock is not None and self.lock.held
        return a

    with capture_logs() as logs:
        out = deliver(t, (10,))
    assert not r.exists(lock_name(prefix, "k:10")), "the lease must not be left for its TTL"
    if policy == "fail_closed":
        assert out.state == "RETRY" and ran == []
        assert len(published(r, app)) == 1
    else:
        assert out.state == "SUCCESS" and ran == [10]
        assert "lock.fail_open" in names(logs) and "completion.record_failed" in names(logs)


def test_a_watch_copy_meeting_an_unreachable_store_does_not_record_failure(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    app = make_app("paths-pgw", redis_url, prefix, lockguard_completion_backend="postgresql://postgres@127.0.0.1:1/x")

    @app.task(base=LockedTask, bind=True, name="p.pgwatch", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    out = deliver(t, (11,), headers={headers.WATCH: 1, headers.WATCH_TOKEN: "w"})
    assert out.state == "PENDING", "a watch copy stores no state over its original's (no FAILURE, no RETRY)"
    (msg,) = published(r, app)
    assert msg.headers[headers.WATCH] == 1, "a wait of a watch copy stays a watch copy"


# -- 7. a direct call inside the task's own body ---------------------------------------------------


@pytest.fixture(params=["tracer", "worker"])
def worker_optimized(request: pytest.FixtureRequest, app: Celery) -> Iterator[str]:
    """The tracer alone, or with what every ``celery worker`` installs first (Celery's stack protection).

    Under the protection the first ``Task.__call__`` on a request runs ``run`` without pushing one; a
    direct call inside the body must still get a request of its own.
    """
    if request.param == "tracer":
        yield "tracer"
        return
    from celery import _state
    from celery.app.trace import reset_worker_optimizations, setup_worker_optimizations

    default, current = _state.default_app, _state.get_current_app()
    setup_worker_optimizations(app, "tracer@lockguard-test")
    try:
        yield "worker"
    finally:
        reset_worker_optimizations(app)
        _state.set_default_app(default)
        _state._set_current_app(current)


def test_a_direct_call_inside_the_body_runs_unlocked_and_leaves_the_outer_run_alone(
    app: Celery, r: redis.Redis, prefix: str, worker_optimized: str
) -> None:
    seen: list[tuple[int, Any, Any, Any]] = []
    steps: list[Any] = []

    @app.task(base=LockedTask, bind=True, name="p.walk", lock_key="node:{n}", shared=False)
    def walk(self: Any, n: int) -> int:
        lease_before = self.lock
        inner = walk(n - 1) if n > 0 else 0
        seen.append((n, self.lock, self.request.id, self.completion_scope))
        assert self.lock is lease_before, "the inner call clobbered the outer request"
        if self.lock is not None:  # the outer run: its checkpoint names are its own, the inner calls used none
            steps.append(self.checkpoint("step", lambda: f"step-{n}"))
        return n + inner

    tid = uuid()
    out = deliver(walk, (2,), task_id=tid)
    assert (out.state, out.retval) == ("SUCCESS", 3)
    inner = [x for x in seen if x[0] < 2]
    outer = [x for x in seen if x[0] == 2]
    assert all(lease is None and scope is None for _, lease, _, scope in inner), "a direct call must run unlocked"
    assert outer[0][1] is not None and outer[0][1].key == "node:2" and outer[0][3] == f"task:{tid}"
    assert steps == ["step-2"]
    # The outer task id's completion record holds the outer result.
    assert deliver(walk, (2,), task_id=tid).retval == 3
    assert not r.keys(f"{prefix}:v1:{{node:1}}*"), "the inner call took a lock"


def test_a_wrapper_patched_onto_task_call_still_runs_around_a_locked_body(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Task

    around: list[str] = []
    original = Task.__call__

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        around.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Task, "__call__", wrapped)

    @app.task(base=LockedTask, bind=True, name="p.wrapped", lock_key="w:{a}", shared=False)
    def t(self: Any, a: int) -> Any:
        return self.lock is not None

    out = deliver(t, (1,))
    assert (out.state, out.retval) == ("SUCCESS", True) and around == ["p.wrapped"]


def test_release_errors_never_fail_a_successful_body(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.relerr", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        # Make the lease key a string: RELEASE's HGET then fails with WRONGTYPE, a reply no policy expects.
        r.delete(lock_name(prefix, "k:12"))
        r.set(lock_name(prefix, "k:12"), "x", px=5000)
        return a

    with capture_logs() as logs:
        out = deliver(t, (12,))
    assert (out.state, out.retval) == ("SUCCESS", 12)
    assert "lock.backend_unavailable" in names(logs)


# -- 4. server errors by meaning, at each stage of a delivery --------------------------------------


def test_noperm_at_acquire_fails_before_the_body_with_a_configuration_error(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    user = f"{prefix}-noevalsha"
    r.execute_command("ACL", "SETUSER", user, "on", ">pw", f"~{prefix}:*", "+@all", "-evalsha")
    try:
        app = make_app(
            "paths-noperm",
            redis_url,
            prefix,
            lockguard_redis_kwargs={"username": user, "password": "pw"},
            lockguard_on_unavailable="fail_open",
        )
        ran: list[int] = []

        @app.task(base=LockedTask, bind=True, name="p.noperm", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            ran.append(a)
            return a

        out = deliver(t, (14,))
        assert out.state == "FAILURE" and ran == [], "misconfiguration is not an outage: fail_open must not run it"
        error = app.AsyncResult(out.task_id).result
        assert type(error).__name__ == "ConfigurationError" and "p.noperm" in str(error) and "ACQUIRE" in str(error)
        assert published(r, app) == []
    finally:
        r.acl_deluser(user)


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_noreplicas_at_acquire_follows_the_outage_policy(
    redis_url: str, r: redis.Redis, prefix: str, policy: str
) -> None:
    with RedisServer(extra=["--min-replicas-to-write", "1"]) as lock_server:
        app = make_app(
            "paths-norepl", redis_url, prefix, lockguard_redis_url=lock_server.url, lockguard_on_unavailable=policy
        )
        ran: list[int] = []

        @app.task(base=LockedTask, bind=True, name="p.norepl", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            ran.append(a)
            return a

        with capture_logs() as logs:
            out = deliver(t, (15,))
        if policy == "fail_closed":
            assert out.state == "RETRY" and ran == []
            (wait_msg,) = published(r, app)
            assert wait_msg.headers[headers.WAITS] == 1
            assert any("NOREPLICAS" in str(e.get("reason")) for e in logs if e["event"] == "lock.backend_unavailable")
        else:
            assert out.state == "SUCCESS" and ran == [15] and "lock.fail_open" in names(logs)
    connection.forget_clients()


def test_busy_at_acquire_waits_and_the_next_delivery_runs(redis_url: str, r: redis.Redis, prefix: str) -> None:
    with RedisServer(extra=["--busy-reply-threshold", "50"]) as lock_server:
        app = make_app("paths-busy", redis_url, prefix, lockguard_redis_url=lock_server.url)

        @app.task(base=LockedTask, bind=True, name="p.busy", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            return a

        with busy(lock_server):
            assert deliver(t, (16,)).state == "RETRY"
        (wait_msg,) = published(r, app)
        assert redeliver(t, wait_msg).retval == 16
    connection.forget_clients()


def test_a_corrupt_fence_fails_the_task_before_the_body_and_leaves_no_lease(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, name="p.fence", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        ran.append(a)
        return a

    r.set(fence_name(prefix, "k:17"), "1e400")
    out = deliver(t, (17,))
    assert out.state == "FAILURE" and ran == []
    assert not r.exists(lock_name(prefix, "k:17"))


def test_until_done_retry_whose_publish_fails_frees_the_handed_over_claim(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    app = make_app(
        "paths-retryfail",
        "redis://127.0.0.1:1/0",
        prefix,
        lockguard_redis_url=redis_url,
        result_backend=redis_url,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
    )

    @app.task(base=LockedTask, bind=True, name="p.ud_retry", lock_key="k:{a}", lock_mode="until_done")
    def t(self: Any, a: int) -> int:
        raise self.retry(countdown=1)

    assert deliver(t, (18,)).state != "RETRY", "Celery rejects a retry it could not publish"
    assert not r.exists(lock_name(prefix, "k:18")), "no retry message exists: its claim must not block the entity"


# -- answered from a record, skipped as a duplicate: the caller can tell -----------------------------


@pytest.mark.parametrize("store", ["redis", "postgres"])
@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_an_idempotency_key_reused_with_other_arguments_is_not_a_duplicate(
    redis_url: str, r: redis.Redis, prefix: str, postgres_url: str, store: str, policy: str
) -> None:
    backend = postgres_url if store == "postgres" else "redis"
    app = make_app("paths-idem", redis_url, prefix, lockguard_completion_backend=backend)
    ran: list[tuple[int, int]] = []

    @app.task(base=LockedTask, bind=True, name="p.charge", idempotency_key="pay:{key}", idempotency_mismatch=policy)
    def charge(self: Any, customer: int, amount: int, key: str) -> int:
        ran.append((customer, amount))
        return amount

    assert deliver(charge, (1, 1000, "pay-A")).retval == 1000
    assert deliver(charge, (1, 1000, "pay-A")).retval == 1000  # the same work: answered from the record
    with capture_logs() as logs:
        other = deliver(charge, (1, 999, "pay-A"))  # the same key for other work: the caller's mistake
    assert ran == [(1, 1000)]
    assert "completion.key_reused" in names(logs)
    if policy == "raise":
        assert other.state == "FAILURE"
        error = app.AsyncResult(other.task_id).result
        assert type(error).__name__ == "IdempotencyKeyReused" and "pay-A" in str(error)
    else:
        assert (other.state, other.retval) == ("SUCCESS", 1000)


def test_a_skipped_duplicate_names_the_task_that_did_the_work(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.dup", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:19", task_id="the-holder", task_name=t.name, dig=digest({"a": 19}))
    out = deliver(t, (19,))
    result = app.AsyncResult(out.task_id)
    assert (result.state, result.result) == ("SUCCESS", None)
    assert [child.id for child in result.children] == ["the-holder"], "the caller cannot tell a skip from a result"


# -- found by the multi-mode chaos soak --------------------------------------------------------------


def test_a_duplicated_wait_copy_never_runs_beside_the_one_that_adopted_the_orphan(
    redis_url: str, r: redis.Redis, prefix: str
) -> None:
    """chaos.repro wait-twice: the transport hands the same wait message to two workers."""
    app = make_app("paths-twice", redis_url, prefix, lockguard_redis_url="redis://127.0.0.1:1/0")
    ran: list[str] = []
    nested: list[Any] = []

    @app.task(base=LockedTask, bind=True, name="p.twice", lock_key="k:{a}", completion=False)
    def t(self: Any, a: int) -> int:
        ran.append(self.request.id)
        if len(ran) == 1:  # while the first copy runs, the duplicate copy of the same wait message arrives
            nested.append(redeliver(t, wait_msg))
        return a

    tid = uuid()
    assert deliver(t, (20,), task_id=tid).state == "RETRY"
    (wait_msg,) = published(r, app)
    hold(
        r, prefix, "k:20", task_id=tid, task_name=t.name, dig=digest({"a": 20}), token=wait_msg.headers[headers.ATTEMPT]
    )
    app.conf.lockguard_redis_url = redis_url
    from celery_lockguard._config import reset

    reset(app)
    assert redeliver(t, wait_msg).state == "SUCCESS"
    assert ran == [tid], "the duplicated wait copy ran the body beside the first"
    assert len(nested) == 1, "the duplicate copy was delivered"


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_checkpoint_that_cannot_be_read_follows_the_outage_policy(
    redis_url: str, r: redis.Redis, prefix: str, policy: str
) -> None:
    with RedisServer(extra=["--busy-reply-threshold", "50"]) as lock_server:
        app = make_app(
            "paths-cpread", redis_url, prefix, lockguard_redis_url=lock_server.url, lockguard_on_unavailable=policy
        )
        steps: list[int] = []

        @app.task(base=LockedTask, bind=True, name="p.cpread", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            with busy(lock_server):  # the store answers BUSY from the checkpoint on
                return int(self.checkpoint("charge", lambda: steps.append(a) or a))

        out = deliver(t, (21,))
        if policy == "fail_closed":
            assert out.state == "RETRY" and steps == [], "the step must not run when its record cannot be read"
            (wait_msg,) = published(r, app)
            assert wait_msg.headers[headers.WAITS] == 1
        else:
            assert (out.state, steps) == ("SUCCESS", [21])
    connection.forget_clients()


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_checkpoint_that_ran_but_cannot_be_recorded_is_never_run_again_blindly(
    redis_url: str, r: redis.Redis, prefix: str, policy: str
) -> None:
    with RedisServer() as lock_server:
        app = make_app(
            "paths-cpwrite", redis_url, prefix, lockguard_redis_url=lock_server.url, lockguard_on_unavailable=policy
        )
        admin = lock_server.client()
        steps: list[int] = []

        def step(a: int) -> int:
            steps.append(a)
            admin.config_set("min-replicas-to-write", 1)  # writes refused (NOREPLICAS) from now on
            return a

        @app.task(base=LockedTask, bind=True, name="p.cpwrite", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            return int(self.checkpoint("charge", step, a))

        out = deliver(t, (22,))
        admin.config_set("min-replicas-to-write", 0)
        assert steps == [22]
        if policy == "fail_closed":
            assert out.state == "FAILURE" and published(r, app) == []
            error = app.AsyncResult(out.task_id).result
            assert type(error).__name__ == "BackendUnavailable" and "could not be recorded" in str(error)
        else:
            assert out.state == "SUCCESS"
    connection.forget_clients()


# -- found by the fresh review -------------------------------------------------------------------


def test_a_retry_carries_none_of_the_deliverys_lockguard_headers(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, name="p.hdr", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        raise self.retry(countdown=300)

    ours = {headers.WATCH: 1, headers.WATCH_TOKEN: "w", headers.WAITS: 2, headers.ATTEMPT: "x"}
    assert deliver(t, (23,), headers=ours).state == "RETRY"
    (retry_msg,) = published(r, app)
    assert retry_msg.custom() == {}, "a retry inherited a watch marker, a wait count or an orphan token"


def test_a_watch_copy_never_reruns_an_original_that_failed(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs: list[Any] = []

    @app.task(base=LockedTask, bind=True, name="p.watch_failed", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        runs.append(headers.read(self.request, headers.WATCH))
        raise RuntimeError("the provider said no")

    tid = uuid()
    assert deliver(t, (24,), task_id=tid).state == "FAILURE"
    watch = deliver(t, (24,), task_id=tid, headers={headers.WATCH: 1, headers.WATCH_TOKEN: "w"})
    assert runs == [None], "the watch copy ran the job again"
    assert app.AsyncResult(tid).state == "FAILURE" == watch.state, "the watch copy overwrote the original's state"


def test_a_watch_copy_behind_a_retry_runs_the_job_and_the_retry_is_answered(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """RETRY is no end: the retry message may be the copy dropped behind a running duplicate (chaos:
    retried-then-killed). The watch copy runs the job, at worst early; the retry is answered from its record."""
    runs: list[int] = []

    @app.task(base=LockedTask, bind=True, name="p.watch_retry", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        runs.append(self.request.retries)
        if len(runs) == 1:
            raise self.retry(countdown=300)
        return a

    tid = uuid()
    assert deliver(t, (28,), task_id=tid).state == "RETRY"
    (retry_msg,) = published(r, app)
    assert deliver(t, (28,), task_id=tid, headers={headers.WATCH: 1, headers.WATCH_TOKEN: "w"}).state == "SUCCESS"
    assert runs == [0, 0]
    with capture_logs() as logs:
        assert deliver(t, (28,), task_id=tid, retries=1, headers=retry_msg.custom()).retval == 28
    assert runs == [0, 0] and "completion.skipped" in names(logs)


def test_a_task_scheduling_its_own_follow_up_is_never_deduplicated(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs: list[str] = []
    follow_ups: list[Any] = []

    @app.task(base=LockedTask, bind=True, name="p.poll", lock_key="k:{a}", lock_mode="until_done")
    def poll(self: Any, a: int) -> int:
        runs.append(self.request.id)
        if len(runs) == 1:
            follow_ups.append(self.apply_async(args=(a,), countdown=1))
            (msg,) = published(r, app)
            assert msg.task_id == follow_ups[0].id != self.request.id, "the follow-up was swallowed"
            r.delete(app.conf.broker_transport_options["global_keyprefix"] + app.conf.task_default_queue)
            follow_ups.append(redeliver(poll, msg))  # delivered while this run still holds the entity
        return a

    first = deliver(poll, (25,))
    assert first.state == "SUCCESS" and runs == [first.task_id]
    assert follow_ups[1].state == "RETRY", "the follow-up was skipped as a duplicate of its parent"
    (wait_msg,) = published(r, app)
    assert redeliver(poll, wait_msg).state == "SUCCESS"
    assert runs == [first.task_id, follow_ups[0].id]


@pytest.mark.parametrize("mode", ["until_done", "until_started"])
def test_a_wait_after_the_lease_consumed_the_claim_hands_a_claim_on(
    redis_url: str, r: redis.Redis, prefix: str, mode: str
) -> None:
    app = make_app(
        "paths-handback", redis_url, prefix, lockguard_completion_backend="postgresql://postgres@127.0.0.1:1/x"
    )

    @app.task(base=LockedTask, bind=True, name=f"p.handback_{mode}", lock_key="k:{a}", lock_mode=mode)
    def t(self: Any, a: int) -> int:
        return a

    sent = t.apply_async(args=(26,))
    (msg,) = published(r, app)
    assert redeliver(t, msg).state == "RETRY"  # the completion store is down: fail_closed waits
    wait_msg = published(r, app)[-1]
    assert wait_msg.task_id == sent.id and wait_msg.headers[headers.CLAIM] != msg.headers[headers.CLAIM]
    again = t.apply_async(args=(26,))
    assert again.id == sent.id, "an identical publish queued a second copy while the first waits"


def test_until_done_keeps_one_identical_copy_queued_behind_different_work(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, name="p.ud_behind", lock_key="inv:{a}", lock_mode="until_done")
    def charge(self: Any, a: int, amount: int) -> int:
        runs.append(self.request.id)
        return amount

    refund = hold(r, prefix, "inv:42", task_id="the-refund", task_name="refund")  # different work runs
    first = charge.apply_async(args=(42, 100))
    assert [charge.apply_async(args=(42, 100)).id for _ in range(2)] == [first.id, first.id]
    (msg,) = published(r, app)
    assert redeliver(charge, msg).state == "RETRY"  # waits behind the refund, its claim handed on
    assert charge.apply_async(args=(42, 100)).id == first.id
    L.release(r, refund, prefix)
    wait_msg = published(r, app)[-1]
    assert redeliver(charge, wait_msg).state == "SUCCESS"
    assert runs == [first.id]
    assert not r.exists(claim_name(prefix, "inv:42")) and not r.exists(lock_name(prefix, "inv:42"))


@pytest.mark.parametrize("publisher_fails", [True, False])
def test_an_identical_publish_waits_for_a_claim_still_publishing(
    app: Celery, r: redis.Redis, prefix: str, publisher_fails: bool
) -> None:
    """A took the claim and is still publishing: B must not be answered with a message that may never exist."""

    @app.task(base=LockedTask, bind=True, name="p.race", lock_key="inv:{a}", lock_mode="until_done")
    def charge(self: Any, a: int) -> int:
        return a

    keys = [lock_name(prefix, "inv:27"), claim_name(prefix, "inv:27")]
    L.claim(
        r,
        keys,
        token="a-token",
        ttl_ms=60_000,
        task_id="task-a",
        task_name=charge.name,
        digest=digest({"a": 27}),
        publish_ttl_ms=15_000,
    )
    answer: list[Any] = []
    b = threading.Thread(target=lambda: answer.append(charge.apply_async(args=(27,))), daemon=True)
    b.start()
    b.join(0.3)
    assert b.is_alive(), "B was answered while A's message was still being published"
    if publisher_fails:
        assert L.release_claim(r, keys, "task-a", token="a-token")  # A's publish failed: it frees its claim
    else:
        assert L.confirm_claim(r, keys, "a-token", 60_000)  # A's message is out
    b.join(10)
    (result,) = answer
    if publisher_fails:
        assert result.id != "task-a" and [m.task_id for m in published(r, app)] == [result.id]
    else:
        assert result.id == "task-a" and published(r, app) == []


def test_a_watch_copy_that_waits_never_overwrites_its_originals_state(app: Celery, r: redis.Redis, prefix: str) -> None:
    """chaos-quick (PostgreSQL leg): the watch copy's wait stored RETRY over the original's SUCCESS, then found
    the record and dropped itself: the job showed RETRY forever."""

    @app.task(base=LockedTask, bind=True, name="p.watch_wait", lock_key="k:{a}", lock_mode="until_started")
    def t(self: Any, a: int) -> int:
        return a

    tid = uuid()
    assert deliver(t, (29,), task_id=tid).state == "SUCCESS"
    r.delete(*r.keys(f"{prefix}:v1:{{task:{tid}}}:done"))  # the record out of sight (a store outage)
    hold(r, prefix, "k:29", task_id="identical-twin", task_name=t.name, dig=digest({"a": 29}))
    watch = deliver(t, (29,), task_id=tid, headers={headers.WATCH: 1, headers.WATCH_TOKEN: "w"})
    assert app.AsyncResult(tid).state == "SUCCESS", "the watch copy's wait overwrote the original's state"
    (wait_msg,) = published(r, app)
    assert wait_msg.headers[headers.WATCH] == 1 and watch.state == "SUCCESS"


def test_a_wait_that_cannot_be_published_is_reported_not_crashed(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """chaos-quick: a watch's publish met NOREPLICAS, and reporting it raised KeyError('reason') (its fields
    carried a reason already): the copy failed instead of being dropped. A wait's failed publish had the same
    bug: the task failed instead of waiting in-process. This drives the wait (the holder lapses in 0.3 s)."""
    from kombu.exceptions import OperationalError

    from celery_lockguard import _republish

    @app.task(base=LockedTask, bind=True, name="p.watch_unpublished", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    tid = uuid()
    hold(r, prefix, "k:31", task_id=tid, task_name=t.name, dig=digest({"a": 31}), host="other-host", ttl_ms=300)

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker unreachable")  # the publish the watch needs: a broker-side fault

    monkeypatch.setattr(_republish, "publish", broker_down)
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        out = deliver(t, (31,), task_id=tid)
    assert out.state == "SUCCESS", out  # waited in-process, then ran once the holder lapsed
    reported = [
        rec.lockguard for rec in caplog.records if getattr(rec, "lockguard", {}).get("policy") == "wait_in_process"
    ]
    assert reported and reported[0]["reason"] == "publish failed: OperationalError"


def test_a_lease_that_lapsed_while_the_postgresql_record_was_read_is_not_run_on(
    redis_url: str, r: redis.Redis, prefix: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chaos-quick (PostgreSQL leg): the record is read under the fresh lease, before it is tracked for renewal;
    a store answering after the TTL (a hung proxy, a connect timeout) let the lease lapse, a redelivery took it,
    and both bodies ran (the fence rejected the stale write). A late answer now counts as a late ACQUIRE: wait."""
    from celery_lockguard import _completion

    app = make_app("paths-pglate", redis_url, prefix, lockguard_completion_backend=postgres_url)
    runs: list[int] = []

    @app.task(base=LockedTask, bind=True, name="p.pglate", lock_key="k:{a}", lock_ttl=0.2)
    def t(self: Any, a: int) -> int:
        runs.append(a)
        return a

    real_lookup = _completion.PostgresStore.lookup

    def slow_lookup(self: Any, scope: str) -> Any:
        time.sleep(0.35)  # the store's answer arrives after the 0.2 s lease (the fault, not a synchronisation)
        return real_lookup(self, scope)

    monkeypatch.setattr(_completion.PostgresStore, "lookup", slow_lookup)
    out = deliver(t, (32,))
    assert runs == [], "the body ran on a lease that lapsed while the record was read"
    assert out.state == "RETRY", out
    assert not r.exists(lock_name(prefix, "k:32")), "the lapsed lease was left behind"


@pytest.mark.parametrize("store", ["redis", "postgres"])
def test_a_watch_copy_answers_for_an_original_that_died_after_other_work_did_the_job(
    redis_url: str, r: redis.Redis, prefix: str, postgres_url: str, store: str
) -> None:
    """chaos-quick (PostgreSQL leg, until_started/skip): the original's worker was paused, then its child killed
    before it stored a state; a duplicate enqueue of the same job (another task id) did the work. The watch copy
    found the record and dropped itself, so the original's task id stayed PENDING for good. It answers now."""
    backend = postgres_url if store == "postgres" else "redis"
    app = make_app(f"paths-wanswer-{store}", redis_url, prefix, lockguard_completion_backend=backend)
    runs: list[str] = []

    @app.task(base=LockedTask, bind=True, name=f"p.wanswer_{store}", lock_key="k:{a}", idempotency_key="job:{a}")
    def t(self: Any, a: int) -> int:
        runs.append(self.request.id)
        return a

    assert deliver(t, (33,), task_id="the-duplicate").state == "SUCCESS"  # other work did the job
    original = uuid()  # its worker died mid-body: it never stored a state
    watch = deliver(t, (33,), task_id=original, headers={headers.WATCH: 1, headers.WATCH_TOKEN: "w"})
    assert runs == ["the-duplicate"], "the watch copy ran the job again"
    assert watch.state == "SUCCESS" and app.AsyncResult(original).get(timeout=5) == 33


def test_a_redelivered_copy_whose_watch_cannot_be_published_goes_back_to_the_broker(
    app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """chaos-quick: arming the watch met NOREPLICAS and the copy was dropped anyway; when the original's child
    was then killed, nothing was left to run the job. The copy is now rejected with requeue (it is an acks_late
    redelivery): it comes back and decides again. No state is stored under the original's task id."""
    from celery.exceptions import Reject
    from kombu.exceptions import OperationalError

    from celery_lockguard import _republish

    @app.task(base=LockedTask, bind=True, name="p.watch_requeue", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    tid = uuid()
    hold(r, prefix, "k:34", task_id=tid, task_name=t.name, dig=digest({"a": 34}))  # this process: alive

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(_republish, "publish", broker_down)
    with caplog.at_level(logging.WARNING, logger="celery_lockguard"):
        out = deliver(t, (34,), task_id=tid)
    assert out.retval.type is Reject and "watch not published" in str(out.retval.exception), out
    assert out.state == "PENDING", "a copy of a running original stores no state"
    reported = [rec.lockguard for rec in caplog.records if getattr(rec, "lockguard", {}).get("policy") == "watch"]
    assert reported and reported[0]["reason"] == "publish failed: broker unreachable"
