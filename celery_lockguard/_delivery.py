"""The delivery loop: acquire, ask :mod:`._decision`, carry the answer out.

``LockGuard.__call__`` enters here for a locked delivery; a workflow member and debounce
enter through the same named doors, never the task class's private methods:

* :func:`deliver` -- a locked delivery of ``task`` with these arguments (lease, decision, exits);
* :func:`run_body` -- the body under the delivery's request, through the other task classes' ``__call__``;
* :func:`._waits.wait` -- re-deliver the call later within ``lock_max_waits``;
* :func:`._request.enter` / :func:`._request.hold` -- the per-request state a body reads.

What a delivery holds across its attempts (the message's claim, the token ACQUIRE adopts, a
parked copy's entry, a reservation RELEASE made for it, ...) is one :class:`DeliveryState`, a
name per token. Releases and records live in :mod:`._release` and :mod:`._records`, waits in
:mod:`._waits`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from celery import states
from celery._state import _task_stack
from celery.exceptions import Ignore, Retry

from . import _calls as calls
from . import _connection as connection
from . import _debounce as debounce
from . import _errors as errors
from . import _handoff as handoff
from . import _headers as headers
from . import _keys as keys
from . import _lease as lease_ops
from . import _metrics as metrics
from . import _multi as multi
from . import _records as records
from . import _release as release_ops
from . import _request as request_state
from . import _taskclass as taskclass
from . import _waits as waits
from ._calls import CallNames
from ._completion import Store
from ._config import Settings, TaskOptions
from ._decision import (
    FREES_CLAIM,
    RUN_ACQUIRED,
    Action,
    Decision,
    Delivery,
    HolderFacts,
    Outcome,
    decide_delivery,
)
from ._events import emit
from ._lease import Done, Holder, Lease, Throttled
from ._renewer import renewer
from ._request import event_fields


def run_body(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], req: Any = None) -> Any:
    """Run the body under the delivery's own request, through the other task classes' ``__call__``.

    Where the next ``__call__`` in the MRO is Celery's own, the body runs as a worker runs it
    (``celery.app.trace``'s stack protection): ``run`` under the request the tracer pushed (the
    lease, names and checkpoints are already on it), which is marked ``_protected`` so that a
    direct call inside the body pushes a request of its own (and runs unlocked, see
    :meth:`LockGuard.push_request`). Outside a worker (``apply()``, eager mode) ``Task.__call__`` would
    push a copy of that request first: a second ``Context`` per call. Any other ``__call__``
    (Django's task class, a user's base, a wrapper patched onto ``Task.__call__``) is kept.
    ``req``: ``task.request``, when the caller has it at hand.
    """
    if taskclass.runs_plainly(type(task)):
        if req is None:
            req = task.request
        req._protected = 1
        _task_stack.push(task)
        try:
            return task.run(*args, **kwargs)
        finally:
            _task_stack.pop()
    guard = taskclass.guard_of(type(task))  # LockGuard: the next __call__ after it in the task's MRO
    assert guard is not None
    return super(guard, task).__call__(*args, **kwargs)


@dataclass
class DeliveryState:
    """What one delivery holds and owes across its attempts at ACQUIRE: a name per token.

    Read once from the message (:meth:`of`); ACQUIRE, PARK and the exits update it. A token is
    ``""`` when there is none.
    """

    #: The rendered names of this call (entity key, completion scope, record).
    call: CallNames
    #: The Redis client the lease scripts run on.
    client: Any
    #: The completion store; ``None`` without completion records.
    store: Store | None
    #: When the lock wait began (ms): the message's first delivery, carried by its waits, else now.
    first_ms: int
    #: A delayed watch copy of a running original (same task id): its wait is the original's run, not contention.
    watch_copy: bool
    #: The queue claim the message carries (``until_started``/``until_done``): freed or handed on at every exit.
    claim_token: str
    #: The token ACQUIRE replaces, i.e. adopts: our own ``until_done`` claim, a parked copy's reservation, a
    #: holder of our own id that the decision says to adopt.
    replace_token: str
    #: The claim ACQUIRE frees on start (``until_started``; ``until_done`` too when it queued behind other work).
    start_claim: str
    #: A parked copy's waiter entry, settled before the first ACQUIRE (``""`` once settled).
    park_token: str
    #: A reservation RELEASE may have made for this copy (its park token): abandoned on every exit that does not run.
    reserved: str
    #: ``call``, named after the entity this delivery parked on: for several entities, the one that blocked it
    #: (header ``lockguard_park_entity``); its waiter queue and reservation live there (``_multi.parked_on``).
    parked: CallNames
    #: Whether a contended attempt may park behind the holder (else it backs off with a countdown).
    can_park: bool
    #: ACQUIREs repeated because PARK found the lease already gone.
    free_retries: int = 0
    #: Tokens a holder of our own id may be an orphan of ours under, adopted when met: those the message carries
    #: (header ``lockguard_attempt``) and the reservations this delivery re-tokened or gave back with a call
    #: whose reply may be lost (KEEP_BEFORE). A copy it publishes carries them on.
    orphans: frozenset[str] = frozenset()
    #: Orphan tokens adopted once in this delivery: met again (two tokens on two entities, each adoption
    #: blocked by the other), the delivery backs off rather than spin until one lapses.
    adopted: set[str] = field(default_factory=set)

    @classmethod
    def of(
        cls,
        task: Any,
        req: Any,
        s: Settings,
        opts: TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        held: tuple[str, ...] = (),
    ) -> DeliveryState:
        """The state a delivery starts with, from its request's headers (``req``: ``task.request``).

        ``held``: entities a workflow holds for this delivery, left out of its own (:func:`._calls.without`).
        """
        call = calls.render(opts, req.id, args, kwargs)
        if held:
            call = calls.without(call, held)
        client = connection.client(s)
        store = records.store_for(task, s) if opts.completion else None
        # A plain first delivery carries none of our headers: one test instead of a read per header.
        carried = headers.carried(req)
        # The lock wait counts from the message's first delivery (carried by its waits), else from now.
        first_ms = (headers.read_ms(req, headers.FIRST_DELIVERED) if carried else 0) or int(time.time() * 1000)
        watch_copy = carried and headers.read(req, headers.WATCH) is not None
        claim_token = headers.read_str(req, headers.CLAIM) if carried else ""
        # A copy of a parked delivery (safety or woken) settles with its waiter entry before ACQUIRE, and
        # adopts the reservation RELEASE made for it (token = park token), if it is still there.
        parks = carried and opts.mode == "while_running" and not watch_copy
        park_token = headers.read_str(req, headers.PARK) if parks else ""
        # A lock_limit waiter parks behind its N slots (a slot's release wakes it into that slot); a lock_rate
        # waiter backs off with a countdown instead (docs/limits.md): its start window is freed by time, not
        # by a release.
        can_park = opts.mode == "while_running" and not claim_token and not watch_copy and not req.is_eager
        return cls(
            call=call,
            client=client,
            store=store,
            first_ms=first_ms,
            watch_copy=watch_copy,
            claim_token=claim_token,
            # until_done: adopt our own queue claim (fresh token, state running); a parked copy: its reservation.
            replace_token=park_token or (claim_token if opts.mode == "until_done" else ""),
            # until_started: free it on start; until_done: free it too when it queued in {K}:claim behind other work.
            start_claim=claim_token,
            park_token=park_token,
            reserved=park_token,
            parked=multi.parked_on(call, headers.read_str(req, headers.PARK_ENTITY)) if carried else call,
            can_park=can_park and opts.rate is None,
            orphans=headers.attempt_tokens(req) if carried else frozenset(),
        )


def deliver(
    task: Any,
    s: Settings,
    opts: TaskOptions,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    held: tuple[str, ...] = (),
) -> Any:
    """Acquire, decide, carry out; loop only to adopt a claim or to wait in-process.

    ``held``: entities of the call's ``lock_key`` its workflow already holds (a member nesting its own lock).
    """
    req = task.request
    state = DeliveryState.of(task, req, s, opts, args, kwargs, held)
    call, store = state.call, state.store
    if state.watch_copy and store is not None and not store.in_scripts:
        # A watch copy checks the record first: acquiring to read it would make copies arriving
        # meanwhile see "my own id, alive" and leave watches of their own. A store error: ACQUIRE decides.
        record = records.lookup(task, store, call)
        if record is not None:
            if original_settled(task):
                raise Ignore()
            # The original died before storing a state, its job done by other work: answer for it,
            # or its task id stays PENDING for good.
            return records.completed(task, call, record)
    while True:
        token = lease_ops.new_token()
        got: Lease | Holder | Done | Throttled | None = None
        failure: BaseException | None = None
        outcome: Outcome
        try:
            if state.park_token:
                waits.settle_parked(task, s, state.parked, state.client, state.park_token)
                state.park_token = ""
            got = _acquire(
                task,
                req,
                s,
                opts,
                call,
                state.client,
                token,
                state.replace_token,
                store,
                state.start_claim,
                state.reserved,
            )
        except Ignore:
            raise
        except Exception as exc:
            kind = errors.classify(exc)
            if kind is None:
                raise
            outcome, failure = kind, exc
        else:
            outcome, got, failure = _outcome(task, s, opts, call, store, got, state.watch_copy)
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
                    holder=_facts(task, call, holder, state.orphans, state.adopted) if holder is not None else None,
                    # A watch copy answers from the record when its original never stored a state.
                    watch_copy=state.watch_copy and not (outcome == "record" and not original_settled(task)),
                    waits=headers.read_int(req, headers.WAITS),
                    max_waits=opts.max_waits,
                    can_park=state.can_park,
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
                    task.name,
                    **event_fields(task, call),
                    policy=opts.on_unavailable,
                    reason=f"completion store: {errors.describe(failure)}",
                )
            if not state.watch_copy:  # a watch copy's wait is its original's run, not contention
                metrics.observe_wait(task.name, time.time() * 1000 - state.first_ms)
            if state.reserved and opts.limit > 1:
                # A parked shared waiter got its slot: pass the wake on, so that when an exclusive holder
                # ends, every free slot goes to a parked waiter, not only the one its release handed out.
                handoff.wake_if_free(task.app, s, call.key, task.name, str(req.id), limit=opts.limit)
            return _run_locked(task, req, s, opts, call, state.client, got, args, kwargs)
        if action is Action.ADOPT:
            assert holder is not None
            emit(
                "lock.contended",
                task.name,
                **event_fields(task, call),
                holder_task_id=holder.task_id,
                policy=opts.on_locked,
                reason=decision.reason,
            )
            state.replace_token = holder.token
            if holder.token in state.orphans:
                state.adopted.add(holder.token)
            continue
        handed: str | None = None  # the claim token a wait carries on, when the lease consumed the claim
        if isinstance(got, Lease):  # held only to read the record, or it came too late, or the store is down
            if action is Action.WAIT and state.claim_token:
                handed = release_ops.hand_back(task, s, opts, call, got)
            else:
                release_ops.give_back(task, s, opts, got)
        _met(task, opts, call, decision, holder, failure, throttled)
        kept = ""  # several entities: the park token our reservations kept for the wait carry
        countdown: float | None = None
        if state.reserved and call.keys:
            # Several entities, some reserved for us, another held: keep the reservations on the entities
            # sorted before the blocker (through our wait: the global order makes that deadlock-free) and
            # give back the others, waking their waiters (_multi.keep_before). Not parking: give back all.
            blocker = ""
            if action is Action.PARK and holder is not None and holder.entity:
                blocker, countdown = holder.entity, handoff.safety_countdown(holder.pttl_ms, s)
            kept = release_ops.keep_before(task, s, call, state.client, state.reserved, blocker, countdown or 0.0)
            # A KEEP_BEFORE whose reply was lost left them under the old token or the new one: whichever copy
            # comes back adopts them there (an orphan of its own), never watches them as a running original.
            state.orphans = _orphans(state.orphans, state.reserved, kept)
            state.reserved = ""
        if action is Action.PARK:
            assert holder is not None
            at = multi.parked_on(call, holder.entity or "")  # park on the entity that blocked us
            try:
                parked = waits.park(
                    task,
                    s,
                    opts,
                    at,
                    state.client,
                    decision,
                    holder,
                    state.free_retries,
                    state.first_ms,
                    kept,
                    countdown,
                    state.orphans,
                )
            except Ignore:
                raise  # the woken copy of this wait is out: it adopts what we kept
            except Exception:
                if kept:  # e.g. a workflow member refused to wait in a lock-order cycle: keep nothing
                    release_ops.keep_before(task, s, call, state.client, kept, "", 0.0)
                raise
            if parked == "acquire_again":
                state.free_retries += 1
                if kept:  # our kept reservations: adopted by the next ACQUIRE, kept or given back if blocked again
                    state.replace_token = state.reserved = kept
                continue
            if isinstance(parked, str) and parked.startswith("adopt:"):
                state.replace_token = parked[len("adopt:") :]  # our publish failed, yet a releaser woke us
                state.parked = at
                if call.keys:
                    state.reserved = state.replace_token
                continue
            if parked is not None:
                raise Retry(exc=waits.contention_error(task, call, holder, None), when=waits.when(parked), sig=parked)
            if kept:  # could not park: nothing of the set is held while backing off
                release_ops.keep_before(task, s, call, state.client, kept, "", 0.0)
            decision = Decision(Action.WAIT, decision.reason)  # could not park: back off as before
            action = decision.action
        if action in FREES_CLAIM and not (action is Action.FAIL_OPEN and opts.mode == "until_done"):
            release_ops.free_claim(task, s, opts, call, state.claim_token)
        if state.reserved and action in FREES_CLAIM:
            # answered from the record, skipped, gave up...: the reservation must not hold up the next waiter
            handoff.abandon(task.app, s, state.parked.key, state.reserved, task.name, req.id, limit=opts.limit)
        if action is Action.WAIT and handed is None and state.claim_token and outcome != "unavailable":
            # The claim was not consumed (a holder was met): it goes on with the wait copy, and must live
            # through that copy's countdown, not lapse queue_lock_ttl after the first publish.
            release_ops.keep_claim(task, s, opts, call, state.claim_token)
        if action is Action.WAIT:
            # A wait after an ACQUIRE that errored adopts that attempt's orphan; every wait carries ours on.
            attempt = headers.attempt_value(
                _orphans(state.orphans, token if outcome == "unavailable" and got is None else "")
            )
            sig = waits.wait(
                task, s, opts, call, decision, holder, attempt, handed, state.first_ms, throttled=throttled
            )
            if sig is None:
                continue  # waited in this process: eager, or the publish failed
            if state.watch_copy:
                # A watch copy shares its original's task id: RETRY stored now would overwrite the
                # original's SUCCESS for good if the wait then finds the record and drops itself.
                raise Ignore()
            raise Retry(
                exc=waits.contention_error(task, call, holder, failure, throttled), when=waits.when(sig), sig=sig
            )
        if state.watch_copy and action in (Action.RAISE, Action.GIVE_UP) and original_settled(task):
            raise Ignore()  # the original ended; a failure stored now would overwrite its state
        if action is Action.FAIL_OPEN and outcome == "unavailable" and got is None:
            # The ACQUIRE errored: a stalled server may yet run it, leaving a lease of ours nobody releases.
            orphan = release_ops.Orphan(task, s, opts, call, state.client, token)
            setattr(req, request_state.ORPHAN, orphan)  # a retry() in the body settles it before it publishes
            try:
                return _finish(task, s, opts, call, decision, got, holder, failure, state.claim_token, args, kwargs)
            finally:
                orphan.settle()
        return _finish(task, s, opts, call, decision, got, holder, failure, state.claim_token, args, kwargs)


def _finish(
    task: Any,
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
    action, fields = decision.action, event_fields(task, call)
    throttled = got if isinstance(got, Throttled) else None
    if action is Action.ANSWER:
        record = got.record if isinstance(got, Done) else ""
        return records.completed(task, call, record)
    if action is Action.DROP:
        raise Ignore()  # a watch copy: the original finished; leave its stored state alone
    if action is Action.SKIP:
        assert holder is not None
        emit(
            "lock.skipped_duplicate",
            task.name,
            **fields,
            holder_task_id=holder.task_id,
            policy="skip",
            reason=decision.reason,
        )
        # The caller's AsyncResult says who did the work: ``children[0]`` is the holder, to wait on.
        task.add_trail(task.AsyncResult(holder.task_id))
        return None
    if action is Action.DROP_AND_WATCH:
        assert holder is not None
        emit(
            "lock.skipped_duplicate",
            task.name,
            **fields,
            holder_task_id=holder.task_id,
            policy=opts.on_locked,
            reason=decision.reason,
        )
        waits.watch(task, s, opts, call)
        raise Ignore()
    if action is Action.RAISE:
        assert holder is not None or throttled is not None
        raise waits.contention_error(task, call, holder, None, throttled)
    if action is Action.GIVE_UP:
        emit(
            "lock.wait_budget_exhausted",
            task.name,
            **fields,
            reason=decision.reason,
            waits=headers.read_int(task.request, headers.WAITS),
            policy=waits.policy_of(opts, decision.reason),
        )
        raise waits.contention_error(task, call, holder, failure, throttled)
    if action is Action.MISCONFIGURED:
        assert failure is not None
        raise errors.configuration_error(failure, task.name, "ACQUIRE") from failure
    assert action is Action.FAIL_OPEN
    return _fail_open(task, s, opts, call, decision, failure, claim_token, args, kwargs)


def _acquire(
    task: Any,
    req: Any,
    s: Settings,
    opts: TaskOptions,
    call: CallNames,
    client: Any,
    token: str,
    replace_token: str,
    store: Store | None,
    claim_token: str = "",
    reserved: str = "",
) -> Lease | Holder | Done | Throttled:
    """ACQUIRE for this call: a lease, the holder it met, its record, or a full start window (``lock_rate``).

    ``reserved``: a woken copy's park token (several entities: what Cluster's in-order path keeps).
    ``req``: ``task.request`` (read once per delivery: each read is a walk of Celery's request stack).
    """
    if call.keys:  # several entities: all or nothing (_multi)
        return multi.acquire(
            client,
            s.key_prefix,
            call.keys,
            ttl_ms=opts.ttl_ms,
            task_id=req.id,
            task_name=task.name,
            digest=call.digest,
            worker=req.hostname or "",
            fence_ttl_ms=int(s.fence_ttl * 1000),
            scope=call.record if store is not None and store.in_scripts else None,
            token=token,
            replace_token=replace_token,
            claim_token=claim_token,
            wake=lambda woken: handoff.wake(task.app, s, woken, task.name, req.id, client),
            reserve_ms=handoff.reserve_ms(),
            replicas=opts.replicas,
            replicas_timeout_ms=_replicas_timeout_ms(s, opts),
            reserved=reserved,
        )
    return lease_ops.acquire(
        client,
        s.key_prefix,
        call.key,
        ttl_ms=opts.ttl_ms,
        task_id=req.id,
        task_name=task.name,
        digest=call.digest,
        worker=req.hostname or "",
        fence_ttl_ms=int(s.fence_ttl * 1000),
        scope=call.record if store is not None and store.in_scripts else None,
        token=token,
        replace_token=replace_token,
        claim_token=claim_token,
        replicas=opts.replicas,
        replicas_timeout_ms=_replicas_timeout_ms(s, opts),
        limit=opts.limit,
        rate=(opts.rate.count, opts.rate.window_ms) if opts.rate is not None else None,
    )


def _replicas_timeout_ms(s: Settings, opts: TaskOptions) -> int:
    """How long ACQUIRE's ``WAIT`` may block (0 when no replicas are asked for: nothing reads it then)."""
    if not opts.replicas:
        return 0
    # WAIT must answer well inside the socket timeout, or a slow replica reads as an outage.
    return max(1, min(opts.replicas_timeout_ms, int(s.socket_timeout * 500)))


def _outcome(
    task: Any,
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
    if watch_copy and isinstance(got, Lease) and not got.lost and original_settled(task):
        release_ops.give_back(task, s, opts, got)
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
                release_ops.release(task, s, opts, got)
                raise
            if opts.on_unavailable == "fail_open":
                return "acquired", got, exc  # run under the lease, unchecked (logged as fail_open)
            return "unavailable", got, exc
        if record is not None:
            release_ops.give_back(task, s, opts, got)  # recorded by a finisher: give the fresh lease straight back
            return "record", Done(record), None
        if got.lost:
            # The store answered after the lease's validity (it is not renewed while the record is read):
            # another delivery may hold it by now. As for a late ACQUIRE: never run on it.
            return "late", got, None
    return "acquired", got, None


def _met(
    task: Any,
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
    fields = event_fields(task, call)
    if throttled is not None:
        rate = opts.rate.text if opts.rate is not None else None
        emit(
            "lock.throttled",
            task.name,
            **fields,
            policy=opts.on_locked,
            reason=decision.reason,
            rate=rate,
            starts=throttled.starts,
            retry_after_ms=throttled.wait_ms,
        )
    elif holder is None:
        reason = errors.describe(failure) if failure is not None else decision.reason
        emit("lock.backend_unavailable", task.name, **fields, policy=opts.on_unavailable, reason=reason)
    elif holder.task_id != keys.meta(task.request.id):
        fields.update(multi.contended_fields(call, holder))
        emit("lock.contended", task.name, **fields, holder_task_id=holder.task_id, policy=opts.on_locked)


def original_settled(task: Any) -> bool:
    """Whether this task id already ended in the result backend (SUCCESS, FAILURE or REVOKED).

    ``RETRY`` is not an end: the retry message may be the very copy that was dropped behind a
    running duplicate (then this watch copy is the job's last message), so the watch copy runs
    the job, at worst before the retry's countdown, and the retry is answered from its record.
    Unknown (no result backend, ``ignore_result``, a backend error) counts as not settled: the
    watch copy then falls back on the completion record alone, as documented.
    """
    try:
        state = task.AsyncResult(task.request.id).state
    except Exception:  # noqa: BLE001 - DisabledBackend, an unreachable backend: we cannot tell
        return False
    return state in states.READY_STATES


def _orphans(known: frozenset[str], *tokens: str) -> frozenset[str]:
    """``known`` with ``tokens`` added (``""`` ignored), at most ``MAX_ATTEMPT_TOKENS``: ``tokens`` first."""
    newest = [t for t in tokens if t]
    return frozenset((newest + sorted(known - set(newest)))[: headers.MAX_ATTEMPT_TOKENS])


def _facts(
    task: Any,
    call: CallNames,
    holder: Holder,
    orphans: frozenset[str] = frozenset(),
    adopted: set[str] | frozenset[str] = frozenset(),
) -> HolderFacts:
    """What the decision needs to know about the holder ACQUIRE met (ours? alive? a duplicate? an orphan?).

    ``orphans``: tokens this delivery may have left a lease or reservation of its own id under; ``adopted``:
    those it adopted once already (``DeliveryState``). Nothing of ours runs under such a token, so its holder
    is never a running original: adopted, or (met again) waited out.
    """
    req = task.request
    own = holder.task_id == keys.meta(req.id)  # holder metadata is bounded (keys.MAX_META)
    here = holder.host == lease_ops.HOST
    carried = own and holder.token in orphans
    again = carried and holder.token in adopted  # adopted once: not again in this delivery (no spin)
    return HolderFacts(
        own_id=own,
        duplicate=holder.task_name == task.name and holder.digest == call.digest,
        alive=_holder_alive(task, holder, own) and not carried,
        dead_here=own and here and not again and not lease_ops.pid_alive(holder.pid),
        queued=own and holder.state in ("queued", "publishing"),
        # A wait after an ACQUIRE that errored carries that attempt's token: if the ACQUIRE ran after
        # all, this lease is its orphan. Adopting replaces the token, so a duplicated copy of the wait
        # message finds a fresh token and is dropped instead of running the body beside us.
        orphan=carried and not again,
        parent=not own and bool(req.parent_id) and holder.task_id == keys.meta(str(req.parent_id)),
    )


def holder_alive(task: Any, holder: Any, own: bool) -> bool:
    """:func:`_holder_alive` for a holder met elsewhere (CLAIM at publish: ``_lease.Claimed``, same fields)."""
    return _holder_alive(task, holder, own)


def _holder_alive(task: Any, holder: Holder, own: bool) -> bool:
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
    opts = task.lockguard_options
    if not opts.renew:
        return not own
    ttl_ms = getattr(holder, "ttl_ms", 0) or opts.ttl_ms
    return holder.ms_since_renewal < ttl_ms * 0.6


def _run_locked(
    task: Any,
    req: Any,
    s: Settings,
    opts: TaskOptions,
    call: CallNames,
    client: Any,
    lease: Lease,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the body under ``lease`` (renewed, on the request ``req`` as ``self.lock``); release it, recording, on
    every exit."""
    emit(
        "lock.acquired", task.name, lock_key=call.key, task_id=req.id, fence=lease.fence_field, **multi.set_fields(call)
    )
    if opts.slotted:
        rate = opts.rate.text if opts.rate is not None else None
        emit(
            "lock.admitted",
            task.name,
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
            task.name,
            lock_key=call.key,
            task_id=req.id,
            fence=lease.fence_field,
            replicas=lease.replicas,
            wanted=opts.replicas,
            **multi.set_fields(call),
        )
    request_state.hold(req, lease)
    request_state.enter(req, call)
    metrics.lease_held(lease, req.hostname or lease_ops.HOST)  # the held-now gauge: no Redis here
    if opts.renew:
        renewer().track(lease, client, opts.max_hold)
    done: CallNames | None = None
    result = None
    try:
        if opts.debounce is not None:
            replaced = debounce.start(task, s, opts, client, call.key)
            if replaced is not None:  # taken while waiting for the lease, then replaced: release unrun
                return replaced
        result = run_body(task, args, kwargs, req)
        done = call
        return result
    finally:
        metrics.lease_ended(lease)
        release_ops.release(task, s, opts, lease, done, result, later=not req.is_eager, client=client)


def _fail_open(
    task: Any,
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
    req = task.request
    reason = errors.describe(failure) if failure is not None else decision.reason
    emit("lock.fail_open", task.name, **event_fields(task, call), policy=opts.on_unavailable, reason=reason)
    store = records.store_for(task, s) if opts.completion else None
    try:
        if store is None or store.in_scripts:  # the records live in the Redis that is down
            return run_body(task, args, kwargs)
        record = records.lookup(task, store, call)
        if record is not None:
            return records.completed(task, call, record)
        request_state.enter(req, call)
        result = run_body(task, args, kwargs)
        records.record_elsewhere(task, store, call, req.id, *records.record_for(task, call, req.id, result))
        return result
    finally:
        if opts.mode == "until_done":  # one copy queued or running: the claim stands for us until the end
            release_ops.free_claim(task, s, opts, call, claim_token)
