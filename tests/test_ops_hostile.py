"""Operator surfaces against hostile clients and data (issue 30): secrets, planted metrics, test cleanup,
exposure of the exporter, and idle connections.

Everything here runs the real ``celery ... lockguard`` command or a real
exporter process against the real Redis (and PostgreSQL), and talks to it
over real sockets.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis

from celery_lockguard import _metrics as metrics
from celery_lockguard._keys import lock_name
from celery_lockguard.testing import free_port

from .conftest import make_cfg
from .harness import ROOT, wait_for
from .test_cli import cli, cli_env
from .test_page import LOCKGUARD, start_page

pytestmark = pytest.mark.integration

# -- 2. secrets -------------------------------------------------------------------------------

SSL_PW = "Sslpw7f3q"  # redis-py ssl_password=
ENC_PW = "Encpw9a1q"  # pass%77ord= : redis-py decodes the key to "password"
USER_PW = "Userpw4c2q"  # userinfo
LIBPQ_PW = "Libpqb6dq"  # libpq sslpassword=
HALF_PW = "Halfpwe85q"  # the second half of an unquoted libpq password with a space in it
SECRETS = (SSL_PW, ENC_PW, USER_PW, LIBPQ_PW, HALF_PW)


def _with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


def assert_no_secret(out: subprocess.CompletedProcess[str], what: str) -> None:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, f"{what}:\n{text}"
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"{what} printed {leaked}:\n{text}"


COMMANDS = [
    ("locks",),
    ("locks", "--json"),
    ("stats",),
    ("stats", "--json"),
    ("stats", "--prometheus"),
    ("doctor",),
    ("doctor", "--json"),
    ("describe",),
    ("describe", "--json"),
    ("completions", "show", "s"),
    ("completions", "forget", "s", "--yes"),
]


def test_an_unreachable_lock_redis_is_named_without_any_secret(prefix: str) -> None:
    dead = free_port()
    url = f"rediss://:{USER_PW}@127.0.0.1:{dead}/0?ssl_password={SSL_PW}&pass%77ord={ENC_PW}"
    cfg = make_cfg(prefix, "redis://127.0.0.1:6379/0", lock_url=url)
    for args in COMMANDS:
        out = cli(cfg, *args)
        assert_no_secret(out, " ".join(args))
        if args[0] != "describe":
            assert out.returncode == 69, (args, out.stdout, out.stderr)
            assert f"rediss://:***@127.0.0.1:{dead}/0?ssl_password=***&password=***" in out.stdout + out.stderr


def test_a_reachable_lock_redis_with_secret_options_is_shown_masked(redis_url: str, prefix: str) -> None:
    cfg = make_cfg(prefix, redis_url, lock_url=_with_query(redis_url, f"pass%77ord={ENC_PW}"))
    for args in COMMANDS:
        out = cli(cfg, *args)
        assert_no_secret(out, " ".join(args))
    assert "password=***" in cli(cfg, "describe").stdout


def test_a_completion_database_is_named_without_its_secrets(redis_url: str, prefix: str) -> None:
    dsn = f"postgresql://postgres:{USER_PW}@127.0.0.1:{free_port()}/test?sslpassword={LIBPQ_PW}&sslmode=disable"
    cfg = make_cfg(prefix, redis_url, completion_backend=dsn)
    for args in (("completions", "show", "s"), ("completions", "forget", "s", "--yes"), ("doctor",)):
        out = cli(cfg, *args)
        assert_no_secret(out, " ".join(args))
    assert "sslpassword=***" in cli(cfg, "completions", "show", "s").stderr


@pytest.mark.parametrize(
    "dsn",
    [
        # Port 9 (discard): nothing listens there. The ids must be the same in every xdist worker.
        f"host=127.0.0.1 port=9 dbname=test user=postgres sslpassword={LIBPQ_PW}",
        f"host=127.0.0.1 dbname=test user=postgres password=abc {HALF_PW}",  # libpq: missing "=" after "Half..."
    ],
    ids=["sslpassword", "password-with-space"],
)
def test_a_libpq_keyword_dsn_is_never_printed_unparsed(redis_url: str, prefix: str, dsn: str) -> None:
    cfg = make_cfg(prefix, redis_url)
    redis.Redis.from_url(redis_url).hset(lock_name(prefix, "k"), mapping={"task_id": "t", "fence": "1"})
    out = cli(cfg, "release", "k", "--yes", "--fence-dsn", dsn)
    assert_no_secret(out, "release --fence-dsn")
    assert "fence database" in out.stdout + out.stderr
    bad = cli(make_cfg(prefix, redis_url, completion_backend=dsn), "locks")
    assert_no_secret(bad, "a keyword DSN as the completion backend")
    assert bad.returncode == 78 and "lockguard_completion_backend" in bad.stderr


def test_the_page_header_and_its_data_show_no_secret(redis_url: str, prefix: str) -> None:
    page = start_page(make_cfg(prefix, redis_url, lock_url=_with_query(redis_url, f"pass%77ord={ENC_PW}")))
    try:
        for path in ("/page", "/page/live", "/page/data.json", "/metrics"):
            code, _, body = page.get(path)
            text = body.decode()
            assert code == 200 and not [s for s in SECRETS if s in text], (path, text[:3000])
        assert "password=***" in page.get("/page")[2].decode()
    finally:
        page.proc.terminate()
        _, err = page.proc.communicate(timeout=15)
    assert not [s for s in SECRETS if s in err], err


# -- 3. metrics keys of the wrong type ---------------------------------------------------------


@pytest.mark.parametrize("where", ["total", "procs", "minute"])
def test_every_metrics_reader_survives_a_metrics_key_of_the_wrong_type(
    r: redis.Redis, redis_url: str, prefix: str, where: str
) -> None:
    metrics.count("good.task", "lock.acquired", 3)
    metrics.flush(r, prefix)
    planted = {
        "total": metrics.total_key(prefix),
        "procs": metrics.procs_key(prefix),
        "minute": metrics.minute_key(prefix, int(time.time() // 60)),
    }[where]
    r.delete(planted)
    if where == "minute":
        r.rpush(planted, "a list where a hash belongs")
    else:
        r.set(planted, "a string where a hash or a sorted set belongs")
    cfg = make_cfg(prefix, redis_url)
    for args in (("stats",), ("stats", "--json"), ("stats", "--prometheus")):
        out = cli(cfg, *args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stdout, out.stderr)
        if not (where == "minute" and "--prometheus" in args):  # Prometheus reads the totals only
            assert "is of a type no worker writes, skipped" in out.stderr, (args, out.stderr)
        assert ("good.task" in out.stdout) == (where != "total"), (args, out.stdout)
    summary = json.loads(cli(cfg, "stats", "--json").stdout)
    assert summary["unreadable"] == [planted]
    doctor = cli(cfg, "doctor", "--json")
    assert doctor.returncode in (0, 1) and "Traceback" not in doctor.stderr, doctor.stderr
    json.loads(doctor.stdout)
    page = start_page(cfg)
    try:
        code, _, body = page.get("/metrics")
        assert code == 200 and ('task="good.task"' in body.decode()) == (where != "total"), body.decode()
        data = page.data()
        assert data is not None and data["errors"] == {}, data
        assert page.get("/page")[0] == 200
    finally:
        page.proc.terminate()
        _, err = page.proc.communicate(timeout=15)
    assert "Traceback" not in err, err


# -- 5. testing.delete_prefix ------------------------------------------------------------------


@pytest.mark.parametrize("decode", [False, True])
def test_delete_prefix_deletes_only_keys_under_that_exact_prefix(redis_url: str, prefix: str, decode: bool) -> None:
    from celery_lockguard.testing import delete_prefix

    client = redis.Redis.from_url(redis_url, decode_responses=decode)
    names = ["billing:a", "billing:{x}:lock", "billing-prod:a", "billingX", "tenant-a:a", "tenant-b:a"]
    names += ["tenant-[ab]:a", "star*:a", "starry:a", "q?:a", "qq:a"]
    for name in names:
        client.set(f"{prefix}:{name}", "1")
    assert delete_prefix(client, f"{prefix}:billing") == 2
    assert delete_prefix(client, f"{prefix}:tenant-[ab]") == 1
    assert delete_prefix(client, f"{prefix}:star*") == 1
    assert delete_prefix(client, f"{prefix}:q?") == 1
    left = sorted(k if isinstance(k, str) else k.decode() for k in client.scan_iter(match=f"{prefix}:*", count=1000))
    assert left == sorted(
        f"{prefix}:{n}" for n in ("billing-prod:a", "billingX", "tenant-a:a", "tenant-b:a", "starry:a", "qq:a")
    )
    with pytest.raises(ValueError):
        delete_prefix(client, "")


# -- 6. the page on a non-loopback address -----------------------------------------------------


def _serves(port: int, proc: subprocess.Popen[str]) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return int(resp.status) in (200, 401)
    except urllib.error.HTTPError as err:
        return err.code == 401
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        assert proc.poll() is None, "the exporter exited"
        return False


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_the_page_on_a_non_loopback_bind_needs_auth_or_insecure(redis_url: str, prefix: str, bind: str) -> None:
    env = cli_env(make_cfg(prefix, redis_url))
    env.pop("LOCKGUARD_PAGE_AUTH", None)
    port = free_port()
    base = [*LOCKGUARD, "exporter", "--page", "--bind", bind, "--port", str(port)]
    refused = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 64, (refused.stdout, refused.stderr)
    assert "without --auth" in refused.stderr and "--insecure" in refused.stderr and "Traceback" not in refused.stderr
    for extra, auth_env in ((["--insecure"], {}), ([], {"LOCKGUARD_PAGE_AUTH": "ops:Pagepw3x"})):
        proc = subprocess.Popen(
            [*base, *extra],
            cwd=ROOT,
            env={**env, **auth_env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda proc=proc: _serves(port, proc), 30, interval=0.2, what="the exporter to answer")
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=15)
        assert ("no authentication" in err) == bool(extra), err
    # Loopback needs neither; /metrics alone on any address is unchanged.
    for args in (["--page", "--bind", "127.0.0.1"], ["--bind", bind]):
        proc = subprocess.Popen(
            [*LOCKGUARD, "exporter", "--port", str(port), *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        try:
            wait_for(lambda proc=proc: _serves(port, proc), 30, interval=0.2, what="the exporter to answer")
        finally:
            proc.terminate()
            proc.communicate(timeout=15)


# -- 1. idle and slow connections --------------------------------------------------------------


class Squatters:
    """``n`` connections from another loopback address (127.0.0.2) that never finish a request: half send
    nothing, half a request head without its end. A background thread reopens any the server closes."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.socks: list[socket.socket] = []
        self.opened = 0
        self._stop = threading.Event()
        for i in range(n):
            self.socks.append(self._open(i))
        self._thread = threading.Thread(target=self._keep, daemon=True)
        self._thread.start()

    def _open(self, i: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(5)
        sock.connect(("127.0.0.1", self.port))
        if i % 2:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and never the blank line
        sock.setblocking(False)
        self.opened += 1
        return sock

    def _keep(self) -> None:
        while not self._stop.wait(0.05):
            for i, sock in enumerate(self.socks):
                try:
                    if sock.recv(4096) == b"":
                        raise ConnectionError
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sock.close()
                try:
                    self.socks[i] = self._open(i)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self.socks:
            sock.close()


def test_200_idle_connections_from_another_address_leave_scrapes_and_the_page_answered(
    redis_url: str, prefix: str
) -> None:
    page = start_page(make_cfg(prefix, redis_url))  # the defaults: --max-connections 32, --timeout 10
    squatters = Squatters(page.port, 200)
    try:
        time.sleep(0.5)  # every squatter connected and waiting (not a synchronisation: they never send more)
        for _ in range(5):
            for path in ("/metrics", "/page", "/page/data.json"):
                t0 = time.monotonic()
                code, _, body = page.get(path, timeout=5)
                took = time.monotonic() - t0
                assert code == 200 and body, (path, code, body[:200])
                assert took < 1.0, f"{path} took {took:.2f}s with 200 idle connections open"
            time.sleep(0.3)
        assert page.proc.poll() is None
    finally:
        squatters.close()
        page.proc.terminate()
        _, err = page.proc.communicate(timeout=15)
    assert "Traceback" not in err, err


# -- 4. series cap and labels that reach alert text ----------------------------------------------


def test_metrics_are_capped_per_family_and_labels_cannot_mark_up_an_alert(
    r: redis.Redis, redis_url: str, prefix: str
) -> None:
    from celery_lockguard._stats import MAX_EVENT_SERIES, MAX_TASK_SERIES

    n_tasks = 20_000
    total = metrics.total_key(prefix)
    fields = {f"planted.{i}|lock.acquired": "1" for i in range(n_tasks)}
    fields.update({f"busy.task|planted.event.{i}": "1" for i in range(1000)})
    fields["<!channel> billing|lock.acquired"] = "1000000"  # the most active: never folded
    fields["busy.task|lock.acquired"] = "999999"
    fields[("y" * 10_000) + "|lock.acquired"] = "5"
    r.hset(total, mapping=fields)
    now = time.time()
    rows = ",".join(
        f'{{"task":"held.{i}","worker":"w{i}@h","held":1,"oldest_acquired_at":{now - 5:.3f}}}' for i in range(2000)
    )
    r.set(metrics.proc_key(prefix, "p-many"), f'{{"at":{now:.3f},"ttl":600,"held":[{rows}]}}', ex=600)
    r.zadd(metrics.procs_key(prefix), {"p-many": now})
    exporter = start_page(make_cfg(prefix, redis_url), page=False)
    try:
        code, _, raw_body = exporter.get("/metrics")
    finally:
        exporter.proc.terminate()
        exporter.proc.communicate(timeout=15)
    body = raw_body.decode()
    assert code == 200
    assert len(raw_body) < 1_000_000, f"{len(raw_body)} bytes per scrape"
    series = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert len(series) == len({line.rsplit(" ", 1)[0] for line in series}), "a series written twice"
    assert max(len(line) for line in series) < 1000

    def values(family: str, label: str) -> set[str]:
        pattern = re.compile(rf'^{family}\{{.*?{label}="((?:[^"\\]|\\.)*)"')
        return {m.group(1) for line in series if (m := pattern.match(line))}

    tasks = values("lockguard_events_total", "task")
    assert len(tasks) <= MAX_TASK_SERIES and "(other)" in tasks
    assert len(values("lockguard_events_total", "event")) <= MAX_EVENT_SERIES
    assert len(values("lockguard_leases_held", "worker")) <= MAX_TASK_SERIES
    folded = {m.group(1): int(m.group(2)) for m in re.finditer(r'lockguard_folded_labels\{label="(\w+)"\} (\d+)', body)}
    distinct = n_tasks + 3  # planted.*, the markup, busy.task, the long one
    assert folded["task"] == distinct - (MAX_TASK_SERIES - 1) and folded["task_worker"] == 2000 - (MAX_TASK_SERIES - 1)
    assert folded["event"] > 0
    # The markup is written as text: nothing an alert template (Slack, HTML) would interpret.
    assert "<" not in body and ">" not in body and "&" not in body
    assert 'task="\\\\x3c!channel\\\\x3e billing",event="lock.acquired"} 1000000' in body
    assert 'lockguard_events_total{task="busy.task",event="lock.acquired"} 999999' in body


# -- operators: locks shows what waits -----------------------------------------------------------


def test_locks_shows_the_deliveries_waiting_behind_each_lease(r: redis.Redis, redis_url: str, prefix: str) -> None:
    from celery_lockguard import _lease as L
    from celery_lockguard._keys import wait_name

    for key in ("calm", "hot"):
        L.acquire(
            r,
            prefix,
            key,
            ttl_ms=60_000,
            task_id=f"t-{key}",
            task_name="n",
            digest="d",
            worker="w",
            fence_ttl_ms=60_000,
        )
    r.rpush(wait_name(prefix, "hot"), "park-1", "park-2", "park-3")  # as park-and-wake parks deliveries
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "locks")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[-1] == "WAITING"
    by_key = {row.split()[0]: row.split()[-1] for row in rows}
    assert by_key == {"hot": "3", "calm": "-"}, out.stdout
    listed = {row["key"]: row["waiting"] for row in json.loads(cli(cfg, "locks", "--json").stdout)}
    assert listed == {"hot": 3, "calm": 0}


def test_the_page_shows_slots_held_and_the_start_window_as_locks_does(
    r: redis.Redis, redis_url: str, prefix: str
) -> None:
    from celery_lockguard import _lease as L

    for task_id in ("t-1", "t-2"):
        got = L.acquire(
            r, prefix, "tenant:a", ttl_ms=60_000, task_id=task_id, task_name="exports.run", digest=task_id,
            worker="w@h", fence_ttl_ms=60_000, limit=3, rate=(10, 60_000),
        )  # fmt: skip
        assert isinstance(got, L.Lease)
    page = start_page(make_cfg(prefix, redis_url))
    try:
        shown = "tenant:a: 2/3 slots held, 2/10 starts in the last 60s"
        code, _, body = page.get("/page")
        assert code == 200 and f"<li>{shown}</li>" in body.decode(), body.decode()[:3000]
        data = page.data()
        assert data is not None
        assert data["entity_use"] == [
            {"key": "tenant:a", "held": 2, "limit": 3, "rate": 10, "window_ms": 60_000, "starts": 2}
        ]
    finally:
        page.proc.terminate()
        _, err = page.proc.communicate(timeout=15)
    assert "Traceback" not in err, err


def test_slow_readers_from_one_address_hold_at_most_a_quarter_of_the_slots(
    r: redis.Redis, redis_url: str, prefix: str
) -> None:
    from celery_lockguard._metrics import HISTOGRAMS, bucket_names

    fields: dict[str, str] = {}
    for i in range(499):  # a big scrape (MBs): a client that never reads it keeps its handler writing
        for family in HISTOGRAMS:
            fields[f"task.{i}|{family}.count"] = "1"
            fields[f"task.{i}|{family}.sum_ms"] = "5"
            for le in bucket_names(family):
                fields[f"task.{i}|{family}.le.{le}"] = "1"
    r.hset(metrics.total_key(prefix), mapping=fields)
    page = start_page(make_cfg(prefix, redis_url), "--max-connections", "8", "--timeout", "10", page=False)
    readers: list[socket.socket] = []
    try:
        assert len(page.get("/metrics")[2]) > 900_000
        for _ in range(8):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", page.port))
            sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")  # ... and never read
            readers.append(sock)
        time.sleep(1.0)  # their handlers are writing into full buffers (not a synchronisation: they stay stuck)
        t0 = time.monotonic()
        code, _, _ = page.get("/metrics", timeout=5)
        assert code == 200 and time.monotonic() - t0 < 2.0, code
    finally:
        for sock in readers:
            sock.close()
        page.proc.terminate()
        page.proc.communicate(timeout=15)
