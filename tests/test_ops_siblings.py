"""A multi-entity holder (issue 32: ``lock_key`` as a sequence) as the operator's views show it.

Each entity's ``{K}:lock`` hash carries ``siblings``: a JSON array of the other rendered entity keys of
the same acquisition. ``locks`` (text and ``--json``), the page, ``release`` and the held-now gauge show
the holder once per entity and name its siblings. The field is planted here, as the holder tests plant
leases; a hostile ``siblings`` (bad JSON, another type, megabytes) is one malformed field of one row.
"""

from __future__ import annotations

import json
import time

import pytest
import redis
from celery import Celery

from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard import _multi as multi
from celery_lockguard._keys import lock_name
from celery_lockguard._lease import MultiLease

from .conftest import make_cfg
from .test_cli_hostile import app, invoke, raw, strict_json  # noqa: F401 - app, raw: the CLI's fixtures
from .test_page import PageServer, pages, start_page  # noqa: F401 - pages: stops the page servers

ENTITIES = ["acct:1", "acct:2", "acct:\u00e9"]  # one acquisition: three entities, one task id


def plant_multi(r: redis.Redis, prefix: str, keys: list[str], task_id: str = "t-multi") -> None:
    """One acquisition of ``keys``, as the multi-entity ACQUIRE writes it: a lease per entity naming the others."""
    for key in keys:
        got = L.acquire(
            r, prefix, key, ttl_ms=60_000, task_id=task_id, task_name="bank.transfer", digest="d", worker="w@h",
            fence_ttl_ms=60_000,
        )  # fmt: skip
        assert isinstance(got, L.Lease)
        r.hset(lock_name(prefix, key), "siblings", json.dumps([k for k in keys if k != key]))


HOSTILE = {
    "bad-json": "[not json",
    "an-object": '{"acct:9": 1}',
    "numbers": "[1, 2]",
    "empty-key": '["acct:9", ""]',
    "deep": "[" * 100_000,
    "huge": json.dumps(["k"] * 200_000),
    "not-utf8": b'["\xff"]',
}


def hold_transfer(r: redis.Redis, prefix: str, keys: tuple[str, ...]) -> MultiLease:
    """``bank.transfer`` (id ``t-real``) holding every entity of ``keys`` as ACQUIRE_MULTI writes them."""
    lease = multi.acquire(
        r, prefix, keys, ttl_ms=60_000, task_id="t-real", task_name="bank.transfer", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(lease, MultiLease)
    return lease


def test_locks_shows_each_entity_once_and_names_its_siblings(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    prefix: str,
) -> None:
    plant_multi(r, prefix, ENTITIES)
    L.acquire(r, prefix, "solo", ttl_ms=60_000, task_id="t-solo", task_name="n", digest="d", worker="w", fence_ttl_ms=1)
    out = invoke(app, "locks")
    assert out.exit_code == 0, out.output
    rows = [line for line in out.stdout.splitlines() if "t-multi" in line]
    assert len(rows) == 3, out.stdout  # once per entity
    assert any(line.startswith("acct:1 (with acct:2, acct:\u00e9 [acct:\\xe9])") for line in rows), rows
    assert any(line.startswith("acct:\u00e9 [acct:\\xe9] (with acct:1, acct:2)") for line in rows), rows
    solo = next(line for line in out.stdout.splitlines() if "t-solo" in line)
    assert "(with" not in solo
    data = {row["key"]: row for row in strict_json(invoke(app, "locks", "--json").stdout)}
    assert data["acct:2"]["siblings"] == ["acct:1", "acct:\u00e9"] and data["acct:2"]["sibling_count"] == 2
    assert "siblings" not in data["solo"]  # a single entity's row stays as it was
    every = [row for row in strict_json(invoke(app, "locks", "--all", "--json").stdout) if row["task_id"] == "t-multi"]
    assert sorted(row["key"] for row in every) == sorted(ENTITIES)
    assert all(row["sibling_count"] == 2 for row in every)


def test_a_long_sibling_list_is_cut_in_the_row_and_counted(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    keys = [f"item:{i}" for i in range(40)]
    plant_multi(r, prefix, keys[:1])
    r.hset(lock_name(prefix, "item:0"), "siblings", json.dumps(keys[1:]))
    out = invoke(app, "locks")
    assert "item:0 (with item:1, item:2, item:3 and 36 more)" in out.stdout, out.stdout
    (row,) = strict_json(invoke(app, "locks", "--json").stdout)
    assert row["sibling_count"] == 39 and len(row["siblings"]) == 32


def test_a_hostile_siblings_field_is_one_malformed_field_of_its_row(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    raw: redis.Redis,  # noqa: F811
    prefix: str,
) -> None:
    for name, value in HOSTILE.items():
        plant_multi(r, prefix, [name])
        raw.hset(lock_name(prefix, name), "siblings", value)
    started = time.monotonic()
    out = invoke(app, "locks", "--limit", "100")
    assert out.exit_code == 0 and time.monotonic() - started < 30, out.output
    rows = [line for line in out.stdout.splitlines() if "t-multi" in line]
    assert len(rows) == len(HOSTILE) and not any("(with" in line for line in rows), out.stdout
    assert "siblings" in out.stderr  # named as a value no worker writes
    data = strict_json(invoke(app, "locks", "--json").stdout)
    assert all("siblings" in row["malformed"] and "sibling_count" not in row for row in data), data
    asked = invoke(app, "release", "bad-json", input="n\n")  # the prompt reads the same field
    assert "Force-release" in asked.output and "also holds" not in asked.output


def test_release_names_the_siblings_it_leaves_held(app: Celery, r: redis.Redis, prefix: str) -> None:  # noqa: F811
    plant_multi(r, prefix, ENTITIES)
    asked = invoke(app, "release", "acct:1", input="n\n")
    assert "which also holds acct:2, acct:\u00e9 [acct:\\xe9]" in asked.output, asked.output
    done = invoke(app, "release", "acct:1", "--yes")
    assert done.exit_code == 0, done.output
    assert "its holder also holds acct:2, acct:\u00e9 [acct:\\xe9]: those stay held" in done.output, done.output
    assert r.exists(lock_name(prefix, "acct:2")) and not r.exists(lock_name(prefix, "acct:1"))


@pytest.mark.integration  # a real exporter process, as tests/test_page.py (the compat cells leave them out)
def test_the_page_names_each_entitys_siblings(
    redis_url: str,
    r: redis.Redis,
    prefix: str,
    pages: list[PageServer],  # noqa: F811
) -> None:
    plant_multi(r, prefix, ENTITIES)
    plant_multi(r, prefix, ["broken"], task_id="t-broken")
    r.hset(lock_name(prefix, "broken"), "siblings", "[1, 2]")
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    code, _, body = page.get("/page")
    html = body.decode()
    assert code == 200
    assert "acct:1 (with acct:2, acct:\u00e9 [acct:\\xe9])" in html
    assert "acct:2 (with acct:1, acct:\u00e9 [acct:\\xe9])" in html
    data = page.data()
    assert data is not None
    by_key = {lease["key"]: lease for lease in data["leases"]}
    assert by_key["acct:1"]["siblings"] == ["acct:2", "acct:\u00e9"]
    assert "siblings" in by_key["broken"]["malformed"]


class _Several:
    """A lease of several entities as the held-now registry reads one (``keys``; the multi-entity lease has them)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys, self.task_name, self.held, self.acquired_at = keys, "bank.transfer", True, time.monotonic()


def test_the_held_now_gauge_counts_a_multi_entity_lease_once_per_entity() -> None:
    several, single = (
        _Several(("acct:1", "acct:2", "acct:3")),
        L.Lease("k", "p", "tok", 1, 30_000, time.monotonic(), "i", "n"),
    )
    metrics.lease_held(several, "w@h")
    metrics.lease_held(single, "w@h")
    try:
        got = {row["task"]: row["held"] for row in metrics.held_now()}
        assert got == {"bank.transfer": 3, "n": 1}
    finally:
        metrics.lease_ended(several)
        metrics.lease_ended(single)


def test_a_real_multi_entity_acquisition_shows_once_per_entity_with_its_siblings(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    prefix: str,
) -> None:
    """The contract end to end: what ACQUIRE_MULTI writes is what the views read (no planted field)."""
    keys = ("acct:1", "acct:2", "acct:\u00e9")
    lease = hold_transfer(r, prefix, keys)
    rows = {row["key"]: row for row in strict_json(invoke(app, "locks", "--json").stdout)}
    assert set(rows) == set(keys)
    assert {k: sorted(row["siblings"]) for k, row in rows.items()} == {k: sorted(set(keys) - {k}) for k in keys}
    assert "acct:2 (with acct:1, acct:\u00e9 [acct:\\xe9])" in invoke(app, "locks").stdout
    metrics.lease_held(lease, "w@h")
    try:
        assert {row["task"]: row["held"] for row in metrics.held_now()} == {"bank.transfer": 3}
    finally:
        metrics.lease_ended(lease)


def test_describe_an_entity_of_a_multi_entity_holder_names_its_siblings(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    prefix: str,
) -> None:
    """``describe KEY``: the holder of one entity, and the other entities of its acquisition, as ACQUIRE_MULTI
    wrote them (text and ``--json``); a free entity says so; a single lease names no siblings."""
    keys = ("acct:1", "acct:2", "acct:3")
    hold_transfer(r, prefix, keys)
    out = invoke(app, "describe", "acct:2")
    assert out.exit_code == 0, out.output
    assert "acct:2 (with acct:1, acct:3)" in out.stdout and "t-real" in out.stdout
    assert "acct:2 is held with acct:1, acct:3 by the same acquisition (bank.transfer[t-real])" in out.stdout
    (row,) = strict_json(invoke(app, "describe", "acct:2", "--json").stdout)
    assert (row["key"], row["task_id"], sorted(row["siblings"]), row["waiting"]) == (
        "acct:2", "t-real", ["acct:1", "acct:3"], 0
    )  # fmt: skip
    full = invoke(app, "describe", lock_name(prefix, "acct:3")).stdout  # the full Redis key names it too
    assert "acct:3 (with acct:1, acct:2)" in full
    assert "is free" in invoke(app, "describe", "acct:9").stdout
    assert strict_json(invoke(app, "describe", "acct:9", "--json").stdout) == []
    L.acquire(r, prefix, "solo", ttl_ms=60_000, task_id="t-solo", task_name="n", digest="d", worker="w", fence_ttl_ms=1)
    solo = invoke(app, "describe", "solo").stdout
    assert "t-solo" in solo and "same acquisition" not in solo and "(with" not in solo


def test_describe_an_entity_of_lock_limit_slots_reads_every_slot_by_name(
    app: Celery,  # noqa: F811
    r: redis.Redis,
    prefix: str,
) -> None:
    """Slots are read up to the app's largest ``lock_limit``: slot 0 free does not make the entity look free."""
    from celery_lockguard import LockedTask

    @app.task(base=LockedTask, shared=False, name="pool.use", lock_key="pool:{a}", lock_limit=3)
    def use(a: int) -> None: ...

    leases = []
    for i in range(3):
        got = L.acquire(
            r, prefix, "pool:1", ttl_ms=60_000, task_id=f"t-{i}", task_name="pool.use", digest=str(i), worker="w",
            fence_ttl_ms=60_000, limit=3,
        )  # fmt: skip
        assert isinstance(got, L.Lease)
        leases.append(got)
    L.release(r, leases[0], prefix)
    rows = strict_json(invoke(app, "describe", "pool:1", "--json").stdout)
    assert sorted(row["task_id"] for row in rows) == sorted(lease.task_id for lease in leases[1:])
    assert "t-1" in invoke(app, "describe", "pool:1").stdout
