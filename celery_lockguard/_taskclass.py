"""What lockguard asks of task classes: which class is ours, which of the app's it may adopt, how a body runs.

Kept apart from :mod:`celery_lockguard._task` so that the modules ``_task`` imports
(``_config`` validating options and the app's ``task_cls``) can ask about task classes
without importing ``_task`` back. ``LockGuard`` is found by a marker in its own class
dict (:data:`GUARD_MARKER`), never by importing it: a class is ours when that marker is
in its MRO.
"""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.app import trace as _trace

#: Set in ``LockGuard``'s own class dict (and nowhere else): the class it marks is the mixin itself.
GUARD_MARKER = "_lockguard_guard"

_CELERY_CALL = Task.__dict__["__call__"]


def guard_of(cls: type) -> type[Any] | None:
    """``LockGuard`` as found in ``cls``'s MRO, or ``None`` when ``cls`` is not one of ours."""
    return next((k for k in cls.__mro__ if k.__dict__.get(GUARD_MARKER)), None)


def is_guarded(task: Any) -> bool:
    """Whether ``task`` (an instance) is a ``LockGuard`` task: ``isinstance(task, LockGuard)`` without the import."""
    return guard_of(type(task)) is not None


def configured_task_class(app: Any) -> type | None:
    """The app's default task class when it is one of its own: not Celery's ``Task``, not already a ``LockGuard``.

    Read from ``app.Task``, not ``app.task_cls``: ``app.Task = MyBase`` is
    Celery's documented way to change the default base and leaves ``task_cls``
    alone. Celery's own ``app.Task`` is an app-bound subclass of ``task_cls``
    (``subclass_with_self``, the app in its class dict as ``_app``); the class
    the user chose is the first base past those.
    """
    try:
        configured = app.Task
    except Exception:  # noqa: BLE001 - an unimportable task_cls fails Celery itself, louder than we could
        return None
    while isinstance(configured, type) and vars(configured).get("_app") is app and configured.__bases__:
        configured = configured.__bases__[0]
    if not isinstance(configured, type) or not issubclass(configured, Task):
        return None
    if configured is Task or guard_of(configured) is not None:
        return None
    return configured


def shadowed_names(configured: type, guard: type) -> list[str]:
    """Names ``configured`` defines that ``guard`` (``LockGuard``) defines too (and Celery's ``Task`` does not).

    Ours come first in the MRO and would shadow them silently: a project base
    class with its own ``lock`` or ``checkpoint`` would read lockguard's. Hooks
    both override (``__call__``, ``retry``, ...) are not clashes: they chain
    through ``super()`` (``apply_async`` is a case of its own:
    :func:`publishes_itself`).
    """
    ours = {name for name in vars(guard) if not name.startswith("__")} - set(dir(Task))
    theirs: set[str] = set()
    for cls in configured.__mro__:
        if not issubclass(cls, Task) or cls is Task:
            continue
        theirs.update(vars(cls))
    return sorted(ours & theirs)


def publishes_itself(configured: type) -> type | None:
    """The class below Celery's ``Task`` in ``configured``'s MRO that overrides ``apply_async``, or ``None``.

    With ``LockGuard`` first, the claim is rendered from the arguments *we*
    were given, before that ``apply_async`` runs: one that adds or rewrites
    arguments (a tenant id from a context variable) would make different work
    share one claim key, and the second publish would be answered with the
    first's job and never sent. ``LockedTask`` cannot know what it does, so it
    does not adopt such a class; the user composes in the order that fits.
    ``DjangoTask`` only adds ``*_on_commit`` methods and stays adoptable.
    """
    for cls in configured.__mro__:
        if cls is Task:
            return None
        if "apply_async" in vars(cls):
            return cls
    return None


def refusal(configured: type, guard: type) -> str | None:
    """Why ``LockedTask`` does not adopt ``configured`` under ``guard`` (``LockGuard``), or ``None`` if it may."""
    shadowed = shadowed_names(configured, guard)
    if shadowed:
        return f"it defines {', '.join(shadowed)}, which LockGuard defines too"
    publisher = publishes_itself(configured)
    if publisher is not None:
        where = "its" if publisher is configured else f"{publisher.__qualname__}'s"
        return (
            f"{where} apply_async runs after lockguard computes the claim, so arguments it adds or rewrites "
            "would not be part of the claim key"
        )
    return None


def adoptable_task_class(app: Any, guard: type) -> type | None:
    """The app's default task class if ``LockedTask`` may put it under a function's task (``guard``), else ``None``."""
    configured = configured_task_class(app)
    if configured is None or refusal(configured, guard) is not None:
        return None
    return configured


def missing_task_class(task: Any) -> str | None:
    """Why ``task`` (a ``LockGuard``) lacks the app's non-default task class, or ``None`` if it does not.

    Said at worker start (logged, never fatal): the task still locks, but the
    app's class (``DjangoTask.delay_on_commit``, a project's ``__call__``) is
    not part of it, which a user of ``base=LockedTask`` rarely means.
    """
    configured = configured_task_class(task.app)
    guard = guard_of(type(task))
    if configured is None or guard is None or isinstance(task, configured):
        return None
    where = f"{configured.__module__}.{configured.__qualname__}"
    refused = refusal(configured, guard)
    why = f" (LockedTask does not adopt it: {refused})" if refused else ""
    name = configured.__name__
    how = f"class Locked{name}(LockGuard, {name}) and base= that class"
    if publishes_itself(configured) is not None and not shadowed_names(configured, guard):
        how = (
            f"class Locked{name}(LockGuard, {name}) claims before its apply_async, "
            f"class Locked{name}({name}, LockGuard) claims on the final message (its __call__ must end in "
            "super().__call__()); base= the one that fits"
        )
    return (
        f"task {task.name!r} does not derive from the app's task_cls {where}{why}; "
        f"compose the lease with it explicitly: {how} (docs/django.md)"
    )


def runs_plainly(cls: type) -> bool:
    """Whether the ``__call__`` after ``LockGuard``'s in ``cls``'s MRO is Celery's own ``Task.__call__``.

    The MRO part is kept in the class's own ``__dict__`` (never inherited: a subclass may add a
    ``__call__``); whether ``Task.__call__`` is still Celery's -- or the worker's stack protection
    around it, whose fast path this is -- is asked every time (a wrapper may be patched on later).
    """
    known = cls.__dict__.get("_lockguard_plain_call")
    if known is None:
        mro = cls.__mro__
        after = mro[mro.index(guard_of(cls)) + 1 :]
        known = next((k for k in after if "__call__" in k.__dict__), None) is Task
        type.__setattr__(cls, "_lockguard_plain_call", known)
    if not known:
        return False
    current = Task.__dict__["__call__"]
    if current is _CELERY_CALL:
        return True
    protected = getattr(Task, "_stackprotected", False) and getattr(current, "__name__", "") == "__protected_call__"
    return bool(protected and _trace._patched.get("BaseTask.__call__") is _CELERY_CALL)
