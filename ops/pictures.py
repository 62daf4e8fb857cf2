"""Pictures of the dashboard's panels, from a real run: ``make dashboard-pictures``.

Starts a private Redis (``celery_lockguard.testing.RedisServer``, never a
shared server), a real prefork worker of :mod:`ops.demoapp`, ``celery
lockguard exporter`` and ``prometheus`` (the Debian package) on free loopback
ports, scraping the exporter every second with the shipped rules loaded; drives
load for a few minutes (calm, then a burst on hot invoices), then runs every
panel's PromQL (:data:`ops.dashboard.ROWS`) through Prometheus's HTTP API
(``/api/v1/query_range``) and draws each with matplotlib into
``docs/img/dashboard-<slug>.png``. Everything it started is stopped at the end.

    python -m ops.pictures [--seconds 150]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from celery_lockguard.testing import RedisServer, Worker, free_port, wait_for

from . import dashboard

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
#: The rate window the pictures use for Grafana's ``$__rate_interval`` (the scrape interval is 1 s).
RATE_WINDOW = "20s"
#: Seconds between two points of a picture.
STEP = 2


def _get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def prometheus_config(exporter_port: int, rules: Path) -> str:
    return (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {rules}\n"
        "scrape_configs:\n  - job_name: lockguard\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter_port}']\n"
    )


def drive(seconds: float) -> None:
    """Publish load from this process: one long export, steady work, then a burst on three hot invoices."""
    from .demoapp import build_report, charge, export, sync

    export.delay("ledger")  # the one long holder
    end = time.monotonic() + seconds
    burst_from = time.monotonic() + seconds * 0.45
    burst_to = time.monotonic() + seconds * 0.75
    n = 0
    while time.monotonic() < end:
        now = time.monotonic()
        hot = burst_from <= now < burst_to
        charge.delay(random.choice([1, 2, 3]) if hot or random.random() < 0.2 else random.randint(100, 10_000))
        if n % 8 == 0:
            sync.delay(random.choice(["alpha", "beta", "gamma"]))
        if n % 15 == 0:
            build_report.delay(f"2026-12-{random.randint(1, 28):02d}")
        n += 1
        time.sleep(0.25 if hot else 0.5)


def query_range(base: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode(
        {"query": expr.replace("$__rate_interval", RATE_WINDOW), "start": start, "end": end, "step": STEP}
    )
    reply = _get(f"{base}/api/v1/query_range?{params}")
    if reply.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {reply}")
    return list(reply["data"]["result"])


Series = tuple[str, int, list[tuple[float, float]]]  # legend, which query of the panel, points


def draw(panel: dashboard.Panel, series: list[Series], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 3.0), dpi=110)
    fig.patch.set_facecolor("#181b1f")
    ax.set_facecolor("#181b1f")
    for label, query, points in series:
        xs: list[float] = []
        ys: list[float] = []
        for t, v in points:
            if xs and t - start - xs[-1] * 60 > 3 * STEP:
                xs.append(float("nan"))  # no sample there (no lease held, say): break the line, draw no bridge
                ys.append(float("nan"))
            xs.append((t - start) / 60)
            ys.append(v * 100 if panel.unit == "percentunit" else v)
        # A panel's second query is dashed: where two coincide (every expiry is also a loss), both show.
        ax.plot(xs, ys, linewidth=1.6, label=label, linestyle="-" if query == 0 else "--")
    unit = {"s": "seconds", "ops": "per second", "percentunit": "%", "short": "leases"}.get(panel.unit, "")
    ax.set_title(panel.title, color="#d8d9da", loc="left", fontsize=11)
    ax.set_xlabel("minutes into the run", color="#8e8e8e", fontsize=8)
    ax.set_ylabel(unit, color="#8e8e8e", fontsize=8)
    ax.tick_params(colors="#8e8e8e", labelsize=8)
    ax.grid(color="#2c3235", linewidth=0.6)
    for spine in ax.spines.values():
        spine.set_color("#2c3235")
    if series:
        ax.legend(fontsize=7, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da", loc="upper left")
    else:
        ax.text(0.5, 0.5, "no data", color="#8e8e8e", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, facecolor=fig.get_facecolor())
    plt.close(fig)


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw the dashboard's panels from a real run.")
    parser.add_argument("--seconds", type=float, default=150.0, help="how long to drive load (default 150)")
    args = parser.parse_args(argv)
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not installed (apt-get install prometheus)", file=sys.stderr)
        return 2
    IMG.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lockguard-pictures-"))
    server = RedisServer().start()
    env = {
        "LOCKGUARD_DEMO_REDIS_URL": server.url,
        "LOCKGUARD_DEMO_PREFIX": "lgdemo",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    os.environ.update(env)
    procs: list[subprocess.Popen[bytes]] = []
    worker = Worker("ops.demoapp:app", concurrency=4, env=env, cwd=ROOT, log_path=tmp / "worker.log")
    try:
        worker.start(timeout=60)
        exporter_port, prom_port = free_port(), free_port()
        celery = [sys.executable, "-m", "celery", "-A", "ops.demoapp:app"]
        exporter = subprocess.Popen(
            [*celery, "lockguard", "exporter", "--port", str(exporter_port)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "exporter.log", "wb"),
        )
        procs.append(exporter)
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config(exporter_port, ROOT / "ops" / "prometheus" / "lockguard-rules.yml"))
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "wb"),
        )
        procs.append(prom)
        base = f"http://127.0.0.1:{prom_port}"

        def scraping() -> bool:
            try:
                targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return False
            return bool(targets) and targets[0].get("health") == "up"

        wait_for(scraping, 60, what="prometheus to scrape the exporter", interval=0.5)
        start = time.time()
        drive(args.seconds)
        time.sleep(5)  # the last flushes (1 s) and scrapes (1 s) of the run; not a synchronisation
        end = time.time()
        for panel in dashboard.panels():
            series: list[Series] = []
            for n, query in enumerate(panel.queries):
                for result in query_range(base, query.expr, start, end):
                    points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf", "-Inf")]
                    if points:
                        series.append((legend(query.legend, result["metric"]), n, points))
            out = IMG / f"dashboard-{panel.slug}.png"
            draw(panel, series, start, out)
            print(f"{out.relative_to(ROOT)}: {len(series)} series")
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        worker.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
