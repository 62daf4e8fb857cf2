"""Real ``celery worker`` subprocesses for integration tests.

A worker is started with ``python -m celery worker -P prefork`` and is ready
when it answers ``app.control.ping``; it is stopped warmly by SIGTERM to its
main pid only (the children finish their task), and killed if it hangs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lockguard.testing import child_pids

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def spawn_celery(cfg: dict[str, Any], command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``celery -A tests.workerapp:app <command>`` configured by ``cfg``, its output in ``log_path``."""
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)}
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", *command],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


class Worker:
    """One ``celery worker`` process (prefork) for the app configured by ``cfg``."""

    def __init__(
        self,
        app: Celery,
        cfg: dict[str, Any],
        name: str | None = None,
        concurrency: int = 2,
        log_dir: Path | None = None,
    ) -> None:
        self.app = app
        self.cfg = cfg
        self.name = name or f"w{uuid.uuid4().hex[:6]}"
        self.nodename = f"{self.name}@{socket.gethostname()}"
        self.concurrency = concurrency
        self.log_path = (log_dir or Path("/tmp")) / f"lockguard-{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> Worker:
        self.proc = spawn_celery(
            self.cfg,
            [
                "worker",
                "-P",
                "prefork",
                "-c",
                str(self.concurrency),
                "-n",
                self.nodename,
                "--loglevel=INFO",
                "-Q",
                self.cfg["queue"],
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            self.log_path,
        )
        wait_for(self._pong, timeout, interval=0.2, what=f"worker {self.nodename} to answer ping\n{self.log()}")
        return self

    def _pong(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return bool(self.app.control.ping(destination=[self.nodename], timeout=0.5))

    def children(self) -> list[int]:
        """Pids of the pool's child processes."""
        assert self.proc is not None
        return child_pids(self.proc.pid)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown: SIGTERM the main pid only; SIGKILL the group if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [*self.children(), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(10)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Beat:
    """A ``celery beat`` process for the app configured by ``cfg`` (stopped by SIGTERM)."""

    def __init__(self, cfg: dict[str, Any], log_dir: Path) -> None:
        self.cfg = cfg
        self.dir = log_dir
        self.log_path = log_dir / f"beat-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> Beat:
        self.proc = spawn_celery(
            self.cfg, ["beat", "--loglevel=INFO", "-s", str(self.dir / "beat-schedule"), "--pidfile", ""], self.log_path
        )
        wait_for(
            lambda: "Sending due task" in self.log_path.read_text(errors="replace"),
            timeout,
            interval=0.1,
            what="beat to send its first task",
        )
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
