"""The real prefork workers the demo starts (:class:`celery_lockguard.testing.Worker`).

Every worker runs in its own session, so stopping one also reaches its pool
children by their process group -- and nothing else. Stopping is warm first
(SIGTERM to the main pid), then SIGKILL to the group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery_lockguard.testing import Worker, start_all

__all__ = ["Worker", "billing_worker", "wait_ready"]

ROOT = Path(__file__).resolve().parent.parent


def billing_worker(name: str, queue: str, env: dict[str, str], log_dir: Path, app: Any, concurrency: int = 2) -> Worker:
    """A prefork worker of the billing app (not started: :func:`wait_ready` starts them side by side)."""
    return Worker(
        "example_app.celery_app",
        control=app,
        concurrency=concurrency,
        name=name,
        queues=[queue],
        env=env,
        cwd=ROOT,
        loglevel="WARNING",
        log_path=log_dir / f"{name}.log",
    )


def wait_ready(workers: list[Worker], timeout: float = 40) -> None:
    """Start every worker and poll ``app.control.ping`` until all answer; fail fast (all stopped) if one exits."""
    start_all(workers, timeout)
