"""Worker processes of the soak, and the faults applied to them.

Each worker is a ``celery worker -P prefork`` started in its own session, so
its process group is exactly the worker and its pool children: pausing the
group (SIGSTOP) freezes the whole worker the way a stopped VM would, and a
stray child can be reached at shutdown -- and nothing else on the machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lockguard.testing import child_pids, wait_for_workers

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One prefork worker of the chaos app; ``pause``/``resume`` act on its whole process group."""

    def __init__(
        self, name: str, cfg: dict[str, Any], log_dir: Path, concurrency: int, queues: list[str] | None = None
    ) -> None:
        self.nodename = f"{name}@{socket.gethostname()}"
        self.log_path = log_dir / f"{name}.log"
        self.paused = False
        env = {**os.environ, "CHAOS_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)}
        queue_list = ",".join(queues or [cfg["queue"]])
        cmd = [
            sys.executable, "-m", "celery", "-A", "chaos.app:app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-n", self.nodename, "-Q", queue_list,
            "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def children(self) -> list[int]:
        """Pids of the pool's children (parent pid = this worker's main process, read from /proc)."""
        return child_pids(self.proc.pid)

    def kill_child(self, rng: random.Random) -> int | None:
        """SIGKILL one pool child chosen at random; returns its pid (None if it has none right now)."""
        kids = self.children()
        if not kids:
            return None
        pid = rng.choice(kids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def pause(self) -> None:
        """SIGSTOP the main process and every child: a frozen machine, renewer thread included."""
        self.paused = True
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """Resume if paused (a stopped process cannot act on SIGTERM), then ask for a warm shutdown."""
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
        self.paused = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown (SIGTERM to the main pid), then SIGKILL the group if it hangs."""
        self.terminate()
        if self.proc.poll() is None:
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


def stop_all(workers: list[Worker], timeout: float = 20) -> None:
    """Stop every worker, the warm shutdowns running side by side."""
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        w.stop(max(0.1, deadline - time.monotonic()))


def wait_ready(app: Celery, workers: list[Worker], timeout: float = 60) -> None:
    """Poll ``app.control.ping`` until every worker answers; fail fast if one exits."""
    wait_for_workers(
        app, {w.nodename: w.proc for w in workers}, timeout, logs={w.nodename: w.log_tail for w in workers}
    )
