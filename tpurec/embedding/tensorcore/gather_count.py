"""How many rows XLA's row gather should be asked for on a v5e TensorCore: it runs at one of two
speeds, and the count of indices alone decides which.

Measured (probe 14, `scripts/tpu_probe_gather_shapes.py`, sessions 40-41; docs/results.md): `t[ids]`
of a 1M x 128 f32 table took 0.58 ms (116 GB/s of rows) for 131,080 ids and 1.36 ms (49 GB/s) for
131,072, 8.5 ms against 21.2 ms at ~2.13M ids, the same ids placed four ways within 1%. Over the counts
from 65,536 to 2,127,873 the gather was slow exactly where padding the count to a multiple of 1,024
(the index array's tile, `s32[n]{0:T(1024)}` in the compiled program) adds fewer than 128 slots:
131,072 (0 added), 130,945 (127) and 2,127,799 (73) slow; 130,943 (129), 131,073 (1,023) and 2,127,873
(1,023) fast: 34 counts, none against the rule. Asking for up to 128 more (padding that is dropped)
takes the fast speed. Measured at width 128 only: at width 16 two such counts differed by 7% the
other way and width 64 gathered slowly at every count tried, so other widths keep their count.
"""

from __future__ import annotations

INDEX_TILE = 1024  # the index array's tile in the compiled gather (s32[n]{0:T(1024)}, v5e)
SLOW_TAIL = 128  # a count whose tile padding is shorter than this gathered at the slow speed
MEASURED_WIDTH = 128  # f32 lanes a row of the measured tables held


def fast_gather_count(n: int, width: int) -> int:
    """The smallest count >= n that v5e's row gather of rows `width` wide serves at its fast speed
    (n itself, or up to 128 more); n for widths not measured."""
    if width != MEASURED_WIDTH or n <= 0 or (-n) % INDEX_TILE >= SLOW_TAIL:
        return n
    return n + (-n) % INDEX_TILE + 1  # one past a tile boundary: 1,023 slots of padding
