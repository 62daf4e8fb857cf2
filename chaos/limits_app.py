"""The app the ``lock_limit`` / ``lock_rate`` soak's workers run (:mod:`chaos.limits`), configured by ``CHAOS_LIMITS``.

One task, ``chaos.limited``: ``lock_limit`` and ``lock_rate`` from the config, ``acks_late`` (a killed child's
message is redelivered), ``on_locked="retry"``. Its body records, on the record Redis (never the lock Redis the
soak restarts), its start -- with the server time its start was admitted (the slot hash's ``acquired_at``), its
slot and its pid -- and its end. A child killed mid-body records no end: the driver's kill log ends it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from typing import Any

import redis
import structlog
from celery import Celery

from celery_lockguard import LockedTask

structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING), cache_logger_on_first_use=True
)


def create_app(cfg: dict[str, Any]) -> Celery:
    app = Celery("chaos_limits", broker=cfg["broker"], backend=cfg["broker"])
    prefix = cfg["prefix"]
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["lock_url"],
        lockguard_key_prefix=prefix,
        lockguard_socket_timeout=1.0,
        broker_transport_options={
            "global_keyprefix": f"{prefix}:kombu:",
            "visibility_timeout": 3600,
        },
        result_backend_transport_options={"global_keyprefix": f"{prefix}:results:"},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        result_expires=3600,
    )
    rec = redis.Redis.from_url(cfg["broker"], decode_responses=True)
    lock = redis.Redis.from_url(cfg["lock_url"], decode_responses=True, socket_timeout=1.0)
    key = f"{prefix}:bodies"

    @app.task(
        name="chaos.limited",
        base=LockedTask,
        bind=True,
        lock_key="partner:{entity}",
        lock_limit=cfg["limit"],
        lock_rate=cfg["rate"],
        lock_ttl=cfg["ttl"],
        on_locked="retry",
        lock_max_waits=10_000,
        shared=False,
    )
    def limited(self: Any, job: int, entity: int, work_ms: int) -> int:
        lease = self.lock
        try:
            at = int(lock.hget(lease.redis_key, "acquired_at") or 0)
        except redis.RedisError:
            at = 0  # the lock Redis restarted under the body: the admission time is unknown (excused)
        now = time.time()
        start = {"ev": "start", "job": job, "entity": entity, "id": self.request.id, "pid": os.getpid()}
        rec.rpush(key, json.dumps({**start, "t": now, "at": at, "slot": lease.slot, "fence": lease.fence}))
        time.sleep(work_ms / 1000 * random.uniform(0.8, 1.2))  # the simulated work itself
        end = {"ev": "end", "job": job, "id": self.request.id, "t": time.time(), "pid": os.getpid()}
        rec.rpush(key, json.dumps(end))
        return job

    return app


app = create_app(json.loads(os.environ["CHAOS_LIMITS"])) if "CHAOS_LIMITS" in os.environ else None
