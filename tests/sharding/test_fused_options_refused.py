"""Optimizer options the fused update cannot honour are refused by name under DMP, never dropped
(weight decay FBGEMM applies is honoured: tests/sharding/test_weight_decay_dmp.py)."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec


@pytest.mark.parametrize(
    "optimizer, kwargs, option",
    [
        (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}, "amsgrad=True"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9"),
        (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 1e-4}, "weight_decay=0.0001 with weight_decay_mode NONE"),
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 1e-4}, "weight_decay=0.0001"),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.5}, "lr_decay=0.5"),
    ],
)
def test_an_option_the_fused_update_cannot_honour_is_refused_by_name(optimizer, kwargs, option):
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(optimizer, ebc.parameters(), kwargs)
    with pytest.raises(ValueError, match=rf"table 't0': .*{option} is not supported .*refused, not ignored"):
        tpurec.DistributedModelParallel(ebc, device="cpu")


@pytest.mark.parametrize("name", ["SGD", "ROWWISE_ADAGRAD"])
def test_a_deprecated_fbgemm_optimizer_is_refused_as_stock_torchrec_refuses_it(name):
    """EmbOptimType.SGD / ROWWISE_ADAGRAD in the sharder's fused params: FBGEMM's TBE asserts they are
    deprecated, so stock TorchRec's DMP fails; tpurec's refuses them too (it trained them silently),
    in one line naming the table and the EXACT_ optimizer to use."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel as StockDMP
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from tpurec.errors import UserError
    from tpurec.runtime.device import DeviceKind
    from tpurec.sharding.dmp import _ensure_process_group

    _ensure_process_group(DeviceKind.CPU)

    def model():
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])],
            device=torch.device("meta"),
        )

    def sharder():
        return EmbeddingBagCollectionSharder(
            fused_params={"optimizer": getattr(EmbOptimType, name), "learning_rate": 0.1}
        )

    # stock: on its fused kernel (FBGEMM's TBE), which its planner picks for tables this size on GPUs
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={"t0": ParameterConstraints(compute_kernels=["fused"])},
    )
    stock = model()
    plan = planner.collective_plan(stock, [sharder()])
    with pytest.raises(AssertionError, match="deprecated in the CPU \\+ GPU modes"):
        StockDMP(stock, device=torch.device("cpu"), sharders=[sharder()], plan=plan)
    with pytest.raises(UserError) as e:
        tpurec.DistributedModelParallel(model(), device="cpu", sharders=[sharder()])
    assert str(e.value) == (
        f"table 't0': optimizer EmbOptimType.{name} is deprecated in FBGEMM (TorchRec's fused kernel refuses it "
        f"too); use EmbOptimType.EXACT_{name}"
    )
