"""The same numbers as OpenTelemetry metrics, when OpenTelemetry is installed.

Beside the Redis flush (which the exporter and ``lockguard stats`` read), each
process records its counts into the OpenTelemetry meter ``celery_lockguard``,
so an application that exports OTel metrics (its own ``MeterProvider`` and
reader) gets them with no exporter at all:

=============================  ==========================  =======================
instrument                     kind                        attributes
=============================  ==========================  =======================
``lockguard.events``           counter                     ``task``, ``event``
``lockguard.hold.duration``    histogram (s)               ``task``
``lockguard.wait.duration``    histogram (s)               ``task``
``lockguard.renewal.lag``      histogram (s)               ``task``
``lockguard.leases.held``      observable gauge            ``task``, ``worker``
``lockguard.hold.oldest``      observable gauge (s)        ``task``, ``worker``
=============================  ==========================  =======================

Optional: ``opentelemetry-api`` is imported once, on first use; without it
every call here is a global read. With the API but no SDK configured, the
instruments are the API's no-ops. The histograms advise the same bucket
bounds as the Prometheus ones (API 1.23+). Renewal lag is taken from the
renewer's bucketed tally at each metrics flush (the renewer thread never calls
into OpenTelemetry, whose locks are green under gevent), so its OTel buckets
match and its sum counts each observation at its bucket's upper bound (the
+Inf bucket at the tally's mean).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

_UNSET: Any = object()
_instruments: Any = _UNSET  # None: OpenTelemetry is not installed
_lock = threading.Lock()

HISTOGRAM_NAMES = {
    "hold": "lockguard.hold.duration",
    "wait": "lockguard.wait.duration",
    "renew_lag": "lockguard.renewal.lag",
}


class _Instruments:
    def __init__(self, meter: Any) -> None:
        from . import _metrics as metrics

        self.events = meter.create_counter("lockguard.events", unit="{event}", description="Lock events per task.")
        self.histograms: dict[str, Any] = {}
        for family, name in HISTOGRAM_NAMES.items():
            bounds = [b / 1000 for b in metrics.HISTOGRAMS[family]]
            try:
                hist = meter.create_histogram(name, unit="s", explicit_bucket_boundaries_advisory=bounds)
            except TypeError:  # API before 1.23: no bucket advice
                hist = meter.create_histogram(name, unit="s")
            self.histograms[family] = hist
        meter.create_observable_gauge(
            "lockguard.leases.held", callbacks=[_observe_held], unit="{lease}", description="Leases held now."
        )
        meter.create_observable_gauge(
            "lockguard.hold.oldest", callbacks=[_observe_oldest], unit="s", description="Oldest lease held now."
        )


def _make(provider: Any = None) -> Any:
    try:
        from opentelemetry import metrics as api
    except ImportError:
        return None
    from ._version import __version__

    meter = (provider.get_meter if provider is not None else api.get_meter)("celery_lockguard", __version__)
    return _Instruments(meter)


def _get() -> Any:
    global _instruments
    if _instruments is _UNSET:
        with _lock:
            if _instruments is _UNSET:
                _instruments = _make()
    return _instruments


def use(provider: Any) -> None:
    """Record into ``provider`` from now on instead of the global one (tests; a process with its own provider)."""
    global _instruments
    with _lock:
        _instruments = _make(provider)


def add(task_name: str, event: str, n: int) -> None:
    """Count ``n`` occurrences of ``event`` for ``task_name``."""
    inst = _instruments if _instruments is not _UNSET else _get()  # no call once made (each delivery counts)
    if inst is not None:
        inst.events.add(n, {"task": task_name, "event": event})


def record(task_name: str, family: str, ms: float) -> None:
    """Record one observation (ms) of histogram ``family``."""
    inst = _instruments if _instruments is not _UNSET else _get()
    if inst is not None:
        inst.histograms[family].record(ms / 1000, {"task": task_name})


def record_row(task_name: str, family: str, row: list[float]) -> None:
    """Record a bucketed tally ([count, sum_ms, buckets...]) bucket by bucket (see the module docstring)."""
    inst = _get()
    if inst is None or not row[0]:
        return
    from . import _metrics as metrics

    hist, attrs = inst.histograms[family], {"task": task_name}
    bounds = metrics.HISTOGRAMS[family]
    for i, n in enumerate(row[2:]):
        value = bounds[i] if i < len(bounds) else row[1] / row[0]
        for _ in range(int(n)):
            hist.record(value / 1000, attrs)


def _observations(field: str) -> Iterator[Any]:
    from opentelemetry.metrics import Observation

    from . import _metrics as metrics

    now = time.time()
    for row in metrics.held_now(now):
        value = row["held"] if field == "held" else max(0.0, now - row["oldest_acquired_at"])
        yield Observation(value, {"task": row["task"], "worker": row["worker"]})


def _observe_held(_options: Any) -> Iterator[Any]:
    return _observations("held")


def _observe_oldest(_options: Any) -> Iterator[Any]:
    return _observations("oldest")
