"""The operator's numbers: held-now gauges, the lock-wait and renewal-lag histograms, per-template contention.

Driven through Celery's real tracer against the real Redis (the waits it
publishes are read back from the queue and delivered again), and checked for
cost on a private server by its own command counts: nothing on the way of a
task, one transaction per flush, no ``SCAN`` per scrape.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_lockguard import LockedTask
from celery_lockguard import _headers as headers
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard import _stats as stats
from celery_lockguard._renewer import Renewer
from celery_lockguard.testing import RedisServer

from .harness import wait_for
from .tracer import HOSTNAME, deliver, make_app, published, redeliver


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    yield make_app("gauges", redis_url, prefix)


def hold(r: redis.Redis, prefix: str, key: str, ttl_ms: int = 30_000) -> L.Lease:
    got = L.acquire(
        r, prefix, key, ttl_ms=ttl_ms, task_id="other", task_name="x", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    return got


def families(text: str) -> dict[str, Any]:
    """The exposition parsed by prometheus_client's own parser (it raises on anything malformed)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


# -- lock wait: first delivery to acquisition, waits re-queued included ------------------------------


def test_a_wait_carries_the_first_delivery_and_the_acquisition_counts_from_it(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.wait", lock_key="acct:{a}", on_locked="retry")
    def t(self: Any, a: int) -> int:
        return a

    holder = hold(r, prefix, "acct:1")
    before_ms = time.time() * 1000
    assert deliver(t, (1,)).state == "RETRY"
    (first,) = published(r, app)
    first_ms = first.custom()[headers.FIRST_DELIVERED]
    assert before_ms - 1 <= first_ms <= time.time() * 1000 + 1, "the header is not this delivery's start"
    # Still held: the copy waits again and the first delivery's time travels on unchanged.
    r.delete(f"{prefix}:kombu:{prefix}-q")  # the queue, read: the next publish is alone in it
    assert redeliver(t, first).state == "RETRY"
    (second,) = published(r, app)
    assert second.custom()[headers.FIRST_DELIVERED] == first_ms
    assert second.custom()[headers.WAITS] == first.custom()[headers.WAITS] + 1
    assert metrics.snapshot().get("g.wait", {}).get("wait") is None, "nothing was acquired yet"
    L.release(r, holder, prefix)
    redelivered_at_ms = time.time() * 1000
    assert redeliver(t, second).state == "SUCCESS"
    wait = metrics.snapshot()["g.wait"]["wait"]
    assert wait["count"] == 1
    assert wait["sum_ms"] >= redelivered_at_ms - first_ms, "the wait did not count from the first delivery"


def test_an_uncontended_acquisition_waits_next_to_nothing_and_a_forged_first_delivery_is_bucketed(
    app: Celery, prefix: str
) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.free", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        return a

    assert deliver(t, (2,)).state == "SUCCESS"
    wait = metrics.snapshot()["g.free"]["wait"]
    assert wait["count"] == 1 and wait["sum_ms"] < 1000
    # A copy whose first delivery was 2.5 s ago (another worker's clock) lands in the 5 s bucket.
    assert deliver(t, (3,), headers={headers.FIRST_DELIVERED: int(time.time() * 1000) - 2500}).state == "SUCCESS"
    wait = metrics.snapshot()["g.free"]["wait"]
    assert wait["count"] == 2 and wait["buckets"]["5000"] == 1
    # A clock ahead of ours never makes a negative wait.
    assert deliver(t, (4,), headers={headers.FIRST_DELIVERED: int(time.time() * 1000) + 60_000}).state == "SUCCESS"
    assert metrics.snapshot()["g.free"]["wait"]["buckets"]["5"] >= 1


def test_a_retry_starts_its_wait_clock_again(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.retry", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        raise self.retry(countdown=300)

    assert deliver(t, (5,), headers={headers.FIRST_DELIVERED: 1, headers.WAITS: 1}).state == "RETRY"
    (retry_msg,) = published(r, app)
    assert headers.FIRST_DELIVERED not in retry_msg.custom()


# -- held now ----------------------------------------------------------------------------------------


def test_held_now_counts_running_bodies_and_the_flush_writes_then_removes_the_gauge(
    app: Celery, r: redis.Redis, prefix: str
) -> None:
    seen: list[Any] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="g.held", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        seen.append(metrics.held_now())
        metrics.flush(r, prefix, interval=1.0)  # what the flusher thread does while a body runs
        seen.append(stats.prometheus(stats.read(r, prefix, windows=False)))
        return a

    assert deliver(t, (6,)).state == "SUCCESS"
    (row,) = seen[0]
    assert row["task"] == "g.held" and row["worker"] == HOSTNAME and row["held"] == 1
    assert abs(row["oldest_acquired_at"] - time.time()) < 30
    during = seen[1]
    held = samples(during, "lockguard_leases_held")
    assert held == {(("task", "g.held"), ("worker", HOSTNAME)): 1.0}
    assert samples(during, "lockguard_oldest_hold_seconds")[(("task", "g.held"), ("worker", HOSTNAME))] >= 0
    assert metrics.held_now() == [], "the body ended: nothing is held"
    assert r.ttl(metrics.proc_key(prefix, metrics.process_id())) > 0, "a gauge must expire on its own"
    metrics.flush(r, prefix, interval=1.0)
    after = stats.prometheus(stats.read(r, prefix, windows=False))
    assert samples(after, "lockguard_leases_held") == {}
    assert not r.exists(metrics.proc_key(prefix, metrics.process_id()))
    assert r.zcard(metrics.procs_key(prefix)) == 0
    # Nothing held, nothing held last time, nothing counted: the next flush sends nothing at all.
    assert metrics.flush(r, prefix) == 0


def test_a_body_that_raises_is_no_longer_held(app: Celery, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.fails", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        assert metrics.held_now()
        raise RuntimeError("no")

    assert deliver(t, (7,)).state == "FAILURE"
    assert metrics.held_now() == []


def test_stale_and_planted_gauges_are_skipped(r: redis.Redis, prefix: str) -> None:
    now = time.time()
    good = '{"at": %f, "ttl": 30, "held": [{"task": "t", "worker": "w", "held": 2, "oldest_acquired_at": %f}]}'
    r.set(metrics.proc_key(prefix, "h:1"), good % (now, now - 12))
    r.set(metrics.proc_key(prefix, "h:2"), good % (now - 3600, now - 3600))  # its process stopped flushing
    r.set(metrics.proc_key(prefix, "h:3"), "not json")
    r.set(metrics.proc_key(prefix, "h:4"), '{"at": "nan", "ttl": 30, "held": []}')
    r.zadd(metrics.procs_key(prefix), {"h:1": now, "h:2": now, "h:3": now, "h:4": now, "h:5": now})
    text = stats.prometheus(stats.read(r, prefix, windows=False))
    assert samples(text, "lockguard_leases_held") == {(("task", "t"), ("worker", "w")): 2.0}
    age = samples(text, "lockguard_oldest_hold_seconds")[(("task", "t"), ("worker", "w"))]
    assert 11 <= age < 60


# -- renewal lag -------------------------------------------------------------------------------------


def test_renewal_lag_is_tallied_by_the_renewer_and_taken_by_the_flush(app: Celery, r: redis.Redis, prefix: str) -> None:
    renewed = threading.Event()

    @app.task(base=LockedTask, bind=True, shared=False, name="g.renew", lock_key="acct:{a}", lock_ttl=0.3)
    def t(self: Any, a: int) -> int:
        from celery_lockguard._renewer import renewer

        start = renewer().ticks
        deadline = time.monotonic() + 30
        while renewer().ticks < start + 3 and time.monotonic() < deadline:
            renewed.wait(0.02)
        assert self.lock is not None and self.lock.held
        return a

    assert deliver(t, (8,)).state == "SUCCESS"
    metrics.flush(r, prefix)
    total = r.hgetall(metrics.total_key(prefix))
    assert int(total["g.renew|renew_lag.count"]) >= 3
    le = sum(int(v) for k, v in total.items() if k.startswith("g.renew|renew_lag.le."))
    assert le == int(total["g.renew|renew_lag.count"]), "every renewal is in exactly one bucket"
    text = stats.prometheus(stats.read(r, prefix, windows=False))
    assert samples(text, "lockguard_renewal_lag_seconds_count")[(("task", "g.renew"),)] >= 3


def test_a_renewal_after_failed_ticks_counts_its_lag_from_the_original_due_time(own_redis: RedisServer) -> None:
    """A refused renewal (NOPERM here) is retried soon; the renewal that finally goes through reports how late it ran
    against when the first, refused one was due -- not against the retry's own schedule."""
    admin = own_redis.client()
    admin.execute_command("ACL", "SETUSER", "renewer", "on", ">pw", "~*", "+@all")
    client = own_redis.client(username="renewer", password="pw", socket_timeout=2)
    got = L.acquire(
        admin, "lg", "lag", ttl_ms=6000, task_id="t", task_name="g.lag", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    renewer = Renewer()
    admin.execute_command("ACL", "SETUSER", "renewer", "-evalsha")
    renewer.track(got, client, 3600)
    try:

        def failures() -> int:
            return int(metrics.snapshot().get("-", {}).get("lock.backend_unavailable", 0))

        wait_for(lambda: failures() >= 1, 30, interval=0.01, what="the first refused renewal (due ~2 s in)")
        first_failure = time.monotonic()
        wait_for(lambda: failures() >= 3, 30, interval=0.01, what="two retries refused too")
        restored = time.monotonic()
        admin.execute_command("ACL", "SETUSER", "renewer", "+evalsha")
        lags = wait_for(lambda: renewer.take_lags() or None, 30, interval=0.02, what="the renewal that went through")
        count, sum_ms = lags["g.lag"][0], lags["g.lag"][1]
        assert count == 1 and not got.lost
        assert sum_ms >= (restored - first_failure) * 1000, "the lag was counted from the retry, not the due time"
    finally:
        renewer.untrack(got)
        admin.execute_command("ACL", "DELUSER", "renewer")  # the private server is the session's


def test_a_late_renewal_counts_from_when_it_was_due() -> None:
    """The lag of one renewal is the time past its due moment: a renewer asleep 0.2 s past it reports ~200 ms."""
    renewer = Renewer()
    lease = L.Lease("k", "p", "tok", 1, 30_000, time.monotonic(), "id", "g.late")
    renewer._lags.clear()
    renewer._tally_lag(lease.task_name, 0.0)
    renewer._tally_lag(lease.task_name, 200.0)
    renewer._tally_lag(lease.task_name, 7000.0)
    lags = renewer.take_lags()
    row = lags["g.late"]
    assert row[0] == 3 and row[1] == 7200.0
    names = metrics.bucket_names("renew_lag")
    assert dict(zip(names, row[2:], strict=True)) == {**dict.fromkeys(names, 0.0), "1": 1.0, "500": 1.0, "+Inf": 1.0}
    assert renewer.take_lags() == {}, "a tally is handed over once"


# -- per-template contention and the text itself -----------------------------------------------------


def test_contention_is_labelled_by_template_and_the_text_parses(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.charge", lock_key="invoice:{n}", on_locked="raise")
    def charge(self: Any, n: int) -> int:
        return n

    @app.task(base=LockedTask, bind=True, shared=False, name="g.refund", lock_key="invoice:{n}", on_locked="raise")
    def refund(self: Any, n: int) -> int:
        return n

    holder = hold(r, prefix, "invoice:9")
    assert deliver(charge, (9,)).state == "FAILURE"
    assert deliver(refund, (9,)).state == "FAILURE"
    L.release(r, holder, prefix)
    for n in range(3):
        assert deliver(charge, (100 + n,)).state == "SUCCESS"
    metrics.flush(r, prefix)
    templates = {"g.charge": "invoice:{n}", "g.refund": "invoice:{n}"}
    text = stats.prometheus(stats.read(r, prefix, windows=False), templates)
    assert samples(text, "lockguard_template_contended_total") == {(("template", "invoice:{n}"),): 2.0}
    assert samples(text, "lockguard_template_acquired_total") == {(("template", "invoice:{n}"),): 3.0}
    found = families(text)
    # prometheus_client names a counter family without its _total suffix.
    names = {n if not n.endswith("_total") else n[: -len("_total")] for n in stats.EXPORTED_METRICS}
    assert set(found) <= names
    assert found["lockguard_wait_seconds"].type == "histogram"
    assert found["lockguard_leases_held"].type == "gauge"
    wait = samples(text, "lockguard_wait_seconds_bucket")
    inf = wait[(("le", "+Inf"), ("task", "g.charge"))]
    assert inf == samples(text, "lockguard_wait_seconds_count")[(("task", "g.charge"),)] == 3
    cumulative = [v for (labels, v) in sorted(wait.items(), key=lambda kv: float(dict(kv[0])["le"])) if labels]
    assert cumulative == sorted(cumulative), "buckets must be cumulative"


def test_histograms_from_several_processes_sum(r: redis.Redis, prefix: str) -> None:
    """Each process flushes its own non-cumulative buckets; HINCRBY sums them, the text makes them cumulative."""
    metrics.observe_wait("g.sum", 3)
    metrics.observe_wait("g.sum", 700)
    metrics.flush(r, prefix)  # "process A"
    metrics.clear()
    metrics.observe_wait("g.sum", 4)
    metrics.observe_wait("g.sum", 20_000)
    metrics.flush(r, prefix)  # "process B"
    text = stats.prometheus(stats.read(r, prefix, windows=False))
    buckets = {dict(k)["le"]: v for k, v in samples(text, "lockguard_wait_seconds_bucket").items()}
    assert buckets["0.005"] == 2 and buckets["1.0"] == 3 and buckets["15.0"] == 3 and buckets["60.0"] == 4
    assert buckets["+Inf"] == 4
    assert samples(text, "lockguard_wait_seconds_sum")[(("task", "g.sum"),)] == pytest.approx(20.707)


# -- cheap: nothing per task, one transaction per flush, no SCAN per scrape -------------------------


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}


def test_no_round_trip_per_task_and_no_scan_per_scrape(own_redis: RedisServer, redis_url: str, prefix: str) -> None:
    """On a private lock Redis: 20 deliveries send nothing but their scripts; a flush is one MULTI; no SCAN."""
    # Broker and results on the shared server, locks and metrics alone on the private one: its counts are ours.
    app = make_app("cheap", redis_url, prefix, lockguard_redis_url=own_redis.url)

    @app.task(base=LockedTask, bind=True, shared=False, name="g.cheap", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        return a

    client = own_redis.client()
    assert deliver(t, (0,)).state == "SUCCESS"  # warm: scripts loaded, connections made
    metrics.flush(client, prefix)
    client.config_resetstat()
    for n in range(20):
        assert deliver(t, (n + 1,)).state == "SUCCESS"
    during = commandstats(client)
    # In the scripts, each call is counted too (TIME, HSET, ...): what the client sent is EVALSHA only.
    assert during["evalsha"] == 40, "one ACQUIRE and one RELEASE per delivery"
    sent = {"multi", "exec", "hincrby", "zadd", "zrevrangebyscore", "zcard", "mget", "strlen", "getrange"}
    sent |= {"zremrangebyscore", "hsetnx"}
    sent |= {"scan", "hgetall"}
    assert not sent & set(during), f"a delivery sent a metrics command: {during}"
    client.config_resetstat()
    metrics.flush(client, prefix)
    assert commandstats(client)["multi"] == 1
    # 50 bodies held "now" in 5 processes' gauges: a scrape reads them in 3 round trips (index, sizes, gauges).
    now = time.time()
    for p in range(5):
        row = {"task": "g.cheap", "worker": f"w{p}", "held": 10, "oldest_acquired_at": now - 5}
        client.set(metrics.proc_key(prefix, f"h:{p}"), json.dumps({"at": now, "ttl": 60, "held": [row]}))
        client.zadd(metrics.procs_key(prefix), {f"h:{p}": now})
    client.config_resetstat()
    for _ in range(10):
        text = stats.prometheus(stats.read(client, prefix, windows=False))
    scraped = commandstats(client)
    assert "scan" not in scraped and "keys" not in scraped
    assert "zrange" not in scraped and "mget" not in scraped, "the index is read over its live window only"
    # Per scrape: HGETALL (totals), ZREVRANGEBYSCORE (live window), ZCARD (what it left out); per gauge, in
    # pipelines: STRLEN (sized first), GETRANGE (read within its bound).
    per_scrape = {"hgetall": 10, "zrevrangebyscore": 10, "zcard": 10, "strlen": 50, "getrange": 50}
    assert {c: scraped.get(c, 0) for c in per_scrape} == per_scrape
    assert sum(samples(text, "lockguard_leases_held").values()) == 50


# -- OpenTelemetry -----------------------------------------------------------------------------------


@pytest.fixture
def otel_reader() -> Iterator[Any]:
    """An SDK MeterProvider with an in-memory reader, used by lockguard for this test only."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from celery_lockguard import _otel_metrics as otel

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    otel.use(provider)
    yield reader
    otel._instruments = otel._UNSET  # back to the global provider, looked up on next use
    provider.shutdown()


def otel_points(reader: Any) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_the_same_numbers_as_opentelemetry_metrics(app: Celery, r: redis.Redis, prefix: str, otel_reader: Any) -> None:
    during: list[dict[str, list[Any]]] = []

    @app.task(base=LockedTask, bind=True, shared=False, name="g.otel", lock_key="acct:{a}", lock_ttl=0.3)
    def t(self: Any, a: int) -> int:
        from celery_lockguard._renewer import renewer

        start, deadline = renewer().ticks, time.monotonic() + 30
        while renewer().ticks < start + 2 and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        during.append(otel_points(otel_reader))
        return a

    assert deliver(t, (10,)).state == "SUCCESS"
    (held,) = [p for p in during[0]["lockguard.leases.held"] if p.attributes["task"] == "g.otel"]
    assert held.value == 1 and held.attributes["worker"] == HOSTNAME
    assert [p.value >= 0 for p in during[0]["lockguard.hold.oldest"]] == [True]
    metrics.flush(r, prefix)  # hands the renewer's lag tally over, to Redis and to OpenTelemetry alike
    after = otel_points(otel_reader)
    events = {p.attributes["event"]: p.value for p in after["lockguard.events"] if p.attributes["task"] == "g.otel"}
    assert events["lock.acquired"] == 1 and events["lock.released"] == 1
    (wait,) = [p for p in after["lockguard.wait.duration"] if p.attributes["task"] == "g.otel"]
    assert wait.count == 1 and list(wait.explicit_bounds) == [b / 1000 for b in metrics.WAIT_BUCKETS_MS]
    (hold_point,) = [p for p in after["lockguard.hold.duration"] if p.attributes["task"] == "g.otel"]
    assert hold_point.count == 1 and hold_point.sum > 0
    (lag,) = [p for p in after["lockguard.renewal.lag"] if p.attributes["task"] == "g.otel"]
    flushed = int(r.hget(metrics.total_key(prefix), "g.otel|renew_lag.count") or 0)
    assert lag.count == flushed >= 2
    held_after = [p for p in after.get("lockguard.leases.held", []) if p.attributes["task"] == "g.otel"]
    assert held_after == [], "the body ended: nothing is observed as held"


def test_a_lost_lease_is_not_held_though_its_body_runs_on(app: Celery, r: redis.Redis, prefix: str) -> None:
    seen: list[Any] = []

    @app.task(
        base=LockedTask, bind=True, shared=False, name="g.lost", lock_key="acct:{a}", lock_ttl=0.2, lock_renew=False
    )
    def t(self: Any, a: int) -> int:
        seen.append(len(metrics.held_now()))
        deadline = time.monotonic() + 30
        while self.lock.held and time.monotonic() < deadline:  # no renewal: its validity passes
            threading.Event().wait(0.02)
        seen.append(len(metrics.held_now()))
        return a

    assert deliver(t, (11,)).state == "SUCCESS"
    assert seen == [1, 0]


def test_a_lease_released_by_retry_without_throw_is_not_held(app: Celery, r: redis.Redis, prefix: str) -> None:
    """``retry(throw=False)`` frees the lease (or hands it to the retry as its claim) and the body runs on."""
    seen: list[Any] = []
    # No cyclic GC while the retries publish: an AsyncResult collected inside a publish's result subscribe
    # unsubscribes from its __del__ on the same PubSub and deadlocks on its lock (redis-py 5's PubSub lock is
    # not reentrant; seen once in compat's celery 5.3 + redis-py 5 leg). Collected below, outside any publish.
    gc.disable()
    try:
        _nothrow_deliveries(app, r, prefix, seen)
    finally:
        gc.enable()
        gc.collect()
    assert seen == [([], {}), ([], {})], "a released lease still counted as held"


def _nothrow_deliveries(app: Celery, r: redis.Redis, prefix: str, seen: list[Any]) -> None:
    for mode in ("while_running", "until_done"):

        @app.task(
            base=LockedTask, bind=True, shared=False, name=f"g.nothrow.{mode}", lock_key="acct:{a}", lock_mode=mode
        )
        def t(self: Any, a: int) -> int:
            self.retry(countdown=300, throw=False)
            assert self.lock is not None and self.lock.released
            metrics.flush(r, prefix, interval=1.0)  # the flusher thread, while this body runs on
            seen.append((metrics.held_now(), stats.held_now(stats.read(r, prefix, windows=False))))
            return a

        assert deliver(t, (12,)).state == "SUCCESS"


@pytest.mark.parametrize(
    "value", [float("inf"), float("-inf"), float("nan"), -(10**19), 10**30, -5, "1e400", "soon", [1], {"a": 1}]
)
def test_a_hostile_first_delivery_header_neither_fails_the_delivery_nor_poisons_the_flush(
    app: Celery, r: redis.Redis, prefix: str, value: Any
) -> None:
    """Anyone who can publish sets this header: no value may fail the task or make a flush fail (and replay)."""

    @app.task(base=LockedTask, bind=True, shared=False, name="g.hostile", lock_key="acct:{a}")
    def t(self: Any, a: int) -> int:
        return a

    assert deliver(t, (13,), headers={headers.FIRST_DELIVERED: value}).state == "SUCCESS"
    assert metrics.flush(r, prefix) > 0
    assert metrics.pending() == 0, "the flush failed: its counts went back, to be applied again"
    metrics.flush(r, prefix)
    total = metrics.total_key(prefix)
    assert r.hget(total, "g.hostile|lock.acquired") == "1"
    assert r.hget(total, "g.hostile|wait.count") == "1"
    # An implausible first delivery reads as absent: the wait counts from this delivery.
    assert int(r.hget(total, "g.hostile|wait.sum_ms") or 0) < 60_000


def test_a_wait_replaces_a_garbage_first_delivery_header(app: Celery, r: redis.Redis, prefix: str) -> None:
    @app.task(base=LockedTask, bind=True, shared=False, name="g.garbage", lock_key="acct:{a}", on_locked="retry")
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "acct:14")
    before_ms = time.time() * 1000
    assert deliver(t, (14,), headers={headers.FIRST_DELIVERED: -(10**19)}).state == "RETRY"
    (copy,) = published(r, app)
    assert before_ms - 1 <= copy.custom()[headers.FIRST_DELIVERED] <= time.time() * 1000 + 1


def test_observations_are_bounded() -> None:
    metrics.observe("g.bound", "wait", 1e300)
    metrics.observe("g.bound", "wait", float("-inf"))
    metrics.observe("g.bound", "wait", float("nan"))
    wait = metrics.snapshot()["g.bound"]["wait"]
    assert wait["count"] == 2 and wait["sum_ms"] == metrics.MAX_OBSERVATION_MS
    assert wait["buckets"]["+Inf"] == 1 and wait["buckets"]["5"] == 1
