"""Contended hand-off: charges queued behind a long holder of the same customer (issue 15).

The scenario a new user meets: ``charge(customer=1, amount=...)`` holds its
lease for ``hold`` seconds, and ``waiters`` charges of the same customer with
other amounts (different work, so the default ``on_locked="skip"`` makes them
wait, not skip) are published right after it, on a worker with enough
children to take them all at once. Measured per round:

* **re-publishes per waiting task**: LPUSHes on the broker (its own private
  server, so nothing but task messages counts: the lock Redis, the result
  backend and the bodies' records live on another one) minus the first
  publish of each task, divided by ``waiters``;
* **hand-off delay**: from one body's end to the next body's start, from the
  bodies' own ``time.time()`` records (one machine, one clock), over the
  ``waiters`` hand-offs of the round;
* **drain**: from the holder's publish to the last body's end.

Checked as breakage: every charge ran exactly once, no two bodies overlapped.
:func:`scenario` is parametrized (holder and waiter bodies, waiters,
concurrency, task options), so a later release-wakes-the-oldest-waiter
mechanism is measured by this same code.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis

from . import counting
from .e2e import BenchFailure
from .stats import Summary
from .worker import Worker
from .workerapp import create_app


@dataclass
class HandoffResult:
    """One scenario over rounds: re-publishes per waiter, hand-off delays, drain time."""

    name: str
    waiters: int
    hold: float
    waiter_hold: float
    concurrency: int
    republishes: Summary = field(default_factory=Summary)
    delay_median: Summary = field(default_factory=Summary)
    delay_max: Summary = field(default_factory=Summary)
    drain: Summary = field(default_factory=Summary)
    delays: list[float] = field(default_factory=list)

    @property
    def worst_republishes(self) -> float:
        """The round with the most re-publishes per waiting task (the target is a bound, not a median)."""
        return max(self.republishes.values) if self.republishes.values else float("nan")

    @property
    def all_delays(self) -> Summary:
        """Every hand-off of every round pooled: its median is the target's figure."""
        return Summary(list(self.delays))


def _records(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.lrange(key, 0, -1)]


def scenario(
    broker_url: str,
    lock_url: str,
    rounds: int,
    *,
    name: str = "default on_locked (skip: different work waits)",
    waiters: int = 3,
    hold: float = 2.0,
    waiter_hold: float = 0.1,
    concurrency: int = 4,
    task_options: dict[str, Any] | None = None,
    timeout: float = 120.0,
) -> HandoffResult:
    """Run the hand-off scenario ``rounds`` times on one worker; see the module docstring.

    Why the holder's start is awaited before the waiters are published: the figure is
    the hand-off, and a waiter that raced the holder to the lease would measure nothing.
    """
    prefix = f"benchho{uuid.uuid4().hex[:6]}"
    cfg: dict[str, Any] = {
        "broker": broker_url,
        "lock_url": lock_url,
        "backend": lock_url,
        "queue": f"{prefix}.q",
        "prefix": prefix,
        "handoff_options": dict(task_options or {}),
    }
    app = create_app(cfg)
    charge = app.tasks["ho_charge"]
    broker = redis.Redis.from_url(broker_url, decode_responses=True)
    rec = redis.Redis.from_url(lock_url, decode_responses=True)
    key = f"{prefix}:handoff"
    out = HandoffResult(name, waiters, hold, waiter_hold, concurrency)
    worker = Worker(app, cfg, concurrency=concurrency)
    try:
        worker.start(90)
        for r in range(rounds):
            customer = 1000 + r  # a fresh entity per round: no fence or record carried over
            base_amount = 100 * (r + 1) * 1000
            amounts = [base_amount + i for i in range(waiters + 1)]
            rec.delete(key)
            before = counting.commandstats(broker).get("lpush", 0)
            t0 = time.time()
            charge.delay(customer, amounts[0], hold)
            try:
                _wait(rec, key, lambda recs: any(x["ev"] == "start" for x in recs), 30)
            except TimeoutError as exc:
                raise BenchFailure(f"hand-off: the holder never started\n{worker.log()}") from exc
            for amount in amounts[1:]:
                charge.delay(customer, amount, waiter_hold)
            try:
                recs = _wait(rec, key, lambda recs: sum(x["ev"] == "end" for x in recs) >= waiters + 1, timeout)
            except TimeoutError as exc:
                raise BenchFailure(f"hand-off: not every charge ran within {timeout}s (lost?)\n{worker.log()}") from exc
            lpush = counting.commandstats(broker).get("lpush", 0) - before
            delays = _check(recs, amounts)
            out.republishes.add((lpush - (waiters + 1)) / waiters)
            out.delay_median.add(statistics.median(delays))
            out.delay_max.add(max(delays))
            out.delays += delays
            out.drain.add(max(x["t"] for x in recs) - t0)
        # A doubled copy of an earlier round shows up in a later round's records (its amount is not
        # that round's); for the last round, give a late copy a moment to show before stopping.
        time.sleep(0.5)
        late = _records(rec, key)[2 * (waiters + 1) :]
        if late:
            raise BenchFailure(f"hand-off: {len(late)} records after the last round ended (a charge ran twice?) {late}")
    finally:
        worker.stop()
        broker.close()
        rec.close()
    return out


def _wait(client: redis.Redis, key: str, done: Any, timeout: float) -> list[dict[str, Any]]:
    """The records once ``done(records)`` holds, polled every 10 ms (fine enough beside 50 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = _records(client, key)
        if done(recs):
            return recs
        if time.monotonic() > deadline:
            raise TimeoutError(key)
        time.sleep(0.01)


def _check(recs: list[dict[str, Any]], amounts: list[int]) -> list[float]:
    """Hand-off delays (s) of one round, after checking each charge ran once and none overlapped."""
    starts = sorted((x for x in recs if x["ev"] == "start"), key=lambda x: x["t"])
    ends = {x["amount"]: x["t"] for x in recs if x["ev"] == "end"}
    ran = sorted(x["amount"] for x in starts)
    if ran != sorted(amounts):
        raise BenchFailure(f"hand-off: charges {ran} ran, expected each of {sorted(amounts)} once")
    delays = []
    for prev, nxt in itertools.pairwise(starts):
        gap = nxt["t"] - ends[prev["amount"]]
        if gap < 0:
            raise BenchFailure(f"hand-off: charge {nxt['amount']} started before {prev['amount']} ended (overlap)")
        delays.append(gap)
    return delays
