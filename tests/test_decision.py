"""The decision table: every (mode, policy, outcome, holder) combination, no Redis, no Celery."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from celery_lockguard._decision import (
    FREES_CLAIM,
    MAX_FREE_RETRIES,
    Action,
    DebounceAction,
    Debounced,
    DebouncePublish,
    DebouncePublishAction,
    Delivery,
    HolderFacts,
    ParkedAction,
    Publish,
    PublishAction,
    after_park,
    decide_debounce_publish,
    decide_debounce_start,
    decide_debounced,
    decide_delivery,
    decide_parked,
    decide_publish,
    skips_duplicate,
)

MODES = ("while_running", "until_started", "until_done")
LOCKED = ("skip", "retry", "raise")
UNAVAILABLE = ("fail_closed", "fail_open")

OTHER_DUP_ALIVE = HolderFacts(own_id=False, duplicate=True, alive=True)
OTHER_DUP_DEAD = HolderFacts(own_id=False, duplicate=True, alive=False)
OTHER_DIFFERENT = HolderFacts(own_id=False, duplicate=False, alive=True)
OWN_ALIVE = HolderFacts(own_id=True, duplicate=True, alive=True)
OWN_DEAD_REMOTE = HolderFacts(own_id=True, duplicate=True, alive=False)
OWN_DEAD_HERE = HolderFacts(own_id=True, duplicate=True, alive=False, dead_here=True)
OWN_CLAIM = HolderFacts(own_id=True, duplicate=True, alive=True, queued=True)
OWN_ORPHAN = HolderFacts(own_id=True, duplicate=True, alive=True, orphan=True)
PARENT = HolderFacts(own_id=False, duplicate=True, alive=True, parent=True)


def d(outcome: str, holder: HolderFacts | None = None, **kw: object) -> Delivery:
    base = {"mode": "while_running", "on_locked": "skip", "on_unavailable": "fail_closed"}
    base.update(kw)
    return Delivery(outcome=outcome, holder=holder, **base)  # type: ignore[arg-type]


# (outcome, holder, overrides) -> expected action
TABLE = [
    ("acquired", None, {}, Action.RUN),
    ("record", None, {}, Action.ANSWER),
    ("record", None, {"watch_copy": True}, Action.DROP),
    ("misconfigured", None, {}, Action.MISCONFIGURED),
    ("unavailable", None, {}, Action.WAIT),
    ("unavailable", None, {"on_unavailable": "fail_open"}, Action.FAIL_OPEN),
    ("unavailable", None, {"waits": 100}, Action.GIVE_UP),
    ("late", None, {}, Action.WAIT),
    ("late", None, {"on_unavailable": "fail_open"}, Action.FAIL_OPEN),
    ("held", OTHER_DUP_ALIVE, {}, Action.SKIP),
    ("held", OTHER_DUP_ALIVE, {"mode": "until_done"}, Action.SKIP),
    ("held", OTHER_DUP_ALIVE, {"mode": "until_started"}, Action.WAIT),
    ("held", OTHER_DUP_ALIVE, {"on_locked": "retry"}, Action.WAIT),
    ("held", OTHER_DUP_ALIVE, {"on_locked": "raise"}, Action.RAISE),
    ("held", OTHER_DUP_DEAD, {}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {"on_locked": "raise"}, Action.RAISE),
    # Accepted means it runs: in a queue-time mode raise answered at publish; delivered, the copy waits.
    ("held", OTHER_DUP_ALIVE, {"on_locked": "raise", "mode": "until_started"}, Action.WAIT),
    ("held", OTHER_DUP_ALIVE, {"on_locked": "raise", "mode": "until_done"}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {"on_locked": "raise", "mode": "until_started"}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {"on_locked": "raise", "mode": "until_done"}, Action.WAIT),
    ("held", OTHER_DUP_DEAD, {"on_locked": "raise", "mode": "until_done"}, Action.WAIT),
    ("held", PARENT, {"on_locked": "raise", "mode": "until_started"}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {"on_locked": "raise", "mode": "until_done", "waits": 3, "max_waits": 3}, Action.GIVE_UP),
    ("held", OTHER_DIFFERENT, {"waits": 3, "max_waits": 3}, Action.GIVE_UP),
    ("held", OWN_ALIVE, {}, Action.DROP_AND_WATCH),
    ("held", OWN_ALIVE, {"on_locked": "raise"}, Action.DROP_AND_WATCH),
    ("held", OWN_DEAD_REMOTE, {}, Action.WAIT),
    ("held", OWN_DEAD_REMOTE, {"on_locked": "raise"}, Action.WAIT),
    ("held", OWN_DEAD_HERE, {}, Action.ADOPT),
    ("held", OWN_CLAIM, {"mode": "until_done"}, Action.ADOPT),
    ("held", OWN_ORPHAN, {}, Action.ADOPT),
    ("held", PARENT, {}, Action.WAIT),
    ("held", PARENT, {"on_locked": "raise"}, Action.RAISE),
    ("held", OWN_ORPHAN, {"on_locked": "raise", "waits": 100}, Action.ADOPT),
    # park and wake: only behind a live holder of other work, where the runtime can park
    ("held", OTHER_DIFFERENT, {"can_park": True}, Action.PARK),
    ("held", OTHER_DUP_ALIVE, {"can_park": True, "on_locked": "retry"}, Action.PARK),
    ("held", OTHER_DUP_ALIVE, {"can_park": True}, Action.SKIP),
    ("held", OTHER_DUP_DEAD, {"can_park": True}, Action.WAIT),
    ("held", PARENT, {"can_park": True}, Action.PARK),
    ("held", OTHER_DIFFERENT, {"can_park": True, "watch_copy": True}, Action.WAIT),
    ("held", OTHER_DIFFERENT, {"can_park": True, "waits": 3, "max_waits": 3}, Action.GIVE_UP),
    ("held", OTHER_DIFFERENT, {"can_park": True, "on_locked": "raise"}, Action.RAISE),
    ("held", OWN_DEAD_REMOTE, {"can_park": True}, Action.WAIT),
    ("held", OWN_ALIVE, {"can_park": True}, Action.DROP_AND_WATCH),
    ("unavailable", None, {"can_park": True}, Action.WAIT),
    ("late", None, {"can_park": True}, Action.WAIT),
    # lock_rate: the start window is full (no holder met: identical running work is met as a holder first)
    ("throttled", None, {}, Action.WAIT),
    ("throttled", None, {"on_locked": "retry"}, Action.WAIT),
    ("throttled", None, {"on_locked": "raise"}, Action.RAISE),
    ("throttled", None, {"waits": 3, "max_waits": 3}, Action.GIVE_UP),
    ("throttled", None, {"on_unavailable": "fail_open"}, Action.WAIT),  # throttled is not an outage
    ("throttled", None, {"can_park": True}, Action.WAIT),  # time frees a window, not a release: never parks
    ("throttled", None, {"watch_copy": True}, Action.WAIT),
]


@pytest.mark.parametrize(("outcome", "holder", "over", "expected"), TABLE)
def test_delivery_table(outcome: str, holder: HolderFacts | None, over: dict[str, object], expected: Action) -> None:
    assert decide_delivery(d(outcome, holder, **over)).action is expected


HOLDERS = [
    None,
    OTHER_DUP_ALIVE,
    OTHER_DUP_DEAD,
    OTHER_DIFFERENT,
    OWN_ALIVE,
    OWN_DEAD_REMOTE,
    OWN_DEAD_HERE,
    OWN_CLAIM,
    OWN_ORPHAN,
    PARENT,
]
OUTCOMES = ("acquired", "held", "record", "unavailable", "late", "misconfigured", "throttled")


def every_delivery() -> list[Delivery]:
    out = []
    for mode, locked, unavail, outcome, watch, waits, park in itertools.product(
        MODES, LOCKED, UNAVAILABLE, OUTCOMES, (False, True), (0, 5), (False, True)
    ):
        for holder in HOLDERS[1:] if outcome == "held" else [None]:
            out.append(
                Delivery(
                    mode=mode,  # type: ignore[arg-type]
                    on_locked=locked,  # type: ignore[arg-type]
                    on_unavailable=unavail,  # type: ignore[arg-type]
                    outcome=outcome,  # type: ignore[arg-type]
                    holder=holder,
                    watch_copy=watch,
                    waits=waits,
                    max_waits=5,
                    can_park=park,
                )
            )
    return out


def test_the_whole_space_keeps_the_promises() -> None:
    """Properties over every combination: nothing is dropped silently, nothing runs twice on purpose."""
    cases = every_delivery()
    assert len(cases) == 3 * 3 * 2 * 2 * 2 * 2 * (len(OUTCOMES) - 1 + len(HOLDERS) - 1)
    for case in cases:
        action = decide_delivery(case).action
        h = case.holder
        # Only identical work behind a live holder is ever skipped, only under skip, never in until_started.
        if action is Action.SKIP:
            assert h is not None and h.duplicate and h.alive and not h.own_id and not h.parent
            assert case.on_locked == "skip" and case.mode != "until_started"
        # Raise is the policy's own answer to a foreign holder, never to ourselves.
        if action is Action.RAISE:
            assert case.on_locked == "raise"
            assert (h is not None and not h.own_id) or case.outcome == "throttled"
        # Accepted means it runs: a queue-time mode answered raise at publish, so a delivery meeting a holder
        # never fails for it; it waits (within the budget), exactly as under retry.
        if case.mode != "while_running" and case.outcome == "held" and case.on_locked == "raise":
            assert action is not Action.RAISE
            assert action is decide_delivery(replace(case, on_locked="retry")).action
        # A full start window is never skipped, never run, never parked on: it waits, raises or gives up.
        if case.outcome == "throttled":
            assert action in (Action.WAIT, Action.RAISE, Action.GIVE_UP)
        # A wait is never past the budget; giving up is only at the budget.
        if action in (Action.WAIT, Action.PARK):
            assert case.waits < case.max_waits
        # Parking is only behind a live holder of other work (its release wakes us), where the runtime can park.
        if action is Action.PARK:
            assert case.can_park and not case.watch_copy and h is not None and h.alive and not h.own_id
        # Everything else is the same decision with or without parking.
        if case.can_park and action is not Action.PARK:
            assert decide_delivery(replace(case, can_park=False)).action is action
        if action is Action.GIVE_UP:
            assert case.waits >= case.max_waits
        # Running unlocked happens only under fail_open.
        if action is Action.FAIL_OPEN:
            assert case.on_unavailable == "fail_open" and case.outcome in ("unavailable", "late")
        # Dropping a message is only for ourselves: a running original, or a watch copy whose original finished.
        if action in (Action.DROP, Action.DROP_AND_WATCH):
            assert (h is not None and h.own_id and h.alive) or (case.watch_copy and case.outcome == "record")
        # Adopting is only ever taking over something of our own.
        if action is Action.ADOPT:
            assert h is not None and h.own_id and (h.queued or h.dead_here or h.orphan)
        # The decision is a function of the facts.
        assert decide_delivery(case) == decide_delivery(case)


def test_every_action_says_what_happens_to_the_claim() -> None:
    kept = set(Action) - FREES_CLAIM
    # RUN (adopted or freed by ACQUIRE), ADOPT (loops), WAIT (hands over), DROP_AND_WATCH (the original adopted it),
    # PARK (only without a claim: while_running).
    assert kept == {Action.RUN, Action.ADOPT, Action.WAIT, Action.DROP_AND_WATCH, Action.PARK}


def test_one_duplicate_rule_for_publish_and_delivery() -> None:
    for locked, dup, alive in itertools.product(LOCKED, (False, True), (False, True)):
        rule = skips_duplicate(locked, dup, alive)  # type: ignore[arg-type]
        held = HolderFacts(own_id=False, duplicate=dup, alive=alive)
        delivery = decide_delivery(d("held", held, on_locked=locked)).action is Action.SKIP
        publish = decide_publish(
            Publish(on_locked=locked, claim="held", duplicate=dup, holder_alive=alive)  # type: ignore[arg-type]
        ).action
        assert delivery == rule
        assert (publish is PublishAction.ANSWER_WITH_HOLDER) == rule


PUBLISH_TABLE = [
    (Publish("skip", self_republish=True), PublishAction.BYPASS),
    (Publish("skip", claim="held", duplicate=True, self_republish=True), PublishAction.BYPASS),
    # A delivery's copy of itself (republish.send) bypasses whoever publishes it (a releaser: a woken copy).
    (Publish("skip", own_copy=True), PublishAction.BYPASS),
    (Publish("raise", claim="held", duplicate=True, own_copy=True), PublishAction.BYPASS),
    (Publish("skip"), PublishAction.PUBLISH_CLAIMED),
    (Publish("skip", claim="ok"), PublishAction.PUBLISH_CLAIMED),
    (Publish("skip", claim="own"), PublishAction.PUBLISH),
    (Publish("skip", claim="unavailable"), PublishAction.PUBLISH),
    (Publish("skip", claim="misconfigured"), PublishAction.MISCONFIGURED),
    (Publish("skip", claim="held", duplicate=True), PublishAction.ANSWER_WITH_HOLDER),
    (Publish("skip", claim="held", duplicate=True, in_canvas=True), PublishAction.PUBLISH),
    (Publish("raise", claim="held", duplicate=True, in_canvas=True), PublishAction.PUBLISH),
    (Publish("skip", claim="held", duplicate=True, holder_alive=False), PublishAction.PUBLISH),
    (Publish("raise", claim="held", duplicate=True, holder_alive=False), PublishAction.PUBLISH),
    (Publish("skip", claim="held", duplicate=False), PublishAction.PUBLISH),
    (Publish("retry", claim="held", duplicate=True), PublishAction.PUBLISH),
    (Publish("raise", claim="held", duplicate=True), PublishAction.RAISE),
    (Publish("raise", claim="held", duplicate=False), PublishAction.PUBLISH),
    (Publish("skip", claim="held", duplicate=True, held_by_publisher=True), PublishAction.PUBLISH),
    (Publish("skip", claim="held", duplicate=True, holder_publishing=True), PublishAction.AWAIT),
    (Publish("raise", claim="held", duplicate=True, holder_publishing=True), PublishAction.AWAIT),
    (Publish("retry", claim="held", duplicate=True, holder_publishing=True), PublishAction.PUBLISH),
    (Publish("skip", claim="held", duplicate=False, holder_publishing=True), PublishAction.PUBLISH),
    (Publish("raise", claim="held", duplicate=True, held_by_publisher=True), PublishAction.PUBLISH),
]


@pytest.mark.parametrize(("facts", "expected"), PUBLISH_TABLE)
def test_publish_table(facts: Publish, expected: PublishAction) -> None:
    assert decide_publish(facts).action is expected


def test_held_needs_holder_facts() -> None:
    with pytest.raises(ValueError, match="holder facts"):
        decide_delivery(d("held", None))


# -- park and wake ---------------------------------------------------------------------------

AFTER_PARK = [
    ("parked", 0, "parked"),
    ("free", 0, "acquire_again"),
    ("free", MAX_FREE_RETRIES - 1, "acquire_again"),
    ("free", MAX_FREE_RETRIES, "back_off"),
    ("full", 0, "back_off"),
    ("unserializable", 0, "back_off"),
    ("unavailable", 0, "unconfirmed"),  # PARK may have run: its safety copy goes out all the same
]


@pytest.mark.parametrize(("answer", "free_retries", "expected"), AFTER_PARK)
def test_after_park_table(answer: str, free_retries: int, expected: str) -> None:
    assert after_park(answer, free_retries) == expected  # type: ignore[arg-type]


GRACE = 2000
# (copy, entry state, ms since waking) -> what the copy does
PARKED_TABLE = [
    ("woken", "waking", 5, ParkedAction.PROCEED),
    ("woken", "woken", 5, ParkedAction.PROCEED),
    ("woken", "running", 5, ParkedAction.PROCEED),  # a redelivered woken copy: the own-id rules decide
    ("woken", "missing", -1, ParkedAction.PROCEED),
    ("woken", "taken", 3000, ParkedAction.DROP),
    ("safety", "parked", -1, ParkedAction.PROCEED),
    ("safety", "missing", -1, ParkedAction.PROCEED),
    ("safety", "taken", 3000, ParkedAction.PROCEED),
    ("safety", "waking", 5, ParkedAction.AWAIT),
    ("safety", "waking", GRACE, ParkedAction.PROCEED),
    ("safety", "woken", 5, ParkedAction.DROP),
    ("safety", "running", 5, ParkedAction.DROP),
]


@pytest.mark.parametrize(("copy", "state", "age", "expected"), PARKED_TABLE)
def test_parked_copy_table(copy: str, state: str, age: int, expected: ParkedAction) -> None:
    assert decide_parked(copy, state, age, GRACE)[0] is expected  # type: ignore[arg-type]


STATES = ("parked", "waking", "woken", "running", "taken", "missing")


def test_exactly_one_copy_of_a_parked_message_runs() -> None:
    """For every state the entry can be in when the two copies look (in either order), exactly one proceeds.

    CHECK_PARKED moves the entry as it answers: the woken copy makes waking/woken ``running``, the safety
    copy makes a waking entry past the grace ``taken`` and removes the others. Whoever looks first decides.
    """

    def woken_moves(state: str) -> str:
        return "running" if state in ("waking", "woken") else state

    def safety_moves(state: str, age: int) -> str:
        if state == "waking":
            return "taken" if age >= GRACE else state
        return "missing"

    for state in ("waking", "woken"):
        for age in (0, GRACE):
            # woken copy first, then the safety copy
            first = decide_parked("woken", state, age, GRACE)[0]  # type: ignore[arg-type]
            second = decide_parked("safety", woken_moves(state), age, GRACE)[0]  # type: ignore[arg-type]
            assert [first, second].count(ParkedAction.PROCEED) == 1, (state, age, "woken first")
            # safety copy first (AWAIT means: it looks again later, the woken copy gets there meanwhile)
            first = decide_parked("safety", state, age, GRACE)[0]  # type: ignore[arg-type]
            if first is ParkedAction.AWAIT:
                continue
            second = decide_parked("woken", safety_moves(state, age), age, GRACE)[0]  # type: ignore[arg-type]
            assert [first, second].count(ParkedAction.PROCEED) == 1, (state, age, "safety first")
    for copy, state in itertools.product(("woken", "safety"), STATES):
        action, reason = decide_parked(copy, state, GRACE, GRACE)  # type: ignore[arg-type]
        assert reason and action in ParkedAction


# -- debounce --------------------------------------------------------------------------------------

DEBOUNCE_PUBLISH_TABLE = [
    (DebouncePublish(), DebouncePublishAction.RECORD),
    (DebouncePublish(record="recorded"), DebouncePublishAction.PUBLISH_DEBOUNCED),
    (DebouncePublish(record="unavailable"), DebouncePublishAction.PUBLISH_UNRECORDED),
    (DebouncePublish(record="misconfigured"), DebouncePublishAction.MISCONFIGURED),
    # Self-republishes (retry, replace, waits) and canvas members are never debounced, whatever Redis says.
    (DebouncePublish(self_republish=True), DebouncePublishAction.BYPASS),
    (DebouncePublish(self_republish=True, record="unavailable"), DebouncePublishAction.BYPASS),
    (DebouncePublish(in_canvas=True), DebouncePublishAction.BYPASS),
    (DebouncePublish(in_canvas=True, record="recorded"), DebouncePublishAction.BYPASS),
    # A woken copy is its parked delivery, still its burst's run: never a new publish (a new burst).
    (DebouncePublish(own_copy=True), DebouncePublishAction.BYPASS),
    (DebouncePublish(own_copy=True, record="recorded"), DebouncePublishAction.BYPASS),
]


@pytest.mark.parametrize(("facts", "expected"), DEBOUNCE_PUBLISH_TABLE)
def test_debounce_publish_table(facts: DebouncePublish, expected: DebouncePublishAction) -> None:
    assert decide_debounce_publish(facts).action is expected


DEBOUNCED_TABLE = [
    ("take", "fail_closed", 0, DebounceAction.PROCEED),
    ("taken", "fail_closed", 0, DebounceAction.PROCEED),
    ("missing", "fail_closed", 0, DebounceAction.PROCEED),
    ("superseded", "fail_closed", 0, DebounceAction.SUPERSEDED),
    ("superseded", "fail_open", 100, DebounceAction.SUPERSEDED),
    ("early", "fail_closed", 0, DebounceAction.WAIT_UNTIL_DUE),
    ("await", "fail_closed", 0, DebounceAction.AWAIT_PUBLISH),
    ("misconfigured", "fail_open", 0, DebounceAction.MISCONFIGURED),
    ("unavailable", "fail_open", 0, DebounceAction.FAIL_OPEN),
    ("unavailable", "fail_closed", 0, DebounceAction.WAIT),
    ("unavailable", "fail_closed", 99, DebounceAction.WAIT),
    ("unavailable", "fail_closed", 100, DebounceAction.GIVE_UP),
]


@pytest.mark.parametrize(("answer", "policy", "waits", "expected"), DEBOUNCED_TABLE)
def test_debounced_delivery_table(answer: str, policy: str, waits: int, expected: DebounceAction) -> None:
    facts = Debounced(answer=answer, on_unavailable=policy, waits=waits, max_waits=100)  # type: ignore[arg-type]
    assert decide_debounced(facts)[0] is expected


def test_a_debounced_message_is_consumed_unrun_only_when_superseded() -> None:
    """Never drop the only run: of every answer, only ``superseded`` (a later run exists) ends without a body."""
    answers = ("take", "taken", "early", "superseded", "await", "missing", "unavailable", "misconfigured")
    for answer, policy, waits in itertools.product(answers, UNAVAILABLE, (0, 100)):
        action, reason = decide_debounced(Debounced(answer, policy, waits, 100))  # type: ignore[arg-type]
        assert reason
        if action is DebounceAction.SUPERSEDED:
            assert answer == "superseded"
        if action is DebounceAction.GIVE_UP:  # visible (BackendUnavailable), only at the budget
            assert answer == "unavailable" and policy == "fail_closed" and waits >= 100
        if action is DebounceAction.FAIL_OPEN:
            assert policy == "fail_open"


@pytest.mark.parametrize("mode", MODES)
def test_a_debounced_delivery_waits_behind_identical_running_work_instead_of_skipping(mode: str) -> None:
    """A publish during the run is one more run after it: never skipped as the running one's duplicate."""
    for holder in (OTHER_DUP_ALIVE, OTHER_DUP_DEAD, OTHER_DIFFERENT):
        case = Delivery(mode, "skip", "fail_closed", "held", holder=holder, debounced=True)  # type: ignore[arg-type]
        assert decide_delivery(case).action is Action.WAIT
        assert decide_delivery(replace(case, can_park=True)).action in (Action.PARK, Action.WAIT)
    plain = Delivery("while_running", "skip", "fail_closed", "held", holder=OTHER_DUP_ALIVE)
    assert decide_delivery(plain).action is Action.SKIP


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("run", DebounceAction.PROCEED),
        ("superseded", DebounceAction.SUPERSEDED),
        ("await", DebounceAction.AWAIT_PUBLISH),
        ("unavailable", DebounceAction.PROCEED),  # the lease is held: run rather than lose the run
        ("misconfigured", DebounceAction.PROCEED),
    ],
)
def test_debounce_start_table(answer: str, expected: DebounceAction) -> None:
    action, reason = decide_debounce_start(answer)  # type: ignore[arg-type]
    assert action is expected and reason
