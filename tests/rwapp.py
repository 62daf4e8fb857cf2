"""Tasks of the rw review (fail_open give-back of a timed-out ACQUIRE x other features), on ``tests.workerapp``."""

from __future__ import annotations

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
        base=LockedTask, bind=True, shared=False, name="rw.open_retry", lock_key="rw:{key}", lock_ttl=TTL,
        on_locked="retry", on_unavailable="fail_open", max_retries=3,
    )  # fmt: skip
    def open_retry(self: Any, key: str, gate: str = "", tag: str = "", countdown: float = 2.0) -> dict[str, Any]:
        out = run(self, key, gate, tag)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return out

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.one_open", lock_key="rw:{key}", lock_ttl=TTL,
        on_unavailable="fail_open",
    )  # fmt: skip
    def one_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.one", lock_key="rw:{key}", lock_ttl=TTL,
        on_locked="retry",
    )  # fmt: skip
    def one(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.rate_open", lock_key="rw:{key}", lock_limit=3,
        lock_rate="20/10s", lock_ttl=TTL, on_locked="retry", on_unavailable="fail_open",
    )  # fmt: skip
    def rate_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.deb_open", lock_key="rw:{key}", lock_ttl=TTL,
        lock_debounce=1.0, on_unavailable="fail_open", acks_late=True, reject_on_worker_lost=True,
    )  # fmt: skip
    def deb_open(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.open_retry_nocomp", lock_key="rw:{key}", lock_ttl=TTL,
        on_locked="retry", on_unavailable="fail_open", max_retries=3, completion=False,
    )  # fmt: skip
    def open_retry_nocomp(self: Any, key: str, gate: str = "", tag: str = "", countdown: float = 0.0) -> dict[str, Any]:
        out = run(self, key, gate, tag)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return out

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.open_replace", lock_key="rw:{key}", lock_ttl=TTL,
        on_locked="retry", on_unavailable="fail_open", completion=False,
    )  # fmt: skip
    def open_replace(self: Any, key: str, gate: str = "", tag: str = "", countdown: float = 0.0) -> Any:
        """Fail-open body that replaces itself: the replacement inherits this task id, as a retry does."""
        run(self, key, gate, tag)
        raise self.replace(app.signature("rw.open_replace_by", args=(key, "", tag)))

    @app.task(
        base=LockedTask, bind=True, shared=False, name="rw.open_replace_by", lock_key="rw:{key}", lock_ttl=TTL,
        on_locked="retry", on_unavailable="fail_open", completion=False,
    )  # fmt: skip
    def open_replace_by(self: Any, key: str, gate: str = "", tag: str = "") -> dict[str, Any]:
        return run(self, key, gate, tag)
