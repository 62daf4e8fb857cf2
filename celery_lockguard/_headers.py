"""Message headers lockguard puts on the messages it publishes, and how to read them back.

Celery hands custom headers to the worker either in ``request.headers`` or as
attributes of the request itself (depending on protocol and version), so every
read goes through :func:`read`.
"""

from __future__ import annotations

from typing import Any

#: Lock/outage waits spent so far, counted apart from ``request.retries`` (budget: ``lock_max_waits``).
WAITS = "lockguard_waits"
#: Marks a watch copy (see ``republish.watch``), with how many watches came before it.
WATCH = "lockguard_watch"
#: The watch copy's token: only the current one may re-arm the single pending watch (scripts.WATCH_ARM).
WATCH_TOKEN = "lockguard_watch_token"
#: The queue-time claim's token, from the publisher (or a retry's hand-over) to the worker that adopts it.
CLAIM = "lockguard_claim"
#: The token of the ACQUIRE a wait follows: a timed-out ACQUIRE may still have run on the server, and
#: the returning message must recognise that orphan lease as its own (it ACQUIREs with the same token).
ATTEMPT = "lockguard_attempt"

#: The park token P of a parked delivery's copies (safety and woken): its waiter entry, and the token of
#: the reservation RELEASE hands to it (``_handoff``).
PARK = "lockguard_park"
#: Marks the woken copy a releaser published (absent: the safety copy); see ``_decision.decide_parked``.
WOKEN = "lockguard_woken"

#: Every header lockguard sets; a self-republish carries each one it finds on.
#: When the delivery first parked (ms, the publisher's clock): a copy parking again keeps its place in the queue.
PARKED_AT = "lockguard_parked_at"

ALL = (WAITS, WATCH, WATCH_TOKEN, CLAIM, ATTEMPT, PARK, WOKEN, PARKED_AT)


def read(request: Any, name: str) -> Any:
    """A custom header of the message behind ``request``, or ``None``."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and headers.get(name) is not None:
        return headers[name]
    return request.get(name) if hasattr(request, "get") else None


def read_int(request: Any, name: str) -> int:
    """A counting header (``WAITS``, ``WATCH``), 0 when absent or unreadable."""
    try:
        return int(read(request, name) or 0)
    except (TypeError, ValueError):
        return 0


def read_str(request: Any, name: str) -> str:
    """A token header, ``""`` when absent."""
    value = read(request, name)
    return str(value) if value is not None else ""
