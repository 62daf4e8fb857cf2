"""Fences in storage: PostgreSQL (psycopg 3) and SQLite, inside the caller's transaction."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from celery_lockguard import BackendUnavailable, LockContended, StaleFence, advance_fence, create_fence_table
from celery_lockguard._lease import Lease
from celery_lockguard.fencing import advisory_key, advisory_xact_lock


def lease(fence: int, key: str = "invoice:1") -> Lease:
    return Lease(key, "lg", "tok", fence, 30_000, time.monotonic(), "task-1", "billing.charge")


@pytest.fixture
def pg(postgres_url: str) -> Iterator[tuple[str, str]]:
    """(dsn, table prefix): tables of this test, dropped afterwards."""
    name = f"lgt_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        create_fence_table(conn, f"{name}_fences")
        conn.execute(f"CREATE TABLE {name}_ledger (entity TEXT PRIMARY KEY, value TEXT)")
    yield postgres_url, name
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}_fences, {name}_ledger")


def write(conn: Any, table: str, lease_: Lease | None, value: str) -> None:
    advance_fence(conn, lease_, table=f"{table}_fences")
    conn.execute(
        f"INSERT INTO {table}_ledger (entity, value) VALUES (%s, %s) "
        "ON CONFLICT (entity) DO UPDATE SET value = excluded.value",
        ("e", value),
    )


def ledger(dsn: str, table: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT value FROM {table}_ledger WHERE entity = 'e'").fetchone()
        return row[0] if row else None


def test_postgres_accepts_equal_and_higher_and_rejects_lower(pg: tuple[str, str]) -> None:
    dsn, t = pg
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            write(conn, t, lease(100), "first")
        with conn.transaction():
            write(conn, t, lease(100), "same lease, second transaction")
        with conn.transaction():
            write(conn, t, lease(200), "newer holder")
        with pytest.raises(StaleFence) as err, conn.transaction():
            write(conn, t, lease(150), "stale writer")
    assert (err.value.fence, err.value.current, err.value.key) == (150, 200, "invoice:1")
    assert ledger(dsn, t) == "newer holder"


def test_no_lease_refuses_a_fenced_write(pg: tuple[str, str]) -> None:
    dsn, t = pg
    with psycopg.connect(dsn) as conn, pytest.raises(BackendUnavailable), conn.transaction():
        write(conn, t, None, "fail-open run")
    assert ledger(dsn, t) is None


def test_stale_writer_blocked_behind_a_newer_one_is_rejected_after_it_commits(pg: tuple[str, str]) -> None:
    dsn, t = pg
    with psycopg.connect(dsn) as setup, setup.transaction():
        write(setup, t, lease(10), "initial")
    newer = psycopg.connect(dsn)
    newer_tx = newer.transaction()
    newer_tx.__enter__()
    write(newer, t, lease(30), "newer")  # row locked, not committed yet
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def stale() -> None:
        with psycopg.connect(dsn) as conn:
            started.set()
            try:
                with conn.transaction():
                    write(conn, t, lease(20), "stale")
            except StaleFence as exc:
                outcome["error"] = exc

    th = threading.Thread(target=stale)
    th.start()
    started.wait(5)
    th.join(0.5)
    assert th.is_alive(), "the stale writer must wait for the newer transaction's row lock"
    newer_tx.__exit__(None, None, None)
    newer.close()
    th.join(10)
    assert isinstance(outcome.get("error"), StaleFence) and outcome["error"].current == 30
    assert ledger(dsn, t) == "newer"


def test_sqlite_fences_inside_the_callers_transaction(tmp_path: Any) -> None:
    conn = sqlite3.connect(tmp_path / "ledger.db")
    create_fence_table(conn)
    conn.execute("CREATE TABLE ledger (entity TEXT PRIMARY KEY, value TEXT)")
    conn.commit()

    def sqlite_write(fence: int, value: str) -> None:
        with conn:  # commits on success, rolls back on exception
            advance_fence(conn, lease(fence))
            conn.execute("INSERT OR REPLACE INTO ledger VALUES ('e', ?)", (value,))

    sqlite_write(5, "a")
    sqlite_write(5, "b")
    sqlite_write(9, "c")
    with pytest.raises(StaleFence):
        sqlite_write(7, "stale")
    assert conn.execute("SELECT value FROM ledger").fetchone()[0] == "c"
    assert conn.execute("SELECT fence FROM lockguard_fences").fetchone()[0] == 9


def test_advisory_key_is_stable_and_signed_64_bit() -> None:
    assert advisory_key("invoice:1") == advisory_key("invoice:1") != advisory_key("invoice:2")
    assert -(2**63) <= advisory_key("x" * 1000) < 2**63
    assert advisory_key("invoice:48291") == int.from_bytes(
        __import__("hashlib").sha256(b"invoice:48291").digest()[:8], "big", signed=True
    )


def test_two_transactions_racing_under_the_advisory_guard_commit_one_effect(pg: tuple[str, str]) -> None:
    dsn, t = pg
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def charge_once() -> None:
        try:
            with psycopg.connect(dsn) as conn, conn.transaction():
                barrier.wait(5)
                advisory_xact_lock(conn, "invoice:1")
                if conn.execute(f"SELECT 1 FROM {t}_ledger WHERE entity = 'e'").fetchone() is None:
                    time.sleep(0.05)  # widen the race window; correctness must not depend on it
                    conn.execute(f"INSERT INTO {t}_ledger VALUES ('e', 'charged')")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=charge_once) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert errors == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {t}_ledger").fetchone()[0] == 1


def test_advisory_try_lock_raises_when_held(pg: tuple[str, str]) -> None:
    dsn, _ = pg
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b, a.transaction():
        advisory_xact_lock(a, "tenant:alpha", wait=False)
        with pytest.raises(LockContended), b.transaction():
            advisory_xact_lock(b, "tenant:alpha", wait=False)
    with psycopg.connect(dsn) as c, c.transaction():
        advisory_xact_lock(c, "tenant:alpha", wait=False)  # released at the first transaction's end


def test_bump_fence_raises_the_stored_fence_and_never_lowers_it(pg: tuple[str, str], tmp_path: Any) -> None:
    from celery_lockguard.fencing import bump_fence

    dsn, t = pg
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            write(conn, t, lease(100), "holder")
        with conn.transaction():
            assert bump_fence(conn, "invoice:1", 150, f"{t}_fences") == 150  # the operator's forced release
        with pytest.raises(StaleFence) as err, conn.transaction():
            write(conn, t, lease(100), "evicted holder, same lease")
        assert err.value.current == 150
        with conn.transaction():
            assert bump_fence(conn, "invoice:1", 120, f"{t}_fences") == 150  # never lowers
            assert bump_fence(conn, "invoice:2", 7, f"{t}_fences") == 7  # no row yet: inserted
            write(conn, t, lease(200), "newer holder")
    assert ledger(dsn, t) == "newer holder"
    db = sqlite3.connect(tmp_path / "f.db")
    create_fence_table(db)
    with db:
        assert bump_fence(db, "k", 5) == 5 and bump_fence(db, "k", 3) == 5
