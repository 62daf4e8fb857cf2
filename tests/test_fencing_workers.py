"""The pause scenario end to end: a stopped worker's late write is rejected by the fence."""

from __future__ import annotations

import json
import os
import signal
import uuid
from typing import Any

import psycopg
import pytest
import redis

from celery_lockguard._keys import lock_name

from .conftest import make_cfg
from .harness import wait_for

pytestmark = pytest.mark.integration


def test_worker_paused_past_its_ttl_cannot_overwrite_the_successor(
    fleet: Any, redis_url: str, postgres_url: str, prefix: str, tmp_path: Any
) -> None:
    from celery_lockguard import create_fence_table

    table = f"lgt_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        create_fence_table(conn, f"{table}_fences")
        conn.execute(f"CREATE TABLE {table}_ledger (entity TEXT PRIMARY KEY, value TEXT)")
    try:
        cfg_a = make_cfg(prefix, redis_url, pg=postgres_url, queue=f"{prefix}-a")
        cfg_b = make_cfg(prefix, redis_url, pg=postgres_url, queue=f"{prefix}-b")
        worker_a = fleet.worker(cfg_a, concurrency=1)
        worker_b = fleet.worker(cfg_b, concurrency=1)
        app = fleet.app(cfg_a)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        gate_a, gate_b = tmp_path / "gate-a", tmp_path / "gate-b"
        gate_b.touch()

        res_a = app.tasks["fenced_write"].apply_async(("e", "A", str(gate_a), table), queue=cfg_a["queue"])
        wait_for(lambda: r.llen(f"{prefix}:record") >= 1, 30, what="A to start")
        (child,) = worker_a.children()
        os.kill(child, signal.SIGSTOP)
        try:
            name = lock_name(prefix, "acct:e")
            wait_for(lambda: not r.exists(name), 10, what="A's lease to expire while A is stopped")
            res_b = app.tasks["fenced_write"].apply_async(("e", "B", str(gate_b), table), queue=cfg_b["queue"])
            out_b = res_b.get(timeout=30)
        finally:
            os.kill(child, signal.SIGCONT)
        gate_a.touch()
        with pytest.raises(Exception) as err:
            res_a.get(timeout=30)
        assert type(err.value).__name__ == "StaleFence" and res_a.state == "FAILURE"
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute(f"SELECT value FROM {table}_ledger").fetchall() == [("B",)]
            assert conn.execute(f"SELECT fence FROM {table}_fences").fetchone()[0] == out_b["fence"]
        assert "fence.stale" in worker_a.log()
        rows = [json.loads(x) for x in r.lrange(f"{prefix}:record", 0, -1)]
        assert [(x["ev"], x["tag"]) for x in rows if x["ev"] == "end"] == [("end", "B")]
        assert worker_b.proc is not None
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}_fences, {table}_ledger")
