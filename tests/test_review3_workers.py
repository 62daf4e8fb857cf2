"""Review 3 (fresh context) of d8b365f..main, real prefork workers of ``tests.workflowapp``: WORKFLOW_FORFEIT
crossed with a member's retry() (see tests/test_review3_forfeit.py for the same through the tracer)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis
from celery import chain
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_lockguard import workflow
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_workflow_workers import rows, start_worker
from .test_xreview3_workflows import XFER, force_release, held
from .workflowapp import create_app

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_member_that_retries_after_an_account_was_forced_away_ends_the_chain_visibly(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Path, forced: str
) -> None:
    """forfeit x retry(): an operator releases one account while member 2 runs; member 2 then retries. Its
    hand-over finds the loss, forfeits (the other account freed, the workflow marked ended) and publishes the
    retry. The chain must end visibly (LockLost, or WorkflowEnded, a LockLost), both accounts free, s3 never run.

    Failed before its fix (confirmed defect): the retry copy met WORKFLOW_ENTER's 'ended' and, its state being
    RETRY (not PENDING), was dropped silently (Ignore): the chain's result never became ready."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=2)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    gate = tmp_path / "open"
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.gate_retry"].s(tenant=t, tag="r", gate=str(gate)),
        app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "r" for x in rows(r, cfg, t)), 60, what="member r's first try")
    force_release(app, f"account:{a if forced == 'anchor' else b}")
    gate.touch()
    try:
        res.get(timeout=20)
        outcome = "ran"
    except CeleryTimeout:
        outcome = f"no result after 20 s (r's state: {res.parent.state if res.parent else '?'})"
    except Exception as err:  # noqa: BLE001
        outcome = type(err).__name__
    assert outcome in ("LockLost", "WorkflowEnded"), outcome  # WorkflowEnded is a LockLost
    assert not any(x["tag"] == "s3" for x in rows(r, cfg, t))
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 10, what="both accounts to be free")


def test_a_chord_page_sigkilled_under_a_forfeited_workflow_leaves_the_accounts_to_their_ttl(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """forfeit 'leave' x a chord page SIGKILLed (acks_late: its count in ``active`` never leaves): one account is
    forced away while the other page runs; the chain fails visibly (the callback finds the loss) and the account
    still the workflow's is free within its lock_ttl of the last live page's end, never held longer."""
    from celery import chord, group

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    gate = tmp_path / "p0-ends"  # p0 runs until the account is forced away (a page of 4 s raced it in CI)
    header = group(
        app.tasks["wf.gate"].s(tenant=t, tag="p0", gate=str(gate)),
        app.tasks["wf.crash_once"].s(tenant=t, tag="k"),
    )
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        chord(header, app.tasks["wf.collect"].s(tenant=t, tag="collect")),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=5, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "p0" for x in rows(r, cfg, t)), 60, what="page p0 to start")
    wait_for(lambda: sum(x["tag"] == "k" for x in rows(r, cfg, t)) >= 2, 30, what="page k to die and come back")
    force_release(app, f"account:{b}")
    gate.touch()
    p0_end = wait_for(
        lambda: next((x["t"] for x in rows(r, cfg, t) if x["tag"] == "p0" and x["ev"] == "end"), None),
        30,
        what="page p0 to end",
    )
    try:
        res.get(timeout=30)
        outcome = "ran"
    except CeleryTimeout:
        outcome = "no result"
    except Exception as err:  # noqa: BLE001
        outcome = type(err).__name__
    assert outcome == "LockLost", (outcome, rows(r, cfg, t))
    wait_for(lambda: not held(r, cfg, a), max(0.5, p0_end + 5 + 2 - time.time()), what=f"account {a} to lapse")
    assert not held(r, cfg, b)
