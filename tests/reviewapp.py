"""Tasks of the fresh-context crossing review (tests/test_review_crossings.py), registered on ``tests.workerapp``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers

from .gates import gate_opener


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.ud_raise_retry", lock_key="rv:{key}",
        lock_mode="until_done", on_locked="raise", lock_ttl=5, max_retries=2,
    )  # fmt: skip
    def ud_raise_retry(self: Any, key: str, delay: float = 1.0) -> dict[str, Any]:
        record(ev="start", key=key, tag="ud", retries=self.request.retries, task_id=self.request.id)
        if self.request.retries < 2:
            raise self.retry(countdown=delay)
        record(ev="end", key=key, tag="ud", task_id=self.request.id)
        return {"retries": self.request.retries}

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.other", lock_key="rv:{key}", lock_ttl=5)
    def other(self: Any, key: str, seconds: float = 3.0, tag: str = "other") -> dict[str, Any]:
        """Different work on ``rv:{key}`` (the single lease): holds it ``seconds``."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        time.sleep(seconds)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.deb_retry", lock_key="rv:{key}", lock_ttl=30,
        lock_debounce=0.5, max_retries=3, acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def deb_retry(self: Any, key: str, tag: str = "", retries: int = 1, gate: str = "") -> dict[str, Any]:
        woken = bool(headers.read(self.request, headers.WOKEN))
        record(ev="start", key=key, tag=tag, retries=self.request.retries, task_id=self.request.id, woken=woken)
        until_open(gate)
        if self.request.retries < retries:
            raise self.retry(countdown=0.5)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag, "retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.idem_a", idempotency_key="ref:{ref}",
        idempotency_namespace=cfg.get("ns_a") or None,
    )  # fmt: skip
    def idem_a(self: Any, ref: str) -> dict[str, Any]:
        record(ev="start", key=ref, tag="a", task_id=self.request.id)
        return {"by": "a"}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.idem_b", idempotency_key="ref:{ref}",
        idempotency_namespace=cfg.get("ns_b") or None,
    )  # fmt: skip
    def idem_b(self: Any, ref: str) -> dict[str, Any]:
        record(ev="start", key=ref, tag="b", task_id=self.request.id)
        return {"by": "b"}

    def effect(tag: str, ref: str) -> dict[str, Any]:
        record(ev="effect", key=ref, tag=tag)
        return {"effect_by": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.cp_a", idempotency_key="ref:{ref}",
        idempotency_namespace=cfg.get("ns_a") or None,
    )  # fmt: skip
    def cp_a(self: Any, ref: str, fail: bool = False) -> dict[str, Any]:
        out = self.checkpoint("step", effect, "a", ref)
        if fail:
            raise ValueError("after the checkpoint")
        return {"by": "a", **out}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.cp_b", idempotency_key="ref:{ref}",
        idempotency_namespace=cfg.get("ns_b") or None,
    )  # fmt: skip
    def cp_b(self: Any, ref: str, fail: bool = False) -> dict[str, Any]:
        out = self.checkpoint("step", effect, "b", ref)
        return {"by": "b", **out}

    def timed(self: Any, key: str, gate: str, tag: str, seconds: float) -> dict[str, Any]:
        def now_ms() -> int:
            sec, usec = gates.time()
            return int(sec) * 1000 + int(usec) // 1000

        lease = self.lock
        slot = lease.slot if lease else None
        woken = bool(headers.read(self.request, headers.WOKEN))
        record(ev="start", key=key, tag=tag, task_id=self.request.id, slot=slot, at=now_ms(), woken=woken)
        until_open(gate)
        time.sleep(seconds)
        record(ev="end", key=key, tag=tag, task_id=self.request.id, slot=slot, at=now_ms())
        return {"tag": tag, "slot": slot}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.exp", lock_key="rvp:{p}", lock_limit=2, lock_ttl=20,
        on_locked="retry", max_retries=0,
    )  # fmt: skip
    def exp(self: Any, p: str, gate: str = "", tag: str = "", seconds: float = 0.3) -> dict[str, Any]:
        return timed(self, p, gate, tag, seconds)

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.del", lock_key="rvp:{p}", lock_ttl=20,
              on_locked="retry")  # fmt: skip
    def delete(self: Any, p: str, gate: str = "", tag: str = "", seconds: float = 0.3) -> dict[str, Any]:
        return timed(self, p, gate, tag, seconds)

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.after")
    def after(self: Any, p: str, tag: str = "after") -> dict[str, Any]:
        record(ev="start", key=p, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.wfgate")
    def wfgate(self: Any, p: str, gate: str = "", tag: str = "", seconds: float = 0.3) -> dict[str, Any]:
        """A workflow member with no lock of its own: holds the workflow's entity until ``gate`` opens."""
        return timed(self, p, gate, tag, seconds)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.rated", lock_key="rvr:{p}", lock_limit=2,
        lock_rate="2/3s", lock_ttl=20, on_locked="retry", max_retries=0,
    )  # fmt: skip
    def rated(self: Any, p: str, gate: str = "", tag: str = "", seconds: float = 0.1) -> dict[str, Any]:
        return timed(self, p, gate, tag, seconds)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.us_raise_retry", lock_key="rvu:{key}",
        lock_mode="until_started", on_locked="raise", lock_ttl=5, max_retries=2,
    )  # fmt: skip
    def us_raise_retry(self: Any, key: str, tag: str = "", retries: int = 1, delay: float = 2.0,
                       seconds: float = 0.1) -> dict[str, Any]:  # fmt: skip
        record(ev="start", key=key, tag=tag, retries=self.request.retries, task_id=self.request.id)
        time.sleep(seconds)
        if self.request.retries < retries:
            raise self.retry(countdown=delay)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag, "retries": self.request.retries}

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.spawn")
    def spawn(self: Any, p: str, tag: str = "spawn") -> dict[str, Any]:
        """A workflow member that publishes new work on the workflow's own entity (not a member)."""
        record(ev="start", key=p, tag=tag, task_id=self.request.id)
        child = app.tasks["rv.del"].delay(p, "", "child", 0.5)
        gates.set(f"{cfg['prefix']}:child:{p}", child.id)
        return {"child": child.id}

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.routed", lock_key="rq:{key}", lock_ttl=30)
    def routed(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        """Records which queue delivered it and which worker ran it (a woken copy must keep its routing)."""
        info = self.request.delivery_info or {}
        record(ev="start", key=key, tag=tag, task_id=self.request.id, hostname=self.request.hostname,
               routing_key=info.get("routing_key"), woken=bool(headers.read(self.request, headers.WOKEN)))  # fmt: skip
        until_open(gate)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag, "hostname": self.request.hostname}
