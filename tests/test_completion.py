"""Completion records and checkpoints: the same suite on the Redis and the PostgreSQL backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard.completion import PostgresStore, postgres_store
from celery_lockguard.exceptions import ConfigurationError
from celery_lockguard.testing import free_port


@pytest.fixture(params=["redis", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(completion backend setting, table)."""
    if request.param == "redis":
        yield "redis", "lockguard_completions"
        return
    dsn = request.getfixturevalue("postgres_url")
    table = f"lgt_{uuid.uuid4().hex[:8]}_completions"
    yield dsn, table
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


@pytest.fixture
def app(redis_url: str, prefix: str, backend: tuple[str, str]) -> Celery:
    a = Celery("completiontest", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_completion_backend, a.conf.lockguard_completion_table = backend
    return a


def task(app: Celery, **opts: Any) -> Any:
    def deco(fn: Any) -> Any:
        return app.task(base=LockedTask, bind=True, shared=False, name=f"c.{uuid.uuid4().hex[:6]}", **opts)(fn)

    return deco


def test_same_id_is_skipped_with_the_recorded_result(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}")
    def t(self: Any, a: int) -> dict[str, int]:
        runs.append(a)
        return {"n": len(runs)}

    assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    with capture_logs() as logs:
        assert t.apply(args=(1,), task_id="same").get() == {"n": 1}
    assert runs == [1]
    assert [e["completed_by"] for e in logs if e["event"] == "completion.skipped"] == ["same"]


def test_two_ids_one_idempotency_key_run_once_even_across_task_types(app: Celery) -> None:
    runs: list[str] = []

    @task(app, idempotency_key="invoice:{invoice_id}:charge")
    def charge(self: Any, invoice_id: int) -> str:
        runs.append("charge")
        return "charged"

    @task(app, idempotency_key="invoice:{invoice_id}:charge")
    def charge_v2(self: Any, invoice_id: int, note: str = "") -> str:
        runs.append("v2")
        return "charged-v2"

    assert charge.apply(args=(9,), task_id="a").get() == "charged"
    assert charge.apply(args=(9,), task_id="b").get() == "charged"
    assert charge_v2.apply(args=(9,), task_id="c").get() == "charged"
    assert runs == ["charge"]


def test_a_retried_task_is_not_skipped(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}", max_retries=3, default_retry_delay=0)
    def t(self: Any, a: int) -> int:
        runs.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry()
        return len(runs)

    assert t.apply(args=(1,)).get() == 3
    assert runs == [0, 1, 2]


def test_checkpoint_replays_after_a_failure(app: Celery) -> None:
    effects: list[int] = []

    def provider(x: int) -> dict[str, Any]:
        effects.append(x)
        return {"receipt": f"r-{x}", "amount": (x, 2)}

    @task(app, idempotency_key="inv:{a}")
    def t(self: Any, a: int, fail: bool) -> Any:
        got = self.checkpoint("charge", provider, a)
        if fail:
            raise RuntimeError("crash after the side effect")
        return got

    with pytest.raises(RuntimeError):
        t.apply(args=(5, True), throw=True)
    assert t.apply(args=(5, False), throw=True).get() == {"receipt": "r-5", "amount": [5, 2]}
    assert effects == [5]


def test_completion_off_records_nothing(app: Celery) -> None:
    runs: list[int] = []

    @task(app, lock_key="k:{a}", completion=False)
    def t(self: Any, a: int) -> int:
        runs.append(a)
        return a

    t.apply(args=(1,), task_id="x")
    t.apply(args=(1,), task_id="x")
    assert runs == [1, 1]


def test_record_completion_needs_the_postgres_backend(redis_url: str, prefix: str) -> None:
    app = Celery("redisonly", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix

    @task(app, lock_key="k:{a}")
    def t(self: Any, a: int) -> Any:
        return self.record_completion(None)

    with pytest.raises(ConfigurationError, match="record_completion needs"):
        t.apply(args=(1,), throw=True)


# -- PostgreSQL only ---------------------------------------------------------------


@pytest.fixture
def pg_app(redis_url: str, prefix: str, postgres_url: str) -> Iterator[tuple[Celery, str, str]]:
    table = f"lgt_{uuid.uuid4().hex[:8]}"
    a = Celery("pgcompletion", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_completion_backend = postgres_url
    a.conf.lockguard_completion_table = f"{table}_completions"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table}_effects (scope TEXT PRIMARY KEY)")
    yield a, postgres_url, table
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}_effects, {table}_completions")


def test_body_write_and_completion_row_commit_in_one_transaction(pg_app: tuple[Celery, str, str]) -> None:
    app, dsn, table = pg_app

    @task(app, idempotency_key="order:{order_id}")
    def ship(self: Any, order_id: int, crash: bool) -> str:
        with psycopg.connect(dsn) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {table}_effects VALUES (%s)", (self.completion_scope,))
            assert self.record_completion(conn, "shipped")
            if crash:
                raise RuntimeError("crash inside the transaction")
        return "shipped"

    with pytest.raises(RuntimeError):
        ship.apply(args=(1, True), throw=True)
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}_effects").fetchone()[0] == 0
        assert conn.execute(f"SELECT count(*) FROM {table}_completions").fetchone()[0] == 0
    assert ship.apply(args=(1, False), throw=True).get() == "shipped"
    assert ship.apply(args=(1, False), throw=True).get() == "shipped"
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {table}_effects").fetchone()[0] == 1


def test_fail_open_with_postgres_backend_commits_one_effect(pg_app: tuple[Celery, str, str]) -> None:
    app, _dsn, _table = pg_app
    app.conf.lockguard_redis_url = f"redis://127.0.0.1:{free_port()}/0"  # the lock Redis is down
    app.conf.lockguard_on_unavailable = "fail_open"
    app.conf.lockguard_socket_timeout = 0.3
    effects: list[int] = []

    @task(app, idempotency_key="invoice:{invoice_id}")
    def charge(self: Any, invoice_id: int) -> str:
        assert self.lock is None
        self.checkpoint("provider", effects.append, invoice_id)
        return "charged"

    with capture_logs() as logs:
        assert charge.apply(args=(3,), task_id="one").get() == "charged"
        assert charge.apply(args=(3,), task_id="two").get() == "charged"
    assert effects == [3]
    assert sum(e["event"] == "lock.fail_open" for e in logs) == 2
    assert sum(e["event"] == "completion.skipped" for e in logs) == 1


def test_expired_rows_are_replaced_and_purged(postgres_url: str) -> None:
    store = PostgresStore(postgres_url, f"lgt_{uuid.uuid4().hex[:8]}_c")
    try:
        assert store.record("s", "t1", '{"result":1}', ttl_ms=1)
        with psycopg.connect(postgres_url) as conn:
            conn.execute(f"UPDATE {store.table} SET expires_at = now() - interval '1 second'")
        assert store.lookup("s") is None
        assert store.record("s", "t2", '{"result":2}', ttl_ms=60_000)
        assert not store.record("s", "t3", '{"result":3}', ttl_ms=60_000)
        assert store.lookup("s") == '{"result":2}'
        assert store.forget("s") == 1 and store.lookup("s") is None
        store.record("old", "t", "{}", ttl_ms=1)
        with psycopg.connect(postgres_url) as conn:
            conn.execute(f"UPDATE {store.table} SET expires_at = now() - interval '1 second'")
        assert store.purge_expired() == 1
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {store.table}")
    assert postgres_store(postgres_url) is postgres_store(postgres_url)
