"""``LockGuard`` and ``LockedTask``: the Celery hooks that carry out lockguard's decisions.

What a delivery or a publish does is decided in :mod:`celery_lockguard._decision`
(pure, table-tested); rendering lives in :mod:`calls`, message headers in
:mod:`headers`, self-republishes in :mod:`republish`, claims in :mod:`claims`,
lease scripts in :mod:`lease`. This class gathers the facts, asks, and carries
the answer out, freeing or handing over what the delivery holds on every exit.

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

from celery import Task, states, uuid
from celery._state import _task_stack
from celery.app import trace as _trace
from celery.exceptions import Ignore, Reject, Retry

from . import _calls as calls
from . import _claims as claims
from . import _completion as completion
from . import _connection as connection
from . import _debounce as debounce
from . import _errors as errors
from . import _events as events
from . import _handoff as handoff
from . import _headers as headers
from . import _keys as keys
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _republish as republish
from . import _signals as signals
from . import _tracing as tracing
from . import _wire as wire
from . import _workflow as workflow
from ._calls import CallNames
from ._completion import PostgresStore, RedisStore, Store, StoreGuard
from ._config import Settings, TaskOptions, resolve_task_options, settings
from ._decision import (
    FREES_CLAIM,
    RUN_ACQUIRED,
    Action,
    Decision,
    Delivery,
    HolderFacts,
    Outcome,
    ParkedAction,
    Publish,
    PublishAction,
    after_park,
    decide_delivery,
    decide_parked,
    decide_publish,
)
from ._events import emit
from ._lease import Done, Holder, Lease, Throttled
from ._renewer import renewer
from .exceptions import (
    AlreadyQueued,
    BackendUnavailable,
    ConfigurationError,
    IdempotencyKeyReused,
    LockContended,
    LockThrottled,
)

#: Tries to record a checkpoint whose step has run, before the store error is final.
CHECKPOINT_WRITE_ATTEMPTS = 4

_LEASE = "_lockguard_lease"
_CALL = "_lockguard_call"
_CHECKPOINTS = "_lockguard_checkpoints"
_EAGER_STARTED = "_lockguard_eager_started"
#: Longest an eager call (``.apply()``, ``task_always_eager``) waits, in seconds, on top of ``lock_max_waits``:
#: it waits in the caller's thread, and a budget of 100 growing waits is over an hour of a blocked caller.
EAGER_MAX_WAIT = 60.0
#: Set on the request of a delivery lockguard has entered: a call of the task inside its own body is direct.
_ENTERED = "_lockguard_entered"
#: Fields a direct call must not inherit from the caller's request.
_PRIVATE = {_LEASE: None, _CALL: None, _CHECKPOINTS: None, workflow.WORKFLOW_LEASE: None}
_REQUEST_STATE = (*_PRIVATE, _ENTERED)
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

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str | None:
        """The rendered entity key K for a call (no prefix), or ``None`` if the task is unlocked."""
        opts = self.lockguard_options
        if not opts.locked:
            return None
        return calls.render(opts, "<task-id>", args, kwargs).key

    def _names(self, opts: TaskOptions, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallNames:
        return calls.render(opts, task_id, args, kwargs)

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
        return getattr(self.request, _LEASE, None)

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
        call: CallNames | None = getattr(self.request, _CALL, None)
        return call.scope if call is not None else None

    def checkpoint(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per (scope, name); replays return the recorded JSON value."""
        req = self.request
        call: CallNames | None = getattr(req, _CALL, None)
        if call is None:
            return fn(*args, **kwargs)
        used: set[str] = getattr(req, _CHECKPOINTS)
        if name in used:
            raise ConfigurationError(f"task {self.name!r}: checkpoint name {name!r} used twice in one run")
        used.add(name)
        s = settings(self.app)
        store, ttl_ms = self._store(s), self._completion_ttl_ms(call)
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
            reason = f"checkpoint {name!r} {operation}: {_describe(failure)}"
            if opts.on_unavailable == "fail_open":
                emit("lock.fail_open", self.name, **self._fields(call), policy=opts.on_unavailable, reason=reason)
                return None
            if operation == "write":
                raise BackendUnavailable(
                    f"task {self.name!r}: checkpoint {name!r} ran but could not be recorded ({_describe(failure)}); "
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
        emit("lock.backend_unavailable", self.name, **self._fields(call), policy=opts.on_unavailable, reason=reason)
        if decision.action is Action.GIVE_UP:
            emit(
                "lock.wait_budget_exhausted",
                self.name,
                **self._fields(call),
                reason=reason,
                waits=facts.waits,
                policy=opts.on_unavailable,
            )
            raise self._contention_error(call, None, failure)
        sig = self._wait(s, opts, call, decision, None, None)
        if sig is not None:
            raise Retry(exc=self._contention_error(call, None, failure), when=_when(sig), sig=sig)

    def record_completion(self, conn: Any, result: Any = None) -> bool:
        """Write this run's completion record inside the caller's PostgreSQL transaction.

        With the PostgreSQL completion backend, the body's own write and the
        record then commit together, so a crash can never leave one without the
        other. The record written at the end of the task is then a no-op.
        Returns True if this call wrote the record.
        """
        call: CallNames | None = getattr(self.request, _CALL, None)
        store = self._store(settings(self.app))
        if not isinstance(store, PostgresStore):
            raise ConfigurationError(
                f"task {self.name!r}: record_completion needs lockguard_completion_backend = 'postgresql://...'"
            )
        if call is None:
            return False
        record, _ = completion.encode_record(self.request.id, result, keys.meta(self.name), call.digest)
        return store.record_in(conn, call.record, self.request.id, record, self._completion_ttl_ms(call))

    def _store(self, s: Settings) -> Store:
        if s.completion_backend == "redis":
            client = connection.client(s)
            # Made once per client and prefix (twice per task otherwise); a new client (after fork, or other
            # settings) makes a new one. RedisStore keeps nothing else.
            store = self.__dict__.get("_lockguard_store")
            if type(store) is not RedisStore or store.client is not client or store.prefix != s.key_prefix:
                store = self.__dict__["_lockguard_store"] = RedisStore(client, s.key_prefix)
            return store
        return completion.postgres_store(s.completion_backend, s.completion_table, namespace=s.key_prefix)

    def _completion_ttl_ms(self, call: CallNames) -> int:
        opts = self.lockguard_options
        return int((opts.completion_ttl_task if call.scope_is_task else opts.completion_ttl_scope) * 1000)

    # -- the call ---------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or getattr(req, _ENTERED, False):
            # A plain call, also inside the task's own running body: no lock, and the caller's lease,
            # names and checkpoints stay the caller's.
            return self._call_direct(args, kwargs)
        s = settings(self.app)
        opts = self.lockguard_options
        member = workflow.member_of(req, self.name) if s.enabled else None
        if member is not None:  # a member of a workflow: the workflow's lease first (_workflow)
            setattr(req, _ENTERED, True)
            return workflow.deliver(self, s, opts, member, args, kwargs)
        if not s.enabled or not opts.locked:
            return self._body(args, kwargs)
        setattr(req, _ENTERED, True)
        if opts.debounce is not None:
            answered, result = debounce.arrive(self, s, opts, args, kwargs)
            if answered:
                return result
        return self._deliver(s, opts, args, kwargs)

    def _body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the body under the delivery's own request, through the other task classes' ``__call__``.

        Where the next ``__call__`` in the MRO is Celery's own, the body runs as a worker runs it
        (``celery.app.trace``'s stack protection): ``run`` under the request the tracer pushed (the
        lease, names and checkpoints are already on it), which is marked ``_protected`` so that a
        direct call inside the body pushes a request of its own (and runs unlocked, see
        :meth:`push_request`). Outside a worker (``apply()``, eager mode) ``Task.__call__`` would
        push a copy of that request first: a second ``Context`` per call. Any other ``__call__``
        (Django's task class, a user's base, a wrapper patched onto ``Task.__call__``) is kept.
        """
        if _runs_plainly(type(self)):
            req = self.request
            req._protected = 1
            _task_stack.push(self)
            try:
                return self.run(*args, **kwargs)
            finally:
                _task_stack.pop()
        return super().__call__(*args, **kwargs)

    def _call_direct(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the body unlocked, through the other task classes' ``__call__`` like a plain task's call."""
        mark = _DIRECT_CALL.set(True)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _DIRECT_CALL.reset(mark)

    def _deliver(self, s: Settings, opts: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Acquire, decide, carry out; loop only to adopt a claim or to wait in-process."""
        req = self.request
        # The lock wait counts from the message's first delivery (carried by its waits), else from now.
        first_ms = headers.read_ms(req, headers.FIRST_DELIVERED) or int(time.time() * 1000)
        call = calls.render(opts, req.id, args, kwargs)
        client = connection.client(s)
        store = self._store(s) if opts.completion else None
        watch_copy = headers.read(req, headers.WATCH) is not None
        if watch_copy and store is not None and not store.in_scripts:
            # A watch copy checks the record first: acquiring to read it would make copies arriving
            # meanwhile see "my own id, alive" and leave watches of their own. A store error: ACQUIRE decides.
            record = self._lookup(store, call)
            if record is not None:
                if self._original_settled():
                    raise Ignore()
                # The original died before storing a state, its job done by other work: answer for it,
                # or its task id stays PENDING for good.
                return self._completed(call, record)
        claim_token = headers.read_str(req, headers.CLAIM)
        # until_done: adopt our own queue claim (fresh token, state running); until_started: free it on start.
        replace_token = claim_token if opts.mode == "until_done" else ""
        # until_started: free it on start; until_done: free it too when it queued in {K}:claim behind other work.
        start_claim = claim_token
        # A copy of a parked delivery (safety or woken) settles with its waiter entry before ACQUIRE, and
        # adopts the reservation RELEASE made for it (token = park token), if it is still there.
        park_token = headers.read_str(req, headers.PARK) if opts.mode == "while_running" and not watch_copy else ""
        reserved = park_token  # a reservation RELEASE may have made for us: freed on every exit that does not run
        if park_token:
            replace_token = park_token
        # A lock_limit waiter parks behind its N slots (a slot's release wakes it into that slot); a lock_rate
        # waiter backs off with a countdown instead (docs/limits.md): its start window is freed by time, not
        # by a release.
        can_park = opts.mode == "while_running" and not claim_token and not watch_copy and not req.is_eager
        can_park = can_park and opts.rate is None
        free_retries = 0
        while True:
            token = lease_ops.new_token()
            got: Lease | Holder | Done | Throttled | None = None
            failure: BaseException | None = None
            outcome: Outcome
            try:
                if park_token:
                    self._settle_parked(s, call, client, park_token)
                    park_token = ""
                got = self._acquire(s, opts, call, client, token, replace_token, store, start_claim)
            except Ignore:
                raise
            except Exception as exc:
                kind = errors.classify(exc)
                if kind is None:
                    raise
                outcome, failure = kind, exc
            else:
                outcome, got, failure = self._outcome(s, opts, call, store, got, watch_copy)
            holder = got if isinstance(got, Holder) else None
            throttled = got if isinstance(got, Throttled) else None
            # "acquired" is decided by its outcome alone (decide_delivery's first rule): no facts to gather.
            decision = (
                RUN_ACQUIRED
                if outcome == "acquired"
                else decide_delivery(
                    Delivery(
                        mode=opts.mode,  # type: ignore[arg-type]
                        on_locked=opts.on_locked,  # type: ignore[arg-type]
                        on_unavailable=opts.on_unavailable,  # type: ignore[arg-type]
                        outcome=outcome,
                        holder=self._facts(call, holder) if holder is not None else None,
                        # A watch copy answers from the record when its original never stored a state.
                        watch_copy=watch_copy and not (outcome == "record" and not self._original_settled()),
                        waits=headers.read_int(req, headers.WAITS),
                        max_waits=opts.max_waits,
                        can_park=can_park,
                        debounced=opts.debounce is not None,
                    )
                )
            )
            action = decision.action
            if action is Action.RUN:
                assert isinstance(got, Lease)
                if failure is not None:  # the lease is ours, the completion store is not answering
                    emit(
                        "lock.fail_open",
                        self.name,
                        **self._fields(call),
                        policy=opts.on_unavailable,
                        reason=f"completion store: {_describe(failure)}",
                    )
                if not watch_copy:  # a watch copy's wait is its original's run, not contention
                    metrics.observe_wait(self.name, time.time() * 1000 - first_ms)
                if reserved and opts.limit > 1:
                    # A parked shared waiter got its slot: pass the wake on, so that when an exclusive holder
                    # ends, every free slot goes to a parked waiter, not only the one its release handed out.
                    handoff.wake_if_free(self.app, s, call.key, self.name, str(req.id), limit=opts.limit)
                return self._run_locked(s, opts, call, client, got, args, kwargs)
            if action is Action.ADOPT:
                assert holder is not None
                emit(
                    "lock.contended",
                    self.name,
                    **self._fields(call),
                    holder_task_id=holder.task_id,
                    policy=opts.on_locked,
                    reason=decision.reason,
                )
                replace_token = holder.token
                continue
            handed: str | None = None  # the claim token a wait carries on, when the lease consumed the claim
            if isinstance(got, Lease):  # held only to read the record, or it came too late, or the store is down
                if action is Action.WAIT and claim_token:
                    handed = self._hand_back(s, opts, call, got)
                else:
                    self._give_back(s, opts, got)
            self._met(opts, call, decision, holder, failure, throttled)
            if action is Action.PARK:
                assert holder is not None
                parked = self._park(s, opts, call, client, decision, holder, free_retries, first_ms)
                if parked == "acquire_again":
                    free_retries += 1
                    continue
                if isinstance(parked, str) and parked.startswith("adopt:"):
                    replace_token = parked[len("adopt:") :]  # our publish failed, yet a releaser woke us
                    continue
                if parked is not None:
                    raise Retry(exc=self._contention_error(call, holder, None), when=_when(parked), sig=parked)
                decision = Decision(Action.WAIT, decision.reason)  # could not park: back off as before
                action = decision.action
            if action in FREES_CLAIM and not (action is Action.FAIL_OPEN and opts.mode == "until_done"):
                self._free_claim(s, opts, call, claim_token)
            if reserved and action in FREES_CLAIM:
                # answered from the record, skipped, gave up...: the reservation must not hold up the next waiter
                handoff.abandon(self.app, s, call.key, reserved, self.name, req.id, limit=opts.limit)
            if action is Action.WAIT:
                attempt = token if outcome == "unavailable" and got is None else None
                sig = self._wait(s, opts, call, decision, holder, attempt, handed, first_ms, throttled=throttled)
                if sig is None:
                    continue  # waited in this process: eager, or the publish failed
                if watch_copy:
                    # A watch copy shares its original's task id: RETRY stored now would overwrite the
                    # original's SUCCESS for good if the wait then finds the record and drops itself.
                    raise Ignore()
                raise Retry(exc=self._contention_error(call, holder, failure, throttled), when=_when(sig), sig=sig)
            if watch_copy and action in (Action.RAISE, Action.GIVE_UP) and self._original_settled():
                raise Ignore()  # the original ended; a failure stored now would overwrite its state
            return self._finish(s, opts, call, decision, got, holder, failure, claim_token, args, kwargs)

    def _finish(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        decision: Decision,
        got: Lease | Holder | Done | Throttled | None,
        holder: Holder | None,
        failure: BaseException | None,
        claim_token: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The exits that consume the message without running under a lease (the claim is already freed)."""
        action, fields = decision.action, self._fields(call)
        throttled = got if isinstance(got, Throttled) else None
        if action is Action.ANSWER:
            record = got.record if isinstance(got, Done) else ""
            return self._completed(call, record)
        if action is Action.DROP:
            raise Ignore()  # a watch copy: the original finished; leave its stored state alone
        if action is Action.SKIP:
            assert holder is not None
            emit(
                "lock.skipped_duplicate",
                self.name,
                **fields,
                holder_task_id=holder.task_id,
                policy="skip",
                reason=decision.reason,
            )
            # The caller's AsyncResult says who did the work: ``children[0]`` is the holder, to wait on.
            self.add_trail(self.AsyncResult(holder.task_id))
            return None
        if action is Action.DROP_AND_WATCH:
            assert holder is not None
            emit(
                "lock.skipped_duplicate",
                self.name,
                **fields,
                holder_task_id=holder.task_id,
                policy=opts.on_locked,
                reason=decision.reason,
            )
            self._watch(s, opts, call)
            raise Ignore()
        if action is Action.RAISE:
            assert holder is not None or throttled is not None
            raise self._contention_error(call, holder, None, throttled)
        if action is Action.GIVE_UP:
            emit(
                "lock.wait_budget_exhausted",
                self.name,
                **fields,
                reason=decision.reason,
                waits=headers.read_int(self.request, headers.WAITS),
                policy=_policy(opts, decision.reason),
            )
            raise self._contention_error(call, holder, failure, throttled)
        if action is Action.MISCONFIGURED:
            assert failure is not None
            raise errors.configuration_error(failure, self.name, "ACQUIRE") from failure
        assert action is Action.FAIL_OPEN
        return self._fail_open(s, opts, call, decision, failure, claim_token, args, kwargs)

    def _acquire(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        client: Any,
        token: str,
        replace_token: str,
        store: Store | None,
        claim_token: str = "",
    ) -> Lease | Holder | Done | Throttled:
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
            scope=call.record if store is not None and store.in_scripts else None,
            token=token,
            replace_token=replace_token,
            claim_token=claim_token,
            replicas=opts.replicas,
            # WAIT must answer well inside the socket timeout, or a slow replica reads as an outage.
            replicas_timeout_ms=max(1, min(opts.replicas_timeout_ms, int(s.socket_timeout * 500))),
            limit=opts.limit,
            rate=(opts.rate.count, opts.rate.window_ms) if opts.rate is not None else None,
        )

    def _outcome(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        store: Store | None,
        got: Lease | Holder | Done | Throttled,
        watch_copy: bool = False,
    ) -> tuple[Outcome, Lease | Holder | Done | Throttled, BaseException | None]:
        """Name what ACQUIRE answered; with the PostgreSQL store, read the record under the fresh lease.

        The record is read *after* taking the lease: a finisher records before it releases, so
        whoever holds the lease next sees the record. A watch copy that got the lease also asks
        the result backend whether its original settled without a record (it failed, retried or
        was revoked): only an original that died mid-body is taken over.
        """
        if watch_copy and isinstance(got, Lease) and not got.lost and self._original_settled():
            self._give_back(s, opts, got)
            return "record", Done(""), None
        if isinstance(got, Done):
            return "record", got, None
        if isinstance(got, Holder):
            return "held", got, None
        if isinstance(got, Throttled):
            return "throttled", got, None
        if got.lost:  # the reply came back after the lease's validity: never run on it
            return "late", got, None
        if store is not None and not store.in_scripts:
            try:
                record = store.lookup(call.record)
            except Exception as exc:
                if errors.classify(exc) is None:
                    self._release(s, opts, got)
                    raise
                if opts.on_unavailable == "fail_open":
                    return "acquired", got, exc  # run under the lease, unchecked (logged as fail_open)
                return "unavailable", got, exc
            if record is not None:
                self._give_back(s, opts, got)  # recorded by a finisher: give the fresh lease straight back
                return "record", Done(record), None
            if got.lost:
                # The store answered after the lease's validity (it is not renewed while the record is read):
                # another delivery may hold it by now. As for a late ACQUIRE: never run on it.
                return "late", got, None
        return "acquired", got, None

    def _met(
        self,
        opts: TaskOptions,
        call: CallNames,
        decision: Decision,
        holder: Holder | None,
        failure: BaseException | None,
        throttled: Throttled | None = None,
    ) -> None:
        """Say what the delivery met before it skips, waits, gives up or raises: another holder, a full
        start window (``lock.throttled``), or an outage."""
        if decision.action not in (Action.SKIP, Action.WAIT, Action.PARK, Action.GIVE_UP, Action.RAISE):
            return
        fields = self._fields(call)
        if throttled is not None:
            rate = opts.rate.text if opts.rate is not None else None
            emit(
                "lock.throttled",
                self.name,
                **fields,
                policy=opts.on_locked,
                reason=decision.reason,
                rate=rate,
                starts=throttled.starts,
                retry_after_ms=throttled.wait_ms,
            )
        elif holder is None:
            reason = _describe(failure) if failure is not None else decision.reason
            emit("lock.backend_unavailable", self.name, **fields, policy=opts.on_unavailable, reason=reason)
        elif holder.task_id != keys.meta(self.request.id):
            emit("lock.contended", self.name, **fields, holder_task_id=holder.task_id, policy=opts.on_locked)

    def _original_settled(self) -> bool:
        """Whether this task id already ended in the result backend (SUCCESS, FAILURE or REVOKED).

        ``RETRY`` is not an end: the retry message may be the very copy that was dropped behind a
        running duplicate (then this watch copy is the job's last message), so the watch copy runs
        the job, at worst before the retry's countdown, and the retry is answered from its record.
        Unknown (no result backend, ``ignore_result``, a backend error) counts as not settled: the
        watch copy then falls back on the completion record alone, as documented.
        """
        try:
            state = self.AsyncResult(self.request.id).state
        except Exception:  # noqa: BLE001 - DisabledBackend, an unreachable backend: we cannot tell
            return False
        return state in states.READY_STATES

    def _facts(self, call: CallNames, holder: Holder) -> HolderFacts:
        req = self.request
        own = holder.task_id == keys.meta(req.id)  # holder metadata is bounded (keys.MAX_META)
        here = holder.host == lease_ops.HOST
        return HolderFacts(
            own_id=own,
            duplicate=holder.task_name == self.name and holder.digest == call.digest,
            alive=self._holder_alive(holder, own),
            dead_here=own and here and not lease_ops.pid_alive(holder.pid),
            queued=own and holder.state in ("queued", "publishing"),
            # A wait after an ACQUIRE that errored carries that attempt's token: if the ACQUIRE ran after
            # all, this lease is its orphan. Adopting replaces the token, so a duplicated copy of the wait
            # message finds a fresh token and is dropped instead of running the body beside us.
            orphan=own and holder.token == headers.read_str(req, headers.ATTEMPT) != "",
            parent=not own and bool(req.parent_id) and holder.task_id == keys.meta(str(req.parent_id)),
        )

    def _holder_alive(self, holder: Holder, own: bool) -> bool:
        """Alive: on this host, its pid exists; elsewhere, its lease is still being renewed.

        Renewal runs every third of the *holder's* TTL. A queued claim is presumed alive (its message
        is in the broker). Without renewal a remote holder's liveness is unknown: another task's
        holder is presumed alive (skip stays safe: it finishes or its TTL frees the entity), a holder
        of our own id is presumed dead (waiting it out never loses the job).
        """
        if holder.state in ("queued", "publishing"):
            return True
        if holder.host == lease_ops.HOST:
            return lease_ops.pid_alive(holder.pid)
        opts = self.lockguard_options
        if not opts.renew:
            return not own
        ttl_ms = getattr(holder, "ttl_ms", 0) or opts.ttl_ms
        return holder.ms_since_renewal < ttl_ms * 0.6

    def _fields(self, call: CallNames) -> dict[str, Any]:
        return {"lock_key": call.key, "task_id": self.request.id}

    def _contention_error(
        self, call: CallNames, holder: Holder | None, failure: BaseException | None, throttled: Throttled | None = None
    ) -> LockContended | BackendUnavailable:
        if throttled is not None:
            rate = self.lockguard_options.rate
            return LockThrottled(call.key, throttled.wait_ms, rate.text if rate is not None else None)
        if holder is not None:
            return LockContended(call.key, holder.task_id, holder.pttl_ms)
        reason = _describe(failure) if failure is not None else "acquire_slower_than_ttl"
        return BackendUnavailable(f"task {self.name!r}: lock store unavailable for {call.key!r}: {reason}")

    def _run_locked(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        client: Any,
        lease: Lease,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        req = self.request
        emit("lock.acquired", self.name, lock_key=call.key, task_id=req.id, fence=lease.fence)
        if opts.slotted:
            rate = opts.rate.text if opts.rate is not None else None
            emit(
                "lock.admitted",
                self.name,
                lock_key=call.key,
                task_id=req.id,
                fence=lease.fence,
                slot=lease.slot,
                limit=opts.limit,
                rate=rate,
            )
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
        metrics.lease_held(lease, req.hostname or lease_ops.HOST)  # the held-now gauge: no Redis here
        if opts.renew:
            renewer().track(lease, client, opts.max_hold)
        done: CallNames | None = None
        result = None
        try:
            if opts.debounce is not None:
                replaced = debounce.start(self, s, opts, client, call.key)
                if replaced is not None:  # taken while waiting for the lease, then replaced: release unrun
                    return replaced
            result = self._body(args, kwargs)
            done = call
            return result
        finally:
            metrics.lease_ended(lease)
            self._release(s, opts, lease, done, result, later=not req.is_eager)

    def _give_back(self, s: Settings, opts: TaskOptions, lease: Lease) -> None:
        """Release a lease no body ran on; with ``lock_rate``, take back the start it was counted as.

        A failure to take it back leaves the start counted (the safe side: the window under-admits
        until it passes) and says so.
        """
        self._release(s, opts, lease)
        if opts.rate is None:
            return
        try:
            lease_ops.unadmit(connection.client(s), s.key_prefix, lease)
        except Exception as exc:  # the start stays counted; the delivery's exit is unchanged
            if errors.classify(exc) is None:
                raise
            emit(
                "lock.backend_unavailable",
                self.name,
                lock_key=lease.key,
                task_id=lease.task_id,
                reason=f"start not taken back from the window: {_describe(exc)}",
            )

    def _release(
        self,
        s: Settings,
        opts: TaskOptions,
        lease: Lease,
        done: CallNames | None = None,
        result: Any = None,
        later: bool = False,
    ) -> None:
        """Stop renewal, then release; record completion after a successful body.

        ``later``: the exit after the body sends RELEASE without waiting for its reply, which
        is then read with this process's next lease command (or within ``_wire.DRAIN_DELAY``);
        the lease is free on the server either way, only its report comes later.
        A failing release never turns a successful body into a failure, whatever
        the error: the lease then expires by its TTL, and the event says so.
        """
        renewer().untrack(lease)
        if lease.released:
            return
        scope, record, ttl_ms = None, "", 0
        if done is not None and opts.completion:
            record, ttl_ms = self._record_for(done, lease.task_id, result)
            store = self._store(s)
            if not store.in_scripts:
                self._record_elsewhere(store, done, lease.task_id, record, ttl_ms)
            else:
                scope = done.record
        client = connection.client(s)
        ch = wire.channel(client)
        # Deferred only to a server on another host (``_wire.Channel.defers_release``); release_later decides
        # exactly (it declines on Cluster when the record lives in another slot).
        deferring = later and ch is not None and ch.defers_release
        report = _ReleaseReport(self.app, s, self.name, lease, scope, detached=deferring)
        # Every lease end wakes, a slot lease's too: a shared (lock_limit) waiter into that very slot, an
        # exclusive one once the entity is wholly free (RELEASE checks, given the slot).
        reserve_ms = handoff.reserve_ms()
        try:
            if deferring and lease_ops.release_later(
                client, lease, s.key_prefix, report, scope, record, ttl_ms, reserve_ms
            ):
                # The task's span ends before the reply is read (its lock.released then goes to the logs and
                # metrics only): say on the span that the release went out. report.span is the span current
                # here (captured just above, or None when none records): no fields built for no span.
                if report.span is not None:
                    fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence}
                    fields["hold_ms"] = round(report.hold_ms)
                    tracing.span_event("lock.release_sent", self.name, fields, report.span)
                return
            reply: tuple[int, int, lease_ops.Woken | None] | BaseException
            # Waited for in a worker (the server is on this host): the wake-up publish still runs apart, on
            # the replies thread, as for a deferred reply, so a stalled broker never holds the task past its body.
            report.wake_apart = later and ch is not None
            reply = lease_ops.release_and_wake(client, lease, s.key_prefix, scope, record, ttl_ms, reserve_ms)
        except Exception as exc:  # noqa: BLE001 - the body's outcome stands; the lease expires by its TTL
            lease.released = True
            reply = exc
        report(reply)

    def _record_for(self, call: CallNames, task_id: str, result: Any) -> tuple[str, int]:
        record, dropped = completion.encode_record(keys.meta(task_id), result, keys.meta(self.name), call.digest)
        if dropped:
            emit("completion.result_dropped", self.name, task_id=task_id, scope=call.scope, reason=dropped)
        return record, self._completion_ttl_ms(call)

    def _record_elsewhere(self, store: Store, call: CallNames, task_id: str, record: str, ttl_ms: int) -> None:
        """Record completion in a store outside the lease scripts; a failure is logged, never raised."""
        try:
            store.record(call.record, task_id, record, ttl_ms)
        except Exception as exc:  # noqa: BLE001 - the body succeeded; say so loudly, do not fail it
            emit("completion.record_failed", self.name, task_id=task_id, scope=call.scope, reason=_describe(exc))

    def _lookup(self, store: Store, call: CallNames) -> str | None:
        """The record of ``call`` in a store outside the scripts; ``None`` also when the store does not answer."""
        try:
            return store.lookup(call.record)
        except Exception as exc:
            if errors.classify(exc) is None:
                raise
            emit(
                "lock.backend_unavailable",
                self.name,
                **self._fields(call),
                reason=f"completion store: {_describe(exc)}",
            )
            return None

    def _completed(self, call: CallNames, record: str) -> Any:
        """Answer a call whose scope already completed: return the recorded result.

        An ``idempotency_key`` that completed for the same task with other
        arguments is not a duplicate: the caller reused a key for new work
        (``charge(1, 999, "pay-A")`` after ``charge(1, 1000, "pay-A")``). That
        raises :class:`IdempotencyKeyReused`, or with
        ``idempotency_mismatch="warn"`` logs and answers from the record.
        """
        recorded = completion.read_record(record)
        fields = {**self._fields(call), "scope": call.scope, "completed_by": recorded.task_id}
        if not call.scope_is_task and recorded.other_work(keys.meta(self.name), call.digest):
            policy = self.lockguard_options.idempotency_mismatch
            emit("completion.key_reused", self.name, **fields, policy=policy)
            if policy == "raise":
                raise IdempotencyKeyReused(call.scope, recorded.task_id)
        emit("completion.skipped", self.name, **fields)
        return recorded.result

    # -- exits --------------------------------------------------------------------

    def _hand_back(self, s: Settings, opts: TaskOptions, call: CallNames, lease: Lease) -> str:
        """Turn a lease that consumed this delivery's queue claim back into a claim for its wait.

        ACQUIRE adopts the ``until_done`` claim (the lease hash itself) and deletes the
        ``until_started`` one; a delivery that then waits (the store is down, the reply came
        late) must hand a claim on, or an identical publish queues a second copy meanwhile.
        Returns the new claim token ("" when none could be handed on; the wait goes on without).
        """
        client, token = connection.client(s), lease_ops.new_token()
        ttl_ms = claims.claim_ttl_ms(opts.queue_lock_ttl)
        try:
            if opts.mode == "until_done":
                return token if lease_ops.handover(client, lease, token, ttl_ms) else ""
            self._release(s, opts, lease)
            got = lease_ops.claim(
                client,
                claims.claim_key(s.key_prefix, call.key, opts.mode),
                token=token,
                ttl_ms=ttl_ms,
                task_id=self.request.id,
                task_name=self.name,
                digest=call.digest,
            )
            return token if got.kind == "ok" else ""
        except Exception as exc:  # noqa: BLE001 - the wait still goes out; the claim lives out its TTL or is gone
            lease.released = True
            emit("lock.backend_unavailable", self.name, **self._fields(call), reason=f"hand back: {_describe(exc)}")
            return ""

    def _free_claim(
        self, s: Settings, opts: TaskOptions, call: CallNames, token: str, task_id: str | None = None
    ) -> None:
        """Free a queue claim of ``task_id`` (this delivery's by default); best effort.

        Token-checked, so it never frees a newer message's claim. Called on every exit that
        consumes the message without handing the claim on, and when a publish that took (or
        was handed) a claim failed — else identical work would be swallowed for ``queue_lock_ttl``.
        """
        if not token or opts.mode == "while_running":
            return
        task_id = task_id or self.request.id
        fields = {"lock_key": call.key, "task_id": task_id}
        ckey = claims.claim_keys(s.key_prefix, call.key, opts.mode)
        try:
            freed = lease_ops.release_claim(connection.client(s), ckey, task_id, token)
        except Exception as exc:  # noqa: BLE001 - the claim then lives out its queue TTL; say so
            emit("lock.backend_unavailable", self.name, **fields, reason=f"free claim: {_describe(exc)}")
            return
        if freed:
            emit("lock.released", self.name, **fields, reason="claim freed")
            if opts.mode == "until_done":  # the claim was the entity's lease hash: a lease end, so it wakes
                handoff.wake_if_free(self.app, s, call.key, self.name, task_id, limit=opts.limit)

    def _fail_open(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        decision: Decision,
        failure: BaseException | None,
        claim_token: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run without a lease. A PostgreSQL store that answers still makes a duplicate harmless."""
        req = self.request
        reason = _describe(failure) if failure is not None else decision.reason
        emit("lock.fail_open", self.name, **self._fields(call), policy=opts.on_unavailable, reason=reason)
        store = self._store(s) if opts.completion else None
        try:
            if store is None or store.in_scripts:  # the records live in the Redis that is down
                return self._body(args, kwargs)
            record = self._lookup(store, call)
            if record is not None:
                return self._completed(call, record)
            setattr(req, _CALL, call)
            setattr(req, _CHECKPOINTS, set())
            result = self._body(args, kwargs)
            self._record_elsewhere(store, call, req.id, *self._record_for(call, req.id, result))
            return result
        finally:
            if opts.mode == "until_done":  # one copy queued or running: the claim stands for us until the end
                self._free_claim(s, opts, call, claim_token)

    def _wait(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        decision: Decision,
        holder: Holder | None,
        attempt_token: str | None,
        claim_token: str | None = None,
        first_ms: int = 0,
        throttled: Throttled | None = None,
    ) -> Any:
        """Re-deliver this call later, without spending ``max_retries``; the budget is ``lock_max_waits``.

        Returns the published signature, or ``None`` after waiting in this process (eager, or the
        publish failed: Celery's own retry() would ``Reject(requeue=False)`` and drop the message, and
        when the broker is the Redis that is down there is nowhere else to wait).
        """
        req = self.request
        workflow.check_lock_order(self, call.key)  # a workflow member: never wait in a lock-order cycle
        waits = headers.read_int(req, headers.WAITS)
        holder_ttl = holder.pttl_ms / 1000 if holder is not None else None
        if throttled is not None:  # the window says when a start is admitted: wait for that, not a guess
            countdown = min(republish.throttle_countdown(throttled.wait_ms), republish.max_countdown(s))
        else:
            countdown = min(republish.wait_countdown(waits, holder_ttl), republish.max_countdown(s))
        fields = {**self._fields(call), "reason": decision.reason, "waits": waits}
        if req.is_eager:
            self._eager_bound(call, holder, throttled, countdown, fields)
        self._emit_waiting(opts, call, decision, holder, countdown, waits, _policy(opts, decision.reason))
        emit(
            "lock.retry_scheduled",
            self.name,
            **fields,
            countdown=round(countdown, 3),
            policy=_policy(opts, decision.reason),
        )
        hdrs = republish.wait_headers(req, attempt_token, claim_token, first_ms)
        if not req.is_eager:
            try:
                return republish.publish(self, req.args or (), req.kwargs or {}, countdown, hdrs)
            except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the task
                # fields carries the wait's reason: this event's reason replaces it (a duplicate keyword raised)
                failed = {**fields, "policy": "wait_in_process", "reason": f"publish failed: {exc.__class__.__name__}"}
                emit("lock.backend_unavailable", self.name, **failed)
        time.sleep(countdown)
        req.headers = hdrs
        return None

    def _eager_bound(
        self,
        call: CallNames,
        holder: Holder | None,
        throttled: Throttled | None,
        countdown: float,
        fields: dict[str, Any],
    ) -> None:
        """Give up visibly once an eager call's waits would pass :data:`EAGER_MAX_WAIT` (from its first wait)."""
        req = self.request
        started = getattr(req, _EAGER_STARTED, None)
        if started is None:
            started = time.monotonic()
            setattr(req, _EAGER_STARTED, started)
        waited = time.monotonic() - started
        if waited + countdown <= EAGER_MAX_WAIT:
            return
        emit(
            "lock.wait_budget_exhausted",
            self.name,
            **fields,
            policy="eager_max_wait",
            waited=round(waited, 3),
            max_wait=EAGER_MAX_WAIT,
        )
        if holder is None and throttled is None:
            raise BackendUnavailable(
                f"task {self.name!r}: lock store unavailable for {call.key!r}: an eager call waited {waited:.1f}s "
                f"and gives up before {EAGER_MAX_WAIT:g}s ({fields['reason']})"
            )
        raise self._contention_error(call, holder, None, throttled)

    def _emit_waiting(
        self,
        opts: TaskOptions,
        call: CallNames,
        decision: Decision,
        holder: Holder | None,
        countdown: float,
        waits: int,
        policy: str,
    ) -> None:
        """The one line per wait an operator reads (info): who holds the entity, when this call tries again
        (a parked call: at the latest), and which attempt of ``lock_max_waits`` this is. Celery's own
        "retry: Retry in Ns" line says when too."""
        emit(
            "lock.waiting",
            self.name,
            **self._fields(call),
            reason=decision.reason,
            holder_task_id=holder.task_id if holder is not None else None,
            holder_task_name=holder.task_name if holder is not None else None,
            countdown=round(countdown, 3),
            attempt=waits + 1,
            max_waits=opts.max_waits,
            policy=policy,
        )

    def _park(
        self,
        s: Settings,
        opts: TaskOptions,
        call: CallNames,
        client: Any,
        decision: Decision,
        holder: Holder,
        free_retries: int,
        first_ms: int = 0,
    ) -> Any:
        """Park behind ``holder`` and publish the one safety copy; see :mod:`celery_lockguard._handoff`.

        Returns the safety copy's signature (the caller raises ``Retry``), ``"acquire_again"`` (the
        lease was gone by PARK), ``"adopt:<P>"`` (the safety copy's publish failed, yet a releaser had
        already woken us: ACQUIRE adopting P), or ``None``: back off as before (arguments that are not
        JSON, a full queue, an error at PARK, or a failed publish whose entry was taken back).
        """
        req = self.request
        workflow.check_lock_order(self, call.key)  # a workflow member: never park in a lock-order cycle
        park_token = lease_ops.new_token()
        # A copy of a delivery that parked before keeps its place in the queue (not the tail).
        first = headers.read_int(req, headers.PARKED_AT) or None
        hdrs = {
            **republish.wait_headers(req, None, first_delivered_ms=first_ms),
            headers.PARK: park_token,
            headers.PARKED_AT: first or int(time.time() * 1000),
        }
        hdrs.pop(headers.WOKEN, None)
        args, kwargs = req.args or (), req.kwargs or {}
        message = handoff.message_for(self, req, args, kwargs, {**hdrs, headers.WOKEN: 1})
        countdown = handoff.safety_countdown(holder.pttl_ms, s)
        fields = {**self._fields(call), "reason": decision.reason, "waits": headers.read_int(req, headers.WAITS)}
        answer: Any = "unserializable"
        if message is not None:
            try:
                answer = handoff.park(
                    client,
                    s.key_prefix,
                    call.key,
                    park_token,
                    message,
                    task_id=req.id,
                    task_name=self.name,
                    digest=call.digest,
                    countdown=countdown,
                    first_parked_ms=hdrs[headers.PARKED_AT],
                    limit=opts.limit,
                ).kind
            except Exception as exc:
                if errors.classify(exc) is None:
                    raise
                emit("lock.backend_unavailable", self.name, **{**fields, "reason": f"park: {_describe(exc)}"})
                answer = "unavailable"
        then = after_park(answer, free_retries)
        if then != "parked":
            return "acquire_again" if then == "acquire_again" else None
        self._emit_waiting(opts, call, decision, holder, countdown, fields["waits"], "park")
        emit("lock.retry_scheduled", self.name, **fields, countdown=round(countdown, 3), policy="park")
        try:
            return republish.publish(self, args, kwargs, countdown, hdrs)
        except Exception as exc:  # noqa: BLE001 - a failed publish must not lose the task: take the entry back
            failed = {**fields, "policy": "park", "reason": f"publish failed: {exc.__class__.__name__}"}
            emit("lock.backend_unavailable", self.name, **failed)
        try:
            state, age = handoff.check(client, s.key_prefix, call.key, park_token, "safety", grace=0)
        except Exception as exc:  # noqa: BLE001 - cannot tell whether a releaser woke us: adopt if it did
            emit("lock.backend_unavailable", self.name, **{**fields, "reason": f"unpark: {_describe(exc)}"})
            return f"adopt:{park_token}"
        action, why = decide_parked("safety", state, age, 0)  # type: ignore[arg-type]
        if action is ParkedAction.DROP:
            emit("lock.handoff_dropped", self.name, **self._fields(call), reason=why)
            raise Ignore()  # a releaser woke us and the woken copy is out: it runs the job
        return f"adopt:{park_token}" if state == "waking" else None

    def _settle_parked(self, s: Settings, call: CallNames, client: Any, park_token: str) -> None:
        """A copy of a parked delivery settles with its entry: returns to ACQUIRE, or raises ``Ignore``.

        Within the grace of a releaser still publishing, it looks again in this process (a short,
        bounded wait: the releaser either publishes within ms or has died).
        """
        req = self.request
        copy = "woken" if headers.read(req, headers.WOKEN) else "safety"
        grace_ms = int(handoff.WAKE_GRACE * 1000)
        while True:
            state, age = handoff.check(client, s.key_prefix, call.key, park_token, copy, handoff.WAKE_GRACE)
            action, reason = decide_parked(copy, state, age, grace_ms)  # type: ignore[arg-type]
            if action is ParkedAction.PROCEED:
                return
            if action is ParkedAction.DROP:
                emit("lock.handoff_dropped", self.name, **self._fields(call), reason=reason)
                raise Ignore()  # the other copy of this message runs the job; store nothing under its id
            time.sleep(min(0.1, max(0.01, (grace_ms - age) / 1000)))

    def _watch(self, s: Settings, opts: TaskOptions, call: CallNames) -> None:
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
        watches = headers.read_int(req, headers.WATCH)
        fields = {**self._fields(call), "reason": "watching_running_original", "waits": watches}
        if watches >= opts.max_waits:
            emit("lock.wait_budget_exhausted", self.name, **fields, policy=opts.on_locked)
            return
        countdown = republish.watch_countdown(watches, opts.ttl, s)
        try:
            token = republish.arm_watch(connection.client(s), s, call.key, req, countdown, opts.ttl)
            if token is None:  # a watch of this task is already pending: this copy is a duplicate of one
                return
            republish.publish(self, req.args or (), req.kwargs or {}, countdown, republish.watch_headers(req, token))
        except Exception as exc:
            # fields carries reason="watching_running_original": this event's reason replaces it
            failed = {**fields, "policy": "watch", "reason": f"publish failed: {exc}"}
            emit("lock.backend_unavailable", self.name, **failed)
            # Hand the copy back to the broker instead (a redelivery is an acks_late message): it comes back
            # and decides again -- the original finished, still runs (watch again) or died (take over).
            raise Reject(f"watch not published: {exc}", requeue=True) from exc
        emit("lock.retry_scheduled", self.name, **fields, countdown=round(countdown, 3), policy="watch")

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
        while True:
            got, failure = self._claim(s, ckey, token, ttl_ms, task_id, call)
            decision = decide_publish(
                Publish(
                    on_locked=opts.on_locked,  # type: ignore[arg-type]
                    claim=got.kind if got is not None else errors.classify(failure),  # type: ignore[arg-type]
                    duplicate=got is not None and got.task_name == self.name and got.digest == call.digest,
                    in_canvas=claims.in_canvas(options, link),
                    held_by_publisher=got is not None and publisher is not None and got.task_id == keys.meta(publisher),
                    holder_publishing=got is not None and got.state == "publishing" and time.monotonic() < deadline,
                )
            )
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
                self._free_claim(s, opts, call, token, task_id)
                raise
            backend, span, name = events.backend_choice(), tracing.current_span(), self.name

            def confirmed(reply: bool | BaseException) -> None:
                # Read later (nothing waits on it: the message is out); a failed confirm lapses after the grace.
                if isinstance(reply, BaseException):
                    failed = {**fields, "policy": opts.on_unavailable, "reason": f"confirm claim: {_describe(reply)}"}
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
            emit("lock.backend_unavailable", self.name, **fields, reason=f"publish without claim: {_describe(failure)}")
        return super().apply_async(args, kwargs, task_id, link=link, **options)

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
        if lease is not None and not lease.released:
            limit = self.max_retries if max_retries is None else max_retries
            exhausted = limit is not None and req.retries + 1 > limit
            if opts.mode == "until_done" and not exhausted:
                token = lease_ops.new_token()
                renewer().untrack(lease)
                try:
                    if lease_ops.handover(
                        connection.client(s), lease, token, claims.claim_ttl_ms(opts.queue_lock_ttl, delay)
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
                        reason=f"handover: {_describe(err)}",
                    )
            else:
                self._release(s, opts, lease)
        try:
            with republish.own_copy(req.id):  # the retry's message is this delivery's copy: never new work
                return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            raise
        except BaseException:
            if handed:  # the retry was not published (Celery raises Reject): free its claim
                call: CallNames | None = getattr(req, _CALL, None)
                if call is not None:
                    self._free_claim(s, opts, call, handed)
            raise


def _when(sig: Any) -> float | None:
    """The republished copy's countdown, for ``Retry(when=...)``: Celery logs "Retry in 2.5s", not "at None"."""
    countdown = (getattr(sig, "options", None) or {}).get("countdown")
    return round(float(countdown), 3) if isinstance(countdown, (int, float)) else None


class LockedTask(LockGuard):
    """``LockGuard`` over the app's own task class: ``@app.task(base=LockedTask, lock_key=...)``.

    Celery builds a function's task class as ``type(name, (base,), ...)``, so
    ``base=LockedTask`` alone would drop the app's ``task_cls`` (``DjangoTask``
    under Celery's Django fixup, with its ``delay_on_commit``; a project's base
    class; ``app.Task = MyBase``). The class Celery builds for a function gets
    ``app.Task`` appended to its bases when that is safe
    (:func:`adoptable_task_class`: no name of ours shadowed, no ``apply_async``
    of its own that would run after the claim is computed), giving
    ``<task> -> LockedTask -> LockGuard -> app.Task -> DjangoTask -> Task``. A
    task class written by hand keeps the bases it names: compose with
    ``LockGuard`` there. A worker start warns about a task that misses the app's
    class (:func:`missing_task_class`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        app = own.get("app")
        if not own.get("_decorated") or app is None:
            return
        configured = adoptable_task_class(app)
        if configured is None or any(issubclass(b, configured) for b in cls.__bases__):
            return
        try:
            cls.__bases__ = (*cls.__bases__, app.Task)
        except TypeError:  # a layout or metaclass conflict: keep Celery's class; the worker start warns
            return


def configured_task_class(app: Any) -> type | None:
    """The app's default task class when it is one of its own: not Celery's ``Task``, not already a ``LockGuard``.

    Read from ``app.Task``, not ``app.task_cls``: ``app.Task = MyBase`` is
    Celery's documented way to change the default base and leaves ``task_cls``
    alone. Celery's own ``app.Task`` is an app-bound subclass of ``task_cls``
    (``subclass_with_self``, the app in its class dict as ``_app``); the class
    the user chose is the first base past those.
    """
    try:
        configured = app.Task
    except Exception:  # noqa: BLE001 - an unimportable task_cls fails Celery itself, louder than we could
        return None
    while isinstance(configured, type) and vars(configured).get("_app") is app and configured.__bases__:
        configured = configured.__bases__[0]
    if not isinstance(configured, type) or not issubclass(configured, Task):
        return None
    if configured is Task or issubclass(configured, LockGuard):
        return None
    return configured


def shadowed_names(configured: type) -> list[str]:
    """Names ``configured`` defines that ``LockGuard`` defines too (and Celery's ``Task`` does not).

    Ours come first in the MRO and would shadow them silently: a project base
    class with its own ``lock`` or ``checkpoint`` would read lockguard's. Hooks
    both override (``__call__``, ``retry``, ...) are not clashes: they chain
    through ``super()`` (``apply_async`` is a case of its own:
    :func:`publishes_itself`).
    """
    ours = {name for name in vars(LockGuard) if not name.startswith("__")} - set(dir(Task))
    theirs: set[str] = set()
    for cls in configured.__mro__:
        if not issubclass(cls, Task) or cls is Task:
            continue
        theirs.update(vars(cls))
    return sorted(ours & theirs)


def publishes_itself(configured: type) -> type | None:
    """The class below Celery's ``Task`` in ``configured``'s MRO that overrides ``apply_async``, or ``None``.

    With ``LockGuard`` first, the claim is rendered from the arguments *we*
    were given, before that ``apply_async`` runs: one that adds or rewrites
    arguments (a tenant id from a context variable) would make different work
    share one claim key, and the second publish would be answered with the
    first's job and never sent. ``LockedTask`` cannot know what it does, so it
    does not adopt such a class; the user composes in the order that fits.
    ``DjangoTask`` only adds ``*_on_commit`` methods and stays adoptable.
    """
    for cls in configured.__mro__:
        if cls is Task:
            return None
        if "apply_async" in vars(cls):
            return cls
    return None


def _refusal(configured: type) -> str | None:
    """Why ``LockedTask`` does not adopt ``configured``, or ``None`` if it may."""
    shadowed = shadowed_names(configured)
    if shadowed:
        return f"it defines {', '.join(shadowed)}, which LockGuard defines too"
    publisher = publishes_itself(configured)
    if publisher is not None:
        where = "its" if publisher is configured else f"{publisher.__qualname__}'s"
        return (
            f"{where} apply_async runs after lockguard computes the claim, so arguments it adds or rewrites "
            "would not be part of the claim key"
        )
    return None


def adoptable_task_class(app: Any) -> type | None:
    """The app's default task class if ``LockedTask`` may put it under a function's task, else ``None``."""
    configured = configured_task_class(app)
    if configured is None or _refusal(configured) is not None:
        return None
    return configured


def missing_task_class(task: Any) -> str | None:
    """Why ``task`` (a ``LockGuard``) lacks the app's non-default task class, or ``None`` if it does not.

    Said at worker start (logged, never fatal): the task still locks, but the
    app's class (``DjangoTask.delay_on_commit``, a project's ``__call__``) is
    not part of it, which a user of ``base=LockedTask`` rarely means.
    """
    configured = configured_task_class(task.app)
    if configured is None or isinstance(task, configured):
        return None
    where = f"{configured.__module__}.{configured.__qualname__}"
    refusal = _refusal(configured)
    why = f" (LockedTask does not adopt it: {refusal})" if refusal else ""
    name = configured.__name__
    how = f"class Locked{name}(LockGuard, {name}) and base= that class"
    if publishes_itself(configured) is not None and not shadowed_names(configured):
        how = (
            f"class Locked{name}(LockGuard, {name}) claims before its apply_async, "
            f"class Locked{name}({name}, LockGuard) claims on the final message (its __call__ must end in "
            "super().__call__()); base= the one that fits"
        )
    return (
        f"task {task.name!r} does not derive from the app's task_cls {where}{why}; "
        f"compose the lease with it explicitly: {how} (docs/django.md)"
    )


class _ReleaseReport:
    """What a RELEASE reply means, logged and counted: now, or when a deferred reply is read.

    Everything it needs is captured when the lease is released (hold time, whether the body was
    told it was lost and, for a deferred reply, the log backend and the task's span): a deferred
    reply may be read on the renewer thread or inside the next task, where neither the time nor the
    context is this task's. A reply waited for is reported right here, in the task's own context.
    """

    __slots__ = (
        "app",
        "backend",
        "hold_ms",
        "lease",
        "scope",
        "settings",
        "span",
        "task_name",
        "wake_apart",
        "was_lost",
    )

    def __init__(
        self, app: Any, s: Settings, task_name: str, lease: Lease, scope: str | None, detached: bool = True
    ) -> None:
        self.app, self.settings = app, s
        self.task_name = task_name
        self.lease = lease
        self.scope = scope
        self.was_lost = lease.lost
        self.hold_ms = lease.hold_ms()
        #: ``detached``: the reply may be read on another thread or inside the next task, so the log backend
        #: and the span are captured now; otherwise (``None``) the report runs here, where both are current.
        self.backend: str | None = events.backend_choice() if detached else None
        self.span = tracing.current_span() if detached else None
        #: Publish the wake-up on the replies thread rather than here (a release waited for in a worker).
        self.wake_apart = False

    def _emit(self, event: str, **fields: Any) -> None:
        if self.backend is None:
            emit(event, self.task_name, **fields)
        else:
            events.emit_for(event, self.task_name, fields, backend=self.backend, span=self.span)

    def __call__(self, reply: tuple[int, int, lease_ops.Woken | None] | BaseException) -> None:
        lease, hold_ms = self.lease, round(self.hold_ms)
        fields = {"lock_key": lease.key, "task_id": lease.task_id, "fence": lease.fence}
        if isinstance(reply, BaseException):
            self._emit("lock.backend_unavailable", **fields, reason=f"release: {_describe(reply)}")
            if self.scope is not None:
                self._emit(
                    "completion.record_failed",
                    task_id=lease.task_id,
                    scope=self.scope,
                    reason=f"release: {_describe(reply)}",
                )
            return
        released, _recorded, woken = reply
        metrics.observe_hold(self.task_name, self.hold_ms)
        if released == 1:
            # Still ours in Redis, yet past its validity here (e.g. a renewal delayed in flight): the body
            # was told it was lost, so say so once even though the key survived.
            if self.was_lost and lease.mark_lost("expired"):
                self._emit("lock.lost", **fields, hold_ms=hold_ms, reason="expired")
            self._emit("lock.released", **fields, hold_ms=hold_ms, lost=self.was_lost)
        else:
            reason = "expired" if released == 0 else "taken_by_another_holder"
            if lease.mark_lost(reason):
                self._emit("lock.lost", **fields, hold_ms=hold_ms, reason=reason)
            self._emit("lock.expired_before_release", **fields, hold_ms=hold_ms, reason=reason)
        # The one place the releaser's part of park and wake runs, on RELEASE's reply (never raises).
        if woken is not None and self.wake_apart:
            wire.run_apart(self._wake, woken)
        else:
            self._wake(woken)

    def _wake(self, woken: lease_ops.Woken | None) -> None:
        handoff.wake(self.app, self.settings, woken, self.task_name, self.lease.task_id)


_CELERY_CALL = Task.__dict__["__call__"]


#: Decision reasons of an outage: their exits follow ``on_unavailable``; every other wait or give-up, ``on_locked``.
_OUTAGE_REASONS = frozenset({"backend_unavailable", "acquire_slower_than_ttl"})


def _policy(opts: TaskOptions, reason: str) -> str:
    """The policy an exit's event names: the one that decided it."""
    return opts.on_unavailable if reason in _OUTAGE_REASONS else opts.on_locked


def _runs_plainly(cls: type) -> bool:
    """Whether the ``__call__`` after ``LockGuard``'s in ``cls``'s MRO is Celery's own ``Task.__call__``.

    The MRO part is kept in the class's own ``__dict__`` (never inherited: a subclass may add a
    ``__call__``); whether ``Task.__call__`` is still Celery's -- or the worker's stack protection
    around it, whose fast path this is -- is asked every time (a wrapper may be patched on later).
    """
    known = cls.__dict__.get("_lockguard_plain_call")
    if known is None:
        mro = cls.__mro__
        after = mro[mro.index(LockGuard) + 1 :]
        known = next((k for k in after if "__call__" in k.__dict__), None) is Task
        type.__setattr__(cls, "_lockguard_plain_call", known)
    if not known:
        return False
    current = Task.__dict__["__call__"]
    if current is _CELERY_CALL:
        return True
    protected = getattr(Task, "_stackprotected", False) and getattr(current, "__name__", "") == "__protected_call__"
    return bool(protected and _trace._patched.get("BaseTask.__call__") is _CELERY_CALL)


def _describe(exc: BaseException | None) -> str:
    return f"{exc.__class__.__name__}: {exc}" if exc is not None else ""
