"""Rows copied between the host table and a cache on a device, in a few fixed shapes.

On a TPU every distinct shape of an op is a program of its own (compiled the first time it is seen),
and a batch's misses, victims and flushes come in every count from 0 to the cache's rows. So a copy
with a device side goes in chunks of at most `MAX_BUCKET` rows, each chunk's index lists padded to a
bucket (`buckets`: the powers of two from `MIN_BUCKET` to `MAX_BUCKET` below the cache's row count,
and that count when smaller) by repeating the chunk's last (source, destination) pair: a row read
twice and written twice with the same value is the same copy, so no scratch row is needed. Per table
the device ops then see one shape per bucket, at most `len(buckets(cache rows))` (12), whatever the
batches do.

A row travels with its weight and every optimizer state, laid side by side in one float32 tensor
`[bucket, dim + state widths]` (float32 holds every stored dtype's values exactly: f32, and bf16/fp16
widened), so that a chunk crosses the host link in ONE copy of its values whatever the optimizer: each
transfer through TorchTPU is a synchronous call of a fixed latency, so their count, not their bytes,
is what a chunk costs.

* host -> device (`load`): the rows of every tensor gathered on the host with the padded source rows,
  packed, moved to the device in one copy and the padded destination slots in another; there the
  columns are split and scattered into each cache tensor (cast back to its dtype);
* device -> host (`write_back`): the rows gathered on the device with the padded source slots, packed
  there, moved to the host in one copy (each device->host copy also makes the host wait for the
  device), the padding dropped, and scattered into the host tensors. The table tier starts an
  eviction's write-back (`start_write_back`: the gather, queued on the device) and completes it (the
  copy to the host) at the next batch, so the host does not wait for the device while the current
  step is still to be queued (table_tier.py).

`warm_up` runs every bucket's device ops once when the cache is made, so that a batch needing a bucket
for the first time compiles nothing mid-run. Nothing is rounded: the values are the rows' own, in
their stored dtype (host_rows.py).

**Pinned staging (opt-in, `TPUREC_HOST_TIER_PINNED=1`).** Host buffers from TorchTPU's pinned
allocator (`torch.empty(..., pin_memory=True)`: torch-tpu 0.2.0 has one, `torch_tpu::TpuPinnedAllocator`,
strings on its glue library), made once per shape and kept:

* a load's packed rows are gathered into one (per bucket and width) and copied to the device from it;
  the copy is synchronous (`.to(device)`), so the buffer is free again when it returns;
* a write-back's gathered rows are copied into one (per chunk, bucket and width) with
  `non_blocking=True` when the write-back starts, an event recorded after it (`torch.tpu.Event`: its
  `record()` snapshots the pending device->host copies, its `synchronize()` waits for those alone,
  `_internal/stream/streams.py`), so the copy runs while the step does and `complete()` waits for that
  copy only, then scatters from the buffer. TorchTPU does such a copy asynchronously only into a pinned
  tensor ("non_blocking=True in .cpu() or .to('cpu') only works if the destination is already a
  pinned tensor", strings on its glue library). A chunk's buffer is written again only by a later
  write-back, which the table tier starts after completing this one.

Pageable memory (the default) may cross the link through a bounce buffer; whether pinned memory moves
the ~12 MB a step each way faster than the ~130 MB/s measured is for the chip to say
(scripts/tpu_probe_host_link.py's `*_pinned*` pieces, `bench host-tier --pinned`). Where no pinned
allocator exists (the CPU, the emulated device) every buffer is pageable and copies are as by default,
said once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from tpurec.runtime import env_flags
from tpurec.runtime.device import DeviceKind

PINNED_ENV = "TPUREC_HOST_TIER_PINNED"

MIN_BUCKET = 16  # the smallest padded length: 1 to 16 misses share one small program (not 5: 1, 2, 4, 8, 16)
# Rows per chunk: larger copies go in chunks of this many. Measured on a v5e (docs/results.md, session 31:
# a 4M x 128 f32 table, row-wise Adagrad, batch 16,384 x 8 Zipf ids, a 20% cache) a step loads and writes
# back ~24,400 rows: at 4,096 that was 6 chunks each way (24 host->device transfers a step for the loads
# alone, ~3.7 us a row); at 32,768 it is one chunk, 2 transfers in and 1 out. The chunk's packed tensor is
# transient HBM of at most 32,768 x 129 x 4 B = 16.9 MB (Adam at dim 128: 32,768 x 384 x 4 B = 50 MB) on
# a 15.7 GiB chip, and a cache of 32,768 rows or more warms up 12 buckets (16 to 32,768) instead of 9.
MAX_BUCKET = 32768


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


# (use, rows, width) -> a kept pinned host buffer (module docstring): use "load", or a write-back's
# chunk number within its write-back
_STAGING: dict[tuple[str | int, int, int], torch.Tensor] = {}
_PINNED_REFUSED: list[str] = []  # why this process has no pinned buffers, once known


def pinned_empty(rows: int, width: int) -> torch.Tensor:
    """A [rows, width] float32 host tensor from the accelerator's pinned allocator."""
    return torch.empty(rows, width, dtype=torch.float32, pin_memory=True)


def pinned_buffer(use: str | int, rows: int, width: int, device: torch.device) -> torch.Tensor | None:
    """The kept pinned buffer of `use` in that shape when TPUREC_HOST_TIER_PINNED is on and the
    accelerator of `device` pins memory; None otherwise (then pageable memory, as by default)."""
    if on_host_device(device) or not env_flags.is_on(PINNED_ENV) or _PINNED_REFUSED:
        return None
    buf = _STAGING.get((use, rows, width))
    if buf is None:
        try:
            buf = _STAGING[(use, rows, width)] = pinned_empty(rows, width)
        except RuntimeError as ex:  # no pinned allocator (a CPU-only torch, the emulated device)
            _PINNED_REFUSED.append(str(ex))
            said = f"{PINNED_ENV}: no pinned host memory here ({str(ex)[:200]}); rows cross in pageable memory"
            warnings.warn(said, stacklevel=2)
            return None
    return buf


def staging(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """The host tensor a load to `device` packs `rows` x `width` floats in: the kept pinned buffer when
    there is one (`pinned_buffer`), else a new pageable one."""
    buf = pinned_buffer("load", rows, width, device)
    return torch.empty(rows, width, dtype=torch.float32) if buf is None else buf


def on_host_device(device: torch.device) -> bool:
    return device.type == DeviceKind.CPU


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the host) on `device`: every host->device copy of a load, in one place (tests count them)."""
    return t.to(device)


@torch.no_grad()
def copy_tensor(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor) -> None:
    """dst[dst_index] = src[src_index] (host int64 indices, one per row), one side on the host and the
    other (the cache) on a device: a `load` or a `write_back` of that one tensor."""
    if on_host(src):
        load([src], src_index, [dst], dst_index)
    else:
        write_back([src], src_index, [dst], dst_index)


@torch.no_grad()
def load(srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor) -> None:
    """dsts[k][dst_index] = srcs[k][src_index] for each k: the host table's weight and states into the
    cache's (on a device, rows along dim 0), two host->device copies per chunk for all of them (the
    packed rows, the padded slots)."""
    for start in range(0, src_index.numel(), MAX_BUCKET):
        _load_chunk(srcs, src_index[start : start + MAX_BUCKET], dsts, dst_index[start : start + MAX_BUCKET])


def _load_chunk(
    srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor
) -> None:
    cache = dsts[0]
    size = bucket(src_index.numel(), cache.shape[0])
    rows = pad(src_index, size)  # gathered padded on the host: no second copy to pad the values
    widths = [s[0].numel() for s in srcs]  # a row's floats: dim, or 1 (a row-wise state)
    packed = staging(size, sum(widths), cache.device)
    for part, src in zip(packed.split(widths, dim=1), srcs):
        part.copy_(src.index_select(0, rows).reshape(size, -1))  # (widened to float32: exact)
    packed, slots = to_device(packed, cache.device), to_device(pad(dst_index, size), cache.device)
    for part, dst in zip(packed.split(widths, dim=1), dsts):
        dst.index_copy_(0, slots, part.reshape(size, *dst.shape[1:]).to(dst.dtype))


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
        _gather_chunk(srcs, src_index[start : start + MAX_BUCKET], dsts, dst_index[start : start + MAX_BUCKET], k)
        for k, start in enumerate(range(0, src_index.numel(), MAX_BUCKET))
    ]


@dataclass
class PendingWriteBack:
    """A chunk of rows gathered on the device, side by side in float32, not yet on the host."""

    packed: torch.Tensor  # [bucket, sum of widths] on the device, or its pinned host copy on its way
    rows: int  # the chunk's real rows (the rest is padding)
    widths: list[int]
    dsts: list[torch.Tensor]
    dst_index: torch.Tensor
    arrival: Any = None  # with `packed` pinned: the event its copy completes (module docstring)
    source: torch.Tensor | None = None  # the device rows that copy reads, held until it has

    @torch.no_grad()
    def complete(self) -> None:
        """One device->host copy (the host waits for the gather), or the wait for the one started into
        pinned memory, then the rows into the host table."""
        n = self.rows
        if self.arrival is not None:
            self.arrival.synchronize()
            packed, self.source = self.packed[:n], None
        else:
            from tpurec.runtime import host_copies

            packed = host_copies.to_host(self.packed, "host tier rows")[:n]
        for part, dst in zip(packed.split(self.widths, dim=1), self.dsts):
            dst.index_copy_(0, self.dst_index, part.reshape(n, *dst.shape[1:]).to(dst.dtype))


def _gather_chunk(
    srcs: list[torch.Tensor], src_index: torch.Tensor, dsts: list[torch.Tensor], dst_index: torch.Tensor, k: int = 0
) -> PendingWriteBack:
    n, cache = src_index.numel(), srcs[0]
    size = bucket(n, cache.shape[0])
    index = pad(src_index, size).to(cache.device)
    parts = [s.index_select(0, index).reshape(size, -1).to(torch.float32) for s in srcs]
    packed, widths = torch.cat(parts, dim=1), [p.shape[1] for p in parts]
    from tpurec.runtime import host_copies

    pinned = pinned_buffer(k, size, packed.shape[1], cache.device)
    if pinned is None:
        return PendingWriteBack(packed, n, widths, dsts, dst_index)

    pinned.copy_(packed, non_blocking=True)
    host_copies.count("host tier rows")  # a device->host copy, as `complete` counts its own
    arrival = device_event(cache.device)
    arrival.record()  # (after the copy: it snapshots the pending device->host copies)
    return PendingWriteBack(pinned, n, widths, dsts, dst_index, arrival, packed)


def device_event(device: torch.device) -> Any:
    """An event of `device`'s module (`torch.tpu.Event` on a TPU: record, synchronize)."""
    return torch.get_device_module(device).Event()


@torch.no_grad()
def warm_up(hosts: list[torch.Tensor], caches: list[torch.Tensor]) -> None:
    """Run every bucket's load and write-back between `hosts` (a host table's weight and states) and
    `caches` (its cache's, on a device, holding no row yet) once: each copies host row 0 into cache
    slot 0 and back, so the cache's contents and the host table stay as they were for the rows in use."""
    for size in buckets(caches[0].shape[0]):
        zeros = torch.zeros(size, dtype=torch.long)
        load(hosts, zeros, caches, zeros)
        write_back(caches, zeros, hosts, zeros)  # slot 0 back into host row 0: its own value
