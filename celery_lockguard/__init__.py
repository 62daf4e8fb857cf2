"""celery-lockguard: entity-scoped Redis leases, fences and completion records for Celery tasks.

Guard the side effect, not the job: the lease reduces concurrent execution;
completion records and fencing tokens make a duplicate harmless when the
lease fails.

The public API is what ``__all__`` lists, plus the public modules
``celery_lockguard.fencing``, ``celery_lockguard.acl``,
``celery_lockguard.exceptions``, ``celery_lockguard.testing``,
``celery_lockguard.django`` (the lease composed with Celery's ``DjangoTask``,
and ``manage.py lockguard``; imported only by a Django project, as it needs
Django) and the pytest plugin ``celery_lockguard.pytest_plugin``. Modules whose
name starts with an underscore are internal: they change without notice.
"""

from . import acl
from ._completion import PostgresStore, postgres_store
from ._config import Settings, settings, validate_tasks
from ._lease import Lease
from ._task import LockedTask, LockGuard
from ._version import __version__
from ._workflow import Workflow, workflow
from .exceptions import (
    AlreadyQueued,
    BackendUnavailable,
    CheckpointNotSerializable,
    ConfigurationError,
    CorruptFence,
    EmptyField,
    IdempotencyKeyReused,
    LockContended,
    LockGuardError,
    LockLost,
    LockThrottled,
    StaleFence,
    UnstableText,
    WorkflowDeadlock,
    WorkflowEnded,
)
from .fencing import advance_fence, advisory_xact_lock, bump_fence, create_fence_table, fence_table_sql

__all__ = [
    "AlreadyQueued",
    "BackendUnavailable",
    "CheckpointNotSerializable",
    "ConfigurationError",
    "CorruptFence",
    "EmptyField",
    "IdempotencyKeyReused",
    "Lease",
    "LockContended",
    "LockGuard",
    "LockGuardError",
    "LockLost",
    "LockThrottled",
    "LockedTask",
    "PostgresStore",
    "Settings",
    "StaleFence",
    "UnstableText",
    "Workflow",
    "WorkflowDeadlock",
    "WorkflowEnded",
    "__version__",
    "acl",
    "advance_fence",
    "advisory_xact_lock",
    "bump_fence",
    "create_fence_table",
    "fence_table_sql",
    "postgres_store",
    "settings",
    "validate_tasks",
    "workflow",
]
