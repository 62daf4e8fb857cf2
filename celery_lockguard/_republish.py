"""Self-republishes: every message a delivery publishes of itself goes through :func:`send`.

A wait, a park's safety copy, the woken copy a releaser publishes for a parked
waiter, a watch copy, a debounce run's early re-delivery, a workflow member's
wait and ``retry()``'s message are copies of one delivery, not new work: they
must never pass the user's dedupe, claims or debounce (a claim check could
swallow the message while ``Retry`` is still raised: a lost job; a debounce
publish would start a new burst and a new countdown for a run already taken).
:func:`send` publishes them under :func:`own_copy`, a marker naming the
message's task id that ``apply_async`` reads as the ``own_copy`` fact
(``_decision.decide_publish`` / ``decide_debounce_publish``: BYPASS) whoever
publishes it -- the woken copy is published by the *releasing* task.
``apply_async`` is for new work.

A wait carries the delivery's queue claim on (hand-over); a watch copy never
carries one (the original adopted it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from . import _headers as headers
from . import _lease as lease_ops
from ._config import Settings


def max_countdown(s: Settings) -> float:
    """Longest countdown we give our own delayed messages: half the transport's ``visibility_timeout``.

    The Redis transport holds a message with a countdown unacknowledged and redelivers it once
    ``visibility_timeout`` passes, so a longer countdown would duplicate our own waits and watches.
    """
    return max(0.05, s.visibility_timeout / 2)


#: Longest step of a wait (seconds), and of a watch copy before its jitter.
MAX_WAIT_STEP = MAX_WATCH_STEP = 60.0
#: A watch copy comes back up to this much later than its step.
WATCH_JITTER = 1.25


def wait_countdown(waits: int, holder_ttl: float | None) -> float:
    """Seconds to wait: exponential in the number of waits, capped by the holder's TTL, jittered.

    Jitter spreads waiters over [50%, 100%] of the step, so a released key does
    not set off a retry storm.
    """
    step = min(0.25 * (2 ** min(waits, 10)), MAX_WAIT_STEP)
    if holder_ttl is not None:
        step = min(step, max(holder_ttl, 0.05))
    return max(0.05, step * random.uniform(0.5, 1.0))


def throttle_countdown(wait_ms: int) -> float:
    """Seconds a rate-limited start waits: until the window's oldest start leaves it, then a little jitter.

    Never earlier than the window allows (an early try would only be throttled again); the jitter
    (up to 10 % of the wait plus 50 ms, always added) spreads the waiters of one entity so they do
    not all ask in the same millisecond.
    """
    base = max(wait_ms, 1) / 1000
    return base + random.uniform(0.0, base * 0.1 + 0.05)


def watch_countdown(watches: int, ttl: float, s: Settings) -> float:
    """Seconds before a watch copy looks again: at least the lease TTL, growing, below the visibility timeout."""
    countdown = min(MAX_WATCH_STEP, max(ttl, 0.5 * 2**watches)) * random.uniform(1.0, WATCH_JITTER)
    return min(countdown, max_countdown(s))


def longest_wait_countdown(s: Settings) -> float:
    """The longest countdown :func:`wait_countdown` gives (after many waits, with ``max_countdown`` applied)."""
    return min(MAX_WAIT_STEP, max_countdown(s))


def longest_watch_countdown(s: Settings) -> float:
    """The longest countdown :func:`watch_countdown` gives."""
    return min(MAX_WATCH_STEP * WATCH_JITTER, max_countdown(s))


def _ours(request: Any) -> dict[str, Any]:
    """Lockguard's headers on this request: a worker's request carries them as attributes, not in ``headers``."""
    out = {**(request.headers or {})}
    for name in (*headers.ALL, headers.WORKFLOW):
        value = headers.read(request, name)
        if value is not None:
            out[name] = value
    return out


def without_ours(request: Any) -> dict[str, Any]:
    """The request's message headers without lockguard's: what a new attempt (``retry()``) carries on."""
    return {k: v for k, v in (request.headers or {}).items() if k not in headers.ALL}


def wait_headers(
    request: Any, attempt_token: str | None, claim_token: str | None = None, first_delivered_ms: int = 0
) -> dict[str, Any]:
    """Headers of a wait: one more wait spent, the claim handed over, the orphan-lease token if any.

    ``claim_token`` replaces the delivery's claim (a claim handed back after ACQUIRE consumed
    it; ``""``: none could be). A wait of a watch copy stays a watch copy. The first delivery's
    time is kept from the message, else ``first_delivered_ms`` (this delivery's start) is set.
    """
    out = {**_ours(request), headers.WAITS: headers.read_int(request, headers.WAITS) + 1}
    if first_delivered_ms and not headers.read_ms(request, headers.FIRST_DELIVERED):
        out[headers.FIRST_DELIVERED] = first_delivered_ms
    if claim_token:
        out[headers.CLAIM] = claim_token
    elif claim_token == "":
        out.pop(headers.CLAIM, None)
    if attempt_token:
        out[headers.ATTEMPT] = attempt_token
    else:
        out.pop(headers.ATTEMPT, None)
    return out


def watch_headers(request: Any, token: str) -> dict[str, Any]:
    """Headers of a watch copy: its number and token; no claim and no orphan token travel with it."""
    out = {**_ours(request), headers.WATCH: headers.read_int(request, headers.WATCH) + 1, headers.WATCH_TOKEN: token}
    out.pop(headers.CLAIM, None)
    out.pop(headers.ATTEMPT, None)
    return out


#: The task id of the copy :func:`send` is publishing in this context (``None``: new work).
_OWN_COPY: ContextVar[str | None] = ContextVar("lockguard_own_copy", default=None)


@contextmanager
def own_copy(task_id: str | None) -> Iterator[None]:
    """Within it, a publish of ``task_id`` is a delivery's copy of itself (see :func:`is_own_copy`).

    Keyed by task id, so a publish of other work inside it (a user ``apply_async`` override
    sending something else) is still new work.
    """
    token = _OWN_COPY.set(task_id)
    try:
        yield
    finally:
        _OWN_COPY.reset(token)


def is_own_copy(task_id: str | None) -> bool:
    """Whether the message ``apply_async`` is publishing is a copy :func:`send` (or ``retry()``) publishes."""
    return task_id is not None and _OWN_COPY.get() == task_id


def send(sig: Any) -> Any:
    """THE self-republish primitive: publish ``sig``, a copy of a delivery, past dedupe, claims and debounce.

    ``sig`` carries its task id and exactly the headers its decision gave it. A task registered
    here publishes through its own ``apply_async`` (so a composed class's publish still runs),
    which reads the marker as the ``own_copy`` fact; one that is not goes by name
    (``send_task``, which never claims or debounces).
    """
    with own_copy(sig.options.get("task_id") or sig.id):
        return sig.apply_async()


def publish(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float, hdrs: dict[str, Any]) -> Any:
    """Publish this request again (same task id, same retries count) after ``countdown``; returns the signature."""
    req = task.request
    sig = task.signature_from_request(req, args, kwargs, countdown=countdown, retries=req.retries, headers=hdrs)
    # A workflow member hands the workflow's lease to its own next copy before that copy can be delivered.
    from ._workflow import before_self_republish

    before_self_republish(task, countdown=countdown)  # the hand-over covers the countdown
    send(sig)
    return sig


def retry_when(sig: Any) -> float | None:
    """The republished copy's countdown, for ``Retry(when=...)``: Celery logs "Retry in 2.5s", not "at None"."""
    countdown = (getattr(sig, "options", None) or {}).get("countdown")
    return round(float(countdown), 3) if isinstance(countdown, (int, float)) else None


def arm_watch(client: Any, s: Settings, key: str, request: Any, countdown: float, ttl: float) -> str | None:
    """Arm the single pending watch of this task on ``key``: the new watch token, or ``None`` if one is pending."""
    token = lease_ops.new_token()
    armed = lease_ops.watch_arm(
        client,
        s.key_prefix,
        key,
        str(request.id),
        headers.read_str(request, headers.WATCH_TOKEN),
        token,
        int((countdown + ttl) * 1000) + 60_000,
    )
    return token if armed else None
