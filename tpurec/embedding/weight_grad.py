"""The gradient of a SparseCore kernel's pooled output with respect to its per-id weights.

The fused update consumes the output gradient for the tables, but the per-id weights of a weighted
KeyedJaggedTensor can be trainable too: TorchRec's `PositionWeightedModule` gathers them from its
`position_weight` parameter. A bag's output is sum_i w_i * row(id_i) (divided by the bag's length
when mean-pooled), so d loss / d w_i = <output gradient of its bag and feature, row(id_i)> (over the
length). The rows are read before this step's update, as FBGEMM's TBE computes the weights' gradient
(stock TorchRec's position weights match that, not the updated rows): autograd runs this node's
backward before the update's, which consumes the output gradient it passes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchrec.modules.embedding_configs import PoolingType

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.embedding.kernel_protocol import EmbeddingKernel


def with_weight_grad(kernel: EmbeddingKernel, features: KeyedJaggedTensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the kernel's pooled lookup of `features`), made to pass a gradient to the KJT's weights
    when they require one; `out` itself otherwise."""
    weights = features.weights_or_none() if kernel.is_weighted else None
    if weights is None or not weights.requires_grad or not torch.is_grad_enabled():
        return out
    return _WeightGrad.apply(out, weights, kernel, features)


class _WeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, weights: torch.Tensor, kernel: EmbeddingKernel, features: KeyedJaggedTensor
    ) -> torch.Tensor:
        ctx.kernel, ctx.features = kernel, features
        ctx.dtype, ctx.device = weights.dtype, weights.device
        # A copy, not a view: TorchRec adds to the pooled output in place (its FP module's DDP
        # no-op), which autograd forbids on a custom Function's view. Paid only with trainable weights.
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        return grad, weight_gradient(ctx.kernel, ctx.features, grad).to(ctx.device, ctx.dtype), None, None


@torch.no_grad()
def weight_gradient(kernel: EmbeddingKernel, features: KeyedJaggedTensor, grad: torch.Tensor) -> torch.Tensor:
    """d loss / d weights ([ids], in the KJT's values order) from the output gradient `grad` [batch,
    sum of dims], reading the kernel's tables as they are now. Keys the kernel has no table for
    (looked up by name) get 0."""
    batch = features.stride()
    values, lengths = features.values().to(torch.int64), features.lengths().to(torch.int64)
    columns, start = {}, 0
    for f, dim in zip(kernel.feature_order, kernel.feature_dims):
        columns[f] = start
        start += dim
    pieces = []
    value_offsets = features.offset_per_key()
    for j, key in enumerate(features.keys()):
        lo, hi = value_offsets[j], value_offsets[j + 1]
        # positional kernels (TorchRec's sharded lookups) take the j-th key as their j-th feature
        feature = kernel.feature_order[j] if kernel.positional else key
        table = kernel.table_of(feature)
        if table is None or hi == lo:
            pieces.append(torch.zeros(hi - lo, device=grad.device))
            continue
        bag_lengths = lengths[j * batch : (j + 1) * batch]
        samples = torch.repeat_interleave(torch.arange(batch), bag_lengths)
        rows = kernel.read_weight(table.name)
        rows = rows.index_select(0, values[lo:hi].to(rows.device)).to(device=grad.device, dtype=torch.float32)
        col = columns[feature]
        bag_grad = grad[:, col : col + table.embedding_dim].to(torch.float32).index_select(0, samples.to(grad.device))
        piece = (bag_grad * rows).sum(1)
        if table.pooling is PoolingType.MEAN:
            piece = piece / bag_lengths.clamp(min=1).index_select(0, samples).to(piece)
        pieces.append(piece)
    return torch.cat(pieces) if pieces else grad.new_zeros(0)
