"""``python -m chaos.soak``: the chaos soak. Exits 1 on any violated invariant or uncaught control.

A run is one *leg* per completion backend (``--backends``: Redis, and
PostgreSQL through a proxy the soak can cut). Each leg:

1. Starts two private Redis servers: the broker and result backend (never
   touched) and the lock store (restarted without persistence, made BUSY,
   made to refuse writes). PostgreSQL holds the ledger, the fences, the
   completion records (PostgreSQL leg), the provider's books and the
   execution history, in tables of this run only.
2. Starts ``--workers`` real ``celery worker -P prefork -c --concurrency``
   processes of :mod:`chaos.app` (``acks_late``, ``reject_on_worker_lost``, a
   short ``visibility_timeout``).
3. Publishes ``--jobs`` jobs per *cell* over ``--entities`` entities per cell.
   A cell is a ``lock_mode`` x ``on_locked`` combination (``--modes``,
   ``--policies``: all nine by default), plus a heavy-tailed ``billing``
   cell, plus the negative controls (:data:`CONTROLS`): cells with one guard
   switched off, which the checker must catch. ``--duplicates`` of the jobs
   are published again under another task id (some right behind the
   original, some much later), spread over ``--duration`` seconds (0: at
   once). A few jobs (``--slow``) outlive the visibility timeout, so their
   message is redelivered while they run.
4. Injects faults while the jobs run, placed by progress so they land on
   work in flight whatever the machine's speed: pool children SIGKILLed
   (every ``--kill-every`` seconds on average, aimed at each cell in turn),
   ``--pauses`` SIGSTOPs of a whole worker that holds a lease, for
   ``--pause-seconds`` (> TTL), ``--restarts`` restarts of the lock Redis,
   ``--busy`` windows in which it answers BUSY (a script that never ends),
   ``--noreplicas`` windows in which it refuses writes (NOREPLICAS), and
   ``--pg-outages`` cuts of the completion store's PostgreSQL endpoint.
5. Drains until the broker holds nothing, waits out the TTL, then checks
   every cell (:mod:`chaos.check`) and prints a report per leg and a summary.

Every process started here is stopped and every table dropped on the way
out, also on Ctrl-C or SIGTERM; ``--keep`` keeps the tables and worker logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
import structlog

from celery_lockguard import AlreadyQueued, create_fence_table
from celery_lockguard._completion import PostgresStore
from celery_lockguard.testing import RedisServer

from . import check
from .app import (
    BACKENDS,
    DEFAULT_CELL,
    MODES,
    POLICIES,
    SWITCHES,
    TASK_NAME,
    UNSAFE_MODES,
    Cell,
    Keys,
    Tables,
    connect,
    create_app,
    reason_of,
)
from .fleet import Worker, chaos_worker, stop_all, wait_ready
from .proxy import CutProxy
from .report import build_report, render, render_summary

__all__ = ["TASK_NAME", "Environment", "Options", "broker_backlog", "default_pg", "interrupt", "main"]

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
#: Progress (share of publishes answered) between which the scheduled faults are placed.
FAULT_WINDOW = (0.1, 0.9)
#: Pool children of the worker that runs the baits (see FaultLoop._restart).
BAIT_CONCURRENCY = 8
#: The lock Redis answers BUSY once a script has run this long (``busy-reply-threshold``, ms).
BUSY_THRESHOLD_MS = 100


@dataclass(frozen=True)
class Control:
    """A negative control: a cell with one guard off, and the invariant that must catch it."""

    cell: Cell
    target: str  # a Verdict field that must be > 0
    backends: tuple[str, ...] = BACKENDS

    @property
    def switch(self) -> str:
        return self.cell.unsafe


#: Every guard and the count that shows it missing. Each runs as one more cell beside the real ones.
CONTROLS: tuple[Control, ...] = (
    Control(Cell(unsafe="ignore-record"), "duplicate_effects"),
    Control(Cell(unsafe="no-fence"), "fence_regressions"),
    Control(Cell(workload="billing", unsafe="no-renew"), "overlaps", ("redis",)),
    Control(Cell(unsafe="no-completion"), "record_misses"),
    Control(Cell("until_started", "skip", unsafe="no-claim"), "queued_twice", ("redis",)),
    Control(Cell("until_done", "skip", unsafe="no-claim"), "queued_twice", ("postgresql",)),
    Control(Cell("while_running", "raise", unsafe="swallow-contended"), "lost_jobs", ("postgresql",)),
    Control(Cell(unsafe="fail-open"), "overlaps", ("redis",)),
)
#: The positive twin of the no-renew control: the same heavy tail with renewal on must pass.
BILLING_CELL = Cell(workload="billing")


@dataclass
class Options:
    """Everything a run is made of; ``--quick`` only changes the defaults."""

    jobs: int = 500  # per cell
    entities: int = 25  # per cell
    duplicates: float = 0.3
    duration: float = 180.0
    workers: int = 3
    concurrency: int = 3
    seed: int | None = None
    ttl: float = 3.0
    visibility_timeout: float = 8.0
    slow: float = 0.004
    kill_every: float = 2.0
    pauses: int = 2
    pause_seconds: float | None = None
    restarts: int = 3
    busy: int = 2
    noreplicas: int = 2
    pg_outages: int = 2
    backends: tuple[str, ...] = BACKENDS
    modes: tuple[str, ...] = MODES
    policies: tuple[str, ...] = POLICIES
    billing: bool = True
    controls: tuple[str, ...] = SWITCHES
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
    "jobs": 40,
    "entities": 5,
    "duration": 25.0,
    "ttl": 2.0,
    "visibility_timeout": 3.0,
    "slow": 0.01,
    "kill_every": 1.0,
    "pauses": 1,
    "restarts": 2,
    "busy": 1,
    "noreplicas": 1,
    "pg_outages": 1,
    "drain_timeout": 60.0,
}


def default_pg() -> str:
    """``$CHAOS_POSTGRES_URL``, else the test suite's ``$LOCKGUARD_TEST_POSTGRES_URL``, else the local server."""
    return os.environ.get("CHAOS_POSTGRES_URL") or os.environ.get("LOCKGUARD_TEST_POSTGRES_URL") or DEFAULT_PG


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(allowed)}")
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m chaos.soak", description=__doc__.split("\n", 1)[0])
    d = Options()
    p.add_argument("--quick", action="store_true", help=f"the bounded CI run: {QUICK}")
    p.add_argument("--jobs", type=int, help=f"distinct jobs per cell (default {d.jobs})")
    p.add_argument("--entities", type=int, help=f"entities per cell (default {d.entities})")
    p.add_argument("--duplicates", type=float, help=f"share of jobs published twice (default {d.duplicates})")
    p.add_argument(
        "--duration", type=float, help=f"seconds over which a leg publishes, 0 = at once (default {d.duration:g})"
    )
    p.add_argument("--workers", type=int, help=f"celery worker processes (default {d.workers})")
    p.add_argument("--concurrency", type=int, help=f"pool children per worker (default {d.concurrency})")
    p.add_argument("--seed", type=int, help="random seed (default: random, printed)")
    p.add_argument("--ttl", type=float, help=f"lock TTL in seconds (default {d.ttl})")
    p.add_argument(
        "--visibility-timeout", type=float, help=f"broker visibility_timeout (default {d.visibility_timeout})"
    )
    p.add_argument("--slow", type=float, help=f"share of jobs outliving the visibility timeout (default {d.slow})")
    p.add_argument("--kill-every", type=float, help=f"mean seconds between SIGKILLs, 0 = none (default {d.kill_every})")
    p.add_argument("--pauses", type=int, help=f"SIGSTOP pauses of a worker per leg (default {d.pauses})")
    p.add_argument("--pause-seconds", type=float, help="length of a pause (default visibility timeout + TTL)")
    p.add_argument("--restarts", type=int, help=f"lock Redis restarts per leg (default {d.restarts})")
    p.add_argument("--busy", type=int, help=f"lock Redis BUSY windows per leg (default {d.busy})")
    p.add_argument("--noreplicas", type=int, help=f"lock Redis NOREPLICAS windows per leg (default {d.noreplicas})")
    p.add_argument(
        "--pg-outages", type=int, help=f"completion-store outages per PostgreSQL leg (default {d.pg_outages})"
    )
    p.add_argument("--backends", type=_choices(BACKENDS), help="completion backends, one leg each (default both)")
    p.add_argument("--modes", type=_choices(MODES), help="lock modes to run (default all)")
    p.add_argument("--policies", type=_choices(POLICIES), help="on_locked policies to run (default all)")
    p.add_argument(
        "--no-billing", dest="billing", action="store_false", default=None, help="leave out the billing cell"
    )
    p.add_argument(
        "--controls",
        type=_choices(("none", *SWITCHES)),
        help="negative controls to run beside the cells (default all; 'none' for none)",
    )
    p.add_argument("--drain-timeout", type=float, help=f"give up after this long without progress ({d.drain_timeout})")
    p.add_argument("--pg", help="PostgreSQL DSN (default $CHAOS_POSTGRES_URL, $LOCKGUARD_TEST_POSTGRES_URL, or local)")
    p.add_argument(
        "--unsafe",
        choices=[m for m in UNSAFE_MODES if m],
        help="switch a guard off in every cell (no controls): the check must fail",
    )
    p.add_argument("--keep", action="store_true", help="keep the run's tables and worker logs")
    p.add_argument("--report-json", help="also write the report as JSON to this path")
    ns = p.parse_args(argv)
    opts = Options(**(QUICK if ns.quick else {}))
    for name, value in vars(ns).items():
        if value is not None and value is not False:
            setattr(opts, name, value)
    if ns.billing is False:
        opts.billing = False
    if "none" in opts.controls:
        opts.controls = ()
    opts.pg = opts.pg or default_pg()
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(1 << 31)
    if opts.pause_for <= opts.ttl:
        p.error(f"--pause-seconds must exceed the TTL ({opts.ttl}s): the pause is meant to outlive the lease")
    if opts.workers < 2 and opts.pauses:
        p.error("a pause needs at least 2 workers (the others take the paused one's work over)")
    return opts


def leg_cells(opts: Options, backend: str) -> tuple[list[Cell], dict[Cell, Control]]:
    """The cells one leg runs: the matrix (and billing twin), then the controls meant for this backend."""
    if opts.unsafe:
        cells = [Cell(m, p, unsafe=opts.unsafe) for m in opts.modes for p in opts.policies]
        return cells, {}
    cells = [Cell(m, p) for m in opts.modes for p in opts.policies]
    controls = {c.cell: c for c in CONTROLS if c.switch in opts.controls and backend in c.backends}
    # The billing twin runs beside the no-renew control (the quick run has it only there) and in every full leg.
    if opts.billing and (not opts.quick or any(c.switch == "no-renew" for c in controls.values())):
        cells.append(BILLING_CELL)
    return cells + list(controls), controls


# -- the plan -------------------------------------------------------------------


@dataclass
class Plan:
    """What gets published: per job (cell, entity, work ms), and the publishing order (with duplicates)."""

    cells: list[Cell]
    jobs: list[tuple[int, int, int]]  # job id -> (cell index, entity, work ms)
    order: list[int]  # job ids; a job appears twice when duplicated
    slow: list[int]

    def jobs_of(self, k: int) -> list[int]:
        return [j for j, (c, _, _) in enumerate(self.jobs) if c == k]

    entities: int = 0  # per cell: cell k owns entities [k * entities, (k + 1) * entities)
    baits: dict[int, int] = field(default_factory=dict)  # entity -> cell, for entities of baits

    def add_job(self, k: int, entity: int, work_ms: int) -> int:
        """A job beyond the plan (a bait the fault loop publishes itself); returns its id."""
        self.jobs.append((k, entity, work_ms))
        return len(self.jobs) - 1

    def bait_entity(self, k: int) -> int:
        """An entity of cell ``k`` that no planned job uses."""
        entity = len(self.cells) * self.entities + len(self.baits)
        self.baits[entity] = k
        return entity

    def cell_of_entity(self, entity: int) -> int:
        return self.baits.get(entity, entity // max(1, self.entities))


def _work_ms(cell: Cell, opts: Options, rng: random.Random, tail: bool) -> int:
    if cell.workload == "billing":
        base = rng.randint(150, 250)  # a nightly billing run: ~200 ms a job ...
        return base * 40 if tail else base  # ... and 1% forty times longer, well past the TTL
    return int(opts.visibility_timeout * 1.5 * 1000) if tail else rng.randint(5, 40)


def make_plan(opts: Options, cells: list[Cell], rng: random.Random) -> Plan:
    """Per cell: jobs over its own entities; duplicates right behind their original or anywhere later.

    The cells' orders are interleaved, so every cell is in flight for the whole leg.
    """
    jobs: list[tuple[int, int, int]] = []
    keyed: list[tuple[float, int, int]] = []
    slow: list[int] = []
    n = opts.jobs
    for k, cell in enumerate(cells):
        share = 0.01 if cell.workload == "billing" else opts.slow
        n_tail = max(1, round(n * share)) if share > 0 else 0
        # The long jobs come in the first 60% of the cell's order, so later work on their entities meets them.
        tails = set(rng.sample(range(max(1, n * 6 // 10)), min(n_tail, max(1, n * 6 // 10))))
        first = len(jobs)
        for j in range(n):
            job = first + j
            jobs.append((k, k * opts.entities + rng.randrange(opts.entities), _work_ms(cell, opts, rng, j in tails)))
            keyed.append((float(j), k, job))
            if j in tails:
                slow.append(job)
        for j in rng.sample(range(n), round(n * opts.duplicates)):
            offset = rng.uniform(0.5, 4) if rng.random() < 0.5 else rng.uniform(0.5, n)
            keyed.append((j + offset, k, first + j))
    keyed.sort()
    return Plan(cells, jobs, [job for _, _, job in keyed], sorted(slow), opts.entities)


# -- the run --------------------------------------------------------------------


@dataclass
class Run:
    """State shared by the publisher, the fault loop and the report."""

    opts: Options
    run_id: str
    tables: Tables
    faults: check.Faults = field(default_factory=check.Faults)
    published: int = 0
    answered_at_publish: int = 0  # publishes deduplicated or refused: answered without a message
    publishes: list[check.Publish] = field(default_factory=list)
    task_ids: dict[int, list[str]] = field(default_factory=dict)  # job -> the task ids it was published under
    unclaimed: set[str] = field(default_factory=set)  # task ids the library published without their claim
    publish_done: float | None = None
    started: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def observe_publisher(run: Run) -> None:
    """Quiet the driver's own lock events, keeping which publishes went out without their claim."""

    def collect(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if event.get("event") == "lock.backend_unavailable" and reason_of(event) == "publish without claim":
            run.unclaimed.add(str(event.get("task_id")))
        raise structlog.DropEvent

    structlog.configure(processors=[collect], cache_logger_on_first_use=False)


def claim_holder(lock: redis.Redis, cell: Cell, entity: int) -> str | None:
    """The task id holding the entity's queue-time claim ("" = none; None = unreadable or not a queue mode).

    Names from the data model (DESIGN: ``{prefix}:v1:{K}:lock``): ``until_started`` claims ``{K}:claim``;
    ``until_done`` claims the lease hash itself, or ``{K}:claim`` beside it while other work holds the lease.
    """
    if not cell.queue_mode:
        return None
    base = f"{Environment.LOCK_PREFIX}:v1:{{acct:{entity}}}"
    kinds = ("claim", "lock") if cell.mode == "until_done" else ("claim",)
    try:
        holders = [lock.hget(f"{base}:{kind}", "task_id") for kind in kinds]
    except redis.RedisError:
        return None
    return str(next((h for h in holders if h), ""))


def send(
    run: Run, app: Any, plan: Plan, lock: redis.Redis, job: int, queue: str | None = None, countdown: float = 0.0
) -> check.Publish:
    """Publish one message of ``job`` under a fresh task id and record what the publish returned.

    In queue-time modes the entity's claim is read just before and just after
    the publish, so the checker knows whether this publish held it.
    """
    k, entity, work_ms = plan.jobs[job]
    cell = plan.cells[k]
    task_id = f"{run.run_id}-{job}-{uuid.uuid4().hex[:8]}"
    run.task_ids.setdefault(job, []).append(task_id)
    args = (job, entity, work_ms)
    options: dict[str, Any] = {"queue": queue} if queue else {}
    if countdown:
        options["countdown"] = countdown
    answered_by = None
    before = claim_holder(lock, cell, entity)
    t_sent = time.monotonic()
    try:
        if cell.unsafe == "no-claim":  # send_task bypasses the queue-time claim
            result = app.send_task(cell.task_name, args, task_id=task_id, **options)
        else:
            result = app.tasks[cell.task_name].apply_async(args, task_id=task_id, **options)
        outcome = "enqueued" if result.id == task_id else "deduped"
        answered_by = None if result.id == task_id else str(result.id)
    except AlreadyQueued:
        outcome = "raised:AlreadyQueued"
    except Exception as exc:  # noqa: BLE001 - a publish that raises is recorded, and the run goes on
        outcome = f"raised:{exc.__class__.__name__}"
    t_done = time.monotonic()
    after = claim_holder(lock, cell, entity)
    record = check.Publish(job, task_id, t_sent, t_done, outcome, answered_by, None, before, after)
    run.publishes.append(record)
    run.published += 1
    run.answered_at_publish += outcome != "enqueued"
    return record


def publish(run: Run, app: Any, plan: Plan, lock: redis.Redis) -> None:
    """Publish the plan in order, paced over ``--duration``; a duplicate gets its own task id."""
    pace = run.opts.duration / max(1, len(plan.order))
    try:
        for i, job in enumerate(plan.order):
            if run.stop.is_set():
                return
            send(run, app, plan, lock, job)
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


def running_bodies(pg: psycopg.Connection[Any], tables: Tables) -> int:
    """Bodies started in the last minute, not ended, whose process is still alive (a killed child's never end)."""
    alive = 0
    rows = pg.execute(
        f"SELECT pid FROM {tables.executions} WHERE t_end IS NULL AND t_start > %s", (time.monotonic() - 60,)
    )
    for (pid,) in rows:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive += 1
    return alive


def broker_backlog(broker: redis.Redis, queue: str) -> int:
    """Messages the broker still holds for the queue: waiting, or delivered and not yet acknowledged."""
    waiting = sum(
        int(broker.llen(k)) for k in broker.scan_iter(match=f"{queue}*", count=100) if broker.type(k) == "list"
    )
    return waiting + int(broker.hlen("unacked"))


def lease_keys(lock: redis.Redis, prefix: str) -> list[str]:
    """Leases and queue-time claims still in the lock Redis (every exit must free what it holds)."""
    return [
        str(k) for pattern in ("lock", "claim") for k in lock.scan_iter(match=f"{prefix}:v1:*:{pattern}", count=1000)
    ]


def describe_key(lock: redis.Redis, name: str) -> str:
    """A lease or claim left behind, with what it says about its holder."""
    try:
        h = lock.hgetall(name)
        ttl = lock.pttl(name)
    except redis.RedisError:
        return name
    return f"{name} task_id={h.get('task_id')} state={h.get('state')} pttl_ms={ttl}"


def holders(lock: redis.Redis, prefix: str) -> set[str]:
    """Nodenames of workers holding a lease right now (empty when the lock Redis is unavailable)."""
    try:
        return {str(lock.hget(k, "worker") or "") for k in lock.scan_iter(match=f"{prefix}:v1:*:lock", count=1000)}
    except redis.RedisError:
        return set()


class StoreFaults:
    """Faults of the lock Redis that leave it running: BUSY (a script that never ends) and NOREPLICAS."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self._spinner: threading.Thread | None = None

    def busy_on(self) -> None:
        """Run ``while true do end`` on a connection of its own; every other client then gets BUSY."""

        def spin() -> None:
            try:
                self.server.client().eval("while true do end", 0)
            except redis.RedisError:
                pass  # "Script killed by user", or the server went away

        self._spinner = threading.Thread(target=spin, name="busy-script", daemon=True)
        self._spinner.start()
        time.sleep(BUSY_THRESHOLD_MS / 1000 + 0.05)  # BUSY replies start once the script passed the threshold

    def busy_off(self) -> None:
        for _ in range(50):
            try:
                self.server.client(socket_timeout=1).script_kill()
                break
            except redis.RedisError as exc:
                if "NOTBUSY" in str(exc):
                    break
                time.sleep(0.05)
        if self._spinner is not None:
            self._spinner.join(5)
            self._spinner = None

    def noreplicas(self, on: bool) -> None:
        """``min-replicas-to-write 1`` on a server with no replica: every write is refused."""
        try:
            self.server.client(socket_timeout=1).config_set("min-replicas-to-write", 1 if on else 0)
        except redis.RedisError:
            pass


#: Baits of each restart: (cell, then other work on the entity, then a duplicate of the job). A long body
#: is running when its lease vanishes; other work on its entity then commits with a newer fence (what the
#: no-fence control needs to show a commit below it), or a duplicate of its job runs beside it (what the
#: ignore-record control needs to show a second commit). The twin cell gets both, and must hold.
RESTART_BAIT: tuple[tuple[Cell, bool, bool], ...] = (
    (Cell(), True, False),
    (Cell(), False, True),
    (Cell(unsafe="no-fence"), True, False),
    (Cell(unsafe="ignore-record"), False, True),
)
#: Cells baited while the lock Redis is down: a long job delivered during the outage, then other work on its
#: entity once it is back. The fail-open control runs the first unlocked beside the second; its twin waits.
OUTAGE_BAIT = (Cell(), Cell(unsafe="fail-open"))


class FaultLoop:
    """Applies the scheduled faults by progress and the SIGKILLs by time, one store fault at a time."""

    def __init__(
        self,
        run: Run,
        env: Environment,
        plan: Plan,
        rng: random.Random,
        pg: psycopg.Connection[Any],
    ) -> None:
        self.run = run
        self.opts = run.opts
        self.env = env
        self.workers = env.workers
        self.plan = plan
        self.rng = rng
        self.pg = pg
        self.store = StoreFaults(env.lock_server)
        kinds = {
            "restart": self.opts.restarts,
            "pause": self.opts.pauses,
            "busy": self.opts.busy,
            "noreplicas": self.opts.noreplicas,
            "pg_outage": self.opts.pg_outages if env.proxy is not None else 0,
        }
        order: list[str] = []
        left = dict(kinds)
        while any(left.values()):  # round-robin, so the kinds are interleaved over the window
            for kind in kinds:
                if left[kind]:
                    order.append(kind)
                    left[kind] -= 1
        lo, hi = FAULT_WINDOW
        self.schedule = [(lo + (hi - lo) * (i + 0.5) / len(order), kind) for i, kind in enumerate(order)]
        self.paused: tuple[Worker, float] | None = None  # (worker, stopped at)
        self.store_fault: tuple[str, float, float] | None = None  # (kind, began, ends)
        self.pg_cut: tuple[float, float] | None = None  # (began, ends)
        self.next_kill = self._draw_kill(time.monotonic())
        self.kill_turn = 0
        self.kills_by_cell: Counter[str] = Counter()
        self.killed_jobs: set[int] = set()
        self.bait_jobs: set[int] = set()
        self.lock = env.lock_server.client(socket_timeout=1)
        self.timed: list[tuple[float, Any]] = [(0.0, self._bait_start)]  # (due, action), driven by step()
        self.quiet_until = 0.0  # no scheduled fault starts before (a restart's baits are playing out)

    def _draw_kill(self, now: float) -> float:
        every = self.opts.kill_every
        return now + self.rng.expovariate(1 / every) if every > 0 else math.inf

    def pending(self) -> bool:
        """Scheduled faults not applied yet (or one still in effect)."""
        return bool(self.schedule or self.paused or self.store_fault or self.pg_cut)

    def step(self, progress: float) -> None:
        """Apply whatever is due now (``progress`` = share of publishes answered)."""
        now = time.monotonic()
        self._run_timed()
        if self.paused and now >= self.paused[1] + self.opts.pause_for:
            self._resume()
        if self.store_fault and now >= self.store_fault[2]:
            self._store_fault_end()
        if self.pg_cut and now >= self.pg_cut[1]:
            self._pg_restore()
        for i, (at, kind) in enumerate(self.schedule):
            if progress < at:
                break
            if self._start(kind):
                self.schedule.pop(i)
                break  # one new fault per step
        if now >= self.next_kill and progress < FAULT_WINDOW[1]:
            self._kill()
            self.next_kill = self._draw_kill(now)

    def _start(self, kind: str) -> bool:
        """Start a fault of ``kind`` once no other scheduled fault is in effect; True if started.

        One at a time, so each is seen on its own (and the baits of a restart find every worker awake).
        """
        ttl = self.opts.ttl
        if self.paused is not None or self.store_fault is not None or self.pg_cut is not None:
            return False
        if time.monotonic() < self.quiet_until:
            return False
        if kind == "pause":
            self._pause()
        elif kind == "pg_outage":
            if self.env.proxy is None:
                return True
            self.env.proxy.cut()
            now = time.monotonic()
            self.pg_cut = (now, now + self.rng.uniform(1.0, 3.0))
        elif kind == "restart":
            return self._restart()
        elif kind == "busy":
            began = time.monotonic()
            self.store.busy_on()
            self.store_fault = ("busy", began, began + self.rng.uniform(0.3, 1.5) * ttl)
        elif kind == "noreplicas":
            self.store.noreplicas(True)
            now = time.monotonic()
            self.store_fault = ("noreplicas", now, now + self.rng.uniform(0.3, 1.5) * ttl)
        return True

    def _cells(self, wanted: tuple[Cell, ...]) -> list[int]:
        return [k for k, cell in enumerate(self.plan.cells) if cell in wanted]

    def _bait(
        self, k: int, work_ms: int, job: int | None = None, entity: int | None = None, countdown: float = 0.0
    ) -> tuple[int, int]:
        """Publish a job of cell ``k`` on the bait queue (a new one, or another copy of ``job``)."""
        if job is None:
            if entity is None:
                entity = self.plan.bait_entity(k)  # a fresh entity: no other job of the cell disturbs the bait
            job = self.plan.add_job(k, entity, work_ms)
            self.bait_jobs.add(job)
        send(self.run, self.env.app, self.plan, self.env.claims, job, queue=self.env.bait_queue, countdown=countdown)
        return job, self.plan.jobs[job][1]

    def _run_timed(self) -> None:
        now = time.monotonic()
        for due, action in [x for x in self.timed if x[0] <= now]:
            self.timed.remove((due, action))
            action()

    def _wait_bodies(self, jobs: list[int], timeout: float, ended: bool = False) -> None:
        """Until a body of each job has started (``ended``: and finished), or ``timeout``."""
        deadline = time.monotonic() + timeout
        done = " AND t_end IS NOT NULL" if ended else ""
        while jobs and time.monotonic() < deadline:
            row = self.pg.execute(
                f"SELECT count(DISTINCT job_id) FROM {self.env.tables.executions} WHERE job_id = ANY(%s){done}",
                (jobs,),
            ).fetchone()
            if row and row[0] >= len(jobs):
                return
            self._run_timed()
            time.sleep(0.05)

    def _bait_start(self) -> None:
        """At the start: the billing cells' heavy tail, and contention for every ``raise`` cell.

        Billing cells: one job of the tail (40 x 200 ms), then other work on its entity 3 s later. With
        renewal the second waits for the first; without (the no-renew control) the first's lease expires
        after the TTL and the second runs beside it, with no fault to explain it.

        ``raise`` cells: a 3 s job, then other work on its entity 1 s later, which meets the holder and
        must fail visibly with ``LockContended`` (the swallow-contended control turns that into a silent
        success, a lost job).

        Queue-time cells that deduplicate (``skip``, ``raise``): a job published with a 1 s countdown
        (its claim waits with it) and at once its duplicate, which must be answered at publish (the
        no-claim control enqueues it); in ``until_done`` also a duplicate 1 s into a 3 s body.
        """
        now = time.monotonic()
        for k, cell in enumerate(self.plan.cells):
            if cell.workload == "billing":
                # No store fault while it plays out: a restart or BUSY under the 8 s job excuses its lost
                # lease, and the no-renew control then has nothing left to catch (seen in a quick run).
                self.quiet_until = max(self.quiet_until, now + 40 * 200 / 1000 + 1)
                _, entity = self._bait(k, 40 * 200)
                self.timed.append((now + 3.0, lambda k=k, e=entity: self._bait(k, 200, entity=e)))
            if cell.policy == "raise":
                _, entity = self._bait(k, 3000)
                self.timed.append((now + 1.0, lambda k=k, e=entity: self._bait(k, 20, entity=e)))
            if cell.queue_mode and cell.policy != "retry":
                job, _ = self._bait(k, 20, countdown=1.0)
                self._bait(k, 20, job=job)
                if cell.mode == "until_done":
                    job, _ = self._bait(k, 3000)
                    self.timed.append((now + 1.0, lambda k=k, j=job: self._bait(k, 3000, job=j)))

    def _restart(self) -> bool:
        """Kill the lock Redis and start it empty, with baits for the cells whose guard needs it.

        Before: a long job of each RESTART_BAIT recipe starts (on the bait worker, waited for up to
        5 s). During the outage: a long job of each OUTAGE_BAIT cell. After: other work on the entity of
        a running bait (it runs and commits while the bait still runs) and other work on the entity of
        each outage bait; then a duplicate of a running bait's job (it runs beside the bait).
        """
        index = {cell: k for k, cell in enumerate(self.plan.cells)}
        recipes = [(index[cell], other, dup) for cell, other, dup in RESTART_BAIT if cell in index]
        outage_cells = self._cells(OUTAGE_BAIT)
        bait_ms = int(max(3.0, self.opts.ttl + 1.5) * 1000)
        running = [(k, other, dup, *self._bait(k, bait_ms)) for k, other, dup in recipes]
        self._wait_bodies([job for *_, job, _ in running], 5)
        down = time.monotonic()
        self.env.lock_server.stop()
        outage = {k: self._bait(k, bait_ms) for k in outage_cells}
        unlocked = [job for k, (job, _) in outage.items() if self.plan.cells[k].unsafe == "fail-open"]
        self._wait_bodies(unlocked, 3)  # the fail-open control starts its body without a lease
        time.sleep(max(0.0, down + self.rng.uniform(0.2, 1.5) - time.monotonic()))  # the outage's length
        self.env.lock_server.start()
        self.run.faults.restarts.append((down, time.monotonic()))
        others = [self._bait(k, 20, entity=entity)[0] for k, other, _, _, entity in running if other]
        for k, (_, entity) in outage.items():
            self._bait(k, 20, entity=entity)
        self._wait_bodies(others, 2, ended=True)  # the other work commits first, with a newer fence
        for k, _, dup, job, _ in running:
            if dup:
                self._bait(k, bait_ms, job=job)  # a duplicate of the job whose lease vanished under it
        self.quiet_until = time.monotonic() + bait_ms / 1000 + 1  # no other fault while the baits play out
        return True

    def _store_fault_end(self) -> None:
        assert self.store_fault is not None
        kind, began, _ = self.store_fault
        if kind == "busy":
            self.store.busy_off()
            self.run.faults.busy.append((began, time.monotonic()))
        else:
            self.store.noreplicas(False)
            self.run.faults.noreplicas.append((began, time.monotonic()))
        self.store_fault = None

    def _pg_restore(self) -> None:
        assert self.pg_cut is not None and self.env.proxy is not None
        self.env.proxy.restore()
        self.run.faults.pg_outages.append((self.pg_cut[0], time.monotonic()))
        self.pg_cut = None

    def _kill(self) -> None:
        """SIGKILL a child running a body, aiming at each cell in turn; never a bait, never a job twice."""
        awake = [w for w in self.workers if not w.paused]
        kids = {pid for w in awake for pid in w.children()}
        if not kids:
            return
        running: dict[int, list[tuple[int, int]]] = defaultdict(list)  # cell -> (pid, job) running its bodies
        spared: set[int] = set()
        try:
            for pid, job in self.pg.execute(
                f"SELECT pid, job_id FROM {self.env.tables.executions} WHERE t_end IS NULL AND t_start > %s",
                (time.monotonic() - 60,),
            ):
                if pid not in kids:
                    continue
                if job in self.bait_jobs or job in self.killed_jobs:
                    spared.add(pid)
                else:
                    running[self.plan.jobs[job][0]].append((pid, job))
        except psycopg.Error:
            running.clear()
        n = len(self.plan.cells)
        target: tuple[int, int] | None = None
        for turn in range(n):
            k = (self.kill_turn + turn) % n
            if running.get(k):
                target = self.rng.choice(running[k])
                self.kill_turn = k + 1
                self.kills_by_cell[self.plan.cells[k].name] += 1
                break
        if target is None:
            idle = sorted(kids - spared)
            if not idle:
                return
            target = (self.rng.choice(idle), -1)
        pid, job = target
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed_jobs.add(job)
        self.run.faults.kills.append((pid, time.monotonic()))

    def _pause(self) -> None:
        """Freeze a worker that holds a lease right now (any worker if none does within a second)."""
        deadline = time.monotonic() + 1
        busy: list[Worker] = []
        while True:
            names = holders(self.lock, self.env.LOCK_PREFIX)
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
        """End every fault still in effect: the run is ending."""
        if self.paused:
            self._resume()
        if self.store_fault:
            self._store_fault_end()
        if self.pg_cut:
            self._pg_restore()


# -- reading the run back ---------------------------------------------------------


def read_rows(
    conn: psycopg.Connection[Any], tables: Tables
) -> tuple[list[check.Effect], list[check.Execution], list[tuple[str, int, str, int]]]:
    effects = [
        check.Effect(*r)
        for r in conn.execute(
            f"SELECT seq, job_id, entity, fence, task_id, charge_id, exec_id FROM {tables.effects} ORDER BY seq"
        ).fetchall()
    ]
    executions = [
        check.Execution(*r)
        for r in conn.execute(
            f"SELECT id, job_id, entity, task_id, fence, worker, pid, t_start, t_end, lost_body, lost_release,"
            f" outcome, t_delivered, t_released FROM {tables.executions} ORDER BY id"
        ).fetchall()
    ]
    provider: list[tuple[str, int, str, int]] = [
        (r[0], r[1], r[2], r[3])
        for r in conn.execute(f"SELECT idem_key, job_id, charge_id, calls FROM {tables.provider}")
    ]
    return effects, executions, provider


def read_results(results: redis.Redis, task_ids: set[str]) -> dict[str, tuple[str, str | None]]:
    """The state each task id left in the result backend, and the exception type of a failure."""
    ids = sorted(task_ids)
    out: dict[str, tuple[str, str | None]] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        pipe = results.pipeline(transaction=False)
        for task_id in chunk:
            pipe.get(f"celery-task-meta-{task_id}")
        for task_id, raw in zip(chunk, pipe.execute(), strict=True):
            if raw is None:
                out[task_id] = ("PENDING", None)
                continue
            meta = json.loads(raw)
            result = meta.get("result")
            exc = result.get("exc_type") if meta.get("status") == "FAILURE" and isinstance(result, dict) else None
            out[task_id] = (str(meta.get("status")), exc)
    return out


def event_counts(broker: redis.Redis, key: str) -> Counter[str]:
    """Lock events and deliveries the workers counted: ``event`` and ``event|reason`` -> count."""
    out: Counter[str] = Counter()
    for fieldname, n in broker.hgetall(key).items():
        event, reason = str(fieldname).split("|", 1)
        if event.startswith("@"):
            out[f"{event}|{reason}"] += int(n)  # per task: "@task|event"
            continue
        out[event] += int(n)
        if reason:
            out[f"{event}|{reason}"] += int(n)
    return out


def dump_history(
    log_dir: Path,
    backend: str,
    effects: list[check.Effect],
    executions: list[check.Execution],
    publishes: list[check.Publish],
    faults: check.Faults,
) -> None:
    """Keep the leg's history beside the worker logs (the tables are dropped): what a reduction starts from."""
    for name, rows in (("effects", effects), ("executions", executions), ("publishes", publishes)):
        with open(log_dir / f"{backend}-{name}.jsonl", "w") as out:
            out.writelines(json.dumps(r._asdict()) + "\n" for r in rows)
    (log_dir / f"{backend}-faults.json").write_text(json.dumps(asdict(faults), indent=1))


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Environment:
    """The servers, proxy, tables and workers of one leg; :meth:`close` stops and drops all of it."""

    QUEUE_PREFIX, LOCK_PREFIX, EVENTS_KEY = "chaos-", "chaos", "chaos:events"

    def __init__(
        self,
        opts: Options,
        run_id: str,
        log_dir: Path,
        backend: str = "postgresql",
        cells: list[Cell] | None = None,
    ) -> None:
        self.opts = opts
        self.run_id = run_id
        self.log_dir = log_dir
        self.backend = backend
        self.cells = cells or [DEFAULT_CELL]
        self.tables = Tables(f"chaos_{run_id}")
        self.keys = Keys(self.EVENTS_KEY)
        self.queue = f"{self.QUEUE_PREFIX}{run_id}"
        self.bait_queue = f"{self.queue}-bait"  # served by a worker of its own: baits skip the backlog
        self.servers: list[RedisServer] = []
        self.workers: list[Worker] = []
        self.bait_worker: Worker | None = None
        self.proxy: CutProxy | None = None
        self.created = False

    def start(self) -> Environment:
        opts = self.opts
        self.broker_server = RedisServer().start()  # never restarted: a different server from the lock store
        self.servers.append(self.broker_server)
        self.lock_server = RedisServer(
            persistent=False, extra=["--busy-reply-threshold", str(BUSY_THRESHOLD_MS)]
        ).start()
        self.servers.append(self.lock_server)
        with connect(opts.pg) as conn:
            self.created = True
            for ddl in self.tables.ddl():
                conn.execute(ddl)
            create_fence_table(conn, self.tables.fences)
            PostgresStore(opts.pg, self.tables.completions).create_table(conn)
        store = "redis"
        if self.backend == "postgresql":
            # The completion store goes through a proxy the soak can cut; the ledger stays direct.
            self.proxy = CutProxy.for_dsn(opts.pg).start()
            store = self.proxy.dsn(opts.pg)
        self.cfg = {
            "broker": self.broker_server.url,
            "results": f"redis://127.0.0.1:{self.broker_server.port}/1",
            "lock_url": self.lock_server.url,
            "pg": opts.pg,
            "store": store,
            "tables": self.tables.base,
            "queue": self.queue,
            "prefix": self.LOCK_PREFIX,
            "ttl": opts.ttl,
            "visibility_timeout": opts.visibility_timeout,
            "events_key": self.EVENTS_KEY,
            "cells": [c.to_json() for c in self.cells],
            # The lock Redis is on this host, where replies are waited for: the Redis leg defers them as to a
            # server on another host (_wire.DEFER_NEAR), so both release paths run under the faults.
            "defer_replies": self.backend == "redis",
        }
        self.app = create_app(self.cfg)
        self.claims = redis.Redis.from_url(self.lock_server.url, socket_timeout=1, decode_responses=True)
        print(
            f"chaos {self.run_id} [{self.backend} completion records]: {len(self.cells)} cells,"
            f" {opts.workers} workers x {opts.concurrency}, logs in {self.log_dir}",
            flush=True,
        )
        self.workers = [
            chaos_worker(f"chaos{k}-{self.run_id}", self.cfg, self.log_dir, opts.concurrency, self.app)
            for k in range(opts.workers)
        ]
        # The baits' own worker: they start at once instead of queueing behind the backlog the other
        # workers have prefetched. It is faulted like the others, except that it is never paused.
        self.bait_worker = chaos_worker(
            f"chaosbait-{self.run_id}", self.cfg, self.log_dir, BAIT_CONCURRENCY, self.app, queues=[self.bait_queue]
        )
        wait_ready([*self.workers, self.bait_worker])
        return self

    def events(self) -> Counter[str]:
        return event_counts(self.broker_server.client(), self.keys.events)

    def decisions(self) -> dict[str, list[str]]:
        """Lock events per task id, in order (``event|reason``), as the workers logged them."""
        out: dict[str, list[str]] = {}
        for raw in self.broker_server.client().lrange(self.keys.log, 0, -1):
            task_id, what, _t = json.loads(raw)
            out.setdefault(task_id, []).append(what.rstrip("|"))
        return out

    def deliveries(self) -> tuple[dict[str, float], list[float]]:
        """The first delivery of each task id, and every delivery's start time."""
        first: dict[str, float] = {}
        times: list[float] = []
        for raw in self.broker_server.client().lrange(self.keys.deliveries, 0, -1):
            task_id, t, _redelivered = json.loads(raw)
            times.append(t)
            first[task_id] = min(t, first.get(task_id, t))
        return first, times

    def answered(self) -> int:
        try:
            return int(self.broker_server.client().scard(self.keys.answered))
        except redis.RedisError:
            return 0

    def close(self, keep: bool) -> None:
        """Stop the workers first (they hold PostgreSQL connections), then drop the tables, then the servers."""
        stop_all([*self.workers, *([self.bait_worker] if self.bait_worker else [])])
        if self.proxy is not None:
            self.proxy.close()
        if self.created and not keep:
            with connect(self.opts.pg) as conn:
                conn.execute("SET lock_timeout = '10s'")
                conn.execute(f"DROP TABLE IF EXISTS {', '.join(self.tables.all())}")
        for server in self.servers:
            server.close()


def drive(env: Environment, run: Run, plan: Plan, rng: random.Random) -> FaultLoop:
    """Publish, inject faults, and return once the leg drained (or the drain timed out)."""
    opts = run.opts
    publisher_lock = redis.Redis.from_url(env.lock_server.url, socket_timeout=1, decode_responses=True)
    threading.Thread(target=publish, args=(run, env.app, plan, publisher_lock), name="publisher", daemon=True).start()
    broker = env.broker_server.client()
    total = len(plan.order)
    idle_since: float | None = None
    settle = 2.0
    last_print = 0.0
    last_answered, last_progress = -1, time.monotonic()
    with connect(opts.pg) as pg:
        loop = FaultLoop(run, env, plan, rng, pg)
        try:
            while True:
                if run.error is not None:
                    raise RuntimeError("publishing failed") from run.error
                answered = env.answered() + run.answered_at_publish
                loop.step(answered / total)
                now = time.monotonic()
                if answered != last_answered:
                    last_answered, last_progress = answered, now
                if now - last_print >= (3 if opts.quick else 10):
                    last_print = now
                    f = run.faults
                    print(
                        f"[{now - run.started:6.1f}s] published {run.published}/{total}"
                        f" · answered {answered} · committed {committed(pg, env.tables)}/{len(plan.jobs)}"
                        f" · kills {len(f.kills)} · pauses {len(f.pauses)}{' (paused now)' if loop.paused else ''}"
                        f" · restarts {len(f.restarts)} · busy {len(f.busy)} · noreplicas {len(f.noreplicas)}"
                        f" · pg outages {len(f.pg_outages)}",
                        flush=True,
                    )
                if run.publish_done is not None:
                    # Done when the broker holds nothing (queued or unacknowledged) and no body runs, for a
                    # while, and every fault ran. A body can run with no unacknowledged entry left: the Redis
                    # transport's ack of one copy of a message deletes the entry its redelivered twin shares.
                    idle = broker_backlog(broker, env.queue) == 0 and not running_bodies(pg, env.tables)
                    idle_since = (idle_since or now) if idle else None
                    if idle_since is not None and now - idle_since > settle and not loop.pending():
                        return loop
                    if now - last_progress > opts.drain_timeout:
                        print(f"no publish answered for {opts.drain_timeout:.0f}s: giving up", flush=True)
                        return loop
                time.sleep(0.2)
        finally:
            run.stop.set()
            loop.finish()


_ENTITY = re.compile(r"acct:(\d+)")


def cell_of_key(plan: Plan, name: str) -> int | None:
    """The cell whose entity a lease or claim key names."""
    m = _ENTITY.search(name)
    return plan.cell_of_entity(int(m.group(1))) if m else None


def run_leg(opts: Options, backend: str, rng: random.Random, log_dir: Path) -> dict[str, Any]:
    """One leg: start, drive, check every cell; returns the leg's report (``ok``: every cell passed)."""
    cells, controls = leg_cells(opts, backend)
    run_id = uuid.uuid4().hex[:8]
    env = Environment(opts, run_id, log_dir, backend, cells)
    run = Run(opts, run_id, env.tables)
    observe_publisher(run)
    ok = False
    try:
        env.start()
        plan = make_plan(opts, cells, rng)
        run.started = time.monotonic()
        loop = drive(env, run, plan, rng)
        quiet = time.monotonic()
        lock = env.lock_server.client()
        # Every lease and claim must be gone once the TTL ran out after the last job (drift margin: 1 s).
        while lease_keys(lock, env.LOCK_PREFIX) and time.monotonic() < quiet + opts.ttl + 1:
            time.sleep(0.1)
        leases_left = [describe_key(lock, name) for name in lease_keys(lock, env.LOCK_PREFIX)]
        broker_left = broker_backlog(env.broker_server.client(), env.queue)
        elapsed = time.monotonic() - run.started
        with connect(opts.pg) as pg:
            effects, executions, provider = read_rows(pg, env.tables)
        publishes = [p._replace(claimed=False) if p.task_id in run.unclaimed else p for p in run.publishes]
        ids = {p.task_id for p in publishes} | {p.answered_by for p in publishes if p.answered_by}
        results = read_results(redis.Redis.from_url(env.cfg["results"], decode_responses=True), ids)
        first_delivery, delivery_times = env.deliveries()
        events = env.events()
        decisions = env.decisions()
        verdicts: dict[str, check.Verdict] = {}
        published = {p.job_id for p in publishes}
        for k, cell in enumerate(cells):
            jobs = set(plan.jobs_of(k)) & published
            verdict = check.check_all(
                sorted(jobs),
                [e for e in effects if e.job_id in jobs],
                [x for x in executions if x.job_id in jobs],
                [p for p in provider if p[1] in jobs],
                run.faults,
                opts.ttl,
                [name for name in leases_left if cell_of_key(plan, name) == k],
                publishes=[p for p in publishes if p.job_id in jobs],
                results=results,
                first_delivery=first_delivery,
                mode=cell.mode,
                policy=cell.policy,
                backend=backend,
            )
            check.annotate(verdict, run.task_ids, decisions)
            verdict.info["kills_aimed"] = loop.kills_by_cell[cell.name]
            verdict.info["jobs"] = len(jobs)
            verdicts[cell.name] = verdict
        overall = check.Verdict()
        overall.broker_left = broker_left
        check.check_coverage(
            overall,
            run.faults,
            wanted_faults(opts, backend),
            events["delivery|redelivered"],
            events["lock.skipped_duplicate|redelivery_of_running_original"],
            delivery_times,
            executions,
            killed_mid_body=sum(v.info.get("executions_killed_mid_body", 0) for v in verdicts.values()),
        )
        report = build_report(
            opts=asdict(opts),
            run_id=run_id,
            backend=backend,
            plan={
                "messages": run.published,
                "duplicates": run.published - len(published),
                "slow_jobs": len(plan.slow),
                "baits": len(loop.bait_jobs),
                "jobs": len(published),
            },
            faults=run.faults,
            events=events,
            cells=cells,
            controls={c.cell.name: c.target for c in controls.values()},
            verdicts=verdicts,
            overall=overall,
            elapsed=elapsed,
            proxy_connections=env.proxy.connections if env.proxy is not None else None,
        )
        print(render(report), flush=True)
        ok = report["ok"]
        if not ok:
            dump_history(log_dir, backend, effects, executions, publishes, run.faults)
            with open(log_dir / f"{backend}-events.jsonl", "w") as out:  # lock events and deliveries, timed
                client = env.broker_server.client()
                out.writelines(raw + "\n" for raw in client.lrange(env.keys.log, 0, -1))
                out.writelines(
                    json.dumps([t, "delivery", when, again]) + "\n"
                    for t, when, again in map(json.loads, client.lrange(env.keys.deliveries, 0, -1))
                )
        return report
    finally:
        run.stop.set()
        env.close(keep=opts.keep)
        if opts.keep:
            print(f"kept tables {env.tables.base}_*", flush=True)


def wanted_faults(opts: Options, backend: str) -> dict[str, int]:
    return {
        "sigkill mid-body": int(opts.kill_every > 0),
        "pause": opts.pauses,
        "lock redis restart": opts.restarts,
        "lock redis busy": opts.busy,
        "lock redis noreplicas": opts.noreplicas,
        "pg outage": opts.pg_outages if backend == "postgresql" else 0,
        "redelivery": 1,
        "redelivery while running": int(opts.slow > 0),
    }


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    rng = random.Random(opts.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    reports: list[dict[str, Any]] = []
    ok = False
    started = time.monotonic()
    # Both stop the run the same way, even when started from a shell that ignores SIGINT for background jobs.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for backend in opts.backends:
            reports.append(run_leg(opts, backend, rng, log_dir))
        summary = render_summary(reports, time.monotonic() - started, opts.seed)
        print(summary, flush=True)
        ok = all(r["ok"] for r in reports)
        if opts.report_json:
            Path(opts.report_json).write_text(json.dumps(reports, indent=2, sort_keys=True, default=str))
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("interrupted: stopping everything this run started", flush=True)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ok and not opts.keep:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"kept worker logs and histories in {log_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
