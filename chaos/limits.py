"""``python -m chaos.limits [--seconds S]``: a soak for ``lock_limit`` and ``lock_rate`` under faults.

Two prefork workers (``-c 3`` each) run ``chaos.limited`` (``lock_limit=3``, ``lock_rate="10/1s"``,
``acks_late``, ``on_locked="retry"``) on two entities while four publisher threads keep them busy and the
driver injects faults: it SIGKILLs a child in the middle of a body (its message is redelivered, its slot
frees within the TTL) and restarts the lock Redis (no persistence: leases and windows are forgotten).

Checked afterwards, per entity, by the pure functions :func:`holders_violations` and
:func:`rate_violations` (``tests/test_chaos_limits.py`` feeds them synthetic histories):

* **limit**: never more than N bodies running at once -- a body runs from its start record to its
  end record, or to the kill that ended it. A restart of the lock Redis forgets every lease, so
  bodies admitted before a restart and running across it are excused against those admitted after;
* **rate**: never more than N admissions in any sliding window, by the server times the starts
  were admitted; windows spanning a restart are excused (the window was forgotten: up to N more);
* **every job ran** to its end at least once (a killed body's job runs again), and none is lost.

Exit status 1 on a violation. ``make chaos`` does not run it; docs/limits.md says how to.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_lockguard import testing
from celery_lockguard.testing import RedisServer, wait_for

from .limits_app import create_app

ROOT = Path(__file__).resolve().parent.parent
LIMIT, RATE, WINDOW_MS, TTL = 3, 10, 1000, 2.0


@dataclass
class Body:
    """One execution: its entity, start (host time), admission (server ms), and end (host time, or the kill)."""

    entity: int
    start: float
    admitted_ms: int
    end: float
    killed: bool = False


@dataclass
class Verdict:
    jobs: int = 0
    bodies: int = 0
    kills: int = 0
    restarts: int = 0
    holders_worst: int = 0
    starts_worst: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def holders_violations(bodies: list[Body], limit: int, restarts: list[float]) -> tuple[int, list[str]]:
    """The most bodies of one entity running at once, and every moment that was above ``limit``.

    A body that ran across a restart of the lock Redis lost its lease there (the server forgot it): it no
    longer counts against bodies admitted after it. Which server admitted a body is told by its admission
    time (server ms) against the restart's stamp, not by its start: an admission the old server made just
    before its kill starts its body after the kill.
    """
    worst, bad = 0, []
    for entity in sorted({b.entity for b in bodies}):
        mine = [b for b in bodies if b.entity == entity]
        for b in mine:
            running = [
                o
                for o in mine
                if o.start <= b.start < o.end
                and not any(o.admitted_ms / 1000 < r <= b.admitted_ms / 1000 for r in restarts)
            ]
            worst = max(worst, len(running))
            if len(running) > limit:
                bad.append(f"entity {entity}: {len(running)} bodies at once at {b.start:.3f}")
    return worst, bad


def rate_violations(bodies: list[Body], rate: int, window_ms: int, restarts_ms: list[int]) -> tuple[int, list[str]]:
    """The most admissions of one entity in any sliding window, and the windows above ``rate``.

    A window that contains a restart of the lock Redis (server ms) is excused: the window was forgotten.
    """
    worst, bad = 0, []
    for entity in sorted({b.entity for b in bodies}):
        at = sorted(b.admitted_ms for b in bodies if b.entity == entity and b.admitted_ms)
        lo = 0
        for hi, t in enumerate(at):
            while at[lo] <= t - window_ms:
                lo += 1
            n = hi - lo + 1
            if any(at[lo] <= r <= t for r in restarts_ms):
                continue
            worst = max(worst, n)
            if n > rate:
                bad.append(f"entity {entity}: {n} starts in the window ending {t}")
    return worst, bad


def _worker(app: Any, cfg: dict[str, Any]) -> testing.Worker:
    name = f"chaoslim{uuid.uuid4().hex[:6]}"
    (ROOT / ".chaos").mkdir(exist_ok=True)
    return testing.Worker(
        "chaos.limits_app:app",
        control=app,
        concurrency=3,
        name=name,
        queues=[cfg["queue"]],
        env={"CHAOS_LIMITS": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        loglevel="WARNING",
        log_path=ROOT / ".chaos" / f"{name}.log",
    )


def soak(seconds: float, seed: int = 1) -> Verdict:
    rng = random.Random(seed)
    verdict = Verdict()
    with RedisServer() as broker, RedisServer() as locks:
        prefix = f"chaoslim{uuid.uuid4().hex[:6]}"
        cfg = {
            "broker": broker.url,
            "lock_url": locks.url,
            "queue": f"{prefix}.q",
            "prefix": prefix,
            "limit": LIMIT,
            "rate": f"{RATE}/{WINDOW_MS // 1000}s",
            "ttl": TTL,
        }
        app = create_app(cfg)
        rec = broker.client()
        workers = [_worker(app, cfg), _worker(app, cfg)]
        for w in workers:
            w.start()
        ids: list[str] = []  # task ids only: an AsyncResult kept past the servers' stop would reconnect
        guard = threading.Lock()
        stop = threading.Event()
        kills: list[tuple[int, float]] = []  # (pid, host time)
        restarts: list[float] = []
        restarts_ms: list[int] = []

        def publisher(n: int) -> None:
            i = 0
            while not stop.is_set():
                job = n * 100_000 + i
                task_id = app.tasks["chaos.limited"].delay(job, job % 2, rng.choice((50, 150, 400))).id
                with guard:
                    ids.append(task_id)
                i += 1
                stop.wait(0.15)

        threads = [threading.Thread(target=publisher, args=(n,), daemon=True) for n in range(4)]
        for t in threads:
            t.start()
        t_end = time.monotonic() + seconds
        restarted = False
        while time.monotonic() < t_end:
            stop.wait(rng.uniform(1.0, 2.5))
            rows = [json.loads(x) for x in rec.lrange(f"{prefix}:bodies", 0, -1)]
            ended = {(r["id"], r["pid"]) for r in rows if r["ev"] == "end"}
            running = [r for r in rows if r["ev"] == "start" and (r["id"], r["pid"]) not in ended]
            if not restarted and time.monotonic() > t_end - seconds / 2:
                # Stamped between the old server's death and the new one's start, on this host's clock (both
                # servers' TIME reads it): every admission the old server made is before the stamp, every one
                # the new server makes after it. A stamp before the stop missed an ACQUIRE answered in the
                # moment before the kill; one after the start, the new server's first admissions.
                locks.stop()
                now = time.time()
                restarts_ms.append(int(now * 1000))
                restarts.append(now)
                locks.start()
                restarted = True
                verdict.restarts += 1
            elif running:
                victim = rng.choice(running)
                try:
                    os.kill(victim["pid"], signal.SIGKILL)
                    kills.append((victim["pid"], time.time()))
                    verdict.kills += 1
                except ProcessLookupError:
                    pass
        stop.set()
        for t in threads:
            t.join()

        def settled() -> bool:
            return all(app.AsyncResult(i).ready() for i in ids)

        wait_for(settled, 300, "every published job to finish", interval=0.5)
        rows = [json.loads(x) for x in rec.lrange(f"{prefix}:bodies", 0, -1)]
        lost = [i for i in ids if app.AsyncResult(i).state != "SUCCESS"]
        for w in workers:
            w.stop()
    ends = {(r["id"], r["pid"]): r["t"] for r in rows if r["ev"] == "end"}
    bodies = []
    for r in rows:
        if r["ev"] != "start":
            continue
        end = ends.get((r["id"], r["pid"]))
        killed_at = [t for pid, t in kills if pid == r["pid"] and t >= r["t"]]
        if end is None and not killed_at:
            verdict.violations.append(f"body of {r['id']} in pid {r['pid']} neither ended nor was killed")
            continue
        body_end = end if end is not None else min(killed_at)
        bodies.append(Body(r["entity"], r["t"], r["at"], body_end, end is None))
    verdict.jobs, verdict.bodies = len(ids), len(bodies)
    finished = {r["job"] for r in rows if r["ev"] == "end"}
    started_jobs = {r["job"] for r in rows if r["ev"] == "start"}
    if lost or len(finished) != len(started_jobs):
        verdict.violations.append(f"{len(lost)} jobs did not succeed; {len(started_jobs - finished)} never ended")
    verdict.holders_worst, bad = holders_violations(bodies, LIMIT, restarts)
    verdict.violations += bad
    verdict.starts_worst, bad = rate_violations(bodies, RATE, WINDOW_MS, restarts_ms)
    verdict.violations += bad
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.limits", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to publish and inject faults")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    v = soak(args.seconds, args.seed)
    print(
        f"lock_limit={LIMIT} lock_rate={RATE}/{WINDOW_MS}ms: {v.jobs} jobs, {v.bodies} bodies, {v.kills} kills, "
        f"{v.restarts} lock-Redis restarts; most holders at once {v.holders_worst}, most starts per window "
        f"{v.starts_worst}; {'OK' if v.ok else 'VIOLATED'}"
    )
    for line in v.violations[:20]:
        print(f"  {line}")
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
