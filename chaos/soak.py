"""``python -m chaos.soak``: the chaos soak. Exits 1 on any violated invariant.

1. Two private Redis servers: the broker (never touched) and the lock store
   (restarted without persistence, so every lease and fence key vanishes).
   PostgreSQL holds the ledger, the fences, the completion records, the
   provider's books and the execution history, in tables of this run only.
2. ``--workers`` real ``celery worker -P prefork -c --concurrency`` processes
   of :mod:`chaos.app` (``acks_late``, ``reject_on_worker_lost``, a short
   ``visibility_timeout``).
3. ``--jobs`` jobs over ``--entities`` entities, ``--duplicates`` of them
   published again under another task id (some right behind the original,
   some much later), spread over ``--duration`` seconds (0: at once). A few
   jobs (``--slow``) outlive the visibility timeout, so their message is
   redelivered while they run.
4. Faults while the jobs run, placed by progress so they land on work in
   flight whatever the machine's speed: pool children SIGKILLed at random
   (every ``--kill-every`` seconds on average), ``--pauses`` SIGSTOPs of a
   whole worker that holds a lease, for ``--pause-seconds`` (> TTL), and
   ``--restarts`` restarts of the lock Redis.
5. Drain until every job has committed and the broker holds nothing, wait
   out the TTL, then check (:mod:`chaos.check`) and print a one-screen report.

Every process started here is stopped and every table dropped on the way
out, also on Ctrl-C or SIGTERM; ``--keep`` keeps the tables and worker logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from celery_lockguard import create_fence_table
from celery_lockguard.completion import PostgresStore
from celery_lockguard.testing import RedisServer

from . import check
from .app import TASK_NAME, UNSAFE_MODES, Tables, create_app
from .fleet import Worker, stop_all, wait_ready
from .report import build_report, render

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
#: Progress (share of jobs committed) between which the scheduled faults are placed.
FAULT_WINDOW = (0.1, 0.9)


@dataclass
class Options:
    """Everything a run is made of; ``--quick`` only changes the defaults."""

    jobs: int = 10_000
    entities: int = 500
    duplicates: float = 0.3
    duration: float = 0.0
    workers: int = 3
    concurrency: int = 2
    seed: int | None = None
    ttl: float = 3.0
    visibility_timeout: float = 8.0
    slow: float = 0.003
    kill_every: float = 4.0
    pauses: int = 1
    pause_seconds: float | None = None
    restarts: int = 2
    drain_timeout: float = 300.0
    pg: str = ""
    unsafe: str = ""
    keep: bool = False
    report_json: str | None = None
    quick: bool = False

    @property
    def pause_for(self) -> float:
        """Long enough that the lease expires and the worker's messages are redelivered to others."""
        return self.pause_seconds if self.pause_seconds is not None else self.visibility_timeout + self.ttl


QUICK: dict[str, Any] = {
    "jobs": 600,
    "entities": 60,
    "workers": 3,
    "ttl": 2.0,
    "visibility_timeout": 4.0,
    "slow": 0.01,
    "kill_every": 1.5,
    "drain_timeout": 60.0,
}


def default_pg() -> str:
    """``$CHAOS_POSTGRES_URL``, else the test suite's ``$LOCKGUARD_TEST_POSTGRES_URL``, else the local server."""
    return os.environ.get("CHAOS_POSTGRES_URL") or os.environ.get("LOCKGUARD_TEST_POSTGRES_URL") or DEFAULT_PG


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m chaos.soak", description=__doc__.split("\n", 1)[0])
    d = Options()
    p.add_argument("--quick", action="store_true", help=f"the bounded CI run: {QUICK}")
    p.add_argument("--jobs", type=int, help=f"distinct jobs (default {d.jobs})")
    p.add_argument("--entities", type=int, help=f"entities the jobs lock (default {d.entities})")
    p.add_argument("--duplicates", type=float, help=f"share of jobs published twice (default {d.duplicates})")
    p.add_argument("--duration", type=float, help="seconds to spread publishing over (default 0: all at once)")
    p.add_argument("--workers", type=int, help=f"celery worker processes (default {d.workers})")
    p.add_argument("--concurrency", type=int, help=f"pool children per worker (default {d.concurrency})")
    p.add_argument("--seed", type=int, help="random seed (default: random, printed)")
    p.add_argument("--ttl", type=float, help=f"lock TTL in seconds (default {d.ttl})")
    p.add_argument(
        "--visibility-timeout", type=float, help=f"broker visibility_timeout (default {d.visibility_timeout})"
    )
    p.add_argument("--slow", type=float, help=f"share of jobs outliving the visibility timeout (default {d.slow})")
    p.add_argument("--kill-every", type=float, help=f"mean seconds between SIGKILLs, 0 = none (default {d.kill_every})")
    p.add_argument("--pauses", type=int, help=f"SIGSTOP pauses of a worker (default {d.pauses})")
    p.add_argument("--pause-seconds", type=float, help="length of a pause (default visibility timeout + TTL)")
    p.add_argument("--restarts", type=int, help=f"lock Redis restarts (default {d.restarts})")
    p.add_argument("--drain-timeout", type=float, help=f"give up after this long without progress ({d.drain_timeout})")
    p.add_argument("--pg", help="PostgreSQL DSN (default $CHAOS_POSTGRES_URL, $LOCKGUARD_TEST_POSTGRES_URL, or local)")
    p.add_argument("--unsafe", choices=[m for m in UNSAFE_MODES if m], help="switch a guard off: the check must fail")
    p.add_argument("--keep", action="store_true", help="keep the run's tables and worker logs")
    p.add_argument("--report-json", help="also write the report as JSON to this path")
    ns = p.parse_args(argv)
    opts = Options(**(QUICK if ns.quick else {}))
    for name, value in vars(ns).items():
        if value is not None and value is not False:
            setattr(opts, name, value)
    opts.pg = opts.pg or default_pg()
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(1 << 31)
    if opts.pause_for <= opts.ttl:
        p.error(f"--pause-seconds must exceed the TTL ({opts.ttl}s): the pause is meant to outlive the lease")
    if opts.workers < 2 and opts.pauses:
        p.error("a pause needs at least 2 workers (the others take the paused one's work over)")
    return opts


# -- the plan -------------------------------------------------------------------


@dataclass
class Plan:
    """What gets published: per job (entity, work ms), and the publishing order (with duplicates)."""

    jobs: list[tuple[int, int]]
    order: list[int]  # job ids; a job appears twice when duplicated
    slow: list[int]


def make_plan(opts: Options, rng: random.Random) -> Plan:
    """Jobs over entities; duplicates either right behind their original (concurrent) or anywhere later."""
    slow_ms = int(opts.visibility_timeout * 1.5 * 1000)
    n_slow = max(2, round(opts.jobs * opts.slow)) if opts.slow > 0 else 0
    slow = sorted(rng.sample(range(opts.jobs), min(n_slow, opts.jobs)))
    slow_set = set(slow)
    jobs = [(rng.randrange(opts.entities), slow_ms if j in slow_set else rng.randint(5, 40)) for j in range(opts.jobs)]
    keyed = [(float(j), j) for j in range(opts.jobs)]
    for j in rng.sample(range(opts.jobs), round(opts.jobs * opts.duplicates)):
        offset = rng.uniform(0.5, 4) if rng.random() < 0.5 else rng.uniform(0.5, opts.jobs)
        keyed.append((j + offset, j))
    keyed.sort()
    return Plan(jobs, [j for _, j in keyed], slow)


# -- the run --------------------------------------------------------------------


@dataclass
class Run:
    """State shared by the publisher, the fault loop and the report."""

    opts: Options
    run_id: str
    tables: Tables
    faults: check.Faults = field(default_factory=check.Faults)
    published: int = 0
    task_ids: dict[int, list[str]] = field(default_factory=dict)  # job -> the task ids it was published under
    publish_done: float | None = None
    started: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def publish(run: Run, app: Any, plan: Plan) -> None:
    """Publish the plan in order, paced over ``--duration``; a duplicate gets its own task id."""
    task = app.tasks[TASK_NAME]
    pace = run.opts.duration / max(1, len(plan.order))
    try:
        for i, job in enumerate(plan.order):
            if run.stop.is_set():
                return
            entity, work_ms = plan.jobs[job]
            task_id = f"{run.run_id}-{job}-{uuid.uuid4().hex[:8]}"
            run.task_ids.setdefault(job, []).append(task_id)
            task.apply_async((job, entity, work_ms), task_id=task_id)
            run.published += 1
            if pace:
                ahead = run.started + (i + 1) * pace - time.monotonic()
                if ahead > 0:
                    run.stop.wait(ahead)
        run.publish_done = time.monotonic()
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        run.error = exc


def committed(conn: psycopg.Connection[Any], tables: Tables) -> int:
    row = conn.execute(f"SELECT count(DISTINCT job_id) FROM {tables.effects}").fetchone()
    return int(row[0]) if row else 0


def broker_backlog(broker: redis.Redis, queue: str) -> int:
    """Messages the broker still holds for the queue: waiting, or delivered and not yet acknowledged."""
    waiting = sum(
        int(broker.llen(k)) for k in broker.scan_iter(match=f"{queue}*", count=100) if broker.type(k) == "list"
    )
    return waiting + int(broker.hlen("unacked"))


def lease_keys(lock: redis.Redis, prefix: str) -> list[str]:
    return [str(k) for k in lock.scan_iter(match=f"{prefix}:v1:*:lock", count=1000)]


def holders(lock: redis.Redis, prefix: str) -> set[str]:
    """Nodenames of workers holding a lease right now (empty when the lock Redis is down)."""
    try:
        return {str(lock.hget(k, "worker") or "") for k in lease_keys(lock, prefix)}
    except redis.RedisError:
        return set()


class FaultLoop:
    """Applies the scheduled faults (pauses, restarts) by progress and the SIGKILLs by time."""

    def __init__(
        self, run: Run, workers: list[Worker], lock_server: RedisServer, prefix: str, rng: random.Random
    ) -> None:
        self.run = run
        self.opts = run.opts
        self.workers = workers
        self.lock_server = lock_server
        self.prefix = prefix
        self.rng = rng
        lo, hi = FAULT_WINDOW
        n_restarts, n_pauses = self.opts.restarts, self.opts.pauses
        self.restart_at = [lo + (hi - lo) * (k + 1) / (n_restarts + 1) for k in range(n_restarts)]
        self.pause_at = [lo + (hi - lo) * (k + 0.5) / n_pauses for k in range(n_pauses)]
        self.paused: tuple[Worker, float] | None = None  # (worker, stopped at)
        self.next_kill = self._draw_kill(time.monotonic())
        self.lock = lock_server.client(socket_timeout=1)

    def _draw_kill(self, now: float) -> float:
        every = self.opts.kill_every
        return now + self.rng.expovariate(1 / every) if every > 0 else math.inf

    def pending(self) -> bool:
        """Scheduled faults not applied yet (or a pause not yet over)."""
        return bool(self.restart_at or self.pause_at or self.paused)

    def step(self, progress: float) -> None:
        """Apply whatever is due now (``progress`` = share of jobs committed)."""
        now = time.monotonic()
        if self.paused and now >= self.paused[1] + self.opts.pause_for:
            self._resume()
        if self.pause_at and progress >= self.pause_at[0] and self.paused is None:
            self.pause_at.pop(0)
            self._pause()
        if self.restart_at and progress >= self.restart_at[0]:
            self.restart_at.pop(0)
            down = time.monotonic()
            self.lock_server.stop()
            time.sleep(self.rng.uniform(0.2, 1.5))  # the outage itself: its length is part of the fault
            self.lock_server.start()
            self.run.faults.restarts.append((down, time.monotonic()))
        if now >= self.next_kill and progress < 0.98:
            awake = [w for w in self.workers if not w.paused]
            pid = self.rng.choice(awake).kill_child(self.rng) if awake else None
            if pid is not None:
                self.run.faults.kills.append((pid, time.monotonic()))
            self.next_kill = self._draw_kill(now)

    def _pause(self) -> None:
        """Freeze a worker that holds a lease right now (any worker if none does within a second)."""
        deadline = time.monotonic() + 1
        busy: list[Worker] = []
        while True:
            names = holders(self.lock, self.prefix)
            busy = [w for w in self.workers if w.nodename in names]
            if busy or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        target = self.rng.choice(busy or self.workers)
        target.pause()
        self.paused = (target, time.monotonic())

    def _resume(self) -> None:
        assert self.paused is not None
        worker, stopped = self.paused
        worker.resume()
        self.run.faults.pauses.append((worker.nodename, stopped, time.monotonic()))
        self.paused = None

    def finish(self) -> None:
        """Resume a paused worker: the run is ending."""
        if self.paused:
            self._resume()


# -- reading the run back ---------------------------------------------------------


def read_rows(
    conn: psycopg.Connection[Any], tables: Tables
) -> tuple[list[check.Effect], list[check.Execution], list[tuple[str, int, str, int]]]:
    effects = [
        check.Effect(*r)
        for r in conn.execute(
            f"SELECT seq, job_id, entity, fence, task_id, charge_id FROM {tables.effects} ORDER BY seq"
        ).fetchall()
    ]
    executions = [
        check.Execution(*r)
        for r in conn.execute(
            f"SELECT id, job_id, entity, task_id, fence, worker, pid, t_start, t_end, lost_body, lost_release,"
            f" outcome FROM {tables.executions} ORDER BY id"
        ).fetchall()
    ]
    provider: list[tuple[str, int, str, int]] = [
        (r[0], r[1], r[2], r[3])
        for r in conn.execute(f"SELECT idem_key, job_id, charge_id, calls FROM {tables.provider}")
    ]
    return effects, executions, provider


def event_counts(broker: redis.Redis, key: str) -> Counter[str]:
    """Lock events and deliveries the workers counted: ``event`` and ``event|reason`` -> count."""
    out: Counter[str] = Counter()
    for fieldname, n in broker.hgetall(key).items():
        event, reason = str(fieldname).split("|", 1)
        out[event] += int(n)
        if reason:
            out[f"{event}|{reason}"] += int(n)
    return out


def dump_history(
    log_dir: Path, effects: list[check.Effect], executions: list[check.Execution], faults: check.Faults
) -> None:
    """Keep the run's history beside the worker logs (the tables are dropped): what a reduction starts from."""
    with open(log_dir / "effects.jsonl", "w") as out:
        out.writelines(json.dumps(e._asdict()) + "\n" for e in effects)
    with open(log_dir / "executions.jsonl", "w") as out:
        out.writelines(json.dumps(x._asdict()) + "\n" for x in executions)
    (log_dir / "faults.json").write_text(json.dumps(asdict(faults), indent=1))


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Environment:
    """The servers, tables and workers of one run; :meth:`close` stops and drops all of it."""

    QUEUE_PREFIX, LOCK_PREFIX, EVENTS_KEY = "chaos-", "chaos", "chaos:events"

    def __init__(self, opts: Options, run_id: str, log_dir: Path) -> None:
        self.opts = opts
        self.run_id = run_id
        self.log_dir = log_dir
        self.tables = Tables(f"chaos_{run_id}")
        self.queue = f"{self.QUEUE_PREFIX}{run_id}"
        self.servers: list[RedisServer] = []
        self.workers: list[Worker] = []
        self.created = False

    def start(self) -> Environment:
        opts = self.opts
        self.broker_server = RedisServer().start()  # never restarted: a different server from the lock store
        self.servers.append(self.broker_server)
        self.lock_server = RedisServer(persistent=False).start()
        self.servers.append(self.lock_server)
        with psycopg.connect(opts.pg, autocommit=True) as conn:
            self.created = True
            for ddl in self.tables.ddl():
                conn.execute(ddl)
            create_fence_table(conn, self.tables.fences)
            PostgresStore(opts.pg, self.tables.completions).create_table(conn)
        self.cfg = {
            "broker": self.broker_server.url,
            "lock_url": self.lock_server.url,
            "pg": opts.pg,
            "tables": self.tables.base,
            "queue": self.queue,
            "prefix": self.LOCK_PREFIX,
            "ttl": opts.ttl,
            "visibility_timeout": opts.visibility_timeout,
            "events_key": self.EVENTS_KEY,
            "unsafe": opts.unsafe,
        }
        self.app = create_app(self.cfg)
        print(f"chaos {self.run_id}: {opts.workers} workers x {opts.concurrency}, logs in {self.log_dir}", flush=True)
        self.workers = [
            Worker(f"chaos{k}-{self.run_id}", self.cfg, self.log_dir, opts.concurrency) for k in range(opts.workers)
        ]
        wait_ready(self.app, self.workers)
        return self

    def events(self) -> Counter[str]:
        return event_counts(self.broker_server.client(), self.EVENTS_KEY)

    def decisions(self) -> dict[str, list[str]]:
        """Lock events per task id, in order (``event|reason``), as the workers logged them."""
        out: dict[str, list[str]] = {}
        for raw in self.broker_server.client().lrange(f"{self.EVENTS_KEY}:log", 0, -1):
            task_id, what, _t = json.loads(raw)
            out.setdefault(task_id, []).append(what.rstrip("|"))
        return out

    def close(self, keep: bool) -> None:
        """Stop the workers first (they hold PostgreSQL connections), then drop the tables, then the servers."""
        stop_all(self.workers)
        if self.created and not keep:
            with psycopg.connect(self.opts.pg, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '10s'")
                conn.execute(f"DROP TABLE IF EXISTS {', '.join(self.tables.all())}")
        for server in self.servers:
            server.close()


def drive(env: Environment, run: Run, plan: Plan, rng: random.Random) -> FaultLoop:
    """Publish, inject faults, and return once the run drained (or the drain timed out)."""
    opts = run.opts
    threading.Thread(target=publish, args=(run, env.app, plan), name="publisher", daemon=True).start()
    loop = FaultLoop(run, env.workers, env.lock_server, env.LOCK_PREFIX, rng)
    broker = env.broker_server.client()
    idle_since: float | None = None
    settle = max(2 * opts.ttl, 5.0)
    last_print = 0.0
    last_done, last_progress = -1, time.monotonic()
    with psycopg.connect(opts.pg, autocommit=True) as pg:
        try:
            while True:
                if run.error is not None:
                    raise RuntimeError("publishing failed") from run.error
                done = committed(pg, env.tables)
                loop.step(done / opts.jobs)
                now = time.monotonic()
                if done != last_done:
                    last_done, last_progress = done, now
                if now - last_print >= (2 if opts.quick else 10):
                    last_print = now
                    print(
                        f"[{now - run.started:6.1f}s] published {run.published}/{len(plan.order)}"
                        f" · committed {done}/{opts.jobs} · kills {len(run.faults.kills)}"
                        f" · pauses {len(run.faults.pauses)}{' (paused now)' if loop.paused else ''}"
                        f" · restarts {len(run.faults.restarts)}",
                        flush=True,
                    )
                if run.publish_done is not None:
                    # Done when the broker holds nothing (queued or unacknowledged) and every fault ran.
                    idle = broker_backlog(broker, env.queue) == 0
                    idle_since = (idle_since or now) if idle else None
                    if idle and done >= opts.jobs and not loop.pending():
                        return loop
                    if idle_since is not None and now - idle_since > settle:
                        print(f"the broker is empty but {opts.jobs - done} jobs never committed", flush=True)
                        return loop
                    if now - last_progress > opts.drain_timeout:
                        print(f"no job committed for {opts.drain_timeout:.0f}s: giving up", flush=True)
                        return loop
                time.sleep(0.2)
        finally:
            run.stop.set()
            loop.finish()


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    rng = random.Random(opts.seed)
    run_id = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix=f"chaos-{run_id}-"))
    env = Environment(opts, run_id, log_dir)
    run = Run(opts, run_id, env.tables)
    ok = False
    # Both stop the run the same way, even when started from a shell that ignores SIGINT for background jobs.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        env.start()
        plan = make_plan(opts, rng)
        run.started = time.monotonic()
        drive(env, run, plan, rng)
        quiet = time.monotonic()
        lock = env.lock_server.client()
        # Every lease must be gone once its TTL ran out after the last job (drift margin: 1 s).
        while lease_keys(lock, env.LOCK_PREFIX) and time.monotonic() < quiet + opts.ttl + 1:
            time.sleep(0.1)
        leases_left = lease_keys(lock, env.LOCK_PREFIX)
        broker_left = broker_backlog(env.broker_server.client(), env.queue)
        elapsed = time.monotonic() - run.started
        with psycopg.connect(opts.pg, autocommit=True) as pg:
            effects, executions, provider = read_rows(pg, env.tables)
        verdict = check.check_all(opts.jobs, effects, executions, provider, run.faults, opts.ttl, leases_left)
        verdict.broker_left = broker_left
        check.annotate(verdict, run.task_ids, env.decisions())
        events = env.events()
        wanted = {
            "sigkill mid-body": int(opts.kill_every > 0),
            "pause": opts.pauses,
            "lock redis restart": opts.restarts,
            "redelivery": 1,
            "redelivery while running": int(opts.slow > 0),
        }
        check.check_coverage(
            verdict,
            run.faults,
            wanted,
            events["delivery|redelivered"],
            events["lock.skipped_duplicate|redelivery_of_running_original"],
        )
        report = build_report(
            opts=asdict(opts),
            run_id=run_id,
            plan={"messages": len(plan.order), "duplicates": len(plan.order) - opts.jobs, "slow_jobs": len(plan.slow)},
            faults=run.faults,
            events=events,
            verdict=verdict,
            elapsed=elapsed,
        )
        print(render(report), flush=True)
        if opts.report_json:
            Path(opts.report_json).write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
        ok = verdict.ok
        if not ok:
            dump_history(log_dir, effects, executions, run.faults)
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("interrupted: stopping everything this run started", flush=True)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        run.stop.set()
        env.close(keep=opts.keep)
        if ok and not opts.keep:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            kept = f"tables {env.tables.base}_* and " if opts.keep else ""
            print(f"kept {kept}worker logs in {log_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
