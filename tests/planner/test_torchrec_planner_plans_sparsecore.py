"""TorchRec's own planner (default estimators) plans tables onto tpurec's SparseCore sharder: stock
DMP and `shard_modules` without a plan, with tpurec's cost model for `customized_kernel` and
TorchRec's figures for its own kernels unchanged (tpurec/planner/stock_estimates.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ShardingOption
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tpurec.planner import sizing
from tpurec.planner.estimators import shard_cost, shard_perf, spec_of
from tpurec.planner.stock_estimates import original_estimate
from tpurec.sharding.dmp import _ensure_process_group
from tpurec.sharding.sharder import SparseCoreEBCSharder

ROWS, DIM, BATCH = 96, 16, 8  # 96 rows: a multiple of 4 SparseCores x 8, so no MOD padding


def _tables(n: int = 2) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(n)
    ]


class _Model(nn.Module):
    """The smallest ranking model: pooled embeddings into one linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=_tables())
        self.top = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.ebc(kjt).values())


def _batch(seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _train_step(model: nn.Module, dense_lr: float = 0.1) -> dict[str, torch.Tensor]:
    """One step: forward, backward (the fused row-wise Adagrad updates the tables), dense SGD."""
    loss = model(_batch(0)).pow(2).sum()
    loss.backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embedding_bags" not in name and p.grad is not None:
                p.sub_(dense_lr * p.grad)
    out = {"loss": loss.detach(), "next_output": model(_batch(1)).detach()}
    for key, value in model.state_dict().items():
        out[key] = value.local_shards()[0].tensor.detach().clone() if hasattr(value, "local_shards") else value
    return out


def _model_with_optimizer() -> _Model:
    torch.manual_seed(0)
    model = _Model()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.05})
    return model


def _start_alike(model: nn.Module) -> None:
    """Both models start from the same tables (state_dict tensors are views of the live tables)."""
    with torch.no_grad():
        for i, (_, value) in enumerate(sorted(model.state_dict().items())):
            if hasattr(value, "local_shards"):
                shard = value.local_shards()[0].tensor
                shard.copy_(torch.linspace(-0.1, 0.1, shard.numel()).view_as(shard) * (i + 1))


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """A one-rank group a test here opened is closed after it: a later test in the process (bench
    kernels' in-process run) checks that the group it opened itself is gone."""
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()


def test_stock_dmp_without_a_plan_plans_the_sparsecore_kernel_and_trains_like_tpurec_dmp():
    _ensure_process_group("cpu")
    unsharded = _model_with_optimizer()
    stock = StockDMP(copy.deepcopy(unsharded), device=torch.device("cpu"), sharders=[SparseCoreEBCSharder()])
    tables = stock.plan.plan["ebc"]
    assert {t: p.compute_kernel for t, p in tables.items()} == {"t0": "customized_kernel", "t1": "customized_kernel"}

    ours = tpurec.DistributedModelParallel(copy.deepcopy(unsharded), device="cpu", plan=stock.plan)
    assert {t: (p.sharding_type, p.ranks) for t, p in ours.plan.plan["ebc"].items()} == {
        t: (p.sharding_type, p.ranks) for t, p in tables.items()
    }
    _start_alike(stock)
    _start_alike(ours)
    start = stock.state_dict()["ebc.embedding_bags.t0.weight"].local_shards()[0].tensor.clone()
    want, got = _train_step(ours), _train_step(stock)
    assert got.keys() == want.keys() and "top.weight" in want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    assert not torch.equal(got["ebc.embedding_bags.t0.weight"], start)  # the step did update the table


def _enumerate(module: nn.Module, sharders: list, world_size: int = 1) -> tuple[Topology, list[ShardingOption]]:
    """The sharding options TorchRec's planner rates, with its default perf and storage estimators."""
    topology = Topology(world_size=world_size, compute_device="cpu")
    return topology, EmbeddingEnumerator(topology=topology, batch_size=BATCH).enumerate(module, sharders)


@pytest.mark.parametrize(
    "optimizer,name,state_bytes",
    [(RowWiseAdagrad, "rowwise_adagrad", ROWS * 4), (torch.optim.Adam, "adam", 2 * ROWS * DIM * 4), (None, "sgd", 0)],
)
def test_storage_estimate_is_tpurecs_table_plus_optimizer_state(optimizer, name, state_bytes):
    """TorchRec's default storage estimator charges a shard what tpurec's planner charges it: the
    table and the state its fused optimizer keeps (none set: SGD, no state), plus the SparseCore
    buffers and activations; its perf estimate is tpurec's too."""
    ebc = EmbeddingBagCollection(tables=_tables(1), device=torch.device("meta"))
    if optimizer is not None:
        apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.05})
    topology, options = _enumerate(ebc, [SparseCoreEBCSharder()], world_size=2)
    assert options and {o.compute_kernel for o in options} == {"customized_kernel"}
    (shard,) = next(o for o in options if o.sharding_type == "table_wise").shards
    cost = shard_cost(
        sharding_type="table_wise",
        rows=ROWS,
        cols=DIM,
        pooling_factor=1.0,
        batch_per_device=BATCH,
        world_size=2,
        num_shards=1,
        spec=spec_of(topology),
        optimizer=name,
    )
    assert (shard.storage.ddr, shard.storage.hbm) == (cost.bytes, 0)
    # tpurec's sizing of the table and its optimizer state (x2 there: a TPU's transient new copies)
    assert cost.weights + cost.optimizer == sizing.memory_lower_bound(ebc, name) // 2
    assert (cost.weights, cost.optimizer) == (ROWS * DIM * 4, state_bytes)
    assert shard.perf == shard_perf(cost)


def test_torchrecs_own_kernels_get_torchrecs_own_estimates_beside_ours():
    """One estimate call over TorchRec's own options and ours: TorchRec's get exactly what its
    unwrapped estimators give them; ours get tpurec's."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    def meta_ebc() -> EmbeddingBagCollection:
        ebc = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
        return ebc

    stock_sharder = EmbeddingBagCollectionSharder()
    topology, stock_options = _enumerate(meta_ebc(), [stock_sharder], world_size=2)
    _, our_options = _enumerate(meta_ebc(), [SparseCoreEBCSharder()], world_size=2)
    assert stock_options and "customized_kernel" not in {o.compute_kernel for o in stock_options}
    data = build_sharder_data_map({sharder_name(EmbeddingBagCollection): stock_sharder})
    perf, storage = EmbeddingPerfEstimator(topology=topology), EmbeddingStorageEstimator(topology=topology)

    def estimates(options) -> list:
        out = [(s.perf, s.storage) for o in options for s in o.shards]
        for o in options:
            for s in o.shards:
                s.perf = s.storage = None
        return out

    original_estimate(EmbeddingPerfEstimator)(perf, stock_options, sharder_data_map=data)
    original_estimate(EmbeddingStorageEstimator)(storage, stock_options, sharder_data_map=data)
    want = estimates(stock_options)
    ours_before = estimates(our_options)
    perf.estimate(stock_options + our_options, sharder_data_map=data)
    storage.estimate(stock_options + our_options, sharder_data_map=data)
    assert estimates(stock_options) == want
    assert estimates(our_options) == ours_before  # the same figures as during enumeration


def test_shard_modules_without_a_plan_plans_and_shards_onto_the_sparsecore_kernel(monkeypatch):
    """TorchRec's composable API plans with its own planner, the plan picks our kernel, and the
    module comes back sharded onto it with the unsharded module's parameter FQNs (the composable
    contract's check; tests/sharding/test_named_parameters.py trains through it)."""
    from torchrec.distributed import shard as shard_module

    from tpurec.sharding.sharder import ShardedSparseCoreEBC

    _ensure_process_group("cpu")
    plans = []
    original = EmbeddingShardingPlanner.collective_plan

    def recording(self, *args, **kwargs):
        plans.append(original(self, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(EmbeddingShardingPlanner, "collective_plan", recording)
    model = _Model()
    model.ebc = EmbeddingBagCollection(tables=_tables(), device=torch.device("meta"))
    names = [n for n, _ in model.named_parameters()]
    sharded = shard_module.shard_modules(model, device=torch.device("cpu"), sharders=[SparseCoreEBCSharder()])
    assert len(plans) == 1
    assert {p.compute_kernel for p in plans[0].plan["ebc"].values()} == {"customized_kernel"}
    assert isinstance(sharded.ebc, ShardedSparseCoreEBC)
    assert [n for n, _ in sharded.named_parameters()] == names
