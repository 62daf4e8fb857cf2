"""Lock metrics: counted in-process, flushed to Redis, aggregated across the fleet.

Counting is a ledger append, never a round trip: every event ``events.emit``
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

* ``{prefix}:v1:metrics:{fleet}:proc:<host>:<pid>`` -- what one process
  holds *now* (JSON: per task and worker, the leases held and the oldest
  one's acquisition time), rewritten by each of its flushes and expiring
  :func:`gauge_ttl` seconds after the last, so a killed process drops out by
  itself; ``{prefix}:v1:metrics:{fleet}:procs`` (a sorted set, score = last
  flush time) names them, so a reader finds them with one ``ZRANGE`` and one
  ``MGET`` -- never a ``SCAN``. A process that holds nothing and held
  nothing at its last flush writes no gauge at all.

A field is ``<task name>|<counter>``: ``<counter>`` is an event name
(``lock.acquired``) or a histogram field ``<family>.count``,
``<family>.sum_ms``, ``<family>.le.<ms>`` (non-cumulative buckets) for each
of :data:`HISTOGRAMS`: ``hold`` (acquire to release), ``wait`` (first
delivery to acquisition, re-queued waits included) and ``renew_lag`` (how
late a renewal was sent against when it was due). Fields starting with
``@`` are bookkeeping (first and last flush time). :func:`parse_count` and
:func:`parse_timestamp` read them back; a value no flush writes (anyone with
write access to Redis can plant one) reads as None, and the reader skips it.

What is held now comes from a registry of this process's running bodies
(:func:`lease_held` / :func:`lease_ended`, two dict operations per task), read
at flush time; renewal lag is taken from the renewer's own tally at flush time
(:func:`add_collector`), so the renewer thread never takes the metrics lock.

A task's counts and observations are not added up on its own path: each is one
append to a ledger (no lock, no arithmetic), folded into the counts by whoever
reads them (:func:`snapshot`, :func:`flush`) or, every :data:`FOLD_AT` entries,
by the appender. Each entry carries its time, so it lands in the minute it
happened in, whenever it is folded. Between its two round trips a delivery
then only appends; the arithmetic runs where the counts are read.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from . import _events as events  # logs only; _events imports this module for counting
from . import _otel_metrics as otel

#: Upper bounds (ms) of the hold-time histogram buckets; the last is +inf.
HOLD_BUCKETS_MS = (10, 50, 100, 500, 1000, 5000, 30000, 60000, 300000)
#: Upper bounds (ms) of the lock-wait histogram: from first delivery to acquisition, re-queued waits included.
WAIT_BUCKETS_MS = (5, 25, 100, 500, 1000, 5000, 15000, 60000, 300000, 1800000)
#: Upper bounds (ms) of the renewal-lag histogram: how late a renewal was sent against when it was due.
RENEW_LAG_BUCKETS_MS = (1, 5, 10, 50, 100, 500, 1000, 5000)
#: The largest observation a histogram takes (a year, ms): its sum stays an int64 for 10^8 of them.
MAX_OBSERVATION_MS = 365 * 86400 * 1000.0
#: Histogram family -> its bucket bounds (ms). The family is the field prefix (``wait.le.100``).
HISTOGRAMS: dict[str, tuple[int, ...]] = {
    "hold": HOLD_BUCKETS_MS,
    "wait": WAIT_BUCKETS_MS,
    "renew_lag": RENEW_LAG_BUCKETS_MS,
}

#: Seconds a per-minute bucket is kept in Redis (the longest window ``stats`` shows is an hour).
WINDOW_KEEP = 2 * 3600

#: Default seconds between two flushes of one process.
DEFAULT_FLUSH_INTERVAL = 10.0

#: The hash tag every metrics key carries: one slot, so one flush is one transaction.
TAG = "{fleet}"


def bucket_names(family: str) -> list[str]:
    """The ``le`` names of a histogram family's buckets, as its fields spell them (``"100"``, ..., ``"+Inf"``)."""
    return list(_FIELD_NAMES[family])


#: Per family, the ``le`` names of its buckets (made once: observing is on every task's path).
_FIELD_NAMES = {family: (*(str(b) for b in bounds), "+Inf") for family, bounds in HISTOGRAMS.items()}


#: Per family, its field names in a flush: ``<family>.count``, ``<family>.sum_ms`` and one per bucket
#: (``<family>.le.<name>``), made once: observing is on every task's path.
_FIELDS = {
    family: (f"{family}.count", f"{family}.sum_ms", tuple(f"{family}.le.{name}" for name in names))
    for family, names in _FIELD_NAMES.items()
}


def bucket_of(bounds: tuple[int, ...], ms: float) -> int:
    """The index of the bucket ``ms`` falls in (``len(bounds)``: the +Inf one). Pure: any thread may call it.

    The first bound ``>= ms``: ``bisect_left``, in C (every observation is folded through here).
    """
    return bisect_left(bounds, ms)


#: What a family's field names start with, to tell histogram fields from event counters.
HISTOGRAM_FIELD_PREFIXES = tuple(f"{family}." for family in HISTOGRAMS)

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()
#: (task, family) -> [count, sum_ms, bucket 0, ..., +Inf bucket], since the process started.
_hists: dict[tuple[str, str], list[float]] = {}
#: Leases of this process's running bodies: id(lease) -> (lease, worker, acquired at in unix seconds).
_held: dict[int, tuple[Any, str, float]] = {}
#: Whether the last gauge this process flushed named any lease (then an empty one must replace it).
_gauge_written = False
#: Called at each flush, before the batch is taken: they add what other threads tallied (renewal lag).
_collectors: list[Callable[[], None]] = []
#: Not yet flushed: (unix minute, task, field) -> amount.
_pending: Counter[tuple[int, str, str]] = Counter()
#: Not yet folded (:func:`_fold`): counts as (task, name, n, unix time), observations as (task, family, ms, unix time).
_counted: deque[tuple[str, str, int, float]] = deque()
_observed: deque[tuple[str, str, float, float]] = deque()
#: Entries a ledger holds before its appender folds it (a process nobody flushes stays bounded).
FOLD_AT = 2048

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


def procs_key(prefix: str) -> str:
    """Redis key of the sorted set naming the processes whose gauges may still be alive."""
    return f"{prefix}:v1:metrics:{TAG}:procs"


def proc_key(prefix: str, proc: str) -> str:
    """Redis key of one process's gauges (``proc`` is ``<host>:<pid>``)."""
    return f"{prefix}:v1:metrics:{TAG}:proc:{proc}"


def process_id() -> str:
    """This process as the gauges name it: ``<host>:<pid>``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def gauge_ttl(interval: float) -> float:
    """Seconds a process's gauges outlive its last flush: three intervals, at least 30 s.

    Long enough that a late flush never blanks a live process, short enough
    that a SIGKILLed one stops counting its leases soon after they expire.
    """
    return max(3 * interval, 30.0)


# -- counting (hot path: no I/O) -----------------------------------------------


def count(task_name: str, name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of ``task_name`` (a ledger entry, folded later)."""
    _counted.append((task_name, name, n, time.time()))
    if len(_counted) > FOLD_AT:
        fold()
    otel.add(task_name, name, n)
    if not _started and _target is not None:
        _start_flusher()


def observe(task_name: str, family: str, ms: float) -> None:
    """Record one observation of histogram ``family`` (:data:`HISTOGRAMS`) for ``task_name``.

    Bounded to [0, :data:`MAX_OBSERVATION_MS`]: one value past int64 would make every later
    flush's ``HINCRBY`` fail, and a failed flush's transaction still applies its other commands.
    """
    if math.isnan(ms):
        return  # no bucket holds it; nothing measures one
    ms = min(max(ms, 0.0), MAX_OBSERVATION_MS)
    _observed.append((task_name, family, ms, time.time()))
    if len(_observed) > FOLD_AT:
        fold()
    if not _started and _target is not None:
        _start_flusher()
    otel.record(task_name, family, ms)


def fold() -> None:
    """Add the ledgers' entries to the counts and the next flush (each in the minute it happened in)."""
    with _lock:
        _fold()


def _fold() -> None:
    """:func:`fold` with ``_lock`` held. Entries appended meanwhile are taken now or by the next fold, never twice."""
    take = _counted.popleft
    for _ in range(len(_counted)):
        task_name, name, n, at = take()
        _counts[(task_name, name)] += n
        _pending[(int(at // 60), task_name, name)] += n
    take_obs = _observed.popleft
    for _ in range(len(_observed)):
        task_name, family, ms, at = take_obs()
        # merge() of new_row(family, ms), without building the row: one count, one sum, one bucket.
        bounds = HISTOGRAMS[family]
        i = bucket_of(bounds, ms)
        count_field, sum_field, bucket_fields = _FIELDS[family]
        minute = int(at // 60)
        mine = _hists.get((task_name, family))
        if mine is None:
            mine = _hists[(task_name, family)] = [0.0] * (len(bounds) + 3)
        mine[0] += 1
        mine[1] += ms
        mine[2 + i] += 1
        _pending[(minute, task_name, count_field)] += 1
        _pending[(minute, task_name, sum_field)] += round(ms)
        _pending[(minute, task_name, bucket_fields[i])] += 1


def observe_hold(task_name: str, hold_ms: float) -> None:
    """Record one lease's hold time (count, sum, histogram)."""
    observe(task_name, "hold", hold_ms)


def observe_wait(task_name: str, wait_ms: float) -> None:
    """Record one acquisition's wait: from the message's first delivery to this acquisition (never negative)."""
    observe(task_name, "wait", max(0.0, wait_ms))


def new_row(family: str, ms: float | None = None) -> list[float]:
    """An empty tally row of ``family`` ([count, sum_ms, buckets...]), or one holding the observation ``ms``."""
    bounds = HISTOGRAMS[family]
    row = [0.0] * (len(bounds) + 3)
    if ms is not None:
        add_to_row(row, bounds, ms)
    return row


def add_to_row(row: list[float], bounds: tuple[int, ...], ms: float) -> None:
    """Add one observation to a tally row; lock-free (the caller guards the row). The renewer keeps its own."""
    row[0] += 1
    row[1] += ms
    row[2 + bucket_of(bounds, ms)] += 1


def merge(task_name: str, family: str, row: list[float]) -> None:
    """Add a tally row (one observation, or many another thread collected) to the counts and the next flush."""
    if not row[0]:
        return
    minute = int(time.time() // 60)
    count_field, sum_field, bucket_fields = _FIELDS[family]
    with _lock:
        mine = _hists.setdefault((task_name, family), [0.0] * len(row))
        for i, x in enumerate(row):
            mine[i] += x
        _pending[(minute, task_name, count_field)] += int(row[0])
        _pending[(minute, task_name, sum_field)] += round(row[1])
        for field, n in zip(bucket_fields, row[2:], strict=True):
            if n:
                _pending[(minute, task_name, field)] += int(n)
    if not _started and _target is not None:
        _start_flusher()


def lease_held(lease: Any, worker: str) -> None:
    """A body starts under ``lease`` on ``worker``: it counts as held until :func:`lease_ended`."""
    acquired_at = time.time() - (time.monotonic() - lease.acquired_at)  # the lease keeps monotonic time
    with _lock:
        _held[id(lease)] = (lease, worker, acquired_at)


def lease_ended(lease: Any) -> None:
    """The body under ``lease`` ended (released, lost or handed over): no longer held here."""
    with _lock:
        _held.pop(id(lease), None)


def entities_of(lease: Any) -> int:
    """Entities ``lease`` holds: one, or each of a multi-entity lease's ``keys`` (the gauge counts per entity,
    as ``lockguard locks`` lists one row per entity)."""
    keys = getattr(lease, "keys", None)
    return len(keys) if isinstance(keys, tuple) and keys else 1


def held_now(now: float | None = None) -> list[dict[str, Any]]:
    """Per (task, worker): the entities this process holds now and the oldest lease's acquisition (unix seconds).

    A lease already lost (expired, taken, cut off at ``lock_max_hold``) or released before its body
    ended (``retry(throw=False)`` frees it, or hands it to the retry as its claim) is not held, though
    its body runs on.
    """
    rows: dict[tuple[str, str], list[float]] = {}
    with _lock:
        entries = list(_held.values())
    for lease, worker, acquired_at in entries:
        if not lease.held:
            continue
        row = rows.setdefault((lease.task_name, worker), [0, acquired_at])
        row[0] += entities_of(lease)
        row[1] = min(row[1], acquired_at)
    return [
        {"task": task, "worker": worker, "held": int(n), "oldest_acquired_at": round(oldest, 3)}
        for (task, worker), (n, oldest) in sorted(rows.items())
    ]


def add_collector(collect: Callable[[], None]) -> None:
    """Run ``collect`` at every flush, before the batch is taken: it hands what it tallied to :func:`merge`."""
    if collect not in _collectors:
        _collectors.append(collect)


def snapshot() -> dict[str, dict[str, Any]]:
    """Per task: what this process counted since it started (flushed or not)."""
    with _lock:
        _fold()
        out: dict[str, dict[str, Any]] = {}
        for (task, name), n in _counts.items():
            out.setdefault(task, {})[name] = n
        for (task, family), row in _hists.items():
            out.setdefault(task, {})[family] = {
                "count": int(row[0]),
                "sum_ms": row[1],
                "buckets": dict(zip(bucket_names(family), [int(x) for x in row[2:]], strict=True)),
            }
        return out


def pending() -> int:
    """How many counter cells wait for the next flush."""
    with _lock:
        _fold()
        return len(_pending)


def clear() -> None:
    """Drop every counter, flushed or not, and forget what is held (tests)."""
    global _gauge_written
    with _lock:
        _counted.clear()
        _observed.clear()
        _counts.clear()
        _hists.clear()
        _pending.clear()
        _held.clear()
        _gauge_written = False


# -- flushing ------------------------------------------------------------------


def _collect() -> None:
    for collect in list(_collectors):
        try:
            collect()
        except Exception as exc:  # noqa: BLE001 - a collector's bug costs its own numbers, never the flush
            events.logger.warning("metrics.collect_failed", reason=f"{exc.__class__.__name__}: {exc}")


def flush(client: Any, prefix: str, interval: float = DEFAULT_FLUSH_INTERVAL, final: bool = False) -> int:
    """Write what was counted since the last flush in one MULTI/EXEC; returns the cells written.

    The same transaction rewrites this process's gauge (what it holds now),
    living :func:`gauge_ttl` of ``interval``; ``final`` (the process exits)
    deletes it instead. A process that holds nothing, held nothing at its last
    flush and counted nothing sends nothing.

    On failure the counts are put back, to go with the next flush. (A flush
    whose reply is lost after Redis applied it is then counted twice: the
    price of never losing a flush to a blip.)
    """
    global _gauge_written
    with _flush_lock:
        _collect()
        now = time.time()
        held = [] if final else held_now(now)
        with _lock:
            _fold()
            batch = _pending.copy()
            _pending.clear()
            gauge = bool(held) or _gauge_written
        if not batch and not gauge:
            return 0
        totals: Counter[str] = Counter()
        minutes: dict[int, Counter[str]] = {}
        for (minute, task, name), n in batch.items():
            field = f"{task}|{name}"
            totals[field] += n
            minutes.setdefault(minute, Counter())[field] += n
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
            if batch:
                pipe.hsetnx(tkey, "@first_flush_at", f"{now:.3f}")
                pipe.hset(tkey, "@last_flush_at", f"{now:.3f}")
            if gauge:
                _write_gauge(pipe, prefix, held, now, interval)
            pipe.execute()
        except BaseException:
            with _lock:
                _pending.update(batch)
            raise
        _gauge_written = bool(held)
        return len(batch) + (1 if gauge else 0)


def _write_gauge(pipe: Any, prefix: str, held: list[dict[str, Any]], now: float, interval: float) -> None:
    """This process's gauge, in the flush's transaction: rewritten while it holds leases, deleted when not."""
    proc = process_id()
    index = procs_key(prefix)
    if held:
        ttl = gauge_ttl(interval)
        blob = json.dumps({"at": round(now, 3), "ttl": ttl, "held": held}, separators=(",", ":"))
        pipe.set(proc_key(prefix, proc), blob, px=int(ttl * 1000))
        pipe.zadd(index, {proc: now})
        # The index forgets processes long gone (their gauge keys expired on their own).
        pipe.zremrangebyscore(index, "-inf", now - WINDOW_KEEP)
        pipe.expire(index, WINDOW_KEEP)
    else:
        pipe.delete(proc_key(prefix, proc))
        pipe.zrem(index, proc)


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


def flush_bound(final: bool = False) -> int:
    """Flush to the bound target; logs and returns 0 when the lock Redis is unreachable.

    ``final``: the process is exiting, so its gauge is deleted rather than rewritten.
    """
    target = _target
    if target is None:
        return 0
    from . import _connection as connection
    from ._errors import classify

    s, interval = target
    try:
        return flush(connection.client(s), s.key_prefix, interval, final=final)
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
    global _lock, _flush_lock, _started, _stop, _gauge_written
    _lock = threading.Lock()
    _flush_lock = threading.Lock()
    _counted.clear()
    _observed.clear()
    _counts.clear()
    _hists.clear()
    _pending.clear()
    _held.clear()  # the parent's bodies are the parent's
    _gauge_written = False
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
    flush_bound(final=True)


def connect_signals() -> None:
    """Bind the flush target in every worker process and flush when a process exits."""
    from celery import signals

    signals.worker_process_init.connect(_on_process_init, weak=False, dispatch_uid="lockguard.metrics.init")
    signals.worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="lockguard.metrics.ready")
    signals.worker_process_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="lockguard.metrics.child_exit")
    signals.worker_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="lockguard.metrics.shutdown")
