"""Variable batch per feature (VBE): a KeyedJaggedTensor whose features have batches of their own
(`stride_per_key_per_rank`), as TorchRec's `KeyedJaggedTensor(..., stride_per_key_per_rank=...,
inverse_indices=...)` carries deduplicated samples.

The SparseCore kernel pools a [features, batch] grid of bags. A VBE batch goes through it as an
ordinary one: feature k's bags first, then empty bags up to the largest feature's count
(`pad_to_common_batch`). Values and weights are untouched and an empty bag pools nothing and updates
nothing, so outputs and updates are those of the feature's own bags. The pooled rows are then laid
out as FBGEMM's TBE returns a VBE lookup (`to_vbe_layout`): one flat tensor, rank-major, then
feature, each block [that feature's batch from that rank, its dim]; TorchRec's output
distribution and its inverse-indices expansion take it from there (sharded EBC), or
`expand_to_batch` does (the standalone module, as TorchRec's unsharded EBC).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def pad_to_common_batch(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """`features` with one batch for all keys: each key's bags (all ranks', in rank order, as the
    VBE KJT holds them), then empty bags up to the largest key's bag count (at least 1)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = features.keys()
    per_key = [sum(s) for s in features.stride_per_key_per_rank()]
    batch = max(per_key + [1])
    lengths = features.lengths()
    counts = torch.tensor(per_key, dtype=torch.int64)
    # bag j of key k (j < its count) goes to row k * batch + j
    first = torch.repeat_interleave(torch.arange(len(keys), dtype=torch.int64) * batch, counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(_starts(counts), counts)
    padded = lengths.new_zeros(len(keys) * batch)
    padded[(first + within).to(lengths.device)] = lengths
    return KeyedJaggedTensor(
        keys=keys, values=features.values(), weights=features.weights_or_none(), lengths=padded, stride=batch
    )


def vbe_index(
    stride_per_key_per_rank: Sequence[Sequence[int]],
    dims: Sequence[int],
    batch: int,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """For each element of the VBE layout, in order, its position in the padded output flattened
    ([batch, sum of dims], row-major). With `offsets` ([ranks, keys], element starts in a bigger
    flat tensor: TorchRec's `vbe_output_offsets`) instead: each element's position there, in the
    same order."""
    strides = torch.tensor(list(stride_per_key_per_rank), dtype=torch.int64).reshape(len(dims), -1)  # [keys, ranks]
    dim = torch.tensor(list(dims), dtype=torch.int64)
    row_start = torch.cumsum(strides, 1) - strides  # key k, rank r: first row of that rank's bags
    col_start = torch.cumsum(dim, 0) - dim
    # blocks rank-major, then key
    rows = strides.T.reshape(-1)
    cols = dim.repeat(strides.size(1))
    sizes = rows * cols
    within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(_starts(sizes), sizes)
    if offsets is not None:
        return torch.repeat_interleave(offsets.reshape(-1).to(torch.int64).cpu(), sizes) + within
    block_cols = torch.repeat_interleave(cols, sizes)
    row = torch.repeat_interleave(row_start.T.reshape(-1), sizes) + within // block_cols
    col = torch.repeat_interleave(col_start.repeat(strides.size(1)), sizes) + within % block_cols
    return row * int(dim.sum()) + col


def to_vbe_layout(
    padded_out: torch.Tensor,
    features: KeyedJaggedTensor,
    dims: Sequence[int],
    vbe_output: torch.Tensor | None = None,
    vbe_output_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's output for `pad_to_common_batch(features)` in FBGEMM's VBE layout (1-D). With
    TorchRec's pre-allocated `vbe_output` and this lookup's `vbe_output_offsets` (several kernels in
    one lookup): `vbe_output` with this lookup's blocks written at those offsets, out of place, so
    autograd reaches every kernel that wrote into it."""
    spkr = features.stride_per_key_per_rank()
    flat = padded_out.reshape(-1)
    index = vbe_index(spkr, dims, padded_out.size(0)).to(flat.device)
    mine = flat.index_select(0, index)
    if vbe_output is None:
        return mine
    assert vbe_output_offsets is not None, "TorchRec passes vbe_output with vbe_output_offsets"
    where = vbe_index(spkr, dims, padded_out.size(0), offsets=vbe_output_offsets).to(vbe_output.device)
    return vbe_output.index_copy(0, where, mine.to(vbe_output.dtype))


def expand_to_batch(
    padded_out: torch.Tensor, features: KeyedJaggedTensor, dims: Sequence[int], keys: Sequence[str]
) -> torch.Tensor:
    """[batch, sum of dims] of the full batch, as TorchRec's unsharded EBC returns a VBE lookup:
    row i of output key k is that key's bag `inverse_indices[k][i]` (inverse indices by KJT key name;
    `keys` names each output column block by its KJT key)."""
    names, inverse = features.inverse_indices()
    by_name = {n: i for i, n in enumerate(names)}
    pieces, col = [], 0
    for key, dim in zip(keys, dims):
        rows = inverse[by_name[key]].to(device=padded_out.device, dtype=torch.int64)
        pieces.append(padded_out[:, col : col + dim].index_select(0, rows))
        col += dim
    return torch.cat(pieces, 1)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0) - sizes
