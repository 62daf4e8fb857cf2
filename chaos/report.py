"""The soak's report: what was done to the system, what the library saw, and what held, per cell.

Built from independent sources so a bug in one cannot hide behind another:
the fault log the driver kept, what each publish returned, the lock events
the workers counted, the states in the result backend, and the ledger plus
execution history in PostgreSQL (the verdicts).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .app import Cell
from .check import Faults, Verdict

#: Invariants checked per cell (the run-wide ones -- fault coverage, broker backlog -- are per leg).
CELL_INVARIANTS = [(n, label) for n, label in Verdict.INVARIANTS if n not in ("faults_missing", "broker_left")]
LEG_INVARIANTS = [(n, label) for n, label in Verdict.INVARIANTS if n in ("faults_missing", "broker_left")]


def build_report(
    *,
    opts: dict[str, Any],
    run_id: str,
    backend: str,
    plan: dict[str, int],
    faults: Faults,
    events: Counter[str],
    cells: list[Cell],
    controls: dict[str, str],
    verdicts: dict[str, Verdict],
    overall: Verdict,
    elapsed: float,
    proxy_connections: int | None = None,
) -> dict[str, Any]:
    """Everything a leg's report shows, as JSON-able data.

    ``ok``: every real cell passed every invariant, the leg's own invariants
    held, and every control cell was caught by its target invariant.
    """
    rows = []
    for cell in cells:
        v = verdicts[cell.name]
        target = controls.get(cell.name)
        caught = bool(target and getattr(v, target) > 0)
        task = cell.task_name
        rows.append(
            {
                "cell": cell.name,
                "mode": cell.mode,
                "policy": cell.policy,
                "workload": cell.workload,
                "control": cell.unsafe or None,
                "target": target,
                "caught": caught if target else None,
                "ok": caught if target else v.ok,
                "invariants": v.counts(),
                "jobs": v.info.get("jobs", opts["jobs"]),
                "effects": v.info.get("effects", 0),
                "failed_visibly": v.info.get("jobs_failed_visibly", 0),
                "deduped_at_publish": v.info.get("publishes_deduped", 0),
                "executions": v.info.get("executions", 0),
                "killed_mid_body": v.info.get("executions_killed_mid_body", 0),
                "lost_leases": v.info.get("executions_reported_lost", 0),
                "lost_without_fault": v.info.get("executions_lost_without_fault", 0),
                "without_lease": v.info.get("executions_without_lease", 0),
                "completion_skips": events[f"@{task}|completion.skipped"],
                "skipped_duplicates": events[f"@{task}|lock.skipped_duplicate"],
                "waits": events[f"@{task}|lock.retry_scheduled"],
                "outcomes": v.info.get("outcomes", {}),
                "final_states": v.info.get("final_states", {}),
                "provider_calls_per_job": v.info.get("provider_calls_per_job", {}),
                "examples": v.examples,
            }
        )
    ok = all(r["ok"] for r in rows) and overall.ok
    return {
        "run": run_id,
        "backend": backend,
        "ok": ok,
        "elapsed_s": round(elapsed, 1),
        "options": opts,
        "plan": plan,
        "faults": {
            "sigkills": len(faults.kills),
            "sigkills_mid_body": sum(r["killed_mid_body"] for r in rows),
            "pauses": [{"worker": w, "seconds": round(b - a, 1)} for w, a, b in faults.pauses],
            "lock_redis_restarts": [round(b - a, 2) for a, b in faults.restarts],
            "busy": [round(b - a, 2) for a, b in faults.busy],
            "noreplicas": [round(b - a, 2) for a, b in faults.noreplicas],
            "pg_outages": [round(b - a, 2) for a, b in faults.pg_outages],
            "deliveries": events["delivery"],
            "redelivered": events["delivery|redelivered"],
            "redelivered_while_running": events["lock.skipped_duplicate|redelivery_of_running_original"],
            "seen": overall.info.get("faults_seen", {}),
            "proxy_connections": proxy_connections,
        },
        "library": {
            "leases_lost": events["lock.lost"],
            "leases_lost_by_reason": {k.split("|", 1)[1]: v for k, v in events.items() if k.startswith("lock.lost|")},
            "unavailable_by_reason": {
                k.split("|", 1)[1]: v for k, v in events.items() if k.startswith("lock.backend_unavailable|")
            },
            "stale_fences_rejected": events["fence.stale"],
            "completion_skips": events["completion.skipped"],
            "completion_record_failed": events["completion.record_failed"],
            "duplicates_skipped_while_running": events["lock.skipped_duplicate|identical_work_running"],
            "waits": events["lock.retry_scheduled"],
            "waits_for_lock_redis": events["lock.retry_scheduled|backend_unavailable"],
            "wait_budget_exhausted": events["lock.wait_budget_exhausted"],
            "dead_holder_takeovers": events["lock.contended|taking_over_dead_holder_of_own_id"],
            "expired_before_release": events["lock.expired_before_release"],
            "fail_open": events["lock.fail_open"],
        },
        "cells": rows,
        "leg_invariants": {name: getattr(overall, name) for name, _ in LEG_INVARIANTS},
        "leg_examples": overall.examples,
    }


def _fmt_list(values: list[float], unit: str = "s") -> str:
    return ", ".join(f"{v:g}{unit}" for v in values) or "none"


def cell_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per cell: what happened, then every per-cell invariant's count."""
    cols = [Verdict.SHORT[n] for n, _ in CELL_INVARIANTS]
    width = max([len(r["cell"]) for r in rows] + [4])
    head = f"{'cell':<{width}} {'jobs':>5} {'eff':>5} {'vfail':>5} {'dedup':>5} {'exec':>5} " + " ".join(
        f"{c:>5}" for c in cols
    )
    lines = [head]
    for r in rows:
        counts = " ".join(f"{r['invariants'][n]:>5}" for n, _ in CELL_INVARIANTS)
        if r["control"]:
            verdict = f"control: {Verdict.SHORT[r['target']]} {'CAUGHT' if r['caught'] else 'MISSED'}"
        else:
            verdict = "ok" if r["ok"] else "VIOLATED"
        lines.append(
            f"{r['cell']:<{width}} {r['jobs']:>5} {r['effects']:>5} {r['failed_visibly']:>5}"
            f" {r['deduped_at_publish']:>5} {r['executions']:>5} {counts}  {verdict}"
        )
    return lines


LEGEND = (
    "eff effects · vfail jobs failed visibly (raise) · dedup publishes answered by a queued/running copy · exec"
    " bodies run\n" + " · ".join(f"{Verdict.SHORT[n]} {label}" for n, label in CELL_INVARIANTS)
)


def render(report: dict[str, Any]) -> str:
    """A leg's report as text."""
    o, p, f, lib = report["options"], report["plan"], report["faults"], report["library"]
    pauses = ", ".join(f"{x['worker'].split('@')[0]} {x['seconds']}s" for x in f["pauses"]) or "none"
    lost_by = ", ".join(f"{k} {v}" for k, v in sorted(lib["leases_lost_by_reason"].items()))
    unavailable = ", ".join(f"{k or '-'} {v}" for k, v in sorted(lib["unavailable_by_reason"].items()))
    store = "PostgreSQL (through a cuttable proxy)" if report["backend"] == "postgresql" else "the lock Redis"
    lines = [
        "",
        f"== chaos leg {report['run']}: {report['backend']} completion records (seed {o['seed']})"
        f" — {report['elapsed_s']}s ==",
        f"load     {len(report['cells'])} cells x {o['jobs']} jobs over {o['entities']} entities each:"
        f" {p['jobs']} jobs, {p['duplicates']} duplicate enqueues ({p['messages']} messages), {p['slow_jobs']}"
        f" long jobs; {o['workers']} workers x {o['concurrency']}",
        f"         lock TTL {o['ttl']}s, visibility_timeout {o['visibility_timeout']}s, acks_late, completion"
        f" records in {store}{', UNSAFE: ' + o['unsafe'] if o['unsafe'] else ''}",
        f"faults   {f['sigkills']} SIGKILLs ({f['sigkills_mid_body']} mid-body) · pauses: {pauses}"
        f" · lock Redis restarts: {_fmt_list(f['lock_redis_restarts'])}",
        f"         BUSY: {_fmt_list(f['busy'])} · NOREPLICAS: {_fmt_list(f['noreplicas'])}"
        f" · PostgreSQL store outages: {_fmt_list(f['pg_outages'])}",
        f"         {f['deliveries']} deliveries, {f['redelivered']} redelivered"
        f" ({f['redelivered_while_running']} while the original still ran)",
        f"library  leases lost {lib['leases_lost']} ({lost_by or '-'}) · stale fences rejected"
        f" {lib['stale_fences_rejected']} · dead-holder takeovers {lib['dead_holder_takeovers']}",
        f"         completion skips {lib['completion_skips']} · duplicates skipped while running"
        f" {lib['duplicates_skipped_while_running']} · waits {lib['waits']}"
        f" ({lib['waits_for_lock_redis']} for the lock Redis, {lib['wait_budget_exhausted']} budgets spent)",
        f"         store unavailable: {unavailable or '-'} · fail-open runs {lib['fail_open']}"
        f" · records that failed to write {lib['completion_record_failed']}",
        "",
        *cell_table(report["cells"]),
        "",
    ]
    for name, label in LEG_INVARIANTS:
        n = report["leg_invariants"][name]
        lines.append(f"{label:<56}{n:>7}  {'ok' if n == 0 else 'VIOLATED'}")
    for name, items in report["leg_examples"].items():
        lines.append(f"\n{name}, first {len(items)}:")
        lines += [f"  {json.dumps(x, default=str)[:900]}" for x in items]
    for r in report["cells"]:
        for name, items in r["examples"].items():
            if r["control"] and name == r["target"]:
                continue  # a control's own violation is the expected one
            if not r["control"] and r["ok"]:
                continue
            lines.append(f"\n{r['cell']}: {name}, first {len(items)}:")
            lines += [f"  {json.dumps(x, default=str)[:900]}" for x in items]
    lines.append(f"\nLEG {report['backend']}: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def render_summary(reports: list[dict[str, Any]], elapsed: float, seed: Any) -> str:
    """Every leg's cells side by side, the controls, and the overall result."""
    lines = ["", f"== chaos soak summary (seed {seed}) — {elapsed:.0f}s ==", LEGEND, ""]
    for report in reports:
        lines.append(f"-- {report['backend']} completion records, {report['elapsed_s']}s --")
        lines += cell_table(report["cells"])
        legs = " · ".join(f"{Verdict.SHORT[k]} {v}" for k, v in report["leg_invariants"].items())
        lines.append(f"leg: {legs}")
        lines.append("")
    controls = [(rep["backend"], r) for rep in reports for r in rep["cells"] if r["control"]]
    if controls:
        lines.append("negative controls (a guard switched off; its invariant must catch it):")
        for backend, r in controls:
            n = r["invariants"][r["target"]]
            lines.append(
                f"  {r['control']:<18} {backend:<10} {r['mode']}/{r['policy']} {r['workload']:<8}"
                f" {r['target']} = {n:<5} {'caught' if r['caught'] else 'MISSED'}"
            )
    ok = all(r["ok"] for r in reports)
    lines.append(f"\nRESULT: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)
