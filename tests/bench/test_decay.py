"""`tpurec bench kernels --weight-decay`: the decayed step against its undecayed twin."""

import pytest

from tpurec.bench import decay, equal_work
from tpurec.bench.matrix import QUICK_SHAPES, make_batches


def test_a_cell_times_equal_work_and_reports_the_cost():
    cell = decay.run_cell("rowwise_adagrad_l2", 20, "small", QUICK_SHAPES["small"], rounds_=2, nbatches=1, order_seed=0)
    assert cell["equal_work"]["rows_updated"] > 0
    assert cell["cost_ratio"] > 0 and cell["worst_round"] >= cell["cost_ratio"] >= cell["best_round"]
    assert cell["decayed_step_ms"] > 0 and cell["undecayed_step_ms"] > 0


def test_twins_that_update_other_rows_are_refused():
    shape = QUICK_SHAPES["small"]
    decayed, plain = decay._twins(shape, "adam_decoupled")
    (kjt,) = make_batches(shape, 1, 1, 0)
    upstream = equal_work.upstream_gradient(shape.batch, shape.tables * shape.dim, 0)
    with pytest.raises(equal_work.UnequalWork, match="different tables"):
        plain.step(kjt, upstream)  # the undecayed twin moved ahead: the tables differ before the check
        decay.check_equal_work(decayed, plain, kjt, upstream)
