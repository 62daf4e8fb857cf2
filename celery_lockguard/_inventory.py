"""The lock inventory of an app: per locked task, its key, TTL, renewal, policies and completion.

What ``lockguard describe`` prints (Markdown for a design review or a
runbook, JSON for scripts), built from each task's *resolved* options -- the
values the worker will use, after every ``lockguard_*`` fallback -- so it
cannot drift from the configuration the way a hand-written table does.
"""

from __future__ import annotations

from typing import Any

from ._config import settings
from ._doctor import locked_tasks
from ._holders import RateTask
from ._redact import redact, redact_text
from ._terminal import printable
from .exceptions import ConfigurationError


def inventory(app: Any) -> list[dict[str, Any]]:
    """One entry per ``LockedTask`` of ``app``, from its resolved options (``error`` for an invalid one)."""
    s = settings(app)
    store = "redis" if s.completion_backend == "redis" else f"postgresql ({s.completion_table})"
    out: list[dict[str, Any]] = []
    for task in locked_tasks(app):
        try:
            o = task.lockguard_options
        except ConfigurationError as exc:
            out.append({"task": task.name, "error": redact_text(exc)})
            continue
        scope = o.idempotency_key.template if o.idempotency_key is not None else "task id"
        out.append(
            {
                "task": task.name,
                "key_template": o.lock_key.template
                if o.lock_key is not None
                else (o.idempotency_key.template if o.idempotency_key is not None else None),
                "locked": o.locked,
                "ttl": o.ttl,
                "renew": o.renew,
                "renew_every": round(o.ttl / 3, 3) if o.renew else None,
                "max_hold": o.max_hold,
                "mode": o.mode,
                "debounce": o.debounce,
                "queue_lock_ttl": o.queue_lock_ttl if o.mode != "while_running" else None,
                "on_locked": o.on_locked,
                "on_unavailable": o.on_unavailable,
                "max_waits": o.max_waits,
                "completion": o.completion,
                "completion_scope": scope if o.completion else None,
                # Records answer this task only, or every task of this namespace (issue 29 item 7).
                "completion_namespace": o.idempotency_namespace if o.completion else None,
                "completion_ttl": (o.completion_ttl_scope if o.idempotency_key is not None else o.completion_ttl_task)
                if o.completion
                else None,
                "completion_store": store if o.completion else None,
                "acks_late": bool(getattr(task, "acks_late", False)),
                "lock_limit": o.limit,
                "lock_rate": o.rate.text if o.rate is not None else None,
            }
        )
    return out


def key_templates(app: Any) -> dict[str, str]:
    """Task name -> the template its lease is named by (``stats`` shows it beside the task)."""
    out: dict[str, str] = {}
    for task in locked_tasks(app):
        try:
            opts = task.lockguard_options
        except ConfigurationError:
            continue
        source = opts.lock_key or opts.idempotency_key
        if source is not None:
            out[task.name] = source.template
    return out


def task_limits(app: Any) -> dict[str, int]:
    """Task name -> its ``lock_limit`` now (1 without one), per valid locked task: what ``describe KEY`` holds a slot
    holder's slot against (a body of an earlier deploy may hold a slot above a limit lowered since)."""
    out: dict[str, int] = {}
    for task in locked_tasks(app):
        try:
            out[task.name] = task.lockguard_options.limit
        except ConfigurationError:
            continue
    return out


def rate_tasks(app: Any) -> list[RateTask]:
    """The app's ``lock_rate`` tasks as ``lockguard locks`` matches an entity's window to them (template tasks only)."""
    out: list[RateTask] = []
    for task in locked_tasks(app):
        try:
            opts = task.lockguard_options
        except ConfigurationError:
            continue
        pattern = opts.lock_key.pattern() if opts.rate is not None and opts.lock_key is not None else None
        if pattern is not None and opts.rate is not None:
            out.append((pattern, opts.limit, opts.rate.count, opts.rate.window_ms))
    return out


def _cell(value: object) -> str:
    """A Markdown table cell: escaped for the terminal, and a ``|`` cannot open a column."""
    return printable(value, None).replace("|", "\\|")


def markdown(app: Any, rows: list[dict[str, Any]]) -> str:
    """The inventory as a Markdown table, headed by the lock Redis (redacted), the prefix and the store."""
    s = settings(app)
    lines = [
        f"# Lock inventory of `{_cell(app.main or 'app')}`",
        "",
        f"Lock Redis: `{_cell(redact(s.redis_url))}` · key prefix `{s.key_prefix}` · "
        f"completion store: `{'redis' if s.completion_backend == 'redis' else 'postgresql'}`",
        "",
        "| task (owner) | protected resource (key) | TTL | renewal | max hold | mode | when locked "
        "| Redis down | completion scope | completion TTL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{_cell(r['task'])}` | **invalid:** {_cell(r['error'])} | | | | | | | | |")
            continue
        renew = f"every {r['renew_every']:g}s" if r["renew"] else "off"
        scope = (
            "off"
            if not r["completion"]
            else ("task id" if r["completion_scope"] == "task id" else f"`{_cell(r['completion_scope'])}`")
        )
        if r.get("completion_namespace"):
            scope += f" (shared: `{_cell(r['completion_namespace'])}`)"
        ctl = f"{r['completion_ttl']:g}s" if r["completion"] else "-"
        # A LockedTask without a key runs unlocked alone, but under a workflow() it holds the workflow's lease.
        key = f"`{_cell(r['key_template'])}`" if r["key_template"] else "(none: unlocked; a workflow's key in one)"
        mode = r["mode"]
        if r.get("lock_limit", 1) > 1:
            mode += f", {r['lock_limit']} slots"
        if r.get("lock_rate"):
            mode += f", {_cell(r['lock_rate'])} starts"
        if r.get("debounce") is not None:
            mode += f", debounce {r['debounce']:g}s"
        lines.append(
            f"| `{_cell(r['task'])}` | {key} | {r['ttl']:g}s | {renew} | {r['max_hold']:g}s | {mode} "
            f"| {r['on_locked']} | {r['on_unavailable']} | {scope} | {ctl} |"
        )
    return "\n".join(lines)
