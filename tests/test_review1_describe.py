"""``describe KEY`` against the queue claims an entity may carry besides its lease (review1).

An ``until_started`` message claims ``{K}:claim`` at publish time, and an ``until_done`` one queued behind
*different* work claims it too: while it stands, identical work is not enqueued again. ``describe KEY`` must
show that claim, not say the entity is free while the operator's next ``apply_async`` is refused.
"""

from __future__ import annotations

import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard._keys import claim_name
from celery_lockguard.testing import wait_for

from .test_cli_hostile import app, invoke, strict_json  # noqa: F401 - app: the CLI's fixture
from .test_locks_claims import hold_other_work


def confirmed(r: redis.Redis, name: str) -> None:
    """Wait for the claim's CONFIRM_CLAIM (it rides in the next write or is sent within 20 ms): until then the
    claim reads ``publishing``, not ``queued``."""
    wait_for(lambda: r.hget(name, "state") == "queued", 10, what=f"{name} to be confirmed")


def test_describe_shows_an_until_started_queue_claim(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    @app.task(base=LockedTask, shared=False, name="q.started", lock_key="inv:{a}", lock_mode="until_started")
    def started(a: int) -> None: ...

    sent = started.apply_async((1,))
    assert r.exists(claim_name(prefix, "inv:1")), "the publish claimed the entity"
    confirmed(r, claim_name(prefix, "inv:1"))
    text = invoke(app, "describe", "inv:1")
    assert text.exit_code == 0 and "is free" not in text.stdout, text.stdout
    assert "queued" in text.stdout and sent.id in text.stdout
    (row,) = strict_json(invoke(app, "describe", "inv:1", "--json").stdout)
    assert (row["key"], row["state"], row["task_id"], row["redis_key"]) == (
        "inv:1", "queued", sent.id, claim_name(prefix, "inv:1")
    )  # fmt: skip


def test_describe_shows_an_until_done_claim_queued_behind_different_work(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    prefix: str,
) -> None:
    @app.task(base=LockedTask, shared=False, name="q.done", lock_key="doc:{a}", lock_mode="until_done")
    def done(a: int) -> None: ...

    hold_other_work(r, prefix, "doc:1")
    sent = done.apply_async((1,))
    assert r.exists(claim_name(prefix, "doc:1")), "queued behind the different work holding the lease"
    confirmed(r, claim_name(prefix, "doc:1"))
    rows = strict_json(invoke(app, "describe", "doc:1", "--json").stdout)
    assert sorted((row["key"], row["state"], row["task_id"]) for row in rows) == [
        ("doc:1", "queued", sent.id),
        ("doc:1", "running", "t-other"),
    ]
