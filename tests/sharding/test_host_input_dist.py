"""The sharded modules' input distribution runs on the host, whatever device holds the tables."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from tpurec.planner.plan_check import module_plans
from tpurec.planner.planners import plan
from tpurec.planner.topology import make_topology
from tpurec.runtime import host_copies
from tpurec.runtime.device import DeviceKind
from tpurec.sharding.dmp import _ensure_process_group
from tpurec.sharding.ec_sharder import SparseCoreECSharder
from tpurec.sharding.sharder import SparseCoreEBCSharder


def _kjt(keys=("f2", "f0", "f1")):
    # keys out of the tables' order: TorchRec permutes the KJT with an index tensor first
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=torch.tensor([1, 2, 3, 4, 5, 6, 7]), lengths=torch.tensor([1, 2, 1, 1, 1, 1])
    )


def _shard(kind: str, sharding_type: str, device: str = "meta"):
    """A sharded module built for `device`; meta stands for a device that is not the host, as a TPU
    is (an EmbeddingCollection's ShardedTensors cannot be built on meta: it is built on the CPU)."""
    from torchrec.distributed.planner.types import ParameterConstraints

    _ensure_process_group(DeviceKind.CPU)
    config, module_type, sharder = (
        (EmbeddingBagConfig, EmbeddingBagCollection, SparseCoreEBCSharder())
        if kind == "ebc"
        else (EmbeddingConfig, EmbeddingCollection, SparseCoreECSharder())
    )
    tables: list[Any] = [
        config(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"]) for i in range(3)
    ]
    module = module_type(tables=tables, device=torch.device("meta"))
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[sharding_type]) for i in range(3)}
    p = plan(
        module,
        make_topology(None, world_size=1, compute_device="cpu"),
        batch_size=4,
        sharders=[sharder],
        constraints=constraints,
        pg=dist.group.WORLD,
    )
    assert dist.group.WORLD is not None
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return sharder.shard(module, module_plans(p)[""], env, device=torch.device(device))


@pytest.mark.parametrize("sharding_type", [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value])
def test_the_input_distribution_of_a_device_module_stays_on_the_host(sharding_type):
    sharded = _shard("ebc", sharding_type)
    host_copies.reset()
    out = sharded.input_dist(sharded.create_context(), _kjt()).wait().wait()
    # TorchRec allocates the permutation index on the module's device (meta here, a TPU there)
    assert sharded._features_order_tensor.device.type == "cpu"
    for kjt in out:
        assert kjt.values().device.type == "cpu" and kjt.lengths().device.type == "cpu"
    assert sorted(v for kjt in out for v in kjt.values().tolist()) == [1, 2, 3, 4, 5, 6, 7]
    assert host_copies.counts() == {}
    assert sharded._device.type == "meta"  # the module's own device is untouched


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_a_kjt_handed_in_on_the_device_is_copied_to_the_host_once_and_counted(kind):
    sharded = _shard(kind, ShardingType.TABLE_WISE.value, device="cpu")
    host_copies.reset()
    kjt = _kjt()
    host_copies.mark_on_device(kjt.values())  # what a KJT moved to the TPU is
    sharded.input_dist(sharded.create_context(), kjt).wait().wait()
    assert host_copies.counts() == {"ids": 1}
