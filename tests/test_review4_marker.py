"""Review R4: the slot marker a WAKE writes (``{K}:fence:<i>``, c4f3721) crossed with the other rules that read
markers: the single lease's scan (``held_slot``), fences, Cluster hash tags, describe. Script level, real Redis."""

from __future__ import annotations

import redis

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._keys import slot_lock_name
from celery_lockguard.testing import wait_for


def _woken_into_slot_1(r: redis.Redis, prefix: str, key: str, limit: int, reserve_ms: int) -> L.Lease:
    """Slot 0 held by a lock_limit body, and a shared waiter woken by WAKE into slot 1, never taken before."""
    first = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="del", task_name="delete", digest="d",
                      worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(first, L.Lease)
    parked = handoff.park(r, prefix, key, "pw", "{}", task_id="w", task_name="export", digest="dw",
                          countdown=10, limit=limit)  # fmt: skip
    assert parked.kind == "parked"
    L.release(r, first, prefix)  # no wake (a lease cut short)
    slot0 = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="s0", task_name="export", digest="d0",
                      worker="w1", fence_ttl_ms=60_000, limit=limit)  # fmt: skip
    assert isinstance(slot0, L.Lease) and slot0.slot == 0
    woken = L.wake_if_free(r, prefix, key, reserve_ms, limit=limit)
    assert woken is not None and r.hget(slot_lock_name(prefix, key, 1), "state") == "handed"
    return slot0


def _slot_2_held_above_a_lapsed_reservation(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    """Slot 1 woken into a reservation that lapses (with its marker, both PX 400) while slot 2 is taken above
    it; slot 0 then released: only slot 2 is held, past the first absent marker, fence:1."""
    slot0 = _woken_into_slot_1(r, prefix, key, limit=3, reserve_ms=400)
    slot2 = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="s2", task_name="export", digest="d2",
                      worker="w2", fence_ttl_ms=60_000, limit=3)  # fmt: skip
    assert isinstance(slot2, L.Lease) and slot2.slot == 2
    wait_for(lambda: not r.exists(slot_lock_name(prefix, key, 1)), 5, "the reservation on slot 1 lapses")
    L.release(r, slot0, prefix)
    return slot2


def test_a_lapsed_woken_reservation_leaves_the_slot_above_it_visible_to_the_single_lease(
    redis_url: str, prefix: str
) -> None:
    """The woken copy never comes (its worker died): its reservation on slot 1 and the marker lapse together
    (both PX reserve_ms). Slot 2 was taken meanwhile (slots 0 and 1 held) and is still held. The single lease
    must not be taken beside slot 2 -- but the scan stops at the first absent marker, fence:1."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "t:3"
    slot2 = _slot_2_held_above_a_lapsed_reservation(r, prefix, key)
    assert r.exists(slot_lock_name(prefix, key, 2)), "slot 2 is still held"
    single = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="del2", task_name="delete", digest="d3",
                       worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    if isinstance(single, L.Lease):
        L.release(r, single, prefix)
    L.release(r, slot2, prefix)
    assert isinstance(single, L.Holder), f"the single lease was taken beside slot 2: {single!r}"


def test_a_marker_recreated_as_zero_still_draws_a_fence_past_every_fence_of_the_slot(
    redis_url: str, prefix: str
) -> None:
    """Slot 1 taken and released (fence F), its marker expired (fence_ttl), then a WAKE recreates it as '0':
    the adopting copy's fence must be above F (the clock floor)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "t:4"
    a = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="a", task_name="export", digest="da",
                  worker="w1", fence_ttl_ms=60_000, limit=2)  # fmt: skip
    b = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="b", task_name="export", digest="db",
                  worker="w1", fence_ttl_ms=300, limit=2)  # fmt: skip
    assert isinstance(a, L.Lease) and isinstance(b, L.Lease) and b.slot == 1
    old = int(b.fence)
    L.release(r, b, prefix)
    L.release(r, a, prefix)
    fence1 = f"{prefix}:v1:{{{key}}}:fence:1"
    wait_for(lambda: not r.exists(fence1), 5, "slot 1's marker expires")
    _woken_into_slot_1(r, prefix, key, limit=2, reserve_ms=5000)
    assert r.get(fence1) == "0"
    token = r.hget(slot_lock_name(prefix, key, 1), "token")
    c = L.acquire(r, prefix, key, ttl_ms=30_000, task_id="w", task_name="export", digest="dw",
                  worker="w1", fence_ttl_ms=60_000, limit=2, replace_token=token)  # fmt: skip
    assert isinstance(c, L.Lease) and c.slot == 1
    assert int(c.fence) > old
    assert r.pttl(fence1) > 10_000, "the adopting ACQUIRE gives the marker the fence TTL"


def test_the_wake_marker_keeps_the_cluster_hash_tag(redis_url: str, prefix: str) -> None:
    """The marker is named from K's lease name, {K} tag kept (same Cluster slot as the lease it marks)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "t:5"
    _woken_into_slot_1(r, prefix, key, limit=2, reserve_ms=5000)
    markers = [k for k in r.scan_iter(f"{prefix}:*fence*")]
    assert f"{prefix}:v1:{{{key}}}:fence:1" in markers, markers
    assert all("{" + key + "}" in m for m in markers), markers


def test_describe_reads_no_row_for_a_wake_marker_whose_reservation_is_gone(redis_url: str, prefix: str) -> None:
    """The woken copy gave its reservation back (DEL): the '0' marker stays up to reserve_ms with no holder.
    ``describe KEY`` (read_entity, walking markers) must show slot 0's holder only, not a phantom slot 1."""
    from celery_lockguard._holders import read_entity

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "t:6"
    slot0 = _woken_into_slot_1(r, prefix, key, limit=2, reserve_ms=5000)
    r.delete(slot_lock_name(prefix, key, 1))
    assert r.exists(f"{prefix}:v1:{{{key}}}:fence:1")
    rows = read_entity(r, prefix, key, slots=1)
    assert [row.redis_key for row in rows] == [slot_lock_name(prefix, key, 0)], rows
    L.release(r, slot0, prefix)
    assert read_entity(r, prefix, key, slots=1) == []


def test_describe_finds_a_slot_held_above_a_lapsed_wake_marker(redis_url: str, prefix: str) -> None:
    """As the lapse above, read by ``describe KEY`` from an app whose largest lock_limit is 1 (the operator's
    CLI): slot 2 is held, so the entity is not free."""
    from celery_lockguard._holders import read_entity

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    key = "t:7"
    slot2 = _slot_2_held_above_a_lapsed_reservation(r, prefix, key)
    rows = read_entity(r, prefix, key, slots=1)
    L.release(r, slot2, prefix)
    assert [row.redis_key for row in rows] == [slot_lock_name(prefix, key, 2)], rows


def test_the_wake_writing_a_marker_runs_as_the_worker_acl_user() -> None:
    """ACL x marker: the WAKE (SET, EXISTS on ``{K}:fence:<i>``) as a user granted only the workers' list:
    no denial, the marker written."""
    from celery_lockguard import acl
    from celery_lockguard.testing import RedisServer

    with RedisServer() as server:
        admin = server.client()
        try:
            admin.execute_command("ACL", "SETUSER", "lg", *acl.rule("acl4", cli=False).split(), ">s3cret")
        except redis.exceptions.ResponseError:
            admin.execute_command(
                "ACL", "SETUSER", "lg", *acl.rule("acl4", cli=False, setinfo=False).split(), ">s3cret"
            )
        assert {"set", "exists"} <= set(acl.IN_SCRIPTS)
        user = redis.Redis(host="127.0.0.1", port=server.port, username="lg", password="s3cret",
                           decode_responses=True)  # fmt: skip
        _woken_into_slot_1(user, "acl4", "t:8", limit=2, reserve_ms=5000)
        assert admin.get("acl4:v1:{t:8}:fence:1") == "0"
        assert [e for e in admin.acl_log() if e.get("username") == "lg"] == []
