"""``lockguard exporter`` against clients that hold it: idle sockets, a trickle, no descriptors left.

Real sockets against a real ``celery ... lockguard exporter`` subprocess. The
review reproduced: 200 idle connections held 200 threads; under a
64-descriptor limit the serving loop spun on ``accept`` (EMFILE) at full CPU
and scrapes timed out.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_lockguard import _metrics as metrics
from celery_lockguard.testing import free_port, process_cpu

from .conftest import make_cfg
from .harness import ROOT, wait_for
from .test_cli import cli_env

pytestmark = pytest.mark.integration


class Exporter:
    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc, self.port = proc, port

    def scrape(self, timeout: float = 5) -> int | None:
        """The status of one scrape of /metrics, or None when it got no HTTP answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            assert self.proc.poll() is None, "the exporter exited"
            return None

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    def cpu_seconds(self) -> float:
        return process_cpu(self.proc.pid)


def start(redis_url: str, prefix: str, *args: str, nofile: int | None = None) -> Exporter:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    metrics.count("exp.task", "lock.acquired", 1)
    metrics.flush(r, prefix)
    port = free_port()

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.workerapp:app",
            "lockguard",
            "exporter",
            "--port",
            str(port),
            *args,
        ],
        cwd=ROOT,
        env=cli_env(make_cfg(prefix, redis_url)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )
    exporter = Exporter(proc, port)
    wait_for(lambda: exporter.scrape() == 200, 30, interval=0.2, what="the exporter to answer")
    return exporter


@pytest.fixture
def stop() -> Iterator[list[Any]]:
    held: list[Any] = []
    yield held
    for item in held:
        if isinstance(item, Exporter):
            item.proc.terminate()
            item.proc.communicate(timeout=10)
        else:
            item.close()


def idle_sockets(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        out.append(s)
    return out


def test_idle_connections_are_capped_and_timed_out(redis_url: str, prefix: str, stop: list[Any]) -> None:
    exporter = start(redis_url, prefix, "--timeout", "2", "--max-connections", "16")
    stop.append(exporter)
    base = exporter.threads()
    socks = idle_sockets(exporter.port, 200)
    stop.extend(socks)
    time.sleep(1.0)
    assert exporter.threads() <= base + 16, "one thread per idle connection, past the cap"
    # Connections past the cap are answered 503 at once, without a thread; once the idle ones time out,
    # scrapes are served again, with the 200 sockets still open on the client's side.
    t0 = time.monotonic()
    wait_for(lambda: exporter.scrape() == 200, 15, interval=0.2, what="a scrape to be served")
    assert time.monotonic() - t0 < 10
    answered = socks[-1].recv(200)
    assert answered.startswith(b"HTTP/1.0 503") or answered == b""


def test_a_trickling_client_is_cut_off_at_the_deadline(redis_url: str, prefix: str, stop: list[Any]) -> None:
    exporter = start(redis_url, prefix, "--timeout", "1")
    stop.append(exporter)
    sock = socket.create_connection(("127.0.0.1", exporter.port), timeout=5)
    stop.append(sock)
    t0 = time.monotonic()
    closed = False
    while not closed and time.monotonic() - t0 < 12:
        try:
            sock.send(b"G")  # one byte every 0.5 s: each read well within the 1 s timeout
            sock.settimeout(0.5)
            sock.recv(100)  # b"" or a 400: either way the server gave up on this client
            closed = True
        except TimeoutError:
            pass
        except OSError:
            closed = True
    elapsed = time.monotonic() - t0
    assert closed and elapsed < 8, f"still connected after {elapsed:.1f}s (deadline 4 x 1 s)"


def test_out_of_descriptors_the_exporter_backs_off_and_recovers(redis_url: str, prefix: str, stop: list[Any]) -> None:
    exporter = start(redis_url, prefix, "--timeout", "60", "--max-connections", "1000", nofile=64)
    stop.append(exporter)
    socks = idle_sockets(exporter.port, 100)  # more than 64 descriptors: accept fails with EMFILE
    time.sleep(1.5)
    cpu0, t0 = exporter.cpu_seconds(), time.monotonic()
    time.sleep(3.0)
    share = (exporter.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    assert share < 0.2, f"the exporter burned {share:.0%} of a CPU while out of descriptors"
    for s in socks:
        s.close()
    wait_for(lambda: exporter.scrape() == 200, 20, interval=0.3, what="scrapes served again")
    exporter.proc.terminate()
    _, err = exporter.proc.communicate(timeout=10)
    stop.remove(exporter)
    assert "exporter.accept_failed" in err and "EMFILE" in err
    assert "Traceback" not in err


def _exporter_command(redis_url: str, prefix: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "lockguard", "exporter", *args],
        cwd=ROOT,
        env=cli_env(make_cfg(prefix, redis_url)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_port_in_use_is_a_clear_error_not_a_traceback(redis_url: str, prefix: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        proc = _exporter_command(redis_url, prefix, "--port", str(taken.getsockname()[1]), "--page")
        out, err = proc.communicate(timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 69, (out, err)  # EX_UNAVAILABLE
    assert "cannot listen on 127.0.0.1 port" in err and "Traceback" not in err


def test_an_ipv6_loopback_bind_serves_metrics(redis_url: str, prefix: str) -> None:
    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    finally:
        probe.close()
    port = free_port()
    proc = _exporter_command(redis_url, prefix, "--bind", "::1", "--port", str(port))
    try:

        def scrape() -> int | None:
            try:
                with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as resp:
                    return int(resp.status)
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, f"the exporter exited: {proc.communicate()[1][-2000:]}"
                return None

        assert wait_for(scrape, 30, interval=0.2, what="the exporter on [::1]") == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert f"http://[::1]:{port}/metrics" in out and "Traceback" not in err
