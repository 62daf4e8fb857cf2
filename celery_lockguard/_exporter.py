"""``lockguard exporter``: the fleet's metrics over HTTP for Prometheus, hardened against who connects.

Each scrape of ``/metrics`` reads the flushed totals and the processes'
gauges from Redis (one pipeline, plus one ``MGET`` when any process holds a
lease: never a ``SCAN``) and answers them as Prometheus text
(:func:`celery_lockguard._stats.prometheus`). The
server is a thread per connection, bounded every way a client (or a port
scanner, or a half-open load balancer) can hold it:

* **a handler timeout** (``timeout``): a connection that sends nothing for
  that long is closed, so idle sockets do not hold threads for ever;
* **a deadline** (``4 * timeout``): a client that trickles one byte at a time
  (each read within the timeout) is cut off there, by a reaper thread;
* **a connection cap** (``max_connections``): past it, a new connection gets
  ``503`` at once from the accepting thread and is closed, with no thread of
  its own (200 idle sockets no longer make 200 threads);
* **backoff on accept errors**: out of file descriptors (``EMFILE``), the
  listening socket stays readable while ``accept`` keeps failing, and the
  serving loop spun on it at 100% CPU, starving the scrapes it was failing;
  it now sleeps 50 ms doubling to 1 s between attempts, and logs once per run
  of failures.

Read-only: GET and HEAD are served, any other method is answered 405. With
``--page`` the same server (and so every bound above) also serves the lock
page, and with ``--auth`` asks every request for basic auth
(:mod:`celery_lockguard._page`).

A scrape that fails answers with a status, never an empty reply: 503 when the
lock Redis is unreachable, 500 for anything else (a value no worker writes,
a key of the wrong type); the server keeps serving either way.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
        self._open: dict[socket.socket, float] = {}
        self._open_lock = threading.Lock()
        self._backoff = 0.0
        self._closing = threading.Event()
        # An IPv6 literal (``--bind ::1``) needs an IPv6 socket; the class default is IPv4.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, MetricsHandler)
        threading.Thread(target=self._reap, name="lockguard-exporter-reaper", daemon=True).start()

    # -- accepting --------------------------------------------------------------------------

    def get_request(self) -> tuple[Any, Any]:
        try:
            conn = super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                if not self._backoff:
                    logger.warning("exporter.accept_failed", reason=f"{errno.errorcode.get(exc.errno)}: {exc}")
                self._backoff = min(max(self._backoff * 2, BACKOFF_FIRST), BACKOFF_MAX)
                self._closing.wait(self._backoff)
            raise
        self._backoff = 0.0
        return conn

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(_BUSY)  # fits an empty send buffer: never blocks the accepting thread
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            known = self._open.pop(request, None) is not None
        if known:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line in the log, not a traceback on the operator's terminal."""
        import sys

        exc = sys.exc_info()[1]
        logger.warning("exporter.connection_failed", reason=f"{exc.__class__.__name__}: {exc}")

    # -- the deadline ---------------------------------------------------------------------

    def _reap(self) -> None:
        deadline = self.handler_timeout * DEADLINE_TIMEOUTS
        while not self._closing.wait(min(1.0, self.handler_timeout)):
            now = time.monotonic()
            with self._open_lock:
                late = [sock for sock, since in self._open.items() if now - since > deadline]
            for sock in late:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read; it then closes
                except OSError:
                    pass

    def server_close(self) -> None:
        self._closing.set()
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
