"""Fixtures: real Redis (shared or embedded), private servers, real workers, PostgreSQL.

The Redis servers come from this package's own pytest plugin
(``celery_lockguard.pytest_plugin``: ``lockguard_redis``, ``lockguard_redis_server``),
the way a user's suite gets them. It is named in ``pytest_plugins`` as well as
found through the ``pytest11`` entry point: ``make compat`` runs the suite from
the work tree on ``PYTHONPATH``, where no entry point exists. Both name the
plugin by its module, so pytest registers it once.

Isolation is by key prefix (every key a test makes, Celery's included, lives
under its prefix), never by FLUSHALL on a shared server.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog

from celery_lockguard import _metrics as metrics
from celery_lockguard.testing import RedisServer, delete_prefix, env_flag

from . import services
from .harness import Beat, Worker
from .workerapp import create_app

pytest_plugins = ["celery_lockguard.pytest_plugin"]

REQUIRE = env_flag("LOCKGUARD_REQUIRE_SERVICES")


def amqp_url() -> str:
    """Read when a test asks, not at import: tests/services.py may start a private node after this module loads."""
    return os.environ.get("LOCKGUARD_TEST_AMQP_URL", services.LOCAL_AMQP)


#: Modules that run whole in one pytest-xdist worker under ``make unit`` (``-n N --dist loadgroup``): their
#: tests share a module fixture that is expensive (a private Cluster, a fleet per pool, a migrated Django
#: project and its worker) or must not be set up twice at once (test_package builds in the work tree, and two
#: concurrent ``python -m build`` runs there remove each other's sdist tree). Each is also marked
#: ``xdist_group`` in the module; the collection check below keeps the two lists the same.
XDIST_WHOLE_MODULES = frozenset(
    {"tests/test_cluster.py", "tests/test_django.py", "tests/test_package.py", "tests/test_pools.py"}
)


#: What services.choose_all decided (controller only: xdist workers inherit it as LOCKGUARD_TEST_* variables).
_SERVICES: list[services.Choice] = []
#: A skip for something the machine lacks (a service, a binary, a package), reported the moment it happens.
_MISSING = re.compile(r"not (installed|reachable|set|on PATH)|could not import|missing service", re.I)


def pytest_configure(config: pytest.Config) -> None:
    """Pick each tier's service before anything runs (tests/services.py): env, local port, else embedded."""
    if hasattr(config, "workerinput"):
        return
    _SERVICES[:] = services.choose_all()
    config.add_cleanup(lambda: services.stop_all(_SERVICES))


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    return services.header_lines(_SERVICES) if _SERVICES else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Say at once, not in the summary twenty minutes later, that a test skipped for something missing."""
    if not report.skipped or report.when not in ("setup", "call"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not _MISSING.search(reason):
        return
    config = _CONFIG.get("config")
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    if reporter is not None and not hasattr(config, "workerinput"):
        reporter.ensure_newline()
        reporter.write_line(f"SKIPPED (missing on this machine) {report.nodeid}: {reason}", yellow=True, bold=True)


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` that groups by :data:`XDIST_WHOLE_MODULES` (every other test is its own unit).

    pytest-xdist 3.8 groups by renaming each marked item's ``_nodeid``, which pytest 9.2 no longer reads
    (its node ids come from ``_id``): the marks alone group nothing. The controller, which sees only node
    ids, groups by module path instead. Tests are still scheduled largest unit first.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in XDIST_WHOLE_MODULES else super()._split_scope(nodeid)

    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail the run if a module's ``xdist_group`` mark and :data:`XDIST_WHOLE_MODULES` disagree."""
    modules = {item.nodeid.split("::", 1)[0] for item in items}
    marked = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("xdist_group")}
    if marked != modules & XDIST_WHOLE_MODULES:
        raise pytest.UsageError(
            f"xdist_group marks ({sorted(marked)}) and conftest.XDIST_WHOLE_MODULES"
            f" ({sorted(modules & XDIST_WHOLE_MODULES)}) disagree"
        )


@pytest.fixture(scope="session")
def redis_url(lockguard_redis: str) -> str:
    """The shared test Redis: the plugin's ``lockguard_redis`` (``LOCKGUARD_TEST_REDIS_URL``, else embedded)."""
    if REQUIRE and not os.environ.get("LOCKGUARD_TEST_REDIS_URL"):
        pytest.fail("LOCKGUARD_REQUIRE_SERVICES=1 but LOCKGUARD_TEST_REDIS_URL is not set")
    redis.Redis.from_url(lockguard_redis).ping()
    return lockguard_redis


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """PostgreSQL as tests/services.py chose it at the start: the variable, local 5432, or an embedded one."""
    url = os.environ.get("LOCKGUARD_TEST_POSTGRES_URL")
    if not url:
        if REQUIRE:
            pytest.fail("LOCKGUARD_REQUIRE_SERVICES=1 but LOCKGUARD_TEST_POSTGRES_URL is not set")
        pytest.skip("missing service: PostgreSQL (the run's header says why: tests/services.py)")
    return url


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix owned by this test; its keys are deleted afterwards."""
    p = f"lgt:{uuid.uuid4().hex[:10]}"
    yield p
    client = redis.Redis.from_url(redis_url)
    delete_prefix(client, p)
    strays = stray_keys(client, p)
    if strays:
        client.delete(*strays)
        pytest.fail(f"keys named after the test's prefix {p!r} but outside it (not deleted by it): {strays[:5]}")


def stray_keys(client: redis.Redis, p: str) -> list[bytes]:
    """Keys that carry ``p`` but not as their ``p:`` prefix: a kombu queue or binding, a result written by an app
    without ``global_keyprefix`` (``lgt:x-q``, ``_kombu.binding.lgt:x-q``). The prefix's random part is unique to
    the test, so whatever carries it is this test's, and it would outlive the run on a shared server."""
    return [k for k in client.scan_iter(match=f"*{p}*", count=1000) if not k.startswith(p.encode() + b":")]


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def own_redis(lockguard_redis_server: RedisServer) -> RedisServer:
    """A private server this test may stop, restart or SCRIPT FLUSH (the plugin's ``lockguard_redis_server``)."""
    return lockguard_redis_server


@pytest.fixture(autouse=True)
def _clean_metrics() -> Iterator[None]:
    metrics.clear()
    yield


@pytest.fixture(autouse=True)
def _structlog_unconfigured() -> Iterator[None]:
    """Each test starts in a process that never configured structlog, so events go to stdlib logging.

    ``structlog.testing.capture_logs`` leaves structlog "configured" after it returns, and the
    ``auto`` log backend would then send every later test's events to structlog, past ``caplog``.
    """
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def make_cfg(prefix: str, redis_url: str, **over: Any) -> dict[str, Any]:
    cfg = {
        "broker": redis_url,
        "lock_url": redis_url,
        "record_url": redis_url,
        "queue": f"{prefix}-q",
        "prefix": prefix,
    }
    cfg.update(over)
    return cfg


class Fleet:
    """Apps, workers and beats of one test; everything stopped (and AMQP queues deleted) at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.workers: list[Worker] = []
        self.beats: list[Beat] = []
        self.amqp_queues: set[tuple[str, str]] = set()

    def beat(self, cfg: dict[str, Any]) -> Beat:
        b = Beat(cfg, self.tmp)
        self.beats.append(b)
        return b.start()

    def app(self, cfg: dict[str, Any]) -> Any:
        return create_app(cfg)

    def worker(self, cfg: dict[str, Any], concurrency: int = 2, start: bool = True) -> Worker:
        if cfg["broker"].startswith("amqp"):
            self.amqp_queues.add((cfg["broker"], cfg["queue"]))
        w = Worker(create_app(cfg), cfg, concurrency=concurrency, log_dir=self.tmp)
        self.workers.append(w)
        return w.start() if start else w

    def close(self) -> None:
        for b in self.beats:
            b.stop()
        for w in self.workers:
            w.stop()
        for url, queue in self.amqp_queues:
            from kombu import Connection

            with Connection(url) as conn:
                conn.default_channel.queue_delete(queue)


@pytest.fixture
def fleet(tmp_path: Path, prefix: str) -> Iterator[Fleet]:
    """Needs ``prefix`` so that it is set up after it and torn down before it: the workers stop (and flush
    their metrics under the prefix) before the prefix's keys are deleted, whatever order a test names them."""
    f = Fleet(tmp_path)
    yield f
    f.close()


def amqp_available() -> bool:
    from kombu import Connection

    try:
        with Connection(amqp_url(), connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


@pytest.fixture(params=["redis", "amqp"])
def broker_cfg(request: pytest.FixtureRequest, redis_url: str, prefix: str) -> dict[str, Any]:
    """Worker config on the Redis broker or on RabbitMQ (results and locks stay on Redis)."""
    if request.param == "redis":
        return make_cfg(prefix, redis_url)
    if not amqp_available():
        if REQUIRE:
            pytest.fail(f"LOCKGUARD_REQUIRE_SERVICES=1 but RabbitMQ is not reachable at {amqp_url()}")
        pytest.skip(f"missing service: RabbitMQ is not reachable at {amqp_url()} (the run's header says why)")
    return make_cfg(prefix, redis_url, broker=amqp_url(), backend=redis_url)


@pytest.fixture(scope="session")
def shared_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Two prefork workers (-c 2 each) on the shared Redis, reused by tests that need no special set-up."""
    p = f"lgt:{uuid.uuid4().hex[:10]}"
    cfg = make_cfg(p, redis_url)
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    f.worker(cfg)
    f.worker(cfg)
    yield f.app(cfg), cfg
    f.close()
    delete_prefix(redis.Redis.from_url(redis_url), p)
