"""Every lease end wakes the oldest parked waiter (issue 29 item 5): real prefork workers, real Redis.

Each waiter parks behind a lease of 30 s (``tests/wakeapp.py``), so its safety copy comes back 30-38 s
later; a waiter that starts within :data:`BOUND` of the lease's end was woken by that end. Before every
lease end went through the one wake-up path, a forced release, the end of ``lockguard.hold()``, a freed
``lock_limit`` slot and a lease cut short from the worker's main process left the waiter to its safety copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_lockguard import _lease as L
from celery_lockguard._headers import WAITS
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .harness import ROOT
from .test_workers import records

pytestmark = pytest.mark.integration

#: Seconds from a lease's end to the waiter's start: far below the 30 s safety countdown.
BOUND = 5.0


def parked(r: redis.Redis, prefix: str, key: str, n: int = 1) -> None:
    """Wait until ``n`` deliveries are parked in ``key``'s waiter queue."""
    wait_for(lambda: r.llen(f"{prefix}:v1:{{{key}}}:wait") >= n, 30, what=f"{n} waiter(s) parked on {key}")


def started(r: redis.Redis, prefix: str, task_id: str, timeout: float) -> float:
    """The time the body of ``task_id`` started (its record), waiting up to ``timeout`` seconds for it."""

    def start() -> float | None:
        rows = [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == task_id]
        return rows[0]["t"] if rows else None

    return wait_for(start, timeout, what=f"the waiter {task_id} to start (its safety copy is 30 s away)")


def hold(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    """A foreign holder of ``wake:{key}`` for 30 s (other work: a contender parks behind it)."""
    got = L.acquire(
        r, prefix, f"wake:{key}", ttl_ms=30_000, task_id=f"holder-{uuid.uuid4().hex[:6]}", task_name="ops.holder",
        digest="d", worker="w@h", fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease), got
    return got


CLI_APP = """
    import json, os
    from celery import Celery
    cfg = json.loads(os.environ["LG_CONFIG"])
    # The operator's app: same broker, queue and lock settings as the workers, none of their tasks.
    app = Celery("ops", broker=cfg["broker"], backend=cfg["broker"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        lockguard_redis_url=cfg["lock_url"],
        lockguard_key_prefix=cfg["prefix"],
        broker_transport_options={"global_keyprefix": f"{cfg['prefix']}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{cfg['prefix']}:results:"},
    )
"""


def test_a_forced_release_from_the_cli_wakes_the_parked_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    key = uuid.uuid4().hex[:8]
    hold(r, prefix, key)
    waiter = app.tasks["wake_task"].delay(key, "", "waiter")
    parked(r, prefix, f"wake:{key}")
    (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"wake:{key}", "-y"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    released_at = time.time()
    assert out.returncode == 0, out.stderr
    # The operator's app does not register wake_task: the woken copy went out by name.
    assert started(r, prefix, waiter.id, BOUND) - released_at < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"
    assert f"woke the oldest waiter ({waiter.id})" in out.stdout, out.stdout


def test_the_end_of_the_plugin_hold_wakes_the_parked_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, lockguard: Any
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["wake_task"]
    with lockguard.hold(task, key, "", "held", ttl=30):
        waiter = task.delay(key, "", "waiter")
        parked(r, prefix, f"wake:{key}")
    ended_at = time.time()
    assert started(r, prefix, waiter.id, BOUND) - ended_at < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"


def test_a_freed_lock_limit_slot_wakes_the_parked_waiter_into_that_slot(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["wake_limited"]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    holders = [task.delay(key, gate, f"h{i}") for i, gate in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix) if x["ev"] == "start"]) == 2, 30, what="both slots taken")
    # A waiter that already waited six times: were it backing off, its next try would be 8-16 s away.
    waiter = task.apply_async((key, "", "waiter"), headers={WAITS: 6})
    wait_for(lambda: waiter.state == "RETRY", 30, what="the waiter to wait (parked or backing off)")
    r.set(gates[1], 1)  # the holder of one slot ends
    ended = wait_for(lambda: next((x["t"] for x in records(r, prefix) if x.get("tag") == "h1" and x["ev"] == "end"),
                                  None), 30, what="h1 to end")  # fmt: skip
    assert started(r, prefix, waiter.id, BOUND + 2) - ended < BOUND
    out = waiter.get(timeout=30)
    assert out["slot"] == holders[1].get(timeout=30)["slot"], "woken into the slot that was freed"
    r.set(gates[0], 1)
    holders[0].get(timeout=30)


def test_a_holder_terminated_from_the_main_process_wakes_the_waiter_once_its_grace_is_out(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    key = uuid.uuid4().hex[:8]
    holder = app.tasks["wake_task"].delay(key, f"{prefix}:never", "holder")
    wait_for(lambda: r.exists(f"{prefix}:v1:{{wake:{key}}}:lock") and records(r, prefix), 30, what="the holder")
    waiter = app.tasks["wake_task"].delay(key, "", "waiter")
    parked(r, prefix, f"wake:{key}")
    # SIGKILL: the child runs no release of its own (SIGTERM would unwind the body through it).
    app.control.revoke(holder.id, terminate=True, signal="SIGKILL")
    revoked_at = time.time()
    # The main process cut the lease to the shorten grace (2 s); once it is out, the end wakes the waiter.
    assert started(r, prefix, waiter.id, BOUND + 2) - revoked_at < BOUND
    assert waiter.get(timeout=30)["tag"] == "waiter"


# -- a workflow's lease --------------------------------------------------------------------------------------


def _plain_started(r: redis.Redis, cfg: dict[str, Any], tenant: str, timeout: float) -> float:
    from .test_workflow_workers import rows

    def start() -> float | None:
        return next((x["t"] for x in rows(r, cfg, tenant) if x["tag"] == "plain" and x["ev"] == "start"), None)

    return wait_for(start, timeout, what="the plain task waiting on the workflow's entity to start")


def test_revoking_the_member_a_workflow_gap_waits_for_wakes_the_parked_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chain

    from celery_lockguard import workflow

    from .test_workflow_workers import lease_of, start_worker
    from .workflowapp import PIPELINE, create_app

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg)
    app = create_app(cfg)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    sig = chain(step.s(tenant=tenant, tag="s1"), step.s(tenant=tenant, tag="s2").set(countdown=5))
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    wait_for(lambda: lease_of(r, cfg, tenant).get("state") == "gap", 60, what="s1 to hand the lease on")
    app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")  # parks behind the gap: safety copy 300 s away
    parked(r, prefix, f"tenant:{tenant}:pipeline")
    app.control.revoke(res.id)  # s2 waits for its countdown: WORKFLOW_ABORT frees the gap when it arrives
    wait_for(lambda: lease_of(r, cfg, tenant).get("state") != "gap", 30, what="the revoked member's gap to end")
    freed_at = time.time()
    assert _plain_started(r, cfg, tenant, BOUND) - freed_at < BOUND


def test_terminating_a_running_workflow_member_wakes_the_parked_waiter_once_the_grace_is_out(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    from celery import chain

    from celery_lockguard import workflow

    from .test_workflow_workers import rows, start_worker
    from .workflowapp import PIPELINE, create_app

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg)
    app = create_app(cfg)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    sig = chain(
        app.tasks["wf.gate"].s(tenant=tenant, tag="held", gate=str(tmp_path / "never")),
        app.tasks["wf.step"].s(tenant=tenant, tag="s2"),
    )
    workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, tenant)), 60, what="the gated member to start")
    running = next(x for x in rows(r, cfg, tenant) if x["tag"] == "held")
    app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")  # parks behind the workflow: 60 s away
    parked(r, prefix, f"tenant:{tenant}:pipeline")
    app.control.revoke(running["task_id"], terminate=True, signal="SIGKILL")
    revoked_at = time.time()
    # Cut to the shorten grace (2 s) by the main process; once it is out, the lease's end wakes the waiter.
    assert _plain_started(r, cfg, tenant, BOUND + 2) - revoked_at < BOUND
