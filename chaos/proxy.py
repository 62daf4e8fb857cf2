"""A loopback TCP proxy that can be cut: a private PostgreSQL endpoint for the completion store.

The soak never stops the shared PostgreSQL server. The workers reach the
completion store through this proxy instead (``lockguard_completion_backend``
names the proxy's port), while the ledger, the fences and the history go to
the server directly. :meth:`CutProxy.cut` is the outage: every connection
through the proxy is closed at once and new ones are refused (the listening
socket is closed), exactly what a client sees when the database host goes
away. :meth:`CutProxy.restore` listens again on the same port.

One thread runs a selector over the listener and every connection pair; the
traffic is small (a lookup, a checkpoint and a record per task).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

from celery_lockguard.testing import free_port


class CutProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; :meth:`cut` drops and refuses, :meth:`restore` resumes."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.connections = 0  # accepted since start: shows the workers really went through the proxy
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._peer: dict[socket.socket, socket.socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pg-proxy", daemon=True)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    @classmethod
    def for_dsn(cls, dsn: str) -> CutProxy:
        """A proxy in front of the host and port of a ``postgresql://`` DSN."""
        parts = urlsplit(dsn)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def dsn(self, dsn: str) -> str:
        """``dsn`` with its host and port replaced by the proxy's."""
        parts = urlsplit(dsn)
        user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    @property
    def up(self) -> bool:
        return self._listener is not None

    def start(self) -> CutProxy:
        self._listen()
        self._thread.start()
        return self

    def _listen(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        listener.setblocking(False)
        with self._lock:
            self._listener = listener
            self._sel.register(listener, selectors.EVENT_READ, "accept")
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def cut(self) -> None:
        """The outage: close the listener and every proxied connection (clients get a reset or a refusal)."""
        with self._lock:
            listener, self._listener = self._listener, None
            if listener is not None:
                self._drop(listener)
            for sock in list(self._peer):
                self._drop(sock)
        self._wake()

    def restore(self) -> None:
        """Listen again on the same port."""
        if self._listener is None:
            self._listen()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    def _drop(self, sock: socket.socket) -> None:
        """Unregister and close ``sock`` (caller holds the lock); its peer goes with it."""
        peer = self._peer.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()
        if peer is not None:
            self._peer.pop(peer, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(peer)
            with contextlib.suppress(OSError):
                peer.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        sock.recv(4096)
                elif key.data == "accept":
                    self._accept(sock)
                else:
                    self._pump(sock)

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        with self._lock:
            if self._listener is not listener:  # cut while connecting
                client.close()
                upstream.close()
                return
            self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                a.setblocking(True)
                a.settimeout(5)
                self._peer[a] = b
                self._sel.register(a, selectors.EVENT_READ, "pump")

    def _pump(self, src: socket.socket) -> None:
        with self._lock:
            dst = self._peer.get(src)
            if dst is None:
                return
            try:
                data = src.recv(65536)
                if not data:
                    raise OSError("closed")
                dst.sendall(data)
            except OSError:
                self._drop(src)
