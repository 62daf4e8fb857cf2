"""Fault tests, each with its pass criterion (issue 9): the lock store misbehaves under a running task."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import BackendUnavailable, LockedTask
from celery_lockguard import _connection as conn_mod
from celery_lockguard._keys import done_name, lock_name
from celery_lockguard._renewer import renewer
from celery_lockguard.testing import RedisServer

from .harness import wait_for
from .loading import loading_server
from .proxy import DelayProxy


def make_app(url: str, prefix: str, **conf: Any) -> Celery:
    app = Celery("faults", broker=url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_socket_timeout = 0.3
    app.conf.update(conf)
    return app


def task(app: Celery, **opts: Any) -> Any:
    def deco(fn: Any) -> Any:
        return app.task(base=LockedTask, bind=True, shared=False, name=f"f.{uuid.uuid4().hex[:6]}", **opts)(fn)

    return deco


def names(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s
    conn_mod.forget_clients()


def test_renewal_failing_while_redis_is_unreachable_tells_the_body(server: RedisServer, prefix: str) -> None:
    """Pass: the body sees the lease lost within its TTL; after release nothing is renewed or resurrected."""
    app = make_app(server.url, prefix)
    name = lock_name(prefix, "k:1")

    @task(app, lock_key="k:{a}", lock_ttl=0.6)
    def t(self: Any, a: int) -> Any:
        ticks = renewer().ticks
        server.pause()
        try:
            # lost by time, and at least one renewal attempt has failed against the frozen server
            wait_for(
                lambda: self.lock.lost and renewer().ticks > ticks,
                5,
                interval=0.02,
                what="the body to be told the lease is lost after a failed renewal",
            )
            return [self.lock.lost, self.lock.held]
        finally:
            server.resume()

    with capture_logs() as logs:
        assert t.apply(args=(1,), throw=True).get() == [True, False]
    assert any(e["event"] == "lock.backend_unavailable" and "renew" in e["reason"] for e in logs)
    # expired (validity passed) or token_gone (a tick after resume found the key expired): lost either way
    assert any(e["event"] == "lock.lost" and e["reason"] in ("expired", "token_gone") for e in logs)
    assert renewer().tracked() == 0
    c = server.client()
    window = threading.Event()  # an observation window for a negative property, not synchronisation
    for _ in range(30):  # over three renewal intervals, nothing brings the released lease back
        assert not c.exists(name)
        window.wait(0.02)


def test_redis_restart_between_acquire_and_release(server: RedisServer, prefix: str) -> None:
    """Pass: NOSCRIPT is handled, nothing leaks, the completion record stops a duplicate, fences still rise."""
    app = make_app(server.url, prefix)
    runs: list[int] = []

    @task(app, lock_key="k:{a}", lock_ttl=2)
    def t(self: Any, a: int) -> int:
        runs.append(self.lock.fence)
        if len(runs) == 1:
            server.stop()
            server.start()
        return len(runs)

    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="same", throw=True).get() == 1
    assert "lock.expired_before_release" in names(logs)
    c = server.client()
    assert c.exists(done_name(prefix, "task:same")) and not c.exists(lock_name(prefix, "k:1"))
    assert t.apply(args=(1,), task_id="same", throw=True).get() == 1  # duplicate stopped by the record
    assert t.apply(args=(1,), task_id="other", throw=True).get() == 2
    assert runs[1] > runs[0]


def test_evicted_lease_is_detected_as_lost(prefix: str) -> None:
    """Pass: a lease evicted under maxmemory is reported lost to the body (token gone)."""
    with RedisServer(extra=["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-random"]) as server:
        app = make_app(server.url, prefix)
        c = server.client()

        @task(app, lock_key="k:{a}", lock_ttl=0.9)
        def t(self: Any, a: int) -> Any:
            name = lock_name(prefix, "k:1")
            i = 0
            while c.exists(name):
                c.set(f"junk:{i}", "x" * 20_000)
                i += 1
            wait_for(lambda: self.lock.lost, 3, interval=0.02, what="the eviction to be detected")
            return self.lock.lost_reason

        try:
            assert t.apply(args=(1,), throw=True).get() in ("token_gone", "expired")
        finally:
            conn_mod.forget_clients()


def test_latency_longer_than_the_ttl_during_acquire_means_not_acquired(server: RedisServer, prefix: str) -> None:
    """Pass: a lease whose ACQUIRE reply arrives after its validity is never run on."""
    proxy = DelayProxy(server.port).start()
    try:
        app = make_app(proxy.url, prefix, lockguard_socket_timeout=5, lockguard_max_waits=0)
        ran: list[int] = []

        @task(app, lock_key="k:{a}", lock_ttl=0.5)
        def t(self: Any, a: int) -> None:
            ran.append(a)

        proxy.delay = 0.8
        with capture_logs() as logs, pytest.raises(BackendUnavailable, match="acquire_slower_than_ttl"):
            t.apply(args=(1,), throw=True)
        assert ran == []
        assert any(e.get("reason") == "acquire_slower_than_ttl" for e in logs)
        proxy.delay = 0
        assert t.apply(args=(1,), throw=True).get() is None and ran == [1]
    finally:
        proxy.close()
        conn_mod.forget_clients()
    assert redis.Redis(port=server.port).dbsize() >= 0


def test_terminate_of_a_dead_child_leaves_a_same_id_holder_in_another_child(server: RedisServer, prefix: str) -> None:
    """Pass: the main process shortens only the lease of the child it terminated (issue: SHORTEN matched
    task id + host, so it cut a redelivery of the same task id that had taken the lease over in another child).
    """
    import os
    from types import SimpleNamespace

    from celery_lockguard import _lease as L
    from celery_lockguard import _signals as signals

    app = make_app(server.url, prefix)

    @task(app, lock_key="k:{a}", lock_ttl=60)
    def t(self: Any, a: int) -> None:
        pass

    c = server.client()
    name = lock_name(prefix, "k:1")
    # The redelivered copy of task "same" holds the lease in this process (the new child)...
    held = L.acquire(
        c, prefix, "k:1", ttl_ms=60_000, task_id="same", task_name=t.name, digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(held, L.Lease)
    old_child = os.getpid() + 1  # ...and the request being terminated ran in another child
    with capture_logs() as logs:
        signals._on_revoked(
            sender=t, request=SimpleNamespace(id="same", args=(1,), kwargs={}, worker_pid=old_child), terminated=True
        )
    assert c.pttl(name) > 50_000, "the new holder's lease was cut"
    assert "lock.force_released" not in names(logs)
    signals._on_revoked(
        sender=t, request=SimpleNamespace(id="same", args=(1,), kwargs={}, worker_pid=os.getpid()), terminated=True
    )
    assert 0 < c.pttl(name) <= 2000  # its own child: shortened to the grace


def test_a_private_server_whose_port_is_taken_before_it_binds_moves_to_a_free_one() -> None:
    """Parallel test processes pick ports too: a first start must neither fail nor talk to someone else's server."""
    import socket

    from celery_lockguard.testing import RedisServer

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        moved = RedisServer()
        moved.port = taken  # as if another process bound the port between free_port() and the server's bind
        other = RedisServer().start()
        fooled = RedisServer()
        fooled.port = other.port  # another process's server answers on the port picked
        try:
            moved.start()
            fooled.start()
            assert moved.port != taken and moved.client().ping()
            assert fooled.port != other.port
            assert int(fooled.client().info("server")["process_id"]) == fooled.proc.pid  # type: ignore[union-attr]
            port = moved.port
            moved.stop()
            moved.start()
            assert moved.port == port, "a restart keeps its port"
        finally:
            for srv in (moved, fooled, other):
                srv.stop()


def test_a_server_still_loading_its_dataset_follows_on_unavailable(prefix: str) -> None:
    """Pass: ACQUIRE answered ``LOADING`` (read by the lease channel's own reader) is an outage, not an error.

    fail_closed gives up visibly (``BackendUnavailable``, nothing run); fail_open runs the body and says so;
    once loading ends the same task takes its lease.
    """
    try:
        with loading_server() as (server, finish):
            app = make_app(server.url, prefix, lockguard_max_waits=0)
            ran: list[str] = []

            @task(app, lock_key="k:{a}")
            def closed(self: Any, a: int) -> None:
                ran.append("closed")

            @task(app, lock_key="k:{a}", on_unavailable="fail_open")
            def open_(self: Any, a: int) -> None:
                ran.append("open")

            with capture_logs() as logs:
                with pytest.raises(BackendUnavailable):
                    closed.apply(args=(1,), throw=True)
                open_.apply(args=(2,), throw=True).get()
            assert ran == ["open"]
            by: dict[str, Any] = {}
            for e in logs:  # the first of each: fail_open's give-back of its attempt logs a backend_unavailable too
                by.setdefault(e["event"], e)
            # "Redis is loading ..." or "Valkey is loading ...": the server names itself.
            loading_reason = by["lock.backend_unavailable"]["reason"]
            assert re.fullmatch(r"BusyLoadingError: (Redis|Valkey) is loading the dataset in memory", loading_reason)
            assert by["lock.backend_unavailable"]["policy"] == "fail_closed"
            assert by["lock.wait_budget_exhausted"]["reason"] == "backend_unavailable"
            assert by["lock.wait_budget_exhausted"]["policy"] == "fail_closed"
            assert by["lock.fail_open"]["reason"] == loading_reason and by["lock.fail_open"]["lock_key"] == "k:2"
            finish()
            closed.apply(args=(1,), throw=True).get()
            assert ran == ["open", "closed"] and not server.client().exists(lock_name(prefix, "k:1"))
    finally:
        conn_mod.forget_clients()
