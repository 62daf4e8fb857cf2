"""Server errors classified by what they mean, not by their Python class.

redis-py maps only some error codes to classes: ``BUSY``, ``NOREPLICAS`` and
``MISCONF`` arrive as a plain ``ResponseError`` (so do errors raised by a
command inside a Lua script on older servers), while ``AuthenticationError``
is a subclass of ``ConnectionError``. Catching by class therefore both misses
outages and mistakes a wrong password for one. :func:`classify` reads the
reply itself:

* ``"unavailable"``: a transient state of the store (connection lost, timeout,
  a busy, loading, full, read-only or replica-less server, a Cluster in
  transition, a PostgreSQL outage). The task's ``on_unavailable`` applies.
* ``"misconfigured"``: retrying cannot help (ACL, CROSSSLOT, authentication,
  scripting unavailable, a corrupt fence counter). The task fails with
  :class:`~celery_lockguard.exceptions.ConfigurationError` before any body runs.
* ``None``: anything else is a bug; let it propagate.
"""

from __future__ import annotations

import re
import sys
from typing import Literal

import redis

from .exceptions import ConfigurationError, CorruptFence

ErrorKind = Literal["unavailable", "misconfigured"]

#: Classes that mean "the lock store is unavailable" by class alone. ``except UNAVAILABLE_ERRORS``
#: is a coarse filter: it misses replies redis-py leaves as a plain ``ResponseError`` (BUSY,
#: NOREPLICAS, MISCONF...) and it includes ``AuthenticationError`` (a ``ConnectionError``), which
#: :func:`classify` calls misconfigured. Where a reply can arrive, catch broadly and classify.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (LOADING) and MaxConnectionsError
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # READONLY: a demoted primary after a failover
    redis.exceptions.OutOfMemoryError,  # noeviction and full: no lease can be written
    redis.exceptions.ClusterDownError,  # includes MasterDownError (MASTERDOWN)
    redis.exceptions.SlotNotCoveredError,  # Cluster: no node serves the key's slot right now
    redis.exceptions.TryAgainError,
    OSError,
)

#: Classes that are a misconfiguration whatever their base class says.
MISCONFIGURED_ERRORS: tuple[type[BaseException], ...] = (
    CorruptFence,
    ConfigurationError,
    redis.exceptions.AuthenticationError,  # WRONGPASS, NOAUTH (a ConnectionError subclass)
    redis.exceptions.AuthorizationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
    redis.exceptions.NoPermissionError,  # NOPERM
    redis.exceptions.ClusterCrossSlotError,  # CROSSSLOT
    redis.exceptions.NoScriptError,  # scripts.Script reloads once: one reaching here survived a reload
)

#: Reply codes (first word of the error reply) of transient server states.
UNAVAILABLE_CODES = frozenset(
    {"BUSY", "LOADING", "NOREPLICAS", "TRYAGAIN", "MASTERDOWN", "MISCONF", "OOM", "CLUSTERDOWN", "READONLY"}
)

#: Reply codes that no retry can fix.
MISCONFIGURED_CODES = frozenset({"NOPERM", "CROSSSLOT", "WRONGPASS", "NOAUTH", "NOSCRIPT", "LOCKGUARD_CORRUPT_FENCE"})

#: Plain ``ERR`` replies that no retry can fix: scripting disabled or renamed (managed services),
#: an ACL denial of a command or key called inside a script (Redis 7.0 reports it as ERR).
MISCONFIGURED_TEXTS = (
    "unknown command",
    "the user executing the script can't",
    "no permissions to",  # Redis 7.2+ and Valkey: "ACL failure in script: ... no permissions to run ..."
    "unauthenticated",  # a server that requires AUTH closing an unauthenticated request (redis-py < 6)
)

# Redis < 7 wraps the error of a command called by a script: "Error running script ...: -NOREPLICAS ...".
_EMBEDDED_CODE = re.compile(r"-([A-Z_]{3,})\s")


#: The reply code behind each class redis-py maps a reply to (most specific first).
_CLASS_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (redis.exceptions.NoPermissionError, "NOPERM"),
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.ClusterCrossSlotError, "CROSSSLOT"),
)

#: redis-py's wrappers around the server's reply: a pipeline's failed command, an aborted MULTI/EXEC.
_WRAPPED = re.compile(
    r"^(?:Command # \d+ \(.*?\) of pipeline caused error: |Transaction discarded because of: )(.*)$", re.DOTALL
)


def reply_text(exc: BaseException) -> str:
    """The server's reply as it was sent: redis-py strips the code of errors it maps to a class.

    A reply inside a pipeline (``Command # 1 (...) of pipeline caused error: NOREPLICAS ...``) or an
    aborted transaction (``Transaction discarded because of: BUSY ...``) is unwrapped to the reply.
    """
    text = str(exc)
    wrapped = _WRAPPED.match(text)
    if wrapped:
        return wrapped.group(1)
    code = getattr(exc, "status_code", None) or _class_code(exc)
    if isinstance(exc, redis.exceptions.ResponseError) and code and not text.startswith(code):
        return f"{code} {text}"
    return text


def _class_code(exc: BaseException) -> str | None:
    """The reply code redis-py stripped when it mapped the reply to ``exc``'s class (redis-py < 6 keeps no code)."""
    for cls, code in _CLASS_CODES:
        if isinstance(exc, cls):
            return code
    return None


def _reply_code(exc: redis.exceptions.ResponseError) -> str:
    text = reply_text(exc)
    code = text.split(" ", 1)[0].lstrip("-").upper()
    if code in UNAVAILABLE_CODES or code in MISCONFIGURED_CODES:
        return code
    if "Error running script" in text:
        found = _EMBEDDED_CODE.search(text)
        if found:
            return found.group(1)
    return code


def classify(exc: BaseException) -> ErrorKind | None:
    """``"unavailable"``, ``"misconfigured"`` or ``None`` (not a server state: a bug, let it propagate)."""
    if isinstance(exc, MISCONFIGURED_ERRORS):
        return "misconfigured"
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return "unavailable"
    if isinstance(exc, redis.exceptions.ResponseError):
        code = _reply_code(exc)
        if code in UNAVAILABLE_CODES:
            return "unavailable"
        text = str(exc).lower()
        if code in MISCONFIGURED_CODES or any(marker in text for marker in MISCONFIGURED_TEXTS):
            return "misconfigured"
        return None
    psycopg = sys.modules.get("psycopg")  # optional: if it was never imported, this is not its error
    if psycopg is not None and isinstance(exc, psycopg.OperationalError):
        return "unavailable"  # connection refused or lost, server shutting down or starting up
    return None


def _fix(exc: BaseException) -> str:
    """The likely fix for a misconfiguration, by its reply."""
    code = _reply_code(exc) if isinstance(exc, redis.exceptions.ResponseError) else ""
    text = str(exc).lower()
    if isinstance(exc, CorruptFence) or code == "LOCKGUARD_CORRUPT_FENCE":
        return "repair the fence counter (an integer at least the last fence issued) or delete it"
    if (
        isinstance(exc, redis.exceptions.NoPermissionError)
        or code == "NOPERM"
        or "script can't" in text
        or "no permissions to" in text
    ):
        return "grant the lock user the commands and keys in celery_lockguard.acl (acl.rule(prefix))"
    if isinstance(exc, redis.exceptions.ClusterCrossSlotError) or code == "CROSSSLOT":
        return "keys of one call must share a slot: keep the {K} hash tag in lock_key/idempotency_key templates"
    if (
        isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError))
        or code in ("WRONGPASS", "NOAUTH")
        or "unauthenticated" in text
    ):
        return "check the credentials in lockguard_redis_url / lockguard_redis_kwargs"
    if isinstance(exc, redis.exceptions.NoScriptError) or code == "NOSCRIPT":
        return (
            "the server dropped the script right after SCRIPT LOAD: a proxy or a server that does not keep "
            "scripts; celery-lockguard needs EVALSHA and SCRIPT LOAD on the node that serves the key"
        )
    if "unknown command" in text:
        return "the server does not offer Lua scripting (EVALSHA, SCRIPT LOAD): use a Redis that does"
    return "see docs/failure-modes.md"


def configuration_error(exc: BaseException, task_name: str | None, operation: str) -> ConfigurationError:
    """A :class:`ConfigurationError` naming the task, the operation (e.g. ``"ACQUIRE"``), the reply and the fix."""
    if isinstance(exc, ConfigurationError):
        return exc
    who = f"task {task_name!r}" if task_name else "celery-lockguard"
    return ConfigurationError(
        f"{who}: {operation} was refused by the lock store ({exc.__class__.__name__}: {reply_text(exc)}); "
        f"retrying cannot help. Likely fix: {_fix(exc)}"
    )


def describe(exc: BaseException | None) -> str:
    """An error as an event's ``reason`` reads it: class and message ("" for none)."""
    return f"{exc.__class__.__name__}: {exc}" if exc is not None else ""
