"""The invariants of the crossings soak (:mod:`chaos.crossings`), as pure functions over what was recorded.

Per cell, every count must be zero:

* ``dup`` -- effects beyond one per job (the effects table has no unique key, so the check can fail);
* ``lost`` -- publishes with no final state once the fleet drained, or a final state the cell does not
  expect (a publish that was accepted runs, or is answered: by a result, a ``superseded`` answer, or --
  for a workflow with a failing page -- a visible failure);
* ``ovl`` -- exclusion broken: on one entity, two debounced runs at once; more than ``lock_limit``
  exports, or the ``until_done`` purge beside anything; other work inside a workflow's span;
* ``burst`` -- a debounce burst whose run was not its last publish (:func:`chaos.debounce.check_burst`);
* ``lease`` -- a lease or claim still in Redis once every TTL ran out after the last job;
* ``unend`` -- a body that never ended and that no kill explains.

A control is the cell with one guard switched off; the soak fails if its invariant does *not* catch it.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Execution:
    """One body: its cell, entity, job, task id, kind, start and end (the kill that cut it, if one did)."""

    cell: str
    entity: str
    job: str
    task_id: str
    start: float
    end: float
    kind: str = ""
    wf: str = ""
    killed: bool = False


@dataclass
class CellFindings:
    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    #: Debounce bursts excused by :func:`covered_after_a_kill` (reported, not counted as violations).
    covered: int = 0

    def add(self, what: str, example: str) -> None:
        self.counts[what] += 1
        if len(self.examples) < 8:
            self.examples.append(f"{what}: {example}")

    @property
    def ok(self) -> bool:
        return not self.counts


def executions(rows: Iterable[dict[str, Any]], kills: list[tuple[int, float]]) -> tuple[list[Execution], list[str]]:
    """Pair each start with its end (same task id and pid), or with the kill of its pid that came after it.

    Returns the executions and the starts that neither ended nor were killed (``unend``).
    """
    rows = list(rows)
    ends = {(r["task_id"], r["pid"], r["job"]): r["t"] for r in rows if r["ev"] == "end"}
    out, unended = [], []
    for r in rows:
        if r["ev"] != "start":
            continue
        end = ends.get((r["task_id"], r["pid"], r["job"]))
        killed_at = [t for pid, t in kills if pid == r["pid"] and t >= r["t"]]
        if end is not None and killed_at and min(killed_at) < end:
            end = None  # a later body of the same pid cannot be: the pid died at the kill
        if end is None and not killed_at:
            unended.append(f"{r['cell']} {r['job']} ({r['task_id']}, pid {r['pid']})")
            continue
        out.append(
            Execution(
                r["cell"],
                r["entity"],
                r["job"],
                r["task_id"],
                r["t"],
                end if end is not None else min(killed_at),
                kind=r.get("kind", ""),
                wf=r.get("wf", ""),
                killed=end is None,
            )
        )
    return out, unended


def most_at_once(spans: list[Execution]) -> tuple[int, float]:
    """The most executions running at one moment, and that moment."""
    events = sorted([(e.start, 1) for e in spans] + [(e.end, -1) for e in spans], key=lambda x: (x[0], x[1]))
    now = worst = 0
    at = 0.0
    for t, step in events:
        now += step
        if now > worst:
            worst, at = now, t
    return worst, at


def overlapping_pairs(spans: list[Execution]) -> list[tuple[Execution, Execution]]:
    """Pairs of executions whose bodies overlap in time."""
    found = []
    ordered = sorted(spans, key=lambda e: e.start)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.start >= a.end:
                break
            found.append((a, b))
    return found


def exclusive_violations(spans: list[Execution]) -> list[str]:
    """Debounce cell: on one entity, no two bodies at once."""
    out = []
    by_entity: dict[str, list[Execution]] = defaultdict(list)
    for e in spans:
        by_entity[e.entity].append(e)
    for entity, mine in sorted(by_entity.items()):
        out += [f"{entity}: {a.job} and {b.job} ran at once" for a, b in overlapping_pairs(mine)]
    return out


def limit_violations(spans: list[Execution], limit: int) -> list[str]:
    """Limit cell: at most ``limit`` exports at once per entity; a purge (exclusive) beside nothing."""
    out = []
    by_entity: dict[str, list[Execution]] = defaultdict(list)
    for e in spans:
        by_entity[e.entity].append(e)
    for entity, mine in sorted(by_entity.items()):
        worst, at = most_at_once([e for e in mine if e.kind == "export"])
        if worst > limit:
            out.append(f"{entity}: {worst} exports at once at {at:.3f}")
        for a, b in overlapping_pairs(mine):
            if "purge" in (a.kind, b.kind) and a.task_id != b.task_id:
                out.append(f"{entity}: {a.kind} {a.job} and {b.kind} {b.job} ran at once")
    return out


def workflow_violations(spans: list[Execution]) -> list[str]:
    """Workflow cell: per tenant, no body of other work starts inside a workflow's span (first start, last end)."""
    out = []
    by_tenant: dict[str, list[Execution]] = defaultdict(list)
    for e in spans:
        by_tenant[e.entity].append(e)
    for tenant, mine in sorted(by_tenant.items()):
        spans_of: dict[str, tuple[float, float]] = {}
        for e in mine:
            lo, hi = spans_of.get(e.wf, (e.start, e.end))
            spans_of[e.wf] = (min(lo, e.start), max(hi, e.end))
        for wf, (lo, hi) in spans_of.items():
            for e in mine:
                if e.wf != wf and lo < e.start < hi:
                    out.append(f"{tenant}: {e.wf} {e.job} ran inside {wf} ({e.start - lo:.2f} s in)")
        for (a, (alo, ahi)), (b, (blo, bhi)) in itertools.combinations(sorted(spans_of.items()), 2):
            if alo < bhi and blo < ahi and not any(f"{b} " in x or f"{a} " in x for x in out):
                out.append(f"{tenant}: workflows {a} and {b} interleaved")
    return out


def duplicate_effects(effects: Iterable[tuple[str, str]]) -> list[str]:
    """``(cell, job)`` rows: a job with more than one committed effect."""
    counts = Counter(effects)
    return [f"{cell} {job}: {n} effects" for (cell, job), n in sorted(counts.items()) if n > 1]


def chain_end(results: dict[str, Any], task_id: str, hops: int = 64) -> str:
    """Follow ``superseded_by`` answers from ``task_id`` to the task id that answered for itself."""
    value = results.get(task_id)
    while isinstance(value, dict) and value.get("lockguard") == "superseded" and hops > 0:
        task_id, hops = value["superseded_by"], hops - 1
        value = results.get(task_id)
    return task_id


def covered_after_a_kill(last: str, results: dict[str, Any], ran: set[str], killed: set[str], later: set[str]) -> bool:
    """A burst whose run was killed mid-body, and whose redelivery a later burst's run had replaced meanwhile.

    The redelivered run is consumed as superseded (DEBOUNCE_START: a newer run of the entity started while
    it waited for the dead holder's lease), naming the later run, which ran with newer arguments: the
    entity still ends on the last publish, and no publish is left unanswered. Only that case is excused.
    """
    end = chain_end(results, last)
    return last in killed and end != last and end in later and end in ran
