"""Fewer garbage collections in tpurec's own processes, which spend their first seconds importing.

Importing torch and TorchRec builds ~370,000 long-lived objects. With Python's default thresholds
(700, 10, 10) the cyclic collector runs ~900 young and 7 full collections meanwhile, each full one
walking every object built so far: 0.8 s of `tpurec plan`'s 3.5 s of imports and planning
(MLPerf DCNv2 on v5p-128; measured with gc.callbacks, docs/results.md). A young generation of 10,000
objects leaves no full collection in that start and changes nothing else: cycles are still
collected, only after more allocations. Only tpurec's entry points call this (the `tpurec` command,
a `tpurec train` rank, its launcher); a user's own program keeps the thresholds it sets.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def collect_less() -> None:
    """Raises the young generation's threshold to YOUNG_THRESHOLD, unless it is already higher or
    collection is off (threshold 0)."""
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
