"""Queue-time claims: names, lifetimes and context for ``until_started`` / ``until_done``.

A claim is taken in ``apply_async`` before the message is published and is
adopted by the worker that runs it. ``until_done`` claims the lease hash
itself (state ``queued`` → ``running``, with a fresh token); ``until_started``
claims a separate ``{K}:claim`` hash in the same slot, freed in the ACQUIRE
round trip when the body starts, so one copy can run while one more waits.

Every exit of a delivery that carried a claim frees it (:func:`free`, token
checked, so it never frees a newer message's claim) or hands it over with the
message (a wait); a publish that failed frees the claim it took.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery._state import _task_stack

from . import _calls as calls
from ._config import TaskOptions
from ._keys import claim_name, lock_name
from ._request import CALL

#: Seconds a claim stays ``publishing`` before its message must be confirmed; a publisher that fails or
#: dies mid-publish blocks identical publishes at most this long (they wait, never answered by it).
PUBLISH_GRACE = 15.0

#: Options Celery sets on a message that belongs to a canvas; a publish-time skip would stall it.
#: Presence counts, not truth: Celery publishes a chain's last link with ``chain=[]``.
_CANVAS_OPTIONS = ("group_id", "chord", "chain", "link", "link_error")


def claim_key(prefix: str, key: str, mode: str) -> str:
    """The Redis key a message of ``mode`` claims for entity ``key``."""
    return lock_name(prefix, key) if mode == "until_done" else claim_name(prefix, key)


def claim_keys(prefix: str, key: str, mode: str) -> list[str]:
    """Every key a message of ``mode`` may hold its claim in, for CLAIM and RELEASE_CLAIM.

    ``until_done`` claims the lease hash, or, while *different* work holds the entity,
    ``{K}:claim`` behind it (so identical work still queues once); ``until_started`` ``{K}:claim``.
    """
    if mode == "until_done":
        return [lock_name(prefix, key), claim_name(prefix, key)]
    return [claim_name(prefix, key)]


def claim_ttl_ms(queue_lock_ttl: float, countdown: float | None = None, eta: Any = None) -> int:
    """How long a claim lives: the queue TTL, plus the delay until a countdown/eta task is due."""
    return max(1, int((queue_lock_ttl + due_in(countdown, eta)) * 1000))


def due_in(countdown: float | None = None, eta: Any = None) -> float:
    """Seconds until a message published with ``countdown`` or ``eta`` is due (0 when neither, or past).

    A naive ``eta`` is UTC, as Celery reads it (``maybe_make_aware(naive_as_utc=True)``).
    """
    delay = 0.0
    if countdown:
        delay = float(countdown)
    elif eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if isinstance(when, datetime):
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            delay = (when - datetime.now(timezone.utc)).total_seconds()
    return max(delay, 0.0)


def retry_due_in(default_retry_delay: float | None, countdown: float | None = None, eta: Any = None) -> float:
    """Seconds until a ``retry()`` message is due, by Celery's rule: no ``eta`` and no ``countdown`` means
    ``default_retry_delay`` (180 s unless the task says otherwise). What a hand-over to that message covers."""
    if not eta and countdown is None:
        countdown = default_retry_delay
    return due_in(countdown, eta)


def covering_ttl_ms(base: float, delay: float) -> int:
    """TTL of what a delivery hands to a delayed message of itself (DESIGN, "a hand-over covers its countdown").

    ``base`` seconds on top of the message's ``delay``, and never less than the delay plus
    :data:`PUBLISH_GRACE`: a short ``queue_lock_ttl`` must not let the claim or record lapse
    before its own copy can come back for it.
    """
    delay = max(delay, 0.0)
    return max(1, int((max(base, 0.0) + delay) * 1000), int((delay + PUBLISH_GRACE) * 1000))


def retry_claim_ttl_ms(queue_lock_ttl: float, delay: float) -> int:
    """How long an ``until_done`` lease handed back as a claim to its own ``retry()`` message lives (HANDOVER).

    ``delay``: seconds until the retry is due (:func:`retry_due_in`).
    """
    return covering_ttl_ms(queue_lock_ttl, delay)


def wait_claim_ttl_ms(queue_lock_ttl: float, longest_wait: float) -> int:
    """How long a claim handed back to a delivery's own wait copy lives (``_hand_back``).

    ``longest_wait``: the longest countdown a wait copy is given (``_republish.max_countdown``); the
    claim is handed back before the wait's own countdown is drawn.
    """
    return covering_ttl_ms(queue_lock_ttl, longest_wait)


def in_canvas(options: dict[str, Any], link: Any = None) -> bool:
    """Whether the message is part of a chain, group or chord (never skipped at publish)."""
    return bool(link) or any(options.get(name) is not None for name in _CANVAS_OPTIONS)


def publishing_task_id() -> str | None:
    """The id of the task running in this thread, if any (its own republish is never a duplicate)."""
    task = _task_stack.top  # what ``celery.current_task`` proxies, without an import and a proxy per publish
    if task is None:
        return None
    request = getattr(task, "request", None)
    if request is None or request.called_directly:
        return None
    return getattr(request, "id", None)


def retry_keeps_entity(opts: TaskOptions, req: Any, args: Any, kwargs: Any) -> bool:
    """Whether the ``retry()`` message names the entity this delivery holds, so it can adopt a hand-over.

    ``retry(args=..., kwargs=...)`` may move the call to another entity: a claim handed over on the old
    one would never be adopted nor freed by that message, and would swallow identical work on the old
    entity for ``queue_lock_ttl``. Then the lease is released instead. Arguments that do not render
    cannot adopt a claim either.
    """
    held: calls.CallNames | None = getattr(req, CALL, None)
    if held is None or (args is None and kwargs is None):
        return True
    new_args = req.args if args is None else args
    new_kwargs = req.kwargs if kwargs is None else kwargs
    try:
        moved = calls.render(opts, req.id, tuple(new_args or ()), dict(new_kwargs or {}))
    except Exception:  # noqa: BLE001 - arguments that do not render: the retry cannot adopt a claim either
        return False
    return moved.key == held.key
