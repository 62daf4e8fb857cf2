"""Review 2: the Cluster per-entity loops (38f128b's ``_multi.Unfinished``) crossed with the loops it left out.

38f128b makes a multi-entity RELEASE or KEEP_BEFORE failing at one entity on Cluster go on with the others and
still wake their waiters. The in-order ACQUIRE's roll-back (``_InOrder.roll_back``, RELEASE_MULTI per entity)
is the same loop: an error at one entity there must not leave the entities after it held by a delivery that
is not running (they would block every other caller, and their waiters, for the whole lease TTL).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard import _multi as M
from celery_lockguard._keys import lock_name, wait_name

from .test_cluster import cluster, cprefix, entities_on_distinct_slots, rc  # noqa: F401 - fixtures

pytestmark = [pytest.mark.cluster]  # its own private Cluster (module fixture)


def test_an_in_order_roll_back_failing_at_one_entity_still_gives_back_the_others(rc: Any, cprefix: str) -> None:  # noqa: F811
    """a, b taken in order, c held by other work: the roll-back gives a and b back. a's give-back fails
    (its waiter queue is of another type, the vehicle test_cluster uses); b must still be given back."""
    a, b, c = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:3])
    other = L.acquire(
        rc, cprefix, c, ttl_ms=10_000, task_id="other", task_name="o", digest="o", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(other, L.Lease)
    rc.set(wait_name(cprefix, a), "planted", px=10_000)
    woken: list[Any] = []
    try:
        got = M.acquire(
            rc, cprefix, (a, b, c), ttl_ms=10_000, task_id="t", task_name="n", digest="d", worker="w",
            fence_ttl_ms=60_000, wake=woken.append, reserve_ms=int(handoff.RESERVATION_TTL * 1000),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - what the delivery meets; the entities are what this test is about
        got = exc
    held_b = rc.hgetall(lock_name(cprefix, b))
    assert held_b.get("task_id") != "t", (
        f"b is left held by the caller ({held_b}, pttl {rc.pttl(lock_name(cprefix, b))} ms) after {got!r}"
    )


def test_a_keep_before_timing_out_at_one_entity_leaves_two_tokens_and_the_woken_copy_spins(
    cluster: Any,  # noqa: F811
    rc: Any,  # noqa: F811
    cprefix: str,  # noqa: F811
    redis_url: str,
    r: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the real tracer on Cluster. A waiter of (a, b, c) parked on a is woken (a reserved under P0); its
    woken copy takes b, meets c held and keeps a and b for its park on c (KEEP_BEFORE, one call per entity):
    a's call re-tokens a to P1, b's call times out unsent, so b stays under P0 (its reservation TTL, 5 s). The
    copies carry both tokens (lockguard_attempt). c's holder ends at once and wakes the park: its woken copy
    must adopt a and b (or wait) in a few ACQUIREs, not alternate P1 and P0 in a hot loop until b lapses."""
    from celery_lockguard import LockedTask, _delivery
    from celery_lockguard import _headers as headers
    from celery_lockguard import _scripts as scripts
    from celery_lockguard._config import settings

    from .tracer import deliver, make_app, published, redeliver

    a, b, c = sorted(entities_on_distinct_slots(rc, cprefix, 1)[:3])
    app = make_app("review2c", redis_url, cprefix, lockguard_redis_url=cluster.url, lockguard_redis_cluster=True)
    ran: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="r2c.tri", lock_key=("{x}", "{y}", "{z}"))
    def tri(self: Any, x: str, y: str, z: str) -> int:
        ran.append(self.request.id)
        return 1

    def take(key: str, who: str, ttl_ms: int = 30_000) -> L.Lease:
        got = L.acquire(
            rc, cprefix, key, ttl_ms=ttl_ms, task_id=who, task_name="o", digest=who, worker="w", fence_ttl_ms=60_000
        )
        assert isinstance(got, L.Lease), got
        return got

    def wake(lease: L.Lease) -> None:
        _, _, woken = L.release_and_wake(rc, lease, cprefix, reserve_ms=int(handoff.RESERVATION_TTL * 1000))
        assert handoff.wake(app, settings(app), woken, "holder", "other")

    def mine(task_id: str) -> list[Any]:
        return [m for m in published(r, app) if m.task_id == task_id]

    first = take(a, "other-a")
    out = deliver(tri, (a, b, c))
    assert out.state == "RETRY" and mine(out.task_id)[-1].headers[headers.PARK_ENTITY] == a
    blocker = take(c, "other-c")
    wake(first)
    woken = mine(out.task_id)[-1]
    p0 = woken.headers[headers.PARK]
    assert woken.headers.get(headers.WOKEN) == 1 and rc.hget(lock_name(cprefix, a), "token") == p0
    real = scripts.keep_before

    def b_times_out(client: Any, names: list[str], args: list[Any]) -> Any:
        if args[0] == p0 and names[0] == lock_name(cprefix, b):  # the delivery's KEEP_BEFORE, b's call: unsent
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return real(client, names, args)

    monkeypatch.setattr(scripts, "keep_before", b_times_out)
    assert redeliver(tri, woken).state == "RETRY" and ran == []
    monkeypatch.setattr(scripts, "keep_before", real)
    parked = mine(out.task_id)[-1]
    p1 = parked.headers[headers.PARK]
    assert parked.headers[headers.PARK_ENTITY] == c and p0 in str(parked.headers.get(headers.ATTEMPT))
    assert rc.hget(lock_name(cprefix, a), "token") == p1 and rc.hget(lock_name(cprefix, b), "token") == p0
    wake(blocker)
    again = mine(out.task_id)[-1]
    assert again.headers.get(headers.WOKEN) == 1 and again.headers[headers.PARK] == p1
    calls: list[str] = []
    counted_real = _delivery._acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[7]))
        return counted_real(*args, **kwargs)

    monkeypatch.setattr(_delivery, "_acquire", counted)
    began = time.monotonic()
    state = redeliver(tri, again).state
    took = time.monotonic() - began
    assert len(calls) <= 6, f"{len(calls)} ACQUIREs in {took:.2f} s ({state}, ran {len(ran)})"
