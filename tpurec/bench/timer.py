"""The one timer every `tpurec bench` benchmark uses: warm-up runs, then timed runs, every run kept.

Benchmarks compare contestants on a shared, often busy host, so each timed run is recorded (wall and
process CPU seconds, and what the run returned) and the benchmark picks its statistic: the median
(kernels, preprocess, train) or the best run (data: the run least disturbed by other processes).
`interleaved` lets contestants take turns run by run, so load from other processes falls on all of
them alike. torch.utils.benchmark.Timer was considered: it times one statement at a time (no turns),
reports no CPU time and resets torch's thread count to its own `num_threads`, which the benchmarks
set themselves.
"""

from __future__ import annotations

import gc
import itertools
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class Stopwatch:
    """Wall and process-CPU seconds of a `with` block (for regions that are not a repeatable call)."""

    wall: float = 0.0
    cpu: float = 0.0

    def __enter__(self) -> Stopwatch:
        self._t, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu = time.process_time() - self._c


@dataclass
class Runs:
    """Every timed run of one contestant: seconds (wall, process CPU) and the call's return value."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median wall seconds of a run."""
        return statistics.median(self.wall)

    @property
    def best(self) -> float:
        """Fewest wall seconds of a run."""
        return min(self.wall)

    def add(self, sw: Stopwatch, result: Any) -> None:
        self.wall.append(sw.wall)
        self.cpu.append(sw.cpu)
        self.results.append(result)


def interleaved(
    fns: Sequence[Callable[[], Any]],
    *,
    warmup: int,
    repeats: int,
    seed: int = 0,
    orders: list[tuple[int, ...]] | None = None,
) -> list[Runs]:
    """`warmup` untimed rounds, then `repeats` timed rounds; in each round every fn runs once, in a
    fresh random order (a fixed order hands one contestant the warm caches, or the quiet moment
    after another's burst, every round). `orders`, when given, receives each timed round's order
    (indices into fns), so that a report can show who went first.

    The timed rounds run with the process's objects up to then frozen (`gc.freeze`, after one full
    collection): Python's full collections scan every tracked object, which with torch, TorchRec and
    jax imported took 155 ms here, and one landing in a timed run made that round ~4-8x slower
    (`tpurec bench preprocess`, pooling 20: one round in 15). Frozen objects are not scanned; the
    collector still runs, on what the contestants allocate."""
    rng = random.Random(seed)
    order = list(range(len(fns)))
    for _ in range(warmup):
        for fn in fns:
            fn()
    out = [Runs() for _ in fns]
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeats):
            rng.shuffle(order)
            if orders is not None:
                orders.append(tuple(order))
            for i in order:
                with Stopwatch() as sw:
                    result = fns[i]()
                out[i].add(sw, result)
    finally:
        gc.unfreeze()
    return out


def repeat(fn: Callable[[], Any], *, warmup: int, repeats: int) -> Runs:
    """`warmup` untimed calls of fn, then `repeats` timed ones."""
    return interleaved([fn], warmup=warmup, repeats=repeats)[0]


def median_step_seconds(step: Callable[[Any], Any], batches: Sequence[Any], repeats: int) -> float:
    """Median seconds of step(batch) over `repeats` passes of the batches, after one warm-up step."""
    batch = itertools.cycle(batches).__next__
    return repeat(lambda: step(batch()), warmup=1, repeats=repeats * len(batches)).median
