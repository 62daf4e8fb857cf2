"""A stateful model of the runtime: modes x policies x events, through Celery's real tracer on the real Redis.

Hypothesis drives publishes, deliveries, broker redeliveries, duplicate
publishes, foreign holders (alive, identical, killed) and their releases (which
wake the oldest parked waiter, or die between RELEASE and the wake publish), a
lock-Redis outage, retries and revokes, and checks after every step that

* no claim outlives its message (every queued claim belongs to a message in the queue);
* no reservation outlives its waiter (an entity handed to a parked waiter belongs to a message of it in the queue);
* no message is both swallowed and retried (a delivery left in RETRY has its message queued);
* no job's body runs twice;

and, once the queue is drained with the entities free, that every published
job ran, was answered (a record, or the identical job it was deduplicated
onto), or failed visibly — and that no lease or claim is left behind.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from celery_lockguard import AlreadyQueued, LockedTask
from celery_lockguard import _completion as completion
from celery_lockguard import _connection as connection
from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard import _signals as signals
from celery_lockguard._config import reset
from celery_lockguard._config import settings as lockguard_settings
from celery_lockguard._keys import claim_name, digest, lock_name
from celery_lockguard.testing import delete_prefix

from .tracer import Message, deliver, make_app

pytestmark = pytest.mark.model

MODES = ("while_running", "until_started", "until_done")
POLICIES = ("skip", "retry", "raise")
DOWN = "redis://127.0.0.1:1/0"
#: Deliveries made across all examples: the model must have exercised the runtime, not only published.
STEPS = {"deliveries": 0, "woken": 0, "releaser_died": 0}
ENTITIES = (1, 2)
AMOUNTS = (10, 20)


def machine(mode: str, policy: str, redis_url: str, store: str = "redis") -> type[RuleBasedStateMachine]:
    class Model(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.r = redis.Redis.from_url(redis_url, decode_responses=True)
            self.prefix = f"lgm:{uuid.uuid4().hex[:10]}"
            self.app: Celery = make_app(
                "model",
                redis_url,
                self.prefix,
                lockguard_redis_url=redis_url,
                lockguard_socket_timeout=0.2,
                lockguard_completion_backend=store,
            )
            self.runs: dict[str, int] = {}
            self.retry_once: set[str] = set()

            @self.app.task(
                base=LockedTask,
                bind=True,
                shared=False,
                name="m.charge",
                lock_key="k:{a}",
                lock_mode=mode,
                on_locked=policy,
                lock_max_waits=4,
                lock_ttl=30,
            )
            def charge(task: Any, a: int, amount: int) -> int:
                tid = task.request.id
                self.runs[tid] = self.runs.get(tid, 0) + 1
                if tid in self.retry_once:
                    self.retry_once.discard(tid)
                    raise task.retry(countdown=0.1)
                return a * amount

            self.task = charge
            self.jobs: dict[str, str] = {}  # job id -> "pending" | "ran" | "answered" | "failed"
            self.answered_by: dict[str, str] = {}  # a deduplicated publish -> the job it was answered with
            self.foreign: dict[int, L.Lease] = {}  # planted holders (another worker), by entity
            self.delivered: list[Message] = []
            self.down = False
            # Messages revoked, or ended, while the lock Redis was unreachable: their claim cannot be freed then
            # and lives out queue_lock_ttl (docs/failure-modes.md). Every other claim must go with its message.
            self.excused: set[str] = set()

        # -- the queue (kombu's Redis list: LPUSH to put, the oldest at the right) ----------------

        @property
        def queue_key(self) -> str:
            return f"{self.prefix}:kombu:{self.app.conf.task_default_queue}"

        def queued(self) -> list[Message]:
            from .tracer import published

            return published(self.r, self.app)

        def pop(self) -> Message | None:
            msgs = self.queued()
            if not msgs:
                return None
            self.r.rpop(self.queue_key)
            return msgs[0]

        # -- rules ---------------------------------------------------------------------------

        @initialize(
            work=st.lists(st.tuples(st.sampled_from(ENTITIES), st.sampled_from(AMOUNTS)), min_size=2, max_size=4),
            held=st.sampled_from([True, False]),
        )
        def some_work(self, work: list[tuple[int, int]], held: bool) -> None:
            """The work, and (``held``) another worker already running other work on the first entity.

            Started held more often than not: its deliveries then park, and its release wakes them.
            """
            if held:
                self.foreign_holder(work[0][0], identical=False, alive=True)
            for a, amount in work:
                self.publish(a, amount, False)

        @rule(a=st.sampled_from(ENTITIES), amount=st.sampled_from(AMOUNTS), retry=st.booleans())
        def publish(self, a: int, amount: int, retry: bool) -> None:
            tid = str(uuid.uuid4())
            if retry:
                self.retry_once.add(tid)
            try:
                result = self.task.apply_async((a, amount), task_id=tid)
            except AlreadyQueued:  # on_locked="raise": the publisher is told, nothing was sent
                assert policy == "raise" and mode != "while_running"
                return
            if result.id == tid:
                self.jobs[tid] = "pending"
            else:  # answered at publish with the identical job already queued or running
                self.answered_by[tid] = result.id

        @precondition(lambda self: self.r.llen(self.queue_key) > 0)
        @rule()
        def deliver_next(self) -> None:
            msg = self.pop()
            assert msg is not None
            out = deliver(self.task, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom())
            STEPS["deliveries"] += 1
            self.delivered.append(msg)
            if out.state == "RETRY":
                assert any(m.task_id == msg.task_id for m in self.queued()), (
                    f"{msg.task_id} is in RETRY but no message of it exists"
                )
            self._settle(msg.task_id, out.state)
            if self.down and out.state != "RETRY":  # it ended during the outage: its claim could not be freed
                self.excused.add(msg.task_id)

        @precondition(lambda self: bool(self.delivered))
        @rule(data=st.data())
        def redeliver(self, data: Any) -> None:
            """The broker delivers a message again (visibility timeout, a lost ack)."""
            msg = data.draw(st.sampled_from(self.delivered))
            out = deliver(self.task, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom())
            if out.state == "RETRY":
                assert any(m.task_id == msg.task_id for m in self.queued())
            self._settle(msg.task_id, out.state)

        @precondition(lambda self: self.r.llen(self.queue_key) > 0)
        @rule()
        def revoke_next(self) -> None:
            """The worker discards the oldest message (revoked or expired): its claim goes with it."""
            msg = self.pop()
            assert msg is not None
            if self.down:  # the claim cannot be freed now: it lives out queue_lock_ttl (documented)
                self.excused.add(msg.task_id)
            signals.free_claim_from_main(self.task, msg.task_id, msg.args, msg.kwargs, "revoked")
            # A woken copy discarded: its reservation goes too, and the next waiter is woken.
            signals.free_reservation_from_main(self.task, _Request(msg), msg.args, msg.kwargs)
            if self.jobs.get(msg.task_id) == "pending" and not any(m.task_id == msg.task_id for m in self.queued()):
                self.jobs[msg.task_id] = "revoked"

        @rule(a=st.sampled_from(ENTITIES), identical=st.booleans(), alive=st.booleans())
        def foreign_holder(self, a: int, identical: bool, alive: bool) -> None:
            """Another worker holds the entity: identical or different work, alive or killed (not renewing)."""
            key = lock_name(self.prefix, f"k:{a}")
            if self.r.exists(key):
                return
            tid = f"foreign-{uuid.uuid4().hex[:8]}"
            got = L.acquire(
                self.r,
                self.prefix,
                f"k:{a}",
                ttl_ms=60_000,
                task_id=tid,
                task_name=self.task.name if identical else "other",
                digest=digest({"a": a, "amount": AMOUNTS[0]}) if identical else "d",
                worker="elsewhere",
                fence_ttl_ms=60_000,
            )
            assert isinstance(got, L.Lease)
            self.r.hset(key, "host", "elsewhere")
            if not alive:
                self.r.hset(key, "renewed_at", 0)
                self.r.pexpire(key, 300)  # a killed holder: its lease runs out soon
            self.foreign[a] = got
            self.jobs[tid] = "ran"

        @precondition(lambda self: bool(self.foreign))
        @rule(data=st.data())
        def foreign_release(self, data: Any) -> None:
            """The other worker's body ends: RELEASE hands the entity to the oldest parked waiter, if any.

            ``dies``: its process is killed between RELEASE and the wake publish; the waiter's safety
            copy must then run it, once.
            """
            a = data.draw(st.sampled_from(sorted(self.foreign)))
            dies = data.draw(st.booleans())
            lease = self.foreign.pop(a)
            reserve_ms = int(handoff.RESERVATION_TTL * 1000)
            _, _, woken = L.release_and_wake(self.r, lease, self.prefix, reserve_ms=reserve_ms)
            if woken is not None and dies:
                STEPS["releaser_died"] += 1
            elif woken is not None:
                STEPS["woken"] += handoff.wake(self.app, lockguard_settings(self.app), woken, "other", lease.task_id)

        @rule(down=st.booleans())
        def outage(self, down: bool) -> None:
            """The lock Redis becomes unreachable (or comes back); the broker stays up."""
            self.down = down
            self.app.conf.lockguard_redis_url = DOWN if down else redis_url
            reset(self.app)

        # -- invariants ----------------------------------------------------------------------

        @invariant()
        def no_claim_outlives_its_message(self) -> None:
            queued_ids = {m.task_id for m in self.queued()}
            for a in ENTITIES:
                for key in (claim_name(self.prefix, f"k:{a}"), lock_name(self.prefix, f"k:{a}")):
                    holder = self.r.hgetall(key)
                    waiting = holder.get("state") in ("queued", "publishing")
                    if waiting and holder["task_id"] not in self.excused:
                        assert holder["task_id"] in queued_ids, f"claim {key} of {holder['task_id']} has no message"

        @invariant()
        def no_reservation_outlives_its_waiter(self) -> None:
            queued_ids = {m.task_id for m in self.queued()}
            for a in ENTITIES:
                holder = self.r.hgetall(lock_name(self.prefix, f"k:{a}"))
                if holder.get("state") == "handed" and holder["task_id"] not in self.excused:
                    handed = holder["task_id"]
                    assert handed in queued_ids, f"k:{a} is handed to {handed}, which has no message"

        @invariant()
        def no_body_runs_twice(self) -> None:
            assert all(n <= 1 or tid in self.retried() for tid, n in self.runs.items()), self.runs

        def retried(self) -> set[str]:
            return {tid for tid, n in self.runs.items() if n == 2}  # a retry() runs the body again, by design

        def _settle(self, tid: str, state: str) -> None:
            if state == "SUCCESS":
                self.jobs[tid] = "ran" if self.runs.get(tid) else "answered"
            elif state in ("FAILURE", "REJECTED"):
                self.jobs[tid] = "failed"

        def teardown(self) -> None:
            try:
                self.outage(False)
                for lease in self.foreign.values():
                    L.release(self.r, lease, self.prefix)
                for a in ENTITIES:  # killed holders' leases: their TTL is 300 ms; do not wait for it here
                    key = lock_name(self.prefix, f"k:{a}")
                    if self.r.hget(key, "host") == "elsewhere":
                        self.r.delete(key)
                for _ in range(200):
                    msg = self.pop()
                    if msg is None:
                        break
                    out = deliver(self.task, tuple(msg.args), msg.kwargs, task_id=msg.task_id, headers=msg.custom())
                    self._settle(msg.task_id, out.state)
                assert self.r.llen(self.queue_key) == 0, "the queue did not drain"
                for tid, outcome in self.jobs.items():
                    if outcome in ("pending",):
                        state = self.app.AsyncResult(tid).state
                        assert state in ("SUCCESS", "FAILURE", "REJECTED"), f"job {tid} lost: {state}"
                for tid, holder in self.answered_by.items():
                    assert holder in self.jobs, f"{tid} was answered with {holder}, which is no job"
                leftovers = [
                    k
                    for k in self.r.scan_iter(f"{self.prefix}:v1:*")
                    if k.endswith((":lock", ":claim")) and self.r.hget(k, "task_id") not in self.excused
                ]
                assert leftovers == [], f"left behind: {leftovers}"
            finally:
                delete_prefix(self.r, self.prefix)
                completion.forget_stores()  # a store (and its connection) per namespace: one per example
                if store != "redis":
                    import psycopg

                    with psycopg.connect(store, autocommit=True) as conn:
                        conn.execute("DELETE FROM lockguard_completions WHERE scope LIKE %s", (f"{self.prefix}:%",))
                connection.forget_clients()

    Model.__name__ = f"Model_{mode}_{policy}"
    return Model


@pytest.mark.parametrize(("mode", "policy"), list(itertools.product(MODES, POLICIES)))
def test_model(mode: str, policy: str, redis_url: str) -> None:
    woken, died = STEPS["woken"], STEPS["releaser_died"]
    run(machine(mode, policy, redis_url))
    if mode == "while_running" and policy != "raise":  # waiters park behind other work: releases must wake them
        assert STEPS["woken"] > woken and STEPS["releaser_died"] > died, "the model never exercised park and wake"


@pytest.mark.parametrize("mode", MODES)
def test_model_with_the_postgresql_store(mode: str, redis_url: str, postgres_url: str) -> None:
    run(machine(mode, "skip", redis_url, store=postgres_url))


class _Request:
    """What the worker's main process knows of a discarded message: its id and headers."""

    def __init__(self, msg: Message) -> None:
        self.id = msg.task_id
        self.headers = msg.custom()
        self.request_dict = msg.custom()


@pytest.fixture(autouse=True)
def _short_wake_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A safety copy finding its waiter still 'waking' polls for the grace in-process: keep the model quick."""
    monkeypatch.setattr(handoff, "WAKE_GRACE", 0.05)


def run(Model: type[RuleBasedStateMachine]) -> None:
    Model.TestCase.settings = settings(
        max_examples=25,
        derandomize=True,  # the same examples every run: CI stays deterministic, the model stays broad
        stateful_step_count=30,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    before = STEPS["deliveries"]
    Model.TestCase().runTest()
    assert STEPS["deliveries"] - before >= 10, "the model delivered too little to mean anything"
