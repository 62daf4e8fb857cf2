"""``lockguard doctor``: set-ups that break locks quietly, found before they do.

Each check returns findings with a stable ``code`` (for scripts) and a
message that says what goes wrong and what to change. Checks that need the
server are skipped when it cannot be reached (that is a finding itself), and
a command its ACL refuses is a finding too, never a crash or a pass.

This module holds the task, pool and server checks and runs them all; the
checks of settings that fight the broker's redelivery timers are in
``_doctor_broker``, those of the beat schedule in ``_doctor_beat``.
"""

from __future__ import annotations

import fnmatch
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import NoPermissionError

from . import _connection as connection
from . import _doctor_beat as beat_checks
from . import _doctor_broker as broker_checks
from . import _stats as stats
from ._config import Settings, settings
from ._connection import UNAVAILABLE_ERRORS
from ._findings import VISIBILITY_SCHEMES, Finding, db_of, server_of
from ._findings import broker_url as _broker_url
from ._findings import limit as _limit
from ._redact import redact, redact_text
from ._terminal import plural
from .exceptions import ConfigurationError

__all__ = ["Finding", "db_of", "locked_tasks", "pool_of", "run", "server_of"]

#: Keys sampled from the lock database to look for cache traffic.
SAMPLE_KEYS = 1000
#: Foreign keys in the sample that make a finding: at least this many, and this share of the sample.
FOREIGN_MIN, FOREIGN_SHARE = 20, 0.1

_CELERY_PATTERNS = (
    "_kombu.*",
    "unacked*",
    "celery-task-meta-*",
    "celery-taskset-meta-*",
    "chord-unlock*",
    "*.reply.celery.pidbox",
    "*.celery.pidbox",
    "celery*",
)


def locked_tasks(app: Any) -> list[Any]:
    """The app's ``LockGuard`` tasks (``LockedTask`` or composed), sorted by name (task modules imported first)."""
    from ._task import LockGuard

    app.loader.import_default_modules()
    return sorted((t for t in app.tasks.values() if isinstance(t, LockGuard)), key=lambda t: t.name)


def run(app: Any, consumer_timeout: float | None = None) -> list[Finding]:
    """Every finding for ``app``; an empty list means nothing to report.

    ``consumer_timeout`` is RabbitMQ's server setting in seconds, when the
    operator knows it (``--rabbitmq-consumer-timeout``); else RabbitMQ's
    default is assumed, and a queue's ``x-consumer-timeout`` overrides both.
    """
    try:
        s = settings(app)
    except ConfigurationError as exc:
        return [Finding("configuration", f"lockguard settings are invalid: {redact_text(exc)}")]
    findings: list[Finding] = []
    tasks = locked_tasks(app)
    findings += _task_findings(app, s, tasks)
    findings += _pool_findings(app, tasks)
    valid = [t for t in tasks if _resolves(t)]  # a task whose options are invalid is a `configuration` finding
    findings += broker_checks.findings(app, s, valid, consumer_timeout)
    try:
        # The operator's client: a key that is not UTF-8 (anyone may plant one) must not stop the checks.
        client = connection.operator_client(s)
        client.ping()
    except ConfigurationError as exc:
        return [*findings, Finding("configuration", redact_text(exc))]
    except UNAVAILABLE_ERRORS as exc:
        return [
            Finding(
                "redis_unreachable",
                f"the lock Redis {redact(s.redis_url)} cannot be reached "
                f"({exc.__class__.__name__}: {redact_text(exc, s.redis_url)}). "
                "While it is down, fail_closed tasks wait and fail_open tasks run with no lock at all.",
            ),
            *findings,
            *beat_checks.findings(app, s, valid, None, consumer_timeout),
        ]
    refused: dict[str, str] = {}
    holds = _holds(client, s, refused)
    findings += beat_checks.findings(app, s, valid, holds, consumer_timeout)
    findings += _server_findings(app, s, client, refused)
    if refused:
        findings.append(_refused(refused))
    return findings


def _resolves(task: Any) -> bool:
    try:
        task.lockguard_options  # noqa: B018 - resolving is the check
    except ConfigurationError:
        return False
    return True


def _holds(client: Any, s: Settings, refused: dict[str, str]) -> dict[str, tuple[float, str]] | None:
    """Each task's typical hold from the fleet's flushed metrics; ``None`` when the ACL refuses reading them."""
    try:
        return beat_checks.typical_holds(stats.summarize(stats.read(client, s.key_prefix)))
    except NoPermissionError as exc:
        refused["hold-time metrics (beat_interval_below_hold fell back on lock_ttl)"] = str(exc)
        return None


def _refused(refused: dict[str, str]) -> Finding:
    listed = "; ".join(f"{check}: {reason}" for check, reason in refused.items())
    return Finding(
        "server_checks_refused",
        f"the lock Redis refused commands these checks need, for this user: {listed}. Those checks were skipped, "
        "not passed. Run doctor with the operator's credentials (celery_lockguard.acl.rule(prefix) grants "
        "SCAN, INFO, CONFIG GET and HGETALL; the workers' rule(prefix, cli=False) does not).",
    )


# -- per-task configuration ------------------------------------------------------------


def _task_findings(app: Any, s: Settings, tasks: list[Any]) -> list[Finding]:
    out: list[Finding] = []
    broker = _broker_url(app)
    broker_server = server_of(broker)
    lock_server = None if s.sentinels else server_of(s.redis_url)
    shares_broker = broker_server is not None and broker_server == lock_server
    visibility_applies = urlsplit(broker).scheme in VISIBILITY_SCHEMES
    sharing: list[str] = []
    for task in tasks:
        try:
            opts = task.lockguard_options
        except ConfigurationError as exc:
            out.append(Finding("configuration", redact_text(exc), [task.name]))
            continue
        if not opts.locked:
            continue
        soft, hard = _limit(task, app, "soft_time_limit"), _limit(task, app, "time_limit")
        body_limit = soft or hard
        if not opts.renew and body_limit and opts.ttl < body_limit:
            which = "soft time limit" if soft else "time limit"
            out.append(
                Finding(
                    "ttl_below_time_limit",
                    f"task {task.name!r}: lock_ttl={opts.ttl:g}s is shorter than its {which} ({body_limit:g}s) "
                    "and lock_renew is off, so a body allowed to run that long outlives its lease and a second "
                    "copy can start beside it. Turn lock_renew on, or raise lock_ttl above the limit.",
                    [task.name],
                )
            )
        acks_late = bool(getattr(task, "acks_late", False))
        task_limit = hard or soft
        if acks_late and visibility_applies and task_limit and s.visibility_timeout < task_limit:
            out.append(
                Finding(
                    "visibility_timeout_below_time_limit",
                    f"task {task.name!r}: acks_late with the broker's visibility_timeout={s.visibility_timeout:g}s, "
                    f"shorter than its time limit ({task_limit:g}s): the broker redelivers the message while the "
                    "first copy still runs, so every long run is delivered twice. Raise "
                    "broker_transport_options['visibility_timeout'] above the longest time limit.",
                    [task.name],
                )
            )
        if shares_broker and opts.on_unavailable == "fail_closed" and not acks_late:
            sharing.append(task.name)
    if sharing:
        out.append(
            Finding(
                "fail_closed_shares_broker",
                f"{plural(len(sharing), 'fail_closed task')} keep{'s' if len(sharing) == 1 else ''} their locks "
                "on the broker's Redis "
                f"({redact(s.redis_url)}) without acks_late. When that Redis is down the task must wait, but its "
                "wait cannot be republished to the same dead Redis, so the worker waits in-process holding a "
                "message it already acknowledged: a worker lost then loses the task. Set acks_late=True "
                "(with task_reject_on_worker_lost) on these tasks, or give the locks their own Redis "
                "(lockguard_redis_url).",
                sharing,
            )
        )
    return out


# -- the worker pool -----------------------------------------------------------------------

#: What each pool does to a lease (docs/pools.md has the measurements): where the renewer runs,
#: whether a CPU-bound body keeps its lease while it runs, which time limits the pool enforces,
#: and which bodies its hard limit actually stops (gevent's ``gevent.Timeout`` fires only at a yield).
POOLS: dict[str, dict[str, Any]] = {
    "prefork": {
        "renewer": "thread in each child",
        "cpu_bound_renewed": True,
        "time_limits": ("hard", "soft"),
        "hard_limit_stops": "any body",
    },
    "threads": {"renewer": "thread", "cpu_bound_renewed": True, "time_limits": (), "hard_limit_stops": "no body"},
    "solo": {"renewer": "thread", "cpu_bound_renewed": True, "time_limits": (), "hard_limit_stops": "no body"},
    "gevent": {
        "renewer": "OS thread (own clients)",
        "cpu_bound_renewed": True,
        "time_limits": ("hard",),
        "hard_limit_stops": "a body that yields",
    },
    "eventlet": {
        "renewer": "OS thread (own clients)",
        "cpu_bound_renewed": True,
        "time_limits": (),
        "hard_limit_stops": "no body",
    },
}
_POOL_ALIASES = {"processes": "prefork", "thread": "threads"}


def pool_of(app: Any) -> str:
    """The pool the app's configuration names (``worker_pool``; a ``-P`` on the command line overrides it)."""
    from celery.concurrency import ALIASES

    name = str(app.conf.get("worker_pool") or "prefork")
    # A class path ("celery.concurrency.thread:TaskPool") names the same pool as its alias.
    by_path = {path: alias for alias, path in ALIASES.items() if alias != "processes"}
    name = by_path.get(name.replace(".TaskPool", ":TaskPool") if ":" not in name else name, name)
    return _POOL_ALIASES.get(name, name)


def _pool_findings(app: Any, tasks: list[Any]) -> list[Finding]:
    """Tasks whose hard time limit the configured pool may not enforce, yet which cap their lease by it.

    ``lock_max_hold`` defaults to the hard time limit, trusting the pool to stop
    the body there. threads, solo and eventlet never stop a body, and gevent
    stops one only when it yields: a CPU-bound body runs on while renewal stops
    at the limit, the lease expires under it and a second copy can start beside
    it (the body is told: ``lock.max_hold_reached``). Which bodies compute
    without yielding cannot be read from the configuration, so under gevent
    every such task is listed.
    """
    pool = pool_of(app)
    facts = POOLS.get(pool)
    if facts is None or facts["hard_limit_stops"] == "any body":
        return []
    capped = [
        t.name
        for t in tasks
        if getattr(t, "lock_max_hold", None) is None
        and getattr(t, "lock_renew", True) is not False
        and _limit(t, app, "time_limit")
    ]
    if not capped:
        return []
    if "hard" in facts["time_limits"]:
        what = (
            f"worker_pool={pool!r} stops a body at its hard time limit only when the body yields, and "
            f"{plural(len(capped), 'task')} {'has' if len(capped) == 1 else 'have'} one, which lock_max_hold "
            "defaults to: a CPU-bound body keeps running "
            "past the limit while its lease is no longer renewed, so a second copy can start beside it."
        )
    else:
        what = (
            f"worker_pool={pool!r} enforces no hard time limit, but {plural(len(capped), 'task')} "
            f"{'has' if len(capped) == 1 else 'have'} one, and "
            "lock_max_hold defaults to it: past the limit the body keeps running while its lease is no longer "
            "renewed, so a second copy can start beside it."
        )
    return [
        Finding(
            "pool_ignores_time_limit",
            what + " Set lock_max_hold to the longest real run (or use the prefork pool, which stops any body "
            "at its limit).",
            capped,
        )
    ]


# -- the server ---------------------------------------------------------------------------


def _node_infos(client: Any, section: str) -> dict[str, dict[str, Any]]:
    """INFO ``section`` of every master: one entry per node on Cluster (INFO goes to one node by default)."""
    from ._cluster import is_cluster

    if not is_cluster(client):
        return {"": dict(client.info(section) or {})}
    info = client.info(section, target_nodes=client.PRIMARIES)
    if info and all(isinstance(v, dict) for v in info.values()):
        return {str(name): dict(v) for name, v in info.items()}
    return {"": dict(info or {})}  # a cluster of one master


def _policies(client: Any) -> tuple[dict[str, Any], str | None]:
    """Each master's ``maxmemory-policy``, and why it could not be read (``None``: it was).

    ``INFO memory`` first (every master on Cluster); ``CONFIG GET`` only when
    INFO lacks the policy. Managed servers and ACL users often refuse one or
    both: the refusal is reported, never raised.
    """
    why: list[str] = []
    try:
        policies = {node: m.get("maxmemory_policy") for node, m in _node_infos(client, "memory").items()}
    except NoPermissionError as exc:
        policies, why = {"": None}, [f"INFO refused ({exc})"]
    if None in policies.values() and len(policies) == 1:
        try:
            policies = {"": (client.config_get("maxmemory-policy") or {}).get("maxmemory-policy")}
        except NoPermissionError as exc:
            why.append(f"CONFIG GET refused ({exc})")
        except Exception as exc:  # noqa: BLE001 - CONFIG is often disabled or renamed on managed Redis
            why.append(f"CONFIG GET failed ({exc.__class__.__name__}: {exc})")
    if None in policies.values():
        return {n: p for n, p in policies.items() if p is not None}, "; ".join(why) or "INFO memory does not report it"
    return policies, None


def _server_findings(app: Any, s: Settings, client: Any, refused: dict[str, str]) -> list[Finding]:
    out: list[Finding] = []
    policies, unknown = _policies(client)
    if unknown is not None:
        out.append(
            Finding(
                "maxmemory_policy_unknown",
                f"the lock Redis's maxmemory-policy cannot be read: {unknown}. Whether it evicts leases, fences "
                "and completion records is unknown, not fine: check it with your provider or as an admin "
                "(CONFIG GET maxmemory-policy), and make it noeviction.",
            )
        )
    evicting = {node: p for node, p in policies.items() if p is not None and p != "noeviction"}
    policy = next(iter(evicting.values()), None)
    if policy is not None:
        where = (
            f" (on {len(evicting)} of {len(policies)} masters: {', '.join(sorted(evicting))})"
            if len(policies) > 1
            else ""
        )
        why = (
            "every lease, fence and completion record carries a TTL, so volatile-* evicts exactly them, first"
            if str(policy).startswith("volatile")
            else "under memory pressure it may evict any key, leases, fences and completion records included"
        )
        out.append(
            Finding(
                "maxmemory_policy",
                f"the lock Redis has maxmemory-policy={policy}{where}: {why}. An evicted lease lets a second copy run; "
                "an evicted fence or record lets a stale writer or a duplicate through. Set "
                "maxmemory-policy noeviction (writes then fail loudly instead).",
            )
        )
        shared = _shares_broker(app, s)
        if shared is not None:
            out.append(_evicting_broker(str(policy), shared, s))
    try:
        evicted = sum(int(st.get("evicted_keys") or 0) for st in _node_infos(client, "stats").values())
    except NoPermissionError as exc:
        refused["evictions (INFO stats)"] = str(exc)
        evicted = 0
    if evicted:
        out.append(
            Finding(
                "evictions",
                f"the lock Redis has evicted {plural(evicted, 'key')} since it started: leases or records may "
                "have been among them. Give it more memory, move other traffic off it, and set noeviction.",
            )
        )
    try:
        out += _foreign_traffic(app, s, client)
    except NoPermissionError as exc:
        refused["cache_traffic and shared_server (SCAN, INFO keyspace)"] = str(exc)
    return out


def _shares_broker(app: Any, s: Settings) -> str | None:
    """How the lock Redis is the broker's (``"database"`` or ``"server"``), or ``None``; judged from the URLs."""
    lock_server = None if s.sentinels else server_of(s.redis_url)
    broker = _broker_url(app)
    if lock_server is None or server_of(broker) != lock_server:
        return None
    return "database" if db_of(broker) == db_of(s.redis_url) else "server"


def _evicting_broker(policy: str, shared: str, s: Settings) -> Finding:
    where = "the same database" if shared == "database" else "the same server (another database: memory is per server)"
    if policy.startswith("volatile"):
        why = (
            "the broker's queues and its unacked hash carry no TTL and are never evicted, but every lock key "
            "does: a backlog (a queue that grows while workers are down, a burst of publishes) fills the memory, "
            "and Redis makes room by evicting exactly the leases, fences and completion records. A second copy "
            "then runs beside a live holder, and a lost record lets a redelivery run again"
        )
    else:
        why = (
            "under memory pressure Redis may evict the broker's own keys: a queue (a list of messages: tasks "
            "that then never run), or the unacked hash that brings a dead worker's acks_late job back; and the "
            "broker's backlog is what fills the memory that then evicts leases and records"
        )
    return Finding(
        "broker_shares_evicting_redis",
        f"the lock Redis ({redact(s.redis_url)}) is the broker's, in {where}, and its maxmemory-policy={policy} "
        f"evicts: {why}. Give the locks their own Redis with maxmemory-policy noeviction (lockguard_redis_url), "
        "or set noeviction here (publishes and lock writes then fail loudly when memory is full, and "
        "fail_closed tasks wait).",
    )


def _known_patterns(app: Any, s: Settings) -> list[str]:
    """Key patterns that belong on a lock Redis: lockguard's own, and the broker's and result backend's."""
    patterns = [f"{s.key_prefix}:*"]
    prefixes = [""]
    for opts_name in ("broker_transport_options", "result_backend_transport_options"):
        p = (app.conf.get(opts_name) or {}).get("global_keyprefix")
        if p:
            prefixes.append(str(p))
    queues = []
    try:
        queues = list(app.amqp.queues.keys())
    except Exception:  # noqa: BLE001 - an app without queues configured still gets the default patterns
        queues = [app.conf.get("task_default_queue") or "celery"]
    for p in prefixes:
        patterns += [p + pat for pat in _CELERY_PATTERNS]
        patterns += [p + q + "*" for q in queues]
    return patterns


def _foreign_traffic(app: Any, s: Settings, client: Any) -> list[Finding]:
    """Cache traffic on the lock Redis, where detectable: unknown keys in the lock db, other busy dbs.

    On Cluster the sample is drawn from every master (SCAN goes to each) and
    there are no other databases to look at.
    """
    out: list[Finding] = []
    patterns = _known_patterns(app, s)
    sampled, foreign = 0, []
    for key in client.scan_iter(count=200):
        sampled += 1
        if not any(fnmatch.fnmatchcase(key, p) for p in patterns):
            foreign.append(key)
        if sampled >= SAMPLE_KEYS:
            break
    if len(foreign) >= FOREIGN_MIN and len(foreign) >= FOREIGN_SHARE * sampled:
        examples = ", ".join(repr(k) for k in foreign[:3])
        out.append(
            Finding(
                "cache_traffic",
                f"{len(foreign)} of {sampled} sampled keys in the lock database are neither lockguard's nor "
                f"Celery's (e.g. {examples}): another application, probably a cache, shares this Redis. It "
                "competes for memory and, under any eviction policy but noeviction, for survival with the "
                "leases. Give locks their own Redis (lockguard_redis_url).",
            )
        )
    if s.redis_cluster:
        return out
    own_db = int(client.connection_pool.connection_kwargs.get("db", 0))
    lock_server = server_of(s.redis_url)
    related_dbs = {own_db}
    for url in (_broker_url(app), str(app.conf.get("result_backend") or "")):
        if lock_server is not None and server_of(url) == lock_server:
            related_dbs.add(db_of(url))
    keyspace = client.info("keyspace") or {}
    busy = {
        name: int(v.get("keys", 0))
        for name, v in keyspace.items()
        if isinstance(v, dict) and name.startswith("db") and name[2:].isdigit() and int(name[2:]) not in related_dbs
    }
    busy = {k: v for k, v in busy.items() if v >= FOREIGN_MIN}
    if busy:
        listed = ", ".join(f"{k} ({v} keys)" for k, v in sorted(busy.items()))
        out.append(
            Finding(
                "shared_server",
                f"other databases on the lock Redis hold keys: {listed}. Memory and eviction are per server, "
                "so that traffic (a cache?) shares the leases' fate. Give locks their own Redis.",
            )
        )
    return out
