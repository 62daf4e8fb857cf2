"""What each part of ACQUIRE and RELEASE costs the server (issue 33, target 3).

``INFO commandstats`` gives the server's microseconds per ``EVALSHA`` (the script's own work, the commands
it calls included). Each *part* is measured by taking it out: a copy of the script's source with that part
replaced by a constant (the copies are measurement only, never run by lockguard), called with the same keys
and values as an uncontended locked task sends — a fresh entity and a fresh completion scope per call, the
waiter keys given — so the difference to the full script, paired per round, is what that part costs.

Rounds alternate the variants' order (``bench.stats``); each round calls each variant ``n`` times and reads
the server's EVALSHA time before and after, on a private server (nothing else runs scripts there).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from celery_lockguard import _completion as completion
from celery_lockguard import _handoff as handoff
from celery_lockguard import _keys as keys
from celery_lockguard import _lease as lease_ops
from celery_lockguard import _scripts as scripts
from celery_lockguard import _wire

from . import counting
from .cycle import FENCE_TTL_MS
from .stats import Summary, paired, run_rounds

PREFIX = "benchwork"
_RESERVE_MS = int(handoff.RESERVATION_TTL * 1000)
_RECORD_TTL_MS = 3_600_000

_TIME = "local t = redis.call('TIME')"
_NO_TIME = "local t = {'1700000000', '0'}"


def _without(source: str, old: str, new: str) -> str:
    """``source`` with ``old`` replaced by ``new`` (exactly once: a script that changed fails loudly here)."""
    if source.count(old) != 1:
        raise RuntimeError(f"server_work: {old[:60]!r} is no longer in the script once; update the ablation")
    return source.replace(old, new)


def acquire_variants() -> dict[str, str]:
    """ACQUIRE and its copies with one part taken out each."""
    src = scripts.ACQUIRE
    return {
        "ACQUIRE": src,
        "without the completion check": _without(src, "if KEYS[4] then\n  local rec", "if false then\n  local rec"),
        "without the slot-lease scan": _without(
            src, "local slot, busy = held_slot(KEYS[1], KEYS[2])", "local slot, busy = nil, 0"
        ),
        "without the fence (check and advance)": _without(
            _without(src, "local bad, last = corrupt_fence(KEYS[2])", "local bad, last = nil, 0"),
            "local fence = next_fence(KEYS[2], ARGV[10], now_us, last)",
            "local fence = '1'",
        ),
        "the fence counter read twice (before issue 33)": _without(
            src, "next_fence(KEYS[2], ARGV[10], now_us, last)", "next_fence(KEYS[2], ARGV[10], now_us)"
        ),
        "without TIME": _without(src, _TIME, _NO_TIME),
        "holder hash of 3 fields instead of 12": _without(
            src,
            "redis.call('HSET', KEYS[1], 'token', ARGV[1], 'task_id', ARGV[3], 'task_name', ARGV[4],\n"
            "           'digest', ARGV[5], 'host', ARGV[6], 'pid', ARGV[7], 'worker', ARGV[8], 'state', ARGV[9],\n"
            "           'acquired_at', now_ms, 'renewed_at', now_ms, 'ttl', ARGV[2], 'fence', fence)",
            "redis.call('HSET', KEYS[1], 'token', ARGV[1], 'state', ARGV[9], 'fence', fence)",
        ),
    }


def release_variants() -> dict[str, str]:
    """RELEASE and its copies with one part taken out each."""
    src = scripts.RELEASE
    return {
        "RELEASE": src,
        "without the record": _without(
            src, "if KEYS[4] then\n  if redis.call('SET'", "if false then\n  if redis.call('SET'"
        ),
        "without the waiter-queue check": _without(
            src, "if released == -1 or not KEYS[3] or reserve_ms <= 0", "if true"
        ),
    }


@dataclass
class PartRow:
    script: str
    variant: str
    usec: Summary  # server µs per EVALSHA
    saved: Summary  # full script minus this variant, paired per round


def measure(url: str, rounds: int, n: int) -> list[PartRow]:
    """Server µs per call of ACQUIRE and RELEASE and of each copy with one part taken out."""
    client = redis.Redis.from_url(url, decode_responses=True)
    ch = _wire.channel(client)
    if ch is None:
        raise RuntimeError("server_work needs a plain redis:// client (lockguard's channel)")
    acq = {name: scripts.Script(f"bench_acquire_{i}", s) for i, (name, s) in enumerate(acquire_variants().items())}
    rel = {name: scripts.Script(f"bench_release_{i}", s) for i, (name, s) in enumerate(release_variants().items())}
    seq = itertools.count()
    record = completion.encode_record("t", None)[0]
    pid = os.getpid()

    def names(i: int) -> tuple[str, str, list[str], list[str]]:
        key, task_id = f"e{i}", f"t{i}"
        done = keys.done_name(PREFIX, keys.task_scope(task_id))
        lock = keys.lock_name(PREFIX, key)
        akeys = [lock, keys.fence_name(PREFIX, key), keys.claim_name(PREFIX, key), done]
        rkeys = [lock, keys.wait_name(PREFIX, key), keys.waiters_name(PREFIX, key), done]
        return task_id, lock, akeys, rkeys

    def acquire_args(token: str, task_id: str) -> list[Any]:
        holder = [token, 30_000, task_id, "bench.task", "0" * 16, lease_ops.HOST, pid, "", "running"]
        return [*holder, FENCE_TTL_MS, "", ""]

    def timed(fn: Callable[[], None]) -> float:
        c0, u0 = counting.script_usec(client)
        fn()
        c1, u1 = counting.script_usec(client)
        return (u1 - u0) / max(1, c1 - c0)

    def acquire_variant(script: scripts.Script) -> Callable[[], float]:
        def run() -> float:
            batch = [next(seq) for _ in range(n)]
            made = [(names(i), lease_ops.new_token()) for i in batch]

            def go() -> None:
                for (task_id, _lock, akeys, _rkeys), token in made:
                    ch.call(script, akeys, acquire_args(token, task_id))

            took = timed(go)
            for (_t, _lock, _akeys, rkeys), token in made:  # freed by the real RELEASE, outside the timing
                ch.call(scripts.release, rkeys, [token, record, _RECORD_TTL_MS, _RESERVE_MS])
            return took

        return run

    def release_variant(script: scripts.Script) -> Callable[[], float]:
        def run() -> float:
            batch = [next(seq) for _ in range(n)]
            made = [(names(i), lease_ops.new_token()) for i in batch]
            for (task_id, _lock, akeys, _rkeys), token in made:  # taken by the real ACQUIRE, outside the timing
                ch.call(scripts.acquire, akeys, acquire_args(token, task_id))

            def go() -> None:
                for (_t, _lock, _akeys, rkeys), token in made:
                    ch.call(script, rkeys, [token, record, _RECORD_TTL_MS, _RESERVE_MS])

            return timed(go)

        return run

    for s in [*acq.values(), *rel.values()]:  # loaded before any timing
        client.script_load(s.source)
    variants: dict[str, Callable[[], float]] = {}
    for name, s in acq.items():
        variants[f"ACQUIRE|{name}"] = acquire_variant(s)
    for name, s in rel.items():
        variants[f"RELEASE|{name}"] = release_variant(s)
    got = run_rounds(list(variants), rounds, lambda v, _r: {"usec": variants[v]()})
    rows: list[PartRow] = []
    for label in variants:
        script, variant = label.split("|", 1)
        full = f"{script}|{script}"
        rows.append(PartRow(script, variant, got[label]["usec"], paired(got, full, label, "usec", lambda a, b: a - b)))
    client.close()
    return rows


def main() -> None:
    from celery_lockguard.testing import RedisServer

    with RedisServer() as srv:
        for r in measure(srv.url, 9, 2000):
            print(f"{r.script:8s} {r.variant:40s} {r.usec.fmt('.2f')} µs  saves {r.saved.fmt('.2f')}")


if __name__ == "__main__":
    main()
