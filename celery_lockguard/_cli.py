"""``celery -A proj lockguard ...``: the operator's view of locks, metrics and set-up.

A ``celery`` sub-command (entry point group ``celery.commands``), so it gets
the app from ``-A`` like every Celery command and reads the ``lockguard_*``
settings exactly as the tasks do (:func:`celery_lockguard._config.settings`,
:func:`celery_lockguard._connection.client`).

Commands only parse, call and print: who holds what is read by
:mod:`~celery_lockguard._holders`, the inventory by
:mod:`~celery_lockguard._inventory`, completion records by
:mod:`~celery_lockguard._completion_readers`, the metrics by
:mod:`~celery_lockguard._stats` and served by :mod:`~celery_lockguard._exporter`;
``release`` writes fences through :mod:`~celery_lockguard._fence_targets`.
The lock page (``exporter --page``) is :mod:`~celery_lockguard._page`.
Every text they print from Redis passes :func:`~celery_lockguard._terminal.printable`
(task ids and names come from message bodies anyone with broker access
writes), every URL or DSN :mod:`~celery_lockguard._redact`; output is on
stdout, log lines and errors on stderr.

Exit codes follow Celery's (``celery.platforms``): 0 ok; 1 a finding, an
aborted confirmation or nothing found; 64 bad usage; 69 the lock Redis (or
the completion or fence database) is unreachable; 78 invalid settings or task
options (or no fence table where ``release --fence-dsn`` should write).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_FAILURE, EX_UNAVAILABLE, EX_USAGE
from redis.exceptions import ResponseError

from . import _completion_readers as readers
from . import _connection as connection
from . import _doctor as doctor
from . import _exporter as exporter_server
from . import _fence_targets as fence_targets
from . import _handoff as handoff
from . import _inventory
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _page as page_server
from . import _page_state as page_state
from . import _stats as stats
from . import _terminal as terminal
from ._config import Settings, settings
from ._connection import UNAVAILABLE_ERRORS
from ._debounce import DebounceRow, read_debounce
from ._events import emit
from ._holders import (
    HeldLease,
    entity_use,
    idle_windows,
    iter_leases,
    parse_siblings,
    read_entity,
    read_waiting,
    sibling_names,
    top_leases,
)
from ._keys import (
    checkpoint_name,
    done_name,
    fence_row,
    meta,
    parse_claim_name,
    parse_lock_name,
    parse_slot_lock_name,
    record_scope,
    slot_lock_name,
)
from ._redact import redact, redact_text
from ._terminal import duration, entity, plural, printable
from .exceptions import ConfigurationError, CorruptFence

EX_CONFIG = getattr(os, "EX_CONFIG", 78)

_OUTPUT = "Output Options"
#: Rows ``lockguard locks`` shows unless told otherwise (--limit, --all).
DEFAULT_LOCKS_LIMIT = 50


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
        raise CeleryCommandException(f"invalid lockguard settings: {redact_text(exc)}", EX_CONFIG) from exc


@contextmanager
def _redis(s: Settings) -> Iterator[Any]:
    """The operator's lock Redis client; unreachable becomes exit 69 with the (redacted) URL."""
    try:
        yield connection.operator_client(s)
    except ConfigurationError as exc:
        raise CeleryCommandException(redact_text(exc), EX_CONFIG) from exc
    except UNAVAILABLE_ERRORS as exc:
        raise CeleryCommandException(
            f"the lock Redis {redact(s.redis_url)} is unreachable: "
            f"{exc.__class__.__name__}: {redact_text(exc, s.redis_url)}",
            EX_UNAVAILABLE,
        ) from exc


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _entity(key: str, prefix: str) -> str:
    """Accept the entity key K or its full Redis key ``{prefix}:v1:{K}:lock`` (or a slot's ``...:lock:<i>``)."""
    return parse_lock_name(prefix, key) or key


def _slot_of(key: str, prefix: str, slot: int | None) -> int:
    """The slot a ``release`` names: ``--slot``, else the one in a full slot key, else 0 (K's plain lease)."""
    parsed = parse_slot_lock_name(prefix, key)
    named = parsed[1] if parsed is not None else 0
    if slot is not None and parsed is not None and slot != named:
        raise CeleryCommandException(f"--slot {slot} contradicts the slot in {printable(repr(key))}", EX_USAGE)
    return slot if slot is not None else named


@click.group(name="lockguard")
@click.pass_context
def lockguard(ctx: click.Context, **_: Any) -> None:
    """Entity locks of this app: held leases, metrics, inventory and set-up checks."""


# -- locks ----------------------------------------------------------------------------------


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
@click.option(
    "--limit",
    default=DEFAULT_LOCKS_LIMIT,
    show_default=True,
    type=click.IntRange(min=1),
    cls=CeleryOption,
    help_group=_OUTPUT,
    help="Rows shown: those with most deliveries waiting, then the longest held (a 'showing N of M' line follows).",
)
@click.option(
    "--all",
    "every",
    is_flag=True,
    cls=CeleryOption,
    help_group=_OUTPUT,
    help="Stream every lease as it is read (in scan order, not sorted; memory stays one batch).",
)
@click.pass_context
def locks(ctx: click.Context, match: str, as_json: bool, limit: int, every: bool, **_: Any) -> None:
    """Held leases and queue claims (holder, worker, state, fence, held for, TTL left, waiting), debounced runs.

    By default the --limit rows an operator needs first, read without reading every lease (a bounded scan
    in the server: past SAMPLE_LEASES leases the rows are the oldest of a sample and the total an estimate,
    and the line under the rows says so); --all streams every one.
    """
    s = _settings(ctx)
    rated = _inventory.rate_tasks(_app(ctx))
    if every:
        with _redis(s) as client:
            _locks_all(client, s.key_prefix, match, as_json, rated)
        return
    with _redis(s) as client:
        sample = top_leases(client, s.key_prefix, match, limit)
        leases, waiting = sample.leases, sample.waiting
        pending = read_debounce(client, s.key_prefix, match, names=sample.debounce_names)[:limit]
        uses = entity_use(client, s.key_prefix, leases)
        held = {lease.key for lease in leases}
        windows = idle_windows(client, s.key_prefix, match, held, rated, keys=sample.rate_keys)
    if as_json:
        rows = [{**lease.as_dict(), "waiting": waiting.get(lease.key, 0)} for lease in leases]
        _echo_json(rows + [row.as_dict() for row in pending] + [use.as_dict(s.key_prefix) for use in windows])
        if sample.total > len(leases):
            click.echo(sample.summary(len(leases)), err=True)
        return
    if not leases and not pending and not windows:
        click.echo(f"no leases under {s.key_prefix!r} matching {match!r}")
        return
    if leases:
        _lease_table(leases, waiting)
        if sample.total > len(leases):
            click.echo(sample.summary(len(leases)))
    for use in [*uses, *windows]:  # lock_limit / lock_rate entities: slots held N/M, the start window's use
        click.echo(printable(use.text()))
    if pending:
        _debounce_table(pending)


def _locks_all(client: Any, prefix: str, match: str, as_json: bool, rated: list[Any]) -> None:
    """``locks --all``: every lease, a batch at a time as read (a JSON array written row by row)."""
    limited: list[HeldLease] = []  # lock_limit / lock_rate rows only: their entities' use is summed at the end
    count = 0
    for batch in iter_leases(client, prefix, match):
        waiting = read_waiting(client, prefix, sorted({lease.key for lease in batch}))
        limited += [lease for lease in batch if lease.limit is not None or lease.rate is not None]
        if as_json:
            for lease in batch:
                row = {**lease.as_dict(), "waiting": waiting.get(lease.key, 0)}
                line = json.dumps(row, sort_keys=True, default=str)
                click.echo(("[\n  " if not count else ",\n  ") + line, nl=False)
                count += 1
        else:
            table = _lease_table(batch, waiting, echo=False)
            click.echo(table if not count else table.split("\n", 1)[1] if "\n" in table else "")
            count += len(batch)
    pending = read_debounce(client, prefix, match)
    uses = entity_use(client, prefix, limited)
    windows = idle_windows(client, prefix, match, {lease.key for lease in limited}, rated)
    if as_json:
        rest = [row.as_dict() for row in pending] + [use.as_dict(prefix) for use in windows]
        for extra in rest:
            click.echo(("[\n  " if not count else ",\n  ") + json.dumps(extra, sort_keys=True, default=str), nl=False)
            count += 1
        click.echo("\n]" if count else "[]")
        return
    if not count and not pending and not windows:
        click.echo(f"no leases under {prefix!r} matching {match!r}")
        return
    for use in [*uses, *windows]:
        click.echo(printable(use.text()))
    if pending:
        _debounce_table(pending)


def _debounce_table(pending: list[DebounceRow]) -> None:
    """Debounce records: the pending run of each burst (or the run it ended in) and when it is due."""

    def cell(value: object) -> str:
        return "-" if value is None else str(value)

    rows = [
        [
            entity(row.key),
            row.task_name,
            cell(row.pending_task_id),
            row.state,
            "-" if row.due_in_ms is None else duration(row.due_in_ms),
            cell(row.superseded),
            cell(row.last_run),
            duration(row.ttl_left_ms),
        ]
        for row in pending
    ]
    headings = ["DEBOUNCED KEY", "TASK", "PENDING RUN", "STATE", "DUE IN", "SUPERSEDED", "LAST RUN", "TTL LEFT"]
    click.echo(terminal.table(headings, rows))


def _host_pid(lease: HeldLease, cell: Callable[[object, str], str]) -> str:
    """``host:pid`` of a holder, or ``-`` for one no process holds (a woken waiter's reservation: no host, pid 0)."""
    if not lease.host and not lease.pid and not {"host", "pid"} & set(lease.malformed):
        return "-"
    return f"{cell(lease.host, 'host')}:{cell(lease.pid, 'pid')}"


def _lease_table(leases: list[HeldLease], waiting: dict[str, int], echo: bool = True) -> str:
    """The leases and queue claims of ``lockguard locks``, with the deliveries waiting behind each entity."""
    rows = []
    for lease in leases:
        bad = lease.malformed

        def cell(value: object, name: str, bad: tuple[str, ...] = bad) -> str:
            return "?" if name in bad else ("-" if value is None else str(value))

        rows.append(
            [
                lease.shown,
                lease.state,
                cell(lease.task_name, "task_name") + (f" > {printable(lease.member)}" if lease.member else ""),
                cell(lease.task_id, "task_id"),
                lease.worker or _host_pid(lease, cell),
                cell(lease.fence, "fence"),
                "?" if "acquired_at" in bad else duration(lease.held_for_ms),
                duration(lease.ttl_left_ms),
                str(waiting.get(lease.key, 0) or "-"),
            ]
        )
    headings = ["KEY", "STATE", "TASK", "TASK ID", "WORKER", "FENCE", "HELD", "TTL LEFT", "WAITING"]
    table = terminal.table(headings, rows)
    if echo:
        click.echo(table)
    odd = [lease for lease in leases if lease.malformed]
    if odd:
        click.echo(
            f"{plural(len(odd), 'lease')} with values no worker writes (shown as ?): "
            + "; ".join(f"{entity(lease.key)}: {', '.join(lease.malformed)}" for lease in odd[:10]),
            err=True,
        )
    return table


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


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _holder_text(holder: dict[str, str]) -> str:
    """``task[id] on worker (fence N)`` for the prompt, every part escaped and bounded."""
    name, task_id = printable(holder.get("task_name") or "-"), printable(holder.get("task_id") or "-")
    where = printable(holder.get("worker") or holder.get("host") or "-")
    return f"{name}[{task_id}] on {where} (fence {printable(holder.get('fence') or '-')})" + _also_held(holder)


def _also_held(holder: dict[str, str]) -> str:
    """``, which also holds acct:2, acct:3`` for a multi-entity holder ("" else): a release frees one entity."""
    parsed = parse_siblings(holder.get("siblings"))
    names = sibling_names(*parsed) if parsed else ""
    return f", which also holds {names}" if names else ""


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
@click.option(
    "--slot",
    type=click.IntRange(min=0),
    default=None,
    cls=CeleryOption,
    help_group="Release Options",
    help="The slot of a lock_limit entity to release (as `locks` shows it; default 0, or the one in a full key).",
)
@click.pass_context
def release(
    ctx: click.Context,
    key: str,
    yes: bool,
    fence_dsns: tuple[str, ...],
    fence_table: str | None,
    slot: int | None = None,
    **_: Any,
) -> None:
    """Force-release the lease on KEY and bump its fence.

    KEY is the entity key (``invoice:42``, as ``locks`` shows it) or its full
    Redis key. The evicted holder is not stopped: it finds its lease lost at
    its next renewal (within ttl/3). Its fenced writes are rejected at once
    only in the databases given by --fence-dsn (or lockguard_fence_dsn), where
    the new fence is written; elsewhere the bump lives in Redis, and storage
    keeps accepting the evicted holder's fence until a newer holder writes.
    What it did is printed on stdout; the ``lock.force_released`` log line
    goes to stderr.
    """
    s = _settings(ctx)
    dsns = tuple(fence_dsns) or s.fence_dsns
    table = fence_table or s.fence_table
    entity = _entity(key, s.key_prefix)
    slot = _slot_of(key, s.key_prefix, slot)
    if not entity or any(c in entity for c in "{}") or any(c.isspace() for c in entity):
        # A rendered key never holds braces or whitespace (_keys.py escapes them): refuse rather than
        # touch a key no task uses, or keys of one name in two Cluster slots.
        raise CeleryCommandException(
            f"{printable(repr(key))} is not an entity key: rendered keys never contain braces or whitespace "
            "(copy it from `lockguard locks`)",
            EX_USAGE,
        )
    if not _is_utf8(entity):
        # Rendered keys are strict UTF-8 (_keys.py escapes the rest), so no worker holds this one: someone
        # planted it. The lease scripts cannot even name it; the operator deletes it by hand.
        raise CeleryCommandException(
            f"{printable(entity)} is not an entity key any task renders (not UTF-8): nothing was released; "
            f"inspect it with `redis-cli HGETALL` and delete it by hand",
            EX_USAGE,
        )
    where = ", ".join(f"{table} in {redact(d)}" for d in dsns)
    with _redis(s) as client:
        try:
            holder = client.hgetall(slot_lock_name(s.key_prefix, entity, slot))
        except ResponseError as exc:  # WRONGTYPE: a key planted where a lease belongs
            raise CeleryCommandException(
                f"{entity!r} under prefix {s.key_prefix!r} is not a lease ({printable(exc)}); nothing was released",
                EX_FAILURE,
            ) from None
        if not holder:
            raise CeleryCommandException(f"no lease on {entity!r} under prefix {s.key_prefix!r}", EX_FAILURE)
        if not yes:
            stops = (
                f"its fenced writes to {where} will be rejected."
                if dsns
                else "its fenced writes stay accepted until a newer holder writes (no --fence-dsn)."
            )
            click.confirm(
                f"Force-release {entity!r} held by {_holder_text(holder)}?\n"
                f"The holder keeps running until it notices; {stops}",
                abort=True,
            )
        try:
            opened = fence_targets.open_fence_databases(dsns, table)
        except fence_targets.FenceTargetError as exc:
            code = {"unreachable": EX_UNAVAILABLE, "no_table": EX_CONFIG}.get(exc.reason, EX_USAGE)
            raise CeleryCommandException(f"{printable(exc, None)}; nothing was released", code) from None
        try:
            # A lease end like any other: FORCE_RELEASE hands the entity to its oldest parked waiter, whose
            # woken copy is published below through the app (by name if its task is not imported here).
            deleted, fence, evicted, woken = lease_ops.force_release(
                client, s.key_prefix, entity, int(s.fence_ttl * 1000), slot=slot, reserve_ms=handoff.reserve_ms()
            )
        except BaseException as exc:
            fence_targets.close(opened)
            if isinstance(exc, CorruptFence):
                raise CeleryCommandException(
                    f"the fence counter {printable(repr(exc.key))} holds {printable(repr(exc.value))}, not an "
                    "integer a new fence can follow; nothing was released. Set it to an integer above every "
                    "fence written for this entity, then release again",
                    EX_FAILURE,
                ) from None
            raise
        # Slot i > 0 fences on its own row (``K#<i>``): the evicted holder of that slot is the one to stop.
        written, failed = fence_targets.bump_fences(opened, fence_row(entity, slot), fence, table)
        task_name = holder.get("task_name") or "-"
        with _log_to_stderr():
            emit(
                "lock.force_released",
                task_name,
                lock_key=entity,
                holder_task_id=evicted or holder.get("task_id"),
                fence=fence,
                reason="operator",
            )
            woke = handoff.wake(_app(ctx), s, woken, task_name, evicted or holder.get("task_id") or "", client)
        if deleted:
            # Its holder's own release will find the lease gone and count an expiry: stats subtracts this.
            metrics.count(task_name, metrics.OPERATOR_RELEASE)
        try:
            metrics.flush(client, s.key_prefix)
        except UNAVAILABLE_ERRORS:
            pass  # the release itself went through; only its count is lost
    was = printable(evicted or holder.get("task_id") or "-")
    named = repr(entity) if not slot else f"{entity!r} slot {slot}"
    if deleted:
        click.echo(f"released {named} (was {was}); fence is now {fence}")
        if _also_held(holder):
            also = _also_held(holder).removeprefix(", which also holds ")
            click.echo(f"its holder also holds {also}: those stay held (release each one to free it)")
    else:
        click.echo(f"{named} was already free when released; fence bumped to {fence}")
    if woke and woken is not None:
        click.echo(f"woke the oldest waiter ({printable(handoff.task_id_of(woken) or '-')}): it starts now")
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


@contextmanager
def _log_to_stderr() -> Iterator[None]:
    """Send the library's log lines to stderr while a command logs, whatever handler Celery's CLI set up.

    A command's stdout is its output (scripts parse ``release``'s), so a log
    line there corrupts it. Yet an app's own set-up often logs to stdout:
    ``logging.basicConfig(stream=sys.stdout)`` in a container, or structlog's
    default ``PrintLogger``. For the duration, stdlib handlers writing to
    stdout are pointed at stderr, and ``sys.stdout`` itself is stderr (what a
    ``PrintLogger`` made now writes to); handlers writing elsewhere (a file,
    a socket) are left alone.
    """
    import logging
    import sys
    from contextlib import redirect_stdout

    moved: list[tuple[logging.StreamHandler[Any], Any]] = []
    for name in ("celery_lockguard", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
                moved.append((handler, handler.stream))
                handler.setStream(sys.stderr)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        for handler, stream in moved:
            handler.setStream(stream)


# -- stats ------------------------------------------------------------------------------------


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
    FORCED counts leases an operator force-released (not counted as EXPIRED);
    FROM RECORD, calls answered from their completion record.
    """
    s = _settings(ctx)
    with _redis(s) as client:
        raw = stats.read(client, s.key_prefix, windows=not prometheus)
    for key in raw["unreadable"]:
        click.echo(f"metrics key {printable(key)} is of a type no worker writes, skipped", err=True)
    if prometheus:
        click.echo(stats.prometheus(raw, _inventory.key_templates(_app(ctx))), nl=False)
        return
    summary = stats.summarize(raw, _inventory.key_templates(_app(ctx)))
    if as_json:
        _echo_json(stats.for_json(summary))
        return
    if summary["malformed_count"]:
        listed = ", ".join(printable(f) for f in summary["malformed"])
        click.echo(
            f"{plural(summary['malformed_count'], 'metrics field')} with values no worker writes, skipped: {listed}",
            err=True,
        )
    if not summary["tasks"]:
        click.echo(f"no metrics flushed under {s.key_prefix!r} yet")
        return
    last = summary["last_flush_at"]
    click.echo(f"as of the last flush {time.time() - last:.0f}s ago" if last else "")
    for task, entry in summary["tasks"].items():
        if task == "-" and set(entry["windows"]["total"]["events"]) <= {"lock.renewed"}:
            continue
        template = f"  ({printable(entry['key_template'])})" if entry.get("key_template") else ""
        click.echo(f"\n{printable(task)}{template}")
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
                    str(w["force_released"]),
                    str(w["skipped_duplicates"]),
                    str(w["from_record"]),
                    str(w["waits"]),
                ]
            )
        headers = ["WINDOW", "ACQ/MIN", "ACQ", "CONTENTION", "AVG HOLD MS", "EXPIRED", "FORCED", "SKIPPED"]
        click.echo(terminal.table([*headers, "FROM RECORD", "WAITS"], rows))
        for worker, now in entry.get("held_now", {}).items():
            click.echo(f"  held now: {now['held']} on {printable(worker)} (oldest {now['oldest_hold_s']:.1f}s)")
        for reading in entry["readings"]:
            click.echo(f"  * {printable(reading, None)}")


# -- describe ---------------------------------------------------------------------------------


@lockguard.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def describe(ctx: click.Context, key: str | None, as_json: bool, **_: Any) -> None:
    """The lock inventory (Markdown, or JSON): per locked task its key, TTL, renewal, policies, completion.

    With KEY (an entity key, or the full Redis key of its lease or queue claim): that entity as held now
    instead -- its holder, the other entities a multi-entity holder holds with it (its siblings), and the
    deliveries waiting.
    """
    if key is not None:
        _describe_entity(ctx, key, as_json)
        return
    app = _app(ctx)
    _settings(ctx)
    rows = _inventory.inventory(app)
    if as_json:
        _echo_json(rows)
    else:
        click.echo(_inventory.markdown(app, rows))
    if any("error" in r for r in rows):
        ctx.exit(EX_CONFIG)


def _describe_entity(ctx: click.Context, key: str, as_json: bool) -> None:
    """``describe KEY``: the entity's lease (and lock_limit slots) as ``locks`` shows it, siblings spelled out."""
    s = _settings(ctx)
    name = parse_claim_name(s.key_prefix, key) or _entity(key, s.key_prefix)  # a claim's key names K too
    limits = _inventory.task_limits(_app(ctx))
    most = max(limits.values(), default=1)
    with _redis(s) as client:
        leases = read_entity(client, s.key_prefix, name, slots=most)
        waiting = read_waiting(client, s.key_prefix, [name])
    above = {lease.redis_key: n for lease in leases if (n := _above_limit(lease, limits, most)) is not None}
    if as_json:
        rows = []
        for lease in leases:
            row = {**lease.as_dict(), "waiting": waiting.get(lease.key, 0)}
            if lease.redis_key in above:  # a slot past the lock_limit a deploy lowered: still held, still counts
                row.update(above_limit=True, current_limit=above[lease.redis_key])
            rows.append(row)
        _echo_json(rows)
        return
    if not leases:
        click.echo(f"{entity(name)} is free: no lease under prefix {printable(repr(s.key_prefix))}")
        return
    _lease_table(leases, waiting)
    for lease in leases:
        if lease.redis_key in above:
            click.echo(_above_text(lease, above[lease.redis_key], lease.task_name in limits))
        names = sibling_names(lease.siblings, lease.sibling_count)
        if names:  # one acquisition, one token: a forced release of this entity frees it alone
            click.echo(
                f"{lease.label} is held with {names} by the same acquisition "
                f"({printable(lease.task_name or '-')}[{printable(lease.task_id or '-')}]); "
                "`release` of one entity leaves the others held until the holder ends"
            )


def _above_limit(lease: HeldLease, limits: dict[str, int], most: int) -> int | None:
    """The ``lock_limit`` a slot holder's slot is at or past now (its task's, else the app's largest), else None.

    A deploy that lowers ``lock_limit`` leaves the bodies of the old code on their slots: slot i >= the new N
    is held until they end, and new work does not count it.
    """
    if not lease.slot:
        return None
    now = limits.get(lease.task_name or "", most)
    return now if lease.slot >= now else None


def _above_text(lease: HeldLease, limit: int, known: bool) -> str:
    """The line under ``describe KEY``'s table for a slot above the current ``lock_limit``."""
    whose = (
        f"the current lock_limit of {printable(lease.task_name or '-')} ({limit})"
        if known
        else f"every lock_limit this app declares (largest {limit})"
    )
    was = f"lock_limit {lease.limit}" if lease.limit is not None else "an earlier lock_limit"
    return (
        f"{lease.label} is above {whose}: its holder was admitted under {was}, lowered since; new slot holders "
        f"do not count this slot, so until it ends the entity may have more than {limit} slot holders"
    )


# -- doctor -----------------------------------------------------------------------------------


@lockguard.command(name="doctor", cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.option(
    "--rabbitmq-consumer-timeout",
    "consumer_timeout",
    type=click.FloatRange(min=0.001),
    metavar="SECONDS",
    default=None,
    cls=CeleryOption,
    help_group="Broker Options",
    help="RabbitMQ's consumer_timeout in seconds, as the server sets it (default: RabbitMQ's 1800).",
)
@click.pass_context
def doctor_(ctx: click.Context, as_json: bool, consumer_timeout: float | None, **_: Any) -> None:
    """Check the set-up; exit non-zero with an explanation for each finding.

    Exit 0: nothing found; 78: invalid settings or task options; 69: the lock
    Redis is unreachable; 1: other findings. RabbitMQ's server-wide
    ``consumer_timeout`` cannot be read from a client, so it is given here
    (a queue's ``x-consumer-timeout`` argument in ``task_queues`` wins over it).
    """
    findings = doctor.run(_app(ctx), consumer_timeout=consumer_timeout)
    if as_json:
        _echo_json({"ok": not findings, "findings": [f.as_dict() for f in findings]})
    elif not findings:
        click.echo("lockguard doctor: no findings")
    else:
        for f in findings:
            click.echo(f"[{f.code}] {printable(f.message, None)}")
            if f.tasks:
                click.echo(f"    tasks: {', '.join(printable(t) for t in f.tasks)}")
    if any(f.code == "configuration" for f in findings):
        ctx.exit(EX_CONFIG)
    if any(f.code == "redis_unreachable" for f in findings):
        ctx.exit(EX_UNAVAILABLE)
    if findings:
        ctx.exit(EX_FAILURE)


# -- completions ---------------------------------------------------------------------------


@lockguard.group(name="completions")
def completions() -> None:
    """Completion records and checkpoints of a scope (``task:<task id>``, or an idempotency key)."""


_SCOPE = "Scope Options"


def _scope_options(fn: Any) -> Any:
    """``--task`` / ``--namespace``: whose records an idempotency key SCOPE names (``_keys.record_scope``)."""
    fn = click.option(
        "--namespace",
        default=None,
        cls=CeleryOption,
        help_group=_SCOPE,
        help="The idempotency_namespace the tasks of SCOPE share.",
    )(fn)
    return click.option(
        "--task",
        "task_name",
        default=None,
        cls=CeleryOption,
        help_group=_SCOPE,
        help="The task whose idempotency_key rendered SCOPE (its records answer that task only).",
    )(fn)


def _record_scope(scope: str, task_name: str | None, namespace: str | None) -> str:
    """The stored scope: SCOPE itself (``task:<id>``, or a record scope as events name it), or the record
    scope of an idempotency key SCOPE of one task (``--task``) or of a namespace (``--namespace``)."""
    if task_name is not None and namespace is not None:
        raise CeleryCommandException("give --task or --namespace, not both", EX_FAILURE)
    if namespace is not None:
        return record_scope(scope, "", namespace)
    return record_scope(scope, task_name) if task_name is not None else scope


def _postgres_store(s: Settings) -> Any:
    from ._completion import postgres_store

    return postgres_store(s.completion_backend, s.completion_table, namespace=s.key_prefix)


def _in_postgres(s: Settings, use: Callable[[Any], Any], failures: Any = Exception) -> Any:
    """``use`` the PostgreSQL completion store; one of ``failures`` is an EX_UNAVAILABLE naming the store, redacted."""
    try:
        return use(_postgres_store(s))
    except failures as exc:
        raise CeleryCommandException(
            f"the completion database {redact(s.completion_backend)} failed: {redact_text(exc, s.completion_backend)}",
            EX_UNAVAILABLE,
        ) from None


@completions.command(name="show", cls=CeleryCommand)
@click.argument("scope")
@_scope_options
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help_group=_OUTPUT, help="Print JSON.")
@click.pass_context
def completions_show(
    ctx: click.Context, scope: str, as_json: bool, task_name: str | None, namespace: str | None, **_: Any
) -> None:
    """Show the completion record and checkpoints of SCOPE (exit 1 if there are none)."""
    scope = _record_scope(scope, task_name, namespace)
    s = _settings(ctx)
    if s.completion_backend == "redis":
        with _redis(s) as client:
            found = readers.show_redis(client, s.key_prefix, scope)
    else:
        import psycopg

        found = _in_postgres(s, lambda store: readers.show_postgres(store, scope), psycopg.Error)
    if found is None:
        if as_json:
            _echo_json(None)
        raise CeleryCommandException(f"no completion record or checkpoint for scope {scope!r}", EX_FAILURE)
    if as_json:
        _echo_json(found)
        return
    for line in readers.show_lines(found):
        click.echo(line)


@completions.command(name="forget", cls=CeleryCommand)
@click.argument("scope")
@_scope_options
@_yes_option("Forget Options")
@click.pass_context
def completions_forget(
    ctx: click.Context, scope: str, yes: bool, task_name: str | None, namespace: str | None, **_: Any
) -> None:
    """Delete the completion record and checkpoints of SCOPE: the work may then run again."""
    scope = _record_scope(scope, task_name, namespace)
    s = _settings(ctx)
    if not yes:
        click.confirm(
            f"Forget the completion of {scope!r}? A redelivery or retry of that work will run it again.", abort=True
        )
    if s.completion_backend == "redis":
        with _redis(s) as client:
            deleted = int(client.delete(done_name(s.key_prefix, scope), checkpoint_name(s.key_prefix, scope)))
    else:
        deleted = _in_postgres(s, lambda store: store.forget(scope))  # any failure of the store, redacted
    if not deleted:
        raise CeleryCommandException(f"nothing recorded for scope {scope!r}", EX_FAILURE)
    with _log_to_stderr():
        emit("completion.forgotten", None, scope=scope, reason="operator")
    click.echo(f"forgot {scope!r}")


@completions.command(name="carry-over", cls=CeleryCommand)
@_yes_option("Carry-over Options")
@click.pass_context
def completions_carry_over(ctx: click.Context, yes: bool, **_: Any) -> None:
    """Copy records of the earlier format (named by the idempotency key alone) to the task that wrote them."""
    from ._completion import carry_over_redis

    s = _settings(ctx)
    owners = {}
    for task in doctor.locked_tasks(_app(ctx)):
        try:
            opts = task.lockguard_options
        except ConfigurationError as exc:
            raise CeleryCommandException(redact(exc), EX_CONFIG) from exc
        if opts.idempotency_key is not None and opts.completion:
            owners[meta(task.name)] = opts.record_prefix
    if not yes:
        click.confirm(
            f"Copy the earlier-format completion records of {len(owners)} task(s) to their new names?", abort=True
        )
    if s.completion_backend == "redis":
        with _redis(s) as client:
            copied = carry_over_redis(client, s.key_prefix, owners)
    else:
        copied = _in_postgres(s, lambda store: store.carry_over(owners))
    click.echo(f"carried over {copied} record(s)")


# -- exporter --------------------------------------------------------------------------------


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
@click.option(
    "--timeout",
    default=exporter_server.DEFAULT_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0.001),
    cls=CeleryOption,
    help_group="Exporter Options",
    help="Seconds a connection may take to send its request, or stay silent while served, before it is closed.",
)
@click.option(
    "--max-connections",
    default=exporter_server.DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    type=click.IntRange(min=1),
    cls=CeleryOption,
    help_group="Exporter Options",
    help="Requests served at once (a connection counts once its request has arrived); more are answered 503.",
)
@click.option(
    "--page",
    is_flag=True,
    cls=CeleryOption,
    help_group="Page Options",
    help="Also serve the read-only lock page at http://BIND:PORT/page.",
)
@click.option(
    "--page-interval",
    default=page_state.DEFAULT_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=0.1),
    cls=CeleryOption,
    help_group="Page Options",
    help="Seconds between the page's samples of leases and metrics (the open page updates as often).",
)
@click.option(
    "--doctor-interval",
    default=page_state.DEFAULT_DOCTOR_INTERVAL,
    show_default=True,
    type=click.FloatRange(min=1),
    cls=CeleryOption,
    help_group="Page Options",
    help="Seconds between the page's doctor runs (cached; never run per request).",
)
@click.option(
    "--auth",
    default=None,
    envvar=page_server.AUTH_ENV,
    show_envvar=True,
    cls=CeleryOption,
    help_group="Page Options",
    help="USER:PASSWORD every request (page and /metrics) must send as basic auth. Prefer the environment "
    "variable: an option shows in the process list.",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    cls=CeleryOption,
    help_group="Page Options",
    help="On a loopback --bind, the page and /metrics answer to loopback names only (against DNS rebinding); "
    "also to NAME (repeatable), e.g. the name a local reverse proxy forwards in Host.",
)
@click.option(
    "--insecure",
    is_flag=True,
    cls=CeleryOption,
    help_group="Page Options",
    help="Serve --page on a non-loopback --bind without --auth (refused otherwise: the page shows task ids, "
    "keys and hosts to anyone who can reach the port).",
)
@click.pass_context
def exporter(
    ctx: click.Context,
    bind: str,
    port: int,
    timeout: float,
    max_connections: int,
    page: bool,
    page_interval: float,
    doctor_interval: float,
    auth: str | None,
    allow_hosts: tuple[str, ...],
    insecure: bool,
    **_: Any,
) -> None:
    """Serve the fleet's metrics for Prometheus at http://BIND:PORT/metrics (until interrupted).

    With --page, also the read-only lock page at http://BIND:PORT/page: held
    leases, the busiest entities, the four numbers with sparklines, doctor
    findings; it updates while open.
    """
    s = _settings(ctx)
    try:
        credentials = page_server.parse_credentials(auth) if auth else None
    except ValueError as exc:
        raise CeleryCommandException(f"--auth / {page_server.AUTH_ENV}: {exc}", EX_USAGE) from None
    exposed = page and credentials is None and not page_server.loopback_host(bind.lower())
    if exposed and not insecure:
        raise CeleryCommandException(
            f"--page on --bind {printable(bind)} (not loopback) without --auth would show task ids, keys and "
            f"hosts to anyone who can reach port {port}: set {page_server.AUTH_ENV}=USER:PASSWORD (and put TLS "
            "in front), or keep --bind 127.0.0.1 and tunnel to it, or pass --insecure to serve it anyway",
            EX_USAGE,
        )
    if exposed:
        click.echo(
            f"warning: --insecure: the lock page on {printable(bind)} has no authentication; anyone who can "
            f"reach port {port} reads it",
            err=True,
        )
    state = page_state.PageState(_app(ctx), s, page_interval, doctor_interval) if page else None
    hosts = allow_hosts if page_server.loopback_host(bind.lower()) else None  # bound wider: any Host
    # On loopback the Host rule (DNS rebinding) holds for /metrics too, with or without --page.
    front = page_server.Front(state, credentials, hosts) if (state or credentials or hosts is not None) else None
    try:
        server = exporter_server.serve(s, bind, port, timeout=timeout, max_connections=max_connections, front=front)
    except OSError as exc:  # a port in use, an address this host does not have: the operator's input
        if state is not None:
            state.close()
        reason = exc.strerror or str(exc)
        raise CeleryCommandException(f"cannot listen on {bind} port {port}: {reason}", EX_UNAVAILABLE) from None
    server.templates = _inventory.key_templates(_app(ctx))  # per-template contention labels
    base = f"http://{f'[{bind}]' if ':' in bind else bind}:{server.server_address[1]}"
    click.echo(f"lockguard exporter: {base}/metrics (prefix {s.key_prefix!r})")
    if state is not None:
        state.start()
        click.echo(f"lockguard page: {base}{page_server.BASE}" + (" (basic auth)" if credentials else ""))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if state is not None:
            state.close()
