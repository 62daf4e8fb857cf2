"""The Redis commands celery-lockguard sends, for a least-privilege ACL user.

Every lease operation is one Lua script run by EVALSHA (loaded with SCRIPT
LOAD after a NOSCRIPT). A script runs as the calling user, so the commands it
calls (:data:`IN_SCRIPTS`) must be granted too. The rest is listed by who
sends it. Keys are all under ``{lockguard_key_prefix}:``, so one key pattern
covers them.

>>> rule("lockguard").split()[:3]
['on', 'resetkeys', '~lockguard:*']
"""

from __future__ import annotations

#: Connection set-up redis-py sends. CLIENT SETINFO (Redis 7.2+, Valkey) is refused quietly when
#: not granted -- redis-py ignores the error -- but each refusal fills the ACL log.
CONNECTION = ("hello", "client|setname", "ping")
SETINFO = ("client|setinfo",)

#: What the Lua scripts call (_scripts.py, _cluster.py): checked against the caller's ACL.
IN_SCRIPTS = (
    "time",
    "get",
    "set",
    "hget",
    "hmget",
    "hset",
    "pexpire",
    "pttl",
    "del",
    # park and wake (PARK, CHECK_PARKED, CONFIRM_WAKE, RELEASE's wake)
    "exists",
    "hdel",
    "rpush",
    "lpop",
    "lindex",
    "llen",
    "lrem",
    "lrange",
    "linsert",
    # debounce (DEBOUNCE_PUBLISH counts the publishes a burst superseded)
    "hincrby",
    # workflows: a member of an ended workflow (WORKFLOW_ENTER; WORKFLOW_END's ZADD is in TASKS)
    "zscore",
    # lock_rate's start window (ACQUIRE_SLOTS): trim, count, read the oldest, admit
    "zremrangebyscore",
    "zcard",
    "zrange",
    "zadd",
)

#: Workers: scripts; completion records on Cluster (GET, SET); checkpoints (HGET, then HSET +
#: PEXPIRE in MULTI/EXEC); metrics flushes (HINCRBY, EXPIRE, HSETNX, HSET, and the held-now gauge:
#: SET, ZADD, ZREMRANGEBYSCORE, DEL, ZREM, in MULTI/EXEC); ``lock_replicas`` (WAIT).
TASKS = (
    "evalsha",
    "script|load",
    "get",
    "set",
    "hget",
    "hset",
    "hsetnx",
    "hincrby",
    "pexpire",
    "expire",
    "multi",
    "exec",
    "wait",
    "zadd",
    "zremrangebyscore",
    "zrem",
    "del",
)

#: ``celery lockguard``: locks (SCAN, TIME, HGETALL, PTTL), release (HGETALL + a script), stats and
#: the exporter (HGETALL; ZREVRANGEBYSCORE over the live window, ZCARD for what it left out, then
#: STRLEN + GETRANGE for the held-now gauges), doctor (INFO; CONFIG GET only when INFO lacks the
#: policy, failure tolerated), completions show/forget (GET, PTTL, HGETALL, DEL), and the starts in a
#: ``lock_rate`` entity's window (ZCOUNT, read by ``locks``); the first rows of ``locks`` and the page
#: (a read-only script run with EVALSHA: SCAN, HMGET, LLEN inside; DBSIZE for its estimate); ``describe KEY``
#: (EXISTS on the slot fence counters, LLEN on the waiter queue; no SCAN).
CLI = (
    "scan",
    "time",
    "hgetall",
    "pttl",
    "info",
    "config|get",
    "del",
    "zrevrangebyscore",
    "zcard",
    "strlen",
    "getrange",
    "zcount",
    "dbsize",
    "exists",
    "llen",
)

#: Redis Cluster clients also read the topology and the command table.
CLUSTER = ("cluster|slots", "cluster|shards", "cluster|nodes", "command", "readonly")


def commands(cli: bool = True, cluster: bool = False, setinfo: bool = True) -> tuple[str, ...]:
    """Every command to grant: workers always, the operator CLI and Cluster discovery on request.

    ``setinfo=False`` for servers before Redis 7.2, which reject the unknown name in ACL SETUSER.
    """
    out = CONNECTION + (SETINFO if setinfo else ()) + TASKS + IN_SCRIPTS
    out += (CLI if cli else ()) + (CLUSTER if cluster else ())
    return tuple(dict.fromkeys(out))


def rule(prefix: str, cli: bool = True, cluster: bool = False, setinfo: bool = True) -> str:
    """The ``ACL SETUSER <name>`` arguments for a user limited to ``prefix``'s keys and these commands.

    Add ``>password`` (or ``#sha256``) yourself. No pub/sub channels are needed. A prefix
    ``lockguard_key_prefix`` would refuse (empty, braces, whitespace, glob characters) raises
    :class:`~celery_lockguard.exceptions.ConfigurationError`.
    """
    from ._config import check_prefix

    # A glob character would widen the key pattern: rule("*") granted ~*:*, every key on the server.
    check_prefix(prefix, "acl.rule prefix")
    grants = " ".join(f"+{c}" for c in commands(cli, cluster, setinfo))
    return f"on resetkeys ~{prefix}:* resetchannels -@all {grants}"
