"""The SparseCore CSR input decoded into fixed-size entries, in JAX (`reference.decode`'s semantics).

Every COO slot becomes one entry (physical row, device-batch sample, gain, valid): the arrays keep
the buffer's size, so shapes are static and padding is masked rather than removed (the reference's
`nonzero` has a data-dependent size that XLA cannot compile).

Layout (preprocess.py): SparseCore s owns slots s*slots..(s+1)*slots-1; `row_pointers[s]` holds the
end (in s's slots) of each partition's segment; a slot in partition p's segment with local id c is
row p * rows_per_partition + c, and its sample id is local to s's slice of the device batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpurec.embedding.constraints import PADDING_ID


class Entries(NamedTuple):
    """One entry per COO slot. Invalid slots (padding, past the last segment, id out of the table)
    carry row = num_rows and sample = device_batch_size (out of range: scatters drop them) and gain 0."""

    rows: jax.Array  # int32 [slots]
    samples: jax.Array  # int32 [slots]
    gains: jax.Array  # float32 [slots]
    valid: jax.Array  # bool [slots]


def decode(
    row_pointers: jax.Array,
    embedding_ids: jax.Array,
    sample_ids: jax.Array,
    gains: jax.Array,
    *,
    num_rows: int,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
) -> Entries:
    """The entries of a SparseCore input for a table of `num_rows` physical rows.

    rows_per_partition is num_rows // num_partitions, as the reference ops take it from the table."""
    n = embedding_ids.shape[0]
    slots = n // num_sc
    per_sc = device_batch_size // num_sc
    rows_per_partition = num_rows // num_partitions
    pos = jnp.arange(n, dtype=jnp.int32)
    sc = pos // slots
    # As the reference: every SparseCore's segment ends shifted into one increasing sequence over the
    # whole buffer, so the count of ends <= pos is (SparseCore, partition) of the slot at pos.
    ends = row_pointers.reshape(num_sc, -1)[:, :num_partitions].astype(jnp.int32)
    ends = (ends + (jnp.arange(num_sc, dtype=jnp.int32) * slots)[:, None]).reshape(-1)
    part = jnp.searchsorted(ends, pos, side="right").astype(jnp.int32) - sc * num_partitions
    ids = embedding_ids.astype(jnp.int32)
    rows = part * rows_per_partition + ids
    # A slot past its SparseCore's last segment end is not read by the reference's loops
    # (csr_kernels.bag_order); an id outside its partition's rows raises there and is dropped here
    # (a compiled program cannot raise; the host checks of input_checks.check_csr run before).
    valid = (ids != PADDING_ID) & (part < num_partitions) & (ids >= 0) & (rows < num_rows)
    samples = sc * per_sc + sample_ids.astype(jnp.int32)
    valid = valid & (samples >= sc * per_sc) & (samples < (sc + 1) * per_sc)
    return Entries(
        rows=jnp.where(valid, rows, num_rows),
        samples=jnp.where(valid, samples, device_batch_size),
        gains=jnp.where(valid, gains.astype(jnp.float32), 0.0),
        valid=valid,
    )
