"""The lease-hash reader: one parser for what the scripts write, strict about numbers, one row per hash."""

from __future__ import annotations

import pytest

from celery_lockguard._holders import STATES, HeldLease, number
from celery_lockguard._keys import lock_name, parse_lock_name

WRITTEN = {
    "token": "tok", "task_id": "t-1", "task_name": "billing.charge", "digest": "d", "host": "web-3", "pid": "4242",
    "worker": "celery@web-3", "state": "running", "acquired_at": "1000", "renewed_at": "4000", "ttl": "30000",
    "fence": "1732900112345678",
}  # fmt: skip


def test_a_hash_as_the_scripts_write_it_reads_back_whole() -> None:
    lease = HeldLease.from_hash("lg", lock_name("lg", "invoice:7"), WRITTEN, 25_000, now_ms=5000)
    assert lease.as_dict() == {
        "key": "invoice:7", "redis_key": "lg:v1:{invoice:7}:lock", "state": "running",
        "task_name": "billing.charge", "task_id": "t-1", "worker": "celery@web-3", "host": "web-3", "pid": 4242,
        "fence": 1732900112345678, "held_for_ms": 4000, "since_renewal_ms": 1000, "ttl_left_ms": 25_000,
        "lease_ttl_ms": 30000, "malformed": [],
    }  # fmt: skip


@pytest.mark.parametrize("state", STATES)
def test_every_state_a_script_writes_is_known(state: str) -> None:
    assert HeldLease.from_hash("lg", "x", {**WRITTEN, "state": state}, 1, 0).malformed == ()


@pytest.mark.parametrize("value", ["²", "١٢", "1.5", "1e3", "-1", " 1", "1\n", "nan", "0x10", "9" * 19])
def test_numbers_are_ascii_digits_only(value: str) -> None:
    assert number(value) is None
    lease = HeldLease.from_hash("lg", "x", {**WRITTEN, "fence": value}, 1, 0)
    assert lease.fence is None and lease.malformed == ("fence",)


def test_a_claim_written_without_a_fence_is_not_malformed() -> None:
    lease = HeldLease.from_hash("lg", "x", {**WRITTEN, "fence": "", "state": "queued"}, -1, 0)
    assert lease.fence is None and lease.ttl_left_ms is None and lease.malformed == ()


@pytest.mark.parametrize("key", ["invoice:7", "a", "x}:lock", "{"])
def test_parse_lock_name_inverts_lock_name(key: str) -> None:
    assert parse_lock_name("lg", lock_name("lg", key)) == key
    assert parse_lock_name("other", lock_name("lg", key)) is None
    assert parse_lock_name("lg", "lg:v1:{}:lock") is None and parse_lock_name("lg", key) is None


def test_a_slot_lease_reads_back_its_slot_limit_and_window() -> None:
    from celery_lockguard._keys import slot_lock_name

    fields = {**WRITTEN, "slot": "2", "limit": "3", "rate": "100", "window": "60000"}
    lease = HeldLease.from_hash("lg", slot_lock_name("lg", "tenant:a", 2), fields, 1, 5000)
    row = lease.as_dict()
    assert (row["key"], row["slot"], row["limit"], row["rate"], row["window_ms"]) == ("tenant:a", 2, 3, 100, 60000)
    assert lease.label == "tenant:a (slot 2)" and lease.malformed == ()
    assert "slot" not in HeldLease.from_hash("lg", lock_name("lg", "k"), WRITTEN, 1, 0).as_dict()


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("lg:v1:{a}:lock", ("a", 0)),
        ("lg:v1:{a}:lock:3", ("a", 3)),
        ("lg:v1:{a:lock:3}:lock", ("a:lock:3", 0)),
        ("lg:v1:{a}:lock:0", None),
        ("lg:v1:{a}:lock:03", None),
        ("lg:v1:{a}:lock:x", None),
        ("lg:v1:{}:lock:1", None),
        ("lg:v1:{a}:fence", None),
    ],
)
def test_slot_lock_names_parse_back(name: str, parsed: tuple[str, int] | None) -> None:
    from celery_lockguard._keys import parse_slot_lock_name, slot_lock_name

    assert parse_slot_lock_name("lg", name) == parsed
    if parsed is not None:
        assert slot_lock_name("lg", *parsed) == name and parse_lock_name("lg", name) == parsed[0]
