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

Both read the same duplicate rule (:func:`skips_duplicate`): only identical
work is ever skipped, only behind a holder presumed alive, never with
``retry``; ``raise`` raises for any holder.

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
Outcome = Literal["acquired", "held", "record", "unavailable", "late", "misconfigured"]

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


def decide_delivery(d: Delivery) -> Decision:
    """Decide what a delivered message does (see :class:`Action`)."""
    if d.outcome == "acquired":
        return Decision(Action.RUN, "acquired")
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
    if d.on_locked == "raise":
        return Decision(Action.RAISE, "locked")
    # A follow-up the holder published of itself (a poll loop) is new work, never a duplicate of its parent.
    if h.parent:
        return _wait(d, "follow_up_waits_for_parent")
    # until_started: a copy published after the holder started is kept and runs after it, never skipped.
    if d.mode != "until_started" and skips_duplicate(d.on_locked, h.duplicate, h.alive):
        return Decision(Action.SKIP, "identical_work_running")
    if h.duplicate:
        return _wait(d, "duplicate_waits" if h.alive else "duplicate_of_dead_holder")
    return _wait(d, "different_work_on_entity")


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
AfterPark = Literal["parked", "acquire_again", "back_off"]

#: ``free`` answers in a row after which a delivery backs off instead (a lease flickering between holders).
MAX_FREE_RETRIES = 3


def after_park(answer: ParkAnswer, free_retries: int) -> AfterPark:
    """What a delivery decided to PARK does with PARK's answer (``free_retries``: ``free`` answers so far)."""
    if answer == "parked":
        return "parked"
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
    #: The message republishes the task that is publishing it (same task id): wait, watch, retry, replace.
    self_republish: bool = False
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
    if p.duplicate and p.on_locked == "raise":
        return PublishDecision(PublishAction.RAISE, "identical_work_queued")
    if skips_duplicate(p.on_locked, p.duplicate, p.holder_alive):
        return PublishDecision(PublishAction.ANSWER_WITH_HOLDER, "identical_work_queued")
    return PublishDecision(PublishAction.PUBLISH, "holder_not_alive" if p.duplicate else "different_work_on_entity")
