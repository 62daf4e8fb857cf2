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

**Every lease end wakes** (DESIGN, turn 3). The Lua side is one function,
``wake_oldest`` (``_scripts._WAKE_OLDEST``), shared by RELEASE, FORCE_RELEASE
and WAKE; the Python side is :func:`wake`, on each of their replies:

* a task's release: ``_release.release`` (RELEASE, reply read now or later);
* a release by token outside a task body -- a workflow's end, the testing
  helper ``lockguard.hold()``, a discarded woken copy: :func:`release`;
* an operator's forced release (``celery lockguard release``): FORCE_RELEASE, then :func:`wake`;
* a lease that ends with nobody to release it -- cut short from the worker's
  main process (hard time limit, terminate), freed by WORKFLOW_ABORT: WAKE
  (:func:`wake_if_free`, after the grace when the lease was only shortened:
  :func:`wake_later`);
* ``lock_limit`` slots: the same, on the slot's own lease hash; a limited task's
  waiter parks behind its N slots (PARK with every slot) and its woken copy
  adopts the slot reserved for it (ACQUIRE_SLOTS' ``replace_token``).

Only a lease that expires under a holder that is gone for good (SIGKILL, a
lost host) ends with no code running: its waiters start with their safety
copy, at the TTL (the RELEASE of a holder that outlived its own TTL still
wakes, since the entity is free).
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass
from typing import Any

from . import _connection as connection
from . import _republish as republish
from . import _scripts as scripts
from ._config import Settings
from ._events import emit
from ._keys import meta, slot_lock_name, wait_name, waiters_name
from ._lease import Woken, release_token
from ._lease import wake_if_free as wake_script

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


def entry_lifetime_ms(countdown: float) -> int:
    """How long a parked waiter entry lives: its safety copy's countdown plus :data:`ENTRY_SLACK`.

    The entry is the delivery's place in the queue, handed to its delayed safety copy: it must outlive
    that countdown plus the publish grace, or the copy comes back to no entry (and to the queue's tail).
    """
    return int((max(countdown, 0.0) + ENTRY_SLACK) * 1000)


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
    limit: int = 1,
) -> Parked:
    """Append this delivery to ``key``'s waiter queue (PARK); one round trip.

    ``first_parked_ms``: when this delivery first parked (a copy parking again behind a holder
    that outlived its safety countdown): it goes back ahead of everyone who parked after it.
    ``limit``: a ``lock_limit`` entity's N slots: it parks only while every one is taken.
    """
    lifetime_ms = entry_lifetime_ms(countdown)
    reply = scripts.park(
        client,
        [wait_name(prefix, key), waiters_name(prefix, key), *(slot_lock_name(prefix, key, i) for i in range(limit))],
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


def wake(app: Any, s: Settings, woken: Woken | None, releaser: str, releaser_id: str, client: Any = None) -> bool:
    """Publish the woken copy of the waiter RELEASE handed the entity to, then confirm; never raises.

    Called once, on RELEASE's reply. A failed publish is logged
    (``lock.wake_failed``); the waiter's safety copy then takes over after
    :data:`WAKE_GRACE` and the reservation lapses after :data:`RESERVATION_TTL`.
    Returns True if the woken copy was published.
    """
    if woken is None:
        return False
    for other in woken.also:  # a multi-entity release freed several entities: each wakes its own waiter
        wake(app, s, other, releaser, releaser_id, client)
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
        confirm(client or connection.client(s), s.key_prefix, woken.key, woken.park_token)
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


def reserve_ms() -> int:
    """The TTL (ms) every lease end gives the reservation it makes for the waiter it wakes."""
    return int(RESERVATION_TTL * 1000)


def release(
    app: Any,
    s: Settings,
    client: Any,
    key: str,
    token: str,
    releaser: str,
    releaser_id: str,
    lease_key: str | None = None,
) -> int:
    """End a lease by its token outside a task's own release and wake its oldest waiter; RELEASE's ``released``.

    The one path for a workflow's end, the testing helper ``hold()`` and a discarded woken copy's
    reservation. Raises what RELEASE raises (the caller decides how loud); :func:`wake` never raises.
    """
    released, _, woken = release_token(client, s.key_prefix, key, token, reserve_ms=reserve_ms(), lease_key=lease_key)
    wake(app, s, woken, releaser, releaser_id, client)
    return released


def wake_if_free(app: Any, s: Settings, key: str, releaser: str, releaser_id: str, limit: int = 1) -> bool:
    """WAKE: a lease of ``key`` ended with nobody to release it; if the entity is free, wake its oldest waiter.

    ``limit``: the entity's ``lock_limit`` (its N slot leases). Never raises; True if a woken copy went out.
    """
    try:
        woken = wake_script(connection.client(s), s.key_prefix, key, reserve_ms(), limit)
    except Exception as exc:  # noqa: BLE001 - the waiters' safety copies take over at the TTL
        emit("lock.backend_unavailable", releaser, lock_key=key, task_id=releaser_id, reason=f"wake: {exc}")
        return False
    return wake(app, s, woken, releaser, releaser_id)


def wake_later(app: Any, s: Settings, key: str, delay: float, releaser: str, releaser_id: str, limit: int = 1) -> None:
    """:func:`wake_if_free` after ``delay`` seconds, on a daemon timer: for a lease cut to a grace, not deleted.

    The worker's main process shortens a hard-limited or terminated holder's lease rather than delete
    it (the child may not be dead yet); once the grace has run out the entity is free, and this wakes
    its oldest waiter then instead of leaving it to its safety copy (the holder's whole TTL).
    """
    timer = threading.Timer(delay, wake_if_free, (app, s, key, releaser, releaser_id, limit))
    timer.daemon = True
    timer.start()


def task_id_of(woken: Woken | None) -> str | None:
    """The task id of a woken waiter's message (for an operator's output), or ``None``."""
    if woken is None:
        return None
    try:
        return str(json.loads(woken.message).get("options", {}).get("task_id") or "") or None
    except (TypeError, ValueError, AttributeError):
        return None


def withdraw(app: Any, s: Settings, key: str, park_token: str, task_name: str, task_id: str, limit: int = 1) -> bool:
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
        return abandon(app, s, key, park_token, task_name, task_id, limit)
    if state == "parked":
        emit("lock.handoff_dropped", task_name, lock_key=key, task_id=task_id, reason="discarded_while_parked")
    return state == "parked"


def abandon(app: Any, s: Settings, key: str, park_token: str, task_name: str, task_id: str, limit: int = 1) -> bool:
    """A woken copy the worker discards (revoked, expired): free its reservation and wake the next waiter.

    From the worker's main process; best effort. Without it the other waiters
    would wait for their safety copies, not just for the reservation's short TTL.
    ``limit``: the entity's ``lock_limit``: the reservation may be on any of its slot leases.
    """
    released = 0
    try:
        client = connection.client(s)
        for slot in range(limit):
            lease_key = slot_lock_name(s.key_prefix, key, slot) if limit > 1 else None
            released = release(app, s, client, key, park_token, task_name, task_id, lease_key=lease_key)
            if released == 1:
                break
    except Exception as exc:  # noqa: BLE001 - the reservation then lapses by its TTL
        emit("lock.backend_unavailable", task_name, lock_key=key, task_id=task_id, reason=f"abandon: {exc}")
        return False
    if released == 1:
        emit("lock.released", task_name, lock_key=key, task_id=task_id, reason="reservation freed")
    return released == 1
