"""The model of features crossing on one entity, through Celery's real tracer on the real Redis.

tests/test_model.py models each feature on its own (modes x policies, limits, debounce); this machine puts
them on the same entities at once. Every task below locks ``e:{a}``:

* ``plain``: the single lease (``on_locked="retry"``: it parks behind a holder and is woken);
* ``shared``: ``lock_limit=2`` slots with a ``lock_rate`` start window -- the read side of the
  read/write pair the single lease makes with it;
* ``queued``: ``lock_mode="until_done"`` (a queue claim from publish to the body's end; identical
  publishes are answered with the queued job);
* ``burst``: ``lock_debounce`` (a burst's last publish is the one that runs);
* ``pair``: ``lock_key=("e:{a}", "e:{b}")``, several entities held all or none (both entities in either
  order, overlapping other pairs' sets, or one when both templates name it);
* workflows: a chain (``step``, a member ``own`` with its own lock key ``o:{a}``, ``step``) or a chord
  (two ``step`` pages, a ``step`` callback) under one workflow lease on ``e:{a}``; a member may ``retry()``.

The rules publish (a ``None`` key field too, refused at publish as ``EmptyField``), plant another worker's
holder on ``e:<a>`` or ``o:<a>`` and release it (waking the oldest waiter), deliver the oldest message,
redeliver one, kill a delivery (its process dies holding its lease or claim: no release, the
lease runs out by its TTL, the broker redelivers the message), force-release an entity as the CLI does,
and let time pass. Checked after every step:

* no two bodies on one entity, unless both are ``shared`` bodies on two slots (checked inside each body,
  against every lease hash of the entity: the single lease and ``lock_limit`` slots exclude each other);
* never more starts of ``shared`` per entity than its ``lock_rate`` window allows;
* no body runs twice (but a ``retry()``, or the redelivery of a killed one);
* no claim or reservation outlives its message;
* a parked waiter never sits behind a free entity: every lease end (release, forced release, a claim or
  a slot freed, a workflow's end) hands the entity to the oldest waiter at once, whose woken copy is
  queued with no countdown -- only a killed holder's lease, which ends with no code running, leaves its
  waiters to their safety copies;

and, once drained: every accepted publish ran, was answered (by its record or the identical job it was
deduplicated onto), was superseded along a chain of results that ends in a run, or failed visibly (a
spent wait budget, a workflow whose lease the operator took); the last publish of every burst ran; no
lease, claim or waiter is left behind.
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from celery_lockguard import EmptyField, LockContended, LockedTask, LockLost, workflow
from celery_lockguard import _connection as connection
from celery_lockguard import _handoff as handoff
from celery_lockguard import _lease as L
from celery_lockguard._config import parse_rate
from celery_lockguard._config import settings as lockguard_settings
from celery_lockguard._keys import lock_name, parse_lock_name, slot_lock_name, wait_name, waiters_name
from celery_lockguard.testing import delete_prefix, settle

from .test_model import SCAN_COUNT, STEPS, run
from .tracer import HOSTNAME, make_app

pytestmark = pytest.mark.model

ENTITIES = (1, 2)
LIMIT = 2
RATE = "4/1s"
#: How long a killed delivery's lease outlives it (ms): its TTL as the renewer last set it, cut short here.
DEAD_MS = 300
#: Counters across examples: the model must have reached each crossing, not only published.
CROSSINGS = {
    "woken": 0,
    "killed": 0,
    "forced": 0,
    "superseded": 0,
    "workflow_members": 0,
    "two_slots": 0,
    "empty_field": 0,
    "foreign": 0,
}


class Killed(SystemExit):
    """The delivery's process dies (SIGKILL): nothing after the body runs, the tracer stores nothing."""


@dataclass
class Msg:
    """A queued message as a worker receives it: headers, and the canvas it carries (chain, chord, callbacks)."""

    raw: bytes
    task_id: str
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    embed: dict[str, Any] = field(default_factory=dict)

    def custom(self) -> dict[str, Any]:
        return {k: v for k, v in self.headers.items() if k.startswith("lockguard_")}


def crossing_machine(redis_url: str, kinds: tuple[str, ...]) -> type[RuleBasedStateMachine]:
    """The machine publishing ``kinds`` (of plain, shared, queued, burst, workflow) on the same entities."""
    tasks = tuple(k for k in kinds if k != "workflow")
    rate = parse_rate(RATE, "model")
    assert rate is not None

    class Crossings(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.r = redis.Redis.from_url(redis_url, decode_responses=True)
            self.rb = redis.Redis.from_url(redis_url)
            self.prefix = f"lgx:{uuid.uuid4().hex[:10]}"
            self.app: Celery = make_app(
                "crossings", redis_url, self.prefix, lockguard_redis_url=redis_url, lockguard_socket_timeout=0.5
            )
            self.runs: dict[str, int] = {}
            self.retried: set[str] = set()  # a member's retry() ran its body again, by design
            self.to_kill: str | None = None
            self.killed: set[str] = set()  # deliveries that died in their body: their redelivery runs again
            self.dead: dict[str, int] = {}  # a killed delivery's lease hash -> its entity
            self.excused: set[int] = set()  # entities a killed lease ran out on: its waiters wait for their copies
            self.starts: dict[int, list[int]] = {a: [] for a in ENTITIES}  # server ms of shared starts
            self.jobs: dict[str, str] = {}  # accepted job id -> its kind
            self.answered_by: dict[str, str] = {}
            self.bursts: dict[int, list[str]] = {a: [] for a in ENTITIES}  # debounced publishes in order
            self.entity: dict[str, int] = {}
            self.forced: set[int] = set()  # entities the operator force-released (a workflow on it may end)
            self.trace: list[str] = []
            self.foreign: dict[str, L.Lease] = {}  # planted holders (another worker), by lease hash
            self.counter = 0
            conf = {"bind": True, "shared": False, "base": LockedTask, "lock_max_waits": 6, "lock_ttl": 30}

            def body(task: Any, kind: str, a: int, v: int, retry: bool = False, also: int | None = None) -> int:
                tid = task.request.id
                self.runs[tid] = self.runs.get(tid, 0) + 1
                for e in {a, a if also is None else also}:
                    self.alone(task, kind, e)
                    self.excused.discard(e)  # a body on the entity again: its release wakes the waiters
                if kind == "shared":
                    lease = task.lock
                    self.starts[a].append(int(self.r.hget(lease.redis_key, "acquired_at") or 0))
                    CROSSINGS["two_slots"] += self.slots_held(a) == LIMIT
                if tid == self.to_kill:
                    self.die(task, a)
                if retry and tid not in self.retried:
                    self.retried.add(tid)
                    raise task.retry(countdown=0.1)
                return v

            @self.app.task(name="x.plain", lock_key="e:{a}", on_locked="retry", **conf)
            def plain(task: Any, a: int, v: int) -> int:
                return body(task, "plain", a, v)

            @self.app.task(name="x.shared", lock_key="e:{a}", lock_limit=LIMIT, lock_rate=RATE, **conf)
            def shared(task: Any, a: int, v: int) -> int:
                return body(task, "shared", a, v)

            @self.app.task(name="x.queued", lock_key="e:{a}", lock_mode="until_done", on_locked="retry", **conf)
            def queued(task: Any, a: int, v: int) -> int:
                return body(task, "queued", a, v)

            @self.app.task(name="x.burst", lock_key="e:{a}", lock_debounce=0.01, **conf)
            def burst(task: Any, a: int, v: int) -> int:
                return body(task, "burst", a, v)

            @self.app.task(name="x.pair", lock_key=("e:{a}", "e:{b}"), on_locked="retry", **conf)
            def pair(task: Any, a: int, b: int, v: int) -> int:
                return body(task, "pair", a, v, also=b)

            @self.app.task(name="x.step", **conf)
            def step(task: Any, *prev: Any, a: int, v: int, retry: bool = False) -> int:
                CROSSINGS["workflow_members"] += 1
                return body(task, "member", a, v, retry)

            @self.app.task(name="x.own", lock_key="o:{a}", on_locked="retry", **conf)
            def own(task: Any, *prev: Any, a: int, v: int) -> int:
                CROSSINGS["workflow_members"] += 1
                return body(task, "member", a, v)

            self.tasks = {"plain": plain, "shared": shared, "queued": queued, "burst": burst, "pair": pair}
            self.step, self.own = step, own

        # -- the queue: kombu's Redis list, LPUSH to put, the oldest at the right ---------------------------

        @property
        def queue_key(self) -> str:
            return f"{self.prefix}:kombu:{self.app.conf.task_default_queue}"

        def queued_msgs(self) -> list[Msg]:
            out = []
            for raw in reversed(self.rb.lrange(self.queue_key, 0, -1)):
                payload = json.loads(raw)
                args, kwargs, embed = json.loads(base64.b64decode(payload["body"]))
                h = payload["headers"]
                out.append(Msg(raw, h["id"], h["task"], args, kwargs, h, embed or {}))
            return out

        def take(self, msg: Msg) -> None:
            self.rb.lrem(self.queue_key, 1, msg.raw)

        def run_msg(self, msg: Msg) -> Any:
            """Deliver ``msg`` through the real tracer, its canvas (chain, chord, callbacks) as a worker reads it."""
            from celery.app.trace import build_tracer

            task = self.app.tasks[msg.task]
            request = {
                "id": msg.task_id,
                "task": msg.task,
                "args": msg.args,
                "kwargs": msg.kwargs,
                "hostname": HOSTNAME,
                "retries": msg.headers.get("retries", 0),
                "is_eager": False,
                "root_id": msg.headers.get("root_id") or msg.task_id,
                "parent_id": msg.headers.get("parent_id"),
                "group": msg.headers.get("group"),
                "group_index": msg.headers.get("group_index"),
                "delivery_info": {"exchange": "", "routing_key": self.app.conf.task_default_queue},
                "chain": msg.embed.get("chain"),
                "chord": msg.embed.get("chord"),
                "callbacks": msg.embed.get("callbacks"),
                "errbacks": msg.embed.get("errbacks"),
                **msg.custom(),
            }
            tracer = build_tracer(msg.task, task, app=self.app, eager=False, propagate=False)
            STEPS["deliveries"] += 1
            CROSSINGS["woken"] += bool(msg.custom().get("lockguard_woken"))
            try:
                retval = tracer(msg.task_id, msg.args, msg.kwargs, request)[0]
            except Killed:
                settle()
                self.rb.lpush(self.queue_key, msg.raw)  # acks_late: the broker delivers it again
                return "killed"
            settle()
            if isinstance(retval, dict) and retval.get("lockguard") == "superseded":
                CROSSINGS["superseded"] += 1
            self.discover()
            return retval

        def discover(self) -> None:
            """Jobs a delivery published (a chain's next member, a chord's callback) are accepted work too."""
            for m in self.queued_msgs():
                if m.task_id not in self.jobs and m.task_id not in self.answered_by:
                    self.jobs[m.task_id] = m.task

        # -- a kill: the delivery's process dies in its body -------------------------------------------------

        def die(self, task: Any, a: int) -> None:
            """No RELEASE: the lease (or the until_done claim it adopted) lives out the TTL its renewer last set."""
            self.to_kill = None
            self.killed.add(task.request.id)
            lease = task.lock
            lease.released = True  # the exits after the body find nothing to release, as nothing would run
            # Its process is gone (as another host's would be: this one lives on), its renewer with it: its own
            # redelivery may take over at once; other work waits for the TTL the renewer last set (cut short here).
            for key in getattr(lease, "redis_keys", [lease.redis_key]):  # every entity of a multi-entity lease
                self.r.hset(key, mapping={"host": "elsewhere", "renewed_at": 0})
                self.r.pexpire(key, DEAD_MS)
                self.dead[key] = int(parse_lock_name(self.prefix, key).split(":")[1])
            CROSSINGS["killed"] += 1
            raise Killed()

        # -- rules -----------------------------------------------------------------------------------------

        def next_v(self) -> int:
            self.counter += 1
            return self.counter

        @rule(kind=st.sampled_from(tasks), a=st.sampled_from(ENTITIES * 4 + (None,)), both=st.booleans())
        def publish(self, kind: str, a: int | None, both: bool = True) -> None:
            """Publish; a ``None`` key field is refused at publish, naming the field: nothing is sent or held."""
            if a is None:
                before = self.r.llen(self.queue_key)
                with pytest.raises(EmptyField, match=r"field \{a\} is None"):
                    self.tasks[kind].apply_async((None, 1, 0) if kind == "pair" else (None, 0))
                assert self.r.llen(self.queue_key) == before
                assert not self.r.exists(lock_name(self.prefix, "e:None"))
                CROSSINGS["empty_field"] += 1
                return
            # until_done publishes repeat their arguments: identical ones are answered with the queued job
            v = self.counter % 2 if kind == "queued" else self.next_v()
            tid = str(uuid.uuid4())
            # a multi-entity call: both entities (in either order), or one (its templates name the same entity)
            args = (a, 3 - a if both else a, v) if kind == "pair" else (a, v)
            res = self.tasks[kind].apply_async(args, task_id=tid)
            if res.id != tid:
                self.answered_by[tid] = res.id
                return
            self.jobs[tid], self.entity[tid] = kind, a
            if kind == "burst":
                self.bursts[a].append(tid)
            self.trace.append(f"publish {kind} e:{a} {tid[:8]}")

        @initialize(
            work=st.lists(st.tuples(st.sampled_from(tasks), st.sampled_from(ENTITIES)), min_size=2, max_size=4),
            held=st.booleans(),
        )
        def some_work(self, work: list[tuple[str, int]], held: bool) -> None:
            """The work, and (``held``) another worker already running other work on the first entity: the
            deliveries then park, and its release (or the operator's) wakes them."""
            if held:
                self.foreign_holder(work[0][1])
            for kind, a in work:
                self.publish(kind, a)
            self.publish(work[0][0], None)  # and a call missing its entity, refused

        @rule(a=st.sampled_from(ENTITIES), entity=st.sampled_from(("e", "e", "o")))
        def foreign_holder(self, a: int, entity: str = "e") -> None:
            """Another worker runs other work on the entity (the single lease, alive and renewing); on ``o:<a>``,
            the entity a workflow's member locks of its own, it holds that member up inside its workflow."""
            got = L.acquire(
                self.r,
                self.prefix,
                f"{entity}:{a}",
                ttl_ms=60_000,
                task_id=f"foreign-{uuid.uuid4().hex[:8]}",
                task_name="other",
                digest="d",
                worker="elsewhere",
                fence_ttl_ms=60_000,
            )
            if isinstance(got, L.Lease):
                self.r.hset(got.redis_key, "host", "elsewhere")
                self.foreign[got.redis_key] = got
                CROSSINGS["foreign"] += 1
                self.trace.append(f"foreign_holder e:{a} {self.locks()}")

        @rule(i=st.integers(min_value=0, max_value=7))
        def foreign_release(self, i: int) -> None:
            """Its body ends: RELEASE hands the entity to the oldest parked waiter, whose woken copy goes out.

            (No precondition or draw reads the real Redis, here or in any rule: what is queued or held depends
            on real time, and hypothesis must see the same draws when it replays a prefix.)"""
            if not self.foreign:
                return
            lease = self.foreign.pop(sorted(self.foreign)[i % len(self.foreign)])
            _, _, woken = L.release_and_wake(self.r, lease, self.prefix, reserve_ms=handoff.reserve_ms())
            handoff.wake(self.app, lockguard_settings(self.app), woken, "other", lease.task_id)
            self.trace.append(f"foreign_release {lease.key} woken={woken} {self.locks()}")

        @precondition(lambda self: "workflow" in kinds)
        @rule(a=st.sampled_from(ENTITIES), parallel=st.booleans(), retry=st.booleans())
        def publish_workflow(self, a: int, parallel: bool, retry: bool) -> None:
            """A chain with a member locking its own entity, or a chord; one member may retry()."""
            s, v = self.step, self.next_v()
            if parallel:
                sig: Any = chord([s.si(a=a, v=v, retry=retry), s.si(a=a, v=v + 1)], s.s(a=a, v=v + 2))
            else:
                sig = chain(s.si(a=a, v=v), self.own.si(a=a, v=v), s.si(a=a, v=v + 1, retry=retry))
            res = workflow(sig, lock_key="e:{a}", a=a, app=self.app).apply_async()
            self.trace.append(f"workflow e:{a} parallel={parallel} retry={retry} {res.id[:8]}")
            self.discover()

        @rule(kill=st.booleans())
        def deliver_next(self, kill: bool) -> None:
            """The oldest message (countdowns not waited for); ``kill``: its process dies in the body."""
            msgs = self.queued_msgs()
            if not msgs:
                return
            msg = msgs[0]
            self.take(msg)
            # a workflow member's kill is the soak's (chaos.workflows); here plain, shared, queued and burst work
            if kill and msg.task in ("x.plain", "x.shared", "x.queued", "x.burst", "x.pair"):
                self.to_kill = msg.task_id
            out = self.run_msg(msg)
            self.to_kill = None
            self.trace.append(f"deliver {msg.task} {msg.task_id[:8]} {msg.custom()} -> {_short(out)} {self.locks()}")

        @rule(i=st.integers(min_value=1, max_value=20))
        def redeliver(self, i: int) -> None:
            """The broker delivers a copy of a queued message again (a lost ack); the message stays queued."""
            msgs = self.queued_msgs()
            if len(msgs) < 2:
                return
            msg = msgs[i % len(msgs)]
            out = self.run_msg(msg)
            self.trace.append(f"redeliver {msg.task} {msg.task_id[:8]} -> {_short(out)} {self.locks()}")

        @rule(a=st.sampled_from(ENTITIES), slot=st.sampled_from((0, 1)))
        def force_release(self, a: int, slot: int) -> None:
            """``celery lockguard release e:<a> [--slot 1] -y``: FORCE_RELEASE, then the wake of its oldest waiter."""
            key = slot_lock_name(self.prefix, f"e:{a}", slot)
            holder = self.r.hgetall(key)
            if not holder:
                return
            s = lockguard_settings(self.app)
            _, _, evicted, woken = L.force_release(
                self.r, self.prefix, f"e:{a}", int(s.fence_ttl * 1000), slot=slot, reserve_ms=handoff.reserve_ms()
            )
            handoff.wake(self.app, s, woken, holder.get("task_name") or "-", evicted)
            CROSSINGS["forced"] += 1
            self.forced.add(a)
            self.dead.pop(key, None)
            self.foreign.pop(key, None)
            self.trace.append(f"force_release e:{a} slot={slot} evicted={evicted[:8]} woken={woken} {self.locks()}")

        @rule()
        def time_passes(self) -> None:
            """A killed holder's lease runs out; a start window slides (the server's clock is the one both read)."""
            if not self.dead and not any(self.starts.values()):
                return
            time.sleep(DEAD_MS / 1000 + 0.05)
            self.trace.append(f"time passes {self.locks()}")

        # -- invariants ------------------------------------------------------------------------------------

        def alone(self, task: Any, kind: str, a: int) -> None:
            """No two bodies on one entity: every lease hash on ``e:{a}`` is this body's, its workflow's, or
            (for a ``shared`` body) another slot of ``shared``; a killed body's lease still counts."""
            mine = {k for x in (task.lock, task.workflow_lock) if x is not None for k in _keys_of(x)}
            for slot in range(LIMIT):
                key = slot_lock_name(self.prefix, f"e:{a}", slot)
                h = self.r.hgetall(key)
                if not h or key in mine:
                    continue
                both_slots = kind == "shared" and "slot" in h and h.get("task_name") == "x.shared"
                assert both_slots, (
                    f"{kind} {task.request.id[:8]} runs on e:{a} beside {h.get('task_name')} "
                    f"{h.get('task_id', '')[:8]} ({h.get('state')}, slot {h.get('slot')})\n{self.history()}"
                )

        def slots_held(self, a: int) -> int:
            return sum(bool(self.r.exists(slot_lock_name(self.prefix, f"e:{a}", i))) for i in range(LIMIT))

        @invariant()
        def starts_within_rate(self) -> None:
            for a, starts in self.starts.items():
                at = sorted(starts)
                for i in range(len(at) - rate.count):
                    assert at[i + rate.count] - at[i] >= rate.window_ms, f"too many starts in a window on e:{a}: {at}"

        @invariant()
        def no_body_runs_twice(self) -> None:
            twice = {t: n for t, n in self.runs.items() if n > 1 and t not in self.retried and t not in self.killed}
            assert not twice, f"bodies ran twice: {twice}\n{self.history()}"

        @invariant()
        def no_claim_or_reservation_outlives_its_message(self) -> None:
            queued: dict[str, list[Msg]] = {}
            for m in self.queued_msgs():
                queued.setdefault(m.task_id, []).append(m)
            # every entity's leases: e:<a>'s slots, and o:<a>, the entity a workflow's member locks of its own
            leases = [slot_lock_name(self.prefix, f"e:{a}", i) for a in ENTITIES for i in range(LIMIT)]
            for key in leases + [lock_name(self.prefix, f"o:{a}") for a in ENTITIES]:
                h = self.r.hgetall(key)
                if h.get("state") in ("queued", "publishing", "handed") and key not in self.dead:
                    assert h["task_id"] in queued, f"{key} {h.get('state')} for {h['task_id']}, no message\n" + (
                        self.history()
                    )
                if h.get("state") == "handed":  # a woken waiter starts now: its woken copy has no countdown
                    now = [m for m in queued[h["task_id"]] if m.custom().get("lockguard_woken") or not _eta(m)]
                    assert now, f"{key} is handed to {h['task_id']}, whose copies all wait\n{self.history()}"

        @invariant()
        def no_waiter_parked_behind_a_free_entity(self) -> None:
            """A waiter starts within a bound after any lease end: never parked while the entity (or, for a
            shared waiter, a slot) is free -- except after a killed holder's lease ran out (no code ran)."""
            seen = {}
            for a in ENTITIES:  # read first, then see which killed leases ran out: one may do so in between
                entries = self.r.hgetall(waiters_name(self.prefix, f"e:{a}"))
                order = self.r.lrange(wait_name(self.prefix, f"e:{a}"), 0, -1)
                lock = self.r.hgetall(lock_name(self.prefix, f"e:{a}"))
                seen[a] = (entries, order, lock, self.slots_held(a))
            for key, a in list(self.dead.items()):
                if not self.r.exists(key):
                    del self.dead[key]
                    self.excused.add(a)
            for a in ENTITIES:
                if a in self.excused:
                    continue
                entries, order, lock, held = seen[a]
                parked = [p for p in order if entries.get(f"s:{p}") == "parked"]
                if not parked:
                    continue
                assert held, f"e:{a} is free with {len(parked)} waiters parked\n{self.history()}"
                exclusive = bool(lock) and "slot" not in lock
                head_shared = entries.get(f"k:{parked[0]}") == "s"
                if head_shared and not exclusive:
                    assert held == LIMIT, f"a slot of e:{a} is free, the shared head waiter parked\n{self.history()}"
            for a in ENTITIES:  # a member's own entity: only other holders and members' own leases, never killed
                entries = self.r.hgetall(waiters_name(self.prefix, f"o:{a}"))
                order = self.r.lrange(wait_name(self.prefix, f"o:{a}"), 0, -1)
                if any(entries.get(f"s:{p}") == "parked" for p in order):
                    assert self.r.exists(lock_name(self.prefix, f"o:{a}")), f"o:{a} is free, waiters parked\n" + (
                        self.history()
                    )

        # -- the end ---------------------------------------------------------------------------------------

        def history(self) -> str:
            return "\n".join(self.trace[-int(os.environ.get("LOCKGUARD_MODEL_HISTORY", "30")) :])

        def locks(self) -> str:
            out = []
            for a in ENTITIES:
                for slot in range(LIMIT):
                    h = self.r.hgetall(slot_lock_name(self.prefix, f"e:{a}", slot))
                    if h:
                        out.append(f"e:{a}/{slot}={h.get('state')}/{h.get('task_name')}/{h.get('task_id', '')[:8]}")
                n = self.r.llen(wait_name(self.prefix, f"e:{a}"))
                if n:
                    out.append(f"e:{a} waiters={n}")
            return " ".join(out) + f" q={[m.task_id[:8] for m in self.queued_msgs()]}"

        def dead_run_out(self) -> None:
            """Wait (poll, bounded) until every killed delivery's lease has run out by its TTL."""
            deadline = time.monotonic() + 5 * DEAD_MS / 1000
            while any(self.r.exists(k) for k in self.dead) and time.monotonic() < deadline:
                time.sleep(0.02)

        def drain(self) -> None:
            """Deliver until the queue is empty, each message at its due time (killed leases run out first)."""
            self.dead_run_out()
            for _ in range(400):
                msgs = self.queued_msgs()
                if not msgs:
                    return
                due = [(_eta(m), i) for i, m in enumerate(msgs)]
                eta, i = min(due)
                wait = eta - time.time()
                if 0 < wait <= 1.0:  # a start window sliding, a killed lease running out: wait for it
                    time.sleep(wait)  # (a safety copy behind a live holder goes now: its waiter is woken first)
                self.take(msgs[i])
                out = self.run_msg(msgs[i])
                self.trace.append(f"drain {msgs[i].task} {msgs[i].task_id[:8]} -> {_short(out)} {self.locks()}")

        def teardown(self) -> None:
            try:
                for lease in self.foreign.values():
                    _, _, woken = L.release_and_wake(self.r, lease, self.prefix, reserve_ms=handoff.reserve_ms())
                    handoff.wake(self.app, lockguard_settings(self.app), woken, "other", lease.task_id)
                self.drain()
                assert self.r.llen(self.queue_key) == 0, f"the queue did not drain\n{self.history()}"
                allowed: tuple[type[BaseException], ...] = (LockContended,)
                for tid, kind in self.jobs.items():
                    res = self.app.AsyncResult(tid)
                    assert res.state in ("SUCCESS", "FAILURE"), f"{kind} {tid} lost: {res.state}\n{self.history()}"
                    if res.state == "FAILURE":
                        exc = res.result
                        ok = allowed + ((LockLost,) if kind in ("x.step", "x.own") else ())
                        assert isinstance(exc, ok), f"{kind} {tid} failed {exc!r}\n{self.history()}"
                    elif kind in ("plain", "shared", "queued", "pair", "x.step", "x.own"):
                        assert self.runs.get(tid), f"{kind} {tid} SUCCESS without its body\n{self.history()}"
                for tid, holder in self.answered_by.items():
                    assert holder in self.jobs, f"{tid} was answered with {holder}, which is no job"
                for a, order in self.bursts.items():
                    for tid in order:  # a superseded publish names a run, along a chain that ends in one
                        out, seen = self.app.AsyncResult(tid).result, [tid]
                        while isinstance(out, dict) and out.get("lockguard") == "superseded":
                            seen.append(out["superseded_by"])
                            assert len(seen) <= len(order) + 1, f"a cycle of superseded results: {seen}"
                            out = self.app.AsyncResult(seen[-1]).result
                        end = seen[-1]
                        assert self.runs.get(end) or isinstance(out, LockContended), f"{seen} ends in no run {out!r}"
                    if order and not isinstance(self.app.AsyncResult(order[-1]).result, LockContended):
                        assert self.runs.get(order[-1]), (
                            f"the last publish of e:{a}'s burst never ran\n{self.history()}"
                        )
                self.dead_run_out()  # a killed lease evicted meanwhile, or re-killed: nothing releases it, its TTL does
                leftovers = [
                    k
                    for k in self.r.scan_iter(f"{self.prefix}:v1:*", count=SCAN_COUNT)
                    if k.endswith(":wait") or ":lock" in k or k.endswith(":claim")
                ]
                assert leftovers == [], f"left behind: {leftovers}\n{self.history()}"
            finally:
                delete_prefix(self.r, self.prefix)
                connection.forget_clients()

    return Crossings


def _keys_of(lease: Any) -> list[str]:
    """The lease hashes a lease holds: one, or one per entity of a multi-entity lease."""
    return list(getattr(lease, "redis_keys", [lease.redis_key]))


def _eta(msg: Msg) -> float:
    eta = msg.headers.get("eta")
    if not eta:
        return 0.0
    from datetime import datetime

    return datetime.fromisoformat(eta).timestamp()


def _short(out: Any) -> str:
    text = repr(getattr(out, "exception", out))
    return text if len(text) < 80 else text[:77] + "..."


#: Examples per cell: a deep run sets LOCKGUARD_MODEL_EXAMPLES (the default keeps `-m model` near two minutes).
EXAMPLES = int(os.environ.get("LOCKGUARD_MODEL_EXAMPLES", "6"))
#: Cells: each crosses a few features on the same entities (one machine over all of them would need far more
#: examples to reach each pair), and every cell also kills, force-releases and publishes None fields.
CELLS = {
    "park_limit_until_done": ("plain", "shared", "queued"),
    "debounce_park_limit": ("burst", "plain", "shared"),
    "workflow_limit_park": ("workflow", "plain", "shared"),
    "workflow_debounce_until_done": ("workflow", "burst", "queued"),
    "multi_entity_limit_until_done": ("pair", "plain", "shared", "queued"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_model_of_crossing_features(cell: str, redis_url: str) -> None:
    before = dict(CROSSINGS)
    must = ["woken", "forced", "empty_field"]
    must += ["workflow_members"] if "workflow" in CELLS[cell] else ["killed"]
    must += ["superseded"] if "burst" in CELLS[cell] else []

    def exercised() -> bool:
        return all(CROSSINGS[k] > before[k] for k in must)

    try:
        run(crossing_machine(redis_url, CELLS[cell]), examples=EXAMPLES, steps=30, exercised=exercised)
    except AssertionError as exc:
        reached = {k: CROSSINGS[k] - before[k] for k in CROSSINGS}
        raise AssertionError(f"{exc}; reached {reached}, must reach {must}") from exc
