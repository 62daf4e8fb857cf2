"""Completion records and checkpoints, in Redis or in PostgreSQL.

A completion record says "the work of scope S ran and returned R".

* Redis (default): the record is written by the RELEASE script and read by the
  ACQUIRE script, so it costs no round trip of its own; checkpoints are fields
  of one hash beside it.
* PostgreSQL (``lockguard_completion_backend = "postgresql://..."``): rows in
  one table with a primary key on (scope, name) — name ``""`` is the
  completion record, any other name a checkpoint — written with
  ``ON CONFLICT``, so the first writer wins. The body can write the record in
  its own transaction (:meth:`PostgresStore.record_in`), so a crash never
  leaves its effect without the record. Costs one query at start and one at
  the end of each task.

Both stores are namespaced by ``lockguard_key_prefix``: two apps sharing a
database (or a Redis) and an idempotency template never answer each other's
tasks. Within one app a record answers only the task that wrote it (or the
tasks sharing its ``idempotency_namespace``): the scope a store is given is
a record scope (``_keys.record_scope``: ``by:<task>:<S>``, ``ns:<name>:<S>``
or ``task:<id>``). In PostgreSQL the stored scope is
``{namespace}:v1:{S}:by:<task>`` (``_keys.record_key``), the shape of the
Redis key: no schema change, one primary key, and injective, since a
namespace has no braces and an owner no ``:``. A column would have needed a
migration of every 0.1.0 table; 0.1.0 rows (bare scopes) are simply not seen
(docs/upgrading.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from ._config import is_sql_identifier
from ._keys import checkpoint_name, done_name, record_key
from .exceptions import CheckpointNotSerializable

#: Largest JSON result kept in a completion record; larger results record ``None``.
MAX_RECORD_BYTES = 1024
DEFAULT_TABLE = "lockguard_completions"

_NO_VALUE = '{"novalue":true}'


#: ``json.dumps(value, separators=(",", ":"))`` without building an encoder per call (encoders keep no state).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _json_text(value: Any) -> str:
    """``json.dumps(value)``; a ``str`` (the usual case) goes straight to the escaper ``json.dumps`` would call."""
    return json.encoder.encode_basestring_ascii(value) if isinstance(value, str) else json.dumps(value)


def encode_record(task_id: str, result: Any, task_name: str = "", digest: str = "") -> tuple[str, str | None]:
    """The record for a successful body, and why the result was dropped (or ``None``).

    ``task_name`` and ``digest`` (the arguments digest) let a later call under the
    same scope tell identical work from an idempotency key reused for other work.
    """
    work = f',"task":{_json_text(task_name)},"digest":{_json_text(digest)}' if task_name else ""
    head = f'{{"task_id":{_json_text(task_id)}{work},"result":'
    try:
        # None, str and int as json writes them, without its encoder; anything else through it.
        kind = type(result)
        if result is None:
            value = "null"
        elif kind is str:
            value = json.encoder.encode_basestring_ascii(result)
        elif kind is int:
            value = int.__repr__(result)
        else:
            value = _COMPACT.encode(result)
    except (TypeError, ValueError):
        return head + "null}", "result is not JSON-serializable"
    if len(value.encode()) > MAX_RECORD_BYTES:
        return head + "null}", f"result larger than {MAX_RECORD_BYTES} bytes"
    return f"{head}{value}}}", None


@dataclass(frozen=True)
class Record:
    """A decoded completion record: who completed the scope, what work it was, what it returned."""

    task_id: str | None
    result: Any
    task_name: str = ""
    digest: str = ""

    def other_work(self, task_name: str, digest: str) -> bool:
        """The same task ran under this scope with other arguments (records of 0.1 carry no digest)."""
        return bool(self.digest) and self.task_name == task_name and self.digest != digest


def read_record(record: str) -> Record:
    """The whole record, including the work it recorded."""
    data = json.loads(record)
    return Record(data.get("task_id"), data.get("result"), data.get("task") or "", data.get("digest") or "")


class Store(Protocol):
    """Where completion records and checkpoints live.

    ``in_scripts`` says how the runtime reaches the record: True, ACQUIRE reads
    it and RELEASE writes it in their own round trips (Redis); False, it is read
    with :meth:`lookup` under the fresh lease and written with :meth:`record`
    before the lease is released (PostgreSQL), so whoever takes the lease next
    sees it.
    """

    in_scripts: bool

    def lookup(self, scope: str) -> str | None:
        """The live completion record of ``scope``, or ``None``."""

    def record(self, scope: str, task_id: str, record: str, ttl_ms: int) -> bool:
        """Write the completion record unless a live one exists; True if written."""

    def get_checkpoint(self, scope: str, name: str) -> str | None:
        """The recorded value of checkpoint ``name``, or ``None``."""

    def put_checkpoint(self, scope: str, name: str, encoded: str, ttl_ms: int) -> None:
        """Record checkpoint ``name``."""


class RedisStore:
    """Completion records in Redis: checked and written inside the lease scripts."""

    in_scripts = True

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def lookup(self, scope: str) -> str | None:
        value: str | None = self.client.get(done_name(self.prefix, scope))
        return value

    def record(self, scope: str, task_id: str, record: str, ttl_ms: int) -> bool:
        return bool(self.client.set(done_name(self.prefix, scope), record, nx=True, px=ttl_ms))

    def get_checkpoint(self, scope: str, name: str) -> str | None:
        value: str | None = self.client.hget(checkpoint_name(self.prefix, scope), name)
        return value

    def put_checkpoint(self, scope: str, name: str, encoded: str, ttl_ms: int) -> None:
        key = checkpoint_name(self.prefix, scope)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, name, encoded)
        pipe.pexpire(key, ttl_ms)
        pipe.execute()


class PostgresStore:
    """Completion records and checkpoints as rows of one PostgreSQL table."""

    in_scripts = False

    def __init__(self, dsn: str, table: str = DEFAULT_TABLE, namespace: str = "lockguard") -> None:
        if not is_sql_identifier(table):
            raise ValueError(f"completion table name {table!r} must be a plain SQL identifier")
        if not isinstance(namespace, str) or not namespace or any(c in "{}" or c.isspace() for c in namespace):
            raise ValueError(f"completion namespace {namespace!r} must be non-empty, without braces or spaces")
        self.dsn = dsn
        self.table = table
        self.namespace = namespace
        self._conn: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        self._ready = False

    def stored_scope(self, scope: str) -> str:
        """The ``scope`` column of record scope ``scope``'s rows: ``{namespace}:v1:{S}`` and the record's
        owner (``{namespace}:v1:{S}:by:<task>``), like the Redis key (:func:`~celery_lockguard._keys.record_key`)."""
        return record_key(self.namespace, scope)

    def schema_sql(self) -> str:
        """DDL of the table; run by :meth:`create_table` on first use (see docs)."""
        return (
            f"CREATE TABLE IF NOT EXISTS {self.table} ("
            " scope TEXT NOT NULL,"
            " name TEXT NOT NULL,"
            " value TEXT NOT NULL,"
            " task_id TEXT,"
            " created_at TIMESTAMPTZ NOT NULL DEFAULT now(),"
            " expires_at TIMESTAMPTZ NOT NULL,"
            " PRIMARY KEY (scope, name))"
        )

    def _insert_sql(self) -> str:
        # First writer wins; a row past its expiry is replaced, as Redis would have dropped it.
        return (
            f"INSERT INTO {self.table} (scope, name, value, task_id, expires_at) "
            "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s)) "
            f"ON CONFLICT (scope, name) DO UPDATE SET value = excluded.value, task_id = excluded.task_id, "
            f"created_at = now(), expires_at = excluded.expires_at WHERE {self.table}.expires_at <= now()"
        )

    def create_table(self, conn: Any = None) -> None:
        """Create the table if missing (with ``conn``, or the store's own connection).

        Safe when several processes start at once: two concurrent ``CREATE
        TABLE IF NOT EXISTS`` can both miss the table and one then fails on
        ``pg_type``'s unique index, so the DDL runs under a transaction-scoped
        advisory lock on the table name. A table that exists is left alone
        without any DDL (an application role may lack ``CREATE``).
        """
        if conn is not None:
            self._ensure_table(conn)
            return
        self._run(self._ensure_table)

    def _ensure_table(self, conn: Any) -> None:
        if conn.execute("SELECT to_regclass(%s)", (self.table,)).fetchone()[0] is not None:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._ddl_lock_id(),))
            conn.execute(self.schema_sql())

    def _ddl_lock_id(self) -> int:
        """Advisory lock id of this table's DDL (a signed 64-bit SHA-256 prefix of its name)."""
        digest = hashlib.sha256(f"lockguard:ddl:{self.table}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def _connection(self) -> Any:
        import psycopg

        if self._conn is None or self._pid != os.getpid() or self._conn.closed:
            failure: Exception | None = None
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
            except psycopg.Error as exc:
                failure = redacted_error(exc, self.dsn)
            if failure is not None:
                raise failure  # outside the except block: the original (with the password) is not its context
            self._pid = os.getpid()
            if not self._ready:
                self._ensure_table(self._conn)
                self._ready = True
        return self._conn

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        import psycopg

        with self._lock:
            try:
                return fn(self._connection())
            except psycopg.OperationalError:
                self._conn = None  # reconnect once: the server may have restarted
                return fn(self._connection())

    def lookup(self, scope: str) -> str | None:
        """The live completion record of ``scope``, or ``None``."""
        row = self._run(
            lambda c: c.execute(
                f"SELECT value FROM {self.table} WHERE scope = %s AND name = '' AND expires_at > now()",
                (self.stored_scope(scope),),
            ).fetchone()
        )
        return row[0] if row else None

    def record(self, scope: str, task_id: str, record: str, ttl_ms: int) -> bool:
        """Write the completion record unless a live one exists; True if written."""
        params = (self.stored_scope(scope), "", record, task_id, ttl_ms / 1000)
        cur = self._run(lambda c: c.execute(self._insert_sql(), params))
        return bool(cur.rowcount)

    def record_in(self, conn: Any, scope: str, task_id: str, record: str, ttl_ms: int) -> bool:
        """Write the completion record with the caller's connection, inside its transaction."""
        cur = conn.execute(self._insert_sql(), (self.stored_scope(scope), "", record, task_id, ttl_ms / 1000))
        return bool(cur.rowcount)

    def get_checkpoint(self, scope: str, name: str) -> str | None:
        row = self._run(
            lambda c: c.execute(
                f"SELECT value FROM {self.table} WHERE scope = %s AND name = %s AND expires_at > now()",
                (self.stored_scope(scope), "cp:" + name),
            ).fetchone()
        )
        return row[0] if row else None

    def put_checkpoint(self, scope: str, name: str, encoded: str, ttl_ms: int) -> None:
        params = (self.stored_scope(scope), "cp:" + name, encoded, None, ttl_ms / 1000)
        self._run(lambda c: c.execute(self._insert_sql(), params))

    def entries(self, scope: str) -> list[tuple[str, str, int]]:
        """Live rows of ``scope`` as (name, value, ms to expiry): ``""`` is the record, ``cp:<name>`` checkpoints."""
        return [
            (str(name), str(value), int(ttl))
            for name, value, ttl in self._run(
                lambda c: c.execute(
                    f"SELECT name, value, (extract(epoch from expires_at - now()) * 1000)::bigint FROM {self.table} "
                    "WHERE scope = %s AND expires_at > now() ORDER BY name",
                    (self.stored_scope(scope),),
                ).fetchall()
            )
        ]

    def forget(self, scope: str) -> int:
        """Delete the record and checkpoints of ``scope``; returns rows deleted."""
        stored = self.stored_scope(scope)
        cur = self._run(lambda c: c.execute(f"DELETE FROM {self.table} WHERE scope = %s", (stored,)))
        return int(cur.rowcount)

    def carry_over(self, owners: dict[str, str]) -> int:
        """Copy the live records (and their checkpoints) of the earlier format, named by S alone, to the
        record scope of the task that wrote them (:func:`carry_over_redis`); returns records copied."""
        head = f"{self.namespace}:v1:{{"

        def run(conn: Any) -> int:
            rows = conn.execute(
                f"SELECT scope, name, value, task_id, expires_at FROM {self.table} "
                "WHERE left(scope, length(%s)) = %s AND right(scope, 1) = '}' AND expires_at > now()",
                (head, head),
            ).fetchall()
            by_scope: dict[str, list[Any]] = {}
            for row in rows:
                by_scope.setdefault(row[0][len(head) : -1], []).append(row)
            copied = 0
            for scope, scope_rows in by_scope.items():
                prefix = _owner_of(scope, next((r[2] for r in scope_rows if r[1] == ""), None), owners)
                if prefix is None:
                    continue
                stored = self.stored_scope(prefix + scope)
                with conn.transaction():
                    for _, name, value, task_id, expires_at in scope_rows:
                        cur = conn.execute(
                            f"INSERT INTO {self.table} (scope, name, value, task_id, expires_at) "
                            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (scope, name) DO NOTHING",
                            (stored, name, value, task_id, expires_at),
                        )
                        copied += 1 if name == "" and cur.rowcount else 0
            return copied

        return int(self._run(run))

    def purge_expired(self) -> int:
        """Delete expired rows of every namespace (PostgreSQL has no TTL; run it from a periodic task)."""
        cur = self._run(lambda c: c.execute(f"DELETE FROM {self.table} WHERE expires_at <= now()"))
        return int(cur.rowcount)


def _owner_of(scope: str, record: str | None, owners: dict[str, str]) -> str | None:
    """The record prefix an earlier-format record of ``scope`` moves under: its writer's, if that task is
    one of ``owners`` (task name -> record prefix); ``None`` for task-id scopes, unknown writers, and
    checkpoints with no record (nothing says which task wrote them)."""
    if scope.startswith("task:") or record is None or "}" in scope or "{" in scope:
        return None
    try:
        data = json.loads(record)
    except (ValueError, RecursionError):  # a planted record, not JSON or nested past the parser
        return None
    task = data.get("task") if isinstance(data, dict) else None
    return owners.get(task) if isinstance(task, str) else None


def carry_over_redis(client: Any, prefix: str, owners: dict[str, str]) -> int:
    """Copy the live records of the earlier format, ``{prefix}:v1:{S}:done`` (and ``:cp``), to the record
    scope of the task that wrote them (``owners``: task name as recorded -> its record prefix), keeping
    their TTL; an existing new record is never replaced. Returns the records copied.

    For a rolling upgrade (docs/upgrading.md): run it once the last worker of the earlier release has
    stopped, so their duplicates are answered as before instead of running once more.
    """
    from redis.exceptions import ResponseError

    head, tail = f"{prefix}:v1:{{", "}:done"
    copied = 0
    for key in client.scan_iter(match=f"{prefix}:v1:{{*}}:done", count=1000):
        try:
            name = key.decode() if isinstance(key, bytes) else key
        except UnicodeDecodeError:  # not a name a worker writes (anyone may plant one)
            continue
        if not (name.startswith(head) and name.endswith(tail)):
            continue
        scope = name[len(head) : -len(tail)]
        try:
            record, ttl = client.get(name), client.pttl(name)
        except ResponseError:  # a planted key of another type
            continue
        text = record.decode("utf-8", "replace") if isinstance(record, bytes) else record
        owner = _owner_of(scope, text, owners)
        if owner is None or not isinstance(ttl, int) or ttl <= 0:
            continue
        target = owner + scope
        old_cp = name[: -len(":done")] + ":cp"  # by its name: an S like "by:a:b" must not parse as an owner
        try:
            checkpoints = client.hgetall(old_cp)
        except ResponseError:
            checkpoints = {}
        if checkpoints and not client.exists(checkpoint_name(prefix, target)):
            cp_ttl = client.pttl(old_cp)
            pipe = client.pipeline(transaction=True)
            pipe.hset(checkpoint_name(prefix, target), mapping=checkpoints)
            pipe.pexpire(checkpoint_name(prefix, target), cp_ttl if isinstance(cp_ttl, int) and cp_ttl > 0 else ttl)
            pipe.execute()
        if client.set(done_name(prefix, target), record, nx=True, px=ttl):
            copied += 1
    return copied


#: How a caller wraps each store operation of a checkpoint: ``guard(operation, call)`` with
#: ``operation`` ``"read"`` or ``"write"``; it may retry, raise, or return ``None`` to go on without.
StoreGuard: TypeAlias = Callable[[str, Callable[[], Any]], Any]


def redacted_error(exc: Exception, dsn: str) -> Exception:
    """``exc`` again, of the same class (so it is classified alike), with ``dsn``'s password masked.

    libpq quotes the part of a DSN it cannot parse (``invalid percent-encoded
    token: "p%ZZw"``), and the message travels into ``completion.record_failed``
    and the CLI's errors. The caller raises it outside its ``except`` block, so
    the original is not even its ``__context__``, which a logged traceback prints.
    """
    from ._redact import redact_text

    text = str(exc)
    clean = redact_text(text, dsn)
    if clean == text:
        return exc
    try:
        return type(exc)(clean)
    except Exception:  # noqa: BLE001 - a class that takes other arguments: a plain error of the same meaning
        return RuntimeError(clean)


def _unguarded(operation: str, call: Callable[[], Any]) -> Any:
    return call()


def checkpoint(
    store: Store,
    scope: str,
    name: str,
    ttl_ms: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    guard: StoreGuard = _unguarded,
) -> Any:
    """Run ``fn`` once per (scope, name); replay the recorded JSON value afterwards.

    The value returned is always the JSON round trip of ``fn``'s result, so the
    first run and a replay see the same thing. ``guard`` decides what a store
    error means (the task's outage policy): before ``fn`` a wait is safe, after
    it the step has happened and must not be run again blindly.
    """
    stored = guard("read", lambda: store.get_checkpoint(scope, name))
    if stored is not None:
        return json.loads(stored).get("value")
    value = fn(*args, **kwargs)
    try:
        encoded = json.dumps({"value": value}, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        guard("write", lambda: store.put_checkpoint(scope, name, _NO_VALUE, ttl_ms))
        raise CheckpointNotSerializable(
            f"checkpoint {name!r} of scope {scope!r}: result {type(value).__name__} is not JSON-serializable; "
            "recorded as done with no value so a retry will not repeat it"
        ) from exc
    guard("write", lambda: store.put_checkpoint(scope, name, encoded, ttl_ms))
    return json.loads(encoded)["value"]


_pg_stores: dict[tuple[str, str, str], PostgresStore] = {}
_pg_stores_lock = threading.Lock()


def postgres_store(dsn: str, table: str = DEFAULT_TABLE, namespace: str = "lockguard") -> PostgresStore:
    """The process-wide store for (``dsn``, ``table``, ``namespace``); its connection is re-made after fork.

    ``namespace`` is the app's ``lockguard_key_prefix``: records of two apps
    sharing the database stay apart.
    """
    cache_key = (dsn, table, namespace)
    with _pg_stores_lock:
        store = _pg_stores.get(cache_key)
        if store is None:
            store = _pg_stores[cache_key] = PostgresStore(dsn, table, namespace)
    return store


def forget_stores() -> None:
    """Close and drop the cached PostgreSQL stores (tests that make many namespaces, or a server restart)."""
    with _pg_stores_lock:
        stores = list(_pg_stores.values())
        _pg_stores.clear()
    for store in stores:
        conn, store._conn = store._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not fail the caller
                pass
