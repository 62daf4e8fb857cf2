"""Contention: one hot key, 8 identical calls published together every second.

For each policy (and each peer) one worker (prefork, 8 children) runs the
calls; each body records its start and end. Reported: calls published,
bodies run, duplicates dropped (skipped, raised, rejected at publish),
broker messages spent (LPUSH on the private broker: first publishes and
lockguard's wait re-publishes alike) per useful run. Checked, as real
breakage: lockguard bodies never overlap, and under ``retry`` every call
runs exactly once (none lost, none doubled).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from celery.result import AsyncResult

from celery_lockguard.testing import wait_for

from . import counting
from .e2e import BenchFailure
from .worker import Worker
from .workerapp import HOT_TASKS, create_app


@dataclass
class ContentionResult:
    name: str
    calls: int
    published: int
    bodies: int
    skipped: int
    raised: int
    rejected_at_publish: int
    messages: int
    wall: float
    overlaps: int

    @property
    def messages_per_run(self) -> float:
        return self.messages / self.bodies if self.bodies else float("nan")


def _overlaps(records: list[dict[str, Any]]) -> int:
    """How many bodies ran at once beyond the first, at worst (0: never two at a time)."""
    events = sorted((r["t"], 0 if r["ev"] == "end" else 1) for r in records)  # an end sorts before a start
    running, worst = 0, 0
    for _t, ev in events:
        running += 1 if ev == 1 else -1
        worst = max(worst, running)
    return max(0, worst - 1)


def measure(url: str, seconds: int, per_second: int = 8) -> list[ContentionResult]:
    """Run every contention variant for ``seconds`` seconds of publishing."""
    prefix = f"benchhot{uuid.uuid4().hex[:6]}"
    cfg = {"broker": url, "queue": f"{prefix}.q", "prefix": prefix}
    app = create_app(cfg)
    admin = redis.Redis.from_url(url, decode_responses=True)
    out: list[ContentionResult] = []
    worker = Worker(app, cfg, concurrency=per_second)
    try:
        worker.start()
        for variant, task_name in HOT_TASKS.items():
            out.append(_one(app, admin, prefix, variant, task_name, seconds, per_second, worker))
    finally:
        worker.stop()
        admin.close()
    return out


def _one(
    app: Any,
    admin: redis.Redis,
    prefix: str,
    variant: str,
    task_name: str,
    seconds: int,
    per_second: int,
    worker: Worker,
) -> ContentionResult:
    task = app.tasks[task_name]
    key = uuid.uuid4().hex[:8]
    before = counting.commandstats(admin)
    ids: list[str] = []
    rejected = 0
    t0 = time.monotonic()
    for s in range(seconds):
        for _ in range(per_second):
            res = task.delay(key)
            if res is None or getattr(res, "state", None) == "REJECTED" or res.id is None:
                rejected += 1  # celery-once graceful: dropped at publish, no message
            else:
                ids.append(res.id)
        pause = t0 + s + 1 - time.monotonic()
        if pause > 0 and s < seconds - 1:
            time.sleep(pause)  # pacing: the next batch is due at the next second
    unique = list(dict.fromkeys(ids))
    deadline = max(60.0, seconds * 8.0)

    def all_done() -> bool:
        return all(AsyncResult(i, app=app).ready() for i in unique)

    try:
        wait_for(all_done, deadline, f"{variant}: all calls to finish", interval=0.2)
    except TimeoutError as exc:
        raise BenchFailure(f"{variant}: calls still pending after {deadline}s (lost?)\n{worker.log()}") from exc
    wall = time.monotonic() - t0
    messages = counting.delta(counting.commandstats(admin), before).get("lpush", 0)
    records = [json.loads(x) for x in admin.lrange(f"{prefix}:bodies", 0, -1)]
    mine = [r for r in records if r["task"] == task_name]
    starts = [r for r in mine if r["ev"] == "start"]
    skipped = raised = 0
    for i in unique:
        r = AsyncResult(i, app=app)
        if r.state == "FAILURE":
            raised += 1
        elif r.state == "SUCCESS" and r.result is None:
            skipped += 1
    dedup_publish = len(ids) - len(unique)  # celery-singleton returns the queued task's result instead
    overlaps = _overlaps(mine)
    if task_name.startswith("hot_") and variant.startswith("LockedTask"):
        if overlaps:
            raise BenchFailure(f"{variant}: {overlaps} lockguard bodies overlapped on one key")
        if task_name == "hot_retry":
            started = [r["id"] for r in starts]
            if sorted(started) != sorted(unique):
                raise BenchFailure(
                    f"{variant}: {len(started)} runs for {len(unique)} calls "
                    f"({len(set(started))} distinct): a call was lost or ran twice"
                )
    return ContentionResult(
        name=variant,
        calls=seconds * per_second,
        published=len(unique),
        bodies=len(starts),
        skipped=skipped,
        raised=raised,
        rejected_at_publish=rejected + dedup_publish,
        messages=int(messages),
        wall=wall,
        overlaps=overlaps,
    )
