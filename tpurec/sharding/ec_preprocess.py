"""A sharded EmbeddingCollection's step split at the compile boundary, as `sharded_preprocess.py` splits
a sharded EBC's: host half (`preprocess_sharded_ec`), device half (`compute_preprocessed_ec`).

Only on the EC's fixed-shape output path (tpurec/sharding/sequence_output.py: a TPU device, or the
sharder's `fixed_limits=True`), whose device tensors do not take the batch's id count as their shape:

* `preprocess_sharded_ec(module, kjt)` (eager, data-dependent): TorchRec's input dist of the ids,
  each lookup kernel's SparseCore inputs (one-id bags, `SparseCoreSequenceKernel.preprocess_sequence`),
  the all-to-all's send index and, per output, the received rows to gather, its padding mask and
  lengths: every index the device half needs, computed on the host from what it holds;
* `compute_preprocessed_ec(module, prepared)` (what `torch.compile(fullgraph=True)` traces): the lookups
  (`tpurec::fused_lookup`), one gather and one all-to-all of equal blocks per sharding, one gather per
  output, and TorchRec's `{embedding name: JaggedTensor}`, each `values()` padded to its capacity with
  zero rows (lengths and offsets copied to the device in the host half, ahead of the graph).

The eager fixed path runs the same two halves back to back (`ShardedSparseCoreEC._fixed_compute`), so
the compiled step computes the eager step's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.errors import UserError
from tpurec.sharding.sequence_output import JaggedPlan, ShardingPlan, jagged_from_plans
from tpurec.sharding.sharded_preprocess import RawActivations, ShardedActivations, lookup_kernel, update_kernel


@dataclass
class ShardedECPreprocessed:
    """One batch of one sharded EC after its input dist and host half (`preprocess_sharded_ec`)."""

    owner: Any  # the ShardedSparseCoreEC that built it
    plans: List[ShardingPlan]  # per sharding (lookup)
    jagged: List[List[JaggedPlan]]  # per sharding, per output
    batch: int  # the KJT's stride on this rank

    def stride(self) -> int:
        """The batch size, as a KeyedJaggedTensor says it (models call `features.stride()`)."""
        return self.batch


def preprocess_sharded_ec(module: Any, features: KeyedJaggedTensor) -> ShardedECPreprocessed:
    """The host half of `module(features)` (module: a ShardedSparseCoreEC on its fixed output path)."""
    fixed = module._fixed_output
    if fixed is None:
        raise UserError(fixed_path_needed(module_name=type(module).__name__))
    if features.variable_stride_per_key():
        raise UserError(
            "a batch per feature (VBE KJT) cannot be preprocessed ahead of a compiled step yet: call the "
            "model with the KJT"
        )
    ctx = module.create_context()
    dist_input = module.input_dist(ctx, features).wait().wait()  # KJTList, one KJT per sharding
    plans = module._fixed_plans(ctx, dist_input)
    device = module._fixed_device()
    jagged = []
    for plan, sharding_ctx, names in zip(plans, ctx.sharding_contexts, module._embedding_names_per_sharding):
        assert sharding_ctx.features_before_input_dist is not None
        per_output = fixed.plan_jagged(
            plan.position,
            sharding_ctx.features_before_input_dist,
            names,
            module._need_indices,
            module._features_to_permute_indices,
        )
        jagged.append([p.to(device) for p in per_output])
    return ShardedECPreprocessed(module, plans, jagged, features.stride())


def fixed_path_needed(module_name: str) -> str:
    return (
        f"the compiled and pipelined steps take a sharded EmbeddingCollection ({module_name}) on its fixed-shape "
        "output path only (a TPU device, DistributedModelParallel(fixed_limits=True) or "
        "SparseCoreECSharder(fixed_limits=True)): elsewhere its outputs "
        "take each batch's id count as their shape"
    )


def ec_over_limits(prepared: ShardedECPreprocessed) -> List[str]:
    """What makes this batch's device half not the one fixed graph: a feature over its capacity (lookup
    blocks, a longer output), a block over its agreed rows (all-to-all rounds) or a stack over its fixed id
    limits (several passes). Empty: the batch fits."""
    out = []
    for plan, outputs in zip(prepared.plans, prepared.jagged):
        if plan.over_limits():
            out.append("a sharding's ids over its capacity or block rows")
        out += [f"output {p.name} over its capacity" for p in outputs if p.over]
        for inputs in plan.kernels:
            if any(type(csr) is not SparseCoreInput for csr in inputs.inputs):
                out.append("a stack over its fixed id limits")
    return out


def compute_preprocessed_ec(module: Any, prepared: ShardedECPreprocessed, raw: Any = None) -> Dict[str, JaggedTensor]:
    """The device half: each sharding's lookups (given `raw`: assembled from the stacks' outputs computed
    earlier) and all-to-all, then each output's gathers."""
    _check_owner(module, prepared)
    out: Dict[str, JaggedTensor] = {}
    for recv, outputs in zip(module._fixed_received(prepared.plans, raw), prepared.jagged):
        out.update(jagged_from_plans(recv, outputs))
    return out


# -- a pipelined step's stages (tpurec/sharding/step/pipelined.py; sharded_preprocess.py's for an EBC) --


def lookup_sharded_ec(module: Any, prepared: ShardedECPreprocessed) -> RawActivations:
    """SparseCore forward: each stack's lookup op on the tables as they are now; no autograd graph."""
    _check_owner(module, prepared)
    with torch.no_grad():
        return [
            [
                lookup_kernel(kmod.kernel, inputs.inputs)
                for kmod, inputs in zip(module._lookups[i]._emb_modules, plan.kernels)
            ]
            for i, plan in enumerate(prepared.plans)
        ]


def output_dist_activations_ec(module: Any, acts: ShardedActivations) -> Dict[str, JaggedTensor]:
    """The model's side of a pipelined step: the lookups' outputs assembled from the raw activations,
    then the all-to-all and the outputs' gathers, as `compute_preprocessed_ec` runs them."""
    prepared = acts.prepared
    assert isinstance(prepared, ShardedECPreprocessed)
    return compute_preprocessed_ec(module, prepared, acts.raw)


def update_sharded_ec(module: Any, prepared: ShardedECPreprocessed, grads: RawActivations) -> int:
    """SparseCore backward: each stack's fused update from its raw activations' gradient
    (`sharded_preprocess.update_kernel`). Returns the number of stack updates run."""
    _check_owner(module, prepared)
    count = 0
    for i, plan in enumerate(prepared.plans):
        for kmod, inputs, per_stack in zip(module._lookups[i]._emb_modules, plan.kernels, grads[i]):
            count += update_kernel(kmod.kernel, inputs.inputs, per_stack)
    return count


def _check_owner(module: Any, prepared: ShardedECPreprocessed) -> None:
    if prepared.owner is not module:
        raise ValueError("these SparseCore inputs were preprocessed for another sharded module")
