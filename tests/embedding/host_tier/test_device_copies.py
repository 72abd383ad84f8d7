"""Row copies between the host table and a cache on a device in a few fixed shapes
(tpurec/embedding/host_tier/device_copies.py), on the host: the cache side is taken for a device
(`on_host` says so), and every indexed op on the cache is recorded with its index length."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpurec.embedding.host_tier import device_copies
from tpurec.embedding.host_tier.device_copies import bucket, buckets
from tpurec.embedding.host_tier.host_rows import Rows, copy_rows

ROWS, CAP, DIM = 1000, 100, 3


class _CacheOps(TorchDispatchMode):
    """The index length of every index_select / index_copy_ on `cache` (the 'device' tensor)."""

    def __init__(self, cache: torch.Tensor) -> None:
        super().__init__()
        self.cache = cache
        self.lengths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ("aten::index_select", "aten::index_copy_") and args[0].data_ptr() == self.cache.data_ptr():
            self.lengths.append(args[2].numel())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tables(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    host = torch.randn(ROWS, DIM, generator=gen)
    cache = torch.randn(CAP, DIM, generator=gen)
    monkeypatch.setattr(device_copies, "on_host", lambda t: t.data_ptr() != cache.data_ptr())
    return host, cache


def test_buckets_are_powers_of_two_from_16_up_to_the_cache_and_at_most_4096():
    assert buckets(100) == [16, 32, 64, 100]
    assert buckets(128) == [16, 32, 64, 128]
    assert buckets(10) == [10] and buckets(1) == [1]
    assert buckets(10**6) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert [bucket(n, 100) for n in (1, 16, 17, 33, 64, 65, 100)] == [16, 16, 32, 64, 64, 100, 100]
    assert bucket(3, 10) == 10 and bucket(4096, 10**6) == 4096
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


def test_a_copy_over_4096_rows_goes_in_chunks_of_fixed_shapes(tables, monkeypatch):
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

    monkeypatch.setattr(device_copies, "copy_tensor", refuse)
    copy_rows(host, torch.tensor([7, 2]), cache, torch.tensor([1, 3]))
    assert torch.equal(cache.weight, torch.tensor([[0.0, 0], [14, 15], [0, 0], [4, 5]]))
    assert torch.equal(cache.states["m"], torch.tensor([0.0, 7, 0, 2]))


def test_a_write_back_moves_a_rows_weight_and_states_in_one_copy_per_chunk(monkeypatch):
    """Each device->host copy makes the host wait for the device: a write-back of rows with Adam's two
    states and a row-wise one (mixed widths, a bf16 weight) is one copy per chunk of at most 4,096 rows,
    every value exact."""
    from tpurec.runtime import host_copies

    gen = torch.Generator().manual_seed(5)
    cap, rows = 5000, 9000

    def side(n):
        return Rows(
            torch.randn(n, DIM, generator=gen).to(torch.bfloat16),
            {
                "m": torch.randn(n, DIM, generator=gen),
                "v": torch.rand(n, DIM, generator=gen),
                "r": torch.rand(n, generator=gen),
            },
        )

    host, cache = side(rows), side(cap)
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
