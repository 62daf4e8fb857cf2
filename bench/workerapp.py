"""The Celery app the benchmark runs in a real ``celery worker`` (prefork) subprocess.

Configured from the JSON in ``LG_BENCH_CONFIG`` (broker URL, queue, key
prefix; optionally ``lock_url`` and ``cluster`` for a lock Redis other than
the broker, ``backend`` for the result backend and the bodies' records,
``completion_backend`` and ``completion_table`` for the PostgreSQL store,
``handoff_options`` for the hand-off task); the driver builds the same app
with :func:`create_app` to publish.

* Throughput tasks (``tp_*``): one tiny body per library, ``ignore_result``
  so the only Redis work a task adds is its lock's. Each body counts its run
  in-process; ``tp_mark`` reports those counts and this process's round trips
  (``bench.counting``) so the driver checks that every task ran exactly once
  and reads round trips per task at the client, without a round trip per task.
  ``tp_deferred`` is ``tp_locked`` with its RELEASE left in flight although
  the server is on this host (``_wire.DEFER_NEAR`` around each call), as it
  is to a server on another host: the trade of waiting, in the same run.
  ``tp_by_hand`` is a floor: ``SET NX PX`` + ``DEL`` around the body through
  redis-py (``peers.by_hand``), a lock with nothing beyond those two commands.
  ``tp_scripts`` sends lockguard's own ACQUIRE and RELEASE around the body with
  none of the task logic (``floors.held``), and ``tp_noop_scripts`` the same
  bytes to scripts that do nothing: what the task logic and the scripts' server
  work each cost the worker, in the same run.
* Contention tasks (``hot_*``): one hot key, a 0.1 s body that records its
  start and end, so the driver checks that no two bodies overlapped. Their
  ``lock_ttl`` is 5 s: a waiter's back-off is capped by the holder's TTL, so
  the default 30 s would only stretch the ``retry`` run's tail.
* Hand-off task (``ho_charge``): ``charge(customer, amount, hold)`` locked on
  the customer with the defaults a new user gets (``on_locked="skip"``: a
  charge of another amount is different work, so it waits); its body records
  start and end (``time.time()``, one machine) and sleeps ``hold`` seconds.
  ``handoff_options`` in the config are added to its task options, so a later
  wake-up mechanism is measured by the same scenario.

structlog is configured as a production app would: below INFO is dropped
(lockguard's per-task ``lock.acquired``/``lock.released`` are debug), and
loggers are cached. Unconfigured structlog would print every debug event.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Any

import redis
import structlog
from celery import Celery

from celery_lockguard import Lease, LockedTask, settings
from celery_lockguard import _connection as connection
from celery_lockguard import _lease as lease_ops
from celery_lockguard import _wire as wire

from . import counting, floors, peers

counting.install()
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    cache_logger_on_first_use=True,
)

#: Bodies run in this process, per throughput variant (read by ``tp_mark``).
RUNS: Counter[str] = Counter()

#: A floor for a lock taken in the worker: the two commands users write by hand before a library.
FLOOR = "floor: SET NX PX + DEL by hand in the worker"

#: lockguard's ACQUIRE and RELEASE with none of the task logic, and the same bytes to do-nothing scripts.
SCRIPTS_FLOOR = "floor: lockguard's ACQUIRE and RELEASE in the worker, no task logic"
NOOP_FLOOR = "floor: the same commands to scripts that do nothing on the server"

#: LockedTask with RELEASE deferred, as to a server on another host.
DEFERRED = "LockedTask, RELEASE deferred (as to another host)"

#: Two entities (docs/multi-entity.md): ``lock_key=("item:{i}", "other:{i}")``, held together or not at all.
TWO_ENTITIES = "LockedTask, two entities"
#: The same two entities as nested single locks: ``lock_key="item:{i}"``, a second Lease taken in the body.
NESTED = "LockedTask + a nested Lease in the body"

#: Throughput variants: display name -> task name.
TP_TASKS = {
    "plain task": "tp_plain",
    "LockedTask": "tp_locked",
    DEFERRED: "tp_deferred",
    "LockedTask until_done": "tp_until_done",
    "celery-once QueueOnce": "tp_once",
    "celery-singleton Singleton": "tp_singleton",
    FLOOR: "tp_by_hand",
    SCRIPTS_FLOOR: "tp_scripts",
    NOOP_FLOOR: "tp_noop_scripts",
}

#: Contention variants: display name -> task name.
HOT_TASKS = {
    "LockedTask on_locked=skip": "hot_skip",
    "LockedTask on_locked=retry": "hot_retry",
    "LockedTask on_locked=raise": "hot_raise",
    "LockedTask lock_mode=until_done": "hot_until_done",
    "celery-once QueueOnce (graceful)": "hot_once",
    "celery-singleton Singleton": "hot_singleton",
}

HOT_BODY_SECONDS = 0.1


class _Deferred(LockedTask):
    """A LockedTask whose replies are deferred on this host's server too (``_wire.DEFER_NEAR``, per call)."""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        before, wire.DEFER_NEAR = wire.DEFER_NEAR, True
        try:
            return super().__call__(*args, **kwargs)
        finally:
            wire.DEFER_NEAR = before


def create_app(cfg: dict[str, Any]) -> Celery:
    """The benchmark app for ``cfg``: the worker and the driver build the same one."""
    from celery_once import QueueOnce  # bench environment only
    from celery_singleton import Singleton

    peers.forget_clients()

    url = cfg["broker"]
    prefix = cfg["prefix"]
    backend = cfg.get("backend", url)
    app = Celery("lockguard_bench", broker=url, backend=backend)
    lockguard: dict[str, Any] = {
        "lockguard_redis_url": cfg.get("lock_url", url),
        "lockguard_redis_cluster": bool(cfg.get("cluster", False)),
    }
    if cfg.get("completion_backend"):
        lockguard["lockguard_completion_backend"] = cfg["completion_backend"]
        lockguard["lockguard_completion_table"] = cfg["completion_table"]
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_key_prefix=prefix,
        **lockguard,
        broker_transport_options={"global_keyprefix": f"{prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:results:"},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=900,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url, "default_timeout": 3600}},
        singleton_backend_url=url,
        singleton_key_prefix=f"{prefix}:singleton:",
        singleton_lock_expiry=3600,
    )
    # tp_mark blocks on its gate or barrier up to 120 s: redis-py 8's default 5 s socket timeout is too short.
    rec = redis.Redis.from_url(backend, decode_responses=True, socket_timeout=180.0)
    marks = f"{prefix}:marks"
    record_key = f"{prefix}:bodies"

    # -- throughput -------------------------------------------------------------

    @app.task(name="tp_plain", ignore_result=True, shared=False)
    def tp_plain(i: int) -> None:
        RUNS["tp_plain"] += 1

    @app.task(name="tp_locked", base=LockedTask, lock_key="item:{i}", ignore_result=True, shared=False)
    def tp_locked(i: int) -> None:
        RUNS["tp_locked"] += 1

    @app.task(name="tp_deferred", base=_Deferred, lock_key="item:{i}", ignore_result=True, shared=False)
    def tp_deferred(i: int) -> None:
        RUNS["tp_deferred"] += 1

    @app.task(
        name="tp_until_done",
        base=LockedTask,
        lock_key="item:{i}",
        lock_mode="until_done",
        ignore_result=True,
        shared=False,
    )
    def tp_until_done(i: int) -> None:
        RUNS["tp_until_done"] += 1

    @app.task(
        name="tp_multi",
        base=LockedTask,
        lock_key=("item:{i}", "other:{i}"),
        ignore_result=True,
        shared=False,
    )
    def tp_multi(i: int) -> None:
        RUNS["tp_multi"] += 1

    @app.task(name="tp_nested", base=LockedTask, bind=True, lock_key="item:{i}", ignore_result=True, shared=False)
    def tp_nested(self: Any, i: int) -> None:
        """The second entity as a user nests it today: a Lease taken and given back inside the held one."""
        s = settings(app)
        client = connection.client(s)
        inner = lease_ops.acquire(
            client,
            s.key_prefix,
            f"other:{i}",
            ttl_ms=30_000,
            task_id=self.request.id,
            task_name=self.name,
            digest="",
            worker="",
            fence_ttl_ms=int(s.fence_ttl * 1000),
        )
        if not isinstance(inner, Lease):
            raise RuntimeError(f"other:{i}: {inner!r}: the benchmark's keys are distinct")
        try:
            RUNS["tp_nested"] += 1
        finally:
            lease_ops.release(client, inner, s.key_prefix)

    @app.task(name="tp_once", base=QueueOnce, once={"graceful": True}, ignore_result=True, shared=False)
    def tp_once(i: int) -> None:
        RUNS["tp_once"] += 1

    @app.task(name="tp_singleton", base=Singleton, ignore_result=True, shared=False)
    def tp_singleton(i: int) -> None:
        RUNS["tp_singleton"] += 1

    by_hand = redis.Redis.from_url(cfg.get("lock_url", url), decode_responses=True)

    @app.task(name="tp_by_hand", ignore_result=True, shared=False)
    def tp_by_hand(i: int) -> None:
        """SET NX PX with a uuid4 token, the body, DEL: two round trips, nothing checked, fenced or recorded."""
        with peers.by_hand(by_hand, f"{prefix}:byhand:{i}"):
            RUNS["tp_by_hand"] += 1

    scripts_client = redis.Redis.from_url(cfg.get("lock_url", url), decode_responses=True)

    @app.task(name="tp_scripts", bind=True, ignore_result=True, shared=False)
    def tp_scripts(self: Any, i: int) -> None:
        """lockguard's ACQUIRE and RELEASE around the body, both waited for, with none of the task logic."""
        with floors.held(scripts_client, prefix, f"scripts:{i}", self.request.id, self.name):
            RUNS["tp_scripts"] += 1

    @app.task(name="tp_noop_scripts", bind=True, ignore_result=True, shared=False)
    def tp_noop_scripts(self: Any, i: int) -> None:
        """The same two commands to scripts that do nothing: the wire without the scripts' server work."""
        with floors.held(scripts_client, prefix, f"noop:{i}", self.request.id, self.name, floors.NOOP):
            RUNS["tp_noop_scripts"] += 1

    @app.task(name="tp_mark", ignore_result=True, shared=False)
    def tp_mark(tag: str, gate: str | None = None, barrier: str | None = None) -> None:
        """Report time, runs and round trips of this pool child to ``{marks}:{tag}``.

        With ``gate``: first say ``ready`` and block until the driver opens the gate, so
        one start marker per child holds every child of a ``-c N`` worker before the
        tasks are published. With ``barrier``: block after reporting until the driver
        releases it, so N end markers land on N distinct children (fair scheduling gives
        a marker only to an idle child) and the last one starts after every task ended.
        """
        if gate is not None:
            rec.rpush(f"{marks}:ready", json.dumps({"pid": os.getpid()}))
            if rec.blpop([gate], timeout=120) is None:
                raise RuntimeError(f"gate {gate} never opened")
        sent, deferred = counting.sent(), counting.deferred()  # read first: the marker's own push is not counted
        cpu = os.times()  # this child's CPU, every thread (its renewer's too)
        mark = {"tag": tag, "t": time.time(), "sent": sent, "deferred": deferred, "runs": dict(RUNS)}
        mark.update(cpu=cpu.user + cpu.system, sys=cpu.system)
        mark.update(pid=os.getpid(), background=counting.background())
        rec.rpush(f"{marks}:{tag}", json.dumps(mark))
        if barrier is not None and rec.blpop([barrier], timeout=120) is None:
            raise RuntimeError(f"barrier {barrier} never opened")

    # -- scaling (bench.scaling) -------------------------------------------------

    lock_url = cfg.get("lock_url", url)
    if cfg.get("cluster"):
        from redis.cluster import RedisCluster

        sc_locks: Any = RedisCluster.from_url(lock_url, decode_responses=True)
    else:
        sc_locks = redis.Redis.from_url(lock_url, decode_responses=True)

    def sc_done(counter: str, total: int) -> None:
        """Count this run on the broker's server; the run that completes ``total`` says so (the driver's clock)."""
        if rec.incr(counter) == total:
            rec.rpush(f"{counter}:finished", "1")

    @app.task(name="sc_plain", ignore_result=True, shared=False)
    def sc_plain(i: int, k: int, counter: str, total: int) -> None:
        sc_done(counter, total)

    @app.task(name="sc_locked", base=LockedTask, lock_key="sc:{k}", ignore_result=True, shared=False)
    def sc_locked(i: int, k: int, counter: str, total: int) -> None:
        sc_done(counter, total)

    @app.task(name="sc_redispy", ignore_result=True, shared=False)
    def sc_redispy(i: int, k: int, counter: str, total: int) -> None:
        """redis-py's ``Lock`` on the same entity, blocking until it gets it (polling every 2 ms)."""
        with sc_locks.lock(f"{prefix}:rp:{{sc:{k}}}", timeout=30, sleep=0.002):
            sc_done(counter, total)

    # -- contention -------------------------------------------------------------

    def hot_body(name: str, task_id: str, k: str) -> str:
        rec.rpush(record_key, json.dumps({"ev": "start", "task": name, "id": task_id, "t": time.time()}))
        time.sleep(HOT_BODY_SECONDS)  # the simulated work itself, not a synchronisation
        rec.rpush(record_key, json.dumps({"ev": "end", "task": name, "id": task_id, "t": time.time()}))
        return "ran"

    def locked_hot(name: str, policy: str) -> None:
        @app.task(name=name, base=LockedTask, bind=True, lock_key="hot:{k}", lock_ttl=5, on_locked=policy, shared=False)
        def hot(self: Any, k: str) -> str:
            return hot_body(name, self.request.id, k)

    for name, policy in (("hot_skip", "skip"), ("hot_retry", "retry"), ("hot_raise", "raise")):
        locked_hot(name, policy)

    @app.task(
        name="hot_until_done",
        base=LockedTask,
        bind=True,
        lock_key="hot:{k}",
        lock_ttl=5,
        lock_mode="until_done",
        shared=False,
    )
    def hot_until_done(self: Any, k: str) -> str:
        return hot_body("hot_until_done", self.request.id, k)

    @app.task(name="hot_once", base=QueueOnce, bind=True, once={"graceful": True}, shared=False)
    def hot_once(self: Any, k: str) -> str:
        return hot_body("hot_once", self.request.id, k)

    @app.task(name="hot_singleton", base=Singleton, bind=True, shared=False)
    def hot_singleton(self: Any, k: str) -> str:
        return hot_body("hot_singleton", self.request.id, k)

    # -- hand-off -----------------------------------------------------------------

    handoff_key = f"{prefix}:handoff"
    handoff_options: dict[str, Any] = dict(cfg.get("handoff_options") or {})

    @app.task(
        name="ho_charge",
        base=LockedTask,
        bind=True,
        lock_key="customer:{customer}",
        ignore_result=True,
        shared=False,
        **handoff_options,
    )
    def ho_charge(self: Any, customer: int, amount: int, hold: float) -> None:
        """One charge of ``amount`` for ``customer``: records its start and end around ``hold`` seconds."""
        rec.rpush(handoff_key, json.dumps({"ev": "start", "amount": amount, "id": self.request.id, "t": time.time()}))
        time.sleep(hold)  # the simulated work itself, not a synchronisation
        rec.rpush(handoff_key, json.dumps({"ev": "end", "amount": amount, "id": self.request.id, "t": time.time()}))

    return app


app = create_app(json.loads(os.environ["LG_BENCH_CONFIG"])) if "LG_BENCH_CONFIG" in os.environ else None
