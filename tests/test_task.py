"""LockedTask in-process (``apply()`` behaves like a worker) against a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import BackendUnavailable, LockContended, LockedTask, LockLost
from celery_lockguard import _lease as L
from celery_lockguard._completion import CheckpointNotSerializable
from celery_lockguard._config import reset
from celery_lockguard._keys import done_name, lock_name
from celery_lockguard.testing import free_port, lockguard_disabled

from .harness import wait_for


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("tasktest", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_socket_timeout = 0.5
    yield a


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def hold_externally(
    r: redis.Redis,
    prefix: str,
    key: str,
    task_id: str = "other",
    task_name: str = "x",
    digest: str = "d",
    ttl_ms: int = 10_000,
) -> L.Lease:
    got = L.acquire(
        r,
        prefix,
        key,
        ttl_ms=ttl_ms,
        task_id=task_id,
        task_name=task_name,
        digest=digest,
        worker="elsewhere",
        fence_ttl_ms=60_000,
    )
    assert isinstance(got, L.Lease)
    return got


def test_direct_call_runs_unlocked(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.1", lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.lock

    assert t(1) is None


def test_apply_locks_like_a_worker_and_releases(app: Celery, r: redis.Redis, prefix: str) -> None:
    seen = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.2", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        seen["lease"] = self.lock
        seen["pttl"] = r.pttl(lock_name(prefix, "k:1"))
        seen["scope"] = self.completion_scope
        return a * 2

    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="id-1").get() == 2
    lease = seen["lease"]
    assert lease.key == "k:1" and lease.fence > 0 and lease.released
    assert 0 < seen["pttl"] <= 30_000 and seen["scope"] == "task:id-1"
    assert not r.exists(lock_name(prefix, "k:1"))
    assert [e["event"] for e in logs] == ["lock.acquired", "lock.released"]
    assert logs[0]["lock_key"] == "k:1" and logs[0]["fence"] == lease.fence and logs[0]["task_id"] == "id-1"


def test_same_task_id_again_returns_recorded_result_without_running(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.3", lock_key="k:{a}")
    def t(self: Any, a: int) -> dict[str, int]:
        runs.append(a)
        return {"n": len(runs)}

    assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    assert runs == [1]
    assert events(logs, "completion.skipped")[0]["completed_by"] == "same"
    assert t.apply(args=(1,), task_id="another").get() == {"n": 2}
    assert 0 < r.pttl(done_name(prefix, "task:same")) <= 3600_000


def test_idempotency_key_dedupes_across_task_ids_and_locks_on_scope(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs = []

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.4", idempotency_key="invoice:{invoice_id}:charge")
    def charge(self: Any, invoice_id: int) -> str:
        runs.append(self.lock.key)
        return self.completion_scope

    assert charge.apply(args=(7,), task_id="a").get() == "invoice:7:charge"
    assert charge.apply(args=(7,), task_id="b").get() == "invoice:7:charge"
    assert runs == ["invoice:7:charge"]
    # The record answers tt.4 only (issue 29 item 7); it keeps S's hash tag, the lease's own.
    assert 3600_000 < r.pttl(done_name(prefix, "by:tt.4:invoice:7:charge")) <= 86400_000
    assert done_name(prefix, "by:tt.4:invoice:7:charge") == f"{prefix}:v1:{{invoice:7:charge}}:by:tt.4:done"


def test_large_or_unserializable_result_records_none(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.5", lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return "x" * 2000 if a == 1 else object()

    with capture_logs() as logs:
        assert len(t.apply(args=(1,), task_id="big").get()) == 2000
        t.apply(args=(2,), task_id="obj")
    reasons = [e["reason"] for e in events(logs, "completion.result_dropped")]
    assert reasons == ["result larger than 1024 bytes", "result is not JSON-serializable"]
    assert t.apply(args=(1,), task_id="big").get() is None


def test_lockguard_disabled_turns_everything_off(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.6", lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.lock

    with lockguard_disabled(app):
        assert t.apply(args=(1,)).get() is None
    assert list(r.scan_iter(f"{prefix}*")) == []
    assert t.apply(args=(1,)).get() is not None


def test_identical_work_held_elsewhere_is_skipped(app: Celery, r: redis.Redis, prefix: str) -> None:
    runs = []

    @app.task(base=LockedTask, bind=True, lock_key="k:{a}", name="t.dup")
    def t(self: Any, a: int) -> int:
        runs.append(a)
        return a

    holder = hold_externally(r, prefix, "k:1", task_name="t.dup", digest=_digest(t, 1))
    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="dup-1").get() is None
    assert runs == []
    skipped = events(logs, "lock.skipped_duplicate")[0]
    assert skipped["holder_task_id"] == "other" and skipped["reason"] == "identical_work_running"
    assert r.hget(lock_name(prefix, "k:1"), "token") == holder.token


def _digest(task: Any, *args: Any) -> str:
    from celery_lockguard import _keys as keys

    return keys.digest(keys.bind(task.lockguard_options.signature, args, {}))


def test_different_work_waits_and_the_wait_budget_ends_visibly(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, lock_key="k:{a}", name="t.diff", lock_max_waits=0)
    def t(self: Any, a: int, amount: int) -> int:
        return amount

    hold_externally(r, prefix, "k:1", task_name="t.diff", digest=_digest(t, 1, 100))
    with capture_logs() as logs, pytest.raises(LockContended) as err:
        t.apply(args=(1, 250), throw=True)
    assert err.value.holder_task_id == "other" and err.value.key == "k:1"
    assert events(logs, "lock.wait_budget_exhausted")[0]["reason"] == "different_work_on_entity"


def test_eager_wait_runs_once_the_holder_is_gone(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, lock_key="k:{a}", name="t.w", on_locked="retry", lock_max_waits=50)
    def t(self: Any, a: int) -> str:
        return "ran"

    hold_externally(r, prefix, "k:1", ttl_ms=300)
    with capture_logs() as logs:
        assert t.apply(args=(1,), throw=True).get() == "ran"
    assert len(events(logs, "lock.retry_scheduled")) >= 1
    assert events(logs, "lock.acquired")


def test_on_locked_raise(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.7", lock_key="k:{a}", on_locked="raise")
    def t(self: Any, a: int) -> None: ...

    hold_externally(r, prefix, "k:1")
    with pytest.raises(LockContended):
        t.apply(args=(1,), throw=True)


def test_retry_releases_before_publishing(app: Celery, r: redis.Redis, prefix: str) -> None:
    tries = []

    @app.task(
        base=LockedTask, bind=True, shared=False, name="tt.8", lock_key="k:{a}", max_retries=3, default_retry_delay=0
    )
    def t(self: Any, a: int) -> int:
        tries.append(self.lock.fence)
        if len(tries) < 3:
            raise self.retry()
        return len(tries)

    assert t.apply(args=(1,)).get() == 3
    assert len(set(tries)) == 3 and tries == sorted(tries)
    assert not r.exists(lock_name(prefix, "k:1"))


def test_renewal_keeps_a_short_lease_through_a_long_body(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.9", lock_key="k:{a}", lock_ttl=0.3)
    def t(self: Any, a: int) -> list[Any]:
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            assert self.lock.held
            time.sleep(0.02)
        return [self.lock.held, r.pttl(lock_name(prefix, "k:1"))]

    held, pttl = t.apply(args=(1,), throw=True).get()
    assert held and 0 < pttl <= 300


def test_lost_lease_is_reported_and_release_spares_the_new_holder(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.10", lock_key="k:{a}", lock_ttl=0.2, lock_renew=False)
    def t(self: Any, a: int) -> bool:
        wait_for(lambda: not r.exists(lock_name(prefix, "k:1")), 5, what="lease to expire")
        hold_externally(r, prefix, "k:1", task_id="successor")
        with pytest.raises(LockLost):
            self.lock.ensure_held()
        return self.lock.lost

    with capture_logs() as logs:
        assert t.apply(args=(1,), throw=True).get() is True
    assert r.hget(lock_name(prefix, "k:1"), "task_id") == "successor"
    expired = events(logs, "lock.expired_before_release")[0]
    assert expired["reason"] == "taken_by_another_holder"


def test_checkpoint_runs_once_and_replays_the_json_value(app: Celery) -> None:
    calls = []

    def provider(x: int) -> tuple[int, str]:
        calls.append(x)
        return (x, "receipt")

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="tt.11",
        idempotency_key="inv:{a}",
        max_retries=2,
        default_retry_delay=0,
    )
    def t(self: Any, a: int) -> Any:
        got = self.checkpoint("charge", provider, a)
        if self.request.retries == 0:
            raise self.retry()
        return got

    assert t.apply(args=(5,)).get() == [5, "receipt"]
    assert calls == [5]


def test_checkpoint_name_reused_in_one_run_is_an_error(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.12", lock_key="k:{a}")
    def t(self: Any, a: int) -> None:
        self.checkpoint("x", int, 1)
        self.checkpoint("x", int, 2)

    with pytest.raises(Exception, match="used twice"):
        t.apply(args=(1,), throw=True)


def test_checkpoint_non_json_result_records_done_before_raising(app: Celery) -> None:
    calls = []

    def effect() -> object:
        calls.append(1)
        return object()

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.13", idempotency_key="nj:{a}")
    def t(self: Any, a: int) -> Any:
        return self.checkpoint("effect", effect)

    with pytest.raises(CheckpointNotSerializable):
        t.apply(args=(1,), throw=True)
    assert t.apply(args=(1,), throw=True).get() is None
    assert calls == [1]


def unreachable_app(policy: str, prefix: str) -> Celery:
    a = Celery("down", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_socket_timeout = 0.3
    a.conf.lockguard_on_unavailable = policy
    a.conf.lockguard_max_waits = 0
    return a


def test_fail_open_runs_without_a_lease_visibly(prefix: str) -> None:
    app = unreachable_app("fail_open", prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.14", lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.lock

    with capture_logs() as logs:
        assert t.apply(args=(1,), throw=True).get() is None
    assert events(logs, "lock.fail_open")[0]["policy"] == "fail_open"


def test_fail_closed_never_runs_the_body(prefix: str) -> None:
    app = unreachable_app("fail_closed", prefix)
    ran = []

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.15", lock_key="k:{a}")
    def t(self: Any, a: int) -> None:
        ran.append(a)

    with capture_logs() as logs, pytest.raises(BackendUnavailable):
        t.apply(args=(1,), throw=True)
    assert ran == []
    assert events(logs, "lock.backend_unavailable")[0]["policy"] == "fail_closed"
    # The give-up names the policy that decided it (on_unavailable), not on_locked's "skip".
    assert [e["policy"] for e in events(logs, "lock.wait_budget_exhausted")] == ["fail_closed"]


def test_an_outage_wait_names_on_unavailable_as_its_policy(prefix: str) -> None:
    """Waits and the give-up at the budget, in an outage: each event says ``fail_closed``."""
    app = unreachable_app("fail_closed", prefix)
    app.conf.lockguard_max_waits = 2

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.15w", lock_key="k:{a}")
    def t(self: Any, a: int) -> None:
        raise AssertionError("ran without a lease under fail_closed")

    with capture_logs() as logs, pytest.raises(BackendUnavailable):
        t.apply(args=(1,), throw=True)
    waits = events(logs, "lock.retry_scheduled")
    assert len(waits) == 2 and {e["policy"] for e in waits} == {"fail_closed"}
    assert {e["reason"] for e in waits} == {"backend_unavailable"}
    assert [e["policy"] for e in events(logs, "lock.wait_budget_exhausted")] == ["fail_closed"]


def test_a_publish_without_its_claim_names_on_unavailable(redis_url: str, prefix: str) -> None:
    """until_done publishes without the claim when the lock Redis is down: the warning names ``on_unavailable``."""
    app = Celery("pubdown", broker=redis_url, set_as_current=False)
    app.conf.update(
        lockguard_key_prefix=prefix,
        lockguard_redis_url=f"redis://127.0.0.1:{free_port()}/0",
        lockguard_socket_timeout=0.3,
        lockguard_on_unavailable="fail_open",
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},  # kombu's keys under the prefix too
    )
    queue = f"{prefix}.q"

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.15p", lock_key="k:{a}", lock_mode="until_done")
    def t(self: Any, a: int) -> None:
        return None

    r = redis.Redis.from_url(redis_url)
    with capture_logs() as logs:
        t.apply_async((1,), queue=queue)
    (down,) = events(logs, "lock.backend_unavailable")
    assert down["reason"].startswith("publish without claim: ") and down["policy"] == "fail_open"
    assert r.llen(f"{prefix}:kombu:{queue}") == 1  # published all the same: nothing dropped


def test_settings_reset_picks_up_changes(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.16", lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.lock.ttl_ms

    assert t.apply(args=(1,)).get() == 30_000
    app.conf.lockguard_default_ttl = 7
    reset(app)
    assert t.apply(args=(1,)).get() == 7_000


def test_max_hold_stops_renewal_and_tells_the_body(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(
        base=LockedTask, bind=True, shared=False, name="tt.maxhold", lock_key="k:{a}", lock_ttl=0.3, lock_max_hold=0.6
    )
    def t(self: Any, a: int) -> list[Any]:
        wait_for(lambda: self.lock.lost, 3, interval=0.02, what="max hold to cut the lease off")
        wait_for(lambda: not r.exists(lock_name(prefix, "k:1")), 2, what="the unrenewed lease to expire")
        return [self.lock.lost_reason, self.lock.hold_ms()]

    with capture_logs() as logs:
        reason, hold_ms = t.apply(args=(1,), throw=True).get()
    assert reason == "max_hold" and hold_ms >= 600
    cut = events(logs, "lock.max_hold_reached")
    assert len(cut) == 1 and cut[0]["lock_key"] == "k:1" and cut[0]["hold_ms"] >= 600


def test_max_hold_defaults_to_the_hard_time_limit(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.limit", lock_key="k:{a}", time_limit=120)
    def t(self: Any, a: int) -> None: ...

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.nolimit", lock_key="k:{a}")
    def u(self: Any, a: int) -> None: ...

    assert t.lockguard_options.max_hold == 120 and u.lockguard_options.max_hold == 3600


def test_a_duplicate_of_a_dead_holder_waits_instead_of_skipping(app: Celery, r: redis.Redis, prefix: str) -> None:
    import subprocess
    import sys

    @app.task(base=LockedTask, bind=True, shared=False, name="t.deaddup", lock_key="k:{a}", lock_max_waits=0)
    def t(self: Any, a: int) -> int:
        return a

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    hold_externally(r, prefix, "k:1", task_name="t.deaddup", digest=_digest(t, 1))
    r.hset(lock_name(prefix, "k:1"), "pid", gone.pid)  # the holder's process on this host is gone
    with capture_logs() as logs, pytest.raises(LockContended):
        t.apply(args=(1,), throw=True)
    assert events(logs, "lock.skipped_duplicate") == []
    assert events(logs, "lock.wait_budget_exhausted")[0]["reason"] == "duplicate_of_dead_holder"


def test_a_full_noeviction_server_follows_on_unavailable(prefix: str) -> None:
    from celery_lockguard.testing import RedisServer

    with RedisServer(extra=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as server:
        c = server.client()
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                c.set(f"fill:{i}", "x" * 10_000)
        app = Celery("oom", broker=server.url, set_as_current=False)
        app.conf.lockguard_key_prefix = prefix
        app.conf.lockguard_max_waits = 0

        @app.task(base=LockedTask, bind=True, shared=False, name="t.oom", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            return a

        with capture_logs() as logs, pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
            t.apply(args=(1,), throw=True)
        assert events(logs, "lock.backend_unavailable")[0]["policy"] == "fail_closed"


def test_replace_releases_before_the_replacement_runs(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="tt.replacement", lock_key="k:{a}")
    def replacement(self: Any, a: int) -> str:
        return f"replacement ran with fence {self.lock.fence > 0}"

    @app.task(base=LockedTask, bind=True, shared=False, name="tt.original", lock_key="k:{a}")
    def original(self: Any, a: int) -> Any:
        return self.replace(replacement.s(a))

    assert original.apply(args=(1,), throw=True).get() == "replacement ran with fence True"
    assert not r.exists(lock_name(prefix, "k:1"))


class _Unprintable:
    """An argument whose ``__str__`` fails: what a model with a ``None`` field formatted by ``:d`` does."""

    def __str__(self) -> str:
        return f"{None:d}"


def test_an_argument_whose_str_fails_is_not_reported_as_a_signature_mismatch(app: Celery) -> None:
    """The arguments match the signature; only rendering one of them failed: its own TypeError reaches the
    caller, positional or by keyword, not 'arguments do not match its signature'."""

    @app.task(base=LockedTask, lock_key="item:{item}", shared=False)
    def charge(item: Any, amount: int = 1) -> None:
        return None

    for args, kwargs in (((_Unprintable(),), {}), ((), {"item": _Unprintable()}), ((1, _Unprintable()), {})):
        result = charge.apply(args, kwargs)
        assert result.state == "FAILURE"
        assert isinstance(result.result, TypeError)
        assert "do not match its signature" not in str(result.result), (args, kwargs, result.result)
        assert "NoneType" in str(result.result)
    with pytest.raises(TypeError, match="do not match its signature"):
        charge.lock_key_for(1, 2, 3)
