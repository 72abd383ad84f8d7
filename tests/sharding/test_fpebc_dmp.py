"""TorchRec's FeatureProcessedEmbeddingBagCollection with PositionWeightedModules under
tpurec.DistributedModelParallel: its tables on the SparseCore kernel, trained as stock TorchRec's DMP
trains it (FBGEMM's fused kernel, table-wise): the pooled outputs, the position weights' gradients
(dense parameters, stepped by a dense optimizer), the tables and the position weights after the steps.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tests.helpers.fp_model import MAX_LENGTH, TABLES, FPModel
from tests.sharding.multiprocess import run_ranks
from tpurec.planner.kernel_choice import COMPUTE_KERNEL
from tpurec.sharding.dmp import _ensure_process_group
from tpurec.sharding.fp_sharder import SparseCoreFPEBCSharder

BATCH, STEPS = 6, 3
OPTIMIZERS = {"row_wise_adagrad": RowWiseAdagrad, "sgd": torch.optim.SGD}
# tpurec's layouts: None is its own planner's choice; stock TorchRec always runs table-wise on FBGEMM
# (its planner picks data-parallel at one rank, and its CPU sharder refuses row-wise).
PLANS = {
    "table_wise": lambda i, ws: table_wise(rank=i % ws, compute_kernel=COMPUTE_KERNEL),
    "column_wise": lambda i, ws: column_wise(ranks=[(i + k) % ws for k in range(2)], compute_kernel=COMPUTE_KERNEL),
    "row_wise": lambda i, ws: row_wise(compute_kernel=COMPUTE_KERNEL),
}


def _batches(rank: int) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """(ids, output weights for the loss) per step: every position 0..MAX_LENGTH-1 occurs."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, MAX_LENGTH + 1, (len(TABLES) * BATCH,), generator=gen)
        values = torch.cat(
            [
                torch.randint(0, rows, (int(lengths[k * BATCH : (k + 1) * BATCH].sum()),), generator=gen)
                for k, (_, rows, _, _) in enumerate(TABLES)
            ]
        )
        kjt = KeyedJaggedTensor(keys=[f for *_, f in TABLES], values=values, lengths=lengths)
        out.append((kjt, torch.randn(BATCH, sum(d for _, _, d, _ in TABLES), generator=gen)))
    return out


def _plan(model: FPModel, sharding: str | None, world_size: int) -> ShardingPlan | None:
    if sharding is None:
        return None  # tpurec's planner
    stock = sharding == "stock"
    per_table = {
        n: table_wise(rank=i % world_size, compute_kernel="fused") if stock else PLANS[sharding](i, world_size)
        for i, (n, *_) in enumerate(TABLES)
    }
    sharder = None if stock else cast(ModuleSharder[torch.nn.Module], SparseCoreFPEBCSharder())
    module_plan = construct_module_sharding_plan(
        model.fp, per_table, sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu"
    )
    return ShardingPlan({"fp": module_plan})


def _start(model) -> None:
    """The same tables and position weights for every model and layout (stock re-initialises the
    tables when it shards on CPU): each shard takes its slice of a fixed full table."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key.endswith("position_weight"):
                value.copy_(torch.tensor([1.0, 0.5, 1.5, 0.75][:MAX_LENGTH]) * (2 if "f1" in key else 1))
                continue
            rows, cols = value.size()
            full = torch.linspace(-0.2, 0.2, rows * cols).view(rows, cols) * (2 if "t1" in key else 1)
            for shard in value.local_shards():
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r : r + nr, c : c + nc])


def _full_tables(model) -> dict[str, torch.Tensor]:
    """Every table whole on rank 0 (gathered from its shards), position weights as they are."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("position_weight"):
            out[key] = value.detach().clone()
            continue
        full = torch.empty(value.size()) if torch.distributed.get_rank() == 0 else None
        value.gather(dst=0, out=full)
        if full is not None:
            out[key] = full
    return out


def _train(dmp_class, optimizer: str, sharding: str | None, rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    module = FPModel()
    apply_optimizer_in_backward(OPTIMIZERS[optimizer], module.fp._embedding_bag_collection.parameters(), {"lr": 0.05})
    model = dmp_class(module, device=torch.device("cpu"), plan=_plan(module, sharding, world_size))
    _start(model)
    position_weights = {n: p for n, p in model.named_parameters() if n.endswith("position_weight")}
    assert len(position_weights) == len(TABLES)
    dense = torch.optim.SGD(position_weights.values(), lr=0.1)
    outputs, grads = [], []
    for kjt, loss_weights in _batches(rank):
        out = model(kjt)
        (out * loss_weights).sum().backward()
        outputs.append(out.detach().clone())
        grads.append({n.split(".")[-2]: p.grad.clone() for n, p in position_weights.items()})
        dense.step()
        dense.zero_grad()
    kernels = {ps.compute_kernel for module_plan in model.plan.plan.values() for ps in module_plan.values()}
    return {"outputs": outputs, "grads": grads, "state": _full_tables(model), "kernels": kernels}


def _both(rank: int, world_size: int, optimizer: str, sharding: str | None) -> tuple[dict, dict]:
    stock = _train(StockDMP, optimizer, "stock", rank, world_size)
    ours = _train(tpurec.DistributedModelParallel, optimizer, sharding, rank, world_size)
    return stock, ours


def _assert_same(stock: dict, ours: dict) -> None:
    assert ours["kernels"] == {COMPUTE_KERNEL}
    for got, want in zip(ours["outputs"], stock["outputs"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(ours["grads"], stock["grads"]):
        assert set(got) == set(want) == {f for *_, f in TABLES}
        for f in want:
            assert want[f].abs().sum() > 0  # the position weights do train
            torch.testing.assert_close(got[f], want[f], rtol=0, atol=1e-5)
    assert set(ours["state"]) == set(stock["state"])
    for key, want in stock["state"].items():
        torch.testing.assert_close(ours["state"][key], want, rtol=0, atol=1e-6, msg=key)


# Not row-wise Adagrad under column-wise: its accumulator is per row of each column shard, in FBGEMM too
# (docs/dmp.md), so it cannot equal a table-wise run.
@pytest.mark.parametrize(
    "optimizer, sharding",
    [("row_wise_adagrad", None), ("row_wise_adagrad", "row_wise"), ("sgd", "column_wise")],
)
def test_position_weighted_fpebc_trains_as_in_stock_torchrec(optimizer, sharding):
    _ensure_process_group("cpu")
    _assert_same(*_both(0, 1, optimizer, sharding))


@pytest.mark.slow  # about 25 s of two ranks importing torchrec; the one-rank cases above run by default
@pytest.mark.multiprocess
def test_position_weighted_fpebc_trains_as_in_stock_torchrec_at_two_ranks():
    for rank, (stock, ours) in enumerate(run_ranks(_both, 2, "row_wise_adagrad", "row_wise")):
        if rank > 0:  # tables are gathered on rank 0 only
            stock["state"] = {k: v for k, v in stock["state"].items() if k.endswith("position_weight")}
            ours["state"] = {k: v for k, v in ours["state"].items() if k.endswith("position_weight")}
        _assert_same(stock, ours)


def test_torchrecs_own_fp_sharder_is_swapped_keeping_its_fused_params():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    from tpurec.sharding.dmp import _swap_torchrec_sharders
    from tpurec.sharding.sharder import SparseCoreEBCSharder

    fused = {"learning_rate": 0.05}
    stock = FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))
    (swapped,) = _swap_torchrec_sharders([stock], num_sc=2)
    assert isinstance(swapped, SparseCoreFPEBCSharder)
    assert isinstance(swapped._ebc_sharder, SparseCoreEBCSharder) and swapped.fused_params == fused
    assert swapped.sharding_types("cpu") == SparseCoreEBCSharder().sharding_types("cpu")


@pytest.mark.parametrize("sharding", ["data_parallel", "grid_shard"])
def test_sharding_types_stock_offers_and_sparsecore_does_not_are_refused_by_name(sharding):
    """TorchRec's FP-EBC sharder offers these; tpurec's kernel runs neither (TorchRec would fail
    deep inside with an AttributeError)."""
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import data_parallel, grid_shard

    _ensure_process_group("cpu")
    model = FPModel()
    gen = {"data_parallel": data_parallel, "grid_shard": lambda: grid_shard(host_indexes=[0])}[sharding]
    module_plan = construct_module_sharding_plan(
        model.fp,
        {n: gen() for n, *_ in TABLES},
        sharder=FeatureProcessedEmbeddingBagCollectionSharder(),
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    with pytest.raises(ValueError, match=f"table 't0': sharding_type '{sharding}' is not run by tpurec's SparseCore"):
        tpurec.DistributedModelParallel(model, device="cpu", plan=ShardingPlan({"fp": module_plan}))


def test_tpurec_plan_plans_the_fpebc_as_the_module_dmp_shards():
    """`tpurec plan --model-module` (planner defaults, no sharders given) keys the FP-EBC's tables by
    the FP-EBC's path, as DMP shards it, not by its inner EBC's."""
    from tpurec.planner import model_module
    from tpurec.planner import planners as P
    from tpurec.planner import report as plan_report
    from tpurec.planner.topology import make_topology

    model = FPModel()
    plan = P.plan(model, make_topology("v5p-8"), batch_size=64)
    assert set(plan.plan) == {"fp"}
    assert {ps.compute_kernel for ps in plan.plan["fp"].values()} == {COMPUTE_KERNEL}
    report = plan_report.plan_module(model, model_module.model_tables(model), "v5p-8", batch_size=64, optimizer=None)
    assert report["fits"]
