"""The ratio plot beside the page (matplotlib, bench environment only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .stats import Summary

if TYPE_CHECKING:
    from .run import Results


def _bars(ax: object, names: list[str], sums: list[Summary], target: float, title: str) -> None:
    medians = [s.median for s in sums]
    lower = [s.median - s.low for s in sums]
    upper = [s.high - s.median for s in sums]
    y = list(range(len(names)))
    ax.barh(y, medians, xerr=[lower, upper], color="#4c72b0", capsize=3)  # type: ignore[attr-defined]
    ax.axvline(1.0, color="black", linewidth=0.8)  # type: ignore[attr-defined]
    ax.axvline(target, color="#c44e52", linestyle="--", linewidth=1, label=f"target {target}x")  # type: ignore[attr-defined]
    ax.set_yticks(y, names)  # type: ignore[attr-defined]
    ax.invert_yaxis()  # type: ignore[attr-defined]
    ax.set_xlim(0, max(1.1, max(s.high for s in sums) * 1.05))  # type: ignore[attr-defined]
    ax.set_title(title, fontsize=10)  # type: ignore[attr-defined]
    ax.legend(loc="lower right", fontsize=8)  # type: ignore[attr-defined]
    for yi, m in zip(y, medians, strict=True):
        ax.text(0.02, yi, f"{m:.2f}", va="center", fontsize=8, color="white")  # type: ignore[attr-defined]


def draw(res: Results, path: Path) -> None:
    """Three panels against issue 15's targets: lock cycle vs raw, worker throughput vs plain, new set-ups.

    Medians with the spread over rounds; the third panel is LockedTask against the plain task of the
    same section (concurrency 2 and 8, PostgreSQL store, Redis Cluster), whichever of them ran.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import CYCLE_TARGET, WORKER_TARGET

    extra: list[tuple[str, Summary]] = []
    for c, results in sorted(res.concurrency.items()):
        extra += [(f"LockedTask -c {c}", r.ratio_worker) for r in results if r.name == "LockedTask"]
    extra += [(r.name, r.ratio_worker) for r in res.pg if r.name != "plain task"]
    extra += [(r.name, r.ratio_worker) for r in res.cluster if r.name != "plain task"]
    panels = 3 if extra else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.3 * panels), constrained_layout=True)
    cycle_title = "Lock cycle: cycles/s ÷ raw SET NX PX + DEL"
    _bars(axes[0], [r.name for r in res.cycle], [r.ratio for r in res.cycle], CYCLE_TARGET, cycle_title)
    _bars(
        axes[1],
        [r.name for r in res.e2e],
        [r.ratio_worker for r in res.e2e],
        WORKER_TARGET,
        "Worker throughput (prefork -c 1): variant tasks/s ÷ plain task",
    )
    if extra:
        _bars(
            axes[2],
            [n for n, _ in extra],
            [x for _, x in extra],
            WORKER_TARGET,
            "Worker throughput vs the plain task of the same section",
        )
    fig.suptitle("celery-lockguard vs peers (median, bars = quartiles over rounds)", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
