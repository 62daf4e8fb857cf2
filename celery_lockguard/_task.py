"""``LockGuard`` and ``LockedTask``: the Celery hooks that carry out lockguard's decisions.

What a delivery or a publish does is decided in :mod:`celery_lockguard._decision`
(pure, table-tested); rendering lives in :mod:`calls`, message headers in
:mod:`headers`, self-republishes in :mod:`republish`, claims in :mod:`claims`,
lease scripts in :mod:`lease`. The delivery itself -- acquire, ask, carry the answer
out -- is :mod:`._delivery` (its waits in :mod:`._waits`, its releases and claims in
:mod:`._release`, its completion records in :mod:`._records`); what lockguard asks of
task classes is :mod:`._taskclass`. This class holds the options and the hooks Celery
calls (``__call__``, ``apply_async``, ``retry``, ``on_replace``, ``push_request``) and
hands each to those modules, freeing or handing over what the delivery holds on every exit.

The lease is taken and released inside ``__call__`` because Celery does not
call ``after_return`` on Retry, Ignore or Reject, runs it in the *main*
process on a hard time limit, and a killed child runs nothing at all.

``LockGuard`` is a cooperative mixin: every hook it overrides ends in
``super()``, so ``class LockedDjangoTask(LockGuard, DjangoTask)`` keeps the
other class's ``__call__``, ``apply_async`` and ``on_bound`` around ours (the
lease is outermost, the claim is taken before the other class publishes).
``LockedTask`` is ``LockGuard`` over the app's own task class where that is safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from celery import Task, uuid
from celery.exceptions import Retry

from . import _calls as calls
from . import _claims as claims
from . import _completion as completion
from . import _connection as connection
from . import _debounce as debounce
from . import _delivery as delivery
from . import _errors as errors
from . import _events as events
from . import _handoff as handoff
from . import _headers as headers
from . import _keys as keys
from . import _lease as lease_ops
from . import _records as records
from . import _release as release_ops
from . import _republish as republish
from . import _signals as signals
from . import _taskclass as taskclass
from . import _tracing as tracing
from . import _waits as waits
from . import _workflow as workflow
from ._calls import CallNames
from ._completion import PostgresStore, StoreGuard
from ._config import Settings, TaskOptions, resolve_task_options, settings
from ._decision import Action, Delivery, Publish, PublishAction, decide_delivery, decide_publish
from ._events import emit
from ._lease import Lease
from ._renewer import renewer
from ._request import CALL, CHECKPOINTS, ENTERED, LEASE, ORPHAN, event_fields
from .exceptions import AlreadyQueued, BackendUnavailable, ConfigurationError

#: Tries to record a checkpoint whose step has run, before the store error is final.
CHECKPOINT_WRITE_ATTEMPTS = 4

#: Fields a direct call must not inherit from the caller's request.
_PRIVATE = {LEASE: None, CALL: None, CHECKPOINTS: None, ORPHAN: None, workflow.WORKFLOW_LEASE: None}
_REQUEST_STATE = (*_PRIVATE, ENTERED)
#: Set by a direct call just before ``Task.__call__`` pushes the body's request; that push (and only that
#: one) drops the caller's lease, names and checkpoints. A context variable: thread and gevent pools are safe.
_DIRECT_CALL: ContextVar[bool] = ContextVar("lockguard_direct_call", default=False)


class LockGuard(Task):
    """The lease machinery as a cooperative mixin: ``class LockedDjangoTask(LockGuard, DjangoTask)``.

    Put it first among the bases so the lease wraps whatever the other task
    class does in ``__call__`` and the queue claim is taken before it
    publishes. Options are class attributes (set through ``@app.task(...)``);
    each falls back to the ``lockguard_*`` setting of the same meaning. See
    docs/reference.md for every option; ``LockedTask`` is the ready-made class.
    """

    #: Entity key template (``"invoice:{invoice_id}"``) or callable; ``None``: ``lockguard_keys[name]``, else unlocked.
    lock_key: Any = None
    #: Lease TTL in seconds (> 0); default ``lockguard_default_ttl`` (30).
    lock_ttl: float | None = None
    #: Renew every ttl/3 while the body runs.
    lock_renew: bool = True
    #: Seconds after which renewal stops and the body is told the lease is lost; default: the hard time limit.
    lock_max_hold: float | None = None
    #: ``while_running`` · ``until_started`` · ``until_done`` (docs/model.md).
    lock_mode: str = "while_running"
    #: Lock/outage waits before the task gives up visibly; default ``lockguard_max_waits`` (100).
    lock_max_waits: int | None = None
    #: Seconds a queue-time claim lives while its message waits in the broker (3600).
    queue_lock_ttl: float | None = None
    #: ``skip`` · ``retry`` · ``raise`` when the entity is held; default ``lockguard_on_locked``.
    on_locked: str | None = None
    #: ``fail_closed`` · ``fail_open`` when Redis is unavailable; default ``lockguard_on_unavailable``.
    on_unavailable: str | None = None
    #: Template or callable naming the business effect; ``None``: the task id is the completion scope.
    idempotency_key: Any = None
    #: Record completion so retries and redeliveries skip work that ran.
    completion: bool = True
    #: Seconds a completion record is kept in Redis.
    completion_ttl: float | None = None
    #: ``raise`` · ``warn`` when an ``idempotency_key`` completed with other arguments; default
    #: ``lockguard_idempotency_mismatch`` (``raise``).
    idempotency_mismatch: str | None = None
    #: A name shared by the tasks whose completion records answer each other (same rendered
    #: ``idempotency_key``); ``None``: a record answers only the task that wrote it.
    idempotency_namespace: str | None = None
    #: Replicas that must acknowledge an acquisition (``WAIT``); 0 = do not wait.
    lock_replicas: int = 0
    #: Seconds > 0: a publish replaces the entity's pending run, which runs that long after the last
    #: publish of the burst, with its arguments (docs/debounce.md); default ``lockguard_debounce[name]``.
    lock_debounce: float | None = None
    #: Bodies that may hold one entity at once, each on its own slot lease (docs/limits.md); default
    #: ``lockguard_lock_limit`` (1: the single lease).
    lock_limit: int | None = None
    #: Starts per entity per sliding window, fleet-wide: ``"100/m"``, ``"5/s"``, ``"N/h"`` (docs/limits.md);
    #: default ``lockguard_lock_rate`` (none).
    lock_rate: str | None = None

    # Marks this class (in its own dict only) for the modules that must not import it (_taskclass.GUARD_MARKER).
    _lockguard_guard = True

    @classmethod
    def on_bound(cls, app: Any) -> None:
        signals.install(app)
        super().on_bound(app)

    # -- resolved configuration -------------------------------------------------

    @property
    def lockguard_options(self) -> TaskOptions:
        """This task's validated options (``ConfigurationError`` names task, option and value)."""
        opts: TaskOptions | None = self.__dict__.get("_lockguard_options")
        if opts is None:
            opts = resolve_task_options(self)
            self.__dict__["_lockguard_options"] = opts
        return opts

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str | tuple[str, ...] | None:
        """The rendered entity key K for a call (no prefix), or ``None`` if the task is unlocked.

        Several entities (``lock_key`` as a sequence): the tuple of entity keys, sorted and deduplicated
        (a call naming one entity twice gets its one key, a str).
        """
        opts = self.lockguard_options
        if not opts.locked:
            return None
        call = calls.render(opts, "<task-id>", args, kwargs)
        return call.keys or call.key

    # -- runtime, per request ---------------------------------------------------

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Start the body's request as a copy of the caller's: id, retries, lease, names, checkpoints.

        ``Task.__call__`` pushes a new request for the body. Celery 5.5+ builds
        it from the current one; 5.3 and 5.4 start it empty, so a body behind a
        custom ``__call__`` saw no ``request.id`` and ``self.lock is None`` --
        hence the caller's fields passed on explicitly. A direct call's body
        starts without the caller's lease, names and checkpoints (it runs
        unlocked; a ``checkpoint`` there must not land in the caller's run).
        """
        fields = {**self.request.__dict__, **kwargs}
        if _DIRECT_CALL.get():
            _DIRECT_CALL.set(False)
            fields.update(_PRIVATE)
        super().push_request(*args, **fields)
        ctx = self.request
        if ctx.headers and any(name in ctx.headers for name in _REQUEST_STATE):
            # Celery 5.6+ derives ``headers`` from unknown request fields: our per-request state is not a
            # message header (a retry would try to serialise the lease).
            ctx.headers = {k: v for k, v in ctx.headers.items() if k not in _REQUEST_STATE} or None

    @property
    def lock(self) -> Lease | None:
        """The current request's lease, or ``None`` (no lock, fail-open, direct call)."""
        return getattr(self.request, LEASE, None)

    @property
    def workflow_lock(self) -> Lease | None:
        """The workflow's lease while this task runs as a member of one (``celery_lockguard.workflow``), else ``None``.

        ``self.lock`` is the same lease, unless the member locks an entity of its own: then
        ``self.lock`` is that lease and this one is the workflow's.
        """
        return getattr(self.request, workflow.WORKFLOW_LEASE, None)

    @property
    def completion_scope(self) -> str | None:
        """The rendered completion scope; pass it on as an external idempotency key."""
        call: CallNames | None = getattr(self.request, CALL, None)
        return call.scope if call is not None else None

    def checkpoint(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per (scope, name); replays return the recorded JSON value."""
        req = self.request
        call: CallNames | None = getattr(req, CALL, None)
        if call is None:
            return fn(*args, **kwargs)
        used: set[str] = getattr(req, CHECKPOINTS)
        if name in used:
            raise ConfigurationError(f"task {self.name!r}: checkpoint name {name!r} used twice in one run")
        used.add(name)
        s = settings(self.app)
        store, ttl_ms = records.store_for(self, s), records.ttl_ms_for(self, call)
        guard = self._checkpoint_guard(s, call, name)
        return completion.checkpoint(store, call.record, name, ttl_ms, fn, args, kwargs, guard)

    def _checkpoint_guard(self, s: Settings, call: CallNames, name: str) -> StoreGuard:
        """What a store error inside ``checkpoint`` does, by the task's ``on_unavailable``.

        Reading (before the step): ``fail_closed`` re-delivers the call later (the body stops
        here; earlier checkpoints replay), within the wait budget; ``fail_open`` runs the step
        unrecorded. Writing (the step has run): retried briefly, then ``fail_closed`` fails the
        task visibly with ``BackendUnavailable`` — re-running would repeat the step — and
        ``fail_open`` goes on unrecorded. Misconfiguration is a ``ConfigurationError``.
        """
        opts = self.lockguard_options

        def guard(operation: str, run: Callable[[], Any]) -> Any:
            attempts = 1 if operation == "read" else CHECKPOINT_WRITE_ATTEMPTS
            for attempt in range(attempts):
                try:
                    return run()
                except Exception as exc:
                    kind = errors.classify(exc)
                    if kind is None:
                        raise
                    if kind == "misconfigured":
                        raise errors.configuration_error(exc, self.name, f"checkpoint {name!r}") from exc
                    failure = exc
                if attempt + 1 < attempts:
                    time.sleep(0.05 * 2**attempt)
            reason = f"checkpoint {name!r} {operation}: {errors.describe(failure)}"
            if opts.on_unavailable == "fail_open":
                emit("lock.fail_open", self.name, **event_fields(self, call), policy=opts.on_unavailable, reason=reason)
                return None
            if operation == "write":
                why = errors.describe(failure)
                raise BackendUnavailable(
                    f"task {self.name!r}: checkpoint {name!r} ran but could not be recorded ({why}); "
                    "not re-delivered, since running it again would repeat the step"
                ) from failure
            self._wait_in_body(s, opts, call, failure, reason)
            return guard(operation, run)

        return guard

    def _wait_in_body(
        self, s: Settings, opts: TaskOptions, call: CallNames, failure: BaseException, reason: str
    ) -> None:
        """Stop the body and re-deliver the call later (``Retry``), or give up; returns after an in-process wait."""
        facts = Delivery(
            mode=opts.mode,  # type: ignore[arg-type]
            on_locked=opts.on_locked,  # type: ignore[arg-type]
            on_unavailable=opts.on_unavailable,  # type: ignore[arg-type]
            outcome="unavailable",
            waits=headers.read_int(self.request, headers.WAITS),
            max_waits=opts.max_waits,
        )
        decision = decide_delivery(facts)
        emit(
            "lock.backend_unavailable", self.name, **event_fields(self, call), policy=opts.on_unavailable, reason=reason
        )
        if decision.action is Action.GIVE_UP:
            emit(
                "lock.wait_budget_exhausted",
                self.name,
                **event_fields(self, call),
                reason=reason,
                waits=facts.waits,
                policy=opts.on_unavailable,
            )
            raise waits.contention_error(self, call, None, failure)
        sig = waits.wait(self, s, opts, call, decision, None, None)
        if sig is not None:
            raise Retry(exc=waits.contention_error(self, call, None, failure), when=waits.when(sig), sig=sig)

    def record_completion(self, conn: Any, result: Any = None) -> bool:
        """Write this run's completion record inside the caller's PostgreSQL transaction.

        With the PostgreSQL completion backend, the body's own write and the
        record then commit together, so a crash can never leave one without the
        other. The record written at the end of the task is then a no-op.
        Returns True if this call wrote the record.
        """
        call: CallNames | None = getattr(self.request, CALL, None)
        store = records.store_for(self, settings(self.app))
        if not isinstance(store, PostgresStore):
            raise ConfigurationError(
                f"task {self.name!r}: record_completion needs lockguard_completion_backend = 'postgresql://...'"
            )
        if call is None:
            return False
        record, _ = completion.encode_record(self.request.id, result, keys.meta(self.name), call.digest)
        return store.record_in(conn, call.record, self.request.id, record, records.ttl_ms_for(self, call))

    # -- the call ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or getattr(req, ENTERED, False):
            # A plain call, also inside the task's own running body: no lock, and the caller's lease,
            # names and checkpoints stay the caller's.
            return self._call_direct(args, kwargs)
        s = settings(self.app)
        opts = self.lockguard_options
        member = workflow.member_of(req, self.name) if s.enabled and headers.carried(req) else None
        if member is not None:  # a member of a workflow: the workflow's lease first (_workflow)
            setattr(req, ENTERED, True)
            return workflow.deliver(self, s, opts, member, args, kwargs)
        if not s.enabled or not opts.locked:
            return delivery.run_body(self, args, kwargs)
        setattr(req, ENTERED, True)
        if opts.debounce is not None:
            answered, result = debounce.arrive(self, s, opts, args, kwargs)
            if answered:
                return result
        return delivery.deliver(self, s, opts, args, kwargs)

    def _call_direct(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the body unlocked, through the other task classes' ``__call__`` like a plain task's call."""
        mark = _DIRECT_CALL.set(True)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _DIRECT_CALL.reset(mark)

    # -- publishing -------------------------------------------------------------

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, link: Any = None, **options: Any
    ) -> Any:
        """Publish; in ``until_started``/``until_done`` mode, claim the entity first.

        A duplicate of queued (or, ``until_done``, running) identical work is
        answered with the holder's ``AsyncResult`` (``skip``) or
        ``AlreadyQueued`` (``raise``). Different work, canvas members and a
        task's own republish (retry, replace, waits, watches) are never
        deduplicated; a failed publish frees the claim it took.
        """
        opts = self.lockguard_options
        s = settings(self.app)
        if opts.debounce is not None and s.enabled and not self.app.conf.task_always_eager:
            return debounce.publish(self, s, opts, args, kwargs, task_id, link, options, super().apply_async)
        if opts.mode == "while_running" or not s.enabled or not opts.locked or self.app.conf.task_always_eager:
            if opts.locked and s.enabled:
                calls.refuse_empty_fields(opts, tuple(args or ()), dict(kwargs or {}))
            return super().apply_async(args, kwargs, task_id, link=link, **options)
        publisher = claims.publishing_task_id()
        own = task_id is not None and publisher is not None and publisher == task_id
        own_copy = republish.is_own_copy(task_id)
        if own or own_copy:
            facts = Publish(opts.on_locked, self_republish=own, own_copy=own_copy)  # type: ignore[arg-type]
            decision = decide_publish(facts)
            assert decision.action is PublishAction.BYPASS
            return super().apply_async(args, kwargs, task_id, link=link, **options)
        task_id = task_id or uuid()
        call = calls.render(opts, task_id, tuple(args or ()), dict(kwargs or {}))
        if workflow.claims_own_entity(options, call.key):
            # A member on its workflow's entity runs under the workflow lease: a claim of its own there would
            # be a second holder of that entity (waited on forever, or left for queue_lock_ttl).
            return super().apply_async(args, kwargs, task_id, link=link, **options)
        token = lease_ops.new_token()
        ckey = claims.claim_keys(s.key_prefix, call.key, opts.mode)
        ttl_ms = claims.claim_ttl_ms(opts.queue_lock_ttl, options.get("countdown"), options.get("eta"))
        deadline, pause = time.monotonic() + claims.PUBLISH_GRACE + 1.0, 0.01
        asked = ckey  # the claim hashes CLAIM is asked about
        while True:
            got, failure = self._claim(s, asked, token, ttl_ms, task_id, call)
            decision = decide_publish(
                Publish(
                    on_locked=opts.on_locked,  # type: ignore[arg-type]
                    claim=got.kind if got is not None else errors.classify(failure),  # type: ignore[arg-type]
                    duplicate=got is not None and got.task_name == self.name and got.digest == call.digest,
                    # a running holder of identical work whose process is gone (or no longer renews) will not
                    # do it: publish beside it (the delivery waits it out) rather than answer with it. Unless the
                    # task's lost message goes back to the broker (acks_late + reject_on_worker_lost): then the
                    # work is still queued, and its redelivery takes the lease over and does it
                    holder_alive=got is None
                    or got.kind != "held"
                    or self._redelivered_when_lost()
                    or delivery.holder_alive(self, got, own=False),
                    in_canvas=claims.in_canvas(options, link),
                    held_by_publisher=got is not None and publisher is not None and got.task_id == keys.meta(publisher),
                    holder_publishing=got is not None and got.state == "publishing" and time.monotonic() < deadline,
                )
            )
            if decision.reason == "holder_not_alive" and len(asked) > 1:
                # until_done behind a dead-looking holder of identical work: the copy published beside it
                # queues in {K}:claim (as behind different work), so that identical publishes after it are
                # answered with it instead of each queueing one more copy
                asked = asked[1:]
                continue
            if decision.action is not PublishAction.AWAIT:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        fields = {"lock_key": call.key, "task_id": task_id, "policy": opts.on_locked}
        action = decision.action
        if action is PublishAction.PUBLISH_CLAIMED:
            options["headers"] = {**(options.get("headers") or {}), headers.CLAIM: token}
            try:
                result = super().apply_async(args, kwargs, task_id, link=link, **options)
            except BaseException:
                release_ops.free_claim(self, s, opts, call, token, task_id)
                raise
            backend, span, name = events.backend_choice(), tracing.current_span(), self.name

            def confirmed(reply: bool | BaseException) -> None:
                # Read later (nothing waits on it: the message is out); a failed confirm lapses after the grace.
                if isinstance(reply, BaseException):
                    failed = {
                        **fields,
                        "policy": opts.on_unavailable,
                        "reason": f"confirm claim: {errors.describe(reply)}",
                    }
                    events.emit_for("lock.backend_unavailable", name, failed, backend=backend, span=span)

            try:
                lease_ops.confirm_claim(connection.client(s), ckey, token, ttl_ms, on_reply=confirmed)
            except Exception as exc:  # noqa: BLE001 - the message is out; its claim then lapses after the grace
                confirmed(exc)
            return result
        if action is PublishAction.MISCONFIGURED:
            assert failure is not None
            raise errors.configuration_error(failure, self.name, "CLAIM") from failure
        if action is PublishAction.RAISE:
            assert got is not None
            raise AlreadyQueued(call.key, got.task_id)
        if action is PublishAction.ANSWER_WITH_HOLDER:
            assert got is not None
            emit(
                "lock.skipped_duplicate",
                self.name,
                **fields,
                holder_task_id=got.task_id,
                reason=f"identical_work_{got.state or 'queued'}",
            )
            return self.AsyncResult(got.task_id)
        if failure is not None:
            fields["policy"] = opts.on_unavailable
            emit(
                "lock.backend_unavailable",
                self.name,
                **fields,
                reason=f"publish without claim: {errors.describe(failure)}",
            )
        return super().apply_async(args, kwargs, task_id, link=link, **options)

    def _redelivered_when_lost(self) -> bool:
        """Whether a delivery of this task whose process dies goes back to the broker (it is not lost)."""
        return bool(self.acks_late and self.reject_on_worker_lost)

    def _claim(
        self, s: Settings, ckey: list[str], token: str, ttl_ms: int, task_id: str, call: CallNames
    ) -> tuple[lease_ops.Claimed | None, BaseException | None]:
        """CLAIM in state ``publishing``; an error the outage policy handles comes back as the second value."""
        try:
            got = lease_ops.claim(
                connection.client(s),
                ckey,
                token=token,
                ttl_ms=ttl_ms,
                task_id=task_id,
                task_name=self.name,
                digest=call.digest,
                publish_ttl_ms=int(claims.PUBLISH_GRACE * 1000),
            )
        except Exception as exc:
            if errors.classify(exc) is None:
                raise
            return None, exc
        return got, None

    def on_replace(self, sig: Any) -> Any:
        """Free the lease before the replacement is published under this task's id.

        The replacement inherits the task id: found holding the lease, it would
        look like a redelivery of a running original and be dropped.
        """
        if self.workflow_lock is not None:
            raise ConfigurationError(
                f"task {self.name!r}: replace() inside a workflow is not supported (the replacement would run "
                "outside the workflow lease)"
            )
        release_ops.settle_orphan(self.request)  # failed open: the replacement must not meet what ACQUIRE took
        lease = self.lock
        if lease is not None and not lease.released:
            release_ops.release(self, settings(self.app), self.lockguard_options, lease)
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
        claim instead, unless retries are exhausted (then nothing is left
        behind); if the retry's publish then fails, the handed-over claim is freed.
        """
        lease = self.lock
        handed = ""  # the claim token handed over to the retry message
        s, opts, req = settings(self.app), self.lockguard_options, self.request
        # A retry is a new attempt: it must not inherit this delivery's waits, orphan token, watch marker or
        # claim (Celery copies the request's headers into the retry message).
        options["headers"] = {**republish.without_ours(req), **(options.get("headers") or {})}
        # every hand-over to the retry message (claim, debounce keys, workflow lease) covers its delay
        delay = claims.retry_due_in(self.default_retry_delay, countdown, eta)
        burst = headers.read_str(req, headers.DEBOUNCE) if opts.debounce is not None else ""
        if burst:  # a retried run stays its burst's: superseded if a later run of the entity has started by then
            options["headers"][headers.DEBOUNCE] = burst
            debounce.keep_for_retry(self, s, opts, burst, delay, None)
        # A member's retry keeps its place in the workflow and gets its lease (or, failed open, runs unlocked).
        workflow.on_retry(self, options, delay)
        release_ops.settle_orphan(req)  # failed open: what the ACQUIRE that errored took, before the publish
        if lease is not None and not lease.released:
            limit = self.max_retries if max_retries is None else max_retries
            exhausted = limit is not None and req.retries + 1 > limit
            if opts.mode == "until_done" and not exhausted and claims.retry_keeps_entity(opts, req, args, kwargs):
                token = lease_ops.new_token()
                renewer().untrack(lease)
                try:
                    if lease_ops.handover(
                        connection.client(s),
                        lease,
                        token,
                        claims.retry_claim_ttl_ms(opts.queue_lock_ttl, delay),
                        wake=lambda woken: handoff.wake(self.app, s, woken, self.name, req.id),
                    ):
                        options["headers"][headers.CLAIM] = token
                        handed = token
                except Exception as err:  # noqa: BLE001 - the retry is published without a claim
                    lease.released = True
                    emit(
                        "lock.backend_unavailable",
                        self.name,
                        lock_key=lease.key,
                        task_id=req.id,
                        reason=f"handover: {errors.describe(err)}",
                    )
            else:
                release_ops.release(self, s, opts, lease)
        try:
            with republish.own_copy(req.id):  # the retry's message is this delivery's copy: never new work
                return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            raise
        except BaseException:
            if handed:  # the retry was not published (Celery raises Reject): free its claim
                call: CallNames | None = getattr(req, CALL, None)
                if call is not None:
                    release_ops.free_claim(self, s, opts, call, handed)
            raise


class LockedTask(LockGuard):
    """``LockGuard`` over the app's own task class: ``@app.task(base=LockedTask, lock_key=...)``.

    Celery builds a function's task class as ``type(name, (base,), ...)``, so
    ``base=LockedTask`` alone would drop the app's ``task_cls`` (``DjangoTask``
    under Celery's Django fixup, with its ``delay_on_commit``; a project's base
    class; ``app.Task = MyBase``). The class Celery builds for a function gets
    ``app.Task`` appended to its bases when that is safe
    (:func:`._taskclass.adoptable_task_class`: no name of ours shadowed, no ``apply_async``
    of its own that would run after the claim is computed), giving
    ``<task> -> LockedTask -> LockGuard -> app.Task -> DjangoTask -> Task``. A
    task class written by hand keeps the bases it names: compose with
    ``LockGuard`` there. A worker start warns about a task that misses the app's
    class (:func:`._taskclass.missing_task_class`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        app = own.get("app")
        if not own.get("_decorated") or app is None:
            return
        configured = taskclass.adoptable_task_class(app, LockGuard)
        if configured is None or any(issubclass(b, configured) for b in cls.__bases__):
            return
        try:
            cls.__bases__ = (*cls.__bases__, app.Task)
        except TypeError:  # a layout or metaclass conflict: keep Celery's class; the worker start warns
            return
