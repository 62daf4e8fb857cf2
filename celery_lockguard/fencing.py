"""Storage-side guardrails: fencing tokens and PostgreSQL advisory locks.

A Redis lease cannot stop a paused or partitioned worker from writing after
its lease expired. Storage can: :func:`advance_fence` records, inside the
caller's transaction, the highest fence written for an entity and refuses a
lower one, so the stale writer's transaction never commits. An operator's
forced release bumps the fence in Redis; :func:`bump_fence` carries that bump
into the table, so the evicted holder is refused before any newer holder wrote.

Works with a psycopg 3 connection and with a ``sqlite3`` connection. The fence
row is upserted with a conditional ``DO UPDATE``: in PostgreSQL the row stays
locked until the caller's transaction ends, so two writers of one entity
serialize there, and the older one sees the newer fence once it may proceed.
"""

from __future__ import annotations

import hashlib
import sqlite3
from typing import Any

from ._config import is_sql_identifier
from ._events import emit
from ._lease import Lease
from .exceptions import BackendUnavailable, LockContended, StaleFence

DEFAULT_TABLE = "lockguard_fences"


def _table(table: str) -> str:
    if not is_sql_identifier(table):
        raise ValueError(f"fence table name {table!r} must be a plain SQL identifier (optionally schema-qualified)")
    return table


def fence_table_sql(table: str = DEFAULT_TABLE) -> str:
    """DDL of the fence table (PostgreSQL and SQLite alike); see docs/fencing.md."""
    return (
        f"CREATE TABLE IF NOT EXISTS {_table(table)} ("
        " lock_key TEXT PRIMARY KEY,"
        " fence BIGINT NOT NULL,"
        " updated_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)"
    )


def create_fence_table(conn: Any, table: str = DEFAULT_TABLE) -> None:
    """Create the fence table if it does not exist (commit is the caller's)."""
    conn.execute(fence_table_sql(table))


def advance_fence(conn: Any, lease: Lease | None, table: str = DEFAULT_TABLE, *, entity: str | None = None) -> int:
    """Record ``lease.fence`` for its key inside the caller's open transaction.

    Accepts a fence equal to the stored one (one lease, several transactions)
    and raises :class:`StaleFence` for a lower one: the caller's write in the
    same transaction must then not commit (let the exception propagate out of
    the transaction block). ``lease=None`` (a fail-open run, or no lock) raises
    :class:`BackendUnavailable`: fenced writes are correctness writes.
    Returns the fence now stored.

    The row is ``lease.fence_row``: K for the single lease; with ``lock_limit`` each slot i > 0
    fences on its own row ``K#<i>`` (slot 0 on K), so N legitimate holders never reject each
    other, and a stale holder of slot i is rejected once the next holder of slot i has written
    (docs/limits.md).

    Several entities (``lock_key`` as a sequence; ``lease.fences``): each entity fences on its own
    row K. ``entity=K`` advances that entity's row alone (returns its fence); without it every
    entity's row is advanced in sorted order (one order for every writer, so two transactions
    never wait on each other's rows in a cycle), and the first stale one raises
    :class:`StaleFence`; returns the highest fence stored. ``entity=`` on a single-entity lease
    must name its key.
    """
    if lease is None:
        raise BackendUnavailable("advance_fence needs a lease: fenced writes are refused without one (fail-open run?)")
    if entity is not None and entity not in lease.fences:
        raise ValueError(f"advance_fence: entity {entity!r} is not held by this lease (it holds {list(lease.keys)!r})")
    if not lease.several:
        return _advance(conn, lease, lease.fence_row, lease.fence, table, lease.key)
    rows = [entity] if entity is not None else sorted(lease.fences)
    return max(_advance(conn, lease, row, lease.fences[row], table, row) for row in rows)


def _advance(conn: Any, lease: Lease, row_key: str, fence: int, table: str, entity: str) -> int:
    """Advance one fence row; ``entity``: the key the ``fence.stale`` event names."""
    name = _table(table)
    if isinstance(conn, sqlite3.Connection):
        mark = "?"
    else:
        mark = "%s"
    conn.execute(
        f"INSERT INTO {name} (lock_key, fence) VALUES ({mark}, {mark}) "
        f"ON CONFLICT (lock_key) DO UPDATE SET fence = excluded.fence, updated_at = CURRENT_TIMESTAMP "
        f"WHERE {name}.fence <= excluded.fence",
        (row_key, fence),
    )
    row = conn.execute(f"SELECT fence FROM {name} WHERE lock_key = {mark}", (row_key,)).fetchone()
    current = int(row[0])
    if current != fence:
        emit(
            "fence.stale",
            lease.task_name,
            lock_key=entity,
            task_id=lease.task_id,
            fence=fence,
            current=current,
        )
        raise StaleFence(row_key, fence, current)
    return current


def bump_fence(conn: Any, key: str, fence: int, table: str = DEFAULT_TABLE) -> int:
    """Raise the stored fence of ``key`` to at least ``fence``, inside the caller's transaction.

    What ``lockguard release --fence-dsn`` runs after a forced release: the
    fence bump of Redis reaches the table :func:`advance_fence` checks, so the
    evicted holder's next fenced write raises :class:`StaleFence` at once
    instead of being accepted until a newer holder writes. Never lowers a
    stored fence. Returns the fence now stored.
    """
    name = _table(table)
    mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    conn.execute(
        f"INSERT INTO {name} (lock_key, fence) VALUES ({mark}, {mark}) "
        f"ON CONFLICT (lock_key) DO UPDATE SET fence = excluded.fence, updated_at = CURRENT_TIMESTAMP "
        f"WHERE {name}.fence < excluded.fence",
        (key, int(fence)),
    )
    row = conn.execute(f"SELECT fence FROM {name} WHERE lock_key = {mark}", (key,)).fetchone()
    return int(row[0])


def advisory_key(key: str) -> int:
    """A stable signed 64-bit id for ``key`` (SHA-256 prefix; not PostgreSQL's undocumented hashtext)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big", signed=True)


def advisory_xact_lock(conn: Any, key: str, wait: bool = True) -> None:
    """Take a transaction-scoped PostgreSQL advisory lock on entity ``key``.

    Released by PostgreSQL at commit or rollback, so it is safe behind a pooler
    in transaction mode (PgBouncer): the lock never outlives the transaction
    that owns the server connection. With ``wait=False`` a held lock raises
    :class:`LockContended` at once. Call it inside an open transaction.
    """
    ident = advisory_key(key)
    if wait:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (ident,))
        return
    row = conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (ident,)).fetchone()
    if not row[0]:
        raise LockContended(key, None, None)
