"""Real ``celery worker`` subprocesses for integration tests.

Workers are :class:`celery_lockguard.testing.Worker` (ready when it answers
``app.control.ping``; stopped warmly by SIGTERM to its main pid only, killed if
it hangs) configured for ``tests.workerapp`` by a JSON config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lockguard import testing
from celery_lockguard.testing import wait_for

ROOT = Path(__file__).resolve().parent.parent


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
        # Dies with the test run even when it is SIGKILLed (a Ctrl-C reaches it directly: same process group).
        preexec_fn=testing._die_with_parent if threading.current_thread() is threading.main_thread() else None,
    )


class Worker(testing.Worker):
    """One ``celery worker`` of ``tests.workerapp`` configured by ``cfg`` (prefork unless ``pool`` says).

    A thin layer over :class:`celery_lockguard.testing.Worker` that keeps the suite's
    signature: the config travels as JSON in ``LG_CONFIG``, the queue is ``cfg["queue"]``.
    """

    def __init__(
        self,
        app: Celery,
        cfg: dict[str, Any],
        name: str | None = None,
        concurrency: int = 2,
        log_dir: Path | None = None,
        pool: str = "prefork",
    ) -> None:
        name = name or f"w{uuid.uuid4().hex[:6]}"
        super().__init__(
            "tests.workerapp:app",
            control=app,
            pool=pool,
            concurrency=concurrency,
            name=name,
            queues=[cfg["queue"]],
            env={"LG_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            log_path=(log_dir or Path("/tmp")) / f"lockguard-{name}.log",
        )
        self.cfg = cfg

    def log(self) -> str:
        """The whole log (the suite counts events in it)."""
        return self.output()


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
