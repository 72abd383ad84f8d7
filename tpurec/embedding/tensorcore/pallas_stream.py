"""The fused update as one Pallas TPU kernel that streams the table: merge, optimizer and write-back
block by block, with no gather or scatter of rows.

Why: on a v5e TensorCore XLA moves single rows slowly (its row gather 114 GB/s, the update's gather
+ scatter of 123k distinct rows ~2.4 ms; plain JAX's row-wise Adagrad over the whole 1M x 128 table
beat the sparse update: docs/results.md, session 29). A dense pass runs at the HBM's pace instead:
the table goes through VMEM in blocks of BLOCK rows (the pipeline double-buffers them, the output
aliased to the table: updated in place), and while a block is in VMEM the slots of its rows are
walked in slot order: each adds gain x its sample's gradient row (the gradient resident in VMEM)
into a running sum restarted where a row starts, and at a row's last slot the optimizer updates that
row in VMEM. It pays for the whole table whatever the batch touches, so it serves tables not much
larger than the rows a batch touches (`worth_streaming`).

The slots reach the scalar unit through SMEM in chunks of CHUNK, two buffers, the next chunk's DMA
issued when a chunk is first read: a slot packs its sample, its row within the block and three flags
(valid, starts a row, ends a row) in one int32, and its gain comes in a float32 beside it. Requires
one SparseCore per device (a row's slots adjacent, rows increasing over the valid slots), as
`pallas_merge`. Same sums in the same order as `update_jax` (each row's, in slot order); the
row-wise Adagrad's squared norm is summed across lanes by the TPU, in its own order.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpurec.embedding.pool_vmem import LANES
from tpurec.embedding.tensorcore.csr_jax import Entries

Ref = Any  # a kernel argument is a Pallas Ref; JAX types it loosely

BLOCK = 1024  # table rows per block (512 KiB of a 128-wide f32 table; its row-wise state: 4 KiB of SMEM)
CHUNK = 2048  # slots per SMEM chunk (x2 buffers x 8 bytes = 32 KiB of v5e's 1 MiB SMEM)
VALID, START, LAST = 1, 2, 4
ROW_BITS, ROW_SHIFT, SAMPLE_SHIFT = 11, 3, 14  # flags in bits 0-2, row-in-block 3-13, sample 14-31
MAX_SAMPLES = 1 << (32 - SAMPLE_SHIFT)


def pack_slots(e: Entries, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(bounds int32 [blocks + 1], packed int32 [slots], gains float32 [slots]): block b's slots are
    bounds[b]..bounds[b+1] (invalid slots inside are skipped by their flag)."""
    n = e.rows.shape[0]
    marker = jnp.full(1, -1, jnp.int32)
    before = jnp.concatenate([marker, e.rows[:-1]]) if n else e.rows
    after = jnp.concatenate([e.rows[1:], marker]) if n else e.rows
    flags = (
        jnp.where(e.valid, VALID, 0)
        | jnp.where(e.valid & (e.rows != before), START, 0)
        | jnp.where(e.valid & (e.rows != after), LAST, 0)
    )
    # rows increase over the valid slots; an invalid slot takes the row before it, so the sequence
    # is non-decreasing and each block's slots are one range
    ordered = jax.lax.cummax(jnp.where(e.valid, e.rows, -1))
    blocks = -(-num_rows // BLOCK)
    bounds = jnp.searchsorted(ordered, jnp.arange(blocks + 1, dtype=jnp.int32) * BLOCK, side="left")
    local = jnp.where(e.valid, e.rows % BLOCK, 0)
    samples = jnp.where(e.valid, e.samples, 0)
    packed = (samples << SAMPLE_SHIFT) | (local << ROW_SHIFT) | flags
    return bounds.astype(jnp.int32), packed.astype(jnp.int32), jnp.where(e.valid, e.gains, 0.0)


def _slot_stream(packed: Ref, gains: Ref, pbuf: Ref, gbuf: Ref, sems: Ref, cursor: Ref, num_chunks: int) -> Any:
    """read(k) -> (packed, gain) of slot k, k increasing over the whole kernel: chunk c sits in
    buffer c % 2; reading a new chunk waits for it and starts the next one's DMA."""

    def copy(c: jax.Array) -> tuple[Any, Any]:
        b = c % 2
        src = pl.ds(c * CHUNK, CHUNK)
        return (
            pltpu.make_async_copy(packed.at[src], pbuf.at[b], sems.at[0, b]),
            pltpu.make_async_copy(gains.at[src], gbuf.at[b], sems.at[1, b]),
        )

    def start(c: jax.Array) -> None:
        @pl.when(c < num_chunks)
        def _() -> None:
            for cp in copy(c):
                cp.start()

    def read(k: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = k // CHUNK

        @pl.when(c != cursor[0])
        def _arrive() -> None:
            for cp in copy(c):
                cp.wait()
            start(c + 1)
            cursor[0] = c

        b, j = c % 2, k % CHUNK
        return pbuf[b, j], gbuf[b, j]

    return start, copy, read


def _kernel(
    bounds: Ref,
    scalars: Ref,
    packed: Ref,
    gains: Ref,
    grad: Ref,
    table_in: Ref,
    *rest: Ref,
    optimizer: str,
    num_chunks: int,
) -> None:
    if optimizer == "rowwise_adagrad":
        acc_in, table, acc, pbuf, gbuf, sems, cursor = rest
    else:
        table, pbuf, gbuf, sems, cursor = rest
    b = pl.program_id(0)
    start, copy, read = _slot_stream(packed, gains, pbuf, gbuf, sems, cursor, num_chunks)
    first_chunk = bounds[0] // CHUNK

    @pl.when(b == 0)
    def _open() -> None:
        cursor[0] = -1
        start(first_chunk)

    table[...] = table_in[...]
    if optimizer == "rowwise_adagrad":  # SMEM holds scalars only: the block copied by a local DMA
        local_copy = pltpu.make_async_copy(acc_in, acc, sems.at[0, 2])
        local_copy.start()
        local_copy.wait()
    lr = scalars[0]
    width = table.shape[1]

    def slot(k: jax.Array, run: jax.Array) -> jax.Array:
        p, gain = read(k)
        flags = p & 7
        local = (p >> ROW_SHIFT) & ((1 << ROW_BITS) - 1)
        sample = jax.lax.shift_right_logical(p, SAMPLE_SHIFT)
        base = jnp.where((flags & START) != 0, jnp.zeros_like(run), run)
        run = jnp.where((flags & VALID) != 0, base + grad[pl.ds(sample, 1), :] * gain, run)

        @pl.when((flags & LAST) != 0)
        def _update() -> None:
            old = table[pl.ds(local, 1), :].astype(jnp.float32)
            if optimizer == "sgd":
                step = run * -lr
            else:
                eps = scalars[1]
                norm_sq = jnp.square(jnp.sqrt(jnp.sum(run * run, axis=1, keepdims=True)))
                new = acc[local] + norm_sq / jnp.float32(width)  # [1, 1]: the row's state, in SMEM
                acc[local] = new[0, 0]
                step = run * (-lr / (jnp.sqrt(new) + eps))
            table[pl.ds(local, 1), :] = (old + step).astype(table.dtype)

        return run

    jax.lax.fori_loop(bounds[b], bounds[b + 1], slot, jnp.zeros((1, width), jnp.float32))

    @pl.when((b == pl.num_programs(0) - 1) & (cursor[0] == -1) & (first_chunk < num_chunks))
    def _close() -> None:  # no slot was read: the first chunk's DMA must still end inside the kernel
        for cp in copy(first_chunk):
            cp.wait()


def vmem_bytes(device_batch_size: int, width: int) -> int:
    """VMEM the kernel holds: the gradient, the table's and the state's in and out blocks, each
    double-buffered, rows padded to 128 lanes (pallas_pool.vmem_bytes); a row-wise state is in SMEM."""
    lanes = -(-width // LANES) * LANES
    return (2 * device_batch_size + 4 * BLOCK) * lanes * 4


def fits(num_rows: int, device_batch_size: int, width: int, vmem_capacity: int | None) -> bool:
    """Whether the kernel serves this update (None: no TPU here): the gradient within VMEM and the
    samples within the packed bits."""
    del num_rows  # any: the last block may be partial
    return (
        vmem_capacity is not None
        and device_batch_size <= MAX_SAMPLES
        and vmem_bytes(device_batch_size, width) <= vmem_capacity * 3 // 4
    )


def worth_streaming(num_rows: int, slots: int, row_bytes: int) -> bool:
    """A pass over the table against a gather and a scatter per touched row: XLA moved ~20 ns a row
    (123k rows in 2.4 ms), the HBM ~819 GB/s (v5e: cloud.google.com/tpu/docs/v5e) read and written.
    The streamed pass wins while 2 x table bytes / 819 GB/s < slots x 20 ns."""
    return 2 * num_rows * row_bytes / 819e9 < slots * 20e-9


@functools.partial(jax.jit, static_argnames=("optimizer", "interpret"), donate_argnums=(0, 1))
def update(
    table: jax.Array,
    accumulator: jax.Array | None,
    e: Entries,
    grad: jax.Array,
    lr: jax.Array,
    eps: jax.Array | None = None,
    *,
    optimizer: str,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """(new table, new accumulator or None): SGD (`update_jax.sgd`) or row-wise Adagrad
    (`update_jax.adagrad` with a 1-D accumulator) on the rows the entries touch, in place."""
    num_rows, width = table.shape
    bounds, packed, gains = pack_slots(e, num_rows)
    n = packed.shape[0]
    padded = -(-max(n, 1) // CHUNK) * CHUNK
    packed = jnp.pad(packed, (0, padded - n))
    gains = jnp.pad(gains, (0, padded - n))
    scalars = jnp.stack([jnp.asarray(lr, jnp.float32), jnp.asarray(0.0 if eps is None else eps, jnp.float32)])
    rowwise = optimizer == "rowwise_adagrad"
    blocks = bounds.shape[0] - 1
    block = pl.BlockSpec((BLOCK, width), lambda b, *_: (b, 0))
    state = pl.BlockSpec((BLOCK,), lambda b, *_: (b,), memory_space=pltpu.SMEM)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    inputs = [scalars, packed, gains, grad.astype(jnp.float32), table]
    in_specs = [
        pl.BlockSpec(memory_space=pltpu.SMEM),
        any_,
        any_,
        pl.BlockSpec(grad.shape, lambda b, *_: (0, 0)),
        block,
    ]
    out_specs, out_shape = [block], [jax.ShapeDtypeStruct(table.shape, table.dtype)]
    if rowwise:
        assert accumulator is not None
        inputs.append(accumulator)
        in_specs.append(state)
        out_specs.append(state)
        out_shape.append(jax.ShapeDtypeStruct((num_rows,), jnp.float32))
    # operand indices count the scalar-prefetch bounds first: the table is 5, the accumulator 6.
    # Interpreted, an aliased output of a partial last block comes back padded to whole blocks
    # (JAX 0.10.2): there the outputs are fresh arrays, the same values.
    aliases = {} if interpret else ({5: 0, 6: 1} if rowwise else {5: 0})
    outs = pl.pallas_call(
        functools.partial(_kernel, optimizer=optimizer, num_chunks=padded // CHUNK),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(blocks,),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.SMEM((2, CHUNK), jnp.int32),
                pltpu.SMEM((2, CHUNK), jnp.float32),
                pltpu.SemaphoreType.DMA((2, 3)),
                pltpu.SMEM((1,), jnp.int32),
            ],
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_bytes(grad.shape[0], width) + (16 << 20)
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(bounds, *inputs)
    if rowwise:
        return outs[0], outs[1]
    return outs[0], None
