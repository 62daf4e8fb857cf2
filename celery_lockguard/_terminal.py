"""What the operator's terminal shows: text from Redis made safe, tables, durations, counts.

Task ids, task names, worker names and entity keys arrive from message bodies
and headers that anyone with broker access can write, and from keys anyone
with Redis access can plant. Printed raw, an escape sequence rewrites the
terminal and a newline forges a row of ``lockguard locks`` or a line of a
confirmation prompt. Every text output and every log field goes through
:func:`printable` first.

The rule: a character that ``str.isprintable`` refuses (control characters,
line and paragraph separators, format characters such as U+202E, which
reverses the text after it, lone surrogates) is written as its Python escape
(``\\x1b``, ``\\n``, ``\\u202e``); a surrogate that stands for an undecodable
byte (``surrogateescape``, how the operator client reads non-UTF-8 keys) is
written as that byte, ``\\xff``. Backslashes are left alone, so printable
text (Windows paths, regexes) reads as it is stored. Text longer than
``limit`` keeps its head and says how much was cut.
"""

from __future__ import annotations

#: Longest id or name a log line or a table cell carries by default; longer text is cut (say how much).
MAX_SHOWN = 256


def _escape(c: str) -> str:
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: an undecodable byte, shown as that byte
        return f"\\x{code - 0xDC00:02x}"
    if c == "\n":
        return "\\n"
    if c == "\r":
        return "\\r"
    if c == "\t":
        return "\\t"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object, limit: int | None = MAX_SHOWN) -> str:
    """``value`` as text with every non-printable character escaped, cut to ``limit`` characters (None: no cut)."""
    text = value if isinstance(value, str) else str(value)
    cut = 0
    if limit is not None and len(text) > limit:
        cut, text = len(text) - limit, text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _escape(c) for c in text)
    return f"{text}...[{cut} more]" if cut else text


def entity(value: object, limit: int | None = MAX_SHOWN) -> str:
    """An entity key as :func:`printable` shows it, and beside a key with non-ASCII text its ASCII spelling.

    Keys are rendered in NFC (``_keys``), but two keys can still look alike and differ: a Cyrillic
    U+0430 for a Latin ``a``, or a key written before NFC rendering (``cafe`` and U+0301 beside ``caf``
    and U+00E9). The operator sees ``caf\\xe9`` and ``cafe\\u0301`` in brackets after each, so two rows
    that look alike read apart; the key as stored stays on the left, to copy into ``release``.
    Likewise a key whose spaces a table's padding or a browser would hide (leading, trailing or repeated:
    ``acct:1 `` beside ``acct:1``, ``acct:  2`` beside ``acct: 2``): its brackets spell every space ``\\x20``.
    Likewise a key with a backslash or a character :func:`printable` escapes: ``inv:1`` and U+200B
    and the literal text ``inv:1\\u200b`` both show ``inv:1\\u200b``, but their brackets spell the
    first ``inv:1\\u200b`` and the second ``inv:1\\\\u200b`` (a backslash spelled ``\\\\``).
    """
    text = value if isinstance(value, str) else str(value)
    shown = printable(text, limit)
    kept = text if limit is None else text[:limit]
    spaces = kept != kept.strip(" ") or "  " in kept
    if kept.isascii() and kept.isprintable() and "\\" not in kept and not spaces:
        return shown
    spelled = "".join(
        "\\\\" if c == "\\" else c if c.isascii() and c.isprintable() and not (spaces and c == " ") else _escape(c)
        for c in kept
    )
    cut = len(text) - len(kept)
    return f"{shown} [{spelled}{f'...[{cut} more]' if cut else ''}]"


def plural(n: int, singular: str, many: str | None = None) -> str:
    """``"1 lease"``, ``"2 leases"``: the count and the noun that agrees with it."""
    return f"{n} {singular if n == 1 else (many or singular + 's')}"


def duration(ms: float | None) -> str:
    """A span in ms as an operator reads it: ``12.4s``, ``3.0m``, ``2.5h``; ``-`` when unknown."""
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; every cell passed through :func:`printable`."""
    cells = [[printable(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)
