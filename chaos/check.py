"""The soak's invariants, as pure functions over the rows a run recorded.

Inputs are plain tuples so the checker can be fed synthetic histories (and
shown to fail) without workers: effects from the ledger, executions from the
history table, the provider's books, and the fault log the driver kept.

Times are ``time.monotonic()`` values (``CLOCK_MONOTONIC``), comparable
across the processes of one host. An execution is the interval from the
start of a body (after its lease was acquired) to its end (before the lease
is released); a child killed mid-body ends at the moment of the kill.

Which leases count as "reported lost" (the overlap check skips them):

* the library said so: ``self.lock.lost`` at the end of the body, or a
  ``lost_reason`` set by the renewer or the release;
* a child killed before it could say so, while a fault that necessarily
  destroyed its lease was in effect: its worker was paused past the TTL, or
  the lock Redis was restarted without persistence. A dead process reports
  nothing; the fault log knows the lease was gone.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Effect(NamedTuple):
    seq: int  # commit order per entity: taken under the entity's fence row lock, held to commit
    job_id: int
    entity: int
    fence: int
    task_id: str
    charge_id: str


class Execution(NamedTuple):
    id: int
    job_id: int
    entity: int
    task_id: str
    fence: int
    worker: str
    pid: int
    t_start: float
    t_end: float | None
    lost_body: bool | None
    lost_release: bool | None
    outcome: str | None


@dataclass
class Faults:
    """What the driver did, on the monotonic clock."""

    kills: list[tuple[int, float]] = field(default_factory=list)  # (pid, time)
    pauses: list[tuple[str, float, float]] = field(default_factory=list)  # (worker nodename, stopped, resumed)
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (lock Redis down, back up)


@dataclass
class Verdict:
    """Counts per invariant (each must be zero), a few examples of each, and what the history shows besides."""

    duplicate_effects: int = 0  # effects beyond the first, over all jobs
    lost_jobs: int = 0  # jobs with no effect
    fence_regressions: int = 0  # commits with a fence lower than one committed before for the entity
    overlaps: int = 0  # executions that started while another of the entity ran, neither lease reported lost
    leases_left: int = 0  # lease keys still in the lock Redis after the run plus the TTL
    charge_mismatches: int = 0  # effects whose charge is not the provider's charge for the job
    unreported_losses: int = 0  # bodies that ran through a pause past the TTL and finished believing they held
    unended: int = 0  # executions with no end and no kill that explains it
    faults_missing: int = 0  # fault kinds asked for that never hit work in flight: the run proved less
    broker_left: int = 0  # messages still queued or unacknowledged at the end: the system never went quiet
    examples: dict[str, list[Any]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    INVARIANTS = (
        ("duplicate_effects", "effects beyond one per job"),
        ("lost_jobs", "jobs lost (no effect)"),
        ("fence_regressions", "commits with a fence below an earlier commit's"),
        ("overlaps", "overlapping executions, leases not reported lost"),
        ("leases_left", "leases left held after the TTL"),
        ("charge_mismatches", "effects whose charge is not the provider's"),
        ("unreported_losses", "leases lost in a pause but not reported"),
        ("unended", "executions that never ended (no kill explains it)"),
        ("faults_missing", "fault kinds asked for that never hit running work"),
        ("broker_left", "messages left in the broker at the end"),
    )

    @property
    def ok(self) -> bool:
        return all(getattr(self, name) == 0 for name, _ in self.INVARIANTS)

    def example(self, name: str, item: Any, keep: int = 5) -> None:
        items = self.examples.setdefault(name, [])
        if len(items) < keep:
            items.append(item)


def check_effects(n_jobs: int, effects: list[Effect], verdict: Verdict) -> None:
    """Exactly one effect per job: count the extra ones and the missing ones."""
    per_job = Counter(e.job_id for e in effects)
    for job, n in sorted(per_job.items()):
        if n > 1:
            verdict.duplicate_effects += n - 1
            verdict.example("duplicate_effects", {"job": job, "effects": n})
    for job in range(n_jobs):
        if per_job[job] == 0:
            verdict.lost_jobs += 1
            verdict.example("lost_jobs", {"job": job})
    verdict.info["effects"] = len(effects)


def check_fences(effects: list[Effect], verdict: Verdict) -> None:
    """Per entity, in commit order, no commit may carry a fence lower than one already committed."""
    highest: dict[int, Effect] = {}
    for e in sorted(effects, key=lambda x: x.seq):
        top = highest.get(e.entity)
        if top is not None and e.fence < top.fence:
            verdict.fence_regressions += 1
            verdict.example("fence_regressions", {"entity": e.entity, "seq": e.seq, "fence": e.fence, "after": top})
        if top is None or e.fence >= top.fence:
            highest[e.entity] = e


def check_charges(effects: list[Effect], provider: list[tuple[str, int, str, int]], verdict: Verdict) -> None:
    """Each effect carries the provider's one charge for its job (the checkpoint replayed, never re-charged)."""
    charge_of = {job: charge for _key, job, charge, _calls in provider}
    for e in effects:
        if charge_of.get(e.job_id) != e.charge_id:
            verdict.charge_mismatches += 1
            verdict.example(
                "charge_mismatches", {"job": e.job_id, "effect": e.charge_id, "provider": charge_of.get(e.job_id)}
            )
    calls = Counter(c for *_, c in provider)
    verdict.info["provider_calls_per_job"] = {str(k): v for k, v in sorted(calls.items())}


def _end_of(ex: Execution, kills: dict[int, list[float]]) -> tuple[float | None, bool]:
    """When the execution ended, and whether a kill ended it."""
    if ex.t_end is not None:
        return ex.t_end, False
    times = kills.get(ex.pid, [])
    i = bisect.bisect_left(times, ex.t_start)
    return (times[i], True) if i < len(times) else (None, False)


def _spans_lease_killer(ex: Execution, end: float, faults: Faults, ttl: float) -> bool:
    """The execution was running while its worker was paused past the TTL, or the lock Redis restarted."""
    for worker, stopped, resumed in faults.pauses:
        if worker == ex.worker and ex.t_start < resumed and end > stopped and resumed - stopped > ttl:
            return True
    return any(ex.t_start < up and end > down for down, up in faults.restarts)


def check_overlaps(executions: list[Execution], faults: Faults, ttl: float, verdict: Verdict) -> None:
    """Mutual exclusion per entity among executions whose lease was never reported lost.

    Also: a body that ran through a pause of its worker longer than the TTL
    must have been told (``lost_body``/``lost_release``) -- the lease expired
    while it was frozen, whatever its renewer did.
    """
    kills: dict[int, list[float]] = defaultdict(list)
    for pid, t in faults.kills:
        kills[pid].append(t)
    for times in kills.values():
        times.sort()
    by_entity: dict[int, list[tuple[float, float, Execution]]] = defaultdict(list)
    reported = killed_mid_body = excused = 0
    for ex in executions:
        end, by_kill = _end_of(ex, kills)
        if end is None:
            verdict.unended += 1
            verdict.example("unended", ex._asdict())
            continue
        killed_mid_body += by_kill
        if by_kill:
            if _spans_lease_killer(ex, end, faults, ttl):
                excused += 1
                continue
        elif ex.lost_body or ex.lost_release:
            reported += 1
            continue
        else:
            for worker, stopped, resumed in faults.pauses:
                if worker == ex.worker and ex.t_start < stopped and end > resumed and resumed - stopped > ttl:
                    verdict.unreported_losses += 1
                    verdict.example("unreported_losses", ex._asdict())
        by_entity[ex.entity].append((ex.t_start, end, ex))
    for runs in by_entity.values():
        runs.sort(key=lambda r: r[0])
        latest_end, latest = float("-inf"), None
        for start, end, ex in runs:
            if start < latest_end and latest is not None:
                verdict.overlaps += 1
                verdict.example("overlaps", {"running": latest._asdict(), "started": ex._asdict()})
            if end > latest_end:
                latest_end, latest = end, ex
    verdict.info.update(
        executions=len(executions),
        executions_reported_lost=reported,
        executions_killed_mid_body=killed_mid_body,
        killed_while_lease_destroyed=excused,
        outcomes=dict(Counter((ex.outcome or "killed").split(":")[0] for ex in executions)),
    )


def check_all(
    n_jobs: int,
    effects: list[Effect],
    executions: list[Execution],
    provider: list[tuple[str, int, str, int]],
    faults: Faults,
    ttl: float,
    leases_left: list[str],
) -> Verdict:
    """Every invariant over one run's rows."""
    verdict = Verdict()
    check_effects(n_jobs, effects, verdict)
    check_fences(effects, verdict)
    check_charges(effects, provider, verdict)
    check_overlaps(executions, faults, ttl, verdict)
    runs: dict[int, list[str]] = defaultdict(list)
    for ex in executions:
        runs[ex.job_id].append(f"{ex.task_id}@{ex.worker.split('@')[0]}:{(ex.outcome or 'killed').split(':')[0]}")
    for item in verdict.examples.get("lost_jobs", []) + verdict.examples.get("duplicate_effects", []):
        item["executions"] = runs.get(item["job"], [])
    verdict.leases_left = len(leases_left)
    for name in leases_left[:5]:
        verdict.example("leases_left", name)
    return verdict


def check_coverage(
    verdict: Verdict, faults: Faults, wanted: dict[str, int], redelivered: int, redelivered_running: int
) -> None:
    """Every fault kind asked for happened, on work in flight: a run whose faults missed proves nothing."""
    seen = {
        "sigkill mid-body": verdict.info.get("executions_killed_mid_body", 0),
        "pause": len(faults.pauses),
        "lock redis restart": len(faults.restarts),
        "redelivery": redelivered,
        "redelivery while running": redelivered_running,
    }
    for kind, n in wanted.items():
        if seen[kind] < n:
            verdict.faults_missing += 1
            verdict.example("faults_missing", {"fault": kind, "wanted": n, "seen": seen[kind]})


def annotate(verdict: Verdict, task_ids: dict[int, list[str]], decisions: dict[str, list[str]]) -> None:
    """Add to each lost or duplicated job's example what the library decided for each of its task ids."""
    for item in verdict.examples.get("lost_jobs", []) + verdict.examples.get("duplicate_effects", []):
        item["decisions"] = {t: decisions.get(t, []) for t in task_ids.get(item["job"], [])}
