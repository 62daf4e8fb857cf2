"""Lockguard's per-request state on Celery's request: the field names, and the doors that set them.

A delivery keeps its lease, its rendered names and its checkpoints on the request the body
runs under (``task.request``), where ``LockGuard.lock``, ``completion_scope`` and
``checkpoint`` read them. The task class, the delivery, its waits and a workflow member all
set them; the names live here, below all of those, so that none imports another for them.
"""

from __future__ import annotations

from typing import Any

from ._calls import CallNames
from ._lease import Lease

#: The delivery's lease (``LockGuard.lock``).
LEASE = "_lockguard_lease"
#: The delivery's rendered names (key, scope, record): ``completion_scope`` and ``checkpoint`` read them.
CALL = "_lockguard_call"
#: The checkpoint names used in this run (one set per run: a name used twice is refused).
CHECKPOINTS = "_lockguard_checkpoints"
#: When an eager call's first wait began (``_waits``: an eager call's waits are bounded).
EAGER_STARTED = "_lockguard_eager_started"
#: A fail-open delivery whose ACQUIRE errored: the give-back it owes (``_release.Orphan``), settled once, by
#: ``retry()`` before it publishes (the retry must not meet that lease as a running original) or after the body.
ORPHAN = "_lockguard_orphan"
#: Set on the request of a delivery lockguard has entered: a call of the task inside its own body is direct.
ENTERED = "_lockguard_entered"


def hold(request: Any, lease: Lease) -> None:
    """Put ``lease`` on the request: the body's ``self.lock``."""
    setattr(request, LEASE, lease)


def enter(request: Any, call: CallNames) -> None:
    """Give the body its names and a fresh set of checkpoints: ``completion_scope`` and ``checkpoint`` work."""
    setattr(request, CALL, call)
    setattr(request, CHECKPOINTS, set())


def event_fields(task: Any, call: CallNames) -> dict[str, Any]:
    """The fields every event of a delivery carries: the entity and the task id."""
    return {"lock_key": call.key, "task_id": task.request.id}
