"""A sharded FeatureProcessedEmbeddingBagCollection's step split at the compile boundary, its position
weights trained inside the graph (tpurec/sharding/step/compiled.py).

TorchRec's sharded FP-EBC (`ShardedFeatureProcessedEmbeddingBagCollection`, fp_sharder.py) runs the
inner EBC's input dist, then each rank's `PositionWeightedModule`s (weights = position_weight[position
of the id in its bag]) on the distributed ids, then the inner lookups on the weighted ids. The eager
SparseCore kernel takes the weights as its entries' gains and passes their gradient back
(weight_grad.py). Split here as `sharded_preprocess.py` splits an EBC:

* `preprocess_fp(module, kjt)` (eager, data-dependent): the FP module's input dist (which tags each
  id with its position before row-wise bucketing), each id's position, each kernel's SparseCore
  inputs, and for each stack where every id of the stack's slice of the batch lands: its place in the
  lookup's KJT values (`index`) and its COO slot (`slots`: ids of one (id, sample) pair merged into
  one entry share it, as the preprocessing sums their gains);
* `compute_fp_preprocessed(module, prepared)` (traced): the weights as the feature processors make
  them (`torch.gather(position_weight, 0, positions)`, 1 for features without one), each stack's gains
  built from them (`base.index_add(slots, weights)`: 0 + w1 + w2 in the ids' order, as the host's
  merge sums them; NaN in padded slots), the lookups with those gains (`custom_ops.stack_lookup`: the
  op's backward returns the gains' gradient from the rows before the update, then updates), TorchRec's
  output dist, and its FP module's no-op term that keeps every position weight in the graph.

The position weights are then ordinary dense parameters of the graph: their gradient flows back
through the gather, and the compiled step averages and steps them with the other dense parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchrec.distributed.embedding_lookup import CommOpGradientScaling
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.embedding import custom_ops
from tpurec.embedding.constraints import PADDING_ID
from tpurec.embedding.preprocess import SparseCoreInput
from tpurec.embedding.preprocessed import PreprocessedFeatures
from tpurec.errors import UserError
from tpurec.sharding.sharded_preprocess import ShardedPreprocessed, _build_output_dist, _output_dist

if TYPE_CHECKING:
    from tpurec.embedding.kernel_input import StackInput
    from tpurec.embedding.kernel_protocol import EmbeddingKernel


@dataclass
class StackGains:
    """Where one stack's ids take their weights from and put them, padded to a fixed capacity (the
    graph's shapes: `_capacity`)."""

    index: Tensor  # int64 [capacity]: each id's place in its lookup's weights (padding: the last place)
    slots: Tensor  # int64 [capacity]: each id's COO slot; `slots` (one past the end) for padding or a dropped id
    base: Tensor  # float32 [slots + 1]: 0 in used slots, NaN (the padding's gain) in padded ones, 0
    divisor: Tensor | None  # float32 [capacity]: the bag's length where the table mean-pools, else 1; None: no mean


@dataclass
class LookupWeights:
    """One lookup's (sharding type's) per-id weights: `features`' position weights end to end and a 1
    (`_weight_table`), each id's place in that (`positions`, in the lookup KJT's values order, padded
    to a fixed capacity with the 1's place); per kernel, per stack, where they go."""

    features: list[str]
    positions: Tensor
    stacks: list[list[StackGains]]


@dataclass
class FPPreprocessed(ShardedPreprocessed):
    """`ShardedPreprocessed` of the FP module's inner EBC (owner: the FP module) and its weights' sources."""

    weights: list[LookupWeights] = field(default_factory=list)


def _capacity(n: int, floor: int) -> int:
    """A fixed size for n per-id entries: `floor` (the stacks' COO slots, which hold every id unless
    bags repeat ids), else its next power-of-two multiple, so that batches rarely change the graph."""
    size = max(floor, 1)
    while size < n:
        size *= 2
    return size


def _padded(x: Tensor, size: int, fill: float | int) -> Tensor:
    return torch.cat([x, torch.full((size - x.numel(),), fill, dtype=x.dtype)])


def position_processors(module: Any) -> dict[str, Any]:
    """feature -> its PositionWeightedModule; any other feature processor is refused by name."""
    from torchrec.modules.feature_processor_ import PositionWeightedModule

    if module._is_collection:
        raise UserError(
            f"the compiled step trains FeatureProcessedEmbeddingBagCollections of PositionWeightedModules "
            f"(one per feature); this one has a {type(module._feature_processors).__name__}: use the eager step"
        )
    out = {}
    for key, processor in module._feature_processors.items():
        if not isinstance(processor, PositionWeightedModule):
            raise UserError(
                f"the compiled step trains PositionWeightedModule feature processors; feature {key!r} has a "
                f"{type(processor).__name__}: use the eager step"
            )
        out[key] = processor
    return out


def preprocess_fp(module: Any, features: KeyedJaggedTensor) -> FPPreprocessed:
    """The host half of `module(features)` (module: a sharded FP-EBC whose inner EBC is tpurec's)."""
    if features.variable_stride_per_key():
        raise UserError(
            "a batch per feature (VBE KJT) cannot be preprocessed ahead of a compiled step yet: call the "
            "model with the KJT"
        )
    processors = position_processors(module)
    inner = module._embedding_bag_collection
    ctx = module.create_context()
    dist_input = module.input_dist(ctx, features).wait().wait()  # KJTList, one KJT per lookup
    inputs, strides, weights = [], [], []
    for lookup, kjt in zip(inner._lookups, dist_input):
        if not lookup._emb_modules:
            lookup._dummy_embs_tensor.grad = None  # (as preprocess_sharded: a compiled step guards on it)
        n = kjt.values().numel()
        # the kernels' inputs from weights 1: where entries go does not depend on the weights (their
        # gains are rebuilt in the graph from these entries' places)
        ones = _with_weights(kjt, kjt.values(), torch.ones(n))
        index = _with_weights(kjt, torch.arange(n), torch.ones(n))
        per_kernel, gains = [], []
        for kmod, part, where in zip(
            lookup._emb_modules, ones.split(lookup._feature_splits), index.split(lookup._feature_splits)
        ):
            csrs = kmod.kernel.preprocess(part)
            per_kernel.append(PreprocessedFeatures(csrs, part.stride()))
            gains.append(_stack_gains(kmod.kernel, part, where, csrs))
        slots = sum(g.base.numel() - 1 for kernel in gains for g in kernel)
        size = _capacity(n + 1, slots)  # (+ 1: the padding's place, weight 1)
        for kernel in gains:
            for g in kernel:
                g.index[g.index < 0] = size - 1
                _on_device(g)
        inputs.append(per_kernel)
        strides.append(kjt.stride())
        names = list(processors)
        positions = _padded(_positions(kjt, processors), size, _ones_place(processors))
        device = next((p.position_weight.device for p in processors.values()), torch.device("cpu"))
        weights.append(LookupWeights(names, positions.to(device), gains))
    for output_dist, sharding_ctx in zip(inner._output_dists, ctx.sharding_contexts):
        _build_output_dist(output_dist, sharding_ctx)
    return FPPreprocessed(module, ctx, inputs, strides, features.stride(), weights)


def _with_weights(kjt: KeyedJaggedTensor, values: Tensor, weights: Tensor) -> KeyedJaggedTensor:
    """`kjt` with other values and weights of the same lengths (as TorchRec's FP module rebuilds it)."""
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=values,
        weights=weights,
        lengths=kjt.lengths(),
        offsets=kjt._offsets,
        stride=kjt._stride,
        length_per_key=kjt._length_per_key,
        offset_per_key=kjt._offset_per_key,
        index_per_key=kjt._index_per_key,
    )


def _ones_place(processors: dict[str, Any]) -> int:
    """The place of the 1 after every feature's position weights (`_weight_table`)."""
    return sum(p.position_weight.numel() for p in processors.values())


def _positions(kjt: KeyedJaggedTensor, processors: dict[str, Any]) -> Tensor:
    """Each id's weight's place in `_weight_table`: its feature's first place + its position, as its
    PositionWeightedModule computes positions (the tags input dist carried when it pre-processed the
    ids for row-wise sharding, else each id's place in its bag); the 1's place for a feature without
    one (TorchRec's FP module gives those weight 1)."""
    first, start = {}, 0
    for key, p in processors.items():
        first[key] = start
        start += p.position_weight.numel()
    out = []
    offsets, stride = kjt.offset_per_key(), kjt.stride()
    lengths = kjt.lengths()
    for j, key in enumerate(kjt.keys()):
        lo, hi = offsets[j], offsets[j + 1]
        processor = processors.get(key)
        if processor is None:
            out.append(torch.full((hi - lo,), start, dtype=torch.int64))
            continue
        if processor._pre_processed:
            pos = kjt.weights()[lo:hi].to(torch.int64)
        else:
            bag = lengths[j * stride : (j + 1) * stride].long()
            pos = torch.arange(hi - lo) - torch.repeat_interleave(torch.cumsum(bag, 0) - bag, bag)
        size = processor.position_weight.numel()
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= size):
            raise UserError(
                f"feature {key!r}: a bag of {int(pos.max()) + 1} ids, but its PositionWeightedModule has "
                f"{size} position weights (max_feature_length): truncate the bags or raise it"
            )
        out.append(pos + first[key])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def _stack_gains(
    kernel: EmbeddingKernel, part: KeyedJaggedTensor, where: KeyedJaggedTensor, csrs: list[StackInput]
) -> list[StackGains]:
    """Per stack of `kernel`: where each id of `part` (its weights' places: `where`'s values) goes. The
    index is padded with -1 (the caller's padding place, once the lookup's capacity is known)."""
    inputs = kernel.inputs
    batch, padded, stacks = inputs.stack_arrays(part, demand=False)
    _, _, places = inputs.stack_arrays(where, demand=False)
    out = []
    for s, ((values, lengths, _), (index, _, _), csr) in enumerate(zip(stacks, places, csrs)):
        if type(csr) is not SparseCoreInput:
            name = kernel.stacks[s].layout.name
            raise UserError(
                f"stack {name}: a batch over its fixed id limits (or the TPU's weight-decay layout) runs as several "
                "passes, which a compiled step of a FeatureProcessedEmbeddingBagCollection does not take yet: raise "
                "max_ids_per_partition or use the eager step"
            )
        ids, samples, _ = inputs._stack_entries(s, values, lengths, None, batch, padded)
        total = csr.embedding_ids.numel()
        size = _capacity(ids.numel(), total)
        divisor = None
        mean = inputs.stack_tensors[s][2]
        if mean is not None:
            n = len(kernel.stacks[s].features)
            seg = torch.repeat_interleave(torch.arange(n * batch), lengths.long())
            per_id_len = lengths.clamp(min=1).to(torch.float32).index_select(0, seg)
            divisor = _padded(torch.where(mean.index_select(0, seg // batch), per_id_len, torch.ones(())), size, 1.0)
        valid = csr.embedding_ids.cpu() != PADDING_ID
        base = torch.cat([torch.where(valid, 0.0, float("nan")), torch.zeros(1)]).to(csr.gains.device)
        slots = _padded(_slots(csr, ids, samples), size, total)
        out.append(StackGains(_padded(index.to(torch.int64), size, -1), slots, base, divisor))
    return out


def _on_device(g: StackGains) -> None:
    """The graph's per-id tensors where the stack's gains are built (`base`: on its inputs' device): a
    TPU's op takes no host tensor beside device ones."""
    device = g.base.device
    g.index, g.slots = g.index.to(device), g.slots.to(device)
    g.divisor = g.divisor.to(device) if g.divisor is not None else None


def _slots(csr: SparseCoreInput, ids: Tensor, samples: Tensor) -> Tensor:
    """Each (SparseCore id, device sample) entry's slot in the COO buffers of `csr` (the number of
    slots for an entry the preprocessing dropped). A slot's entry is found from the buffers alone:
    its SparseCore (slot // slots per SparseCore), partition (row pointers: each segment's end),
    local id (id = local x partitions + partition) and sample in the SparseCore's slice."""
    emb, smp = csr.embedding_ids.cpu().to(torch.int64), csr.sample_ids.cpu().to(torch.int64)
    num_sc, parts = csr.num_sc_per_device, csr.num_partitions
    total = emb.numel()
    per_sc_slots, per_sc = total // num_sc, csr.device_batch_size // num_sc
    ends = csr.row_pointers.cpu().to(torch.int64).view(num_sc, -1)[:, :parts].contiguous()
    offsets = torch.arange(per_sc_slots).repeat(num_sc, 1)  # each slot's place within its SparseCore
    partition = torch.searchsorted(ends, offsets, right=True).view(-1)
    valid = (emb != PADDING_ID).nonzero().squeeze(1)
    slot_ids = emb[valid] * parts + partition[valid]
    width = int(max(int(slot_ids.max()) if slot_ids.numel() else 0, int(ids.max()) if ids.numel() else 0)) + 1
    slot_keys = ((valid // per_sc_slots) * width + slot_ids) * per_sc + smp[valid]
    keys = ((samples // per_sc) * width + ids) * per_sc + samples % per_sc
    if not slot_keys.numel():
        return torch.full_like(keys, total)
    order = torch.argsort(slot_keys)
    found = torch.searchsorted(slot_keys[order], keys).clamp(max=slot_keys.numel() - 1)
    hit = slot_keys[order][found] == keys
    return torch.where(hit, valid[order][found], total)


# -- the device half (traced) ----------------------------------------------------------------------


def compute_fp_preprocessed(module: Any, prepared: FPPreprocessed) -> KeyedTensor:
    """`compute_and_output_dist` of the sharded FP-EBC on inputs built ahead, its weights a function of
    the position weights (autograd and the compiled graph see through it), waited."""
    if prepared.owner is not module:
        raise ValueError("these SparseCore inputs were preprocessed for another sharded module")
    inner = module._embedding_bag_collection
    grad = torch.is_grad_enabled()
    per_lookup = []
    for i in range(len(inner._lookups)):  # indexed, not zipped, as TorchRec writes it for Dynamo
        lookup = inner._lookups[i]
        lw = prepared.weights[i]
        # the weights as the feature processors gather them (one gather per lookup, in its KJT's order:
        # the position weights' gradient sums in the eager step's order)
        weights = torch.gather(_weight_table(module, lw.features), 0, lw.positions)
        factor = getattr(lookup, "_scale_gradient_factor", 1)
        if factor != 1:
            # TorchRec's grouped lookup scales the weights' gradient back up by the world size: its
            # output all-to-all divided the gradient (comm_ops.GRADIENT_DIVISION) and DDP averages
            # these dense parameters again (embedding_lookup.py, CommOpGradientScaling); the same here
            weights = CommOpGradientScaling.apply(weights, factor)
        outs = []
        for kmod, f, stacks in zip(lookup._emb_modules, prepared.inputs[i], lw.stacks):
            kernel = kmod.kernel
            trigger = kernel.custom_op_trigger if grad else None
            raw = [
                custom_ops.stack_lookup(kernel, trigger, s, csr, _gains(weights, g))
                for s, (csr, g) in enumerate(zip(f.inputs, stacks))
            ]
            outs.append(kmod.assemble_raw(raw, f))
        per_lookup.append(outs)
    out = _output_dist(inner, prepared, per_lookup)
    # TorchRec's FP module adds 0 x (sum of its position weights) to its output (param_dp_sync): every
    # position weight in the graph on every rank, so DDP's collectives match; kept for the same numbers
    params = [p.flatten() for p in module._feature_processors.parameters()]
    if params:
        out._values.add_(module._no_op_zero * torch.cat(params).sum())
    return out


def _weight_table(module: Any, features: list[str]) -> Tensor:
    """`features`' position weights end to end, then a 1 (the weight of a feature without a processor)."""
    params = [module._feature_processors[key].position_weight for key in features]
    one = params[0].new_ones(1) if params else torch.ones(1)  # (on the parameters' device)
    return torch.cat([*params, one])


def _gains(weights: Tensor, g: StackGains) -> Tensor:
    w = weights.index_select(0, g.index)
    if g.divisor is not None:
        w = w / g.divisor
    return g.base.index_add(0, g.slots, w)[:-1]
