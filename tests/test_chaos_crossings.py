"""The crossings soak's checker (:mod:`chaos.crossings_check`) on synthetic histories: each invariant can fail."""

from __future__ import annotations

from typing import Any

from chaos import crossings_check as cc


def row(ev: str, t: float, job: str, task_id: str = "", pid: int = 1, **kw: Any) -> dict[str, Any]:
    base = {"cell": kw.pop("cell", "limit"), "entity": kw.pop("entity", "partner:1"), "job": job}
    return {"ev": ev, "t": t, "task_id": task_id or job, "pid": pid, **base, **kw}


def test_a_killed_body_ends_at_the_kill_and_an_unexplained_one_is_unended() -> None:
    rows = [row("start", 1.0, "a", pid=7), row("start", 2.0, "b", pid=8)]
    spans, unended = cc.executions(rows, kills=[(7, 1.5)])
    assert [(e.job, e.end, e.killed) for e in spans] == [("a", 1.5, True)]
    assert unended == ["limit b (b, pid 8)"]


def test_more_exports_than_the_limit_or_a_purge_beside_one_is_caught() -> None:
    rows = [
        row("start", 0.0, "e1", kind="export"),
        row("end", 3.0, "e1", kind="export"),
        row("start", 0.5, "e2", pid=2, kind="export"),
        row("end", 3.0, "e2", pid=2, kind="export"),
        row("start", 1.0, "e3", pid=3, kind="export"),
        row("end", 2.0, "e3", pid=3, kind="export"),
    ]
    spans, _ = cc.executions(rows, [])
    assert cc.limit_violations(spans, 3) == []
    assert cc.limit_violations(spans, 2) == ["partner:1: 3 exports at once at 1.000"]
    purge = [row("start", 2.5, "p", pid=4, kind="purge"), row("end", 2.6, "p", pid=4, kind="purge")]
    spans, _ = cc.executions(rows[:2] + purge, [])
    assert cc.limit_violations(spans, 2) == ["partner:1: export e1 and purge p ran at once"]


def test_other_work_inside_a_workflow_span_is_caught_even_in_a_gap() -> None:
    """The plain task ran between two members (in the gap): no body overlapped, the workflow was still broken."""
    rows = [
        row("start", 0.0, "w1/s1", cell="workflow", entity="t", wf="w1"),
        row("end", 1.0, "w1/s1", cell="workflow", entity="t", wf="w1"),
        row("start", 1.5, "w1-plain/plain", pid=2, cell="workflow", entity="t", wf="w1-plain"),
        row("end", 1.6, "w1-plain/plain", pid=2, cell="workflow", entity="t", wf="w1-plain"),
        row("start", 3.0, "w1/s2", cell="workflow", entity="t", wf="w1"),
        row("end", 4.0, "w1/s2", cell="workflow", entity="t", wf="w1"),
    ]
    spans, _ = cc.executions(rows, [])
    assert cc.workflow_violations(spans) == ["t: w1-plain w1-plain/plain ran inside w1 (1.50 s in)"]
    assert cc.workflow_violations([e for e in spans if e.wf == "w1"]) == []


def test_two_debounced_runs_at_once_and_duplicate_effects_are_caught() -> None:
    rows = [
        row("start", 0.0, "0/0/1", "a", cell="debounce", entity="doc:0"),
        row("end", 2.0, "0/0/1", "a", cell="debounce", entity="doc:0"),
        row("start", 1.0, "0/1/3", "b", pid=2, cell="debounce", entity="doc:0"),
        row("end", 1.2, "0/1/3", "b", pid=2, cell="debounce", entity="doc:0"),
    ]
    spans, _ = cc.executions(rows, [])
    assert cc.exclusive_violations(spans) == ["doc:0: 0/0/1 and 0/1/3 ran at once"]
    assert cc.duplicate_effects([("limit", "e1"), ("limit", "e2"), ("limit", "e1")]) == ["limit e1: 2 effects"]


def test_only_a_killed_run_replaced_by_a_later_bursts_run_is_excused() -> None:
    results: dict[str, Any] = {
        "a": {"lockguard": "superseded", "superseded_by": "b"},
        "b": {"entity": 0, "burst": 1, "position": 0},
    }
    assert cc.chain_end(results, "a") == "b"
    assert cc.covered_after_a_kill("a", results, ran={"a", "b"}, killed={"a"}, later={"b"})
    assert not cc.covered_after_a_kill("a", results, ran={"a", "b"}, killed=set(), later={"b"})  # not killed
    assert not cc.covered_after_a_kill("a", results, ran={"a"}, killed={"a"}, later={"b"})  # b never ran
    assert not cc.covered_after_a_kill("a", results, ran={"a", "b"}, killed={"a"}, later=set())  # same burst
