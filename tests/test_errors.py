"""errors.classify: every kind by its meaning; real servers produce the replies wherever they can."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_lockguard import _connection as connection
from celery_lockguard import _errors as errors
from celery_lockguard import _lease as L
from celery_lockguard._keys import lock_name
from celery_lockguard.exceptions import ConfigurationError, CorruptFence
from celery_lockguard.testing import RedisServer, busy, free_port

from .harness import wait_for
from .loading import loading_server

P = "lg"


def reply(text: str) -> Exception:
    """The exception redis-py raises for this error reply (its own parser, as on the wire)."""
    exc: Exception = BaseParser.parse_error(text)
    return exc


def take(c: Any, key: str = "k", **kw: Any) -> Any:
    args: dict[str, Any] = {"ttl_ms": 5000, "task_id": "t1", "task_name": "n", "digest": "d", "worker": "w"}
    args["fence_ttl_ms"] = 60_000
    args.update(kw)
    return L.acquire(c, P, key, **args)


def refusal(fn: Any) -> BaseException:
    """The exception ``fn`` raises (it must raise)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the point is to look at it
        return exc
    raise AssertionError("expected the server to refuse")


def bare(server: RedisServer, **kw: Any) -> redis.Redis:
    """A client with no retries and a short timeout, like the library's own."""
    return server.client(**{"retry": Retry(NoBackoff(), 0), "socket_timeout": 2, **kw})


UNAVAILABLE_REPLIES = [
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "LOADING Redis is loading the dataset in memory",
    "NOREPLICAS Not enough good replicas to write.",
    "NOREPLICAS Not enough good replicas to write. script: 609d3a1a, on @user_script:1.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "CLUSTERDOWN The cluster is down",
    "READONLY You can't write against a read only replica.",
    # Redis 6 wraps the error of a command called inside a script
    "ERR Error running script (call to f_1f2e): @user_script:12: -NOREPLICAS Not enough good replicas to write.",
]

MISCONFIGURED_REPLIES = [
    "NOPERM this user has no permissions to run the 'evalsha' command",
    "ERR The user executing the script can't run this command or subcommand script: 88c9, on @user_script:1.",
    "CROSSSLOT Keys in request don't hash to the same slot",
    "WRONGPASS invalid username-password pair or user is disabled.",
    "NOAUTH Authentication required.",
    "NOSCRIPT No matching script. Please use EVAL.",
    "ERR unknown command 'evalsha', with args beginning with: ",
    "ERR unknown command 'SCRIPT', with args beginning with: 'LOAD' ",
    "LOCKGUARD_CORRUPT_FENCE lg:v1:{k}:fence abc",
]

BUG_REPLIES = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR syntax error",
    "BUSYGROUP Consumer Group name already exists",
    "ERR value is not an integer or out of range",
]


@pytest.mark.parametrize("text", UNAVAILABLE_REPLIES)
def test_transient_replies_are_unavailable(text: str) -> None:
    assert errors.classify(reply(text)) == "unavailable"


@pytest.mark.parametrize("text", MISCONFIGURED_REPLIES)
def test_replies_no_retry_can_fix_are_misconfigured(text: str) -> None:
    assert errors.classify(reply(text)) == "misconfigured"


@pytest.mark.parametrize("text", BUG_REPLIES)
def test_other_replies_are_bugs(text: str) -> None:
    assert errors.classify(reply(text)) is None


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (redis.exceptions.ConnectionError("reset"), "unavailable"),
        (redis.exceptions.TimeoutError("timed out"), "unavailable"),
        (redis.exceptions.BusyLoadingError("loading"), "unavailable"),
        (redis.exceptions.ReadOnlyError("ro"), "unavailable"),
        (redis.exceptions.OutOfMemoryError("oom"), "unavailable"),
        (redis.exceptions.ClusterDownError("down"), "unavailable"),
        (redis.exceptions.MasterDownError("down"), "unavailable"),
        (redis.exceptions.SlotNotCoveredError("slot 7"), "unavailable"),
        (redis.exceptions.TryAgainError("again"), "unavailable"),
        (ConnectionRefusedError(111, "refused"), "unavailable"),
        (OSError("network unreachable"), "unavailable"),
        (redis.exceptions.AuthenticationError("wrong"), "misconfigured"),  # a ConnectionError subclass
        (redis.exceptions.NoPermissionError("noperm"), "misconfigured"),
        (redis.exceptions.ClusterCrossSlotError("crossslot"), "misconfigured"),
        (redis.exceptions.NoScriptError("noscript"), "misconfigured"),
        (CorruptFence("lg:v1:{k}:fence", "inf"), "misconfigured"),
        (ConfigurationError("bad option"), "misconfigured"),
        (redis.exceptions.DataError("bad argument"), None),
        (ValueError("bug"), None),
        (KeyError("bug"), None),
    ],
)
def test_classes(exc: BaseException, kind: str | None) -> None:
    assert errors.classify(exc) == kind


def test_unavailable_errors_agree_with_classify() -> None:
    """``except UNAVAILABLE_ERRORS`` never catches something classify would not call an outage, by class."""
    assert connection.UNAVAILABLE_ERRORS is errors.UNAVAILABLE_ERRORS
    for cls in errors.UNAVAILABLE_ERRORS:
        assert errors.classify(cls("x")) == "unavailable", cls
    assert redis.exceptions.BusyLoadingError in errors.UNAVAILABLE_ERRORS or issubclass(
        redis.exceptions.BusyLoadingError, errors.UNAVAILABLE_ERRORS
    )


def test_configuration_error_names_task_operation_reply_and_fix() -> None:
    err = errors.configuration_error(reply(MISCONFIGURED_REPLIES[0]), "billing.charge", "ACQUIRE")
    assert isinstance(err, ConfigurationError)
    text = str(err)
    assert "billing.charge" in text and "ACQUIRE" in text and "NOPERM" in text and "celery_lockguard.acl" in text
    cross = str(errors.configuration_error(reply(MISCONFIGURED_REPLIES[2]), "t", "RELEASE"))
    assert "CROSSSLOT" in cross and "share a slot" in cross
    fence = str(errors.configuration_error(CorruptFence("lg:v1:{k}:fence", "inf"), None, "ACQUIRE"))
    assert "lg:v1:{k}:fence" in fence and "'inf'" in fence and "ACQUIRE" in fence
    already = ConfigurationError("x")
    assert errors.configuration_error(already, "t", "ACQUIRE") is already


# -- replies produced by real servers -----------------------------------------------------------


def test_busy_from_a_script_that_does_not_finish() -> None:
    with RedisServer(extra=["--busy-reply-threshold", "50"]) as server:
        c = bare(server)
        with busy(server):
            exc = refusal(lambda: take(c))
            assert str(exc).startswith("BUSY") and errors.classify(exc) == "unavailable"
        assert c.ping()


def test_noreplicas_writes_nothing() -> None:
    with RedisServer(extra=["--min-replicas-to-write", "1"]) as server:
        c = bare(server)
        exc = refusal(lambda: take(c))
        assert str(exc).startswith("NOREPLICAS") and errors.classify(exc) == "unavailable"
        assert not c.exists(lock_name(P, "k"))


def test_misconf_when_snapshots_fail() -> None:
    with RedisServer(extra=["--save", "3600 1"]) as server:
        c = bare(server)
        shutil.rmtree(server.dir)  # the server's working directory is gone: every snapshot fails
        c.set("x", "1")
        c.bgsave()
        wait_for(lambda: c.info("persistence")["rdb_last_bgsave_status"] == "err", 10, what="the snapshot to fail")
        exc = refusal(lambda: take(c))
        assert str(exc).startswith("MISCONF") and errors.classify(exc) == "unavailable"


def test_loading_while_the_dataset_loads() -> None:
    with loading_server(keys=2000) as (server, _):
        exc = refusal(lambda: bare(server).get("fill:1"))
        assert isinstance(exc, redis.exceptions.BusyLoadingError) and errors.classify(exc) == "unavailable"


def test_oom_under_noeviction() -> None:
    with RedisServer(extra=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as server:
        c = bare(server)
        seen: list[BaseException] = []

        def full() -> bool:
            try:
                c.set(f"fill:{len(seen)}:{c.dbsize()}", "x" * 20_000)
            except redis.exceptions.OutOfMemoryError as exc:
                seen.append(exc)
                return True
            return False

        wait_for(full, 20, interval=0, what="the server to be full")
        assert errors.classify(seen[0]) == "unavailable"


def test_readonly_replica() -> None:
    with RedisServer() as primary, RedisServer(extra=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        exc = refusal(lambda: take(bare(replica)))
        assert isinstance(exc, redis.exceptions.ReadOnlyError) and errors.classify(exc) == "unavailable"


def test_masterdown_on_a_replica_cut_off_from_its_primary() -> None:
    with RedisServer() as server:
        c = bare(server)
        c.config_set("replica-serve-stale-data", "no")
        c.replicaof("127.0.0.1", free_port())  # nobody listens there
        exc = refusal(lambda: take(c))
        # redis-py >= 6 raises MasterDownError, older versions a plain ResponseError: the reply decides.
        assert errors.reply_text(exc).startswith("MASTERDOWN") and errors.classify(exc) == "unavailable"


def test_connection_refused_and_timeout() -> None:
    nobody = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0), socket_connect_timeout=1)
    assert errors.classify(refusal(lambda: take(nobody))) == "unavailable"
    with RedisServer() as server:
        c = bare(server, socket_timeout=0.2)
        c.ping()
        server.pause()
        try:
            exc = refusal(lambda: take(c))
        finally:
            server.resume()
        assert isinstance(exc, redis.exceptions.TimeoutError) and errors.classify(exc) == "unavailable"


@pytest.fixture
def acl_users(r: redis.Redis, prefix: str) -> Iterator[list[str]]:
    """ACL user names under the test prefix, deleted afterwards from the shared server."""
    names: list[str] = []
    yield names
    if names:
        r.acl_deluser(*names)


def test_noperm_without_evalsha_and_inside_a_script(
    redis_url: str, r: redis.Redis, prefix: str, acl_users: list[str]
) -> None:
    no_evalsha, no_hset = f"{prefix}-noevalsha", f"{prefix}-nohset"
    acl_users += [no_evalsha, no_hset]
    r.execute_command("ACL", "SETUSER", no_evalsha, "on", ">pw", f"~{prefix}:*", "+@all", "-evalsha")
    r.execute_command("ACL", "SETUSER", no_hset, "on", ">pw", f"~{prefix}:*", "+@all", "-hset")

    def as_user(name: str) -> redis.Redis:
        return redis.Redis.from_url(redis_url, username=name, password="pw", decode_responses=True)

    denied = refusal(lambda: L.acquire(as_user(no_evalsha), prefix, "k", **_ARGS))
    assert isinstance(denied, redis.exceptions.NoPermissionError) and errors.classify(denied) == "misconfigured"
    assert "celery_lockguard.acl" in str(errors.configuration_error(denied, "t", "ACQUIRE"))
    inside = refusal(lambda: L.acquire(as_user(no_hset), prefix, "k", **_ARGS))
    assert errors.classify(inside) == "misconfigured", inside
    assert "celery_lockguard.acl" in str(errors.configuration_error(inside, "t", "ACQUIRE"))


_ARGS: dict[str, Any] = {
    "ttl_ms": 5000,
    "task_id": "t1",
    "task_name": "n",
    "digest": "d",
    "worker": "w",
    "fence_ttl_ms": 60_000,
}


def test_wrong_password_and_no_auth(redis_url: str, prefix: str) -> None:
    stranger = redis.Redis.from_url(redis_url, username=f"{prefix}-nobody", password="x", retry=Retry(NoBackoff(), 0))
    wrongpass = refusal(stranger.ping)
    assert isinstance(wrongpass, redis.exceptions.AuthenticationError)
    assert errors.classify(wrongpass) == "misconfigured"  # though an AuthenticationError is a ConnectionError
    with RedisServer() as server:
        server.client().config_set("requirepass", "s3cret")  # new connections must now authenticate
        noauth = refusal(lambda: take(bare(server)))
        # NOAUTH (redis-py >= 6), or the server closing the unauthenticated request (older redis-py).
        assert errors.classify(noauth) == "misconfigured", noauth
        assert "lockguard_redis_url" in str(errors.configuration_error(noauth, "t", "ACQUIRE"))


def test_scripting_disabled_is_misconfigured() -> None:
    with RedisServer(extra=["--rename-command", "EVALSHA", '""']) as server:
        exc = refusal(lambda: take(bare(server)))
        assert "unknown command" in str(exc) and errors.classify(exc) == "misconfigured"
        assert "scripting" in str(errors.configuration_error(exc, "t", "ACQUIRE"))


def test_postgresql_outage_is_unavailable_and_a_bad_query_is_not(postgres_url: str) -> None:
    import psycopg

    down = refusal(lambda: psycopg.connect(f"postgresql://postgres@127.0.0.1:{free_port()}/test", connect_timeout=2))
    assert isinstance(down, psycopg.OperationalError) and errors.classify(down) == "unavailable"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        bad = refusal(lambda: conn.execute("SELEC 1"))
        assert errors.classify(bad) is None
        terminated = refusal(lambda: conn.execute("SELECT pg_terminate_backend(pg_backend_pid())"))
        assert isinstance(terminated, psycopg.OperationalError) and errors.classify(terminated) == "unavailable"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (
            'Command # 1 (HSET k:cp charge {"value":22}) of pipeline caused error: NOREPLICAS Not enough good replicas',
            "unavailable",
        ),
        ("Command # 2 (PEXPIRE k 5) of pipeline caused error: BUSY Redis is busy running a script.", "unavailable"),
        ("Transaction discarded because of: BUSY Redis is busy running a script.", "unavailable"),
        ("Command # 1 (HSET k f v) of pipeline caused error: NOPERM User has no permissions", "misconfigured"),
        ("Command # 1 (HSET k f v) of pipeline caused error: WRONGTYPE Operation against a key", None),
    ],
)
def test_replies_wrapped_by_a_pipeline_are_classified_by_the_reply_inside(text: str, kind: str | None) -> None:
    assert errors.classify(redis.exceptions.ResponseError(text)) == kind


def test_a_refused_write_inside_a_transaction_is_unavailable() -> None:
    with RedisServer(extra=["--min-replicas-to-write", "1"]) as server:
        pipe = bare(server).pipeline(transaction=True)
        pipe.hset("h", "f", "v")
        pipe.pexpire("h", 1000)
        exc = refusal(pipe.execute)
        assert errors.classify(exc) == "unavailable", exc
