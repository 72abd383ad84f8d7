"""Pooling (a scatter-add of rows into samples) as a Pallas TPU kernel with the output held in VMEM.

Why: in the pooled lookup on a v5e TensorCore, XLA's row gather is fast (114 GB/s of rows at width
128) and its unsorted segment sum is two thirds of the time (docs/results.md, session 28). Here the
gathered rows stream through VMEM in chunks (the pipeline double-buffers them) and each entry adds
its row into its sample's row of an output that stays in VMEM for the whole call: no scatter to HBM.
Samples reach the scalar unit one chunk at a time through SMEM (1 MiB on v5e:
jax/_src/pallas/mosaic/tpu_info.py, JAX 0.10.2). Entries with sample == num_segments (the decode's
invalid marker) add into a spare row that is sliced off.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# the VMEM arithmetic, jax-free for the planner (re-exported: tpu_bridge and the probes read it here)
from tpurec.embedding.pool_vmem import ACCUMULATOR_CHOICES, CHUNK, UNROLL, fits, output_rows, vmem_bytes

__all__ = ["CHUNK", "UNROLL", "fits", "output_rows", "segment_sum", "vmem_bytes"]

# A kernel argument is a Pallas Ref (indexed, sliced with .at); JAX types it loosely.
Ref = Any


def _kernel(*refs: Ref, chunk: int, unroll: int, weighted: bool) -> None:
    # refs: samples (SMEM), [gains (SMEM) if weighted], values, out, the spare accumulators
    samples, gains = refs[0], (refs[1] if weighted else None)
    values, out, *spare = refs[2 if weighted else 1 :]
    targets = (out, *spare)  # entry k adds into targets[k % len(targets)]

    @pl.when(pl.program_id(0) == 0)
    def _first() -> None:
        for t in targets:
            t[...] = jnp.zeros_like(t)

    def add(j: jax.Array, carry: None) -> None:
        # consecutive entries into different accumulators: an entry's read-modify-write of its output
        # row need not wait for the previous entry's store (the loop's cost with one: ~4 ns an entry)
        for a, t in enumerate(targets):
            k = j * len(targets) + a
            s = samples[k]
            row = values[pl.ds(k, 1), :]
            t[pl.ds(s, 1), :] += row if gains is None else row * gains[k]

    jax.lax.fori_loop(0, chunk // len(targets), add, None, unroll=max(unroll // len(targets), 1))

    if spare:

        @pl.when(pl.program_id(0) == pl.num_programs(0) - 1)
        def _fold() -> None:
            def fold(i: jax.Array, carry: None) -> None:
                rows = pl.ds(pl.multiple_of(i * 8, 8), 8)
                total = out[rows, :]
                for t in spare:
                    total += t[rows, :]
                out[rows, :] = total

            jax.lax.fori_loop(0, out.shape[0] // 8, fold, None, unroll=8)


@functools.partial(
    jax.jit, static_argnames=("num_segments", "chunk", "unroll", "interpret", "accumulators", "pad_values")
)
def segment_sum(
    values: jax.Array,
    samples: jax.Array,
    gains: jax.Array | None = None,
    *,
    num_segments: int,
    chunk: int = CHUNK,
    unroll: int = UNROLL,
    interpret: bool = False,
    accumulators: int = 1,
    pad_values: bool = False,
) -> jax.Array:
    """jax.ops.segment_sum(values, samples, num_segments) for float32 values [n, width] and int32
    samples in [0, num_segments] (num_segments: dropped), each segment summed in entry order.

    gains: float32 [n], each entry's row times its gain as it is added (the lookup's gains, applied
    here rather than in a pass over the gathered rows; the same products, so the same sums).
    accumulators: entries added into this many copies of the output in turn (1, 2, 4 or 8), summed at
    the end: each sample's entries in entry order within a copy, so float32 sums agree with XLA's up
    to that order (bit-equal with 1). pad_values=False (the default): the rows are not copied to whole
    chunks (unless fewer than one); the last chunk reads past their end, and those slots' samples
    (padded with the invalid marker, a small copy) send whatever they read to the spare row. The copy
    was 14-26% of the pooling on v5e (probe 15, docs/results.md, session 40); pad_values=True keeps it
    for A/B runs."""
    if accumulators not in ACCUMULATOR_CHOICES or chunk % accumulators:
        raise ValueError(f"accumulators {accumulators}: one of {ACCUMULATOR_CHOICES}, dividing the chunk ({chunk})")
    n, width = values.shape
    padded = -(-max(n, 1) // chunk) * chunk
    samples = jnp.pad(samples.astype(jnp.int32), (0, padded - n), constant_values=num_segments)
    values = values.astype(jnp.float32)
    if pad_values or n < chunk:  # (fewer rows than a block: padded, a small copy, not a block past them all)
        values = jnp.pad(values, ((0, padded - n), (0, 0)))
    rows = output_rows(num_segments)
    scalars = [samples] if gains is None else [samples, jnp.pad(gains.astype(jnp.float32), (0, padded - n))]
    out = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, unroll=unroll, weighted=gains is not None),
        grid=(padded // chunk,),
        in_specs=[
            *[pl.BlockSpec((chunk,), lambda i: (i,), memory_space=pltpu.SMEM) for _ in scalars],
            pl.BlockSpec((chunk, width), lambda i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((rows, width), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, width), jnp.float32),
        scratch_shapes=[pltpu.VMEM((rows, width), jnp.float32)] * (accumulators - 1),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_bytes(num_segments, width, chunk, accumulators) + (16 << 20),
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*scalars, values)
    return out[:num_segments]
