"""What every ``lockguard doctor`` check shares: the finding, and reading the app's broker and limits.

A module of its own so the checks can live in small modules (``_doctor``,
``_doctor_broker``, ``_doctor_beat``) without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+socket", "socket")
#: Transports that redeliver an unacknowledged message after ``visibility_timeout``.
VISIBILITY_SCHEMES = (*REDIS_SCHEMES, "sentinel", "sqs")
#: Transports that talk to RabbitMQ, whose analogue of the visibility timeout is ``consumer_timeout``.
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp", "librabbitmq")


@dataclass
class Finding:
    """One problem: a stable code, what is wrong and what to do, and the tasks concerned."""

    code: str
    message: str
    tasks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "tasks": self.tasks}


def server_of(url: str | None) -> tuple[str, ...] | None:
    """Which server a Redis URL names (db and credentials aside), or ``None`` if not a plain Redis URL."""
    if not url:
        return None
    parts = urlsplit(str(url).split(";")[0].strip())
    if parts.scheme not in REDIS_SCHEMES:
        return None
    if parts.scheme in ("unix", "redis+socket", "socket"):
        return ("unix", parts.path)
    host = parts.hostname or "localhost"
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    return ("tcp", host, str(parts.port or 6379))


def db_of(url: str | None) -> int:
    if not url:
        return 0
    parts = urlsplit(str(url).split(";")[0].strip())
    path = parts.path.strip("/")
    return int(path) if path.isdigit() else 0


def broker_url(app: Any) -> str:
    """The first URL (a failover list names its first) of the broker the workers consume from.

    As Celery reads it: ``CELERY_BROKER_URL`` (or ``CELERY_BROKER_READ_URL``) in
    the environment, then ``broker_read_url``, then ``broker_url``. That broker's
    transport is the one that redelivers an unacknowledged message.
    """
    from ._config import broker_url as configured

    return configured(app, read=True)


def broker_scheme(app: Any) -> str:
    return urlsplit(broker_url(app)).scheme


def limit(task: Any, app: Any, which: str) -> float | None:
    """A task's ``time_limit`` or ``soft_time_limit``: the task option, else the ``task_*`` setting."""
    value = getattr(task, which, None)
    if value is None:
        value = app.conf.get(f"task_{which}")
    return float(value) if value else None


def seconds(value: float) -> str:
    """A duration as an operator reads it: ``90s``, ``1800s (30 min)``, ``7200s (2 h)``."""
    if value >= 7200:
        return f"{value:g}s ({value / 3600:.3g} h)"
    if value >= 120:
        return f"{value:g}s ({value / 60:.3g} min)"
    return f"{value:g}s"
