"""Weight decay in fused params under tpurec.DistributedModelParallel trains as stock TorchRec's DMP
(FBGEMM's fused CPU kernel) does with the same fused params: row-wise Adagrad's L2 and DECOUPLE.

Each table is read by two features: FBGEMM's CPU row-wise Adagrad applies weight decay only on its
generic path, which a table shared by features takes (its FP32 single-feature fast path drops the
decay; tests/embedding/test_weight_decay.py). Adam has no FBGEMM CPU kernel: under DMP it is checked
against the standalone module, itself checked against torch's AdamW.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad

from tests.sharding.multiprocess import run_ranks

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}a", f"f{i}b"])
    for i in range(2)
]
KEYS = [f for t in TABLES for f in t.feature_names]
STEPS = 4


def _batches(rank: int):
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(KEYS) * 8,), generator=gen)
        values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
        out.append(KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths))
    return out


def _start(model) -> None:
    """The same tables for both (stock re-initialises the tables it shards)."""
    with torch.no_grad():
        for i, (_, value) in enumerate(sorted(model.state_dict().items())):
            for shard in value.local_shards():
                t = shard.tensor
                t.copy_(torch.linspace(-0.5, 0.5, t.numel()).view_as(t) * (i + 1))


def train(rank, world_size, dmp: str, optimizer, kwargs) -> dict:
    """dmp "stock" / "tpurec" over an EBC with `optimizer(**kwargs)` in backward, table-wise; or
    "standalone": tpurec's unsharded module. Returns this rank's tables after STEPS steps."""
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import tpurec
    from tpurec.embedding.module import SparseCoreEmbeddingBagCollection

    model: Any  # a standalone SparseCore module or a DMP
    if dmp == "standalone":
        model = SparseCoreEmbeddingBagCollection(TABLES, optimizer, kwargs, num_sparsecores=4)
        with torch.no_grad():
            for i, t in enumerate(TABLES):
                w = model.table_weight(t.name)
                w.copy_(torch.linspace(-0.5, 0.5, w.numel()).view_as(w) * (i + 1))
    else:
        ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
        # (not deep-copied after this: a copy's parameters lose their in-backward optimizer)
        apply_optimizer_in_backward(optimizer, ebc.parameters(), dict(kwargs))
        # Table-wise, table i on rank i mod world: stock on FBGEMM's fused kernel, tpurec on SparseCore's.
        kernel = "fused" if dmp == "stock" else "customized_kernel"
        per_table = {t.name: table_wise(rank=i % world_size, compute_kernel=kernel) for i, t in enumerate(TABLES)}
        plan = ShardingPlan({"": construct_module_sharding_plan(ebc, per_table)})
        cls = StockDMP if dmp == "stock" else tpurec.DistributedModelParallel
        model = cls(ebc, device=torch.device("cpu"), plan=plan)
        ours = [m for m in model.modules() if type(m).__name__ == "ShardedSparseCoreEBC"]
        assert bool(ours) == (dmp == "tpurec")
        _start(model)
    for kjt in _batches(rank):
        pooled = model(kjt).to_dict()  # by feature: sharded and unsharded may order columns apart
        loss = sum((pooled[f] * torch.linspace(-1.0, 1.0, pooled[f].numel()).view_as(pooled[f])).sum() for f in KEYS)
        loss.backward()
    if dmp == "standalone":
        return {f"embedding_bags.{t.name}.weight": model.table_weight(t.name).clone() for t in TABLES}
    return {k: s.tensor.clone() for k, v in model.state_dict().items() for s in v.local_shards()}


def _one_rank(dmp, optimizer, kwargs):
    from tpurec.sharding.dmp import _ensure_process_group

    _ensure_process_group("cpu")
    torch.manual_seed(0)
    return train(0, 1, dmp, optimizer, kwargs)


def _assert_tables_equal(ours: dict, want: dict) -> None:
    assert ours.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(ours[name], w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", [WeightDecayMode.L2, WeightDecayMode.DECOUPLE])
def test_rowwise_adagrad_weight_decay_trains_as_stock_torchrec(mode):
    kwargs = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01, "weight_decay_mode": mode}
    stock = _one_rank("stock", RowWiseAdagrad, kwargs)
    ours = _one_rank("tpurec", RowWiseAdagrad, kwargs)
    _assert_tables_equal(ours, stock)
    _assert_tables_equal(_one_rank("standalone", RowWiseAdagrad, kwargs), stock)
    plain = _one_rank("stock", RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8})
    assert max(float((plain[k] - stock[k]).abs().max()) for k in stock) > 1e-5, "stock applied no decay"


def test_adam_weight_decay_under_dmp_equals_the_standalone_module():
    kwargs = {"lr": 0.05, "weight_decay": 0.01}
    ours = _one_rank("tpurec", torch.optim.Adam, kwargs)
    _assert_tables_equal(ours, _one_rank("standalone", torch.optim.Adam, kwargs))
    plain = _one_rank("tpurec", torch.optim.Adam, {"lr": 0.05})
    assert max(float((plain[k] - ours[k]).abs().max()) for k in ours) > 1e-5


@pytest.mark.slow  # 45-75 s: two launches of two ranks each
@pytest.mark.multiprocess
def test_rowwise_adagrad_l2_at_two_ranks_trains_as_stock_torchrec():
    kwargs = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.L2}
    stock = run_ranks(train, 2, "stock", RowWiseAdagrad, kwargs)
    ours = run_ranks(train, 2, "tpurec", RowWiseAdagrad, kwargs)
    for o, s in zip(ours, stock):
        _assert_tables_equal(o, s)


def test_ec_rowwise_adagrad_l2_trains_as_stock_torchrec():
    """An EmbeddingCollection (FBGEMM's unpooled kernel, whose CPU update is its generic one) with
    L2 weight decay: tpurec's EC sharder vs TorchRec's, table-wise at 1 rank, tables after 3 steps."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from tests.sharding import ec_cases
    from tpurec.sharding.dmp import _ensure_process_group

    _ensure_process_group("cpu")
    torch.manual_seed(0)
    init = EmbeddingCollection(tables=ec_cases.tables()).state_dict()
    result = ec_cases.run_case(0, 1, "table_wise", "rowwise_adagrad_l2", init, 3, True)
    plain = ec_cases.run_case(0, 1, "table_wise", "rowwise_adagrad", init, 3, False)
    for key, want in result["stock_tables"].items():
        torch.testing.assert_close(result["tables"][key], want, rtol=1e-5, atol=1e-7)
        assert (plain["tables"][key] - want).abs().max() > 1e-4, "no decay applied"
