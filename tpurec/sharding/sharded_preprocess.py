"""A sharded EBC's step split at the compile boundary: host half (`preprocess_sharded`), device half
(`compute_preprocessed`).

TorchRec's pipelines run a sharded module's `input_dist` ahead of its `compute_and_output_dist`
(TrainPipelineSparseDist, through the module's context); TorchRec's `SparseCoreTrainPipeline`
feeds its compiled step SparseCore inputs built ahead. tpurec's sharded EBC splits the same way:

* `preprocess_sharded(module, kjt)` (eager, data-dependent): TorchRec's input dist of the ids
  (permute, split, KJT all-to-alls), then each lookup's kernels' SparseCore inputs
  (`SparseCoreKernel.preprocess`), in a `ShardedPreprocessed`;
* `compute_preprocessed(module, prepared)` (what `torch.compile(fullgraph=True)` traces): each
  kernel's lookup (the `tpurec::fused_lookup` op when compiling), TorchRec's output dist of the
  pooled embeddings (its comm ops switch to functional collectives under Dynamo) and the
  KeyedTensor, as `compute_and_output_dist` builds it.

A pipelined step (tpurec/sharding/step/pipelined.py) splits the device half once more:
`lookup_sharded` (the SparseCore forward, no autograd graph), `output_dist_activations` (the
kernels' outputs from those activations as leaves, and the output dist) and `update_sharded` (the
SparseCore backward: each stack's fused update from its activations' gradient).

`ShardedSparseCoreEBC.forward` takes a `ShardedPreprocessed` (or `ShardedActivations`) in place
of the KJT, so a model whose forward hands its KJT to the sharded EBC (TorchRec's DLRM) runs only
the device half (tpurec/sharding/step/compiled.py, docs/kernels.md "Compiled step").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchrec.distributed.embedding_lookup import embeddings_cat_empty_rank_handle, fx_wrap_tensor_view2d
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable, _apply_mean_pooling
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.embedding import custom_ops
from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.embedding.preprocessed import PreprocessedFeatures
from tpurec.errors import UserError

if TYPE_CHECKING:
    from tpurec.embedding.kernel_input import StackInput
    from tpurec.embedding.kernel_protocol import EmbeddingKernel


@dataclass
class ShardedPreprocessed:
    """One batch of one sharded EBC after its input dist and SparseCore preprocessing."""

    owner: Any  # the sharded EBC that built it (its lookups own the kernels the inputs are for)
    ctx: Any  # TorchRec's EmbeddingBagCollectionContext of this batch (sharding contexts, divisor)
    inputs: list[list[PreprocessedFeatures]]  # per lookup (sharding type), per kernel of the lookup
    strides: list[int]  # per lookup: the batch it looks up (after the ids' all-to-all)
    batch: int  # the KJT's stride on this rank

    def stride(self) -> int:
        """The batch size, as a KeyedJaggedTensor says it (models call `features.stride()`)."""
        return self.batch


def preprocess_sharded(module: Any, features: KeyedJaggedTensor) -> ShardedPreprocessed:
    """The host half of `module(features)` (module: a ShardedSparseCoreEBC): eager, before a compiled step."""
    if features.variable_stride_per_key():
        raise UserError(
            "a batch per feature (VBE KJT) cannot be preprocessed ahead of a compiled step yet: call the "
            "model with the KJT"
        )
    ctx = module.create_context()
    dist_input = module.input_dist(ctx, features).wait().wait()  # KJTList, one KJT per lookup
    inputs, strides = [], []
    for lookup, kjt in zip(module._lookups, dist_input):
        if not lookup._emb_modules:
            # A rank without tables of this sharding type looks up TorchRec's [batch, 0] dummy, which
            # requires grad (so the output dist's backward runs on every rank) and so collects an
            # empty .grad in backward; a compiled step guards on it being None: cleared per batch.
            lookup._dummy_embs_tensor.grad = None
        per_kernel = []
        # GroupedPooledEmbeddingsLookup.forward's split: one KJT per kernel module, in order
        for kmod, part in zip(lookup._emb_modules, kjt.split(lookup._feature_splits)):
            per_kernel.append(PreprocessedFeatures(kmod.kernel.preprocess(part), part.stride()))
        inputs.append(per_kernel)
        strides.append(kjt.stride())
    for output_dist, sharding_ctx in zip(module._output_dists, ctx.sharding_contexts):
        _build_output_dist(output_dist, sharding_ctx)
    return ShardedPreprocessed(module, ctx, inputs, strides, features.stride())


def over_limits(prepared: ShardedPreprocessed) -> list[str]:
    """The stacks ("name (tables a, b)") whose inputs are not one fixed-size pass: a batch over its fixed id
    limits runs as several passes (multipass.py), whose number of op calls depends on the batch, so
    it has no fixed graph (as the TPU path's weight-decay layout has none). Empty: every input is one."""
    out = []
    for lookup, per_kernel in zip(prepared.owner._lookups, prepared.inputs):
        for kmod, f in zip(lookup._emb_modules, per_kernel):
            for s, csr in enumerate(f.inputs):
                if type(csr) is not SparseCoreInput:
                    plan = kmod.kernel.stacks[s]
                    tables = ", ".join(dict.fromkeys(t for _, t in plan.features))
                    out.append(f"{plan.layout.name} (tables {tables})")
    return out


def _build_output_dist(output_dist: Any, sharding_ctx: Any) -> None:
    """TorchRec's TW and RW output dists build their all-to-all module, TWRW (and grid) theirs of
    reduce-scatter and all-to-all, on their first call; built inside the compiled region, that
    changes the module tree after the first trace (a guard fails: one recompile). Built here,
    eagerly, as that first call would."""
    if getattr(output_dist, "_dist", False) is None:
        output_dist._create_output_dist_module(sharding_ctx)
    elif getattr(output_dist, "_intra_dist", False) is None or getattr(output_dist, "_cross_dist", False) is None:
        output_dist._create_output_dist_modules(sharding_ctx)


def compute_preprocessed(module: Any, prepared: ShardedPreprocessed) -> KeyedTensor:
    """The device half: `compute_and_output_dist` of ShardedEmbeddingBagCollection on the inputs built
    ahead, waited (a compiled region returns tensors, not TorchRec's lazy awaitables)."""
    _check_owner(module, prepared)
    per_lookup = []
    for i in range(len(module._lookups)):  # indexed, not zipped, as TorchRec writes it for Dynamo
        lookup = module._lookups[i]
        per_lookup.append([kmod.lookup_preprocessed(f) for kmod, f in zip(lookup._emb_modules, prepared.inputs[i])])
    return _output_dist(module, prepared, per_lookup)


# -- a pipelined step's stages (tpurec/sharding/step/pipelined.py) ------------------------------
# TorchRec's SparseCoreTrainPipeline splits the device half once more: the SparseCore forward
# (lookups) of one batch, the model on another batch's activations, the SparseCore backward (fused
# update) of a third. Raw activations: each stack's lookup-op output, [device batch, width].

RawActivations = list[list[list[Tensor]]]  # per lookup, per kernel of the lookup, per stack


@dataclass
class ShardedActivations:
    """A batch whose lookups ran ahead: what the sharded EBC's (EC's) forward takes in place of the KJT
    to run only TorchRec's output dist (`output_dist_activations`), differentiable back to `raw`."""

    prepared: Any  # ShardedPreprocessed (or a sharded EC's ShardedECPreprocessed: ec_preprocess.py)
    raw: RawActivations

    def stride(self) -> int:
        return self.prepared.batch


class KJTNeeded(UserError, AttributeError):
    """The model read a KeyedJaggedTensor's attribute of a batch field a step replaced by `ModuleInputs`
    (an AttributeError too: `hasattr` probes see the attribute missing, as it is)."""


@dataclass
class ModuleInputs:
    """A batch field's KJT after the host half of every sharded EBC it feeds, in the field's place
    (tpurec/sharding/step/inputs.py: which field feeds which module)."""

    parts: list[Any]  # ShardedPreprocessed or ShardedActivations, one per sharded EBC the field feeds
    batch: int  # the KJT's stride

    def stride(self) -> int:
        """The batch size, as a KeyedJaggedTensor says it (models call `features.stride()`)."""
        return self.batch

    def __getattr__(self, name: str) -> Any:
        # (called only for names the dataclass does not have: a KeyedJaggedTensor's methods)
        if name.startswith("__"):  # Python's and libraries' protocol probes (copy, pickle, pytree)
            raise AttributeError(name)
        raise KJTNeeded(
            f"the compiled/pipelined step hands the model its sharded EmbeddingBagCollections' SparseCore "
            f"inputs in place of the batch's KeyedJaggedTensor; the model's forward reads `.{name}` of it, "
            "which needs the KJT itself: hand the KJT to the EBCs unchanged, or train with the eager step"
        )

    def __getitem__(self, key: Any) -> Any:
        return self.__getattr__(f"[{key!r}]")

    def part_for(self, module: Any) -> Any:
        for part in self.parts:
            owner = part.prepared.owner if isinstance(part, ShardedActivations) else part.owner
            if owner is module:
                return part
        raise ValueError("this batch field holds no SparseCore inputs for this sharded module")


def lookup_sharded(module: Any, prepared: ShardedPreprocessed) -> RawActivations:
    """SparseCore forward: each stack's lookup op on the tables as they are now; no autograd graph."""
    _check_owner(module, prepared)
    out = []
    with torch.no_grad():
        for i in range(len(module._lookups)):
            lookup = module._lookups[i]
            out.append(
                [lookup_kernel(kmod.kernel, f.inputs) for kmod, f in zip(lookup._emb_modules, prepared.inputs[i])]
            )
    return out


def lookup_kernel(kernel: EmbeddingKernel, inputs: list[StackInput]) -> list[Tensor]:
    """One kernel's stacks' lookup-op outputs (raw activations) from its SparseCore inputs."""
    return [custom_ops.stack_lookup(kernel, None, s, csr) for s, csr in enumerate(inputs)]


def output_dist_activations(module: Any, acts: ShardedActivations) -> KeyedTensor:
    """The model's side of a pipelined step: the kernels' outputs assembled from the raw activations,
    then TorchRec's output dist, as `compute_preprocessed` runs them after its lookups."""
    prepared = acts.prepared
    _check_owner(module, prepared)
    per_lookup = []
    for i in range(len(module._lookups)):
        lookup = module._lookups[i]
        kernels = zip(lookup._emb_modules, prepared.inputs[i], acts.raw[i])
        per_lookup.append([kmod.assemble_raw(raw, f) for kmod, f, raw in kernels])
    return _output_dist(module, prepared, per_lookup)


def update_sharded(module: Any, prepared: ShardedPreprocessed, grads: RawActivations) -> int:
    """SparseCore backward: each stack's fused update from its raw activations' gradient, through
    `tpurec::fused_update` (the compiled backward's op: the same optimizer code as the eager step's;
    its step counts, hooks and learning rate those `pipeline_stages.begin_updates` began before it).
    Returns the number of stack updates run."""
    _check_owner(module, prepared)
    count = 0
    for i in range(len(module._lookups)):
        lookup = module._lookups[i]
        for kmod, f, per_stack in zip(lookup._emb_modules, prepared.inputs[i], grads[i]):
            count += update_kernel(kmod.kernel, f.inputs, per_stack)
    return count


def update_kernel(kernel: EmbeddingKernel, inputs: list[StackInput], grads: list[Tensor]) -> int:
    """One kernel's stacks' fused updates from their raw activations' gradients; the number run."""
    count = 0
    for s, (csr, grad) in enumerate(zip(inputs, grads)):
        assert isinstance(csr, SparseCoreInput)  # lookup_kernel refused the others (custom_ops.stack_lookup)
        states = [kernel.stack_state(s, name) for name in kernel.optimizer.state_names]
        torch.ops.tpurec.fused_update(
            grad,
            csr.row_pointers,
            csr.embedding_ids,
            csr.sample_ids,
            csr.gains,
            kernel.stack_weight(s),
            states,
            kernel.step_feed,
            csr.device_batch_size,
            csr.num_sc_per_device,
            csr.num_partitions,
            csr.max_ids_per_partition,
            csr.max_unique_ids_per_partition,
            kernel.custom_op_key,
            s,
        )
        count += 1
    return count


def _check_owner(module: Any, prepared: ShardedPreprocessed) -> None:
    if prepared.owner is not module:
        raise ValueError("these SparseCore inputs were preprocessed for another sharded module")


def _output_dist(module: Any, prepared: ShardedPreprocessed, per_lookup: list[list[Tensor]]) -> KeyedTensor:
    """TorchRec's output dist of each lookup's kernel outputs and the KeyedTensor, waited."""
    ctx = prepared.ctx
    awaitables = []
    for i in range(len(module._lookups)):
        lookup = module._lookups[i]
        dummy = fx_wrap_tensor_view2d(lookup._dummy_embs_tensor, prepared.strides[i], 0)  # a rank without tables
        embs = embeddings_cat_empty_rank_handle(per_lookup[i], dummy, dim=1)
        awaitables.append(module._output_dists[i](embs, ctx.sharding_contexts[i]))
    awaitable = EmbeddingBagCollectionAwaitable(
        awaitables=awaitables, embedding_dims=module._embedding_dims, embedding_names=module._embedding_names
    )
    if module._has_mean_pooling_callback:  # row- or column-wise mean pooling: divided by the host's counts
        awaitable.callbacks.append(partial(_apply_mean_pooling, divisor=ctx.divisor))
    out: KeyedTensor = awaitable.wait()
    return out
