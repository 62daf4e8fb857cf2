"""``python -m bench.run [--quick] [--out docs/benchmarks.md]``: run every benchmark, check, report.

Each section gets its own private server (``celery_lockguard.testing.RedisServer``)
so command counts and memory readings see nothing but the benchmark.

Exit status: 1 on a real breakage only (a lost or double-run task, bodies
overlapping under one lease, more than 2 commands sent per locked task, more
than 1 round trip per renewal tick, a lease lost while renewed). Timing
ratios never fail a run: on a shared machine they are weather, reported with
their spread. Nor does a missing PostgreSQL: its section says so and is skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from celery_lockguard.testing import RedisServer, server_binary

from . import (
    breakdown,
    contention,
    cycle,
    debounce,
    e2e,
    env,
    handoff,
    limits,
    memory,
    multi,
    pg,
    renewal,
    scaling,
    server_work,
    workerapp,
)
from .cluster import LocalCluster
from .e2e import BenchFailure, E2EResult, Variant

#: Section parameters: (full, quick).
PARAMS: dict[str, tuple[Any, Any]] = {
    "cycle_rounds": (40, 10),
    "cycle_n": (300, 100),
    "e2e_rounds": (11, 3),
    "e2e_n": (1000, 200),
    "breakdown_rounds": (30, 6),
    "breakdown_n": (300, 100),
    "hot_seconds": (10, 2),
    "renew_sizes": ([1, 10, 100, 1000], [1, 100, 1000]),
    "renew_window": (4.0, 1.5),
    "memory_n": (20000, 2000),
    "conc_levels": ([2, 8], [2, 8]),
    "conc_rounds": (9, 3),
    "conc_n": (1000, 200),
    "pg_rounds": (9, 3),
    "pg_n": (500, 150),
    "cluster_rounds": (9, 3),
    "cluster_n": (500, 150),
    "handoff_rounds": (5, 2),
    "debounce_rounds": (9, 3),
    "debounce_n": (500, 100),
    "debounce_burst": (10, 10),
    "work_rounds": (15, 3),
    "work_n": (2000, 500),
    "scale_rounds": (5, 2),
    "scale_n": (1000, 200),
    "scale_hot_n": (200, 50),
    "scale_cells": ([(1, 1000), (4, 1000), (1, 1), (4, 1)], [(1, 1000), (4, 1000), (4, 1)]),
    "scale_cluster_cells": ([(4, 1000)], [(4, 1000)]),
    "multi_rounds": (9, 3),
    "multi_n": (500, 150),
}

#: Scaling (issue 33): children per worker process.
SCALE_CONCURRENCY = 4

#: The hand-off scenario of issue 15: three charges behind a 2 s holder of the same customer.
HANDOFF: dict[str, Any] = {"waiters": 3, "hold": 2.0, "waiter_hold": 0.1, "concurrency": 4}

RATES = [10, 100, 1000]

#: Hard limits checked in every mode (issue 8): more is a regression, not noise.
MAX_LOCK_ROUND_TRIPS = 2
MAX_RENEW_ROUND_TRIPS_PER_TICK = 1
#: Function calls (Python and C) the task logic adds per uncontended in-process delivery over lockguard's own
#: ACQUIRE and RELEASE (issue 33; deterministic for one set of installed versions, ``breakdown.calls_per_delivery``):
#: 346 before the cut, 266 after in one bench venv and 280 in a fresh one (its redis-py/Celery builds differ: the
#: floor moved too, 453 -> 473). More is code added to the path between the two round trips; raise it deliberately.
MAX_TASK_LOGIC_CALLS = 300
#: Slack of the per-task round-trip checks (see bench.e2e.ROUND_TRIP_SLACK).
ROUND_TRIP_SLACK = e2e.ROUND_TRIP_SLACK
#: Debounce (issue 16): lock round trips a debounced publish sends (DEBOUNCE_PUBLISH, waited; DEBOUNCE_SETTLE,
#: deferred), and what a burst's run costs beyond its B deliveries' DEBOUNCE_TAKE (ACQUIRE, DEBOUNCE_START, RELEASE).
MAX_DEBOUNCE_PUBLISH_SENT = 2
MAX_DEBOUNCE_PUBLISH_WAITED = 1
DEBOUNCE_RUN_EXTRA_EVALSHA = 3
#: On Redis Cluster a task-id completion scope lands in another slot than the entity (by design).
CLUSTER_EXTRA_ROUND_TRIPS = 2


@dataclass
class Results:
    quick: bool
    params: dict[str, Any]
    env: dict[str, Any] = field(default_factory=dict)
    cycle: list[cycle.CycleResult] = field(default_factory=list)
    script_usec: float = 0.0
    server_work: list[server_work.PartRow] = field(default_factory=list)
    scaling: list[scaling.ScaleRow] = field(default_factory=list)
    e2e: list[E2EResult] = field(default_factory=list)
    concurrency: dict[int, list[E2EResult]] = field(default_factory=dict)
    pg: list[E2EResult] = field(default_factory=list)
    pg_skipped: str = ""
    pg_table: str = ""
    cluster: list[E2EResult] = field(default_factory=list)
    multi: list[E2EResult] = field(default_factory=list)
    handoff: list[handoff.HandoffResult] = field(default_factory=list)
    debounce: list[debounce.DebounceResult] = field(default_factory=list)
    limits: limits.LimitsResult | None = None
    cycle_probe: tuple[int, int] = (0, 0)
    breakdown: list[breakdown.BreakdownRow] = field(default_factory=list)
    #: Function calls per in-process delivery, per breakdown variant (``breakdown.calls_per_delivery``).
    breakdown_calls: dict[str, float] = field(default_factory=dict)
    hot: list[contention.ContentionResult] = field(default_factory=list)
    renewal: list[renewal.RenewalResult] = field(default_factory=list)
    memory: list[memory.MemoryRow] = field(default_factory=list)
    rate_costs: list[tuple[int, float, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    command: str = ""


def _section(res: Results, name: str, fn: Any) -> None:
    """Run one section on a private server of its own, timed (the page lists every section's time)."""
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with RedisServer() as srv:
        fn(srv)
    res.seconds[name] = time.monotonic() - t0
    print(f"[bench] {name} done in {res.seconds[name]:.1f}s", file=sys.stderr, flush=True)


def run(quick: bool, command: str) -> Results:
    p = {k: v[1] if quick else v[0] for k, v in PARAMS.items()}
    res = Results(quick=quick, params=p, command=command)

    def do_cycle(srv: RedisServer) -> None:
        res.env = env.describe(srv.client(), server_binary())
        res.cycle = cycle.measure(srv.url, p["cycle_rounds"], p["cycle_n"])
        res.script_usec = cycle.script_server_usec(srv.url)
        sent, waited = res.cycle_probe = cycle.probe(srv.url)
        res.checks.append(
            (
                f"lockguard acquire+release: commands sent <= {MAX_LOCK_ROUND_TRIPS}",
                sent <= MAX_LOCK_ROUND_TRIPS,
                f"{sent} sent, {waited} waited",
            )
        )

    def check_added(label: str, results: list[E2EResult], variant: str = "LockedTask") -> None:
        """The ``<= 2`` check on commands sent (deferred ones included) that ``variant`` adds per task."""
        sent, waited = e2e.added_round_trips(results, variant)
        res.checks.append(
            (
                f"{label}: commands sent added per task <= {MAX_LOCK_ROUND_TRIPS}",
                sent <= MAX_LOCK_ROUND_TRIPS + ROUND_TRIP_SLACK,
                f"{sent:.2f} sent, {waited:.2f} waited",
            )
        )

    def do_e2e(srv: RedisServer) -> None:
        assert srv.proc is not None
        res.e2e = e2e.measure(srv.url, p["e2e_rounds"], p["e2e_n"], server_pids=[srv.proc.pid])
        check_added("LockedTask", res.e2e)
        res.checks.append(("every throughput task ran exactly once", True, "checked per round"))

    def do_concurrency(srv: RedisServer) -> None:
        pair = [Variant(e2e.BASE, "tp_plain"), Variant("LockedTask", "tp_locked")]
        pair.append(Variant(workerapp.DEFERRED, "tp_deferred"))  # the release's other path, at each concurrency
        for c in p["conc_levels"]:
            res.concurrency[c] = e2e.measure(srv.url, p["conc_rounds"], p["conc_n"], concurrency=c, variants=pair)
            check_added(f"LockedTask at -c {c}", res.concurrency[c])

    def do_pg(srv: RedisServer) -> None:
        why = pg.unreachable()
        if why:
            res.pg_skipped = why
            res.checks.append(("PostgreSQL completion store: skipped", True, why))
            return
        res.pg_table = table = pg.table_name()
        variants = [
            Variant(e2e.BASE, "tp_plain"),
            Variant("LockedTask (Redis store)", "tp_locked"),
            Variant("LockedTask (PostgreSQL store)", "tp_locked", group=1),
        ]
        groups: list[dict[str, Any]] = [{}, {"completion_backend": pg.DSN, "completion_table": table}]
        try:
            res.pg = e2e.measure(srv.url, p["pg_rounds"], p["pg_n"], variants=variants, groups=groups)
        finally:
            try:
                pg.drop_table(table)
            except Exception as exc:  # noqa: BLE001 - a leftover table is reported, not a breakage
                print(f"[bench] could not drop {table}: {exc}", file=sys.stderr)
        check_added("LockedTask (PostgreSQL store)", res.pg, "LockedTask (PostgreSQL store)")

    def do_cluster(srv: RedisServer) -> None:
        with LocalCluster() as cluster:
            nodes = cluster.node_clients()
            try:
                res.cluster = e2e.measure(
                    srv.url,
                    p["cluster_rounds"],
                    p["cluster_n"],
                    variants=[Variant(e2e.BASE, "tp_plain"), Variant("LockedTask on Redis Cluster", "tp_locked")],
                    groups=[{"lock_url": cluster.url, "cluster": True}],
                    stats_clients=nodes,
                )
            finally:
                for n in nodes:
                    n.close()
        sent, _waited = e2e.added_round_trips(res.cluster, "LockedTask on Redis Cluster")
        # The task-id completion scope hashes to another slot than the entity: one more round trip
        # on each side (ACQUIRE's record check, RELEASE's record write), by design.
        limit = MAX_LOCK_ROUND_TRIPS + CLUSTER_EXTRA_ROUND_TRIPS
        label = f"LockedTask on Redis Cluster: commands sent added per task <= {limit}"
        res.checks.append((label, sent <= limit + ROUND_TRIP_SLACK, f"{sent:.2f}"))

    def do_multi(srv: RedisServer) -> None:
        assert srv.proc is not None
        res.multi = multi.measure(srv.url, p["multi_rounds"], p["multi_n"], server_pids=[srv.proc.pid])
        extra = multi.added(res.multi)
        two, one = extra[workerapp.TWO_ENTITIES], extra[multi.SINGLE]
        limit = multi.MAX_TWO_ENTITY_ROUND_TRIPS
        res.checks.append(
            (
                f"two entities: worker round trips added per task <= {limit}, as one entity's",
                two <= limit + ROUND_TRIP_SLACK and abs(two - one) <= ROUND_TRIP_SLACK,
                f"{two:.2f} (one entity {one:.2f}, nested {extra[workerapp.NESTED]:.2f})",
            )
        )

    def do_handoff(srv: RedisServer) -> None:
        with RedisServer() as locks:
            res.handoff = [handoff.scenario(srv.url, locks.url, p["handoff_rounds"], **HANDOFF)]
        res.checks.append(("hand-off: every charge ran exactly once, no two overlapped", True, "checked per round"))

    def do_debounce(srv: RedisServer) -> None:
        with RedisServer() as locks:
            got = debounce.measure(srv.url, locks.url, p["debounce_rounds"], p["debounce_n"], p["debounce_burst"])
        res.debounce = [got]
        add = debounce.added(got)[debounce.DEBOUNCED]
        res.checks.append(("debounce: one run per burst, with its last arguments", True, "checked per round"))
        ok = add["publish_sent"] <= MAX_DEBOUNCE_PUBLISH_SENT + ROUND_TRIP_SLACK
        ok = ok and add["publish_waited"] <= MAX_DEBOUNCE_PUBLISH_WAITED + ROUND_TRIP_SLACK
        label = (
            f"debounce: round trips added per publish <= {MAX_DEBOUNCE_PUBLISH_SENT} sent, "
            f"{MAX_DEBOUNCE_PUBLISH_WAITED} waited"
        )
        res.checks.append((label, ok, f"{add['publish_sent']:.2f} sent, {add['publish_waited']:.2f} waited"))
        per_run = got.rows[-1].evalsha_per_run.median
        limit = got.burst + DEBOUNCE_RUN_EXTRA_EVALSHA
        res.checks.append(
            (
                f"debounce: lock EVALSHA per run of a burst of {got.burst} <= {limit}",
                per_run <= limit + 1e-9,
                f"{per_run:.2f}",
            )
        )

    def do_limits(srv: RedisServer) -> None:
        res.limits = lim = limits.measure(srv.url, quick)
        race = lim.race[0]
        res.checks.append(
            (
                f"lock_limit: holders at once <= {limits.RACE_LIMIT}; lock_rate: starts per window "
                f"<= {limits.RACE_RATE[0]}; every call ran once",
                True,
                f"{race.most_holders} holders, {race.most_starts_per_window} starts (checked, or BenchFailure)",
            )
        )
        worst = max(t.scripts_per_task.median for t in lim.throughput)
        res.checks.append(
            (
                f"lock_limit / lock_rate: lock scripts per task <= {MAX_LOCK_ROUND_TRIPS}",
                worst <= MAX_LOCK_ROUND_TRIPS + ROUND_TRIP_SLACK,
                f"{worst:.2f}",
            )
        )

    def do_breakdown(srv: RedisServer) -> None:
        res.breakdown = breakdown.measure(srv.url, p["breakdown_rounds"], p["breakdown_n"])
        res.breakdown_calls = calls = breakdown.calls_per_delivery(srv.url)
        logic = calls[breakdown.DEFAULT] - calls[breakdown.WIRE_FLOOR]
        res.checks.append(
            (
                f"task logic function calls per delivery over the scripts floor <= {MAX_TASK_LOGIC_CALLS}",
                logic <= MAX_TASK_LOGIC_CALLS,
                f"{logic:.0f} ({calls[breakdown.DEFAULT]:.0f} - {calls[breakdown.WIRE_FLOOR]:.0f})",
            )
        )

    def do_hot(srv: RedisServer) -> None:
        res.hot = contention.measure(srv.url, p["hot_seconds"])
        res.checks.append(("contention: lockguard bodies never overlapped; retry ran every call once", True, "checked"))

    def do_renewal(srv: RedisServer) -> None:
        res.renewal = renewal.measure(srv.url, p["renew_sizes"], p["renew_window"])
        worst = max(r.round_trips_per_tick for r in res.renewal)
        res.checks.append(
            (
                f"renewal: round trips per tick <= {MAX_RENEW_ROUND_TRIPS_PER_TICK} at every size",
                worst <= MAX_RENEW_ROUND_TRIPS_PER_TICK + 1e-9,
                f"{worst:.2f}",
            )
        )

    def do_server_work(srv: RedisServer) -> None:
        res.server_work = server_work.measure(srv.url, p["work_rounds"], p["work_n"])

    def do_scaling(srv: RedisServer) -> None:
        common = {"concurrency": SCALE_CONCURRENCY, "rounds": p["scale_rounds"], "n": p["scale_n"]}
        common["hot_n"] = p["scale_hot_n"]
        with RedisServer() as locks:
            assert locks.proc is not None
            res.scaling = scaling.measure(srv.url, locks.url, [locks.proc.pid], cells=p["scale_cells"], **common)
        with LocalCluster() as cluster:
            pids = [n.proc.pid for n in cluster.nodes if n.proc is not None]
            res.scaling += scaling.measure(
                srv.url, cluster.url, pids, cells=p["scale_cluster_cells"], cluster=True, label="Cluster", **common
            )
        res.checks.append(("scaling: every task ran exactly once, every cell", True, "checked per round"))

    def do_memory(srv: RedisServer) -> None:
        res.memory = memory.measure(srv.url, p["memory_n"])
        res.rate_costs = memory.rate_costs(res.memory, RATES)

    for name, fn in (
        ("lock cycle", do_cycle),
        ("server work", do_server_work),
        ("end-to-end", do_e2e),
        ("concurrency", do_concurrency),
        ("PostgreSQL completion", do_pg),
        ("Redis Cluster", do_cluster),
        ("scaling", do_scaling),
        ("several entities", do_multi),
        ("breakdown", do_breakdown),
        ("contention", do_hot),
        ("hand-off", do_handoff),
        ("debounce", do_debounce),
        ("limits", do_limits),
        ("renewal", do_renewal),
        ("memory", do_memory),
    ):
        _section(res, name, fn)
    res.env["loadavg_end"] = os.getloadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs for CI: checks breakage, not speed")
    parser.add_argument("--out", type=Path, help="write the Markdown page here (and its plot beside it)")
    args = parser.parse_args(argv)
    # The driver publishes thousands of duplicates on purpose: their info events go nowhere,
    # and anything louder goes to stderr, never into the page printed on stdout.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    command = "python -m bench.run" + (" --quick" if args.quick else "") + (f" --out {args.out}" if args.out else "")
    try:
        res = run(args.quick, command)
    except BenchFailure as exc:
        print(f"[bench] FAILED: {exc}", file=sys.stderr)
        return 1
    from . import report

    page = report.render(res, plot_name=args.out.with_suffix(".png").name if args.out else None)
    if args.out:
        from . import plot

        args.out.parent.mkdir(parents=True, exist_ok=True)

        plot.draw(res, args.out.with_suffix(".png"))
        args.out.write_text(page)
        print(f"[bench] wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
    else:
        print(page)
    failed = [c for c in res.checks if not c[1]]
    for name, ok, value in res.checks:
        print(f"[bench] check {'ok  ' if ok else 'FAIL'} {name}: {value}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
