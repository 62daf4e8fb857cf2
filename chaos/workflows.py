"""``python -m chaos.workflows``: the workflow mode of the chaos soak (``make chaos-workflows``).

Publishes ``--workflows`` workflows over ``--tenants`` tenants (chains of ``--steps`` members, every
third one with a chord of ``--pages`` pages in the middle) to ``--workers`` real prefork workers,
SIGKILLs a random pool child every ``--kill-every`` seconds on average while they run (members are
``acks_late``: the message comes back and its redelivery takes the workflow over), then checks
(:mod:`chaos.workflow_check`): no two workflows of a tenant interleaved, fences only went up, every
workflow settled, no lease left behind. A control tenant runs the same chains without
``workflow()``, and must be caught interleaving. Exits 1 on a violation or an uncaught control.

Bounded: at most ``--duration`` seconds of publishing and ``--drain`` of waiting; every process it
started is stopped on the way out. One private Redis on loopback.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from celery import chain, chord

from celery_lockguard import workflow
from celery_lockguard.testing import RedisServer, Worker, start_all, stop_all

from .workflow_app import PIPELINE, create_app, history_key
from .workflow_check import check

ROOT = Path(__file__).resolve().parent.parent
CONTROL = "control"


def canvas(app: Any, tenant: str, wf: str, steps: int, pages: int, with_chord: bool) -> Any:
    step, collect = app.tasks["cwf.step"], app.tasks["cwf.collect"]
    members: list[Any] = [step.s(tenant=tenant, wf=wf, step=f"s{i}") for i in range(steps)]
    if with_chord:
        header = [step.s(tenant=tenant, wf=wf, step=f"page{i}") for i in range(pages)]
        members.insert(1, chord(header, collect.s(tenant=tenant, wf=wf, step="collect")))
    return chain(*members)


def run(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="chaos-wf-"))
    rng = random.Random(args.seed)
    with RedisServer() as server:
        cfg = {
            "redis": server.url,
            "prefix": f"cwf{uuid.uuid4().hex[:6]}",
            "queue": "chaos-workflows",
            "min_ms": 20,
            "max_ms": args.step_ms,
        }
        app = create_app(cfg)
        workers = [
            Worker(
                "chaos.workflow_app:app",
                control=app,
                concurrency=args.concurrency,
                name=f"cwf{i}-{uuid.uuid4().hex[:4]}",
                queues=[cfg["queue"]],
                env={"CHAOS_WF_CONFIG": json.dumps(cfg), "PYTHONPATH": str(ROOT)},
                cwd=ROOT,
                log_path=log_dir / f"worker{i}.log",
            )
            for i in range(args.workers)
        ]
        stop = threading.Event()
        kills = 0

        def killer() -> None:
            nonlocal kills
            while not stop.wait(rng.expovariate(1 / args.kill_every) if args.kill_every > 0 else 3600):
                w = rng.choice(workers)
                if w.kill_child() is not None:
                    kills += 1

        try:
            start_all(workers, 90)
            thread = threading.Thread(target=killer, name="chaos-wf-killer", daemon=True)
            thread.start()
            results: dict[str, Any] = {}
            tenants = [f"t{i}" for i in range(args.tenants)]
            began = time.monotonic()
            for n in range(args.workflows):
                tenant = tenants[n % len(tenants)]
                wf = f"w{n:04d}"
                sig = canvas(app, tenant, wf, args.steps, args.pages, with_chord=n % 3 == 2)
                results[wf] = workflow(
                    sig, lock_key=PIPELINE, tenant=tenant, on_locked="retry", lock_ttl=args.ttl, gap_ttl=args.gap
                ).apply_async()
                if n % (3 * len(tenants)) == 0:  # control chains beside, with no workflow lease: three at once
                    for k in range(3):
                        canvas(app, CONTROL, f"c{n:04d}{k}", args.steps, args.pages, with_chord=False).apply_async()
                if args.duration > 0:
                    time.sleep(max(0.0, min(args.duration / args.workflows, began + args.duration - time.monotonic())))
            deadline = time.monotonic() + args.drain
            while time.monotonic() < deadline and not all(r.ready() for r in results.values()):
                time.sleep(0.25)
            stop.set()
            thread.join(5)
            states = {wf: r.state for wf, r in results.items()}
            client = server.client()
            # a lease still running or handed on waits out at most its TTL: give the fleet that long
            lease_deadline = time.monotonic() + max(args.ttl, args.gap) + 5
            while time.monotonic() < lease_deadline and list(client.scan_iter(f"{cfg['prefix']}:v1:*:lock")):
                time.sleep(0.25)
            leftover = sorted(client.scan_iter(f"{cfg['prefix']}:v1:*:lock"))
            rows = [json.loads(x) for x in client.lrange(history_key(cfg["prefix"]), 0, -1)]
        finally:
            stop.set()
            stop_all(workers)
    findings = check(rows, states, leftover, {CONTROL})
    failed = sum(1 for s in states.values() if s == "FAILURE")
    print(
        f"workflows: {len(states)} ({failed} failed visibly), member bodies: {len(rows)}, "
        f"children killed: {kills}, controls caught: {findings.controls_caught}"
    )
    for v in findings.violations:
        print(f"VIOLATION {v}")
    print("OK" if findings.ok else f"FAILED (worker logs in {log_dir})")
    return 0 if findings.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.workflows", description=__doc__.split("\n", 1)[0])
    p.add_argument("--workflows", type=int, default=24)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pages", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--step-ms", type=int, default=200, help="longest member body (ms)")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between child kills (0: none)")
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--gap", type=float, default=30.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds over which workflows are published")
    p.add_argument("--drain", type=float, default=240.0, help="longest wait for every workflow to settle")
    p.add_argument("--seed", type=int, default=None)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
