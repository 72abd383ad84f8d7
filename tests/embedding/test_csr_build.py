"""The compiled CSR build (`tpurec.embedding.csr_build`) gives the numpy route's SparseCore inputs
bit for bit: every stack, padding, stats, weights, mean pooling, fixed limits, MOD renaming."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.embedding.helpers import make_tables, random_kjt
from tpurec.embedding import csr_build
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.multipass import MultiPassInput
from tpurec.embedding.optimizers.sgd import SGDSpec

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed")


def _kernel(tables, num_sc, **kw):
    kt = [KernelTable(t.name, t.num_embeddings, t.embedding_dim, tuple(t.feature_names), kw.pop("pool", "sum"))
          for t in tables]  # fmt: skip
    return SparseCoreKernel(kt, SGDSpec(lr=0.1), num_sc, **kw)


def _both(kernel, kjt, monkeypatch):
    """(compiled, numpy route) inputs and stats of every stack for the same KJT."""
    got = kernel.preprocess(kjt)
    got_stats = dict(kernel.last_stats)
    monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    want = kernel.preprocess(kjt)
    want_stats = dict(kernel.last_stats)
    monkeypatch.delenv("TPUREC_NO_NUMBA")
    return got, want, got_stats, want_stats


def _assert_same(got, want, got_stats, want_stats):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for name in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            # bitwise: NaN padding and -0.0 included
            assert np.array_equal(x.numpy().view(np.int32), y.numpy().view(np.int32)), name
        for name in ("device_batch_size", "num_sc_per_device", "num_partitions", "max_ids_per_partition",
                     "max_unique_ids_per_partition"):  # fmt: skip
            assert getattr(a, name) == getattr(b, name), name
    for k in want_stats:
        s, t = got_stats[k], want_stats[k]
        assert torch.equal(s.ids_per_partition, t.ids_per_partition)
        assert torch.equal(s.unique_ids_per_partition, t.unique_ids_per_partition)
        assert s.required_buffer_size_per_sc == t.required_buffer_size_per_sc
        assert s.dropped_id_count == t.dropped_id_count


@pytest.mark.parametrize("limits", [None, 1024])  # sized to each batch; given (merge and place in one pass)
@pytest.mark.parametrize("num_sc", [1, 2, 4])
@pytest.mark.parametrize("case", ["sum", "weighted", "mean", "hot"])
def test_compiled_equals_numpy_route(num_sc, case, limits, monkeypatch):
    gen = torch.Generator().manual_seed(num_sc * 7 + len(case))
    tables = make_tables()
    kernel = _kernel(tables, num_sc, is_weighted=case == "weighted", pool="mean" if case == "mean" else "sum",
                     max_ids_per_partition=limits, max_unique_ids_per_partition=limits and limits // 2)  # fmt: skip
    for batch in (1, 5, 16, 33):
        kjt = random_kjt(tables, batch, gen, max_len=6, weighted=case == "weighted", hot_ids=case == "hot")
        if kjt.values().numel() == 0:
            continue
        _assert_same(*_both(kernel, kjt, monkeypatch))


def test_compiled_is_used_and_handles_fixed_limits(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    tables = make_tables()
    kernel = _kernel(tables, 4, fixed_limits=True)
    calls = []
    real = csr_build.stack_csr
    monkeypatch.setattr(csr_build, "stack_csr", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = random_kjt(tables, 32, gen)
    kernel.preprocess(first)  # the first batch sets the limits through the numpy route
    assert not calls
    _assert_same(*_both(kernel, random_kjt(tables, 32, gen, max_len=2), monkeypatch))
    assert calls, "the compiled build did not run"


def test_out_of_range_and_over_limit_fall_back_to_the_numpy_route():
    tables = make_tables()
    kernel = _kernel(tables, 2, max_ids_per_partition=1)
    kjt = random_kjt(tables, 16, torch.Generator().manual_seed(0), hot_ids=True)
    # over the limits: the numpy route runs the batch in passes that fit (multipass.py)
    inputs = kernel.preprocess(kjt)
    assert all(isinstance(x, MultiPassInput) for x in inputs) and kernel.multipass_batches == len(inputs)
    bad = random_kjt(tables, 4, torch.Generator().manual_seed(1))
    bad.values()[0] = 10_000
    with pytest.raises(IndexError, match="ids must be in"):
        _kernel(tables, 2).preprocess(bad)


@pytest.mark.parametrize("max_ids, max_uniq", [(4, 4), (1024, 2)])
def test_a_batch_over_given_limits_is_dropped_as_the_numpy_route_drops(max_ids, max_uniq, monkeypatch):
    tables = make_tables()
    kernel = _kernel(tables, 2, max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_uniq,
                     allow_id_dropping=True)  # fmt: skip
    kjt = random_kjt(tables, 16, torch.Generator().manual_seed(5), max_len=6)
    before = kernel.dropped_id_count
    _assert_same(*_both(kernel, kjt, monkeypatch))
    assert kernel.dropped_id_count > before


def test_mlperf_shaped_stack_matches(monkeypatch):
    """One stack of 26 multi-hot features with 40M-row tables (large local ids, uint64 keys)."""
    from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT, get_table_set

    rng = np.random.default_rng(0)
    ts = get_table_set("mlperf-dcnv2")
    kt = [KernelTable(t.name, t.num_embeddings, t.embedding_dim, (t.feature,)) for t in ts.tables]
    kernel = SparseCoreKernel(kt, SGDSpec(lr=0.1), 4, device="meta", fixed_limits=False)
    batch = 64
    lengths = torch.tensor(np.repeat(MLPERF_DCNV2_MULTI_HOT, batch), dtype=torch.int32)
    values = torch.cat(
        [
            torch.from_numpy(rng.integers(0, t.num_embeddings, batch * k))
            for t, k in zip(ts.tables, MLPERF_DCNV2_MULTI_HOT)
        ]
    )
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=[t.feature for t in ts.tables], values=values, lengths=lengths)
    got = [kernel.inputs.stack_input(0, *kernel.inputs.stacked_arrays(kjt), batch, batch)]
    gs = dict(kernel.last_stats)
    monkeypatch.setenv("TPUREC_NO_NUMBA", "1")
    want = [kernel.inputs.stack_input(0, *kernel.inputs.stacked_arrays(kjt), batch, batch)]
    _assert_same(got, want, gs, dict(kernel.last_stats))


def test_recycled_buffers_never_change_a_result_still_held():
    """Buffers are reused only after every tensor viewing them is gone."""
    gen = torch.Generator().manual_seed(9)
    tables = make_tables()
    kernel = _kernel(tables, 2, max_ids_per_partition=64)
    kjts = [random_kjt(tables, 16, gen) for _ in range(6)]
    held = [kernel.preprocess(k) for k in kjts[:3]]
    copies = [[c.embedding_ids.clone() for c in csrs] for csrs in held]
    ptrs = {c.embedding_ids.data_ptr() for csrs in held for c in csrs}
    for k in kjts[3:]:  # results dropped at once: their buffers go back to the pool
        later = kernel.preprocess(k)
        assert not ptrs & {c.embedding_ids.data_ptr() for c in later}
        del later
    for csrs, want in zip(held, copies):
        assert all(torch.equal(c.embedding_ids, w) for c, w in zip(csrs, want))
