"""Tables placed in a stack by their expected ids, so the SparseCore partitions share the ids."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.data.catalog import MLPERF_DCNV2_MULTI_HOT, get_table_set
from tpurec.embedding.constraints import padded_rows
from tpurec.embedding.kernel import KernelTable, SparseCoreKernel
from tpurec.embedding.layout import build_stacks
from tpurec.embedding.optimizers.rowwise_adagrad import RowWiseAdagradSpec
from tpurec.embedding.stack_order import balanced_order, partition_loads


def test_partition_loads_split_a_table_by_its_rows_in_each_partition():
    # P = 2 over 32 rows: table 0 (4 rows, 8 of storage) in partition 0; table 1 (12 rows from row 8)
    # has 8 rows in partition 0 and 4 in partition 1; table 2 (5 rows from row 24) in partition 1.
    loads = partition_loads([0, 1, 2], [4, 12, 5], [8, 16, 8], [2.0, 3.0, 1.0], 2)
    assert loads == pytest.approx([2.0 + 3.0 * 8 / 12, 3.0 * 4 / 12 + 1.0])


def _mlperf(p):
    tables = get_table_set("mlperf-dcnv2").tables
    rows = [t.num_embeddings for t in tables]
    return rows, [padded_rows(r, p) for r in rows], [float(k) for k in MLPERF_DCNV2_MULTI_HOT]


def test_the_mlperf_stack_is_evened_out():
    rows, pads, ids = _mlperf(4)
    natural = partition_loads(range(26), rows, pads, ids, 4)
    order = balanced_order(rows, pads, ids, 4)
    placed = partition_loads(order, rows, pads, ids, 4)
    mean = sum(ids) / 4
    assert max(natural) / mean > 1.45  # table order: 19.9, 45.6, 80.3, 68.1 of 214 ids per sample
    assert max(placed) / mean < 1.06
    assert sorted(order) == list(range(26)) and order == balanced_order(rows, pads, ids, 4)  # deterministic


def test_a_stack_of_many_tables_is_placed_within_a_bounded_search():
    import time

    n = 600
    rows = [1000 + 37 * (i % 50) for i in range(n)]
    pads = [padded_rows(r, 8) for r in rows]
    ids = [float(1 + (i * 7) % 13) for i in range(n)]
    start = time.process_time()
    order = balanced_order(rows, pads, ids, 8)
    assert time.process_time() - start < 20  # unbounded, the local search would take hours here
    assert sorted(order) == list(range(n)) and order == balanced_order(rows, pads, ids, 8)
    assert max(partition_loads(order, rows, pads, ids, 8)) <= max(partition_loads(range(n), rows, pads, ids, 8))


def test_build_stacks_keeps_table_order_without_hints_for_every_table():
    tables = [("a", 100, 8), ("b", 5000, 8), ("c", 100, 8)]
    (given,) = build_stacks(tables, 4, pad_to=1, expected_ids={"a": 1.0, "b": 50.0})  # "c" has none
    assert [t.name for t in given.tables] == ["a", "b", "c"]
    (placed,) = build_stacks(tables, 4, pad_to=1, expected_ids={"a": 1.0, "b": 50.0, "c": 1.0})
    assert sorted(t.name for t in placed.tables) == ["a", "b", "c"] and placed.total_rows == given.total_rows


def _kernel(hints: bool):
    # Four small hot tables, then four big cold ones: in table order the hot ones share partition 0.
    spec = [(f"hot{i}", 400, 8) for i in range(4)] + [(f"cold{i}", 1600, 1) for i in range(4)]
    tables = [KernelTable(n, r, 8, (f"f_{n}",), expected_ids=float(k) if hints else None) for n, r, k in spec]
    torch.manual_seed(0)
    return SparseCoreKernel(tables, RowWiseAdagradSpec(lr=0.1, eps=1e-8), 4), spec


def _batch(spec, batch, gen):
    lengths = torch.cat([torch.full((batch,), k) for _, _, k in spec])
    values = torch.cat([torch.randint(0, r, (batch * k,), generator=gen) for _, r, k in spec])
    return KeyedJaggedTensor(keys=[f"f_{n}" for n, _, _ in spec], values=values, lengths=lengths)


def test_placement_changes_the_partitions_not_the_results():
    plain, spec = _kernel(hints=False)
    placed, _ = _kernel(hints=True)
    names = [n for n, _, _ in spec]
    assert [t.name for t in plain.stacks[0].layout.tables] == names
    assert [t.name for t in placed.stacks[0].layout.tables] != names
    for name, *_ in spec:  # same initial tables, each still a view of its stack's storage
        assert torch.equal(plain.read_weight(name), placed.read_weight(name))
        view = placed.read_weight(name)
        base = placed.stack_weight(0)
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        kjt = _batch(spec, 64, gen)
        outs = [k(kjt) for k in (plain, placed)]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
        for out in outs:
            (out * out).sum().backward()
    for name, *_ in spec:
        torch.testing.assert_close(plain.read_weight(name), placed.read_weight(name), rtol=1e-6, atol=1e-6)
    fullest = {}
    for k in (plain, placed):
        k.preprocess(_batch(spec, 256, torch.Generator().manual_seed(4)))
        per_partition = next(iter(k.last_stats.values())).ids_per_partition.sum(0).float()
        fullest[k is placed] = float(per_partition.max() / per_partition.mean())
    assert fullest[False] > 3.0 and fullest[True] < 1.1, fullest  # expected: 3.6 and 1.0


def test_bad_pooling_factors_are_refused_naming_table_and_value():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"])]
    with pytest.raises(ValueError, match=r"does not have: \['typo'\]"):
        SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, pooling_factors={"typo": 2.0})
    with pytest.raises(ValueError, match=r"pooling_factors\['t'\] = -1.0"):
        SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, pooling_factors={"t": -1.0})
