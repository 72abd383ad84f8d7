"""TorchTPU's batched host<->device transfer (`torch_tpu._internal.batch_transfer`, a private API of
torch-tpu 0.2.0): the one module that calls it.

What the wheel shows (pybind signatures in `batch_transfer_impl_2_13_0.so`, read in session 34; no
documentation): `batch_transfer_h2d(src_arrs, dst_arrs, src_offsets_major_dim, dst_offsets_major_dim,
copy_sizes_major_dim) -> TransferFuture` (and `_d2h`, and `_sync` forms returning None;
`TransferFuture.wait()`, `await_all`): lists of tensors and, per pair, an offset into each along the
first dimension and a length. Read as: rows [src_off, src_off + size) of each source into rows
[dst_off, dst_off + size) of its destination, in place; an H2D copy into an existing device tensor's
rows needs then no scatter program. That reading is what `scripts/tpu_probe_host_link.py` checks on a
chip (its `batch_*` pieces compare what arrives); nothing else in tpurec uses it until the chip says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_ranges(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    src_offsets: Sequence[int],
    dst_offsets: Sequence[int],
    sizes: Sequence[int],
) -> None:
    """Refuse (ValueError, naming the pair) what the reading above cannot mean: lists of different
    lengths, a range past its tensor's rows, or a pair whose rows differ in shape or dtype."""
    n = len(srcs)
    if not n == len(dsts) == len(src_offsets) == len(dst_offsets) == len(sizes):
        lens = [len(x) for x in (srcs, dsts, src_offsets, dst_offsets, sizes)]
        raise ValueError(f"batch transfer: sources, destinations, offsets and sizes differ in number: {lens}")
    for k, (s, d, so, do, size) in enumerate(zip(srcs, dsts, src_offsets, dst_offsets, sizes)):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise ValueError(
                f"batch transfer pair {k}: rows of {tuple(s.shape[1:])} {s.dtype} into {tuple(d.shape[1:])} {d.dtype}"
            )
        if size < 0 or so < 0 or do < 0 or so + size > s.shape[0] or do + size > d.shape[0]:
            raise ValueError(
                f"batch transfer pair {k}: rows [{so}, {so + size}) of {s.shape[0]} into "
                f"[{do}, {do + size}) of {d.shape[0]}"
            )
        if not (s.is_contiguous() and d.is_contiguous()):
            raise ValueError(f"batch transfer pair {k}: both tensors must be contiguous")


def _module() -> Any:
    from torch_tpu._internal import batch_transfer

    return batch_transfer


def h2d(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    src_offsets: Sequence[int],
    dst_offsets: Sequence[int],
    sizes: Sequence[int],
    wait: bool = True,
) -> Any:
    """Host rows into device tensors' rows (checked first); the TransferFuture when not `wait`."""
    check_ranges(srcs, dsts, src_offsets, dst_offsets, sizes)
    bt = _module()
    args = (list(srcs), list(dsts), list(src_offsets), list(dst_offsets), list(sizes))
    return bt.batch_transfer_h2d_sync(*args) if wait else bt.batch_transfer_h2d(*args)


def d2h(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    src_offsets: Sequence[int],
    dst_offsets: Sequence[int],
    sizes: Sequence[int],
    wait: bool = True,
) -> Any:
    """Device tensors' rows into host tensors' rows (checked first); the TransferFuture when not `wait`."""
    check_ranges(srcs, dsts, src_offsets, dst_offsets, sizes)
    bt = _module()
    args = (list(srcs), list(dsts), list(src_offsets), list(dst_offsets), list(sizes))
    return bt.batch_transfer_d2h_sync(*args) if wait else bt.batch_transfer_d2h(*args)
