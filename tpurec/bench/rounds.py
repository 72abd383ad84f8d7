"""How every side-by-side benchmark reports its rounds: the ratio of each round, the median, the
worst and best round, and the host's load average around the runs.

A ratio is the peer's seconds over tpurec's seconds in the same round (> 1: tpurec is faster), so
that round k of both contestants, run back to back in a random order, is compared with itself and
not with a quieter moment of the other. The median says what is typical, the worst round what a
user may get on a busy host; reporting only a median (or a best run) hides the spread, and a
figure without the load average cannot be compared with another one.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Sequence


def fresh_seed() -> int:
    """A seed for the order of contenders, new each run (reported, so that a run can be repeated):
    a fixed seed would give every run, and every cell, the same sequence of orders."""
    import random

    return random.SystemRandom().randrange(2**31)


def load_average() -> list[float]:
    """os.getloadavg(): 1, 5 and 15-minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def ratio_summary(ours: Sequence[float], theirs: Sequence[float]) -> dict:
    """Per-round ratios theirs[k] / ours[k] (seconds: > 1 means ours is faster), their median, min and max."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"rounds differ or are missing: {len(ours)} vs {len(theirs)}")
    ratios = [t / o for o, t in zip(ours, theirs)]
    return {
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "round_ratios": [float(f"{r:.5g}") for r in ratios],
    }


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
