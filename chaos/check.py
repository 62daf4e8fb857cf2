"""The soak's invariants, as pure functions over the rows a run recorded.

Inputs are plain tuples so the checker can be fed synthetic histories (and
shown to fail) without workers: effects from the ledger, executions from the
history table, the provider's books, what each publish returned, the state
each task id left in the result backend, and the fault log the driver kept.
One cell (a lock mode, a policy, a workload) is checked at a time, over its
own jobs and entities.

Times are ``time.monotonic()`` values (``CLOCK_MONOTONIC``), comparable
across the processes of one host. An execution is the interval from the
start of a body (after its lease was acquired) to its end (before the lease
is released); a child killed mid-body ends at the moment of the kill.

**A job is answered** when its effect committed exactly once, or -- with
``on_locked="raise"`` only -- when it failed *visibly*: a publish raised
``AlreadyQueued`` or a task ended ``FAILURE`` with ``LockContended`` in the
result backend. A publish a queue-time mode answered with an existing task
(``apply_async`` returned the holder's ``AsyncResult``) is answered by that
task. Anything else is lost.

**Faults that break a lease.** Mutual exclusion is promised only while the
lease lives. A lease may be lost (and the overlap check then skips its
execution) only when a fault explains it: its worker was paused past the
TTL, or the lock Redis was restarted, answered BUSY, or refused writes
(NOREPLICAS) while the execution ran. A lease that expired with no such
fault -- a renewal that never came -- is not excused, reported or not: that
is what the ``no-renew`` control shows.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Effect(NamedTuple):
    seq: int  # commit order per entity: taken under the entity's fence row lock, held to commit
    job_id: int
    entity: int
    fence: int
    task_id: str
    charge_id: str
    exec_id: int | None = None  # the execution that committed it


class Execution(NamedTuple):
    id: int
    job_id: int
    entity: int
    task_id: str
    fence: int  # -1: ran without a lease (fail-open)
    worker: str
    pid: int
    t_start: float
    t_end: float | None
    lost_body: bool | None
    lost_release: bool | None
    outcome: str | None
    t_delivered: float | None = None  # when the delivery that ran this body started (task_prerun)
    t_released: float | None = None  # when the release returned (task_postrun)


class Publish(NamedTuple):
    """One ``apply_async`` of the driver and what it returned."""

    job_id: int
    task_id: str
    t_sent: float
    t_done: float
    outcome: str  # "enqueued", "deduped" (answered by another task), or "raised:<ExceptionType>"
    answered_by: str | None = None  # the holder's task id when deduped
    claimed: bool | None = None  # False when the library logged "publish without claim"
    # Queue-time modes: the task id holding the entity's claim just before and just after the publish
    # ("" = nobody, None = not read or unreadable).
    holder_before: str | None = None
    holder_after: str | None = None

    @property
    def claim_eligible(self) -> bool:
        """This publish holds the entity's claim, or should: it was free before and nobody took it."""
        if self.claimed is False:
            return False
        return self.holder_after == self.task_id or (self.holder_before == "" and self.holder_after == "")


#: Failures that answer a job visibly, per policy: ``raise`` fails a contended job on purpose.
VISIBLE_FAILURES: dict[str, frozenset[str]] = {
    "raise": frozenset({"LockContended", "AlreadyQueued"}),
    "skip": frozenset(),
    "retry": frozenset(),
}
TERMINAL = frozenset({"SUCCESS", "FAILURE"})


@dataclass
class Faults:
    """What the driver did, on the monotonic clock."""

    kills: list[tuple[int, float]] = field(default_factory=list)  # (pid, time)
    pauses: list[tuple[str, float, float]] = field(default_factory=list)  # (worker nodename, stopped, resumed)
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (lock Redis down, back up)
    busy: list[tuple[float, float]] = field(default_factory=list)  # lock Redis answering BUSY
    noreplicas: list[tuple[float, float]] = field(default_factory=list)  # lock Redis refusing writes
    pg_outages: list[tuple[float, float]] = field(default_factory=list)  # completion store's endpoint cut

    def store_faults(self) -> list[tuple[float, float]]:
        """Windows in which the lock Redis lost or refused to keep leases, claims and Redis records."""
        return self.restarts + self.busy + self.noreplicas


@dataclass
class Verdict:
    """Counts per invariant (each must be zero), a few examples of each, and what the history shows besides."""

    duplicate_effects: int = 0  # effects beyond the first, over all jobs
    lost_jobs: int = 0  # jobs with no effect and no visible failure
    unexpected_failures: int = 0  # tasks or publishes that failed with an error the policy does not explain
    unanswered: int = 0  # enqueued tasks (or holders of deduplicated publishes) with no final state
    fence_regressions: int = 0  # commits with a fence lower than one committed before for the entity
    overlaps: int = 0  # executions that started while another of the entity ran, no fault breaking a lease
    queued_twice: int = 0  # identical work enqueued while a copy was still queued (or, until_done, running)
    record_misses: int = 0  # bodies that started after the job's completion record was visible
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
        ("lost_jobs", "jobs lost (no effect, no visible failure)"),
        ("unexpected_failures", "failures the policy does not explain"),
        ("unanswered", "publishes left without a final state"),
        ("fence_regressions", "commits with a fence below an earlier commit's"),
        ("overlaps", "overlapping executions, no fault broke a lease"),
        ("queued_twice", "identical work queued twice (queue-time modes)"),
        ("record_misses", "bodies started after the job's record was visible"),
        ("leases_left", "leases left held after the TTL"),
        ("charge_mismatches", "effects whose charge is not the provider's"),
        ("unreported_losses", "leases lost in a pause but not reported"),
        ("unended", "executions that never ended (no kill explains it)"),
        ("faults_missing", "fault kinds asked for that never hit running work"),
        ("broker_left", "messages left in the broker at the end"),
    )
    #: Short column names for the per-cell table of the report.
    SHORT = {
        "duplicate_effects": "dup",
        "lost_jobs": "lost",
        "unexpected_failures": "fail",
        "unanswered": "unans",
        "fence_regressions": "fence",
        "overlaps": "ovl",
        "queued_twice": "q2",
        "record_misses": "miss",
        "leases_left": "lease",
        "charge_mismatches": "chg",
        "unreported_losses": "unrep",
        "unended": "unend",
        "faults_missing": "cover",
        "broker_left": "broker",
    }

    @property
    def ok(self) -> bool:
        return all(getattr(self, name) == 0 for name, _ in self.INVARIANTS)

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name, _ in self.INVARIANTS}

    def violated(self) -> dict[str, int]:
        return {name: n for name, n in self.counts().items() if n}

    def example(self, name: str, item: Any, keep: int = 5) -> None:
        items = self.examples.setdefault(name, [])
        if len(items) < keep:
            items.append(item)


def _spans(windows: Iterable[tuple[float, float]], start: float, end: float) -> bool:
    return any(start < up and end > down for down, up in windows)


def check_effects(
    jobs: Iterable[int],
    effects: list[Effect],
    verdict: Verdict,
    publishes: list[Publish] | None = None,
    results: dict[str, tuple[str, str | None]] | None = None,
    policy: str = "skip",
) -> None:
    """Exactly one effect per job; a job without one must have failed visibly (``raise`` only).

    Also: every failure is one the policy explains, and every publish ends in a final state.
    """
    per_job = Counter(e.job_id for e in effects)
    for job, n in sorted(per_job.items()):
        if n > 1:
            verdict.duplicate_effects += n - 1
            verdict.example("duplicate_effects", {"job": job, "effects": n})
    visible = VISIBLE_FAILURES.get(policy, frozenset())
    results = results or {}
    pubs: dict[int, list[Publish]] = defaultdict(list)
    for p in publishes or []:
        pubs[p.job_id].append(p)
    failed_visibly = deduped = 0
    states: Counter[str] = Counter()
    for job in jobs:
        answered = False
        for p in pubs.get(job, []):
            if p.outcome.startswith("raised:"):
                exc = p.outcome.split(":", 1)[1]
                answered |= exc in visible
                if exc not in visible:
                    verdict.unexpected_failures += 1
                    verdict.example("unexpected_failures", {"job": job, "publish": p.task_id, "raised": exc})
                continue
            task_id = p.task_id
            if p.outcome == "deduped":
                deduped += 1
                task_id = p.answered_by or ""
            state, exc_type = results.get(task_id, ("PENDING", None))
            if p.outcome == "enqueued":
                states[state] += 1
            if state not in TERMINAL:
                verdict.unanswered += 1
                verdict.example("unanswered", {"job": job, "task_id": task_id, "state": state, "publish": p.outcome})
            elif state == "FAILURE" and p.outcome == "enqueued":
                if exc_type in visible:
                    answered = True
                else:
                    verdict.unexpected_failures += 1
                    verdict.example("unexpected_failures", {"job": job, "task_id": task_id, "error": exc_type})
        if per_job[job] == 0:
            if answered:
                failed_visibly += 1
            else:
                verdict.lost_jobs += 1
                verdict.example("lost_jobs", {"job": job})
    verdict.info.update(
        effects=len(effects), jobs_failed_visibly=failed_visibly, publishes_deduped=deduped, final_states=dict(states)
    )


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


def _kill_index(faults: Faults) -> dict[int, list[float]]:
    kills: dict[int, list[float]] = defaultdict(list)
    for pid, t in faults.kills:
        kills[pid].append(t)
    for times in kills.values():
        times.sort()
    return kills


def _end_of(ex: Execution, kills: dict[int, list[float]]) -> tuple[float | None, bool]:
    """When the execution ended, and whether a kill ended it."""
    if ex.t_end is not None:
        return ex.t_end, False
    times = kills.get(ex.pid, [])
    i = bisect.bisect_left(times, ex.t_start)
    return (times[i], True) if i < len(times) else (None, False)


def lease_fault(ex: Execution, end: float, faults: Faults, ttl: float) -> bool:
    """A fault that can break a lease hit the execution: a pause of its worker past the TTL, or a
    lock-Redis restart, BUSY or NOREPLICAS window while it ran."""
    for worker, stopped, resumed in faults.pauses:
        if worker == ex.worker and ex.t_start < resumed and end > stopped and resumed - stopped > ttl:
            return True
    return _spans(faults.store_faults(), ex.t_start, end)


def check_overlaps(executions: list[Execution], faults: Faults, ttl: float, verdict: Verdict) -> None:
    """Mutual exclusion per entity among executions whose lease no fault broke.

    An execution leaves the check only when a fault explains a lost lease
    (:func:`lease_fault`) and the lease was reported lost -- or, for a child
    killed mid-body (it can report nothing), when such a fault hit it. A lease
    reported lost with no fault to explain it stays in (a renewal that never
    came is the guard failing), and so does a body that ran without a lease.

    Also: a body that ran through a pause of its worker longer than the TTL
    must have been told (``lost_body``/``lost_release``) -- the lease expired
    while it was frozen, whatever its renewer did.
    """
    kills = _kill_index(faults)
    by_entity: dict[int, list[tuple[float, float, Execution]]] = defaultdict(list)
    reported = killed_mid_body = excused = lost_no_fault = unlocked = 0
    for ex in executions:
        end, by_kill = _end_of(ex, kills)
        if end is None:
            verdict.unended += 1
            verdict.example("unended", ex._asdict())
            continue
        killed_mid_body += by_kill
        faulted = lease_fault(ex, end, faults, ttl)
        if by_kill:
            if faulted:
                excused += 1
                continue
        elif ex.lost_body or ex.lost_release:
            reported += 1
            if faulted:
                continue
            lost_no_fault += 1
        else:
            for worker, stopped, resumed in faults.pauses:
                if worker == ex.worker and ex.t_start < stopped and end > resumed and resumed - stopped > ttl:
                    verdict.unreported_losses += 1
                    verdict.example("unreported_losses", ex._asdict())
        unlocked += ex.fence < 0
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
        executions_lost_without_fault=lost_no_fault,
        executions_without_lease=unlocked,
        executions_killed_mid_body=killed_mid_body,
        killed_while_lease_destroyed=excused,
        outcomes=dict(Counter((ex.outcome or "killed").split(":")[0] for ex in executions)),
    )


def check_queue_claims(
    mode: str,
    policy: str,
    publishes: list[Publish],
    executions: list[Execution],
    first_delivery: dict[str, float],
    faults: Faults,
    verdict: Verdict,
) -> None:
    """Queue-time modes with ``skip`` or ``raise``: no identical work enqueued while a copy still waits.

    A claim is per entity: a publish finding it held by *different* work on the
    entity is enqueued without one, and its duplicates cannot be recognised.
    So ``p2`` counts when it was enqueued (not deduplicated, not refused) after
    an earlier publish ``p1`` of the same job that held the entity's claim (or
    found it free and left it free: it should have taken it,
    :attr:`Publish.claim_eligible`) and before ``p1``'s message was first
    delivered -- and, in ``until_done``, also while ``p1``'s body ran and kept
    its lease. Excused: a restart of the lock Redis between the two (it drops
    every claim), and a publish the library logged as made without its claim
    (the lock Redis was unavailable). ``retry`` never deduplicates at publish,
    so it is not checked.
    """
    if mode == "while_running" or policy == "retry":
        return
    by_job: dict[int, list[Publish]] = defaultdict(list)
    for p in publishes:
        by_job[p.job_id].append(p)
    runs: dict[str, list[Execution]] = defaultdict(list)
    for ex in executions:
        if ex.t_end is not None and not (ex.lost_body or ex.lost_release) and ex.fence >= 0:
            runs[ex.task_id].append(ex)
    for job, pubs in by_job.items():
        pubs.sort(key=lambda p: p.t_sent)
        for i, p2 in enumerate(pubs):
            if p2.outcome != "enqueued" or p2.claimed is False:
                continue
            for p1 in pubs[:i]:
                if p1.outcome != "enqueued" or not p1.claim_eligible or p1.task_id == p2.task_id:
                    continue
                if _spans(faults.restarts, p1.t_sent, p2.t_done):
                    continue
                queued = p1.t_done < p2.t_sent and p2.t_done < first_delivery.get(p1.task_id, math.inf)
                running = mode == "until_done" and any(
                    ex.t_start < p2.t_sent
                    and p2.t_done < (ex.t_end or 0.0)
                    and not _spans(faults.store_faults(), ex.t_start, p2.t_done)
                    for ex in runs.get(p1.task_id, [])
                )
                if queued or running:
                    verdict.queued_twice += 1
                    while_ = "queued" if queued else "running"
                    verdict.example(
                        "queued_twice", {"job": job, "first": p1.task_id, "second": p2.task_id, "while": while_}
                    )
                    break


def check_records(
    backend: str, effects: list[Effect], executions: list[Execution], faults: Faults, verdict: Verdict
) -> None:
    """No body of a job starts once its completion record is visible.

    The record of the committing execution C is visible from C's commit
    (PostgreSQL: it commits with the effect; bounded by C's end) or from C's
    release (Redis: the release writes it). A later delivery R of the same job
    must find it and not run its body. R counts when its delivery started
    after that moment. Excused on Redis only: a restart, BUSY or NOREPLICAS
    window between C's end and R's delivery (the record was lost or never
    written). A C killed before its end was seen proves nothing and is skipped.
    """
    by_id = {ex.id: ex for ex in executions}
    first_effect: dict[int, Effect] = {}
    for e in sorted(effects, key=lambda x: x.seq):
        first_effect.setdefault(e.job_id, e)
    by_job: dict[int, list[Execution]] = defaultdict(list)
    for ex in executions:
        by_job[ex.job_id].append(ex)
    for job, e in first_effect.items():
        c = by_id.get(e.exec_id) if e.exec_id is not None else None
        if c is None or c.t_end is None:
            continue
        visible = c.t_end if backend == "postgresql" else c.t_released
        if visible is None:
            continue
        for r in by_job[job]:
            if r.id == c.id or r.t_delivered is None or r.t_delivered <= visible:
                continue
            if backend != "postgresql" and _spans(faults.store_faults(), c.t_end, r.t_delivered):
                continue
            verdict.record_misses += 1
            verdict.example(
                "record_misses",
                {"job": job, "recorded_by": c.task_id, "visible_at": visible, "run": r._asdict()},
            )


def check_all(
    jobs: int | Iterable[int],
    effects: list[Effect],
    executions: list[Execution],
    provider: list[tuple[str, int, str, int]],
    faults: Faults,
    ttl: float,
    leases_left: list[str],
    *,
    publishes: list[Publish] | None = None,
    results: dict[str, tuple[str, str | None]] | None = None,
    first_delivery: dict[str, float] | None = None,
    mode: str = "while_running",
    policy: str = "skip",
    backend: str = "postgresql",
) -> Verdict:
    """Every invariant over one cell's rows (``jobs``: its job ids, or their number from 0)."""
    verdict = Verdict()
    job_ids = range(jobs) if isinstance(jobs, int) else list(jobs)
    check_effects(job_ids, effects, verdict, publishes, results, policy)
    check_fences(effects, verdict)
    check_charges(effects, provider, verdict)
    check_overlaps(executions, faults, ttl, verdict)
    check_queue_claims(mode, policy, publishes or [], executions, first_delivery or {}, faults, verdict)
    check_records(backend, effects, executions, faults, verdict)
    runs: dict[int, list[str]] = defaultdict(list)
    for ex in executions:
        runs[ex.job_id].append(f"{ex.task_id}@{ex.worker.split('@')[0]}:{(ex.outcome or 'killed').split(':')[0]}")
    for item in verdict.examples.get("lost_jobs", []) + verdict.examples.get("duplicate_effects", []):
        item["executions"] = runs.get(item["job"], [])
    verdict.leases_left = len(leases_left)
    for name in leases_left[:5]:
        verdict.example("leases_left", name)
    return verdict


#: Fault kinds and how to tell they hit work in flight.
FAULT_KINDS = (
    "sigkill mid-body",
    "pause",
    "lock redis restart",
    "lock redis busy",
    "lock redis noreplicas",
    "pg outage",
    "redelivery",
    "redelivery while running",
)


def _hit(windows: list[tuple[float, float]], deliveries: list[float], executions: list[Execution]) -> int:
    """Windows during which some delivery started or some body ran."""
    hit = 0
    for down, up in windows:
        i = bisect.bisect_left(deliveries, down)
        if (i < len(deliveries) and deliveries[i] < up) or any(
            ex.t_start < up and (ex.t_end is None or ex.t_end > down) for ex in executions
        ):
            hit += 1
    return hit


def check_coverage(
    verdict: Verdict,
    faults: Faults,
    wanted: dict[str, int],
    redelivered: int,
    redelivered_running: int,
    deliveries: list[float] | None = None,
    executions: list[Execution] | None = None,
    killed_mid_body: int | None = None,
) -> None:
    """Every fault kind asked for happened, on work in flight: a run whose faults missed proves nothing."""
    times = sorted(deliveries or [])
    runs = executions or []
    seen = {
        "sigkill mid-body": verdict.info.get("executions_killed_mid_body", 0)
        if killed_mid_body is None
        else killed_mid_body,
        "pause": len(faults.pauses),
        "lock redis restart": len(faults.restarts),
        "lock redis busy": _hit(faults.busy, times, runs),
        "lock redis noreplicas": _hit(faults.noreplicas, times, runs),
        "pg outage": _hit(faults.pg_outages, times, runs),
        "redelivery": redelivered,
        "redelivery while running": redelivered_running,
    }
    verdict.info["faults_seen"] = seen
    for kind, n in wanted.items():
        if seen[kind] < n:
            verdict.faults_missing += 1
            verdict.example("faults_missing", {"fault": kind, "wanted": n, "seen": seen[kind]})


def annotate(verdict: Verdict, task_ids: dict[int, list[str]], decisions: dict[str, list[str]]) -> None:
    """Add to each lost or duplicated job's example what the library decided for each of its task ids."""
    for item in verdict.examples.get("lost_jobs", []) + verdict.examples.get("duplicate_effects", []):
        item["decisions"] = {t: decisions.get(t, []) for t in task_ids.get(item["job"], [])}
