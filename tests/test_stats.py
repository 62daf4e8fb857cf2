"""The four numbers, windows, readings and Prometheus text computed from flushed metrics (real Redis)."""

from __future__ import annotations

import time
from typing import Any

import redis

from celery_lockguard import _metrics as metrics
from celery_lockguard import _stats as stats


def write_minute(r: redis.Redis, prefix: str, minute: int, task: str, counts: dict[str, int]) -> None:
    """Put counts where a worker's flush would have put them for ``minute`` (and in the totals)."""
    for name, n in counts.items():
        r.hincrby(metrics.minute_key(prefix, minute), f"{task}|{name}", n)
        r.hincrby(metrics.total_key(prefix), f"{task}|{name}", n)
    r.expire(metrics.minute_key(prefix, minute), metrics.WINDOW_KEEP)


def summary(r: redis.Redis, prefix: str, now: float, first: float) -> dict[str, Any]:
    r.hset(metrics.total_key(prefix), mapping={"@first_flush_at": first, "@last_flush_at": now})
    return stats.summarize(stats.read(r, prefix, now=now))


def test_windows_sum_their_minutes_and_divide_by_the_seconds_they_cover(r: redis.Redis, prefix: str) -> None:
    now = (int(time.time() // 60) * 60) + 30.0  # 30 s into a minute
    m = int(now // 60)
    write_minute(r, prefix, m, "t", {"lock.acquired": 3, "hold.count": 3, "hold.sum_ms": 300})
    write_minute(r, prefix, m - 1, "t", {"lock.acquired": 6, "lock.contended": 3})
    write_minute(r, prefix, m - 10, "t", {"lock.acquired": 90, "lock.released": 9, "lock.expired_before_release": 1})
    w = summary(r, prefix, now, first=now - 3600)["tasks"]["t"]["windows"]
    assert w["1m"]["acquisitions"] == 9 and w["1m"]["seconds"] == 90
    assert w["1m"]["acquisition_rate_per_min"] == 9 * 60 / 90
    assert w["1m"]["contention_rate"] == 3 / 12 and w["1m"]["avg_hold_ms"] == 100
    assert w["5m"]["acquisitions"] == 9 and w["15m"]["acquisitions"] == 99
    assert w["15m"]["expired_rate"] == 0.1 and w["5m"]["expired_rate"] is None
    assert w["total"]["acquisitions"] == 99 and w["total"]["acquisition_rate_per_min"] == 99 / 60


def test_high_contention_with_short_holds_reads_as_a_too_broad_key(r: redis.Redis, prefix: str) -> None:
    now = time.time()
    write_minute(
        r,
        prefix,
        int(now // 60),
        "t",
        {"lock.acquired": 10, "lock.contended": 10, "hold.count": 10, "hold.sum_ms": 500},
    )
    readings = summary(r, prefix, now, first=now - 60)["tasks"]["t"]["readings"]
    assert len(readings) == 1 and "too broad" in readings[0] and "50%" in readings[0]


def test_a_rising_expired_rate_and_back_pressure_are_read_out(r: redis.Redis, prefix: str) -> None:
    now = time.time()
    m = int(now // 60)
    write_minute(r, prefix, m - 30, "t", {"lock.acquired": 600, "lock.released": 600})
    write_minute(r, prefix, m, "t", {"lock.acquired": 5, "lock.released": 3, "lock.expired_before_release": 2})
    write_minute(r, prefix, m, "t", {"lock.retry_scheduled": 200, "lock.contended": 5})
    readings = summary(r, prefix, now, first=now - 3600)["tasks"]["t"]["readings"]
    assert any(x.startswith("rising expired-lock rate") for x in readings)
    assert any("back-pressure" in x for x in readings)
    assert not any("contention" in x for x in readings), "no hold time in the window: nothing to say about holds"


def test_prometheus_text_has_counters_and_a_cumulative_histogram(r: redis.Redis, prefix: str) -> None:
    metrics.count('odd"name', "lock.acquired", 2)
    metrics.observe_hold('odd"name', 5)
    metrics.observe_hold('odd"name', 700)
    metrics.flush(r, prefix)
    lines = stats.prometheus(stats.read(r, prefix, windows=False)).splitlines()
    assert 'lockguard_events_total{task="odd\\"name",event="lock.acquired"} 2' in lines
    assert 'lockguard_hold_seconds_bucket{task="odd\\"name",le="0.01"} 1' in lines
    assert 'lockguard_hold_seconds_bucket{task="odd\\"name",le="0.5"} 1' in lines
    assert 'lockguard_hold_seconds_bucket{task="odd\\"name",le="1.0"} 2' in lines
    assert 'lockguard_hold_seconds_bucket{task="odd\\"name",le="+Inf"} 2' in lines
    assert 'lockguard_hold_seconds_sum{task="odd\\"name"} 0.705' in lines
    assert 'lockguard_hold_seconds_count{task="odd\\"name"} 2' in lines
    assert any(x.startswith("lockguard_metrics_last_flush_timestamp_seconds ") for x in lines)


def test_superseded_and_recordless_debounced_messages_are_counted_and_read_out(r: redis.Redis, prefix: str) -> None:
    now = time.time()
    write_minute(
        r,
        prefix,
        int(now // 60),
        "search.reindex",
        {"lock.acquired": 2, "lock.superseded": 49, "lock.debounce_missing": 1},
    )
    task = summary(r, prefix, now, first=now - 60)["tasks"]["search.reindex"]
    assert task["windows"]["total"]["superseded"] == 49
    readings = task["readings"]
    assert any(x.startswith("49 debounced messages superseded") for x in readings)
    assert any(x.startswith("1 debounced message ran without its debounce record") for x in readings)
