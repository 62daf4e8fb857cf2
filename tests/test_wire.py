"""The lease channel (``_wire``): packing, replies read late and in order, NOSCRIPT, lost links, threads, fork."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _wire as wire
from celery_lockguard._keys import done_name, lock_name
from celery_lockguard._renewer import renewer
from celery_lockguard.testing import RedisServer, settle, wait_for

from .tracer import HOSTNAME, make_app

P = "lgw"


def take(c: Any, key: str = "k", ttl_ms: int = 5000, **kw: Any) -> Any:
    args = {"task_id": "t1", "task_name": "n", "digest": "d", "worker": "w@h", "fence_ttl_ms": 60_000}
    args.update(kw)
    return L.acquire(c, P, key, ttl_ms=ttl_ms, **args)


class Replies:
    """A deferred command's callback: records what it was handed, and on which thread."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.threads: list[str] = []

    def __call__(self, reply: Any) -> None:
        self.got.append(reply)
        self.threads.append(threading.current_thread().name)


def warm(c: Any) -> Any:
    """Run ACQUIRE and RELEASE once on ``c``'s channel: the server has them cached, so RELEASE may be deferred."""
    L.release(c, take(c, "warm-up"), P)
    return c


@pytest.fixture(autouse=True)
def defer_near(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about deferred replies: defer them on a server on this host too (``DEFER_NEAR``)."""
    monkeypatch.setattr(wire, "DEFER_NEAR", True)


@pytest.fixture
def c(own_redis: RedisServer) -> Any:
    return warm(own_redis.client())


def release_later(c: Any, lease: L.Lease, replies: Replies, scope: str | None = None) -> None:
    assert L.release_later(c, lease, P, replies, scope, '{"r":1}' if scope else "", 60_000 if scope else 0)


def test_packing_matches_redis_py() -> None:
    keys, args = ["a:{k}", "ü"], ["tok", 30000, "", b"raw", -1]
    ours = wire.pack_evalsha(scripts.acquire.sha_bytes, keys, args)
    theirs = b"".join(redis.Connection().pack_command("EVALSHA", scripts.acquire.sha, len(keys), *keys, *args))
    assert ours == theirs
    with pytest.raises(TypeError, match="float"):
        wire.pack_evalsha(scripts.acquire.sha_bytes, [], [1.5])


def test_a_plain_client_gets_one_channel_per_thread_and_others_get_none(c: Any, own_redis: RedisServer) -> None:
    mine = wire.channel(c)
    assert mine is not None and wire.channel(c) is mine
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(wire.channel(c)))
    thread.start()
    thread.join()
    assert seen[0] is not None and seen[0] is not mine

    class OtherPool(redis.ConnectionPool):
        pass

    assert wire.channel(redis.Redis(connection_pool=OtherPool(port=own_redis.port))) is None


def test_a_client_of_another_kind_under_a_collected_clients_id_gets_none(c: Any) -> None:
    """``id`` is reused once a client is collected: a client with no ``connection_pool`` (Cluster) found
    under a plain client's channel is served by redis-py, not failed with an AttributeError (CI, test_cluster)."""

    class PoolLess:
        pass

    mine = wire.channel(c)
    assert mine is not None
    other = PoolLess()
    wire._local.channels[id(other)] = mine  # what a collected client's id, reused, leaves behind
    assert wire.channel(other) is None


def test_a_deferred_release_frees_the_lease_at_once_and_its_reply_comes_with_the_next_call(
    c: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "DRAIN_DELAY", 60.0)  # keep the renewer's drain out of this test's window
    lease = take(c)
    replies = Replies()
    release_later(c, lease, replies, scope="s1")
    ch = wire.channel(c)
    assert ch is not None and ch.pending == 1 and lease.released
    other = redis.Redis(port=c.connection_pool.connection_kwargs["port"], decode_responses=True)
    # On the server already (RELEASE went out before the check did); the reply is not read yet.
    assert not other.exists(lock_name(P, "k")) and other.exists(done_name(P, "s1"))
    assert replies.got == []
    again = take(c)  # the same entity, right after the release on the same connection: free
    assert isinstance(again, L.Lease)
    assert replies.got == [(1, 1, None)] and ch.pending == 0


def test_a_script_not_yet_seen_on_the_connection_runs_synchronously(c: Any) -> None:
    """The first RELEASE on a fresh server would answer NOSCRIPT: deferred, the lease would stay held until read."""
    c.script_flush()
    lease = take(c)
    ch = wire.channel(c)
    assert ch is not None
    ch._loaded.discard(scripts.release.sha_bytes)
    replies = Replies()
    release_later(c, lease, replies)
    assert replies.got == [(1, 0, None)] and ch.pending == 0  # answered at once
    lease2 = take(c)
    release_later(c, lease2, Replies())
    assert ch.deferred >= 1  # now known to the server: deferred


def test_an_idle_channel_is_drained_by_the_renewer_within_the_delay(c: Any) -> None:
    lease = take(c)
    replies = Replies()
    release_later(c, lease, replies)
    wait_for(lambda: replies.got, 1.0, interval=0.005, what="the renewer to read the deferred reply")
    assert replies.got == [(1, 0, None)] and replies.threads == ["lockguard-replies"]  # not on the renewer
    assert renewer()._drain_at == float("inf")  # nothing left to drain: the thread sleeps again


def test_replies_are_read_in_order_and_error_replies_keep_the_stream_in_step(c: Any) -> None:
    first, second = take(c, "a"), take(c, "b")
    c.delete(lock_name(P, "b"))
    c.set(lock_name(P, "b"), "a string, not a lease hash")  # RELEASE's HGET answers WRONGTYPE
    one, two = Replies(), Replies()
    ch = wire.channel(c)
    assert ch is not None
    with ch._lock:  # keep the renewer out: the next call must read both, in order
        for lease, replies in [(first, one), (second, two)]:
            sent = wire._Sent(scripts.release, [lease.redis_key], [lease.token, "", 0], replies)
            ch._send(ch._connection(), sent, [])
    assert isinstance(take(c, "c"), L.Lease)  # its own reply, after both deferred ones
    assert one.got == [[1, 0]]
    assert len(two.got) == 1 and isinstance(two.got[0], redis.ResponseError) and "WRONGTYPE" in str(two.got[0])
    assert ch.pending == 0 and c.ping()


def test_noscript_on_a_deferred_reply_reloads_and_runs_it_again_in_order(c: Any, own_redis: RedisServer) -> None:
    lease = take(c)
    c.script_flush()  # a restart or SCRIPT FLUSH between acquire and release
    replies = Replies()
    ch = wire.channel(c)
    assert ch is not None
    with ch._lock:
        ch._send(ch._connection(), wire._Sent(scripts.release, [lease.redis_key], [lease.token, "", 0], replies), [])
    again = take(c)  # NOSCRIPT for both: loaded, then RELEASE and ACQUIRE run again, in that order
    assert isinstance(again, L.Lease)
    assert replies.got == [[1, 0]]
    assert c.hget(lock_name(P, "k"), "token") == again.token


def test_a_lost_link_fails_the_replies_in_flight_and_the_next_call_reconnects(own_redis: RedisServer) -> None:
    c = warm(own_redis.client())
    lease = take(c)
    ch = wire.channel(c)
    assert ch is not None
    replies = Replies()
    with ch._lock:
        ch._send(ch._connection(), wire._Sent(scripts.release, [lease.redis_key], [lease.token, "", 0], replies), [])
        own_redis.stop()  # the reply may or may not have been written: either way the stream ends
    own_redis.start()
    # The next command goes out on the old link behind the pending reply: the dead link fails both (the
    # pending one may have arrived first), and the command after that reconnects.
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        take(c)
    assert len(replies.got) == 1
    assert isinstance(replies.got[0], (redis.ConnectionError, redis.TimeoutError)) or replies.got[0] == [1, 0]
    assert isinstance(take(c), L.Lease)  # reconnected (the restarted server has no lease)


def test_an_idle_connection_the_server_closed_is_replaced_before_the_next_command(own_redis: RedisServer) -> None:
    c = own_redis.client()
    take(c)
    own_redis.stop()
    own_redis.start()
    assert isinstance(take(c), L.Lease)  # no error: the stale link is seen at checkout, as the pool does


def test_a_forked_child_gets_its_own_channel(c: Any) -> None:
    parent = wire.channel(c)
    lease = take(c)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = False
        try:
            child = wire.channel(c)
            ok = child is not None and child is not parent and isinstance(take(c, "child"), L.Lease)
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    assert L.release(c, lease, P) == (1, 0)  # the parent's link is intact


@pytest.mark.parametrize(
    ("kwargs", "near"),
    [
        ({"path": "/run/redis.sock"}, True),
        ({"host": "127.0.0.1"}, True),
        ({"host": "127.0.1.1"}, True),
        ({"host": "::1"}, True),
        ({"host": "[::1]"}, True),
        ({"host": "localhost"}, True),
        ({"host": "0.0.0.0"}, True),
        ({"host": "::ffff:127.0.0.1"}, True),
        ({"host": "localhost."}, True),
        ({"host": "10.0.0.5"}, False),
        ({"host": "redis.internal"}, False),  # a name may resolve anywhere: taken to be another host
        ({}, True),  # redis-py's default host: localhost
    ],
)
def test_a_server_on_this_host_is_told_by_its_address(kwargs: dict[str, Any], near: bool) -> None:
    assert wire.on_this_host(kwargs) is near


def test_release_to_a_server_on_this_host_is_waited_for(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DEFER_NEAR (the default), release_later declines for a local server; other calls still defer."""
    monkeypatch.setattr(wire, "DEFER_NEAR", False)
    monkeypatch.setattr(wire, "DRAIN_DELAY", 60.0)  # a reply left in flight stays unread in this test
    ch = wire.channel(c)
    assert ch is not None and ch.near and not ch.defers_release
    lease = take(c)
    # Nothing sent: the caller releases and waits (release_and_wake), as for Sentinel.
    assert not L.release_later(c, lease, P, Replies()) and not lease.released and ch.pending == 0
    assert c.exists(lock_name(P, "k"))
    assert L.release_and_wake(c, lease, P)[0] == 1 and not c.exists(lock_name(P, "k"))
    # The publish side's deferred calls (CONFIRM_CLAIM, DEBOUNCE_SETTLE) stay deferred on this host too.
    L.confirm_claim(c, f"{P}:claim-near", "tok", 60_000, Replies())  # its first call loads the script, waited
    replies = Replies()
    L.confirm_claim(c, f"{P}:claim-near", "tok", 60_000, replies)
    assert ch.pending == 1 and replies.got == []
    assert settle() >= 1 and replies.got == [False]  # no such claim: read later


@pytest.mark.parametrize("defer", [True, False], ids=["server-elsewhere", "server-on-this-host"])
def test_a_locked_delivery_frees_the_lease_when_it_returns_and_reports_the_release_once(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, defer: bool
) -> None:
    """Through Celery's real tracer: the lease is free when the tracer returns. Deferred (a server elsewhere),
    lock.released comes with settle(); waited for (a server on this host, the default), before the tracer returns."""
    from celery.app.trace import build_tracer
    from structlog.testing import capture_logs

    monkeypatch.setattr(wire, "DEFER_NEAR", defer)  # the test's Redis is on this host
    monkeypatch.setattr(wire, "DRAIN_DELAY", 60.0)  # keep the renewer's drain out of this test's window
    app: Celery = make_app("wire", redis_url, prefix, lockguard_redis_url=redis_url)

    @app.task(base=LockedTask, bind=True, name="w.t", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    c = redis.Redis.from_url(redis_url, decode_responses=True)
    t.apply((0,))  # ACQUIRE and RELEASE cached on the server and known to this thread's channel
    request = {"id": "wire-1", "task": t.name, "args": [3], "kwargs": {}, "hostname": HOSTNAME, "is_eager": False}
    tracer = build_tracer(t.name, t, app=app, eager=False, propagate=False)
    with capture_logs() as logs:
        assert tracer("wire-1", [3], {}, request)[0] == 3
        assert not c.exists(lock_name(prefix, "k:3")) and c.exists(done_name(prefix, "task:wire-1"))
        before = [e for e in logs if e["event"] == "lock.released"]
        read = settle()
    released = [e for e in logs if e["event"] == "lock.released"]
    assert len(released) == 1 and released[0]["task_id"] == "wire-1"
    if defer:
        assert before == [] and read >= 1
    else:
        assert before == released and read == 0  # nothing was left in flight


def test_tokens_are_unique_per_lease_and_never_repeat_across_fork() -> None:
    """Owner tokens come from a per-process generator: a forked child must not repeat its parent's sequence."""
    tokens = {L.new_token() for _ in range(20_000)}
    assert len(tokens) == 20_000 and all(len(t) == 32 for t in tokens)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, L.new_token().encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    assert len(child) == 32 and child != L.new_token() and child not in tokens


def test_a_callback_that_blocks_never_holds_up_renewal(c: Any) -> None:
    """A wake-up publish to a stalled broker runs in a reply callback: the renewer must keep renewing meanwhile."""
    blocking, release_it = threading.Event(), threading.Event()

    def stuck(reply: Any) -> None:
        blocking.set()
        release_it.wait(10)

    held = take(c, "renewed", ttl_ms=600)
    renewer().track(held, c, 3600)
    try:
        assert L.release_later(c, take(c, "released"), P, stuck)
        wait_for(blocking.is_set, 2, what="the deferred reply's callback to start")
        ticks = renewer().ticks
        wait_for(lambda: renewer().ticks >= ticks + 3, 3, interval=0.02, what="renewals while the callback blocks")
        assert held.held
    finally:
        release_it.set()
        renewer().untrack(held)


def test_settle_waits_for_callbacks_the_renewer_handed_to_the_replies_thread(c: Any) -> None:
    """The renewer read the reply first: ``settle()`` (and worker shutdown) return only once its callback ran."""
    started, finish = threading.Event(), threading.Event()
    ran: list[Any] = []

    def slow(reply: Any) -> None:
        started.set()
        finish.wait(10)
        ran.append(reply)

    assert L.release_later(c, take(c, "handed"), P, slow)
    wait_for(started.is_set, 2, what="the renewer to read the reply and hand its callback over")
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: (settle(), settled.set()))
    waiter.start()
    try:
        assert not settled.wait(0.3)  # the callback is still running: settle() must not have returned
        assert ran == []
    finally:
        finish.set()
        waiter.join(5)
    assert settled.is_set() and len(ran) == 1
    assert settle() == 0  # nothing left to read or to wait for


def test_a_callback_that_raises_leaves_the_replies_thread_serving_and_settle_not_waiting(c: Any) -> None:
    """A time limit or an error raised in a handed-over callback: the thread lives on and nothing stays pending."""
    from billiard.exceptions import SoftTimeLimitExceeded

    def raising(reply: Any) -> None:
        raise SoftTimeLimitExceeded()

    replies = Replies()
    for callback in (raising, replies):
        assert L.release_later(c, take(c, f"raise-{id(callback)}"), P, callback)
        wait_for(lambda: wire.channel(c).pending == 0, 2, what="the renewer to read the reply")
    settle()
    assert len(replies.got) == 1 and replies.threads == ["lockguard-replies"]
    assert wire._replies.get().pending == 0


def test_settle_waits_for_a_stuck_callback_no_longer_than_idle_wait(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake-up publish stuck on a dead broker must not hold a worker's shutdown for ever."""
    import time

    monkeypatch.setattr(wire, "IDLE_WAIT", 0.2)
    started, finish = threading.Event(), threading.Event()

    def stuck(reply: Any) -> None:
        started.set()
        finish.wait(10)

    try:
        assert L.release_later(c, take(c, "stuck"), P, stuck)
        wait_for(started.is_set, 2, what="the stuck callback to start")
        t0 = time.monotonic()
        settle()
        assert time.monotonic() - t0 < 5  # bounded by IDLE_WAIT (0.2 s), not by the callback
    finally:
        finish.set()


def test_a_dropped_client_takes_its_channel_along(own_redis: RedisServer) -> None:
    """A client collected (an app's settings reset) leaves no channel behind in its thread or in drain_all's walk."""
    gc.collect()
    before = len(wire._all)
    for i in range(5):
        client = own_redis.client()
        lease = take(client, f"dropped-{i}")
        release_later(client, lease, Replies())
        del client, lease
        gc.collect()
    assert len(wire._all) == before
    assert settle() == 0


def test_a_thread_that_ends_frees_its_channel_while_the_client_lives(own_redis: RedisServer) -> None:
    """Short-lived threads on a long-lived app client: each ended thread gives its connection back to the pool."""
    pool = redis.BlockingConnectionPool(
        host="127.0.0.1", port=own_redis.port, max_connections=2, timeout=1, decode_responses=True
    )
    client = redis.Redis(connection_pool=pool)
    gc.collect()
    before = len(wire._all)
    failures: list[BaseException] = []

    def job(i: int) -> None:
        try:
            L.release(client, take(client, f"thread-{i}"), P)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    for i in range(5):  # more threads than the pool has connections
        t = threading.Thread(target=job, args=(i,))
        t.start()
        t.join(10)
        gc.collect()
    assert failures == [] and len(wire._all) == before  # a kept connection: the third thread found the pool empty


def test_the_renewer_hands_callbacks_over_before_the_channel_is_free_again(
    c: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted as pending while the renewer still holds the channel: a drain_all taking the lock next waits for them."""
    ch = wire.channel(c)
    assert ch is not None
    seen: list[bool] = []
    real = wire._dispatch

    def watching(done: list[Any]) -> None:
        seen.append(ch._lock.locked())
        real(done)

    monkeypatch.setattr(wire, "_dispatch", watching)
    replies = Replies()
    release_later(c, take(c, "counted"), replies)
    assert ch.drain(block=False) == 1  # as the renewer reads it
    assert seen == [True]
    settle()
    assert len(replies.got) == 1


def test_after_noscript_only_the_commands_that_did_not_run_are_sent_again(c: Any, own_redis: RedisServer) -> None:
    """A deferred CONFIRM_CLAIM meets NOSCRIPT, the RELEASE after it ran: re-sending both ran RELEASE twice."""
    lease = take(c)
    c.script_flush()
    other = own_redis.client()
    other.script_load(scripts.release.source)  # another worker reloaded RELEASE in between
    confirm, release = Replies(), Replies()
    ch = wire.channel(c)
    assert ch is not None
    with ch._lock:
        for sent in (
            wire._Sent(scripts.confirm_claim, ["lgw:v1:{k}:claim"], ["no-token", 1000], confirm),
            wire._Sent(scripts.release, [lease.redis_key], [lease.token, "", 0], release),
        ):
            ch._send(ch._connection(), sent, [])
    ch.drain()
    assert confirm.got == [0]  # loaded and run once
    assert release.got[0][0] == 1  # released (run once), not "taken by another holder" from a second run


def test_a_confirm_claim_that_fails_is_logged_whether_waited_for_or_deferred(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIRM_CLAIM after a publish is not waited for: a refusal read later is still logged, and the message is out."""
    import logging

    from .tracer import published

    refusal = "return redis.error_reply('NOREPLICAS Not enough good replicas to write.')"
    refusing = scripts.Script("CONFIRM_CLAIM", refusal)  # a real server's reply, through the real channel
    monkeypatch.setattr(scripts, "confirm_claim", refusing)
    app: Celery = make_app("wire-confirm", redis_url, prefix, lockguard_redis_url=redis_url)

    @app.task(base=LockedTask, bind=True, name="w.ud", lock_key="k:{a}", lock_mode="until_done")
    def t(self: Any, a: int) -> int:
        return a

    caplog.set_level(logging.WARNING, logger="celery_lockguard")
    first, second = t.apply_async((1,)), t.apply_async((2,))  # the first runs CONFIRM_CLAIM waited, the second deferred
    settle()
    events = [getattr(r, "lockguard", {}) for r in caplog.records]
    reasons = [e["reason"] for e in events if e.get("event") == "lock.backend_unavailable"]
    assert len([x for x in reasons if x.startswith("confirm claim:") and "NOREPLICAS" in x]) == 2
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert {m.task_id for m in published(r, app)} == {first.id, second.id}


def test_closing_a_channel_waits_for_a_reader_and_forgets_the_unread_replies(
    c: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit the channel's finalizer closed the socket under the renewer reading a deferred
    reply: a release and a completion record the server had were reported failed (found by the perf work)."""
    monkeypatch.setattr(wire, "DRAIN_DELAY", 60.0)  # no drain by the renewer in this window
    lease = take(c)
    replies = Replies()
    release_later(c, lease, replies, scope="s-exit")
    ch = wire.channel(c)
    assert ch is not None and ch.pending == 1
    reading, closed = threading.Event(), threading.Event()

    def reader() -> None:  # the renewer, mid-read: it holds the channel's lock
        with ch._lock:
            reading.set()
            closed.wait(0.3)  # the finalizer must not close the socket before this returns

    holder = threading.Thread(target=reader)
    holder.start()
    reading.wait(5)
    closer = threading.Thread(
        target=lambda: (wire._give_back(ch._pool, ch._made, ch._lock, ch._inflight), closed.set())
    )
    closer.start()
    assert not closed.wait(0.1), "the socket was closed while a reader held the channel"
    holder.join(5)
    closer.join(5)
    assert closed.is_set() and ch.pending == 0
    assert ch.drain(block=False) == 0 and replies.got == []  # nothing read, nothing reported as failed
    other = redis.Redis(port=c.connection_pool.connection_kwargs["port"], decode_responses=True)
    assert other.exists(done_name(P, "s-exit"))  # the server had the release and its record all along


# -- held commands: CONFIRM_CLAIM rides in the next write (issue 33) ----------------------------------------


def publishing(c: Any, key: str, token: str = "c1") -> list[str]:
    """A claim taken ``publishing`` (as ``apply_async`` takes it) on ``key``: its keys, for CONFIRM_CLAIM."""
    keys = [lock_name(P, key), f"{lock_name(P, key)}:claim-behind"]
    args = {"ttl_ms": 60_000, "task_name": "n", "digest": "d", "publish_ttl_ms": 5_000}
    # This channel's first CONFIRM_CLAIM runs at once (the server may not have the script yet): one ahead.
    assert L.claim(c, [lock_name(P, "warm-claim")], token="w", task_id="w", **args).kind in ("ok", "own")
    L.confirm_claim(c, [lock_name(P, "warm-claim")], "w", 60_000)
    assert L.claim(c, keys, token=token, task_id=f"t-{key}", **args).kind == "ok"
    return keys


def state_of(port: int, key: str) -> str | None:
    """The claim's state as another connection sees it (what is on the server, not in a channel)."""
    other = redis.Redis(port=port, decode_responses=True)
    try:
        return other.hget(lock_name(P, key), "state")
    finally:
        other.close()


def test_a_held_confirm_goes_out_in_the_next_write_and_its_reply_is_read_first(
    c: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "DRAIN_DELAY", 60.0)  # keep the renewer's drain out of this test's window
    port = c.connection_pool.connection_kwargs["port"]
    keys = publishing(c, "held")
    ch = wire.channel(c)
    assert ch is not None
    writes: list[bytes] = []
    conn = ch._conn
    send = conn.send_packed_command
    monkeypatch.setattr(conn, "send_packed_command", lambda cmd, check=True: (writes.append(cmd[0]), send(cmd, check)))
    replies = Replies()
    assert L.confirm_claim(c, keys, "c1", 60_000, on_reply=replies)
    assert writes == [] and ch.pending == 1 and ch.held == 1, "held: nothing written yet"
    assert state_of(port, "held") == "publishing"
    lease = take(c, "next")  # the next command on the channel carries it
    assert isinstance(lease, L.Lease)
    assert len(writes) == 1 and writes[0].count(b"EVALSHA") == 2, "one write: the held confirm, then ACQUIRE"
    assert replies.got == [True] and ch.pending == 0
    assert state_of(port, "held") == "queued"


def test_a_held_confirm_on_an_idle_channel_is_written_by_the_renewer_within_the_delay(c: Any) -> None:
    port = c.connection_pool.connection_kwargs["port"]
    keys = publishing(c, "idle")
    replies = Replies()
    assert L.confirm_claim(c, keys, "c1", 60_000, on_reply=replies)
    wait_for(lambda: state_of(port, "idle") == "queued", 2.0, interval=0.005, what="the renewer to write it")
    wait_for(lambda: replies.got, 2.0, interval=0.005, what="its reply to be read")
    assert replies.got == [True]


def test_a_thread_that_ends_right_after_a_publish_still_confirms_its_claim(own_redis: RedisServer) -> None:
    """The renewer keeps the channel until its drain, which writes what the ended thread held."""
    client = warm(own_redis.client())
    failures: list[BaseException] = []

    def job() -> None:
        try:
            keys = publishing(client, "thread")
            assert L.confirm_claim(client, keys, "c1", 60_000, on_reply=Replies())
            ch = wire.channel(client)
            assert ch is not None and ch.held == 1 and state_of(own_redis.port, "thread") == "publishing"
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failures.append(exc)

    t = threading.Thread(target=job)
    t.start()
    t.join(10)
    gc.collect()
    assert failures == []
    wait_for(lambda: state_of(own_redis.port, "thread") == "queued", 5.0, what="the ended thread's write")


def test_a_process_that_exits_right_after_a_publish_still_confirms_its_claim(own_redis: RedisServer) -> None:
    """A script that publishes and exits: the held confirm is written at interpreter exit, not lost."""
    import subprocess
    import sys

    code = f"""
import redis
from celery_lockguard import _lease as L, _wire as wire
wire.DRAIN_DELAY = 60.0
c = redis.Redis(port={own_redis.port}, decode_responses=True)
keys = ["{lock_name(P, "exit")}", "{lock_name(P, "exit")}:claim-behind"]
args = dict(ttl_ms=60_000, task_name="n", digest="d", publish_ttl_ms=5_000)
L.claim(c, ["{lock_name(P, "exit-warm")}"], token="w", task_id="w", **args)  # the channel knows CLAIM
L.confirm_claim(c, ["{lock_name(P, "exit-warm")}"], "w", 60_000, on_reply=print)  # and CONFIRM_CLAIM
assert L.claim(c, keys, token="c1", task_id="t", **args).kind == "ok"
assert L.confirm_claim(c, keys, "c1", 60_000, on_reply=print)
assert wire.channel(c).held == 1
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: state_of(own_redis.port, "exit") == "queued", 5.0, what="the exit's write")


def test_a_publisher_killed_before_its_held_confirm_is_written_blocks_identical_work_only_for_the_grace(
    own_redis: RedisServer,
) -> None:
    """The held confirm is lost with a SIGKILLed process: its claim stays ``publishing`` and lapses after the
    publishing grace, exactly as when the publisher is killed between CLAIM and the publish."""
    import subprocess
    import sys

    key = lock_name(P, "killed")
    code = f"""
import os, signal, redis
from celery_lockguard import _lease as L, _wire as wire
wire.DRAIN_DELAY = 60.0
c = redis.Redis(port={own_redis.port}, decode_responses=True)
args = dict(ttl_ms=60_000, task_name="n", digest="d", publish_ttl_ms=800)
L.claim(c, ["{key}-warm"], token="w", task_id="w", **args)
L.confirm_claim(c, ["{key}-warm"], "w", 60_000, on_reply=print)  # the channel knows CONFIRM_CLAIM: held next
assert L.claim(c, ["{key}"], token="c1", task_id="t", **args).kind == "ok"
assert L.confirm_claim(c, ["{key}"], "c1", 60_000, on_reply=print) and wire.channel(c).held == 1
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    c = own_redis.client()
    assert c.hget(key, "state") == "publishing" and 0 < c.pttl(key) <= 800
    identical = {"ttl_ms": 60_000, "task_name": "n", "digest": "d", "publish_ttl_ms": 800}
    assert L.claim(c, [key], token="c2", task_id="t2", **identical).kind == "held"
    wait_for(lambda: L.claim(c, [key], token="c2", task_id="t2", **identical).kind == "ok", 3.0, what="the grace")
