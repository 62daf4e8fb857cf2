"""Every Lua script directly, on the test's own server: wrong token, expired, missing key, NOSCRIPT."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard._keys import (
    claim_name,
    debounce_name,
    debounce_run_name,
    done_name,
    fence_name,
    lock_name,
    wait_name,
    waiters_name,
)
from celery_lockguard.exceptions import CorruptFence
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
        scripts.ACQUIRE_SLOTS,
        scripts.ACQUIRE_MULTI,
        scripts.RELEASE_MULTI,
        scripts.RELEASE,
        scripts.RENEW,
        scripts.SHORTEN,
        scripts.FORCE_RELEASE,
        scripts.WAKE,
        scripts.CLAIM,
        scripts.RELEASE_CLAIM,
        scripts.HANDOVER,
        scripts.WATCH_ARM,
        scripts.PARK,
        scripts.CHECK_PARKED,
        scripts.CONFIRM_WAKE,
        scripts.DEBOUNCE_PUBLISH,
        scripts.DEBOUNCE_SETTLE,
        scripts.DEBOUNCE_TAKE,
        scripts.DEBOUNCE_START,
        scripts.DEBOUNCE_KEEP,
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
    deleted, fence, holder, woken = L.force_release(c, P, "k", 60_000)
    assert deleted and holder == "t1" and fence > lease.fence and woken is None
    assert not c.exists(lock_name(P, "k"))
    assert L.force_release(c, P, "k", 60_000)[0] is False
    assert take(c).fence > fence


@pytest.mark.parametrize("name", ["acquire", "release", "renew", "shorten", "force_release", "wake"])
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
    elif name == "wake":
        assert L.wake_if_free(c, P, "k", 3000) is None  # held: nothing written
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


def test_acquire_refuses_a_claim_of_the_wrong_type_before_taking_the_lease(c: Any) -> None:
    """The until_started claim is read after the lease is written (to free it): a string there failed the script
    with the lease taken for a delivery that got an error. Its type is checked before the first write."""
    from redis.exceptions import ResponseError

    c.set(claim_name(P, "k"), "planted")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        take(c, claim_token="ct")
    assert not c.exists(lock_name(P, "k")) and not c.exists(fence_name(P, "k")), "nothing written"
    assert isinstance(take(c), L.Lease), "without a claim to free, the claim is not read"


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


def test_release_with_the_wrong_token_wakes_nobody_and_of_an_expired_lease_wakes_the_oldest(c: Any) -> None:
    lease = take(c)
    park(c, "p1")
    impostor = L.Lease("k", P, "not-the-token", 1, 5000, 0.0, "t9", "n")
    assert L.release_and_wake(c, impostor, P, reserve_ms=3000) == (-1, 0, None)
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1"], "the holder is still there: the waiter stays parked"
    c.delete(lock_name(P, "k"))  # expired under its holder, and nobody took it
    released, _, woken = L.release_and_wake(c, lease, P, reserve_ms=3000)
    assert released == 0 and woken is not None and woken.park_token == "p1", "the entity is free: its end wakes"
    assert c.hget(lock_name(P, "k"), "token") == "p1" and c.hget(lock_name(P, "k"), "state") == "handed"


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


# -- ACQUIRE_SLOTS (lock_limit, lock_rate) ------------------------------------------------------------


def slots(c: Any, limit: int = 3, rate: tuple[int, int] | None = None, key: str = "e", **kw: Any) -> Any:
    """ACQUIRE_SLOTS as the runtime calls it; each call is different work (its own digest) unless told."""
    ttl_ms = kw.pop("ttl_ms", 5000)
    args = {"task_id": f"t-{L.new_token()[:8]}", "task_name": "n", "worker": "w@h", "fence_ttl_ms": 60_000}
    args["digest"] = args["task_id"]
    args.update(kw)
    return L.acquire(c, P, key, ttl_ms=ttl_ms, limit=limit, rate=rate, **args)


def test_slots_fill_lowest_first_then_the_holder_that_frees_first_is_met(c: Any) -> None:
    from celery_lockguard._keys import rate_name, slot_fence_name, slot_lock_name

    held = [slots(c) for _ in range(3)]
    assert [x.slot for x in held] == [0, 1, 2]
    assert [x.redis_key for x in held] == [slot_lock_name(P, "e", i) for i in range(3)]
    assert held[0].redis_key == lock_name(P, "e") and held[1].redis_key == f"{P}:v1:{{e}}:lock:1"
    assert [x.fence_row for x in held] == ["e", "e#1", "e#2"]
    assert all(c.get(slot_fence_name(P, "e", i)) == str(held[i].fence) for i in range(3))
    assert c.hget(slot_lock_name(P, "e", 2), "slot") == "2"
    assert not c.exists(rate_name(P, "e"))  # no rate: no window written
    c.pexpire(slot_lock_name(P, "e", 1), 800)  # slot 1 frees first
    met = slots(c)
    assert isinstance(met, L.Holder) and met.slot == 1 and met.busy == 3 and met.token == held[1].token
    assert met.task_id == held[1].task_id and 0 < met.pttl_ms <= 800 and met.ttl_ms == 5000


def test_slots_same_token_is_idempotent_and_a_freed_slot_is_reused(c: Any) -> None:
    a, b = slots(c, limit=2), slots(c, limit=2)
    again = slots(c, limit=2, token=b.token, task_id=b.task_id, digest=b.task_id)
    assert isinstance(again, L.Lease) and again.slot == 1 and again.fence == b.fence
    assert L.release(c, a, P) == (1, 0)
    c2 = slots(c, limit=2)
    assert isinstance(c2, L.Lease) and c2.slot == 0 and c2.fence > a.fence


def test_slots_meet_identical_work_or_their_own_task_id_before_a_free_slot(c: Any) -> None:
    first = slots(c, limit=3, task_id="t1", digest="same")
    dup = slots(c, limit=3, task_id="t2", digest="same")  # identical work (name + digest)
    assert isinstance(dup, L.Holder) and dup.task_id == "t1" and dup.slot == 0 and dup.busy == 1
    own = slots(c, limit=3, task_id="t1", digest="other")  # a copy of the holder's own task id
    assert isinstance(own, L.Holder) and own.task_id == "t1"
    other = slots(c, limit=3, task_id="t3", digest="other")
    assert isinstance(other, L.Lease) and other.slot == 1 and first.slot == 0


def test_slots_past_a_lowered_limit_are_read_for_the_duplicate_rule(c: Any) -> None:
    # A deploy lowered lock_limit 3 -> 2 while t1 still holds slot 2: its redelivery, and identical
    # work, took a free slot below 2 and ran a second time.
    o1, o2 = slots(c, limit=3), slots(c, limit=3)
    t1 = slots(c, limit=3, task_id="t1", digest="same")
    assert t1.slot == 2
    L.release(c, o1, P), L.release(c, o2, P)
    own = slots(c, limit=2, task_id="t1", digest="same")  # a redelivery of t1, under N = 2
    assert isinstance(own, L.Holder) and own.task_id == "t1" and own.slot == 2 and own.token == t1.token
    assert 0 < own.pttl_ms <= 5000
    dup = slots(c, limit=2, task_id="t2", digest="same")  # identical work
    assert isinstance(dup, L.Holder) and dup.task_id == "t1" and dup.slot == 2
    other = slots(c, limit=2)  # other work is not held up by the old slot
    assert isinstance(other, L.Lease) and other.slot == 0
    # Our own dead holder there, taken over (ADOPT): it goes, and we take a slot below N.
    took = slots(c, limit=2, task_id="t1", digest="same", replace_token=t1.token)
    assert isinstance(took, L.Lease) and took.slot == 1 and not c.exists(t1.redis_key)


def test_slots_past_the_limit_stop_at_the_first_slot_never_used(c: Any) -> None:
    from celery_lockguard._keys import slot_lock_name

    # A hash at slot 3 with no fence at slot 2 was never taken by ACQUIRE_SLOTS: not scanned (bounded cost).
    c.hset(slot_lock_name(P, "e", 3), mapping={"token": "x", "task_id": "t1", "task_name": "n", "digest": "d"})
    got = slots(c, limit=2, task_id="t1", digest="d")
    assert isinstance(got, L.Lease) and got.slot == 0


def test_slots_replace_token_takes_over_that_slot_only(c: Any) -> None:
    a = slots(c, limit=2, task_id="t1", digest="d1")
    b = slots(c, limit=2, task_id="t2", digest="d2")
    assert isinstance(slots(c, limit=2, task_id="t9", replace_token="not-a-token"), L.Holder)
    took = slots(c, limit=2, task_id="t2", digest="d2", replace_token=b.token)
    assert isinstance(took, L.Lease) and took.slot == 1 and took.fence > b.fence
    assert c.hget(took.redis_key, "token") == took.token and c.hget(a.redis_key, "token") == a.token


def test_slot_release_renew_and_shorten_touch_only_their_own_slot(c: Any) -> None:
    a, b = slots(c, limit=2, task_id="t1"), slots(c, limit=2, task_id="t2")
    wrong = L.Lease("e", P, "wrong-token", 1, 5000, time.monotonic(), "x", "n", slot=1)
    assert L.release(c, wrong, P) == (-1, 0) and c.exists(b.redis_key)  # wrong token: left alone
    assert L.renew(c, [a, b, wrong]) == [1, 1, 0]
    assert L.shorten(c, P, "e", "t2", 1000, limit=2)  # the main process scans the slots for its task
    assert 0 < c.pttl(b.redis_key) <= 1000 and c.pttl(a.redis_key) > 1000
    assert not L.shorten(c, P, "e", "t2", 1000, limit=1)  # slot 0 is not t2's
    assert L.release(c, b, P) == (1, 0) and not c.exists(b.redis_key) and c.exists(a.redis_key)
    c.delete(a.redis_key)  # expired meanwhile
    assert L.release(c, a, P) == (0, 0)
    assert L.renew(c, [a]) == [0] and not c.exists(a.redis_key)  # renewal never resurrects


def test_slot_release_records_completion_and_wakes_nobody(c: Any) -> None:
    a = slots(c, limit=2)
    assert L.release_and_wake(c, a, P, "sc", "rec", 60_000, reserve_ms=0) == (1, 1, None)
    assert c.get(done_name(P, "sc")) == "rec"
    got = slots(c, limit=2, scope="sc")
    assert isinstance(got, L.Done) and got.record == "rec" and not c.exists(lock_name(P, "e"))


def test_rate_admits_n_starts_per_window_then_says_when_the_oldest_leaves(c: Any) -> None:
    from celery_lockguard._keys import rate_name

    admitted = []
    for _ in range(3):
        lease = slots(c, limit=5, rate=(3, 2000))
        assert isinstance(lease, L.Lease)
        admitted.append(lease)
        L.release(c, lease, P)  # released at once: the window still counts the start
    got = slots(c, limit=5, rate=(3, 2000))
    assert isinstance(got, L.Throttled) and got.starts == 3 and 0 < got.wait_ms <= 2000
    window = rate_name(P, "e")
    assert c.zcard(window) == 3 and 0 < c.pttl(window) <= 2000  # bounded: N members, PX = window
    oldest = float(c.zrange(window, 0, 0, withscores=True)[0][1])
    now_ms = int(c.time()[0]) * 1000 + int(c.time()[1]) // 1000
    assert abs((oldest + 2000 - now_ms) - got.wait_ms) < 200
    assert not any(c.exists(x.redis_key) for x in admitted)  # a throttled call took nothing


def test_rate_window_slides_and_is_trimmed(c: Any) -> None:
    from celery_lockguard._keys import rate_name

    window = rate_name(P, "e")
    for _ in range(2):
        L.release(c, slots(c, limit=1, rate=(2, 300)), P)
    assert isinstance(slots(c, limit=1, rate=(2, 300)), L.Throttled)
    wait_for(lambda: isinstance(lease := slots(c, limit=1, rate=(2, 300)), L.Lease) and L.release(c, lease, P), 5)
    assert c.zcard(window) <= 2


def test_rate_with_a_single_lease_keeps_the_single_lease_keys(c: Any) -> None:
    from celery_lockguard._keys import rate_name

    lease = slots(c, limit=1, rate=(5, 60_000))
    assert isinstance(lease, L.Lease) and lease.slot == 0 and lease.redis_key == lock_name(P, "e")
    assert lease.fence_row == "e" and c.get(fence_name(P, "e")) == str(lease.fence)
    assert c.zscore(rate_name(P, "e"), lease.token) is not None
    busy = slots(c, limit=1, rate=(5, 60_000))
    assert isinstance(busy, L.Holder) and busy.busy == 1  # held, checked before the window
    assert c.zcard(rate_name(P, "e")) == 1  # a start that was not admitted is not counted


def test_rate_forgotten_after_a_restart_without_persistence() -> None:
    """Documented: with no persistence the lock Redis forgets the window, so up to N more starts follow."""
    with RedisServer() as own:
        c = own.client()
        for _ in range(2):
            L.release(c, slots(c, limit=1, rate=(2, 60_000)), P)
        assert isinstance(slots(c, limit=1, rate=(2, 60_000)), L.Throttled)
        own.stop()
        own.start()
        c = own.client()
        assert isinstance(slots(c, limit=1, rate=(2, 60_000)), L.Lease)


def test_slots_refuse_a_corrupt_fence_of_the_slot_taken_and_write_nothing(c: Any) -> None:
    from celery_lockguard._keys import slot_fence_name
    from celery_lockguard.exceptions import CorruptFence

    slots(c, limit=2, task_id="t1")
    c.set(slot_fence_name(P, "e", 1), "garbage")
    with pytest.raises(CorruptFence) as err:
        slots(c, limit=2, rate=(5, 60_000))
    assert err.value.args[0] == slot_fence_name(P, "e", 1)
    assert not c.exists(f"{P}:v1:{{e}}:lock:1") and not c.exists(f"{P}:v1:{{e}}:rate")


def test_slots_noscript_after_script_flush_reloads(c: Any) -> None:
    slots(c, limit=2, rate=(5, 60_000))
    c.script_flush()
    assert c.script_exists(scripts.acquire_slots.sha) == [False]
    assert isinstance(slots(c, limit=2, rate=(5, 60_000)), L.Lease)
    assert c.script_exists(scripts.acquire_slots.sha) == [True]


def test_slots_never_over_admit_under_a_race_of_threads(own_redis: RedisServer) -> None:
    """Admission is one script: 16 threads racing for 3 slots and 5 starts per window never get more."""
    held: list[Any] = []
    barrier = threading.Barrier(16)

    def racer() -> None:
        c = own_redis.client()
        barrier.wait()
        for _ in range(10):
            got = slots(c, limit=3, rate=(5, 60_000), key="race")
            if isinstance(got, L.Lease):
                held.append(got)

    threads = [threading.Thread(target=racer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(held) == 3  # slots never released: exactly N holders, whatever the race
    assert sorted(x.slot for x in held) == [0, 1, 2]


def test_rate_never_over_admits_under_a_race_of_threads(own_redis: RedisServer) -> None:
    """Every start released at once, so only the window bounds them: 16 racing threads, exactly N starts."""
    admitted: list[Any] = []
    barrier = threading.Barrier(16)

    def racer() -> None:
        c = own_redis.client()
        barrier.wait()
        for _ in range(10):
            got = slots(c, limit=16, rate=(5, 60_000), key="rate-race")
            if isinstance(got, L.Lease):
                admitted.append(got)
                L.release(c, got, P)

    threads = [threading.Thread(target=racer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5


# -- debounce: DEBOUNCE_PUBLISH, DEBOUNCE_SETTLE, DEBOUNCE_TAKE, DEBOUNCE_START-------------------------------------

DREC = debounce_name(P, "k", "n")


def dpublish(c: Any, task_id: str, delay_ms: int = 0, ttl_ms: int = 60_000, digest: str = "d") -> list[str]:
    return [str(x) for x in scripts.debounce_publish(c, [DREC], [task_id, digest, delay_ms, ttl_ms])]


def dsettle(c: Any, task_id: str, how: str) -> int:
    return int(scripts.debounce_settle(c, [DREC], [task_id, how]))


def dtake(c: Any, task_id: str, burst: str, grace_ms: int = 15_000, ttl_ms: int = 60_000) -> list[str]:
    run = debounce_run_name(P, "k", "n", burst)
    return [str(x) for x in scripts.debounce_take(c, [DREC, run], [task_id, burst, grace_ms, ttl_ms])]


def test_debounce_publish_starts_a_burst_then_replaces_the_pending_run(c: Any) -> None:
    assert dpublish(c, "t1", delay_ms=5000) == ["t1", ""]  # nothing pending: a new burst named after itself
    assert dpublish(c, "t2", delay_ms=5000, digest="d2") == ["t1", "t1"]  # same burst, replaces t1
    rec = c.hgetall(DREC)
    assert (rec["task_id"], rec["digest"], rec["state"], rec["burst"], rec["superseded"]) == (
        "t2",
        "d2",
        "publishing",
        "t1",
        "1",
    )
    assert (rec["prev_id"], rec["prev_digest"]) == ("t1", "d")
    assert int(rec["due_ms"]) - int(rec["at_ms"]) == 5000


def test_debounce_publish_extends_the_record_ttl_never_shortens_it(c: Any) -> None:
    dpublish(c, "t1", ttl_ms=60_000)
    dpublish(c, "t2", ttl_ms=1000)
    assert c.pttl(DREC) > 50_000


def test_debounce_settle_published_confirms_only_its_own_publish(c: Any) -> None:
    assert dsettle(c, "t1", "published") == 0 and not c.exists(DREC)  # missing key: nothing written
    dpublish(c, "t1")
    assert dsettle(c, "other", "published") == 0  # wrong id
    assert c.hget(DREC, "state") == "publishing"
    dpublish(c, "t2")
    assert dsettle(c, "t1", "published") == 1 and c.hget(DREC, "prev_state") == "queued"  # its reply came late
    assert dsettle(c, "t2", "published") == 1 and c.hget(DREC, "state") == "queued"


def test_debounce_settle_failed_puts_back_the_run_it_replaced(c: Any) -> None:
    dpublish(c, "t1", delay_ms=5000)
    dsettle(c, "t1", "published")
    due = c.hget(DREC, "due_ms")
    dpublish(c, "t2", delay_ms=9000)
    assert dsettle(c, "t2", "failed") == 1
    rec = c.hgetall(DREC)
    assert (rec["task_id"], rec["state"], rec["due_ms"], rec["superseded"]) == ("t1", "queued", due, "0")
    assert "prev_id" not in rec
    assert dsettle(c, "t2", "failed") == 0  # not named any more: nothing written


def test_debounce_settle_failed_without_a_replaced_run_clears_the_pending_one(c: Any) -> None:
    dpublish(c, "t1")
    assert dsettle(c, "t1", "failed") == 1
    assert c.hget(DREC, "task_id") == ""
    assert dpublish(c, "t2") == ["t2", ""]  # nothing pending: a new burst


def test_debounce_settle_failed_of_a_replaced_publish_is_forgotten_as_prev(c: Any) -> None:
    dpublish(c, "t1")
    dpublish(c, "t2")
    dpublish(c, "t3")  # prev is t2
    assert dsettle(c, "t2", "failed") == 1 and c.hget(DREC, "prev_id") is None
    assert dsettle(c, "t3", "failed") == 1 and c.hget(DREC, "task_id") == ""
    # The burst now has no pending run and no run: its older messages find nothing and run (never lost).
    assert dtake(c, "t1", "t1") == ["missing", ""]


def test_debounce_take_early_then_due_then_taken(c: Any) -> None:
    dpublish(c, "t1", delay_ms=60_000)
    answer, ms = dtake(c, "t1", "t1")
    assert answer == "early" and 0 < int(ms) <= 60_000
    c.hset(DREC, "due_ms", 0)
    assert dtake(c, "t1", "t1", ttl_ms=30_000) == ["take", ""]
    run = debounce_run_name(P, "k", "n", "t1")
    assert c.get(run) == "t1" and 0 < c.pttl(run) <= 30_000
    assert (c.hget(DREC, "task_id"), c.hget(DREC, "last_run")) == ("", "t1")
    assert dtake(c, "t1", "t1") == ["taken", ""]  # a redelivery of the burst's run
    assert dpublish(c, "t9") == ["t9", ""]  # a publish after the take starts a new burst


def test_debounce_take_superseded_names_the_pending_run_then_the_run_it_became(c: Any) -> None:
    dpublish(c, "t1")
    dpublish(c, "t2")
    dsettle(c, "t2", "published")
    assert dtake(c, "t1", "t1") == ["superseded", "t2"]
    assert dtake(c, "t2", "t1") == ["take", ""]
    dpublish(c, "t3")  # a new burst is pending now
    assert dtake(c, "t1", "t1") == ["superseded", "t2"]  # late: still the run of its own burst


def test_debounce_take_awaits_a_replacing_publish_in_flight_until_the_grace(c: Any) -> None:
    dpublish(c, "t1")
    dsettle(c, "t1", "published")
    dpublish(c, "t2")  # publishing, not yet settled
    assert dtake(c, "t1", "t1") == ["await", "t2"]
    assert dtake(c, "t1", "t1", grace_ms=0) == ["superseded", "t2"]  # past the grace: taken as published


def test_debounce_take_wrong_id_or_burst_and_missing_keys(c: Any) -> None:
    assert dtake(c, "t1", "t1") == ["missing", ""]  # no record, no run
    assert not c.exists(DREC) and not c.exists(debounce_run_name(P, "k", "n", "t1"))
    dpublish(c, "t5")
    assert dtake(c, "t1", "other-burst") == ["missing", ""]  # a burst the record does not know
    assert c.hget(DREC, "task_id") == "t5"  # and nothing written


def test_debounce_take_after_the_record_expired_reads_the_run_key(c: Any) -> None:
    dpublish(c, "t1")
    dpublish(c, "t2")
    dsettle(c, "t2", "published")
    assert dtake(c, "t2", "t1") == ["take", ""]
    c.delete(DREC)  # expired or evicted
    assert dtake(c, "t1", "t1") == ["superseded", "t2"]
    assert dtake(c, "t2", "t1") == ["taken", ""]
    c.delete(debounce_run_name(P, "k", "n", "t1"))
    assert dtake(c, "t1", "t1") == ["missing", ""]


def dstart(c: Any, task_id: str, burst: str, grace_ms: int = 15_000) -> list[str]:
    run = debounce_run_name(P, "k", "n", burst)
    return [str(x) for x in scripts.debounce_start(c, [DREC, run], [task_id, grace_ms])]


def test_debounce_start_runs_the_taken_run_once_marked_started(c: Any) -> None:
    dpublish(c, "t1")
    dsettle(c, "t1", "published")
    assert dtake(c, "t1", "t1") == ["take", ""]
    assert dstart(c, "t1", "t1") == ["run", ""]
    assert c.hget(DREC, "started") == "t1"
    dpublish(c, "t2")  # a publish once the body started: one more run after it, this one still runs
    assert dstart(c, "t1", "t1") == ["run", ""]  # a redelivery of the started run


def test_debounce_start_a_taken_run_waiting_for_the_lease_is_replaced_by_a_later_publish(c: Any) -> None:
    dpublish(c, "t1")
    dsettle(c, "t1", "published")
    assert dtake(c, "t1", "t1") == ["take", ""]
    dpublish(c, "t2")  # while t1 waited for the lease: still in flight
    assert dstart(c, "t2", "t1") == ["run", ""]  # not the burst's taken run: nothing to check
    assert dstart(c, "t1", "t1") == ["await", "t2"]
    assert dstart(c, "t1", "t1", grace_ms=0) == ["superseded", "t2"]
    dsettle(c, "t2", "published")
    assert dstart(c, "t1", "t1") == ["superseded", "t2"]
    assert dtake(c, "t2", "t2") == ["take", ""]  # t2's burst taken too: t1 is replaced by the newer run
    assert dstart(c, "t1", "t1") == ["superseded", "t2"]
    assert dstart(c, "t2", "t2") == ["run", ""]
    assert c.hget(DREC, "started") == "t2"


def test_debounce_start_wrong_id_missing_record_or_run_key_runs(c: Any) -> None:
    assert dstart(c, "t1", "t1") == ["run", ""]  # nothing at all: run, never lose one
    dpublish(c, "t1")
    dsettle(c, "t1", "published")
    dtake(c, "t1", "t1")
    dpublish(c, "t2")
    dsettle(c, "t2", "published")
    assert dstart(c, "tX", "t1") == ["run", ""]  # not the run its burst took
    c.delete(DREC)
    assert dstart(c, "t1", "t1") == ["run", ""]  # record gone: run
    assert not c.exists(DREC), "nothing written without a record"


def dkeep(c: Any, task_id: str, burst: str, ttl_ms: int) -> int:
    return int(scripts.debounce_keep(c, [DREC, debounce_run_name(P, "k", "n", burst)], [task_id, ttl_ms]))


def test_debounce_keep_extends_the_taken_runs_keys_never_shortens_and_ignores_others(c: Any) -> None:
    run = debounce_run_name(P, "k", "n", "t1")
    assert dkeep(c, "t1", "t1", 60_000) == 0  # missing keys: nothing written
    assert not c.exists(DREC) and not c.exists(run)
    dpublish(c, "t1")
    dsettle(c, "t1", "published")
    dtake(c, "t1", "t1")
    assert dkeep(c, "tX", "t1", 60_000) == 0  # not the burst's run (wrong id): nothing written
    assert c.pttl(run) <= 60_000
    assert dkeep(c, "t1", "t1", 3_600_000) == 1
    assert 3_500_000 < c.pttl(run) <= 3_600_000 and 3_500_000 < c.pttl(DREC) <= 3_600_000
    assert dkeep(c, "t1", "t1", 1_000) == 1  # never shortened
    assert c.pttl(run) > 3_500_000 and c.pttl(DREC) > 3_500_000
    c.delete(DREC)  # the record expired: only the run key is kept, no record made
    assert dkeep(c, "t1", "t1", 7_200_000) == 1 and not c.exists(DREC) and c.pttl(run) > 7_000_000
    c.delete(run)  # expired run key: nothing to keep
    assert dkeep(c, "t1", "t1", 60_000) == 0 and not c.exists(run)


@pytest.mark.parametrize(
    "name", ["debounce_publish", "debounce_settle", "debounce_take", "debounce_start", "debounce_keep"]
)
def test_noscript_after_script_flush_reloads_the_debounce_scripts(c: Any, name: str) -> None:
    dpublish(c, "t1")
    c.script_flush()
    if name == "debounce_publish":
        assert dpublish(c, "t2") == ["t1", "t1"]
    elif name == "debounce_settle":
        assert dsettle(c, "t1", "published") == 1
    elif name == "debounce_take":
        assert dtake(c, "t1", "t1") == ["take", ""]
    elif name == "debounce_keep":
        assert dkeep(c, "t1", "t1", 60_000) == 0  # not taken yet: answered, after the reload
    else:
        assert dstart(c, "t1", "t1") == ["run", ""]
    assert c.script_exists(getattr(scripts, name).sha) == [True]


# -- the single lease and the slots of one entity: exclusive and shared (issue 29 item 12) ------------------


def plain(c: Any, key: str = "e", **kw: Any) -> Any:
    """ACQUIRE (the single lease) on the entity the slot tests use."""
    return take(c, key=key, **kw)


def commands(c: Any) -> dict[str, int]:
    """Calls per command on this server so far (commands a script runs count too)."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()}


def test_a_held_slot_refuses_the_single_lease_and_reports_it_as_a_waitable_holder(c: Any) -> None:
    s0 = slots(c, limit=2, task_id="e0")
    s1 = slots(c, limit=2, task_id="e1", ttl_ms=8000)
    assert (s0.slot, s1.slot) == (0, 1)
    assert isinstance(plain(c, task_id="d"), L.Holder)  # slot 0 is {K}:lock itself: held as before
    L.release(c, s0, P)
    fences = c.get(fence_name(P, "e"))
    met = plain(c, task_id="d", digest="dd")
    assert isinstance(met, L.Holder), "the single lease ran beside slot 1"
    assert (met.task_id, met.slot, met.busy, met.token) == ("e1", 1, 1, s1.token) and 4000 < met.pttl_ms <= 8000
    assert met.ttl_ms == 8000 and met.state == "running"
    assert not c.exists(lock_name(P, "e")) and c.get(fence_name(P, "e")) == fences, "nothing written"
    # An adopting replace_token (an until_done claim, a woken reservation) is refused by a held slot too.
    c.hset(lock_name(P, "e"), mapping={"token": "claim", "task_id": "d", "state": "queued"})
    c.pexpire(lock_name(P, "e"), 5000)
    assert isinstance(plain(c, task_id="d", replace_token="claim"), L.Holder)
    assert c.hget(lock_name(P, "e"), "token") == "claim"
    c.delete(lock_name(P, "e"))
    assert L.release(c, s1, P) == (1, 0)
    got = plain(c, task_id="d")
    assert isinstance(got, L.Lease), "every slot free: the single lease is taken"


def test_the_single_lease_waits_for_the_slot_that_frees_last_and_an_expired_slot_frees_it(c: Any) -> None:
    slots(c, limit=3, task_id="e0", ttl_ms=60_000)
    s1 = slots(c, limit=3, task_id="e1", ttl_ms=9000)
    s2 = slots(c, limit=3, task_id="e2", ttl_ms=300)
    c.delete(lock_name(P, "e"))  # slot 0 expired
    met = plain(c)
    assert isinstance(met, L.Holder) and met.slot == 1 and met.busy == 2 and met.task_id == "e1"
    c.delete(s1.redis_key)  # expired too
    wait_for(lambda: not c.exists(s2.redis_key), 5, what="slot 2 to expire")
    assert isinstance(plain(c), L.Lease), "expired slots hold nothing"


def test_the_uncontended_path_reads_the_fence_once_and_a_release_nobody_waits_for_reads_no_time(c: Any) -> None:
    """Issue 33: ACQUIRE reads the fence counter once (the check and the advance share the read); RELEASE
    reads the server's TIME only when a waiter is queued (the wake needs it), never on the uncontended path."""
    plain(c, key="warm", scope="warm")  # loads the script
    before = commands(c)
    lease = plain(c, key="once", scope="once")
    after = commands(c)
    assert isinstance(lease, L.Lease)
    assert after["get"] - before.get("get", 0) == 2, "the completion record and the fence counter, once each"
    assert after["time"] - before.get("time", 0) == 1, "ACQUIRE floors the fence by the server's TIME"
    before = commands(c)
    assert L.release_and_wake(c, lease, P, "once", '{"result":1}', 10_000, reserve_ms=5000)[:2] == (1, 1)
    after = commands(c)
    assert after.get("time", 0) == before.get("time", 0), "nobody waits: the release reads no TIME"
    assert after["lindex"] - before.get("lindex", 0) == 1, "the one look at the waiter queue"
    # A corrupt counter is still refused before anything is written, from the same single read.
    c.set(fence_name(P, "bad"), "nope")
    with pytest.raises(CorruptFence):
        plain(c, key="bad")
    assert not c.exists(lock_name(P, "bad"))


def test_the_single_lease_acquire_is_one_round_trip_and_one_exists_on_a_plain_entity(c: Any) -> None:
    plain(c, key="warm")  # loads the script
    before = commands(c)
    lease = plain(c, key="plain")
    after = commands(c)
    assert isinstance(lease, L.Lease)
    assert after["evalsha"] - before.get("evalsha", 0) == 1
    assert after.get("exists", 0) - before.get("exists", 0) == 1, "the slot check costs one EXISTS"
    # With lock_limit slots on the entity: still one round trip.
    a, b = slots(c, limit=2, key="lim"), slots(c, limit=2, key="lim")
    L.release(c, a, P)
    before = commands(c)
    assert isinstance(plain(c, key="lim"), L.Holder)
    assert commands(c)["evalsha"] - before["evalsha"] == 1
    L.release(c, b, P)


def test_the_single_lease_refuses_every_slot_even_with_slots_free(c: Any) -> None:
    d = plain(c, task_id="d", digest="dd")
    met = slots(c, limit=3, task_id="e", digest="ee")
    assert isinstance(met, L.Holder), "a slot was taken beside the single lease"
    assert (met.task_id, met.slot) == ("d", 0) and met.token == d.token
    assert not c.exists(f"{P}:v1:{{e}}:lock:1") and not c.exists(f"{P}:v1:{{e}}:fence:1"), "nothing written"
    # a waiter's reservation, an until_done claim or a workflow lease in {K}:lock are exclusive holders too
    L.release(c, d, P)
    c.hset(lock_name(P, "e"), mapping={"token": "p1", "task_id": "w", "state": "handed"})
    c.pexpire(lock_name(P, "e"), 3000)
    assert isinstance(slots(c, limit=3), L.Holder)
    c.delete(lock_name(P, "e"))
    # identical work in a slot is still met first (the duplicate rule), and a slot-0 holder is shared
    e0 = slots(c, limit=3, task_id="e0", digest="same")
    assert isinstance(e0, L.Lease) and c.hget(lock_name(P, "e"), "slot") == "0"
    assert isinstance(slots(c, limit=3, task_id="e1"), L.Lease)
    dup = slots(c, limit=3, task_id="e2", digest="same")
    assert isinstance(dup, L.Holder) and dup.task_id == "e0"


def test_park_behind_slots_only_parks_with_the_slots_ttl(c: Any) -> None:
    slots(c, limit=2, task_id="e0")
    s1 = slots(c, limit=2, task_id="e1", ttl_ms=7000)
    c.delete(lock_name(P, "e"))  # slot 0 gone: only slot 1 is held
    parked = park(c, "p1", key="e")
    assert parked.kind == "parked" and 5000 < parked.pttl_ms <= 7000
    assert c.lrange(wait_name(P, "e"), 0, -1) == ["p1"]
    L.release(c, s1, P)  # no reservation asked: the waiter stays
    assert park(c, "p2", key="e").kind == "free", "no lease and no slot: acquire now"


def test_the_last_slot_release_wakes_the_single_lease_waiter_into_k_lock(c: Any) -> None:
    s0, s1 = slots(c, limit=2, task_id="e0"), slots(c, limit=2, task_id="e1")
    assert isinstance(plain(c, task_id="d"), L.Holder)
    assert park(c, "p1", key="e", task_id="d").kind == "parked"
    # Slot 1 goes first: slot 0 is still held, nobody is woken.
    assert L.release_and_wake(c, s1, P, reserve_ms=3000) == (1, 0, None)
    assert c.lrange(wait_name(P, "e"), 0, -1) == ["p1"]
    # A wrong token or an expired slot wakes nobody.
    impostor = L.Lease("e", P, "not-the-token", 1, 5000, 0.0, "t9", "n", slot=0)
    assert L.release_and_wake(c, impostor, P, reserve_ms=3000) == (-1, 0, None)
    # The last slot (slot 0, {K}:lock) goes: the entity is wholly free and handed to the waiter.
    released, _, woken = L.release_and_wake(c, s0, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "p1"
    held = c.hgetall(lock_name(P, "e"))
    assert (held["token"], held["state"], held["task_id"]) == ("p1", "handed", "d") and "slot" not in held
    assert isinstance(slots(c, limit=2), L.Holder), "the reservation is exclusive: no export barges in"
    adopted = plain(c, task_id="d", replace_token="p1")
    assert isinstance(adopted, L.Lease)


def test_a_slot_above_zero_released_last_hands_k_lock_to_the_waiter(c: Any) -> None:
    s0, s1 = slots(c, limit=2, task_id="e0"), slots(c, limit=2, task_id="e1")
    park(c, "p1", key="e", task_id="d")
    L.release(c, s0, P)
    released, _, woken = L.release_and_wake(c, s1, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "p1"
    assert c.hget(lock_name(P, "e"), "token") == "p1" and not c.exists(s1.redis_key)
    # An expired (missing) slot lease wakes nobody.
    L.release(c, L.Lease("e", P, "p1", 0, 3000, 0.0, "d", "n"), P)
    park(c, "p2", key="e")  # no holder: free
    assert L.release_and_wake(c, s1, P, reserve_ms=3000) == (0, 0, None)


@pytest.mark.parametrize("name", ["acquire", "acquire_slots", "release", "park"])
def test_noscript_reload_of_the_scripts_that_read_slots_and_the_single_lease(c: Any, name: str) -> None:
    s1 = slots(c, limit=2, task_id="e0"), slots(c, limit=2, task_id="e1")
    c.delete(lock_name(P, "e"))
    c.script_flush()
    if name == "acquire":
        assert isinstance(plain(c), L.Holder)
    elif name == "acquire_slots":
        assert isinstance(slots(c, limit=2), L.Lease)
    elif name == "release":
        assert L.release_and_wake(c, s1[1], P, reserve_ms=3000) == (1, 0, None)
    else:
        assert park(c, "p1", key="e").kind == "parked"
    assert c.script_exists(getattr(scripts, name).sha) == [True]


def test_a_workflow_first_member_is_refused_by_a_held_slot_and_slots_by_the_workflow(c: Any) -> None:
    """The workflow lease is exclusive on K like the single lease: never beside a lock_limit slot."""
    from .test_workflow import KEY, enter, spec

    s0 = slots(c, limit=2, key=KEY, task_id="e0")
    s1 = slots(c, limit=2, key=KEY, task_id="e1")
    L.release(c, s0, P)  # only slot 1 is held
    met = enter(c, spec(), "m1")
    assert met.kind == "held" and met.holder is not None and (met.holder.task_id, met.holder.slot) == ("e1", 1)
    assert not c.exists(lock_name(P, KEY)), "nothing written"
    L.release(c, s1, P)
    assert enter(c, spec(), "m1").kind == "started"
    assert isinstance(slots(c, limit=2, key=KEY), L.Holder), "no slot beside the running workflow"


# -- every lease end wakes: FORCE_RELEASE, WAKE, PARK and RELEASE on slots --------------------------------


def test_force_release_wakes_the_oldest_waiter_into_the_freed_lease_and_bumps_the_fence(c: Any) -> None:
    lease = take(c)
    park(c, "p1", task_id="w1")
    park(c, "p2", task_id="w2")
    deleted, fence, holder, woken = L.force_release(c, P, "k", 60_000, reserve_ms=3000)
    assert deleted and holder == "t1" and fence > lease.fence
    assert woken is not None and (woken.key, woken.park_token) == ("k", "p1") and '"id":"p1"' in woken.message
    held = c.hgetall(lock_name(P, "k"))
    assert (held["token"], held["state"], held["task_id"]) == ("p1", "handed", "w1")
    assert 0 < c.pttl(lock_name(P, "k")) <= 3000
    assert c.hget(waiters_name(P, "k"), "s:p1") == "waking" and c.lrange(wait_name(P, "k"), 0, -1) == ["p2"]
    # the evicted holder's late release finds another token: it wakes nobody and leaves the reservation
    assert L.release_and_wake(c, lease, P, reserve_ms=3000) == (-1, 0, None)
    adopted = take(c, task_id="w1", replace_token="p1")
    assert isinstance(adopted, L.Lease) and adopted.fence > fence, "the woken waiter's fence is above the bump"


def test_force_release_of_a_missing_lease_still_wakes_and_without_reserve_wakes_nobody(c: Any) -> None:
    lease = take(c)
    park(c, "p1")
    assert L.force_release(c, P, "k", 60_000)[3] is None, "reserve_ms 0: nobody woken"
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1"] and not c.exists(lock_name(P, "k"))
    deleted, _, holder, woken = L.force_release(c, P, "k", 60_000, reserve_ms=3000)  # already free
    assert not deleted and holder == "" and woken is not None and woken.park_token == "p1"
    assert lease.fence < int(c.get(fence_name(P, "k")))


def test_force_release_of_one_slot_reserves_that_slot_for_the_waiter(c: Any) -> None:
    from celery_lockguard._keys import slot_lock_name

    a, b = slots(c, limit=2, key="k"), slots(c, limit=2, key="k")
    parked = handoff.park(c, P, "k", "p1", '{"id":"p1"}', task_id="w", task_name="n", digest="d", countdown=5, limit=2)
    assert parked.kind == "parked"
    _, _, _, woken = L.force_release(c, P, "k", 60_000, slot=1, reserve_ms=3000)
    assert woken is not None and c.hget(slot_lock_name(P, "k", 1), "token") == "p1"
    took = slots(c, limit=2, key="k", task_id="w", replace_token="p1")
    assert isinstance(took, L.Lease) and took.slot == 1 and c.hget(a.redis_key, "token") == a.token
    assert b.slot == 1


def test_wake_answers_held_while_every_lease_is_taken_and_wakes_once_one_is_free(c: Any) -> None:
    take(c, ttl_ms=60_000)
    park(c, "p1", task_id="w1")
    assert L.wake_if_free(c, P, "k", 3000) is None
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1"] and c.hget(lock_name(P, "k"), "task_id") == "t1"
    c.pexpire(lock_name(P, "k"), 1)  # cut to a grace by the main process, which then ran out
    wait_for(lambda: not c.exists(lock_name(P, "k")), 5, what="the shortened lease to expire")
    woken = L.wake_if_free(c, P, "k", 3000)
    assert woken is not None and woken.park_token == "p1"
    assert c.hget(lock_name(P, "k"), "state") == "handed" and c.hget(waiters_name(P, "k"), "s:p1") == "waking"
    assert L.wake_if_free(c, P, "k", 3000) is None, "the reservation holds the entity now"


def test_wake_on_a_missing_key_with_no_waiter_writes_nothing(c: Any) -> None:
    assert scripts.wake(c, [wait_name(P, "k"), waiters_name(P, "k"), lock_name(P, "k")], [3000]) == ["none"]
    assert not c.exists(lock_name(P, "k")) and not c.exists(wait_name(P, "k"))


def test_wake_skips_stale_entries_and_reserves_the_first_free_slot(c: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_lockguard._keys import slot_lock_name

    a, b = slots(c, limit=2, key="k"), slots(c, limit=2, key="k")
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 0.0)
    assert handoff.park(c, P, "k", "old", "{}", task_id="o", task_name="n", digest="d", countdown=0.05, limit=2).kind
    monkeypatch.setattr(handoff, "ENTRY_SLACK", 30.0)
    handoff.park(c, P, "k", "live", '{"id":"live"}', task_id="l", task_name="n", digest="d", countdown=5, limit=2)
    wait_for(lambda: _stale(c, "old"), 5, what="stale entry")
    assert L.wake_if_free(c, P, "k", 3000, limit=2) is None  # both slots taken
    c.delete(b.redis_key)  # slot 1 expired
    woken = L.wake_if_free(c, P, "k", 3000, limit=2)
    assert woken is not None and woken.park_token == "live" and c.hget(slot_lock_name(P, "k", 1), "token") == "live"
    assert c.hget(a.redis_key, "token") == a.token and not c.hexists(waiters_name(P, "k"), "m:old")


def test_park_behind_slots_parks_only_while_every_slot_is_taken(c: Any) -> None:
    def park_slots(p: str) -> handoff.Parked:
        return handoff.park(c, P, "k", p, "{}", task_id="w", task_name="n", digest="d", countdown=5, limit=2)

    a = slots(c, limit=2, key="k", ttl_ms=60_000)
    assert park_slots("p0").kind == "free", "slot 1 is free: acquire now"
    b = slots(c, limit=2, key="k", ttl_ms=2_000)
    got = park_slots("p1")
    assert got.kind == "parked" and 0 < got.pttl_ms <= 2_000, "the pttl is the slot that frees first"
    assert c.lrange(wait_name(P, "k"), 0, -1) == ["p1"]
    released, _, woken = L.release_and_wake(c, b, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "p1"
    assert c.hget(b.redis_key, "token") == "p1" and c.hget(a.redis_key, "token") == a.token


# -- shared (lock_limit) and exclusive (single lease) waiters in one queue ----------------------------------


def park_shared(c: Any, p: str, key: str = "e", limit: int = 2, task_id: str = "w") -> handoff.Parked:
    """PARK as a lock_limit task's waiter: behind all ``limit`` slots (a shared waiter)."""
    message = f'{{"task":"n","id":"{p}"}}'
    return handoff.park(c, P, key, p, message, task_id=task_id, task_name="n", digest="dw", countdown=5.0, limit=limit)


def test_an_exclusive_head_waiter_holds_the_queue_until_the_entity_is_wholly_free(c: Any) -> None:
    s0, s1 = slots(c, limit=2, task_id="e0"), slots(c, limit=2, task_id="e1")
    assert park(c, "x1", key="e", task_id="d").kind == "parked"  # the single lease: exclusive
    assert park_shared(c, "s1").kind == "parked"  # a third export: shared, behind both slots
    assert c.hget(waiters_name(P, "e"), "k:s1") == "s" and c.hget(waiters_name(P, "e"), "k:x1") is None
    # Slot 1 frees: the head is exclusive and slot 0 still held, so nobody is woken (nor the export behind it).
    assert L.release_and_wake(c, s1, P, reserve_ms=3000) == (1, 0, None)
    assert c.lrange(wait_name(P, "e"), 0, -1) == ["x1", "s1"]
    # Slot 0 frees: wholly free, the exclusive head gets {K}:lock (no 'slot' field: exclusive).
    released, _, woken = L.release_and_wake(c, s0, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "x1"
    held = c.hgetall(lock_name(P, "e"))
    assert held["token"] == "x1" and "slot" not in held
    d = take(c, key="e", task_id="d", replace_token="x1")
    assert isinstance(d, L.Lease)
    # The single lease ends: the shared waiter is woken into {K}:lock as slot 0, a shared reservation.
    released, _, woken = L.release_and_wake(c, d, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "s1"
    assert c.hget(lock_name(P, "e"), "slot") == "0"
    assert isinstance(slots(c, limit=2, task_id="e9"), L.Lease), "a shared reservation refuses no other slot"
    assert isinstance(slots(c, limit=2, task_id="w", replace_token="s1"), L.Lease)  # the woken export adopts it


def test_a_shared_waiter_parks_behind_an_exclusive_holder_although_slots_are_free(c: Any) -> None:
    d = take(c, key="e", task_id="d")
    assert isinstance(d, L.Lease)
    parked = park_shared(c, "s1", limit=3)
    assert parked.kind == "parked" and parked.pttl_ms > 0, "slot 1 and 2 are free, but the single lease refuses them"
    released, _, woken = L.release_and_wake(c, d, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "s1"
    assert park_shared(c, "s2", limit=3).kind == "free", "slot 0 reserved as a slot: slots 1 and 2 free"


def test_a_free_slot_wakes_no_shared_waiter_while_the_single_lease_holds_k_lock(c: Any) -> None:
    # RELEASE of a slot already gone (a discarded woken copy frees its reservation slot by slot) and WAKE on a
    # free slot must not reserve slot 1 for a shared waiter beside the single lease: they exclude each other.
    d = take(c, key="e", task_id="d")
    assert isinstance(d, L.Lease)
    assert park_shared(c, "s1").kind == "parked"
    slot1 = lock_name(P, "e") + ":1"
    assert L.release_token(c, P, "e", "gone", reserve_ms=3000, lease_key=slot1, slot=1) == (0, 0, None)
    assert L.wake_if_free(c, P, "e", 3000, 2) is None
    assert not c.exists(slot1) and c.lrange(wait_name(P, "e"), 0, -1) == ["s1"]
    assert c.hget(lock_name(P, "e"), "task_id") == "d"
    released, _, woken = L.release_and_wake(c, d, P, reserve_ms=3000)  # its end wakes the waiter, into slot 0
    assert released == 1 and woken is not None and woken.park_token == "s1"
    assert c.hget(lock_name(P, "e"), "slot") == "0"


def test_a_shared_head_waiter_is_woken_into_the_very_slot_that_came_free(c: Any) -> None:
    s0, s1 = slots(c, limit=2, task_id="e0"), slots(c, limit=2, task_id="e1")
    assert park_shared(c, "s1").kind == "parked"
    released, _, woken = L.release_and_wake(c, s1, P, reserve_ms=3000)
    assert released == 1 and woken is not None and woken.park_token == "s1"
    assert c.hget(s1.redis_key, "token") == "s1" and c.hget(s1.redis_key, "slot") == "1"
    assert c.hget(lock_name(P, "e"), "token") == s0.token, "slot 0 untouched"
