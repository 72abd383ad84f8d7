"""The SparseCore lookup in JAX: gather the entries' rows, scale by their gains, sum per sample.

`reference.lookup_csr`'s result: [device_batch_size, width] float32, row b the sum over the entries
of sample b of gain * table[row]. An FP16/BF16 table's gathered rows are read into float32 first and
summed in float32 (as the reference, after FBGEMM's CPU TBE). Each sample's entries are summed in
slot order, which is the reference's bag order (a bag lies in one SparseCore's slice, read in CSR
order), so float32 sums agree up to XLA's scatter-add order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpurec.embedding.tensorcore.csr_jax import Entries, decode
from tpurec.embedding.tensorcore.gather_count import fast_gather_count


def lookup(
    row_pointers: jax.Array,
    embedding_ids: jax.Array,
    sample_ids: jax.Array,
    gains: jax.Array,
    table: jax.Array,
    *,
    device_batch_size: int,
    num_sc: int,
    num_partitions: int,
    pallas_pool: bool = False,
    interpret: bool = False,
    pool_gains: bool = False,
    pool_accumulators: int = 1,
    pad_gather: bool = True,
) -> jax.Array:
    """Pooled activations [device_batch_size, table width], float32; padding contributes nothing.

    pallas_pool: sum the rows into their samples with `pallas_pool.segment_sum` (a TPU kernel; on
    CPU only with `interpret`) instead of XLA's segment sum: the same sums in the same order.
    pool_gains (with pallas_pool): the gains applied inside the pooling kernel, not in a pass over
    the gathered rows (the same products; the chip's default: tpu_bridge.pool_options).
    pool_accumulators:
    `pallas_pool.segment_sum`'s accumulators (the same A/B). pad_gather: dropped entries appended
    up to a count v5e's row gather runs fast at (`gather_count`; False for A/B runs)."""
    e = decode(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        num_rows=table.shape[0],
        device_batch_size=device_batch_size,
        num_sc=num_sc,
        num_partitions=num_partitions,
    )
    if pad_gather:
        e = _padded_to_a_fast_gather(e, device_batch_size, table.shape[1])
    # invalid entries gather row 0 (mode="fill" would too, at a cost per slot) and are dropped by
    # their out-of-range sample below; their gain is 0 as well, so a NaN never reaches the sums
    rows = jnp.where(e.valid, e.rows, 0)
    values = table[rows].astype(jnp.float32)
    if pallas_pool:
        from tpurec.embedding.tensorcore import pallas_pool as kernel  # Pallas: only when asked for

        kw = {"num_segments": device_batch_size, "interpret": interpret, "accumulators": pool_accumulators}
        if pool_gains:  # each row scaled as the kernel adds it
            return kernel.segment_sum(values, e.samples, e.gains, **kw)
        return kernel.segment_sum(values * e.gains[:, None], e.samples, **kw)
    return jax.ops.segment_sum(values * e.gains[:, None], e.samples, num_segments=device_batch_size)


def _padded_to_a_fast_gather(e: Entries, device_batch_size: int, width: int) -> Entries:
    """The entries with invalid ones appended up to a count XLA's row gather runs fast at on v5e
    (gather_count: up to 128 more; they gather row 0 and are dropped like any invalid entry)."""
    n = e.rows.shape[0]
    extra = fast_gather_count(n, width) - n
    if not extra:
        return e
    return Entries(
        rows=jnp.pad(e.rows, (0, extra)),
        samples=jnp.pad(e.samples, (0, extra), constant_values=device_batch_size),
        gains=jnp.pad(e.gains, (0, extra)),
        valid=jnp.pad(e.valid, (0, extra)),
    )
