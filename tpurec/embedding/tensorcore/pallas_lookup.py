"""The pooled lookup as one Pallas TPU kernel: rows gathered by DMA, summed into a VMEM-resident output.

Why: XLA's gather on a TPU TensorCore moves embedding rows at a few percent of HBM bandwidth
(docs/tpu.md, "Measured on a TPU v5e chip"). Here each entry's row is one DMA from the table in HBM
into a chunk buffer in VMEM; the next chunk's DMAs are issued before the current chunk is summed, so
the copies overlap the adds. The output [device batch, width] stays in VMEM for the whole call and
is written to HBM once at the end; each entry adds gain * row into its sample's output row.

Entries are the decoded CSR slots (`csr_jax.decode`), in slot order, padded to whole chunks; an
invalid entry reads row 0 with gain 0 into the spare output row `device_batch_size` (the output has
`round_up(device_batch_size + 1, 8)` rows; the caller slices). Ids and samples reach the scalar unit
through SMEM blocks of one chunk (SMEM is 1 MiB on v5e, jax/_src/pallas/mosaic/tpu_info.py in JAX
0.10.2: a whole batch's ids would not fit), the next chunk's ids through a second view of the same
array one block ahead. Float32 tables only (a bf16 row is half a sublane: the XLA program serves those).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# A kernel argument is a Pallas Ref (indexed, sliced with .at); JAX types it loosely.
Ref = Any


def _kernel(
    rows_next: Ref,
    rows: Ref,
    samples: Ref,
    gains: Ref,
    table: Ref,
    out: Ref,
    acc: Ref,
    buf: Ref,
    sems: Ref,
    out_sem: Ref,
    *,
    chunk: int,
    unroll: int,
) -> None:
    i = pl.program_id(0)
    n = pl.num_programs(0)
    slot = i % 2

    def issue(ids: Ref, into: jax.Array) -> None:
        def body(k: jax.Array, carry: None) -> None:
            pltpu.make_async_copy(table.at[pl.ds(ids[k], 1)], buf.at[into, pl.ds(k, 1)], sems.at[into]).start()

        jax.lax.fori_loop(0, chunk, body, None, unroll=unroll)

    @pl.when(i == 0)
    def _first() -> None:
        acc[...] = jnp.zeros_like(acc)
        issue(rows, slot)

    @pl.when(i + 1 < n)
    def _ahead() -> None:
        issue(rows_next, 1 - slot)

    # One wait for the whole chunk: a DMA semaphore counts bytes, so a descriptor of the chunk's size
    # waits for all of its row copies.
    pltpu.make_async_copy(table.at[pl.ds(0, chunk)], buf.at[slot], sems.at[slot]).wait()

    def add(k: jax.Array, carry: None) -> None:
        s = samples[k]
        acc[pl.ds(s, 1), :] += gains[k] * buf[slot, pl.ds(k, 1), :]

    jax.lax.fori_loop(0, chunk, add, None, unroll=unroll)

    @pl.when(i + 1 == n)
    def _last() -> None:
        copy = pltpu.make_async_copy(acc, out, out_sem.at[0])
        copy.start()
        copy.wait()


def output_rows(device_batch_size: int) -> int:
    """Rows of the kernel's output: the batch, a spare row for invalid entries, rounded to a sublane tile."""
    return -(-(device_batch_size + 1) // 8) * 8


@functools.partial(jax.jit, static_argnames=("device_batch_size", "chunk", "unroll", "interpret"))
def pooled_lookup(
    rows: jax.Array,
    samples: jax.Array,
    gains: jax.Array,
    table: jax.Array,
    *,
    device_batch_size: int,
    chunk: int = 512,
    unroll: int = 8,
    interpret: bool = False,
) -> jax.Array:
    """[device_batch_size, width] float32: out[b] = sum of gains[k] * table[rows[k]] over k with samples[k] == b.

    rows, samples: int32 [n]; an entry with samples[k] == device_batch_size (the decode's invalid
    marker) and rows[k] a valid row is dropped. `interpret` runs the same kernel on CPU (tests)."""
    n = rows.shape[0]
    padded = -(-max(n, 1) // chunk) * chunk
    pad = padded - n
    rows = jnp.pad(rows.astype(jnp.int32), (0, pad))
    samples = jnp.pad(samples.astype(jnp.int32), (0, pad), constant_values=device_batch_size)
    gains = jnp.pad(gains.astype(jnp.float32), (0, pad))
    num_chunks = padded // chunk
    width = table.shape[1]
    out_rows = output_rows(device_batch_size)

    def smem(ahead: int) -> pl.BlockSpec:
        return pl.BlockSpec((chunk,), lambda i: (jnp.minimum(i + ahead, num_chunks - 1),), memory_space=pltpu.SMEM)

    vmem_bytes = (out_rows + 2 * chunk) * width * 4
    out = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, unroll=unroll),
        grid=(num_chunks,),
        in_specs=[smem(1), smem(0), smem(0), smem(0), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((out_rows, width), jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((out_rows, width), jnp.float32),
            pltpu.VMEM((2, chunk, width), table.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((1,)),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_bytes + (16 << 20)
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(rows, rows, samples, gains, table)
    return out[:device_batch_size]
