"""The Celery app of the chaos soak, run by ``celery -A chaos.app:app worker -P prefork``.

Configured from the JSON in ``CHAOS_CONFIG`` (written by :mod:`chaos.soak`):
the broker and result backend (a private Redis that is never touched), the
lock Redis (a private one the soak restarts, makes BUSY and refuses writes
on), the PostgreSQL DSN of the ledger, the completion backend (``"redis"``, or
a DSN through a proxy the soak cuts), the run's table names and its *cells*.
The driver builds the same app with :func:`create_app` to publish.

A cell is one combination the soak checks: a ``lock_mode``, an ``on_locked``
policy, a workload and, for a negative control, one guard switched off
(:data:`SWITCHES`). Each cell is its own task, ``chaos.job.<mode>.<policy>...``,
over entities no other cell uses, so the cells of one run share the workers
and the faults and are checked apart.

Every task is written the way the docs tell a user to write a money-moving task:

* ``lock_key="acct:{entity}"``, ``idempotency_key="job:{job_id}"``: the job's
  identity is its idempotency key, so a duplicate enqueue under another task
  id is the same business effect;
* ``acks_late`` + ``reject_on_worker_lost``: a killed child's message goes
  back to the queue; a short ``visibility_timeout`` redelivers running ones;
* body: some work, a checkpointed provider call (the provider honours the
  scope as its idempotency key, like Stripe's), more work, then ONE transaction with
  ``advance_fence``, the effect row and the *commit guard*, which says whether
  another run of the job already committed (the body then rolls its effect
  back; see docs/chaos.md for why the guard is needed):

  * with the PostgreSQL completion backend, ``self.record_completion`` -- the
    record commits with the effect;
  * with the Redis completion backend, the record is written by the release,
    after the transaction, and a Redis restart without persistence loses it:
    the guard is a uniqueness row in the ledger (``<run>_applied``), the
    "uniqueness rule in your database" the failure-modes page asks for;

* ``StaleFence`` and ``BackendUnavailable`` (a store outage in the middle of a
  body) are retried: a holder that lost its lease must not drop the job, it
  must run it again (where the completion record then ends it).

Every body records its execution -- start and end on the system-wide
``CLOCK_MONOTONIC`` (``time.monotonic()``, comparable across processes of
one host), the time its delivery started, its fence, whether the library
reported its lease lost, and when the release returned -- in the run's
PostgreSQL history table, committed at once so the row survives the ledger
transaction's rollback. Deliveries, answered task ids and
lock events are logged on the broker Redis; task states go to the result
backend, where a caller would read them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
import redis
import structlog
from celery import Celery, signals

from celery_lockguard import BackendUnavailable, LockContended, LockedTask, StaleFence, advance_fence
from celery_lockguard import _wire as wire

MODES = ("while_running", "until_started", "until_done")
POLICIES = ("skip", "retry", "raise")
BACKENDS = ("redis", "postgresql")
#: ``fast``: 5-40 ms bodies, a few outliving ``visibility_timeout``; ``billing``: ~200 ms, 1% forty times longer.
WORKLOADS = ("fast", "billing")
#: Guards a cell can switch off; each is a negative control the checker must catch (see chaos.soak.CONTROLS).
SWITCHES = (
    "ignore-record",  # the body ignores the commit guard's answer
    "no-fence",  # the body writes without advance_fence
    "no-renew",  # lock_renew=False
    "no-completion",  # completion=False: no record is checked or written
    "no-claim",  # the driver publishes with send_task, which bypasses queue-time claims
    "swallow-contended",  # the task catches LockContended and returns None (a silent skip)
    "fail-open",  # on_unavailable="fail_open": bodies run unlocked while the lock Redis is unavailable
)
UNSAFE_MODES = ("", *SWITCHES)


@dataclass(frozen=True)
class Cell:
    """One combination the soak checks, as its own task over its own entities."""

    mode: str = "while_running"
    policy: str = "skip"
    workload: str = "fast"
    unsafe: str = ""

    def __post_init__(self) -> None:
        for value, allowed in (
            (self.mode, MODES),
            (self.policy, POLICIES),
            (self.workload, WORKLOADS),
            (self.unsafe, UNSAFE_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"cell value {value!r} must be one of {allowed}")

    @property
    def name(self) -> str:
        """``mode/policy``, then the workload if not ``fast``, then ``!switch`` for a control."""
        name = f"{self.mode}/{self.policy}"
        if self.workload != "fast":
            name += f" {self.workload}"
        if self.unsafe:
            name += f" !{self.unsafe}"
        return name

    @property
    def task_name(self) -> str:
        parts = [self.mode, self.policy] + ([self.workload] if self.workload != "fast" else [])
        parts += [self.unsafe.replace("-", "_")] if self.unsafe else []
        return "chaos.job." + ".".join(parts)

    @property
    def queue_mode(self) -> bool:
        return self.mode != "while_running"

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, str]) -> Cell:
        return cls(**data)


#: The cell of the original soak (and of chaos.repro).
DEFAULT_CELL = Cell()
TASK_NAME = DEFAULT_CELL.task_name


class Tables:
    """The run's PostgreSQL tables, all named after one base so a run owns (and drops) exactly these."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.effects = f"{base}_effects"
        self.executions = f"{base}_exec"
        self.provider = f"{base}_provider"
        self.fences = f"{base}_fences"
        self.completions = f"{base}_completions"
        self.applied = f"{base}_applied"

    def all(self) -> list[str]:
        return [self.effects, self.executions, self.provider, self.fences, self.completions, self.applied]

    def ddl(self) -> list[str]:
        """Ledger, history and the provider's books; no uniqueness on effects, so the check can fail."""
        return [
            f"CREATE TABLE {self.effects} ("
            " seq BIGSERIAL PRIMARY KEY, job_id INT NOT NULL, entity INT NOT NULL, fence BIGINT NOT NULL,"
            " task_id TEXT NOT NULL, charge_id TEXT NOT NULL, exec_id BIGINT)",
            f"CREATE TABLE {self.executions} ("
            " id BIGSERIAL PRIMARY KEY, job_id INT NOT NULL, entity INT NOT NULL, task_id TEXT NOT NULL,"
            " fence BIGINT NOT NULL, worker TEXT NOT NULL, pid INT NOT NULL, redelivered BOOLEAN NOT NULL,"
            " t_delivered DOUBLE PRECISION, t_start DOUBLE PRECISION NOT NULL, t_end DOUBLE PRECISION,"
            " t_released DOUBLE PRECISION, lost_body BOOLEAN, lost_release BOOLEAN, lost_reason TEXT, outcome TEXT)",
            f"CREATE TABLE {self.provider} ("
            " idem_key TEXT PRIMARY KEY, job_id INT NOT NULL, charge_id TEXT NOT NULL, calls INT NOT NULL)",
            f"CREATE TABLE {self.applied} (job_id INT PRIMARY KEY, task_id TEXT NOT NULL)",
        ]


class Keys:
    """The run's keys on the broker Redis: lock events, deliveries and answered task ids."""

    def __init__(self, base: str) -> None:
        self.events = base  # hash: "event|reason" and "@task|event" -> count
        self.log = f"{base}:log"  # list: [task id, "event|reason", time] per lock event
        self.deliveries = f"{base}:deliveries"  # list: [task id, time, redelivered] per delivery
        self.answered = f"{base}:answered"  # set: task ids that stored SUCCESS or FAILURE


def connect(dsn: str, autocommit: bool = True, patience: float = 120.0) -> psycopg.Connection[Any]:
    """A connection to the soak's own PostgreSQL (ledger, history), waiting while the server refuses one.

    The soak never faults this server, but it is shared: when other users fill ``max_connections`` a
    connect fails with "too many clients". Waiting for a slot keeps the soak's bookkeeping from failing
    a task for a reason that has nothing to do with the library.
    """
    deadline = time.monotonic() + patience
    while True:
        try:
            return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=5)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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
            conn = self._conn = connect(self.dsn, self.autocommit)
            self._pid = os.getpid()
        return conn


class _Execution:
    """One run of a body: inserted at start, completed by the ``task_postrun`` hook."""

    def __init__(self, row_id: int, t_start: float, lease: Any) -> None:
        self.id = row_id
        self.t_start = t_start
        self.lease = lease
        self.t_end: float | None = None
        self.lost_body: bool | None = None
        self.outcome = "error"


class _AlreadyRecorded(Exception):
    """Another run of this job committed first: roll this run's effect back."""


class SwallowContended(LockedTask):
    """The ``swallow-contended`` control: a task that catches ``LockContended`` and reports success."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except LockContended:
            return None


def reason_of(event: MutableMapping[str, Any]) -> str:
    """The stable part of an event's reason (the text before any ``:`` detail such as an error message)."""
    return str(event.get("reason") or "").split(":", 1)[0].strip()


def create_app(cfg: dict[str, Any]) -> Celery:
    """The soak's app for ``cfg`` (see :mod:`chaos.soak` for the keys)."""
    tables = Tables(cfg["tables"])
    keys = Keys(cfg["events_key"])
    cells = [Cell.from_json(c) for c in cfg.get("cells") or [DEFAULT_CELL.to_json()]]
    store = cfg.get("store") or cfg["pg"]
    pg_backend = store != "redis"
    wire.DEFER_NEAR = bool(cfg.get("defer_replies"))  # True: as to a lock server on another host (chaos.soak)
    app = Celery("chaos", broker=cfg["broker"], backend=cfg.get("results") or None)
    app.conf.update(
        task_default_queue=cfg["queue"],
        task_ignore_result=not cfg.get("results"),
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
        lockguard_completion_backend=store,
        lockguard_completion_table=tables.completions,
    )
    if cfg.get("sentinels"):  # the failover leg (chaos.failover): the lock Redis is a Sentinel-managed master
        app.conf.update(
            lockguard_redis_url=None,
            lockguard_sentinels=[tuple(s) for s in cfg["sentinels"]],
            lockguard_sentinel_master=cfg["sentinel_master"],
        )
    # One autocommit connection per process (the server is shared: keep to few connections). The
    # history rows commit at once, so they survive the ledger transaction's rollback; the ledger write
    # is an explicit transaction on the same connection.
    history = ledger = _Connection(cfg["pg"], autocommit=True)
    counters = redis.Redis.from_url(cfg["broker"], socket_timeout=2)
    delivered_at: dict[str, float] = {}  # task id -> when its current delivery started (this process)
    runs: dict[str, _Execution] = {}  # task id -> the body running in this process
    by_task = {c.task_name: c for c in cells}

    def count(field: str, task_id: str | None = None, task_name: str | None = None) -> None:
        """Count an event (overall and per task); log it per task id too, for the report on a lost job."""
        try:
            pipe = counters.pipeline(transaction=False)
            pipe.hincrby(keys.events, field, 1)
            if task_name in by_task:
                pipe.hincrby(keys.events, f"@{task_name}|{field.split('|', 1)[0]}", 1)
            if task_id:
                pipe.rpush(keys.log, json.dumps([task_id, field, time.monotonic()]))
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

    def commit_guard(task: Any, cell: Cell, conn: psycopg.Connection[Any], job_id: int, result: Any) -> bool:
        """True if this run is the first to commit the job (see the module docstring)."""
        if pg_backend and cell.unsafe != "no-completion":
            return bool(task.record_completion(conn, result))
        cur = conn.execute(
            f"INSERT INTO {tables.applied} (job_id, task_id) VALUES (%s, %s) ON CONFLICT (job_id) DO NOTHING",
            (job_id, task.request.id),
        )
        return bool(cur.rowcount)

    def body(task: Any, cell: Cell, job_id: int, entity: int, work_ms: int) -> dict[str, Any] | None:
        lease = task.lock  # None only for the fail-open control, while the lock Redis is unavailable
        req = task.request
        t_start = time.monotonic()
        (row_id,) = history.get().execute(
            f"INSERT INTO {tables.executions} (job_id, entity, task_id, fence, worker, pid, redelivered,"
            " t_delivered, t_start) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (
                job_id,
                entity,
                req.id,
                lease.fence if lease is not None else -1,
                req.hostname or "",
                os.getpid(),
                bool((req.delivery_info or {}).get("redelivered")),
                delivered_at.get(req.id),
                t_start,
            ),
        ).fetchone() or (0,)
        run = runs[req.id] = _Execution(row_id, t_start, lease)
        try:
            # The work comes in two halves around the provider call: a kill lands before or after the charge,
            # and a run without a lease (fail-open) has started its work before it needs the store.
            time.sleep(work_ms / 2000)
            # No scope on a fail-open run with the Redis backend (nothing is checked or recorded then).
            scope = task.completion_scope or f"job:{job_id}"
            charge = task.checkpoint("provider", provider_charge, job_id, idempotency_key=scope)
            time.sleep(work_ms / 2000)
            conn = ledger.get()
            fence = lease.fence if lease is not None else -1
            try:
                with conn.transaction():
                    if cell.unsafe != "no-fence":
                        # StaleFence: a newer holder of the entity wrote; BackendUnavailable: no lease (fail-open)
                        fence = advance_fence(conn, lease, table=tables.fences)
                    conn.execute(
                        f"INSERT INTO {tables.effects} (job_id, entity, fence, task_id, charge_id, exec_id) "
                        "VALUES (%s, %s, %s, %s, %s, %s)",
                        (job_id, entity, fence, req.id, charge["charge_id"], row_id),
                    )
                    result = {"charge_id": charge["charge_id"], "fence": fence}
                    if not commit_guard(task, cell, conn, job_id, result) and cell.unsafe != "ignore-record":
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
            run.lost_body = lease.lost if lease is not None else None

    for cell in cells:
        _register(app, cell, cfg["ttl"], body)

    @signals.task_prerun.connect(weak=False)
    def _delivered(task: Any = None, task_id: str | None = None, **_: Any) -> None:
        if getattr(task, "name", None) not in by_task or task_id is None:
            return
        now = time.monotonic()
        delivered_at[task_id] = now
        redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
        count("delivery|redelivered" if redelivered else "delivery|first", task_name=task.name)
        try:
            counters.rpush(keys.deliveries, json.dumps([task_id, now, redelivered]))
        except redis.RedisError:
            pass

    @signals.task_postrun.connect(weak=False)
    def _finished(task: Any = None, task_id: str | None = None, state: str | None = None, **_: Any) -> None:
        """Complete the execution row once the lease is released: the release may report it lost."""
        if getattr(task, "name", None) not in by_task or task_id is None:
            return
        released = time.monotonic()
        delivered_at.pop(task_id, None)
        if state in ("SUCCESS", "FAILURE"):
            try:
                counters.sadd(keys.answered, task_id)
            except redis.RedisError:
                pass
        run = runs.pop(task_id, None)
        if run is None:
            return
        reason = getattr(run.lease, "lost_reason", None)
        history.get().execute(
            f"UPDATE {tables.executions} SET t_end = %s, t_released = %s, lost_body = %s, lost_release = %s,"
            " lost_reason = %s, outcome = %s WHERE id = %s",
            (run.t_end, released, run.lost_body, reason is not None, reason, f"{run.outcome}:{state}", run.id),
        )

    @signals.worker_init.connect(weak=False)
    @signals.worker_process_init.connect(weak=False)
    def _observe(**_: Any) -> None:
        configure_structlog(count)

    return app


def _register(app: Celery, cell: Cell, ttl: float, body: Any) -> None:
    """The cell's task: the shared body under the cell's mode, policy and switch."""
    base = SwallowContended if cell.unsafe == "swallow-contended" else LockedTask

    @app.task(
        base=base,
        bind=True,
        shared=False,
        name=cell.task_name,
        lock_key="acct:{entity}",
        idempotency_key="job:{job_id}",
        lock_ttl=ttl,
        lock_mode=cell.mode,
        on_locked=cell.policy,
        lock_renew=cell.unsafe != "no-renew",
        completion=cell.unsafe != "no-completion",
        on_unavailable="fail_open" if cell.unsafe == "fail-open" else "fail_closed",
        acks_late=True,
        reject_on_worker_lost=True,
        autoretry_for=(StaleFence, BackendUnavailable),
        retry_kwargs={"max_retries": 50, "countdown": 0.2},
    )
    def job(self: Any, job_id: int, entity: int, work_ms: int) -> dict[str, Any] | None:
        return body(self, cell, job_id, entity, work_ms)  # type: ignore[no-any-return]


def configure_structlog(count: Any) -> None:
    """Count every lock event at info or above (field ``event|reason``) and print it to the worker log.

    The library never configures structlog; this app does, as a production app would.
    Per-task debug events (``lock.acquired``/``lock.released``) are dropped uncounted.
    """

    def counter(_: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if method == "debug":
            raise structlog.DropEvent
        name = str(event.get("event", ""))
        if name.startswith(("lock.", "completion.", "fence.")):
            count(f"{name}|{reason_of(event)}", event.get("task_id"), event.get("task_name"))
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
