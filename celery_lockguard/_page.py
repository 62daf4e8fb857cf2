"""``lockguard exporter --page``: a read-only lock page beside ``/metrics``, and the server's basic auth.

The exporter's handler asks :meth:`Front.answer` first on every GET or HEAD
(:mod:`celery_lockguard._exporter` answers any other method 405). The front:

* checks **basic auth** when credentials are configured (``--auth
  USER:PASSWORD`` or ``LOCKGUARD_PAGE_AUTH``), for every path the server
  serves, ``/metrics`` included: a request without them, or with others, is
  answered 401. The comparison is :func:`hmac.compare_digest` over the
  whole decoded ``user:password``, so its time does not tell how much of a
  guess was right; the credentials are never printed or logged.
* answers every path (the page, ``/metrics`` and ``/``) only to a loopback
  ``Host`` when the server listens on loopback (``localhost``,
  ``*.localhost``, ``127.0.0.0/8``, ``[::1]``, and the names given with
  ``--allow-host``), else ``403``. Loopback alone does not keep a web page
  out: with **DNS rebinding** a site the operator visits renames itself to
  127.0.0.1, and its script then reads ``/page/data.json`` or ``/metrics``
  as same-origin -- every task id, argument-bearing key and worker name. Its
  requests carry its own name in ``Host``; a browser cannot forge that.
  Prometheus sends its target's ``host:port`` as ``Host`` (``127.0.0.1:9808``,
  ``localhost:9808``: allowed); a target named otherwise (an ``/etc/hosts``
  alias of loopback) needs ``--allow-host NAME``. A request without ``Host``
  (HTTP/1.0, not a browser) is answered.
* serves the page (when enabled) under :data:`BASE`:

  ==========================  =================================================
  ``/page``                    the page (HTML)
  ``/page/live``               the part that updates, polled by the page's script
  ``/page/data.json``          the same data as JSON, for scripts
  ``/page/app.js``             the page's script
  ``/page/style.css``          the page's stylesheet
  ==========================  =================================================

Every answer carries a strict Content-Security-Policy (script, style and
fetches from this origin only, nothing inline, no frames, no forms, no
external resources), ``nosniff``, ``no-store`` and ``no-referrer``. Requests
render the sampler's latest snapshot (:mod:`celery_lockguard._page_state`),
never Redis directly; its status is the answer's (503: the lock Redis
unreachable; 500: a value the page could not read); a snapshot that fails to
*render* answers 500 and is logged, and the server keeps serving.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
from collections.abc import Callable, Iterable
from typing import Any

from . import _page_html as render
from ._events import logger
from ._page_state import PageState

#: Where the page lives on the exporter's port (``/`` and ``/metrics`` stay Prometheus text).
BASE = "/page"
#: The environment variable ``--auth`` falls back to (preferred: an option shows in ``ps``).
AUTH_ENV = "LOCKGUARD_PAGE_AUTH"
REALM = "lockguard"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
HTML, JS, CSS = "text/html; charset=utf-8", "text/javascript; charset=utf-8", "text/css; charset=utf-8"
JSON = "application/json"


def host_name(header: str | None) -> str | None:
    """The name in a ``Host`` header, lower-cased, without its port, brackets or trailing dot (None: no header)."""
    value = (header or "").strip().lower()
    if not value:
        return None
    if value.startswith("["):  # [::1]:9808
        return value[1 : value.find("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    if value.count(":") > 1:  # a bare IPv6 address (no brackets, so no port)
        name, sep, port = value, "", ""
    return (name if sep and port.isdigit() else value).rstrip(".")


def loopback_host(name: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761: browsers resolve it to loopback) or a loopback IP."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_credentials(value: str) -> tuple[str, str]:
    """``USER:PASSWORD`` split at its first colon; the error never quotes the value (it holds a password)."""
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("credentials must be USER:PASSWORD, both non-empty (the value given is not shown)")
    return user, password


class Front:
    """What the exporter's handler asks first: basic auth for every path, then the page's routes."""

    def __init__(
        self,
        state: PageState | None = None,
        credentials: tuple[str, str] | None = None,
        hosts: Iterable[str] | None = None,
    ) -> None:
        """``hosts``: None serves any ``Host`` (a server bound wider); else loopback names and these only."""
        self.state = state
        self._expected = f"{credentials[0]}:{credentials[1]}".encode() if credentials else None
        self._hosts = None if hosts is None else frozenset(h.lower().rstrip(".") for h in hosts)
        self._routes: dict[str, Callable[[], tuple[int, str, bytes]]] = (
            {
                BASE: self._page,
                BASE + "/": self._page,
                BASE + "/live": self._live,
                BASE + "/data.json": self._data,
                BASE + "/app.js": lambda: (200, JS, render.SCRIPT.encode()),
                BASE + "/style.css": lambda: (200, CSS, render.STYLE.encode()),
            }
            if state is not None
            else {}
        )

    def authorized(self, header: str | None) -> bool:
        """True without configured credentials, else only for ``Basic`` with exactly them."""
        if self._expected is None:
            return True
        scheme, _, encoded = (header or "").strip().partition(" ")
        try:
            given = base64.b64decode(encoded.strip(), validate=True) if scheme.lower() == "basic" else b""
        except (binascii.Error, ValueError):
            given = b""
        return hmac.compare_digest(given, self._expected)

    def host_allowed(self, header: str | None) -> bool:
        """True for any ``Host`` when not restricted, for none at all (not a browser), else for loopback names."""
        if self._hosts is None:
            return True
        name = host_name(header)
        return name is None or name in self._hosts or loopback_host(name)

    def answer(self, handler: Any) -> bool:
        """Answer ``handler``'s request if it is the front's to answer (401, or a page route); else False."""
        if not self.authorized(handler.headers.get("Authorization")):
            body = b"authentication required\n"
            send(handler, 401, "text/plain; charset=utf-8", body, (("WWW-Authenticate", f'Basic realm="{REALM}"'),))
            return True
        if not self.host_allowed(handler.headers.get("Host")):  # every path: /metrics names tasks and workers too
            body = b"this server answers to loopback names only (add yours with --allow-host)\n"
            send(handler, 403, "text/plain; charset=utf-8", body)
            return True
        route = self._routes.get(handler.path.split("?", 1)[0])
        if route is None:
            return False
        if self.state is not None and route in (self._page, self._live, self._data):
            self.state.viewed()  # someone looks: the sampler reads leases (the first view waits for a sample)
        try:
            code, ctype, body = route()
        except Exception as exc:  # noqa: BLE001 - one bad render answers 500; the next request renders again
            logger.warning("page.render_failed", reason=f"{exc.__class__.__name__}: {exc}")
            code, ctype = 500, "text/plain; charset=utf-8"
            body = f"page failed: {exc.__class__.__name__} (see the exporter's log)\n".encode()
        send(handler, code, ctype, body)
        return True

    # -- routes -------------------------------------------------------------------------

    def _page(self) -> tuple[int, str, bytes]:
        assert self.state is not None
        snap = self.state.snapshot
        return snap.status, HTML, render.page(snap, self.state.settings.redis_url, BASE).encode()

    def _live(self) -> tuple[int, str, bytes]:
        assert self.state is not None
        snap = self.state.snapshot
        return snap.status, HTML, render.live(snap).encode()

    def _data(self) -> tuple[int, str, bytes]:
        assert self.state is not None
        snap = self.state.snapshot
        # ASCII only and no NaN: strict JSON whatever a value holds.
        return snap.status, JSON, json.dumps(snap.as_dict(), ensure_ascii=True, allow_nan=False, default=str).encode()


def send(handler: Any, code: int, ctype: str, body: bytes, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """One complete answer with the security headers (the exporter drops the body of a HEAD)."""
    handler.send_response(code)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (*SECURITY_HEADERS, *extra):
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(body)
