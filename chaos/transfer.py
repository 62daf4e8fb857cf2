"""``python -m chaos.transfer``: the multi-entity transfer soak (``make chaos-transfer``, docs/multi-entity.md).

Two real prefork workers (RabbitMQ broker, a private Redis for results and leases -- or a private three-master
Cluster with ``--cluster`` --, the test PostgreSQL for money, fences and records) run ``--transfers`` transfers
among ``--accounts`` accounts, random pairs in both orders (a few of them twice, under another task id, to be
answered from their record; a few from an account to itself). While the first half is published a SIGKILL takes
the pool child running a transfer body every ``--kill-every`` seconds on average; a watcher times how long
each entity the dead body held stays held by its pid. The control -- ``--control`` transfers with locking off,
on accounts of their own -- runs beside them.

Checked by :mod:`chaos.transfer_check`: none lost, no account in two bodies at once (PostgreSQL server
clock), fences rising per account, money moved once per transfer and conserved, no entity blocked past its
TTL after a kill; and the control caught. Exits 1 on a violation or an uncaught control. Every process and
table it made is removed on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_lockguard._keys import lock_name
from celery_lockguard.testing import LocalCluster, RedisServer, Worker, start_all, stop_all, wait_for

from .app import connect
from .transfer_app import Tables, account_of, create_app
from .transfer_check import Body, Findings, Move, check

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
OPENING = 10_000
CONTROL_BASE = 100  # control accounts are 100..100+accounts-1


@dataclass
class Outcome:
    """What a run did and found (printed by :func:`main`, asserted by tests/test_chaos_transfer.py)."""

    transfers: int = 0
    calls: int = 0
    duplicates: int = 0
    control_transfers: int = 0
    bodies: int = 0
    committed: int = 0
    answered_from_record: int = 0
    kills: int = 0
    longest_blocked: float = 0.0
    seconds: float = 0.0
    findings: Findings = field(default_factory=Findings)

    @property
    def ok(self) -> bool:
        return self.findings.ok


@contextmanager
def lock_servers(cluster: bool) -> Iterator[tuple[RedisServer, str, Any]]:
    """The results Redis, the lock Redis URL, and a client that reads lease hashes (a Cluster client on one)."""
    with RedisServer() as results:
        if not cluster:
            yield results, results.url, results.client()
            return
        with LocalCluster(3) as c:
            yield results, c.url, c.client()


def run(args: argparse.Namespace) -> Outcome:
    rng = random.Random(args.seed)
    out = Outcome()
    began = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-transfer-"))
    base = f"ctr_{uuid.uuid4().hex[:8]}"
    tables = Tables(base)
    pg = os.environ.get("LOCKGUARD_TEST_POSTGRES_URL") or DEFAULT_PG
    db = connect(pg)
    for ddl in tables.ddl():
        db.execute(ddl)
    accounts = list(range(args.accounts))
    control_accounts = [CONTROL_BASE + a for a in accounts]
    with db.transaction():
        for a in accounts + control_accounts:
            db.execute(f"INSERT INTO {tables.accounts} (id, balance) VALUES (%s, %s)", (a, OPENING))
    try:
        with lock_servers(args.cluster) as (results, lock_url, lock_client):
            cfg = {
                "broker": os.environ.get("LOCKGUARD_TEST_AMQP_URL") or DEFAULT_AMQP,
                "results": results.url,
                "lock_url": lock_url,
                "cluster": args.cluster,
                "prefix": base,
                "queue": f"{base}.q",
                "pg": pg,
                "tables": base,
                "ttl": args.ttl,
                "work_ms": args.work_ms,
                "loglevel": args.loglevel,
            }
            app = create_app(cfg)
            workers = [
                Worker(
                    "chaos.transfer_app:app",
                    control=app,
                    concurrency=args.concurrency,
                    name=f"{base}w{i}",
                    queues=[cfg["queue"]],
                    env={"CHAOS_TRANSFER": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
                    cwd=ROOT,
                    loglevel=args.loglevel,
                    log_path=log_dir / f"worker{i}.log",
                )
                for i in range(args.workers)
            ]
            try:
                start_all(workers, 90)
                states, blocked = _drive(
                    log_dir, app, workers, lock_client, cfg, tables, accounts, control_accounts, rng, args, out
                )
            finally:
                stop_all(workers)
                _delete_queue(app, cfg["queue"])
        _verdict(db, tables, accounts, control_accounts, args, out, states, blocked)
    finally:
        for t in tables.all():
            db.execute(f"DROP TABLE IF EXISTS {t}")
        db.close()
    out.seconds = time.monotonic() - began
    if not out.ok:
        print(f"worker logs in {log_dir}")
    return out


def _drive(
    log_dir: Path,
    app: Any,
    workers: list[Worker],
    lock_client: Any,
    cfg: dict[str, Any],
    tables: Tables,
    accounts: list[int],
    control_accounts: list[int],
    rng: random.Random,
    args: argparse.Namespace,
    out: Outcome,
) -> tuple[dict[str, str], list[tuple[str, float]]]:
    """Publish, kill during the first half, wait for every call; the final states and the blocked times."""
    move, unlocked = app.tasks["ctransfer.move"], app.tasks["ctransfer.unlocked"]
    kill_db = connect(cfg["pg"])
    killing = threading.Event()
    stop = threading.Event()
    blocked: list[tuple[str, float]] = []
    watchers: list[threading.Thread] = []

    def watch(pid: int, keys: list[str], killed_at: float) -> None:
        """How long each entity stays held by the dead pid (the lease hash's ``pid`` field)."""
        pending = {k: lock_name(cfg["prefix"], k) for k in keys}
        deadline = killed_at + args.ttl + 15
        while pending and time.monotonic() < deadline:
            for k, name in list(pending.items()):
                if lock_client.hget(name, "pid") != str(pid):
                    blocked.append((k, time.monotonic() - killed_at))
                    del pending[k]
            time.sleep(0.05)
        blocked.extend((k, time.monotonic() - killed_at) for k in pending)

    def running_bodies() -> list[Any]:
        """Pids of live pool children inside a transfer body, polled up to a second (bodies are short)."""
        deadline = time.monotonic() + 1.0
        while killing.is_set() and time.monotonic() < deadline:
            live = {pid for w in workers for pid in w.children()}
            running = kill_db.execute(
                f"SELECT pid FROM {tables.executions} WHERE t_end IS NULL AND NOT control AND pid = ANY(%s)",
                (sorted(live),),
            ).fetchall()
            if running:
                return running
            time.sleep(0.02)
        return []

    def killer() -> None:
        while not stop.wait(rng.expovariate(1 / args.kill_every)):
            if not killing.is_set():
                continue
            running = running_bodies()
            if not running:
                continue
            pid = rng.choice(running)[0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            t_kill = time.monotonic()
            # Ended at the kill, read on the server clock after the SIGKILL: never before the body's real end.
            held = kill_db.execute(
                f"UPDATE {tables.executions} SET outcome = 'killed', t_end = extract(epoch from clock_timestamp())"
                " WHERE pid = %s AND t_end IS NULL RETURNING accounts",
                (pid,),
            ).fetchall()
            out.kills += 1
            keys = sorted({f"account:{a}" for (row,) in held for a in json.loads(row)})
            t = threading.Thread(target=watch, args=(pid, keys, t_kill), daemon=True)
            t.start()
            watchers.append(t)

    thread = threading.Thread(target=killer, name="chaos-transfer-killer", daemon=True)
    thread.start()
    ids: list[str] = []
    per_control = max(1, args.control // 4)
    started = time.monotonic()
    killing.set()
    for n in range(args.transfers):
        if n >= args.transfers // 2:
            killing.clear()  # kills during the first half of the run only
        src, dst = rng.sample(accounts, 2)
        if rng.random() < args.self_transfers:
            dst = src
        amount = rng.randint(1, 100)
        ids.append(move.delay(n, src, dst, amount).id)
        out.transfers += 1
        if rng.random() < args.duplicates:  # the same transfer under another task id: answered from its record
            ids.append(move.delay(n, src, dst, amount).id)
            out.duplicates += 1
        if n % max(1, args.transfers // 4) == 0 and out.control_transfers < args.control:
            for _ in range(per_control):  # a burst: several run at once on a few accounts
                c_src, c_dst = rng.sample(control_accounts, 2)
                c = 100_000 + out.control_transfers
                ids.append(unlocked.delay(c, c_src, c_dst, rng.randint(1, 100)).id)
                out.control_transfers += 1
        time.sleep(max(0.0, min(args.duration / args.transfers, started + args.duration - time.monotonic())))
    killing.clear()
    out.calls = len(ids)

    def settled() -> bool:
        return all(app.AsyncResult(i).ready() for i in ids)

    try:
        wait_for(settled, args.drain, "every transfer to settle", interval=0.5)
    except AssertionError:  # reported by the oracle as lost calls; what Redis holds then says why
        dump = log_dir / "locks-at-drain.txt"
        with dump.open("w") as f:
            for name in sorted(lock_client.scan_iter(f"{cfg['prefix']}:v1:*")):
                f.write(f"{name} pttl={lock_client.pttl(name)} {_dump(lock_client, name)}\n")
        print(f"not settled after {args.drain} s: the lock keys then are in {dump}")
    stop.set()
    thread.join(10)
    for t in watchers:
        t.join(args.ttl + 20)
    states = {i: app.AsyncResult(i).state for i in ids}
    kill_db.close()
    return states, blocked


def _dump(client: Any, name: str) -> Any:
    """A key's value, whatever its type (for the stall report)."""
    kind = client.type(name)
    if kind == "hash":
        return client.hgetall(name)
    if kind == "zset":
        return client.zrange(name, 0, -1, withscores=True)
    if kind == "list":
        return client.lrange(name, 0, -1)
    return client.get(name) if kind == "string" else kind


def _delete_queue(app: Any, queue: str) -> None:
    try:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    except Exception as exc:  # noqa: BLE001 - cleanup only: a left queue is harmless and named after the run
        print(f"could not delete queue {queue}: {exc}")


def _bodies(db: Any, tables: Tables, control: bool) -> tuple[list[Body], list[str]]:
    rows = db.execute(
        f"SELECT id, transfer_id, accounts, fences, t_start, t_end, outcome FROM {tables.executions}"
        " WHERE control = %s ORDER BY id",
        (control,),
    ).fetchall()
    bodies, unfinished = [], []
    for exec_id, transfer_id, accounts, fences, t_start, t_end, outcome in rows:
        if t_end is None:
            unfinished.append(f"exec {exec_id} (transfer {transfer_id}) neither ended nor was killed")
            continue
        fence_map = {account_of(k): int(v) for k, v in json.loads(fences).items()}
        bodies.append(
            Body(
                exec_id,
                transfer_id,
                tuple(json.loads(accounts)),
                t_start,
                t_end,
                fence_map,
                outcome == "committed",
                outcome == "killed",
            )
        )
    return bodies, unfinished


def _money(db: Any, tables: Tables, accounts: list[int]) -> tuple[dict[int, int], list[Move]]:
    balances = dict(db.execute(f"SELECT id, balance FROM {tables.accounts} WHERE id = ANY(%s)", (accounts,)).fetchall())
    moves = [
        Move(*r)
        for r in db.execute(
            f"SELECT transfer_id, src, dst, amount FROM {tables.moves} WHERE src = ANY(%s) ORDER BY seq", (accounts,)
        ).fetchall()
    ]
    return balances, moves


def _verdict(
    db: Any,
    tables: Tables,
    accounts: list[int],
    control_accounts: list[int],
    args: argparse.Namespace,
    out: Outcome,
    states: dict[str, str],
    blocked: list[tuple[str, float]],
) -> None:
    bodies, unfinished = _bodies(db, tables, control=False)
    control_bodies, _ = _bodies(db, tables, control=True)
    balances, moves = _money(db, tables, accounts)
    c_balances, c_moves = _money(db, tables, control_accounts)
    out.bodies = len(bodies)
    out.committed = sum(b.committed for b in bodies)
    out.answered_from_record = out.transfers + out.duplicates - out.committed
    out.longest_blocked = max((s for _, s in blocked), default=0.0)
    control_ids = sorted({b.transfer_id for b in control_bodies} | {m.transfer_id for m in c_moves})
    out.findings = check(
        bodies=bodies,
        control_bodies=control_bodies,
        opening=dict.fromkeys(accounts, OPENING),
        balances=balances,
        moves=moves,
        transfers=list(range(out.transfers)),
        control_opening=dict.fromkeys(control_accounts, OPENING),
        control_balances=c_balances,
        control_moves=c_moves,
        control_transfers=control_ids,
        states=states,
        blocked=blocked,
        ttl=args.ttl,
    )
    out.findings.violations[:0] = unfinished


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos.transfer", description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="the bounded CI run: 150 transfers over 20 s (~1 min)")
    p.add_argument("--cluster", action="store_true", help="leases on a private three-master Redis Cluster")
    p.add_argument("--transfers", type=int, default=None, help="default 1000 (150 with --quick)")
    p.add_argument("--accounts", type=int, default=10)
    p.add_argument("--control", type=int, default=40, help="transfers with locking off (the control)")
    p.add_argument("--duplicates", type=float, default=0.05, help="share of transfers published twice")
    p.add_argument("--self-transfers", type=float, default=0.02, help="share of transfers from an account to itself")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--work-ms", type=float, default=40.0, help="mean body time (ms), half of it inside the transaction")
    p.add_argument("--ttl", type=float, default=4.0, help="lock_ttl (s): a killed body's entities wait at most this")
    p.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between kills (first half only)")
    p.add_argument("--duration", type=float, default=None, help="seconds over which transfers are published")
    p.add_argument("--drain", type=float, default=300.0, help="longest wait for every transfer to settle")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--loglevel", default="WARNING", help="the workers' (and their lock events') log level")
    return p


def options(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.transfers is None:
        args.transfers = 150 if args.quick else 1000
    if args.duration is None:
        args.duration = 20.0 if args.quick else args.transfers / 10
    return args


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    o = run(args)
    f = o.findings
    print(
        f"transfers: {o.transfers} (+{o.duplicates} published twice) among {args.accounts} accounts"
        f"{' on a 3-master Cluster' if args.cluster else ''}, calls: {o.calls}, bodies: {o.bodies}, "
        f"committed: {o.committed}, answered without a commit of their own: {o.answered_from_record}, "
        f"children killed: {o.kills}, longest an entity stayed with a killed child: {o.longest_blocked:.2f} s "
        f"(TTL {args.ttl} s), {o.seconds:.0f} s"
    )
    pairs = sum(1 for line in f.control_caught if line.startswith("account "))
    money = [line for line in f.control_caught if not line.startswith("account ")]
    print(
        f"control (locking off, {o.control_transfers} transfers): "
        + (
            f"caught: {pairs} overlapping pairs of bodies; money: {'; '.join(money) or 'intact'}"
            if f.control_caught
            else "NOT caught"
        )
    )
    for line in f.control_caught[:2]:
        print(f"  control: {line}")
    for v in f.violations[:20]:
        print(f"VIOLATION {v}")
    print("OK" if o.ok else "FAILED")
    return 0 if o.ok else 1


if __name__ == "__main__":
    sys.exit(main())
