"""Rows copied between the host table and a cache on a device, in a few fixed shapes.

On a TPU every distinct shape of an op is a program of its own (compiled the first time it is seen),
and a batch's misses, victims and flushes come in every count from 0 to the cache's rows. So a copy
with a device side goes in chunks of at most `MAX_BUCKET` rows, each chunk's index lists padded to a
bucket (`buckets`: the powers of two from `MIN_BUCKET` to `MAX_BUCKET` below the cache's row count,
and that count when smaller) by repeating the chunk's last (source, destination) pair: a row read
twice and written twice with the same value is the same copy, so no scratch row is needed. Per table
and tensor (the weight, each optimizer state) the device ops then see one shape per bucket, at most
`len(buckets(cache rows))` (9), whatever the batches do:

* host -> device (loads): the rows gathered on the host (exact, unpadded), padded, moved to the device
  in one tensor of the bucket's rows, and scattered there with the padded destination slots;
* device -> host (write-backs): the rows gathered on the device with the padded source slots, moved
  to the host, the padding dropped, and scattered into the host table. A row's weight and optimizer
  state go back together (`write_back`): gathered, laid side by side in one float32 tensor on the
  device and moved in ONE copy, since each device->host copy makes the host wait for the device
  (float32 holds every stored dtype's values exactly: f32, and bf16/fp16 widened). The table tier
  starts an eviction's write-back (`start_write_back`: the gather, queued on the device) and completes
  it (the copy to the host) at the next batch, so the host does not wait for the device while the
  current step is still to be queued (table_tier.py).

`warm_up` runs every bucket's device ops once when the cache is made, so that a batch needing a bucket
for the first time compiles nothing mid-run. Nothing is rounded: the values are the rows' own, in
their stored dtype (host_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpurec.runtime.device import DeviceKind

MIN_BUCKET = 16  # the smallest padded length: 1 to 16 misses share one small program (not 5: 1, 2, 4, 8, 16)
MAX_BUCKET = 4096  # rows per chunk: larger copies (a flush of a large cache) go in chunks of this many


def buckets(cap: int) -> list[int]:
    """Every padded length a copy into or out of a cache of `cap` rows may have (increasing)."""
    out, size = [], MIN_BUCKET
    while size < min(cap, MAX_BUCKET):
        out.append(size)
        size *= 2
    return [*out, min(cap, MAX_BUCKET)]


def bucket(n: int, cap: int) -> int:
    """The padded length of a chunk of `n` indices (1 <= n <= min(cap, MAX_BUCKET)): the smallest of
    `buckets(cap)` holding them."""
    if not 0 < n <= min(cap, MAX_BUCKET):
        raise ValueError(f"a chunk of {n} rows into or out of a cache of {cap}")
    return min(cap, MAX_BUCKET, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


def pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` (rows along dim 0, at least one) with its last row repeated up to `size` rows."""
    extra = size - x.shape[0]
    return torch.cat([x, x[-1:].expand(extra, *x.shape[1:])]) if extra else x


def on_host(t: torch.Tensor) -> bool:
    return t.device.type == DeviceKind.CPU


@torch.no_grad()
def copy_tensor(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    """dst[dst_index] = src[src_index] (host int64 indices, one per row), one side on the host and the
    other (the cache) on a device: the device's ops in the fixed shapes of the module docstring."""
    for start in range(0, src_index.numel(), MAX_BUCKET):
        _copy_chunk(src, src_index[start : start + MAX_BUCKET], dst, dst_index[start : start + MAX_BUCKET])


def _copy_chunk(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    n = src_index.numel()
    if on_host(src):  # a load: gathered on the host, scattered on the device
        size = bucket(n, dst.shape[0])
        values = pad(src.index_select(0, src_index), size).to(dst.device, dst.dtype)
        dst.index_copy_(0, pad(dst_index, size).to(dst.device), values)
        return
    size = bucket(n, src.shape[0])  # a write-back: gathered on the device, scattered on the host
    values = src.index_select(0, pad(src_index, size).to(src.device)).to("cpu")[:n]
    dst.index_copy_(0, dst_index, values.to(dst.dtype))


@torch.no_grad()
def write_back(
    srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor
) -> None:
    """dsts[k][dst_index] = srcs[k][src_index] for each k: the cache's weight and states (on a device,
    rows along dim 0) into the host table's, one device->host copy per chunk for all of them."""
    for pending in start_write_back(srcs, src_index, dsts, dst_index):
        pending.complete()


@torch.no_grad()
def start_write_back(
    srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor
) -> list[PendingWriteBack]:
    """`write_back`'s device half only: the rows gathered on the device (queued there, in order before
    whatever later overwrites their slots), the host not waiting; each chunk's `complete()` moves them
    to the host table. Until then those host rows hold their older values."""
    return [
        _gather_chunk(srcs, src_index[start : start + MAX_BUCKET], dsts, dst_index[start : start + MAX_BUCKET])
        for start in range(0, src_index.numel(), MAX_BUCKET)
    ]


@dataclass
class PendingWriteBack:
    """A chunk of rows gathered on the device, side by side in float32, not yet on the host."""

    packed: torch.Tensor  # [bucket, sum of widths] on the device
    rows: int  # the chunk's real rows (the rest is padding)
    widths: list[int]
    dsts: list[torch.Tensor]
    dst_index: torch.Tensor

    @torch.no_grad()
    def complete(self) -> None:
        """One device->host copy (the host waits for the gather), then the rows into the host table."""
        from tpurec.runtime import host_copies

        n = self.rows
        packed = host_copies.to_host(self.packed, "host tier rows")[:n]
        for part, dst in zip(packed.split(self.widths, dim=1), self.dsts):
            dst.index_copy_(0, self.dst_index, part.reshape(n, *dst.shape[1:]).to(dst.dtype))


def _gather_chunk(
    srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor
) -> PendingWriteBack:
    n, cache = src_index.numel(), srcs[0]
    size = bucket(n, cache.shape[0])
    index = pad(src_index, size).to(cache.device)
    parts = [s.index_select(0, index).reshape(size, -1).to(torch.float32) for s in srcs]
    return PendingWriteBack(torch.cat(parts, dim=1), n, [p.shape[1] for p in parts], dsts, dst_index)


@torch.no_grad()
def warm_up(host: torch.Tensor, cache: torch.Tensor) -> None:
    """Run every bucket's load between `host` (a host table's tensor) and `cache` (its cache's, on a
    device, holding no row yet) once: each copies host row 0 into cache slot 0, so the cache's contents
    and the host table stay as they were for the rows in use. (Write-backs go with the row's states:
    `write_back`, warmed up by host_rows.warm_up after these loads.)"""
    for size in buckets(cache.shape[0]):
        zeros = torch.zeros(size, dtype=torch.long)
        _copy_chunk(host, zeros, cache, zeros)
