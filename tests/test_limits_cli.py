"""lock_limit / lock_rate as an operator sees them: `locks` (slots held N/M, window use), `release --slot`,
`describe` and `stats`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_lockguard import LockedTask
from celery_lockguard import _connection as connection
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import reset
from celery_lockguard._keys import slot_lock_name

pytestmark = pytest.mark.integration


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("limitscli", broker=redis_url, set_as_current=False)
    a.conf.update(lockguard_redis_url=redis_url, lockguard_key_prefix=prefix)

    @a.task(base=LockedTask, shared=False, name="exports.run", lock_key="tenant:{t}", lock_limit=3, lock_rate="10/m")
    def run(t: str) -> None: ...

    yield a
    reset(a)
    connection.forget_clients()


def invoke(app: Celery, *args: str) -> Result:
    from celery_lockguard._cli import lockguard

    return CliRunner().invoke(lockguard, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))


def take(r: redis.Redis, prefix: str, task_id: str) -> Any:
    got = L.acquire(
        r, prefix, "tenant:a", ttl_ms=30_000, task_id=task_id, task_name="exports.run", digest=task_id,
        worker="w@h", fence_ttl_ms=60_000, limit=3, rate=(10, 60_000),
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    return got


def test_locks_shows_every_slot_and_the_entity_use(app: Celery, r: redis.Redis, prefix: str) -> None:
    first, second = take(r, prefix, "t-1"), take(r, prefix, "t-2")
    L.release(r, first, prefix)
    third = take(r, prefix, "t-3")  # slot 0 again
    out = invoke(app, "locks")
    assert out.exit_code == 0, out.output
    assert "tenant:a (slot 1)" in out.stdout and "t-2" in out.stdout and "t-3" in out.stdout
    assert "tenant:a: 2/3 slots held, 3/10 starts in the last 60s" in out.stdout
    rows = json.loads(invoke(app, "locks", "--json").stdout)
    assert sorted((x["slot"], x["task_id"], x["limit"]) for x in rows) == [(0, "t-3", 3), (1, "t-2", 3)]
    assert third.slot == 0 and second.slot == 1


def test_release_slot_evicts_that_slot_only_and_bumps_its_own_fence(app: Celery, r: redis.Redis, prefix: str) -> None:
    zero, one = take(r, prefix, "t-1"), take(r, prefix, "t-2")
    out = invoke(app, "release", "tenant:a", "--slot", "1", "--yes")
    assert out.exit_code == 0, out.output
    assert "released 'tenant:a' slot 1 (was t-2)" in out.stdout
    assert not r.exists(slot_lock_name(prefix, "tenant:a", 1)) and r.exists(one.redis_key) == 0
    assert r.hget(zero.redis_key, "token") == zero.token  # the other slot's holder is untouched
    assert int(r.get(f"{prefix}:v1:{{tenant:a}}:fence:1") or 0) > one.fence
    full = invoke(app, "release", slot_lock_name(prefix, "tenant:a", 0), "--yes")  # a full key names its slot
    assert full.exit_code == 0 and not r.exists(zero.redis_key)
    clash = invoke(app, "release", slot_lock_name(prefix, "tenant:a", 2), "--slot", "1", "--yes")
    assert clash.exit_code != 0 and "contradicts" in clash.output


def test_describe_and_stats_show_limit_rate_admitted_and_throttled(app: Celery, r: redis.Redis, prefix: str) -> None:
    rows = json.loads(invoke(app, "describe", "--json").stdout)
    (row,) = [x for x in rows if x["task"] == "exports.run"]
    assert (row["lock_limit"], row["lock_rate"]) == (3, "10/m")
    assert "while_running, 3 slots, 10/m starts" in invoke(app, "describe").stdout
    metrics.count("exports.run", "lock.admitted", 3)
    metrics.count("exports.run", "lock.throttled", 1)
    metrics.flush(r, prefix)
    summary = json.loads(invoke(app, "stats", "--json").stdout)
    total = summary["tasks"]["exports.run"]["windows"]["total"]
    assert (total["admitted"], total["throttled"], total["throttle_rate"]) == (3, 1, 0.25)
    assert any("throttled by lock_rate" in x for x in summary["tasks"]["exports.run"]["readings"])
    text = invoke(app, "stats", "--prometheus").stdout
    assert 'lockguard_events_total{task="exports.run",event="lock.throttled"} 1' in text


def test_locks_shows_a_window_that_holds_starts_while_no_slot_is_held(app: Celery, r: redis.Redis, prefix: str) -> None:
    """A throttled entity between bodies: no lease row carries its rate, so `locks` said nothing (review)."""
    for i in range(2):
        L.release(r, take(r, prefix, f"t-{i}"), prefix)
    # A window left by a task this app does not know: its starts, without a rate to measure them against.
    L.release(r, L.acquire(r, prefix, "other:1", ttl_ms=30_000, task_id="o", task_name="gone.task", digest="d",
                           worker="w@h", fence_ttl_ms=60_000, rate=(5, 60_000)), prefix)  # fmt: skip
    out = invoke(app, "locks")
    assert out.exit_code == 0, out.output
    assert "tenant:a: 0/3 slots held, 2/10 starts in the last 60s" in out.stdout.splitlines()
    assert "other:1: 0/? slots held, 1 start recorded (no task of this app names its lock_rate)" in out.stdout
    rows = {row["key"]: row for row in json.loads(invoke(app, "locks", "--json").stdout)}
    assert rows["tenant:a"] == {
        "key": "tenant:a", "redis_key": f"{prefix}:v1:{{tenant:a}}:rate", "state": "window", "held": 0,
        "limit": 3, "rate": 10, "window_ms": 60_000, "starts": 2,
    }  # fmt: skip
    assert rows["other:1"]["rate"] is None and rows["other:1"]["starts"] == 1
    assert invoke(app, "locks", "--match", "other:*").stdout.count("start recorded") == 1


def test_the_page_shows_slots_held_and_the_windows_fill(app: Celery, r: redis.Redis, prefix: str) -> None:
    """Issue 30: the page showed slot leases under one key and no `N/M slots held` or window fill (`locks` did)."""
    from celery_lockguard import _page_html as html
    from celery_lockguard._config import settings
    from celery_lockguard._page_state import PageState

    first, _ = take(r, prefix, "t-1"), take(r, prefix, "t-2")
    L.release(r, first, prefix)
    take(r, prefix, "t-3")
    state = PageState(app, settings(app), interval=1, doctor_interval=3600)
    state.refresh()
    section = html.leases_section(state.snapshot)
    assert "tenant:a (slot 1)" in section
    assert "tenant:a: 2/3 slots held, 3/10 starts in the last 60s" in section
    (use,) = state.snapshot.as_dict()["limited_entities"]
    assert (use["held"], use["limit"], use["starts"], use["rate"]) == (2, 3, 3, 10)


def test_describe_finds_a_slot_held_above_a_lowered_lock_limit(app: Celery, r: redis.Redis, prefix: str) -> None:
    """A deploy lowered lock_limit 5 -> 3 (this app's) while a body of the old deploy holds slot 3: `describe KEY`
    read slots 0..2 only and left it out (`locks` showed it), though it still counts against the entity."""

    def old(task_id: str) -> L.Lease:  # a worker of the earlier deploy: lock_limit 5
        got = L.acquire(
            r, prefix, "tenant:a", ttl_ms=30_000, task_id=task_id, task_name="exports.run", digest=task_id,
            worker="old@h", fence_ttl_ms=60_000, limit=5,
        )  # fmt: skip
        assert isinstance(got, L.Lease)
        return got

    held = [old(f"t-old-{i}") for i in range(4)]
    for lease in held[:3]:
        L.release(r, lease, prefix)
    assert held[3].slot == 3
    new = take(r, prefix, "t-new")  # the new deploy (lock_limit 3) takes slot 0
    assert new.slot == 0
    rows = json.loads(invoke(app, "describe", "tenant:a", "--json").stdout)
    assert [(x["slot"], x["task_id"], x["limit"]) for x in rows] == [(0, "t-new", 3), (3, "t-old-3", 5)]
    assert "above_limit" not in rows[0] and (rows[1]["above_limit"], rows[1]["current_limit"]) == (True, 3)
    out = invoke(app, "describe", "tenant:a")
    assert out.exit_code == 0, out.output
    assert "tenant:a (slot 3)" in out.stdout and "t-old-3" in out.stdout
    assert "tenant:a (slot 3) is above the current lock_limit of exports.run (3)" in out.stdout
    L.release(r, new, prefix)  # slots 0..2 all free: still found, by the slot fence counters
    (row,) = json.loads(invoke(app, "describe", "tenant:a", "--json").stdout)
    assert (row["slot"], row["task_id"]) == (3, "t-old-3")
    assert "is free" not in invoke(app, "describe", "tenant:a").stdout


def test_describe_reads_an_entity_s_slots_by_name_without_scan() -> None:
    """The slots past the app's largest lock_limit are found by the entity's own fence counters, not a SCAN of
    the keyspace: as a user refused SCAN, and for a key whose text is a glob (``t:*`` names itself only)."""
    from celery_lockguard import acl
    from celery_lockguard._holders import read_entity
    from celery_lockguard.testing import RedisServer

    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "ro", *acl.rule("p", setinfo=False).split(), "-scan", ">pw")

        def old(key: str, i: int) -> L.Lease:  # a worker of an earlier deploy: lock_limit 40
            got = L.acquire(
                admin, "p", key, ttl_ms=30_000, task_id=f"{key}-{i}", task_name="exports.run", digest=f"{key}-{i}",
                worker="old@h", fence_ttl_ms=60_000, limit=40,
            )  # fmt: skip
            assert isinstance(got, L.Lease)
            return got

        for key in ("t:*", "t:x"):
            held = [old(key, i) for i in range(36)]  # slots 0..35; slot 35 stays, past one step of 32 counters
            for lease in held[:35]:
                L.release(admin, lease, "p")
        user = redis.Redis(port=server.port, username="ro", password="pw", decode_responses=True)
        (row,) = read_entity(user, "p", "t:*", slots=3)
        assert (row.key, row.slot, row.task_id) == ("t:*", 35, "t:*-35")
        assert read_entity(user, "p", "t:?", slots=3) == []
        assert [e for e in admin.acl_log() if e.get("username") == "ro"] == []
