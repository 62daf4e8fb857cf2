"""The per-process renewer: one round trip per tick for all leases, woken only when it must be."""

from __future__ import annotations

from typing import Any

import pytest

from celery_lockguard import lease as L
from celery_lockguard.keys import lock_name
from celery_lockguard.renewer import Renewer
from celery_lockguard.testing import RedisServer

from .harness import wait_for


@pytest.fixture
def server() -> Any:
    with RedisServer() as s:
        yield s


def take(c: Any, key: str, ttl_ms: int) -> L.Lease:
    got = L.acquire(
        c, "lg", key, ttl_ms=ttl_ms, task_id=key, task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    return got


def evalsha_calls(c: Any) -> int:
    return int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_short_lease_tracked_while_the_thread_sleeps_on_a_long_one_is_renewed(server: RedisServer) -> None:
    c = server.client()
    renewer = Renewer()
    long_lease, short_lease = take(c, "long", 30_000), take(c, "short", 300)
    renewer.track(long_lease, c, 3600)
    wait_for(lambda: renewer._wake_at not in (0.0, float("inf")), 2, what="the thread to sleep on the long lease")
    renewer.track(short_lease, c, 3600)
    seen: set[str] = set()

    def renewed_across_three_ttls() -> bool:
        assert c.exists(lock_name("lg", "short")), "the short lease expired: the renewer was not woken"
        seen.add(c.hget(lock_name("lg", "short"), "renewed_at") or "")
        return len(seen) >= 4

    wait_for(renewed_across_three_ttls, 3, interval=0.02, what="the short lease to be renewed repeatedly")
    assert short_lease.held and long_lease.held
    renewer.untrack(short_lease)
    renewer.untrack(long_lease)


def test_one_round_trip_per_tick_whatever_the_number_of_leases(server: RedisServer) -> None:
    c = server.client()
    renewer = Renewer()
    leases = [take(c, f"k{i}", 600) for i in range(200)]
    for lease in leases:
        renewer.track(lease, c, 3600)
    before_calls, before_ticks = evalsha_calls(c), renewer.ticks
    wait_for(lambda: renewer.ticks >= before_ticks + 3, 5, interval=0.02, what="three ticks")
    calls, ticks = evalsha_calls(c) - before_calls, renewer.ticks - before_ticks
    assert calls == ticks or calls == ticks + 1  # a tick may be in flight when we read
    assert all(lease.held for lease in leases)
    for lease in leases:
        renewer.untrack(lease)
