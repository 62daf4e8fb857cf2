"""The demo's verdict: what ran, what was skipped, and whether any money moved twice.

The report is computed from three independent sources -- the result backend
(did every job finish?), the lock events the workers counted (what did the
library decide?) and the ledger plus the provider's books (what actually
happened?) -- so a bug in one cannot hide behind another.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

CHARGE = "billing.charge_invoice"


def _total(events: dict[str, Counter[str]], event: str) -> int:
    return sum(events.get(event, Counter()).values())


def _histogram(per_invoice: dict[int, int], invoices: list[int]) -> dict[str, int]:
    """``{"1": 59, "2": 1}``: how many invoices have each count (0 included)."""
    return {str(k): v for k, v in sorted(Counter(per_invoice.get(i, 0) for i in invoices).items())}


def _overlaps(runs: list[tuple[float, float | None]]) -> int:
    """Catalog runs that started before the previous one finished (single-flight broken)."""
    return sum(1 for (_, end), (start, _) in pairwise(runs) if end is None or start < end)


def build_report(
    *,
    jobs: list[tuple[str, tuple[Any, ...]]],
    ids: list[str],
    states: dict[str, str],
    invoices: list[int],
    events: dict[str, Counter[str]],
    ledger: dict[str, Any],
    killed: dict[str, Any] | None,
    elapsed: float,
) -> dict[str, Any]:
    """Everything the demo shows, as plain JSON-able data, with ``ok`` and the list of ``problems``."""
    outcome = Counter(states.get(i, "LOST") for i in ids)
    charges, postings, emails = ledger["charges"], ledger["postings"], ledger["emails"]
    report: dict[str, Any] = {
        "elapsed_s": round(elapsed, 1),
        "jobs_enqueued": len(ids),
        "jobs_by_task": dict(Counter(name for name, _ in jobs)),
        "jobs_succeeded": outcome["SUCCESS"],
        "jobs_failed": outcome["FAILURE"] + outcome["REVOKED"],
        "jobs_lost": outcome["LOST"],
        "bodies_run": dict(events.get("lock.acquired", Counter())),
        "duplicates_skipped": _total(events, "lock.skipped_duplicate"),
        "waits": _total(events, "lock.retry_scheduled"),
        "completions_skipped": _total(events, "completion.skipped"),
        "leases_lost": _total(events, "lock.lost"),
        "stale_fences": _total(events, "fence.stale"),
        "takeovers": _total(events, "lock.contended#taking_over_dead_holder_of_own_id"),
        "killed": killed,
        "invoices": len(invoices),
        "charges_per_invoice": _histogram(charges, invoices),
        "provider_calls": sum(ledger["provider_calls"].values()),
        "postings_per_invoice": _histogram(postings, invoices),
        "receipts_per_invoice": _histogram(emails, invoices),
        "tenant_pages": ledger["tenant_pages"],
        "catalog_runs": len(ledger["catalog_runs"]),
        "catalog_overlaps": _overlaps(ledger["catalog_runs"]),
    }
    problems = []
    if report["jobs_lost"]:
        problems.append(f"{report['jobs_lost']} jobs never finished")
    if report["jobs_failed"]:
        problems.append(f"{report['jobs_failed']} jobs failed")
    twice = sorted(i for i in invoices if charges.get(i, 0) > 1)
    never = sorted(i for i in invoices if charges.get(i, 0) == 0)
    if twice:
        problems.append(f"invoices charged more than once: {twice}")
    if never:
        problems.append(f"invoices never charged: {never}")
    if any(postings.get(i, 0) != 1 for i in invoices):
        problems.append("an invoice does not have exactly one ledger posting")
    if any(emails.get(i, 0) == 0 for i in invoices):
        problems.append("a charged invoice got no receipt (a receipt job was lost)")
    if report["catalog_overlaps"]:
        problems.append(f"{report['catalog_overlaps']} catalog reindex runs overlapped")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def print_report(r: dict[str, Any]) -> None:
    """The human-readable report."""
    bodies = r["bodies_run"]
    killed = r["killed"]
    lines = [
        "",
        "== celery-lockguard demo report " + "=" * 40,
        f"jobs enqueued         {r['jobs_enqueued']:>5}   "
        + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in sorted(r["jobs_by_task"].items())),
        f"jobs finished         {r['jobs_succeeded']:>5}   failed {r['jobs_failed']}, lost {r['jobs_lost']}",
        f"bodies run            {sum(bodies.values()):>5}   "
        + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in sorted(bodies.items())),
        f"duplicates skipped    {r['duplicates_skipped']:>5}   identical work already running (lock.skipped_duplicate)",
        f"waits                 {r['waits']:>5}   other work on a busy entity, retried later (lock.retry_scheduled)",
        f"completions skipped   {r['completions_skipped']:>5}   the work had already run (completion.skipped)",
        f"leases lost           {r['leases_lost']:>5}   stale fences rejected {r['stale_fences']}",
    ]
    if killed:
        lines.append(
            f"worker child killed       1   pid {killed['pid']} holding {killed['lock_key']}; "
            f"redelivered and taken over at once: {r['takeovers']}"
        )
    else:
        lines.append("worker child killed       0   (no charge was running when the demo looked)")
    lines += [
        f"invoices              {r['invoices']:>5}   provider calls {r['provider_calls']}",
        f"charges per invoice          {_fmt(r['charges_per_invoice'])}",
        f"ledger postings per invoice  {_fmt(r['postings_per_invoice'])}",
        f"receipts per invoice         {_fmt(r['receipts_per_invoice'])}",
        f"tenant pages synced          {r['tenant_pages']}",
        f"catalog reindex runs         {r['catalog_runs']} (overlapping: {r['catalog_overlaps']}); "
        "in production, celery beat sends one tick a minute",
        f"elapsed                      {r['elapsed_s']} s",
        "",
        "OK: no invoice charged twice, no job lost." if r["ok"] else "FAILED: " + "; ".join(r["problems"]),
    ]
    print("\n".join(lines), flush=True)


def _fmt(histogram: dict[str, int]) -> str:
    """``{"1": 60}`` as ``60 invoices x 1``."""
    return ", ".join(f"{n} invoices x {count}" for count, n in histogram.items())
