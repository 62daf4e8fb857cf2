"""A fresh-context security review of the operator surfaces (issue 30): what it reproduced.

Each test runs the real exporter process or the real ``celery ... lockguard``
command against the real Redis (a private key prefix) and fails on the code
reviewed; its docstring says what was observed and what was expected.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time

import pytest
import redis

from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._keys import lock_name
from celery_lockguard.testing import free_port

from .conftest import make_cfg
from .test_cli import cli
from .test_page import start_page

pytestmark = pytest.mark.integration

#: A planted lease field this large (bytes) is what an attacker with write access to the lock Redis can store.
HUGE = 8 * 1024 * 1024
#: What one answer about one lease may reasonably weigh, whatever its fields hold.
BOUNDED = 1024 * 1024


def _hold(r: redis.Redis, prefix: str, key: str, **fields: str) -> None:
    got = L.acquire(
        r, prefix, key, ttl_ms=600_000, task_id=f"t-{key}", task_name="billing.charge", digest="d",
        worker="w@h", fence_ttl_ms=600_000,
    )  # fmt: skip
    assert isinstance(got, L.Lease)
    for field, value in fields.items():
        r.hset(lock_name(prefix, key), field, value)


def _hold_big_answer(r: redis.Redis, prefix: str) -> None:
    """500 leases, each with 32 siblings and fields past the 256-character cut (non-ASCII: six bytes each as JSON
    escapes): the biggest answer the page gives, megabytes, past any socket's send buffer."""
    siblings = json.dumps([f"s{i}:" + "y" * 300 for i in range(32)])
    wide = "\u00e9" * 300
    for n in range(500):
        _hold(r, prefix, f"big:{n}", siblings=siblings, task_name=wide, worker=wide, host=wide, task_id=wide)


def _stop(page: object) -> str:
    proc = page.proc  # type: ignore[attr-defined]
    proc.terminate()
    _, err = proc.communicate(timeout=15)
    return str(err)


def test_slow_readers_from_four_addresses_take_every_slot(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """Slow readers from four client addresses starve real scrapes (medium: monitoring DoS).

    Repro: an answer larger than the kernel's send buffer (4 MB here: ``/page/data.json`` over one lease
    with an 8 MB field, see the next test; since fields are cut, 500 leases with 32 siblings each), then 8
    connections from each of 127.0.0.2-127.0.0.5 that
    request it and never read. Observed: each address is held to its quarter of the 32 slots, but four
    addresses take all 32, and a fresh ``/metrics`` from 127.0.0.1 gets ``503 exporter at connection
    limit`` (for the 10 s handler timeout, and again each time they reconnect). With ``/metrics`` alone
    (series-capped at ~1 MB) the attack held: the send buffer absorbs the whole body. Expected (issue 30:
    slow clients must not starve real ones): a fresh scrape is answered, e.g. answers bounded under the
    send buffer, or a stalled writer evicted when the slots run out.
    """
    # Fields are cut at 256 characters now (the next tests), so a big answer takes the most the page shows:
    # 500 leases, each with 32 siblings and fields at the cut (non-ASCII: six bytes each as JSON escapes).
    _hold_big_answer(r, prefix)
    page = start_page(make_cfg(prefix, redis_url))  # defaults: 32 slots, a quarter per address
    readers: list[socket.socket] = []
    try:
        assert len(page.get("/page/data.json", timeout=60)[2]) > 5 * 1024 * 1024  # past any send buffer (4 MB)
        for peer in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"):
            for _ in range(8):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.bind((peer, 0))
                sock.connect(("127.0.0.1", page.port))
                sock.sendall(b"GET /page/data.json HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")  # ... and never read
                readers.append(sock)
        time.sleep(2.0)  # their handlers are writing into full buffers (not a synchronisation: they stay stuck)
        code, _, body = page.get("/metrics", timeout=5)
        assert code == 200, f"a fresh scrape from 127.0.0.1 got {code}: {body[:80]!r}"
    finally:
        for sock in readers:
            sock.close()
        _stop(page)


def test_the_page_data_serves_a_planted_megabyte_field_whole(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``/page/data.json`` carries lease fields uncut (low-medium: memory and CPU of the exporter).

    Repro: a lease hash whose ``task_name`` is 8 MB (HSET by anyone who can write the lock Redis), then
    GET ``/page/data.json``. Observed: the answer is > 8 MB (with four 30 MB fields: 125 MB per request,
    the exporter at 650 MB resident and 55% of a core for 10 s after ten views). The HTML page cuts the
    same cell to 256 characters. Expected: every text field the page reads is cut (as ``printable`` cuts
    it, with the count of what was cut), so one answer stays well under a megabyte per lease.
    """
    _hold(r, prefix, "huge", task_name="x" * HUGE)
    page = start_page(make_cfg(prefix, redis_url))
    try:
        code, _, body = page.get("/page/data.json", timeout=60)
        assert code == 200
        (lease,) = json.loads(body)["leases"]
        assert lease["key"] == "huge"
        assert len(body) < BOUNDED, f"/page/data.json answered {len(body)} bytes for one lease"
    finally:
        _stop(page)


def test_locks_json_prints_a_planted_megabyte_field_whole(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``locks --json`` prints lease fields uncut (low: the operator's terminal and pipeline).

    Repro: a lease hash whose ``worker`` is 8 MB, then ``celery lockguard locks --json``. Observed: more than
    8 MB printed for one row (four 30 MB fields: 125 MB, 560 MB resident), while ``locks`` cuts the cell to
    256 characters. Expected: text fields cut as in the table (and the cut counted), one row bounded.
    """
    _hold(r, prefix, "huge", worker="w" * HUGE)
    out = cli(make_cfg(prefix, redis_url), "locks", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout) < BOUNDED, f"locks --json printed {len(out.stdout)} characters for one lease"


def test_metrics_answer_a_foreign_host_on_a_loopback_bind(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``/metrics`` and ``/`` answer any ``Host`` on a loopback bind (low: DNS rebinding reads the fleet).

    Repro: ``lockguard exporter --page`` on 127.0.0.1 (no ``--auth``: the loopback default), a held lease,
    then ``GET /metrics`` with ``Host: attacker.example``. Observed: 200 with task names and worker names
    (``lockguard_leases_held{task=...,worker=...}``), while the page routes answer that Host 403. A site
    the operator visits that rebinds its name to 127.0.0.1 reads it same-origin -- the attack the page's
    Host check exists for. Expected: the same Host rule for every route the server answers (403), or
    a documented reason why ``/metrics`` is exempt.
    """
    _hold(r, prefix, "acct:1")
    page = start_page(make_cfg(prefix, redis_url))
    try:
        wait_page = time.monotonic() + 30
        while b"billing.charge" not in _raw(page.port, "/metrics", "127.0.0.1") and time.monotonic() < wait_page:
            time.sleep(0.2)  # the held gauges are published by the sampler: poll with a deadline
        assert _raw(page.port, "/page/data.json", "attacker.example").startswith(b"HTTP/1.0 403")
        answer = _raw(page.port, "/metrics", "attacker.example")
        assert not answer.startswith(b"HTTP/1.0 200"), answer[:400]
    finally:
        _stop(page)


def _raw(port: int, path: str, host: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_sibling_key_with_a_comma_forges_the_sibling_list(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """A sibling's text is joined bare into ``(with a, b)`` (low: a misleading force-release prompt).

    Repro: a lease whose ``siblings`` is ``["acct:2, acct:3) (with acct:9"]`` (one planted entry, or a
    ``lock_key`` callable returning such text), then ``locks`` and ``release KEY`` (answer n). Observed:
    ``acct:1 (with acct:2, acct:3) (with acct:9)`` and "which also holds acct:2, acct:3) (with acct:9?":
    the operator reads three entities where there is one. Expected: each sibling shown so the list
    cannot be forged (quoted or ``repr``-style, as the key column shows look-alikes), and the count
    ("1 other entity") stated.
    """
    _hold(r, prefix, "acct:1", siblings=json.dumps(["acct:2, acct:3) (with acct:9"]))
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "locks")
    row = next(line for line in out.stdout.splitlines() if line.startswith("acct:1"))
    assert "(with acct:2, acct:3) (with acct:9)" not in row, row
    prompt = cli(cfg, "release", "acct:1", input="n\n")
    assert "also holds acct:2, acct:3) (with acct:9?" not in prompt.stdout + prompt.stderr, prompt.stdout


def test_a_planted_process_index_makes_every_scrape_read_all_of_it(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """Every scrape reads the whole process index and MGETs a gauge per member (low: scrape time).

    Repro: 600,000 members (300,000 observed) with future scores in ``{prefix}:v1:metrics:{fleet}:procs`` (the flush
    prunes only members older than its window, so a planted future score stays), then ``GET /metrics``.
    Observed: 2.5 s per scrape (ZRANGE 0 -1, then one MGET of 300,000 keys; linear: 1M members would
    pass Prometheus' 10 s default scrape timeout), on every scrape. Expected: the index read bounded
    (ZRANGEBYSCORE over the live window only, with a LIMIT, the rest counted as folded), so a scrape
    costs what a real fleet's processes cost.
    """
    future = time.time() + 10**6
    pipe = r.pipeline(transaction=False)
    for start in range(0, 600_000, 10_000):
        pipe.zadd(metrics.procs_key(prefix), {f"h{i}:{i}": future for i in range(start, start + 10_000)})
    pipe.execute()
    page = start_page(make_cfg(prefix, redis_url), page=False)
    try:
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            code, _, body = page.get("/metrics", timeout=60)
            took.append(time.monotonic() - t0)
            assert code == 200
            assert b'lockguard_folded_labels{label="process"} 600000' in body  # the planted members, counted
        assert min(took) < 0.5, f"/metrics took {min(took):.2f}s at best with a planted 600k-member process index"
    finally:
        _stop(page)


FAILOVER_PW = "Failpw2q"  # the second URL's password of a kombu-style failover list


def test_a_failover_list_as_the_lock_url_prints_its_second_password(redis_url: str, prefix: str) -> None:
    """A secret after the first URL of a ``;`` or ``,`` list is printed (medium: credential disclosure).

    Repro: ``lockguard_redis_url = "redis://127.0.0.1:6379/0;redis://:PW@h2:6379/0"`` (a broker failover
    list pasted into the lock setting; redis-py's ``parse_url`` accepts it, ignores the unparsable db and
    connects to the first host). Observed: ``PW`` in ``doctor``, ``describe``, the page header and
    ``/page/data.json``; with the first host down also in ``locks``, ``locks --json`` and ``stats``
    (``the lock Redis redis://:***@...;redis://:PW@... is unreachable``): ``redact`` masks the parsed
    userinfo and query but prints the URL's path as written. Expected: the path masked or refused like
    any text that does not parse as one URL, or such a setting refused (only one URL is used).
    """
    dead = free_port()
    reachable = make_cfg(prefix, redis_url, lock_url=f"{redis_url};redis://:{FAILOVER_PW}@h2:6379/0")
    unreachable = make_cfg(
        prefix, redis_url, lock_url=f"redis://127.0.0.1:{dead}/0;redis://:{FAILOVER_PW}@127.0.0.1:6379/0"
    )
    leaked = []
    for name, cfg, commands in (
        ("reachable", reachable, (("doctor",), ("describe",))),
        ("unreachable", unreachable, (("locks",), ("locks", "--json"), ("stats",))),
    ):
        for args in commands:
            out = cli(cfg, *args)
            if FAILOVER_PW in out.stdout + out.stderr:
                leaked.append(f"{name}: {' '.join(args)}")
    page = start_page(reachable)
    try:
        for path in ("/page", "/page/data.json"):
            if FAILOVER_PW.encode() in page.get(path)[2]:
                leaked.append(path)
    finally:
        _stop(page)
    assert not leaked, f"the second URL's password was printed by: {leaked}"


def test_keys_that_differ_in_whitespace_look_identical(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """Two entities that differ only in trailing or repeated spaces are shown alike (low: issue 30 item 7).

    Repro: leases on ``acct:1`` and ``acct:1 `` (a ``lock_key`` field with a trailing space: a separate
    lock), and on ``acct: 2`` and ``acct:  2``; then ``locks`` and the page. Observed: ``locks`` pads both
    ``acct:1`` cells to the same text, and the page's cells (no ``white-space: pre``) collapse and trim
    the spaces, so each pair reads identically although they are separate locks -- the confusion item 7
    fixed for NFC/NFD and Cyrillic look-alikes. Expected: such keys shown distinguishably (e.g. the
    ``[...]`` spelling, with spaces made visible, or the key quoted).
    """
    for key in ("acct:1", "acct:1 ", "acct: 2", "acct:  2"):
        _hold(r, prefix, key)
    cfg = make_cfg(prefix, redis_url)
    out = cli(cfg, "locks")
    lines = out.stdout.splitlines()
    width = lines[0].index("STATE")  # the key column, padded to its widest cell
    cells = [line[:width].rstrip() for line in lines if line.startswith("acct:")]
    assert len(cells) == 4, out.stdout
    assert len(set(cells)) == 4, f"locks shows {cells} for four separate keys"
    page = start_page(cfg)
    try:
        html = page.get("/page")[2].decode()
    finally:
        _stop(page)
    shown = [" ".join(cell.split()) for cell in re.findall(r'<span class="key">([^<]*)</span>', html)]
    assert len(shown) == 4, html[:2000]
    assert len(set(shown)) == 4, f"the page shows {shown} (as a browser collapses whitespace) for four keys"


def test_reset_connections_write_a_warning_each(redis_url: str, prefix: str) -> None:
    """Every client that resets its connection writes a warning line (low: unauthenticated log flooding).

    Repro: 1,000 connections that send ``GET /page`` and close with RST (SO_LINGER 0), no credentials
    needed (``--auth`` set here: the line is written either way). Observed: one
    ``exporter.connection_failed reason="ConnectionResetError: ..."`` line per reset that lands while
    the handler writes (16 to 125 lines per 300 resets here): anyone who can connect grows the log at
    the rate they can open sockets. Expected: a client going away is routine -- not logged at warning,
    or logged once per run with a count, as ``exporter.accept_failed`` already is.
    """
    page = start_page(make_cfg(prefix, redis_url), "--auth", "ops:Resetpw5q")
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", page.port), timeout=5)
            sock.sendall(b"GET /page HTTP/1.0\r\nHost: localhost\r\n\r\n")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        assert page.get("/metrics")[0] == 200  # still serving
    finally:
        err = _stop(page)
    lines = [line for line in err.splitlines() if "connection_failed" in line]
    assert len(lines) < 10, f"{len(lines)} warning lines for 1,000 resets, e.g. {lines[:1]}"
