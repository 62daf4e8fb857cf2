"""Several entities as one acquisition (``lock_key`` as a sequence): all or nothing, one fence per entity."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from structlog.testing import capture_logs

from celery_lockguard import ConfigurationError, LockContended, LockedTask, StaleFence, advance_fence
from celery_lockguard import _lease as L
from celery_lockguard import _multi as multi
from celery_lockguard import _scripts as scripts
from celery_lockguard._keys import claim_name, done_name, fence_name, lock_name, wait_name, waiters_name
from celery_lockguard.fencing import create_fence_table
from celery_lockguard.testing import RedisServer

from .harness import wait_for

ACC = ("acc:{src}", "acc:{dst}")


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("multitest", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_socket_timeout = 0.5
    yield a


def hold(r: redis.Redis, prefix: str, key: str, task_id: str = "other", ttl_ms: int = 10_000) -> L.Lease:
    got = L.acquire(
        r, prefix, key, ttl_ms=ttl_ms, task_id=task_id, task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    return got


def take(c: Any, prefix: str, keys: tuple[str, ...], **kw: Any) -> Any:
    args: dict[str, Any] = {"ttl_ms": 5000, "task_id": "t1", "task_name": "n", "digest": "d", "worker": "w"}
    args["fence_ttl_ms"] = 60_000
    args.update(kw)
    return multi.acquire(c, prefix, keys, **args)


# -- options and rendering ----------------------------------------------------------------------------


def test_a_sequence_renders_sorted_distinct_keys(app: Celery) -> None:
    @app.task(base=LockedTask, shared=False, name="bank.transfer", lock_key=("account:{dst}", "account:{src}"))
    def transfer(src: int, dst: int, amount: int) -> None: ...

    assert transfer.lock_key_for(7, 3, 10) == ("account:3", "account:7")
    assert transfer.lock_key_for(3, 7, 10) == ("account:3", "account:7")  # one global order
    assert transfer.lock_key_for(5, 5, 10) == "account:5"  # the same entity twice is one entity


def test_lockguard_keys_and_a_callable_may_name_several(app: Celery) -> None:
    app.conf.lockguard_keys = {"bank.a": ["account:{src}", "account:{dst}"]}

    @app.task(base=LockedTask, shared=False, name="bank.a")
    def a(src: int, dst: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="bank.b", lock_key=lambda src, dst: [f"acc:{dst}", f"acc:{src}"])
    def b(src: int, dst: int) -> None: ...

    assert a.lock_key_for(2, 1) == ("account:1", "account:2")
    assert b.lock_key_for(2, 1) == ("acc:1", "acc:2")
    assert b.lock_key_for(2, 2) == "acc:2"


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ((), "lock_key=()"),
        (["account:{src}", 7], "member 7"),
        (("account:{src}", ""), "member ''"),
        (("account:{src}", "account:{nope}"), "unknown field {nope}"),
    ],
)
def test_bad_sequences_name_task_option_and_value(app: Celery, value: Any, needle: str) -> None:
    @app.task(base=LockedTask, shared=False, name="bank.bad", lock_key=value)
    def bad(src: int, dst: int) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        bad.apply(args=(1, 2), throw=True)
    text = str(err.value)
    assert "bank.bad" in text and "lock_key" in text and needle in text


@pytest.mark.parametrize(("option", "value"), [("lock_limit", 2), ("lock_rate", "5/m"), ("lock_debounce", 1.0)])
def test_limits_rates_and_debounce_are_refused_with_several_entities(app: Celery, option: str, value: Any) -> None:
    @app.task(base=LockedTask, shared=False, name="bank.lim", lock_key=("a:{src}", "a:{dst}"), **{option: value})
    def lim(src: int, dst: int) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        lim.apply(args=(1, 2), throw=True)
    text = str(err.value)
    assert "bank.lim" in text and f"{option}={value!r}" in text and "several entities" in text


def test_a_callable_naming_several_entities_with_a_limit_is_refused_per_call(app: Celery) -> None:
    @app.task(base=LockedTask, shared=False, name="bank.cl", lock_key=lambda a, b: (f"x:{a}", f"x:{b}"), lock_limit=2)
    def cl(a: int, b: int) -> int:
        return a

    assert cl.apply(args=(1, 1), throw=True).get() == 1  # one entity: a lock_limit task as any
    with pytest.raises(ConfigurationError, match="lock_limit=2"):
        cl.apply(args=(1, 2), throw=True)


# -- a task on several entities -------------------------------------------------------------------------


def test_every_entity_is_held_with_its_own_fence_and_siblings(app: Celery, r: redis.Redis, prefix: str) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="bank.t1", lock_key=("acc:{src}", "acc:{dst}"))
    def t(self: Any, src: int, dst: int) -> None:
        seen["fences"] = self.lock.fences
        seen["hashes"] = {k: r.hgetall(lock_name(prefix, k)) for k in ("acc:1", "acc:2")}
        with pytest.raises(AttributeError, match="fences"):
            _ = self.lock.fence

    t.apply(args=(2, 1), throw=True)
    fences, hashes = seen["fences"], seen["hashes"]
    assert set(fences) == {"acc:1", "acc:2"}
    one, two = hashes["acc:1"], hashes["acc:2"]
    assert one["token"] == two["token"] and one["task_name"] == "bank.t1" and one["state"] == "running"
    assert json.loads(one["siblings"]) == ["acc:2"] and json.loads(two["siblings"]) == ["acc:1"]
    assert int(one["fence"]) == fences["acc:1"] and int(two["fence"]) == fences["acc:2"]
    assert not r.exists(lock_name(prefix, "acc:1")) and not r.exists(lock_name(prefix, "acc:2"))
    # fences increase per entity, across acquisitions
    t.apply(args=(1, 2), throw=True)
    assert all(seen["fences"][k] > fences[k] for k in fences)


def test_the_same_entity_twice_is_one_lease(app: Celery, r: redis.Redis, prefix: str) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="bank.t2", lock_key=("acc:{src}", "acc:{dst}"))
    def t(self: Any, src: int, dst: int) -> None:
        seen["fences"] = self.lock.fences
        seen["fence"] = self.lock.fence
        seen["siblings"] = r.hget(lock_name(prefix, "acc:5"), "siblings")

    t.apply(args=(5, 5), throw=True)
    assert seen["fences"] == {"acc:5": seen["fence"]} and seen["siblings"] is None


def test_a_held_entity_means_none_is_taken_and_the_error_names_it(app: Celery, r: redis.Redis, prefix: str) -> None:
    ran = []

    @app.task(base=LockedTask, shared=False, name="bank.t3", lock_key=("acc:{src}", "acc:{dst}"), on_locked="raise")
    def t(src: int, dst: int) -> None:
        ran.append(1)

    blocker = hold(r, prefix, "acc:2", task_id="blocker-id")
    with capture_logs() as logs, pytest.raises(LockContended) as err:
        t.apply(args=(1, 2), throw=True)
    assert err.value.key == "acc:2" and err.value.holder_task_id == "blocker-id"
    assert ran == [] and not r.exists(lock_name(prefix, "acc:1"))  # acc:1 free: nothing was taken
    contended = [e for e in logs if e["event"] == "lock.contended"]
    assert contended and contended[0]["lock_key"] == "acc:2" and contended[0]["holder_task_id"] == "blocker-id"
    assert contended[0]["lock_keys"] == ["acc:1", "acc:2"] and contended[0]["holder_task_name"] == "x"
    L.release(r, blocker, prefix)
    t.apply(args=(1, 2), throw=True)
    assert ran == [1]


def test_losing_one_entity_signals_the_body(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(
        base=LockedTask, bind=True, shared=False, name="bank.t4", lock_key=("acc:{src}", "acc:{dst}"), lock_ttl=0.6
    )
    def t(self: Any, src: int, dst: int) -> bool:
        r.delete(lock_name(prefix, "acc:2"))  # one entity taken from under us (an operator, an eviction)
        wait_for(lambda: self.lock.lost, 5, what="the renewer to report the loss")
        assert self.lock.held is False
        return bool(r.exists(lock_name(prefix, "acc:1")))

    with capture_logs() as logs:
        assert t.apply(args=(1, 2), throw=True).get() is True  # the other entity was still renewed
    lost = [e for e in logs if e["event"] == "lock.lost"]
    assert lost and lost[0]["reason"] == "token_gone"
    assert not r.exists(lock_name(prefix, "acc:1"))  # released anyway, token-checked


def test_renewal_renews_every_entity(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(
        base=LockedTask, bind=True, shared=False, name="bank.t5", lock_key=("acc:{src}", "acc:{dst}"), lock_ttl=0.3
    )
    def t(self: Any, src: int, dst: int) -> list[int]:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert self.lock.held
            time.sleep(0.02)
        return [r.pttl(lock_name(prefix, k)) for k in ("acc:1", "acc:2")]

    assert all(0 < p <= 300 for p in t.apply(args=(1, 2), throw=True).get())


def test_advance_fence_per_entity_and_for_all(app: Celery, prefix: str) -> None:
    conn = sqlite3.connect(":memory:")
    create_fence_table(conn)
    leases: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="bank.t6", lock_key=("acc:{src}", "acc:{dst}"))
    def t(self: Any, src: int, dst: int) -> None:
        leases.append(self.lock)
        advance_fence(conn, self.lock)  # every entity
        assert advance_fence(conn, self.lock, entity="acc:1") == self.lock.fences["acc:1"]
        with pytest.raises(ValueError, match="acc:9"):
            advance_fence(conn, self.lock, entity="acc:9")

    t.apply(args=(1, 2), throw=True)
    t.apply(args=(2, 1), throw=True)
    rows = dict(conn.execute("SELECT lock_key, fence FROM lockguard_fences").fetchall())
    assert rows == leases[1].fences
    with pytest.raises(StaleFence) as err:
        advance_fence(conn, leases[0], entity="acc:2")  # the first holder, paused, writes late
    assert err.value.key == "acc:2"
    with pytest.raises(StaleFence):
        advance_fence(conn, leases[0])


# -- the scripts, directly ------------------------------------------------------------------------------


def test_acquire_multi_takes_all_or_nothing(r: redis.Redis, prefix: str) -> None:
    blocker = hold(r, prefix, "b")
    got = take(r, prefix, ("a", "b", "c"))
    assert isinstance(got, L.Holder) and got.entity == "b" and got.task_id == "other"
    assert not r.exists(lock_name(prefix, "a")) and not r.exists(lock_name(prefix, "c"))
    assert not r.exists(fence_name(prefix, "a"))  # no fence issued either
    L.release(r, blocker, prefix)
    lease = take(r, prefix, ("a", "b", "c"))
    assert isinstance(lease, L.MultiLease) and lease.keys == ("a", "b", "c")
    assert lease.fences["b"] > blocker.fence
    assert multi.release(r, lease, prefix)[0] == 1
    assert not any(r.exists(lock_name(prefix, k)) for k in "abc")


def test_acquire_multi_answers_from_the_record_and_frees_the_anchor_claim(r: redis.Redis, prefix: str) -> None:
    r.set(done_name(prefix, "s1"), "rec")
    assert take(r, prefix, ("a", "b"), scope="s1") == L.Done("rec")
    assert not r.exists(lock_name(prefix, "a"))
    r.hset(claim_name(prefix, "a"), mapping={"token": "ct", "task_id": "t1", "state": "queued"})
    lease = take(r, prefix, ("a", "b"), claim_token="ct")
    assert isinstance(lease, L.MultiLease) and not r.exists(claim_name(prefix, "a"))


def test_acquire_multi_adopts_an_entity_carrying_the_replace_token(r: redis.Redis, prefix: str) -> None:
    r.hset(lock_name(prefix, "b"), mapping={"token": "park-1", "task_id": "t1", "state": "handed"})
    r.pexpire(lock_name(prefix, "b"), 5000)
    assert isinstance(take(r, prefix, ("a", "b")), L.Holder)  # someone else's reservation
    lease = take(r, prefix, ("a", "b"), replace_token="park-1")
    assert isinstance(lease, L.MultiLease)
    assert (
        r.hget(lock_name(prefix, "b"), "token") == lease.token and r.hget(lock_name(prefix, "b"), "state") == "running"
    )


def test_release_multi_wrong_token_expired_and_missing(r: redis.Redis, prefix: str) -> None:
    lease = take(r, prefix, ("a", "b"))
    assert isinstance(lease, L.MultiLease)
    r.delete(lock_name(prefix, "a"))  # expired
    r.hset(lock_name(prefix, "b"), "token", "someone-else")  # taken by another holder
    released, recorded, woken = multi.release(r, lease, prefix)
    assert (released, recorded, woken) == (-1, 0, None)
    assert r.hget(lock_name(prefix, "b"), "token") == "someone-else"  # left alone
    names = [lock_name(prefix, "zz"), wait_name(prefix, "zz"), waiters_name(prefix, "zz")]
    assert scripts.release_multi(r, names, ["nobody", "", 0, 0, 1]) == [0, [0], []]  # missing key


def test_release_multi_wakes_each_freed_entitys_oldest_waiter(r: redis.Redis, prefix: str) -> None:
    from celery_lockguard import _handoff as handoff

    lease = take(r, prefix, ("a", "b"))
    assert isinstance(lease, L.MultiLease)
    for key, p in (("a", "pa"), ("b", "pb")):
        got = handoff.park(r, prefix, key, p, "{}", task_id=f"w-{key}", task_name="n", digest="d", countdown=5)
        assert got.kind == "parked"
    released, _, woken = multi.release(r, lease, prefix, reserve_ms=2000)
    assert released == 1 and woken is not None
    assert {(w.key, w.park_token) for w in (woken, *woken.also)} == {("a", "pa"), ("b", "pb")}
    assert r.hget(lock_name(prefix, "a"), "token") == "pa" and r.hget(lock_name(prefix, "b"), "state") == "handed"


def reserve(r: redis.Redis, prefix: str, key: str, token: str, ttl_ms: int = 5000) -> None:
    """A hand-off reservation of ``key`` for park token ``token`` (as wake_oldest writes it)."""
    r.hset(lock_name(prefix, key), mapping={"token": token, "state": "handed", "pid": 0, "ttl": ttl_ms, "fence": ""})
    r.pexpire(lock_name(prefix, key), ttl_ms)


def test_keep_before_keeps_the_reservations_sorted_before_the_blocker_and_gives_back_the_rest(
    r: redis.Redis, prefix: str
) -> None:
    from celery_lockguard import _handoff as handoff

    keys = ("a", "b", "c", "d")
    for key in ("a", "b", "d"):
        reserve(r, prefix, key, "p-old")
    got = handoff.park(r, prefix, "d", "pd", "{}", task_id="w-d", task_name="n", digest="d", countdown=5)
    assert got.kind == "parked"
    # blocked on c (another holder's): a and b (before c) are kept, d (after c) is given back and woken
    kept, woken = multi.keep_before(r, prefix, keys, "p-old", "p-new", "c", 40_000, 2000)
    assert kept == ["a", "b"]
    for key in ("a", "b"):
        h = r.hgetall(lock_name(prefix, key))
        assert (h["token"], h["state"], h["ttl"]) == ("p-new", "handed", "40000")
        assert 35_000 < r.pttl(lock_name(prefix, key)) <= 40_000
    assert woken is not None and (woken.key, woken.park_token, woken.also) == ("d", "pd", ())
    assert r.hget(lock_name(prefix, "d"), "token") == "pd"  # d's own waiter now holds its reservation
    # the kept reservations are adopted by one ACQUIRE_MULTI with the new park token
    lease = take(r, prefix, ("a", "b"), replace_token="p-new")
    assert isinstance(lease, L.MultiLease)


def test_keep_before_touches_no_other_token_and_gives_back_all_without_a_blocker(r: redis.Redis, prefix: str) -> None:
    reserve(r, prefix, "a", "someone-else")
    reserve(r, prefix, "b", "p-old")
    kept, woken = multi.keep_before(r, prefix, ("a", "b"), "p-old", "p-new", "b", 40_000, 2000)
    assert (kept, woken) == ([], None)  # a is not ours: left alone; b is the blocker's own entity
    assert r.hget(lock_name(prefix, "a"), "token") == "someone-else"
    assert not r.exists(lock_name(prefix, "b"))
    reserve(r, prefix, "b", "p-old")
    assert multi.keep_before(r, prefix, ("a", "b"), "p-old", "", "", 0, 0) == ([], None)  # no blocker: all back
    assert not r.exists(lock_name(prefix, "b"))
    names = [lock_name(prefix, "zz"), wait_name(prefix, "zz"), waiters_name(prefix, "zz")]
    assert scripts.keep_before(r, names, ["nobody", "x", 1000, 0, 1, 1]) == [[0], []]  # missing key


def test_acquire_multi_reports_a_corrupt_fence_and_writes_nothing(r: redis.Redis, prefix: str) -> None:
    from celery_lockguard.exceptions import CorruptFence

    r.set(fence_name(prefix, "b"), "not-a-number")
    with pytest.raises(CorruptFence) as err:
        take(r, prefix, ("a", "b"))
    assert err.value.args[0] == fence_name(prefix, "b")
    assert not r.exists(lock_name(prefix, "a")) and not r.exists(fence_name(prefix, "a"))


def park_on(r: redis.Redis, prefix: str, key: str, p: str) -> None:
    from celery_lockguard import _handoff as handoff

    got = handoff.park(r, prefix, key, p, "{}", task_id=f"w-{p}", task_name="n", digest="d", countdown=5)
    assert got.kind == "parked"


def plant(r: redis.Redis, name: str) -> None:
    """A string where a hash or list of ours belongs (another writer's mistake)."""
    r.delete(name)
    r.set(name, "planted", px=60_000)


@pytest.mark.parametrize("where", ["lease", "queue", "entries"])
def test_release_multi_meeting_a_wrong_type_key_at_the_second_entity_writes_nothing(
    r: redis.Redis, prefix: str, where: str
) -> None:
    """Redis keeps a script's writes before an error: freeing a, reserving it for its waiter and then failing at
    b left a reserved with the reply, and so the wake, lost (the waiter ran only at its safety copy). RELEASE_MULTI
    checks every key it will touch first: nothing is freed, recorded or reserved; both lapse by their TTL."""
    from redis.exceptions import ResponseError

    lease = take(r, prefix, ("a", "b"))
    assert isinstance(lease, L.MultiLease)
    park_on(r, prefix, "a", "pa")
    park_on(r, prefix, "b", "pb")
    plant(r, {"lease": lock_name, "queue": wait_name, "entries": waiters_name}[where](prefix, "b"))
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        multi.release(r, lease, prefix, scope="s1", record='{"r": 1}', completion_ttl_ms=60_000, reserve_ms=2000)
    assert r.hget(lock_name(prefix, "a"), "token") == lease.token, "a not freed"
    assert r.hget(waiters_name(prefix, "a"), "s:pa") == "parked" and r.lrange(wait_name(prefix, "a"), 0, -1) == ["pa"]
    assert not r.exists(done_name(prefix, "s1")), "nothing recorded"
    if where == "lease":
        assert r.hget(waiters_name(prefix, "b"), "s:pb") == "parked"


@pytest.mark.parametrize("where", ["lease", "queue", "entries"])
def test_keep_before_meeting_a_wrong_type_key_at_the_second_entity_writes_nothing(
    r: redis.Redis, prefix: str, where: str
) -> None:
    """Given back with no blocker, a's reservation was freed and its waiter reserved before b's key failed the
    script: a wake lost as in RELEASE_MULTI. KEEP_BEFORE checks first and writes nothing."""
    from redis.exceptions import ResponseError

    reserve(r, prefix, "a", "p-old")
    reserve(r, prefix, "b", "p-old")
    park_on(r, prefix, "a", "pa")
    park_on(r, prefix, "b", "pb")
    plant(r, {"lease": lock_name, "queue": wait_name, "entries": waiters_name}[where](prefix, "b"))
    for blocker, new in (("", ""), ("b", "p-new")):  # all given back; a kept, b given back
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            multi.keep_before(r, prefix, ("a", "b"), "p-old", new, blocker, 40_000, 2000)
        assert r.hgetall(lock_name(prefix, "a"))["token"] == "p-old", "a neither given back nor re-tokened"
        assert r.hget(waiters_name(prefix, "a"), "s:pa") == "parked"


def test_acquire_multi_meeting_a_claim_of_the_wrong_type_takes_nothing(r: redis.Redis, prefix: str) -> None:
    """The anchor's claim is read after the leases are written (to free it): a string there failed the script with
    every lease taken for a delivery that got an error. Checked before the first write."""
    from redis.exceptions import ResponseError

    plant(r, claim_name(prefix, "a"))
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        take(r, prefix, ("a", "b"), claim_token="ct")
    assert not r.exists(lock_name(prefix, "a")) and not r.exists(lock_name(prefix, "b"))
    assert not r.exists(fence_name(prefix, "a")), "no fence issued either"
    assert isinstance(take(r, prefix, ("a", "b")), L.MultiLease), "without a claim to free, the claim is not read"


def test_multi_scripts_reload_after_script_flush(own_redis: RedisServer) -> None:
    c = own_redis.client()
    c.script_flush()
    assert c.script_exists(scripts.acquire_multi.sha) == [False]
    lease = take(c, "lg", ("a", "b"))
    assert isinstance(lease, L.MultiLease)
    c.script_flush()
    assert multi.release(c, lease, "lg")[0] == 1
    assert c.script_exists(scripts.acquire_multi.sha, scripts.release_multi.sha) == [False, True]


def test_a_lock_limit_slot_held_on_an_entity_blocks_the_set(r: redis.Redis, prefix: str) -> None:
    slot = L.acquire(
        r, prefix, "b", ttl_ms=5000, task_id="s", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000, limit=3
    )
    assert isinstance(slot, L.Lease)
    got = L.acquire(
        r, prefix, "b", ttl_ms=5000, task_id="s2", task_name="n", digest="e", worker="w", fence_ttl_ms=60_000, limit=3
    )
    assert isinstance(got, L.Lease) and got.slot == 1
    L.release(r, slot, prefix)  # slot 0 (K's own lease hash) free: slot 1 alone holds the entity
    blocked = take(r, prefix, ("a", "b"))
    assert isinstance(blocked, L.Holder) and blocked.entity == "b" and blocked.slot == 1
    assert not r.exists(lock_name(prefix, "a"))


@pytest.mark.parametrize("mode", ["until_started", "until_done"])
def test_queue_modes_claim_on_the_anchor_and_retries_free_every_other_entity(
    app: Celery, r: redis.Redis, prefix: str, mode: str
) -> None:
    seen: list[dict[str, Any]] = []

    @app.task(
        base=LockedTask, bind=True, shared=False, name=f"bank.{mode}", lock_key=ACC, lock_mode=mode, max_retries=2
    )
    def t(self: Any, src: int, dst: int) -> int:
        seen.append(self.lock.fences)
        if len(seen) == 1:
            raise self.retry(countdown=0)
        return len(seen)

    assert t.apply(args=(1, 2)).get() == 2
    assert seen[1]["acc:1"] > seen[0]["acc:1"] and seen[1]["acc:2"] > seen[0]["acc:2"]
    assert not any(r.exists(lock_name(prefix, k)) for k in ("acc:1", "acc:2"))
    assert not r.exists(claim_name(prefix, "acc:1"))


def test_an_until_done_handover_keeps_the_claim_on_the_anchor_and_frees_the_rest(r: redis.Redis, prefix: str) -> None:
    lease = take(r, prefix, ("a", "b"))
    assert isinstance(lease, L.MultiLease)
    assert L.handover(r, lease, "claim-token", 5000)
    assert (
        r.hget(lock_name(prefix, "a"), "token") == "claim-token" and r.hget(lock_name(prefix, "a"), "state") == "queued"
    )
    assert not r.exists(lock_name(prefix, "b"))
    again = take(r, prefix, ("a", "b"), replace_token="claim-token")  # the retry adopts its claim
    assert isinstance(again, L.MultiLease) and again.fences["a"] > lease.fences["a"]


def test_a_workflow_lock_key_sequence_naming_one_entity_is_that_entity_and_several_are_all_held() -> None:
    from celery import chain

    from celery_lockguard import workflow

    app = Celery("wf-multi", broker="memory://", set_as_current=False)

    @app.task(base=LockedTask, shared=False, name="wf.step")
    def step(a: int) -> int:
        return a

    w = workflow(chain(step.s(1)), lock_key=("acc:{src}", "acc:{dst}"), src=5, dst=5)
    assert w.spec().key == "acc:5" and w.spec().keys == ()
    several = workflow(chain(step.s(1)), lock_key=("acc:{src}", "acc:{dst}"), src=6, dst=5).spec()
    assert several.key == "acc:5" and several.keys == ("acc:5", "acc:6")  # formerly a ConfigurationError


def test_the_plugin_holds_and_names_every_entity_of_a_multi_entity_task(
    app: Celery, r: redis.Redis, lockguard: Any
) -> None:
    @app.task(base=LockedTask, shared=False, name="bank.held", lock_key=ACC, on_locked="raise")
    def t(src: int, dst: int) -> None: ...

    with lockguard.hold(t, 2, 1) as lease:
        assert isinstance(lease, L.MultiLease) and set(lease.fences) == {"acc:1", "acc:2"}
        with pytest.raises(LockContended):
            t.apply(args=(1, 2), throw=True)
    assert lockguard.lock_name(t, 2, 1).endswith("{acc:1}:lock")
    t.apply(args=(1, 2), throw=True)


def test_a_two_entity_task_costs_two_round_trips_as_a_one_entity_task_does(own_redis: RedisServer) -> None:
    app = Celery("multirt", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = own_redis.url
    app.conf.lockguard_key_prefix = "rt"
    c = own_redis.client()

    @app.task(base=LockedTask, shared=False, name="bank.rt2", lock_key=ACC, lock_renew=False)
    def two(src: int, dst: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="bank.rt1", lock_key="acc:{src}", lock_renew=False)
    def one(src: int) -> None: ...

    def calls(run: Any) -> list[str]:
        """The commands clients sent (MONITOR, leaving out what scripts call) while ``run`` ran, warmed up."""
        run()  # warm up: scripts loaded, connection open
        marker = f"multirt-{uuid.uuid4().hex}"
        seen: list[str] = []
        with c.monitor() as m:

            def read() -> None:
                for cmd in m.listen():
                    if marker in cmd["command"]:
                        return
                    verb = cmd["command"].split(" ", 1)[0].upper()
                    if cmd.get("client_type") != "lua" and verb not in ("HELLO", "CLIENT", "AUTH", "SELECT"):
                        seen.append(verb)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            run()
            c.get(marker)
            reader.join(10)
        return seen

    assert calls(lambda: two.apply(args=(1, 2), throw=True)) == ["EVALSHA", "EVALSHA"]  # ACQUIRE_MULTI, RELEASE_MULTI
    assert calls(lambda: one.apply(args=(1,), throw=True)) == ["EVALSHA", "EVALSHA"]  # ACQUIRE, RELEASE


def test_lock_replicas_waits_in_the_same_round_trip_for_several_entities(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="bank.rep", lock_key=ACC, lock_replicas=1)
    def t(self: Any, src: int, dst: int) -> Any:
        return self.lock.replicas

    with capture_logs() as logs:
        assert t.apply(args=(1, 2), throw=True).get() == 0  # the test server has no replica
    under = [e for e in logs if e["event"] == "lock.under_replicated"]
    assert under and under[0]["wanted"] == 1 and under[0]["lock_keys"] == ["acc:1", "acc:2"]


def test_an_until_done_publish_claims_the_anchor_and_dedupes_identical_work(redis_url: str, prefix: str) -> None:
    app = Celery("multiclaim", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = redis_url
    app.conf.lockguard_key_prefix = prefix
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    @app.task(base=LockedTask, shared=False, name="bank.claim", lock_key=ACC, lock_mode="until_done")
    def t(src: int, dst: int) -> None: ...

    first = t.apply_async((2, 1))
    claim = r.hgetall(lock_name(prefix, "acc:1"))
    assert claim["task_id"] == first.id and claim["state"] in ("queued", "publishing")
    assert not r.exists(lock_name(prefix, "acc:2"))  # a queued call holds no other entity
    assert t.apply_async((2, 1)).id == first.id  # identical work: the queued copy answers
    assert t.apply_async((1, 2)).id != first.id  # a transfer the other way is other work: it is queued
