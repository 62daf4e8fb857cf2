"""Credentials out of every message: Redis URLs, PostgreSQL DSNs, and errors that quote them.

A secret reaches an operator's screen (and the logs, and a CI transcript)
by three roads, each closed here:

* a connection string printed as configured. It is shown only as its own
  library reads it: a Redis URL through redis-py's ``parse_url``, a libpq
  URL or keyword DSN through psycopg's ``conninfo_to_dict``, with every
  secret-bearing key masked (``password``, ``ssl_password``,
  ``sslpassword``, also when the key is percent-encoded: redis-py and libpq
  decode ``pass%77ord`` to ``password``). A string its parser refuses is
  never echoed, not even in part: :data:`UNPARSED` stands in for it (a
  regular expression cannot know where libpq thinks an unquoted password
  with a space in it ends);
* a setting refused for its scheme (``postgressql://u:pw@h/db``), whose
  error would quote the value: the same function shows it;
* an error raised while connecting: libpq quotes a part of the DSN it cannot
  parse (``missing "=" after "cret"``). :func:`redact_text` masks every
  secret the given DSNs carry, and withholds a message about a DSN that does
  not parse.

Every surface (CLI, exporter, page, doctor, logs) goes through :func:`redact`
for a connection string and :func:`redact_text` for any other text.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

MASK = "***"
#: Shown instead of a connection string its library refuses to parse.
UNPARSED = "<connection string not shown: it does not parse>"
#: Shown instead of a message about a connection string that does not parse (it may quote any part of it).
WITHHELD = "<message withheld: it may quote a connection string that does not parse>"

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_PG_SCHEMES = ("postgresql://", "postgres://")
#: A key whose value is a secret, matched on the decoded, lower-cased key name.
_SECRET_KEY = re.compile(r"pass|secret|token|credential|auth")
#: ``key=value`` in free text (a query string, a keyword DSN quoted in a message); the key may be percent-encoded.
_KEYWORD = re.compile(r"([A-Za-z0-9_.%\-]+)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;'\"]*)")
#: Between two URLs of a failover list (``;`` or ``,``, as kombu writes it): split there, show each.
_LIST_SEP = re.compile(r"(\s*[;,]\s*)(?=[a-z][a-z0-9+.\-]*://)", re.I)
#: A URL's scheme at the start of a string.
_SCHEME = re.compile(r"[a-z][a-z0-9+.\-]*://", re.I)
#: Something URL-shaped in free text.
_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s'\"<>`]*")


def is_secret_key(key: str) -> bool:
    """Whether a connection option named ``key`` (as written, possibly percent-encoded) carries a secret."""
    return bool(_SECRET_KEY.search(unquote(key).lower()))


def redact(url: object) -> str:
    """``url`` (a Redis URL, a PostgreSQL URL or keyword DSN) as its library parses it, every secret masked.

    Empty and ``None`` are shown as they are, and a word that cannot carry a
    credential (``redis``, a bare host name) as written; anything else that
    its parser refuses becomes :data:`UNPARSED`. A list or tuple (Celery
    accepts ``broker_url`` as one) is shown element by element; any other
    value that is no string is :data:`UNPARSED` (its ``str`` may hold a
    secret no parser saw).
    """
    if url is None or url == "":
        return str(url)
    if isinstance(url, (list, tuple)):
        return "[" + ", ".join(redact(each) for each in url) + "]"
    if isinstance(url, bool | int | float):
        return str(url)
    if not isinstance(url, str):
        return UNPARSED
    text = url
    try:
        shown = _display(text)
    except Exception:  # noqa: BLE001 - any parser failure: the string is not shown
        return UNPARSED
    return shown if shown is not None else UNPARSED


def _display(text: str) -> str | None:
    parts = _LIST_SEP.split(text.strip())
    if len(parts) > 1:  # a failover list (``redis://h1/0;redis://:pw@h2/0``): each URL shown as parsed
        each = [_display(part) for part in parts[::2]]
        if any(one is None for one in each):
            return None
        return "".join(f"{one}{sep}" for one, sep in zip(each, [*parts[1::2], ""], strict=True))
    low = text.strip().lower()
    if low.startswith(_REDIS_SCHEMES):
        from redis.connection import parse_url

        parse_url(text)  # what redis-py would refuse is not shown
        shown = _url(text, set())
        if low.startswith(("redis://", "rediss://")):  # the path is a db number; anything else is masked
            path = urlsplit(text.strip()).path
            if not re.fullmatch(r"/?\d*", path):
                shown = shown.replace(path, "/" + MASK, 1) if path else shown
        return shown
    if low.startswith(_PG_SCHEMES):
        return _url(text, _libpq_secrets(text))
    if "://" in text:  # another scheme (a mistyped one, a broker URL): the standard URL parser
        if not _SCHEME.match(text.strip()):  # ``://`` not after a scheme: the parser would see no userinfo
            return None
        return _url(text, set())
    if "=" in text:
        conninfo = _conninfo(text)
        return " ".join(f"{k}={MASK if is_secret_key(k) else _dsn_value(v)}" for k, v in sorted(conninfo.items()))
    if re.fullmatch(r"[\w.\-]*", text):  # one word: no key, no userinfo, nothing secret
        return text
    return None


def _conninfo(dsn: str) -> dict[str, Any]:
    """libpq's own reading of ``dsn`` (psycopg's ``conninfo_to_dict``); raises if libpq refuses it."""
    from psycopg.conninfo import conninfo_to_dict

    return {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}


def _libpq_secrets(dsn: str) -> set[str]:
    """The secret values libpq reads from ``dsn`` (empty where psycopg is not installed)."""
    try:
        conninfo = _conninfo(dsn)
    except ImportError:
        return set()
    return {str(v) for k, v in conninfo.items() if is_secret_key(k) and v}


def _dsn_value(value: object) -> str:
    text = str(value)
    if text and re.fullmatch(r"[^\s'\\]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _url(text: str, secrets: set[str]) -> str:
    """``text`` rebuilt from its parsed parts: the userinfo password, secret keys and ``secrets`` masked."""
    parts = urlsplit(text.strip())
    parts.port  # noqa: B018 - raises ValueError for a port that is no number
    userinfo = ""
    if parts.username is not None or parts.password is not None:
        userinfo = quote(unquote(parts.username or ""), safe="")
        userinfo += f":{MASK}@" if parts.password is not None else "@"
    hostport = parts.netloc.rpartition("@")[2]
    query = "&".join(
        f"{quote(k, safe='_-.')}={MASK if is_secret_key(k) or v in secrets else quote(v, safe='/:,_-.')}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return f"{parts.scheme}://{userinfo}{hostport}{parts.path}" + (f"?{query}" if query else "")


def passwords(dsn: object) -> list[str] | None:
    """Every secret ``dsn`` carries, decoded and as written (longest first); ``None`` if it does not parse."""
    if not dsn:
        return []
    text = str(dsn)
    if redact(text) == UNPARSED:
        return None
    found: set[str] = set()
    listed = _LIST_SEP.split(text.strip())
    if len(listed) > 1:  # a failover list: the secrets of each URL
        for part in listed[::2]:
            found |= set(passwords(part) or [])
        return sorted((p for p in found if p), key=len, reverse=True)
    low = text.strip().lower()
    if "://" in text:
        parts = urlsplit(text.strip())
        if parts.password:
            found |= {parts.password, unquote(parts.password)}
        for raw in parts.query.split("&"):
            key, _, value = raw.partition("=")
            if is_secret_key(key) and value:
                found |= {value, unquote(value), unquote(value.replace("+", " "))}
    if low.startswith(_PG_SCHEMES) or "://" not in text:
        try:
            found |= _libpq_secrets(text)
        except Exception:  # noqa: BLE001 - redact() above already parsed it; nothing more to learn
            pass
    return sorted((p for p in found if p), key=len, reverse=True)


def redact_text(text: object, *dsns: object) -> str:
    """``text`` with every secret of ``dsns`` masked, and every URL or ``key=value`` secret in it masked.

    If one of ``dsns`` does not parse, the whole text is :data:`WITHHELD`:
    the error is about that string and may quote any part of it.
    """
    out = str(text)
    for dsn in dsns:
        secrets = passwords(dsn)
        if secrets is None:
            return WITHHELD
        for secret in secrets:
            out = out.replace(secret, MASK)
    out = _URL.sub(lambda m: _url_in_text(m.group(0)), out)
    return _KEYWORD.sub(_mask_keyword, out)


def _mask_keyword(m: re.Match[str]) -> str:
    return f"{m.group(1)}{m.group(2)}{MASK}" if is_secret_key(m.group(1)) else m.group(0)


def _url_in_text(found: str) -> str:
    tail = ""
    while found and found[-1] in ".,;:)]}":  # sentence punctuation after the URL
        found, tail = found[:-1], found[-1] + tail
    return redact(found) + tail
