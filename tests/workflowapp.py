"""The worker app of the workflow tests: ``tests.workerapp``'s app plus pipeline members.

Every member records its start and end (with the lease it saw: key, fence, whether held) in a Redis
list the test reads, and returns the tags of the steps so far, so a chain's result shows its order.
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

from .workerapp import create_app as create_base_app

PIPELINE = "tenant:{tenant}:pipeline"


def create_app(cfg: dict[str, Any]) -> Celery:
    app = create_base_app(cfg)
    rec = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    rec_key = f"{cfg['prefix']}:wf"

    def record(self: Any, ev: str, tenant: str, tag: str, **fields: Any) -> None:
        lease, wf = self.lock, self.workflow_lock
        row = {
            "ev": ev,
            "tenant": tenant,
            "tag": tag,
            "task_id": self.request.id,
            "pid": os.getpid(),
            "t": time.time(),
            "key": lease.key if lease else None,
            "fence": lease.fence if lease and not lease.several else None,
            "fences": lease.fences if lease else None,  # every entity's (a workflow over several: each its own)
            "held": lease.held if lease else None,
            "wf_key": wf.key if wf else None,
            "wf_fence": wf.fence if wf and not wf.several else None,
            **fields,
        }
        rec.rpush(rec_key, json.dumps(row))

    def run(self: Any, prev: Any, tenant: str, tag: str, seconds: float, **extra: Any) -> dict[str, Any]:
        record(self, "start", tenant, tag, **extra)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        record(self, "end", tenant, tag, **extra)
        tags = list(prev["tags"]) if isinstance(prev, dict) else []
        fence = self.lock.fences if self.lock and self.lock.several else (self.lock.fence if self.lock else None)
        return {"tags": [*tags, tag], "fence": fence}

    def wait_gate(gate: str) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.step")
    def step(self: Any, prev: Any = None, tenant: str = "", tag: str = "", seconds: float = 0.2) -> dict[str, Any]:
        """A pipeline step with no lock of its own: it runs under the workflow lease."""
        return run(self, prev, tenant, tag, seconds)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.fail")
    def fail(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> None:
        record(self, "start", tenant, tag)
        raise ValueError(f"step {tag} failed")

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.gate")
    def gate(self: Any, prev: Any = None, tenant: str = "", tag: str = "", gate: str = "") -> dict[str, Any]:
        """Hold the workflow lease until the test creates ``gate`` (a file), at most 60 s."""
        record(self, "gate", tenant, tag)
        wait_gate(gate)
        return run(self, prev, tenant, tag, 0)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.stuck")
    def stuck(self: Any, prev: Any = None, tenant: str = "", tag: str = "", gate: str = "") -> dict[str, Any]:
        """Like ``wf.gate``, deaf to SIGTERM: at its hard time limit billiard must SIGKILL it, so nothing
        in the child (no ``finally``) ends the lease, only the worker's main process."""
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # process-wide: a mask would miss other threads
        try:
            record(self, "gate", tenant, tag)
            wait_gate(gate)
        finally:
            signal.signal(signal.SIGTERM, before)
        return run(self, prev, tenant, tag, 0)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="wf.crash_once", acks_late=True, reject_on_worker_lost=True
    )
    def crash_once(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> dict[str, Any]:
        """SIGKILL its own pool child on the first delivery (acks_late: the message comes back)."""
        attempt = rec.incr(f"{cfg['prefix']}:attempts:{tenant}:{tag}")
        charged = self.checkpoint("charge", rec.incr, f"{cfg['prefix']}:effects:{tenant}")
        record(self, "start", tenant, tag, attempt=attempt, charged=charged)
        if attempt == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return run(self, prev, tenant, tag, 0, attempt=attempt)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.retry_once", max_retries=3)
    def retry_once(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> dict[str, Any]:
        record(self, "try", tenant, tag, retries=self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=0.2)
        return run(self, prev, tenant, tag, 0, retries=self.request.retries)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.retry_always", max_retries=1)
    def retry_always(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> None:
        """Retry on every delivery: its second retry exceeds max_retries and the member fails."""
        record(self, "try", tenant, tag, retries=self.request.retries)
        raise self.retry(countdown=0.1)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.gate_retry", max_retries=2)
    def gate_retry(self: Any, prev: Any = None, tenant: str = "", tag: str = "", gate: str = "") -> dict[str, Any]:
        """Hold the workflow lease until ``gate`` exists, then retry once (0.5 s); the retry runs."""
        record(self, "try", tenant, tag, retries=self.request.retries)
        if self.request.retries < 1:
            wait_gate(gate)
            raise self.retry(countdown=0.5)
        return run(self, prev, tenant, tag, 0.1, retries=self.request.retries)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.retry_bare", max_retries=2, default_retry_delay=4)
    def retry_bare(
        self: Any, prev: Any = None, tenant: str = "", tag: str = "", countdown: float | None = None
    ) -> dict[str, Any]:
        """Retry once as users write it: ``raise self.retry(exc=exc)`` (``default_retry_delay``, here 4 s), or
        with ``countdown``; then run."""
        record(self, "try", tenant, tag, retries=self.request.retries)
        if self.request.retries < 1:
            exc = ValueError(f"{tag}: try again")
            raise self.retry(exc=exc) if countdown is None else self.retry(exc=exc, countdown=countdown)
        return run(self, prev, tenant, tag, 0.1, retries=self.request.retries)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="wf.hold_invoice", lock_key="invoice:{invoice}", lock_ttl=5
    )
    def hold_invoice(
        self: Any, tenant: str = "", tag: str = "", invoice: int = 0, seconds: float = 1
    ) -> dict[str, Any]:
        """A plain task holding the invoice entity ``seconds`` (its 5 s lease renewed meanwhile)."""
        return run(self, None, tenant, tag, seconds)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="wf.invoice_gate", lock_key="invoice:{invoice}", lock_ttl=5
    )
    def invoice_gate(
        self: Any, prev: Any = None, tenant: str = "", tag: str = "", invoice: int = 0, gate: str = ""
    ) -> dict[str, Any]:
        """A member locking an entity of its own, whose body runs until the test creates ``gate`` (a file)."""
        record(self, "start", tenant, tag)
        wait_gate(gate)
        return run(self, prev, tenant, tag, 0)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.invoice", lock_key="invoice:{invoice}", lock_ttl=5)
    def invoice(self: Any, prev: Any = None, tenant: str = "", tag: str = "", invoice: int = 0) -> dict[str, Any]:
        """A member locking an entity of its own: that lease nests inside the workflow's."""
        return run(self, prev, tenant, tag, 0.1)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.same_entity", lock_key=PIPELINE, lock_ttl=5)
    def same_entity(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> dict[str, Any]:
        """A member whose own lock_key is the workflow's entity: it runs under the workflow lease."""
        return run(self, prev, tenant, tag, 0.1)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="wf.plain", lock_key=PIPELINE, lock_ttl=5, on_locked="retry"
    )
    def plain(self: Any, tenant: str = "", tag: str = "") -> dict[str, Any]:
        """A plain locked task on the workflow's entity: it waits behind the workflow."""
        return run(self, None, tenant, tag, 0.05)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="wf.account",
        lock_key="account:{acct}",
        lock_ttl=5,
        on_locked="retry",
    )
    def account(self: Any, tenant: str = "", tag: str = "", acct: str = "") -> dict[str, Any]:
        """A plain locked task on one account: it waits behind a workflow holding that account."""
        return run(self, None, tenant, tag, 0.05)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.fenced")
    def fenced(self: Any, prev: Any = None, tenant: str = "", tag: str = "", db: str = "") -> dict[str, Any]:
        """Write ``tag`` to a sqlite ledger under the workflow lease's fence (``advance_fence``)."""
        import sqlite3

        from celery_lockguard import advance_fence

        record(self, "start", tenant, tag)
        conn = sqlite3.connect(db, timeout=30)
        try:
            with conn:
                advance_fence(conn, self.lock)
                conn.execute("INSERT INTO ledger (tenant, tag, fence) VALUES (?, ?, ?)", (tenant, tag, self.lock.fence))
        finally:
            conn.close()
        return run(self, prev, tenant, tag, 0)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.page")
    def page(
        self: Any, prev: Any = None, tenant: str = "", tag: str = "", fail: bool = False, seconds: float = 0.3
    ) -> dict[str, Any]:
        """One page of a chord's header: runs beside the other pages under the one workflow lease."""
        if fail:
            record(self, "start", tenant, tag)
            raise ValueError(f"page {tag} failed")
        return run(self, prev, tenant, tag, seconds)

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.collect")
    def collect(self: Any, pages: list[Any], tenant: str = "", tag: str = "") -> dict[str, Any]:
        """A chord's callback: all pages' tags, in page order."""
        out = run(self, None, tenant, tag, 0.1)
        return {**out, "pages": sorted(t for p in pages for t in p["tags"])}

    @app.task(base=LockedTask, bind=True, shared=False, name="wf.done")
    def done(self: Any, results: list[Any]) -> list[Any]:
        """The no-op callback the bare-group error tells users to write: it only ends the workflow."""
        return results

    return app


app = create_app(json.loads(os.environ["LG_CONFIG"])) if "LG_CONFIG" in os.environ else None
