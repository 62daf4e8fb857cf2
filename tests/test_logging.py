"""Lock events through the standard ``logging`` module (Celery's), or structlog when the app uses it.

Unit tests read records with ``caplog``; the worker tests read a real
``celery worker``'s output at ``-l INFO`` and ``-l DEBUG``.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from celery import Celery, _state
from structlog.testing import capture_logs

from celery_lockguard import LockedTask
from celery_lockguard import _events as events
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import reset, settings
from celery_lockguard._keys import lock_name
from celery_lockguard._renewer import Renewer
from celery_lockguard.exceptions import ConfigurationError

from .conftest import make_cfg
from .harness import Worker, wait_for
from .workerapp import create_app

ROOT = Path(__file__).resolve().parent.parent
LOGGER = "celery_lockguard"


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    """The current app while the test runs, as a worker's app is (the log backend is read from it)."""
    before = _state.get_current_app()
    a = Celery("logtest", broker=redis_url, set_as_current=True)
    a.conf.lockguard_key_prefix = prefix
    a.conf.lockguard_socket_timeout = 0.5
    yield a
    before.set_current()


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == LOGGER]


# -- levels, message and fields -------------------------------------------------------


def test_an_event_is_a_record_of_the_celery_lockguard_logger_at_its_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    events.emit("lock.acquired", "billing.charge", lock_key="invoice:7", task_id="t-1", fence=3)
    events.emit(
        "lock.skipped_duplicate",
        "billing.charge",
        lock_key="invoice:7",
        task_id="t-2",
        holder_task_id="t-1",
        policy="skip",
        reason="identical_work_running",
    )
    events.emit(
        "lock.lost", "billing.charge", lock_key="invoice:7", task_id="t-1", fence=3, hold_ms=10, reason="expired"
    )
    acquired, skipped, lost = ours(caplog)
    assert (acquired.levelno, skipped.levelno, lost.levelno) == (logging.DEBUG, logging.INFO, logging.WARNING)
    assert acquired.getMessage() == "lock.acquired task_name=billing.charge lock_key=invoice:7 task_id=t-1 fence=3"
    assert skipped.getMessage() == (
        "lock.skipped_duplicate task_name=billing.charge lock_key=invoice:7 task_id=t-2 holder_task_id=t-1"
        " policy=skip reason=identical_work_running"
    )
    assert skipped.lockguard == {  # type: ignore[attr-defined]
        "event": "lock.skipped_duplicate",
        "task_name": "billing.charge",
        "lock_key": "invoice:7",
        "task_id": "t-2",
        "holder_task_id": "t-1",
        "policy": "skip",
        "reason": "identical_work_running",
    }


def test_routine_events_are_debug_and_what_an_operator_acts_on_is_info_or_above() -> None:
    for name in ("lock.acquired", "lock.released", "lock.renewed", "lock.contended", "lock.retry_scheduled"):
        assert events.level_of(name) == logging.DEBUG, name
    assert events.level_of("lock.skipped_duplicate") == logging.INFO
    assert events.level_of("completion.skipped") == logging.INFO
    for name in ("lock.lost", "lock.fail_open", "lock.backend_unavailable", "lock.wait_budget_exhausted"):
        assert events.level_of(name) == logging.WARNING, name


def test_values_with_spaces_are_quoted_none_is_left_out_and_lists_are_json(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    events.emit("lock.renewed", None, leases=2, lock_keys=["a:1", "b:2"])
    events.emit("lock.backend_unavailable", "t", lock_key="k", task_id=None, reason='release: ConnectionError: "down"')
    renewed, unavailable = ours(caplog)
    assert renewed.getMessage() == 'lock.renewed leases=2 lock_keys=["a:1","b:2"]'
    assert (
        unavailable.getMessage()
        == r'lock.backend_unavailable task_name=t lock_key=k reason="release: ConnectionError: \"down\""'
    )
    assert unavailable.lockguard["task_id"] is None  # type: ignore[attr-defined]


def test_an_uncounted_event_logs_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    try:
        raise RuntimeError("tick broke")
    except RuntimeError:
        events.logger.error("lock.renewer_error", reason="RuntimeError: tick broke", exc_info=True)
    (rec,) = ours(caplog)
    assert rec.levelno == logging.ERROR and rec.exc_info and rec.exc_info[0] is RuntimeError
    assert rec.getMessage() == 'lock.renewer_error reason="RuntimeError: tick broke"'
    assert metrics.snapshot() == {}  # logged, not counted


def test_a_disabled_level_costs_no_formatting_but_the_event_is_still_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    rendered = []

    class Noisy:
        def __str__(self) -> str:
            rendered.append(1)
            return "noisy"

    events.emit("lock.acquired", "t", lock_key=Noisy())
    assert rendered == [] and ours(caplog) == []
    assert metrics.snapshot()["t"]["lock.acquired"] == 1


def test_a_broken_handler_never_fails_the_task(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("handler down")

    class BrokenFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("filter down")

    @app.task(base=LockedTask, bind=True, shared=False, name="lg.broken", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a + 1

    logger = logging.getLogger(LOGGER)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for broken in (Broken(), BrokenFilter()):
        if isinstance(broken, logging.Handler):
            logger.addHandler(broken)
        else:
            logger.addFilter(broken)
        try:
            assert t.apply(args=(1,)).get() == 2
        finally:
            logger.removeHandler(broken) if isinstance(broken, logging.Handler) else logger.removeFilter(broken)
    assert metrics.snapshot()["lg.broken"]["lock.acquired"] == 2


# -- structlog ------------------------------------------------------------------------


def test_a_process_that_configured_structlog_gets_events_through_structlog(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with capture_logs() as logs:
        events.emit("lock.skipped_duplicate", "t", lock_key="k", task_id="t-2", holder_task_id="t-1")
        events.logger.warning("metrics.flush_failed", reason="down", pending=3)
    assert logs == [
        {
            "event": "lock.skipped_duplicate",
            "log_level": "info",
            "task_name": "t",
            "lock_key": "k",
            "task_id": "t-2",
            "holder_task_id": "t-1",
        },
        {"event": "metrics.flush_failed", "log_level": "warning", "task_name": None, "reason": "down", "pending": 3},
    ]
    assert ours(caplog) == []


@pytest.mark.parametrize("cache", [False, True])
def test_a_filtering_structlog_below_its_level_builds_no_logger_and_still_counts(
    cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """structlog's lazy proxy built a bound logger (and a PrintLogger) on every method read: for each
    per-task debug event a production app filters out. The filter is now asked of the wrapper class."""
    monkeypatch.setattr(events, "_structlog_logger", None)  # a proxy of its own: one that caches stays here
    made: list[int] = []
    seen: list[dict[str, Any]] = []

    def factory(*args: Any) -> Any:
        made.append(1)
        return structlog.PrintLogger()

    def keep(logger: Any, name: str, event: dict[str, Any]) -> Any:
        seen.append(dict(event))
        raise structlog.DropEvent

    structlog.configure(
        processors=[keep],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=factory,
        cache_logger_on_first_use=cache,
    )
    events.emit("lock.acquired", "t", lock_key="k", task_id="t-1")  # debug: filtered out
    # Caching, the first event is the proxy's first use (one logger, kept); else nothing is built for it.
    assert made == ([1] if cache else []) and seen == []
    events.emit("lock.skipped_duplicate", "t", lock_key="k", task_id="t-2", holder_task_id="t-1")  # info: logged
    assert [e["event"] for e in seen] == ["lock.skipped_duplicate"] and made == [1]
    events.emit("lock.acquired", "t", lock_key="k", task_id="t-3")
    assert len(seen) == 1 and made == [1]  # cached or not, a filtered event builds nothing
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    events.emit("lock.acquired", "t", lock_key="k", task_id="t-4")
    # Reconfigured to debug: the event is logged, unless the proxy cached its INFO logger on first use.
    assert [e["event"] for e in seen] == ["lock.skipped_duplicate"] + ([] if cache else ["lock.acquired"])
    assert metrics.snapshot()["t"]["lock.acquired"] == 3


@pytest.mark.parametrize("backend", ["logging", "structlog"])
def test_the_log_backend_setting_overrides_the_choice(
    app: Celery, caplog: pytest.LogCaptureFixture, backend: str
) -> None:
    app.conf.lockguard_log_backend = backend

    @app.task(base=LockedTask, bind=True, shared=False, name="lg.backend", lock_key="k:{a}")
    def t(self: Any, a: int) -> int:
        return a

    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with capture_logs() as logs:  # structlog "configured": auto would pick it
        assert t.apply(args=(1,)).get() == 1
    via_structlog = [e["event"] for e in logs]
    via_logging = [rec.lockguard["event"] for rec in ours(caplog)]  # type: ignore[attr-defined]
    expected = ["lock.acquired", "lock.released"]
    assert (via_logging, via_structlog) == ((expected, []) if backend == "logging" else ([], expected))


@pytest.mark.parametrize("isolated", [False, True])
def test_the_renewers_events_follow_the_log_backend_setting_outside_a_worker(
    app: Celery, caplog: pytest.LogCaptureFixture, isolated: bool
) -> None:
    """The renewer's thread has no current app: it used to read "auto" there and send lock.lost to a
    configured structlog despite lockguard_log_backend="logging". The backend is now read at track()."""
    app.conf.lockguard_log_backend = "logging"
    s = settings(app)
    c = redis.Redis.from_url(s.redis_url, decode_responses=True)
    got = L.acquire(
        c, s.key_prefix, "rn", ttl_ms=600, task_id="t", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000
    )
    assert isinstance(got, L.Lease)
    renewer = Renewer(isolated=isolated)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with capture_logs() as logs:  # structlog "configured": auto would pick it
        renewer.track(got, c, 3600)
        c.delete(lock_name(s.key_prefix, "rn"))
        wait_for(lambda: got.lost and renewer.tracked() == 0, 5, interval=0.01, what="the loss to be found")
        flusher = threading.Thread(target=renewer.flush_events)  # isolated: a thread with no app either
        flusher.start()
        flusher.join()
        wait_for(lambda: ours(caplog), 5, interval=0.01, what="lock.lost through logging")
    assert [rec.lockguard["event"] for rec in ours(caplog)] == ["lock.lost"]  # type: ignore[attr-defined]
    assert logs == []


def test_structlog_chosen_by_setting_without_structlog_configured(app: Celery) -> None:
    app.conf.lockguard_log_backend = "structlog"
    settings(app)
    assert not structlog.is_configured() and events._use_structlog()
    app.conf.lockguard_log_backend = "auto"
    reset(app)
    settings(app)
    assert not events._use_structlog()


@pytest.mark.parametrize("value", ["json", "", None, ["logging"]])
def test_a_bad_log_backend_names_setting_and_value(app: Celery, value: Any) -> None:
    app.conf.lockguard_log_backend = value
    with pytest.raises(ConfigurationError, match=re.escape(f"setting lockguard_log_backend={value!r} must be one of")):
        settings(app)


# -- the contract: every event has a level, and the reference documents it --------------


def emitted_events() -> dict[str, str | None]:
    """Event name -> the method level of an uncounted ``logger.<level>(...)`` call, or ``None`` for ``emit``."""
    found: dict[str, str | None] = {}
    for path in (ROOT / "celery_lockguard").glob("*.py"):
        text = path.read_text()
        for m in re.finditer(r'\bemit[(,]\s*"([a-z_]+\.[a-z_]+)"', text):  # emit("x", ...), _report(emit, "x", ...)
            found[m.group(1)] = None
        for m in re.finditer(r'\blogger\.(debug|info|warning|error)\(\s*"([a-z_]+\.[a-z_]+)"', text):
            found[m.group(2)] = m.group(1)
    return found


def test_every_event_has_its_level_in_the_table_and_the_reference() -> None:
    found = emitted_events()
    assert len(found) >= 20, found
    reference = (ROOT / "docs" / "reference.md").read_text()
    documented = dict(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| (debug|info|warning|error) \|", reference, re.M))
    for name, method in found.items():
        level = method or logging.getLevelName(events._LEVELS[name]).lower()
        assert name in events._LEVELS or method is not None, f"{name} is emitted but has no level in _events._LEVELS"
        assert documented.get(name) == level, f"docs/reference.md: {name} should be listed at {level}"


# -- a real worker --------------------------------------------------------------------


def run_renewal_and_duplicate(control: Celery, r: redis.Redis, prefix: str) -> str:
    """A 1 s lease held 1.5 s (so it renews) and an identical call meanwhile (skipped); returns the key."""
    key = f"log-{uuid.uuid4().hex[:6]}"
    first = control.tasks["short_ttl"].delay(key, 1.5, "")
    wait_for(lambda: r.exists(lock_name(prefix, f"res:{key}")), 30, what="the lease")
    second = control.tasks["short_ttl"].delay(key, 1.5, "")
    assert second.get(timeout=30) is None  # skipped: identical work is running
    assert first.get(timeout=30)["held"]
    return key


LINE = r"^\[[^\]]*: {level}/[^\]]*\] {event} "


def test_a_worker_at_info_logs_the_skip_at_its_level_and_no_routine_events(
    redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url)
    control = create_app(cfg)
    with Worker(control, cfg, log_dir=tmp_path) as worker:
        key = run_renewal_and_duplicate(control, r, prefix)
        skip = re.compile(LINE.format(level="INFO", event="lock.skipped_duplicate") + rf".*lock_key=res:{key} ", re.M)
        wait_for(lambda: skip.search(worker.output()), 30, interval=0.1, what="the skip line in the worker log")
        out = worker.output()
    assert "lock.renewed" not in out and "lock.acquired" not in out and "lock.released" not in out, out[-3000:]
    assert "[debug" not in out and "[info" not in out, out[-3000:]  # no structlog PrintLogger lines
    redirected = [ln for ln in out.splitlines() if re.search(r"WARNING/[^\]]*\] .*lock\.", ln)]
    assert redirected == []


def test_a_worker_at_debug_logs_acquired_and_renewed_as_debug_lines(
    redis_url: str, prefix: str, r: redis.Redis, tmp_path: Path
) -> None:
    cfg = make_cfg(prefix, redis_url)
    control = create_app(cfg)
    worker = Worker(control, cfg, log_dir=tmp_path)
    worker.loglevel = "DEBUG"
    with worker:
        key = run_renewal_and_duplicate(control, r, prefix)
        wanted = [
            re.compile(
                LINE.format(level="DEBUG", event="lock.acquired") + rf"task_name=short_ttl lock_key=res:{key} ", re.M
            ),
            re.compile(LINE.format(level="DEBUG", event="lock.renewed") + r"leases=\d+ ", re.M),
            re.compile(
                LINE.format(level="DEBUG", event="lock.released") + rf"task_name=short_ttl lock_key=res:{key} ", re.M
            ),
            re.compile(LINE.format(level="INFO", event="lock.skipped_duplicate") + rf".*lock_key=res:{key} ", re.M),
        ]
        wait_for(
            lambda: all(p.search(worker.output()) for p in wanted),
            30,
            interval=0.1,
            what="acquired/renewed/released lines",
        )
