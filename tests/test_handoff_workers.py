"""Park and wake with real prefork workers: a 2 s holder and three charges of other work on one customer.

Measures the hand-off latency (end of one body to the start of the next) and the re-publishes per waiting
task (each park publishes one safety copy, each wake one woken copy: ``waits`` + ``woken``).
"""

from __future__ import annotations

import itertools
import statistics
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_workers import intervals, overlapping, records

pytestmark = pytest.mark.integration


def run_contention(fleet: Fleet, cfg: dict[str, Any], r: redis.Redis) -> tuple[list[float], list[dict[str, Any]]]:
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    invoice = int(uuid.uuid4().int % 10**9)
    holder = app.tasks["hold_invoice"].delay(invoice, 2.0)
    name = f"{cfg['prefix']}:v1:{{invoice:{invoice}}}:lock"
    wait_for(lambda: r.exists(name), 30, what="the holder's lease")
    charges = [app.tasks["charge"].delay(invoice, amount, 0.3) for amount in (100, 200, 300)]
    outs = [res.get(timeout=60) for res in charges]
    holder.get(timeout=60, propagate=False)
    rows = records(r, cfg["prefix"], f"invoice:{invoice}")
    return gaps(rows), outs


def gaps(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds from each body's end to the next body's start, in order."""
    spans = intervals(rows)
    return [b[0] - a[1] for a, b in itertools.pairwise(spans)]


def test_a_release_wakes_the_next_waiter_at_once_and_each_waiter_costs_at_most_two_publishes(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    handoffs, outs = run_contention(fleet, cfg, r)
    rows = records(r, prefix)
    spans = intervals(rows)
    assert len(spans) == 4 and overlapping(spans) == [], spans
    starts = [x["task_id"] for x in rows if x["ev"] == "start"]
    assert len(starts) == len(set(starts)) == 4, "every task ran exactly once"
    publishes = [o["waits"] + int(o["woken"]) for o in outs]
    assert all(p <= 2 for p in publishes), publishes
    assert len(handoffs) == 3
    median = statistics.median(handoffs)
    print(
        f"hand-off latency median {median * 1000:.1f} ms, all {[round(g * 1000, 1) for g in handoffs]} ms; "
        f"re-publishes per waiter {publishes}"
    )
    assert median < 0.5, handoffs


def test_a_releaser_killed_between_release_and_wake_loses_and_doubles_nothing(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKGUARD_TEST_EXIT_AFTER_RELEASE", "hold_invoice")  # the worker inherits it
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    invoice = int(uuid.uuid4().int % 10**9)
    holder = app.tasks["hold_invoice"].delay(invoice, 1.0)
    wait_for(lambda: r.exists(f"{prefix}:v1:{{invoice:{invoice}}}:lock"), 30, what="the holder's lease")
    charge = app.tasks["charge"].delay(invoice, 100, 0.1)
    out = charge.get(timeout=60)  # the safety copy takes over: a TTL plus the grace after the release
    holder.get(timeout=30, propagate=False)
    assert holder.state == "FAILURE", "the releaser's child was killed right after RELEASE"
    starts = [x for x in records(r, prefix, f"invoice:{invoice}") if x["ev"] == "start"]
    assert [x["task_id"] for x in starts].count(charge.id) == 1, "the waiter ran exactly once"
    assert out["woken"] is False and out["waits"] == 1, out
