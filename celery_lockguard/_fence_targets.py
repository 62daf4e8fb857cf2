"""The fence tables ``lockguard release`` writes into: opened and checked first, then bumped.

A forced release bumps the entity's fence in Redis; only the databases whose
fence table ``advance_fence`` checks can refuse the evicted holder's next
write, so the bump is written there too (``--fence-dsn``,
``lockguard_fence_dsn``). Every database is opened and its table checked
*before* the lease is touched: an unreachable database or a missing table
(a typo would write the fence where no ``advance_fence`` looks) leaves the
lease as it was. Errors quote DSNs redacted, and libpq's messages with the
DSN's password masked (libpq quotes the part of a DSN it cannot parse).
"""

from __future__ import annotations

from typing import Any

from ._redact import redact, redact_text


class FenceTargetError(Exception):
    """A fence database cannot take the bump: ``reason`` is ``"unreachable"``, ``"no_table"`` or ``"bad_table"``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message, reason)
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return self.message


def open_fence_databases(dsns: tuple[str, ...], table: str) -> list[tuple[str, Any]]:
    """One open connection per DSN, each with ``table`` present; raises :class:`FenceTargetError` (none left open)."""
    from .fencing import _table

    try:
        _table(table)
    except ValueError as exc:
        raise FenceTargetError(str(exc), "bad_table") from None
    if not dsns:
        return []
    import psycopg

    opened: list[tuple[str, Any]] = []
    try:
        for dsn in dsns:
            failure: str | None = None
            try:
                conn = psycopg.connect(dsn, connect_timeout=5)
            except psycopg.Error as exc:
                failure = f"the fence database {redact(dsn)} is unreachable: {redact_text(exc, dsn)}"
            if failure is not None:  # raised outside the except block: libpq's raw message is not its context
                raise FenceTargetError(failure, "unreachable")
            opened.append((dsn, conn))
            row = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
            if row is None or row[0] is None:
                raise FenceTargetError(
                    f"no fence table {table!r} in {redact(dsn)} (create_fence_table, or --fence-table)", "no_table"
                )
            conn.rollback()
    except BaseException:
        close(opened)
        raise
    return opened


def bump_fences(opened: list[tuple[str, Any]], entity: str, fence: int, table: str) -> tuple[list[str], list[str]]:
    """Write ``fence`` for ``entity`` into every fence table and close: (databases written, failures with why)."""
    from .fencing import bump_fence

    written: list[str] = []
    failed: list[str] = []
    for dsn, conn in opened:
        try:
            with conn.transaction():
                bump_fence(conn, entity, fence, table)
            written.append(redact(dsn))
        except Exception as exc:  # noqa: BLE001 - reported to the operator, with what it leaves open
            failed.append(f"{redact(dsn)}: {exc.__class__.__name__}: {redact_text(exc, dsn)}")
        finally:
            conn.close()
    return written, failed


def close(opened: list[tuple[str, Any]]) -> None:
    """Close connections opened by :func:`open_fence_databases` when the release does not happen."""
    for _dsn, conn in opened:
        conn.close()
