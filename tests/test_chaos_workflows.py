"""The workflow soak's checker (``chaos.workflow_check``): each invariant catches what it is for."""

from __future__ import annotations

from typing import Any

from chaos.workflow_check import check, fence_breaks, overlaps


def row(wf: str, start: float, end: float, fence: int | None = 5, tenant: str = "t0", held: bool = True) -> Any:
    return {"tenant": tenant, "wf": wf, "step": "s", "start": start, "end": end, "fence": fence, "held": held}


def test_members_of_one_workflow_may_overlap_two_workflows_may_not() -> None:
    assert overlaps([row("a", 0, 2), row("a", 1, 3), row("b", 3, 4)]) == []  # a chord's pages; then b
    assert overlaps([row("a", 0, 2), row("b", 1, 3)]) == [("a", "b")]
    # a short member of b inside a long member of a, after another member of a
    assert overlaps([row("a", 0, 10), row("a", 1, 2), row("b", 3, 4)]) == [("a", "b")]


def test_fences_rise_within_and_across_workflows() -> None:
    ok = [row("a", 0, 1, 5), row("a", 1, 2, 7), row("b", 3, 4, 9)]  # a taken over once (5 -> 7), then b
    assert fence_breaks(ok) == []
    assert fence_breaks([row("a", 0, 1, 7), row("a", 1, 2, 5)]) == ["a: fence went backwards [7, 5]"]
    assert fence_breaks([row("a", 0, 1, 7), row("b", 2, 3, 7)]) == ["b started with fence 7, not above a's 7"]
    assert fence_breaks([row("a", 0, 1, None)]) == ["a: a member ran without the workflow lease"]


def test_check_needs_every_workflow_settled_no_lease_left_and_the_control_caught() -> None:
    rows = [row("a", 0, 1, 5), row("b", 2, 3, 6), row("c1", 0, 2, None, "control"), row("c2", 1, 3, None, "control")]
    good = check(rows, {"a": "SUCCESS", "b": "FAILURE"}, [], {"control"})
    assert good.ok and good.controls_caught == {"control": True}
    assert not check(rows, {"a": "PENDING"}, [], {"control"}).ok
    assert not check(rows, {}, ["lg:v1:{tenant:t0:pipeline}:lock"], {"control"}).ok
    uncaught = check(rows[:2], {}, [], {"control"})  # the control never ran, or never overlapped
    assert uncaught.violations == [] and not uncaught.ok
    lost = check([row("a", 0, 1, held=False)], {}, [], set())
    assert lost.violations == ["t0: a s ended with its lease lost"]
