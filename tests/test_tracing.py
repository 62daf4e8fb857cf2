"""Lock decisions as span events on the current span (OpenTelemetry SDK, in-memory exporter)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import LockContended, LockedTask
from celery_lockguard import _lease as L
from celery_lockguard._keys import digest, lock_name

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    a = Celery("tracetest", broker=redis_url, set_as_current=False)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_socket_timeout = 0.5
    yield a


@pytest.fixture
def tracer() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("lockguard-test"), exporter
    provider.shutdown()


def span_events(exporter: InMemorySpanExporter) -> list[tuple[str, dict[str, Any]]]:
    (span,) = exporter.get_finished_spans()
    return [(e.name, dict(e.attributes or {})) for e in span.events]


def hold(r: redis.Redis, prefix: str, key: str, task_name: str = "other", dig: str = "d") -> L.Lease:
    got = L.acquire(
        r,
        prefix,
        key,
        ttl_ms=10_000,
        task_id="holder-1",
        task_name=task_name,
        digest=dig,
        worker="w",
        fence_ttl_ms=60_000,
    )
    assert isinstance(got, L.Lease)
    return got


def test_acquired_and_released_are_on_the_task_span_with_key_and_fence(app: Celery, tracer: Any) -> None:
    tr, exporter = tracer
    seen = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="tr.ok", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        seen["fence"] = self.lock.fence
        return a

    with tr.start_as_current_span("job"):
        assert t.apply(args=(1,), task_id="id-ok").get() == 1
    events = span_events(exporter)
    assert [name for name, _ in events] == ["lock.acquired", "lock.released"]
    for _, attrs in events:
        assert attrs["lockguard.lock_key"] == "k:1"
        assert attrs["lockguard.fence"] == seen["fence"]
        assert attrs["lockguard.task_name"] == "tr.ok"
    assert events[1][1]["lockguard.hold_ms"] >= 0


def test_a_skipped_duplicate_says_who_held_the_lock(app: Celery, r: redis.Redis, prefix: str, tracer: Any) -> None:
    tr, exporter = tracer

    @app.task(base=LockedTask, bind=True, shared=False, name="tr.dup", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:2", task_name="tr.dup", dig=digest({"a": 2}))
    with tr.start_as_current_span("job"):
        assert t.apply(args=(2,), task_id="id-dup").get() is None
    names = [name for name, _ in span_events(exporter)]
    assert names == ["lock.contended", "lock.skipped_duplicate"]
    assert span_events(exporter)[1][1]["lockguard.holder_task_id"] == "holder-1"


def test_waits_and_giving_up_are_on_the_span(app: Celery, r: redis.Redis, prefix: str, tracer: Any) -> None:
    tr, exporter = tracer

    @app.task(
        base=LockedTask, bind=True, shared=False, name="tr.wait", lock_key="k:{a}", on_locked="retry", lock_max_waits=1
    )
    def t(self: Any, a: int) -> int:
        return a

    hold(r, prefix, "k:3")
    with tr.start_as_current_span("job"):
        result = t.apply(args=(3,), task_id="id-wait")
    with pytest.raises(LockContended):
        result.get()
    names = [name for name, _ in span_events(exporter)]
    assert names == ["lock.contended", "lock.retry_scheduled", "lock.contended", "lock.wait_budget_exhausted"]


def test_a_lost_lease_is_on_the_span(app: Celery, r: redis.Redis, prefix: str, tracer: Any) -> None:
    tr, exporter = tracer

    @app.task(base=LockedTask, bind=True, shared=False, name="tr.lost", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        r.delete(lock_name(prefix, "k:4"))  # someone else's doing: the lease is gone before release
        return a

    with tr.start_as_current_span("job"):
        t.apply(args=(4,), task_id="id-lost").get()
    events = dict(span_events(exporter))
    assert "lock.lost" in events and events["lock.lost"]["lockguard.reason"] == "expired"
    assert "lock.expired_before_release" in events and "lock.released" not in events


def test_without_a_recording_span_nothing_breaks(app: Celery, tracer: Any) -> None:
    _, exporter = tracer

    @app.task(base=LockedTask, bind=True, shared=False, name="tr.nospan", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    assert t.apply(args=(5,)).get() == 5
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize("defer", [True, False], ids=["server-elsewhere", "server-on-this-host"])
def test_a_worker_delivery_says_on_its_span_that_the_release_went_out(
    app: Celery, tracer: Any, defer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferred release's reply is read after the task's span ended: the span gets lock.release_sent.
    A release waited for (the server on this host) puts lock.released on the span itself."""
    from celery.app.trace import build_tracer

    from celery_lockguard import _wire
    from celery_lockguard.testing import settle

    monkeypatch.setattr(_wire, "DEFER_NEAR", defer)  # the test's Redis is on this host
    tr, exporter = tracer

    @app.task(base=LockedTask, bind=True, shared=False, name="tr.worker", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    t.apply(args=(0,))  # the scripts cached and known on this thread's connection: the release may be deferred
    exporter.clear()
    request = {"id": "id-w", "task": t.name, "args": [7], "kwargs": {}, "hostname": "h@h", "is_eager": False}
    with tr.start_as_current_span("job"):
        assert build_tracer(t.name, t, app=app, eager=False, propagate=False)("id-w", [7], {}, request)[0] == 7
    settle()
    names = [name for name, _ in span_events(exporter)]
    assert names[0] == "lock.acquired"
    if defer:
        assert "lock.release_sent" in names and "lock.released" not in names
    else:
        assert "lock.released" in names and "lock.release_sent" not in names
