"""Several entities as one acquisition (``lock_key`` as a sequence): every lease or none.

A delivery that names several entities (a transfer between two accounts) must never hold a part
of its set while it waits for the rest: two such deliveries naming the same entities in opposite
orders would each hold one and wait for the other. So:

* **One Redis** (standalone, Sentinel): one script, ACQUIRE_MULTI, takes every lease atomically or
  none; a held entity makes it take nothing and name that entity (the blocker). RELEASE_MULTI frees
  every entity still carrying the token and wakes each freed entity's oldest waiter. One round trip
  each, whatever the number of entities.
* **Redis Cluster**, where the entities' hash tags fall in different slots: one script cannot touch
  them all. The entities are taken one by one in sorted order (one global order); when one is held,
  the ones already taken are released again (token-checked, waking their waiters) before the
  delivery decides, so no body ever runs on a part of its set. What it gives up: for the few
  milliseconds of that roll-back, another delivery may see an entity held by a delivery that will
  not run. One round trip per entity (plus the roll-back when blocked).

Every entity's lease hash is written as ACQUIRE writes it (readers of one entity see a usual
holder), plus ``siblings``: a JSON array of the other entity keys of the same acquisition, which
the operator views read to show the holder once per entity and name its siblings. One token for
the whole acquisition; one fence per entity (:attr:`~celery_lockguard._lease.MultiLease.fences`).

A multi-entity waiter parks on the entity that blocked it (that entity's waiter queue): its release
wakes it (a reservation on that entity), and if another entity then blocks it, it keeps the
reservations it holds on entities sorted *before* the blocker, gives back the ones on the blocker and
after (waking their next waiters) and parks on the blocker (:func:`keep_before`). The order is the
sorted one every acquisition uses, so a waiter only ever waits for an entity above all it keeps: no
cycle, and two woken waiters crossing each other's reservations cannot hand them to each other forever
(they did: a livelock under sustained contention). No entity wakes every waiter of the set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from . import _cluster as cluster
from . import _scripts as scripts
from . import _wire
from ._calls import CallNames
from ._headers import PARK_ENTITY
from ._keys import claim_name, done_name, fence_name, lock_name, meta, wait_name, waiters_name
from ._lease import HOST, Done, Holder, MultiLease, Woken, _acquire_and_wait, held_reply, new_token

#: Reply of :func:`release`: (released, recorded, woken) as ``_lease.release_and_wake``'s. ``released`` is
#: 1 when every entity was still ours, -1 when any was taken by another holder, else 0 (one expired).
Released = tuple[int, int, Woken | None]


T = TypeVar("T")


def parked_on(call: CallNames, entity: str) -> CallNames:
    """``call`` named after the entity a multi-entity delivery parks (or parked) on; ``call`` itself otherwise.

    The park, the settling of its copies and the give-back of a reservation read the waiter queue of
    ``call.key``: for several entities that is the one that blocked the acquisition, not the anchor.
    """
    if call.keys and entity and entity != call.key and entity in call.keys:
        return call._replace(key=entity)
    return call


def park_headers(call: CallNames) -> dict[str, str]:
    """The header naming the entity a multi-entity delivery parks on (``call`` as :func:`parked_on` gave it)."""
    return {PARK_ENTITY: call.key} if call.keys else {}


def blocked_fields(call: CallNames, holder: Holder | None) -> dict[str, Any]:
    """Event fields of a multi-entity contention: ``lock_key`` is the entity that blocked, ``lock_keys`` the set."""
    if not call.keys or holder is None or not holder.entity:
        return {}
    return {"lock_key": holder.entity, "lock_keys": list(call.keys)}


def contended_fields(call: CallNames, holder: Holder) -> dict[str, Any]:
    """:func:`blocked_fields` plus the blocking holder's task name (``lock.contended`` names entity, task and id)."""
    fields = blocked_fields(call, holder)
    return {**fields, "holder_task_name": holder.task_name} if fields else fields


def set_fields(call: CallNames) -> dict[str, Any]:
    """``lock_keys`` (every entity of the set) for a multi-entity call's events; nothing for one entity."""
    return {"lock_keys": list(call.keys)} if call.keys else {}


def siblings(keys: tuple[str, ...], i: int) -> str:
    """The ``siblings`` field of entity ``i``: a JSON array of the other entity keys (compact, in order)."""
    return json.dumps([k for j, k in enumerate(keys) if j != i], separators=(",", ":"))


def one_slot(client: Any, names: list[str]) -> bool:
    """Whether every key can go in one script: not Cluster, or all in the same hash slot."""
    return not cluster.is_cluster(client) or len({cluster.slot(n) for n in names}) == 1


def acquire(
    client: Any,
    prefix: str,
    keys: tuple[str, ...],
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
    wake: Callable[[Woken], Any] | None = None,
    reserve_ms: int = 0,
    replicas: int = 0,
    replicas_timeout_ms: int = 0,
    reserved: str = "",
) -> MultiLease | Holder | Done:
    """Take every entity of ``keys`` (sorted, distinct, two or more) or none; check ``scope``'s record first.

    Returns the :class:`MultiLease`, the :class:`Holder` of the first entity (in order) that is held
    (``Holder.entity`` names it), or :class:`Done` when the completion record exists.
    ``wake``/``reserve_ms``: on Cluster, a roll-back frees entities it took for a moment; a waiter that
    parked behind one meanwhile is handed it (``reserve_ms`` > 0) and ``wake`` publishes its copy.
    ``replicas`` > 0 sends ``WAIT`` in the same round trip as ACQUIRE_MULTI (``lock_replicas``, as
    ``_lease.acquire`` does); the in-order Cluster path does not wait (``MultiLease.replicas`` is ``None``).
    ``reserved``: the park token of a woken copy's reservations (``replace_token`` adopts them): on Cluster,
    when an entity blocks it, the entities it took before that one stay reserved under this token (the
    order's prefix, see :func:`keep_before`) instead of being given back.
    """
    token = token or new_token()
    base = [token, ttl_ms, meta(task_id), meta(task_name), meta(digest), meta(HOST), os.getpid(), meta(worker)]
    base += [state, fence_ttl_ms, replace_token, claim_token]
    done_key = done_name(prefix, scope) if scope is not None else None
    names = [lock_name(prefix, k) for k in keys] + [fence_name(prefix, k) for k in keys]
    names.append(claim_name(prefix, keys[0]))
    sent_at = time.monotonic()
    if one_slot(client, names + ([done_key] if done_key else [])):
        if done_key is not None:
            names.append(done_key)
        args = base + [len(keys)] + [siblings(keys, i) for i in range(len(keys))]
        acked: int | None = None
        if replicas > 0:
            reply, acked = _call_and_wait(client, names, args, keys, replicas, replicas_timeout_ms)
        else:
            reply = _call(client, names, args, keys)
        got = _answer(reply, keys, prefix, token, ttl_ms, sent_at, task_id, task_name)
        if isinstance(got, MultiLease):
            got.replicas = acked
        return got
    order = _InOrder(client, prefix, keys, token, wake, reserve_ms, reserved)
    return order.acquire(base, done_key, sent_at, ttl_ms, task_id, task_name)


def _call(client: Any, names: list[str], args: list[Any], keys: tuple[str, ...]) -> Any:
    try:
        return scripts.acquire_multi(client, names, args)
    except ResponseError as exc:
        n = len(keys)
        fences = names[n : 2 * n]
        text = str(exc)
        named = next((f for f in fences if f" {f} " in text), fences[0])
        corrupt = scripts.corrupt_fence(exc, named)
        if corrupt is not None:
            raise corrupt from exc
        raise


def _call_and_wait(
    client: Any, names: list[str], args: list[Any], keys: tuple[str, ...], replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    try:
        return _acquire_and_wait(client, names, args, replicas, timeout_ms, scripts.acquire_multi)
    except ResponseError as exc:
        corrupt = scripts.corrupt_fence(
            exc, next((f for f in names[len(keys) : 2 * len(keys)] if f" {f} " in str(exc)), None)
        )
        if corrupt is not None:
            raise corrupt from exc
        raise


def _answer(
    reply: Any,
    keys: tuple[str, ...],
    prefix: str,
    token: str,
    ttl_ms: int,
    sent_at: float,
    task_id: str,
    task_name: str,
) -> MultiLease | Holder | Done:
    kind = reply[0]
    if kind == "done":
        return Done(reply[1])
    if kind == "blocked":
        return blocker(reply[2], keys[int(reply[1]) - 1])
    fences = {k: int(f) for k, f in zip(keys, reply[1:], strict=True)}
    return MultiLease(keys, prefix, token, fences, ttl_ms, sent_at, task_id, task_name)


def blocker(held: Any, entity: str) -> Holder:
    """The :class:`Holder` of a ``'held'`` reply, naming the entity it holds."""
    return dataclasses.replace(held_reply(held), entity=entity)


class _InOrder:
    """Cluster, entities in different slots: take them one by one in sorted order; roll back if one is held."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        keys: tuple[str, ...],
        token: str,
        wake: Callable[[Woken], Any] | None,
        reserve_ms: int,
        reserved: str = "",
    ) -> None:
        self.client, self.prefix, self.keys, self.token = client, prefix, keys, token
        self.wake, self.reserve_ms = wake, reserve_ms if wake is not None else 0
        self.reserved = reserved

    def acquire(
        self, base: list[Any], done_key: str | None, sent_at: float, ttl_ms: int, task_id: str, task_name: str
    ) -> MultiLease | Holder | Done:
        """Every entity in order, or none (what was taken is given back before this returns).

        The completion record (its own slot) is read first, as a GET, and again once every entity is
        held: a finisher records before it releases, so whoever holds every entity next sees it.
        """
        client, prefix, keys = self.client, self.prefix, self.keys
        if done_key is not None:
            record = client.get(done_key)
            if record is not None:
                return Done(record)
        fences: dict[str, int] = {}
        for i, key in enumerate(keys):
            names = [lock_name(prefix, key), fence_name(prefix, key), claim_name(prefix, keys[0])]
            args = list(base)
            if i > 0:
                args[11] = ""  # the until_started claim lives beside the anchor (entity 0) only
                names[2] = names[0] + ":noclaim"  # a name in the lease's slot that never exists
            try:
                reply = _call(client, names, [*args, 1, siblings(keys, i)], (key,))
            except BaseException:
                self.roll_back(list(fences))
                raise
            if reply[0] == "blocked":
                if self.reserved:  # a woken copy: what it took before the blocker stays reserved for it
                    self.keep(list(fences))
                else:
                    self.roll_back(list(fences))
                return blocker(reply[2], key)
            fences[key] = int(reply[1])
        lease = MultiLease(keys, prefix, self.token, fences, ttl_ms, sent_at, task_id, task_name)
        if done_key is not None:
            record = client.get(done_key)
            if record is not None:
                self.roll_back(list(keys))
                lease.released = True
                return Done(record)
        return lease

    def keep(self, taken: list[str]) -> None:
        """Turn the entities taken (all sorted before the blocker) into reservations under ``reserved``.

        For :data:`~celery_lockguard._handoff.RESERVATION_TTL`; the delivery's :func:`keep_before` then
        extends them to its wait. Token-checked (KEEP_BEFORE, one entity per call: several slots).
        """
        ttl = max(self.reserve_ms, 1000)
        args = [self.token, self.reserved, ttl, self.reserve_ms, 1, 1]
        _raise(_for_each(taken, lambda key: scripts.keep_before(self.client, _names(self.prefix, key), args)))

    def roll_back(self, taken: list[str]) -> None:
        """Give back the entities taken (token-checked), handing each to a waiter that parked behind it meanwhile.

        One entity's error does not stop the others (each is in its own slot); the first is raised after them.
        """

        def give_back(key: str) -> None:
            reply = scripts.release_multi(
                self.client, _names(self.prefix, key), [self.token, "", 0, self.reserve_ms, 1]
            )
            woken = _woken((key,), reply[2])
            if woken is not None and self.wake is not None:
                self.wake(woken)

        _raise(_for_each(taken, give_back))


def _names(prefix: str, key: str) -> list[str]:
    """The three keys a per-entity RELEASE_MULTI or KEEP_BEFORE touches: lease hash, wait queue, waiter entries."""
    return [lock_name(prefix, key), wait_name(prefix, key), waiters_name(prefix, key)]


def _for_each(items: Iterable[T], call: Callable[[T], Any]) -> Exception | None:
    """``call(item)`` for every item, whatever one of them raises; the first error, or ``None``."""
    error: Exception | None = None
    for item in items:
        try:
            call(item)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller once every entity had its turn
            error = error or exc
    return error


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _release_args(
    client: Any,
    lease: MultiLease,
    prefix: str,
    scope: str | None,
    record: str,
    completion_ttl_ms: int,
    reserve_ms: int,
) -> tuple[list[str], list[Any], int]:
    """RELEASE_MULTI's keys and args for the whole set (one slot), and the record written apart (-1: none)."""
    names: list[str] = []
    for key in lease.keys:
        names += [lock_name(prefix, key), wait_name(prefix, key), waiters_name(prefix, key)]
    recorded = -1
    if scope is not None:
        done_key = done_name(prefix, scope)
        if one_slot(client, [*names, done_key]):
            names.append(done_key)
        else:
            recorded = 1 if client.set(done_key, record, nx=True, px=completion_ttl_ms) else 0
    return names, [lease.token, record, completion_ttl_ms, reserve_ms, len(lease.keys)], recorded


def _released(keys: tuple[str, ...], reply: Any, recorded: int) -> Released:
    codes = [int(x) for x in reply[1]]
    released = -1 if -1 in codes else (1 if all(c == 1 for c in codes) else 0)
    return released, int(reply[0]) if recorded < 0 else recorded, _woken(keys, reply[2])


def _chained(flat: Any, keys: tuple[str, ...]) -> list[Woken]:
    """A script's flat woken triples (entity index, park token, message), one :class:`Woken` each."""
    return [Woken(keys[int(flat[j]) - 1], flat[j + 1], flat[j + 2]) for j in range(0, len(flat), 3)]


def _chain(found: list[Woken]) -> Woken | None:
    """Waiters woken as one :class:`Woken` (the rest in ``also``: ``_handoff.wake`` publishes each), or ``None``."""
    return Woken(found[0].key, found[0].park_token, found[0].message, tuple(found[1:])) if found else None


def _woken(keys: tuple[str, ...], flat: Any) -> Woken | None:
    """RELEASE_MULTI's woken triples as one :class:`Woken` (the rest in ``also``), or ``None``."""
    return _chain(_chained(flat, keys))


class Unfinished(Exception):
    """A per-entity loop (Cluster) failed at an entity after handing others to their waiters.

    The loop went on past the error (each entity lives in its own slot and is freed on its own), so
    ``woken`` holds every waiter an entity was handed to: the caller publishes them as it would a
    reply's (:func:`split`), then handles ``error`` as the failure it is. Without this the error lost
    them, and each waited for its safety copy (about the holder's TTL).
    """

    def __init__(self, error: BaseException, woken: Woken) -> None:
        super().__init__(str(error))
        self.error, self.woken = error, woken


def split(exc: BaseException) -> tuple[BaseException, Woken | None]:
    """The error to handle and the waiters to wake anyway (``None`` unless ``exc`` is :class:`Unfinished`)."""
    return (exc.error, exc.woken) if isinstance(exc, Unfinished) else (exc, None)


def _each_entity(keys: tuple[str, ...], call: Callable[[int], Any], reply_at: int) -> tuple[list[int], Woken | None]:
    """``call(i)`` for every entity (Cluster, one script per slot): their codes and the waiters woken.

    ``reply_at``: where the reply holds the entity's code list (its woken triples follow it). An error at
    one entity does not stop the others; it is raised at the end, as :class:`Unfinished` when some waiter
    was woken meanwhile (those must still be published), else as it is.
    """
    codes = [0] * len(keys)  # a failed entity's stays 0
    found: list[Woken] = []

    def one(i: int) -> None:
        reply = call(i)
        codes[i] = int(reply[reply_at][0])
        found.extend(_chained(reply[reply_at + 1], (keys[i],)))

    error = _for_each(range(len(keys)), one)
    woken = _chain(found)
    if error is not None:
        raise Unfinished(error, woken) if woken is not None else error
    return codes, woken


def release(
    client: Any,
    lease: MultiLease,
    prefix: str,
    scope: str | None = None,
    record: str = "",
    completion_ttl_ms: int = 0,
    reserve_ms: int = 0,
) -> Released:
    """Free every entity still carrying the lease's token, record completion first, wake each freed entity's waiter.

    One round trip where the set shares a slot; on Cluster one per entity (the record written first).
    """
    names, args, recorded = _release_args(client, lease, prefix, scope, record, completion_ttl_ms, reserve_ms)
    lease.released = True
    if one_slot(client, names):
        return _released(lease.keys, scripts.release_multi(client, names, args), recorded)
    # Cluster, several slots: the record was written first, apart; then one RELEASE_MULTI per entity.
    codes, first = _each_entity(
        lease.keys, lambda i: scripts.release_multi(client, names[3 * i : 3 * i + 3], [*args[:4], 1]), reply_at=1
    )
    released = -1 if -1 in codes else (1 if all(c == 1 for c in codes) else 0)
    return released, max(recorded, 0), first


def release_others(client: Any, lease: MultiLease, wake: Callable[[Woken], Any] | None) -> None:
    """Free every entity but the anchor (an ``until_done`` retry keeps its claim there), waking their waiters."""
    from . import _handoff as handoff  # imports _lease, which imports this module lazily
    from ._errors import describe
    from ._events import emit

    reserve_ms = handoff.reserve_ms() if wake is not None else 0

    def free(key: str) -> None:
        names = _names(lease.prefix, key)
        woken = _woken((key,), scripts.release_multi(client, names, [lease.token, "", 0, reserve_ms, 1])[2])
        if woken is not None and wake is not None:
            wake(woken)

    # One entity's error stops neither the others nor the anchor's hand-over: that entity lapses by its TTL.
    error = _for_each(lease.keys[1:], free)
    if error is not None:
        fields = {"lock_key": lease.key, "lock_keys": list(lease.keys), "task_id": lease.task_id}
        emit("lock.backend_unavailable", lease.task_name, **fields, reason=f"release others: {describe(error)}")


def keep_before(
    client: Any,
    prefix: str,
    keys: tuple[str, ...],
    token: str,
    new_token: str,
    blocker: str,
    keep_ms: int,
    reserve_ms: int,
) -> tuple[list[str], Woken | None]:
    """A woken waiter blocked on ``blocker``: keep its reservations (``token``) on the entities sorted before it.

    They are re-tokened to ``new_token`` (the park token of the wait to come, so that its copies' ACQUIRE_MULTI
    adopts them with the reservation the wake makes) for ``keep_ms``; the reservations on ``blocker`` and
    after are given back, waking their entities' waiters (KEEP_BEFORE). ``blocker`` ``""`` gives back all.
    Returns the entities kept and the waiters woken (publish them: :func:`_handoff.wake`).
    """
    k = keys.index(blocker) if blocker in keys else 0
    names: list[str] = []
    for key in keys:
        names += [lock_name(prefix, key), wait_name(prefix, key), waiters_name(prefix, key)]
    if one_slot(client, names):
        reply = scripts.keep_before(client, names, [token, new_token, keep_ms, reserve_ms, len(keys), k])
        codes, woken = [int(c) for c in reply[0]], _woken(keys, reply[1])
    else:  # Cluster, several slots: one entity per call (each keeps or gives back on its own)
        codes, woken = _each_entity(
            keys,
            lambda i: scripts.keep_before(
                client, names[3 * i : 3 * i + 3], [token, new_token, keep_ms, reserve_ms, 1, 1 if i < k else 0]
            ),
            reply_at=0,
        )
    return [key for key, code in zip(keys, codes, strict=True) if code == 2], woken


def release_later(
    client: Any,
    lease: MultiLease,
    prefix: str,
    on_reply: Callable[[Released | BaseException], None],
    scope: str | None = None,
    record: str = "",
    completion_ttl_ms: int = 0,
    reserve_ms: int = 0,
) -> bool:
    """:func:`release` sent now, its reply read later (``_lease.release_later``); False where it cannot be."""
    ch = _wire.channel(client)
    if ch is None or not ch.defers_release:
        return False
    names, args, recorded = _release_args(client, lease, prefix, scope, record, completion_ttl_ms, reserve_ms)
    keys = lease.keys

    def read(reply: Any) -> None:
        on_reply(reply if isinstance(reply, BaseException) else _released(keys, reply, recorded))

    ch.defer(scripts.release_multi, names, args, read)
    lease.released = True
    return True
