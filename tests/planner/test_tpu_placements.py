"""Every shard of a TPU plan is placed on its rank's tpu:0 (#36 item 1).

TorchTPU numbers each process's own device 0 ("device_ids=[0] which names this process's own
device", docs/tpu.md); TorchRec's planner numbers devices by local rank, as for CUDA, and torch's
ShardedTensor refuses a local shard whose device differs from its placement.
"""

from tests.planner.conftest import ebc_for
from tpurec.planner import planners as P
from tpurec.planner.plan_check import module_plans, place_on_own_device
from tpurec.planner.topology import make_topology


def _placements(plan) -> list[str]:
    return [
        str(shard.placement)
        for module_plan in module_plans(plan).values()
        for ps in module_plan.values()
        for shard in getattr(ps.sharding_spec, "shards", ())
    ]


def test_a_two_host_plan_places_every_shard_on_tpu_0():
    plan = P.plan(ebc_for("dlrm-tiny"), make_topology("v5p-16"), batch_size=64, optimizer="rowwise_adagrad")
    placements = _placements(plan)
    ranks = {p.split("/")[0] for p in placements}
    assert len(ranks) > 4  # shards on ranks of both hosts, local ranks 1-3 among them
    assert {p.split("/")[1] for p in placements} == {"tpu:0"}


def test_a_plan_is_moved_to_each_ranks_own_device():
    plan = P.plan(ebc_for("dlrm-tiny"), make_topology("v5p-16"), batch_size=64, optimizer="rowwise_adagrad")
    place_on_own_device(plan, "cpu")
    assert {p.split("/")[1] for p in _placements(plan)} == {"cpu"}
    place_on_own_device(plan, "tpu")
    assert {p.split("/")[1] for p in _placements(plan)} == {"tpu:0"}
