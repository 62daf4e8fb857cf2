"""Metrics flushing against a real Redis: one transaction per flush, windows, failures, fork, settings."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import _metrics as metrics
from celery_lockguard._config import reset
from celery_lockguard.exceptions import ConfigurationError
from celery_lockguard.testing import RedisServer

from .harness import wait_for


class CountingRedis(redis.Redis):
    """A real client that counts the pipelines it hands out (one per flush is the contract)."""

    pipelines = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.pipelines += 1
        return super().pipeline(*args, **kwargs)


def minute_sums(r: redis.Redis, prefix: str) -> tuple[Counter[str], list[int]]:
    """Every minute bucket under ``prefix`` summed (a test may straddle a minute), and their TTLs."""
    sums: Counter[str] = Counter()
    ttls = []
    for key in r.scan_iter(match=f"{prefix}:v1:metrics:*:min:*"):
        sums.update({k: int(v) for k, v in r.hgetall(key).items()})
        ttls.append(int(r.ttl(key)))
    return sums, ttls


@pytest.fixture
def unbound() -> Iterator[None]:
    yield
    metrics.unbind()


def test_flush_writes_totals_and_minute_buckets_in_one_pipeline(redis_url: str, prefix: str) -> None:
    client = CountingRedis.from_url(redis_url, decode_responses=True)
    for _ in range(3):
        metrics.count("t.a", "lock.acquired")
    metrics.count("t.b", "lock.contended")
    metrics.observe_hold("t.a", 42.4)
    metrics.observe_hold("t.a", 2000)
    assert metrics.flush(client, prefix) > 0
    assert client.pipelines == 1
    total = client.hgetall(metrics.total_key(prefix))
    assert total["t.a|lock.acquired"] == "3" and total["t.b|lock.contended"] == "1"
    assert total["t.a|hold.count"] == "2" and total["t.a|hold.sum_ms"] == "2042"
    assert total["t.a|hold.le.50"] == "1" and total["t.a|hold.le.5000"] == "1"
    assert float(total["@first_flush_at"]) <= float(total["@last_flush_at"])
    sums, ttls = minute_sums(client, prefix)
    assert sums["t.a|lock.acquired"] == 3 and sums["t.a|hold.count"] == 2
    assert ttls and all(0 < t <= metrics.WINDOW_KEEP for t in ttls)
    # Nothing pending: no round trip at all.
    assert metrics.flush(client, prefix) == 0
    assert client.pipelines == 1
    # A second flush (another process, or later) adds to the totals.
    metrics.count("t.a", "lock.acquired")
    metrics.flush(client, prefix)
    assert client.hget(metrics.total_key(prefix), "t.a|lock.acquired") == "4"
    assert metrics.snapshot()["t.a"]["lock.acquired"] == 4


def test_a_failed_flush_keeps_its_counts_for_the_next(own_redis: RedisServer, prefix: str) -> None:
    client = own_redis.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    metrics.count("t.a", "lock.acquired", 2)
    own_redis.stop()
    with pytest.raises(redis.exceptions.ConnectionError):
        metrics.flush(client, prefix)
    assert metrics.pending() == 1
    metrics.count("t.a", "lock.acquired")
    own_redis.start()
    metrics.flush(client, prefix)
    assert client.hget(metrics.total_key(prefix), "t.a|lock.acquired") == "3"
    assert metrics.pending() == 0


def test_bound_process_flushes_periodically_from_a_timer_thread(redis_url: str, prefix: str, unbound: None) -> None:
    app = Celery("metricstest", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_metrics_flush_interval = 0.2
    metrics.bind(app)
    metrics.count("t.timer", "lock.acquired")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    wait_for(lambda: r.hget(metrics.total_key(prefix), "t.timer|lock.acquired") == "1", 10, what="a timed flush")
    metrics.count("t.timer", "lock.acquired")
    wait_for(lambda: r.hget(metrics.total_key(prefix), "t.timer|lock.acquired") == "2", 10, what="a second flush")


def test_flush_interval_setting_is_validated_in_both_spellings(redis_url: str) -> None:
    app = Celery("metricstest", broker=redis_url, set_as_current=False)
    assert metrics.flush_interval(app) == metrics.DEFAULT_FLUSH_INTERVAL
    app.conf.CELERY_LOCKGUARD_METRICS_FLUSH_INTERVAL = 2.5
    assert metrics.flush_interval(app) == 2.5
    app.conf.lockguard_metrics_flush_interval = 0
    reset(app)
    with pytest.raises(ConfigurationError, match="lockguard_metrics_flush_interval=0"):
        metrics.flush_interval(app)


def test_a_forked_child_starts_with_nothing_to_flush() -> None:
    """A prefork child must not flush what its parent counted (the parent flushes that itself)."""
    metrics.count("t.parent", "lock.acquired")
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        ok = metrics.pending() == 0 and metrics.snapshot() == {}
        metrics.count("t.child", "lock.acquired")
        ok = ok and metrics.pending() == 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert metrics.pending() == 1 and "t.child" not in metrics.snapshot()


def test_a_count_lands_in_the_minute_it_happened_in_however_late_it_is_folded(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counts and observations are ledger entries folded later (at a read, a flush, or by the appender):
    each carries its own time, so a fold in the next minute still puts it in the minute it happened in."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    minute = 29_000_000  # a unix minute in 2025, far from now: its bucket is this test's alone
    monkeypatch.setattr(metrics.time, "time", lambda: minute * 60 + 59.5)
    metrics.count("t.late", "lock.acquired")
    metrics.observe_hold("t.late", 7.0)
    monkeypatch.setattr(metrics.time, "time", lambda: (minute + 1) * 60 + 0.5)
    metrics.count("t.late", "lock.acquired")
    metrics.flush(client, prefix)
    early = client.hgetall(metrics.minute_key(prefix, minute))
    later = client.hgetall(metrics.minute_key(prefix, minute + 1))
    assert early == {
        "t.late|lock.acquired": "1",
        "t.late|hold.count": "1",
        "t.late|hold.sum_ms": "7",
        "t.late|hold.le.10": "1",
    }
    assert later == {"t.late|lock.acquired": "1"}


def test_the_appender_folds_its_ledger_so_a_process_nobody_flushes_stays_bounded() -> None:
    for _ in range(3 * metrics.FOLD_AT):
        metrics.count("t.bound", "lock.acquired")
        metrics.observe_wait("t.bound", 1.0)
    assert len(metrics._counted) <= metrics.FOLD_AT and len(metrics._observed) <= metrics.FOLD_AT
    snap = metrics.snapshot()["t.bound"]
    assert snap["lock.acquired"] == 3 * metrics.FOLD_AT and snap["wait"]["count"] == 3 * metrics.FOLD_AT


def test_entries_appended_while_other_threads_fold_are_counted_once() -> None:
    """Four threads count while two others fold and flush-read in a loop: nothing lost, nothing twice."""
    import threading

    per_thread, stop = 20_000, threading.Event()

    def counter() -> None:
        for _ in range(per_thread):
            metrics.count("t.race", "lock.acquired")
            metrics.observe_hold("t.race", 3.0)

    def folder() -> None:
        while not stop.is_set():
            metrics.fold()
            metrics.pending()

    folders = [threading.Thread(target=folder) for _ in range(2)]
    counters = [threading.Thread(target=counter) for _ in range(4)]
    for t in folders + counters:
        t.start()
    for t in counters:
        t.join()
    stop.set()
    for t in folders:
        t.join()
    snap = metrics.snapshot()["t.race"]
    assert snap["lock.acquired"] == 4 * per_thread
    assert snap["hold"]["count"] == 4 * per_thread and snap["hold"]["sum_ms"] == 3.0 * 4 * per_thread


def _fold_by_entry(
    counted: list[Any], observed: list[Any]
) -> tuple[Counter[Any], dict[Any, list[float]], Counter[Any]]:
    """The fold as it was before it was batched: one Python step per ledger entry (the reference)."""
    counts: Counter[Any] = Counter()
    hists: dict[Any, list[float]] = {}
    pending: Counter[Any] = Counter()
    for task_name, name, n, at in counted:
        counts[(task_name, name)] += n
        pending[(int(at // 60), task_name, name)] += n
    for task_name, family, ms, at in observed:
        bounds = metrics.HISTOGRAMS[family]
        i = next((j for j, bound in enumerate(bounds) if ms <= bound), len(bounds))
        count_field, sum_field, bucket_fields = metrics._FIELDS[family]
        minute = int(at // 60)
        mine = hists.setdefault((task_name, family), [0.0] * (len(bounds) + 3))
        mine[0] += 1
        mine[1] += ms
        mine[2 + i] += 1
        pending[(minute, task_name, count_field)] += 1
        pending[(minute, task_name, sum_field)] += round(ms)
        pending[(minute, task_name, bucket_fields[i])] += 1
    return counts, hists, pending


@pytest.mark.parametrize("coalesced", [False, True])
def test_the_fold_adds_up_every_entry_in_its_minute_and_bucket(coalesced: bool) -> None:
    """Every count, sum, bucket (found by bisect) and minute comes out as the definition's, at bucket edges,
    across minutes, tasks and families, with and without the renewer's coalesced counts (n > 1)."""
    import random

    rng = random.Random(33 + coalesced)
    edges = sorted({b + d for bounds in metrics.HISTOGRAMS.values() for b in bounds for d in (-0.5, 0.0, 0.25)})
    values = [0.0, 0.4, 1.0, metrics.MAX_OBSERVATION_MS, *edges]
    base = 1_764_900_000.0
    counted = [
        (
            rng.choice(["a", "b", "c"]),
            rng.choice(["lock.acquired", "lock.released", "lock.lost"]),
            rng.choice([1, 1, 1, 3]) if coalesced else 1,
            base + rng.uniform(0, 400),
        )
        for _ in range(3000)
    ]
    observed = [
        (rng.choice(["a", "b"]), rng.choice(list(metrics.HISTOGRAMS)), rng.choice(values), base + rng.uniform(0, 400))
        for _ in range(3000)
    ]
    metrics.clear()
    try:
        metrics._counted.extend(counted)
        metrics._observed.extend(observed)
        metrics.fold()
        counts, hists, pending = _fold_by_entry(counted, observed)
        assert (dict(metrics._counts), metrics._hists, dict(metrics._pending)) == (dict(counts), hists, dict(pending))
        assert not metrics._counted and not metrics._observed
        # A second fold adds the next batch to the same rows.
        metrics._counted.extend(counted[:10])
        metrics._observed.extend(observed[:10])
        metrics.fold()
        counts, hists, pending = _fold_by_entry(counted + counted[:10], observed + observed[:10])
        assert (dict(metrics._counts), metrics._hists, dict(metrics._pending)) == (dict(counts), hists, dict(pending))
    finally:
        metrics.clear()
