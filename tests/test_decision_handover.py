"""DESIGN, "a hand-over covers its countdown", as a table: no Redis, no Celery.

Every lease, claim, debounce record or waiter entry a delivery hands to a delayed message of itself
lasts at least that message's countdown plus the publish grace (``_claims.PUBLISH_GRACE``): a wait
copy, a park's safety copy, a ``retry()`` message (an ``until_done`` claim, a burst's records, a
workflow member's or a chord page's lease), a workflow member's wait copy, a debounced publish.
Shorter, the copy comes back to nothing: the claim gone (identical work queued twice), the burst's
records gone (older arguments run last), the workflow lease gone (``LockLost``, or other work in
the middle of the chain).

Each row names the hand-over, where its countdown comes from (``countdown``, ``eta``, Celery's
``default_retry_delay``, none) and the sizes around it (``queue_lock_ttl``, the transport's
``visibility_timeout``, the workflow's ``gap_ttl``), and asserts the TTL the runtime's own function
computes for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from celery_lockguard import _claims as claims
from celery_lockguard import _debounce as debounce
from celery_lockguard import _handoff as handoff
from celery_lockguard import _republish as republish
from celery_lockguard import _workflow as workflow

GRACE_MS = int(claims.PUBLISH_GRACE * 1000)
#: Slack for an ``eta`` row: the clock moves between building the eta and reading it.
ETA_SLACK_MS = 1000

QUEUE_LOCK_TTLS = (1.0, 5.0, 60.0, 3600.0)
VISIBILITY_TIMEOUTS = (2.0, 30.0, 3600.0)
GAP_TTLS = (1.0, 3.0, 60.0)
#: Where a delayed message's countdown comes from: (countdown, eta in seconds from now, default_retry_delay).
SOURCES: dict[str, tuple[float | None, float | None, float | None]] = {
    "countdown": (7.0, None, 180.0),
    "long_countdown": (200.0, None, 180.0),
    "eta": (None, 40.0, 180.0),
    "default_retry_delay": (None, None, 180.0),
    "none": (None, None, None),
}


def _eta(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.now(timezone.utc) + timedelta(seconds=seconds)


def _retry_delay(source: str) -> float:
    countdown, eta, default = SOURCES[source]
    return claims.retry_due_in(default, countdown, _eta(eta))


def _publish_delay(source: str, debounce_s: float = 0.5) -> float:
    """A debounced publish waits its ``lock_debounce``, or a longer countdown/eta the caller asked for."""
    countdown, eta, _ = SOURCES[source]
    return max(debounce_s, claims.due_in(countdown, _eta(eta)))


def _settings(vis: float) -> Any:
    return SimpleNamespace(visibility_timeout=vis)


def _opts(qlt: float) -> Any:
    return SimpleNamespace(queue_lock_ttl=qlt)


# Each hand-over kind: (the delayed message's countdown in seconds, the TTL in ms the runtime gives what it hands
# over), for a source and sizes. The TTL is computed by the function the runtime calls at that site.
Row = Callable[[str, float, float, float], tuple[float, int]]


def retry_until_done_claim(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    delay = _retry_delay(source)
    return delay, claims.retry_claim_ttl_ms(qlt, delay)


def retry_debounce_records(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    delay = _retry_delay(source)
    return delay, debounce.record_ttl_ms(_settings(vis), _opts(qlt), delay)


def retry_workflow_member(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    delay = _retry_delay(source)
    return delay, workflow.gap_ms_for(int(gap * 1000), workflow.covering_ms(delay))


# A chord page's retry leaves its slot through WORKFLOW_LEAVE with the same gap as a chain member's WORKFLOW_PASS.
retry_chord_page = retry_workflow_member


def wait_claim(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    """A wait copy's countdown is its own (never the caller's), at most ``max_countdown``: the longest one."""
    longest = republish.max_countdown(_settings(vis))
    return longest, claims.wait_claim_ttl_ms(qlt, longest)


def workflow_member_wait(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    longest = republish.max_countdown(_settings(vis))
    return longest, workflow.gap_ms_for(int(gap * 1000), workflow.covering_ms(longest))


def park_safety_copy(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    """Behind a holder with a 600 s TTL: the longest safety countdown the visibility timeout allows."""
    longest = handoff.longest_safety_countdown(600.0, _settings(vis))
    return longest, handoff.entry_lifetime_ms(longest)


def debounced_publish_records(source: str, qlt: float, vis: float, gap: float) -> tuple[float, int]:
    delay = _publish_delay(source)  # _debounce.delay_for, then DEBOUNCE_PUBLISH with record_ttl_ms(s, opts, delay)
    return delay, debounce.record_ttl_ms(_settings(vis), _opts(qlt), delay)


KINDS: dict[str, Row] = {
    "retry: until_done claim": retry_until_done_claim,
    "retry: debounce records": retry_debounce_records,
    "retry: workflow member lease": retry_workflow_member,
    "retry: chord page lease": retry_chord_page,
    "wait: claim handed back": wait_claim,
    "wait: workflow member lease": workflow_member_wait,
    "park: waiter entry for the safety copy": park_safety_copy,
    "debounced publish: burst records": debounced_publish_records,
}

ROWS = list(itertools.product(KINDS, SOURCES, QUEUE_LOCK_TTLS, VISIBILITY_TIMEOUTS, GAP_TTLS))


@pytest.mark.parametrize(("kind", "source", "qlt", "vis", "gap"), ROWS)
def test_every_hand_over_covers_its_countdown_plus_the_publish_grace(
    kind: str, source: str, qlt: float, vis: float, gap: float
) -> None:
    countdown, ttl_ms = KINDS[kind](source, qlt, vis, gap)
    slack = ETA_SLACK_MS if SOURCES[source][1] is not None else 0
    need = int(countdown * 1000) + GRACE_MS - slack
    assert ttl_ms >= need, f"{kind} ({source}, queue_lock_ttl={qlt}, vis={vis}, gap={gap}): {ttl_ms} ms < {need} ms"


def test_the_sources_are_read_as_celery_reads_them() -> None:
    """``retry()`` with neither countdown nor eta is due after ``default_retry_delay``; an explicit 0 is now."""
    assert claims.retry_due_in(180.0) == 180.0
    assert claims.retry_due_in(180.0, countdown=0) == 0.0
    assert claims.retry_due_in(None) == 0.0
    assert 39.0 < claims.retry_due_in(180.0, eta=_eta(40.0)) <= 40.0


@pytest.mark.parametrize("qlt", QUEUE_LOCK_TTLS)
def test_a_hand_over_keeps_its_own_base_ttl_on_top_of_the_delay(qlt: float) -> None:
    """The floor adds the grace where the base is short; it never shortens what ``queue_lock_ttl`` gives."""
    assert claims.retry_claim_ttl_ms(qlt, 10.0) >= int((qlt + 10.0) * 1000)
    assert claims.wait_claim_ttl_ms(qlt, 1.0) >= int(qlt * 1000)
    assert debounce.record_ttl_ms(_settings(30.0), _opts(qlt), 10.0) >= int((qlt + 30.0 + 10.0) * 1000)


def test_a_publish_time_claim_is_not_a_hand_over() -> None:
    """A claim taken at publish lives ``queue_lock_ttl`` plus the delay, as documented (docs/model.md)."""
    assert claims.claim_ttl_ms(2.0, 4.0) == 6000
