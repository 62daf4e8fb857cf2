"""Scaling (issue 33): W prefork workers of ``-c C`` children on one queue, on many entities and on one hot one.

Per round and variant: every worker's consumer is off (``cancel_consumer``) while the driver publishes N tasks,
then W workers' consumers go on (``add_consumer``) and the clock runs until the run that completes N says so
(each body counts itself with one ``INCR`` on the broker's server, every variant alike). Variants: the plain
task, ``LockedTask`` (default mode, ``lock_key`` on the entity) and redis-py's ``Lock`` taken around the same
body on the same entity (blocking, polling every 2 ms). Entities: ``i % entities`` (1,000: uncontended at this
size; 1: one hot entity, every task waits its turn). The lock Redis is a server of its own (or a three-master
Cluster), so its CPU over the drain (``/proc``) is the locks' alone: per 1,000 tasks, LockedTask's against
redis-py's ``Lock`` doing the same work in the same round (paired).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from celery_lockguard import testing

from .e2e import BLOCKING_SOCKET_TIMEOUT, BenchFailure
from .stats import Summary, paired, run_rounds
from .worker import Worker
from .workerapp import create_app

PLAIN, LOCKED, REDIS_PY = "plain task", "LockedTask", "redis-py Lock"
VARIANTS = {PLAIN: "sc_plain", LOCKED: "sc_locked", REDIS_PY: "sc_redispy"}


@dataclass
class ScaleRow:
    """One (lock server, workers, entities) cell: a variant's rate, ratio to plain, lock-server CPU."""

    lock_server: str
    workers: int
    concurrency: int
    entities: int
    variant: str
    tasks: int
    rate: Summary  # tasks/s over the drain
    ratio: Summary  # rate / plain's rate, paired per round
    lock_cpu_ms: Summary  # lock server CPU ms per 1,000 tasks
    cpu_vs_redis_py: Summary | None  # LockedTask's lock CPU / redis-py Lock's, paired per round


def measure(
    broker_url: str,
    lock_url: str,
    lock_pids: list[int],
    *,
    cells: list[tuple[int, int]],
    concurrency: int,
    rounds: int,
    n: int,
    hot_n: int,
    cluster: bool = False,
    label: str = "Redis",
) -> list[ScaleRow]:
    """``cells``: (workers, entities) pairs, measured on one fleet of ``max(workers)`` workers."""
    prefix = f"benchsc{uuid.uuid4().hex[:6]}"
    cfg: dict[str, Any] = {"broker": broker_url, "queue": f"{prefix}.q", "prefix": prefix, "lock_url": lock_url}
    cfg["cluster"] = cluster
    app = create_app(cfg)
    fleet = [Worker(app, cfg, concurrency=concurrency) for _ in range(max(w for w, _ in cells))]
    admin = redis.Redis.from_url(broker_url, decode_responses=True, socket_timeout=BLOCKING_SOCKET_TIMEOUT)
    queue = cfg["queue"]

    def consumers(on: list[Worker], off: list[Worker]) -> None:
        for group, verb in ((off, app.control.cancel_consumer), (on, app.control.add_consumer)):
            if group:
                names = [w.nodename for w in group]
                replies = verb(queue, destination=names, reply=True, timeout=10.0, limit=len(names))
                if len(replies or []) != len(names):
                    raise BenchFailure(f"scaling: {len(replies or [])} of {len(names)} workers answered {verb}")

    rows: list[ScaleRow] = []
    try:
        testing.start_all(fleet, timeout=90)
        consumers([], fleet)
        for workers, entities in cells:
            total = hot_n if entities == 1 else n

            def one(variant: str, r: int, workers: int = workers, entities: int = entities, total: int = total) -> dict:
                task = app.tasks[VARIANTS[variant]]
                counter = f"{prefix}:done:{uuid.uuid4().hex[:8]}"
                for i in range(total):
                    task.apply_async((i, i % entities, counter, total))
                cpu0 = sum(testing.process_cpu(p) for p in lock_pids)
                t0 = time.perf_counter()
                consumers(fleet[:workers], [])
                got = admin.blpop([f"{counter}:finished"], timeout=max(120, total * 0.2))
                drain = time.perf_counter() - t0
                cpu1 = sum(testing.process_cpu(p) for p in lock_pids)
                consumers([], fleet[:workers])
                if got is None or int(admin.get(counter) or 0) != total:
                    raise BenchFailure(f"scaling {variant}: {admin.get(counter)} of {total} ran ({label}, {workers}w)")
                return {"rate": total / drain, "lock_cpu_ms": (cpu1 - cpu0) / total * 1e6}

            for variant in VARIANTS:  # warm-up: imports, connections, scripts in every child
                one(variant, -1)
            got = run_rounds(list(VARIANTS), rounds, one)
            for variant in VARIANTS:
                rows.append(
                    ScaleRow(
                        lock_server=label,
                        workers=workers,
                        concurrency=concurrency,
                        entities=entities,
                        variant=variant,
                        tasks=total,
                        rate=got[variant]["rate"],
                        ratio=paired(got, variant, PLAIN, "rate", lambda a, b: a / b),
                        lock_cpu_ms=got[variant]["lock_cpu_ms"],
                        cpu_vs_redis_py=(
                            paired(got, variant, REDIS_PY, "lock_cpu_ms", lambda a, b: a / b if b else float("nan"))
                            if variant == LOCKED
                            else None
                        ),
                    )
                )
    finally:
        testing.stop_all(fleet)
        admin.close()
    return rows
