"""Lock events: counted, put on the current span and logged, in one call.

Where an event is logged (``lockguard_log_backend``):

* ``"logging"``: the standard library logger ``celery_lockguard``, so Celery's
  ``--loglevel``, format and ``worker_hijack_root_logger`` -- or the
  application's own logging configuration -- apply. The message reads
  ``lock.skipped_duplicate task_name=... lock_key=...``; the fields ride on the
  record as ``record.lockguard`` (a dict holding ``event`` too) for JSON and
  structlog formatters.
* ``"structlog"``: ``structlog.get_logger("celery_lockguard")`` with the fields
  as keyword arguments, into the application's structlog pipeline.
* ``"auto"`` (the default): structlog when the process has configured it
  (``structlog.is_configured()``), else logging.

The setting is read from the settings already loaded on the current app (or
the running task's app); before any are loaded, ``"auto"``. The renewer's
thread has neither: its events use the setting read where each lease was
tracked (:func:`emit_for`). The library never
configures logging or structlog. Logging never raises into the caller and costs
a level check when the level is off. Names and fields are a contract
(docs/reference.md).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from celery import _state

from . import _metrics as metrics
from . import _tracing as tracing
from ._terminal import MAX_SHOWN, printable

LOGGER_NAME = "celery_lockguard"

_stdlib = logging.getLogger(LOGGER_NAME)

#: The level of every event. Per-task and per-tick routine (acquired, released, renewed,
#: contended, a wait scheduled) is debug; what an operator acts on is info or above.
_LEVELS: dict[str, int] = {
    "lock.acquired": logging.DEBUG,
    "lock.released": logging.DEBUG,
    "lock.renewed": logging.DEBUG,
    "lock.contended": logging.DEBUG,
    "lock.admitted": logging.DEBUG,
    "lock.throttled": logging.DEBUG,
    "lock.retry_scheduled": logging.DEBUG,
    # One per wait, at info: the holder, when the call tries again and the attempt (the budget's count).
    "lock.waiting": logging.INFO,
    "lock.woken": logging.DEBUG,
    # info: the one line that says why Celery then logs "Task ... ignored" for a parked call's other copy.
    "lock.handoff_dropped": logging.INFO,
    "lock.debounced": logging.DEBUG,
    "lock.superseded": logging.INFO,
    "lock.debounce_missing": logging.WARNING,
    "lock.debounce_revoked": logging.WARNING,
    "workflow.started": logging.DEBUG,
    "workflow.entered": logging.DEBUG,
    "workflow.handed_over": logging.DEBUG,
    "workflow.member_dropped": logging.INFO,
    "workflow.released": logging.INFO,
    "workflow.taken_over": logging.WARNING,
    "workflow.released_on_error": logging.WARNING,
    "workflow.lost": logging.WARNING,
    "workflow.deadlock": logging.WARNING,
    "lock.skipped_duplicate": logging.INFO,
    "completion.skipped": logging.INFO,
    "completion.result_dropped": logging.INFO,
    "completion.forgotten": logging.INFO,
    "lock.lost": logging.WARNING,
    "lock.max_hold_reached": logging.WARNING,
    "lock.expired_before_release": logging.WARNING,
    "lock.force_released": logging.WARNING,
    "lock.fail_open": logging.WARNING,
    "lock.backend_unavailable": logging.WARNING,
    "lock.wait_budget_exhausted": logging.WARNING,
    "lock.wake_failed": logging.WARNING,
    "lock.under_replicated": logging.WARNING,
    "fence.stale": logging.WARNING,
    "completion.record_failed": logging.WARNING,
    "completion.key_reused": logging.WARNING,
}

_METHODS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error"}

_structlog_logger: Any = None


def level_of(event: str) -> int:
    """The level ``event`` is logged at (info for a name not in the table)."""
    return _LEVELS.get(event, logging.INFO)


def emit(event: str, task_name: str | None = None, **fields: Any) -> None:
    """Log ``event`` with its fields and count it for ``task_name``."""
    metrics.count(task_name or "-", event)
    tracing.span_event(event, task_name, fields)
    log(level_of(event), event, task_name, fields)


def emit_for(event: str, task_name: str | None, fields: dict[str, Any], *, backend: str, span: Any, n: int = 1) -> None:
    """:func:`emit` on behalf of the context an event belongs to, for the renewer.

    Its thread has neither the task's app (so ``lockguard_log_backend`` cannot
    be read there) nor the task's span; the renewer captures both where the
    lease is tracked (:func:`backend_choice`, ``tracing.current_span``).
    ``n`` counts coalesced occurrences of the event as one metrics update.
    """
    metrics.count(task_name or "-", event, n)
    tracing.span_event(event, task_name, fields, span)
    log(level_of(event), event, task_name, fields, backend=backend)


def log(
    level: int,
    event: str,
    task_name: str | None,
    fields: dict[str, Any],
    exc_info: bool = False,
    backend: str | None = None,
) -> None:
    """Log one event at ``level`` through ``backend`` (default: the one in force here); never raises."""
    try:
        if _use_structlog(backend):
            proxy, name = _structlog(), _METHODS.get(level, "info")
            if _below_level(proxy, name):
                # A filtering bound logger below its level: the call would return None and run nothing,
                # so the fields are not cleaned for it (the per-task debug events, in production).
                return
            method = getattr(proxy, name)
            task_name, fields = _clean(task_name, MAX_SHOWN), _clean_fields(fields)
            kwargs = {"task_name": task_name, **fields}
            if exc_info:
                kwargs["exc_info"] = True
            method(event, **kwargs)
        elif _stdlib.isEnabledFor(level):
            task_name, fields = _clean(task_name, MAX_SHOWN), _clean_fields(fields)
            _stdlib.log(
                level,
                "%s",
                render(event, task_name, fields),
                exc_info=exc_info,
                extra={"lockguard": {"event": event, "task_name": task_name, **fields}},
            )
    except Exception:  # noqa: BLE001 - a broken handler, filter or processor never fails a task
        pass


def render(event: str, task_name: str | None, fields: dict[str, Any]) -> str:
    """The message text: ``event key=value ...`` (``None`` values left out)."""
    parts = [event]
    if task_name is not None:
        parts.append(f"task_name={_text(task_name)}")
    parts.extend(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)


#: Fields that carry an id or a name from a message or from Redis: cut at ``MAX_SHOWN`` characters.
_ID_FIELDS = frozenset({"task_id", "holder_task_id", "lock_key", "scope", "worker", "host", "idempotency_key"})
#: Any other text field (a reason quoting an error) is cut here.
MAX_FIELD = 2048


def _clean(value: Any, limit: int = MAX_FIELD) -> Any:
    """A field value safe for a log line: text with non-printables escaped and cut at ``limit``.

    Task ids, names and keys come from message headers anyone with broker
    access writes: raw, an escape sequence or a newline would forge log lines
    (and a 100 kB id fill them). Printable short text, the usual case, is
    returned as it is, after one ``isprintable`` and one ``len``.
    """
    if isinstance(value, str) and (len(value) > limit or not value.isprintable()):
        return printable(value, limit)
    return value


def _clean_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: _clean(v, MAX_SHOWN if k in _ID_FIELDS else MAX_FIELD) for k, v in fields.items()}


def _text(value: Any) -> str:
    if isinstance(value, str):
        if value and not any(c.isspace() or c in '"=' for c in value):
            return value
        return json.dumps(value)
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def _use_structlog(backend: str | None = None) -> bool:
    choice = backend or backend_choice()
    if choice == "logging":
        return False
    if choice == "structlog":
        return True
    module = sys.modules.get("structlog")  # configured implies imported: no import on this path
    return module is not None and bool(module.is_configured())


def backend_choice() -> str:
    """``lockguard_log_backend`` of the settings loaded on the current app, else on the running task's app.

    The current app first: a thread-local read, where the task stack costs
    microseconds; in a worker both are the worker's app.
    """
    app = _state._tls.current_app or _state.default_app
    loaded = getattr(app, "_lockguard_settings", None) if app is not None else None
    if loaded is None:
        task = _state._task_stack.top
        loaded = getattr(getattr(task, "app", None), "_lockguard_settings", None) if task is not None else None
    return getattr(loaded, "log_backend", "auto")


def _structlog_nop() -> Any:
    """structlog's do-nothing level method (``make_filtering_bound_logger`` below its level), or ``None``."""
    try:
        from structlog._native import _nop
    except ImportError:  # pragma: no cover - a structlog without it: every call is made, as before
        return None
    return _nop


_NOP: Any = None


def _below_level(proxy: Any, name: str) -> bool:
    """Whether structlog's ``name`` method (``"debug"``...) is the filtering logger's do-nothing one.

    Asked of the wrapper class the proxy would bind, not of a bound logger: structlog's lazy proxy
    builds a new bound logger (and a new ``PrintLogger``) on every attribute read unless it caches
    on first use, which cost a quarter of a filtered debug event's instructions per delivery. A proxy
    that caches its logger (``cache_logger_on_first_use``) is asked directly: that logger decides, and
    lockguard's first event is its first use whatever its level.
    """
    if _NOP is None:
        return False
    config = getattr(sys.modules.get("structlog._config"), "_CONFIG", None)
    caches = getattr(proxy, "_cache_logger_on_first_use", None)
    if caches is None:
        caches = getattr(config, "cache_logger_on_first_use", False)
    wrapper = getattr(proxy, "_wrapper_class", None) or getattr(config, "default_wrapper_class", None)
    if "bind" in vars(proxy) or caches is True or wrapper is None:
        # Cached, or caching on its first use: reading the method binds nothing new after the first time, and
        # the first event (even a filtered one) fixes the configuration the cached logger keeps, as before.
        # No wrapper class to ask (a structlog without one): the bound method decides, as before the cut.
        return getattr(getattr(proxy, name), "__func__", None) is _NOP
    return getattr(wrapper, name, None) is _NOP


def _structlog() -> Any:
    global _structlog_logger, _NOP
    if _structlog_logger is None:
        import structlog

        _NOP = _structlog_nop()
        _structlog_logger = structlog.get_logger(LOGGER_NAME)
    return _structlog_logger


class EventLogger:
    """Logs events that are not counted (the renewer's loop, the metrics flusher, configuration).

    Called like a structlog logger: ``logger.error("lock.renewer_error", reason=..., exc_info=True)``.
    """

    def debug(self, event: str, task_name: str | None = None, **fields: Any) -> None:
        self._log(logging.DEBUG, event, task_name, fields)

    def info(self, event: str, task_name: str | None = None, **fields: Any) -> None:
        self._log(logging.INFO, event, task_name, fields)

    def warning(self, event: str, task_name: str | None = None, **fields: Any) -> None:
        self._log(logging.WARNING, event, task_name, fields)

    def error(self, event: str, task_name: str | None = None, **fields: Any) -> None:
        self._log(logging.ERROR, event, task_name, fields)

    @staticmethod
    def _log(level: int, event: str, task_name: str | None, fields: dict[str, Any]) -> None:
        exc_info = bool(fields.pop("exc_info", False))
        log(level, event, task_name, fields, exc_info)


logger = EventLogger()
