"""Completion records and checkpoints in Redis.

A completion record says "the work of scope S ran and returned R". It is
written by the RELEASE script and read by the ACQUIRE script, so it costs no
round trip of its own. Checkpoints are per (scope, name) entries of one hash
beside the record, written right after the wrapped call returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .keys import checkpoint_name

#: Largest JSON result kept in a completion record; larger results record ``None``.
MAX_RECORD_BYTES = 1024

_NO_VALUE = '{"novalue":true}'


def encode_record(task_id: str, result: Any) -> tuple[str, str | None]:
    """The record for a successful body, and why the result was dropped (or ``None``)."""
    try:
        value = json.dumps(result, separators=(",", ":"))
    except (TypeError, ValueError):
        return json.dumps({"task_id": task_id, "result": None}), "result is not JSON-serializable"
    if len(value.encode()) > MAX_RECORD_BYTES:
        return json.dumps({"task_id": task_id, "result": None}), f"result larger than {MAX_RECORD_BYTES} bytes"
    return f'{{"task_id":{json.dumps(task_id)},"result":{value}}}', None


def decode_record(record: str) -> tuple[str | None, Any]:
    """``(task id that completed, recorded result)`` of a record."""
    data = json.loads(record)
    return data.get("task_id"), data.get("result")


class CheckpointNotSerializable(TypeError):
    """``fn`` returned a value JSON cannot hold; the step is recorded as done with no value."""


def checkpoint(
    client: Any,
    prefix: str,
    scope: str,
    name: str,
    ttl_ms: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``fn`` once per (scope, name); replay the recorded JSON value afterwards.

    The value returned is always the JSON round trip of ``fn``'s result, so the
    first run and a replay see the same thing.
    """
    key = checkpoint_name(prefix, scope)
    stored = client.hget(key, name)
    if stored is not None:
        return json.loads(stored).get("value")
    value = fn(*args, **kwargs)
    try:
        encoded = json.dumps({"value": value}, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        _store(client, key, name, _NO_VALUE, ttl_ms)
        raise CheckpointNotSerializable(
            f"checkpoint {name!r} of scope {scope!r}: result {type(value).__name__} is not JSON-serializable; "
            "recorded as done with no value so a retry will not repeat it"
        ) from exc
    _store(client, key, name, encoded, ttl_ms)
    return json.loads(encoded)["value"]


def _store(client: Any, key: str, name: str, encoded: str, ttl_ms: int) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, name, encoded)
    pipe.pexpire(key, ttl_ms)
    pipe.execute()
