"""Exceptions raised by celery-lockguard.

Every exception keeps its constructor arguments in ``args`` so that Celery's
result backends (JSON or pickle) can rebuild it on the caller's side.

    LockGuardError
    ├── LockContended       the entity is held by other work and the wait budget is spent
    │   └── LockThrottled   the entity's start window (``lock_rate``) is full
    │   └── WorkflowDeadlock  a workflow member waits for an entity whose workflow waits for ours
    ├── LockLost            the lease expired or was taken while the body ran
    │   └── WorkflowEnded   a workflow member never ran: its workflow had already ended
    ├── AlreadyQueued       identical work already holds the queue-time claim
    ├── BackendUnavailable  the lock store could not be reached (or no lease exists)
    ├── StaleFence          storage holds a newer fence: this writer is stale
    ├── CorruptFence        the fence counter in Redis is not an exact integer: nothing was written
    ├── IdempotencyKeyReused  an idempotency key already completed with other arguments
    └── ConfigurationError  a task option or setting is invalid

This module imports nothing, so it can be imported from anywhere.
"""


class LockGuardError(Exception):
    """Base class of every celery-lockguard error."""


class LockContended(LockGuardError):
    """The entity is held by other work and this task stopped waiting."""

    def __init__(self, key: str, holder_task_id: str | None = None, ttl_ms: int | None = None) -> None:
        super().__init__(key, holder_task_id, ttl_ms)
        self.key = key
        self.holder_task_id = holder_task_id
        self.ttl_ms = ttl_ms

    def __str__(self) -> str:
        return f"lock {self.key!r} is held by task {self.holder_task_id} ({self.ttl_ms} ms left)"


class LockThrottled(LockContended):
    """The entity's start window (``lock_rate``) is full: ``on_locked="raise"``, or the wait budget is spent.

    A subclass of :class:`LockContended`, so code that handles contention handles it too;
    ``retry_after_ms`` is when the oldest start leaves the window (``ttl_ms`` carries the same).
    """

    def __init__(self, key: str, retry_after_ms: int | None = None, rate: str | None = None) -> None:
        LockGuardError.__init__(self, key, retry_after_ms, rate)
        self.key = key
        self.holder_task_id = None
        self.ttl_ms = retry_after_ms
        self.retry_after_ms = retry_after_ms
        self.rate = rate

    def __str__(self) -> str:
        return f"lock {self.key!r} is rate limited ({self.rate}): next start in {self.retry_after_ms} ms"


class LockLost(LockGuardError):
    """The lease on ``key`` is no longer valid: stop writing."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"lease on {self.key!r} was lost"


class WorkflowEnded(LockLost):
    """This workflow member never ran: its workflow ``workflow`` on ``key`` had already ended (a member failed,
    was revoked, or the lease lapsed). Stored as the member's result so nobody waits on it forever."""

    def __init__(self, key: str, workflow: str = "") -> None:
        LockGuardError.__init__(self, key, workflow)
        self.key = key
        self.workflow = workflow

    def __str__(self) -> str:
        return f"workflow {self.workflow!r} on {self.key!r} ended before this member ran: it did not run"


class WorkflowDeadlock(LockContended):
    """A workflow member's own lock on ``key`` is held by another workflow that waits for ``workflow_key``,
    the entity this member's workflow holds: neither could go on (a lock-order deadlock).

    ``cycle`` lists the entities around the cycle, starting with ``workflow_key``. Lock entities in one
    order, or declare both up front (see docs/workflows.md, "Lock order").
    """

    def __init__(self, key: str, workflow_key: str = "", cycle: tuple[str, ...] | list[str] = ()) -> None:
        LockGuardError.__init__(self, key, workflow_key, list(cycle))
        self.key = key
        self.workflow_key = workflow_key
        self.cycle = list(cycle) or [workflow_key, key]
        self.holder_task_id = None
        self.ttl_ms = None

    def __str__(self) -> str:
        around = " -> ".join(repr(k) for k in [*self.cycle, self.cycle[0]])
        return (
            f"lock-order deadlock: this workflow holds {self.workflow_key!r} and its member waits for {self.key!r}, "
            f"held by another workflow that waits for {self.workflow_key!r} ({around}); lock entities in one "
            "order, or declare both entities up front"
        )


class AlreadyQueued(LockGuardError):
    """Identical work is already queued or running under ``task_id``."""

    def __init__(self, key: str, task_id: str | None = None) -> None:
        super().__init__(key, task_id)
        self.key = key
        self.task_id = task_id

    def __str__(self) -> str:
        return f"identical work for {self.key!r} is already queued as task {self.task_id}"


class IdempotencyKeyReused(LockGuardError):
    """Scope ``scope`` completed (as task ``completed_by``) with other arguments than this call's.

    The rule payment APIs follow: a key reused with different parameters is the
    caller's mistake, not a duplicate to answer with someone else's result.
    """

    def __init__(self, scope: str, completed_by: str | None = None) -> None:
        super().__init__(scope, completed_by)
        self.scope = scope
        self.completed_by = completed_by

    def __str__(self) -> str:
        return (
            f"idempotency key {self.scope!r} already completed as task {self.completed_by} "
            "with other arguments; use a new key for new work"
        )


class BackendUnavailable(LockGuardError):
    """The lock store is unreachable, or a fenced write was attempted without a lease."""


class StaleFence(LockGuardError):
    """Storage already holds ``current`` for ``key``, newer than this writer's ``fence``."""

    def __init__(self, key: str, fence: int, current: int) -> None:
        super().__init__(key, fence, current)
        self.key = key
        self.fence = fence
        self.current = current

    def __str__(self) -> str:
        return f"stale fence {self.fence} for {self.key!r}: storage already at {self.current}"


class CorruptFence(LockGuardError):
    """The fence counter ``key`` holds ``value``, not an integer a new fence can exactly follow.

    Lua numbers are doubles: past 2**53 - 1 successive holders would get the
    same fence, and a non-integer would make every fence meaningless. The
    script refuses before writing anything, so no lease is orphaned.
    """

    def __init__(self, key: str, value: str) -> None:
        super().__init__(key, value)
        self.key = key
        self.value = value

    def __str__(self) -> str:
        return (
            f"fence counter {self.key!r} holds {self.value!r}, not an integer below 2**53 - 1: nothing was written; "
            "set it to an integer at least the last fence issued (or delete it: new fences are floored by the "
            "server clock in microseconds)"
        )


class ConfigurationError(LockGuardError):
    """A task option or ``lockguard_*`` setting is invalid; names the task, option and value."""


class UnstableText(ConfigurationError):
    """An argument has no text form that is the same in every process."""


class EmptyField(ConfigurationError):
    """A key field rendered as empty text: the key would lose its entity (or its Cluster hash tag)."""


class CheckpointNotSerializable(TypeError):
    """``fn`` returned a value JSON cannot hold; the step is recorded as done with no value."""
