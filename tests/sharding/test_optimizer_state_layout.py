"""The fused optimizer's state layout under DMP is stock TorchRec's, where TorchRec's tools read it
(DCP, KeyedOptimizer / CombinedOptimizer state_dict, `model.fused_optimizer`): the same optimizers
by name, parameter keys, state keys, ShardedTensor global sizes and each local shard's offsets and
sizes, param-group entries; row-wise Adagrad's momentum1 1-D, column shard k at offset k x rows.

Intended difference, kept: Adam adds "<table>.step" (its bias correction's step count, so that a
resumed run continues it; stock TorchRec's fused Adam keeps its iteration count in FBGEMM's module,
outside the optimizer's state_dict). Stock cannot run Adam on CPU (FBGEMM: "Optimizer adam is not
supported in CPU mode"), so its layout is written out from TorchRec's rule below.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.dmp import _ensure_process_group

TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=40, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=24, feature_names=["f1"]),
]
SHARDINGS = {
    "table_wise": lambda kernel: table_wise(rank=0, compute_kernel=kernel),
    "column_wise": lambda kernel: column_wise(ranks=[0, 0], compute_kernel=kernel),  # two shards on the rank
    "row_wise": lambda kernel: row_wise(compute_kernel=kernel),
}


def _model(stock: bool, optimizer, sharding: str):
    _ensure_process_group(DeviceKind.CPU)
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": 0.1})
    kernel = "fused" if stock else "customized_kernel"
    plan = ShardingPlan(
        {"": construct_module_sharding_plan(ebc, {t.name: SHARDINGS[sharding](kernel) for t in TABLES})}
    )
    return (StockDMP if stock else tpurec.DistributedModelParallel)(ebc, device=torch.device("cpu"), plan=plan)


def _layout(model) -> dict:
    """Everything of `model.fused_optimizer` a TorchRec tool keys on, values left out."""
    opt = model.fused_optimizer
    sd = opt.state_dict()
    state = {}
    for param, entries in sd["state"].items():
        for key, v in entries.items():
            shards = None  # a plain tensor (Adam's step count)
            if hasattr(v, "local_shards"):
                shards = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in v.local_shards()]
            state[(param, key)] = (type(v).__name__, tuple(v.size()), v.dtype, shards)
    return {
        "type": type(opt).__name__,
        "optimizers": [name for name, _ in opt.optimizers],
        "params": list(opt.params),
        "state_dict": sorted(sd),
        "state": state,
        "param_groups": [sorted(k for k in g if k != "params") for g in opt.param_groups],
    }


@pytest.mark.parametrize("sharding", list(SHARDINGS))
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad, RowWiseAdagrad])
def test_fused_optimizer_state_layout_is_stock_torchrecs(optimizer, sharding):
    stock = _layout(_model(True, optimizer, sharding))
    ours = _layout(_model(False, optimizer, sharding))
    assert ours == stock
    if optimizer is not torch.optim.SGD:  # the check compares something
        assert len(stock["state"]) == len(TABLES)


def test_adam_state_layout_is_torchrecs_plus_the_step_count():
    """TorchRec names FBGEMM's Adam states (get_optimizer_state: exp_avg, exp_avg_sq) by its rule
    (torchrec/distributed/batched_embedding_kernel.py): the first "momentum1" (backward
    compatibility), the others by FBGEMM's key; both pointwise, shaped as the table's shard."""
    ours = _layout(_model(False, torch.optim.Adam, "column_wise"))
    for t in TABLES:
        param = f"embedding_bags.{t.name}.weight"
        half = t.embedding_dim // 2
        pointwise = ("ShardedTensor", (t.num_embeddings, t.embedding_dim), torch.float32)
        shards = [((0, 0), (t.num_embeddings, half)), ((0, half), (t.num_embeddings, half))]
        for key in ("momentum1", "exp_avg_sq"):
            assert ours["state"][(param, f"{t.name}.{key}")] == (*pointwise, shards)
        # the intended extra: the step count, one scalar per table
        assert ours["state"][(param, f"{t.name}.step")] == ("Tensor", (), torch.float32, None)
    assert len(ours["state"]) == 3 * len(TABLES)
