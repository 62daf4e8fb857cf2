"""Every Lua script directly, on the test's own server: wrong token, expired, missing key, NOSCRIPT."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_lockguard import lease as L
from celery_lockguard import scripts
from celery_lockguard.keys import done_name, fence_name, lock_name
from celery_lockguard.testing import RedisServer

from .harness import wait_for

P = "lg"


def take(c: Any, key: str = "k", ttl_ms: int = 5000, **kw: Any) -> Any:
    args = {"task_id": "t1", "task_name": "n", "digest": "d", "worker": "w@h", "fence_ttl_ms": 60_000}
    args.update(kw)
    return L.acquire(c, P, key, ttl_ms=ttl_ms, **args)


@pytest.fixture
def c(own_redis: RedisServer) -> Any:
    return own_redis.client()


def test_every_script_declares_keys_argv_and_returns() -> None:
    for script in (
        scripts.ACQUIRE,
        scripts.RELEASE,
        scripts.RENEW,
        scripts.SHORTEN,
        scripts.FORCE_RELEASE,
        scripts.CLAIM,
        scripts.RELEASE_CLAIM,
        scripts.HANDOVER,
        scripts.WATCH_ARM,
    ):
        header = [line for line in script.strip().splitlines() if line.startswith("--")]
        text = "\n".join(header)
        assert "KEYS[" in text and "ARGV[" in text and "Returns" in text


def test_acquire_free_then_held(c: Any) -> None:
    lease = take(c)
    assert isinstance(lease, L.Lease) and lease.held
    assert c.hget(lock_name(P, "k"), "token") == lease.token
    assert 0 < c.pttl(lock_name(P, "k")) <= 5000
    holder = take(c, task_id="t2", digest="other")
    assert isinstance(holder, L.Holder)
    assert (holder.task_id, holder.task_name, holder.digest, holder.state) == ("t1", "n", "d", "running")
    assert holder.token == lease.token and 0 < holder.pttl_ms <= 5000 and holder.ms_since_renewal >= 0


def test_acquire_with_same_token_is_idempotent(c: Any) -> None:
    lease = take(c)
    again = take(c, token=lease.token)
    assert isinstance(again, L.Lease) and again.fence == lease.fence


def test_acquire_replace_token_takes_over_only_that_token(c: Any) -> None:
    first = take(c)
    assert isinstance(take(c, task_id="t2", replace_token="not-the-token"), L.Holder)
    second = take(c, task_id="t2", replace_token=first.token)
    assert isinstance(second, L.Lease) and second.fence > first.fence
    assert c.hget(lock_name(P, "k"), "task_id") == "t2"


def test_acquire_returns_completion_record_without_taking_the_lease(c: Any) -> None:
    c.set(done_name(P, "scope"), '{"task_id":"x","result":7}')
    got = take(c, scope="scope")
    assert isinstance(got, L.Done) and '"result":7' in got.record
    assert not c.exists(lock_name(P, "k"))


def test_fences_strictly_increase_and_are_floored_by_server_time(c: Any) -> None:
    fences = []
    for _ in range(5):
        lease = take(c)
        fences.append(lease.fence)
        L.release(c, lease, P)
    assert fences == sorted(fences) and len(set(fences)) == 5
    server_us = int(c.time()[0]) * 1_000_000
    assert fences[0] > server_us - 60_000_000


def test_fences_keep_increasing_across_a_restart_without_persistence() -> None:
    with RedisServer() as server:
        c = server.client()
        before = take(c).fence
        server.stop()
        server.start()
        c = server.client()
        assert not c.exists(fence_name(P, "k"))
        after = take(c).fence
        assert after > before


def test_release_wrong_token_leaves_the_holder_alone(c: Any) -> None:
    lease = take(c)
    impostor = L.Lease("k", P, "wrong", 1, 5000, time.monotonic(), "t9", "n")
    assert L.release(c, impostor, P) == (-1, 0)
    assert c.hget(lock_name(P, "k"), "token") == lease.token
    assert L.release(c, lease, P) == (1, 0)
    assert not c.exists(lock_name(P, "k"))


def test_release_of_expired_or_missing_lease_still_records_completion(c: Any) -> None:
    lease = take(c, ttl_ms=50)
    wait_for(lambda: not c.exists(lock_name(P, "k")), 5, what="lease to expire")
    assert L.release(c, lease, P, scope="s", record='{"result":1}', completion_ttl_ms=10_000) == (0, 1)
    assert c.get(done_name(P, "s")) == '{"result":1}'
    assert 0 < c.pttl(done_name(P, "s")) <= 10_000
    # first record wins
    again = L.Lease("k", P, "zzz", 1, 5000, time.monotonic(), "t", "n")
    assert L.release(c, again, P, scope="s", record='{"result":2}', completion_ttl_ms=10_000) == (0, 0)
    assert c.get(done_name(P, "s")) == '{"result":1}'


def test_renew_extends_only_matching_tokens(c: Any) -> None:
    a = take(c, "a", ttl_ms=1000)
    b = take(c, "b", ttl_ms=1000)
    c.hset(lock_name(P, "b"), "token", "stolen")
    missing = L.Lease("gone", P, "tok", 1, 1000, time.monotonic(), "t", "n")
    c.pexpire(lock_name(P, "a"), 100)
    assert L.renew(c, [a, b, missing]) == [1, 0, 0]
    assert c.pttl(lock_name(P, "a")) > 500
    assert not c.exists(lock_name(P, "gone"))


def test_renew_after_expiry_does_not_resurrect(c: Any) -> None:
    a = take(c, ttl_ms=50)
    wait_for(lambda: not c.exists(lock_name(P, "k")), 5, what="lease to expire")
    assert L.renew(c, [a]) == [0]
    assert not c.exists(lock_name(P, "k"))


def test_shorten_only_for_matching_task_and_host_and_never_lengthens(c: Any) -> None:
    take(c, ttl_ms=60_000)
    assert not L.shorten(c, P, "k", "other-task", 2000)
    assert not L.shorten(c, P, "k", "t1", 2000, host="elsewhere")
    assert c.pttl(lock_name(P, "k")) > 50_000
    assert L.shorten(c, P, "k", "t1", 2000)
    assert 0 < c.pttl(lock_name(P, "k")) <= 2000
    assert L.shorten(c, P, "k", "t1", 5000)
    assert c.pttl(lock_name(P, "k")) <= 2000
    assert not L.shorten(c, P, "missing", "t1", 2000)


def test_force_release_deletes_and_bumps_fence(c: Any) -> None:
    lease = take(c)
    deleted, fence, holder = L.force_release(c, P, "k", 60_000)
    assert deleted and holder == "t1" and fence > lease.fence
    assert not c.exists(lock_name(P, "k"))
    assert L.force_release(c, P, "k", 60_000)[0] is False
    assert take(c).fence > fence


@pytest.mark.parametrize("name", ["acquire", "release", "renew", "shorten", "force_release"])
def test_noscript_after_script_flush_reloads(c: Any, name: str) -> None:
    lease = take(c)
    c.script_flush()
    assert c.script_exists(scripts.acquire.sha) == [False]
    if name == "acquire":
        assert isinstance(take(c, token=lease.token), L.Lease)
    elif name == "release":
        assert L.release(c, lease, P) == (1, 0)
    elif name == "renew":
        assert L.renew(c, [lease]) == [1]
    elif name == "shorten":
        assert L.shorten(c, P, "k", "t1", 1000)
    else:
        assert L.force_release(c, P, "k", 1000)[0]
    assert c.script_exists(getattr(scripts, name).sha) == [True]


def test_watch_arm_keeps_one_pending_watch_per_task(c: Any) -> None:
    from celery_lockguard.keys import watch_name

    assert L.watch_arm(c, P, "k", "t1", "", "w1", 5000)  # first watch of t1
    assert not L.watch_arm(c, P, "k", "t1", "", "dup", 5000)  # another dropped copy: one is pending
    assert not L.watch_arm(c, P, "k", "t1", "stale", "w2", 5000)  # wrong token: a duplicate delivery
    assert L.watch_arm(c, P, "k", "t1", "w1", "w2", 5000)  # the current watch re-arms
    assert not L.watch_arm(c, P, "k", "t1", "w1", "w3", 5000)  # ...once
    assert c.hget(watch_name(P, "k"), "token") == "w2" and 0 < c.pttl(watch_name(P, "k")) <= 5000
    assert L.watch_arm(c, P, "k", "t2", "", "x1", 5000)  # another task's marker is stale: replaced
    c.delete(watch_name(P, "k"))
    assert L.watch_arm(c, P, "k", "t2", "x1", "x2", 5000)  # missing (expired): a late watch may re-arm
    c.script_flush()
    assert L.watch_arm(c, P, "k", "t2", "x2", "x3", 5000)  # NOSCRIPT reloads
