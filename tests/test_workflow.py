"""Workflows without workers: the WORKFLOW_* scripts on the test's own server, the member decision table,
and ``workflow()``'s validation and the headers it puts on each member."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, chain, group

from celery_lockguard import ConfigurationError, LockedTask, workflow
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _workflow as wf
from celery_lockguard._config import settings
from celery_lockguard._decision import HolderFacts, Member, MemberAction, decide_member
from celery_lockguard._headers import WORKFLOW
from celery_lockguard._holders import read_leases
from celery_lockguard._keys import fence_name, lock_name, workflows_ended_name
from celery_lockguard.exceptions import CorruptFence
from celery_lockguard.testing import RedisServer

P = "lg"
KEY = "tenant:a:pipeline"


@pytest.fixture
def c(own_redis: RedisServer) -> Any:
    return own_redis.client()


def spec(index: int = 0, **over: Any) -> wf.Spec:
    fields: dict[str, Any] = {
        "id": "wf1",
        "key": KEY,
        "name": "workflow:etl",
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


def member(task_id: str, name: str = "etl.step") -> Any:
    return SimpleNamespace(id=task_id, task=name, hostname="w1@host")


def settings_for(c: Any) -> Any:
    return SimpleNamespace(key_prefix=P, fence_ttl=86400.0)


def enter(c: Any, s: wf.Spec, task_id: str, token: str = "tok1", take_over: bool = False) -> wf.Entry:
    return wf.enter(c, settings_for(c), s, member(task_id), token, take_over)


def pass_on(c: Any, token: str, index: int, gap_ms: int = 2000) -> int:
    return int(scripts.workflow_pass(c, [lock_name(P, KEY)], [token, wf.slot(index), gap_ms]))


def abort(c: Any, wid: str, task_id: str, index: int, grace_ms: int = 500) -> int:
    return int(scripts.workflow_abort(c, [lock_name(P, KEY)], [wid, task_id, grace_ms, wf.slot(index)]))


def end(c: Any, wid: str, window_ms: int = 60_000) -> int:
    return int(scripts.workflow_end(c, [workflows_ended_name(P, KEY)], [wid, window_ms]))


# -- scripts --------------------------------------------------------------------------------


def test_every_workflow_script_declares_keys_argv_and_returns() -> None:
    for script in (
        scripts.WORKFLOW_ENTER,
        scripts.WORKFLOW_PASS,
        scripts.WORKFLOW_LEAVE,
        scripts.WORKFLOW_END,
        scripts.WORKFLOW_ABORT,
        scripts.WORKFLOW_WAITS_ON,
    ):
        header = "\n".join(line for line in script.strip().splitlines() if line.startswith("--"))
        assert "KEYS[" in header and "ARGV[" in header and "Returns" in header


def test_the_first_member_starts_later_members_enter_with_the_same_token_and_fence(c: Any) -> None:
    started = enter(c, spec(), "m1")
    assert started.kind == "started" and started.token == "tok1" and started.fence > 0
    fields = c.hgetall(lock_name(P, KEY))
    assert fields["workflow"] == "wf1" and fields["task_name"] == "workflow:etl" and fields["task_id"] == "m1"
    assert fields["member"] == "etl.step" and fields["state"] == "running"
    assert pass_on(c, "tok1", 1) == 1
    assert c.hget(lock_name(P, KEY), "state") == "gap" and 0 < c.pttl(lock_name(P, KEY)) <= 2000
    # only the member in the next slot may enter (a stale copy of the first is told apart); no token is
    # carried by the member (it is read from the hash)
    assert enter(c, spec(index=2), "m3", token="other").kind == "passed"
    assert enter(c, spec(index=0), "m1", token="other").kind == "passed"
    entered = enter(c, spec(index=1), "m2", token="ignored")
    assert (entered.kind, entered.token, entered.fence) == ("entered", "tok1", started.fence)
    assert c.hget(lock_name(P, KEY), "task_id") == "m2" and c.pttl(lock_name(P, KEY)) > 2000
    # the lease is renewed by token like any other
    lease = L.Lease(KEY, P, "tok1", started.fence, 5000, time.monotonic(), "m2", "workflow:etl")
    assert L.renew(c, [lease]) == [1]


def test_a_stale_copy_of_a_member_of_an_ended_workflow_is_told_ended_and_writes_nothing(c: Any) -> None:
    started = enter(c, spec(), "m1")
    assert end(c, "wf1") == 1  # the last member marks the end, then releases
    # while the lease is still the workflow's, its members enter as before
    assert pass_on(c, "tok1", 1) == 1
    assert enter(c, spec(index=1), "m2").kind == "entered"
    c.delete(lock_name(P, KEY))
    # released: a redelivered first member must not start the workflow again, nor a middle one fail it
    assert enter(c, spec(), "m1", token="tok9").kind == "ended"
    assert enter(c, spec(index=1), "m2", token="tok9").kind == "ended"
    assert not c.exists(lock_name(P, KEY))
    assert int(c.get(fence_name(P, KEY)) or 0) == started.fence  # no fence drawn
    # another workflow on the entity is not affected, and the window trims old ids
    assert enter(c, spec(id="wf2"), "n1", token="tok2").kind == "started"
    c.delete(lock_name(P, KEY))
    assert end(c, "wf2", window_ms=1) == 1
    wait = time.monotonic() + 5
    while c.zscore(workflows_ended_name(P, KEY), "wf1") is not None and time.monotonic() < wait:
        end(c, "wf3", window_ms=1)
    assert c.zscore(workflows_ended_name(P, KEY), "wf1") is None


def test_a_redelivery_of_the_running_member_sees_itself_and_takes_over_with_a_new_fence(c: Any) -> None:
    first = enter(c, spec(), "m1")
    again = enter(c, spec(), "m1", token="tok2")
    assert again.kind == "self" and again.holder is not None and again.holder.pid == os.getpid()
    assert c.hget(lock_name(P, KEY), "token") == "tok1"  # nothing written
    taken = enter(c, spec(), "m1", token="tok2", take_over=True)
    assert taken.kind == "entered" and taken.token == "tok2" and taken.fence > first.fence
    # the earlier delivery can neither renew nor hand on any more
    old = L.Lease(KEY, P, "tok1", first.fence, 5000, time.monotonic(), "m1", "workflow:etl")
    assert L.renew(c, [old]) == [0]
    assert pass_on(c, "tok1", 1) == 0


def test_another_holder_is_held_for_the_first_member_and_lost_for_a_later_one(c: Any) -> None:
    L.acquire(c, P, KEY, ttl_ms=5000, task_id="x", task_name="plain", digest="dx", worker="w", fence_ttl_ms=60_000)
    held = enter(c, spec(), "m1")
    assert held.kind == "held" and held.holder is not None and held.holder.task_name == "plain"
    assert held.holder.ttl_ms == 5000 and held.holder.pttl_ms > 0
    assert enter(c, spec(index=1), "m2").kind == "held"
    c.delete(lock_name(P, KEY))
    assert enter(c, spec(index=1), "m2").kind == "lost"  # expired or missing: not started again
    assert not c.exists(lock_name(P, KEY))


def test_pass_with_the_wrong_token_or_an_expired_lease_writes_nothing(c: Any) -> None:
    assert pass_on(c, "tok1", 1) == 0 and not c.exists(lock_name(P, KEY))
    enter(c, spec(), "m1")
    assert pass_on(c, "nope", 1) == 0
    assert c.hget(lock_name(P, KEY), "state") == "running"


def test_abort_frees_a_gap_at_once_and_cuts_a_running_member_to_the_grace(c: Any) -> None:
    enter(c, spec(), "m1")
    assert abort(c, "other-wf", "m1", 0) == 0 and abort(c, "wf1", "m9", 0) == 0
    assert abort(c, "wf1", "m1", 0, grace_ms=300) == 1 and 0 < c.pttl(lock_name(P, KEY)) <= 300
    c.delete(lock_name(P, KEY))
    enter(c, spec(), "m1")
    pass_on(c, "tok1", 1)
    assert abort(c, "wf1", "m1", 0) == 0  # the member that handed on is no longer the one the lease waits for
    assert abort(c, "wf1", "m2", 1) == 1 and not c.exists(lock_name(P, KEY))
    assert abort(c, "wf1", "m2", 1) == 0  # missing key


def test_fences_of_workflows_increase_with_the_tasks_on_the_same_entity(c: Any) -> None:
    plain = L.acquire(c, P, KEY, ttl_ms=5000, task_id="x", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000)
    assert isinstance(plain, L.Lease)
    L.release(c, plain, P)
    started = enter(c, spec(), "m1")
    assert started.fence > plain.fence and int(c.get(fence_name(P, KEY))) == started.fence


def test_enter_refuses_a_corrupt_fence_before_writing(c: Any) -> None:
    c.set(fence_name(P, KEY), "not-a-number")
    with pytest.raises(CorruptFence):
        enter(c, spec(), "m1")
    assert not c.exists(lock_name(P, KEY))


@pytest.mark.parametrize(
    "name", ["workflow_enter", "workflow_pass", "workflow_leave", "workflow_end", "workflow_abort", "workflow_waits_on"]
)
def test_noscript_after_script_flush_reloads_the_workflow_scripts(c: Any, name: str) -> None:
    enter(c, spec(), "m1")
    c.script_flush()
    if name == "workflow_enter":
        assert enter(c, spec(), "m1").kind == "self"
    elif name == "workflow_pass":
        assert pass_on(c, "tok1", 1) == 1
    elif name == "workflow_leave":
        assert scripts.workflow_leave(c, [lock_name(P, KEY)], ["tok1", wf.slot(0), 2000]) == 0
    elif name == "workflow_end":
        assert end(c, "wf1") == 1
    elif name == "workflow_waits_on":
        assert scripts.workflow_waits_on(c, [lock_name(P, KEY)], ["tok1", "invoice:7"]) == 1
    else:
        assert abort(c, "wf1", "m1", 0) == 1
    assert c.script_exists(getattr(scripts, name).sha) == [True]


def test_lockguard_locks_shows_the_workflow_as_one_holder_with_its_member(c: Any) -> None:
    enter(c, spec(), "m1")
    (row,) = read_leases(c, P)
    assert (row.task_name, row.task_id, row.member, row.workflow_id) == ("workflow:etl", "m1", "etl.step", "wf1")
    assert row.malformed == ()
    pass_on(c, "tok1", 1)
    (row,) = read_leases(c, P)
    assert row.state == "gap" and row.malformed == () and row.as_dict()["workflow_id"] == "wf1"


# -- the decision -----------------------------------------------------------------------------

ALIVE_OTHER = HolderFacts(own_id=False, duplicate=False, alive=True)
ALIVE_SAME = HolderFacts(own_id=False, duplicate=True, alive=True)
DEAD_SAME = HolderFacts(own_id=False, duplicate=True, alive=False)


@pytest.mark.parametrize(
    ("entry", "first", "on_locked", "holder", "waits", "expected"),
    [
        ("started", True, "skip", None, 0, MemberAction.RUN),
        ("entered", False, "skip", None, 0, MemberAction.RUN),
        ("passed", False, "skip", None, 0, MemberAction.DROP),
        ("ended", True, "skip", None, 0, MemberAction.DROP),
        ("ended", False, "skip", None, 0, MemberAction.DROP),
        ("self", False, "skip", HolderFacts(own_id=True, duplicate=True, alive=True), 0, MemberAction.DROP),
        ("self", False, "skip", HolderFacts(own_id=True, duplicate=True, alive=False), 0, MemberAction.ADOPT),
        (
            "self",
            True,
            "skip",
            HolderFacts(own_id=True, duplicate=True, alive=False, dead_here=True),
            0,
            MemberAction.ADOPT,
        ),
        ("lost", False, "skip", None, 0, MemberAction.LOST),
        ("held", False, "skip", ALIVE_OTHER, 0, MemberAction.LOST),
        ("held", True, "skip", ALIVE_SAME, 0, MemberAction.SKIP_WORKFLOW),
        ("held", True, "skip", DEAD_SAME, 0, MemberAction.WAIT),
        ("held", True, "skip", ALIVE_OTHER, 0, MemberAction.WAIT),
        ("held", True, "retry", ALIVE_SAME, 0, MemberAction.WAIT),
        ("held", True, "raise", ALIVE_OTHER, 0, MemberAction.RAISE),
        ("held", True, "skip", ALIVE_OTHER, 5, MemberAction.GIVE_UP),
        ("unavailable", True, "skip", None, 0, MemberAction.WAIT),
        ("unavailable", False, "skip", None, 5, MemberAction.GIVE_UP),
        ("misconfigured", False, "skip", None, 0, MemberAction.MISCONFIGURED),
    ],
)
def test_decide_member(entry: Any, first: bool, on_locked: Any, holder: Any, waits: int, expected: Any) -> None:
    got = decide_member(Member(entry, first, on_locked, "fail_closed", holder=holder, waits=waits, max_waits=5))
    assert got.action is expected, got


def test_decide_member_fails_open_only_on_an_outage() -> None:
    outage = Member("unavailable", False, "skip", "fail_open")
    assert decide_member(outage).action is MemberAction.FAIL_OPEN
    assert decide_member(Member("lost", False, "skip", "fail_open")).action is MemberAction.LOST
    with pytest.raises(ValueError):
        decide_member(Member("self", False, "skip", "fail_closed"))


# -- workflow() -----------------------------------------------------------------------------------


@pytest.fixture
def app() -> Celery:
    app = Celery("wf-unit", broker="memory://", set_as_current=False)
    app.conf.lockguard_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=LockedTask, bind=True, shared=False, name="etl.fetch")
    def fetch(self: Any, tenant: str) -> str:
        return tenant

    @app.task(base=LockedTask, bind=True, shared=False, name="etl.load")
    def load(self: Any, prev: Any) -> Any:
        return prev

    @app.task(shared=False, name="etl.plain")
    def plain_task(prev: Any = None) -> Any:
        return prev

    return app


def test_workflow_puts_one_header_on_every_member_only_the_first_may_start(app: Celery) -> None:
    sig = chain(app.tasks["etl.fetch"].s("a"), chain(app.tasks["etl.load"].s(), app.tasks["etl.load"].s()))
    w = workflow(sig, lock_key="tenant:{tenant}:pipeline", tenant="a", lock_ttl=10, gap_ttl=30, name="etl")
    assert [m.task for m in w.members] == ["etl.fetch", "etl.load", "etl.load"]
    sent: list[Any] = []
    app.tasks["etl.fetch"].apply_async = lambda *a, **kw: sent.append(kw)  # type: ignore[method-assign]
    w.apply_async()
    (options,) = sent
    head = options["headers"][WORKFLOW]
    assert head["key"] == "tenant:a:pipeline" and head["index"] == 0 and head["ttl_ms"] == 10_000
    assert head["gap_ms"] == 30_000 and head["name"] == "etl"
    rest = [step["options"]["headers"][WORKFLOW] for step in reversed(options["chain"])]  # next step last
    assert [(h["index"], h["count"]) for h in rest] == [(1, 3), (2, 3)] and {h["id"] for h in rest} == {head["id"]}
    assert wf.Spec.from_header(head, "t").key == "tenant:a:pipeline"
    # the same canvas again is the identical workflow (same name and digest), under a new id
    again = w.spec()
    assert (again.name, again.digest) == (head["name"], head["digest"]) and again.id != head["id"]
    other = workflow(chain(app.tasks["etl.fetch"].s("")), lock_key="tenant:{tenant}:pipeline", tenant="a")
    assert other.spec().digest != head["digest"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"on_locked": "later"}, "on_locked='later'"),
        ({"on_unavailable": "maybe"}, "on_unavailable='maybe'"),
        ({"lock_ttl": 0}, "lock_ttl=0"),
        ({"gap_ttl": -1}, "gap_ttl=-1"),
        ({"lock_max_waits": -2}, "lock_max_waits=-2"),
        ({"tenant": ""}, "rendered empty"),
        ({"tenant": None}, r"field \{tenant\} is None"),  # issue 29 item 6: not "tenant:None:pipeline"
        ({"other": "x"}, "unknown field"),
    ],
)
def test_bad_workflow_options_raise_configuration_error(app: Celery, kwargs: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {"tenant": "a"}
    if "other" in kwargs:
        fields = {"other": kwargs.pop("other")}
    fields.update(kwargs)
    with pytest.raises(ConfigurationError, match=match):
        workflow(chain(app.tasks["etl.fetch"].s("a")), lock_key="tenant:{tenant}:pipeline", **fields)


def test_members_must_be_lockguard_tasks_and_a_group_needs_a_callback(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match=r"'etl\.plain' must be a LockGuard task"):
        workflow(chain(app.tasks["etl.fetch"].s("a"), app.tasks["etl.plain"].s()), lock_key="k")
    with pytest.raises(ConfigurationError, match="not registered"):
        workflow(chain(app.signature("etl.nowhere")), lock_key="k", app=app)
    pages = group(app.tasks["etl.load"].s(), app.tasks["etl.load"].s())
    # the error tells the user what to write instead, wherever the bare group stands
    for sig in (chain(app.tasks["etl.fetch"].s("a"), pages), pages):
        with pytest.raises(ConfigurationError, match="group with no callback") as caught:
            workflow(sig, lock_key="k")
        assert r"chord(group(...), done.s())" in str(caught.value)
        assert "@app.task(base=LockedTask)" in str(caught.value)


def test_a_header_no_workflow_wrote_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"'t1'.*lockguard_workflow"):
        wf.Spec.from_header({"id": "x"}, "t1")
    with pytest.raises(ConfigurationError, match="not valid"):
        wf.Spec.from_header({**spec().header(), "on_locked": "sometimes"}, "t1")


def test_settings_default_ttl_applies(app: Celery) -> None:
    w = workflow(chain(app.tasks["etl.fetch"].s("a")), lock_key="k:{tenant}", tenant="a")
    assert w.spec().ttl_ms == int(settings(app).default_ttl * 1000)


def test_an_eager_workflow_hands_over_by_slot_and_releases(own_redis: RedisServer) -> None:
    app = Celery("wf-eager", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    seen: list[tuple[str, int, bool]] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="eager.step")
    def step(self: Any, prev: Any = None, tag: str = "") -> list[str]:
        seen.append((self.lock.key, self.lock.fence, self.lock.held))
        return [*(prev or []), tag]

    @app.task(base=LockedTask, bind=True, shared=False, name="eager.boom")
    def boom(self: Any, prev: Any = None) -> None:
        raise RuntimeError("boom")

    w = workflow(chain(step.s(tag="a"), step.s(tag="b"), step.s(tag="c")), lock_key="t:{t}", t="x")
    assert w.apply_async().get() == ["a", "b", "c"]
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0][0] == "t:x" and seen[0][2] is True
    c = own_redis.client()
    assert not c.exists(lock_name(P, "t:x"))
    with pytest.raises(RuntimeError, match="boom"):
        workflow(chain(step.s(tag="a"), boom.s(), step.s(tag="c")), lock_key="t:{t}", t="x").apply_async().get()
    assert not c.exists(lock_name(P, "t:x"))  # released by the failing member
    assert len(seen) == 4  # the step after the failure never ran


def test_a_chords_header_members_join_the_lease_the_last_out_lets_the_callback_in(c: Any) -> None:
    enter(c, spec(), "m0")
    pass_on(c, "tok1", 1)
    page = spec(index=1, parallel=True)
    first, second = enter(c, page, "p1", token="x"), enter(c, page, "p2", token="y")
    assert first.kind == second.kind == "entered" and first.token == second.token == "tok1"
    assert first.fence == second.fence and c.hget(lock_name(P, KEY), "active") == "2"
    # the callback (slot 2, admitted after slot 1) waits its turn only in Celery: a lease still running the
    # header admits it, as a page that died never leaves
    leave = [lock_name(P, KEY)]
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000]) == 1
    assert c.hget(lock_name(P, KEY), "state") == "running"
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000]) == 0
    assert c.hget(lock_name(P, KEY), "state") == "gap" and c.hget(lock_name(P, KEY), "next") == "#1"
    assert enter(c, spec(index=3), "late").kind == "passed"  # not its slot
    body = enter(c, spec(index=2, after=1), "cb")
    assert (body.kind, body.token) == ("entered", "tok1") and c.hget(lock_name(P, KEY), "active") == "0"
    assert scripts.workflow_leave(c, leave, ["wrong", wf.slot(1), 2000]) == -1


def test_a_chord_first_starts_with_its_first_page_and_the_others_join(c: Any) -> None:
    page = spec(index=0, parallel=True)
    started, joined = enter(c, page, "p1"), enter(c, page, "p2", token="other")
    assert started.kind == "started" and (joined.kind, joined.token) == ("entered", "tok1")
    assert c.hget(lock_name(P, KEY), "active") == "2"


def test_workflow_gives_a_chord_two_slots_its_pages_share_the_first(app: Celery) -> None:
    from celery import chord

    app.conf.result_backend = "cache+memory://"  # chords need a result backend
    fetch, load = app.tasks["etl.fetch"], app.tasks["etl.load"]
    sig = chain(fetch.s("a"), chord(group(load.s() for _ in range(3)), load.s()), load.s())
    w = workflow(sig, lock_key="k:{t}", t="a")
    assert len(w.members) == 6 and w.spec().count == 4
    sent: list[Any] = []
    app.tasks["etl.fetch"].apply_async = lambda *a, **kw: sent.append(kw)  # type: ignore[method-assign]
    w.apply_async()
    ((options,),) = [sent]
    chord_step = options["chain"][-1]  # the next step is last
    pages = [t["options"]["headers"][WORKFLOW] for t in chord_step["kwargs"]["header"]["kwargs"]["tasks"]]
    body = chord_step["kwargs"]["body"]
    callback = (body["kwargs"]["tasks"][0] if body.get("subtask_type") == "chain" else body)["options"]["headers"]
    assert {(h["index"], h["parallel"]) for h in pages} == {(1, True)}
    assert (callback[WORKFLOW]["index"], callback[WORKFLOW]["after"]) == (2, 1)


def test_an_outage_at_entry_gives_up_visibly_or_fails_open() -> None:
    from celery_lockguard import BackendUnavailable

    app = Celery("wf-outage", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lockguard_redis_url="redis://127.0.0.1:1/0", lockguard_key_prefix=P)
    seen: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="outage.step")
    def step(self: Any, prev: Any = None) -> int:
        seen.append(self.lock)
        return 1

    closed = workflow(chain(step.s(), step.s()), lock_key="t:{t}", t="x", lock_max_waits=0)
    with pytest.raises(BackendUnavailable, match="t:x"):
        closed.apply_async().get()
    assert seen == []  # fail_closed: no body ran without the lease
    opened = workflow(chain(step.s(), step.s()), lock_key="t:{t}", t="x", on_unavailable="fail_open")
    assert opened.apply_async().get() == 1
    assert seen == [None, None]  # fail_open: both members ran, unlocked (self.lock is None)


def test_a_running_delivery_of_this_member_is_alive_only_while_renewed() -> None:
    def own(pid: int, since: int, host: str = L.HOST) -> wf.Entry:
        holder = L.Holder("m1", "workflow:etl", "d1", host, pid, "running", 0, since, "tok", 5000)
        return wf.Entry("self", "tok", 5, 0, holder)

    live = wf.facts(spec(), own(os.getpid(), 100))
    assert live is not None and live.alive and not live.dead_here
    stale = wf.facts(spec(), own(os.getpid(), 4000))  # its process lives on, but nobody renews the member
    assert stale is not None and not stale.alive
    assert decide_member(Member("self", False, "skip", "fail_closed", holder=stale)).action is MemberAction.ADOPT
    gone = wf.facts(spec(), own(2**22 + 12345, 100))
    assert gone is not None and gone.dead_here and not gone.alive
    remote = wf.facts(spec(), own(1, 100, host="elsewhere"))
    assert remote is not None and remote.alive


# -- review fixes: publish arguments, headers, apply(), queue-time members, fail_open mid-chain, skipped chords --


def test_the_first_members_publish_arguments_are_part_of_the_workflows_identity(app: Celery) -> None:
    """Two publishes with other ``apply_async`` arguments are different work, waited for, never skipped."""
    w = workflow(chain(app.tasks["etl.load"].s(), app.tasks["etl.load"].s()), lock_key="k:{t}", t="a")
    plain = w.spec().digest
    assert w.spec(({"tags": ["batch-1"]},)).digest == w.spec(({"tags": ["batch-1"]},)).digest != plain
    assert w.spec(({"tags": ["batch-1"]},)).digest != w.spec(({"tags": ["batch-2"]},)).digest
    assert w.spec(None, {"prev": 1}).digest not in (plain, w.spec(None, {"prev": 2}).digest)


def test_headers_passed_to_the_publish_go_beside_the_workflow_header_on_every_member(app: Celery) -> None:
    """Celery puts call options over the first member's: its workflow header was dropped (review)."""
    sig = chain(app.tasks["etl.fetch"].s("a"), app.tasks["etl.load"].s())
    sent: list[Any] = []
    app.tasks["etl.fetch"].apply_async = lambda *a, **kw: sent.append(kw)  # type: ignore[method-assign]
    workflow(sig, lock_key="k:{t}", t="a").apply_async(headers={"trace": "t-1", WORKFLOW: "forged"})
    (options,) = sent
    assert options["headers"]["trace"] == "t-1" and options["headers"][WORKFLOW]["index"] == 0
    (rest,) = options["chain"]
    assert rest["options"]["headers"]["trace"] == "t-1" and rest["options"]["headers"][WORKFLOW]["index"] == 1


def test_apply_runs_the_workflow_eagerly_under_its_lease(own_redis: RedisServer) -> None:
    app = Celery("wf-apply", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    fences: list[int] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="apply.step")
    def step(self: Any, prev: Any = None, tag: str = "") -> list[str]:
        fences.append(self.lock.fence)
        return [*(prev or []), tag]

    w = workflow(chain(step.s(tag="a"), step.s(tag="b")), lock_key="t:{t}", t="y")
    assert w.apply().get() == ["a", "b"]
    assert len(fences) == 2 and len(set(fences)) == 1
    assert not own_redis.client().exists(lock_name(P, "t:y"))


@pytest.mark.parametrize("mode", ["until_done", "until_started"])
def test_a_queue_time_member_on_the_workflows_entity_takes_no_claim_of_its_own(
    own_redis: RedisServer, mode: str
) -> None:
    """Its claim was a second holder of the entity: until_done waited on itself, until_started left a claim
    for queue_lock_ttl that answered later work with the old member's result (review)."""
    from celery_lockguard._keys import claim_name

    app = Celery("wf-claim", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)

    @app.task(base=LockedTask, bind=True, shared=False, name="claim.same", lock_key="tenant:{tenant}:pipeline",
              lock_mode=mode)  # fmt: skip
    def same(self: Any, prev: Any = None, tenant: str = "") -> None:
        return None

    c = own_redis.client()
    member = wf.Spec(id="w1", key="tenant:q:pipeline", name="wf", digest="d", ttl_ms=5000, gap_ms=5000,
                     on_locked="skip", on_unavailable="fail_closed", max_waits=3, max_hold=60.0)  # fmt: skip
    same.apply_async(kwargs={"tenant": "q"}, headers={WORKFLOW: member.header()})
    assert not c.exists(lock_name(P, "tenant:q:pipeline")) and not c.exists(claim_name(P, "tenant:q:pipeline"))
    same.apply_async(kwargs={"tenant": "q"})  # outside a workflow the mode claims as usual
    held = lock_name(P, "tenant:q:pipeline") if mode == "until_done" else claim_name(P, "tenant:q:pipeline")
    assert c.exists(held)


def test_fail_open_mid_chain_runs_the_rest_unlocked_instead_of_dropping_it(own_redis: RedisServer) -> None:
    """The lock Redis unreachable only while the middle member enters: it runs unlocked (fail_open), and so do
    the members after it; before, the next one found the lease still waiting for the middle one and was
    dropped, the chain's result never came (review)."""
    from structlog.testing import capture_logs

    from celery_lockguard._config import reset

    app = Celery("wf-open", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    seen: list[tuple[str, Any]] = []

    def point(url: str) -> None:
        app.conf.lockguard_redis_url = url
        reset(app)

    @app.task(base=LockedTask, bind=True, shared=False, name="open.step")
    def step(self: Any, prev: Any = None, tag: str = "", then: str = "") -> list[str]:
        seen.append((tag, self.lock.fence if self.lock else None))
        if then:
            point(then)  # what the next member's entry will find
        return [*(prev or []), tag]

    sig = chain(step.s(tag="a", then="redis://127.0.0.1:1/0"), step.s(tag="b", then=own_redis.url), step.s(tag="c"))
    w = workflow(sig, lock_key="t:{t}", t="z", on_unavailable="fail_open", gap_ttl=30)
    with capture_logs() as logs:
        assert w.apply_async().get() == ["a", "b", "c"]
    assert seen[0][1] is not None and seen[1:] == [("b", None), ("c", None)]
    opened = [e for e in logs if e["event"] == "lock.fail_open"]
    assert len(opened) == 2 and opened[1]["reason"] == "an earlier member ran unlocked"
    assert not [e for e in logs if e["event"] in ("workflow.member_dropped", "workflow.lost")]


def test_fail_open_marks_every_later_member_of_its_workflow_in_the_request(app: Celery) -> None:
    """What a worker publishes next comes from ``request.chain`` / ``request.chord``: their headers say unlocked."""
    from celery import chord

    app.conf.result_backend = "cache+memory://"
    fetch, load = app.tasks["etl.fetch"], app.tasks["etl.load"]
    sig = chain(fetch.s("a"), load.s(), chord(group(load.s() for _ in range(2)), load.s()), load.s())
    sent: list[Any] = []
    fetch.apply_async = lambda *a, **kw: sent.append(kw)  # type: ignore[method-assign]
    workflow(sig, lock_key="k:{t}", t="a").apply_async()
    (options,) = sent
    rest = options["chain"]
    wid = options["headers"][WORKFLOW]["id"]
    wf._mark_unlocked(rest, "another-workflow")
    headers_found = [o["headers"][WORKFLOW] for o in wf._signature_options(rest) if WORKFLOW in o.get("headers", {})]
    # Every later step (1 load, 2 the chord's pages, 3 its callback, 4 the last load); Celery versions repeat
    # a signature in its serialized form differently, so the same header may be met more than once.
    assert {h["index"] for h in headers_found} == {1, 2, 3, 4} and not any(h["unlocked"] for h in headers_found)
    wf._mark_unlocked(rest, wid)
    assert all(h["unlocked"] for h in headers_found)
    assert all(wf.Spec.from_header(h, "t").unlocked for h in headers_found)
    # A skipped identical workflow stores None for every later member: a chord's callback and pages too.
    ids = wf._task_ids(rest)
    chord_step = next(step for step in rest if step.get("subtask_type") == "chord")
    assert chord_step["kwargs"]["body"]["options"]["task_id"] in ids
    assert all(t["options"]["task_id"] in ids for t in chord_step["kwargs"]["header"]["kwargs"]["tasks"])


def test_a_member_that_failed_open_retries_unlocked_even_in_another_process(own_redis: RedisServer) -> None:
    """Its retry carries its own header, marked unlocked: entering, it would find the workflow ended (the
    failed-open member freed the lease) and be dropped, and the rest with it (re-review)."""
    from celery_lockguard._config import reset

    app = Celery("wf-open-retry", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    seen: list[tuple[str, int, Any]] = []

    def point(url: str) -> None:
        app.conf.lockguard_redis_url = url
        reset(app)

    @app.task(base=LockedTask, bind=True, shared=False, name="open.retry", max_retries=1)
    def step(self: Any, prev: Any = None, tag: str = "", then: str = "") -> list[str]:
        seen.append((tag, self.request.retries, self.lock))
        if then:
            point(then)
        if tag == "b" and self.request.retries == 0:
            wf._failed_open.clear()  # the retry is delivered by another process
            raise self.retry(countdown=0)
        return [*(prev or []), tag]

    sig = chain(step.s(tag="a", then="redis://127.0.0.1:1/0"), step.s(tag="b", then=own_redis.url), step.s(tag="c"))
    w = workflow(sig, lock_key="t:{t}", t="r", on_unavailable="fail_open")
    assert w.apply_async().get() == ["a", "b", "c"]
    assert [(tag, retries) for tag, retries, _ in seen] == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    assert [lease is None for _, _, lease in seen] == [False, True, True, True]


# -- issue 29: crossings --------------------------------------------------------------------------


def test_a_workflow_nested_in_another_chain_or_workflow_is_a_configuration_error(app: Celery) -> None:
    """Issue 29 item 13: Celery raised a bare TypeError (``unsupported operand type(s) for |``)."""
    fetch, load = app.tasks["etl.fetch"], app.tasks["etl.load"]
    inner = workflow(chain(fetch.s("b")), lock_key="site:{site}", site="b", name="inner")
    builds = [
        lambda: chain(fetch.s("a"), inner),
        lambda: fetch.s("a") | inner,
        lambda: inner | load.s(),
        lambda: workflow(chain(fetch.s("a"), inner), lock_key="site:{site}", site="a"),
        lambda: workflow(inner, lock_key="site:{site}", site="a"),  # type: ignore[arg-type]
    ]
    for build in builds:
        with pytest.raises(ConfigurationError, match=r"workflow 'inner' on 'site:b'.*cannot be a step of another"):
            build()


def test_a_hand_over_covers_the_copys_countdown_plus_the_publish_grace() -> None:
    from celery_lockguard import _claims as claims

    assert wf.covering_ms(None) == 0
    assert wf.covering_ms(4) == int((4 + claims.PUBLISH_GRACE) * 1000)
    # retry(): Celery's rule, no countdown and no eta means default_retry_delay
    assert claims.retry_due_in(180, None, None) == 180
    assert claims.retry_due_in(180, 2, None) == 2 and claims.retry_due_in(180, 0, None) == 0
    assert 8 < claims.retry_due_in(180, None, _in(9)) <= 9


def _in(seconds: float) -> Any:
    from datetime import datetime, timedelta, timezone

    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


def test_a_longer_gap_asked_by_a_pass_or_by_any_page_leaving_holds(c: Any) -> None:
    enter(c, spec(), "m0")
    assert pass_on(c, "tok1", 1, gap_ms=20_000) == 1
    assert c.pttl(lock_name(P, KEY)) > 15_000
    page = spec(index=1, parallel=True, width=2)
    enter(c, page, "p1"), enter(c, page, "p2")
    leave = [lock_name(P, KEY)]
    # p1 retries after a long countdown (not final); p2 ends with the short gap: the slot waits the longer
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 20_000, "", "", 2]) == 1
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "", 2]) == 0
    assert c.hget(lock_name(P, KEY), "state") == "gap" and c.pttl(lock_name(P, KEY)) > 15_000


def test_a_failed_page_leaves_the_slot_to_its_siblings_the_last_one_out_ends_the_workflow(c: Any) -> None:
    enter(c, spec(), "m0")
    pass_on(c, "tok1", 1)
    page = spec(index=1, parallel=True, width=3)
    enter(c, page, "p1"), enter(c, page, "p2")
    leave = [lock_name(P, KEY)]
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "1", 3]) == 1  # p1 failed: p2 runs on
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "", 3]) == 0  # p3 still to come
    assert c.hget(lock_name(P, KEY), "state") == "gap"
    assert enter(c, page, "p3").kind == "entered"  # the queued sibling is not dropped
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "", 3]) == -2  # last out: end it
    assert c.hget(lock_name(P, KEY), "token") == "tok1"  # nothing written: the caller releases
    # the next chord of the workflow starts its tallies afresh
    enter(c, spec(index=2, after=1), "cb")
    assert c.hmget(lock_name(P, KEY), "left", "failed") == ["0", ""]


def test_a_member_waiting_for_another_entity_says_so_in_the_lease_until_it_enters_again(c: Any) -> None:
    enter(c, spec(), "m0")
    name = [lock_name(P, KEY)]
    assert scripts.workflow_waits_on(c, name, ["wrong", "invoice:7"]) == 0
    assert scripts.workflow_waits_on(c, name, ["tok1", "invoice:7"]) == 1
    assert scripts.workflow_pass(c, name, ["tok1", wf.slot(0), 2000, "invoice:7"]) == 1
    assert c.hget(lock_name(P, KEY), "waits_on") == "invoice:7"
    enter(c, spec(), "m0")  # its wait copy enters: no longer waiting
    assert c.hget(lock_name(P, KEY), "waits_on") == ""


def test_a_member_of_an_ended_workflow_that_never_ran_fails_visibly_a_copy_of_one_that_ran_is_ignored(
    redis_url: str, prefix: str
) -> None:
    """Issue 29 item 10: a member dropped because its workflow ended was ``Ignore``d, its result PENDING for good
    (the real tracer, Redis broker and result backend)."""
    import redis as redis_lib
    from celery import states

    from celery_lockguard import WorkflowEnded

    from .tracer import deliver, make_app

    app = make_app("wf-ended", redis_url, prefix)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="wfe.step")
    def step(self: Any, prev: Any = None) -> str:
        ran.append(self.request.id)
        return "ok"

    w = workflow(chain(step.s(), step.s(), step.s()), lock_key="site:{site}", site="e", app=app)
    s = w.spec()
    wf.mark_ended(redis_lib.Redis.from_url(redis_url), settings(app), s)  # e.g. a sibling page was revoked
    never = deliver(step, headers={WORKFLOW: s.header(index=1)})
    assert never.state == states.FAILURE and isinstance(never.retval.exception, WorkflowEnded)
    assert "'site:e' ended before this member ran" in str(never.retval.exception)
    with pytest.raises(WorkflowEnded):  # what a caller waiting on it gets
        app.AsyncResult(never.task_id).get(timeout=5)
    done = "done-" + s.id
    app.backend.store_result(done, "ok", states.SUCCESS)  # a redelivered copy of a member that ran
    again = deliver(step, task_id=done, headers={WORKFLOW: s.header(index=2)})
    assert again.state == states.SUCCESS and app.AsyncResult(done).get(timeout=5) == "ok"
    assert ran == []


def test_a_page_whose_retries_ran_out_after_leaving_is_counted_out_once(c: Any) -> None:
    enter(c, spec(), "m0")
    pass_on(c, "tok1", 1)
    page = spec(index=1, parallel=True, width=2)
    enter(c, page, "p1"), enter(c, page, "p2")
    leave = [lock_name(P, KEY)]
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "", "", 2]) == 1  # p1: retry() leaves
    # its retries had run out: no retry was published, p1 fails; p2 still runs and keeps the entity
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "1", 2, "1"]) == 1
    assert c.hget(lock_name(P, KEY), "state") == "running"
    assert scripts.workflow_leave(c, leave, ["tok1", wf.slot(1), 2000, "1", "", 2]) == -2  # p2, the last out


def test_a_skipped_identical_workflow_is_counted_under_the_workflow(own_redis: RedisServer) -> None:
    """Issue 30: it was counted under its first member's task, so `stats` showed the task skipping itself."""
    from celery_lockguard import _metrics as metrics

    app = Celery("wf-skip-count", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="skipcount.step")
    def step(self: Any, prev: Any = None, tag: str = "") -> None:
        ran.append(tag)

    # One member: an eager chain would go on to the next member after a skip (a worker's does not).
    w = workflow(chain(step.s(tag="a")), lock_key="t:{t}", t="skip")
    c = own_redis.client()
    running = w.spec()  # an identical workflow (same name and digest) holds the entity, its first member running
    assert wf.enter(c, settings(app), running, member("m-0"), "tok-0", False).kind == "started"
    metrics.clear()
    assert w.apply().get() is None and ran == []  # skipped whole
    counted = metrics.snapshot()
    assert counted.get("workflow:skipcount.step", {}).get("lock.skipped_duplicate") == 1, counted
    assert "lock.skipped_duplicate" not in counted.get("skipcount.step", {})


def test_describe_says_a_keyless_member_takes_the_workflows_key(own_redis: RedisServer) -> None:
    """Issue 30: describe listed a workflow's keyless members as "(none: unlocked)"."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_lockguard._cli import lockguard

    app = Celery("wf-describe", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=own_redis.url, lockguard_key_prefix=P)

    @app.task(base=LockedTask, shared=False, name="describe.member")
    def member() -> None: ...

    out = CliRunner().invoke(lockguard, ["describe"], obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))
    row = next(line for line in out.stdout.splitlines() if "describe.member" in line)
    assert "(none: unlocked)" not in row and "a workflow's key in one" in row, row


def test_a_redelivered_chord_page_that_already_ran_is_dropped_not_run_again(redis_url: str, prefix: str) -> None:
    """A chord page's copy delivered again after the page ran (a lost ack, the visibility timeout) while the
    workflow still waits for its other page or its callback: it ran its body a second time, since a page joins
    the lease of its slot whoever left it (a chain member's copy finds the lease at the next member and is
    dropped). The model of crossing features found it (tests/test_model_crossings.py). Real tracer and Redis."""
    from celery import _state

    from .tracer import make_app

    app = make_app("wf-page-again", redis_url, prefix)
    # Celery 5.3's Redis backend restores a chord's group through the *current* app (5.7 passes its own): made
    # current here, or the chord's callback is never sent when another test left a backend-less app current.
    before = _state.get_current_app()
    app.set_current()
    try:
        _chord_page_again(app, redis_url, prefix)
    finally:
        before.set_current()


def _chord_page_again(app: Any, redis_url: str, prefix: str) -> None:
    from celery import chord

    from .tracer import published, redeliver_with_canvas

    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="wfp.step")
    def step(self: Any, *prev: Any, tag: str) -> str:
        ran.append(tag)
        return tag

    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    queue = f"{prefix}:kombu:{app.conf.task_default_queue}"
    workflow(
        chord([step.si(tag="p1"), step.si(tag="p2")], step.s(tag="cb")), lock_key="e:{e}", e=1, app=app
    ).apply_async()
    p1, p2 = published(r, app)
    r.delete(queue)
    assert redeliver_with_canvas(step, p1).state == "SUCCESS"
    again = redeliver_with_canvas(step, p1)  # before its sibling ran
    assert ran == ["p1"], ran
    assert again.state == "SUCCESS" and app.AsyncResult(p1.task_id).get(timeout=5) == "p1"
    assert redeliver_with_canvas(step, p2).state == "SUCCESS"
    redeliver_with_canvas(step, p1)  # after both pages, the callback not yet run
    assert ran == ["p1", "p2"], ran
    (callback,) = published(r, app)
    r.delete(queue)
    assert redeliver_with_canvas(step, callback).state == "SUCCESS"
    assert ran == ["p1", "p2", "cb"], ran


def test_a_redelivered_first_member_that_ran_does_not_start_the_workflow_again_after_a_forced_release(
    redis_url: str, prefix: str
) -> None:
    """The operator force-releases a workflow between its members; a copy of its first member, which ran, is
    delivered again (a lost ack): it found the entity free and ran again, starting the workflow anew."""
    import redis as redis_lib

    from .tracer import make_app, published, redeliver_with_canvas

    app = make_app("wf-first-again", redis_url, prefix)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="wff.step")
    def step(self: Any, *prev: Any, tag: str) -> str:
        ran.append(tag)
        return tag

    r = redis_lib.Redis.from_url(redis_url)
    queue = f"{prefix}:kombu:{app.conf.task_default_queue}"
    workflow(chain(step.si(tag="m0"), step.si(tag="m1")), lock_key="e:{e}", e=1, app=app).apply_async()
    (first,) = published(r, app)
    r.delete(queue)
    assert redeliver_with_canvas(step, first).state == "SUCCESS"
    L.force_release(r, prefix, "e:1", 60_000)  # `celery lockguard release e:1 -y`
    redeliver_with_canvas(step, first)
    assert ran == ["m0"], ran
    assert app.AsyncResult(first.task_id).get(timeout=5) == "m0"


def test_a_member_that_fails_before_its_own_lock_gives_back_the_reservation_it_was_woken_into(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member waiting for its own entity (``o:1``) parks there; the operator force-releases the workflow's
    entity meanwhile; the holder of ``o:1`` ends and wakes the member into a reservation of ``o:1``. The woken
    copy fails ``LockLost`` (its workflow lease is gone) before taking ``o:1``: the reservation stayed for
    ``RESERVATION_TTL`` with nobody to adopt it, so whoever parked behind it waited for its safety copy. The
    model of crossing features found it (another workflow's member then spent its wait budget on it)."""
    import redis as redis_lib

    from celery_lockguard import LockLost
    from celery_lockguard import _handoff as handoff

    from .tracer import make_app, published, redeliver_with_canvas

    monkeypatch.setattr(handoff, "WAKE_GRACE", 0.05)
    app = make_app("wf-own-gone", redis_url, prefix)

    @app.task(base=LockedTask, bind=True, shared=False, name="wfo.step")
    def step(self: Any, *prev: Any, e: int, tag: str) -> str:
        return tag

    @app.task(base=LockedTask, bind=True, shared=False, name="wfo.own", lock_key="o:{e}", on_locked="retry")
    def own(self: Any, *prev: Any, e: int, tag: str) -> str:
        return tag

    r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    queue = f"{prefix}:kombu:{app.conf.task_default_queue}"

    def take(woken: bool = False) -> Any:
        msg = next(m for m in published(r, app) if bool(m.custom().get("lockguard_woken")) == woken)
        r.lrem(queue, 1, next(raw for raw in r.lrange(queue, 0, -1) if msg.task_id in raw and (
            ("lockguard_woken" in raw) == woken)))  # fmt: skip
        return msg

    other = L.acquire(r, prefix, "o:1", ttl_ms=30_000, task_id="other", task_name="other", digest="d",
                      worker="elsewhere", fence_ttl_ms=60_000)  # fmt: skip
    assert isinstance(other, L.Lease)
    sig = chain(step.si(e=1, tag="m0"), own.si(e=1, tag="own"), step.si(e=1, tag="m2"))
    workflow(sig, lock_key="e:{e}", e=1, app=app).apply_async()
    assert redeliver_with_canvas(step, take()).state == "SUCCESS"
    parked = take()
    assert redeliver_with_canvas(own, parked).state == "RETRY"  # parked on o:1, the workflow lease in its gap
    L.force_release(r, prefix, "e:1", 60_000)  # `celery lockguard release e:1 -y`
    _, _, woken = L.release_and_wake(r, other, prefix, reserve_ms=handoff.reserve_ms())
    assert handoff.wake(app, settings(app), woken, "other", "other")
    assert r.hget(lock_name(prefix, "o:1"), "state") == "handed"
    out = redeliver_with_canvas(own, take(woken=True))
    assert out.state == "FAILURE" and isinstance(out.retval.exception, LockLost)
    assert r.hget(lock_name(prefix, "o:1"), "task_id") != parked.task_id, r.hgetall(lock_name(prefix, "o:1"))
