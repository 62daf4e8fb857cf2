"""Stand-ins for the outside world: a payment provider and a mail service.

Their books live in the ledger database only so the demo can count them; in
life they are remote APIs. Like real payment providers, :func:`charge`
honours an idempotency key -- a second call with the same key returns the
first charge -- and counts calls, so the demo can show how often the task
reached it. The checkpoint keeps a retry from calling again; the provider's
key covers the instant between its reply and the checkpoint being stored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from . import ledger

#: Seconds a provider call takes (the network round trip).
LATENCY = 0.08


def charge(invoice_id: int, amount_cents: int, idempotency_key: str | None) -> dict[str, Any]:
    """Charge the customer once per ``idempotency_key``; returns ``{"charge_id", "amount_cents"}``.

    Without a key (a direct call of the task, no lock) every call is a new charge.
    """
    idempotency_key = idempotency_key or f"nokey_{uuid.uuid4().hex}"
    time.sleep(LATENCY)
    with ledger.transaction() as conn:
        ledger.execute(
            conn,
            "INSERT INTO provider_charges (idempotency_key, charge_id, invoice_id, amount_cents, calls)"
            " VALUES (?, ?, ?, ?, 1)"
            " ON CONFLICT (idempotency_key) DO UPDATE SET calls = provider_charges.calls + 1",
            (idempotency_key, f"ch_{uuid.uuid4().hex[:12]}", invoice_id, amount_cents),
        )
        row = ledger.execute(
            conn,
            "SELECT charge_id, amount_cents FROM provider_charges WHERE idempotency_key = ?",
            (idempotency_key,),
        ).fetchone()
    return {"charge_id": row[0], "amount_cents": int(row[1])}


def send_email(invoice_id: int, idempotency_key: str | None) -> str:
    """Send a receipt; mail services do not deduplicate, so every call is a message."""
    message_id = f"msg_{uuid.uuid4().hex[:12]}"
    with ledger.transaction() as conn:
        ledger.execute(
            conn,
            "INSERT INTO emails_sent (message_id, invoice_id, idempotency_key) VALUES (?, ?, ?)",
            (message_id, invoice_id, idempotency_key or ""),
        )
    return message_id
