"""The Sentinel failover leg of the soak: ``python -m chaos.failover [--quick]`` (``make chaos-failover``).

Real prefork workers run the soak's money-moving task (:mod:`chaos.app`:
``acks_late``, a checkpointed provider call, then one PostgreSQL transaction
with ``advance_fence``, the effect and the completion record) against a lock
Redis that is a private Sentinel-managed master (``lockguard_sentinels``;
:class:`tests.topologies.SentinelSet`: a master, one replica, three
sentinels on loopback). Jobs are published at a steady pace while the driver
fails the master over again and again:

* **lossy** (most of them): the replica is frozen (SIGSTOP) and its link is
  cut (``CLIENT KILL TYPE replica``), so nothing written from then on reaches
  it; a *bait* job (a long body on an entity of its own) takes its lease on
  the master -- a lease that is never replicated -- and makes its provider
  call; then the master is SIGKILLed, the replica woken and promoted by the
  sentinels. The bait's lease is gone on the new master (the leg checks it):
  a *follower* job on the same entity takes it there with a higher fence and
  commits while the bait's body is still running. The bait's write is then
  refused (``StaleFence``: the job is retried and commits once, under a new
  lease) -- or, in the ``no-fence`` control, it commits a stale effect the
  ledger shows as a fence regression. The killed server is
  started again as a replica of the new master, ready for the next round.
* **graceful**: ``SENTINEL FAILOVER`` with the replica in sync (replicated
  leases survive; the client must follow).

Checked with :func:`chaos.check.check_all` against the PostgreSQL ledger, per
cell: ``while_running/retry`` (must hold every invariant: no double effect,
no lost job, no fence regression, no overlap a failover does not explain)
and the same cell with ``no-fence`` (the control: the check must count a
stale write or a double effect, else the failover window is too gentle).
Exits 1 on any violation, an uncaught control, a lossy failover that lost
no lease, or a lost lease its holder was not told about.
"""

from __future__ import annotations

import argparse
import json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_lockguard import create_fence_table
from celery_lockguard._completion import PostgresStore
from celery_lockguard._keys import lock_name
from celery_lockguard.testing import RedisServer
from tests.harness import wait_for
from tests.topologies import SentinelSet

from . import check
from .app import Cell, Keys, Tables, connect, create_app
from .fleet import Worker, chaos_worker, stop_all, wait_ready
from .soak import default_pg, read_results, read_rows

PREFIX = "chaosfo"
EVENTS_KEY = "chaosfo:events"
SAFE = Cell(mode="while_running", policy="retry")
CONTROL = Cell(mode="while_running", policy="retry", unsafe="no-fence")
CELLS = (SAFE, CONTROL)
#: Per cell, entities [k * SPAN, k * SPAN + entities) for the steady jobs, and k * SPAN + BAIT + i for failover i.
SPAN, BAIT = 10_000, 5_000


@dataclass
class Options:
    jobs: int  # steady jobs per cell
    failovers: int
    graceful_every: int  # every n-th failover is a SENTINEL FAILOVER (0: none)
    duration: float  # seconds over which the steady jobs are published
    entities: int
    hold: float  # seconds of a bait's body before and after its provider call
    ttl: float
    workers: int
    concurrency: int
    seed: int
    pg: str
    keep: bool
    report_json: str | None


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m chaos.failover", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the bounded run CI makes (~2 minutes)")
    p.add_argument("--jobs", type=int, help="steady jobs per cell (quick: 60, else 400)")
    p.add_argument("--failovers", type=int, help="quick: 4, else 10")
    p.add_argument("--graceful-every", type=int, default=3, help="every n-th failover is SENTINEL FAILOVER")
    p.add_argument(
        "--hold",
        type=float,
        default=5.0,
        help="a bait's half body in seconds: must outlast the promotion (~2.5 s) and the follower's commit",
    )
    p.add_argument("--ttl", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--pg", default=default_pg())
    p.add_argument("--keep", action="store_true", help="keep the tables and logs")
    p.add_argument("--report-json")
    a = p.parse_args(argv)
    failovers = a.failovers or (4 if a.quick else 10)
    return Options(
        jobs=a.jobs or (60 if a.quick else 400),
        failovers=failovers,
        graceful_every=a.graceful_every,
        duration=0.0,  # set from the failovers' schedule
        # Three per cell in the quick run; with more jobs, one per 20 (the retry policy serialises an entity).
        entities=max(3, (a.jobs or (60 if a.quick else 400)) // 20),
        hold=a.hold,
        ttl=a.ttl,
        workers=a.workers,
        concurrency=a.concurrency,
        seed=a.seed,
        pg=a.pg,
        keep=a.keep,
        report_json=a.report_json,
    )


@dataclass
class Failover:
    """One failover the driver made, on the monotonic clock."""

    kind: str  # "lossy" or "graceful"
    started: float
    killed: float = 0.0  # lossy: when the master was SIGKILLed
    promoted: float = 0.0
    ready: float = 0.0  # the old master replicates the new one again
    old_port: int = 0
    new_port: int = 0
    baits: list[int] = field(default_factory=list)  # job ids
    unreplicated: int = 0  # bait leases on the master, absent on the replica, when the master was killed
    lost: int = 0  # of those, absent on the promoted master
    leases_on_master: int = 0  # every lease the master held when it was killed


@dataclass
class Run:
    opts: Options
    app: Any
    run_id: str
    jobs: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # job -> (cell index, entity, work ms)
    publishes: list[check.Publish] = field(default_factory=list)
    failovers: list[Failover] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def send(self, k: int, entity: int, work_ms: int, queue: str | None = None) -> int:
        """Publish one job of cell ``k`` under a fresh task id; returns its job id."""
        with self.lock:
            job = len(self.jobs)
            self.jobs[job] = (k, entity, work_ms)
        task_id = f"{self.run_id}-{job}"
        t_sent = time.monotonic()
        try:
            options = {"queue": queue} if queue else {}
            self.app.tasks[CELLS[k].task_name].apply_async((job, entity, work_ms), task_id=task_id, **options)
            outcome = "enqueued"
        except Exception as exc:  # noqa: BLE001 - a publish that raises is recorded (and counted by the check)
            outcome = f"raised:{exc.__class__.__name__}"
        with self.lock:
            self.publishes.append(check.Publish(job, task_id, t_sent, time.monotonic(), outcome))
        return job


def publish_steady(run: Run, rng: random.Random) -> None:
    """The steady load: ``jobs`` per cell, interleaved, paced over ``duration``, short bodies."""
    opts = run.opts
    order = [k for k in range(len(CELLS)) for _ in range(opts.jobs)]
    rng.shuffle(order)
    pace = opts.duration / max(1, len(order))
    t0 = time.monotonic()
    try:
        for i, k in enumerate(order):
            if run.stop.is_set():
                return
            run.send(k, k * SPAN + rng.randrange(opts.entities), rng.randint(20, 300))
            ahead = t0 + (i + 1) * pace - time.monotonic()
            if ahead > 0:
                run.stop.wait(ahead)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        run.error = exc


def promoted(sset: SentinelSet, port: int) -> bool:
    """Every sentinel names ``port`` as the master and that server says it is one."""
    try:
        if any(sset.master_port(i) != port for i in range(len(sset.sentinel_ports))):
            return False
        role = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).role()
        return bool(role[0] in (b"master", "master"))
    except redis.RedisError:
        return False


def replica_ready(sset: SentinelSet) -> bool:
    """The replica is linked, acknowledges writes, and every sentinel lists it as a healthy replica."""
    try:
        if sset.replica.client(socket_timeout=1).info("replication").get("master_link_status") != "up":
            return False
        if int(sset.master.client(socket_timeout=2).execute_command("WAIT", 1, 200)) < 1:
            return False
        for i in range(len(sset.sentinel_ports)):
            replicas = sset.sentinel_client(i).sentinel_slaves(sset.NAME)
            mine = [r for r in replicas if int(r["port"]) == sset.replica.port]
            if not mine or any(f in mine[0]["flags"] for f in ("s_down", "o_down", "disconnected")):
                return False
        return True
    except redis.RedisError:
        return False


def _as_replica_of(server: RedisServer, port: int) -> None:
    """Drop any ``--replicaof`` from the server's arguments and make it a replica of ``port``."""
    extra, out, i = server.extra, [], 0
    while i < len(extra):
        if extra[i] == "--replicaof":
            i += 3
            continue
        out.append(extra[i])
        i += 1
    server.extra[:] = [*out, "--replicaof", "127.0.0.1", str(port)]


def bait_leases(client: redis.Redis, run: Run, jobs: list[int]) -> dict[int, str | None]:
    """The token each bait's entity lease has on ``client``'s server (``None``: no lease there)."""
    out: dict[int, str | None] = {}
    for job in jobs:
        _k, entity, _ms = run.jobs[job]
        token = client.hget(lock_name(PREFIX, f"acct:{entity}"), "token")
        out[job] = token.decode() if isinstance(token, bytes) else token
    return out


def lossy_failover(run: Run, sset: SentinelSet, env: Env, n: int) -> Failover:
    """Freeze and cut the replica, let baits take unreplicated leases, kill the master, promote the replica."""
    opts = run.opts
    master, replica = sset.master, sset.replica
    assert replica.proc is not None and master.proc is not None
    fo = Failover("lossy", time.monotonic(), old_port=master.port, new_port=replica.port)
    replica.proc.send_signal(signal.SIGSTOP)
    master.client(socket_timeout=2).execute_command("CLIENT", "KILL", "TYPE", "replica")
    work_ms = int(opts.hold * 2000)
    fo.baits = [run.send(k, k * SPAN + BAIT + n, work_ms, env.bait_queue) for k in range(len(CELLS))]
    try:
        # The baits made their provider call (their lease is held and renewed on the master alone).
        wait_for(
            lambda: env.checkpointed(fo.baits) and all(bait_leases(master.client(), run, fo.baits).values()),
            60,
            interval=0.05,
            what="the baits' provider calls under an unreplicated lease",
        )
        fo.leases_on_master = len(list(master.client().scan_iter(match=f"{PREFIX}:v1:*:lock", count=1000)))
        before = bait_leases(master.client(), run, fo.baits)
        fo.unreplicated = sum(1 for t in before.values() if t)
    finally:
        master.stop()  # SIGKILL: the only copy of those leases dies with it
        fo.killed = time.monotonic()
        replica.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: promoted(sset, replica.port), 90, interval=0.1, what=f"failover {n}: the promotion")
    fo.promoted = time.monotonic()
    after = bait_leases(replica.client(), run, fo.baits)
    fo.lost = sum(1 for job, t in before.items() if t and after.get(job) != t)
    # A follower on each bait's entity takes the entity on the new master while the bait's body still runs.
    for job in fo.baits:
        k, entity, _ms = run.jobs[job]
        run.send(k, entity, 50, env.bait_queue)
    _as_replica_of(master, replica.port)
    master.start(timeout=30)
    sset.master, sset.replica = replica, master
    wait_for(lambda: replica_ready(sset), 90, interval=0.1, what=f"failover {n}: the old master to rejoin")
    fo.ready = time.monotonic()
    return fo


def graceful_failover(run: Run, sset: SentinelSet, n: int) -> Failover:
    """``SENTINEL FAILOVER`` with the replica in sync: nothing is lost, the clients must follow."""
    fo = Failover("graceful", time.monotonic(), old_port=sset.master.port, new_port=sset.replica.port)
    sset.sentinel_client().execute_command("SENTINEL", "FAILOVER", sset.NAME)
    wait_for(lambda: promoted(sset, fo.new_port), 90, interval=0.1, what=f"failover {n}: the promotion")
    fo.promoted = time.monotonic()
    sset.master, sset.replica = sset.replica, sset.master
    wait_for(lambda: replica_ready(sset), 90, interval=0.1, what=f"failover {n}: the old master to rejoin")
    fo.ready = time.monotonic()
    return fo


class Env:
    """The leg's servers, tables and workers; :meth:`close` stops and drops all of it."""

    def __init__(self, opts: Options, run_id: str, log_dir: Path) -> None:
        self.opts = opts
        self.run_id = run_id
        self.log_dir = log_dir
        self.tables = Tables(f"chaosfo_{run_id}")
        self.keys = Keys(EVENTS_KEY)
        self.sset = SentinelSet(down_after_ms=1000)
        self.broker = RedisServer()
        self.workers: list[Worker] = []
        self.bait_queue = f"chaosfo-{run_id}-bait"
        self.created = False
        self._pg: Any = None

    def start(self) -> Env:
        self.sset.start()
        self.broker.start()
        with connect(self.opts.pg) as conn:
            self.created = True
            for ddl in self.tables.ddl():
                conn.execute(ddl)
            create_fence_table(conn, self.tables.fences)
            PostgresStore(self.opts.pg, self.tables.completions).create_table(conn)
        self.cfg: dict[str, Any] = {
            "broker": self.broker.url,
            "results": f"redis://127.0.0.1:{self.broker.port}/1",
            "lock_url": None,
            "sentinels": self.sset.sentinels,
            "sentinel_master": self.sset.NAME,
            "pg": self.opts.pg,
            "store": self.opts.pg,
            "tables": self.tables.base,
            "queue": f"chaosfo-{self.run_id}",
            "prefix": PREFIX,
            "ttl": self.opts.ttl,
            # Longer than any body (a bait's is 2 x hold): a redelivery here would be noise, not the failover.
            "visibility_timeout": max(30.0, 4 * self.opts.hold + 10),
            "events_key": EVENTS_KEY,
            "cells": [c.to_json() for c in CELLS],
        }
        self.app = create_app(self.cfg)
        self.workers = [
            chaos_worker(f"chaosfo{k}-{self.run_id}", self.cfg, self.log_dir, self.opts.concurrency, self.app)
            for k in range(self.opts.workers)
        ]
        # Baits and followers have a worker of their own: the failover's timing (the bait's provider call
        # before the kill, the follower's commit before the bait's) must not wait behind the steady backlog.
        self.workers.append(
            chaos_worker(f"chaosfobait-{self.run_id}", self.cfg, self.log_dir, 3, self.app, queues=[self.bait_queue])
        )
        wait_ready(self.workers, timeout=120)
        self._pg = connect(self.opts.pg)
        return self

    def checkpointed(self, jobs: list[int]) -> bool:
        rows = self._pg.execute(
            f"SELECT count(DISTINCT job_id) FROM {self.tables.provider} WHERE job_id = ANY(%s)", (jobs,)
        ).fetchone()
        return bool(rows and int(rows[0]) == len(jobs))

    def close(self, keep: bool) -> None:
        stop_all(self.workers)
        if self._pg is not None:
            self._pg.close()
        if self.created and not keep:
            with connect(self.opts.pg) as conn:
                conn.execute("SET lock_timeout = '10s'")
                conn.execute(f"DROP TABLE IF EXISTS {', '.join(self.tables.all())}")
        self.sset.close()
        self.broker.close()


def drive(run: Run, env: Env, rng: random.Random) -> None:
    """Publish the steady load in a thread while the failovers run one after the other."""
    opts = run.opts
    publisher = threading.Thread(target=publish_steady, args=(run, rng), daemon=True)
    publisher.start()
    # Failover n starts at n / failovers of the publishing time, and at least two calm seconds (leases taken
    # then are replicated) after the previous one: the failovers span the load instead of its first part.
    t0, slot, gap = time.monotonic(), opts.duration / max(1, opts.failovers), 2.0
    for n in range(opts.failovers):
        if run.stop.wait(max(gap, t0 + n * slot - time.monotonic())) or run.error:
            break
        graceful = opts.graceful_every > 0 and n % opts.graceful_every == opts.graceful_every - 1
        fo = graceful_failover(run, env.sset, n) if graceful else lossy_failover(run, env.sset, env, n)
        run.failovers.append(fo)
        print(
            f"[failover] {n + 1}/{opts.failovers} {fo.kind}: {fo.old_port} -> {fo.new_port}, promoted"
            f" {fo.promoted - (fo.killed or fo.started):.1f} s after the {'kill' if fo.killed else 'command'},"
            f" rejoined {fo.ready - fo.promoted:.1f} s later"
            + (f"; bait leases unreplicated {fo.unreplicated}, lost {fo.lost}" if fo.kind == "lossy" else ""),
            flush=True,
        )
    publisher.join()


def settle(run: Run, env: Env, timeout: float) -> dict[str, tuple[str, str | None]]:
    """Wait (bounded) until every published task id has a final state in the result backend."""
    results_client = redis.Redis.from_url(env.cfg["results"], decode_responses=True)
    ids = {p.task_id for p in run.publishes}
    deadline, said = time.monotonic() + timeout, time.monotonic()
    while True:
        results = read_results(results_client, ids)
        pending = [t for t, (state, _) in results.items() if state not in check.TERMINAL]
        if not pending or time.monotonic() > deadline:
            return results
        if time.monotonic() - said > 15:
            said = time.monotonic()
            print(f"[failover] waiting for {len(pending)} of {len(ids)} jobs to settle", flush=True)
        time.sleep(0.5)


def run_leg(opts: Options, log_dir: Path) -> dict[str, Any]:
    """Start, drive, settle and check the leg; returns its report (``ok``: everything held)."""
    rng = random.Random(opts.seed)
    run_id = uuid.uuid4().hex[:8]
    env = Env(opts, run_id, log_dir)
    started = time.monotonic()
    try:
        env.start()
        # Publishing spans the failovers: a lossy one takes about hold + 5 s (the bait's first half, the
        # promotion, the rejoin), a graceful one about 12 s (the sentinels reconfigure the old master).
        opts.duration = opts.failovers * (opts.hold + 8)
        run = Run(opts, env.app, run_id)
        print(
            f"chaos failover {run_id}: {len(CELLS)} cells x {opts.jobs} jobs, {opts.failovers} failovers,"
            f" {opts.workers} workers x {opts.concurrency}, logs in {log_dir}",
            flush=True,
        )
        t_load = time.monotonic()
        try:
            drive(run, env, rng)
        finally:
            run.stop.set()
        if run.error is not None:
            raise run.error
        results = settle(run, env, timeout=240)
        quiet = time.monotonic()
        master = env.sset.master.client()
        while list(master.scan_iter(match=f"{PREFIX}:v1:*:lock")) and time.monotonic() < quiet + opts.ttl + 1:
            time.sleep(0.1)
        leases_left = [str(k) for k in master.scan_iter(match=f"{PREFIX}:v1:*:lock", count=1000)]
        elapsed = time.monotonic() - t_load
        with connect(opts.pg) as pg:
            effects, executions, provider = read_rows(pg, env.tables)
        faults = check.Faults(restarts=[(f.started, f.promoted) for f in run.failovers if f.kind == "lossy"])
        cells: dict[str, Any] = {}
        for k, cell in enumerate(CELLS):
            jobs = {j for j, (c, _, _) in run.jobs.items() if c == k}
            verdict = check.check_all(
                sorted(jobs),
                [e for e in effects if e.job_id in jobs],
                [x for x in executions if x.job_id in jobs],
                [p for p in provider if p[1] in jobs],
                faults,
                opts.ttl,
                [name for name in leases_left if _cell_of_key(name) == k],
                publishes=[p for p in run.publishes if p.job_id in jobs],
                results=results,
                mode=cell.mode,
                policy=cell.policy,
                backend="postgresql",
            )
            outcomes = Counter((x.outcome or "killed").split(":")[0] for x in executions if x.job_id in jobs)
            stale_writes = verdict.fence_regressions
            cells[cell.name] = {
                "control": cell.unsafe or None,
                "jobs": len(jobs),
                "effects": verdict.info.get("effects"),
                "double_effects": verdict.duplicate_effects,
                "lost_jobs": verdict.lost_jobs,
                "unanswered": verdict.unanswered,
                "stale_writes": stale_writes,
                "stale_fence_refusals": outcomes.get("stale_fence", 0),
                "violations": verdict.violated(),
                "caught": (stale_writes + verdict.duplicate_effects > 0) if cell.unsafe else None,
                "ok": (stale_writes + verdict.duplicate_effects > 0) if cell.unsafe else verdict.ok,
                "examples": {n: v[:2] for n, v in verdict.examples.items()},
                "outcomes": dict(outcomes),
            }
        lossy = [f for f in run.failovers if f.kind == "lossy"]
        baits = {job for f in lossy for job in f.baits}
        # The library told the bait its lease was gone (the renewer found its token missing on the new master).
        told = {x.job_id for x in executions if x.job_id in baits and (x.lost_body or x.lost_release)}
        report = {
            "run_id": run_id,
            "seed": opts.seed,
            "failovers": len(run.failovers),
            "lossy": len(lossy),
            "graceful": len(run.failovers) - len(lossy),
            "wanted_failovers": opts.failovers,
            "leases_unreplicated": sum(f.unreplicated for f in lossy),
            "leases_lost": sum(f.lost for f in lossy),
            "baits_told_lost": len(told),
            "leases_on_master_at_kill": sum(f.leases_on_master for f in lossy),
            # Seconds from the kill (lossy) or the SENTINEL FAILOVER command (graceful) to every sentinel naming
            # the new master; a lossy failover's window (cut to promotion) is the hold longer.
            "promotion_s": [round(f.promoted - (f.killed or f.started), 1) for f in run.failovers],
            "window_s": [round(f.promoted - f.started, 1) for f in lossy],
            "published": len(run.publishes),
            "elapsed_s": round(elapsed, 1),
            "total_s": round(time.monotonic() - started, 1),
            "cells": cells,
        }
        report["ok"] = (
            all(c["ok"] for c in cells.values())
            and len(run.failovers) == opts.failovers
            and all(f.lost > 0 for f in lossy)
            and report["baits_told_lost"] == report["leases_lost"]
        )
        print(render(report), flush=True)
        if not report["ok"]:
            (log_dir / "failover-report.json").write_text(json.dumps(report, indent=1, default=str))
        return report
    finally:
        env.close(keep=opts.keep)


def _cell_of_key(name: str) -> int | None:
    """The cell of a lease key ``<prefix>:v1:acct:<entity>:lock`` (``None``: not one of the leg's)."""
    try:
        entity = int(name.split("acct:", 1)[1].split("}", 1)[0])
    except (IndexError, ValueError):
        return None
    return entity // SPAN


def render(report: dict[str, Any]) -> str:
    lines = [
        f"failover leg {report['run_id']} (seed {report['seed']}): {report['failovers']} failovers"
        f" ({report['lossy']} lossy, {report['graceful']} graceful), {report['published']} jobs published,"
        f" {report['elapsed_s']} s under load ({report['total_s']} s in all)",
        f"  leases never replicated when the master was killed: {report['leases_unreplicated']} baits"
        f" (of {report['leases_on_master_at_kill']} leases on the master), lost on the new master:"
        f" {report['leases_lost']}, reported lost to their holder: {report['baits_told_lost']}",
        f"  promotion took {report['promotion_s']} s after the kill/command, replica cut off for"
        f" {report['window_s']} s",
    ]
    for name, c in report["cells"].items():
        verdict = (
            ("caught" if c["caught"] else "NOT CAUGHT")
            if c["control"]
            else ("OK" if c["ok"] else f"VIOLATED {c['violations']}")
        )
        lines.append(
            f"  {name:<28} jobs {c['jobs']:>4}  effects {c['effects']:>4}  double {c['double_effects']}"
            f"  lost {c['lost_jobs']}  unanswered {c['unanswered']}  stale writes {c['stale_writes']}"
            f"  StaleFence refusals {c['stale_fence_refusals']}  {verdict}"
        )
        if not c["ok"]:
            lines.append(f"    examples: {json.dumps(c['examples'], default=str)[:1500]}")
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-failover-"))
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    ok = False
    try:
        report = run_leg(opts, log_dir)
        ok = bool(report["ok"])
        if opts.report_json:
            Path(opts.report_json).write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
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
            print(f"kept worker logs in {log_dir}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
