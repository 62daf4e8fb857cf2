"""A delivery's completion records: where they are kept, how they are written, read and answered from.

A finisher records before it releases, so whoever holds the lease next sees the record; a
delivery whose scope already completed is answered from it. With the Redis store the record
is written inside the RELEASE script (:mod:`._release`); a store outside the scripts
(PostgreSQL) is written and read here. Checkpoints and ``record_completion`` use the same store.
"""

from __future__ import annotations

from typing import Any

from . import _completion as completion
from . import _connection as connection
from . import _errors as errors
from . import _keys as keys
from ._calls import CallNames
from ._completion import RedisStore, Store
from ._config import Settings
from ._events import emit
from ._request import event_fields
from .exceptions import IdempotencyKeyReused


def store_for(task: Any, s: Settings) -> Store:
    """The completion store of ``task`` under settings ``s``: Redis (the lease scripts' server) or PostgreSQL."""
    if s.completion_backend == "redis":
        client = connection.client(s)
        # Made once per client and prefix (twice per task otherwise); a new client (after fork, or other
        # settings) makes a new one. RedisStore keeps nothing else.
        store = task.__dict__.get("_lockguard_store")
        if type(store) is not RedisStore or store.client is not client or store.prefix != s.key_prefix:
            store = task.__dict__["_lockguard_store"] = RedisStore(client, s.key_prefix)
        return store
    return completion.postgres_store(s.completion_backend, s.completion_table, namespace=s.key_prefix)


def ttl_ms_for(task: Any, call: CallNames) -> int:
    """How long ``call``'s record is kept (ms): a task-id scope and a named scope have their own TTLs."""
    opts = task.lockguard_options
    return int((opts.completion_ttl_task if call.scope_is_task else opts.completion_ttl_scope) * 1000)


def record_for(task: Any, call: CallNames, task_id: str, result: Any) -> tuple[str, int]:
    """The record of a successful run and its TTL; a result that cannot be stored is dropped, and said so."""
    record, dropped = completion.encode_record(keys.meta(task_id), result, keys.meta(task.name), call.digest)
    if dropped:
        emit("completion.result_dropped", task.name, task_id=task_id, scope=call.scope, reason=dropped)
    return record, ttl_ms_for(task, call)


def record_elsewhere(task: Any, store: Store, call: CallNames, task_id: str, record: str, ttl_ms: int) -> None:
    """Record completion in a store outside the lease scripts; a failure is logged, never raised."""
    try:
        store.record(call.record, task_id, record, ttl_ms)
    except Exception as exc:  # noqa: BLE001 - the body succeeded; say so loudly, do not fail it
        emit("completion.record_failed", task.name, task_id=task_id, scope=call.scope, reason=errors.describe(exc))


def lookup(task: Any, store: Store, call: CallNames) -> str | None:
    """The record of ``call`` in a store outside the scripts; ``None`` also when the store does not answer."""
    try:
        return store.lookup(call.record)
    except Exception as exc:
        if errors.classify(exc) is None:
            raise
        emit(
            "lock.backend_unavailable",
            task.name,
            **event_fields(task, call),
            reason=f"completion store: {errors.describe(exc)}",
        )
        return None


def completed(task: Any, call: CallNames, record: str) -> Any:
    """Answer a call whose scope already completed: return the recorded result.

    An ``idempotency_key`` that completed for the same task with other
    arguments is not a duplicate: the caller reused a key for new work
    (``charge(1, 999, "pay-A")`` after ``charge(1, 1000, "pay-A")``). That
    raises :class:`IdempotencyKeyReused`, or with
    ``idempotency_mismatch="warn"`` logs and answers from the record.
    """
    recorded = completion.read_record(record)
    fields = {**event_fields(task, call), "scope": call.scope, "completed_by": recorded.task_id}
    if not call.scope_is_task and recorded.other_work(keys.meta(task.name), call.digest):
        policy = task.lockguard_options.idempotency_mismatch
        emit("completion.key_reused", task.name, **fields, policy=policy)
        if policy == "raise":
            raise IdempotencyKeyReused(call.scope, recorded.task_id)
    emit("completion.skipped", task.name, **fields)
    return recorded.result
