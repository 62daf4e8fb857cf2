"""Doctor checks: the ``beat_schedule`` against the lock and the broker.

Beat publishes each entry with the same arguments every time, so every
publish of a locked task names the same entity. Two things can fight:

* the interval: an entry that fires more often than a run holds its lock
  meets the previous run still holding it, every time;
* a ``countdown`` (or ``eta``) in the entry's ``options``: the worker keeps a
  delayed message unacknowledged until it is due, so a delay past the
  broker's ``visibility_timeout`` (Redis, SQS) or ``consumer_timeout``
  (RabbitMQ) is delivered again before it ever ran.

Publishes the doctor cannot see (``apply_async(countdown=...)`` in code)
are not judged; lockguard's own delayed messages (waits, watch and safety
copies) are capped at half the ``visibility_timeout`` and need no check on
Redis and SQS (``_doctor_broker`` checks the safety copy against RabbitMQ).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from itertools import pairwise
from typing import Any

from ._config import Settings
from ._doctor_broker import consumer_timeout, publish_options
from ._findings import AMQP_SCHEMES, VISIBILITY_SCHEMES, Finding, broker_scheme, seconds
from ._terminal import printable

#: Seconds in a day: a crontab that fires once a day (or on some days) fires at most this often.
DAY = 86400.0


def period_of(schedule: Any) -> tuple[float, str] | None:
    """The shortest gap between two publishes of a beat entry, and how it was read; ``None``: not judged.

    A number or ``timedelta`` is the interval. For a ``crontab`` the gap is the
    shortest one between its times of day (days of the week or month can only
    make it longer), so it is a lower bound. ``solar`` and custom schedules are
    not judged.
    """
    from celery.schedules import crontab
    from celery.schedules import schedule as every

    if isinstance(schedule, bool):
        return None
    if isinstance(schedule, (int, float)):
        return float(schedule), f"every {seconds(float(schedule))}"
    if isinstance(schedule, timedelta):
        return schedule.total_seconds(), f"every {seconds(schedule.total_seconds())}"
    if isinstance(schedule, crontab):
        times = sorted(h * 60 + m for h in schedule.hour for m in schedule.minute)
        if not times:
            return None
        gaps = [b - a for a, b in pairwise(times)] + [times[0] + 1440 - times[-1]]
        gap = min(gaps) * 60.0
        return gap, f"{schedule!r}, at most every {seconds(gap)}"
    if isinstance(schedule, every):
        run_every = schedule.run_every.total_seconds()
        return run_every, f"every {seconds(run_every)}"
    return None


def delay_of(options: Any, now: datetime | None = None) -> tuple[float, str] | None:
    """The delay an entry's ``options`` give each publish (``countdown``, or ``eta`` from now), if any."""
    if not isinstance(options, dict):
        return None
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool) and countdown > 0:
        return float(countdown), f"countdown={seconds(float(countdown))}"
    eta = options.get("eta")
    if isinstance(eta, datetime):
        now = now or datetime.now(timezone.utc)
        when = eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)  # naive is UTC, as Celery reads it
        delay = (when - now).total_seconds()
        if delay > 0:
            return delay, f"eta {eta.isoformat()} ({seconds(round(delay))} from now)"
    return None


def findings(
    app: Any,
    s: Settings,
    tasks: list[Any],
    holds: dict[str, tuple[float, str]] | None,
    given_timeout: float | None = None,
) -> list[Finding]:
    """Beat entries that fight their task's lock or the broker's redelivery timer.

    ``holds`` maps a task name to its typical hold in seconds and where that
    was read (the flushed hold-time metrics); a task missing from it falls
    back on its ``lock_ttl``, and the message says which was used. ``None``:
    the metrics could not be read (the lock Redis is down, or the ACL refuses).
    """
    schedule = app.conf.get("beat_schedule") or {}
    if not isinstance(schedule, dict):
        return []
    locked = {t.name: t for t in tasks}
    scheme = broker_scheme(app)
    out: list[Finding] = []
    for entry_name, entry in sorted(schedule.items(), key=lambda kv: str(kv[0])):
        if not isinstance(entry, dict) or not isinstance(entry.get("task"), str):
            continue
        task_name, entry_shown = entry["task"], printable(str(entry_name))
        delay = delay_of(entry.get("options"))
        if delay and scheme in VISIBILITY_SCHEMES and delay[0] > s.visibility_timeout:
            out.append(
                Finding(
                    "countdown_beyond_visibility_timeout",
                    f"beat entry {entry_shown!r} publishes {printable(task_name)!r} with {delay[1]}, longer than "
                    f"the broker's visibility_timeout={seconds(s.visibility_timeout)}: the worker holds a delayed "
                    "message unacknowledged until it is due, so the broker hands it to another worker after "
                    "visibility_timeout, and again after each one: the task runs several times once due. Keep "
                    "the delay below visibility_timeout, or raise broker_transport_options['visibility_timeout'].",
                    [task_name],
                )
            )
        if delay and scheme in AMQP_SCHEMES:
            # Any task, registered here or not (beat publishes by name), routed by the entry's options.
            task = locked.get(task_name) or app.tasks.get(task_name)
            route = publish_options(task, entry.get("options"))
            timeout, source = consumer_timeout(app, task_name, given_timeout, route)
            if delay[0] > timeout:
                out.append(
                    Finding(
                        "countdown_beyond_consumer_timeout",
                        f"beat entry {entry_shown!r} publishes {printable(task_name)!r} with {delay[1]}, longer "
                        f"than consumer_timeout={seconds(timeout)} ({source}): the worker holds a delayed message "
                        "unacknowledged until it is due, so RabbitMQ closes its channel and requeues every "
                        "message unacknowledged on it before this one ever ran. Keep the delay below "
                        "consumer_timeout, or raise consumer_timeout.",
                        [task_name],
                    )
                )
        if task_name in locked:
            out += _interval(entry_shown, entry, locked[task_name], holds)
    return out


def _interval(
    entry_shown: str, entry: dict[str, Any], task: Any, holds: dict[str, tuple[float, str]] | None
) -> list[Finding]:
    opts = task.lockguard_options
    period = period_of(entry.get("schedule"))
    if not opts.locked or period is None or (opts.on_locked == "skip" and opts.mode == "until_done"):
        # skip + until_done is how a task says the overlap is meant: a publish behind a running copy is
        # answered at publish and never queues, which is this finding's own fix, so it cannot be the finding.
        return []
    missing = "no hold-time metrics for it were found" if holds is not None else "the metrics could not be read"
    hold, source = (holds or {}).get(task.name) or (
        opts.ttl,
        f"its lock_ttl={seconds(opts.ttl)}, used because {missing}",
    )
    if period[0] >= hold:
        return []
    what = _what_a_publish_meets(opts.on_locked, opts.mode)
    return [
        Finding(
            "beat_interval_below_hold",
            f"beat entry {entry_shown!r} publishes {printable(task.name)!r} {period[1]}, but a run holds its lock "
            f"for {seconds(round(hold, 3))} ({source}): each publish names the same entity (beat sends the same "
            f"arguments), so {what}. Make the interval longer than a run, or shorten the run; if skipping "
            "is what you want, say so with on_locked='skip' and lock_mode='until_done' (a publish behind a "
            "running copy is then answered at publish and never queues).",
            [task.name],
        )
    ]


def _what_a_publish_meets(on_locked: str, mode: str) -> str:
    """What a beat publish does when the previous run still holds the lock (``docs/model.md``'s matrix).

    (``skip`` with ``until_done`` is no finding: see :func:`_interval`.)
    """
    if on_locked == "raise" and mode == "while_running":
        return "it fails with LockContended when delivered"
    if on_locked == "raise":
        # Accepted means it runs: a publish that got past the claim waits for the holder when delivered.
        return "it is refused with AlreadyQueued at publish while a copy is queued" + (
            " or running" if mode == "until_done" else "; one copy published during a run waits behind it"
        )
    if on_locked == "retry":
        return (
            "it waits for the previous run: publishes arrive faster than runs finish, the waiting copies "
            "pile up without bound, and each gives up with LockContended once lock_max_waits is spent"
        )
    if mode == "until_started":
        return (
            "one copy queues behind the running one and later publishes are answered with it: runs follow "
            "each other back to back, fewer than the schedule says"
        )
    return (
        "it meets the previous run still holding the lock and is skipped as its duplicate "
        "(lock.skipped_duplicate): the schedule runs less often than written, and nothing fails"
    )


def typical_holds(summary: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Each task's average hold from ``_stats.summarize``: the last 60 minutes when it has holds, else the total."""
    out: dict[str, tuple[float, str]] = {}
    for name, entry in (summary.get("tasks") or {}).items():
        windows = entry.get("windows") or {}
        for window, label in (("60m", "in the last 60 min"), ("total", "since the first flush")):
            w = windows.get(window) or {}
            if w.get("hold_count") and w.get("avg_hold_ms") is not None:
                out[name] = (
                    w["avg_hold_ms"] / 1000,
                    f"the average of {w['hold_count']} holds {label}, from the flushed hold-time metrics",
                )
                break
    return out
