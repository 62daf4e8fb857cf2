"""lockguard's own two scripts around a body, with none of the task logic: a floor in-process and in the worker.

``held`` sends the ACQUIRE and RELEASE a default ``LockedTask`` sends (same keys, same values, on
lockguard's own channel), each waited for, as LockedTask waits for both against a server on this
host. The default variant minus this floor is what the task logic costs (options, headers, the
decision, metrics, events, renewal tracking, the release report). ``NOOP`` are scripts that answer
the same replies and do nothing on the server: the same bytes on the wire with the server's
script work taken out, so the floor minus that one is what the scripts cost the server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_lockguard import _completion as completion
from celery_lockguard import _handoff as handoff
from celery_lockguard import _keys as keys
from celery_lockguard import _lease as lease_ops
from celery_lockguard import _scripts as scripts
from celery_lockguard import _wire
from celery_lockguard._config import DEFAULT_VISIBILITY_TIMEOUT

from .cycle import FENCE_TTL_MS

#: ACQUIRE and RELEASE as lockguard runs them.
LOCKGUARD = (scripts.acquire, scripts.release)
#: Scripts that answer as an uncontended ACQUIRE and RELEASE do, and touch nothing.
NOOP = (
    scripts.Script("bench_noop_acquire", "return {'ok', '1'}"),
    scripts.Script("bench_noop_release", "return {1, 1}"),
)

#: A task-id scope's completion_ttl: the broker's visibility timeout, at its default.
_RECORD_TTL_MS = int(DEFAULT_VISIBILITY_TIMEOUT * 1000)
_RESERVE_MS = int(handoff.RESERVATION_TTL * 1000)


@contextmanager
def held(
    client: Any, prefix: str, key: str, task_id: str, task_name: str, pair: tuple[Any, Any] = LOCKGUARD
) -> Iterator[None]:
    """ACQUIRE entity ``key`` (completion check on the task's own scope) around the block, then RELEASE it with
    a completion record; both waited for. A held entity raises: the benchmark's keys are distinct."""
    ch = _wire.channel(client)
    if ch is None:
        raise RuntimeError("the scripts floor needs a plain redis:// client (lockguard's channel)")
    acquire, release = pair
    lock, done = keys.lock_name(prefix, key), keys.done_name(prefix, keys.task_scope(task_id))
    token = lease_ops.new_token()
    holder = [token, 30_000, task_id, task_name, "0" * 16, lease_ops.HOST, os.getpid(), "", "running"]
    got = ch.call(
        acquire,
        [lock, keys.fence_name(prefix, key), keys.claim_name(prefix, key), done],
        [*holder, FENCE_TTL_MS, "", ""],
    )
    if got[0] != "ok":
        raise RuntimeError(f"{key}: {got!r}: the floor's keys are distinct")
    try:
        yield
    finally:
        record = completion.encode_record(task_id, None)[0]
        ch.call(
            release,
            [lock, keys.wait_name(prefix, key), keys.waiters_name(prefix, key), done],
            [token, record, _RECORD_TTL_MS, _RESERVE_MS],
        )
