"""What a delivery or a publish does: one pure function each, no Redis, no Celery.

Every branch of the runtime used to be decided where it was carried out
(``__call__``, ``_contended``, ``_watch``, ``_wait``, ``apply_async``,
``retry``), under rules that drifted apart. Here the whole decision is a
function of plain facts, so a table test covers every combination and the
task class only carries the answer out:

* :func:`decide_delivery` — a delivered message, given what ACQUIRE (or the
  completion store, or an error) said.
* :func:`decide_publish` — ``apply_async`` in a queue-time mode, given what
  CLAIM said.
* :func:`after_park` and :func:`decide_parked` — park and wake (``_handoff``):
  what PARK's answer makes a waiting delivery do, and what a parked delivery's
  copy (safety or woken) does with the state of its waiter entry.
* :func:`decide_debounce_publish` and :func:`decide_debounced` — ``lock_debounce``
  (``_debounce``): what a publish records, and what a delivered message of a
  burst does with DEBOUNCE_TAKE's answer, before the lease is asked for.

Both read the same duplicate rule (:func:`skips_duplicate`): only identical
work is ever skipped, only behind a holder presumed alive, never with
``retry``; ``raise`` raises for any holder, at publish in a queue-time mode and
at delivery only in ``while_running`` (:func:`raises_when_delivered`).

What each exit does with what the delivery holds is written on the
:class:`Action` members; the task class must keep to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

LockMode = Literal["while_running", "until_started", "until_done"]
OnLocked = Literal["skip", "retry", "raise"]
OnUnavailable = Literal["fail_closed", "fail_open"]

#: What ACQUIRE (and the completion check around it) answered for a delivery.
#: ``late``: the lease came back after its own validity (a reply slower than the TTL).
#: ``throttled``: a slot was free but the entity's start window (``lock_rate``) is full.
Outcome = Literal["acquired", "held", "record", "unavailable", "late", "misconfigured", "throttled"]

#: What CLAIM answered at publish time.
ClaimOutcome = Literal["ok", "own", "held", "unavailable", "misconfigured"]


class Action(enum.Enum):
    """What a delivery does. Every member says what happens to the delivery's queue claim."""

    #: Run the body under the lease; the claim was freed (until_started) or adopted (until_done) by ACQUIRE.
    RUN = "run"
    #: ACQUIRE again, replacing the holder's token: our own queue claim, our own orphan lease (an ACQUIRE that
    #: errored but ran), or a dead child of ours on this host.
    ADOPT = "adopt"
    #: Identical work is running: return ``None`` now. Frees the claim.
    SKIP = "skip"
    #: The completion record exists: return the recorded result. Frees the claim.
    ANSWER = "answer"
    #: A watch copy whose original finished: consume it without storing anything. Frees the claim.
    DROP = "drop"
    #: A redelivery of our own running original: consume it, leave one delayed watch copy behind.
    DROP_AND_WATCH = "drop_and_watch"
    #: Re-deliver later (a self-republish, never deduplicated); the claim travels with the message.
    WAIT = "wait"
    #: Wait behind a live foreign holder in the entity's waiter queue: its release wakes us (``_handoff``);
    #: one safety copy is published. Only where parking is possible (``Delivery.can_park``: while_running,
    #: no claim, not eager, not a watch copy); PARK's answer may still fall back on WAIT (:func:`after_park`).
    PARK = "park"
    #: The wait budget is spent: fail visibly (``LockContended`` or ``BackendUnavailable``). Frees the claim.
    GIVE_UP = "give_up"
    #: ``on_locked="raise"``: fail visibly with ``LockContended``. Frees the claim.
    RAISE = "raise"
    #: Redis (or the completion store) is unavailable and the task runs anyway, unlocked. Frees the claim.
    FAIL_OPEN = "fail_open"
    #: The server refused us for a reason retrying cannot fix (NOPERM, CROSSSLOT): ``ConfigurationError``.
    MISCONFIGURED = "misconfigured"


#: Actions after which the message is consumed and the claim must not outlive it.
FREES_CLAIM = frozenset(
    {Action.SKIP, Action.ANSWER, Action.DROP, Action.GIVE_UP, Action.RAISE, Action.FAIL_OPEN, Action.MISCONFIGURED}
)


@dataclass(frozen=True)
class HolderFacts:
    """What a contender knows of the holder it met (from the ACQUIRE reply and this host)."""

    #: The holder carries this delivery's task id (a redelivery, retry or wait of ourselves).
    own_id: bool
    #: Same task name and same arguments digest: identical work.
    duplicate: bool
    #: Presumed alive: on this host its pid exists; elsewhere its lease is still being renewed.
    alive: bool
    #: Our own id, on this host, and its process is gone: a killed child of ours.
    dead_here: bool = False
    #: A queue-time claim (state ``queued``), not a running lease.
    queued: bool = False
    #: Our own id, carrying the token of an ACQUIRE of ours that errored but ran on the server.
    orphan: bool = False
    #: The holder published this delivery (its ``parent_id``): a task scheduling its own follow-up.
    parent: bool = False


@dataclass(frozen=True)
class Delivery:
    """The facts a delivered message is decided on."""

    mode: LockMode
    on_locked: OnLocked
    on_unavailable: OnUnavailable
    outcome: Outcome
    holder: HolderFacts | None = None
    #: This message is a watch copy left behind by a dropped redelivery.
    watch_copy: bool = False
    #: Waits already spent (message header) and the budget (``lock_max_waits``).
    waits: int = 0
    max_waits: int = 100
    #: The runtime can park this delivery: while_running, no queue claim, not eager, not a watch copy.
    can_park: bool = False
    #: The task debounces (``lock_debounce``): a publish during a run is one more run after it, never a
    #: duplicate to skip.
    debounced: bool = False


@dataclass(frozen=True)
class Decision:
    """What to do, and the reason carried into the log event."""

    action: Action
    reason: str


def skips_duplicate(on_locked: OnLocked, duplicate: bool, alive: bool) -> bool:
    """The one duplicate rule: skip only identical work, only behind a holder presumed alive, only with skip.

    A dead holder's work may never finish (a child killed without
    ``acks_late``): skipping behind it could lose the job, so the copy waits.
    """
    return on_locked == "skip" and duplicate and alive


def raises_when_delivered(mode: LockMode, on_locked: OnLocked) -> bool:
    """Whether a delivery that meets a holder fails with ``LockContended`` instead of waiting.

    Only in ``while_running``, which has no publish-time check. In a queue-time mode ``raise`` is
    answered at publish (``AlreadyQueued``); a publish that returned was accepted, and accepted means
    it runs: meeting a holder when delivered (the work it was accepted behind, different work on the
    entity, a publish made during an outage or by ``send_task``) it waits like ``retry``, within
    ``lock_max_waits``.
    """
    return on_locked == "raise" and mode == "while_running"


#: The decision for every delivery whose ACQUIRE took the lease (``outcome="acquired"``), whatever the other
#: facts: the runtime uses it without building the facts on that path (the one every locked task takes).
RUN_ACQUIRED = Decision(Action.RUN, "acquired")


def decide_delivery(d: Delivery) -> Decision:
    """Decide what a delivered message does (see :class:`Action`)."""
    if d.outcome == "acquired":
        return RUN_ACQUIRED
    if d.outcome == "record":
        if d.watch_copy:
            return Decision(Action.DROP, "original_completed")
        return Decision(Action.ANSWER, "completion_record")
    if d.outcome == "misconfigured":
        return Decision(Action.MISCONFIGURED, "server_refused")
    if d.outcome in ("unavailable", "late"):
        reason = "backend_unavailable" if d.outcome == "unavailable" else "acquire_slower_than_ttl"
        if d.on_unavailable == "fail_open":
            return Decision(Action.FAIL_OPEN, reason)
        return _wait(d, reason)
    if d.outcome == "throttled":
        return _throttled(d)
    h = d.holder
    if h is None:
        raise ValueError("outcome 'held' needs holder facts")
    if h.own_id:
        if h.queued or h.dead_here or h.orphan:
            reason = (
                "adopting_own_claim"
                if h.queued
                else "adopting_own_orphan"
                if h.orphan
                else "taking_over_dead_holder_of_own_id"
            )
            return Decision(Action.ADOPT, reason)
        if h.alive:
            return Decision(Action.DROP_AND_WATCH, "redelivery_of_running_original")
        return _wait(d, "holder_of_own_id_dead")
    if raises_when_delivered(d.mode, d.on_locked):
        return Decision(Action.RAISE, "locked")
    # A follow-up the holder published of itself (a poll loop) is new work, never a duplicate of its parent.
    if h.parent:
        return _wait(d, "follow_up_waits_for_parent")
    # until_started, and debounce: a copy published after the holder started is kept and runs after it.
    if d.mode != "until_started" and not d.debounced and skips_duplicate(d.on_locked, h.duplicate, h.alive):
        return Decision(Action.SKIP, "identical_work_running")
    if h.duplicate:
        return _wait(d, "duplicate_waits" if h.alive else "duplicate_of_dead_holder")
    return _wait(d, "different_work_on_entity")


def _throttled(d: Delivery) -> Decision:
    """The start window is full (``lock_rate``); no holder was met, so nothing is a duplicate.

    ``raise`` fails visibly (``LockThrottled``); ``skip`` and ``retry`` wait for the window, since
    ``skip`` drops only identical work, and identical work running would have been met as a holder
    (ACQUIRE_SLOTS reports it before it looks at the window). A rate wait never parks: no release
    frees a window, time does, so the back-off countdown is the window's own.
    """
    if d.on_locked == "raise":
        return Decision(Action.RAISE, "rate_limited")
    return _wait(d, "rate_limited")


def _wait(d: Delivery, reason: str) -> Decision:
    if d.waits >= d.max_waits:
        return Decision(Action.GIVE_UP, reason)
    h = d.holder
    # Park only behind a live holder of other work: its release is what wakes us. A dead holder, a holder of
    # our own id and an outage never release: there the back-off is the wait.
    if d.can_park and not d.watch_copy and h is not None and h.alive and not h.own_id:
        return Decision(Action.PARK, reason)
    return Decision(Action.WAIT, reason)


#: What PARK answered: parked (safety copy to publish), the lease was already gone, the queue is full; or
#: the runtime could not park: arguments that are not JSON, an error at PARK.
ParkAnswer = Literal["parked", "free", "full", "unserializable", "unavailable"]
#: What the delivery does next: publish the safety copy and end (``Retry``), ACQUIRE again at once, or back off.
#: ``unconfirmed``: PARK's reply was lost (an error, not an answer), so it may have run (a frozen server runs
#: what it read on thaw): publish the safety copy all the same, due when a wait would be. If PARK ran, that
#: copy settles with the entry (it and a woken copy never both run); if not, it adopts what the park token holds.
AfterPark = Literal["parked", "unconfirmed", "acquire_again", "back_off"]

#: ``free`` answers in a row after which a delivery backs off instead (a lease flickering between holders).
MAX_FREE_RETRIES = 3


def after_park(answer: ParkAnswer, free_retries: int) -> AfterPark:
    """What a delivery decided to PARK does with PARK's answer (``free_retries``: ``free`` answers so far)."""
    if answer == "parked":
        return "parked"
    if answer == "unavailable":
        return "unconfirmed"
    if answer == "free" and free_retries < MAX_FREE_RETRIES:
        return "acquire_again"
    return "back_off"


#: A parked delivery's copy: the ``woken`` one its releaser published, or its own ``safety`` copy.
ParkedCopy = Literal["woken", "safety"]
#: The waiter entry's state as CHECK_PARKED found it (``missing``: gone, expired or dropped as stale).
EntryState = Literal["parked", "waking", "woken", "running", "taken", "missing"]


class ParkedAction(enum.Enum):
    """What a copy of a parked delivery does once CHECK_PARKED has read (and moved) its entry."""

    #: Decide as any delivery, ACQUIRE adopting the reservation carrying the park token if it is still there.
    PROCEED = "proceed"
    #: Consume the message with ``Ignore`` (no state stored): the other copy of this message runs the job.
    DROP = "drop"
    #: The releaser is publishing the woken copy (``waking`` within the grace): look again shortly.
    AWAIT = "await"


def decide_parked(copy: ParkedCopy, state: EntryState, waking_ms: int, grace_ms: int) -> tuple[ParkedAction, str]:
    """One rule for both copies of a parked message; CHECK_PARKED writes the matching state change.

    The woken copy runs unless its safety copy took over (``taken``); the safety copy drops itself
    once the woken copy is out (``woken``, ``running``), waits out the grace while the releaser
    publishes (``waking``), takes over past it (the releaser died), and decides afresh when its entry
    is still ``parked`` (no release came within a whole TTL; it may park again) or gone.
    """
    if copy == "woken":
        if state == "taken":
            return ParkedAction.DROP, "safety_copy_took_over"
        return ParkedAction.PROCEED, "woken" if state in ("waking", "woken") else f"woken_entry_{state}"
    if state in ("woken", "running"):
        return ParkedAction.DROP, "woken_copy_runs"
    if state == "waking":
        if waking_ms < grace_ms:
            return ParkedAction.AWAIT, "releaser_publishing"
        return ParkedAction.PROCEED, "releaser_lost"
    return ParkedAction.PROCEED, "still_parked" if state == "parked" else f"safety_entry_{state}"


class PublishAction(enum.Enum):
    """What ``apply_async`` does in a queue-time mode."""

    #: Publish without asking CLAIM: a self-republish (wait, watch, retry, replace) carries its own claim.
    BYPASS = "bypass"
    #: Publish carrying the claim just taken (its token in a header). A failed publish frees it.
    PUBLISH_CLAIMED = "publish_claimed"
    #: Publish without a claim: different work, a canvas member, the task's own id, or Redis unavailable.
    PUBLISH = "publish"
    #: Identical work is queued (or running, until_done): return the holder's ``AsyncResult``.
    ANSWER_WITH_HOLDER = "answer_with_holder"
    #: Identical work is queued and the policy is raise: ``AlreadyQueued``.
    RAISE = "raise"
    #: The server refused CLAIM for a reason retrying cannot fix.
    MISCONFIGURED = "misconfigured"
    #: Identical work's claim is still ``publishing``: wait for it to be confirmed or freed, then ask again.
    AWAIT = "await"


@dataclass(frozen=True)
class Publish:
    """The facts a queue-time publish is decided on."""

    on_locked: OnLocked
    claim: ClaimOutcome | None = None
    #: The holder of the claim does identical work.
    duplicate: bool = False
    #: The holder is presumed alive: a queued claim is (its message is in the broker); a running lease if renewed.
    holder_alive: bool = True
    #: The message republishes the task that is publishing it (same task id): ``replace()``, or a body
    #: publishing its own id.
    self_republish: bool = False
    #: The message is a delivery's copy of itself sent through ``_republish.send`` (a wait, a safety,
    #: woken or watch copy, a retry), whoever publishes it: a releaser publishes its waiter's woken copy.
    own_copy: bool = False
    #: The message belongs to a chain, group or chord (a skip would stall the canvas).
    in_canvas: bool = False
    #: The claim is held by the publishing task itself (a running task scheduling its own follow-up).
    held_by_publisher: bool = False
    #: The holder's message is still being published (claim state ``publishing``): it may never exist.
    holder_publishing: bool = False


@dataclass(frozen=True)
class PublishDecision:
    """What to do at publish, and the reason carried into the log event."""

    action: PublishAction
    reason: str


def decide_publish(p: Publish) -> PublishDecision:
    """Decide what a queue-time publish does (see :class:`PublishAction`); call first with ``claim=None``.

    With ``claim=None`` the answer is either :attr:`PublishAction.BYPASS` or
    ``PUBLISH_CLAIMED`` meaning "ask CLAIM, then decide again with its answer".
    """
    if p.own_copy:
        return PublishDecision(PublishAction.BYPASS, "own_copy")
    if p.self_republish:
        return PublishDecision(PublishAction.BYPASS, "self_republish")
    if p.claim is None or p.claim == "ok":
        return PublishDecision(PublishAction.PUBLISH_CLAIMED, "claimed")
    if p.claim == "misconfigured":
        return PublishDecision(PublishAction.MISCONFIGURED, "server_refused")
    if p.claim == "unavailable":
        return PublishDecision(PublishAction.PUBLISH, "publish_without_claim")
    if p.claim == "own":
        return PublishDecision(PublishAction.PUBLISH, "own_claim")
    if p.in_canvas:
        return PublishDecision(PublishAction.PUBLISH, "canvas_member")
    if p.held_by_publisher:
        return PublishDecision(PublishAction.PUBLISH, "held_by_publisher")
    if p.duplicate and p.holder_publishing and p.on_locked != "retry":
        # Answering now could hand the caller the result of a message whose publish then fails.
        return PublishDecision(PublishAction.AWAIT, "holder_publishing")
    if p.duplicate and p.on_locked == "raise" and p.holder_alive:
        return PublishDecision(PublishAction.RAISE, "identical_work_queued")
    if skips_duplicate(p.on_locked, p.duplicate, p.holder_alive):
        return PublishDecision(PublishAction.ANSWER_WITH_HOLDER, "identical_work_queued")
    return PublishDecision(PublishAction.PUBLISH, "holder_not_alive" if p.duplicate else "different_work_on_entity")


#: What WORKFLOW_ENTER answered for a member of a workflow (``_workflow``), or the error kind met.
#: ``started``: a first member took the free lease; ``entered``: the lease was handed to this member;
#: ``self``: a delivery of this very member runs under it; ``passed``: the workflow is at another member;
#: ``held``: another holder has the entity; ``lost``: no lease, and this member is not the first;
#: ``ended``: the workflow already ended (this delivery is a stale copy, e.g. a broker redelivery).
MemberEntry = Literal["started", "entered", "self", "passed", "ended", "held", "lost", "unavailable", "misconfigured"]


class MemberAction(enum.Enum):
    """What a workflow member's delivery does. The lease it runs under is the workflow's, not its own."""

    #: Run the body under the workflow lease ("holder is my workflow"): renew it, hand it on or release it.
    RUN = "run"
    #: Enter again taking over a delivery of this member that died (fresh token, new fence), then run.
    ADOPT = "adopt"
    #: Consume the message storing nothing (``Ignore``): a copy of this member runs, or the workflow moved on.
    DROP = "drop"
    #: The first member met an identical workflow running: skip the whole workflow (its members answer ``None``).
    SKIP_WORKFLOW = "skip_workflow"
    #: Re-deliver this member later with its place in the chain (a self-republish); budget ``max_waits``.
    WAIT = "wait"
    #: ``on_locked="raise"`` at the first member: ``LockContended``; the chain stops.
    RAISE = "raise"
    #: The wait budget is spent: ``LockContended`` or ``BackendUnavailable``; the chain stops.
    GIVE_UP = "give_up"
    #: A later member found the lease gone or held by another: ``LockLost``; the chain stops.
    LOST = "lost"
    #: Redis is unavailable and the workflow's policy is ``fail_open``: run this member unlocked.
    FAIL_OPEN = "fail_open"
    #: The server refused the script for a reason retrying cannot fix: ``ConfigurationError``.
    MISCONFIGURED = "misconfigured"


@dataclass(frozen=True)
class Member:
    """The facts a workflow member's delivery is decided on."""

    entry: MemberEntry
    #: This member is the workflow's first: it starts the workflow when the lease is free.
    first: bool
    on_locked: OnLocked
    on_unavailable: OnUnavailable
    #: ``held``: the other holder; ``self``: the running delivery of this member (``own_id``).
    holder: HolderFacts | None = None
    waits: int = 0
    max_waits: int = 100


#: How a first member's contention maps onto a member's actions (the rules of :func:`decide_delivery`).
_CONTENDED = {
    Action.SKIP: MemberAction.SKIP_WORKFLOW,
    Action.WAIT: MemberAction.WAIT,
    Action.PARK: MemberAction.WAIT,
    Action.RAISE: MemberAction.RAISE,
    Action.GIVE_UP: MemberAction.GIVE_UP,
    Action.FAIL_OPEN: MemberAction.FAIL_OPEN,
    Action.MISCONFIGURED: MemberAction.MISCONFIGURED,
}


def decide_member(m: Member) -> MemberDecision:
    """Decide what a workflow member's delivery does (see :class:`MemberAction`).

    A member whose workflow holds the entity runs: that is the one new fact a workflow adds. The
    first member contends like any delivery (identical workflow skipped behind a live holder,
    different work waits, ``raise`` raises), by :func:`decide_delivery`'s rules; a later member never
    contends: finding anyone else (or no one) on the entity means the workflow lost its lease
    (a gap longer than its TTL), and running on would interleave with the work that came between.
    """
    if m.entry in ("started", "entered"):
        return MemberDecision(MemberAction.RUN, "holder_is_my_workflow" if m.entry == "entered" else "workflow_started")
    if m.entry == "passed":
        return MemberDecision(MemberAction.DROP, "workflow_moved_on")
    if m.entry == "ended":
        return MemberDecision(MemberAction.DROP, "workflow_ended")
    if m.entry == "self":
        h = m.holder
        if h is None:
            raise ValueError("entry 'self' needs holder facts")
        if h.dead_here or not h.alive:
            return MemberDecision(MemberAction.ADOPT, "taking_over_dead_member")
        return MemberDecision(MemberAction.DROP, "member_already_running")
    if m.entry == "lost" or (m.entry == "held" and not m.first):
        return MemberDecision(MemberAction.LOST, "workflow_lease_gone" if m.entry == "lost" else "entity_taken")
    outcome: Outcome = "held" if m.entry == "held" else "misconfigured" if m.entry == "misconfigured" else "unavailable"
    d = decide_delivery(
        Delivery(
            mode="while_running",
            on_locked=m.on_locked,
            on_unavailable=m.on_unavailable,
            outcome=outcome,
            holder=m.holder,
            waits=m.waits,
            max_waits=m.max_waits,
        )
    )
    return MemberDecision(_CONTENDED[d.action], d.reason)


@dataclass(frozen=True)
class MemberDecision:
    """What a workflow member does, and the reason carried into the log event."""

    action: MemberAction
    reason: str


# -- debounce ---------------------------------------------------------------------------------------

#: What DEBOUNCE_PUBLISH answered (``None``: not asked yet), or the error kind that stopped it.
DebounceRecord = Literal["recorded", "unavailable", "misconfigured"]


class DebouncePublishAction(enum.Enum):
    """What ``apply_async`` of a debounced task does."""

    #: Publish as is, no record: a self-republish (retry, replace, a wait) or a canvas member, never debounced.
    BYPASS = "bypass"
    #: Ask DEBOUNCE_PUBLISH to make this message the entity's latest pending run, then decide again.
    RECORD = "record"
    #: Publish after the debounce delay, carrying the burst in a header; then settle the record.
    PUBLISH_DEBOUNCED = "publish_debounced"
    #: Redis is unavailable: publish after the delay without a record (logged). It is never superseded,
    #: so an outage costs extra runs, never a lost one; at delivery the lease follows ``on_unavailable``.
    PUBLISH_UNRECORDED = "publish_unrecorded"
    #: The server refused DEBOUNCE_PUBLISH for a reason retrying cannot fix: ``ConfigurationError``.
    MISCONFIGURED = "misconfigured"


@dataclass(frozen=True)
class DebouncePublish:
    """The facts a publish of a debounced task is decided on."""

    #: The message republishes the task that is publishing it (same task id).
    self_republish: bool = False
    #: The message belongs to a chain, group or chord (superseding a member would change the canvas' data).
    in_canvas: bool = False
    record: DebounceRecord | None = None
    #: A delivery's copy of itself sent through ``_republish.send`` (see :class:`Publish`): a woken copy is
    #: its parked delivery, still its burst's run, never a new publish (a new burst would replace the
    #: publishes made while it waited, and start a full delay late).
    own_copy: bool = False


def decide_debounce_publish(p: DebouncePublish) -> DebouncePublishDecision:
    """Decide a debounced publish; call first with ``record=None`` (answer: ``BYPASS`` or ``RECORD``)."""
    if p.own_copy:
        return DebouncePublishDecision(DebouncePublishAction.BYPASS, "own_copy")
    if p.self_republish:
        return DebouncePublishDecision(DebouncePublishAction.BYPASS, "self_republish")
    if p.in_canvas:
        return DebouncePublishDecision(DebouncePublishAction.BYPASS, "canvas_member")
    if p.record is None:
        return DebouncePublishDecision(DebouncePublishAction.RECORD, "debounce")
    if p.record == "recorded":
        return DebouncePublishDecision(DebouncePublishAction.PUBLISH_DEBOUNCED, "recorded")
    if p.record == "misconfigured":
        return DebouncePublishDecision(DebouncePublishAction.MISCONFIGURED, "server_refused")
    return DebouncePublishDecision(DebouncePublishAction.PUBLISH_UNRECORDED, "publish_without_debounce_record")


@dataclass(frozen=True)
class DebouncePublishDecision:
    """What a debounced publish does, and the reason carried into the log event."""

    action: DebouncePublishAction
    reason: str


#: What DEBOUNCE_TAKE answered for a delivered message of a burst, or the error kind that stopped it.
TakeAnswer = Literal["take", "taken", "early", "superseded", "await", "missing", "unavailable", "misconfigured"]


class DebounceAction(enum.Enum):
    """What a delivered message of a debounce burst does before it asks for the lease."""

    #: Go on as any delivery (ACQUIRE; a running holder is waited for, never skipped as a duplicate).
    PROCEED = "proceed"
    #: A later publish replaced this one: consume it without running; the result names the burst's run.
    SUPERSEDED = "superseded"
    #: This is the pending run, but not due yet: wait the rest of the delay (in process when short, else a
    #: self-republish with the remaining countdown), then ask again.
    WAIT_UNTIL_DUE = "wait_until_due"
    #: The publish that replaced this one is still in flight: ask again shortly (it may fail and hand back).
    AWAIT_PUBLISH = "await_publish"
    #: Redis is unavailable and the policy is ``fail_open``: go on as any delivery, undebounced (logged).
    FAIL_OPEN = "fail_open"
    #: Redis is unavailable and the policy is ``fail_closed``: re-deliver later (``lock_max_waits``).
    WAIT = "wait"
    #: The wait budget is spent: fail visibly with ``BackendUnavailable``.
    GIVE_UP = "give_up"
    #: The server refused DEBOUNCE_TAKE for a reason retrying cannot fix: ``ConfigurationError``.
    MISCONFIGURED = "misconfigured"


@dataclass(frozen=True)
class Debounced:
    """The facts a delivered message of a debounce burst is decided on."""

    answer: TakeAnswer
    on_unavailable: OnUnavailable
    waits: int = 0
    max_waits: int = 100


def decide_debounced(d: Debounced) -> tuple[DebounceAction, str]:
    """Decide what a delivered message of a burst does with DEBOUNCE_TAKE's answer.

    ``missing`` proceeds: without its record a message cannot tell whether it was superseded, and a
    duplicate run is harmless where a lost one is not (the completion record and fences still hold).
    """
    a = d.answer
    if a == "take":
        return DebounceAction.PROCEED, "burst_run_due"
    if a == "taken":
        return DebounceAction.PROCEED, "burst_run_redelivered"
    if a == "missing":
        return DebounceAction.PROCEED, "debounce_record_missing"
    if a == "superseded":
        return DebounceAction.SUPERSEDED, "superseded_by_later_publish"
    if a == "early":
        return DebounceAction.WAIT_UNTIL_DUE, "not_due"
    if a == "await":
        return DebounceAction.AWAIT_PUBLISH, "replacing_publish_in_flight"
    if a == "misconfigured":
        return DebounceAction.MISCONFIGURED, "server_refused"
    if d.on_unavailable == "fail_open":
        return DebounceAction.FAIL_OPEN, "backend_unavailable"
    if d.waits >= d.max_waits:
        return DebounceAction.GIVE_UP, "backend_unavailable"
    return DebounceAction.WAIT, "backend_unavailable"


#: What DEBOUNCE_START answered for a burst's run that holds the lease, or the error kind that stopped it.
StartAnswer = Literal["run", "superseded", "await", "unavailable", "misconfigured"]


def decide_debounce_start(answer: StartAnswer) -> tuple[DebounceAction, str]:
    """Decide what a burst's run that holds the lease does before its body starts.

    A run taken while a body of the entity still ran waited for the lease: it never started, so a
    publish since then replaced it (``SUPERSEDED``: release, do not run). Redis failing here runs the
    body: the lease is held, and a run too many is harmless where a lost one is not.
    """
    if answer == "superseded":
        return DebounceAction.SUPERSEDED, "superseded_while_waiting_for_the_lease"
    if answer == "await":
        return DebounceAction.AWAIT_PUBLISH, "replacing_publish_in_flight"
    if answer == "run":
        return DebounceAction.PROCEED, "burst_run_starts"
    return DebounceAction.PROCEED, "debounce_start_unanswered"
