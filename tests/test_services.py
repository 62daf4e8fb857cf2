"""``make test`` on a fresh machine runs every tier: the services on their usual ports, else embedded ones.

The PostgreSQL tests skipped silently unless ``LOCKGUARD_TEST_POSTGRES_URL`` was set, and the skips showed
only in the summary at the end. Here a real pytest run with no ``LOCKGUARD_TEST_*`` variable and local
services ignored (``LOCKGUARD_TEST_EMBEDDED``, what a machine without them gets) starts its own
PostgreSQL from the machine's binaries, says so in its header, and runs the PostgreSQL tests against it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from . import services
from .conftest import make_cfg

#: Each test runs the suite's own pytest (with xdist) in a subprocess, and some start workers or servers:
#: integration tests, which the compatibility cells (no xdist there) leave out.
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_TEST_", "LOCKGUARD_REQUIRE"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "--durations=0", *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.timeout(600)
def test_without_services_the_run_starts_its_own_postgres_and_says_so() -> None:
    if services.postgres_binaries() is None:
        pytest.skip("not installed: initdb/pg_ctl (the machine's PostgreSQL binaries)")
    run = _pytest("tests/test_fencing.py", "-k", "postgres", LOCKGUARD_TEST_EMBEDDED="redis,postgres")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    header = out[: out.index("collected")]
    assert re.search(r"postgres +postgresql://postgres@127\.0\.0\.1:\d+/test <- embedded: \S+/initdb", header), header
    assert "redis     <- embedded" in header, header
    assert re.search(r"^  (browser|promtool) ", header, re.M), header
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
    # the embedded cluster was stopped and removed with the run
    dirs = re.findall(r"in (/\S+lockguard-pg-\S+)", header)
    assert dirs and not Path(dirs[0]).exists(), dirs


def _processes_naming(word: str) -> list[str]:
    """Command lines holding ``word``. A node's name is not on its command line; its directory is (-home)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if word in args:
            found.append(args[:200])
    return found


@pytest.mark.timeout(600)
def test_without_rabbitmq_on_5672_the_run_starts_a_private_node_and_stops_it() -> None:
    """The machine's RabbitMQ (if any) stays untouched: the private node has its own ports, name and epmd."""
    if services.rabbitmq_server() is None:
        pytest.skip("not installed: rabbitmq-server")
    machine_node_before = services._port_open(5672)
    epmds_before = len(_processes_naming("epmd"))
    run = _pytest(
        "tests/test_queue_modes.py::test_warm_shutdown_finishes_and_releases", LOCKGUARD_TEST_EMBEDDED="redis,rabbitmq"
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    header = out[: out.index("collected")]
    found = re.search(
        r"rabbitmq +amqp://guest:\*\*\*@127\.0\.0\.1:(\d+)// <- embedded: \S+rabbitmq-server as (\S+) in (\S+)", header
    )
    assert found, header
    port, node, node_dir = int(found[1]), found[2], Path(found[3])
    assert port != 5672 and node.startswith("lockguard-test-"), header
    summary = out.strip().splitlines()[-1]
    assert re.search(r"2 passed", summary) and "skipped" not in summary, summary  # [redis] and [amqp]
    # stopped with the run: no process of that node (nor its epmd), its directory gone, its port free
    assert not _processes_naming(str(node_dir)), _processes_naming(str(node_dir))
    assert not node_dir.exists() and not services._port_open(port)
    assert len(_processes_naming("epmd")) <= epmds_before  # its private epmd was stopped too
    assert services._port_open(5672) == machine_node_before


@pytest.mark.timeout(600)
def test_a_killed_run_does_not_leave_its_rabbitmq_node_running() -> None:
    """SIGKILL (or a SIGTERM from a timeout) skips pytest's cleanup; the node's watchdog stops it instead."""
    if services.rabbitmq_server() is None:
        pytest.skip("not installed: rabbitmq-server")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_TEST_", "LOCKGUARD_REQUIRE"))}
    env = {**base, "LOCKGUARD_TEST_EMBEDDED": "redis,rabbitmq", "LOCKGUARD_WAIT_TO_BE_KILLED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-s", "--timeout=0"]
    cmd.append("tests/test_services.py::test_waits_to_be_killed_on_purpose")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    header = ""
    try:
        for line in proc.stdout:  # up to the test's own line: the node is up and the test is running
            header += line
            if "waiting to be killed" in line:
                break
        found = re.search(r"rabbitmq .* as (\S+)@localhost in (\S+)", header)
        assert found, header
        node_dir = Path(found[2])
        assert [p for p in _processes_naming(str(node_dir)) if "beam" in p], header  # running when pytest dies
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 90
    while (_processes_naming(str(node_dir)) or node_dir.exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_naming(str(node_dir)) and not node_dir.exists(), _processes_naming(str(node_dir))


@pytest.mark.timeout(600)
def test_a_killed_run_does_not_leave_its_embedded_postgresql_running() -> None:
    """Issue 31: an embedded PostgreSQL (``pg_ctl start`` detaches the postmaster) outlived a run killed by SIGKILL
    or a timeout's SIGTERM, which skip pytest's cleanup; its watchdog stops the cluster and removes its directory."""
    bindir = services.postgres_binaries()
    if bindir is None:
        pytest.skip("not installed: initdb/pg_ctl")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKGUARD_TEST_", "LOCKGUARD_REQUIRE"))}
    env = {**base, "LOCKGUARD_TEST_EMBEDDED": "redis,postgres", "LOCKGUARD_WAIT_TO_BE_KILLED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-s", "--timeout=0"]
    cmd.append("tests/test_services.py::test_waits_to_be_killed_on_purpose")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    header, pg_dir = "", None
    try:
        for line in proc.stdout:  # up to the test's own line: the cluster is up and the test is running
            header += line
            if "waiting to be killed" in line:
                break
        found = re.search(r"postgres .*<- embedded: \S+/initdb in (\S+)", header)
        assert found, header
        pg_dir = Path(found[1])
        assert [p for p in _processes_naming(str(pg_dir)) if "postgres" in p], header  # running when pytest dies
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 90
        while (_processes_naming(str(pg_dir)) or pg_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _processes_naming(str(pg_dir)) and not pg_dir.exists(), _processes_naming(str(pg_dir))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if pg_dir is not None and (pg_dir / "data").exists():  # the test failed: leave nothing running anyway
            pg = services.EmbeddedPostgres(bindir)
            pg.dir.rmdir()
            pg.dir = pg_dir
            pg.stop()


def test_waits_to_be_killed_on_purpose() -> None:
    if not os.environ.get("LOCKGUARD_WAIT_TO_BE_KILLED"):
        return  # only the run above waits here
    print("waiting to be killed", flush=True)
    threading.Event().wait()


def test_a_skip_for_something_missing_is_reported_when_it_happens(tmp_path: Path) -> None:
    """Not only in the summary at the end: the line comes before the next test's result."""
    run = _pytest("tests/test_services.py::test_skips_for_a_missing_service_on_purpose", LOCKGUARD_SKIP_ON_PURPOSE="1")
    out = run.stdout
    line = "SKIPPED (missing on this machine) tests/test_services.py::test_skips_for_a_missing_service_on_purpose"
    assert line in out, out
    assert out.index(line) < out.index("short test summary info"), out


def test_skips_for_a_missing_service_on_purpose() -> None:
    if not os.environ.get("LOCKGUARD_SKIP_ON_PURPOSE"):
        return  # only the run above makes it skip
    pytest.skip("missing service: on purpose, for test_a_skip_for_something_missing_is_reported_when_it_happens")


def test_a_worker_test_leaves_no_key_behind_whatever_order_it_names_its_fixtures() -> None:
    """A test that names ``fleet`` before ``prefix`` had its prefix deleted before its workers stopped, and each
    worker's shutdown flush then wrote ``<prefix>:v1:metrics:{fleet}:*`` keys that nothing deleted: hundreds on
    the shared Redis after a run, and ``lockguard doctor`` on the README's app there reported ``cache_traffic``.
    Run against a Redis of its own, so any key left is this run's."""
    from celery_lockguard.testing import RedisServer

    with RedisServer() as own:
        run = _pytest(
            "tests/test_services.py::test_a_worker_test_on_purpose",
            LOCKGUARD_TEST_REDIS_URL=own.url,
            LOCKGUARD_TEST_EMBEDDED="redis",
            LOCKGUARD_WORKER_ON_PURPOSE="1",
        )
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]
        left = sorted(str(k) for k in own.client().scan_iter(count=1000))
        assert left == [], left


def test_a_worker_test_on_purpose(fleet: Any, prefix: str, redis_url: str) -> None:
    """``fleet`` first on purpose (set up before ``prefix``, so torn down after it, before the fix)."""
    if not os.environ.get("LOCKGUARD_WORKER_ON_PURPOSE"):
        return  # only the run above starts a worker here
    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg)
    res = fleet.app(cfg).tasks["charge"].delay(7, 100, 0.1)
    assert res.get(timeout=60) is not None
