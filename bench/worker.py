"""A real ``celery worker`` subprocess (prefork) for :mod:`bench.workerapp`, and polling helpers.

The worker is :class:`celery_lockguard.testing.Worker`: ready when it answers
``app.control.ping``; stopped warmly with SIGTERM to its main pid only, killed
(its whole session) if it hangs.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from celery_lockguard import testing

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / ".bench" / "logs"


class Worker(testing.Worker):
    """One prefork ``celery worker`` of the bench app (:class:`celery_lockguard.testing.Worker`).

    Keeps the bench's signature: the config travels as JSON in ``LG_BENCH_CONFIG``, the
    queue is ``cfg["queue"]``, the log goes to ``.bench/logs``, WARNING so logging costs
    the measured worker as little as it would in production.
    """

    def __init__(self, app: Celery, cfg: dict[str, Any], concurrency: int, loglevel: str = "WARNING") -> None:
        name = f"bench{uuid.uuid4().hex[:6]}"
        super().__init__(
            "bench.workerapp:app",
            control=app,
            concurrency=concurrency,
            name=name,
            queues=[cfg["queue"]],
            env={"LG_BENCH_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            loglevel=loglevel,
            log_path=LOG_DIR / f"{name}.log",
        )
        self.cfg = cfg

    def start(self, timeout: float = 60) -> Worker:
        super().start(timeout)
        return self

    def log(self) -> str:
        """The log's tail, for a failure message."""
        return self.output(4000)
