"""Fresh-context review of issue 29's crossings: two features at a time, real prefork workers, real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis

from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .harness import ROOT
from .test_wake_workers import BOUND, CLI_APP, hold, parked, started
from .test_workers import records

pytestmark = pytest.mark.integration


def test_until_done_raise_accepted_behind_other_work_waits_then_retries_to_success(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Crossing 3: until_done + on_locked='raise' x retry(): published while different work holds the
    entity (accepted: its claim queues behind it), delivered while it still runs: it waits, runs, and its
    retry copies (the claim handed over) run too; nothing fails LockContended."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    other = app.tasks["rv.other"].delay(key, 3.0)
    wait_for(lambda: any(x["tag"] == "other" for x in records(r, prefix, key)), 30, what="other work to start")
    res = app.tasks["rv.ud_raise_retry"].delay(key, 1.0)
    assert res.get(timeout=60) == {"retries": 2}
    assert other.get(timeout=30) == {"tag": "other"}
    starts = [x for x in records(r, prefix, key) if x["ev"] == "start"]
    assert [x["tag"] for x in starts] == ["other", "ud", "ud", "ud"], starts


def test_revoked_parked_waiter_is_skipped_by_the_cli_forced_release_wake(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Crossing 7: two waiters parked; the oldest is revoked; the forced release must get the next one
    running within BOUND, not after its 30 s safety copy."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    key = uuid.uuid4().hex[:8]
    hold(r, prefix, key)
    first = app.tasks["wake_task"].delay(key, "", "first")
    parked(r, prefix, f"wake:{key}", 1)
    second = app.tasks["wake_task"].delay(key, "", "second")
    parked(r, prefix, f"wake:{key}", 2)
    app.control.revoke(first.id)
    time.sleep(1.0)  # let the worker learn the revoke (a broadcast; no ack to wait for)
    (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"wake:{key}", "-y"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    released_at = time.time()
    assert out.returncode == 0, out.stderr
    assert started(r, prefix, second.id, BOUND + 3) - released_at < BOUND + 3, out.stdout
    assert second.get(timeout=30)["tag"] == "second"
    assert not [x for x in records(r, prefix) if x.get("task_id") == first.id], "the revoked waiter ran"


def test_a_woken_debounced_run_that_retries_keeps_its_burst_and_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Crossing 4: a debounced run parks behind a foreign holder, is woken by the release, retries once:
    the retry runs (not superseded, not re-debounced), and a later publish still runs after it."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate:{key}"
    task = app.tasks["rv.deb_retry"]
    v1 = task.delay(key, "v1", 0, gate)  # holds the entity until the gate opens
    wait_for(lambda: any(x["tag"] == "v1" for x in records(r, prefix, key)), 30, what="v1 to start")
    a = task.delay(key, "A", 1)  # the next burst's run: parks behind v1, woken by v1's release
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rv:{key}}}:wait") >= 1, 30, what="A to park")
    r.set(gate, 1)
    assert v1.get(timeout=30)["tag"] == "v1"
    out = a.get(timeout=30)
    assert out == {"tag": "A", "retries": 1}, out
    starts = [(x["tag"], x["retries"]) for x in records(r, prefix, key) if x["ev"] == "start"]
    assert starts == [("v1", 0), ("A", 0), ("A", 1)], starts
    b = task.delay(key, "B", 0)
    assert b.get(timeout=30)["tag"] == "B"


def test_a_debounced_retry_while_a_new_burst_is_pending(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Crossing 4b: run A retries (countdown 0.5 s); B is published during A's body: B's burst is due
    0.5 s later. The entity must not end on A's arguments: B's run is the last start."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate:{key}"
    task = app.tasks["rv.deb_retry"]
    a = task.delay(key, "A", 1, gate)
    wait_for(lambda: any(x["tag"] == "A" for x in records(r, prefix, key)), 30, what="A to start")
    b = task.delay(key, "B", 0)
    r.set(gate, 1)
    out_b = b.get(timeout=30)
    out_a = a.get(timeout=30)
    rows = records(r, prefix, key)
    ends = [x["tag"] for x in rows if x["ev"] == "end"]
    assert ends and ends[-1] == "B", (ends, out_a, out_b)
    assert out_b["tag"] == "B"


@pytest.mark.parametrize("shared", [True, False], ids=["shared_ns", "no_ns"])
def test_namespace_records_and_checkpoints_cross_tasks_only_when_shared(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, shared: bool
) -> None:
    """Crossing 6: a shared idempotency_namespace answers the other task's record and replays its
    checkpoint; without it, never -- plain calls and workflow members alike."""
    from celery import chain

    from celery_lockguard import workflow

    ns = {"ns_a": "billing", "ns_b": "billing"} if shared else {}
    cfg = make_cfg(prefix, redis_url, **ns)
    app = fleet.app(cfg)
    fleet.worker(cfg)
    # completion records, plain calls
    ref = uuid.uuid4().hex[:8]
    assert app.tasks["rv.idem_a"].delay(ref).get(timeout=30) == {"by": "a"}
    got = app.tasks["rv.idem_b"].delay(ref).get(timeout=30)
    assert got == ({"by": "a"} if shared else {"by": "b"}), got
    # checkpoints: a dies after its checkpoint (no record), b's checkpoint of the same name
    ref2 = uuid.uuid4().hex[:8]
    with pytest.raises(ValueError):
        app.tasks["rv.cp_a"].delay(ref2, True).get(timeout=30)
    got = app.tasks["rv.cp_b"].delay(ref2).get(timeout=30)
    assert got == {"by": "b", "effect_by": "a" if shared else "b"}, got
    effects = [x["tag"] for x in records(r, prefix, ref2) if x["ev"] == "effect"]
    assert effects == (["a"] if shared else ["a", "b"]), effects
    # workflow members
    ref3 = uuid.uuid4().hex[:8]
    sig = chain(app.tasks["rv.idem_a"].si(ref3), app.tasks["rv.idem_b"].si(ref3))
    res = workflow(sig, lock_key="rvwf:{ref}", ref=ref3, app=app).apply_async()
    got = res.get(timeout=60)
    assert got == ({"by": "a"} if shared else {"by": "b"}), got
    ran = [x["tag"] for x in records(r, prefix, ref3) if x["ev"] == "start"]
    assert ran == (["a"] if shared else ["a", "b"]), ran


def _spans(r: redis.Redis, prefix: str, p: str) -> dict[str, tuple[int, int]]:
    rows = [x for x in records(r, prefix, p) if "at" in x]
    starts = {x["task_id"]: (x["tag"], x["at"]) for x in rows if x["ev"] == "start"}
    return {starts[x["task_id"]][0]: (starts[x["task_id"]][1], x["at"]) for x in rows if x["ev"] == "end"}


@pytest.mark.parametrize("how", ["gates", "cli"])
def test_workflow_member_exclusive_and_a_shared_waiter_parked_behind_two_slots(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path, how: str
) -> None:
    """Crossing 2 + 5: a workflow member taking the single lease of rvp:{p} and a lock_limit=2 export
    both park behind two export slots (exclusive head, shared behind). The slots end (their bodies end,
    or the operator force-releases both): the member runs alone, then the export; the workflow finishes,
    all within a bound far below the 20 s safety countdowns."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    exp = app.tasks["rv.exp"]
    holders = [exp.delay(p, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix, p) if x["ev"] == "start"]) == 2, 30, what="both slots")
    sig = chain(app.tasks["rv.del"].si(p, "", "d"), app.tasks["rv.after"].si(p))
    wf = workflow(sig, lock_key="rvwf:{p}", p=p, app=app).apply_async()
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 1, 30, what="the member to park")
    e = exp.delay(p, "", "e")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 2, 30, what="the export to park")
    if how == "gates":
        for g in gates:
            r.set(g, 1)
    else:
        (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
        env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
        for slot in (0, 1):
            out = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"rvp:{p}",
                 "--slot", str(slot), "-y"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
            )  # fmt: skip
            assert out.returncode == 0, (out.stdout, out.stderr)
    freed = time.time()
    assert wf.get(timeout=60) == {"tag": "after"}
    assert e.get(timeout=60)["tag"] == "e"
    rows = records(r, prefix, p)
    t_d = next(x["t"] for x in rows if x["ev"] == "start" and x["tag"] == "d")
    t_e = next(x["t"] for x in rows if x["ev"] == "start" and x["tag"] == "e")
    assert t_d - freed < BOUND and t_e - freed < BOUND + 2, (t_d - freed, t_e - freed, rows)
    if how == "gates":
        spans = _spans(r, prefix, p)
        for x in ("h0", "h1", "e"):
            assert spans[x][1] <= spans["d"][0] or spans["d"][1] <= spans[x][0], (x, spans)
    else:
        for g in gates:
            r.set(g, 1)
        for h in holders:
            h.get(timeout=30)


def test_revoked_shared_waiter_is_skipped_by_a_forced_slot_release(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Crossing 7 on slots: two lock_limit waiters parked behind two slots; the oldest is revoked; the
    operator force-releases one slot: the other waiter runs in it within the bound."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["wake_limited"]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    holders = [task.delay(key, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix) if x["ev"] == "start"]) == 2, 30, what="both slots taken")
    from celery_lockguard._headers import WAITS

    first = task.apply_async((key, "", "first"), headers={WAITS: 6})
    parked(r, prefix, f"wake:{key}", 1)
    second = task.apply_async((key, "", "second"), headers={WAITS: 6})
    parked(r, prefix, f"wake:{key}", 2)
    app.control.revoke(first.id)
    time.sleep(1.0)  # the revoke is a broadcast with no ack
    (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"wake:{key}", "--slot", "1", "-y"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    released_at = time.time()
    assert out.returncode == 0, out.stderr
    assert started(r, prefix, second.id, BOUND + 3) - released_at < BOUND + 3, out.stdout
    assert second.get(timeout=30)["tag"] == "second"
    assert not [x for x in records(r, prefix) if x.get("task_id") == first.id], "the revoked waiter ran"
    for g in gates:
        r.set(g, 1)
    for h in holders:
        h.get(timeout=30)


def test_a_workflow_on_a_limited_entity_excludes_slots_and_its_end_wakes_the_shared_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Workflow lease x lock_limit slots on one entity: the workflow waits for both slots, runs alone
    (through its gap), and its end wakes the export parked behind it within the bound."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    gates = [f"{prefix}:gate:{i}" for i in range(3)]
    exp = app.tasks["rv.exp"]
    holders = [exp.delay(p, g, f"h{i}") for i, g in enumerate(gates[:2])]
    wait_for(lambda: len([x for x in records(r, prefix, p) if x["ev"] == "start"]) == 2, 30, what="both slots")
    m = app.tasks["rv.wfgate"]
    sig = chain(m.si(p, "", "m1"), m.si(p, gates[2], "m2"))
    wf = workflow(sig, lock_key="rvp:{p}", p=p, app=app, gap_ttl=60).apply_async()
    time.sleep(1.0)
    for g in gates[:2]:
        r.set(g, 1)
    wait_for(lambda: any(x["tag"] == "m2" for x in records(r, prefix, p)), 30, what="m2 to start")
    e = exp.delay(p, "", "e")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 1, 30, what="the export to park")
    r.set(gates[2], 1)
    wf.get(timeout=60)
    ended = time.time()
    assert e.get(timeout=60)["tag"] == "e"
    rows = records(r, prefix, p)
    t_e = next(x["t"] for x in rows if x["ev"] == "start" and x["tag"] == "e")
    assert t_e - ended < BOUND, (t_e - ended, rows)
    spans = _spans(r, prefix, p)
    for x in ("h0", "h1", "e"):
        for mm in ("m1", "m2"):
            assert spans[x][1] <= spans[mm][0] or spans[mm][1] <= spans[x][0], (x, mm, spans)
    for h in holders:
        h.get(timeout=30)


def test_a_failing_chord_page_ends_the_workflow_and_the_end_wakes_the_parked_plain_task(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """Chord page failure x every lease end wakes: the plain task parked behind the workflow (gap_ttl 300:
    its safety copy is a minute away) starts within the bound after the last page leaves the entity."""
    from celery import chain, chord, group

    from celery_lockguard import workflow

    from .test_workflow_workers import lease_of, rows, start_worker
    from .test_workflow_workers import started as wf_started
    from .workflowapp import PIPELINE, create_app

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    page, step = app.tasks["wf.page"], app.tasks["wf.step"]
    header = group(page.s(tenant=tenant, tag=f"p{i:02d}", fail=i == 1, seconds=2) for i in range(3))
    sig = chain(
        step.s(tenant=tenant, tag="fetch", seconds=0),
        chord(header, app.tasks["wf.collect"].s(tenant=tenant, tag="collect")),
    )
    res = workflow(sig, lock_key=PIPELINE, tenant=tenant, gap_ttl=300).apply_async()
    wait_for(lambda: wf_started(r, cfg, tenant, "p01"), 60, what="the failing page to run")
    plain = app.tasks["wf.plain"].delay(tenant=tenant, tag="plain")
    parked(r, prefix, f"tenant:{tenant}:pipeline")
    with pytest.raises(Exception):  # noqa: B017 - ChordError or the page's error
        res.get(timeout=90)
    wait_for(lambda: not lease_of(r, cfg, tenant) or lease_of(r, cfg, tenant).get("task_name") == "wf.plain", 60,
             what="the workflow to end")  # fmt: skip
    ended = time.time()
    assert plain.get(timeout=90)["tags"] == ["plain"]
    t_plain = next(x["t"] for x in rows(r, cfg, tenant) if x["tag"] == "plain" and x["ev"] == "start")
    pages_end = max(x["t"] for x in rows(r, cfg, tenant) if x["tag"].startswith("p0"))
    assert t_plain >= pages_end
    assert t_plain - ended < BOUND, f"woken {t_plain - ended:.1f} s after the workflow ended"


def test_the_deadlock_loser_releasing_wakes_the_winner_member_parked_on_its_entity(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """WorkflowDeadlock x wake: W1's member parks on the invoice W2 holds; W2's member finds the cycle and
    W2 releases the invoice: W1's member must start within the bound (its own safety copy is later)."""
    from celery import chain

    from celery_lockguard import workflow

    from .test_workflow_workers import rows, start_worker
    from .workflowapp import PIPELINE, create_app

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    tenant, inv = f"t-{uuid.uuid4().hex[:6]}", int(uuid.uuid4().int % 10**9)
    step = app.tasks["wf.step"]
    w1 = chain(
        step.s(tenant=tenant, tag="w1", seconds=1), app.tasks["wf.invoice"].s(tenant=tenant, tag="inv", invoice=inv)
    )
    w2 = chain(step.s(tenant=tenant, tag="w2", seconds=3), app.tasks["wf.same_entity"].s(tenant=tenant, tag="ten"))
    first = workflow(w1, lock_key=PIPELINE, tenant=tenant, lock_ttl=30, gap_ttl=60).apply_async()
    second = workflow(w2, lock_key="invoice:{invoice}", invoice=inv, lock_ttl=30, gap_ttl=60).apply_async()
    with pytest.raises(Exception) as err:
        second.get(timeout=90)
    assert type(err.value).__name__ == "WorkflowDeadlock", repr(err.value)
    failed_at = time.time()
    assert first.get(timeout=90)["tags"] == ["w1", "inv"]
    t_inv = next(x["t"] for x in rows(r, cfg, tenant) if x["tag"] == "inv" and x["ev"] == "start")
    assert t_inv - failed_at < BOUND, f"W1's member started {t_inv - failed_at:.1f} s after W2 failed"


def test_woken_waiters_on_a_rated_limited_entity_keep_the_rate_and_all_run(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """lock_rate x slots: two waiters behind both slots (a rated task backs off, never parks: docs/model.md)
    must keep the window once the slots free (never a third start inside 3 s), and both run."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    task = app.tasks["rv.rated"]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    holders = [task.delay(p, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix, p) if x["ev"] == "start"]) == 2, 30, what="both slots")
    waiters = [task.delay(p, "", f"w{i}") for i in range(2)]  # a rated task never parks: it backs off
    wait_for(lambda: len([x for x in records(r, prefix) if x.get("ev") == "start"]) == 2, 30, what="both slots")
    for g in gates:
        r.set(g, 1)
    for w in waiters:
        assert w.get(timeout=60)["tag"].startswith("w")
    for h in holders:
        h.get(timeout=30)
    starts = sorted(x["at"] for x in records(r, prefix, p) if x["ev"] == "start")
    assert len(starts) == 4, starts
    for a, b in zip(starts, starts[2:], strict=False):
        assert b - a >= 3000 - 50, f"three starts inside one 3 s window: {starts}"


def test_until_started_raise_retry_meets_an_identical_copy_running_and_is_not_lost(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_started + on_locked='raise' x retry(): A runs and retries (countdown 1 s); B, identical work,
    is published meanwhile (accepted) and runs 3 s: A's retry copy arrives while B runs. Neither fails:
    A's retry runs after B (it is A's own copy, accepted long ago) or is answered as B's duplicate."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["rv.us_raise_retry"]
    a = task.delay(key, "x", 1, 1.0, 0.1)
    wait_for(lambda: any(x["ev"] == "start" for x in records(r, prefix, key)), 30, what="A to start")
    time.sleep(0.3)  # A is in its retry countdown
    b = task.delay(key, "x", 0, 1.0, 3.0)
    out_a = a.get(timeout=60, propagate=False)
    out_b = b.get(timeout=60, propagate=False)
    assert a.state == "SUCCESS" and b.state == "SUCCESS", (a.state, out_a, b.state, out_b)


def test_the_end_of_an_exclusive_lease_admits_every_parked_shared_waiter_a_slot_is_free_for(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Single lease x lock_limit x wake: two lock_limit=2 waiters park behind the exclusive single lease of
    their entity. Its end frees the whole entity (two slots): both should start within the bound, as a
    read/write lock admits every waiting reader when the writer leaves. w0 holds its slot (gate) so that
    w1 cannot be woken by w0's release instead."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    hold(r, prefix, key)  # the exclusive single lease of wake:{key}, 30 s
    task = app.tasks["wake_limited"]
    gate = f"{prefix}:gate:w0"
    w0 = task.delay(key, gate, "w0")
    parked(r, prefix, f"wake:{key}", 1)
    w1 = task.delay(key, "", "w1")
    parked(r, prefix, f"wake:{key}", 2)
    (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"wake:{key}", "-y"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    released_at = time.time()
    assert out.returncode == 0, out.stderr
    try:
        assert started(r, prefix, w0.id, BOUND) - released_at < BOUND
        t1 = started(r, prefix, w1.id, 40)
        assert t1 - released_at < BOUND, f"w1 started {t1 - released_at:.1f} s after the entity was wholly free"
    finally:
        r.set(gate, 1)
    assert w0.get(timeout=30)["tag"] == "w0" and w1.get(timeout=30)["tag"] == "w1"


def test_a_single_lease_task_release_admits_both_parked_limit_waiters(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """The same through a plain RELEASE: wake_task (single lease) holds wake:{key}; two wake_limited
    (lock_limit=2) calls park behind it; its body ends: both slots are free, both waiters should start."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    hgate, gate = f"{prefix}:gate:holder", f"{prefix}:gate:w0"
    holder = app.tasks["wake_task"].delay(key, hgate, "holder")
    wait_for(lambda: records(r, prefix), 30, what="the holder to start")
    task = app.tasks["wake_limited"]
    w0 = task.delay(key, gate, "w0")
    parked(r, prefix, f"wake:{key}", 1)
    w1 = task.delay(key, "", "w1")
    parked(r, prefix, f"wake:{key}", 2)
    r.set(hgate, 1)
    holder.get(timeout=30)
    ended = next(x["t"] for x in records(r, prefix) if x["tag"] == "holder" and x["ev"] == "end")
    try:
        assert started(r, prefix, w0.id, BOUND) - ended < BOUND
        t1 = started(r, prefix, w1.id, 40)
        assert t1 - ended < BOUND, f"w1 started {t1 - ended:.1f} s after the single lease ended (both slots free)"
    finally:
        r.set(gate, 1)
    assert w1.get(timeout=30)["tag"] == "w1"


def test_new_work_published_from_a_workflow_member_on_the_workflow_entity_waits_for_the_workflow(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Workflow x self-republish marker / workflow context: a member's body publishes *new* work (not a
    member) on the workflow's entity. It is other work: it must not run inside the workflow beside m2."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    p = uuid.uuid4().hex[:8]
    sig = chain(app.tasks["rv.spawn"].si(p), app.tasks["rv.wfgate"].si(p, "", "m2", 2.0))
    wf = workflow(sig, lock_key="rvp:{p}", p=p, app=app).apply_async()
    wf.get(timeout=60)
    child_id = wait_for(lambda: r.get(f"{prefix}:child:{p}"), 30, what="the child id")
    app.AsyncResult(child_id).get(timeout=60)
    spans = _spans(r, prefix, p)
    assert spans["child"][0] >= spans["m2"][1] or spans["child"][1] <= spans["m2"][0], spans


@pytest.mark.parametrize("victim", [0, 1])
def test_a_slot_holder_terminated_from_the_main_process_wakes_the_parked_waiter(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, victim: int
) -> None:
    """SHORTEN + WAKE timer x lock_limit: the holder of slot 0 or 1 is SIGKILLed by a terminate-revoke:
    the main process cuts *its slot* to the grace and the grace's end wakes the parked waiter into it."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["wake_limited"]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    holders = [task.delay(key, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix) if x["ev"] == "start"]) == 2, 30, what="both slots taken")
    slots = {x["tag"]: x for x in records(r, prefix) if x["ev"] == "start"}
    base = f"{prefix}:v1:{{wake:{key}}}:lock"
    lease_slot = {h.id: s for s in (0, 1) for h in holders if r.hget(base + (f":{s}" if s else ""), "task_id") == h.id}
    target = next(h for h in holders if lease_slot.get(h.id) == victim)
    waiter = task.delay(key, "", "waiter")
    parked(r, prefix, f"wake:{key}", 1)
    app.control.revoke(target.id, terminate=True, signal="SIGKILL")
    revoked_at = time.time()
    try:
        t = started(r, prefix, waiter.id, BOUND + 30)
        assert t - revoked_at < BOUND + 2, f"waiter started {t - revoked_at:.1f} s after slot {victim}'s holder died"
    finally:
        for g in gates:
            r.set(g, 1)
    assert waiter.get(timeout=30)["slot"] == victim, slots


def test_a_forced_release_wakes_a_parked_debounced_run_at_once_and_it_stays_the_bursts_run(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Debounce x park x CLI forced release: the operator's app (no such task registered) wakes the parked
    debounced run: it starts within the bound (not a debounce later, not re-debounced), its caller gets its
    result, and a later publish still runs once after it."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate:{key}"
    task = app.tasks["rv.deb_retry"]
    v1 = task.delay(key, "v1", 0, gate)
    wait_for(lambda: any(x["tag"] == "v1" for x in records(r, prefix, key)), 30, what="v1 to start")
    a = task.delay(key, "A", 0)
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rv:{key}}}:wait") >= 1, 30, what="A to park")
    (tmp_path / "opsapp.py").write_text(textwrap.dedent(CLI_APP))
    env = {**os.environ, "LG_CONFIG": json.dumps(cfg), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "opsapp", "lockguard", "release", f"rv:{key}", "-y"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    released_at = time.time()
    assert out.returncode == 0, out.stderr
    try:
        assert started(r, prefix, a.id, BOUND) - released_at < BOUND, out.stdout
    finally:
        r.set(gate, 1)
    assert a.get(timeout=30) == {"tag": "A", "retries": 0}
    v1.get(timeout=30)
    b = task.delay(key, "B", 0)
    assert b.get(timeout=30)["tag"] == "B"
    tags = [x["tag"] for x in records(r, prefix, key) if x["ev"] == "start"]
    assert tags == ["v1", "A", "B"], tags


def test_a_woken_copy_keeps_the_queue_its_waiter_was_published_to(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Park/wake x routing: the holder runs on worker A (queue q1), the waiter was sent to q2 (worker B
    only). The releaser on A publishes the woken copy: it must go to q2 and run on B, within the bound."""
    cfg_a = make_cfg(prefix, redis_url)
    cfg_b = make_cfg(prefix, redis_url, queue=f"{prefix}-q2")
    app = fleet.app(cfg_a)
    wa = fleet.worker(cfg_a)
    wb = fleet.worker(cfg_b)
    key = uuid.uuid4().hex[:8]
    gate = f"{prefix}:gate:{key}"
    task = app.tasks["rv.routed"]
    holder = task.delay(key, gate, "holder")
    wait_for(lambda: records(r, prefix, key), 30, what="the holder to start")
    waiter = task.apply_async((key, "", "waiter"), queue=cfg_b["queue"])
    parked(r, prefix, f"rq:{key}")
    r.set(gate, 1)
    assert holder.get(timeout=30)["hostname"] == wa.nodename
    ended = next(x["t"] for x in records(r, prefix, key) if x["tag"] == "holder" and x["ev"] == "end")
    t = started(r, prefix, waiter.id, 40)
    out = waiter.get(timeout=30)
    assert t - ended < BOUND, f"woken after {t - ended:.1f} s"
    assert out["hostname"] == wb.nodename, (out, wa.nodename, wb.nodename)


def test_a_revoked_exclusive_head_waiter_hands_on_to_the_shared_waiter_behind_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """Revoke x exclusive/shared waiter kinds: the delete (exclusive) parks first behind two export slots,
    an export (shared) behind it; the delete is revoked. When the slots end, the revoked delete's woken
    copy is discarded and must hand on: the export starts within the bound of the last slot's end."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    gates = [f"{prefix}:gate:{i}" for i in range(2)]
    exp = app.tasks["rv.exp"]
    holders = [exp.delay(p, g, f"h{i}") for i, g in enumerate(gates)]
    wait_for(lambda: len([x for x in records(r, prefix, p) if x["ev"] == "start"]) == 2, 30, what="both slots")
    d = app.tasks["rv.del"].delay(p, "", "d")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 1, 30, what="the delete to park")
    e = exp.delay(p, "", "e")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 2, 30, what="the export to park")
    app.control.revoke(d.id)
    time.sleep(1.0)  # the revoke is a broadcast with no ack
    for g in gates:
        r.set(g, 1)
    for h in holders:
        h.get(timeout=30)
    last_end = max(x["t"] for x in records(r, prefix, p) if x["ev"] == "end" and x["tag"] in ("h0", "h1"))
    t = started(r, prefix, e.id, 40)
    assert t - last_end < BOUND, f"the export started {t - last_end:.1f} s after the last slot ended"
    assert not any(x["tag"] == "d" for x in records(r, prefix, p)), "the revoked delete ran"


def test_two_different_until_done_raise_calls_both_retrying_on_one_entity_both_finish(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done + raise x retry() x different work queued behind: A runs and retries twice (its claim
    handed over each time); B (other arguments) was accepted behind A and retries twice too. Both
    finish; their runs never interleave (until_done holds the entity across a call's retries)."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=3)
    key = uuid.uuid4().hex[:8]
    task = app.tasks["rv.ud_raise_retry"]
    a = task.delay(key, 1.0)
    wait_for(lambda: records(r, prefix, key), 30, what="A to start")
    b = task.delay(key, 0.5)
    assert a.get(timeout=90) == {"retries": 2}
    assert b.get(timeout=90) == {"retries": 2}
    ids = [x["task_id"] for x in records(r, prefix, key) if x["ev"] == "start"]
    assert ids == [a.id] * 3 + [b.id] * 3, ids


def test_the_end_of_a_workflow_admits_both_parked_export_waiters(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """The same defect through a workflow's end: two lock_limit=2 exports park behind the workflow on
    their entity; when it ends both slots are free, yet (observed) only the oldest is woken."""
    from celery import chain

    from celery_lockguard import workflow

    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=4)
    p = uuid.uuid4().hex[:8]
    mgate, egate = f"{prefix}:gate:m", f"{prefix}:gate:e0"
    m = app.tasks["rv.wfgate"]
    wf = workflow(chain(m.si(p, mgate, "m1")), lock_key="rvp:{p}", p=p, app=app).apply_async()
    wait_for(lambda: any(x["tag"] == "m1" for x in records(r, prefix, p)), 30, what="the member to start")
    exp = app.tasks["rv.exp"]
    e0 = exp.delay(p, egate, "e0")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 1, 30, what="e0 to park")
    e1 = exp.delay(p, "", "e1")
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rvp:{p}}}:wait") >= 2, 30, what="e1 to park")
    r.set(mgate, 1)
    wf.get(timeout=30)
    ended = next(x["t"] for x in records(r, prefix, p) if x["tag"] == "m1" and x["ev"] == "end")
    try:
        assert started(r, prefix, e0.id, BOUND) - ended < BOUND
        t1 = started(r, prefix, e1.id, 40)
        assert t1 - ended < BOUND, f"e1 started {t1 - ended:.1f} s after the workflow ended (both slots free)"
    finally:
        r.set(egate, 1)
    assert e1.get(timeout=30)["tag"] == "e1"


def test_a_revoked_until_done_claim_wakes_the_waiter_parked_behind_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """until_done claim x park/wake x revoke: an until_done call published with a countdown holds the
    entity as a queued claim; different work parks behind it; the call is revoked and its claim freed
    (RELEASE_CLAIM from the worker's main process). That is a lease end: the waiter should start within
    the bound, not at its safety copy."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    lock = f"{prefix}:v1:{{rv:{key}}}:lock"
    ud = app.tasks["rv.ud_raise_retry"].apply_async((key, 1.0), countdown=4)
    wait_for(lambda: r.hget(lock, "task_id") == ud.id, 30, what="the until_done claim")
    other = app.tasks["rv.other"].delay(key, 0.2)
    holder = r.hgetall(lock)
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rv:{key}}}:wait") >= 1 or records(r, prefix, key), 30,
             what="the other work to park (or run)")  # fmt: skip
    assert not records(r, prefix, key), f"other work ran beside the until_done claim {holder}"
    app.control.revoke(ud.id)
    wait_for(lambda: r.hget(lock, "task_id") != ud.id, 30, what="the revoked call's claim to be freed")
    freed = time.time()
    t = started(r, prefix, other.id, 40)
    assert t - freed < BOUND, f"the waiter started {t - freed:.1f} s after the claim was freed ({holder})"
    assert other.get(timeout=30) == {"tag": "other"}


def test_an_expired_until_done_claim_wakes_the_waiter_parked_behind_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis
) -> None:
    """As above, through expiry: the until_done message expires before it is due; the worker discards it
    and frees its claim: the waiter parked behind the claim should start within the bound."""
    cfg = make_cfg(prefix, redis_url)
    app = fleet.app(cfg)
    fleet.worker(cfg, concurrency=2)
    key = uuid.uuid4().hex[:8]
    lock = f"{prefix}:v1:{{rv:{key}}}:lock"
    ud = app.tasks["rv.ud_raise_retry"].apply_async((key, 1.0), countdown=4, expires=2)
    wait_for(lambda: r.hget(lock, "task_id") == ud.id, 30, what="the until_done claim")
    other = app.tasks["rv.other"].delay(key, 0.2)
    wait_for(lambda: r.llen(f"{prefix}:v1:{{rv:{key}}}:wait") >= 1, 30, what="the other work to park")
    wait_for(lambda: r.hget(lock, "task_id") != ud.id, 30, what="the expired call's claim to be freed")
    freed = time.time()
    t = started(r, prefix, other.id, 40)
    assert t - freed < BOUND, f"the waiter started {t - freed:.1f} s after the claim was freed"
