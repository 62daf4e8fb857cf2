"""How a delivery waits: re-delivered later, parked behind a holder, or leaving a watch copy.

Each is a self-republish (:mod:`._republish`): it never walks back in through
``apply_async``. Debounce's outage wait and a checkpoint's store-error wait use :func:`wait`
too, so ``lock_max_waits`` is one budget. A workflow member checks the lock order before it
waits or parks (never wait in a cycle).
"""

from __future__ import annotations

import time
from typing import Any

from celery.exceptions import Ignore, Reject

from . import _connection as connection
from . import _errors as errors
from . import _handoff as handoff
from . import _headers as headers
from . import _lease as lease_ops
from . import _multi as multi
from . import _republish as republish
from . import _request as request_state
from . import _workflow as workflow
from ._calls import CallNames
from ._config import Settings, TaskOptions
from ._decision import (
    Decision,
    ParkedAction,
    after_park,
    decide_parked,
)
from ._events import emit
from ._lease import Holder, Throttled
from ._request import event_fields
from .exceptions import BackendUnavailable, LockContended, LockThrottled

#: Longest an eager call (``.apply()``, ``task_always_eager``) waits, in seconds, on top of ``lock_max_waits``:
#: it waits in the caller's thread, and a budget of 100 growing waits is over an hour of a blocked caller.
EAGER_MAX_WAIT = 60.0

#: Decision reasons of an outage: their exits follow ``on_unavailable``; every other wait or give-up, ``on_locked``.
_OUTAGE_REASONS = frozenset({"backend_unavailable", "acquire_slower_than_ttl"})


def wait(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    call: CallNames,
    decision: Decision,
    holder: Holder | None,
    attempt_token: str | None,
    claim_token: str | None = None,
    first_ms: int = 0,
    throttled: Throttled | None = None,
) -> Any:
    """Re-deliver this call later, without spending ``max_retries``; the budget is ``lock_max_waits``.

    Returns the published signature, or ``None`` after waiting in this process (eager, or the
    publish failed: Celery's own retry() would ``Reject(requeue=False)`` and drop the message, and
    when the broker is the Redis that is down there is nowhere else to wait).
    """
    req = task.request
    workflow.check_lock_order(task, call.key)  # a workflow member: never wait in a lock-order cycle
    waits = headers.read_int(req, headers.WAITS)
    holder_ttl = holder.pttl_ms / 1000 if holder is not None else None
    if throttled is not None:  # the window says when a start is admitted: wait for that, not a guess
        countdown = min(republish.throttle_countdown(throttled.wait_ms), republish.max_countdown(s))
    else:
        countdown = min(republish.wait_countdown(waits, holder_ttl), republish.max_countdown(s))
    fields = {**event_fields(task, call), "reason": decision.reason, "waits": waits}
    if req.is_eager:
        _eager_bound(task, call, holder, throttled, countdown, fields)
    emit_waiting(task, opts, call, decision, holder, countdown, waits, policy_of(opts, decision.reason))
    emit(
        "lock.retry_scheduled",
        task.name,
        **fields,
        countdown=round(countdown, 3),
        policy=policy_of(opts, decision.reason),
    )
    hdrs = republish.wait_headers(req, attempt_token, claim_token, first_ms)
    if not req.is_eager:
        try:
            return republish.publish(task, req.args or (), req.kwargs or {}, countdown, hdrs)
        except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the task
            # fields carries the wait's reason: this event's reason replaces it (a duplicate keyword raised)
            failed = {**fields, "policy": "wait_in_process", "reason": f"publish failed: {exc.__class__.__name__}"}
            emit("lock.backend_unavailable", task.name, **failed)
    time.sleep(countdown)
    req.headers = hdrs
    return None


def _eager_bound(
    task: Any,
    call: CallNames,
    holder: Holder | None,
    throttled: Throttled | None,
    countdown: float,
    fields: dict[str, Any],
) -> None:
    """Give up visibly once an eager call's waits would pass :data:`EAGER_MAX_WAIT` (from its first wait)."""
    req = task.request
    started = getattr(req, request_state.EAGER_STARTED, None)
    if started is None:
        started = time.monotonic()
        setattr(req, request_state.EAGER_STARTED, started)
    waited = time.monotonic() - started
    if waited + countdown <= EAGER_MAX_WAIT:
        return
    emit(
        "lock.wait_budget_exhausted",
        task.name,
        **fields,
        policy="eager_max_wait",
        waited=round(waited, 3),
        max_wait=EAGER_MAX_WAIT,
    )
    if holder is None and throttled is None:
        raise BackendUnavailable(
            f"task {task.name!r}: lock store unavailable for {call.key!r}: an eager call waited {waited:.1f}s "
            f"and gives up before {EAGER_MAX_WAIT:g}s ({fields['reason']})"
        )
    raise contention_error(task, call, holder, None, throttled)


def emit_waiting(
    task: Any,
    opts: TaskOptions,
    call: CallNames,
    decision: Decision,
    holder: Holder | None,
    countdown: float,
    waits: int,
    policy: str,
) -> None:
    """The one line per wait an operator reads (info): who holds the entity, when this call tries again
    (a parked call: at the latest), and which attempt of ``lock_max_waits`` this is. Celery's own
    "retry: Retry in Ns" line says when too."""
    emit(
        "lock.waiting",
        task.name,
        **{**event_fields(task, call), **multi.blocked_fields(call, holder)},
        reason=decision.reason,
        holder_task_id=holder.task_id if holder is not None else None,
        holder_task_name=holder.task_name if holder is not None else None,
        countdown=round(countdown, 3),
        attempt=waits + 1,
        max_waits=opts.max_waits,
        policy=policy,
    )


def park(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    call: CallNames,
    client: Any,
    decision: Decision,
    holder: Holder,
    free_retries: int,
    first_ms: int = 0,
    park_token: str = "",
    countdown: float | None = None,
    orphans: frozenset[str] = frozenset(),
) -> Any:
    """Park behind ``holder`` and publish the one safety copy; see :mod:`celery_lockguard._handoff`.

    ``park_token``/``countdown``: chosen by the caller when it already handed something to this wait
    (a multi-entity waiter's kept reservations carry the park token and last the countdown).
    ``orphans``: tokens the park's copies adopt a holder of their own id under (header ``lockguard_attempt``).

    Returns the safety copy's signature (the caller raises ``Retry``), ``"acquire_again"`` (the
    lease was gone by PARK), ``"adopt:<P>"`` (the safety copy's publish failed, yet a releaser had
    already woken us: ACQUIRE adopting P), or ``None``: back off as before (arguments that are not
    JSON, a full queue, or a failed publish whose entry was taken back). An error at PARK is no answer:
    PARK may have run, so the safety copy goes out all the same (``after_park``'s ``unconfirmed``).
    """
    req = task.request
    workflow.check_lock_order(task, call.key)  # a workflow member: never park in a lock-order cycle
    park_token = park_token or lease_ops.new_token()
    # A copy of a delivery that parked before keeps its place in the queue (not the tail).
    first = headers.read_int(req, headers.PARKED_AT) or None
    hdrs = {
        **republish.wait_headers(req, headers.attempt_value(orphans) or None, first_delivered_ms=first_ms),
        headers.PARK: park_token,
        headers.PARKED_AT: first or int(time.time() * 1000),
        **multi.park_headers(call),
    }
    hdrs.pop(headers.WOKEN, None)
    args, kwargs = req.args or (), req.kwargs or {}
    message = handoff.message_for(task, req, args, kwargs, {**hdrs, headers.WOKEN: 1})
    countdown = handoff.safety_countdown(holder.pttl_ms, s) if countdown is None else countdown
    fields = {**event_fields(task, call), "reason": decision.reason, "waits": headers.read_int(req, headers.WAITS)}
    answer: Any = "unserializable"
    if message is not None:
        try:
            answer = handoff.park(
                client,
                s.key_prefix,
                call.key,
                park_token,
                message,
                task_id=req.id,
                task_name=task.name,
                digest=call.digest,
                countdown=countdown,
                first_parked_ms=hdrs[headers.PARKED_AT],
                limit=opts.limit,
            ).kind
        except Exception as exc:
            if errors.classify(exc) is None:
                raise
            emit("lock.backend_unavailable", task.name, **{**fields, "reason": f"park: {errors.describe(exc)}"})
            answer = "unavailable"
    then = after_park(answer, free_retries)
    if then not in ("parked", "unconfirmed"):
        return "acquire_again" if then == "acquire_again" else None
    if then == "unconfirmed":
        # The copy is this park's safety copy (it carries the park token), due when a wait would be: what the
        # caller handed to the park token lasts the longer safety countdown, so it outlives this one.
        waits_spent, holder_ttl = headers.read_int(req, headers.WAITS), holder.pttl_ms / 1000
        countdown = min(countdown, republish.wait_countdown(waits_spent, holder_ttl), republish.max_countdown(s))
    emit_waiting(task, opts, call, decision, holder, countdown, fields["waits"], "park")
    emit("lock.retry_scheduled", task.name, **fields, countdown=round(countdown, 3), policy="park")
    try:
        return republish.publish(task, args, kwargs, countdown, hdrs)
    except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the task: take the entry back
        failed = {**fields, "policy": "park", "reason": f"publish failed: {exc.__class__.__name__}"}
        emit("lock.backend_unavailable", task.name, **failed)
    try:
        state, age = handoff.check(client, s.key_prefix, call.key, park_token, "safety", grace=0)
    except Exception as exc:  # noqa: BLE001 - cannot tell whether a releaser woke us: adopt if it did
        emit("lock.backend_unavailable", task.name, **{**fields, "reason": f"unpark: {errors.describe(exc)}"})
        return f"adopt:{park_token}"
    action, why = decide_parked("safety", state, age, 0)  # type: ignore[arg-type]
    if action is ParkedAction.DROP:
        emit("lock.handoff_dropped", task.name, **event_fields(task, call), reason=why)
        raise Ignore()  # a releaser woke us and the woken copy is out: it runs the job
    return f"adopt:{park_token}" if state == "waking" else None


def settle_parked(task: Any, s: Settings, call: CallNames, client: Any, park_token: str) -> None:
    """A copy of a parked delivery settles with its entry: returns to ACQUIRE, or raises ``Ignore``.

    Within the grace of a releaser still publishing, it looks again in this process (a short,
    bounded wait: the releaser either publishes within ms or has died).
    """
    req = task.request
    copy = "woken" if headers.read(req, headers.WOKEN) else "safety"
    grace_ms = int(handoff.WAKE_GRACE * 1000)
    while True:
        state, age = handoff.check(client, s.key_prefix, call.key, park_token, copy, handoff.WAKE_GRACE)
        action, reason = decide_parked(copy, state, age, grace_ms)  # type: ignore[arg-type]
        if action is ParkedAction.PROCEED:
            return
        if action is ParkedAction.DROP:
            emit("lock.handoff_dropped", task.name, **event_fields(task, call), reason=reason)
            raise Ignore()  # the other copy of this message runs the job; store nothing under its id
        time.sleep(min(0.1, max(0.01, (grace_ms - age) / 1000)))


def watch(task: Any, s: Settings, opts: TaskOptions, call: CallNames) -> None:
    """Before dropping a redelivered copy of a running task, leave a delayed watch copy behind.

    Dropping the copy acknowledges it, and on the Redis transport that also
    deletes the original's entry in ``unacked``: if the original's child
    is then killed, its ``reject(requeue=True)`` restores nothing and the
    job would be lost. The watch copy (same task id) comes back later: if
    the original completed, it stores nothing (``Ignore``); if it still
    runs, it watches again with a longer countdown; if it died, it takes
    over and runs. It needs completion records to tell "finished" from
    "died", so without them the copy is only dropped (documented).
    """
    req = task.request
    if not opts.completion or req.is_eager:
        return
    watches = headers.read_int(req, headers.WATCH)
    fields = {**event_fields(task, call), "reason": "watching_running_original", "waits": watches}
    if watches >= opts.max_waits:
        emit("lock.wait_budget_exhausted", task.name, **fields, policy=opts.on_locked)
        return
    countdown = republish.watch_countdown(watches, opts.ttl, s)
    try:
        token = republish.arm_watch(connection.client(s), s, call.key, req, countdown, opts.ttl)
        if token is None:  # a watch of this task is already pending: this copy is a duplicate of one
            return
        republish.publish(task, req.args or (), req.kwargs or {}, countdown, republish.watch_headers(req, token))
    except Exception as exc:
        # fields carries reason="watching_running_original": this event's reason replaces it
        failed = {**fields, "policy": "watch", "reason": f"publish failed: {exc}"}
        emit("lock.backend_unavailable", task.name, **failed)
        # Hand the copy back to the broker instead (a redelivery is an acks_late message): it comes back
        # and decides again -- the original finished, still runs (watch again) or died (take over).
        raise Reject(f"watch not published: {exc}", requeue=True) from exc
    emit("lock.retry_scheduled", task.name, **fields, countdown=round(countdown, 3), policy="watch")


def contention_error(
    task: Any, call: CallNames, holder: Holder | None, failure: BaseException | None, throttled: Throttled | None = None
) -> LockContended | BackendUnavailable:
    """The error a wait's ``Retry`` carries, or a give-up raises: what the delivery met, in the caller's terms."""
    if throttled is not None:
        rate = task.lockguard_options.rate
        return LockThrottled(call.key, throttled.wait_ms, rate.text if rate is not None else None)
    if holder is not None:
        return LockContended(holder.entity or call.key, holder.task_id, holder.pttl_ms)
    reason = errors.describe(failure) if failure is not None else "acquire_slower_than_ttl"
    return BackendUnavailable(f"task {task.name!r}: lock store unavailable for {call.key!r}: {reason}")


#: The republished copy's countdown, for ``Retry(when=...)`` (one rule for every self-republish: the
#: debounce and workflow waits use it too).
when = republish.retry_when


def policy_of(opts: TaskOptions, reason: str) -> str:
    """The policy an exit's event names: the one that decided it."""
    return opts.on_unavailable if reason in _OUTAGE_REASONS else opts.on_locked
