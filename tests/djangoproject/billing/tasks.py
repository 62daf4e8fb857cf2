"""Tasks of the test project: the lease composed with ``DjangoTask``, ORM writes fenced on Django's connection."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task
from django.db import connection, connections, transaction
from django.db.models import F

from celery_lockguard import LockedTask, advance_fence
from celery_lockguard.django import LockedDjangoTask

from .models import Invoice


@shared_task(
    base=LockedDjangoTask, bind=True, name="billing.charge", lock_key="invoice:{invoice_id}", lock_mode="until_done"
)
def charge(self: Any, invoice_id: int, amount_cents: int, hold: float = 0.0) -> dict[str, Any]:
    """Mark the invoice paid; the fence and the row commit together or not at all."""
    if hold:
        time.sleep(hold)  # the slow provider call the lease is held across
    with transaction.atomic(), connection.cursor() as cursor:
        fence = advance_fence(cursor, self.lock)  # StaleFence rolls the update below back
        Invoice.objects.filter(pk=invoice_id).update(
            paid=True, amount_cents=amount_cents, charges=F("charges") + 1, fence=fence
        )
    return {"fence": fence, "ttl_ms": self.lock.ttl_ms}


@shared_task(
    base=LockedTask, bind=True, name="billing.remind", lock_key="invoice:{invoice_id}:remind", lock_mode="until_started"
)
def remind(self: Any, invoice_id: int) -> int:
    """``base=LockedTask`` under Celery's Django fixup: built over ``DjangoTask``, so it has ``*_on_commit``."""
    return Invoice.objects.filter(pk=invoice_id).update(reminders=F("reminders") + 1)


@shared_task(base=LockedDjangoTask, bind=True, name="billing.sync_tenant")
def sync_tenant(self: Any, tenant_id: str) -> dict[str, Any]:
    """No ``lock_key``: the key template comes from ``CELERY_LOCKGUARD_KEYS``, the TTL from the default."""
    return {"key": self.lock.key, "ttl_ms": self.lock.ttl_ms}


@shared_task(base=LockedDjangoTask, bind=True, name="billing.fenced_write", lock_key="note:{key}")
def fenced_write(self: Any, key: str, using: str = "default", table: str = "lockguard_fences") -> int:
    """Advance the fence of ``note:{key}`` on database ``using`` (SQLite or PostgreSQL), through Django's cursor."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        return advance_fence(cursor, self.lock, table)
