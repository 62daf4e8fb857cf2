"""Message headers lockguard puts on the messages it publishes, and how to read them back.

Celery hands custom headers to the worker either in ``request.headers`` or as
attributes of the request itself (depending on protocol and version), so every
read goes through :func:`read`.
"""

from __future__ import annotations

from typing import Any

from celery.app.task import Context

#: Lock/outage waits spent so far, counted apart from ``request.retries`` (budget: ``lock_max_waits``).
WAITS = "lockguard_waits"
#: Marks a watch copy (see ``republish.watch``), with how many watches came before it.
WATCH = "lockguard_watch"
#: The watch copy's token: only the current one may re-arm the single pending watch (scripts.WATCH_ARM).
WATCH_TOKEN = "lockguard_watch_token"
#: The queue-time claim's token, from the publisher (or a retry's hand-over) to the worker that adopts it.
CLAIM = "lockguard_claim"
#: The tokens (comma-separated) a copy may find its own orphans under: the ACQUIRE a wait follows (a
#: timed-out ACQUIRE may still have run on the server), or reservations a multi-entity delivery kept or gave
#: back (KEEP_BEFORE) with a call whose reply was lost. The returning message recognises a holder of its own
#: id under one of them as its own, and adopts it; never a holder under a token no copy of it carried.
ATTEMPT = "lockguard_attempt"
#: At most this many tokens travel in ATTEMPT (a delivery adds two at most; a bound against a forged header),
#: each at most this long (ours are 32 hex digits): anything else is no token of ours and is dropped.
MAX_ATTEMPT_TOKENS, MAX_TOKEN_LEN = 4, 64

#: The park token P of a parked delivery's copies (safety and woken): its waiter entry, and the token of
#: the reservation RELEASE hands to it (``_handoff``).
PARK = "lockguard_park"
#: The entity a multi-entity delivery parked on (the one that blocked it; ``_multi``): its copies settle with
#: that entity's waiter queue and give its reservation back if another entity blocks them then.
PARK_ENTITY = "lockguard_park_entity"
#: Marks the woken copy a releaser published (absent: the safety copy); see ``_decision.decide_parked``.
WOKEN = "lockguard_woken"

#: When the delivery first parked (ms, the publisher's clock): a copy parking again keeps its place in the queue.
PARKED_AT = "lockguard_parked_at"
#: When the message was first delivered (unix ms, that worker's clock), set on its first wait or park and
#: carried by every copy after: the lock-wait histogram counts from it to the acquisition, re-queued waits
#: included. A ``retry()`` is a new attempt and starts again.
FIRST_DELIVERED = "lockguard_first_delivered"

#: The debounce burst a message belongs to (``_debounce``): a wait copy carries it on and is recognised as
#: the burst's run; ``retry()`` drops it (a retry is a new attempt, never debounced).
DEBOUNCE = "lockguard_debounce"

#: Every header lockguard sets; a self-republish carries each one it finds on.
ALL = (WAITS, WATCH, WATCH_TOKEN, CLAIM, ATTEMPT, PARK, PARK_ENTITY, WOKEN, PARKED_AT, FIRST_DELIVERED, DEBOUNCE)

#: The workflow a message is a member of (``_workflow.Spec``: entity key, workflow id, TTLs, policies),
#: set on every member when ``workflow()`` publishes. Not in :data:`ALL`: a retry keeps it (a new attempt
#: of the same member), and every self-republish carries it on (``_republish``).
WORKFLOW = "lockguard_workflow"


#: Every header name lockguard reads from a delivered message (:data:`ALL` and :data:`WORKFLOW`).
_OURS = frozenset((*ALL, WORKFLOW))


def carried(request: Any) -> bool:
    """Whether the message behind ``request`` may carry a lockguard header; ``False`` on a plain first delivery.

    One set test per place a header can be (``request.headers``, the request's own fields) decides
    what would otherwise be a :func:`read` per header, each ``None``: a delivery that is no wait,
    park, watch, claim or workflow member reads none of them. A request that is not Celery's
    ``Context`` answers ``True`` (read each header as usual).
    """
    if type(request) is not Context:
        return True
    found = request.__dict__
    if not _OURS.isdisjoint(found):
        return True
    h = found.get("headers")
    return isinstance(h, dict) and not _OURS.isdisjoint(h)


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
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON ``Infinity`` (int(inf))
        return 0


#: Above any time a header of ours can carry (ms): JSON-exact, and an int64 on AMQP.
_MAX_MS = 2**53


def read_ms(request: Any, name: str) -> int:
    """A time header (unix ms, ``FIRST_DELIVERED``), 0 when absent, unreadable or not a plausible time.

    Anyone who can publish can set it: a value <= 0 or beyond any clock would put a wait of
    10^19 ms into the counters, which no ``HINCRBY`` can add, so it reads as absent.
    """
    value = read_int(request, name)
    return value if 0 < value < _MAX_MS else 0


def read_str(request: Any, name: str) -> str:
    """A token header, ``""`` when absent."""
    value = read(request, name)
    return str(value) if value is not None else ""


def attempt_tokens(request: Any) -> frozenset[str]:
    """The orphan tokens the message carries (:data:`ATTEMPT`), at most :data:`MAX_ATTEMPT_TOKENS`."""
    raw = read_str(request, ATTEMPT)
    if not raw:
        return frozenset()
    return frozenset(t for t in raw.split(",", MAX_ATTEMPT_TOKENS)[:MAX_ATTEMPT_TOKENS] if 0 < len(t) <= MAX_TOKEN_LEN)


def attempt_value(tokens: frozenset[str]) -> str:
    """The :data:`ATTEMPT` header carrying ``tokens`` (``""`` for none), read back by :func:`attempt_tokens`."""
    return ",".join(sorted(tokens))
