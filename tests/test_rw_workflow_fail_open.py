"""rw review: a fail_open workflow member whose own nested lock's ACQUIRE times out against a stalled lock Redis
(the workflow's first member: its WORKFLOW_ENTER timed out first, so it runs unlocked). Whatever the stalled
commands took when the server thaws, after the body the member's entity is free at once for other work, not after
lock_ttl. (Observed: the ENTER's timeout drops the child's connection, so the ACQUIRE times out on a new
connection's handshake and never reaches the server: no orphan arises in this order.)"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain

from celery_lockguard import workflow
from celery_lockguard.testing import RedisServer, wait_for

from .conftest import Fleet, amqp_url, make_cfg
from .test_workflow_workers import start_worker
from .workflowapp import PIPELINE, create_app

pytestmark = pytest.mark.integration


def rows(r: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in r.lrange(f"{prefix}:wf", 0, -1)]


def test_fail_open_member_whose_own_acquire_timed_out_frees_its_entity(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    with RedisServer() as srv:
        cfg = make_cfg(
            prefix, redis_url, broker=amqp_url(), backend=redis_url, lock_url=srv.url, on_unavailable="fail_open"
        )
        app = create_app(cfg)
        w = start_worker(fleet, cfg, concurrency=1)
        lock = srv.client()
        tenant, inv = uuid.uuid4().hex[:6], int(time.time() * 1000) % 1000000
        g2 = tmp_path / "g2"
        app.tasks["wf.hold_invoice"].delay(tenant=tenant, tag="warm", invoice=inv + 1, seconds=0).get(timeout=30)
        sig = chain(
            app.tasks["wf.invoice_gate"].s(tenant=tenant, tag="m", invoice=inv, gate=str(g2)),
            app.tasks["wf.step"].s(tenant=tenant, tag="b", seconds=0),
        )
        res = workflow(sig, lock_key=PIPELINE, tenant=tenant, on_unavailable="fail_open", gap_ttl=30).apply_async(
            countdown=1
        )
        time.sleep(0.5)
        srv.pause()
        try:
            wait_for(lambda: any(x["tag"] == "m" for x in rows(r, prefix)), 30, what="the member's body (unlocked)")
        finally:
            srv.resume()
        ent = f"{prefix}:v1:{{invoice:{inv}}}:lock"
        time.sleep(1.0)  # whatever the stalled commands took, they have run now
        during = lock.hgetall(ent)
        g2.touch()
        out = res.get(timeout=30)
        ended = max(x["t"] for x in rows(r, prefix) if x["tag"] == "m")
        left = lock.hgetall(ent)
        other = app.tasks["wf.hold_invoice"].delay(tenant=tenant, tag="after", invoice=inv, seconds=0)
        other.get(timeout=30)
        began = min(x["t"] for x in rows(r, prefix) if x["tag"] == "after")
        print(out, during, left, w.output()[-4000:])
        assert "lock.fail_open" in w.output()
        assert not left, f"the member's entity still held after its fail-open body ended: {left}"
        assert began - ended < 2.0, f"other work on the member's entity waited {began - ended:.1f}s"
