"""Tasks of the "every lease end wakes" tests (tests/test_wake_workers.py), registered on ``tests.workerapp``.

Their leases live 30 s, so a waiter parked behind one gets a safety countdown of 30-38 s: a waiter that
starts within a few seconds of a lease's end was woken by that end, not by its safety copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask

#: The leases' TTL: far above the tests' bound on a wake-up (the safety copy comes back after it).
TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    def until_open(gate: str) -> None:
        """Hold the body until the test sets the Redis key ``gate`` (at most a minute)."""
        deadline = time.monotonic() + 60
        while not gates.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)

    def run(self: Any, key: str, gate: str, tag: str) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        if gate:
            until_open(gate)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        lease = self.lock
        return {"tag": tag, "slot": lease.slot if lease else None, "fence": lease.fence if lease else None}

    @app.task(base=LockedTask, bind=True, shared=False, name="wake_task", lock_key="wake:{key}", lock_ttl=TTL)
    def wake_task(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        """Other work on ``wake:{key}`` each call (the tag differs): a second call waits, parked."""
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="wake_limited",
        lock_key="wake:{key}",
        lock_limit=2,
        lock_ttl=TTL,
        on_locked="retry",
    )
    def wake_limited(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        """Two at a time on ``wake:{key}``; a third waits for a slot."""
        return run(self, key, gate, tag)
