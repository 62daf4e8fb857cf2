"""Least privilege and TLS: the whole lifecycle as an ACL user granted only ``celery_lockguard.acl``'s list.

The user may touch only ``~<prefix>:*`` and run only the listed commands; the
server's ACL LOG must stay empty of that user's denials, so a command the
library swallows an error for (CLIENT SETINFO, CONFIG GET) is caught too.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockContended, LockedTask, LockThrottled, acl
from celery_lockguard import _connection as connection
from celery_lockguard import _doctor as doctor
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard import _stats as stats
from celery_lockguard._completion_readers import show_redis
from celery_lockguard._config import settings
from celery_lockguard._holders import read_leases
from celery_lockguard._keys import checkpoint_name, done_name, lock_name
from celery_lockguard.testing import RedisServer, free_port

from .harness import wait_for

PREFIX = "acl"


def create_user(server: RedisServer) -> None:
    """The ``lg`` user, from :func:`acl.rule` (without CLIENT SETINFO on servers older than 7.2)."""
    admin = server.client()
    try:
        admin.execute_command("ACL", "SETUSER", "lg", *acl.rule(PREFIX).split(), ">s3cret")
    except redis.exceptions.ResponseError as exc:
        assert "client|setinfo" in str(exc)
        admin.execute_command("ACL", "SETUSER", "lg", *acl.rule(PREFIX, setinfo=False).split(), ">s3cret")


@pytest.fixture
def acl_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        create_user(server)
        yield server
    connection.forget_clients()


def denials(server: RedisServer) -> list[dict[str, Any]]:
    return [e for e in server.client().acl_log() if e.get("username") == "lg"]


def lifecycle(app: Celery, admin: redis.Redis) -> None:
    """Acquire, renew, checkpoint, record, skip, contend, claim modes, NOSCRIPT, metrics, CLI reads."""
    ran: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="acl.charge", lock_key="inv:{n}", lock_ttl=0.6)
    def charge(self: Any, n: int) -> int:
        ran.append(n)
        first = self.checkpoint("step", lambda: n * 10)
        before = admin.hget(lock_name(PREFIX, f"inv:{n}"), "renewed_at")
        wait_for(lambda: admin.hget(lock_name(PREFIX, f"inv:{n}"), "renewed_at") != before, 5, what="a renewal")
        return int(first)

    assert charge.apply(args=(1,), task_id="t-1").get() == 10
    assert charge.apply(args=(1,), task_id="t-1").get() == 10  # recorded: skipped
    assert ran == [1]
    assert admin.get(done_name(PREFIX, "task:t-1")) is not None
    assert admin.exists(checkpoint_name(PREFIX, "task:t-1"))

    @app.task(base=LockedTask, bind=True, shared=False, name="acl.raise", lock_key="inv:{n}", on_locked="raise")
    def contended(self: Any, n: int) -> int:
        return n

    held = L.acquire(
        admin, PREFIX, "inv:2", ttl_ms=10_000, task_id="x", task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(held, L.Lease)
    with pytest.raises(LockContended):
        contended.apply(args=(2,)).get()

    @app.task(base=LockedTask, bind=True, shared=False, name="acl.repl", lock_key="r:{n}", lock_replicas=1)
    def replicated(self: Any, n: int) -> int:
        return int(self.lock.replicas)

    assert replicated.apply(args=(1,)).get() == 0  # WAIT allowed; no replica here

    client = connection.client(settings(app))  # queue-time claims: CLAIM and RELEASE_CLAIM scripts
    got = L.claim(
        client, f"{PREFIX}:v1:{{q:1}}:lock", token="tok", ttl_ms=5000, task_id="c1", task_name="n", digest="d"
    )
    assert got.kind == "ok"
    assert L.release_claim(client, f"{PREFIX}:v1:{{q:1}}:lock", "c1")

    @app.task(base=LockedTask, shared=False, name="acl.reindex", lock_key="doc:{n}", lock_debounce=30)
    def reindex(n: int, v: int) -> int:
        return v

    # Debounce: DEBOUNCE_PUBLISH and DEBOUNCE_SETTLE at publish (the memory broker delivers nothing),
    # DEBOUNCE_TAKE at delivery, and the records `lockguard locks` lists.
    from celery_lockguard import _debounce as debounce
    from celery_lockguard._debounce import read_debounce

    first, last = reindex.delay(1, 0), reindex.delay(1, 1)
    s, opts = settings(app), reindex.lockguard_options
    assert debounce.take(client, s, opts, "doc:1", "acl.reindex", first.id, first.id) == ("superseded", last.id)
    assert [row.pending_task_id for row in read_debounce(client, PREFIX)] == [last.id]

    admin.script_flush()  # NOSCRIPT: the user reloads with SCRIPT LOAD
    assert charge.apply(args=(3,)).get() == 30

    metrics.count("acl.charge", "lock.acquired", 3)
    assert metrics.flush(client, PREFIX) > 0
    assert stats.read(client, PREFIX)["total"]
    rows = [lease.as_dict() for lease in read_leases(client, PREFIX)]
    assert [r["key"] for r in rows] == ["inv:2"]  # debounce records are no lease rows
    assert L.force_release(client, PREFIX, "inv:2", 60_000)[0]
    shown = show_redis(client, PREFIX, "task:t-1")
    assert shown is not None and shown["record"]["result"] == 10
    assert client.delete(done_name(PREFIX, "task:t-1"), checkpoint_name(PREFIX, "task:t-1")) == 2
    findings = doctor.run(app)
    assert not [f for f in findings if f.code in ("redis_unreachable", "configuration")], findings


def test_full_lifecycle_as_a_least_privilege_acl_user(acl_server: RedisServer) -> None:
    app = Celery("acltest", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = f"redis://lg:s3cret@127.0.0.1:{acl_server.port}/0"
    app.conf.lockguard_key_prefix = PREFIX
    admin = acl_server.client()
    lifecycle(app, admin)
    assert denials(acl_server) == []
    # The user really is confined: a key outside the prefix, and a command off the list, are refused.
    user = redis.Redis.from_url(app.conf.lockguard_redis_url, decode_responses=True)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.execute_command("FLUSHALL")
    assert len(denials(acl_server)) == 2


def test_rule_lists_each_command_once_and_only_the_prefix() -> None:
    r = acl.rule("lgp", cluster=True).split()
    assert r[:5] == ["on", "resetkeys", "~lgp:*", "resetchannels", "-@all"]
    grants = [x for x in r if x.startswith("+")]
    assert len(grants) == len(set(grants)) and "+evalsha" in grants and "+cluster|slots" in grants
    assert "+scan" not in acl.rule("lgp", cli=False).split() and "+scan" in r


def test_every_command_a_script_calls_is_granted_to_a_worker() -> None:
    # ACQUIRE_SLOTS (lock_rate) calls ZCARD and ZRANGE: missing from the grants, a rate task as the
    # worker user was refused every ACQUIRE (NOPERM, raised as a ConfigurationError).
    import inspect
    import re

    from celery_lockguard import _cluster, _scripts

    called = set()
    for module in (_scripts, _cluster):
        called |= {c.lower() for c in re.findall(r"redis\.p?call\('([A-Za-z]+)'", inspect.getsource(module))}
    assert {"zcard", "zrange", "hmget"} <= called  # the scan found the scripts
    assert called - set(acl.commands(cli=False, cluster=True)) == set()


def test_locks_reads_a_rate_window_as_the_cli_acl_user(acl_server: RedisServer) -> None:
    # ``locks`` counts the window's starts with ZCOUNT: refused, the count was left out (starts None)
    # without a word, and the ACL log filled with denials.
    from celery_lockguard._holders import entity_use

    admin = acl_server.client()
    got = L.acquire(
        admin, PREFIX, "p:1", ttl_ms=10_000, task_id="t", task_name="n", digest="d", worker="w",
        fence_ttl_ms=60_000, limit=2, rate=(5, 60_000),
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    user = redis.Redis(port=acl_server.port, username="lg", password="s3cret", decode_responses=True)
    (use,) = entity_use(user, PREFIX, read_leases(user, PREFIX))
    assert (use.held, use.limit, use.starts, use.rate) == (1, 2, 1, 5)
    assert denials(acl_server) == []


def test_limited_and_rated_task_as_the_worker_acl_user() -> None:
    """lock_limit + lock_rate through the real tracer as a user granted only the workers' list."""
    with RedisServer() as server:
        admin = server.client()
        try:
            admin.execute_command("ACL", "SETUSER", "lg", *acl.rule(PREFIX, cli=False).split(), ">s3cret")
        except redis.exceptions.ResponseError as exc:
            assert "client|setinfo" in str(exc)
            admin.execute_command(
                "ACL", "SETUSER", "lg", *acl.rule(PREFIX, cli=False, setinfo=False).split(), ">s3cret"
            )
        app = Celery("acllimits", broker="memory://", set_as_current=False)
        app.conf.lockguard_redis_url = f"redis://lg:s3cret@127.0.0.1:{server.port}/0"
        app.conf.lockguard_key_prefix = PREFIX

        @app.task(
            base=LockedTask,
            bind=True,
            shared=False,
            name="acl.push",
            lock_key="p:{n}",
            lock_limit=2,
            lock_rate="1/m",
            on_locked="raise",
        )
        def push(self: Any, n: int) -> int:
            return int(self.lock.slot)

        try:
            assert push.apply(args=(1,)).get() == 0
            with pytest.raises(LockThrottled):  # the window is read as this user too
                push.apply(args=(1,)).get()
            assert denials(server) == []
        finally:
            connection.forget_clients()


@pytest.mark.parametrize("prefix", ["*", "lg*", "a?", "[a]", "", "a b"])
def test_rule_refuses_a_prefix_that_would_widen_the_key_pattern(prefix: str) -> None:
    # rule("*") granted ~*:*: every key on the server.
    from celery_lockguard import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"acl\.rule prefix"):
        acl.rule(prefix)


def tls_server(tmp: Path) -> RedisServer | None:
    """A private server with a TLS port and a fresh self-signed certificate, or None if TLS is unavailable."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    made = subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        capture_output=True,
        timeout=60,
    )
    if made.returncode != 0:
        return None
    tls_port = free_port()
    server = RedisServer(
        extra=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ]
    )
    try:
        server.start()
    except RuntimeError:
        server.close()
        return None  # built without TLS
    server.tls_port = tls_port  # type: ignore[attr-defined]
    return server


def test_rediss_lifecycle_as_the_acl_user_over_tls(tmp_path: Path) -> None:
    server = tls_server(tmp_path)
    if server is None:
        pytest.skip("this redis-server has no TLS support or openssl is missing")
    try:
        create_user(server)
        app = Celery("tlstest", broker="memory://", set_as_current=False)
        cert = tmp_path / "cert.pem"
        app.conf.lockguard_redis_url = (
            f"rediss://lg:s3cret@127.0.0.1:{server.tls_port}/0"  # type: ignore[attr-defined]
            f"?ssl_cert_reqs=required&ssl_ca_certs={cert}"
        )
        app.conf.lockguard_key_prefix = PREFIX
        client = connection.client(settings(app))
        assert client.connection_pool.connection_class.__name__ == "SSLConnection"
        lifecycle(app, server.client())
        assert denials(server) == []
        # The certificate is checked: a client that trusts nothing is refused.
        bad = redis.Redis.from_url(
            f"rediss://lg:s3cret@127.0.0.1:{server.tls_port}/0?ssl_cert_reqs=required",  # type: ignore[attr-defined]
            socket_timeout=2,
        )
        with pytest.raises(redis.exceptions.ConnectionError):
            bad.ping()
    finally:
        connection.forget_clients()
        server.close()
