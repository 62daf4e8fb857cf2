"""RELEASE_MULTI and KEEP_BEFORE on a server out of memory (``maxmemory``, ``noeviction``): all or nothing.

Both scripts write to several entities in one call, after checking every key's type first so that a
WRONGTYPE stops them before any write. An out-of-memory server is the other refusal that could stop a
script between two writes. Redis 7 and Valkey refuse a script's write for OOM only while the script has
written nothing yet (``scriptVerifyOOM``: a script "can't stop in the middle"), so each call either changes
nothing (its first write is refused) or runs to its end, and every write after the first one goes through.
These tests pin that, through the scripts as lockguard sends them:

* RELEASE_MULTI with a completion record: the record is its first write; refused, so both leases and the
  waiter queue stay as they were. The entities lapse by their TTL, late but not lost, as for any failed
  release.
* RELEASE_MULTI without a record: its first write is a ``DEL``, which OOM does not refuse. Both leases are
  freed, and the waiter on one of them gets its reservation, although that is an ``HSET``.
* KEEP_BEFORE keeping the first entity: its first write is the ``HSET`` that re-tokens it; refused, so
  nothing is kept and nothing is given back.
* KEEP_BEFORE giving everything back: a ``DEL`` first, then the whole call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_lockguard import _scripts as scripts
from celery_lockguard._keys import done_name, lock_name, wait_name, waiters_name
from celery_lockguard.testing import RedisServer

from .harness import wait_for
from .test_errors import bare

PREFIX = "oom"
TOKEN = "t-holder"
WAITER = "p-waiter"
RESERVE_MS = 30_000


def _names(*entities: str) -> list[str]:
    out: list[str] = []
    for entity in entities:
        out += [lock_name(PREFIX, entity), wait_name(PREFIX, entity), waiters_name(PREFIX, entity)]
    return out


def _hold(c: redis.Redis, entity: str, token: str = TOKEN) -> None:
    key = lock_name(PREFIX, entity)
    c.hset(key, mapping={"token": token, "task_id": "t1", "task_name": "oom.task", "state": "running"})
    c.pexpire(key, 60_000)


def _park(c: redis.Redis, entity: str, park_token: str = WAITER) -> None:
    """A live exclusive waiter parked on ``entity`` (the fields RELEASE's wake reads)."""
    deadline = int(time.time() * 1000) + 60_000
    c.rpush(wait_name(PREFIX, entity), park_token)
    c.hset(
        waiters_name(PREFIX, entity),
        mapping={
            f"s:{park_token}": "parked",
            f"d:{park_token}": deadline,
            f"m:{park_token}": "{}",
            f"t:{park_token}": "t2",
            f"n:{park_token}": "oom.task",
            f"g:{park_token}": "0" * 16,
            f"k:{park_token}": "",
        },
    )


def _fill(c: redis.Redis) -> None:
    """Write until the server refuses a write for memory."""
    filled = [0]

    def full() -> bool:
        try:
            c.set(f"fill:{filled[0]}", "x" * 20_000)
        except redis.exceptions.OutOfMemoryError:
            return True
        filled[0] += 1
        return False

    wait_for(full, 30, interval=0, what="the server to be full")


@pytest.fixture
def full_server() -> Iterator[redis.Redis]:
    """A private server with entities a, b (held, a waiter parked on b) and c, d (held), then filled up."""
    with RedisServer(extra=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) as server:
        c = bare(server)  # decodes replies (RedisServer.client)
        for entity in "abcd":
            _hold(c, entity)
        _park(c, "b")
        # Load both scripts while there is room (a call that matches no token writes nothing).
        scripts.release_multi(c, _names("x"), ["nobody", "", 0, 0, 1])
        scripts.keep_before(c, _names("x"), ["nobody", "n", 1000, 0, 1, 0])
        _fill(c)
        yield c


def _state(c: redis.Redis, *entities: str) -> dict[str, object]:
    return {
        e: (
            c.hget(lock_name(PREFIX, e), "token"),
            c.lrange(wait_name(PREFIX, e), 0, -1),
            c.pttl(lock_name(PREFIX, e)) > 0,
        )
        for e in entities
    }


def test_release_multi_refused_at_its_record_changes_nothing(full_server: redis.Redis) -> None:
    c = full_server
    before = _state(c, "a", "b")
    done = done_name(PREFIX, "task:t1")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        scripts.release_multi(c, [*_names("a", "b"), done], [TOKEN, '{"ok":1}', 60_000, RESERVE_MS, 2])
    assert (
        _state(c, "a", "b")
        == before
        == {
            "a": (TOKEN, [], True),
            "b": (TOKEN, [WAITER], True),
        }
    )
    assert c.exists(done) == 0
    assert c.hget(waiters_name(PREFIX, "b"), f"s:{WAITER}") == "parked"


def test_release_multi_without_a_record_frees_both_and_wakes_the_waiter(full_server: redis.Redis) -> None:
    c = full_server
    recorded, released, woken = scripts.release_multi(c, _names("a", "b"), [TOKEN, "", 0, RESERVE_MS, 2])
    assert (recorded, released) == (0, [1, 1])
    assert woken == [2, WAITER, "{}"]  # entity 2 (b): its waiter's park token and entry
    assert c.exists(lock_name(PREFIX, "a")) == 0
    # The wake's writes after the first DEL went through although the server is full.
    assert c.hget(lock_name(PREFIX, "b"), "token") == WAITER
    assert c.hget(lock_name(PREFIX, "b"), "state") == "handed"
    assert c.lrange(wait_name(PREFIX, "b"), 0, -1) == []
    assert c.hget(waiters_name(PREFIX, "b"), f"s:{WAITER}") == "waking"


def test_keep_before_refused_at_its_first_keep_changes_nothing(full_server: redis.Redis) -> None:
    c = full_server
    before = _state(c, "c", "d")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        # keep c (sorted before the blocker d), give back d
        scripts.keep_before(c, _names("c", "d"), [TOKEN, "t-new", 45_000, RESERVE_MS, 2, 1])
    assert _state(c, "c", "d") == before == {"c": (TOKEN, [], True), "d": (TOKEN, [], True)}
    assert c.hget(lock_name(PREFIX, "c"), "state") == "running"


def test_keep_before_giving_everything_back_runs_whole(full_server: redis.Redis) -> None:
    c = full_server
    codes, woken = scripts.keep_before(c, _names("c", "d"), [TOKEN, "", 45_000, RESERVE_MS, 2, 0])
    assert (codes, woken) == ([1, 1], [])
    assert c.exists(lock_name(PREFIX, "c"), lock_name(PREFIX, "d")) == 0
