"""Renewal cost: 1 to 1,000 leases held by one process, renewed by its one renewer thread.

The leases are acquired on a private server and tracked with
``renewer().track(lease, client, max_hold)``, exactly as ``LockedTask`` does
for each running body (the renewer is per process, whichever thread - a
``threads`` pool slot or the main thread - tracks a lease). Over a window we
count round trips at the client (only the renewer thread talks to Redis
then), renewer ticks, the renewer thread's own CPU time
(``pthread_getcpuclockid``) and the server time of the RENEW script.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from celery_lockguard import _lease as lease_ops
from celery_lockguard._lease import Lease
from celery_lockguard._renewer import Renewer, renewer

from . import counting
from .e2e import BenchFailure

TTL_MS = 3000  # renewed every ~1 s (ttl/3 with jitter): several ticks in a short window


@dataclass
class RenewalResult:
    leases: int
    ticks: int
    round_trips: int
    cpu_us_per_tick: float
    server_us_per_tick: float
    lost: int

    @property
    def round_trips_per_tick(self) -> float:
        return self.round_trips / self.ticks if self.ticks else float("nan")

    @property
    def cpu_us_per_lease(self) -> float:
        """Renewer CPU per lease per tick."""
        return self.cpu_us_per_tick / self.leases


def _thread_cpu(thread: Any) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _next_tick(r: Renewer, timeout: float = 10.0) -> int:
    """Wait for the renewer's next completed tick; return the tick count then."""
    start = r.ticks
    deadline = time.monotonic() + timeout
    while r.ticks == start:
        if time.monotonic() > deadline:
            raise BenchFailure(f"renewer made no tick in {timeout}s")
        time.sleep(0.002)
    return r.ticks


def measure(url: str, sizes: list[int], window: float) -> list[RenewalResult]:
    """For each size, hold that many leases for ``window`` seconds and measure their renewal."""
    client = redis.Redis.from_url(url, decode_responses=True)
    admin = redis.Redis.from_url(url, decode_responses=True)
    prefix = f"benchrenew{uuid.uuid4().hex[:6]}"
    r = renewer()
    admin.ping()  # connect now: a connection's handshake would count as round trips in the first window
    out = []
    try:
        for n in sizes:
            leases: list[Lease] = []
            for j in range(n):
                got = lease_ops.acquire(
                    client,
                    prefix,
                    f"renew:{j}",
                    ttl_ms=TTL_MS,
                    task_id=f"t{j}",
                    task_name="bench.renew",
                    digest="d",
                    worker="bench",
                    fence_ttl_ms=86_400_000,
                )
                if not isinstance(got, Lease):
                    raise BenchFailure(f"renewal bench: could not acquire renew:{j}: {got!r}")
                leases.append(got)
            for lease in leases:
                r.track(lease, client, 3600)
            # Snapshots are taken right after a tick completes: the next is ~1 s away, so
            # no tick is half-counted (its EVALSHA sent, its ``ticks += 1`` not yet done).
            counting.install()
            ticks_start = _next_tick(r)
            sent0, calls0, usec0, cpu0 = counting.sent(), *counting.script_usec(admin), _thread_cpu(r._thread)
            time.sleep(window)  # the renewer works on its own; we only watch
            ticks_end = _next_tick(r)
            sent1, cpu1 = counting.sent(), _thread_cpu(r._thread)
            calls1, usec1 = counting.script_usec(admin)
            counting.uninstall()
            ticks = ticks_end - ticks_start
            lost = sum(1 for lease in leases if lease.lost)
            for lease in leases:
                r.untrack(lease)
                lease_ops.release(client, lease, prefix)
            out.append(
                RenewalResult(
                    leases=n,
                    ticks=ticks,
                    round_trips=sent1 - sent0 - 1,  # minus our own INFO between the snapshots
                    cpu_us_per_tick=(cpu1 - cpu0) / ticks * 1e6 if ticks else float("nan"),
                    server_us_per_tick=(usec1 - usec0) / max(1, calls1 - calls0),
                    lost=lost,
                )
            )
            if lost:
                raise BenchFailure(f"renewal bench: {lost} of {n} leases were lost while renewed")
    finally:
        client.close()
        admin.close()
    return out
