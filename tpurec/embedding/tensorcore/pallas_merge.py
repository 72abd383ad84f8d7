"""Duplicate rows' gradients merged in one pass, as a Pallas TPU kernel: the update's row gradients
without XLA's gather of gradient rows, segment sum and compaction scatter.

Why: on a v5e TensorCore, of the SGD update's 5.1 ms (1M x 128 f32, 131,072 ids) the gradient rows'
gather took 0.39, the sorted segment sum 1.08 and the scatter compacting the distinct rows 0.84
(docs/results.md, session 28). On one SparseCore per device (the TensorCore layout) a row's entries are
adjacent in slot order, so a running sum suffices: the kernel walks the slots in order with the
activations' gradient resident in VMEM, adds gain * grad[sample] into a running row (reset where a
row starts) and writes the running row at every slot. The merged gradient of a row is then at its
last slot; every other slot's row index is set past the table, so the optimizer's gather reads zeros
there and its scatter drops them. The rows are distinct but no longer sorted, and the slot count is
unchanged (no compaction). Same sums, in the same order, as `update_jax._merge_in_slot_order`; on
CPU (interpreted) XLA contracts `sum + gain * grad` into one FMA, so a gain that is not a power of
two can round differently there in the last bit.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpurec.embedding.pool_vmem import LANES

Ref = Any  # a kernel argument is a Pallas Ref; JAX types it loosely

# Slots per grid step and loop unroll: pallas_pool's measured choice (its module says why).
CHUNK, UNROLL = 1024, 8
VALID, START = 1, 2  # the slot flags' bits: an entry of the table; the first slot of its row


def _kernel(
    samples: Ref, gains: Ref, flags: Ref, grad: Ref, out: Ref, running: Ref, *, chunk: int, unroll: int
) -> None:
    @pl.when(pl.program_id(0) == 0)
    def _first() -> None:
        running[...] = jnp.zeros_like(running)

    def slot(k: jax.Array, acc: jax.Array) -> jax.Array:
        f = flags[k]
        base = jnp.where((f & START) != 0, jnp.zeros_like(acc), acc)  # 0 + x, as a segment sum starts
        added = base + grad[pl.ds(samples[k], 1), :] * gains[k]
        acc = jnp.where((f & VALID) != 0, added, acc)  # padding adds nothing, not even a signed zero
        out[pl.ds(k, 1), :] = acc
        return acc

    running[...] = jax.lax.fori_loop(0, chunk, slot, running[...], unroll=unroll)


def vmem_bytes(device_batch_size: int, width: int, chunk: int = CHUNK) -> int:
    """VMEM the kernel holds: the gradient and a chunk of output rows, each double-buffered by the
    pipeline, and the running row; rows padded to whole 128-lane tiles (pallas_pool.vmem_bytes)."""
    lanes = -(-width // LANES) * LANES
    return (2 * device_batch_size + 2 * chunk + 8) * lanes * 4


def fits(device_batch_size: int, width: int, vmem_capacity: int | None) -> bool:
    """Whether the kernel serves a merge on a chip of `vmem_capacity` bytes (None: no TPU here)."""
    return vmem_capacity is not None and vmem_bytes(device_batch_size, width) <= vmem_capacity * 3 // 4


@functools.partial(jax.jit, static_argnames=("chunk", "unroll", "interpret"))
def running_sums(
    grad: jax.Array,
    samples: jax.Array,
    gains: jax.Array,
    flags: jax.Array,
    *,
    chunk: int = CHUNK,
    unroll: int = UNROLL,
    interpret: bool = False,
) -> jax.Array:
    """float32 [slots, width]: at slot k, the sum of gain * grad[sample] over the valid slots from the
    last START slot up to k, in slot order. grad: float32 [batch, width]; samples, flags: int32 and
    gains: float32 [slots]; an invalid slot's sample must still index grad (0 will do)."""
    n = samples.shape[0]
    batch, width = grad.shape
    padded = -(-max(n, 1) // chunk) * chunk
    pad = (0, padded - n)
    samples = jnp.pad(samples.astype(jnp.int32), pad)
    gains = jnp.pad(gains.astype(jnp.float32), pad)
    flags = jnp.pad(flags.astype(jnp.int32), pad)  # padded slots: invalid
    smem = functools.partial(pl.BlockSpec, (chunk,), lambda i: (i,), memory_space=pltpu.SMEM)
    out = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, unroll=unroll),
        grid=(padded // chunk,),
        in_specs=[smem(), smem(), smem(), pl.BlockSpec((batch, width), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((chunk, width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, width), jnp.float32),
        scratch_shapes=[pltpu.VMEM((1, width), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_bytes(batch, width, chunk) + (16 << 20)
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(samples, gains, flags, grad.astype(jnp.float32))
    return out[:n]
