"""SparseCoreEmbeddingBagCollection's forward equals torchrec's EBC and nn.EmbeddingBag."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

from .helpers import make_tables, random_kjt


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("num_sc", [1, 2, 4])
@pytest.mark.parametrize("stack", [True, False])
def test_forward_equals_ebc(pooling, weighted, num_sc, stack):
    gen = torch.Generator().manual_seed(num_sc * 7 + weighted)
    tables = make_tables(pooling)
    sc = SparseCoreEmbeddingBagCollection(
        tables, torch.optim.SGD, {"lr": 0.1}, num_sparsecores=num_sc, is_weighted=weighted, stack_tables=stack
    )
    # torch's EmbeddingBag refuses per-sample weights with mean pooling; FBGEMM (and the SparseCore)
    # define it as sum(w * e) / bag_length, so compare against a SUM EBC divided by the bag length.
    weighted_mean = weighted and pooling == PoolingType.MEAN
    ebc = EmbeddingBagCollection(make_tables(PoolingType.SUM) if weighted_mean else tables, is_weighted=weighted)
    ebc.load_state_dict(sc.state_dict())
    for batch in (1, 5, 13):  # 5, 13: not multiples of the SparseCore count
        for hot in (False, True):
            kjt = random_kjt(tables, batch, gen, weighted=weighted, hot_ids=hot)
            ours, theirs = sc(kjt), ebc(kjt)
            assert ours.keys() == theirs.keys()
            assert ours.length_per_key() == theirs.length_per_key()
            expected = theirs.values()
            if weighted_mean:
                lengths = kjt.lengths().view(len(kjt.keys()), batch).T.clamp(min=1).float()
                expected = torch.cat(
                    [
                        expected.split(theirs.length_per_key(), 1)[k] / lengths[:, k : k + 1]
                        for k in range(len(kjt.keys()))
                    ],
                    1,
                )
            torch.testing.assert_close(ours.values(), expected, rtol=1e-6, atol=1e-6)


def test_forward_equals_nn_embedding_bag_with_empty_bags_and_repeats():
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=11, feature_names=["f"])
    sc = SparseCoreEmbeddingBagCollection([table], torch.optim.SGD, {"lr": 0.1}, num_sparsecores=2)
    bag = torch.nn.EmbeddingBag(11, 8, mode="sum")
    bag.weight.data.copy_(sc.table_weight("t"))
    values = torch.tensor([3, 3, 3, 0, 10, 10, 7])
    lengths = torch.tensor([3, 0, 2, 0, 2])  # empty bags at 1 and 3, an id repeated in a bag
    kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths)
    offsets = torch.tensor([0, 3, 3, 5, 5])
    torch.testing.assert_close(sc(kjt).values(), bag(values, offsets), rtol=0, atol=1e-6)
    assert torch.all(sc(kjt).values()[[1, 3]] == 0)


def test_state_dict_roundtrip_both_ways_with_ebc():
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.Adagrad, {"lr": 0.1}, num_sparsecores=4)
    assert set(sc.state_dict()) == set(ebc.state_dict()) == {f"embedding_bags.t{i}.weight" for i in (1, 2, 3)}
    sc.load_state_dict(ebc.state_dict())
    for k, v in ebc.state_dict().items():
        assert torch.equal(sc.state_dict()[k], v)
    ebc2 = EmbeddingBagCollection(tables)
    ebc2.load_state_dict(sc.state_dict())
    for k, v in ebc.state_dict().items():
        assert torch.equal(ebc2.state_dict()[k], v)


def test_bad_inputs_have_clear_errors():
    tables = make_tables()
    sc = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1})
    lengths = torch.ones(4, dtype=torch.long)
    with pytest.raises(IndexError, match=r"feature 'f3' \(table 't2'\): ids must be in \[0, 50\), got min 50, max 50"):
        sc(KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([0, 0, 50, 0]), lengths=lengths))
    with pytest.raises(IndexError, match="got min -1"):
        sc(KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([-1, 0, 0, 0]), lengths=lengths))
    with pytest.raises(KeyError, match=r"lacks features \['f4'\]"):
        sc(KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([0, 0, 0]), lengths=lengths[:3]))
    with pytest.raises(TypeError, match="ids must be integers"):
        sc(KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([0.0, 0, 0, 0]), lengths=lengths))
    with pytest.raises(ValueError, match="momentum=0.9 is not supported"):
        SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="has no fused SparseCore update"):
        SparseCoreEmbeddingBagCollection(tables, torch.optim.RMSprop, {"lr": 0.1})
    weighted = SparseCoreEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1}, is_weighted=True)
    with pytest.raises(ValueError, match="has no weights"):
        weighted(KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([0, 0, 0, 0]), lengths=lengths))


def test_id_limits_run_in_passes_or_drop_when_asked():
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=64, feature_names=["f"])
    # 4 samples, 1 SparseCore, 1 partition: ids 0..9 in sample 0 -> 10 ids in one partition.
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(10), lengths=torch.tensor([10, 0, 0, 0]))
    strict = SparseCoreEmbeddingBagCollection(
        [table], torch.optim.SGD, {"lr": 0.1}, num_sparsecores=1, max_ids_per_partition=8
    )
    # Over the limit: lookups in 2 passes of at most 8 ids; the 10 rows' updates in 3 passes (a row's
    # gradient takes a sample slot, and the batch has 4). Nothing dropped.
    out = strict(kjt).values()
    torch.testing.assert_close(out[0], strict.table_weight("t")[:10].sum(0))
    assert strict.id_stats()["stack_d8"].passes == 3 and strict.kernel.dropped_id_count == 0
    dropping = SparseCoreEmbeddingBagCollection(
        [table], torch.optim.SGD, {"lr": 0.1}, num_sparsecores=1, max_ids_per_partition=8, allow_id_dropping=True
    )
    out = dropping(kjt).values()
    assert dropping.kernel.dropped_id_count == 2
    # ids 8 and 9 (last in (id, sample) order) are dropped
    torch.testing.assert_close(out[0], dropping.table_weight("t")[:8].sum(0))
    stats = dropping.id_stats()["stack_d8"]
    assert stats.max_ids_per_partition == 10 and stats.dropped_id_count == 2


def test_public_name_is_the_module_class():
    import tpurec.embedding

    assert tpurec.embedding.SparseCoreEmbeddingBagCollection is SparseCoreEmbeddingBagCollection
