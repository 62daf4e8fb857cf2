"""The chaos soak's checker catches each violation it claims to (synthetic histories, no services).

The soak itself runs in CI as ``make chaos-quick``; this only proves its checks can fail.
"""

from __future__ import annotations

from chaos.check import (
    FAULT_KINDS,
    Effect,
    Execution,
    Faults,
    Publish,
    Verdict,
    check_all,
    check_coverage,
)


def ex(
    id: int,
    entity: int,
    start: float,
    end: float | None,
    *,
    lost: bool = False,
    pid: int = 1,
    worker: str = "w0",
    job: int | None = None,
    fence: int = 1,
    delivered: float | None = None,
    released: float | None = None,
    outcome: str = "committed:SUCCESS",
) -> Execution:
    return Execution(
        id,
        id if job is None else job,
        entity,
        f"t{id}",
        fence,
        worker,
        pid,
        start,
        end,
        lost,
        False,
        outcome,
        start if delivered is None else delivered,
        released if released is not None else end,
    )


def effect(
    seq: int, job: int, entity: int = 0, fence: int = 1, charge: str = "ch", exec_id: int | None = None
) -> Effect:
    return Effect(seq, job, entity, fence, f"t{seq}", charge, exec_id)


def provider(*jobs: int) -> list[tuple[str, int, str, int]]:
    return [(f"job:{j}", j, "ch", 1) for j in jobs]


def pub(job: int, task_id: str, t: float, outcome: str = "enqueued", **kw: object) -> Publish:
    return Publish(job, task_id, t, t + 0.01, outcome, **kw)  # type: ignore[arg-type]


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


def test_a_lease_lost_with_no_fault_to_explain_it_still_counts_as_an_overlap() -> None:
    """The no-renew control: the library says the lease is lost, but nothing broke it -- the guard failed."""
    runs = [ex(1, 0, 0.0, 8.0, lost=True), ex(2, 0, 3.0, 3.5)]
    verdict = check_all(0, [], runs, [], Faults(), 2.0, [])
    assert verdict.overlaps == 1 and verdict.info["executions_lost_without_fault"] == 1
    for faults in (
        Faults(restarts=[(1.0, 1.5)]),
        Faults(busy=[(1.0, 2.5)]),
        Faults(noreplicas=[(1.0, 2.5)]),
        Faults(pauses=[("w0", 0.5, 5.0)]),
    ):
        assert check_all(0, [], runs, [], faults, 2.0, []).overlaps == 0, faults
    # A pause shorter than the TTL breaks no lease; one of another worker breaks nothing of this one.
    for faults in (Faults(pauses=[("w0", 0.5, 1.0)]), Faults(pauses=[("w9", 0.5, 5.0)])):
        assert check_all(0, [], runs, [], faults, 2.0, []).overlaps == 1, faults


def test_a_body_without_a_lease_is_never_excused() -> None:
    """The fail-open control: a body that ran unlocked beside a locked one is an overlap, outage or not."""
    runs = [ex(1, 0, 0.0, 3.0, fence=-1), ex(2, 0, 1.0, 1.2)]
    verdict = check_all(0, [], runs, [], Faults(restarts=[(0.0, 0.5)]), 2.0, [])
    assert verdict.overlaps == 1 and verdict.info["executions_without_lease"] == 1


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


def test_with_raise_a_visible_failure_answers_a_job_and_a_silent_success_loses_it() -> None:
    pubs = [pub(0, "a", 0.0), pub(1, "b", 0.1), pub(2, "c", 0.2, "raised:AlreadyQueued"), pub(3, "d", 0.3)]
    results = {"a": ("FAILURE", "LockContended"), "b": ("SUCCESS", None), "d": ("FAILURE", "LockContended")}
    verdict = check_all([0, 1, 2, 3], [], [], [], Faults(), 2.0, [], publishes=pubs, results=results, policy="raise")
    # job 1 ended SUCCESS with no effect: the swallow-contended control
    assert (verdict.lost_jobs, verdict.unexpected_failures, verdict.unanswered) == (1, 0, 0)
    assert verdict.info["jobs_failed_visibly"] == 3
    # Under skip the same failures are not the policy's: every one is unexpected and the jobs are lost.
    skip = check_all([0, 1, 2, 3], [], [], [], Faults(), 2.0, [], publishes=pubs, results=results, policy="skip")
    assert (skip.lost_jobs, skip.unexpected_failures) == (4, 3)


def test_failures_the_policy_does_not_explain_and_publishes_without_a_final_state_are_counted() -> None:
    pubs = [pub(0, "a", 0.0), pub(0, "b", 0.1), pub(1, "c", 0.2), pub(1, "d", 0.3, "raised:ResponseError")]
    results = {"a": ("SUCCESS", None), "b": ("FAILURE", "ResponseError"), "c": ("SUCCESS", None)}
    effects = [effect(1, 0), effect(2, 1)]
    verdict = check_all(
        [0, 1], effects, [], provider(0, 1), Faults(), 2.0, [], publishes=[*pubs, pub(1, "e", 0.4)], results=results
    )
    # b failed with an error skip does not explain (BUSY read as a bug), d's publish raised one, e never ended
    assert (verdict.unexpected_failures, verdict.unanswered, verdict.lost_jobs) == (2, 1, 0)


def test_a_deduplicated_publish_is_answered_by_its_holder() -> None:
    pubs = [pub(0, "a", 0.0), pub(0, "b", 0.1, "deduped", answered_by="a")]
    ok = check_all([0], [effect(1, 0)], [], provider(0), Faults(), 2.0, [], publishes=pubs,
                   results={"a": ("SUCCESS", None)})  # fmt: skip
    assert ok.ok and ok.info["publishes_deduped"] == 1
    lost_holder = check_all([0], [], [], [], Faults(), 2.0, [], publishes=pubs, results={})
    assert (lost_holder.unanswered, lost_holder.lost_jobs) == (2, 1)


def test_identical_work_queued_twice_counts_only_behind_a_copy_that_held_the_claim() -> None:
    held = pub(0, "a", 0.0, holder_before="", holder_after="a")
    second = pub(0, "b", 1.0)
    first_delivery = {"a": 5.0}
    kw = {"first_delivery": first_delivery, "mode": "until_started", "policy": "skip", "results": {}}
    assert check_all([0], [], [], [], Faults(), 2.0, [], publishes=[held, second], **kw).queued_twice == 1  # type: ignore[arg-type]
    # The claim was held by other work on the entity: nothing could recognise the duplicate.
    other = pub(0, "a", 0.0, holder_before="x", holder_after="x")
    assert check_all([0], [], [], [], Faults(), 2.0, [], publishes=[other, second], **kw).queued_twice == 0  # type: ignore[arg-type]
    # Free before and after: the publish should have claimed it (send_task bypassed the claim).
    bypass = pub(0, "a", 0.0, holder_before="", holder_after="")
    assert check_all([0], [], [], [], Faults(), 2.0, [], publishes=[bypass, second], **kw).queued_twice == 1  # type: ignore[arg-type]
    # After the first delivery, or after a restart dropped every claim, or with retry: allowed.
    assert check_all([0], [], [], [], Faults(), 2.0, [], publishes=[held, pub(0, "b", 6.0)], **kw).queued_twice == 0  # type: ignore[arg-type]
    restarted = Faults(restarts=[(0.5, 0.7)])
    assert check_all([0], [], [], [], restarted, 2.0, [], publishes=[held, second], **kw).queued_twice == 0  # type: ignore[arg-type]
    kw_retry = {**kw, "policy": "retry"}
    assert check_all([0], [], [], [], Faults(), 2.0, [], publishes=[held, second], **kw_retry).queued_twice == 0  # type: ignore[arg-type]


def test_until_done_also_counts_identical_work_published_while_a_copy_runs() -> None:
    held = pub(0, "a", 0.0, holder_before="", holder_after="a")
    second = pub(0, "b", 3.0)
    run = Execution(1, 0, 0, "a", 1, "w0", 1, 2.0, 4.0, False, False, "committed:SUCCESS", 1.9, 4.0)
    kw = {"first_delivery": {"a": 1.9}, "results": {}, "policy": "skip"}
    done = check_all([0], [], [run], [], Faults(), 2.0, [], publishes=[held, second], mode="until_done", **kw)  # type: ignore[arg-type]
    started = check_all([0], [], [run], [], Faults(), 2.0, [], publishes=[held, second], mode="until_started", **kw)  # type: ignore[arg-type]
    assert (done.queued_twice, started.queued_twice) == (1, 0)


def test_a_body_started_after_the_record_was_visible_is_a_record_miss() -> None:
    first = ex(1, 0, 0.0, 1.0, job=0, released=1.1)
    late = ex(2, 0, 2.0, 2.1, job=0, delivered=1.9, outcome="rolled_back_already_recorded:SUCCESS")
    racing = ex(3, 0, 0.5, 1.5, job=0, delivered=0.4, outcome="rolled_back_already_recorded:SUCCESS")
    effects = [effect(1, 0, exec_id=1)]
    for backend in ("postgresql", "redis"):
        verdict = check_all([0], effects, [first, late, racing], provider(0), Faults(), 2.0, [], backend=backend)
        assert verdict.record_misses == 1, backend
    # A restart after the first release lost a Redis record (not a PostgreSQL one).
    restarted = Faults(restarts=[(1.3, 1.5)])
    assert check_all([0], effects, [first, late], provider(0), restarted, 2.0, [], backend="redis").record_misses == 0
    assert check_all([0], effects, [first, late], provider(0), restarted, 2.0, [], backend="postgresql").record_misses
    # The committer was killed before its end was seen: proves nothing.
    killed = ex(1, 0, 0.0, None, job=0, pid=5)
    assert check_all([0], effects, [killed, late], provider(0), Faults(kills=[(5, 1.0)]), 2.0, []).record_misses == 0


def test_a_fault_kind_that_never_fired_fails_the_run() -> None:
    verdict = Verdict()
    wanted = dict.fromkeys(FAULT_KINDS, 1) | {"lock redis restart": 2}
    run = Execution(1, 0, 0, "t", 1, "w0", 1, 10.0, 11.0, False, False, "committed:SUCCESS")
    faults = Faults(restarts=[(1.0, 2.0)], busy=[(10.5, 10.8)], noreplicas=[(30.0, 31.0)], pg_outages=[(40.0, 41.0)])
    check_coverage(verdict, faults, wanted, 3, 0, deliveries=[40.5], executions=[run])
    kinds = {x["fault"] for x in verdict.examples["faults_missing"]}
    # busy hit a running body and the outage a delivery; noreplicas hit nothing
    assert kinds == {
        "sigkill mid-body",
        "pause",
        "lock redis restart",
        "lock redis noreplicas",
        "redelivery while running",
    }


def test_every_control_names_an_invariant_and_a_switch_its_cell_turns_off() -> None:
    from chaos.app import SWITCHES
    from chaos.soak import CONTROLS

    invariants = {name for name, _ in Verdict.INVARIANTS}
    assert {c.switch for c in CONTROLS} == set(SWITCHES)
    for control in CONTROLS:
        assert control.target in invariants and control.switch, control


# -- the debounce soak's invariant -------------------------------------------------------------------


def test_debounce_check_accepts_one_run_with_the_last_arguments_and_superseded_chains() -> None:
    from chaos.debounce import Burst, check_burst

    b = Burst(entity=3, number=1, ids=["a", "b", "c"])
    run = {"entity": 3, "burst": 1, "position": 2}
    results = {
        "a": {"lockguard": "superseded", "superseded_by": "b"},  # consumed while b was pending, b then replaced
        "b": {"lockguard": "superseded", "superseded_by": "c"},
        "c": run,
    }
    assert check_burst(b, results, ["c", "c"]) == []  # a body restarted under the same id after a kill is fine


def test_debounce_check_catches_a_second_run_wrong_arguments_and_a_dangling_chain() -> None:
    from chaos.debounce import Burst, check_burst

    b = Burst(entity=3, number=1, ids=["a", "b", "c"])
    run = {"entity": 3, "burst": 1, "position": 2}
    sup = {"lockguard": "superseded", "superseded_by": "c"}
    assert any("bodies ran" in p for p in check_burst(b, {"a": sup, "b": sup, "c": run}, ["b", "c"]))
    assert any("bodies ran" in p for p in check_burst(b, {"a": sup, "b": sup, "c": run}, []))
    wrong = {**run, "position": 1}
    assert any("the run answered" in p for p in check_burst(b, {"a": sup, "b": sup, "c": wrong}, ["c"]))
    dangling = {"lockguard": "superseded", "superseded_by": "zz"}
    assert any("ends at zz" in p for p in check_burst(b, {"a": dangling, "b": sup, "c": run}, ["c"]))
    assert any("ends at a" in p for p in check_burst(b, {"a": None, "b": sup, "c": run}, ["c"]))


def test_debounce_check_lets_a_burst_the_driver_stalled_in_split_but_never_lose_its_last_run() -> None:
    """A driver stalled a whole delay between two publishes: the library may rightly see two bursts."""
    from chaos.debounce import Burst, check_burst

    run = {"entity": 3, "burst": 1, "position": 2}
    b_run = {"entity": 3, "burst": 1, "position": 1}
    results = {"a": {"lockguard": "superseded", "superseded_by": "b"}, "b": b_run, "c": run}
    tight = Burst(3, 1, ["a", "b", "c"], [(0.0, 0.01), (0.02, 0.03), (0.04, 0.05)])
    stalled = Burst(3, 1, ["a", "b", "c"], [(0.0, 0.01), (0.02, 0.03), (0.60, 0.61)])  # c came 0.59 s after b
    assert not tight.split_possible(0.5) and stalled.split_possible(0.5)
    assert any("bodies ran" in p for p in check_burst(tight, results, ["b", "c"], 0.5)), "no stall: one run only"
    assert check_burst(stalled, results, ["b", "c"], 0.5) == []  # two library bursts: b's run and c's
    # Even split, the last publish must run with its arguments, and every chain must end at a run that ran.
    assert any("bodies ran" in p for p in check_burst(stalled, results, ["b"], 0.5))
    lost = {**results, "a": {"lockguard": "superseded", "superseded_by": "zz"}}
    assert any("ends at zz" in p for p in check_burst(stalled, lost, ["b", "c"], 0.5))
