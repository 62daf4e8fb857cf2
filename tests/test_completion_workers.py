"""Completion with real workers, on the Redis and on the PostgreSQL backend."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis

from .conftest import make_cfg

pytestmark = pytest.mark.integration


@pytest.fixture(params=["redis", "postgres"])
def completion_cfg(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if request.param == "redis":
        yield {}
        return
    dsn = request.getfixturevalue("postgres_url")
    table = f"lgt_{uuid.uuid4().hex[:8]}_completions"
    yield {"completion_backend": dsn, "completion_table": table}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


@pytest.fixture
def setup(fleet: Any, redis_url: str, prefix: str, completion_cfg: dict[str, Any]) -> tuple[Any, Any, str]:
    cfg = make_cfg(prefix, redis_url, **completion_cfg)
    fleet.worker(cfg)
    return fleet.app(cfg), redis.Redis.from_url(redis_url, decode_responses=True), prefix


def starts(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in r.lrange(f"{prefix}:record", 0, -1)]
    return [x for x in rows if x["key"] == key and x["ev"] == "start"]


def test_resent_with_the_same_id_is_skipped_and_returns_the_recorded_result(setup: Any) -> None:
    app, r, prefix = setup
    first = app.tasks["idem_effect"].apply_async((1,), task_id="fixed-id-1").get(timeout=30)
    again = app.tasks["idem_effect"].apply_async((1,), task_id="fixed-id-1").get(timeout=30)
    assert first == again == {"effects": 1, "by": "fixed-id-1"}
    assert r.get(f"{prefix}:effects:1") == "1"


def test_two_ids_with_one_idempotency_key_run_the_body_once(setup: Any) -> None:
    app, r, prefix = setup
    results = [app.tasks["idem_effect"].delay(2) for _ in range(4)]
    outs = [res.get(timeout=60) for res in results]
    assert r.get(f"{prefix}:effects:2") == "1"
    assert len(starts(r, prefix, "inv:2")) == 1
    assert all(o is None or o["effects"] == 1 for o in outs)


def test_killed_right_after_a_checkpoint_the_effect_happens_once(
    fleet: Any, redis_url: str, prefix: str, completion_cfg: dict[str, Any]
) -> None:
    cfg = make_cfg(prefix, redis_url, **completion_cfg)
    fleet.worker(cfg)
    app = fleet.app(cfg)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    out = app.tasks["checkpoint_crash"].delay("cp1").get(timeout=60)
    assert out == {"attempt": 2, "charged": 1}
    assert r.get(f"{prefix}:effects:cp1") == "1"
    assert [x["attempt"] for x in starts(r, prefix, "cp1")] == [1, 2]


def test_a_retried_task_runs_again(setup: Any) -> None:
    app, r, prefix = setup
    assert app.tasks["retry_self"].delay("rt").get(timeout=60) == {"retries": 2}
    assert [x["retries"] for x in starts(r, prefix, "rt")] == [0, 1, 2]
