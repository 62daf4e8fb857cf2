"""Review ``rv``: 46af2c4 made ``lockguard locks`` show ``-`` as WORKER for a holder no process holds (a woken
waiter's reservation: host '', pid 0). The live page's leases table must say the same, not ``-:-``."""

from __future__ import annotations

from celery_lockguard._holders import HeldLease
from celery_lockguard._page_html import _lease_row


def _reservation(host: str = "", pid: int = 0) -> HeldLease:
    return HeldLease(
        key="res:1", redis_key="lg:v1:{res:1}:lock", state="handed", task_name="hold_skip", task_id="t-woken",
        worker="", host=host, pid=pid, fence=None, held_for_ms=5, since_renewal_ms=5, ttl_left_ms=30_000,
        lease_ttl_ms=30_000,
    )  # fmt: skip


def test_the_page_shows_no_worker_for_a_woken_waiters_reservation_as_lockguard_locks_does() -> None:
    assert _lease_row(_reservation(), 0)[4] == "-"


def test_the_page_shows_host_and_pid_of_a_running_holder() -> None:
    assert _lease_row(_reservation("w1", 42), 0)[4] == "w1:42"
