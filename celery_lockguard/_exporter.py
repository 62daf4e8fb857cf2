"""``lockguard exporter``: the fleet's metrics over HTTP for Prometheus, hardened against who connects.

Each scrape of ``/metrics`` reads the flushed totals and the processes'
gauges from Redis (one pipeline, plus a bounded read when any process holds a
lease: never a ``SCAN``) and answers them as Prometheus text
(:func:`celery_lockguard._stats.prometheus`). The
server is a thread per connection, bounded every way a client (or a port
scanner, or a half-open load balancer) can hold it:

* **a waiting room**: a new connection gets no thread and no slot until its
  whole request head (request line and headers) has arrived. One thread
  reads the heads of every waiting connection (non-blocking, one selector);
  a head that is not complete ``timeout`` seconds after the accept, or is
  larger than 64 KiB, closes the connection. The room holds at most
  ``MAX_WAITING`` connections, ``MAX_WAITING_PER_PEER`` per client address;
  past either, the oldest waiting connection (of that peer, else of the
  peer with the most) is closed to make room. Idle or trickling sockets
  therefore cost a file descriptor each and never a slot: 32 silent
  connections used to take every slot and answer every real scrape and
  page view 503 (issue 30), and now 200 of them, from one address or many,
  leave a fresh scrape answered at once. Out of file descriptors
  (``EMFILE``), the room gives up its oldest connections first;
* **a connection cap** (``max_connections``): requests served at once, each
  in its own thread, at most a quarter of them (at least one) for one client
  address; past either, a complete request gets ``503`` at once and is
  closed;
* **a handler timeout** (``timeout``): a handler whose client stops reading
  or sending for that long is closed;
* **slow answers yield**: a handler writing its answer whose client has not
  taken a 64 KiB chunk of it for ``STALLED`` (1 s), or whose request arrived
  more than ``SLOW_ANSWER`` (1 s) ago, is closed when a fresh request finds
  every slot (or its peer's share) taken (the oldest request first), and that
  request gets its slot. Slow readers from
  four addresses (a quarter of the slots each) used to hold every slot for
  the handler timeout and answer real scrapes 503; readers that trickle just
  fast enough never to stall a chunk (16 KiB every 0.1 s) did too, until
  the answer's age counted;
* **a deadline** (``4 * timeout``): a handler still running that long after
  its request arrived is cut off, by a reaper thread;
* **backoff on accept errors**: out of file descriptors (``EMFILE``), the
  listening socket stays readable while ``accept`` keeps failing, and the
  serving loop spun on it at 100% CPU, starving the scrapes it was failing;
  it now sleeps 50 ms doubling to 1 s between attempts, and logs once per run
  of failures;
* **quiet about clients that go away**: a connection reset, a broken pipe or
  a timed-out client is logged at debug, not warning (a warning per reset
  socket let anyone who can connect grow the log).

Read-only: GET and HEAD are served, any other method is answered 405. With
``--page`` the same server (and so every bound above) also serves the lock
page, and with ``--auth`` asks every request for basic auth
(:mod:`celery_lockguard._page`).

A scrape that fails answers with a status, never an empty reply: 503 when the
lock Redis is unreachable, 500 for anything else (a metrics key of the wrong
type is not a failure: :func:`~celery_lockguard._stats.read` skips it); the
server keeps serving either way.
"""

from __future__ import annotations

import errno
import io
import queue
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any

from . import _connection as connection
from . import _stats as stats
from ._config import Settings
from ._connection import UNAVAILABLE_ERRORS
from ._events import logger

if TYPE_CHECKING:
    from ._page import Front

#: Seconds a connection may stay silent before it is closed.
DEFAULT_TIMEOUT = 10.0
#: Connections served at once; more get 503 from the accepting thread.
DEFAULT_MAX_CONNECTIONS = 32
#: A connection is cut off this many timeouts after it was accepted, however it trickles.
DEADLINE_TIMEOUTS = 4
#: Accept errors that mean "no resources right now": back off instead of spinning.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: First and longest pause after such an error (seconds).
BACKOFF_FIRST, BACKOFF_MAX = 0.05, 1.0
#: One client address may hold at most this share of the slots (1/4): slow readers from one address
#: cannot take every slot.
PEER_SHARE = 4
#: Connections whose request head has not arrived yet, at most (all peers; one peer).
MAX_WAITING, MAX_WAITING_PER_PEER = 512, 64
#: The largest request head (request line and headers) read; larger closes the connection with 431.
MAX_HEAD = 65536
#: Bytes a handler writes at once; a chunk the client has not taken for :data:`STALLED` seconds marks a stalled writer.
WRITE_CHUNK = 65536
#: Seconds a handler may wait on a client that does not read before its slot can go to a fresh request.
STALLED = 1.0
#: Seconds a request whose answer is being written may have been served before its slot can go to a fresh
#: request: a client that reads just enough never stalls a chunk for :data:`STALLED`, and still holds a slot.
SLOW_ANSWER = 1.0
#: Waiting connections closed at once to free descriptors when ``accept`` fails with ``EMFILE``.
EVICT_ON_EMFILE = 16
_TOO_LARGE = (
    b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
    b"Connection: close\r\n\r\nrequest head too big\n"
)
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 29\r\n"
    b"Connection: close\r\n\r\nexporter at connection limit\n"
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsHandler(BaseHTTPRequestHandler):
    """GET ``/metrics`` (or ``/``): the fleet's totals as Prometheus text, read from Redis on each scrape."""

    server: MetricsServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.handler_timeout)  # a silent client is dropped, not waited for
        self.wfile = _Tracked(self.wfile, self.server, self.connection)  # type: ignore[assignment]
        head = self.server.take_head(self.connection)
        if head:  # the bytes the waiting room already read are read again first
            self.rfile.close()
            self.rfile = io.BufferedReader(_Replay(head, self.connection))

    def parse_request(self) -> bool:
        """Read-only: any method but GET and HEAD is answered 405 (with ``Allow``) before it is looked at."""
        if not super().parse_request():
            return False
        if self.command in ("GET", "HEAD"):
            return True
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", "19")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"method not allowed\n")
        self.close_connection = True
        return False

    def end_headers(self) -> None:
        """A HEAD gets the headers GET would send, and no body: what is written after them is dropped."""
        super().end_headers()
        if self.command == "HEAD":
            self.wfile = _Discard(self.wfile)  # type: ignore[assignment]

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        front = self.server.front  # basic auth and the lock page (``_page``), when configured
        if front is not None and front.answer(self):
            return
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        try:
            s = self.server.settings
            raw = stats.read(connection.operator_client(s), s.key_prefix, windows=False)
            body = stats.prometheus(raw, self.server.templates).encode()
            code = 200
        except UNAVAILABLE_ERRORS as exc:
            body, code = f"lock Redis unreachable: {exc.__class__.__name__}\n".encode(), 503
        except Exception as exc:  # noqa: BLE001 - one bad scrape answers 500; the next one is served again
            logger.warning("exporter.scrape_failed", reason=f"{exc.__class__.__name__}: {exc}")
            body, code = f"scrape failed: {exc.__class__.__name__} (see the exporter's log)\n".encode(), 500
        self.send_response(code)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a scrape every few seconds is not worth a line (failures are logged as events)."""


class _Replay(io.RawIOBase):
    """A connection's stream whose first bytes (the request head, read by the waiting room) are given again."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head = head
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(b)


class _Tracked:
    """A handler's ``wfile`` that writes in chunks and tells the server while a chunk waits on the client.

    A client that stops reading leaves its handler blocked in ``send`` with a full buffer: the server
    sees since when (:meth:`MetricsServer._writing_since`), and takes that slot back when the slots run out.
    """

    def __init__(self, stream: Any, server: MetricsServer, sock: socket.socket) -> None:
        self._stream = stream
        self._server = server
        self._sock = sock

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for start in range(0, len(view), WRITE_CHUNK):
            self._server._writing_since(self._sock, time.monotonic())
            try:
                self._stream.write(view[start : start + WRITE_CHUNK])
            finally:
                self._server._writing_since(self._sock, None)
        return len(data)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()

    @property
    def closed(self) -> bool:
        return bool(self._stream.closed)


class _Waiting:
    """One connection in the waiting room: its peer, when it was accepted, the bytes read so far."""

    __slots__ = ("address", "head", "peer", "since")

    def __init__(self, address: Any, now: float) -> None:
        self.address = address
        self.peer = str(address[0]) if isinstance(address, tuple) and address else "?"
        self.since = now
        self.head = bytearray()


class _Discard:
    """A HEAD's ``wfile`` once its headers are out: writes are dropped, flush and close reach the socket's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()

    @property
    def closed(self) -> bool:
        return bool(self._stream.closed)


class MetricsServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` with a connection cap, a per-connection deadline and accept backoff."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        s: Settings,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        front: Front | None = None,
    ) -> None:
        if not timeout > 0 or max_connections < 1:
            raise ValueError("the exporter needs a timeout > 0 and max_connections >= 1")
        self.settings = s
        self.front = front
        #: Task name -> lock_key template, for the per-template counters (the CLI fills it from the app).
        self.templates: dict[str, str] = {}
        self.handler_timeout = float(timeout)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        #: Requests being served: when each arrived, and its peer (for the per-peer share of the slots).
        self._open: dict[socket.socket, tuple[float, str]] = {}
        self._per_peer: dict[str, int] = {}
        #: Handlers blocked writing to their client, and since when (``_open_lock``).
        self._writing: dict[socket.socket, float] = {}
        #: Handlers that have started writing their answer (``_open_lock``).
        self._answering: set[socket.socket] = set()
        self.max_per_peer = max(1, max_connections // PEER_SHARE)
        self._open_lock = threading.Lock()
        self._backoff = 0.0
        self._closing = threading.Event()
        # The waiting room: sockets handed over by the accepting thread, owned by the room's thread.
        self._arrivals: queue.SimpleQueue[tuple[socket.socket, Any] | int] = queue.SimpleQueue()
        self._waiting: dict[socket.socket, _Waiting] = {}
        self._by_peer: dict[str, dict[socket.socket, None]] = {}
        self._heads: dict[socket.socket, bytes] = {}
        self._heads_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # An IPv6 literal (``--bind ::1``) needs an IPv6 socket; the class default is IPv4.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, MetricsHandler)
        threading.Thread(target=self._reap, name="lockguard-exporter-reaper", daemon=True).start()
        threading.Thread(target=self._room, name="lockguard-exporter-room", daemon=True).start()

    # -- accepting --------------------------------------------------------------------------

    def get_request(self) -> tuple[Any, Any]:
        try:
            conn = super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                if not self._backoff:
                    logger.warning("exporter.accept_failed", reason=f"{errno.errorcode.get(exc.errno)}: {exc}")
                self._backoff = min(max(self._backoff * 2, BACKOFF_FIRST), BACKOFF_MAX)
                if self._waiting:  # the oldest silent connections give their descriptors to new ones
                    self._arrive(EVICT_ON_EMFILE)
                    self._closing.wait(BACKOFF_FIRST / 5)
                else:
                    self._closing.wait(self._backoff)
            raise
        self._backoff = 0.0
        return conn

    def process_request(self, request: Any, client_address: Any) -> None:
        """Into the waiting room: no thread and no slot until the request head has arrived."""
        self._arrive((request, client_address))

    def _arrive(self, item: tuple[socket.socket, Any] | int) -> None:
        self._arrivals.put(item)
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the wake-up pipe is full: the room is awake already
            pass

    def take_head(self, request: Any) -> bytes:
        """The request head the waiting room read from ``request`` (once)."""
        with self._heads_lock:
            return self._heads.pop(request, b"")

    def _dispatch(self, request: socket.socket, client_address: Any, head: bytes) -> None:
        """A complete request head: a slot and a thread, or 503 at once past the cap (or the peer's share)."""
        peer = str(client_address[0]) if isinstance(client_address, tuple) and client_address else "?"
        evicted = None
        with self._open_lock:
            mine = self._per_peer.get(peer, 0)
            admitted = mine < self.max_per_peer and self._slots.acquire(blocking=False)
            if not admitted:  # the slots (or this peer's share) are taken: a stalled writer's slot is handed on
                evicted = self._stalled_writer(peer if mine >= self.max_per_peer else None)
                admitted = evicted is not None
            if admitted:
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
                self._open[request] = (time.monotonic(), peer)
        if evicted is not None:
            try:
                evicted.shutdown(socket.SHUT_RDWR)  # its blocked send fails; its thread ends, releasing nothing
            except OSError:
                pass
        if not admitted:
            try:
                request.setblocking(False)
                request.send(_BUSY)  # fits an empty send buffer: never blocks the accepting thread
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._heads_lock:
            self._heads[request] = head
        try:
            request.settimeout(self.handler_timeout)
            ThreadingMixIn.process_request(self, request, client_address)
        except Exception:  # noqa: BLE001 - no thread (out of memory, interpreter exiting): this request only
            self._done(request)
            self.take_head(request)
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            known = self._forget_open(request)
        if known:
            self._slots.release()

    def _forget_open(self, request: Any) -> bool:
        """Take ``request`` off the served ones (``_open_lock`` held); whether it held a slot."""
        self._writing.pop(request, None)
        self._answering.discard(request)
        known = self._open.pop(request, None)
        if known is not None:
            left = self._per_peer.get(known[1], 1) - 1
            if left > 0:
                self._per_peer[known[1]] = left
            else:
                self._per_peer.pop(known[1], None)
        return known is not None

    def _writing_since(self, request: socket.socket, since: float | None) -> None:
        """A handler starts (``since``) or ends (None) writing a chunk to its client."""
        with self._open_lock:
            if since is None:
                self._writing.pop(request, None)
            elif request in self._open:
                self._writing[request] = since
                self._answering.add(request)

    def _stalled_writer(self, peer: str | None) -> socket.socket | None:
        """The request (of ``peer``, else of anyone) served longest whose answer is being written, if its
        client has not taken a chunk for :data:`STALLED` or the request arrived more than
        :data:`SLOW_ANSWER` ago: taken off the served ones, its slot now the caller's (``_open_lock`` held).

        Slow readers from a few addresses could otherwise hold every slot (a quarter each) for the whole
        handler timeout, and answer every fresh scrape 503; readers that trickle (16 KiB every 0.1 s)
        never stall a chunk for a second, so the answer's age counts too (issue 30).
        """
        now = time.monotonic()
        stalled: list[tuple[float, socket.socket]] = []
        for sock in self._answering:
            arrived, whose = self._open.get(sock, (now, ""))
            if peer is not None and whose != peer:
                continue
            if arrived < now - SLOW_ANSWER or self._writing.get(sock, now) < now - STALLED:
                stalled.append((arrived, sock))
        if not stalled:
            return None
        sock = min(stalled, key=lambda item: item[0])[1]
        self._forget_open(sock)
        return sock

    # -- the waiting room -----------------------------------------------------------------

    def _room(self) -> None:
        """Read the request heads of every waiting connection; hand complete ones to :meth:`_dispatch`."""
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closing.is_set():
                self._admit(sel)
                for key, _ in sel.select(timeout=self._next_expiry()):
                    if key.fileobj is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._read_head(sel, key.fileobj)  # type: ignore[arg-type]
                self._expire(sel)
        except Exception as exc:  # noqa: BLE001 - logged; the accepting thread then has nobody to hand to
            logger.warning("exporter.room_failed", reason=f"{exc.__class__.__name__}: {exc}")
        finally:
            for sock in list(self._waiting):
                self._drop(sel, sock)
            sel.close()

    def _admit(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while True:
            try:
                item = self._arrivals.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, int):  # out of descriptors: close the oldest waiting connections
                for sock in list(self._waiting)[:item]:
                    self._drop(sel, sock)
                continue
            sock, address = item
            waiting = _Waiting(address, now)
            mine = self._by_peer.setdefault(waiting.peer, {})
            if len(mine) >= MAX_WAITING_PER_PEER:
                self._drop(sel, next(iter(mine)))
            elif len(self._waiting) >= MAX_WAITING:
                busiest = max(self._by_peer.values(), key=len)
                self._drop(sel, next(iter(busiest)))
            try:
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                self.shutdown_request(sock)
                continue
            self._waiting[sock] = waiting
            self._by_peer.setdefault(waiting.peer, {})[sock] = None

    def _read_head(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        waiting = self._waiting.get(sock)
        if waiting is None:
            return
        try:
            data = sock.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # closed by the client (or reset)
            self._drop(sel, sock)
            return
        start = max(0, len(waiting.head) - 3)
        waiting.head += data
        tail = bytes(waiting.head[start:])
        if b"\r\n\r\n" in tail or b"\n\n" in tail:
            self._forget(sel, sock)
            self._dispatch(sock, waiting.address, bytes(waiting.head))
        elif len(waiting.head) > MAX_HEAD:
            try:
                sock.send(_TOO_LARGE)
            except OSError:
                pass
            self._drop(sel, sock)

    def _next_expiry(self) -> float:
        """Seconds until the oldest waiting connection runs out of time (at most one)."""
        if not self._waiting:
            return 1.0
        oldest = next(iter(self._waiting.values()))
        return max(0.0, min(1.0, oldest.since + self.handler_timeout - time.monotonic()))

    def _expire(self, sel: selectors.BaseSelector) -> None:
        """Close every waiting connection whose head is not complete ``timeout`` seconds after its accept."""
        cutoff = time.monotonic() - self.handler_timeout
        for sock, waiting in list(self._waiting.items()):  # in accept order: stop at the first in time
            if waiting.since > cutoff:
                return
            self._drop(sel, sock)

    def _forget(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        waiting = self._waiting.pop(sock, None)
        if waiting is not None:
            mine = self._by_peer.get(waiting.peer, {})
            mine.pop(sock, None)
            if not mine:
                self._by_peer.pop(waiting.peer, None)
        try:
            sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        self._forget(sel, sock)
        self.shutdown_request(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line in the log, not a traceback on the operator's terminal.

        A client that goes away (reset, broken pipe, timed out) is routine and
        logged at debug: anyone who can connect could otherwise grow the log
        with a warning per reset socket (issue 30).
        """
        import sys

        exc = sys.exc_info()[1]
        reason = f"{exc.__class__.__name__}: {exc}"
        if isinstance(exc, (ConnectionError, TimeoutError)):  # the client went away
            logger.debug("exporter.connection_failed", reason=reason)
        else:
            logger.warning("exporter.connection_failed", reason=reason)

    # -- the deadline ---------------------------------------------------------------------

    def _reap(self) -> None:
        deadline = self.handler_timeout * DEADLINE_TIMEOUTS
        while not self._closing.wait(min(1.0, self.handler_timeout)):
            now = time.monotonic()
            with self._open_lock:
                late = [sock for sock, (since, _) in self._open.items() if now - since > deadline]
            for sock in late:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read; it then closes
                except OSError:
                    pass

    def server_close(self) -> None:
        self._closing.set()
        self._arrive(0)
        super().server_close()


def serve(
    s: Settings,
    bind: str,
    port: int,
    timeout: float = DEFAULT_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    front: Front | None = None,
) -> MetricsServer:
    """A server listening on ``bind:port`` (0: any free port), not yet serving: call ``serve_forever``.

    ``front`` (:class:`celery_lockguard._page.Front`) adds basic auth and the lock page.
    """
    return MetricsServer((bind, port), s, timeout, max_connections, front)
