"""What the planner tests share: `run_plan` runs `tpurec plan ARGV` in this process, and a plan of two
tables on a v6e-4 (`TABLES`, `two_table_plan`): table a table-wise on rank 0, table b row-wise."""

from __future__ import annotations

from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardingPlan,
)

from tpurec.data.catalog import TableSpec
from tpurec.planner.topology import make_topology

KERNEL = "customized_kernel"
TABLES = [TableSpec("a", "fa", 1000, 16, 1.0), TableSpec("b", "fb", 400, 16, 2.0)]


def two_table_plan(b_ranks=(0, 1, 2, 3)):
    make_topology("v6e-4")  # names the tpu backend so placements parse
    a = EnumerableShardingSpec([ShardMetadata([0, 0], [1000, 16], "rank:0/tpu:0")])
    b = EnumerableShardingSpec(
        [ShardMetadata([100 * i, 0], [100, 16], f"rank:{r}/tpu:{r}") for i, r in enumerate(b_ranks)]
    )
    return ShardingPlan(
        {
            "": EmbeddingModuleShardingPlan(
                {
                    "a": ParameterSharding("table_wise", KERNEL, [0], a),
                    "b": ParameterSharding("row_wise", KERNEL, list(b_ranks), b),
                }
            )
        }
    )


def run_plan(*argv):
    """`tpurec plan ARGV` in this process, through the command's entry point (which prints user errors)."""
    from tpurec.cli import main

    return main(["plan", *argv])
