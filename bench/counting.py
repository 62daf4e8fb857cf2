"""Round trips counted at the client, commands counted at the server.

*Round trips*: every write of a request to a socket by redis-py goes through
``AbstractConnection.send_packed_command`` (a single command, a whole
pipeline, a script call, kombu's BRPOP alike), and each is followed by a wait
for the reply. Counting its calls counts round trips as the client pays them.

*Values sent*: every command's arguments (its name, keys, values) pass
through the serializer's ``pack``; counting them shows how much a client
encodes per operation (redis-py's default serializer is pure Python).
lockguard may pack its lease scripts itself (``celery_lockguard._wire.pack_evalsha``,
bypassing redis-py's packer): where that function exists its values are
counted too (``EVALSHA``, the sha, numkeys, keys, args), the same way.

*Deferred sends*: the runtime may hand a command to the connection without
waiting for its reply (RELEASE: the reply is read later, with the next command
on that connection or by a background thread). Such sends go through
``celery_lockguard._wire.Channel.defer``; counting the calls that leave a reply in flight (the
channel waits for it itself where its server is near) beside the sends
gives *round trips waited* = sends - deferred. Where that method does not
exist (a runtime that defers nothing), deferred is 0.

*Held commands* (``Channel.hold``, a ``CONFIRM_CLAIM`` after a publish) go out
in the channel's next write, beside another command, or alone within 20 ms:
each counts as one command sent and deferred when it is held, and the write
that carries it alone is not counted again. A held command is a command on the
server like any other; what it saves is a write of its own, which shows in
time, not in these counts.

*Server commands*: ``INFO commandstats`` deltas on a private server, where
nothing else runs. Commands that a Lua script calls are counted too, so a
script shows what it really costs the server.
"""

from __future__ import annotations

import contextlib
import importlib
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
_deferred = 0
#: ``(Channel class, its own defer)`` once wrapped, so :func:`uninstall` can put it back.
_original_defer: tuple[Any, Any] | None = None
#: ``(Channel class, its own hold, its own _write_held)`` once wrapped.
_original_hold: tuple[Any, Any, Any] | None = None
#: ``(the _wire module, its own pack_evalsha)`` once wrapped.
_original_pack_evalsha: tuple[Any, Any] | None = None


#: Sends of lockguard's renewer thread (its ticks: per held lease per ~ttl/3, not per task; section 4).
RENEWER_THREAD = "lockguard-renewer"
_background = 0


#: Set on a thread while it writes held commands alone (counted already when they were held).
_quiet = threading.local()


def _counting_send(self: Any, command: Any, check_health: bool = True) -> Any:
    global _sent, _background
    if getattr(_quiet, "on", False):
        return _original_send(self, command, check_health)
    with _lock:
        _sent += 1
        if threading.current_thread().name == RENEWER_THREAD:
            _background += 1
    return _original_send(self, command, check_health)


def _counting_pack(self: Any, *args: Any) -> Any:
    global _values
    with _lock:
        _values += len(args)
    return _original_pack(self, *args)


def _channel_class() -> Any:
    """``celery_lockguard._wire.Channel`` if the runtime has it with a ``defer`` method, else ``None``.

    Why a lookup and not an import: the bench measures whichever runtime is checked
    out, with or without deferred sends; an absent module, class or method means
    nothing is deferred.
    """
    try:
        wire = importlib.import_module("celery_lockguard._wire")
    except ImportError:
        return None
    cls = getattr(wire, "Channel", None)
    return cls if cls is not None and callable(getattr(cls, "defer", None)) else None


def _wrap_pack() -> None:
    """Count the values of lockguard's own EVALSHA packer, if the runtime has one.

    Why: a client that packs its scripts itself would otherwise show 0 values sent.
    The wrapper is set on the module, where the runtime's callers look the name up.
    """
    global _original_pack_evalsha
    wire: Any
    try:
        wire = importlib.import_module("celery_lockguard._wire")
    except ImportError:
        return
    original = getattr(wire, "pack_evalsha", None)
    if original is None or _original_pack_evalsha is not None:
        return

    def counting_pack_evalsha(sha: Any, keys: Any, args: Any) -> Any:
        global _values
        with _lock:
            _values += 3 + len(keys) + len(args)
        return original(sha, keys, args)

    wire.pack_evalsha = counting_pack_evalsha
    _original_pack_evalsha = (wire, original)


def _wrap_defer() -> None:
    """Count calls of ``Channel.defer`` (a send whose reply is not waited for), if it exists."""
    global _original_defer
    cls = _channel_class()
    if cls is None or _original_defer is not None:
        return
    original = cls.__dict__.get("defer", cls.defer)

    def counting_defer(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Only a send left in flight counts: the channel waits for the reply itself where that is cheaper
        # (its ``deferred`` counter then stays put).
        global _deferred
        before = getattr(self, "deferred", None)
        try:
            return original(self, *args, **kwargs)
        finally:
            if before is None or getattr(self, "deferred", None) != before:
                with _lock:
                    _deferred += 1

    counting_defer.__doc__ = getattr(original, "__doc__", None)
    cls.defer = counting_defer
    _original_defer = (cls, original)


def _wrap_hold() -> None:
    """Count ``Channel.hold`` calls as commands sent and deferred; the write that carries them alone is not."""
    global _original_hold
    cls = _channel_class()
    if cls is None or _original_hold is not None or not callable(getattr(cls, "hold", None)):
        return
    hold, write_held = cls.__dict__["hold"], cls.__dict__["_write_held"]

    def counting_hold(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _sent, _deferred
        before = self.held
        try:
            return hold(self, *args, **kwargs)
        finally:
            if self.held != before:  # held (else it went through defer, counted there)
                with _lock:
                    _sent += 1
                    _deferred += 1

    def quiet_write_held(self: Any, *args: Any, **kwargs: Any) -> Any:
        _quiet.on = True
        try:
            return write_held(self, *args, **kwargs)
        finally:
            _quiet.on = False

    cls.hold, cls._write_held = counting_hold, quiet_write_held
    _original_hold = (cls, hold, write_held)


def install() -> None:
    """Count every round trip of this process from now on (idempotent; survives fork)."""
    global _installed
    if not _installed:
        AbstractConnection.send_packed_command = _counting_send  # type: ignore[method-assign]
        PythonRespSerializer.pack = _counting_pack  # type: ignore[method-assign]
        _wrap_defer()
        _wrap_hold()
        _wrap_pack()
        _installed = True


def uninstall() -> None:
    """Put redis-py's (and the runtime's) own methods back: what follows is not counted."""
    global _installed, _original_defer, _original_pack_evalsha, _original_hold
    if _installed:
        if _original_hold is not None:
            cls, hold, write_held = _original_hold
            cls.hold, cls._write_held = hold, write_held
            _original_hold = None
        AbstractConnection.send_packed_command = _original_send  # type: ignore[method-assign]
        PythonRespSerializer.pack = _original_pack  # type: ignore[method-assign]
        if _original_defer is not None:
            cls, original = _original_defer
            cls.defer = original
            _original_defer = None
        if _original_pack_evalsha is not None:
            wire, pack = _original_pack_evalsha
            wire.pack_evalsha = pack
            _original_pack_evalsha = None
        _installed = False


def sent() -> int:
    """Round trips sent by this process since :func:`install`."""
    return _sent


def background() -> int:
    """Sends of this process's renewer thread since :func:`install` (included in :func:`sent`).

    Why apart: a renewer tick that happens to find a lease held is time-driven, not
    task-driven; per-task figures leave it out and report it on its own.
    """
    return _background


def deferred() -> int:
    """Sends of this process since :func:`install` whose reply was not waited for (``Channel.defer``)."""
    return _deferred


def waited() -> int:
    """Round trips this process waited for: sends minus deferred sends."""
    return _sent - _deferred


def values() -> int:
    """Command arguments (name included) packed by this process since :func:`install`."""
    return _values


@contextlib.contextmanager
def counting() -> Iterator[list[int]]:
    """Count round trips inside the block: the yielded list is ``[sent, deferred]`` after it.

    ``box[0]`` is every command sent (the figure the ``<= 2`` check reads); ``box[1]``
    the deferred ones among them, so ``box[0] - box[1]`` is round trips waited.
    """
    was_installed = _installed
    install()
    start, start_deferred = _sent, _deferred
    box = [0, 0]
    try:
        yield box
    finally:
        box[0] = _sent - start
        box[1] = _deferred - start_deferred
        if not was_installed:
            uninstall()


def commandstats(client: Any, *more: Any) -> Counter[str]:
    """Calls per command on the server (``INFO commandstats``), without INFO itself.

    With ``more`` clients (the masters of a cluster beside the broker), their counts are
    summed in: one figure for all the servers a task talks to.
    """
    out: Counter[str] = Counter()
    for c in (client, *more):
        info = c.info("commandstats")
        for name, row in info.items():
            cmd = name.removeprefix("cmdstat_")
            if cmd in ("info", "config|resetstat", "config", "cluster|info", "cluster|slots", "cluster|shards"):
                continue
            out[cmd] += int(row["calls"])
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
