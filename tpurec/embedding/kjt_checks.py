"""What a KeyedJaggedTensor must satisfy before the kernel reads it, checked as stock TorchRec's
kernels do: lengths that do not sum to the values, or a lengths count that is not keys x batch,
would otherwise be cut silently (the kernel slices values by lengths)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpurec.errors import UserError

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def check_kjt(features: KeyedJaggedTensor) -> None:
    """One-line UserError naming what is inconsistent; costs one pass over the lengths."""
    check_kjt_shape(features)
    keys = features.keys()
    lengths = features.lengths()
    values = features.values()
    if lengths.numel():
        if int(lengths.min()) < 0:
            raise UserError(f"KeyedJaggedTensor has a negative length ({int(lengths.min())}); keys {keys}")
        total = int(lengths.sum())
    else:
        total = 0
    if total != values.numel():
        raise UserError(f"KeyedJaggedTensor lengths sum to {total} but it has {values.numel()} values (keys {keys})")
    weights = features.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise UserError(f"KeyedJaggedTensor has {weights.numel()} weights for {values.numel()} values")


def check_kjt_shape(features: KeyedJaggedTensor) -> None:
    """The checks of `check_kjt` that read no lengths: one batch for every feature, keys x batch
    lengths. The direct CPU step checks the lengths' sum and sign in its own pass over them."""
    keys = features.keys()
    lengths = features.lengths()
    if features.variable_stride_per_key():
        # A VBE KJT (a batch per feature, stride_per_key_per_rank) is laid out by the EBC modules
        # (embedding/vbe.py pads it to one batch); one reaching a kernel as it is would be laid out
        # as if every feature had `stride`, so it is refused.
        raise NotImplementedError(
            "variable batch per feature (VBE KeyedJaggedTensors) is not supported by this SparseCore kernel "
            "(EmbeddingBagCollections take it, EmbeddingCollections do not); give every feature the same batch size"
        )
    expected = len(keys) * features.stride()
    if lengths.numel() != expected:
        raise UserError(
            f"KeyedJaggedTensor has {lengths.numel()} lengths, but {len(keys)} keys x batch {features.stride()} "
            f"need {expected} (keys {keys})"
        )
