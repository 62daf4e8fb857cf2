"""The Celery app of the workflow soak (:mod:`chaos.workflows`), run by ``celery -A chaos.workflow_app:app worker``.

Configured from the JSON in ``CHAOS_WF_CONFIG``: one private Redis for the broker, the results,
the leases and the execution history (the soak kills pool children, it does not touch the server).
Every member records its body's start and end (``time.monotonic()``, comparable across the
processes of one host), its workflow, tenant, step and the fence it held, in a Redis list the
checker reads. Members are ``acks_late`` + ``reject_on_worker_lost``: a killed child's message
comes back, and its redelivery takes the workflow over.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask

#: The workflows' entity: one per tenant.
PIPELINE = "tenant:{tenant}:pipeline"


def history_key(prefix: str) -> str:
    return f"{prefix}:history"


def create_app(cfg: dict[str, Any]) -> Celery:
    app = Celery("chaos_workflows", broker=cfg["redis"], backend=cfg["redis"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["redis"],
        lockguard_key_prefix=cfg["prefix"],
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
    )
    rec = redis.Redis.from_url(cfg["redis"], decode_responses=True)
    key = history_key(cfg["prefix"])

    def work(self: Any, tenant: str, wf: str, step: str, prev: Any) -> dict[str, Any]:
        lease = self.workflow_lock
        start = time.monotonic()
        deadline = start + random.uniform(cfg["min_ms"], cfg["max_ms"]) / 1000
        while time.monotonic() < deadline:
            time.sleep(0.01)
        row = {
            "tenant": tenant,
            "wf": wf,
            "step": step,
            "task_id": self.request.id,
            "start": start,
            "end": time.monotonic(),
            "fence": lease.fence if lease else None,
            "held": lease.held if lease else None,
            "pid": os.getpid(),
        }
        rec.rpush(key, json.dumps(row))
        steps = list(prev["steps"]) if isinstance(prev, dict) else []
        return {"steps": [*steps, step]}

    @app.task(base=LockedTask, bind=True, shared=False, name="cwf.step")
    def step(self: Any, prev: Any = None, tenant: str = "", wf: str = "", step: str = "") -> dict[str, Any]:
        return work(self, tenant, wf, step, prev)

    @app.task(base=LockedTask, bind=True, shared=False, name="cwf.collect")
    def collect(self: Any, pages: Any = None, tenant: str = "", wf: str = "", step: str = "") -> dict[str, Any]:
        return work(self, tenant, wf, step, None)

    return app


app = create_app(json.loads(os.environ["CHAOS_WF_CONFIG"])) if "CHAOS_WF_CONFIG" in os.environ else None
