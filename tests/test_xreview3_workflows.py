"""Third fresh-context review, workflow crossings: real prefork workers of ``tests.workflowapp``, real Redis."""

from __future__ import annotations

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
from celery_lockguard._keys import lock_name, wait_name
from celery_lockguard.testing import wait_for

from .conftest import Fleet, make_cfg
from .test_wake_workers import BOUND
from .test_workflow_workers import rows, span, start_worker
from .workflowapp import create_app

pytestmark = pytest.mark.integration

XFER = ("account:{src}", "account:{dst}")


def held(r: redis.Redis, cfg: dict[str, Any], acct: str) -> dict[str, str]:
    return r.hgetall(lock_name(cfg["prefix"], f"account:{acct}"))


def force_release(app: Any, key: str) -> str:
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    out = CliRunner().invoke(lockguard, ["release", key, "--yes"], obj=obj)
    assert out.exit_code == 0, out.output
    return out.output


def started_at(r: redis.Redis, cfg: dict[str, Any], t: str, tag: str, timeout: float) -> float:
    def start() -> float | None:
        hit = [x["t"] for x in rows(r, cfg, t) if x["tag"] == tag and x["ev"] == "start"]
        return hit[0] if hit else None

    return wait_for(start, timeout, what=f"{tag} to start")


def test_a_multi_entity_workflow_member_retrying_past_the_gap_keeps_every_account(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """workflow over two entities x a member's retry(countdown > gap_ttl): both accounts stay held through
    the countdown (a plain task on either waits), the retry runs under the workflow, and the end frees both."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = f"{t}-a", f"{t}-b"
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.retry_bare"].s(tenant=t, tag="r", countdown=6),
        app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=5, gap_ttl=2).apply_async()
    wait_for(lambda: any(x["tag"] == "r" for x in rows(r, cfg, t)), 60, what="the member's first try")
    plain_a = app.tasks["wf.account"].delay(tenant=t, tag="plain-a", acct=a)
    plain_b = app.tasks["wf.account"].delay(tenant=t, tag="plain-b", acct=b)
    assert res.get(timeout=90)["tags"] == ["s1", "r", "s3"]
    assert plain_a.get(timeout=60)["tags"] == ["plain-a"] and plain_b.get(timeout=60)["tags"] == ["plain-b"]
    mine = rows(r, cfg, t)
    wf_end = span(mine, {"s1", "r", "s3"})[1]
    for tag in ("plain-a", "plain-b"):
        assert span(mine, {tag})[0] >= wf_end, (tag, mine)
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 30, what="both accounts to be free")


@pytest.mark.parametrize("forced", ["anchor", "sibling"])
def test_a_forced_release_of_one_account_in_a_workflow_gap_frees_the_other_when_the_next_member_comes(
    fleet: Fleet, redis_url: str, prefix: str, forced: str
) -> None:
    """forced release x multi-entity workflow: an operator releases one account (the anchor, sorted first,
    or its sibling) while the workflow is in a gap; the next member fails visibly (LockLost) and that exit
    ends the workflow: the other account is freed at once and its parked waiter woken, not left to the
    300 s gap TTL (docs/multi-entity.md: "its exit frees the siblings it still holds, waking their
    waiters"; docs/workflows.md: "Every other exit releases at once").

    FAILS (confirmed defect): the other account stays in state 'gap' for the whole gap TTL."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.step"].s(tenant=t, tag="s2", seconds=0.1).set(countdown=5),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: held(r, cfg, b).get("state") == "gap", 60, what="s1 to hand both accounts to the gap")
    gone, kept = (a, b) if forced == "anchor" else (b, a)
    app.tasks["wf.account"].delay(tenant=t, tag="plain", acct=kept)
    wait_for(lambda: r.llen(wait_name(prefix, f"account:{kept}")), 30, what="plain to park on the kept account")
    out = force_release(app, f"account:{gone}")
    assert held(r, cfg, kept), f"the sibling stays held while the workflow may still run: {out}"
    try:
        res.get(timeout=60)
        failed_at = time.time()
        outcome = "ran"
    except Exception as err:  # noqa: BLE001
        failed_at = time.time()
        outcome = type(err).__name__
    assert outcome == "LockLost", outcome
    try:
        took = started_at(r, cfg, t, "plain", BOUND + 5) - failed_at
    except Exception:  # noqa: BLE001 - say what still holds the kept account
        kept_lease = held(r, cfg, kept)
        ttl = r.pttl(lock_name(prefix, f"account:{kept}"))
        pytest.fail(f"the workflow failed (LockLost) but account:{kept} is still held ({ttl} ms left): {kept_lease}")
    assert took < BOUND, took
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 30, what="both accounts to be free")


def test_terminating_a_running_member_of_a_multi_entity_workflow_frees_both_accounts_within_the_grace(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Any
) -> None:
    """multi-entity workflow x revoke(terminate=True): the main process cuts every account of the workflow
    to the shorten grace, and each account's parked waiter starts soon after (not after the 60 s TTL)."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.gate"].s(tenant=t, tag="held", gate=str(tmp_path / "never")),
        app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1),
    )
    workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, t)), 60, what="the gated member")
    running = next(x for x in rows(r, cfg, t) if x["tag"] == "held")
    plain_a = app.tasks["wf.account"].delay(tenant=t, tag="plain-a", acct=a)
    plain_b = app.tasks["wf.account"].delay(tenant=t, tag="plain-b", acct=b)
    wait_for(lambda: all(r.llen(wait_name(prefix, f"account:{x}")) for x in (a, b)), 30, what="both parked")
    app.control.revoke(running["task_id"], terminate=True, signal="SIGKILL")
    revoked = time.time()
    for tag in ("plain-a", "plain-b"):
        assert started_at(r, cfg, t, tag, BOUND + 5) - revoked < BOUND, tag
    assert plain_a.get(timeout=30)["tags"] == ["plain-a"] and plain_b.get(timeout=30)["tags"] == ["plain-b"]
    assert not any(x["tag"] == "s3" for x in rows(r, cfg, t))


def test_revoking_the_member_a_multi_entity_workflow_gap_waits_for_frees_both_accounts(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """multi-entity workflow x revoke of the queued member (countdown in the gap): when the worker discards
    it, both accounts are freed and each one's parked waiter woken (not the 300 s gap TTL)."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.step"].s(tenant=t, tag="s2", seconds=0.1).set(countdown=4),
    )
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: held(r, cfg, b).get("state") == "gap", 60, what="s1 to hand both accounts to the gap")
    for acct, tag in ((a, "plain-a"), (b, "plain-b")):
        app.tasks["wf.account"].delay(tenant=t, tag=tag, acct=acct)
    wait_for(lambda: all(r.llen(wait_name(prefix, f"account:{x}")) for x in (a, b)), 30, what="both parked")
    app.control.revoke(res.id)
    wait_for(lambda: held(r, cfg, a).get("state") != "gap", 30, what="the revoked member's gap to end")
    freed = time.time()
    for tag in ("plain-a", "plain-b"):
        assert started_at(r, cfg, t, tag, BOUND + 5) - freed < BOUND, tag
    assert not any(x["tag"] == "s2" for x in rows(r, cfg, t))


def test_a_multi_entity_workflow_member_sigkilled_is_taken_over_on_every_account(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """multi-entity workflow x SIGKILL of a member's child (acks_late): the redelivery takes the workflow
    over on both accounts with new fences, the chain finishes, and both accounts end free."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=2)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.crash_once"].s(tenant=t, tag="crash"),
        app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1),
    )
    began = time.time()
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=30).apply_async()
    assert res.get(timeout=90)["tags"] == ["s1", "crash", "s3"]
    assert time.time() - began < 20, "the redelivery waited out the killed member's 30 s lease"
    mine = rows(r, cfg, t)
    fences = {x["tag"]: x["fences"] for x in mine if x["ev"] == "end"}
    for acct in (f"account:{a}", f"account:{b}"):
        assert fences["crash"][acct] > fences["s1"][acct] and fences["s3"][acct] == fences["crash"][acct], fences
    assert r.get(f"{prefix}:effects:{t}") == "1"
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 10, what="both accounts free")


@pytest.mark.parametrize("member", ["middle", "last"])
def test_a_forced_release_of_one_account_while_a_workflow_member_runs_frees_the_other_at_the_members_end(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Any, member: str
) -> None:
    """forced release x multi-entity workflow, the member running: the operator releases the anchor while
    the (middle or last) member's body runs. When that member ends (its hand-over finds the workflow no
    longer holds every account, or it is the last), the other account must be freed at once and its
    parked waiter woken: not left to the 60 s lease TTL.

    FAILS for ``middle`` (confirmed defect): the hand-over writes nothing (a part is gone), the next
    member fails LockLost, and b stays 'running' until its 60 s TTL."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    gate = tmp_path / "open"
    members = [
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.gate"].s(tenant=t, tag="held", gate=str(gate)),
    ]
    if member == "middle":
        members.append(app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1))
    res = workflow(chain(*members), lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, t)), 60, what="the gated member")
    app.tasks["wf.account"].delay(tenant=t, tag="plain", acct=b)
    wait_for(lambda: r.llen(wait_name(prefix, f"account:{b}")), 30, what="plain to park on b")
    force_release(app, f"account:{a}")
    gate.touch()
    try:
        outcome = repr(res.get(timeout=60))
    except Exception as err:  # noqa: BLE001 - LockLost (or the member's own error) is a visible end
        outcome = repr(err)
    ended = time.time()
    try:
        took = started_at(r, cfg, t, "plain", BOUND + 5) - ended
    except Exception:  # noqa: BLE001 - say what still holds b
        kept_lease = held(r, cfg, b)
        ttl = r.pttl(lock_name(prefix, f"account:{b}"))
        pytest.fail(f"the workflow ended ({outcome}) but account:{b} is still held ({ttl} ms left): {kept_lease}")
    assert took < BOUND, took


def test_a_failing_chord_page_of_a_multi_entity_workflow_frees_both_accounts_after_the_last_page(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """multi-entity workflow x chord with a failing page: the pages keep both accounts until the last one
    leaves, then the workflow ends failed, both accounts are freed and each one's parked waiter starts at
    once (not after the 300 s gap)."""
    from celery import chord, group

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    page, step = app.tasks["wf.page"], app.tasks["wf.step"]
    header = group(page.s(tenant=t, tag=f"p{i}", fail=i == 1, seconds=1.5) for i in range(3))
    sig = chain(step.s(tenant=t, tag="fetch", seconds=0), chord(header, app.tasks["wf.collect"].s(tenant=t, tag="c")))
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "p1" for x in rows(r, cfg, t)), 60, what="the failing page")
    plains = [app.tasks["wf.account"].delay(tenant=t, tag=f"plain-{x}", acct=x) for x in (a, b)]
    with pytest.raises(Exception):  # noqa: B017 - a ChordError or the page's own error
        res.get(timeout=90)
    for p in plains:
        p.get(timeout=BOUND + 10)
    mine = rows(r, cfg, t)
    pages_end = max(x["t"] for x in mine if x["tag"] in ("p0", "p2") and x["ev"] == "end")
    for x in (a, b):
        assert span(mine, {f"plain-{x}"})[0] >= pages_end, "a plain task ran beside a page"
    wait_for(lambda: not held(r, cfg, a) and not held(r, cfg, b), 30, what="both accounts free")


def test_a_forced_release_of_one_account_while_chord_pages_run_frees_the_other_when_the_pages_leave(
    fleet: Fleet, redis_url: str, prefix: str
) -> None:
    """forced release x multi-entity workflow x chord: the anchor is released while the pages run; when the
    last page leaves (WORKFLOW_LEAVE finds a part gone) or the callback fails LockLost, the other account
    must be freed and its parked waiter woken, not left to the 60 s lease TTL.

    FAILS (confirmed defect, same class as the tests above): b stays 'running' until its TTL."""
    from celery import chord, group

    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    page, step = app.tasks["wf.page"], app.tasks["wf.step"]
    header = group(page.s(tenant=t, tag=f"p{i}", seconds=2) for i in range(2))
    sig = chain(step.s(tenant=t, tag="fetch", seconds=0), chord(header, app.tasks["wf.collect"].s(tenant=t, tag="c")))
    res = workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: len({x["tag"] for x in rows(r, cfg, t) if x["tag"] in ("p0", "p1")}) == 2, 60, what="pages")
    app.tasks["wf.account"].delay(tenant=t, tag="plain", acct=b)
    wait_for(lambda: r.llen(wait_name(prefix, f"account:{b}")), 30, what="plain to park on b")
    force_release(app, f"account:{a}")
    try:
        outcome = repr(res.get(timeout=60))
    except Exception as err:  # noqa: BLE001
        outcome = repr(err)
    ended = time.time()
    try:
        took = started_at(r, cfg, t, "plain", BOUND + 5) - ended
    except Exception:  # noqa: BLE001
        kept_lease = held(r, cfg, b)
        ttl = r.pttl(lock_name(prefix, f"account:{b}"))
        pytest.fail(f"the workflow ended ({outcome}) but account:{b} is still held ({ttl} ms left): {kept_lease}")
    assert took < BOUND, took


def test_terminating_a_member_after_a_forced_release_of_the_anchor_still_frees_the_other_account(
    fleet: Fleet, redis_url: str, prefix: str, tmp_path: Any
) -> None:
    """forced release x multi-entity workflow x revoke(terminate=True): the operator releases the anchor while
    a member runs, then the member is terminated. The main process's abort must still cut the other account
    to the grace and its parked waiter start soon after, not after the 60 s lease TTL.

    FAILS (confirmed defect, same class): WORKFLOW_ABORT decides on the anchor alone; the anchor no longer
    names the workflow, so nothing is written and the other account waits out its TTL."""
    cfg = make_cfg(prefix, redis_url)
    start_worker(fleet, cfg, concurrency=3)
    app = create_app(cfg)
    r = redis.Redis.from_url(cfg["record_url"], decode_responses=True)
    t = f"t-{uuid.uuid4().hex[:6]}"
    a, b = sorted((f"{t}-a", f"{t}-b"))
    sig = chain(
        app.tasks["wf.step"].s(tenant=t, tag="s1", seconds=0.1),
        app.tasks["wf.gate"].s(tenant=t, tag="held", gate=str(tmp_path / "never")),
        app.tasks["wf.step"].s(tenant=t, tag="s3", seconds=0.1),
    )
    workflow(sig, lock_key=XFER, src=a, dst=b, lock_ttl=60, gap_ttl=300).apply_async()
    wait_for(lambda: any(x["tag"] == "held" for x in rows(r, cfg, t)), 60, what="the gated member")
    running = next(x for x in rows(r, cfg, t) if x["tag"] == "held")
    app.tasks["wf.account"].delay(tenant=t, tag="plain", acct=b)
    wait_for(lambda: r.llen(wait_name(prefix, f"account:{b}")), 30, what="plain to park on b")
    force_release(app, f"account:{a}")
    app.control.revoke(running["task_id"], terminate=True, signal="SIGKILL")
    revoked = time.time()
    try:
        took = started_at(r, cfg, t, "plain", BOUND + 5) - revoked
    except Exception:  # noqa: BLE001
        kept_lease = held(r, cfg, b)
        ttl = r.pttl(lock_name(prefix, f"account:{b}"))
        pytest.fail(f"the member was terminated but account:{b} is still held ({ttl} ms left): {kept_lease}")
    assert took < BOUND, took
