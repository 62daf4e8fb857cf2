"""Settings (``lockguard_*``) and per-task options, validated once and frozen.

Settings are read from ``app.conf`` at first use, never through
``app.add_defaults`` (which would shadow values the user sets later). Each is
found as ``lockguard_x`` or, for ``config_from_object(..., namespace="CELERY")``
users, as ``CELERY_LOCKGUARD_X``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

from ._entities import EntityKeys, is_sequence
from ._keys import NAMESPACE, KeyRenderer
from ._keys import digest_order as _digest_order
from ._keys import record_prefix as _record_prefix
from .exceptions import ConfigurationError

ON_LOCKED = ("skip", "retry", "raise")
ON_UNAVAILABLE = ("fail_closed", "fail_open")
#: What a completion record found under the same ``idempotency_key`` with other arguments does.
ON_KEY_REUSED = ("raise", "warn")
LOCK_MODES = ("while_running", "until_started", "until_done")
LOG_BACKENDS = ("auto", "logging", "structlog")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://")
PG_SCHEMES = ("postgresql://", "postgres://")
#: Shortest duration any seconds option may have: everything becomes milliseconds, and below
#: one millisecond ``PX``/``PEXPIRE`` would get 0 (an error, or a key that never expires).
MIN_SECONDS = 0.001

_MISSING = object()
#: A plain SQL identifier, optionally schema-qualified. ``\Z``, not ``$``: ``$`` also matches before a
#: trailing newline, and ``"lockguard_fences\n"`` would pass into the SQL text.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?\Z")
#: Characters a key prefix must not hold: braces and whitespace break the hash tag; glob characters
#: turn ``SCAN MATCH {prefix}:...`` (``lockguard locks``) and the ACL key pattern ``~{prefix}:*``
#: (``acl.rule``) into patterns over other prefixes' keys.
PREFIX_FORBIDDEN = "{}*?[]\\"


#: Every setting the library reads, without its ``lockguard_`` prefix. A ``lockguard_*`` (or
#: ``CELERY_LOCKGUARD_*``) name on ``app.conf`` outside this set is a typo and is refused
#: (:func:`check_setting_names`): a misspelled default TTL would silently keep the 30 s one.
#: A new setting goes here first; ``tests/test_config.py`` holds every ``setting(app, "...")`` to it.
KNOWN_SETTINGS = frozenset(
    {
        "completion_backend",
        "completion_table",
        "completion_ttl",
        "debounce",
        "default_ttl",
        "enabled",
        "fence_dsn",
        "fence_table",
        "fence_ttl",
        "idempotency_mismatch",
        "key_prefix",
        "keys",
        "lock_limit",
        "lock_rate",
        "log_backend",
        "max_waits",
        "metrics_flush_interval",
        "on_locked",
        "on_unavailable",
        "redis_cluster",
        "redis_kwargs",
        "redis_url",
        "sentinel_kwargs",
        "sentinel_master",
        "sentinels",
        "shorten_grace",
        "socket_timeout",
    }
)
#: How a configuration name may start when it means one of ours (compared in lower case).
_SETTING_PREFIXES = ("celery_lockguard_", "lockguard_")


def check_setting_names(app: Any) -> None:
    """Refuse a ``lockguard_*`` name on ``app.conf`` that the library never reads, naming the nearest one.

    Misspelled options are refused by :func:`check_option_names`; a misspelled
    setting would otherwise pass ``doctor`` and worker start and keep its
    default. Both spellings count (``lockguard_x`` and, for
    ``namespace="CELERY"``, ``CELERY_LOCKGUARD_X``); a known name in another
    case (``LOCKGUARD_REDIS_URL``, which neither spelling reads) is refused too,
    but other ``LOCKGUARD_*`` names are left alone (a Django settings module
    loaded with ``namespace="CELERY"`` brings every setting of the project).
    """
    try:
        names = list(app.conf.keys())
    except AttributeError:  # a bare mapping without keys(): nothing to check
        return
    for key in names:
        if not isinstance(key, str):
            continue
        lowered = key.lower()
        prefix = next((p for p in _SETTING_PREFIXES if lowered.startswith(p)), None)
        if prefix is None:
            continue
        name = lowered[len(prefix) :]
        upper = prefix == "celery_lockguard_"
        spelled = f"CELERY_LOCKGUARD_{name.upper()}" if upper else f"lockguard_{name}"
        if name in KNOWN_SETTINGS and key == spelled:
            continue
        if name not in KNOWN_SETTINGS and not key.startswith(("lockguard_", "CELERY_LOCKGUARD_")):
            continue  # LOCKGUARD_FOO in a Django settings module may be the project's own name
        if name in KNOWN_SETTINGS and key.startswith(("lockguard_", "CELERY_LOCKGUARD_")):
            nearest = spelled
        elif name in KNOWN_SETTINGS:
            nearest = f"lockguard_{name} (or CELERY_LOCKGUARD_{name.upper()} with namespace='CELERY')"
        else:
            match = max(sorted(KNOWN_SETTINGS), key=lambda known: difflib.SequenceMatcher(None, name, known).ratio())
            nearest = f"CELERY_LOCKGUARD_{match.upper()}" if upper else f"lockguard_{match}"
        # The value is not quoted: a misspelled DSN or URL setting carries a password.
        raise ConfigurationError(
            f"setting {key} is not a LockGuard setting; did you mean {nearest}? "
            "(every setting: docs/reference.md, Settings)"
        )


def setting(app: Any, name: str, default: Any = None) -> Any:
    """Read ``lockguard_<name>`` from the app's configuration (both spellings)."""
    conf = app.conf
    for key in (f"lockguard_{name}", f"CELERY_LOCKGUARD_{name.upper()}"):
        value = conf.get(key, _MISSING)
        if value is not _MISSING:
            return value
    return default


@dataclass(frozen=True, eq=False)
class Settings:
    """App-wide settings; one instance cached on the app."""

    enabled: bool
    redis_url: str | None
    key_prefix: str
    keys: dict[str, Any]
    default_ttl: float
    on_locked: str
    on_unavailable: str
    completion_backend: str
    completion_table: str
    completion_ttl: float | None
    redis_cluster: bool
    sentinels: list[Any] | None
    sentinel_master: str | None
    socket_timeout: float
    max_waits: int
    visibility_timeout: float
    fence_ttl: float = 30 * 86400
    shorten_grace: float = 2.0
    redis_kwargs: tuple[tuple[str, Any], ...] = ()
    sentinel_kwargs: tuple[tuple[str, Any], ...] = ()
    idempotency_mismatch: str = "raise"
    #: Databases whose fence table ``lockguard release`` bumps (``lockguard_fence_dsn``).
    fence_dsns: tuple[str, ...] = ()
    fence_table: str = "lockguard_fences"
    #: Where events are logged: ``"auto"``, ``"logging"`` or ``"structlog"`` (``lockguard_log_backend``).
    log_backend: str = "auto"
    #: ``lockguard_debounce``: task name -> debounce seconds, for tasks that set no ``lock_debounce``.
    debounce: dict[str, Any] | None = None


def first_url(url: Any) -> str:
    """The first of a broker URL setting: a list, or a ``;``-separated failover string, names its first."""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    return str(url or "").split(";")[0].strip()


def broker_url(app: Any, read: bool = False) -> str:
    """The app's broker URL as Celery reads it: ``CELERY_BROKER_URL`` in the environment wins, as it does
    for the worker (``app.conf.get("broker_url")`` would miss it and see no broker at all).

    ``read``: the URL workers consume from (``broker_read_url``, else the broker's), which is the
    transport that redelivers an unacknowledged message.
    """
    conf = app.conf
    name = "broker_read_url" if read else "broker_url"
    try:
        url = getattr(conf, name)  # Celery's Settings property: the environment, then the settings
    except AttributeError:  # a bare mapping, not Celery's Settings
        url = None
    return first_url(url or conf.get(name) or conf.get("broker_url"))


def _broker_redis_url(app: Any) -> str | None:
    url = broker_url(app)
    return url if url.startswith(REDIS_SCHEMES) else None


#: The transports' own ``visibility_timeout`` when ``broker_transport_options`` sets none
#: (kombu's defaults: Redis and Sentinel one hour, SQS half an hour).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0
SQS_VISIBILITY_TIMEOUT = 1800.0


def _visibility_timeout(app: Any, transport: Any) -> float:
    """``broker_transport_options["visibility_timeout"]``, else the transport's own default.

    Lockguard caps its own countdowns at half of it and doctor judges holds
    against it, so a value kombu could not use either is a ConfigurationError,
    never a traceback.
    """
    if not isinstance(transport, dict):
        raise ConfigurationError(
            f"setting broker_transport_options={transport!r} must be a dict (kombu's transport options)"
        )
    sqs = broker_url(app, read=True).startswith("sqs://")
    value = transport.get("visibility_timeout")
    if "visibility_timeout" not in transport or (sqs and value in (None, "")):  # SQS also reads these as unset
        return SQS_VISIBILITY_TIMEOUT if sqs else DEFAULT_VISIBILITY_TIMEOUT
    try:
        seconds = float(value) if isinstance(value, str) else value
    except ValueError:
        seconds = value
    return _seconds("setting", "broker_transport_options['visibility_timeout']", seconds)


def load_settings(app: Any) -> Settings:
    """Read and validate the ``lockguard_*`` settings of ``app`` (an unknown one is refused first)."""
    check_setting_names(app)
    key_prefix = check_prefix(str(setting(app, "key_prefix", "lockguard")), "setting lockguard_key_prefix")
    on_locked = setting(app, "on_locked", "skip")
    if on_locked not in ON_LOCKED:
        raise ConfigurationError(f"setting lockguard_on_locked={on_locked!r} must be one of {ON_LOCKED}")
    idempotency_mismatch = setting(app, "idempotency_mismatch", "raise")
    if idempotency_mismatch not in ON_KEY_REUSED:
        raise ConfigurationError(
            f"setting lockguard_idempotency_mismatch={idempotency_mismatch!r} must be one of {ON_KEY_REUSED}"
        )
    on_unavailable = setting(app, "on_unavailable", "fail_closed")
    if on_unavailable not in ON_UNAVAILABLE:
        raise ConfigurationError(f"setting lockguard_on_unavailable={on_unavailable!r} must be one of {ON_UNAVAILABLE}")
    default_ttl = _seconds("setting", "lockguard_default_ttl", setting(app, "default_ttl", 30))
    keys = setting(app, "keys", None) or {}
    if not isinstance(keys, dict):
        raise ConfigurationError(f"setting lockguard_keys={keys!r} must be a dict of task name -> template")
    transport = app.conf.get("broker_transport_options") or {}
    max_waits = setting(app, "max_waits", 100)
    if not isinstance(max_waits, int) or isinstance(max_waits, bool) or max_waits < 0:
        raise ConfigurationError(f"setting lockguard_max_waits={max_waits!r} must be an int >= 0")
    completion_ttl = setting(app, "completion_ttl", None)
    if completion_ttl is not None:
        completion_ttl = _seconds("setting", "lockguard_completion_ttl", completion_ttl)
    return Settings(
        enabled=bool(setting(app, "enabled", True)),
        redis_url=setting(app, "redis_url", None) or _broker_redis_url(app),
        key_prefix=key_prefix,
        keys=dict(keys),
        default_ttl=default_ttl,
        on_locked=on_locked,
        on_unavailable=on_unavailable,
        completion_backend=_completion_backend(setting(app, "completion_backend", "redis")),
        completion_table=str(setting(app, "completion_table", "lockguard_completions")),
        completion_ttl=completion_ttl,
        redis_cluster=bool(setting(app, "redis_cluster", False)),
        sentinels=setting(app, "sentinels", None),
        sentinel_master=setting(app, "sentinel_master", None),
        socket_timeout=_seconds("setting", "lockguard_socket_timeout", setting(app, "socket_timeout", 5.0)),
        max_waits=max_waits,
        visibility_timeout=_visibility_timeout(app, transport),
        fence_ttl=_seconds("setting", "lockguard_fence_ttl", setting(app, "fence_ttl", 30 * 86400)),
        shorten_grace=_seconds("setting", "lockguard_shorten_grace", setting(app, "shorten_grace", 2.0)),
        redis_kwargs=_kwargs("lockguard_redis_kwargs", setting(app, "redis_kwargs", None)),
        sentinel_kwargs=_kwargs("lockguard_sentinel_kwargs", setting(app, "sentinel_kwargs", None)),
        idempotency_mismatch=idempotency_mismatch,
        fence_dsns=_fence_dsns(setting(app, "fence_dsn", None)),
        fence_table=_identifier("lockguard_fence_table", setting(app, "fence_table", "lockguard_fences")),
        log_backend=_log_backend(setting(app, "log_backend", "auto")),
        debounce=_debounce_map(setting(app, "debounce", None)),
    )


def _debounce_map(value: Any) -> dict[str, Any]:
    """``lockguard_debounce``: a dict of task name -> seconds (each value is checked with its task)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"setting lockguard_debounce={value!r} must be a dict of task name -> seconds")
    return dict(value)


def check_prefix(prefix: str, where: str) -> str:
    """``prefix`` if it can name keys safely: non-empty, no braces, whitespace or glob characters."""
    if not prefix or any(c in PREFIX_FORBIDDEN or c.isspace() or not c.isprintable() for c in prefix):
        raise ConfigurationError(
            f"{where}={prefix!r} must be non-empty, without braces, whitespace, control or glob "
            f"characters ({' '.join(PREFIX_FORBIDDEN)}): a glob in the prefix would make "
            "`lockguard locks` and the ACL key pattern reach other prefixes' keys"
        )
    return prefix


def _log_backend(value: Any) -> str:
    """``lockguard_log_backend``: ``"auto"``, ``"logging"`` or ``"structlog"`` (which needs structlog installed)."""
    from importlib.util import find_spec

    if value not in LOG_BACKENDS:
        raise ConfigurationError(f"setting lockguard_log_backend={value!r} must be one of {LOG_BACKENDS}")
    if value == "structlog" and find_spec("structlog") is None:
        raise ConfigurationError("setting lockguard_log_backend='structlog' needs structlog installed")
    return str(value)


def _fence_dsns(value: Any) -> tuple[str, ...]:
    """``lockguard_fence_dsn``: one ``postgresql://`` DSN or a list of them (every database that fences)."""
    if value is None or value == "":
        return ()
    dsns = [value] if isinstance(value, str) else value
    if not isinstance(dsns, (list, tuple)) or not all(isinstance(d, str) and d.startswith(PG_SCHEMES) for d in dsns):
        raise ConfigurationError(
            "setting lockguard_fence_dsn must be a 'postgresql://' DSN or a list of them "
            "(the databases whose fence table advance_fence checks)"
        )
    return tuple(dsns)


def is_sql_identifier(value: object) -> bool:
    """Whether ``value`` is a plain SQL identifier, optionally schema-qualified (the whole string)."""
    return isinstance(value, str) and _IDENT.match(value) is not None


def _identifier(name: str, value: Any) -> str:
    if not is_sql_identifier(value):
        raise ConfigurationError(
            f"setting {name}={value!r} must be a plain SQL identifier (optionally schema-qualified)"
        )
    return value


def _kwargs(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """Extra client keyword arguments (credentials, TLS files), kept as sorted pairs in the frozen settings."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"setting {name} must be a dict of redis-py keyword arguments")
    return tuple(sorted(value.items()))


def _completion_backend(value: Any) -> str:
    if value == "redis" or (isinstance(value, str) and value.startswith(PG_SCHEMES)):
        return str(value)
    from ._redact import redact

    # The value is quoted redacted: a mistyped scheme ("postgressql://u:pw@h/db") still carries a password.
    raise ConfigurationError(
        f"setting lockguard_completion_backend={redact(value)!r} must be 'redis' or a 'postgresql://' DSN"
    )


def settings(app: Any) -> Settings:
    """The app's settings, loaded on first use and cached on the app."""
    cached = getattr(app, "_lockguard_settings", None)
    if cached is None:
        cached = load_settings(app)
        app._lockguard_settings = cached
    return cached


def reset(app: Any) -> None:
    """Forget cached settings and task options (tests that change ``app.conf``)."""
    app.__dict__.pop("_lockguard_settings", None)
    for task in list(app.tasks.values()):
        task.__dict__.pop("_lockguard_options", None)


def _seconds(kind: str, name: str, value: Any, task: str | None = None) -> float:
    """A duration in seconds, at least :data:`MIN_SECONDS` and finite: it becomes whole milliseconds."""
    where = f"task {task!r}: option {name}" if task else f"{kind} {name}"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value >= MIN_SECONDS
    ):
        raise ConfigurationError(
            f"{where}={value!r} must be a finite number of seconds >= {MIN_SECONDS} (it is sent as milliseconds)"
        )
    return float(value)


#: Most slots ``lock_limit`` may ask for: ACQUIRE reads every slot in its one round trip.
MAX_LOCK_LIMIT = 256
#: Seconds per unit of a ``lock_rate`` period.
RATE_UNITS = {"s": 1, "m": 60, "h": 3600}
#: Longest ``lock_rate`` window (366 days). ACQUIRE_SLOTS hands the window to Lua and to PEXPIRE: a
#: window of ~1e17 ms or more reached Redis as "1e+20" ("not an integer"), so every start failed after
#: its slot was written, the window key kept no TTL, and the countdown came back negative.
MAX_RATE_WINDOW_S = 366 * 86400
_RATE = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]*)\s*([smh])\s*\Z")


@dataclass(frozen=True)
class Rate:
    """A parsed ``lock_rate``: at most ``count`` starts per ``window_ms`` (sliding), per entity."""

    count: int
    window_ms: int
    text: str


def parse_rate(value: Any, where: str) -> Rate | None:
    """``"N/s"``, ``"N/m"``, ``"N/h"`` (or ``"N/10s"``: N per ten seconds) -> :class:`Rate`; ``None`` -> ``None``.

    ``where`` names the task and the option for the ``ConfigurationError`` a bad value raises.
    """
    if value is None:
        return None
    match = _RATE.match(value) if isinstance(value, str) else None
    count = int(match.group(1)) if match else 0
    periods = int(match.group(2) or 1) if match else 0
    window_s = periods * RATE_UNITS[match.group(3)] if match else 0
    if match is None or count < 1 or periods < 1 or count > 100_000 or window_s > MAX_RATE_WINDOW_S:
        raise ConfigurationError(
            f"{where}={value!r} must be 'N/s', 'N/m', 'N/h' or 'N/<k>s|m|h' with 1 <= N <= 100000 "
            "and a window of at most 366 days (starts per entity per sliding window), e.g. '100/m'"
        )
    return Rate(count, window_s * 1000, value.strip())


def _limits(task: Any, s: Settings, mode: str) -> tuple[int, Rate | None]:
    """``lock_limit`` and ``lock_rate`` (each falling back to ``lockguard_lock_limit`` / ``lockguard_lock_rate``)."""
    name = task.name
    own_limit = getattr(task, "lock_limit", None)
    limit = own_limit if own_limit is not None else setting(task.app, "lock_limit", 1)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LOCK_LIMIT:
        option = "option lock_limit" if own_limit is not None else "setting lockguard_lock_limit"
        raise ConfigurationError(f"task {name!r}: {option}={limit!r} must be an int from 1 to {MAX_LOCK_LIMIT}")
    own_rate = getattr(task, "lock_rate", None)
    rate_src = own_rate if own_rate is not None else setting(task.app, "lock_rate", None)
    option = "option lock_rate" if own_rate is not None else "setting lockguard_lock_rate"
    rate = parse_rate(rate_src, f"task {name!r}: {option}")
    if (limit > 1 or rate is not None) and mode != "while_running":
        raise ConfigurationError(
            f"task {name!r}: option lock_mode={mode!r} cannot be combined with lock_limit={limit!r} / "
            f"lock_rate={rate_src!r}: slots and start windows are execution-time only (use 'while_running')"
        )
    return limit, rate


@dataclass(frozen=True, eq=False)
class TaskOptions:
    """One task's resolved, validated options."""

    task_name: str
    #: A template (``KeyRenderer``), several templates or a callable (``EntityKeys``: one or more entities).
    lock_key: KeyRenderer | EntityKeys | None
    idempotency_key: KeyRenderer | None
    ttl: float
    renew: bool
    max_hold: float
    mode: str
    queue_lock_ttl: float
    on_locked: str
    on_unavailable: str
    completion: bool
    completion_ttl_task: float
    completion_ttl_scope: float
    max_waits: int
    signature: inspect.Signature
    replicas: int = 0
    idempotency_mismatch: str = "raise"
    #: ``lock_debounce`` seconds (last publish wins, one run per burst), or ``None``.
    debounce: float | None = None
    #: ``lock_limit``: bodies that may hold the entity at once (1: the single lease, unchanged).
    limit: int = 1
    #: ``lock_rate``: starts admitted per entity per sliding window, fleet-wide; ``None``: no rate.
    rate: Rate | None = None
    #: ``idempotency_namespace``: the name of the records this task shares with others, or ``None``
    #: (its records answer this task only).
    idempotency_namespace: str | None = None

    @functools.cached_property
    def record_prefix(self) -> str:
        """What precedes S in the record scope (``_keys.record_prefix``), made once per task."""
        return _record_prefix(self.task_name, self.idempotency_namespace)

    @functools.cached_property
    def positional_names(self) -> tuple[str, ...] | None:
        """The body's parameter names when every one can be passed by position (no ``*args``, ``**kwargs``
        or keyword-only parameter), else ``None``: a call passing exactly that many positional arguments
        binds them in this order, defaults unused (``_calls.render`` skips ``Signature.bind`` then)."""
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = self.signature.parameters.values()
        if all(p.kind in positional for p in params):
            return tuple(p.name for p in params)
        return None

    @functools.cached_property
    def digest_order(self) -> tuple[tuple[int, str], ...]:
        """For :func:`~celery_lockguard._keys.digest_in_order`: each positional parameter's index and JSON
        name, in the key order the digest sorts by (made once: it is on every delivery's path)."""
        return _digest_order(self.positional_names or ())

    # The derived options below are read on every delivery: each is computed once per task (cached
    # in the instance, so later reads are plain attribute reads).
    @functools.cached_property
    def slotted(self) -> bool:
        """Whether ACQUIRE goes through the slot script (``lock_limit`` > 1 or a ``lock_rate``)."""
        return self.limit > 1 or self.rate is not None

    @functools.cached_property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    @functools.cached_property
    def replicas_timeout_ms(self) -> int:
        """How long ``WAIT`` may block an acquisition: a tenth of the TTL, at most one second."""
        return max(10, min(1000, self.ttl_ms // 10))

    @functools.cached_property
    def locked(self) -> bool:
        """Whether calls take a lease at all (a key or a scope to lock on)."""
        return self.lock_key is not None or self.idempotency_key is not None


def _static(task: Any, option: str) -> Any:
    """An option as set, not as bound: a callable class attribute must not become a method."""
    value = inspect.getattr_static(task, option, None)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


#: Name prefixes of LockGuard's options: an unknown name with one of these is a typo of ours.
_OUR_PREFIXES = ("lock", "queue_lock", "on_", "idempotency", "completion")
#: Options Celery reads from a task class without defining them on ``Task`` (autoretry, routing).
_CELERY_EXTRA_OPTIONS = frozenset(
    {
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "queue",
        "exchange",
        "routing_key",
        "options",
        "pydantic",
    }
)


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


@functools.lru_cache(maxsize=1024)
def _near_ours(name: str, ours: tuple[str, ...]) -> bool:
    """Whether ``name`` is within two edits of one of our options (cached: a config reset checks every task again)."""
    return min(_edit_distance(name, o) for o in ours) <= 2


def _set_option_names(task: Any, base: type) -> list[str]:
    """Names set on the task's classes below ``base``: decorator options and subclass attributes.

    On the class ``@app.task`` builds, every name came from the decorator's
    options; on a user's own subclass, methods and properties are its own
    business and only data attributes are options.
    """
    names: list[str] = []
    for cls in type(task).__mro__:
        if cls is base or not issubclass(cls, base):
            break
        decorated = "_decorated" in vars(cls)
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            if not decorated and (
                inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))
            ):
                continue
            names.append(attr)
    return names


#: Names other lock libraries give an option of ours (celery-once, python-redis-lock say ``timeout``):
#: suggested before spelling similarity, which would offer ``lock_limit`` for ``lock_timeout``.
_SYNONYMS = {"lock_timeout": "lock_ttl", "lock_expire": "lock_ttl", "lock_expires": "lock_ttl"}


def check_option_names(task: Any) -> None:
    """Refuse a misspelled option: ``lock_tll=5`` would silently keep the 30 s TTL.

    A name set on the task that Celery's ``Task``, ``LockGuard`` and the other
    task classes the task derives from (``DjangoTask``, a project's base) do
    not know is refused when it starts like one of ours (``lock``,
    ``queue_lock``, ``on_``, ``idempotency``, ``completion``) or is within two
    edits of one. Other unknown names are the user's own attributes and are
    left alone.
    """
    from ._taskclass import guard_of  # kept out of import time, like the worker-side modules

    guard = guard_of(type(task))  # LockGuard itself, found without importing _task (which imports this module)
    if guard is None:  # not one of ours: no option of ours to misspell
        return
    known = set(dir(guard)) | _CELERY_EXTRA_OPTIONS
    for cls in type(task).__mro__:
        if not issubclass(cls, guard):  # a task class composed with ours: its names are its options
            known.update(vars(cls))
    ours = tuple(
        sorted(
            attr
            for attr, value in vars(guard).items()
            if not attr.startswith("_")
            and not callable(value)
            and not isinstance(value, (property, staticmethod, classmethod))
        )
    )
    for attr in _set_option_names(task, guard):
        if attr in known:
            continue
        lowered = attr.lower()
        if lowered.startswith(_OUR_PREFIXES) or _near_ours(lowered, ours):
            nearest = _SYNONYMS.get(lowered) or max(
                ours, key=lambda o: (difflib.SequenceMatcher(None, lowered, o).ratio(), -len(o))
            )
            value = repr(getattr(type(task), attr, None))
            raise ConfigurationError(
                f"task {task.name!r}: unknown option {attr}={value[:80]}; "
                f"did you mean {nearest}? (LockedTask options: {', '.join(ours)})"
            )


def validate_tasks(app: Any) -> None:
    """Resolve the options of every ``LockGuard`` task of ``app``; raise the first ``ConfigurationError``.

    Run when the worker starts (``worker_init``), so a bad deploy fails there
    instead of at the first publish of the bad task. Leaves nothing cached:
    settings stay "read at first use", so a value set on ``app.conf`` after
    this check still counts. A task that misses the app's own ``task_cls``
    (``DjangoTask``, a project base class) is only warned about, once per
    process: it still locks correctly, it just lacks what that class adds.
    """
    from ._events import logger  # kept out of import time: the worker-side modules load on use
    from ._taskclass import is_guarded, missing_task_class

    check_setting_names(app)  # also in an app without locked tasks: a typo there is a typo too
    locked = [app.tasks[n] for n in sorted(app.tasks) if is_guarded(app.tasks[n])]
    if not locked:
        return
    had_settings = "_lockguard_settings" in app.__dict__
    try:
        for task in locked:
            resolve_task_options(task)  # loads the settings first; caches no options
    finally:
        if not had_settings:
            app.__dict__.pop("_lockguard_settings", None)
    for task in locked:
        reason = missing_task_class(task)
        if reason is not None and (id(app), task.name) not in _warned_task_cls:
            _warned_task_cls.add((id(app), task.name))
            logger.warning("lock.task_cls_missing", task_name=task.name, option="task_cls", reason=reason)


#: (app id, task name) pairs already warned about a missing ``task_cls``: the check runs at finalize and at
#: worker start, and once is enough.
_warned_task_cls: set[tuple[int, str]] = set()


def resolve_task_options(task: Any) -> TaskOptions:
    """Resolve a task's options against the app's settings, raising ``ConfigurationError``."""
    s = settings(task.app)
    name = task.name
    check_option_names(task)

    def choice(option: str, value: Any, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise ConfigurationError(f"task {name!r}: option {option}={value!r} must be one of {allowed}")
        return str(value)

    try:
        signature = inspect.signature(task.run)
    except (TypeError, ValueError) as exc:  # pragma: no cover - builtins only
        raise ConfigurationError(f"task {name!r}: cannot read the signature of its body: {exc}") from exc
    own_key = _static(task, "lock_key")
    key_source = own_key if own_key is not None else s.keys.get(name)
    lock_key = _lock_key(key_source, signature, name)
    idem_source = _static(task, "idempotency_key")
    idem = KeyRenderer(idem_source, signature, name, "idempotency_key") if idem_source is not None else None
    ttl = _seconds("option", "lock_ttl", task.lock_ttl if task.lock_ttl is not None else s.default_ttl, name)
    hard_limit = task.time_limit if task.time_limit is not None else task.app.conf.get("task_time_limit")
    max_hold_src = task.lock_max_hold if task.lock_max_hold is not None else (hard_limit or 3600)
    max_hold = _seconds("option", "lock_max_hold", max_hold_src, name)
    queue_lock_ttl = _seconds(
        "option", "queue_lock_ttl", task.queue_lock_ttl if task.queue_lock_ttl is not None else 3600, name
    )
    completion_ttl_src = task.completion_ttl if task.completion_ttl is not None else s.completion_ttl
    # An explicit 0 is an error, not "the default": test for None, never for truth.
    ttl_task = _seconds(
        "option", "completion_ttl", s.visibility_timeout if completion_ttl_src is None else completion_ttl_src, name
    )
    ttl_scope = _seconds("option", "completion_ttl", 86400 if completion_ttl_src is None else completion_ttl_src, name)
    max_waits = task.lock_max_waits if task.lock_max_waits is not None else s.max_waits
    if not isinstance(max_waits, int) or isinstance(max_waits, bool) or max_waits < 0:
        raise ConfigurationError(f"task {name!r}: option lock_max_waits={max_waits!r} must be an int >= 0")
    replicas = getattr(task, "lock_replicas", 0)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ConfigurationError(f"task {name!r}: option lock_replicas={replicas!r} must be an int >= 0")
    debounce = _debounce_option(task, s, lock_key is not None)
    if debounce is not None and task.lock_mode != "while_running":
        raise ConfigurationError(
            f"task {name!r}: option lock_debounce={debounce!r} works with lock_mode='while_running' only "
            f"(lock_mode={task.lock_mode!r} dedupes queued copies at publish, which debounce replaces)"
        )
    if not isinstance(task.lock_renew, bool):
        raise ConfigurationError(f"task {name!r}: option lock_renew={task.lock_renew!r} must be True or False")
    mode = choice("lock_mode", task.lock_mode, LOCK_MODES)
    on_locked = choice("on_locked", task.on_locked if task.on_locked is not None else s.on_locked, ON_LOCKED)
    if debounce is not None and on_locked == "raise":
        raise ConfigurationError(
            f"task {name!r}: option on_locked='raise' does not combine with lock_debounce={debounce!r}: a publish "
            "during a run is one more run after it, so its delivery waits for the running body (use 'skip' or 'retry')"
        )
    limit, rate = _limits(task, s, mode)
    namespace = _namespace_option(task, idem is not None)
    if isinstance(lock_key, EntityKeys) and lock_key.several and not lock_key.callable:
        refuse_with_several(name, lock_key.source, limit, rate, debounce)
    if debounce is not None and (limit > 1 or rate is not None):
        raise ConfigurationError(
            f"task {name!r}: option lock_debounce={debounce!r} runs one burst's run at a time on the single "
            "lease; it does not combine with lock_limit or lock_rate"
        )
    return TaskOptions(
        task_name=name,
        lock_key=lock_key,
        idempotency_key=idem,
        ttl=ttl,
        renew=task.lock_renew,
        max_hold=max_hold,
        mode=mode,
        queue_lock_ttl=queue_lock_ttl,
        on_locked=on_locked,
        on_unavailable=choice(
            "on_unavailable",
            task.on_unavailable if task.on_unavailable is not None else s.on_unavailable,
            ON_UNAVAILABLE,
        ),
        completion=bool(task.completion),
        completion_ttl_task=ttl_task,
        completion_ttl_scope=ttl_scope,
        max_waits=max_waits,
        signature=signature,
        replicas=replicas,
        idempotency_mismatch=choice(
            "idempotency_mismatch",
            task.idempotency_mismatch if task.idempotency_mismatch is not None else s.idempotency_mismatch,
            ON_KEY_REUSED,
        ),
        debounce=debounce,
        limit=limit,
        rate=rate,
        idempotency_namespace=namespace,
    )


def _lock_key(source: Any, signature: inspect.Signature, name: str) -> KeyRenderer | EntityKeys | None:
    """``lock_key``: one template, a sequence of templates (several entities), or a callable returning either.

    A sequence naming one template (after deduplication) is that template: one entity, the single lease.
    """
    if source is None:
        return None
    if is_sequence(source) and source and all(isinstance(m, str) for m in source) and len(set(source)) == 1:
        source = source[0]
    if is_sequence(source) or callable(source):
        return EntityKeys(source, signature, name, "lock_key")
    return KeyRenderer(source, signature, name, "lock_key")


def refuse_with_several(name: str, keys: Any, limit: int, rate: Any, debounce: float | None) -> None:
    """``lock_limit``, ``lock_rate`` and ``lock_debounce`` do not combine with several entities (docs/multi-entity.md).

    Slots and start windows count starts per entity; a set of entities has no one window to count in, and
    a debounce burst replaces the pending run of one entity. Refused rather than guessed.
    """
    for option, value, bad in (
        ("lock_limit", limit, limit > 1),
        ("lock_rate", rate.text if rate is not None else None, rate is not None),
        ("lock_debounce", debounce, debounce is not None),
    ):
        if bad:
            raise ConfigurationError(
                f"task {name!r}: option {option}={value!r} does not combine with several entities "
                f"(lock_key={keys!r}): slots, start windows and debounce count per entity; use one lock_key"
            )


def _namespace_option(task: Any, keyed: bool) -> str | None:
    """``idempotency_namespace``: a short plain name, on a task with an ``idempotency_key``.

    Without an ``idempotency_key`` the scope is the task id, which no other task shares: a
    namespace there would be a no-op the reader takes for sharing.
    """
    value = getattr(task, "idempotency_namespace", None)
    if value is None:
        return None
    if not isinstance(value, str) or NAMESPACE.match(value) is None:
        raise ConfigurationError(
            f"task {task.name!r}: option idempotency_namespace={value!r} must be a name of 1-64 letters, digits, "
            "'_', '.' or '-' (starting with a letter or digit), shared by the tasks whose records answer each other"
        )
    if not keyed:
        raise ConfigurationError(
            f"task {task.name!r}: option idempotency_namespace={value!r} needs an idempotency_key: without one "
            "the scope is the task id, which no other task shares"
        )
    return value


def _debounce_option(task: Any, s: Settings, locked: bool) -> float | None:
    """``lock_debounce`` (else ``lockguard_debounce[task.name]``): seconds > 0, on a task with a ``lock_key``.

    Not on an ``idempotency_key`` alone: the completion scope would then be the entity, and the first
    burst's record would answer (or refuse, as other arguments) every later burst.
    """
    value = getattr(task, "lock_debounce", None)
    if value is None:
        value = (s.debounce or {}).get(task.name)
    if value is None:
        return None
    seconds = _seconds("option", "lock_debounce", value, task.name)
    if not locked:
        raise ConfigurationError(
            f"task {task.name!r}: option lock_debounce={value!r} needs a lock_key: debounce replaces the pending "
            "run of one entity (an idempotency_key alone would make the first burst's record answer every later one)"
        )
    return seconds
