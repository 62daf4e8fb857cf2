"""Debounce (``lock_debounce``): round trips per publish and per task, against the single lease, in one run.

Three tasks on one app, in the same rounds: a plain task (the baseline), a
``LockedTask`` (the single lease) and the same ``LockedTask`` with
``lock_debounce``. Per round each variant publishes N messages with distinct
entities -- the debounced one in bursts of B messages per entity (B-1 of them
superseded, one run per burst) -- and, once the bursts are due, every message
is delivered through Celery's real tracer in this process
(``build_tracer(eager=False)``, as a worker child runs it: the debounce check,
the lease, the result write), so the lock's own round trips are not buried
under the broker and the pool.

Round trips are counted at the client (``bench.counting``: sent, and waited =
sent minus deferred sends) and as EVALSHA calls on the private lock server
(INFO commandstats; nothing else runs there). Figures *added* over the plain
task are the cost of the lease or of debounce. Every burst must run exactly
once with its last arguments, every lease task once: otherwise the bench fails.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.app.trace import build_tracer

from celery_lockguard import LockedTask
from celery_lockguard.testing import settle

from . import counting
from .e2e import BenchFailure
from .stats import Summary

PLAIN, LEASE, DEBOUNCED = "plain task", "LockedTask (single lease)", "LockedTask + lock_debounce"
VARIANTS = (PLAIN, LEASE, DEBOUNCED)
#: The debounce delay of the benchmark task: short, the bench waits it out once per round.
DELAY = 0.05


@dataclass
class DebounceRow:
    """One variant: per publish and per delivered message (and per run), medians over rounds."""

    name: str
    publish_sent: Summary = field(default_factory=Summary)
    publish_waited: Summary = field(default_factory=Summary)
    publish_evalsha: Summary = field(default_factory=Summary)
    publish_us: Summary = field(default_factory=Summary)
    deliver_sent: Summary = field(default_factory=Summary)
    deliver_waited: Summary = field(default_factory=Summary)
    deliver_evalsha: Summary = field(default_factory=Summary)
    deliver_us: Summary = field(default_factory=Summary)
    #: Per run (the debounced variant runs once per burst): lock-server EVALSHA calls of the whole burst.
    evalsha_per_run: Summary = field(default_factory=Summary)


@dataclass
class DebounceResult:
    burst: int
    n: int
    rounds: int
    rows: list[DebounceRow]


def _app(broker: str, locks: str, prefix: str) -> tuple[Celery, dict[str, Any], list[tuple[str, Any]]]:
    app = Celery("lockguard_debounce_bench", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{prefix}.q",
        lockguard_redis_url=locks,
        lockguard_key_prefix=prefix,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:results:"},
        task_publish_retry=False,
    )
    ran: list[tuple[str, Any]] = []

    @app.task(name="db_plain", shared=False)
    def db_plain(i: int, v: int) -> None:
        ran.append(("db_plain", (i, v)))

    @app.task(name="db_lease", base=LockedTask, lock_key="item:{i}", shared=False)
    def db_lease(i: int, v: int) -> None:
        ran.append(("db_lease", (i, v)))

    @app.task(name="db_debounced", base=LockedTask, lock_key="item:{i}", lock_debounce=DELAY, shared=False)
    def db_debounced(i: int, v: int) -> None:
        ran.append(("db_debounced", (i, v)))

    return app, {PLAIN: db_plain, LEASE: db_lease, DEBOUNCED: db_debounced}, ran


def _messages(r: redis.Redis, app: Celery) -> list[dict[str, Any]]:
    """Every message in the queue, oldest first, removed from it (they are delivered by hand)."""
    name = f"{app.conf.broker_transport_options['global_keyprefix']}{app.conf.task_default_queue}"
    raw = r.lrange(name, 0, -1)
    r.delete(name)
    out = []
    for item in reversed(raw):
        payload = json.loads(item)
        body = json.loads(base64.b64decode(payload["body"]))
        out.append({"headers": payload["headers"], "args": body[0], "kwargs": body[1]})
    return out


def _deliver(app: Celery, msg: dict[str, Any]) -> None:
    h = msg["headers"]
    task = app.tasks[h["task"]]
    request = {
        "id": h["id"],
        "task": task.name,
        "args": msg["args"],
        "kwargs": msg["kwargs"],
        "hostname": "bench@debounce",
        "retries": 0,
        "is_eager": False,
        "root_id": h["id"],
        "parent_id": None,
        "delivery_info": {"exchange": "", "routing_key": app.conf.task_default_queue, "redelivered": False},
        **{k: v for k, v in h.items() if k.startswith("lockguard_")},
    }
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=True)
    tracer(h["id"], msg["args"], msg["kwargs"], request)


def _evalsha(c: redis.Redis) -> int:
    return int(counting.commandstats(c).get("evalsha", 0))


def measure(broker_url: str, lock_url: str, rounds: int, n: int, burst: int = 10) -> DebounceResult:
    """``rounds`` rounds of ``n`` publishes and deliveries per variant (bursts of ``burst`` when debounced)."""
    prefix = f"benchdb{uuid.uuid4().hex[:6]}"
    app, tasks, ran = _app(broker_url, lock_url, prefix)
    broker = redis.Redis.from_url(broker_url)
    locks = redis.Redis.from_url(lock_url, decode_responses=True)
    rows = {name: DebounceRow(name) for name in VARIANTS}
    entity = iter(range(10**9))
    counting.install()
    try:
        for rnd in range(-1, rounds):  # round -1 warms up: settings, clients, scripts loaded
            for name in VARIANTS:
                task, row = tasks[name], rows[name]
                per = burst if name == DEBOUNCED else 1
                entities = [next(entity) for _ in range(n // per)]
                plan = [(i, v) for i in entities for v in range(per)]
                e0, s0, d0, t0 = _evalsha(locks), counting.sent(), counting.deferred(), time.perf_counter()
                for i, v in plan:
                    task.delay(i, v)
                pub_us = (time.perf_counter() - t0) / len(plan) * 1e6
                settle()
                pub_sent, pub_def = counting.sent() - s0, counting.deferred() - d0
                pub_eval = _evalsha(locks) - e0
                time.sleep(DELAY * 2)  # the bursts fall due
                msgs = _messages(broker, app)
                del ran[:]
                e0, s0, d0, t0 = _evalsha(locks), counting.sent(), counting.deferred(), time.perf_counter()
                for msg in msgs:
                    _deliver(app, msg)
                settle()
                del_us = (time.perf_counter() - t0) / len(msgs) * 1e6
                del_sent, del_def = counting.sent() - s0, counting.deferred() - d0
                del_eval = _evalsha(locks) - e0
                # One body per lease task; one per burst, with the burst's last arguments, when debounced.
                expected = sorted({(task.name, (i, per - 1 if name == DEBOUNCED else v)) for i, v in plan})
                if sorted(ran) != expected:
                    raise BenchFailure(f"{name}: ran {len(ran)} bodies, expected {len(expected)} (one per burst)")
                if rnd < 0:
                    continue
                m = len(plan)
                row.publish_sent.add(pub_sent / m)
                row.publish_waited.add((pub_sent - pub_def) / m)
                row.publish_evalsha.add(pub_eval / m)
                row.publish_us.add(pub_us)
                row.deliver_sent.add(del_sent / len(msgs))
                row.deliver_waited.add((del_sent - del_def) / len(msgs))
                row.deliver_evalsha.add(del_eval / len(msgs))
                row.deliver_us.add(del_us)
                row.evalsha_per_run.add(del_eval / max(1, len(expected)))
    finally:
        counting.uninstall()
        broker.close()
        locks.close()
    return DebounceResult(burst=burst, n=n, rounds=rounds, rows=[rows[name] for name in VARIANTS])


def added(result: DebounceResult) -> dict[str, dict[str, float]]:
    """Per variant, what it adds over the plain task: sent and waited per publish and per delivery."""
    base = result.rows[0]
    out: dict[str, dict[str, float]] = {}
    for row in result.rows[1:]:
        out[row.name] = {
            "publish_sent": row.publish_sent.median - base.publish_sent.median,
            "publish_waited": row.publish_waited.median - base.publish_waited.median,
            "deliver_sent": row.deliver_sent.median - base.deliver_sent.median,
            "deliver_waited": row.deliver_waited.median - base.deliver_waited.median,
        }
    return out
