"""``python -m chaos.repro SCENARIO``: one-job reductions of what the soak found (each exits 1 if it shows).

Each uses the soak's app and environment (private Redis servers, PostgreSQL
tables of their own, real prefork workers), exit 1 when the defect shows and
0 when it does not, and clean up like the soak.

``ignore-then-kill`` (a lost job; fixed in 77aad04 by a watch copy). Two
workers with one child each, ``acks_late`` + ``reject_on_worker_lost``, a
``visibility_timeout`` (1 s) shorter than the body (4 s):

1. the body starts on a child of worker A and holds the lease ``acct:0``;
2. the transport's visibility sweep puts the still-unacknowledged message back
   in the queue, and worker B receives the copy;
3. LockedTask sees its own task id holding a live lease and drops the copy
   with ``Ignore`` (``reason="redelivery_of_running_original"``), which
   acknowledges it;
4. the child running the body is killed. Worker A rejects the original
   delivery with requeue, but the Redis transport's ``unacked`` entry for it
   is already gone, so nothing is requeued;
5. the broker is empty and the job never committed: lost.

``watch-storm`` (the watch copy multiplying). The same setup, but the lock TTL
(8 s) is longer than the ``visibility_timeout`` (1 s), and the body takes
20 s. Each dropped copy leaves a watch copy counted down for at least the TTL.
The Redis transport holds such a countdown message unacknowledged, so the
visibility sweep redelivers it before it is due, and every copy that arrives
while the original runs leaves a watch of its own. The count grows
geometrically. After the original commits, a watch copy briefly holds the
lease while it reads the PostgreSQL completion record, and copies arriving in
that window see "their own task id, alive" and leave further watches. The run
reports deliveries and the broker backlog until the backlog drains, or for
30 s after the commit.

``wait-twice`` (two bodies of one task at once under one lease; found by the
multi-mode soak). Two workers with one child each, TTL 2 s,
``visibility_timeout`` 1 s, a 4 s body:

1. the lock Redis is down: the first delivery waits (``lock.retry_scheduled``,
   ``reason="backend_unavailable"``) and publishes its wait copy -- same task
   id, a short countdown, and the ``lockguard_attempt`` token of the ACQUIRE it
   follows;
2. the worker holding the wait copy (unacknowledged: the Redis transport keeps
   a countdown message in ``unacked``) is frozen (SIGSTOP) and the lock Redis
   comes back; the visibility sweep hands the copy to the other worker, which
   ACQUIREs with the attempt token and runs the body;
3. the frozen worker resumes; its copy of the same wait message ACQUIREs with
   the same token, is taken for the lease's owner, and runs the body too --
   with the same fence, beside the first, and with no lock event at all.

Any delay of a held wait copy past ``visibility_timeout`` (a busy pool, a GC
pause) does the same; the soak saw it in every cell that waited.

``checkpoint-outage`` (a checkpoint in an outage fails the task). Redis
completion backend, one 4 s body whose checkpoint comes after 2 s: while the
body runs, the lock Redis refuses writes (NOREPLICAS) for 4 s. The checkpoint
raises the driver's own error instead of ``BackendUnavailable``, the task ends
``FAILURE`` and the job never commits (the soak sees the same with BUSY, a
restart, or a PostgreSQL store outage).

``watch-outage`` (a lost job: the watch copy dropped in a store outage). The
``ignore-then-kill`` setup with the PostgreSQL completion backend: the
redelivered copy of a running 4 s body is dropped and leaves a watch copy;
then the completion store's PostgreSQL goes away for 3 s and the body's
child is killed. The watch copy, which reads the record before it acquires,
meets the outage and is dropped (``Ignore``) instead of waiting, so nothing
is left to run the job.

``wait-then-kill`` (a lost job: a watch copy reads a wait's ``RETRY`` as a
retry). ``ignore-then-kill``, except that the lock Redis is down when the job
is published: the first delivery waits (Celery stores ``RETRY`` for the wait),
the wait copy runs the body, its redelivered copy is dropped and leaves a
watch copy, and the body's child is killed. The watch copy finds ``RETRY`` in
the result backend, takes it for "the original retried, its retry will run
it", and is consumed without running the job.

``retried-then-killed`` (a lost job: a watch copy trusts a retry that was
dropped). A 4 s body runs; the lock Redis restarts under it, other work on
the entity commits with a newer fence, and the visibility sweep's copy of the
message runs the body beside it. The original's commit meets the newer
fence and retries (``StaleFence``, state ``RETRY``); the retry message finds
the copy running and is dropped, leaving a watch copy; the copy's child is
then killed. The watch copy takes the dead holder's lease over, reads
``RETRY`` in the result backend, takes it for "the original retried, its
retry will run it", and is consumed -- but that retry was the message just
dropped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from celery_lockguard.testing import wait_for

from .app import TASK_NAME
from .soak import Environment, Options, StoreFaults, broker_backlog, default_pg, interrupt

IGNORED = "lock.skipped_duplicate|redelivery_of_running_original"
WATCHES = "lock.retry_scheduled|watching_running_original"


def poll(what: str, predicate: Callable[[], Any], timeout: float) -> Any:
    """``predicate()`` once truthy, polled every 50 ms; raises a ``TimeoutError`` after ``timeout`` seconds."""
    return wait_for(predicate, timeout, what)


class Scenario:
    """One job on a small fleet; ``say`` prints with the time since it was published."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.pg = psycopg.connect(env.opts.pg, autocommit=True)
        self.t0 = time.monotonic()
        self.task_id = f"{env.run_id}-job0"

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.2f}s] {msg}", flush=True)

    def publish(self, work_ms: int) -> None:
        self.t0 = time.monotonic()
        self.env.app.tasks[TASK_NAME].apply_async((0, 0, work_ms), task_id=self.task_id)
        opts = self.env.opts
        self.say(
            f"published job 0: a {work_ms / 1000:g} s body, lock TTL {opts.ttl:g} s,"
            f" visibility_timeout {opts.visibility_timeout:g} s"
        )

    def committed(self) -> bool:
        row = self.pg.execute(f"SELECT count(*) FROM {self.env.tables.effects} WHERE job_id = 0").fetchone()
        return bool(row and row[0])

    def backlog(self) -> int:
        return broker_backlog(self.env.broker_server.client(), self.env.queue)

    def log_lines(self, limit: int = 40) -> None:
        print("\nthe workers' log lines about the job:", flush=True)
        shown = 0
        for w in self.env.workers:
            for line in w.output(100_000).splitlines():
                if (self.task_id in line or "SIGKILL" in line) and shown < limit:
                    shown += 1
                    print(f"  {w.nodename.split('@')[0]}: {line[:220]}", flush=True)


def ignore_then_kill(sc: Scenario, wait_first: bool = False) -> int:
    if wait_first:
        sc.env.lock_server.stop()
    sc.publish(4000)
    if wait_first:
        poll("the first delivery to wait", lambda: sc.env.events()["lock.retry_scheduled|backend_unavailable"], 15)
        sc.env.lock_server.start()
        sc.say("the lock Redis was down: the first delivery waited (state RETRY); it is back")
    pid, worker = poll(
        "the body to start",
        lambda: sc.pg.execute(f"SELECT pid, worker FROM {sc.env.tables.executions} WHERE job_id = 0").fetchone(),
        15,
    )
    sc.say(f"body running in pid {pid} on {worker}, holding acct:0")
    poll("the redelivered copy to be ignored", lambda: sc.env.events()[IGNORED], 15)
    sc.say("the visibility sweep redelivered the message; the copy was dropped with Ignore (acked)")
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    sc.say(f"SIGKILL -> pid {pid} (the only run of the job)")
    idle_since: float | None = None
    while time.monotonic() < killed + 20:
        if sc.committed():
            sc.say("job 0 committed: not reproduced")
            return 0
        idle = sc.backlog() == 0
        idle_since = (idle_since or time.monotonic()) if idle else None
        if idle_since is not None and time.monotonic() - idle_since > 2 * sc.env.opts.ttl + 1:
            break
        time.sleep(0.1)
    ev = sc.env.events()
    sc.say(
        f"broker empty (queue and unacked), job 0 never committed: LOST. deliveries {ev['delivery']},"
        f" redelivered {ev['delivery|redelivered']}, ignored as a running original's copy {ev[IGNORED]}"
    )
    sc.log_lines()
    return 1


def watch_storm(sc: Scenario, work_ms: int = 20_000) -> int:
    sc.publish(work_ms)
    done_at: float | None = None
    give_up = time.monotonic() + work_ms / 1000 + 120
    while time.monotonic() < give_up:
        time.sleep(2)
        ev, backlog = sc.env.events(), sc.backlog()
        if done_at is None and sc.committed():
            done_at = time.monotonic()
            sc.say("job 0 committed")
        sc.say(
            f"deliveries {ev['delivery']:>6} · copies dropped as a running original's {ev[IGNORED]:>5}"
            f" · watch copies left {ev[WATCHES]:>5} · messages in the broker {backlog:>4}"
        )
        if done_at is not None and backlog == 0:
            break
        if done_at is not None and time.monotonic() > done_at + 30:
            break
    storm = ev["delivery"] > 50 or backlog > 0
    after = f"{time.monotonic() - done_at:.0f}s after it committed" if done_at is not None else "(never committed)"
    sc.say(f"{'STORM' if storm else 'no storm'}: {ev['delivery']} deliveries for one job; {backlog} messages {after}")
    return 1 if storm else 0


def wait_twice(sc: Scenario) -> int:
    """Two copies of one wait message: the transport duplicates it, and both run the body under one lease."""
    env = sc.env
    env.lock_server.stop()
    sc.publish(4000)
    sc.say("lock Redis stopped: the first delivery waits and publishes its wait copy (same task id)")
    poll("the first delivery to wait", lambda: env.events()["lock.retry_scheduled|backend_unavailable"], 15)

    def holder() -> Any:
        received = [
            (line[:24], w)
            for w in env.workers
            for line in w.output(200_000).splitlines()
            if sc.task_id in line and line.rstrip().endswith("received")
        ]
        return sorted(received, key=lambda r: r[0])[-1][1] if len(received) >= 2 else None

    worker = poll("a worker to receive the wait copy", holder, 10)
    worker.pause()
    sc.say(f"{worker.nodename.split('@')[0]} holds the wait copy (unacknowledged, countdown): SIGSTOP it")
    env.lock_server.start()
    sc.say("lock Redis back; the visibility sweep hands the held wait copy to the other worker")
    rows = f"SELECT pid, fence, t_start, t_end FROM {env.tables.executions} WHERE job_id = 0 ORDER BY id"
    poll("the other worker to run the body", lambda: sc.pg.execute(rows).fetchall(), 15)
    worker.resume()
    sc.say(f"SIGCONT {worker.nodename.split('@')[0]}: its copy of the wait message runs now (countdown passed)")
    time.sleep(3 * env.opts.ttl)
    runs = sc.pg.execute(rows).fetchall()
    for pid, fence, start, end in runs:
        sc.say(f"  body in pid {pid}: fence {fence}, {start - sc.t0:.2f}s -> {(end or 0) - sc.t0:.2f}s")
    twice = any(
        a[1] == b[1] and a[2] < (b[3] or math.inf) and b[2] < (a[3] or math.inf) for a, b in itertools.pairwise(runs)
    )
    sc.say("REPRODUCED: two bodies at once under one lease" if twice else "one body at a time: not reproduced")
    if twice:
        sc.log_lines()
    return 1 if twice else 0


def checkpoint_outage(sc: Scenario) -> int:
    """A checkpoint meets the completion store refusing writes: the body must not fail for good."""
    env = sc.env
    sc.publish(4000)
    rows = f"SELECT count(*) FROM {env.tables.executions} WHERE job_id = 0"
    poll("the body to start", lambda: (sc.pg.execute(rows).fetchone() or (0,))[0], 15)
    faults = StoreFaults(env.lock_server)
    faults.noreplicas(True)
    sc.say("body running (2 s of work before its checkpoint); lock Redis now refuses writes (NOREPLICAS) for 4 s")
    time.sleep(4)
    faults.noreplicas(False)
    sc.say("lock Redis takes writes again")
    try:
        poll("job 0 to commit", sc.committed, 20)
    except TimeoutError:
        meta = env.broker_server.client(db=1).get(f"celery-task-meta-{sc.task_id}")
        state = json.loads(meta) if meta else {}
        result = state.get("result") or {}
        sc.say(
            f"REPRODUCED: job 0 never committed; the task ended {state.get('status')}"
            f" with {result.get('exc_type')}: {str(result.get('exc_message'))[:160]}"
        )
        sc.log_lines()
        return 1
    sc.say("job 0 committed: not reproduced")
    return 0


def watch_outage(sc: Scenario) -> int:
    """The watch copy that must take over a killed original meets the completion store down."""
    env = sc.env
    assert env.proxy is not None
    sc.publish(4000)
    pid, worker = poll(
        "the body to start",
        lambda: sc.pg.execute(f"SELECT pid, worker FROM {env.tables.executions} WHERE job_id = 0").fetchone(),
        15,
    )
    poll("the redelivered copy to be dropped", lambda: env.events()[IGNORED], 15)
    sc.say(f"body running in pid {pid} on {worker}; its redelivered copy was dropped, leaving a watch copy")
    env.proxy.cut()
    os.kill(pid, signal.SIGKILL)
    sc.say(f"completion store (PostgreSQL) cut; SIGKILL -> pid {pid}: the watch copy is all that is left")
    time.sleep(3)
    env.proxy.restore()
    sc.say("completion store back")
    try:
        poll("job 0 to commit", sc.committed, 20)
    except TimeoutError:
        ev = env.events()
        sc.say(
            f"REPRODUCED: job 0 never committed and the broker holds {sc.backlog()} messages;"
            f" watch copies left {ev[WATCHES]}, store outages met {ev['lock.backend_unavailable']}"
        )
        sc.log_lines()
        return 1
    sc.say("job 0 committed: not reproduced")
    return 0


def retried_then_killed(sc: Scenario) -> int:
    """An original that retried, whose retry message was dropped behind a running copy that then died."""
    env = sc.env
    sc.publish(4000)
    rows = f"SELECT pid, t_start FROM {env.tables.executions} WHERE job_id = 0 ORDER BY id"
    first = poll("the body to start", lambda: sc.pg.execute(rows).fetchall(), 15)[0][0]
    env.lock_server.stop()
    env.lock_server.start()
    sc.say(f"body running in pid {first}; lock Redis restarted empty: its lease is gone")
    env.app.tasks[TASK_NAME].apply_async((1, 0, 20), task_id=f"{env.run_id}-job1")
    sc.say("job 1 on the same entity takes the free lease and commits with a newer fence")
    copy = poll("the redelivered copy to run a body beside it", lambda: sc.pg.execute(rows).fetchall()[1:], 15)[0][0]
    sc.say(f"the visibility sweep redelivered job 0: its copy runs the body in pid {copy}")
    poll("the original to retry (StaleFence)", lambda: env.events()["fence.stale"], 15)
    sc.say("the original's commit met the newer fence: StaleFence, retried (state RETRY)")
    poll("the retry to be dropped behind the running copy", lambda: env.events()[IGNORED], 15)
    os.kill(copy, signal.SIGKILL)
    sc.say(f"its retry was dropped behind the running copy (watch left); SIGKILL -> pid {copy}")
    try:
        poll("job 0 to commit", sc.committed, 20)
    except TimeoutError:
        meta = env.broker_server.client(db=1).get(f"celery-task-meta-{sc.task_id}")
        state = json.loads(meta).get("status") if meta else "PENDING"
        sc.say(f"REPRODUCED: job 0 never committed; broker holds {sc.backlog()} messages; its state is {state}")
        sc.log_lines()
        return 1
    sc.say("job 0 committed: not reproduced")
    sc.log_lines()
    return 0


SCENARIOS: dict[str, tuple[Callable[[Scenario], int], dict[str, float]]] = {
    "ignore-then-kill": (ignore_then_kill, {"ttl": 2.0, "visibility_timeout": 1.0}),
    "watch-storm": (watch_storm, {"ttl": 8.0, "visibility_timeout": 1.0}),
    "wait-twice": (wait_twice, {"ttl": 2.0, "visibility_timeout": 1.0}),
    "checkpoint-outage": (checkpoint_outage, {"ttl": 2.0, "visibility_timeout": 8.0}),
    "watch-outage": (watch_outage, {"ttl": 2.0, "visibility_timeout": 1.0}),
    "retried-then-killed": (retried_then_killed, {"ttl": 2.0, "visibility_timeout": 1.0}),
    "wait-then-kill": (lambda sc: ignore_then_kill(sc, wait_first=True), {"ttl": 2.0, "visibility_timeout": 1.0}),
}
#: Scenarios that need the Redis completion backend (the others use PostgreSQL, as the soak's default cell).
REDIS_BACKEND = {"checkpoint-outage"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.repro", description=__doc__.split("\n", 1)[0])
    p.add_argument("scenario", nargs="?", choices=sorted(SCENARIOS), default="ignore-then-kill")
    p.add_argument("--pg", default=None, help="PostgreSQL DSN (default as for chaos.soak)")
    ns = p.parse_args(argv)
    fn, timing = SCENARIOS[ns.scenario]
    opts = Options(workers=2, concurrency=1, pg=ns.pg or default_pg(), pauses=0, restarts=0)
    opts.ttl, opts.visibility_timeout = timing["ttl"], timing["visibility_timeout"]
    run_id = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix=f"chaos-repro-{run_id}-"))
    env = Environment(opts, run_id, log_dir, backend="redis" if ns.scenario in REDIS_BACKEND else "postgresql")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        env.start()
        scenario = Scenario(env)
        try:
            return fn(scenario)
        finally:
            scenario.pg.close()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        env.close(keep=False)
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
