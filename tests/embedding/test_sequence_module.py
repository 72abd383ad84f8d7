"""SparseCoreEmbeddingCollection equals torchrec's EmbeddingCollection (forward, fused updates, state)
and FBGEMM's CPU TBE in sequence mode (PoolingMode.NONE), its independent oracle for fused updates."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

from .helpers import random_kjt, seq_batch, seq_tables

STEPS = 5


def _stock(tables, need_indices=False):
    return EmbeddingCollection(tables=tables, need_indices=need_indices)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_forward_equals_embedding_collection(dtype):
    tables = seq_tables()
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4, need_indices=True)
    ec = _stock(tables, need_indices=True)
    ec.load_state_dict(sc.state_dict())
    gen = torch.Generator().manual_seed(0)
    for hot in (False, True):
        kjt = seq_batch(gen, hot=hot, dtype=dtype)
        ours, theirs = sc(kjt), ec(kjt)
        assert list(ours) == list(theirs) == ["f1@t1", "f2", "f3", "f1@t2", "f4"]
        for k in theirs:
            assert torch.equal(ours[k].values(), theirs[k].values()), k
            assert torch.equal(ours[k].lengths(), theirs[k].lengths()), k
            assert torch.equal(ours[k].weights(), theirs[k].weights()), k  # need_indices: the ids
            assert ours[k].values().dtype == torch.float32


def test_empty_sequences_and_empty_batch():
    tables = seq_tables()
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    ec = _stock(tables)
    ec.load_state_dict(sc.state_dict())
    keys = ["f1", "f2", "f3", "f4"]
    # f2 and f4 have no ids at all; f1 has an empty sequence in the middle.
    kjt = KeyedJaggedTensor(
        keys=keys, values=torch.tensor([3, 3, 36, 0, 49, 7]), lengths=torch.tensor([2, 0, 1, 0, 0, 0, 2, 1, 0, 0, 0, 0])
    )
    ours, theirs = sc(kjt), ec(kjt)
    for k in theirs:
        assert torch.equal(ours[k].values(), theirs[k].values()), k
        assert ours[k].values().shape == theirs[k].values().shape
    empty = KeyedJaggedTensor(
        keys=keys, values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(8, dtype=torch.long)
    )
    out = sc(empty)
    assert all(v.values().shape == (0, 8) for v in out.values())
    sum(v.values().sum() for v in out.values()).backward()  # no ids: no update, no error
    assert torch.equal(sc.state_dict()["embeddings.t1.weight"], ec.state_dict()["embeddings.t1.weight"])


@pytest.mark.parametrize(
    "optim,kwargs",
    [
        (torch.optim.SGD, {"lr": 0.3}),
        (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-6, "initial_accumulator_value": 0.1}),
    ],
)
def test_fused_updates_equal_embedding_collection_with_torch_optimizer(optim, kwargs):
    # SGD and Adagrad leave rows without gradient alone also when stepped densely: equal on any batch.
    tables = seq_tables()
    sc = SparseCoreEmbeddingCollection(tables, optim, kwargs, num_sparsecores=4)
    ec = _stock(tables)
    ec.load_state_dict(sc.state_dict())
    opt = optim(ec.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        kjt = seq_batch(gen, hot=step % 2 == 0)
        ours, theirs = sc(kjt), ec(kjt)
        ups = {k: torch.randn(v.values().shape, generator=gen) for k, v in theirs.items()}
        sum((ours[k].values() * u).sum() for k, u in ups.items()).backward()
        opt.zero_grad()
        sum((theirs[k].values() * u).sum() for k, u in ups.items()).backward()
        opt.step()
    for k, v in ec.state_dict().items():
        torch.testing.assert_close(sc.state_dict()[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "optim,kwargs",
    [
        (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}),
        (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-6}),
    ],
)
def test_fused_updates_equal_torch_optimizer_when_every_row_is_touched(optim, kwargs):
    # Adam is lazy and row-wise Adagrad keeps one accumulator per row: with every row in every batch,
    # the dense torch-style optimizers on an EmbeddingCollection coincide with them.
    tables = [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=6, feature_names=["f", "g"])]
    sc = SparseCoreEmbeddingCollection(tables, optim, kwargs, num_sparsecores=2)
    ec = _stock(tables)
    ec.load_state_dict(sc.state_dict())
    opt = optim(ec.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(5)
    for step in range(1, STEPS + 1):
        values = torch.cat([torch.arange(6), torch.randint(0, 6, (7,), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=torch.tensor([4, 0, 5, 2, 2, 0]))
        ups = {k: torch.randn(v, 8, generator=gen) for k, v in (("f", 9), ("g", 4))}
        ours, theirs = sc(kjt), ec(kjt)
        sum((ours[k].values() * u).sum() for k, u in ups.items()).backward()
        opt.zero_grad()
        sum((theirs[k].values() * u).sum() for k, u in ups.items()).backward()
        if optim is torch.optim.Adam:
            # Fused Adam keeps eps constant (TorchTPU compiles it in): torch's Adam with eps/sqrt(1-b2^t).
            opt.param_groups[0]["eps"] = kwargs["eps"] / (1 - kwargs["betas"][1] ** step) ** 0.5
        opt.step()
    torch.testing.assert_close(sc.table_weight("t"), ec.state_dict()["embeddings.t.weight"], rtol=1e-5, atol=1e-6)


def _fbgemm_sequence(tables, optim, **kw):
    specs = [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables]
    return SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=optim, pooling_mode=PoolingMode.NONE, **kw)


@pytest.mark.parametrize(
    "torch_optim,kwargs,fbgemm_optim",
    [
        (torch.optim.SGD, {"lr": 0.3}, EmbOptimType.EXACT_SGD),
        (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-4}, EmbOptimType.EXACT_ADAGRAD),
    ],
)
def test_fused_updates_equal_fbgemm_sequence_tbe(torch_optim, kwargs, fbgemm_optim):
    # FBGEMM's sequence TBE (PoolingMode.NONE), one table per feature, hot ids repeated in a batch.
    tables = [
        EmbeddingConfig(name="a", embedding_dim=16, num_embeddings=30, feature_names=["fa"]),
        EmbeddingConfig(name="b", embedding_dim=16, num_embeddings=7, feature_names=["fb"]),
    ]
    sc = SparseCoreEmbeddingCollection(tables, torch_optim, kwargs, num_sparsecores=4)
    tbe = _fbgemm_sequence(tables, fbgemm_optim, learning_rate=kwargs["lr"], eps=kwargs.get("eps", 1e-8))
    for w, t in zip(tbe.split_embedding_weights(), tables):
        w.data.copy_(sc.table_weight(t.name))
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        kjt = random_kjt(tables, 8, gen, max_len=6, hot_ids=step % 2 == 0)
        out = sc(kjt)
        ours = torch.cat([out["fa"].values(), out["fb"].values()])
        theirs = tbe(kjt.values(), kjt.offsets())
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(ours.shape, generator=gen)
        (ours * upstream).sum().backward()
        (theirs * upstream).sum().backward()
    for w, t in zip(tbe.split_embedding_weights(), tables):
        torch.testing.assert_close(sc.table_weight(t.name), w, rtol=1e-5, atol=1e-6)


def test_fp16_tables_match_embedding_collection_forward():
    tables = seq_tables(DataType.FP16)
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    ec = _stock(tables)
    assert sc.state_dict()["embeddings.t1.weight"].dtype == torch.float16
    ec.load_state_dict(sc.state_dict())
    kjt = seq_batch(torch.Generator().manual_seed(2))
    ours, theirs = sc(kjt), ec(kjt)
    for k in theirs:
        assert torch.equal(ours[k].values(), theirs[k].values()), k


def test_state_dict_aliases_live_tables_and_loads_both_ways():
    tables = seq_tables()
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4)
    assert list(sc.state_dict()) == ["embeddings.t1.weight", "embeddings.t2.weight", "embeddings.t3.weight"]
    sc.state_dict()["embeddings.t2.weight"][4].fill_(2.5)  # an in-place write (DCP, TorchRec's tools)
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([4]), lengths=torch.tensor([0, 0, 1, 0]))
    assert torch.equal(sc(kjt)["f3"].values(), torch.full((1, 8), 2.5))
    ec = _stock(tables)
    sc.load_state_dict(ec.state_dict())
    assert torch.equal(sc.table_weight("t3"), ec.embeddings["t3"].weight.detach())


def test_init_follows_each_tables_init_fn():
    torch.manual_seed(7)
    tables = [
        EmbeddingConfig(
            name="t", embedding_dim=8, num_embeddings=20, feature_names=["f"], init_fn=lambda w: w.data.fill_(0.25)
        )
    ]
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1})
    assert torch.equal(sc.table_weight("t"), torch.full((20, 8), 0.25))


def test_tables_of_different_dims_are_refused_as_torchrec_does():
    tables = [
        EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=5, feature_names=["fa"]),
        EmbeddingConfig(name="b", embedding_dim=16, num_embeddings=5, feature_names=["fb"]),
    ]
    with pytest.raises(ValueError, match="same embedding dim.*a: 8, b: 16"):
        SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(ValueError, match="same embedding dim"):
        EmbeddingCollection(tables=tables)


def test_an_empty_table_shard_looks_up_nothing_and_refuses_any_id():
    # TorchRec's row-wise sharding gives the last ranks no rows of a small table (9 rows over 4 ranks:
    # 3, 3, 3, 0); the kernel of such a rank holds a 0-row table.
    from tpurec.embedding.kernel import KernelTable
    from tpurec.embedding.optimizers.registry import spec_from_torch
    from tpurec.embedding.sequence_kernel import SparseCoreSequenceKernel

    kernel = SparseCoreSequenceKernel(
        [KernelTable("t/0", 0, 8, ("0:f",)), KernelTable("u/0", 5, 8, ("1:g",))],
        spec_from_torch(torch.optim.SGD, {"lr": 0.1}),
        4,
    )
    assert kernel.read_weight("t/0").shape == (0, 8)
    out = kernel(KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([4, 0]), lengths=torch.tensor([0, 0, 1, 1])))
    assert torch.equal(out, kernel.read_weight("u/0")[[4, 0]])
    out.sum().backward()
    with pytest.raises(IndexError, match=r"table 't/0'\): ids must be in \[0, 0\)"):
        kernel(KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([0]), lengths=torch.tensor([1, 0, 0, 0])))


def test_a_features_ids_are_dealt_round_the_sparsecores():
    """Feature k's j-th id goes to SparseCore j mod P: a batch of N ids under a capacity C puts ceil(N / P)
    or floor(N / P) on each SparseCore (at sample j div P of its C / P), not min(N, C / P) on the first;
    the ids still come back in order, equal to TorchRec's EmbeddingCollection."""
    from tpurec.embedding.sequence_kernel import slots

    assert slots(torch.arange(8), 8, 4).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    tables = [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=64, feature_names=["f", "g"])]
    torch.manual_seed(0)
    ours = SparseCoreEmbeddingCollection(
        tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=4, max_ids_per_feature=32, fixed_limits=True
    )
    stock = EmbeddingCollection(tables=tables)
    stock.embeddings["t"].weight.data.copy_(ours.kernel.read_weight("t"))
    # f: 10 ids, g: 3 (one bag each of 4 samples); the capacity is 32
    lengths = torch.tensor([4, 0, 6, 0, 1, 1, 0, 1])
    kjt = KeyedJaggedTensor(keys=["f", "g"], values=torch.arange(13) * 3 % 64, lengths=lengths)
    out, expected = ours(kjt), stock(kjt)
    for key in ("f", "g"):
        assert torch.equal(out[key].values(), expected[key].values()), key
    # ids per SparseCore (both features, summed over partitions): f's 10 as 3, 3, 2, 2 and g's 3 as 1, 1, 1, 0
    (stats,) = ours.kernel.last_stats.values()
    assert stats.ids_per_partition.sum(1).tolist() == [4, 4, 3, 2]
