"""A batch of 0 samples (a rank whose data ran out, an empty eval shard) steps as stock TorchRec does."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from tests.sharding.multiprocess import run_ranks
from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=30, feature_names=[f"f{i}"]) for i in range(2)
]


def _batch(rank: int, world_size: int) -> KeyedJaggedTensor:
    n = 0 if rank == 0 else 3  # rank 0 has no samples
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (2 * n,), generator=gen)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, stride=n)


def _step(rank, world_size, stock: bool):
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    module_plan = construct_module_sharding_plan(
        ebc, {t.name: table_wise(rank=i % world_size) for i, t in enumerate(TABLES)}
    )
    plan = ShardingPlan({"": module_plan})
    if stock:
        model = StockDMP(copy.deepcopy(ebc), device=torch.device("cpu"), plan=plan)
    else:
        model = tpurec.DistributedModelParallel(copy.deepcopy(ebc), device="cpu", plan=plan)
    with torch.no_grad():  # the same start (stock re-initialises the tables when sharding)
        for i, (_, value) in enumerate(sorted(model.state_dict().items())):
            for shard in value.local_shards():
                shard.tensor.copy_(torch.linspace(-0.1, 0.1, shard.tensor.numel()).view_as(shard.tensor) * (i + 1))
    kjt = _batch(rank, world_size)
    out = model(kjt).values()
    (out * 2).sum().backward()
    tables = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in model.state_dict().items()}
    return tuple(out.shape), tables


def _stock_then_ours(rank, world_size):
    """Both steps in one launch of the ranks (a launch imports torch and TorchRec on every rank: half
    the test's time when each side had its own). Stock first, so that nothing tpurec's DMP sets up
    in the process can reach the stock run."""
    return _step(rank, world_size, True), _step(rank, world_size, False)


@pytest.mark.multiprocess
# one rank in `make test-all` (9 s): the default suite's two ranks step an empty batch through the
# all-to-alls as well
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_an_empty_batch_steps_as_stock_torchrec(world_size):
    stock, ours = zip(*run_ranks(_stock_then_ours, world_size))
    for (shape, tables), (want_shape, want) in zip(ours, stock):
        assert shape == want_shape
        for k, shards in want.items():
            for a, b in zip(tables[k], shards):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert ours[0][0] == (0, 16)


def test_the_standalone_module_takes_an_empty_batch():
    sc = SparseCoreEmbeddingBagCollection(TABLES, torch.optim.SGD, {"lr": 0.5})
    before = sc.table_weight("t0").clone()
    out = sc(_batch(0, 1)).values()
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(sc.table_weight("t0"), before)
