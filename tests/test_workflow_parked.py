"""A workflow member with its own lock, parked behind that lock's holder: its two copies and the workflow lease.

Found by the soak's workflow crossing cell (``chaos.crossings``, full run, seed 11): the member parked on its
own entity; its safety copy came first, found the woken copy out (entry ``woken``) and dropped itself
with ``Ignore`` -- which the workflow took for the member failing: it ended the workflow
(``workflow.released_on_error reason=failed``), so the woken copy then found it ended and was dropped too,
and the chain's result stayed ``PENDING`` for good. A parked copy that drops itself hands the workflow
lease back to its member's slot (the other copy enters it), and a parked copy meeting its twin inside the
workflow gives it a moment to hand back rather than drop the member.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard import _scripts as scripts
from celery_lockguard import _workflow as wf
from celery_lockguard._headers import PARK, WOKEN, WORKFLOW
from celery_lockguard._keys import lock_name, waiters_name, workflows_ended_name
from celery_lockguard.testing import RedisServer

P = "lgpk"
KEY = "tenant:p:pipeline"
INV = "inv:1"


def spec(index: int) -> wf.Spec:
    return wf.Spec(
        id="wfp1", key=KEY, name="workflow:parked", digest="d1", ttl_ms=5000, gap_ms=5000, index=index,
        count=3, on_locked="retry", on_unavailable="fail_closed", max_waits=100, max_hold=3600.0,
    )  # fmt: skip


def app_for(server: RedisServer) -> tuple[Celery, Any, list[str]]:
    app = Celery("wf-parked", broker="memory://", set_as_current=False)
    app.conf.update(lockguard_redis_url=server.url, lockguard_key_prefix=P)
    ran: list[str] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="parked.own", lock_key="inv:{inv}", lock_ttl=5)
    def own(self: Any, prev: Any = None, inv: int = 0) -> list[str]:
        ran.append(self.request.id)
        return [*(prev or []), "own"]

    return app, own, ran


def workflow_at_member_1(c: Any) -> str:
    """The workflow's first member ran and handed the lease on to member 1 (state gap)."""
    first = wf.enter(c, type("S", (), {"key_prefix": P, "fence_ttl": 86400.0})(), spec(0), _req("m0"), "tok0", False)
    assert first.kind == "started"
    assert int(scripts.workflow_pass(c, [lock_name(P, KEY)], ["tok0", wf.slot(1), 5000])) == 1
    return "tok0"


def _req(task_id: str) -> Any:
    return type("R", (), {"id": task_id, "task": "parked.step", "hostname": "w1@host"})()


def parked_entry(c: Any, member_id: str, state: str) -> str:
    """Member 1 parked behind another holder of its own lock, and that holder released: entry ``state``."""
    holder = L.acquire(
        c, P, INV, ttl_ms=10_000, task_id="holder", task_name="other", digest="dh", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(holder, L.Lease)
    token = L.new_token()
    parked = handoff.park(c, P, INV, token, "{}", task_id=member_id, task_name="parked.own", digest="dm", countdown=5.0)
    assert parked.kind == "parked"
    L.release(c, holder, P)
    c.hset(waiters_name(P, INV), f"s:{token}", state)
    return token


def test_a_parked_members_safety_copy_that_drops_itself_hands_the_workflow_back(own_redis: RedisServer) -> None:
    c = own_redis.client()
    _app, own, ran = app_for(own_redis)
    workflow_at_member_1(c)
    token = parked_entry(c, "m1", "woken")  # the releaser published the woken copy; the safety copy comes first
    safety = own.apply(kwargs={"inv": 1}, task_id="m1", headers={WORKFLOW: spec(1).header(), PARK: token})
    assert safety.state == "IGNORED" and ran == []
    lease = c.hgetall(lock_name(P, KEY))
    assert lease.get("state") == "gap" and lease.get("next") == wf.slot(1), lease  # before: freed
    assert not c.zscore(workflows_ended_name(P, KEY), "wfp1")  # before: the workflow was marked ended
    woken = own.apply(kwargs={"inv": 1}, task_id="m1", headers={WORKFLOW: spec(1).header(), PARK: token, WOKEN: 1})
    assert woken.state == "SUCCESS" and ran == ["m1"]


def test_a_parked_copy_meeting_its_twin_in_the_workflow_waits_for_it_to_hand_back(own_redis: RedisServer) -> None:
    """The woken copy enters while the safety copy still holds member 1 (it is about to drop itself and hand
    back): dropping the woken copy there too would leave nobody to run the member."""
    c = own_redis.client()
    _app, own, ran = app_for(own_redis)
    workflow_at_member_1(c)
    token = parked_entry(c, "m1", "woken")
    twin = wf.enter(c, type("S", (), {"key_prefix": P, "fence_ttl": 86400.0})(), spec(1), _req("m1"), "tok-twin", False)
    assert twin.kind == "entered"  # the safety copy is inside the workflow, running member 1
    lease_token = twin.token  # a member enters under the workflow's one token
    hand_back = threading.Timer(
        0.4, lambda: scripts.workflow_pass(c, [lock_name(P, KEY)], [lease_token, wf.slot(1), 5000])
    )
    hand_back.start()
    began = time.monotonic()
    woken = own.apply(kwargs={"inv": 1}, task_id="m1", headers={WORKFLOW: spec(1).header(), PARK: token, WOKEN: 1})
    hand_back.join()
    assert woken.state == "SUCCESS" and ran == ["m1"], woken.state  # before: IGNORED, the member lost
    assert time.monotonic() - began < handoff.WAKE_GRACE + 1
