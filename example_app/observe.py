"""Route celery-lockguard's structlog events in a worker: count them, then log them.

The library logs through structlog and never configures it; the application
does. This is one way to watch lock decisions: a processor that counts each
event in a Redis hash (field ``<event>|<task name>|<reason>``) before the event is
rendered. Counting is synchronous, so a child killed with SIGKILL loses
nothing it already logged -- the demo's report needs exact numbers. (The
library's own metrics, flushed every few seconds, trade that exactness for no
round trip per event; they are what ``celery lockguard stats`` reads.)
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any

import redis
import structlog

_PREFIXES = ("lock.", "completion.", "fence.")


def configure(redis_url: str, counter_key: str) -> None:
    """Count lock events in ``counter_key`` and write info-and-above events as JSON lines to stderr."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2)

    def count(_: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        name = str(event.get("event", ""))
        if name.startswith(_PREFIXES):
            try:
                field = f"{name}|{event.get('task_name') or '-'}|{event.get('reason') or ''}"
                client.hincrby(counter_key, field, 1)
            except redis.RedisError:
                pass  # observing must never fail a task
        return event

    def drop_debug(_: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method == "debug":
            raise structlog.DropEvent
        return event

    structlog.configure(
        processors=[
            count,
            drop_debug,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
