"""Doctor checks: how long a task holds its message against the broker's redelivery timers.

A message the worker has not acknowledged comes back: on the Redis and SQS
transports after ``visibility_timeout`` (``broker_transport_options``), on
RabbitMQ when the delivery outlives ``consumer_timeout`` (the server closes
the channel, and everything unacknowledged on it is requeued). With
``acks_late`` a message stays unacknowledged for the whole run; a message
with a countdown or an ``eta`` stays unacknowledged in the worker until it is
due, whatever ``acks_late`` says. Either one past the timer is delivered
again while the first copy still runs or waits.

What a run's length is read from, longest bound first: the hard time limit,
the soft one, an explicit ``lock_max_hold`` (renewal keeps the lease that
long), and, with renewal off, ``lock_ttl`` (the body is meant to end within
it). A task with none of these gives no bound, and no finding.
"""

from __future__ import annotations

from typing import Any

from . import _handoff as handoff
from . import _republish as republish
from ._config import Settings
from ._decision import raises_when_delivered
from ._findings import AMQP_SCHEMES, VISIBILITY_SCHEMES, Finding, broker_scheme, limit, seconds
from ._terminal import printable

#: RabbitMQ's ``consumer_timeout`` when nothing says otherwise: 30 minutes since RabbitMQ 3.8.15.
RABBITMQ_DEFAULT_CONSUMER_TIMEOUT = 1800.0


def run_bound(task: Any, app: Any, opts: Any) -> tuple[float, str] | None:
    """The longest a run of ``task`` is allowed to take, and what says so; ``None`` when nothing bounds it."""
    hard, soft = limit(task, app, "time_limit"), limit(task, app, "soft_time_limit")
    if hard:
        return hard, f"hard time limit {seconds(hard)}"
    if soft:
        return soft, f"soft time limit {seconds(soft)}"
    if opts.renew and getattr(task, "lock_max_hold", None) is not None:
        return opts.max_hold, f"lock_max_hold={seconds(opts.max_hold)}, renewed that long"
    if not opts.renew:
        return opts.ttl, f"lock_ttl={seconds(opts.ttl)} with lock_renew off, the body meant to end within it"
    return None


def consumer_timeout(
    app: Any, task_name: str, given: float | None, options: dict[str, Any] | None = None
) -> tuple[float, str]:
    """The ``consumer_timeout`` a task's deliveries get, and where the number comes from.

    A queue's ``x-consumer-timeout`` argument (milliseconds) overrides the
    server's setting, as it does in RabbitMQ; ``given`` is the server's
    setting as the operator passed it (``--rabbitmq-consumer-timeout``);
    without either, RabbitMQ's default. The server is not asked: its
    management API is often off, and ``rabbitmqctl`` works only as root on
    its own host. ``options`` are the publish's (a ``queue`` there routes it
    past ``task_routes``, as in ``apply_async``).
    """
    queue = queue_of(app, task_name, options)
    if queue is not None:
        arg = (getattr(queue, "queue_arguments", None) or {}).get("x-consumer-timeout")
        if isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg > 0:
            return arg / 1000, f"the x-consumer-timeout argument of queue {queue.name!r}"
    if given is not None:
        return given, "--rabbitmq-consumer-timeout"
    return (
        RABBITMQ_DEFAULT_CONSUMER_TIMEOUT,
        "RabbitMQ's default (since 3.8.15; pass --rabbitmq-consumer-timeout if the server sets another)",
    )


def publish_options(task: Any, options: Any = None) -> dict[str, Any]:
    """What routes a publish of ``task``: the task's own ``queue``, overridden by the call's ``options``.

    ``task`` may be ``None`` (a beat entry naming a task this process has not
    registered: beat publishes it by name, routed the same way).
    """
    out: dict[str, Any] = {"queue": task.queue} if getattr(task, "queue", None) else {}
    if isinstance(options, dict) and options.get("queue"):
        out["queue"] = options["queue"]
    return out


def queue_of(app: Any, task_name: str, options: dict[str, Any] | None = None) -> Any:
    """The kombu ``Queue`` a publish is routed to (its ``queue`` option, ``task_routes``, the default queue)."""
    try:
        return app.amqp.router.route(dict(options or {}), task_name).get("queue")
    except Exception:  # noqa: BLE001 - a router that cannot answer without real arguments: no queue argument known
        return None


def findings(app: Any, s: Settings, tasks: list[Any], given_timeout: float | None = None) -> list[Finding]:
    """Every finding of this module for the app's locked tasks (options already validated)."""
    scheme = broker_scheme(app)
    out: list[Finding] = []
    for task in tasks:
        opts = task.lockguard_options
        if not opts.locked:
            continue
        acks_late = bool(getattr(task, "acks_late", False))
        name = printable(task.name)
        if acks_late and not opts.completion and opts.on_locked == "skip":
            out.append(_skip_without_completion(task.name, name))
        if opts.debounce is not None and not acks_late:
            out.append(_debounce_without_acks_late(task.name, name))
        bound = run_bound(task, app, opts)
        has_limit = bool(limit(task, app, "time_limit") or limit(task, app, "soft_time_limit"))
        if acks_late and bound and not has_limit and scheme in VISIBILITY_SCHEMES and s.visibility_timeout < bound[0]:
            # (a time limit longer than visibility_timeout is visibility_timeout_below_time_limit, in _doctor)
            out.append(
                Finding(
                    "visibility_timeout_below_lock_hold",
                    f"task {name!r}: acks_late on a {scheme}:// broker whose visibility_timeout="
                    f"{seconds(s.visibility_timeout)} is shorter than a run may last ({bound[1]}): the broker "
                    "redelivers the message while the first copy still runs. LockGuard drops that copy (it meets "
                    "its own live original), and dropping acknowledges it, so every long run costs a redelivery; "
                    "without completion records no watch copy is left behind and a crash of the original after "
                    "that loses the job. Raise broker_transport_options['visibility_timeout'] above the longest "
                    "run, or bound the run below it (time_limit).",
                    [task.name],
                )
            )
        if scheme in AMQP_SCHEMES:
            timeout, source = consumer_timeout(app, task.name, given_timeout, publish_options(task))
            if acks_late and bound and timeout < bound[0]:
                out.append(
                    Finding(
                        "consumer_timeout_below_time_limit",
                        f"task {name!r}: acks_late on RabbitMQ with consumer_timeout={seconds(timeout)} ({source}), "
                        f"shorter than a run may last ({bound[1]}): a run past it makes RabbitMQ close the "
                        "worker's channel (PRECONDITION_FAILED, delivery acknowledgement timed out) and requeue "
                        "every message unacknowledged on it, the running one and the prefetched ones. The "
                        "redelivered copy of a run that has meanwhile finished meets no lease and runs again "
                        "unless a completion record answers it; the original's ack then fails. Raise "
                        "consumer_timeout (server setting, or the queue argument x-consumer-timeout) above the "
                        "hard time limit, or lower the limit.",
                        [task.name],
                    )
                )
            longest = max(own_countdowns(opts, s), default=None)
            if longest is not None and timeout <= longest[0]:
                out.append(
                    Finding(
                        "countdown_beyond_consumer_timeout",
                        f"task {name!r}: lockguard gives this task's own delayed messages countdowns of up to "
                        f"{seconds(round(longest[0], 2))} ({longest[1]}; capped at visibility_timeout/2, which "
                        f"RabbitMQ ignores), not below consumer_timeout={seconds(timeout)} ({source}). A worker "
                        "holds a countdown message unacknowledged until it is due, so RabbitMQ closes its channel "
                        "and requeues everything unacknowledged on it: the delayed copy comes back early and the "
                        "worker's other prefetched messages are redelivered. "
                        + (
                            "Lower lock_ttl (renewal keeps long bodies covered) below consumer_timeout/1.25, or "
                            "raise consumer_timeout."
                            if longest[2] == "safety"
                            else "Raise consumer_timeout above a few minutes."
                        ),
                        [task.name],
                    )
                )
    return out


def own_countdowns(opts: Any, s: Settings) -> list[tuple[float, str, str]]:
    """The longest countdown each kind of lockguard's own republish of a task can get: (seconds, what, kind).

    A wait (behind a lock, or for the lock Redis to come back), a watch copy
    (a dropped redelivery of a running original; needs completion records)
    and a safety copy (a call parked behind a live holder of other work) are
    delayed messages like any other. Each is capped at half the
    ``visibility_timeout``, so on Redis and SQS none outlives it.
    """
    out: list[tuple[float, str, str]] = []
    if not raises_when_delivered(opts.mode, opts.on_locked) or opts.on_unavailable == "fail_closed":
        out.append((republish.longest_wait_countdown(s), "a wait's countdown", "wait"))
    if opts.completion:
        out.append((republish.longest_watch_countdown(s), "a watch copy's countdown", "watch"))
    if opts.mode == "while_running" and opts.on_locked != "raise":
        out.append(
            (
                handoff.longest_safety_countdown(opts.ttl, s),
                f"the safety copy of a call parked behind a holder: the holder's remaining lease, lock_ttl="
                f"{seconds(opts.ttl)}, x{handoff.SAFETY_JITTER:g}",
                "safety",
            )
        )
    return out


def _skip_without_completion(task_name: str, shown: str) -> Finding:
    return Finding(
        "acks_late_skip_without_completion",
        f"task {shown!r}: acks_late with on_locked='skip' and completion=False. acks_late promises that a job "
        "whose worker dies comes back, but nothing records that a run finished: (1) a redelivery of a run that "
        "is still going (visibility_timeout, consumer_timeout, a lost broker connection) meets its own live "
        "original and is dropped, which acknowledges it, and without completion records no watch copy is left, "
        "so if the original then dies the job is lost, and identical calls skipped as its duplicates are lost "
        "with it; (2) a redelivery of a run that finished but was not yet acknowledged (the worker died between "
        "the body and the ack) meets no lease and no record, so the body runs a second time. Set completion=True "
        "(the default): the record, written in the release, answers a redelivery with the first result and "
        "lets the watch copy tell 'finished' from 'died'.",
        [task_name],
    )


def _debounce_without_acks_late(task_name: str, shown: str) -> Finding:
    return Finding(
        "debounce_without_acks_late",
        f"task {shown!r}: lock_debounce without acks_late. A burst's superseded messages are consumed when they "
        "fall due and its run is acknowledged when it starts, so a worker killed during the run gives nothing "
        "back: the burst is lost, and every publish it superseded names a run that never finished. (Before the "
        "run, a dead worker's messages do come back: the burst's records live the delay plus the transport's "
        "visibility_timeout plus queue_lock_ttl, so the copies are superseded as before.) Set acks_late=True "
        "with task_reject_on_worker_lost=True.",
        [task_name],
    )
