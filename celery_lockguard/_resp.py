"""Replies of a lease channel's connection, read straight from its socket (RESP2 and RESP3).

redis-py's pure-Python parser reads a reply line by line through a buffer
object (a ``readline``, ``seek`` and ``tell`` per element, a frame per nested
value): for the few short replies a locked task reads, that costs more CPU
than the script takes on the server. A :class:`Reader` parses what one
``recv`` brought in a single pass over the bytes, and returns exactly what
redis-py's reader would: the same values (decoded as the client decodes), the
same exception classes for error replies (from the connection's own parser,
so ``NOSCRIPT`` is a ``NoScriptError``), ``TimeoutError`` and
``ConnectionError`` for the socket.

Only for a connection nobody else reads (a :class:`~celery_lockguard._wire.Channel`'s):
redis-py's parser reads the handshake when the connection is made, this one
everything after it; the two never share bytes, because the handshake's
replies are read whole before the first lease command goes out.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

#: Bytes asked of the socket per ``recv`` (redis-py's default read size).
READ_SIZE = 65536


#: What a RESP3 push frame (an invalidation, a server notice) parses to: skipped, as redis-py's reader
#: hands it to a push handler and reads on for the reply.
_PUSH: Any = object()


class _Short(Exception):
    """The buffer ends inside the reply: more bytes are needed."""


class Reader:
    """Reads the replies of one connection, in order; its buffer follows the connection's socket."""

    def __init__(self, conn: Any) -> None:
        encoder = conn.encoder
        self._decode = bool(encoder.decode_responses)
        self._encoding = encoder.encoding
        self._errors = encoder.encoding_errors
        self._parse_error = conn._parser.parse_error
        self._sock: Any = None
        self._buf = b""
        self._pos = 0

    def read(self, conn: Any) -> Any:
        """The next reply on ``conn``; an error reply is *returned* as its exception (as redis-py raises it).

        Raises ``TimeoutError`` / ``ConnectionError`` when the socket does (the caller closes the
        connection), and ``ConnectionError`` subclasses the server answers with (``LOADING``), as
        redis-py does.
        """
        sock = conn._sock
        if sock is None:
            raise RedisConnectionError("Connection closed by server.")
        if sock is not self._sock:  # a new connection: nothing buffered belongs to it
            self._sock, self._buf, self._pos = sock, b"", 0
        buf, pos = self._buf, self._pos
        while True:
            if pos < len(buf):
                try:
                    value, pos = self._parse(buf, pos)
                except _Short:
                    pass
                else:
                    if value is _PUSH:  # out-of-band (RESP3 push): not a reply, read on
                        continue
                    if pos >= len(buf):
                        self._buf, self._pos = b"", 0
                    else:
                        self._buf, self._pos = buf, pos
                    if isinstance(value, RedisConnectionError):
                        raise value
                    return value
            try:
                chunk = sock.recv(READ_SIZE)
            except TimeoutError:  # socket.timeout
                self._sock = None
                raise RedisTimeoutError(f"Timeout reading from {_where(conn)}") from None
            except OSError as exc:
                self._sock = None
                raise RedisConnectionError(f"Error while reading from {_where(conn)} : {exc.args}") from None
            if not chunk:
                self._sock = None
                raise RedisConnectionError("Connection closed by server.")
            buf, pos = buf[pos:] + chunk, 0

    def _parse(self, buf: bytes, pos: int) -> tuple[Any, int]:
        """One reply starting at ``pos``: (value, where the next one starts); ``_Short`` if it is not all here."""
        end = buf.find(b"\r\n", pos)
        if end < 0:
            raise _Short
        kind = buf[pos]
        if kind == 36:  # $ bulk string
            n = int(buf[pos + 1 : end])
            if n < 0:
                return None, end + 2
            start = end + 2
            stop = start + n
            if len(buf) < stop + 2:
                raise _Short
            value = buf[start:stop]
            return (value.decode(self._encoding, self._errors) if self._decode else value), stop + 2
        if kind == 58:  # : integer
            return int(buf[pos + 1 : end]), end + 2
        if kind == 42 or kind == 126 or kind == 62:  # * array, ~ set (a list, as redis-py gives it), > push
            n = int(buf[pos + 1 : end])
            if n < 0:
                return None, end + 2
            pos = end + 2
            out = []
            for _ in range(n):
                item, pos = self._parse(buf, pos)
                out.append(item)
            return (_PUSH if kind == 62 else out), pos
        line = buf[pos + 1 : end]
        if kind == 43:  # + simple string
            return (line.decode(self._encoding, self._errors) if self._decode else line), end + 2
        if kind == 45:  # - error
            return self._parse_error(line.decode("utf-8", errors="replace")), end + 2
        if kind == 95:  # _ null (RESP3)
            return None, end + 2
        if kind == 35:  # # boolean (RESP3)
            return line == b"t", end + 2
        if kind == 44:  # , double (RESP3)
            return float(line), end + 2
        if kind == 40:  # ( big number (RESP3)
            return int(line), end + 2
        if kind == 37:  # % map (RESP3)
            pos = end + 2
            out_map: dict[Any, Any] = {}
            for _ in range(int(line)):
                k, pos = self._parse(buf, pos)
                v, pos = self._parse(buf, pos)
                out_map[k] = v
            return out_map, pos
        if kind == 61:  # = verbatim string (RESP3): 'txt:' then the text
            n = int(line)
            start = end + 2
            stop = start + n
            if len(buf) < stop + 2:
                raise _Short
            value = buf[start + 4 : stop]
            return (value.decode(self._encoding, self._errors) if self._decode else value), stop + 2
        raise InvalidResponse(f"Protocol Error: {buf[pos : end + 2]!r}")


def _where(conn: Any) -> str:
    describe = getattr(conn, "_host_error", None)
    return describe() if callable(describe) else f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
