"""A plan is checked against the model and world size it is applied to, with one-line errors, and
its module paths follow the tables (a `tpurec plan` file is keyed "")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tpurec.planner import plan_io
from tpurec.planner.plan_check import align_to_model, check_plan, embedding_tables
from tpurec.planner.topology import make_topology

K = "customized_kernel"


def _model():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name="a", embedding_dim=16, num_embeddings=100, feature_names=["fa"]),
                    EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=40, feature_names=["fb"]),
                ],
                device=torch.device("meta"),
            )

    return Model()


def _plan(a_shards=(([0, 0], [100, 16], 0),), b_type="table_wise", b_rank=1, path=""):
    make_topology("v6e-4")  # names the tpu backend so placements parse
    spec = lambda shards: EnumerableShardingSpec(  # noqa: E731
        [ShardMetadata(o, s, f"rank:{r}/tpu:{r}") for o, s, r in shards]
    )
    return ShardingPlan(
        {
            path: EmbeddingModuleShardingPlan(
                {
                    "a": ParameterSharding("table_wise", K, [a_shards[0][2]], spec(a_shards)),
                    "b": ParameterSharding(b_type, K, [b_rank], spec([([0, 0], [40, 8], b_rank)])),
                }
            )
        }
    )


def test_a_plan_keyed_by_tables_follows_them_to_the_models_module():
    model = _model()
    aligned = align_to_model(_plan(path=""), model)
    assert list(aligned.plan) == ["sparse"]
    check_plan(aligned, embedding_tables(model), world_size=2)


@pytest.mark.parametrize(
    "plan_kwargs,world,match",
    [
        ({"b_type": "bogus_wise"}, 2, r"table 'b': sharding_type 'bogus_wise' is not one of"),
        ({"b_rank": 7}, 2, r"table 'b': placed on rank 7, but the world size is 2 \(a plan made for another"),
        ({"a_shards": (([0, 0], [60, 16], 0),)}, 2, r"table 'a': shards cover 960 of the table's 1,600"),
        (
            {"a_shards": (([50, 0], [60, 16], 0),)},
            2,
            r"table 'a': shard at offsets \[50, 0\] sizes \[60, 16\] does not",
        ),
    ],
)
def test_a_plan_that_does_not_fit_the_model_or_world_is_refused(plan_kwargs, world, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        check_plan(align_to_model(_plan(**plan_kwargs), model), embedding_tables(model), world)


def test_a_plan_for_other_tables_is_refused_naming_them():
    other = nn.Module()
    other.ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="z", embedding_dim=8, num_embeddings=10, feature_names=["fz"])],
        device=torch.device("meta"),
    )
    with pytest.raises(ValueError, match=r"tables \['a', 'b'\] matches no embedding collection of the model"):
        align_to_model(_plan(), other)
    tables = embedding_tables(_model())
    tables["sparse"] = {"a": (100, 16), "b": (40, 8), "c": (5, 8)}
    with pytest.raises(ValueError, match=r"no sharding for table\(s\) \['c'\]"):
        check_plan(align_to_model(_plan(), _model()), tables, 2)


def test_plan_file_with_a_missing_field_names_module_table_and_field(tmp_path):
    doc = plan_io.plan_to_dict(_plan())
    del doc["modules"][""]["b"]["compute_kernel"]
    with pytest.raises(ValueError, match=r'plan file: \$\.modules\[""\]\.b\.compute_kernel: missing'):
        plan_io.plan_from_dict(doc)


def test_plan_show_refuses_an_edited_plan_with_one_line(tmp_path):
    from tpurec.planner import report as plan_report

    report = plan_report.plan_tables(
        [plan_report.TableSpec("a", "fa", 1000, 16, 1.0)], "v6e-4", batch_size=8, optimizer="sgd", model="t"
    )
    report["plan"]["modules"][""]["a"]["sharding_type"] = "bogus_wise"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(report))
    p = subprocess.run(
        [sys.executable, "-m", "tpurec.cli", "plan", "show", str(path)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2
    assert f"{path}, module '<root>', table 'a': sharding_type 'bogus_wise' is not one of" in p.stderr
    assert "Traceback" not in p.stderr
