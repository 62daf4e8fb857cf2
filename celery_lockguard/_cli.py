"""``celery -A proj lockguard ...``: the operator's view of locks, metrics and set-up.

A ``celery`` sub-command (entry point group ``celery.commands``), so it gets
the app from ``-A`` like every Celery command and reads the ``lockguard_*``
settings exactly as the tasks do (:func:`celery_lockguard._config.settings`,
:func:`celery_lockguard._connection.client`).

Exit codes follow Celery's (``celery.platforms``): 0 ok; 1 a finding, an
aborted confirmation or nothing found; 64 bad usage; 69 the lock Redis (or
the completion or fence database) is unreachable; 78 invalid settings (or no
fence table where ``release --fence-dsn`` should write).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_FAILURE, EX_UNAVAILABLE, EX_USAGE

from . import _connection as connection
from . import _doctor as doctor
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _stats as stats
from ._config import Settings, settings
from ._connection import UNAVAILABLE_ERRORS
from ._events import emit
from ._keys import checkpoint_name, done_name, lock_name
from .exceptions import ConfigurationError

EX_CONFIG = getattr(os, "EX_CONFIG", 78)

_OUTPUT = "Output Options"


# -- plumbing -----------------------------------------------------------------------------


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_root().obj
    if obj is None or getattr(obj, "app", None) is None:
        raise CeleryCommandException("no Celery app: run it as `celery -A proj lockguard ...`", EX_USAGE)
    return obj.app


def _settings(ctx: click.Context) -> Settings:
    try:
        return settings(_app(ctx))
    except ConfigurationError as exc:
        raise CeleryCommandException(f"invalid lockguard settings: {exc}", EX_CONFIG) from exc


@contextmanager
def _redis(s: Settings) -> Iterator[Any]:
    """The lock Redis client; unreachable becomes exit 69 with the (redacted) URL."""
    try:
        yield connection.client(s)
    except ConfigurationError as exc:
        raise CeleryCommandException(str(exc), EX_CONFIG) from exc
    except UNAVAILABLE_ERRORS as exc:
        raise CeleryCommandException(
            f"the lock Redis {doctor.redact(s.redis_url)} is unreachable: {exc.__class__.__name__}: {exc}",
            EX_UNAVAILABLE,
        ) from exc


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _entity(key: str, prefix: str) -> str:
    """Accept the entity key K or its full Redis key ``{prefix}:v1:{K}:lock``."""
    head, tail = f"{prefix}:v1:{{", "}:lock"
    if key.startswith(head) and key.endswith(tail):
        return key[len(head) : -len(tail)]
    return key


def _duration(ms: float | None) -> str:
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


@click.group(name="lockguard")
@click.pass_context
def lockguard(ctx: click.Context, **_: Any) -> None:
    """Entity locks of this app: held leases, metrics, inventory and set-up checks."""


# -- locks ----------------------------------------------------------------------------------


def read_locks(client: Any, prefix: str, match: str = "*") -> list[dict[str, Any]]:
    """Every lease and queue claim under ``prefix`` whose entity key matches the glob ``match``."""
    head = f"{prefix}:v1:{{"
    names = sorted(client.scan_iter(match=f"{head}{match}}}:lock", count=1000))
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    out: list[dict[str, Any]] = []
    for i in range(0, len(names), 200):
        chunk = names[i : i + 200]
        pipe = client.pipeline(transaction=False)
        for name in chunk:
            pipe.hgetall(name)
            pipe.pttl(name)
        replies = pipe.execute()
        for name, fields, pttl in zip(chunk, replies[0::2], replies[1::2], strict=True):
            if not fields:
                continue  # released between SCAN and HGETALL
            acquired = int(fields.get("acquired_at") or 0) or None
            renewed = int(fields.get("renewed_at") or 0) or None
            out.append(
                {
                    "key": name[len(head) : -len("}:lock")],
                    "redis_key": name,
                    "state": fields.get("state") or "running",
                    "task_name": fields.get("task_name"),
                    "task_id": fields.get("task_id"),
                    "worker": fields.get("worker") or None,
                    "host": fields.get("host"),
                    "pid": int(fields["pid"]) if (fields.get("pid") or "").isdigit() else None,
                    "fence": int(fields["fence"]) if (fields.get("fence") or "").isdigit() else None,
                    "held_for_ms": now_ms - acquired if acquired else None,
                    "since_renewal_ms": now_ms - renewed if renewed else None,
                    "ttl_left_ms": int(pttl) if int(pttl) >= 0 else None,
                    "lease_ttl_ms": int(fields["ttl"]) if (fields.get("ttl") or "").isdigit() else None,
                }
            )
    return out


@lockguard.command(cls=CeleryCommand)
@click.option(
    "--match",
    default="*",
    show_default=True,
    cls=CeleryOption,
    help_group="Filter Options",
    help="Glob over entity keys (e.g. 'invoice:*').",
)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def locks(ctx: click.Context, match: str, as_json: bool, **_: Any) -> None:
    """Every held lease and queue claim: holder, worker, state, fence, held for, TTL left."""
    s = _settings(ctx)
    with _redis(s) as client:
        rows = read_locks(client, s.key_prefix, match)
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        click.echo(f"no leases under {s.key_prefix!r} matching {match!r}")
        return
    click.echo(
        _table(
            ["KEY", "STATE", "TASK", "TASK ID", "WORKER", "FENCE", "HELD", "TTL LEFT"],
            [
                [
                    r["key"],
                    r["state"],
                    r["task_name"] or "-",
                    r["task_id"] or "-",
                    r["worker"] or f"{r['host']}:{r['pid']}",
                    str(r["fence"]),
                    _duration(r["held_for_ms"]),
                    _duration(r["ttl_left_ms"]),
                ]
                for r in rows
            ],
        )
    )


def _yes_option(group: str) -> Any:
    """``--yes/-y``: skip the confirmation of a destructive command (for scripts)."""
    return click.option(
        "--yes",
        "-y",
        is_flag=True,
        cls=CeleryOption,
        help_group=group,
        help="Do not ask for confirmation (for scripts).",
    )


# -- release --------------------------------------------------------------------------------


def _fence_connections(dsns: tuple[str, ...], table: str) -> list[tuple[str, Any]]:
    """Open one connection per fence database and check its fence table, before anything is released.

    Unreachable is exit 69; a missing table is exit 78: a typo there would
    write the fence where no ``advance_fence`` looks.
    """
    import psycopg

    from .fencing import _table

    try:
        _table(table)
    except ValueError as exc:
        raise CeleryCommandException(str(exc), EX_USAGE) from exc
    opened: list[tuple[str, Any]] = []
    try:
        for dsn in dsns:
            try:
                conn = psycopg.connect(dsn, connect_timeout=5)
            except psycopg.Error as exc:
                raise CeleryCommandException(
                    f"the fence database {doctor.redact(dsn)} is unreachable: {exc}; nothing was released",
                    EX_UNAVAILABLE,
                ) from exc
            opened.append((dsn, conn))
            row = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
            if row is None or row[0] is None:
                raise CeleryCommandException(
                    f"no fence table {table!r} in {doctor.redact(dsn)} (create_fence_table, or --fence-table); "
                    "nothing was released",
                    EX_CONFIG,
                )
            conn.rollback()
    except BaseException:
        for _, conn in opened:
            conn.close()
        raise
    return opened


def _bump_fences(opened: list[tuple[str, Any]], entity: str, fence: int, table: str) -> tuple[list[str], list[str]]:
    """Write ``fence`` for ``entity`` into every fence table: (databases written, failures with why)."""
    from .fencing import bump_fence

    written: list[str] = []
    failed: list[str] = []
    for dsn, conn in opened:
        try:
            with conn.transaction():
                bump_fence(conn, entity, fence, table)
            written.append(doctor.redact(dsn))
        except Exception as exc:  # noqa: BLE001 - reported to the operator, with what it leaves open
            failed.append(f"{doctor.redact(dsn)}: {exc.__class__.__name__}: {exc}")
        finally:
            conn.close()
    return written, failed


@lockguard.command(cls=CeleryCommand)
@click.argument("key")
@_yes_option("Release Options")
@click.option(
    "--fence-dsn",
    "fence_dsns",
    multiple=True,
    cls=CeleryOption,
    help_group="Release Options",
    help="PostgreSQL DSN whose fence table advance_fence checks: the bumped fence is written there, so the "
    "evicted holder's fenced writes fail. Repeat for several databases. Default: lockguard_fence_dsn.",
)
@click.option(
    "--fence-table",
    default=None,
    cls=CeleryOption,
    help_group="Release Options",
    help="The fence table in those databases. Default: lockguard_fence_table (lockguard_fences).",
)
@click.pass_context
def release(
    ctx: click.Context, key: str, yes: bool, fence_dsns: tuple[str, ...], fence_table: str | None, **_: Any
) -> None:
    """Force-release the lease on KEY and bump its fence.

    KEY is the entity key (``invoice:42``, as ``locks`` shows it) or its full
    Redis key. The evicted holder is not stopped: it finds its lease lost at
    its next renewal (within ttl/3). Its fenced writes are rejected at once
    only in the databases given by --fence-dsn (or lockguard_fence_dsn), where
    the new fence is written; elsewhere the bump lives in Redis, and storage
    keeps accepting the evicted holder's fence until a newer holder writes.
    """
    s = _settings(ctx)
    dsns = tuple(fence_dsns) or s.fence_dsns
    table = fence_table or s.fence_table
    entity = _entity(key, s.key_prefix)
    if not entity or any(c in entity for c in "{}") or any(c.isspace() for c in entity):
        # A rendered key never holds braces or whitespace (_keys.py escapes them): refuse rather than
        # touch a key no task uses, or keys of one name in two Cluster slots.
        raise CeleryCommandException(
            f"{key!r} is not an entity key: rendered keys never contain braces or whitespace "
            "(copy it from `lockguard locks`)",
            EX_USAGE,
        )
    where = ", ".join(f"{table} in {doctor.redact(d)}" for d in dsns)
    with _redis(s) as client:
        holder = client.hgetall(lock_name(s.key_prefix, entity))
        if not holder:
            raise CeleryCommandException(f"no lease on {entity!r} under prefix {s.key_prefix!r}", EX_FAILURE)
        if not yes:
            stops = (
                f"its fenced writes to {where} will be rejected."
                if dsns
                else "its fenced writes stay accepted until a newer holder writes (no --fence-dsn)."
            )
            click.confirm(
                f"Force-release {entity!r} held by {holder.get('task_name')}[{holder.get('task_id')}] on "
                f"{holder.get('worker') or holder.get('host')} (fence {holder.get('fence')})?\n"
                f"The holder keeps running until it notices; {stops}",
                abort=True,
            )
        opened = _fence_connections(dsns, table)
        try:
            deleted, fence, evicted = lease_ops.force_release(
                client, s.key_prefix, entity, fence_ttl_ms=int(s.fence_ttl * 1000)
            )
        except BaseException:
            for _dsn, conn in opened:
                conn.close()
            raise
        written, failed = _bump_fences(opened, entity, fence, table)
        emit(
            "lock.force_released",
            holder.get("task_name") or "-",
            lock_key=entity,
            holder_task_id=evicted or holder.get("task_id"),
            fence=fence,
            reason="operator",
        )
        try:
            metrics.flush(client, s.key_prefix)
        except UNAVAILABLE_ERRORS:
            pass  # the release itself went through; only its count is lost
    if deleted:
        click.echo(f"released {entity!r} (was {evicted or holder.get('task_id')}); fence is now {fence}")
    else:
        click.echo(f"{entity!r} was already free when released; fence bumped to {fence}")
    if written:
        targets = ", ".join(f"{table} in {d}" for d in written)
        click.echo(f"fence {fence} written to {targets}: the evicted holder's advance_fence there raises StaleFence")
    if failed:
        raise CeleryCommandException(
            f"the lease is released, but fence {fence} was NOT written to: {'; '.join(failed)}. Until it is, "
            "the evicted holder's advance_fence there is still accepted; write it with "
            f"celery_lockguard.fencing.bump_fence(conn, {entity!r}, {fence}, {table!r})",
            EX_UNAVAILABLE,
        )
    if not dsns:
        click.echo(
            f"fence {fence} is in Redis only: the evicted holder is not stopped, and its advance_fence(...) "
            "is still accepted by storage until a newer holder of this entity writes through it. "
            "Pass --fence-dsn (or set lockguard_fence_dsn) to write the fence where advance_fence checks it."
        )


# -- stats ------------------------------------------------------------------------------------


def _templates(app: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for task in doctor.locked_tasks(app):
        try:
            opts = task.lockguard_options
        except ConfigurationError:
            continue
        source = opts.lock_key or opts.idempotency_key
        if source is not None:
            out[task.name] = source.template
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}" if x >= 0.1 or x == 0 else f"{x:.1%}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


@lockguard.command(name="stats", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.option(
    "--prometheus",
    is_flag=True,
    cls=CeleryOption,
    help_group=_OUTPUT,
    help="Print the totals in Prometheus text format.",
)
@click.pass_context
def stats_(ctx: click.Context, as_json: bool, prometheus: bool, **_: Any) -> None:
    """Per task: acquisition rate, contention rate, average hold, expired-lock rate.

    Over the last 1, 5, 15 and 60 minutes and in total, summed over every
    worker of the fleet, as of their last flush (lockguard_metrics_flush_interval).
    """
    s = _settings(ctx)
    with _redis(s) as client:
        raw = stats.read(client, s.key_prefix, windows=not prometheus)
    if prometheus:
        click.echo(stats.prometheus(raw), nl=False)
        return
    summary = stats.summarize(raw, _templates(_app(ctx)))
    if as_json:
        _echo_json(summary)
        return
    if not summary["tasks"]:
        click.echo(f"no metrics flushed under {s.key_prefix!r} yet")
        return
    last = summary["last_flush_at"]
    click.echo(f"as of the last flush {time.time() - last:.0f}s ago" if last else "")
    for task, entry in summary["tasks"].items():
        if task == "-" and set(entry["windows"]["total"]["events"]) <= {"lock.renewed"}:
            continue
        template = f"  ({entry['key_template']})" if entry.get("key_template") else ""
        click.echo(f"\n{task}{template}")
        rows = []
        for name in ("1m", "5m", "15m", "60m", "total"):
            w = entry["windows"][name]
            rows.append(
                [
                    name,
                    _num(w["acquisition_rate_per_min"]),
                    str(w["acquisitions"]),
                    _pct(w["contention_rate"]),
                    _num(w["avg_hold_ms"], "{:.0f}"),
                    _pct(w["expired_rate"]),
                    str(w["skipped_duplicates"]),
                    str(w["waits"]),
                ]
            )
        click.echo(
            _table(["WINDOW", "ACQ/MIN", "ACQ", "CONTENTION", "AVG HOLD MS", "EXPIRED", "SKIPPED", "WAITS"], rows)
        )
        for reading in entry["readings"]:
            click.echo(f"  * {reading}")


# -- describe ---------------------------------------------------------------------------------


def inventory(app: Any) -> list[dict[str, Any]]:
    """The lock inventory of ``app``: one entry per ``LockedTask``, from its resolved options."""
    s = settings(app)
    store = "redis" if s.completion_backend == "redis" else f"postgresql ({s.completion_table})"
    out: list[dict[str, Any]] = []
    for task in doctor.locked_tasks(app):
        try:
            o = task.lockguard_options
        except ConfigurationError as exc:
            out.append({"task": task.name, "error": str(exc)})
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
                "queue_lock_ttl": o.queue_lock_ttl if o.mode != "while_running" else None,
                "on_locked": o.on_locked,
                "on_unavailable": o.on_unavailable,
                "max_waits": o.max_waits,
                "completion": o.completion,
                "completion_scope": scope if o.completion else None,
                "completion_ttl": (o.completion_ttl_scope if o.idempotency_key is not None else o.completion_ttl_task)
                if o.completion
                else None,
                "completion_store": store if o.completion else None,
                "acks_late": bool(getattr(task, "acks_late", False)),
            }
        )
    return out


def _markdown(app: Any, rows: list[dict[str, Any]]) -> str:
    s = settings(app)
    lines = [
        f"# Lock inventory of `{app.main or 'app'}`",
        "",
        f"Lock Redis: `{doctor.redact(s.redis_url)}` · key prefix `{s.key_prefix}` · "
        f"completion store: `{'redis' if s.completion_backend == 'redis' else 'postgresql'}`",
        "",
        "| task (owner) | protected resource (key) | TTL | renewal | max hold | mode | when locked "
        "| Redis down | completion scope | completion TTL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['task']}` | **invalid:** {r['error']} | | | | | | | | |")
            continue
        renew = f"every {r['renew_every']:g}s" if r["renew"] else "off"
        scope = (
            "off"
            if not r["completion"]
            else ("task id" if r["completion_scope"] == "task id" else f"`{r['completion_scope']}`")
        )
        ctl = f"{r['completion_ttl']:g}s" if r["completion"] else "-"
        key = f"`{r['key_template']}`" if r["key_template"] else "(none: unlocked)"
        lines.append(
            f"| `{r['task']}` | {key} | {r['ttl']:g}s | {renew} | {r['max_hold']:g}s | {r['mode']} "
            f"| {r['on_locked']} | {r['on_unavailable']} | {scope} | {ctl} |"
        )
    return "\n".join(lines)


@lockguard.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def describe(ctx: click.Context, as_json: bool, **_: Any) -> None:
    """The lock inventory (Markdown, or JSON): per locked task its key, TTL, renewal, policies, completion."""
    app = _app(ctx)
    _settings(ctx)
    rows = inventory(app)
    if as_json:
        _echo_json(rows)
    else:
        click.echo(_markdown(app, rows))
    if any("error" in r for r in rows):
        ctx.exit(EX_CONFIG)


# -- doctor -----------------------------------------------------------------------------------


@lockguard.command(name="doctor", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def doctor_(ctx: click.Context, as_json: bool, **_: Any) -> None:
    """Check the set-up; exit non-zero with an explanation for each finding.

    Exit 0: nothing found; 69: the lock Redis is unreachable; 1: other findings.
    """
    findings = doctor.run(_app(ctx))
    if as_json:
        _echo_json({"ok": not findings, "findings": [f.as_dict() for f in findings]})
    elif not findings:
        click.echo("lockguard doctor: no findings")
    else:
        for f in findings:
            click.echo(f"[{f.code}] {f.message}")
            if f.tasks:
                click.echo(f"    tasks: {', '.join(f.tasks)}")
    if any(f.code == "redis_unreachable" for f in findings):
        ctx.exit(EX_UNAVAILABLE)
    if findings:
        ctx.exit(EX_FAILURE)


# -- completions ---------------------------------------------------------------------------


@lockguard.group(name="completions")
def completions() -> None:
    """Completion records and checkpoints of a scope (``task:<task id>``, or an idempotency key)."""


def _decode(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _show_redis(client: Any, prefix: str, scope: str) -> dict[str, Any] | None:
    pipe = client.pipeline(transaction=False)
    pipe.get(done_name(prefix, scope))
    pipe.pttl(done_name(prefix, scope))
    pipe.hgetall(checkpoint_name(prefix, scope))
    pipe.pttl(checkpoint_name(prefix, scope))
    record, record_ttl, cps, cp_ttl = pipe.execute()
    if record is None and not cps:
        return None
    return {
        "scope": scope,
        "store": "redis",
        "record": _decode(record) if record is not None else None,
        "record_ttl_ms": record_ttl if record is not None else None,
        "checkpoints": {k: _decode(v) for k, v in sorted(cps.items())},
        "checkpoints_ttl_ms": cp_ttl if cps else None,
    }


def _show_pg(s: Settings, scope: str) -> dict[str, Any] | None:
    import psycopg

    from ._completion import postgres_store

    store = postgres_store(s.completion_backend, s.completion_table, namespace=s.key_prefix)
    try:
        rows = store.entries(scope)
    except psycopg.OperationalError as exc:
        raise CeleryCommandException(f"the completion database is unreachable: {exc}", EX_UNAVAILABLE) from exc
    if not rows:
        return None
    record = next((r for r in rows if r[0] == ""), None)
    cps = {r[0][3:]: _decode(r[1]) for r in rows if r[0].startswith("cp:")}
    cp_ttl = max((r[2] for r in rows if r[0].startswith("cp:")), default=None)
    return {
        "scope": scope,
        "store": f"postgresql ({store.table}, namespace {store.namespace})",
        "record": _decode(record[1]) if record else None,
        "record_ttl_ms": record[2] if record else None,
        "checkpoints": cps,
        "checkpoints_ttl_ms": cp_ttl,
    }


@completions.command(name="show", cls=CeleryCommand)
@click.argument("scope")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def completions_show(ctx: click.Context, scope: str, as_json: bool, **_: Any) -> None:
    """Show the completion record and checkpoints of SCOPE (exit 1 if there are none)."""
    s = _settings(ctx)
    if s.completion_backend == "redis":
        with _redis(s) as client:
            found = _show_redis(client, s.key_prefix, scope)
    else:
        found = _show_pg(s, scope)
    if found is None:
        if as_json:
            _echo_json(None)
        raise CeleryCommandException(f"no completion record or checkpoint for scope {scope!r}", EX_FAILURE)
    if as_json:
        _echo_json(found)
        return
    rec = found["record"]
    if rec is not None:
        click.echo(
            f"{scope}: completed by {rec.get('task_id')} -> {json.dumps(rec.get('result'))} "
            f"(kept {_duration(found['record_ttl_ms'])} more)"
        )
    else:
        click.echo(f"{scope}: no completion record")
    for name, value in found["checkpoints"].items():
        shown = "done, no value" if value == {"novalue": True} else json.dumps(value.get("value"))
        click.echo(f"  checkpoint {name}: {shown}")


@completions.command(name="forget", cls=CeleryCommand)
@click.argument("scope")
@_yes_option("Forget Options")
@click.pass_context
def completions_forget(ctx: click.Context, scope: str, yes: bool, **_: Any) -> None:
    """Delete the completion record and checkpoints of SCOPE: the work may then run again."""
    s = _settings(ctx)
    if not yes:
        click.confirm(
            f"Forget the completion of {scope!r}? A redelivery or retry of that work will run it again.", abort=True
        )
    if s.completion_backend == "redis":
        with _redis(s) as client:
            deleted = int(client.delete(done_name(s.key_prefix, scope), checkpoint_name(s.key_prefix, scope)))
    else:
        from ._completion import postgres_store

        try:
            deleted = postgres_store(s.completion_backend, s.completion_table, namespace=s.key_prefix).forget(scope)
        except Exception as exc:
            raise CeleryCommandException(f"the completion database failed: {exc}", EX_UNAVAILABLE) from exc
    if not deleted:
        raise CeleryCommandException(f"nothing recorded for scope {scope!r}", EX_FAILURE)
    emit("completion.forgotten", None, scope=scope, reason="operator")
    click.echo(f"forgot {scope!r}")


# -- exporter --------------------------------------------------------------------------------


def _handler(s: Settings) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        """GET /metrics: the fleet's totals as Prometheus text, read from Redis on each scrape."""

        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = stats.prometheus(stats.read(connection.client(s), s.key_prefix, windows=False)).encode()
                code = 200
            except UNAVAILABLE_ERRORS as exc:
                body, code = f"lock Redis unreachable: {exc.__class__.__name__}\n".encode(), 503
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return MetricsHandler


@lockguard.command(cls=CeleryCommand)
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    cls=CeleryOption,
    help_group="Exporter Options",
    help="Address to listen on.",
)
@click.option(
    "--port",
    default=9808,
    show_default=True,
    type=int,
    cls=CeleryOption,
    help_group="Exporter Options",
    help="Port to listen on.",
)
@click.pass_context
def exporter(ctx: click.Context, bind: str, port: int, **_: Any) -> None:
    """Serve the fleet's metrics for Prometheus at http://BIND:PORT/metrics (until interrupted)."""
    s = _settings(ctx)
    server = ThreadingHTTPServer((bind, port), _handler(s))
    click.echo(f"lockguard exporter: http://{bind}:{server.server_address[1]}/metrics (prefix {s.key_prefix!r})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
