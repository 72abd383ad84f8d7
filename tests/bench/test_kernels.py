"""`tpurec bench kernels`: the cell matrix (tiny shapes), its equal-work refusal, and --sequence."""

import dataclasses
import json
import math
import statistics

import pytest

from tpurec.bench import contenders, equal_work, matrix
from tpurec.bench import kernels as bench_kernels

TINY = {"small": matrix.Shape(tables=3, rows=200, dim=8, batch=16, zipf=False)}


def test_full_matrix_enumerates_at_least_24_cells_with_sgd_and_adagrad():
    cells = matrix.cells()
    assert len(cells) == len(set(cells)) == 48  # 4 optimizers x 4 poolings x 3 shapes
    assert {o for o, _, _ in cells} == {"sgd", "adagrad", "rowwise_adagrad", "adam"}
    assert {p for _, p, _ in cells} == {1, 20, 100, "var"}
    assert {s for _, _, s in cells} == set(matrix.SHAPES) == {"small", "large", "hot"}
    assert matrix.SHAPES["small"].dim == 16 and matrix.SHAPES["large"].dim == 128 and matrix.SHAPES["hot"].tables == 1
    assert contenders.peer_of("sgd") == "fbgemm" and contenders.peer_of("adam") == "torch-sparse-adam"


def test_quick_matrix_reports_every_field_and_the_summary():
    r = bench_kernels.run(quick=True, matrix=True, shapes=TINY, poolings=("var",), rounds=3)
    assert r["refused"] == [] and len(r["cells"]) == 4
    for c in r["cells"]:
        for key in ("optimizer", "pooling", "shape", "peer", "ratio_vs_fbgemm", "min", "max", "load_average_1min"):
            assert key in c, key
        assert len(c["round_ratios"]) == 3 and c["min"] <= c["ratio_vs_fbgemm"] <= c["max"]
        assert c["ratio_vs_fbgemm"] == pytest.approx(statistics.median(c["round_ratios"]), rel=1e-3)
        assert c["tpurec_step_ms"] > 0 and c["peer_step_ms"] > 0 and len(c["first_in_round"]) == 3
        assert c["equal_work"]["max_abs_diff_tables"] <= equal_work.ATOL
    medians = [c["ratio_vs_fbgemm"] for c in r["cells"]]
    assert r["worst_ratio_vs_fbgemm"] == min(medians)
    assert r["worst_round_ratio_vs_fbgemm"] == min(c["min"] for c in r["cells"])
    geo = math.exp(sum(map(math.log, medians)) / len(medians))
    assert r["geomean_ratio_vs_fbgemm"] == pytest.approx(geo, rel=1e-3)
    assert len(r["load_average"]["start"]) == 3 and r["threads"] >= 1 and r["torch"] and r["fbgemm_gpu"]
    assert set(r["by_optimizer"]) == set(contenders.OPTIMIZERS)
    json.dumps(r)  # one JSON document
    text = bench_kernels.format_table(r)
    assert "worst cell" in text and "geomean" in text and "load average" in text
    md = matrix.format_markdown(r)
    assert md.count("| small |") == 4 and "worst cell" in md


def test_variable_length_bags_include_empty_ones_and_vary():
    (kjt,) = matrix.make_batches(TINY["small"], "var", 1, seed=0)
    lengths = kjt.lengths()
    assert lengths.min() == 0 and lengths.max() <= matrix.VAR_MAX_LEN and len(set(lengths.tolist())) > 5


def _perturbed(what):
    def build(num_tables, rows, dim, optimizer):
        ours, theirs = contenders.build(num_tables, rows, dim, optimizer)
        if what == "table":
            theirs.tables()[1][7].add_(1e-3)  # one row of one table starts elsewhere
        else:  # the peer takes its step with the upstream gradient doubled: same ids, other update
            step = theirs.step
            theirs = dataclasses.replace(theirs, step=lambda kjt, up: step(kjt, up * 2))
        return ours, theirs

    return build


@pytest.mark.parametrize("what", ["table", "update"])
def test_a_cell_whose_work_differs_is_refused_and_not_summarized(what):
    r = matrix.run_matrix(
        shapes=TINY, optimizers=("sgd",), poolings=(20,), rounds_=1, nbatches=1, build=_perturbed(what)
    )
    assert r["cells"] == [] and len(r["refused"]) == 1
    assert r["refused"][0]["optimizer"] == "sgd" and "differ" in r["refused"][0]["reason"]
    assert "worst_ratio_vs_fbgemm" not in r and "geomean_ratio_vs_fbgemm" not in r
    assert "REFUSED" in matrix.format_matrix(r)


def test_the_unperturbed_cell_passes_the_same_check():
    r = matrix.run_matrix(shapes=TINY, optimizers=("sgd",), poolings=(20,), rounds_=1, nbatches=1)
    assert r["refused"] == [] and len(r["cells"]) == 1
    # sub-millisecond steps: a timed run repeats them until it lasts about MIN_RUN_SECONDS
    assert r["cells"][0]["steps_per_run"] > 1


def test_the_order_of_contenders_varies_between_rounds():
    r = matrix.run_matrix(
        shapes=TINY, optimizers=("rowwise_adagrad",), poolings=(1,), rounds_=8, nbatches=1, order_seed=0
    )
    (cell,) = r["cells"]
    assert set(cell["first_in_round"]) == {"tpurec", "fbgemm"} and r["order_seed"] == 0


def test_every_run_draws_a_fresh_order_seed_and_reports_it():
    seeds = {matrix.run_matrix(shapes=TINY, optimizers=("sgd",), poolings=(1,), rounds_=1, nbatches=1)["order_seed"]
             for _ in range(3)}  # fmt: skip
    assert len(seeds) == 3  # a fixed seed would give every run the same sequence of orders


def test_adam_cell_names_its_peer_and_does_the_same_lazy_update():
    r = matrix.run_matrix(shapes=TINY, optimizers=("adam",), poolings=(20,), rounds_=1, nbatches=1)
    (cell,) = r["cells"]
    assert cell["peer"] == "torch-sparse-adam" and "SparseAdam" in r["peers"]["torch-sparse-adam"]


def test_bench_kernels_sequence_checks_equal_work_and_reports_every_round():
    import torch.distributed as dist

    from tpurec.bench.sequence import format_sequence, run_sequence

    r = run_sequence(quick=True, num_tables=2, rows=500, dim=16, users=8, seq_len=5)
    assert len(r["runs"]) == 2 and all(run["tpurec_ids_per_s"] > 0 for run in r["runs"])
    ratios = [run["ratio_vs_torchrec"] for run in r["runs"]]
    assert r["ratio_vs_torchrec"] == pytest.approx(statistics.median(ratios))
    assert r["min"] == min(ratios) and r["max"] == max(ratios)
    assert r["equal_work"]["max_abs_diff_tables"] <= equal_work.ATOL and "start" in r["load_average"]
    assert "worst round" in format_sequence(r)
    assert not dist.is_initialized()  # the one-rank group it needed is gone
