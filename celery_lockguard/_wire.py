"""Lease scripts on a connection of their own: packed once, replies read late where nothing waits on them.

redis-py spends more CPU per script call than the script takes on the server
(its generic packer encodes every value through type checks, and every command
checks a connection out of the pool and back). A task's lease calls are a
handful of known shapes, so a :class:`Channel` -- one connection per (process,
thread, client) -- packs the ``EVALSHA`` bytes directly and keeps its
connection for itself.

It also lets a command go out *without waiting for its reply*
(:meth:`Channel.defer`): RELEASE after a body is on the server as soon as the
bytes are written, so the next holder waits no longer than before, and the
worker takes its next message instead of idling for the reply. The reply
(released / expired / taken, recorded or not) is read later, in order: by the
next command on the same channel (it is already in the socket buffer by then,
so that read costs no round trip), or by the renewer thread within
:data:`DRAIN_DELAY` seconds on an idle worker (:func:`drain_soon`), or at
process shutdown (:func:`drain_all`). Its callback then logs and counts what
the synchronous path would have.

A command can also be *held* (:meth:`Channel.hold`): written with the channel's
next command, in the same write, or by the renewer thread within
:data:`DRAIN_DELAY`, or when the channel is closed (its thread ended, or the
interpreter exits: :func:`_give_back`), whichever comes first. Only for a
command whose effect may come that much later and be lost with a killed
process: ``CONFIRM_CLAIM`` after a publish, whose claim then
lapses after the publishing grace exactly as when the publisher is killed
before it (a burst of publishes pays one write per publish, not two).

RELEASE is deferred only to a server on another host: to one on this host
(loopback, a unix socket; :attr:`Channel.near`) the task waits for its reply,
because there the wait is time the server needs on the same CPUs anyway
(:data:`DEFER_NEAR`).

Replies are read strictly in the order their commands were sent. A ``NOSCRIPT``
reply (a restart or ``SCRIPT FLUSH`` between two calls) means that command did
not run: the script is loaded and that command alone is sent again (a command
that ran is never sent twice: a RELEASE run again would answer "taken" and lose
the waiter it woke). Only if another client reloaded one script but not the
other in the microseconds between two sends can a re-sent command run after a
later one; each is token-checked, so that costs at most a wait (an ACQUIRE that
met the lease its predecessor was releasing parks, and the re-sent RELEASE wakes
it). A connection error fails every command still waiting for its reply: their
effect is unknown, as for any lost reply. Replies
the renewer thread reads have their callbacks run on a thread of their own
(``lockguard-replies``), so a callback that publishes (a wake-up) never holds
up renewal.

Only for what it can do exactly: a plain ``redis.Redis`` over a plain
connection pool, outside gevent/eventlet (a green socket belongs to its hub,
and the drain runs on an OS thread). Sentinel clients (which must follow a
failover), Cluster clients (which route per slot) and green pools keep
redis-py's own path (:func:`channel` returns ``None``).
"""

from __future__ import annotations

import ipaddress
import os
import queue
import select
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from billiard.exceptions import SoftTimeLimitExceeded
from redis.exceptions import NoScriptError

from ._process import PerProcess
from ._resp import Reader

#: Seconds within which the renewer thread reads a deferred reply nobody else read.
DRAIN_DELAY = 0.02

#: Whether RELEASE to a server on this host (loopback or a unix socket) is deferred too
#: (``_lease.release_later``). It is not by default: such a server shares this host's CPUs, so the
#: wait for its reply is time it needs anyway, and leaving the reply in flight cost a ``-c 1`` prefork
#: worker 0.03-0.09 of its throughput in ``make bench`` (paired, same run; level at ``-c 2`` and ``-c 8``:
#: docs/benchmarks.md). RELEASE to a
#: server on another host is deferred: there the wait is a network round trip. The publish side's
#: deferred calls (CONFIRM_CLAIM, DEBOUNCE_SETTLE) are deferred everywhere, as measured before.
#: Tests, the bench and the chaos soak set it to run the deferred release against a local server.
DEFER_NEAR = False

OnReply = Callable[[Any], None]  # called with the reply, or with the exception that stands for it


@dataclass
class _Sent:
    """A command on the wire whose reply is still to be read."""

    script: Any  # _scripts.Script
    keys: list[str]
    args: list[Any]
    on_reply: OnReply | None  # None: the caller reads it (call)


def on_this_host(kwargs: dict[str, Any]) -> bool:
    """Whether a pool's connections reach a server on this host: a unix socket, or a loopback address."""
    if kwargs.get("path"):
        return True
    host = str(kwargs.get("host") or "localhost")  # redis-py's own default
    if host.rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a name: it may resolve anywhere, so it is taken to be another host
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or ip.is_unspecified or (mapped is not None and mapped.is_loopback)


def _encode(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d" % value
    raise TypeError(f"lease script argument of type {type(value).__name__}: {value!r}")


def pack_evalsha(sha: bytes, keys: list[str], args: list[Any]) -> bytes:
    """``EVALSHA sha numkeys keys... args...`` as RESP bytes."""
    # The usual call: text and ints only, formatted as text and encoded once. Lengths are counted in
    # characters, which are bytes only if the whole text is ASCII (one check at the end); anything else
    # (non-ASCII text, bytes, a type to refuse) takes the general path.
    parts = []
    for value in (*keys, *args):
        kind = type(value)
        if kind is str:
            parts.append(f"${len(value)}\r\n{value}\r\n")
        elif kind is int:
            text = str(value)
            parts.append(f"${len(text)}\r\n{text}\r\n")
        else:
            return _pack_any(sha, keys, args)
    body = "".join(parts)
    if not body.isascii():
        return _pack_any(sha, keys, args)
    numkeys = b"%d" % len(keys)
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n" % (len(parts) + 3, sha, len(numkeys), numkeys)
    return head + body.encode()


def _pack_any(sha: bytes, keys: list[str], args: list[Any]) -> bytes:
    """:func:`pack_evalsha` for any values: each encoded on its own (refusing what cannot be sent exactly)."""
    numkeys = b"%d" % len(keys)
    out = [
        b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n" % (len(keys) + len(args) + 3, sha, len(numkeys), numkeys)
    ]
    append = out.append
    for value in (*keys, *args):
        # str and int (every value a lease script takes) inline; anything else through _encode, which refuses
        # what it cannot send exactly (bool, float, None) before a byte goes out.
        kind = type(value)
        item = value.encode() if kind is str else b"%d" % value if kind is int else _encode(value)
        append(b"$%d\r\n%s\r\n" % (len(item), item))
    return b"".join(out)


def _pack_load(source: str) -> bytes:
    body = source.encode()
    return b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$%d\r\n%s\r\n" % (len(body), body)


class Channel:
    """One connection of one client, used by one thread for lease scripts (the renewer may drain it).

    ``_lock`` covers every write and read on the connection: the owning
    thread holds it for a whole command, the renewer only tries it (a busy
    channel is drained by its owner's next command anyway).
    """

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None
        self._made: list[Any] = []  # the connection, for the finalizer (which must not hold self)
        self._lock = threading.Lock()
        self._inflight: deque[_Sent] = deque()
        # Packed commands held for the next write (their _Sent are in _inflight already, in order).
        self._held: list[bytes] = []
        # Scripts known to be in the server's cache since this connection was made: only those are
        # deferred (a deferred NOSCRIPT would hold the release back until its reply is read).
        self._loaded: set[bytes] = set()
        self._polled: tuple[Any, select.poll] | None = None  # the socket polled for staleness, and its poller
        self._reader: Reader | None = None  # replies read off the socket (_resp), made by the first read
        self.pid = os.getpid()
        #: Commands sent whose reply is read later (tests and the bench count them).
        self.deferred = 0
        #: Commands held for a later write (:meth:`hold`; tests and the bench count them).
        self.held = 0
        #: The server is on this host: RELEASE waits for its reply (unless :data:`DEFER_NEAR`).
        self.near = on_this_host(self._pool.connection_kwargs)
        weakref.finalize(self, _give_back, self._pool, self._made, self._lock, self._inflight, self._held, self.pid)

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None:
            conn = self._conn = self._pool.get_connection()
            self._made.append(conn)
        elif not self._inflight and self._stale(conn):
            # As the pool does at every checkout: data (or EOF) on an idle connection means the server
            # closed it (a restart, a timeout): reconnect now, before the command goes out on a dead link.
            conn.disconnect()  # send_packed_command connects again
            self._loaded.clear()
        return conn

    def _stale(self, conn: Any) -> bool:
        """Whether the idle ``conn`` has anything to read (EOF included): one ``poll``, not redis-py's three calls."""
        sock = getattr(conn, "_sock", None)
        if sock is None:
            return False  # not connected: the next send connects
        if not hasattr(select, "poll"):  # Windows
            try:
                return bool(conn.can_read())
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                return True
        if self._polled is None or self._polled[0] is not sock:
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLPRI)
            self._polled = (sock, poller)
        try:
            return bool(self._polled[1].poll(0))
        except OSError:
            return True

    @property
    def defers_release(self) -> bool:
        """Whether RELEASE is left in flight here: the server is on another host (or :data:`DEFER_NEAR`)."""
        return DEFER_NEAR or not self.near

    @property
    def pending(self) -> int:
        """Commands whose reply has not been read yet."""
        return len(self._inflight)

    def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` and return its reply (reading any earlier deferred replies first, in order)."""
        done: list[tuple[OnReply, Any]] = []
        try:
            with self._lock:
                conn = self._connection()
                # Sent before the earlier deferred replies are read: a reply still on its way then costs
                # no round trip of its own (the next task's ACQUIRE can follow its predecessor's RELEASE
                # within microseconds).
                sent = _Sent(script, keys, args, None)
                self._send(conn, sent, done)
                reply = self._read_through(conn, sent, done)
        finally:
            _run(done)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def defer(self, script: Any, keys: list[str], args: list[Any], on_reply: OnReply) -> None:
        """Send ``script`` now; ``on_reply`` gets its reply when it is read (see the module docstring).

        A failed send raises here, as :meth:`call` would: nothing was sent. A script not yet
        seen in the server's cache on this connection (its first call, after a reconnect) runs
        synchronously instead, so a ``NOSCRIPT`` never delays what the command does.
        """
        if script.sha_bytes not in self._loaded:
            try:
                reply = self.call(script, keys, args)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # as a failed send: the caller reports it
            except Exception as exc:  # noqa: BLE001 - an error reply is the command's answer, as when deferred
                reply = exc
            _run([(on_reply, reply)])
            return
        done: list[tuple[OnReply, Any]] = []
        try:
            with self._lock:
                self._send(self._connection(), _Sent(script, keys, args, on_reply), done)
                self.deferred += 1
        finally:
            _run(done)
        drain_soon(self)

    def hold(self, script: Any, keys: list[str], args: list[Any], on_reply: OnReply) -> None:
        """As :meth:`defer`, but the bytes go out with this channel's next write (see the module docstring).

        Written within :data:`DRAIN_DELAY` at the latest (the renewer thread), or when the channel is
        closed (thread end, interpreter exit: ``weakref.finalize`` runs :func:`_give_back` then); lost
        with a killed process. A script not yet in the server's cache on this
        connection is deferred instead (which runs it at once, synchronously).
        """
        if script.sha_bytes not in self._loaded or self._conn is None:
            self.defer(script, keys, args, on_reply)
            return
        with self._lock:
            self._held.append(pack_evalsha(script.sha_bytes, keys, args))
            self._inflight.append(_Sent(script, keys, args, on_reply))
            self.held += 1
        drain_soon(self)

    def drain(self, block: bool = True) -> int:
        """Read every reply still in flight and hand each to its callback; how many were read.

        ``block=False`` (the renewer): skip a channel its owner is using.
        """
        if not self._lock.acquire(block):
            return 0
        done: list[tuple[OnReply, Any]] = []
        try:
            if self._held and self._conn is not None:
                self._write_held(self._conn, done)
            if self._inflight and self._conn is not None:
                self._read_through(self._conn, None, done)
        finally:
            # On the renewer thread the callbacks go to a thread of their own: a wake-up publish to a
            # stalled broker must never hold up the renewal ticks of every lease in the process. They are
            # handed over (counted as pending) before the lock goes, so a drain_all that takes the lock next
            # waits for them.
            try:
                if not block:
                    _dispatch(done)
            finally:
                self._lock.release()
            if block:
                _run(done)
        return len(done)

    # -- with the lock held --------------------------------------------------

    def _send(self, conn: Any, sent: _Sent, done: list[tuple[OnReply, Any]]) -> None:
        packed = pack_evalsha(sent.script.sha_bytes, sent.keys, sent.args)
        if self._held:  # held commands first, in the same write: their replies come first too
            packed = b"".join([*self._held, packed])
            self._held.clear()
        try:
            conn.send_packed_command([packed], False)
        except BaseException as exc:
            self._conn_lost(conn, exc, done)  # what was in flight on it is lost too
            raise
        self._inflight.append(sent)

    def _write_held(self, conn: Any, done: list[tuple[OnReply, Any]]) -> None:
        """Write the held commands (their replies are then read as deferred ones')."""
        packed = b"".join(self._held)
        self._held.clear()
        try:
            conn.send_packed_command([packed], False)
        except BaseException as exc:  # noqa: BLE001 - every reply still expected on the link is lost
            self._conn_lost(conn, exc, done)

    def _read_through(self, conn: Any, until: _Sent | None, done: list[tuple[OnReply, Any]]) -> Any:
        """Read replies in order up to ``until`` (every one if ``None``); returns ``until``'s reply.

        Callbacks of deferred replies are collected in ``done``, run by the caller outside the lock.
        """
        read: list[tuple[_Sent, Any]] = []
        while self._inflight:
            sent = self._inflight.popleft()
            try:
                reply: Any = self._read(conn)
            except BaseException as exc:  # noqa: BLE001 - a timeout, a dropped link or an interrupt mid-read
                # The connection is gone (or the read timed out): nothing more can be read on it.
                self._inflight.appendleft(sent)
                for s, r in read:
                    _collect(s, r, done)
                self._conn_lost(conn, exc, done)
                return exc
            read.append((sent, reply))
            if not isinstance(reply, NoScriptError):
                self._loaded.add(sent.script.sha_bytes)
            if sent is until:
                break
        missed = [i for i, (_, r) in enumerate(read) if isinstance(r, NoScriptError)]
        if missed:
            # Only what did not run goes out again: a command that ran must not run twice (a RELEASE
            # run again would answer "taken" and lose the waiter it woke).
            for i, again in zip(missed, self._rerun(conn, [read[i][0] for i in missed]), strict=True):
                read[i] = again
        answer: Any = None
        for s, r in read:
            if s is until:
                answer = r
            else:
                _collect(s, r, done)
        return answer

    def _rerun(self, conn: Any, batch: list[_Sent]) -> list[tuple[_Sent, Any]]:
        """After NOSCRIPT: load the scripts, then send ``batch`` again in order and read it (once)."""
        try:
            for script in {id(s.script): s.script for s in batch}.values():
                conn.send_packed_command([_pack_load(script.source)], False)
                loaded = self._read(conn)
                if isinstance(loaded, Exception):
                    raise loaded
            conn.send_packed_command([b"".join(pack_evalsha(s.script.sha_bytes, s.keys, s.args) for s in batch)], False)
        except BaseException as exc:  # noqa: BLE001 - the stream is unusable: every reply of the batch is lost
            self._conn_lost(conn, exc, [])
            return [(s, exc) for s in batch]
        out: list[tuple[_Sent, Any]] = []
        for i, s in enumerate(batch):
            try:
                r: Any = self._read(conn)
            except BaseException as exc:  # noqa: BLE001 - as above
                self._conn_lost(conn, exc, [])
                return out + [(x, exc) for x in batch[i:]]
            if isinstance(r, NoScriptError):
                # The message starts with the code: errors.classify calls a NOSCRIPT that survives a reload
                # misconfigured (a proxy spreading calls over nodes, a flush racing every load).
                r = NoScriptError(f"NOSCRIPT {s.script.name}: again right after SCRIPT LOAD ({r})")
            if not isinstance(r, NoScriptError):
                self._loaded.add(s.script.sha_bytes)
            out.append((s, r))
        return out

    def _read(self, conn: Any) -> Any:
        """The next reply on ``conn`` (an error reply as its exception, returned), off the socket (``_resp``)."""
        if self._reader is None:
            self._reader = Reader(conn)
        return self._reader.read(conn)

    def _conn_lost(self, conn: Any, exc: BaseException, done: list[tuple[OnReply, Any]]) -> None:
        """Close ``conn``; every reply still expected on it is lost (``exc``). The next command reconnects."""
        self._loaded.clear()
        self._held.clear()  # their _Sent are in _inflight: lost with the rest
        try:
            conn.disconnect()
        except Exception:  # noqa: BLE001 - already broken
            pass
        while self._inflight:
            _collect(self._inflight.popleft(), exc, done)


def _collect(sent: _Sent, reply: Any, done: list[tuple[OnReply, Any]]) -> None:
    if sent.on_reply is not None:
        done.append((sent.on_reply, reply))


def _run(done: list[tuple[OnReply, Any]]) -> None:
    limit: BaseException | None = None
    for on_reply, reply in done:
        try:
            on_reply(reply)
        except SoftTimeLimitExceeded as exc:  # the running task's own limit: the other replies first, then it
            limit = exc
        except Exception:  # noqa: BLE001 - a reply's bookkeeping must never fail the command that read it
            pass
    if limit is not None:
        raise limit


class _Replies:
    """This process's ``lockguard-replies`` thread and what it has yet to run.

    ``wait_idle`` lets :func:`drain_all` return only once the callbacks the renewer handed over ran too: a test's
    ``settle()`` and the worker's shutdown read their events, metrics and wake-up publishes right after it.
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[OnReply, Any]] = queue.SimpleQueue()
        self.pending = 0
        self.idle = threading.Condition()
        self.thread = threading.Thread(target=self.serve, name="lockguard-replies", daemon=True)
        self.thread.start()

    def put(self, done: list[tuple[OnReply, Any]]) -> None:
        with self.idle:
            self.pending += len(done)
        for item in done:
            self.queue.put(item)

    def serve(self) -> None:
        while True:
            item = self.queue.get()
            try:
                _run([item])
            except BaseException:  # noqa: BLE001 - a callback raising a time limit here must not end the thread
                pass
            finally:
                with self.idle:
                    self.pending -= 1
                    if not self.pending:
                        self.idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every handed-over callback ran (not on the replies thread itself); whether they all did."""
        if threading.current_thread() is self.thread:
            return not self.pending
        with self.idle:
            return self.idle.wait_for(lambda: not self.pending, timeout)


_replies: PerProcess[_Replies] = PerProcess(_Replies)

#: How long :func:`drain_all` waits for callbacks already on the replies thread (a wake-up publish to a slow broker).
IDLE_WAIT = 5.0


def run_apart(callback: OnReply, arg: Any) -> None:
    """Run ``callback(arg)`` on this process's ``lockguard-replies`` thread (:func:`drain_all` waits for it)."""
    _dispatch([(callback, arg)])


def _dispatch(done: list[tuple[OnReply, Any]]) -> None:
    """Run ``done``'s callbacks on this process's ``lockguard-replies`` thread (started on first use)."""
    if done:
        _replies.get().put(done)


def _give_back(
    pool: Any, holder: list[Any], lock: Any, inflight: deque[Any], held: list[bytes] | None = None, pid: int = 0
) -> None:
    """A channel's thread ended: write what it held, close its connection (replies may be unread), return it.

    Under the channel's lock (waited for a moment): at interpreter exit the renewer thread may be reading a
    deferred reply; closing the socket under it made that read fail and report a release and a completion
    record as failed although the server had them. The replies nobody will read are forgotten first.
    """
    got = lock.acquire(True, 1.0)
    try:
        if held and holder and pid == os.getpid():  # never from a forked child: the socket is the parent's
            try:
                holder[-1].send_packed_command([b"".join(held)], False)
            except Exception:  # noqa: BLE001 - best effort: a held CONFIRM_CLAIM lapses after its grace
                pass
        if held:
            held.clear()
        inflight.clear()
        for conn in holder:
            try:
                conn.disconnect()
                pool.release(conn)
            except Exception:  # noqa: BLE001 - best effort at thread or interpreter exit
                pass
    finally:
        if got:
            lock.release()


class _Channels(dict[int, Channel]):
    """A thread's channels by client id (a class of its own so a client's finalizer can refer to it weakly)."""


_local = threading.local()
_all: weakref.WeakSet[Channel] = weakref.WeakSet()
_all_lock = threading.Lock()


def usable(client: Any) -> bool:
    """Whether ``client`` is one a channel serves exactly (see the module docstring)."""
    from ._renewer import green_runtime

    pool = getattr(client, "connection_pool", None)
    return (
        type(client) is redis.Redis
        and type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
        and green_runtime() is None
    )


def channel(client: Any) -> Channel | None:
    """This thread's channel for ``client``, or ``None`` where redis-py's own path must serve it."""
    pid = os.getpid()
    mine: _Channels | None = getattr(_local, "channels", None)
    if mine is None or getattr(_local, "pid", None) != pid:
        mine = _local.channels = _Channels()
        _local.pid = pid
    found = mine.get(id(client))
    # ``id`` is reused once a client is collected, by any client kind: a Cluster client has no ``connection_pool``.
    if found is not None and found._pool is getattr(client, "connection_pool", None):
        return found
    if not usable(client):
        return None
    made = Channel(client)
    mine[id(client)] = made
    # A client dropped (an app's settings reset, a test's own client) takes its channel along: kept in this
    # thread's map, every dead channel stayed in memory and in each drain_all's walk until the thread ended.
    # Weakly: a thread that ends first must still free its channel (and connection), and then the watch goes.
    watch = weakref.finalize(client, _forget, weakref.ref(mine), id(client), weakref.ref(made))
    weakref.finalize(made, watch.detach)
    with _all_lock:
        _all.add(made)
    return made


def _forget(mine_ref: weakref.ref[_Channels], key: int, made_ref: weakref.ref[Channel]) -> None:
    """A channel's client was collected: its thread no longer keeps the channel (nor ``drain_all`` walks it).

    The client closed its pool's connections as it went (``Redis.__del__``), so replies still in flight on the
    channel are lost with it, as at thread exit (:func:`_give_back`).
    """
    mine, made = mine_ref(), made_ref()
    if mine is not None and made is not None and mine.get(key) is made:
        del mine[key]


def drain_soon(ch: Channel) -> None:
    """Have the renewer thread read ``ch``'s deferred replies within :data:`DRAIN_DELAY` if nobody else does."""
    global _renewer_module
    if _renewer_module is None:  # imported here once: _renewer imports this module
        from . import _renewer as module

        _renewer_module = module
    _renewer_module.renewer().drain_soon(ch)


_renewer_module: Any = None


def drain_all() -> int:
    """Read every deferred reply of this process and run its callback (worker process shutdown, ``settle()``).

    Returns how many replies this call read. Replies the renewer thread read first had their callbacks handed to
    the replies thread: those are waited for too (up to :data:`IDLE_WAIT`), so their events, metrics and wake-up
    publishes have happened when this returns.
    """
    pid = os.getpid()
    with _all_lock:
        mine = [ch for ch in _all if ch.pid == pid]
    read = sum(ch.drain() for ch in mine)
    replies = _replies.peek()
    if replies is not None:
        replies.wait_idle(IDLE_WAIT)
    return read
