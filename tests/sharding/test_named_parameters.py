"""`named_parameters()` of a model sharded onto tpurec's kernel lists the tables as stock TorchRec's
DMP on FBGEMM's fused kernel does (names, shapes, counts, the in-backward marking, no `.grad`), over
the live tables; and TorchRec's composable API (`shard_modules`, `shard`), which refuses a sharder
that changes parameter FQNs, shards onto tpurec's kernel and trains as tpurec's DMP does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.distributed.shard import shard, shard_modules
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

import tpurec
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.dmp import _ensure_process_group
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.sharded_optimizer import ShardedSparseCoreOptimizer
from tpurec.sharding.sharder import SparseCoreEBCSharder

DIM, BATCH = 16, 8
KEY = "ebc.embedding_bags.t0.weight"
# Per sharding: a ParameterShardingGenerator taking the compute kernel (one rank, one process).
SHARDINGS = {
    "table_wise": lambda kernel: table_wise(rank=0, compute_kernel=kernel),
    "column_wise": lambda kernel: column_wise(ranks=[0, 0], compute_kernel=kernel),
    "row_wise": lambda kernel: row_wise(compute_kernel=kernel),
}


def _tables(rows: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(2)
    ]


class _Model(nn.Module):
    """Pooled embeddings into one linear layer."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=_tables(rows))
        self.top = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.ebc(kjt).values())


def _model(rows: int = 96) -> _Model:
    """The same model every call (built anew: deepcopy would drop apply_optimizer_in_backward's marks)."""
    torch.manual_seed(0)
    model = _Model(rows)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.05})
    return model


def _plan(model: _Model, sharding: str, kernel: str) -> ShardingPlan:
    per_table = {t.name: SHARDINGS[sharding](kernel) for t in model.ebc.embedding_bag_configs()}
    return ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, per_table)})


def _sharded(dmp_class, sharding: str, rows: int = 96) -> nn.Module:
    """Stock TorchRec's DMP on FBGEMM's fused kernel, or tpurec's on its own, with the same plan."""
    _ensure_process_group(DeviceKind.CPU)
    model = _model(rows)
    kernel = "fused" if dmp_class is StockDMP else "customized_kernel"
    return dmp_class(model, device=torch.device("cpu"), plan=_plan(model, sharding, kernel))


def _batch(seed: int, rows: int = 96) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)


def _described(model: nn.Module) -> list[tuple]:
    """What a user sees of each parameter: name, shape, dtype, trainable, fused, gradient."""
    return [
        (n, tuple(p.shape), p.dtype, p.requires_grad, hasattr(p, "_in_backward_optimizers"), p.grad)
        for n, p in model.named_parameters()
    ]


def _step(model: nn.Module, seed: int = 0) -> None:
    model(_batch(seed)).pow(2).sum().backward()


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_named_parameters_list_the_tables_as_stock_torchrec(sharding):
    stock, ours = _sharded(StockDMP, sharding), _sharded(tpurec.DistributedModelParallel, sharding)
    _step(stock)
    _step(ours)  # a step: fused tables still have no .grad, dense ones have theirs
    want = _described(stock)
    assert [d[0] for d in want] == [KEY, "ebc.embedding_bags.t1.weight", "top.weight", "top.bias"]
    assert [d[:-1] for d in _described(ours)] == [d[:-1] for d in want]  # column-wise: [2 x 96, 8] as stock
    assert [d[-1] is None for d in _described(ours)] == [d[-1] is None for d in want] == [True, True, False, False]
    count = sum(p.numel() for p in stock.parameters())
    assert sum(p.numel() for p in ours.parameters()) == count == 2 * 96 * DIM + 2 * DIM + 1


def _local_shards(model: nn.Module, key: str = KEY) -> list[torch.Tensor]:
    return [s.tensor for s in model.state_dict()[key].local_shards()]


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_table_parameters_are_the_live_tables(sharding):
    model = _sharded(tpurec.DistributedModelParallel, sharding)
    param = dict(model.named_parameters())[KEY]
    (shard,) = _local_shards(model)
    assert param.data_ptr() == shard.data_ptr() and param.shape == shard.shape

    rows = torch.arange(96 * DIM, dtype=torch.float32).view(96, DIM) / 1000
    with torch.no_grad():
        param.copy_(rows)  # written through the parameter ...
    assert torch.equal(_local_shards(model)[0], rows)  # ... it is in state_dict ...
    one_id = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([5, 7]), lengths=torch.tensor([1, 0, 0, 1]))
    pooled = model.module.ebc(one_id).to_dict()["f0"]
    assert torch.equal(pooled[0], rows[5])  # ... and in the lookup

    before = param.detach().clone()
    _step(model)
    assert param.grad is None
    assert not torch.equal(param, before)  # the fused update shows in the parameter
    assert torch.equal(param, _local_shards(model)[0])


def test_column_shards_behind_padding_are_one_parameter_over_the_live_shards():
    """50 rows: the kernel pads each column shard's rows to its SparseCore partitions, so the two
    shards are not end to end as stock TorchRec's [2 x 50, 8]; the parameter is [2, 50, 8] over
    them, with stock's element count."""
    stock, ours = (
        _sharded(StockDMP, "column_wise", rows=50),
        _sharded(tpurec.DistributedModelParallel, "column_wise", 50),
    )
    want = dict(stock.named_parameters())[KEY]
    param = dict(ours.named_parameters())[KEY]
    assert tuple(want.shape) == (100, 8) and tuple(param.shape) == (2, 50, 8) and param.numel() == want.numel()
    with torch.no_grad():
        param.copy_(torch.linspace(-1, 1, param.numel()).view_as(param))
    shards = _local_shards(ours)
    assert [tuple(s.shape) for s in shards] == [(50, 8), (50, 8)]
    for j, s in enumerate(shards):
        assert torch.equal(param[j], s)


def test_in_backward_optimizer_filter_leaves_the_tables_out_and_dense_optimizers_leave_them_alone():
    """TorchRec's filter (what its examples build the dense optimizer from) keeps the tables out, as
    for stock; a dense optimizer over all of `parameters()` (the common mistake) updates the same
    tables as one over the filtered ones, since the tables never have a gradient."""
    stock = _sharded(StockDMP, "table_wise")
    want = [n for n, _ in in_backward_optimizer_filter(stock.named_parameters())]
    results = []
    for everything in (False, True):
        model = _sharded(tpurec.DistributedModelParallel, "table_wise")
        named = model.named_parameters() if everything else in_backward_optimizer_filter(model.named_parameters())
        params = dict(named)
        assert list(params) == (want if not everything else [KEY, "ebc.embedding_bags.t1.weight", *want])
        dense = torch.optim.Adagrad(params.values(), lr=0.5, weight_decay=0.1)
        for seed in range(2):
            _step(model, seed)
            dense.step()
            dense.zero_grad()
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    # The mark names the fused optimizer that updates the table, as stock's names its own.
    (optimizer,) = dict(model.named_parameters())[KEY]._in_backward_optimizers
    # the group's lr as stock's shows it: float32's value read back (test_lr_schedule_dmp.py)
    assert isinstance(optimizer, ShardedSparseCoreOptimizer)
    assert list(optimizer.param_groups)[0]["lr"] == float(np.float32(0.05))


def test_ddp_leaves_the_tables_out():
    """DMP's DDP wrap ignores every parameter of a sharded module: the tables are never all-reduced."""
    model = _sharded(tpurec.DistributedModelParallel, "table_wise")
    ddp = model._dmp_wrapped_module
    assert {KEY, "ebc.embedding_bags.t1.weight"} <= set(ddp.parameters_to_ignore)
    assert not {"top.weight", "top.bias"} & set(ddp.parameters_to_ignore)


def test_embedding_collection_parameters_as_stock():
    """The sharded EmbeddingCollection: `embeddings.<table>.weight`, as stock's."""
    tables = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=96, feature_names=[f"f{i}"]) for i in (0, 1)
    ]
    described = []
    for dmp_class, kernel in ((StockDMP, "fused"), (tpurec.DistributedModelParallel, "customized_kernel")):
        _ensure_process_group(DeviceKind.CPU)
        ec = EmbeddingCollection(tables=tables)
        apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.05})
        plan = ShardingPlan(
            {
                "": construct_module_sharding_plan(
                    ec, {t.name: table_wise(rank=0, compute_kernel=kernel) for t in tables}
                )
            }
        )
        described.append(_described(dmp_class(ec, device=torch.device("cpu"), plan=plan)))
    assert described[1] == described[0] and [d[0] for d in described[0]] == [
        "embeddings.t0.weight",
        "embeddings.t1.weight",
    ]


def _trained(model: nn.Module) -> dict[str, torch.Tensor]:
    """One step (fused row-wise Adagrad in backward, dense SGD on the filtered parameters), then the
    loss, the next output and every state_dict tensor (local shards)."""
    dense = torch.optim.SGD(dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.1)
    loss = model(_batch(0)).pow(2).sum()
    loss.backward()
    dense.step()
    out = {"loss": loss.detach(), "next_output": model(_batch(1)).detach()}
    for key, value in model.state_dict().items():
        out[key] = value.local_shards()[0].tensor.clone() if hasattr(value, "local_shards") else value.clone()
    return out


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_shard_modules_trains_as_tpurec_dmp(sharding):
    _ensure_process_group(DeviceKind.CPU)
    model = _model()
    plan = _plan(model, sharding, "customized_kernel")
    composable = shard_modules(model, device=torch.device("cpu"), plan=plan, sharders=[SparseCoreEBCSharder()])
    assert [d[:-1] for d in _described(composable)] == [d[:-1] for d in _described(_sharded(StockDMP, sharding))]
    ours = tpurec.DistributedModelParallel(_model(), device="cpu", plan=plan)
    want, got = _trained(ours), _trained(composable)
    assert got.keys() == want.keys() and KEY in want and "top.weight" in want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_shard_one_module_trains_as_tpurec_dmp():
    """`shard(ebc, plan, sharder=...)`: the module itself becomes the sharded one."""
    _ensure_process_group(DeviceKind.CPU)
    ebcs = []
    for _ in range(2):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=_tables(96))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
        ebcs.append(ebc)

    def per_table() -> dict:  # a new dict each time: `shard` replaces its generators by their results
        return {t.name: table_wise(rank=0, compute_kernel="customized_kernel") for t in _tables(96)}

    composable = shard(ebcs[0], per_table(), device=torch.device("cpu"), sharder=SparseCoreEBCSharder())
    assert [n for n, _ in composable.named_parameters()] == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    ours = tpurec.DistributedModelParallel(
        ebcs[1], device="cpu", plan=ShardingPlan({"": construct_module_sharding_plan(ebcs[1], per_table())})
    )
    outputs = []
    for model in (ours, composable):
        out = model(_batch(0)).values()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append((out.detach(), model(_batch(1)).values().detach()))
        outputs.append({k: v.local_shards()[0].tensor.clone() for k, v in model.state_dict().items()})
    assert outputs[0][0].shape == (BATCH, 2 * DIM)
    torch.testing.assert_close(outputs[2], outputs[0], rtol=0, atol=0)
    assert outputs[3].keys() == {"embedding_bags.t0.weight", "embedding_bags.t1.weight"}
    torch.testing.assert_close(outputs[3], outputs[1], rtol=0, atol=0)


def test_shard_modules_of_an_embedding_collection():
    _ensure_process_group(DeviceKind.CPU)
    tables = [EmbeddingConfig(name="t0", embedding_dim=DIM, num_embeddings=96, feature_names=["f0"])]

    class WithEC(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=tables)

    model = WithEC()
    plan = ShardingPlan(
        {"ec": construct_module_sharding_plan(model.ec, {"t0": table_wise(rank=0, compute_kernel="customized_kernel")})}
    )
    sharded = shard_modules(model, device=torch.device("cpu"), plan=plan, sharders=[SparseCoreECSharder()])
    assert [(n, tuple(p.shape)) for n, p in sharded.named_parameters()] == [("ec.embeddings.t0.weight", (96, DIM))]


class _ShardedStandIn(nn.Module):
    """What `table_params.publish` reads of a sharded module: tables, this rank's shards, slots."""

    STATE_PREFIX = "embedding_bags"

    def __init__(self, shards: list[tuple[str, torch.Tensor]], tables: list[str]) -> None:
        super().__init__()
        self._sc_tables, self._device, self._shards = tables, torch.device("cpu"), shards
        self.embedding_bags = nn.ModuleDict({t: nn.Module() for t in tables})

    def _sc_shards(self):
        for table, view in self._shards:  # (table, kernel name, metadata, kernel module)
            yield table, table, None, SimpleNamespace(kernel=SimpleNamespace(read_weight=lambda name, v=view: v))


def test_a_table_without_a_shard_here_is_stocks_empty_parameter():
    """As TorchRec registers it for a rank holding none of a table (embeddingbag.py,
    `_initialize_torch_state`): an empty parameter marked with an EmptyFusedOptimizer."""
    from torchrec.optim.fused import EmptyFusedOptimizer

    from tpurec.sharding import table_params

    module = _ShardedStandIn([("t0", torch.zeros(4, 2))], ["t0", "t1"])
    table_params.publish(module, lambda table: ["the fused optimizer"])
    params = dict(module.named_parameters())
    assert params["embedding_bags.t0.weight"]._in_backward_optimizers == ["the fused optimizer"]
    empty = params["embedding_bags.t1.weight"]
    assert empty.shape == (0,) and isinstance(empty._in_backward_optimizers[0], EmptyFusedOptimizer)


def test_shards_in_different_storages_are_a_copy_said_in_a_warning(caplog):
    from tpurec.sharding import table_params

    first, second = torch.ones(3, 2), torch.full((3, 4), 2.0)  # column shards of different widths
    module = _ShardedStandIn([("t0", first), ("t0", second)], ["t0"])
    with caplog.at_level("WARNING", logger="tpurec.sharding.table_params"):
        table_params.publish(module, lambda table: [])
    (param,) = module.parameters()
    assert torch.equal(param, torch.cat([first.reshape(-1), second.reshape(-1)]))
    assert "table 't0': its 2 shards on this rank do not lie evenly in one storage" in caplog.text


def test_feature_processed_collection_parameters_as_stock():
    """Position weights stay dense (no mark: DDP all-reduces them); the tables are marked, as stock's."""
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    described = []
    for dmp_class, kernel in ((StockDMP, "fused"), (tpurec.DistributedModelParallel, "customized_kernel")):
        _ensure_process_group(DeviceKind.CPU)
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=_tables(96), is_weighted=True)
        fp = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"f0": 4, "f1": 4}))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
        per_table = {t.name: table_wise(rank=0, compute_kernel=kernel) for t in _tables(96)}
        plan = ShardingPlan(
            {"": construct_module_sharding_plan(fp, per_table, sharder=FeatureProcessedEmbeddingBagCollectionSharder())}
        )
        described.append(_described(dmp_class(fp, device=torch.device("cpu"), plan=plan)))
    assert described[1] == described[0]
    assert [(d[0], d[4]) for d in described[0]] == [
        ("_embedding_bag_collection.embedding_bags.t0.weight", True),
        ("_embedding_bag_collection.embedding_bags.t1.weight", True),
        ("_feature_processors.position_weights.f0", False),
        ("_feature_processors.position_weights.f1", False),
    ]
