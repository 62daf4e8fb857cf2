"""Worker-side hooks, connected explicitly by :func:`install` (nothing at import).

The worker's *main* process learns of a hard time limit or a terminate-revoke
but never saw the lease token. It identifies the holder by task id and host
and shortens the lease to a short grace instead of deleting it: billiard
reports a hard timeout before the child is surely dead, so deleting could let
a successor overlap a body still running.

A hard time limit reports only the task id, args and kwargs (``task_failure``),
not the request whose headers name a workflow; so the main process remembers
each workflow member's request from ``task_received``, weakly (an entry lives
exactly as long as Celery keeps the request), to end the workflow there too.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.exceptions import TimeLimitExceeded

from . import _metrics as metrics

if TYPE_CHECKING:
    from ._config import Settings

_installed = False
_lock = threading.Lock()
EX_CONFIG = getattr(os, "EX_CONFIG", 78)
#: Main process: the requests of workflow members received and not yet dropped by Celery, by task id.
_members: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def install(app: Any = None) -> None:
    """Connect the hooks once per process (called when a ``LockedTask`` is bound).

    With ``app``, also check its tasks' options once it finalizes
    (:func:`_validate_after_finalize`). Lazy tasks are bound while the app
    finalizes, before ``on_after_finalize`` is sent; for an app that already
    finalized the receiver never runs, and a task's first use checks it.
    """
    global _installed
    if app is not None:
        app.on_after_finalize.connect(
            _validate_after_finalize, sender=app, weak=False, dispatch_uid=f"lockguard.finalize.{id(app)}"
        )
    with _lock:
        if _installed:
            return
        signals.worker_init.connect(_validate_at_worker_init, weak=False, dispatch_uid="lockguard.worker_init")
        signals.task_failure.connect(_on_failure, weak=False, dispatch_uid="lockguard.task_failure")
        signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="lockguard.task_revoked")
        signals.task_received.connect(_on_received, weak=False, dispatch_uid="lockguard.task_received")
        # Before the metrics flush (receivers run in the order they connected): the release replies still
        # unread carry hold times and lock.released counts, and a woken waiter to publish.
        for shutdown in (signals.worker_process_shutdown, signals.worker_shutdown):
            shutdown.connect(_read_replies, weak=False, dispatch_uid=f"lockguard.replies.{shutdown.name}")
        metrics.connect_signals()  # flush target per worker process; flush on process and worker shutdown
        _installed = True


def _read_replies(sender: Any = None, **_: Any) -> None:
    """Read the lease replies this process has not read yet (``_wire.drain_all``); never raises."""
    from ._wire import drain_all

    try:
        drain_all()
    except Exception:  # noqa: BLE001 - a process on its way out: what is unread stays unread
        pass


def _validate_at_worker_init(sender: Any = None, **_: Any) -> None:
    """Refuse to start a worker whose ``LockedTask`` options are invalid: a bad deploy fails at start.

    Celery's signal dispatch logs and swallows a receiver's ``Exception``, so
    the error leaves as ``SystemExit`` (exit code 78, ``EX_CONFIG``), after the
    message is written to stderr (logging is not configured yet).
    """
    from ._config import validate_tasks
    from .exceptions import ConfigurationError

    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        validate_tasks(app)
    except ConfigurationError as exc:
        sys.stderr.write(f"celery-lockguard: refusing to start the worker: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(EX_CONFIG) from exc


def _validate_after_finalize(sender: Any = None, **_: Any) -> None:
    """Log invalid ``LockedTask`` options when the app finalizes; the bad task still fails at first use.

    Only logged: finalizing happens lazily wherever the app is first used (a
    request, a shell, a test), Celery swallows a receiver's exception, and a
    ``SystemExit`` there would take down whatever process touched the app.
    """
    from ._config import validate_tasks
    from ._events import logger
    from .exceptions import ConfigurationError

    if sender is None:
        return
    try:
        validate_tasks(sender)
    except ConfigurationError as exc:
        logger.error("lock.configuration_error", task_name=None, reason=str(exc))


def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if isinstance(exception, TimeLimitExceeded) and task_id:
        # Popped: Celery sends task_failure twice for one hard limit (its timeout handler, then the pool's
        # error callback), and the workflow ends once.
        request = _members.pop(task_id, None)
        if request is not None:  # a workflow member: its hard limit ends the workflow, as a terminate-revoke does
            _workflow_member_aborted(sender, request, True, "hard_time_limit")
        shorten_from_main(sender, task_id, args or (), kwargs or {}, "hard_time_limit")


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Main process: remember a workflow member's request, so its hard time limit can find the workflow."""
    from . import _headers as headers

    if request is None:
        return
    found = getattr(request, "request_dict", None) or {}
    if headers.read(request, headers.WORKFLOW) is not None or found.get(headers.WORKFLOW) is not None:
        _members[str(request.id)] = request


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    if request is None:
        return
    args, kwargs = request.args or (), request.kwargs or {}
    if _workflow_member_aborted(sender, request, terminated):
        if not terminated:  # its own lock on another entity may have parked it: the entry goes too
            free_reservation_from_main(sender, request, args, kwargs)
        return
    if terminated:  # the request knows its child: a same-id holder in another process is left alone
        shorten_from_main(sender, request.id, args, kwargs, "terminated", getattr(request, "worker_pid", None))
    else:  # discarded before it ran: its queue claim will never be adopted, its reservation never used
        free_claim_from_main(sender, request.id, args, kwargs, "expired" if expired else "revoked")
        free_reservation_from_main(sender, request, args, kwargs)
        _debounce_run_discarded(sender, request, args, kwargs, "expired" if expired else "revoked")


def _debounce_run_discarded(task: Any, request: Any, args: Any, kwargs: Any, reason: str) -> bool:
    """A debounced message discarded unrun: if it was its burst's run, say the burst ends without one. Never raises."""
    from . import _debounce as debounce
    from ._task import LockGuard

    if not isinstance(task, LockGuard):
        return False
    try:
        return debounce.discarded(task, request, args, kwargs, reason)
    except Exception:  # noqa: BLE001 - the main process never fails on our account; the event is only a report
        return False


def _workflow_member_aborted(task: Any, request: Any, terminated: bool, reason: str | None = None) -> bool:
    """A revoked (or hard-limited) member of a workflow ends the workflow's lease (``_workflow.abort_from_main``).

    Never raises.
    """
    from ._task import LockGuard
    from ._workflow import abort_from_main

    if not isinstance(task, LockGuard):
        return False
    try:
        return abort_from_main(task, request, terminated, reason)
    except Exception:  # noqa: BLE001 - the main process never fails on our account; the lease expires by its TTL
        return False


def free_reservation_from_main(task: Any, request: Any, args: Any, kwargs: Any) -> bool:
    """A parked delivery's copy discarded before it ran: free what the waiter queue holds for it.

    A woken copy: the reservation RELEASE made for it goes, and the next waiter is woken. A safety
    copy: its entry leaves the queue, so no release hands the entity to a message that is gone. Either,
    of several entities: the reservations its wait kept on the others go too (:func:`_give_back_kept`).
    """
    from . import _calls as calls
    from . import _handoff as handoff
    from . import _headers as headers
    from ._config import settings
    from ._task import LockGuard

    if not isinstance(task, LockGuard):
        return False
    found = getattr(request, "request_dict", None) or {}
    park_token = headers.read_str(request, headers.PARK) or str(found.get(headers.PARK) or "")
    woken = headers.read(request, headers.WOKEN) or found.get(headers.WOKEN)
    s, opts = settings(task.app), task.lockguard_options
    if not park_token or not s.enabled or not opts.locked or opts.mode != "while_running":
        return False
    try:
        names = calls.render(opts, request.id, tuple(args), dict(kwargs))
    except Exception:  # noqa: BLE001 - a key that cannot render never parked
        return False
    key = names.key
    entity = headers.read_str(request, headers.PARK_ENTITY) or str(found.get(headers.PARK_ENTITY) or "")
    if entity and entity in names.keys:  # several entities: it parked on the one that blocked it
        key = entity
    if len(names.keys) > 1:
        _give_back_kept(task, s, names.keys, key, park_token, str(request.id))
    if not woken:
        return handoff.withdraw(task.app, s, key, park_token, task.name, request.id, limit=opts.limit)
    return handoff.abandon(task.app, s, key, park_token, task.name, request.id, limit=opts.limit)


def _give_back_kept(
    task: Any, s: Settings, keys: tuple[str, ...], parked_on: str, park_token: str, task_id: str
) -> None:
    """A discarded multi-entity copy: give back the reservations its wait kept on the other entities.

    A woken copy blocked further up the order kept its reservations sorted before the blocker, re-tokened
    to the park token both its copies carry (``_release.keep_before``); discarded, neither copy will adopt
    them, and without this they would block those entities until their TTL (countdown + grace + reservation
    TTL). KEEP_BEFORE is token-checked: another holder, or a lease the copy already took, is left alone. The
    parked-on entity is left to ``withdraw``/``abandon``. Wakes each freed entity's waiter; never raises.
    """
    from . import _connection as connection
    from . import _handoff as handoff
    from . import _multi as multi
    from ._events import emit

    others = tuple(k for k in keys if k != parked_on)
    if not others:
        return
    try:
        client = connection.client(s)
        _, woken = multi.keep_before(client, s.key_prefix, others, park_token, "", "", 0, handoff.reserve_ms())
    except Exception as exc:  # noqa: BLE001 - the main process never fails on our account; they lapse by TTL
        error, woken = multi.split(exc)  # Cluster: the entities given back before or after the error still wake
        emit("lock.backend_unavailable", task.name, lock_key=others[0], task_id=task_id, reason=f"give back: {error}")
        if woken is None:
            return
    handoff.wake(task.app, s, woken, task.name, task_id, client)


def free_claim_from_main(task: Any, task_id: str, args: Any, kwargs: Any, reason: str) -> bool:
    """Free the queue claim of a message the worker discards (revoked or expired); True if it held one."""
    from . import _calls as calls
    from . import _claims as claims
    from . import _connection as connection
    from . import _lease as lease_ops
    from ._config import settings
    from ._errors import classify
    from ._events import emit
    from ._task import LockGuard

    if not isinstance(task, LockGuard):
        return False
    s, opts = settings(task.app), task.lockguard_options
    if not s.enabled or not opts.locked or opts.mode == "while_running":
        return False
    try:
        key = calls.render(opts, task_id, tuple(args), dict(kwargs)).key
        freed = lease_ops.release_claim(connection.client(s), claims.claim_keys(s.key_prefix, key, opts.mode), task_id)
    except Exception as exc:  # BUSY, NOREPLICAS, NOPERM... arrive as ResponseError: classify, log, never fail
        kind = classify(exc)
        if kind is None:
            raise
        why = f"{reason} ({kind}): {exc.__class__.__name__}"
        emit("lock.backend_unavailable", task.name, task_id=task_id, reason=why)
        return False
    if freed:
        emit("lock.released", task.name, lock_key=key, task_id=task_id, reason=f"claim freed: {reason}")
        if opts.mode == "until_done":  # the claim was the entity's lease hash: its end wakes the oldest waiter
            from . import _handoff as handoff

            handoff.wake_if_free(task.app, s, key, task.name, task_id, limit=opts.limit)
    return freed


def shorten_from_main(task: Any, task_id: str, args: Any, kwargs: Any, reason: str, pid: int | None = None) -> bool:
    """Shorten the lease ``task_id`` holds on this host (in child ``pid``, if known) to the grace; True if it did."""
    from . import _calls as calls
    from . import _connection as connection
    from . import _lease as lease_ops
    from ._config import settings
    from ._errors import classify
    from ._events import emit
    from ._task import LockGuard

    if not isinstance(task, LockGuard):
        return False
    s = settings(task.app)
    opts = task.lockguard_options
    if not s.enabled or not opts.locked:
        return False
    try:
        names = calls.render(opts, task_id, tuple(args), dict(kwargs))
        key = names.key
        grace_ms = int(s.shorten_grace * 1000)
        client = connection.client(s)
        shortened = False
        for entity in names.keys or (key,):  # several entities: every one is cut to the grace
            cut = lease_ops.shorten(client, s.key_prefix, entity, task_id, grace_ms, pid=pid, limit=opts.limit)
            shortened = cut or shortened
    except Exception as exc:  # BUSY, NOREPLICAS, NOPERM... arrive as ResponseError: classify, log, never fail
        kind = classify(exc)
        if kind is None:
            raise
        why = f"{reason} ({kind}): {exc.__class__.__name__}"
        emit("lock.backend_unavailable", task.name, task_id=task_id, reason=why)
        return False
    if shortened:
        emit(
            "lock.force_released",
            task.name,
            lock_key=key,
            task_id=task_id,
            reason=reason,
            grace_ms=int(s.shorten_grace * 1000),
        )
        # Nobody releases a lease cut to the grace: once the grace is out, its end wakes the oldest waiter
        # (else the waiter starts with its safety copy, the holder's whole TTL after it parked).
        from . import _handoff as handoff

        for entity in names.keys or (key,):
            handoff.wake_later(task.app, s, entity, s.shorten_grace + 0.05, task.name, task_id, limit=opts.limit)
    return shortened
