"""Integration: workflows (one lease across a chain) on real prefork workers, Redis and RabbitMQ brokers."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, group
from celery.bin.base import CLIContext
from celery.exceptions import TimeLimitExceeded
from click.testing import CliRunner

from celery_lockguard import ConfigurationError, LockLost, StaleFence, advance_fence, testing, workflow
from celery_lockguard._cli import lockguard
from celery_lockguard._keys import lock_name
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .harness import ROOT
from .workflowapp import PIPELINE, create_app

pytestmark = pytest.mark.integration


def start_worker(fleet: Fleet, cfg: dict[str, Any], concurrency: int = 2) -> testing.Worker:
    """A worker of ``tests.workflowapp`` (stopped, and its AMQP queue deleted, with the fleet)."""
    if cfg["broker"].startswith("amqp"):
        fleet.amqp_queues.add((cfg["broker"], cfg["queue"]))
    name = f"wf{uuid.uuid4().hex[:6]}"
    w = testing.Worker(
        "tests.workflowapp:app",
        control=create_app(cfg),
        concurrency=concurrency,
        name=name,
        queues=[cfg["queue"]],
        env={"LG_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        log_path=fleet.tmp / f"lockguard-{name}.log",
    )
    fleet.workers.append(w)  # type: ignore[arg-type]
    return w.start()


def rows(r: redis.Redis, cfg: dict[str, Any], tenant: str | None = None) -> list[dict[str, Any]]:
    out = [json.loads(x) for x in r.lrange(f"{cfg['prefix']}:wf", 0, -1)]
    return [x for x in out if tenant is None or x["tenant"] == tenant]


def span(rs: list[dict[str, Any]], tags: set[str]) -> tuple[float, float]:
    """From the first start to the last end among the rows of ``tags``."""
    times = [x["t"] for x in rs if x["tag"] in tags]
    return min(times), max(times)


def pipeline(app: Any, tenant: str, tags: list[str], seconds: float = 0.2, **options: Any) -> Any:
    step = app.tasks["wf.step"]
    sig = chain(*(step.s(tenant=tenant, tag=t, seconds=seconds) for t in tags))
    return workflow(sig, lock_key=PIPELINE, tenant=tenant, **options)


def test_two_chains_of_one_tenant_never_interleave_another_tenant_runs_beside(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    worker = start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    alpha, beta = f"alpha-{uuid.uuid4().hex[:6]}", f"beta-{uuid.uuid4().hex[:6]}"
    first = pipeline(app, alpha, ["a1", "a2", "a3"], on_locked="retry").apply_async()
    second = pipeline(app, alpha, ["b1", "b2", "b3"], on_locked="retry").apply_async()
    other = pipeline(app, beta, ["c1", "c2", "c3"]).apply_async()
    assert first.get(timeout=90)["tags"] == ["a1", "a2", "a3"]
    assert second.get(timeout=90)["tags"] == ["b1", "b2", "b3"]
    assert other.get(timeout=90)["tags"] == ["c1", "c2", "c3"]
    mine = rows(r, cfg, alpha)
    a, b = span(mine, {"a1", "a2", "a3"}), span(mine, {"b1", "b2", "b3"})
    assert a[1] < b[0] or b[1] < a[0], f"the two workflows of one tenant interleaved: {a} {b}"
    # every member of one workflow saw the same lease: the workflow's key and fence
    for tags in ({"a1", "a2", "a3"}, {"b1", "b2", "b3"}):
        seen = {(x["key"], x["fence"], x["held"]) for x in mine if x["tag"] in tags}
        assert len(seen) == 1, seen
        ((key, _fence, held),) = seen
        assert key == f"tenant:{alpha}:pipeline" and held is True
    fences = {x["fence"] for x in mine}
    assert len(fences) == 2
    c = span(rows(r, cfg, beta), {"c1", "c2", "c3"})
    assert c[0] < max(a[1], b[1]) and min(a[0], b[0]) < c[1], "another tenant's workflow should run in parallel"
    assert not r.exists(lock_name(cfg["prefix"], f"tenant:{alpha}:pipeline"))
    assert not r.exists(lock_name(cfg["prefix"], f"tenant:{beta}:pipeline"))
    # one release per workflow, its hold time the whole workflow (three members of 0.2 s each)
    released = [x for x in worker.output().splitlines() if "workflow.released " in x and alpha in x]
    assert len(released) == 2, released
    assert all(int(re.search(r"hold_ms=(\d+)", x).group(1)) >= 550 for x in released), released  # type: ignore[union-attr]


def lease_of(r: redis.Redis, cfg: dict[str, Any], tenant: str) -> dict[str, str]:
    return r.hgetall(lock_name(cfg["prefix"], f"tenant:{tenant}:pipeline"))


def test_a_failure_in_the_middle_releases_at_once_and_stops_the_chain(fleet: Fleet, broker_cfg: dict[str, Any]) -> None:
    cfg = broker_cfg
    worker = start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step, fail = app.tasks["wf.step"], app.tasks["wf.fail"]
    sig = chain(step.s(tenant=tenant, tag="s1"), fail.s(tenant=tenant, tag="boom"), step.s(tenant=tenant, tag="s3"))
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    with pytest.raises(ValueError, match="boom failed"):
        res.get(timeout=60)
    # released by the failing member, not left for the 300 s gap TTL
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the workflow lease to be released on failure")
    assert [x["tag"] for x in rows(r, cfg, tenant) if x["ev"] == "start"] == ["s1", "boom"]
    said = [x for x in worker.output().splitlines() if "workflow.released_on_error" in x and tenant in x]
    assert len(said) == 1 and "reason=failed" in said[0] and "task_name=wf.fail" in said[0], said
    # the entity is free for the next workflow right away
    assert pipeline(app, tenant, ["n1"]).apply_async().get(timeout=60)["tags"] == ["n1"]


def test_revoking_the_running_member_releases_the_workflow(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = broker_cfg
    worker = start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    gate = str(tmp_path / "never")
    sig = chain(
        app.tasks["wf.step"].s(tenant=tenant, tag="s1"),
        app.tasks["wf.gate"].s(tenant=tenant, tag="held", gate=gate),
        app.tasks["wf.step"].s(tenant=tenant, tag="s3"),
    )
    workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, tenant)), 60, what="the gated member to start")
    running = next(x for x in rows(r, cfg, tenant) if x["tag"] == "held")
    assert lease_of(r, cfg, tenant)["task_id"] == running["task_id"]
    # the operator sees one holder: the workflow, with the member at it
    out = CliRunner().invoke(lockguard, ["locks"], obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))
    assert out.exit_code == 0, out.output
    (line,) = [x for x in out.output.splitlines() if f"tenant:{tenant}:pipeline" in x]
    assert "workflow:wf.step > wf.gate" in line and running["task_id"] in line and " running " in line
    app.control.revoke(running["task_id"], terminate=True, signal="SIGKILL")
    # cut to the shorten grace (2 s) by the main process, far below the 60 s TTL
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the revoked member's workflow lease to end")
    assert not any(x["tag"] == "s3" for x in rows(r, cfg, tenant))
    said = [x for x in worker.output().splitlines() if "workflow.released_on_error" in x and tenant in x]
    assert len(said) == 1 and "reason=terminated" in said[0] and "MainProcess" in said[0], said


def test_a_hard_time_limit_in_a_member_cuts_the_workflow_lease(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = broker_cfg
    worker = start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    gate = str(tmp_path / "never")
    sig = chain(
        app.tasks["wf.step"].s(tenant=tenant, tag="s1"),
        app.tasks["wf.stuck"].s(tenant=tenant, tag="held", gate=gate).set(time_limit=1),
        app.tasks["wf.step"].s(tenant=tenant, tag="s3"),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, tenant)), 60, what="the limited member to start")
    # the chain fails with the member's hard limit (the main process marks it and the rest)
    with pytest.raises(TimeLimitExceeded):
        res.get(timeout=60)
    # cut to the shorten grace (2 s) by the main process, far below the 60 s TTL (the child is killed, never renews)
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the hard-limited member's workflow lease to end")
    assert not any(x["tag"] == "s3" for x in rows(r, cfg, tenant))
    said = [x for x in worker.output().splitlines() if "workflow.released_on_error" in x and tenant in x]
    # once, by the main process, although Celery reports the hard limit there twice; the SIGKILLed child said nothing
    assert len(said) == 1 and "reason=hard_time_limit" in said[0] and "MainProcess" in said[0], said
    assert "grace_ms=2000" in said[0], said
    # a second workflow for the tenant starts: the entity is free, not held for lock_ttl or gap_ttl
    assert pipeline(app, tenant, ["n1"]).apply_async().get(timeout=60)["tags"] == ["n1"]


def test_a_retry_keeps_the_lease_and_its_fence(fleet: Fleet, broker_cfg: dict[str, Any]) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    sig = chain(
        app.tasks["wf.step"].s(tenant=tenant, tag="s1"),
        app.tasks["wf.retry_once"].s(tenant=tenant, tag="r"),
        app.tasks["wf.step"].s(tenant=tenant, tag="s3"),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant).apply_async()
    assert res.get(timeout=60)["tags"] == ["s1", "r", "s3"]
    mine = rows(r, cfg, tenant)
    assert [x["retries"] for x in mine if x["ev"] == "try"] == [0, 1]
    assert len({x["fence"] for x in mine}) == 1 and all(x["held"] for x in mine)
    assert not lease_of(r, cfg, tenant)


def test_members_nest_their_own_leases_and_run_under_the_workflow_on_its_entity(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant, inv = f"t-{uuid.uuid4().hex[:6]}", int(uuid.uuid4().int % 10**9)
    sig = chain(
        app.tasks["wf.invoice"].s(tenant=tenant, tag="inv", invoice=inv),
        app.tasks["wf.same_entity"].s(tenant=tenant, tag="same"),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant).apply_async()
    assert res.get(timeout=60)["tags"] == ["inv", "same"]
    by_tag = {x["tag"]: x for x in rows(r, cfg, tenant) if x["ev"] == "start"}
    # its own entity's lease inside the workflow's
    assert by_tag["inv"]["key"] == f"invoice:{inv}" and by_tag["inv"]["wf_key"] == f"tenant:{tenant}:pipeline"
    # on the workflow's own entity: the workflow lease itself, no deadlock
    assert by_tag["same"]["key"] == by_tag["same"]["wf_key"] == f"tenant:{tenant}:pipeline"
    assert by_tag["same"]["fence"] == by_tag["inv"]["wf_fence"]
    assert not lease_of(r, cfg, tenant)
    assert not r.exists(lock_name(cfg["prefix"], f"invoice:{inv}"))


def test_identical_workflow_is_skipped_a_plain_task_waits_behind(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    gate = tmp_path / "open"

    def gated() -> Any:
        sig = chain(
            app.tasks["wf.gate"].s(tenant=tenant, tag="g", gate=str(gate)),
            app.tasks["wf.step"].s(tenant=tenant, tag="after"),
        )
        return workflow(sig, lock_key=PIPELINE, tenant=tenant)

    first = gated().apply_async()
    wait_for(lambda: any(x["tag"] == "g" for x in rows(r, cfg, tenant)), 60, what="the first workflow to start")
    dup = gated().apply_async()
    plain = app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")
    assert dup.get(timeout=60) is None  # the whole identical workflow answered None
    gate.touch()
    assert first.get(timeout=60)["tags"] == ["g", "after"]
    assert plain.get(timeout=60)["tags"] == ["plain"]
    mine = rows(r, cfg, tenant)
    assert [x["tag"] for x in mine if x["ev"] == "gate"] == ["g"]
    end_after = max(x["t"] for x in mine if x["tag"] == "after")
    start_plain = min(x["t"] for x in mine if x["tag"] == "plain")
    assert start_plain >= end_after, "the plain task ran inside the workflow"


def test_a_member_whose_child_is_sigkilled_resumes_the_chain_under_the_workflow(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    sig = chain(
        app.tasks["wf.step"].s(tenant=tenant, tag="s1"),
        app.tasks["wf.crash_once"].s(tenant=tenant, tag="crash"),
        app.tasks["wf.step"].s(tenant=tenant, tag="s3"),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=30).apply_async()
    assert res.get(timeout=90)["tags"] == ["s1", "crash", "s3"]
    mine = rows(r, cfg, tenant)
    starts = [(x["tag"], x.get("attempt")) for x in mine if x["ev"] == "start"]
    assert (
        starts[0] == ("s1", None) and ("crash", 1) in starts and ("crash", 2) in starts and starts[-1] == ("s3", None)
    )
    fence = {x["tag"]: x["fence"] for x in mine if x["ev"] == "end"}
    # the redelivery took the workflow over with a new fence (the killed delivery could not write past it),
    # and the rest of the chain ran under that lease
    assert fence["crash"] > fence["s1"] and fence["s3"] == fence["crash"]
    # the step checkpointed before the kill did not repeat
    assert r.get(f"{cfg['prefix']}:effects:{tenant}") == "1"
    assert [x["charged"] for x in mine if "charged" in x] == [1, 1]
    assert not lease_of(r, cfg, tenant)


def test_a_gap_past_its_ttl_is_caught_the_late_member_fails_and_its_fence_is_stale(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    import sqlite3

    from celery_lockguard import create_fence_table

    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    db = str(tmp_path / "ledger.db")
    with sqlite3.connect(db) as conn:
        create_fence_table(conn)
        conn.execute("CREATE TABLE ledger (tenant TEXT, tag TEXT, fence INTEGER)")
    fenced = app.tasks["wf.fenced"]
    late = chain(fenced.s(tenant=tenant, tag="a1", db=db), fenced.s(tenant=tenant, tag="a2", db=db).set(countdown=4))
    a = workflow(late, lock_key=PIPELINE, tenant=tenant, gap_ttl=0.5).apply_async()
    wait_for(lambda: any(x["tag"] == "a1" and x["ev"] == "end" for x in rows(r, cfg, tenant)), 60, what="a1 to end")
    b = workflow(chain(fenced.s(tenant=tenant, tag="b1", db=db)), lock_key=PIPELINE, tenant=tenant).apply_async()
    assert b.get(timeout=60)["tags"] == ["b1"]
    with pytest.raises(LockLost):
        a.get(timeout=60)
    assert not any(x["tag"] == "a2" for x in rows(r, cfg, tenant)), "the late member ran after the gap expired"
    with sqlite3.connect(db) as conn:
        written = dict(conn.execute("SELECT tag, fence FROM ledger").fetchall())
        assert written.keys() == {"a1", "b1"} and written["b1"] > written["a1"]
        stale = type(
            "StaleLease",
            (),
            {
                "key": f"tenant:{tenant}:pipeline",
                "fence_row": f"tenant:{tenant}:pipeline",
                "fence": written["a1"],
                "several": False,
                "task_name": "t",
                "task_id": "x",
            },
        )()
        with pytest.raises(StaleFence):  # a write of the first workflow now would be refused
            advance_fence(conn, stale)  # type: ignore[arg-type]


def test_revoking_a_member_waiting_in_the_gap_frees_the_entity_at_once(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    sig = chain(step.s(tenant=tenant, tag="s1"), step.s(tenant=tenant, tag="s2").set(countdown=3))
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    wait_for(lambda: lease_of(r, cfg, tenant).get("state") == "gap", 60, what="s1 to hand the lease on")
    app.control.revoke(res.id)  # s2, the chain's last member, waiting for its countdown
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the revoked member's gap to be freed")
    assert [x["tag"] for x in rows(r, cfg, tenant) if x["ev"] == "start"] == ["s1"]


def chord_pipeline(app: Any, tenant: str, pages: int, fail: int = -1, **options: Any) -> Any:
    from celery import chord, group

    page, step = app.tasks["wf.page"], app.tasks["wf.collect"]
    header = group(page.s(tenant=tenant, tag=f"p{i:02d}", fail=i == fail) for i in range(pages))
    sig = chain(
        app.tasks["wf.step"].s(tenant=tenant, tag="fetch"),
        chord(header, step.s(tenant=tenant, tag="collect")),
        app.tasks["wf.step"].s(tenant=tenant, tag="publish"),
    )
    return workflow(sig, lock_key=PIPELINE, tenant=tenant, **options)


def test_a_chord_of_ten_pages_holds_one_lease_and_releases_after_the_callback(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=4)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant, other = f"t-{uuid.uuid4().hex[:6]}", f"t-{uuid.uuid4().hex[:6]}"
    res = chord_pipeline(app, tenant, 10).apply_async()
    second = pipeline(app, tenant, ["after"], on_locked="retry").apply_async()
    assert res.get(timeout=120)["tags"] == ["collect", "publish"]
    assert second.get(timeout=120)["tags"] == ["after"]
    mine = rows(r, cfg, tenant)
    pages = [x for x in mine if x["tag"].startswith("p0")]
    assert len([x for x in pages if x["ev"] == "start"]) == 10
    # one lease: every member, pages included, saw the workflow's key and fence, held
    fences = {x["fence"] for x in mine if x["tag"] != "after"}
    assert len(fences) == 1 and all(x["held"] for x in mine)
    starts = sorted(x["t"] for x in pages if x["ev"] == "start")
    ends = sorted(x["t"] for x in pages if x["ev"] == "end")
    assert starts[1] < ends[0], "the pages should have run in parallel"
    collect = next(x["t"] for x in mine if x["tag"] == "collect" and x["ev"] == "start")
    assert collect >= ends[-1]
    # the workflow held the entity from fetch to publish: the other workflow ran before or after, never inside
    whole = span(mine, {"fetch", "publish", "collect"} | {x["tag"] for x in pages})
    after = span(mine, {"after"})
    assert after[1] <= whole[0] or after[0] >= whole[1], f"a workflow ran inside the chord's: {after} {whole}"
    assert not lease_of(r, cfg, tenant)
    assert not rows(r, cfg, other)


def test_a_bare_group_is_refused_and_the_callback_its_error_suggests_ends_the_workflow(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=4)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step, page = app.tasks["wf.step"], app.tasks["wf.page"]
    pages = group(page.s(tenant=tenant, tag=f"p{n}") for n in range(4))
    with pytest.raises(ConfigurationError, match=r"chord\(group\(\.\.\.\), done\.s\(\)\)"):
        workflow(chain(step.s(tenant=tenant, tag="fetch"), pages), lock_key=PIPELINE, tenant=tenant)
    assert not rows(r, cfg, tenant) and not lease_of(r, cfg, tenant)  # refused at publish: nothing ran or held
    # what the error says to write: the no-op callback ends the lease when every page has ended
    sig = chain(step.s(tenant=tenant, tag="fetch"), pages, app.tasks["wf.done"].s())
    results = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async().get(timeout=120)
    assert sorted(t for p in results for t in p["tags"]) == ["fetch"] * 4 + [f"p{n}" for n in range(4)]
    assert len({x["fence"] for x in rows(r, cfg, tenant)}) == 1
    assert not lease_of(r, cfg, tenant)  # released by the callback, not left for the 300 s gap TTL
    assert pipeline(app, tenant, ["n1"]).apply_async().get(timeout=60)["tags"] == ["n1"]


def test_a_failing_page_releases_the_workflow_at_once(fleet: Fleet, broker_cfg: dict[str, Any]) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    res = chord_pipeline(app, tenant, 4, fail=2, gap_ttl=300).apply_async()
    with pytest.raises(Exception):  # noqa: B017 - Celery reports a chord failure as ChordError or the page's error
        res.get(timeout=90)
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the workflow lease to be released by the failing page")
    assert not any(x["tag"] in ("collect", "publish") for x in rows(r, cfg, tenant))


def test_a_redelivered_member_of_a_workflow_that_ended_is_dropped_not_run_again(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    """A broker redelivery (a lost ack) of a member after its workflow ended: no second run, no failure stored.

    The copies are the first member's very message (body and headers, as the broker would hand it
    back), and a copy of the middle member built from it.
    """
    from celery.signals import before_task_publish

    from celery_lockguard._headers import WORKFLOW

    cfg = broker_cfg
    worker = start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    sent: list[tuple[Any, dict[str, Any], str, str]] = []

    def grab(body: Any = None, headers: Any = None, routing_key: str = "", exchange: str = "", **_: Any) -> None:
        sent.append((body, dict(headers), routing_key, exchange))

    before_task_publish.connect(grab, weak=False)
    try:
        res = pipeline(app, tenant, ["s1", "s2", "s3"], seconds=0).apply_async()
    finally:
        before_task_publish.disconnect(grab)
    assert res.get(timeout=60)["tags"] == ["s1", "s2", "s3"]
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the workflow to release")
    body, hdrs, routing_key, exchange = sent[0]
    args, kwargs, embed = body
    middle_hdrs = {**hdrs, "id": res.parent.id, WORKFLOW: {**hdrs[WORKFLOW], "index": 1}}
    middle_body = (args, kwargs, {**embed, "chain": embed["chain"][:1]})  # the chain is stored last step first
    with app.producer_or_acquire() as producer:
        for b, h in ((body, hdrs), (middle_body, middle_hdrs)):
            producer.publish(b, routing_key=routing_key, exchange=exchange or "", headers=h, serializer="json")

    def dropped() -> int:
        lines = worker.output().splitlines()
        # A member whose result is stored is dropped as already_ran before the ended workflow is looked at.
        why = ("workflow_ended", "already_ran")
        return len([x for x in lines if "workflow.member_dropped" in x and tenant in x and any(w in x for w in why)])

    wait_for(lambda: dropped() == 2, 60, what="both stale copies to be dropped")
    assert [x["tag"] for x in rows(r, cfg, tenant) if x["ev"] == "start"] == ["s1", "s2", "s3"]
    assert res.state == "SUCCESS" and res.parent.state == "SUCCESS"  # nothing overwrote the results
    assert not lease_of(r, cfg, tenant)


def test_an_outage_at_the_hand_over_fails_the_member_visibly_the_next_is_not_dropped(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """The lock Redis is down when a member hands on, and back (with its data) before the next enters.

    The next member would find the lease still ``running`` at the previous one and be dropped as a
    stale copy: the chain would hang with no result. The member that could not hand on fails
    instead (``BackendUnavailable``), the chain stops visibly, and the lease frees within its TTL.
    """
    from celery_lockguard import BackendUnavailable

    with testing.RedisServer(persistent=True) as srv:
        cfg = make_cfg(prefix, redis_url, lock_url=srv.url)
        worker = start_worker(fleet, cfg)
        app = create_app(cfg)
        r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
        lock = srv.client()
        tenant = f"t-{uuid.uuid4().hex[:6]}"
        gate = tmp_path / "open"
        sig = chain(
            app.tasks["wf.gate"].s(tenant=tenant, tag="g", gate=str(gate)),
            app.tasks["wf.step"].s(tenant=tenant, tag="s2"),
        )
        res = workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=5, gap_ttl=300).apply_async()
        wait_for(lambda: any(x["tag"] == "g" for x in rows(r, cfg, tenant)), 60, what="the first member to run")
        srv.stop()
        gate.touch()
        wait_for(lambda: "hand on: " in worker.output(), 60, what="the hand-over to meet the outage")
        srv.start()
        with pytest.raises(BackendUnavailable):
            res.get(timeout=60)
        assert not any(x["tag"] == "s2" for x in rows(r, cfg, tenant))
        name = lock_name(cfg["prefix"], f"tenant:{tenant}:pipeline")
        wait_for(lambda: not lock.exists(name), 30, what="the lease, no longer renewed, to expire")


def test_a_member_whose_retries_run_out_releases_at_once(fleet: Fleet, broker_cfg: dict[str, Any]) -> None:
    """``retry()`` past ``max_retries``: the lease handed to the retry is released at once, not left to gap_ttl."""
    from celery.exceptions import MaxRetriesExceededError

    cfg = broker_cfg
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    sig = chain(
        step.s(tenant=tenant, tag="s1"),
        app.tasks["wf.retry_always"].s(tenant=tenant, tag="r"),
        step.s(tenant=tenant, tag="s3"),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    with pytest.raises(MaxRetriesExceededError):
        res.get(timeout=60)
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the lease to be released by the exhausted member")
    assert [x["retries"] for x in rows(r, cfg, tenant) if x["ev"] == "try"] == [0, 1]
    assert not any(x["tag"] == "s3" for x in rows(r, cfg, tenant))


def test_fail_open_at_one_member_runs_the_rest_unlocked_in_other_processes(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """``on_unavailable="fail_open"``: the lock Redis stalls only while the middle member enters. It runs
    unlocked, and so does the member after it, in another pool process (``max_tasks_per_child=1``: the
    headers Celery publishes carry it, not process memory); before, the next member found the lease still
    waiting for the middle one and was dropped, and the chain's result never came (review)."""
    with testing.RedisServer() as srv:
        cfg = make_cfg(prefix, redis_url, lock_url=srv.url, max_tasks_per_child=1)
        start_worker(fleet, cfg, concurrency=1)
        app = create_app(cfg)
        r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
        lock = srv.client()
        tenant = f"t-{uuid.uuid4().hex[:6]}"
        step = app.tasks["wf.step"]
        sig = chain(
            step.s(tenant=tenant, tag="a", seconds=0),
            step.s(tenant=tenant, tag="b", seconds=0).set(countdown=2),
            step.s(tenant=tenant, tag="c", seconds=0),
        )
        res = workflow(sig, lock_key=PIPELINE, tenant=tenant, on_unavailable="fail_open", gap_ttl=60).apply_async()
        name = lock_name(cfg["prefix"], f"tenant:{tenant}:pipeline")
        wait_for(lambda: lock.hget(name, "state") == "gap", 60, interval=0.01, what="the lease handed on to b")
        lock.execute_command("CLIENT", "PAUSE", "8000", "ALL")  # b's entry (due in 2 s) times out: fail_open
        assert res.get(timeout=60)["tags"] == ["a", "b", "c"]
        seen = {x["tag"]: x for x in rows(r, cfg, tenant) if x["ev"] == "start"}
        assert seen["a"]["fence"] is not None and seen["b"]["fence"] is None and seen["c"]["fence"] is None
        assert len({seen[t]["pid"] for t in "abc"}) == 3  # three pool processes: no process memory carried it


# -- issue 29: a workflow crossing a member's own lock, retry(), a failing chord page, another workflow --------


def started(r: redis.Redis, cfg: dict[str, Any], tenant: str, tag: str, ev: str = "start") -> bool:
    return any(x["tag"] == tag and x["ev"] == ev for x in rows(r, cfg, tenant))


def test_a_member_waiting_behind_a_long_holder_of_its_own_lock_keeps_the_workflow(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Issue 29 item 2: the member's own lock is held by a live task whose lock_ttl (5 s) outlasts the gap (2 s)
    and which runs 6 s. Each wait hands the workflow lease to the wait copy: for its countdown plus the publish
    grace, not the gap TTL alone (before: LockLost, ``workflow.lost reason=workflow_lease_gone``)."""
    cfg = make_cfg(prefix, redis_url)
    worker = start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant, inv = f"t-{uuid.uuid4().hex[:6]}", int(uuid.uuid4().int % 10**9)
    holder = app.tasks["wf.hold_invoice"].delay(tenant=tenant, tag="holder", invoice=inv, seconds=6)
    wait_for(lambda: started(r, cfg, tenant, "holder"), 60, what="the invoice's holder to start")
    step = app.tasks["wf.step"]
    sig = chain(
        step.s(tenant=tenant, tag="s1", seconds=0),
        app.tasks["wf.invoice"].s(tenant=tenant, tag="inv", invoice=inv),
        step.s(tenant=tenant, tag="s3", seconds=0),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, lock_ttl=5, gap_ttl=2).apply_async()
    assert res.get(timeout=120)["tags"] == ["s1", "inv", "s3"]
    assert holder.get(timeout=60)["tags"] == ["holder"]
    mine = rows(r, cfg, tenant)
    held_until = max(x["t"] for x in mine if x["tag"] == "holder")
    assert min(x["t"] for x in mine if x["tag"] == "inv") >= held_until  # it did wait for the holder
    assert len({x["wf_fence"] for x in mine if x["tag"] in ("s1", "inv", "s3")}) == 1  # one workflow lease
    assert "workflow.lost" not in worker.output()
    assert not lease_of(r, cfg, tenant)


def test_a_bare_retry_of_a_middle_member_keeps_the_workflow_past_the_gap(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Issue 29 item 9: ``raise self.retry(exc=exc)`` waits ``default_retry_delay`` (here 4 s) against a 2 s gap:
    the retry's countdown plus the publish grace is what the hand-over covers (before: LockLost)."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    sig = chain(
        step.s(tenant=tenant, tag="s1", seconds=0),
        app.tasks["wf.retry_bare"].s(tenant=tenant, tag="r"),
        step.s(tenant=tenant, tag="s3", seconds=0),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=2).apply_async()
    assert res.get(timeout=90)["tags"] == ["s1", "r", "s3"]
    mine = rows(r, cfg, tenant)
    tries = [x for x in mine if x["ev"] == "try"]
    assert [x["retries"] for x in tries] == [0, 1] and tries[1]["t"] - tries[0]["t"] >= 3.5  # the default delay
    assert len({x["fence"] for x in mine}) == 1 and all(x["held"] for x in mine)
    assert not lease_of(r, cfg, tenant)


def test_a_retrying_first_member_lets_no_other_work_into_the_workflow(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Issue 29 item 9: the first member retries after 4 s against a 2 s gap; a plain task on the entity
    published meanwhile runs after the workflow, not inside it (before: between the two tries)."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    sig = chain(
        app.tasks["wf.retry_bare"].s(tenant=tenant, tag="r"),
        app.tasks["wf.step"].s(tenant=tenant, tag="s2", seconds=0),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=2).apply_async()
    wait_for(lambda: started(r, cfg, tenant, "r", ev="try"), 60, what="the first try")
    plain = app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")
    assert res.get(timeout=90)["tags"] == ["r", "s2"]
    assert plain.get(timeout=90)["tags"] == ["plain"]
    mine = rows(r, cfg, tenant)
    whole = span(mine, {"r", "s2"})
    assert min(x["t"] for x in mine if x["tag"] == "plain") >= whole[1], "the plain task ran inside the workflow"
    assert len({x["fence"] for x in mine if x["tag"] in ("r", "s2")}) == 1


def test_a_chord_page_retrying_past_the_gap_keeps_the_workflow(fleet: Fleet, redis_url: str, prefix: str) -> None:
    """Issue 29 item 9: one page retries after 4 s, its sibling leaves at once: the last one out hands the slot
    on for the longest gap any page asked for (before: the 2 s gap lapsed and the retried page failed LockLost)."""
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    step = app.tasks["wf.step"]
    header = group(
        app.tasks["wf.page"].s(tenant=tenant, tag="p00", seconds=0.5),
        app.tasks["wf.retry_bare"].s(tenant=tenant, tag="p01", countdown=4),
    )
    sig = chain(
        step.s(tenant=tenant, tag="fetch", seconds=0),
        chord(header, app.tasks["wf.collect"].s(tenant=tenant, tag="collect")),
        step.s(tenant=tenant, tag="publish", seconds=0),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=2).apply_async()
    assert res.get(timeout=90)["tags"] == ["collect", "publish"]
    mine = rows(r, cfg, tenant)
    assert [x["retries"] for x in mine if x["ev"] == "try"] == [0, 1]
    assert len({x["fence"] for x in mine}) == 1 and all(x["held"] for x in mine)
    assert not lease_of(r, cfg, tenant)


def test_a_failing_chord_page_leaves_the_entity_to_its_siblings_and_no_result_stays_pending(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Issue 29 item 10: p01 fails while p00 runs and p02 is still queued (two pool processes). Before, the
    failure released the workflow: a plain task ran beside p00 and p02 was dropped (``Ignore``), its result
    PENDING forever. Now the pages keep the entity until the last leaves, then the workflow ends failed."""
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=2)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    page, step = app.tasks["wf.page"], app.tasks["wf.step"]
    ids = [uuid.uuid4().hex for _ in range(3)]
    header = group(page.s(tenant=tenant, tag=f"p{i:02d}", fail=i == 1, seconds=2).set(task_id=ids[i]) for i in range(3))
    sig = chain(
        step.s(tenant=tenant, tag="fetch", seconds=0),
        chord(header, app.tasks["wf.collect"].s(tenant=tenant, tag="collect")),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    wait_for(lambda: started(r, cfg, tenant, "p01"), 60, what="the failing page to run")
    plain = app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")
    with pytest.raises(Exception):  # noqa: B017 - Celery reports a chord failure as ChordError or the page's error
        res.get(timeout=90)
    states = lambda: [app.AsyncResult(i).state for i in ids]  # noqa: E731
    wait_for(lambda: "PENDING" not in states(), 60, what=f"every page's result to be stored ({states()})")
    assert states() == ["SUCCESS", "FAILURE", "SUCCESS"]
    assert plain.get(timeout=90)["tags"] == ["plain"]
    mine = rows(r, cfg, tenant)
    pages_end = max(x["t"] for x in mine if x["tag"].startswith("p0"))
    assert min(x["t"] for x in mine if x["tag"] == "plain") >= pages_end, "the plain task ran beside a page"
    assert not started(r, cfg, tenant, "collect")
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="the workflow to end after its last page")


def test_two_workflows_locking_each_others_entity_fail_one_visibly_and_the_other_finishes(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Issue 29 item 3: W1 holds the tenant and its member locks the invoice; W2 holds the invoice and its
    member locks the tenant. Before, both sat in ``gap`` and failed LockLost; now the member that finds the
    cycle fails with WorkflowDeadlock naming both entities, its workflow releases, and W1 finishes."""
    cfg = make_cfg(prefix, redis_url)
    worker = start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant, inv = f"t-{uuid.uuid4().hex[:6]}", int(uuid.uuid4().int % 10**9)
    step = app.tasks["wf.step"]
    w1 = chain(
        step.s(tenant=tenant, tag="w1", seconds=1), app.tasks["wf.invoice"].s(tenant=tenant, tag="inv", invoice=inv)
    )
    w2 = chain(step.s(tenant=tenant, tag="w2", seconds=3), app.tasks["wf.same_entity"].s(tenant=tenant, tag="ten"))
    first = workflow(w1, lock_key=PIPELINE, tenant=tenant, lock_ttl=5, gap_ttl=3).apply_async()
    second = workflow(w2, lock_key="invoice:{invoice}", invoice=inv, lock_ttl=5, gap_ttl=3).apply_async()
    outcome: dict[str, Any] = {}
    for name, res in (("w1", first), ("w2", second)):
        try:
            outcome[name] = res.get(timeout=90)
        except Exception as exc:  # noqa: BLE001 - WorkflowDeadlock is new: any other error fails below
            outcome[name] = exc
    # W1's member waits first (W2's first step runs 2 s longer), so W2's member is the one to find the cycle;
    # either way exactly one fails, visibly, and the other finishes
    failed = {n: v for n, v in outcome.items() if isinstance(v, BaseException)}
    assert len(failed) == 1, outcome
    ((loser, error),) = failed.items()
    assert type(error).__name__ == "WorkflowDeadlock", repr(error)
    said = str(error)
    assert f"invoice:{inv}" in said and f"tenant:{tenant}:pipeline" in said and "deadlock" in said
    winner = "w1" if loser == "w2" else "w2"
    assert outcome[winner]["tags"] == ([winner, "inv"] if winner == "w1" else [winner, "ten"])
    assert not started(r, cfg, tenant, "ten" if loser == "w2" else "inv")
    assert "workflow.deadlock" in worker.output()
    wait_for(lambda: not lease_of(r, cfg, tenant), 30, what="W1 to release")
    assert not r.exists(lock_name(cfg["prefix"], f"invoice:{inv}"))
