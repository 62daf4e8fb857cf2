"""End-to-end Celery throughput of one tiny task: plain, LockedTask, celery-once, celery-singleton.

Prefork workers with ``-c C`` children (C = 1 for the main table: tasks run
one after another; 2 and 8 for the concurrency table). Per round and variant:

1. publish C *gate* markers: each child takes one, says it is ready and blocks
   on a Redis list (fair scheduling hands a marker only to an idle child);
2. publish N tasks with distinct arguments (uncontended), timed: the publish
   cost, where celery-once and celery-singleton take their lock;
3. publish C end markers, open the gate: the children drain the N tasks; each
   end marker reports and then blocks until the driver has all C, so they land
   on C distinct children and the last one starts only once every task ended.
   The first start and the last end bracket exactly those N runs: the worker cost.

Variants can live in several *groups*, each its own app configuration, queue
and worker (the PostgreSQL completion store is an app setting, so its variant
needs a worker of its own); the driver alternates over all variants of all
groups in one round order, so every ratio stays paired.

Round trips are counted at the client in the publisher (this process) and in
the worker children (reported by the markers): commands sent, and round trips
waited (sent minus ``Channel.defer`` sends, see ``bench.counting``); server
commands are INFO commandstats deltas on the private servers over each phase.
Every variant's run count must grow by exactly N per round: a lost or double
run fails.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_lockguard import testing

from . import counting
from .stats import Summary, paired, run_rounds
from .worker import Worker
from .workerapp import TP_TASKS, create_app

BASE = "plain task"

#: Slack of the per-task round-trip checks. They read averages over thousands of tasks: a sporadic
#: command (a connection re-made, a retried read on a loaded machine) adds a few thousandths; a
#: command added to every task adds 1, to one task in ten 0.1.
ROUND_TRIP_SLACK = 0.05

#: Socket timeout of the clients that block on a marker, gate or barrier list (BLPOP up to 120 s):
#: redis-py 8 defaults to 5 s, which a loaded machine's stall outlasts.
BLOCKING_SOCKET_TIMEOUT = 180.0


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
    publish_waited: float = 0.0
    child_waited: float = 0.0
    #: Commands the children's renewer threads sent per task (ticks finding a lease held): not in ``child_rt``.
    renewer_rt: float = 0.0
    #: CPU µs per task while the worker drains: its main process, its pool children, the server(s) given.
    cpu_main_us: Summary | None = None
    cpu_child_us: Summary | None = None
    cpu_server_us: Summary | None = None
    #: Paired per round against the base: the child's CPU, and all three processes' together.
    cpu_child_added_us: Summary | None = None
    cpu_added_us: Summary | None = None

    @property
    def round_trips(self) -> float:
        """Commands sent per task, publisher and worker child together."""
        return self.publish_rt + self.child_rt

    @property
    def waited(self) -> float:
        """Round trips waited per task (commands sent minus deferred ones), both sides."""
        return self.publish_waited + self.child_waited


@dataclass(frozen=True)
class Variant:
    """A display name, the task it publishes, and the group (app configuration and worker) it runs in."""

    name: str
    task: str
    group: int = 0


def default_variants() -> list[Variant]:
    """Every throughput task of the main table, in one group."""
    return [Variant(name, task) for name, task in TP_TASKS.items()]


class BenchFailure(AssertionError):
    """A real breakage (lost or double-run task, too many round trips): fails ``--quick`` too."""


def added_round_trips(results: list[E2EResult], variant: str, base: str = BASE) -> tuple[float, float]:
    """(commands sent, round trips waited) a variant adds per task over ``base``, publisher and worker."""
    by = {r.name: r for r in results}
    v, b = by[variant], by[base]
    return v.round_trips - b.round_trips, v.waited - b.waited


class _Group:
    """One app configuration: its app (to publish), its worker, its counters of runs per task."""

    def __init__(self, url: str, prefix: str, index: int, extra: dict[str, Any], concurrency: int) -> None:
        self.cfg: dict[str, Any] = {"broker": url, "queue": f"{prefix}.g{index}.q", "prefix": f"{prefix}g{index}"}
        self.cfg.update(extra)
        self.app = create_app(self.cfg)
        self.marks = f"{self.cfg['prefix']}:marks"
        self.expected: dict[str, int] = {}
        self.worker = Worker(self.app, self.cfg, concurrency=concurrency)


def measure(
    url: str,
    rounds: int,
    n: int,
    *,
    concurrency: int = 1,
    variants: list[Variant] | None = None,
    groups: list[dict[str, Any]] | None = None,
    stats_clients: list[Any] | None = None,
    base: str = BASE,
    server_pids: list[int] | None = None,
) -> list[E2EResult]:
    """Alternate the variants ``rounds`` times with ``n`` tasks each, on ``-c concurrency`` workers.

    ``groups`` are config overrides (``bench.workerapp``), one worker each, ``[{}]`` by
    default; ``stats_clients`` are further servers whose commandstats count as the task's
    (the masters of a lock cluster); ``server_pids`` are the local servers whose CPU is read from
    ``/proc`` over each drain. Why one function for every table: the same gates,
    markers and checks measure each figure, so the figures compare.
    """
    variants = variants or default_variants()
    groups = groups or [{}]
    prefix = f"benche2e{uuid.uuid4().hex[:6]}"
    gs = [_Group(url, prefix, i, extra, concurrency) for i, extra in enumerate(groups)]
    # BLPOP waits up to a marker's timeout: redis-py 8's default 5 s socket timeout would cut it short.
    admin = redis.Redis.from_url(url, decode_responses=True, socket_timeout=BLOCKING_SOCKET_TIMEOUT)
    more = list(stats_clients or [])
    names = [v.name for v in variants]
    spec = {v.name: v for v in variants}
    zero = {"publish_rt": 0.0, "publish_waited": 0.0, "child_rt": 0.0, "child_waited": 0.0, "cmds": 0.0}
    zero["renewer_rt"] = 0.0
    counts: dict[str, dict[str, float]] = {v: dict(zero) for v in names}
    breakdown: dict[str, dict[str, float]] = {v: {} for v in names}
    next_arg = [0]
    c = concurrency

    def marks_of(g: _Group, tag: str, timeout: float) -> list[dict[str, Any]]:
        """The ``c`` marks of ``tag`` (one per child), or a failure naming the stall."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < c:
            left = deadline - time.monotonic()
            item = admin.blpop([f"{g.marks}:{tag}"], timeout=max(0.1, left)) if left > 0 else None
            if item is None:
                raise BenchFailure(
                    f"{len(got)} of {c} '{tag}' markers within {timeout}s: the worker lost or stalled a task\n"
                    f"{g.worker.log()}"
                )
            got.append(dict(json.loads(item[1])))
        pids = {m["pid"] for m in got}
        if len(pids) != c:
            raise BenchFailure(f"'{tag}' markers came from {len(pids)} children, expected {c}: {sorted(pids)}")
        return got

    def cpu_now(g: _Group) -> tuple[float, float]:
        """CPU seconds so far of ``g``'s worker main process and of the servers in ``server_pids``."""
        return testing.process_cpu(g.worker.pid), sum(testing.process_cpu(p) for p in server_pids or ())

    def one(variant: str, r: int, n: int = n) -> dict[str, float]:
        v = spec[variant]
        g = gs[v.group]
        task = g.app.tasks[v.task]
        mark = g.app.tasks["tp_mark"]
        gate = f"{g.marks}:gate:{r}:{v.task}"
        barrier = f"{g.marks}:barrier:{r}:{v.task}"
        for _ in range(c):
            mark.delay("start", gate)
        marks_of(g, "ready", 60)  # every child holds a gate: none takes a task before the clock starts
        first = next_arg[0]
        next_arg[0] += n
        before = counting.commandstats(admin, *more)
        with counting.counting() as box:
            t0 = time.perf_counter()
            for i in range(first, first + n):
                task.delay(i)
            publish = time.perf_counter() - t0
        mid = counting.commandstats(admin, *more)
        for _ in range(c):
            mark.delay("end", None, barrier)
        main0, srv0 = cpu_now(g)
        admin.rpush(gate, *(["go"] * c))
        starts = marks_of(g, "start", 60)
        ends = marks_of(g, "end", max(60, n * 0.05))
        main1, srv1 = cpu_now(g)
        admin.rpush(barrier, *(["go"] * c))
        after = counting.commandstats(admin, *more)
        if {m["pid"] for m in starts} != {m["pid"] for m in ends}:
            raise BenchFailure(f"{variant}: start and end markers ran in different children (a child was replaced?)")
        g.expected[v.task] = g.expected.get(v.task, 0) + n
        runs = sum(m["runs"].get(v.task, 0) for m in ends)
        if runs != g.expected[v.task]:
            raise BenchFailure(f"{variant}: {runs} bodies ran, expected {g.expected[v.task]} (lost or double run)")
        drain = max(m["t"] for m in ends) - min(m["t"] for m in starts)
        by_pid = {m["pid"]: m for m in starts}
        sent = sum(m["sent"] - by_pid[m["pid"]]["sent"] - 1 for m in ends)  # minus each start marker's own push
        deferred = sum(m["deferred"] - by_pid[m["pid"]]["deferred"] for m in ends)
        renewer = sum(m.get("background", 0) - by_pid[m["pid"]].get("background", 0) for m in ends)
        sent -= renewer  # renewer ticks are time-driven, not per task: reported apart
        pub = counting.delta(mid, before)
        run = counting.delta(after, mid)
        k = counts[variant]
        k["publish_rt"] += box[0] / n
        k["publish_waited"] += (box[0] - box[1]) / n
        k["child_rt"] += sent / n
        k["renewer_rt"] += renewer / n
        k["child_waited"] += (sent - deferred) / n
        k["cmds"] += (sum(pub.values()) + sum(run.values())) / n
        for key, x in (pub + run).items():
            breakdown[variant][key] = breakdown[variant].get(key, 0) + x / n
        child_cpu = sum(m["cpu"] - by_pid[m["pid"]]["cpu"] for m in ends)
        return {
            "cpu_main": (main1 - main0) / n * 1e6,
            "cpu_child": child_cpu / n * 1e6,
            "cpu_server": (srv1 - srv0) / n * 1e6,
            "cpu_all": (main1 - main0 + child_cpu + srv1 - srv0) / n * 1e6,
            "worker_rate": n / drain,
            "publish_us": publish / n * 1e6,
            "run_us": drain / n * 1e6,
            "total_us": (publish + drain) / n * 1e6,
        }

    try:
        testing.start_all([g.worker for g in gs], timeout=90)
        for variant in names:  # warm-up: imports, connections, scripts in every process
            one(variant, -1, max(50, 10 * c))
        for k in counts.values():
            k.update(dict.fromkeys(k, 0.0))
        for b in breakdown.values():
            b.clear()
        results = run_rounds(names, rounds, one)
    finally:
        testing.stop_all([g.worker for g in gs])
        admin.close()
    out = []
    for v in names:
        res = results[v]
        k = counts[v]
        out.append(
            E2EResult(
                name=v,
                worker_rate=res["worker_rate"],
                publish_us=res["publish_us"],
                run_us=res["run_us"],
                total_us=res["total_us"],
                ratio_worker=paired(results, v, base, "worker_rate", lambda a, b: a / b),
                ratio_total=paired(results, v, base, "total_us", lambda a, b: b / a),
                added_us=paired(results, v, base, "total_us", lambda a, b: a - b),
                publish_rt=k["publish_rt"] / rounds,
                child_rt=k["child_rt"] / rounds,
                publish_waited=k["publish_waited"] / rounds,
                child_waited=k["child_waited"] / rounds,
                renewer_rt=k["renewer_rt"] / rounds,
                cpu_main_us=res["cpu_main"],
                cpu_child_us=res["cpu_child"],
                cpu_server_us=res["cpu_server"] if server_pids else None,
                cpu_child_added_us=paired(results, v, base, "cpu_child", lambda a, b: a - b),
                cpu_added_us=paired(results, v, base, "cpu_all", lambda a, b: a - b) if server_pids else None,
                server_cmds=k["cmds"] / rounds,
                server_breakdown={
                    key: round(x / rounds, 2) for key, x in sorted(breakdown[v].items()) if x / rounds >= 0.01
                },
            )
        )
    return out
