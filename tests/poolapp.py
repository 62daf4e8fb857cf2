"""The Celery app ``tests/test_pools.py`` runs under every worker pool.

Configured from the JSON in ``POOLAPP_CONFIG`` (broker, lock Redis, key prefix,
queue), so each test module gets its own keys. Every body writes a ledger entry
(start and end wall-clock times, pid, whether the lease was lost, how many
renewal ticks the process made meanwhile) to a Redis list under the prefix:
overlap and renewal are judged from that ledger, not from logs.

Two bodies: ``sleeper`` waits cooperatively (``time.sleep``, a greenlet switch
under gevent/eventlet), ``spinner`` burns CPU in pure Python and never yields:
the case that starves a greenlet renewer.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from celery_lockguard import LockedTask
from celery_lockguard._renewer import renewer

#: The TTL every pool test runs under: a body of a few seconds needs several renewals.
TTL = 1


def create_app(cfg: dict[str, Any]) -> Celery:
    app = Celery("poolapp", broker=cfg["broker"], backend=cfg["broker"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["lock_url"],
        lockguard_key_prefix=cfg["prefix"],
        broker_transport_options={"global_keyprefix": f"{cfg['prefix']}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{cfg['prefix']}:results:"},
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        worker_hijack_root_logger=False,
    )
    ledger = redis.Redis.from_url(cfg["lock_url"], decode_responses=True)
    ledger_key = f"{cfg['prefix']}:ledger"

    def run(task: Any, key: str, seconds: float, tag: str, spin: bool, fail: bool = False) -> dict[str, Any]:
        ticks = renewer().ticks
        start = time.time()
        deadline = time.monotonic() + seconds
        soft_limited = False
        try:
            if spin:
                n = 0
                while time.monotonic() < deadline:  # pure Python, no I/O, no greenlet switch
                    n += 1
            else:
                while time.monotonic() < deadline:
                    time.sleep(0.05)
        except SoftTimeLimitExceeded:
            soft_limited = True
        lease = task.lock
        entry = {
            "tag": tag,
            "key": key,
            "task_id": task.request.id,
            "pid": os.getpid(),
            "start": start,
            "end": time.time(),
            "lost": lease.lost if lease else None,
            "ticks": renewer().ticks - ticks,
            "soft_limited": soft_limited,
            "renewer": renewer().thread_kind,
        }
        ledger.rpush(ledger_key, json.dumps(entry))
        if fail:
            raise ValueError(f"body {tag} failed on purpose")
        return entry

    common: dict[str, Any] = {"base": LockedTask, "bind": True, "shared": False, "lock_key": "res:{key}"}

    @app.task(name="pools.sleeper", lock_ttl=TTL, **common)
    def sleeper(self: Any, key: str, seconds: float = 2.5, tag: str = "") -> dict[str, Any]:
        return run(self, key, seconds, tag, spin=False)

    @app.task(name="pools.spinner", lock_ttl=TTL, **common)
    def spinner(self: Any, key: str, seconds: float = 2.5, tag: str = "") -> dict[str, Any]:
        return run(self, key, seconds, tag, spin=True)

    @app.task(name="pools.failer", lock_ttl=TTL, **common)
    def failer(self: Any, key: str, seconds: float = 0.3, tag: str = "") -> dict[str, Any]:
        return run(self, key, seconds, tag, spin=False, fail=True)

    @app.task(name="pools.hard_limited", lock_ttl=30, time_limit=1, **common)
    def hard_limited(self: Any, key: str, seconds: float = 20, tag: str = "") -> dict[str, Any]:
        return run(self, key, seconds, tag, spin=False)

    @app.task(name="pools.soft_limited", lock_ttl=30, soft_time_limit=1, **common)
    def soft_limited(self: Any, key: str, seconds: float = 20, tag: str = "") -> dict[str, Any]:
        return run(self, key, seconds, tag, spin=False)

    return app


app = create_app(json.loads(os.environ["POOLAPP_CONFIG"])) if "POOLAPP_CONFIG" in os.environ else None
