"""Instructions per in-process delivery, counted by callgrind: deterministic where the bench's µs are weather.

``python tools/instructions.py [--url redis://127.0.0.1:6379/0] [VARIANT ...]`` runs, for each variant,
``task.apply()`` 200 and then 1,200 times under ``valgrind --tool=callgrind --separate-threads=yes`` and
prints the main thread's instructions per delivery (the slope: start-up and warm-up cancel out).
Repeated runs agree within ~0.2%. Variants: ``default`` (a ``LockedTask``), ``floor`` (lockguard's own
ACQUIRE and RELEASE with no task logic, as ``bench.floors.held``), ``plain`` (no lock). structlog is
configured to filter at INFO, as the bench and a production worker do.

Use it to see what a change to the delivery path costs before timing it (issue 33: a 3% cut is
invisible in the breakdown's µs, clear here). Needs valgrind (``apt-get install valgrind``) and the
bench environment (``make bench`` builds ``.bench/venv``); keys live under a fresh prefix, removed after.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("default", "floor", "plain")


def drive(url: str, variant: str, n: int) -> None:
    """Run ``n`` deliveries of ``variant`` after a warm-up of 300 (the measured process)."""
    sys.path.insert(0, str(ROOT))
    import redis
    import structlog
    from celery import Celery, Task

    from bench import floors
    from celery_lockguard import LockedTask

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    prefix = f"instr{uuid.uuid4().hex[:6]}"
    app = Celery("instructions", broker=url)
    app.conf.update(lockguard_redis_url=url, lockguard_key_prefix=prefix, task_ignore_result=True)
    raw = redis.Redis.from_url(url, decode_responses=True)

    class Floor(Task):  # type: ignore[misc]
        def __call__(self, *args: object, **kwargs: object) -> object:
            with floors.held(raw, prefix, f"item:{args[0]}", self.request.id, self.name):
                return self.run(*args, **kwargs)

    @app.task(name="i_default", base=LockedTask, lock_key="item:{i}", shared=False)
    def i_default(i: int) -> None:
        return None

    @app.task(name="i_floor", base=Floor, shared=False)
    def i_floor(i: int) -> None:
        return None

    @app.task(name="i_plain", shared=False)
    def i_plain(i: int) -> None:
        return None

    task = {"default": i_default, "floor": i_floor, "plain": i_plain}[variant]
    try:
        for i in range(300 + n):
            task.apply((i,))
    finally:
        for key in raw.scan_iter(f"{prefix}*", count=1000):
            raw.delete(key)


def count(url: str, variant: str, n: int) -> int:
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
    parser.add_argument("--drive", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args.url, args.drive, args.n)
        return
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    for variant in args.variants or VARIANTS:
        low, high = count(args.url, variant, 200), count(args.url, variant, 1200)
        print(f"{variant}: {(high - low) / 1000:,.0f} instructions per delivery (main thread)")


if __name__ == "__main__":
    main()
