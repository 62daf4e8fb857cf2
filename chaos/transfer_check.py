"""The transfer soak's oracle (:mod:`chaos.transfer`): pure functions over the run's history.

A *body* is one execution of a transfer's body: the accounts its delivery held, its start and end on the
PostgreSQL server clock (``clock_timestamp()``; a killed body ends at the kill, read after the SIGKILL),
the fence it held per account, and whether it committed. The checks:

* :func:`overlaps`: no account is ever inside two bodies at once (touching is allowed: one body's end may
  equal the next one's start, both read from one clock);
* :func:`fence_breaks`: per account, the fences of committed bodies never go down in start order;
* :func:`money_violations`: every transfer moved money exactly once, each account's balance is its opening
  balance plus the moves the ledger holds (a lost update breaks this), the total is conserved;
* :func:`lost_transfers`: every published call answered SUCCESS (run, or answered from its record);
* :func:`blocked_violations`: after a kill, no entity stayed held by the dead process past its TTL.

:func:`check` runs them all on the locked accounts and asks the control (the same transfers with locking off)
to be caught by at least one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Body:
    """One execution of a transfer body (see the module docstring)."""

    exec_id: int
    transfer_id: int
    accounts: tuple[int, ...]
    start: float
    end: float
    fences: Mapping[int, int] = field(default_factory=dict)
    committed: bool = False
    killed: bool = False


@dataclass(frozen=True)
class Move:
    """One row of the ledger: money the body of ``transfer_id`` moved."""

    transfer_id: int
    src: int
    dst: int
    amount: int


@dataclass
class Findings:
    violations: list[str] = field(default_factory=list)
    #: What the control (locking off) was caught at; empty when it slipped through.
    control_caught: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and bool(self.control_caught)


def overlaps(bodies: Iterable[Body]) -> list[str]:
    """Every pair of bodies that held one account at the same time, as ``account N: exec a and exec b``."""
    per: dict[int, list[Body]] = {}
    for b in bodies:
        for a in set(b.accounts):
            per.setdefault(a, []).append(b)
    out = []
    for account in sorted(per):
        running: Body | None = None  # the body with the latest end so far
        for b in sorted(per[account], key=lambda x: (x.start, x.end)):
            if running is not None and b.start < running.end:
                out.append(
                    f"account {account}: exec {running.exec_id} (transfer {running.transfer_id}) and exec "
                    f"{b.exec_id} (transfer {b.transfer_id}) overlap by {running.end - b.start:.4f} s"
                )
            if running is None or b.end > running.end:
                running = b
    return out


def fence_breaks(bodies: Iterable[Body]) -> list[str]:
    """Per account, a committed body whose fence is below an earlier committed body's fence."""
    per: dict[int, list[Body]] = {}
    for b in bodies:
        if b.committed:
            for a in set(b.accounts):
                per.setdefault(a, []).append(b)
    out = []
    for account in sorted(per):
        top = -1
        for b in sorted(per[account], key=lambda x: x.start):
            fence = b.fences.get(account)
            if fence is None:
                out.append(f"account {account}: exec {b.exec_id} committed without a fence")
                continue
            if fence < top:
                out.append(f"account {account}: exec {b.exec_id} committed fence {fence} after fence {top}")
            top = max(top, fence)
    return out


def money_violations(
    opening: Mapping[int, int], balances: Mapping[int, int], moves: Iterable[Move], transfers: Iterable[int]
) -> list[str]:
    """Each transfer moved once, each balance is opening plus its moves, the total is conserved."""
    moves = list(moves)
    out = []
    count: dict[int, int] = {}
    for m in moves:
        count[m.transfer_id] = count.get(m.transfer_id, 0) + 1
    missing = [t for t in transfers if count.get(t, 0) == 0]
    twice = sorted(t for t, n in count.items() if n > 1)
    if missing:
        out.append(f"{len(missing)} transfers never moved money: {sorted(missing)[:10]}")
    if twice:
        out.append(f"{len(twice)} transfers moved money more than once: {twice[:10]}")
    expected = dict(opening)
    for m in moves:
        expected[m.src] = expected.get(m.src, 0) - m.amount
        expected[m.dst] = expected.get(m.dst, 0) + m.amount
    wrong = {a: (balances.get(a), expected[a]) for a in sorted(expected) if balances.get(a) != expected[a]}
    if wrong:
        shown = ", ".join(f"{a}: {got} != {want}" for a, (got, want) in list(wrong.items())[:5])
        out.append(f"{len(wrong)} balances differ from their ledger (lost updates): {shown}")
    if sum(balances.values()) != sum(opening.values()):
        out.append(f"total balance {sum(balances.values())} != opening total {sum(opening.values())}")
    return out


def lost_transfers(states: Mapping[str, str]) -> list[str]:
    """Every published call (task id -> final state) answered SUCCESS."""
    bad = {tid: s for tid, s in states.items() if s != "SUCCESS"}
    if not bad:
        return []
    shown = ", ".join(f"{tid}={s}" for tid, s in sorted(bad.items())[:5])
    return [f"{len(bad)} of {len(states)} calls did not succeed: {shown}"]


def blocked_violations(blocked: Iterable[tuple[str, float]], ttl: float, slack: float) -> list[str]:
    """``(entity, seconds it stayed held by a killed process)`` pairs longer than ``ttl + slack``."""
    return [
        f"{key} stayed held by a killed child {secs:.2f} s (TTL {ttl} s)" for key, secs in blocked if secs > ttl + slack
    ]


def check(
    *,
    bodies: list[Body],
    control_bodies: list[Body],
    opening: Mapping[int, int],
    balances: Mapping[int, int],
    moves: list[Move],
    transfers: list[int],
    control_opening: Mapping[int, int],
    control_balances: Mapping[int, int],
    control_moves: list[Move],
    control_transfers: list[int],
    states: Mapping[str, str],
    blocked: list[tuple[str, float]],
    ttl: float,
    slack: float = 2.0,
) -> Findings:
    """Every invariant on the locked run; the control must break at least one (overlap or money)."""
    f = Findings()
    f.violations += overlaps(bodies)
    f.violations += fence_breaks(bodies)
    f.violations += money_violations(opening, balances, moves, transfers)
    f.violations += lost_transfers(states)
    f.violations += blocked_violations(blocked, ttl, slack)
    f.control_caught += overlaps(control_bodies)
    f.control_caught += money_violations(control_opening, control_balances, control_moves, control_transfers)
    return f
