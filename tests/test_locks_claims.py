"""``locks`` lists the queue claims ``{K}:claim`` beside the leases (docs/cli.md, "locks").

An ``until_started`` message waiting in its queue, and an ``until_done`` one queued behind *different*
work, claim ``{K}:claim`` at publish time: while the claim stands identical work is not enqueued. ``locks``
(the limited default scan, ``--json``, ``--all``, ``--match``) shows it as a ``queued`` row keyed K, as
``describe KEY`` does; an ``until_done`` claim held in the lease hash itself stays the row it always was.
No worker consumes the queue here, so the claims stay until the test's prefix is deleted.
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from celery_lockguard import LockedTask
from celery_lockguard import _holders as holders
from celery_lockguard import _lease as L
from celery_lockguard._keys import claim_name, lock_name, wait_name
from celery_lockguard.testing import wait_for

from .conftest import make_cfg
from .test_cli_hostile import app, invoke, strict_json  # noqa: F401 - app: the CLI's fixture
from .test_page import PageServer, pages, start_page  # noqa: F401 - pages: stops the page servers


def hold_other_work(r: redis.Redis, prefix: str, key: str) -> L.Lease:
    """Different work (task ``other.work``, id ``t-other``) holding entity ``key``'s lease for a minute."""
    other = L.acquire(
        r, prefix, key, ttl_ms=60_000, task_id="t-other", task_name="other.work", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(other, L.Lease)
    return other


def _queue(app: Celery, r: redis.Redis, prefix: str) -> dict[str, str]:  # noqa: F811 - the fixture's name
    """Three queued messages: until_started on inv:1, until_done behind other work on doc:1, until_done on doc:2."""

    @app.task(base=LockedTask, shared=False, name="q.started", lock_key="inv:{a}", lock_mode="until_started")
    def started(a: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="q.done", lock_key="doc:{a}", lock_mode="until_done")
    def done(a: int) -> None: ...

    hold_other_work(r, prefix, "doc:1")
    ids = {"inv:1": started.apply_async((1,)).id}
    ids.update({f"doc:{a}": done.apply_async((a,)).id for a in (1, 2)})
    assert r.exists(claim_name(prefix, "inv:1")) and r.exists(claim_name(prefix, "doc:1"))
    assert r.hget(lock_name(prefix, "doc:2"), "task_id") == ids["doc:2"], "until_done claims the lease hash itself"
    # A claim reads `publishing` until its CONFIRM_CLAIM, which rides in the process's next write or is sent
    # within 20 ms (issue 33): wait for it, or a row caught in that window reads `publishing` (seen on CI).
    names = (claim_name(prefix, "inv:1"), claim_name(prefix, "doc:1"), lock_name(prefix, "doc:2"))
    wait_for(lambda: all(r.hget(n, "state") == "queued" for n in names), 10, what="the claims to be confirmed")
    return ids


def plant_claim(r: redis.Redis, prefix: str, key: str, task_id: str, age_ms: int) -> None:
    """A queued claim on ``{key}:claim`` as CLAIM writes it, taken ``age_ms`` ago by the server's clock."""
    now = holders.server_ms(r)
    r.hset(
        claim_name(prefix, key),
        mapping={
            "token": "c", "task_id": task_id, "task_name": "t", "digest": "d", "host": "h", "pid": "1",
            "worker": "", "state": "queued", "acquired_at": str(now - age_ms), "renewed_at": str(now),
            "ttl": "7200000", "fence": "",
        },
    )  # fmt: skip
    r.pexpire(claim_name(prefix, key), 7_200_000)


def _rows(rows: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {(row["key"], row["state"], row["task_id"], row["redis_key"]) for row in rows if row.get("task_id")}


def test_locks_lists_queue_claims_as_queued_rows(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    ids = _queue(app, r, prefix)
    expected = {
        ("inv:1", "queued", ids["inv:1"], claim_name(prefix, "inv:1")),
        ("doc:1", "queued", ids["doc:1"], claim_name(prefix, "doc:1")),
        ("doc:1", "running", "t-other", lock_name(prefix, "doc:1")),
        ("doc:2", "queued", ids["doc:2"], lock_name(prefix, "doc:2")),
    }
    for args in ((), ("--all",)):
        assert _rows(strict_json(invoke(app, "locks", "--json", *args).stdout)) == expected, args
        text = invoke(app, "locks", *args)
        assert text.exit_code == 0, text.stdout
        cells = [line.split() for line in text.stdout.splitlines()[1:]]
        shown = {(c[0], c[1], c[3]) for c in cells if len(c) > 3}
        assert {("inv:1", "queued", ids["inv:1"]), ("doc:1", "queued", ids["doc:1"])} <= shown, text.stdout
    assert "showing" not in invoke(app, "locks").stdout, "every row fits the default --limit"
    # --match is a glob over the entity key: it selects the claim's entity, not the others.
    for args in (("--match", "inv:*"), ("--match", "inv:*", "--all"), ("--match", "inv:1")):
        rows = strict_json(invoke(app, "locks", "--json", *args).stdout)
        assert _rows(rows) == {("inv:1", "queued", ids["inv:1"], claim_name(prefix, "inv:1"))}, args
    # The functions behind them: the limited scan (and its count), every row, and the batches of --all.
    sample = holders.top_leases(r, prefix)
    assert sample.complete and sample.total == 4 and _rows([x.as_dict() for x in sample.leases]) == expected
    assert _rows([x.as_dict() for x in holders.read_leases(r, prefix)]) == expected
    assert _rows([x.as_dict() for batch in holders.iter_leases(r, prefix) for x in batch]) == expected


def test_a_claim_takes_its_place_in_the_order(r: redis.Redis, prefix: str) -> None:
    """Most waiters, then longest held: a claim queued an hour ago comes before a lease taken just now."""
    young = L.acquire(
        r, prefix, "e:new", ttl_ms=60_000, task_id="t-new", task_name="t", digest="d", worker="w@h", fence_ttl_ms=60_000
    )  # fmt: skip
    assert isinstance(young, L.Lease)
    plant_claim(r, prefix, "e:old", "t-old", age_ms=3_600_000)
    first = holders.top_leases(r, prefix, limit=1)
    assert [(x.key, x.state, x.redis_key) for x in first.leases] == [("e:old", "queued", claim_name(prefix, "e:old"))]
    assert first.total == 2 and first.summary(1).startswith("showing 1 of 2")
    r.rpush(wait_name(prefix, "e:new"), "park-1")  # a delivery parked behind e:new: it comes first now
    assert [x.key for x in holders.top_leases(r, prefix, limit=2).leases] == ["e:new", "e:old"]


def test_the_summary_counts_leases_and_queue_claims_apart(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    """The line under the rows said ``showing N of M leases`` while M counted the queue claims too (rows of state
    ``queued`` / ``publishing``): it names both now; ``--json`` stays an array of rows, the line on stderr."""
    _queue(app, r, prefix)  # doc:1 held by other work; three queued claims (inv:1, doc:1, doc:2)
    # An until_done claim in its publishing window: CLAIM written before the publish, no CONFIRM_CLAIM yet.
    got = L.claim(
        r, lock_name(prefix, "doc:3"), token="tok-3", ttl_ms=60_000, task_id="t-pub", task_name="q.done", digest="d",
        publish_ttl_ms=15_000,
    )  # fmt: skip
    assert got.kind == "ok"
    line = "showing 1 of 5 rows: 1 lease, 4 queue claims (most waiters, then longest held, first"
    text = invoke(app, "locks", "--limit", "1")
    assert text.exit_code == 0 and line in text.stdout, text.stdout
    data = invoke(app, "locks", "--json", "--limit", "1")
    assert len(strict_json(data.stdout)) == 1 and line in data.stderr
    sample = holders.top_leases(r, prefix, limit=1)
    assert (sample.total, sample.claims) == (5, 4)
    # The publishing claim is a row of its own state in `locks` and `describe`, with the grace as its TTL.
    rows = {row["key"]: row for row in strict_json(invoke(app, "locks", "--json").stdout)}
    assert (rows["doc:3"]["state"], rows["doc:3"]["task_id"]) == ("publishing", "t-pub")
    (row,) = strict_json(invoke(app, "describe", "doc:3", "--json").stdout)
    assert row["state"] == "publishing" and 0 < row["ttl_left_ms"] <= 15_000
    assert "publishing" in invoke(app, "describe", "doc:3").stdout
    assert L.confirm_claim(r, lock_name(prefix, "doc:3"), "tok-3", 60_000)
    (row,) = strict_json(invoke(app, "describe", "doc:3", "--json").stdout)
    assert row["state"] == "queued" and row["ttl_left_ms"] > 15_000


def test_describe_resolves_a_claim_key_to_its_entity(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    ids = _queue(app, r, prefix)
    for key in (claim_name(prefix, "inv:1"), "inv:1"):
        rows = strict_json(invoke(app, "describe", key, "--json").stdout)
        assert _rows(rows) == {("inv:1", "queued", ids["inv:1"], claim_name(prefix, "inv:1"))}, key
        assert "is free" not in invoke(app, "describe", key).stdout


def test_the_page_lists_a_queue_claim(redis_url: str, r: redis.Redis, prefix: str, pages: list[PageServer]) -> None:  # noqa: F811
    """The page's sampler reads rows as ``locks`` does (every row up to its full read, else the limited scan)."""
    plant_claim(r, prefix, "inv:7", "t-queued", age_ms=1_000)
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    data = page.data()
    assert data is not None
    assert _rows(data["leases"]) == {("inv:7", "queued", "t-queued", claim_name(prefix, "inv:7"))}


def test_the_page_heading_and_note_count_rows_claims_included(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    """The page's count is of rows (leases and queue claims), as `locks`' summary is, and says so."""
    from celery_lockguard import _page_html as html
    from celery_lockguard._config import settings
    from celery_lockguard._page_state import PageState

    state = PageState(app, settings(app), interval=1, doctor_interval=3600)
    state.refresh()
    assert "no leases or queue claims under" in html.leases_section(state.snapshot)
    hold_other_work(r, prefix, "e:held")
    plant_claim(r, prefix, "e:queued", "t-queued", age_ms=1000)
    state.refresh()
    section = html.leases_section(state.snapshot)
    assert 'Leases and queue claims <span class="count">2</span>' in section
    assert state.snapshot.lease_count == 2 and {x.key for x in state.snapshot.leases} == {"e:held", "e:queued"}
