"""The soak's one-screen report: what was done to the system, what the library saw, what held.

Built from three independent sources so a bug in one cannot hide behind
another: the fault log the driver kept, the lock events the workers counted,
and the ledger plus execution history in PostgreSQL (the verdict).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .check import Faults, Verdict


def build_report(
    *,
    opts: dict[str, Any],
    run_id: str,
    plan: dict[str, int],
    faults: Faults,
    events: Counter[str],
    verdict: Verdict,
    elapsed: float,
) -> dict[str, Any]:
    """Everything the report shows, as JSON-able data; ``ok`` is the verdict."""
    info = verdict.info
    return {
        "run": run_id,
        "ok": verdict.ok,
        "elapsed_s": round(elapsed, 1),
        "options": opts,
        "plan": plan,
        "faults": {
            "sigkills": len(faults.kills),
            "sigkills_mid_body": info.get("executions_killed_mid_body", 0),
            "pauses": [{"worker": w, "seconds": round(b - a, 1)} for w, a, b in faults.pauses],
            "lock_redis_restarts": [{"down_s": round(b - a, 2)} for a, b in faults.restarts],
            "deliveries": events["delivery"],
            "redelivered": events["delivery|redelivered"],
            "redelivered_while_running": events["lock.skipped_duplicate|redelivery_of_running_original"],
        },
        "library": {
            "leases_lost": events["lock.lost"],
            "leases_lost_by_reason": {k.split("|", 1)[1]: v for k, v in events.items() if k.startswith("lock.lost|")},
            "stale_fences_rejected": events["fence.stale"],
            "completion_skips": events["completion.skipped"],
            "duplicates_skipped_while_running": events["lock.skipped_duplicate|identical_work_running"],
            "waits": events["lock.retry_scheduled"],
            "waits_for_lock_redis": events["lock.retry_scheduled|backend_unavailable"],
            "dead_holder_takeovers": events["lock.contended|taking_over_dead_holder_of_own_id"],
            "expired_before_release": events["lock.expired_before_release"],
        },
        "history": {
            "executions": info.get("executions", 0),
            "outcomes": info.get("outcomes", {}),
            "reported_lost": info.get("executions_reported_lost", 0),
            "killed_while_lease_destroyed": info.get("killed_while_lease_destroyed", 0),
            "effects": info.get("effects", 0),
            "provider_calls_per_job": info.get("provider_calls_per_job", {}),
        },
        "invariants": {name: getattr(verdict, name) for name, _ in Verdict.INVARIANTS},
        "examples": verdict.examples,
    }


def render(report: dict[str, Any]) -> str:
    """The report as text, one screen."""
    o, p, f, lib, h = report["options"], report["plan"], report["faults"], report["library"], report["history"]
    pauses = ", ".join(f"{x['worker'].split('@')[0]} {x['seconds']}s" for x in f["pauses"]) or "none"
    restarts = ", ".join(f"down {x['down_s']}s" for x in f["lock_redis_restarts"]) or "none"
    lost_by = ", ".join(f"{k} {v}" for k, v in sorted(lib["leases_lost_by_reason"].items()))
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(h["outcomes"].items()))
    calls = ", ".join(f"{k}x: {v}" for k, v in h["provider_calls_per_job"].items())
    lines = [
        "",
        f"== chaos soak {report['run']} (seed {o['seed']}) — {report['elapsed_s']}s ==",
        f"load     {o['jobs']} jobs over {o['entities']} entities, {p['duplicates']} duplicate enqueues"
        f" ({p['messages']} messages), {p['slow_jobs']} slow jobs; {o['workers']} workers x {o['concurrency']}",
        f"         lock TTL {o['ttl']}s, visibility_timeout {o['visibility_timeout']}s, acks_late,"
        f" completion records in PostgreSQL{', UNSAFE: ' + o['unsafe'] if o['unsafe'] else ''}",
        f"faults   {f['sigkills']} SIGKILLs ({f['sigkills_mid_body']} mid-body) · pauses: {pauses}"
        f" · lock Redis restarts: {restarts}",
        f"         {f['deliveries']} deliveries, {f['redelivered']} redelivered"
        f" ({f['redelivered_while_running']} while the original still ran)",
        f"library  leases lost {lib['leases_lost']} ({lost_by or '-'}) · stale fences rejected"
        f" {lib['stale_fences_rejected']} · dead-holder takeovers {lib['dead_holder_takeovers']}",
        f"         completion skips {lib['completion_skips']} · duplicates skipped while running"
        f" {lib['duplicates_skipped_while_running']} · waits {lib['waits']}"
        f" ({lib['waits_for_lock_redis']} for the lock Redis)",
        f"history  {h['executions']} executions: {outcomes}",
        f"         {h['reported_lost']} reported lost, {h['killed_while_lease_destroyed']} killed while a fault"
        f" had destroyed their lease · provider calls per job {calls or '-'}",
        "",
        f"{'invariant':<56}{'count':>7}",
    ]
    for name, label in Verdict.INVARIANTS:
        n = report["invariants"][name]
        lines.append(f"{label:<56}{n:>7}  {'ok' if n == 0 else 'VIOLATED'}")
    for name, items in report["examples"].items():
        lines.append(f"\n{name}, first {len(items)}:")
        lines += [f"  {json.dumps(x, default=str)[:900]}" for x in items]
    lines.append(f"\nRESULT: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)
