"""A second fresh-context security review of the operator surfaces (issue 30): what it reproduced.

Each test fails on the code reviewed (main after the first review's fixes, tests/test_secreview.py); its
docstring says what was observed and what was expected. The exporter tests run the real exporter process
against the real Redis under a private key prefix.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import pytest
import redis
from celery import Celery

from celery_lockguard._config import ConfigurationError, load_settings
from celery_lockguard._keys import debounce_name
from celery_lockguard._metrics import proc_key, procs_key, total_key
from celery_lockguard._redact import redact

from .conftest import make_cfg
from .test_cli import cli
from .test_page import start_page
from .test_secreview import _hold, _hold_big_answer, _stop

pytestmark = pytest.mark.integration

LIST_PW = "Listpw9q"  # a password inside a connection-string setting given as a list


def test_a_connection_string_given_as_a_list_prints_its_password() -> None:
    """``redact`` prints a list or tuple of URLs whole, password included (low-medium: credential disclosure).

    Repro: ``lockguard_completion_backend = ["postgresql://u:PW@h/db"]`` (a list, as Celery accepts
    ``broker_url`` as a list), then load the app's settings (a worker, ``celery ... lockguard ...``).
    Observed: ``ConfigurationError: setting lockguard_completion_backend="://['postgresql://u:PW@h/db']"
    must be ...``: ``redact(value)`` turns the list into its ``str`` and, finding ``://`` in it, rebuilds it
    with the standard URL parser, which sees no scheme and no userinfo and prints it all (``redact(["redis://
    :PW@h/0"])`` likewise). The CLI happens to mask it again (its error passes ``redact_text``), but the
    exception a worker or the API raises carries it. Expected: a value that is no string shown as
    ``UNPARSED`` (or each element redacted), never echoed.
    """
    shown = {repr(v): redact(v) for v in ([f"redis://:{LIST_PW}@h/0"], (f"postgresql://u:{LIST_PW}@h/db",))}
    app = Celery("secreview2", set_as_current=False)
    app.conf.lockguard_completion_backend = [f"postgresql://u:{LIST_PW}@127.0.0.1:5432/test"]
    with pytest.raises(ConfigurationError) as raised:
        load_settings(app)
    leaked = [f"{k} -> {v}" for k, v in shown.items() if LIST_PW in v]
    if LIST_PW in str(raised.value):
        leaked.append(f"ConfigurationError: {raised.value}")
    assert not leaked, f"the password was printed: {leaked}"


def test_readers_that_trickle_keep_every_slot_from_a_fresh_scrape(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """Slow readers that read just enough are never "stalled", and still take every slot (medium: monitoring DoS).

    Repro: a ``/page/data.json`` larger than the socket buffers (500 leases with 32 siblings each, as in
    test_secreview's slow-reader test), then 8 connections from each of 127.0.0.2-127.0.0.5 that request it
    and read 16 KiB every 0.1 s (160 KB/s each: a 64 KiB chunk never waits 1 s, so no handler counts as a
    stalled writer and none is evicted). Observed: a fresh ``/metrics`` from 127.0.0.1 gets ``503 exporter
    at connection limit`` for as long as they trickle (each answer takes ~30 s of the 40 s deadline, and
    they reconnect). Expected (issue 30: slow clients must not starve real ones): a fresh scrape is
    answered, e.g. a handler evicted by its answer's progress rate or age, not only a chunk stalled 1 s,
    or a slot kept for scrapes.
    """
    _hold_big_answer(r, prefix)
    page = start_page(make_cfg(prefix, redis_url))  # defaults: 32 slots, a quarter per address
    readers: list[socket.socket] = []
    sel = selectors.DefaultSelector()
    try:
        assert len(page.get("/page/data.json", timeout=60)[2]) > 5 * 1024 * 1024  # past the socket buffers
        for peer in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"):
            for _ in range(8):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind((peer, 0))
                sock.connect(("127.0.0.1", page.port))
                sock.sendall(b"GET /page/data.json HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                sock.setblocking(False)
                readers.append(sock)
        codes: list[int] = []
        stop = threading.Event()

        def scrape() -> None:
            # From 2 s on (the readers' handlers are all serving by then), one a second, each given 15 s: on a
            # loaded machine an answer may be slow, and only a refusal (503) or no answer at all is the defect.
            # On their own thread, so the readers trickle on meanwhile instead of stalling into eviction.
            for pause in (2.0, 1.0, 1.0, 1.0):
                if stop.wait(pause):
                    return
                codes.append(_scrape(page.port, timeout=15))

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        deadline = time.monotonic() + 80
        while scraper.is_alive() and time.monotonic() < deadline:
            for sock in readers:  # trickle: 16 KiB per reader per 0.1 s
                try:
                    sock.recv(16384)
                except (BlockingIOError, OSError):
                    pass
            time.sleep(0.1)
        stop.set()
        scraper.join(20)
        assert len(codes) == 4 and all(code == 200 for code in codes), f"fresh scrapes from 127.0.0.1 got {codes}"
    finally:
        sel.close()
        for sock in readers:
            sock.close()
        _stop(page)


def _scrape(port: int, timeout: float) -> int:
    """One ``/metrics`` from 127.0.0.1: its status code (0: no answer within ``timeout`` seconds)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            line = sock.recv(64).split(b"\r\n", 1)[0].split()
            return int(line[1]) if len(line) > 1 else 0
    except OSError:
        return 0


#: A planted field this large (bytes): what anyone who can write the lock Redis can store.
HUGE = 8 * 1024 * 1024
#: What one row of one answer may reasonably weigh, whatever its fields hold.
BOUNDED = 1024 * 1024


def test_locks_json_prints_a_planted_debounce_record_whole(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``locks --json`` prints a debounce record's fields uncut (low: the operator's terminal and pipeline).

    Repro: a debounce record hash (``{prefix}:v1:{acct:1}:debounce:billing.charge``, the layout
    DEBOUNCE_PUBLISH writes) whose ``task_id`` and ``last_run`` are 8 MB each, then ``celery lockguard locks
    --json``. Observed: over 16 MB printed for one row: the first review's fix cuts lease rows in
    ``HeldLease.as_dict`` but ``DebounceRow.as_dict`` returns its fields as read (the text table cuts them,
    through ``terminal.table``). Expected: every text field of every ``--json`` row cut at 256 characters
    (``...[N more]``), as lease rows are.
    """
    name = debounce_name(prefix, "acct:1", "billing.charge")
    r.hset(name, mapping={"task_id": "x" * HUGE, "state": "queued", "due_ms": "1", "last_run": "y" * HUGE})
    r.pexpire(name, 600_000)
    out = cli(make_cfg(prefix, redis_url), "locks", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [row for row in json.loads(out.stdout) if row.get("state") == "debounce"]
    assert len(rows) == 1, out.stdout[:2000]
    assert len(out.stdout) < BOUNDED, f"locks --json printed {len(out.stdout)} bytes for one debounce record"


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_scrape_reads_planted_process_gauges_whole(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``/metrics`` reads every process gauge in the live window whole, whatever its size (low-medium: exporter
    memory and CPU; the neighbour of the first review's bounded process index).

    Repro: 24 process gauges (``...:metrics:{fleet}:proc:<host>:<pid>``, indexed in ``...:procs`` with a
    current score, as a flush writes them) of 4 MB each (a valid gauge with a padding field), then a few
    scrapes of ``/metrics``. Observed: the exporter's peak resident memory is ~210 MB above an exporter on an
    empty prefix (62 MB): one ``MGET`` of 96 MB, decoded, then ``json.loads`` of each. The live window bounds the number
    of members (4096) but not their bytes, so 4096 such gauges would be 16 GB per scrape. Expected: a gauge's size
    bounded before it is read (e.g. ``STRLEN`` in the same pipeline, or ``GETRANGE`` to a cap, a larger one
    skipped and counted), so a scrape's memory is bounded whatever Redis holds.
    """
    now = time.time()
    pad = "x" * (4 * 1024 * 1024)
    for n in range(24):
        proc = f"planted:{n}"
        r.set(proc_key(prefix, proc), json.dumps({"at": now, "ttl": 600, "held": [], "pad": pad}), ex=600)
        r.zadd(procs_key(prefix), {proc: now})
    baseline = start_page(make_cfg(f"{prefix}-empty", redis_url), page=False)  # nothing planted under it
    try:
        assert baseline.get("/metrics")[0] == 200
        unplanted = _peak_rss_mb(baseline.proc.pid)
    finally:
        _stop(baseline)
    page = start_page(make_cfg(prefix, redis_url), page=False)
    try:
        for _ in range(3):
            assert page.get("/metrics", timeout=60)[0] == 200
        grown = _peak_rss_mb(page.proc.pid) - unplanted
    finally:
        _stop(page)
    assert grown < 64, f"the exporter's peak memory was {grown:.0f} MB above an empty prefix's after scrapes"


def test_stats_json_prints_a_planted_task_name_whole(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """``stats --json`` prints a task name from the metrics totals uncut (low: the operator's terminal and
    pipeline).

    Repro: one field ``<8 MB task name>|lock.acquired`` = 1 in the fleet's totals hash
    (``...:metrics:{fleet}:total``, the layout a flush writes), and one ``<8 MB>|x`` = ``nan`` (a malformed
    count), then ``celery lockguard stats --json``. Observed: over 16 MB printed (the task name as a key of
    ``tasks``, the malformed field whole in ``malformed``), while ``stats`` (text) cuts both to 256
    characters and ``/metrics`` to its label cap. Expected: text fields of ``--json`` cut as ``locks
    --json`` now cuts lease fields (``...[N more]``), one answer bounded.
    """
    r.hset(total_key(prefix), mapping={"t" * HUGE + "|lock.acquired": "1", "m" * HUGE + "|x": "nan"})
    out = cli(make_cfg(prefix, redis_url), "stats", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    json.loads(out.stdout)
    assert len(out.stdout) < BOUNDED, f"stats --json printed {len(out.stdout)} bytes for two planted fields"


def test_a_format_character_and_its_escape_spelled_out_look_identical(
    r: redis.Redis, redis_url: str, prefix: str
) -> None:
    """A key holding U+200B and a key holding the six characters ``\\u200b`` read the same (low: issue 30
    item 7, look-alike entities).

    Repro: leases on ``inv:1`` + U+200B (a zero-width space: key rendering percent-encodes whitespace and
    control characters, but not format characters such as U+200B or U+202E, so a task renders it from an
    argument) and on ``inv:1\\u200b`` (a literal backslash: rendering leaves backslashes alone), then
    ``locks``. Observed: both rows show the text ``inv:1\\u200b``: ``printable`` escapes the format character to
    ASCII text and leaves the backslash as it is, and ``entity`` adds its ``[...]`` spelling only when the
    escaped text is non-ASCII, so neither gets one. Expected: two keys shown distinguishably (e.g. the
    bracket spelling whenever ``printable`` escaped anything, or backslashes escaped in it).
    """
    keys = ("inv:1\u200b", "inv:1\\u200b")
    assert keys[0] != keys[1] and len(keys[0]) == 6 and len(keys[1]) == 11
    for key in keys:
        _hold(r, prefix, key)
    out = cli(make_cfg(prefix, redis_url), "locks")
    lines = out.stdout.splitlines()
    width = lines[0].index("STATE")
    cells = [line[:width].rstrip() for line in lines if line.startswith("inv:")]
    assert len(cells) == 2, out.stdout
    assert cells[0] != cells[1], f"locks shows {cells} for two separate keys"
