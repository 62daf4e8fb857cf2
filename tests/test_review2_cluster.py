"""Review 2: the Cluster per-entity loops (38f128b's ``_multi.Unfinished``) crossed with the loops it left out.

38f128b makes a multi-entity RELEASE or KEEP_BEFORE failing at one entity on Cluster go on with the others and
still wake their waiters. The in-order ACQUIRE's roll-back (``_InOrder.roll_back``, RELEASE_MULTI per entity)
is the same loop: an error at one entity there must not leave the entities after it held by a delivery that
is not running (they would block every other caller, and their waiters, for the whole lease TTL).
"""

from __future__ import annotations

from typing import Any

import pytest

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
