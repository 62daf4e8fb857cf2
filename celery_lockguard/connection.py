"""The Redis client for lock state: one per (settings, process).

Short socket timeouts and no client-side retry loop: an unreachable Redis must
surface quickly as ``BackendUnavailable`` so the task's ``on_unavailable``
policy decides, rather than stalling a worker slot for tens of seconds.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .config import Settings
from .exceptions import ConfigurationError

#: Errors that mean "the lock store is unreachable", not "the lock is held".
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,  # noeviction and full: no lease can be written
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    OSError,
)

_clients: dict[tuple[int, Settings], Any] = {}
_lock = threading.Lock()


def client(s: Settings) -> Any:
    """The process's client for these settings (recreated after fork)."""
    key = (os.getpid(), s)
    c = _clients.get(key)
    if c is None:
        with _lock:
            c = _clients.get(key)
            if c is None:
                c = _make_client(s)
                _clients[key] = c
    return c


def _make_client(s: Settings) -> Any:
    common: dict[str, Any] = {
        "socket_timeout": s.socket_timeout,
        "socket_connect_timeout": min(s.socket_timeout, 2.0),
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        "client_name": "lockguard",
    }
    if s.sentinels:
        if not s.sentinel_master:
            raise ConfigurationError("setting lockguard_sentinels needs lockguard_sentinel_master")
        from redis.sentinel import Sentinel

        sentinel = Sentinel(s.sentinels, socket_timeout=s.socket_timeout)
        return sentinel.master_for(s.sentinel_master, **common)
    if not s.redis_url:
        raise ConfigurationError(
            "setting lockguard_redis_url is required when the broker is not Redis: "
            "a per-host default would give no cross-host exclusion"
        )
    if s.redis_cluster:
        from redis.cluster import RedisCluster

        common.pop("retry")
        return RedisCluster.from_url(s.redis_url, **common)
    return redis.Redis.from_url(s.redis_url, **common)


def forget_clients() -> None:
    """Close and drop cached clients (tests that restart servers)."""
    with _lock:
        for c in _clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing a dead client must not fail a test
                pass
        _clients.clear()
