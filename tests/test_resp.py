"""The channel's reply reader (``_resp``) against a real server: what redis-py's own reader returns, byte for byte.

Each case sends one command on a connection of its own and reads the reply with
:class:`Reader`; the same command read by redis-py's parser on a twin connection
must give the same value (or the same exception class and text).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.exceptions import BusyLoadingError, ConnectionError, NoScriptError, ResponseError, TimeoutError

from celery_lockguard import _resp
from celery_lockguard._resp import Reader

from .loading import loading_server


def connection(url: str, protocol: int, decode: bool = True, **kw: Any) -> Any:
    pool = redis.ConnectionPool.from_url(url, protocol=protocol, decode_responses=decode, **kw)
    conn = pool.get_connection()
    conn.connect()
    return conn


def ours(conn: Any, *command: Any) -> Any:
    conn.send_command(*command)
    return Reader(conn).read(conn)


def theirs(conn: Any, *command: Any) -> Any:
    conn.send_command(*command)
    try:
        return conn.read_response()
    except ResponseError as exc:
        return exc


def same(a: Any, b: Any) -> bool:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a) is type(b) and str(a) == str(b)
    return bool(a == b) and type(a) is type(b)


SCRIPT_REPLIES = [
    "return {'ok', 42}",
    "return {'held', 'id', '', 'n', 7, {'nested', {1, 2}}}",
    "return nil",
    "return false",
    "return true",
    "return 'plain'",
    "return {}",
    "return redis.status_reply('FINE')",
    "return redis.error_reply('LOCKGUARD_CORRUPT_FENCE k v')",
    "return 3.9",  # Lua numbers reach the client as integers
    "return 'ünïcode ✓'",
    "return {1, nil, 3}",  # a Lua array stops at its first nil
]


@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("source", SCRIPT_REPLIES)
def test_script_replies_read_as_redis_py_reads_them(redis_url: str, protocol: int, decode: bool, source: str) -> None:
    mine, twin = connection(redis_url, protocol, decode), connection(redis_url, protocol, decode)
    try:
        assert same(ours(mine, "EVAL", source, 0), theirs(twin, "EVAL", source, 0))
    finally:
        mine.disconnect()
        twin.disconnect()


@pytest.mark.parametrize("protocol", [2, 3])
def test_other_reply_types_and_error_classes(redis_url: str, prefix: str, protocol: int) -> None:
    mine, twin = connection(redis_url, protocol), connection(redis_url, protocol)
    r = redis.Redis.from_url(redis_url)
    r.set(f"{prefix}:s", "v")
    r.hset(f"{prefix}:h", mapping={"a": "1", "b": "2"})
    r.sadd(f"{prefix}:set", "x")
    r.zadd(f"{prefix}:z", {"m": 1.5})
    commands: list[tuple[Any, ...]] = [
        ("HGETALL", f"{prefix}:h"),  # a map in RESP3
        ("SMEMBERS", f"{prefix}:set"),  # a set in RESP3
        ("GET", f"{prefix}:missing"),  # null
        ("ZSCORE", f"{prefix}:z", "m"),  # a double in RESP3
        ("PING",),
        ("EVALSHA", "0" * 40, 0),  # NOSCRIPT: the class the channel retries on
        ("HGET", f"{prefix}:s", "a"),  # WRONGTYPE
        ("NOSUCHCOMMAND",),
    ]
    try:
        for command in commands:
            a, b = ours(mine, *command), theirs(twin, *command)
            assert same(a, b), (command, a, b)
        assert isinstance(ours(mine, "EVALSHA", "0" * 40, 0), NoScriptError)
    finally:
        mine.disconnect()
        twin.disconnect()


def test_a_reply_split_over_many_recvs_and_replies_sharing_one(redis_url: str, prefix: str) -> None:
    conn = connection(redis_url, 2)
    big = "x" * (3 * _resp.READ_SIZE + 17)  # several recv calls for one bulk string
    redis.Redis.from_url(redis_url).set(f"{prefix}:big", big)
    reader = Reader(conn)
    try:
        conn.send_packed_command(
            conn.pack_commands([("GET", f"{prefix}:big"), ("PING",), ("EVAL", "return {1, {2, 'three'}}", 0)])
        )
        assert reader.read(conn) == big
        assert reader.read(conn) == "PONG"  # already in the buffer the big reply was read with
        assert reader.read(conn) == [1, [2, "three"]]
    finally:
        conn.disconnect()


def test_a_reply_that_arrives_in_pieces(redis_url: str) -> None:
    """Bytes trickling in one by one: each short parse waits for more, none is lost or read twice."""
    conn = connection(redis_url, 2)
    reader = Reader(conn)
    real = conn._sock

    class Trickle:
        def recv(self, n: int) -> bytes:
            return real.recv(1)

    conn._sock = Trickle()
    try:
        conn._sock.sendall = real.sendall  # type: ignore[attr-defined]
        real.sendall(b"*1\r\n$4\r\nPING\r\n*3\r\n$4\r\nEVAL\r\n$22\r\nreturn {'ok', 'fence'}\r\n$1\r\n0\r\n")
        assert reader.read(conn) == "PONG"
        assert reader.read(conn) == ["ok", "fence"]
    finally:
        conn._sock = real
        conn.disconnect()


def test_a_timeout_and_a_closed_connection_raise_redis_pys_exceptions(redis_url: str, prefix: str) -> None:
    conn = connection(redis_url, 2, socket_timeout=0.2)
    try:
        conn.send_command("BLPOP", f"{prefix}:never", 5)
        with pytest.raises(TimeoutError, match="Timeout reading from"):
            Reader(conn).read(conn)
    finally:
        conn.disconnect()
    conn = connection(redis_url, 2)
    name = f"{prefix}-victim"
    conn.send_command("CLIENT", "SETNAME", name)
    reader = Reader(conn)
    assert reader.read(conn) == "OK"
    _kill_by_name(redis_url, name)
    with pytest.raises(ConnectionError):
        reader.read(conn)
    conn.disconnect()


def _kill_by_name(url: str, name: str) -> None:
    admin = redis.Redis.from_url(url, decode_responses=True)
    ids = [c["id"] for c in admin.client_list() if c.get("name") == name]
    assert ids, "the test's connection is not listed"
    for client_id in ids:
        admin.execute_command("CLIENT", "KILL", "ID", client_id)


def test_a_new_socket_starts_with_an_empty_buffer(redis_url: str) -> None:
    """Bytes left from a dead connection never answer for the next one."""
    conn = connection(redis_url, 2)
    reader = Reader(conn)
    conn.send_packed_command(conn.pack_commands([("PING",), ("ECHO", "stale")]))
    assert reader.read(conn) == "PONG"  # 'stale' may now sit in the reader's buffer
    conn.disconnect()
    conn.connect()
    conn.send_command("ECHO", "fresh")
    assert reader.read(conn) == "fresh"
    conn.disconnect()
    with pytest.raises(ConnectionError):
        reader.read(conn)  # not connected: nothing to read


def test_a_resp3_push_frame_before_a_reply_is_skipped(redis_url: str, prefix: str) -> None:
    """Out-of-band data (here a client-side-caching invalidation) is not a reply: the next reply is read."""
    conn = connection(redis_url, 3)
    reader = Reader(conn)
    key = f"{prefix}:tracked"
    try:
        conn.send_command("CLIENT", "TRACKING", "ON")
        assert reader.read(conn) == "OK"
        conn.send_command("GET", key)
        assert reader.read(conn) is None
        redis.Redis.from_url(redis_url).set(key, "changed")  # the server pushes an invalidation to conn
        conn.send_command("ECHO", "after the push")
        assert reader.read(conn) == "after the push"
    finally:
        conn.disconnect()


@pytest.mark.parametrize("protocol", [2, 3])
def test_loading_reads_as_redis_pys_busy_loading_error(protocol: int) -> None:
    """``LOADING`` is redis-py's ``BusyLoadingError`` (a ``ConnectionError``: ``_wire`` then drops the connection)."""
    with loading_server(keys=2000) as (server, _):
        mine, twin = connection(server.url, protocol), connection(server.url, protocol)
        try:
            with pytest.raises(BusyLoadingError) as got:
                ours(mine, "EVAL", "return 1", 0)
            with pytest.raises(BusyLoadingError) as expected:
                twin.send_command("EVAL", "return 1", 0)
                twin.read_response()
            assert str(got.value) == str(expected.value)
        finally:
            mine.disconnect()
            twin.disconnect()
