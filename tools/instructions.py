"""Instructions per in-process delivery, counted by callgrind: deterministic where the bench's µs are weather.

``python tools/instructions.py [--url redis://127.0.0.1:6379/0] [VARIANT ...]`` runs, for each variant,
``task.apply()`` 200 and then 1,200 times under ``valgrind --tool=callgrind --separate-threads=yes`` and
prints the main thread's instructions per delivery (the slope: start-up and warm-up cancel out).
Repeated runs agree within ~0.2%. Variants: ``default`` (a ``LockedTask``), ``floor`` (lockguard's own
ACQUIRE and RELEASE with no task logic), ``plain`` (no lock): the breakdown section's tasks. structlog is
configured to filter at INFO, as the bench and a production worker do.

Use it to see what a change to the delivery path costs before timing it (issue 33: a 3% cut is
invisible in the breakdown's µs, clear here). Needs valgrind (``apt-get install valgrind``) and the
bench environment (``make bench`` builds ``.bench/venv``); keys live under a fresh prefix, removed after.

``--without PART`` (repeatable) switches a part of the task logic off in the measured process, to see
what it costs: ``metrics`` (every count and observation), ``log`` (the event log path; events are still
counted), ``renewal`` (renewal tracking), ``getpid`` (answered from a cached value). Measurement only:
a delivery without them is not one lockguard supports. ``--root DIR`` imports ``celery_lockguard``
and ``bench`` from another checkout (a mypyc-compiled copy, say: ``tools/compiled_copy.sh``).
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("default", "floor", "plain")
PARTS = ("metrics", "log", "renewal", "getpid")


def _switch_off(parts: list[str]) -> None:
    """Replace each named part of the task logic by a do-nothing (measurement only, see the module's text)."""
    import os

    from celery_lockguard import _events, _metrics, _renewer

    def nothing(*_: object, **__: object) -> None:
        return None

    if "metrics" in parts:
        for name in ("count", "observe", "observe_hold", "observe_wait"):
            setattr(_metrics, name, nothing)
    if "log" in parts:
        _events.log = nothing
    if "renewal" in parts:
        _renewer.Renewer.track = nothing  # type: ignore[method-assign]
    if "getpid" in parts:
        pid = os.getpid()
        os.getpid = lambda: pid


def drive(url: str, variant: str, n: int, root: Path = ROOT, without: list[str] | None = None) -> None:
    """Run ``n`` deliveries of ``variant`` after a warm-up of 300 (the measured process).

    The tasks are the breakdown section's own (``bench.breakdown._app``), so ``floor`` is the bench's floor.
    """
    sys.path.insert(0, str(root))
    import redis
    import structlog

    from bench import breakdown

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    _switch_off(without or [])
    app, tasks = breakdown._app(url)
    task = tasks[{"default": breakdown.DEFAULT, "floor": breakdown.WIRE_FLOOR, "plain": breakdown.PLAIN}[variant]]
    try:
        for i in range(300 + n):
            task.apply((i,))
    finally:
        raw = redis.Redis.from_url(url)
        for key in raw.scan_iter(f"{app.conf.lockguard_key_prefix}*", count=1000):
            raw.delete(key)


def count(url: str, variant: str, n: int, root: Path = ROOT, without: list[str] | None = None) -> int:
    """Main-thread instructions of one driven run of ``n`` deliveries."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--separate-threads=yes",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--drive",
                variant,
                "--n",
                str(n),
                "--url",
                url,
                "--root",
                str(root),
                *[arg for part in without or [] for arg in ("--without", part)],
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        main = Path(f"{out}-01").read_text()
        found = re.search(r"^totals:\s*(\d+)", main, re.M)
        if found is None:
            raise RuntimeError(f"no totals in callgrind's output for {variant}")
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", metavar="VARIANT", help=f"any of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--without", action="append", choices=PARTS, default=[], help="switch a part off")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to import (default: this one)")
    parser.add_argument("--drive", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args.url, args.drive, args.n, args.root, args.without)
        return
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    for variant in args.variants or VARIANTS:
        low = count(args.url, variant, 200, args.root, args.without)
        high = count(args.url, variant, 1200, args.root, args.without)
        off = f" without {', '.join(args.without)}" if args.without else ""
        print(f"{variant}{off}: {(high - low) / 1000:,.0f} instructions per delivery (main thread)")


if __name__ == "__main__":
    main()
