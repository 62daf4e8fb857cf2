"""Processes the demo starts: the embedded Valkey and real prefork workers.

Every process is started in its own session, so stopping one can also reach
its pool children by their process group -- and nothing else. Stopping is
warm first (SIGTERM to the main pid), then SIGKILL to the group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from celery_lockguard.testing import child_pids, wait_for_workers

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One ``celery worker -P prefork`` subprocess of the billing app."""

    def __init__(self, name: str, queue: str, env: dict[str, str], log_dir: Path, concurrency: int = 2) -> None:
        self.nodename = f"{name}@{socket.gethostname()}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "celery", "-A", "example_app.celery_app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-n", self.nodename, "-Q", queue,
            "--loglevel=WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def children(self) -> list[int]:
        """Pids of the pool's child processes (read from /proc: parent pid = this worker)."""
        return child_pids(self.proc.pid)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15) -> None:
        """Warm shutdown (SIGTERM to the main pid); SIGKILL the whole process group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: strays of this worker only
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def wait_ready(app: Any, workers: list[Worker], timeout: float = 40) -> None:
    """Poll ``app.control.ping`` until every worker answers; fail fast if one exits."""
    wait_for_workers(
        app, {w.nodename: w.proc for w in workers}, timeout, logs={w.nodename: w.log_tail for w in workers}
    )
