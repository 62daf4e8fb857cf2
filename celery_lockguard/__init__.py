"""celery-lockguard: entity-scoped Redis leases, fences and completion records for Celery tasks.

Guard the side effect, not the job: the lease reduces concurrent execution;
completion records and fencing tokens make a duplicate harmless when the
lease fails.
"""

from .exceptions import (
    AlreadyQueued,
    BackendUnavailable,
    ConfigurationError,
    LockContended,
    LockGuardError,
    LockLost,
    StaleFence,
)
from .fencing import advance_fence, advisory_xact_lock, create_fence_table
from .lease import Lease
from .task import LockedTask

__version__ = "0.1.0"

__all__ = [
    "AlreadyQueued",
    "BackendUnavailable",
    "ConfigurationError",
    "Lease",
    "LockContended",
    "LockGuardError",
    "LockLost",
    "LockedTask",
    "StaleFence",
    "__version__",
    "advance_fence",
    "advisory_xact_lock",
    "create_fence_table",
]
