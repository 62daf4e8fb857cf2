"""The invariants of the workflow soak, as pure functions over the recorded rows and the final states.

* **no interleaving**: on one tenant, no member body of one workflow overlaps a member body of
  another (the workflow's lease spans from its first member to its last);
* **one fence per stretch**: the members of one workflow that ran under one lease share its fence;
  a take-over after a killed member raises it; a later workflow on the tenant has a higher one;
* **every workflow settled**: each one's result is ready (SUCCESS, or a visible FAILURE: a member
  killed once too often, a lease lost), none left PENDING;
* **nothing left behind**: no lease of the run remains once the fleet drained.

A *control* tenant runs the same chains without ``workflow()``: its members must be caught
interleaving, or the check proved nothing.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Findings:
    """What the checker found; ``ok`` when no invariant broke and every control was caught."""

    violations: list[str] = field(default_factory=list)
    controls_caught: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations and all(self.controls_caught.values())


def overlaps(rows: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of workflows (ids) whose member bodies overlapped in time on one tenant."""
    spans = sorted((r["start"], r["end"], r["wf"]) for r in rows)
    found: list[tuple[str, str]] = []
    latest: tuple[float, str] | None = None  # the member ending last so far, and its workflow
    for start, end, wf in spans:
        if latest is not None and start < latest[0] and wf != latest[1]:
            found.append((latest[1], wf))
        if latest is None or end > latest[0]:
            latest = (end, wf)
    return found


def fence_breaks(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Fences that went backwards: within a workflow (in time order), or between workflows of one tenant."""
    out: list[str] = []
    by_wf: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_wf[r["wf"]].append(r)
    firsts = []
    for wf, members in by_wf.items():
        members.sort(key=lambda r: r["start"])
        fences = [r["fence"] for r in members]
        if any(f is None for f in fences):
            out.append(f"{wf}: a member ran without the workflow lease")
            continue
        if any(b < a for a, b in itertools.pairwise(fences)):
            out.append(f"{wf}: fence went backwards {fences}")
        firsts.append((members[0]["start"], fences[0], fences[-1], wf))
    firsts.sort()
    for (_, _, last, a), (_, first, _, b) in itertools.pairwise(firsts):
        if first <= last:
            out.append(f"{b} started with fence {first}, not above {a}'s {last}")
    return out


def check(
    rows: list[dict[str, Any]],
    states: dict[str, str],
    leftover_leases: list[str],
    control_tenants: set[str],
) -> Findings:
    """Every invariant over one run: ``rows`` the member bodies, ``states`` each workflow's final state."""
    f = Findings()
    by_tenant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_tenant[r["tenant"]].append(r)
    for tenant, mine in sorted(by_tenant.items()):
        pairs = overlaps(mine)
        if tenant in control_tenants:
            f.controls_caught[tenant] = bool(pairs)
            continue
        f.violations += [f"{tenant}: workflows {a} and {b} interleaved" for a, b in pairs]
        f.violations += [f"{tenant}: {why}" for why in fence_breaks(mine)]
        f.violations += [
            f"{tenant}: {r['wf']} {r['step']} ended with its lease lost" for r in mine if r["held"] is False
        ]
    for tenant in control_tenants - set(by_tenant):
        f.controls_caught[tenant] = False
    f.violations += [
        f"workflow {wf} never settled (state {state})" for wf, state in states.items() if state == "PENDING"
    ]
    f.violations += [f"lease left behind: {name}" for name in leftover_leases]
    return f
