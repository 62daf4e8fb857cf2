"""Park and wake: a delivery waiting behind a live holder parks; the holder's release wakes the oldest waiter.

A blind back-off costs a re-publish per try and starts the next task up to a
whole countdown after the release. Instead a waiting delivery *parks*: PARK
appends an entry to the entity's waiter queue (``{K}:wait`` / ``{K}:waiters``,
same slot as the lease) holding the very message the releaser must re-publish,
and the delivery publishes ONE *safety copy* of itself (same task id, header
``lockguard_park`` = P) due when the holder's TTL runs out. RELEASE, when it
deleted its own lease, pops the oldest live entry, turns the lease hash into a
short *reservation* for it (token P, state ``handed``) so a fresh delivery
cannot barge in, marks it ``waking`` and answers it; the releaser publishes the
*woken copy* (same task id, P, ``lockguard_woken``) at once (:func:`wake`),
then confirms (``woken``). The woken copy adopts the reservation (ACQUIRE's
``replace_token``) and runs. Two publishes per waiting task, however long it waits.

The entry is the arbiter between the two copies of one message
(CHECK_PARKED, before ACQUIRE; :func:`_decision.decide_parked`): the woken copy
marks it ``running`` and its safety copy then drops itself; a safety copy that
finds it still ``waking`` past :data:`WAKE_GRACE` (the releaser died between
RELEASE and the publish) marks it ``taken`` and runs, and a late woken copy
then drops itself. Never both, never neither.

The releaser's part is :func:`wake`, called once on RELEASE's reply. A failed
wake publish never fails the releasing task: the waiter's safety copy takes
over after the grace.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

from . import _connection as connection
from . import _republish as republish
from . import _scripts as scripts
from ._config import Settings
from ._events import emit
from ._keys import lock_name, meta, wait_name, waiters_name
from ._lease import Woken, release_token

#: Most entries one entity's waiter queue holds; past it a waiting delivery backs off as before.
MAX_WAITERS = 1000
#: Seconds a woken waiter's reservation lives: its woken copy must reach a worker and ACQUIRE within it.
RESERVATION_TTL = 5.0
#: Seconds a safety copy leaves a ``waking`` entry to its releaser before it takes over.
WAKE_GRACE = 2.0
#: A grace no ``waking`` entry ever reaches (seconds): a discarded safety copy never takes over.
NEVER = 10.0**9
#: Seconds a parked entry outlives its safety copy's countdown before it counts as stale (never woken).
ENTRY_SLACK = 30.0
#: Seconds the waiter keys outlive the longest entry in them (woken entries wait for their safety copy).
KEYS_SLACK = 600.0

#: Test-only: a task name whose releasing process exits right after a RELEASE that woke a waiter,
#: before publishing the woken copy (the "releaser dies between release and wake-up" case). Read at import.
_EXIT_AFTER_RELEASE = os.environ.get("LOCKGUARD_TEST_EXIT_AFTER_RELEASE", "")


@dataclass(frozen=True)
class Parked:
    """PARK's answer: ``parked`` (with the lease's pttl), ``free`` (acquire now) or ``full``."""

    kind: str
    pttl_ms: int = 0


#: A safety copy comes back up to this much later than the holder's remaining TTL.
SAFETY_JITTER = 1.25


def safety_countdown(pttl_ms: int, s: Settings) -> float:
    """When the safety copy comes back: the holder's remaining TTL, jittered later, below the visibility timeout.

    A release wakes the waiter long before; the safety copy only acts when no
    wake came (the releaser died, or the holder is still alive and renewing).
    """
    countdown = max(pttl_ms / 1000, 0.05) * random.uniform(1.0, SAFETY_JITTER) + 0.05
    return min(countdown, max(0.05, s.visibility_timeout / 2))


def longest_safety_countdown(ttl: float, s: Settings) -> float:
    """The longest countdown :func:`safety_countdown` gives behind a holder whose lease TTL is ``ttl``."""
    return min(max(ttl, 0.05) * SAFETY_JITTER + 0.05, max(0.05, s.visibility_timeout / 2))


def message_for(task: Any, request: Any, args: Any, kwargs: Any, hdrs: dict[str, Any]) -> str | None:
    """The JSON of the woken copy's signature (this very message, no countdown), or ``None`` if not JSON-able."""
    sig = task.signature_from_request(request, args, kwargs, retries=request.retries, headers=hdrs)
    sig.options.pop("countdown", None)
    sig.options.pop("eta", None)
    try:
        return json.dumps(dict(sig), separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def park(
    client: Any,
    prefix: str,
    key: str,
    park_token: str,
    message: str,
    *,
    task_id: str,
    task_name: str,
    digest: str,
    countdown: float,
    first_parked_ms: int | None = None,
) -> Parked:
    """Append this delivery to ``key``'s waiter queue (PARK); one round trip.

    ``first_parked_ms``: when this delivery first parked (a copy parking again behind a holder
    that outlived its safety countdown): it goes back ahead of everyone who parked after it.
    """
    lifetime_ms = int((countdown + ENTRY_SLACK) * 1000)
    reply = scripts.park(
        client,
        [wait_name(prefix, key), waiters_name(prefix, key), lock_name(prefix, key)],
        [
            park_token,
            message,
            meta(task_id),
            meta(task_name),
            meta(digest),
            lifetime_ms,
            lifetime_ms + int(KEYS_SLACK * 1000),
            MAX_WAITERS,
            "" if first_parked_ms is None else first_parked_ms,
        ],
    )
    return Parked(reply[0], int(reply[1]) if reply[0] == "parked" else 0)


def check(client: Any, prefix: str, key: str, park_token: str, copy: str, grace: float = WAKE_GRACE) -> tuple[str, int]:
    """CHECK_PARKED for a safety or woken copy: (state found, ms since waking or -1)."""
    state, age = scripts.check_parked(
        client, [wait_name(prefix, key), waiters_name(prefix, key)], [park_token, copy, int(grace * 1000)]
    )
    return str(state), int(age)


def confirm(client: Any, prefix: str, key: str, park_token: str) -> bool:
    """CONFIRM_WAKE: the woken copy is published (``waking`` -> ``woken``)."""
    return bool(scripts.confirm_wake(client, [waiters_name(prefix, key)], [park_token]))


def wake(app: Any, s: Settings, woken: Woken | None, releaser: str, releaser_id: str) -> bool:
    """Publish the woken copy of the waiter RELEASE handed the entity to, then confirm; never raises.

    Called once, on RELEASE's reply. A failed publish is logged
    (``lock.wake_failed``); the waiter's safety copy then takes over after
    :data:`WAKE_GRACE` and the reservation lapses after :data:`RESERVATION_TTL`.
    Returns True if the woken copy was published.
    """
    if woken is None:
        return False
    if _EXIT_AFTER_RELEASE and _EXIT_AFTER_RELEASE == releaser:
        os._exit(17)
    fields: dict[str, Any] = {"lock_key": woken.key, "holder_task_id": releaser_id}
    try:
        spec = json.loads(woken.message)
        fields["task_id"] = spec.get("options", {}).get("task_id")
        publish(app, spec)
    except Exception as exc:  # noqa: BLE001 - the releasing task's result stands; the safety copy takes over
        emit("lock.wake_failed", releaser, **fields, reason=f"publish: {exc.__class__.__name__}: {exc}")
        return False
    emit("lock.woken", releaser, **fields)
    try:
        confirm(connection.client(s), s.key_prefix, woken.key, woken.park_token)
    except Exception as exc:  # noqa: BLE001 - the woken copy marks its entry running on arrival anyway
        emit("lock.backend_unavailable", releaser, **fields, reason=f"confirm wake: {exc.__class__.__name__}")
    return True


def publish(app: Any, spec: dict[str, Any]) -> None:
    """Publish a stored woken copy through the self-republish primitive (:func:`_republish.send`).

    The copy is the parked delivery itself (its task id, its burst, its park token), published by
    the releasing task: through ``apply_async`` as new work, a debounced waiter would start a new
    burst with a new countdown and replace the publishes made while it waited.
    """
    republish.send(app.signature(spec))


def withdraw(app: Any, s: Settings, key: str, park_token: str, task_name: str, task_id: str) -> bool:
    """A safety copy the worker discards (revoked, expired) before it ran: its entry leaves the waiter queue.

    From the worker's main process; best effort. CHECK_PARKED as the copy would have run it on
    arrival, except that a ``waking`` entry is never taken over. A ``waking`` entry's reservation is
    freed instead and the next waiter woken (:func:`abandon`): the woken copy carries the same id
    and the same absolute ``expires``, so it is discarded too, and a releaser that died before
    publishing it would otherwise leave the entity reserved for :data:`RESERVATION_TTL`. Without
    this the next release would hand the entity to a message that is gone, or re-publish a revoked
    task that a worker which forgot the revoke (a restart) would run.
    """
    try:
        state, _ = check(connection.client(s), s.key_prefix, key, park_token, "safety", grace=NEVER)
    except Exception as exc:  # noqa: BLE001 - the entry then goes stale at its deadline; a release skips it
        emit("lock.backend_unavailable", task_name, lock_key=key, task_id=task_id, reason=f"withdraw: {exc}")
        return False
    if state == "waking":
        return abandon(app, s, key, park_token, task_name, task_id)
    if state == "parked":
        emit("lock.handoff_dropped", task_name, lock_key=key, task_id=task_id, reason="discarded_while_parked")
    return state == "parked"


def abandon(app: Any, s: Settings, key: str, park_token: str, task_name: str, task_id: str) -> bool:
    """A woken copy the worker discards (revoked, expired): free its reservation and wake the next waiter.

    From the worker's main process; best effort. Without it the other waiters
    would wait for their safety copies, not just for the reservation's short TTL.
    """
    try:
        released, _, woken = release_token(
            connection.client(s), s.key_prefix, key, park_token, reserve_ms=int(RESERVATION_TTL * 1000)
        )
    except Exception as exc:  # noqa: BLE001 - the reservation then lapses by its TTL
        emit("lock.backend_unavailable", task_name, lock_key=key, task_id=task_id, reason=f"abandon: {exc}")
        return False
    if released == 1:
        emit("lock.released", task_name, lock_key=key, task_id=task_id, reason="reservation freed")
    wake(app, s, woken, task_name, task_id)
    return released == 1
