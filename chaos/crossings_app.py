"""The app of the crossings soak (:mod:`chaos.crossings`), run by ``celery -A chaos.crossings_app:app worker``.

Configured from the JSON in ``CHAOS_CX_CONFIG``: the broker (RabbitMQ, or a private Redis), one private
Redis for the leases, the results and the bodies' history, and PostgreSQL for the effects, the fences and
the completion records (tables named after the run). Every body records its start and end
(``time.monotonic()``, one clock for every process of the host) and its pid in a Redis list the checker
reads; a body that commits an effect does it in one PostgreSQL transaction.

Three cells cross two or three features each:

* ``debounce`` -- ``lock_debounce`` bursts published while a run of the entity holds it, so the pending
  run parks and is woken by the release (hand-off), under SIGKILLs of pool children mid-body. Its
  control ``cx.undebounced`` is the same task without ``lock_debounce``: every publish runs.
* ``workflow`` -- chains under ``workflow()`` whose members take their own lock behind a long holder,
  ``retry()`` after Celery's ``default_retry_delay`` (longer than the gap), and chords with a failing
  page, beside plain tasks on the workflow's entity. Its control runs the same chain without
  ``workflow()``: the plain task gets in between.
* ``limit`` -- ``lock_limit=2`` exports and an ``until_done`` purge on one entity (shared and
  exclusive), under SIGKILLs. Its control ``cx.purge_unlocked`` is a plain Celery task: it overlaps.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import psycopg
import redis
from celery import Celery, Task

from celery_lockguard import LockedTask, advance_fence

#: The workflow cell's entity, one per tenant.
PIPELINE = "cxt:{tenant}"
#: The workflow cell's tasks (``cx.<name>``), routed to its own queue and worker.
WORKFLOW_TASKS = ("step", "own_lock", "hold", "retry_bare", "page", "collect", "plain")


def history_key(prefix: str) -> str:
    return f"{prefix}:history"


def tables(prefix: str) -> dict[str, str]:
    """The run's PostgreSQL tables (dropped at the end)."""
    return {"effects": f"{prefix}_effects", "fences": f"{prefix}_fences", "completions": f"{prefix}_done"}


class AlreadyRecorded(Exception):
    """Another run of this job committed first: roll this effect back."""


def create_app(cfg: dict[str, Any]) -> Celery:
    app = Celery("chaos_crossings", broker=cfg["broker"], backend=cfg["redis"])
    t = tables(cfg["prefix"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["redis"],
        lockguard_key_prefix=cfg["prefix"],
        lockguard_completion_backend=cfg["pg"],
        lockguard_completion_table=t["completions"],
        broker_transport_options={"visibility_timeout": cfg["visibility_timeout"]},
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
        # The workflow cell on a worker of its own: a member queued behind the other cells' backlog longer than
        # the gap would lose its workflow (gap_ttl's promise), which is not the crossing under test.
        task_routes={f"cx.{name}": {"queue": cfg["wf_queue"]} for name in WORKFLOW_TASKS},
    )
    rec = redis.Redis.from_url(cfg["redis"], decode_responses=True)
    hist = history_key(cfg["prefix"])
    conns: dict[int, psycopg.Connection[Any]] = {}

    def pg() -> psycopg.Connection[Any]:
        pid = os.getpid()
        conn = conns.get(pid)
        if conn is None or conn.closed:
            conn = conns[pid] = psycopg.connect(cfg["pg"], autocommit=True, connect_timeout=10)
        return conn

    def record(ev: str, cell: str, entity: str, job: str, task: Any, **extra: Any) -> None:
        row = {"ev": ev, "cell": cell, "entity": entity, "job": job, "task_id": task.request.id, "pid": os.getpid()}
        rec.rpush(hist, json.dumps({**row, "t": time.monotonic(), **extra}))

    def work(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.01)

    def commit(task: Any, cell: str, entity: str, job: str, lease: Any, guard: bool) -> bool:
        """The effect, its fence and (``guard``) the completion record, in one transaction."""
        conn = pg()
        try:
            with conn.transaction():
                fence = advance_fence(conn, lease, table=t["fences"]) if lease is not None else None
                conn.execute(
                    f"INSERT INTO {t['effects']} (cell, entity, job, task_id, fence) VALUES (%s, %s, %s, %s, %s)",
                    (cell, entity, job, task.request.id, fence),
                )
                if guard and not task.record_completion(conn, result=job):
                    raise AlreadyRecorded
        except AlreadyRecorded:
            return False
        return True

    # -- debounce x park x kills ---------------------------------------------------------------------

    def debounced_body(self: Any, cell: str, entity: int, burst: int, position: int, work_s: float) -> dict[str, Any]:
        job = f"{entity}/{burst}/{position}"
        record("start", cell, f"doc:{entity}", job, self, burst=burst, position=position)
        work(work_s)
        committed = commit(self, cell, f"doc:{entity}", job, self.lock, guard=True)
        record("end", cell, f"doc:{entity}", job, self, committed=committed)
        return {"entity": entity, "burst": burst, "position": position}

    common = {"base": LockedTask, "bind": True, "shared": False, "acks_late": True, "reject_on_worker_lost": True}

    @app.task(
        name="cx.debounced",
        lock_key="doc:{entity}",
        lock_debounce=cfg["debounce"],
        lock_ttl=3,
        idempotency_key="cxd:{entity}:{burst}:{position}",
        lock_max_waits=10_000,
        **common,
    )
    def debounced(self: Any, entity: int, burst: int, position: int, work_s: float) -> dict[str, Any]:
        return debounced_body(self, "debounce", entity, burst, position, work_s)

    @app.task(
        name="cx.undebounced",
        lock_key="doc:{entity}",
        lock_ttl=3,
        idempotency_key="cxu:{entity}:{burst}:{position}",
        lock_max_waits=10_000,
        **common,
    )
    def undebounced(self: Any, entity: int, burst: int, position: int, work_s: float) -> dict[str, Any]:
        """The debounce cell's control: the same task without ``lock_debounce`` runs every publish."""
        return debounced_body(self, "debounce-control", entity, burst, position, work_s)

    # -- workflow x a member's own lock x retry() x a failing chord page ------------------------------

    def member(self: Any, cell: str, tenant: str, wf: str, step: str, seconds: float, prev: Any) -> dict[str, Any]:
        record("start", cell, tenant, f"{wf}/{step}", self, wf=wf, step=step)
        work(seconds)
        commit(self, cell, tenant, f"{wf}/{step}", None, guard=False)
        record("end", cell, tenant, f"{wf}/{step}", self, wf=wf, step=step)
        steps = list(prev["steps"]) if isinstance(prev, dict) else []
        return {"steps": [*steps, step]}

    wf_task = {"base": LockedTask, "bind": True, "shared": False}

    @app.task(name="cx.step", **wf_task)
    def step(self: Any, prev: Any = None, cell: str = "", tenant: str = "", wf: str = "", step: str = "") -> Any:
        return member(self, cell, tenant, wf, step, 0.1, prev)

    @app.task(name="cx.own_lock", lock_key="cxi:{invoice}", lock_ttl=6, lock_max_waits=10_000, **wf_task)
    def own_lock(
        self: Any, prev: Any = None, cell: str = "", tenant: str = "", wf: str = "", step: str = "", invoice: int = 0
    ) -> Any:
        """A member with a lock of its own: it waits behind ``cx.hold`` (lock_ttl 6 s > the gap)."""
        return member(self, cell, tenant, wf, step, 0.1, prev)

    @app.task(name="cx.hold", lock_key="cxi:{invoice}", lock_ttl=6, **wf_task)
    def hold(self: Any, invoice: int = 0, seconds: float = 4.0) -> int:
        """A plain task holding the member's own entity a while (its lease renewed meanwhile)."""
        work(seconds)
        return invoice

    @app.task(name="cx.retry_bare", max_retries=3, default_retry_delay=cfg["retry_delay"], **wf_task)
    def retry_bare(self: Any, prev: Any = None, cell: str = "", tenant: str = "", wf: str = "", step: str = "") -> Any:
        """Retries once as users write it: ``raise self.retry(exc=exc)``, due after ``default_retry_delay``."""
        record("try", cell, tenant, f"{wf}/{step}", self, wf=wf, step=step, retries=self.request.retries)
        if self.request.retries == 0:
            try:
                raise ConnectionError("the provider is down")
            except ConnectionError as exc:
                raise self.retry(exc=exc) from exc
        return member(self, cell, tenant, wf, step, 0.1, prev)

    @app.task(name="cx.page", **wf_task)
    def page(
        self: Any, prev: Any = None, cell: str = "", tenant: str = "", wf: str = "", step: str = "", fail: bool = False
    ) -> Any:
        if fail:
            record("start", cell, tenant, f"{wf}/{step}", self, wf=wf, step=step)
            record("end", cell, tenant, f"{wf}/{step}", self, wf=wf, step=step, failed=True)
            raise ValueError(f"page {step} failed")
        return member(self, cell, tenant, wf, step, 0.6, prev)

    @app.task(name="cx.collect", **wf_task)
    def collect(self: Any, pages: Any = None, cell: str = "", tenant: str = "", wf: str = "", step: str = "") -> Any:
        return member(self, cell, tenant, wf, step, 0.05, None)

    @app.task(name="cx.plain", lock_key=PIPELINE, lock_ttl=5, on_locked="retry", lock_max_waits=10_000, **wf_task)
    def plain(self: Any, cell: str = "", tenant: str = "", job: str = "") -> Any:
        """Other work on the workflow's entity: it must run before or after a workflow, never inside it."""
        return member(self, cell, tenant, job, "plain", 0.05, None)

    # -- lock_limit x until_done -------------------------------------------------------------------------

    def partner_body(self: Any, cell: str, kind: str, partner: int, job: str, work_s: float, lease: Any) -> str:
        record("start", cell, f"partner:{partner}", job, self, kind=kind)
        work(work_s)
        committed = commit(self, cell, f"partner:{partner}", job, lease, guard=lease is not None)
        record("end", cell, f"partner:{partner}", job, self, kind=kind, committed=committed)
        return job

    @app.task(
        name="cx.export",
        lock_key="partner:{partner}",
        lock_limit=2,
        lock_ttl=3,
        idempotency_key="cxe:{job}",
        lock_max_waits=10_000,
        **common,
    )
    def export(self: Any, partner: int, job: str, work_s: float, cell: str = "limit") -> str:
        return partner_body(self, cell, "export", partner, job, work_s, self.lock)

    @app.task(
        name="cx.purge",
        lock_key="partner:{partner}",
        lock_mode="until_done",
        lock_ttl=3,
        queue_lock_ttl=120,
        idempotency_key="cxp:{job}",
        lock_max_waits=10_000,
        **common,
    )
    def purge(self: Any, partner: int, job: str, work_s: float) -> str:
        return partner_body(self, "limit", "purge", partner, job, work_s, self.lock)

    @app.task(name="cx.purge_unlocked", bind=True, shared=False, acks_late=True, reject_on_worker_lost=True)
    def purge_unlocked(self: Task, partner: int, job: str, work_s: float) -> str:
        """The limit cell's control: the purge without the exclusive lease."""
        return partner_body(self, "limit-control", "purge", partner, job, work_s, None)

    return app


app = create_app(json.loads(os.environ["CHAOS_CX_CONFIG"])) if "CHAOS_CX_CONFIG" in os.environ else None
