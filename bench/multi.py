"""Several entities at once (docs/multi-entity.md): a two-entity task against one entity and against nesting.

Same run, same worker, paired rounds (``bench.e2e``): the plain task, ``LockedTask`` on ``item:{i}``, a
``LockedTask`` with ``lock_key=("item:{i}", "other:{i}")`` (one ACQUIRE_MULTI, one RELEASE_MULTI), and the
way a user nests the second entity without it: ``lock_key="item:{i}"`` and a second Lease taken and given back
inside the body (two more round trips, and a wait while holding the first when the second is busy).
Uncontended: distinct ``i`` per task. Round trips are counted at the client, in the worker child.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import e2e
from .e2e import E2EResult, Variant
from .workerapp import NESTED, TWO_ENTITIES

SINGLE = "LockedTask"

VARIANTS = [
    Variant(e2e.BASE, "tp_plain"),
    Variant(SINGLE, "tp_locked"),
    Variant(TWO_ENTITIES, "tp_multi"),
    Variant(NESTED, "tp_nested"),
]

#: Worker round trips a two-entity task adds over the plain task on one Redis: ACQUIRE_MULTI and RELEASE_MULTI,
#: the single lease's two (more is a regression: the entities would be taken one by one).
MAX_TWO_ENTITY_ROUND_TRIPS = 2
#: What nesting a second Lease inside a single one adds: that lease's ACQUIRE and RELEASE on top.
NESTED_ROUND_TRIPS = 4


def measure(url: str, rounds: int, n: int, server_pids: list[int] | None = None) -> list[E2EResult]:
    return e2e.measure(url, rounds, n, variants=VARIANTS, server_pids=server_pids)


def added(results: list[E2EResult]) -> dict[str, float]:
    """Worker commands sent per task over the plain task, per variant."""
    by = {r.name: r for r in results}
    return {r.name: r.child_rt - by[e2e.BASE].child_rt for r in results if r.name != e2e.BASE}


def render(results: list[E2EResult], params: dict[str, Any], table: Callable[[list[E2EResult]], str]) -> str:
    """The page's section: the table, then the two comparisons in words."""
    by = {r.name: r for r in results}
    one, two, nested = by[SINGLE], by[TWO_ENTITIES], by[NESTED]
    extra = added(results)
    lines = [
        "### Several entities at once\n",
        '`lock_key=("item:{i}", "other:{i}")` (docs/multi-entity.md) against the single-entity task on '
        '`item:{i}` and against two nested single locks (`lock_key="item:{i}"` and a second `Lease` on '
        "`other:{i}` taken and given back inside the body), with the plain task as the base, in one run on one "
        f"`-c 1` worker, alternated in one round order: {params['multi_n']} tasks per variant per round, "
        f"{params['multi_rounds']} rounds, distinct arguments (uncontended). Round trips are the worker child's "
        "commands sent per task, counted at the client.\n",
        table(results) + "\n",
        f"Round trips per task in the worker, over the plain task: one entity {extra[SINGLE]:.2f}, two entities "
        f"{extra[TWO_ENTITIES]:.2f} (one ACQUIRE_MULTI, one RELEASE_MULTI: both entities in each round trip), "
        f"nested {extra[NESTED]:.2f} (each lease its own ACQUIRE and RELEASE). End to end the two-entity task "
        f"costs {two.added_us.fmt('.0f')} µs over the plain task against {one.added_us.fmt('.0f')} µs for one "
        f"entity and {nested.added_us.fmt('.0f')} µs nested; paired per round, two entities against nesting: "
        f"{_paired(two, nested)} µs per task. Nesting also waits for the second entity *while holding the "
        "first*, which is how two transfers in opposite orders deadlock; the two-entity task never holds a "
        "part (docs/multi-entity.md).\n",
    ]
    return "\n".join(lines)


def _paired(a: E2EResult, b: E2EResult) -> str:
    from .stats import Summary

    return Summary([x - y for x, y in zip(a.total_us.values, b.total_us.values, strict=True)]).fmt("+.0f")
