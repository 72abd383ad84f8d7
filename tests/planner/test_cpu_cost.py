"""The CPU cost model (tpurec/planner/cpu_cost.py): its terms in shard_cost and the whole-step sum,
with round constants so every figure is worked out by hand."""

import pytest

from tpurec.planner import cpu_cost
from tpurec.planner.estimators import shard_cost
from tpurec.planner.topology import cpu_spec

# 1 us per id + 0.1 us per float of the row; 1 ms per collective; 1e9 bytes/s all-to-all, a quarter
# and a half of that for reduce-scatter and all-gather.
COSTS = cpu_cost.CpuCosts(
    kernel_fixed_ms=2.0,
    per_id_us=1.0,
    per_id_float_us=0.1,
    collective_latency_ms=1.0,
    gloo_bytes_per_s=1e9,
    reduce_scatter_bytes_per_s=0.25e9,
    all_gather_bytes_per_s=0.5e9,
    group_fixed_ms=3.0,
    step_fixed_ms=10.0,
    host_cores=2,
)


def cpu_cost_of(sharding="table_wise", cols=16, num_shards=1, costs=COSTS):
    return shard_cost(
        sharding_type=sharding,
        rows=1000,
        cols=cols,
        pooling_factor=1.0,
        batch_per_device=500,
        world_size=2,
        num_shards=num_shards,
        spec=cpu_spec(2, cpu_costs=costs),
        optimizer="rowwise_adagrad",
    )


def test_compute_is_measured_cost_per_id_and_per_float():
    c = cpu_cost_of()
    # global batch 1000 samples x 1 id = 1000 ids, each (1 + 0.1 * 16) us = 2.6 ms in all
    assert c.lookup_ms + c.update_ms == pytest.approx(2.6)
    # half the width: 1000 * (1 + 0.8) us
    half = cpu_cost_of(cols=8)
    assert half.lookup_ms + half.update_ms == pytest.approx(1.8)
    # a row-wise shard of 2 serves half the ids
    rw = cpu_cost_of("row_wise", num_shards=2)
    assert rw.lookup_ms + rw.update_ms == pytest.approx(1.3)


def test_comm_is_gloo_bytes_without_per_shard_latency():
    c = cpu_cost_of()
    # pooled rows out: 1000 samples x 16 floats x 4 bytes = 64,000 bytes, half leaves the rank: 32 us
    assert c.output_comm_ms == pytest.approx(0.032)
    assert c.grad_comm_ms == pytest.approx(0.032)
    # ids in: 1000 int32 ids + 1000 int32 lengths = 8,000 bytes, half of it sent: 4 us
    assert c.input_comm_ms == pytest.approx(0.004)


def test_row_wise_output_is_priced_as_reduce_scatter_and_its_gradient_as_all_gather():
    rw = cpu_cost_of("row_wise", num_shards=2)
    # the same 64,000 pooled bytes, half of them leave the rank: at 0.25 GB/s out, 0.5 GB/s back
    assert rw.output_comm_ms == pytest.approx(0.128)
    assert rw.grad_comm_ms == pytest.approx(0.064)
    # table-row-wise: reduce-scatter / all-gather inside its 2-rank group, then an all-to-all of its half
    twrw = cpu_cost_of("table_row_wise", num_shards=2)
    assert twrw.output_comm_ms == pytest.approx(0.128 + 0.016)
    assert twrw.grad_comm_ms == pytest.approx(0.064 + 0.016)
    # column-wise stays an all-to-all both ways
    cw = cpu_cost_of("column_wise", cols=8)
    assert cw.output_comm_ms == cw.grad_comm_ms == pytest.approx(0.016)


def test_tpu_prices_every_collective_kind_alike():
    from tpurec.planner.topology import make_topology

    spec = make_topology("v5p-8").spec
    kw = dict(rows=1000, cols=16, pooling_factor=1.0, batch_per_device=500, world_size=4, spec=spec)
    rw = shard_cost(sharding_type="row_wise", num_shards=4, optimizer="sgd", **kw)
    tw = shard_cost(sharding_type="table_wise", num_shards=1, optimizer="sgd", **kw)
    assert rw.output_comm_ms == rw.grad_comm_ms == pytest.approx(tw.output_comm_ms)


def test_cpu_model_differs_from_the_nominal_bandwidth_one():
    nominal = cpu_cost_of(costs=None)
    # 50 GB/s * 0.3 gathering 64-byte rows: 1000 ids take a few microseconds, far below the measured 2.6 ms
    assert nominal.lookup_ms + nominal.update_ms < 0.1


def _report(shards_by_table: dict, device_ms: list[float]) -> dict:
    """A build_report-shaped document: {table: (sharding_type, [ranks])} and each rank's shard time."""
    return {
        "world_size": len(device_ms),
        "tables": [
            {"name": n, "sharding_type": st, "shards": [{"rank": r} for r in ranks]}
            for n, (st, ranks) in shards_by_table.items()
        ],
        "devices": [{"estimated_time_ms": t} for t in device_ms],
    }


def test_step_is_busiest_rank_with_every_ranks_fixed_work_plus_latency():
    report = _report({"a": ("table_wise", [0]), "b": ("table_wise", [1]), "c": ("row_wise", [0, 1])}, [4.0, 1.0])
    s = cpu_cost.step_ms(report, COSTS)
    assert s["groups"] == ["row_wise", "table_wise"]
    assert s["kernels_per_rank"] == [2, 2]
    # embedding work: rank 0 4 + 2 kernels x 2 ms = 8, rank 1 1 + 4 = 5
    assert s["embedding_ms_per_rank"] == pytest.approx([8.0, 5.0])
    # every rank adds 10 ms per step + 2 groups x 3 ms: 24 and 21; the busiest (24) beats the
    # total over 2 cores (22.5); then 2 groups x 4 collectives + 1 shared = 9 x 1 ms of latency
    assert s["step_ms"] == pytest.approx(24 + 9)


def test_ranks_sharing_one_core_add_up():
    one_core = cpu_cost.CpuCosts(**{**COSTS.__dict__, "host_cores": 1})
    report = _report({"a": ("table_wise", [0]), "b": ("table_wise", [1])}, [4.0, 4.0])
    # each rank 10 + 3 + 4 + 2 = 19 ms; on one core the two take 38 ms, on two 19 ms; + 5 ms latency
    assert cpu_cost.step_ms(report, one_core)["step_ms"] == pytest.approx(38.0 + 5)
    assert cpu_cost.step_ms(report, COSTS)["step_ms"] == pytest.approx(19.0 + 5)


def test_imbalance_is_hidden_by_the_other_ranks_fixed_work_while_cores_are_short():
    # all embedding work on rank 0 (one kernel) vs split (two kernels), at 1.5 cores for 2 ranks
    costs = cpu_cost.CpuCosts(**{**COSTS.__dict__, "host_cores": 1.5})
    one = cpu_cost.step_ms(_report({"a": ("table_wise", [0]), "b": ("table_wise", [0])}, [4.0, 0.0]), costs)
    split = cpu_cost.step_ms(_report({"a": ("table_wise", [0]), "b": ("table_wise", [1])}, [2.0, 2.0]), costs)
    # one: ranks 13 + 6 = 19 and 13; total 32 / 1.5 = 21.33 beats the busiest 19
    assert one["step_ms"] - 5 == pytest.approx(32 / 1.5)
    # split: ranks 17 and 17; 34 / 1.5 = 22.67: one kernel call fewer wins, imbalance costs nothing
    assert split["step_ms"] - 5 == pytest.approx(34 / 1.5)
    assert one["step_ms"] < split["step_ms"]


def test_a_rank_without_shards_pays_no_kernel():
    report = _report({"a": ("table_wise", [0]), "b": ("table_wise", [0])}, [4.0, 0.0])
    s = cpu_cost.step_ms(report, COSTS)
    assert s["kernels_per_rank"] == [1, 0]
    assert s["busiest_rank_ms"] == pytest.approx(6.0)
