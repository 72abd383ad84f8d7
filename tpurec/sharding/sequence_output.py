"""The sharded EmbeddingCollection's output distribution on the TPU path: on the device, fixed shapes.

TorchRec's sequence output distribution (`SequenceEmbeddingsAllToAll`, `alltoall_sequence`) permutes
the lookup's `[ids, dim]` embeddings with FBGEMM's `permute_2D_sparse_data` and a recat tensor, sends
them with uneven splits, then (row-wise) reorders them with the input distribution's unbucketize
permutation. On a TPU each step of that breaks something: the index tensors live on the host (the input
distribution runs there, tpurec/sharding/host_input_dist.py), FBGEMM's permute has no TPU kernel (its
host route would carry the embeddings off the device and back), every shape follows the batch's id count
(a new TorchTPU program per count), and the all-to-all's buffers differ between ranks, which
`ProcessGroupTpu` refuses.

Here the same result is built from gathers whose indices the host computes from what it already holds
(lengths, splits, recat, unbucketize permutation), with fixed shapes:

1. the lookup returns its whole fixed-capacity output and, on the host, each id's row in it
   (`SparseCoreSequenceKernel.forward_padded`);
2. one gather on the device puts each destination rank's rows, in TorchRec's order, into a block of
   `block_rows` rows (the same on every rank and every step), and one all-to-all of equal blocks
   sends them;
3. one gather per feature takes the received rows into that feature's output, `[capacity, dim]`, its
   first `lengths().sum()` rows the ids' embeddings in `values()` order, the rest zeros.

`block_rows` is agreed by the ranks at the first batch (one host all-reduce: `max_ids_per_feature` x
the features a rank looks up, else twice the largest block; 8-aligned) and each feature's capacity is
`max_ids_per_feature`, else twice its first batch's ids, 8-aligned; each step one host all-reduce
(gloo, the process group's host half) of the largest block decides how many all-to-all rounds run, one
unless a batch is over `block_rows`. The gradient goes back the same way (gathers' backward on the
device, the all-to-all reversed), divided by the world size as TorchRec's sequence all-to-all divides
it (`GRADIENT_DIVISION`).

The output is TorchRec's: `{embedding name: JaggedTensor}`, its lengths, offsets (and, with `need_indices`,
the ids) copied to the device beside `values()`; only `values()` is padded to the capacity.

Each part is split into its host half (`plan_sharding`, `plan_jagged`: SparseCore inputs and every index,
on the host) and its device half (`received`, `jagged_from_plans`: lookups, gathers, all-to-all), so that a
compiled step runs the first ahead, eagerly, and traces the second (tpurec/sharding/ec_preprocess.py).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tpurec.embedding.constraints import SEGMENT_ALIGN, round_up

_HOST = torch.device("cpu")


class _EvenAllToAll(torch.autograd.Function):
    """An all-to-all of equal blocks; backward sends the gradient back, divided by the world size when
    TorchRec divides its sequence all-to-all's gradient (comm_ops.GRADIENT_DIVISION)."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, group: dist.ProcessGroup, anchor: torch.Tensor) -> torch.Tensor:
        # `anchor` requires grad, so that every rank runs the backward all-to-all (a rank holding no
        # table of the sharding sends rows that need no gradient, but must still take part)
        ctx.group = group
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        if get_gradient_division():
            out.div_(dist.get_world_size(ctx.group))
        return out, None, None


def _capacity(n: int, given: int | None) -> int:
    return round_up(max(given if given is not None else 2 * n, 1), SEGMENT_ALIGN)


class FixedSequenceOutput:
    """One sharded EC's fixed shapes (block rows per sharding, capacity per output) and its output path."""

    def __init__(self, max_ids_per_feature: int | None = None) -> None:
        self.max_ids_per_feature = max_ids_per_feature
        self.block_rows: Dict[int, int] = {}  # sharding index -> rows per (source, destination) block
        self.capacity: Dict[str, int] = {}  # embedding name -> output rows

    def _rounds(self, i: int, largest: int, features: int, group: dist.ProcessGroup) -> int:
        """All-to-all rounds of sharding i for this batch; the first batch fixes its block rows (from
        `max_ids_per_feature` x the features a rank looks up, else twice the largest block)."""
        planned = features * self.max_ids_per_feature if self.max_ids_per_feature is not None else 2 * largest
        found = torch.tensor([largest, planned], dtype=torch.int64)  # on the host: the group's gloo half
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        largest = int(found[0])
        if i not in self.block_rows:
            self.block_rows[i] = round_up(max(int(found[1]), 1), SEGMENT_ALIGN)
        return max(1, -(-largest // self.block_rows[i]))

    def sharding_output(
        self,
        i: int,
        lookup: Any,
        features: KeyedJaggedTensor,
        ctx: Any,
        odist: Any,
        dim: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sharding i: the received rows on the device [rounds x world x block rows, dim] and, on the host,
        the row of each id of this rank's batch (TorchRec's output order for the sharding) in it."""
        plan = self.plan_sharding(i, lookup, features, ctx, odist, device)
        return self.received(plan, lookup_planned(lookup, plan.kernels, dim, device)), plan.position

    def plan_sharding(
        self, i: int, lookup: Any, features: KeyedJaggedTensor, ctx: Any, odist: Any, device: torch.device
    ) -> ShardingPlan:
        """`sharding_output`'s host half (eager; ahead of a compiled step, tpurec/sharding/ec_preprocess.py):
        the lookup's SparseCore inputs, the all-to-all's send index and each id's row in what comes back."""
        group = odist._dist._pg
        world = group.size()
        kernels, rows_of = preprocess_padded(lookup, features)
        lengths = features.lengths().view(-1, features.stride()) if features.stride() else features.lengths()
        ctx.lengths_after_input_dist = lengths
        send_counts = list(ctx.output_splits)  # ids each rank sent here: their rows go back to it
        recv_counts = list(ctx.input_splits)  # ids this rank sent to each: their rows come back
        local_features = lengths.shape[0] if lengths.dim() == 2 else 0
        rounds = self._rounds(i, max(send_counts + [0]), local_features, group)
        block = self.block_rows[i]
        # TorchRec's forward recat: the lookup's rows grouped (feature, source) -> (source, feature)
        order = _sequence_order(odist, ctx.sparse_features_recat, lengths, world, rows_of.numel())
        send_rows = rows_of[order] if order.numel() else rows_of
        index = torch.zeros(rounds, world, block, dtype=torch.long)
        start = 0
        for s, n in enumerate(send_counts):
            rows = send_rows[start : start + n]
            start += n
            for q in range(rounds):
                piece = rows[q * block : (q + 1) * block]
                index[q, s, : piece.numel()] = piece
        # each received id's row: source r's j-th row is in round j // block, block r, row j % block
        source = torch.repeat_interleave(torch.arange(world), torch.tensor(recv_counts, dtype=torch.long))
        j = torch.arange(int(source.numel())) - torch.repeat_interleave(
            torch.cumsum(torch.tensor(recv_counts), 0) - torch.tensor(recv_counts), torch.tensor(recv_counts)
        )
        position = (j // block) * world * block + source * block + j % block
        if ctx.unbucketize_permute_tensor is not None:  # row-wise: back to the batch's own order
            position = position[ctx.unbucketize_permute_tensor.to(_HOST, torch.long)]
        # a 0-dim leaf that requires grad, made here (a compiled region cannot make one): added to the rows
        # sent when they need no gradient (a rank without tables of the sharding), so that every rank
        # runs the backward all-to-all in a compiled step (`_exchange`)
        anchor = torch.zeros((), requires_grad=True)
        return ShardingPlan(kernels, index.reshape(rounds, world * block).to(device), position, group, anchor)

    def received(self, plan: ShardingPlan, local: torch.Tensor) -> torch.Tensor:
        """`sharding_output`'s device half after the lookups (`local`: their outputs stacked,
        `lookup_planned`): one gather and one all-to-all of equal blocks per round (traceable by
        torch.compile when the batch is one round)."""
        received = []
        for q in range(plan.index.shape[0]):
            send = local.index_select(0, plan.index[q])
            received.append(_exchange(send, plan.group, plan.anchor))
        return received[0] if len(received) == 1 else torch.cat(received)

    def jagged_tensors(
        self,
        recv: torch.Tensor,
        position: torch.Tensor,
        features: KeyedJaggedTensor,
        embedding_names: List[str],
        need_indices: bool,
        features_to_permute_indices: Dict[str, List[int]] | None,
    ) -> Dict[str, JaggedTensor]:
        """TorchRec's `construct_jagged_tensors` on the padded path: per feature one gather of fixed shape."""
        plans = self.plan_jagged(position, features, embedding_names, need_indices, features_to_permute_indices)
        return jagged_from_plans(recv, [p.to(recv.device) for p in plans])

    def plan_jagged(
        self,
        position: torch.Tensor,
        features: KeyedJaggedTensor,
        embedding_names: List[str],
        need_indices: bool,
        features_to_permute_indices: Dict[str, List[int]] | None,
    ) -> List[JaggedPlan]:
        """`jagged_tensors`' host half: per output, the received rows to gather, its mask and lengths."""
        lengths = features.lengths().view(-1, features.stride()) if features.stride() else features.lengths()
        per_key = features.length_per_key()
        starts = [0]
        for n in per_key:
            starts.append(starts[-1] + n)
        lengths_tuple = torch.unbind(lengths, dim=0)
        values_list = torch.split(features.values(), per_key) if need_indices else None
        key_indices: Dict[str, List[int]] = defaultdict(list)
        for k, name in enumerate(embedding_names):
            key_indices[name].append(k)
        out: List[JaggedPlan] = []
        for name, indices in key_indices.items():
            if features_to_permute_indices and name in features_to_permute_indices:
                indices = [indices[p] for p in features_to_permute_indices[name]]
            n = per_key[indices[0]]
            cap = self.capacity.setdefault(name, _capacity(n, self.max_ids_per_feature))
            rows = cap if n <= cap else round_up(n, cap)  # over the capacity: a multiple of it
            index = torch.zeros(len(indices), rows, dtype=torch.long)
            for piece, k in enumerate(indices):
                index[piece, :n] = position[starts[k] : starts[k] + n]
            feature_lengths = lengths_tuple[indices[0]]
            offsets = torch.cat([feature_lengths.new_zeros(1), feature_lengths.cumsum(0).to(feature_lengths.dtype)])
            out.append(
                JaggedPlan(
                    name,
                    index,
                    torch.arange(rows) < n,
                    feature_lengths,
                    offsets,
                    values_list[indices[0]] if values_list is not None else None,
                    over=n > cap,
                )
            )
        return out


@dataclass
class ShardingPlan:
    """One sharding's host half of the fixed output (`FixedSequenceOutput.plan_sharding`)."""

    kernels: List[Any]  # per kernel of the lookup: its SequenceInputs
    index: torch.Tensor  # [rounds, world x block rows]: the lookup's rows each round sends (on the device)
    position: torch.Tensor  # host: per id of this rank's batch, its row in the received rows
    group: Any  # the sharding's process group
    anchor: torch.Tensor  # 0-dim, requires grad (`_exchange`)

    def over_limits(self) -> bool:
        """Several all-to-all rounds (a block over its agreed rows) or lookup blocks: no fixed graph."""
        return self.index.shape[0] > 1 or any(k.blocks > 1 for k in self.kernels)


@dataclass
class JaggedPlan:
    """One output's host half (`FixedSequenceOutput.plan_jagged`): what builds its JaggedTensor."""

    name: str
    index: torch.Tensor  # [pieces (column shards), rows]: received rows gathered into the output
    mask: torch.Tensor  # [rows] bool: rows holding an id (the rest are zeros)
    lengths: torch.Tensor  # as the input distribution left them (on the host)
    offsets: torch.Tensor
    weights: torch.Tensor | None  # the ids (need_indices)
    over: bool = False  # more ids than the capacity: rows a multiple of it (a new shape)

    def to(self, device: torch.device) -> JaggedPlan:
        """Everything on `device`, the output's lengths, offsets and ids too: the model gets them beside
        `values()`, as TorchRec's EC gives them on a GPU (the KJT moved there) and TorchRec's TPU EC
        (`SparseCorePreprocessedInput.to` moves its lengths), so it builds masks and gathers on the device
        (a host->device copy inside a compiled graph is not possible on the emulated device)."""
        moved = {f: getattr(self, f).to(device) for f in ("index", "mask", "lengths", "offsets")}
        return dataclasses.replace(self, weights=None if self.weights is None else self.weights.to(device), **moved)


def jagged_from_plans(recv: torch.Tensor, plans: List[JaggedPlan]) -> Dict[str, JaggedTensor]:
    """`jagged_tensors`' device half: per output one gather per column piece and the padding rows zeroed."""
    out: Dict[str, JaggedTensor] = {}
    for plan in plans:
        pieces = [recv.index_select(0, plan.index[p]) for p in range(plan.index.shape[0])]
        values = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        out[plan.name] = JaggedTensor(
            values=values * plan.mask.to(recv.dtype).unsqueeze(1),
            lengths=plan.lengths,
            offsets=plan.offsets,
            weights=plan.weights,
        )
    return out


def _exchange(send: torch.Tensor, group: dist.ProcessGroup, anchor: torch.Tensor) -> torch.Tensor:
    """One all-to-all of equal blocks, its gradient sent back (divided as TorchRec divides it)."""
    if not torch.compiler.is_compiling():
        return _EvenAllToAll.apply(send, group, anchor.detach().requires_grad_(torch.is_grad_enabled()))
    world = group.size()
    if world == 1:  # (the eager all-to-all of one rank copies; its gradient divided by 1)
        return send
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    if torch.is_grad_enabled() and not send.requires_grad:
        send = send + anchor  # (adds zeros) every rank runs the backward all-to-all
    out = all_to_all_single_autograd(send, None, None, group)
    return _GradDivided.apply(out, world) if get_gradient_division() else out


class _GradDivided(torch.autograd.Function):
    """The identity, its gradient divided by the world size (the compiled `_exchange`'s TorchRec division)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, world: int) -> torch.Tensor:
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.world, None


def preprocess_padded(lookup: Any, features: KeyedJaggedTensor) -> tuple[List[Any], torch.Tensor]:
    """A grouped sequence lookup's host half: each kernel's SequenceInputs, and each id's row in the
    kernels' outputs stacked (host)."""
    modules = list(getattr(lookup, "_emb_modules", ()))
    if not modules:
        return [], torch.zeros(0, dtype=torch.long)
    kernels, rows, offset = [], [], 0
    for module, group_features in zip(modules, features.split(lookup._feature_splits)):
        inputs = module.preprocess_padded(group_features)
        kernels.append(inputs)
        rows.append(inputs.id_rows() + offset)
        offset += inputs.rows()
    return kernels, torch.cat(rows)


def lookup_planned(lookup: Any, kernels: List[Any], dim: int, device: torch.device) -> torch.Tensor:
    """The grouped lookup's device half: its kernels' fixed outputs, stacked [rows, dim]."""
    modules = list(getattr(lookup, "_emb_modules", ()))
    if not modules:
        return torch.zeros(1, dim, device=device)
    outs = [module.lookup_padded(inputs) for module, inputs in zip(modules, kernels)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def assembled(
    lookup: Any, kernels: List[Any], raw: List[List[torch.Tensor]], dim: int, device: torch.device
) -> torch.Tensor:
    """`lookup_planned`'s output from its kernels' stacks' lookup-op outputs computed earlier (a pipelined
    step's SparseCore forward)."""
    modules = list(getattr(lookup, "_emb_modules", ()))
    if not modules:
        return torch.zeros(1, dim, device=device)
    outs = [module.assemble_padded(r, inputs) for module, inputs, r in zip(modules, kernels, raw)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _sequence_order(
    odist: Any, recat: torch.Tensor | None, lengths: torch.Tensor, world: int, total: int
) -> torch.Tensor:
    """The lookup's rows in the order TorchRec's sequence all-to-all sends them (its forward recat
    applied to row numbers instead of embeddings, on the host); empty when this rank holds no feature."""
    features = lengths.shape[0] if lengths.dim() == 2 else 0
    if features == 0 or total == 0:
        return torch.zeros(0, dtype=torch.long)
    if recat is not None:  # as TorchRec: the inverse of the ids' recat (the input distribution's, on the host)
        recat = torch.ops.fbgemm.invert_permute(recat.to(_HOST))
    else:
        a2a = odist._dist
        recat = torch.tensor(
            [j + i * a2a._num_splits for j in range(a2a._num_splits) for i in range(a2a._local_split)],
            dtype=torch.int32,
        )
    _, order, _ = torch.ops.fbgemm.permute_2D_sparse_data(
        recat, lengths.reshape(features * world, -1).to(_HOST), torch.arange(total), None, total
    )
    return order
