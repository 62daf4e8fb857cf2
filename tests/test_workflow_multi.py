"""Workflows over several entities without workers: the WORKFLOW_* scripts with N lease hashes on the test's own
server (all or none, one token, one fence per entity, the state mirrored on every entity), ``workflow()``'s
build, an eager run and the lock-order check across every entity."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, chain

from celery_lockguard import ConfigurationError, LockedTask, WorkflowDeadlock, workflow
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _workflow as wf
from celery_lockguard._headers import WORKFLOW
from celery_lockguard._keys import fence_name, lock_name, workflows_ended_name
from celery_lockguard.exceptions import CorruptFence
from celery_lockguard.testing import RedisServer

P = "lg"
A, B = "acc:1", "acc:2"
KEYS = (A, B)


@pytest.fixture
def c(own_redis: RedisServer) -> Any:
    return own_redis.client()


def spec(index: int = 0, **over: Any) -> wf.Spec:
    fields: dict[str, Any] = {
        "id": "wf1",
        "key": A,
        "keys": KEYS,
        "name": "workflow:xfer",
        "digest": "d1",
        "ttl_ms": 5000,
        "gap_ms": 2000,
        "index": index,
        "count": 3,
        "on_locked": "skip",
        "on_unavailable": "fail_closed",
        "max_waits": 100,
        "max_hold": 3600.0,
    }
    fields.update(over)
    return wf.Spec(**fields)


def enter(c: Any, s: wf.Spec, task_id: str, token: str = "tok1", take_over: bool = False) -> wf.Entry:
    request = SimpleNamespace(id=task_id, task="xfer.step", hostname="w1@host")
    return wf.enter(c, SimpleNamespace(key_prefix=P, fence_ttl=86400.0), s, request, token, take_over)


def names() -> list[str]:
    return [lock_name(P, k) for k in KEYS]


def pass_on(c: Any, token: str, index: int, gap_ms: int = 2000, waits_on: str = "") -> int:
    return int(scripts.workflow_pass(c, names(), [token, wf.slot(index), gap_ms, waits_on]))


def abort(c: Any, wid: str, task_id: str, index: int, grace_ms: int = 500) -> int:
    return int(scripts.workflow_abort(c, names(), [wid, task_id, grace_ms, wf.slot(index)]))


def state(c: Any, field: str) -> list[Any]:
    return [c.hget(n, field) for n in names()]


def plain(c: Any, key: str, task_id: str = "x") -> Any:
    return L.acquire(
        c, P, key, ttl_ms=5000, task_id=task_id, task_name="plain", digest="d", worker="w", fence_ttl_ms=60_000
    )


# -- scripts ------------------------------------------------------------------------------------------------


def test_the_first_member_takes_every_entity_on_one_token_with_a_fence_each_and_later_members_enter_all(
    c: Any,
) -> None:
    started = enter(c, spec(), "m1")
    assert started.kind == "started" and started.token == "tok1" and started.fences is not None
    assert set(started.fences) == {A, B} and all(f > 0 for f in started.fences.values())
    for key, other in ((A, B), (B, A)):
        h = c.hgetall(lock_name(P, key))
        assert h["token"] == "tok1" and h["workflow"] == "wf1" and h["state"] == "running" and h["task_id"] == "m1"
        assert int(h["fence"]) == started.fences[key] and json.loads(h["siblings"]) == [other]
        assert int(c.get(fence_name(P, key))) == started.fences[key]
    assert pass_on(c, "tok1", 1) == 1
    assert state(c, "state") == ["gap", "gap"] and state(c, "next") == ["#1", "#1"]
    assert all(0 < c.pttl(n) <= 2000 for n in names())  # every entity held through the gap
    assert enter(c, spec(index=2), "m3", token="other").kind == "passed"
    entered = enter(c, spec(index=1), "m2", token="ignored")
    assert (entered.kind, entered.token, entered.fences) == ("entered", "tok1", started.fences)
    assert state(c, "task_id") == ["m2", "m2"] and all(c.pttl(n) > 2000 for n in names())
    lease = wf.new_lease(spec(index=1), SimpleNamespace(key_prefix=P), entered, time.monotonic(), "m2")
    assert isinstance(lease, L.MultiLease) and lease.fences == started.fences
    assert L.renew(c, [lease]) == [1]  # the renewer renews every entity in its one round trip


def test_a_held_entity_makes_the_first_member_take_none_and_names_it(c: Any) -> None:
    held = plain(c, B)
    got = enter(c, spec(), "m1")
    assert got.kind == "held" and got.holder is not None and got.holder.entity == B
    assert got.holder.task_name == "plain" and got.holder.pttl_ms > 0
    assert not c.exists(lock_name(P, A)) and not c.exists(fence_name(P, A))  # no partial hold, no fence drawn
    with pytest.raises(Exception) as err:
        raise wf._contention_error(SimpleNamespace(name="t"), spec(), got.holder, None)
    assert B in str(err.value)
    L.release(c, held, P)
    assert enter(c, spec(), "m1").kind == "started"


def test_a_later_member_is_lost_when_any_entity_of_the_workflow_is_gone(c: Any) -> None:
    enter(c, spec(), "m1")
    pass_on(c, "tok1", 1)
    c.delete(lock_name(P, B))  # forced away, or expired
    assert enter(c, spec(index=1), "m2").kind == "lost"
    c.delete(lock_name(P, A))
    assert enter(c, spec(index=1), "m2").kind == "lost" and not c.exists(lock_name(P, A))


def test_pass_and_waits_on_with_a_wrong_token_expired_or_missing_entity_write_nothing(c: Any) -> None:
    assert pass_on(c, "tok1", 1) == 0 and not any(c.exists(n) for n in names())
    enter(c, spec(), "m1")
    assert pass_on(c, "nope", 1) == 0 and state(c, "state") == ["running", "running"]
    assert scripts.workflow_waits_on(c, names(), ["nope", "inv:1"]) == 0
    assert scripts.workflow_waits_on(c, names(), ["tok1", "inv:1"]) == 1 and state(c, "waits_on") == ["inv:1"] * 2
    c.pexpire(lock_name(P, B), 1)  # one entity's lease expires
    deadline = time.monotonic() + 5
    while c.exists(lock_name(P, B)) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pass_on(c, "tok1", 1) == 0 and c.hget(lock_name(P, A), "state") == "running"  # nothing written on A
    assert scripts.workflow_waits_on(c, names(), ["tok1", "inv:2"]) == 0 and state(c, "waits_on")[0] == "inv:1"
    assert scripts.workflow_leave(c, names(), ["tok1", "#0", 2000]) == -1


def test_a_chord_page_leaving_updates_every_entity(c: Any) -> None:
    enter(c, spec(parallel=True, width=2), "p1")
    assert enter(c, spec(parallel=True, width=2), "p2").kind == "entered"
    assert state(c, "active") == ["2", "2"]
    assert scripts.workflow_leave(c, names(), ["tok1", "#0", 3000, "1", "", 2]) == 1
    assert state(c, "active") == ["1", "1"] and state(c, "left") == ["1", "1"]
    assert scripts.workflow_leave(c, names(), ["tok1", "#0", 2000, "1", "", 2]) == 0
    assert state(c, "state") == ["gap", "gap"] and state(c, "next") == ["#0", "#0"]
    assert all(2000 < c.pttl(n) <= 3000 for n in names())  # the longest gap asked, on both


def test_abort_frees_every_entity_in_a_gap_and_cuts_a_running_member_on_all(c: Any) -> None:
    enter(c, spec(), "m1")
    assert abort(c, "other", "m1", 0) == 0 and abort(c, "wf1", "m9", 0) == 0
    assert abort(c, "wf1", "m1", 0, grace_ms=300) == 1 and all(0 < c.pttl(n) <= 300 for n in names())
    for n in names():
        c.delete(n)
    enter(c, spec(), "m1")
    pass_on(c, "tok1", 1)
    assert abort(c, "wf1", "m2", 1) == 1 and not any(c.exists(n) for n in names())
    assert abort(c, "wf1", "m2", 1) == 0  # missing keys


def forfeit(c: Any, who: str, wid: str = "wf1", token: str = "tok1", left: bool = False) -> list[tuple[int, str]]:
    flat = scripts.workflow_forfeit(c, names(), [wid, who, "" if who == "enter" else token, "1" if left else ""])
    return [(int(flat[i]), str(flat[i + 1])) for i in range(0, len(flat), 2)]


def test_forfeit_names_the_entities_still_the_workflows_once_nothing_runs_under_them(c: Any) -> None:
    """One entity gone: the others, still W's, are named for release -- by the member ending (``pass``), by a
    member entering only while they wait in the gap (``enter``), by the last chord page out (``leave``)."""
    assert forfeit(c, "pass") == [] and forfeit(c, "enter") == []  # missing keys: nothing
    enter(c, spec(), "m1")
    c.delete(lock_name(P, A))  # the anchor forced away
    assert forfeit(c, "pass", wid="other") == []  # another workflow's id: nothing
    assert forfeit(c, "pass", token="tok-stale") == [], "a delivery taken over: its stale token frees nothing"
    assert forfeit(c, "enter") == [], "a member runs under B: it ends it itself"
    assert forfeit(c, "pass") == [(2, "tok1")]
    assert c.hget(lock_name(P, B), "token") == "tok1", "named, not written: RELEASE frees it and wakes its waiter"
    pass_on_b = scripts.workflow_pass(c, [lock_name(P, B)], ["tok1", wf.slot(1), 2000, ""])
    assert int(pass_on_b) == 1 and c.hget(lock_name(P, B), "state") == "gap"
    assert forfeit(c, "enter") == [(2, "tok1")], "in the gap: the member that finds the loss ends it"


def test_forfeit_by_a_chord_page_waits_for_the_last_page(c: Any) -> None:
    enter(c, spec(parallel=True, width=2), "p1")
    enter(c, spec(parallel=True, width=2), "p2")
    c.delete(lock_name(P, B))  # forced away while both pages run
    assert forfeit(c, "enter") == []
    assert forfeit(c, "leave") == [] and c.hget(lock_name(P, A), "active") == "1", "one page still runs"
    assert forfeit(c, "leave", left=True) == [] and c.hget(lock_name(P, A), "active") == "1", "not counted twice"
    assert forfeit(c, "leave") == [(1, "tok1")]


def test_abort_decides_on_an_entity_still_the_workflows_when_the_anchor_is_gone(c: Any) -> None:
    enter(c, spec(), "m1")
    c.delete(lock_name(P, A))  # the anchor forced away
    assert abort(c, "wf1", "m1", 0, grace_ms=300) == 1 and 0 < c.pttl(lock_name(P, B)) <= 300
    hold = plain(c, A, task_id="other")  # another holder on the anchor now: left alone
    assert abort(c, "wf1", "m1", 0, grace_ms=100) == 1 and c.pttl(lock_name(P, A)) > 1000
    assert c.hget(lock_name(P, A), "token") == hold.token


def test_a_take_over_draws_a_new_fence_on_every_entity(c: Any) -> None:
    first = enter(c, spec(), "m1")
    again = enter(c, spec(), "m1", token="tok2")
    assert again.kind == "self" and again.fences == first.fences
    taken = enter(c, spec(), "m1", token="tok2", take_over=True)
    assert taken.kind == "entered" and taken.token == "tok2" and taken.fences is not None and first.fences is not None
    assert all(taken.fences[k] > first.fences[k] for k in KEYS) and state(c, "token") == ["tok2", "tok2"]
    assert pass_on(c, "tok1", 1) == 0


def test_fences_rise_per_entity_past_plain_tasks_and_the_end_wakes_nobody_twice(c: Any) -> None:
    lease = plain(c, B)
    L.release(c, lease, P)
    started = enter(c, spec(), "m1")
    assert started.fences is not None and started.fences[B] > lease.fence
    ended = scripts.workflow_end(c, [workflows_ended_name(P, A)], ["wf1", 60_000])
    assert ended == 1
    for n in names():
        c.delete(n)
    assert enter(c, spec(), "m1", token="tok9").kind == "ended"  # recorded on the anchor, read there


def test_a_corrupt_fence_of_any_entity_refuses_before_writing(c: Any) -> None:
    c.set(fence_name(P, B), "not-a-number")
    with pytest.raises(CorruptFence) as err:
        enter(c, spec(), "m1")
    assert err.value.key == fence_name(P, B)
    assert not any(c.exists(n) for n in names()) and not c.exists(fence_name(P, A))


@pytest.mark.parametrize(
    "name",
    ["workflow_enter", "workflow_pass", "workflow_leave", "workflow_abort", "workflow_waits_on", "workflow_forfeit"],
)
def test_noscript_after_script_flush_reloads_the_multi_entity_workflow_scripts(c: Any, name: str) -> None:
    enter(c, spec(), "m1")
    c.script_flush()
    if name == "workflow_enter":
        assert enter(c, spec(), "m1").kind == "self"
    elif name == "workflow_pass":
        assert pass_on(c, "tok1", 1) == 1 and state(c, "state") == ["gap", "gap"]
    elif name == "workflow_leave":
        assert scripts.workflow_leave(c, names(), ["tok1", wf.slot(0), 2000]) == 0
    elif name == "workflow_waits_on":
        assert scripts.workflow_waits_on(c, names(), ["tok1", "inv:7"]) == 1
    elif name == "workflow_forfeit":
        assert forfeit(c, "pass") == [(1, "tok1"), (2, "tok1")]
    else:
        assert abort(c, "wf1", "m1", 0) == 1
    assert c.script_exists(getattr(scripts, name).sha) == [True]


# -- workflow() ---------------------------------------------------------------------------------------------


def test_workflow_takes_several_entities_sorted_and_one_entity_named_twice_is_one() -> None:
    app = Celery("wfm-unit", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"  # never reached: one Redis, no Cluster slots to check

    @app.task(base=LockedTask, shared=False, name="wfm.step")
    def step(a: int = 0) -> int:
        return a

    w = workflow(chain(step.s(1), step.s()), lock_key=("acc:{src}", "acc:{dst}"), src=6, dst=5)
    s = w.spec()
    assert (s.key, s.keys, s.entities) == ("acc:5", ("acc:5", "acc:6"), ("acc:5", "acc:6"))
    header = s.header()
    assert header["keys"] == ["acc:5", "acc:6"] and wf.Spec.from_header(header, "t").keys == s.keys
    assert [m.options["headers"][WORKFLOW]["keys"] for m in w._canvas(None, None, {}).tasks] == [["acc:5", "acc:6"]] * 2
    one = workflow(chain(step.s(1)), lock_key=("acc:{src}", "acc:{dst}"), src=5, dst=5).spec()
    assert (one.key, one.keys) == ("acc:5", ()) and "keys" not in one.header()  # one entity: as before
    # the same pair named in the other order is the same set
    other = workflow(chain(step.s(1), step.s()), lock_key=("acc:{src}", "acc:{dst}"), src=5, dst=6)
    assert other.spec().keys == s.keys and other._fields["digest"] == w._fields["digest"]
    with pytest.raises(ConfigurationError, match="not valid"):
        wf.Spec.from_header({**header, "keys": ["acc:9", "acc:6"]}, "t")  # the anchor must be the first key


def test_an_eager_workflow_over_two_entities_holds_both_with_a_fence_each_and_releases_both(
    own_redis: RedisServer,
) -> None:
    app = Celery("wfm-eager", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    c = own_redis.client()
    seen: list[tuple[Any, ...]] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="wfm.step")
    def step(self: Any, prev: Any = None, tag: str = "") -> list[str]:
        seen.append(
            (
                self.lock.keys,
                tuple(sorted(self.lock.fences.items())),
                self.lock.held,
                c.hget(lock_name(P, "a:2"), "token"),
            )
        )
        return [*(prev or []), tag]

    @app.task(base=LockedTask, bind=True, shared=False, name="wfm.boom")
    def boom(self: Any, prev: Any = None) -> None:
        raise RuntimeError("boom")

    keys2 = ("a:{src}", "a:{dst}")
    w = workflow(chain(step.s(tag="x"), step.s(tag="y")), lock_key=keys2, src=2, dst=1)
    assert w.apply_async().get() == ["x", "y"]
    assert len(seen) == 2 and len(set(seen)) == 1
    keys_, fences, held, token = seen[0]
    assert keys_ == ("a:1", "a:2") and [k for k, _ in fences] == ["a:1", "a:2"] and held and token
    assert not c.exists(lock_name(P, "a:1")) and not c.exists(lock_name(P, "a:2"))
    with pytest.raises(RuntimeError, match="boom"):
        workflow(chain(step.s(tag="x"), boom.s(), step.s(tag="z")), lock_key=keys2, src=1, dst=2).apply_async().get()
    assert not c.exists(lock_name(P, "a:1")) and not c.exists(lock_name(P, "a:2"))  # the failure released both
    assert len(seen) == 3 and dict(seen[2][1])["a:2"] > dict(fences)["a:2"]  # fences rise per entity


def test_the_lock_order_check_follows_every_entity_of_both_workflows(own_redis: RedisServer) -> None:
    """W1 holds (acc:1, acc:2) and its member is about to wait for inv:9; W2 holds (inv:9, acc:7) and waits on
    acc:2, the second of W1's entities: a cycle through a non-anchor entity, refused."""
    app = Celery("wfm-order", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    c = own_redis.client()
    mine = spec()
    entry = enter(c, mine, "m1")
    theirs = spec(id="wf2", key="acc:7", keys=("acc:7", "inv:9"), digest="d2")
    enter(c, theirs, "n1", token="tok2")
    assert scripts.workflow_waits_on(c, [lock_name(P, k) for k in theirs.keys], ["tok2", B]) == 1
    lease = wf.new_lease(mine, SimpleNamespace(key_prefix=P), entry, time.monotonic(), "m1")
    request = SimpleNamespace(id="m1", headers={WORKFLOW: mine.header()})
    setattr(request, wf.WORKFLOW_LEASE, lease)
    task = SimpleNamespace(request=request, name="xfer.step", app=app)
    wf.check_lock_order(task, B)  # one of our own entities: never a wait, nothing checked
    with pytest.raises(WorkflowDeadlock):
        wf.check_lock_order(task, "inv:9")
    assert state(c, "waits_on") == ["inv:9", "inv:9"]  # recorded on every entity of ours


def test_on_redis_cluster_a_workflow_over_entities_in_different_slots_is_refused_at_build() -> None:
    app = Celery("wfm-cluster", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url="redis://127.0.0.1:1/0", lockguard_redis_cluster=True)  # never connected

    @app.task(base=LockedTask, shared=False, name="wfm.step")
    def step(a: int = 0) -> int:
        return a

    with pytest.raises(ConfigurationError) as err:
        workflow(chain(step.s(1)), lock_key=("acc:{src}", "acc:{dst}"), src=1, dst=2)
    text = str(err.value)
    assert "lock_key=('acc:{src}', 'acc:{dst}')" in text and "Cluster slots" in text and "one task" in text
    assert workflow(chain(step.s(1)), lock_key=("acc:{src}", "acc:{dst}"), src=1, dst=1).spec().key == "acc:1"
