"""``lock_limit`` crossed with ``until_done`` on the real Redis (CLAIM, ACQUIRE, ACQUIRE_SLOTS).

The suspected over-exclusion ("the ``until_done`` CLAIM does not consult the ``lock_limit`` slots, so a
task with ``lock_limit=2`` and ``until_done`` may be refused where a slot is free") cannot arise on one
task: that combination is refused when the task is configured. What remains is two tasks on one entity,
a ``lock_limit`` task (shared slots) and an ``until_done`` task (the exclusive single lease). Here:

* the ``until_done`` publish is never refused because slots are held: CLAIM answers ``ok`` -- in the
  lease hash when slot 0 is free, behind it in ``{K}:claim`` when a slot holder has slot 0;
* its delivery waits until every slot is free (exclusive), then runs;
* its claim queued in ``{K}:lock`` keeps new slot holders out meanwhile (writer preference, as
  docs/limits.md says for an ``until_done`` claim), even with a slot free: documented, not a defect.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _lease as L
from celery_lockguard._claims import claim_keys
from celery_lockguard._keys import lock_name
from celery_lockguard.exceptions import ConfigurationError

KEY = "partner:1"


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("limituntildone", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    yield a


def slot_holder(r: redis.Redis, prefix: str, limit: int, name: str = "export") -> L.Lease:
    got = L.acquire(
        r, prefix, KEY, ttl_ms=10_000, task_id=f"{name}-{L.new_token()[:6]}", task_name=name,
        digest=L.new_token(), worker="w", fence_ttl_ms=60_000, limit=limit,
    )  # fmt: skip
    assert isinstance(got, L.Lease), got
    return got


def claim(r: redis.Redis, prefix: str, task_id: str) -> tuple[L.Claimed, str]:
    token = L.new_token()
    got = L.claim(
        r, claim_keys(prefix, KEY, "until_done"), token=token, ttl_ms=60_000, task_id=task_id,
        task_name="purge", digest="d-purge",
    )  # fmt: skip
    return got, token


def deliver(r: redis.Redis, prefix: str, task_id: str, token: str) -> L.Lease | L.Holder | L.Done | L.Throttled:
    """The until_done delivery's ACQUIRE, adopting its own claim (replace_token), as the runtime does."""
    return L.acquire(
        r, prefix, KEY, ttl_ms=10_000, task_id=task_id, task_name="purge", digest="d-purge", worker="w",
        fence_ttl_ms=60_000, replace_token=token,
    )  # fmt: skip


def test_one_task_with_lock_limit_and_until_done_is_refused_when_configured(app: Celery) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="t.both", lock_key="p:{p}", lock_limit=2,
              lock_mode="until_done")  # fmt: skip
    def both(self: object, p: int) -> int:
        return p

    with pytest.raises(ConfigurationError, match="lock_limit"):
        both.apply(args=(1,)).get()


def test_an_until_done_publish_beside_a_held_slot_is_accepted_and_runs_once_the_slots_are_free(
    r: redis.Redis, prefix: str
) -> None:
    export = slot_holder(r, prefix, limit=2)  # slot 0 (the lease hash) held by a shared holder
    got, token = claim(r, prefix, "purge-1")
    assert got.kind == "ok"  # never refused for the slots: it queues behind them in {K}:claim
    held = deliver(r, prefix, "purge-1", token)
    assert isinstance(held, L.Holder) and held.task_id == export.task_id  # exclusive: waits for the slot
    L.release(r, export, prefix)
    ran = deliver(r, prefix, "purge-1", token)
    assert isinstance(ran, L.Lease)


def test_an_until_done_claim_on_a_free_slot_0_waits_for_slot_1_and_keeps_new_slot_holders_out(
    r: redis.Redis, prefix: str
) -> None:
    first = slot_holder(r, prefix, limit=3)
    second = slot_holder(r, prefix, limit=3)
    L.release(r, first, prefix)  # slot 0 free again, slot 1 held
    assert second.slot == 1
    got, token = claim(r, prefix, "purge-2")
    assert got.kind == "ok" and r.hget(lock_name(prefix, KEY), "task_id") is not None  # queued in slot 0's hash
    held = deliver(r, prefix, "purge-2", token)
    assert isinstance(held, L.Holder) and held.slot == 1  # the slot it waits for
    # Writer preference (docs/limits.md): the queued exclusive claim refuses a new shared holder, slot 2 free or not.
    late = L.acquire(
        r, prefix, KEY, ttl_ms=10_000, task_id="export-late", task_name="export", digest="d-late", worker="w",
        fence_ttl_ms=60_000, limit=3,
    )  # fmt: skip
    assert isinstance(late, L.Holder) and late.slot == 0 and late.state == "queued"
    L.release(r, second, prefix)
    ran = deliver(r, prefix, "purge-2", token)
    assert isinstance(ran, L.Lease)
