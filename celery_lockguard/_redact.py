"""Credentials out of every message: Redis URLs, PostgreSQL DSNs, and errors that quote them.

A password reaches an operator's screen (and the logs, and a CI transcript)
by three roads, each closed here:

* a URL printed as configured: ``redis://:pw@host`` and the query form
  ``redis://host/0?password=pw`` (redis-py and libpq both read it), and a
  libpq keyword DSN ``host=h password=pw``;
* a setting refused for its scheme (``postgressql://u:pw@h/db``), whose
  error would quote the value;
* an error raised while connecting: libpq quotes a part of the DSN it cannot
  parse (``invalid percent-encoded token: "p%ZZw"``).

:func:`redact` rewrites a URL or DSN; :func:`redact_text` removes every
password found in the given DSNs from any text, whatever quoted it.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit

MASK = "***"

#: ``password=...`` in a query string or a libpq keyword DSN (quoted or bare value).
_KEYWORD = re.compile(r"(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;]*)")
#: ``scheme://user:password@``, also where urlsplit gives up (a mistyped scheme, a bad port).
_USERINFO = re.compile(r"(?i)([a-z][a-z0-9+.\-]*://[^/@:\s]*:)([^\s/]*)(@)")


def redact(url: object) -> str:
    """``url`` (a Redis URL, a PostgreSQL URL or keyword DSN, anything) with every password masked."""
    if not url:
        return str(url)
    text = str(url)
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)
    return _KEYWORD.sub(lambda m: f"{m.group(1)}{MASK}", text)


def passwords(dsn: object) -> list[str]:
    """Every password ``dsn`` carries, as written and percent-decoded (longest first)."""
    if not dsn:
        return []
    text = str(dsn)
    found = [m.group(2) for m in _USERINFO.finditer(text)]
    found += [m.group(2).strip("'") for m in _KEYWORD.finditer(text)]
    try:
        parts = urlsplit(text)
        if parts.password:
            found.append(parts.password)
        found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() == "password"]
    except ValueError:  # an unparsable port: the regexes above already looked
        pass
    found += [unquote(p) for p in found]
    return sorted({p for p in found if p}, key=len, reverse=True)


def redact_text(text: object, *dsns: object) -> str:
    """``text`` with the passwords of ``dsns`` masked wherever they appear, and any URL in it redacted."""
    out = str(text)
    for secret in (p for dsn in dsns for p in passwords(dsn)):
        out = out.replace(secret, MASK)
    return redact(out)
