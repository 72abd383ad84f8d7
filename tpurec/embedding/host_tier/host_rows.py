"""A table's rows and their optimizer state, on one side of the host tier: the whole table in host
memory, or its cache (views of the kernel's storage), and the copy of rows from one to the other.

A row travels with every optimizer state of it (row-wise Adagrad's one float, Adagrad's and Adam's
dim floats each), so a row's update continues exactly where it left off wherever it lives. Copies
are plain element copies in the stored dtype: nothing is rounded on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpurec.embedding import huge_pages
from tpurec.embedding.host_tier import device_copies
from tpurec.embedding.optimizers.base import OptimizerSpec
from tpurec.runtime.device import DeviceKind


@dataclass
class Rows:
    """weight [rows, dim] and each optimizer state ([rows] or [rows, dim]), by state name."""

    weight: torch.Tensor
    states: dict[str, torch.Tensor]


def host_rows(rows: int, dim: int, dtype: torch.dtype, optimizer: OptimizerSpec) -> Rows:
    """A whole table in host memory (zeros: the kernel draws its initial values) and its optimizer
    state at the optimizer's initial values, float32 as the kernel keeps state; on huge pages where
    Linux grants them (huge_pages.py: the host tier's tables are the large ones)."""
    weight = huge_pages.filled((rows, dim), 0.0, dtype, "cpu")
    states = {}
    for name in optimizer.state_names:
        shape = tuple(optimizer.state_shape(name, rows, dim))
        states[name] = huge_pages.filled(shape, optimizer.initial_value(name), torch.float32, "cpu")
    return Rows(weight, states)


@torch.no_grad()
def start_copy_rows(
    src: Rows, src_index: torch.Tensor, dst: Rows, dst_index: torch.Tensor
) -> list[device_copies.PendingWriteBack]:
    """`copy_rows`, except that a write-back from a device's cache is only started: the chunks to
    complete (device_copies.start_write_back); every other copy is done at once (none returned)."""
    if src_index.numel() and not device_copies.on_host(src.weight) and device_copies.on_host(dst.weight):
        pairs = _pairs(src, dst)
        return device_copies.start_write_back([a for a, _ in pairs], src_index, [b for _, b in pairs], dst_index)
    copy_rows(src, src_index, dst, dst_index)
    return []


@torch.no_grad()
def copy_rows(src: Rows, src_index: torch.Tensor, dst: Rows, dst_index: torch.Tensor) -> None:
    """dst[dst_index] = src[src_index], weight and every state (int64 host indices, one per row). Both
    on the host: one indexed copy each; a side on a device (a TPU's cache): in the few fixed shapes of
    device_copies.py."""
    if src_index.numel() == 0:
        return
    pairs = _pairs(src, dst)
    srcs, dsts = [a for a, _ in pairs], [b for _, b in pairs]
    if device_copies.on_host(src.weight) and device_copies.on_host(dst.weight):
        for a, b in pairs:
            b.index_copy_(0, dst_index, a.index_select(0, src_index).to(dtype=b.dtype))
    elif device_copies.on_host(src.weight):  # a load: the weight and states packed, two copies a chunk
        device_copies.load(srcs, src_index, dsts, dst_index)
    else:  # a write-back: one copy a chunk
        device_copies.write_back(srcs, src_index, dsts, dst_index)


def warm_up(host: Rows, cache: Rows) -> None:
    """A cache on a TPU, holding no row yet: every copy shape it will use run once (device_copies.py):
    the packed load and write-back of the weight and states together, in each bucket."""
    if cache.weight.device.type == DeviceKind.TPU:
        pairs = _pairs(host, cache)
        device_copies.warm_up([a for a, _ in pairs], [b for _, b in pairs])


def _pairs(src: Rows, dst: Rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(src.weight, dst.weight)] + [(src.states[name], t) for name, t in dst.states.items()]
