"""Tasks of the xc crossing review (outage policies x other features), registered on ``tests.workerapp``."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask

from .gates import gate_opener, gated_run

TTL = 6


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)
    run = gated_run(record, until_open)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.cp", lock_key="xc:{key}", lock_ttl=TTL,
        acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def cp(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id, retries=self.request.retries)

        def step(name: str) -> str:
            record(ev="step", step=name, key=key, tag=tag, task_id=self.request.id)
            return f"{name}-{uuid.uuid4().hex[:8]}"

        a = self.checkpoint("a", step, "a")
        record(ev="after_a", key=key, tag=tag, a=a, task_id=self.request.id)
        until_open(gate)
        b = self.checkpoint("b", step, "b")
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"a": a, "b": b}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.slot", lock_key="xc:{key}", lock_limit=2, lock_ttl=TTL,
        on_locked="retry",
    )  # fmt: skip
    def slot(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.multi_open", lock_key=("xc:{a}", "xc:{b}"), lock_ttl=TTL,
        on_unavailable="fail_open",
    )  # fmt: skip
    def multi_open(self: Any, a: str, b: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, f"xc:{a}+xc:{b}", gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.ud_open", lock_key="xc:{key}", lock_mode="until_done",
        lock_ttl=TTL, on_unavailable="fail_open",
    )  # fmt: skip
    def ud_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.ud", lock_key="xc:{key}", lock_mode="until_done",
        lock_ttl=TTL,
    )  # fmt: skip
    def ud(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.one", lock_key="xc:{key}", lock_ttl=TTL,
        on_locked="retry",
    )  # fmt: skip
    def one(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.deb", lock_key="xc:{key}", lock_ttl=TTL,
        lock_debounce=1.0, acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def deb(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.one_open", lock_key="xc:{key}", lock_ttl=TTL,
        on_unavailable="fail_open",
    )  # fmt: skip
    def one_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.slot_open", lock_key="xc:{key}", lock_limit=2,
        lock_ttl=TTL, on_locked="retry", on_unavailable="fail_open",
    )  # fmt: skip
    def slot_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xc.multi", lock_key=("xc:{a}", "xc:{b}"), lock_ttl=TTL,
        on_locked="retry",
    )  # fmt: skip
    def multi(self: Any, a: str, b: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, f"xc:{a}+xc:{b}", gate, tag)
