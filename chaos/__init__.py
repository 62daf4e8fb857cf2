"""The chaos soak: real prefork workers under faults, and a checker that proves nothing went wrong.

``python -m chaos.soak`` (``make chaos``; ``make chaos-quick`` for the bounded
CI run) publishes jobs over entities with duplicate enqueues, kills worker
children, pauses a worker past its TTL, restarts the lock Redis without
persistence and lets a short ``visibility_timeout`` redeliver running
messages; then it checks the PostgreSQL ledger and the execution history.
See docs/chaos.md.

* :mod:`chaos.app` -- the Celery app the workers run (configured by ``CHAOS_CONFIG``).
* :mod:`chaos.fleet` -- worker processes and the faults applied to them.
* :mod:`chaos.check` -- the invariants, as pure functions over the recorded rows.
* :mod:`chaos.soak` -- the driver: plan, publish, inject, drain, check, report.
"""
