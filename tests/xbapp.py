"""Tasks of the xb crossing review (tests/test_xb_*.py), registered on ``tests.workerapp``.

Leases live 30 s, so a waiter parked behind one gets its safety copy 30-38 s later: a waiter that starts
within a few seconds of a lease's end was woken by that end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask

from .gates import gate_opener

TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)

    def run(self: Any, key: str, gate: str, tag: str) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id, retries=self.request.retries)
        until_open(gate)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        lease = self.lock
        return {"tag": tag, "slot": getattr(lease, "slot", None), "held": getattr(lease, "held", None)}

    @app.task(base=LockedTask, bind=True, shared=False, name="xb.one", lock_key="xb:{key}", lock_ttl=TTL)
    def one(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xb.multi", lock_key=("xb:{a}", "xb:{b}"), lock_ttl=TTL,
    )  # fmt: skip
    def multi(self: Any, a: str, b: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, f"xb:{a}+xb:{b}", gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xb.slot", lock_key="xb:{key}", lock_limit=2, lock_ttl=TTL,
        on_locked="retry",
    )  # fmt: skip
    def slot(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xb.rated", lock_key="xbr:{p}", lock_rate="1/8s",
        lock_ttl=TTL, on_locked="retry", max_retries=0,
    )  # fmt: skip
    def rated(self: Any, prev: Any = None, p: str = "", gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, f"xbr:{p}", gate, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="xb.step")
    def step(self: Any, prev: Any = None, key: str = "", gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="xb.retry", max_retries=2)
    def retry(self: Any, prev: Any = None, key: str = "", countdown: float = 6.0, tag: str = "") -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id, retries=self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=countdown)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(base=LockedTask, bind=True, shared=False, name="xb.own", lock_key="xb:{key}", lock_ttl=TTL)
    def own(self: Any, prev: Any = None, key: str = "", gate: str = "", tag: str = "") -> dict[str, Any]:
        """A workflow member with its own lock on ``xb:{key}`` (another entity than the workflow's)."""
        out = run(self, key, gate, tag)
        wf = self.workflow_lock
        return {**out, "wf_held": wf.held if wf else None}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xb.deb", lock_key="xbw:{tenant}", lock_ttl=TTL,
        lock_debounce=0.5, acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def deb(self: Any, tenant: str = "", tag: str = "") -> dict[str, Any]:
        """Debounced work on a workflow's entity."""
        return run(self, f"xbw:{tenant}", "", tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="xb.fail")
    def fail(self: Any, prev: Any = None, key: str = "", tag: str = "") -> None:
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        raise ValueError(f"page {tag} failed")

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xb.rated_wf", lock_key="xbw:{tenant}", lock_rate="1/10s",
        lock_ttl=TTL, on_locked="retry", max_retries=0,
    )  # fmt: skip
    def rated_wf(self: Any, prev: Any = None, tenant: str = "", tag: str = "") -> dict[str, Any]:
        """At most one start per 10 s on ``xbw:{tenant}``, which a workflow may hold."""
        return run(self, f"xbw:{tenant}", "", tag)
