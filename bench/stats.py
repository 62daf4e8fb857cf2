"""Alternating rounds and robust summaries.

A shared 2-core machine drifts (other suites start and stop): measuring
variant A for a minute and then B for a minute compares two machines. Every
benchmark here runs *rounds*; each round runs every variant once, in an order
that alternates between rounds (ABCD, DCBA, ...), so slow patches hit all
variants alike. Ratios are taken *within* a round (paired) and summarised by
the median with the spread over rounds, never by a mean that one stall moves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def round_order(variants: Sequence[T], round_index: int) -> list[T]:
    """The order of variants in round ``round_index``: forward on even rounds, reversed on odd ones."""
    items = list(variants)
    return items if round_index % 2 == 0 else items[::-1]


@dataclass
class Summary:
    """Median and spread of one quantity over rounds."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def low(self) -> float:
        """Lower quartile (the minimum below 4 rounds: quartiles of 3 points mean little)."""
        return _quantiles(self.values)[0]

    @property
    def high(self) -> float:
        return _quantiles(self.values)[1]

    def fmt(self, spec: str = ".0f", scale: float = 1.0) -> str:
        """``median [low\u2013high]`` with ``spec`` applied after multiplying by ``scale``."""
        if not self.values:
            return "n/a"
        m, lo, hi = (format(v * scale, spec) for v in (self.median, self.low, self.high))
        return f"{m} [{lo}\u2013{hi}]"


def _quantiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def run_rounds(
    variants: Sequence[str], rounds: int, measure: Callable[[str, int], dict[str, float]]
) -> dict[str, dict[str, Summary]]:
    """Call ``measure(variant, round)`` for every variant in alternating order, ``rounds`` times.

    ``measure`` returns named quantities; the result maps variant -> name -> Summary.
    """
    out: dict[str, dict[str, Summary]] = {v: {} for v in variants}
    for r in range(rounds):
        for v in round_order(variants, r):
            for name, value in measure(v, r).items():
                out[v].setdefault(name, Summary()).add(value)
    return out


def paired(
    results: dict[str, dict[str, Summary]], variant: str, base: str, name: str, fn: Callable[[float, float], float]
) -> Summary:
    """``fn(variant value, base value)`` round by round: drift shared by a round cancels."""
    mine, theirs = results[variant][name].values, results[base][name].values
    return Summary([fn(a, b) for a, b in zip(mine, theirs, strict=True)])
