"""The billing tasks, one per row of the decision matrix (docs/model.md).

* ``charge_invoice`` -- money: lease, idempotency key, checkpointed provider
  call, fenced ledger write.
* ``send_receipt_email`` -- a retryable side effect: idempotency key (the task
  locks on it) and a completion record.
* ``sync_tenant`` -- long-running: a short lease renewed while the body runs,
  checked before every write.
* ``reindex_catalog`` -- single-flight, scheduled by celery beat.
"""

from __future__ import annotations

import time
from typing import Any

from celery_lockguard import LockedTask, LockLost, advance_fence

from . import ledger, provider
from .celery_app import app


@app.task(
    base=LockedTask,
    bind=True,
    name="billing.charge_invoice",
    lock_key="invoice:{invoice_id}",
    idempotency_key="invoice:{invoice_id}:charge",
    lock_ttl=30,
)
def charge_invoice(self: LockedTask, invoice_id: int, amount_cents: int) -> dict[str, Any]:
    """Charge an invoice once, however often the job is sent or redelivered."""
    # Once per scope: a replay (redelivery after a crash) gets the recorded charge back.
    # The scope doubles as the provider's idempotency key for the instant before it is recorded.
    charge = self.checkpoint(
        "provider.charge", provider.charge, invoice_id, amount_cents, idempotency_key=self.completion_scope
    )
    with ledger.transaction() as conn:
        fence = advance_fence(conn, self.lock, table=ledger.FENCES)  # StaleFence: a newer holder wrote
        ledger.post(conn, invoice_id, "charge", amount_cents, charge["charge_id"], fence, self.request.id)
    send_receipt_email.delay(invoice_id)
    return charge


@app.task(
    base=LockedTask,
    bind=True,
    name="billing.send_receipt_email",
    idempotency_key="receipt:{invoice_id}",
    lock_ttl=10,
)
def send_receipt_email(self: LockedTask, invoice_id: int) -> str:
    """Send the receipt once per invoice: copies sent later find the completion record and skip."""
    return provider.send_email(invoice_id, idempotency_key=self.completion_scope)


@app.task(base=LockedTask, bind=True, name="billing.sync_tenant", lock_ttl=3, max_retries=5)
def sync_tenant(self: LockedTask, tenant_id: str, pages: int = 8) -> int:
    """Pull a tenant's pages into the ledger; the lease (key from ``lockguard_keys``) is renewed meanwhile.

    Each page is its own fenced transaction, so a lost lease stops the sync
    between pages; the retry writes the pages again (the writes are upserts).
    """
    try:
        for page in range(pages):
            time.sleep(0.25)  # fetch the page from the tenant's API
            self.lock.ensure_held()  # LockLost once the lease is gone: stop writing
            with ledger.transaction() as conn:
                fence = advance_fence(conn, self.lock, table=ledger.FENCES)
                ledger.sync_page(conn, tenant_id, page, fence)
    except LockLost as exc:
        raise self.retry(exc=exc, countdown=1) from exc
    return pages


@app.task(base=LockedTask, bind=True, name="billing.reindex_catalog", lock_key="catalog:reindex", lock_ttl=10)
def reindex_catalog(self: LockedTask) -> str:
    """Rebuild the search index; single-flight, so overlapping beat ticks are skipped."""
    run_id = self.request.id
    with ledger.transaction() as conn:
        ledger.execute(conn, "INSERT INTO catalog_runs (run_id, started_at) VALUES (?, ?)", (run_id, time.time()))
    for _ in range(6):
        time.sleep(0.25)  # index a batch of products
        self.lock.ensure_held()
    with ledger.transaction() as conn:
        ledger.execute(conn, "UPDATE catalog_runs SET finished_at = ? WHERE run_id = ?", (time.time(), run_id))
    return run_id
