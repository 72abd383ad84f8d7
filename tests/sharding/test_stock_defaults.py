"""Given only `lr`, tpurec's DMP trains like stock TorchRec's DMP (FBGEMM's fused CPU kernel): the
hyper-parameters nobody passed take FBGEMM's defaults."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tpurec.sharding.dmp import _ensure_process_group


def _tables():
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"]) for i in range(2)
    ]


def _batches(n=4):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (2 * 16,), generator=gen)
        values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
        out.append(KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths))
    return out


def _sharded(dmp_class, ebc, **kw):
    """`dmp_class` over `ebc`: stock TorchRec table-wise on FBGEMM's fused kernel (its planner would
    pick data-parallel at one rank), tpurec planned by its own planner; tables set to one start."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    if dmp_class is StockDMP:
        per_table = {t.name: table_wise(rank=0, compute_kernel="fused") for t in _tables()}
        kw["plan"] = ShardingPlan({"": construct_module_sharding_plan(ebc, per_table)})
    model = dmp_class(ebc, device=torch.device("cpu"), **kw)
    with torch.no_grad():  # the same start for both (stock re-initialises the tables when sharding)
        for i, (_, value) in enumerate(sorted(model.state_dict().items())):
            shard = value.local_shards()[0].tensor
            shard.copy_(torch.linspace(-0.1, 0.1, shard.numel()).view_as(shard) * (i + 1))
    return model


def _steps(model) -> dict:
    for kjt in _batches():
        # a gradient of varied size, so that eps matters next to tiny accumulators
        out = model(kjt).values()
        (out * torch.linspace(-1e-3, 1e-3, out.numel()).view_as(out)).sum().backward()
    return {k: v.local_shards()[0].tensor.detach().clone() for k, v in model.state_dict().items()}


def _train(dmp_class, optimizer, ebc):
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.05})
    return _steps(_sharded(dmp_class, ebc))


# Adam: FBGEMM's CPU kernel refuses it ("Optimizer adam is not supported in CPU mode"), so there is no
# stock run to compare with; its fused-params defaults (lr 0.01, eps 1e-8, betas 0.9/0.999) are FBGEMM's.
@pytest.mark.parametrize("optimizer", [torch.optim.Adagrad, RowWiseAdagrad])
def test_only_lr_trains_like_stock_torchrec(optimizer):
    _ensure_process_group("cpu")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_tables())
    stock = _train(StockDMP, optimizer, copy.deepcopy(ebc))
    ours = _train(tpurec.DistributedModelParallel, optimizer, copy.deepcopy(ebc))
    for name, want in stock.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=2e-7)


def _train_with_sharder(dmp_class, ebc):
    """TorchRec's own sharder with fused params (as torchrec's examples pass it), no in-backward optimizer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6}
    return _steps(_sharded(dmp_class, ebc, sharders=[EmbeddingBagCollectionSharder(fused_params=fused)]))


def test_torchrecs_own_sharder_is_swapped_for_the_sparsecore_one_keeping_its_fused_params(caplog):
    _ensure_process_group("cpu")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_tables())
    stock = _train_with_sharder(StockDMP, copy.deepcopy(ebc))
    with caplog.at_level("WARNING", logger="tpurec.sharding.dmp"):
        ours = _train_with_sharder(tpurec.DistributedModelParallel, copy.deepcopy(ebc))
    said = [r.getMessage() for r in caplog.records if "replaced by" in r.getMessage()]
    assert (
        len(said) == 1 and "EmbeddingBagCollectionSharder replaced by tpurec.sharding.SparseCoreEBCSharder" in said[0]
    )
    for name, want in stock.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=2e-7)


def test_a_subclass_of_torchrecs_sharder_is_refused_naming_it_and_what_to_derive_from():
    """TorchRec's own EmbeddingBagCollectionSharder is swapped for tpurec's; a user's subclass of it
    was refused with "no sharding option" naming neither: now one line names both."""
    import pytest
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import tpurec
    from tpurec.errors import UserError

    class MySharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return ["table_wise"]

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
        device=torch.device("meta"),
    )
    with pytest.raises(UserError) as e:
        tpurec.DistributedModelParallel(ebc, device="cpu", sharders=[MySharder()])
    assert str(e.value) == (
        "sharders=[MySharder(...)]: a subclass of TorchRec's EmbeddingBagCollectionSharder shards onto FBGEMM's "
        "kernels, which tpurec does not run, and swapping it for tpurec's would drop what it overrides; derive it "
        "from tpurec.sharding.sharder.SparseCoreEBCSharder instead (the same arguments), or pass TorchRec's "
        "EmbeddingBagCollectionSharder itself, which tpurec swaps"
    )

    class Mine(tpurec.sharding.sharder.SparseCoreEBCSharder):  # what the message says: it shards
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return ["table_wise"]

    dmp = tpurec.DistributedModelParallel(ebc, device="cpu", sharders=[Mine(num_sparsecores=4)])
    assert dmp.plan.plan[""]["t0"].sharding_type == "table_wise"


def test_a_saved_plan_with_fbgemms_fused_kernel_runs_on_the_sparsecore_kernel_with_a_notice(caplog):
    """A plan TorchRec's planner made for its own sharder names compute kernel "fused": tpurec's DMP
    built FBGEMM's BatchedFusedEmbeddingBag inside its sharded module without a word. Now the table
    runs on tpurec's kernel (same sharding), said in one warning, and trains as stock does."""
    import logging

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    _ensure_process_group()
    torch.manual_seed(0)
    base = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
        device=torch.device("cpu"),
    )
    sharder = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(compute_kernels=["fused"])},
    )
    plan = planner.collective_plan(copy.deepcopy(base), [sharder])
    assert plan.plan[""]["t0"].compute_kernel == "fused"
    with caplog.at_level(logging.WARNING):
        ours = tpurec.DistributedModelParallel(
            copy.deepcopy(base), device="cpu", plan=copy.deepcopy(plan), sharders=[sharder]
        )
    notice = "the plan puts 1 table(s) on TorchRec's own kernels (t0 (fused)): run on tpurec's SparseCore kernel"
    assert notice in caplog.text
    assert [type(e).__name__ for lookup in ours.module._lookups for e in lookup._emb_modules] == [
        "SparseCoreEmbeddingBag"
    ]
    assert ours.plan.plan[""]["t0"].compute_kernel == "customized_kernel"
    stock = StockDMP(copy.deepcopy(base), device=torch.device("cpu"), plan=plan, sharders=[sharder])
    start = base.state_dict()["embedding_bags.t0.weight"]
    with torch.no_grad():  # the same start for both (stock re-initialises the tables when sharding)
        for d in (ours, stock):
            d.state_dict()["embedding_bags.t0.weight"].local_tensor().copy_(start)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([3, 5, 7, 3]), torch.tensor([1, 3]))
    for dmp in (ours, stock):
        dmp(kjt).values().sum().backward()  # one fused SGD step, lr 0.1
    t_ours, t_stock = (d.state_dict()["embedding_bags.t0.weight"].local_tensor() for d in (ours, stock))
    assert torch.allclose(t_ours, t_stock, atol=1e-7) and not torch.equal(
        t_ours, base.state_dict()["embedding_bags.t0.weight"]
    )
