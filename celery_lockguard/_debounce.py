"""Debounce (``lock_debounce=seconds``): a burst of publishes for one entity becomes one run, the last.

Publish (:func:`publish`): DEBOUNCE_PUBLISH makes the new message the entity's
latest *pending* run (task id, arguments digest, due time) in
``{prefix}:v1:{K}:debounce:<task>`` and returns the *burst* it belongs to; the
message is published with ``countdown=seconds`` and the burst in a header, and
DEBOUNCE_SETTLE then says how the publish ended (its reply is read later: the
message is out either way). A failed publish puts back the run it replaced,
so a broker error never leaves a burst without a run.

Delivery (:func:`arrive`, before the lease): DEBOUNCE_TAKE answers in one round
trip whether this message is its burst's run (due: *take* it, then ACQUIRE as
any delivery), was *superseded* (consume it without running; the result and
the ``lock.superseded`` event name the burst's run), is early (wait the rest),
or cannot tell because the record is gone (*missing*: run, never lose one).
Taking the pending run clears it, so a publish during the run starts a new
burst: one more run, after the running one (a debounced task never skips a
holder as a duplicate; it waits for it).

Nothing is held across the delay: a worker that dies holding the surviving
message (an ETA message, unacknowledged under ``acks_late``) leaves it to the
broker's redelivery, and the redelivered copy asks DEBOUNCE_TAKE again
(*take* if nobody took it, *taken* if the dead worker had: then the lease and
completion rules handle it as any redelivery). Self-republishes (``retry()``,
waits, ``replace``) and canvas members bypass debounce (DESIGN); so does the
woken copy a releaser publishes for a parked run (``_republish.send``): it is
that run, still its burst's, and DEBOUNCE_START decides it like any taken run.
A burst's keys live :func:`record_ttl_ms`, past a dead worker's redelivery.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from celery.exceptions import Retry

from . import _calls as calls
from . import _claims as claims
from . import _connection as connection
from . import _errors as errors
from . import _headers as headers
from . import _keys as keys
from . import _republish as republish
from . import _scripts as scripts
from . import _waits as waiting
from . import _wire
from ._config import Settings, TaskOptions
from ._config import settings as settings_of
from ._decision import (
    Action,
    DebounceAction,
    Debounced,
    DebouncePublish,
    DebouncePublishAction,
    Decision,
    decide_debounce_publish,
    decide_debounce_start,
    decide_debounced,
)
from ._events import emit
from ._holders import cut_field, number, server_ms
from .exceptions import BackendUnavailable, ConfigurationError

#: Seconds a delivery that came early waits in its worker process; longer, it republishes itself.
EARLY_IN_PROCESS = 1.0

#: Tries to put back the run a failed publish replaced, before the error is only logged.
SETTLE_ATTEMPTS = 4

#: The result a superseded message stores (its ``AsyncResult.children[0]`` is the burst's run too).
SUPERSEDED = "superseded"


class Send(Protocol):
    """The next ``apply_async`` in the MRO (the actual publish)."""

    def __call__(self, args: Any, kwargs: Any, task_id: str | None, link: Any = None, **options: Any) -> Any: ...


def superseded_result(survivor: str) -> dict[str, str]:
    """What a superseded message returns: JSON-safe, naming the run that replaced it."""
    return {"lockguard": SUPERSEDED, "superseded_by": survivor}


def record_ttl_ms(s: Settings, opts: TaskOptions, delay: float | None, eta: Any = None) -> int:
    """How long a burst's record and run key live: as long as any message of the burst may still arrive.

    That is the message's delay (``countdown``/``eta``), plus the transport's redelivery horizon
    (``visibility_timeout``: a worker that dies holding the message, as it holds every countdown
    message until due, gives it back that long after it took it), plus ``queue_lock_ttl`` (its time
    in queue, before and after), and never less than the delay plus the publish grace
    (:func:`_claims.covering_ttl_ms`). Shorter, the dead worker's superseded copies would come back to no
    record, find it ``missing`` and all run, older arguments after newer.
    """
    return claims.covering_ttl_ms(opts.queue_lock_ttl + s.visibility_timeout, claims.due_in(delay, eta))


def delay_for(opts: TaskOptions, options: dict[str, Any]) -> float:
    """Seconds the message waits: ``lock_debounce``, or a longer ``countdown``/``eta`` the caller asked for."""
    assert opts.debounce is not None
    asked = 0.0
    if options.get("countdown"):
        asked = float(options["countdown"])
    elif options.get("eta") is not None:
        eta = options["eta"]
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if isinstance(when, datetime):
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            asked = (when - datetime.now(timezone.utc)).total_seconds()
    return max(opts.debounce, asked)


def _seconds_until(when: Any) -> float | None:
    """Seconds from now until ``when`` (a datetime or an ISO string; naive is UTC), else None."""
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, datetime):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - datetime.now(timezone.utc)).total_seconds()


def check_expires(task: Any, options: dict[str, Any], delay: float) -> None:
    """Refuse an ``expires`` that falls before the debounced run is due: the burst would never run.

    The message waits ``delay`` seconds in the broker before it may run, and Celery discards a
    message past its ``expires`` (state REVOKED, "expired"). A burst whose last publish expires
    first is lost whole — its superseded messages all name a run that never happens — so the
    publish is refused instead (ConfigurationError naming the task, the option and the value).
    """
    value = options.get("expires")
    if value is None:
        value = getattr(task, "expires", None)
    if value is None:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        left: float | None = float(value)
    else:
        left = _seconds_until(value)
    if left is not None and left <= delay:
        raise ConfigurationError(
            f"task {task.name!r}: option expires={value!r} falls before the debounced run is due "
            f"(lock_debounce/countdown: {delay:g} s): the message would expire unrun and its burst would be lost"
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def publish(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    link: Any,
    options: dict[str, Any],
    send: Send,
) -> Any:
    """``apply_async`` of a debounced task: record the message as the latest pending run, then publish it."""
    from celery import uuid

    publisher = claims.publishing_task_id()
    facts = DebouncePublish(
        self_republish=task_id is not None and publisher is not None and publisher == task_id,
        in_canvas=claims.in_canvas(options, link),
        own_copy=republish.is_own_copy(task_id),
    )
    decision = decide_debounce_publish(facts)
    if decision.action is DebouncePublishAction.BYPASS:
        return send(args, kwargs, task_id, link=link, **options)
    task_id = task_id or uuid()
    call = calls.render(opts, task_id, tuple(args or ()), dict(kwargs or {}))
    delay = delay_for(opts, options)
    check_expires(task, options, delay)
    options = {**options, "countdown": delay}
    options.pop("eta", None)
    record = keys.debounce_name(s.key_prefix, call.key, task.name)
    client = connection.client(s)
    fields = {"lock_key": call.key, "task_id": task_id}
    burst, replaced, failure = "", "", None
    try:
        reply = scripts.debounce_publish(
            client,
            [record],
            [keys.meta(task_id), keys.meta(call.digest), int(delay * 1000), record_ttl_ms(s, opts, delay)],
        )
        burst, replaced = _text(reply[0]), _text(reply[1])
        state = "recorded"
    except Exception as exc:
        kind = errors.classify(exc)
        if kind is None:
            raise
        state, failure = kind, exc
    decision = decide_debounce_publish(
        DebouncePublish(facts.self_republish, facts.in_canvas, record=state, own_copy=facts.own_copy)  # type: ignore[arg-type]
    )
    if decision.action is DebouncePublishAction.MISCONFIGURED:
        assert failure is not None
        raise errors.configuration_error(failure, task.name, "DEBOUNCE_PUBLISH") from failure
    if decision.action is DebouncePublishAction.PUBLISH_UNRECORDED:
        emit(
            "lock.backend_unavailable",
            task.name,
            **fields,
            policy=opts.on_unavailable,
            reason=f"publish without debounce record: {errors.reply_text(failure) if failure else ''}",
        )
        return send(args, kwargs, task_id, link=link, **options)
    assert decision.action is DebouncePublishAction.PUBLISH_DEBOUNCED
    options["headers"] = {**(options.get("headers") or {}), headers.DEBOUNCE: burst}
    try:
        result = send(args, kwargs, task_id, link=link, **options)
    except BaseException:
        _settle(task.name, client, record, task_id, "failed", fields, wait=True)
        raise
    _settle(task.name, client, record, task_id, "published", fields, wait=False)
    if replaced:
        emit("lock.debounced", task.name, **fields, replaced_task_id=replaced, countdown=round(delay, 3))
    return result


def _settle(
    task_name: str, client: Any, record: str, task_id: str, how: str, fields: dict[str, Any], wait: bool
) -> None:
    """DEBOUNCE_SETTLE, never raising: a failed publish must say so; a published one's reply is read later."""

    def report(reply: Any) -> None:
        if isinstance(reply, BaseException):
            reason = f"debounce settle ({how}): {reply.__class__.__name__}: {reply}"
            emit("lock.backend_unavailable", task_name, **fields, reason=reason)

    ch = None if wait else _wire.channel(client)
    for attempt in range(SETTLE_ATTEMPTS if wait else 1):
        try:
            if ch is not None:
                ch.defer(scripts.debounce_settle, [record], [keys.meta(task_id), how], report)
            else:
                scripts.debounce_settle(client, [record], [keys.meta(task_id), how])
            return
        except Exception as exc:  # noqa: BLE001 - logged; a 'publishing' record counts as published past the grace
            failure = exc
        if attempt + 1 < SETTLE_ATTEMPTS:
            time.sleep(0.05 * 2**attempt)
    report(failure)


def take(
    client: Any, s: Settings, opts: TaskOptions, key: str, task_name: str, task_id: str, burst: str
) -> tuple[str, str]:
    """DEBOUNCE_TAKE for a delivered message of ``burst``: ``(answer, value)`` (see the script's header)."""
    record = keys.debounce_name(s.key_prefix, key, task_name)
    run = keys.debounce_run_name(s.key_prefix, key, task_name, burst)
    assert opts.debounce is not None
    ttl_ms = record_ttl_ms(s, opts, opts.debounce)
    reply = scripts.debounce_take(
        client, [record, run], [keys.meta(task_id), keys.meta(burst), int(claims.PUBLISH_GRACE * 1000), ttl_ms]
    )
    return _text(reply[0]), _text(reply[1])


def arrive(
    task: Any, s: Settings, opts: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """Decide a delivered message of a debounce burst: ``(answered, result)``; not answered: go on to the lease.

    Raises ``Retry`` when it re-delivers itself (early past :data:`EARLY_IN_PROCESS`, or an outage
    under ``fail_closed``), ``BackendUnavailable`` when the wait budget is spent.
    """
    req = task.request
    burst = headers.read_str(req, headers.DEBOUNCE)
    if not burst:
        return False, None  # published during an outage, or a new attempt (retry): never superseded
    call = calls.render(opts, req.id, args, kwargs)
    fields = {"lock_key": call.key, "task_id": req.id}
    pause = 0.01
    while True:
        failure: BaseException | None = None
        try:
            answer, value = take(connection.client(s), s, opts, call.key, task.name, req.id, burst)
        except Exception as exc:
            kind = errors.classify(exc)
            if kind is None:
                raise
            answer, value, failure = kind, "", exc
        waits = headers.read_int(req, headers.WAITS)
        action, reason = decide_debounced(
            Debounced(
                answer=answer,  # type: ignore[arg-type]
                on_unavailable=opts.on_unavailable,  # type: ignore[arg-type]
                waits=waits,
                max_waits=opts.max_waits,
            )
        )
        if action is DebounceAction.PROCEED:
            if answer == "missing":
                emit("lock.debounce_missing", task.name, **fields, reason=reason)
            return False, None
        if action is DebounceAction.SUPERSEDED:
            emit("lock.superseded", task.name, **fields, superseded_by=value, reason=reason)
            task.add_trail(task.AsyncResult(value))
            return True, superseded_result(value)
        if action is DebounceAction.AWAIT_PUBLISH:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            continue
        if action is DebounceAction.WAIT_UNTIL_DUE:
            remaining = int(value) / 1000
            if remaining <= EARLY_IN_PROCESS or req.is_eager:
                time.sleep(remaining)
                continue
            countdown = min(remaining, republish.max_countdown(s))
            emit(
                "lock.retry_scheduled",
                task.name,
                **fields,
                countdown=round(countdown, 3),
                reason=reason,
                policy="debounce",
            )
            try:
                sig = republish.publish(
                    task, req.args or (), req.kwargs or {}, countdown, republish.wait_headers(req, None)
                )
            except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the run: wait here instead
                failed = {**fields, "policy": "wait_in_process", "reason": f"publish failed: {exc.__class__.__name__}"}
                emit("lock.backend_unavailable", task.name, **failed)
                time.sleep(countdown)
                continue
            raise Retry(when=republish.retry_when(sig), sig=sig)
        if _outage(task, s, opts, call, action, reason, failure, fields, waits):
            return False, None


def start(task: Any, s: Settings, opts: TaskOptions, client: Any, key: str) -> dict[str, str] | None:
    """Before the body of a burst's run that holds the lease: ``None`` runs it, else the superseded result.

    A run taken while another body of the entity ran waited for the lease, not yet started: a publish
    in that time replaced it (DEBOUNCE_START), so it releases without running and names the new run.
    """
    req = task.request
    burst = headers.read_str(req, headers.DEBOUNCE)
    if opts.debounce is None or not burst:
        return None  # no burst: published without a record, a retry (a new attempt), eager
    record = keys.debounce_name(s.key_prefix, key, task.name)
    run = keys.debounce_run_name(s.key_prefix, key, task.name, burst)
    fields = {"lock_key": key, "task_id": req.id}
    pause = 0.01
    while True:
        failure: BaseException | None = None
        try:
            reply = scripts.debounce_start(client, [record, run], [keys.meta(req.id), int(claims.PUBLISH_GRACE * 1000)])
            answer, value = _text(reply[0]), _text(reply[1])
        except Exception as exc:
            kind = errors.classify(exc)
            if kind is None:
                raise
            answer, value, failure = kind, "", exc
        action, reason = decide_debounce_start(answer)  # type: ignore[arg-type]
        if action is DebounceAction.SUPERSEDED:
            emit("lock.superseded", task.name, **fields, superseded_by=value, reason=reason)
            task.add_trail(task.AsyncResult(value))
            return superseded_result(value)
        if action is DebounceAction.AWAIT_PUBLISH:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            continue
        if failure is not None:  # the lease is held: run rather than lose the run, and say so
            why = f"debounce start (running): {failure.__class__.__name__}: {failure}"
            emit("lock.backend_unavailable", task.name, **fields, policy=opts.on_unavailable, reason=why)
        return None


def keep_for_retry(task: Any, s: Settings, opts: TaskOptions, burst: str, countdown: Any, eta: Any) -> None:
    """``retry()`` of a burst's run keeps its burst: keep its keys until the retry can come back (DEBOUNCE_KEEP).

    Past their TTL the retry would find neither the record nor its run (``missing``) and run with older
    arguments after a newer run. Best effort, never failing the retry: unreachable, the keys keep their TTL.
    """
    req = task.request
    call = calls.render(opts, req.id, tuple(req.args or ()), dict(req.kwargs or {}))
    names = [
        keys.debounce_name(s.key_prefix, call.key, task.name),
        keys.debounce_run_name(s.key_prefix, call.key, task.name, burst),
    ]
    try:
        scripts.debounce_keep(connection.client(s), names, [keys.meta(req.id), record_ttl_ms(s, opts, countdown, eta)])
    except Exception as exc:
        if errors.classify(exc) is None:
            raise
        emit(
            "lock.backend_unavailable",
            task.name,
            lock_key=call.key,
            task_id=req.id,
            reason=f"debounce keep: {exc.__class__.__name__}: {exc}",
        )


def discarded(task: Any, request: Any, args: Any, kwargs: Any, reason: str) -> bool:
    """From the worker's main process: a message of a burst discarded unrun (revoked, expired).

    If it is still its burst's pending run, the burst ends without a run: the publishes it superseded
    were consumed when they fell due (each before it), so none is left to hand the run to, and their
    results name this one. Said as ``lock.debounce_revoked`` (warning, with how many publishes the
    burst superseded), so a lost burst is never silent; the next publish starts the entity again.
    Returns True when it was the pending run. Best effort: an unreachable Redis only skips the event.
    """
    found = getattr(request, "request_dict", None) or {}
    burst = headers.read_str(request, headers.DEBOUNCE) or str(found.get(headers.DEBOUNCE) or "")
    s, opts = settings_of(task.app), task.lockguard_options
    if opts.debounce is None or not burst or not s.enabled:
        return False
    key = calls.render(opts, request.id, tuple(args), dict(kwargs)).key
    record = keys.debounce_name(s.key_prefix, key, task.name)
    try:
        pipe = connection.client(s).pipeline(transaction=False)
        pipe.hget(record, "task_id")
        pipe.hget(record, "superseded")
        pending, superseded = pipe.execute()
    except Exception as exc:
        if errors.classify(exc) is None:
            raise
        return False
    if pending is None or _text(pending) != keys.meta(request.id):
        return False
    emit(
        "lock.debounce_revoked",
        task.name,
        lock_key=key,
        task_id=request.id,
        superseded=int(_text(superseded or 0)),
        reason=f"the burst's run was {reason}: the publishes it superseded will not run",
    )
    return True


def _outage(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    call: Any,
    action: DebounceAction,
    reason: str,
    failure: BaseException | None,
    fields: dict[str, Any],
    waits: int,
) -> bool:
    """Carry out an outage (or refusal) at DEBOUNCE_TAKE: True goes on to the lease (fail open), False asks again."""
    why = f"debounce: {failure.__class__.__name__}: {failure}" if failure is not None else reason
    if action is DebounceAction.MISCONFIGURED:
        assert failure is not None
        raise errors.configuration_error(failure, task.name, "DEBOUNCE_TAKE") from failure
    if action is DebounceAction.FAIL_OPEN:
        emit("lock.fail_open", task.name, **fields, policy=opts.on_unavailable, reason=why)
        return True
    error = BackendUnavailable(f"task {task.name!r}: debounce record unavailable for {call.key!r}: {why}")
    if action is DebounceAction.GIVE_UP:
        emit("lock.wait_budget_exhausted", task.name, **fields, reason=why, waits=waits, policy=opts.on_unavailable)
        raise error
    assert action is DebounceAction.WAIT
    emit("lock.backend_unavailable", task.name, **fields, policy=opts.on_unavailable, reason=why)
    sig = waiting.wait(task, s, opts, call, Decision(Action.WAIT, reason), None, None)
    if sig is not None:
        raise Retry(exc=error, when=republish.retry_when(sig), sig=sig)
    return False  # waited in this process (eager, or the wait's publish failed): ask again


# -- reading the records back (``lockguard locks``) ------------------------------------------------


@dataclass(frozen=True)
class DebounceRow:
    """One debounce record as ``lockguard locks`` shows it (the reader beside DEBOUNCE_PUBLISH, its writer)."""

    key: str
    task_name: str
    redis_key: str
    #: The pending run (the burst's latest publish), or None when the last burst was taken.
    pending_task_id: str | None
    #: ``publishing`` · ``queued`` · ``taken`` (as DEBOUNCE_PUBLISH / SETTLE / TAKE write it).
    state: str
    due_in_ms: int | None
    superseded: int | None
    last_run: str | None
    ttl_left_ms: int | None

    @classmethod
    def from_hash(
        cls, key: str, task_name: str, redis_key: str, fields: dict[str, str], pttl: Any, now_ms: int
    ) -> DebounceRow:
        """Parse one record hash (HGETALL) with its PTTL, as of the server time ``now_ms``."""
        pending = fields.get("task_id") or None
        due = number(fields.get("due_ms"))
        return cls(
            key=key,
            task_name=task_name,
            redis_key=redis_key,
            pending_task_id=pending,
            state=fields.get("state") or ("queued" if pending else "taken"),
            due_in_ms=max(0, due - now_ms) if pending and due is not None else None,
            superseded=number(fields.get("superseded")),
            last_run=fields.get("last_run") or None,
            ttl_left_ms=pttl if isinstance(pttl, int) and not isinstance(pttl, bool) and pttl >= 0 else None,
        )

    def as_dict(self) -> dict[str, Any]:
        """The row of ``lockguard locks --json`` (``state: "debounce"`` tells it from a lease row)."""
        return {
            "key": cut_field(self.key),
            "redis_key": cut_field(self.redis_key),
            "state": "debounce",
            "task_name": cut_field(self.task_name),
            "task_id": cut_field(self.pending_task_id),
            "debounce_state": cut_field(self.state),
            "due_in_ms": self.due_in_ms,
            "superseded": self.superseded,
            "last_run": cut_field(self.last_run),
            "ttl_left_ms": self.ttl_left_ms,
        }


def read_debounce(client: Any, prefix: str, match: str = "*", names: list[str] | None = None) -> list[DebounceRow]:
    """Every debounce record under ``prefix`` whose entity key matches ``match``, sorted (one SCAN, one pipeline).

    ``names``: read these records instead of scanning (``lockguard locks`` found them in its own bounded scan).
    """
    found = []
    scanned = client.scan_iter(match=f"{prefix}:v1:{{{match}}}:debounce:*", count=1000) if names is None else names
    for name in scanned:
        name = _text(name)
        parsed = keys.parse_debounce_name(prefix, name)
        if parsed is not None:
            found.append((name, *parsed))
    found.sort()
    if not found:
        return []
    now_ms = server_ms(client)
    pipe = client.pipeline(transaction=False)
    for name, _, _ in found:
        pipe.hgetall(name)
        pipe.pttl(name)
    replies = pipe.execute(raise_on_error=False)
    out = []
    for (name, key, task_name), fields, pttl in zip(found, replies[0::2], replies[1::2], strict=True):
        if isinstance(fields, dict) and fields:
            out.append(DebounceRow.from_hash(key, task_name, name, fields, pttl, now_ms))
    return out
