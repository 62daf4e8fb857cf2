"""One lease's lifecycle on one client: acquire, release, renew, shorten.

Each public function validates and calls exactly one script: one round trip.
A :class:`Lease` knows whether it is still valid without asking Redis: it is
valid until the *send time* of its last successful renewal plus the TTL, minus
a drift margin (Redis's distributed-lock rule), so a slow reply or a paused
process can only make it look lost early, never valid late. Lost is final: a
renewal whose reply arrives after the validity passed does not bring it back.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError

from . import _cluster as cluster
from . import _scripts as scripts
from . import _wire
from ._keys import (
    claim_name,
    done_name,
    fence_name,
    fence_row,
    lock_name,
    meta,
    rate_name,
    slot_fence_name,
    slot_lock_name,
    wait_name,
    waiters_name,
    watch_name,
)
from ._process import PerProcess
from .exceptions import LockLost

HOST = socket.gethostname()
#: ``HOST`` as holder metadata (bounded once, not per acquisition).
HOST_META = meta(HOST)


def drift_margin(ttl_ms: int) -> float:
    """Seconds of clock drift and scheduling slack subtracted from every validity."""
    return ttl_ms * 0.01 / 1000 + 0.002


class Lease:
    """A held lease: key, token, fence and a locally computed validity."""

    def __init__(
        self,
        key: str,
        prefix: str,
        token: str,
        fence: int,
        ttl_ms: int,
        sent_at: float,
        task_id: str,
        task_name: str,
        slot: int | None = None,
    ) -> None:
        self.key = key
        #: The slot held (``lock_limit``/``lock_rate`` tasks, 0-based), or ``None`` for the single lease.
        self.slot = slot
        self.redis_key = slot_lock_name(prefix, key, slot or 0)
        self.token = token
        self.fence = fence
        self.ttl_ms = ttl_ms
        self.task_id = task_id
        self.task_name = task_name
        self.acquired_at = sent_at
        self.valid_until = sent_at + ttl_ms / 1000 - drift_margin(ttl_ms)
        self.released = False
        self.lost_reason: str | None = None
        self._expired = False  # latched once the validity has passed: lost stays lost
        #: Replicas that acknowledged the acquisition (``WAIT``), or ``None`` when none were asked for.
        self.replicas: int | None = None
        self._guard = threading.Lock()

    @property
    def lost(self) -> bool:
        """True once the token is gone or the validity has passed; never false again after that."""
        if self.lost_reason is not None or self._expired:
            return True
        if time.monotonic() > self.valid_until:
            self._expired = True
            return True
        return False

    #: Whether this lease holds several entities (:class:`MultiLease`).
    several = False

    @property
    def keys(self) -> tuple[str, ...]:
        """Every entity this lease holds: ``(key,)`` for one entity."""
        return (self.key,)

    @property
    def fences(self) -> dict[str, int]:
        """Entity key -> fence, one entry per entity held (one here; several for a :class:`MultiLease`)."""
        return {self.key: self.fence}

    @property
    def fence_field(self) -> int | dict[str, int]:
        """What an event's ``fence`` field says: the fence, or the fences of a multi-entity lease."""
        return self.fence

    def renewal_entries(self) -> list[tuple[str, str, int]]:
        """``(lease hash, token, ttl_ms)`` of every hash RENEW must extend for this lease."""
        return [(self.redis_key, self.token, self.ttl_ms)]

    @property
    def fence_row(self) -> str:
        """The row :func:`~celery_lockguard.advance_fence` keeps: K, or ``K#<i>`` for slot i > 0 (own fences)."""
        return fence_row(self.key, self.slot)

    @property
    def held(self) -> bool:
        """True while the lease is neither released nor lost."""
        return not self.released and not self.lost

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the lease is still held: call before a write."""
        if not self.held:
            raise LockLost(self.key)

    def renewed(self, sent_at: float) -> bool:
        """Extend the validity from a renewal sent at ``sent_at``; False (nothing changes) once lost.

        A reply that arrives after the validity passed must not revive the
        lease: the body may already have been told it was lost, and between
        the two moments someone else may have held the key.
        """
        with self._guard:
            if self.lost:
                return False
            self.valid_until = max(self.valid_until, sent_at + self.ttl_ms / 1000 - drift_margin(self.ttl_ms))
            return True

    def mark_lost(self, reason: str) -> bool:
        """Record why the lease is lost; True the first time only."""
        with self._guard:
            if self.lost_reason is not None:
                return False
            self.lost_reason = reason
            return True

    def hold_ms(self) -> float:
        return (time.monotonic() - self.acquired_at) * 1000

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<Lease {self.key!r} fence={self.fence} {state}>"


class MultiLease(Lease):
    """A lease on several entities taken as one acquisition (``lock_key`` as a sequence): one token, one fence each.

    ``key`` is the anchor (the first entity in sorted order), where the queue claim, the park and
    the watch markers live. ``fence`` is refused: there is no one fence of several entities, and a
    caller writing one would fence one entity and leave the others open. Read :attr:`fences`
    (entity key -> fence); :func:`~celery_lockguard.advance_fence` advances every entity, or the one
    named by ``entity=``.
    """

    several = True

    def __init__(
        self,
        keys: tuple[str, ...],
        prefix: str,
        token: str,
        fences: dict[str, int],
        ttl_ms: int,
        sent_at: float,
        task_id: str,
        task_name: str,
    ) -> None:
        self._keys = keys
        self._fences = dict(fences)
        super().__init__(keys[0], prefix, token, fences[keys[0]], ttl_ms, sent_at, task_id, task_name)
        self.redis_keys = [lock_name(prefix, k) for k in keys]
        self.prefix = prefix

    @property
    def fence(self) -> int:
        raise AttributeError(
            f"this lease holds several entities {list(self._keys)!r}, each with its own fence: read "
            "lease.fences[key], or call advance_fence(conn, lease) (every entity) or advance_fence(conn, lease, "
            "entity=key)"
        )

    @fence.setter
    def fence(self, value: int) -> None:
        pass  # Lease.__init__ sets it; the fences live in _fences

    @property
    def keys(self) -> tuple[str, ...]:
        return self._keys

    @property
    def fences(self) -> dict[str, int]:
        return dict(self._fences)

    @property
    def fence_field(self) -> dict[str, int]:
        return dict(self._fences)

    @property
    def fence_row(self) -> str:
        raise AttributeError("a multi-entity lease fences one row per entity key: see MultiLease.fences")

    def renewal_entries(self) -> list[tuple[str, str, int]]:
        return [(key, self.token, self.ttl_ms) for key in self.redis_keys]

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<MultiLease {list(self._keys)!r} fences={self._fences} {state}>"


@dataclass(frozen=True)
class Holder:
    """Who holds a contended entity, as read in the ACQUIRE round trip."""

    task_id: str
    task_name: str
    digest: str
    host: str
    pid: int
    state: str
    pttl_ms: int
    ms_since_renewal: int
    token: str
    #: The holder's own lease TTL in ms (0 if unknown): judge its liveness by it, not by the contender's.
    ttl_ms: int = 0
    #: ``lock_limit``/``lock_rate`` tasks: the slot the holder holds and how many of the N slots are taken.
    slot: int | None = None
    busy: int = 1
    #: Several entities (``lock_key`` as a sequence): the entity that blocked the acquisition, else ``None``.
    entity: str | None = None


@dataclass(frozen=True)
class Throttled:
    """A slot was free but the entity's start window is full (``lock_rate``): nothing was acquired."""

    #: Milliseconds until the oldest start in the window leaves it (the earliest a start can be admitted).
    wait_ms: int
    #: Starts in the window when asked.
    starts: int


@dataclass(frozen=True)
class Done:
    """A completion record exists for the scope: the work already ran."""

    record: str


_rng: PerProcess[random.Random] = PerProcess(lambda: random.Random(secrets.randbits(256)))


def new_token() -> str:
    """A random owner token, fresh per acquisition (never the task id): 128 bits, unique, not a secret.

    Anyone who can read the lease hash reads the token, so it guards against
    mix-ups (a late release, a second copy), not attackers: a generator seeded
    from the OS once per process serves it without a system call per lease
    (``secrets`` cost ~10 µs of a locked task's CPU here). Reseeded after fork,
    or parent and children would hand out the same sequence.
    """
    return f"{_rng.get().getrandbits(128):032x}"


def acquire(
    client: Any,
    prefix: str,
    key: str,
    *,
    ttl_ms: int,
    task_id: str,
    task_name: str,
    digest: str,
    worker: str,
    fence_ttl_ms: int,
    scope: str | None = None,
    state: str = "running",
    replace_token: str = "",
    token: str | None = None,
    claim_token: str = "",
    replicas: int = 0,
    replicas_timeout_ms: int = 0,
    limit: int = 1,
    rate: tuple[int, int] | None = None,
) -> Lease | Holder | Done | Throttled:
    """Try to take the lease on ``key``; check ``scope``'s completion record first.

    ``limit`` > 1 or a ``rate`` (starts, window ms) take one of ``limit`` slot leases through
    ACQUIRE_SLOTS, admitted by the start window in the same round trip (``Throttled`` when it is
    full); otherwise the single lease through ACQUIRE, exactly as before.

    ``claim_token`` frees this message's until_started claim in the same round trip.
    ``replicas`` > 0 sends ``WAIT replicas replicas_timeout_ms`` in the same
    round trip, on the same connection (WAIT counts that connection's writes);
    the count that acknowledged is ``Lease.replicas``.

    On Cluster, when the completion record lives in another slot than the lease,
    it is read with its own GET *after* ACQUIRE: a finisher writes its record
    before it frees the lease (:func:`release`), so whoever takes the lease next
    sees that record. A record found then gives the fresh lease back (a third
    round trip, only for a duplicate).
    """
    token = token or new_token()
    lock_key = lock_name(prefix, key)
    slotted = limit > 1 or rate is not None
    if slotted:
        keys = [slot_lock_name(prefix, key, i) for i in range(limit)]
        keys += [slot_fence_name(prefix, key, i) for i in range(limit)]
        keys.append(rate_name(prefix, key))
    else:
        keys = [lock_key, fence_name(prefix, key), claim_name(prefix, key)]
    script = scripts.acquire_slots if slotted else scripts.acquire
    done_key = done_name(prefix, scope) if scope is not None else None
    split = done_key is not None and cluster.split_done(client, lock_key, done_key)
    if done_key is not None and not split:
        keys.append(done_key)
    args: list[Any] = [
        token,
        ttl_ms,
        meta(task_id),
        meta(task_name),
        meta(digest),
        HOST_META,
        os.getpid(),
        meta(worker),
        state,
        fence_ttl_ms,
        replace_token,
    ]
    if slotted:
        args += [limit, rate[0] if rate else 0, rate[1] if rate else 0]
    else:
        args.append(claim_token)
    sent_at = time.monotonic()
    acked: int | None = None
    try:
        if replicas > 0:
            reply, acked = _acquire_and_wait(client, keys, args, replicas, replicas_timeout_ms, script)
        else:
            reply = script(client, keys, args)
    except ResponseError as exc:
        fences = keys[limit : 2 * limit] if slotted else [keys[1]]
        text = str(exc)
        named = next((f for f in fences if f" {f} " in text), fences[0])
        corrupt = scripts.corrupt_fence(exc, named)
        if corrupt is not None:
            raise corrupt from exc
        raise
    kind = reply[0]
    slot = int(reply[2]) if slotted and kind == "ok" else None
    if split and kind != "done":
        # A full window is no reason to refuse work that already ran: a record answers a throttled call too.
        assert done_key is not None
        record = client.get(done_key)
        if record is not None:
            if kind == "ok":
                scripts.release(client, [slot_lock_name(prefix, key, slot or 0)], [token, "", 0])
                if rate is not None:  # no body runs on this lease: its start is taken back (as _give_back does)
                    client.zrem(rate_name(prefix, key), token)
            return Done(record)
    if kind == "ok":
        lease = Lease(key, prefix, token, int(reply[1]), ttl_ms, sent_at, task_id, task_name, slot)
        lease.replicas = acked
        return lease
    if kind == "done":
        return Done(reply[1])
    if kind == "throttled":
        return Throttled(int(reply[1]), int(reply[2]))
    return held_reply(reply)


def held_reply(reply: Any) -> Holder:
    """The holder in a script's ``'held'`` reply (ACQUIRE, ACQUIRE_SLOTS and WORKFLOW_ENTER share its layout)."""
    return Holder(
        task_id=reply[1],
        task_name=reply[2],
        digest=reply[3],
        host=reply[4],
        pid=int(reply[5] or 0),
        state=reply[6],
        pttl_ms=int(reply[7]),
        ms_since_renewal=int(reply[8]),
        token=reply[9],
        ttl_ms=int(reply[10]) if len(reply) > 10 else 0,
        slot=int(reply[11]) if len(reply) > 11 else None,
        busy=int(reply[12]) if len(reply) > 12 else 1,
    )


def _acquire_and_wait(
    client: Any, keys: list[str], args: list[Any], replicas: int, timeout_ms: int, script: scripts.Script
) -> tuple[Any, int]:
    """ACQUIRE (or ACQUIRE_SLOTS) then ``WAIT`` in one pipeline: one connection, one round trip (plus the wait)."""
    on_cluster = cluster.is_cluster(client)
    for attempt in range(3):
        target = cluster.node_client(client, keys[0]) if on_cluster else client
        pipe = target.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        reply, acked = pipe.execute(raise_on_error=False)
        if isinstance(reply, NoScriptError) and attempt < 2:
            target.script_load(script.source)
            continue
        if on_cluster and isinstance(reply, (MovedError, AskError)) and attempt < 2:
            client.nodes_manager.initialize()  # the slot moved: refresh the map, go to its new node
            continue
        for value in (reply, acked):
            if isinstance(value, Exception):
                raise value
        return reply, int(acked)
    raise AssertionError("unreachable")  # pragma: no cover


def release(
    client: Any, lease: Lease, prefix: str, scope: str | None = None, record: str = "", completion_ttl_ms: int = 0
) -> tuple[int, int]:
    """Release ``lease`` if it still owns the key; record completion of ``scope`` if given.

    Returns ``(released, recorded)`` as the RELEASE script does; wakes nobody
    (see :func:`release_and_wake`).
    """
    released, recorded, _ = release_and_wake(client, lease, prefix, scope, record, completion_ttl_ms, reserve_ms=0)
    return released, recorded


@dataclass(frozen=True)
class Woken:
    """The waiter RELEASE handed the entity to: its park token (the reservation's token) and message."""

    key: str
    park_token: str
    message: str
    #: The waiters of the other entities the same release freed (a multi-entity lease): woken alike.
    also: tuple[Woken, ...] = ()


def release_and_wake(
    client: Any,
    lease: Lease,
    prefix: str,
    scope: str | None = None,
    record: str = "",
    completion_ttl_ms: int = 0,
    reserve_ms: int = 0,
) -> tuple[int, int, Woken | None]:
    """Release ``lease`` as :func:`release` does and, with ``reserve_ms`` > 0, hand the entity to its oldest waiter.

    Returns ``(released, recorded, woken)``; ``woken`` is the waiter whose message the caller must
    publish now (``_handoff.wake``), or ``None``. On Cluster, with the record in another slot, the
    record is written first (``SET NX PX``), then the lease is released: never a moment where the
    lease is free and the record missing.
    """
    if isinstance(lease, MultiLease):
        from . import _multi

        return _multi.release(client, lease, prefix, scope, record, completion_ttl_ms, reserve_ms)
    recorded = 0
    done_key: str | None = None
    if scope is not None:
        done_key = done_name(prefix, scope)
        if cluster.split_done(client, lease.redis_key, done_key):
            recorded = 1 if client.set(done_key, record, nx=True, px=completion_ttl_ms) else 0
            done_key = None
    released, recorded_here, woken = release_token(
        client,
        prefix,
        lease.key,
        lease.token,
        record,
        completion_ttl_ms,
        reserve_ms,
        done_key,
        lease.redis_key,
        lease.slot,
    )
    lease.released = True
    return released, recorded_here or recorded, woken


def release_token(
    client: Any,
    prefix: str,
    key: str,
    token: str,
    record: str = "",
    completion_ttl_ms: int = 0,
    reserve_ms: int = 0,
    done_key: str | None = None,
    lease_key: str | None = None,
    slot: int | None = None,
) -> tuple[int, int, Woken | None]:
    """RELEASE by token (also a woken copy's reservation, from the worker's main process on a revoke).

    ``lease_key``: the slot lease hash (``Lease.redis_key``) when it is not K's single lease; ``slot``: its
    slot (``Lease.slot``), so a waiter of the single lease is woken only once no slot is held.
    """
    keys, args = _release_call(prefix, key, token, record, completion_ttl_ms, reserve_ms, done_key, lease_key, slot)
    return _released(key, scripts.release(client, keys, args))


def _release_call(
    prefix: str,
    key: str,
    token: str,
    record: str,
    completion_ttl_ms: int,
    reserve_ms: int,
    done_key: str | None,
    lease_key: str | None = None,
    slot: int | None = None,
) -> tuple[list[str], list[Any]]:
    keys = [lease_key or lock_name(prefix, key), wait_name(prefix, key), waiters_name(prefix, key)]
    if done_key is not None:
        keys.append(done_key)
    return keys, [token, record, completion_ttl_ms, reserve_ms, "" if slot is None else slot]


def _released(key: str, reply: Any) -> tuple[int, int, Woken | None]:
    woken = Woken(key, reply[2], reply[3]) if len(reply) > 3 else None
    return int(reply[0]), int(reply[1]), woken


def release_later(
    client: Any,
    lease: Lease,
    prefix: str,
    on_reply: Callable[[tuple[int, int, Woken | None] | BaseException], None],
    scope: str | None = None,
    record: str = "",
    completion_ttl_ms: int = 0,
    reserve_ms: int = 0,
) -> bool:
    """:func:`release_and_wake`, sent now; ``on_reply`` gets ``(released, recorded, woken)`` (or the error) when read.

    The lease is free (or handed to its oldest waiter) on the server as soon as this
    returns; only the reply is read later (:mod:`celery_lockguard._wire`), and with it
    the waiter to publish. False, with nothing sent, where that cannot be done exactly
    (Sentinel, Cluster, green pools) or is not worth it (a server on this host,
    ``_wire.DEFER_NEAR``): call :func:`release_and_wake` instead. A failed
    send raises, as :func:`release_and_wake` would.
    """
    if isinstance(lease, MultiLease):
        from . import _multi

        return _multi.release_later(client, lease, prefix, on_reply, scope, record, completion_ttl_ms, reserve_ms)
    done_key = done_name(prefix, scope) if scope is not None else None
    if done_key is not None and cluster.split_done(client, lease.redis_key, done_key):
        return False
    ch = _wire.channel(client)
    if ch is None or not ch.defers_release:
        return False
    keys, args = _release_call(
        prefix, lease.key, lease.token, record, completion_ttl_ms, reserve_ms, done_key, lease.redis_key, lease.slot
    )

    def read(reply: Any) -> None:
        on_reply(reply if isinstance(reply, BaseException) else _released(lease.key, reply))

    ch.defer(scripts.release, keys, args, read)
    lease.released = True
    return True


def renew(client: Any, leases: list[Lease]) -> list[int]:
    """Renew every lease in one round trip (on Cluster: one per node); 1 renewed, 0 lost (token gone)."""
    if not leases:
        return []
    if any(lease.several for lease in leases):
        # A multi-entity lease renews every one of its hashes in the same RENEW: renewed only if all were
        # (losing any one entity is losing the lease).
        entries = [lease.renewal_entries() for lease in leases]
        flat = renew_entries(client, [entry for group in entries for entry in group])
        out, at = [], 0
        for group in entries:
            out.append(1 if all(flat[at : at + len(group)]) else 0)
            at += len(group)
        return out
    if cluster.is_cluster(client):
        return cluster.renew(client, [(lease.redis_key, lease.token, lease.ttl_ms) for lease in leases])
    args: list[Any] = []
    for lease in leases:
        args += [lease.token, lease.ttl_ms]
    return [int(x) for x in scripts.renew(client, [lease.redis_key for lease in leases], args)]


def renew_entries(client: Any, entries: list[tuple[str, str, int]]) -> list[int]:
    """RENEW ``(lease hash, token, ttl_ms)`` entries in one round trip (on Cluster: one per node)."""
    if cluster.is_cluster(client):
        return cluster.renew(client, entries)
    args: list[Any] = []
    for _, token, ttl_ms in entries:
        args += [token, ttl_ms]
    return [int(x) for x in scripts.renew(client, [key for key, _, _ in entries], args)]


def shorten(
    client: Any,
    prefix: str,
    key: str,
    task_id: str,
    grace_ms: int,
    host: str = HOST,
    pid: int | None = None,
    limit: int = 1,
) -> bool:
    """From a process without the token: cut the lease ``task_id`` holds on ``host`` to ``grace_ms``.

    ``pid``: the child that ran the task, when the caller knows it; then a
    same-host holder of the same task id in another process (a redelivery that
    took the lease over) is left alone. ``None`` matches any pid.
    ``limit`` > 1: the main process does not know which slot the child took, so every slot is
    tried (one SHORTEN each, on this rare path only) until one was the task's.
    """
    args: list[Any] = [meta(task_id), meta(host), grace_ms, "" if pid is None else int(pid)]
    return any(bool(scripts.shorten(client, [slot_lock_name(prefix, key, i)], args)) for i in range(limit))


def unadmit(client: Any, prefix: str, lease: Lease) -> int:
    """Take back the start ``lease`` was admitted with (``lock_rate``) when no body runs on it.

    A watch copy whose original settled, a record found under the fresh lease, a late reply: the lease
    is given back unused, and a start counted for it would spend the entity's budget on nothing (a
    ``"1/h"`` partner budget gone for an hour). ZREM of its token; 1 taken back, 0 not in the window.
    """
    return int(client.zrem(rate_name(prefix, lease.key), lease.token))


def force_release(
    client: Any, prefix: str, key: str, fence_ttl_ms: int, slot: int = 0, reserve_ms: int = 0
) -> tuple[bool, int, str, Woken | None]:
    """Evict any holder of ``key`` (slot ``slot`` of a ``lock_limit`` entity), bump its fence, wake its oldest waiter.

    Returns (deleted, new fence, evicted task id, woken): ``woken`` is the waiter the freed lease
    was handed to (``reserve_ms`` > 0), whose message the caller publishes (``_handoff.wake``).
    Raises :class:`~celery_lockguard.exceptions.CorruptFence` (nothing deleted) when the fence
    counter is corrupt.
    """
    keys = [slot_lock_name(prefix, key, slot), slot_fence_name(prefix, key, slot)]
    keys += [wait_name(prefix, key), waiters_name(prefix, key)]
    try:
        reply = scripts.force_release(client, keys, [fence_ttl_ms, reserve_ms])
    except ResponseError as exc:
        corrupt = scripts.corrupt_fence(exc, keys[1])
        if corrupt is not None:
            raise corrupt from exc
        raise
    woken = Woken(key, reply[3], reply[4]) if len(reply) > 4 else None
    return bool(reply[0]), int(reply[1]), reply[2], woken


def wake_if_free(client: Any, prefix: str, key: str, reserve_ms: int, limit: int = 1) -> Woken | None:
    """WAKE: if ``key`` (any of its ``limit`` slots) is free, hand it to its oldest waiter; the waiter, or ``None``."""
    keys = [wait_name(prefix, key), waiters_name(prefix, key)]
    keys += [slot_lock_name(prefix, key, i) for i in range(limit)]
    reply = scripts.wake(client, keys, [reserve_ms])
    return Woken(key, reply[1], reply[2]) if reply[0] == "woken" else None


@dataclass(frozen=True)
class Claimed:
    """CLAIM's answer: ``kind`` is ``ok`` (claimed), ``own`` (this task's already) or ``held``."""

    kind: str
    task_id: str = ""
    task_name: str = ""
    digest: str = ""
    state: str = ""
    pttl_ms: int = 0
    #: A running holder's host, pid, milliseconds since its last renewal and its own lease TTL (its liveness).
    host: str = ""
    pid: int = 0
    ms_since_renewal: int = 0
    ttl_ms: int = 0


def claim(
    client: Any,
    claim_key: str | list[str],
    *,
    token: str,
    ttl_ms: int,
    task_id: str,
    task_name: str,
    digest: str,
    publish_ttl_ms: int = 0,
) -> Claimed:
    """Take a queue-time claim for a message: ``claim_key`` is the key, or the keys, of its mode (claims.claim_keys).

    ``publish_ttl_ms`` > 0 takes it in state ``publishing`` for that long; :func:`confirm_claim`
    makes it ``queued`` once the message is out.
    """
    keys = [claim_key] if isinstance(claim_key, str) else claim_key
    reply = scripts.claim(
        client,
        keys,
        [token, ttl_ms, meta(task_id), meta(task_name), meta(digest), meta(HOST), os.getpid(), publish_ttl_ms],
    )
    if reply[0] != "held":
        return Claimed(reply[0])
    if len(reply) < 10:  # a server still running the previous CLAIM: no liveness facts (presumed alive)
        return Claimed("held", reply[1], reply[2], reply[3], reply[4], int(reply[5]))
    pid = int(reply[7] or 0)
    return Claimed("held", reply[1], reply[2], reply[3], reply[4], int(reply[5]), reply[6], pid, int(reply[8]),
                   int(reply[9]))  # fmt: skip


def release_claim(client: Any, claim_key: str | list[str], task_id: str, token: str = "") -> bool:
    """Free ``task_id``'s queued claim (never a running lease).

    ``token``: only the claim carrying it (a publisher freeing the claim it
    took); ``""`` any claim of that task id (the worker's main process on a
    revoke, which never saw the token).
    """
    keys = [claim_key] if isinstance(claim_key, str) else claim_key
    return bool(scripts.release_claim(client, keys, [meta(task_id), token]))


def confirm_claim(
    client: Any,
    claim_key: str | list[str],
    token: str,
    ttl_ms: int,
    on_reply: Callable[[bool | BaseException], None] | None = None,
) -> bool:
    """The claim's message is published: ``publishing`` → ``queued`` for ``ttl_ms``.

    With ``on_reply``, where a channel serves the client, the command is *held* (``_wire.Channel.hold``): it
    goes out with the channel's next write (a burst of publishes pays one write each, not two) or within
    ``_wire.DRAIN_DELAY``, and its reply is read later (nothing waits on it: the message is out either way);
    ``on_reply`` gets it; returns True then. A publisher killed before the write leaves the claim
    ``publishing``, which lapses after the grace, as when it is killed before the publish.
    """
    keys = [claim_key] if isinstance(claim_key, str) else claim_key
    ch = _wire.channel(client) if on_reply is not None else None
    if ch is not None and on_reply is not None:
        report = on_reply

        def read(reply: Any) -> None:
            report(reply if isinstance(reply, BaseException) else bool(reply))

        ch.hold(scripts.confirm_claim, keys, [token, ttl_ms], read)
        return True
    confirmed = bool(scripts.confirm_claim(client, keys, [token, ttl_ms]))
    if on_reply is not None:
        on_reply(confirmed)
    return confirmed


def handover(
    client: Any, lease: Lease, new_token: str, ttl_ms: int, wake: Callable[[Woken], Any] | None = None
) -> bool:
    """Turn ``lease`` into a queued claim carrying ``new_token`` (until_done retries).

    A multi-entity lease keeps the claim on its anchor (the entity the claim lives on) and frees the
    others first (token-checked); ``wake`` publishes the copy of a waiter one of them was handed to.
    """
    if isinstance(lease, MultiLease):
        from . import _multi

        _multi.release_others(client, lease, wake)
    handed = bool(scripts.handover(client, [lease.redis_key], [lease.token, new_token, ttl_ms]))
    lease.released = True
    return handed


def watch_arm(client: Any, prefix: str, key: str, task_id: str, token: str, new_token: str, ttl_ms: int) -> bool:
    """Arm the single pending watch of ``task_id`` on ``key``; False if another watch is pending."""
    return bool(scripts.watch_arm(client, [watch_name(prefix, key)], [task_id, token, new_token, ttl_ms]))


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
