"""tpurec's partitioner and planner shards against TorchRec's own: same placements, same errors."""

import copy
import random
import re

import pytest
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.types import Perf, PlannerError, Shard, Storage

from tests.planner.conftest import ebc_for, pooling_of
from tpurec.planner import planners as P
from tpurec.planner.partitioner import TpuPartitioner
from tpurec.planner.planned_shard import PlannedShard
from tpurec.planner.topology import make_topology


def _space(model, slice_name, batch, hbm_cap=None):
    """The enumerated options of `model` on `slice_name` and the topology left for tables."""
    topo = make_topology(slice_name, hbm_cap=hbm_cap)
    cons = pooling_of(model)
    planner = P.make_planner(topo, batch_size=batch, constraints=cons, optimizer="rowwise_adagrad")
    ebc, sharders = ebc_for(model), P.planning_sharders()
    constraint = planner._storage_reservation.reserve(
        topology=topo, batch_size=batch, module=ebc, sharders=sharders, constraints=cons
    )
    by_table = {}
    for o in planner._enumerator.enumerate(ebc, sharders):
        by_table.setdefault(o.fqn, []).append(o)
    return by_table, constraint


def _placed(partitioner, proposal, constraint):
    """Shard ranks after `partitioner` placed a copy of `proposal`, or the error's message (without
    the options' object addresses, and the group's param_count: TorchRec's counts the module's
    options of every kind, tpurec's those it left to TorchRec)."""
    proposal = copy.deepcopy(proposal)
    try:
        partitioner.partition(proposal, constraint)
    except PlannerError as e:
        return re.sub(r"param_count=-?\d+", "", re.sub(r"0x[0-9a-f]+", "", str(e)))
    return [(o.fqn, o.sharding_type, [s.rank for s in o.shards]) for o in proposal]


@pytest.mark.parametrize(
    "model,slice_name,hbm_cap",
    [
        ("dlrm-tiny", "v5p-16", None),  # 2 hosts: table-wise, row-wise and TWRW options (co-host placement)
        ("mlperf-dcnv2", "v5p-32", None),
        ("mlperf-dcnv2", "v5p-8", 60 * 2**30),  # tight: about half the proposals do not fit
    ],
)
def test_partitioner_places_every_shard_where_torchrec_does(model, slice_name, hbm_cap):
    by_table, constraint = _space(model, slice_name, batch=512, hbm_cap=hbm_cap)
    kinds = {o.sharding_type for opts in by_table.values() for o in opts}
    assert {"row_wise", "table_wise"} <= kinds
    rng = random.Random(0)
    outcomes = []
    for _ in range(12):  # random mixes of uniform (row-wise) and per-device options, in random order
        proposal = [rng.choice(opts) for opts in by_table.values()]
        rng.shuffle(proposal)
        theirs = _placed(GreedyPerfPartitioner(), proposal, constraint)
        assert _placed(TpuPartitioner(), proposal, constraint) == theirs
        outcomes.append(type(theirs))
    if hbm_cap is not None:
        assert str in outcomes and list in outcomes  # both the refusal and the placement were compared


def test_uniform_shard_that_does_not_fit_is_refused_as_torchrec_refuses_it():
    by_table, constraint = _space("mlperf-dcnv2", "v5p-8", batch=512, hbm_cap=2**30)
    row_wise = [next(o for o in opts if o.sharding_type == "row_wise") for opts in by_table.values()]
    theirs = _placed(GreedyPerfPartitioner(), row_wise, constraint)
    assert isinstance(theirs, str) and "does not fit on any rank" in theirs
    assert _placed(TpuPartitioner(), row_wise, constraint) == theirs


def _shard(rank=3):
    return dict(
        size=[100, 64],
        offset=[200, 0],
        storage=Storage(hbm=1234, ddr=5, ssd=0),
        perf=Perf(fwd_compute=0.5, fwd_comms=0.25, bwd_compute=1.0, bwd_comms=0.125, input_dist_comms=0.1),
        rank=rank,
    )


def test_planned_shard_is_a_shard_that_copies_and_hashes_alike():
    planned, stock = PlannedShard(**_shard()), Shard(**_shard())
    assert isinstance(planned, Shard)
    assert hash(planned) == hash(stock)
    assert planned == stock and stock == planned
    assert planned != Shard(**_shard(rank=4))
    assert repr(planned) == repr(stock)
    for none in ("storage", "perf", "rank"):
        assert hash(PlannedShard(**{**_shard(), none: None})) == hash(Shard(**{**_shard(), none: None}))
    twin = copy.deepcopy(planned)
    assert type(twin) is PlannedShard and twin == planned
    twin.size[0] = 7
    twin.storage.hbm = 0
    twin.perf.fwd_compute = 9.0
    assert planned == stock  # nothing shared with the copy


def test_planner_enumerates_planned_shards():
    by_table, _ = _space("dlrm-tiny", "v5p-8", batch=64)
    assert all(type(s) is PlannedShard for opts in by_table.values() for o in opts for s in o.shards)
