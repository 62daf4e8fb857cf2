"""The PostgreSQL completion store's figure: reachability, a per-run table, its removal.

The store creates its table on first use (``CREATE TABLE IF NOT EXISTS``); a
table name per run keeps two runs (or a run and the test suite) from sharing
rows, and :func:`drop_table` removes it afterwards. When PostgreSQL cannot be
reached the section is skipped and says why: ``--quick`` must not fail on a
machine without it.
"""

from __future__ import annotations

import uuid

DSN = "postgresql://postgres@127.0.0.1:5432/test"


def unreachable(dsn: str = DSN) -> str | None:
    """Why the store cannot be measured here (driver missing, server down), or ``None`` if it can."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed in the bench environment"
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure to connect means: skip, and say why
        return f"{dsn} unreachable: {exc.__class__.__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None


def table_name() -> str:
    """A fresh table for this run (lower-case, a valid unquoted identifier)."""
    return f"lgbench_{uuid.uuid4().hex[:10]}"


def drop_table(table: str, dsn: str = DSN) -> None:
    """Remove the run's table; a failure here is reported, never raised over the figures."""
    import psycopg

    with psycopg.connect(dsn, connect_timeout=3, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
