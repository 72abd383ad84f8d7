"""The direct step's backward sort (`tpurec.embedding.key_sort`): the radix sort gives numpy's sorted
keys, and the direct step trains bit for bit the same whichever sort this CPU picked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import PoolingType

from tests.embedding.helpers import fused_optimizers, make_tables, random_kjt
from tpurec.embedding import csr_build, key_sort
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

pytestmark = pytest.mark.skipif(not csr_build.available(), reason="numba not installed")


def _keys(rng, sizes, row_bits, key_bits, dtype):
    """Segments of keys as the direct step makes them: random rows, `low` never decreasing."""
    parts, segments, at = [], [], 0
    for n in sizes:
        rows = rng.integers(0, 1 << row_bits, n) if row_bits else np.zeros(n, np.int64)
        low = np.sort(rng.integers(0, 1 << key_bits, n))
        parts.append((rows << key_bits | low).astype(dtype))
        segments.append([at, at + n, 0, 0])
        at += n
    return np.concatenate(parts), np.array(segments, np.int64).reshape(-1, 4)


@pytest.mark.parametrize(
    "row_bits, key_bits, dtype",
    # 13 and 15 row bits: the 5,000- and 40,000-key segments in one counting pass, the others by digits
    [(0, 8, np.uint32), (5, 10, np.uint32), (13, 12, np.uint32), (15, 15, np.uint32), (17, 15, np.uint32),
     (20, 30, np.int64)],
)  # fmt: skip
def test_the_radix_sort_gives_numpys_sorted_keys(row_bits, key_bits, dtype):
    rng = np.random.default_rng(row_bits)
    # empty and one-key segments, a few rows taking many keys (repeated keys), large segments
    keys, segments = _keys(rng, [0, 1, 2, 7, 300, 5000, 40_000], row_bits, key_bits, dtype)
    keys[100:160] = keys[100]  # one key repeated
    expected = keys.copy()
    key_sort.numpy_sort_segments(expected, segments)
    got = keys.copy()
    key_sort.sort_segments(got, segments, key_bits, row_bits)
    assert got.dtype == expected.dtype and np.array_equal(got, expected)
    # with rows there was something to sort; without (1-row tables) the keys come sorted
    assert np.array_equal(keys, expected) == (row_bits == 0)


def test_one_counting_pass_where_the_keys_are_a_sixth_of_the_buckets_or_more():
    assert key_sort.one_pass(40_000, 15) and key_sort.one_pass(5_000, 13)  # 32,768 <= 240,000; 8,192 <= 30,000
    assert not key_sort.one_pass(5_000, 15)  # 32,768 > 30,000: two 8-bit digits
    assert not key_sort.one_pass(1_000_000, 11)  # one digit already
    assert not key_sort.one_pass(1_000_000, 17)  # 131,072 counts: past L2, by digits


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_direct_step_trains_the_same_with_either_sort(name, weighted, monkeypatch):
    # make_tables: two stacks, t1 feeds two features (feature-major keys), weighted ids keyed by position
    tables = make_tables(PoolingType.SUM)
    cls, kwargs = fused_optimizers()[name]
    runs = []
    for radix in (True, False):
        monkeypatch.setattr(key_sort, "_choice", radix)
        torch.manual_seed(0)
        m = SparseCoreEmbeddingBagCollection(tables, cls, kwargs, num_sparsecores=4, is_weighted=weighted)
        gen = torch.Generator().manual_seed(7)
        for step in range(3):
            kjt = random_kjt(tables, 6, gen, weighted=weighted, hot_ids=step == 1)
            grad = torch.randn(6, sum(t.embedding_dim * len(t.feature_names) for t in tables), generator=gen)
            m(kjt).values().backward(grad)
        runs.append({t.name: m.kernel.read_weight(t.name) for t in tables})
    fresh = SparseCoreEmbeddingBagCollection(tables, cls, kwargs, num_sparsecores=4, is_weighted=weighted)
    for t in tables:
        assert torch.equal(runs[0][t.name], runs[1][t.name]), t.name
    assert any(not torch.equal(runs[0][t.name], fresh.kernel.read_weight(t.name)) for t in tables)


def test_the_faster_sort_is_measured_once(monkeypatch):
    monkeypatch.setattr(key_sort, "_choice", None)
    first = key_sort.use_radix()
    monkeypatch.setattr(key_sort, "sort_segments", None)  # not timed again: the choice is kept
    assert key_sort.use_radix() is first
