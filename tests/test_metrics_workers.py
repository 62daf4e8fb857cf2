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
    wait_for(lambda: int(r.hget(total, "plain_locked|lock.acquired") or 0) >= 6, 30, what="three children's flushes")
    wait_for(
        lambda: r.hget(total, "plain_locked|hold.count") == r.hget(total, "plain_locked|lock.acquired"),
        30,
        what="every flushed acquisition to have its hold time",
    )
    assert r.hget(total, "plain_locked|lock.released") == r.hget(total, "plain_locked|lock.acquired")
