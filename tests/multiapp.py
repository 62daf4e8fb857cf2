"""Tasks of the multi-entity worker tests (tests/test_multi_workers.py), registered on ``tests.workerapp``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask

#: The leases' TTL: a parked waiter's safety copy comes back 30-38 s later, far past the tests' bounds.
TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="multi_pair", lock_key=("pair:{a}", "pair:{b}"), lock_ttl=TTL
    )
    def multi_pair(self: Any, a: str, b: str, gate: str = "", tag: str = "", busy: float = 0.0) -> dict[str, Any]:
        """Work on the entities ``pair:{a}`` and ``pair:{b}`` together (other work each call: the tag differs)."""
        keys = sorted({f"pair:{a}", f"pair:{b}"})
        record(ev="start", key="+".join(keys), keys=keys, tag=tag, task_id=self.request.id)
        deadline = time.monotonic() + 60
        while gate and not gates.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        if busy:
            time.sleep(busy)
        fences = self.lock.fences
        record(ev="end", key="+".join(keys), keys=keys, tag=tag, task_id=self.request.id)
        return {"tag": tag, "fences": fences}

    @app.task(base=LockedTask, bind=True, shared=False, name="multi_single", lock_key="pair:{a}", lock_ttl=TTL)
    def multi_single(self: Any, a: str, tag: str = "") -> dict[str, Any]:
        """Work on the one entity ``pair:{a}``: a single-key task behind a multi-entity waiter's reservation."""
        record(ev="start", key=f"pair:{a}", keys=[f"pair:{a}"], tag=tag, task_id=self.request.id)
        record(ev="end", key=f"pair:{a}", keys=[f"pair:{a}"], tag=tag, task_id=self.request.id)
        return {"tag": tag}
