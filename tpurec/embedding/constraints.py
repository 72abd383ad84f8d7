"""What the SparseCore kernel demands of a table, and what its buffers cost.

One place for the numbers that the kernel, the planner's storage estimator and the inspector must
agree on. Layout facts follow jax-tpu-embedding 0.1.0 (`sparsecore/lib/core/input_preprocessing.py`,
the reference the SparseCore ops consume) and TorchTPU 0.2.0's op schemas (docs/kernels.md).
"""

from __future__ import annotations

import math

from tpurec.errors import UserError

# Padded slots in embedding_ids / sample_ids carry this value; their gains are NaN.
PADDING_ID = 2**31 - 1
# CSR segments (one per partition) start on multiples of this many entries.
SEGMENT_ALIGN = 8
# embedding_dim must be a multiple of this (SparseCore vector width in f32 lanes).
DIM_ALIGN = 8

# SparseCores per device when neither the caller nor a TPU says: v5p's 4 (jax-tpu-embedding
# NUM_SC_PER_DEVICE_MAP; Cloud TPU v5p docs). On CPU the count changes only the layout, never results.
DEFAULT_NUM_SPARSECORES = 4


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def check_dim(table: str, dim: int) -> None:
    if dim <= 0 or dim % DIM_ALIGN:
        raise UserError(
            f"table {table!r}: embedding_dim={dim} is not a positive multiple of {DIM_ALIGN}, which the "
            f"SparseCore kernel requires; use {max(DIM_ALIGN, round_up(dim, DIM_ALIGN))}"
        )


def padded_rows(num_embeddings: int, num_partitions: int) -> int:
    """Rows a table occupies once its vocabulary is padded to a multiple of num_partitions * 8."""
    return round_up(num_embeddings, num_partitions * SEGMENT_ALIGN)


def rows_per_partition(num_embeddings: int, num_partitions: int) -> int:
    return padded_rows(num_embeddings, num_partitions) // num_partitions


def coo_entries_per_sc(max_ids_per_partition: int, num_partitions: int) -> int:
    """COO slots one SparseCore's buffer holds: one 8-aligned segment of max ids per partition."""
    return round_up(max_ids_per_partition, SEGMENT_ALIGN) * num_partitions


def row_pointer_entries_per_sc(num_partitions: int) -> int:
    return max(num_partitions, SEGMENT_ALIGN)


def csr_buffer_bytes(max_ids_per_partition: int, num_sc_per_device: int, global_device_count: int = 1) -> int:
    """Bytes of one table's (or stack's) SparseCore input buffers on one device.

    Per local SparseCore: int32 row pointers, and int32 embedding ids, int32 sample ids, f32 gains
    for every COO slot.
    """
    parts = num_sc_per_device * global_device_count
    per_sc = 4 * row_pointer_entries_per_sc(parts) + 12 * coo_entries_per_sc(max_ids_per_partition, parts)
    return num_sc_per_device * per_sc


def worst_case_max_ids_per_partition(batch_per_device: int, pooling_factor: float, num_sc_per_device: int) -> int:
    """A limit no batch can exceed: every id of one SparseCore's sample slice in one partition."""
    per_sc = math.ceil(batch_per_device / num_sc_per_device)
    return round_up(max(1, math.ceil(per_sc * pooling_factor)), SEGMENT_ALIGN)
