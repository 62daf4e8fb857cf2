"""The transfer soak (``chaos.transfer``): its oracle on synthetic histories, and the bounded run on a Cluster.

The oracle's functions each pass what is allowed and catch what they are for; the soak itself runs in CI as
``make chaos-transfer-quick`` (a line of ``.ci/run``). The Cluster variant is here: the same transfer check
with the leases on the private three-master test cluster, where the two accounts of a transfer live in
different slots, so the delivery takes them one slot at a time in sorted order.
"""

from __future__ import annotations

import pytest

from chaos.transfer_check import (
    Body,
    Move,
    blocked_violations,
    check,
    fence_breaks,
    lost_transfers,
    money_violations,
    overlaps,
)


def body(exec_id: int, accounts: tuple[int, ...], start: float, end: float, fence: int = 1, **kw: object) -> Body:
    return Body(exec_id, exec_id, accounts, start, end, dict.fromkeys(accounts, fence), committed=True, **kw)  # type: ignore[arg-type]


def test_bodies_sharing_an_account_may_touch_but_not_overlap() -> None:
    assert overlaps([body(1, (0, 1), 0, 1), body(2, (1, 2), 1, 2), body(3, (3, 4), 0.5, 1.5)]) == []
    found = overlaps([body(1, (0, 1), 0, 1), body(2, (2, 1), 0.9, 2)])
    assert found == ["account 1: exec 1 (transfer 1) and exec 2 (transfer 2) overlap by 0.1000 s"]


def test_a_short_body_inside_a_long_one_after_another_is_caught() -> None:
    """The overlap is with the longest-running earlier body, not only the one just before."""
    assert overlaps([body(1, (0, 1), 0, 10), body(2, (0, 2), 1, 2), body(3, (0, 3), 3, 4)]) == [
        "account 0: exec 1 (transfer 1) and exec 2 (transfer 2) overlap by 9.0000 s",
        "account 0: exec 1 (transfer 1) and exec 3 (transfer 3) overlap by 7.0000 s",
    ]


def test_a_self_transfer_is_one_account_not_an_overlap_with_itself() -> None:
    assert overlaps([body(1, (4, 4), 0, 1)]) == []


def test_fences_of_committed_bodies_rise_per_account() -> None:
    assert fence_breaks([body(1, (0, 1), 0, 1, fence=3), body(2, (1, 2), 1, 2, fence=5)]) == []
    assert fence_breaks([body(1, (0, 1), 0, 1, fence=5), body(2, (1, 2), 1, 2, fence=3)]) == [
        "account 1: exec 2 committed fence 3 after fence 5"
    ]
    no_fence = Body(3, 3, (7,), 0, 1, {}, committed=True)
    assert fence_breaks([no_fence]) == ["account 7: exec 3 committed without a fence"]
    killed = Body(4, 4, (1,), 3, 4, {1: 1}, committed=False, killed=True)  # never committed: not compared
    assert fence_breaks([body(1, (0, 1), 0, 1, fence=5), killed]) == []


def test_money_moved_once_matches_the_ledger_and_is_conserved() -> None:
    opening = {0: 100, 1: 100}
    moves = [Move(1, 0, 1, 30), Move(2, 1, 0, 10)]
    assert money_violations(opening, {0: 80, 1: 120}, moves, [1, 2]) == []
    lost_update = money_violations(opening, {0: 70, 1: 120}, moves, [1, 2])  # 0's debit of 10 overwritten
    assert lost_update == [
        "1 balances differ from their ledger (lost updates): 0: 70 != 80",
        "total balance 190 != opening total 200",
    ]
    assert money_violations(opening, {0: 50, 1: 150}, [*moves, Move(1, 0, 1, 30)], [1, 2]) == [
        "1 transfers moved money more than once: [1]"
    ]
    assert money_violations(opening, {0: 70, 1: 130}, moves[:1], [1, 2]) == ["1 transfers never moved money: [2]"]


def test_every_call_must_succeed_and_no_entity_stays_with_a_dead_child_past_its_ttl() -> None:
    assert lost_transfers({"a": "SUCCESS", "b": "SUCCESS"}) == []
    assert lost_transfers({"a": "SUCCESS", "b": "PENDING"}) == ["1 of 2 calls did not succeed: b=PENDING"]
    assert blocked_violations([("account:1", 3.9), ("account:2", 5.9)], ttl=4, slack=2) == []
    assert blocked_violations([("account:3", 6.5)], ttl=4, slack=2) == [
        "account:3 stayed held by a killed child 6.50 s (TTL 4 s)"
    ]


def test_check_is_ok_only_with_no_violation_and_the_control_caught() -> None:
    good = {
        "bodies": [body(1, (0, 1), 0, 1), body(2, (1, 0), 1, 2, fence=2)],
        "opening": {0: 100, 1: 100},
        "balances": {0: 100, 1: 100},
        "moves": [Move(1, 0, 1, 5), Move(2, 1, 0, 5)],
        "transfers": [1, 2],
        "control_opening": {100: 100, 101: 100},
        "control_transfers": [7, 8],
        "states": {"a": "SUCCESS"},
        "blocked": [("account:0", 1.0)],
        "ttl": 4.0,
    }
    control_race = {  # two unlocked bodies at once: one overwrote the other's debit
        "control_bodies": [body(7, (100, 101), 0, 1), body(8, (101, 100), 0.5, 1.5)],
        "control_balances": {100: 95, 101: 105},
        "control_moves": [Move(7, 100, 101, 5), Move(8, 100, 101, 5)],
    }
    ok = check(**good, **control_race)  # type: ignore[arg-type]
    assert ok.ok and ok.violations == [] and len(ok.control_caught) == 3
    quiet_control = {"control_bodies": [], "control_balances": {100: 100, 101: 100}, "control_moves": []}
    uncaught = check(**{**good, "control_transfers": []}, **quiet_control)  # type: ignore[arg-type]
    assert uncaught.violations == [] and not uncaught.ok
    broken = check(**{**good, "bodies": [body(1, (0, 1), 0, 1), body(2, (1, 0), 0.5, 2)]}, **control_race)  # type: ignore[arg-type]
    assert not broken.ok and broken.violations[0].startswith("account 0: exec 1")


@pytest.mark.cluster
@pytest.mark.integration
def test_transfers_on_the_three_master_cluster_keys_in_different_slots(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded: 60 transfers over 10 s, kills during the first half, the control beside; the full oracle."""
    from celery_lockguard import _connection as connection
    from celery_lockguard._cluster import slot
    from chaos import transfer

    from .conftest import REQUIRE, amqp_available, amqp_url

    if connection.redis_py_version() < connection.CLUSTER_MIN_REDIS_PY:
        pytest.skip("Cluster support needs redis-py >= 6.1")
    if not amqp_available():
        if REQUIRE:
            pytest.fail(f"LOCKGUARD_REQUIRE_SERVICES=1 but RabbitMQ is not reachable at {amqp_url()}")
        pytest.skip(f"missing service: RabbitMQ is not reachable at {amqp_url()}")

    slots = {slot(f"ctr:v1:{{account:{a}}}:lock") for a in range(10)}
    assert len(slots) == 10  # ten accounts, ten slots: no transfer's two leases share one
    monkeypatch.setenv("LOCKGUARD_TEST_POSTGRES_URL", postgres_url)
    monkeypatch.setenv("LOCKGUARD_TEST_AMQP_URL", amqp_url())
    args = transfer.options(["--cluster", "--transfers", "60", "--duration", "10", "--control", "12", "--seed", "7"])
    out = transfer.run(args)
    assert out.findings.violations == []
    assert out.findings.control_caught, "the control (locking off) was not caught"
    assert out.kills >= 1 and out.transfers == 60
