"""Structured lock events: logged through structlog and counted in one call.

The library never configures structlog; the application's configuration
decides where events go. Field names are a contract (docs/reference.md).
"""

from __future__ import annotations

from typing import Any

import structlog

from . import _metrics as metrics
from . import _tracing as tracing

logger = structlog.get_logger("celery_lockguard")

#: Per-task routine events are debug (volume); anything an operator must see is info or above.
_LEVELS = {
    "lock.acquired": "debug",
    "lock.released": "debug",
    "lock.renewed": "debug",
    "lock.lost": "warning",
    "lock.max_hold_reached": "warning",
    "lock.expired_before_release": "warning",
    "lock.force_released": "warning",
    "lock.fail_open": "warning",
    "lock.backend_unavailable": "warning",
    "fence.stale": "warning",
    "lock.wait_budget_exhausted": "warning",
    "lock.under_replicated": "warning",
    "completion.record_failed": "warning",
}


def emit(event: str, task_name: str | None = None, **fields: Any) -> None:
    """Log ``event`` with its fields and count it for ``task_name``."""
    metrics.count(task_name or "-", event)
    tracing.span_event(event, task_name, fields)
    level = _LEVELS.get(event, "info")
    getattr(logger, level)(event, task_name=task_name, **fields)
