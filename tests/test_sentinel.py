"""Sentinel: a private master, replica and three sentinels; the master fails over while a lease is held.

What the docs promise, shown end to end:

* the client follows a failover (the renewer keeps renewing on the new master);
* ``lock_replicas`` waits for a replica and reports an under-replicated lease;
* a lease lost in the failover (never replicated) is detected -- its token is
  gone on the new master -- and the fence and the completion record keep the
  effect single although a second holder ran meanwhile.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockedTask, StaleFence, advance_fence
from celery_lockguard import _connection as connection
from celery_lockguard._config import settings
from celery_lockguard._keys import done_name, lock_name
from celery_lockguard.fencing import create_fence_table

from .harness import wait_for
from .topologies import SentinelSet

pytestmark = pytest.mark.sentinel


@pytest.fixture
def sset() -> Iterator[SentinelSet]:
    with SentinelSet() as s:
        yield s
    connection.forget_clients()


def sentinel_app(sset: SentinelSet, prefix: str) -> Celery:
    app = Celery("sentineltest", broker="memory://", set_as_current=False)
    app.conf.lockguard_sentinels = sset.sentinels
    app.conf.lockguard_sentinel_master = sset.NAME
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_socket_timeout = 0.5
    app.conf.lockguard_max_waits = 1  # an outage ends the call quickly instead of waiting in-process
    return app


def master_client(sset: SentinelSet) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=sset.master_port(), decode_responses=True, socket_timeout=2)


def promoted(sset: SentinelSet, port: int) -> bool:
    """Every sentinel names ``port`` and that server says it is a master."""
    try:
        if any(sset.master_port(i) != port for i in range(len(sset.sentinel_ports))):
            return False
        role = redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=1).role()
        return bool(role[0] == "master")
    except redis.exceptions.RedisError:
        return False


class Gate:
    """Holds a body inside its lease until the test lets it go (bounded: a stuck test fails, never hangs)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.proceed = threading.Event()

    def hold(self) -> None:
        self.started.set()
        assert self.proceed.wait(60), "the test never released the body"


def test_client_follows_a_failover_and_a_replicated_lease_survives_it(sset: SentinelSet) -> None:
    app = sentinel_app(sset, "lgs")
    gate = Gate()
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="s.sync", lock_key="acct:{a}", lock_ttl=6, lock_replicas=1)
    def sync(self: Any, a: int) -> int:
        seen["lease"] = self.lock
        gate.hold()
        seen["held_after"] = self.lock.held
        return a

    result: dict[str, Any] = {}
    with capture_logs() as logs:
        runner = threading.Thread(
            target=lambda: result.setdefault("r", sync.apply(args=(1,), task_id="tid-1")), daemon=True
        )
        runner.start()
        assert gate.started.wait(20)
        lease = seen["lease"]
        assert lease.replicas == 1  # WAIT saw the replica take the lease before the body started
        old, new = sset.master.port, sset.replica.port
        assert redis.Redis(port=new, decode_responses=True).hget(lock_name("lgs", "acct:1"), "token") == lease.token
        sset.sentinel_client().execute_command("SENTINEL", "FAILOVER", sset.NAME)
        wait_for(lambda: promoted(sset, new), 30, interval=0.1, what="the replica to be promoted")
        renewed = redis.Redis(port=new, decode_responses=True)
        before = renewed.hget(lock_name("lgs", "acct:1"), "renewed_at")
        # The renewer reaches the new master (after READONLY or a reset connection on the old one).
        wait_for(
            lambda: renewed.hget(lock_name("lgs", "acct:1"), "renewed_at") != before,
            15,
            interval=0.1,
            what="a renewal on the new master",
        )
        gate.proceed.set()
        runner.join(30)
    assert result["r"].get() == 1 and seen["held_after"]
    assert not lease.lost
    assert old != new
    new_master = redis.Redis(port=new, decode_responses=True)
    assert not new_master.exists(lock_name("lgs", "acct:1"))  # released on the new master
    assert new_master.get(done_name("lgs", "task:tid-1")) is not None  # the record landed there too
    assert not [e for e in logs if e["event"] in ("lock.under_replicated", "lock.lost")]


def test_a_lease_lost_in_a_failover_is_detected_and_effects_stay_single(sset: SentinelSet, tmp_path: Path) -> None:
    app = sentinel_app(sset, "lgs")
    db = tmp_path / "effects.db"
    with sqlite3.connect(db) as conn:
        create_fence_table(conn)
        conn.execute("CREATE TABLE effects (who TEXT)")
    gate = Gate()
    leases: dict[str, Any] = {}
    ran: list[str] = []

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="s.charge",
        lock_key="order:{order}",
        idempotency_key="order:{order}:charge",
        lock_ttl=8,
        lock_replicas=1,
    )
    def charge(self: Any, order: int, who: str) -> str:
        ran.append(who)
        leases[who] = self.lock
        if who == "A":
            gate.hold()
        conn = sqlite3.connect(db)
        try:
            with conn:
                advance_fence(conn, self.lock)  # StaleFence if a newer holder wrote first
                conn.execute("INSERT INTO effects VALUES (?)", (who,))
        finally:
            conn.close()
        return who

    result: dict[str, Any] = {}
    with capture_logs() as logs:
        # The replica is frozen and its link cut, so A's lease (and its fence) never reach it:
        # WAIT times out. (Freezing alone is not enough: bytes already sent wait in its socket.)
        assert sset.replica.proc is not None
        sset.replica.proc.send_signal(signal.SIGSTOP)
        sset.master.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
        runner = threading.Thread(
            target=lambda: result.setdefault("A", charge.apply(args=(1, "A"), task_id="tA")), daemon=True
        )
        runner.start()
        assert gate.started.wait(20)
        lease_a = leases["A"]
        assert lease_a.replicas == 0
        # The master dies with the only copy of the lease; the replica wakes up and is promoted.
        sset.master.stop()
        sset.replica.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: promoted(sset, sset.replica.port), 40, interval=0.1, what="the failover")
        assert not master_client(sset).exists(lock_name("lgs", "order:1"))
        # A second copy of the work takes the entity on the new master with a higher fence and runs.
        b = charge.apply(args=(1, "B"), task_id="tB")
        assert b.get() == "B"
        assert leases["B"].fence > lease_a.fence  # floored by the server's TIME: no fence is reused
        # A finds out at its next renewal: its token is not on the new master.
        wait_for(lambda: lease_a.lost_reason is not None, 20, interval=0.05, what="A to see its lease lost")
        assert lease_a.lost_reason == "token_gone"
        gate.proceed.set()
        runner.join(30)
        with pytest.raises(StaleFence):
            result["A"].get()  # A's late write is refused by the fence
        # Another copy of the same work finds B's completion record and does not run.
        assert charge.apply(args=(1, "B"), task_id="tC").get() == "B"
    assert ran == ["A", "B"]
    with sqlite3.connect(db) as conn:
        assert [r[0] for r in conn.execute("SELECT who FROM effects")] == ["B"]
    events = [e["event"] for e in logs]
    under = [e for e in logs if e["event"] == "lock.under_replicated"]
    # A's replica was cut off; B ran on the promoted master, which has no replica left.
    assert [(e["task_id"], e["replicas"], e["wanted"]) for e in under] == [("tA", 0, 1), ("tB", 0, 1)]
    assert "lock.lost" in events and "fence.stale" in events and "completion.skipped" in events


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_lock_replicas_is_validated_like_other_options(bad: Any) -> None:
    from celery_lockguard import ConfigurationError

    app = Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, bind=True, shared=False, name="s.bad", lock_key="k:{a}", lock_replicas=bad)
    def t(self: Any, a: int) -> None: ...

    with pytest.raises(ConfigurationError, match=r"s\.bad.*lock_replicas"):
        t.lockguard_options  # noqa: B018 - resolving the options is what raises


def test_wait_is_bounded_by_ttl_and_socket_timeout() -> None:
    app = Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, bind=True, shared=False, name="s.ok", lock_key="k:{a}", lock_replicas=2, lock_ttl=3)
    def t(self: Any, a: int) -> None: ...

    opts = t.lockguard_options
    assert opts.replicas == 2 and opts.replicas_timeout_ms == 300


def test_an_acl_user_on_the_sentinel_managed_primary(sset: SentinelSet) -> None:
    from celery_lockguard import acl

    for server in (sset.master, sset.replica):  # the replica too: it is the primary after a failover
        admin = server.client()
        try:
            admin.execute_command("ACL", "SETUSER", "lg", *acl.rule("lgs").split(), ">pw")
        except redis.exceptions.ResponseError:  # before Redis 7.2: no CLIENT SETINFO to grant
            admin.execute_command("ACL", "SETUSER", "lg", *acl.rule("lgs", setinfo=False).split(), ">pw")
    app = sentinel_app(sset, "lgs")
    app.conf.lockguard_redis_kwargs = {"username": "lg", "password": "pw"}

    @app.task(base=LockedTask, bind=True, shared=False, name="s.acl", lock_key="acct:{a}", lock_replicas=1)
    def t(self: Any, a: int) -> Any:
        return [self.lock.replicas, self.checkpoint("step", lambda: a)]

    assert t.apply(args=(5,)).get() == [1, 5]
    assert [e for e in sset.master.client().acl_log() if e.get("username") == "lg"] == []
    app.conf.lockguard_redis_kwargs = {"username": "lg", "password": "wrong"}
    from celery_lockguard._config import reset

    reset(app)
    with pytest.raises(redis.exceptions.AuthenticationError):
        connection.client(settings(app)).ping()


def test_client_kwargs_settings_are_validated() -> None:
    from celery_lockguard import ConfigurationError

    app = Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_kwargs = ["username", "lg"]
    with pytest.raises(ConfigurationError, match="lockguard_redis_kwargs must be a dict"):
        settings(app)
