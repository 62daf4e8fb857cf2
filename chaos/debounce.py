"""The debounce soak: ``python -m chaos.debounce [--quick]`` (``make chaos-debounce``).

Real prefork workers (``acks_late``, a short ``visibility_timeout``) run a
``lock_debounce`` task while the driver publishes rounds of bursts -- one
burst per entity per round, interleaved across entities, each publish
carrying its position in the burst -- and a fault thread SIGKILLs whole
workers (main process and children: the ETA messages they hold go back to
the broker only through redelivery) and starts them again.

The invariant, per burst (:func:`check_burst`, pure, unit-tested):

* exactly one task id of the burst ran a body, the burst's last publish, with
  its arguments (a body that a kill cut short may start again *under that
  same task id*: the lease and the completion record handle that, not
  debounce);
* every other publish of the burst answered "superseded", and following
  ``superseded_by`` from it ends at that run.

A round waits for every burst's run before the next round publishes on the
same entities, so the driver's bursts are the runtime's bursts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_lockguard import LockedTask
from celery_lockguard.testing import RedisServer, Worker, start_all, stop_all

ROOT = Path(__file__).resolve().parent.parent
TASK = "chaos.debounced"


def create_app(cfg: dict[str, Any]) -> Celery:
    """The app the workers run and the driver publishes with (configured by ``CHAOS_DEBOUNCE_CONFIG``)."""
    app = Celery("chaos_debounce", broker=cfg["broker"], backend=cfg["locks"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["locks"],
        lockguard_key_prefix=cfg["prefix"],
        broker_transport_options={
            "visibility_timeout": cfg["visibility_timeout"],
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        worker_prefetch_multiplier=4,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
        worker_hijack_root_logger=False,
    )
    history = redis.Redis.from_url(cfg["locks"], decode_responses=True)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name=TASK,
        lock_key="doc:{entity}",
        lock_debounce=cfg["debounce"],
        lock_ttl=5,
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def debounced(self: Any, entity: int, burst: int, position: int, work_ms: int) -> dict[str, int]:
        history.rpush(
            f"{cfg['prefix']}:ran", json.dumps({"task_id": self.request.id, "entity": entity, "burst": burst})
        )
        time.sleep(work_ms / 1000)
        return {"entity": entity, "burst": burst, "position": position}

    return app


app = create_app(json.loads(os.environ["CHAOS_DEBOUNCE_CONFIG"])) if "CHAOS_DEBOUNCE_CONFIG" in os.environ else None


@dataclass
class Burst:
    """One burst the driver published: its task ids in publish order."""

    entity: int
    number: int
    ids: list[str] = field(default_factory=list)
    #: (monotonic start, end) of each publish call: where the driver itself stalled a whole delay between two
    #: publishes, the library may rightly split the burst there (the earlier message fell due and was taken).
    times: list[tuple[float, float]] = field(default_factory=list)

    def split_possible(self, delay: float) -> bool:
        """Whether some publish ended ``delay`` or more after the previous one started (a stalled driver)."""
        return any(b[1] - a[0] >= delay for a, b in zip(self.times, self.times[1:], strict=False))


def check_burst(burst: Burst, results: dict[str, Any], ran: list[str], delay: float = 0.0) -> list[str]:
    """What is wrong with one burst (empty: it kept the promise).

    ``results`` maps task id to its stored result; ``ran`` lists the task ids
    whose body started (a task id more than once after a kill is not debounce's concern).
    A burst the driver stalled in for a whole ``delay`` (:meth:`Burst.split_possible`) may rightly be
    two bursts to the library: then an earlier publish may run too, and each earlier publish must
    have run or be answered by a chain of runs ending at one that ran; the last must still run.
    """
    problems = []
    last = burst.ids[-1]
    mine = set(burst.ids)
    bodies = {tid for tid in ran if tid in mine}
    split = delay > 0 and burst.split_possible(delay)
    if bodies != {last} and not (split and last in bodies):
        problems.append(f"burst {burst.entity}/{burst.number}: bodies ran for {sorted(bodies)}, expected only {last}")
    want = {"entity": burst.entity, "burst": burst.number, "position": len(burst.ids) - 1}
    if results.get(last) != want:
        problems.append(f"burst {burst.entity}/{burst.number}: the run answered {results.get(last)!r}, not {want}")
    for tid in burst.ids[:-1]:
        seen, value = [tid], results.get(tid)
        while isinstance(value, dict) and value.get("lockguard") == "superseded" and len(seen) <= len(burst.ids):
            seen.append(value["superseded_by"])
            value = results.get(seen[-1])
        if seen[-1] != last and not (split and seen[-1] in bodies):
            problems.append(
                f"burst {burst.entity}/{burst.number}: {tid} answered {results.get(tid)!r}, ends at {seen[-1]}"
            )
    return problems


@dataclass
class Options:
    entities: int
    rounds: int
    max_burst: int
    debounce: float
    kill_every: float
    workers: int
    visibility_timeout: float
    seed: int
    #: ``redis`` (a private server) or an AMQP URL.
    broker: str = "redis"


def parse(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(prog="python -m chaos.debounce", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short run for CI")
    p.add_argument("--entities", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument(
        "--broker",
        default=os.environ.get("LOCKGUARD_TEST_AMQP_URL", "redis"),
        help="'redis' (a private server) or an AMQP URL (default: LOCKGUARD_TEST_AMQP_URL, else redis)",
    )
    a = p.parse_args(argv)
    return Options(
        entities=a.entities or (4 if a.quick else 8),
        rounds=a.rounds or (12 if a.quick else 40),
        max_burst=12,
        debounce=0.5,
        kill_every=2.0 if a.quick else 4.0,
        workers=2,
        visibility_timeout=3.0,
        seed=a.seed,
        broker=a.broker,
    )


def _worker(cfg: dict[str, Any], control: Celery, log_dir: Path, name: str) -> Worker:
    return Worker(
        "chaos.debounce:app",
        control=control,
        concurrency=2,
        name=name,
        queues=[cfg["queue"]],
        env={"CHAOS_DEBOUNCE_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        log_path=log_dir / f"{name}.log",
    )


def _stuck_report(cfg: dict[str, Any], burst: Burst, tid: str, control: Celery) -> str:
    """What the broker and the lock Redis hold for a task whose result never came (for the soak's report)."""
    from celery_lockguard._keys import debounce_name, lock_name

    locks = redis.Redis.from_url(cfg["locks"], decode_responses=True)
    key = f"doc:{burst.entity}"
    held = ""
    if cfg["broker"].startswith("redis"):
        broker = redis.Redis.from_url(cfg["broker"], decode_responses=True)
        queued = [m for m in broker.lrange(cfg["queue"], 0, -1) if tid in m]
        unacked = [tag for tag, m in broker.hgetall("unacked").items() if tid in m]
        held = f", queued {len(queued)}, unacked {len(unacked)}"
    return (
        f"burst {burst.entity}/{burst.number}: no result for {tid} ({burst.ids.index(tid) + 1} of {len(burst.ids)}) "
        f"in 120 s; state {control.AsyncResult(tid).state}{held}, "
        f"debounce record {locks.hgetall(debounce_name(cfg['prefix'], key, TASK))}, "
        f"lease {locks.hgetall(lock_name(cfg['prefix'], key))}"
    )


def _received(log_dir: Path) -> set[str]:
    """Task ids some worker logged as received, over every log of the run (each restart writes its own)."""
    found: set[str] = set()
    for log in log_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "] received" in line and f"{TASK}[" in line:
                found.add(line.split(f"{TASK}[", 1)[1].split("]", 1)[0])
    return found


def _faults(stop: threading.Event, workers: list[Worker], opts: Options, rng: random.Random, kills: list[str]) -> None:
    """SIGKILL a whole worker now and then (the ETA messages it holds are redelivered), then start it again."""
    while not stop.wait(opts.kill_every * rng.uniform(0.5, 1.5)):
        w = rng.choice(workers)
        w.kill()
        kills.append(w.nodename)
        w.log_path = w.log_path.with_name(f"{w.name}-{len(kills)}.log")  # keep the killed worker's log
        try:
            w.start(timeout=60)
        except Exception as exc:  # noqa: BLE001 - reported; the other worker drains the queue
            print(f"[debounce-soak] restart of {w.nodename} failed: {exc}", file=sys.stderr)


def run(opts: Options) -> int:
    rng = random.Random(opts.seed)
    prefix = f"cd{uuid.uuid4().hex[:6]}"
    log_dir = Path(tempfile.mkdtemp(prefix="lockguard-debounce-soak-"))
    with contextlib.ExitStack() as servers:
        locks = servers.enter_context(RedisServer())
        broker_url = servers.enter_context(RedisServer()).url if opts.broker == "redis" else opts.broker
        cfg = {
            "broker": broker_url,
            "locks": locks.url,
            "prefix": prefix,
            "queue": f"{prefix}.q",
            "debounce": opts.debounce,
            "visibility_timeout": opts.visibility_timeout,
        }
        control = create_app(cfg)
        task = control.tasks[TASK]
        workers = [_worker(cfg, control, log_dir, f"debounce{i}") for i in range(opts.workers)]
        start_all(workers, 60)
        stop, kills = threading.Event(), []
        faults = threading.Thread(target=_faults, args=(stop, workers, opts, rng, kills), daemon=True)
        faults.start()
        bursts: list[Burst] = []
        results: dict[str, Any] = {}
        stuck: dict[str, str] = {}  # task id -> what Redis held for it when its result never came
        t0 = time.monotonic()
        try:
            for number in range(opts.rounds):
                this = [Burst(entity, number) for entity in range(opts.entities)]
                sizes = {b.entity: rng.randint(1, opts.max_burst) for b in this}
                pending = [b for b in this for _ in range(sizes[b.entity])]
                rng.shuffle(pending)  # interleaved across entities, in order within each burst
                for b in pending:
                    started = time.monotonic()
                    res = task.delay(b.entity, number, len(b.ids), rng.randint(20, 400))
                    b.ids.append(res.id)
                    b.times.append((started, time.monotonic()))
                    time.sleep(rng.uniform(0, opts.debounce / (2 * opts.max_burst)))
                for b in this:
                    for tid in b.ids:
                        try:
                            results[tid] = control.AsyncResult(tid).get(timeout=120, propagate=False)
                        except CeleryTimeout:  # a lost task: say which, and what Redis held for it, then check all
                            stuck[tid] = _stuck_report(cfg, b, tid, control)
                            print(f"[debounce-soak] {stuck[tid]}", file=sys.stderr)
                if stuck:
                    bursts += this
                    break
                bursts += this
                print(
                    f"[debounce-soak] round {number + 1}/{opts.rounds}: {sum(sizes.values())} publishes",
                    file=sys.stderr,
                )
        finally:
            stop.set()
            faults.join(timeout=90)
            stop_all(workers)
        history = redis.Redis.from_url(locks.url, decode_responses=True)
        ran = [json.loads(x)["task_id"] for x in history.lrange(f"{prefix}:ran", 0, -1)]
        if opts.broker != "redis":
            from kombu import Connection

            with Connection(opts.broker) as conn:
                conn.default_channel.queue_delete(cfg["queue"])
    received = _received(log_dir)
    # kombu's Redis transport pops a message (BRPOP) before it records it as unacknowledged: a worker killed in
    # between loses it before any worker -- or lockguard -- received it. Such a loss is the transport's, shown apart.
    transport = {t: r for t, r in stuck.items() if opts.broker == "redis" and t not in received}
    problems = [r for t, r in stuck.items() if t not in transport]
    checked = (p for b in bursts for p in check_burst(b, results, ran, opts.debounce))
    problems += [p for p in checked if not any(t in p for t in transport)]
    publishes = sum(len(b.ids) for b in bursts)
    print(
        f"debounce soak (seed {opts.seed}): {len(bursts)} bursts, {publishes} publishes, {len(set(ran))} runs, "
        f"{len(ran) - len(set(ran))} restarted after a kill, {len(kills)} workers killed, "
        f"{time.monotonic() - t0:.0f} s: " + ("OK" if not problems else f"{len(problems)} PROBLEMS")
    )
    for p in problems[:20]:
        print(f"  {p}")
    for report in transport.values():
        print(f"  lost by the Redis transport before any worker received it (not counted): {report}")
    print(f"worker logs: {log_dir}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
