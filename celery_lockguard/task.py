"""``LockedTask``: the policy around a task body. Lease work is delegated.

The lease is taken and released inside ``__call__`` because Celery does not
call ``after_return`` on Retry, Ignore or Reject, runs it in the *main*
process on a hard time limit, and a killed child runs nothing at all.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from celery import Task, uuid
from celery.app.task import Context
from celery.exceptions import Ignore, Retry

from . import claims, completion, connection, keys, signals
from . import lease as lease_ops
from .completion import PostgresStore, RedisStore, Store
from .config import Settings, TaskOptions, resolve_task_options, settings
from .connection import UNAVAILABLE_ERRORS
from .events import emit
from .exceptions import AlreadyQueued, BackendUnavailable, ConfigurationError, LockContended, LockGuardError
from .lease import Done, Holder, Lease
from .metrics import observe_hold
from .renewer import renewer

#: Message header counting lock/outage waits, separate from ``request.retries``.
WAITS_HEADER = "lockguard_waits"
#: Message header marking a watch copy (see ``LockedTask._watch``), with how many watches came before.
WATCH_HEADER = "lockguard_watch"
#: Message header carrying a watch copy's token: only the current token may re-arm (scripts.WATCH_ARM).
WATCH_TOKEN_HEADER = "lockguard_watch_token"

_LEASE = "_lockguard_lease"
_CALL = "_lockguard_call"
_CHECKPOINTS = "_lockguard_checkpoints"


class _Call:
    """One call's rendered names: entity K, scope S, args digest."""

    __slots__ = ("digest", "key", "scope", "scope_is_task")

    def __init__(self, key: str, scope: str, digest: str, scope_is_task: bool) -> None:
        self.key = key
        self.scope = scope
        self.digest = digest
        self.scope_is_task = scope_is_task


class LockedTask(Task):
    """A Celery task that runs its body under an entity-scoped Redis lease.

    Options are class attributes (set through ``@app.task(...)``); each falls
    back to the ``lockguard_*`` setting of the same meaning. See
    docs/reference.md for every option.
    """

    lock_key: Any = None
    lock_ttl: float | None = None
    lock_renew: bool = True
    lock_max_hold: float | None = None
    lock_mode: str = "while_running"
    lock_max_waits: int | None = None
    queue_lock_ttl: float | None = None
    on_locked: str | None = None
    on_unavailable: str | None = None
    idempotency_key: Any = None
    completion: bool = True
    completion_ttl: float | None = None
    lock_replicas: int = 0

    @classmethod
    def on_bound(cls, app: Any) -> None:
        signals.install()

    # -- resolved configuration -------------------------------------------------

    @property
    def lockguard_options(self) -> TaskOptions:
        """This task's validated options (``ConfigurationError`` names task, option and value)."""
        opts: TaskOptions | None = self.__dict__.get("_lockguard_options")
        if opts is None:
            opts = resolve_task_options(self)
            self.__dict__["_lockguard_options"] = opts
        return opts

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str | None:
        """The rendered entity key K for a call (no prefix), or ``None`` if the task is unlocked."""
        opts = self.lockguard_options
        if not opts.locked:
            return None
        return self._names(opts, "<task-id>", args, kwargs).key

    def _names(self, opts: TaskOptions, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        try:
            arguments = keys.bind(opts.signature, args, kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.name!r}: arguments do not match its signature: {exc}") from exc
        if opts.idempotency_key is not None:
            scope, scope_is_task = opts.idempotency_key.render(arguments, args, kwargs), False
        else:
            scope, scope_is_task = keys.task_scope(task_id), True
        key = opts.lock_key.render(arguments, args, kwargs) if opts.lock_key is not None else scope
        return _Call(key, scope, keys.digest(arguments), scope_is_task)

    # -- runtime, per request ---------------------------------------------------

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Start the body's request as a copy of the caller's: id, retries, lease, names, checkpoints.

        ``Task.__call__`` pushes a new request for the body. Celery 5.5+ builds
        it from the current one (this is that code); 5.3 and 5.4 start it
        empty, so a body behind a custom ``__call__`` saw no ``request.id`` and
        ``self.lock is None``.
        """
        self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

    @property
    def lock(self) -> Lease | None:
        """The current request's lease, or ``None`` (no lock, fail-open, direct call)."""
        return getattr(self.request, _LEASE, None)

    @property
    def completion_scope(self) -> str | None:
        """The rendered completion scope; pass it on as an external idempotency key."""
        call: _Call | None = getattr(self.request, _CALL, None)
        return call.scope if call is not None else None

    def checkpoint(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per (scope, name); replays return the recorded JSON value."""
        req = self.request
        call: _Call | None = getattr(req, _CALL, None)
        if call is None:
            return fn(*args, **kwargs)
        used: set[str] = getattr(req, _CHECKPOINTS)
        if name in used:
            raise ConfigurationError(f"task {self.name!r}: checkpoint name {name!r} used twice in one run")
        used.add(name)
        s = settings(self.app)
        ttl_ms = self._completion_ttl_ms(call)
        return completion.checkpoint(self._store(s), call.scope, name, ttl_ms, fn, args, kwargs)

    def record_completion(self, conn: Any, result: Any = None) -> bool:
        """Write this run's completion record inside the caller's PostgreSQL transaction.

        With the PostgreSQL completion backend, the body's own write and the
        record then commit together, so a crash can never leave one without the
        other. The record written at the end of the task is then a no-op.
        Returns True if this call wrote the record.
        """
        call: _Call | None = getattr(self.request, _CALL, None)
        store = self._store(settings(self.app))
        if not isinstance(store, PostgresStore):
            raise ConfigurationError(
                f"task {self.name!r}: record_completion needs lockguard_completion_backend = 'postgresql://...'"
            )
        if call is None:
            return False
        record, _ = completion.encode_record(self.request.id, result)
        return store.record_in(conn, call.scope, self.request.id, record, self._completion_ttl_ms(call))

    def _store(self, s: Settings) -> Store:
        if s.completion_backend == "redis":
            return RedisStore(connection.client(s), s.key_prefix)
        return completion.postgres_store(s.completion_backend, s.completion_table)

    def _completion_ttl_ms(self, call: _Call) -> int:
        opts = self.lockguard_options
        return int((opts.completion_ttl_task if call.scope_is_task else opts.completion_ttl_scope) * 1000)

    def _completed(self, call: _Call, record: str) -> Any:
        """Skip a call whose scope already completed: return the recorded result."""
        task_id, result = completion.decode_record(record)
        emit(
            "completion.skipped",
            self.name,
            lock_key=call.key,
            task_id=self.request.id,
            scope=call.scope,
            completed_by=task_id,
        )
        return result

    # -- the call ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly:
            return super().__call__(*args, **kwargs)
        s = settings(self.app)
        opts = self.lockguard_options
        if not s.enabled or not opts.locked:
            return super().__call__(*args, **kwargs)
        call = self._names(opts, req.id, args, kwargs)
        client = connection.client(s)
        store = self._store(s) if opts.completion else None
        in_scripts = store is not None and store.in_scripts
        if claims.header(req, WATCH_HEADER) is not None and isinstance(store, PostgresStore):
            # A watch copy checks the record first: acquiring to read it would make copies arriving
            # meanwhile see "my own id, alive" and leave watches of their own.
            if store.lookup(call.scope) is not None:
                raise Ignore()
        claim_token = str(claims.header(req, claims.CLAIM_HEADER) or "")
        # until_done: adopt our own queue claim (fresh token, state running); until_started: free it on start.
        replace_token = claim_token if opts.mode == "until_done" else ""
        start_claim = claim_token if opts.mode == "until_started" else ""
        while True:
            try:
                got = self._acquire(s, opts, call, client, replace_token, in_scripts, start_claim)
            except UNAVAILABLE_ERRORS as exc:
                return self._unavailable(opts, call, store, args, kwargs, f"{exc.__class__.__name__}: {exc}")
            if isinstance(got, Done):
                if claims.header(req, WATCH_HEADER) is not None:
                    raise Ignore()  # a watch copy: the original finished; leave its stored state alone
                return self._completed(call, got.record)
            if isinstance(got, Holder):
                if got.token != replace_token and (
                    (got.task_id == keys.meta(req.id) and got.state == "queued") or self._dead_here(got, req.id)
                ):
                    # Our own queue claim, or a killed child of this host that held our id: take it over now.
                    reason = "adopting_own_claim" if got.state == "queued" else "taking_over_dead_holder_of_own_id"
                    emit(
                        "lock.contended",
                        self.name,
                        lock_key=call.key,
                        task_id=req.id,
                        holder_task_id=got.task_id,
                        policy=opts.on_locked,
                        reason=reason,
                    )
                    replace_token = got.token
                    continue
                return self._contended(opts, call, got, args, kwargs)
            if got.lost:  # the reply came back after the lease's validity: never run on it
                self._release(s, opts, got)
                return self._unavailable(opts, call, store, args, kwargs, "acquire_slower_than_ttl")
            if isinstance(store, PostgresStore):
                record = store.lookup(call.scope)  # checked under the lease: a finisher recorded before releasing
                if record is not None:
                    self._release(s, opts, got)
                    return self._completed(call, record)
            return self._run_locked(s, opts, call, client, got, args, kwargs)

    def _acquire(
        self,
        s: Settings,
        opts: TaskOptions,
        call: _Call,
        client: Any,
        replace_token: str,
        check_done: bool,
        claim_token: str = "",
    ) -> Lease | Holder | Done:
        req = self.request
        return lease_ops.acquire(
            client,
            s.key_prefix,
            call.key,
            ttl_ms=opts.ttl_ms,
            task_id=req.id,
            task_name=self.name,
            digest=call.digest,
            worker=req.hostname or "",
            fence_ttl_ms=int(s.fence_ttl * 1000),
            scope=call.scope if check_done else None,
            replace_token=replace_token,
            claim_token=claim_token,
            replicas=opts.replicas,
            # WAIT must answer well inside the socket timeout, or a slow replica reads as an outage.
            replicas_timeout_ms=max(1, min(opts.replicas_timeout_ms, int(s.socket_timeout * 500))),
        )

    def _run_locked(
        self,
        s: Settings,
        opts: TaskOptions,
        call: _Call,
        client: Any,
        lease: Lease,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        req = self.request
        emit("lock.acquired", self.name, lock_key=call.key, task_id=req.id, fence=lease.fence)
        if lease.replicas is not None and lease.replicas < opts.replicas:
            # WAIT timed out: a failover now could lose this lease (fences and records still hold).
            emit(
                "lock.under_replicated",
                self.name,
                lock_key=call.key,
                task_id=req.id,
                fence=lease.fence,
                replicas=lease.replicas,
                wanted=opts.replicas,
            )
        setattr(req, _LEASE, lease)
        setattr(req, _CALL, call)
        setattr(req, _CHECKPOINTS, set())
        if opts.renew:
            renewer().track(lease, client, opts.max_hold)
        done: _Call | None = None
        result = None
        try:
            result = super().__call__(*args, **kwargs)
            done = call
            return result
        finally:
            self._release(s, opts, lease, done, result)

    def _release(
        self, s: Settings, opts: TaskOptions, lease: Lease, done: _Call | None = None, result: Any = None
    ) -> None:
        """Stop renewal, then release; record completion after a successful body.

        A failing release never turns a successful body into a failure: the
        lease then expires by its TTL, and the event says so.
        """
        renewer().untrack(lease)
        if lease.released:
            return
        was_lost = lease.lost
        scope, record, ttl_ms = None, "", 0
        if done is not None and opts.completion:
            record, ttl_ms = self._record_for(done, lease.task_id, result)
            store = self._store(s)
            if isinstance(store, PostgresStore):
                self._record_elsewhere(store, done, lease.task_id, record, ttl_ms)
            else:
                scope = done.scope
        fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence}
        try:
            released, _recorded = lease_ops.release(connection.client(s), lease, s.key_prefix, scope, record, ttl_ms)
        except UNAVAILABLE_ERRORS as exc:
            lease.released = True
            emit("lock.backend_unavailable", self.name, **fields, reason=f"release: {exc.__class__.__name__}")
            return
        hold_ms = lease.hold_ms()
        observe_hold(self.name, hold_ms)
        if released == 1:
            # Still ours in Redis, yet past its validity here (e.g. a renewal delayed in flight): the body
            # was told it was lost, so say so once even though the key survived.
            if was_lost and lease.mark_lost("expired"):
                emit("lock.lost", self.name, **fields, hold_ms=round(hold_ms), reason="expired")
            emit("lock.released", self.name, **fields, hold_ms=round(hold_ms), lost=was_lost)
        else:
            reason = "expired" if released == 0 else "taken_by_another_holder"
            if lease.mark_lost(reason):
                emit("lock.lost", self.name, **fields, hold_ms=round(hold_ms), reason=reason)
            emit("lock.expired_before_release", self.name, **fields, hold_ms=round(hold_ms), reason=reason)

    def _record_for(self, call: _Call, task_id: str, result: Any) -> tuple[str, int]:
        record, dropped = completion.encode_record(keys.meta(task_id), result)
        if dropped:
            emit("completion.result_dropped", self.name, task_id=task_id, scope=call.scope, reason=dropped)
        return record, self._completion_ttl_ms(call)

    def _record_elsewhere(self, store: PostgresStore, call: _Call, task_id: str, record: str, ttl_ms: int) -> None:
        """Record completion in a store outside the lease scripts; a failure is logged, never raised."""
        try:
            store.record(call.scope, task_id, record, ttl_ms)
        except Exception as exc:  # noqa: BLE001 - the body succeeded; say so loudly, do not fail it
            emit(
                "completion.record_failed",
                self.name,
                task_id=task_id,
                scope=call.scope,
                reason=f"{exc.__class__.__name__}: {exc}",
            )

    # -- policies ---------------------------------------------------------------

    def _contended(
        self, opts: TaskOptions, call: _Call, holder: Holder, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        req = self.request
        fields = {"lock_key": call.key, "task_id": req.id, "holder_task_id": holder.task_id}
        error = LockContended(call.key, holder.task_id, holder.pttl_ms)
        if holder.task_id == keys.meta(req.id):  # holder metadata is bounded (keys.MAX_META)
            if self._holder_alive(opts, holder):
                emit(
                    "lock.skipped_duplicate",
                    self.name,
                    **fields,
                    policy=opts.on_locked,
                    reason="redelivery_of_running_original",
                )
                self._watch(opts, args, kwargs, call, holder)
                raise Ignore()
            return self._wait(opts, args, kwargs, call, "holder_of_own_id_dead", error, holder.pttl_ms / 1000)
        emit("lock.contended", self.name, **fields, policy=opts.on_locked)
        duplicate = holder.task_name == self.name and holder.digest == call.digest
        if opts.on_locked == "raise":
            raise error
        # Skip only behind a live holder: a dead one's work may never finish (no acks_late), so wait it out.
        alive = self._holder_alive(opts, holder, presume=True)
        if opts.on_locked == "skip" and duplicate and alive and opts.mode != "until_started":
            emit("lock.skipped_duplicate", self.name, **fields, policy="skip", reason="identical_work_running")
            return None
        reason = (
            ("duplicate_waits" if alive else "duplicate_of_dead_holder") if duplicate else "different_work_on_entity"
        )
        return self._wait(opts, args, kwargs, call, reason, error, holder.pttl_ms / 1000)

    def _watch(
        self, opts: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call, holder: Holder
    ) -> None:
        """Before dropping a redelivered copy of a running task, leave a delayed watch copy behind.

        Dropping the copy acknowledges it, and on the Redis transport that also
        deletes the original's entry in ``unacked``: if the original's child
        is then killed, its ``reject(requeue=True)`` restores nothing and the
        job would be lost. The watch copy (same task id) comes back later: if
        the original completed, it stores nothing (``Ignore``); if it still
        runs, it watches again with a longer countdown; if it died, it takes
        over and runs. It needs completion records to tell "finished" from
        "died", so without them the copy is only dropped (documented).
        """
        req = self.request
        if not opts.completion or req.is_eager:
            return
        watches = int(claims.header(req, WATCH_HEADER) or 0)
        fields = {"lock_key": call.key, "task_id": req.id, "reason": "watching_running_original", "waits": watches}
        if watches >= opts.max_waits:
            emit("lock.wait_budget_exhausted", self.name, **fields, policy=opts.on_locked)
            return
        s = settings(self.app)
        countdown = min(60.0, max(opts.ttl, 0.5 * 2**watches)) * random.uniform(1.0, 1.25)
        countdown = min(countdown, _below_visibility(s))
        token = lease_ops.new_token()
        headers = {**(req.headers or {}), WATCH_HEADER: watches + 1, WATCH_TOKEN_HEADER: token}
        headers.pop(claims.CLAIM_HEADER, None)
        sig = self.signature_from_request(req, args, kwargs, countdown=countdown, retries=req.retries, headers=headers)
        try:
            armed = lease_ops.watch_arm(
                connection.client(s),
                s.key_prefix,
                call.key,
                str(req.id),
                str(claims.header(req, WATCH_TOKEN_HEADER) or ""),
                token,
                int((countdown + opts.ttl) * 1000) + 60_000,
            )
            if not armed:  # a watch of this task is already pending: this copy is a duplicate of one
                return
            sig.apply_async()
        except Exception as exc:  # noqa: BLE001 - the copy is dropped either way; say the watch is missing
            emit("lock.backend_unavailable", self.name, **fields, policy="watch", reason=f"publish failed: {exc}")
            return
        emit("lock.retry_scheduled", self.name, **fields, countdown=round(countdown, 3), policy="watch")

    @staticmethod
    def _dead_here(holder: Holder, task_id: str) -> bool:
        """The holder is this task id, on this host, and its process is gone."""
        own = holder.task_id == keys.meta(task_id)
        return own and holder.host == lease_ops.HOST and not lease_ops.pid_alive(holder.pid)

    def _holder_alive(self, opts: TaskOptions, holder: Holder, presume: bool = False) -> bool:
        """Alive: on this host, its pid exists; elsewhere, its lease is still being renewed.

        Without renewal a remote holder's liveness is unknown: ``presume`` says what to assume.
        """
        if holder.host == lease_ops.HOST:
            return lease_ops.pid_alive(holder.pid)
        if not opts.renew:
            return presume
        return holder.ms_since_renewal < opts.ttl_ms * 0.6

    def _unavailable(
        self,
        opts: TaskOptions,
        call: _Call,
        store: Store | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str,
    ) -> Any:
        req = self.request
        fields = {"lock_key": call.key, "task_id": req.id, "policy": opts.on_unavailable, "reason": reason}
        if opts.on_unavailable == "fail_open":
            emit("lock.fail_open", self.name, **fields)
            if not isinstance(store, PostgresStore):
                return super().__call__(*args, **kwargs)
            # No lease, but the completion store is up: it still makes a duplicate harmless.
            record = store.lookup(call.scope)
            if record is not None:
                return self._completed(call, record)
            setattr(req, _CALL, call)
            setattr(req, _CHECKPOINTS, set())
            result = super().__call__(*args, **kwargs)
            self._record_elsewhere(store, call, req.id, *self._record_for(call, req.id, result))
            return result
        emit("lock.backend_unavailable", self.name, **fields)
        return self._wait(
            opts,
            args,
            kwargs,
            call,
            "backend_unavailable",
            BackendUnavailable(f"task {self.name!r}: lock store unavailable for {call.key!r}: {reason}"),
            None,
        )

    def _wait(
        self,
        opts: TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: _Call,
        reason: str,
        exc: LockGuardError,
        holder_ttl: float | None,
    ) -> Any:
        """Re-deliver this call later without spending ``max_retries``; the budget is ``lock_max_waits``."""
        req = self.request
        waits = int((req.headers or {}).get(WAITS_HEADER) or req.get(WAITS_HEADER) or 0)
        fields = {"lock_key": call.key, "task_id": req.id, "reason": reason, "waits": waits}
        if waits >= opts.max_waits:
            emit("lock.wait_budget_exhausted", self.name, **fields, policy=opts.on_locked)
            raise exc
        countdown = min(wait_countdown(waits, holder_ttl), _below_visibility(settings(self.app)))
        emit("lock.retry_scheduled", self.name, **fields, countdown=round(countdown, 3), policy=opts.on_locked)
        headers = {**(req.headers or {}), WAITS_HEADER: waits + 1}
        if not req.is_eager:
            sig = self.signature_from_request(
                req, args, kwargs, countdown=countdown, retries=req.retries, headers=headers
            )
            try:
                sig.apply_async()
            except Exception as publish_exc:  # noqa: BLE001 - a failed publish must not lose the task
                # Celery's own retry() would Reject(requeue=False) here and drop the message:
                # when the broker is the Redis that is down, wait in this process instead.
                emit(
                    "lock.backend_unavailable",
                    self.name,
                    **fields,
                    policy="wait_in_process",
                    reason=f"publish failed: {publish_exc.__class__.__name__}",
                )
            else:
                raise Retry(exc=exc, when=countdown, sig=sig)
        time.sleep(countdown)  # eager calls are synchronous; a failed publish leaves nowhere else to wait
        req.headers = headers
        return self.__call__(*args, **kwargs)

    # -- publishing -------------------------------------------------------------

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, link: Any = None, **options: Any
    ) -> Any:
        """Publish; in ``until_started``/``until_done`` mode, claim the entity first.

        A duplicate of queued (or, ``until_done``, running) identical work is
        answered with the holder's ``AsyncResult`` (``skip``) or
        ``AlreadyQueued`` (``raise``). Different work, canvas members and a
        task's own republish (retry, replace, waits) are never deduplicated.
        """
        opts = self.lockguard_options
        s = settings(self.app)
        if opts.mode == "while_running" or not s.enabled or not opts.locked or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id, link=link, **options)
        task_id = task_id or uuid()
        call = self._names(opts, task_id, tuple(args or ()), dict(kwargs or {}))
        token = lease_ops.new_token()
        ttl_ms = claims.claim_ttl_ms(opts.queue_lock_ttl, options.get("countdown"), options.get("eta"))
        fields = {"lock_key": call.key, "task_id": task_id, "policy": opts.on_locked}
        try:
            got = lease_ops.claim(
                connection.client(s),
                claims.claim_key(s.key_prefix, call.key, opts.mode),
                token=token,
                ttl_ms=ttl_ms,
                task_id=task_id,
                task_name=self.name,
                digest=call.digest,
            )
        except UNAVAILABLE_ERRORS as exc:
            emit("lock.backend_unavailable", self.name, **fields, reason=f"publish without claim: {exc}")
            return super().apply_async(args, kwargs, task_id, link=link, **options)
        if got.kind == "ok":
            options["headers"] = {**(options.get("headers") or {}), claims.CLAIM_HEADER: token}
        elif got.kind == "held":
            duplicate = got.task_name == self.name and got.digest == call.digest
            publisher = claims.publishing_task_id()
            ours = publisher is not None and got.task_id == keys.meta(publisher)
            if duplicate and not ours and not claims.in_canvas(options, link) and opts.on_locked != "retry":
                if opts.on_locked == "raise":
                    raise AlreadyQueued(call.key, got.task_id)
                emit(
                    "lock.skipped_duplicate",
                    self.name,
                    **fields,
                    holder_task_id=got.task_id,
                    reason=f"identical_work_{got.state or 'queued'}",
                )
                return self.AsyncResult(got.task_id)
        return super().apply_async(args, kwargs, task_id, link=link, **options)

    def on_replace(self, sig: Any) -> Any:
        """Free the lease before the replacement is published under this task's id.

        The replacement inherits the task id: found holding the lease, it would
        look like a redelivery of a running original and be dropped.
        """
        lease = self.lock
        if lease is not None and not lease.released:
            self._release(settings(self.app), self.lockguard_options, lease)
        return super().on_replace(sig)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Free the lease before Celery publishes the retry, so the retry never waits on us.

        ``until_done`` hands the lease over to the retry message as its queue
        claim instead, unless retries are exhausted (then nothing is left behind).
        """
        lease = self.lock
        if lease is not None and not lease.released:
            s, opts, req = settings(self.app), self.lockguard_options, self.request
            limit = self.max_retries if max_retries is None else max_retries
            exhausted = limit is not None and req.retries + 1 > limit
            if opts.mode == "until_done" and not exhausted:
                token = lease_ops.new_token()
                delay = countdown if countdown is not None or eta is not None else self.default_retry_delay
                renewer().untrack(lease)
                try:
                    lease_ops.handover(
                        connection.client(s), lease, token, claims.claim_ttl_ms(opts.queue_lock_ttl, delay, eta)
                    )
                    options["headers"] = {**(req.headers or {}), claims.CLAIM_HEADER: token}
                except UNAVAILABLE_ERRORS as err:
                    emit(
                        "lock.backend_unavailable",
                        self.name,
                        lock_key=lease.key,
                        task_id=req.id,
                        reason=f"handover: {err.__class__.__name__}",
                    )
            else:
                self._release(s, opts, lease)
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)


def _below_visibility(s: Settings) -> float:
    """Longest countdown we give our own delayed messages: half the transport's ``visibility_timeout``.

    The Redis transport holds a message with a countdown unacknowledged and redelivers it once
    ``visibility_timeout`` passes, so a longer countdown would duplicate our own waits and watches.
    """
    return max(0.05, s.visibility_timeout / 2)


def wait_countdown(waits: int, holder_ttl: float | None) -> float:
    """Seconds to wait: exponential in the number of waits, capped by the holder's TTL, jittered.

    Jitter spreads waiters over [50%, 100%] of the step, so a released key does
    not set off a retry storm.
    """
    step = min(0.25 * (2 ** min(waits, 10)), 60.0)
    if holder_ttl is not None:
        step = min(step, max(holder_ttl, 0.05))
    return max(0.05, step * random.uniform(0.5, 1.0))
