"""The kernel's lookup and fused update as custom ops with registered autograd: what
`torch.compile(fullgraph=True)` traces (docs/kernels.md, "Compiled step").

The eager step runs `kernel._FusedLookup`, a `torch.autograd.Function` whose context holds the
kernel and the stack's input objects and whose backward mutates Python state (step counts, the
fused optimizers' hooks, the param group's learning rate): Dynamo cannot trace that. Under
`torch.compile` the kernel's `lookup` runs these two ops instead, as TorchRec's own TPU path does
(`torchrec/experimental/torch_tpu/modules/custom_ops.py`: a forward op with `register_fake` and
`register_autograd` whose backward calls an update op that mutates the table):

* `tpurec::fused_lookup` takes the stack's SparseCore input tensors and table and runs
  `torch.ops.tpurec.sparse_dense_matmul` (so the CPU reference, the TPU adapter or the TorchTPU
  stand-in, whichever kernel the device has); its fake returns [device_batch_size, width] float32;
* its autograd backward calls `tpurec::fused_update`, which declares the table and the optimizer
  state it writes (`mutates_args`) and runs `SparseCoreKernel.apply_update` on exactly those tensors:
  the same code as the eager backward, so the same numbers, hooks, step counts and learning rate.

Both ops are opaque to the compiler: the graph holds one call per stack and direction, with fixed
shapes when the stack's id limits are fixed (its COO buffers are then the same size every batch).
The kernel is named in the graph by an integer key (`prepare`), found again at run time here.
The host half (KJT -> SparseCore inputs, `SparseCoreKernel.preprocess`) is data-dependent and stays
eager, before the compiled step, as in TorchRec's `SparseCoreTrainPipeline`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tpurec.embedding import ops, step_scalars
from tpurec.embedding.constraints import PADDING_ID
from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.runtime.device import on_torchtpu

if TYPE_CHECKING:
    from tpurec.embedding.kernel_input import StackInput
    from tpurec.embedding.kernel_protocol import EmbeddingKernel

# The ops' lookups take any EmbeddingKernel (kernel_protocol.py). `prepare` writes the two members
# the protocol only reads, and the update runs the SparseCore kernel's own `apply_update`: those two
# take its SparseCoreKernel, typed Any here (tpurec.embedding.kernel imports this module).
SparseCoreKernel = Any

# key -> kernel: the ops name their kernel by an int (a graph constant), not by the object.
_KERNELS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def prepare(kernel: SparseCoreKernel) -> None:
    """Give a new kernel what its compiled lookups need, made here because a compiled region cannot
    make them: its key in the ops' arguments, and the empty tensor that requires grad (`trigger`)."""
    key = next(_KEYS)
    _KERNELS[key] = kernel
    kernel.custom_op_key = key
    # 0-dim: a scalar, which an op on device tensors may take from the host (torch's device rule; an
    # empty host tensor of shape (0,) among a TPU's tensors is refused, by the emulated device too).
    # On TorchTPU on the device: its compiled program takes no host tensor (the v5e refused this one)
    feed = getattr(kernel, "step_feed", None)
    device = feed.device if feed is not None and on_torchtpu(feed.device) else None
    kernel.custom_op_trigger = torch.zeros((), requires_grad=True, device=device)


def _kernel(key: int) -> SparseCoreKernel:
    kernel = _KERNELS.get(key)
    if kernel is None:
        raise RuntimeError(f"tpurec custom ops: kernel {key} no longer exists (a compiled step outlived its model)")
    return kernel


@torch.library.custom_op("tpurec::fused_lookup", mutates_args=())
def fused_lookup(
    trigger: Tensor,
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    states: list[Tensor],
    step_feed: Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    kernel: int,
    stack: int,
) -> Tensor:
    """Stack `stack`'s pooled lookup, [device_batch_size, width] float32. `trigger` (a 0-dim tensor
    that requires grad) makes autograd reach the update; `states` and `step_feed` (the kernel's, the
    update's scalars: step_scalars.py) are only carried to it."""
    return torch.ops.tpurec.sparse_dense_matmul(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        embedding_table,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
        max_ids_per_partition,
        max_unique_ids_per_partition,
    )


@fused_lookup.register_fake
def _(
    trigger: Tensor,
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    states: list[Tensor],
    step_feed: Tensor,
    device_batch_size: int,
    *_: Any,
) -> Tensor:
    return embedding_table.new_empty((device_batch_size, embedding_table.shape[1]), dtype=torch.float32)


@torch.library.custom_op("tpurec::fused_update", mutates_args=("embedding_table", "states"))
def fused_update(
    activations_grad: Tensor,
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    embedding_table: Tensor,
    states: list[Tensor],
    step_feed: Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    kernel: int,
    stack: int,
) -> None:
    """Stack `stack`'s fused update, in place on `embedding_table` and `states` (which may be the
    compiler's copies of the kernel's storage: written here, copied back by the graph). Its step count
    and scalars are the step's that `begin_compiled_step` began: on a TPU this Python runs once, when
    the graph is compiled, so it reads no per-step state of its own (step_scalars.py)."""
    csr = SparseCoreInput(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        device_batch_size,
        num_sc_per_device,
        num_partitions,
        max_ids_per_partition,
        max_unique_ids_per_partition,
    )
    k = _kernel(kernel)
    lr, values = k.take_step_feed(stack)
    with step_scalars.feeding(step_scalars.Feed(step_feed[stack], values)):
        k.apply_update(stack, csr, activations_grad, lr, new_step=False, storage=(embedding_table, list(states)))


fused_update.register_fake(lambda *args, **kwargs: None)  # in place: nothing to compute under fake tensors


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, rp, emb, smp, gains, table, states, step_feed, *ints = inputs
    ctx.save_for_backward(rp, emb, smp, gains, table, step_feed, *states)
    ctx.ints, ctx.num_states = ints, len(states)


def _backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    rp, emb, smp, gains, table, step_feed, *states = ctx.saved_tensors
    # trainable per-id weights (a FeatureProcessedEmbeddingBagCollection's position weights, built
    # in the graph: tpurec/sharding/fp_preprocess.py): their gradient from the rows before the update
    gains_grad = gains_gradient(grad, rp, emb, smp, gains, table, *ctx.ints[:5]) if ctx.needs_input_grad[4] else None
    torch.ops.tpurec.fused_update(grad, rp, emb, smp, gains, table, states, step_feed, *ctx.ints)
    # no gradient for the other inputs (the table's is consumed by the update); the states' as a list
    return (None,) * 4 + (gains_grad, None, [None] * ctx.num_states, None) + (None,) * 7


def gains_gradient(
    grad: Tensor,
    row_pointers: Tensor,
    embedding_ids: Tensor,
    sample_ids: Tensor,
    gains: Tensor,
    table: Tensor,
    device_batch_size: int,
    num_sc_per_device: int,
    num_partitions: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
) -> Tensor:
    """d loss / d gains of one stack's lookup: entry e's is <grad[sample of e], row(id of e)>, 0 in
    padded slots (as weight_grad.py computes it per id, eagerly; the caller runs it before the update).

    Each entry's row comes from the lookup op itself, so from whatever storage layout and kernel the
    device has: the same COO entries with gain 1 and each entry its own sample (its slot within its
    SparseCore), a [slots, width] output whose row e is row(id of e)."""
    slots = embedding_ids.numel()
    per_sc_slots = slots // num_sc_per_device
    per_sc = device_batch_size // num_sc_per_device
    slot = torch.arange(slots, device=embedding_ids.device)
    valid = embedding_ids != PADDING_ID
    ones = torch.where(valid, 1.0, gains)  # (NaN, the padding's gain, in padded slots)
    own = (slot % per_sc_slots).to(torch.int32)
    rows = torch.ops.tpurec.sparse_dense_matmul(
        row_pointers,
        embedding_ids,
        torch.where(valid, own, sample_ids),
        ones,
        table,
        slots,
        num_sc_per_device,
        num_partitions,
        max_ids_per_partition,
        max_unique_ids_per_partition,
    )
    sample = torch.where(valid, (slot // per_sc_slots) * per_sc + sample_ids.to(torch.int64), 0)
    out = (grad.index_select(0, sample) * rows).sum(1)
    return torch.where(valid, out, 0.0)


fused_lookup.register_autograd(_backward, setup_context=_setup_context)


def stack_lookup(
    kernel: EmbeddingKernel, trigger: Tensor | None, i: int, csr: StackInput, gains: Tensor | None = None
) -> Tensor:
    """Stack i's lookup through the ops: [device_batch_size, width] float32. gains: in place of the
    input's (a tensor of the graph that may require grad: `_backward` then returns its gradient)."""
    if type(csr) is not SparseCoreInput:
        # Several passes (a batch over its limits) or the TPU path's weight-decay layout: their
        # number of op calls depends on the batch, so they have no fixed graph.
        raise NotImplementedError(
            f"compiled step: stack {kernel.stacks[i].layout.name} got a {type(csr).__name__}; only inputs within "
            "fixed id limits (one pass, no TPU weight-decay layout) run in a compiled step yet"
        )
    states = [kernel.stack_state(i, s) for s in kernel.optimizer.state_names]
    if trigger is None:
        if not torch.compiler.is_compiling():  # no grad, eager: the plain lookup op
            args = op_args(csr, kernel.stack_weight(i))
            return ops.sparse_dense_matmul(*args[:3], csr.gains if gains is None else gains, *args[4:])
        # no grad, compiling (the pipelined step's SparseCore forward): fused_lookup too, whose fake
        # kernel traces on any device (the plain op's TPU kernel reaches TorchTPU's op, which may have
        # none); under no_grad its autograd is not recorded
        trigger = kernel.custom_op_trigger
    return torch.ops.tpurec.fused_lookup(
        trigger,
        csr.row_pointers,
        csr.embedding_ids,
        csr.sample_ids,
        csr.gains if gains is None else gains,
        kernel.stack_weight(i),
        states,
        kernel.step_feed,
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
        csr.max_ids_per_partition,
        csr.max_unique_ids_per_partition,
        kernel.custom_op_key,
        i,
    )


def op_args(csr: SparseCoreInput, table: Tensor) -> tuple[Any, ...]:
    """The lookup op's arguments for one stack."""
    return (
        csr.row_pointers,
        csr.embedding_ids,
        csr.sample_ids,
        csr.gains,
        table,
        csr.device_batch_size,
        csr.num_sc_per_device,
        csr.num_partitions,
        csr.max_ids_per_partition,
        csr.max_unique_ids_per_partition,
    )
