"""``lock_limit`` and ``lock_rate``: admission accuracy under a race, round trips, throughput (issue 16).

``python -m bench.limits [--quick]`` runs the section alone on a private server and prints it;
``bench.run`` runs it as one section of the page.

* **Admission race**: 16 publisher threads publish at once to one entity (``lim_race``:
  ``lock_limit=3``, ``lock_rate="5/1s"``, ``on_locked="retry"``), consumed by 2 workers (prefork,
  ``-c 2`` each). Checked as breakage: bodies holding the entity at once never above 3 (from the
  bodies' own start and end records), starts in any sliding 1 s window never above 5 (from the
  server times the starts were admitted), every call ran exactly once. Reported: the worst of
  each, the drain time, and the waits (re-publishes) per call.
* **Throughput and round trips**: distinct entities, no contention, one worker ``-c 2``; the
  single lease against ``lock_limit=4`` and ``lock_limit=4`` plus a rate, alternating rounds.
  Reported: tasks per second (median, spread), lock scripts per task and the server's µs per
  script call (``INFO commandstats``: ``evalsha``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery.result import AsyncResult

from celery_lockguard import testing
from celery_lockguard.testing import RedisServer, wait_for

from . import counting
from .e2e import BenchFailure
from .limitsapp import RACE_LIMIT, RACE_RATE, TP_TASKS, create_app
from .stats import Summary

ROOT = Path(__file__).resolve().parent.parent
PUBLISHERS = 16


@dataclass
class RaceResult:
    calls: int
    most_holders: int
    most_starts_per_window: int
    drain_s: float
    waits_per_call: float


@dataclass
class ThroughputRow:
    name: str
    per_second: Summary = field(default_factory=Summary)
    scripts_per_task: Summary = field(default_factory=Summary)
    usec_per_script: Summary = field(default_factory=Summary)


@dataclass
class LimitsResult:
    race: list[RaceResult] = field(default_factory=list)
    throughput: list[ThroughputRow] = field(default_factory=list)


def _worker(app: Any, cfg: dict[str, Any], concurrency: int) -> testing.Worker:
    name = f"limits{uuid.uuid4().hex[:6]}"
    (ROOT / ".bench" / "logs").mkdir(parents=True, exist_ok=True)
    return testing.Worker(
        "bench.limitsapp:app",
        control=app,
        concurrency=concurrency,
        name=name,
        queues=[cfg["queue"]],
        env={"LG_LIMITS_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        loglevel="WARNING",
        log_path=ROOT / ".bench" / "logs" / f"{name}.log",
    )


def most_at_once(records: list[dict[str, Any]]) -> int:
    """The most bodies running at one moment (an end sorts before a start at the same instant)."""
    events = sorted((r["t"], 0 if r["ev"] == "end" else 1) for r in records)
    running = worst = 0
    for _t, ev in events:
        running += 1 if ev else -1
        worst = max(worst, running)
    return worst


def most_starts_per_window(admitted_ms: list[int], window_ms: int) -> int:
    """The most admissions in any window (t - window, t]: the sliding window the script enforces."""
    at = sorted(admitted_ms)
    worst, lo = 0, 0
    for hi, t in enumerate(at):
        while at[lo] <= t - window_ms:
            lo += 1
        worst = max(worst, hi - lo + 1)
    return worst


def race(url: str, per_publisher: int) -> RaceResult:
    """16 publishers at once, 2 workers: slots and window checked, every call run once."""
    prefix = f"benchlim{uuid.uuid4().hex[:6]}"
    cfg = {"broker": url, "queue": f"{prefix}.q", "prefix": prefix}
    app = create_app(cfg)
    admin = redis.Redis.from_url(url, decode_responses=True)
    workers = [_worker(app, cfg, 2) for _ in range(2)]
    ids: list[str] = []
    guard = threading.Lock()
    barrier = threading.Barrier(PUBLISHERS)
    entity = uuid.uuid4().hex[:8]

    def publish(n: int) -> None:
        barrier.wait()
        for i in range(per_publisher):
            res = app.tasks["lim_race"].delay(entity, n * per_publisher + i)
            with guard:
                ids.append(res.id)

    try:
        for w in workers:
            w.start()
        before = counting.commandstats(admin)
        t0 = time.monotonic()
        threads = [threading.Thread(target=publish, args=(n,)) for n in range(PUBLISHERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = 60.0 + 2.0 * len(ids) * RACE_RATE[1] / 1000 / RACE_RATE[0]
        try:
            wait_for(lambda: all(AsyncResult(i, app=app).ready() for i in ids), deadline, "race calls", interval=0.2)
        except TimeoutError as exc:
            raise BenchFailure(f"lock_limit/lock_rate race: calls pending after {deadline:.0f}s (lost?)") from exc
        drain = time.monotonic() - t0
        pushes = counting.delta(counting.commandstats(admin), before).get("lpush", 0)
        records = [json.loads(x) for x in admin.lrange(f"{prefix}:bodies", 0, -1)]
    finally:
        for w in workers:
            w.stop()
    starts = [r for r in records if r["ev"] == "start"]
    if sorted(r["id"] for r in starts) != sorted(ids):
        raise BenchFailure(f"lock_limit/lock_rate race: {len(starts)} runs for {len(ids)} calls (lost or doubled)")
    failed = [i for i in ids if AsyncResult(i, app=app).state != "SUCCESS"]
    if failed:
        raise BenchFailure(f"lock_limit/lock_rate race: {len(failed)} calls did not succeed")
    holders = most_at_once(records)
    per_window = most_starts_per_window([r["at"] for r in starts], RACE_RATE[1])
    if holders > RACE_LIMIT:
        raise BenchFailure(f"lock_limit={RACE_LIMIT}: {holders} bodies held the entity at once")
    if per_window > RACE_RATE[0]:
        raise BenchFailure(f"lock_rate={RACE_RATE[0]}/{RACE_RATE[1]}ms: {per_window} starts in one window")
    admin.close()
    return RaceResult(len(ids), holders, per_window, drain, max(0, pushes - len(ids)) / len(ids))


def throughput(url: str, rounds: int, n: int) -> list[ThroughputRow]:
    """Alternate the single lease and the slotted variants, ``n`` uncontended tasks each, one ``-c 2`` worker."""
    prefix = f"benchlimtp{uuid.uuid4().hex[:6]}"
    cfg = {"broker": url, "queue": f"{prefix}.q", "prefix": prefix}
    app = create_app(cfg)
    admin = redis.Redis.from_url(url, decode_responses=True)
    rows = {name: ThroughputRow(name) for name in TP_TASKS}
    worker = _worker(app, cfg, 2)
    next_i = [0]
    try:
        worker.start()
        for rnd in range(rounds):
            order = list(TP_TASKS.items())
            for name, task in order if rnd % 2 == 0 else reversed(order):
                admin.set(f"{prefix}:done", 0)
                calls0, usec0 = counting.script_usec(admin)
                t0 = time.monotonic()
                for _ in range(n):
                    app.tasks[task].delay(next_i[0])
                    next_i[0] += 1
                wait_for(lambda: int(admin.get(f"{prefix}:done") or 0) >= n, 120, f"{name} tasks", interval=0.02)
                wall = time.monotonic() - t0
                calls1, usec1 = counting.script_usec(admin)
                rows[name].per_second.add(n / wall)
                rows[name].scripts_per_task.add((calls1 - calls0) / n)
                rows[name].usec_per_script.add((usec1 - usec0) / max(1, calls1 - calls0))
    finally:
        worker.stop()
        admin.close()
    return list(rows.values())


def measure(url: str, quick: bool) -> LimitsResult:
    """Both parts on the server at ``url`` (a private one: its command counts must be the section's)."""
    res = LimitsResult()
    res.race.append(race(url, 1 if quick else 3))
    res.throughput = throughput(url, 2 if quick else 7, 200 if quick else 1000)
    return res


def render(res: LimitsResult, quick: bool) -> str:
    """The section of the page."""
    out = [
        "## lock_limit and lock_rate (issue 16)\n",
        f"**Admission race**: {PUBLISHERS} publisher threads released together, each publishing "
        f"{'one call' if quick else 'three calls'} to one entity of `lim_race` (`lock_limit={RACE_LIMIT}`, "
        f'`lock_rate="{RACE_RATE[0]}/{RACE_RATE[1] // 1000}s"`, `on_locked="retry"`, a '
        "0.2 s body), consumed by 2 workers (prefork, `-c 2` each). Holders at once come from the bodies' "
        "own start/end records; starts per window from the server times the starts were admitted (the "
        "slot hash's `acquired_at`), over every sliding window. Both are checked as breakage.\n",
    ]
    rows = [
        [
            str(r.calls),
            f"{r.most_holders} (limit {RACE_LIMIT})",
            f"{r.most_starts_per_window} (rate {RACE_RATE[0]})",
            f"{r.drain_s:.1f}",
            f"{r.waits_per_call:.1f}",
        ]
        for r in res.race
    ]
    header = ["calls", "most holders at once", "most starts in any 1 s window", "drain s", "waits per call"]
    out.append(_table(header, rows) + "\n")
    out.append(
        "**Throughput and round trips**, uncontended (distinct entities), one worker `-c 2`, alternating "
        "rounds. *Lock scripts per task* counts `EVALSHA` calls at the server (ACQUIRE or ACQUIRE_SLOTS, "
        "RELEASE, and any renewal); *µs per script* is the server's own time per call.\n"
    )
    base = res.throughput[0].per_second.median if res.throughput else float("nan")
    trows = [
        [
            t.name,
            t.per_second.fmt(".0f"),
            f"{t.per_second.median / base:.2f}" if base else "-",
            t.scripts_per_task.fmt(".2f"),
            t.usec_per_script.fmt(".1f"),
        ]
        for t in res.throughput
    ]
    header = ["variant", "tasks/s", "vs single lease", "lock scripts per task", "µs per script"]
    out.append(_table(header, trows) + "\n")
    return "\n".join(out)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.limits", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: checks breakage, not speed")
    args = parser.parse_args(argv)
    try:
        with RedisServer() as srv:
            res = measure(srv.url, args.quick)
    except BenchFailure as exc:
        print(f"[bench] FAILED: {exc}")
        return 1
    print(render(res, args.quick))
    print("medians:", {t.name: round(statistics.median(t.per_second.values), 1) for t in res.throughput})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
