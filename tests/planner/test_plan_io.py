import json

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
)

from tests.planner.conftest import ebc_for
from tpurec.planner import plan_io
from tpurec.planner import planners as P
from tpurec.planner.topology import make_topology


def _tpu_plan():
    return P.plan(ebc_for("dlrm-tiny"), make_topology("v5p-8"), batch_size=64, optimizer="rowwise_adagrad")


def test_round_trip_equal(tmp_path):
    plan = _tpu_plan()
    path = tmp_path / "plan.json"
    plan_io.save_plan(plan, path, meta={"note": "x"})
    loaded = plan_io.load_plan(path)
    assert loaded.plan.keys() == plan.plan.keys()
    for name, ps in plan.plan[""].items():
        assert loaded.plan[""][name] == ps  # dataclass equality incl. ShardMetadata and placements
    assert isinstance(loaded.plan[""], EmbeddingModuleShardingPlan)
    assert plan_io.plan_to_dict(loaded) == plan_io.plan_to_dict(plan)
    assert plan_io.load_meta(path) == {"note": "x"}
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == ("tpurec-sharding-plan", 1)


def test_round_trip_all_fields(tmp_path):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.types import DataType

    spec = EnumerableShardingSpec(
        [ShardMetadata([0, 0], [5, 8], "rank:0/cpu"), ShardMetadata([5, 0], [5, 8], "rank:1/cpu")]
    )
    plan = ShardingPlan(
        {
            "sparse.ebc": EmbeddingModuleShardingPlan(
                {
                    "a": ParameterSharding(
                        "row_wise",
                        "customized_kernel",
                        [0, 1],
                        spec,
                        enforce_hbm=True,
                        stochastic_rounding=False,
                        bounds_check_mode=BoundsCheckMode.WARNING,
                        output_dtype=DataType.FP16,
                    ),
                    "b": ParameterSharding("data_parallel", "dense", None, None),
                }
            )
        }
    )
    plan_io.save_plan(plan, tmp_path / "p.json")
    loaded = plan_io.load_plan(tmp_path / "p.json")
    assert loaded.plan["sparse.ebc"]["a"] == plan.plan["sparse.ebc"]["a"]
    assert loaded.plan["sparse.ebc"]["b"] == plan.plan["sparse.ebc"]["b"]


def test_rejects_other_documents(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "something", "version": 1}')
    with pytest.raises(ValueError, match="not a tpurec sharding plan"):
        plan_io.load_plan(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"format": "tpurec-sharding-plan", "version": 99, "modules": {}}')
    with pytest.raises(ValueError, match="version 99"):
        plan_io.load_plan(tmp_path / "y.json")


def test_loaded_plan_shards_model_identically(tmp_path):
    """A loaded plan drives torchrec's DMP to the same sharded model (CPU, 1 rank, fused kernel)."""

    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from tpurec.data.catalog import get_table_set
    from tpurec.dlrm.model import embedding_bag_configs

    # A file rendezvous: no port to collide with other jobs on the host, no environment left behind.
    # An earlier in-process tpurec.DistributedModelParallel may have left its one-rank group (it does
    # not tear down a group the user may go on using); reuse that one.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        configs = embedding_bag_configs(get_table_set("dlrm-tiny"))[:4]
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), debug=False).plan(
            EmbeddingBagCollection(tables=configs, device=torch.device("meta")), [EmbeddingBagCollectionSharder()]
        )
        plan_io.save_plan(plan, tmp_path / "p.json")
        loaded = plan_io.load_plan(tmp_path / "p.json")

        def shard(p):
            torch.manual_seed(0)
            ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
            return DistributedModelParallel(
                ebc, device=torch.device("cpu"), plan=p, sharders=[EmbeddingBagCollectionSharder()]
            )

        a, b = shard(plan), shard(loaded)
        assert a.plan.plan == b.plan.plan
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            ta, tb = sa[k], sb[k]
            ta = ta.local_shards()[0].tensor if hasattr(ta, "local_shards") else ta
            tb = tb.local_shards()[0].tensor if hasattr(tb, "local_shards") else tb
            assert torch.equal(ta, tb), k
    finally:
        if owned:
            dist.destroy_process_group()
