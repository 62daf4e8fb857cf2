"""The lock_limit / lock_rate soak's invariants on synthetic histories: they pass what is allowed, catch what is not."""

from __future__ import annotations

from chaos.limits import Body, holders_violations, rate_violations


def body(start: float, end: float, admitted_ms: int = 0, entity: int = 0) -> Body:
    return Body(entity, start, admitted_ms or int(start * 1000), end)


def test_n_bodies_at_once_pass_and_one_more_is_caught() -> None:
    three = [body(0.0, 1.0), body(0.1, 1.0), body(0.2, 1.0)]
    assert holders_violations(three, 3, []) == (3, [])
    worst, bad = holders_violations([*three, body(0.5, 0.6)], 3, [])
    assert worst == 4 and bad and "4 bodies at once" in bad[0]


def test_back_to_back_bodies_and_other_entities_do_not_count_together() -> None:
    chain = [body(0.0, 1.0), body(1.0, 2.0), body(0.0, 1.0, entity=1), body(0.1, 1.0, entity=1)]
    assert holders_violations(chain, 1, [])[1] == ["entity 1: 2 bodies at once at 0.100"]


def test_a_body_running_across_a_lock_redis_restart_is_excused_against_later_ones() -> None:
    history = [body(0.0, 5.0), body(3.0, 4.0)]
    assert holders_violations(history, 1, [])[1]  # without the restart: two at once
    assert holders_violations(history, 1, [2.0]) == (1, [])


def test_n_starts_per_sliding_window_pass_and_one_more_is_caught() -> None:
    ok = [body(0, 1, admitted_ms=t) for t in (10, 100, 1010, 1100)]  # never 3 in one second
    assert rate_violations(ok, 2, 1000, []) == (2, [])
    worst, bad = rate_violations([*ok, body(0, 1, admitted_ms=1050)], 2, 1000, [])
    assert worst == 3 and "3 starts in the window" in bad[0]


def test_a_window_spanning_a_restart_is_excused() -> None:
    burst = [body(0, 1, admitted_ms=t) for t in (10, 100, 200)]
    assert rate_violations(burst, 2, 1000, [])[1]
    assert rate_violations(burst, 2, 1000, [150]) == (2, [])


def test_an_admission_just_before_the_restart_is_the_old_servers_even_if_its_body_starts_after() -> None:
    """Found by CI: the old server admitted a body 1 ms before its kill, the body's start record came after the
    restart's stamp, and the new server (which forgot that lease) admitted the next: not a violation."""
    old = body(2.001, 4.0, admitted_ms=1999)  # admitted by the old server, started after the stamp at 2.0
    new = body(2.5, 3.0, admitted_ms=2500)
    assert holders_violations([old, new], 1, [2.0]) == (1, [])
    # both admitted by the new server: still caught
    assert holders_violations([body(2.1, 4.0, admitted_ms=2100), new], 1, [2.0])[1]
