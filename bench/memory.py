"""Memory in Redis per held lease, per fence counter, per completion record; and what a task rate costs.

Two readings on a private server: ``MEMORY USAGE`` of one key (the key's own
allocation) and the ``used_memory`` delta over many keys divided by their
number (adds the keyspace and expires-dict entries: what the server really
grows by). Names and values are realistic: a uuid task id, a dotted task
name, a hostname, an ``invoice:<n>`` entity.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from celery_lockguard import _completion as completion
from celery_lockguard import _lease as lease_ops
from celery_lockguard._keys import done_name, fence_name, lock_name, task_scope
from celery_lockguard._lease import Lease

from .e2e import BenchFailure

PREFIX = "lockguard"  # the default prefix: key lengths as in production
TASK_NAME = "billing.tasks.charge_invoice"
FENCE_TTL_MS = 30 * 86400 * 1000
TASK_SCOPE_TTL_S = 3600  # completion_ttl for task-id scopes (broker visibility_timeout)
IDEM_SCOPE_TTL_S = 86400  # completion_ttl for idempotency_key scopes


@dataclass
class MemoryRow:
    what: str
    memory_usage: int  # MEMORY USAGE of one key
    per_item: float  # used_memory delta / items


def _grow(admin: redis.Redis, n: int, make: Callable[[int], None]) -> float:
    before = int(admin.info("memory")["used_memory"])
    for i in range(n):
        make(i)
    after = int(admin.info("memory")["used_memory"])
    return (after - before) / n


def measure(url: str, n: int) -> list[MemoryRow]:
    """Measure each kind of key with ``n`` instances."""
    c = redis.Redis.from_url(url, decode_responses=True)
    admin = redis.Redis.from_url(url, decode_responses=True)
    host = socket.gethostname()
    run = uuid.uuid4().hex[:6]
    leases: list[Lease] = []
    rows: list[MemoryRow] = []

    def hold(i: int) -> None:
        got = lease_ops.acquire(
            c,
            PREFIX,
            f"invoice:{run}{i}",
            ttl_ms=30_000,
            task_id=str(uuid.uuid4()),
            task_name=TASK_NAME,
            digest="0123456789abcdef",
            worker=f"celery@{host}",
            fence_ttl_ms=FENCE_TTL_MS,
        )
        if not isinstance(got, Lease):
            raise BenchFailure(f"memory bench: acquire failed: {got!r}")
        leases.append(got)

    per_pair = _grow(admin, n, hold)  # a held lease = its hash + its entity's fence counter
    k0 = f"invoice:{run}0"
    lock_usage = int(admin.memory_usage(lock_name(PREFIX, k0), samples=0) or 0)
    fence_usage = int(admin.memory_usage(fence_name(PREFIX, k0), samples=0) or 0)
    # Release the leases: the fence counters stay (30-day TTL), so the delta is the hashes.
    before = int(admin.info("memory")["used_memory"])
    for lease in leases:
        lease_ops.release(c, lease, PREFIX)
    freed = (before - int(admin.info("memory")["used_memory"])) / n
    rows.append(MemoryRow("held lease (lock hash)", lock_usage, freed))
    rows.append(MemoryRow("fence counter (per entity, 30-day TTL)", fence_usage, per_pair - freed))

    for label, scope_of, result, ttl_s in (
        ("completion record, task-id scope, result None", lambda t, i: task_scope(t), None, TASK_SCOPE_TTL_S),
        (
            "completion record, task-id scope, small result",
            lambda t, i: task_scope(t),
            {"charged": 1250, "ok": True},
            TASK_SCOPE_TTL_S,
        ),
        ("completion record, idempotency_key scope", lambda t, i: f"charge:{run}{i}", None, IDEM_SCOPE_TTL_S),
    ):
        marker: list[str] = []

        def make(
            i: int,
            _s: Callable[[str, int], str] = scope_of,
            _r: object = result,
            _ttl: int = ttl_s,
            _first: list[str] = marker,
        ) -> None:
            task_id = str(uuid.uuid4())
            name = done_name(PREFIX, _s(task_id, i))
            if not _first:
                _first.append(name)
            c.set(name, completion.encode_record(task_id, _r)[0], px=_ttl * 1000)  # as RELEASE writes it

        per = _grow(admin, n, make)
        rows.append(MemoryRow(label, int(admin.memory_usage(marker[0], samples=0) or 0), per))

    # Peers: one held lock each, for scale.
    for label, name, value in (
        ("redis-py Lock / raw SET NX (uuid token)", "lock:invoice:48291", uuid.uuid1().hex),
        ("celery-once key", f"qo_{TASK_NAME}_invoice_id-48291", "1"),
        ("celery-singleton key", "SINGLETONLOCK_" + uuid.uuid4().hex, str(uuid.uuid4())),
    ):
        c.set(name, value, px=3_600_000)
        rows.append(MemoryRow(label, int(admin.memory_usage(name, samples=0) or 0), float("nan")))
    c.close()
    admin.close()
    return rows


def rate_costs(rows: list[MemoryRow], rates: list[int]) -> list[tuple[int, float, float]]:
    """(tasks/s, MiB of task-id completion records, MiB of idempotency_key records) in steady state.

    Steady state holds rate * TTL records: 3600 s for task-id scopes, 86400 s
    for ``idempotency_key`` scopes (the defaults).
    """
    by = {r.what: r.per_item for r in rows}
    task_rec = by["completion record, task-id scope, result None"]
    idem_rec = by["completion record, idempotency_key scope"]
    mib = 1024 * 1024
    return [(r, r * TASK_SCOPE_TTL_S * task_rec / mib, r * IDEM_SCOPE_TTL_S * idem_rec / mib) for r in rates]
