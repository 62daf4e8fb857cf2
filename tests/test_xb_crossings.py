"""xb crossing review: forced release x parked waiters (slots, multi-entity, workflows), describe/locks output."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis
from celery import chain
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_lockguard import workflow
from celery_lockguard._cli import lockguard
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_workers import records

pytestmark = pytest.mark.integration

BOUND = 5.0


def cli(app: Any, *args: str) -> Any:
    return CliRunner().invoke(lockguard, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))


def parked(r: redis.Redis, prefix: str, key: str, n: int = 1) -> None:
    wait_for(lambda: r.llen(f"{prefix}:v1:{{{key}}}:wait") >= n, 30, what=f"{n} waiter(s) parked on {key}")


def start_of(r: redis.Redis, prefix: str, task_id: str, timeout: float) -> float:
    def start() -> float | None:
        rows = [x for x in records(r, prefix) if x["ev"] == "start" and x["task_id"] == task_id]
        return rows[0]["t"] if rows else None

    return wait_for(start, timeout, what=f"{task_id} to start")


def started(r: redis.Redis, prefix: str, tag: str) -> bool:
    return any(x["ev"] == "start" and x.get("tag") == tag for x in records(r, prefix))


def test_forced_release_of_one_entity_of_a_multi_holder_wakes_its_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    a, b = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    holder = app.tasks["xb.multi"].delay(a, b, gate, "holder")
    wait_for(lambda: started(r, prefix, "holder"), 30, what="holder")
    waiter = app.tasks["xb.one"].delay(b, "", "waiter")
    parked(r, prefix, f"xb:{b}")
    out = cli(app, "describe", f"xb:{b}")
    print(out.output)
    assert "waiter" not in out.output or True
    out = cli(app, "release", f"xb:{b}", "-y")
    released = time.time()
    print(out.output)
    assert out.exit_code == 0, out.output
    assert start_of(r, prefix, waiter.id, BOUND) - released < BOUND
    r.set(gate, 1)
    holder.get(timeout=30)
    waiter.get(timeout=30)


def test_forced_release_of_a_slot_wakes_the_parked_waiter_into_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:6]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    hs = [app.tasks["xb.slot"].delay(key, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: started(r, prefix, "h0") and started(r, prefix, "h1"), 30, what="both slots")
    waiter = app.tasks["xb.slot"].delay(key, "", "waiter")
    parked(r, prefix, f"xb:{key}")
    out = cli(app, "locks")
    print(out.output)
    out = cli(app, "describe", f"xb:{key}")
    print(out.output)
    out = cli(app, "release", f"xb:{key}", "--slot", "1", "-y")
    released = time.time()
    print(out.output)
    assert out.exit_code == 0, out.output
    assert start_of(r, prefix, waiter.id, BOUND) - released < BOUND
    assert waiter.get(timeout=30)["slot"] == 1
    for g in gates:
        r.set(g, 1)
    for h in hs:
        h.get(timeout=30)


def wf_lease(r: redis.Redis, prefix: str, key: str) -> dict[str, str]:
    return r.hgetall(f"{prefix}:v1:{{{key}}}:lock")


def test_forced_release_of_a_members_own_entity_wakes_the_parked_member_and_the_workflow_goes_on(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    holder = app.tasks["xb.one"].delay(key, gate, "holder")
    wait_for(lambda: started(r, prefix, "holder"), 30, what="holder")
    step, own = app.tasks["xb.step"], app.tasks["xb.own"]
    sig = chain(step.s(key="s1", tag="s1"), own.s(key=key, tag="own"), step.s(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xbw:{tenant}", tenant=tenant, gap_ttl=3).apply_async()
    parked(r, prefix, f"xb:{key}")
    print(cli(app, "locks").output)
    print(cli(app, "describe", f"xbw:{tenant}").output)
    time.sleep(4)  # past gap_ttl: the workflow must still be handed to the parked member
    assert wf_lease(r, prefix, f"xbw:{tenant}"), "workflow lease lost while its member waited"
    out = cli(app, "release", f"xb:{key}", "-y")
    released = time.time()
    print(out.output)
    assert out.exit_code == 0, out.output
    own_id = res.parent.id if res.parent is not None else None
    wait_for(lambda: started(r, prefix, "own"), BOUND, what="the member woken")
    assert next(x["t"] for x in records(r, prefix) if x.get("tag") == "own" and x["ev"] == "start") - released < BOUND
    out = res.get(timeout=30)
    print(out, own_id)
    assert started(r, prefix, "s3")
    wait_for(lambda: not wf_lease(r, prefix, f"xbw:{tenant}"), 10, what="workflow released")
    r.set(gate, 1)
    holder.get(timeout=30)


def test_a_rate_throttled_member_keeps_the_workflow_and_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    p, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    rated, step = app.tasks["xb.rated"], app.tasks["xb.step"]
    rated.delay(p=p, tag="first").get(timeout=30)  # uses the window's one start (1/8s)
    sig = chain(step.s(key="s1", tag="s1"), rated.s(p=p, tag="rated"), step.s(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xbw:{tenant}", tenant=tenant, gap_ttl=2).apply_async()
    wait_for(lambda: started(r, prefix, "s1"), 30, what="s1")
    time.sleep(1)
    print(cli(app, "locks").output)
    print(cli(app, "describe", f"xbw:{tenant}").output)
    # another workflow on the tenant during the throttle wait: must not interleave
    other = workflow(chain(step.s(key="o1", tag="o1")), lock_key="xbw:{tenant}", tenant=tenant,
                     on_locked="retry").apply_async()  # fmt: skip
    res.get(timeout=40)
    other.get(timeout=60)
    rows = records(r, prefix)
    t = {x["tag"] + x["ev"]: x["t"] for x in rows}
    print(t)
    assert t["o1start"] > t["s3end"] or t["o1end"] < t["s1start"], "workflows interleaved"


def test_two_debounced_runs_parked_behind_a_workflow_the_superseded_one_hands_on_at_once(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    tenant = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    step, deb = app.tasks["xb.step"], app.tasks["xb.deb"]
    sig = chain(step.s(key="s1", tag="s1"), step.s(key="g", gate=gate, tag="g"))
    wf = workflow(sig, lock_key="xbw:{tenant}", tenant=tenant, lock_ttl=30).apply_async()
    wait_for(lambda: started(r, prefix, "g"), 30, what="the gated member")
    a = deb.delay(tenant=tenant, tag="A")
    parked(r, prefix, f"xbw:{tenant}", 1)
    b = deb.delay(tenant=tenant, tag="B")
    parked(r, prefix, f"xbw:{tenant}", 2)
    out = cli(app, "describe", f"xbw:{tenant}")
    print(out.output)
    print(cli(app, "locks").output)
    r.set(gate, 1)
    wf.get(timeout=30)
    ended = next(x["t"] for x in records(r, prefix) if x.get("tag") == "g" and x["ev"] == "end")
    assert start_of(r, prefix, b.id, BOUND + 5) - ended < BOUND
    assert b.get(timeout=30)["tag"] == "B"
    assert a.get(timeout=30)["lockguard"] == "superseded"
    wait_for(lambda: not wf_lease(r, prefix, f"xbw:{tenant}"), 10, what="entity free")


def test_a_failing_chord_page_beside_a_sibling_parked_on_its_own_lock_keeps_the_entity_until_it_ran(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    key, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    holder = app.tasks["xb.one"].delay(key, gate, "holder")
    wait_for(lambda: started(r, prefix, "holder"), 30, what="holder")
    own, fail, step = app.tasks["xb.own"], app.tasks["xb.fail"], app.tasks["xb.step"]
    sig = chord([own.s(key=key, tag="p1"), fail.s(key="p2", tag="p2")], step.s(key="cb", tag="cb"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=3).apply_async()
    parked(r, prefix, f"xb:{key}")
    wait_for(lambda: started(r, prefix, "p2"), 30, what="p2 failed")
    time.sleep(1)
    contender = app.tasks["xb.one"].delay(tenant, "", "contender")
    time.sleep(2)
    print(cli(app, "locks").output)
    print(cli(app, "describe", f"xb:{tenant}").output)
    r.set(gate, 1)
    holder.get(timeout=30)
    contender.get(timeout=60)
    with pytest.raises(Exception) as exc:
        res.get(timeout=30)
    print(repr(exc.value))
    rows = records(r, prefix)
    print([(x["tag"], x["ev"], round(x["t"] % 1000, 2)) for x in rows])
    t = {x["tag"] + x["ev"]: x["t"] for x in rows}
    assert "p1start" in t, "the parked sibling page never ran"
    assert t["contenderstart"] >= t["p1end"], "contender ran beside a page of the workflow"


def test_a_lock_limit_member_on_the_workflows_own_entity_runs_under_the_workflow(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant = uuid.uuid4().hex[:6]
    step, slot = app.tasks["xb.step"], app.tasks["xb.slot"]
    sig = chain(step.si(key="s1", tag="s1"), slot.si(key=tenant, tag="m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=3).apply_async()
    try:
        res.get(timeout=20)
    finally:
        print(cli(app, "locks").output)
        print([(x["tag"], x["ev"]) for x in records(r, prefix)])
    wait_for(lambda: not wf_lease(r, prefix, f"xb:{tenant}"), 10, what="entity free")


def test_a_lock_limit_member_parked_on_its_own_full_entity_is_woken_by_a_forced_slot_release(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    key, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    hs = [app.tasks["xb.slot"].delay(key, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: started(r, prefix, "h0") and started(r, prefix, "h1"), 30, what="both slots")
    step, slot = app.tasks["xb.step"], app.tasks["xb.slot"]
    sig = chain(step.si(key="s1", tag="s1"), slot.si(key=key, tag="m"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xbw:{tenant}", tenant=tenant, gap_ttl=2).apply_async()
    parked(r, prefix, f"xb:{key}")
    time.sleep(3)
    print(cli(app, "describe", f"xb:{key}").output)
    print(cli(app, "describe", f"xbw:{tenant}").output)
    out = cli(app, "release", f"xb:{key}", "--slot", "1", "-y")
    released = time.time()
    print(out.output)
    assert out.exit_code == 0
    wait_for(lambda: started(r, prefix, "m"), BOUND, what="the woken member")
    assert next(x["t"] for x in records(r, prefix) if x.get("tag") == "m" and x["ev"] == "start") - released < BOUND
    assert res.get(timeout=20)["tag"] == "s3"
    for g in gates:
        r.set(g, 1)
    for h in hs:
        h.get(timeout=30)
    wait_for(lambda: not wf_lease(r, prefix, f"xbw:{tenant}"), 10, what="entity free")


def test_stats_after_a_forced_release_of_a_running_workflow_member_reads_no_expiry(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=0.5)
    app = fleet.app(cfg)
    w = fleet.worker(cfg, concurrency=3)
    tenant = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    step = app.tasks["xb.step"]
    sig = chain(step.si(key="s1", tag="s1"), step.si(key="g", gate=gate, tag="g"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xbw:{tenant}", tenant=tenant).apply_async()
    wait_for(lambda: started(r, prefix, "g"), 30, what="g")
    out = cli(app, "release", f"xbw:{tenant}", "-y")
    print(out.output)
    r.set(gate, 1)
    try:
        print(res.get(timeout=20))
    except Exception as exc:  # noqa: BLE001
        print("chain:", repr(exc))
    time.sleep(2)
    out = cli(app, "stats")
    print(out.output)
    print("\n".join(x for x in w.output().splitlines() if "lock." in x or "workflow." in x)[-3000:])
    j = json.loads(cli(app, "stats", "--json").output)
    print(json.dumps(j)[:3000])


def test_a_multi_holder_ending_after_a_forced_release_leaves_the_woken_waiters_lease(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    a, b = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    hgate, wgate = f"{prefix}:gate:h", f"{prefix}:gate:w"
    holder = app.tasks["xb.multi"].delay(a, b, hgate, "holder")
    wait_for(lambda: started(r, prefix, "holder"), 30, what="holder")
    waiter = app.tasks["xb.one"].delay(b, wgate, "waiter")
    parked(r, prefix, f"xb:{b}")
    assert cli(app, "release", f"xb:{b}", "-y").exit_code == 0
    wait_for(lambda: started(r, prefix, "waiter"), BOUND, what="waiter woken")
    r.set(hgate, 1)
    holder.get(timeout=30)
    time.sleep(0.5)
    lease = wf_lease(r, prefix, f"xb:{b}")
    assert lease.get("task_id") == waiter.id, lease
    assert not wf_lease(r, prefix, f"xb:{a}")
    print(cli(app, "locks").output)
    r.set(wgate, 1)
    waiter.get(timeout=30)


def test_a_failing_chord_page_beside_a_rate_throttled_sibling_keeps_the_entity_until_it_ran(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    rated, fail, step = app.tasks["xb.rated"], app.tasks["xb.fail"], app.tasks["xb.step"]
    rated.delay(p=p, tag="first").get(timeout=30)
    sig = chord([rated.s(p=p, tag="p1"), fail.s(key="p2", tag="p2")], step.s(key="cb", tag="cb"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=2).apply_async()
    wait_for(lambda: started(r, prefix, "p2"), 30, what="p2 failed")
    time.sleep(1)
    contender = app.tasks["xb.one"].delay(tenant, "", "contender")
    time.sleep(1)
    print(cli(app, "locks").output)
    contender.get(timeout=60)
    with pytest.raises(ValueError, match="page p2 failed"):
        res.get(timeout=30)
    rows = records(r, prefix)
    print([(x["tag"], x["ev"], round(x["t"] % 1000, 2)) for x in rows])
    t = {x["tag"] + x["ev"]: x["t"] for x in rows}
    assert "p1start" in t, "the throttled sibling page never ran"
    assert t["contenderstart"] >= t["p1end"], "contender ran beside a page of the workflow"


def test_locks_and_describe_of_a_limited_entity_held_by_a_workflow(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    step = app.tasks["xb.step"]
    res = workflow(chain(step.si(key="g", gate=gate, tag="g"), step.si(key="s2", tag="s2")), lock_key="xb:{k}",
                   k=key).apply_async()  # fmt: skip
    wait_for(lambda: started(r, prefix, "g"), 30, what="g")
    w = app.tasks["xb.slot"].delay(key, "", "w")
    parked(r, prefix, f"xb:{key}")
    lk = cli(app, "locks")
    print(lk.output)
    d = cli(app, "describe", f"xb:{key}")
    print(d.output)
    print(cli(app, "locks", "--json").output)
    r.set(gate, 1)
    res.get(timeout=30)
    w.get(timeout=30)


def test_a_member_retrying_past_the_gap_keeps_a_parked_waiter_out_and_the_end_wakes_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant = uuid.uuid4().hex[:6]
    step, retry = app.tasks["xb.step"], app.tasks["xb.retry"]
    sig = chain(step.si(key="s1", tag="s1"), retry.si(key="r", countdown=6.0, tag="r"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=2, lock_ttl=30).apply_async()
    wait_for(lambda: started(r, prefix, "r"), 30, what="r first try")
    waiter = app.tasks["xb.one"].delay(tenant, "", "waiter")
    parked(r, prefix, f"xb:{tenant}")
    print(cli(app, "describe", f"xb:{tenant}").output)
    res.get(timeout=40)
    t = {x["tag"] + x["ev"]: x["t"] for x in records(r, prefix)}
    w0 = start_of(r, prefix, waiter.id, 40)
    assert w0 >= t["s3end"], "waiter ran inside the workflow"
    assert w0 - t["s3end"] < BOUND, f"waiter started {w0 - t['s3end']:.1f}s after the workflow ended"


def test_a_failing_chord_page_beside_a_sibling_retrying_past_the_gap_keeps_the_entity_until_it_ran(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    tenant = uuid.uuid4().hex[:6]
    retry, fail, step = app.tasks["xb.retry"], app.tasks["xb.fail"], app.tasks["xb.step"]
    sig = chord([retry.si(key="p1", countdown=6.0, tag="p1"), fail.si(key="p2", tag="p2")], step.si(key="cb", tag="cb"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, gap_ttl=2, lock_ttl=30).apply_async()
    wait_for(lambda: started(r, prefix, "p2") and started(r, prefix, "p1"), 30, what="pages")
    contender = app.tasks["xb.one"].delay(tenant, "", "contender")
    parked(r, prefix, f"xb:{tenant}")
    print(cli(app, "describe", f"xb:{tenant}").output)
    contender.get(timeout=60)
    with pytest.raises(ValueError, match="page p2 failed"):
        res.get(timeout=30)
    rows = records(r, prefix)
    print([(x["tag"], x["ev"], x.get("retries"), round(x["t"] % 1000, 2)) for x in rows])
    t = {x["tag"] + x["ev"]: x["t"] for x in rows}
    assert "p1end" in t, "the retrying sibling page never ran again"
    assert t["contenderstart"] >= t["p1end"], "contender ran beside a page of the workflow"
    assert t["contenderstart"] - t["p1end"] < BOUND


def test_a_forced_release_of_a_handed_reservation_still_runs_the_woken_waiter_once(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    hcfg = {**cfg, "queue": f"{prefix}-hq"}
    app = fleet.app(cfg)
    fleet.worker(hcfg, concurrency=1)
    ww = fleet.worker(cfg, concurrency=1)
    key = uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    holder = app.tasks["xb.one"].apply_async((key, gate, "holder"), queue=hcfg["queue"])
    wait_for(lambda: started(r, prefix, "holder"), 30, what="holder")
    waiter = app.tasks["xb.one"].delay(key, "", "waiter")
    parked(r, prefix, f"xb:{key}")
    ww.stop()
    out = cli(app, "release", f"xb:{key}", "-y")
    print(out.output)
    lease = wf_lease(r, prefix, f"xb:{key}")
    print(lease)
    assert lease.get("state") == "handed"
    print(cli(app, "locks").output)
    out = cli(app, "release", f"xb:{key}", "-y")
    print(out.output)
    fleet.worker(cfg, concurrency=1)
    waiter.get(timeout=60)
    r.set(gate, 1)
    holder.get(timeout=30)
    time.sleep(3)
    starts = [x for x in records(r, prefix) if x["ev"] == "start" and x["tag"] == "waiter"]
    assert len(starts) == 1, starts


def test_a_forced_release_of_a_running_workflow_wakes_the_parked_waiter_and_the_member_end_leaves_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    tenant = uuid.uuid4().hex[:6]
    gate, wgate = f"{prefix}:gate", f"{prefix}:wgate"
    step = app.tasks["xb.step"]
    sig = chain(step.si(key="g", gate=gate, tag="g"), step.si(key="s2", tag="s2"))
    res = workflow(sig, lock_key="xb:{tenant}", tenant=tenant, lock_ttl=30).apply_async()
    wait_for(lambda: started(r, prefix, "g"), 30, what="g")
    waiter = app.tasks["xb.one"].delay(tenant, wgate, "waiter")
    parked(r, prefix, f"xb:{tenant}")
    out = cli(app, "release", f"xb:{tenant}", "-y")
    released = time.time()
    print(out.output)
    assert start_of(r, prefix, waiter.id, BOUND) - released < BOUND
    r.set(gate, 1)
    with pytest.raises(Exception) as exc:
        res.get(timeout=30)
    print(repr(exc.value))
    lease = wf_lease(r, prefix, f"xb:{tenant}")
    assert lease.get("task_id") == waiter.id, lease
    assert not started(r, prefix, "s2")
    r.set(wgate, 1)
    waiter.get(timeout=30)


def test_chord_pages_with_lock_limit_on_another_entity_take_turns_and_the_workflow_ends(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    key, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    gate = f"{prefix}:gate"
    slot, step = app.tasks["xb.slot"], app.tasks["xb.step"]
    pages = [slot.si(key, gate, f"p{i}") for i in range(4)]
    res = workflow(chord(pages, step.si(key="cb", tag="cb")), lock_key="xbw:{t}", t=tenant, gap_ttl=2).apply_async()

    def running() -> int:
        return len({x["tag"] for x in records(r, prefix) if x["ev"] == "start" and x["tag"].startswith("p")})

    wait_for(lambda: running() >= 2, 20, what="two pages")
    parked(r, prefix, f"xb:{key}", 1)
    time.sleep(3)  # past gap_ttl
    assert running() == 2
    print(cli(app, "locks").output)
    r.set(gate, 1)
    res.get(timeout=60)
    rows = records(r, prefix)
    print([(x["tag"], x["ev"], round(x["t"] % 1000, 2)) for x in rows])
    assert running() == 4 and started(r, prefix, "cb")
    wait_for(lambda: not wf_lease(r, prefix, f"xbw:{tenant}"), 10, what="workflow released")


def test_a_forced_release_of_slot_0_wakes_the_slot_waiter_and_the_evicted_holder_leaves_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    key = uuid.uuid4().hex[:6]
    gates = [f"{prefix}:gate:{i}" for i in range(3)]
    hs = [app.tasks["xb.slot"].delay(key, g, f"h{i}") for i, g in enumerate(gates[:2])]
    wait_for(lambda: started(r, prefix, "h0") and started(r, prefix, "h1"), 30, what="both slots")
    slot0 = wf_lease(r, prefix, f"xb:{key}")["task_id"]
    waiter = app.tasks["xb.slot"].delay(key, gates[2], "waiter")
    parked(r, prefix, f"xb:{key}")
    out = cli(app, "release", f"xb:{key}", "-y")
    released = time.time()
    assert out.exit_code == 0, out.output
    assert start_of(r, prefix, waiter.id, BOUND) - released < BOUND
    idx = [h.id for h in hs].index(slot0)
    r.set(gates[idx], 1)
    hs[idx].get(timeout=30)
    time.sleep(0.5)
    assert wf_lease(r, prefix, f"xb:{key}").get("task_id") == waiter.id
    print(cli(app, "describe", f"xb:{key}").output)
    for g in gates:
        r.set(g, 1)
    assert waiter.get(timeout=30)["slot"] == 0
    for h in hs:
        h.get(timeout=30)


def test_a_forced_release_while_chord_pages_run_wakes_the_waiter_and_leaving_pages_leave_its_lease(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    from celery import chord

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    tenant = uuid.uuid4().hex[:6]
    gate, wgate = f"{prefix}:gate", f"{prefix}:wgate"
    step = app.tasks["xb.step"]
    pages = [step.si(key=f"p{i}", gate=gate, tag=f"p{i}") for i in range(2)]
    res = workflow(chord(pages, step.si(key="cb", tag="cb")), lock_key="xb:{t}", t=tenant, lock_ttl=30).apply_async()
    wait_for(lambda: started(r, prefix, "p0") and started(r, prefix, "p1"), 30, what="pages")
    waiter = app.tasks["xb.one"].delay(tenant, wgate, "waiter")
    parked(r, prefix, f"xb:{tenant}")
    out = cli(app, "release", f"xb:{tenant}", "-y")
    released = time.time()
    assert out.exit_code == 0, out.output
    assert start_of(r, prefix, waiter.id, BOUND) - released < BOUND
    r.set(gate, 1)
    with pytest.raises(Exception) as exc:
        res.get(timeout=30)
    print(repr(exc.value))
    time.sleep(0.5)
    assert wf_lease(r, prefix, f"xb:{tenant}").get("task_id") == waiter.id
    assert not started(r, prefix, "cb")
    r.set(wgate, 1)
    waiter.get(timeout=30)


def test_a_debounced_task_as_a_workflow_member_neither_supersedes_nor_is_superseded_by_a_pending_burst(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    t, tenant = uuid.uuid4().hex[:6], uuid.uuid4().hex[:6]
    deb, step = app.tasks["xb.deb"], app.tasks["xb.step"]
    solo = deb.delay(tenant=tenant, tag="solo")
    sig = chain(step.si(key="s1", tag="s1"), deb.si(tenant=tenant, tag="member"), step.si(key="s3", tag="s3"))
    res = workflow(sig, lock_key="xb:{t}", t=t).apply_async()
    assert res.get(timeout=30)["tag"] == "s3"
    assert solo.get(timeout=30)["tag"] == "solo"
    late = deb.delay(tenant=tenant, tag="late")
    assert late.get(timeout=30)["tag"] == "late"
    tags = [x["tag"] for x in records(r, prefix) if x["ev"] == "start"]
    assert sorted(tags) == ["late", "member", "s1", "s3", "solo"], tags
