"""How a delivery lets go: release its lease (recording completion), give back, hand back or free a claim.

"Every exit frees what it holds": the delivery loop (:mod:`._delivery`), ``retry``,
``replace`` and ``apply_async`` all end a lease or a claim through these functions, and every
lease end wakes the oldest waiter (:class:`ReleaseReport` runs the releaser's part of the
hand-off on RELEASE's reply, now or when a deferred reply is read).
"""

from __future__ import annotations

import time
from typing import Any

from . import _claims as claims
from . import _connection as connection
from . import _errors as errors
from . import _events as events
from . import _handoff as handoff
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _multi as multi
from . import _records as records
from . import _republish as republish
from . import _tracing as tracing
from . import _wire as wire
from ._calls import CallNames
from ._config import Settings, TaskOptions
from ._events import emit
from ._lease import Lease
from ._renewer import renewer
from ._request import ORPHAN, event_fields


def give_back(task: Any, s: Settings, opts: TaskOptions, lease: Lease) -> None:
    """Release a lease no body ran on; with ``lock_rate``, take back the start it was counted as.

    A failure to take it back leaves the start counted (the safe side: the window under-admits
    until it passes) and says so.
    """
    release(task, s, opts, lease)
    if opts.rate is None:
        return
    try:
        lease_ops.unadmit(connection.client(s), s.key_prefix, lease)
    except Exception as exc:  # the start stays counted; the delivery's exit is unchanged
        if errors.classify(exc) is None:
            raise
        emit(
            "lock.backend_unavailable",
            task.name,
            lock_key=lease.key,
            task_id=lease.task_id,
            reason=f"start not taken back from the window: {errors.describe(exc)}",
        )


def free_orphan(task: Any, s: Settings, opts: TaskOptions, call: CallNames, client: Any, token: str) -> None:
    """After a ``fail_open`` body whose ACQUIRE errored: give back what that ACQUIRE may yet have taken.

    An ACQUIRE that timed out against a stalled server still runs when the server thaws, leaving a
    ``running`` lease (every entity of a multi-entity key, or a slot) under ``token`` that nobody renews
    or releases: the entity stayed blocked until ``lock_ttl`` behind a call that had ended. The give-back
    is token-checked (a no-op when the ACQUIRE never ran) and wakes the entity's waiter as any release
    does. Any error leaves it to its TTL, as before; it never changes the body's outcome.
    """
    now, ttl_ms, task_id = time.monotonic(), opts.ttl_ms, str(task.request.id)
    leases: list[Lease]
    if call.keys:
        leases = [lease_ops.MultiLease(call.keys, s.key_prefix, token, dict.fromkeys(call.keys, 0), ttl_ms, now,
                                       task_id, task.name)]  # fmt: skip
    elif opts.limit > 1 or opts.rate is not None:
        leases = [
            Lease(call.key, s.key_prefix, token, 0, ttl_ms, now, task_id, task.name, i) for i in range(opts.limit)
        ]
    else:
        leases = [Lease(call.key, s.key_prefix, token, 0, ttl_ms, now, task_id, task.name)]
    try:
        for lease in leases:
            released, _, woken = lease_ops.release_and_wake(
                client, lease, s.key_prefix, reserve_ms=handoff.reserve_ms()
            )
            handoff.wake(task.app, s, woken, task.name, task_id, client)
            if released == 1:
                return
    except Exception as exc:  # noqa: BLE001 - as a failing release: never the body's outcome; it expires by its TTL
        reason = f"a lease the fail-open attempt may have taken is left to its TTL: {errors.describe(exc)}"
        emit("lock.backend_unavailable", task.name, **event_fields(task, call), reason=reason)


def settle_orphan(req: Any) -> None:
    """Give back what a fail-open delivery's errored ACQUIRE may have taken, before a copy of it is published.

    ``retry()`` and ``replace()`` publish under the same task id: that copy must not meet the lease as a
    running original. A no-op when the request owes nothing (:class:`Orphan`, settled once).
    """
    orphan: Orphan | None = getattr(req, ORPHAN, None)
    if orphan is not None:
        orphan.settle()


class Orphan:
    """What a fail-open delivery owes when its ACQUIRE errored: :func:`free_orphan`, run once.

    Kept on the body's request (``_request.ORPHAN``): ``retry()`` settles it before it publishes the retry
    (a copy of the same task id meeting that lease would take it for a running original and drop itself),
    the delivery after the body.
    """

    def __init__(self, task: Any, s: Settings, opts: TaskOptions, call: CallNames, client: Any, token: str) -> None:
        self._args = (task, s, opts, call, client, token)
        self.settled = False

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            free_orphan(*self._args)


def keep_before(
    task: Any, s: Settings, call: CallNames, client: Any, token: str, blocker: str, countdown: float
) -> str:
    """A woken multi-entity copy blocked on ``blocker``: keep its reservations sorted before it, give back the rest.

    The kept ones get a fresh park token (returned; ``""`` when nothing was kept) for the wait to use, and
    last its safety copy's ``countdown`` plus the wake's grace and the reservation's own TTL, so the copy
    that comes back (woken or safety) still finds them, and a killed waiter's still lapse. ``blocker`` ``""``:
    give back every one. Wakes the given-back entities' waiters. Any error (an outage, a key of the wrong
    type) leaves them to their TTL, as a failing release does: the delivery still parks or waits, never lost.
    The new token is still returned then: a KEEP_BEFORE that timed out may yet have run (a frozen server
    thawing), re-tokening them to it for the whole countdown; the park carrying it adopts those instead of
    meeting them as an orphan held by nobody. (A wrong-type key stops it before any write: nothing re-tokened.)
    """
    new_token = lease_ops.new_token() if blocker else ""
    keep_ms = int((countdown + handoff.WAKE_GRACE + handoff.RESERVATION_TTL) * 1000)
    try:
        kept, woken = multi.keep_before(
            client, s.key_prefix, call.keys, token, new_token, blocker, keep_ms, handoff.reserve_ms()
        )
    except Exception as exc:  # noqa: BLE001 - reservations only: each lapses by its TTL; the job goes on
        error, woken = multi.split(exc)
        reason = f"reservations left to their TTL: {errors.describe(error)}"
        emit("lock.backend_unavailable", task.name, **event_fields(task, call), reason=reason)
        handoff.wake(task.app, s, woken, task.name, str(task.request.id), client)
        return new_token
    handoff.wake(task.app, s, woken, task.name, str(task.request.id), client)
    return new_token if kept else ""


def release(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    lease: Lease,
    done: CallNames | None = None,
    result: Any = None,
    later: bool = False,
    client: Any = None,
) -> None:
    """Stop renewal, then release; record completion after a successful body.

    ``later``: the exit after the body sends RELEASE without waiting for its reply, which
    is then read with this process's next lease command (or within ``_wire.DRAIN_DELAY``);
    the lease is free on the server either way, only its report comes later.
    A failing release never turns a successful body into a failure, whatever
    the error: the lease then expires by its TTL, and the event says so.
    ``client``: the process's client for ``s``, when the caller has it at hand.
    """
    renewer().untrack(lease)
    if lease.released:
        return
    scope, record, ttl_ms = None, "", 0
    if done is not None and opts.completion:
        record, ttl_ms = records.record_for(task, done, lease.task_id, result)
        if s.completion_backend == "redis":  # the record goes in RELEASE (records.store_for: in_scripts)
            scope = done.record
        else:
            records.record_elsewhere(task, records.store_for(task, s), done, lease.task_id, record, ttl_ms)
    if client is None:
        client = connection.client(s)
    ch = wire.channel(client)
    # Deferred only to a server on another host (``_wire.Channel.defers_release``); release_later decides
    # exactly (it declines on Cluster when the record lives in another slot).
    deferring = later and ch is not None and ch.defers_release
    report = ReleaseReport(task.app, s, task.name, lease, scope, detached=deferring)
    # Every lease end wakes, a slot lease's too: a shared (lock_limit) waiter into that very slot, an
    # exclusive one once the entity is wholly free (RELEASE checks, given the slot).
    reserve_ms = handoff.reserve_ms()
    try:
        if deferring and lease_ops.release_later(
            client, lease, s.key_prefix, report, scope, record, ttl_ms, reserve_ms
        ):
            # The task's span ends before the reply is read (its lock.released then goes to the logs and
            # metrics only): say on the span that the release went out. report.span is the span current
            # here (captured just above, or None when none records): no fields built for no span.
            if report.span is not None:
                fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence_field}
                fields["hold_ms"] = round(report.hold_ms)
                tracing.span_event("lock.release_sent", task.name, fields, report.span)
            return
        reply: tuple[int, int, lease_ops.Woken | None] | BaseException
        # Waited for in a worker (the server is on this host): the wake-up publish still runs apart, on
        # the replies thread, as for a deferred reply, so a stalled broker never holds the task past its body.
        report.wake_apart = later and ch is not None
        reply = lease_ops.release_and_wake(client, lease, s.key_prefix, scope, record, ttl_ms, reserve_ms)
    except Exception as exc:  # noqa: BLE001 - the body's outcome stands; the lease expires by its TTL
        lease.released = True
        reply = exc
    report(reply)


def hand_back(task: Any, s: Settings, opts: TaskOptions, call: CallNames, lease: Lease) -> str:
    """Turn a lease that consumed this delivery's queue claim back into a claim for its wait.

    ACQUIRE adopts the ``until_done`` claim (the lease hash itself) and deletes the
    ``until_started`` one; a delivery that then waits (the store is down, the reply came
    late) must hand a claim on, or an identical publish queues a second copy meanwhile.
    Returns the new claim token ("" when none could be handed on; the wait goes on without).
    """
    client, token = connection.client(s), lease_ops.new_token()
    ttl_ms = claims.wait_claim_ttl_ms(opts.queue_lock_ttl, republish.max_countdown(s))
    try:
        if opts.mode == "until_done":
            wake = lambda woken: handoff.wake(task.app, s, woken, task.name, lease.task_id, client)  # noqa: E731
            return token if lease_ops.handover(client, lease, token, ttl_ms, wake=wake) else ""
        release(task, s, opts, lease)
        got = lease_ops.claim(
            client,
            claims.claim_key(s.key_prefix, call.key, opts.mode),
            token=token,
            ttl_ms=ttl_ms,
            task_id=task.request.id,
            task_name=task.name,
            digest=call.digest,
        )
        return token if got.kind == "ok" else ""
    except Exception as exc:  # noqa: BLE001 - the wait still goes out; the claim lives out its TTL or is gone
        lease.released = True
        emit(
            "lock.backend_unavailable",
            task.name,
            **event_fields(task, call),
            reason=f"hand back: {errors.describe(exc)}",
        )
        return ""


def keep_claim(task: Any, s: Settings, opts: TaskOptions, call: CallNames, token: str) -> None:
    """Make this delivery's unconsumed queue claim live through the wait it is about to publish; best effort.

    A delivery that met a holder hands its claim (the header) on to its wait copy. Nothing else renews the
    claim, which would lapse ``queue_lock_ttl`` after the first publish while the message still waits, and
    identical work would queue a second copy (DESIGN: a hand-over covers its countdown). CLAIM by the same
    task id extends a queued claim (never shortens it) or, if it lapsed and nobody took its place, takes it
    again under the same token. An error leaves the claim to its TTL.
    """
    if not token or opts.mode == "while_running":
        return
    ttl_ms = claims.wait_claim_ttl_ms(opts.queue_lock_ttl, republish.max_countdown(s))
    try:
        lease_ops.claim(
            connection.client(s),
            claims.claim_keys(s.key_prefix, call.key, opts.mode),
            token=token,
            ttl_ms=ttl_ms,
            task_id=task.request.id,
            task_name=task.name,
            digest=call.digest,
        )
    except Exception as exc:  # the wait still goes out; the claim lives out its TTL
        if errors.classify(exc) is None:
            raise
        emit(
            "lock.backend_unavailable",
            task.name,
            **event_fields(task, call),
            reason=f"keep claim: {errors.describe(exc)}",
        )


def free_claim(
    task: Any, s: Settings, opts: TaskOptions, call: CallNames, token: str, task_id: str | None = None
) -> None:
    """Free a queue claim of ``task_id`` (this delivery's by default); best effort.

    Token-checked, so it never frees a newer message's claim. Called on every exit that
    consumes the message without handing the claim on, and when a publish that took (or
    was handed) a claim failed — else identical work would be swallowed for ``queue_lock_ttl``.
    """
    if not token or opts.mode == "while_running":
        return
    task_id = task_id or task.request.id
    fields = {"lock_key": call.key, "task_id": task_id}
    ckey = claims.claim_keys(s.key_prefix, call.key, opts.mode)
    try:
        freed = lease_ops.release_claim(connection.client(s), ckey, task_id, token)
    except Exception as exc:  # noqa: BLE001 - the claim then lives out its queue TTL; say so
        emit("lock.backend_unavailable", task.name, **fields, reason=f"free claim: {errors.describe(exc)}")
        return
    if freed:
        emit("lock.released", task.name, **fields, reason="claim freed")
        if opts.mode == "until_done":  # the claim was the entity's lease hash: a lease end, so it wakes
            handoff.wake_if_free(task.app, s, call.key, task.name, task_id, limit=opts.limit)


class ReleaseReport:
    """What a RELEASE reply means, logged and counted: now, or when a deferred reply is read.

    Everything it needs is captured when the lease is released (hold time, whether the body was
    told it was lost and, for a deferred reply, the log backend and the task's span): a deferred
    reply may be read on the renewer thread or inside the next task, where neither the time nor the
    context is this task's. A reply waited for is reported right here, in the task's own context.
    """

    __slots__ = (
        "app",
        "backend",
        "hold_ms",
        "lease",
        "scope",
        "settings",
        "span",
        "task_name",
        "wake_apart",
        "was_lost",
    )

    def __init__(
        self, app: Any, s: Settings, task_name: str, lease: Lease, scope: str | None, detached: bool = True
    ) -> None:
        self.app, self.settings = app, s
        self.task_name = task_name
        self.lease = lease
        self.scope = scope
        self.was_lost = lease.lost
        self.hold_ms = lease.hold_ms()
        #: ``detached``: the reply may be read on another thread or inside the next task, so the log backend
        #: and the span are captured now; otherwise (``None``) the report runs here, where both are current.
        self.backend: str | None = events.backend_choice() if detached else None
        self.span = tracing.current_span() if detached else None
        #: Publish the wake-up on the replies thread rather than here (a release waited for in a worker).
        self.wake_apart = False

    def _emit(self, event: str, **fields: Any) -> None:
        if self.backend is None:
            emit(event, self.task_name, **fields)
        else:
            events.emit_for(event, self.task_name, fields, backend=self.backend, span=self.span)

    def __call__(self, reply: tuple[int, int, lease_ops.Woken | None] | BaseException) -> None:
        lease, hold_ms = self.lease, round(self.hold_ms)
        fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence_field}
        if isinstance(reply, BaseException):
            error, woken = multi.split(reply)  # Cluster: the entities freed before or after the error still wake
            self._emit("lock.backend_unavailable", **fields, reason=f"release: {errors.describe(error)}")
            if self.scope is not None:
                self._emit(
                    "completion.record_failed",
                    task_id=lease.task_id,
                    scope=self.scope,
                    reason=f"release: {errors.describe(error)}",
                )
            self._hand_on(woken)
            return
        released, _recorded, woken = reply
        metrics.observe_hold(self.task_name, self.hold_ms)
        if released == 1:
            # Still ours in Redis, yet past its validity here (e.g. a renewal delayed in flight): the body
            # was told it was lost, so say so once even though the key survived.
            if self.was_lost and lease.mark_lost("expired"):
                self._emit("lock.lost", **fields, hold_ms=hold_ms, reason="expired")
            self._emit("lock.released", **fields, hold_ms=hold_ms, lost=self.was_lost)
        else:
            reason = "expired" if released == 0 else "taken_by_another_holder"
            if lease.mark_lost(reason):
                self._emit("lock.lost", **fields, hold_ms=hold_ms, reason=reason)
            self._emit("lock.expired_before_release", **fields, hold_ms=hold_ms, reason=reason)
        self._hand_on(woken)

    def _hand_on(self, woken: lease_ops.Woken | None) -> None:
        """The one place the releaser's part of park and wake runs, on RELEASE's reply (never raises)."""
        if woken is not None and self.wake_apart:
            wire.run_apart(self._wake, woken)
        else:
            self._wake(woken)

    def _wake(self, woken: lease_ops.Woken | None) -> None:
        handoff.wake(self.app, self.settings, woken, self.task_name, self.lease.task_id)
