"""``lock_debounce`` crossed with park/hand-off, dead workers and revokes, with real prefork workers.

Every body here is ``debounced_gate``: it runs until the test creates its gate file, so the test
decides when the holder releases, not a timer racing a loaded machine.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_lockguard._keys import debounce_name, wait_name

from .conftest import Fleet, make_cfg
from .harness import wait_for

pytestmark = pytest.mark.integration


def rows(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    return [x for x in (json.loads(v) for v in r.lrange(f"{prefix}:record", 0, -1)) if x["key"] == key]


def starts(r: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    return [x for x in rows(r, prefix, key) if x["ev"] == "start"]


def superseded_by(survivor: str) -> dict[str, str]:
    return {"lockguard": "superseded", "superseded_by": survivor}


class Entity:
    """One entity of ``debounced_gate`` under test: its record, its waiter queue, its gate."""

    def __init__(self, r: redis.Redis, prefix: str, tmp: Path) -> None:
        self.r, self.prefix = r, prefix
        self.k = f"k{uuid.uuid4().hex[:6]}"
        self.key = f"res:{self.k}"
        self.gate = str(tmp / f"gate-{self.k}")
        self.record = debounce_name(prefix, self.key, "debounced_gate")

    def tags(self) -> list[str]:
        return [x["tag"] for x in starts(self.r, self.prefix, self.k)]

    def taken(self, task_id: str, what: str) -> None:
        wait_for(lambda: self.r.hget(self.record, "last_run") == task_id, 60, what=what)

    def parked(self, n: int, what: str) -> None:
        wait_for(lambda: self.r.llen(wait_name(self.prefix, self.key)) >= n, 60, what=what)

    def open(self) -> None:
        Path(self.gate).touch()


def holder_running(fleet: Fleet, cfg: dict[str, Any], r: redis.Redis, tmp: Path) -> tuple[Any, Entity, Any]:
    """A worker, and v1 (the burst's run) holding the entity until the gate opens."""
    fleet.worker(cfg, concurrency=4)
    app = fleet.app(cfg)
    e = Entity(r, cfg["prefix"], tmp)
    t = app.tasks["debounced_gate"]
    v1 = t.delay(e.k, e.gate, "v1")
    wait_for(lambda: e.tags() == ["v1"], 60, what="v1 to start")
    return t, e, v1


def test_a_publish_while_a_woken_run_waits_replaces_it(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    # A is published during v1, falls due, is taken and parks behind v1. C is published before v1 ends.
    # The release wakes A: its woken copy is A's parked delivery (same burst), not a new publish, so it
    # must not start a burst of its own and replace C. At DEBOUNCE_START A finds C pending: superseded.
    cfg = make_cfg(prefix, redis_url, debounce=1.0)
    t, e, v1 = holder_running(fleet, cfg, r, tmp_path)
    a = t.delay(e.k, e.gate, "A")
    e.taken(a.id, "A to be taken")
    e.parked(1, "A to park behind v1")
    c = t.delay(e.k, e.gate, "C")
    e.open()
    assert v1.get(timeout=60) == {"tag": "v1"}
    assert c.get(timeout=60) == {"tag": "C"}
    assert a.get(timeout=60) == superseded_by(c.id)
    assert e.tags() == ["v1", "C"]


def test_two_bursts_ending_inside_one_run_are_one_more_run_with_the_last_arguments(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url, debounce=1.0)
    t, e, v1 = holder_running(fleet, cfg, r, tmp_path)
    first = [t.delay(e.k, e.gate, f"A{i}") for i in range(1, 5)]
    e.taken(first[-1].id, "A4 to be taken")
    e.parked(1, "A4 to park")
    second = [t.delay(e.k, e.gate, f"B{i}") for i in range(1, 3)]
    e.taken(second[-1].id, "B2 to be taken")
    e.parked(2, "B2 to park")
    e.open()
    assert v1.get(timeout=60) == {"tag": "v1"}
    assert second[-1].get(timeout=60) == {"tag": "B2"}
    for res in (*first, second[0]):
        value = res.get(timeout=60)
        assert value["lockguard"] == "superseded", value
    assert first[-1].get(timeout=60) == superseded_by(second[-1].id)
    assert e.tags() == ["v1", "B2"]


def test_a_woken_debounced_run_starts_at_once_not_a_debounce_later(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url, debounce=3.0)
    t, e, _ = holder_running(fleet, cfg, r, tmp_path)
    a = t.delay(e.k, e.gate, "A")
    e.taken(a.id, "A to be taken")
    e.parked(1, "A to park behind v1")
    e.open()
    assert a.get(timeout=60) == {"tag": "A"}
    ran = rows(r, prefix, e.k)
    v1_end = next(x["t"] for x in ran if x["ev"] == "end" and x["tag"] == "v1")
    a_start = next(x["t"] for x in ran if x["ev"] == "start" and x["tag"] == "A")
    assert e.tags() == ["v1", "A"]
    assert a_start - v1_end < 2.0, f"the woken run started {a_start - v1_end:.2f} s after the release"


def test_superseded_copies_redelivered_after_a_worker_death_stay_superseded(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    # queue_lock_ttl (1 s) is far shorter than the transport's redelivery horizon (visibility_timeout 8 s):
    # the burst's records must still be there when the dead worker's messages come back, else every
    # superseded copy finds no record ("missing") and runs, older arguments after newer.
    cfg = make_cfg(prefix, redis_url, acks_late=True, visibility_timeout=8, debounce=3, debounce_queue_ttl=1)
    doomed = fleet.worker(cfg, concurrency=1)
    app = fleet.app(cfg)
    e = Entity(r, prefix, tmp_path)
    e.open()  # bodies end at once
    t = app.tasks["debounced_gate"]
    burst = [t.delay(e.k, e.gate, f"t{i}") for i in range(3)]
    last = burst[-1]
    wait_for(lambda: all(res.id in doomed.output() for res in burst), 30, what="the worker to hold the burst")
    doomed.kill()
    assert not e.tags(), "killed before the burst was due"
    fleet.worker(cfg)  # the broker redelivers the unacknowledged messages after visibility_timeout
    assert last.get(timeout=90) == {"tag": "t2"}
    for res in burst[:-1]:
        assert res.get(timeout=60) == superseded_by(last.id)
    assert e.tags() == ["t2"]


def test_revoking_the_pending_run_cancels_the_burst_and_a_later_publish_runs(
    fleet: Fleet, redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    # Documented behaviour (docs/debounce.md, "Revoking a burst's run"): the messages a run superseded are
    # consumed when they fall due, before the revoked run is (it is due last), so nothing of the burst is
    # left to hand the run to. Their results name the revoked run; the next publish starts the entity again.
    cfg = make_cfg(prefix, redis_url, debounce=2.0)
    worker = fleet.worker(cfg)
    app = fleet.app(cfg)
    e = Entity(r, prefix, tmp_path)
    e.open()
    t = app.tasks["debounced_gate"]
    burst = [t.delay(e.k, e.gate, f"t{i}") for i in range(3)]
    last = burst[-1]
    app.control.revoke(last.id)
    for res in burst[:-1]:
        assert res.get(timeout=60) == superseded_by(last.id)
    wait_for(lambda: last.state == "REVOKED", 60, what="the pending run to be revoked")
    # The lost burst is never silent: the worker's main process says so when it discards the run.
    said = lambda: [x for x in worker.output().splitlines() if "lock.debounce_revoked" in x and last.id in x]  # noqa: E731
    wait_for(said, 60, what="lock.debounce_revoked")
    assert "superseded=2" in said()[0], said()
    again = t.delay(e.k, e.gate, "t3")
    assert again.get(timeout=60) == {"tag": "t3"}
    assert e.tags() == ["t3"]
