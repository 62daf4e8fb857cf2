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
named under ``malformed``, and everything else is summed as usual. A metrics
key of a type no flush writes (a string planted where the totals hash or the
process index belongs) is read as empty and named under ``unreadable``: every
reader (``stats``, the exporter, the page, ``doctor``) survives it.

What is held *now* comes from the processes' gauges (``_metrics`` module
docstring): one ``ZREVRANGEBYSCORE`` names them, one pipeline of ``STRLEN``
sizes them and one of ``GETRANGE`` reads them (each at most
:data:`MAX_GAUGE_BYTES`, all at most :data:`MAX_GAUGES_BYTES`; a larger
gauge is skipped and counted with the members left out), only when any exist
-- never a ``SCAN``, whatever the
number of leases. Only the live window of the index is read (flushed in the
last ``WINDOW_KEEP``, at most :data:`MAX_SKEW` ahead), newest first, at most
:data:`MAX_PROCS`; the members left out are counted
(``lockguard_folded_labels{label="process"}``). A gauge that does not parse, or is older than the TTL it states, is
skipped.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from typing import Any

import redis

from ._holders import cut_field
from ._metrics import (
    HISTOGRAM_FIELD_PREFIXES,
    HISTOGRAMS,
    OPERATOR_RELEASE,
    WINDOW_KEEP,
    bucket_names,
    minute_key,
    parse_count,
    parse_timestamp,
    proc_key,
    procs_key,
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
    """Totals, the processes' gauges and (unless ``windows=False``, enough for Prometheus) the last hour's minutes.

    One pipeline, and two more after it (``STRLEN``, then a bounded ``GETRANGE`` per gauge) when any
    process has a live gauge.
    """
    now = time.time() if now is None else now
    this_minute = int(now // 60)
    minutes = list(range(this_minute - max(WINDOWS), this_minute + 1)) if windows else []
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(total_key(prefix))
    # The live window only, newest first and at most MAX_PROCS: a planted index (future scores, or a
    # million members) costs one bounded read, not a ZRANGE and MGET of all of it (issue 30).
    pipe.zrevrangebyscore(procs_key(prefix), now + MAX_SKEW, now - WINDOW_KEEP, start=0, num=MAX_PROCS)
    for m in minutes:
        pipe.hgetall(minute_key(prefix, m))
    keys = [total_key(prefix), procs_key(prefix), *(minute_key(prefix, m) for m in minutes)]
    # Per-command errors come back as values: one planted key of the wrong type costs its own numbers only.
    pipe.zcard(procs_key(prefix))
    replies = pipe.execute(raise_on_error=False)
    indexed = replies.pop()
    unreadable: list[str] = []
    for i, (key, reply) in enumerate(zip(keys, replies, strict=True)):
        expected = list if i == 1 else dict
        if isinstance(reply, Exception):
            if not is_wrong_type(reply):
                raise reply
            unreadable.append(key)
            replies[i] = expected()
        elif not isinstance(reply, expected):
            unreadable.append(key)
            replies[i] = expected()
    procs = [p for p in replies[1] if isinstance(p, str)]
    blobs, oversized = _read_gauges(client, [proc_key(prefix, p) for p in procs])
    return {
        "now": now,
        "total": replies[0],
        "minutes": dict(zip(minutes, replies[2:], strict=True)),
        "gauges": parse_gauges(blobs, now),
        # Index members not read: outside the live window (a planted future score) or past MAX_PROCS,
        # or a gauge past MAX_GAUGE_BYTES (or the read's MAX_GAUGES_BYTES).
        "procs_skipped": (max(0, indexed - len(replies[1])) if isinstance(indexed, int) else 0) + oversized,
        "unreadable": unreadable,
    }


#: Process gauges one read takes at most (the newest first): a fleet's prefork children, with room to spare.
MAX_PROCS = 4096
#: Largest process gauge read (bytes): a process's held rows, one per task it holds now, with room to spare.
MAX_GAUGE_BYTES = 1024 * 1024
#: Bytes of process gauges one read takes at most (newest first): thousands of processes' real gauges.
MAX_GAUGES_BYTES = 16 * 1024 * 1024


def _read_gauges(client: Any, names: list[str]) -> tuple[list[Any], int]:
    """The process gauges ``names`` (None where unreadable), and how many were too large to read.

    ``STRLEN`` of each first (one pipeline), then ``GETRANGE`` up to its size of those within
    :data:`MAX_GAUGE_BYTES` while the total stays within :data:`MAX_GAUGES_BYTES` (one more): planted
    4 MB gauges cost this reader nothing, not an ``MGET`` of all of them (issue 30). A gauge rewritten
    larger in between is read only up to the size it had (a cut JSON, skipped as not parsing).
    """
    if not names:
        return [], 0
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    sizes = pipe.execute(raise_on_error=False)  # a key of the wrong type: an error value, skipped
    budget = MAX_GAUGES_BYTES
    wanted: list[tuple[int, int]] = []  # (index, bytes)
    oversized = 0
    for i, size in enumerate(sizes):
        if not isinstance(size, int) or size <= 0:
            continue
        if size > MAX_GAUGE_BYTES or size > budget:
            oversized += 1
            continue
        budget -= size
        wanted.append((i, size))
    blobs: list[Any] = [None] * len(names)
    if wanted:
        pipe = client.pipeline(transaction=False)
        for i, size in wanted:
            pipe.getrange(names[i], 0, size - 1)
        for (i, _), blob in zip(wanted, pipe.execute(raise_on_error=False), strict=True):
            blobs[i] = blob
    return blobs, oversized


#: How far in the future (seconds) a process's flush time may be and still count: clocks of other hosts.
MAX_SKEW = 300.0


def is_wrong_type(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command for the type of the key (``WRONGTYPE``)."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


#: The most leases one process gauge row may count; a larger value is malformed and skipped.
MAX_HELD = 2**31


def parse_gauges(blobs: list[Any], now: float) -> list[dict[str, Any]]:
    """The held-now rows of every live process gauge; a blob that does not parse or is stale is skipped."""
    rows: list[dict[str, Any]] = []
    for blob in blobs:
        if not isinstance(blob, str):
            continue  # expired between ZRANGE and MGET, or never written
        try:
            gauge = json.loads(blob)
            at, ttl, held = float(gauge["at"]), float(gauge["ttl"]), gauge["held"]
        except (ValueError, TypeError, KeyError):
            continue
        if not (math.isfinite(at) and math.isfinite(ttl)) or at + ttl < now or not isinstance(held, list):
            continue
        for row in held:
            try:
                task, worker = str(row["task"]), str(row["worker"])
                n, oldest = row["held"], float(row["oldest_acquired_at"])
            except (ValueError, TypeError, KeyError, OverflowError):
                continue
            # A count no process could hold (inf, a 400-digit int) would fail every reader or the scrape itself.
            if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_HELD and math.isfinite(oldest):
                rows.append({"task": task, "worker": worker, "held": n, "oldest_acquired_at": oldest})
    return rows


def held_now(raw: dict[str, Any]) -> dict[tuple[str, str], tuple[int, float]]:
    """Per (task, worker): leases held now over its processes, and the oldest one's age in seconds."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for row in raw.get("gauges", []):
        key = (row["task"], row["worker"])
        age = max(0.0, raw["now"] - row["oldest_acquired_at"])
        n, oldest = out.get(key, (0, 0.0))
        out[key] = (n + row["held"], max(oldest, age))
    return out


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
        "superseded": counts["lock.superseded"],
        "from_record": counts["completion.skipped"],
        # lock_limit / lock_rate: starts admitted to a slot, and starts a full start window turned back.
        "admitted": counts["lock.admitted"],
        "throttled": counts["lock.throttled"],
        "throttle_rate": _ratio(counts["lock.throttled"], counts["lock.admitted"] + counts["lock.throttled"]),
        "waits": sum(counts[e] for e in _WAIT_EVENTS),
        "wait_rate_per_min": per_min(sum(counts[e] for e in _WAIT_EVENTS)),
        "avg_wait_ms": _ratio(counts["wait.sum_ms"], counts["wait.count"]),
        "avg_renew_lag_ms": _ratio(counts["renew_lag.sum_ms"], counts["renew_lag.count"]),
        "events": {k: v for k, v in sorted(counts.items()) if not k.startswith(HISTOGRAM_FIELD_PREFIXES)},
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
    for (task, worker), (n, age) in sorted(held_now(raw).items()):
        if task in tasks:  # a gauge is flushed with the acquisitions it counts: its task has totals
            tasks[task].setdefault("held_now", {})[worker] = {"held": n, "oldest_hold_s": round(age, 1)}
    return {
        "generated_at": now,
        "first_flush_at": first,
        "last_flush_at": last,
        "tasks": tasks,
        "malformed": sorted(malformed)[:MAX_MALFORMED_LISTED],
        "malformed_count": len(malformed),
        "unreadable": list(raw.get("unreadable", [])),
    }


def for_json(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with every text field cut (:func:`~._holders.cut_field`), as ``stats --json`` prints it.

    Task and worker names and malformed field names are read from hashes anyone with Redis access can
    write: one planted 8 MB name would otherwise be printed whole (issue 30).
    """
    tasks: dict[str, Any] = {}
    for task, entry in summary["tasks"].items():
        entry = dict(entry)
        if "key_template" in entry:
            entry["key_template"] = cut_field(entry["key_template"])
        if "held_now" in entry:
            entry["held_now"] = {cut_field(w): v for w, v in entry["held_now"].items()}
        tasks[str(cut_field(task))] = entry
    return {
        **summary,
        "tasks": tasks,
        "malformed": [cut_field(f) for f in summary["malformed"]],
        "unreadable": [cut_field(k) for k in summary["unreadable"]],
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
    if total["superseded"]:
        out.append(
            f"{plural(total['superseded'], 'debounced message')} superseded by a later publish for the same entity "
            "(lock_debounce): consumed without running, each result names the run that replaced it"
        )
    if ev.get("lock.debounce_missing"):
        out.append(
            f"{plural(ev['lock.debounce_missing'], 'debounced message')} ran without its debounce record (expired, "
            "evicted or lost in a restart): each ran rather than risk losing the burst's run; check maxmemory-policy"
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
    if total["throttled"]:
        share = total["throttle_rate"]
        out.append(
            f"{plural(total['throttled'], 'start')} throttled by lock_rate"
            + (f" ({share:.0%} of starts asked for)" if share is not None else "")
            + ": the entity's start window was full; each waited for the window (lock_max_waits), or raised "
            "LockThrottled under on_locked='raise'"
        )
    if total["from_record"]:
        out.append(
            f"{plural(total['from_record'], 'call')} answered from the completion record: the work had already run"
        )
    return out


# -- Prometheus text exposition ----------------------------------------------------


#: Distinct ``task`` label values per metric family, and (task, worker) pairs per gauge; the rest are folded.
MAX_TASK_SERIES = 500
#: Distinct ``event`` label values; the rest (names no worker writes, planted) are folded.
MAX_EVENT_SERIES = 64
#: Characters of a label value shown (the rest is cut, and says how much).
MAX_LABEL = 200
#: The label value everything past a series cap is summed under.
OTHER = "(other)"
#: Characters that mean something in the text alerts carry a label into (Slack's ``<!channel>``, HTML, Markdown).
_ALERT_UNSAFE = str.maketrans({c: f"\\x{ord(c):02x}" for c in "<>&`"})


def _label(value: str) -> str:
    """A label value: non-printables and alert-text markup written as text (``\\x1b``, ``\\x3c``), cut to
    :data:`MAX_LABEL`, then escaped for the text format.

    Label values reach alert summaries (``{{ $labels.task }}``): a task named
    ``<!channel>`` must not page a whole Slack channel, nor ``<img ...>`` run
    in an HTML mail.
    """
    return printable(value, MAX_LABEL).translate(_ALERT_UNSAFE).replace("\\", "\\\\").replace('"', '\\"')


def _activity(counts: Counter[str]) -> int:
    return sum(n for name, n in counts.items() if not name.startswith(HISTOGRAM_FIELD_PREFIXES))


def _fold(rows: dict[str, Counter[str]], keep: int) -> tuple[dict[str, Counter[str]], int]:
    """``rows`` with all but the ``keep`` most active summed under :data:`OTHER`; and how many were folded."""
    if len(rows) <= keep:
        return rows, 0
    ranked = sorted(rows, key=lambda k: (-_activity(rows[k]), k))
    kept = {k: rows[k] for k in ranked[: keep - 1]}
    other = kept.setdefault(OTHER, Counter())
    folded = 0
    for k in ranked[keep - 1 :]:
        if k != OTHER:
            folded += 1
        other.update(rows[k])
    return kept, folded


#: The histograms as Prometheus names them (seconds, per Prometheus conventions) and what each measures.
PROMETHEUS_HISTOGRAMS = {
    "hold": ("lockguard_hold_seconds", "Time between acquiring and releasing a lease."),
    "wait": (
        "lockguard_wait_seconds",
        "Lock wait: from a message's first delivery to its acquisition, waits spent re-queued included.",
    ),
    "renew_lag": (
        "lockguard_renewal_lag_seconds",
        "How late each renewal was sent against when it was due (0: on time or early).",
    ),
}
#: Label value of a task whose lock_key template the exporter's app does not know.
UNKNOWN_TEMPLATE = "unknown"


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram(lines: list[str], per_task: dict[str, Counter[str]], family: str) -> None:
    name, help_text = PROMETHEUS_HISTOGRAMS[family]
    _family(lines, name, "histogram", help_text)
    for task, counts in sorted(per_task.items()):
        if not counts[f"{family}.count"]:
            continue
        t = task  # already a label (:func:`prometheus`)
        cumulative = 0
        for bound, le_name in zip([*HISTOGRAMS[family], None], bucket_names(family), strict=True):
            cumulative += counts[f"{family}.le.{le_name}"]
            le = "+Inf" if bound is None else repr(bound / 1000)
            lines.append(f'{name}_bucket{{task="{t}",le="{le}"}} {cumulative}')
        lines.append(f'{name}_sum{{task="{t}"}} {counts[f"{family}.sum_ms"] / 1000}')
        lines.append(f'{name}_count{{task="{t}"}} {counts[f"{family}.count"]}')


def prometheus(raw: dict[str, Any], templates: dict[str, str] | None = None) -> str:
    """The fleet's metrics in Prometheus text format 0.0.4, named and typed as ``prometheus_client`` would.

    Counters (events per task; acquisitions and contended attempts per
    ``lock_key`` *template* -- ``templates`` maps task names to them, bounded
    by the code, never the rendered keys), histograms (hold, wait, renewal
    lag per task) and gauges (leases held now and the oldest hold's age per
    task and worker, from the processes' gauges).

    Bounded whatever Redis holds: at most :data:`MAX_TASK_SERIES` task label
    values per family (and task/worker pairs per gauge) and
    :data:`MAX_EVENT_SERIES` event names, the least active summed under
    ``(other)`` and counted in ``lockguard_folded_labels``; label values are
    sanitised by :func:`_label` (names that sanitise alike are summed).
    """
    total = raw["total"]
    raw_tasks = _split(total)
    per_task: dict[str, Counter[str]] = {}
    for task, counts in raw_tasks.items():
        per_task.setdefault(_label(task), Counter()).update(counts)
    per_task, folded_tasks = _fold(per_task, MAX_TASK_SERIES)
    events: Counter[str] = Counter()
    for counts in per_task.values():
        for name, n in counts.items():
            if not name.startswith(HISTOGRAM_FIELD_PREFIXES):
                events[_label(name)] += n
    kept_events = {name for name, _ in sorted(events.items(), key=lambda kv: (-kv[1], kv[0]))[: MAX_EVENT_SERIES - 1]}
    folded_events = len(events) - len(kept_events) if len(events) > MAX_EVENT_SERIES else 0
    if not folded_events:
        kept_events = set(events)
    lines: list[str] = []
    _family(lines, "lockguard_events_total", "counter", "Lock events per task, summed over every worker that flushed.")
    for task, counts in sorted(per_task.items()):
        row: Counter[str] = Counter()
        for name, n in counts.items():
            if not name.startswith(HISTOGRAM_FIELD_PREFIXES):
                event = _label(name)
                row[event if event in kept_events else OTHER] += n
        for event, n in sorted(row.items()):
            lines.append(f'lockguard_events_total{{task="{task}",event="{event}"}} {n}')
    for family in PROMETHEUS_HISTOGRAMS:
        _histogram(lines, per_task, family)
    by_template: dict[str, Counter[str]] = {}
    for task, counts in raw_tasks.items():
        template = _label((templates or {}).get(task, UNKNOWN_TEMPLATE))
        outcomes = by_template.setdefault(template, Counter())
        outcomes["acquired"] += counts["lock.acquired"]
        outcomes["contended"] += counts["lock.contended"]
    by_template, folded_templates = _fold(by_template, MAX_TASK_SERIES)
    for outcome in ("acquired", "contended"):
        name = f"lockguard_template_{outcome}_total"
        what = "Leases acquired" if outcome == "acquired" else "Attempts that found the entity held"
        _family(lines, name, "counter", f"{what}, per lock_key template (not the rendered key: bounded labels).")
        for template, outcomes in sorted(by_template.items()):
            if outcomes["acquired"] or outcomes["contended"]:
                lines.append(f'{name}{{template="{template}"}} {outcomes[outcome]}')
    held: dict[tuple[str, str], tuple[int, float]] = {}
    for (task, worker), (n, age) in held_now(raw).items():
        key = (_label(task), _label(worker))
        had_n, had_age = held.get(key, (0, 0.0))
        held[key] = (had_n + n, max(had_age, age))
    folded_pairs = 0
    if len(held) > MAX_TASK_SERIES:
        ranked = sorted(held, key=lambda k: (-held[k][0], -held[k][1], k))
        rest = ranked[MAX_TASK_SERIES - 1 :]
        other = (sum(held[k][0] for k in rest), max(held[k][1] for k in rest))
        held = {k: held[k] for k in ranked[: MAX_TASK_SERIES - 1]}
        had_n, had_age = held.get((OTHER, OTHER), (0, 0.0))
        held[(OTHER, OTHER)] = (had_n + other[0], max(had_age, other[1]))
        folded_pairs = len(rest)
    _family(
        lines,
        "lockguard_leases_held",
        "gauge",
        "Entities held now by running bodies (each of a multi-entity lease), per task and worker.",
    )
    for (task, worker), (n, _age) in sorted(held.items()):
        lines.append(f'lockguard_leases_held{{task="{task}",worker="{worker}"}} {n}')
    _family(lines, "lockguard_oldest_hold_seconds", "gauge", "Age of the oldest lease held now, per task and worker.")
    for (task, worker), (_n, age) in sorted(held.items()):
        lines.append(f'lockguard_oldest_hold_seconds{{task="{task}",worker="{worker}"}} {round(age, 3)}')
    _family(
        lines,
        "lockguard_folded_labels",
        "gauge",
        f'Label values past the series cap, summed under "{OTHER}" (task: per family; task_worker: per gauge; '
        "process: process gauges not read, outside the live window, past the cap or over the size bound).",
    )
    folded = {
        "task": folded_tasks,
        "event": folded_events,
        "template": folded_templates,
        "task_worker": folded_pairs,
        "process": raw.get("procs_skipped", 0),
    }
    for label, n in folded.items():
        lines.append(f'lockguard_folded_labels{{label="{label}"}} {n}')
    last = parse_timestamp(total.get("@last_flush_at"))
    if last is not None:
        name = "lockguard_metrics_last_flush_timestamp_seconds"
        _family(lines, name, "gauge", "When a worker last flushed its counts.")
        lines.append(f"lockguard_metrics_last_flush_timestamp_seconds {last}")
    return "\n".join(lines) + "\n"


#: Every metric family the exporter writes (the dashboard and the rules may name only these).
EXPORTED_METRICS = (
    "lockguard_events_total",
    *(name for name, _ in PROMETHEUS_HISTOGRAMS.values()),
    "lockguard_template_acquired_total",
    "lockguard_template_contended_total",
    "lockguard_leases_held",
    "lockguard_oldest_hold_seconds",
    "lockguard_metrics_last_flush_timestamp_seconds",
    "lockguard_folded_labels",
)
