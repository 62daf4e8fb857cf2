"""Review of the speed commits a2099e8 (structlog level filter asked of the wrapper class, bucket_of by
bisect) and 7ca8585 (publishing_task_id from Celery's task stack), through real behaviour.

Each structlog configuration a user may have must log the same events as before (9b458ff); a real
prefork worker with structlog configured keeps its levels and counts; a task's own republish is
never deduplicated against itself; histogram buckets are unchanged at their edges.
"""

from __future__ import annotations

import json
import logging
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from celery import Celery, _state, chain, current_task
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard import _claims as claims
from celery_lockguard import _events as events
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import settings
from celery_lockguard._keys import claim_name, lock_name
from celery_lockguard._renewer import Renewer
from celery_lockguard.testing import Worker

from .conftest import make_cfg
from .harness import wait_for
from .workerapp import create_app

ROOT = Path(__file__).resolve().parent.parent
LOGGER = "celery_lockguard"

DEBUG_EV = ("lock.acquired", {"lock_key": "k", "task_id": "t-1"})
INFO_EV = ("lock.skipped_duplicate", {"lock_key": "k", "task_id": "t-2", "holder_task_id": "t-1"})
WARN_EV = ("lock.lost", {"lock_key": "k", "task_id": "t-3"})
LEVEL_OF = {"lock.acquired": logging.DEBUG, "lock.skipped_duplicate": logging.INFO, "lock.lost": logging.WARNING}


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """A proxy of this test's own (one that caches stays here) and the (level, event) pairs that reach structlog."""
    monkeypatch.setattr(events, "_structlog_logger", None)
    got: list[tuple[str, str]] = []
    yield got


def keeper(got: list[tuple[str, str]]) -> Any:
    def keep(logger: Any, name: str, event: dict[str, Any]) -> Any:
        got.append((name, event["event"]))
        raise structlog.DropEvent

    return keep


def emit(ev: tuple[str, dict[str, Any]]) -> None:
    events.emit(ev[0], "t", **ev[1])


def emit_from_a_thread(ev: tuple[str, dict[str, Any]]) -> None:
    """As the renewer does: a thread with no app, the backend captured where the lease was tracked."""
    th = threading.Thread(
        target=events.emit_for, args=(ev[0], "t", dict(ev[1])), kwargs={"backend": "structlog", "span": None}
    )
    th.start()
    th.join()


# -- structlog: every configuration logs what it logged before -------------------------------------


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR])
def test_a_filtering_bound_logger_logs_exactly_the_events_at_or_above_its_level(
    seen: list[tuple[str, str]], level: int, cache: bool
) -> None:
    structlog.configure(
        processors=[keeper(seen)],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=cache,
    )
    for ev in (DEBUG_EV, INFO_EV, WARN_EV, DEBUG_EV, INFO_EV):
        emit(ev)
    for ev in (WARN_EV, DEBUG_EV):
        emit_from_a_thread(ev)
    sent = [DEBUG_EV, INFO_EV, WARN_EV, DEBUG_EV, INFO_EV, WARN_EV, DEBUG_EV]
    assert [e for _, e in seen] == [ev[0] for ev in sent if LEVEL_OF[ev[0]] >= level]
    assert metrics.snapshot()["t"]["lock.acquired"] == 3  # counted whether logged or not


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO, logging.WARNING])
def test_the_stdlib_bound_logger_filtered_by_the_stdlib_level_logs_the_same_events(
    seen: list[tuple[str, str]], level: int, cache: bool
) -> None:
    std = logging.getLogger(LOGGER)
    before = std.level
    std.setLevel(level)
    try:
        structlog.configure(
            processors=[structlog.stdlib.filter_by_level, keeper(seen)],
            wrapper_class=structlog.stdlib.BoundLogger,
            logger_factory=structlog.stdlib.LoggerFactory(),
            cache_logger_on_first_use=cache,
        )
        for ev in (DEBUG_EV, INFO_EV, WARN_EV, DEBUG_EV):
            emit(ev)
        emit_from_a_thread(WARN_EV)
    finally:
        std.setLevel(before)
    sent = [DEBUG_EV, INFO_EV, WARN_EV, DEBUG_EV, WARN_EV]
    assert [e for _, e in seen] == [ev[0] for ev in sent if LEVEL_OF[ev[0]] >= level]


def test_unconfigured_structlog_by_setting_then_capture_logs_see_every_event(
    seen: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    for ev in (DEBUG_EV, INFO_EV):
        emit_from_a_thread(ev)  # backend "structlog" with structlog never configured: its default PrintLogger
    out = capsys.readouterr().out
    assert "lock.acquired" in out and "lock.skipped_duplicate" in out
    with capture_logs() as logs:
        for ev in (DEBUG_EV, INFO_EV, WARN_EV):
            emit(ev)
    assert [(x["log_level"], x["event"]) for x in logs] == [
        ("debug", "lock.acquired"),
        ("info", "lock.skipped_duplicate"),
        ("warning", "lock.lost"),
    ]


@pytest.mark.parametrize(
    ("later", "expected"),
    [
        # Cached on first use at INFO: a later WARNING configuration does not reach the cached logger.
        (logging.WARNING, ["lock.skipped_duplicate", "lock.lost"]),
        # Nor does a later DEBUG one: the cached logger still filters debug out.
        (logging.DEBUG, ["lock.skipped_duplicate", "lock.lost"]),
    ],
)
def test_a_logger_cached_on_first_use_keeps_the_configuration_of_that_use_even_a_filtered_one(
    seen: list[tuple[str, str]], later: int, expected: list[str]
) -> None:
    """cache_logger_on_first_use: structlog caches the bound logger the first time the proxy is used. At
    9b458ff lockguard's first event, even a filtered debug one, was that use. Since a2099e8 a filtered event
    no longer binds, so the logger is cached at the first event that passes, under whatever configuration is
    in force then: reconfiguring after lockguard's first (debug) event changes which events are logged --
    here an info event (skipped_duplicate) lost after reconfiguring to WARNING, or debug events appearing."""
    structlog.configure(
        processors=[keeper(seen)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    emit(DEBUG_EV)  # lockguard's first use of its logger (an acquisition), filtered out at INFO
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(later))
    for ev in (DEBUG_EV, INFO_EV, WARN_EV):
        emit(ev)
    assert [e for _, e in seen] == expected


def test_a_logger_cached_by_an_info_event_keeps_its_level_after_reconfiguring(seen: list[tuple[str, str]]) -> None:
    structlog.configure(
        processors=[keeper(seen)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        cache_logger_on_first_use=True,
    )
    emit(WARN_EV)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    for ev in (DEBUG_EV, INFO_EV, WARN_EV):
        emit(ev)
    assert [e for _, e in seen] == ["lock.lost", "lock.lost"]


@pytest.mark.parametrize("backend", ["logging", "structlog", "auto"])
@pytest.mark.parametrize("level", [logging.DEBUG, logging.WARNING])
def test_the_backend_setting_crossed_with_a_filtering_structlog(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture, seen: list[tuple[str, str]], backend: str, level: int
) -> None:
    before = _state.get_current_app()
    app = Celery("rvspeed", broker=redis_url, set_as_current=True)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_log_backend = backend
    try:

        @app.task(base=LockedTask, bind=True, shared=False, name="rv.backend", lock_key="k:{a}")
        def t(self: Any, a: int) -> int:
            return a

        structlog.configure(processors=[keeper(seen)], wrapper_class=structlog.make_filtering_bound_logger(level))
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        assert t.apply(args=(1,)).get() == 1
    finally:
        before.set_current()
    via_logging = [rec.lockguard["event"] for rec in caplog.records if rec.name == LOGGER]  # type: ignore[attr-defined]
    if backend == "logging":
        assert (via_logging, seen) == (["lock.acquired", "lock.released"], [])
    else:  # auto: structlog is configured
        assert via_logging == []
        assert [e for _, e in seen] == ([] if level == logging.WARNING else ["lock.acquired", "lock.released"])
    assert metrics.snapshot()["rv.backend"]["lock.acquired"] == 1


@pytest.mark.parametrize("level", [logging.DEBUG, logging.WARNING])
def test_the_renewers_lock_lost_reaches_a_filtering_structlog_and_renewed_only_at_debug(
    redis_url: str, prefix: str, seen: list[tuple[str, str]], level: int
) -> None:
    before = _state.get_current_app()
    app = Celery("rvspeed", broker=redis_url, set_as_current=True)
    app.conf.lockguard_key_prefix = prefix
    app.conf.lockguard_log_backend = "structlog"
    try:
        s = settings(app)
        c = redis.Redis.from_url(s.redis_url, decode_responses=True)
        got = L.acquire(
            c, s.key_prefix, "rn", ttl_ms=600, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
        )
        assert isinstance(got, L.Lease)
        structlog.configure(processors=[keeper(seen)], wrapper_class=structlog.make_filtering_bound_logger(level))
        renewer = Renewer()
        renewer.track(got, c, 3600)
    finally:
        before.set_current()
    wait_for(lambda: metrics.snapshot().get("-", {}).get("lock.renewed", 0) >= 1, 10, interval=0.02, what="a renewal")
    c.delete(lock_name(s.key_prefix, "rn"))
    wait_for(lambda: got.lost and renewer.tracked() == 0, 5, interval=0.01, what="the loss to be found")
    renewer.flush_events()
    wait_for(lambda: ("warning", "lock.lost") in seen, 5, interval=0.01, what="lock.lost through structlog")
    names = {e for _, e in seen}
    assert ("lock.renewed" in names) == (level == logging.DEBUG), seen


# -- a real prefork worker with structlog configured ---------------------------------------------------

STRUCTLOG_APP = """
import json, logging, os
import structlog
from tests.workerapp import create_app

structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, os.environ["LG_STRUCTLOG_LEVEL"])),
    logger_factory=structlog.WriteLoggerFactory(file=open(os.environ["LG_STRUCTLOG_FILE"], "a")),
    cache_logger_on_first_use=os.environ["LG_STRUCTLOG_CACHE"] == "1",
)
app = create_app(json.loads(os.environ["LG_CONFIG"]))
"""


@pytest.mark.integration
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_a_prefork_worker_with_structlog_logs_debug_events_only_at_debug_and_counts_every_acquisition(
    redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path, level: str, cache: bool
) -> None:
    (tmp_path / "slapp.py").write_text(textwrap.dedent(STRUCTLOG_APP))
    cfg = make_cfg(prefix, redis_url, metrics_flush_interval=3600)
    control = create_app(cfg)
    out = tmp_path / "structlog.jsonl"
    out.touch()
    name = f"w{uuid.uuid4().hex[:6]}"
    worker = Worker(
        "slapp:app",
        control=control,
        concurrency=2,
        name=name,
        queues=[cfg["queue"]],
        env={
            "LG_CONFIG": json.dumps(cfg),
            "PYTHONPATH": f"{tmp_path}:{ROOT}",
            "LG_STRUCTLOG_LEVEL": level,
            "LG_STRUCTLOG_FILE": str(out),
            "LG_STRUCTLOG_CACHE": "1" if cache else "0",
        },
        cwd=ROOT,
        loglevel=level,  # the worker's stdlib level matches: structlog's own filter decides either way
        log_path=tmp_path / f"{name}.log",
    )
    with worker:
        results = [control.tasks["plain_locked"].delay(f"m-{uuid.uuid4().hex[:8]}") for _ in range(6)]
        assert all(res.get(timeout=30)["locked"] for res in results)
        key = f"log-{uuid.uuid4().hex[:6]}"
        first = control.tasks["short_ttl"].delay(key, 1.5, "")
        wait_for(lambda: r.exists(lock_name(prefix, f"res:{key}")), 30, what="the lease")
        assert control.tasks["short_ttl"].delay(key, 1.5, "").get(timeout=30) is None  # skipped
        assert first.get(timeout=30)["held"]
        wait_for(lambda: "lock.skipped_duplicate" in out.read_text(), 30, interval=0.1, what="the skip via structlog")
        if level == "DEBUG":
            wait_for(lambda: out.read_text().count('"lock.released"') >= 7, 30, interval=0.1, what="the releases")
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    got = [(x["level"], x["event"]) for x in lines if x["event"].startswith("lock.")]
    assert ("info", "lock.skipped_duplicate") in got
    routine = {"lock.acquired", "lock.released", "lock.renewed"}
    if level == "INFO":
        assert [g for g in got if g[1] in routine] == [], got
        assert all(lvl != "debug" for lvl, _ in got), got
    else:
        assert sum(1 for g in got if g == ("debug", "lock.acquired")) == 7, got
        assert sum(1 for g in got if g == ("debug", "lock.released")) == 7, got
        assert ("debug", "lock.renewed") in got, got
    assert "lock." not in worker.output().replace("lockguard", ""), worker.output()[-3000:]  # not via stdlib
    total = r.hgetall(metrics.total_key(prefix))  # flushed at the warm stop
    assert int(total.get("plain_locked|lock.acquired", 0)) == 6, total
    assert int(total.get("short_ttl|lock.acquired", 0)) == 1, total
    assert int(total.get("short_ttl|lock.skipped_duplicate", 0)) == 1, total
    assert int(total.get("plain_locked|hold.count", 0)) == 6, total


# -- bucket_of at the edges, and in a flush ---------------------------------------------------------


def linear_bucket(bounds: tuple[int, ...], ms: float) -> int:
    """bucket_of as it was at 9b458ff."""
    for i, bound in enumerate(bounds):
        if ms <= bound:
            return i
    return len(bounds)


def edges(bounds: tuple[int, ...]) -> list[float]:
    points = [0.0, -1.0, 0.5, float("inf"), metrics.MAX_OBSERVATION_MS, 1e-12]
    for b in bounds:
        points += [b - 1, b - 0.5, b - 1e-9, b, float(b), b + 1e-9, b + 0.5, b + 1]
    return points


@pytest.mark.parametrize("family", sorted(metrics.HISTOGRAMS))
def test_bucket_of_is_the_first_bound_at_or_above_at_every_edge(family: str) -> None:
    bounds = metrics.HISTOGRAMS[family]
    assert list(bounds) == sorted(set(bounds))  # bisect's precondition
    for ms in edges(bounds):
        assert metrics.bucket_of(bounds, ms) == linear_bucket(bounds, ms), (family, ms)


def test_hold_and_wait_histograms_flush_unchanged_at_bucket_edges(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    expected: dict[str, int] = {}
    for family, observe in (("hold", metrics.observe_hold), ("wait", metrics.observe_wait)):
        bounds = metrics.HISTOGRAMS[family]
        names = metrics.bucket_names(family)
        for ms in edges(bounds):
            observe("rv.edge", ms)
            clamped = min(max(ms, 0.0), metrics.MAX_OBSERVATION_MS)
            field = f"rv.edge|{family}.le.{names[linear_bucket(bounds, clamped)]}"
            expected[field] = expected.get(field, 0) + 1
    tally = metrics.new_row("renew_lag")
    for ms in edges(metrics.RENEW_LAG_BUCKETS_MS):
        if 0 <= ms < 1e9:  # the renewer's lags: finite, never negative
            metrics.add_to_row(tally, metrics.RENEW_LAG_BUCKETS_MS, ms)
            name = metrics.bucket_names("renew_lag")[linear_bucket(metrics.RENEW_LAG_BUCKETS_MS, ms)]
            expected[f"rv.edge|renew_lag.le.{name}"] = expected.get(f"rv.edge|renew_lag.le.{name}", 0) + 1
    metrics.merge("rv.edge", "renew_lag", tally)
    assert metrics.flush(client, prefix) > 0
    total = client.hgetall(metrics.total_key(prefix))
    buckets = {k: int(v) for k, v in total.items() if ".le." in k}
    assert buckets == expected


# -- publishing_task_id: the running task, as celery.current_task saw it -----------------------------


def reference_publisher() -> str | None:
    """publishing_task_id as it was at 9b458ff (through the ``celery.current_task`` proxy)."""
    task = current_task
    request = getattr(task, "request", None)
    if request is None or request.called_directly:
        return None
    return getattr(request, "id", None)


def test_publishing_task_id_matches_current_task_everywhere_a_publish_can_happen(redis_url: str, prefix: str) -> None:
    app = Celery("rvpub", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    seen: list[tuple[str, str | None, str | None]] = []

    def note(where: str) -> None:
        seen.append((where, claims.publishing_task_id(), reference_publisher()))

    @app.task(shared=False, name="rv.inner", bind=True)
    def inner(self: Any) -> None:
        note("inner")

    @app.task(shared=False, name="rv.outer", bind=True)
    def outer(self: Any) -> str:
        note("outer-before")
        inner.apply(task_id="inner-id")  # eager, inside another task's body
        note("outer-after-eager")
        inner()  # a direct call: called_directly
        note("outer-after-direct")
        th = threading.Thread(target=note, args=("thread",))
        th.start()
        th.join()
        return self.request.id

    note("no-task")
    assert outer.apply(task_id="outer-id").get() == "outer-id"
    note("after")
    assert [s[1] for s in seen] == [s[2] for s in seen], seen
    assert [(w, p) for w, p, _ in seen] == [
        ("no-task", None),
        ("outer-before", "outer-id"),
        ("inner", "inner-id"),
        ("outer-after-eager", "outer-id"),
        ("inner", None),
        ("outer-after-direct", "outer-id"),
        ("thread", None),
        ("after", None),
    ]


def test_an_until_done_task_republishing_itself_from_its_eager_body_is_not_its_own_duplicate(
    redis_url: str, prefix: str
) -> None:
    """The body runs eagerly (``apply``) under the id its queued message claimed: republishing that id from
    the body is its own republish (bypass), and follow-up identical work from the body is published (the
    claim is the publisher's). From another task's body, identical work is a duplicate of the queued copy;
    a canvas member is never one."""
    app = Celery("rvpub", broker=redis_url, set_as_current=False)
    app.conf.lockguard_key_prefix = prefix
    app.conf.task_default_queue = f"{prefix}-q"
    app.conf.broker_transport_options = {"global_keyprefix": f"{prefix}:kombu:"}
    out: dict[str, Any] = {}

    @app.task(base=LockedTask, bind=True, shared=False, name="rv.selfpub", lock_key="e:{n}", lock_mode="until_done")
    def selfpub(self: Any, n: int, again: bool) -> None:
        if again:
            out["own"] = self.apply_async((n, False), task_id=self.request.id).id
            out["follow_up"] = self.apply_async((n, False)).id

    @app.task(bind=True, shared=False, name="rv.other")
    def other(self: Any, n: int) -> None:
        out["from_other"] = selfpub.apply_async((n, False)).id
        out["from_other_own_id"] = selfpub.apply_async((n, False), task_id=self.request.id).id
        out["canvas"] = chain(selfpub.s(n, False), selfpub.si(n, False)).apply_async().parent.id

    queued = selfpub.apply_async((1, False))  # claims e:1 for queued.id (no worker: it stays queued)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.exists(claim_name(prefix, "e:1")) or r.exists(lock_name(prefix, "e:1"))
    assert selfpub.apply_async((1, False)).id == queued.id  # identical work from outside: deduplicated
    other.apply((1,), task_id="other-id").get()
    assert out["from_other"] == queued.id  # another task's identical work: the queued copy answers
    assert out["from_other_own_id"] == "other-id"  # the running task's own id: its republish, published
    assert out["canvas"] not in (queued.id, None)  # a chain member bypasses
    selfpub.apply((1, True), task_id=queued.id).get()  # the queued message's body, run here
    assert out["own"] == queued.id
    assert out["follow_up"] != queued.id  # held by the publisher: published, not answered with itself
