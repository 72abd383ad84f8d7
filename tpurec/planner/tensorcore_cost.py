"""Step time of the TensorCore kernel's lookups and updates (TPUs without driven SparseCores: v5e,
v4), from what they cost on a v5e chip rather than from a share of HBM bandwidth.

Why: the SparseCore model (`estimators.shard_cost`: bytes moved at 30% of HBM bandwidth) priced a
v5e lookup of 131,072 ids at 1M x 128 f32 at 0.27 ms and its row-wise Adagrad update at 0.82 ms; the
chip took 0.99 and 7.79 ms (docs/results.md, session 41). The TensorCore kernel is bound by XLA's
row gather and scatter, not by bytes: a gather of narrow rows costs about a 128-lane row or more, and
a scatter's time per row grows with the table it writes into.

The figures: v5e, 16,384 samples x 8 uniform ids (131,072), JAX 0.10.2, libtpu 0.0.42.1, medians of
interleaved rounds. v4 (not measured) is scaled by its HBM bandwidth over v5e's (an assumption).
"""

from __future__ import annotations

from tpurec.embedding import pool_vmem
from tpurec.planner.tensorcore_pooling import VMEM_BYTES

_IDS = 131_072  # the measured cells' ids
# The lookup (decode, gather, pooling) at width 128, ns per id, by the pooling's output copies
# (probe 15, `scripts/tpu_probe_lookup_pool.py`, session 41: 4 copies + gains 0.989 ms; 1 copy +
# gains 1.113 ms, also taken for 2, not measured with the gains inside; 0 = XLA's segment sum,
# 1.716 ms). An unpooled (sequence) lookup is the decode and gather alone (0.725 ms).
LOOKUP_NS_PER_ID = {8: 0.989e6 / _IDS, 4: 0.989e6 / _IDS, 2: 1.113e6 / _IDS, 1: 1.113e6 / _IDS, 0: 1.716e6 / _IDS}
GATHER_NS_PER_ID = 0.725e6 / _IDS


def _per_id_line(ms_1m: float, ms_4m: float) -> tuple[float, float]:
    """(a, b) of ns per id = a + b x rows / 1M through a 1M- and a 4M-row measurement."""
    at_1m, at_4m = ms_1m * 1e6 / _IDS, ms_4m * 1e6 / _IDS
    b = (at_4m - at_1m) / 3
    return at_1m - b, b


# The update program at width 128, ns per id = a + b x (table rows / 1M), from `tpurec bench
# tpu-kernels` (session 41) at 1M and 4M rows: SGD 5.191 / 9.808 ms, row-wise Adagrad 7.035 / 12.761
# ms; the growth is XLA's row scatter, slower into a larger table (probe 16: no table copy).
UPDATE_NS_PER_ID = {"sgd": _per_id_line(5.191, 9.808), "rowwise_adagrad": _per_id_line(7.035, 12.761)}
# Width 16 against width 128 (`tpurec bench tpu-kernels`, cells 3 and 0, session 41): lookup 1.470 /
# 1.036 ms, SGD 17.219 / 5.191, row-wise Adagrad 12.168 / 7.035: narrower rows are not cheaper on
# v5e. Taken for every width under 128 (width 64's gather measured slower than 128's too: probe 14).
NARROW_FACTOR = {"lookup": 1.470 / 1.036, "sgd": 17.219 / 5.191, "rowwise_adagrad": 12.168 / 7.035}
V5E_HBM_BW = 819e9  # bytes/s, cloud.google.com/tpu/docs/v5e (as topology.GENERATIONS["v5e"])


def _width_factor(cols: int, kind: str) -> float:
    """Cost of a row of `cols` against a 128-wide one: proportional above 128, NARROW_FACTOR below."""
    lanes = pool_vmem.LANES
    return cols / lanes if cols >= lanes else NARROW_FACTOR[kind]


def _chip_factor(generation: str, hbm_bw: float) -> float:
    return 1.0 if generation == "v5e" else V5E_HBM_BW / hbm_bw


def pooling_accumulators(generation: str, segments: int, cols: int) -> int:
    """The output copies the kernel pools with for `segments` pooled rows of `cols` (0: XLA's
    segment sum), as `tpu_bridge.pool_options` picks them on the chip. A shard alone: a stack of
    several tables has more segments, so this can be one step optimistic."""
    return pool_vmem.accumulators_that_fit(segments, cols, VMEM_BYTES.get(generation))


def lookup_ms(ids: float, cols: int, generation: str, hbm_bw: float, accumulators: int | None) -> float:
    """The lookup of `ids` rows of `cols`; `accumulators` None: unpooled (a gather, no pooling)."""
    per_id = GATHER_NS_PER_ID if accumulators is None else LOOKUP_NS_PER_ID[accumulators]
    return ids * per_id * _width_factor(cols, "lookup") * _chip_factor(generation, hbm_bw) / 1e6


def update_ms(
    ids: float, cols: int, rows: int, optimizer: str, state_bytes_per_row: int, generation: str, hbm_bw: float
) -> float:
    """The fused update of `ids` ids into a table of `rows` x `cols`. Optimizers not measured on the
    chip (Adagrad, Adam, ...) take row-wise Adagrad's figure scaled by the bytes an id moves (its
    gradient, its row read and written, its state read and written) against row-wise Adagrad's."""
    kind = optimizer if optimizer in UPDATE_NS_PER_ID else "rowwise_adagrad"
    a, b = UPDATE_NS_PER_ID[kind]
    per_id = a + b * rows / 1e6
    if optimizer not in UPDATE_NS_PER_ID:
        row = 4 * cols
        per_id *= (3 * row + 2 * state_bytes_per_row) / (3 * row + 2 * 4)
    return ids * per_id * _width_factor(cols, kind) * _chip_factor(generation, hbm_bw) / 1e6
