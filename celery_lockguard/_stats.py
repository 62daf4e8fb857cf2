"""Reading the fleet's flushed metrics: the four numbers, recent windows, readings, Prometheus text.

The four numbers per task, for each window (last 1, 5, 15 and 60 minutes)
and in total:

* **acquisition rate** -- leases taken per minute (``lock.acquired``);
* **contention rate** -- contended attempts / (acquired + contended);
* **average hold time** -- mean ms between acquire and release;
* **expired-lock rate** -- leases that expired (or were taken) before their
  release / leases that ended (released + expired before release). A lease
  an operator force-released (``lockguard release``) is counted apart, as
  *forced*: its holder's release finds it gone and counts an expiry, which
  is subtracted here (one per ``operator.force_released``), so a release by
  hand never reads as "the TTL is too short".

A window of N minutes is the sum of the last N full per-minute buckets and
the current (partial) one; its rate divides by the seconds that really
covers, so a fresh minute does not make a rate jump. The
total's rate divides by the time since the fleet's first flush (at least a minute).

The readings are plain-language hints computed from those numbers; their
thresholds are below, so an operator can check why one fired.

Every field is parsed on its own (:func:`celery_lockguard._metrics.parse_count`):
a value no flush writes (``nan``, ``inf``, ``1e400``, text) is skipped and
named under ``malformed``, and everything else is summed as usual.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ._metrics import (
    _BUCKET_NAMES,
    HOLD_BUCKETS_MS,
    OPERATOR_RELEASE,
    minute_key,
    parse_count,
    parse_timestamp,
    total_key,
)
from ._terminal import plural, printable

#: Recent windows, in minutes (the longest must fit in ``metrics.WINDOW_KEEP``).
WINDOWS = (1, 5, 15, 60)

#: Contention at or above this share of attempts is "high".
HIGH_CONTENTION = 0.3
#: An average hold below this is "short" (ms).
SHORT_HOLD_MS = 1000.0
#: Fewer attempts than this in a window are too few to read anything into.
MIN_ATTEMPTS = 10
#: An expired-lock rate at or above this is worth a reading even when steady.
NOTABLE_EXPIRED = 0.01
#: Acquisitions in the last 5 minutes below this share of the hour's rate are "falling".
FALLING = 0.5

_WAIT_EVENTS = ("lock.retry_scheduled",)


def read(client: Any, prefix: str, now: float | None = None, windows: bool = True) -> dict[str, Any]:
    """Totals and (unless ``windows=False``, enough for Prometheus) the last hour's minute buckets: one pipeline."""
    now = time.time() if now is None else now
    this_minute = int(now // 60)
    minutes = list(range(this_minute - max(WINDOWS), this_minute + 1)) if windows else []
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(total_key(prefix))
    for m in minutes:
        pipe.hgetall(minute_key(prefix, m))
    replies = pipe.execute()
    return {"now": now, "total": replies[0] or {}, "minutes": dict(zip(minutes, replies[1:], strict=True))}


#: Malformed field names kept in a summary (the count of all of them is kept too).
MAX_MALFORMED_LISTED = 20


def _split(fields: dict[str, str], malformed: set[str] | None = None) -> dict[str, Counter[str]]:
    """Per task, the counters of one metrics hash; a field whose value no flush writes goes to ``malformed``."""
    out: dict[str, Counter[str]] = {}
    for field, value in fields.items():
        if field.startswith("@") or "|" not in field:
            continue
        n = parse_count(value)
        if n is None:
            if malformed is not None:
                malformed.add(field)
            continue
        task, name = field.rsplit("|", 1)
        out.setdefault(task, Counter())[name] += n
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def numbers(counts: Counter[str], seconds: float | None) -> dict[str, Any]:
    """The four numbers (and what they are made of) for one task over one window."""
    acquired = counts["lock.acquired"]
    contended = counts["lock.contended"]
    forced = max(0, counts[OPERATOR_RELEASE])
    ended_early = counts["lock.expired_before_release"]
    expired = max(0, ended_early - forced)  # a forced release's holder counted its lease as expired
    ended = counts["lock.released"] + ended_early
    hold_count = counts["hold.count"]
    per_min = (lambda n: n * 60.0 / seconds) if seconds else (lambda n: None)
    return {
        "seconds": round(seconds, 1) if seconds else None,
        "acquisitions": acquired,
        "acquisition_rate_per_min": per_min(acquired),
        "attempts": acquired + contended,
        "contended": contended,
        "contention_rate": _ratio(contended, acquired + contended),
        "hold_count": hold_count,
        "avg_hold_ms": _ratio(counts["hold.sum_ms"], hold_count),
        "expired": expired,
        "expired_rate": _ratio(expired, ended),
        "force_released": forced,
        "skipped_duplicates": counts["lock.skipped_duplicate"],
        "from_record": counts["completion.skipped"],
        "waits": sum(counts[e] for e in _WAIT_EVENTS),
        "wait_rate_per_min": per_min(sum(counts[e] for e in _WAIT_EVENTS)),
        "events": {k: v for k, v in sorted(counts.items()) if not k.startswith("hold.")},
    }


def summarize(raw: dict[str, Any], templates: dict[str, str] | None = None) -> dict[str, Any]:
    """Per task: the four numbers per window and in total, and the readings that apply."""
    now = raw["now"]
    this_minute = int(now // 60)
    into_minute = now - this_minute * 60
    total = raw["total"]
    malformed: set[str] = set()
    first, last = parse_timestamp(total.get("@first_flush_at")), parse_timestamp(total.get("@last_flush_at"))
    for name in ("@first_flush_at", "@last_flush_at"):
        if name in total and parse_timestamp(total[name]) is None:
            malformed.add(name)
    per_task_total = _split(total, malformed)
    per_minute = {m: _split(f or {}, malformed) for m, f in raw["minutes"].items()}
    tasks: dict[str, Any] = {}
    for task in sorted(per_task_total):
        windows: dict[str, Any] = {}
        for w in WINDOWS:
            counts: Counter[str] = Counter()
            for m in range(this_minute - w, this_minute + 1):
                counts.update(per_minute.get(m, {}).get(task, Counter()))
            windows[f"{w}m"] = numbers(counts, w * 60 + into_minute)
        # Counts reach Redis up to a flush interval after they happen: never read a rate off less than a minute.
        windows["total"] = numbers(per_task_total[task], max(now - first, 60.0) if first else None)
        entry: dict[str, Any] = {"windows": windows, "readings": readings(windows)}
        if templates and task in templates:
            entry["key_template"] = templates[task]
        tasks[task] = entry
    return {
        "generated_at": now,
        "first_flush_at": first,
        "last_flush_at": last,
        "tasks": tasks,
        "malformed": sorted(malformed)[:MAX_MALFORMED_LISTED],
        "malformed_count": len(malformed),
    }


def readings(w: dict[str, dict[str, Any]]) -> list[str]:
    """Plain-language hints for one task's windows (empty when nothing stands out)."""
    out: list[str] = []
    total, recent, hour = w["total"], w["5m"], w["60m"]
    basis, label = (recent, "last 5 min") if recent["attempts"] >= MIN_ATTEMPTS else (total, "in total")
    contention, hold = basis["contention_rate"], basis["avg_hold_ms"]
    if basis["attempts"] >= MIN_ATTEMPTS and contention is not None and contention >= HIGH_CONTENTION:
        if hold is not None and hold < SHORT_HOLD_MS:
            out.append(
                f"high contention ({contention:.0%} of attempts, {label}) with short holds ({hold:.0f} ms): "
                "the key is probably too broad -- unrelated calls share one entity key; make lock_key name "
                "the smallest object the side effect touches"
            )
        elif hold is not None:
            out.append(
                f"high contention ({contention:.0%} of attempts, {label}) with long holds: work on the same "
                "entity queues behind long bodies; expected for a hot entity, otherwise shorten the locked section"
            )
    if total["expired"]:
        rate_total, rate_recent = total["expired_rate"] or 0.0, recent["expired_rate"]
        if recent["expired"] and rate_recent is not None and rate_recent > rate_total:
            out.append(
                f"rising expired-lock rate ({rate_recent:.1%} in the last 5 min vs {rate_total:.1%} in total): "
                "the TTL is too short or the workers too slow (paused, overloaded, renewal off); raise lock_ttl "
                "or keep lock_renew on"
            )
        elif rate_total >= NOTABLE_EXPIRED:
            out.append(
                f"expired-lock rate {rate_total:.1%} ({plural(total['expired'], 'lease')} expired before release): "
                "the TTL is too short or the workers too slow; raise lock_ttl or keep lock_renew on"
            )
    hour_rate, recent_rate = hour["acquisition_rate_per_min"], recent["acquisition_rate_per_min"]
    if (
        hour["acquisitions"] >= MIN_ATTEMPTS
        and hour_rate
        and recent_rate is not None
        and recent_rate < FALLING * hour_rate
        and (recent["wait_rate_per_min"] or 0) > max(recent_rate, (hour["wait_rate_per_min"] or 0))
    ):
        out.append(
            f"falling acquisitions ({recent_rate:.1f}/min in the last 5 min vs {hour_rate:.1f}/min over the hour) "
            f"while waits grow ({recent['wait_rate_per_min']:.1f}/min): back-pressure -- calls queue up behind "
            "held keys; find the slow holders (lockguard locks) or add capacity"
        )
    ev = total["events"]
    if total["skipped_duplicates"]:
        stuck = ev.get("lock.expired_before_release", 0) + ev.get("lock.max_hold_reached", 0)
        out.append(
            f"{plural(total['skipped_duplicates'], 'duplicate')} skipped because identical work held the lock"
            + (
                f"; {plural(stuck, 'lease')} ended by expiry or max-hold, so some skips may be behind a stuck holder"
                if stuck
                else " (no lease expired: none were behind a stuck lock)"
            )
        )
    if ev.get("lock.wait_budget_exhausted"):
        out.append(
            f"{plural(ev['lock.wait_budget_exhausted'], 'call')} gave up waiting (lock_max_waits spent): raise "
            "lock_max_waits or find the holder that does not finish (lockguard locks)"
        )
    if ev.get("lock.max_hold_reached"):
        n = ev["lock.max_hold_reached"]
        out.append(f"{plural(n, 'lease')} reached lock_max_hold: the body ran longer than allowed")
    if ev.get("lock.fail_open"):
        n = ev["lock.fail_open"]
        out.append(f"{plural(n, 'body', 'bodies')} ran with no lock (fail_open while the lock Redis was unreachable)")
    if ev.get("lock.force_released"):
        n, by_hand = ev["lock.force_released"], total["force_released"]
        detail = f"{by_hand} by an operator, not counted as expired" if by_hand else "at a hard time limit or a revoke"
        out.append(f"{plural(n, 'lease')} {'was' if n == 1 else 'were'} force-released ({detail})")
    if total["from_record"]:
        out.append(
            f"{plural(total['from_record'], 'call')} answered from the completion record: the work had already run"
        )
    return out


# -- Prometheus text exposition ----------------------------------------------------


def _label(value: str) -> str:
    """A label value in the text format: non-printables written as text first (``\\x1b``), then escaped."""
    return printable(value, None).replace("\\", "\\\\").replace('"', '\\"')


def prometheus(raw: dict[str, Any]) -> str:
    """The fleet's totals in Prometheus text format 0.0.4 (counters and a hold-time histogram)."""
    total = raw["total"]
    per_task = _split(total)
    lines = [
        "# HELP lockguard_events_total Lock events per task, summed over every worker that flushed.",
        "# TYPE lockguard_events_total counter",
    ]
    for task, counts in sorted(per_task.items()):
        for name, n in sorted(counts.items()):
            if not name.startswith("hold."):
                lines.append(f'lockguard_events_total{{task="{_label(task)}",event="{_label(name)}"}} {n}')
    lines += [
        "# HELP lockguard_hold_seconds Time between acquiring and releasing a lease.",
        "# TYPE lockguard_hold_seconds histogram",
    ]
    for task, counts in sorted(per_task.items()):
        if not counts["hold.count"]:
            continue
        t = _label(task)
        cumulative = 0
        for bound, name in zip([*HOLD_BUCKETS_MS, None], _BUCKET_NAMES, strict=True):
            cumulative += counts[f"hold.le.{name}"]
            le = "+Inf" if bound is None else repr(bound / 1000)
            lines.append(f'lockguard_hold_seconds_bucket{{task="{t}",le="{le}"}} {cumulative}')
        lines.append(f'lockguard_hold_seconds_sum{{task="{t}"}} {counts["hold.sum_ms"] / 1000}')
        lines.append(f'lockguard_hold_seconds_count{{task="{t}"}} {counts["hold.count"]}')
    last = parse_timestamp(total.get("@last_flush_at"))
    if last is not None:
        lines += [
            "# HELP lockguard_metrics_last_flush_timestamp_seconds When a worker last flushed its counts.",
            "# TYPE lockguard_metrics_last_flush_timestamp_seconds gauge",
            f"lockguard_metrics_last_flush_timestamp_seconds {last}",
        ]
    return "\n".join(lines) + "\n"
