"""Row copies between the host table and a cache on a device in a few fixed shapes
(tpurec/embedding/host_tier/device_copies.py), on the host: the cache side is taken for a device
(`on_host` says so), and every indexed op on the cache is recorded with its index length."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpurec.embedding.host_tier import device_copies
from tpurec.embedding.host_tier.device_copies import bucket, buckets
from tpurec.embedding.host_tier.host_rows import Rows, copy_rows

ROWS, CAP, DIM = 1000, 100, 3


class _CacheOps(TorchDispatchMode):
    """The index length of every index_select / index_copy_ on `caches` (the 'device' tensors), and
    (`by_tensor`) which of them each was on."""

    def __init__(self, *caches: torch.Tensor) -> None:
        super().__init__()
        self.caches = [c.data_ptr() for c in caches]
        self.lengths: list[int] = []
        self.by_tensor: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ("aten::index_select", "aten::index_copy_") and args[0].data_ptr() in self.caches:
            self.lengths.append(args[2].numel())
            self.by_tensor.append((self.caches.index(args[0].data_ptr()), args[2].numel()))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tables(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    host = torch.randn(ROWS, DIM, generator=gen)
    cache = torch.randn(CAP, DIM, generator=gen)
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() != cache.data_ptr())
    return host, cache


def test_buckets_are_powers_of_two_from_16_up_to_the_cache_and_at_most_32768():
    assert buckets(100) == [16, 32, 64, 100]
    assert buckets(128) == [16, 32, 64, 128]
    assert buckets(10) == [10] and buckets(1) == [1]
    assert buckets(10**6) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert buckets(20000) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 20000]
    assert [bucket(n, 100) for n in (1, 16, 17, 33, 64, 65, 100)] == [16, 16, 32, 64, 64, 100, 100]
    assert bucket(3, 10) == 10 and bucket(4096, 10**6) == 4096
    # a batch of 16,384 x 8 Zipf ids misses ~24,400 rows of a 20% cache of 4M rows: one chunk
    assert bucket(24400, 819200) == 32768 and bucket(32768, 10**6) == 32768
    with pytest.raises(ValueError):
        bucket(0, 100)
    with pytest.raises(ValueError):
        bucket(101, 100)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 40, 64, 65, 99, 100])
def test_loads_and_write_backs_of_any_count_copy_exactly_those_rows_in_bucket_shapes(tables, n):
    host, cache = tables
    gen = torch.Generator().manual_seed(n)
    rows = torch.randperm(ROWS, generator=gen)[:n]
    slots = torch.randperm(CAP, generator=gen)[:n]
    want_cache = cache.clone()
    want_cache[slots] = host[rows]
    with _CacheOps(cache) as ops:
        device_copies.copy_tensor(host, rows, cache, slots)  # a load
    assert torch.equal(cache, want_cache)  # the padding wrote the last row again, with its own value
    cache[slots] += 1.0  # an update
    want_host = host.clone()
    want_host[rows] = cache[slots]
    with _CacheOps(cache) as back:
        device_copies.copy_tensor(cache, slots, host, rows)  # its write-back
    assert torch.equal(host, want_host)
    assert ops.lengths == back.lengths == [bucket(n, CAP)]


def test_a_copy_over_max_bucket_rows_goes_in_chunks_of_fixed_shapes(tables, monkeypatch):
    host, cache = tables
    monkeypatch.setattr(device_copies, "MAX_BUCKET", 32)
    rows, slots = torch.arange(900, 1000), torch.arange(CAP).flip(0)
    with _CacheOps(cache) as ops:
        device_copies.copy_tensor(host, rows, cache, slots)
    assert torch.equal(cache[slots], host[rows])
    assert ops.lengths == [32, 32, 32, 16]  # 100 rows: three full chunks, then 4 rows padded to 16
    assert buckets(CAP) == [16, 32]


def test_rows_and_their_state_on_the_host_copy_as_before_without_padding(monkeypatch):
    """Both sides on the host (the CPU kernel): one indexed copy per tensor, of the rows asked for."""
    host = Rows(torch.arange(20.0).reshape(10, 2), {"m": torch.arange(10.0)})
    cache = Rows(torch.zeros(4, 2), {"m": torch.zeros(4)})

    def refuse(*args):
        raise AssertionError("a host-to-host copy took the device's path")

    for name in ("copy_tensor", "load", "write_back", "pad", "to_device"):
        monkeypatch.setattr(device_copies, name, refuse)
    copy_rows(host, torch.tensor([7, 2]), cache, torch.tensor([1, 3]))
    assert torch.equal(cache.weight, torch.tensor([[0.0, 0], [14, 15], [0, 0], [4, 5]]))
    assert torch.equal(cache.states["m"], torch.tensor([0.0, 7, 0, 2]))


def _adam_and_rowwise_rows(gen: torch.Generator, n: int) -> Rows:
    """n rows of a bf16 weight with Adam's two states and a row-wise one (mixed widths)."""
    return Rows(
        torch.randn(n, DIM, generator=gen).to(torch.bfloat16),
        {
            "m": torch.randn(n, DIM, generator=gen),
            "v": torch.rand(n, DIM, generator=gen),
            "r": torch.rand(n, generator=gen),
        },
    )


def test_a_write_back_moves_a_rows_weight_and_states_in_one_copy_per_chunk(monkeypatch):
    """Each device->host copy makes the host wait for the device: a write-back of rows with Adam's two
    states and a row-wise one (mixed widths, a bf16 weight) is one copy per chunk, every value exact."""
    from tpurec.runtime import host_copies

    gen = torch.Generator().manual_seed(5)
    monkeypatch.setattr(device_copies, "MAX_BUCKET", 4096)  # (chunks of a few thousand rows: a fast test)
    cap, rows = 5000, 9000
    host, cache = _adam_and_rowwise_rows(gen, rows), _adam_and_rowwise_rows(gen, cap)
    on_cache = {t.data_ptr() for t in (cache.weight, *cache.states.values())}
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() not in on_cache)
    copies = []
    real = host_copies.to_host
    monkeypatch.setattr(host_copies, "to_host", lambda x, what: copies.append((tuple(x.shape), what)) or real(x, what))
    slots = torch.randperm(cap, generator=gen)[:4500]
    dest = torch.randperm(rows, generator=gen)[:4500]
    want = Rows(host.weight.clone(), {k: v.clone() for k, v in host.states.items()})
    want.weight[dest] = cache.weight[slots]
    for k in want.states:
        want.states[k][dest] = cache.states[k][slots]
    copy_rows(cache, slots, host, dest)
    # 4,500 rows: a chunk of 4,096 and one of 404 padded to 512; DIM + DIM + DIM + 1 columns side by side
    assert copies == [((4096, 3 * DIM + 1), "host tier rows"), ((512, 3 * DIM + 1), "host tier rows")]
    assert torch.equal(host.weight, want.weight) and host.weight.dtype == torch.bfloat16
    assert all(torch.equal(host.states[k], want.states[k]) for k in want.states)


def test_a_load_moves_a_rows_weight_and_states_in_one_values_copy_per_chunk(monkeypatch):
    """Each host->device copy is a synchronous call of a fixed latency: a load of rows with Adam's two
    states and a row-wise one (a bf16 weight) is, per chunk, ONE copy of the values (laid side by side
    in float32) and one of the padded slots, in the chunk's bucket shape; on the device each cache tensor
    takes its columns back in its own dtype, every value exact."""
    monkeypatch.setattr(device_copies, "MAX_BUCKET", 4096)  # (chunks of a few thousand rows: a fast test)
    gen = torch.Generator().manual_seed(6)
    cap, rows = 5000, 9000
    host, cache = _adam_and_rowwise_rows(gen, rows), _adam_and_rowwise_rows(gen, cap)
    tensors = (cache.weight, *cache.states.values())
    on_cache = {t.data_ptr() for t in tensors}
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() not in on_cache)
    moved = []
    monkeypatch.setattr(device_copies, "to_device", lambda t, device: moved.append((tuple(t.shape), t.dtype)) or t)
    src = torch.randperm(rows, generator=gen)[:4500]
    slots = torch.randperm(cap, generator=gen)[:4500]
    want = Rows(cache.weight.clone(), {k: v.clone() for k, v in cache.states.items()})
    want.weight[slots] = host.weight[src]
    for k in want.states:
        want.states[k][slots] = host.states[k][src]
    with _CacheOps(*tensors) as ops:
        copy_rows(host, src, cache, slots)
    # 4,500 rows: a chunk of 4,096 and one of 404 padded to 512; DIM + DIM + DIM + 1 columns side by side
    f32, i64 = torch.float32, torch.long
    assert moved == [((4096, 3 * DIM + 1), f32), ((4096,), i64), ((512, 3 * DIM + 1), f32), ((512,), i64)]
    assert ops.by_tensor == [(k, 4096) for k in range(4)] + [(k, 512) for k in range(4)]  # a scatter per tensor
    assert torch.equal(cache.weight, want.weight) and cache.weight.dtype == torch.bfloat16
    assert all(torch.equal(cache.states[k], want.states[k]) for k in want.states)


def test_a_warm_up_runs_every_buckets_packed_load_and_write_back_and_changes_no_row_in_use(monkeypatch):
    """`warm_up`: each bucket's load and write-back once (host row 0 into the empty slot 0 and back), two
    host->device copies a bucket whatever the optimizer; the host table and every other slot unchanged."""
    gen = torch.Generator().manual_seed(7)
    host, cache = _adam_and_rowwise_rows(gen, ROWS), _adam_and_rowwise_rows(gen, CAP)
    before_host = [t.clone() for t in (host.weight, *host.states.values())]
    before_cache = [t.clone() for t in (cache.weight, *cache.states.values())]
    tensors = (cache.weight, *cache.states.values())
    on_cache = {t.data_ptr() for t in tensors}
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() not in on_cache)
    moved = []
    monkeypatch.setattr(device_copies, "to_device", lambda t, device: moved.append(t.shape[0]) or t)
    with _CacheOps(*tensors) as ops:
        device_copies.warm_up([host.weight, *host.states.values()], list(tensors))
    assert moved == [size for size in buckets(CAP) for _ in range(2)]  # 16, 16, 32, 32, 64, 64, 100, 100
    # per bucket: each tensor's scatter (the load), then each tensor's gather (the write-back)
    assert ops.lengths == [size for size in buckets(CAP) for _ in range(2 * len(tensors))]
    assert all(torch.equal(a, b) for a, b in zip((host.weight, *host.states.values()), before_host))
    for t, b in zip(tensors, before_cache):
        assert torch.equal(t[1:], b[1:])
    assert torch.equal(cache.weight[0], host.weight[0]) and torch.equal(cache.states["r"][0], host.states["r"][0])


def test_pinned_staging_keeps_one_buffer_per_bucket_and_loads_the_same_rows(tables, monkeypatch):
    """TPUREC_HOST_TIER_PINNED=1: a load's packed rows are staged in a pinned host buffer made once per
    (bucket, width) and reused by every later load of that shape (the copy to the device is synchronous:
    the buffer is free again after it); the rows loaded are those of a pageable load."""
    host, cache = tables
    made, staged = [], []
    monkeypatch.setenv(device_copies.PINNED_ENV, "1")
    monkeypatch.setattr(device_copies, "_STAGING", {})
    monkeypatch.setattr(device_copies, "on_host_device", lambda device: False)  # the cache is "on a TPU"
    monkeypatch.setattr(device_copies, "pinned_empty", lambda r, w: made.append((r, w)) or torch.empty(r, w))
    monkeypatch.setattr(device_copies, "to_device", lambda t, device: staged.append(t) or t.clone())
    gen = torch.Generator().manual_seed(9)
    for n in (20, 30, 5, 40):  # buckets 32, 32, 16, 64
        rows, slots = torch.randperm(ROWS, generator=gen)[:n], torch.randperm(CAP, generator=gen)[:n]
        want = cache.clone()
        want[slots] = host[rows]
        device_copies.copy_tensor(host, rows, cache, slots)
        assert torch.equal(cache, want)
    assert made == [(32, DIM), (16, DIM), (64, DIM)]  # one buffer per shape, made when first needed
    values = [t for t in staged if t.dim() == 2]  # (the slots' index copies are the 1-D ones)
    assert values[0] is values[1] and values[2] is not values[0]


def test_without_a_pinned_allocator_loads_stage_in_pageable_memory_and_say_so_once(tables, monkeypatch):
    host, cache = tables

    def refuse(rows: int, width: int) -> torch.Tensor:
        raise RuntimeError("Need to provide pin_memory allocator to use pin memory.")

    monkeypatch.setenv(device_copies.PINNED_ENV, "1")
    monkeypatch.setattr(device_copies, "_STAGING", {})
    monkeypatch.setattr(device_copies, "_PINNED_REFUSED", [])
    monkeypatch.setattr(device_copies, "on_host_device", lambda device: False)
    monkeypatch.setattr(device_copies, "pinned_empty", refuse)
    rows, slots = torch.arange(10), torch.arange(10, 20)
    want = cache.clone()
    want[slots] = host[rows]
    with pytest.warns(UserWarning, match="TPUREC_HOST_TIER_PINNED: no pinned host memory here"):
        device_copies.copy_tensor(host, rows, cache, slots)
    assert torch.equal(cache, want)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        device_copies.copy_tensor(host, rows + 10, cache, slots)
    assert later == []  # said once: no pinned buffer is tried again
    assert torch.equal(cache[slots], host[rows + 10])


class _Event:
    """A device event's stand-in: when it was recorded and waited for, in `log`."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_a_pinned_write_back_copies_without_waiting_and_completes_after_its_event(tables, monkeypatch):
    """TPUREC_HOST_TIER_PINNED=1: starting a write-back copies the gathered rows into a kept pinned buffer
    per chunk (non_blocking) and records an event; nothing is read on the host until `complete`, which
    waits for that event alone, then scatters the buffer's rows into the host table (counted as one
    device->host copy, as the pageable path counts its own)."""
    from tpurec.runtime import host_copies

    host, cache = tables
    log: list = []
    made: list = []
    monkeypatch.setenv(device_copies.PINNED_ENV, "1")
    monkeypatch.setattr(device_copies, "_STAGING", {})
    monkeypatch.setattr(device_copies, "on_host_device", lambda device: False)
    monkeypatch.setattr(device_copies, "pinned_empty", lambda r, w: made.append((r, w)) or torch.empty(r, w))
    monkeypatch.setattr(device_copies, "device_event", lambda device: _Event(log))
    monkeypatch.setattr(device_copies, "MAX_BUCKET", 32)  # two chunks: one buffer each
    slots, rows = torch.arange(40), torch.randperm(ROWS, generator=torch.Generator().manual_seed(4))[:40]
    want = host.clone()
    want[rows] = cache[slots]
    before = host_copies.total()
    pending = device_copies.start_write_back([cache], slots, [host], rows)
    assert log == ["record", "record"] and made == [(32, DIM), (16, DIM)]
    assert not torch.equal(host, want)  # nothing on the host table yet
    for chunk in pending:
        chunk.complete()
    assert log == ["record", "record", "synchronize", "synchronize"]
    assert torch.equal(host, want) and host_copies.total() - before == 2
    again = device_copies.start_write_back([cache], slots, [host], rows)  # the same buffers, kept
    assert all(a.packed is b.packed for a, b in zip(again, pending, strict=True)) and len(made) == 2
