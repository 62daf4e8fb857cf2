"""A loopback TCP proxy that can delay replies: latency injected on the lock connection."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from celery_lockguard.testing import free_port


class DelayProxy:
    """Forwards 127.0.0.1:<port> to a target; every server→client chunk waits ``delay`` seconds."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.delay = 0.0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> DelayProxy:
        self._spawn(self._accept)
        return self

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._socks += [client, upstream]
            self._spawn(self._pipe, client, upstream, False)
            self._spawn(self._pipe, upstream, client, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if delayed and self.delay:
                    time.sleep(self.delay)  # the injected fault itself, not synchronisation
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
