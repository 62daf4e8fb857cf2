"""Every Lua script directly, on the test's own server: wrong token, expired, missing key, NOSCRIPT."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard._keys import claim_name, done_name, fence_name, lock_name, wait_name, waiters_name
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
        scripts.PARK,
        scripts.CHECK_PARKED,
        scripts.CONFIRM_WAKE,
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
    from celery_lockguard._keys import watch_name

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


# -- CLAIM, RELEASE_CLAIM, the holder's TTL ---------------------------------------------------------


def claim(c: Any, token: str = "c1", ttl_ms: int = 3_600_000, task_id: str = "t1", key: str = "k") -> L.Claimed:
    return L.claim(c, lock_name(P, key), token=token, ttl_ms=ttl_ms, task_id=task_id, task_name="n", digest="d")


def test_claim_by_the_running_task_itself_leaves_its_lease_ttl_alone(c: Any) -> None:
    """A task's own republish answers 'own' but must not stretch its running lease to the queue TTL."""
    take(c, ttl_ms=30_000)  # until_done: the lease hash is the claim, state running
    assert claim(c).kind == "own"
    assert 0 < c.pttl(lock_name(P, "k")) <= 30_000, "a dead holder would block the entity for the queue TTL"
    assert c.hget(lock_name(P, "k"), "state") == "running"


def test_claim_by_the_same_task_extends_a_queued_claim_never_shortens(c: Any) -> None:
    assert claim(c, ttl_ms=10_000).kind == "ok"
    assert claim(c, ttl_ms=60_000).kind == "own"
    assert 10_000 < c.pttl(lock_name(P, "k")) <= 60_000
    assert claim(c, ttl_ms=1_000).kind == "own"
    assert c.pttl(lock_name(P, "k")) > 10_000


def test_release_claim_by_token_or_any_token_of_the_task(c: Any) -> None:
    key = lock_name(P, "k")
    assert claim(c, token="mine").kind == "ok"
    assert not L.release_claim(c, key, "t1", token="someone-elses")
    assert not L.release_claim(c, key, "t2")
    assert c.exists(key)
    assert L.release_claim(c, key, "t1", token="mine")
    assert not c.exists(key)
    assert claim(c, token="again").kind == "ok"
    assert L.release_claim(c, key, "t1")  # '' = any token of that task id (the revoke path)
    take(c)  # a running lease is never freed here, whatever the token
    assert not L.release_claim(c, key, "t1")
    assert not L.release_claim(c, key, "t1", token=c.hget(key, "token"))
    assert c.exists(key)


def until_done(c: Any, token: str, task_id: str, digest: str = "d", task_name: str = "n") -> L.Claimed:
    keys = [lock_name(P, "k"), claim_name(P, "k")]
    return L.claim(c, keys, token=token, ttl_ms=60_000, task_id=task_id, task_name=task_name, digest=digest)


def test_until_done_claim_queues_behind_different_work_once(c: Any) -> None:
    """The lease hash is held by different work: one identical copy queues in {K}:claim, the next is held."""
    take(c, task_id="refund", task_name="refund")  # different work runs on the entity
    assert until_done(c, "a", "t1").kind == "ok"
    assert c.hget(claim_name(P, "k"), "token") == "a"
    again = until_done(c, "b", "t2")
    assert (again.kind, again.task_id, again.state) == ("held", "t1", "queued")
    assert until_done(c, "c", "t3", digest="other").kind == "held"  # different work too: one queued copy
    assert until_done(c, "d", "t1").kind == "own"


def test_until_done_claim_on_a_free_entity_sees_identical_work_queued_behind(c: Any) -> None:
    take(c, task_id="refund", task_name="refund")
    assert until_done(c, "a", "t1").kind == "ok"  # queued behind the refund
    c.delete(lock_name(P, "k"))  # the refund finished
    held = until_done(c, "b", "t2")
    assert (held.kind, held.task_id) == ("held", "t1"), "a second identical copy was queued"
    assert until_done(c, "e", "t5", digest="other").kind == "ok"  # different work claims the free lease hash
    assert c.hget(lock_name(P, "k"), "task_id") == "t5"


def test_until_done_claim_on_identical_running_work_is_held(c: Any) -> None:
    take(c, task_id="t0", task_name="n", digest="d")
    held = until_done(c, "a", "t1")
    assert (held.kind, held.task_id, held.state) == ("held", "t0", "running")
    assert not c.exists(claim_name(P, "k"))


def test_release_claim_frees_whichever_key_holds_the_claim(c: Any) -> None:
    take(c, task_id="refund", task_name="refund")
    assert until_done(c, "a", "t1").kind == "ok"
    keys = [lock_name(P, "k"), claim_name(P, "k")]
    assert not L.release_claim(c, keys, "t1", token="wrong")
    assert L.release_claim(c, keys, "t1", token="a")
    assert not c.exists(claim_name(P, "k")) and c.hget(lock_name(P, "k"), "task_id") == "refund"


def test_acquire_frees_the_until_done_claim_queued_behind_other_work(c: Any) -> None:
    take(c, task_id="refund", task_name="refund")
    assert until_done(c, "a", "t1").kind == "ok"
    c.delete(lock_name(P, "k"))
    got = take(c, task_id="t1", replace_token="a", claim_token="a")
    assert isinstance(got, L.Lease) and not c.exists(claim_name(P, "k"))


def test_a_claim_taken_publishing_lapses_after_the_grace_unless_confirmed(c: Any) -> None:
    keys = [lock_name(P, "k"), claim_name(P, "k")]
    args = {"ttl_ms": 60_000, "task_name": "n", "digest": "d", "publish_ttl_ms": 2_000}
    assert L.claim(c, keys, token="a", task_id="t1", **args).kind == "ok"
    assert c.hget(lock_name(P, "k"), "state") == "publishing" and 0 < c.pttl(lock_name(P, "k")) <= 2_000
    met = L.claim(c, keys, token="b", task_id="t2", **args)
    assert (met.kind, met.task_id, met.state) == ("held", "t1", "publishing")
    assert not L.confirm_claim(c, keys, "wrong", 60_000)
    assert L.confirm_claim(c, keys, "a", 60_000)
    assert c.hget(lock_name(P, "k"), "state") == "queued" and c.pttl(lock_name(P, "k")) > 2_000
    assert not L.confirm_claim(c, keys, "a", 60_000), "only a publishing claim is confirmed"


def test_a_publishing_claim_is_freed_by_its_token_and_adopted_by_its_worker(c: Any) -> None:
    keys = [lock_name(P, "k"), claim_name(P, "k")]
    args = {"ttl_ms": 60_000, "task_name": "n", "digest": "d", "publish_ttl_ms": 5_000}
    assert L.claim(c, keys, token="a", task_id="t1", **args).kind == "ok"
    assert L.release_claim(c, keys, "t1", token="a") and not c.exists(lock_name(P, "k"))
    assert L.claim(c, keys, token="b", task_id="t1", **args).kind == "ok"
    got = take(c, task_id="t1", replace_token="b", claim_token="b")  # the message beat the confirm
    assert isinstance(got, L.Lease) and c.hget(lock_name(P, "k"), "state") == "running"
    assert not L.confirm_claim(c, keys, "b", 60_000) and c.hget(lock_name(P, "k"), "state") == "running"


def test_held_reply_carries_the_holders_own_ttl(c: Any) -> None:
    take(c, ttl_ms=60_000)
    holder = take(c, task_id="t2", ttl_ms=1_000)
    assert isinstance(holder, L.Holder) and holder.ttl_ms == 60_000
    c.hdel(lock_name(P, "k"), "ttl")  # a hash written by an older release has no ttl field
    holder = take(c, task_id="t2", ttl_ms=1_000)
    assert isinstance(holder, L.Holder) and holder.ttl_ms == 0


# -- corrupt fences -----------------------------------------------------------------------------------


CORRUPT = ["inf", "1e400", "abc", "1.5", "-3", "", "9007199254740992", "99999999999999999999", "9007199254740991"]


@pytest.mark.parametrize("value", CORRUPT)
def test_acquire_refuses_a_corrupt_fence_before_writing_anything(c: Any, value: str) -> None:
    from celery_lockguard._errors import classify
    from celery_lockguard.exceptions import CorruptFence

    c.set(fence_name(P, "k"), value)
    c.hset(claim_name(P, "k"), mapping={"token": "ct", "task_id": "t1", "state": "queued"})
    with pytest.raises(CorruptFence) as raised:
        take(c, claim_token="ct")
    assert raised.value.key == fence_name(P, "k") and raised.value.value == value
    assert raised.value.args == (fence_name(P, "k"), value)
    assert classify(raised.value) == "misconfigured"
    assert not c.exists(lock_name(P, "k")), "a lease was written and orphaned"
    assert c.get(fence_name(P, "k")) == value and c.exists(claim_name(P, "k"))


def test_acquire_refuses_a_fence_counter_of_the_wrong_type(c: Any) -> None:
    from celery_lockguard.exceptions import CorruptFence

    c.hset(fence_name(P, "k"), "x", "1")
    with pytest.raises(CorruptFence, match="WRONGTYPE"):
        take(c)
    assert not c.exists(lock_name(P, "k"))


@pytest.mark.parametrize("value", CORRUPT)
def test_force_release_refuses_a_corrupt_fence_and_leaves_the_holder(c: Any, value: str) -> None:
    from celery_lockguard.exceptions import CorruptFence

    lease = take(c)
    c.set(fence_name(P, "k"), value)
    with pytest.raises(CorruptFence):
        L.force_release(c, P, "k", 60_000)
    assert c.hget(lock_name(P, "k"), "token") == lease.token and c.get(fence_name(P, "k")) == value


def test_a_long_corrupt_value_is_truncated_in_the_error(c: Any) -> None:
    from celery_lockguard.exceptions import CorruptFence

    c.set(fence_name(P, "k"), "x" * 10_000 + "\r\n")
    with pytest.raises(CorruptFence) as raised:
        take(c)
    assert raised.value.value == "x" * 64


def test_fences_stay_exact_integers_up_to_2_53_minus_1(c: Any) -> None:
    from celery_lockguard.exceptions import CorruptFence

    c.set(fence_name(P, "k"), str(2**53 - 2))
    lease = take(c)
    assert lease.fence == 2**53 - 1 and c.get(fence_name(P, "k")) == str(2**53 - 1)
    L.release(c, lease, P)
    with pytest.raises(CorruptFence):  # no exact fence is left above it: never hand out the same one twice
        take(c)
    assert not c.exists(lock_name(P, "k"))


# -- NOSCRIPT that a reload cannot fix ----------------------------------------------------------------


class FlushAfterLoadProxy:
    """Relays a client to a real server and runs SCRIPT FLUSH on the server after every SCRIPT LOAD.

    The flush happens before the client sees the load's reply, so the EVALSHA that follows finds no
    script: what a proxy spreading calls over nodes, or a flush racing every load, does.
    """

    def __init__(self, server: RedisServer) -> None:
        import socket

        from celery_lockguard.testing import free_port

        self.server = server
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.loads = 0
        self._pending = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def _accept(self) -> None:
        import socket

        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.server.port))
            threading.Thread(target=self._pipe, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()

    def _pipe(self, src: Any, dst: Any, to_server: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_server and b"LOAD" in data.upper():
                    self.loads += 1
                    self._pending.set()
                elif not to_server and self._pending.is_set():
                    self._pending.clear()
                    self.server.client().script_flush()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self.listener.close()


def test_noscript_that_survives_a_reload_is_misconfigured(own_redis: RedisServer) -> None:
    from redis.exceptions import NoScriptError

    from celery_lockguard._errors import classify, configuration_error

    proxy = FlushAfterLoadProxy(own_redis)
    try:
        c = proxy.client()
        with pytest.raises(NoScriptError) as raised:
            take(c)
        assert proxy.loads == 1, "reloaded exactly once, not in a loop"
        assert "ACQUIRE" in str(raised.value)
        assert classify(raised.value) == "misconfigured"
        assert "NOSCRIPT" in str(configuration_error(raised.value, "t", "ACQUIRE"))
        assert not own_redis.client().exists(lock_name(P, "k"))
    finally:
        proxy.close()


def test_no_script_load_on_the_server_is_misconfigured() -> None:
    from redis.exceptions import ResponseError

    from celery_lockguard._errors import classify

    with RedisServer(extra=["--rename-command", "SCRIPT", '""']) as server:
        c = server.client()
        with pytest.raises(ResponseError) as raised:
            take(c)
        assert "unknown command" in str(raised.value) and classify(raised.value) == "misconfigured"


# -- SHORTEN and the child's pid ------------------------------------------------------------------------


def test_shorten_with_a_pid_leaves_a_same_host_holder_of_the_same_task_id_in_another_process(c: Any) -> None:
    """A redelivery took over the dead child's lease in another child: the main process must not cut it."""
    take(c, ttl_ms=60_000)  # held by this process's pid
    new_holder = c.hget(lock_name(P, "k"), "pid")
    assert not L.shorten(c, P, "k", "t1", 2000, pid=int(new_holder) + 1)  # the old child's pid
    assert c.pttl(lock_name(P, "k")) > 50_000
    assert L.shorten(c, P, "k", "t1", 2000, pid=int(new_holder))
    assert 0 < c.pttl(lock_name(P, "k")) <= 2000


# -- park and wake ---------------------------------------------------------------------------


def park(
    c: Any, p: str, key: str = "k", task_id: str = "w", countdown: float = 5.0, first: int | None = None
) -> handoff.Parked:
    message = f'{{"task":"n","id":"{p}"}}'
    return handoff.park(
        c, P, key, p, message, task_id=task_id, task_name="n", digest="dw", countdown=countdown, first_parked_ms=first
    )


def test_a_copy_parking_again_goes_back_ahead_of_those_who_parked_after_it(c: Any) -> None:
    """FIFO by first park: a safety copy whose holder outlived its countdown must not lose its place."""
    take(c)
    park(c, "w1", first=1_000)
    park(c, "w2", first=2_000)
    park(c, "w3", first=3_000)
    assert handoff.check(c, P, "k", "w1", "safety")[0] == "parked"  # W1's safety copy: the holder still runs
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["w2", "w3"]
    park(c, "w1-again", first=1_000)  # parks again with its first-park time
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["w1-again", "w2", "w3"]
    park(c, "w2-again", first=2_000) if handoff.check(c, P, "k", "w2", "safety")[0] == "parked" else None
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["w1-again", "w2-again", "w3"]
    park(c, "w4")  # a new waiter: the tail
    assert c.lrange(wait_name(P, "k"), 0, -1)[-1] == "w4"


def test_park_behind_a_held_lease_queues_in_order_and_extends_the_waiter_keys(c: Any) -> None:
    take(c)
    first, second = park(c, "p1"), park(c, "p2", task_id="w2")
    assert first.kind == "parked" and 0 < first.pttl_ms <= 5000 and second.kind == "parked"
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1", "p2"]
    entries = c.hgetall(waiters_name(P, "k"))
    assert entries["s:p1"] == "parked" and entries["t:p2"] == "w2" and entries["m:p1"].startswith("{")
    assert c.pttl(wait_name(P, "k")) > 600_000 and c.pttl(waiters_name(P, "k")) > 600_000


def test_park_on_a_missing_or_expired_lease_answers_free_and_writes_nothing(c: Any) -> None:
    assert park(c, "p1").kind == "free"
    take(c, ttl_ms=50)
    wait_for(lambda: not c.exists(lock_name(P, "k")), 5, what="the lease to expire")
    assert park(c, "p1").kind == "free"
    assert not c.exists(wait_name(P, "k")) and not c.exists(waiters_name(P, "k"))


def test_park_past_the_cap_answers_full(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "MAX_WAITERS", 2)
    take(c)
    assert [park(c, f"p{i}").kind for i in range(3)] == ["parked", "parked", "full"]


def test_park_drops_stale_entries_at_the_head_first(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "MAX_WAITERS", 1)
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 0.0)
    take(c)
    assert park(c, "old", countdown=0.05).kind == "parked"
    wait_for(lambda: _stale(c, "old"), 5, what="stale entry")
    assert park(c, "new").kind == "parked", "a stale entry must not count against the cap"
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["new"] and not c.hexists(waiters_name(P, "k"), "m:old")


def _stale(c: Any, p: str) -> bool:
    sec, us = c.time()
    return int(c.hget(waiters_name(P, "k"), f"d:{p}") or 0) < sec * 1000 + us // 1000


def test_release_wakes_the_oldest_live_waiter_and_reserves_the_lease_for_it(c: Any) -> None:
    lease = take(c)
    park(c, "p1", task_id="w1")
    park(c, "p2", task_id="w2")
    released, recorded, woken = L.release_and_wake(c, lease, P, reserve_ms=3000)
    assert (released, recorded) == (1, 0) and woken is not None
    assert (woken.key, woken.park_token) == ("k", "p1") and '"id":"p1"' in woken.message
    held = c.hgetall(lock_name(P, "k"))
    assert (held["token"], held["state"], held["task_id"], held["digest"]) == ("p1", "handed", "w1", "dw")
    assert 0 < c.pttl(lock_name(P, "k")) <= 3000
    assert c.hget(waiters_name(P, "k"), "s:p1") == "waking" and c.lrange(wait_name(P, "k"), 0, -1) == ["p2"]
    assert handoff.confirm(c, P, "k", "p1") and c.hget(waiters_name(P, "k"), "s:p1") == "woken"
    assert not handoff.confirm(c, P, "k", "p1"), "confirm only moves a waking entry"
    # the woken copy adopts the reservation: ACQUIRE replacing the park token
    adopted = take(c, task_id="w1", replace_token="p1")
    assert isinstance(adopted, L.Lease) and c.hget(lock_name(P, "k"), "state") == "running"
    assert isinstance(take(c, task_id="fresh"), L.Holder), "nobody barges in meanwhile"


def test_release_with_the_wrong_token_or_an_expired_lease_wakes_nobody(c: Any) -> None:
    lease = take(c)
    park(c, "p1")
    impostor = L.Lease("k", P, "not-the-token", 1, 5000, 0.0, "t9", "n")
    assert L.release_and_wake(c, impostor, P, reserve_ms=3000) == (-1, 0, None)
    c.delete(lock_name(P, "k"))  # expired
    assert L.release_and_wake(c, lease, P, reserve_ms=3000) == (0, 0, None)
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1"], "the waiter stays parked for its safety copy"


def test_release_with_an_empty_queue_or_without_reserve_wakes_nobody(c: Any) -> None:
    assert L.release_and_wake(c, take(c), P, reserve_ms=3000) == (1, 0, None)
    lease = take(c)
    park(c, "p1")
    assert L.release(c, lease, P) == (1, 0)
    assert not c.exists(lock_name(P, "k")) and c.lrange(wait_name(P, "k"), 0, -1) == ["p1"]


def test_release_skips_stale_and_taken_entries(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 0.0)
    lease = take(c)
    park(c, "stale", countdown=0.05)
    park(c, "gone")
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 30.0)
    park(c, "live")
    c.hdel(waiters_name(P, "k"), "s:gone", "m:gone")  # its safety copy took it out (or the hash expired)
    wait_for(lambda: _stale(c, "stale"), 5, what="stale entry")
    _, _, woken = L.release_and_wake(c, lease, P, reserve_ms=3000)
    assert woken is not None and woken.park_token == "live"
    assert c.llen(wait_name(P, "k")) == 0 and not c.hexists(waiters_name(P, "k"), "m:stale")


def test_release_records_completion_and_wakes_in_one_script(c: Any) -> None:
    lease = take(c)
    park(c, "p1")
    got = L.release_and_wake(c, lease, P, scope="s", record='{"result":1}', completion_ttl_ms=10_000, reserve_ms=3000)
    assert got[:2] == (1, 1) and got[2] is not None and c.get(done_name(P, "s")) == '{"result":1}'


def test_check_parked_moves_the_entry_for_each_copy(c: Any) -> None:
    lease = take(c)
    for p in ("a", "b", "c", "d"):
        park(c, p)
    # safety copy of a still-parked entry takes it out of the queue
    assert handoff.check(c, P, "k", "a", "safety")[0] == "parked"
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["b", "c", "d"] and not c.hexists(waiters_name(P, "k"), "s:a")
    assert handoff.check(c, P, "k", "a", "safety")[0] == "missing"
    # b is woken: the woken copy marks it running, its safety copy then drops it
    _, _, woken = L.release_and_wake(c, lease, P, reserve_ms=3000)
    assert woken is not None and woken.park_token == "b"
    state, age = handoff.check(c, P, "k", "b", "safety", grace=60)
    assert state == "waking" and 0 <= age < 60_000 and c.hget(waiters_name(P, "k"), "s:b") == "waking"
    assert handoff.check(c, P, "k", "b", "woken")[0] == "waking"
    assert c.hget(waiters_name(P, "k"), "s:b") == "running"
    assert handoff.check(c, P, "k", "b", "safety")[0] == "running" and not c.hexists(waiters_name(P, "k"), "s:b")
    # c is woken and its releaser dies: past the grace the safety copy takes over, the late woken copy sees it
    lease2 = take(c, task_id="w", replace_token="b")
    _, _, woken = L.release_and_wake(c, lease2, P, reserve_ms=3000)
    assert woken is not None and woken.park_token == "c"
    assert handoff.check(c, P, "k", "c", "safety", grace=0)[0] == "waking"
    assert c.hget(waiters_name(P, "k"), "s:c") == "taken"
    # only the marker stays (the message is not needed again); the late woken copy sees it and removes it
    assert [f for f in c.hkeys(waiters_name(P, "k")) if f.endswith(":c")] == ["s:c"]
    assert handoff.check(c, P, "k", "c", "woken")[0] == "taken" and not c.hexists(waiters_name(P, "k"), "s:c")
    assert handoff.check(c, P, "k", "c", "safety")[0] == "missing"
    assert handoff.check(c, P, "k", "nope", "woken") == ("missing", -1)


@pytest.mark.parametrize("name", ["park", "check_parked", "confirm_wake"])
def test_noscript_after_script_flush_reloads_the_handoff_scripts(c: Any, name: str) -> None:
    take(c)
    park(c, "p1")
    c.script_flush()
    if name == "park":
        assert park(c, "p2").kind == "parked"
    elif name == "check_parked":
        assert handoff.check(c, P, "k", "p1", "safety")[0] == "parked"
    else:
        assert not handoff.confirm(c, P, "k", "p1")
    assert c.script_exists(getattr(scripts, name).sha) == [True]
