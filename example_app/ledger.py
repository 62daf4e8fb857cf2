"""The billing ledger: SQLite by default, PostgreSQL when ``DATABASE_URL`` is set.

SQLite lives in ``LEDGER_PATH`` (default ``billing-ledger.sqlite3``). Every
write runs in :func:`transaction`, which is where the tasks call
``advance_fence``: the fence check and the write commit together or not at all.

The same database also holds the books of the stand-in outside world
(:mod:`example_app.provider`), so the demo can count charges in one place.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_lockguard.fencing import fence_table_sql

FENCES = "billing_fences"

SCHEMA = (
    fence_table_sql(FENCES),
    # One posting per (invoice, kind): the ledger's own guard against a repeated write.
    "CREATE TABLE IF NOT EXISTS billing_postings ("
    " invoice_id BIGINT NOT NULL, kind TEXT NOT NULL, amount_cents BIGINT NOT NULL,"
    " charge_id TEXT NOT NULL, fence BIGINT NOT NULL, task_id TEXT NOT NULL,"
    " PRIMARY KEY (invoice_id, kind))",
    "CREATE TABLE IF NOT EXISTS tenant_sync ("
    " tenant_id TEXT NOT NULL, page INTEGER NOT NULL, fence BIGINT NOT NULL, PRIMARY KEY (tenant_id, page))",
    "CREATE TABLE IF NOT EXISTS catalog_runs ("
    " run_id TEXT PRIMARY KEY, started_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION)",
    # The outside world's books (see provider.py).
    "CREATE TABLE IF NOT EXISTS provider_charges ("
    " idempotency_key TEXT PRIMARY KEY, charge_id TEXT NOT NULL, invoice_id BIGINT NOT NULL,"
    " amount_cents BIGINT NOT NULL, calls INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS emails_sent ("
    " message_id TEXT PRIMARY KEY, invoice_id BIGINT NOT NULL, idempotency_key TEXT NOT NULL)",
)


def database_url() -> str | None:
    return os.environ.get("DATABASE_URL") or None


def is_postgres(conn: Any) -> bool:
    return not isinstance(conn, sqlite3.Connection)


def execute(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """Run ``sql`` written with ``?`` placeholders on either database."""
    return conn.execute(sql.replace("?", "%s") if is_postgres(conn) else sql, params)


@contextmanager
def transaction() -> Iterator[Any]:
    """One transaction on a fresh connection: committed on success, rolled back on any exception."""
    url = database_url()
    if url:
        import psycopg

        with psycopg.connect(url) as pg, pg.transaction():
            yield pg
        return
    conn = sqlite3.connect(os.environ.get("LEDGER_PATH", "billing-ledger.sqlite3"), timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no upgrade deadlock between workers
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()


def create_schema() -> None:
    """Create every table if missing (and WAL mode for SQLite, so readers never block writers)."""
    with transaction() as conn:
        for statement in SCHEMA:
            conn.execute(statement)
    if not database_url():
        conn = sqlite3.connect(os.environ.get("LEDGER_PATH", "billing-ledger.sqlite3"))
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()


def post(conn: Any, invoice_id: int, kind: str, amount_cents: int, charge_id: str, fence: int, task_id: str) -> bool:
    """Post one entry; a second posting of the same (invoice, kind) is ignored. True if posted."""
    cur = execute(
        conn,
        "INSERT INTO billing_postings (invoice_id, kind, amount_cents, charge_id, fence, task_id)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (invoice_id, kind) DO NOTHING",
        (invoice_id, kind, amount_cents, charge_id, fence, task_id),
    )
    return bool(cur.rowcount)


def sync_page(conn: Any, tenant_id: str, page: int, fence: int) -> None:
    execute(
        conn,
        "INSERT INTO tenant_sync (tenant_id, page, fence) VALUES (?, ?, ?)"
        " ON CONFLICT (tenant_id, page) DO UPDATE SET fence = excluded.fence",
        (tenant_id, page, fence),
    )


def summary() -> dict[str, Any]:
    """What the ledger and the outside world hold, per invoice, for the demo's report."""
    with transaction() as conn:

        def per_invoice(sql: str) -> dict[int, int]:
            return {int(k): int(v) for k, v in execute(conn, sql).fetchall()}

        runs = execute(conn, "SELECT started_at, finished_at FROM catalog_runs ORDER BY started_at").fetchall()
        return {
            "charges": per_invoice("SELECT invoice_id, COUNT(*) FROM provider_charges GROUP BY invoice_id"),
            "provider_calls": per_invoice("SELECT invoice_id, SUM(calls) FROM provider_charges GROUP BY invoice_id"),
            "postings": per_invoice("SELECT invoice_id, COUNT(*) FROM billing_postings GROUP BY invoice_id"),
            "emails": per_invoice("SELECT invoice_id, COUNT(*) FROM emails_sent GROUP BY invoice_id"),
            "tenant_pages": dict(
                Counter(row[0] for row in execute(conn, "SELECT tenant_id FROM tenant_sync").fetchall())
            ),
            "catalog_runs": [(float(a), float(b) if b is not None else None) for a, b in runs],
        }
