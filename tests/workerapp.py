"""The Celery app the integration tests run in real ``celery worker`` subprocesses.

Configured from the JSON in ``LG_CONFIG`` so each test can start workers
against its own Redis, queue and key prefix; the test process builds the same
app with :func:`create_app` to publish and read results.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers


def create_app(cfg: dict[str, Any]) -> Celery:
    app = Celery("workerapp", broker=cfg["broker"], backend=cfg.get("backend", cfg["broker"]))
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["lock_url"],
        lockguard_key_prefix=cfg["prefix"],
        lockguard_on_unavailable=cfg.get("on_unavailable", "fail_closed"),
        lockguard_socket_timeout=cfg.get("socket_timeout", 1.0),
        lockguard_redis_cluster=cfg.get("lock_cluster", False),
        broker_transport_options={
            "visibility_timeout": cfg.get("visibility_timeout", 3600),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "global_keyprefix": f"{cfg['prefix']}:kombu:",
        },
        result_backend_transport_options={"global_keyprefix": f"{cfg['prefix']}:results:"},
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=900,
        task_acks_late=cfg.get("acks_late", False),
        task_reject_on_worker_lost=cfg.get("acks_late", False),
        worker_hijack_root_logger=False,
    )
    if cfg.get("max_tasks_per_child"):
        app.conf.worker_max_tasks_per_child = cfg["max_tasks_per_child"]
    if cfg.get("metrics_flush_interval"):
        app.conf.lockguard_metrics_flush_interval = cfg["metrics_flush_interval"]
    if cfg.get("soft_time_limit"):
        app.conf.task_soft_time_limit = cfg["soft_time_limit"]
    if cfg.get("completion_backend"):
        app.conf.lockguard_completion_backend = cfg["completion_backend"]
        app.conf.lockguard_completion_table = cfg.get("completion_table", "lockguard_completions")
    rec = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    rec_key = f"{cfg['prefix']}:record"

    def record(**fields: Any) -> None:
        rec.rpush(rec_key, json.dumps({"pid": os.getpid(), "t": time.time(), **fields}))

    def body(self: Any, key: str, seconds: float, tag: str) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        lease = self.lock
        record(ev="end", key=key, tag=tag, task_id=self.request.id, lost=lease.lost if lease else None)
        return {
            "tag": tag,
            "fence": lease.fence if lease else None,
            "lost": lease.lost if lease else None,
            "held": lease.held if lease else None,
        }

    @app.task(base=LockedTask, bind=True, shared=False, name="hold_skip", lock_key="res:{key}", lock_ttl=5)
    def hold_skip(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="hold_wait", lock_key="res:{key}", lock_ttl=5, on_locked="retry"
    )
    def hold_wait(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="hold_raise", lock_key="res:{key}", lock_ttl=5, on_locked="raise"
    )
    def hold_raise(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="short_ttl", lock_key="res:{key}", lock_ttl=1)
    def short_ttl(self: Any, key: str, seconds: float = 4, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="no_renew", lock_key="res:{key}", lock_ttl=1, lock_renew=False
    )
    def no_renew(self: Any, key: str, seconds: float = 2, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="charge", lock_key="invoice:{invoice_id}", lock_ttl=5)
    def charge(self: Any, invoice_id: int, amount: int, seconds: float = 1.0) -> dict[str, Any]:
        out = body(self, f"invoice:{invoice_id}", seconds, f"charge:{amount}")
        # what the message cost: waits spent (each a publish: a back-off or a safety copy) and a wake publish
        return {
            **out,
            "waits": headers.read_int(self.request, headers.WAITS),
            "woken": bool(headers.read(self.request, headers.WOKEN)),
        }

    @app.task(
        base=LockedTask, bind=True, shared=False, name="hold_invoice", lock_key="invoice:{invoice_id}", lock_ttl=5
    )
    def hold_invoice(self: Any, invoice_id: int, seconds: float = 2.0) -> dict[str, Any]:
        """A holder of other work on the ``charge`` entity (its own name: the releaser-killed hook names it)."""
        return body(self, f"invoice:{invoice_id}", seconds, "holder")

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="crash_once",
        lock_key="res:{key}",
        lock_ttl=30,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def crash_once(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        attempt = rec.incr(f"{cfg['prefix']}:attempts:{key}")
        record(ev="start", key=key, tag=tag, attempt=attempt, task_id=self.request.id)
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        record(ev="end", key=key, tag=tag, attempt=attempt, task_id=self.request.id)
        return {"attempt": attempt, "fence": self.lock.fence}

    @app.task(base=LockedTask, bind=True, shared=False, name="plain_locked", lock_key="res:{key}")
    def plain_locked(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag, "locked": self.lock is not None}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="retry_self",
        lock_key="res:{key}",
        max_retries=2,
        default_retry_delay=0.1,
    )
    def retry_self(self: Any, key: str) -> dict[str, Any]:
        record(ev="start", key=key, retries=self.request.retries, task_id=self.request.id)
        if self.request.retries < 2:
            raise self.retry()
        return {"retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="limited", lock_key="res:{key}", lock_ttl=60, time_limit=1.5
    )
    def limited(self: Any, key: str, seconds: float = 30, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    def gated_key(key: str, gate: str, tag: str = "") -> str:
        """Render only once the test opens ``gate`` (a file): lets a test act between delivery and acquire."""
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"res:{key}"

    @app.task(base=LockedTask, bind=True, shared=False, name="gated", lock_key=gated_key, lock_ttl=5)
    def gated(self: Any, key: str, gate: str, tag: str = "") -> dict[str, Any]:
        return body(self, key, 0.1, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="fenced_write", lock_key="acct:{entity}", lock_ttl=1)
    def fenced_write(self: Any, entity: str, value: str, gate: str, table: str) -> dict[str, Any]:
        """Write ``value`` to the ledger under the lease's fence once ``gate`` (a file) exists."""
        import psycopg

        from celery_lockguard import advance_fence

        record(ev="start", key=entity, tag=value, task_id=self.request.id)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        with psycopg.connect(cfg["pg"]) as conn, conn.transaction():
            advance_fence(conn, self.lock, table=f"{table}_fences")
            conn.execute(
                f"INSERT INTO {table}_ledger (entity, value) VALUES (%s, %s) "
                "ON CONFLICT (entity) DO UPDATE SET value = excluded.value",
                (entity, value),
            )
        record(ev="end", key=entity, tag=value, task_id=self.request.id)
        return {"value": value, "fence": self.lock.fence}

    @app.task(base=LockedTask, bind=True, shared=False, name="idem_effect", idempotency_key="inv:{invoice_id}")
    def idem_effect(self: Any, invoice_id: int) -> dict[str, Any]:
        effects = rec.incr(f"{cfg['prefix']}:effects:{invoice_id}")
        record(ev="start", key=f"inv:{invoice_id}", task_id=self.request.id)
        return {"effects": effects, "by": self.request.id}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="checkpoint_crash",
        lock_key="res:{key}",
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def checkpoint_crash(self: Any, key: str) -> dict[str, Any]:
        """Charge through a checkpoint, then die once right after it: the charge must not repeat."""
        attempt = rec.incr(f"{cfg['prefix']}:attempts:{key}")
        charged = self.checkpoint("charge", rec.incr, f"{cfg['prefix']}:effects:{key}")
        record(ev="start", key=key, attempt=attempt, task_id=self.request.id)
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"attempt": attempt, "charged": charged}

    @app.task(base=LockedTask, bind=True, shared=False, name="hold_gate", lock_key="res:{key}", lock_ttl=5)
    def hold_gate(self: Any, key: str, gate: str, tag: str = "") -> dict[str, Any]:
        """Hold the lease until the test creates ``gate`` (a file), at most 60 s: a holder a test controls."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        lease = self.lock
        return {"tag": tag, "fence": lease.fence, "lost": lease.lost, "held": lease.held}

    @app.task(base=LockedTask, bind=True, shared=False, name="idem_step", idempotency_key="order:{order}")
    def idem_step(self: Any, order: int) -> dict[str, Any]:
        """One checkpointed step under an idempotency scope (for ``lockguard completions``)."""
        charged = self.checkpoint("charge", rec.incr, f"{cfg['prefix']}:charges:{order}")
        return {"order": order, "charged": charged}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_started",
        lock_key="res:{key}",
        lock_mode="until_started",
        lock_ttl=5,
    )
    def until_started(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_started_raise",
        lock_key="res:{key}",
        lock_mode="until_started",
        on_locked="raise",
        lock_ttl=5,
    )
    def until_started_raise(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        """celery-once's ``unlock_before_run=True`` with its default ``graceful=False`` (docs/migrating.md)."""
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_done",
        lock_key="res:{key}",
        lock_mode="until_done",
        lock_ttl=5,
        queue_lock_ttl=2,
    )
    def until_done(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_done_raise",
        lock_key="res:{key}",
        lock_mode="until_done",
        on_locked="raise",
        lock_ttl=5,
    )
    def until_done_raise(self: Any, key: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_done_retry",
        lock_key="res:{key}",
        lock_mode="until_done",
        max_retries=2,
        default_retry_delay=0.5,
    )
    def until_done_retry(self: Any, key: str, always: bool = False) -> dict[str, Any]:
        record(ev="start", key=key, retries=self.request.retries, task_id=self.request.id)
        if always or self.request.retries < 2:
            raise self.retry()
        return {"retries": self.request.retries}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="until_done_autoretry",
        lock_key="res:{key}",
        lock_mode="until_done",
        autoretry_for=(ValueError,),
        retry_kwargs={"max_retries": 2, "countdown": 0.3},
    )
    def until_done_autoretry(self: Any, key: str) -> dict[str, Any]:
        record(ev="start", key=key, retries=self.request.retries, task_id=self.request.id)
        if self.request.retries < 2:
            raise ValueError("transient")
        return {"retries": self.request.retries}

    @app.task(shared=False, name="echo")
    def echo(value: Any = None) -> dict[str, Any]:
        return {"got": value}

    @app.task(base=LockedTask, bind=True, shared=False, name="reindex_catalog", lock_key="catalog:reindex", lock_ttl=5)
    def reindex_catalog(self: Any, seconds: float = 2.5) -> dict[str, Any]:
        return body(self, "catalog:reindex", seconds, "beat")

    @app.task(base=LockedTask, bind=True, shared=False, name="replacer", lock_key="res:{key}", lock_ttl=5)
    def replacer(self: Any, key: str, mode: str = "while_running") -> Any:
        """Replace itself with locked work on the same entity, under the same task id."""
        record(ev="replacer", key=key, task_id=self.request.id)
        target = "until_done" if mode == "until_done" else "hold_skip"
        return self.replace(app.tasks[target].s(key, 0.2, "replaced"))

    lock_redis = redis.Redis.from_url(cfg["lock_url"], decode_responses=True)

    def admitted(self: Any, key: str, seconds: float, tag: str) -> dict[str, Any]:
        """A body that records the server time its slot was admitted (the lease hash's ``acquired_at``)."""
        lease = self.lock
        at = int(lock_redis.hget(lease.redis_key, "acquired_at") or 0) if lease else 0
        record(ev="start", key=key, tag=tag, task_id=self.request.id, slot=lease.slot if lease else None, at=at)
        time.sleep(seconds)
        record(ev="end", key=key, tag=tag, task_id=self.request.id, slot=lease.slot if lease else None)
        return {"tag": tag, "slot": lease.slot if lease else None, "fence": lease.fence if lease else None, "at": at}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="export_limited",
        lock_key="tenant:{tenant}",
        lock_limit=2,
        lock_ttl=3,
        on_locked="retry",
        max_retries=0,  # a slot wait must not use up max_retries: it spends lock_max_waits
    )
    def export_limited(self: Any, tenant: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        return admitted(self, tenant, seconds, tag)

    def server_timed(self: Any, key: str, seconds: float, tag: str) -> dict[str, Any]:
        """A body that records the lock server's TIME (ms) when it starts and ends: one clock for every worker."""

        def now_ms() -> int:
            sec, usec = lock_redis.time()
            return int(sec) * 1000 + int(usec) // 1000

        lease = self.lock
        slot = lease.slot if lease else None
        woken = bool(headers.read(self.request, headers.WOKEN))  # a releaser's wake, not a safety copy
        record(ev="start", key=key, tag=tag, task_id=self.request.id, slot=slot, at=now_ms(), woken=woken)
        time.sleep(seconds)
        record(ev="end", key=key, tag=tag, task_id=self.request.id, slot=slot, at=now_ms())
        return {"tag": tag, "slot": slot}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="export_partner",
        lock_key="partner:{partner}",
        lock_limit=2,
        lock_ttl=3,
        on_locked="retry",
        max_retries=0,
    )
    def export_partner(self: Any, partner: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        """docs/limits.md's two exports per partner: shared holders of ``partner:{partner}``."""
        return server_timed(self, partner, seconds, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="delete_partner", lock_key="partner:{partner}", lock_ttl=3)
    def delete_partner(self: Any, partner: str, seconds: float = 0.5, tag: str = "") -> dict[str, Any]:
        """The single lease on the same entity: exclusive against every export slot (issue 29 item 12)."""
        return server_timed(self, partner, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="partner_call",
        lock_key="partner:{partner}",
        lock_limit=4,
        lock_rate="3/1s",
        lock_ttl=5,
        on_locked="retry",
        max_retries=0,  # a rate wait must not use up max_retries: it spends lock_max_waits
    )
    def partner_call(self: Any, partner: str, seconds: float = 0.05, tag: str = "") -> dict[str, Any]:
        return admitted(self, partner, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="partner_call_raise",
        lock_key="partner:{partner}",
        lock_rate="1/1m",
        on_locked="raise",
    )
    def partner_call_raise(self: Any, partner: str, seconds: float = 0.05, tag: str = "") -> dict[str, Any]:
        return admitted(self, partner, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="debounced",
        lock_key="res:{key}",
        lock_ttl=5,
        lock_debounce=cfg.get("debounce", 1.5),
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def debounced(self: Any, key: str, seconds: float = 0.1, tag: str = "") -> dict[str, Any]:
        """Debounced work on ``res:{key}`` (the search re-index of docs/debounce.md): the last publish wins."""
        return body(self, key, seconds, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="debounced_gate",
        lock_key="res:{key}",
        lock_ttl=5,
        lock_debounce=cfg.get("debounce", 1.5),
        queue_lock_ttl=cfg.get("debounce_queue_ttl"),
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def debounced_gate(self: Any, key: str, gate: str, tag: str = "") -> dict[str, Any]:
        """Debounced work on ``res:{key}`` whose body runs until the test creates ``gate`` (a file, at most 60 s)."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    from .wakeapp import register as register_wake_tasks

    register_wake_tasks(app, cfg, record)

    from .reviewapp import register as register_review_tasks

    register_review_tasks(app, cfg, record)

    from .multiapp import register as register_multi_tasks

    register_multi_tasks(app, cfg, record)

    from .xr3app import register as register_xr3_tasks

    register_xr3_tasks(app, cfg, record)

    from .xbapp import register as register_xb_tasks

    register_xb_tasks(app, cfg, record)

    from .xaapp import register as register_xa_tasks

    register_xa_tasks(app, cfg, record)

    from .xcapp import register as register_xc_tasks

    register_xc_tasks(app, cfg, record)

    from .rwapp import register as register_rw_tasks

    register_rw_tasks(app, cfg, record)

    from .rvapp import register as register_rv_tasks

    register_rv_tasks(app, cfg, record)

    if cfg.get("beat_every"):
        app.conf.beat_schedule = {
            "reindex": {"task": "reindex_catalog", "schedule": float(cfg["beat_every"]), "args": (2.5,)}
        }

    return app


app = create_app(json.loads(os.environ["LG_CONFIG"])) if "LG_CONFIG" in os.environ else None
