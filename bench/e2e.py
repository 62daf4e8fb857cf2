"""End-to-end Celery throughput of one tiny task: plain, LockedTask, celery-once, celery-singleton.

One prefork worker with one child (``-c 1``: tasks run one after another,
so a marker published after N tasks runs after all N, and µs per task read
straight off the clock). Per round and variant:

1. publish a *gate* marker: the child takes it and blocks on a Redis list;
2. publish N tasks with distinct arguments (uncontended), timed: the publish
   cost, where celery-once and celery-singleton take their lock;
3. publish an end marker, open the gate: the child drains the N tasks; the
   two markers' timestamps bracket exactly those N runs: the worker cost.

Round trips are counted at the client in the publisher (this process) and in
the worker child (reported by the markers); server commands are INFO
commandstats deltas on the private server over each phase. Every variant's
run count must grow by exactly N per round: a lost or double run fails.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from . import counting
from .stats import Summary, paired, run_rounds
from .worker import Worker
from .workerapp import TP_TASKS, create_app

BASE = "plain task"


@dataclass
class E2EResult:
    """One variant over rounds: worker rate, publish and run µs per task, counts per task."""

    name: str
    worker_rate: Summary
    publish_us: Summary
    run_us: Summary
    total_us: Summary
    ratio_worker: Summary
    ratio_total: Summary
    added_us: Summary
    publish_rt: float
    child_rt: float
    server_cmds: float
    server_breakdown: dict[str, float] = field(default_factory=dict)


class BenchFailure(AssertionError):
    """A real breakage (lost or double-run task, too many round trips): fails ``--quick`` too."""


def measure(url: str, rounds: int, n: int) -> list[E2EResult]:
    """Alternate the variants ``rounds`` times with ``n`` tasks each, on one worker."""
    prefix = f"benche2e{uuid.uuid4().hex[:6]}"
    cfg = {"broker": url, "queue": f"{prefix}.q", "prefix": prefix}
    app = create_app(cfg)
    admin = redis.Redis.from_url(url, decode_responses=True)
    marks = f"{prefix}:marks"
    expected_runs: dict[str, int] = {}
    counts: dict[str, dict[str, float]] = {v: {"publish_rt": 0, "child_rt": 0, "cmds": 0} for v in TP_TASKS}
    breakdown: dict[str, Any] = {v: {} for v in TP_TASKS}
    next_arg = [0]

    def next_mark(timeout: float) -> dict[str, Any]:
        got = admin.blpop([marks], timeout=timeout)
        if got is None:
            raise BenchFailure(f"no marker within {timeout}s: the worker lost or stalled a task\n{worker.log()}")
        return dict(json.loads(got[1]))

    def one(variant: str, r: int, n: int = n) -> dict[str, float]:
        task = app.tasks[TP_TASKS[variant]]
        mark = app.tasks["tp_mark"]
        gate = f"{prefix}:gate:{r}:{TP_TASKS[variant]}"
        mark.delay("start", gate)
        first = next_arg[0]
        next_arg[0] += n
        before = counting.commandstats(admin)
        with counting.counting() as box:
            t0 = time.perf_counter()
            for i in range(first, first + n):
                task.delay(i)
            publish = time.perf_counter() - t0
        mid = counting.commandstats(admin)
        mark.delay("end")
        admin.rpush(gate, "go")
        start, end = next_mark(60), next_mark(max(60, n * 0.05))
        after = counting.commandstats(admin)
        if start["tag"] != "start" or end["tag"] != "end":
            raise BenchFailure(f"markers out of order: {start} {end}")
        name = TP_TASKS[variant]
        expected_runs[name] = expected_runs.get(name, 0) + n
        runs = end["runs"].get(name, 0)
        if runs != expected_runs[name]:
            raise BenchFailure(f"{variant}: {runs} bodies ran, expected {expected_runs[name]} (lost or double run)")
        drain = end["t"] - start["t"]
        pub = counting.delta(mid, before)
        run = counting.delta(after, mid)
        c = counts[variant]
        c["publish_rt"] += box[0] / n
        c["child_rt"] += (end["sent"] - start["sent"] - 1) / n  # minus the start marker's own push
        c["cmds"] += (sum(pub.values()) + sum(run.values())) / n
        for k, v in (pub + run).items():
            breakdown[variant][k] = breakdown[variant].get(k, 0) + v / n
        return {
            "worker_rate": n / drain,
            "publish_us": publish / n * 1e6,
            "run_us": drain / n * 1e6,
            "total_us": (publish + drain) / n * 1e6,
        }

    worker = Worker(app, cfg, concurrency=1)
    try:
        worker.start()
        for variant in TP_TASKS:  # warm-up: imports, connections, scripts in both processes
            one(variant, -1, 50)
        for c in counts.values():
            c.update(dict.fromkeys(c, 0))
        for b in breakdown.values():
            b.clear()
        results = run_rounds(list(TP_TASKS), rounds, one)
    finally:
        worker.stop()
        admin.close()
    out = []
    for v in TP_TASKS:
        res = results[v]
        out.append(
            E2EResult(
                name=v,
                worker_rate=res["worker_rate"],
                publish_us=res["publish_us"],
                run_us=res["run_us"],
                total_us=res["total_us"],
                ratio_worker=paired(results, v, BASE, "worker_rate", lambda a, b: a / b),
                ratio_total=paired(results, v, BASE, "total_us", lambda a, b: b / a),
                added_us=paired(results, v, BASE, "total_us", lambda a, b: a - b),
                publish_rt=counts[v]["publish_rt"] / rounds,
                child_rt=counts[v]["child_rt"] / rounds,
                server_cmds=counts[v]["cmds"] / rounds,
                server_breakdown={
                    k: round(x / rounds, 2) for k, x in sorted(breakdown[v].items()) if x / rounds >= 0.01
                },
            )
        )
    return out
