"""The per-process renewer: one round trip per tick for all leases, woken only when it must be; it never dies."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard import _scripts as scripts
from celery_lockguard._keys import lock_name
from celery_lockguard._renewer import Renewer, _Event, _own_client
from celery_lockguard.testing import RedisServer, busy

from .harness import wait_for
from .proxy import DelayProxy


@pytest.fixture(autouse=True)
def forgetful_renewers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Renewer]]:
    """Every ``Renewer`` a test makes forgets its leases at teardown, whether the test passed or not.

    Its thread outlives the test (it is a daemon and never dies): a failed test that skipped its
    ``untrack`` left 200 leases renewing against a server that was gone, and the next test captured their
    ``lock.backend_unavailable`` events as its own.
    """
    made: list[Renewer] = []

    class Forgetful(Renewer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(sys.modules[__name__], "Renewer", Forgetful)
    yield made
    for renewer in made:
        with renewer._mutex:
            renewer._entries.clear()
            renewer._drains.clear()


@pytest.fixture
def server() -> Any:
    with RedisServer() as s:
        yield s


def take(c: Any, key: str, ttl_ms: int) -> L.Lease:
    got = L.acquire(
        c, "lg", key, ttl_ms=ttl_ms, task_id=key, task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    return got


def evalsha_calls(c: Any) -> int:
    return int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_short_lease_tracked_while_the_thread_sleeps_on_a_long_one_is_renewed(server: RedisServer) -> None:
    c = server.client()
    renewer = Renewer()
    # The short TTL leaves room for a busy CI machine (300 ms once lapsed there between two GIL turns);
    # unwoken, the thread would sleep ~20 s on the long lease and the short one would lapse at 1.2 s.
    long_lease, short_lease = take(c, "long", 60_000), take(c, "short", 1200)
    renewer.track(long_lease, c, 3600)
    wait_for(lambda: renewer._wake_at not in (0.0, float("inf")), 2, what="the thread to sleep on the long lease")
    renewer.track(short_lease, c, 3600)
    seen: set[str] = set()

    def renewed_across_three_ttls() -> bool:
        assert c.exists(lock_name("lg", "short")), "the short lease expired: the renewer was not woken"
        seen.add(str(c.hget(lock_name("lg", "short"), "renewed_at") or ""))
        return len(seen) >= 4

    wait_for(renewed_across_three_ttls, 6, interval=0.02, what="the short lease to be renewed repeatedly")
    assert short_lease.held and long_lease.held
    renewer.untrack(short_lease)
    renewer.untrack(long_lease)


def idling_renewer(c: Any, margin: float = 0.0) -> tuple[Renewer, list[float]]:
    """A renewer whose thread saw a 1.5 s lease and now idles with a bounded sleep (at least ``margin`` s
    left), and the times its ``_notify`` (the wake-up ``track`` may send) is called from now on."""
    renewer = Renewer()
    first = take(c, "first", 1500)
    renewer.track(first, c, 3600)
    wait_for(lambda: renewer._wake_at not in (0.0, float("inf")), 2, what="the thread to sleep on the first lease")
    first_due = renewer._wake_at
    renewer.untrack(first)
    # Past the first lease's due time the thread finds nothing held: it idles, armed for the next lease.
    wait_for(
        lambda: renewer._wake_at != first_due and time.monotonic() + margin < renewer._wake_at < float("inf"),
        3,
        interval=0.005,
        what="the thread to idle with a bounded sleep",
    )
    notified: list[float] = []
    real_notify = renewer._notify

    def counting_notify() -> None:
        notified.append(time.monotonic())
        real_notify()

    renewer._notify = counting_notify  # type: ignore[method-assign]
    return renewer, notified


def test_a_lease_tracked_while_the_thread_idles_after_earlier_leases_is_renewed_without_a_wake_up(
    server: RedisServer,
) -> None:
    """A stream of short tasks: the thread idles no longer than a new lease's earliest renewal, so track()
    does not wake it per task, and every lease is still renewed on time (issue 15)."""
    c = server.client()
    renewer, notified = idling_renewer(c)
    assert renewer._wake_at - time.monotonic() <= 0.85 * 0.5 + 0.01
    later = take(c, "later", 1500)
    renewer.track(later, c, 3600)
    assert notified == [], "a lease due after the idle thread's next look woke it"
    seen: set[str] = set()

    def renewed_across_three_ttls() -> bool:
        assert c.exists(lock_name("lg", "later")), "the lease expired: the idle thread looked too late"
        seen.add(str(c.hget(lock_name("lg", "later"), "renewed_at") or ""))
        return len(seen) >= 4

    wait_for(renewed_across_three_ttls, 8, interval=0.02, what="the lease to be renewed repeatedly")
    assert later.held
    renewer.untrack(later)
    # Nothing tracked since: after one more bounded look the thread sleeps until woken.
    wait_for(lambda: renewer._wake_at == float("inf"), 3, interval=0.01, what="the thread to sleep until woken")


def test_a_lease_tracked_while_the_thread_idles_wakes_it_when_due_before_its_next_look(server: RedisServer) -> None:
    """The idle thread's bounded sleep is no licence to be late: a lease whose lock_max_hold (or renewal) falls
    before that wake-up wakes it, so ``lost`` is set on time (review: it came up to ttl/15 late)."""
    c = server.client()
    renewer, notified = idling_renewer(c, margin=0.2)
    short = take(c, "short", 30_000)
    # Its max-hold deadline falls 0.05 s before the idle thread's next look: inside the old fifth-of-interval slack.
    renewer.track(short, c, max(0.01, renewer._wake_at - short.acquired_at - 0.05))
    assert notified, "a lease whose max hold falls before the idle thread's next look did not wake it"
    wait_for(lambda: short.lost, 2, interval=0.005, what="the lease to be marked lost at its max hold")
    renewer.untrack(short)


def test_one_round_trip_per_tick_whatever_the_number_of_leases(server: RedisServer) -> None:
    c = server.client()
    renewer = Renewer()
    # 4.5 s: a tick every ~1.4 s, and a tick 3 s late still loses nothing (600 ms lost a lease to a tick
    # 400 ms late on a loaded CI machine). Three ticks prove the count however long each period is.
    leases = [take(c, f"k{i}", 4500) for i in range(200)]
    for lease in leases:
        renewer.track(lease, c, 3600)
    before_calls, before_ticks = evalsha_calls(c), renewer.ticks
    wait_for(lambda: renewer.ticks >= before_ticks + 3, 20, interval=0.02, what="three ticks")
    calls, ticks = evalsha_calls(c) - before_calls, renewer.ticks - before_ticks
    assert calls == ticks or calls == ticks + 1  # a tick may be in flight when we read
    assert all(lease.held for lease in leases)
    for lease in leases:
        renewer.untrack(lease)


# -- a renewer that never dies -----------------------------------------------------------------------


class Fault:
    """A real server state that refuses RENEW until ended: BUSY, NOREPLICAS or NOPERM."""

    def __init__(self, name: str, server: RedisServer) -> None:
        self.name = name
        self.server = server
        self.admin = server.client()
        self.code = {"busy": "BUSY", "noreplicas": "NOREPLICAS", "noperm": "NOPERM"}[name]
        self.kind = "misconfigured" if name == "noperm" else "unavailable"
        self._busy = contextlib.ExitStack()
        # The renewer authenticates as its own user, so an ACL change can hit it alone.
        self.admin.execute_command("ACL", "SETUSER", "renewer", "on", ">pw", "~*", "+@all")
        self.client = server.client(username="renewer", password="pw", socket_timeout=2)

    def start(self) -> None:
        if self.name == "noreplicas":
            self.admin.config_set("min-replicas-to-write", 1)
        elif self.name == "noperm":
            self.admin.execute_command("ACL", "SETUSER", "renewer", "-evalsha")
        else:
            self._busy.enter_context(busy(self.server))

    def stop(self) -> None:
        if self.name == "noreplicas":
            self.admin.config_set("min-replicas-to-write", 0)
        elif self.name == "noperm":
            self.admin.execute_command("ACL", "SETUSER", "renewer", "+evalsha")
        else:
            self._busy.close()


@pytest.fixture(params=["busy", "noreplicas", "noperm"])
def fault(request: pytest.FixtureRequest) -> Iterator[Fault]:
    with RedisServer(extra=["--busy-reply-threshold", "50"]) as s:
        yield Fault(request.param, s)


def test_a_refused_renewal_is_a_failed_tick_the_thread_survives_and_reports_lost(fault: Fault) -> None:
    """Pass: the thread lives on, the short lease is reported lost and untracked, the long one renews again."""
    c = fault.admin
    renewer = Renewer()
    short, long_ = take(c, "short", 600), take(c, "long", 5000)
    with capture_logs() as logs:
        renewer.track(short, fault.client, 3600)
        renewer.track(long_, fault.client, 3600)
        fault.start()
        try:
            wait_for(lambda: renewer.tracked() == 1, 5, interval=0.02, what="the short lease to be reported lost")
            assert renewer._thread is not None and renewer._thread.is_alive()
            assert short.lost and not long_.lost
        finally:
            fault.stop()
        before = c.hget(lock_name("lg", "long"), "renewed_at")
        wait_for(
            lambda: c.hget(lock_name("lg", "long"), "renewed_at") != before,
            5,
            interval=0.02,
            what="the long lease to be renewed after the server recovered",
        )
    assert long_.held and renewer.tracked() == 1 and renewer._thread.is_alive()
    # Only this test's leases: another module's renewer (the process's own) may still be failing elsewhere.
    failed = [
        e
        for e in logs
        if e["event"] == "lock.backend_unavailable" and set(e.get("lock_keys") or ["?"]) <= {"short", "long"}
    ]
    assert failed and all(f"renew ({fault.kind})" in e["reason"] for e in failed)
    assert any(fault.code in e["reason"] for e in failed)
    lost = [e for e in logs if e["event"] == "lock.lost"]
    assert [(e["lock_key"], e["reason"]) for e in lost] == [("short", "expired")]
    renewer.untrack(long_)


@pytest.mark.parametrize("refusal", ["noreplicas", "readonly"])
def test_after_a_failed_tick_the_next_try_comes_soon(server: RedisServer, refusal: str) -> None:
    """Pass: a failed renewal is retried after a fraction of the interval (1 s here), not a whole one.

    READONLY (a demoted primary) was always an outage; NOREPLICAS used to kill the thread.
    """
    c = server.client()
    renewer = Renewer()
    lease = take(c, "k", 3000)
    with contextlib.ExitStack() as undo:
        if refusal == "noreplicas":
            c.config_set("min-replicas-to-write", 1)
            undo.callback(c.config_set, "min-replicas-to-write", 0)
        else:
            primary = undo.enter_context(RedisServer())
            c.replicaof("127.0.0.1", primary.port)  # this server is now a replica: writes answer READONLY
            undo.callback(c.replicaof, "NO", "ONE")
        renewer.track(lease, c, 3600)
        wait_for(lambda: renewer.ticks >= 1, 3, interval=0.005, what="a first (failed) tick")
        first = time.monotonic()
        wait_for(lambda: renewer.ticks >= 2, 3, interval=0.005, what="a second tick")
        assert time.monotonic() - first < 0.6, "the retry waited a full renewal interval"
        assert lease.held
    if refusal == "noreplicas":
        before = c.hget(lock_name("lg", "k"), "renewed_at")
        wait_for(lambda: c.hget(lock_name("lg", "k"), "renewed_at") != before, 3, what="a renewal after recovery")
        assert lease.held
    renewer.untrack(lease)


def test_a_renewal_answered_after_the_validity_passed_does_not_revive_the_lease(server: RedisServer) -> None:
    """Pass: once lost, a lease stays lost, even when a renewal sent in time succeeds late."""
    proxy = DelayProxy(server.port).start()
    try:
        c = server.client()
        slow = redis.Redis(port=proxy.port, decode_responses=True, socket_timeout=5)
        slow.ping()
        c.script_load(scripts.RENEW)  # one round trip per renewal: no NOSCRIPT + SCRIPT LOAD on the slow path
        lease = take(c, "k", 1000)  # first renewal ~0.3 s in; valid until ~0.99 s
        proxy.delay = 0.75  # its reply arrives ~1.05 s: after the validity, and the key still exists
        renewer = Renewer()
        with capture_logs() as logs:
            renewer.track(lease, slow, 3600)
            wait_for(lambda: lease.lost, 3, interval=0.005, what="the validity to pass")
            wait_for(lambda: renewer.ticks >= 1, 3, interval=0.005, what="the late renewal to be answered")
            assert lease.lost and not lease.held, "a late renewal brought a lost lease back"
            wait_for(lambda: renewer.tracked() == 0, 3, interval=0.005, what="the lease to be untracked")
        assert c.exists(lock_name("lg", "k"))  # the renewal did land: only the reply was late
        assert [e["reason"] for e in logs if e["event"] == "lock.lost"] == ["expired"]
        assert lease.lost
    finally:
        proxy.close()


def test_a_lost_lease_is_never_renewed_back(server: RedisServer) -> None:
    c = server.client()
    lease = take(c, "k", 100)
    c.pexpire(lock_name("lg", "k"), 60_000)  # the key outlives the local validity (a slow clock on Redis)
    wait_for(lambda: lease.lost, 2, interval=0.005, what="the validity to pass")
    sent_at = time.monotonic()
    assert L.renew(c, [lease]) == [1]
    assert lease.renewed(sent_at) is False and lease.lost


def test_an_isolated_renewer_runs_on_an_os_thread_with_its_own_client_and_leaves_logging_to_the_caller(
    server: RedisServer,
) -> None:
    """What gevent and eventlet workers get: green locks and sockets must not cross OS threads, so the
    loop renews through a client it made itself, guards each lease with an OS lock, and queues its events
    for the next track/untrack (made by a greenlet) to emit."""
    import _thread
    import threading

    c = server.client()
    renewer = Renewer(isolated=True)
    lease = take(c, "iso", 300)
    renewer.track(lease, c, 3600)
    assert renewer.thread_kind == "os-thread" and isinstance(lease._guard, _thread.LockType)
    assert renewer._thread is not None and not isinstance(renewer._thread, threading.Thread)
    seen: set[str] = set()

    def renewed_across_three_ttls() -> bool:
        seen.add(str(c.hget(lock_name("lg", "iso"), "renewed_at")))
        return len(seen) >= 4

    wait_for(renewed_across_three_ttls, 3, interval=0.02, what="the lease to be renewed from the OS thread")
    assert lease.held
    [(original, own)] = renewer._own_clients.values()
    assert original is c and own is not c and own.connection_pool is not c.connection_pool
    assert renewer._coalesced["lock.renewed"].fields["lock_keys"] == ["iso"]
    renewer.untrack(lease)
    assert not renewer._coalesced and not renewer._events


def test_an_isolated_renewer_drops_nothing_however_long_the_greenlets_take(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The queue used to keep the newest 1000 events: 1000 renewals behind a CPU-bound body pushed a
    lock.lost out. Now the per-tick events coalesce (counted in full, logged once) and lost is queued."""
    caplog.set_level(logging.DEBUG, logger="celery_lockguard")
    renewer = Renewer(isolated=True)
    renewed = _Event("lock.renewed", None, {"leases": 1, "lock_keys": ["a"]}, "logging")
    for _ in range(3000):
        renewer._report(_Event(renewed.name, None, renewed.fields, "logging"))
    lost_fields = {"lock_key": "a", "task_id": "t1", "fence": 7, "hold_ms": 900, "reason": "token_gone"}
    renewer._report(_Event("lock.lost", "n", lost_fields, "logging"))
    for _ in range(3000):
        renewer._report(_Event(renewed.name, None, renewed.fields, "logging"))
    renewer._report(_Event("lock.backend_unavailable", None, {"reason": "renew (unavailable): x"}, "logging"))
    renewer.flush_events()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "celery_lockguard"]
    assert lines == [
        'lock.renewed leases=1 lock_keys=["a"] occurrences=6000',
        'lock.backend_unavailable reason="renew (unavailable): x"',
        "lock.lost task_name=n lock_key=a task_id=t1 fence=7 hold_ms=900 reason=token_gone",
    ]
    counted = metrics.snapshot()
    assert counted["-"]["lock.renewed"] == 6000 and counted["n"]["lock.lost"] == 1


GREEN_IDLE = """
import sys
runtime = sys.argv[1]
if runtime == "gevent":
    from gevent import monkey; monkey.patch_all()
    from gevent import sleep
else:
    import eventlet; eventlet.monkey_patch()
    from eventlet import sleep
import logging, time
import redis
from celery_lockguard import _lease as L
from celery_lockguard._keys import lock_name
from celery_lockguard._renewer import Renewer

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((time.monotonic(), record.getMessage()))
logging.getLogger("celery_lockguard").addHandler(Keep())
logging.getLogger("celery_lockguard").setLevel(logging.WARNING)
c = redis.Redis.from_url(sys.argv[2], decode_responses=True)
renewer = Renewer()
assert renewer.isolated
def take(key, ttl_ms):
    return L.acquire(c, sys.argv[3], key, ttl_ms=ttl_ms, task_id=key, task_name="n", digest="d", worker="w",
                     fence_ttl_ms=60_000)
lease = take("green", 600)
renewer.track(lease, c, 3600)
c.delete(lock_name(sys.argv[3], "green"))
deleted = time.monotonic()
deadline = deleted + 5
while not any("lock.lost" in m for _, m in records) and time.monotonic() < deadline:
    sleep(0.01)  # the hub runs; no track/untrack that would flush on its behalf
found = [t for t, m in records if "lock.lost" in m and "reason=token_gone" in m]
print("LOST_AFTER", found[0] - deleted if found else None)
idle = take("idle", 30_000)
renewer.track(idle, c, 3600)
cpu = time.process_time()
sleep(1.0)  # measuring, not waiting: what an idle process spends while a lease is tracked
print("IDLE_CPU", time.process_time() - cpu)
renewer.untrack(idle)
"""


@pytest.mark.parametrize("runtime", ["gevent", "eventlet"])
def test_under_gevent_and_eventlet_the_renewers_events_are_emitted_at_once_on_an_idle_process(
    server: RedisServer, runtime: str
) -> None:
    """lock.lost used to wait for the next track/untrack: on an idle worker, forever. The OS thread now
    wakes the hub (gevent async watcher, eventlet socket pair); idle, that costs no polling."""
    out = run_green(GREEN_IDLE, runtime, server.url, "lg")
    assert float(out["LOST_AFTER"]) < 1.0  # a tick (~0.2 s) and the hub's turn
    assert float(out["IDLE_CPU"]) < 0.05, out


def run_green(script: str, runtime: str, url: str, prefix: str) -> dict[str, str]:
    """Run ``script`` in a process patched by ``runtime``; its ``NAME value`` lines, once it lost a lease."""
    pytest.importorskip(runtime)
    cmd = [sys.executable, "-c", script, runtime, url, prefix]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("LOST_", "IDLE_")))
    assert out["LOST_AFTER"] != "None", done.stdout + done.stderr
    return out


GREEN_FORK = (
    GREEN_IDLE.split("found = ")[0]
    + """
import os
pid = os.fork()
if pid == 0:  # a child whose hub keeps running, as in a program that forks after patching
    sleep(4)
    os._exit(0)
records.clear()
after = take("after_fork", 600)
renewer.track(after, c, 3600)
c.delete(lock_name(sys.argv[3], "after_fork"))
deleted = time.monotonic()
deadline = deleted + 3
while not any("lock.lost" in m for _, m in records) and time.monotonic() < deadline:
    sleep(0.01)
found = [t for t, m in records if "lock.lost" in m]
print("LOST_AFTER", found[0] - deleted if found else None)
os.kill(pid, 9)
os.waitpid(pid, 0)
"""
)


@pytest.mark.parametrize("runtime", ["gevent", "eventlet"])
def test_a_forked_child_does_not_take_the_parents_wake_ups(server: RedisServer, runtime: str) -> None:
    """Under eventlet a forked child inherited the drainer's socket pair and read the parent's wake-ups:
    the parent's lock.lost then waited for its next track/untrack. The child now closes its copies."""
    out = run_green(GREEN_FORK, runtime, server.url, "lgf")
    assert float(out["LOST_AFTER"]) < 1.0, out


@pytest.mark.parametrize("isolated", [False, True])
def test_a_lease_lost_lands_on_the_span_of_the_task_that_held_it(server: RedisServer, isolated: bool) -> None:
    """Under gevent, task A's lock.lost used to land on task B's span: the greenlet that flushed it."""
    sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("lockguard-test")
    c = server.client()
    renewer = Renewer(isolated=isolated)
    lease = take(c, "spanned", 600)
    span_a = tracer.start_span("A")
    token = otel_context.attach(trace.set_span_in_context(span_a))
    try:
        renewer.track(lease, c, 3600)
    finally:
        otel_context.detach(token)
    c.delete(lock_name("lg", "spanned"))
    wait_for(lambda: lease.lost and renewer.tracked() == 0, 3, interval=0.01, what="the loss to be found")
    with tracer.start_as_current_span("B"):
        renewer.flush_events()  # isolated: the flushing greenlet runs B
    span_a.end()
    provider.shutdown()
    on = {s.name: [e.name for e in s.events] for s in exporter.get_finished_spans()}
    assert on == {"A": ["lock.lost"], "B": []}


def test_copies_of_forgotten_clients_are_closed_and_unknown_pools_are_not_shared(server: RedisServer) -> None:
    """The isolated loop kept a copy of every client it ever renewed through; sharing a client it cannot
    copy would put one green socket on two OS threads."""
    renewer = Renewer(isolated=True)
    first, second = server.client(), server.client()
    lease = take(first, "one", 600)
    renewer.track(lease, first, 3600)
    wait_for(lambda: renewer.ticks >= 1, 3, interval=0.01, what="a tick through the first client")
    renewer.untrack(lease)
    [(_, first_copy)] = renewer._own_clients.values()
    other = take(second, "two", 600)
    renewer.track(other, second, 3600)
    before = renewer.ticks
    wait_for(lambda: renewer.ticks >= before + 1, 3, interval=0.01, what="a tick through the second client")
    renewer.untrack(other)
    assert [original for original, _ in renewer._own_clients.values()] == [second]
    pool = first_copy.connection_pool
    made = [*pool._available_connections, *pool._in_use_connections]  # in use: held by this thread's _wire channel
    assert made and all(conn._sock is None for conn in made)  # its connection closed

    class OtherPool(redis.ConnectionPool):
        pass

    with pytest.raises(TypeError, match="cannot renew through a Redis with a OtherPool"):
        _own_client(redis.Redis(connection_pool=OtherPool(port=server.port)))


def test_own_copies_are_made_beside_the_cli_operator_client(server: RedisServer) -> None:
    """The CLI's operator client is cached under a three-part key; the isolated loop's copy lookup unpacked
    two parts and failed every tick of a process that had made one (seen in the full suite)."""
    from celery import Celery

    from celery_lockguard import _connection as connection
    from celery_lockguard._config import settings

    app = Celery("own-copies", broker=server.url, set_as_current=False)
    s = settings(app)
    try:
        plain, operator = connection.client(s), connection.operator_client(s)
        copy, operator_copy = _own_client(plain), _own_client(operator)
        assert copy is not plain and copy.ping()
        assert operator_copy is not operator and operator_copy.get_encoder().encoding_errors == "surrogateescape"
    finally:
        connection.forget_clients()
