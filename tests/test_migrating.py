"""docs/migrating.md, row by row: each mapping from celery-once, celery-singleton and celery-heimdall holds.

Every test names the row(s) it holds. Deliveries go through Celery's real (non-eager) tracer on the real
Redis (``tests/tracer.py``); what needs two processes at once is held by real prefork workers elsewhere,
named where it applies:

* once ``unlock_before_run`` with ``graceful=False`` (a copy accepted during a run runs after it):
  ``test_queue_modes.py::test_until_started_raise_runs_a_copy_accepted_while_the_first_runs``;
* once "a lease left by a killed worker expires within ``lock_ttl``":
  ``test_queue_modes.py::test_killed_worker_frees_the_lock_within_its_ttl``.

The File-backend row maps to nothing (no file lock is offered), so it has no behaviour to hold.
"""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import AlreadyQueued, LockContended, LockedTask
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard._config import load_settings, reset
from celery_lockguard._config import settings as lockguard_settings
from celery_lockguard._keys import claim_name, digest, fence_name, lock_name

from .harness import wait_for
from .tracer import deliver, make_app, published

pytestmark = pytest.mark.integration


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("migrating", redis_url, prefix)


def task(app: Celery, body: Any, **opts: Any) -> Any:
    """A LockedTask of its own name running ``body(self, ...)`` (its parameters are what ``lock_key`` names)."""
    name = f"mig.{uuid.uuid4().hex[:8]}"
    return app.task(base=LockedTask, bind=True, shared=False, name=name, **opts)(body)


def echo_n(self: Any, n: int) -> int:
    return n


def echo_ab(self: Any, a: int, b: str) -> list[Any]:
    return [a, b]


def echo_account(self: Any, account_id: int) -> int:
    return account_id


def echo_export(self: Any, account_id: int, fmt: str) -> str:
    return f"{account_id}.{fmt}"


def echo_user(self: Any, username: str, reason: str = "") -> str:
    return username


def from_another_client(fn: Any) -> Any:
    """Publish from a thread with no current task: another web request, not the running body's follow-up."""
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(_catch(fn)))
    th.start()
    th.join(30)
    (got,) = out
    if isinstance(got, BaseException):
        raise got
    return got


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
        return exc


def next_message(r: redis.Redis, app: Celery) -> Any:
    """Pop the oldest message of the app's queue (as a worker would receive it)."""
    msgs = published(r, app)
    r.rpop(f"{app.conf.broker_transport_options['global_keyprefix']}{app.conf.task_default_queue}")
    return msgs[0]


def deliver_next(r: redis.Redis, app: Celery, t: Any) -> Any:
    msg = next_message(r, app)
    return deliver(t, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom())


def plant(r: redis.Redis, prefix: str, key: str, t: Any, kwargs: dict[str, Any], **kw: Any) -> L.Lease:
    """A running holder of ``t(**kwargs)`` on ``key`` (another worker's body), alive unless told."""
    got = L.acquire(
        r,
        prefix,
        key,
        ttl_ms=kw.pop("ttl_ms", 30_000),
        task_id=kw.pop("task_id", f"running-{uuid.uuid4().hex[:6]}"),
        task_name=t.name,
        digest=digest(kwargs),
        worker="elsewhere",
        fence_ttl_ms=60_000,
        **kw,
    )
    assert isinstance(got, L.Lease)
    return got


# -- celery-once ---------------------------------------------------------------------------------------


def test_queueonce_and_singleton_are_until_done_claimed_at_publish_and_held_through_the_body(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``base=QueueOnce`` / singleton ``base=Singleton`` / heimdall ``unique`` -> ``lock_mode="until_done"``.

    Also once ``graceful=True`` and singleton's and heimdall's "a duplicate ``delay()`` returns the
    existing task's ``AsyncResult``" -> ``on_locked="skip"`` (the default).
    """
    seen: dict[str, Any] = {}

    def body(self: Any, account_id: int) -> str:
        seen["state"] = r.hget(lock_name(prefix, f"report:{account_id}"), "state")
        seen["dup"] = from_another_client(lambda: build.delay(account_id)).id  # while the body runs
        return f"report {account_id}"

    build = task(app, body, lock_key="report:{account_id}", lock_mode="until_done")
    first = build.delay(1)
    held = r.hgetall(lock_name(prefix, "report:1"))
    assert held["state"] == "queued" and held["task_id"] == first.id, "claimed at publish"
    again = build.delay(1)
    assert again.id == first.id and type(again).__name__ == "AsyncResult", "the queued holder's AsyncResult"
    assert deliver_next(r, app, build).state == "SUCCESS"
    assert seen == {"state": "running", "dup": first.id}, "held through the body: the running one answers"
    assert not r.exists(lock_name(prefix, "report:1")), "freed when the body ends"
    assert build.delay(1).id != first.id, "a publish after the run is new work"


def test_once_keys_map_to_a_lock_key_over_those_parameters(app: Celery, r: redis.Redis, prefix: str) -> None:
    """once ``once={"keys": ["a"]}`` -> ``lock_key="thing:{a}"``; singleton ``unique_on`` likewise."""
    t = task(app, echo_ab, lock_key="thing:{a}", lock_mode="until_done")

    def call(a: int, b: str) -> Any:
        return t.apply_async(kwargs={"a": a, "b": b})

    one = call(1, "x")
    assert r.hget(lock_name(prefix, "thing:1"), "task_id") == one.id
    assert call(1, "x").id == one.id, "the same a, the same b: identical work, answered"
    other_b = call(1, "y")  # the same entity, other arguments: different work, queued behind it (not refused)
    assert other_b.id != one.id and r.hget(claim_name(prefix, "thing:1"), "task_id") == other_b.id
    two = call(2, "x")
    assert r.hget(lock_name(prefix, "thing:2"), "task_id") == two.id, "another a is another entity"


def test_once_keys_empty_is_a_constant_key_one_at_a_time_whatever_the_arguments(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``once={"keys": []}`` -> a constant key ``lock_key="reindex"``."""
    reindex = task(app, echo_n, lock_key="reindex")
    running = plant(r, prefix, "reindex", reindex, {"n": 1})  # reindex(1) runs on another worker
    out = deliver(reindex, kwargs={"n": 2})
    assert out.state == "RETRY", "other arguments still wait for the one running"
    L.release(r, running, prefix)
    msg = next_message(r, app)
    assert deliver(reindex, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom()).state == "SUCCESS"


def test_once_default_key_is_a_lock_key_over_every_parameter(app: Celery, r: redis.Redis, prefix: str) -> None:
    """once's and heimdall's default key (task name + every argument) -> ``lock_key`` over every parameter."""
    export = task(app, echo_export, lock_key="export:{account_id}:{fmt}", lock_mode="until_done")
    csv = export.delay(account_id=1, fmt="csv")
    assert export.delay(account_id=1, fmt="csv").id == csv.id
    pdf = export.delay(account_id=1, fmt="pdf")
    assert pdf.id != csv.id
    assert r.hget(lock_name(prefix, "export:1:csv"), "task_id") == csv.id
    assert r.hget(lock_name(prefix, "export:1:pdf"), "task_id") == pdf.id


def test_once_graceful_false_and_singleton_raise_on_duplicate_raise_already_queued(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``graceful=False``; singleton ``raise_on_duplicate``; heimdall ``unique_raises=True``.

    -> ``on_locked="raise"`` as a task option or ``lockguard_on_locked``: ``AlreadyQueued(key, task_id)``.
    """
    by_option = task(app, echo_account, lock_key="report:{account_id}", lock_mode="until_done", on_locked="raise")
    first = by_option.delay(7)
    with pytest.raises(AlreadyQueued) as err:
        by_option.delay(7)
    assert (err.value.key, err.value.task_id) == ("report:7", first.id)
    assert published(r, app)[-1].task_id == first.id and len(published(r, app)) == 1, "nothing was sent"
    app.conf.lockguard_on_locked = "raise"
    reset(app)
    by_setting = task(app, echo_user, lock_key="user:{username}", lock_mode="until_done")
    queued = by_setting.delay("bob")
    with pytest.raises(AlreadyQueued) as err:
        by_setting.delay("bob")
    assert (err.value.key, err.value.task_id) == ("user:bob", queued.id)


def test_once_timeout_and_singleton_lock_expiry_are_queue_lock_ttl_then_lock_ttl(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``timeout`` / singleton ``lock_expiry`` / heimdall ``unique_timeout``.

    -> ``queue_lock_ttl`` while the message waits, then ``lock_ttl`` while the body runs.
    """
    seen: dict[str, int] = {}

    def body(self: Any, n: int) -> int:
        seen["running_pttl"] = int(r.pttl(lock_name(prefix, f"job:{n}")))
        return n

    t = task(app, body, lock_key="job:{n}", lock_mode="until_done", queue_lock_ttl=120, lock_ttl=7)
    t.delay(1)
    assert 100_000 < r.pttl(lock_name(prefix, "job:1")) <= 120_000, "queued: queue_lock_ttl"
    assert deliver_next(r, app, t).state == "SUCCESS"
    assert 0 < seen["running_pttl"] <= 7_000, "running: lock_ttl (renewed)"
    assert lockguard_settings(app).key_prefix == prefix
    defaults = task(app, echo_n, lock_key="job:{n}", lock_mode="until_done").lockguard_options
    assert (defaults.queue_lock_ttl, defaults.ttl) == (3600, 30), "the documented defaults"


def test_once_unlock_before_run_is_until_started_and_an_accepted_copy_runs_after(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``unlock_before_run=True`` (with its default ``graceful=False``) -> ``until_started`` (+ ``raise``).

    The claim is freed when the body starts; a copy published while it runs is accepted, waits when
    delivered behind the running one, then runs; a copy published while that one is queued is refused.
    """
    seen: dict[str, Any] = {}

    def body(self: Any, n: int) -> int:
        seen.setdefault("claim_at_start", r.exists(claim_name(prefix, f"job:{n}")))
        return n

    t = task(app, body, lock_key="job:{n}", lock_mode="until_started", on_locked="raise")
    first = t.delay(1)
    assert r.hget(claim_name(prefix, "job:1"), "task_id") == first.id
    assert deliver_next(r, app, t).state == "SUCCESS" and seen["claim_at_start"] == 0
    running = plant(r, prefix, "job:1", t, {"n": 1})  # the first copy runs on another worker
    accepted = t.delay(1)  # published while it runs: accepted
    with pytest.raises(AlreadyQueued):
        t.delay(1)  # the accepted copy is queued: refused at publish
    out = deliver_next(r, app, t)
    assert out.state == "RETRY", f"the accepted copy must wait behind the running one, not fail: {out.retval}"
    L.release(r, running, prefix)
    assert deliver_next(r, app, t).state == "SUCCESS"
    assert app.AsyncResult(accepted.id).state == "SUCCESS"


def test_once_backend_url_and_singleton_backend_url_are_lockguard_redis_url_defaulting_to_the_broker(
    redis_url: str, prefix: str
) -> None:
    """once ``ONCE["settings"]["url"]`` / singleton ``singleton_backend_url`` / heimdall's Redis.

    -> ``lockguard_redis_url``, defaulting to the broker when it is Redis.
    """
    on_broker = Celery("b", broker=redis_url, set_as_current=False)
    assert load_settings(on_broker).redis_url == redis_url, "the broker, when it is Redis"
    elsewhere = Celery("e", broker=redis_url, set_as_current=False)
    elsewhere.conf.lockguard_redis_url = "redis://127.0.0.1:6379/5"
    assert load_settings(elsewhere).redis_url == "redis://127.0.0.1:6379/5"


def test_once_blocking_is_on_locked_retry_waiting_by_re_sending_within_lock_max_waits(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once Redis backend ``blocking=True``, ``blocking_timeout`` -> ``on_locked="retry"``, ``lock_max_waits``."""
    t = task(app, echo_n, lock_key="job:{n}", on_locked="retry", lock_max_waits=1)
    running = plant(r, prefix, "job:1", t, {"n": 1})  # identical work running: retry waits even for that
    out = deliver(t, kwargs={"n": 1})
    assert out.state == "RETRY"
    (wait,) = published(r, app)
    assert wait.task_id == out.task_id and int(wait.custom()[headers.WAITS]) == 1
    assert wait.headers.get("eta"), "re-sent with a countdown, no worker blocked"
    out = deliver_next(r, app, t)
    assert out.state == "FAILURE" and isinstance(out.retval.exception, LockContended), "the budget is spent"
    L.release(r, running, prefix)


def test_queueonceid_is_built_in_a_resend_is_dropped_while_running_and_answered_after(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once ``QueueOnceId`` -> built in: the same ``task_id`` is dropped while the original runs, then answered."""
    runs: list[int] = []

    def body(self: Any, n: int) -> int:
        runs.append(n)
        return n * 10

    t = task(app, body, lock_key="job:{n}")
    tid = str(uuid.uuid4())
    original = plant(r, prefix, "job:1", t, {"n": 1}, task_id=tid)  # the original runs on another worker
    dropped = deliver(t, kwargs={"n": 1}, task_id=tid)
    assert dropped.state == "PENDING" and runs == [], "the resend is dropped (Ignore): the original's state stands"
    L.release(r, original, prefix)
    r.delete(*[k for k in r.scan_iter(f"{prefix}:v1:*watch*")])  # its watch copy is another test's subject
    for k in r.scan_iter(f"{prefix}:kombu:*"):
        r.delete(k)
    assert deliver(t, kwargs={"n": 1}, task_id=tid).state == "SUCCESS" and runs == [1]
    again = deliver(t, kwargs={"n": 1}, task_id=tid)  # sent again after it completed: answered from its record
    assert again.state == "SUCCESS" and again.retval == 10 and runs == [1]


def test_once_after_return_is_the_finally_of_call_any_exit_frees_the_lease(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """once "lock cleared in ``after_return``" -> released in ``__call__``'s ``finally``.

    Celery skips ``after_return`` on ``Ignore``/``Reject``/``Retry``: the lease must go anyway.
    """
    from celery.exceptions import Ignore

    def body(self: Any, n: int, how: str) -> int:
        assert r.exists(lock_name(prefix, f"job:{n}"))
        if how == "ignore":
            raise Ignore()
        raise RuntimeError("boom")

    t = task(app, body, lock_key="job:{n}", lock_mode="until_done")
    for n, how in ((1, "ignore"), (2, "fail")):
        t.delay(n, how)
        deliver_next(r, app, t)
        assert not r.exists(lock_name(prefix, f"job:{n}")), f"{how}: the lease outlived the body"


# -- celery-singleton ----------------------------------------------------------------------------------


def test_singleton_unique_on_shares_the_entity_but_other_arguments_are_different_work(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """singleton ``unique_on=["username"]`` -> ``lock_key="user:{username}"``; the "one difference" paragraph."""
    order: list[str] = []

    def body(self: Any, username: str, reason: str = "") -> None:
        order.append(reason)

    rebuild = task(app, body, lock_key="user:{username}", lock_mode="until_done")
    a = rebuild.delay("bob", reason="signup")
    assert rebuild.delay("bob", reason="signup").id == a.id
    b = rebuild.delay("bob", reason="other")  # the same entity, different work: queued and runs after
    assert b.id != a.id
    assert deliver_next(r, app, rebuild).state == "SUCCESS"
    assert deliver_next(r, app, rebuild).state == "SUCCESS"
    assert order == ["signup", "other"]


def test_singleton_challenge_lock_on_startup_is_not_needed_a_dead_holder_is_taken_over(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """singleton ``challenge_lock_on_startup`` -> not needed: the redelivery takes a dead holder over at once."""
    t = task(app, echo_n, lock_key="job:{n}")
    tid = str(uuid.uuid4())
    gone = subprocess.Popen(["true"])
    gone.wait()
    plant(r, prefix, "job:1", t, {"n": 1}, task_id=tid, ttl_ms=60_000)
    r.hset(lock_name(prefix, "job:1"), "pid", gone.pid)  # this host, its process gone: a killed child
    out = deliver(t, kwargs={"n": 1}, task_id=tid)
    assert out.state == "SUCCESS", "taken over at once, not after the 60 s lease"
    other = plant(r, prefix, "job:2", t, {"n": 2}, ttl_ms=300)  # a holder that stops renewing: gone within its TTL
    wait_for(lambda: not r.exists(other.redis_key), 5, what="the unrenewed lease to expire")
    assert deliver(t, kwargs={"n": 2}).state == "SUCCESS"


def test_singleton_clear_locks_is_lockguard_release_which_bumps_the_fence(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """singleton ``clear_locks(app)`` -> ``celery lockguard release KEY`` frees one entity and bumps its fence."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lockguard._cli import lockguard

    t = task(app, echo_n, lock_key="job:{n}")
    held = plant(r, prefix, "job:1", t, {"n": 1})
    untouched = plant(r, prefix, "job:2", t, {"n": 2})
    app.conf.lockguard_socket_timeout = 5.0  # the tracer app's 0.5 s is for outage tests; a busy host needs more
    reset(app)
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["release", "job:1", "--yes"], obj=obj)
    assert out.exit_code == 0, (out.output, out.exception)
    assert not r.exists(lock_name(prefix, "job:1")) and int(r.get(fence_name(prefix, "job:1"))) > held.fence
    assert r.exists(untouched.redis_key), "one entity, not every lock"


def test_singleton_key_prefix_is_lockguard_key_prefix(app: Celery, r: redis.Redis, prefix: str) -> None:
    """singleton ``singleton_key_prefix`` / heimdall ``heimdall_lock_prefix`` -> ``lockguard_key_prefix``."""
    assert load_settings(Celery("d", set_as_current=False)).key_prefix == "lockguard"
    t = task(app, echo_user, lock_key="user:{username}", lock_mode="until_done")
    sent = t.delay("ann")
    assert r.hget(f"{prefix}:v1:{{user:ann}}:lock", "task_id") == sent.id


def test_singleton_backend_class_is_redis_valkey_sentinel_or_cluster_settings(redis_url: str) -> None:
    """singleton ``singleton_backend_class`` -> none: ``lockguard_sentinels`` or ``lockguard_redis_cluster``."""
    a = Celery("s", broker=redis_url, set_as_current=False)
    a.conf.lockguard_sentinels = [("127.0.0.1", 26379)]
    a.conf.lockguard_sentinel_master = "mymaster"
    got = load_settings(a)
    assert got.sentinels == [("127.0.0.1", 26379)] and got.sentinel_master == "mymaster"
    c = Celery("c", broker=redis_url, set_as_current=False)
    c.conf.lockguard_redis_cluster = True
    assert load_settings(c).redis_cluster is True


def test_singleton_uppercase_settings_are_celery_lockguard_with_the_celery_namespace(redis_url: str) -> None:
    """singleton ``CELERY_SINGLETON_*`` -> ``CELERY_LOCKGUARD_*``, ``config_from_object(..., namespace="CELERY")``."""

    class Config:
        CELERY_BROKER_URL = redis_url
        CELERY_LOCKGUARD_KEY_PREFIX = "from-django"
        CELERY_LOCKGUARD_ON_LOCKED = "raise"

    a = Celery("django", set_as_current=False)
    a.config_from_object(Config, namespace="CELERY")
    got = load_settings(a)
    assert (got.key_prefix, got.on_locked) == ("from-django", "raise")


# -- celery-heimdall -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["generate_report", lambda customer_id: "generate_report"])
def test_heimdall_key_function_is_a_constant_or_callable_lock_key(
    app: Celery, r: redis.Redis, prefix: str, key: Any
) -> None:
    """heimdall ``"key": lambda args, kwargs: "generate_report"`` -> a constant or callable ``lock_key``."""

    def body(self: Any, customer_id: int) -> int:
        return customer_id

    report = task(app, body, lock_key=key, lock_mode="until_done")
    first = report.delay(1)
    assert r.hget(lock_name(prefix, "generate_report"), "task_id") == first.id
    assert report.delay(1).id == first.id
    other = report.delay(2)  # one entity whatever the arguments; other arguments queue behind, not refused
    assert other.id != first.id and r.hget(claim_name(prefix, "generate_report"), "task_id") == other.id
    assert deliver_next(r, app, report).retval == 1 and deliver_next(r, app, report).retval == 2


def test_heimdall_unique_wait_for_expiry_is_a_completion_record_kept_for_the_interval(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """heimdall ``unique_wait_for_expiry=True`` -> ``idempotency_key`` with ``completion_ttl``: answered, not run."""
    from celery_lockguard._keys import done_name, record_scope

    runs: list[int] = []

    def body(self: Any, customer_id: int) -> str:
        runs.append(customer_id)
        return f"report {customer_id}"

    report = task(app, body, idempotency_key="report:{customer_id}", completion_ttl=3600)
    assert deliver(report, kwargs={"customer_id": 1}).retval == "report 1"
    later = deliver(report, kwargs={"customer_id": 1})  # another call within the hour
    assert later.state == "SUCCESS" and later.retval == "report 1" and runs == [1], "answered from the record"
    kept = r.pttl(done_name(prefix, record_scope("report:1", report.name)))  # the record answers its own task only
    assert 3_500_000 < kept <= 3_600_000, "kept for the interval"
    assert deliver(report, kwargs={"customer_id": 2}).retval == "report 2" and runs == [1, 2]


def test_heimdall_times_per_is_lock_rate_with_lock_limit_waiting_for_the_window(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    """heimdall ``times=2, per=60`` -> ``lock_rate="2/60s"`` with ``lock_limit=2``: a third start waits."""
    seen: dict[str, int] = {}

    def body(self: Any, customer_id: int, n: int) -> int:
        seen["slot"] = max(seen.get("slot", 0), self.lock.slot)
        return n

    download = task(app, body, lock_key="amazon:{customer_id}", lock_limit=2, lock_rate="2/60s")
    assert [deliver(download, kwargs={"customer_id": 1, "n": n}).state for n in (1, 2)] == ["SUCCESS"] * 2
    third = deliver(download, kwargs={"customer_id": 1, "n": 3})
    assert third.state == "RETRY", "the window is full: rescheduled"
    (wait,) = published(r, app)
    assert wait.headers.get("eta"), "with a countdown until the window has room"
    assert deliver(download, kwargs={"customer_id": 2, "n": 4}).state == "SUCCESS", "the budget is per key"
    alone = task(app, body, lock_key="api:{customer_id}", lock_rate="2/60s")  # no lock_limit: one at a time
    running = plant(r, prefix, "api:1", alone, {"customer_id": 1, "n": 0})
    assert deliver(alone, kwargs={"customer_id": 1, "n": 5}).state == "RETRY", "a second body waits"
    L.release(r, running, prefix)
