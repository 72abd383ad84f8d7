"""The TensorCore update's transient in the planner (v5e, v4): the new stack and state the update
program returns, and its work arrays, for the stack that needs the most, against XLA's own account of
the program (memory_analysis of tpu_bridge.tc_adagrad compiled on CPU) at the shapes the planner
assumes; and the plan report's reserved bytes carrying it (`tpurec plan`, `tpurec train`'s DMP)."""

from __future__ import annotations

import math

import pytest
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tests.planner.conftest import ebc_for
from tpurec.embedding.settings import FIRST_BATCH_HEADROOM_TENSORCORE
from tpurec.planner import planners as P
from tpurec.planner.topology import make_topology

# three tables of dim 20 (stored 24 wide): two in one stack under a 1 MiB cut, one alone
TABLES = [("a", 3_000, 20, 3.0), ("b", 2_000, 20, 10.0), ("c", 9_000, 20, 1.0)]
BATCH = 512


def _configs():
    return [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[n]) for n, r, d, _ in TABLES]


def _pooling():
    return P.pooling_constraints({n: pf for n, _, _, pf in TABLES})


def _xla_bytes(rows: int, width: int, features: int, slots: int, distinct: int) -> int:
    """XLA's bytes beside the live table for one row-wise Adagrad update: its outputs (the new table
    and accumulator) and its temporaries, compiled from shapes alone."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from tpurec.embedding.tensorcore import tpu_bridge

    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    batch = features * BATCH  # the op's device batch: every feature's samples
    csr = (S((8,), i32), S((slots,), i32), S((slots,), i32), S((slots,), f32))
    args = (*csr, S((rows, width), f32), S((rows,), f32), S((batch, width), f32), S((), f32), S((), f32))
    fn = jax.jit(tpu_bridge.tc_adagrad, static_argnums=(9, 10, 11, 12))
    m = fn.lower(*args, batch, 1, 1, distinct).compile().memory_analysis()
    return int(m.output_size_in_bytes + m.temp_size_in_bytes)


def test_v5e_reserves_the_largest_stack_update_as_xla_compiles_it(monkeypatch):
    import tpurec.embedding.settings as settings

    monkeypatch.setattr(settings, "TENSORCORE_MAX_STACK_BYTES", 1 << 20)  # a and b in one stack, c alone
    got = P.stack_transient(
        "v5e", ebc_for(_configs()), batch_size=BATCH, constraints=_pooling(), optimizer="rowwise_adagrad"
    )
    # independently: each stack's rows padded to 8, its ids plus the first batch's headroom as slots,
    # at most that many distinct rows (and no more than it has)
    ab_rows, c_rows = 3_000 + 2_000, 9_000
    ab_slots = math.ceil(BATCH * 13.0 * (1 + FIRST_BATCH_HEADROOM_TENSORCORE))
    c_slots = math.ceil(BATCH * 1.0 * (1 + FIRST_BATCH_HEADROOM_TENSORCORE))
    ab = _xla_bytes(ab_rows, 24, 2, ab_slots, min(ab_slots, ab_rows))
    c = _xla_bytes(c_rows, 24, 1, c_slots, c_slots)
    assert ab > c  # the stack with the most ids needs the most here, though c has more rows
    assert got == pytest.approx(ab, rel=0.02)


def test_no_batch_counts_the_copy_alone_and_sparsecore_chips_count_per_shard():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=2_000_000, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    # each 1.02 GB table a stack of its own (two exceed the 1 GiB cut): one table's rows, SGD's no state
    assert P.stack_transient("v5e", ebc_for(tables)) == 2_000_000 * 128 * 4
    assert P.stack_transient("v5e", ebc_for(tables), optimizer="rowwise_adagrad") == 2_000_000 * (128 + 1) * 4
    assert P.stack_transient("v6e", ebc_for(tables), batch_size=BATCH) == 0


def test_plan_report_reserves_what_the_planner_reserved():
    """`tpurec plan`'s reserved bytes on a v5e are what the planner took from the device (its
    reservation's amount and the update's transient), and DMP's figure for `tpurec train` is the same."""
    from tpurec.data.catalog import TableSpec
    from tpurec.planner.report import plan_module
    from tpurec.sharding.dmp import planned_reserved_bytes

    topo = make_topology("v5e-1")
    ebc, pooling = ebc_for(_configs()), _pooling()
    tables = [TableSpec(n, n, r, d, pf) for n, r, d, pf in TABLES]
    report = plan_module(ebc, tables, "v5e-1", batch_size=BATCH, optimizer="rowwise_adagrad", constraints=pooling)
    cap = topo.spec.generation.hbm_bytes
    transient = P.stack_transient("v5e", ebc, batch_size=BATCH, constraints=pooling, optimizer="rowwise_adagrad")
    expected = P.TpuStorageReservation().amount(ebc, BATCH, cap) + transient
    assert transient > 0
    assert report["devices"][0]["reserved_bytes"] == report["meta"]["reserved_bytes"] == expected
    reservation = P.TpuStorageReservation()
    reservation.optimizer = "rowwise_adagrad"
    assert cap - reservation.reserve(topo, BATCH, ebc, [], pooling).devices[0].storage.hbm == expected
    plan = P.plan(ebc, topo, batch_size=BATCH, constraints=pooling, optimizer="rowwise_adagrad")
    # DMP reads the optimizer from the model (none set here: SGD's, no state): the row-wise state less
    sgd = P.stack_transient("v5e", ebc, batch_size=BATCH, constraints=pooling)
    assert planned_reserved_bytes(ebc, topo, BATCH, pooling, plan) == expected - transient + sgd
