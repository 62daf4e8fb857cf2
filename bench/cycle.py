"""Lock cycle, uncontended: acquire + release on one private server, every library alike.

Each variant is a function ``cycle()`` doing one full acquire + release on
key ``bench:cycle`` (nobody else holds it, so every acquire succeeds). The
lockguard cycle is what a locked task pays: ACQUIRE with fence and completion
check, RELEASE with a completion record for a fresh scope per cycle (a reused
scope would find its record and skip).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from celery_lockguard import _completion as completion
from celery_lockguard import _lease as lease_ops
from celery_lockguard._lease import Lease

from . import counting
from .stats import Summary, paired, run_rounds

PREFIX = "benchcycle"
TTL_MS = 30_000
FENCE_TTL_MS = 30 * 86400 * 1000
COMPLETION_TTL_MS = 3_600_000

Cycle = Callable[[], None]


@dataclass
class CycleResult:
    """Per variant: cycle time (µs) and rate over rounds, ratio to raw, counts from a counted pass."""

    name: str
    usec: Summary
    rate: Summary
    ratio: Summary
    round_trips: float
    waited: float
    values_sent: float
    server_commands: float
    server_breakdown: dict[str, float]


def _raw(c: redis.Redis) -> Cycle:
    def cycle() -> None:
        c.set("bench:cycle:raw", "tok", nx=True, px=TTL_MS)
        c.delete("bench:cycle:raw")

    return cycle


def _redis_py(c: redis.Redis) -> Cycle:
    def cycle() -> None:
        lock = c.lock("bench:cycle:redispy", timeout=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError("redis-py Lock: uncontended acquire failed")
        lock.release()

    return cycle


def _python_redis_lock(c: redis.Redis, auto_renewal: bool) -> Cycle:
    import redis_lock  # bench environment only

    def cycle() -> None:
        lock = redis_lock.Lock(c, "bench:cycle:prl", expire=TTL_MS // 1000, auto_renewal=auto_renewal)
        if not lock.acquire(blocking=False):
            raise RuntimeError("python-redis-lock: uncontended acquire failed")
        lock.release()

    return cycle


def _lockguard(c: redis.Redis, with_completion: bool) -> Cycle:
    run = uuid.uuid4().hex[:8]
    ids = itertools.count()

    def cycle() -> None:
        task_id = f"{run}-{next(ids)}"
        scope = f"task:{task_id}" if with_completion else None
        got = lease_ops.acquire(
            c,
            PREFIX,
            "invoice:42",
            ttl_ms=TTL_MS,
            task_id=task_id,
            task_name="bench.cycle",
            digest="0123456789abcdef",
            worker="bench@host",
            fence_ttl_ms=FENCE_TTL_MS,
            scope=scope,
        )
        if not isinstance(got, Lease):
            raise RuntimeError(f"lockguard: uncontended acquire returned {got!r}")
        record = completion.encode_record(task_id, None)[0] if with_completion else ""
        lease_ops.release(c, got, PREFIX, scope, record, COMPLETION_TTL_MS if with_completion else 0)

    return cycle


def variants(c: redis.Redis) -> dict[str, Cycle]:
    """Every cycle under its display name; raw first (the baseline)."""
    return {
        "raw SET NX PX + DEL": _raw(c),
        "redis-py Lock": _redis_py(c),
        "python-redis-lock": _python_redis_lock(c, auto_renewal=False),
        "python-redis-lock (auto_renewal)": _python_redis_lock(c, auto_renewal=True),
        "lockguard lease (no completion)": _lockguard(c, with_completion=False),
        "lockguard lease": _lockguard(c, with_completion=True),
    }


BASE = "raw SET NX PX + DEL"


def _counted(admin: redis.Redis, cycle: Cycle, n: int) -> tuple[float, float, float, float, dict[str, float]]:
    """Per cycle: commands sent, round trips waited (sent minus deferred), values packed, server commands."""
    before = counting.commandstats(admin)
    with counting.counting() as box:
        v0 = counting.values()
        for _ in range(n):
            cycle()
        packed = counting.values() - v0
    server = counting.delta(counting.commandstats(admin), before)
    per = {k: v / n for k, v in sorted(server.items())}
    return box[0] / n, (box[0] - box[1]) / n, packed / n, sum(server.values()) / n, per


def measure(url: str, rounds: int, cycles: int) -> list[CycleResult]:
    """Run every variant ``rounds`` times, alternating, ``cycles`` cycles each; then one counted pass each.

    Short blocks and many rounds beat long blocks: on a shared VM the loopback
    latency wanders on a scale of seconds, and a block of ~0.1 s sees one weather.
    """
    c = redis.Redis.from_url(url, decode_responses=True)
    admin = redis.Redis.from_url(url, decode_responses=True)
    table = variants(c)
    for cycle in table.values():  # warm-up: connection, script load, imports
        for _ in range(200):
            cycle()

    def one(name: str, r: int) -> dict[str, float]:
        cycle = table[name]
        t0 = time.perf_counter()
        for _ in range(cycles):
            cycle()
        elapsed = time.perf_counter() - t0
        return {"usec": elapsed / cycles * 1e6, "rate": cycles / elapsed}

    results = run_rounds(list(table), rounds, one)
    out = []
    for name, cycle in table.items():
        rt, waited, packed, cmds, breakdown = _counted(admin, cycle, 300)
        out.append(
            CycleResult(
                name=name,
                usec=results[name]["usec"],
                rate=results[name]["rate"],
                ratio=paired(results, name, BASE, "rate", lambda a, b: a / b),
                round_trips=rt,
                waited=waited,
                values_sent=packed,
                server_commands=cmds,
                server_breakdown=breakdown,
            )
        )
    c.close()
    admin.close()
    return out


def script_server_usec(url: str, n: int = 2000) -> float:
    """Server µs per EVALSHA of lockguard's cycle (ACQUIRE and RELEASE averaged), from commandstats."""
    c = redis.Redis.from_url(url, decode_responses=True)
    cycle = _lockguard(c, with_completion=True)
    cycle()
    calls0, usec0 = counting.script_usec(c)
    for _ in range(n):
        cycle()
    calls1, usec1 = counting.script_usec(c)
    c.close()
    return (usec1 - usec0) / max(1, calls1 - calls0)


def probe(url: str) -> tuple[int, int]:
    """(commands sent, round trips waited) of one lockguard cycle at the client.

    CI checks the first (must be <= 2): a deferred RELEASE is still a command on
    the wire; the second shows what the caller actually waits for.
    """
    c = redis.Redis.from_url(url, decode_responses=True)
    cycle = _lockguard(c, with_completion=True)
    cycle()
    with counting.counting() as box:
        cycle()
    c.close()
    return box[0], box[0] - box[1]
