"""Settings (``lockguard_*``) and per-task options, validated once and frozen.

Settings are read from ``app.conf`` at first use, never through
``app.add_defaults`` (which would shadow values the user sets later). Each is
found as ``lockguard_x`` or, for ``config_from_object(..., namespace="CELERY")``
users, as ``CELERY_LOCKGUARD_X``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .exceptions import ConfigurationError
from .keys import KeyRenderer

ON_LOCKED = ("skip", "retry", "raise")
ON_UNAVAILABLE = ("fail_closed", "fail_open")
LOCK_MODES = ("while_running", "until_started", "until_done")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+socket://")

_MISSING = object()


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


def _broker_redis_url(app: Any) -> str | None:
    url = app.conf.get("broker_url") or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    url = str(url).split(";")[0].strip()
    return url if url.startswith(REDIS_SCHEMES) else None


def load_settings(app: Any) -> Settings:
    """Read and validate the ``lockguard_*`` settings of ``app``."""
    key_prefix = str(setting(app, "key_prefix", "lockguard"))
    if not key_prefix or any(c in key_prefix for c in "{}") or any(c.isspace() for c in key_prefix):
        raise ConfigurationError(
            f"setting lockguard_key_prefix={key_prefix!r} must be non-empty, without braces or spaces"
        )
    on_locked = setting(app, "on_locked", "skip")
    if on_locked not in ON_LOCKED:
        raise ConfigurationError(f"setting lockguard_on_locked={on_locked!r} must be one of {ON_LOCKED}")
    on_unavailable = setting(app, "on_unavailable", "fail_closed")
    if on_unavailable not in ON_UNAVAILABLE:
        raise ConfigurationError(f"setting lockguard_on_unavailable={on_unavailable!r} must be one of {ON_UNAVAILABLE}")
    default_ttl = _positive("setting", "lockguard_default_ttl", setting(app, "default_ttl", 30))
    keys = setting(app, "keys", None) or {}
    if not isinstance(keys, dict):
        raise ConfigurationError(f"setting lockguard_keys={keys!r} must be a dict of task name -> template")
    transport = app.conf.get("broker_transport_options") or {}
    max_waits = setting(app, "max_waits", 100)
    if not isinstance(max_waits, int) or isinstance(max_waits, bool) or max_waits < 0:
        raise ConfigurationError(f"setting lockguard_max_waits={max_waits!r} must be an int >= 0")
    completion_ttl = setting(app, "completion_ttl", None)
    if completion_ttl is not None:
        completion_ttl = _positive("setting", "lockguard_completion_ttl", completion_ttl)
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
        socket_timeout=_positive("setting", "lockguard_socket_timeout", setting(app, "socket_timeout", 5.0)),
        max_waits=max_waits,
        visibility_timeout=float(transport.get("visibility_timeout", 3600)),
        fence_ttl=_positive("setting", "lockguard_fence_ttl", setting(app, "fence_ttl", 30 * 86400)),
        shorten_grace=_positive("setting", "lockguard_shorten_grace", setting(app, "shorten_grace", 2.0)),
        redis_kwargs=_kwargs("lockguard_redis_kwargs", setting(app, "redis_kwargs", None)),
        sentinel_kwargs=_kwargs("lockguard_sentinel_kwargs", setting(app, "sentinel_kwargs", None)),
    )


def _kwargs(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """Extra client keyword arguments (credentials, TLS files), kept as sorted pairs in the frozen settings."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"setting {name} must be a dict of redis-py keyword arguments")
    return tuple(sorted(value.items()))


def _completion_backend(value: Any) -> str:
    if value == "redis" or (isinstance(value, str) and value.startswith(("postgresql://", "postgres://"))):
        return str(value)
    raise ConfigurationError(f"setting lockguard_completion_backend={value!r} must be 'redis' or a 'postgresql://' DSN")


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


def _positive(kind: str, name: str, value: Any, task: str | None = None) -> float:
    where = f"task {task!r}: option {name}" if task else f"{kind} {name}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{where}={value!r} must be a number of seconds > 0")
    return float(value)


@dataclass(frozen=True, eq=False)
class TaskOptions:
    """One task's resolved, validated options."""

    task_name: str
    lock_key: KeyRenderer | None
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

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    @property
    def replicas_timeout_ms(self) -> int:
        """How long ``WAIT`` may block an acquisition: a tenth of the TTL, at most one second."""
        return max(10, min(1000, self.ttl_ms // 10))

    @property
    def locked(self) -> bool:
        """Whether calls take a lease at all (a key or a scope to lock on)."""
        return self.lock_key is not None or self.idempotency_key is not None


def _static(task: Any, option: str) -> Any:
    """An option as set, not as bound: a callable class attribute must not become a method."""
    value = inspect.getattr_static(task, option, None)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def resolve_task_options(task: Any) -> TaskOptions:
    """Resolve a task's options against the app's settings, raising ``ConfigurationError``."""
    s = settings(task.app)
    name = task.name

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
    lock_key = KeyRenderer(key_source, signature, name, "lock_key") if key_source is not None else None
    idem_source = _static(task, "idempotency_key")
    idem = KeyRenderer(idem_source, signature, name, "idempotency_key") if idem_source is not None else None
    ttl = _positive("option", "lock_ttl", task.lock_ttl if task.lock_ttl is not None else s.default_ttl, name)
    hard_limit = task.time_limit if task.time_limit is not None else task.app.conf.get("task_time_limit")
    max_hold_src = task.lock_max_hold if task.lock_max_hold is not None else (hard_limit or 3600)
    max_hold = _positive("option", "lock_max_hold", max_hold_src, name)
    queue_lock_ttl = _positive(
        "option", "queue_lock_ttl", task.queue_lock_ttl if task.queue_lock_ttl is not None else 3600, name
    )
    completion_ttl_src = task.completion_ttl if task.completion_ttl is not None else s.completion_ttl
    ttl_task = _positive("option", "completion_ttl", completion_ttl_src or s.visibility_timeout, name)
    ttl_scope = _positive("option", "completion_ttl", completion_ttl_src or 86400, name)
    max_waits = task.lock_max_waits if task.lock_max_waits is not None else s.max_waits
    if not isinstance(max_waits, int) or isinstance(max_waits, bool) or max_waits < 0:
        raise ConfigurationError(f"task {name!r}: option lock_max_waits={max_waits!r} must be an int >= 0")
    replicas = getattr(task, "lock_replicas", 0)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ConfigurationError(f"task {name!r}: option lock_replicas={replicas!r} must be an int >= 0")
    if not isinstance(task.lock_renew, bool):
        raise ConfigurationError(f"task {name!r}: option lock_renew={task.lock_renew!r} must be True or False")
    return TaskOptions(
        task_name=name,
        lock_key=lock_key,
        idempotency_key=idem,
        ttl=ttl,
        renew=task.lock_renew,
        max_hold=max_hold,
        mode=choice("lock_mode", task.lock_mode, LOCK_MODES),
        queue_lock_ttl=queue_lock_ttl,
        on_locked=choice("on_locked", task.on_locked if task.on_locked is not None else s.on_locked, ON_LOCKED),
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
    )
