"""xb crossing review: confirmed defects where two features cross (real prefork workers, real Redis)."""

from __future__ import annotations

import uuid

import pytest
import redis
from celery import chain

from celery_lockguard import workflow
from celery_lockguard._keys import lock_name
from celery_lockguard.exceptions import ConfigurationError

from .conftest import Fleet, make_cfg
from .test_workers import records

pytestmark = pytest.mark.integration


def test_a_member_locking_the_workflows_entity_and_another_runs_not_dropped_as_its_own_redelivery(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Workflow x multi-entity lock_key. The workflow holds ``xb:{tenant}``; its middle member ``xb.multi``
    locks ``(xb:{tenant}, xb:{other})``: the workflow's entity and one more. ``own_entities`` is False (not a
    subset), so the member nests and ACQUIRE_MULTI meets the workflow lease, whose ``task_id`` is the member's
    own id: decided as ``redelivery_of_running_original`` (DROP_AND_WATCH), ``Ignore`` is raised, the workflow
    is released "on error" and the chain's result stays PENDING. Expected: the member runs (it holds the
    workflow's entity through the workflow, the other one nested), or fails visibly."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant, other = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    step, multi = app.tasks["xb.step"], app.tasks["xb.multi"]
    sig = chain(step.si(key="s1", tag="s1"), multi.si(tenant, other, "", "m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=3).apply_async()
    member = res.parent
    assert member is not None
    try:
        out = res.get(timeout=30)
    finally:
        print("member state:", member.state, "last state:", res.state)
        print([(x["tag"], x["ev"]) for x in records(r, prefix)])
    assert out["tag"] == "s3"
    assert [x["tag"] for x in records(r, prefix) if x["ev"] == "start"] == ["s1", "m", "s3"]


def test_a_rated_member_on_the_workflows_own_entity_is_refused_not_run_uncounted(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Workflow x lock_rate. ``xb.rated_wf`` has ``lock_rate="1/10s"`` on ``xbw:{tenant}``. A plain call takes the
    window's one start; then a workflow on ``xbw:{tenant}`` runs ``xb.rated_wf`` as a member. Its lock_key is the
    workflow's own entity, so it would run under the workflow lease, which counts no start in the window: before
    the fix it started at once, a second start within 10 s. Now the member fails visibly with
    ``ConfigurationError`` naming the task, the option and its value, and its body never starts."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant = uuid.uuid4().hex[:6]
    rated, step = app.tasks["xb.rated_wf"], app.tasks["xb.step"]
    rated.delay(tenant=tenant, tag="plain").get(timeout=30)  # the window's one start
    sig = chain(step.si(key="s1", tag="s1"), rated.si(tenant=tenant, tag="member"))
    with pytest.raises(ConfigurationError) as err:
        workflow(sig, lock_key="xbw:{tenant}", tenant=tenant).apply_async().get(timeout=40)
    assert "'xb.rated_wf'" in str(err.value) and "lock_rate='1/10s'" in str(err.value)
    assert [x["tag"] for x in records(r, prefix) if x["ev"] == "start"] == ["plain", "s1"]
    assert not r.exists(lock_name(prefix, f"xbw:{tenant}"))  # the workflow ended: nothing left holding it


def test_chord_pages_with_lock_limit_below_their_number_on_the_workflows_own_entity_are_refused(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Workflow (chord) x lock_limit. Four pages of ``xb.slot`` (``lock_limit=2`` on ``xb:{key}``) form the header
    of a chord run as a workflow on that very entity. Pages join the workflow's lease and run under it at once:
    before the fix, four bodies held the entity under lock_limit=2. Now each page fails visibly with
    ``ConfigurationError`` (the chord fails), and no page body starts."""
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    key = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    r.set(gate, 1)
    slot, step = app.tasks["xb.slot"], app.tasks["xb.step"]
    pages = [slot.si(key, gate, f"p{i}") for i in range(4)]
    res = workflow(chord(pages, step.si(key="cb", tag="cb")), lock_key="xb:{k}", k=key).apply_async()
    with pytest.raises(Exception) as err:  # Celery fails the callback with the page's error
        res.get(timeout=60)
    assert "lock_limit=2" in str(err.value) and "4 pages" in str(err.value)
    assert [x for x in records(r, prefix) if x["ev"] == "start"] == []


def test_chord_pages_within_lock_limit_on_the_workflows_own_entity_run(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """The same chord with two pages (= lock_limit): the limit holds under the workflow lease, so they run."""
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    r.set(gate, 1)
    slot, step = app.tasks["xb.slot"], app.tasks["xb.step"]
    res = workflow(
        chord([slot.si(key, gate, f"p{i}") for i in range(2)], step.si(key="cb", tag="cb")), lock_key="xb:{k}", k=key
    ).apply_async()
    assert res.get(timeout=60)["tag"] == "cb"
    assert sorted(x["tag"] for x in records(r, prefix) if x["ev"] == "start") == ["cb", "p0", "p1"]
