"""The Celery app of the chaos soak, run by ``celery -A chaos.app:app worker -P prefork``.

Configured from the JSON in ``CHAOS_CONFIG`` (written by :mod:`chaos.soak`):
the broker (a private Redis that is never restarted), the lock Redis (a
private one the soak restarts), the PostgreSQL DSN and the run's table names.
The driver builds the same app with :func:`create_app` to publish.

One task, ``chaos.job(job_id, entity, work_ms)``, written the way the docs
tell a user to write a money-moving task:

* ``lock_key="acct:{entity}"``, ``idempotency_key="job:{job_id}"``: the job's
  identity is its idempotency key, so a duplicate enqueue under another task
  id is the same business effect;
* ``acks_late`` + ``reject_on_worker_lost``: a killed child's message goes
  back to the queue; a short ``visibility_timeout`` redelivers running ones;
* the completion backend is PostgreSQL, so completion records survive a
  lock-Redis restart;
* body: a checkpointed provider call (the provider honours the scope as its
  idempotency key, like Stripe's), some work, then ONE transaction with
  ``advance_fence``, the effect row and ``self.record_completion`` -- which
  returns False when another run of the scope already committed, and the
  body then rolls its effect back (see docs/chaos.md for why that check is
  needed);
* ``StaleFence`` is retried: a holder that lost its lease must not drop the
  job, it must run it again (where the completion record then ends it).

Every body records its execution -- start and end on the system-wide
``CLOCK_MONOTONIC`` (``time.monotonic()``, comparable across processes of
one host), its fence and whether the library reported its lease lost -- in
the run's PostgreSQL history table, through its own autocommit connection so
the row survives the ledger transaction's rollback. Lock events and message
deliveries are counted in a hash on the broker Redis.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

import psycopg
import redis
import structlog
from celery import Celery, signals

from celery_lockguard import LockedTask, StaleFence, advance_fence

TASK_NAME = "chaos.job"
#: Guards the soak can switch off to prove the checker catches what they prevent.
UNSAFE_MODES = ("", "ignore-record", "no-fence")


class Tables:
    """The run's PostgreSQL tables, all named after one base so a run owns (and drops) exactly these."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.effects = f"{base}_effects"
        self.executions = f"{base}_exec"
        self.provider = f"{base}_provider"
        self.fences = f"{base}_fences"
        self.completions = f"{base}_completions"

    def all(self) -> list[str]:
        return [self.effects, self.executions, self.provider, self.fences, self.completions]

    def ddl(self) -> list[str]:
        """Ledger, history and the provider's books; no uniqueness on effects, so the check can fail."""
        return [
            f"CREATE TABLE {self.effects} ("
            " seq BIGSERIAL PRIMARY KEY, job_id INT NOT NULL, entity INT NOT NULL, fence BIGINT NOT NULL,"
            " task_id TEXT NOT NULL, charge_id TEXT NOT NULL, exec_id BIGINT)",
            f"CREATE TABLE {self.executions} ("
            " id BIGSERIAL PRIMARY KEY, job_id INT NOT NULL, entity INT NOT NULL, task_id TEXT NOT NULL,"
            " fence BIGINT NOT NULL, worker TEXT NOT NULL, pid INT NOT NULL, redelivered BOOLEAN NOT NULL,"
            " t_start DOUBLE PRECISION NOT NULL, t_end DOUBLE PRECISION, lost_body BOOLEAN,"
            " lost_release BOOLEAN, lost_reason TEXT, outcome TEXT)",
            f"CREATE TABLE {self.provider} ("
            " idem_key TEXT PRIMARY KEY, job_id INT NOT NULL, charge_id TEXT NOT NULL, calls INT NOT NULL)",
        ]


class _Connection:
    """One PostgreSQL connection per process, made lazily (never inherited across fork), remade when broken."""

    def __init__(self, dsn: str, autocommit: bool) -> None:
        self.dsn = dsn
        self.autocommit = autocommit
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0

    def get(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or self._pid != os.getpid() or conn.closed or conn.broken:
            conn = self._conn = psycopg.connect(self.dsn, autocommit=self.autocommit, connect_timeout=5)
            self._pid = os.getpid()
        return conn


class _Execution:
    """One run of a body: inserted at start, completed by the ``task_postrun`` hook."""

    def __init__(self, row_id: int, t_start: float) -> None:
        self.id = row_id
        self.t_start = t_start
        self.t_end: float | None = None
        self.lost_body: bool | None = None
        self.outcome = "error"


class _AlreadyRecorded(Exception):
    """Another run of this scope committed first: roll this run's effect back."""


def create_app(cfg: dict[str, Any]) -> Celery:
    """The soak's app for ``cfg`` (see :mod:`chaos.soak` for the keys)."""
    tables = Tables(cfg["tables"])
    unsafe = cfg.get("unsafe", "")
    if unsafe not in UNSAFE_MODES:
        raise ValueError(f"unsafe mode {unsafe!r} must be one of {UNSAFE_MODES}")
    app = Celery("chaos", broker=cfg["broker"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": cfg["visibility_timeout"],
            # The sweep that restores unacknowledged messages runs every second (default: ~100 s).
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        lockguard_redis_url=cfg["lock_url"],
        lockguard_key_prefix=cfg["prefix"],
        lockguard_socket_timeout=1.0,
        lockguard_completion_backend=cfg["pg"],
        lockguard_completion_table=tables.completions,
    )
    history = _Connection(cfg["pg"], autocommit=True)
    ledger = _Connection(cfg["pg"], autocommit=False)
    counters = redis.Redis.from_url(cfg["broker"], socket_timeout=2)
    events_key = cfg["events_key"]

    def count(field: str, task_id: str | None = None) -> None:
        """Count an event; log it per task id too, so the report can say what happened to a lost job."""
        try:
            pipe = counters.pipeline(transaction=False)
            pipe.hincrby(events_key, field, 1)
            if task_id:
                pipe.rpush(f"{events_key}:log", json.dumps([task_id, field, time.monotonic()]))
            pipe.execute()
        except redis.RedisError:
            pass  # observing must never fail a task

    def provider_charge(job_id: int, idempotency_key: str) -> dict[str, Any]:
        """The payment provider: one charge per idempotency key; every call is counted."""
        row = (
            history.get()
            .execute(
                f"INSERT INTO {tables.provider} AS p (idem_key, job_id, charge_id, calls) VALUES (%s, %s, %s, 1) "
                "ON CONFLICT (idem_key) DO UPDATE SET calls = p.calls + 1 RETURNING charge_id",
                (idempotency_key, job_id, f"ch_{uuid.uuid4().hex[:16]}"),
            )
            .fetchone()
        )
        assert row is not None
        return {"charge_id": row[0]}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=TASK_NAME,
        lock_key="acct:{entity}",
        idempotency_key="job:{job_id}",
        lock_ttl=cfg["ttl"],
        acks_late=True,
        reject_on_worker_lost=True,
        autoretry_for=(StaleFence,),
        retry_kwargs={"max_retries": 50, "countdown": 0.2},
    )
    def job(self: Any, job_id: int, entity: int, work_ms: int) -> dict[str, Any] | None:
        lease = self.lock
        req = self.request
        t_start = time.monotonic()
        (row_id,) = history.get().execute(
            f"INSERT INTO {tables.executions} (job_id, entity, task_id, fence, worker, pid, redelivered, t_start) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (
                job_id,
                entity,
                req.id,
                lease.fence,
                req.hostname or "",
                os.getpid(),
                bool((req.delivery_info or {}).get("redelivered")),
                t_start,
            ),
        ).fetchone() or (0,)
        run = _Execution(row_id, t_start)
        req.chaos_execution = run
        try:
            charge = self.checkpoint("provider", provider_charge, job_id, idempotency_key=self.completion_scope)
            time.sleep(work_ms / 1000)
            conn = ledger.get()
            fence = lease.fence
            try:
                with conn.transaction():
                    if unsafe != "no-fence":
                        fence = advance_fence(conn, lease, table=tables.fences)
                    conn.execute(
                        f"INSERT INTO {tables.effects} (job_id, entity, fence, task_id, charge_id, exec_id) "
                        "VALUES (%s, %s, %s, %s, %s, %s)",
                        (job_id, entity, fence, req.id, charge["charge_id"], row_id),
                    )
                    result = {"charge_id": charge["charge_id"], "fence": fence}
                    if not self.record_completion(conn, result) and unsafe != "ignore-record":
                        raise _AlreadyRecorded()
            except _AlreadyRecorded:
                run.outcome = "rolled_back_already_recorded"
                return None
            except StaleFence:
                run.outcome = "stale_fence"
                raise
            run.outcome = "committed"
            return result
        finally:
            run.t_end = time.monotonic()
            run.lost_body = lease.lost

    @signals.task_prerun.connect(weak=False)
    def _delivered(task: Any = None, **_: Any) -> None:
        if getattr(task, "name", None) != TASK_NAME:
            return
        redelivered = (task.request.delivery_info or {}).get("redelivered")
        count("delivery|redelivered" if redelivered else "delivery|first")

    @signals.task_postrun.connect(weak=False)
    def _finished(task: Any = None, state: str | None = None, **_: Any) -> None:
        """Complete the execution row once the lease is released: the release may report it lost."""
        if getattr(task, "name", None) != TASK_NAME:
            return
        run: _Execution | None = getattr(task.request, "chaos_execution", None)
        if run is None:
            return
        lease = task.lock
        reason = lease.lost_reason if lease is not None else None
        history.get().execute(
            f"UPDATE {tables.executions} SET t_end = %s, lost_body = %s, lost_release = %s, lost_reason = %s, "
            "outcome = %s WHERE id = %s",
            (run.t_end, run.lost_body, reason is not None, reason, f"{run.outcome}:{state}", run.id),
        )

    @signals.worker_init.connect(weak=False)
    @signals.worker_process_init.connect(weak=False)
    def _observe(**_: Any) -> None:
        _configure_structlog(count)

    return app


def _configure_structlog(count: Any) -> None:
    """Count every lock event at info or above (field ``event|reason``) and print it to the worker log.

    The library never configures structlog; this app does, as a production app would.
    Per-task debug events (``lock.acquired``/``lock.released``) are dropped uncounted.
    """

    def counter(_: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method == "debug":
            raise structlog.DropEvent
        name = str(event.get("event", ""))
        if name.startswith(("lock.", "completion.", "fence.")):
            count(f"{name}|{event.get('reason') or ''}", event.get("task_id"))
        return event

    structlog.configure(
        processors=[
            counter,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


app = create_app(json.loads(os.environ["CHAOS_CONFIG"])) if "CHAOS_CONFIG" in os.environ else None
