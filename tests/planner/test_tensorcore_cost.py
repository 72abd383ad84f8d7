"""The planner's step time on TensorCore-only TPUs (v5e, v4): the kernel's per-id costs measured on a
v5e chip (tensorcore_cost), not the SparseCore's share of HBM bandwidth; SparseCore chips unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from tpurec.data.catalog import TableSpec
from tpurec.planner import tensorcore_cost as tc
from tpurec.planner.estimators import shard_cost
from tpurec.planner.report import plan_tables
from tpurec.planner.report_text import format_text
from tpurec.planner.topology import parse_slice


def _cost(topology: str = "v5e-1", rows: int = 1_000_000, cols: int = 128, optimizer: str = "rowwise_adagrad", **kw):
    spec = parse_slice(topology)
    args: dict[str, Any] = dict(
        sharding_type="table_wise", pooling_factor=8.0, batch_per_device=16384 // spec.world_size
    )
    args |= kw
    return shard_cost(
        rows=rows, cols=cols, world_size=spec.world_size, num_shards=1, spec=spec, optimizer=optimizer, **args
    )


def test_the_measured_cells_come_back_as_measured():
    # `tpurec bench tpu-kernels` and probe 15 on v5e, session 41: 131,072 ids, 1M and 4M x 128 f32
    assert _cost().lookup_ms == pytest.approx(0.989)  # four output copies, the gains inside
    assert _cost().update_ms == pytest.approx(7.035)
    assert _cost(rows=4_000_000).update_ms == pytest.approx(12.761)
    assert _cost(optimizer="sgd").update_ms == pytest.approx(5.191)
    assert _cost(optimizer="sgd", rows=4_000_000).update_ms == pytest.approx(9.808)
    # the same ids over four devices' batches: the global batch is what a table-wise shard serves
    assert _cost("v5e-4").lookup_ms == pytest.approx(0.989)


def test_the_update_grows_with_the_table_and_the_lookup_does_not():
    small, large = _cost(rows=100_000), _cost(rows=8_000_000)
    assert small.lookup_ms == large.lookup_ms
    a, b = tc.UPDATE_NS_PER_ID["rowwise_adagrad"]
    assert small.update_ms == pytest.approx(131072 * (a + 0.1 * b) / 1e6)
    assert large.update_ms == pytest.approx(131072 * (a + 8 * b) / 1e6) and large.update_ms > 2 * small.update_ms


def test_the_pooling_follows_the_output_copies_that_fit_vmem():
    # one feature: 4 copies; three: 2 (priced as one, with the gains inside); eight: XLA's segment sum
    one = _cost()
    three = _cost(num_features=3, pooling_factor=24.0)
    eight = _cost(num_features=8, pooling_factor=64.0)
    assert three.lookup_ms == pytest.approx(3 * 1.113)
    assert eight.lookup_ms == pytest.approx(8 * 1.716)
    assert one.lookup_ms < three.lookup_ms / 3 < eight.lookup_ms / 8
    # a sequence table has no pooling: the decode and gather alone
    assert _cost(pooled=False).lookup_ms == pytest.approx(0.725)


def test_narrow_rows_cost_more_than_a_128_lane_row_and_wide_ones_proportionally():
    assert _cost(cols=16).lookup_ms == pytest.approx(0.989 * 1.470 / 1.036)
    assert _cost(cols=16, optimizer="sgd").update_ms == pytest.approx(5.191 * 17.219 / 5.191)
    assert _cost(cols=256).lookup_ms == pytest.approx(2 * 0.989)
    assert _cost(cols=256).update_ms == pytest.approx(2 * 7.035)


def test_optimizers_not_measured_scale_row_wise_adagrads_figure_by_their_bytes():
    # Adam: two 128-wide f32 states an id reads and writes against row-wise Adagrad's one float
    want = 7.035 * (3 * 512 + 2 * 1024) / (3 * 512 + 2 * 4)
    assert _cost(optimizer="adam").update_ms == pytest.approx(want)


def test_v4_is_scaled_by_its_hbm_bandwidth_and_its_vmem_keeps_xlas_pooling():
    c = _cost("v4-8", batch_per_device=4096)  # 4 devices, the same 16,384-sample global batch
    # 16 MiB of VMEM a core: not one output copy of 16,384 x 128 fits, so XLA's segment sum
    assert c.lookup_ms == pytest.approx(1.716 * 819 / 1200)
    assert c.update_ms == pytest.approx(7.035 * 819 / 1200)


def test_sparsecore_chips_keep_the_bandwidth_model():
    c = _cost("v5p-8")  # 4 devices, the same global batch
    sc_bw = 2765e9 * 0.3
    assert c.lookup_ms == pytest.approx(131072 * 512 / sc_bw * 1e3)


def test_the_report_says_how_it_priced_the_kernel():
    t = TableSpec("a", "a_f0", 1_000_000, 128, 8.0)
    v5e = plan_tables([t], "v5e-1", batch_size=16384, optimizer="rowwise_adagrad")
    assert v5e["assumptions"]["kernel_time"] == "tensorcore-measured"
    assert v5e["estimated_step_time_ms"] >= 0.989 + 7.035
    assert "TensorCore kernel at its per-id costs measured on v5e" in format_text(v5e)
    v5p = plan_tables([t], "v5p-8", batch_size=2048, optimizer="rowwise_adagrad")
    assert v5p["assumptions"]["kernel_time"] == "sparsecore-bandwidth"
    assert "SparseCore gather 30% of HBM bw" in format_text(v5p)
