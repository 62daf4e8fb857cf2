"""``python -m bench.run [--quick] [--out docs/benchmarks.md]``: run every benchmark, check, report.

Each section gets its own private server (``celery_lockguard.testing.RedisServer``)
so command counts and memory readings see nothing but the benchmark.

Exit status: 1 on a real breakage only (a lost or double-run task, bodies
overlapping under one lease, more than 2 round trips per locked task, more
than 1 round trip per renewal tick, a lease lost while renewed). Timing
ratios never fail a run: on a shared machine they are weather, reported with
their spread.
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

from . import breakdown, contention, cycle, e2e, env, memory, renewal
from .e2e import BenchFailure

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
}

RATES = [10, 100, 1000]

#: Hard limits checked in every mode (issue 8): more is a regression, not noise.
MAX_LOCK_ROUND_TRIPS = 2
MAX_RENEW_ROUND_TRIPS_PER_TICK = 1


@dataclass
class Results:
    quick: bool
    params: dict[str, Any]
    env: dict[str, Any] = field(default_factory=dict)
    cycle: list[cycle.CycleResult] = field(default_factory=list)
    script_usec: float = 0.0
    e2e: list[e2e.E2EResult] = field(default_factory=list)
    breakdown: list[breakdown.BreakdownRow] = field(default_factory=list)
    hot: list[contention.ContentionResult] = field(default_factory=list)
    renewal: list[renewal.RenewalResult] = field(default_factory=list)
    memory: list[memory.MemoryRow] = field(default_factory=list)
    rate_costs: list[tuple[int, float, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    command: str = ""


def _section(res: Results, name: str, fn: Any) -> None:
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
        rt = cycle.probe(srv.url)
        res.checks.append(
            (f"lockguard acquire+release: round trips <= {MAX_LOCK_ROUND_TRIPS}", rt <= MAX_LOCK_ROUND_TRIPS, str(rt))
        )

    def do_e2e(srv: RedisServer) -> None:
        res.e2e = e2e.measure(srv.url, p["e2e_rounds"], p["e2e_n"])
        by = {r.name: r for r in res.e2e}
        plain, locked = by[e2e.BASE], by["LockedTask"]
        added = (locked.publish_rt - plain.publish_rt) + (locked.child_rt - plain.child_rt)
        res.checks.append(
            (
                f"LockedTask: round trips added per task <= {MAX_LOCK_ROUND_TRIPS}",
                added <= MAX_LOCK_ROUND_TRIPS + 0.01,
                f"{added:.2f}",
            )
        )
        res.checks.append(("every throughput task ran exactly once", True, "checked per round"))

    def do_breakdown(srv: RedisServer) -> None:
        res.breakdown = breakdown.measure(srv.url, p["breakdown_rounds"], p["breakdown_n"])

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

    def do_memory(srv: RedisServer) -> None:
        res.memory = memory.measure(srv.url, p["memory_n"])
        res.rate_costs = memory.rate_costs(res.memory, RATES)

    for name, fn in (
        ("lock cycle", do_cycle),
        ("end-to-end", do_e2e),
        ("breakdown", do_breakdown),
        ("contention", do_hot),
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
