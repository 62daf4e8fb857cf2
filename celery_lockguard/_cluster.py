"""Redis Cluster: which slot and node a key lives on, and RENEW grouped by node.

Every key of one entity carries the hash tag ``{K}``, so each lease script
touches a single slot and Cluster runs it on one node unchanged. Two things
need help here:

* The completion record ``{S}:done`` has its own tag. When S and K fall in
  different slots, ACQUIRE and RELEASE cannot touch it in the same script;
  :mod:`celery_lockguard._lease` then reads and writes it with a command of its
  own (:func:`split_done`), one more round trip, only on Cluster and only when
  the slots differ.
* A process holds leases in many slots. The renewer sends one EVALSHA per
  *node* per tick (:data:`RENEW_NODE`), not one per slot and never one
  CROSSSLOT script: the script declares one key (so Cluster routes it) and
  reaches the others through ARGV under ``allow-cross-slot-keys``, which
  Redis 7.0+ and Valkey allow for keys of slots the node serves. If a slot is
  moving, the node refuses, and :func:`renew` falls back to one call per slot.
"""

from __future__ import annotations

from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from . import _scripts as scripts

try:  # redis-py always ships it; the guard keeps a broken install from failing at import
    from redis.cluster import RedisCluster
except ImportError:  # pragma: no cover
    RedisCluster = None  # type: ignore[assignment,misc]

RENEW_NODE_SOURCE = (
    """#!lua flags=allow-cross-slot-keys
-- RENEW_NODE: RENEW on Redis Cluster for the leases of one process on one node, whatever their slots.
-- KEYS[1] lease hash of lease 1 (declared so Cluster routes the call to the node that serves it)
-- ARGV[3i-2] lease hash i (ARGV[1] = KEYS[1])  ARGV[3i-1] token of lease i  ARGV[3i] ttl_ms of lease i
-- Returns {r1, ..., rn}: 1 renewed; 0 the token is gone (the lease is lost; nothing written)
-- Errors (nothing is wrong with the leases) when a key's slot is not served by this node: a
-- slot migration or a stale slot map; the caller then renews slot by slot.
"""
    + scripts._NOW
    + """
local out = {}
for i = 1, #ARGV / 3 do
  local key = ARGV[3 * i - 2]
  if redis.call('HGET', key, 'token') == ARGV[3 * i - 1] then
    redis.call('PEXPIRE', key, ARGV[3 * i])
    redis.call('HSET', key, 'renewed_at', now_ms)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

renew_node = scripts.Script("RENEW_NODE", RENEW_NODE_SOURCE)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a ``redis.cluster.RedisCluster``.

    ``isinstance`` itself, spelled out: ``RedisCluster``'s metaclass is typing's protocol meta, whose
    ``__instancecheck__`` runs in Python (~0.4 µs, twice per locked task), while ``issubclass`` of the
    class (and of ``type(client)`` when ``__class__`` says otherwise) is answered by ABC's cache.
    """
    if RedisCluster is None:
        return False
    cls = client.__class__
    return issubclass(cls, RedisCluster) or (type(client) is not cls and issubclass(type(client), RedisCluster))


def slot(key: str) -> int:
    """The hash slot of a Redis key (its ``{tag}`` if it has one), as Cluster computes it."""
    return int(key_slot(key.encode("utf-8")))


def split_done(client: Any, lease_key: str, done_key: str) -> bool:
    """True when the completion record must be read and written outside the lease scripts."""
    return is_cluster(client) and slot(lease_key) != slot(done_key)


def node_name(client: Any, key: str) -> str:
    """The name (``host:port``) of the primary serving ``key``; ``""`` for a non-cluster client."""
    if not is_cluster(client):
        return ""
    try:
        return str(client.get_node_from_key(key).name)
    except Exception:  # noqa: BLE001 - slot not covered while the map refreshes: the call itself will say
        return "?"


def group_by_node(client: Any, keys: list[str]) -> dict[str, list[int]]:
    """Indexes of ``keys`` grouped by the primary that serves them, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(node_name(client, key), []).append(i)
    return groups


def renew(client: Any, entries: list[tuple[str, str, int]]) -> list[int]:
    """Renew ``(lease key, token, ttl_ms)`` entries: one EVALSHA per node they live on.

    Returns 1 renewed / 0 token gone per entry, in order. A node that refuses
    a key it does not serve (slot migration, stale map) is retried slot by slot.
    """
    out = [0] * len(entries)
    for indexes in group_by_node(client, [e[0] for e in entries]).values():
        group = [entries[i] for i in indexes]
        for i, result in zip(indexes, _renew_one_node(client, group), strict=True):
            out[i] = result
    return out


def _renew_one_node(client: Any, group: list[tuple[str, str, int]]) -> list[int]:
    if len({slot(key) for key, _, _ in group}) == 1:
        return _renew_slot(client, group)
    args: list[Any] = []
    for entry in group:
        args += list(entry)
    try:
        return [int(x) for x in renew_node(client, [group[0][0]], args)]
    except ResponseError:
        by_slot: dict[int, list[int]] = {}
        for i, (key, _, _) in enumerate(group):
            by_slot.setdefault(slot(key), []).append(i)
        out = [0] * len(group)
        for indexes in by_slot.values():
            for i, result in zip(indexes, _renew_slot(client, [group[i] for i in indexes]), strict=True):
                out[i] = result
        return out


def _renew_slot(client: Any, group: list[tuple[str, str, int]]) -> list[int]:
    args: list[Any] = []
    for _, token, ttl_ms in group:
        args += [token, ttl_ms]
    return [int(x) for x in scripts.renew(client, [key for key, _, _ in group], args)]


def node_client(client: Any, key: str) -> Any:
    """A plain ``redis.Redis`` for the primary serving ``key`` (for commands that must share a connection)."""
    return client.get_redis_connection(client.get_node_from_key(key))


def primaries(client: Any) -> list[Any]:
    """Every primary of the cluster (``ClusterNode``), for scans and per-node checks."""
    return list(client.get_primaries())
