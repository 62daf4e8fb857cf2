"""The Celery app of the transfer soak (:mod:`chaos.transfer`), run by ``celery -A chaos.transfer_app:app worker``.

Configured from the JSON in ``CHAOS_TRANSFER`` (written by the driver, which builds the same app to publish):
the broker (RabbitMQ), the result backend and the lock Redis (a private server, or a private Cluster), the
PostgreSQL DSN and the run's table base name.

Two tasks share one body, written the way docs/multi-entity.md tells a user to write a transfer:

* ``ctransfer.move``: ``lock_key=("account:{src}", "account:{dst}")`` -- both accounts or neither --,
  ``idempotency_key="transfer:{transfer_id}"`` with the PostgreSQL completion backend (the record commits
  with the money), ``acks_late`` + ``reject_on_worker_lost`` (a killed child's message comes back), and one
  transaction that advances the fence of each account, reads both balances, works, and writes them back;
* ``ctransfer.unlocked``: the control, a plain task with the same body on accounts of its own and no lock,
  no fence, no record. The read-then-write is deliberate: two bodies of one account at once lose an update,
  and the oracle must see it.

Every body records its execution in the run's history table, committed at once (outside the ledger
transaction): the accounts, the fence it held per account, its pid, and its start and end read from the
PostgreSQL server clock (``clock_timestamp()``), one clock for every process of the run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from typing import Any

import psycopg
import structlog
from celery import Celery

from celery_lockguard import BackendUnavailable, LockedTask, StaleFence, advance_fence
from celery_lockguard.fencing import fence_table_sql

from .app import connect

# Lock events at INFO and above with ``--loglevel INFO`` (the driver's option): a stall is then readable.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(
        getattr(logging, json.loads(os.environ.get("CHAOS_TRANSFER", "{}")).get("loglevel", "WARNING"))
    ),
    cache_logger_on_first_use=True,
)

#: The two entities of a transfer: held together or not at all.
ACCOUNTS = ("account:{src}", "account:{dst}")


def account_of(key: str) -> int:
    """The account number of an entity key such as ``account:7``."""
    return int(key.rsplit(":", 1)[1])


class Tables:
    """The run's PostgreSQL tables, named after one base so a run owns (and drops) exactly these."""

    def __init__(self, base: str) -> None:
        self.accounts = f"{base}_accounts"
        self.moves = f"{base}_moves"
        self.executions = f"{base}_exec"
        self.fences = f"{base}_fences"
        self.completions = f"{base}_completions"

    def all(self) -> list[str]:
        return [self.accounts, self.moves, self.executions, self.fences, self.completions]

    def ddl(self) -> list[str]:
        """No uniqueness on moves and no row locks in the body: the oracle, not the schema, must catch a fault."""
        return [
            f"CREATE TABLE {self.accounts} (id INT PRIMARY KEY, balance BIGINT NOT NULL)",
            f"CREATE TABLE {self.moves} (seq BIGSERIAL PRIMARY KEY, transfer_id INT NOT NULL, src INT NOT NULL,"
            " dst INT NOT NULL, amount INT NOT NULL, exec_id BIGINT NOT NULL)",
            f"CREATE TABLE {self.executions} (id BIGSERIAL PRIMARY KEY, transfer_id INT NOT NULL,"
            " task_id TEXT NOT NULL, control BOOLEAN NOT NULL, accounts TEXT NOT NULL, fences TEXT NOT NULL,"
            " pid INT NOT NULL, t_start DOUBLE PRECISION NOT NULL, t_end DOUBLE PRECISION, outcome TEXT)",
            fence_table_sql(self.fences),
        ]


class _Connection:
    """One PostgreSQL connection per process, made lazily (never inherited across fork), remade when broken."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0

    def get(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or self._pid != os.getpid() or conn.closed or conn.broken:
            conn = self._conn = connect(self.dsn)
            self._pid = os.getpid()
        return conn


class _AlreadyRecorded(Exception):
    """Another run of this transfer committed first: roll this run's money back."""


def create_app(cfg: dict[str, Any]) -> Celery:
    """The soak's app for ``cfg`` (see :mod:`chaos.transfer` for the keys)."""
    tables = Tables(cfg["tables"])
    app = Celery("chaos_transfer", broker=cfg["broker"], backend=cfg["results"])
    app.conf.update(
        task_default_queue=cfg["queue"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
        lockguard_redis_url=cfg["lock_url"],
        lockguard_redis_cluster=bool(cfg.get("cluster")),
        lockguard_key_prefix=cfg["prefix"],
        lockguard_socket_timeout=2.0,
        lockguard_completion_backend=cfg["pg"],
        lockguard_completion_table=tables.completions,
    )
    db = _Connection(cfg["pg"])
    work_ms = float(cfg["work_ms"])

    def body(task: Any, transfer_id: int, src: int, dst: int, amount: int, control: bool) -> dict[str, Any]:
        lease = None if control else task.lock
        fences = dict(lease.fences) if lease is not None else {}
        accounts = sorted({src, dst})
        conn = db.get()
        row = conn.execute(
            f"INSERT INTO {tables.executions} (transfer_id, task_id, control, accounts, fences, pid, t_start)"
            " VALUES (%s, %s, %s, %s, %s, %s, extract(epoch from clock_timestamp())) RETURNING id",
            (transfer_id, task.request.id, control, json.dumps(accounts), json.dumps(fences), os.getpid()),
        ).fetchone()
        assert row is not None
        exec_id = row[0]
        outcome = "error"
        result = {"transfer_id": transfer_id, "fences": fences}
        try:
            time.sleep(work_ms / 2000 * random.uniform(0.5, 1.5))  # a kill lands before or inside the transaction
            with conn.transaction():
                if lease is not None:
                    for key in sorted(lease.fences):  # each account's fence, in one order; StaleFence: retried
                        advance_fence(conn, lease, table=tables.fences, entity=key)
                rows = conn.execute(
                    f"SELECT id, balance FROM {tables.accounts} WHERE id = ANY(%s)", (accounts,)
                ).fetchall()
                balance = {int(a): int(b) for a, b in rows}
                time.sleep(work_ms / 2000 * random.uniform(0.5, 1.5))  # read, work, write: the unlocked race
                balance[src] -= amount
                balance[dst] += amount
                for account in accounts:
                    conn.execute(
                        f"UPDATE {tables.accounts} SET balance = %s WHERE id = %s", (balance[account], account)
                    )
                conn.execute(
                    f"INSERT INTO {tables.moves} (transfer_id, src, dst, amount, exec_id) VALUES (%s, %s, %s, %s, %s)",
                    (transfer_id, src, dst, amount, exec_id),
                )
                if not control and not task.record_completion(conn, result):
                    raise _AlreadyRecorded()
            outcome = "committed"
        except _AlreadyRecorded:
            outcome = "already_recorded"
        except StaleFence:
            outcome = "stale_fence"
            raise
        finally:
            db.get().execute(
                f"UPDATE {tables.executions} SET t_end = extract(epoch from clock_timestamp()), outcome = %s"
                " WHERE id = %s",
                (outcome, exec_id),
            )
        return result

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="ctransfer.move",
        lock_key=ACCOUNTS,
        idempotency_key="transfer:{transfer_id}",
        lock_ttl=cfg["ttl"],
        on_locked="retry",
        lock_max_waits=100_000,
        acks_late=True,
        reject_on_worker_lost=True,
        autoretry_for=(StaleFence, BackendUnavailable),
        retry_kwargs={"max_retries": 50, "countdown": 0.2},
    )
    def move(self: Any, transfer_id: int, src: int, dst: int, amount: int) -> dict[str, Any]:
        return body(self, transfer_id, src, dst, amount, control=False)

    @app.task(bind=True, shared=False, name="ctransfer.unlocked", acks_late=True, reject_on_worker_lost=True)
    def unlocked(self: Any, transfer_id: int, src: int, dst: int, amount: int) -> dict[str, Any]:
        return body(self, transfer_id, src, dst, amount, control=True)

    return app


app = create_app(json.loads(os.environ["CHAOS_TRANSFER"])) if "CHAOS_TRANSFER" in os.environ else None
