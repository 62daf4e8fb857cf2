"""``python -m chaos.crossings [--quick]``: the soak's cells where two features cross (``make chaos-crossings``).

Real prefork workers (``acks_late``, ``reject_on_worker_lost``) of :mod:`chaos.crossings_app` on RabbitMQ
(``LOCKGUARD_TEST_AMQP_URL``; a private Redis broker without it), one private Redis for leases, results
and history, PostgreSQL for effects, fences and completion records. Three cells run side by side on the
same fleet while a fault thread SIGKILLs pool children in the middle of the debounce and limit cells'
bodies:

* **debounce x park x kills**: each round publishes a burst on an entity, waits for its run to start
  (a 2 s body), then publishes a second burst *during* that run: its pending run parks behind the
  holder and the release wakes it (hand-off). The last publish of each burst must be the one that
  runs, every other publish answer ``superseded`` naming it. Control: the same task without
  ``lock_debounce`` (every publish runs) -- caught by the burst check.
* **workflow x a member's own lock x retry() x a failing chord page**: chains under ``workflow()``
  (``gap_ttl`` 5 s) whose second member waits for its own lock behind a holder with a 6 s TTL, whose
  third retries after Celery's ``default_retry_delay`` (6 s, longer than the gap); and chains with a
  chord whose middle page fails. A plain task on the workflow's entity is published while each runs.
  The first kind must succeed, the second fail visibly with every page's result stored; nothing may run
  inside a workflow. Control: the first kind without ``workflow()`` -- caught by the interleave check.
* **lock_limit x until_done**: ``lock_limit=2`` exports and an ``until_done`` purge (published twice:
  the duplicate is answered at publish) on the same entities. Never more than 2 exports at once, never
  a purge beside anything. Control: a purge without a lease -- caught overlapping.

Every cell: 0 double effects, 0 lost publishes, no lease or claim left once every TTL ran out
(:mod:`chaos.crossings_check`). Exit status 1 on a violation or a control not caught.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery, chain, chord, group
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_lockguard import workflow
from celery_lockguard._completion import PostgresStore
from celery_lockguard.fencing import create_fence_table
from celery_lockguard.testing import RedisServer, Worker, start_all, stop_all

from . import crossings_check as cc
from .crossings_app import PIPELINE, create_app, history_key, tables
from .debounce import Burst, check_burst

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2
#: The workflows' gap: what a hand-over must outlast. Short enough that the retry (``retry_delay``) and the own
#: lock's holder (TTL 6 s) outlast it, long enough that a busy fleet takes the next member within it.
GAP_TTL = 5.0
#: Longest TTL of any lease or claim in the app (``cx.plain`` 5 s); waited out before leftovers are counted.
LONGEST_TTL = 6.0


@dataclass
class Options:
    quick: bool
    rounds: int
    entities: int
    workflows: int
    limit_seconds: float
    kill_every: float
    workers: int
    concurrency: int
    seed: int
    broker: str
    pg: str


def parse(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(prog="python -m chaos.crossings", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the bounded run CI makes (~1 min)")
    p.add_argument("--rounds", type=int, help="debounce cell: rounds of two bursts per entity")
    p.add_argument("--entities", type=int, help="debounce cell: entities, each with its own rounds")
    p.add_argument("--workflows", type=int, help="workflow cell: workflows (half retrying, half failing a page)")
    p.add_argument("--limit-seconds", type=float, help="limit cell: seconds of publishing")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between SIGKILLs of a pool child")
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--broker", default=os.environ.get("LOCKGUARD_TEST_AMQP_URL", "redis"))
    p.add_argument(
        "--pg", default=os.environ.get("LOCKGUARD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test")
    )
    a = p.parse_args(argv)
    return Options(
        quick=a.quick,
        rounds=a.rounds or (2 if a.quick else 10),
        entities=a.entities or (3 if a.quick else 6),
        workflows=a.workflows or (4 if a.quick else 16),
        limit_seconds=a.limit_seconds or (12.0 if a.quick else 90.0),
        kill_every=a.kill_every,
        workers=2,
        concurrency=4,
        seed=a.seed,
        broker=a.broker,
        pg=a.pg,
    )


@dataclass
class Run:
    """What the driver published and what it expects of each publish."""

    app: Celery
    cfg: dict[str, Any]
    rng: random.Random
    history: redis.Redis
    #: cell -> (task id, what the publish was, the final states it may end in)
    publishes: dict[str, list[tuple[str, str, tuple[str, ...]]]] = field(default_factory=dict)
    bursts: dict[str, list[Burst]] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)
    errors: list[str] = field(default_factory=list)

    def expect(self, cell: str, task_id: str, what: str, states: tuple[str, ...] = ("SUCCESS",)) -> None:
        with self.guard:
            self.publishes.setdefault(cell, []).append((task_id, what, states))

    def started(self, task_id: str) -> bool:
        rows = self.history.lrange(history_key(self.cfg["prefix"]), 0, -1)
        return any(json.loads(x)["task_id"] == task_id for x in rows)

    def wait_started(self, task_id: str, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.started(task_id):
                return True
            time.sleep(0.05)
        return False


# -- the cells' drivers ------------------------------------------------------------------------------------


def debounce_cell(run: Run, opts: Options, entity: int, task_name: str, cell: str, rounds: int) -> None:
    """Rounds of two bursts on one entity: the second published while the first burst's run holds the entity."""
    task = run.app.tasks[task_name]
    rng = random.Random(run.rng.random())
    for number in range(rounds):
        first, second = Burst(entity, 2 * number), Burst(entity, 2 * number + 1)
        for b, size, work_s, spacing in ((first, rng.randint(1, 3), 2.0, 0.03), (second, rng.randint(2, 5), 0.3, 0.15)):
            for position in range(size):
                t0 = time.monotonic()
                res = task.delay(entity, b.number, position, work_s)
                b.ids.append(res.id)
                b.times.append((t0, time.monotonic()))
                run.expect(cell, res.id, f"burst {entity}/{b.number} #{position}")
                time.sleep(rng.uniform(0.5, 1.0) * spacing)
            if b is first and not run.wait_started(first.ids[-1]) and cell == "debounce":
                run.errors.append(f"{cell}: burst {entity}/{b.number}'s run never started")
        for b in (first, second):
            for tid in b.ids:
                with contextlib.suppress(CeleryTimeout):
                    run.app.AsyncResult(tid).get(timeout=120, propagate=False)
        with run.guard:
            run.bursts.setdefault(cell, []).extend([first, second])


def workflow_cell(
    run: Run, opts: Options, n: int, tenant: str, cell: str, wrapped: bool = True, delay: float = 0.0
) -> None:
    """One workflow on ``tenant``, ``delay`` seconds in: even ``n`` a chain whose members take their own lock and
    retry, odd ``n`` a chain with a chord whose middle page fails; a plain task on the entity published while it
    runs."""
    time.sleep(delay)
    app, wf = run.app, f"{cell}-w{n:03d}"
    step, kw = app.tasks["cx.step"], {"cell": cell, "tenant": tenant, "wf": wf}
    page_ids: list[str] = []
    if n % 2 == 0:
        invoice = run.rng.randrange(10**9)
        hold = app.tasks["cx.hold"].delay(invoice=invoice, seconds=4.0)
        run.expect(cell, hold.id, f"{wf} holder of invoice {invoice}")
        sig = chain(
            step.s(**kw, step="s1"),
            app.tasks["cx.own_lock"].s(**kw, step="own", invoice=invoice),
            app.tasks["cx.retry_bare"].s(**kw, step="retry"),
            step.s(**kw, step="s4"),
        )
        states: tuple[str, ...] = ("SUCCESS",)
    else:
        page_ids = [uuid.uuid4().hex for _ in range(3)]
        header = group(
            app.tasks["cx.page"].s(**kw, step=f"p{i}", fail=i == 1).set(task_id=page_ids[i]) for i in range(3)
        )
        sig = chain(step.s(**kw, step="s1"), chord(header, app.tasks["cx.collect"].s(**kw, step="collect")))
        states = ("FAILURE",)
    if wrapped:
        res = workflow(
            sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=5, gap_ttl=GAP_TTL, on_locked="retry"
        ).apply_async()
    else:
        res = sig.apply_async()
        states = ("SUCCESS", "FAILURE")
    run.expect(cell, res.id, wf, states)
    for i, pid in enumerate(page_ids):
        run.expect(cell, pid, f"{wf} page p{i}", ("FAILURE",) if i == 1 else ("SUCCESS",))
    time.sleep(0.8 if n % 2 == 0 else 0.3)  # inside the workflow: in the own-lock wait, or among the pages
    plain = app.tasks["cx.plain"].delay(cell=cell, tenant=tenant, job=f"{wf}-plain")
    run.expect(cell, plain.id, f"{wf}'s plain task")
    for tid in (res.id, plain.id, *page_ids):
        with contextlib.suppress(CeleryTimeout):
            app.AsyncResult(tid).get(timeout=120, propagate=False)


def limit_cell(run: Run, opts: Options, seconds: float, partners: list[int], control: int) -> None:
    """Exports (lock_limit=2) and until_done purges on ``partners``; on ``control`` the purge has no lease."""
    app, rng = run.app, random.Random(run.rng.random())
    export, purge, unlocked = app.tasks["cx.export"], app.tasks["cx.purge"], app.tasks["cx.purge_unlocked"]
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        partner = rng.choice(partners)
        res = export.delay(partner, f"e{n}", rng.uniform(0.2, 0.8))
        run.expect("limit", res.id, f"export e{n} on {partner}")
        if n % 6 == 0:
            job = f"purge{n}"
            first = purge.delay(partner, job, 0.4)
            again = purge.delay(partner, job, 0.4)  # identical: answered at publish with the first's result
            run.expect("limit", first.id, f"{job} on {partner}")
            run.expect("limit", again.id, f"{job} on {partner} (duplicate)")
        if n % 10 == 0:  # the control: two exports then a purge with no lease, at once
            for k in range(2):
                ctl = export.delay(control, f"ce{n}-{k}", 1.0, cell="limit-control")
                run.expect("limit-control", ctl.id, f"control export ce{n}-{k}")
            ctl = unlocked.delay(control, f"cpurge{n}", 0.6)
            run.expect("limit-control", ctl.id, f"control purge cpurge{n}")
        n += 1
        time.sleep(rng.uniform(0.15, 0.4))  # below the fleet's pace: a purge waits for every slot to be free


# -- faults --------------------------------------------------------------------------------------------------


def killer(run: Run, opts: Options, stop: threading.Event, kills: list[tuple[int, float]]) -> None:
    """SIGKILL a pool child in the middle of a debounce or limit body (not a control's) now and then."""
    rng = random.Random(run.rng.random())
    killed_jobs: set[str] = set()
    while not stop.wait(opts.kill_every * rng.uniform(0.5, 1.5)):
        rows = [json.loads(x) for x in run.history.lrange(history_key(run.cfg["prefix"]), 0, -1)]
        ended = {(r["task_id"], r["pid"]) for r in rows if r["ev"] == "end"}
        dead = {pid for pid, _ in kills}
        running = [
            r
            for r in rows
            if r["ev"] == "start"
            and r["cell"] in ("debounce", "limit")
            and (r["task_id"], r["pid"]) not in ended
            and r["pid"] not in dead
            and r["job"] not in killed_jobs
            and time.monotonic() - r["t"] > 0.05
        ]
        if not running:
            continue
        victim = rng.choice(running)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append((victim["pid"], time.monotonic()))
        killed_jobs.add(victim["job"])


# -- the run -------------------------------------------------------------------------------------------------


def _pg_setup(dsn: str, prefix: str) -> None:
    t = tables(prefix)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {t['effects']} (cell TEXT, entity TEXT, job TEXT, task_id TEXT, fence BIGINT)")
        create_fence_table(conn, t["fences"])
        PostgresStore(dsn, t["completions"]).create_table(conn)


def _pg_effects(dsn: str, prefix: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(r[0], r[1]) for r in conn.execute(f"SELECT cell, job FROM {tables(prefix)['effects']}")]


def _pg_drop(dsn: str, prefix: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in tables(prefix).values():
            conn.execute(f"DROP TABLE IF EXISTS {name}")


def run_soak(opts: Options) -> int:
    began = time.monotonic()
    rng = random.Random(opts.seed)
    prefix = f"cx{uuid.uuid4().hex[:6]}"
    log_dir = Path(tempfile.mkdtemp(prefix="lockguard-crossings-"))
    kills: list[tuple[int, float]] = []
    with contextlib.ExitStack() as stack:
        locks = stack.enter_context(RedisServer())
        broker = stack.enter_context(RedisServer()).url if opts.broker == "redis" else opts.broker
        cfg = {
            "broker": broker,
            "redis": locks.url,
            "pg": opts.pg,
            "prefix": prefix,
            "queue": f"{prefix}.q",
            "wf_queue": f"{prefix}.wf",
            "debounce": 0.4,
            "retry_delay": 6,
            "visibility_timeout": 30,
        }
        _pg_setup(opts.pg, prefix)
        stack.callback(_pg_drop, opts.pg, prefix)
        app = create_app(cfg)
        history = redis.Redis.from_url(locks.url, decode_responses=True)
        run = Run(app, cfg, rng, history)
        workers = [
            Worker(
                "chaos.crossings_app:app",
                control=app,
                concurrency=opts.concurrency,
                name=f"cx{i}-{uuid.uuid4().hex[:4]}",
                queues=[queue],
                env={"CHAOS_CX_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
                cwd=ROOT,
                log_path=log_dir / f"worker{i}.log",
            )
            for i, queue in enumerate([cfg["queue"]] * opts.workers + [cfg["wf_queue"]])
        ]
        stack.callback(stop_all, workers)
        start_all(workers, 120)
        ready = time.monotonic()
        stop = threading.Event()
        fault = threading.Thread(target=killer, args=(run, opts, stop, kills), daemon=True)
        fault.start()
        drivers: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (debounce_cell, (run, opts, e, "cx.debounced", "debounce", opts.rounds)) for e in range(opts.entities)
        ]
        drivers.append((debounce_cell, (run, opts, 900, "cx.undebounced", "debounce-control", 1)))
        tenants = max(2, opts.workflows // 2)
        for n in range(opts.workflows):
            drivers.append((workflow_cell, (run, opts, n, f"t{n % tenants}-{prefix}", "workflow", True, n * 1.5)))
        drivers.append((workflow_cell, (run, opts, 0, f"ctl-{prefix}", "workflow-control", False, 0.0)))
        drivers.append((limit_cell, (run, opts, opts.limit_seconds, [1, 2], 99)))
        threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in drivers]
        # a tenant's workflows run one after the other (each waits for the one before): start them in order
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=600)
        stop.set()
        fault.join(timeout=30)
        ids = {tid for pubs in run.publishes.values() for tid, _, _ in pubs}
        settle = time.monotonic() + (120 if opts.quick else 300)
        while time.monotonic() < settle and not all(app.AsyncResult(t).ready() for t in ids):
            time.sleep(0.5)
        states: dict[str, tuple[str, Any]] = {}
        for tid in ids:
            res = app.AsyncResult(tid)
            states[tid] = (res.state, res.result if res.state == "SUCCESS" else None)
        deadline = time.monotonic() + LONGEST_TTL + 5
        pattern = f"{prefix}:v1:*"

        def leftovers() -> list[str]:
            return sorted(k for k in history.scan_iter(pattern) if k.endswith((":lock", ":claim")) or ":lock:" in k)

        while time.monotonic() < deadline and leftovers():
            time.sleep(0.25)
        left = leftovers()
        rows = [json.loads(x) for x in history.lrange(history_key(prefix), 0, -1)]
        effects = _pg_effects(opts.pg, prefix)
        if opts.broker != "redis":
            from kombu import Connection

            with Connection(opts.broker) as conn:
                conn.default_channel.queue_delete(cfg["queue"])
    return report(opts, run, rows, effects, states, left, kills, time.monotonic() - began, ready - began, log_dir)


def report(
    opts: Options,
    run: Run,
    rows: list[dict[str, Any]],
    effects: list[tuple[str, str]],
    states: dict[str, tuple[str, Any]],
    left: list[str],
    kills: list[tuple[int, float]],
    elapsed: float,
    startup: float,
    log_dir: Path,
) -> int:
    spans, unended = cc.executions(rows, kills)
    lines = [line for log in log_dir.glob("*.log") for line in log.read_text(errors="replace").splitlines()]
    parks = sum(1 for x in lines if "lock.waiting task_name=cx.debounced" in x and "policy=park" in x)
    woken = sum(1 for x in lines if "task_name=cx.debounced" in x and "reason=woken_copy_runs" in x)
    cells = ("debounce", "workflow", "limit")
    found = {c: cc.CellFindings() for c in (*cells, "debounce-control", "workflow-control", "limit-control")}
    for where, problem in (x.split(": ", 1) for x in run.errors):
        found[where].add("lost", problem)
    for cell, f in found.items():
        mine = [e for e in spans if e.cell == cell]
        for d in cc.duplicate_effects(x for x in effects if x[0] == cell):
            f.add("dup", d)
        for tid, what, allowed in run.publishes.get(cell, []):
            state = states.get(tid, ("PENDING", None))[0]
            if state not in allowed:
                f.add("lost", f"{what} ({tid}) ended {state}, expected {'/'.join(allowed)}")
        if cell.startswith("debounce"):
            for v in cc.exclusive_violations(mine):
                f.add("ovl", v)
            results = {tid: res for tid, (_, res) in states.items()}
            ran = [e.task_id for e in mine]
            killed_ids = {e.task_id for e in mine if e.killed}
            bursts = run.bursts.get(cell, [])
            for b in bursts:
                later = {t for o in bursts if o.entity == b.entity and o.number > b.number for t in o.ids}
                problems = check_burst(b, results, ran, 0.4)
                if problems and cc.covered_after_a_kill(b.ids[-1], results, set(ran), killed_ids, later):
                    f.covered += 1
                    continue
                for p in problems:
                    f.add("burst", p)
        elif cell.startswith("workflow"):
            for v in cc.workflow_violations(mine):
                f.add("ovl", v)
        else:
            for v in cc.limit_violations(mine, LIMIT):
                f.add("ovl", v)
        for u in unended:
            if u.startswith(f"{cell} "):
                f.add("unend", u)
    for k in left:
        found["limit" if "partner:" in k else "workflow" if "cxt:" in k or "cxi:" in k else "debounce"].add("lease", k)
    caught = {
        "debounce-control (burst)": found["debounce-control"].counts["burst"] > 0,
        "workflow-control (ovl)": found["workflow-control"].counts["ovl"] > 0,
        "limit-control (ovl)": found["limit-control"].counts["ovl"] > 0,
    }
    print(
        f"crossings soak (seed {opts.seed}, broker {'redis' if opts.broker == 'redis' else 'rabbitmq'}): "
        f"{elapsed:.0f} s ({startup:.0f} s worker start), {len(kills)} children killed mid-body"
    )
    for cell in cells:
        pubs = run.publishes.get(cell, [])
        bodies = len([e for e in spans if e.cell == cell])
        counts = found[cell].counts
        summary = " ".join(f"{k}={counts[k]}" for k in ("dup", "lost", "ovl", "burst", "lease", "unend"))
        killed = sum(1 for e in spans if e.cell == cell and e.killed)
        extra = f", {killed} killed mid-body"
        if cell == "debounce":
            n = len(run.bursts.get(cell, []))
            extra += f", {n} bursts ({found[cell].covered} covered by a later run after a kill)"
            extra += f", {parks} runs parked, {woken} woken by a release (their safety copy dropped)"
        print(f"  {cell:9s} publishes {len(pubs):4d}, bodies {bodies:4d}, effects "
              f"{sum(1 for x in effects if x[0] == cell):4d}{extra}: {summary}")  # fmt: skip
        for ex in found[cell].examples:
            print(f"      {ex}")
    for name, ok in caught.items():
        cell = name.split(" ")[0]
        print(f"  control {name}: {'caught' if ok else 'NOT CAUGHT'} ({dict(found[cell].counts)})")
    ok = all(found[c].ok for c in cells) and all(caught.values())
    print("OK" if ok else f"FAILED (worker logs in {log_dir})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run_soak(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
