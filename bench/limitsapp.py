"""The Celery app of the ``lock_limit`` / ``lock_rate`` benchmark (:mod:`bench.limits`), in a real worker.

Configured from the JSON in ``LG_LIMITS_CONFIG`` (broker URL, queue, key prefix). It imports no
peer library, so the section runs wherever celery-lockguard does.

* ``lim_single``, ``lim_slots``, ``lim_rated``: throughput tasks on distinct entities (no
  contention): the single lease, ``lock_limit=4``, and ``lock_limit=4`` with a rate too high to
  throttle. Each body counts itself with one ``INCR`` so the driver knows when all ran.
* ``lim_race``: one entity, ``lock_limit=3``, ``lock_rate="5/1s"``, ``on_locked="retry"``: its
  body records the server time its start was admitted (the slot hash's ``acquired_at``), and its
  start and end (``time.time()``, one machine), so the driver checks slots and window.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import redis
import structlog
from celery import Celery

from celery_lockguard import LockedTask

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO), cache_logger_on_first_use=True)

#: The race task's options: the driver checks against the same numbers.
RACE_LIMIT = 3
RACE_RATE = (5, 1000)
RACE_BODY_SECONDS = 0.2
#: Throughput variants: display name -> task name.
TP_TASKS = {
    "LockedTask (single lease)": "lim_single",
    "LockedTask lock_limit=4": "lim_slots",
    "LockedTask lock_limit=4, lock_rate": "lim_rated",
}


def create_app(cfg: dict[str, Any]) -> Celery:
    """The benchmark app for ``cfg``: the worker and the driver build the same one."""
    url, prefix = cfg["broker"], cfg["prefix"]
    app = Celery("lockguard_limits_bench", broker=url, backend=url)
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=url,
        lockguard_key_prefix=prefix,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:results:"},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_prefetch_multiplier=1,
        result_expires=900,
    )
    rec = redis.Redis.from_url(url, decode_responses=True)
    done, bodies = f"{prefix}:done", f"{prefix}:bodies"

    @app.task(name="lim_single", base=LockedTask, lock_key="item:{i}", ignore_result=True, shared=False)
    def lim_single(i: int) -> None:
        rec.incr(done)

    @app.task(name="lim_slots", base=LockedTask, lock_key="item:{i}", lock_limit=4, ignore_result=True, shared=False)
    def lim_slots(i: int) -> None:
        rec.incr(done)

    @app.task(
        name="lim_rated",
        base=LockedTask,
        lock_key="item:{i}",
        lock_limit=4,
        lock_rate="100000/s",
        ignore_result=True,
        shared=False,
    )
    def lim_rated(i: int) -> None:
        rec.incr(done)

    @app.task(
        name="lim_race",
        base=LockedTask,
        bind=True,
        lock_key="partner:{p}",
        lock_limit=RACE_LIMIT,
        lock_rate=f"{RACE_RATE[0]}/{RACE_RATE[1] // 1000}s",
        lock_ttl=5,
        on_locked="retry",
        shared=False,
    )
    def lim_race(self: Any, p: str, i: int) -> int:
        lease = self.lock
        at = int(rec.hget(lease.redis_key, "acquired_at") or 0)
        rec.rpush(bodies, json.dumps({"ev": "start", "id": self.request.id, "t": time.time(), "at": at}))
        time.sleep(RACE_BODY_SECONDS)  # the simulated work itself, not a synchronisation
        rec.rpush(bodies, json.dumps({"ev": "end", "id": self.request.id, "t": time.time()}))
        return i

    return app


app = create_app(json.loads(os.environ["LG_LIMITS_CONFIG"])) if "LG_LIMITS_CONFIG" in os.environ else None
