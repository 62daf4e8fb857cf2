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
import time
from pathlib import Path
from typing import Any

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
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and parent_pid(int(entry.name)) == self.proc.pid:
                out.append(int(entry.name))
        return out

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


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def wait_ready(app: Any, workers: list[Worker], timeout: float = 40) -> None:
    """Poll ``app.control.ping`` until every worker answers; fail fast if one exits."""
    deadline = time.monotonic() + timeout
    pending = {w.nodename: w for w in workers}
    while pending:
        for w in pending.values():
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.nodename} exited with {w.proc.returncode}:\n{w.log_tail()}")
        replies = app.control.ping(destination=list(pending), timeout=0.5) or []
        for reply in replies:
            for name in reply:
                pending.pop(name, None)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(pending)} did not answer within {timeout}s")
