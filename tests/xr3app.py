"""Tasks of the third fresh-context crossing review (tests/test_xreview3_crossings.py), on ``tests.workerapp``.

Leases live 30 s, so a waiter parked behind one gets its safety copy 30-38 s later: a waiter that starts
within a few seconds of a lease's end was woken by that end.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask

from .gates import gate_opener

#: The leases' TTL: far above the tests' bound on a wake-up.
TTL = 30


def register(app: Celery, cfg: dict[str, Any], record: Callable[..., None]) -> None:
    until_open = gate_opener(cfg)
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    def body(self: Any, key: str, gate: str, tag: str, retries: int, countdown: float) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, retries=self.request.retries, task_id=self.request.id)
        if self.request.retries < retries:
            until_open(gate)
            raise self.retry(countdown=countdown)
        until_open(gate)
        record(ev="end", key=key, tag=tag, retries=self.request.retries, task_id=self.request.id)
        lease = self.lock
        return {"tag": tag, "retries": self.request.retries, "slot": getattr(lease, "slot", None)}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.multi", lock_key=("xm:{a}", "xm:{b}"), lock_ttl=TTL,
        max_retries=3,
    )  # fmt: skip
    def multi(self: Any, a: str, b: str, gate: str = "", tag: str = "", retries: int = 0,
              countdown: float = 3.0) -> dict[str, Any]:  # fmt: skip
        """Work on ``xm:{a}`` and ``xm:{b}`` together; retries ``retries`` times after the gate opens."""
        return body(self, f"xm:{a}+xm:{b}", gate, tag, retries, countdown)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.multi_ud", lock_key=("xm:{a}", "xm:{b}"), lock_ttl=TTL,
        lock_mode="until_done", max_retries=3,
    )  # fmt: skip
    def multi_ud(self: Any, a: str, b: str, gate: str = "", tag: str = "", retries: int = 0,
                 countdown: float = 3.0) -> dict[str, Any]:  # fmt: skip
        """``xr.multi`` in ``until_done``: a retry hands the claim over (on its anchor) to the retry message."""
        return body(self, f"xm:{a}+xm:{b}", gate, tag, retries, countdown)

    @app.task(base=LockedTask, bind=True, shared=False, name="xr.single", lock_key="xm:{a}", lock_ttl=TTL)
    def single(self: Any, a: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        """Other work on the one entity ``xm:{a}`` (the tag differs each call): waits, parked."""
        return body(self, f"xm:{a}", gate, tag, 0, 0)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.slot", lock_key="xs:{p}", lock_limit=2, lock_ttl=TTL,
        on_locked="retry", max_retries=3,
    )  # fmt: skip
    def slot(self: Any, p: str, gate: str = "", tag: str = "", retries: int = 0,
             countdown: float = 3.0) -> dict[str, Any]:  # fmt: skip
        """Two at a time on ``xs:{p}``; retries ``retries`` times after the gate opens."""
        return body(self, f"xs:{p}", gate, tag, retries, countdown)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.ud", lock_key="xu:{key}", lock_ttl=TTL,
        lock_mode="until_done", queue_lock_ttl=2, max_retries=3,
    )  # fmt: skip
    def ud(self: Any, key: str, gate: str = "", tag: str = "", retries: int = 0,
           countdown: float = 3.0) -> dict[str, Any]:  # fmt: skip
        """``until_done`` with a 2 s queue claim: a retry's countdown may be longer than the claim's own TTL."""
        return body(self, f"xu:{key}", gate, tag, retries, countdown)

    @app.task(base=LockedTask, bind=True, shared=False, name="xr.ud_other", lock_key="xu:{key}", lock_ttl=TTL)
    def ud_other(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        """Other work on ``xu:{key}``: waits behind the until_done claim."""
        return body(self, f"xu:{key}", gate, tag, 0, 0)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.ud_kill", lock_key="xk:{key}", lock_ttl=TTL,
        lock_mode="until_done", acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def ud_kill(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        """``until_done`` whose first delivery SIGKILLs its own child mid-body (acks_late: redelivered)."""
        record(ev="start", key=f"xk:{key}", tag=tag, task_id=self.request.id)
        if gates.set(f"{cfg['prefix']}:killed:{key}", 1, nx=True):
            os.kill(os.getpid(), signal.SIGKILL)
        record(ev="end", key=f"xk:{key}", tag=tag, task_id=self.request.id)
        return {"tag": tag}

    def kill_once(name: str) -> None:
        """SIGKILL this child the first time ``name`` is seen (the redelivered copy then runs on)."""
        if gates.set(f"{cfg['prefix']}:killed:{name}", 1, nx=True):
            os.kill(os.getpid(), signal.SIGKILL)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.multi_kill", lock_key=("xm:{a}", "xm:{b}"), lock_ttl=TTL,
        acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def multi_kill(self: Any, a: str, b: str, tag: str = "") -> dict[str, Any]:
        """Multi-entity work whose first delivery SIGKILLs its child mid-body (acks_late: redelivered)."""
        record(ev="start", key=f"xm:{a}+xm:{b}", tag=tag, task_id=self.request.id)
        kill_once(f"{a}+{b}")
        record(ev="end", key=f"xm:{a}+xm:{b}", tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.slot_kill", lock_key="xs:{p}", lock_limit=2, lock_ttl=TTL,
        on_locked="retry", acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def slot_kill(self: Any, p: str, tag: str = "") -> dict[str, Any]:
        """A slot holder whose first delivery SIGKILLs its child mid-body (acks_late: redelivered)."""
        record(ev="start", key=f"xs:{p}", tag=tag, task_id=self.request.id)
        kill_once(f"slot:{p}:{tag}")
        record(ev="end", key=f"xs:{p}", tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.deb", lock_key="xd:{key}", lock_ttl=TTL,
        lock_debounce=0.5, acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def deb(self: Any, key: str, tag: str = "", gate: str = "", kill: bool = False) -> dict[str, Any]:
        """Debounced work on ``xd:{key}``: held until ``gate`` opens; ``kill``: then SIGKILL the first delivery."""
        record(ev="start", key=f"xd:{key}", tag=tag, task_id=self.request.id)
        until_open(gate)
        if kill:
            kill_once(f"deb:{key}:{tag}")
        record(ev="end", key=f"xd:{key}", tag=tag, task_id=self.request.id)
        return {"tag": tag}

    @app.task(
        base=LockedTask, bind=True, shared=False, name="xr.multi_w1", lock_key=("xm:{a}", "xm:{b}"), lock_ttl=TTL,
        on_locked="retry", lock_max_waits=1,
    )  # fmt: skip
    def multi_w1(self: Any, a: str, b: str, tag: str = "") -> dict[str, Any]:
        """Work on ``xm:{a}`` and ``xm:{b}`` that waits once at most, then gives up with LockContended."""
        return body(self, f"xm:{a}+xm:{b}", "", tag, 0, 0)

    @app.task(base=LockedTask, bind=True, shared=False, name="xr.wf_plain", lock_key="xw:{p}", lock_ttl=TTL)
    def wf_plain(self: Any, p: str, tag: str = "") -> dict[str, Any]:
        """Other work on the workflow entity ``xw:{p}``: waits behind the workflow."""
        return body(self, f"xw:{p}", "", tag, 0, 0)

    class KillAfterCall(LockedTask):  # type: ignore[misc]
        """``__call__`` returns (the lease released, the completion recorded), then the child is SIGKILLed
        once, before Celery stores the result or acks the message: acks_late redelivers it."""

        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            kill_once(f"after:{self.request.id}")
            return out

    def once(self: Any, key: str, tag: str) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id)
        n = gates.incr(f"{cfg['prefix']}:effects:{self.request.id}")
        return {"tag": tag, "effects": n}

    after = {"acks_late": True, "reject_on_worker_lost": True, "lock_ttl": TTL}

    @app.task(base=KillAfterCall, bind=True, shared=False, name="xr.after_ud", lock_key="xa:{key}",
              lock_mode="until_done", **after)  # fmt: skip
    def after_ud(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        return once(self, f"xa:{key}", tag)

    @app.task(base=KillAfterCall, bind=True, shared=False, name="xr.after_multi", lock_key=("xa:{key}", "xa:{key}:2"),
              **after)  # fmt: skip
    def after_multi(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        return once(self, f"xa:{key}", tag)

    @app.task(base=KillAfterCall, bind=True, shared=False, name="xr.after_slot", lock_key="xa:{key}", lock_limit=2,
              on_locked="retry", **after)  # fmt: skip
    def after_slot(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        return once(self, f"xa:{key}", tag)

    @app.task(base=KillAfterCall, bind=True, shared=False, name="xr.after_deb", lock_key="xa:{key}", lock_debounce=0.3,
              **after)  # fmt: skip
    def after_deb(self: Any, key: str, tag: str = "") -> dict[str, Any]:
        return once(self, f"xa:{key}", tag)

    @app.task(base=LockedTask, bind=True, shared=False, name="xr.us", lock_key="xq:{key}", lock_ttl=TTL,
              lock_mode="until_started")  # fmt: skip
    def us(self: Any, key: str, gate: str = "") -> dict[str, Any]:
        """``until_started`` work on ``xq:{key}`` (identical each call): held until ``gate`` opens."""
        return body(self, f"xq:{key}", gate, "us", 0, 0)
