"""The standalone SparseCore modules list their tables in `named_parameters()` as TorchRec's
EmbeddingBagCollection / EmbeddingCollection do, each parameter over the live (stacked) table."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.embedding.module import SparseCoreEmbeddingBagCollection
from tpurec.embedding.sequence_module import SparseCoreEmbeddingCollection

from .helpers import make_tables, random_kjt


def _shapes(module: torch.nn.Module) -> list[tuple]:
    return [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()]


def test_bag_collection_lists_its_tables_as_torchrecs():
    sc = SparseCoreEmbeddingBagCollection(make_tables(), torch.optim.SGD, {"lr": 0.1})
    stock = EmbeddingBagCollection(make_tables())
    assert _shapes(sc) == _shapes(stock)
    assert [n for n, _ in sc.named_modules() if n.startswith("embedding_bags")] == [
        n for n, _ in stock.named_modules() if n
    ]
    assert sum(p.numel() for p in sc.parameters()) == sum(p.numel() for p in stock.parameters())
    # updated in backward by the fused optimizer: TorchRec's filter keeps them from dense optimizers
    assert list(in_backward_optimizer_filter(sc.named_parameters())) == []
    assert all(p._in_backward_optimizers == [sc.fused_optimizer] for p in sc.parameters())
    assert list(sc.state_dict()) == list(stock.state_dict())  # state_dict unchanged


def test_embedding_collection_lists_its_tables_as_torchrecs():
    tables = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20 + i, feature_names=[f"f{i}"]) for i in (0, 1)
    ]
    sc = SparseCoreEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.1})
    assert _shapes(sc) == _shapes(EmbeddingCollection(tables=tables))
    assert list(in_backward_optimizer_filter(sc.named_parameters())) == []


@pytest.mark.parametrize("pad_dims", [False, True])
def test_parameters_are_views_of_the_live_stacked_tables(pad_dims):
    """t1 and t3 share one stacked storage (dim 8); pad_dims stores rows 8-aligned as on a TPU (t2's
    16 too), where a table is a strided view: the parameters are those views either way."""
    sc = SparseCoreEmbeddingBagCollection(make_tables(), torch.optim.SGD, {"lr": 0.1}, pad_dims=pad_dims)
    params = dict(sc.named_parameters())
    for name in ("t1", "t2", "t3"):
        param, view = params[f"embedding_bags.{name}.weight"], sc.table_weight(name)
        assert (param.data_ptr(), param.stride()) == (view.data_ptr(), view.stride())
    assert params["embedding_bags.t1.weight"].untyped_storage().data_ptr() == (
        params["embedding_bags.t3.weight"].untyped_storage().data_ptr()
    )

    t2 = params["embedding_bags.t2.weight"]
    with torch.no_grad():
        t2.copy_(torch.arange(50 * 16, dtype=torch.float32).view(50, 16))
    one = KeyedJaggedTensor(keys=["f1", "f2", "f3", "f4"], values=torch.tensor([7]), lengths=torch.tensor([0, 0, 1, 0]))
    assert torch.equal(sc(one).to_dict()["f3"][0], t2[7].detach())  # a write through it is looked up

    before = {n: p.detach().clone() for n, p in params.items()}
    kjt = random_kjt(make_tables(), 4, torch.Generator().manual_seed(1))
    sc(kjt).values().sum().backward()
    assert all(p.grad is None for p in params.values())
    assert any(not torch.equal(p, before[n]) for n, p in params.items())  # the update shows in them
    for name in ("t1", "t2", "t3"):
        assert torch.equal(params[f"embedding_bags.{name}.weight"], sc.table_weight(name))


def test_load_state_dict_still_goes_through_the_tables_and_reports_strays():
    sc = SparseCoreEmbeddingBagCollection(make_tables(), torch.optim.SGD, {"lr": 0.1})
    stock = EmbeddingBagCollection(make_tables())
    assert not sc.load_state_dict(stock.state_dict()).missing_keys  # strict: nothing missing
    for name, p in sc.named_parameters():
        assert torch.equal(p, stock.state_dict()[name])
    stray = {**stock.state_dict(), "embedding_bags.t1.stray": torch.zeros(1)}
    result = sc.load_state_dict(stray, strict=False)
    assert result.unexpected_keys == ["embedding_bags.t1.stray"] and not result.missing_keys
