"""A real ``celery worker`` subprocess (prefork) for :mod:`bench.workerapp`, and polling helpers.

Ready when it answers ``app.control.ping``; stopped warmly with SIGTERM to its
main pid only, killed (main pid and its children, by pid) if it hangs.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery

from celery_lockguard.testing import child_pids

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / ".bench" / "logs"

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Worker:
    """One prefork ``celery worker`` of the bench app."""

    def __init__(self, app: Celery, cfg: dict[str, Any], concurrency: int, loglevel: str = "WARNING") -> None:
        self.app = app
        self.cfg = cfg
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.nodename = f"bench{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{self.nodename.split('@')[0]}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Worker:
        env = {**os.environ, "LG_BENCH_CONFIG": json.dumps(self.cfg), "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "bench.workerapp:app",
                    "worker",
                    "-P",
                    "prefork",
                    "-c",
                    str(self.concurrency),
                    "-n",
                    self.nodename,
                    f"--loglevel={self.loglevel}",
                    "-Q",
                    self.cfg["queue"],
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._pong, timeout, f"worker {self.nodename} to answer ping", interval=0.2)
        return self

    def _pong(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return bool(self.app.control.ping(destination=[self.nodename], timeout=0.5))

    def children(self) -> list[int]:
        """Pids of the pool's child processes."""
        assert self.proc is not None
        return child_pids(self.proc.pid)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown: SIGTERM the main pid only; SIGKILL it and its children if it hangs."""
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
