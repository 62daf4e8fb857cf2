"""What the review test apps' task bodies share: a gate the test opens, and a gated body that records itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis


def gate_opener(cfg: dict[str, Any]) -> Callable[[str], None]:
    """``until_open(gate)``: hold a body until the test sets the Redis key ``gate`` (at most a minute; ``""``: no gate).

    The key lives on the records' Redis (``cfg["record_url"]``), never the lock Redis a test may stall.
    """
    gates = redis.Redis.from_url(cfg["record_url"], decode_responses=True)

    def until_open(gate: str) -> None:
        deadline = time.monotonic() + 60
        while gate and not gates.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)

    return until_open


def gated_run(
    record: Callable[..., None], until_open: Callable[[str], None]
) -> Callable[[Any, str, str, str], dict[str, Any]]:
    """A body that records its start, waits for ``gate``, records its end and says whether it held a lease."""

    def run(self: Any, key: str, gate: str, tag: str) -> dict[str, Any]:
        record(ev="start", key=key, tag=tag, task_id=self.request.id, retries=self.request.retries)
        until_open(gate)
        lease = self.lock
        record(ev="end", key=key, tag=tag, task_id=self.request.id, locked=lease is not None)
        return {"tag": tag, "locked": lease is not None, "slot": getattr(lease, "slot", None)}

    return run
