"""In-process counters: every lock event counted per task, hold times bucketed.

Counting is a dict update, never a round trip. ``snapshot()`` returns what was
counted since the process started; flushing to Redis for fleet-wide numbers is
done by whoever owns a client (the CLI reads the flushed totals).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

#: Upper bounds (ms) of the hold-time histogram buckets; the last is +inf.
HOLD_BUCKETS_MS = (10, 50, 100, 500, 1000, 5000, 30000, 60000, 300000)

_BUCKET_NAMES = [str(b) for b in HOLD_BUCKETS_MS] + ["+Inf"]

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()
_hold: dict[str, list[float]] = {}


def count(task_name: str, name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of ``task_name``."""
    with _lock:
        _counts[(task_name, name)] += n


def observe_hold(task_name: str, hold_ms: float) -> None:
    """Record one lease's hold time (count, sum, histogram)."""
    with _lock:
        row = _hold.setdefault(task_name, [0.0, 0.0] + [0.0] * (len(HOLD_BUCKETS_MS) + 1))
        row[0] += 1
        row[1] += hold_ms
        for i, bound in enumerate(HOLD_BUCKETS_MS):
            if hold_ms <= bound:
                row[2 + i] += 1
                break
        else:
            row[-1] += 1


def snapshot() -> dict[str, dict[str, Any]]:
    """Per task: its counters and hold-time summary."""
    with _lock:
        out: dict[str, dict[str, Any]] = {}
        for (task, name), n in _counts.items():
            out.setdefault(task, {})[name] = n
        for task, row in _hold.items():
            out.setdefault(task, {})["hold"] = {
                "count": int(row[0]),
                "sum_ms": row[1],
                "buckets": dict(zip(_BUCKET_NAMES, [int(x) for x in row[2:]], strict=True)),
            }
        return out


def clear() -> None:
    """Drop every counter (tests)."""
    with _lock:
        _counts.clear()
        _hold.clear()
