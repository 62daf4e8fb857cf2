"""Tasks of the ``rv`` review (tests/test_rv_crossings.py), on ``tests.workerapp``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask

from .gates import gate_opener

TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.udr", lock_key="rv:{key}", lock_ttl=TTL,
        lock_mode="until_done", on_locked="raise",
    )  # fmt: skip
    def udr(self: Any, key: str, gate: str = "") -> dict[str, Any]:
        """``until_done`` with ``on_locked="raise"`` on ``rv:{key}``, held until ``gate`` opens."""
        record(ev="start", key=key, task_id=self.request.id, pid=os.getpid())
        until_open(gate)
        record(ev="end", key=key, task_id=self.request.id)
        return {"key": key}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.mud", lock_key=("rvm:{a}", "rvm:{b}"), lock_ttl=TTL,
        lock_mode="until_done", max_retries=3,
    )  # fmt: skip
    def mud(self: Any, a: str, b: str, move_b: str = "", gate: str = "") -> dict[str, Any]:
        """``until_done`` on two entities; with ``move_b``, retries once onto ``(a, move_b)`` (same anchor)."""
        record(ev="start", key=f"{a}+{b}", task_id=self.request.id, pid=os.getpid(), retries=self.request.retries)
        until_open(gate)
        if move_b:
            raise self.retry(kwargs={"a": a, "b": move_b, "gate": gate}, countdown=3.0)
        record(ev="end", key=f"{a}+{b}", task_id=self.request.id)
        return {"a": a, "b": b}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.udw", lock_key="xq:{key}", lock_ttl=TTL,
        lock_mode="until_done", queue_lock_ttl=2, lock_max_waits=2,
    )  # fmt: skip
    def udw(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        """``until_done`` on ``xq:{key}`` (beside ``xa.udq``) that gives up after two waits."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.mretry", lock_key=("xb:{a}", "xb:{b}"), lock_ttl=TTL,
        max_retries=2,
    )  # fmt: skip
    def mretry(self: Any, a: str, b: str, tag: str = "") -> dict[str, Any]:
        """A workflow member over ``xb:{a}`` (the workflow's) and ``xb:{b}``: a checkpoint, then one retry."""
        n = self.checkpoint("effect", gates.incr, f"{cfg['prefix']}:effects:{b}")
        record(ev="start", key=f"{a}+{b}", tag=tag, task_id=self.request.id, retries=self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=1.5)
        record(ev="end", key=f"{a}+{b}", tag=tag, task_id=self.request.id)
        return {"tag": tag, "n": n}

    # acks_late off and fail_open: a renew-less 30 s lease is no finding for test_cli's doctor tests (which
    # set acks_late and a 1 s visibility_timeout app-wide, or share the broker's Redis)
    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.udnr", lock_key="rvn:{key}", lock_ttl=TTL,
        lock_mode="until_done", lock_renew=False, acks_late=False, on_unavailable="fail_open",
    )  # fmt: skip
    def udnr(self: Any, key: str, gate: str = "") -> dict[str, Any]:
        """``until_done`` without renewal on ``rvn:{key}``, held until ``gate`` opens."""
        record(ev="start", key=key, task_id=self.request.id, pid=os.getpid())
        until_open(gate)
        record(ev="end", key=key, task_id=self.request.id)
        return {"key": key}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.ude", lock_key="rve:{key}", lock_ttl=TTL,
        lock_mode="until_done", max_retries=1,
    )  # fmt: skip
    def ude(self: Any, key: str, how: str = "eta") -> dict[str, Any]:
        """``until_done`` retrying with an ``eta`` 3 s ahead (``how="eta"``) or every time (``"exhaust"``)."""
        from datetime import datetime, timedelta, timezone

        record(ev="start", key=key, task_id=self.request.id, retries=self.request.retries)
        if how == "exhaust" or self.request.retries < 1:
            raise self.retry(eta=datetime.now(timezone.utc) + timedelta(seconds=3))
        return {"key": key, "retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.udak", lock_key="rva:{key}", lock_ttl=TTL,
        lock_mode="until_done", acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def udak(self: Any, key: str, gate: str = "") -> dict[str, Any]:
        """``until_done`` with ``acks_late`` + ``reject_on_worker_lost`` on ``rva:{key}`` (a killed child's message
        is redelivered), held until ``gate`` opens."""
        record(ev="start", key=key, task_id=self.request.id, pid=os.getpid())
        until_open(gate)
        record(ev="end", key=key, task_id=self.request.id)
        return {"key": key}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.wfud", lock_key="xb:{key}", lock_ttl=TTL,
        lock_mode="until_done", max_retries=2,
    )  # fmt: skip
    def wfud(self: Any, prev: Any = None, key: str = "", tag: str = "") -> dict[str, Any]:
        """An ``until_done`` workflow member on ``xb:{key}`` that retries once (countdown 1.5 s)."""
        record(ev="start", key=key, tag=tag, task_id=self.request.id, retries=self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=1.5)
        record(ev="end", key=key, tag=tag, task_id=self.request.id)
        return {"tag": tag, "retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.wfmud", lock_key=("xb:{a}", "xb:{b}"), lock_ttl=TTL,
        lock_mode="until_done", max_retries=2,
    )  # fmt: skip
    def wfmud(self: Any, prev: Any = None, a: str = "", b: str = "", tag: str = "") -> dict[str, Any]:
        """An ``until_done`` member over ``xb:{a}`` (the workflow's) and ``xb:{b}`` that retries once."""
        record(ev="start", key=f"{a}+{b}", tag=tag, task_id=self.request.id, retries=self.request.retries)
        if self.request.retries < 1:
            raise self.retry(countdown=1.5)
        record(ev="end", key=f"{a}+{b}", tag=tag, task_id=self.request.id)
        return {"tag": tag, "retries": self.request.retries}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rv.badretry", lock_key="rvb:{key}", lock_ttl=TTL,
        lock_mode="until_done", max_retries=2,
    )  # fmt: skip
    def badretry(self: Any, key: str) -> dict[str, Any]:
        """``until_done`` whose retry names arguments its signature does not take."""
        record(ev="start", key=key, task_id=self.request.id, retries=self.request.retries)
        raise self.retry(kwargs={"nope": 1}, countdown=0.5)
