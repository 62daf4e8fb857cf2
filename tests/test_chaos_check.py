"""The chaos soak's checker catches each violation it claims to (synthetic histories, no services).

The soak itself runs in CI as ``make chaos-quick``; this only proves its checks can fail.
"""

from __future__ import annotations

from chaos.check import Effect, Execution, Faults, Verdict, check_all, check_coverage


def ex(
    id: int, entity: int, start: float, end: float | None, *, lost: bool = False, pid: int = 1, worker: str = "w0"
) -> Execution:
    return Execution(id, id, entity, f"t{id}", 1, worker, pid, start, end, lost, False, "committed:SUCCESS")


def effect(seq: int, job: int, entity: int = 0, fence: int = 1, charge: str = "ch") -> Effect:
    return Effect(seq, job, entity, fence, f"t{seq}", charge)


def provider(*jobs: int) -> list[tuple[str, int, str, int]]:
    return [(f"job:{j}", j, "ch", 1) for j in jobs]


def test_a_clean_history_passes() -> None:
    effects = [effect(1, 0, fence=1), effect(2, 1, fence=2)]
    runs = [ex(1, 0, 0.0, 1.0), ex(2, 0, 1.5, 2.0)]
    verdict = check_all(2, effects, runs, provider(0, 1), Faults(), 2.0, [])
    assert verdict.ok, verdict


def test_duplicates_lost_jobs_fence_regressions_and_charges_are_counted() -> None:
    effects = [
        effect(1, 0, entity=5, fence=10),
        effect(2, 0, entity=5, fence=12),  # job 0 twice
        effect(3, 2, entity=5, fence=11, charge="other"),  # below 12, committed after it; not the provider's charge
    ]
    verdict = check_all(3, effects, [], provider(0, 2), Faults(), 2.0, ["chaos:v1:{acct:5}:lock"])
    assert (verdict.duplicate_effects, verdict.lost_jobs, verdict.fence_regressions) == (1, 1, 1)
    assert (verdict.charge_mismatches, verdict.leases_left) == (1, 1)
    assert not verdict.ok


def test_overlaps_count_only_leases_never_reported_lost() -> None:
    runs = [ex(1, 0, 0.0, 2.0), ex(2, 0, 1.0, 3.0), ex(3, 0, 1.5, 2.5, lost=True)]
    verdict = check_all(0, [], runs, [], Faults(), 2.0, [])
    assert verdict.overlaps == 1 and verdict.info["executions_reported_lost"] == 1


def test_a_killed_body_ends_at_its_kill_and_is_excused_only_by_a_fault_that_destroyed_its_lease() -> None:
    runs = [ex(1, 0, 4.0, None, pid=99), ex(2, 0, 4.5, 6.0)]
    killed = Faults(kills=[(99, 5.0)])
    assert check_all(0, [], runs, [], killed, 2.0, []).overlaps == 1
    restarted = Faults(kills=[(99, 5.0)], restarts=[(4.2, 4.3)])
    assert check_all(0, [], runs, [], restarted, 2.0, []).overlaps == 0
    after_kill = [ex(1, 0, 4.0, None, pid=99), ex(2, 0, 5.1, 6.0)]
    assert check_all(0, [], after_kill, [], killed, 2.0, []).ok


def test_unended_bodies_and_unreported_pause_losses_are_counted() -> None:
    runs = [ex(1, 0, 0.0, None, pid=77), ex(2, 1, 0.0, 10.0, worker="w1")]
    verdict = check_all(0, [], runs, [], Faults(pauses=[("w1", 2.0, 8.0)]), 3.0, [])
    assert (verdict.unended, verdict.unreported_losses) == (1, 1)


def test_a_fault_kind_that_never_fired_fails_the_run() -> None:
    verdict = Verdict()
    wanted = {
        "sigkill mid-body": 1,
        "pause": 1,
        "lock redis restart": 2,
        "redelivery": 1,
        "redelivery while running": 1,
    }
    check_coverage(verdict, Faults(restarts=[(1.0, 2.0)]), wanted, 3, 0)
    kinds = {x["fault"] for x in verdict.examples["faults_missing"]}
    assert kinds == {"sigkill mid-body", "pause", "lock redis restart", "redelivery while running"}
