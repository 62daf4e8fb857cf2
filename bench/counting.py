"""Round trips counted at the client, commands counted at the server.

*Round trips*: every write of a request to a socket by redis-py goes through
``AbstractConnection.send_packed_command`` (a single command, a whole
pipeline, a script call, kombu's BRPOP alike), and each is followed by a wait
for the reply. Counting its calls counts round trips as the client pays them.

*Values sent*: every command's arguments (its name, keys, values) pass
through the serializer's ``pack``; counting them shows how much a client
encodes per operation (redis-py's default serializer is pure Python).

*Server commands*: ``INFO commandstats`` deltas on a private server, where
nothing else runs. Commands that a Lua script calls are counted too, so a
script shows what it really costs the server.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from redis.connection import AbstractConnection, PythonRespSerializer

_lock = threading.Lock()
_sent = 0
_values = 0
_original_send = AbstractConnection.send_packed_command
_original_pack = PythonRespSerializer.pack
_installed = False


def _counting_send(self: Any, command: Any, check_health: bool = True) -> Any:
    global _sent
    with _lock:
        _sent += 1
    return _original_send(self, command, check_health)


def _counting_pack(self: Any, *args: Any) -> Any:
    global _values
    with _lock:
        _values += len(args)
    return _original_pack(self, *args)


def install() -> None:
    """Count every round trip of this process from now on (idempotent; survives fork)."""
    global _installed
    if not _installed:
        AbstractConnection.send_packed_command = _counting_send  # type: ignore[method-assign]
        PythonRespSerializer.pack = _counting_pack  # type: ignore[method-assign]
        _installed = True


def uninstall() -> None:
    global _installed
    if _installed:
        AbstractConnection.send_packed_command = _original_send  # type: ignore[method-assign]
        PythonRespSerializer.pack = _original_pack  # type: ignore[method-assign]
        _installed = False


def sent() -> int:
    """Round trips sent by this process since :func:`install`."""
    return _sent


def values() -> int:
    """Command arguments (name included) packed by this process since :func:`install`."""
    return _values


@contextlib.contextmanager
def counting() -> Iterator[list[int]]:
    """Count round trips inside the block; the single item of the yielded list is the count after it."""
    was_installed = _installed
    install()
    start = _sent
    box = [0]
    try:
        yield box
    finally:
        box[0] = _sent - start
        if not was_installed:
            uninstall()


def commandstats(client: Any) -> Counter[str]:
    """Calls per command on the server (``INFO commandstats``), without INFO itself."""
    info = client.info("commandstats")
    out: Counter[str] = Counter()
    for name, row in info.items():
        cmd = name.removeprefix("cmdstat_")
        if cmd in ("info", "config|resetstat", "config"):
            continue
        out[cmd] = int(row["calls"])
    return out


def script_usec(client: Any) -> tuple[int, int]:
    """(calls, total microseconds) the server spent in EVALSHA: a script's own server time."""
    row = client.info("commandstats").get("cmdstat_evalsha")
    return (int(row["calls"]), int(row["usec"])) if row else (0, 0)


def delta(after: Counter[str], before: Counter[str]) -> Counter[str]:
    """Per-command difference of two :func:`commandstats` readings (only positive entries)."""
    d = Counter(after)
    d.subtract(before)
    return Counter({k: v for k, v in d.items() if v > 0})
