"""Lock events as OpenTelemetry span events, when OpenTelemetry is installed.

A trace should answer "why did this job do nothing?": the task's span (the
current span while the body's ``__call__`` runs, as opentelemetry's Celery
instrumentation sets it) gets one event per lock decision -- acquired,
skipped, waited, lost, released -- with the lock key and fence.

OpenTelemetry is optional (``pip install celery-lockguard[otel]``). The
import is tried once, on the first event; without it, or without a recording
span, an event costs a global lookup and a call.
"""

from __future__ import annotations

from typing import Any

#: Events put on the current span. ``lock.renewed`` is left out: it comes from
#: the renewer thread, outside any task's span, and would only be noise.
SPAN_EVENTS = frozenset(
    {
        "lock.acquired",
        "lock.skipped_duplicate",
        "completion.skipped",
        "lock.contended",
        "lock.retry_scheduled",
        "lock.wait_budget_exhausted",
        "lock.lost",
        "lock.max_hold_reached",
        "lock.expired_before_release",
        "lock.released",
        "lock.release_sent",
        "lock.force_released",
        "lock.fail_open",
        "lock.backend_unavailable",
        "fence.stale",
    }
)

_UNSET: Any = object()
_trace: Any = _UNSET


def _api() -> Any:
    """``opentelemetry.trace``, or ``None`` when OpenTelemetry is not installed (tried once)."""
    global _trace
    if _trace is _UNSET:
        api: Any = None
        try:
            from opentelemetry import trace as api
        except ImportError:
            pass
        _trace = api
    return _trace


def _value(value: Any) -> Any:
    """An attribute value OpenTelemetry accepts: str, bool, int, float, or a list of one of those."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return str(value)


def current_span() -> Any:
    """The recording span of the caller, or ``None``: for events made later, elsewhere (the renewer's).

    The renewer finds a lease lost on its own thread, outside every task's
    context; :func:`span_event` given this span puts the event on the task
    that held the lease instead of on whatever span is current there.
    """
    trace = _trace if _trace is not _UNSET else _api()
    if trace is None:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


#: ``span_event``'s default: the span current where the event is made.
CURRENT: Any = object()


def span_event(event: str, task_name: str | None, fields: dict[str, Any], span: Any = CURRENT) -> None:
    """Add ``event`` to ``span`` (default: the current span), with its fields as ``lockguard.*`` attributes.

    ``span=None`` puts it on no span. A span that has ended since it was
    captured records nothing.
    """
    if event not in SPAN_EVENTS or span is None:
        return
    if span is CURRENT:
        trace = _trace if _trace is not _UNSET else _api()  # no call once looked up (each delivery emits)
        if trace is None:
            return
        span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes = {f"lockguard.{k}": _value(v) for k, v in fields.items() if v is not None}
    if task_name:
        attributes["lockguard.task_name"] = task_name
    span.add_event(event, attributes)
