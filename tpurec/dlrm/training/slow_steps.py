"""Training steps whose host half took far longer than the steps before: on a TPU, a new program.

TorchTPU's eager mode compiles a program the first time it meets an op with new shapes, dtypes or
layout, synchronously, on the host thread that issues it: a step that meets one takes seconds where
the others take a fraction of one. On a v5e, MLPerf DLRM-DCNv2's batches whose inputs crossed to the
device in another layout took 7.5-28 s instead of ~0.3 and brought the mean step from 307 ms to 1,167
(docs/results.md, session 35) with nothing in the run's output to say why. So each step's time on the
host (its `advance`: the batch read, the host preprocessing, the ops issued; not the loss reads of the
logged steps, which wait for the device) is compared with the median of the steps before it, and a
step over FACTOR times that, and at least FLOOR_S seconds, is counted: the run's JSON gives
`slow_steps`, and the first one is said on stderr. Not timed: the first step of each training segment
(the run's first compiles nearly everything; after an evaluation the input pipeline starts again);
not counted: the first WARMUP timed steps (the second step compiles the rest: 12-13 s on the chip).
"""

from __future__ import annotations

import statistics

WARMUP = 1  # timed steps never counted (the run's second step compiles what the first did not)
FACTOR = 5.0  # a step over this many times the recent median...
FLOOR_S = 1.0  # ... and at least this long (a CPU run's hiccups under load are shorter)
RECENT = 20  # the steps the median is taken over
KEEP = 10  # slow steps listed in the figures (all are counted)


class SlowSteps:
    def __init__(self) -> None:
        self.seconds: list[float] = []  # every step's host seconds, in order
        self.slow: list[tuple[int, float, float]] = []  # (step, seconds, the median it was compared with)

    def add(self, step: int, seconds: float | None) -> tuple[int, float, float] | None:
        """Step `step` took `seconds` on the host (None: not timed, a segment's first); the slow step's
        record when it was one."""
        if seconds is None:
            return None
        self.seconds.append(seconds)
        steady = self.seconds[WARMUP:-1][-RECENT:]  # the steps before this one, past the warm-up
        if not steady:
            return None
        median = statistics.median(steady)
        if seconds < max(FACTOR * median, FLOOR_S):
            return None
        record = (step, round(seconds, 3), round(median, 4))
        self.slow.append(record)
        return record

    def figures(self) -> dict:
        """`count`, the first KEEP as [step, seconds, median], and the median step after the warm-up."""
        steady = self.seconds[WARMUP:]
        return {
            "count": len(self.slow),
            "first": [list(r) for r in self.slow[:KEEP]],
            "median_step_s": round(statistics.median(steady), 4) if steady else None,
        }


def message(record: tuple[int, float, float]) -> str:
    step, seconds, median = record
    return (
        f"step {step} took {seconds:.1f} s on the host against a median of {median:.3f} s: on a TPU a new "
        "program was compiled (an input of a new shape, dtype or layout); `slow_steps` in the result counts them"
    )
