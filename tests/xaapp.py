"""Tasks of the ``xa`` crossing review (tests/test_xa_crossings.py), on ``tests.workerapp``.

Queue-time modes crossed with retry(args=...), a killed child, shared idempotency namespaces and several
entities. Bodies record ``start``/``end`` in the record list and wait on a Redis key ``gate`` when given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask

from .gates import gate_opener

#: The leases' TTL: far above the tests' bound on "the entity is free again".
TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.shard", lock_key="xa:{shard}", lock_ttl=TTL,
        lock_mode="until_done", max_retries=3,
    )  # fmt: skip
    def shard(self: Any, shard: str, move_to: str = "", gate: str = "") -> dict[str, Any]:
        """Work on ``xa:{shard}``; with ``move_to``, retries once onto that shard (``retry(kwargs=...)``)."""
        record(ev="start", key=shard, task_id=self.request.id, pid=os.getpid(), retries=self.request.retries)
        until_open(gate)
        if move_to:
            raise self.retry(kwargs={"shard": move_to, "gate": gate}, countdown=2.0)
        record(ev="end", key=shard, task_id=self.request.id)
        return {"shard": shard, "retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.ud", lock_key="xa:{key}", lock_ttl=TTL,
        lock_mode="until_done",
    )  # fmt: skip
    def ud(self: Any, key: str, gate: str = "") -> dict[str, Any]:
        """``until_done`` work on ``xa:{key}`` held until ``gate`` opens."""
        record(ev="start", key=key, task_id=self.request.id, pid=os.getpid())
        until_open(gate)
        record(ev="end", key=key, task_id=self.request.id)
        return {"key": key}

    for name in ("xa.cap1", "xa.cap2"):

        def capture(self: Any, invoice: int, _name: str = name) -> dict[str, Any]:
            record(ev="start", key=str(invoice), task_id=self.request.id, name=_name)
            return {"by": _name}

        app.task(
            base=LockedTask, bind=True, shared=False, name=name, idempotency_key="xa-pay:{invoice}",
            idempotency_namespace="xa_capture", lock_mode="until_done", lock_ttl=TTL,
        )(capture)  # fmt: skip

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.multi_us", lock_key=("xam:{a}", "xam:{b}"),
        lock_ttl=TTL, lock_mode="until_started",
    )  # fmt: skip
    def multi_us(self: Any, a: str, b: str, gate: str = "") -> dict[str, Any]:
        record(ev="start", key=f"{a}+{b}", task_id=self.request.id)
        until_open(gate)
        record(ev="end", key=f"{a}+{b}", task_id=self.request.id)
        return {"a": a, "b": b}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.udq", lock_key="xq:{key}", lock_ttl=TTL,
        lock_mode="until_done", queue_lock_ttl=2,
    )  # fmt: skip
    def udq(self: Any, key: str, tag: str = "", gate: str = "") -> dict[str, Any]:
        """``until_done`` on ``xq:{key}`` with a 2 s queue claim; other work when the tag differs."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        until_open(gate)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.slots", lock_key="xq:{key}", lock_ttl=TTL, lock_limit=2,
        on_locked="retry",
    )  # fmt: skip
    def slots(self: Any, key: str, tag: str = "", gate: str = "") -> dict[str, Any]:
        """Two at a time on ``xq:{key}`` (beside ``xa.udq``'s single lease)."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        until_open(gate)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    from celery.exceptions import Ignore, Reject

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.exit", lock_key="xe:{key}", lock_ttl=TTL,
        lock_mode="until_done", soft_time_limit=1, max_retries=0,
    )  # fmt: skip
    def exit_(self: Any, key: str, how: str) -> Any:
        """``until_done`` on ``xe:{key}`` leaving its body the way ``how`` names."""
        record(ev="start", key=key, how=how, task_id=self.request.id)
        if how == "error":
            raise ValueError("boom")
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("no", requeue=False)
        if how == "soft":
            time.sleep(5)
        if how == "retry_exhausted":
            raise self.retry(countdown=1)
        return how

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xa.multi_ud", lock_key=("xd:{a}", "xd:{b}"), lock_ttl=TTL,
        lock_mode="until_done", max_retries=3,
    )  # fmt: skip
    def multi_ud(self: Any, a: str, b: str, retries: int = 0, sleep: float = 0.0) -> dict[str, Any]:
        """``until_done`` on two entities; retries ``retries`` times with a 4 s countdown; sleeps ``sleep``."""
        record(ev="start", key=f"{a}+{b}", task_id=self.request.id, retries=self.request.retries)
        if self.request.retries < retries:
            raise self.retry(countdown=4.0)
        time.sleep(sleep)
        return {"a": a, "b": b}
