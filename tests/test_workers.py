"""Integration: real ``celery worker`` subprocesses (prefork, -c 2) against a real broker."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard import lease as L
from celery_lockguard.keys import lock_name

from .harness import wait_for

pytestmark = pytest.mark.integration


def records(r: redis.Redis, prefix: str, key: str | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in r.lrange(f"{prefix}:record", 0, -1)]
    return [x for x in rows if key is None or x["key"] == key]


def intervals(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    starts = {x["task_id"]: x["t"] for x in rows if x["ev"] == "start"}
    return sorted((starts[x["task_id"]], x["t"]) for x in rows if x["ev"] == "end")


def overlapping(spans: list[tuple[float, float]]) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    spans = sorted(spans)
    return [(a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]


def test_duplicates_across_workers_never_overlap_while_other_keys_run_in_parallel(shared_fleet: Any) -> None:
    app, cfg = shared_fleet
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    hot, cold = f"hot-{uuid.uuid4().hex[:6]}", f"cold-{uuid.uuid4().hex[:6]}"
    results = [app.tasks["hold_wait"].delay(hot, 0.3, f"d{i}") for i in range(8)]
    results += [app.tasks["hold_wait"].delay(f"{cold}-{i}", 0.6, f"c{i}") for i in range(3)]
    outs = [res.get(timeout=90) for res in results]
    assert all(o["held"] for o in outs)
    hot_spans = intervals(records(r, cfg["prefix"], f"{hot}"))
    assert len(hot_spans) == 8
    assert overlapping(hot_spans) == []
    fences = [o["fence"] for o in outs[:8]]
    assert len(set(fences)) == 8
    all_spans = intervals([x for x in records(r, cfg["prefix"]) if x["key"].startswith((hot, cold))])
    assert overlapping(all_spans), "different keys should have run in parallel"
