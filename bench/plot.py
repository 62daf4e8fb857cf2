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
    """Two panels: lock cycle vs raw, end-to-end vs plain; medians with the spread over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5), constrained_layout=True)
    cycle_title = "Lock cycle: cycles/s ÷ raw SET NX PX + DEL"
    _bars(a, [r.name for r in res.cycle], [r.ratio for r in res.cycle], 0.95, cycle_title)
    _bars(
        b,
        [r.name for r in res.e2e],
        [r.ratio_total for r in res.e2e],
        0.97,
        "End-to-end (publish + run): plain task µs ÷ variant µs",
    )
    fig.suptitle("celery-lockguard vs peers (median, bars = quartiles over rounds)", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
