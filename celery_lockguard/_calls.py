"""A call's rendered names: entity key K, completion scope S, arguments digest.

Rendered once per delivery (and per publish in the queue-time modes) from the
task's options and the call's arguments; every later step reads these names
instead of rendering again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _keys as keys
from ._config import TaskOptions, refuse_with_several
from ._entities import EntityKeys


class CallNames(NamedTuple):
    """What one call is about: the entity it locks, the scope it records, and its work's digest.

    A named tuple, not a frozen dataclass: it is made on every delivery, and a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``.
    """

    #: The entity key K (no prefix), e.g. ``invoice:42``.
    key: str
    #: The completion scope S: the rendered ``idempotency_key``, or the task id.
    scope: str
    #: Digest of the bound arguments: same task name and digest means identical work.
    digest: str
    #: True when the scope is the task id (records live ``completion_ttl_task``, not the scope TTL).
    scope_is_task: bool
    #: Where the completion record and checkpoints live: S of this task (``by:<task>:<S>``), of the
    #: tasks sharing its ``idempotency_namespace`` (``ns:<name>:<S>``), or the task-id scope itself.
    record: str
    #: Several entities (``lock_key`` as a sequence): every entity key, sorted and deduplicated, ``key``
    #: being the first (the anchor: queue claims, park and watch markers live there). ``()``: one entity.
    keys: tuple[str, ...] = ()


def render(opts: TaskOptions, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallNames:
    """Bind ``args``/``kwargs`` to the task's signature and render K, S and the digest."""
    names = opts.positional_names
    positional = names is not None and not kwargs and len(args) == len(names)
    try:
        if positional:
            # What Signature.bind gives for these: every parameter by position, in order.
            arguments = dict(zip(names or (), args, strict=True))
        else:
            arguments = keys.bind(opts.signature, args, kwargs)
    except TypeError as exc:
        raise TypeError(f"task {opts.task_name!r}: arguments do not match its signature: {exc}") from exc
    # Outside the try: a TypeError from an argument's own __str__ is that argument's, not a signature mismatch.
    digest = keys.digest_in_order(opts.digest_order, args) if positional else keys.digest(arguments)
    if opts.idempotency_key is not None:
        scope, scope_is_task = opts.idempotency_key.render(arguments, args, kwargs), False
        record = opts.record_prefix + scope
    else:
        scope, scope_is_task = keys.task_scope(task_id), True
        record = scope
    # The lease stays on S itself (not on the record scope): calls of one effect exclude each other
    # whatever task they are, and old and new workers keep excluding each other during an upgrade.
    lock_key = opts.lock_key
    if lock_key is None:
        key = scope
    elif isinstance(lock_key, EntityKeys):
        several = lock_key.render_keys(arguments, args, kwargs)
        if len(several) > 1:
            if lock_key.callable:  # a template sequence is refused at validation; a callable per call
                refuse_with_several(opts.task_name, several, opts.limit, opts.rate, opts.debounce)
            return CallNames(several[0], scope, digest, scope_is_task, record, several)
        key = several[0]
    else:
        key = lock_key.render(arguments, args, kwargs)
    return CallNames(key, scope, digest, scope_is_task, record)


def without(call: CallNames, held: tuple[str, ...]) -> CallNames:
    """``call`` without the entities in ``held``: those its workflow already holds for it (``_workflow._run``).

    A workflow member whose ``lock_key`` names the workflow's entity and others takes leases on the others
    only: ACQUIRE on the workflow's own entity would meet the workflow lease, which carries the member's own
    task id, and read it as a redelivery of a running original. ``call`` as it is when nothing is left out.
    """
    if not call.keys:
        return call
    rest = tuple(k for k in call.keys if k not in held)
    if not rest or len(rest) == len(call.keys):
        return call
    return call._replace(key=rest[0], keys=rest if len(rest) > 1 else ())


def refuse_empty_fields(opts: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Render the call's names at publish only to refuse a bad key (``EmptyField``, ``UnstableText``) there.

    The queue-time modes render at publish anyway (they claim); the others would otherwise accept a call
    whose ``None`` or empty field names no entity and fail it later in a worker. Arguments that do not bind
    are left to Celery's own check and to the delivery, as before.
    """
    try:
        render(opts, "", args, kwargs)
    except TypeError:
        pass
