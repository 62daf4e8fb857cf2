"""Where a locked task's time goes: LockedTask variants run in-process with ``task.apply()``.

``apply()`` runs the same ``LockedTask.__call__`` a worker runs (lease,
renewal tracking, completion), without the broker and the pool, so the lock's
own cost is not buried under a millisecond of Celery. Each variant switches
one feature off; paired differences against the default, per round, give
what that feature costs in wall time and in process CPU (both threads: the
renewer's wake-ups included).

*Floors* run beside them: lockguard's own ACQUIRE and RELEASE on its own
channel with none of the task logic around them (so the default variant minus
it is what that logic costs); the lock a user writes by hand (redis-py
``SET NX PX`` with a uuid4 token, then ``DEL``, around the body); and those two
round trips as pre-packed bytes on a bare socket: what two round trips cost
on this host before any library code, so a CPU target can be read against
what is physically left.
"""

from __future__ import annotations

import itertools
import resource
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery, Task

from celery_lockguard import LockedTask

from . import floors, peers
from .stats import Summary, paired, run_rounds

DEFAULT = "LockedTask (default)"
RAW_FLOOR = "floor: SET NX PX + DEL by hand (redis-py, no lockguard)"
WIRE_FLOOR = "floor: lockguard's ACQUIRE and RELEASE on its own channel, no task logic"
BARE_FLOOR = "floor: the same two round trips, pre-packed bytes on a bare socket"
PLAIN = "plain task (no lock)"


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

    raw = redis.Redis.from_url(url, decode_responses=True)

    class ByHand(Task):  # type: ignore[misc]
        """The two-command lock users write before a library: SET NX PX with a random token, DEL after."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with peers.by_hand(raw, f"{prefix}:raw:{args[0]}"):
                return self.run(*args, **kwargs)

    @app.task(name="bd_raw", base=ByHand, shared=False)
    def bd_raw(i: int) -> None:
        return None

    bare = _BareCycle(url, prefix)

    class Bare(Task):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            bare.cycle(args[0])
            return self.run(*args, **kwargs)

    @app.task(name="bd_bare", base=Bare, shared=False)
    def bd_bare(i: int) -> None:
        return None

    wire_client = redis.Redis.from_url(url, decode_responses=True)

    class WireOnly(Task):  # type: ignore[misc]
        """The default variant's two scripts, same keys and values, on lockguard's own channel, both waited for.

        What remains is what the task logic costs (options, headers, decision, metrics, events,
        renewal tracking, the release report): the default variant minus this one.
        """

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with floors.held(wire_client, prefix, f"item:{args[0]}", self.request.id, self.name):
                return self.run(*args, **kwargs)

    @app.task(name="bd_wire", base=WireOnly, shared=False)
    def bd_wire(i: int) -> None:
        return None

    return app, {
        DEFAULT: bd_locked,
        "without renewal tracking (lock_renew=False)": bd_norenew,
        "without completion record (completion=False)": bd_nocompletion,
        WIRE_FLOOR: bd_wire,
        RAW_FLOOR: bd_raw,
        BARE_FLOOR: bd_bare,
        PLAIN: bd_plain,
    }


class _BareCycle:
    """``SET key token NX PX 30000`` then ``DEL key``, each sent and its reply read on one plain socket.

    No parser, no pool, no encoding beyond one ``%`` format: the least any client pays for two round
    trips (the socket has a timeout, as every real client's has). Only a plain ``redis://`` URL.
    """

    def __init__(self, url: str, prefix: str) -> None:
        u = urlsplit(url)
        if u.scheme != "redis" or u.password:
            raise ValueError(f"the bare floor needs a plain redis:// URL without AUTH, not {url!r}")
        self._sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=5.0)
        db = (u.path or "/0").lstrip("/") or "0"
        self._call(b"*2\r\n$6\r\nSELECT\r\n$%d\r\n%s\r\n" % (len(db), db.encode()), b"+OK\r\n")
        self._prefix = f"{prefix}:bare:".encode()

    def _call(self, packed: bytes, expect: bytes) -> None:
        self._sock.sendall(packed)
        reply = self._sock.recv(64)
        while len(reply) < len(expect) and not reply.startswith(b"-"):  # a reply split in two: rare
            more = self._sock.recv(64)
            if not more:
                break
            reply += more
        if reply != expect:
            raise RuntimeError(f"bare floor: {packed!r} answered {reply!r}, not {expect!r}")

    def cycle(self, i: int) -> None:
        k = self._prefix + str(i).encode()
        n = len(k)
        self._call(
            b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$5\r\ntoken\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n" % (n, k),
            b"+OK\r\n",
        )
        self._call(b"*2\r\n$3\r\nDEL\r\n$%d\r\n%s\r\n" % (n, k), b":1\r\n")


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


#: Deliveries counted per variant by :func:`calls_per_delivery` (after a warm-up of as many).
CALL_COUNT_N = 21


def calls_per_delivery(url: str, n: int = CALL_COUNT_N) -> dict[str, float]:
    """Python and C function calls one ``apply()`` makes on this thread, per variant (median over ``n``).

    Deterministic where the µs are weather: what a delivery *touches* (issue 33: code between two
    blocking round trips costs several times its warm cost), so a change that adds calls to the
    path shows here first. The median leaves out the rare delivery that also folds the metrics
    ledger (every 2,048 entries). Only the default variant and the scripts floor are counted: their
    difference is the task logic's calls.
    """
    _app_obj, tasks = _app(url)
    args = itertools.count()
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    out: dict[str, float] = {}
    for name in (DEFAULT, WIRE_FLOOR, PLAIN):
        task = tasks[name]
        for _ in range(n):  # warm-up: settings, options, client, scripts, renewer thread
            task.apply((next(args),))
        per: list[int] = []
        for _ in range(n):
            a = (next(args),)
            calls = 0
            sys.setprofile(profile)
            try:
                task.apply(a)
            finally:
                sys.setprofile(None)
            per.append(calls)
        out[name] = statistics.median(per)
    return out


def main() -> None:
    """``python -m bench.breakdown [REDIS_URL] [ROUNDS] [N]``: this section alone, on a server you give it.

    For re-measuring the task logic against the scripts floor without the full run (keys are under a
    fresh ``benchbd*`` prefix; nothing is flushed). Prints each row and the calls per delivery.
    """
    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    rows = measure(url, rounds, n)
    for row in rows:
        print(f"{row.name}: CPU {row.cpu_us.fmt()} µs, CPU vs default {row.cpu_vs_default.fmt('+.0f')} µs")
    by = {row.name: row for row in rows}
    logic = Summary([-x for x in by[WIRE_FLOOR].cpu_vs_default.values])
    print(f"task logic over the scripts floor (CPU, paired): {logic.fmt()} µs")
    calls = calls_per_delivery(url)
    print(f"calls per delivery: {calls}; task logic {calls[DEFAULT] - calls[WIRE_FLOOR]:.0f}")


if __name__ == "__main__":
    main()
