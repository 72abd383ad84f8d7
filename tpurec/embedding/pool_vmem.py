"""The Pallas pooling's VMEM arithmetic (`tensorcore.pallas_pool`), without jax: the kernel asks it
whether its output fits the chip, and the planner asks it which pooling each TensorCore stack gets.

The kernel holds the pooled output ([segments + a spare row, to 8 rows] x width, f32) in VMEM for the
whole call, double-buffered by the pipeline, beside two chunks of gathered rows; every row takes
whole 128-lane tiles.
"""

from __future__ import annotations

# Entries per grid step, and adds unrolled per loop turn: 1,024 and 8 were within 3% of the best of
# (512, 8), (1024, 8), (2048, 16) in every cell measured on v5e (docs/results.md, session 28).
CHUNK, UNROLL = 1024, 8
LANES = 128  # a VMEM tile's lanes for 32-bit values (jax/_src/pallas/mosaic/tpu_info.py, num_lanes)
# Output copies the kernel adds into in turn: an entry's read-modify-write of its sample's row then
# need not wait for the previous entry's. On v5e (1M x 128, 16,384 x 8 ids) the pooling alone took
# 0.528 / 0.475 / 0.366 ms with 1 / 2 / 4 copies, and every cell of probe 15 ran fastest with 4
# (docs/results.md, session 41). The kernel takes 1, 2, 4 or 8.
ACCUMULATORS = 4
ACCUMULATOR_CHOICES = (1, 2, 4, 8)


def output_rows(num_segments: int) -> int:
    """Rows of the kernel's output: the segments, a spare row for invalid entries, to a sublane tile."""
    return -(-(num_segments + 1) // 8) * 8


def vmem_bytes(num_segments: int, width: int, chunk: int = CHUNK, accumulators: int = 1) -> int:
    """VMEM the kernel holds: the output and a chunk of rows, each double-buffered by the pipeline,
    and the spare accumulators, every row padded to whole 128-lane tiles (a width-16 output of 106,504
    rows took 53 MiB on v5e: the compiler's VMEM error, docs/results.md, session 28)."""
    lanes = -(-width // LANES) * LANES
    return ((1 + accumulators) * output_rows(num_segments) + 2 * chunk) * lanes * 4


def fits(num_segments: int, width: int, vmem_capacity: int | None, accumulators: int = 1) -> bool:
    """Whether the kernel serves a pooling on a chip of `vmem_capacity` bytes of VMEM (None: no TPU
    in this process). A quarter of VMEM stays for the compiler's own buffers."""
    need = vmem_bytes(num_segments, width, accumulators=accumulators)
    return vmem_capacity is not None and need <= vmem_capacity * 3 // 4


def accumulators_that_fit(num_segments: int, width: int, vmem_capacity: int | None, want: int = ACCUMULATORS) -> int:
    """The most output copies, at most `want`, whose kernel fits the chip's VMEM; 0 where not even
    one does (XLA's segment sum then pools)."""
    return max((a for a in ACCUMULATOR_CHOICES if a <= want and fits(num_segments, width, vmem_capacity, a)), default=0)
