"""Reading a scope's completion record and checkpoints for ``lockguard completions show``.

From either store (Redis or PostgreSQL), one view: the record, its TTL, the
checkpoints and theirs. Records and checkpoints are JSON the library wrote
(``_completion.encode_record``: an object with ``task_id`` and ``result``; a
checkpoint ``{"value": ...}`` or ``{"novalue": true}``), but anyone with
write access can plant something else: a JSON list or a scalar, text that is
not JSON, or 100 000 nested brackets (which made ``json.loads`` raise
``RecursionError``). :func:`decode` keeps what it cannot read as the raw
text, and :func:`show_lines` prints any of it as one escaped, bounded line.
"""

from __future__ import annotations

import json
from typing import Any

from ._keys import checkpoint_name, done_name
from ._terminal import duration, printable

#: Deepest JSON a record or checkpoint may nest and still be decoded (the library writes depth 2-3
#: plus the task's result; json's own limit is about 1000, and the CLI's indented output recurses in Python).
MAX_DEPTH = 64
#: Longest value shown in the text output (characters); the JSON output carries all of it.
MAX_SHOWN_VALUE = 2000


def _depth(value: Any) -> int:
    """How deep ``value`` nests (iteratively: a deep value must not exhaust the stack here either)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def decode(value: str) -> Any:
    """``value`` as JSON if it is JSON nested at most :data:`MAX_DEPTH` deep, else the text itself."""
    try:
        decoded = json.loads(value)
    except (ValueError, RecursionError):
        return value
    return value if _depth(decoded) > MAX_DEPTH else decoded


def show_redis(client: Any, prefix: str, scope: str) -> dict[str, Any] | None:
    """The view of ``scope`` in Redis (one pipeline), or None when nothing is recorded."""
    pipe = client.pipeline(transaction=False)
    pipe.get(done_name(prefix, scope))
    pipe.pttl(done_name(prefix, scope))
    pipe.hgetall(checkpoint_name(prefix, scope))
    pipe.pttl(checkpoint_name(prefix, scope))
    record, record_ttl, cps, cp_ttl = pipe.execute(raise_on_error=False)
    if isinstance(record, Exception):  # a planted key of the wrong type: show what it is, do not crash
        record = f"<unreadable record: {str(record).split(' ', 1)[0]}>"
    if isinstance(cps, Exception):
        cps = {"<unreadable>": f"<unreadable checkpoints: {str(cps).split(' ', 1)[0]}>"}
    if record is None and not cps:
        return None
    return {
        "scope": scope,
        "store": "redis",
        "record": decode(record) if record is not None else None,
        "record_ttl_ms": record_ttl if record is not None and isinstance(record_ttl, int) else None,
        "checkpoints": {k: decode(v) for k, v in sorted(cps.items())},
        "checkpoints_ttl_ms": cp_ttl if cps and isinstance(cp_ttl, int) else None,
    }


def show_postgres(store: Any, scope: str) -> dict[str, Any] | None:
    """The view of ``scope`` in a :class:`~celery_lockguard._completion.PostgresStore`, or None."""
    rows = store.entries(scope)
    if not rows:
        return None
    record = next((r for r in rows if r[0] == ""), None)
    cps = {r[0][3:]: decode(r[1]) for r in rows if r[0].startswith("cp:")}
    cp_ttl = max((r[2] for r in rows if r[0].startswith("cp:")), default=None)
    return {
        "scope": scope,
        "store": f"postgresql ({store.table}, namespace {store.namespace})",
        "record": decode(record[1]) if record else None,
        "record_ttl_ms": record[2] if record else None,
        "checkpoints": cps,
        "checkpoints_ttl_ms": cp_ttl,
    }


def _shown(value: Any) -> str:
    """One value as a bounded, escaped line of JSON (text that did not decode shows as a JSON string)."""
    return printable(json.dumps(value), MAX_SHOWN_VALUE)


def show_lines(found: dict[str, Any]) -> list[str]:
    """The text of ``completions show``: the record's line, then one line per checkpoint."""
    scope, rec = printable(found["scope"]), found["record"]
    lines = []
    if isinstance(rec, dict):
        lines.append(
            f"{scope}: completed by {printable(str(rec.get('task_id')))} -> {_shown(rec.get('result'))} "
            f"(kept {duration(found['record_ttl_ms'])} more)"
        )
    elif rec is not None:
        lines.append(f"{scope}: a record no worker writes (not a JSON object): {_shown(rec)}")
    else:
        lines.append(f"{scope}: no completion record")
    for name, value in found["checkpoints"].items():
        if value == {"novalue": True}:
            shown = "done, no value"
        elif isinstance(value, dict) and "value" in value:
            shown = _shown(value["value"])
        else:
            shown = f"(not a checkpoint) {_shown(value)}"
        lines.append(f"  checkpoint {printable(name)}: {shown}")
    return lines
