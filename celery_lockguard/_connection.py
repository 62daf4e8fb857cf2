"""The Redis client for lock state: one per (settings, process).

Short socket timeouts and no client-side retry loop: an unreachable Redis must
surface quickly as ``BackendUnavailable`` so the task's ``on_unavailable``
policy decides, rather than stalling a worker slot for tens of seconds.

Sentinel: redis-py asks the sentinels for the master only when it opens a
connection, and a master demoted by ``SENTINEL FAILOVER`` (or cut off by a
partition) keeps answering writes until the sentinels reconfigure it -- many
seconds in which renewals and releases would land on a server whose data is
about to be thrown away. So at most every :data:`SENTINEL_CHECK_INTERVAL`
seconds :func:`follow_failover` asks the sentinels again; when the master
moved, idle connections are closed at once and busy ones when returned, and
the next command goes to the new master.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import _errors as errors
from ._config import Settings
from .exceptions import ConfigurationError

#: Errors that mean "the lock store is unreachable" by class alone: the same tuple
#: :func:`celery_lockguard._errors.classify` calls "unavailable" (defined there). A coarse filter:
#: replies redis-py leaves as a plain ``ResponseError`` (BUSY, NOREPLICAS, MISCONF, ...) escape it,
#: and it lets through ``AuthenticationError``, a ``ConnectionError`` that classify calls
#: misconfigured. Where a reply can arrive, catch broadly and classify instead.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = errors.UNAVAILABLE_ERRORS

#: redis-py runs MULTI/EXEC on Cluster (one slot) from 6.1 on; checkpoints and metrics flushes need it.
CLUSTER_MIN_REDIS_PY = (6, 1)

#: Seconds between two "is the master still where we think?" questions to the sentinels.
SENTINEL_CHECK_INTERVAL = 1.0

_clients: dict[tuple[int, Settings, str], Any] = {}  # (pid, settings, kind) -> client
_lock = threading.Lock()
_checked_at: dict[int, float] = {}


def client(s: Settings) -> Any:
    """The process's client for these settings (recreated after fork)."""
    return _cached(s, "")


def operator_client(s: Settings) -> Any:
    """A client for the operator CLI: like :func:`client`, but bytes that are not UTF-8 survive.

    Anyone with write access to the lock Redis can plant a key or a value that
    is not UTF-8; with strict decoding one such key crashed ``lockguard locks``
    and ``doctor`` (their SCAN decodes every name). ``surrogateescape`` decodes
    each bad byte to a lone surrogate and encodes it back to the same byte, so
    the key can be read, shown (``_terminal.printable`` writes it as ``\\xff``) and
    released by name. Workers keep the strict client: their keys are rendered
    strict UTF-8 (``_keys``).
    """
    return _cached(s, "operator")


#: What each kind of cached client adds to the settings' client arguments.
_KINDS: dict[str, dict[str, Any]] = {"": {}, "operator": {"encoding_errors": "surrogateescape"}}


def _cached(s: Settings, kind: str) -> Any:
    key = (os.getpid(), s, kind)
    c = _clients.get(key)
    if c is None:
        with _lock:
            c = _clients.get(key)
            if c is None:
                c = _make_client(s, **_KINDS[kind])
                _clients[key] = c
    if s.sentinels:
        follow_failover(c)
    return c


def independent_copy(c: Any) -> Any | None:
    """A new client made as this process's cached client ``c`` was (same settings, same kind), or ``None``.

    For a thread that must not share ``c``'s connections (the renewer's OS thread under gevent/eventlet).
    """
    for (pid, s, kind), known in list(_clients.items()):
        if known is c and pid == os.getpid():
            return _make_client(s, **_KINDS[kind])
    return None


def cached_ids() -> set[int]:
    """``id()`` of every client this process has cached: the ones ``client``/``operator_client`` can hand out."""
    pid = os.getpid()
    return {id(c) for (p, _, _), c in list(_clients.items()) if p == pid}


def follow_failover(c: Any) -> None:
    """On a Sentinel client, re-ask the sentinels for the master (rate-limited); a no-op otherwise.

    ``get_master_address`` closes the pool's idle connections when the answer
    changed, and the pool drops busy ones as they come back. A sentinel that
    cannot answer changes nothing: the command itself then says whether the
    master is reachable.
    """
    pool = getattr(c, "connection_pool", None)
    if pool is None or not hasattr(pool, "get_master_address"):
        return
    now = time.monotonic()
    if now - _checked_at.get(id(pool), 0.0) < SENTINEL_CHECK_INTERVAL:
        return
    _checked_at[id(pool)] = now
    try:
        pool.get_master_address()
    except Exception:  # noqa: BLE001 - MasterNotFoundError, timeouts: keep the current connection
        pass


def _make_client(s: Settings, **extra: Any) -> Any:
    common: dict[str, Any] = {
        "socket_timeout": s.socket_timeout,
        "socket_connect_timeout": min(s.socket_timeout, 2.0),
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        "client_name": "lockguard",
    }
    common.update(extra)
    common.update(dict(s.redis_kwargs))  # lockguard_redis_kwargs: e.g. username/password, ssl_* with Sentinel
    if s.sentinels:
        if not s.sentinel_master:
            raise ConfigurationError("setting lockguard_sentinels needs lockguard_sentinel_master")
        from redis.sentinel import Sentinel

        sentinel = Sentinel(
            [tuple(x) for x in s.sentinels],
            sentinel_kwargs={
                "socket_timeout": s.socket_timeout,
                "socket_connect_timeout": common["socket_connect_timeout"],
                **dict(s.sentinel_kwargs),  # lockguard_sentinel_kwargs: the sentinels' own password, TLS
            },
        )
        return sentinel.master_for(s.sentinel_master, **common)
    if not s.redis_url:
        raise ConfigurationError(
            "setting lockguard_redis_url is required when the broker is not Redis: "
            "a per-host default would give no cross-host exclusion"
        )
    if s.redis_cluster:
        from redis.cluster import RedisCluster

        if redis_py_version() < CLUSTER_MIN_REDIS_PY:
            raise ConfigurationError(
                f"setting lockguard_redis_cluster needs redis-py >= 6.1 (installed: {redis.__version__}): "
                "checkpoints and metrics flushes are MULTI/EXEC transactions on one slot, which older "
                "redis-py refuses on Cluster"
            )

        common.pop("retry")
        return RedisCluster.from_url(s.redis_url, **common)
    return redis.Redis.from_url(s.redis_url, **common)


def redis_py_version() -> tuple[int, ...]:
    """The installed redis-py version as numbers (``(8, 1, 0)``)."""
    return tuple(int(x) for x in redis.__version__.split(".")[:2] if x.isdigit())


def forget_clients() -> None:
    """Close and drop cached clients (tests that restart servers)."""
    with _lock:
        for c in _clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead client must not fail a test
                pass
        _clients.clear()
