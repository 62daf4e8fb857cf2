"""Lock metrics: counted in-process, flushed to Redis, aggregated across the fleet.

Counting is a dict update, never a round trip: every event ``events.emit``
logs is counted per task, and every released lease adds its hold time.
The counts are flushed to Redis in **one pipeline per flush**:

* periodically, by a small daemon thread started lazily in the process that
  counts (a prefork child, or the main process of a solo/threads worker),
  every ``lockguard_metrics_flush_interval`` seconds (default 10);
* on ``worker_process_shutdown`` (a prefork child exiting) and
  ``worker_shutdown`` (the main process).

A child killed with SIGKILL runs neither, so it loses what it counted since
its last flush: at most one flush interval of its events. Metrics are for
operators, not for correctness; that bound is the trade for no round trip
per task.

Redis layout (every key shares the hash tag ``{fleet}``, so one flush is one
MULTI/EXEC to one node, on Cluster too):

* ``{prefix}:v1:metrics:{fleet}:total`` -- hash of running totals;
* ``{prefix}:v1:metrics:{fleet}:min:<unix minute>`` -- the same fields for
  the events counted in that minute, kept :data:`WINDOW_KEEP` seconds, so
  ``lockguard stats`` can show recent windows.

A field is ``<task name>|<counter>``: ``<counter>`` is an event name
(``lock.acquired``) or a hold-time field (``hold.count``, ``hold.sum_ms``,
``hold.le.<ms>``, non-cumulative buckets). Fields starting with ``@`` are
bookkeeping (first and last flush time). :func:`parse_count` and
:func:`parse_timestamp` read them back; a value no flush writes (anyone with
write access to Redis can plant one) reads as None, and the reader skips it.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import Counter
from typing import Any

from . import _events as events  # logs only; _events imports this module for counting

#: Upper bounds (ms) of the hold-time histogram buckets; the last is +inf.
HOLD_BUCKETS_MS = (10, 50, 100, 500, 1000, 5000, 30000, 60000, 300000)

#: Seconds a per-minute bucket is kept in Redis (the longest window ``stats`` shows is an hour).
WINDOW_KEEP = 2 * 3600

#: Default seconds between two flushes of one process.
DEFAULT_FLUSH_INTERVAL = 10.0

#: The hash tag every metrics key carries: one slot, so one flush is one transaction.
TAG = "{fleet}"

_BUCKET_NAMES = [str(b) for b in HOLD_BUCKETS_MS] + ["+Inf"]

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()
_hold: dict[str, list[float]] = {}
#: Not yet flushed: (unix minute, task, field) -> amount.
_pending: Counter[tuple[int, str, str]] = Counter()

# The flush target of this process (bound by the worker signals) and its timer thread.
_target: tuple[Any, float] | None = None  # (Settings, interval)
_started = False
_stop = threading.Event()
_flush_lock = threading.Lock()


#: Counted when ``lockguard release`` evicts a holder (beside the ``lock.force_released`` event): that
#: holder's own release then finds its lease gone and counts ``lock.expired_before_release``, which
#: ``stats`` must not blame on a short TTL. Not an event name: nothing logs it.
OPERATOR_RELEASE = "operator.force_released"

#: A counter as ``HINCRBY`` writes it: an integer (ASCII digits, an optional minus, at most int64's 19 digits).
_COUNT = re.compile(r"-?[0-9]{1,19}\Z")


def parse_count(value: object) -> int | None:
    """A counter field as a flush writes it, else None (``nan``, ``inf``, ``1e400``, ``1.5``, ``"²"`` are not)."""
    return int(value) if isinstance(value, str) and _COUNT.match(value) else None


def parse_timestamp(value: object) -> float | None:
    """A flush time (``@first_flush_at``, ``@last_flush_at``: unix seconds) if it is one, else None."""
    try:
        t = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and t > 0 else None


def total_key(prefix: str) -> str:
    """Redis key of the fleet's running totals."""
    return f"{prefix}:v1:metrics:{TAG}:total"


def minute_key(prefix: str, minute: int) -> str:
    """Redis key of the counts of one unix minute (``int(time // 60)``)."""
    return f"{prefix}:v1:metrics:{TAG}:min:{minute}"


# -- counting (hot path: no I/O) -----------------------------------------------


def count(task_name: str, name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of ``task_name``."""
    minute = int(time.time() // 60)
    with _lock:
        _counts[(task_name, name)] += n
        _pending[(minute, task_name, name)] += n
    if not _started and _target is not None:
        _start_flusher()


def observe_hold(task_name: str, hold_ms: float) -> None:
    """Record one lease's hold time (count, sum, histogram)."""
    minute = int(time.time() // 60)
    bucket = next((i for i, bound in enumerate(HOLD_BUCKETS_MS) if hold_ms <= bound), len(HOLD_BUCKETS_MS))
    with _lock:
        row = _hold.setdefault(task_name, [0.0, 0.0] + [0.0] * (len(HOLD_BUCKETS_MS) + 1))
        row[0] += 1
        row[1] += hold_ms
        row[2 + bucket] += 1
        _pending[(minute, task_name, "hold.count")] += 1
        _pending[(minute, task_name, "hold.sum_ms")] += round(hold_ms)
        _pending[(minute, task_name, f"hold.le.{_BUCKET_NAMES[bucket]}")] += 1
    if not _started and _target is not None:
        _start_flusher()


def snapshot() -> dict[str, dict[str, Any]]:
    """Per task: what this process counted since it started (flushed or not)."""
    with _lock:
        out: dict[str, dict[str, Any]] = {}
        for (task, name), n in _counts.items():
            out.setdefault(task, {})[name] = n
        for task, row in _hold.items():
            out.setdefault(task, {})["hold"] = {
                "count": int(row[0]),
                "sum_ms": row[1],
                "buckets": dict(zip(_BUCKET_NAMES, [int(x) for x in row[2:]], strict=True)),
            }
        return out


def pending() -> int:
    """How many counter cells wait for the next flush."""
    with _lock:
        return len(_pending)


def clear() -> None:
    """Drop every counter, flushed or not (tests)."""
    with _lock:
        _counts.clear()
        _hold.clear()
        _pending.clear()


# -- flushing ------------------------------------------------------------------


def flush(client: Any, prefix: str) -> int:
    """Write what was counted since the last flush in one MULTI/EXEC; returns the cells written.

    On failure the counts are put back, to go with the next flush. (A flush
    whose reply is lost after Redis applied it is then counted twice: the
    price of never losing a flush to a blip.)
    """
    with _flush_lock:
        with _lock:
            batch = _pending.copy()
            _pending.clear()
        if not batch:
            return 0
        totals: Counter[str] = Counter()
        minutes: dict[int, Counter[str]] = {}
        for (minute, task, name), n in batch.items():
            field = f"{task}|{name}"
            totals[field] += n
            minutes.setdefault(minute, Counter())[field] += n
        now = time.time()
        try:
            pipe = client.pipeline(transaction=True)
            tkey = total_key(prefix)
            for field, n in totals.items():
                pipe.hincrby(tkey, field, n)
            for minute, fields in minutes.items():
                mkey = minute_key(prefix, minute)
                for field, n in fields.items():
                    pipe.hincrby(mkey, field, n)
                pipe.expire(mkey, WINDOW_KEEP)
            pipe.hsetnx(tkey, "@first_flush_at", f"{now:.3f}")
            pipe.hset(tkey, "@last_flush_at", f"{now:.3f}")
            pipe.execute()
        except BaseException:
            with _lock:
                _pending.update(batch)
            raise
        return len(batch)


def flush_interval(app: Any) -> float:
    """The app's ``lockguard_metrics_flush_interval`` in seconds, validated."""
    from ._config import setting
    from .exceptions import ConfigurationError

    value = setting(app, "metrics_flush_interval", DEFAULT_FLUSH_INTERVAL)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"setting lockguard_metrics_flush_interval={value!r} must be a number of seconds > 0")
    return float(value)


def bind(app: Any) -> None:
    """Flush this process's counts to ``app``'s lock Redis from now on (worker signals call this).

    The timer thread itself starts on the next count, in whichever process
    counts: binding in a parent that then forks starts nothing there.
    """
    global _target
    from ._config import settings

    try:
        _target = (settings(app), flush_interval(app))
    except Exception as exc:  # noqa: BLE001 - a bad setting is reported by the task itself; never break a worker
        events.logger.warning("metrics.not_flushed", reason=f"{exc.__class__.__name__}: {exc}")


def unbind() -> None:
    """Stop the timer thread and forget the flush target (tests)."""
    global _target, _started
    _stop.set()
    _target = None
    _started = False


def flush_bound() -> int:
    """Flush to the bound target; logs and returns 0 when the lock Redis is unreachable."""
    target = _target
    if target is None:
        return 0
    from . import _connection as connection
    from ._errors import classify

    s = target[0]
    try:
        return flush(connection.client(s), s.key_prefix)
    except Exception as exc:  # noqa: BLE001 - metrics never fail a worker; the counts wait for the next flush
        # Every kind, a bug included (logged as "unexpected"): a flush runs on a timer thread and at
        # process exit, where an exception would only be lost or break shutdown.
        kind = classify(exc) or "unexpected"
        events.logger.warning(
            "metrics.flush_failed", reason=f"{kind}: {exc.__class__.__name__}: {exc}", pending=pending()
        )
        return 0


def _start_flusher() -> None:
    global _started, _stop
    with _lock:
        if _started or _target is None:
            return
        _started = True
        _stop = threading.Event()
        stop, interval = _stop, _target[1]
    threading.Thread(target=_run, args=(stop, interval), name="lockguard-metrics", daemon=True).start()


def _run(stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        flush_bound()


def _after_fork_in_child() -> None:
    """A forked child is a new process: its counts start at zero and it has no timer thread yet."""
    global _lock, _flush_lock, _started, _stop
    _lock = threading.Lock()
    _flush_lock = threading.Lock()
    _counts.clear()
    _hold.clear()
    _pending.clear()
    _started = False
    _stop = threading.Event()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- worker signals --------------------------------------------------------------


def _on_process_init(**_: Any) -> None:
    from celery import current_app

    bind(current_app._get_current_object())


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        bind(app)


def _on_shutdown(**_: Any) -> None:
    flush_bound()


def connect_signals() -> None:
    """Bind the flush target in every worker process and flush when a process exits."""
    from celery import signals

    signals.worker_process_init.connect(_on_process_init, weak=False, dispatch_uid="lockguard.metrics.init")
    signals.worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="lockguard.metrics.ready")
    signals.worker_process_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="lockguard.metrics.child_exit")
    signals.worker_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="lockguard.metrics.shutdown")
