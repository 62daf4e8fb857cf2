"""Integration: a workflow over several entities (``lock_key`` as a sequence) on real prefork workers.

The chain holds every account from its first member to its last, gaps included; plain tasks and other
workflows on any of them wait and then run; opposite orders never deadlock; a failing member frees
every account and wakes each one's waiter.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain

from celery_lockguard import workflow
from celery_lockguard._keys import lock_name, wait_name
from celery_lockguard.testing import wait_for

from .conftest import Fleet
from .test_workflow_workers import rows, span, start_worker
from .workflowapp import create_app

pytestmark = pytest.mark.integration

XFER = ("account:{src}", "account:{dst}")


def transfer(app: Any, tenant: str, src: str, dst: str, tags: list[str], gate: str = "", **options: Any) -> Any:
    """A chain over two accounts: an optional gated first member, then a step per tag (0.1 s each)."""
    step = app.tasks["wf.step"]
    members = [app.tasks["wf.gate"].s(tenant=tenant, tag=f"{tags[0]}-gate", gate=gate)] if gate else []
    members += [step.s(tenant=tenant, tag=t, seconds=0.1) for t in tags]
    return workflow(chain(*members), lock_key=XFER, src=src, dst=dst, **options)


def held(r: redis.Redis, cfg: dict[str, Any], acct: str) -> dict[str, str]:
    return r.hgetall(lock_name(cfg["prefix"], f"account:{acct}"))


def test_a_chain_over_two_accounts_holds_both_through_its_gaps_others_wait_then_run(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b, c = f"{t}-a", f"{t}-b", f"{t}-c"
    gate = tmp_path / "open"
    opts = {"lock_ttl": 5, "gap_ttl": 10, "on_locked": "retry"}
    first = transfer(app, t, b, a, ["w1", "w1b", "w1c"], gate=str(gate), **opts).apply_async()
    wait_for(lambda: any(x["tag"] == "w1-gate" for x in rows(r, cfg, t)), 60, what="the first transfer to start")
    lease_a, lease_b = held(r, cfg, a), held(r, cfg, b)
    assert lease_a["token"] == lease_b["token"] and lease_a["workflow"] == lease_b["workflow"]
    assert lease_a["siblings"] == f'["account:{b}"]' and lease_b["siblings"] == f'["account:{a}"]'
    # plain tasks on either account, and a workflow on an overlapping set, named in the other order
    plain_a = app.tasks["wf.account"].delay(tenant=t, tag="plain-a", acct=a)
    plain_b = app.tasks["wf.account"].delay(tenant=t, tag="plain-b", acct=b)
    second = transfer(app, t, c, b, ["w2", "w2b"], **opts).apply_async()
    gate.touch()
    assert first.get(timeout=90)["tags"] == ["w1-gate", "w1", "w1b", "w1c"]
    assert second.get(timeout=90)["tags"] == ["w2", "w2b"]
    assert plain_a.get(timeout=90)["tags"] == ["plain-a"] and plain_b.get(timeout=90)["tags"] == ["plain-b"]
    mine = rows(r, cfg, t)
    w1 = span(mine, {"w1-gate", "w1", "w1b", "w1c"})
    w2 = span(mine, {"w2", "w2b"})
    for tag in ("plain-a", "plain-b", "w2"):
        assert span(mine, {tag})[0] >= w1[1], f"{tag} ran inside the first transfer (gaps included)"
    # every member of a transfer saw both accounts with one fence each, the same in every member
    fences1 = {str(x["fences"]) for x in mine if x["tag"] in {"w1-gate", "w1", "w1b", "w1c"}}
    fences2 = {str(x["fences"]) for x in mine if x["tag"] in {"w2", "w2b"}}
    assert len(fences1) == 1 and len(fences2) == 1, (fences1, fences2)
    f1 = next(x["fences"] for x in mine if x["tag"] == "w1")
    f2 = next(x["fences"] for x in mine if x["tag"] == "w2")
    assert set(f1) == {f"account:{a}", f"account:{b}"} and set(f2) == {f"account:{b}", f"account:{c}"}
    assert f2[f"account:{b}"] > f1[f"account:{b}"], "the shared account's fence rises"
    assert w2[0] >= w1[1]
    wait_for(lambda: not any(held(r, cfg, x) for x in (a, b, c)), 30, what="every account to be free")


def test_two_transfers_in_opposite_orders_never_deadlock_nor_interleave(
    fleet: Fleet, broker_cfg: dict[str, Any]
) -> None:
    cfg = broker_cfg
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = f"{t}-a", f"{t}-b"
    opts = {"lock_ttl": 5, "gap_ttl": 10, "on_locked": "retry"}
    # published together, half naming (a, b), half (b, a)
    pairs = [(a, b) if i % 2 else (b, a) for i in range(4)]
    results = [
        transfer(app, t, src, dst, [f"x{i}", f"x{i}b"], **opts).apply_async() for i, (src, dst) in enumerate(pairs)
    ]
    for i, res in enumerate(results):
        assert res.get(timeout=120)["tags"] == [f"x{i}", f"x{i}b"]
    mine = rows(r, cfg, t)
    spans = sorted(span(mine, {f"x{i}", f"x{i}b"}) for i in range(4))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"two transfers on the same accounts overlapped: {spans}"
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 30, what="both accounts to be free")


def test_a_failing_member_frees_every_account_at_once_and_wakes_their_waiters(
    fleet: Fleet, broker_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = broker_cfg
    worker = start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = f"{t}-a", f"{t}-b"
    gate = tmp_path / "open"
    sig = chain(
        app.tasks["wf.gate"].s(tenant=t, tag="g", gate=str(gate)),
        app.tasks["wf.fail"].s(tenant=t, tag="boom"),
        app.tasks["wf.step"].s(tenant=t, tag="never"),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "g" for x in rows(r, cfg, t)), 60, what="the transfer to start")
    plain_a = app.tasks["wf.account"].delay(tenant=t, tag="plain-a", acct=a)
    plain_b = app.tasks["wf.account"].delay(tenant=t, tag="plain-b", acct=b)
    wait_for(
        lambda: all(r.llen(wait_name(cfg["prefix"], f"account:{x}")) for x in (a, b)),
        30,
        what="a waiter parked on each account",
    )
    gate.touch()
    with pytest.raises(ValueError, match="boom failed"):
        res.get(timeout=60)
    # freed by the failing member (not the 300 s gap, not the 60 s TTL); each account's waiter is woken
    assert plain_a.get(timeout=20)["tags"] == ["plain-a"] and plain_b.get(timeout=20)["tags"] == ["plain-b"]
    mine = rows(r, cfg, t)
    assert [x["tag"] for x in mine if x["ev"] == "start" and x["tag"] in ("g", "boom", "never")] == [
        "g",
        "boom",
    ]
    out = worker.output().splitlines()
    said = [x for x in out if "workflow.released_on_error" in x and t in x]
    assert len(said) == 1 and "reason=failed" in said[0], said
    # woken by the release (lock.woken is a DEBUG event): their safety copies were due after the 60 s lease
    failed_at = next(x["t"] for x in mine if x["tag"] == "boom")
    for tag in ("plain-a", "plain-b"):
        assert span(mine, {tag})[0] - failed_at < 5, f"{tag} was not woken by the release"
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 30, what="both accounts to be free")
