"""Where a locked task's time goes: LockedTask variants run in-process with ``task.apply()``.

``apply()`` runs the same ``LockedTask.__call__`` a worker runs (lease,
renewal tracking, completion), without the broker and the pool, so the lock's
own cost is not buried under a millisecond of Celery. Each variant switches
one feature off; paired differences against the default, per round, give
what that feature costs in wall time and in process CPU (both threads: the
renewer's wake-ups included).
"""

from __future__ import annotations

import itertools
import resource
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask

from .stats import Summary, paired, run_rounds

DEFAULT = "LockedTask (default)"


@dataclass
class BreakdownRow:
    name: str
    wall_us: Summary
    cpu_us: Summary
    wall_vs_default: Summary
    cpu_vs_default: Summary
    #: The kernel's part of ``cpu_us`` (system time: the socket calls, the scheduler's wake-ups).
    sys_us: Summary


def _app(url: str) -> tuple[Celery, dict[str, Any]]:
    prefix = f"benchbd{uuid.uuid4().hex[:6]}"
    app = Celery("lockguard_breakdown", broker=url)
    app.conf.update(lockguard_redis_url=url, lockguard_key_prefix=prefix)

    @app.task(name="bd_plain", shared=False)
    def bd_plain(i: int) -> None:
        return None

    @app.task(name="bd_locked", base=LockedTask, lock_key="item:{i}", shared=False)
    def bd_locked(i: int) -> None:
        return None

    @app.task(name="bd_norenew", base=LockedTask, lock_key="item:{i}", lock_renew=False, shared=False)
    def bd_norenew(i: int) -> None:
        return None

    @app.task(name="bd_nocompletion", base=LockedTask, lock_key="item:{i}", completion=False, shared=False)
    def bd_nocompletion(i: int) -> None:
        return None

    return app, {
        DEFAULT: bd_locked,
        "without renewal tracking (lock_renew=False)": bd_norenew,
        "without completion record (completion=False)": bd_nocompletion,
        "plain task (no lock)": bd_plain,
    }


def measure(url: str, rounds: int, n: int) -> list[BreakdownRow]:
    """Alternate the variants ``rounds`` times, ``n`` calls each, distinct arguments throughout."""
    _app_obj, tasks = _app(url)
    args = itertools.count()

    def one(name: str, r: int) -> dict[str, float]:
        task = tasks[name]
        w0, c0, s0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
        for _ in range(n):
            task.apply((next(args),))
        sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0
        return {
            "wall": (time.perf_counter() - w0) / n * 1e6,
            "cpu": (time.process_time() - c0) / n * 1e6,
            "sys": sys_s / n * 1e6,
        }

    for name in tasks:  # warm-up: settings, client, scripts, renewer thread
        one(name, -1)
    res = run_rounds(list(tasks), rounds, one)
    return [
        BreakdownRow(
            name=name,
            wall_us=res[name]["wall"],
            cpu_us=res[name]["cpu"],
            wall_vs_default=paired(res, name, DEFAULT, "wall", lambda a, b: a - b),
            cpu_vs_default=paired(res, name, DEFAULT, "cpu", lambda a, b: a - b),
            sys_us=res[name]["sys"],
        )
        for name in tasks
    ]
