"""The Grafana dashboard for ``lockguard exporter``, generated with grafanalib.

The panels are data (:data:`ROWS`): the same expressions feed the committed
JSON (``ops/grafana/lockguard.json``), the test that checks every metric they
name is one the exporter writes, and the pictures in docs/dashboards.md
(``ops/pictures.py`` runs each expression against a real Prometheus). Edit
here, then ``make dashboard``; a test fails when the committed JSON differs
from what this generates.

    python -m ops.dashboard            # write ops/grafana/lockguard.json
    python -m ops.dashboard --check    # exit 1 if the committed JSON is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

#: The committed dashboard.
JSON_PATH = Path(__file__).parent / "grafana" / "lockguard.json"
#: Grafana's rate window for the Prometheus data source (at least four scrape intervals).
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One time-series panel: what it answers (its description is the operator's question) and its queries."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    #: A file name for its picture in docs/ (``dashboard-<slug>.png``).
    slug: str


def _by_task_rate(event: str) -> str:
    return f'sum by (task) (rate(lockguard_events_total{{event="{event}"}}[{RATE}]))'


def _quantile(q: float, metric: str, by: str = "task") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"


_ATTEMPTS = f'sum by (task) (rate(lockguard_events_total{{event=~"lock.acquired|lock.contended"}}[{RATE}]))'

#: (row title, panels) in the order they appear.
ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "The four numbers",
        (
            Panel(
                "Acquisitions",
                "Leases taken per second, per task.",
                "ops",
                (Query(_by_task_rate("lock.acquired"), "{{task}}"),),
                "acquisitions",
            ),
            Panel(
                "Contention",
                "Share of attempts that found the entity held (contended / (acquired + contended)).",
                "percentunit",
                (Query(f"{_by_task_rate('lock.contended')} / {_ATTEMPTS}", "{{task}}"),),
                "contention",
            ),
            Panel(
                "Hold time",
                "Acquire to release: the 95th percentile and the mean, per task.",
                "s",
                (
                    Query(_quantile(0.95, "lockguard_hold_seconds"), "p95 {{task}}"),
                    Query(
                        f"sum by (task) (rate(lockguard_hold_seconds_sum[{RATE}])) / "
                        f"sum by (task) (rate(lockguard_hold_seconds_count[{RATE}]))",
                        "mean {{task}}",
                    ),
                ),
                "hold-time",
            ),
            Panel(
                "Expired and lost leases",
                "Leases that ended before their release (expired or taken) and leases the body was told it lost.",
                "ops",
                (
                    Query(_by_task_rate("lock.expired_before_release"), "expired {{task}}"),
                    Query(_by_task_rate("lock.lost"), "lost {{task}}"),
                ),
                "expired-lost",
            ),
        ),
    ),
    (
        "Waits",
        (
            Panel(
                "Lock wait",
                "From a message's first delivery to its acquisition, waits spent re-queued included: p50 and p95.",
                "s",
                (
                    Query(_quantile(0.5, "lockguard_wait_seconds"), "p50 {{task}}"),
                    Query(_quantile(0.95, "lockguard_wait_seconds"), "p95 {{task}}"),
                ),
                "lock-wait",
            ),
            Panel(
                "Waits scheduled and given up",
                "Deliveries sent back to wait (re-queued or parked) and calls that spent lock_max_waits.",
                "ops",
                (
                    Query(_by_task_rate("lock.retry_scheduled"), "waits {{task}}"),
                    Query(_by_task_rate("lock.wait_budget_exhausted"), "gave up {{task}}"),
                ),
                "waits",
            ),
        ),
    ),
    (
        "Held now",
        (
            Panel(
                "Leases held",
                "Leases held by running bodies now, per task and worker (from the workers' own gauges).",
                "short",
                (Query("sum by (task, worker) (lockguard_leases_held)", "{{task}} on {{worker}}"),),
                "held-now",
            ),
            Panel(
                "Oldest hold",
                "Age of the oldest lease held now: a body that does not finish shows as a rising line.",
                "s",
                (Query("max by (task) (lockguard_oldest_hold_seconds)", "{{task}}"),),
                "oldest-hold",
            ),
        ),
    ),
    (
        "Renewal and contention by key",
        (
            Panel(
                "Renewal lag",
                "How late renewals were sent against when they were due: p99 per task. Near a third of the TTL, "
                "leases are about to be lost.",
                "s",
                (Query(_quantile(0.99, "lockguard_renewal_lag_seconds"), "p99 {{task}}"),),
                "renewal-lag",
            ),
            Panel(
                "Contention per key template",
                "Contended share of attempts per lock_key template (bounded labels: the template, never the key).",
                "percentunit",
                (
                    Query(
                        f"sum by (template) (rate(lockguard_template_contended_total[{RATE}])) / "
                        f"(sum by (template) (rate(lockguard_template_acquired_total[{RATE}])) + "
                        f"sum by (template) (rate(lockguard_template_contended_total[{RATE}])))",
                        "{{template}}",
                    ),
                ),
                "template-contention",
            ),
        ),
    ),
)


def panels() -> list[Panel]:
    """Every panel, in order."""
    return [p for _row, row_panels in ROWS for p in row_panels]


def build() -> object:
    """The dashboard as a grafanalib object (imported here: grafanalib is a docs/dev extra)."""
    from grafanalib.core import Dashboard, GridPos, RowPanel, Target, Template, Templating, Time, TimeSeries

    width, height = 12, 8
    out: list[object] = []
    y = 0
    for title, row_panels in ROWS:
        out.append(RowPanel(title=title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, p in enumerate(row_panels):
            out.append(
                TimeSeries(
                    title=p.title,
                    description=p.description,
                    dataSource="${datasource}",
                    unit=p.unit,
                    targets=[
                        Target(expr=q.expr, legendFormat=q.legend, refId=chr(ord("A") + n))
                        for n, q in enumerate(p.queries)
                    ],
                    gridPos=GridPos(h=height, w=width, x=(i % 2) * width, y=y + (i // 2) * height),
                )
            )
        y += ((len(row_panels) + 1) // 2) * height
    return Dashboard(
        title="celery-lockguard",
        uid="celery-lockguard",
        description="Leases, waits, renewal and contention from `celery lockguard exporter` (docs/dashboards.md).",
        tags=["celery", "lockguard"],
        timezone="utc",
        time=Time("now-1h", "now"),
        templating=Templating(
            list=[Template(name="datasource", label="Prometheus", query="prometheus", type="datasource")]
        ),
        panels=out,
    ).auto_panel_ids()


def render() -> str:
    """The dashboard JSON exactly as committed (sorted keys, two-space indent, one final newline)."""
    from grafanalib._gen import DashboardEncoder

    return json.dumps(build().to_json_data(), cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is not what this generates")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if JSON_PATH.read_text() != text:
            print(f"{JSON_PATH} is stale: run python -m ops.dashboard", file=sys.stderr)
            return 1
        return 0
    JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
    JSON_PATH.write_text(text)
    print(f"wrote {JSON_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
