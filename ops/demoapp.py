"""A small app whose workers give every dashboard panel something to show (``ops/pictures.py`` runs it).

Configured from the environment: ``LOCKGUARD_DEMO_REDIS_URL`` (broker, results
and locks: the pictures script's own server, never a shared one) and
``LOCKGUARD_DEMO_PREFIX``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from celery import Celery

from celery_lockguard import LockedTask

REDIS_URL = os.environ.get("LOCKGUARD_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("LOCKGUARD_DEMO_PREFIX", "lgdemo")

app = Celery("lgdemo", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=f"{PREFIX}.tasks",
    lockguard_key_prefix=PREFIX,
    lockguard_metrics_flush_interval=1.0,
    broker_transport_options={"global_keyprefix": f"{PREFIX}:kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:results:"},
    result_expires=600,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


def _work(low: float, high: float) -> None:
    time.sleep(random.uniform(low, high))


@app.task(base=LockedTask, bind=True, name="billing.charge", lock_key="invoice:{invoice_id}", on_locked="retry")
def charge(self: Any, invoice_id: int) -> int:
    """Short holds on invoices, a few of them hot: contention, waits, the four numbers."""
    _work(0.05, 0.4)
    return invoice_id


@app.task(base=LockedTask, bind=True, name="tenant.sync", lock_key="tenant:{tenant}:sync", lock_ttl=1.5)
def sync(self: Any, tenant: str) -> str:
    """Multi-second holds under a short TTL: renewals (and their lag), leases held now, the oldest hold."""
    _work(2.0, 6.0)
    return tenant


@app.task(base=LockedTask, bind=True, name="reports.build", lock_key="report:{day}", lock_ttl=0.5, lock_renew=False)
def build_report(self: Any, day: str) -> str:
    """No renewal and a body longer than its TTL: leases that expire before release (and are lost)."""
    _work(0.7, 1.0)
    return day


@app.task(base=LockedTask, bind=True, name="reports.export", lock_key="export:{name}")
def export(self: Any, name: str) -> str:
    """One long hold, renewed: the oldest-hold line rises one second per second until it ends."""
    _work(80.0, 90.0)
    return name
