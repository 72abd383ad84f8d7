"""Row gathers and in-place row updates as Pallas TPU kernels: one DMA per row, chunks double-buffered.

`gather_rows(values, idx)` is values[idx] for a 2-D array in HBM (XLA's gather moves rows at a few
percent of HBM bandwidth on a v5e TensorCore: docs/tpu.md). `add_rows(table, rows, step)` is
table.at[rows].add(step) for unique rows, done in place: the table is aliased to the output, each
chunk's rows are copied into VMEM, the step added, and the rows copied back, the next chunk's reads
issued before the current chunk's adds. Rows past the table (the update's padding, `num_rows`) are
neither read nor written. Index arrays reach the scalar unit one chunk at a time through SMEM (1 MiB
on v5e: jax/_src/pallas/mosaic/tpu_info.py, JAX 0.10.2), the next chunk through a second view one
block ahead.
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


def _smem(chunk: int, num_chunks: int, ahead: int) -> pl.BlockSpec:
    return pl.BlockSpec((chunk,), lambda i: (jnp.minimum(i + ahead, num_chunks - 1),), memory_space=pltpu.SMEM)


def _params(vmem_bytes: int) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_bytes + (16 << 20))


def _interpret(on: bool) -> pltpu.InterpretParams | bool:
    return pltpu.InterpretParams() if on else False


def _pad(idx: jax.Array, chunk: int, fill: int) -> jax.Array:
    n = idx.shape[0]
    return jnp.pad(idx.astype(jnp.int32), (0, -(-max(n, 1) // chunk) * chunk - n), constant_values=fill)


def _issue_reads(src: Ref, ids: Ref, buf: Ref, sem: Ref, chunk: int, unroll: int) -> None:
    """Start one DMA per id: src[ids[k]] -> buf[k]. Ids outside src read its last row (never waited apart)."""
    last = src.shape[0] - 1

    def body(k: jax.Array, carry: None) -> None:
        row = jnp.minimum(ids[k], last)
        pltpu.make_async_copy(src.at[pl.ds(row, 1)], buf.at[pl.ds(k, 1)], sem).start()

    jax.lax.fori_loop(0, chunk, body, None, unroll=unroll)


def _wait_chunk(src: Ref, buf: Ref, sem: Ref, chunk: int) -> None:
    # a DMA semaphore counts bytes: one wait of the chunk's size covers all of its row copies
    pltpu.make_async_copy(src.at[pl.ds(0, chunk)], buf, sem).wait()


def _gather_kernel(ids_next, ids, src, out, buf, sems, out_sems, *, chunk: int, unroll: int) -> None:  # type: ignore[no-untyped-def]
    i = pl.program_id(0)
    n = pl.num_programs(0)
    slot = i % 2

    @pl.when(i == 0)
    def _first() -> None:
        _issue_reads(src, ids, buf.at[slot], sems.at[slot], chunk, unroll)

    @pl.when(i + 1 < n)
    def _ahead() -> None:
        # the other slot's last write-out must be done before its buffer is refilled
        @pl.when(i > 0)
        def _drain() -> None:
            pltpu.make_async_copy(buf.at[1 - slot], out.at[pl.ds(0, chunk)], out_sems.at[1 - slot]).wait()

        _issue_reads(src, ids_next, buf.at[1 - slot], sems.at[1 - slot], chunk, unroll)

    _wait_chunk(src, buf.at[slot], sems.at[slot], chunk)
    write = pltpu.make_async_copy(buf.at[slot], out.at[pl.ds(i * chunk, chunk)], out_sems.at[slot])
    write.start()

    @pl.when(i + 1 == n)
    def _last() -> None:
        write.wait()

        @pl.when(i > 0)
        def _other() -> None:
            pltpu.make_async_copy(buf.at[1 - slot], out.at[pl.ds(0, chunk)], out_sems.at[1 - slot]).wait()


@functools.partial(jax.jit, static_argnames=("chunk", "unroll", "interpret"))
def gather_rows(
    values: jax.Array, idx: jax.Array, *, chunk: int = 512, unroll: int = 8, interpret: bool = False
) -> jax.Array:
    """values[idx] for int32 idx in [0, len(values)) (an index past the end reads the last row)."""
    n = idx.shape[0]
    ids = _pad(idx, chunk, 0)
    num_chunks = ids.shape[0] // chunk
    width = values.shape[1]
    out = pl.pallas_call(
        functools.partial(_gather_kernel, chunk=chunk, unroll=unroll),
        grid=(num_chunks,),
        in_specs=[_smem(chunk, num_chunks, 1), _smem(chunk, num_chunks, 0), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((ids.shape[0], width), values.dtype),
        scratch_shapes=[
            pltpu.VMEM((2, chunk, width), values.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        compiler_params=_params(2 * chunk * width * values.dtype.itemsize),
        interpret=_interpret(interpret),
    )(ids, ids, values)
    return out[:n]


def _add_kernel(
    rows_prev: Ref,
    rows_next: Ref,
    rows: Ref,
    step: Ref,
    table_in: Ref,
    table: Ref,
    buf: Ref,
    sems: Ref,
    out_sems: Ref,
    *,
    chunk: int,
    unroll: int,
) -> None:
    del table_in  # aliased to `table`
    i = pl.program_id(0)
    n = pl.num_programs(0)
    slot = i % 2
    num_rows = table.shape[0]

    def wait_writes(s: jax.Array, ids: Ref) -> None:
        """Wait for the chunk's row writes (padding rows were not written)."""

        def body(k: jax.Array, carry: None) -> None:
            @pl.when(ids[k] < num_rows)
            def _w() -> None:
                pltpu.make_async_copy(buf.at[s, pl.ds(k, 1)], table.at[pl.ds(0, 1)], out_sems.at[s]).wait()

        jax.lax.fori_loop(0, chunk, body, None, unroll=unroll)

    @pl.when(i == 0)
    def _first() -> None:
        _issue_reads(table, rows, buf.at[slot], sems.at[slot], chunk, unroll)

    # the other slot's writes (chunk i - 1) finish before its buffer takes chunk i + 1's rows
    @pl.when(i > 0)
    def _drain() -> None:
        wait_writes(1 - slot, rows_prev)

    @pl.when(i + 1 < n)
    def _ahead() -> None:
        _issue_reads(table, rows_next, buf.at[1 - slot], sems.at[1 - slot], chunk, unroll)

    _wait_chunk(table, buf.at[slot], sems.at[slot], chunk)
    buf[slot] = (buf[slot].astype(jnp.float32) + step[...]).astype(buf.dtype)

    def write(k: jax.Array, carry: None) -> None:
        @pl.when(rows[k] < num_rows)
        def _w() -> None:
            pltpu.make_async_copy(buf.at[slot, pl.ds(k, 1)], table.at[pl.ds(rows[k], 1)], out_sems.at[slot]).start()

    jax.lax.fori_loop(0, chunk, write, None, unroll=unroll)

    @pl.when(i + 1 == n)
    def _last() -> None:
        wait_writes(slot, rows)


@functools.partial(jax.jit, static_argnames=("chunk", "unroll", "interpret"), donate_argnums=(0,))
def add_rows(
    table: jax.Array, rows: jax.Array, step: jax.Array, *, chunk: int = 512, unroll: int = 8, interpret: bool = False
) -> jax.Array:
    """table.at[rows].add(step) in place (the table is donated): rows unique where < len(table), and
    rows >= len(table) (padding) skipped; step float32 [len(rows), width], added in float32 and rounded
    once to the table's dtype."""
    num_rows, width = table.shape
    ids = _pad(rows, chunk, num_rows)
    step = jnp.pad(step.astype(jnp.float32), ((0, ids.shape[0] - rows.shape[0]), (0, 0)))
    num_chunks = ids.shape[0] // chunk
    return pl.pallas_call(
        functools.partial(_add_kernel, chunk=chunk, unroll=unroll),
        grid=(num_chunks,),
        in_specs=[
            pl.BlockSpec((chunk,), lambda i: (jnp.maximum(i - 1, 0),), memory_space=pltpu.SMEM),
            _smem(chunk, num_chunks, 1),
            _smem(chunk, num_chunks, 0),
            pl.BlockSpec((chunk, width), lambda i: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
        input_output_aliases={4: 0},
        scratch_shapes=[
            pltpu.VMEM((2, chunk, width), table.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        compiler_params=_params(4 * chunk * width * 4),
        interpret=_interpret(interpret),
    )(ids, ids, ids, step, table)
