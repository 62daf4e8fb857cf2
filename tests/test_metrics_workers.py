"""Metrics flushed by real prefork workers: periodically, at shutdown, and what a SIGKILL loses."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import pytest
import redis

from celery_lockguard import _metrics as metrics

from .conftest import make_cfg
from .harness import wait_for

pytestmark = pytest.mark.integration


def acquired(r: redis.Redis, prefix: str) -> int:
    return int(r.hget(metrics.total_key(prefix), "plain_locked|lock.acquired") or 0)


def run_tasks(app: Any, n: int) -> None:
    results = [app.tasks["plain_locked"].delay(f"m-{uuid.uuid4().hex[:8]}") for _ in range(n)]
    assert all(res.get(timeout=30)["locked"] for res in results)


def kill_child(worker: Any) -> None:
    """SIGKILL the pool's only child and wait until the pool has replaced it."""
    (child,) = worker.children()
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: (kids := worker.children()) and child not in kids, 30, what="the pool to replace its child")


def test_periodic_flush_bounds_what_a_sigkill_loses(fleet: Any, redis_url: str, prefix: str) -> None:
    """Counts reach Redis within about one flush interval while the child lives, so a SIGKILL cannot lose them."""
    interval = 1.0
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=interval)
    worker = fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    run_tasks(app, 3)
    done = time.monotonic()
    wait_for(lambda: acquired(r, prefix) == 3, 20, what="the child's periodic flush (no shutdown involved)")
    # Timing-tolerant: on a loaded 2-core machine a tick can run late, never by many intervals.
    assert time.monotonic() - done < interval + 10
    kill_child(worker)
    assert acquired(r, prefix) == 3, "counts flushed before the SIGKILL must survive it"
    run_tasks(app, 1)
    wait_for(lambda: acquired(r, prefix) == 4, 20, what="the replacement child's own flush")


def test_shutdown_flushes_and_a_sigkill_loses_only_the_unflushed(fleet: Any, redis_url: str, prefix: str) -> None:
    """With a long interval nothing is flushed early: a killed child's counts are lost, a warm stop's are not."""
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=3600)
    worker = fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    run_tasks(app, 2)
    assert acquired(r, prefix) == 0, "nothing is flushed before the interval"
    kill_child(worker)  # its two acquisitions were never flushed: lost, at most one interval's worth
    run_tasks(app, 1)
    worker.stop()  # warm: worker_process_shutdown flushes in the child
    assert worker.proc is not None and worker.proc.returncode == 0
    assert acquired(r, prefix) == 1


def test_a_recycled_child_counts_every_release(fleet: Any, redis_url: str, prefix: str) -> None:
    """A child recycled by max_tasks_per_child reads its last release replies before its metrics flush.

    RELEASE's reply is read after the task returns; the child's exit used to flush the metrics first,
    so the last task of every child counted no hold time and no lock.released.
    """
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=3600, max_tasks_per_child=2)
    fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for _ in range(8):  # one at a time: each child runs two and exits
        run_tasks(app, 1)
    total = metrics.total_key(prefix)
    fields = ("plain_locked|lock.acquired", "plain_locked|hold.count", "plain_locked|lock.released")
    seen: list[str | None] = []

    def settled() -> bool:
        # One HMGET: a flush (one MULTI/EXEC) landing between two reads would pair counts of different flushes.
        seen[:] = r.hmget(total, fields)
        return int(seen[0] or 0) >= 6 and seen[0] == seen[1]

    wait_for(settled, 30, what="three children's flushes, every acquisition with its hold time")
    acquired, _, released = seen
    assert released == acquired


def test_held_now_per_worker_and_wait_histograms_sum_across_the_fleet(
    fleet: Any, redis_url: str, prefix: str, tmp_path: Any
) -> None:
    """Two workers hold a lease each: the exporter's text shows one per worker, then none; their waits sum."""
    from prometheus_client.parser import text_string_to_metric_families

    from celery_lockguard import _stats as stats

    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=0.5)
    workers = [fleet.worker(cfg, concurrency=1), fleet.worker(cfg, concurrency=1)]
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    gate = tmp_path / "gate"
    results = [app.tasks["hold_gate"].delay(f"g-{n}", str(gate)) for n in range(2)]

    def sampled(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        text = stats.prometheus(stats.read(r, prefix, windows=False))
        return {
            tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == name
        }

    def held_by_worker() -> dict[str, float]:
        rows = sampled("lockguard_leases_held").items()
        return {dict(k)["worker"]: v for k, v in rows if dict(k)["task"] == "hold_gate"}

    def both_held() -> dict[str, float] | None:
        held = held_by_worker()
        return held if sum(held.values()) == 2 else None

    # Each worker's only child holds one lease: its periodic flush (no task finishing) reports it.
    held = wait_for(both_held, 60, what="both leases held")
    assert set(held) == {w.nodename for w in workers} and set(held.values()) == {1.0}
    ages = sampled("lockguard_oldest_hold_seconds")
    assert len(ages) == 2 and all(age >= 0 for age in ages.values())
    gate.touch()
    assert all(res.get(timeout=60)["held"] for res in results)
    wait_for(lambda: not held_by_worker(), 30, what="the gauges to clear once the bodies ended")
    total = metrics.total_key(prefix)
    wait_for(lambda: r.hget(total, "hold_gate|wait.count") == "2", 30, what="both children's waits flushed")
    count = sampled("lockguard_wait_seconds_count")[(("task", "hold_gate"),)]
    assert count == sampled("lockguard_wait_seconds_bucket")[(("le", "+Inf"), ("task", "hold_gate"))] == 2


def test_a_hostile_first_delivery_header_does_not_poison_the_workers_flushes(
    fleet: Any, redis_url: str, prefix: str
) -> None:
    """A message whose lockguard_first_delivered is a wait past int64, or Infinity, through a real worker.

    It used to make every later flush fail on HINCRBY (after Redis had applied the transaction's other
    commands, so each retry counted the acquisition again), and Infinity failed the task itself.
    """
    from celery_lockguard import _headers as headers

    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=0.5)
    fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for value in (-(10**19), float("inf")):
        key = f"h-{uuid.uuid4().hex[:8]}"
        res = app.tasks["plain_locked"].apply_async((key,), headers={headers.FIRST_DELIVERED: value})
        assert res.get(timeout=30)["locked"]
    total = metrics.total_key(prefix)
    wait_for(lambda: r.hget(total, "plain_locked|wait.count") == "2", 30, what="both waits flushed")
    # Later flushes go through and count each acquisition once (a replayed batch would count more).
    run_tasks(app, 1)
    wait_for(lambda: r.hget(total, "plain_locked|hold.count") == "3", 30, what="the third task's flush")
    assert acquired(r, prefix) == 3
