"""Queue-time claims: names, lifetimes and context for ``until_started`` / ``until_done``.

A claim is taken in ``apply_async`` before the message is published and is
adopted by the worker that runs it. ``until_done`` claims the lease hash
itself (state ``queued`` → ``running``, with a fresh token); ``until_started``
claims a separate ``{K}:claim`` hash in the same slot, freed in the ACQUIRE
round trip when the body starts, so one copy can run while one more waits.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .keys import claim_name, lock_name

#: Message header carrying the claim token from publisher to worker.
CLAIM_HEADER = "lockguard_claim"

#: Options Celery sets on a message that belongs to a canvas; a publish-time skip would stall it.
_CANVAS_OPTIONS = ("group_id", "chord", "chain", "link")


def claim_key(prefix: str, key: str, mode: str) -> str:
    """The Redis key a message of ``mode`` claims for entity ``key``."""
    return lock_name(prefix, key) if mode == "until_done" else claim_name(prefix, key)


def claim_ttl_ms(queue_lock_ttl: float, countdown: float | None = None, eta: Any = None) -> int:
    """How long a claim lives: the queue TTL, plus the delay until a countdown/eta task is due."""
    delay = 0.0
    if countdown:
        delay = float(countdown)
    elif isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo or timezone.utc) if eta.tzinfo else datetime.now()
        delay = (eta - now).total_seconds()
    elif isinstance(eta, str):
        parsed = datetime.fromisoformat(eta)
        now = datetime.now(parsed.tzinfo) if parsed.tzinfo else datetime.now()
        delay = (parsed - now).total_seconds()
    return max(1, int((queue_lock_ttl + max(delay, 0.0)) * 1000))


def in_canvas(options: dict[str, Any], link: Any = None) -> bool:
    """Whether the message is part of a chain, group or chord (never skipped at publish)."""
    return bool(link) or any(options.get(name) for name in _CANVAS_OPTIONS)


def publishing_task_id() -> str | None:
    """The id of the task running in this thread, if any (its own republish is never a duplicate)."""
    from celery import current_task

    task = current_task
    if task is None:
        return None
    request = getattr(task, "request", None)
    if request is None or request.called_directly:
        return None
    return getattr(request, "id", None)


def header(request: Any, name: str) -> Any:
    """A custom message header: Celery puts them in ``request.headers`` or on the request itself."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and headers.get(name) is not None:
        return headers[name]
    return request.get(name) if hasattr(request, "get") else None
