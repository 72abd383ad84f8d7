"""Hand-computed storage and time for small shards (numbers worked out in the comments)."""

import pytest

from tpurec.planner.estimators import _collective_ms, shard_cost
from tpurec.planner.topology import parse_slice

V6E4 = parse_slice("v6e-4")  # 2 SparseCores, 1638 GB/s HBM, ICI 800 GB/s per chip, 1 device per chip


def cost(optimizer="sgd", sharding="table_wise", rows=1000, cols=16, num_shards=1, spec=V6E4, pf=1.0):
    return shard_cost(
        sharding_type=sharding,
        rows=rows,
        cols=cols,
        pooling_factor=pf,
        batch_per_device=8,
        world_size=spec.world_size,
        num_shards=num_shards,
        spec=spec,
        optimizer=optimizer,
    )


def test_storage_hand_computed_table_wise():
    c = cost()
    # 1000 rows padded to a multiple of 2 SparseCores * 8 = 1008; 1008 * 16 dims * 4 bytes
    assert c.weights == 64512
    assert c.optimizer == 0
    # global batch 8*4 = 32 samples -> 16 per SparseCore, 1 id each -> limit 16 ids per partition.
    # per SC: row pointers max(2, 8) * 4 = 32 bytes; COO 16 * 2 partitions * 12 bytes = 384 -> 416; x2 SCs
    assert c.buffers == 832
    # pooled output for 32 samples x 16 dims x 4 bytes, and its gradient
    assert c.activations == 4096
    # TorchTPU's update returns a new table (and state; none for SGD) beside the live one
    assert c.transient == 64512
    assert c.bytes == 2 * 64512 + 832 + 4096


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
def test_transient_is_weights_and_state_on_tpu_and_zero_on_cpu(opt):
    from tpurec.planner.topology import cpu_spec

    c = cost(opt)
    assert c.transient == c.weights + c.optimizer > 0
    on_cpu = cost(opt, spec=cpu_spec(4, num_sc_per_device=2))
    assert on_cpu.transient == 0  # the CPU reference updates in place
    assert on_cpu.bytes == on_cpu.weights + on_cpu.optimizer + on_cpu.buffers + on_cpu.activations


@pytest.mark.parametrize(
    "opt,state", [("sgd", 0), ("rowwise_adagrad", 1008 * 4), ("adagrad", 1008 * 16 * 4), ("adam", 2 * 1008 * 16 * 4)]
)
def test_optimizer_state_on_padded_rows(opt, state):
    assert cost(opt).optimizer == state


def test_row_wise_shard_pads_its_local_rows():
    c = cost(sharding="row_wise", rows=250, num_shards=4)
    assert c.weights == 256 * 16 * 4  # 250 local rows -> 256
    assert c.buffers == 832  # id limit is the worst case: all ids may land in one shard


def test_time_hand_computed_table_wise():
    c = cost()
    sc_bw = 1638e9 * 0.3  # bytes/s, the stated SparseCore gather assumption
    ids = 32.0  # global batch 32, pooling factor 1
    assert c.lookup_ms == pytest.approx(ids * 64 / sc_bw * 1e3)
    assert c.update_ms == pytest.approx(ids * 3 * 64 / sc_bw * 1e3)  # sgd: grad read, row read + write
    ici = 800e9 * 0.5  # per device, all-to-all efficiency 0.5
    assert c.input_comm_ms == pytest.approx((32 * 4 + 32 * 4) * 3 / 4 / ici * 1e3)  # ids + lengths, 3/4 leave
    assert c.output_comm_ms == pytest.approx(32 * 16 * 4 * 3 / 4 / ici * 1e3)
    assert c.grad_comm_ms == c.output_comm_ms
    assert c.time_ms == pytest.approx(c.lookup_ms + c.update_ms + c.input_comm_ms + 2 * c.output_comm_ms)


def test_update_time_counts_optimizer_state():
    sc_bw = 1638e9 * 0.3
    assert cost("adam").update_ms == pytest.approx(32 * (3 * 64 + 2 * 2 * 16 * 4) / sc_bw * 1e3)


def test_row_wise_splits_lookups_not_pooled_output():
    tw, rw = cost(), cost(sharding="row_wise", rows=250, num_shards=4)
    assert rw.lookup_ms == pytest.approx(tw.lookup_ms / 4)
    assert rw.output_comm_ms == pytest.approx(tw.output_comm_ms)


def test_dcn_share_across_slices():
    two = parse_slice("2xv6e-4")  # 8 devices, 4 per host and per slice
    ms = _collective_ms(8000, 8, two, spans_slices=True)
    out = 8000 * 7 / 8
    assert ms == pytest.approx((out / 2 / (800e9 * 0.5) + out / 2 / (25e9 / 4)) * 1e3)
    assert _collective_ms(8000, 8, two, spans_slices=False) == pytest.approx(out / (800e9 * 0.5) * 1e3)
    assert _collective_ms(8000, 1, two, True) == 0.0


def test_sparsecore_count_changes_padding():
    v5p = parse_slice("v5p-8")  # 4 SparseCores -> pad to 32
    assert cost(spec=v5p, rows=1000).weights == 1024 * 16 * 4


def test_table_row_wise_comm_is_host_reduce_scatter_then_all_to_all():
    two = parse_slice("2xv6e-4")  # 8 devices in 2 slices of one host each
    c = cost(sharding="table_row_wise", rows=250, num_shards=4, spec=two)
    pooled = 8 * 8 * 16 * 4  # global batch 64 x 16 dims x 4 bytes
    expect = _collective_ms(pooled, 4, two, False) + _collective_ms(pooled / 4, 8, two, True)
    assert c.output_comm_ms == pytest.approx(expect)
    ici, dcn = 800e9 * 0.5, 25e9 / 4
    assert expect == pytest.approx(
        (pooled * 3 / 4 / ici + pooled / 4 * 7 / 8 / 2 / ici + pooled / 4 * 7 / 8 / 2 / dcn) * 1e3
    )


def test_sequence_tables_pay_for_one_output_row_per_id():
    spec = parse_slice("v5p-8")
    common = dict(rows=10_000, cols=64, batch_per_device=8, world_size=spec.world_size, spec=spec, optimizer="sgd")
    for st, shards in (("table_wise", 1), ("row_wise", 4)):
        pooled = shard_cost(sharding_type=st, pooling_factor=20, num_shards=shards, **common)
        seq = shard_cost(sharding_type=st, pooling_factor=20, num_shards=shards, pooled=False, **common)
        samples = 8 * spec.world_size
        assert pooled.activations == 2 * samples * 64 * 4  # one row per sample
        # one row per id, and a row shard returns only its own ids' rows
        assert seq.activations == 2 * samples * 20 * 64 * 4 / shards
        assert seq.output_comm_ms > pooled.output_comm_ms  # 20 ids per sample out, 5x even split over 4 shards
        # what the shard stores and looks up does not depend on pooling
        assert (seq.weights, seq.optimizer, seq.buffers, seq.lookup_ms) == (
            pooled.weights,
            pooled.optimizer,
            pooled.buffers,
            pooled.lookup_ms,
        )
