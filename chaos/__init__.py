"""The chaos soak: real prefork workers under faults, and a checker that proves nothing went wrong.

``python -m chaos.soak`` (``make chaos``; ``make chaos-quick`` for the bounded
CI run) runs every ``lock_mode`` x ``on_locked`` cell on both completion
backends, beside negative controls (one guard off each), while it kills worker
children, pauses a worker past its TTL, restarts the lock Redis, makes it
answer BUSY and refuse writes, cuts the completion store's PostgreSQL and lets
a short ``visibility_timeout`` redeliver running messages; then it checks the
PostgreSQL ledger, the execution history and the result backend, per cell.
See docs/chaos.md.

* :mod:`chaos.app` -- the Celery app the workers run (configured by ``CHAOS_CONFIG``): one task per cell.
* :mod:`chaos.fleet` -- worker processes and the faults applied to them.
* :mod:`chaos.proxy` -- the cuttable loopback proxy in front of the completion store's PostgreSQL.
* :mod:`chaos.check` -- the invariants, as pure functions over the recorded rows.
* :mod:`chaos.report` -- the per-leg report and the summary.
* :mod:`chaos.soak` -- the driver: plan, publish, inject, bait, drain, check, report.
* :mod:`chaos.repro` -- one-job reductions of what the soak found.
* :mod:`chaos.workflows` -- the workflow mode (``make chaos-workflows``): workflows of chains and chords
  under child kills, with :mod:`chaos.workflow_app` (its worker app) and :mod:`chaos.workflow_check` (its
  invariants).
"""
