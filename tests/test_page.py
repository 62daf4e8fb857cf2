"""The lock page (``lockguard exporter --page``) in a real headless Chromium, and its HTTP rules.

The page is served by a real ``celery ... lockguard exporter --page``
subprocess against the real Redis, under the test's prefix; leases are held
by a real worker or taken with the library. The browser is Debian's
``chromium`` driven by ``chromedriver`` (selenium); no browser is downloaded.
Hostile values -- task ids, task arguments rendered into the entity key,
task names, worker names and states planted in a lease hash -- must show as
text and run nothing: no dialog, no injected element, no attempt at inline
code (every ``securitypolicyviolation`` the page raises is recorded and must
stay empty, so the escaping is tested, not only the CSP behind it).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_lockguard import _doctor as doctor
from celery_lockguard import _exporter as exporter_server
from celery_lockguard import _lease as L
from celery_lockguard import _metrics as metrics
from celery_lockguard._config import settings
from celery_lockguard._keys import lock_name, wait_name
from celery_lockguard._page import CSP, Front
from celery_lockguard._page_state import PageState
from celery_lockguard.testing import free_port

from .conftest import REQUIRE, make_cfg
from .harness import ROOT, wait_for
from .test_cli import cli_env
from .test_cli_hostile import assert_terminal_safe, plant, strict_json
from .workerapp import create_app

pytestmark = pytest.mark.integration

LOCKGUARD = (sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "lockguard")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)
#: Written by the page's document before any of its scripts: every CSP violation and every alert() call.
RECORDER = """
window.__violations = [];
document.addEventListener('securitypolicyviolation', function (e) {
  window.__violations.push(e.violatedDirective + ' ' + e.blockedURI);
});
window.__alerts = 0;
var realAlert = window.alert;
window.alert = function (m) { window.__alerts += 1; return realAlert.call(window, m); };
"""
HOSTILE_ID = "\"><img src=x onerror=alert('id')>\x1b[31m"
HOSTILE_ARG = "<script>alert('arg')</script>"
HOSTILE_ARG_2 = '"><img src=x onerror=alert(2)>'


class PageServer:
    def __init__(self, proc: subprocess.Popen[str], port: int, auth: tuple[str, str] | None = None) -> None:
        self.proc, self.port, self.auth = proc, port, auth
        self.url = f"http://127.0.0.1:{port}"

    def get(
        self, path: str, method: str = "GET", auth: tuple[str, str] | bool | None = True, timeout: float = 10
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; ``auth=True``: with the server's credentials (if any), ``None``: without any."""
        req = urllib.request.Request(self.url + path, method=method)
        creds = self.auth if auth is True else (auth or None)
        if creds:
            req.add_header("Authorization", "Basic " + base64.b64encode(":".join(creds).encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return int(resp.status), dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return int(err.code), dict(err.headers), err.read()

    def answers(self, path: str) -> tuple[int, bytes] | None:
        """Status and body of a GET of ``path``, or None while the server does not answer yet."""
        try:
            code, _, body = self.get(path)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            assert self.proc.poll() is None, "the page server exited"
            return None
        return code, body

    def data(self) -> dict[str, Any] | None:
        answer = self.answers("/page/data.json")
        return json.loads(answer[1]) if answer and answer[0] in (200, 500, 503) else None


#: Doctor findings drawn from a sample of the server's keys, which the other tests on it change.
SAMPLED_FINDINGS = frozenset({"cache_traffic", "shared_server", "evictions"})


def start_page(cfg: dict[str, Any], *args: str, env: dict[str, str] | None = None, page: bool = True) -> PageServer:
    port = free_port()
    with_page = ("--page", "--page-interval", "0.3") if page else ()
    proc = subprocess.Popen(
        [*LOCKGUARD, "exporter", "--port", str(port), *with_page, *args],
        cwd=ROOT,
        env={**cli_env(cfg), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    given = args[args.index("--auth") + 1] if "--auth" in args else (env or {}).get("LOCKGUARD_PAGE_AUTH")
    auth = tuple(given.split(":", 1)) if given else None
    server = PageServer(proc, port, auth)  # type: ignore[arg-type]
    ready = server.data if page else (lambda: (server.answers("/metrics") or (0,))[0] == 200)
    wait_for(ready, 60, interval=0.2, what="the page server to answer")
    return server


@pytest.fixture
def pages() -> Iterator[list[PageServer]]:
    started: list[PageServer] = []
    yield started
    for server in started:
        server.proc.terminate()
        _, err = server.proc.communicate(timeout=15)
        assert "Traceback" not in err, err


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Debian's headless Chromium under chromedriver, a fresh profile, the recorder installed before any script."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if REQUIRE:
            pytest.fail("LOCKGUARD_REQUIRE_SERVICES=1 but chromium/chromedriver are not installed")
        pytest.skip("chromium and chromium-driver are not installed")
    if not REQUIRE:
        pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}")
    options.set_capability("unhandledPromptBehavior", "ignore")  # a dialog stays open, to be found
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORDER})
    try:
        yield driver
    finally:
        driver.quit()


def no_script_ran(driver: Any) -> None:
    """No dialog open, no alert() called, no CSP violation, no element made from a value."""
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
        pytest.fail(f"a dialog opened: {alert.text!r}")
    except NoAlertPresentException:
        pass
    assert driver.execute_script("return window.__alerts") == 0
    assert driver.execute_script("return window.__violations") == []
    injected = driver.execute_script(
        "return Array.from(document.querySelectorAll('#live img, #live script, #live iframe, #live [onerror],"
        " #live [onload]')).map(e => e.outerHTML)"
    )
    assert injected == []


def texts(driver: Any, selector: str) -> list[str]:
    """The text of every element ``selector`` matches, read in one script: the page swaps ``#live`` every
    interval, so an element found by one WebDriver call may be gone (stale) by the next."""
    found = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent)", selector
    )
    return [str(t) for t in found]


def live_text(driver: Any) -> str:
    return str(driver.execute_script("var l = document.getElementById('live'); return l ? l.textContent : ''"))


@pytest.mark.browser
def test_the_page_shows_the_fleets_leases_updates_live_and_runs_no_hostile_value(
    fleet: Any, r: redis.Redis, redis_url: str, prefix: str, pages: list[PageServer], browser: Any
) -> None:
    cfg = make_cfg(prefix, redis_url)
    fleet.worker(cfg, concurrency=2)
    app = fleet.app(cfg)
    # A real worker holds a lease whose task id and rendered key are hostile.
    held = app.tasks["hold_skip"].apply_async(args=(HOSTILE_ARG, 25.0, ""), task_id=HOSTILE_ID)
    held2 = app.tasks["hold_skip"].apply_async(args=(HOSTILE_ARG_2, 25.0, ""))
    # And a lease hash planted by someone with Redis access, every text field hostile.
    planted = lock_name(prefix, "planted")
    r.hset(
        planted,
        mapping={"task_id": "t\x1b[2Jx", "task_name": "<b>bold</b>", "worker": "<svg onload=alert(3)>", "fence": "²"},
    )
    r.pexpire(planted, 120_000)
    metrics.count("hold_skip", "lock.acquired", 4)
    metrics.count("hold_skip", "lock.contended", 1)
    metrics.flush(r, prefix)
    page = start_page(cfg)
    pages.append(page)

    def held_by_worker() -> bool:
        data = page.data() or {}
        ids = {lease["task_id"] for lease in data.get("leases", [])}
        return HOSTILE_ID in ids and held2.id in ids

    wait_for(held_by_worker, 90, interval=0.3, what="the worker's leases on the page's data")

    browser.get(page.url + "/page")
    assert browser.title.startswith("lockguard")
    shown = live_text(browser)
    # Shown as text: the task id (its escape sequence written out), the keys, the planted fields.
    assert "\"><img src=x onerror=alert('id')>\\x1b[31m" in shown
    assert f"res:{HOSTILE_ARG}" in shown
    assert 'res:"><img%20src=x%20onerror=alert(2)>' in shown  # whitespace is escaped in rendered keys
    assert "t\\x1b[2Jx" in shown and "<b>bold</b>" in shown and "<svg onload=alert(3)>" in shown
    assert browser.find_elements("css selector", "#live b, #live svg:not(.spark)") == []
    no_script_ran(browser)
    # The doctor's findings (cached by the page server) and the four numbers with their sparklines.
    # Findings that sample the shared Redis (other tests' keys) differ from run to run: the page
    # must show its own cached run in full, and that run holds every finding of the set-up.
    configured = {f.code for f in doctor.run(app)} - SAMPLED_FINDINGS
    assert configured, "the test app has doctor findings (its locks share the broker's Redis)"
    cached = wait_for(lambda: (page.data() or {}).get("doctor", {}).get("findings"), 60, what="the page's doctor run")
    codes = {f["code"] for f in cached}
    assert configured <= codes
    wait_for(lambda: all(c in texts(browser, "#doctor")[0] for c in codes), 60, what="the doctor's findings")
    assert texts(browser, "#numbers .card .label") == [
        "acquisitions / min", "contention", "average hold", "expired-lock rate"
    ]  # fmt: skip
    assert texts(browser, "#numbers .card .value")[0] not in ("", "-")
    wait_for(lambda: browser.find_elements("css selector", "#numbers .spark polyline"), 30, what="a sparkline")
    assert "hold_skip" in texts(browser, "#numbers table.tasks")[0]

    # Updates without a reload: a marker set on this document survives while the page changes.
    browser.execute_script("window.__sameDocument = true")
    lease = L.acquire(
        r, prefix, "inv:fresh", ttl_ms=60_000, task_id="t-fresh", task_name="billing.charge", digest="d",
        worker="ops@host", fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(lease, L.Lease)
    wait_for(lambda: "inv:fresh" in live_text(browser), 30, interval=0.2, what="the new lease on the open page")
    L.release(r, lease, prefix)
    wait_for(lambda: "inv:fresh" not in live_text(browser), 30, interval=0.2, what="the released lease to go")
    # The worker's holds end by themselves: their rows go too.
    wait_for(lambda: f"res:{HOSTILE_ARG}" not in live_text(browser), 90, interval=0.3, what="the worker's release")
    assert held.get(timeout=60)["tag"] == "" and held2.get(timeout=60)["tag"] == ""
    assert browser.execute_script("return window.__sameDocument") is True
    assert "live" == browser.find_element("id", "poll").text
    no_script_ran(browser)
    shot = os.environ.get("LOCKGUARD_PAGE_SCREENSHOT")
    if shot:
        lease = L.acquire(
            r, prefix, "invoice:42", ttl_ms=60_000, task_id="5f1c-charge", task_name="billing.charge", digest="d",
            worker="celery@billing-1", fence_ttl_ms=60_000,
        )  # fmt: skip
        wait_for(lambda: "invoice:42" in live_text(browser), 30, interval=0.2, what="the screenshot's lease")
        browser.save_screenshot(shot)


def test_basic_auth_read_only_methods_loopback_and_headers(
    redis_url: str, prefix: str, pages: list[PageServer]
) -> None:
    secret = "s3cret-pw:with-colon"
    page = start_page(make_cfg(prefix, redis_url), env={"LOCKGUARD_PAGE_AUTH": f"ops:{secret}"})
    pages.append(page)
    for path in ("/page", "/page/live", "/page/data.json", "/page/app.js", "/metrics", "/"):
        code, headers, body = page.get(path, auth=None)
        assert code == 401, path
        assert headers["WWW-Authenticate"].startswith("Basic realm=")
        assert secret.encode() not in body
        assert page.get(path, auth=("ops", "wrong"))[0] == 401
        assert page.get(path, auth=("ops", secret[:-1]))[0] == 401
        assert page.get(path)[0] == 200, path
    code, headers, body = page.get("/page")
    assert headers["Content-Security-Policy"] == CSP and "'unsafe-inline'" not in CSP
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"
    assert b'<script src="/page/app.js"' in body and b"<script>" not in body and b" style=" not in body
    # Read-only: any method but GET and HEAD is 405, on the page and on /metrics, authorised or not.
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"):
        for path in ("/page", "/page/data.json", "/metrics"):
            code, headers, _ = page.get(path, method=method)
            assert code == 405, (method, path)
            assert headers["Allow"] == "GET, HEAD"
    for path in ("/page", "/metrics"):
        code, headers, body = page.get(path, method="HEAD")
        assert code == 200 and body == b"" and int(headers["Content-Length"]) > 20, path
    # Bound to loopback by default: the one listening socket on its port is 127.0.0.1's.
    listening = [
        line.split()[1]
        for line in Path(f"/proc/{page.proc.pid}/net/tcp").read_text().splitlines()[1:]
        if line.split()[3] == "0A" and line.split()[1].endswith(f":{page.port:04X}")
    ]
    assert listening == [f"0100007F:{page.port:04X}"]
    page.proc.terminate()
    out, err = page.proc.communicate(timeout=15)
    pages.remove(page)
    assert secret not in out and secret not in err
    assert f"{page.url}/page (basic auth)" in out


def test_auth_without_the_page_guards_metrics(redis_url: str, prefix: str, pages: list[PageServer]) -> None:
    exporter = start_page(make_cfg(prefix, redis_url), "--auth", "prom:scrape-pw", page=False)
    pages.append(exporter)
    assert exporter.get("/metrics", auth=None)[0] == 401
    assert exporter.get("/metrics", auth=("prom", "nope"))[0] == 401
    assert exporter.get("/metrics")[0] == 200
    assert exporter.get("/page")[0] == 404  # no page unless --page
    assert exporter.get("/metrics", method="POST")[0] == 405


def get_with_host(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    """GET ``path`` from 127.0.0.1:``port`` sending ``host`` as the Host header (None: no Host header)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_on_loopback_the_page_answers_to_loopback_names_only(
    r: redis.Redis, redis_url: str, prefix: str, pages: list[PageServer]
) -> None:
    """DNS rebinding: a site renamed to 127.0.0.1 reads the page as same-origin, with its own name in Host."""
    L.acquire(
        r, prefix, "inv:secret", ttl_ms=60_000, task_id="t-secret", task_name="n", digest="d", worker="w",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    port = page.port
    for host in (f"rebind.attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}"):
        for path in ("/page", "/page/live", "/page/data.json", "/page/app.js"):
            code, body = get_with_host(port, path, host)
            assert code == 403, (host, path)
            assert b"inv:secret" not in body and b"loopback names only" in body
    assert get_with_host(port, "/metrics", "attacker.example")[0] == 403  # /metrics names tasks too (issue 30)
    assert get_with_host(port, "/metrics", f"127.0.0.1:{port}")[0] == 200  # what Prometheus sends: its target
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}", "127.1.2.3", "ops.localhost",
                 None):  # fmt: skip
        code, body = get_with_host(port, "/page/data.json", host)
        assert code == 200 and b"inv:secret" in body, host
    assert get_with_host(port, "/page", "locks.internal")[0] == 403
    named = start_page(make_cfg(prefix, redis_url), "--allow-host", "Locks.Internal.")  # a local proxy's name
    pages.append(named)
    assert get_with_host(named.port, "/page/data.json", f"locks.internal:{named.port}")[0] == 200
    assert get_with_host(named.port, "/page/data.json", "other.internal")[0] == 403


def test_host_names_are_read_without_port_case_or_brackets() -> None:
    from celery_lockguard._page import host_name, loopback_host

    assert host_name("LocalHost:9808") == "localhost" and host_name("localhost.") == "localhost"
    assert host_name("[::1]:9808") == "::1" and host_name("[::1]") == "::1" and host_name("::1") == "::1"
    assert host_name("") is None and host_name(None) is None and host_name("a.example:x") == "a.example:x"
    assert loopback_host("127.0.0.9") and loopback_host("::1") and loopback_host("x.localhost")
    assert not loopback_host("10.0.0.1") and not loopback_host("localhost.example") and not loopback_host("::")
    # Bound wider (no list of hosts), any Host is served: auth and a reverse proxy guard that set-up.
    assert Front(None, None, None).host_allowed("anything.example")
    assert not Front(None, None, ()).host_allowed("anything.example")


def test_bad_credentials_setting_exits_64_without_echoing_it(redis_url: str, prefix: str) -> None:
    out = subprocess.run(
        [*LOCKGUARD, "exporter", "--page", "--port", str(free_port())],
        cwd=ROOT,
        env={**cli_env(make_cfg(prefix, redis_url)), "LOCKGUARD_PAGE_AUTH": "no-colon-secret"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 64, out.stderr
    assert "USER:PASSWORD" in out.stderr
    assert "no-colon-secret" not in out.stdout + out.stderr


def test_a_bad_value_answers_500_an_outage_503_and_the_page_keeps_serving(
    r: redis.Redis, redis_url: str, prefix: str, pages: list[PageServer]
) -> None:
    L.acquire(
        r, prefix, "inv:ok", ttl_ms=60_000, task_id="t-ok", task_name="billing.charge", digest="d", worker="w@h",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    r.set(metrics.total_key(prefix), "a string where the totals hash belongs")
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    code, _, body = page.get("/page")
    # A totals key of the wrong type is read as empty (issue 30; it used to fail the metrics section with 500).
    assert code == 200 and b"inv:ok" in body and b"could not read" not in body
    r.delete(metrics.total_key(prefix))
    r.hset(metrics.total_key(prefix), "billing.charge|lock.acquired", "3")
    wait_for(
        lambda: "billing.charge" in ((page.data() or {}).get("tasks") or {}), 30, interval=0.2, what="the totals read"
    )
    dead = make_cfg(prefix, redis_url, lock_url=f"redis://127.0.0.1:{free_port()}/0")
    down = start_page(dead)
    pages.append(down)
    code, _, body = down.get("/page")
    assert code == 503 and b"could not read the leases: ConnectionError" in body
    assert down.get("/page/data.json")[0] == 503


def test_the_connection_cap_and_timeout_cover_the_page(redis_url: str, prefix: str, pages: list[PageServer]) -> None:
    page = start_page(make_cfg(prefix, redis_url), "--max-connections", "1", "--timeout", "2")
    pages.append(page)
    idle = socket.create_connection(("127.0.0.1", page.port), timeout=5)
    opened = time.monotonic()
    try:
        # A silent connection takes no slot (issue 30: it used to, and the page answered 503): the page is
        # served with the cap at 1, and the silent one is closed after the timeout. The one slot may still be
        # on its way back from start_page's readiness request (its handler closes after the client has read
        # the answer): ask again until well before the 2 s timeout could have freed a slot the silent one took.
        codes = [page.get("/page")[0]]
        while codes[-1] != 200 and time.monotonic() - opened < 1.5:
            time.sleep(0.05)
            codes.append(page.get("/page")[0])
        assert codes[-1] == 200, codes
        t0 = time.monotonic()
        assert idle.recv(100) == b""
        assert 1.0 < time.monotonic() - t0 < 5.0
    finally:
        idle.close()


class Markup(HTMLParser):
    """Every element and attribute of a document, to hold the page to its own vocabulary."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self.scripts: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)
        if tag == "script":
            self.scripts.append(dict(attrs))


PAGE_TAGS = {
    "html", "head", "meta", "title", "link", "script", "body", "header", "h1", "h2", "p", "code", "span", "main",
    "div", "time", "section", "table", "thead", "tbody", "tr", "th", "td", "ul", "li", "svg", "polyline", "circle",
}  # fmt: skip
PAGE_ATTRS = {
    "lang", "charset", "name", "content", "rel", "href", "src", "defer", "class", "id", "data-interval", "viewbox",
    "width", "height", "role", "aria-label", "points", "cx", "cy", "r",
}  # fmt: skip


def test_over_every_hostile_value_the_markup_is_the_pages_own(
    r: redis.Redis, redis_url: str, prefix: str, pages: list[PageServer]
) -> None:
    """The values test_cli_hostile plants (escapes, forged newlines, U+202E, NUL, non-UTF-8, 100 000 chars,
    wrong types): the page answers, and its markup has only the elements and attributes the page writes."""
    plant(r, redis.Redis.from_url(redis_url), prefix)
    page = start_page(make_cfg(prefix, redis_url))
    pages.append(page)
    for path in ("/page", "/page/live"):
        code, _, body = page.get(path)
        assert code == 200, body[:2000]
        html = body.decode()
        assert_terminal_safe(html, path)  # no raw control character: each is written as text
        markup = Markup()
        markup.feed(html)
        assert markup.tags <= PAGE_TAGS, markup.tags - PAGE_TAGS
        assert markup.attrs <= PAGE_ATTRS, markup.attrs - PAGE_ATTRS
        assert markup.scripts == ([{"src": "/page/app.js", "defer": None}] if path == "/page" else [])
        assert "inv:good" in html and "\\x1b[2J\\x1b[31mred" in html  # the good row, the planted one as text
    data = strict_json(page.get("/page/data.json")[2].decode())
    assert any(lease["key"] == "inv:good" for lease in data["leases"])
    assert data["status"] == 200


@pytest.mark.browser
def test_behind_basic_auth_the_page_loads_and_updates_over_hostile_values(
    r: redis.Redis, redis_url: str, prefix: str, pages: list[PageServer], browser: Any
) -> None:
    plant(r, redis.Redis.from_url(redis_url), prefix)
    page = start_page(make_cfg(prefix, redis_url), env={"LOCKGUARD_PAGE_AUTH": "ops:pw-for-the-browser"})
    pages.append(page)
    browser.get(f"http://ops:pw-for-the-browser@127.0.0.1:{page.port}/page")  # the browser caches the auth
    assert "inv:good" in live_text(browser)
    assert "red" in live_text(browser) and "\\x1b[2J" in live_text(browser)
    no_script_ran(browser)
    lease = L.acquire(
        r, prefix, "inv:after-auth", ttl_ms=60_000, task_id="t-a", task_name="n", digest="d", worker="w",
        fence_ttl_ms=60_000,
    )  # fmt: skip
    assert isinstance(lease, L.Lease)
    wait_for(lambda: "inv:after-auth" in live_text(browser), 30, interval=0.2, what="an update behind basic auth")
    assert browser.find_element("id", "poll").text == "live"
    no_script_ran(browser)


# -- the sampler, in-process against the real Redis ---------------------------------------------


@pytest.fixture
def page_app(redis_url: str, prefix: str) -> Celery:
    return create_app(make_cfg(prefix, redis_url))


def test_doctor_runs_in_the_sampler_not_per_request(page_app: Celery, prefix: str) -> None:
    s = settings(page_app)
    state = PageState(page_app, s, interval=0.1, doctor_interval=3600).start()
    server = exporter_server.serve(s, "127.0.0.1", 0, front=Front(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        first = wait_for(lambda: state.snapshot.doctor.at, 60, what="the first doctor run")
        assert state.snapshot.doctor.findings is not None
        taken = state.snapshot.taken_at
        url = f"http://127.0.0.1:{server.server_address[1]}/page"
        for _ in range(20):
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.status == 200 and b'id="doctor"' in resp.read()
        wait_for(lambda: state.snapshot.taken_at > taken, 10, what="another sample")
        assert state.snapshot.doctor.at == first  # sampled again, requests served, doctor not re-run
        assert state.snapshot.samples, "every sample adds to the ring"
    finally:
        server.shutdown()
        server.server_close()
        state.close()


def test_busy_entities_count_holders_seen_and_waiters(page_app: Celery, r: redis.Redis, prefix: str) -> None:
    state = PageState(page_app, settings(page_app), interval=1, doctor_interval=3600)
    for i in range(3):  # three holders of one entity, each seen by one sample
        lease = L.acquire(
            r, prefix, "hot", ttl_ms=60_000, task_id=f"t-{i}", task_name="n", digest="d", worker="w",
            fence_ttl_ms=60_000,
        )  # fmt: skip
        assert isinstance(lease, L.Lease)
        state.refresh()
        if i < 2:
            L.release(r, lease, prefix)
    L.acquire(r, prefix, "calm", ttl_ms=60_000, task_id="c", task_name="n", digest="d", worker="w", fence_ttl_ms=60_000)
    r.rpush(wait_name(prefix, "calm"), "park-1", "park-2")
    state.refresh()
    busy = {b.key: b for b in state.snapshot.busy}
    assert busy["hot"].holders == 3 and busy["hot"].waiting == 0
    assert busy["calm"].waiting == 2 and busy["calm"].holders == 1
    assert [b.key for b in state.snapshot.busy][:2] == ["calm", "hot"]  # waiters first
    assert state.snapshot.waiting == {"calm": 2}
    # Four samples within a few seconds: one or two 5 s slots of the sparklines' ring, the latest sample last.
    assert 1 <= len(state.snapshot.samples) <= 2 and state.snapshot.samples[-1].at == state.snapshot.taken_at
    assert time.time() - state.snapshot.taken_at < 60


def test_busy_entities_past_the_rows_shown_and_the_tracking_cap(
    page_app: Celery, r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More leases than rows shown and than entities tracked (500 and 5000, made 5 and 8 here): waiters behind
    a lease past the rows still count, and an entity that changes hands is tracked long enough to be seen."""
    from celery_lockguard import _page_state as page_state

    monkeypatch.setattr(page_state, "MAX_LEASES", 5)
    monkeypatch.setattr(page_state, "MAX_TRACKED", 8)

    def take(key: str, i: int) -> L.Lease:
        lease = L.acquire(
            r, prefix, key, ttl_ms=60_000, task_id=f"{key}-{i}", task_name="n", digest="d", worker="w",
            fence_ttl_ms=60_000,
        )  # fmt: skip
        assert isinstance(lease, L.Lease)
        return lease

    held = {f"e:{i:02d}": take(f"e:{i:02d}", 0) for i in range(12)}
    take("z:hot", 0)  # sorts last: past the five rows shown
    r.rpush(wait_name(prefix, "z:hot"), "park-1", "park-2", "park-3")
    state = PageState(page_app, settings(page_app), interval=1, doctor_interval=3600)
    for i in range(4):
        if i:  # e:09 changes hands between samples: a new holder, a new fence
            L.release(r, held["e:09"], prefix)
            held["e:09"] = take("e:09", i)
        state.refresh()
    snap = state.snapshot
    assert snap.lease_count == 13 and len(snap.leases) == 5
    busy = {b.key: b for b in snap.busy}
    assert busy["z:hot"].waiting == 3, snap.busy  # its waiters were read though its row is not shown
    assert busy["z:hot"].held_share == 1.0  # and it stayed tracked: held in every sample
    assert busy["e:09"].holders == 4, snap.busy  # four holders, one per sample
    assert len(state._seen) <= 8


def test_busy_entities_count_the_last_hour_only(page_app: Celery, prefix: str) -> None:
    """Two hours of samples, every 5 s: holders and held shares from before the hour no longer count."""
    from celery_lockguard._holders import HeldLease

    state = PageState(page_app, settings(page_app), interval=5, doctor_interval=3600)

    def held(key: str, fence: int) -> HeldLease:
        return HeldLease.from_hash(prefix, lock_name(prefix, key), {"task_id": "t", "fence": str(fence)}, 60_000, 0)

    t0 = 1_800_000_000.0
    busy: tuple[Any, ...] = ()
    for i in range(12):  # the first minute: "hot" has a new holder every sample
        busy = state._observe([held("hot", 1 + i), held("quiet", 1)], {"quiet": 1}, t0 + 5 * i)
    assert {b.key: b.holders for b in busy}["hot"] == 12
    for i in range(12, 12 * 120):  # then two hours: one holder of "hot"; "quiet" seen once every half hour
        now = t0 + 5 * i
        leases = [held("hot", 100)] + ([held("quiet", 1)] if i % 360 == 0 else [])
        busy = state._observe(leases, {"quiet": 1}, now)
    rows = {b.key: b for b in busy}
    assert "hot" not in rows, rows  # one holder in the last hour: not busy, whatever it was two hours ago
    assert state._seen["hot"].holders == 1
    assert rows["quiet"].held_share < 0.01, rows  # held in 2 of the hour's ~700 samples, not "100%"
    assert len(state._seen["hot"].buckets) <= 13  # memory per entity: one bucket per 5 minutes of the hour


# -- rendering and the four numbers, without a server ---------------------------------------------


@pytest.mark.parametrize(
    "value,shown",
    [
        ("<script>alert(1)</script>", "&lt;script&gt;alert(1)&lt;/script&gt;"),
        ('"><img src=x onerror=alert(1)>', "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"),
        ("it's & more", "it&#x27;s &amp; more"),
        ("\x1b[2J\u202e\n", "\\x1b[2J\\u202e\\n"),
        (None, "-"),
        (42, "42"),
        ("x" * 300, "x" * 256 + "...[44 more]"),
    ],
)
def test_every_value_is_escaped_for_html_after_the_terminal_rules(value: object, shown: str) -> None:
    from celery_lockguard._page_html import text

    assert text(value) == shown


def test_the_fleets_four_numbers_weigh_each_task_by_its_traffic() -> None:
    from celery_lockguard import _stats as stats
    from celery_lockguard._page_state import fleet_sample

    now = 60 * 1_000_000 + 30.0
    minute = int(now // 60)
    fields = {
        "a|lock.acquired": "9", "a|lock.contended": "1", "a|lock.released": "9", "a|hold.count": "9",
        "a|hold.sum_ms": "900", "b|lock.acquired": "1", "b|lock.contended": "3", "b|lock.released": "0",
        "b|lock.expired_before_release": "1", "b|hold.count": "1", "b|hold.sum_ms": "10100",
    }  # fmt: skip
    raw = {"now": now, "total": {**fields, "@first_flush_at": str(now - 600)}, "minutes": {minute: fields}}
    sample = fleet_sample(stats.summarize(raw), now)
    assert sample.contention == pytest.approx(4 / 14)  # not the mean of 10% and 75%
    assert sample.avg_hold_ms == pytest.approx(11000 / 10)  # 1100 ms, not the mean of 100 and 10100
    assert sample.expired_rate == pytest.approx(1 / 10)
    assert sample.acquisition_rate == pytest.approx(10 * 60 / 90)  # the 1m window covers 90 s here
    empty = fleet_sample(stats.summarize({"now": now, "total": {}, "minutes": {}}), now)
    assert (empty.acquisition_rate, empty.contention, empty.avg_hold_ms, empty.expired_rate) == (None,) * 4


def test_an_hour_at_the_shortest_interval_keeps_one_sample_per_slot(page_app: Celery) -> None:
    """--page-interval 0.1 kept 36 001 samples, all drawn on each poll of /page/live (1.5 MB, ~150 ms a request)."""
    from celery_lockguard import _page_state as page_state
    from celery_lockguard._page_html import live
    from celery_lockguard._page_state import Sample

    state = PageState(page_app, settings(page_app), interval=0.1, doctor_interval=3600)
    for _ in range(5):  # back to back: one slot of the ring
        state.refresh()
    assert len(state.snapshot.samples) <= 2 and state.snapshot.samples[-1].at == state.snapshot.taken_at
    ring_points = page_state.RING_POINTS
    now = state.snapshot.taken_at
    state._ring.clear()
    for i in range(36_000, -1, -1):  # an hour at 0.1 s (the numbers are one-minute windows: they move slowly)
        state.remember(Sample(now - i * 0.1, 1.0 + i // 600, 0.1, 20.0, 0.0))
    ring = list(state._ring)
    assert ring_points - 1 <= len(ring) <= ring_points + 1
    assert ring[-1].at == now  # the latest sample is the ring's last: the value shown now
    assert all(b.at - a.at > 4.9 for a, b in itertools.pairwise(ring[:-1]))  # one per 5 s slot
    snap = replace(state.snapshot, samples=tuple(ring), taken_at=now)
    assert len(live(snap, now=now)) < 60_000
    assert len(state._samples_taken) <= 36_001  # the busy entities still count every sample of the hour


def test_a_snapshot_that_fails_to_render_answers_500_and_the_next_one_is_served(page_app: Celery) -> None:
    s = settings(page_app)
    state = PageState(page_app, s, interval=3600, doctor_interval=3600)
    state.refresh()
    good = state.snapshot
    server = exporter_server.serve(s, "127.0.0.1", 0, front=Front(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # A summary no stats.summarize() writes (a task without windows): rendering it fails.
        state._current = replace(good, summary={"tasks": {"broken": {}}})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url + "/page", timeout=10)
        assert failed.value.code == 500 and b"page failed: KeyError" in failed.value.read()
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:  # the server kept serving
            assert resp.status == 200
        state._current = good
        with urllib.request.urlopen(url + "/page", timeout=10) as resp:
            assert resp.status == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_late_sample_says_it_is_stale(page_app: Celery) -> None:
    from celery_lockguard._page_html import live

    state = PageState(page_app, settings(page_app), interval=1, doctor_interval=3600)
    state.refresh()
    snap = state.snapshot
    assert snap.stale_after == 3 * 1 + 4 * settings(page_app).socket_timeout
    assert 'class="state">ok<' in live(snap, now=snap.taken_at + 1)
    assert "stale: the last sample is 100s old" in live(snap, now=snap.taken_at + 100)
