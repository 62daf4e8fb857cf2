"""``python -m chaos.repro``: the smallest run that loses a job, reduced from a soak failure.

One job, no duplicates, two workers with one child each, Redis broker with
``acks_late`` + ``reject_on_worker_lost`` and a ``visibility_timeout`` (1 s)
shorter than the body (4 s):

1. the body starts on a child of worker A and holds the lease ``acct:0``;
2. the transport's visibility sweep moves the still-unacknowledged message
   from ``unacked`` back to the queue; worker B receives the copy;
3. LockedTask sees its own task id holding a live lease and drops the copy
   with ``Ignore`` (event ``lock.skipped_duplicate``, reason
   ``redelivery_of_running_original``) -- Celery acknowledges it;
4. the child running the body is killed (SIGKILL): worker A rejects the
   original delivery with requeue, but the transport's ``reject`` restores
   from ``unacked`` only, where step 2 removed it -- nothing is requeued;
5. the broker is empty and the job never committed: lost.

Exit status 1 when the job was lost (the defect reproduced), 0 when it
committed. Every process and table is cleaned up as in the soak.
"""

from __future__ import annotations

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

from .app import TASK_NAME
from .soak import Environment, Options, broker_backlog, default_pg, interrupt

IGNORED = "lock.skipped_duplicate|redelivery_of_running_original"


def poll(what: str, predicate: Callable[[], Any], timeout: float) -> Any:
    """``predicate()`` once truthy, polled every 50 ms; raises after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
    return value


def main(argv: list[str] | None = None) -> int:
    pg_url = argv[0] if argv else default_pg()
    opts = Options(workers=2, concurrency=1, ttl=2.0, visibility_timeout=1.0, pg=pg_url, pauses=0, restarts=0)
    run_id = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix=f"chaos-repro-{run_id}-"))
    env = Environment(opts, run_id, log_dir)
    previous = signal.signal(signal.SIGTERM, interrupt)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:5.2f}s] {msg}", flush=True)

    try:
        env.start()
        pg = psycopg.connect(opts.pg, autocommit=True)  # closed with the process; the tables go in close()
        t0 = time.monotonic()
        task_id = f"{run_id}-job0"
        env.app.tasks[TASK_NAME].apply_async((0, 0, 4000), task_id=task_id)
        say(f"published job 0 (task id {task_id}): a 4 s body, visibility_timeout 1 s")
        row = poll(
            "the body to start",
            lambda: pg.execute(f"SELECT pid, worker FROM {env.tables.executions} WHERE job_id = 0").fetchone(),
            15,
        )
        pid, worker = row
        say(f"body running in pid {pid} on {worker}, holding acct:0")
        poll("the redelivered copy to be ignored", lambda: env.events()[IGNORED], 15)
        say("the visibility sweep redelivered the message; the copy was dropped with Ignore (acked)")
        signal_sent = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        say(f"SIGKILL -> pid {pid} (the only run of the job)")
        broker = env.broker_server.client()
        effects = f"SELECT count(*) FROM {env.tables.effects} WHERE job_id = 0"
        idle_since: float | None = None
        while time.monotonic() < signal_sent + 20:
            if (pg.execute(effects).fetchone() or (0,))[0]:
                say("job 0 committed: not reproduced")
                return 0
            idle = broker_backlog(broker, env.queue) == 0
            idle_since = (idle_since or time.monotonic()) if idle else None
            if idle_since is not None and time.monotonic() - idle_since > 2 * opts.ttl + 1:
                break
            time.sleep(0.1)
        ev = env.events()
        say(
            f"broker empty (queue and unacked), job 0 never committed: LOST. deliveries {ev['delivery']},"
            f" redelivered {ev['delivery|redelivered']}, ignored as a running original's copy {ev[IGNORED]}"
        )
        print("\nthe workers' log lines about the job:", flush=True)
        for w in env.workers:
            for line in w.log_tail(100_000).splitlines():
                if task_id in line or "SIGKILL" in line:
                    print(f"  {w.nodename.split('@')[0]}: {line[:220]}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        env.close(keep=False)
        shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
