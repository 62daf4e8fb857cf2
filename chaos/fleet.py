"""Worker processes of the soak.

Each worker is a :class:`celery_lockguard.testing.Worker` (``celery worker -P
prefork``) in its own session, so its process group is exactly the worker and
its pool children: ``pause()`` freezes the whole worker the way a stopped VM
would, and a stray child is reached at shutdown -- and nothing else on the machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lockguard.testing import Worker, start_all, stop_all

__all__ = ["Worker", "chaos_worker", "stop_all", "wait_ready"]

ROOT = Path(__file__).resolve().parent.parent


def chaos_worker(
    name: str, cfg: dict[str, Any], log_dir: Path, concurrency: int, app: Celery, queues: list[str] | None = None
) -> Worker:
    """A prefork worker of the chaos app (not started: :func:`wait_ready` starts a fleet side by side)."""
    return Worker(
        "chaos.app:app",
        control=app,
        concurrency=concurrency,
        name=name,
        queues=queues or [cfg["queue"]],
        env={"CHAOS_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        log_path=log_dir / f"{name}.log",
    )


def wait_ready(workers: list[Worker], timeout: float = 60) -> None:
    """Start every worker and poll ``app.control.ping`` until all answer; fail fast (all stopped) if one exits."""
    start_all(workers, timeout)
