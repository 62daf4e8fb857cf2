"""The billing app's Celery configuration: one Redis as broker, result backend and lock store.

Everything comes from the environment, so the demo (or you) can point it anywhere:

* ``LOCKGUARD_REDIS_URL`` -- the Redis (or Valkey) for all three roles;
  default ``redis://127.0.0.1:6379/0``.
* ``BILLING_PREFIX`` -- prefixes every key and the queue name, so several
  copies of the app can share one server; default ``billing``.
* ``DATABASE_URL`` / ``LEDGER_PATH`` -- the ledger (see :mod:`example_app.ledger`).

Run a worker and the beat scheduler the usual way::

    celery -A example_app.celery_app worker -P prefork -c 2
    celery -A example_app.celery_app beat
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, signals

from . import observe

REDIS_URL = os.environ.get("LOCKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BILLING_PREFIX", "billing")
QUEUE = f"{PREFIX}.tasks"

app = Celery("billing", broker=REDIS_URL, backend=REDIS_URL, include=["example_app.tasks"])
app.conf.update(
    task_default_queue=QUEUE,
    # The lock store defaults to the broker's Redis; lockguard_redis_url would separate them.
    lockguard_key_prefix=f"{PREFIX}:lockguard",
    # A key set in settings rather than on the task (sync_tenant shows this form).
    lockguard_keys={"billing.sync_tenant": "tenant:{tenant_id}:sync"},
    # A worker child killed mid-task puts its message back: the job runs again, never vanishes.
    # LockedTask then takes over the dead child's lease at once (same host, pid gone).
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={"visibility_timeout": 3600, "global_keyprefix": f"{PREFIX}:kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:results:"},
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # reindex_catalog every minute. A tick that finds the previous run still going is a
    # duplicate (same task, same arguments) and is skipped; `expires` drops ticks that
    # waited in the queue longer than one period.
    beat_schedule={
        "reindex-catalog-every-minute": {
            "task": "billing.reindex_catalog",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
    },
)


@signals.worker_init.connect
@signals.worker_process_init.connect
def _observe_lock_events(**_: Any) -> None:
    """Count lock events in every worker process (the demo's report reads the counts)."""
    observe.configure(REDIS_URL, events_key(PREFIX))


def events_key(prefix: str) -> str:
    """Redis hash where the workers count lock events, field ``<event>|<task name>|<reason>``."""
    return f"{prefix}:events"
